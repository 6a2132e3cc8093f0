"""Where two trees or forests differ and which rows that concerns: :class:`MerkleDiff`
and :func:`diff` (the differing leaves, walking down from the roots), and the rows of a
table whose key lies under a set of leaves (:func:`rows_under_leaves`).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet.errors import InvalidArgumentError, UnsupportedTypeError
from sparkjet.merkle._hashing import describe_keys
from sparkjet.merkle.forest import (
    MerkleForest,
    MerkleTree,
    check_depth,
    check_same_partitions,
    native_forest,
    readonly,
)


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
        self.leaf_ids = readonly(np.asarray(leaf_ids, np.int64))
        self.depth = depth
        self.depths = depths
        self.partition_count = partition_count
        self.compared = readonly(np.asarray(compared, np.int64))
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
                groups[label] = readonly(nodes[s:e])
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
        check_depth(depth)
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
    labels = check_comparable(a, b)
    depth = min(a.depth, b.depth)
    compared = np.zeros(depth, np.int64)
    fa, fb = native_forest(a), native_forest(b)
    out = np.empty(1024, np.int64)
    count = _native.forest_diff(*fa, *fb, out, compared)
    if count > len(out):
        out = np.empty(count, np.int64)
        count = _native.forest_diff(*fa, *fb, out, compared)
    return MerkleDiff(out[:count].copy(), depth, (a.depth, b.depth), a.partition_count,
                      compared, labels)


def check_comparable(a, b) -> np.ndarray | None:
    """Raises unless a and b (two trees or two forests) can be compared; returns a single
    tree's partition label, None for forests."""
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
    check_same_partitions(a.partition_count, b.partition_count)
    if a.value_hash != b.value_hash:
        raise InvalidArgumentError(
            f"the two sides hash values differently ({a.value_hash!r} and {b.value_hash!r}): "
            "build both with the same value_hash"
        )
    return labels


def diff_leaf_set(found: MerkleDiff) -> _native.LeafSet:
    """The differing leaves as the native bitmaps, built once for any number of batches."""
    return leaf_set(found.leaf_ids, found.depth, found.partition_count)


def leaf_set(leaf_ids, depth: int, partition_count: int) -> _native.LeafSet:
    """Leaf ids (as :attr:`MerkleDiff.leaf_ids` holds them) of forests of
    ``partition_count`` trees of ``depth`` as the native bitmaps, to select rows with
    :func:`rows_under_leaves`."""
    return _native.LeafSet(depth, partition_count, np.ascontiguousarray(leaf_ids, np.int64))


def rows_under_diff(table: pa.Table, keys, key_type, found: MerkleDiff) -> pa.ChunkedArray:
    """Boolean mask of the rows whose key lies under a differing leaf."""
    return rows_under_leaves(table, keys, key_type, diff_leaf_set(found))


def rows_under_leaves(table: pa.Table, keys, key_type,
                      leaves: _native.LeafSet) -> pa.ChunkedArray:
    """Boolean mask of the rows of ``table`` whose key (the columns ``keys``) lies under a
    leaf of ``leaves``, batch by batch (native and fused: hash, partition, leaf, bitmap
    test in one pass, GIL released)."""
    masks, base = [], 0
    for batch in table.select(list(keys)).to_batches():
        n = batch.num_rows
        if n:
            descs = describe_keys(batch, keys, key_type, base)
            buf = pa.allocate_buffer((n + 7) // 8)
            _native.select_keys(descs, leaves, buf, list(keys), base)
            masks.append(pa.Array.from_buffers(pa.bool_(), n, [None, buf]))
        base += n
    return pa.chunked_array(masks, pa.bool_())
