"""Merkle trees of keyed data: find what differs between two replicas and move only that.

Hazelcast keeps a Merkle tree per partition of its persisted data (``shared/HAZELCAST.md``
§4); a member that comes back with stale data sends its trees and fetches only the
entries under the leaves that differ. sparkjet does the same over Arrow data:

- :class:`MerkleTree`: one tree, Hazelcast's semantics exactly (native).
- :class:`MerkleForest`: one tree per Hazelcast partition of the key, built in one pass
  over Arrow columns with the GIL released; ``add`` / ``remove`` / ``replace`` of whole
  batches; trees serialize to bytes (leaves only, as Hazelcast sends them) and back.
- :func:`diff`: the differing leaves per partition, walking down from the roots and
  comparing only the children of differing nodes; trees of different depths compare on
  their common levels.
- :class:`SyncSession`: the same walk as two parties run it, message by message, with
  the messages and bytes exchanged.
- :func:`sync_plan` / :func:`apply`: the rows to upsert and the keys to delete so that a
  stale table becomes the fresh one, reading only rows under differing leaves.
- :func:`choose_depth` / :func:`estimate_sync`: which depth suits which change rate.

The tree
--------
Depth = number of levels (2..27, Hazelcast's default 10). A perfect binary tree in an
int32 array, breadth-first: root 0, children ``2o+1`` and ``2o+2``; ``2**(depth-1)``
leaves, the first at node ``2**(depth-1) - 1``. An entry lands in leaf
``first_leaf + (key_hash + 2**31) // (2**32 // leaves)``, ``key_hash`` being the key's
Hazelcast murmur hash (:func:`sparkjet.murmur3_32`), and adds ``2038079003 * value_hash``
to it, wrapping at 32 bits; remove subtracts, replace does both; an inner node is the
wrapping sum of its children. A forest puts each entry in the tree of its key's
Hazelcast partition (:func:`sparkjet.partition_ids`, the same hash). Keys may be one
column or several (a composite key hashes as in :func:`sparkjet.partition_ids`); a null
key raises :class:`~sparkjet.errors.NullKeyError`.

Value hashes
------------
The *value hash* of a row is the Hazelcast hash of its value when there is one value
column, and for several value columns the hash of their Hazelcast payloads concatenated
in order (what ``sparkjet.murmur3_32(batch, key=[value columns])`` computes). With no
value column it is the key hash (the tree of a set of keys). Value columns may hold any
type below; integers, strings and binary hash as in :mod:`sparkjet.partitioning`:

=========================================  ==========================================
Arrow type                                 hashed as
=========================================  ==========================================
float16 / float32 / float64                their IEEE bits as a 2 / 4 / 8-byte integer
                                           (float32 and float64 equal Hazelcast's
                                           Float and Double payloads)
boolean                                    Integer 0 or 1
date32, time32 / date64, time64,           their int32 / int64 storage
timestamp, duration
decimal128 / decimal256                    byte[] of their 16 / 32 little-endian bytes
uint64                                     Long of the same bits
dictionary                                 its values
=========================================  ==========================================

Hazelcast never stores a null value; sparkjet hashes a null as its type's zero (0, empty
string) and then XORs the row's value hash with ``fmix32(mask)``, bit ``i % 32`` of
``mask`` set when value column ``i`` is null (``fmix32``: murmur3's finalizer; rows
without nulls are unchanged).

Two modes (``value_hash=``) decide what a leaf sums. ``"value"``, Hazelcast's and the
default of the tree classes, sums the value hash alone: the key only picks the leaf, so
two keys of one leaf that swap values, or a value that moves to another key of the same
leaf, leave every node unchanged. ``"entry"``, the default of :func:`sync_plan` and
``merkle_diff``, sums ``fmix32(value_hash ^ key_hash * 0x9E3779B1)`` (unsigned 32-bit)
instead, which binds each value to its key, so such changes are found too. Whatever the
mode, a change can hide only if a 32-bit sum collides: its leaf's, or that of any node
above it, since the diff descends only into differing nodes (about depth * 2**-32 per
changed leaf).

Choosing a depth
----------------
With ``D`` changed rows and ``L`` leaves in all (``partition_count * 2**(depth-1)``),
about ``L * (1 - exp(-D / L))`` leaves differ, and every row under a differing leaf is
read. Deeper trees isolate changes better but cost ``4 * (2**depth - 1)`` bytes per tree
and a longer walk. :func:`choose_depth` picks the depth that minimizes the bytes a sync
exchanges (:func:`estimate_sync`: tree walk plus rows fetched) within a memory limit
(160 MiB per forest by default). For 10M rows of 16 bytes over 271 partitions:

==============  ==========  ===========  =================  ===========  ===================
changed rows    best depth  forest MiB   rows read per      bytes sent   the same at depth
                                         changed row        / dataset    10 (Hazelcast's)
==============  ==========  ===========  =================  ===========  ===================
1,200 (0.012%)  16          68           2.1                0.21 %       73 rows, 0.97 %
10k (0.1%)      16          68           2.1                1.2 %        71 rows, 7.5 %
100k (1%)       16          68           2.1                9.0 %        52 rows, 53 %
1M (10%)        15          34           2.8                55 %         10 rows, 102 %
==============  ==========  ===========  =================  ===========  ===================

So Merkle sync pays off while a few percent of the rows change at most; at 10 % a full
copy moves about as much. Hazelcast's default depth 10 (138,752 leaves over 271
partitions) is the right choice for about 300k rows with a few hundred changes
(``choose_depth(300_000, 300) == 10``).
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet import _native
from sparkjet.errors import (
    CorruptDataError,
    InvalidArgumentError,
    UnsupportedTypeError,
)
from sparkjet._keys import (
    check_key_type as _check_key_type,
    check_partition_count as _check_partition_count,
    chunks as _chunks,
    describe as _describe,
    is_integer as _is_integer,
    key_names as _key_names,
)
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT, murmur3_32

__all__ = [
    "DEFAULT_DEPTH",
    "MAX_DEPTH",
    "MIN_DEPTH",
    "VALUE_FACTOR",
    "MerkleDiff",
    "MerkleForest",
    "MerkleTree",
    "SyncEstimate",
    "SyncMessage",
    "SyncPlan",
    "SyncSession",
    "apply",
    "choose_depth",
    "diff",
    "estimate_sync",
    "locate",
    "sync_plan",
]

MIN_DEPTH = _native.MIN_DEPTH
MAX_DEPTH = _native.MAX_DEPTH
DEFAULT_DEPTH = _native.DEFAULT_DEPTH
VALUE_FACTOR = _native.VALUE_FACTOR
_MODES = {"value": _native.MODE_VALUE, "entry": _native.MODE_ENTRY}
_MODE_NAMES = {v: k for k, v in _MODES.items()}

# ---------------------------------------------------------------------------------- input


def _check_depth(depth: int) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or not MIN_DEPTH <= depth <= MAX_DEPTH:
        raise InvalidArgumentError(
            f"depth must be an int in {MIN_DEPTH}..{MAX_DEPTH} (the number of levels; "
            f"Hazelcast's default is {DEFAULT_DEPTH}), got {depth!r}"
        )


def _mode(value_hash: str) -> int:
    if value_hash not in _MODES:
        raise InvalidArgumentError(
            f"value_hash must be 'value' (Hazelcast's) or 'entry' (bound to the key), "
            f"got {value_hash!r}"
        )
    return _MODES[value_hash]


def _as_table(data: Any) -> pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if hasattr(data, "__arrow_c_stream__"):
        return pa.table(data)
    raise InvalidArgumentError(
        f"key= selects columns of a Table or RecordBatch, got {type(data).__name__}"
    )


def _column_names(value: str | Sequence[str] | None, what: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"{what} must be a column name or a list of them, got {value!r}")
    return names


def _columns(table: pa.Table, key, value) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The key and value column names, checked: value=None means every other column."""
    keys = _key_names(key)
    names = table.schema.names
    if value is None:
        values = tuple(n for n in names if n not in keys)
    else:
        values = _column_names(value, "value")
    for n in (*keys, *values):
        if n not in names:
            raise InvalidArgumentError(f"no column {n!r}; columns are {', '.join(names)}")
    both = set(keys) & set(values)
    if both:
        raise InvalidArgumentError(f"column {min(both)!r} is both a key and a value column")
    if len(set(keys)) != len(keys) or len(set(values)) != len(values):
        raise InvalidArgumentError(f"a column is named twice in key={keys!r} value={values!r}")
    return keys, values


