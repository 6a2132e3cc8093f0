"""A transactional (two-phase commit) Parquet or Arrow IPC file sink on ``pyarrow.fs``.

Layout under the sink's URI (a local path, or any ``pyarrow.fs`` URI), for job ``J``
(16 hex digits), processor ``P``, execution ``E``, the writer's transaction ordinal ``T``
in that execution and file ``K`` of the transaction::

    part-J-pP-eE-tT-K.parquet                committed output (the only files readers see)
    _staging/J/pP/eE-tT-K.parquet            staged: written, not visible
    _executions/J/eE.json                    execution E registered (created exclusively)
    _committed/J/pP-eE-tT.json               on object stores only: transaction T committed
                                             (created exclusively; see below)

**Transactions.** A processor's open transaction is a set of staged files (one, or one per
``rows_per_file`` rows). :meth:`prepare` closes them (fsync on local disks) and returns a
description naming each staged file and its final name; the runtime saves it in the
snapshot. :meth:`commit` moves the staged files of snapshots up to *n* to their final names
by rename (atomic on local disks and HDFS). Names are a function of the transaction id, so
a commit repeated or retried after a crash finds either the staged file (rename it) or the
final one (done), and two transactions can never target one name. Until committed, a
prepared transaction stays in every later :meth:`prepare` result, so a restore from any
later snapshot still commits it.

**Bounded leftovers.** A processor has at most one open transaction plus the prepared ones
not yet committed, all under ``_staging/J/pP`` with names derived from the execution and
ordinal (on object stores, and the writer's token): :meth:`recover` commits what the restored snapshot lists and
deletes everything else it finds there by listing: leftovers of crashed executions and
prepared transactions of snapshots that never completed.

**Fencing.** Opening a writer registers its execution under ``_executions/J`` by exclusive
create. :meth:`prepare` and :meth:`commit` list that folder and raise
:class:`~sparkjet.errors.FencedError` if a newer execution is registered, so a zombie of an
older execution is refused at its next check. The check and the rename are two steps: a
zombie that passed the check just before a newer execution registered can still rename
what it was committing. With exactly-once that is harmless (it only commits transactions of
complete snapshots, which the new execution's recovery would commit too); with guarantee
"none" a file rolled in that window can appear.

**Object stores** (S3, GCS) have no atomic rename, so there the commit point of a
transaction is one exclusive create (on S3 a conditional ``PUT``, which two racing writers
cannot both pass) of a small marker, ``_committed/J/pP-eE-tT.json``, naming the writer and
the files; the files are then copied to their final names. Staged names carry the writer's
token (``eE-tT-K-TOKEN``), so of two writers given one processor and execution (a duplicated
task) exactly one commits each transaction, whole, and the other gets FencedError. Only
a marker's winner copies files to final names, so every ``part-*`` file is committed;
:meth:`TransactionalFileSink.read` and :meth:`~TransactionalFileSink.committed_files` also
read the markers of transactions still staged and take a committed file whose copy is
under way from where it was staged, so they never see part of a transaction. A plain
listing of ``part-*`` files (Spark, ``pyarrow.dataset``) sees a transaction's files appear
one by one during its commit, each whole, never one that was not committed. Markers are
never removed (a late second writer must still find the first one's): one small object
per transaction and processor. With guarantee "none" each rolled file has its own marker
(``pP-eE-tT-K.json``).

Readers see only ``part-*`` files; names starting with ``_`` or ``.`` are ignored by
:meth:`TransactionalFileSink.read`, by ``pyarrow.dataset`` and by Spark alike. A
transaction of several files becomes visible file by file; a crash in the middle of a
commit leaves a snapshot's transaction partly visible until :meth:`recover` finishes it
(never anything uncommitted, never a partial file). Object stores copy then delete: a
reader may briefly see a file both staged and final, but the final file is complete once it
appears.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from dataclasses import KW_ONLY, dataclass
from typing import Literal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sparkjet._batches import record_batches
from sparkjet._fs import Backend, absolute, storage_error
from sparkjet.connectors._prepared import check_next_snapshot, prepared_transactions
from sparkjet.connectors._settings import FileSystem, Path, PositiveInt, Settings
from sparkjet.connectors.base import GUARANTEES, ProcessorContext, Sink, SinkWriter
from sparkjet.errors import FencedError, InvalidArgumentError, SnapshotIncompleteError

DESCRIPTION_FORMAT = 1
FORMATS = ("parquet", "arrow")
_STAGED = re.compile(
    r"_staging/[0-9a-f]{16}/p\d{5,}/e\d{12,}-t\d{6,}-\d{5,}(?:-[0-9a-f]{16})?\.(?:parquet|arrow)")
_FINAL = re.compile(r"part-[0-9a-f]{16}-p\d{5,}-e\d{12,}-t\d{6,}-\d{5,}\.(?:parquet|arrow)")
_REGISTERED = re.compile(r"e(\d{12,})\.json")
_STAGED_PARTS = re.compile(
    r"_staging/([0-9a-f]{16})/p(\d{5,})/e(\d{12,})-t(\d{6,})-(\d{5,})-[0-9a-f]{16}\.(?:parquet|arrow)")


@dataclass(frozen=True)
class TransactionalFileSinkSettings(Settings):
    """:class:`TransactionalFileSink`'s arguments, checked (see
    :mod:`sparkjet.connectors._settings`)."""

    uri: Path
    format: Literal["parquet", "arrow"] = "parquet"     # FORMATS
    rows_per_file: PositiveInt | None = None
    _: KW_ONLY
    filesystem: FileSystem | None = None
    durable: bool = True

    def check(self) -> None:
        self._derive("uri", absolute(self.uri, self.filesystem))


class TransactionalFileSink(Sink):
    """Writes Parquet or Arrow IPC files, visible only once the snapshot covering them is
    complete (exactly-once with a replayable source).

    >>> sink = TransactionalFileSink("/data/out", format="parquet", rows_per_file=1_000_000)
    >>> table = TransactionalFileSink.read("/data/out")      # doctest: +SKIP
    """

    name = "files"
    transactional = True

    def __init__(self, uri, format: str = "parquet", rows_per_file: int | None = None, *,
                 filesystem: pafs.FileSystem | None = None, durable: bool = True):
        TransactionalFileSinkSettings.of(locals()).apply(self)

    def __repr__(self) -> str:
        return (f"TransactionalFileSink({self.uri!r}, format={self.format!r}, "
                f"rows_per_file={self.rows_per_file!r})")

    def open(self, context: ProcessorContext) -> TransactionalFileWriter:
        return TransactionalFileWriter(self, context)

    @staticmethod
    def committed_files(uri, *, filesystem: pafs.FileSystem | None = None) -> list[str]:
        """The paths of the committed output files, sorted by final name. On object stores
        a transaction whose marker is written but whose files are still being copied to
        their final names (see the module doc) is read where it was staged, so the result
        never holds part of a transaction."""
        backend = Backend(uri, filesystem)
        finals = [n for n in backend.listdir(backend.root) if _FINAL.fullmatch(n)]
        files = {n: backend.path(n) for n in finals}
        if not backend.atomic_rename:
            # Only a marker's winner copies files to final names, so every final file is
            # committed; the markers to read are those of transactions still staged.
            for marker in sorted(_staged_markers(backend)):
                if not backend.exists(marker):
                    continue    # prepared, not committed
                for staged, final in json.loads(bytes(backend.read(marker)))["files"]:
                    if final not in files:
                        files[final] = _committed_path(backend, staged, final)
        return [files[final] for final in sorted(files)]

    @staticmethod
    def read(uri, *, filesystem: pafs.FileSystem | None = None,
             columns: list[str] | None = None) -> pa.Table:
        """The committed rows under `uri` as one table (staged files are never read). An
        empty output gives a table without columns."""
        backend = Backend(uri, filesystem)
        tables = []
        for path in TransactionalFileSink.committed_files(uri, filesystem=filesystem):
            if path.endswith(".parquet"):
                tables.append(pq.read_table(path, columns=columns, filesystem=backend.fs))
            else:
                with backend.fs.open_input_file(path) as f:
                    table = pa.ipc.open_file(f).read_all()
                tables.append(table.select(columns) if columns is not None else table)
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="default")


def _staged_markers(backend: Backend) -> set[str]:
    """The paths the commit markers of the staged files' transactions have."""
    infos = backend.fs.get_file_info(
        pafs.FileSelector(backend.path("_staging"), recursive=True, allow_not_found=True))
    out = set()
    for info in infos:
        rel = info.path[len(backend.root) + 1:]
        m = _STAGED_PARTS.fullmatch(rel)
        if m:
            job, processor, execution, ordinal, index = m.groups()
            txn = f"p{processor}-e{execution}-t{ordinal}"
            # With guarantee "none" each rolled file has its own marker.
            for name in (f"{txn}.json", f"{txn}-{index}.json"):
                out.add(backend.path("_committed", job, name))
    return out


