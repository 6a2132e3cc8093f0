"""Snapshot duration under backpressure, aligned and unaligned (issue 28 item 3).

A keyed count and sum over the generator at a fixed offered rate, with a hot key (one event
in four has key 0, so one keyed processor gets 5/8 of the events) and a sink ``--slowdown``
times slower than the input (a stage before the sink, in the sink's thread, sleeps
``slowdown / rate`` seconds per row: one processor alone drains ``rate / slowdown`` rows
per second). Exactly-once, snapshots every ``--interval`` seconds, ``local_parallelism=2``,
in one member run in process. The job runs for ``--seconds`` and is then cancelled; the
table gives each mode's snapshot durations (the coordinator's: from the barrier's
injection to the commit), how many snapshots completed, the bytes of the largest snapshot
(an unaligned one holds its items in flight) and the events the job took in.

Modes: aligned (``alignment_timeout=None``, the default) and unaligned after
``--timeout`` seconds (``alignment_timeout=timeout``).

Run: ``python bench/bench_unaligned.py`` (30 s per mode; ``--seconds 8`` for a short run).
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.errors import JobCancelledError, MemberFailedError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

KEYS = 100_000
PARALLELISM = 2


def hot_key(b: pa.RecordBatch) -> pa.RecordBatch:
    key = pc.if_else(pc.equal(pc.bit_wise_and(b["id"], 3), 0), 0, b["key"])
    return b.set_column(b.schema.get_field_index("key"), "key", key)


def run(mode_timeout: float | None, rate: float, seconds: float, slowdown: float,
        interval: float, batch: int, work: str) -> dict:
    per_row = slowdown / rate

    def slow(b: pa.RecordBatch) -> pa.RecordBatch:
        time.sleep(b.num_rows * per_row)
        return b

    source = GeneratorSource(total=None, partitions=4, keys=KEYS, batch_size=batch, rate=rate)
    pipeline = (Pipeline().read_from(source).map_batches(hot_key)
                .group_by("key").aggregate(count="count", sum=("sum", "value"))
                .map_batches(slow).write_to(DiscardSink()))
    config = JobConfig(name=f"bench-unaligned-{mode_timeout}", snapshot_store=work,
                       snapshot_interval=interval, local_parallelism=PARALLELISM,
                       batch_size=batch, alignment_timeout=mode_timeout)
    snapshots: list[dict] = []
    events = [0]

    def progress(event: dict) -> None:
        if event["event"] == "snapshot":
            snapshots.append(event)
        if event.get("events_in"):
            events[0] = max(events[0], event["events_in"])

    job = Job(pipeline, config)
    done = threading.Event()

    def cancel_later():
        if not done.wait(seconds):
            job.cancel()

    t = threading.Thread(target=cancel_later, daemon=True)
    t.start()
    try:
        job.run(isolated=False, on_progress=progress)
    except (JobCancelledError, MemberFailedError) as e:
        if "cancelled" not in str(e):   # in process, the member reports the cancel
            raise
    finally:
        done.set()
    d = np.array([s["duration_s"] for s in snapshots]) if snapshots else np.array([np.nan])
    return {"snapshots": len(snapshots), "p50": float(np.median(d)),
            "p90": float(np.percentile(d, 90)), "max": float(d.max()),
            "bytes": max((s.get("bytes") or 0 for s in snapshots), default=0),
            "events_in": events[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=100_000, help="offered events per second")
    ap.add_argument("--slowdown", type=float, default=10.0, help="how much slower the sink is")
    ap.add_argument("--timeout", type=float, default=0.1, help="alignment_timeout, seconds")
    ap.add_argument("--interval", type=float, default=1.0, help="snapshot_interval, seconds")
    ap.add_argument("--batch", type=int, default=1_000, help="the generator's batch size")
    a = ap.parse_args()
    print(f"{a.rate:,.0f} events/s offered for {a.seconds:.0f} s, sink {a.slowdown:g}x slower, "
          f"hot key, snapshots every {a.interval:g} s, batches of {a.batch} rows")
    print(f"{'mode':<22} {'snapshots':>9} {'p50 s':>7} {'p90 s':>7} {'max s':>7} "
          f"{'max bytes':>11} {'events in':>10}")
    for timeout in (None, a.timeout):
        with tempfile.TemporaryDirectory() as work:
            r = run(timeout, a.rate, a.seconds, a.slowdown, a.interval, a.batch, work)
        mode = "aligned" if timeout is None else f"unaligned after {timeout:g} s"
        print(f"{mode:<22} {r['snapshots']:>9} {r['p50']:>7.3f} {r['p90']:>7.3f} "
              f"{r['max']:>7.3f} {r['bytes']:>11,} {r['events_in']:>10,}", flush=True)


if __name__ == "__main__":
    main()
