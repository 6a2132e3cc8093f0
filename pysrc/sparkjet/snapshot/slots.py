"""Storage slots: where a member keeps snapshot data on its own host (seeds 003 and 004).

A Spark barrier task is a new process at every execution and may land on any executor of a
host, so a task cannot own storage; a *slot* can. A slot is a folder under a host-local
``storage_dir`` (tmpfs for the memory tier, a local disk fsynced for persistence)::

    storage_dir/
      slot-<uuid>/
        LOCK            flock-ed by the task that claimed the slot; the kernel frees it when
                        that process dies, so the next task on the host reclaims the slot.
                        It names its holder ({"pid", "job", "execution", "log"}) for
                        fencing
        MEMBER.json     {"format", "uuid", "host", "created"}: whose slot this is
        jobs/job-<id>/  one job's data: FENCE (the newest execution seen), records/ (copies
                        of committed snapshot records), TABLE.json (its last partition table),
                        replicas/ (the chunk files this slot holds), tables/ (the versions
                        of the job's reference tables its snapshots use: DIGEST.arrow, named
                        by the xxh3-128 of its Arrow IPC bytes, and DIGEST.snap, the newest
                        snapshot id it was stored for) and LOG (which log of the job's
                        snapshot store all that belongs to)
      .new-<uuid>/      a slot being made: locked and named before it is renamed to
                        slot-<uuid> (a slot- folder without MEMBER.json is a dead creator's)

A task claims one slot before it joins the execution (:meth:`StorageSlot.claim`): a free
slot of its host holding this job's data first (a killed worker's slot, restored locally),
then any free slot of its host, else a new one. ``local[N]`` ends up with N slots on one
host. The host is ``SPARKJET_HOST_ID`` when set (the standalone harness gives each worker
its own), else the host name. A slot of another host in ``storage_dir`` is refused: the
folder is shared between hosts, and a lock over a network file system proves nothing.
"""
from __future__ import annotations

import base64
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass

from sparkjet._fs import storage_error
from sparkjet.errors import FencedError, SnapshotCorruptError, StorageSlotError
from sparkjet.snapshot.backend import FileSystemBackend
from sparkjet.snapshot.layout import content_digest, is_table_digest
from sparkjet.snapshot.layout import job_dir as job_folder

_log = logging.getLogger(__name__)

#: Format of ``MEMBER.json`` this code writes and reads.
SLOT_FORMAT = 1
SLOT_PREFIX = "slot-"
#: Seconds a claim waits for the lock of a zombie it killed to be freed.
FENCE_WAIT = 5.0
LOCK = "LOCK"
MEMBER = "MEMBER.json"
JOBS = "jobs"
FENCE = "FENCE"
RECORDS = "records"
TABLE = "TABLE.json"
REPLICAS = "replicas"
#: the reference table versions (``sparkjet.operators.table_join``) of the job in a slot
TABLES = "tables"
#: which log of the job's snapshot store the job's data in the slot belongs to
LOG_OF = "LOG"
#: Which snapshot store the job's data in a slot is of (its root): a job of the same name
#: (the same id) in another store is another job, whose data a claim must leave alone.
STORE_OF = "STORE"


def host_id() -> str:
    """This host's name for slots: ``SPARKJET_HOST_ID``, else the host name."""
    return os.environ.get("SPARKJET_HOST_ID") or socket.gethostname()


@dataclass(frozen=True)
class SlotIdentity:
    """What ``MEMBER.json`` says: the slot's UUID and the host it belongs to."""

    uuid: str
    host: str
    created: str

    def to_json(self) -> bytes:
        return json.dumps({"format": SLOT_FORMAT, "uuid": self.uuid, "host": self.host,
                           "created": self.created}, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, path: str) -> SlotIdentity:
        """The identity in ``data`` (read from ``path``); StorageSlotError naming the file
        and what is wrong with it."""
        try:
            doc = json.loads(bytes(data))
        except ValueError as e:
            raise StorageSlotError(f"{path} is not a slot's MEMBER.json ({e}): remove the "
                                   "slot folder if it holds nothing you need") from None
        if not isinstance(doc, dict) or doc.get("format") != SLOT_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise StorageSlotError(f"{path} has format {found!r}; this sparkjet reads format "
                                   f"{SLOT_FORMAT}")
        try:
            uuidlib.UUID(str(doc.get("uuid")))
        except ValueError:
            raise StorageSlotError(f"{path}: {doc.get('uuid')!r} is not a UUID") from None
        if not isinstance(doc.get("host"), str) or not doc["host"]:
            raise StorageSlotError(f"{path}: no host name")
        return cls(str(doc["uuid"]), doc["host"], str(doc.get("created", "")))


