"""The members' storage (``JobConfig.storage == "members"``), as the runtime uses it.

A member task claims a storage slot on its host before it joins
(:func:`claim_slot`), and tells the driver at join what the slot holds
(:meth:`~sparkjet.snapshot.slots.StorageSlot.join_report`). Once every member has joined,
the driver places the partitions over the slots (:func:`table_for`): the last table the
slots hold, with the slots that are gone removed (their first backups promoted) and new
ones added, so that a slot reclaimed after its task died keeps its partitions; a new table
when there is none. Replicas of a partition sit on slots of distinct hosts when the
slots are on more than one host, else on distinct slots (``local[N]``: a slot lost with its
folder, or not claimed by an execution that runs fewer tasks, still has its backups).

Each processor writes its chunk files into its member's slot (a file holds its partitions'
chunks back to back, in partition order) and then sends each slot that backs one of its
partitions the byte ranges of the partitions that slot backs (every other slot gets
broadcast state whole) over a ``slot_write`` file stream (Flight ``DoPut``), and each
verifies every range's xxh3 before it answers; the receiver keeps the ranges at their
offsets in a sparse copy and names them in a ``.ranges`` sidecar, and the file's record
names the slots as its replicas (which partitions each holds follows from the record's
partition table). A restore reads each chunk from its own slot when that holds it, else
from a member whose slot holds it over a ``slot_read`` file stream (``DoGet`` of the ranges
it reads), the writer's slot first; a copy refuses a range it does not hold. Both
streams are fenced by the execution and authenticated like every call on the members'
links (:mod:`sparkjet.runtime.exchange`).

The versions of a job's reference tables (:mod:`sparkjet.operators.table_join`) are broadcast
state too: at each barrier a member keeps each version its processors use in its own slot
and in every other slot of the execution (:class:`SlotTables`: a ``slot_table`` action that
marks it used by the barrier's snapshot, and a ``slot_table`` file stream when that slot
lacks it), and also in ``snapshot_store`` when the snapshot has a durable copy. A restore
reads a version from its own slot, else a peer's, else ``snapshot_store`` (a durable copy,
or where slots written before versions were kept in them left it), each checked against
its digest; phase 2 removes from a slot the versions no retained snapshot uses
(:func:`keep_committed`).
"""
from __future__ import annotations

import base64
import binascii
import bisect
import json
import logging
import os
import shutil
import time
import uuid as uuidlib

import msgspec
import pyarrow as pa
import xxhash

from sparkjet._fs import storage_error
from sparkjet.errors import (
    InvalidArgumentError,
    PartitionTableError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
    StorageError,
    StorageSlotError,
)
from sparkjet.partition_table import PartitionTable
from sparkjet.runtime.config import JobConfig
from sparkjet.snapshot import layout
from sparkjet.snapshot.backend import open_backend
from sparkjet.snapshot.chunks import DEFAULT_CHUNK_SIZE, HEADER_SIZE
from sparkjet.snapshot.layout import content_digest
from sparkjet.snapshot.reading import partition_holders
from sparkjet.snapshot.slots import JOBS, REPLICAS, SLOT_PREFIX, StorageSlot, host_id
from sparkjet.snapshot.writer import SnapshotWriter

_log = logging.getLogger(__name__)


def claim_slot(config: JobConfig, execution: int, log: str | None = None,
               store: str | None = None) -> StorageSlot | None:
    """This member's slot, claimed on its host and fenced by ``execution`` (FencedError if
    the slot has seen a newer execution of the job: this task is a zombie); None when the
    job keeps its state in the shared store. ``log``: which log of the job's snapshot store
    the execution is in (:meth:`~sparkjet.snapshot.store.SnapshotStore.incarnation`): the
    slot's data of the job from another log (the store's folder was removed and made again)
    is of a run the store no longer knows, and is given up before the fence. ``store``: the
    snapshot store's root (:attr:`~sparkjet.snapshot.store.SnapshotStore.root`): a slot
    holding a job of the same name in another store is left to it."""
    if config.storage != "members":
        return None
    slot = StorageSlot.claim(config.storage_root(), job_id=config.id,
                             durable=config.persistence, execution=execution,
                             wait=claim_wait(config), log=log, store=store)
    try:
        if log is not None:
            slot.keep_log(config.id, log, drop_other=True, store=store)
        slot.fence(config.id, execution)
    except BaseException:
        slot.release()
        raise
    return slot


def remove_finished(config: JobConfig, log: str | None, store: str | None = None, *,
                    wait: float = 0.0) -> list[str]:
    """After a run of ``config``'s job to its end (its ``FINISHED`` mark written: it never
    runs again), removes its data from every free slot of this host's storage root, as Jet
    destroys a completed job's snapshot maps: in memory (``/dev/shm``) it would hold the
    job's last state for good. Only data of the store's log ``log``
    (:meth:`~sparkjet.snapshot.store.SnapshotStore.incarnation`) goes: a job of the same
    name in another snapshot store has the same id, and its data in a shared
    ``storage_dir`` is its own. The slots' paths it emptied; a slot that is held, of another
    host, or cannot be read is left (logged). Each job folder is renamed away under the
    slot's lock and deleted after it, so a claim is not held up by the deletion. A held
    slot is tried again until ``wait`` seconds have passed (on a cluster, a member's Python
    worker of a killed executor may hold its slot a little longer than the job ran). On a
    cluster, every executor's host runs it too
    (:func:`~sparkjet.runtime.spark_runner.remove_finished_on_hosts`)."""
    if config.storage != "members" or log is None:
        return []
    root, removed = config.storage_root(), []
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(SLOT_PREFIX))
    except FileNotFoundError:
        return []
    except OSError as e:
        _log.warning("the slots of finished job %r were not removed: %s", config.name, e)
        return []
    deadline = time.monotonic() + wait
    held = [os.path.join(root, name) for name in names]
    while True:
        held = [folder for folder in held
                if _held_or_removed(config, folder, log, store, removed)]
        if not held or time.monotonic() >= deadline:
            break
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    for folder in held:
        _log.warning("finished job %r: slot %s is held by a running task; its data of the "
                     "job stays", config.name, folder)
    return removed


