"""Throughput toward the batch limit (issue 28 item 5): the keyed count and sum end to end
on two processors beside the same aggregation done as one in-memory batch.

Four measurements over the same events (int64 keys uniform over 1M, 64K-row batches):

- ``batch limit``: pyarrow ``Table.group_by(...).aggregate([count, sum])`` over every event
  at once, the events already in memory (what the issue measures sparkjet against);
- ``source alone``: the generator read to the end on two partitions, nothing else (the floor
  the job cannot go below);
- ``job, no snapshots`` and ``job, exactly-once 1 s``: the job (`local_parallelism=2`, one
  member, output discarded): over the whole run, and warm: between its first progress
  report after one second and its last before the end (the job's own ``events_in``), so
  member start, the first growth of the key map and the end are left out.

Ratios are of one run, side by side (the machine is small and shared)::

    python bench/bench_throughput.py --events 40000000
    python -m pytest bench/bench_throughput.py --benchmark-only
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

KEYS = 1_000_000
BATCH = 65_536


def source(events: int) -> GeneratorSource:
    return GeneratorSource(total=events, partitions=2, keys=KEYS, batch_size=BATCH)


def batch_limit(events: int) -> float:
    """Events per second of pyarrow's group_by over all events in one table (the events
    generated beforehand, not timed)."""
    table = source(events).events(0, events).select(["key", "value"])
    start = time.perf_counter()
    out = table.group_by("key", use_threads=False).aggregate([("value", "count"),
                                                              ("value", "sum")])
    seconds = time.perf_counter() - start
    assert out.num_rows == min(KEYS, events)
    return events / seconds


def source_alone(events: int) -> float:
    reader = source(events).open([0, 1], None)
    start, n = time.perf_counter(), 0
    while not reader.at_end():
        batch = reader.read(BATCH)
        if batch is not None:
            n += batch.num_rows
    assert n == events
    return events / (time.perf_counter() - start)


def job(events: int, guarantee: str, work: str) -> dict:
    """The job's whole-run rate and its warm rate (see the module doc)."""
    p = (Pipeline().read_from(source(events))
         .group_by("key").aggregate(count="count", sum=("sum", "value"))
         .write_to(DiscardSink()))
    config = JobConfig(name=f"throughput-{guarantee}", processing_guarantee=guarantee,
                       snapshot_store=None if guarantee == "none" else work,
                       snapshot_interval=1.0, local_parallelism=2, batch_size=BATCH)
    marks: list[tuple[float, int]] = []

    def progress(event):
        if "events_in" in event:
            marks.append((time.monotonic(), event["events_in"]))

    start = time.monotonic()
    result = Job(p, config).run(isolated=False, on_progress=progress)
    warm = [(t, n) for t, n in marks if t - start >= 1.0 and 0 < n < events]
    rate = ((warm[-1][1] - warm[0][1]) / (warm[-1][0] - warm[0][0])
            if len(warm) >= 2 and warm[-1][0] > warm[0][0] else float("nan"))
    return {"whole_run": events / result.seconds, "warm": rate,
            "warm_events": warm[-1][1] - warm[0][1] if len(warm) >= 2 else 0}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=40_000_000)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    n = args.events
    load = os.getloadavg()[0]
    figures = {"events": n, "keys": KEYS, "load_before": load,
               "batch_limit": batch_limit(n), "source_alone": source_alone(n)}
    for guarantee in ("none", "exactly-once"):
        with tempfile.TemporaryDirectory() as work:
            figures[f"job_{guarantee}"] = job(n, guarantee, work)
    figures["load_after"] = os.getloadavg()[0]
    limit = figures["batch_limit"]
    print(f"{n:,} events, {KEYS:,} keys, load average {load:.1f} -> {figures['load_after']:.1f}")
    print(f"{'':28}{'M events/s':>12}{'of batch limit':>16}")
    print(f"{'batch limit (pyarrow)':28}{limit / 1e6:>12.2f}{1:>16.0%}")
    print(f"{'source alone':28}{figures['source_alone'] / 1e6:>12.2f}"
          f"{figures['source_alone'] / limit:>16.0%}")
    for g in ("none", "exactly-once"):
        f = figures[f"job_{g}"]
        for what in ("warm", "whole_run"):
            print(f"{f'job {g}, {what}':28}{f[what] / 1e6:>12.2f}{f[what] / limit:>16.0%}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


def test_job_beside_the_batch_limit(benchmark, tmp_path):
    events = 4_000_000
    limit = batch_limit(events)
    r = benchmark.pedantic(job, args=(events, "exactly-once", str(tmp_path)), rounds=1)
    benchmark.extra_info["of_batch_limit"] = r["whole_run"] / limit


if __name__ == "__main__":
    main()
