"""What TLS costs a job: a keyed count and sum over 10M generated events (1M keys) on
``local[2]`` with two members and exactly-once snapshots every second, with the links
authenticated only (``tls=False``, the ``local[N]`` default) and authenticated and
encrypted (``tls=True``, the default on a cluster), run alternately in one process.

Run: ``python bench/bench_tls_job.py`` (prints a table) or
``python -m pytest bench/bench_tls_job.py --benchmark-only``.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import pytest

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

EVENTS = 10_000_000
KEYS = 1_000_000
BATCH = 65_536


def run(spark, tls: bool, events: int, work: str) -> float:
    """Events per second from the members' start to the terminal snapshot."""
    source = GeneratorSource(total=events, partitions=4, keys=KEYS, batch_size=BATCH)
    pipeline = (Pipeline().read_from(source)
                .group_by("key").aggregate(count="count", sum=("sum", "value"))
                .write_to(DiscardSink()))
    config = JobConfig(name=f"tls-{tls}-{time.time_ns()}", snapshot_store=work,
                       snapshot_interval=1.0, members=2, local_parallelism=1,
                       batch_size=BATCH, tls=tls)
    marks: dict[str, float] = {}

    def on_progress(event):
        if event["event"] == "started":
            marks.setdefault("t0", time.monotonic())

    Job(pipeline, config).run(spark, on_progress=on_progress)
    return events / (time.monotonic() - marks["t0"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=EVENTS)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating (3)")
    args = parser.parse_args(argv)
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "sparkjet-bench-tls",
                          **{"spark.ui.showConsoleProgress": "false"})
    rates: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as work:
        run(spark, False, args.events // 10, f"{work}/warm")  # JVM and workers warm
        for r in range(args.rounds):
            for tls in (False, True):
                rates[tls].append(run(spark, tls, args.events, f"{work}/{tls}-{r}"))
                print(f"  tls={tls!s:<5} {rates[tls][-1] / 1e6:6.2f} M events/s", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print()
    print("| links | M events/s (median) | × authenticated-only |")
    print("|---|---:|---:|")
    print(f"| authenticated (tls=False) | {off / 1e6:.2f} | 1.00 |")
    print(f"| authenticated + TLS (tls=True) | {on / 1e6:.2f} | {on / off:.2f} |")
    spark.stop()


@pytest.fixture(scope="module")
def spark():
    from sparkjet.spark import local_session

    session = local_session("local[2]", "sparkjet-bench-tls")
    yield session
    session.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["auth-only", "auth+tls"])
def test_job_with_tls(benchmark, spark, tmp_path, tls):
    benchmark.group = "keyed job on local[2], 10M events, exactly-once 1 s"
    benchmark.pedantic(lambda: run(spark, tls, EVENTS, str(tmp_path / f"s{time.time_ns()}")),
                       rounds=2, warmup_rounds=0)


if __name__ == "__main__":
    main()
