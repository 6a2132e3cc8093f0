"""Key columns for the native kernels: checks of the key arguments, and the column tuples
(kind, width, offset, length, values buffer, data buffer, variadic buffers) that
sparkjet._native reads an Arrow key column through. Shared by partitioning and the Merkle
trees; the Arrow type -> Hazelcast type table is in sparkjet.partitioning's docstring."""
from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from sparkjet import _native
from sparkjet._checks import check_int
from sparkjet.errors import (
    InvalidArgumentError,
    KeyRangeError,
    NullKeyError,
    UnsupportedTypeError,
)

KEY_TYPES = (None, "integer", "long")

SUPPORTED = (
    "int8, int16, int32, int64, uint8, uint16, uint32, uint64, string, large_string, "
    "string_view, binary, large_binary, binary_view, fixed_size_binary and dictionaries of them"
)


def check_partition_count(partition_count: int) -> int:
    return check_int("partition_count", partition_count, min=1, max=2**31 - 1)


def check_key_type(key_type: str | None) -> None:
    if key_type not in KEY_TYPES:
        raise InvalidArgumentError(
            f"key_type must be None, 'integer' or 'long', got {key_type!r}"
        )


def key_names(key: str | Sequence[str]) -> tuple[str, ...]:
    names = (key,) if isinstance(key, str) else tuple(key)
    if not names or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"key must be a column name or a non-empty list of them, got {key!r}")
    return names


def refuse_nulls(column, what: str, suffix: str = "") -> None:
    """Raises NullKeyError ("``what`` has a null at row N``suffix``") when a key column
    (an Array or ChunkedArray) holds a null."""
    if column.null_count:
        first = pc.index(pc.is_null(column), True).as_py()
        raise NullKeyError(f"{what} has a null at row {first}{suffix}", first)


def is_key_type(t: pa.DataType) -> bool:
    """Whether a column of type ``t`` can be a key (see ``SUPPORTED``)."""
    value = t.value_type if pa.types.is_dictionary(t) else t
    return (pa.types.is_integer(value) or pa.types.is_fixed_size_binary(value)
            or value in (pa.string(), pa.large_string(), pa.string_view(), pa.binary(),
                         pa.large_binary(), pa.binary_view()))


def is_integer(t: pa.DataType) -> bool:
    return pa.types.is_integer(t.value_type if pa.types.is_dictionary(t) else t)


def chunks(values) -> list[pa.Array]:
    if isinstance(values, pa.ChunkedArray):
        return list(values.chunks)
    if isinstance(values, pa.Array):
        return [values]
    try:
        if hasattr(values, "__arrow_c_array__") and not hasattr(values, "__arrow_c_stream__"):
            return [pa.array(values)]
        if hasattr(values, "__arrow_c_stream__"):
            return list(pa.chunked_array(values).chunks)
        return [pa.array(values)]
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
        raise UnsupportedTypeError(
            f"cannot read keys from {type(values).__name__}: {e}"
        ) from e


def describe(arr: pa.Array, key_type, base: int, context: str) -> tuple:
    """The native column tuple for one chunk of keys (a dictionary is decoded, small
    integers widened; the tuple holds the buffers, which keep their memory alive). Raises
    for nulls and unsupported types; ``base`` is the chunk's first row, for messages."""
    t = arr.type
    if pa.types.is_dictionary(t):
        # The partition of an entry is the partition of its dictionary value.
        arr = arr.dictionary.take(arr.indices)
        t = arr.type
    if arr.null_count:
        first = pc.index(arr.is_null(), True).as_py()
        raise NullKeyError(
            f"{context} has a null at index {base + first}: keys cannot be null", base + first
        )
    if pa.types.is_integer(t):
        return describe_integer(arr, key_type, base, context)
    if key_type is not None:
        raise InvalidArgumentError(
            f"key_type={key_type!r} applies to integer keys, not to {t}"
        )
    bufs = arr.buffers()
    if t in (pa.string(), pa.binary()):
        return column_tuple(_native.KEY_VAR32, arr, bufs[1], bufs[2])
    if t in (pa.large_string(), pa.large_binary()):
        return column_tuple(_native.KEY_VAR64, arr, bufs[1], bufs[2])
    if pa.types.is_fixed_size_binary(t):
        return column_tuple(_native.KEY_FIXED, arr, None, bufs[1], width=t.byte_width)
    if t in (pa.string_view(), pa.binary_view()):
        data = [b for b in bufs[2:] if b is not None]
        return column_tuple(_native.KEY_VIEW, arr, bufs[1], None, variadic=data)
    raise UnsupportedTypeError(
        f"unsupported {context} type {t}: Hazelcast partitioning supports {SUPPORTED}"
    )


def describe_integer(arr: pa.Array, key_type, base: int, context: str) -> tuple:
    t = arr.type
    if t == pa.uint64():
        top = pc.max(arr).as_py()
        if top is not None and top > 2**63 - 1:
            first = pc.index(pc.greater(arr, pa.scalar(2**63 - 1, pa.uint64())), True).as_py()
            raise KeyRangeError(
                f"{context}: value {arr[first].as_py()} at index {base + first} does not fit a "
                "Hazelcast Long (uint64 keys must be <= 2**63-1)", base + first)
        arr = arr.view(pa.int64())
    elif t in (pa.uint32(),) or (t != pa.int64() and key_type == "long"):
        arr = arr.cast(pa.int64())
    elif t in (pa.int8(), pa.int16(), pa.uint8(), pa.uint16()):
        arr = arr.cast(pa.int32())
    if arr.type == pa.int32():
        return column_tuple(_native.KEY_INT32, arr, arr.buffers()[1], None)
    kind = _native.KEY_INT64_AS_INT32 if key_type == "integer" else _native.KEY_INT64
    return column_tuple(kind, arr, arr.buffers()[1], None)


def column_tuple(kind, arr, values, data, *, width=0, variadic=()):
    """The tuple sparkjet._native.Columns reads: buffers, never addresses."""
    return (kind, width, arr.offset, len(arr), values, data, tuple(variadic))


def join_keys(on, what: str, sides: tuple[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A join's ``on``: a column name, a tuple of names (the same on both sides), or a dict
    of {``sides[0]`` column: ``sides[1]`` column}; as the two sides' key tuples. ``what``
    names the join in errors ("join_table")."""
    from collections.abc import Mapping

    if isinstance(on, str):
        pairs = [(on, on)]
    elif isinstance(on, Mapping):
        pairs = list(on.items())
    elif isinstance(on, (tuple, list)):
        pairs = [(k, k) for k in on]
    else:
        pairs = []
    if not pairs or not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
        raise InvalidArgumentError(
            f"{what}(on=...) takes a column name, a tuple of names, or a dict of "
            f"{{{sides[0]} column: {sides[1]} column}}, got {on!r}")
    first, second = tuple(a for a, _ in pairs), tuple(b for _, b in pairs)
    if len(set(first)) != len(first) or len(set(second)) != len(second):
        raise InvalidArgumentError(f"{what}(on=...) names a column twice: {on!r}")
    return first, second
