"""The two-party Merkle exchange: :class:`SyncSession` runs the tree walk between a
stale and a fresh :class:`Party` as bytes on a wire (the format below), recording every
:class:`SyncMessage`.

Wire format, big-endian: a 12-byte header (:data:`HEADER`: kind, level, 0, groups,
items), then per partition a (partition, count) pair of int32 (:data:`GROUP`), then the
items: (node, hash) int32 pairs (:data:`PAIR`) or leaf node orders (:data:`LEAF`). A
hello carries depth, partition count and value-hash mode (:data:`HELLO_BODY`) after its
header. :mod:`sparkjet.merkle.sizing` models the bytes a walk sends from these sizes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sparkjet._keys import key_names
from sparkjet.errors import CorruptDataError, InvalidArgumentError
from sparkjet.merkle._hashing import as_table
from sparkjet.merkle.compare import MerkleDiff, check_comparable, rows_under_diff
from sparkjet.merkle.forest import (
    MAX_DEPTH,
    MIN_DEPTH,
    MODE_NAMES,
    MODES,
    MerkleForest,
    MerkleTree,
    check_same_partitions,
)

# Message kinds.
HELLO, NODES, LEAVES, ROWS = 0, 1, 2, 3
KIND_NAMES = {HELLO: "hello", NODES: "nodes", LEAVES: "leaves", ROWS: "rows"}
# kind, level, reserved, groups, items
HEADER = struct.Struct(">BBHII")
# depth, partition count, flags (bit 0: entry hashes)
HELLO_BODY = struct.Struct(">iii")
GROUP = np.dtype([("partition", ">i4"), ("count", ">i4")])
PAIR = np.dtype([("node", ">i4"), ("hash", ">i4")])
LEAF = np.dtype(">i4")


@dataclass(frozen=True)
class SyncMessage:
    """One message of a :class:`SyncSession`, as it went over the wire."""

    sender: str  # "stale" or "fresh"
    kind: str  # "hello", "nodes", "leaves" or "rows"
    level: int  # tree level of the nodes or leaves; -1 for hello and rows
    items: int  # (node, hash) pairs, leaves or rows
    nbytes: int


class Party:
    """One side of the exchange: it holds its own trees and sees only messages. Each
    method makes or answers one message."""

    def __init__(self, name: str, trees: MerkleTree | MerkleForest):
        self.name = name
        self.trees = trees
        self.nodes = np.atleast_2d(trees.nodes)  # one row per tree (a read-only view)
        self.own_depth = trees.depth
        self.mode = MODES[trees.value_hash]
        self.partition_count = trees.partition_count
        # partition label -> row of self.nodes
        self.single = trees.partition if isinstance(trees, MerkleTree) else None
        self.depth = 0

    def hello(self) -> bytes:
        return HEADER.pack(HELLO, 0, 0, 0, 0) + HELLO_BODY.pack(
            self.own_depth, self.partition_count, self.mode)

    def receive_hello(self, message: bytes) -> None:
        _header(message, HELLO, self.name)
        if len(message) != HEADER.size + HELLO_BODY.size:
            raise CorruptDataError(f"hello to {self.name}: {len(message)} bytes", 0)
        depth, count, mode = HELLO_BODY.unpack_from(message, HEADER.size)
        check_same_partitions(self.partition_count, count)
        if mode != self.mode:
            raise InvalidArgumentError(
                f"the two sides hash values differently ({MODE_NAMES.get(mode, mode)!r} and "
                f"{MODE_NAMES[self.mode]!r}): build both with the same value_hash")
        if not MIN_DEPTH <= depth <= MAX_DEPTH:
            raise CorruptDataError(f"hello to {self.name}: depth {depth}", HEADER.size)
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
        return _encode(NODES, 0, partitions, np.zeros(len(partitions), np.int64),
                       self.nodes[:, 0])

    def receive_nodes(self, message: bytes) -> bytes:
        """Compares the pairs with its own nodes; answers with its hashes of the
        children of the differing ones, or at the leaf level (or when nothing differs)
        with the list of differing leaves."""
        level, partitions, nodes, hashes = _decode(message, NODES, self.name, self.depth,
                                                   self.partition_count)
        rows = self._rows(partitions)
        differ = self.nodes[rows, nodes] != hashes
        partitions, nodes, rows = partitions[differ], nodes[differ], rows[differ]
        if level == self.depth - 1 or not len(nodes):
            return _encode(LEAVES, level, partitions, nodes, None)
        children = np.stack([2 * nodes + 1, 2 * nodes + 2], axis=1).ravel()
        rows = np.repeat(rows, 2)
        return _encode(NODES, level + 1, np.repeat(partitions, 2), children,
                       self.nodes[rows, children])

    def receive_leaves(self, message: bytes) -> tuple[int, np.ndarray, np.ndarray]:
        level, partitions, nodes, _ = _decode(message, LEAVES, self.name, self.depth,
                                              self.partition_count)
        return level, partitions, nodes


def _header(message: bytes, kind: int, receiver: str):
    if len(message) < HEADER.size:
        raise CorruptDataError(f"message to {receiver}: {len(message)} bytes, no header", 0)
    fields = HEADER.unpack_from(message)
    if fields[0] != kind:
        raise CorruptDataError(
            f"message to {receiver}: kind {fields[0]} where {KIND_NAMES[kind]} was due", 0)
    return fields


def _encode(kind: int, level: int, partitions: np.ndarray, nodes: np.ndarray,
            hashes: np.ndarray | None) -> bytes:
    """Header, then (partition, count) groups, then (node, hash) pairs or leaf nodes."""
    if len(partitions):
        starts = np.flatnonzero(np.r_[True, partitions[1:] != partitions[:-1]])
        counts = np.diff(np.r_[starts, len(partitions)])
    else:
        starts = counts = np.empty(0, np.int64)
    groups = np.empty(len(starts), GROUP)
    groups["partition"] = partitions[starts] if len(starts) else []
    groups["count"] = counts
    if hashes is None:
        items = np.asarray(nodes, LEAF)
    else:
        items = np.empty(len(nodes), PAIR)
        items["node"] = nodes
        items["hash"] = hashes
    return (HEADER.pack(kind, level, 0, len(groups), len(items)) + groups.tobytes()
            + items.tobytes())


def _decode(message: bytes, kind: int, receiver: str, depth: int, partition_count: int):
    """A nodes or leaves message, checked as a party checks what a peer sent."""
    _, level, _, ngroups, nitems = _header(message, kind, receiver)
    what = f"{KIND_NAMES[kind]} message to {receiver}"
    item = PAIR if kind == NODES else LEAF
    need = HEADER.size + ngroups * GROUP.itemsize + nitems * item.itemsize
    if len(message) != need:
        raise CorruptDataError(f"{what}: {len(message)} bytes where the counts need {need}",
                               min(len(message), need))
    if level >= depth:
        raise CorruptDataError(f"{what}: level {level} in trees of depth {depth}", 1)
    groups = np.frombuffer(message, GROUP, ngroups, HEADER.size)
    items = np.frombuffer(message, item, nitems, HEADER.size + ngroups * GROUP.itemsize)
    partitions = groups["partition"].astype(np.int64)
    counts = groups["count"].astype(np.int64)
    if (np.any(counts < 0) or counts.sum() != nitems or np.any(partitions < 0)
            or np.any(partitions >= partition_count) or np.any(np.diff(partitions) <= 0)):
        raise CorruptDataError(f"{what}: bad partition groups", HEADER.size)
    nodes = (items["node"] if kind == NODES else items).astype(np.int64)
    low, high = (1 << level) - 1, (1 << (level + 1)) - 1
    if np.any(nodes < low) or np.any(nodes >= high):
        raise CorruptDataError(f"{what}: a node outside level {level}",
                               HEADER.size + ngroups * GROUP.itemsize)
    hashes = items["hash"].astype(np.int32) if kind == NODES else None
    return level, np.repeat(partitions, counts), nodes, hashes


def encode_message(kind: int, level: int, partitions: np.ndarray, nodes: np.ndarray,
                   hashes: np.ndarray | None = None) -> bytes:
    """A nodes message (``hashes`` given) or a leaves message of ``level``: the items
    grouped by ``partitions`` (ascending), as a party sends them. For a side that trims
    a message before it sends it (:mod:`sparkjet.runtime.resync` drops the partitions it
    copies instead)."""
    return _encode(kind, level, np.asarray(partitions, np.int64), np.asarray(nodes, np.int64),
                   hashes)


def decode_message(message: bytes, kind: int, receiver: str, depth: int,
                   partition_count: int):
    """(level, partitions, nodes, hashes or None) of a nodes or leaves message, one item
    each, checked as a party checks what a peer sent."""
    return _decode(message, kind, receiver, depth, partition_count)


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
        self._labels = check_comparable(stale, fresh)
        self._stale = Party("stale", stale)
        self._fresh = Party("fresh", fresh)
        self._depths = (stale.depth, fresh.depth)
        self.messages: list[SyncMessage] = []
        self._diff: MerkleDiff | None = None

    def _send(self, sender: Party, message: bytes) -> bytes:
        kind, level, _, _, items = HEADER.unpack_from(message)
        self.messages.append(SyncMessage(
            sender.name, KIND_NAMES[kind], level if kind in (NODES, LEAVES) else -1, items,
            len(message)))
        return message

    def run(self) -> MerkleDiff:
        """Runs the walk (once) and returns the differing leaves."""
        if self._diff is not None:
            return self._diff
        stale, fresh = self._stale, self._fresh
        for party in (stale, fresh):
            # The trees may have changed since the session was made: walk their nodes now.
            party.nodes = np.atleast_2d(party.trees.nodes)
        fresh.receive_hello(self._send(stale, stale.hello()))
        stale.receive_hello(self._send(fresh, fresh.hello()))
        depth = stale.depth
        compared = np.zeros(depth, np.int64)
        message, sender, receiver = self._send(stale, stale.roots()), stale, fresh
        while True:
            _, level, _, _, items = HEADER.unpack_from(message)
            compared[level] += items
            reply = receiver.receive_nodes(message)
            sender, receiver = receiver, sender
            message = self._send(sender, reply)
            if HEADER.unpack_from(message)[0] == LEAVES:
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
        table = as_table(fresh)
        keys = key_names(key)
        rows = table.filter(rows_under_diff(table, keys, key_type, found))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rows.schema) as writer:
            writer.write_table(rows)
        payload = sink.getvalue().size
        self.messages.append(SyncMessage("fresh", "rows", -1, rows.num_rows,
                                         HEADER.size + payload))
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