def _entries(data, values, key, value) -> tuple[pa.Table, tuple[str, ...], tuple[str, ...]]:
    """Entries as one table of key and value columns: a Table or RecordBatch with key=
    (and value=), or key and value arrays, or a (keys, values) pair."""
    if key is not None:
        if values is not None:
            raise InvalidArgumentError(
                "with key=, the values are columns of the table (value=); do not also pass them"
            )
        table = _as_table(data)
        keys, vals = _columns(table, key, value)
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
        return pa.chunked_array(_chunks(values))
    except UnsupportedTypeError as e:
        raise UnsupportedTypeError(f"cannot read {what}: {e}") from None


def _key_descs(batch: pa.RecordBatch, keys, key_type, base: int):
    """Native column tuples of the key columns (the first len(keys) of the batch)."""
    descs, keep = [], []
    for i, name in enumerate(keys):
        column = batch.column(i)
        # key_type speaks of integers; a composite may mix in strings (as partition_ids).
        kt = key_type if len(keys) == 1 or _is_integer(column.type) else None
        desc, k = _describe(column, kt, base, f"key column {name!r}")
        descs.append(desc)
        keep.append(k)
    return descs, keep


_VALUE_TYPES = (
    "integers, floating point, boolean, string, binary, fixed_size_binary, decimals, dates, "
    "times, timestamps, durations and dictionaries of them"
)


def _hashable(arr: pa.Array, name: str) -> pa.Array:
    """The value column as an array the hash kernels read (see the module's table)."""
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


def _value_input(batch: pa.RecordBatch, first: int, values, base: int):
    """Value columns as native tuples (no nulls: hashed in the fused kernel) or, when a
    value is null, the row value hashes computed here, as the module documents."""
    arrays = [_hashable(batch.column(first + i), n) for i, n in enumerate(values)]
    if not any(a.null_count for a in arrays):
        descs, keep = [], []
        for a, n in zip(arrays, values):
            desc, k = _describe(a, None, base, f"value column {n!r}")
            descs.append(desc)
            keep.append(k)
        return descs, None, keep
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
    return [], np.ascontiguousarray(hashes.view(np.int32)), [hashes]


def _int32_hashes(hashes, what: str) -> np.ndarray:
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


def _readonly(arr: np.ndarray) -> np.ndarray:
    view = arr.view()
    view.flags.writeable = False
    return view


# ---------------------------------------------------------------------------------- trees


class _Trees:
    """Trees of one depth in one array (row t = tree t), updated by the native kernels.
    Updates change leaves and flag trees dirty; reads recompute inner nodes first."""

    __slots__ = ("_depth", "_dirty", "_mode", "_nodes")

    def __init__(self, count: int, depth: int, value_hash: str):
        _check_depth(depth)
        self._depth = depth
        self._mode = _mode(value_hash)
        nodes = (1 << depth) - 1
        try:
            self._nodes = np.zeros((count, nodes), np.int32)
        except MemoryError:
            raise MemoryError(
                f"{count} Merkle tree(s) of depth {depth} need {4 * count * nodes:,} bytes; "
                "pick a smaller depth (see sparkjet.merkle.choose_depth)"
            ) from None
        self._dirty = np.zeros(count, np.uint8)

    @property
    def depth(self) -> int:
        """Number of levels, 2..27."""
        return self._depth

    @property
    def value_hash(self) -> str:
        """``"value"`` (Hazelcast's) or ``"entry"`` (value hash bound to the key)."""
        return _MODE_NAMES[self._mode]

    @property
    def leaf_count(self) -> int:
        """Leaves per tree: ``2**(depth-1)``."""
        return 1 << (self._depth - 1)

    @property
    def node_count(self) -> int:
        """Nodes per tree: ``2**depth - 1``."""
        return (1 << self._depth) - 1

    @property
    def first_leaf(self) -> int:
        """Node order of the leftmost leaf: ``2**(depth-1) - 1``."""
        return (1 << (self._depth - 1)) - 1

    @property
    def nbytes(self) -> int:
        return self._nodes.nbytes

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The forest as the native kernels take it: every node in one flat int32 array
        (a view of the nodes), the dirty flags, the depth."""
        return self._nodes.reshape(-1), self._dirty, self._depth

    def _fresh(self) -> np.ndarray:
        if self._dirty.any():
            _native.forest_refresh(*self._arrays())
        return self._nodes

    def add(self, data, values=None, *, key=None, value=None, key_type=None) -> None:
        """Adds entries: a Table or RecordBatch with ``key=`` (a column or a list of
        them) and ``value=`` (default: every other column; ``[]`` for none), or an array
        of keys and an array of values (or no values). All or nothing: on error nothing
        was added. ``key_type`` as in :func:`sparkjet.partition_ids`."""
        self._update(data, values, key, value, key_type, 1)

    def remove(self, data, values=None, *, key=None, value=None, key_type=None) -> None:
        """Removes entries (their exact key and value), as :meth:`add` takes them."""
        self._update(data, values, key, value, key_type, -1)

    def replace(self, old, new, *, key=None, value=None, key_type=None) -> None:
        """Replaces entries: removes ``old`` and adds ``new`` (each a table with
        ``key=``, or a ``(keys, values)`` pair)."""
        self._update(old, None, key, value, key_type, -1)
        try:
            self._update(new, None, key, value, key_type, 1)
        except BaseException:
            self._update(old, None, key, value, key_type, 1)
            raise

    def add_hashes(self, key_hashes, value_hashes=None) -> None:
        """Adds entries given by their signed int32 key and value hashes (without
        value hashes, each key's hash stands for its value)."""
        self._update_hashes(key_hashes, value_hashes, 1)

    def remove_hashes(self, key_hashes, value_hashes=None) -> None:
        """Removes entries given by their hashes (see :meth:`add_hashes`)."""
        self._update_hashes(key_hashes, value_hashes, -1)

    def replace_hashes(self, key_hashes, old_value_hashes, new_value_hashes) -> None:
        """Hazelcast's ``updateReplace``: each key's old value out, its new value in."""
        keys = _int32_hashes(key_hashes, "key_hashes")
        old = _int32_hashes(old_value_hashes, "old_value_hashes")
        new = _int32_hashes(new_value_hashes, "new_value_hashes")
        if not len(keys) == len(old) == len(new):
            raise InvalidArgumentError(
                f"{len(keys)} key hashes, {len(old)} old and {len(new)} new value hashes")
        self._update_hashes(keys, old, -1)
        self._update_hashes(keys, new, 1)

    def clear(self) -> None:
        """Empties every tree, keeping the memory."""
        self._nodes.fill(0)
        self._dirty.fill(0)

    def _update(self, data, values, key, value, key_type, sign) -> None:
        _check_key_type(key_type)
        table, keys, vals = _entries(data, values, key, value)
        names = [*keys, *vals]
        prepared = []
        base = 0
        for batch in table.select(names).to_batches():
            if batch.num_rows:
                key_descs, key_keep = _key_descs(batch, keys, key_type, base)
                value_descs, value_hashes, value_keep = _value_input(batch, len(keys), vals, base)
                prepared.append((key_descs, value_descs, value_hashes, base,
                                 (key_keep, value_keep)))
            base += batch.num_rows
        forest, done = self._arrays(), []
        try:
            for key_descs, value_descs, value_hashes, base, _ in prepared:
                _native.forest_update(*forest, self._mode, sign, key_descs, None, value_descs,
                                      value_hashes, names, base)
                done.append((key_descs, value_descs, value_hashes))
        except BaseException:
            for key_descs, value_descs, value_hashes in done:  # all or nothing
                _native.forest_update(*forest, self._mode, -sign, key_descs, None, value_descs,
                                      value_hashes)
            raise

    def _update_hashes(self, key_hashes, value_hashes, sign) -> None:
        keys = _int32_hashes(key_hashes, "key_hashes")
        vals = None if value_hashes is None else _int32_hashes(value_hashes, "value_hashes")
        if vals is not None and len(vals) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} key hashes but {len(vals)} value hashes")
        if len(keys):
            _native.forest_update(*self._arrays(), self._mode, sign, [], keys, [], vals)

    def _same_shape(self, other, what: str) -> None:
        if self._depth != other._depth or self._mode != other._mode:
            raise InvalidArgumentError(
                f"cannot {what} trees of depth {self._depth} ({self.value_hash} hashes) and "
                f"depth {other._depth} ({other.value_hash} hashes)"
            )


