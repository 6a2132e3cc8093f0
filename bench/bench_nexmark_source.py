"""How fast :class:`~sparkjet.sources.NexmarkSource` generates events on one core.

One reader of one partition reads batches of 65,536 rows until it has ``rows`` (bids) or a
quarter of that (auctions, persons, 16 and 46 times rarer in the stream), ``rounds`` times
in a row; the text tables are built before the clock starts. Rows per second by the wall
clock and by the process's CPU time, best and median of the rounds: on a shared machine
the best CPU figure says most about the generator itself.

    python bench/bench_nexmark_source.py            # a table, about 20 s
    python -m pytest bench/bench_nexmark_source.py --benchmark-only
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import pytest

from sparkjet.connectors.base import ProcessorContext
from sparkjet.sources import NexmarkSource

KINDS = ("bid", "auction", "person")
ROWS = 1_000_000
BATCH = 65_536
CONTEXT = ProcessorContext(job_id=0, execution_id=0, vertex="bench", processor=0, processors=1)


def _reader(kind: str):
    reader = NexmarkSource(kind=kind, partitions=1, batch_size=BATCH).open([0], CONTEXT)
    reader.read(1000)   # builds the text tables
    return reader


def _read(reader, rows: int) -> int:
    got = 0
    while got < rows:
        got += reader.read(BATCH).num_rows
    return got


def measure(kind: str, rows: int = ROWS, rounds: int = 8) -> dict:
    """Rows per second of ``kind`` from one reader, ``rounds`` times: the lists ``wall``
    and ``cpu``."""
    reader = _reader(kind)
    rows = rows if kind == "bid" else rows // 4
    result: dict = {"kind": kind, "wall": [], "cpu": []}
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        got = _read(reader, rows)
        result["wall"].append(got / (time.perf_counter() - wall))
        result["cpu"].append(got / (time.process_time() - cpu))
    return result


@pytest.mark.parametrize("kind", KINDS)
def test_nexmark_source(benchmark, kind):
    benchmark.group = "NEXMark generator, one reader"
    reader = _reader(kind)
    rows = 1_000_000 if kind == "bid" else 250_000
    benchmark.pedantic(_read, args=(reader, rows), rounds=3, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["M_rows_per_s"] = rows / benchmark.stats.stats.median / 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS, help="bids per round (1M)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per kind (8)")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; M rows/s, "
          f"best / median of {args.rounds} rounds")
    print(f"{'kind':8}{'wall':>14}{'CPU':>14}")
    for kind in KINDS:
        r = measure(kind, args.rows, args.rounds)
        print(f"{kind:8}" + "".join(f"{max(r[c]) / 1e6:>8.2f} / {statistics.median(r[c]) / 1e6:.2f}"
                                    for c in ("wall", "cpu")))


if __name__ == "__main__":
    main()
