"""Merkle resync of a storage slot that missed snapshots (issue 25 item 2; seed 004's
"Synchronizing persisted data faster", ``shared/HAZELCAST.md`` §5).

A slot that comes back (a member that was away, a slot reclaimed after its task died)
holds replicas of an older snapshot's chunk files, while the newest committed snapshot's
record names partitions it should hold. Instead of copying those partitions' byte ranges
whole (the backup stream, :mod:`sparkjet.runtime.storage`), it syncs them from a current
holder with one Merkle tree per (vertex, partition) (:mod:`sparkjet.merkle`):

1. **Open** (action ``merkle_open`` on the holder's exchange server, fenced by the
   execution like every action): the holder reads its copy of the file's chunks of those
   partitions (checked against their checksums), builds a :class:`~sparkjet.merkle.MerkleForest`
   of ``merkle_tree_depth`` levels over their entries (``value_hash="entry"``: each value
   bound to its key; a table chunk's entries are its rows, keyed by the vertex's state key;
   an entry chunk's are its key and value bytes), and answers its hello, the schema, and
   every partition's root and entry count.
2. **Walk** (``merkle_step``, one action per tree level): the stale slot builds its forest
   over the entries of the same (vertex, partition)s that its old copies hold (while the
   holder builds its own), compares its roots with the holder's, and runs the rest of the
   :class:`~sparkjet.merkle.SyncSession` walk with the holder, message by message.
3. **Fetch** (file stream ``merkle_rows``, Flight ``DoGet``): the holder's rows under the
   differing leaves of the partitions named (the leaves sent, or the holder's own answer
   that ended the walk), each with its position in its partition, as a zstd Arrow IPC
   stream, and the 64-byte headers of those partitions' chunks.
4. **Rebuild and verify**: per partition, the old rows under equal leaves are kept in their
   order, the fetched rows put at their positions (slices of both tables, no row copied
   until its chunk is encoded); the partition's entry count and root
   hash must equal the holder's (else :class:`~sparkjet.errors.MerkleSyncError`, naming
   vertex, partition, file and holder, and nothing is kept). The rows are cut into the
   holder's chunks (their entry counts) and encoded as the writer encodes them
   (:func:`~sparkjet.snapshot.chunks.encode_payload`): a chunk whose payload hashes to the
   record's checksum is the holder's chunk byte for byte, so the copy is a replica of the
   current snapshot like one the backup stream wrote (a sparse file of the file's size
   plus its ``.ranges`` sidecar), verified by the record like any other.
5. **Merkle or copy, per partition**: each partition goes the cheaper way. A partition so
   small that a Merkle sync of a single changed entry would move :data:`SMALL_SHARE` of
   its copy's bytes is copied without a walk (known from the record; when every one is,
   no walk opens). The roots
   compare with the holder's from its answer to the open (equal: nothing more moves);
   before each walk message the stale side drops from it the partitions a plain copy of
   their chunks (``slot_read``) moves less for: all nodes of a level differ and the next
   message costs over :data:`SATURATED_SHARE` of the copy's bytes (a dense change), or the
   rest of the walk and the rows under the leaves that would differ, estimated from the
   nodes differing so far, reach :data:`COPY_SHARE` of them, or the walk would pass
   :data:`WALK_SHARE` of them (the bound: a partition never moves more than that share of
   its copy on top of the copy). At the leaves, the rows to fetch are known exactly (the
   holder's entries less the old ones under equal leaves): a partition whose walk and rows
   would reach :data:`LEAF_SHARE` of its copy is copied. A partition whose rebuilt bytes
   differ (its rows were reordered between the snapshots, so the entries agree but the
   bytes do not) and broadcast state are copied too. The report says which way each
   partition went (``ways``: ``"merkle"`` or ``"copy"``, ``fallback``: why) and what each
   moved (``partition_bytes``).

The granularity is the entry: what moves is the walk's messages, the chunk headers and the
rows under differing leaves. :class:`ResyncReport` gives bytes synced against a full copy's
(the chunks' stored bytes).

In a job, a member calls :func:`resync_for_restore` before it restores (the partitions it
owns, from files its slot has no copy of, when the slot keeps an older snapshot's copies,
from the file's writer when a member holds it, else each partition from a backup that backs
it: a backup holds only those partitions' ranges),
and its restore then reads a resynced copy from its own slot before the holders the record
names (:func:`~sparkjet.runtime.storage.resynced_copy`: the sidecar says ``"resynced"``).
The recovery policy still counts only the holders the committed record names.
"""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import struct
import threading
import time
import uuid as uuidlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import xxhash

from sparkjet import _native
from sparkjet.errors import (
    ExchangeRefusedError,
    FencedError,
    InvalidArgumentError,
    MerkleSyncError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
    SparkjetError,
    UnsupportedTypeError,
)
from sparkjet.merkle import MerkleForest, choose_depth
from sparkjet.merkle.compare import leaf_set, rows_under_leaves
from sparkjet.merkle.forest import MODES, check_depth
from sparkjet.merkle.protocol import (
    GROUP,
    HEADER,
    HELLO,
    HELLO_BODY,
    LEAF,
    LEAVES,
    NODES,
    PAIR,
    Party,
    decode_message,
    encode_message,
)
from sparkjet.partition_table import PartitionTable
from sparkjet.runtime.storage import (
    RANGES_SUFFIX,
    READ_PIECE,
    LocalSlotFile,
    PeerSlotFile,
    held_ranges,
)
from sparkjet.snapshot import layout
from sparkjet.snapshot import records as meta
from sparkjet.snapshot.chunks import (
    BLOSC2_CLEVELS,
    HEADER_SIZE,
    ChunkHeader,
    decode_entries,
    decode_table,
    encode_payload,
    read_chunks,
)
from sparkjet.snapshot.reading import partition_holders
from sparkjet.snapshot.slots import REPLICAS, StorageSlot

_log = logging.getLogger(__name__)

OPEN, STEP, ROWS, CLOSE = "merkle_open", "merkle_step", "merkle_rows", "merkle_close"
#: Columns the fetched rows carry besides the entry's: its partition and its position there.
PART, POS = "__sparkjet_partition", "__sparkjet_pos"
#: The key column of an entry chunk's entries (its value: ``value``).
ENTRY_KEY = "key"
#: Sessions a holder keeps open at once (the oldest goes first), and how long one unused
#: stays (a stale side that gave up, or died, never closes its own).
MAX_SESSIONS = 4
SESSION_IDLE_S = 120.0
#: A partition is copied as byte ranges once its walk (its share of the messages so far,
#: the next one and its answer) would pass this share of its copy's bytes...
WALK_SHARE = 0.5
#: ... or once the bytes its Merkle sync would still move (the rest of the walk and the
#: rows under its differing leaves, estimated from the nodes found differing so far) reach
#: this share...
COPY_SHARE = 0.5
#: ... or, at the leaves, once its walk and the rows under its differing leaves (known
#: before they move: the old entries under equal leaves are kept) reach this share.
LEAF_SHARE = 0.8
#: A partition all of whose nodes of a level (of 4 or more) differ goes on only while the
#: next message and its answer cost less than this share of its copy's bytes (a dense
#: change saturates level after level; a sparse one stops doing so within a few levels).
SATURATED_SHARE = 0.02
#: A partition of which a Merkle sync of a single changed entry would move this share of
#: a copy's bytes is copied without a walk (known from the record: no open for it).
SMALL_SHARE = 0.25
#: ``merkle_tree_depth="auto"``: the share of entries assumed changed.
AUTO_CHANGED = 0.001


def _b64(data) -> str:
    return base64.b64encode(bytes(data)).decode()


def _unb64(text, what: str) -> bytes:
    try:
        return base64.b64decode(str(text), validate=True)
    except ValueError:
        raise InvalidArgumentError(f"{what}: not base64") from None


