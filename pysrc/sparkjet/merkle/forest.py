"""Merkle trees and forests: :class:`MerkleTree` and :class:`MerkleForest` (built from
Arrow batches or hashes by the native kernels), their serialized records, and
:func:`locate`, the partition and leaf every key lands in.

The tree, the record and the value hashes are described in the package doc
(:mod:`sparkjet.merkle`) and in ``sparkjet/merkle.h``.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet._checks import check_int
from sparkjet._keys import check_key_type, check_partition_count
from sparkjet.errors import CorruptDataError, InvalidArgumentError
from sparkjet.merkle._hashing import describe_keys, describe_values, entries, int32_hashes
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT

MIN_DEPTH = _native.MIN_DEPTH
MAX_DEPTH = _native.MAX_DEPTH
DEFAULT_DEPTH = _native.DEFAULT_DEPTH
VALUE_FACTOR = _native.VALUE_FACTOR
# value_hash= names and the native modes they stand for.
MODES = {"value": _native.MODE_VALUE, "entry": _native.MODE_ENTRY}
MODE_NAMES = {v: k for k, v in MODES.items()}


def check_depth(depth: int) -> None:
    """Raises unless ``depth`` is an int in MIN_DEPTH..MAX_DEPTH."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not MIN_DEPTH <= depth <= MAX_DEPTH:
        raise InvalidArgumentError(
            f"depth must be an int in {MIN_DEPTH}..{MAX_DEPTH} (the number of levels; "
            f"Hazelcast's default is {DEFAULT_DEPTH}), got {depth!r}"
        )


def check_value_hash(value_hash: str) -> int:
    """The native mode of a ``value_hash=`` argument, which must be ``"value"`` or
    ``"entry"``."""
    if value_hash not in MODES:
        raise InvalidArgumentError(
            f"value_hash must be 'value' (Hazelcast's) or 'entry' (bound to the key), "
            f"got {value_hash!r}"
        )
    return MODES[value_hash]


def check_same_partitions(a: int, b: int) -> None:
    """Raises unless two sides have the same partition count (trees compare only
    partition by partition)."""
    if a != b:
        raise InvalidArgumentError(
            f"mismatched partition counts: {a} and {b} (trees compare only partition by "
            "partition, so both sides must partition the same way)"
        )


def readonly(arr: np.ndarray) -> np.ndarray:
    """A read-only view of ``arr``, for arrays handed out while the forest keeps them."""
    view = arr.view()
    view.flags.writeable = False
    return view


