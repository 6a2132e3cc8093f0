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

from sparkjet.errors import PartitionTableError, StorageSlotError
from sparkjet.partition_table import PartitionTable
from sparkjet.runtime.config import JobConfig
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


__all__ = ["claim_slot", "decode_table", "encode_table", "table_for"]