def _read_chunk(read, path: str, c: meta.ChunkEntry, where: str):
    """(header bytes, header, payload) of chunk ``c`` of ``path``, checked against its
    checksum and the record."""
    buf = read(c.offset, HEADER_SIZE + c.stored_size)
    buf = buf if isinstance(buf, pa.Buffer) else pa.py_buffer(buf)
    found = read_chunks(buf, f"{where}: {path}")
    if len(found) != 1:
        raise SnapshotCorruptError(f"{where}: {path}", c.offset, "chunk", "not one chunk there")
    _, header, payload = found[0]
    if header.checksum != c.checksum or header.partition != c.partition:
        raise SnapshotCorruptError(f"{where}: {path}", c.offset, "checksum",
                                   f"{header.checksum:016x}, record says {c.checksum:016x}")
    return buf.slice(0, HEADER_SIZE), header, payload


#: The largest walk message a side unpacks (a bound on what a hostile size asks for).
MAX_MESSAGE = 1 << 30


def _pack(message: bytes) -> str:
    """A walk message for a JSON body: its items' node orders as differences (small
    numbers, where the orders themselves fill half the message), zstd, base64. The message
    itself (:mod:`sparkjet.merkle.protocol`) is unchanged: :func:`_unpack` gives it back."""
    kind, _, _, groups, items = HEADER.unpack_from(message)
    head = HEADER.size + groups * GROUP.itemsize
    if kind == NODES and len(message) == head + items * PAIR.itemsize:
        pairs = np.frombuffer(message, PAIR, items, head)
        nodes = pairs["node"].astype(np.int64)
        body = (bytes(message[:head]) + np.diff(nodes, prepend=0).astype("<i4").tobytes()
                + pairs["hash"].astype("<i4").tobytes())
    elif kind == LEAVES and len(message) == head + items * LEAF.itemsize:
        nodes = np.frombuffer(message, LEAF, items, head).astype(np.int64)
        body = bytes(message[:head]) + np.diff(nodes, prepend=0).astype("<i4").tobytes()
    else:
        body = bytes(message)
    return _b64(struct.pack(">I", len(body)) + pa.compress(body, codec="zstd", asbytes=True))


def _unpack(text, what: str) -> bytes:
    """The walk message :func:`_pack` packed; InvalidArgumentError when it does not read."""
    raw = _unb64(text, what)
    if len(raw) < 4 or struct.unpack_from(">I", raw)[0] > MAX_MESSAGE:
        raise InvalidArgumentError(f"{what}: not a packed Merkle message")
    size = struct.unpack_from(">I", raw)[0]
    try:
        body = pa.decompress(raw[4:], decompressed_size=size, codec="zstd", asbytes=True)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise InvalidArgumentError(f"{what}: the message does not decompress ({e})") from None
    if len(body) < HEADER.size:
        raise InvalidArgumentError(f"{what}: {len(body)} bytes, no header")
    kind, _, _, groups, items = HEADER.unpack_from(body)
    head = HEADER.size + groups * GROUP.itemsize
    if kind == NODES and len(body) == head + items * PAIR.itemsize:
        deltas = np.frombuffer(body, "<i4", items, head)
        pairs = np.empty(items, PAIR)
        pairs["node"] = np.cumsum(deltas, dtype=np.int64)
        pairs["hash"] = np.frombuffer(body, "<i4", items, head + 4 * items)
        return body[:head] + pairs.tobytes()
    if kind == LEAVES and len(body) == head + items * LEAF.itemsize:
        nodes = np.cumsum(np.frombuffer(body, "<i4", items, head), dtype=np.int64)
        return body[:head] + nodes.astype(LEAF).tobytes()
    return body


#: A chunk as the open names it: offset, stored size, checksum, entries, partition.
CHUNK = np.dtype([("offset", "<i8"), ("stored_size", "<i8"), ("checksum", "<u8"),
                  ("entry_count", "<i8"), ("partition", "<i4")])


def _pack_chunks(chunks) -> str:
    """The chunks an open names, packed (:data:`CHUNK` rows, offsets as differences, zstd,
    base64): about half the bytes of the JSON lists :func:`_chunk_list` also reads."""
    rows = np.array([(c.offset, c.stored_size, c.checksum, c.entry_count, c.partition)
                     for c in chunks], CHUNK)
    rows["offset"] = np.diff(rows["offset"], prepend=0)
    data = rows.tobytes()
    return _b64(struct.pack(">I", len(data)) + pa.compress(data, codec="zstd", asbytes=True))


def _chunk_list(value) -> list:
    """The chunks of an open: JSON lists as they are, or :func:`_pack_chunks`'s text."""
    if not isinstance(value, str):
        return list(value or [])
    raw = _unb64(value, "merkle_open chunks")
    if len(raw) < 4 or struct.unpack_from(">I", raw)[0] > MAX_MESSAGE \
            or struct.unpack_from(">I", raw)[0] % CHUNK.itemsize:
        raise InvalidArgumentError("merkle_open chunks: not a packed chunk list")
    try:
        data = pa.decompress(raw[4:], decompressed_size=struct.unpack_from(">I", raw)[0],
                             codec="zstd", asbytes=True)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise InvalidArgumentError(f"merkle_open chunks: do not decompress ({e})") from None
    rows = np.frombuffer(data, CHUNK).copy()
    rows["offset"] = np.cumsum(rows["offset"])
    return [[int(r["offset"]), int(r["stored_size"]), int(r["checksum"]), int(r["entry_count"]),
             int(r["partition"])] for r in rows]


def _decode(header: ChunkHeader, payload, where: str, offset: int) -> pa.Table:
    """A chunk's entries as a table: its rows, or (key, value) binary columns."""
    if header.entries:
        keys, values = decode_entries(header, payload, where, offset)
        return pa.table({ENTRY_KEY: keys, "value": values})
    return decode_table(header, payload, where, offset)


def _key_of(entries: bool, key) -> tuple[str, ...]:
    if entries:
        return (ENTRY_KEY,)
    if key is None:
        raise InvalidArgumentError("a table chunk's entries need the vertex's state key "
                                   "(key=) to be placed in Merkle leaves")
    return (key,) if isinstance(key, str) else tuple(key)


def _forest(tables: dict[int, pa.Table], keys, depth: int, partition_count: int) -> MerkleForest:
    forest = MerkleForest(partition_count, depth, value_hash="entry")
    full = [t for t in tables.values() if t.num_rows]
    if full:
        t = full[0] if len(full) == 1 else pa.concat_tables(full)
        values = [n for n in t.schema.names if n not in keys and n not in (PART, POS)]
        forest.add(t, key=list(keys), value=values)
    return forest


