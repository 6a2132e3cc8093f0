"""Snapshot storage: partition-aligned, checksummed, fenced, and all-or-nothing.

Layout under the store's URI (a local path, or ``s3://``, ``hdfs://``, ``gs://`` through
``pyarrow.fs``), for job ``J`` (16 hex digits)::

    job-J/log/000000000042.json                events, in order (see below)
    job-J/snapshots/S-eE/VERTEX/W-C.chunks     chunks of writer W's C-th write, by partition
    job-J/snapshots/S-eE/_validation-X.json    the validation record of snapshot S by execution E
                                               (X: its xxh3, so no write can replace it)
    job-J/snapshots/S-eE/_durable.json         durable_tier="async": the members' uploads of
                                               its files are complete (mark_durable)
    job-J/exports/NAME/...                     an exported snapshot (same layout) + _export.json
                                               (on object stores, in exports/NAME/d-X/, X a
                                               random id, which _export.json names)
    job-J/tables/DIGEST.arrow                  a reference table version (Arrow IPC), named by
                                               the xxh3-128 of its bytes (sparkjet.operators.table_join;
                                               storage="members": only durable copies)

**The log is the commit point.** Events are small JSON files named by a sequence number and
created exclusively (a name is taken once, whole): ``register`` (execution E starts) and
``commit`` (execution E's snapshot S is complete, with the xxh3 of its validation record). A
commit counts only if its execution was registered before it and *no newer execution was
registered before it*, so a zombie of an old execution can write and commit all it likes
after a restart: nothing it writes becomes visible. Its data also lives under its own
``S-eE`` directory, so it can never mix with the new execution's files.

**On object stores** the log's exclusive create is, on S3, one conditional put
(``If-None-Match: *``, see ``sparkjet._fs``): of two writers racing for a sequence number
exactly one gets it, as on local disks and HDFS, so fencing and commits hold there too. An
export is not a directory rename there (S3 copies to rename): each export writes its own
folder and the exclusive create of ``_export.json`` naming it is the commit, so of two
exports racing for one name one wins whole and the other raises. GCS and other stores
without a conditional create keep a check-then-write window, and warn.

**Retention** (Jet's two alternating data sets, and more): a directory per snapshot and
execution; the last ``retained`` complete snapshots (2 by default) are kept while the next is
written, and older ones (with their commit events, and leftovers of failed attempts) are
removed only after a newer one is complete. With ``durable_tier="async"`` (members' storage,
``keep_marked``) retention also keeps the snapshots whose upload may still be under way (the
``pinned`` ids of the commit: :mod:`sparkjet.runtime.durable`) and the newest snapshot
marked durable, until a newer one is marked. Exports are never removed by cleanup. A
snapshot's validation record lists the table versions it uses (``tables``); a commit
refuses one whose version is missing (the members' storage keeps them in the storage slots
instead: :mod:`sparkjet.runtime.storage`; here only their durable copies), and removes the
versions that neither a retained snapshot nor an export lists. Versions are written only at barriers, and barrier n + 1
follows the commit of n, so none of them is in flight while a commit removes the others.

**A way back**: :meth:`SnapshotStore.newest_verified` reads every chunk of the newest
complete snapshot and, when it fails (a flipped byte, a missing file, a log event that no
longer reads), of the older retained ones in turn; :meth:`SnapshotStore.rollback` appends a
``rollback`` event, after which the snapshots newer than its target committed before it
no longer count (restore takes the target, and snapshot ids continue from it). Whether a
fallback is *safe* (no sink committed output past the older snapshot) is the runtime's
question (:mod:`sparkjet.runtime.restore`). A log event that does not read is never
skipped silently: reads of "the last snapshot" raise until a rollback event settles it.

**Restore trusts nothing**: the validation record must match the commit's checksum, job,
snapshot and execution; the files of the requested partitions must be exactly those the
record lists; every chunk's header, ids, count and checksum must match. Any mismatch raises
and nothing is returned: never partial state.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec
import pyarrow as pa
import xxhash

from sparkjet._checks import check_int
from sparkjet.errors import (
    FencedError,
    InvalidArgumentError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
    SnapshotNotFoundError,
    SnapshotStoreLostError,
)
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT
from sparkjet.snapshot import layout
from sparkjet.snapshot import records as meta
from sparkjet.snapshot.backend import StorageBackend, open_backend
from sparkjet.snapshot.chunks import (
    DEFAULT_CHUNK_SIZE,
    HEADER_SIZE,
    TableDecoder,
    decode_entries,
)
from sparkjet.snapshot.layout import check_name as _check_name
from sparkjet.snapshot.layout import content_digest
from sparkjet.snapshot.reading import (
    SlotFile,
    check_listing,
    concat_entries,
    concat_tables,
    read_file,
)
from sparkjet.snapshot.records import CommitEvent, RegisterEvent, RollbackEvent, ValidationRecord
from sparkjet.snapshot.writer import Manifest, SnapshotWriter, vertex_id

RECORD_FORMAT = meta.RECORD_FORMAT
_MAX_ID = 2**63 - 1  # snapshot and execution ids: what the log's schema accepts
#: Complete snapshots a job's store keeps by default (``JobConfig.retained_snapshots``).
DEFAULT_RETAINED = 2
#: The most a store keeps (each is a full copy of the job's state).
MAX_RETAINED = 100
#: Durable marks a store remembers having read: more than it retains snapshots of and
#: pins, so a retained snapshot's mark is read from storage once.
_KEPT_MARKS = 4 * MAX_RETAINED


@dataclass(frozen=True)
class SnapshotInfo:
    """A complete snapshot (or an export of one)."""

    job_id: int
    snapshot_id: int
    execution_id: int
    chunk_count: int
    bytes: int
    entries: int
    vertices: tuple[str, ...]
    created: float
    name: str | None = None


@dataclass
class VertexState:
    """What one processor restores: its partitions' keyed state and the broadcast state."""

    table: pa.Table | None = None
    entries: tuple[pa.Array, pa.Array] | None = None
    broadcast_table: pa.Table | None = None
    broadcast_entries: tuple[pa.Array, pa.Array] | None = None
    chunks: int = 0
    bytes_read: int = 0


@dataclass(frozen=True)
class Unusable:
    """A complete snapshot restore cannot use, and why: ``snapshot`` is None for a log
    event that does not read (it may have been the commit of a newer snapshot); ``seq``
    is the log event's sequence number."""

    snapshot: int | None
    reason: str
    seq: int

    def __str__(self) -> str:
        return (f"snapshot {self.snapshot}: {self.reason}" if self.snapshot is not None
                else self.reason)


#: A restore decodes a file's queued table chunks every this many (16 MiB of them): a
#: file fetched from a peer's slot is decoded while the rest streams in.
_DECODE_EVERY = 128


@dataclass(frozen=True)
class _Unreadable:
    """A log event that does not decode (truncated, overwritten): kept in its place."""

    path: str
    error: SnapshotCorruptError


@dataclass(frozen=True)
class _Stored:
    """A checked validation record and where it is: ``dir`` under the job, ``file`` in it."""

    record: ValidationRecord
    dir: tuple[str, ...]
    file: str


