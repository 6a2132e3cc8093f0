"""Arrow entries to what the native Merkle kernels hash: the key and value columns of a
table, their native column tuples, and value columns (nulls included) as int32 hashes.

Private to :mod:`sparkjet.merkle`; the value types and how each hashes are in the
package doc.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet._keys import chunks, describe, is_integer, key_names
from sparkjet.errors import InvalidArgumentError, UnsupportedTypeError
from sparkjet.partitioning import murmur3_32


def as_table(data: Any) -> pa.Table:
    """A Table from a Table, a RecordBatch or an Arrow stream."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if hasattr(data, "__arrow_c_stream__"):
        return pa.table(data)
    raise InvalidArgumentError(
        f"key= selects columns of a Table or RecordBatch, got {type(data).__name__}"
    )


def column_names(value: str | Sequence[str] | None, what: str) -> tuple[str, ...]:
    """A column name or a list of them as a tuple of names (``what`` names the argument
    in the message)."""
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"{what} must be a column name or a list of them, got {value!r}")
    return names


def entry_columns(table: pa.Table, key, value) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The key and value column names, checked: value=None means every other column."""
    keys = key_names(key)
    names = table.schema.names
    if value is None:
        values = tuple(n for n in names if n not in keys)
    else:
        values = column_names(value, "value")
    for n in (*keys, *values):
        if n not in names:
            raise InvalidArgumentError(f"no column {n!r}; columns are {', '.join(names)}")
    both = set(keys) & set(values)
    if both:
        raise InvalidArgumentError(f"column {min(both)!r} is both a key and a value column")
    if len(set(keys)) != len(keys) or len(set(values)) != len(values):
        raise InvalidArgumentError(f"a column is named twice in key={keys!r} value={values!r}")
    return keys, values


def entries(data, values, key, value) -> tuple[pa.Table, tuple[str, ...], tuple[str, ...]]:
    """Entries as one table of key and value columns: a Table or RecordBatch with key=
    (and value=), or key and value arrays, or a (keys, values) pair."""
    if key is not None:
        if values is not None:
            raise InvalidArgumentError(
                "with key=, the values are columns of the table (value=); do not also pass them"
            )
        table = as_table(data)
        keys, vals = entry_columns(table, key, value)
        return table, keys, vals
    if isinstance(data, tuple) and values is None:
        if len(data) != 2:
            raise InvalidArgumentError("entries as a tuple must be a (keys, values) pair")
        data, values = data
    if isinstance(data, (pa.Table, pa.RecordBatch)):
        raise InvalidArgumentError(
            "a Table or RecordBatch needs key=<column name or list of names>"
        )
    if value is not None:
        raise InvalidArgumentError("value= names columns of a table; pass value arrays as values")
    columns = {"key": _chunked(data, "keys")}
    if values is not None:
        columns["value"] = _chunked(values, "values")
        if len(columns["value"]) != len(columns["key"]):
            raise InvalidArgumentError(
                f"{len(columns['key'])} keys but {len(columns['value'])} values"
            )
    return pa.table(columns), ("key",), ("value",) if values is not None else ()


def _chunked(values, what: str) -> pa.ChunkedArray:
    if isinstance(values, pa.ChunkedArray):
        return values
    try:
        return pa.chunked_array(chunks(values))
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"cannot read {what}: {e}") from None


def describe_keys(batch: pa.RecordBatch, keys, key_type, base: int):
    """The native column tuples of the key columns, the first len(keys) of the batch;
    ``base`` is the batch's first row, for messages."""
    descs = []
    for i, name in enumerate(keys):
        column = batch.column(i)
        # key_type speaks of integers; a composite may mix in strings (as partition_ids).
        kt = key_type if len(keys) == 1 or is_integer(column.type) else None
        descs.append(describe(column, kt, base, f"key column {name!r}"))
    return descs


