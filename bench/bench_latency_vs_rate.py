"""Latency percentiles against the offered rate (issue 28 item 7): sparkjet beside Spark
Structured Streaming's micro-batch mode, both on one ``local[2]`` session in one process,
the same keyed count and sum (1M int64 keys), measured the same way: per event, from its
*scheduled* creation time at a fixed offered rate to its output becoming visible.

For each offered rate (0.1, 0.5, 1, 2, 5 M events/s by default), one after the other:

- **sparkjet, at-least-once** (emitted: the update handed to the sink), ``Job.run(spark)``
  with 2 members (barrier tasks of the ``local[2]`` session), ``GeneratorSource`` at
  ``rate`` (each event stamped with its scheduled time), ``DiscardSink``;
- **sparkjet, exactly-once, 100 ms and 1 s snapshots**: emitted and committed (the
  snapshot's commit that makes the update visible to a transactional sink). Latency is
  ``JobResult.latency`` (an HdrHistogram per member, every event counted);
- **Structured Streaming, micro-batch** (default trigger: as fast as it goes; HDFS-backed
  state store, ``update`` mode, ``noop`` sink, 2 shuffle partitions): the ``rate`` source at
  ``rowsPerSecond``. That source stamps each row with its scheduled time (the rows of second
  *s* evenly over that second) and releases a second's rows once the second is over; an
  event's output is visible when its micro-batch ends (``timestamp`` + ``triggerExecution``
  of the batch's progress, the offsets committed). Its latency is computed exactly from the
  progress records: the batch covering seconds [s0, s1) shows rows whose scheduled times are
  spread evenly over them. Also reported: latency from the row's release (the end of its
  second), i.e. without the source's one-second granularity. The first ``--warmup``
  seconds are left out; rows not output when the run stops count with the stop time (a lower
  bound) and make the point *saturated*.
- **Structured Streaming, real-time mode** (``trigger(realTime=...)``, in pyspark 4.x): probed
  once; see :func:`probe_real_time` for why it cannot run here.

No coordinated omission on either side: both sources keep their schedule whatever the job
does, and latency runs from the schedule. A configuration that falls behind its schedule
(sparkjet: the run lasts over 1.25 x its scheduled seconds + 1.5 s; SSS: rows of the window
not output within ``--drain`` seconds of its end) is marked saturated; a sparkjet
configuration 2.5x behind its schedule, or SSS once saturated, is not run at higher rates.
SSS's achieved rate is its rows over the time from the source's start to its last
batch's end (so slightly under the offered rate even when it keeps up).

Run: ``python bench/bench_latency_vs_rate.py`` (about 10 minutes on a loaded machine;
``--seconds 10``, ``--rates 0.1,0.5,1,2,5``, ``--only sparkjet`` or ``--only sss``, whose
rows replace that system's in an existing ``--out`` JSON; ``--runner local`` for sparkjet on
the local runner, without Spark). Writes ``bench/results/latency-vs-rate.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
KEYS = 1_000_000
QUANTILES = (("p50", 50.0), ("p99", 99.0), ("p99.9", 99.9), ("p99.99", 99.99))
HDFS_STORE = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
ROCKSDB_STORE = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SPARKJET_CONFIGS = (("sparkjet at-least-once", "at-least-once", 1.0),
                    ("sparkjet exactly-once 100 ms", "exactly-once", 0.1),
                    ("sparkjet exactly-once 1 s", "exactly-once", 1.0))
SSS_NAME = "SSS micro-batch"


def session():
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "bench-latency-vs-rate", **{
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.streaming.stateStore.providerClass": HDFS_STORE,
        "spark.sql.streaming.numRecentProgressUpdates": "10000",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": "2g",
    })
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# --- sparkjet ----------------------------------------------------------------------------------

def run_sparkjet(spark, work: str, rate: float, seconds: float, guarantee: str,
                 interval: float, runner: str) -> dict:
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import DiscardSink
    from sparkjet.sources import GeneratorSource

    events = int(rate * seconds)
    batch = 16_384
    source = GeneratorSource(total=events, partitions=4, keys=KEYS, rate=rate, batch_size=batch)
    pipeline = (Pipeline().read_from(source).group_by("key")
                .aggregate(count="count", sum=("sum", "value")).write_to(DiscardSink()))
    name = f"lat-rate-{guarantee}-{int(interval * 1000)}-{time.time_ns()}"
    layout = ({"members": 2, "local_parallelism": 1} if runner == "spark"
              else {"local_parallelism": 2})
    config = JobConfig(name=name, processing_guarantee=guarantee,
                       snapshot_store=os.path.join(work, name), snapshot_interval=interval,
                       batch_size=batch, **layout)
    marks: dict[str, float] = {}

    def progress(event):
        if event["event"] == "started":
            marks.setdefault("started", time.monotonic())

    start = time.monotonic()
    job = Job(pipeline, config)
    result = job.run(spark, on_progress=progress) if runner == "spark" else job.run(isolated=False)
    end = time.monotonic()
    running = end - marks.get("started", start)
    lat = result.latency
    snaps = result.snapshots
    # the generator keeps its schedule: a job that keeps up ends about ``seconds`` after its
    # start (plus the final snapshot and teardown); one that falls behind runs longer
    return {"offered": rate, "events": events, "seconds": end - start, "running_s": running,
            "behind": running > 1.25 * seconds + 1.5,
            "achieved": events / running if running > 0 else float("nan"),
            "emitted": lat["emitted"],
            "committed": lat["committed"] if guarantee == "exactly-once" else None,
            "snapshots": len(snaps),
            "snapshot_ms_mean": (sum(s["duration_s"] for s in snaps) / len(snaps) * 1e3
                                 if snaps else None)}


# --- Structured Streaming ----------------------------------------------------------------------

def _offset(x) -> int:
    """A rate source offset (whole seconds since its start) as the progress JSON gives it:
    a number, its string, or null before the first batch (0)."""
    if x is None or x == "null":
        return 0
    return int(json.loads(x)) if isinstance(x, str) else int(x)


def _iso(ts: str) -> float:
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def _weighted_percentiles(values, weights, qs):
    import numpy as np

    order = np.argsort(values)
    v, w = np.asarray(values)[order], np.asarray(weights)[order]
    cum = np.cumsum(w)
    total = cum[-1]
    return [float(v[min(len(v) - 1, np.searchsorted(cum, q / 100 * total))]) for q in qs]


def sss_latencies(progress: list[dict], created: float, rate: float, window: tuple[float, float],
                  stop: float) -> dict:
    """Per-event latency from the rate source's progress records: rows of second ``s`` are
    scheduled evenly over [created + s, created + s + 1) and released at its end; the batch
    covering seconds [s0, s1) makes them visible at its end. Rows scheduled in ``window``
    and not output by ``stop`` count with ``stop`` (a lower bound)."""
    import numpy as np

    lo, hi = window
    vals, rel_vals, weights = [], [], []
    covered_until = created
    for p in progress:
        src = p["sources"][0]
        s0 = _offset(src.get("startOffset"))
        s1 = _offset(src["endOffset"])
        if s1 <= s0:
            continue
        visible = _iso(p["timestamp"]) + p["durationMs"]["triggerExecution"] / 1e3
        covered_until = max(covered_until, created + s1)
        for s in range(s0, s1):
            a, b = max(lo, created + s), min(hi, created + s + 1)
            if b <= a:
                continue
            k = 200
            ts = a + (np.arange(k) + 0.5) / k * (b - a)
            vals.append(visible - ts)
            rel_vals.append(np.full(k, visible - (created + s + 1)))
            weights.append(np.full(k, rate * (b - a) / k))
    # rows scheduled in the window but never output: censored at the stop time
    missing = 0.0
    a = max(lo, covered_until)
    if a < hi:
        k = 400
        ts = a + (np.arange(k) + 0.5) / k * (hi - a)
        vals.append(stop - ts)
        rel_vals.append(np.maximum(0.0, stop - np.ceil(ts - created) - created))
        weights.append(np.full(k, rate * (hi - a) / k))
        missing = rate * (hi - a)
    if not vals:
        return {"count": 0}
    v, r, w = np.concatenate(vals), np.concatenate(rel_vals), np.concatenate(weights)
    qs = [q for _, q in QUANTILES] + [100.0]
    names = [n for n, _ in QUANTILES] + ["max"]
    out = dict(zip(names, _weighted_percentiles(v, w, qs)))
    out["from_release"] = dict(zip(names, _weighted_percentiles(r, w, qs)))
    out["count"] = float(w.sum())
    out["not_output"] = missing
    return out


def _sss_query(spark, rate: float, checkpoint: str):
    """The keyed count+sum as a Structured Streaming query on the ``rate`` source, started
    (micro-batch mode, update output, ``noop`` sink)."""
    from pyspark.sql import functions as F

    events = (spark.readStream.format("rate").option("rowsPerSecond", int(rate))
              .option("numPartitions", 2).load())
    keyed = events.select((F.col("value") % KEYS).alias("key"),
                          ((F.col("value") * 7919) % 1000 / 1000.0).alias("value"))
    totals = keyed.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total"))
    return (totals.writeStream.format("noop").outputMode("update")
            .option("checkpointLocation", checkpoint).start())


def run_sss(spark, work: str, rate: float, seconds: float, warmup: float, drain: float) -> dict:
    ck = os.path.join(work, f"sss-{int(rate)}-{time.time_ns()}")
    query = _sss_query(spark, rate, ck)
    try:
        created_file = Path(ck) / "sources" / "0" / "0"
        while not created_file.exists() and query.isActive:
            time.sleep(0.05)
        created = int(created_file.read_text().split("\n")[-1].strip()) / 1e3
        window = (created + warmup, created + warmup + seconds)
        # wait for the window to end, then for a batch that covers it (or the drain limit)
        while time.time() < window[1] and query.isActive:
            time.sleep(0.1)
        deadline = window[1] + drain
        covered = False
        while time.time() < deadline and query.isActive and not covered:
            time.sleep(0.1)
            prog = [json.loads(p.json) for p in query.recentProgress]
            covered = any(created + _offset(p["sources"][0]["endOffset"]) >= window[1]
                          for p in prog if p["sources"])
        stop = time.time()
        error = str(query.exception()) if query.exception() else None
    finally:
        query.stop()
    prog = [json.loads(p.json) for p in query.recentProgress if p.sources]
    lat = sss_latencies(prog, created, rate, window, stop)
    in_window = [p for p in prog if p["numInputRows"]
                 and created + _offset(p["sources"][0]["endOffset"]) <= window[1] + 1]
    rows = sum(p["numInputRows"] for p in prog)
    durations = [p["durationMs"]["triggerExecution"] / 1e3 for p in in_window]
    span = (max(_iso(p["timestamp"]) + p["durationMs"]["triggerExecution"] / 1e3 for p in prog)
            - created) if prog else float("nan")
    return {"offered": rate, "seconds": seconds, "warmup": warmup,
            "achieved": rows / span if span > 0 else float("nan"),
            "committed": lat, "emitted": None, "batches": len(in_window),
            "batch_s_median": sorted(durations)[len(durations) // 2] if durations else None,
            "error": error}


def warm_sss(spark, work: str, rate: float, batches: int = 3, timeout: float = 240.0) -> dict:
    """Run the query until ``batches`` micro-batches with rows have completed (or ``timeout``)
    and throw it away: under load a cold JVM took 26 s for the first (empty) micro-batch and
    longer for the first with rows (code generation, state store set-up)."""
    start = time.time()
    query = _sss_query(spark, rate, os.path.join(work, f"warm-{time.time_ns()}"))
    done = 0
    try:
        while time.time() - start < timeout and query.isActive:
            time.sleep(0.5)
            done = sum(1 for p in query.recentProgress if p.numInputRows)
            if done >= batches:
                break
    finally:
        query.stop()
    return {"seconds": time.time() - start, "batches": done}


def probe_real_time(spark, work: str) -> dict:
    """Try the same query with ``trigger(realTime=...)``: Spark 4.x's real-time mode admits
    only sources that implement real-time reads (Kafka in the Apache release; the rate
    source is not one) and the console, foreach and Kafka sinks. Returns what happened."""
    from pyspark.sql import functions as F

    out = {}
    ev = spark.readStream.format("rate").option("rowsPerSecond", 1000).load()
    agg = (ev.select((F.col("value") % KEYS).alias("key"), F.col("value"))
           .groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total")))

    class Nothing:
        def open(self, partition_id, epoch_id):
            return True

        def process(self, row):
            pass

        def close(self, error):
            pass

    # real-time mode refuses the HDFS-backed state store: ask with RocksDB, as it requires
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_STORE)
    try:
        q = (agg.writeStream.outputMode("update").foreach(Nothing())
             .option("checkpointLocation", os.path.join(work, f"rtm-{time.time_ns()}"))
             .trigger(realTime="5 seconds").start())
        time.sleep(8)
        exc = q.exception()
        out["ran"] = bool(q.isActive and exc is None and q.lastProgress)
        out["error"] = str(exc) if exc else None
        q.stop()
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        out["ran"] = False
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", HDFS_STORE)
    try:
        import importlib.util

        out["kafka_connector"] = any(
            "kafka" in j for j in os.listdir(Path(importlib.util.find_spec("pyspark").origin).parent / "jars"))
    except OSError:
        out["kafka_connector"] = None
    return out


# --- report ------------------------------------------------------------------------------------

def _ms(x) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def _order(row: dict) -> tuple:
    names = [n for n, _, _ in SPARKJET_CONFIGS] + [SSS_NAME]
    return row["offered"], names.index(row["system"]) if row["system"] in names else len(names)


def table(rows: list[dict]) -> str:
    head = ("| offered M/s | system | achieved M/s | emitted p50 | p99 | p99.9 | p99.99 | max "
            "| committed p50 | p99 | p99.9 | p99.99 | max |")
    lines = [head, "| " + " | ".join(["---"] * 2 + ["---:"] * 11) + " |"]
    for r in rows:
        e, c = r.get("emitted") or {}, r.get("committed") or {}
        sat = " (saturated)" if r.get("saturated") else ""
        lines.append(
            f"| {r['offered'] / 1e6:g} | {r['system']}{sat} | {r['achieved'] / 1e6:.2f} | "
            + " | ".join(_ms(e.get(k)) for k in ("p50", "p99", "p99.9", "p99.99", "max")) + " | "
            + " | ".join(_ms(c.get(k)) for k in ("p50", "p99", "p99.9", "p99.99", "max")) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, load: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    series = [(SPARKJET_CONFIGS[0][0], "emitted", "#d9480f", "-"),
              (SPARKJET_CONFIGS[1][0], "emitted", "#f08c00", "--"),
              (SPARKJET_CONFIGS[1][0], "committed", "#1971c2", "-"),
              (SPARKJET_CONFIGS[2][0], "committed", "#4dabf7", "--"),
              (SSS_NAME, "committed", "#495057", "-")]
    for ax, q in zip(axes, ("p99", "p99.99")):
        for system, output, color, style in series:
            pts = [(r["offered"] / 1e6, r[output][q], r.get("saturated"))
                   for r in rows if r["system"] == system and r.get(output) and q in r[output]]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, color=color,
                    marker="o", label=f"{system}, {output}")
            for x, y, s in pts:
                if s:
                    ax.plot([x], [y * 1e3], "x", color="black", markersize=10)
        ax.axhline(5 if q == "p99" else 20, color="green", linewidth=0.8, linestyle=":")
        if q == "p99":
            ax.axhline(250, color="purple", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered M events/s")
        ax.set_title(f"{q} latency, scheduled time to visible output")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"keyed count+sum, 1M keys, local[2]; x = saturated; dotted: issue 28 targets; {load}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.1,0.5,1,2,5", help="M events/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="events per point: rate x seconds")
    parser.add_argument("--warmup", type=float, default=8.0, help="SSS seconds left out at the start")
    parser.add_argument("--drain", type=float, default=15.0,
                        help="SSS: seconds past the window to wait for its output")
    parser.add_argument("--only", choices=("sparkjet", "sss"), default=None)
    parser.add_argument("--runner", choices=("spark", "local"), default="spark",
                        help="sparkjet on the local[2] session (default) or the local runner")
    parser.add_argument("--out", default=str(RESULTS / "latency-vs-rate"))
    args = parser.parse_args(argv)
    rates = [float(x) * 1e6 for x in args.rates.split(",")]
    spark = None if args.only == "sparkjet" and args.runner == "local" else session()
    rows: list[dict] = []
    kept: list[dict] = []
    if args.only and Path(args.out + ".json").exists():   # keep the other systems' rows
        old = json.loads(Path(args.out + ".json").read_text())
        kept = [r for r in old.get("rows", [])
                if r["system"].startswith("sparkjet") != (args.only == "sparkjet")]
    loads = []
    saturated: set[str] = set()
    report: dict = {"machine": {"cpus": os.cpu_count()}, "args": vars(args)}
    with tempfile.TemporaryDirectory() as work:
        if args.only != "sparkjet":
            report["real_time_mode"] = probe_real_time(spark, work)
            print("real-time mode:", report["real_time_mode"], flush=True)
            # one throwaway query first (see warm_sss)
            report["sss_warmup"] = warm_sss(spark, work, rates[0])
            print("SSS warm-up:", report["sss_warmup"], flush=True)
        for rate in rates:
            plan = []
            if args.only != "sss":
                plan += [(n, g, i) for n, g, i in SPARKJET_CONFIGS]
            if args.only != "sparkjet":
                plan.append((SSS_NAME, None, None))
            for system, guarantee, interval in plan:
                if system in saturated:
                    continue
                load = os.getloadavg()[0]
                loads.append(load)
                if guarantee is None:
                    r = run_sss(spark, work, rate, args.seconds, args.warmup, args.drain)
                    r["saturated"] = bool(r["committed"].get("not_output"))
                else:
                    r = run_sparkjet(spark, work, rate, args.seconds, guarantee, interval, args.runner)
                    r["saturated"] = r["behind"]
                r |= {"system": system, "load": load}
                rows.append(r)
                # the sweep stops for a system far behind its schedule (more of the same)
                if guarantee is None and r["saturated"] or r.get("running_s", 0) > 2.5 * args.seconds:
                    saturated.add(system)
                print(table([r]).splitlines()[-1], f"load {load:.1f}", flush=True)
                report["rows"] = kept + rows
                Path(args.out + ".json").write_text(json.dumps(report, indent=1, default=str))
    if spark is not None:
        spark.stop()
    load = f"load average {min(loads):.0f}-{max(loads):.0f} on {os.cpu_count()} CPUs"
    report["machine"]["load"] = load
    Path(args.out + ".json").write_text(json.dumps(report, indent=1, default=str))
    report["rows"] = rows = sorted(kept + rows, key=_order)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1, default=str))
    plot(rows, Path(args.out + ".png"), load)
    print(load)
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
