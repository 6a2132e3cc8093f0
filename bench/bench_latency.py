"""Latency per event and throughput, end to end (issue 28 items 1 and 2): a keyed count and
sum over the generator (int64 keys, 1M distinct, output discarded), exactly-once snapshots
every second, in one member run in process (the local runner, ``local_parallelism=2``: two
source and two keyed threads), at a fixed offered rate and as fast as it goes.

Latency is the job's own (``JobResult.latency``): from each event's scheduled creation time
(the generator's ``ts`` at a fixed rate, so an event that waited to be read counts its wait)
to its output handed to the sink (emitted) and made visible by the snapshot's commit
(committed). Throughput is events over the run's seconds, with the generator unthrottled.

It also runs on a checkout without ``JobResult.latency`` or ``max_batch_delay`` (the
"before" of bench/README.md): latency then comes from ``latency_percentiles``, whose samples
were 16 per batch, unweighted.

Run: ``python bench/bench_latency.py`` (prints a table; ``--quick`` for a short run) or
``python -m pytest bench/bench_latency.py --benchmark-only``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import pytest

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

KEYS = 1_000_000
BATCH = 65_536
PARALLELISM = 2
QUANTILES = (("p50", 50.0), ("p99", 99.0), ("p99.9", 99.9), ("p99.99", 99.99))


def _config(name: str, work: str, max_batch_delay: float | None) -> JobConfig:
    extra = {}
    if max_batch_delay is not None and any(
            f.name == "max_batch_delay" for f in dataclasses.fields(JobConfig)):
        extra["max_batch_delay"] = max_batch_delay
    return JobConfig(name=name, snapshot_store=work, snapshot_interval=1.0,
                     local_parallelism=PARALLELISM, batch_size=BATCH, **extra)


def _latency(result) -> dict:
    if hasattr(result, "latency"):
        return result.latency
    out = {}
    for output, until in (("emitted", "emit"), ("committed", "commit")):
        values = result.latency_percentiles(*(q for _, q in QUANTILES), 100.0, until=until)
        out[output] = dict(zip([n for n, _ in QUANTILES] + ["max"], values)) | {"count": None}
    return out


def run(rate: float | None, events: int, work: str, max_batch_delay: float | None = None) -> dict:
    """One run: ``events`` events offered at ``rate`` per second (None: as fast as it goes)."""
    source = GeneratorSource(total=events, partitions=4, keys=KEYS, batch_size=BATCH, rate=rate)
    pipeline = (Pipeline().read_from(source)
                .group_by("key").aggregate(count="count", sum=("sum", "value"))
                .write_to(DiscardSink()))
    name = f"bench-latency-{rate or 'max'}"
    result = Job(pipeline, _config(name, work, max_batch_delay)).run(isolated=False)
    return {"events_per_s": events / result.seconds, "seconds": result.seconds,
            "latency": _latency(result)}


def visible(rate: float, events: int, work: str) -> dict:
    """Latency to rows a reader can see, measured from outside the job: the generator's
    events (stateless) into an upsert sink (SQLite, keyed by id, at-least-once, 1 s
    snapshots), whose table a thread reads every 10 ms; an id's latency is the read that
    first shows it minus its ``ts``. The same on any checkout, ``max_batch_delay`` or not."""
    import sqlite3
    import threading
    import time

    import numpy as np

    from sparkjet.sinks import SQLiteUpsertSink

    db = os.path.join(work, "out.db")
    source = GeneratorSource(total=events, partitions=4, keys=KEYS, batch_size=BATCH, rate=rate)
    pipeline = Pipeline().read_from(source).write_to(SQLiteUpsertSink(db, "out", key="id"))
    config = JobConfig(name="bench-visible", processing_guarantee="at-least-once",
                       snapshot_store=os.path.join(work, "snaps"), snapshot_interval=1.0,
                       local_parallelism=PARALLELISM, batch_size=BATCH)
    seen = np.zeros(events, dtype=np.int64)        # ns when each id was first read back
    done = threading.Event()

    def poll():
        last = -1
        while not done.is_set():
            time.sleep(0.01)
            try:
                con = sqlite3.connect(db)
                rows = con.execute("SELECT id, ts FROM out WHERE id > ?", (last,)).fetchall()
                con.close()
            except sqlite3.Error:
                continue
            now = time.time_ns()
            for i, ts in rows:
                if not seen[i]:
                    seen[i] = now - ts
            # ids arrive out of order across partitions: re-read from the least unseen id
            unseen = np.flatnonzero(seen == 0)
            last = int(unseen[0]) - 1 if len(unseen) else events

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    result = Job(pipeline, config).run(isolated=False)
    time.sleep(0.05)
    done.set()
    t.join()
    got = seen[seen != 0] / 1e9
    out = {"events_per_s": events / result.seconds, "count": len(got)}
    for name, q in QUANTILES:
        out[name] = float(np.percentile(got, q)) if len(got) else float("nan")
    out["max"] = float(got.max()) if len(got) else float("nan")
    return out


def median_run(rate, events, rounds, max_batch_delay=None) -> dict:
    """The run of median throughput (max rate) or median emitted p99 (a fixed rate)."""
    runs = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as work:
            runs.append(run(rate, events, work, max_batch_delay))
    key = ((lambda r: r["events_per_s"]) if rate is None
           else (lambda r: r["latency"]["emitted"]["p99"]))
    runs.sort(key=key)
    return runs[len(runs) // 2] | {"all": [key(r) for r in runs]}


def _ms(x) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:.1f}"


def format_rows(rows: list[tuple[str, dict]]) -> str:
    head = (f"{'offered':>12} {'events/s':>10} | emitted ms: {'p50':>6} {'p99':>6} {'p99.9':>6} "
            f"{'p99.99':>7} {'max':>7} | committed ms: {'p50':>6} {'p99':>6} {'p99.99':>7}")
    lines = [head]
    for label, r in rows:
        e, c = r["latency"]["emitted"], r["latency"]["committed"]
        lines.append(f"{label:>12} {r['events_per_s'] / 1e6:>8.2f}M | {'':11} {_ms(e['p50']):>6} "
                     f"{_ms(e['p99']):>6} {_ms(e['p99.9']):>6} {_ms(e['p99.99']):>7} "
                     f"{_ms(e['max']):>7} | {'':14} {_ms(c['p50']):>6} {_ms(c['p99']):>6} "
                     f"{_ms(c['p99.99']):>7}")
    return "\n".join(lines)


def machine() -> str:
    return (f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; local runner, one "
            f"member in process, local_parallelism={PARALLELISM}; {KEYS:,} keys; exactly-once, "
            "1 s snapshots")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch-delay", type=float, default=None,
                        help="JobConfig.max_batch_delay (default: the JobConfig default)")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    scale = 0.25 if args.quick else 1.0
    plan = [("10k/s", 10_000, int(100_000 * scale)),        # 10 s
            ("1M/s", 1_000_000, int(10_000_000 * scale)),   # 10 s
            ("max", None, int(20_000_000 * scale))]
    print(machine())
    rows = []
    for label, rate, events in plan:
        r = median_run(rate, events, rounds, args.max_batch_delay)
        rows.append((label, r))
        print(f"  {label}: {events:,} events, runs: "
              + ", ".join(f"{x / 1e6:.2f} M/s" if rate is None else f"p99 {x * 1e3:.1f} ms"
                          for x in r["all"]), flush=True)
    print(format_rows(rows))


# ---------------------------------------------------------------- pytest-benchmark mode


@pytest.fixture(scope="module")
def latency_rows(bench_summaries):
    rows: list = []
    yield rows
    if rows:
        bench_summaries.append(machine() + "\n" + format_rows(rows))


@pytest.mark.parametrize("label,rate,events", [("10k/s", 10_000, 50_000),
                                               ("1M/s", 1_000_000, 5_000_000),
                                               ("max", None, 10_000_000)])
def test_latency_and_throughput(benchmark, latency_rows, tmp_path, label, rate, events):
    benchmark.group = "keyed count+sum, end to end"
    out = {}

    def once():
        out["r"] = run(rate, events, str(tmp_path / f"s{len(out)}-{os.getpid()}"))

    benchmark.pedantic(once, rounds=1)
    r = out["r"]
    benchmark.extra_info.update(events_per_s=r["events_per_s"],
                                emitted=r["latency"]["emitted"],
                                committed=r["latency"]["committed"])
    latency_rows.append((label, r))


if __name__ == "__main__":
    main()