class SnapshotStore:
    """The snapshots of one job in one place.

    >>> store = SnapshotStore(tmp_path, job_id=1)          # doctest: +SKIP
    >>> store.register_execution(1)
    >>> w = store.writer(snapshot_id=0, execution_id=1)
    >>> w.write_table("counts", table, key="key")
    >>> store.commit(0, 1, [w.finish()])
    >>> store.restore("counts", partitions=[0, 1, 2]).table
    """

    def __init__(self, uri, job_id: int, *, filesystem=None, durable: bool = True,
                 create: bool = True, name: str | None = None,
                 retained: int = DEFAULT_RETAINED, keep_marked: bool = False):
        """``uri``: a local path or URI, or a :class:`~sparkjet.snapshot.backend.StorageBackend`
        (then ``filesystem`` and ``durable`` are the backend's own business).
        ``create=False`` opens the snapshots of a job that has some, to read them:
        nothing is created, and SnapshotNotFoundError says when the store or the job's
        directory is missing. ``name``: the job's name, for messages (without it, the
        name the job's ``JOB.json`` records, else the id). ``retained``: how many complete
        snapshots a commit keeps (1 to :data:`MAX_RETAINED`). ``keep_marked``
        (``durable_tier="async"``): retention also keeps the newest snapshot marked durable
        (:meth:`mark_durable`) and those a commit pins (their uploads under way)."""
        job_id = check_int("job_id", job_id, min=0, max=2**64 - 1)
        self.retained = check_int("retained", retained, min=1, max=MAX_RETAINED)
        self._backend = (uri if isinstance(uri, StorageBackend)
                         else open_backend(uri, filesystem, durable))
        self.job_id = job_id
        self.name = name
        self._job = layout.job_dir(job_id)
        self._log_lock = threading.Lock()
        self._event_cache: dict[str, tuple] = {}    # log file name -> (stamp, event)
        self._registered: int | None = None  # the newest execution this object registered
        self._cleaner: threading.Thread | None = None
        self._records: dict[tuple[str, str], tuple[int, _Stored]] = {}  # parsed, checked
        # (mark path, record xxh3) of marks read, the newest few (a job runs for months:
        # one entry per snapshot would grow without end)
        self._durable_marks: dict[tuple[str, str], None] = {}
        self.keep_marked = keep_marked
        #: snapshot ids the last commit pinned (uploads under way: kept by retention)
        self._pinned: frozenset[int] = frozenset()
        #: With the members' storage: ``(slot uuids, path) -> SlotFile`` for a chunk file a
        #: record places in storage slots (the one that wrote it, then its replicas; set by
        #: the member that restores; without it such files are not reachable here: verify()
        #: passes over them, restore() refuses)
        self.slot_files: Callable[[list[str], str], SlotFile] | None = None
        if not create:
            _require_store(self._backend)
            if not self._backend.is_dir(self._path()):
                raise SnapshotNotFoundError(
                    f"no snapshots of {self.who} in {self._backend.root}")
            return
        for d in layout.JOB_FOLDERS:
            self._backend.makedirs(self._path(d))

    def __repr__(self) -> str:
        return f"SnapshotStore({self._backend.root!r}, job_id={self.job_id})"

    @property
    def root(self) -> str:
        """What tells this store apart from another (with the job's id, a job from one of
        the same name in another store): a local folder's real path, else its URI without
        credentials (scheme, host, path, endpoint)."""
        return getattr(self._backend, "identity", None) or self._backend.root

    @property
    def who(self) -> str:
        """The job, as messages name it: ``job 'NAME'``, with the id in brackets when the
        name does not derive it (an explicit ``JobConfig.job_id``); ``job ID (0x...)`` when
        the name is unknown."""
        if self.name is None:
            try:
                recorded = json.loads(bytes(self._backend.read(self._path(layout.JOB_RECORD))))
                self.name = recorded.get("name") if isinstance(recorded, dict) else None
            except (OSError, ValueError):
                pass
        if not isinstance(self.name, str):
            self.name = None
            return f"job {self.job_id} ({self.job_id:#x})"
        derived = xxhash.xxh64_intdigest(self.name.encode()) & (2**63 - 1)
        return f"job {self.name!r}" + ("" if derived == self.job_id else f" [{self.job_id:#x}]")

    def close(self) -> None:
        """Waits for the background cleanup."""
        self.wait_for_cleanup()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_for_cleanup(self) -> None:
        """Returns once the removal of snapshots older than the last commit is done."""
        if self._cleaner is not None:
            self._cleaner.join()
            self._cleaner = None

    @staticmethod
    def jobs(uri, *, filesystem=None, must_exist: bool = False) -> list[int]:
        """The job ids that have snapshots under a URI; with ``must_exist``, a URI that is
        not a directory raises SnapshotNotFoundError rather than giving []."""
        backend = uri if isinstance(uri, StorageBackend) else open_backend(uri, filesystem)
        if must_exist:
            _require_store(backend)
        ids = (layout.job_id_of(n) for n in backend.listdir(backend.root))
        return [i for i in ids if i is not None]

    def _path(self, *parts: str) -> str:
        return self._backend.path(self._job, *parts)

    # -- the log -----------------------------------------------------------------------

    def _events(self) -> list[tuple[int, meta.LogEvent | _Unreadable]]:
        """Every log event in order; one that does not decode is an :class:`_Unreadable`
        in its place (see :meth:`_readable`)."""
        out: list = []
        cache, seen = self._event_cache, {}
        for name, stamp in self._backend.listdir_stamped(self._path(layout.LOG)):
            seq = layout.log_sequence(name)
            if seq is None:
                continue
            # Log events are created whole and never rewritten, so one already decoded is
            # taken from the cache while its name, size and time are the same (the fence
            # is checked at every file a writer makes: reading the log each time cost
            # ~0.5 ms per check with 8 events).
            hit = cache.get(name)
            if hit is not None and hit[0] == stamp:
                out.append((seq, hit[1]))
                seen[name] = hit
                continue
            path = self._path(layout.LOG, name)
            try:
                raw = self._backend.read(path)
            except OSError as e:
                # Cleanup removed it between the listing and the read: it was a commit
                # event superseded by a newer valid one, which the listing also holds. (On
                # S3, pyarrow may report an object deleted between its HEAD and its GET as
                # another OSError than FileNotFoundError.)
                if isinstance(e, FileNotFoundError) or not self._backend.exists(path):
                    continue
                raise
            try:
                event = meta.decode(raw, meta.LogEvent, path, "log event")
            except SnapshotCorruptError as e:
                out.append((seq, _Unreadable(path, e)))     # read again next time
                continue
            out.append((seq, event))
            seen[name] = (stamp, event)
        self._event_cache = seen
        return out

    @staticmethod
    def _readable(events):
        """``events``, once no unreadable one is left unsettled (followed by a rollback
        event); otherwise its SnapshotCorruptError: what is "the last snapshot" is not
        known while a log event that may be a newer commit does not read."""
        settled = max((s for s, e in events if isinstance(e, RollbackEvent)), default=-1)
        for seq, e in events:
            if isinstance(e, _Unreadable) and seq > settled:
                raise e.error
        return events

    def _append(self, event: meta.LogEvent, check=None) -> int:
        """Appends an event at the next free sequence number; `check(events)` may refuse."""
        data = meta.encode(event, meta.LogEvent)
        with self._log_lock:
            while True:
                events = self._events()
                if check is not None:
                    check(events)
                seq = events[-1][0] + 1 if events else 0
                if self._backend.create_exclusive(self._path(layout.LOG, layout.log_event(seq)), data):
                    return seq

    @staticmethod
    def _newest_execution(events, before: int | None = None) -> int | None:
        ids = [e.execution for s, e in events
               if isinstance(e, RegisterEvent) and (before is None or s < before)]
        return max(ids) if ids else None

    def register_execution(self, execution_id: int) -> None:
        """Starts execution `execution_id` (the fencing token): from now on, writes and
        commits of every older execution are refused and never become visible."""
        execution_id = check_int("execution_id", execution_id, min=0, max=_MAX_ID)

        def check(events):
            newest = self._newest_possible(events)
            if newest is not None and newest >= execution_id:
                raise FencedError(f"{self.who}: execution {execution_id} is not newer than "
                                  f"registered execution {newest}")

        self._append(RegisterEvent(execution_id, time.time()), check)
        self._registered = execution_id

    def incarnation(self) -> str | None:
        """Which log of the job this is: the first execution it registered and when (None:
        it registered none). A store folder removed and made again starts another, so
        members' storage slots can tell their data of the job from an earlier log's."""
        first = min(((seq, e) for seq, e in self._events() if isinstance(e, RegisterEvent)),
                    default=None, key=lambda x: x[0])
        return None if first is None else f"{first[1].execution}@{first[1].time!r}"

    def current_execution(self) -> int | None:
        """The newest registered execution, or None. Log events that do not read count
        as registrations of the next ids (executions are numbered one after the other), so
        a new execution never takes an id a lost event may have given."""
        return self._newest_possible(self._events())

    @classmethod
    def _newest_possible(cls, events) -> int | None:
        newest, last = None, -1
        for seq, e in events:
            if isinstance(e, RegisterEvent) and (newest is None or e.execution >= newest):
                newest, last = e.execution, seq
        unread = sum(1 for s, e in events if isinstance(e, _Unreadable) and s > last)
        if unread == 0:
            return newest
        return (-1 if newest is None else newest) + unread

    def check_fence(self, execution_id: int) -> None:
        """Raises FencedError if a newer execution than `execution_id` is registered, or
        if `execution_id` was never registered; SnapshotStoreLostError if the log no longer
        holds the execution this store registered (deleted under a running job)."""
        events = self._events()
        newest = self._newest_execution(events)
        if self._registered is not None and (newest is None or newest < self._registered):
            raise SnapshotStoreLostError(
                f"{self.who}: the snapshot log in {self._backend.root} no longer holds execution "
                f"{self._registered}, which this process registered: the job's snapshots were "
                f"deleted (or replaced) while it ran. Nothing written now could be restored or "
                f"fenced, so the job stops; restore the store from a copy, or start the job "
                f"again with a new snapshot store")
        if newest is None or newest > execution_id:
            raise FencedError(f"{self.who}: execution {execution_id} is fenced off by "
                              f"execution {newest}")
        if not any(isinstance(e, RegisterEvent) and e.execution == execution_id
                   for _, e in events):
            raise FencedError(f"{self.who}: execution {execution_id} was never registered")

    def _valid_commits(self, events) -> list[tuple[int, CommitEvent]]:
        """The commits that count, oldest first: by the execution registered last before
        them, and not set aside by a later rollback event. (A commit after a log event that
        no longer reads was checked against it when it was appended.)"""
        valid: list[tuple[int, CommitEvent]] = []
        for seq, e in events:
            if isinstance(e, RollbackEvent):
                valid = [(s, c) for s, c in valid if c.snapshot <= e.snapshot]
            elif isinstance(e, CommitEvent) and \
                    self._newest_execution(events, before=seq) == e.execution:
                valid.append((seq, e))
        return valid

    # -- writing -----------------------------------------------------------------------

    def writer(self, snapshot_id: int, execution_id: int, *, writer: int = 0,
               partition_count: int = DEFAULT_PARTITION_COUNT, chunk_size: int = DEFAULT_CHUNK_SIZE,
               codec: str = "blosc2-lz4", slot=None, replicate=None,
               durable: bool = False) -> SnapshotWriter:
        """A writer of snapshot `snapshot_id` for execution `execution_id`. Several writers
        (members, processors) may write one snapshot; give each a distinct `writer` number.
        ``slot``: the storage slot the chunk files go to (``storage="members"``), and
        ``replicate`` what copies them to the slots that back them, and ``durable``
        whether they are copied into the store too (see SnapshotWriter)."""
        self.check_fence(execution_id)
        return SnapshotWriter(self, snapshot_id, execution_id, writer, partition_count,
                              chunk_size, codec, slot, replicate, durable)

    def _snapshot_dir(self, snapshot_id: int, execution_id: int) -> str:
        return layout.snapshot_dir(snapshot_id, execution_id)

    def commit(self, snapshot_id: int, execution_id: int,
               manifests: Iterable[Manifest], *, table: str | None = None,
               plan: str | None = None, pinned: Iterable[int] = ()) -> SnapshotInfo:
        """Makes a snapshot complete (Jet's phase-1 commit point): writes its validation
        record, then the commit event; then removes older snapshots. Refused with
        FencedError if a newer execution was registered (before or during the commit).
        ``table``: the execution's partition table (base64), and ``plan``: the DAG's
        fingerprint (JSON), kept in a record whose files are in storage slots (format 2).
        ``pinned``: snapshot ids retention keeps besides the last ``retained`` until the
        next commit (``durable_tier="async"``: those whose upload may be under way)."""
        snapshot_id = check_int("snapshot_id", snapshot_id, min=-_MAX_ID - 1, max=_MAX_ID)
        execution_id = check_int("execution_id", execution_id, min=0, max=_MAX_ID)
        directory = self._snapshot_dir(snapshot_id, execution_id)

        def check(events):
            newest = self._newest_execution(events)
            if newest != execution_id:
                raise FencedError(f"{self.who}: commit of snapshot {snapshot_id} by "
                                  f"execution {execution_id} refused: execution {newest} is newer")
            valid = self._valid_commits(events)
            if valid and valid[-1][1].snapshot >= snapshot_id:
                raise InvalidArgumentError(
                    f"{self.who}: snapshot {snapshot_id} is not newer than the last "
                    f"complete snapshot {valid[-1][1].snapshot}; snapshot ids must grow")

        check(self._events())  # fail before writing anything; checked again at the append
        by_vertex: dict[str, list[meta.FileRecord]] = {}
        seen = set()
        tables: set[str] = set()
        for m in manifests:
            tables.update(m.tables)
            if (m.snapshot_id, m.execution_id) != (snapshot_id, execution_id):
                raise InvalidArgumentError(
                    f"manifest of snapshot {m.snapshot_id} execution {m.execution_id} given to "
                    f"the commit of snapshot {snapshot_id} execution {execution_id}")
            for f in meta.convert(m.files, list[meta.FileRecord], "a manifest's files"):
                if f.path in seen:
                    raise InvalidArgumentError(f"chunk file {f.path} in two manifests")
                seen.add(f.path)
                by_vertex.setdefault(f.vertex, []).append(f)
        vertices = {name: meta.VertexRecord(vertex_id(name), by_vertex[name])
                    for name in sorted(by_vertex)}
        ids = [v.id for v in vertices.values()]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("two vertex names share a vertex id; rename one")
        files = [f for v in vertices.values() for f in v.files]
        in_slots = any(f.slot is not None for f in files)
        if in_slots and any(f.slot is None for f in files):
            raise InvalidArgumentError(f"snapshot {snapshot_id}: some chunk files are in "
                                       "storage slots and some in the store")
        record = ValidationRecord(
            format=meta.RECORD_FORMAT_SLOTS if in_slots else RECORD_FORMAT,
            job_id=self.job_id, snapshot_id=snapshot_id,
            execution_id=execution_id, created=time.time(),
            chunk_count=sum(len(f.chunks) for f in files),
            bytes=sum(f.bytes for f in files),
            entries=sum(c.entry_count for f in files for c in f.chunks),
            vertices=vertices, tables=sorted(tables), table=table if in_slots else None,
            plan=plan if in_slots else None)
        for digest in sorted(tables) if not in_slots else ():
            # (the members' storage keeps them in every slot, not here)
            if not self._backend.exists(self._table_path(digest)):
                raise SnapshotIncompleteError(
                    f"{self.who}: snapshot {snapshot_id} uses table version {digest}, "
                    f"which is missing from {self._path('tables')}; refusing to commit")
        data = meta.encode(record, ValidationRecord)
        digest = xxhash.xxh3_64_hexdigest(data)
        # Named by its checksum: a refused or repeated commit can never overwrite the
        # record a valid commit points to.
        record_name = layout.validation_record(digest)
        self._backend.makedirs(self._path(layout.SNAPSHOTS, directory))
        self._backend.write(self._path(layout.SNAPSHOTS, directory, record_name), [data])
        self._backend.sync_dir(self._path(layout.SNAPSHOTS, directory))
        self.wait_for_cleanup()
        self._pinned = frozenset(int(s) for s in pinned)
        self._append(CommitEvent(snapshot_id, execution_id, directory, record_name, digest,
                                 record.created), check)
        self._remove_table_versions(tables | self._retained_tables())
        # The snapshot is complete now; removing the previous one (and freeing its page
        # cache) takes longer than writing it, so it runs in the background.
        self._cleaner = threading.Thread(target=self._cleanup, name="sparkjet-snapshot-cleanup",
                                         daemon=True)
        self._cleaner.start()
        return self._info(record)

    def adopt_record(self, data: bytes) -> SnapshotInfo:
        """Commits a snapshot again from a copy of its validation record (``data``, the
        bytes a storage slot kept at phase 2): what a persistence restart does when this
        job's folder of the store was lost (:mod:`sparkjet.runtime.persistence`). The
        record's execution is registered (unless it is the newest already; this fences
        off every older one, the driver's current execution too), then the record is
        written and its commit appended. FencedError when a newer execution than the
        record's is registered already (its commit would not count)."""
        digest = xxhash.xxh3_64_hexdigest(data)
        record = meta.decode(data, ValidationRecord, "a slot's copy of a record",
                             "validation record")
        if record.job_id != self.job_id:
            raise InvalidArgumentError(f"{self.who}: the record is of job {record.job_id}")
        current = self.current_execution()
        if current is not None and current > record.execution_id:
            raise FencedError(f"{self.who}: cannot commit snapshot {record.snapshot_id} of "
                              f"execution {record.execution_id} again: execution {current} "
                              "is registered")
        if current is None or record.execution_id > current:
            self.register_execution(record.execution_id)
        directory = self._snapshot_dir(record.snapshot_id, record.execution_id)
        name = layout.validation_record(digest)
        self._backend.makedirs(self._path(layout.SNAPSHOTS, directory))
        self._backend.write(self._path(layout.SNAPSHOTS, directory, name), [data])
        self._backend.sync_dir(self._path(layout.SNAPSHOTS, directory))
        self._append(CommitEvent(record.snapshot_id, record.execution_id, directory, name,
                                 digest, record.created))
        return self._info(record)

    def _retained(self, events=None) -> list[tuple[int, CommitEvent]]:
        """The valid commits a commit keeps, oldest first: the last ``retained``; with
        ``keep_marked`` also those the last commit pinned (uploads under way) and the newest
        one marked durable (a restore that needs a durable copy always finds one)."""
        valid = self._valid_commits(self._events() if events is None else events)
        kept = valid[-self.retained:]
        if not self.keep_marked or not kept:
            return kept
        extra = {seq for seq, c in valid[:-self.retained] if c.snapshot in self._pinned}
        for seq, commit in reversed(valid):
            if self._marked(commit):
                extra.add(seq)
                break
        return [(seq, c) for seq, c in valid if seq in extra or seq >= kept[0][0]]

    def _marked(self, commit: CommitEvent) -> bool:
        """Whether the snapshot's folder holds the mark of its uploads (naming its
        record's xxh3: :meth:`mark_durable`)."""
        return self._read_mark((layout.SNAPSHOTS, commit.record), commit.record_xxh3)

    def _read_mark(self, folder: tuple[str, ...], record_xxh3: str) -> bool:
        mark = self._path(*folder, layout.DURABLE_MARK)
        key = (mark, record_xxh3)
        if key in self._durable_marks:
            return True
        # (an outage of the storage raises: it says nothing about the uploads)
        if not self._backend.exists(mark):
            return False
        try:
            doc = json.loads(bytes(self._backend.read(mark)))
        except FileNotFoundError:
            return False    # its folder removed meanwhile
        except ValueError:
            return False    # a mark that does not read counts as none
        if not isinstance(doc, dict) or doc.get("record") != record_xxh3:
            return False
        if len(self._durable_marks) >= _KEPT_MARKS:
            self._durable_marks.pop(next(iter(self._durable_marks)))
        self._durable_marks[key] = None
        return True

    def _retained_tables(self) -> set[str]:
        out: set[str] = set()
        for _, commit in self._retained():
            try:
                out.update(self._record(commit).record.tables)
            except (SnapshotIncompleteError, SnapshotCorruptError):
                continue    # a snapshot that cannot restore needs no table
        return out

    def _cleanup(self) -> None:
        """Removes snapshot directories other than the retained complete ones and the
        newest execution's ongoing ones, and the commit events of snapshots it
        does not keep (rollback events stay: they are small, and say what was set aside)."""
        events = self._events()
        kept = self._retained(events)
        if not kept:
            return
        kept_seqs = {seq for seq, _ in kept}
        first_seq, last = kept[0][0], kept[-1][1]
        # (an async store may keep a snapshot older than the last ``retained``: the valid
        # commits between it and them go)
        dropped = {seq for seq, _ in self._valid_commits(events) if seq not in kept_seqs}
        newest = self._newest_execution(events)
        keep = {c.record for _, c in kept}
        for name in self._backend.listdir(self._path(layout.SNAPSHOTS)):
            m = layout.snapshot_of(name)
            if not m or name in keep:
                continue
            snap, execution = m
            ongoing = execution == newest and snap > last.snapshot
            if not ongoing:
                self._backend.remove_tree(self._path(layout.SNAPSHOTS, name))
        for seq, e in events:
            if isinstance(e, CommitEvent) and (seq < first_seq or seq in dropped):
                self._backend.remove(self._path(layout.LOG, layout.log_event(seq)))
        # Temporaries of appends that died before their link; a live one is seconds old.
        for name in self._backend.listdir(self._path(layout.LOG)):
            path = self._path(layout.LOG, name)
            if layout.is_stale_tmp(name, time.time() - self._backend.mtime(path)):
                self._backend.remove(path)

    # -- reference table versions ------------------------------------------------------

    def _table_path(self, digest: str) -> str:
        if not layout.is_table_digest(digest):
            raise InvalidArgumentError(f"a table version is 32 hex digits, got {digest!r}")
        return self._path(layout.TABLES, layout.table_file(digest))

    def write_table_version(self, data, digest: str, snapshot_id: int | None = None) -> None:
        """Stores a reference table version (Arrow IPC bytes named by
        :func:`content_digest`), whole or not at all; a no-op if it is stored already.
        (``snapshot_id``, the snapshot that will use it, matters to the members' storage,
        :class:`sparkjet.runtime.storage.SlotTables`, not here.)"""
        if content_digest(data) != digest:
            raise InvalidArgumentError(f"table version {digest}: the bytes have another digest")
        path = self._table_path(digest)
        if not self._backend.exists(path):
            self._backend.create_exclusive(path, data)

    def read_table_version(self, digest: str):
        """The Arrow IPC bytes of a stored table version, checked against their name."""
        path = self._table_path(digest)
        if not self._backend.exists(path):
            raise SnapshotIncompleteError(f"{self.who}: table version {path} is missing")
        data = self._backend.read(path)
        if content_digest(data) != digest:
            raise SnapshotCorruptError(path, 0, "table version digest")
        return data

    def _remove_table_versions(self, keep: set[str]) -> None:
        """Removes the table versions that neither the snapshot just committed (``keep``)
        nor an export uses. Synchronous: the next barrier, which may store a new version,
        is sent only after the commit returns."""
        keep = set(keep)
        for name in self._backend.listdir(self._path(layout.EXPORTS)):
            if layout.is_name(name) and not name.startswith(layout.TMP_PREFIX):
                try:
                    keep.update(self._export_record(name).record.tables)
                except (SnapshotNotFoundError, SnapshotIncompleteError, SnapshotCorruptError):
                    continue
        for name in self._backend.listdir(self._path(layout.TABLES)):
            path = self._path(layout.TABLES, name)
            if name.endswith(".arrow") and name[:-6] not in keep:
                self._backend.remove(path)
            elif layout.is_stale_tmp(name, time.time() - self._backend.mtime(path)):
                self._backend.remove(path)

    # -- reading -----------------------------------------------------------------------

    def latest_complete(self) -> SnapshotInfo | None:
        """The last complete snapshot, or None (SnapshotCorruptError while a log event
        that may be a newer commit does not read: see :meth:`newest_verified`)."""
        valid = self._valid_commits(self._readable(self._events()))
        if not valid:
            return None
        return self._info(self._record(valid[-1][1]).record)

    def _record(self, commit: CommitEvent | meta.ExportRecord,
                base: tuple[str, ...] = ()) -> _Stored:
        directory = base or (layout.SNAPSHOTS, commit.record)
        path = self._path(*directory, commit.record_file)
        if not self._backend.exists(path):
            raise SnapshotIncompleteError(f"{path}: validation record missing")
        # A record is named by its checksum and never rewritten: parse and check it once
        # (it lists every chunk, and a member restores several vertices from it).
        cached = self._records.get((path, commit.record_xxh3))
        if cached is not None and self._backend.size(path) == cached[0]:
            return self._durable_view(cached[1], commit.record_xxh3)
        data = bytes(self._backend.read(path))
        if xxhash.xxh3_64_hexdigest(data) != commit.record_xxh3:
            raise SnapshotCorruptError(path, 0, "validation record checksum")
        record = meta.decode(data, ValidationRecord, path, "validation record")
        for key, got, want in (("job_id", record.job_id, self.job_id),
                               ("snapshot_id", record.snapshot_id, commit.snapshot),
                               ("execution_id", record.execution_id, commit.execution)):
            if got != want:
                raise SnapshotIncompleteError(
                    f"{path}: validation record has {key} {got!r}, expected {want!r}")
        stored = _Stored(record, directory, commit.record_file)
        if len(self._records) >= 4:
            self._records.pop(next(iter(self._records)))
        self._records[(path, commit.record_xxh3)] = (len(data), stored)
        return self._durable_view(stored, commit.record_xxh3)

    def _durable_view(self, stored: _Stored, record_xxh3: str) -> _Stored:
        """``stored`` as restore reads it: with ``durable_tier="async"`` the chunk files of
        a snapshot in the members' slots are uploaded into its folder of the store after
        its commit, so its record names no durable copy; once every one is uploaded whole
        the folder holds the driver's mark (:data:`~sparkjet.snapshot.layout.DURABLE_MARK`,
        naming the record's xxh3) and those copies count as a sync copy does. Without the
        mark (an upload not done, failed, or superseded) none of them counts."""
        record = stored.record
        if record.format != meta.RECORD_FORMAT_SLOTS or not any(
                not f.in_store
                for v in record.vertices.values() for f in v.files):
            return stored
        if not self._read_mark(stored.dir, record_xxh3):
            return stored
        return _Stored(with_durable_copies(record), stored.dir, stored.file)

    def durable_complete(self, snapshot_id: int | None = None, *,
                         name: str | None = None) -> bool:
        """Whether the snapshot's (or export's) chunk files in the members' slots all have
        a durable copy in the store: copied before the commit (``durable_tier="sync"``, or
        the terminal snapshot of a stop that exports) or uploaded after it and marked
        (``"async"``, :meth:`mark_durable`). True for a snapshot of the shared store."""
        record = self._resolve(snapshot_id, name).record
        return all(f.in_store
                   for v in record.vertices.values() for f in v.files)

    def mark_durable(self, snapshot_id: int) -> dict:
        """Marks committed snapshot ``snapshot_id`` of the members' storage as held whole
        in the store (``durable_tier="async"``: its members uploaded every chunk file after
        the commit): each file the record places in a slot is checked to be in the
        snapshot's folder at the record's size (every chunk's checksum is checked as a
        restore reads it), then the mark naming the record's xxh3 is written. Returns the
        files and bytes it counted; SnapshotIncompleteError naming the first file missing
        or of another size (nothing is marked), SnapshotNotFoundError when the store no
        longer keeps the snapshot."""
        commit = self._commit_of(snapshot_id)
        stored = self._record(commit)
        files, total = 0, 0
        for vertex, v in stored.record.vertices.items():
            pending = [f for f in v.files if not f.in_store]
            if not pending:
                continue
            folder = self._path(*stored.dir, vertex)
            present = set(self._backend.listdir(folder))
            for f in pending:
                path = f"{folder}/{f.name}"
                size = self._backend.size(path) if f.name in present else None
                if size != f.bytes:
                    raise SnapshotIncompleteError(
                        f"snapshot {snapshot_id} of {self.who}: the durable copy {path} is "
                        + ("missing" if size is None else
                           f"{size} bytes, the record says {f.bytes}")
                        + "; the snapshot is not marked durable")
                files, total = files + 1, total + f.bytes
        if files:
            doc = {"snapshot": snapshot_id, "execution": commit.execution,
                   "record": commit.record_xxh3, "files": files, "bytes": total,
                   "time": time.time()}
            folder = self._path(*stored.dir)
            self._backend.write(f"{folder}/{layout.DURABLE_MARK}",
                                [json.dumps(doc, sort_keys=True).encode()])
            self._backend.sync_dir(folder)
        return {"files": files, "bytes": total}

    def _info(self, r: ValidationRecord, name: str | None = None) -> SnapshotInfo:
        return SnapshotInfo(r.job_id, r.snapshot_id, r.execution_id, r.chunk_count, r.bytes,
                            r.entries, tuple(r.vertices), r.created, name)

    def _resolve(self, snapshot_id: int | None, name: str | None) -> _Stored:
        """The record of export ``name``, of retained snapshot ``snapshot_id``, or (both
        None) of the last complete snapshot."""
        if name is not None:
            return self._export_record(name)
        return self._record(self._commit_of(snapshot_id))

    def _commit_of(self, snapshot_id: int | None) -> CommitEvent:
        events = self._events()
        valid = self._valid_commits(events if snapshot_id is not None else self._readable(events))
        if not valid:
            raise SnapshotNotFoundError(f"{self.who} has no complete snapshot")
        if snapshot_id is None:
            return valid[-1][1]
        for _, commit in valid:
            if commit.snapshot == snapshot_id:
                return commit
        raise SnapshotNotFoundError(
            f"{self.who}: snapshot {snapshot_id} is not a complete snapshot it keeps (it "
            f"keeps {[c.snapshot for _, c in valid]}; JobConfig.retained_snapshots says how "
            f"many); export a snapshot to keep it")

    def complete(self, *, strict: bool = False) -> list[SnapshotInfo]:
        """The complete snapshots the store keeps (and restore may use), oldest first;
        those whose validation record no longer reads are left out (``strict``: raise)."""
        out = []
        for _, commit in self._valid_commits(self._events()):
            try:
                out.append(self._info(self._record(commit).record))
            except (SnapshotIncompleteError, SnapshotCorruptError):
                if strict:
                    raise
        return out

    def newest_verified(self) -> tuple[SnapshotInfo | None, list[Unusable]]:
        """The newest complete snapshot whose every chunk reads and checks (None: none
        does, or there is none), and the newer ones that do not, newest first: snapshots
        that failed to verify (a flipped byte, a missing or truncated file, a validation
        record that does not read), and log events after it that no longer read (each may
        have been the commit of a newer snapshot). Other errors of the storage (a lost
        connection) raise: they say nothing about the snapshot."""
        events = self._events()
        settled = max((s for s, e in events if isinstance(e, RollbackEvent)), default=-1)
        unreadable = [Unusable(None, f"log event {e.path} does not read ({e.error}); it may be "
                                     f"the commit of a newer snapshot", seq)
                      for seq, e in events if isinstance(e, _Unreadable) and seq > settled]
        failed: list[Unusable] = []
        for seq, commit in reversed(self._valid_commits(events)):
            try:
                info = self.verify(commit.snapshot)
            except (SnapshotCorruptError, SnapshotIncompleteError, FileNotFoundError) as e:
                failed.append(Unusable(commit.snapshot, f"{type(e).__name__}: {e}", seq))
                continue
            newer = failed + [u for u in unreadable if u.seq > seq]
            return info, sorted(newer, key=lambda u: u.seq, reverse=True)
        return None, sorted(failed + unreadable, key=lambda u: u.seq, reverse=True)

    def newest_commit(self) -> int | None:
        """The newest complete snapshot by the log alone, not read (None: there is none,
        or a log event after it does not read and may be a newer commit, which only
        :meth:`newest_verified` can weigh). A restore that reads all of it checks every
        chunk it reads as :meth:`verify` does, so a start may restore this one at once and
        fall back through :meth:`newest_verified` only when that fails: one read of the
        state instead of two."""
        events = self._events()
        valid = self._valid_commits(events)
        if not valid:
            return None
        seq, commit = valid[-1]
        if any(isinstance(e, _Unreadable) and s > seq for s, e in events):
            return None
        return commit.snapshot

    def rollbacks(self) -> list[int]:
        """The snapshot ids the log's rollback events went back to, oldest first."""
        return [e.snapshot for _, e in self._events() if isinstance(e, RollbackEvent)]

    def rollback(self, snapshot_id: int, *, reason: str,
                 execution_id: int | None = None) -> list[int]:
        """Sets aside every complete snapshot newer than ``snapshot_id`` (a complete one
        the store keeps): restore takes ``snapshot_id`` from now on, and snapshot ids go on
        from it. Returns the ids set aside. ``execution_id``: the execution doing it (a
        restore), refused with FencedError if a newer one is registered; without one (an
        operator's rollback) a new execution is registered first, so that no execution
        that ran before the rollback can commit after it. Settles the log events before
        it that do not read."""
        snapshot_id = check_int("snapshot_id", snapshot_id, min=-_MAX_ID - 1, max=_MAX_ID)
        if execution_id is None:
            newest = self.current_execution()
            self.register_execution(0 if newest is None else newest + 1)
            execution_id = self._registered
        replaced: list[int] = []

        def check(events):
            newest = self._newest_possible(events)
            if newest != execution_id:
                raise FencedError(f"{self.who}: rollback to snapshot {snapshot_id} by "
                                  f"execution {execution_id} refused: execution {newest} is "
                                  f"newer")
            ids = [c.snapshot for _, c in self._valid_commits(events)]
            if snapshot_id not in ids:
                raise SnapshotNotFoundError(
                    f"{self.who}: cannot roll back to snapshot {snapshot_id}: it is not a "
                    f"complete snapshot the store keeps (it keeps {ids or 'none'})")
            replaced[:] = [i for i in ids if i > snapshot_id]

        check(self._events())
        self.verify(snapshot_id)
        self._append(RollbackEvent(snapshot_id, list(replaced), reason, time.time()), check)
        return list(replaced)

    def restore(self, vertex: str, partitions: Sequence[int] | None = None, *,
                snapshot_id: int | None = None, name: str | None = None) -> VertexState:
        """The state of `vertex` in `partitions` (all when None) plus its broadcast state,
        from the last complete snapshot (or the exported snapshot `name`). Reads only the
        byte ranges of those partitions' chunks; refuses the whole restore on any mismatch."""
        stored = self._resolve(snapshot_id, name)
        v = stored.record.vertices.get(vertex)
        if v is None:
            raise SnapshotNotFoundError(
                f"snapshot {stored.record.snapshot_id} of {self.who} has no vertex "
                f"{vertex!r}; it has {sorted(stored.record.vertices)}")
        wanted = None if partitions is None else set(int(p) for p in partitions)
        check_listing(self, stored, vertex, v)
        state = VertexState()
        keyed_entries, broadcast_entries = [], []
        # the chunks' schema parsed once, not once per chunk, and a file's table chunks
        # decoded together
        keyed, broadcast = TableDecoder(), TableDecoder()
        keyed_tables, broadcast_tables = [], []
        for f in v.files:
            for header, payload, path, offset in read_file(self, stored, vertex, v.id, f, wanted):
                state.chunks += 1
                state.bytes_read += HEADER_SIZE + header.stored_size
                if header.entries:
                    kv = decode_entries(header, payload, path, offset)
                    (broadcast_entries if header.broadcast else keyed_entries).append(kv)
                else:
                    (broadcast if header.broadcast else keyed).add(header, payload, path, offset)
                    if keyed.queued >= _DECODE_EVERY:   # decoded while the next chunks arrive
                        keyed_tables += keyed.tables()
            keyed_tables += keyed.tables()
            broadcast_tables += broadcast.tables()
        where = self._path(*stored.dir, vertex)
        state.table = concat_tables(keyed_tables, where)
        state.broadcast_table = concat_tables(broadcast_tables, where)
        state.entries = concat_entries(keyed_entries)
        state.broadcast_entries = concat_entries(broadcast_entries)
        return state

    def committed_record(self, snapshot_id: int | None = None, *,
                         name: str | None = None) -> tuple[bytes, tuple[str, ...], str]:
        """The validation record of a complete snapshot (or export ``name``) as committed:
        its bytes (checked against the commit's xxh3), its folder under the job and its
        file name, which a :class:`RecordView` reads the snapshot by (what the driver hands
        the members of the members' storage, which never open the store)."""
        stored = self._resolve(snapshot_id, name)
        path = self._path(*stored.dir, stored.file)
        data = bytes(self._backend.read(path))
        if layout.validation_record(xxhash.xxh3_64_hexdigest(data)) != stored.file:
            raise SnapshotCorruptError(path, 0, "validation record checksum")
        return data, stored.dir, stored.file

    def recorded_plan(self, snapshot_id: int | None = None, *,
                      name: str | None = None) -> str | None:
        """The DAG fingerprint (JSON) a format-2 record keeps (None: the record has none,
        and the plan's entry is read from the snapshot)."""
        return self._resolve(snapshot_id, name).record.plan

    def verify(self, snapshot_id: int | None = None, *, name: str | None = None,
               progress=None) -> SnapshotInfo:
        """Reads and checks every chunk of a snapshot (all vertices and partitions);
        `progress(done_bytes, total_bytes)` is called as it goes."""
        stored = self._resolve(snapshot_id, name)
        done = 0
        for vertex, v in stored.record.vertices.items():
            check_listing(self, stored, vertex, v)
            decoder = TableDecoder()
            for f in v.files:
                if f.slot is not None and self.slot_files is None and not f.durable:
                    continue    # checked where its slot is read, at restore
                for header, payload, path, offset in read_file(self, stored, vertex, v.id, f):
                    if header.entries:
                        decode_entries(header, payload, path, offset)
                    else:
                        decoder.add(header, payload, path, offset)
                    done += HEADER_SIZE + header.stored_size
                    if progress:
                        progress(done, stored.record.bytes)
                decoder.tables()
        return self._info(stored.record, name)

    def unverifiable(self, snapshot_id: int | None = None, *, name: str | None = None) -> int:
        """How many chunk files of a snapshot :meth:`verify` cannot read here: those in the
        members' storage slots (``storage="members"``) with no durable copy in the store,
        which a restore checks as it reads them."""
        stored = self._resolve(snapshot_id, name)
        return sum(1 for v in stored.record.vertices.values() for f in v.files
                   if f.slot is not None and self.slot_files is None and not f.durable)

    def describe(self, snapshot_id: int | None = None, *, name: str | None = None) -> dict:
        """Per vertex and partition (-1: broadcast): bytes, chunks and entries, from the
        validation record."""
        stored = self._resolve(snapshot_id, name)
        out = {}
        for vertex, v in stored.record.vertices.items():
            parts = defaultdict(lambda: {"bytes": 0, "chunks": 0, "entries": 0})
            for f in v.files:
                for c in f.chunks:
                    p = parts[c.partition]
                    p["bytes"] += HEADER_SIZE + c.stored_size
                    p["chunks"] += 1
                    p["entries"] += c.entry_count
            out[vertex] = dict(sorted(parts.items()))
        return out

    # -- exports -----------------------------------------------------------------------

    def export(self, snapshot_id: int | None, name: str) -> SnapshotInfo:
        """Keeps a complete snapshot under `name` (Jet's exported snapshots, Flink's
        savepoints): cleanup never removes it, and restore(name=...) reads it. Of two
        exports racing for one name, one wins and the other raises InvalidArgumentError."""
        _check_name("export name", name)
        b = self._backend
        final = self._path(layout.EXPORTS, name)
        marker = f"{final}/{layout.EXPORT_RECORD}"
        if b.exists(marker if not b.atomic_rename else final):
            raise InvalidArgumentError(f"export {name!r} of {self.who} already exists")
        stored = self._resolve(snapshot_id, None)
        if any(not f.in_store
               for v in stored.record.vertices.values() for f in v.files):
            raise InvalidArgumentError(
                f"snapshot {stored.record.snapshot_id} of {self.who} is in the members' storage "
                "slots (storage=\"members\") without a durable copy: an export needs the "
                "files in the store. Export while the job runs with Job.stop(snapshot=NAME) "
                "(its members copy the terminal snapshot into the store), run it with "
                "JobConfig(durable_tier=\"sync\") or storage=\"shared\", or, with "
                "durable_tier=\"async\", export a snapshot whose upload is complete (the "
                "\"durable\" progress event names them)")
        self.verify(stored.record.snapshot_id)
        if b.atomic_rename:
            # The files go to a temporary directory whose rename (refused once the name
            # exists) is the commit.
            data_dir, base = None, self._path(layout.EXPORTS, f"{layout.TMP_PREFIX}{name}")
            b.remove_tree(base)
        else:
            # Object stores copy a directory to rename it: each export writes its own
            # folder, and the exclusive create of _export.json naming it is the commit;
            # readers follow only that record.
            data_dir = f"d-{uuid.uuid4().hex[:16]}"
            base = f"{final}/{data_dir}"
        try:
            for vertex, v in stored.record.vertices.items():
                b.makedirs(f"{base}/{vertex}")
                for f in v.files:
                    b.link_or_copy(self._path(*stored.dir, vertex, f.name),
                                   f"{base}/{vertex}/{f.name}")
            data = bytes(b.read(self._path(*stored.dir, stored.file)))
            b.write(f"{base}/{stored.file}", [data])
            mark = self._path(*stored.dir, layout.DURABLE_MARK)
            if b.exists(mark):      # the async tier's uploads count in the export too
                b.write(f"{base}/{layout.DURABLE_MARK}", [bytes(b.read(mark))])
        except OSError:
            # On an object store, an export that won the race for this name meanwhile
            # removes the folders of the others.
            if b.atomic_rename or not b.exists(marker):
                raise
            b.remove_tree(base)
            raise InvalidArgumentError(f"export {name!r} of {self.who} already exists") from None
        export = meta.encode(meta.ExportRecord(
            name, stored.record.snapshot_id, stored.record.execution_id, stored.file,
            xxhash.xxh3_64_hexdigest(data), time.time(), data_dir), meta.ExportRecord)
        if b.atomic_rename:
            b.write(f"{base}/{layout.EXPORT_RECORD}", [export])
            b.rename_dir(base, final)
        elif not b.create_exclusive(marker, export):
            b.remove_tree(base)
            raise InvalidArgumentError(f"export {name!r} of {self.who} already exists")
        else:
            # Folders of exports that lost the race or died before their record.
            for other in b.listdir(final):
                if other.startswith("d-") and other != data_dir:
                    b.remove_tree(f"{final}/{other}")
        return self._info(stored.record, name)

    def _export_record(self, name: str) -> _Stored:
        _check_name("export name", name)
        meta_path = self._path(layout.EXPORTS, name, layout.EXPORT_RECORD)
        if not self._backend.exists(meta_path):
            raise SnapshotNotFoundError(f"{self.who} has no exported snapshot {name!r}")
        export = meta.decode(bytes(self._backend.read(meta_path)), meta.ExportRecord, meta_path,
                             "export record")
        base = (layout.EXPORTS, name) if export.data is None else (layout.EXPORTS, name, export.data)
        return self._record(export, base)

    def delete_export(self, name: str) -> None:
        self._export_record(name)
        # The record first: a reader then finds no export rather than a part of one.
        self._backend.remove(self._path(layout.EXPORTS, name, layout.EXPORT_RECORD))
        self._backend.remove_tree(self._path(layout.EXPORTS, name))

    def snapshots(self) -> list[SnapshotInfo]:
        """The complete snapshots the store keeps and every export, oldest first."""
        self._readable(self._events())
        out = self.complete(strict=True)
        for name in self._backend.listdir(self._path(layout.EXPORTS)):
            if layout.is_name(name) and not name.startswith(layout.TMP_PREFIX):
                try:
                    stored = self._export_record(name)
                except SnapshotNotFoundError:
                    continue    # on an object store: the folder of an export that died
                out.append(self._info(stored.record, name))
        return sorted(out, key=lambda s: (s.created, s.name or ""))