def _ipc(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd", use_threads=False)
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue()


# -- the holder ------------------------------------------------------------------------------


class _Session:
    def __init__(self, party: Party, table: pa.Table, keys, depth: int, partition_count: int):
        self.party, self.table, self.keys = party, table, keys
        self.depth, self.partition_count = depth, partition_count
        self.headers: list = []
        self.leaves: bytes | None = None    # its answer that ended the walk, if it did
        self.used = time.monotonic()


class MerkleHolder:
    """The holder's side, on a member's exchange server (:meth:`register`): the actions
    ``merkle_open`` and ``merkle_step`` and the file stream ``merkle_rows`` over the chunk
    files of ``slot`` for ``job_id`` (its own or the ranges a backup holds; anything else
    is refused, as ``slot_read`` refuses it)."""

    def __init__(self, slot: StorageSlot, job_id: int):
        self.slot, self.job_id = slot, job_id
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, server) -> None:
        server.on_action(OPEN, self.open)
        server.on_action(STEP, self.step)
        server.on_action(CLOSE, self.close)
        server.on_get(ROWS, self.rows)

    def _expire(self) -> None:
        """Drops the sessions unused for SESSION_IDLE_S (with the lock held)."""
        now = time.monotonic()
        for name in [k for k, v in self._sessions.items() if now - v.used > SESSION_IDLE_S]:
            del self._sessions[name]

    def _session(self, body: dict) -> _Session:
        with self._lock:
            self._expire()
            session = self._sessions.get(str(body.get("session")))
            if session is not None:
                session.used = time.monotonic()
        if session is None:
            raise InvalidArgumentError(f"no Merkle sync session {body.get('session')!r} on "
                                       f"slot {self.slot.uuid} (never opened, or ended)")
        return session

    def open(self, body: dict) -> dict:
        """Body ``{session, slot, path, chunks: [[offset, stored_size, checksum,
        entry_count, partition], ...] (or those packed, :func:`_pack_chunks`), key, depth,
        partition_count, hello}``."""
        if body.get("slot") != self.slot.uuid:
            raise InvalidArgumentError(f"this member holds slot {self.slot.uuid}, not "
                                       f"{body.get('slot')!r}")
        depth, count = body.get("depth"), body.get("partition_count")
        check_depth(depth)
        path = str(body.get("path"))
        where = f"slot {self.slot.uuid}"
        read = LocalSlotFile(self.slot, self.job_id, path).range_reader()
        headers, parts = [], {}
        entries = None
        for raw in _chunk_list(body.get("chunks")):
            c = meta.convert(raw, meta.ChunkEntry, "merkle_open chunk")
            head, header, payload = _read_chunk(read, path, c, where)
            entries = header.entries
            headers.append([_b64(head), header.codec, header.flags, c.partition])
            parts.setdefault(c.partition, []).append(_decode(header, payload, path, c.offset))
        if entries is None:
            raise InvalidArgumentError(f"merkle_open of {path}: no chunks named")
        keys = _key_of(entries, body.get("key"))
        tables = {}
        for p in sorted(parts):     # ascending: the rows stream counts them in this order
            t = pa.concat_tables(parts[p])
            tables[p] = t.append_column(PART, pa.array(np.full(t.num_rows, p, np.int32))) \
                .append_column(POS, pa.array(np.arange(t.num_rows, dtype=np.int32)))
        forest = _forest(tables, keys, depth, count)
        party = Party("fresh", forest)
        party.receive_hello(_unb64(body.get("hello"), "merkle_open hello"))
        roots = forest.roots
        session = _Session(party, pa.concat_tables(tables.values()), keys, depth, count)
        session.headers = headers       # sent with the rows: a walk that stops needs none
        with self._lock:
            self._expire()
            self._sessions[str(body.get("session"))] = session
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        schema = next(iter(tables.values())).schema
        schema = pa.schema([f for f in schema if f.name not in (PART, POS)], schema.metadata)
        return {"hello": _b64(party.hello()), "entries": entries,
                "schema": _b64(schema.serialize()),
                "roots": {str(p): int(roots[p]) for p in tables},
                "counts": {str(p): tables[p].num_rows for p in tables}}

    def close(self, body: dict) -> dict:
        """Ends session ``{session}`` (a walk that stopped for a copy, or failed): its rows
        and trees are let go at once. Closing one that is gone is no error."""
        with self._lock:
            found = self._sessions.pop(str(body.get("session")), None) is not None
        return {"closed": found}

    def step(self, body: dict) -> dict:
        """One message of the walk in, the answer out (``{session, message}``)."""
        session = self._session(body)
        reply = session.party.receive_nodes(_unpack(body.get("message"), "merkle_step"))
        if HEADER.unpack_from(reply)[0] == LEAVES:
            session.leaves = reply      # the rows request may name it rather than send it back
        return {"message": _pack(reply)}

    def rows(self, body: dict):
        """The rows under the leaves of the ``leaves`` message (without one: of this holder's
        answer that ended the walk), of the ``partitions`` named (default: all), as a zstd
        Arrow IPC stream with their position, and the headers of those partitions' chunks;
        ends the session."""
        session = self._session(body)
        with self._lock:
            self._sessions.pop(str(body.get("session")), None)
        if body.get("leaves") is None:
            if session.leaves is None:
                raise InvalidArgumentError("merkle_rows: no leaves sent, and the walk did not "
                                           "end with this holder's")
            leaves = session.leaves
        else:
            leaves = _unpack(body.get("leaves"), "merkle_rows leaves")
        level, partitions, nodes = session.party.receive_leaves(leaves)
        wanted = body.get("partitions")
        wanted = None if wanted is None else {int(p) for p in wanted}
        if wanted is not None:
            chosen = np.isin(partitions, list(wanted))
            partitions, nodes = partitions[chosen], nodes[chosen]
        rows = session.table.filter(_under(session, level, partitions, nodes))
        # grouped by partition already (the session's rows are): counts say where each
        # group ends, so the partition column stays home
        found, counts = np.unique(rows[PART].to_numpy(), return_counts=True) \
            if rows.num_rows else (np.empty(0, np.int32), np.empty(0, np.int64))
        data = _ipc(rows.drop_columns([PART]).combine_chunks())
        pieces = (data.slice(at, min(READ_PIECE, data.size - at))
                  for at in range(0, data.size, READ_PIECE))
        headers = [h[:3] for h in session.headers if wanted is None or h[3] in wanted]
        return {"rows": rows.num_rows, "bytes": data.size, "headers": headers,
                "parts": [[int(p), int(n)] for p, n in zip(found, counts)]}, pieces


def _under(session, level: int, partitions, nodes):
    """Mask of the session's rows under the differing leaves."""
    depth, count = session.depth, session.partition_count
    per = 1 << (depth - 1)
    ids = (partitions * per + (nodes - (per - 1)) if level == depth - 1 and len(nodes)
           else np.empty(0, np.int64))
    table = session.table
    if not len(ids) or not table.num_rows:
        return pa.array(np.zeros(table.num_rows, bool))
    return rows_under_leaves(table, session.keys, None, leaf_set(ids, depth, count))


# -- the stale slot --------------------------------------------------------------------------


@dataclass
class ResyncReport:
    """What one file's resync moved. ``synced_bytes`` (walk, headers, rows and ranges
    copied) against ``full_copy_bytes`` (the stored bytes of the chunks a copy moves).
    ``ways``: each keyed partition's way, ``"merkle"`` or ``"copy"`` (``fallback`` says why
    a partition was copied); ``partition_bytes``: what each moved (its share of the walk,
    headers and rows; a copied one's chunks too, after whatever walk it had before)."""

    path: str
    holder: str
    depth: int
    partitions: list[int]
    entries: int = 0
    differing_leaves: int = 0
    rows_fetched: int = 0
    tree_bytes: int = 0
    header_bytes: int = 0
    row_bytes: int = 0
    copied_bytes: int = 0
    full_copy_bytes: int = 0
    messages: int = 0
    fallback: dict = field(default_factory=dict)
    ways: dict = field(default_factory=dict)
    partition_bytes: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def synced_bytes(self) -> int:
        return self.tree_bytes + self.header_bytes + self.row_bytes + self.copied_bytes

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["synced_bytes"] = self.synced_bytes
        return out


def _merged(reports: list[ResyncReport], seconds: float) -> ResyncReport:
    """One file's report from the reports of its partitions synced from several holders."""
    if len(reports) == 1:
        reports[0].seconds = seconds
        return reports[0]
    first = reports[0]
    out = ResyncReport(first.path, ", ".join(r.holder for r in reports), first.depth,
                       sorted(p for r in reports for p in r.partitions), seconds=seconds)
    for name in ("entries", "differing_leaves", "rows_fetched", "tree_bytes", "header_bytes",
                 "row_bytes", "copied_bytes", "full_copy_bytes", "messages"):
        setattr(out, name, sum(getattr(r, name) for r in reports))
    for r in reports:
        out.fallback.update(r.fallback)
        out.ways.update(r.ways)
        out.partition_bytes.update(r.partition_bytes)
    return out


#: The most memory one Merkle forest of an explicit ``merkle_tree_depth`` may take.
EXPLICIT_LIMIT = 512 * 2**20