def _held_or_removed(config: JobConfig, folder: str, log: str, store: str | None,
                     removed: list[str]) -> bool:
    """:func:`remove_finished` in one slot folder: True when another process holds the
    slot (try again later); else the folder's data of the finished run is removed (its
    slot's path appended to ``removed``), or it has none, or a failure is logged."""
    if not os.path.isdir(os.path.join(folder, JOBS, layout.job_dir(config.id))):
        return False
    gone = os.path.join(folder, JOBS, f".gone-{uuidlib.uuid4()}")
    try:
        slot = StorageSlot.claim_folder(folder, durable=config.persistence)
        if slot is None:
            return True
        with slot:
            if slot.host != host_id() or not _finished_here(slot, config.id, log, store):
                return False            # another host's slot, or another store's job
            try:
                os.rename(slot.job_path(config.id), gone)
            except OSError as e:
                raise storage_error("rename", slot.job_path(config.id), e) from None
        removed.append(slot.path)
        shutil.rmtree(gone, ignore_errors=True)
    except (StorageError, StorageSlotError) as e:
        _log.warning("finished job %r: its data in slot %s was not removed: %s",
                     config.name, folder, e)
    return False


def _finished_here(slot: StorageSlot, job_id: int, log: str, store: str | None) -> bool:
    """Whether ``slot``'s data of ``job_id`` is of the finished run: of its log, or (a
    persisted slot records no log: the restart judges logs) of its store."""
    recorded = slot.log_of(job_id)
    if recorded is not None:
        return recorded == log
    return store is not None and slot.store_of(job_id) == store


def claim_wait(config: JobConfig) -> float:
    """How long a member waits for a slot holding the job's data that a task of an older
    execution still locks (a zombie, declared silent after ``heartbeat_timeout``, or a task
    of the cancelled stage, killed by Spark shortly): twice the heartbeat timeout, within
    half of ``start_timeout``."""
    return min(2 * config.heartbeat_timeout, config.start_timeout / 2)


def encode_table(table: PartitionTable) -> str:
    return base64.b64encode(table.to_bytes()).decode()


def decode_table(text: str, where: str) -> PartitionTable:
    """The table in ``text`` (base64 of ``to_bytes``); StorageSlotError naming ``where``."""
    try:
        return PartitionTable.from_bytes(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError, PartitionTableError) as e:
        raise StorageSlotError(f"the partition table of {where} does not read: {e}") from None


def previous_table(reports: list[dict]) -> PartitionTable | None:
    """The newest partition table the joined slots' ``reports`` hold (None: none); a table
    that does not read is logged and left out."""
    previous = None
    for r in reports:
        if not r.get("table"):
            continue
        try:
            table = decode_table(r["table"], f"slot {r['uuid']} at {r.get('path')}")
        except StorageSlotError as e:
            _log.warning("%s; it is left out of the placement", e)
            continue
        if previous is None or table.version > previous.version:
            previous = table
    return previous


def table_for(config: JobConfig, reports: list[dict]) -> PartitionTable:
    """The partition table of an execution whose member ``i`` joined with slot report
    ``reports[i]``: built from the newest table a slot holds (slots gone removed, new
    ones added), or created. A table a slot holds that does not read is logged and left
    out; a table for another partition or backup count is replaced by a new one."""
    uuids = [r["uuid"] for r in reports]
    hosts = {r["uuid"]: r["host"] for r in reports}
    if len(set(hosts.values())) == 1:   # one host: a slot is its own group
        hosts = {u: u for u in uuids}
    if len(set(uuids)) != len(uuids):
        twice = sorted({u for u in uuids if uuids.count(u) > 1})
        raise StorageSlotError(f"two members joined with the same storage slot {twice}: a "
                               "slot is claimed by one task at a time (is storage_dir shared "
                               "by hosts that give themselves one SPARKJET_HOST_ID?)")
    previous = previous_table(reports)
    kept = {} if previous is None or previous.groups is None else previous.groups
    if (previous is None or previous.partition_count != config.partition_count
            or previous.backup_count != config.backup_count or previous.groups is None
            or any(kept[u] != hosts[u] for u in uuids if u in kept)):
        return PartitionTable.create(uuids, config.partition_count, config.backup_count,
                                     groups=hosts)
    table = previous
    for gone in [m for m in table.members if m not in hosts]:
        if len(table.members) == 1:
            # the last slot of the old table is gone: nothing to promote from
            return PartitionTable.create(uuids, config.partition_count, config.backup_count,
                                         groups=hosts)
        table = table.with_member_removed(gone)
    for new in [u for u in uuids if u not in set(table.members)]:
        table = table.with_member_added(new, hosts[new])
    return table


#: The most bytes one piece of a ``slot_write`` or ``slot_read`` file stream carries
#: (the exchange's ``FILE_PIECE``; not imported, so the driver need not load Flight).
READ_PIECE = 1 << 20
#: The slowest a file stream between members is allowed to be before its deadline (bytes
#: per second), on top of the peer's action timeout: a peer that stops reading or sending
#: fails the stream instead of holding it.
STREAM_FLOOR = 1 << 20


def _deadline(peer, size: int) -> float:
    return peer.action_timeout + size / STREAM_FLOOR


#: The sidecar of a backup's copy in a slot: ``<chunk file>.ranges``, JSON ``{"size",
#: "ranges": [[offset, length, xxh3], ...]}``, the byte ranges the copy holds (those of the
#: partitions its slot backs; the rest of the file is a hole). Written by the receiver of
#: a ``slot_write`` stream before the copy is renamed into place; a file without one is a
#: primary, and holds every byte.
RANGES_SUFFIX = ".ranges"


def held_ranges(path: str) -> tuple[int, list[tuple[int, int]]] | None:
    """The size and the merged ``(start, end)`` byte ranges that the copy at ``path`` (a
    file in a slot) holds, from its sidecar; None when it has none (it holds every byte).
    SnapshotCorruptError naming the sidecar when it does not read."""
    where = path + RANGES_SUFFIX
    try:
        with open(where, "rb") as f:
            doc = json.loads(f.read())
        size, ranges = doc["size"], doc["ranges"]
        if not (type(size) is int and size >= 0 and isinstance(ranges, list)):
            raise ValueError("size and ranges wanted")
        merged: list[tuple[int, int]] = []
        for r in ranges:
            start, length = r[0], r[1]
            if not (type(start) is int and type(length) is int and length > 0
                    and start >= (merged[-1][1] if merged else 0) and start + length <= size):
                raise ValueError(f"range {r!r} is out of order or outside {size} bytes")
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], start + length)
            else:
                merged.append((start, start + length))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise SnapshotCorruptError(where, 0, "ranges sidecar", str(e)) from None
    return size, merged


