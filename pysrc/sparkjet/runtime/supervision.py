"""What both supervisors of a job share: the result of a run, the error that ends it, and
the restart policy.

A supervisor (:mod:`~sparkjet.runtime.local_runner`: a member in a child process;
:mod:`~sparkjet.runtime.spark_runner`: members as a Spark barrier stage) runs executions
until one succeeds. After each failure it asks :func:`restart_or_fail`, which ends the job
with :class:`JobFailedError` (at once for an error about the data; past
``config.max_restarts`` failures within ``config.restart_window`` seconds otherwise) or
waits :func:`backoff` seconds and lets it start the next execution, whose id
:func:`next_execution` gives. Outages (:func:`~sparkjet.runtime.failures.transient_kind`)
are retried within those bounds however often they repeat.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sparkjet.errors import JobFailedError, SnapshotStoreLostError
from sparkjet.runtime.config import JobConfig, open_store
from sparkjet.runtime.observability import LATENCY_OUTPUTS, LatencyHistogram

#: The longest wait between two executions, in seconds.
MAX_BACKOFF = 30.0


@dataclass
class JobResult:
    """What a run did, across all its executions."""

    job_id: int
    #: each execution's metrics (or failure); with persistence, ``recovery``: what the
    #: restart restored and who held what (sparkjet.runtime.persistence.recover)
    executions: list[dict] = field(default_factory=list)
    restarts: int = 0
    seconds: float = 0.0
    #: stopped (Job.stop / suspend) before its sources ended: a new run resumes it
    stopped: bool = False
    #: the name the final snapshot was exported under (Job.stop(snapshot=...))
    export: str | None = None
    #: when each restarted failure happened (time.monotonic()), for the restart window
    failure_times: list[float] = field(default_factory=list, repr=False)

    @property
    def events_in(self) -> int:
        return sum(e.get("events_in", 0) for e in self.executions)

    @property
    def events_out(self) -> int:
        return sum(e.get("events_out", 0) for e in self.executions)

    @property
    def late_events(self) -> int:
        """Events too late for every window they belonged to (counted, and written to a
        window's ``late_events`` sink when it has one). Of failed executions, only what
        their members reported before failing."""
        return sum(e.get("late_events", 0) for e in self.executions)

    @property
    def skipped_events(self) -> int:
        """Rows a stage with ``on_error="skip"`` failed on and dropped. Of failed
        executions, only what their members reported before failing."""
        return sum(e.get("skipped_events", 0) for e in self.executions)

    @property
    def dead_letters(self) -> int:
        """Rows a stage failed on that went to its ``on_error`` sink (committed with the
        job's guarantee: a replay may count one twice, the sink holds it once under
        exactly-once)."""
        return sum(e.get("dead_letters", 0) for e in self.executions)

    @property
    def offset_resets(self) -> int:
        """Times a source followed its ``on_offset_reset`` policy past a position its input
        no longer held (a Kafka partition whose log was truncated, moved on or deleted):
        records may then have been read twice or never. Nonzero deserves a look. Of failed
        executions, only what their members reported before failing."""
        return sum(e.get("offset_resets", 0) for e in self.executions)

    @property
    def refused_calls(self) -> int:
        """Calls to the job's members or coordinator refused for their credentials (an
        outsider, or a zombie of an older execution): nonzero deserves a look."""
        return sum(e.get("refused_calls", 0) for e in self.executions)

    @property
    def fallbacks(self) -> list[dict]:
        """The executions that started from an older snapshot than the newest: each
        ``{"to", "unusable", "replaced", "explicit"}`` (see
        :func:`sparkjet.runtime.restore.own_start`). Empty on a run that needed none."""
        return [e["fallback"] for e in self.executions if e.get("fallback")]

    @property
    def snapshots(self) -> list[dict]:
        return [s for e in self.executions for s in e.get("snapshots", [])]

    def latency_percentiles(self, *qs: float, until: str = "commit") -> list[float]:
        """Latency percentiles in seconds, from an event's creation (its ``ts``) to the
        commit of the output it led to (``until="commit"``: when a transactional sink
        makes it visible) or to the moment the output is handed to the sink
        (``until="emit"``: what an idempotent or at-least-once sink sees). Each member
        keeps its samples in a :class:`~sparkjet.runtime.observability.LatencyHistogram`
        (within 1 %); NaN without samples."""
        field = {"commit": "latencies_ns", "emit": "emit_latencies_ns"}[until]
        merged = LatencyHistogram.merged(e.get(field) for e in self.executions)
        return [merged.percentile(q) / 1e9 for q in qs]

    @property
    def latency(self) -> dict:
        """Latency per event as users judge it, in seconds: ``{"emitted": {...},
        "committed": {...}}``, each with ``p50``, ``p99``, ``p99.9``, ``p99.99``, ``max``
        and ``count`` (the events measured; NaN percentiles without any), from an event's
        ``ts`` to its output handed to the sink (emitted) or made visible by the sink's
        commit (committed; exactly-once). A source at a fixed rate stamps each event with
        its scheduled time (:class:`~sparkjet.sources.GeneratorSource` with ``rate``), so
        the time an event waited to be read counts too: no coordinated omission. Merged
        over every member and execution (one HdrHistogram each, within 1 %)."""
        return {output: LatencyHistogram.merged(e.get(field) for e in self.executions).summary()
                for field, output in LATENCY_OUTPUTS.items()}


def backoff(config: JobConfig, attempt: int) -> float:
    """Seconds to wait before restart number ``attempt`` (1, 2, ...) of the restart window:
    ``restart_backoff * 2**(attempt - 1)``, at most :data:`MAX_BACKOFF`."""
    return min(MAX_BACKOFF, config.restart_backoff * 2 ** (attempt - 1))


def restart_or_fail(config: JobConfig, result: JobResult, attempt: int, outcome: dict,
                    progress: Callable[[dict], None], start: float) -> None:
    """The restart policy of both supervisors, after failure number ``attempt`` of the run
    (whose ``outcome`` holds the ``error`` and its kind, see
    :mod:`~sparkjet.runtime.failures`). Raises JobFailedError for an error a replay would
    repeat (``deterministic``), for an error of unknown kind that ended the previous
    execution too, and past ``config.max_restarts`` failures within ``restart_window``
    seconds; a ``transient`` failure (an outage) is never cut short by the "same way twice"
    rule. Otherwise counts the restart in ``result``, reports it to ``progress`` and waits
    :func:`backoff` seconds for restart k of the window. ``start`` is when the run began
    (``time.monotonic()``)."""
    error = outcome.get("error")
    detail = _detail(outcome)
    now = time.monotonic()
    if outcome.get("deterministic"):
        result.seconds = now - start
        raise JobFailedError(f"job {config.name!r} failed on an error a replay would repeat, "
                             f"not retried: {error}{detail}")
    kind = outcome.get("transient")
    previous = [e for e in result.executions[:-1] if e.get("status") == "failed"]
    if (not kind and outcome.get("exception") and previous and previous[-1].get("exception")
            and not previous[-1].get("transient")
            and previous[-1].get("cause") == outcome.get("cause")):
        result.seconds = now - start
        raise JobFailedError(f"job {config.name!r} failed {attempt} times the same way, which a "
                             f"replay repeats: not retried further (max_restarts="
                             f"{config.max_restarts}); {error}{detail}")
    result.failure_times.append(now)
    window = config.restart_window
    k = sum(1 for t in result.failure_times if window is None or now - t <= window)
    within = "" if window is None else f" within {window:g} s (restart_window)"
    if k > config.max_restarts:
        result.seconds = now - start
        what = f"transient: {kind}; " if kind else ""
        raise JobFailedError(f"job {config.name!r} failed {k} times{within} (max_restarts="
                             f"{config.max_restarts}); last failure: {what}{error}{detail}")
    result.restarts += 1
    delay = backoff(config, k)
    span = "the run" if window is None else f"{window:g} s"
    message = (f"{f'transient: {kind}' if kind else 'failed'}, retrying in {delay:g} s "
               f"(restart {k} of {config.max_restarts}, window {span})")
    progress({"event": "restart", "attempt": attempt, "restart": k,
              "max_restarts": config.max_restarts, "window_s": window, "after_s": delay,
              "transient": kind, "message": message,
              "error": outcome.get("error"), "member": outcome.get("failed_member"),
              "guarantee": config.processing_guarantee,
              "note": None if config.processing_guarantee != "none" else
              "guarantee 'none': no snapshot; the sources restart from their start"})
    time.sleep(delay)


def _detail(outcome: dict) -> str:
    """The failure's traceback and the member's kept log, for the error's message."""
    out = ""
    if outcome.get("traceback"):
        out += "\n\nThe member's traceback:\n" + outcome["traceback"].rstrip()
    if outcome.get("log"):
        out += f"\n(the member's log: {outcome['log']})"
    return out


