"""The PostgreSQL sink's writers, one processor into one table, beside what a psycopg user
would write instead.

Rows: (id int64, key int64, value float64, name string of 8-12 characters), N of them in
64K-row Arrow batches, made before anything is timed.

- **sparkjet transactional**: ``PostgresSink(dsn, table)``'s writer under exactly-once:
  ``write`` every batch (``COPY ... FROM STDIN (FORMAT csv)``, the CSV written by Arrow),
  ``prepare`` (the fence check and ``PREPARE TRANSACTION``) and ``commit`` (``COMMIT
  PREPARED``), into an empty table. Timed from the first write to the end of the commit.
- **sparkjet upsert, inserts / updates**: ``mode="upsert", key="id"``: ``write`` every batch,
  then ``prepare`` (the flush: last row per key in key order, ``COPY`` into a temporary
  table, ``MERGE``; ``INSERT ... ON CONFLICT (id) DO UPDATE`` before PostgreSQL 15), first
  into an empty table (every row new), then the same rows again (every row an update).
- **psycopg COPY, write_row**: ``cursor.copy(...)`` with ``copy.write_row`` per row from
  Python tuples (``zip`` of the columns' ``to_pylist()``, conversion included), one
  transaction.
- **psycopg executemany INSERT / ... ON CONFLICT**: ``cursor.executemany`` (psycopg 3 runs
  it in pipeline mode) of the same tuples, on the first ``--sample`` rows (default 200,000;
  it is slower), one transaction.

The server: by default a throwaway one (tests/helpers/postgres_server.py: Debian's binaries,
``initdb`` in a temporary directory) with its durable defaults (``fsync``, full page writes,
synchronous commit), or ``--dsn``. Each method runs into a fresh table; the median of
``--rounds`` runs is reported.

Run: ``python bench/bench_postgres.py --rows 2000000`` (prints a table) or
``python -m pytest bench/bench_postgres.py --benchmark-only`` (200,000 rows).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import postgres_server  # noqa: E402 - after the path

from sparkjet.connectors.base import ProcessorContext  # noqa: E402
from sparkjet.sinks import PostgresSink  # noqa: E402

BATCH = 65_536
TABLE = "bench_rows"
COLUMNS = "(id bigint, key bigint, value double precision, name text)"


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


def fresh(dsn: str, table: str = TABLE) -> None:
    PostgresSink.drop(dsn, table)


def context(execution: int = 1) -> ProcessorContext:
    return ProcessorContext(1, execution, "sink", 0, 1, "exactly-once")


def sparkjet_transactional(dsn: str, batches: list) -> float:
    fresh(dsn)
    w = PostgresSink(dsn, TABLE).open(context())
    w.recover(None, None)
    start = time.perf_counter()
    for b in batches:
        w.write(b)
    w.prepare(1)
    w.commit(1)
    seconds = time.perf_counter() - start
    w.close()
    return seconds


def sparkjet_upsert(dsn: str, batches: list, updates: bool) -> float:
    fresh(dsn)
    sink = PostgresSink(dsn, TABLE, mode="upsert", key="id")
    if updates:
        w = sink.open(context(1))
        w.recover(None, None)
        for b in batches:
            w.write(b)
        w.close()
    w = sink.open(context(2))
    w.recover(None, None)
    start = time.perf_counter()
    for b in batches:
        w.write(b)
    w.prepare(1)
    seconds = time.perf_counter() - start
    w.close()
    return seconds


def _tuples(batches: list) -> list[tuple]:
    out = []
    for b in batches:
        out.extend(zip(*(c.to_pylist() for c in b.columns)))
    return out


def psycopg_copy_write_row(dsn: str, batches: list) -> float:
    import psycopg

    fresh(dsn)
    with psycopg.connect(dsn) as con:
        con.execute(f"CREATE TABLE {TABLE} {COLUMNS}")
        con.commit()
        start = time.perf_counter()
        with con.cursor() as cur:
            with cur.copy(f"COPY {TABLE} (id, key, value, name) FROM STDIN") as copy:
                for b in batches:
                    for row in zip(*(c.to_pylist() for c in b.columns)):
                        copy.write_row(row)
        con.commit()
        return time.perf_counter() - start


def psycopg_executemany(dsn: str, batches: list, sample: int, upsert: bool) -> tuple[float, int]:
    import psycopg

    fresh(dsn)
    rows = _tuples(batches)[:sample]
    key = " PRIMARY KEY" if upsert else ""
    with psycopg.connect(dsn) as con:
        con.execute(f"CREATE TABLE {TABLE} (id bigint{key}, key bigint, value double precision, "
                    "name text)")
        con.commit()
        statement = f"INSERT INTO {TABLE} (id, key, value, name) VALUES (%s, %s, %s, %s)"
        if upsert:
            statement += (" ON CONFLICT (id) DO UPDATE SET key = excluded.key, "
                          "value = excluded.value, name = excluded.name")
        start = time.perf_counter()
        with con.cursor() as cur:
            cur.executemany(statement, rows)
        con.commit()
        return time.perf_counter() - start, len(rows)


def count(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn) as con:
        return con.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--sample", type=int, default=200_000,
                        help="rows for the executemany methods (default 200,000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=None, help="default: a throwaway durable server")
    args = parser.parse_args(argv)
    server = None if args.dsn else postgres_server.start(durable=True)
    dsn = args.dsn or server.dsn
    try:
        batches = make_rows(args.rows)
        n = args.rows
        runs = {
            "sparkjet transactional (COPY, 2PC)": (n, lambda: sparkjet_transactional(dsn, batches)),
            "sparkjet upsert, inserts": (n, lambda: sparkjet_upsert(dsn, batches, False)),
            "sparkjet upsert, updates": (n, lambda: sparkjet_upsert(dsn, batches, True)),
            "psycopg COPY, write_row": (n, lambda: psycopg_copy_write_row(dsn, batches)),
            "psycopg executemany INSERT": (
                min(n, args.sample),
                lambda: psycopg_executemany(dsn, batches, args.sample, False)[0]),
            "psycopg executemany ON CONFLICT": (
                min(n, args.sample),
                lambda: psycopg_executemany(dsn, batches, args.sample, True)[0]),
        }
        with_server = "throwaway durable server" if server else "--dsn"
        print(f"{n:,} rows in {BATCH:,}-row batches, one processor, one table ({with_server}); "
              f"load average {os.getloadavg()[0]:.2f}")
        rates = {}
        for name, (rows, run) in runs.items():
            times = [run() for _ in range(args.rounds)]
            assert count(dsn) == rows, f"{name}: {count(dsn)} rows in the table, not {rows}"
            rates[name] = rows / statistics.median(times)
        base_copy = rates["sparkjet transactional (COPY, 2PC)"]
        base_upsert = rates["sparkjet upsert, inserts"]
        print(f"{'method':36}{'rows timed':>12}{'rows/s':>12}{'sparkjet is ×':>15}")
        for name, rate in rates.items():
            rows = runs[name][0]
            base = base_upsert if "CONFLICT" in name else base_copy
            ratio = "" if name.startswith("sparkjet") else f"{base / rate:.1f}"
            print(f"{name:36}{rows:>12,}{rate / 1e3:>10.0f} K{ratio:>15}")
    finally:
        if server is not None:
            server.stop()


# -- pytest-benchmark ----------------------------------------------------------------------

ROWS = 200_000


@pytest.fixture(scope="module")
def dsn():
    server = postgres_server.start(durable=True)
    yield server.dsn
    server.stop()


@pytest.fixture(scope="module")
def batches():
    return make_rows(ROWS)


def test_sparkjet_transactional(benchmark, dsn, batches):
    benchmark.pedantic(sparkjet_transactional, args=(dsn, batches), rounds=3)
    assert count(dsn) == ROWS


def test_sparkjet_upsert(benchmark, dsn, batches):
    benchmark.pedantic(sparkjet_upsert, args=(dsn, batches, False), rounds=3)
    assert count(dsn) == ROWS


def test_psycopg_copy_write_row(benchmark, dsn, batches):
    benchmark.pedantic(psycopg_copy_write_row, args=(dsn, batches), rounds=3)


def test_psycopg_executemany(benchmark, dsn, batches):
    benchmark.pedantic(psycopg_executemany, args=(dsn, batches, 50_000, False), rounds=3)


if __name__ == "__main__":
    main()
