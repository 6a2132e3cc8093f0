"""split_by and group_rows (sparkjet._batches): the rows of each value together, in row
order, against a plain reference (a stable filter per value), for every column kind the
native path moves and those it leaves to take."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from sparkjet._batches import copy_fixed, group_rows, split_by
from sparkjet.errors import InvalidArgumentError


def _batch(n: int, rng: np.random.Generator) -> pa.RecordBatch:
    ints = rng.integers(-10**12, 10**12, n)
    return pa.record_batch({
        "int64": ints,
        "int32": ints.astype(np.int32),
        "int8": ints.astype(np.int8),
        "float64": rng.random(n),
        "nullable": pa.array([None if i % 7 == 3 else i for i in range(n)], pa.int64()),
        "bool": pa.array(rng.random(n) < 0.5),
        "string": pa.array([f"s{i}" * (i % 4) for i in range(n)]),
        "ts": pa.array(ints, pa.timestamp("us")),
    })


def _reference(batch: pa.RecordBatch, values: np.ndarray) -> list[tuple[int, dict]]:
    return [(int(v), batch.filter(pa.array(values == v)).to_pydict())
            for v in np.unique(values)]


@pytest.mark.parametrize("high", [2, 3, 271, 1 << 16, 1 << 40])
def test_split_by_groups_rows_as_a_stable_filter_per_value(high):
    rng = np.random.default_rng(high % 1000)
    n = 1_500
    batch = _batch(n, rng)
    values = rng.integers(0, high, n)
    got = [(k, rows.to_pydict()) for k, rows in split_by(batch, values)]
    assert got == _reference(batch, values)


def test_split_by_a_sliced_batch_and_negative_values():
    rng = np.random.default_rng(5)
    batch = _batch(3_000, rng).slice(700, 1_500)     # columns with an offset
    for values in (rng.integers(0, 4, 1_500), rng.integers(-3, 3, 1_500)):
        got = [(k, rows.to_pydict()) for k, rows in split_by(batch, values)]
        assert got == _reference(batch, values)


def test_split_by_float_values_keeps_them_apart():
    batch = _batch(4, np.random.default_rng(3))
    got = [(k, rows.num_rows) for k, rows in split_by(batch, np.array([1.2, 1.7, 1.2, 0.5]))]
    assert [n for _, n in got] == [1, 2, 1]


def test_split_by_one_value_returns_the_batch_itself():
    batch = _batch(100, np.random.default_rng(1))
    [(value, rows)] = split_by(batch, np.full(100, 3))
    assert value == 3 and rows is batch


def test_group_rows_refuses_ids_out_of_range_and_a_wrong_count():
    batch = _batch(10, np.random.default_rng(2))
    with pytest.raises(InvalidArgumentError, match="index 4 is outside 0..2"):
        group_rows(batch, np.array([0, 1, 2, 0, 3, 0, 0, 0, 0, 0], np.int32), 3)
    with pytest.raises(InvalidArgumentError, match="9 ids for 10 rows"):
        group_rows(batch, np.zeros(9, np.int32), 1)
    ordered, starts = group_rows(pa.Table.from_batches([batch]), np.arange(10) % 2, 2)
    assert starts.tolist() == [0, 5, 10]
    assert ordered.column("string").to_pylist() == (
        batch.column("string").to_pylist()[0::2] + batch.column("string").to_pylist()[1::2])


def test_copy_fixed_copies_fixed_width_columns_into_memory_of_their_own():
    """copy_fixed: every column moved into a buffer from alloc (or a fresh one), so the
    source's arrays can change afterwards; a sliced, chunked source copies its rows; a
    column of variable width, bits or with nulls copies nothing (None)."""
    rng = np.random.default_rng(5)
    values = rng.integers(-10**12, 10**12, 1_000)
    floats = rng.random(1_000)
    table = pa.Table.from_batches([
        pa.record_batch({"k": values[:600], "f": floats[:600],
                         "t": pa.array(values[:600], pa.timestamp("us"))}),
        pa.record_batch({"k": values[600:], "f": floats[600:],
                         "t": pa.array(values[600:], pa.timestamp("us"))}),
    ]).slice(100, 800)
    want = table.to_pydict()
    taken = []

    def alloc(nbytes):
        taken.append(nbytes)
        return pa.py_buffer(bytearray(nbytes))

    copy = copy_fixed(table, alloc)
    assert copy.schema == table.schema and copy.to_pydict() == want
    assert taken == [800 * 8] * 3
    live = values.copy()
    batch = pa.record_batch({"k": pa.array(live)})     # (zero copy: it shows live's memory)
    copy = copy_fixed(batch)
    live[:] = 0                                         # the state goes on changing
    assert batch.column(0).to_pylist()[:3] == [0, 0, 0]
    assert copy.column(0).to_pylist() == values.tolist()
    for column in (pa.array(["a", "b"]), pa.array([True, False]), pa.array([1, None])):
        assert copy_fixed(pa.record_batch({"c": column})) is None