def next_execution(config: JobConfig, attempt: int, previous: int | None = None) -> int:
    """The id of the next execution (the fencing token of store and sinks): one more than
    the newest execution registered in the snapshot store; with guarantee "none" (no
    store), ``attempt``, the number of executions this run has started so far.

    ``previous``: the execution this run started last, whose id came from the store's
    newest registered execution, ``previous - 1`` (``previous`` itself may have failed before
    it registered). A store that no longer holds that one (its log was deleted while the job
    ran) raises SnapshotStoreLostError rather than hand out an id that a zombie of an
    earlier execution may still hold."""
    if config.processing_guarantee == "none":
        return attempt
    store = open_store(config)
    current = store.current_execution()
    seen = None if previous is None or previous == 0 else previous - 1
    if seen is not None and (current is None or current < seen):
        raise SnapshotStoreLostError(
            f"{store.who}: the snapshot store {config.snapshot_store} no longer holds execution "
            f"{seen}, which this run saw registered: its snapshots were deleted (or replaced) "
            f"while the job ran. Nothing can be restored or fenced there, so the job stops; restore "
            f"the store from a copy, or start the job again with a new snapshot store")
    return 0 if current is None else current + 1


__all__ = ["MAX_BACKOFF", "JobFailedError", "JobResult", "backoff", "next_execution",
           "restart_or_fail"]
