"""Batches: a sink's input as record batches, and a batch split by a per-row integer (the rows
of each value together, in row order)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet.errors import InvalidArgumentError


def record_batches(data: pa.RecordBatch | pa.Table) -> list[pa.RecordBatch]:
    """The non-empty record batches of ``data``: a RecordBatch, or a Table (what a sink's
    writer may be given)."""
    batches = data.to_batches() if isinstance(data, pa.Table) else [data]
    return [b for b in batches if b.num_rows]


def one_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``column`` as one Array: its only chunk as it is, or its chunks concatenated.
    (``ChunkedArray.combine_chunks`` copies even a single chunk: 40 MB of int64s cost
    about 10 ms, and a table built from one batch has a single chunk per column.)"""
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column


def split_by(batch: pa.RecordBatch, values: np.ndarray) -> list[tuple[int, pa.RecordBatch]]:
    """``(value, rows)`` for each distinct value of ``values`` (one per row of ``batch``),
    in increasing value order; each part keeps the rows' order. A batch of one value is
    returned whole, without a copy."""
    first = values[0]
    if (values == first).all():
        return [(int(first), batch)]
    low, high = values.min(), values.max()
    if values.dtype.kind in "iu" and 0 <= low and high < _GROUPED_VALUES:
        # small non-negative values (a target processor, a partition, an ordinal): one
        # counting pass and each column moved once, in native code (group_rows)
        ordered, starts = group_rows(batch, values.astype(np.int32, copy=False), int(high) + 1)
        present = np.flatnonzero(np.diff(starts))
        return [(int(v), ordered.slice(int(starts[v]), int(starts[v + 1] - starts[v])))
                for v in present]
    return split_by_sorting(batch, values)


def split_by_sorting(batch: pa.RecordBatch, values: np.ndarray) -> list[tuple[int, pa.RecordBatch]]:
    """:func:`split_by` by a stable sort of ``values`` and one ``take`` of the batch, for
    values of any range (``bench/bench_routing.py`` measures it beside the native path)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    cuts = np.flatnonzero(np.diff(ordered)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(order)]))
    taken = batch.take(pa.array(order))
    return [(int(ordered[s]), taken.slice(s, e - s)) for s, e in zip(starts.tolist(), ends.tolist())]


#: split_by groups rows by values below this natively (a counting pass over as many buckets).
_GROUPED_VALUES = 1 << 16


def group_rows(data: pa.RecordBatch | pa.Table, ids: np.ndarray, count: int,
               alloc=None) -> tuple[pa.RecordBatch, np.ndarray]:
    """The rows of ``data`` grouped by ``ids`` (one int32 per row, each in
    ``0..count - 1``), keeping their order within a group, as one RecordBatch, and where
    each id's rows start (``count + 1`` values, the last the row count). Fixed-width
    columns without nulls move in one native pass each (``_native.scatter_fixed``) into a
    buffer from ``alloc(nbytes)`` (a writable buffer; default ``pa.allocate_buffer``); the
    others through one ``take`` of the native counting sort's row order. An id outside
    ``0..count - 1`` is refused (InvalidArgumentError naming its index)."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    n = len(ids)
    if n != data.num_rows:
        raise InvalidArgumentError(f"group_rows: {n} ids for {data.num_rows} rows")
    starts = np.empty(count + 1, np.int64)
    _native.scatter(ids, count, starts, None)
    perm = None
    columns = []
    for column in data.columns:
        column = one_array(column)
        t = column.type
        width = fixed_width(column)
        if width:
            data_buffer = column.buffers()[1]
            out = (alloc or pa.allocate_buffer)(n * width)
            _native.scatter_fixed(data_buffer.slice(column.offset * width, n * width), width,
                                  ids, starts, out)
            columns.append(pa.Array.from_buffers(t, n, [None, out]))
        else:
            if perm is None:
                perm = np.empty(n, np.int64)
                _native.scatter(ids, count, np.empty(count + 1, np.int64), perm)
            columns.append(column.take(perm))
    return pa.RecordBatch.from_arrays(columns, schema=data.schema), starts


def fixed_width(column: pa.Array | pa.ChunkedArray) -> int:
    """The bytes each value of ``column`` takes when it is of a fixed width in whole bytes
    and holds no null (what moves in one plain pass: :func:`group_rows`,
    :func:`copy_fixed`); 0 otherwise."""
    t = column.type
    if pa.types.is_primitive(t) and t.bit_width % 8 == 0 and column.null_count == 0:
        return t.bit_width // 8
    return 0


def copy_fixed(data: pa.RecordBatch | pa.Table, alloc=None) -> pa.RecordBatch | None:
    """A copy of ``data`` as one RecordBatch whose columns own their memory (from
    ``alloc(nbytes)``, as :func:`group_rows` takes it): one plain copy per column, when
    every column is of fixed width without nulls; None otherwise (nothing copied). What a
    snapshot takes of state that goes on changing: a copy is a third of the time grouping
    the rows by partition takes, which can then happen elsewhere."""
    columns = [one_array(c) for c in data.columns]
    widths = [fixed_width(c) for c in columns]
    if not all(widths):
        return None
    n = data.num_rows
    out = []
    for column, width in zip(columns, widths):
        into = (alloc or pa.allocate_buffer)(n * width)
        source = column.buffers()[1].slice(column.offset * width, n * width)
        np.copyto(np.frombuffer(into, np.uint8), np.frombuffer(source, np.uint8))
        out.append(pa.Array.from_buffers(column.type, n, [None, into]))
    return pa.RecordBatch.from_arrays(out, schema=data.schema)