class MerkleTree(_Trees):
    """One Merkle tree with Hazelcast's semantics: every entry added goes into this tree
    (a :class:`MerkleForest` routes entries to the tree of their partition).

    ``partition`` and ``partition_count`` only label the tree (they travel with its
    bytes and must match when trees are compared).

    >>> t = MerkleTree(10)
    >>> t.add(pa.array([42, 1], pa.int32()), pa.array(["hello", "a"]))
    >>> t.add(pa.array(["key"]), pa.array([7], pa.int32()))
    >>> t.root
    67687613
    """

    __slots__ = ("_partition", "_partition_count")

    def __init__(self, depth: int = DEFAULT_DEPTH, *, value_hash: str = "value",
                 partition: int = 0, partition_count: int = 1):
        _check_partition_count(partition_count)
        if isinstance(partition, bool) or not isinstance(partition, int) or not (
            0 <= partition < partition_count
        ):
            raise InvalidArgumentError(
                f"partition must be an int in 0..{partition_count - 1}, got {partition!r}"
            )
        super().__init__(1, depth, value_hash)
        self._partition = partition
        self._partition_count = partition_count

    @property
    def partition(self) -> int:
        return self._partition

    @property
    def partition_count(self) -> int:
        return self._partition_count

    @property
    def config(self) -> dict:
        """The configuration as plain data; ``MerkleTree(**config)`` makes an empty twin."""
        return {"depth": self._depth, "value_hash": self.value_hash,
                "partition": self._partition, "partition_count": self._partition_count}

    @property
    def nodes(self) -> np.ndarray:
        """Every node, breadth-first (a read-only view, current until the next update)."""
        return _readonly(self._fresh()[0])

    @property
    def leaves(self) -> np.ndarray:
        """The leaves, left to right (read-only view)."""
        return _readonly(self._nodes[0, self.first_leaf:])

    @property
    def root(self) -> int:
        return int(self._fresh()[0, 0])

    def node(self, order: int) -> int:
        """The hash of node ``order`` (0 is the root)."""
        if not 0 <= order < self.node_count:
            raise InvalidArgumentError(f"node {order} outside 0..{self.node_count - 1}")
        return int(self._fresh()[0, order])

    def leaf_of(self, key_hash: int) -> int:
        """The node order of the leaf a key hash lands in."""
        return _native.tree_leaf_of_hash(key_hash, self._depth)

    def copy(self) -> MerkleTree:
        twin = MerkleTree(**self.config)
        twin._nodes[:] = self._fresh()
        return twin

    def to_bytes(self) -> bytes:
        """The tree's record: a 24-byte header (magic, version, depth, flags, partition,
        partition count, checksum) then the leaves as Hazelcast's
        ``MerkleTreeUtil.writeLeaves`` sends them. The layout is described in
        ``sparkjet/merkle.h``."""
        return _write(self._nodes[0], self._depth, self._partition, self._partition_count,
                      self._mode)

    @classmethod
    def from_bytes(cls, data) -> MerkleTree:
        """A tree from :meth:`to_bytes`; raises :class:`~sparkjet.errors.CorruptDataError`
        naming the bad field and its byte offset."""
        view = memoryview(data).cast("B")
        header = _native.read_tree_header(view, 0, "Merkle tree")
        _, depth, mode, partition, count, size = header
        if size != len(view):
            raise CorruptDataError(
                f"Merkle tree: {len(view) - size} bytes after the tree's {size}", size
            )
        tree = cls(depth, value_hash=_MODE_NAMES[mode], partition=partition, partition_count=count)
        _native.read_tree(view, 0, header, tree._nodes[0])
        return tree

    def __reduce__(self):
        return (MerkleTree.from_bytes, (self.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MerkleTree) and self.config == other.config
                and np.array_equal(self._fresh(), other._fresh()))

    __hash__ = None

    def __repr__(self) -> str:
        label = (f", partition={self._partition}/{self._partition_count}"
                 if self._partition_count != 1 else "")
        return (f"MerkleTree(depth={self._depth}, value_hash={self.value_hash!r}{label}, "
                f"root={self.root})")