def resynced_copy(slot: StorageSlot, job_id: int, path: str) -> bool:
    """Whether the slot holds a copy of ``path`` that a Merkle resync wrote
    (:mod:`sparkjet.runtime.resync`: its ranges sidecar says ``"resynced"``): a replica of
    the snapshot that the record does not name, which a restore reads before the holders'
    (each chunk is checked against the record as any copy's)."""
    if ".." in path.split("/"):
        return False
    where = os.path.join(slot.job_path(job_id, REPLICAS), *path.split("/")) + RANGES_SUFFIX
    try:
        with open(where, "rb") as f:
            return json.loads(f.read()).get("resynced") is True
    except (OSError, ValueError, AttributeError):
        return False


class LocalSlotFile:
    """A chunk file in this member's own slot: the writer's whole file, or a backup's copy
    holding the byte ranges of the partitions its slot backs (:func:`held_ranges`), whose
    reader refuses any other range (a hole reads as zeros: never handed on)."""

    def __init__(self, slot: StorageSlot, job_id: int, path: str):
        self._backend = slot.replicas(job_id)
        self._name = _checked(path)
        self.slot = slot.uuid
        self._where = f"slot {slot.uuid}: {path}"
        self._path = self._backend.path(*path.split("/"))
        self.held = held_ranges(os.path.join(self._backend.root, *path.split("/")))

    def size(self) -> int:
        size = self._backend.size(self._path)
        if self.held is not None and self.held[0] != size:
            raise SnapshotCorruptError(self._where, 0, "file size",
                                       f"{size} bytes, its ranges sidecar says {self.held[0]}")
        return size

    def holds(self, offset: int, length: int) -> bool:
        """Whether this copy holds bytes ``offset`` to ``offset + length``."""
        if self.held is None or length == 0:
            return True
        i = bisect.bisect_right([s for s, _ in self.held[1]], offset) - 1
        return i >= 0 and offset + length <= self.held[1][i][1]

    def check_held(self, offset: int, length: int) -> None:
        """SnapshotIncompleteError unless this copy holds bytes ``offset`` to ``offset +
        length``."""
        if not self.holds(offset, length):
            held = ", ".join(f"{s}..{e}" for s, e in self.held[1]) or "none"
            raise SnapshotIncompleteError(
                f"{self._where}: this copy holds bytes {held} (a backup holds the ranges "
                f"of the partitions its slot backs), not {offset}..{offset + length}")

    def range_reader(self):
        read = self._backend.range_reader(self._path)
        if self.held is None:
            return read

        def checked(offset: int, length: int):
            self.check_held(offset, length)
            return read(offset, length)
        return checked


class PeerSlotFile:
    """A chunk file in a peer's slot, read over the exchange: a ``slot_read`` file stream
    (Flight ``DoGet``) of the range asked for, fenced by the execution and authenticated
    like every call on the members' links."""

    def __init__(self, client, slot: str, path: str, member: int):
        self._client, self._slot, self._path, self._member = client, slot, path, member
        self.slot = slot

    def _get(self, offset: int, length: int):
        return self._client.get_file(
            "slot_read", {"slot": self._slot, "path": self._path, "offset": offset,
                          "length": length}, timeout=_deadline(self._client, length))

    def size(self) -> int:
        return int(self._get(0, 0)[0]["size"])

    def range_reader(self):
        def read(offset: int, length: int):
            _, pieces = self._get(offset, length)
            got = []
            n = 0
            for piece in pieces:
                n += piece.size
                if n > length:
                    break
                got.append(piece)
            if n != length:
                raise SnapshotIncompleteError(
                    f"slot {self._slot} of member {self._member}: the stream of "
                    f"{self._path} from byte {offset} carried {n} bytes, {length} wanted")
            if len(got) == 1:
                return got[0]
            # (pyarrow's pool: memory it has had before, not zeroed first as a bytearray's)
            out = pa.allocate_buffer(length)
            view, at = memoryview(out).cast("B"), 0
            for piece in got:
                view[at:at + piece.size] = memoryview(piece).cast("B")
                at += piece.size
            return out
        read.ahead = True   # fetched ahead of the restore's decoding (snapshot.reading)
        return read


def slot_files(member, slot: StorageSlot, job_id: int):
    """The store's ``slot_files`` resolver of a member: a file from its own slot's copy
    from disk (one it holds, or one a Merkle resync brought up to date: :func:`resynced_copy`),
    else from the first slot holding one that a member of this execution holds,
    over the exchange; SnapshotIncompleteError naming every slot when none is held."""
    members = {uuid: i for i, uuid in enumerate(member.topology.slots or [])}

    def resolve(uuids: list[str], path: str):
        if slot.uuid in uuids or resynced_copy(slot, job_id, path):
            return LocalSlotFile(slot, job_id, path)
        for uuid in uuids:
            i = members.get(uuid)
            if i is not None:
                return PeerSlotFile(member.peers[i], uuid, path, i)
        raise SnapshotIncompleteError(
            f"the snapshot's chunk file {path} is in storage slot(s) {', '.join(uuids)}, none "
            f"of which a member of this execution holds (their hosts lost them, or run no "
            f"task of this execution): its state cannot be restored. Run the job where those "
            f"slots are, with more backups (backup_count), or start it again from an export "
            f"of a job with storage=\"shared\"")
    return resolve


