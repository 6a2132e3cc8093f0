"""Persistence restart on the members' storage (seed 004, ``JobConfig.persistence``).

A job whose slots are on disk (``storage="members"``, ``persistence=True``) can be started
again after its driver and every member died: a new ``Job`` of the same configuration (a
new driver) finds the newest committed record in ``snapshot_store`` and restores it from
the slots, as Hazelcast's cluster does after a whole-cluster restart. The steps, with
Hazelcast's settings (``JobConfig``):

1. **Validation** (``validation_timeout``, 120 s): before its first execution the driver
   waits until the cluster offers as many task slots as the newest record's partition
   table had storage slots (:func:`wait_for_slots`); then it goes on with what there is.
2. **Load** (``data_load_timeout``, 900 s): each member claims its slot (a corrupt
   ``MEMBER.json`` (of a slot with no other job's data), FENCE, table or record copy is
   removed alone, or refused naming its path,
   per ``auto_remove_stale_data``: :func:`claim`), verifies its replicas of the committed
   snapshots against the records' checksums (every chunk's, read whole; in the first
   execution of a run, not at the restarts after it, whose restores check every chunk they
   read) and joins with a report of what it holds (:func:`join_report`); a file it had no
   time to verify counts as not held. A file of a snapshot whose record copy the slot
   lacks (phase 2 did not reach it) counts by its size, checked as the restore reads it.
3. **Policy** (``cluster_data_recovery_policy``, :func:`recover`, on the driver once every
   member joined): every file of a snapshot must be held by a slot present, verified (or
   have a durable copy), and every reference table version it uses by one slot present
   (each slot keeps them all) or by ``snapshot_store``. ``FULL_RECOVERY_ONLY`` restores the newest committed snapshot or
   refuses (:class:`~sparkjet.errors.RecoveryRefusedError` naming the vertices,
   partitions, slots and hosts missing and what to do). ``PARTIAL_RECOVERY_MOST_RECENT``
   takes the newest snapshot complete over the slots present;
   ``PARTIAL_RECOVERY_MOST_COMPLETE`` the newest complete snapshot of the partition table
   that the largest group of slots holds. A snapshot older than the newest committed one
   replays output the newer ones' phase 2 committed: under exactly-once it is refused
   while the pipeline has a transactional sink or an acknowledging source; otherwise it
   is taken with a rollback event in the log and reported (``given_up``: the replay
   window). Who held what goes to the ``recovery`` progress event, the log and the
   execution's entry of ``JobResult.executions``.

**Stale slots.** A slot holding another job's data is left alone (only this job's folder of
a slot is ever looked at). A slot that has seen a newer execution of this job than the
driver's log registered holds data from the future (the store was replaced by an older
copy): its job data is removed by its member (``auto_remove_stale_data``, logged with the
path) or the job is refused, naming it.

**Lost metadata.** When ``snapshot_store`` holds no snapshot of the job but slots hold
record copies (the job's folder of the store was lost), the driver commits the copy of the
newest execution (then of its newest snapshot) a slot holds whose execution the slot has
seen, says so loudly (a warning and a ``metadata_rebuilt`` event), registers an execution as
new as any the slots have seen and ends the current execution, so that the next one (newer
than every slot's fence) restores it, the table join's versions from the slots too. Under exactly-once it refuses
(:class:`~sparkjet.errors.RecoveryRefusedError` naming the slots, hosts and partitions)
while a slot of that record's partition table has not joined: it may hold a newer copy.

**Durable copies.** A file whose durable copy (``durable_tier="sync"``, or ``"async"``'s
uploads once marked complete) the store no longer
holds whole counts as held only where a slot present holds it; the refusal and the
``recovery`` event name the paths.

**Force start** (:func:`force_start`, ``Job.force_start()``): removes the job's folder of
the store (its log, records, exports and table versions) and the job's data from every slot
of this host's ``storage_dir`` that no running task holds, and leaves a ``FORCE_START`` mark
(:func:`read_mark`) in the store with the newest execution and snapshot ids the data had
seen: the job's ids go on above them, and at every later execution a member whose slot holds
data from before the force start empties it (its record copies are never committed again).
Logged path by path. Never implicit.

**Rebalance delay** (``rebalance_delay``, 0 s: Hazelcast's wait after an unexpected leave
before backups are promoted): when an execution restarts after a member was lost and a slot
of the previous partition table (the newest the joined slots hold) is not among the joined
members' slots, the driver (:class:`~sparkjet.runtime.coordinator.ExecutionCoordinator`)
holds the joins for up to the delay from the loss (from its first joins for a new driver)
and asks each member whose slot is outside that table to claim the missing one instead
(:func:`reclaim`: its host came back) -- a ``waiting`` event names the slots awaited; a
member asked is left out of placement until it joins again with the slot it holds then
(placement waits for it, even past the delay), and lets its own slot go only after that
join; the members' start may take as long more as the joins were held. The runner's quorum
wait also waits, within the delay, for as many task slots as the lost execution had (a
worker restarting on its host; ``quorum_timeout`` counts from the delay's end). A slot back
in time keeps its partitions
(the table is the one before: no backup promoted, no byte copied; its member restores
from its own disk); after the delay its partitions' backups are promoted and the table
rebalanced. The ``rebalance`` event (and ``JobResult.executions[i]["rebalance"]``) says
which slots returned after how long and which partitions were promoted from which slots.

A slot that missed snapshots is synced by Merkle trees before its member restores
(:mod:`sparkjet.runtime.resync`), not by this module.
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import time
from dataclasses import dataclass, field

import pyarrow as pa

from sparkjet.errors import (
    ExecutionFailedError,
    FencedError,
    InvalidArgumentError,
    PartitionTableError,
    RecoveryRefusedError,
    SnapshotCorruptError,
    SparkjetError,
    StorageError,
    StorageSlotError,
)
from sparkjet.partition_table import PartitionTable
from sparkjet.runtime.config import JobConfig, open_store
from sparkjet.runtime.lifecycle import RunLock
from sparkjet.runtime.restore import handed_start
from sparkjet.runtime.storage import claim_slot, claim_wait, held_ranges, partition_ranges
from sparkjet.snapshot import layout
from sparkjet.snapshot import records as meta
from sparkjet.snapshot.chunks import HEADER_SIZE, read_chunks
from sparkjet.snapshot.slots import (
    FENCE,
    RECORDS,
    REPLICAS,
    SLOT_PREFIX,
    STORE_OF,
    TABLE,
    StorageSlot,
    host_id,
    recorded,
    remove_file,
)

_log = logging.getLogger("sparkjet.job")

#: The mark ``force_start`` leaves in the job's folder of the store.
FORCE_START = "FORCE_START.json"

FULL = "FULL_RECOVERY_ONLY"
MOST_RECENT = "PARTIAL_RECOVERY_MOST_RECENT"
MOST_COMPLETE = "PARTIAL_RECOVERY_MOST_COMPLETE"


def _persisted(config: JobConfig) -> bool:
    return config.storage == "members" and config.persistence


# -- on a member, before join ----------------------------------------------------------------


def claim(config: JobConfig, execution: int, log: str | None = None,
          store: str | None = None) -> tuple[StorageSlot | None, dict]:
    """This member's slot (see :func:`~sparkjet.runtime.storage.claim_slot`), and notes for
    its join report. With persistence: a slot whose ``MEMBER.json`` does not read is
    removed or refused (``auto_remove_stale_data``), this job's data in the slot is checked
    (:func:`check_metadata`), and a slot that has seen a newer execution than ``execution``
    is left unfenced: the driver decides at join whether its data is from the future or
    the driver's metadata was lost (:func:`recover`); the member fences it after
    (:func:`after_join`)."""
    if not _persisted(config):
        return claim_slot(config, execution, log, store), {}
    slot = StorageSlot.claim(config.storage_root(), job_id=config.id, durable=True,
                             remove_corrupt=config.auto_remove_stale_data,
                             execution=execution, wait=claim_wait(config), log=log,
                             store=store)
    return slot, _checked(config, slot, execution, store)


def _checked(config: JobConfig, slot: StorageSlot, execution: int,
             store: str | None = None) -> dict:
    """:func:`claim`'s checks of a slot just claimed (released when they raise); the
    slot records the job's store (``store``: its root), so that a claim of a job of the
    same name in another store passes it over."""
    try:
        if store is not None:
            slot.keep_store(config.id, store)
        notes = {"removed": check_metadata(config, slot)}
        notes["seen"] = slot.newest_execution(config.id)
        if notes["seen"] is None or notes["seen"] <= execution:
            slot.fence(config.id, execution)
    except BaseException:
        slot.release()
        raise
    return notes


def reclaim(config: JobConfig, uuids: list[str], execution: int,
            log: str | None = None) -> tuple[StorageSlot, dict] | None:
    """``rebalance_delay``: while the slots ``uuids`` of the previous partition table have
    not joined, the driver asks a member whose slot is outside that table to claim one of
    them instead: the first that is back in this host's ``storage_dir`` (its host returned)
    and free, claimed and checked as :func:`claim` does; None when none is."""
    root = config.storage_root()
    for uuid in uuids:
        folder = os.path.join(root, SLOT_PREFIX + uuid)
        if not os.path.isdir(folder):
            continue
        try:
            slot = StorageSlot.claim_folder(folder, durable=True, holder={
                "job": config.id, "execution": execution, "log": log})
        except StorageSlotError:
            continue
        if slot is None:
            continue
        if slot.host != host_id():
            slot.release()
            continue
        return slot, _checked(config, slot, execution)
    return None


def check_metadata(config: JobConfig, slot: StorageSlot) -> list[str]:
    """Checks this job's metadata in ``slot`` (FENCE, TABLE.json, the record copies); when
    some does not read, removes those files alone (the slot's verified replicas and its
    other record copies stay) and returns what was wrong (``auto_remove_stale_data``), or
    raises StorageSlotError naming the path."""
    job = config.id
    where = slot.job_path(job)
    if not os.path.isdir(where):
        return []
    problems: list[tuple[str, str]] = []         # (what is wrong, the file to remove)
    try:
        slot.newest_execution(job)
    except StorageSlotError as e:
        problems.append((str(e), slot.job_path(job, FENCE)))
    table = slot.read_table(job)
    if table is not None:
        try:
            PartitionTable.from_bytes(table)
        except (ValueError, PartitionTableError) as e:
            problems.append((f"{slot.job_path(job, TABLE)}: the partition table does not "
                             f"read ({e})", slot.job_path(job, TABLE)))
    for sid in slot.records(job):
        path = slot.job_path(job, RECORDS, f"{sid:020d}")
        try:
            record = meta.decode(slot.read_record(job, sid), meta.ValidationRecord, path,
                                 "record copy")
            if (record.job_id, record.snapshot_id) != (job, sid):
                raise SnapshotCorruptError(path, 0, "job and snapshot id",
                                           f"{record.job_id}/{record.snapshot_id}")
        except SnapshotCorruptError as e:
            problems.append((str(e), path))
    if not problems:
        return []
    said = "; ".join(what for what, _ in problems)
    if not config.auto_remove_stale_data:
        raise StorageSlotError(
            f"storage slot {slot.path}: this job's data in {where} is corrupt: {said}. "
            f"Remove the files named to give them up, or set auto_remove_stale_data=True, "
            f"or Job.force_start()")
    for _, path in problems:
        remove_file(path)
    _log.warning("storage slot %s: this job's metadata in %s is corrupt (%s): those files "
                 "removed (auto_remove_stale_data)", slot.path, where, said)
    return [f"{where}: {what}" for what, _ in problems]


def join_report(config: JobConfig, slot: StorageSlot, notes: dict, execution: int,
                verify: bool = True) -> dict:
    """The slot's join report (:meth:`~sparkjet.snapshot.slots.StorageSlot.join_report`);
    with persistence also ``seen`` (the newest execution the slot had seen before this
    one), ``held`` (the chunk files it holds, by snapshot folder, with their sizes),
    ``tables`` (the digests of the reference table versions it holds, each checked against
    its digest when ``verify``), ``loaded`` (per
    record copy: the files verified against its checksums, those that
    failed and why, those not verified within ``data_load_timeout``), ``removed`` (corrupt
    data given up) and, when the slot has seen this execution or a newer one (the driver's
    log is behind the slots: lost), ``record``: its newest record copy (base64).
    ``verify`` False (an execution after the first of a run): ``loaded`` is empty and the
    files count by their size (the restore checks every chunk it reads)."""
    report = slot.join_report(config.id)
    if not _persisted(config):
        return report
    job = config.id
    seen = notes.get("seen")
    report.update(seen=seen, removed=notes.get("removed") or [], held=_held(slot, job),
                  tables=_tables(slot, job) if verify else slot.table_versions(job),
                  loaded=_load(config, slot, time.monotonic() + config.data_load_timeout)
                  if verify else {})
    if seen is not None and seen >= execution and report["records"]:
        report["record"] = base64.b64encode(_newest_record(slot, job)).decode()
    return report


def _tables(slot: StorageSlot, job: int) -> list[str]:
    """The table versions ``slot`` holds whose bytes are the version's (review F12: a
    corrupt only copy counted as held, so the policy restored a snapshot whose restore
    then refused it). A corrupt copy is logged with its path and left out; the restore
    reads the version from a copy that reads."""
    out = []
    for digest in slot.table_versions(job):
        try:
            slot.read_table_version(job, digest)
        except (SnapshotCorruptError, StorageError) as e:
            _log.warning("storage slot %s: its copy of table version %s does not read (%s): "
                         "not counted as held", slot.path, digest, e)
            continue
        out.append(digest)
    return out


def _newest_record(slot: StorageSlot, job: int) -> bytes:
    """The slot's record copy of the newest execution (of its newest snapshot): after a
    rollback (a partial policy) the copies of the snapshots given up keep higher snapshot
    ids than the newer execution's, and must not win. A copy that does not read counts
    last (:func:`check_metadata` removed or refused those at claim)."""
    best, out = None, b""
    for sid in slot.records(job):
        data = slot.read_record(job, sid)
        try:
            key = (meta.decode(data, meta.ValidationRecord, "", "record copy").execution_id,
                   sid)
        except SnapshotCorruptError:
            key = (-1, sid)
        if best is None or key > best:
            best, out = key, data
    return out


def after_join(config: JobConfig, slot: StorageSlot, answer: dict, execution: int) -> None:
    """What a member does with its slot once the driver answered its join: empties it of
    the job's data when told to (``wipe``: force start, or data from the future), then
    fences it (FencedError if it has still seen a newer execution)."""
    if not _persisted(config):
        return
    if answer.get("wipe"):
        _log.warning("storage slot %s: removing this job's data (%s), as the driver said",
                     slot.path, answer["wipe"])
        slot.remove_job(config.id)
    slot.fence(config.id, execution)


def _held(slot: StorageSlot, job: int) -> dict:
    """``{snapshot folder: {"VERTEX/FILE": [size, ranges]}}`` of the chunk files in the slot:
    ``ranges`` None for a whole file (the writer's), else the ``[start, end]`` byte ranges a
    backup's copy holds (its ``.ranges`` sidecar; a copy whose sidecar does not read is left
    out, logged)."""
    root = slot.job_path(job, REPLICAS, layout.SNAPSHOTS)
    out: dict = {}
    for d in _names(root):
        for vertex in _names(os.path.join(root, d)):
            for name in _names(os.path.join(root, d, vertex)):
                if not name.endswith(".chunks"):
                    continue
                path = os.path.join(root, d, vertex, name)
                try:
                    size = os.stat(path).st_size
                    held = held_ranges(path)
                except FileNotFoundError:
                    continue
                except SnapshotCorruptError as e:
                    _log.warning("storage slot %s: %s: the copy counts as not held", slot.path, e)
                    continue
                out.setdefault(d, {})[f"{vertex}/{name}"] = [
                    size, None if held is None else [list(r) for r in held[1]]]
    return out


def _load(config: JobConfig, slot: StorageSlot, deadline: float) -> dict:
    """Per record copy the slot keeps (by snapshot id, as a string): ``verified`` (files
    whose every chunk reads and matches the record), ``bad`` (file -> why) and
    ``unverified`` (files left when the deadline passed)."""
    job = config.id
    out = {}
    for sid in reversed(slot.records(job)):         # the newest first
        record = meta.decode(slot.read_record(job, sid), meta.ValidationRecord,
                             slot.job_path(job, RECORDS, f"{sid:020d}"), "record copy")
        folder = layout.snapshot_dir(sid, record.execution_id)
        verified, bad, unverified = 0, {}, []
        for v in record.vertices.values():
            for f in v.files:
                if slot.uuid not in f.holders:
                    continue
                rel = f"{folder}/{f.path}"
                if time.monotonic() > deadline:
                    unverified.append(rel)
                    continue
                path = slot.job_path(job, REPLICAS, layout.SNAPSHOTS, folder, f.path)
                try:
                    held = held_ranges(path)
                    _verify_file(path, f, job, sid, None if held is None else held[1])
                    verified += 1
                except (SparkjetError, OSError) as e:
                    bad[rel] = f"{type(e).__name__}: {e}"
        out[str(sid)] = {"verified": verified, "bad": bad, "unverified": unverified}
        if unverified:
            _log.warning("storage slot %s: %d file(s) of snapshot %d not verified within "
                         "data_load_timeout=%g s: they count as not held", slot.path,
                         len(unverified), sid, config.data_load_timeout)
    return out


def _verify_file(path: str, f: meta.FileRecord, job: int, snapshot: int, ranges) -> None:
    """Every chunk of the file at ``path`` that it holds (all, or those inside ``ranges``:
    a backup's copy) read and checked against its record ``f``."""
    size = os.stat(path).st_size
    if size != f.bytes:
        raise SnapshotCorruptError(path, min(size, f.bytes), "file size",
                                   f"{size} bytes, record says {f.bytes}")
    wanted = [c for c in f.chunks if _inside(ranges, c)]
    if not wanted:
        return
    with pa.memory_map(path) as file:       # pieces of it live on as the payloads
        buf = file.read_buffer()
    if ranges is None:
        found = read_chunks(buf, path)
        if len(found) != len(f.chunks):
            raise SnapshotCorruptError(path, 0, "chunk count",
                                       f"{len(found)}, record says {len(f.chunks)}")
    else:
        found = []
        for c in wanted:
            span = read_chunks(buf.slice(c.offset, HEADER_SIZE + c.stored_size), path)
            if len(span) != 1:
                raise SnapshotCorruptError(path, c.offset, "chunk", "not one chunk there")
            found.append((c.offset + span[0][0], span[0][1], span[0][2]))
    for (offset, header, _), want in zip(found, wanted):
        for what, got, expected in (("offset", offset, want.offset),
                                    ("checksum", header.checksum, want.checksum),
                                    ("stored size", header.stored_size, want.stored_size),
                                    ("job id", header.job_id, job),
                                    ("snapshot id", header.snapshot_id, snapshot),
                                    ("partition", header.partition, want.partition)):
            if got != expected:
                raise SnapshotCorruptError(path, offset, what, f"{got}, record says {expected}")


def _inside(ranges, c) -> bool:
    """Whether chunk ``c`` lies in ``ranges`` (``[start, end]`` pairs; None: everything)."""
    if ranges is None:
        return True
    end = c.offset + HEADER_SIZE + c.stored_size
    return any(s <= c.offset and end <= e for s, e in ranges)


def _names(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


# -- on the driver, once every member joined -------------------------------------------------


@dataclass
class Recovery:
    """What :func:`recover` decided: the join answer's ``start`` (possibly another
    snapshot than the one handed before join), the members that must empty their slot of
    the job (index -> why), and the report (None: nothing to recover)."""

    start: dict | None
    wipe: dict[int, str] = field(default_factory=dict)
    report: dict | None = None


def _force_started(config: JobConfig, store, mark: dict, execution: int, reports: list[dict],
                   recovery: Recovery) -> None:
    """After a force start (``mark``): the members whose slots hold the job's data from
    before it (a slot that has seen no execution above the mark's, or holds record copies
    and no FENCE) go into ``recovery.wipe``, and the mark's snapshot floor rises above
    their ids. A slot that has seen this execution or a newer one was away at the force
    start (the store did not know its ids): the floors rise above its ids, that execution
    is registered, and this one ends (ExecutionFailedError): the next one, newer than it,
    empties it. A slot away now is emptied whenever it comes back, and its record copies
    are never committed again (:func:`_rebuild`)."""
    floor = mark["execution"]
    beyond = [r for r in reports if r.get("seen") is not None and r["seen"] >= execution]
    old = [i for i, r in enumerate(reports)
           if (r.get("seen") is not None and r["seen"] <= floor)
           or (r.get("seen") is None and r.get("records"))]
    ids = [_report_ids(reports[i]) for i in old] + [_report_ids(r) for r in beyond]
    raised = dict(mark, execution=max([floor, *(e for e, _ in ids)]),
                  snapshot=max([mark["snapshot"], *(sn for _, sn in ids)]))
    if raised != mark:
        _write_mark(store, raised)
        mark.update(raised)
    if beyond:
        try:
            store.register_execution(raised["execution"])
        except FencedError:
            pass        # a newer one is registered already: this one is fenced off anyway
        where = ", ".join(f"{r['path']} (host {r['host']}, execution {r['seen']})"
                          for r in beyond)
        message = (f"job {config.name!r}: slot(s) {where} hold the job's data from before its "
                   f"force start (generation {mark['generation']}) with ids the force start "
                   f"did not see (their hosts were away): the job's ids go on above "
                   f"execution {raised['execution']} and snapshot {raised['snapshot']}")
        _log.warning("%s", message)
        raise ExecutionFailedError(f"{message}. Execution {execution} is fenced off by it; "
                                   f"the next execution empties those slots")
    for i in old:
        recovery.wipe[i] = "force start"
    if old:
        _log.warning("job %r: force start (generation %d): member(s) empty their slot of the "
                     "job's data from before it (%s)", config.name, mark["generation"],
                     ", ".join(reports[i]["path"] for i in old))


def recover(config: JobConfig, store, dag, execution: int, start: dict | None,
            reports: list[dict], progress) -> Recovery:
    """The persistence restart's decision over the members' join ``reports`` (see the
    module doc): force start, lost metadata rebuilt, stale slots, and the recovery policy
    over the committed snapshots. Raises RecoveryRefusedError (the policy cannot restore),
    StorageSlotError (a stale slot, ``auto_remove_stale_data=False``) or
    ExecutionFailedError (metadata rebuilt: the next execution restores it)."""
    recovery = Recovery(start)
    removed = [p for r in reports for p in r.get("removed") or []]
    mark = read_mark(store)
    if mark is not None:
        _force_started(config, store, mark, execution, reports, recovery)
        if recovery.wipe and not store.complete():
            recovery.report = {"policy": "force start", "snapshot": None, "given_up": [],
                               "wiped": [reports[i]["path"] for i in recovery.wipe],
                               "removed": removed, "slots": {}}
            progress({"event": "recovery", "execution": execution, **recovery.report})
            return recovery
    committed = [s.snapshot_id for s in store.complete()]
    if not committed and start is None and config.initial_snapshot is None:
        # raises when it rebuilt
        _rebuild(config, store, execution, [r for i, r in enumerate(reports)
                                            if i not in recovery.wipe], progress,
                 -1 if mark is None else mark["execution"])
    stale = {i: r for i, r in enumerate(reports)
             if r.get("seen") is not None and r["seen"] > execution}
    hazards = _replay_hazards(config, dag) if stale else ""
    for i, r in stale.items():
        why = (f"it has seen execution {r['seen']} of the job, newer than any the driver's "
               f"snapshot_store registered ({execution} is the newest): its data is from the "
               f"future (the store was replaced by an older copy?)")
        if hazards:
            # the newer executions may have committed output past the store's newest
            # snapshot: restoring that one would replay it
            raise RecoveryRefusedError(
                f"storage slot {r['path']} (host {r['host']}): {why}. Under exactly-once "
                f"restoring the store's newest snapshot would replay {hazards} that the newer "
                f"executions may have committed. Put the store's newer copy back, or give "
                f"the job's data up under a new job name")
        if not config.auto_remove_stale_data:
            raise StorageSlotError(
                f"storage slot {r['path']} (host {r['host']}): {why}. Remove "
                f"{r['path']}/jobs/{layout.job_dir(config.id)} to give it up, set "
                f"auto_remove_stale_data=True, or Job.force_start()")
        _log.warning("storage slot %s (host %s): %s: its member removes this job's data "
                     "(auto_remove_stale_data)", r["path"], r["host"], why)
        recovery.wipe[i] = "data from the future: " + why
        removed.append(f"{r['path']}/jobs/{layout.job_dir(config.id)}: {why}")
    present = {r["uuid"]: r for i, r in enumerate(reports) if i not in recovery.wipe}
    slots = {r["uuid"]: {"member": i, "host": r["host"], "path": r["path"],
                         "records": list(r.get("records") or []), "holds": [],
                         "verified": sum(int(x.get("verified", 0))
                                         for x in (r.get("loaded") or {}).values()),
                         "bad": sorted(b for x in (r.get("loaded") or {}).values()
                                       for b in x.get("bad", {})),
                         "unverified": sum(len(x.get("unverified", []))
                                           for x in (r.get("loaded") or {}).values())}
             for i, r in enumerate(reports)}
    for i in recovery.wipe:
        slots[reports[i]["uuid"]]["stale"] = recovery.wipe[i]
    own = start is not None and start.get("export") is None and not start.get("initial")
    if not own or not committed:
        if removed or recovery.wipe:
            recovery.report = {"policy": config.cluster_data_recovery_policy, "snapshot": None,
                               "given_up": [], "removed": removed, "slots": slots}
            progress({"event": "recovery", "execution": execution, **recovery.report})
        return recovery
    # as restore reads them: with durable_tier="async" a marked snapshot's uploads count
    records = {sid: store._resolve(sid, None).record for sid in committed}
    gone = _durable_gone(store, records)
    missing = {sid: _missing(rec, present, gone) for sid, rec in records.items()}
    for sid, rec in records.items():
        missing[sid].update(_missing_tables(store, rec, present))
    for sid, rec in records.items():
        for uuid in present:
            if _holds_whole(rec, uuid, present[uuid]):
                slots[uuid]["holds"].append(sid)
    policy = config.cluster_data_recovery_policy
    newest = committed[-1]
    chosen = None
    if policy == FULL:
        chosen = newest if not missing[newest] else None
    elif policy == MOST_RECENT:
        chosen = next((s for s in reversed(committed) if not missing[s]), None)
    else:
        group = _largest_group(present)
        of_group = [s for s in committed if group is not None
                    and _table_version(records[s].table) == group]
        chosen = next((s for s in reversed(of_group) if not missing[s]), None)
    report = {"policy": policy, "newest": newest, "snapshot": chosen,
              # every id after the one chosen: with durable_tier="async" the log keeps an
              # old marked snapshot but not the commits between it and the retained ones
              "given_up": [] if chosen is None else list(range(chosen + 1, newest + 1)),
              "removed": removed, "slots": slots}
    if gone:
        report["durable_missing"] = sorted(gone.values())
    if chosen is None or chosen != newest:
        report["missing"] = _describe(missing[newest], records[newest])
    if chosen is None:
        progress({"event": "recovery", "execution": execution, **report})
        raise RecoveryRefusedError(_refusal(config, policy, newest, missing, records,
                                            present, committed, gone))
    if chosen != newest:
        hazards = _replay_hazards(config, dag)
        if hazards:
            progress({"event": "recovery", "execution": execution, **report,
                      "refused": "exactly-once"})
            raise RecoveryRefusedError(
                f"job {config.name!r}: {policy} would restore snapshot {chosen}, the newest "
                f"complete over the slots present, but snapshot(s) "
                f"{report['given_up']} committed after it and their phase 2 committed "
                f"{hazards}: an older snapshot replays that output, so exactly-once refuses "
                f"it. The newest snapshot {newest} lacks "
                f"{_where(missing[newest])}, held by slot(s) "
                f"{_slots_named(missing[newest], records[newest])}. Bring those slots back "
                f"and run again, run with processing_guarantee=\"at-least-once\" to accept "
                f"the replay, or give the data up with Job.force_start()")
        store.rollback(chosen, execution_id=execution,
                       reason=f"{policy}: snapshot(s) {report['given_up']} incomplete over "
                              f"the slots present")
        _, _, recovery.start = handed_start(config, store, chosen)
        _log.warning("job %r: %s restores snapshot %d and gives up snapshot(s) %s (they lack "
                     "%s): output since snapshot %d is written again (the replay window)",
                     config.name, policy, chosen, report["given_up"],
                     _where(missing[newest]), chosen)
    report["replay_from"] = chosen if chosen != newest else None
    _log.info("job %r: persistence restart of snapshot %d (%s): %s", config.name, chosen,
              policy, "; ".join(f"slot {u} ({s['host']}, {s['path']}) holds {s['holds']}"
                                for u, s in slots.items()))
    progress({"event": "recovery", "execution": execution, **report})
    recovery.report = report
    return recovery


def _held_chunks(r: dict, rec: meta.ValidationRecord, f: meta.FileRecord) -> set[int]:
    """The indexes of the chunks of ``f`` (of ``rec``) that the slot of report ``r`` holds
    verified: every one of a whole copy, those in a backup's ranges; none when its copy is
    missing, of another size, failed to verify or was not verified in time."""
    folder = layout.snapshot_dir(rec.snapshot_id, rec.execution_id)
    entry = (r.get("held") or {}).get(folder, {}).get(f.path)
    if not entry or entry[0] != f.bytes:
        return set()
    loaded = (r.get("loaded") or {}).get(str(rec.snapshot_id))
    rel = f"{folder}/{f.path}"
    if loaded is not None and (rel in loaded.get("bad", {})
                               or rel in loaded.get("unverified", [])):
        return set()
    return {i for i, c in enumerate(f.chunks) if _inside(entry[1], c)}


def _durable_gone(store, records: dict) -> dict[tuple[int, str], str]:
    """The durable copies (``durable_tier="sync"``) the records name that the store no
    longer holds whole: (snapshot id, file path) -> the copy's path and what is wrong
    (missing, or of another size). Those files count as held only where a slot present
    holds them; the loss is logged. (A copy of the right size with a flipped byte is found
    by the restore, which reads the slots' copies first and names the path when none
    reads.)"""
    out: dict[tuple[int, str], str] = {}
    backend = store._backend
    for sid, rec in records.items():
        folder = layout.snapshot_dir(sid, rec.execution_id)
        for vertex, v in rec.vertices.items():
            durable = [f for f in v.files if f.durable]
            if not durable:
                continue
            where = store._path(layout.SNAPSHOTS, folder, vertex)
            names = set(backend.listdir(where))
            for f in durable:
                path = f"{where}/{f.name}"
                if f.name not in names:
                    out[(sid, f.path)] = f"{path}: missing"
                    continue
                size = backend.size(path)
                if size != f.bytes:
                    out[(sid, f.path)] = f"{path}: {size} bytes, the record says {f.bytes}"
    if out:
        _log.warning("snapshot_store %s: durable copies not whole (%s): they count as held "
                     "only where a slot present holds the file", store.who,
                     "; ".join(sorted(out.values())))
    return out


def _missing(rec: meta.ValidationRecord, present: dict,
             gone: dict | None = None) -> dict[str, tuple[set, set]]:
    """vertex -> (partitions, slots that held them) of the chunks of ``rec`` that no slot
    present holds verified (and no durable copy has: ``gone`` names the durable copies
    the store lost, :func:`_durable_gone`)."""
    out: dict[str, tuple[set, set]] = {}
    gone = gone or {}
    for vertex, v in rec.vertices.items():
        for f in v.files:
            if f.durable and (rec.snapshot_id, f.path) not in gone:
                continue
            covered: set[int] = set()
            for u in f.holders:
                if u in present:
                    covered |= _held_chunks(present[u], rec, f)
            lost = [c.partition for i, c in enumerate(f.chunks) if i not in covered]
            if lost:
                parts, gone = out.setdefault(vertex, (set(), set()))
                parts.update(lost)
                gone.update(f.holders)
    return out


def _missing_tables(store, rec: meta.ValidationRecord, present: dict) -> dict:
    """``{"table version DIGEST": ({-1}, the record's slots)}`` for each reference table
    version ``rec`` uses that no slot present holds (their reports' ``tables``: every slot
    keeps each one) and ``snapshot_store`` has no copy of (a durable copy, or one that
    slots written before versions were kept in them left there)."""
    out: dict[str, tuple[set, set]] = {}
    held = {d for r in present.values() for d in r.get("tables") or ()}
    for digest in rec.tables:
        if digest in held or store._backend.exists(store._table_path(digest)):
            continue
        out[f"table version {digest}"] = ({-1}, set(_hosts(rec)))
    return out


def _holds_whole(rec: meta.ValidationRecord, uuid: str, r: dict) -> bool:
    """Whether the slot holds its share of ``rec``: some verified chunks of every file that
    names it."""
    files = [f for v in rec.vertices.values() for f in v.files if uuid in f.holders]
    return bool(files) and all(_held_chunks(r, rec, f) for f in files)


def _table_version(text: str | None):
    if not text:
        return None
    try:
        return PartitionTable.from_bytes(base64.b64decode(text, validate=True)).version
    except (binascii.Error, ValueError, PartitionTableError):
        return None


def _largest_group(present: dict):
    """The table version the most slots present hold (ties: the newer version)."""
    versions: dict = {}
    for r in present.values():
        v = _table_version(r.get("table"))
        if v is not None:
            versions[v] = versions.get(v, 0) + 1
    if not versions:
        return None
    return max(versions, key=lambda v: (versions[v], v))


def _where(missing: dict) -> str:
    return "; ".join(f"{vertex}: partitions {partition_ranges(parts)}" if parts != {-1}
                     else vertex if vertex.startswith("table version ")
                     else f"{vertex}: broadcast state"
                     for vertex, (parts, _) in sorted(missing.items()))


def _hosts(rec: meta.ValidationRecord) -> dict:
    try:
        return (PartitionTable.from_bytes(base64.b64decode(rec.table or "")).groups or {})
    except (binascii.Error, ValueError, PartitionTableError):
        return {}


def _slots_named(missing: dict, rec: meta.ValidationRecord) -> str:
    hosts = _hosts(rec)
    gone = sorted(set().union(*(g for _, g in missing.values())))
    return ", ".join(f"{u} (host {hosts[u]})" if hosts.get(u, u) != u else u for u in gone)


def _describe(missing: dict, rec: meta.ValidationRecord) -> dict:
    hosts = _hosts(rec)
    return {vertex: {"partitions": partition_ranges(parts),
                     "slots": {u: hosts.get(u) for u in sorted(gone)}}
            for vertex, (parts, gone) in sorted(missing.items())}


def _refusal(config, policy, newest, missing, records, present, committed,
             durable_gone) -> str:
    rec = records[newest]
    head = (f"job {config.name!r}: persistence restart refused ({policy}): the newest "
            f"committed snapshot {newest} lacks {_where(missing[newest])}; no slot present "
            f"holds a verified copy (they were in slot(s) {_slots_named(missing[newest], rec)}; "
            f"slots present: {', '.join(sorted(present)) or 'none'})")
    gone = set().union(*(g for _, g in missing[newest].values()))
    unloaded = sorted(gone & set(present))
    if unloaded:
        head += (f"; slot(s) {', '.join(unloaded)} are present, but their copies failed to "
                 f"verify or were not verified within data_load_timeout="
                 f"{config.data_load_timeout:g} s (the recovery event lists them)")
    lost = sorted(why for (sid, _), why in durable_gone.items() if sid == newest)
    if lost:
        head += (f"; its durable copies in snapshot_store are not whole ({'; '.join(lost)}): "
                 f"put them back from a copy of snapshot_store, or bring the slots back")
    if policy == FULL:
        older = [s for s in reversed(committed[:-1]) if not missing[s]]
        alt = (f", or a partial policy (cluster_data_recovery_policy="
               f"\"{MOST_RECENT}\" would restore snapshot {older[0]})" if older else
               ", or a partial policy")
        return (head + f". Bring those slots' hosts back and run again (validation_timeout="
                f"{config.validation_timeout:g} s waits for them){alt}, or give the job's "
                f"data up with Job.force_start()")
    return (head + f"; {policy} finds no snapshot the store keeps "
            f"({committed}) complete over the slots present. Bring those slots' hosts back "
            f"and run again, or give the job's data up with Job.force_start()")


def _replay_hazards(config: JobConfig, dag) -> str:
    """What an older snapshot would replay under exactly-once ("" when nothing does:
    at-least-once, or no transactional sink and no acknowledging source)."""
    if config.processing_guarantee != "exactly-once":
        return ""
    sinks = [n for n, s in dag.sinks.items() if getattr(s.sink, "transactional", False)]
    acking = [v.name for v in dag.sources if getattr(v.source, "acknowledging", False)]
    parts = []
    if sinks:
        parts.append(f"the transactions of sink(s) {sinks}")
    if acking:
        parts.append(f"the acknowledgements of source(s) {acking}")
    return " and ".join(parts)


def _rebuild(config: JobConfig, store, execution: int, reports: list[dict], progress,
             floor: int = -1) -> None:
    """The job's folder of the store holds no snapshot: commits again the newest record
    copy a slot holds (one whose execution the slot has seen, and above ``floor``: the
    newest execution before a force start, whose data is never committed again), loudly,
    and ends this execution when a slot has seen a newer execution than it (the next one,
    registered newer than all, restores it). The newest is the copy of the newest
    execution, then of its newest snapshot: after a force start or a rollback a newer
    execution's snapshot ids may be lower. Under exactly-once RecoveryRefusedError when a
    slot of that record's partition table did not join (it may hold a newer copy, whose
    output the sinks committed). Returns when no slot holds a record."""
    best = None
    for r in reports:
        if not r.get("record") or r.get("seen") is None or r["seen"] <= floor:
            continue
        data = base64.b64decode(r["record"])
        try:
            rec = meta.decode(data, meta.ValidationRecord, f"{r['path']} record copy",
                              "record copy")
        except SnapshotCorruptError as e:
            _log.warning("storage slot %s: its newest record copy does not read: %s",
                         r["path"], e)
            continue
        if rec.job_id != config.id or rec.execution_id > r["seen"] or \
                rec.execution_id <= floor:
            continue
        if best is None or (rec.execution_id, rec.snapshot_id) > best[0]:
            best = ((rec.execution_id, rec.snapshot_id), data, r, rec)
    if best is None:
        return
    (eid, sid), data, r, rec = best
    if config.processing_guarantee == "exactly-once":
        try:
            table = PartitionTable.from_bytes(base64.b64decode(rec.table or "", validate=True))
        except (binascii.Error, ValueError, PartitionTableError) as e:
            raise RecoveryRefusedError(
                f"job {config.name!r}: the driver's metadata was lost, and the newest record "
                f"copy the slots hold (snapshot {sid}, execution {eid}, in {r['path']}) has "
                f"no partition table that reads ({e}): which slots it needs is not known, so "
                f"exactly-once refuses to rebuild from it. Run with processing_guarantee="
                f"\"at-least-once\", or give the job's data up with Job.force_start()"
            ) from None
        absent = [u for u in table.members if u not in {x.get("uuid") for x in reports}]
        if absent:
            raise RecoveryRefusedError(_rebuild_refusal(config, rec, r, table, absent))
    seen = max(x["seen"] for x in reports if x.get("seen") is not None)
    message = (f"job {config.name!r}: snapshot_store {config.snapshot_store} holds no "
               f"snapshot of this job, but its storage slots do: the driver's metadata was "
               f"lost. Rebuilding it from the record copy of snapshot {sid} (execution {eid}) "
               f"in slot {r['uuid']} at {r['path']} (host {r['host']}); the slots have seen "
               f"execution {seen}")
    _log.warning("%s", message)
    try:
        store.adopt_record(data)
        if (store.current_execution() or 0) < seen:
            store.register_execution(seen)
    except FencedError as e:
        raise RecoveryRefusedError(f"{message}, but the log cannot take it: {e}. Start the "
                                   f"job with a new snapshot_store folder") from None
    progress({"event": "metadata_rebuilt", "execution": execution, "snapshot": sid,
              "from_execution": eid, "slot": r["uuid"], "path": r["path"], "message": message})
    raise ExecutionFailedError(f"{message}. Execution {execution} is fenced off by it; the "
                               f"next execution restores snapshot {sid}")


def _rebuild_refusal(config: JobConfig, rec: meta.ValidationRecord, r: dict,
                     table: PartitionTable, absent: list[str]) -> str:
    hosts = table.groups or {}
    named = "; ".join(
        f"slot {u} (host {hosts.get(u, 'unknown')}, owner of partitions "
        f"{partition_ranges(set(table.partitions_of(u))) or 'none'})" for u in sorted(absent))
    return (f"job {config.name!r}: snapshot_store {config.snapshot_store} holds no snapshot "
            f"of this job, but its storage slots do: the driver's metadata was lost. The "
            f"newest record copy the slots present hold is snapshot {rec.snapshot_id} "
            f"(execution {rec.execution_id}, in {r['path']}), but {named} of its partition "
            f"table did not join: a newer record copy may be there, whose output the sinks "
            f"committed, and rebuilding from an older one would replay it, which "
            f"exactly-once refuses. Bring those hosts back and run again (validation_timeout="
            f"{config.validation_timeout:g} s waits for them), run with processing_guarantee="
            f"\"at-least-once\" to accept the replay, or give the job's data up with "
            f"Job.force_start()")


# -- the driver's store, before the first execution ------------------------------------------


def wait_for_slots(config: JobConfig, store, available, progress) -> None:
    """Before a run's first execution: waits up to ``validation_timeout`` s until
    ``available()`` (the cluster's task slots) reaches the number of storage slots of the
    newest committed record's partition table, saying so in a ``waiting`` event; then goes
    on with what there is (the policy decides at join)."""
    if not _persisted(config):
        return
    try:
        latest = store.latest_complete()
        if latest is None:
            return
        data, _, _ = store.committed_record(latest.snapshot_id)
        rec = meta.decode(data, meta.ValidationRecord, "the newest record", "validation record")
    except SparkjetError as e:   # the execution finds it too, and fails by its kind
        _log.warning("job %r: the newest record does not read (%s): not waiting for its slots",
                     config.name, e)
        return
    want = len(_hosts(rec)) or 0
    deadline = time.monotonic() + config.validation_timeout
    said = None
    while True:
        have = available()
        if have >= want or time.monotonic() >= deadline:
            return
        if have != said:
            said = have
            progress({"event": "waiting", "slots": have, "wanted": want,
                      "note": f"snapshot {latest.snapshot_id} is in {want} storage slots; "
                              f"{have} task slot(s) now: waiting up to validation_timeout="
                              f"{config.validation_timeout:g} s"})
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


# -- force start -----------------------------------------------------------------------------


def force_start(config: JobConfig, dag=None, *, without_transactions: bool = False) -> dict:
    """Deletes the job's data: its folder of ``snapshot_store`` (log, records, exports,
    table versions) and its data in every slot of this host's ``storage_dir`` that no
    running task holds; leaves the ``FORCE_START`` mark (:func:`read_mark`), at which every
    later execution has a member whose slot holds data from before the force start empty
    it, and which keeps that data's record copies from ever being committed again. Logs
    each path. Returns what it removed, and the ``floor``: the newest execution and
    snapshot ids anything had seen before (the store's log and snapshot folders, this
    host's slots, an earlier mark). The new log starts with that execution registered, and
    the next execution's snapshots start above that snapshot id: a sink's marker or
    registry, or a slot of another host, that kept the old ids never meets them again
    (a slot that joins later having seen more raises the floor then, :func:`recover`).

    Refused under exactly-once when the store's log holds no registration (the ids the
    old executions used are not known) and the pipeline ``dag`` (None: unknown, assumed
    so) has a transactional sink or an acknowledging source: those systems keep the old
    ids (a Kafka sink's markers, a Delta table's transaction versions, a registry of
    executions), so the new output could be fenced off or taken as committed already.
    ``without_transactions``: the caller (the CLI, which has no pipeline) says there is
    none of those."""
    if config.storage != "members":
        raise InvalidArgumentError(
            f"job {config.name!r}: force start deletes the data of the members' storage "
            f"slots (storage=\"members\"); with storage={config.storage!r} delete or roll "
            f"back its snapshots with `sparkjet snapshots`")
    removed: dict = {"store": [], "slots": [], "held": []}
    with RunLock(config):
        store = open_store(config)
        try:
            execution, snapshot, known = _store_ids(store)
            hazards = ("" if known or without_transactions
                       or config.processing_guarantee != "exactly-once"
                       else _replay_hazards(config, dag) if dag is not None
                       else "the transactions of any transactional sink")
            if hazards:
                raise InvalidArgumentError(
                    f"job {config.name!r}: force start refused under exactly-once: "
                    f"{config.snapshot_store} holds no log of the job, so the execution and "
                    f"snapshot ids its old executions used are not known, while {hazards} "
                    f"keep them (newer output fenced off, or taken as committed already and "
                    f"lost). Start the pipeline under a new job name (JobConfig.name) "
                    f"instead, which starts empty with ids of its own (`sparkjet snapshots "
                    f"force-start --no-transactional-outputs` when the job has neither)")
            mark = read_mark(store)
            root = config.storage_root()
            folders = [os.path.join(root, name, "jobs", layout.job_dir(config.id))
                       for name in _names(root) if name.startswith("slot-")]
            # a job of the same name in another snapshot store is another job: left alone
            folders = [f for f in folders if recorded(f, STORE_OF) in (None, store.root)]
            for folder in folders:
                e, sn = _folder_ids(folder)
                execution, snapshot = max(execution, e), max(snapshot, sn)
            floor = {"execution": execution, "snapshot": snapshot}
            # the mark first: a force start cut short leaves the floors known
            backend = store._backend
            backend.makedirs(backend.path(layout.job_dir(config.id)))
            _write_mark(store, {"time": time.time(), **floor,
                                "generation": 1 if mark is None else mark["generation"] + 1})
            for name in backend.listdir(backend.path(layout.job_dir(config.id))):
                if name in (layout.RUNNING, FORCE_START):
                    continue
                path = backend.path(layout.job_dir(config.id), name)
                if backend.is_dir(path):
                    backend.remove_tree(path)
                else:
                    backend.remove(path)
                removed["store"].append(path)
                _log.warning("force start of job %r: removed %s", config.name, path)
        finally:
            store.close()
        with open_store(config) as store:     # the job's folders anew
            if execution >= 0:
                store.register_execution(execution)
        _log.warning("force start of job %r: its execution and snapshot ids go on above %d "
                     "and %d, the newest its data had seen", config.name, execution, snapshot)
        removed["floor"] = floor
        for folder in folders:
            if not os.path.isdir(folder):
                continue
            try:
                slot = StorageSlot.claim_folder(os.path.dirname(os.path.dirname(folder)),
                                                durable=True)
            except StorageSlotError as e:
                removed["held"].append(f"{folder}: {e}")
                continue
            if slot is None:
                removed["held"].append(folder)
                _log.warning("force start of job %r: %s is held by a running task; the next "
                             "execution empties it", config.name, folder)
                continue
            with slot:
                slot.remove_job(config.id)
            removed["slots"].append(folder)
            _log.warning("force start of job %r: removed %s", config.name, folder)
    return removed


def _mark_path(store) -> str:
    return store._backend.path(layout.job_dir(store.job_id), FORCE_START)


def read_mark(store) -> dict | None:
    """The ``FORCE_START`` mark of the job's folder of ``store`` (None: never force
    started): ``generation`` (force starts so far), ``execution`` and ``snapshot`` (the
    newest ids anything had seen before the last force start, -1 for none: the ids after
    it go on above them, and a slot or record copy of those ids or below is the old
    data). RecoveryRefusedError naming the path when it does not read."""
    backend, path = store._backend, _mark_path(store)
    if not backend.exists(path):
        return None
    try:
        mark = json.loads(bytes(backend.read(path)))
        out = {"generation": int(mark.get("generation", 1)),
               "execution": int(mark.get("execution", -1)),
               "snapshot": int(mark.get("snapshot", -1)), "time": mark.get("time")}
    except (ValueError, TypeError, AttributeError) as e:
        raise RecoveryRefusedError(
            f"{path}: the force start mark does not read ({e}): the ids the job's data had "
            f"before its force start are not known, so no slot's data can be told old or "
            f"new. Run `sparkjet snapshots force-start` again (it writes the mark anew)"
        ) from None
    return out


def _write_mark(store, mark: dict) -> None:
    store._backend.write(_mark_path(store), [json.dumps(mark, sort_keys=True).encode()])


def first_snapshot(store, restore_from: int | None) -> int:
    """The id of an execution's first snapshot: one after the one it restored, and after a
    force start above every snapshot id the job's data had before it (a Kafka marker or a
    slot's record copy of the old ids must never meet a new snapshot of the same id)."""
    nxt = 0 if restore_from is None else restore_from + 1
    mark = None if store is None else read_mark(store)
    return nxt if mark is None else max(nxt, mark["snapshot"] + 1)


def _store_ids(store) -> tuple[int, int, bool]:
    """The newest execution and snapshot ids the job's folder of the store names (its log,
    its snapshot folders, an earlier force start's mark; -1: none), and whether they are
    known (its log holds a registration, or a mark is there). A log event that does not
    read counts as one more of each."""
    execution, snapshot = -1, -1
    events = store._events()
    unread = sum(1 for _, e in events if not isinstance(
        e, (meta.RegisterEvent, meta.CommitEvent, meta.RollbackEvent)))
    known = False
    for _, e in events:
        if isinstance(e, meta.RegisterEvent):
            execution, known = max(execution, e.execution), True
        elif isinstance(e, meta.CommitEvent):
            execution, snapshot = max(execution, e.execution), max(snapshot, e.snapshot)
        elif isinstance(e, meta.RollbackEvent):
            snapshot = max([snapshot, e.snapshot, *e.replaced])
    backend = store._backend
    for name in backend.listdir(backend.path(layout.job_dir(store.job_id), layout.SNAPSHOTS)):
        ids = layout.snapshot_of(name)
        if ids is not None:
            snapshot, execution = max(snapshot, ids[0]), max(execution, ids[1])
    mark = read_mark(store)
    if mark is not None:         # the ids before an earlier force start are known
        execution, snapshot = max(execution, mark["execution"]), max(snapshot, mark["snapshot"])
        known = True
    return execution + unread, snapshot + unread, known


def _folder_ids(folder: str) -> tuple[int, int]:
    """The newest execution and snapshot ids a slot's folder of the job names (its FENCE,
    record copies and replicas' snapshot folders; -1: none). A FENCE that does not read
    names none (the record copies and folders still count)."""
    execution, snapshot = -1, -1
    try:
        with open(os.path.join(folder, FENCE)) as f:
            execution = int(f.read().strip())
    except (OSError, ValueError):
        pass
    for name in _names(os.path.join(folder, RECORDS)):
        if name.isdigit():
            snapshot = max(snapshot, int(name))
    for name in _names(os.path.join(folder, REPLICAS, layout.SNAPSHOTS)):
        ids = layout.snapshot_of(name)
        if ids is not None:
            snapshot, execution = max(snapshot, ids[0]), max(execution, ids[1])
    return execution, snapshot


def _report_ids(r: dict) -> tuple[int, int]:
    """The newest execution and snapshot ids a join report names (-1: none)."""
    execution = -1 if r.get("seen") is None else int(r["seen"])
    snapshot = max([-1, *(int(s) for s in r.get("records") or [])])
    for name in r.get("held") or {}:
        ids = layout.snapshot_of(name)
        if ids is not None:
            snapshot, execution = max(snapshot, ids[0]), max(execution, ids[1])
    return execution, snapshot


__all__ = ["FORCE_START", "Recovery", "after_join", "check_metadata", "claim", "first_snapshot",
           "force_start", "join_report", "read_mark", "recover", "wait_for_slots"]