class MerkleForest(_Trees):
    """One Merkle tree per Hazelcast partition of the key (``partition_count`` trees of
    one depth). Entries go to the tree of their key's partition and the leaf of their
    key's hash; :meth:`add` takes whole Arrow batches and hashes keys and values in the
    same pass as the scatter into the leaves, with the GIL released. Inner nodes are
    computed once, when next read.

    >>> forest = MerkleForest(271, 10)
    >>> forest.add(table, key="id")                  # value= every other column
    >>> forest.remove(old_rows, key="id")
    >>> data = forest.to_bytes()                      # one record per tree
    >>> MerkleForest.from_bytes(data) == forest
    True
    """

    __slots__ = ()

    def __init__(self, partition_count: int = DEFAULT_PARTITION_COUNT, depth: int = DEFAULT_DEPTH,
                 *, value_hash: str = "value"):
        _check_partition_count(partition_count)
        super().__init__(partition_count, depth, value_hash)

    @property
    def partition_count(self) -> int:
        return len(self._dirty)

    @property
    def config(self) -> dict:
        """The configuration as plain data; ``MerkleForest(**config)`` makes an empty twin."""
        return {"partition_count": self.partition_count, "depth": self._depth,
                "value_hash": self.value_hash}

    @property
    def nodes(self) -> np.ndarray:
        """All nodes, shape ``(partition_count, 2**depth - 1)`` (read-only view, current
        until the next update)."""
        return _readonly(self._fresh())

    @property
    def leaves(self) -> np.ndarray:
        """All leaves, shape ``(partition_count, 2**(depth-1))`` (read-only view)."""
        return _readonly(self._nodes[:, self.first_leaf:])

    @property
    def roots(self) -> np.ndarray:
        return self._fresh()[:, 0].copy()

    @classmethod
    def from_leaves(cls, leaves, *, value_hash: str = "value") -> MerkleForest:
        """A forest from its leaves, shape ``(partition_count, 2**(depth-1))`` (int32;
        what :attr:`leaves` returns, or what Hazelcast sends per partition); the inner
        nodes are computed."""
        arr = np.asarray(leaves)
        if arr.ndim != 2 or arr.shape[0] < 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(
                f"leaves must be a 2-d integer array (partitions x leaves), got shape {arr.shape}")
        width = arr.shape[1]
        depth = width.bit_length()
        if width < 2 or width != 1 << (depth - 1):
            raise InvalidArgumentError(f"{width} leaves per tree is not a power of two >= 2")
        forest = cls(arr.shape[0], depth, value_hash=value_hash)
        forest._nodes[:, forest.first_leaf:] = arr.astype(np.int32, copy=False)
        forest._dirty.fill(1)
        return forest

    def tree(self, partition: int) -> MerkleTree:
        """A copy of one partition's tree."""
        self._check_partition(partition)
        tree = MerkleTree(self._depth, value_hash=self.value_hash, partition=partition,
                          partition_count=self.partition_count)
        tree._nodes[0] = self._fresh()[partition]
        return tree

    def tree_bytes(self, partition: int) -> bytes:
        """One partition's tree record (see :meth:`MerkleTree.to_bytes`)."""
        self._check_partition(partition)
        return _write(self._nodes[partition], self._depth, partition, self.partition_count,
                      self._mode)

    def to_bytes(self) -> bytes:
        """Every tree's record, in partition order."""
        size = _native.tree_serialized_size(self._depth)
        out = bytearray(size * self.partition_count)
        with memoryview(out) as view:
            for p in range(self.partition_count):
                _native.write_tree(self._nodes[p], self._depth, p, self.partition_count,
                                   self._mode, view[p * size:(p + 1) * size])
        return bytes(out)

    @classmethod
    def from_bytes(cls, data) -> MerkleForest:
        """A forest from :meth:`to_bytes` (records in any order, each partition exactly
        once); raises :class:`~sparkjet.errors.CorruptDataError` naming the record, the
        field and its byte offset."""
        view = memoryview(data).cast("B")
        if not len(view):
            raise CorruptDataError("Merkle forest: no bytes (expected one record per tree)", 0)
        first = _native.read_tree_header(view, 0, "Merkle forest record 0")
        _, depth, mode, _, count, size = first
        forest = cls(count, depth, value_hash=_MODE_NAMES[mode])
        seen = np.zeros(count, bool)
        offset, record = 0, 0
        while offset < len(view):
            header = _native.read_tree_header(view, offset, f"Merkle forest record {record}")
            _, d, m, p, c, _ = header
            if (d, m, c) != (depth, mode, count):
                field = "depth" if d != depth else "flags" if m != mode else "partition count"
                raise CorruptDataError(
                    f"Merkle forest record {record} at byte {offset}: {field} differs from "
                    f"record 0's (depth {d} vs {depth}, mode {m} vs {mode}, "
                    f"partitions {c} vs {count})", offset)
            if seen[p]:
                raise CorruptDataError(
                    f"Merkle forest record {record} at byte {offset}: partition {p} appears twice",
                    offset)
            seen[p] = True
            _native.read_tree(view, offset, header, forest._nodes[p])
            offset += size
            record += 1
        if not seen.all():
            missing = np.flatnonzero(~seen)
            raise CorruptDataError(
                f"Merkle forest: {len(missing)} of {count} partitions have no record "
                f"(first missing: {int(missing[0])})", len(view))
        return forest

    def merge(self, other: MerkleForest) -> None:
        """Adds another forest's entries to this one (leaf sums add up: partial forests
        built on different shards of the data merge into the forest of all of it)."""
        if not isinstance(other, MerkleForest):
            raise InvalidArgumentError(f"can only merge a MerkleForest, not {type(other).__name__}")
        _check_same_partitions(self.partition_count, other.partition_count)
        self._same_shape(other, "merge")
        self._nodes += other._nodes
        self._dirty |= other._dirty

    def locate(self, data, *, key=None, key_type=None) -> tuple[pa.Int32Array, pa.Int32Array]:
        """The partition and the leaf node order of every key (see :func:`locate`)."""
        return locate(data, self._depth, self.partition_count, key=key, key_type=key_type)

    def copy(self) -> MerkleForest:
        twin = MerkleForest(**self.config)
        twin._nodes[:] = self._fresh()
        return twin

    def _check_partition(self, partition: int) -> None:
        if isinstance(partition, bool) or not isinstance(partition, (int, np.integer)) or not (
            0 <= partition < self.partition_count
        ):
            raise InvalidArgumentError(
                f"partition must be in 0..{self.partition_count - 1}, got {partition!r}"
            )

    def __reduce__(self):
        return (MerkleForest.from_bytes, (self.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MerkleForest) and self.config == other.config
                and np.array_equal(self._fresh(), other._fresh()))

    __hash__ = None

    def __repr__(self) -> str:
        return (f"MerkleForest(partition_count={self.partition_count}, depth={self._depth}, "
                f"value_hash={self.value_hash!r})")


def _write(tree: np.ndarray, depth: int, partition: int, count: int, mode: int) -> bytes:
    out = bytearray(_native.tree_serialized_size(depth))
    _native.write_tree(tree, depth, partition, count, mode, out)
    return bytes(out)


def _check_same_partitions(a: int, b: int) -> None:
    if a != b:
        raise InvalidArgumentError(
            f"mismatched partition counts: {a} and {b} (trees compare only partition by "
            "partition, so both sides must partition the same way)"
        )


def locate(data, depth: int = DEFAULT_DEPTH, partition_count: int = DEFAULT_PARTITION_COUNT,
           *, key=None, key_type=None) -> tuple[pa.Int32Array, pa.Int32Array]:
    """The Hazelcast partition and the leaf node order (in a tree of ``depth``) of every
    key: keys as :func:`sparkjet.partition_ids` takes them. Both ``int32`` arrays.

    >>> locate(pa.array([42], pa.int32()), 10)
    (<pyarrow.lib.Int32Array ...> [175], <pyarrow.lib.Int32Array ...> [1014])
    """
    _check_depth(depth)
    _check_partition_count(partition_count)
    _check_key_type(key_type)
    table, keys, _ = _entries(data, None, key, [] if key is not None else None)
    rows = table.num_rows
    parts, leaves = np.empty(rows, np.int32), np.empty(rows, np.int32)
    base = 0
    for batch in table.select(list(keys)).to_batches():
        n = batch.num_rows
        if n:
            descs, _keep = _key_descs(batch, keys, key_type, base)
            _native.locate_keys(descs, depth, partition_count, parts[base:base + n],
                                leaves[base:base + n], list(keys), base)
        base += n
    return pa.array(parts, pa.int32()), pa.array(leaves, pa.int32())


# ----------------------------------------------------------------------------------- diff