class StorageSlot:
    """One claimed slot: its :class:`SlotIdentity`, its folder, and the lock that makes it
    this process's until :meth:`release` (or the process's death)."""

    def __init__(self, path: str, identity: SlotIdentity, lock_fd: int, durable: bool):
        self.path = path
        self.identity = identity
        self.durable = durable
        self._lock_fd: int | None = lock_fd
        #: the zombies this claim fenced to take the slot: {"pid", "job", "execution", "path"}
        self.fenced: list[dict] = []
        self.backend = FileSystemBackend(path, durable=durable)
        # a peer's barrier may store a table version while phase 2 drops the unused ones
        self._tables_lock = threading.Lock()

    @property
    def uuid(self) -> str:
        return self.identity.uuid

    @property
    def host(self) -> str:
        return self.identity.host

    def __repr__(self) -> str:
        return f"StorageSlot({self.uuid} of host {self.host!r} at {self.path})"

    # -- claim and release -----------------------------------------------------------------

    @classmethod
    def claim(cls, storage_dir: str, *, job_id: int | None = None, host: str | None = None,
              durable: bool = False, remove_corrupt: bool = False,
              execution: int | None = None, wait: float = 0.0,
              log: str | None = None, store: str | None = None) -> StorageSlot:
        """A slot of ``host`` (default :func:`host_id`) under ``storage_dir``, locked by this
        process; StorageSlotError when ``storage_dir`` holds a slot of another host, or one
        whose ``MEMBER.json`` does not read (``remove_corrupt``: such a slot, when no
        process holds it, is removed and logged instead); StorageError when it cannot be
        used. ``durable``: writes are fsynced (persistence).

        Which slot: a free one holding ``job_id``'s data first (of the snapshot log ``log``,
        when given: data of another log is given up at the claim), then any free one, else
        a new one. A slot holding a job of the same id in another snapshot store (``store``,
        the store's root, differs from the one the slot recorded) is passed over, also when
        it turns out so once locked: that is another job.

        A zombie: when every slot holding the job's data is locked and one of them by an
        older execution than ``execution`` (its FENCE says so: a zombie, or a task of a
        cancelled stage not yet killed), the claim waits up to ``wait`` seconds for one of
        them to be freed before taking another (a slot taken instead leaves that data out
        of reach). When the wait ends, a holder that claimed the slot for an older execution
        of the job in the same log (the lock's holder record and the kernel's lock table
        agree on its pid; a job of the same name in another store has the same id, never
        its log) is fenced: killed, and the slot claimed once the kernel frees its lock (the
        slot's ``fenced`` lists it)."""
        host = host or host_id()
        storage_dir = os.path.abspath(storage_dir)
        try:
            os.makedirs(storage_dir, mode=0o700, exist_ok=True)
            names = sorted(n for n in os.listdir(storage_dir) if n.startswith(SLOT_PREFIX))
        except OSError as e:
            raise storage_error("create directory", storage_dir, e) from None
        mine, first, stale = [], [], []
        for name in names:
            folder = os.path.join(storage_dir, name)
            try:
                identity = _read_identity(folder)
            except StorageSlotError as e:
                if not remove_corrupt:
                    raise
                others = _other_jobs(folder, job_id)
                if others:
                    # another job's data is not this job's to give up: passed over
                    _log.warning("storage slot %s passed over: its MEMBER.json does not read "
                                 "(%s) and it holds data of other jobs (%s); remove it by hand "
                                 "to give that data up", folder, e, ", ".join(others))
                    continue
                if not _remove_unheld(folder):
                    raise
                _log.warning("removed storage slot %s: its MEMBER.json does not read (%s); "
                             "its data is given up (JobConfig.auto_remove_stale_data)",
                             folder, e)
                continue
            if identity is None:          # a slot whose creator died before MEMBER.json
                mine.append(folder)
                continue
            if identity.host != host:
                raise StorageSlotError(
                    f"storage_dir {storage_dir} holds {name} of host {identity.host!r}, and this "
                    f"is host {host!r}: a storage_dir must be local to one host (tmpfs or a local "
                    f"disk), never shared. If this host was renamed, set SPARKJET_HOST_ID="
                    f"{identity.host} for its members, or remove {folder} to give its data up")
            holds = job_id is not None and os.path.isdir(
                os.path.join(folder, JOBS, job_folder(job_id)))
            if holds and not _may_be(folder, job_id, STORE_OF, store):
                continue        # a job of the same name in another store: not ours
            if holds and not _may_be(folder, job_id, LOG_OF, log):
                # the job's data of another log (a run the store no longer knows) is
                # given up at the claim: this slot is no better than an empty one, and
                # must not stand in for the one a zombie of this log still holds
                stale.append(folder)
                continue
            (first if holds else mine).append(folder)
        mine = stale + mine     # taking a stale slot first frees what it held
        holder = {"pid": os.getpid(), "job": job_id, "execution": execution, "log": log}
        deadline = time.monotonic() + wait
        while True:
            for folder in first:
                fd = _try_lock(folder, holder)
                if fd is not None:
                    return cls._locked(folder, fd, host, durable)
            if (not first or execution is None
                    or not any(_fenced_below(f, job_id, execution) for f in first)):
                break
            if time.monotonic() >= deadline:
                # still held by a task of an older execution: a zombie (SIGSTOPped, or hung)
                # that the driver declared silent. Left alone, it holds the job's state out
                # of reach of every later execution; fenced by killing it, as seed 003's
                # members shut down a member the cluster removed
                for folder in first:
                    fenced = _fence_holder(folder, job_id, execution, log)
                    if fenced is None:
                        continue
                    fd = _wait_lock(folder, holder, FENCE_WAIT)
                    if fd is not None:
                        slot = cls._locked(folder, fd, host, durable)
                        slot.fenced.append(fenced)
                        return slot
                break
            time.sleep(0.1)
        for folder in mine:
            fd = _try_lock(folder, holder)
            if fd is None:
                continue
            if job_id is not None and not _may_be(folder, job_id, STORE_OF, store):
                # ranked before the wait; another store's job of the same name has taken
                # it meanwhile: its data is not this job's to give up
                os.close(fd)
                continue
            return cls._locked(folder, fd, host, durable)
        identity = _new_identity(host)
        folder = os.path.join(storage_dir, SLOT_PREFIX + identity.uuid)
        # made whole (locked, MEMBER.json written) under a name no claim lists, then renamed
        # into place: a slot- folder without MEMBER.json is one whose creator died, which
        # another claim may take over (the lock follows the folder through the rename)
        making = os.path.join(storage_dir, f".new-{identity.uuid}")
        try:
            os.mkdir(making, 0o700)
        except OSError as e:     # named as the slot it makes (the folder users will look for)
            raise storage_error("create directory", folder,
                                OSError(e.errno, e.strerror)) from None
        fd = _try_lock(making, holder)
        if fd is None:  # cannot happen: nobody else knows the new UUID
            raise StorageSlotError(f"{making}: a new slot was locked by someone else")
        try:
            _write_atomic(making, MEMBER, identity.to_json(), durable)   # (names its error)
            try:
                os.rename(making, folder)
            except OSError as e:
                raise storage_error("rename", making, e) from None
            if durable:
                _sync_dir(storage_dir)
        except BaseException:
            os.close(fd)
            if os.path.isdir(making):   # a half-made slot that nobody would ever take over
                shutil.rmtree(making, ignore_errors=True)
            raise
        return cls(folder, identity, fd, durable)

    @classmethod
    def _locked(cls, folder: str, fd: int, host: str, durable: bool) -> StorageSlot:
        identity = _read_identity(folder)
        if identity is None:          # ours now: finish what its creator began
            identity = _new_identity(host)
            _write_atomic(folder, MEMBER, identity.to_json(), durable)
        return cls(folder, identity, fd, durable)

    @classmethod
    def claim_folder(cls, folder: str, *, durable: bool = False,
                     holder: dict | None = None) -> StorageSlot | None:
        """The slot at ``folder``, locked by this process; None when another process holds
        it. StorageSlotError when its ``MEMBER.json`` is missing or does not read.
        ``holder``: the job, execution and log a member task claims it for (a zombie of it
        can be fenced, as :meth:`claim` says); without, the pid alone (never fenced)."""
        identity = _read_identity(folder)
        if identity is None:
            raise StorageSlotError(f"{folder} has no {MEMBER}: not a slot")
        fd = _try_lock(folder, {**(holder or {}), "pid": os.getpid()})
        if fd is None:
            return None
        return cls(folder, identity, fd, durable)

    def release(self) -> None:
        """Unlocks the slot (its data stays for the next task on this host)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # closing the only descriptor of the open file drops the flock

    @property
    def claimed(self) -> bool:
        return self._lock_fd is not None

    def __enter__(self) -> StorageSlot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- one job's data --------------------------------------------------------------------

    def job_path(self, job_id: int, *parts: str) -> str:
        return os.path.join(self.path, JOBS, job_folder(job_id), *parts)

    def jobs(self) -> list[int]:
        """The ids of the jobs this slot holds data of."""
        names = _listdir(os.path.join(self.path, JOBS))
        return sorted(int(n[4:], 16) for n in names if _is_job_folder(n))

    def log_of(self, job_id: int) -> str | None:
        """Which log of the job's snapshot store this slot's data of it belongs to
        (:meth:`SnapshotStore.incarnation`; None: not recorded)."""
        return recorded(self.job_path(job_id), LOG_OF)

    def store_of(self, job_id: int) -> str | None:
        """The root of the snapshot store this slot's data of ``job_id`` is of (None: not
        recorded)."""
        return recorded(self.job_path(job_id), STORE_OF)

    def keep_store(self, job_id: int, store: str) -> None:
        """Records that this slot's data of ``job_id`` is of the store whose root is
        ``store`` (a persisted slot records no log: the restart judges logs, but a claim of
        a job of the same name in another store must still pass it over);
        StorageSlotError if it recorded another store."""
        self._check_claimed()
        was = self.store_of(job_id)
        if was == store:
            return
        if was is not None:
            raise StorageSlotError(f"{self}: its data of job {job_id:016x} is of snapshot "
                                   f"store {was}, not {store}: another job of the same name")
        _write_atomic(self._job_dir(job_id), STORE_OF, store.encode(), self.durable)

    def keep_log(self, job_id: int, log: str, *, drop_other: bool,
                 store: str | None = None) -> bool:
        """Records that this slot's data of ``job_id`` belongs to the store's log ``log``
        (and to the store whose root is ``store``, when given). When it belonged to another
        log (the store's folder was removed and made again), that data is of a run the
        store no longer knows: ``drop_other`` gives it up first (returns True), else it
        stays and is relabelled (the persistence restart decides about it). A claim never
        hands out a slot holding a job of the same id of another store
        (:meth:`claim`)."""
        self._check_claimed()
        if store is not None:
            self.keep_store(job_id, store)   # never drops another store's job's data
        was = self.log_of(job_id)
        if was == log:
            return False
        dropped = False
        if was is not None and drop_other and os.path.isdir(self.job_path(job_id)):
            _log.warning("%s: its data of job %016x is of another snapshot log (%s, the store's "
                         "is %s): given up", self, job_id, was, log)
            self.remove_job(job_id)
            dropped = True
        _write_atomic(self._job_dir(job_id), LOG_OF, log.encode(), self.durable)
        if store is not None and dropped:    # remove_job took the STORE file too
            self.keep_store(job_id, store)
        return dropped

    def fence(self, job_id: int, execution: int) -> None:
        """Records ``execution`` as the newest of ``job_id`` this slot has seen; FencedError
        if it has seen a newer one (this task belongs to an execution that was replaced)."""
        self._check_claimed()
        newest = self.newest_execution(job_id)
        if newest is not None and newest > execution:
            raise FencedError(f"{self}: execution {execution} of job {job_id:016x} is fenced "
                              f"off by execution {newest}, which this slot has seen")
        if newest != execution:
            _write_atomic(self._job_dir(job_id), FENCE, str(execution).encode(), self.durable)

    def check_fence(self, job_id: int, execution: int) -> None:
        """FencedError if this slot has seen a newer execution of ``job_id`` than
        ``execution`` (what a writer of the members' storage checks before each write, in
        place of the store's log: a processor thread of an execution that was replaced,
        left in a reused Python worker whose slot the next execution's task claimed and
        fenced, is refused here)."""
        newest = self.newest_execution(job_id)
        if newest is not None and newest > execution:
            raise FencedError(f"{self}: execution {execution} of job {job_id:016x} is fenced "
                              f"off by execution {newest}, which this slot has seen")

    def newest_execution(self, job_id: int) -> int | None:
        """The newest execution of ``job_id`` this slot has seen (None: none)."""
        path = self.job_path(job_id, FENCE)
        text = _read(path)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            raise StorageSlotError(f"{path} holds {text[:40]!r}, not an execution id") from None

    def write_record(self, job_id: int, snapshot_id: int, record: bytes, *,
                     execution: int | None = None) -> None:
        """Keeps a copy of a committed snapshot's record (phase 2 hands every slot one);
        with ``execution`` (the execution that committed it), FencedError if this slot has
        seen a newer one."""
        self._check_claimed()
        if execution is not None:
            self.check_fence(job_id, execution)
        folder = self._job_dir(job_id, RECORDS)
        _write_atomic(folder, f"{snapshot_id:020d}", record, self.durable)

    def records(self, job_id: int) -> list[int]:
        """The snapshot ids whose records this slot holds, oldest first."""
        return sorted(int(n) for n in _listdir(self.job_path(job_id, RECORDS)) if n.isdigit())

    def read_record(self, job_id: int, snapshot_id: int) -> bytes:
        path = self.job_path(job_id, RECORDS, f"{snapshot_id:020d}")
        data = _read_bytes(path)
        if data is None:
            raise StorageSlotError(f"{self} holds no record of snapshot {snapshot_id} of job "
                                   f"{job_id:016x}")
        return data

    def drop_records_before(self, job_id: int, snapshot_id: int, *, keep=()) -> None:
        """Removes the record copies older than ``snapshot_id``, except those of ``keep``
        (snapshot ids retention keeps: with ``durable_tier="async"``, an upload under way or
        the newest marked snapshot may be older than the retained ones)."""
        self._check_claimed()
        keep = set(keep)
        for old in self.records(job_id):
            if old < snapshot_id and old not in keep:
                remove_file(self.job_path(job_id, RECORDS, f"{old:020d}"))

    def write_table(self, job_id: int, table: bytes) -> None:
        """Keeps the job's last partition table (``PartitionTable.to_bytes()``, which
        carries its own checksum)."""
        self._check_claimed()
        _write_atomic(self._job_dir(job_id), TABLE, table, self.durable)

    def read_table(self, job_id: int) -> bytes | None:
        """The job's last partition table as written (None: none)."""
        return _read_bytes(self.job_path(job_id, TABLE))

    def replicas(self, job_id: int) -> FileSystemBackend:
        """The backend of the chunk files this slot holds for ``job_id``."""
        self._check_claimed()
        folder = self._job_dir(job_id, REPLICAS)
        return FileSystemBackend(folder, durable=self.durable)

    # -- reference table versions (every slot holds each one a snapshot uses) ----------

    def _table_version_path(self, job_id: int, digest: str, suffix: str = ".arrow") -> str:
        if not is_table_digest(digest):
            raise StorageSlotError(f"{self}: a table version is 32 hex digits, not {digest!r}")
        return self.job_path(job_id, TABLES, f"{digest}{suffix}")

    def write_table_version(self, job_id: int, digest: str, data,
                            snapshot_id: int | None = None) -> None:
        """Keeps the table version ``digest`` (Arrow IPC bytes, checked against their name;
        written whole, once) and records that snapshot ``snapshot_id`` uses it
        (:meth:`keep_table_version`)."""
        self._check_claimed()
        if content_digest(data) != digest:
            raise StorageSlotError(f"{self}: table version {digest}: the bytes have another "
                                   "digest")
        path = self._table_version_path(job_id, digest)
        with self._tables_lock:
            if not os.path.exists(path):
                _write_atomic(self._job_dir(job_id, TABLES), os.path.basename(path),
                              bytes(data), self.durable)
            if snapshot_id is not None:
                self._keep_table_version(job_id, digest, snapshot_id)

    def keep_table_version(self, job_id: int, digest: str, snapshot_id: int) -> bool:
        """Records that snapshot ``snapshot_id`` (its barrier, before its commit) uses the
        table version ``digest``, so that phase 2 of an older snapshot does not remove it
        (:meth:`drop_table_versions`); False when the slot does not hold it."""
        self._check_claimed()
        with self._tables_lock:
            return self._keep_table_version(job_id, digest, snapshot_id)

    def _keep_table_version(self, job_id: int, digest: str, snapshot_id: int) -> bool:
        if not os.path.exists(self._table_version_path(job_id, digest)):
            return False
        mark = self._table_version_path(job_id, digest, ".snap")
        if self._table_mark(mark) < snapshot_id:
            _write_atomic(os.path.dirname(mark), os.path.basename(mark),
                          str(snapshot_id).encode(), self.durable)
        return True

    @staticmethod
    def _table_mark(path: str) -> int:
        text = _read(path)
        try:
            return -1 if text is None else int(text)
        except ValueError:
            return -1

    def read_table_version(self, job_id: int, digest: str) -> bytes | None:
        """The bytes of table version ``digest`` in this slot (None: not held);
        SnapshotCorruptError naming the file when they are not the version's."""
        path = self._table_version_path(job_id, digest)
        data = _read_bytes(path)
        if data is not None and content_digest(data) != digest:
            raise SnapshotCorruptError(path, 0, "table version digest")
        return data

    def remove_table_version(self, job_id: int, digest: str) -> None:
        """Gives up this slot's copy of table version ``digest`` (one that does not read:
        a copy read from elsewhere takes its place)."""
        self._check_claimed()
        with self._tables_lock:
            remove_file(self._table_version_path(job_id, digest))
            remove_file(self._table_version_path(job_id, digest, ".snap"))

    def table_versions(self, job_id: int) -> list[str]:
        """The digests of the table versions this slot holds of ``job_id``."""
        return sorted(n[:-6] for n in _listdir(self.job_path(job_id, TABLES))
                      if n.endswith(".arrow") and is_table_digest(n[:-6]))

    def drop_table_versions(self, job_id: int, keep, committed: int) -> list[str]:
        """Removes the table versions that no snapshot of ``keep`` (the digests the
        retained snapshots use) needs and that no barrier after snapshot ``committed``
        stored (a newer snapshot, not committed yet, may use it); returns their digests."""
        self._check_claimed()
        keep = set(keep)
        gone = []
        with self._tables_lock:
            for digest in self.table_versions(job_id):
                mark = self._table_version_path(job_id, digest, ".snap")
                if digest in keep or self._table_mark(mark) > committed:
                    continue
                remove_file(self._table_version_path(job_id, digest))
                remove_file(mark)
                gone.append(digest)
        return gone

    def remove_job(self, job_id: int) -> None:
        """Gives up everything this slot holds of ``job_id``."""
        self._check_claimed()
        FileSystemBackend(self.path, durable=self.durable).remove_tree(self.job_path(job_id))

    def report(self) -> dict:
        """What the slot tells the driver at join: identity and, per job it holds, the
        newest execution seen and the records kept."""
        return {"uuid": self.uuid, "host": self.host, "path": self.path,
                "durable": self.durable,
                "jobs": {f"{j:016x}": {"execution": self.newest_execution(j),
                                       "records": self.records(j)} for j in self.jobs()}}

    def join_report(self, job_id: int) -> dict:
        """What a member tells the driver at join about its slot for ``job_id``: identity,
        the newest execution seen, the snapshot ids of the records it keeps and the job's
        last partition table (base64), if any; ``fenced``: the zombies its claim killed."""
        table = self.read_table(job_id)
        report = {"uuid": self.uuid, "host": self.host, "path": self.path,
                  "execution": self.newest_execution(job_id), "records": self.records(job_id),
                  "table": None if table is None else base64.b64encode(table).decode()}
        if self.fenced:
            report["fenced"] = [{"pid": f["pid"], "execution": f["execution"]}
                                for f in self.fenced]
        return report

    # -- internals -------------------------------------------------------------------------

    def _check_claimed(self) -> None:
        if self._lock_fd is None:
            raise StorageSlotError(f"{self} was released: claim it again to write")

    def _job_dir(self, job_id: int, *parts: str) -> str:
        folder = self.job_path(job_id, *parts)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as e:
            raise storage_error("create directory", folder, e) from None
        return folder