class RecordView(SnapshotStore):
    """One committed snapshot read from its validation record alone, without the store's
    log: what a member of the members' storage (``storage="members"``) restores from. The
    driver, the one process that opens ``snapshot_store``, hands it the record's bytes
    (:meth:`SnapshotStore.committed_record`); the chunk files come through ``slot_files``
    (the member's slot, a peer's), and the files the record places in the store (durable
    copies, exports) through ``backend``, which on a member reads them from the driver.
    Only :meth:`restore`, :meth:`recorded_plan` and :meth:`describe` of that one snapshot
    work; what needs the log raises."""

    def __init__(self, job_id: int, record: bytes, directory: Sequence[str], file: str, *,
                 name: str | None = None, backend: StorageBackend | None = None,
                 durable: bool = False):
        self.job_id = check_int("job_id", job_id, min=0, max=2**64 - 1)
        self.retained = DEFAULT_RETAINED
        self._backend = backend
        self.name = name
        self._job = layout.job_dir(self.job_id)
        self._log_lock = threading.Lock()
        self._event_cache: dict[str, tuple] = {}
        self._registered = None
        self._cleaner = None
        self._records = {}
        self._durable_marks = {}
        self.slot_files = None
        directory = tuple(directory)
        where = "/".join((*directory, file))
        if layout.validation_record(xxhash.xxh3_64_hexdigest(record)) != file:
            raise SnapshotCorruptError(where, 0, "validation record checksum")
        parsed = meta.decode(record, ValidationRecord, where, "validation record")
        if parsed.job_id != self.job_id:
            raise SnapshotIncompleteError(f"{where}: validation record has job_id "
                                          f"{parsed.job_id!r}, expected {self.job_id!r}")
        if durable:     # the driver found the async tier's uploads complete (its mark)
            parsed = with_durable_copies(parsed)
        self._stored = _Stored(parsed, directory, file)
        self.export_name = directory[1] if directory[0] == layout.EXPORTS else None

    def __repr__(self) -> str:
        return (f"RecordView(job_id={self.job_id}, snapshot "
                f"{self._stored.record.snapshot_id})")

    @property
    def who(self) -> str:
        if isinstance(self.name, str):
            return super().who
        return f"job {self.job_id} ({self.job_id:#x})"

    @property
    def snapshot_id(self) -> int:
        return self._stored.record.snapshot_id

    def _path(self, *parts: str) -> str:
        if self._backend is None:
            return "/".join((self._job, *parts))
        return self._backend.path(self._job, *parts)

    def _resolve(self, snapshot_id: int | None, name: str | None) -> _Stored:
        record = self._stored.record
        if (name is not None and name != self.export_name) or \
                (snapshot_id is not None and snapshot_id != record.snapshot_id):
            raise SnapshotNotFoundError(
                f"{self.who}: only snapshot {record.snapshot_id}"
                f"{'' if self.export_name is None else f' (export {self.export_name!r})'} is "
                f"readable here, not {name if name is not None else snapshot_id!r}")
        if self._backend is None and any(f.slot is None or (f.durable and self.slot_files is None)
                                         for v in record.vertices.values() for f in v.files):
            raise SnapshotIncompleteError(
                f"snapshot {record.snapshot_id} of {self.who}: some chunk files are in "
                f"snapshot_store only, which this view has no way to read")
        return self._stored

    def _events(self):
        raise InvalidArgumentError(f"{self!r} reads one snapshot from its record: it has no "
                                   "log (only the driver opens snapshot_store)")

    def check_fence(self, execution_id: int) -> None:
        self._events()

    def close(self) -> None:
        pass


def with_durable_copies(record: ValidationRecord) -> ValidationRecord:
    """``record`` with every chunk file in a slot counted as having its durable copy."""
    vertices = {name: msgspec.structs.replace(v, files=[
        msgspec.structs.replace(f, durable=True) if f.slot is not None else f
        for f in v.files]) for name, v in record.vertices.items()}
    return msgspec.structs.replace(record, vertices=vertices)


def _require_store(backend: StorageBackend) -> None:
    if not backend.is_dir(backend.root):
        what = "is not a directory" if backend.exists(backend.root) else "does not exist"
        raise SnapshotNotFoundError(f"{backend.root} {what}")


__all__ = ["DEFAULT_RETAINED", "MAX_RETAINED", "Manifest", "RecordView", "SnapshotInfo",
           "SnapshotStore",
           "SnapshotWriter", "Unusable", "VertexState", "content_digest",
           "with_durable_copies"]
