"""The streaming core end to end: a keyed count and sum over the generator (int64 keys, 1M
distinct, 64K-row batches, output discarded), without snapshots and with exactly-once
snapshots every 1 s and every 100 ms, in one member; and the recovery time after a kill.

Run: ``python bench/bench_job.py`` (prints a table) or
``python -m pytest bench/bench_job.py --benchmark-only``.
"""
from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

KEYS = 1_000_000
BATCH = 65_536


def pipeline(events: int):
    source = GeneratorSource(total=events, partitions=2, keys=KEYS, batch_size=BATCH)
    return (Pipeline().read_from(source)
            .group_by("key").aggregate(count="count", sum=("sum", "value"))
            .write_to(DiscardSink()))


def throughput(events: int, guarantee: str, interval: float, work: str) -> dict:
    config = JobConfig(name=f"bench-{guarantee}-{interval}", processing_guarantee=guarantee,
                       snapshot_store=None if guarantee == "none" else work,
                       snapshot_interval=interval, local_parallelism=1, batch_size=BATCH)
    result = Job(pipeline(events), config).run(isolated=False)
    snaps = result.snapshots
    return {"events_per_s": events / result.seconds, "seconds": result.seconds,
            "snapshots": len(snaps),
            "snapshot_mb": (sum(s["bytes"] for s in snaps) / len(snaps) / 1e6) if snaps else 0.0,
            "snapshot_ms": (sum(s["duration_s"] for s in snaps) / len(snaps) * 1e3) if snaps else 0.0}


def recovery(work: str) -> dict:
    """Kill the member once its state holds all 1M keys and a snapshot covers them; time
    from the kill to the first snapshot (the first new committed output) after restart."""
    events = 40_000_000
    source = GeneratorSource(total=events, partitions=2, keys=KEYS, batch_size=BATCH, rate=4_000_000)
    p = (Pipeline().read_from(source).group_by("key").aggregate(count="count", sum=("sum", "value"))
         .write_to(DiscardSink()))
    config = JobConfig(name="bench-recovery", snapshot_store=work, snapshot_interval=1.0,
                       local_parallelism=1, max_restarts=2, restart_backoff=0.0)
    job = Job(p, config)
    marks: dict = {}

    def progress(event):
        now = time.monotonic()
        if event.get("event") == "snapshot" and event.get("events_in", 0) >= 4_000_000 and "kill" not in marks:
            marks["state_bytes"] = event["bytes"]
            pid = job.member_pid
            if pid:
                marks["kill"] = now
                os.kill(pid, signal.SIGKILL)
        elif event.get("event") == "restored" and "kill" in marks:
            marks.setdefault("restored", now)
        elif event.get("event") == "snapshot" and "restored" in marks:
            marks.setdefault("first_output", now)

    result = job.run(on_progress=progress)
    return {"restarts": result.restarts, "state_mb": marks.get("state_bytes", 0) / 1e6,
            "kill_to_restored_s": marks.get("restored", float("nan")) - marks.get("kill", float("nan")),
            "kill_to_first_output_s": marks.get("first_output", float("nan")) - marks.get("kill", float("nan"))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20_000_000)
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.events:,} events, {KEYS:,} keys, one member, "
          "local_parallelism 1")
    rows = []
    base = None
    for label, guarantee, interval in (("no snapshots", "none", 1.0),
                                       ("exactly-once, 1 s", "exactly-once", 1.0),
                                       ("exactly-once, 100 ms", "exactly-once", 0.1)):
        with tempfile.TemporaryDirectory() as work:
            r = throughput(args.events, guarantee, interval, work)
        base = base or r["events_per_s"]
        rows.append((label, f"{r['events_per_s'] / 1e6:.2f} M/s", f"{r['events_per_s'] / base:.1%}",
                     str(r["snapshots"]), f"{r['snapshot_mb']:.1f}", f"{r['snapshot_ms']:.0f}"))
    print(f"{'configuration':24}{'events/s':>12}{'of no-snap':>12}{'snapshots':>11}{'MB each':>9}{'ms each':>9}")
    for row in rows:
        print(f"{row[0]:24}{row[1]:>12}{row[2]:>12}{row[3]:>11}{row[4]:>9}{row[5]:>9}")
    with tempfile.TemporaryDirectory() as work:
        rec = recovery(work)
    print(f"recovery after kill -9 with {rec['state_mb']:.1f} MB of state: restored in "
          f"{rec['kill_to_restored_s']:.2f} s, first new output after {rec['kill_to_first_output_s']:.2f} s "
          f"(target: 2 s + state / 500 MB/s = {2 + rec['state_mb'] / 500:.2f} s)")


def test_no_snapshots(benchmark, tmp_path):
    benchmark.pedantic(throughput, args=(5_000_000, "none", 1.0, str(tmp_path)), rounds=2)


def test_exactly_once_1s(benchmark, tmp_path):
    benchmark.pedantic(lambda: throughput(5_000_000, "exactly-once", 1.0, str(tmp_path / str(time.time()))),
                       rounds=2)


def test_exactly_once_100ms(benchmark, tmp_path):
    benchmark.pedantic(lambda: throughput(5_000_000, "exactly-once", 0.1, str(tmp_path / str(time.time()))),
                       rounds=2)


if __name__ == "__main__":
    main()
