"""Recovery by promotion on a standalone cluster (issue 24's target: "standalone worker-JVM
kill (promotion) reported at 10M keys").

A Spark standalone cluster of 3 one-core workers (:mod:`sparkjet.testing.standalone`), each
a host with its own storage root. An unbounded ``GeneratorSource`` (int64 keys uniform over
``keys``) into ``group_by("key").aggregate(count, sum)``, exactly-once, 1 s snapshots, 3
members (``local_parallelism=1``), ``storage="members"``, ``backup_count=1`` (every slot's
files backed up on another host). Once a committed snapshot has seen 3 x ``keys`` events,
worker 2's JVM is SIGKILLed, its executor and the member's Python worker with it: that
host's slot is gone, and the next execution (2 members, the quorum) restores its
partitions by promoting their backups on the other two hosts. Seconds from the kill to each
phase, from the job's progress events, as ``bench_recovery.py``: **detected** (``restart``),
**running** (``execution``), **restored** (every operator rebuilt its state), **first
commit**; the ``restored`` event's own read and rebuild seconds beside them.

Run: ``python bench/bench_promotion.py --keys 1000000 10000000 [--json out.json]``. The
driver must be a process without a SparkContext (this script is one).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench_recovery import AGGREGATIONS, BATCH, NAN, _phase_recorder, _phases, save_results

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource
from sparkjet.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster

VICTIM = 2      # the worker whose JVM is killed


def promotion(cluster: StandaloneCluster, spark, keys: int, work: str,
              rate: float = 3_000_000) -> dict:
    """One run: kill worker ``VICTIM``'s JVM once a snapshot covers 3 x ``keys`` events;
    seconds from the kill to each phase, and the placements before and after."""
    source = GeneratorSource(partitions=6, keys=keys, batch_size=BATCH, rate=rate)
    p = (Pipeline().read_from(source).group_by("key").aggregate(**AGGREGATIONS)
         .write_to(DiscardSink()))
    config = JobConfig(name=f"bench-promotion-{keys}", snapshot_store=os.path.join(work, "store"),
                       snapshot_interval=1.0, members=3, local_parallelism=1, max_restarts=3,
                       restart_backoff=0.0, storage="members", backup_count=1)
    job = Job(p, config)
    marks: dict = {}
    placed: list[dict] = []
    killed: dict = {}

    def kill_worker():
        killed["kill"] = cluster.kill_worker(VICTIM)
        # the phases count from the signal, not from the snapshot event that asked for it
        # (the lookup of the worker's executors comes between)
        marks["kill"] = killed["kill"].signalled_at

    recorder = _phase_recorder(job, keys, None, marks, fault=kill_worker)

    def progress(event):
        if event.get("event") == "placed":
            placed.append(event)
        recorder(event)

    job.run(spark, on_progress=progress)
    out = _phases(marks, {"keys": keys, "state_mb": marks.get("state_bytes", 0) / 1e6,
                          "snapshot_before_kill_s": marks.get("snapshot_s", NAN)})
    out["members"] = [len(e["slots"]) for e in placed]
    out["hosts"] = [sorted(s["host"] for s in e["slots"]) for e in placed]
    if "kill" in killed:
        out["worker_kill_s"] = killed["kill"].seconds
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results: dict = {"load": os.getloadavg()[0]}
    print(f"load average {results['load']:.2f}", flush=True)
    for k in args.keys:
        # a fresh cluster per key count: the killed worker comes back empty otherwise
        with StandaloneCluster(workers=3, cores=1, memory="1g") as cluster, \
                tempfile.TemporaryDirectory() as work:
            spark = cluster.session("sparkjet-bench-promotion", **{
                "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
                "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
                "spark.ui.showConsoleProgress": "false"})
            spark.sparkContext.setLogLevel("OFF")
            try:
                r = results[f"promotion-{k}"] = promotion(cluster, spark, k, work)
            finally:
                spark.stop()
        print("  " + json.dumps(r), flush=True)
    save_results(results, args.json)


if __name__ == "__main__":
    main()
