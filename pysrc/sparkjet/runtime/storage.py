"""The members' storage (``JobConfig.storage == "members"``), as the runtime uses it.

A member task claims a storage slot on its host before it joins
(:func:`claim_slot`), and tells the driver at join what the slot holds
(:meth:`~sparkjet.snapshot.slots.StorageSlot.join_report`). Once every member has joined,
the driver places the partitions over the slots (:func:`table_for`): the last table the
slots hold, with the slots that are gone removed (their first backups promoted) and new
ones added, so that a slot reclaimed after its task died keeps its partitions; a new table
when there is none. Replicas of a partition sit on slots of distinct hosts.
"""
from __future__ import annotations

import base64
import binascii
import logging
import os

from sparkjet.errors import (
    InvalidArgumentError,
    PartitionTableError,
    SnapshotIncompleteError,
    StorageSlotError,
)
from sparkjet.partition_table import PartitionTable
from sparkjet.runtime.config import JobConfig
from sparkjet.snapshot import layout
from sparkjet.snapshot.slots import StorageSlot

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
    if (previous is None or previous.partition_count != config.partition_count
            or previous.backup_count != config.backup_count or previous.groups is None):
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


#: The most bytes one ``slot_read`` answer carries (base64 in JSON): larger ranges are read
#: in pieces.
READ_PIECE = 1 << 20


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
    """A chunk file in a peer's slot, read over the exchange (``slot_read`` actions)."""

    def __init__(self, client, slot: str, path: str, member: int):
        self._client, self._slot, self._path, self._member = client, slot, path, member

    def _call(self, offset: int, length: int) -> dict:
        return self._client.action("slot_read", {"slot": self._slot, "path": self._path,
                                                 "offset": offset, "length": length})

    def size(self) -> int:
        return int(self._call(0, 0)["size"])

    def range_reader(self):
        def read(offset: int, length: int) -> bytes:
            pieces = []
            while length > 0:
                n = min(length, READ_PIECE)
                data = base64.b64decode(self._call(offset, n)["data"])
                if len(data) != n:
                    raise SnapshotIncompleteError(
                        f"slot {self._slot} of member {self._member}: {self._path} ended at "
                        f"byte {offset + len(data)}, {offset + n} wanted")
                pieces.append(data)
                offset, length = offset + n, length - n
            return b"".join(pieces)
        return read


def slot_files(member, slot: StorageSlot, job_id: int):
    """The store's ``slot_files`` resolver of a member: its own slot's files from disk,
    a peer's over the exchange; a slot no member of this execution holds is
    SnapshotIncompleteError naming it (its data is lost with it until replicas exist)."""
    holders = {uuid: i for i, uuid in enumerate(member.topology.slots or [])}

    def resolve(uuid: str, path: str):
        if uuid == slot.uuid:
            return LocalSlotFile(slot, job_id, path)
        i = holders.get(uuid)
        if i is None:
            raise SnapshotIncompleteError(
                f"the snapshot's chunk file {path} is in storage slot {uuid}, which no member "
                f"of this execution holds (its task's host lost it, or it runs elsewhere); "
                f"with storage=\"members\" and no backups yet, its state cannot be restored: "
                f"start the job again from an export, or run it with storage=\"shared\"")
        return PeerSlotFile(member.peers[i], uuid, path, i)
    return resolve


def slot_read_handler(slot: StorageSlot, job_id: int):
    """The ``slot_read`` action of a member's exchange server: ``{slot, path, offset,
    length}`` -> ``{size, data}`` (base64) of a chunk file in this member's slot."""
    def handle(body: dict) -> dict:
        if body.get("slot") != slot.uuid:
            raise InvalidArgumentError(f"this member holds slot {slot.uuid}, not "
                                       f"{body.get('slot')!r}")
        offset, length = body.get("offset"), body.get("length")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0
                and 0 <= length <= READ_PIECE):
            raise InvalidArgumentError(f"slot_read: bad range {offset!r}+{length!r}")
        file = LocalSlotFile(slot, job_id, str(body.get("path")))
        data = file.range_reader()(offset, length) if length else b""
        return {"size": file.size(), "data": base64.b64encode(bytes(data)).decode()}
    return handle


def _checked(path: str) -> str:
    """A chunk file's path in a slot: ``snapshots/<dir>/<vertex>/<file>``, nothing else."""
    parts = path.split("/")
    if (len(parts) != 4 or parts[0] != layout.SNAPSHOTS
            or any(p in ("", ".", "..") or os.sep in p for p in parts)):
        raise InvalidArgumentError(f"not a chunk file's path in a slot: {path!r}")
    return path


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


__all__ = ["claim_slot", "decode_table", "drop_old_snapshots", "encode_table", "slot_files",
           "slot_read_handler", "table_for"]
