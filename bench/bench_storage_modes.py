"""The members' storage beside the shared store, steady state (issue 24, Targets).

One job per storage mode and key count, on a ``local[2]`` Spark session, two members
(``local_parallelism=1`` each): an unbounded ``GeneratorSource`` (int64 keys uniform over
``keys``, no rate limit: as fast as the members go) into ``group_by("key").aggregate(count,
sum)`` into ``DiscardSink``, exactly-once, 1 s snapshots. The modes:

- ``shared``: the chunk files in ``snapshot_store`` (a local disk, fsynced);
- ``members``: ``storage="members"``, ``backup_count=1``: each member's files in its slot
  under ``/dev/shm`` (the default ``storage_dir``, memory) and each file streamed to the other
  member's slot (``slot_write``, Flight ``DoPut``), verified there before the snapshot's ack.

Steady state starts at the first snapshot that has seen 3 x ``keys`` events (95 % of the keys
in the state); from it, ``--snapshots`` more snapshots are taken, then the job is stopped.
Reported per run: **throughput** (events between the first and the last of those snapshots
over the time between them, from the coordinator's counts) and the **snapshot duration**
(median ``duration_s``, barrier to commit, of those snapshots) and the state's size. The modes
alternate within each round, so each ratio (members / shared) compares runs minutes apart at
most; the ratios are the medians over ``--rounds`` rounds.

Run: ``python bench/bench_storage_modes.py --keys 1000000 10000000 --json out.json`` or
``python -m pytest bench/bench_storage_modes.py --benchmark-only`` (1M keys, one round).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

BATCH = 65_536
AGGREGATIONS = {"count": "count", "sum": ("sum", "value")}
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
MODES = ("shared", "members")


def steady(spark, keys: int, work: str, storage: str, snapshots: int = 6) -> dict:
    """One run of ``storage``'s job at ``keys`` keys: throughput and snapshot duration in
    steady state."""
    source = GeneratorSource(partitions=4, keys=keys, batch_size=BATCH)
    p = (Pipeline().read_from(source).group_by("key").aggregate(**AGGREGATIONS)
         .write_to(DiscardSink()))
    extra: dict = {}
    if storage == "members":
        extra = {"storage": "members", "backup_count": 1,
                 "storage_dir": tempfile.mkdtemp(prefix="bench-slots-", dir=SHM)}
    config = JobConfig(name=f"bench-steady-{storage}-{keys}",
                       snapshot_store=os.path.join(work, "store"), snapshot_interval=1.0,
                       members=2, local_parallelism=1, max_restarts=0, **extra)
    job = Job(p, config)
    seen: list[tuple[float, int, float, int]] = []
    stopping = threading.Event()

    def progress(event):
        if event.get("event") != "snapshot" or stopping.is_set():
            return
        if event.get("events_in", 0) < 3 * keys:
            return
        seen.append((time.monotonic(), event["events_in"], event["duration_s"], event["bytes"]))
        if len(seen) > snapshots:
            stopping.set()
            threading.Thread(target=job.stop, daemon=True).start()

    started = time.monotonic()
    try:
        job.run(spark, on_progress=progress)
    finally:
        if "storage_dir" in extra:
            shutil.rmtree(extra["storage_dir"], ignore_errors=True)
    if len(seen) < 2:
        raise RuntimeError(f"{storage} at {keys} keys: {len(seen)} steady snapshots")
    (t0, e0, _, _), (t1, e1, _, _) = seen[0], seen[-1]
    return {"keys": keys, "storage": storage, "events_per_s": (e1 - e0) / (t1 - t0),
            "snapshot_s": statistics.median(d for _, _, d, _ in seen[1:]),
            "snapshot_s_all": [round(d, 3) for _, _, d, _ in seen[1:]],
            "state_mb": seen[-1][3] / 1e6, "fill_s": t0 - started, "snapshots": len(seen) - 1}


def compare(spark, keys: list[int], rounds: int, snapshots: int) -> dict:
    """Every key count, each round running both modes one after the other (the order
    alternates round by round)."""
    out: dict = {"load": os.getloadavg()[0], "runs": []}
    for k in keys:
        for r in range(rounds):
            for storage in (MODES if r % 2 == 0 else MODES[::-1]):
                with tempfile.TemporaryDirectory() as work:
                    run = steady(spark, k, work, storage, snapshots)
                run["round"] = r
                run["load"] = os.getloadavg()[0]
                out["runs"].append(run)
                print("  " + json.dumps(run), flush=True)
        ratios = []
        for r in range(rounds):
            pair = {x["storage"]: x for x in out["runs"] if x["keys"] == k and x["round"] == r}
            ratios.append((pair["members"]["events_per_s"] / pair["shared"]["events_per_s"],
                           pair["members"]["snapshot_s"] / pair["shared"]["snapshot_s"]))
        out[f"ratio-{k}"] = {"throughput": statistics.median(t for t, _ in ratios),
                             "snapshot_duration": statistics.median(d for _, d in ratios),
                             "per_round": ratios}
    out["load_end"] = os.getloadavg()[0]
    return out


def test_storage_modes_1m(benchmark):
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "sparkjet-bench-storage",
                          **{"spark.ui.showConsoleProgress": "false"})
    try:
        benchmark.pedantic(compare, args=(spark, [1_000_000], 1, 4), rounds=1)
    finally:
        spark.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--snapshots", type=int, default=6,
                        help="steady-state snapshots per run")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "sparkjet-bench-storage",
                          **{"spark.ui.showConsoleProgress": "false"})
    print(f"load average {os.getloadavg()[0]:.2f}")
    try:
        out = compare(spark, args.keys, args.rounds, args.snapshots)
    finally:
        spark.stop()
    print("\nmembers (backup_count=1) / shared, medians over rounds")
    for k in args.keys:
        r = out[f"ratio-{k}"]
        print(f"  {k:>12,} keys: throughput {r['throughput']:.2f}x, snapshot duration "
              f"{r['snapshot_duration']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
