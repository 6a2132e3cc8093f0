"""The Delta Lake sink's writer, one processor into one local table, beside a plain
``deltalake.write_deltalake`` of the same rows.

Rows: (id int64, key int64, value float64, name string of 8-12 characters), N of them in
64K-row Arrow batches, made before anything is timed.

- **sparkjet exactly-once**: ``DeltaSink(path)``'s writer: ``write`` every batch, ``prepare``
  (the epoch staged as one fsynced Arrow IPC file) and ``commit`` (one Delta append with the
  processor's application transactions, then the staged file deleted). Timed from the first
  write to the end of the commit: the price of exactly-once is the staging.
- **sparkjet at-least-once**: the same writer under at-least-once: ``write`` every batch and
  ``prepare`` (one Delta append, fenced; nothing staged).
- **write_deltalake**: ``deltalake.write_deltalake(path, table, mode="append")`` of the
  same rows as one table: what a user of delta-rs would write, with no guarantee across
  restarts.

Each method runs into a fresh table; the median of ``--rounds`` runs is reported.

Run: ``python bench/bench_delta.py --rows 2000000`` (prints a table) or
``python -m pytest bench/bench_delta.py --benchmark-only`` (200,000 rows).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from sparkjet.connectors.base import ProcessorContext
from sparkjet.sinks import DeltaSink

BATCH = 65_536


def make_rows(n: int, seed: int = 0) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    lengths = rng.integers(8, 13, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    data = letters[rng.integers(0, 26, int(offsets[-1]))]
    names = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data.tobytes()))
    table = pa.table({"id": np.arange(n, dtype=np.int64),
                      "key": rng.integers(0, 1_000_000, n), "value": rng.random(n),
                      "name": names})
    return table.to_batches(BATCH)


def fresh(path: Path) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


def sparkjet_writer(path: Path, batches: list, guarantee: str) -> float:
    w = DeltaSink(fresh(path)).open(ProcessorContext(1, 1, "delta", 0, 1, guarantee))
    w.recover(None, None)
    start = time.perf_counter()
    for b in batches:
        w.write(b)
    w.prepare(1)
    w.commit(1)
    seconds = time.perf_counter() - start
    w.close()
    return seconds


def plain_write_deltalake(path: Path, batches: list) -> float:
    from deltalake import write_deltalake

    target = fresh(path)
    start = time.perf_counter()
    write_deltalake(target, pa.Table.from_batches(batches), mode="append")
    return time.perf_counter() - start


def count(path: Path) -> int:
    return DeltaSink.read(path, columns=["id"]).num_rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the tables go (default: a temporary "
                                                    "directory)")
    args = parser.parse_args(argv)
    batches = make_rows(args.rows)
    with tempfile.TemporaryDirectory(prefix="sparkjet-bench-delta-", dir=args.dir) as tmp:
        path = Path(tmp) / "table"
        runs = {
            "sparkjet exactly-once (staged)": lambda: sparkjet_writer(path, batches,
                                                                      "exactly-once"),
            "sparkjet at-least-once": lambda: sparkjet_writer(path, batches, "at-least-once"),
            "write_deltalake (no guarantee)": lambda: plain_write_deltalake(path, batches),
        }
        print(f"{args.rows:,} rows in {BATCH:,}-row batches, one processor, one local table; "
              f"load average {os.getloadavg()[0]:.2f}")
        rates = {}
        for name, run in runs.items():
            times = [run() for _ in range(args.rounds)]
            assert count(path) == args.rows, f"{name}: {count(path)} rows, not {args.rows}"
            rates[name] = args.rows / statistics.median(times)
        plain = rates["write_deltalake (no guarantee)"]
        print(f"{'method':34}{'rows/s':>12}{'of write_deltalake':>20}")
        for name, rate in rates.items():
            print(f"{name:34}{rate / 1e3:>10.0f} K{rate / plain:>19.0%}")


# -- pytest-benchmark ----------------------------------------------------------------------

ROWS = 200_000


@pytest.fixture(scope="module")
def batches():
    return make_rows(ROWS)


def test_sparkjet_exactly_once(benchmark, tmp_path, batches):
    benchmark.pedantic(sparkjet_writer, args=(tmp_path / "t", batches, "exactly-once"), rounds=3)
    assert count(tmp_path / "t") == ROWS


def test_sparkjet_at_least_once(benchmark, tmp_path, batches):
    benchmark.pedantic(sparkjet_writer, args=(tmp_path / "t", batches, "at-least-once"),
                       rounds=3)
    assert count(tmp_path / "t") == ROWS


def test_write_deltalake(benchmark, tmp_path, batches):
    benchmark.pedantic(plain_write_deltalake, args=(tmp_path / "t", batches), rounds=3)
    assert count(tmp_path / "t") == ROWS


if __name__ == "__main__":
    main()