def check_reachable(store, snapshot_id: int, member) -> None:
    """Counts every (vertex, partition) of a snapshot in the members' storage against the
    slots this execution holds before anything is restored (a partition's chunks of a file
    are held by the slot that wrote it and the backups of that partition in the record's
    table: :func:`~sparkjet.snapshot.reading.partition_holders`): SnapshotIncompleteError
    naming every vertex and partition no reachable copy has, the slots that held them and their
    hosts (from the record's partition table), and what to do. A file with a durable copy
    is always reachable."""
    stored = store._resolve(snapshot_id, None)
    lost = unreachable(stored, set(member.topology.slots or []))
    if not lost:
        return
    pending = ""
    if getattr(getattr(member, "config", None), "durable_tier", None) == "async":
        pending = (f" With durable_tier=\"async\" the durable copy of snapshot {snapshot_id} "
                   f"was not complete (its upload had not ended, or failed): it does not "
                   f"count, and an older snapshot is never restored in its place under "
                   f"exactly-once.")
    raise SnapshotIncompleteError(
        f"snapshot {snapshot_id}: no slot of this execution holds a copy of "
        f"{describe_unreachable(stored, lost)}.{pending} Run the job where those slots are, "
        f"with more backups (backup_count) or durable_tier=\"sync\", or start it again from "
        f"an export")


def unreachable(stored, held: set[str]) -> tuple[dict[str, set[int]], set[str]] | None:
    """What of a checked record (format 2) no slot of ``held`` holds and no durable copy
    has: (vertex -> partitions, -1 for broadcast state; the slots that held them), or
    None when every partition is reachable."""
    if stored.record.format != 2:
        return None
    holders = partition_holders(stored)
    lost: dict[str, set[int]] = {}
    gone: set[str] = set()
    for vertex, v in stored.record.vertices.items():
        for f in v.files:
            if f.in_store:
                continue
            for p in {c.partition for c in f.chunks}:
                where = holders(f, p)
                if not held.intersection(where):
                    lost.setdefault(vertex, set()).add(p)
                    gone.update(where)
    return (lost, gone) if lost else None


def describe_unreachable(stored, lost: tuple[dict[str, set[int]], set[str]]) -> str:
    """:func:`unreachable`'s answer in words: vertices, partitions (as ranges), the slots
    and their hosts (from the record's partition table)."""
    parts_of, gone = lost
    hosts: dict[str, str] = {}
    if stored.record.table:
        try:
            hosts = decode_table(stored.record.table, "the snapshot's record").groups or {}
        except StorageSlotError:
            hosts = {}
    where = "; ".join(
        f"{vertex}: {'broadcast state' if parts == {-1} else 'partitions ' + partition_ranges(parts)}"
        for vertex, parts in sorted(parts_of.items()))
    slots = ", ".join(f"{u} (host {hosts[u]})" if u in hosts and hosts[u] != u else u
                      for u in sorted(gone))
    return (f"{where}; they were in slot(s) {slots}, which no member of this execution holds "
            f"(their hosts lost them, or run no task of this execution)")


def partition_ranges(parts: set[int]) -> str:
    """Partitions as ranges: ``0-3, 7, 9-10``, then `` and broadcast state`` when -1 is
    among them (``broadcast state`` alone when it is the only one)."""
    ps = sorted(p for p in parts if p >= 0)
    out, i = [], 0
    while i < len(ps):
        j = i
        while j + 1 < len(ps) and ps[j + 1] == ps[j] + 1:
            j += 1
        out.append(str(ps[i]) if i == j else f"{ps[i]}-{ps[j]}")
        i = j + 1
    if -1 not in parts:
        return ", ".join(out)
    return " and ".join(([", ".join(out)] if out else []) + ["broadcast state"])


def backup_ranges(table: PartitionTable | None, slots: list[str], own: str,
                  chunks) -> dict[str, list[tuple[int, int]]]:
    """Per backup slot, the merged ``(start, end)`` byte ranges of a chunk file it backs:
    each chunk (``[offset, stored size, checksum, entries, partition]``, as the record lists
    them) goes to the slots of ``table.replicas(partition)`` (its backups, ``[1:]``, when the
    writer's slot ``own`` is its primary, as a processor's are), a broadcast chunk
    (partition -1) to every slot of ``slots``; ``own`` holds the whole file already."""
    out: dict[str, list[tuple[int, int]]] = {}
    if table is None or len(slots) < 2:
        return out
    for c in chunks:
        start, end, p = c[0], c[0] + HEADER_SIZE + c[1], c[4]
        backs = slots if p < 0 else [u for u in table.replicas(p) if u is not None]
        for u in backs:
            if u == own:
                continue
            ranges = out.setdefault(u, [])
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
    return out


def replicator(member, slot: StorageSlot, job_id: int):
    """What a member's snapshot writers call on each chunk file they wrote into ``slot``
    (:class:`~sparkjet.snapshot.writer.SnapshotWriter`'s ``replicate``, with the file's
    chunks as the record lists them): sends each slot of this execution that backs one of
    its partitions the byte ranges of the partitions it backs (:func:`backup_ranges`;
    broadcast state, partition -1, to every other slot) and returns those slots once each
    has verified its ranges.

    One ``slot_write`` file stream (Flight ``DoPut``, fenced by the execution) goes to each
    backup slot's member, its body naming the file's size and the ranges it carries; the
    file is read once, piece by piece, each piece written to the streams whose ranges hold
    it, and each trailer carries the ranges with their xxh3, which each receiver checks
    before it answers."""
    table = member.topology.table
    slots = member.topology.slots or []
    index = {uuid: i for i, uuid in enumerate(slots)}

    def replicate(path: str, chunks) -> list[str]:
        wanted = backup_ranges(table, slots, slot.uuid, chunks)
        if not wanted:
            return []
        file = LocalSlotFile(slot, job_id, path)
        size = file.size()
        read = file.range_reader()
        order = sorted(wanted, key=lambda u: index[u])
        starts = {u: [s for s, _ in wanted[u]] for u in order}
        digests = {(u, s): xxhash.xxh3_64() for u in order for s, _ in wanted[u]}
        cuts = sorted({b for u in order for r in wanted[u] for b in r})
        streams = {}
        try:
            for uuid in order:
                peer = member.peers[index[uuid]]
                streams[uuid] = peer.put_file(
                    "slot_write", {"slot": uuid, "path": path, "size": size,
                                   "ranges": [[s, e - s] for s, e in wanted[uuid]]},
                    timeout=_deadline(peer, size))
            for lo, hi in zip(cuts, cuts[1:]):
                into = []           # (stream, range start) of each slot whose ranges hold lo
                for uuid in order:
                    i = bisect.bisect_right(starts[uuid], lo) - 1
                    if i >= 0 and lo < wanted[uuid][i][1]:
                        into.append((uuid, starts[uuid][i]))
                for offset in range(lo, hi, READ_PIECE) if into else ():
                    piece = read(offset, min(READ_PIECE, hi - offset))
                    for uuid, start in into:
                        digests[(uuid, start)].update(piece)
                        streams[uuid].write(piece)
            for uuid in order:
                streams[uuid].finish({"size": size, "ranges": [
                    [s, e - s, digests[(uuid, s)].hexdigest()] for s, e in wanted[uuid]]})
        except BaseException:
            for stream in streams.values():
                stream.abort()
            raise
        return order
    return replicate