def _committed_path(backend: Backend, staged: str, final: str) -> str:
    """Where a committed file not listed at its final name is: still staged, or copied
    there since the listing."""
    for rel in (staged, final):
        if backend.exists(backend.path(rel)):
            return backend.path(rel)
    raise SnapshotIncompleteError(
        f"{backend.root}: committed file {final} is neither staged as {staged} nor at its "
        "final name; the transaction's data is gone")


class _StagedFile:
    """One staged output file being written."""

    def __init__(self, backend: Backend, path: str, fmt: str, schema: pa.Schema):
        self.schema = schema
        self.rows = 0
        self.path = path
        try:
            if backend.local:
                # "x": two writers given the same processor and execution fail loudly here
                # instead of overwriting each other.
                self._file = open(path, "xb")
                self._stream = None
                sink = self._file
            else:
                self._file = None
                self._stream = backend.fs.open_output_stream(path)
                sink = self._stream
        except OSError as e:
            raise storage_error("create", path, e) from None
        try:
            if fmt == "parquet":
                self._writer = pq.ParquetWriter(sink, schema)
            else:
                self._writer = pa.ipc.new_file(sink, schema)
        except BaseException as e:
            self._release()
            if isinstance(e, OSError):
                raise storage_error("write", path, e) from None
            raise

    def write(self, batch: pa.RecordBatch) -> None:
        try:
            self._writer.write_batch(batch)
        except OSError as e:
            raise storage_error("write", self.path, e) from None
        self.rows += batch.num_rows

    def close(self, durable: bool) -> None:
        """Writes the footer and makes the bytes durable."""
        try:
            self._writer.close()
            if self._file is not None:
                self._file.flush()
                if durable:
                    os.fsync(self._file.fileno())
        except OSError as e:
            try:
                self._release()
            except OSError:
                pass    # the same failure again: the first one says it
            raise storage_error("write", self.path, e) from None
        self._release()

    def _release(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._stream is not None:
            self._stream.close()

    def discard(self) -> None:
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001, S110 - the file is deleted next; only release it
            pass
        try:
            self._release()
        except OSError:     # noqa: S110
            # a full disk fails the flush of the file's last buffer (the file is closed all
            # the same): it is deleted next, and the error that made the writer discard it
            # is the one to report, not this bare OSError without a path
            pass


class TransactionalFileWriter(SinkWriter):
    """One processor's writer of a :class:`TransactionalFileSink` (see the module doc)."""

    def __init__(self, sink: TransactionalFileSink, context: ProcessorContext):
        if context.guarantee not in GUARANTEES:
            raise InvalidArgumentError(
                f"guarantee must be one of {GUARANTEES}, got {context.guarantee!r}")
        self.sink = sink
        self.context = context
        self._backend = Backend(sink.uri, sink.filesystem, sink.durable)
        self._job = f"{context.job_id:016x}"
        self._ext = "parquet" if sink.format == "parquet" else "arrow"
        b = self._backend
        self._registry = b.path("_executions", self._job)
        self._staging_rel = f"_staging/{self._job}/p{context.processor:05d}"
        for d in (b.root, self._registry, b.path(self._staging_rel)):
            b.makedirs(d)
        self._register()
        # On object stores, staged names carry this writer's token, so two writers given
        # one processor and execution cannot overwrite each other's staged files (a local
        # disk refuses the second one's file instead) and a commit marker names its writer.
        self._token = None if b.atomic_rename else uuid.uuid4().hex[:16]
        if self._token is not None:
            b.makedirs(b.path("_committed", self._job))
        self._ordinal = 0           # the next transaction's T
        self._files: list[list[str]] = []   # [staged, final] of the open transaction
        self._rows = 0
        self._current: _StagedFile | None = None
        self._pending: list[dict] = []      # prepared, not yet committed
        self._pending_lock = threading.Lock()   # commit may run beside the next writes
        self._last_prepared: int | None = None

    def __repr__(self) -> str:
        c = self.context
        return (f"TransactionalFileWriter({self.sink.uri!r}, job={c.job_id}, "
                f"execution={c.execution_id}, processor={c.processor})")

    # -- fencing -----------------------------------------------------------------------

    def _register(self) -> None:
        b, execution = self._backend, self.context.execution_id
        path = f"{self._registry}/e{execution:012d}.json"
        if not b.exists(path):
            record = {"execution": execution, "time": time.time()}
            b.create_exclusive(path, json.dumps(record).encode())
        self._check_fence("start")

    def _check_fence(self, action: str) -> None:
        newest = max((int(m[1]) for n in self._backend.listdir(self._registry)
                      if (m := _REGISTERED.fullmatch(n))), default=-1)
        if newest > self.context.execution_id:
            raise FencedError(
                f"{self.sink.uri}: {action} by execution {self.context.execution_id} of "
                f"{self.context.job} refused: execution {newest} is newer")

    # -- writing -----------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch) -> None:
        for b in record_batches(batch):
            self._write(b)

    def _write(self, batch: pa.RecordBatch) -> None:
        limit = self.sink.rows_per_file
        offset, n = 0, batch.num_rows
        while offset < n:
            if self._current is not None and not self._current.schema.equals(batch.schema):
                self._roll()
            if self._current is None:
                self._open_file(batch.schema)
            take = n - offset if limit is None else min(n - offset, limit - self._current.rows)
            self._current.write(batch.slice(offset, take) if take < n else batch)
            offset += take
            if limit is not None and self._current.rows >= limit:
                self._roll()

    def _open_file(self, schema: pa.Schema) -> None:
        c, k = self.context, len(self._files)
        stem = f"e{c.execution_id:012d}-t{self._ordinal:06d}-{k:05d}"
        token = "" if self._token is None else f"-{self._token}"
        staged = f"{self._staging_rel}/{stem}{token}.{self._ext}"
        final = f"part-{self._job}-p{c.processor:05d}-{stem}.{self._ext}"
        self._current = _StagedFile(self._backend, self._backend.path(staged), self.sink.format,
                                    schema)
        self._files.append([staged, final])

    def _roll(self) -> None:
        """Closes the open file; with guarantee "none" it becomes visible at once."""
        self._current.close(self._backend.durable)
        self._rows += self._current.rows
        self._current = None
        if self.context.guarantee == "none":
            self._check_fence("commit")
            if self._token is not None:
                self._mark_committed(f"-{len(self._files) - 1:05d}", self._token,
                                     [self._files[-1]])
            self._move(*self._files[-1])
            self._backend.sync_dir(self._backend.root)

    def _end_transaction(self, snapshot_id: int | None) -> dict | None:
        """Closes the open transaction and returns its description (None if empty)."""
        if self._current is not None:
            self._roll()
        txn = None
        if self._files:
            c = self.context
            txn = {"job": c.job_id, "processor": c.processor, "execution": c.execution_id,
                   "transaction": self._ordinal, "snapshot": snapshot_id,
                   "files": self._files, "rows": self._rows}
            if self._token is not None:
                txn["writer"] = self._token
            self._backend.sync_dir(self._backend.path(self._staging_rel))
        self._files, self._rows = [], 0
        self._ordinal += 1
        return txn

    def prepare(self, snapshot_id: int) -> dict:
        """Ends the open transaction. Returns ``{"format": 1, "transactions": [...]}``: every
        prepared, not yet committed transaction of this writer (each with its snapshot id,
        ``files`` as [staged, final] names relative to the URI, and ``rows``)."""
        check_next_snapshot(snapshot_id, self._last_prepared)
        try:
            self._check_fence("prepare")
        except FencedError:
            self._abort_open()
            raise
        txn = self._end_transaction(snapshot_id)
        with self._pending_lock:
            if txn is not None:
                self._pending.append(txn)
            pending = [dict(t) for t in self._pending]
        self._last_prepared = snapshot_id
        return {"format": DESCRIPTION_FORMAT, "transactions": pending}

    def commit(self, snapshot_id: int) -> None:
        """Makes the prepared transactions of snapshots up to `snapshot_id` visible.
        Idempotent; raises FencedError (final: do not retry) if a newer execution started.
        May run on another thread than :meth:`write` and :meth:`prepare`."""
        with self._pending_lock:
            due = [t for t in self._pending if t["snapshot"] <= snapshot_id]
        self._check_fence("commit")
        for txn in due:
            self._commit_transaction(txn)
            with self._pending_lock:
                self._pending = [t for t in self._pending if t is not txn]
        if due:
            self._backend.sync_dir(self._backend.root)

    def _commit_transaction(self, txn: dict) -> None:
        if not self._backend.atomic_rename:
            self._check_fence("commit")
            self._mark_committed("", txn.get("writer", ""), txn["files"], txn)
        for staged, final in txn["files"]:
            self._check_fence("commit")
            self._move(staged, final)

    def _mark_committed(self, suffix: str, writer: str, files: list, txn: dict | None = None):
        """On object stores, the commit point of a transaction (or, with guarantee "none",
        of one rolled file): the exclusive create of its marker, which names the writer and
        the files. The same writer again (a retry, a recovery) finds its own marker and goes
        on; another writer of the same transaction gets FencedError and its files are
        dropped, so the output holds one writer's transaction whole."""
        b, c = self._backend, self.context
        execution = c.execution_id if txn is None else txn["execution"]
        ordinal = self._ordinal if txn is None else txn["transaction"]
        processor = c.processor if txn is None else txn["processor"]
        name = f"p{processor:05d}-e{execution:012d}-t{ordinal:06d}{suffix}.json"
        path = b.path("_committed", self._job, name)
        record = json.dumps({"writer": writer, "files": files}, sort_keys=True).encode()
        if b.create_exclusive(path, record):
            return
        winner = json.loads(bytes(b.read(path))).get("writer")
        if winner == writer:
            return
        for staged, _ in files:
            b.remove(b.path(staged))
        raise FencedError(
            f"{self.sink.uri}: commit of transaction {ordinal} of processor {processor}, "
            f"execution {execution} of job {c.job_id} refused: writer {winner} committed it "
            f"first; this writer's ({writer}) files are dropped")

    def _move(self, staged: str, final: str) -> None:
        """Renames a staged file to its final name; done already if only the final exists."""
        b = self._backend
        src, dst = b.path(staged), b.path(final)
        try:
            if b.local:
                os.replace(src, dst)
            else:
                # Not atomic on object stores: a crash may leave both names, and the retry
                # moves again (the same bytes: a name belongs to one transaction).
                b.fs.move(src, dst)
            return
        except OSError as e:
            if b.exists(src):
                raise storage_error("rename", f"{src} to {dst}", e) from None
        if not b.exists(dst):
            raise SnapshotIncompleteError(
                f"{b.root}: prepared file {staged} is neither staged nor committed as {final}; "
                "the transaction's data is gone")

    # -- recovery and end ------------------------------------------------------------------

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        """Commits the transactions listed in `prepared` (this processor's state in the
        restored snapshot; states of several old processors may be merged by concatenating
        their ``transactions``), then deletes every other staged file of this processor,
        and of processors >= the current parallelism that map to it (p % processors)."""
        self._register()
        txns = prepared_transactions(prepared, DESCRIPTION_FORMAT)
        for txn in txns:
            for staged, final in txn["files"]:
                if not (_STAGED.fullmatch(staged) and _FINAL.fullmatch(final)):
                    raise InvalidArgumentError(
                        f"prepared state names a bad file: {staged!r} -> {final!r}")
        for txn in sorted(txns, key=lambda t: (t["execution"], t["transaction"])):
            self._commit_transaction(txn)
        if txns:
            self._backend.sync_dir(self._backend.root)
        self._abort_leftovers()
        self._pending = []
        self._last_prepared = snapshot_id

    def _abort_leftovers(self) -> None:
        b, c = self._backend, self.context
        base = f"_staging/{self._job}"
        mine = [f"p{c.processor:05d}"]
        for name in b.listdir(b.path(base)):
            m = re.fullmatch(r"p(\d{5,})", name)
            if m and int(m[1]) >= c.processors and int(m[1]) % c.processors == c.processor:
                mine.append(name)
        for directory in mine:
            for name in b.listdir(b.path(base, directory)):
                m = re.fullmatch(r"e(\d{12,})-.*", name)
                # A newer execution's files are not ours to judge (we would be fenced anyway).
                if m is None or int(m[1]) <= c.execution_id:
                    b.remove(b.path(base, directory, name))

    def _abort_open(self) -> None:
        if self._current is not None:
            self._current.discard()
            self._current = None
        for staged, _ in self._files:
            self._backend.remove(self._backend.path(staged))
        self._files, self._rows = [], 0

    def close(self) -> None:
        """With guarantee "none", commits what was written; otherwise discards the open,
        unprepared transaction (the snapshot's replay rewrites it). Prepared, uncommitted
        transactions stay staged for :meth:`recover`."""
        if self.context.guarantee == "none":
            self._end_transaction(None)
        else:
            self._abort_open()
