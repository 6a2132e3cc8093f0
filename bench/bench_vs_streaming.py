"""sparkjet on Spark beside Spark Structured Streaming and PyFlink, on one workload, in one run.

The workload: 20M events (id, key uniform over 1M keys, value), a per-key count and sum
emitting updates, output discarded.

- sparkjet: ``Job(...).run(spark)`` on ``local[2]`` with 2 members (Spark barrier tasks),
  exactly-once snapshots every 1 s, and with snapshots off. It reads the same events from
  files: the Parquet files the others read, copied once into an Arrow IPC log
  (:class:`~sparkjet.sources.ArrowLogSource`, 4 partitions).
- Spark Structured Streaming (HDFS-backed and RocksDB state stores) and PyFlink (checkpoints
  every 1 s, and off): ``streaming_competitors.py``, each in a subprocess of its own.

Latency: sparkjet's is measured per event (creation time to the committed output, and to
the update handed to the sink) with the generator offering 2M events/s, about a third of
what the job sustains; Structured Streaming's is its micro-batch duration (an event waits
at least that long); PyFlink's comes from Flink's latency markers (queueing between source
and sink, not event time: all its input is there from the start).
Recovery: kill -9 of one member once a snapshot covers every key, to the first snapshot
(the first new committed output) of the restarted execution; and as state grows (1M, 10M,
50M keys).

Run: ``python bench/bench_vs_streaming.py`` (about 20 minutes; ``--quick`` for a 2M-event
trial, ``--skip-competitors`` for sparkjet alone). It prints the table and writes
``bench/results/streaming.png`` and ``.json``. PyFlink needs ``bench/.flink-venv``, which
``streaming_competitors.ensure_flink_venv`` creates (``pip install apache-flink`` there).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import streaming_competitors as rivals  # noqa: E402 - after the path

KEYS = 1_000_000
BATCH = 65_536


def arrow_log(data: dict, work: Path, partitions: int = 4) -> str:
    """The Parquet files of ``data`` copied once into an Arrow IPC log (cached)."""
    import pyarrow.parquet as pq

    from sparkjet.sources import ArrowLogWriter

    root = Path(data["parquet_dir"]).parent / f"arrowlog-{partitions}"
    if (root / "DONE").exists():
        return str(root)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    files = sorted(Path(data["parquet_dir"]).glob("*.parquet"))
    schema = pq.read_schema(files[0])
    with ArrowLogWriter(root, partitions, schema) as log:
        for i, f in enumerate(files):
            for batch in pq.read_table(f).to_batches(BATCH):
                log.append(i % partitions, batch)
    (root / "DONE").write_text("")
    return str(root)


def _pipeline(source):
    from sparkjet.pipeline import Pipeline
    from sparkjet.sinks import DiscardSink

    return (Pipeline().read_from(source).group_by("key")
            .aggregate(count="count", sum=("sum", "value")).write_to(DiscardSink()))


def sparkjet_throughput(spark, log_root: str, events: int, guarantee: str, work: Path) -> dict:
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sources import ArrowLogSource

    config = JobConfig(name=f"vs-{guarantee}-{time.time_ns()}", processing_guarantee=guarantee,
                       snapshot_store=None if guarantee == "none" else str(work / f"snap-{time.time_ns()}"),
                       snapshot_interval=1.0, members=2, local_parallelism=1, batch_size=BATCH)
    marks = {}

    def progress(event):
        if event["event"] == "started":
            marks["started"] = time.monotonic()

    start = time.monotonic()
    result = Job(_pipeline(ArrowLogSource(log_root)), config).run(spark, on_progress=progress)
    end = time.monotonic()
    assert result.events_in == events, (result.events_in, events)
    snaps = result.snapshots
    return {"events_per_s": events / (end - start), "seconds": end - start,
            "events_per_s_running": events / (end - marks["started"]),
            "start_s": marks["started"] - start, "checkpoints": len(snaps),
            "snapshot_mb": sum(s["bytes"] for s in snaps) / len(snaps) / 1e6 if snaps else 0.0,
            "snapshot_ms": sum(s["duration_s"] for s in snaps) / len(snaps) * 1e3 if snaps else 0.0,
            "note": "Arrow IPC log of the same events; seconds include the barrier stage's start"}


def sparkjet_steady_overhead(spark, work: Path, events: int = 100_000_000) -> dict:
    """Snapshot overhead in steady state: ``events`` generated events (about 8 s, so the
    first and the terminal snapshot weigh little), exactly-once every 1 s against none,
    events/s from the members' start."""
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sources import GeneratorSource

    rates = {}
    for guarantee in ("none", "exactly-once"):
        source = GeneratorSource(total=events, partitions=4, keys=KEYS, batch_size=BATCH)
        config = JobConfig(name=f"vs-steady-{guarantee}-{time.time_ns()}", processing_guarantee=guarantee,
                           snapshot_store=None if guarantee == "none" else str(work / f"st-{time.time_ns()}"),
                           snapshot_interval=1.0, members=2, local_parallelism=1)
        marks: dict[str, float] = {}

        def on_progress(event, marks=marks):
            if event["event"] == "started":
                marks.setdefault("t0", time.monotonic())

        Job(_pipeline(source), config).run(spark, on_progress=on_progress)
        rates[guarantee] = events / (time.monotonic() - marks["t0"])
    return {"events": events, "none_per_s": rates["none"], "exactly_once_per_s": rates["exactly-once"],
            "overhead": 1 - rates["exactly-once"] / rates["none"]}


