"""Choosing a depth: :func:`estimate_sync` models the bytes a sync at a given depth
exchanges (the :class:`SyncSession` walk plus the rows fetched) as a
:class:`SyncEstimate`, and :func:`choose_depth` picks the depth that minimizes them within
a memory limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sparkjet._keys import check_partition_count
from sparkjet.errors import InvalidArgumentError
from sparkjet.merkle.forest import MAX_DEPTH, MIN_DEPTH, check_depth
from sparkjet.merkle.protocol import GROUP, HEADER, HELLO_BODY, LEAF, PAIR
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT


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
    check_depth(depth)
    check_partition_count(partition_count)
    if rows < 0 or changes < 0:
        raise InvalidArgumentError("rows and changes must be >= 0")
    changes = min(changes, rows) if rows else changes
    header, group = HEADER.size, GROUP.itemsize

    def differing(level: int) -> float:
        nodes = partition_count * 2.0**level
        return nodes * -math.expm1(-changes / nodes)

    tree = 2 * (header + HELLO_BODY.size) + header + partition_count * (group + PAIR.itemsize)
    for level in range(1, depth):
        parents = differing(level - 1)
        tree += header + min(parents, partition_count) * group + 2 * parents * PAIR.itemsize
    leaves = differing(depth - 1)
    tree += header + min(leaves, partition_count) * group + leaves * LEAF.itemsize
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
