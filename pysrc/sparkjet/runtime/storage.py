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

Each processor writes its chunk files into its member's slot and then copies each one to
the slots that back its partitions (every other slot, for broadcast state) over a
``slot_write`` file stream (Flight ``DoPut``) to each, and each verifies its copy's size
and xxh3 before it answers; the file's record names them as its replicas. A restore reads
a file from its own slot when it holds a copy, else from a member whose slot holds one
over a ``slot_read`` file stream (``DoGet`` of the ranges it reads), the writer's slot
first. Both streams are fenced by the execution and authenticated like every call on the
members' links (:mod:`sparkjet.runtime.exchange`).
"""
from __future__ import annotations

import base64
import binascii
import logging
import os

import xxhash

from sparkjet.errors import (
    InvalidArgumentError,
    PartitionTableError,
    SnapshotIncompleteError,
    StorageSlotError,
)
from sparkjet.partition_table import PartitionTable
from sparkjet.runtime.config import JobConfig
from sparkjet.snapshot import layout
from sparkjet.snapshot.backend import open_backend
from sparkjet.snapshot.chunks import DEFAULT_CHUNK_SIZE
from sparkjet.snapshot.slots import StorageSlot
from sparkjet.snapshot.writer import SnapshotWriter

_log = logging.getLogger(__name__)


def claim_slot(config: JobConfig, execution: int) -> StorageSlot | None:
    """This member's slot, claimed on its host and fenced by ``execution`` (FencedError if
    the slot has seen a newer execution of the job: this task is a zombie); None when the
    job keeps its state in the shared store."""
    if config.storage != "members":
        return None
    slot = StorageSlot.claim(config.storage_root(), job_id=config.id,
                             durable=config.persistence)
    try:
        slot.fence(config.id, execution)
    except BaseException:
        slot.release()
        raise
    return slot


def encode_table(table: PartitionTable) -> str:
    return base64.b64encode(table.to_bytes()).decode()


def decode_table(text: str, where: str) -> PartitionTable:
    """The table in ``text`` (base64 of ``to_bytes``); StorageSlotError naming ``where``."""
    try:
        return PartitionTable.from_bytes(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError, PartitionTableError) as e:
        raise StorageSlotError(f"the partition table of {where} does not read: {e}") from None


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


class LocalSlotFile:
    """A chunk file in this member's own slot."""

    def __init__(self, slot: StorageSlot, job_id: int, path: str):
        self._backend = slot.replicas(job_id)
        self._path = self._backend.path(*_checked(path).split("/"))

    def size(self) -> int:
        return self._backend.size(self._path)

    def range_reader(self):
        return self._backend.range_reader(self._path)


class PeerSlotFile:
    """A chunk file in a peer's slot, read over the exchange: a ``slot_read`` file stream
    (Flight ``DoGet``) of the range asked for, fenced by the execution and authenticated
    like every call on the members' links."""

    def __init__(self, client, slot: str, path: str, member: int):
        self._client, self._slot, self._path, self._member = client, slot, path, member

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
            out = bytearray(length)
            view, at = memoryview(out), 0
            for piece in got:
                view[at:at + piece.size] = memoryview(piece).cast("B")
                at += piece.size
            return out
        return read


