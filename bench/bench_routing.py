"""Routing a batch to its target processors (issue 28 item 5): the rows of each target
together, in row order, as sparkjet's outbox splits every batch of a partitioned edge
(``sparkjet._batches.split_by``: one native counting pass, each fixed-width column moved
once), beside what Python code would use instead:

- ``argsort + take``: numpy's stable argsort of the targets and one pyarrow ``take`` of the
  batch, sliced per target (what split_by did before, and still does for values beyond
  the native path's range: ``split_by_sorting``);
- ``filter per target``: one pyarrow ``filter`` of the batch per target;
- ``polars partition_by``: ``DataFrame.partition_by`` on the target column (one thread).

Workload: 64K-row batches (int64 id and key, float64 value), targets uniform over 2 and
over 16 processors. Medians of several rounds in one process, interleaved; every way's
parts are checked equal to split_by's. No time is ever asserted::

    python bench/bench_routing.py
    python -m pytest bench/bench_routing.py --benchmark-only
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import pyarrow as pa
import pytest

from sparkjet._batches import split_by, split_by_sorting

os.environ["POLARS_MAX_THREADS"] = "1"
import polars as pl  # noqa: E402

ROWS = 65_536


def batch_and_targets(targets: int, seed: int = 1) -> tuple[pa.RecordBatch, np.ndarray]:
    rng = np.random.default_rng(seed)
    batch = pa.record_batch({"id": np.arange(ROWS, dtype=np.int64),
                             "key": rng.integers(0, 1_000_000, ROWS),
                             "value": rng.random(ROWS)})
    return batch, rng.integers(0, targets, ROWS).astype(np.int32)


def filter_each(batch: pa.RecordBatch, values: np.ndarray) -> list:
    return [(int(v), batch.filter(pa.array(values == v))) for v in np.unique(values)]


def polars_partition(frame: pl.DataFrame) -> list:
    return frame.partition_by("target", maintain_order=True, as_dict=False)


WAYS = {
    "sparkjet split_by": lambda b, v, f: split_by(b, v),
    "argsort + take": lambda b, v, f: split_by_sorting(b, v),
    "filter per target": lambda b, v, f: filter_each(b, v),
    "polars partition_by": lambda b, v, f: polars_partition(f),
}


def check(batch: pa.RecordBatch, values: np.ndarray, frame: pl.DataFrame) -> None:
    """Every way gives split_by's parts (polars: the same rows per target, in order)."""
    want = [(k, rows.to_pydict()) for k, rows in split_by(batch, values)]
    for name in ("argsort + take", "filter per target"):
        got = [(k, rows.to_pydict()) for k, rows in WAYS[name](batch, values, frame)]
        assert got == want, name
    parts = sorted(polars_partition(frame), key=lambda d: d["target"][0])
    assert [p.drop("target").to_dict(as_series=False) for p in parts] == [w for _, w in want]


def measure(targets: int, rounds: int = 15, loops: int = 20) -> dict[str, float]:
    """Microseconds per 64K-row batch, median of ``rounds`` interleaved rounds."""
    batch, values = batch_and_targets(targets)
    frame = pl.from_arrow(pa.Table.from_batches([batch])).with_columns(
        pl.Series("target", values))
    check(batch, values, frame)
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(rounds):
        for name, way in WAYS.items():
            start = time.perf_counter()
            for _ in range(loops):
                way(batch, values, frame)
            times[name].append((time.perf_counter() - start) / loops * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def table(results: dict[int, dict[str, float]]) -> str:
    lines = [f"{'64K rows to':22}" + "".join(f"{f'{t} targets (us)':>18}{'x':>7}"
                                             for t in results)]
    for name in WAYS:
        row = f"{name:22}"
        for r in results.values():
            row += f"{r[name]:>18.0f}{r[name] / r['sparkjet split_by']:>7.2f}"
        lines.append(row)
    return "\n".join(lines)


@pytest.mark.parametrize("targets", [2, 16])
@pytest.mark.parametrize("way", list(WAYS))
def test_routing(benchmark, way, targets):
    batch, values = batch_and_targets(targets)
    frame = pl.from_arrow(pa.Table.from_batches([batch])).with_columns(
        pl.Series("target", values))
    benchmark(WAYS[way], batch, values, frame)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    results = {t: measure(t, args.rounds) for t in (2, 16)}
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; x: time over split_by's")
    print(table(results))


if __name__ == "__main__":
    main()