def sparkjet_latency(spark, work: Path, rate: float = 2_000_000, seconds: float = 10.0) -> dict:
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sources import GeneratorSource

    events = int(rate * seconds)
    source = GeneratorSource(total=events, partitions=4, keys=KEYS, rate=rate, batch_size=16_384)
    config = JobConfig(name=f"vs-latency-{time.time_ns()}", snapshot_store=str(work / f"lat-{time.time_ns()}"),
                       snapshot_interval=1.0, members=2, local_parallelism=1)
    result = Job(_pipeline(source), config).run(spark)
    c50, c99 = result.latency_percentiles(50, 99)
    e50, e99 = result.latency_percentiles(50, 99, until="emit")
    return {"rate": rate, "p50_latency_s": c50, "p99_latency_s": c99, "emit_p50_s": e50,
            "emit_p99_s": e99, "events_per_s": events / result.seconds,
            "note": f"generator offering {rate / 1e6:.1f}M events/s; per event: creation to the "
                    "committed output (and to the update handed to the sink)"}


def sparkjet_recovery(spark, work: Path, keys: int = KEYS) -> dict:
    """Kill -9 one member once a snapshot covers ~every key; seconds from the kill to the
    restored execution running and to its first committed snapshot."""
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sources import GeneratorSource

    events = 3 * keys   # uniform keys: after 2.5 x keys events 92 % of the keys are in the state
    source = GeneratorSource(total=events, partitions=4, keys=keys, batch_size=BATCH)
    config = JobConfig(name=f"vs-recovery-{keys}-{time.time_ns()}",
                       snapshot_store=str(work / f"rec-{time.time_ns()}"), snapshot_interval=1.0,
                       members=2, local_parallelism=1, max_restarts=2, restart_backoff=0.0,
                       heartbeat_timeout=120.0)
    job = Job(_pipeline(source), config)
    marks: dict = {}

    def progress(event):
        now = time.monotonic()
        kind = event["event"]
        if kind == "snapshot" and "kill" not in marks and event["events_in"] >= 2.5 * keys:
            marks["state_bytes"] = event["bytes"]
            pid = job.member_pids[1]
            marks["kill"] = now
            os.kill(pid, signal.SIGKILL)
        elif kind == "started" and "kill" in marks:
            marks.setdefault("running", now)
        elif kind == "snapshot" and "running" in marks:
            marks.setdefault("first_output", now)

    result = job.run(spark, on_progress=progress)
    nan = float("nan")
    return {"keys": keys, "restarts": result.restarts, "state_mb": marks.get("state_bytes", 0) / 1e6,
            "kill_to_running_s": marks.get("running", nan) - marks.get("kill", nan),
            "kill_to_first_output_s": marks.get("first_output", nan) - marks.get("kill", nan)}