class MerkleDiff(Mapping):
    """The leaves where two trees or forests differ: a mapping from partition to the
    node orders of its differing leaves (``int32``, ascending) in a tree of
    :attr:`depth`, the common depth of the two sides. Partitions without differences
    are absent, so an empty diff is falsy.

    :attr:`leaf_ids` holds every differing leaf as one ``int64``:
    ``tree * 2**(depth-1) + (leaf - first_leaf)``, ``tree`` being the partition for a
    forest and 0 for a single tree. :attr:`compared` counts the node pairs compared on
    each level.
    """

    def __init__(self, leaf_ids: np.ndarray, depth: int, depths: tuple[int, int],
                 partition_count: int, compared: np.ndarray, labels: np.ndarray | None = None):
        self.leaf_ids = _readonly(np.asarray(leaf_ids, np.int64))
        self.depth = depth
        self.depths = depths
        self.partition_count = partition_count
        self.compared = _readonly(np.asarray(compared, np.int64))
        self._labels = labels  # a single tree's partition label, else None
        self._groups: dict[int, np.ndarray] | None = None

    @property
    def leaf_count(self) -> int:
        """Differing leaves in all."""
        return len(self.leaf_ids)

    @property
    def leaves_per_tree(self) -> int:
        return 1 << (self.depth - 1)

    def _by_partition(self) -> dict[int, np.ndarray]:
        if self._groups is None:
            per = self.leaves_per_tree
            trees = self.leaf_ids // per
            nodes = (self.leaf_ids - trees * per + (per - 1)).astype(np.int32)
            starts = np.flatnonzero(np.r_[True, trees[1:] != trees[:-1]]) if len(trees) else []
            ends = [*starts[1:], len(trees)]
            groups = {}
            for s, e in zip(starts, ends):
                tree = int(trees[s])
                label = int(self._labels[tree]) if self._labels is not None else tree
                groups[label] = _readonly(nodes[s:e])
            self._groups = groups
        return self._groups

    def __getitem__(self, partition: int) -> np.ndarray:
        return self._by_partition()[partition]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_partition())

    def __len__(self) -> int:
        return len(self._by_partition())

    def leaf_ranges(self, partition: int, depth: int) -> np.ndarray:
        """The differing leaves of ``partition`` in a tree of ``depth`` (>= :attr:`depth`):
        rows ``[start, stop)`` of leaf node orders; one leaf of the common depth covers
        ``2**(depth - self.depth)`` leaves of the deeper tree."""
        _check_depth(depth)
        if depth < self.depth:
            raise InvalidArgumentError(f"depth {depth} is shallower than the diff's {self.depth}")
        nodes = self.get(partition, np.empty(0, np.int32)).astype(np.int64)
        shift = depth - self.depth
        first_deep = (1 << (depth - 1)) - 1
        start = ((nodes - (self.leaves_per_tree - 1)) << shift) + first_deep
        return np.stack([start, start + (1 << shift)], axis=1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MerkleDiff):
            return NotImplemented
        return (self.depth == other.depth and self.partition_count == other.partition_count
                and dict(self._by_partition()).keys() == dict(other._by_partition()).keys()
                and np.array_equal(self.leaf_ids, other.leaf_ids))

    __hash__ = None

    def __repr__(self) -> str:
        return (f"MerkleDiff(depth={self.depth}, differing_leaves={self.leaf_count}, "
                f"partitions={len(self)} of {self.partition_count})")


def diff(a: MerkleTree | MerkleForest, b: MerkleTree | MerkleForest) -> MerkleDiff:
    """The leaves where ``a`` and ``b`` differ, per partition: each tree is walked from
    the root, comparing only the children of differing nodes. Trees of different depths
    compare on their common levels (a node of the deeper tree is the sum of its
    subtree, so its level ``min(depths) - 1`` matches the shallower tree's leaves).

    Both must be trees (of the same partition) or forests (of the same partition count),
    built with the same ``value_hash``.
    """
    labels = _check_comparable(a, b)
    depth = min(a.depth, b.depth)
    compared = np.zeros(depth, np.int64)
    a._fresh()
    b._fresh()
    fa, fb = a._arrays(), b._arrays()
    out = np.empty(1024, np.int64)
    count = _native.forest_diff(*fa, *fb, out, compared)
    if count > len(out):
        out = np.empty(count, np.int64)
        count = _native.forest_diff(*fa, *fb, out, compared)
    return MerkleDiff(out[:count].copy(), depth, (a.depth, b.depth), a.partition_count,
                      compared, labels)


def _check_comparable(a, b) -> np.ndarray | None:
    """Raises unless a and b can be compared; returns a tree's partition label."""
    kinds = (type(a).__name__, type(b).__name__)
    if isinstance(a, MerkleForest) and isinstance(b, MerkleForest):
        labels = None
    elif isinstance(a, MerkleTree) and isinstance(b, MerkleTree):
        if a.partition != b.partition:
            raise InvalidArgumentError(
                f"the trees are of different partitions ({a.partition} and {b.partition})"
            )
        labels = np.array([a.partition])
    else:
        raise UnsupportedTypeError(
            f"diff compares two MerkleTrees or two MerkleForests, not a {kinds[0]} and a {kinds[1]}"
        )
    _check_same_partitions(a.partition_count, b.partition_count)
    if a._mode != b._mode:
        raise InvalidArgumentError(
            f"the two sides hash values differently ({a.value_hash!r} and {b.value_hash!r}): "
            "build both with the same value_hash"
        )
    return labels


# ---------------------------------------------------------------------------- the session

_HELLO, _NODES, _LEAVES, _ROWS = 0, 1, 2, 3
_KIND_NAMES = {_HELLO: "hello", _NODES: "nodes", _LEAVES: "leaves", _ROWS: "rows"}
# kind, level, reserved, groups, items
_HEADER = struct.Struct(">BBHII")
# depth, partition count, flags (bit 0: entry hashes)
_HELLO_BODY = struct.Struct(">iii")
_GROUP = np.dtype([("partition", ">i4"), ("count", ">i4")])
_PAIR = np.dtype([("node", ">i4"), ("hash", ">i4")])
_LEAF = np.dtype(">i4")


@dataclass(frozen=True)
class SyncMessage:
    """One message of a :class:`SyncSession`, as it went over the wire."""

    sender: str  # "stale" or "fresh"
    kind: str  # "hello", "nodes", "leaves" or "rows"
    level: int  # tree level of the nodes or leaves; -1 for hello and rows
    items: int  # (node, hash) pairs, leaves or rows
    nbytes: int


class _Party:
    """One side of the exchange: it holds its own trees and sees only messages."""

    def __init__(self, name: str, trees: MerkleTree | MerkleForest):
        self.name = name
        self.trees = trees
        self.nodes = trees._fresh()
        self.own_depth = trees.depth
        self.mode = trees._mode
        self.partition_count = trees.partition_count
        # partition label -> row of self.nodes
        self.single = trees.partition if isinstance(trees, MerkleTree) else None
        self.depth = 0

    def hello(self) -> bytes:
        return _HEADER.pack(_HELLO, 0, 0, 0, 0) + _HELLO_BODY.pack(
            self.own_depth, self.partition_count, self.mode)

    def receive_hello(self, message: bytes) -> None:
        _header(message, _HELLO, self.name)
        if len(message) != _HEADER.size + _HELLO_BODY.size:
            raise CorruptDataError(f"hello to {self.name}: {len(message)} bytes", 0)
        depth, count, mode = _HELLO_BODY.unpack_from(message, _HEADER.size)
        _check_same_partitions(self.partition_count, count)
        if mode != self.mode:
            raise InvalidArgumentError(
                f"the two sides hash values differently ({_MODE_NAMES.get(mode, mode)!r} and "
                f"{_MODE_NAMES[self.mode]!r}): build both with the same value_hash")
        if not MIN_DEPTH <= depth <= MAX_DEPTH:
            raise CorruptDataError(f"hello to {self.name}: depth {depth}", _HEADER.size)
        self.depth = min(depth, self.own_depth)

    def _rows(self, partitions: np.ndarray) -> np.ndarray:
        if self.single is None:
            return partitions
        if len(partitions) and np.any(partitions != self.single):
            raise CorruptDataError(f"nodes to {self.name}: a partition other than {self.single}")
        return np.zeros(len(partitions), np.int64)

    def roots(self) -> bytes:
        partitions = (np.arange(self.partition_count) if self.single is None
                      else np.array([self.single]))
        return _encode(_NODES, 0, partitions, np.zeros(len(partitions), np.int64),
                       self.nodes[:, 0])

    def receive_nodes(self, message: bytes) -> bytes:
        """Compares the pairs with its own nodes; answers with its hashes of the
        children of the differing ones, or at the leaf level (or when nothing differs)
        with the list of differing leaves."""
        level, partitions, nodes, hashes = _decode(message, _NODES, self.name, self.depth,
                                                   self.partition_count)
        rows = self._rows(partitions)
        differ = self.nodes[rows, nodes] != hashes
        partitions, nodes, rows = partitions[differ], nodes[differ], rows[differ]
        if level == self.depth - 1 or not len(nodes):
            return _encode(_LEAVES, level, partitions, nodes, None)
        children = np.stack([2 * nodes + 1, 2 * nodes + 2], axis=1).ravel()
        rows = np.repeat(rows, 2)
        return _encode(_NODES, level + 1, np.repeat(partitions, 2), children,
                       self.nodes[rows, children])

    def receive_leaves(self, message: bytes) -> tuple[int, np.ndarray, np.ndarray]:
        level, partitions, nodes, _ = _decode(message, _LEAVES, self.name, self.depth,
                                              self.partition_count)
        return level, partitions, nodes