def _is_job_folder(name: str) -> bool:
    if not name.startswith("job-") or len(name) != 20:
        return False
    try:
        int(name[4:], 16)
    except ValueError:
        return False
    return True


def _new_identity(host: str) -> SlotIdentity:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return SlotIdentity(str(uuidlib.uuid4()), host, now)


def _read_identity(folder: str) -> SlotIdentity | None:
    path = os.path.join(folder, MEMBER)
    data = _read_bytes(path)
    return None if data is None else SlotIdentity.parse(data, path)


def remove_file(path: str) -> None:
    """Removes a file of a slot (gone already: nothing to do); StorageError naming it."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise storage_error("remove", path, e) from None


def _other_jobs(folder: str, job_id: int | None) -> list[str]:
    """The job folders in slot ``folder`` other than ``job_id``'s (every one, and anything
    under ``jobs/`` that cannot be listed, counts: only data known to be nobody else's may
    be removed)."""
    jobs = os.path.join(folder, JOBS)
    try:
        names = os.listdir(jobs)
    except FileNotFoundError:
        return []
    except OSError as e:
        return [f"{jobs} ({e.strerror})"]
    mine = job_folder(job_id) if job_id is not None else None
    return sorted(n for n in names if n != mine)


def _remove_unheld(folder: str) -> bool:
    """Removes a slot's folder if no process holds its lock; False if one does."""
    fd = _try_lock(folder)
    if fd is None:
        return False
    try:
        shutil.rmtree(folder)
    except OSError as e:
        raise storage_error("remove", folder, e) from None
    finally:
        os.close(fd)
    return True