def slot_files(member, slot: StorageSlot, job_id: int):
    """The store's ``slot_files`` resolver of a member: a file from its own slot's copy
    from disk, else from the first slot holding one that a member of this execution holds,
    over the exchange; SnapshotIncompleteError naming every slot when none is held."""
    members = {uuid: i for i, uuid in enumerate(member.topology.slots or [])}

    def resolve(uuids: list[str], path: str):
        if slot.uuid in uuids:
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
    slots this execution holds before anything is restored: SnapshotIncompleteError naming
    every vertex and partition no reachable copy has, the slots that held them and their
    hosts (from the record's partition table), and what to do. A file with a durable copy
    is always reachable."""
    stored = store._resolve(snapshot_id, None)
    if stored.record.format != 2:
        return
    held = set(member.topology.slots or [])
    hosts: dict[str, str] = {}
    if stored.record.table:
        try:
            hosts = decode_table(stored.record.table, "the snapshot's record").groups or {}
        except StorageSlotError:
            hosts = {}
    lost: dict[str, set[int]] = {}
    gone: set[str] = set()
    for vertex, v in stored.record.vertices.items():
        for f in v.files:
            if f.slot is None or f.durable or held.intersection(f.holders):
                continue
            lost.setdefault(vertex, set()).update(c.partition for c in f.chunks)
            gone.update(f.holders)
    if not lost:
        return
    where = "; ".join(
        f"{vertex}: {'broadcast state' if parts == {-1} else 'partitions ' + _ranges(parts)}"
        for vertex, parts in sorted(lost.items()))
    slots = ", ".join(f"{u} (host {hosts[u]})" if u in hosts and hosts[u] != u else u
                      for u in sorted(gone))
    raise SnapshotIncompleteError(
        f"snapshot {snapshot_id}: no slot of this execution holds a copy of {where}; they "
        f"were in slot(s) {slots}, which no member of this execution holds (their hosts lost "
        f"them, or run no task of this execution). Run the job where those slots are, with "
        f"more backups (backup_count) or durable_tier=\"sync\", or start it again from an "
        f"export")


def _ranges(parts: set[int]) -> str:
    """Partitions as ranges: ``0-3, 7, 9-10`` (broadcast state, -1, left out)."""
    ps = sorted(p for p in parts if p >= 0)
    out, i = [], 0
    while i < len(ps):
        j = i
        while j + 1 < len(ps) and ps[j + 1] == ps[j] + 1:
            j += 1
        out.append(str(ps[i]) if i == j else f"{ps[i]}-{ps[j]}")
        i = j + 1
    return ", ".join(out) + (" and broadcast state" if -1 in parts else "")


def replicator(member, slot: StorageSlot, job_id: int):
    """What a member's snapshot writers call on each chunk file they wrote into ``slot``
    (:class:`~sparkjet.snapshot.writer.SnapshotWriter`'s ``replicate``): copies it to the
    slots of this execution that back one of its partitions (every other slot for
    broadcast state, partition -1) and returns them once each has verified its copy.

    One ``slot_write`` file stream (Flight ``DoPut``, fenced by the execution) goes to each
    backup slot's member; the file is read once, piece by piece, each piece written to
    every stream, and the trailer carries its size and xxh3, which each receiver checks
    before it answers."""
    table = member.topology.table
    slots = member.topology.slots or []
    index = {uuid: i for i, uuid in enumerate(slots)}

    def replicate(path: str, partitions: list[int]) -> list[str]:
        if table is None or len(slots) < 2:
            return []
        targets: set[str] = set()
        for p in partitions:
            if p < 0:
                targets.update(slots)
            else:
                targets.update(u for u in table.replicas(p)[1:] if u is not None)
        targets.discard(slot.uuid)
        if not targets:
            return []
        file = LocalSlotFile(slot, job_id, path)
        size = file.size()
        read = file.range_reader()
        order = sorted(targets, key=lambda u: index[u])
        streams = []
        try:
            for uuid in order:
                peer = member.peers[index[uuid]]
                streams.append(peer.put_file("slot_write", {"slot": uuid, "path": path},
                                             timeout=_deadline(peer, size)))
            digest = xxhash.xxh3_64()
            for offset in range(0, size, READ_PIECE):
                piece = read(offset, min(READ_PIECE, size - offset))
                digest.update(piece)
                for stream in streams:
                    stream.write(piece)
            trailer = {"size": size, "xxh3": digest.hexdigest()}
            for stream in streams:
                stream.finish(trailer)
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return order
    return replicate


def slot_write_handler(slot: StorageSlot, job_id: int):
    """The ``slot_write`` file stream of a member's exchange server (``on_put``): a peer's
    copy of one of its chunk files into this member's slot, body ``{slot, path}``. The
    pieces go into a temporary file as they come, hashed as they are written; the copy is
    renamed into place only when the stream's trailer has the size and xxh3 read, else it
    is removed and the stream refused (a short stream, one cut before its trailer, a
    corrupted piece)."""
    backend = slot.replicas(job_id)

    def handle(body: dict, stream) -> dict:
        if body.get("slot") != slot.uuid:
            raise InvalidArgumentError(f"this member holds slot {slot.uuid}, not "
                                       f"{body.get('slot')!r}")
        path = _checked(str(body.get("path")))
        final = os.path.join(backend.root, *path.split("/"))
        temp = final + ".part"
        os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
        digest, length = xxhash.xxh3_64(), 0
        try:
            with open(temp, "wb") as f:
                for piece in stream:
                    digest.update(piece)
                    f.write(piece)
                    length += piece.size
                trailer, got = stream.trailer, digest.hexdigest()
                if trailer is None:
                    raise SnapshotIncompleteError(
                        f"slot {slot.uuid}: the copy of {path} ended after {length} bytes "
                        f"without the writer's size and checksum (the writer stopped)")
                if length != trailer.get("size") or got != trailer.get("xxh3"):
                    raise SnapshotIncompleteError(
                        f"slot {slot.uuid}: the copy of {path} has {length} bytes and xxh3 "
                        f"{got}, the writer's has {trailer.get('size')} and "
                        f"{trailer.get('xxh3')}")
                if slot.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(temp, final)
        except BaseException:
            try:
                os.remove(temp)
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
        self._durable_uri = config.snapshot_store if config.durable_tier == "sync" else None
        self._store_backend = None

    @property
    def _backend(self):
        """The backend of ``snapshot_store``, opened on the first durable copy."""
        if self._durable_uri is None:
            raise InvalidArgumentError("a member of the members' storage writes into "
                                       "snapshot_store only with durable_tier=\"sync\"")
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
                *, writer: int, replicate) -> SnapshotWriter:
    """The writer of processor ``writer`` of a member of the members' storage: chunk files
    into its slot (copied to their backups by ``replicate``, and into snapshot_store with
    ``durable_tier="sync"``), fenced by the slot."""
    link.check_fence(execution_id)
    return SnapshotWriter(link, snapshot_id, execution_id, writer, config.partition_count,
                          DEFAULT_CHUNK_SIZE, config.snapshot_codec, link.slot, replicate,
                          config.durable_tier == "sync")


def keep_committed(slot: StorageSlot, job_id: int, snapshot_id: int, execution: int,
                   record: bytes, keep) -> None:
    """Phase 2 in a member's slot: a copy of the committed snapshot's record (refused,
    FencedError, if the slot has seen a newer execution than the one that committed it),
    then the record copies and chunk files of the snapshots the store no longer keeps
    (``keep``: the retained snapshot ids) removed."""
    slot.write_record(job_id, snapshot_id, record, execution=execution)
    keep = set(keep) | {snapshot_id}
    try:
        slot.drop_records_before(job_id, min(keep))
        drop_old_snapshots(slot, job_id, snapshot_id, keep)
    except OSError as e:
        # housekeeping of a committed snapshot: what is left is dropped at the next commit,
        # and is no reason to fail (and restart) the execution
        _log.warning("%s: could not drop snapshots older than %d: %s", slot, min(keep), e)


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
    snapshot or export the execution starts from) and nothing else; what
    :class:`DriverStoreFiles` calls."""
    prefix = [layout.job_dir(store.job_id), *directory]
    backend = store._backend

    def handle(body: dict) -> dict:
        path = str(body.get("path"))
        parts = path.split("/")
        if (parts[:len(prefix)] != prefix or len(parts) > len(prefix) + 2
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


__all__ = ["DriverStoreFiles", "SlotWriterLink", "check_reachable", "claim_slot", "decode_table",
           "drop_old_snapshots", "encode_table", "keep_committed", "replicator",
           "slot_files", "slot_read_handler", "slot_write_handler", "slot_writer",
           "store_read_handler", "table_for"]