def resolve_depth(depth, entries: int, partitions: int, partition_count: int,
                  row_bytes: int) -> int:
    """``merkle_tree_depth`` as a number: an int as is, "auto" :func:`~sparkjet.merkle.choose_depth`
    for ``entries`` over ``partitions`` of ``partition_count`` (about 0.1 % changed), within
    160 MiB per forest."""
    if depth != "auto":
        check_depth(depth)
        # a forest holds 4 bytes per node of every partition's tree on each side of the
        # walk (and in every session a holder keeps): deeper than fits in EXPLICIT_LIMIT,
        # the deepest that fits is used (a depth of 27 would ask for about 145 GB)
        fits = depth
        while fits > 2 and 4 * partition_count * ((1 << fits) - 1) > EXPLICIT_LIMIT:
            fits -= 1
        if fits != depth:
            _log.warning("merkle_tree_depth %d: a forest of %d partitions would take %.1f GB; "
                         "depth %d is used (%d MB)", depth, partition_count,
                         4 * partition_count * ((1 << depth) - 1) / 1e9, fits,
                         4 * partition_count * ((1 << fits) - 1) // 2**20)
        return fits
    parts = max(1, partitions)
    limit = max(1, 160 * 2**20 * parts // partition_count)
    return choose_depth(max(1, entries), max(1, int(entries * AUTO_CHANGED)), parts,
                        row_bytes=max(1, row_bytes), memory_limit=limit)


def _holds_old(slot: StorageSlot, job_id: int, old: meta.ValidationRecord, vertex: str,
               parts: set[int]) -> bool:
    """Whether the slot's copies of ``old`` hold a chunk of ``vertex``'s ``parts`` (what a
    walk would start from: without one, a resync is a copy with extra steps)."""
    if vertex not in old.vertices:
        return False
    folder = layout.snapshot_dir(old.snapshot_id, old.execution_id)
    for f in old.vertices[vertex].files:
        path = f"{layout.SNAPSHOTS}/{folder}/{f.path}"
        if not os.path.exists(os.path.join(slot.job_path(job_id, REPLICAS), *path.split("/"))):
            continue
        try:
            file = LocalSlotFile(slot, job_id, path)
        except SparkjetError:
            continue
        if any(c.partition in parts and file.holds(c.offset, HEADER_SIZE + c.stored_size)
               for c in f.chunks):
            return True
    return False


def _old_tables(slot: StorageSlot, job_id: int, old: meta.ValidationRecord | None, vertex: str,
                parts: set[int], kinds: set | None = None) -> dict[int, list[pa.Table]]:
    """The entries of ``vertex``'s ``parts`` that the slot's copies of ``old`` hold (a chunk
    that does not read is left out, logged: its entries are then fetched); ``kinds`` gets
    whether each chunk read was an entry chunk."""
    out: dict[int, list[pa.Table]] = {}
    if old is None or vertex not in old.vertices:
        return out
    folder = layout.snapshot_dir(old.snapshot_id, old.execution_id)
    for f in old.vertices[vertex].files:
        path = f"{layout.SNAPSHOTS}/{folder}/{f.path}"
        local = os.path.join(slot.job_path(job_id, REPLICAS), *path.split("/"))
        if not os.path.exists(local):
            continue
        try:
            file = LocalSlotFile(slot, job_id, path)
            read = file.range_reader()
        except SparkjetError as e:
            _log.warning("Merkle resync: slot %s: %s: %s", slot.uuid, path, e)
            continue
        for c in f.chunks:
            if c.partition not in parts or not file.holds(c.offset, HEADER_SIZE + c.stored_size):
                continue
            try:
                _, header, payload = _read_chunk(read, path, c, f"slot {slot.uuid}")
                out.setdefault(c.partition, []).append(
                    _decode(header, payload, path, c.offset))
                if kinds is not None:
                    kinds.add(header.entries)
            except (SparkjetError, OSError) as e:
                _log.warning("Merkle resync: slot %s: old chunk at %d of %s left out (%s): its "
                             "entries are fetched", slot.uuid, c.offset, path, e)
    return out


def _json_size(doc: dict) -> int:
    return len(json.dumps(doc))


def resync_file(slot: StorageSlot, job_id: int, client, holder: str, record: meta.ValidationRecord,
                f: meta.FileRecord, partitions, old: meta.ValidationRecord | None, *,
                key=None, depth=10, partition_count: int = 271, member: int = -1,
                execution: int | None = None) -> ResyncReport:
    """Brings ``slot``'s copy of file ``f`` of snapshot ``record`` (its chunks of
    ``partitions``; -1: broadcast state) up to date from slot ``holder`` (reached over
    ``client``, the holder member's exchange client) with Merkle trees, starting from the
    entries of the same vertex and partitions that the slot's copies of the older snapshot
    ``old`` hold. ``key``: the vertex's state key (table chunks). Writes the copy, verified
    chunk by chunk against the record, and returns the :class:`ResyncReport`;
    MerkleSyncError when the rebuilt entries are not the holder's. ``execution``: the one
    resyncing; FencedError, and no copy, when the slot has seen a newer one."""
    began = time.monotonic()
    report, chunks = _resync_chunks(slot, job_id, client, holder, record, f, partitions, old,
                                    key=key, depth=depth, partition_count=partition_count,
                                    member=member)
    rel = f"{layout.SNAPSHOTS}/{layout.snapshot_dir(record.snapshot_id, record.execution_id)}/{f.path}"
    _write_copy(slot, job_id, rel, f.bytes, chunks, _fence(slot, job_id, execution))
    report.seconds = time.monotonic() - began
    return report


def _resync_chunks(slot: StorageSlot, job_id: int, client, holder: str,
                   record: meta.ValidationRecord, f: meta.FileRecord, partitions,
                   old: meta.ValidationRecord | None, *, key=None, depth=10,
                   partition_count: int = 271, member: int = -1) -> tuple[ResyncReport, dict]:
    """:func:`resync_file` up to the copy: its report and the chunks synced (offset ->
    bytes), not yet written."""
    parts = set(partitions)
    wanted = [c for c in f.chunks if c.partition in parts]
    keyed = [c for c in wanted if c.partition >= 0]
    rel = f"{layout.SNAPSHOTS}/{layout.snapshot_dir(record.snapshot_id, record.execution_id)}/{f.path}"
    entries = sum(c.entry_count for c in keyed)
    stored = sum(c.stored_size for c in keyed)
    depth = resolve_depth(depth, entries, len({c.partition for c in keyed}), partition_count,
                          stored // max(1, entries))
    report = ResyncReport(rel, holder, depth, sorted(parts), entries=entries,
                          full_copy_bytes=sum(HEADER_SIZE + c.stored_size for c in wanted))
    where = f"Merkle resync of {rel} (vertex {f.vertex}) from slot {holder}"
    chunks: dict[int, bytes | pa.Buffer] = {}      # offset -> the chunk's bytes
    copy = [c for c in wanted if c.partition < 0]
    small = _too_small(keyed, depth)
    walked = [c for c in keyed if c.partition not in small]
    report.fallback.update(small)
    if keyed:
        built, mismatched = {}, set(small)
        try:
            if walked:
                built, more = _merkle(slot, job_id, client, holder, f, walked, old, key,
                                      depth, partition_count, rel, where, report)
                mismatched |= more
        except (InvalidArgumentError, UnsupportedTypeError, ExchangeRefusedError) as e:
            # entries the trees cannot take (no state key, a column type the value hash
            # does not read; the holder refused to open the walk for such a reason): the
            # partitions go as byte ranges, which fail in turn if the holder cannot serve
            built, mismatched = {}, {c.partition for c in keyed}
            why = f"{type(e).__name__}: {e}"
            report.fallback.update({p: why for p in sorted(mismatched) if p not in small})
        chunks.update(built)
        for p in sorted(mismatched):
            report.fallback.setdefault(
                p, "the rebuilt rows are the holder's entries, but their chunks' bytes differ "
                   "from the record's checksums (rows reordered between the snapshots): "
                   "copied as byte ranges")
        copy += [c for c in keyed if c.partition in mismatched]
        for p in sorted({c.partition for c in keyed}):
            report.ways[p] = "copy" if p in mismatched else "merkle"
            if p in mismatched:
                report.partition_bytes[p] = report.partition_bytes.get(p, 0) + sum(
                    HEADER_SIZE + c.stored_size for c in keyed if c.partition == p)
    report.copied_bytes += _copy_chunks(client, holder, rel, copy, member, chunks)
    return report, chunks


def _by_holder(record: meta.ValidationRecord, f: meta.FileRecord, mine: set[int],
               members: dict) -> dict[str, set[int]] | None:
    """``mine`` (partitions of file ``f``; -1: broadcast state) split by the slot of a
    member of this execution that holds them: the file's writer when it is one (it holds
    every byte), else per partition a backup that backs it (a backup holds only the ranges
    of the partitions it backs, :func:`~sparkjet.snapshot.reading.partition_holders`);
    None when some partition has no such holder."""
    if f.slot in members:
        return {f.slot: set(mine)}
    holders = partition_holders(SimpleNamespace(record=record))
    out: dict[str, set[int]] = {}
    for p in sorted(q for q in mine if q >= 0):
        u = next((u for u in holders(f, p) if u in members), None)
        if u is None:
            return None
        out.setdefault(u, set()).add(p)
    if -1 in mine:          # every replica holds broadcast state whole
        u = next(iter(out), None) or next((u for u in f.holders if u in members), None)
        if u is None:
            return None
        out.setdefault(u, set()).add(-1)
    return out


def _fence(slot: StorageSlot, job_id: int, execution: int | None):
    """What a copy's writer calls before it renames the copy into place."""
    if execution is None:
        return None
    return lambda: slot.check_fence(job_id, execution)


def copy_file(slot: StorageSlot, job_id: int, client, holder: str,
              record: meta.ValidationRecord, f: meta.FileRecord, partitions, *,
              member: int = -1, execution: int | None = None) -> ResyncReport:
    """A full copy of ``f``'s chunks of ``partitions`` from slot ``holder`` as byte ranges
    (``slot_read``), each checked against the record: what a resync falls back to, and
    what it is measured against (``bench/bench_merkle_resync.py``)."""
    began = time.monotonic()
    parts = set(partitions)
    wanted = [c for c in f.chunks if c.partition in parts]
    rel = f"{layout.SNAPSHOTS}/{layout.snapshot_dir(record.snapshot_id, record.execution_id)}/{f.path}"
    report = ResyncReport(rel, holder, 0, sorted(parts),
                          entries=sum(c.entry_count for c in wanted),
                          full_copy_bytes=sum(HEADER_SIZE + c.stored_size for c in wanted))
    chunks: dict = {}
    report.copied_bytes = _copy_chunks(client, holder, rel, wanted, member, chunks)
    _write_copy(slot, job_id, rel, f.bytes, chunks, _fence(slot, job_id, execution))
    report.seconds = time.monotonic() - began
    return report


def _copy_chunks(client, holder: str, rel: str, copy, member: int, chunks: dict) -> int:
    """Reads ``copy`` (chunk entries) of ``rel`` from slot ``holder`` into ``chunks``
    (offset -> bytes), each checked against the record; the bytes read."""
    if not copy:
        return 0
    read = PeerSlotFile(client, holder, rel, member).range_reader()
    n = 0
    runs: list[list] = []           # adjacent chunks read in one stream
    for c in sorted(copy, key=lambda c: c.offset):
        if runs and runs[-1][-1].offset + HEADER_SIZE + runs[-1][-1].stored_size == c.offset:
            runs[-1].append(c)
        else:
            runs.append([c])
    for run in runs:
        start = run[0].offset
        data = read(start, run[-1].offset + HEADER_SIZE + run[-1].stored_size - start)
        data = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
        for c in run:
            piece = data.slice(c.offset - start, HEADER_SIZE + c.stored_size)
            _read_chunk(lambda _o, _n, p=piece: p, rel, c, f"slot {holder}")   # checked
            chunks[c.offset] = piece.to_pybytes()
            n += HEADER_SIZE + c.stored_size
    return n


def _merkle(slot, job_id, client, holder, f, keyed, old, key, depth, partition_count, rel,
            where, report):
    """The walk, the fetch and the rebuild: ({offset: chunk bytes} of the partitions rebuilt
    byte for byte, {partitions whose bytes differ})."""
    session = str(uuidlib.uuid4())
    hello = HEADER.pack(HELLO, 0, 0, 0, 0) + HELLO_BODY.pack(depth, partition_count,
                                                             MODES["entry"])
    body = {"session": session, "slot": holder, "path": rel, "key": key, "depth": depth,
            "partition_count": partition_count, "hello": _b64(hello),
            "chunks": _pack_chunks(keyed)}
    # the stale side reads its old entries and builds its trees while the holder reads and
    # builds its own: both sides decode and hash every entry, the rest of the resync is small
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="merkle-local") as pool:
            local = pool.submit(_local, slot, job_id, old, f.vertex,
                                {c.partition for c in keyed}, key, depth, partition_count)
            answer = client.action(OPEN, body)      # on error, the pool waits for local
            built = local.result()
        return _walk(slot, job_id, client, session, answer, body, f, keyed, old, key, depth,
                     partition_count, rel, where, report, built)
    finally:
        # the holder lets the session go at once (rows() ended it already on success)
        with contextlib.suppress(Exception):
            client.action(CLOSE, {"session": session})


@dataclass
class _Part:
    """One partition of a resync: what a copy of it moves, its entries on either side, and
    its share of the bytes moved so far (the walk's messages, then its rows)."""

    copy: int               # its chunks' bytes, headers included
    rows: int               # the holder's entries
    old: int                # the stale side's
    headers: int            # its chunks' headers' bytes
    spent: float = 0.0

    @property
    def row_bytes(self) -> float:
        """A copy's bytes per entry, headers left out (about what a fetched row costs)."""
        return (self.copy - self.headers) / max(1, self.rows)


def _too_small(keyed, depth: int) -> dict[int, str]:
    """The partitions of ``keyed`` (chunk entries) too small for a walk, with why: those of
    which a Merkle sync of even one changed entry (its share of the open, a message per
    level, a row) would move :data:`SMALL_SHARE` of a copy's bytes. Known from the record
    alone: they are copied without opening a walk."""
    chunks: dict[int, list] = {}
    for c in keyed:
        chunks.setdefault(c.partition, []).append(c)
    out = {}
    for p, cs in chunks.items():
        copy = sum(HEADER_SIZE + c.stored_size for c in cs)
        rows = sum(c.entry_count for c in cs)
        part = _Part(copy, rows, rows, HEADER_SIZE * len(cs))
        least = OPEN_BYTES + OPEN_CHUNK_BYTES * len(cs) + _still(part, 1, 0, depth, len(chunks))
        if least >= SMALL_SHARE * copy:
            out[p] = (f"a Merkle sync of even one changed entry would move about {least:,.0f} "
                      f"bytes, over {SMALL_SHARE:.0%} of a copy's {copy:,}: copied as byte "
                      f"ranges")
    return out


def _changes(part: _Part, differ: int, nodes: int) -> float:
    """The changed entries a partition probably has when ``differ`` of the ``nodes`` nodes of
    a level differ: ``nodes * ln((nodes + 1) / (nodes + 1 - differ))`` (the inverse of
    ``nodes * (1 - exp(-changes / nodes))``, finite when every node differs), at least
    ``differ`` and the change in its entry count, at most the entries of both sides."""
    guess = nodes * math.log((nodes + 1) / (nodes + 1 - differ))
    return min(part.rows + part.old, max(differ, abs(part.rows - part.old), guess))


#: What a walk message costs besides its items, about: its action's JSON, the header, a
#: partition's group (split among the partitions of the message), and an item.
MESSAGE_BYTES, GROUP_BYTES, ITEM_BYTES = 90, 11, 8
#: What the open costs per partition and per chunk, about (their roots and counts in the
#: answer; the chunks named in the request).
OPEN_BYTES, OPEN_CHUNK_BYTES = 30, 60


def _still(part: _Part, differ: int, level: int, depth: int, sharing: int) -> float:
    """The bytes a Merkle sync of the partition still moves when ``differ`` nodes of
    ``level`` differ: the walk below (two items per differing node of each level, the
    changes spread by their hash; a message per level, shared with ``sharing`` partitions)
    and the rows under the differing leaves."""
    changes = _changes(part, differ, 1 << level)
    walk = 0.0
    for k in range(level, depth - 1):
        walk += (2 * (1 << k) * -math.expm1(-changes / (1 << k)) * ITEM_BYTES + GROUP_BYTES
                 + MESSAGE_BYTES / max(1, sharing))
    leaves = float(1 << (depth - 1))
    holding = -math.expm1(-max(1, part.rows) / leaves)
    share = min(1.0, -math.expm1(-changes / leaves) / holding)
    return walk + share * part.copy


def _counts(message: bytes, kind: int, depth: int, partition_count: int) -> dict[int, int]:
    """Items per partition of a walk message."""
    partitions = decode_message(message, kind, "stale", depth, partition_count)[1]
    found, counts = np.unique(partitions, return_counts=True)
    return dict(zip(found.tolist(), counts.tolist()))


def _attribute(plan: dict, partitions, nbytes: int) -> None:
    """Adds a message's ``nbytes`` to its partitions' shares, by their items."""
    found, counts = np.unique(np.asarray(partitions), return_counts=True)
    total = counts.sum()
    for p, n in zip(found.tolist(), counts.tolist()):
        if p in plan:
            plan[p].spent += nbytes * n / total


def _descend(client, session, stale: Party, answer: dict, plan: dict, copied: dict,
             depth: int, partition_count: int, report) -> bytes:
    """The walk, partition by partition: the roots compare with the holder's (from its
    answer to the open, no message), then each message of the stale side goes without the
    partitions a copy moves less for (``copied``: partition -> why): those whose walk would
    pass :data:`WALK_SHARE` of their copy's bytes with the next message and its answer, or
    whose Merkle sync would still move :data:`COPY_SHARE` of them, as the differing nodes
    so far tell. The leaves message that ends the walk."""
    roots = sorted(plan)
    message = stale.receive_nodes(encode_message(
        NODES, 0, roots, np.zeros(len(roots), np.int64),
        np.array([int(answer["roots"][str(p)]) for p in roots], np.int32)))
    while HEADER.unpack_from(message)[0] == NODES:
        level, mparts, nodes, hashes = decode_message(message, NODES, "holder", depth,
                                                      partition_count)
        counts = _counts(message, NODES, depth, partition_count)
        for p, items in counts.items():
            part = plan[p]
            # the message and its answer (at most twice as many items)
            nxt = 3 * (items * ITEM_BYTES + GROUP_BYTES) + 2 * MESSAGE_BYTES / len(counts)
            if items // 2 == 1 << (level - 1) >= 4 and nxt > SATURATED_SHARE * part.copy:
                copied[p] = (f"all {items // 2:,} nodes of level {level - 1} differ (a dense "
                             f"change): a copy of the ranges moves less")
            elif part.spent + nxt > WALK_SHARE * part.copy:
                copied[p] = (f"the walk would pass {WALK_SHARE:.0%} of a copy's {part.copy:,} "
                             f"bytes by level {level} of {depth}: copied as byte ranges")
            elif (_still(part, items // 2, level - 1, depth, len(counts))
                  >= COPY_SHARE * part.copy):
                copied[p] = (f"{items // 2:,} of the {1 << (level - 1):,} nodes of level "
                             f"{level - 1} differ (most entries changed): a copy of the "
                             f"ranges moves less")
        if copied:
            keep = ~np.isin(mparts, list(copied))
            if not keep.all():
                message = encode_message(NODES, level, mparts[keep], nodes[keep], hashes[keep])
                if not keep.any():
                    return encode_message(LEAVES, level, mparts[keep], nodes[keep]), False
        body = {"session": session, "message": _pack(message)}
        step = client.action(STEP, body)
        reply = _unpack(step["message"], "merkle_step answer")
        report.messages += 2
        sent, got = _json_size(body), _json_size(step)
        report.tree_bytes += sent + got
        kind = HEADER.unpack_from(reply)[0]
        mine = decode_message(message, NODES, "holder", depth, partition_count)[1]
        theirs = decode_message(reply, kind, "stale", depth, partition_count)[1]
        _attribute(plan, mine, sent)
        _attribute(plan, theirs if len(theirs) else mine, got)
        if kind == LEAVES:
            return reply, True
        message = stale.receive_nodes(reply)
    return message, False


def _local(slot, job_id, old, vertex, parts, key, depth, partition_count):
    """The stale side's old entries of ``parts`` (partition -> pieces), whether they are
    entry chunks (None: mixed, or none), and their forest (None when it could not be built
    before the holder's answer: its keys or schema unknown, or a piece it refuses)."""
    kinds: set = set()
    pieces = _old_tables(slot, job_id, old, vertex, parts, kinds)
    entries = next(iter(kinds)) if len(kinds) == 1 else None
    flat = [t for ts in pieces.values() for t in ts]
    if entries is None or (not entries and key is None) or not flat \
            or any(not t.schema.equals(flat[0].schema) for t in flat):
        return pieces, entries, None
    tables = {p: pa.concat_tables(ts) for p, ts in pieces.items()}
    try:
        return pieces, entries, _forest(tables, _key_of(entries, key), depth, partition_count)
    except (SparkjetError, pa.ArrowException):
        return pieces, entries, None        # _walk builds it again and raises, as before


def _walk(slot, job_id, client, session, answer, body, f, keyed, old, key, depth,
          partition_count, rel, where, report, built=None):
    """:func:`_merkle` once the holder opened the session (``built``: what :func:`_local`
    read and built meanwhile)."""
    report.messages += 2
    report.tree_bytes += _json_size(body) + _json_size(answer)
    entries = bool(answer["entries"])
    keys = _key_of(entries, key)
    schema = pa.ipc.read_schema(pa.py_buffer(_unb64(answer["schema"], "schema")))
    parts = sorted({c.partition for c in keyed})
    read, kind, trees = built if built is not None else (
        _old_tables(slot, job_id, old, f.vertex, set(parts)), None, None)
    old_tables, dropped = {}, False
    for p, pieces in read.items():
        same = [t for t in pieces if t.schema.equals(schema)]
        dropped |= len(same) != len(pieces)
        if same:
            old_tables[p] = pa.concat_tables(same)
    if trees is None or dropped or kind != entries:
        trees = _forest(old_tables, keys, depth, partition_count)
    stale = Party("stale", trees)
    stale.receive_hello(_unb64(answer["hello"], "holder hello"))
    plan = {p: _Part(0, int(answer["counts"][str(p)]),
                     old_tables[p].num_rows if p in old_tables else 0, 0) for p in parts}
    for c in keyed:
        plan[c.partition].copy += HEADER_SIZE + c.stored_size
        plan[c.partition].headers += HEADER_SIZE
    copied: dict[int, str] = {}         # partition -> why it goes as byte ranges
    leaves, theirs = _descend(client, session, stale, answer, plan, copied, depth,
                              partition_count, report)
    level, lparts, nodes = stale.receive_leaves(leaves)
    per = 1 << (depth - 1)
    ids = lparts * per + (nodes - (per - 1)) if level == depth - 1 and len(nodes) else \
        np.empty(0, np.int64)
    # the old entries under equal leaves are kept; the holder's other entries are fetched:
    # their number is known before they move, so is a copy's
    walked = [p for p in parts if p not in copied]
    under = {p: np.zeros(old_tables[p].num_rows if p in old_tables else 0, bool) for p in walked}
    olds = [old_tables[p] for p in walked if p in old_tables]
    if len(ids) and olds:
        old_all = pa.concat_tables(olds)
        mask = rows_under_leaves(old_all, keys, None, leaf_set(ids, depth, partition_count)) \
            .to_numpy(zero_copy_only=False)
        at = 0
        for p in walked:
            n = len(under[p])
            under[p], at = mask[at:at + n], at + n
    for p in walked:
        part = plan[p]
        fetch = part.rows - (len(under[p]) - int(under[p].sum()))
        cost = part.spent + fetch * part.row_bytes + part.headers
        if fetch > 0 and cost > LEAF_SHARE * part.copy:
            copied[p] = (f"{fetch:,} of its {part.rows:,} entries lie under differing leaves: "
                         f"with the walk, {cost:,.0f} bytes where a copy of the ranges moves "
                         f"{part.copy:,}")
    parts = [p for p in parts if p not in copied]
    keyed = [c for c in keyed if c.partition not in copied]
    for p, why in copied.items():
        report.fallback[p] = why
    if not parts:
        report.partition_bytes = {p: round(plan[p].spent) for p in plan}
        return {}, set(copied)
    ids = ids[np.isin(ids // per, parts)]
    report.differing_leaves = len(ids)
    chosen = np.isin(lparts, parts)
    body = {"session": session, "partitions": parts}
    if not theirs:      # the holder keeps the leaves it answered with: no need to send them
        body["leaves"] = _pack(encode_message(LEAVES, level, lparts[chosen], nodes[chosen]))
    info, pieces = client.get_file(ROWS, body)
    data = b"".join(p.to_pybytes() for p in pieces)
    report.messages += 2
    report.tree_bytes += _json_size(body)
    if len(info.get("headers") or []) != len(keyed):
        raise MerkleSyncError(f"{where}: the holder sent {len(info.get('headers') or [])} "
                              f"chunk headers for {len(keyed)} chunks; nothing of the file "
                              f"is kept")
    report.header_bytes = sum(len(h[0]) for h in info["headers"])
    report.row_bytes += len(data) + _json_size(info) - report.header_bytes
    fetched = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    report.rows_fetched = fetched.num_rows
    # each partition's kept rows (under equal leaves, in their order) and fetched rows (at
    # their positions) in the holder's order (_interleave); old_all: every partition's old
    # entries, for the trees' check
    olds = [old_tables[p] for p in parts if p in old_tables]
    old_all = pa.concat_tables(olds) if olds else schema.empty_table()
    keep = ~np.concatenate([under[p] for p in parts]) if old_all.num_rows else \
        np.ones(0, bool)
    groups = info.get("parts") or []
    fetched_parts = np.repeat([int(p) for p, _ in groups], [int(n) for _, n in groups]) \
        .astype(np.int32)
    if len(fetched_parts) != fetched.num_rows:
        raise MerkleSyncError(f"{where}: the holder sent {fetched.num_rows} rows but counted "
                              f"{len(fetched_parts)} by partition")
    _attribute(plan, fetched_parts, len(data) + _json_size(info) - report.header_bytes)
    by_part = np.argsort(fetched_parts, kind="stable")
    fetched_pos = fetched[POS].to_numpy().astype(np.int64)[by_part] if fetched.num_rows \
        else np.empty(0, np.int64)
    bounds = np.searchsorted(fetched_parts[by_part], parts + [np.iinfo(np.int32).max])
    fetched = fetched.drop_columns([POS]).cast(old_all.schema)
    # by partition (the holder sends them so; the sort is a no-op then)
    grouped = fetched if np.all(by_part == np.arange(len(by_part))) else \
        fetched.take(pa.array(by_part))
    rebuilt = {}
    for i, p in enumerate(parts):
        mine = old_tables.get(p, old_all.schema.empty_table())
        kept = np.flatnonzero(~under[p]) if len(under[p]) else np.empty(0, np.int64)
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        pos = fetched_pos[lo:hi]
        want = int(answer["counts"][str(p)])
        n = len(kept) + len(pos)
        free = np.ones(n, bool)
        if n == want and len(pos) and pos.min() >= 0 and pos.max() < n:
            free[pos] = False
        if n != want or np.count_nonzero(free) != len(kept):
            raise MerkleSyncError(
                f"{where}: partition {p} rebuilt with {n} entries ({len(kept)} kept, "
                f"{len(pos)} fetched), the holder has {want}: nothing of the file is "
                f"kept; copy the partition whole or from another holder")
        rebuilt[p] = _interleave(mine, kept, grouped.slice(lo, hi - lo), free)
    # the rebuilt partitions' trees: the old forest without the old rows under the
    # differing leaves (those not kept), plus the rows fetched; the rows received are what
    # is checked, at the cost of the changes rather than of the whole state
    values = [n for n in schema.names if n not in keys]
    if not keep.all():
        trees.remove(old_all.filter(pa.array(~keep)), key=list(keys), value=values)
    if fetched.num_rows:
        trees.add(fetched, key=list(keys), value=values)
    check = trees.roots
    for p in parts:
        want = int(answer["roots"][str(p)])
        if int(check[p]) != want:
            raise MerkleSyncError(
                f"{where}: partition {p} rebuilt has root hash {int(check[p])}, the holder's "
                f"is {want} (depth {depth}, {rebuilt[p].num_rows} entries): the rows fetched "
                f"or the holder's tree are damaged; nothing of the file is kept. Copy the "
                f"partition whole or from another holder")
    for c, h in zip(keyed, info["headers"]):
        plan[c.partition].spent += len(h[0])
    report.partition_bytes = {p: round(plan[p].spent) for p in plan}
    built, mismatched = _encode(keyed, info["headers"], rebuilt, entries, rel, where)
    return built, mismatched | set(copied)


#: Runs per row past which a partition is rebuilt with one take rather than by slices.
RUNS_PER_ROW = 1 / 64


def _interleave(old: pa.Table, kept: np.ndarray, fetched: pa.Table, free: np.ndarray):
    """A partition's rows in the holder's order: ``old``'s rows ``kept`` (in their order)
    at the ``free`` positions, ``fetched``'s rows (in theirs) at the others. Few changes
    leave long runs of kept rows: the result is then slices of the two tables (no row is
    copied until its chunk is encoded); many, one take over both."""
    n = len(free)
    order = np.empty(n, np.int64)
    order[free] = kept
    big = len(old) + 1          # fetched row j is big + j: no run goes from old into fetched
    order[~free] = big + np.arange(n - len(kept), dtype=np.int64)
    if not n:
        return old.slice(0, 0)
    starts = np.flatnonzero(np.r_[True, np.diff(order) != 1])
    if len(starts) > max(16, n * RUNS_PER_ROW):
        both = pa.concat_tables([old, fetched]).combine_chunks()
        return both.take(pa.array(np.where(order >= big, order - 1, order)))
    ends = np.r_[starts[1:], n]
    pieces = [old.slice(int(order[s]), int(e - s)) if order[s] < big
              else fetched.slice(int(order[s] - big), int(e - s))
              for s, e in zip(starts, ends)]
    return pa.concat_tables(pieces)


def _encode(keyed, headers, rebuilt, entries: bool, rel: str, where: str):
    """Cuts each partition's rows into the holder's chunks and encodes them; a chunk counts
    only if its payload hashes to the record's checksum."""
    jobs, at = [], {}
    for c, (head, codec, flags) in zip(keyed, headers):
        start = at.get(c.partition, 0)
        at[c.partition] = start + c.entry_count
        jobs.append((c, _unb64(head, "chunk header"), codec, flags,
                     rebuilt[c.partition].slice(start, c.entry_count)))

    # the Blosc2 levels to try, the one the last chunk matched at first: a file is written
    # by one build, so an older build's chunks are not each compressed at today's level too
    levels = list(BLOSC2_CLEVELS)

    def encode(job):
        c, head, codec, flags, rows = job
        header = ChunkHeader(codec, flags, 0, 0, 0, c.partition, c.entry_count, 0, 0, 0)
        data = (rows[ENTRY_KEY].combine_chunks(), rows["value"].combine_chunks()) if entries \
            else rows
        # (a Blosc2 chunk written by an older sparkjet has another level's bytes)
        for clevel in levels if codec == _native.CODEC_BLOSC2_LZ4 else (None,):
            chunk = b"".join([head, *encode_payload(header, data, clevel)])
            if len(chunk) == HEADER_SIZE + c.stored_size and \
                    xxhash.xxh3_64_intdigest(memoryview(chunk)[HEADER_SIZE:]) == c.checksum:
                if clevel is not None and clevel != levels[0]:
                    levels.remove(clevel)
                    levels.insert(0, clevel)
                break
        else:
            return None
        read_chunks(pa.py_buffer(chunk), f"{where}: rebuilt chunk at {c.offset}")  # header too
        return chunk

    chunks = [encode(job) for job in jobs]
    mismatched = {c.partition for (c, *_), chunk in zip(jobs, chunks) if chunk is None}
    built = {c.offset: chunk for (c, *_), chunk in zip(jobs, chunks)
             if c.partition not in mismatched}
    return built, mismatched


def _write_copy(slot: StorageSlot, job_id: int, rel: str, size: int, chunks: dict,
                fence=None) -> None:
    """The copy of ``rel`` in the slot: a sparse file of ``size`` bytes holding ``chunks``
    (offset -> bytes) and its ranges sidecar, renamed into place (as the backup stream
    writes one). ``fence()``, called before the renames, raises FencedError when the slot
    has seen a newer execution than the one resyncing."""
    backend = slot.replicas(job_id)
    final = os.path.join(backend.root, *rel.split("/"))
    # a name of its own: a backup stream (``slot_write``) may write ``final + ".part"``
    tag = f".resync-{uuidlib.uuid4().hex[:12]}.part"
    temp, side = final + tag, final + RANGES_SUFFIX
    os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
    ranges = []
    try:
        with open(temp, "wb") as out:
            out.truncate(size)
            for offset in sorted(chunks):
                data = chunks[offset]
                out.seek(offset)
                out.write(data)
                ranges.append([offset, len(data), xxhash.xxh3_64(data).hexdigest()])
            if slot.durable:
                out.flush()
                os.fsync(out.fileno())
        with open(side + tag, "w") as out:
            json.dump({"size": size, "ranges": ranges, "resynced": True}, out)
            if slot.durable:
                out.flush()
                os.fsync(out.fileno())
        if fence is not None:
            fence()         # a newer execution took the slot: it must not see this copy
        os.replace(side + tag, side)
        os.replace(temp, final)
        if slot.durable:
            backend.sync_dir(os.path.dirname(final))
    except BaseException:
        for name in (temp, side + tag):
            try:
                os.remove(name)
            except FileNotFoundError:
                pass
        raise
    held_ranges(final)          # the sidecar reads back


def resync_slot(slot: StorageSlot, job_id: int, record: meta.ValidationRecord,
                old: meta.ValidationRecord | None, clients: dict, *, keys: dict | None = None,
                depth=10, partition_count: int | None = None) -> list[ResyncReport]:
    """Resyncs every file of ``record`` whose partitions the record's table gives ``slot``
    (as primary or backup; the broadcast state of every file) and that it does
    not hold yet, each from the first of its holders in ``clients`` (slot uuid -> exchange
    client of the member holding it). ``keys``: vertex -> state key. SnapshotIncompleteError
    when no holder of a file is reachable."""
    if record.table is None:
        raise InvalidArgumentError(f"snapshot {record.snapshot_id}: no partition table in "
                                   "its record (not the members' storage)")
    table = PartitionTable.from_bytes(base64.b64decode(record.table))
    count = partition_count or table.partition_count
    mine = {p for p in range(table.partition_count) if slot.uuid in table.replicas(p)}
    folder = layout.snapshot_dir(record.snapshot_id, record.execution_id)
    out = []
    for vertex, v in record.vertices.items():
        for f in v.files:
            if f.slot == slot.uuid:
                continue
            parts = {c.partition for c in f.chunks if c.partition in mine}
            if any(c.partition < 0 for c in f.chunks):     # every slot holds broadcast state
                parts.add(-1)
            rel = f"{layout.SNAPSHOTS}/{folder}/{f.path}"
            if not parts or os.path.exists(os.path.join(slot.job_path(job_id, REPLICAS), *rel.split("/"))):
                continue
            holder = next((u for u in f.holders if u in clients and u != slot.uuid), None)
            if holder is None:
                raise SnapshotIncompleteError(
                    f"Merkle resync of slot {slot.uuid}: no holder of {rel} ({', '.join(f.holders)}) "
                    f"is reachable")
            out.append(resync_file(slot, job_id, clients[holder], holder, record, f, parts, old,
                                   key=(keys or {}).get(vertex), depth=depth,
                                   partition_count=count))
    return out


def resync_for_restore(member, slot: StorageSlot, job_id: int, record: meta.ValidationRecord,
                       wanted: dict, *, depth=10, partition_count: int = 271,
                       progress=None) -> list[ResyncReport]:
    """What a member does before it restores ``record`` (:meth:`Member._restore_handed`):
    for each vertex in ``wanted`` (vertex -> (partitions it restores, state key)), each file
    of the record holding some of those partitions of which its slot has no copy, when the
    slot keeps a copy of an older snapshot's file of that vertex (it missed the snapshots
    since: a member that was away, a slot reclaimed), resyncs those partitions (and the
    file's broadcast state) from a holder that a member of this execution holds
    (``member.topology.slots`` and ``member.peers``, as ``slot_files`` reads them); the
    restore then reads them from the slot. A resync that fails is logged and the restore
    reads those partitions from the holders, as without it. ``progress`` gets one
    ``merkle_resync`` event with the bytes synced and a full copy's."""
    old = None
    older = [s for s in slot.records(job_id) if s < record.snapshot_id]
    if older:
        try:
            old = meta.decode(slot.read_record(job_id, older[-1]), meta.ValidationRecord,
                              slot.job_path(job_id, "records", f"{older[-1]:020d}"),
                              "record copy")
        except SnapshotCorruptError as e:
            _log.warning("Merkle resync: slot %s: %s: no resync", slot.uuid, e)
    if old is None:
        return []
    members = {u: i for i, u in enumerate(member.topology.slots or []) if u != slot.uuid}
    folder = layout.snapshot_dir(record.snapshot_id, record.execution_id)
    reports = []
    for vertex, (parts, key) in wanted.items():
        if vertex not in record.vertices or vertex not in old.vertices:
            continue
        for f in record.vertices[vertex].files:
            mine = {c.partition for c in f.chunks if c.partition in parts}
            rel = f"{layout.SNAPSHOTS}/{folder}/{f.path}"
            # a copy in place (its own, a backup's, a resynced one) is read as it is; the
            # record may name this slot and it lack the file (lost since, or never kept)
            if not mine or os.path.exists(
                    os.path.join(slot.job_path(job_id, REPLICAS), *rel.split("/"))):
                continue
            if any(c.partition < 0 for c in f.chunks):
                mine.add(-1)
            groups = _by_holder(record, f, mine, members)
            if not groups:
                continue            # the restore names what no member holds
            holder = ", ".join(groups)
            if not _holds_old(slot, job_id, old, vertex, mine):
                continue            # nothing to start a walk from: the restore reads them
            try:
                began, chunks, synced = time.monotonic(), {}, []
                for u, group in groups.items():     # one copy, from as many holders
                    report, got = _resync_chunks(
                        slot, job_id, member.peers[members[u]], u, record, f, group, old,
                        key=key, depth=depth, partition_count=partition_count,
                        member=members[u])
                    synced.append(report)
                    chunks.update(got)
                _write_copy(slot, job_id, rel, f.bytes, chunks,
                            _fence(slot, job_id, getattr(member, "execution_id", None)))
                reports.append(_merged(synced, time.monotonic() - began))
            except FencedError:
                raise       # this execution is over: no restore follows
            except Exception as e:  # noqa: BLE001 (an optimization: a malformed answer, a peer gone, no memory; the restore reads from the holders)
                _log.warning("Merkle resync of %s from slot %s failed (%s: %s): the restore "
                             "reads partitions %s from the holders", rel, holder,
                             type(e).__name__, e, sorted(mine))
    if reports and progress is not None:
        progress({"event": "merkle_resync", "snapshot": record.snapshot_id,
                  "files": [r.to_dict() for r in reports],
                  "bytes": sum(r.synced_bytes for r in reports),
                  "full_copy_bytes": sum(r.full_copy_bytes for r in reports)})
    return reports


__all__ = ["MerkleHolder", "ResyncReport", "copy_file", "resolve_depth", "resync_file",
           "resync_for_restore", "resync_slot"]
