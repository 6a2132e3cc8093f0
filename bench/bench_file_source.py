"""The directory source reading a directory of files, beside pyarrow's own readers of the
same files.

Files: ``--files`` files of ``--rows`` rows each (id int64, key int64, value float64, name
string of 8-12 characters), written once into a temporary directory on the local disk, as
Parquet (64K-row row groups) and as CSV. Each run reads every row of every file into Arrow
record batches of at most 65,536 rows and drops them:

- **sparkjet DirectorySource**: one reader of all 4 partitions, ``read(65536)`` until
  ``at_end()`` (listing, partition assignment, file cursors and the cast to the schema
  included), schema declared;
- **pyarrow.dataset**: ``ds.dataset(dir, format=...).to_batches(batch_size=65536)``, what a
  pyarrow user would write for a batch read of the directory (no replay, no new files);
- **pyarrow per file**: ``ParquetFile.iter_batches`` / ``csv.open_csv`` over the sorted
  files, one after the other: the floor the source's per-file reading cannot beat.

All use pyarrow's threads as they do by default. The median of ``--rounds`` runs, the
methods taking turns round by round.

Run: ``python bench/bench_file_source.py --files 40 --rows 50000`` (prints a table) or
``python -m pytest bench/bench_file_source.py --benchmark-only`` (20 files of 20,000 rows).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from sparkjet.connectors.base import ProcessorContext
from sparkjet.sources import DirectorySource

BATCH = 65_536
PARTITIONS = 4
SCHEMA = pa.schema([("id", pa.int64()), ("key", pa.int64()), ("value", pa.float64()),
                    ("name", pa.string())])
CTX = ProcessorContext(1, 1, "source", 0, 1)


def make_table(first: int, n: int, rng) -> pa.Table:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    lengths = rng.integers(8, 13, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    data = letters[rng.integers(0, 26, int(offsets[-1]))]
    names = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data.tobytes()))
    return pa.table({"id": np.arange(first, first + n, dtype=np.int64),
                     "key": rng.integers(0, 1_000_000, n), "value": rng.random(n),
                     "name": names}, schema=SCHEMA)


def make_dirs(root: str, files: int, rows: int) -> dict[str, str]:
    """One directory per format, the same rows in each."""
    rng = np.random.default_rng(0)
    dirs = {fmt: os.path.join(root, fmt) for fmt in ("parquet", "csv")}
    for d in dirs.values():
        os.makedirs(d)
    for f in range(files):
        table = make_table(f * rows, rows, rng)
        pq.write_table(table, os.path.join(dirs["parquet"], f"part-{f:05d}.parquet"),
                       row_group_size=BATCH)
        pcsv.write_csv(table, os.path.join(dirs["csv"], f"part-{f:05d}.csv"))
    return dirs


def sparkjet_source(path: str, fmt: str) -> int:
    reader = DirectorySource(path, fmt, schema=SCHEMA, partitions=PARTITIONS,
                             batch_size=BATCH).open(list(range(PARTITIONS)), CTX)
    n = 0
    while not reader.at_end():
        batch = reader.read(BATCH)
        if batch is not None:
            n += batch.num_rows
    reader.close()
    return n


def pyarrow_dataset(path: str, fmt: str) -> int:
    fmt_obj = ds.CsvFileFormat(convert_options=pcsv.ConvertOptions(column_types=SCHEMA)) \
        if fmt == "csv" else "parquet"
    return sum(b.num_rows for b in ds.dataset(path, format=fmt_obj)
               .to_batches(batch_size=BATCH))


def pyarrow_per_file(path: str, fmt: str) -> int:
    n = 0
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if fmt == "parquet":
            batches = pq.ParquetFile(full).iter_batches(batch_size=BATCH)
        else:
            batches = pcsv.open_csv(full, convert_options=pcsv.ConvertOptions(
                column_types=SCHEMA))
        n += sum(b.num_rows for b in batches)
    return n


METHODS = {"sparkjet DirectorySource": sparkjet_source, "pyarrow.dataset": pyarrow_dataset,
           "pyarrow per file": pyarrow_per_file}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--rows", type=int, default=50_000, help="rows per file")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    total = args.files * args.rows
    with tempfile.TemporaryDirectory() as root:
        dirs = make_dirs(root, args.files, args.rows)
        print(f"{args.files} files of {args.rows:,} rows ({total:,} rows); load average "
              f"{os.getloadavg()[0]:.2f}")
        print(f"{'format':9}{'method':27}{'rows/s':>10}{'÷ sparkjet':>12}")
        for fmt, path in dirs.items():
            times: dict[str, list[float]] = {name: [] for name in METHODS}
            for method in METHODS.values():
                method(path, fmt)   # warm the page cache and pyarrow's pools
            # Rounds take turns between the methods, so that a change in the machine's load
            # falls on all of them alike.
            for _ in range(args.rounds):
                for name, method in METHODS.items():
                    start = time.perf_counter()
                    assert method(path, fmt) == total, name
                    times[name].append(time.perf_counter() - start)
            rates = {name: total / statistics.median(t) for name, t in times.items()}
            base = rates["sparkjet DirectorySource"]
            for name, rate in rates.items():
                ratio = "" if name.startswith("sparkjet") else f"{rate / base:.2f}"
                print(f"{fmt:9}{name:27}{rate / 1e6:>8.2f} M{ratio:>12}")


# -- pytest-benchmark ----------------------------------------------------------------------

FILES, ROWS = 20, 20_000


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(str(tmp_path_factory.mktemp("files")), FILES, ROWS)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("method", list(METHODS))
def test_read_directory(benchmark, dirs, fmt, method):
    benchmark.group = fmt
    rows = benchmark.pedantic(METHODS[method], args=(dirs[fmt], fmt), rounds=5, warmup_rounds=1)
    assert rows == FILES * ROWS


if __name__ == "__main__":
    main()