def _declared_ranges(body: dict, path: str) -> tuple[int, list[tuple[int, int]]]:
    """The size and ``(start, end)`` ranges a ``slot_write`` body declares:
    InvalidArgumentError for a range outside the size, empty, overlapping another or out of
    order."""
    size, ranges = body.get("size"), body.get("ranges")
    if type(size) is not int or size < 0 or not isinstance(ranges, list) or not ranges:
        raise InvalidArgumentError(f"slot_write of {path}: size {size!r} and ranges "
                                   f"{ranges!r} are not a file's size and its byte ranges")
    out: list[tuple[int, int]] = []
    for r in ranges:
        if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
                and r[0] >= 0 and r[1] > 0):
            raise InvalidArgumentError(f"slot_write of {path}: {r!r} is not a byte range "
                                       "[offset, length]")
        start, end = r[0], r[0] + r[1]
        if end > size:
            raise InvalidArgumentError(f"slot_write of {path}: range {start}..{end} is "
                                       f"outside the file's {size} bytes")
        if out and start < out[-1][1]:
            raise InvalidArgumentError(f"slot_write of {path}: range {start}..{end} overlaps "
                                       f"or precedes {out[-1][0]}..{out[-1][1]}")
        out.append((start, end))
    return size, out


def slot_write_handler(slot: StorageSlot, job_id: int):
    """The ``slot_write`` file stream of a member's exchange server (``on_put``): a peer's
    copy of byte ranges of one of its chunk files into this member's slot, body ``{slot,
    path, size, ranges}`` (``ranges``: the ``[offset, length]`` of the partitions this slot
    backs, in order). Each range's pieces are written at its own offset into a sparse
    temporary file of the file's size (a hole costs nothing), hashed as they are written;
    the copy is renamed into place only when the stream's trailer (``{size, ranges:
    [[offset, length, xxh3], ...]}``) has every range read as sent, after its ranges
    sidecar (:func:`held_ranges`); else both are removed and the stream refused (a range
    outside the file, overlapping another, a short stream, one cut before its trailer, a
    corrupted piece)."""
    def handle(body: dict, stream) -> dict:
        backend = slot.replicas(job_id)     # the slot held now (rebalance_delay: reclaimed)
        if body.get("slot") != slot.uuid:
            raise InvalidArgumentError(f"this member holds slot {slot.uuid}, not "
                                       f"{body.get('slot')!r}")
        path = _checked(str(body.get("path")))
        size, ranges = _declared_ranges(body, path)
        final = os.path.join(backend.root, *path.split("/"))
        temp, side = final + ".part", final + RANGES_SUFFIX
        os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
        digests = [xxhash.xxh3_64() for _ in ranges]
        length, i, at, sidecar = 0, 0, ranges[0][0], False
        try:
            with open(temp, "wb") as f:
                f.truncate(size)
                f.seek(at)
                for piece in stream:
                    view, length = memoryview(piece).cast("B"), length + piece.size
                    while view.nbytes:
                        if i == len(ranges):
                            raise SnapshotIncompleteError(
                                f"slot {slot.uuid}: the copy of {path} carries more than "
                                f"the {sum(e - s for s, e in ranges)} bytes of its ranges")
                        n = min(view.nbytes, ranges[i][1] - at)
                        digests[i].update(view[:n])
                        f.write(view[:n])
                        view, at = view[n:], at + n
                        if at == ranges[i][1]:
                            i += 1
                            if i < len(ranges):
                                at = ranges[i][0]
                                f.seek(at)
                trailer = stream.trailer
                if trailer is None:
                    raise SnapshotIncompleteError(
                        f"slot {slot.uuid}: the copy of {path} ended after {length} bytes "
                        f"without the writer's size and checksums (the writer stopped)")
                got = [[s, e - s, d.hexdigest()] for (s, e), d in zip(ranges, digests)]
                if i != len(ranges) or trailer.get("size") != size or (
                        trailer.get("ranges") != got):
                    raise SnapshotIncompleteError(
                        f"slot {slot.uuid}: the copy of {path} has {length} bytes in ranges "
                        f"(offset, length, xxh3) {got}, the writer's has "
                        f"{trailer.get('ranges')} of a file of {trailer.get('size')} bytes")
                if slot.durable:
                    f.flush()
                    os.fsync(f.fileno())
            with open(side + ".part", "w") as f:
                json.dump({"size": size, "ranges": got}, f)
                if slot.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(side + ".part", side)
            sidecar = True
            os.replace(temp, final)
            if slot.durable:    # the renames made durable before the copy is called verified
                backend.sync_dir(os.path.dirname(final))
        except BaseException:
            # a copy whose sidecar is not its own would hand on another's ranges: both go
            for name in (temp, side + ".part", *((side, final) if sidecar else ())):
                try:
                    os.remove(name)
                except FileNotFoundError:
                    pass
            raise
        return {"verified": got, "bytes": length}
    return handle


def slot_read_handler(slot: StorageSlot, job_id: int):
    """The ``slot_read`` file stream of a member's exchange server (``on_get``): body
    ``{slot, path, offset, length}``; answers ``{size}`` (the file's) and the range's
    bytes in pieces, read from the slot's memory map (not copied)."""
    def handle(body: dict):
        if body.get("slot") != slot.uuid:
            raise InvalidArgumentError(f"this member holds slot {slot.uuid}, not "
                                       f"{body.get('slot')!r}")
        offset, length = body.get("offset"), body.get("length")
        file = LocalSlotFile(slot, job_id, str(body.get("path")))
        size = file.size()
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0
                and offset + length <= size):
            raise InvalidArgumentError(f"slot_read: bad range {offset!r}+{length!r} of "
                                       f"{body.get('path')} ({size} bytes)")
        file.check_held(offset, length)     # refused before any piece goes
        read = file.range_reader() if length else None

        def pieces():
            for at in range(offset, offset + length, READ_PIECE):
                yield read(at, min(READ_PIECE, offset + length - at))
        return {"size": size}, pieces()
    return handle