_VALUE_TYPES = (
    "integers, floating point, boolean, string, binary, fixed_size_binary, decimals, dates, "
    "times, timestamps, durations and dictionaries of them"
)


def _hashable(arr: pa.Array, name: str) -> pa.Array:
    """The value column as an array the hash kernels read (see the package doc's table)."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_null(t):
        return pa.nulls(len(arr), pa.int32())
    if t == pa.uint64():
        return arr.view(pa.int64())
    if (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or pa.types.is_fixed_size_binary(t) or t in (pa.string_view(), pa.binary_view())):
        return arr
    if pa.types.is_boolean(t):
        return pc.cast(arr, pa.int8())
    if pa.types.is_floating(t):
        return arr.view({16: pa.int16(), 32: pa.int32(), 64: pa.int64()}[t.bit_width])
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return arr.view(pa.int32())
    if (pa.types.is_date64(t) or pa.types.is_time64(t) or pa.types.is_timestamp(t)
            or pa.types.is_duration(t)):
        return arr.view(pa.int64())
    if pa.types.is_decimal(t):
        return arr.view(pa.binary(t.byte_width))
    raise UnsupportedTypeError(
        f"value column {name!r} has type {t}; Merkle value hashing supports {_VALUE_TYPES}"
    )


def _zero_filled(arr: pa.Array) -> pa.Array:
    t = arr.type
    if t in (pa.string_view(), pa.binary_view()):
        arr = arr.cast(pa.large_string() if t == pa.string_view() else pa.large_binary())
        t = arr.type
    if pa.types.is_fixed_size_binary(t):
        zero = pa.scalar(b"\0" * t.byte_width, t)
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        zero = pa.scalar("", t)
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        zero = pa.scalar(b"", t)
    else:
        zero = pa.scalar(0, t)
    return pc.fill_null(arr, zero)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """murmur3's finalizer over uint32 (a bijection with fmix32(0) == 0)."""
    h = h.astype(np.uint32, copy=True)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def describe_values(batch: pa.RecordBatch, first: int, values, base: int):
    """The value columns (``values``, from column ``first`` of the batch) as (native
    column tuples, None) when no value is null, hashed then in the fused kernel; else as
    ([], the row value hashes computed here as the package doc says)."""
    arrays = [_hashable(batch.column(first + i), n) for i, n in enumerate(values)]
    if not any(a.null_count for a in arrays):
        return [describe(a, None, base, f"value column {n!r}")
                for a, n in zip(arrays, values)], None
    filled = [_zero_filled(a) for a in arrays]
    if len(filled) == 1:
        hashes = murmur3_32(filled[0])
    else:
        names = [f"v{i}" for i in range(len(filled))]
        hashes = murmur3_32(pa.RecordBatch.from_arrays(filled, names=names), key=names)
    mask = np.zeros(batch.num_rows, np.uint32)
    for i, a in enumerate(arrays):
        if a.null_count:
            nulls = a.is_null().to_numpy(zero_copy_only=False)
            mask |= nulls.astype(np.uint32) << np.uint32(i % 32)
    hashes = np.asarray(hashes).view(np.uint32) ^ _fmix32(mask)
    return [], np.ascontiguousarray(hashes.view(np.int32))


def int32_hashes(hashes, what: str) -> np.ndarray:
    """Hashes given by the caller (a sequence, numpy or Arrow array of signed int32) as
    a contiguous int32 array."""
    if isinstance(hashes, (pa.Array, pa.ChunkedArray)):
        if hashes.null_count:
            raise InvalidArgumentError(f"{what} has nulls")
        hashes = hashes.to_numpy()
    arr = np.asarray(hashes)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise InvalidArgumentError(f"{what} must be a 1-d sequence of int32 hashes")
    if arr.size and (arr.min() < -(2**31) or arr.max() > 2**31 - 1):
        raise InvalidArgumentError(f"{what} must be signed int32 hashes (-2**31..2**31-1)")
    return np.ascontiguousarray(arr, dtype=np.int32)
