"""What short snapshot intervals cost (issue 28 item 4): throughput at ``snapshot_interval``
0.2 s and 0.1 s against 1 s, in one run.

A bounded ``GeneratorSource`` (``--events`` int64 keys uniform over ``--keys``, 64K-row
batches, no rate limit) into ``group_by("key").aggregate(count, sum)`` into ``DiscardSink``,
exactly-once. By default on a ``local[2]`` Spark session, two members (``local_parallelism=1``
each), the shared snapshot store on local disk (fsynced); ``--storage members`` runs the
members' storage (``backup_count=1``, slots under ``/dev/shm``); ``--in-process`` runs one
member with ``local_parallelism=2`` in this process (no Spark: what ``py-spy`` profiles
best). The intervals alternate round by round (``--rounds``), after an untimed warm-up
run on Spark.

Per run: **throughput**, the events after the first snapshot over the time from it to the
terminal snapshot's commit (the job's start and its first second, where the state fills, are
left out); **the ratio** to the 1 s run of the same round (the median over the rounds); in
process also **the CPU ratio**, the 1 s run's CPU seconds per event (of this process, every
thread) over this run's, a figure other work on a shared machine disturbs less than
the wall time; and the snapshots' median
phases, from the coordinator's records: ``duration`` (barrier to commit), ``phase1`` (barrier
to the last processor's acknowledgement: the processors write their state) and ``commit``
(the store's commit point: the validation record and the log event).

Run: ``python bench/bench_interval.py`` (prints the table; ``--json out.json`` keeps it) or
``python -m pytest bench/bench_interval.py --benchmark-only`` (in process, one round).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery import AGGREGATIONS, BATCH, storage_options  # noqa: E402 - after the path

INTERVALS = (1.0, 0.2, 0.1)


def run(spark, interval: float, events: int, keys: int, storage: str, work: str,
        codec: str = "blosc2-lz4") -> dict:
    """One bounded run at ``interval``: throughput after the first snapshot, and the
    snapshots' phases."""
    source = GeneratorSource(total=events, partitions=4, keys=keys, batch_size=BATCH)
    p = (Pipeline().read_from(source).group_by("key").aggregate(**AGGREGATIONS)
         .write_to(DiscardSink()))
    extra = storage_options(storage)
    shape = ({"members": 2, "local_parallelism": 1} if spark is not None
             else {"local_parallelism": 2})
    config = JobConfig(name=f"bench-interval-{interval}", snapshot_interval=interval,
                       snapshot_store=os.path.join(work, "store"), max_restarts=0,
                       batch_size=BATCH, snapshot_codec=codec, **shape, **extra)
    seen: list[tuple[float, int, dict]] = []
    cpu: list[float] = []

    def progress(event):
        if event.get("event") == "snapshot":
            seen.append((time.monotonic(), event.get("events_in", 0), event))
            cpu.append(time.process_time())

    try:
        if spark is None:
            Job(p, config).run(isolated=False, on_progress=progress)
        else:
            Job(p, config).run(spark, on_progress=progress)
    finally:
        if "storage_dir" in extra:
            shutil.rmtree(extra["storage_dir"], ignore_errors=True)
    if len(seen) < 2 or not seen[-1][2]["terminal"]:
        raise RuntimeError(f"interval {interval}: {len(seen)} snapshots, none terminal")
    (t0, e0, _), (t1, _, _) = seen[0], seen[-1]
    snaps = [s for _, _, s in seen[1:-1]] or [seen[-1][2]]

    def median(key):
        return statistics.median(s.get(key, float("nan")) for s in snaps)

    return {"interval": interval, "storage": storage, "events_per_s": (events - e0) / (t1 - t0),
            "snapshots": len(seen), "duration_ms": median("duration_s") * 1e3,
            "phase1_ms": median("phase1_s") * 1e3, "commit_ms": median("commit_s") * 1e3,
            "mb": statistics.median(s["bytes"] for s in snaps) / 1e6,
            "seconds": t1 - t0,
            # in process only: this process's CPU seconds per million events
            "cpu_s_per_m": (cpu[-1] - cpu[0]) / (events - e0) * 1e6 if spark is None else None}