def recorded(job_folder_path: str, name: str) -> str | None:
    """What a slot's job folder recorded in file ``name`` (:data:`LOG_OF`, the snapshot
    log; :data:`STORE_OF`, the store's root); None when it recorded nothing."""
    data = _read_bytes(os.path.join(job_folder_path, name))
    return None if data is None else data.decode(errors="replace")


def _may_be(folder: str, job_id: int, name: str, value: str | None) -> bool:
    """Whether slot ``folder``'s data of ``job_id`` may be of ``value`` for what file
    ``name`` records (none given, or none recorded: it may)."""
    if value is None:
        return True
    was = recorded(os.path.join(folder, JOBS, job_folder(job_id)), name)
    return was is None or was == value


def _fenced_below(folder: str, job_id: int | None, execution: int) -> bool:
    """Whether slot ``folder``'s FENCE for ``job_id`` names an execution older than
    ``execution`` (a FENCE that does not read: no)."""
    if job_id is None:
        return False
    try:
        with open(os.path.join(folder, JOBS, job_folder(job_id), FENCE)) as f:
            return int(f.read().strip()) < execution
    except (OSError, ValueError):
        return False


def _try_lock(folder: str, holder: dict | None = None) -> int | None:
    """A descriptor of ``folder``/LOCK holding an exclusive flock, or None if another
    process (or another claim in this one) holds it. ``holder`` (pid, job, execution) is
    written into the file once locked: who holds it, for :func:`_fence_holder` (a full
    disk leaves it empty: the lock holds all the same)."""
    path = os.path.join(folder, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise storage_error("open", path, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise storage_error("lock", path, e) from None
    if holder is not None:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError as e:   # a full disk: the lock holds, only fencing its holder cannot
            _log.warning("%s: its holder could not be recorded (%s); a claim of a later "
                         "execution can wait for it but not fence it", path, e)
    return fd


def _wait_lock(folder: str, holder: dict, timeout: float) -> int | None:
    """:func:`_try_lock` until it locks or ``timeout`` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        fd = _try_lock(folder, holder)
        if fd is not None or time.monotonic() >= deadline:
            return fd
        time.sleep(0.05)


def _lock_holder(folder: str) -> dict | None:
    """Who holds ``folder``/LOCK: what its holder wrote into it (pid, job, execution), when
    the kernel's lock table (``/proc/locks``) shows that pid holding a flock on that very
    file (by device and inode: a pid reused since, or a holder in another pid namespace,
    is not it);
    None when that cannot be told."""
    path = os.path.join(folder, LOCK)
    try:
        st = os.stat(path)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open(path, "rb") as f:
            doc = json.loads(f.read() or b"null")
        with open("/proc/locks") as f:
            table = f.read().splitlines()
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("pid"), int):
        return None
    for line in table:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2d:1234 0 EOF"; waiters have "->" after "1:"
        if len(fields) < 6 or fields[1] != "FLOCK" or not fields[4].isdigit():
            continue
        if int(fields[4]) == doc["pid"] and fields[5] == inode:
            return doc
    return None


def _fence_holder(folder: str, job_id: int | None, execution: int | None,
                  log: str | None) -> dict | None:
    """Kills the process holding slot ``folder``'s lock when it claimed it for an older
    execution of ``job_id`` than ``execution`` in the snapshot log ``log`` (a zombie); what
    it had claimed, with the slot's path, or None when the holder is not one (another job's
    task, the same name's in another store, this process, one that cannot be told)."""
    doc = _lock_holder(folder)
    if doc is None:
        _log.warning("storage slot %s: a task of an older execution still holds it, and "
                     "who cannot be told (its LOCK names no holder the kernel's lock table "
                     "confirms: another pid namespace, an overlay file system); it is not "
                     "fenced", folder)
        return None
    if (job_id is None or execution is None or doc.get("job") != job_id
            or doc.get("log") != log
            or not isinstance(doc.get("execution"), int) or doc["execution"] >= execution
            or doc["pid"] == os.getpid()):
        return None
    try:
        os.kill(doc["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass                      # died meanwhile: its lock is free, or about to be
    except OSError as e:
        _log.warning("storage slot %s: could not fence pid %s of execution %s: %s",
                     folder, doc["pid"], doc["execution"], e)
        return None
    _log.warning("storage slot %s: fenced pid %s, which held it for execution %s of job "
                 "%016x, declared silent; execution %s claims it", folder, doc["pid"],
                 doc["execution"], job_id, execution)
    return {"pid": doc["pid"], "job": job_id, "execution": doc["execution"], "path": folder}


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise storage_error("read", path, e) from None


def _read(path: str) -> str | None:
    data = _read_bytes(path)
    return None if data is None else data.decode("utf-8", "replace").strip()


def _write_atomic(folder: str, name: str, data: bytes, durable: bool) -> None:
    """``folder``/``name`` replaced whole by ``data`` (a temporary file renamed over it;
    fsynced, file and folder, when ``durable``)."""
    path = os.path.join(folder, name)
    temp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError as e:
        try:
            os.remove(temp)
        except OSError:
            pass
        raise storage_error("write", path, e) from None
    if durable:
        _sync_dir(folder)


def _sync_dir(folder: str) -> None:
    FileSystemBackend(folder, durable=True).sync_dir(folder)


def _listdir(folder: str) -> list[str]:
    """The names in ``folder`` ([] when it does not exist)."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise storage_error("list", folder, e) from None


__all__ = ["SLOT_FORMAT", "SlotIdentity", "StorageSlot", "host_id", "recorded", "remove_file"]
