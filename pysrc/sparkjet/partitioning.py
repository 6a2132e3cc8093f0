"""Hazelcast-compatible partitioning of Arrow keys.

A key's partition is MurmurHash3 x86_32 (seed ``0x01000193``) of the payload of its
Hazelcast serialized form, reduced by Java's rule ``0 if h == -2**31 else abs(h) % n``.
The Arrow type of a column decides the Hazelcast type it hashes as:

================================================  ==================================
Arrow type                                        Hazelcast type (payload)
================================================  ==================================
int8, int16, int32, uint8, uint16                 Integer (4 bytes, big-endian)
int64, uint32                                     Long (8 bytes, big-endian)
uint64 (every value must be <= 2**63 - 1)         Long
string, large_string, string_view                 String (int32 byte count + UTF-8)
binary, large_binary, binary_view,                byte[] (int32 length + bytes)
fixed_size_binary
dictionary<any of the above>                      the dictionary's value type
================================================  ==================================

``key_type="integer"`` hashes every integer column as Integer, as the Hazelcast Python
client does for ``int`` by default, and raises :class:`KeyRangeError` at the first value
outside int32; ``key_type="long"`` hashes every integer column as Long, like the client's
``IntType.LONG``. Python lists go through ``pyarrow.array``, so Python ``int`` becomes
int64 (Long) unless ``key_type="integer"``; Python ``bytes`` become binary (byte[]), unlike
the Hazelcast client, which pickles ``bytes`` (only ``bytearray`` is byte[] there).

Composite keys (``key=["a", "b"]`` over a RecordBatch or Table) hash, per row, the
concatenation of each column's payload above, in the order given. **No Hazelcast type
serializes to that byte string**, so composite partitions match no Hazelcast member's;
they are stable, documented, and equal to the single-column partition when ``key`` names
one column.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkjet import hash as _native
from sparkjet.errors import (
    InvalidArgumentError,
    KeyRangeError,
    NullKeyError,
    UnsupportedTypeError,
)

HAZELCAST_SEED = 0x01000193
DEFAULT_PARTITION_COUNT = 271
KEY_TYPES = (None, "integer", "long")

_SUPPORTED = (
    "int8, int16, int32, int64, uint8, uint16, uint32, uint64, string, large_string, "
    "string_view, binary, large_binary, binary_view, fixed_size_binary and dictionaries of them"
)


def partition_ids(
    values: Any,
    partition_count: int = DEFAULT_PARTITION_COUNT,
    *,
    key_type: str | None = None,
    key: str | Sequence[str] | None = None,
) -> pa.Int32Array:
    """The Hazelcast partition of every key, as an ``int32`` Arrow array.

    ``values`` is a pyarrow Array or ChunkedArray, anything exposing
    ``__arrow_c_array__`` or ``__arrow_c_stream__``, a numpy array or a Python list; or a
    RecordBatch or Table together with ``key`` (a column name or a list of them).
    Keys are read in place (no copy, GIL released); chunked input gives one array.

    >>> partition_ids(pa.array(["hello", "a"])).to_pylist()
    [270, 73]
    >>> partition_ids([42], key_type="integer").to_pylist()
    [175]
    """
    _check_partition_count(partition_count)
    return _compute(values, key_type, key, partition_count=partition_count)


def murmur3_32(
    values: Any,
    seed: int = HAZELCAST_SEED,
    *,
    key_type: str | None = None,
    key: str | Sequence[str] | None = None,
) -> pa.Int32Array:
    """The signed MurmurHash3 x86_32 of every key's Hazelcast payload (what Hazelcast's
    ``Data.getPartitionHash()`` returns for the default seed). Same inputs as
    :func:`partition_ids`.

    >>> murmur3_32(pa.array([0], pa.int32())).to_pylist() == [0x37077D1E]
    True
    """
    if not isinstance(seed, int) or not 0 <= seed <= 0xFFFFFFFF:
        raise InvalidArgumentError(f"seed must be an int in 0..2**32-1, got {seed!r}")
    return _compute(values, key_type, key, seed=seed)


class Partitioner:
    """A reusable partitioning configuration: ``Partitioner(271, key=["a", "b"])(batch)``.

    Its configuration is plain data (:attr:`config`) so it can travel to Spark executors
    or into a snapshot record.
    """

    __slots__ = ("_partition_count", "_key_type", "_key")

    def __init__(
        self,
        partition_count: int = DEFAULT_PARTITION_COUNT,
        *,
        key_type: str | None = None,
        key: str | Sequence[str] | None = None,
    ):
        _check_partition_count(partition_count)
        _check_key_type(key_type)
        self._partition_count = partition_count
        self._key_type = key_type
        self._key = _key_names(key) if key is not None else None

    @property
    def partition_count(self) -> int:
        return self._partition_count

    @property
    def config(self) -> dict:
        """The configuration as JSON-able data; ``Partitioner(**config)`` rebuilds it."""
        return {"partition_count": self._partition_count, "key_type": self._key_type,
                "key": list(self._key) if self._key is not None else None}

    def __call__(self, values: Any) -> pa.Int32Array:
        """The partition of every key of ``values`` (see :func:`partition_ids`)."""
        return _compute(values, self._key_type, self._key, partition_count=self._partition_count)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Partitioner) and self.config == other.config

    def __hash__(self) -> int:
        return hash((self._partition_count, self._key_type, self._key))

    def __repr__(self) -> str:
        args = [str(self._partition_count)]
        if self._key_type is not None:
            args.append(f"key_type={self._key_type!r}")
        if self._key is not None:
            args.append(f"key={list(self._key)!r}")
        return f"Partitioner({', '.join(args)})"


def _check_partition_count(partition_count: int) -> None:
    if isinstance(partition_count, bool) or not isinstance(partition_count, int) or not (
        1 <= partition_count <= 2**31 - 1
    ):
        raise InvalidArgumentError(
            f"partition_count must be an int in 1..2**31-1, got {partition_count!r}"
        )


def _check_key_type(key_type: str | None) -> None:
    if key_type not in KEY_TYPES:
        raise InvalidArgumentError(
            f"key_type must be None, 'integer' or 'long', got {key_type!r}"
        )


def _key_names(key: str | Sequence[str]) -> tuple[str, ...]:
    names = (key,) if isinstance(key, str) else tuple(key)
    if not names or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"key must be a column name or a non-empty list of them, got {key!r}")
    return names


def _compute(values, key_type, key, *, partition_count=None, seed=HAZELCAST_SEED) -> pa.Int32Array:
    _check_key_type(key_type)
    if key is not None:
        return _compute_rows(values, _key_names(key), key_type, partition_count, seed)
    if isinstance(values, (pa.RecordBatch, pa.Table)):
        raise InvalidArgumentError(
            "a RecordBatch or Table needs key=<column name or list of names> to choose its key"
        )
    chunks = _chunks(values)
    total = sum(len(c) for c in chunks)
    out = pa.allocate_buffer(total * 4)
    base = 0
    for chunk in chunks:
        if len(chunk):
            desc, _keepalive = _describe(chunk, key_type, base, "key")
            address = out.address + 4 * base
            context = f"key {chunk.type}"
            try:
                if partition_count is None:
                    _native.column_hashes(desc, seed, address, base, context)
                else:
                    _native.column_partitions(desc, partition_count, address, base, context)
            except KeyRangeError as e:
                value = chunk[e.index - base].as_py()
                raise KeyRangeError(
                    f"key {value} at index {e.index} does not fit a Hazelcast Integer "
                    "(key_type='integer' needs every value in -2**31..2**31-1)", e.index
                ) from None
        base += len(chunk)
    return pa.Array.from_buffers(pa.int32(), total, [None, out])


def _compute_rows(values, names, key_type, partition_count, seed) -> pa.Int32Array:
    if isinstance(values, pa.RecordBatch):
        batches = [values]
    elif isinstance(values, pa.Table):
        batches = values.select(list(names)).to_batches()
    else:
        raise InvalidArgumentError(
            f"key= selects columns of a RecordBatch or Table, got {type(values).__name__}"
        )
    schema = values.schema
    for n in names:
        if schema.get_field_index(n) < 0:
            raise InvalidArgumentError(
                f"no key column {n!r}; columns are {', '.join(schema.names)}"
            )
    if len(names) == 1:
        column = values.column(names[0])
        return _compute(column, key_type, None, partition_count=partition_count, seed=seed)
    total = values.num_rows
    out = pa.allocate_buffer(total * 4)
    base = 0
    for batch in batches:
        if batch.num_rows:
            descs, keep = [], []
            for n in names:
                column = batch.column(n)
                # key_type speaks of integers; a composite may mix in strings.
                kt = key_type if _is_integer(column.type) else None
                desc, k = _describe(column, kt, base, f"key column {n!r}")
                descs.append(desc)
                keep.append(k)
            address = out.address + 4 * base
            _native.row_hashes(descs, seed, address, base, list(names))
            if partition_count is not None:
                _native.partitions_from_hashes(address, batch.num_rows, partition_count, address)
        base += batch.num_rows
    return pa.Array.from_buffers(pa.int32(), total, [None, out])


def _is_integer(t: pa.DataType) -> bool:
    return pa.types.is_integer(t.value_type if pa.types.is_dictionary(t) else t)


def _chunks(values) -> list[pa.Array]:
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


def _describe(arr: pa.Array, key_type, base: int, context: str):
    """The native column tuple for one chunk, and the arrays it points into (to keep
    alive during the call). Raises for nulls and unsupported types."""
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
        return _describe_integer(arr, key_type, base, context)
    if key_type is not None:
        raise InvalidArgumentError(
            f"key_type={key_type!r} applies to integer keys, not to {t}"
        )
    bufs = arr.buffers()
    if t in (pa.string(), pa.binary()):
        return _desc(_native.KEY_VAR32, arr, bufs[1], bufs[2]), arr
    if t in (pa.large_string(), pa.large_binary()):
        return _desc(_native.KEY_VAR64, arr, bufs[1], bufs[2]), arr
    if pa.types.is_fixed_size_binary(t):
        return _desc(_native.KEY_FIXED, arr, None, bufs[1], width=t.byte_width), arr
    if t in (pa.string_view(), pa.binary_view()):
        data = [b for b in bufs[2:] if b is not None]
        return _desc(_native.KEY_VIEW, arr, bufs[1], None, variadic=data), arr
    raise UnsupportedTypeError(
        f"unsupported {context} type {t}: Hazelcast partitioning supports {_SUPPORTED}"
    )


def _describe_integer(arr: pa.Array, key_type, base: int, context: str):
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
        return _desc(_native.KEY_INT32, arr, arr.buffers()[1], None), arr
    kind = _native.KEY_INT64_AS_INT32 if key_type == "integer" else _native.KEY_INT64
    return _desc(kind, arr, arr.buffers()[1], None), arr


def _desc(kind, arr, values, data, *, width=0, variadic=()):
    return (
        kind, width, arr.offset, len(arr),
        values.address if values is not None else 0, values.size if values is not None else 0,
        data.address if data is not None else 0, data.size if data is not None else 0,
        tuple(b.address for b in variadic), tuple(b.size for b in variadic),
    )