def _checked(path: str) -> str:
    """A chunk file's path in a slot: ``snapshots/<dir>/<vertex>/<file>``, nothing else."""
    parts = path.split("/")
    if (len(parts) != 4 or parts[0] != layout.SNAPSHOTS
            or any(p in ("", ".", "..") or os.sep in p for p in parts)):
        raise InvalidArgumentError(f"not a chunk file's path in a slot: {path!r}")
    return path


class SlotWriterLink:
    """What a snapshot writer of the members' storage asks of its store
    (:class:`~sparkjet.snapshot.writer.StoreLink`), without the store: each write fenced by
    the slot's FENCE (the newest execution it has seen) rather than the store's log, names
    from the store's layout, and, with ``durable_tier="sync"``, the backend of
    ``snapshot_store`` into which the writer copies each file (the one write a member
    makes there; it needs no log). Only the driver commits."""

    def __init__(self, config: JobConfig, slot: StorageSlot):
        self.job_id = config.id
        self.slot = slot
        # the durable tier's copies, or those of a stop exporting its terminal snapshot
        self._durable_uri = config.snapshot_store
        self._store_backend = None

    @property
    def _backend(self):
        """The backend of ``snapshot_store``, opened on the first durable copy."""
        if self._durable_uri is None:
            raise InvalidArgumentError("a member of the members' storage writes durable "
                                       "copies into snapshot_store: the job has none")
        if self._store_backend is None:
            self._store_backend = open_backend(self._durable_uri)
        return self._store_backend

    def _path(self, *parts: str) -> str:
        return self._backend.path(layout.job_dir(self.job_id), *parts)

    def _snapshot_dir(self, snapshot_id: int, execution_id: int) -> str:
        return layout.snapshot_dir(snapshot_id, execution_id)

    def _table_path(self, digest: str) -> str:
        if not layout.is_table_digest(digest):
            raise InvalidArgumentError(f"a table version is 32 hex digits, got {digest!r}")
        return "/".join((layout.job_dir(self.job_id), layout.TABLES, layout.table_file(digest)))

    def check_fence(self, execution_id: int) -> None:
        self.slot.check_fence(self.job_id, execution_id)

    def commit(self, snapshot_id: int, execution_id: int, manifests) -> None:
        raise InvalidArgumentError("with the members' storage only the driver commits "
                                   "snapshots")


def slot_writer(config: JobConfig, link: SlotWriterLink, snapshot_id: int, execution_id: int,
                *, writer: int, replicate, durable: bool | None = None) -> SnapshotWriter:
    """The writer of processor ``writer`` of a member of the members' storage: chunk files
    into its slot (copied to their backups by ``replicate``, and into snapshot_store when
    ``durable``: default with ``durable_tier="sync"``), fenced by the slot."""
    link.check_fence(execution_id)
    if durable is None:
        durable = config.durable_tier == "sync"
    return SnapshotWriter(link, snapshot_id, execution_id, writer, config.partition_count,
                          DEFAULT_CHUNK_SIZE, config.snapshot_codec, link.slot, replicate,
                          durable)


def keep_committed(slot: StorageSlot, job_id: int, snapshot_id: int, execution: int,
                   record: bytes, keep, uploading=(), kept_tables=None) -> None:
    """Phase 2 in a member's slot: a copy of the committed snapshot's record (refused,
    FencedError, if the slot has seen a newer execution than the one that committed it),
    then the record copies and chunk files of the snapshots the store no longer keeps
    (``keep``: the retained snapshot ids, with ``durable_tier="async"`` the pinned and the
    newest marked ones too) removed, except those of ``uploading`` (the member's uploads
    under way or waiting, :attr:`~sparkjet.runtime.durable.DurableUploader.pending`), and
    the table versions none of those kept uses (:func:`drop_table_versions`; ``kept_tables``:
    the digests the driver says the store's retained snapshots use)."""
    slot.write_record(job_id, snapshot_id, record, execution=execution)
    keep = set(keep) | set(uploading) | {snapshot_id}
    try:
        slot.drop_records_before(job_id, snapshot_id, keep=keep)
        drop_old_snapshots(slot, job_id, snapshot_id, keep)
        drop_table_versions(slot, job_id, snapshot_id, keep, kept_tables)
    except OSError as e:
        # housekeeping of a committed snapshot: what is left is dropped at the next commit,
        # and is no reason to fail (and restart) the execution
        _log.warning("%s: could not drop snapshots older than %d: %s", slot, snapshot_id, e)


class DriverStoreFiles:
    """The files of ``snapshot_store`` that a member of the members' storage reads (the
    durable copies of a snapshot, or an export it starts from), read for it by the driver
    (the ``store_read`` action of its coordinator): a member never opens the store. The
    read side of a :class:`~sparkjet.snapshot.backend.StorageBackend`, for a
    :class:`~sparkjet.snapshot.store.RecordView`."""

    root = "snapshot_store (read by the driver)"
    durable = True

    def __init__(self, client):
        self._client = client

    def _call(self, body: dict) -> dict:
        return self._client.action("store_read", body)

    def path(self, *parts: str) -> str:
        return "/".join(parts)

    def listdir(self, path: str) -> list[str]:
        return list(self._call({"op": "list", "path": path})["names"])

    def size(self, path: str) -> int:
        return int(self._call({"op": "size", "path": path})["size"])

    def range_reader(self, path: str):
        def read(offset: int, length: int) -> bytes:
            pieces = []
            while length > 0:
                n = min(length, READ_PIECE)
                data = base64.b64decode(self._call({"op": "read", "path": path,
                                                    "offset": offset, "length": n})["data"])
                if len(data) != n:
                    raise SnapshotIncompleteError(
                        f"snapshot_store: {path} ended at byte {offset + len(data)}, "
                        f"{offset + n} wanted")
                pieces.append(data)
                offset, length = offset + n, length - n
            return b"".join(pieces)
        return read


