"""Batches: a sink's input as record batches, and a batch split by a per-row integer (the rows
of each value together, in row order)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa


def record_batches(data: pa.RecordBatch | pa.Table) -> list[pa.RecordBatch]:
    """The non-empty record batches of ``data``: a RecordBatch, or a Table (what a sink's
    writer may be given)."""
    batches = data.to_batches() if isinstance(data, pa.Table) else [data]
    return [b for b in batches if b.num_rows]


def split_by(batch: pa.RecordBatch, values: np.ndarray) -> list[tuple[int, pa.RecordBatch]]:
    """``(value, rows)`` for each distinct value of ``values`` (one per row of ``batch``),
    in increasing value order; each part keeps the rows' order. A batch of one value is
    returned whole, without a copy."""
    first = values[0]
    if (values == first).all():
        return [(int(first), batch)]
    if values.dtype.itemsize > 2 and 0 <= values.min() and values.max() < 1 << 16:
        # numpy's stable sort is a radix sort for 16-bit and narrower integers: about
        # twice as fast as the merge sort of int64 for a 64K-row batch
        values = values.astype(np.uint8 if values.max() < 1 << 8 else np.uint16)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    cuts = np.flatnonzero(np.diff(ordered)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(order)]))
    taken = batch.take(pa.array(order))
    return [(int(ordered[s]), taken.slice(s, e - s)) for s, e in zip(starts.tolist(), ends.tolist())]
