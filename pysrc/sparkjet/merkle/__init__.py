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

Modules
-------
Everything above is importable from :mod:`sparkjet.merkle`; it lives in:

- :mod:`sparkjet.merkle.forest`: :class:`MerkleTree` and :class:`MerkleForest` (building,
  reading, serializing) and :func:`locate`, the partition and leaf each key lands in.
- :mod:`sparkjet.merkle.compare`: :class:`MerkleDiff` and :func:`diff`, the differing
  leaves of two trees or forests, and the rows of a table under a set of leaves.
- :mod:`sparkjet.merkle.protocol`: :class:`SyncSession`, the walk as two parties exchange
  it, and its wire messages (:class:`SyncMessage`).
- :mod:`sparkjet.merkle.sync`: :func:`sync_plan` and :func:`apply`, the rows to upsert and
  the keys to delete that turn a stale table into the fresh one (:class:`SyncPlan`).
- :mod:`sparkjet.merkle.sizing`: :func:`estimate_sync` and :func:`choose_depth`, what a
  sync at each depth costs (:class:`SyncEstimate`).
- ``sparkjet.merkle._hashing`` (private): Arrow entries to what the native kernels hash,
  value columns hashed to int32 as the table below says.

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
from sparkjet.merkle.compare import MerkleDiff, diff
from sparkjet.merkle.forest import (
    DEFAULT_DEPTH,
    MAX_DEPTH,
    MIN_DEPTH,
    VALUE_FACTOR,
    MerkleForest,
    MerkleTree,
    locate,
)
from sparkjet.merkle.protocol import SyncMessage, SyncSession
from sparkjet.merkle.sizing import SyncEstimate, choose_depth, estimate_sync
from sparkjet.merkle.sync import SyncPlan, apply, sync_plan

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