def store_read_handler(store, directory):
    """The driver's ``store_read`` action (members' storage): ``{op: list|size|read, path,
    offset, length}`` on the files of ``store`` under ``directory`` (the folder of the
    snapshot or export the execution starts from) and its table versions
    (``tables/DIGEST.arrow``), and nothing else; what :class:`DriverStoreFiles` calls."""
    prefix = [layout.job_dir(store.job_id), *directory]
    backend = store._backend

    def handle(body: dict) -> dict:
        path = str(body.get("path"))
        parts = path.split("/")
        table = (len(parts) == 3 and parts[:2] == [prefix[0], layout.TABLES]
                 and parts[2].endswith(".arrow") and layout.is_table_digest(parts[2][:-6]))
        if not table and (parts[:len(prefix)] != prefix or len(parts) > len(prefix) + 2
                          or any(p in ("", ".", "..") or os.sep in p for p in parts)):
            raise InvalidArgumentError(f"store_read: {path!r} is not a file of the snapshot "
                                       f"this execution starts from")
        real = backend.path(*parts)
        op = body.get("op")
        if op == "list":
            return {"names": backend.listdir(real)}
        if op == "size":
            return {"size": backend.size(real)}
        offset, length = body.get("offset"), body.get("length")
        if op != "read" or not (isinstance(offset, int) and isinstance(length, int)
                                and offset >= 0 and 0 <= length <= READ_PIECE):
            raise InvalidArgumentError(f"store_read: bad request {op!r} {offset!r}+{length!r}")
        data = backend.range_reader(real)(offset, length) if length else b""
        return {"data": base64.b64encode(bytes(data)).decode()}
    return handle


class _RecordTables(msgspec.Struct):
    """The one field of a validation record that phase 2 reads: its table versions."""

    tables: list[str] = msgspec.field(default_factory=list)


def record_tables(record: bytes) -> list[str]:
    """The table versions a validation record's bytes name (none when they do not read)."""
    try:
        return msgspec.json.decode(record, type=_RecordTables).tables
    except msgspec.DecodeError:
        return []


def drop_table_versions(slot: StorageSlot, job_id: int, committed: int, keep,
                        kept_tables=None) -> list[str]:
    """The store's rule for its table versions (:meth:`SnapshotStore._remove_table_versions`)
    in a slot at phase 2 of snapshot ``committed``: removes the versions that no retained
    snapshot (``keep``: their ids) uses, except those a barrier after ``committed`` stored
    (its snapshot is not committed yet). Which versions the retained snapshots use: the
    driver's word (``kept_tables``, the digests it read from the store's records of them),
    with those of the record copies the slot holds; without the driver's word, nothing is
    removed while a retained snapshot's record copy is missing or does not read (review F5:
    a slot added after the older snapshots kept every version for good). Exports are in
    ``snapshot_store``, with their versions: a slot keeps none for them. Returns the
    digests removed."""
    used: set[str] = set(kept_tables or ())
    held = set(slot.records(job_id))
    for sid in keep:
        if sid not in held:
            if kept_tables is None:
                return []
            continue
        try:
            used.update(msgspec.json.decode(slot.read_record(job_id, sid),
                                            type=_RecordTables).tables)
        except (msgspec.DecodeError, StorageSlotError):
            if kept_tables is None:
                return []
    return slot.drop_table_versions(job_id, used, committed)


#: The most bytes a ``slot_table`` file stream's piece carries.
TABLE_PIECE = READ_PIECE


class SlotTables:
    """Where a member of the members' storage keeps the reference table versions its
    processors use (:class:`~sparkjet.operators.table_join.TableVersions`' ``store``): its
    own slot and every other slot of the execution (broadcast state), never
    ``snapshot_store`` except for a durable copy (``durable_tier``, or a stop exporting
    its terminal snapshot).

    :meth:`write_table_version` at each barrier (once per version and snapshot): the
    version into the member's slot, then to each peer's slot a ``slot_table`` action
    (``{slot, digest, snapshot}``: marks it used by that snapshot, answers whether the
    slot holds it) and, when it does not, a ``slot_table`` file stream of its bytes, which
    the peer checks against the digest before it keeps them. :meth:`read_table_version` at
    restore: the member's slot, else each peer's (a ``slot_table`` file stream), else
    ``snapshot_store`` (through the driver), checked against the digest; a version read
    elsewhere is kept in the member's slot too."""

    def __init__(self, member, slot: StorageSlot, job_id: int):
        self.member = member
        self.slot = slot
        self.job_id = job_id
        self._done: dict[str, int | None] = {}    # digest -> the snapshot it was kept for

    def _peers(self):
        """(slot uuid, client) of every other member of the execution."""
        slots = self.member.topology.slots or []
        return [(uuid, self.member.peers[i]) for i, uuid in enumerate(slots)
                if uuid != self.slot.uuid and i in self.member.peers]

    def _durable(self) -> bool:
        config = self.member.config
        return config.durable_tier != "none" or bool(getattr(self.member, "durable_copies",
                                                             False))

    def write_table_version(self, data, digest: str, snapshot_id: int | None = None) -> None:
        if content_digest(data) != digest:
            raise InvalidArgumentError(f"table version {digest}: the bytes have another digest")
        if digest in self._done and self._done[digest] == snapshot_id:
            return          # another processor of this member kept it for this snapshot
        sid = -1 if snapshot_id is None else snapshot_id
        self.slot.write_table_version(self.job_id, digest, data, sid)
        for uuid, peer in self._peers():
            body = {"slot": uuid, "digest": digest, "snapshot": sid}
            if peer.action("slot_table", body)["held"]:
                continue
            size = len(data)
            stream = peer.put_file("slot_table", {**body, "size": size},
                                   timeout=_deadline(peer, size))
            try:
                view = memoryview(data)
                for at in range(0, size, TABLE_PIECE):
                    stream.write(view[at:at + TABLE_PIECE])
                stream.finish({"size": size, "digest": digest})
            except BaseException:
                stream.abort()
                raise
        if self._durable():
            backend = self.member.slot_link._backend     # the durable copies' store
            folder = backend.path(layout.job_dir(self.job_id), layout.TABLES)
            path = backend.path(layout.job_dir(self.job_id), layout.TABLES,
                                layout.table_file(digest))
            if not backend.exists(path):
                backend.makedirs(folder)
                backend.create_exclusive(path, bytes(data))
        self._done[digest] = snapshot_id

    def read_table_version(self, digest: str):
        tried = []
        try:
            data = self.slot.read_table_version(self.job_id, digest)
            if data is not None:
                return data
            tried.append(f"slot {self.slot.uuid} (this member's): not held")
        except SnapshotCorruptError as e:
            tried.append(f"slot {self.slot.uuid} (this member's): {e}")
            _log.warning("%s: %s: removed, read from elsewhere", self.slot, e)
            self.slot.remove_table_version(self.job_id, digest)
        for uuid, peer in self._peers():
            try:
                _, pieces = peer.get_file("slot_table", {"slot": uuid, "digest": digest},
                                          timeout=peer.action_timeout)
                data = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
            except Exception as e:  # noqa: BLE001 - the next place is tried, each one named
                tried.append(f"slot {uuid}: {type(e).__name__}: {e}")
                continue
            if content_digest(data) == digest:
                return self._keep(digest, data)
            tried.append(f"slot {uuid}: its bytes have another digest")
        start = self.member.start or {}
        job = int(start.get("job", self.job_id))
        path = "/".join((layout.job_dir(job), layout.TABLES, layout.table_file(digest)))
        try:
            if self.member.link is not None:
                files = DriverStoreFiles(self.member.link.client)
            else:
                files = open_backend(self.member.config.snapshot_store)
                path = files.path(*path.split("/"))
            size = files.size(path)
            data = bytes(files.range_reader(path)(0, size)) if size else b""
        except Exception as e:  # noqa: BLE001 - named in the error below
            tried.append(f"snapshot_store {path}: {type(e).__name__}: {e}")
        else:
            if content_digest(data) == digest:
                return self._keep(digest, data)
            tried.append(f"snapshot_store {path}: its bytes have another digest")
        raise SnapshotIncompleteError(
            f"table version {digest}, which the snapshot records, is in no slot of this "
            f"execution nor in snapshot_store ({'; '.join(tried)}): the table join's state "
            f"cannot be restored. Run the job where those slots are, or start it again from "
            f"an export")

    def _keep(self, digest: str, data: bytes) -> bytes:
        try:
            self.slot.write_table_version(self.job_id, digest, data)
        except (OSError, StorageSlotError) as e:   # a cache: the restore goes on
            _log.warning("%s: could not keep table version %s: %s", self.slot, digest, e)
        return data