def _header(message: bytes, kind: int, receiver: str):
    if len(message) < _HEADER.size:
        raise CorruptDataError(f"message to {receiver}: {len(message)} bytes, no header", 0)
    fields = _HEADER.unpack_from(message)
    if fields[0] != kind:
        raise CorruptDataError(
            f"message to {receiver}: kind {fields[0]} where {_KIND_NAMES[kind]} was due", 0)
    return fields


def _encode(kind: int, level: int, partitions: np.ndarray, nodes: np.ndarray,
            hashes: np.ndarray | None) -> bytes:
    """Header, then (partition, count) groups, then (node, hash) pairs or leaf nodes."""
    if len(partitions):
        starts = np.flatnonzero(np.r_[True, partitions[1:] != partitions[:-1]])
        counts = np.diff(np.r_[starts, len(partitions)])
    else:
        starts = counts = np.empty(0, np.int64)
    groups = np.empty(len(starts), _GROUP)
    groups["partition"] = partitions[starts] if len(starts) else []
    groups["count"] = counts
    if hashes is None:
        items = np.asarray(nodes, _LEAF)
    else:
        items = np.empty(len(nodes), _PAIR)
        items["node"] = nodes
        items["hash"] = hashes
    return (_HEADER.pack(kind, level, 0, len(groups), len(items)) + groups.tobytes()
            + items.tobytes())


def _decode(message: bytes, kind: int, receiver: str, depth: int, partition_count: int):
    """A nodes or leaves message, checked as a party checks what a peer sent."""
    _, level, _, ngroups, nitems = _header(message, kind, receiver)
    what = f"{_KIND_NAMES[kind]} message to {receiver}"
    item = _PAIR if kind == _NODES else _LEAF
    need = _HEADER.size + ngroups * _GROUP.itemsize + nitems * item.itemsize
    if len(message) != need:
        raise CorruptDataError(f"{what}: {len(message)} bytes where the counts need {need}",
                               min(len(message), need))
    if level >= depth:
        raise CorruptDataError(f"{what}: level {level} in trees of depth {depth}", 1)
    groups = np.frombuffer(message, _GROUP, ngroups, _HEADER.size)
    items = np.frombuffer(message, item, nitems, _HEADER.size + ngroups * _GROUP.itemsize)
    partitions = groups["partition"].astype(np.int64)
    counts = groups["count"].astype(np.int64)
    if (np.any(counts < 0) or counts.sum() != nitems or np.any(partitions < 0)
            or np.any(partitions >= partition_count) or np.any(np.diff(partitions) <= 0)):
        raise CorruptDataError(f"{what}: bad partition groups", _HEADER.size)
    nodes = (items["node"] if kind == _NODES else items).astype(np.int64)
    low, high = (1 << level) - 1, (1 << (level + 1)) - 1
    if np.any(nodes < low) or np.any(nodes >= high):
        raise CorruptDataError(f"{what}: a node outside level {level}",
                               _HEADER.size + ngroups * _GROUP.itemsize)
    hashes = items["hash"].astype(np.int32) if kind == _NODES else None
    return level, np.repeat(partitions, counts), nodes, hashes


class SyncSession:
    """The Merkle exchange between a stale party and a fresh party, run as the two would
    run it over a network: each holds only its own trees and reads only the other's
    messages (bytes, checked on receipt).

    1. Each side says hello: depth, partition count, value-hash mode. The walk uses the
       smaller depth (the deeper side answers with the nodes of its upper levels, which
       equal the shallower side's).
    2. The stale side sends every root as a (node, hash) pair. From then on, each
       message answers the previous one: the receiver compares the pairs with its own
       nodes and sends its (node, hash) pairs for the children of the ones that differ,
       one level further down. Whoever compares the leaves sends the list of differing
       leaves.
    3. :meth:`fetch` then counts the fresh side's rows under those leaves (an Arrow IPC
       stream), which is all the stale side needs to catch up.

    Wire format, big-endian: a 12-byte header (kind, level, 0, groups, items), then per
    partition a (partition, count) pair of int32, then the items: (node, hash) int32
    pairs, or leaf node orders.

    >>> session = SyncSession(stale_forest, fresh_forest)
    >>> session.run()                       # the same MerkleDiff as diff(stale, fresh)
    >>> rows = session.fetch(fresh_table, key="id")
    >>> session.bytes_exchanged, session.message_count
    """

    def __init__(self, stale: MerkleTree | MerkleForest, fresh: MerkleTree | MerkleForest):
        self._labels = _check_comparable(stale, fresh)
        self._stale = _Party("stale", stale)
        self._fresh = _Party("fresh", fresh)
        self._depths = (stale.depth, fresh.depth)
        self.messages: list[SyncMessage] = []
        self._diff: MerkleDiff | None = None

    def _send(self, sender: _Party, message: bytes) -> bytes:
        kind, level, _, _, items = _HEADER.unpack_from(message)
        self.messages.append(SyncMessage(
            sender.name, _KIND_NAMES[kind], level if kind in (_NODES, _LEAVES) else -1, items,
            len(message)))
        return message

    def run(self) -> MerkleDiff:
        """Runs the walk (once) and returns the differing leaves."""
        if self._diff is not None:
            return self._diff
        stale, fresh = self._stale, self._fresh
        for party in (stale, fresh):
            # The trees may have changed since the session was made: walk their nodes now.
            party.nodes = party.trees._fresh()
        fresh.receive_hello(self._send(stale, stale.hello()))
        stale.receive_hello(self._send(fresh, fresh.hello()))
        depth = stale.depth
        compared = np.zeros(depth, np.int64)
        message, sender, receiver = self._send(stale, stale.roots()), stale, fresh
        while True:
            _, level, _, _, items = _HEADER.unpack_from(message)
            compared[level] += items
            reply = receiver.receive_nodes(message)
            sender, receiver = receiver, sender
            message = self._send(sender, reply)
            if _HEADER.unpack_from(message)[0] == _LEAVES:
                break
        level, partitions, nodes = receiver.receive_leaves(message)
        per = 1 << (depth - 1)
        if level == depth - 1 and len(nodes):
            rows = (partitions if self._labels is None else np.zeros(len(partitions), np.int64))
            ids = rows * per + (nodes - (per - 1))
        else:
            ids = np.empty(0, np.int64)
        self._diff = MerkleDiff(ids, depth, self._depths, stale.partition_count, compared,
                                self._labels)
        return self._diff

    def fetch(self, fresh, key, *, key_type=None) -> pa.Table:
        """The fresh side's rows under the differing leaves (the table the fresh side
        was built from), counted as one message of their Arrow IPC stream."""
        found = self.run()
        table = _as_table(fresh)
        keys = _key_names(key)
        rows = table.filter(_rows_under(table, keys, key_type, found))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rows.schema) as writer:
            writer.write_table(rows)
        payload = sink.getvalue().size
        self.messages.append(SyncMessage("fresh", "rows", -1, rows.num_rows,
                                         _HEADER.size + payload))
        return rows

    @property
    def message_count(self) -> int:
        return len(self.messages)

    @property
    def bytes_exchanged(self) -> int:
        return sum(m.nbytes for m in self.messages)

    @property
    def tree_bytes(self) -> int:
        """Bytes of the walk: hellos, node pairs and the leaf list."""
        return sum(m.nbytes for m in self.messages if m.kind != "rows")

    @property
    def row_bytes(self) -> int:
        return sum(m.nbytes for m in self.messages if m.kind == "rows")

    def __repr__(self) -> str:
        return (f"SyncSession(messages={self.message_count}, bytes={self.bytes_exchanged:,}, "
                f"tree_bytes={self.tree_bytes:,}, row_bytes={self.row_bytes:,})")