class _Trees:
    """Trees of one depth in one array (row t = tree t), updated by the native kernels.
    Updates change leaves and flag trees dirty; reads recompute inner nodes first."""

    __slots__ = ("_depth", "_dirty", "_mode", "_nodes")

    def __init__(self, count: int, depth: int, value_hash: str):
        check_depth(depth)
        self._depth = depth
        self._mode = check_value_hash(value_hash)
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
        return MODE_NAMES[self._mode]

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
        keys = int32_hashes(key_hashes, "key_hashes")
        old = int32_hashes(old_value_hashes, "old_value_hashes")
        new = int32_hashes(new_value_hashes, "new_value_hashes")
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
        check_key_type(key_type)
        table, keys, vals = entries(data, values, key, value)
        names = [*keys, *vals]
        prepared = []
        base = 0
        for batch in table.select(names).to_batches():
            if batch.num_rows:
                key_descs = describe_keys(batch, keys, key_type, base)
                value_descs, value_hashes = describe_values(batch, len(keys), vals, base)
                prepared.append((key_descs, value_descs, value_hashes, base))
            base += batch.num_rows
        forest, done = self._arrays(), []
        try:
            for key_descs, value_descs, value_hashes, base in prepared:
                _native.forest_update(*forest, self._mode, sign, key_descs, None, value_descs,
                                      value_hashes, names, base)
                done.append((key_descs, value_descs, value_hashes))
        except BaseException:
            for key_descs, value_descs, value_hashes in done:  # all or nothing
                _native.forest_update(*forest, self._mode, -sign, key_descs, None, value_descs,
                                      value_hashes)
            raise

    def _update_hashes(self, key_hashes, value_hashes, sign) -> None:
        keys = int32_hashes(key_hashes, "key_hashes")
        vals = None if value_hashes is None else int32_hashes(value_hashes, "value_hashes")
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
        check_partition_count(partition_count)
        partition = check_int("partition", partition, min=0, max=partition_count - 1)
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
        return readonly(self._fresh()[0])

    @property
    def leaves(self) -> np.ndarray:
        """The leaves, left to right (read-only view)."""
        return readonly(self._nodes[0, self.first_leaf:])

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
        tree = cls(depth, value_hash=MODE_NAMES[mode], partition=partition, partition_count=count)
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
        check_partition_count(partition_count)
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
        return readonly(self._fresh())

    @property
    def leaves(self) -> np.ndarray:
        """All leaves, shape ``(partition_count, 2**(depth-1))`` (read-only view)."""
        return readonly(self._nodes[:, self.first_leaf:])

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
        partition = self._check_partition(partition)
        tree = MerkleTree(self._depth, value_hash=self.value_hash, partition=partition,
                          partition_count=self.partition_count)
        tree._nodes[0] = self._fresh()[partition]
        return tree

    def tree_bytes(self, partition: int) -> bytes:
        """One partition's tree record (see :meth:`MerkleTree.to_bytes`)."""
        partition = self._check_partition(partition)
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
        forest = cls(count, depth, value_hash=MODE_NAMES[mode])
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
        check_same_partitions(self.partition_count, other.partition_count)
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

    def _check_partition(self, partition: int) -> int:
        return check_int("partition", partition, min=0, max=self.partition_count - 1)

    def __reduce__(self):
        return (MerkleForest.from_bytes, (self.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MerkleForest) and self.config == other.config
                and np.array_equal(self._fresh(), other._fresh()))

    __hash__ = None

    def __repr__(self) -> str:
        return (f"MerkleForest(partition_count={self.partition_count}, depth={self._depth}, "
                f"value_hash={self.value_hash!r})")


def native_forest(trees: MerkleTree | MerkleForest) -> tuple[np.ndarray, np.ndarray, int]:
    """A tree's or a forest's arrays as the native kernels take them, inner nodes
    recomputed first: every node in one flat int32 array (a view, not a copy), the dirty
    flags (one per tree) and the depth."""
    trees._fresh()
    return trees._arrays()


def _write(tree: np.ndarray, depth: int, partition: int, count: int, mode: int) -> bytes:
    out = bytearray(_native.tree_serialized_size(depth))
    _native.write_tree(tree, depth, partition, count, mode, out)
    return bytes(out)


def locate(data, depth: int = DEFAULT_DEPTH, partition_count: int = DEFAULT_PARTITION_COUNT,
           *, key=None, key_type=None) -> tuple[pa.Int32Array, pa.Int32Array]:
    """The Hazelcast partition and the leaf node order (in a tree of ``depth``) of every
    key: keys as :func:`sparkjet.partition_ids` takes them. Both ``int32`` arrays.

    >>> locate(pa.array([42], pa.int32()), 10)
    (<pyarrow.lib.Int32Array ...> [175], <pyarrow.lib.Int32Array ...> [1014])
    """
    check_depth(depth)
    check_partition_count(partition_count)
    check_key_type(key_type)
    table, keys, _ = entries(data, None, key, [] if key is not None else None)
    rows = table.num_rows
    parts, leaves = np.empty(rows, np.int32), np.empty(rows, np.int32)
    base = 0
    for batch in table.select(list(keys)).to_batches():
        n = batch.num_rows
        if n:
            descs = describe_keys(batch, keys, key_type, base)
            _native.locate_keys(descs, depth, partition_count, parts[base:base + n],
                                leaves[base:base + n], list(keys), base)
        base += n
    return pa.array(parts, pa.int32()), pa.array(leaves, pa.int32())
