"""What a running job shows: its metrics as a dict and for Prometheus, a live line on the
terminal, and log records that say which job, execution and member they come from.

:class:`JobMetrics` is fed the job's progress events (the same dicts ``on_progress``
gets): members report their counters (events in and out, per vertex, with the watermark
each vertex has reached; late, skipped and dead-lettered events) twice a second, and the
supervisor reports executions, restores, snapshots and restarts. Where the event time is a
timestamp column, the members also report the newest event time each source has read, so
that the metrics say how far behind the wall clock the job is: ``source_lag_s`` and
``watermark_lag_s``. ``Job.metrics`` returns
:meth:`JobMetrics.as_dict`; ``Job.run(metrics_port=P)`` serves the same numbers for
Prometheus on ``http://127.0.0.1:P/metrics`` while the job runs (``prometheus-client``'s
server, on the driver), and ``Job.run(progress=True)`` draws them on one terminal line, with
a bar when the sources are bounded.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
from hdrh.histogram import HdrHistogram

from sparkjet.runtime.progress import ProgressLine, bar

#: The fields every sparkjet log record carries ("-" where they do not apply).
CONTEXT_FIELDS = ("job", "execution", "member")
LOG_FORMAT = ("%(asctime)s %(levelname)s %(name)s [job=%(job)s execution=%(execution)s "
              "member=%(member)s] %(message)s")


class ContextFilter(logging.Filter):
    """Adds ``job``, ``execution`` and ``member`` to every record passing through (those
    the record already has, from ``extra=``, win)."""

    def __init__(self, **context):
        super().__init__()
        self.context = {k: context.get(k, "-") for k in CONTEXT_FIELDS}

    def filter(self, record: logging.LogRecord) -> bool:
        for k, v in self.context.items():
            if not hasattr(record, k):
                setattr(record, k, v)
        return True


def log_to(stream, **context) -> logging.Handler:
    """Sends the ``sparkjet`` loggers' records (INFO and up) to ``stream`` in
    :data:`LOG_FORMAT`, tagged with ``context`` (a member's log; a Spark Python worker
    reused by the next task replaces the handler of the one before)."""
    logger = logging.getLogger("sparkjet")
    for old in [h for h in logger.handlers if getattr(h, "_sparkjet_member", False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(stream)
    handler._sparkjet_member = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(ContextFilter(**context))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


#: Per-vertex event times the members report: the watermark (event-time units) and, where
#: the event time is a timestamp, the watermark and the newest event read in ns since epoch.
_TIMES = ("watermark", "watermark_ns", "newest_event_ns")
_END_OF_TIME = 2**63 - 1   # sparkjet.runtime.watermarks.MAX_TIME (not imported: no runtime)


def add_vertex_counts(into: dict, vertices: dict) -> dict:
    """Adds per-vertex rows in and out (``{vertex: {"in": n, "out": n, ...}}``) of
    ``vertices`` into ``into``; returns ``into``."""
    for v, counts in vertices.items():
        total = into.setdefault(v, {"in": 0, "out": 0})
        total["in"] += counts.get("in", 0)
        total["out"] += counts.get("out", 0)
    return into


#: The latency fields of a member's metrics (each a :class:`LatencyHistogram`).
LATENCY_FIELDS = ("latencies_ns", "emit_latencies_ns")
#: Which output each latency field measures up to: committed (visible under
#: exactly-once) or emitted (handed to the sink).
LATENCY_OUTPUTS = {"latencies_ns": "committed", "emit_latencies_ns": "emitted"}
#: The percentiles of :meth:`LatencyHistogram.summary` (name, percentile), then ``max``.
SUMMARY_PERCENTILES = (("p50", 50.0), ("p99", 99.0), ("p99.9", 99.9), ("p99.99", 99.99))
#: Samples a batch gives at most: each stands for its share of the batch's rows.
SAMPLES_PER_BATCH = 16


def weighted_samples(n: int, limit: int = SAMPLES_PER_BATCH):
    """Which of ``n`` rows to sample and how many rows each stands for: rows ``0, step,
    2*step, ...`` with ``step = ceil(n / limit)``, each counting ``step`` rows (the last,
    what is left), so the counts add up to ``n``. A large batch (the rows that waited
    while the pipeline was slow) then weighs as many events as it holds: sampling a fixed
    number per batch would let the slow stretches count less than the fast ones, the
    coordinated-omission trap inside the runtime. Returns (indices, counts) as numpy arrays.

    >>> [a.tolist() for a in weighted_samples(10, 4)]
    [[0, 3, 6, 9], [3, 3, 3, 1]]
    """
    if n <= 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    step = -(-n // limit)
    index = np.arange(0, n, step, dtype=np.int64)
    counts = np.full(len(index), step, dtype=np.int64)
    counts[-1] = n - step * (len(index) - 1)
    return index, counts


class LatencyHistogram:
    """Latency samples in ns, kept as counts per value range (an HdrHistogram: two
    significant digits, so a percentile is within 1 % of the sample's; 0 ns to about 146
    years), not as a list that grows with the events: its size and its repr stay bounded.
    A negative latency (an event time ahead of this clock) counts as 0. Crosses process
    boundaries as :meth:`encode`'s text (JSON-safe) and pickles the same way."""

    _LOWEST, _HIGHEST, _DIGITS = 1, 2**62, 2

    def __init__(self):
        self._h = HdrHistogram(self._LOWEST, self._HIGHEST, self._DIGITS)

    def record(self, latencies_ns, counts=None) -> None:
        """Records each latency of ``latencies_ns`` once, or ``counts[i]`` times (a sample
        standing for that many events: see :func:`weighted_samples`)."""
        if counts is None:
            for v in latencies_ns:
                self._h.record_value(min(max(int(v), 0), self._HIGHEST))
            return
        for v, n in zip(latencies_ns, counts, strict=True):
            if n > 0:
                self._h.record_value(min(max(int(v), 0), self._HIGHEST), int(n))

    def add(self, other: LatencyHistogram) -> LatencyHistogram:
        """Adds ``other``'s counts into this one; returns this one."""
        if other.count:
            self._h.add(other._h)
        return self

    @property
    def count(self) -> int:
        return self._h.get_total_count()

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile in ns (NaN when empty)."""
        if not self.count:
            return float("nan")
        return float(self._h.get_value_at_percentile(q))

    @property
    def max(self) -> float:
        """The greatest latency recorded in ns (within the histogram's 1 %; NaN when empty)."""
        if not self.count:
            return float("nan")
        return float(self._h.get_max_value())

    def summary(self) -> dict:
        """The percentiles users judge latency by, in seconds: ``p50``, ``p99``,
        ``p99.9``, ``p99.99`` and ``max`` (NaN when empty, in that order, each at least
        the one before), and ``count``, the events they cover."""
        out = {name: self.percentile(q) / 1e9 for name, q in SUMMARY_PERCENTILES}
        out["max"] = self.max / 1e9
        out["count"] = self.count
        return out

    def encode(self) -> str:
        return self._h.encode().decode("ascii")

    @classmethod
    def decode(cls, text: str | None) -> LatencyHistogram:
        out = cls()
        if text:
            out._h.add(HdrHistogram.decode(text))
        return out

    @classmethod
    def merged(cls, parts) -> LatencyHistogram:
        """One histogram of all of ``parts`` (histograms, their encodings, or None)."""
        out = cls()
        for part in parts:
            if part is not None:
                out.add(part if isinstance(part, LatencyHistogram) else cls.decode(part))
        return out

    def __reduce__(self):
        return (LatencyHistogram.decode, (self.encode(),))

    def __repr__(self) -> str:
        if not self.count:
            return "LatencyHistogram(count=0)"
        return (f"LatencyHistogram(count={self.count}, p50={self.percentile(50) / 1e9:.3f}s, "
                f"p99={self.percentile(99) / 1e9:.3f}s, max={self._h.get_max_value() / 1e9:.3f}s)")


def latencies_encoded(metrics: dict) -> dict:
    """A copy of a member's ``metrics`` whose latency histograms are their encodings (for
    JSON: a member process's result, the "done" action)."""
    return {k: (v.encode() if k in LATENCY_FIELDS and isinstance(v, LatencyHistogram) else v)
            for k, v in metrics.items()}


def latencies_decoded(metrics: dict) -> dict:
    """``metrics`` (changed in place, and returned) with its latency encodings decoded."""
    for k in LATENCY_FIELDS:
        if isinstance(metrics.get(k), str):
            metrics[k] = LatencyHistogram.decode(metrics[k])
    return metrics


class JobMetrics:
    """A job's metrics, kept up to date from its progress events (thread-safe)."""

    def __init__(self, name: str, expected_events: int | None = None):
        self.name = name
        self.expected_events = expected_events
        self._lock = threading.Lock()
        self.state = "starting"
        self.execution: int | None = None
        self.members = 0
        self.restarts = 0
        self.started = time.monotonic()
        self._done = {"events_in": 0, "events_out": 0, "late_events": 0, "skipped_events": 0,
                      "dead_letters": 0, "offset_resets": 0}
        self._done_vertices: dict = {}
        #: latency histograms (by field) of the executions that ended
        self._done_latency = {k: LatencyHistogram() for k in LATENCY_FIELDS}
        self._current: dict = {}          # member -> its counters in this execution
        self.snapshots = 0
        self.last_snapshot: dict = {}
        self._rate = (time.monotonic(), 0, 0.0)  # (when, events_in, events/s)
        self.ended_ns: int | None = None  # wall clock when the run ended

    # -- feeding -------------------------------------------------------------------------

    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        with self._lock:
            if kind == "execution":
                self._close_execution()
                self.execution = event.get("execution")
                self.members = event.get("members") or 1
                self.state = "running"
            elif kind == "started":
                self.state = "running"
            elif kind == "restored":
                self.state = "running"
            elif kind == "progress":
                members = event.get("members")
                if members is not None:       # the driver's view of every member (Spark)
                    for i, counters in members.items():
                        self._progress({**counters, "member": i})
                else:
                    self._progress(event)
            elif kind == "snapshot":
                self.snapshots += 1
                align = event.get("alignment_s") or {}
                self.last_snapshot = {
                    "id": event.get("snapshot"), "duration_s": event.get("duration_s"),
                    "bytes": event.get("bytes"),
                    "alignment_s": max(align.values()) if align else 0.0}
            elif kind == "restart":
                self.restarts += 1
                self.state = "restarting"
            elif kind == "waiting":
                self.state = "waiting"

    def _progress(self, event: dict) -> None:
        member = event.get("member", 0)
        self._current[member] = {k: event.get(k) or 0 for k in self._done} | \
            {"vertices": event.get("vertices") or {}, "latency": event.get("latency") or {}}
        now, events = time.monotonic(), self._sum("events_in")
        when, before, rate = self._rate
        if now - when >= 0.5:
            fresh = (events - before) / (now - when)
            rate = fresh if rate == 0.0 else 0.5 * rate + 0.5 * fresh
            self._rate = (now, events, rate)

    def _close_execution(self) -> None:
        """An execution ended: what it did counts in the totals (a failed execution's work
        is replayed, so its events are counted again: these count work, not results)."""
        for c in self._current.values():
            for k in self._done:
                self._done[k] += c.get(k, 0)
            add_vertex_counts(self._done_vertices, c["vertices"])
            for k, encoded in c["latency"].items():
                if k in self._done_latency:
                    self._done_latency[k].add(LatencyHistogram.decode(encoded))
        self._current = {}
        self._rate = (time.monotonic(), self._sum("events_in"), self._rate[2])

    def finish(self, state: str, result=None) -> None:
        """The run ended in ``state``; with its ``result`` (a JobResult), the totals are
        its members' final counts instead of the last progress seen."""
        with self._lock:
            self.state = state
            if result is None:
                return
            self.ended_ns = time.time_ns()
            marks = {v: {k: c[k] for k in _TIMES if k in c} for v, c in self._vertices().items()}
            self._current = {}
            self._done = {k: sum(e.get(k, 0) for e in result.executions) for k in self._done}
            vertices: dict = {}
            for e in result.executions:
                add_vertex_counts(vertices, e.get("vertices") or {})
            if vertices:
                self._done_vertices = vertices
            self._done_latency = {k: LatencyHistogram.merged(e.get(k) for e in result.executions)
                                  for k in LATENCY_FIELDS}
            # the event times the last execution ended at, else those the last progress showed
            last = (result.executions[-1].get("vertices") or {}) if result.executions else {}
            for v, c in last.items():
                ended = {k: c[k] for k in _TIMES if k in c}
                if ended:
                    marks[v] = ended
            for v, mark in marks.items():
                self._done_vertices.setdefault(v, {"in": 0, "out": 0}).update(mark)

    # -- reading -------------------------------------------------------------------------

    def _sum(self, key: str) -> int:
        return self._done[key] + sum(c.get(key, 0) for c in self._current.values())

    def _vertices(self) -> dict:
        out = {v: dict(c) for v, c in self._done_vertices.items()}
        for c in self._current.values():
            add_vertex_counts(out, c["vertices"])
            for v, counts in c["vertices"].items():
                into = out[v]
                for k in _TIMES:
                    if k in counts:       # the least watermark, the newest event, of members
                        pick = max if k == "newest_event_ns" else min
                        into[k] = pick(into.get(k, counts[k]), counts[k])
        return out

    def _lags(self, vertices: dict) -> tuple[float | None, float | None]:
        """(source lag, watermark lag) in seconds: the wall clock (at the end, once the run
        ended) minus the newest event time read by the source furthest behind, and minus
        the lowest watermark of the vertices; None where no event time is a timestamp.
        A vertex whose input ended (its watermark is the end of time) is not behind."""
        now = self.ended_ns or time.time_ns()
        newest = [c["newest_event_ns"] for c in vertices.values() if "newest_event_ns" in c]
        marks = [c["watermark_ns"] for c in vertices.values()
                 if "watermark_ns" in c and c.get("watermark") != _END_OF_TIME]
        source = (now - min(newest)) / 1e9 if newest else None
        if marks:
            return source, (now - min(marks)) / 1e9
        ended = any(c.get("watermark") == _END_OF_TIME for c in vertices.values())
        return source, 0.0 if ended and newest else None

    def _latency(self) -> dict:
        """``{"emitted": summary, "committed": summary}`` over every execution so far (see
        :meth:`LatencyHistogram.summary`)."""
        out = {}
        for k in LATENCY_FIELDS:
            merged = LatencyHistogram().add(self._done_latency[k])
            for c in self._current.values():
                encoded = c["latency"].get(k)
                if encoded:
                    merged.add(LatencyHistogram.decode(encoded))
            out[LATENCY_OUTPUTS[k]] = merged.summary()
        return out

    def as_dict(self) -> dict:
        """Every metric, as plain data (``vertices``: per vertex, rows in and out over all
        executions and the watermark reached in this one, the least over its members;
        ``latency``: from each event's ``ts`` to its output ``emitted`` and ``committed``,
        as :meth:`LatencyHistogram.summary` gives them)."""
        with self._lock:
            events = self._sum("events_in")
            vertices = self._vertices()
            source_lag, watermark_lag = self._lags(vertices)
            return {
                "job": self.name, "state": self.state, "execution": self.execution,
                "members": self.members, "restarts": self.restarts,
                "seconds": time.monotonic() - self.started,
                "events_in": events, "events_out": self._sum("events_out"),
                "events_per_second": self._rate[2],
                "expected_events": self.expected_events,
                "late_events": self._sum("late_events"),
                "skipped_events": self._sum("skipped_events"),
                "dead_letters": self._sum("dead_letters"),
                "offset_resets": self._sum("offset_resets"),
                "snapshots": self.snapshots, "last_snapshot": dict(self.last_snapshot),
                "source_lag_s": source_lag, "watermark_lag_s": watermark_lag,
                "vertices": vertices, "latency": self._latency(),
            }


class _Collector:
    """The metrics of one job as Prometheus metric families (read at each scrape)."""

    def __init__(self, metrics: JobMetrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.metrics.as_dict()
        job = m["job"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"sparkjet_{name}", doc, labels=["job"])
            g.add_metric([job], float(value or 0))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"sparkjet_{name}", doc, labels=["job"])
            c.add_metric([job], float(value or 0))
            return c

        yield counter("events_in", "Events read by the sources (replays count again)",
                      m["events_in"])
        yield counter("events_out", "Rows written to sinks", m["events_out"])
        yield counter("late_events", "Events too late for every window they belong to",
                      m["late_events"])
        yield counter("skipped_events", "Rows a stage failed on and skipped (on_error)",
                      m["skipped_events"])
        yield counter("dead_letters", "Rows a stage failed on, sent to its on_error sink",
                      m["dead_letters"])
        yield counter("offset_resets", "Times a source moved past a position its input no "
                      "longer holds (Kafka on_offset_reset)", m["offset_resets"])
        yield counter("restarts", "Executions restarted after a failure", m["restarts"])
        yield counter("snapshots", "Snapshots committed by this run", m["snapshots"])
        yield gauge("events_per_second", "Source throughput, smoothed", m["events_per_second"])
        yield gauge("members", "Members of the running execution", m["members"])
        last = m["last_snapshot"]
        yield gauge("snapshot_duration_seconds", "Duration of the last snapshot",
                    last.get("duration_s"))
        yield gauge("snapshot_bytes", "Size of the last snapshot", last.get("bytes"))
        yield gauge("snapshot_alignment_seconds",
                    "Longest barrier alignment of the last snapshot", last.get("alignment_s"))
        if m["source_lag_s"] is not None:
            yield gauge("source_lag_seconds", "Wall clock minus the event time of the newest "
                        "event read (the source furthest behind)", m["source_lag_s"])
        if m["watermark_lag_s"] is not None:
            yield gauge("watermark_lag_seconds", "Wall clock minus the lowest watermark of "
                        "the job's vertices", m["watermark_lag_s"])
        rows = CounterMetricFamily("sparkjet_vertex_rows", "Rows into and out of each vertex",
                                   labels=["job", "vertex", "direction"])
        marks = GaugeMetricFamily("sparkjet_vertex_watermark",
                                  "The watermark each vertex has reached (event-time units)",
                                  labels=["job", "vertex"])
        for v, c in m["vertices"].items():
            rows.add_metric([job, v, "in"], float(c.get("in", 0)))
            rows.add_metric([job, v, "out"], float(c.get("out", 0)))
            if "watermark" in c:
                marks.add_metric([job, v], float(c["watermark"]))
        yield rows
        yield marks
        quantiles = GaugeMetricFamily(
            "sparkjet_latency_seconds", "Latency from an event's creation (its ts: the scheduled "
            "time at a fixed rate) to its output, emitted (handed to the sink) or committed "
            "(visible under exactly-once), at a quantile (1 is the greatest)",
            labels=["job", "output", "quantile"])
        samples = CounterMetricFamily("sparkjet_latency_events",
                                      "Events the latency quantiles cover",
                                      labels=["job", "output"])
        for output, summary in m["latency"].items():
            if not summary["count"]:
                continue
            for name, q in SUMMARY_PERCENTILES:
                quantiles.add_metric([job, output, f"{q / 100:g}"], summary[name])
            quantiles.add_metric([job, output, "1"], summary["max"])
            samples.add_metric([job, output], float(summary["count"]))
        yield quantiles
        yield samples


class MetricsServer:
    """Serves ``metrics`` for Prometheus on ``host:port`` (``port=0``: any free port; the
    one taken is :attr:`port`) until :meth:`close`."""

    def __init__(self, metrics: JobMetrics, port: int, host: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        self.registry.register(_Collector(metrics))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2.0)


class ProgressView:
    """The job's metrics on one terminal line, redrawn as progress events come."""

    def __init__(self, metrics: JobMetrics, out=None):
        self.metrics = metrics
        self.line = ProgressLine(out, every=5.0)

    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "restart":
            self.line.print(f"{event.get('message') or 'restart ' + str(event.get('attempt'))}: "
                            f"{event.get('error')}")
        self.line.update(self.text(), force=kind in ("restart", "execution"))

    def text(self) -> str:
        m = self.metrics.as_dict()
        total = m["expected_events"]
        head = f"{m['job']} {m['state']}"
        if total:
            head += f" {bar(m['events_in'] / total, 20)} {m['events_in']:,}/{total:,}"
        else:
            head += f" {m['events_in']:,} events"
        head += f" {m['events_per_second'] / 1e6:.2f} M/s"
        if m["snapshots"]:
            head += f" snapshot {m['last_snapshot'].get('id')}"
        if m["source_lag_s"] is not None:
            head += f" lag {_duration(m['source_lag_s'])}"
        if m["watermark_lag_s"] is not None:
            head += f" watermark lag {_duration(m['watermark_lag_s'])}"
        if m["restarts"]:
            head += f" restarts {m['restarts']}"
        return head

    def close(self) -> None:
        self.line.update(self.text(), force=True)
        self.line.close()


def _duration(seconds: float) -> str:
    if abs(seconds) < 120:
        return f"{seconds:.1f} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["CONTEXT_FIELDS", "LATENCY_FIELDS", "LATENCY_OUTPUTS", "LOG_FORMAT",
           "SUMMARY_PERCENTILES", "ContextFilter", "JobMetrics",
           "LatencyHistogram", "MetricsServer", "ProgressView", "latencies_decoded",
           "latencies_encoded", "log_to", "weighted_samples"]