# ------------------------------------------------------------------------------ sync plan


def _rows_under(table: pa.Table, keys, key_type, found: MerkleDiff) -> pa.ChunkedArray:
    """Boolean mask of the rows whose key lies under a differing leaf."""
    return _rows_under_leaves(table, keys, key_type, _leaf_set(found))


def _leaf_set(found: MerkleDiff) -> _native.LeafSet:
    """The differing leaves as the native bitmaps, built once for any number of batches."""
    return _leaf_set_of(found.leaf_ids, found.depth, found.partition_count)


def _leaf_set_of(leaf_ids, depth: int, partition_count: int) -> _native.LeafSet:
    return _native.LeafSet(depth, partition_count, np.ascontiguousarray(leaf_ids, np.int64))


def _rows_under_leaves(table: pa.Table, keys, key_type,
                       leaves: _native.LeafSet) -> pa.ChunkedArray:
    """The mask, batch by batch (native and fused: hash, partition, leaf, bitmap test in
    one pass, GIL released)."""
    masks, base = [], 0
    for batch in table.select(list(keys)).to_batches():
        n = batch.num_rows
        if n:
            descs, _keep = _key_descs(batch, keys, key_type, base)
            buf = pa.allocate_buffer((n + 7) // 8)
            _native.select_keys(descs, leaves, buf, list(keys), base)
            masks.append(pa.Array.from_buffers(pa.bool_(), n, [None, buf]))
        base += n
    return pa.chunked_array(masks, pa.bool_())


@dataclass(frozen=True)
class SyncPlan:
    """What turns a stale table into the fresh one: write :attr:`upserts` (fresh rows,
    added or changed), delete the keys in :attr:`deletes`. :attr:`changes` lists every
    key with ``"added"``, ``"changed"`` or ``"removed"``. Apply it with :func:`apply`."""

    key: tuple[str, ...]
    upserts: pa.Table
    deletes: pa.Table
    changes: pa.Table
    diff: MerkleDiff
    key_type: str | None
    stale_rows_read: int  # stale rows under differing leaves
    fresh_rows_fetched: int  # fresh rows under differing leaves: what a remote sync moves

    @property
    def added(self) -> int:
        return self._count("added")

    @property
    def changed(self) -> int:
        return self._count("changed")

    @property
    def removed(self) -> int:
        return self.deletes.num_rows

    def _count(self, what: str) -> int:
        return pc.sum(pc.equal(self.changes["change"], what)).as_py() or 0

    def __repr__(self) -> str:
        return (f"SyncPlan(key={list(self.key)}, added={self.added}, changed={self.changed}, "
                f"removed={self.removed}, differing_leaves={self.diff.leaf_count}, "
                f"fresh_rows_fetched={self.fresh_rows_fetched})")


def sync_plan(stale, fresh, key, *, value=None, depth: int = DEFAULT_DEPTH,
              partition_count: int = DEFAULT_PARTITION_COUNT, key_type: str | None = None,
              value_hash: str = "entry",
              forests: tuple[MerkleForest, MerkleForest] | None = None) -> SyncPlan:
    """The rows to upsert and the keys to delete so that ``stale`` becomes ``fresh``.

    Both are Arrow tables (or record batches) with the same columns and unique keys
    (``key``: a column or a list of them). The two forests are built (or taken from
    ``forests``, built over these tables with the same key and value columns), diffed,
    and only the rows under differing leaves are read from either table and compared,
    column by column (nulls equal nulls, NaN equals NaN). ``value`` picks the value
    columns hashed into the trees (default: every non-key column). ``value_hash="entry"``
    (the default) also finds values that swap between keys of one leaf, which
    Hazelcast's ``"value"`` cannot see (see the module doc).

    Keys must be unique: a key that one side holds more than once while the other side
    holds it too (under a differing leaf) raises :class:`~sparkjet.errors.InvalidArgumentError`.
    With ``forests`` given, ``depth``, ``partition_count`` and ``value_hash`` come from
    them.

    >>> plan = sync_plan(stale, fresh, key="id")
    >>> apply(stale, plan).sort_by("id") == fresh.sort_by("id")
    True
    """
    _check_key_type(key_type)
    stale, fresh = _as_table(stale), _as_table(fresh)
    keys, values = _columns(fresh, key, value)
    _check_same_columns(stale, fresh)
    if forests is None:
        _check_depth(depth)
        _check_partition_count(partition_count)
        sides = []
        for table in (stale, fresh):
            forest = MerkleForest(partition_count, depth, value_hash=value_hash)
            forest.add(table, key=keys, value=values, key_type=key_type)
            sides.append(forest)
        forests = (sides[0], sides[1])
    elif not (isinstance(forests, tuple) and len(forests) == 2
              and all(isinstance(f, MerkleForest) for f in forests)):
        raise InvalidArgumentError("forests must be a (stale, fresh) pair of MerkleForests")
    found = diff(forests[0], forests[1])
    if not found:
        empty = fresh.schema.empty_table()
        return SyncPlan(keys, empty, empty.select(list(keys)), _changes_table(empty, keys, []),
                        found, key_type, 0, 0)
    leaves = _leaf_set(found)
    stale_rows = stale.filter(_rows_under_leaves(stale, keys, key_type, leaves))
    fresh_rows = fresh.filter(_rows_under_leaves(fresh, keys, key_type, leaves))
    added, changed, removed = _compare(stale_rows, fresh_rows, keys, values)
    upserts = fresh_rows.take(np.sort(np.concatenate([added, changed])))
    deletes = stale_rows.select(list(keys)).take(removed)
    changes = _changes_table(fresh_rows.select(list(keys)), keys, [
        (fresh_rows.select(list(keys)).take(added), "added"),
        (fresh_rows.select(list(keys)).take(changed), "changed"),
        (deletes, "removed"),
    ])
    return SyncPlan(keys, upserts, deletes, changes, found, key_type, stale_rows.num_rows,
                    fresh_rows.num_rows)


def _changes_table(template: pa.Table, keys, parts) -> pa.Table:
    tables = [t.append_column("change", pa.array([what] * t.num_rows, pa.string()))
              for t, what in parts]
    if not tables:
        return template.select(list(keys)).append_column("change", pa.array([], pa.string()))
    return pa.concat_tables(tables)


def _check_same_columns(stale: pa.Table, fresh: pa.Table) -> None:
    a, b = stale.schema, fresh.schema
    for name in sorted(set(a.names) ^ set(b.names)):
        side = "stale" if name in a.names else "fresh"
        raise InvalidArgumentError(
            f"column {name!r} is only in the {side} table: both need the same columns")
    for name in a.names:
        if a.field(name).type != b.field(name).type:
            raise InvalidArgumentError(
                f"column {name!r} is {a.field(name).type} in the stale table but "
                f"{b.field(name).type} in the fresh one")


def _joinable(table: pa.Table, keys) -> pa.Table:
    """Key columns in types Arrow's hash join takes (dictionaries decoded, views cast)."""
    columns = []
    for name in keys:
        column = table.column(name)
        t = column.type
        if pa.types.is_dictionary(t):
            column = pc.cast(column, t.value_type)
            t = column.type
        if t in (pa.string_view(), pa.binary_view()):
            wide = pa.large_string() if t == pa.string_view() else pa.large_binary()
            column = pc.cast(column, wide)
        columns.append(column)
    return pa.table(columns, names=list(keys))


def _compare(stale: pa.Table, fresh: pa.Table, keys, values):
    """Row positions (in fresh) of added and changed rows, and (in stale) of removed ones.
    A key twice on one side shows as a row matched twice, and is refused."""
    left, right = _joinable(stale, keys), _joinable(fresh, keys)
    s_col, f_col = "__sparkjet_stale_row", "__sparkjet_fresh_row"
    left = left.append_column(s_col, pa.array(np.arange(stale.num_rows, dtype=np.int64)))
    right = right.append_column(f_col, pa.array(np.arange(fresh.num_rows, dtype=np.int64)))
    joined = left.join(right, keys=list(keys), join_type="full outer")
    s_rows = pc.fill_null(joined[s_col], -1).to_numpy()
    f_rows = pc.fill_null(joined[f_col], -1).to_numpy()
    s_missing, f_missing = s_rows < 0, f_rows < 0
    both = ~s_missing & ~f_missing
    s_both, f_both = s_rows[both], f_rows[both]
    _check_matched_once(s_both, stale, keys, "fresh")
    _check_matched_once(f_both, fresh, keys, "stale")
    same = np.ones(len(s_both), bool)
    for name in values:
        same &= _same(stale[name].take(s_both), fresh[name].take(f_both))
    return np.sort(f_rows[s_missing]), np.sort(f_both[~same]), np.sort(s_rows[f_missing])


def _check_matched_once(rows: np.ndarray, table: pa.Table, keys, other: str) -> None:
    """Rows of `table` that met more than one row of the other side: their key is there
    more than once. (A duplicate key that only one side has still syncs right: every copy
    is deleted, or every copy upserted.)"""
    if not len(rows):
        return
    counts = np.bincount(rows, minlength=table.num_rows)
    worst = int(np.argmax(counts))
    if counts[worst] > 1:
        key = table.select(list(keys)).slice(worst, 1).to_pylist()[0]
        raise InvalidArgumentError(
            f"key {key} appears {counts[worst]} times in the {other} table: a sync needs "
            "unique keys")


def _same(a, b) -> np.ndarray:
    """Null-safe equality (null == null), NaN equal to NaN."""
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    if pa.types.is_null(a.type):
        return both_null.to_numpy(zero_copy_only=False)
    t = a.type.value_type if pa.types.is_dictionary(a.type) else a.type
    if pa.types.is_dictionary(a.type):
        a, b = pc.cast(a, t), pc.cast(b, t)
    same = pc.or_(pc.fill_null(pc.equal(a, b), False), both_null)
    if pa.types.is_floating(t):
        same = pc.or_(same, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return same.to_numpy(zero_copy_only=False)


def apply(stale, plan: SyncPlan) -> pa.Table:
    """``stale`` with ``plan`` applied: the rows whose key is upserted or deleted are
    dropped (they can only lie under the plan's differing leaves, so only those rows are
    looked at) and the upserts appended. Rows keep their order; the upserts come last,
    cast to ``stale``'s schema. ``stale`` must be the table the plan was made from."""
    stale = _as_table(stale)
    if not isinstance(plan, SyncPlan):
        raise InvalidArgumentError(f"plan must be a SyncPlan, got {type(plan).__name__}")
    keys = plan.key
    _check_same_columns(stale, plan.upserts)
    if plan.upserts.num_rows == 0 and plan.deletes.num_rows == 0:
        return stale
    candidates = pc.indices_nonzero(_rows_under(stale, keys, plan.key_type, plan.diff))
    candidates = candidates.to_numpy().astype(np.int64)
    row_col = "__sparkjet_row"
    near = _joinable(stale.select(list(keys)).take(candidates), keys).append_column(
        row_col, pa.array(candidates))
    gone = pa.concat_tables([_joinable(plan.upserts, keys), _joinable(plan.deletes, keys)])
    hits = near.join(gone, keys=list(keys), join_type="left semi")
    keep = np.ones(stale.num_rows, bool)
    keep[hits[row_col].to_numpy()] = False
    upserts = plan.upserts.select(stale.schema.names).cast(stale.schema)
    return pa.concat_tables([stale.filter(pa.array(keep)), upserts])


# --------------------------------------------------------------------------- choosing depth


@dataclass(frozen=True)
class SyncEstimate:
    """Expected cost of one sync at a given depth (see :func:`estimate_sync`)."""

    depth: int
    differing_leaves: float
    rows_fetched: float
    tree_bytes: float
    row_bytes: float
    forest_bytes: int

    @property
    def total_bytes(self) -> float:
        return self.tree_bytes + self.row_bytes


def estimate_sync(rows: int, changes: int, depth: int,
                  partition_count: int = DEFAULT_PARTITION_COUNT, *,
                  row_bytes: int = 16) -> SyncEstimate:
    """The expected cost of syncing ``rows`` rows of which ``changes`` differ, with
    forests of ``depth``: with ``N`` nodes on a level, ``N * (1 - exp(-changes / N))``
    of them differ (changes spread uniformly); :class:`SyncSession` sends 8 bytes per
    (node, hash) pair for the roots and the children of every differing node, plus
    message and group headers; every row under a differing leaf is fetched."""
    _check_depth(depth)
    _check_partition_count(partition_count)
    if rows < 0 or changes < 0:
        raise InvalidArgumentError("rows and changes must be >= 0")
    changes = min(changes, rows) if rows else changes
    header, group = _HEADER.size, _GROUP.itemsize

    def differing(level: int) -> float:
        nodes = partition_count * 2.0**level
        return nodes * -math.expm1(-changes / nodes)

    tree = 2 * (header + _HELLO_BODY.size) + header + partition_count * (group + _PAIR.itemsize)
    for level in range(1, depth):
        parents = differing(level - 1)
        tree += header + min(parents, partition_count) * group + 2 * parents * _PAIR.itemsize
    leaves = differing(depth - 1)
    tree += header + min(leaves, partition_count) * group + leaves * _LEAF.itemsize
    all_leaves = partition_count * 2.0 ** (depth - 1)
    fetched = changes + (rows - changes) * leaves / all_leaves
    return SyncEstimate(depth, leaves, fetched, tree, fetched * row_bytes,
                        4 * partition_count * ((1 << depth) - 1))


def choose_depth(rows: int, changes: int, partition_count: int = DEFAULT_PARTITION_COUNT, *,
                 row_bytes: int = 16, memory_limit: int = 160 * 2**20) -> int:
    """The depth that minimizes the bytes a sync exchanges (:func:`estimate_sync`) for
    ``rows`` rows with about ``changes`` changed, among depths whose forest fits
    ``memory_limit`` bytes (``4 * partition_count * (2**depth - 1)``).

    >>> choose_depth(10_000_000, 1_200)
    16
    """
    best = None
    for depth in range(MIN_DEPTH, MAX_DEPTH + 1):
        estimate = estimate_sync(rows, changes, depth, partition_count, row_bytes=row_bytes)
        if estimate.forest_bytes > memory_limit and best is not None:
            break
        if best is None or estimate.total_bytes < best.total_bytes:
            best = estimate
    return best.depth