def slot_table_handlers(slot: StorageSlot, job_id: int):
    """The ``slot_table`` action, file stream in (``on_put``) and out (``on_get``) of a
    member's exchange server: what :class:`SlotTables` of its peers call. The action
    ``{slot, digest, snapshot}`` marks the version used by that snapshot and answers
    ``{held}``; the stream in ``{slot, digest, snapshot, size}`` keeps the bytes once they
    match the digest and the writer's trailer (``{size, digest}``); the stream out
    ``{slot, digest}`` sends the version's bytes (refused when the slot does not hold
    it)."""
    def check(body: dict) -> str:
        if body.get("slot") != slot.uuid:
            raise InvalidArgumentError(f"this member holds slot {slot.uuid}, not "
                                       f"{body.get('slot')!r}")
        digest = body.get("digest")
        if not layout.is_table_digest(digest):
            raise InvalidArgumentError(f"slot_table: {digest!r} is not a table version")
        return digest

    def snapshot_of(body: dict) -> int:
        sid = body.get("snapshot")
        if type(sid) is not int:
            raise InvalidArgumentError(f"slot_table: snapshot {sid!r} is not an id")
        return sid

    def keep(body: dict) -> dict:
        digest = check(body)
        return {"held": slot.keep_table_version(job_id, digest, snapshot_of(body))}

    def put(body: dict, stream) -> dict:
        digest = check(body)
        sid = snapshot_of(body)
        size = body.get("size")
        data = bytearray()
        for piece in stream:
            data += memoryview(piece).cast("B")
            if type(size) is int and len(data) > size:
                break
        trailer = stream.trailer
        if trailer is None or trailer.get("size") != size or len(data) != size or \
                trailer.get("digest") != digest or content_digest(data) != digest:
            raise SnapshotIncompleteError(
                f"slot {slot.uuid}: the copy of table version {digest} has {len(data)} bytes "
                f"of digest {content_digest(data)}, the writer's "
                f"{None if trailer is None else trailer.get('size')} bytes of "
                f"{None if trailer is None else trailer.get('digest')}: not kept")
        slot.write_table_version(job_id, digest, bytes(data), sid)
        return {"bytes": len(data)}

    def get(body: dict):
        digest = check(body)
        data = slot.read_table_version(job_id, digest)
        if data is None:
            raise SnapshotIncompleteError(f"slot {slot.uuid} holds no table version {digest}")
        return {"size": len(data)}, (data[at:at + TABLE_PIECE]
                                     for at in range(0, len(data), TABLE_PIECE))
    return keep, put, get


def drop_old_snapshots(slot: StorageSlot, job_id: int, committed: int, keep) -> None:
    """Removes the snapshot folders of ``slot`` that the store no longer keeps: those of
    snapshots up to ``committed`` (just committed) that are not in ``keep`` (the retained
    snapshot ids), and what failed executions left there."""
    backend = slot.replicas(job_id)
    keep = set(keep)
    for name in backend.listdir(backend.path(layout.SNAPSHOTS)):
        ids = layout.snapshot_of(name)
        if ids is not None and ids[0] <= committed and ids[0] not in keep:
            backend.remove_tree(backend.path(layout.SNAPSHOTS, name))


__all__ = ["RANGES_SUFFIX", "DriverStoreFiles", "SlotWriterLink", "backup_ranges",
           "check_reachable", "claim_slot", "decode_table", "describe_unreachable",
           "drop_old_snapshots", "drop_table_versions",
           "encode_table", "held_ranges", "keep_committed", "partition_ranges", "replicator",
           "resynced_copy", "SlotTables", "slot_files", "slot_read_handler",
           "slot_table_handlers", "slot_write_handler",
           "slot_writer", "store_read_handler", "table_for", "unreachable"]