def compare(spark, events: int, keys: int, storage: str, rounds: int,
            intervals=INTERVALS, codec: str = "blosc2-lz4") -> dict:
    out: dict = {"load": os.getloadavg()[0], "events": events, "keys": keys, "storage": storage,
                 "spark": spark is not None, "codec": codec, "runs": []}
    if spark is not None:       # the members' Python workers start and import: not timed
        with tempfile.TemporaryDirectory() as work:
            run(spark, intervals[0], min(events, 10_000_000), keys, storage, work, codec)
    for r in range(rounds):
        order = intervals if r % 2 == 0 else intervals[::-1]
        for interval in order:
            with tempfile.TemporaryDirectory() as work:
                res = run(spark, interval, events, keys, storage, work, codec)
            res["round"] = r
            res["load"] = os.getloadavg()[0]
            out["runs"].append(res)
            print("  " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in res.items()}), flush=True)
    for interval in intervals:
        ratios, cpu = [], []
        for r in range(rounds):
            by = {x["interval"]: x for x in out["runs"] if x["round"] == r}
            ratios.append(by[interval]["events_per_s"] / by[intervals[0]]["events_per_s"])
            if spark is None:
                cpu.append(by[intervals[0]]["cpu_s_per_m"] / by[interval]["cpu_s_per_m"])
        out[f"ratio-{interval:g}"] = statistics.median(ratios)
        out[f"cpu-ratio-{interval:g}"] = statistics.median(cpu) if cpu else None
    out["load_end"] = os.getloadavg()[0]
    return out


def table(result: dict) -> str:
    lines = [f"{'interval':>8} {'M events/s':>11} {'vs 1 s':>7} {'CPU vs 1 s':>10} "
             f"{'snapshots':>9} {'duration ms':>11} {'phase1 ms':>9} {'commit ms':>9} "
             f"{'MB':>6}"]
    for interval in sorted({x["interval"] for x in result["runs"]}, reverse=True):
        runs = [x for x in result["runs"] if x["interval"] == interval]

        def med(k, runs=runs):
            return statistics.median(x[k] for x in runs)

        cpu = result.get(f"cpu-ratio-{interval:g}")
        cpu = "-" if cpu is None else f"{cpu:.1%}"

        lines.append(f"{interval:>8g} {med('events_per_s') / 1e6:>11.2f} "
                     f"{result[f'ratio-{interval:g}']:>7.1%} {cpu:>10} {med('snapshots'):>9.0f} "
                     f"{med('duration_ms'):>11.0f} {med('phase1_ms'):>9.0f} "
                     f"{med('commit_ms'):>9.1f} {med('mb'):>6.1f}")
    return "\n".join(lines)


def test_interval_in_process(benchmark, bench_summaries):
    result = benchmark.pedantic(compare, args=(None, 20_000_000, 1_000_000, "shared", 1),
                                rounds=1)
    bench_summaries.append(table(result))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=60_000_000)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--storage", choices=("shared", "members"), default="shared")
    parser.add_argument("--codec", choices=("blosc2-lz4", "lz4", "raw"), default="blosc2-lz4",
                        help="JobConfig.snapshot_codec (default: the job's default)")
    parser.add_argument("--in-process", action="store_true",
                        help="one member, local_parallelism=2, in this process (no Spark)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    spark = None
    if not args.in_process:
        from sparkjet.spark import local_session

        spark = local_session("local[2]", "sparkjet-bench-interval",
                              **{"spark.ui.showConsoleProgress": "false"})
    where = "in process, local_parallelism=2" if spark is None else "local[2], 2 members"
    print(f"{args.events:,} events, {args.keys:,} keys, {where}, storage={args.storage}, "
          f"codec={args.codec}, load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        result = compare(spark, args.events, args.keys, args.storage, args.rounds,
                         codec=args.codec)
    finally:
        if spark is not None:
            spark.stop()
    print(table(result))
    print(f"load average at the end {result['load_end']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