def plot(rows: list[tuple[str, dict]], recoveries: list[tuple[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    names = [n for n, r in rows if "events_per_s" in r]
    values = [r["events_per_s"] / 1e6 for n, r in rows if "events_per_s" in r]
    colors = ["#d9480f" if n.startswith("sparkjet") else "#868e96" for n in names]
    a.barh(names[::-1], values[::-1], color=colors[::-1])
    for y, v in enumerate(values[::-1]):
        a.text(v, y, f" {v:.2f}", va="center")
    a.set_xlabel("M events/s (20M events, 1M keys, count + sum, 2 cores)")
    a.set_title("throughput")
    rec = [(n, v) for n, v in recoveries if not math.isnan(v)]
    b.barh([n for n, _ in rec][::-1], [v for _, v in rec][::-1],
           color=["#d9480f" if n.startswith("sparkjet") else "#868e96" for n, _ in rec][::-1])
    for y, (_, v) in enumerate(rec[::-1]):
        b.text(v, y, f" {v:.1f}", va="center")
    b.set_xlabel("seconds from kill -9 (or restart) to first new output")
    b.set_title("recovery")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000_000)
    parser.add_argument("--quick", action="store_true", help="2M events, no state-size runs")
    parser.add_argument("--skip-competitors", action="store_true")
    parser.add_argument("--state-keys", default="1000000,10000000,50000000")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "sparkjet-streaming-bench"))
    parser.add_argument("--out", default=str(BENCH / "results" / "streaming"))
    args = parser.parse_args(argv)
    events = 2_000_000 if args.quick else args.events
    state_keys = [] if args.quick else [int(k) for k in args.state_keys.split(",")]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = rivals.make_data(work, events, KEYS, rivals.FILES)
    log_root = arrow_log(data, work)
    print(f"load average {os.getloadavg()[0]:.2f}; {events:,} events, {KEYS:,} keys", flush=True)

    from sparkjet.spark import local_session

    spark = local_session("local[2]", "sparkjet-bench", **{"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("OFF")
    results: dict = {}
    snap = work / "sparkjet"
    snap.mkdir(exist_ok=True)
    try:
        # A first short job starts the Python workers, so no row pays for that.
        sparkjet_throughput(spark, log_root, events, "none", snap)
        results["sparkjet-eo"] = sparkjet_throughput(spark, log_root, events, "exactly-once", snap)
        print("  sparkjet exactly-once:", json.dumps(results["sparkjet-eo"]), flush=True)
        results["sparkjet-none"] = sparkjet_throughput(spark, log_root, events, "none", snap)
        print("  sparkjet no snapshots:", json.dumps(results["sparkjet-none"]), flush=True)
        results["sparkjet-steady"] = sparkjet_steady_overhead(spark, snap)
        print("  sparkjet steady state:", json.dumps(results["sparkjet-steady"]), flush=True)
        results["sparkjet-latency"] = sparkjet_latency(spark, snap)
        print("  sparkjet latency:", json.dumps(results["sparkjet-latency"]), flush=True)
        for keys in [KEYS, *[k for k in state_keys if k != KEYS]]:
            results[f"sparkjet-recovery-{keys}"] = sparkjet_recovery(spark, snap, keys)
            print(f"  sparkjet recovery {keys:,} keys:", json.dumps(results[f"sparkjet-recovery-{keys}"]),
                  flush=True)
    finally:
        spark.stop()
    if not args.skip_competitors:
        for name in ("sss-hdfs", "sss-rocksdb", "pyflink", "pyflink-nocp", "sss-recovery",
                     "pyflink-recovery"):
            results[name] = rivals._attempt(rivals.RUNS[name][1], data, work)
            print(f"  {name}:", json.dumps(results[name]), flush=True)
        if state_keys:
            results["recovery-vs-state"] = rivals.recovery_vs_state(
                work, [k for k in state_keys if k != KEYS] or [KEYS])
            print("  recovery vs state:", json.dumps(results["recovery-vs-state"]), flush=True)
    report(results, events, Path(args.out))


def report(results: dict, events: int, out: Path) -> None:
    eo = results["sparkjet-eo"]
    lat = results["sparkjet-latency"]
    rows = [("sparkjet, exactly-once 1 s", {**eo, "p50_latency_s": lat["p50_latency_s"],
                                            "p99_latency_s": lat["p99_latency_s"]}),
            ("sparkjet, snapshots off", results["sparkjet-none"])]
    for name in ("sss-hdfs", "sss-rocksdb", "pyflink", "pyflink-nocp"):
        if name in results:
            rows.append((rivals.RUNS[name][0], results[name]))
    base = eo["events_per_s"]
    print(f"\n{events:,} events, {KEYS:,} keys; ratio = sparkjet exactly-once events/s over the row's;"
          " p50/p99: sparkjet per event to committed output at 2M events/s, SSS micro-batch"
          " duration, PyFlink latency markers")
    print(f"{'system':34}{'events/s':>11}{'ratio':>8}{'p50 s':>8}{'p99 s':>8}{'ckpts':>7}")
    for name, r in rows:
        if "events_per_s" not in r:
            print(f"{name:34}  could not run: {r.get('error')}")
            continue
        p50, p99 = r.get("p50_latency_s", float("nan")), r.get("p99_latency_s", float("nan"))
        print(f"{name:34}{r['events_per_s'] / 1e6:>9.2f} M{base / r['events_per_s']:>7.1f}x"
              f"{p50:>8.2f}{p99:>8.2f}{r.get('checkpoints', 0):>7}")
    none = results["sparkjet-none"]["events_per_s"]
    print(f"\nsparkjet snapshot overhead: {1 - eo['events_per_s'] / none:.1%} "
          f"({eo['checkpoints']} snapshots, {eo['snapshot_mb']:.1f} MB, {eo['snapshot_ms']:.0f} ms each)")
    if "sparkjet-steady" in results:
        st = results["sparkjet-steady"]
        print(f"sparkjet snapshot overhead in steady state ({st['events'] / 1e6:.0f}M generated events): "
              f"{st['overhead']:.1%} ({st['exactly_once_per_s'] / 1e6:.2f} against {st['none_per_s'] / 1e6:.2f} M/s)")
    if "pyflink" in results and "pyflink-nocp" in results and "events_per_s" in results["pyflink"] \
            and "events_per_s" in results["pyflink-nocp"]:
        print(f"PyFlink checkpoint overhead: "
              f"{1 - results['pyflink']['events_per_s'] / results['pyflink-nocp']['events_per_s']:.1%}")
    print(f"sparkjet latency at {lat['rate'] / 1e6:.1f}M events/s: committed p50 {lat['p50_latency_s']:.3f} s "
          f"p99 {lat['p99_latency_s']:.3f} s; emitted p50 {lat['emit_p50_s']:.3f} s p99 {lat['emit_p99_s']:.3f} s")
    recoveries = []
    print("\nrecovery: kill -9 to the first new committed output")
    for name, r in results.items():
        if name.startswith("sparkjet-recovery-"):
            print(f"  sparkjet, {r['keys']:,} keys ({r['state_mb']:.0f} MB snapshot): running after "
                  f"{r['kill_to_running_s']:.2f} s, first output after {r['kill_to_first_output_s']:.2f} s")
            recoveries.append((f"sparkjet {r['keys'] // 10**6}M keys", r["kill_to_first_output_s"]))
    for name in ("sss-recovery", "pyflink-recovery"):
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            print(f"  {rivals.RUNS[name][0]}: could not run: {r['error']}")
            continue
        first = r.get("restart_to_first_batch_s", r.get("restart_to_first_checkpoint_s"))
        print(f"  {rivals.RUNS[name][0]}: first output {first:.1f} s after the restart command "
              f"(their restart is manual; the JVM start is included)")
        recoveries.append((rivals.RUNS[name][0].replace(" recovery", ""), first))
    for label, r in results.get("recovery-vs-state", {}).items():
        if "error" in r:
            print(f"  {label}: could not run: {r['error']}")
        else:
            first = r.get("restart_to_first_batch_s", r.get("restart_to_first_checkpoint_s"))
            print(f"  {label}: first output {first:.1f} s after the restart command")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(rows, recoveries, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
