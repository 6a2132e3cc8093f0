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

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet._keys import (
    KEY_TYPES,
    check_key_type,
    check_partition_count,
    chunks,
    describe,
    is_integer,
    key_names,
)
from sparkjet.errors import InvalidArgumentError, KeyRangeError

HAZELCAST_SEED = 0x01000193
DEFAULT_PARTITION_COUNT = 271

__all__ = ["DEFAULT_PARTITION_COUNT", "HAZELCAST_SEED", "KEY_TYPES", "Partitioner",
           "murmur3_32", "partition_ids"]


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
    check_partition_count(partition_count)
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
        check_partition_count(partition_count)
        check_key_type(key_type)
        self._partition_count = partition_count
        self._key_type = key_type
        self._key = key_names(key) if key is not None else None

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


def _compute(values, key_type, key, *, partition_count=None, seed=HAZELCAST_SEED) -> pa.Int32Array:
    check_key_type(key_type)
    if key is not None:
        return _compute_rows(values, key_names(key), key_type, partition_count, seed)
    if isinstance(values, (pa.RecordBatch, pa.Table)):
        raise InvalidArgumentError(
            "a RecordBatch or Table needs key=<column name or list of names> to choose its key"
        )
    parts = chunks(values)
    total = sum(len(c) for c in parts)
    out = pa.allocate_buffer(total * 4)
    ids = np.frombuffer(out, np.int32)
    base = 0
    for chunk in parts:
        if len(chunk):
            desc = describe(chunk, key_type, base, "key")
            into = ids[base : base + len(chunk)]
            context = f"key {chunk.type}"
            try:
                if partition_count is None:
                    _native.column_hashes(desc, seed, into, base, context)
                else:
                    _native.column_partitions(desc, partition_count, into, base, context)
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
    ids = np.frombuffer(out, np.int32)
    base = 0
    for batch in batches:
        if batch.num_rows:
            descs = []
            for n in names:
                column = batch.column(n)
                # key_type speaks of integers; a composite may mix in strings.
                kt = key_type if is_integer(column.type) else None
                descs.append(describe(column, kt, base, f"key column {n!r}"))
            into = ids[base : base + batch.num_rows]
            _native.row_hashes(descs, seed, into, base, list(names))
            if partition_count is not None:
                _native.partitions_from_hashes(into, partition_count, into)
        base += batch.num_rows
    return pa.Array.from_buffers(pa.int32(), total, [None, out])


