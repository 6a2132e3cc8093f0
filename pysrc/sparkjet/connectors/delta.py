"""A Delta Lake sink with the ``deltalake`` package (delta-rs): exactly-once through Delta's
idempotent application transactions, or at-least-once without staging.

**The protocol (exactly-once).** Each sink processor ``P`` of job ``J`` owns two Delta
*application transaction* ids (``txn`` actions in the table's log, read back with
``DeltaTable.transaction_version``): ``{app_id}-p{P}``, whose version is the last snapshot
whose rows are in the table, and ``{app_id}-p{P}-execution``, whose version is the newest
execution that owns the index (the fence). ``app_id`` defaults to ``sparkjet-{J}`` (16 hex
digits).

1. :meth:`DeltaWriter.write` conforms each batch to the table's schema (errors surface here,
   not at the commit) and keeps it in memory.
2. :meth:`DeltaWriter.prepare` (phase 1) writes the epoch's rows to one Arrow IPC file,
   ``{staging}/{J}/p{P}/e{execution}-s{snapshot}.arrow`` (fsynced), and returns
   the description of every staged, not yet committed snapshot of this processor.
3. :meth:`DeltaWriter.commit` (phase 2) reloads the table, skips the staged snapshots at or
   below the version of ``{app_id}-p{P}`` (committed already) and appends the others in
   **one Delta commit** that also sets ``{app_id}-p{P}`` to the newest of them and
   ``{app_id}-p{P}-execution`` to this execution. Delta makes the rows and the versions
   visible together or not at all; the staged files go once no restorable snapshot lists
   them (:mod:`sparkjet.connectors._staging`).
4. :meth:`DeltaWriter.recover` (after a restart from snapshot *n*) does the same for every
   processor index the restored state names and every index that maps to this processor
   (``old % processors``), so a crash anywhere -- before, during or after Delta's commit, or
   during the recovery itself -- neither loses nor repeats a row. It then deletes the staged
   files of those indexes that the restored snapshot does not list (their snapshots are in
   the table, or never completed); those it lists go at the next snapshot's commit.

**Fencing.** Recovery sets ``{app_id}-p{P}-execution`` to its execution (an empty commit
where nothing is due) for every index it owns; every later commit of the index checks that
version first and carries it again. Delta's conflict checker refuses a commit whose
application ids a concurrent commit changed, so the check and the commit are one step: a
zombie of an older execution that read the table before the newer execution's commit is
refused by Delta, and after it by the check (:class:`~sparkjet.errors.FencedError`). Two
writers can never both commit one snapshot of one index, for the same reason. Before the
table's first commit there is nothing to fence; the first commit creates the table.

**At-least-once** appends the rows buffered since the last barrier at every barrier (one
Delta commit per processor and snapshot, fenced like the above); a replay appends again.
**None** appends at the end (and whenever ``rows_per_commit`` rows are buffered).

**The table.** A missing table is created by the first commit, with the schema of the
first batch in Delta's types (unsigned integers as the next wider signed type, ``uint64``
as ``long``: a value above its range is refused; dictionaries decoded; timestamps in
microseconds, finer ones truncated). An existing table fixes the schema: every batch must have exactly its
columns, with types that cast without loss, and no null in a non-nullable column;
otherwise the writer raises :class:`~sparkjet.errors.InvalidArgumentError` naming the sink,
the table and the column. Readers see only committed rows: the staging directory (default
``{uri}/_sparkjet_staging`` for a local table; give ``staging=`` for an object store) starts
with ``_``, which Delta's readers and ``VACUUM`` ignore. Two sinks of one job that write one
table need distinct ``app_id`` values.

Needs ``deltalake`` (``pip install 'sparkjet[delta]'``).
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import KW_ONLY, dataclass
from typing import Annotated

import pyarrow as pa
import pyarrow.fs as pafs
from msgspec import Meta

from sparkjet._batches import record_batches
from sparkjet._fs import Backend, absolute
from sparkjet.connectors._prepared import check_next_snapshot, prepared_transactions
from sparkjet.connectors._settings import FileSystem, Path, PositiveInt, Settings, Text
from sparkjet.connectors._staging import DESCRIPTION_FORMAT, StagedSnapshots
from sparkjet.connectors.base import GUARANTEES, ProcessorContext, Sink, SinkWriter
from sparkjet.errors import ConnectorError, FencedError, InvalidArgumentError

CONNECTOR = "Delta Lake sink"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TEXT = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")
# Commits refused because a concurrent commit of another processor created the table or
# changed its metadata are retried after a reload; a fence conflict ends on the check.
_COMMIT_ATTEMPTS = 8


def _textual(t: pa.DataType) -> bool:
    """Whether values of type `t` are text or bytes (of any encoding)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_fixed_size_binary(t) or str(t) in _TEXT


def _delta_type(t: pa.DataType) -> pa.DataType:
    """The type a new table's column of Arrow type `t` gets: Delta has no unsigned integers,
    no half floats, no dictionaries and stores timestamps in microseconds."""
    if pa.types.is_dictionary(t):
        return _delta_type(t.value_type)
    if pa.types.is_unsigned_integer(t):
        return {8: pa.int16(), 16: pa.int32()}.get(t.bit_width, pa.int64())
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", t.tz)
    return t


def _message(e: Exception) -> str:
    """delta-rs's error as one line: its chain of causes (one per line, drawn with colour
    codes and arrows) joined by colons."""
    text = _ANSI.sub("", str(e))
    return ": ".join(line.strip().lstrip("↳").strip()
                     for line in text.splitlines() if line.strip())


def _open_table(dl, uri: str, storage_options: dict | None):
    """The table at `uri`, or None if there is none. (Not ``DeltaTable.is_deltatable``:
    its listing of a missing log waits out every retry on some S3 implementations.)"""
    try:
        return dl.DeltaTable(uri, storage_options=storage_options)
    except dl.exceptions.TableNotFoundError:
        return None


def _deltalake():
    try:
        import deltalake
    except ImportError:
        raise ImportError("the Delta Lake sink needs deltalake: "
                          "pip install 'sparkjet[delta]'") from None
    return deltalake


@dataclass(frozen=True)
class DeltaSinkSettings(Settings):
    """:class:`DeltaSink`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    uri: Path
    _: KW_ONLY
    staging: Path | None = None
    staging_filesystem: FileSystem | None = None
    app_id: Text | None = None
    storage_options: Annotated[dict[str, str], Meta(description="a dict of str")] | None = None
    rows_per_commit: PositiveInt = 1_000_000
    durable: bool = True

    def local(self) -> bool:
        """Whether the table is on a local (or mounted) file system."""
        return "://" not in self.uri or self.uri.startswith("file://")

    def check(self) -> None:
        self._derive("uri", absolute(self.uri))
        staging = self.staging
        if staging is None:
            if not self.local():
                raise InvalidArgumentError(
                    f"{CONNECTOR} for table {self.uri!r}: a table on an object store needs "
                    "staging=, a directory or pyarrow.fs URI every member reaches")
            staging = os.path.join(self.uri.removeprefix("file://"), "_sparkjet_staging")
        self._derive("staging", absolute(staging, self.staging_filesystem))
        if self.storage_options is not None:
            self._derive("storage_options", dict(self.storage_options))


class DeltaSink(Sink):
    """Appends rows to the Delta table at ``uri`` (a local path, or an object store URI
    with ``storage_options`` as ``deltalake`` takes them); see the module doc for the
    protocol. ``staging`` is where prepared snapshots wait for phase 2 (a directory or
    ``pyarrow.fs`` URI every member reaches, or a path on ``staging_filesystem``; default
    ``{uri}/_sparkjet_staging`` for a local table). ``app_id`` prefixes the Delta
    application transaction ids.

    >>> DeltaSink("/data/counts")
    DeltaSink('/data/counts')
    >>> table = DeltaSink.read("/data/counts")               # doctest: +SKIP
    """

    name = "delta"
    transactional = True

    def __init__(self, uri, *, staging=None, staging_filesystem: pafs.FileSystem | None = None,
                 app_id: str | None = None, storage_options: dict | None = None,
                 rows_per_commit: int = 1_000_000, durable: bool = True):
        settings = DeltaSinkSettings.of(locals())
        settings.apply(self)
        self.local = settings.local()

    def __repr__(self) -> str:
        return f"DeltaSink({self.uri!r})"

    def app_prefix(self, job_id: int) -> str:
        return self.app_id if self.app_id is not None else f"sparkjet-{job_id:016x}"

    def open(self, context: ProcessorContext) -> DeltaWriter:
        if context.guarantee not in GUARANTEES:
            raise InvalidArgumentError(
                f"guarantee must be one of {GUARANTEES}, got {context.guarantee!r}")
        return DeltaWriter(self, context)

    @staticmethod
    def read(uri, *, storage_options: dict | None = None,
             columns: list[str] | None = None) -> pa.Table:
        """The table's committed rows (its newest version); a missing table gives a table
        without columns."""
        dl = _deltalake()
        dt = _open_table(dl, absolute(os.fspath(uri)), storage_options)
        return pa.table({}) if dt is None else pa.table(dt.to_pyarrow_table(columns=columns))


class DeltaWriter(SinkWriter):
    """One processor's writer of a :class:`DeltaSink` (see the module doc): exactly-once
    with staging, at-least-once or none by appends."""

    def __init__(self, sink: DeltaSink, context: ProcessorContext):
        self._dl = _deltalake()
        self.sink = sink
        self.context = context
        self._prefix = sink.app_prefix(context.job_id)
        self._exactly_once = context.guarantee == "exactly-once"
        self._staged = None
        if self._exactly_once:
            backend = Backend(sink.staging, sink.staging_filesystem, sink.durable)
            self._staged = StagedSnapshots(backend, f"{context.job_id:016x}", context,
                                           self._what(), "the table says it is not committed")
            try:
                backend.makedirs(backend.path(self._staged.processor_dir(context.processor)))
            except OSError as e:
                raise ConnectorError(f"{self._what()}: cannot create the staging directory "
                                     f"{sink.staging!r}: {e}") from None
        elif sink.local:
            try:
                os.makedirs(sink.uri.removeprefix("file://"), exist_ok=True)
            except OSError as e:
                raise ConnectorError(
                    f"{self._what()}: cannot create the table's directory: {e}") from None
        self._dt = None                           # the table, once it exists
        self._schema: pa.Schema | None = None     # what every batch is conformed to
        self._open: list[pa.RecordBatch] = []
        self._open_rows = 0
        self._table_lock = threading.RLock()      # one user of self._dt at a time
        self._last_prepared: int | None = None
        self._table()       # reachable, and readable as a Delta table if it exists

    def __repr__(self) -> str:
        c = self.context
        return (f"DeltaWriter({self.sink.uri!r}, job={c.job_id}, execution={c.execution_id}, "
                f"processor={c.processor}, guarantee={c.guarantee!r})")

    # -- names and the table -------------------------------------------------------------

    def _what(self) -> str:
        return f"{CONNECTOR} for table {self.sink.uri!r}"

    def _app(self, processor: int) -> str:
        """The application id whose version is `processor`'s last committed snapshot."""
        return f"{self._prefix}-p{processor}"

    def _fence_app(self, processor: int) -> str:
        """The application id whose version is the newest execution owning `processor`."""
        return f"{self._prefix}-p{processor}-execution"

    def _table(self):
        """The table at its newest version, or None if there is none yet."""
        dl, s = self._dl, self.sink
        try:
            if self._dt is not None:
                self._dt.update_incremental()
            else:
                self._dt = _open_table(dl, s.uri, s.storage_options)
            return self._dt
        except (dl.exceptions.DeltaError, OSError) as e:
            raise ConnectorError(
                f"{self._what()}: cannot read the table: {_message(e)}") from None

    # -- schema ------------------------------------------------------------------------------

    def _target_schema(self, batch: pa.RecordBatch) -> pa.Schema:
        if self._schema is None:
            with self._table_lock:
                dt = self._table()
            self._schema = (pa.schema(dt.schema().to_arrow()) if dt is not None
                            else pa.schema([f.with_type(_delta_type(f.type))
                                            for f in batch.schema]))
        return self._schema

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The batch with the table's columns, in its order and of its types; a clear
        error if it cannot be."""
        schema = self._target_schema(batch)
        if batch.schema.equals(schema):
            return batch
        names = batch.schema.names
        missing = [n for n in schema.names if n not in names]
        extra = [n for n in names if n not in schema.names]
        if missing or extra or len(set(names)) != len(names):
            raise InvalidArgumentError(
                f"{self._what()}: the batch's columns {names} do not match the table's "
                f"{schema.names}" + (f" (missing {missing})" if missing else "")
                + (f" (not in the table: {extra})" if extra else ""))
        columns = []
        for field in schema:
            column = batch.column(field.name)
            if not column.type.equals(field.type):
                refused = InvalidArgumentError(
                    f"{self._what()}: column {field.name!r} is {column.type}, which "
                    f"cannot be written to the table's {field.type}")
                if _textual(column.type) != _textual(field.type):
                    raise refused   # Arrow would parse or print numbers: not a schema match
                # Delta keeps microseconds: finer timestamps are truncated, as Delta's own
                # writers do; every other cast must keep every value.
                exact = not (pa.types.is_timestamp(column.type)
                             and pa.types.is_timestamp(field.type))
                try:
                    column = column.cast(field.type, safe=exact)
                except pa.ArrowNotImplementedError:
                    raise refused from None
                except pa.ArrowInvalid as e:
                    raise InvalidArgumentError(
                        f"{self._what()}: column {field.name!r} ({column.type}) does not fit "
                        f"the table's {field.type}: {e}") from None
            if not field.nullable and column.null_count:
                first = column.is_null().to_pylist().index(True)
                raise InvalidArgumentError(
                    f"{self._what()}: column {field.name!r} is not nullable in the table, "
                    f"and row {first} of the batch is null")
            columns.append(column)
        return pa.RecordBatch.from_arrays(columns, schema=schema)

    # -- writing ---------------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch) -> None:
        for b in record_batches(batch):
            self._open.append(self._conform(b))
            self._open_rows += b.num_rows
            if self.context.guarantee == "none" and self._open_rows >= self.sink.rows_per_commit:
                self._append_open()

    def _append_open(self) -> None:
        batches, self._open, self._open_rows = self._open, [], 0
        if batches:
            self._commit_index(self.context.processor, batches, None)

    def prepare(self, snapshot_id: int) -> dict | None:
        """Exactly-once: stages the epoch's rows durably and returns ``{"format": 1,
        "processors": N, "transactions": [{"processor", "execution", "snapshot", "file",
        "rows"}, ...]}``, every staged, not yet committed snapshot of this processor.
        At-least-once: appends the epoch's rows (returns None). None: nothing."""
        check_next_snapshot(snapshot_id, self._last_prepared)
        self._last_prepared = snapshot_id
        if not self._exactly_once:
            if self.context.guarantee == "at-least-once":
                self._append_open()
            return None
        batches, self._open, self._open_rows = self._open, [], 0
        return self._staged.stage(snapshot_id, batches)

    # -- phase 2 ---------------------------------------------------------------------------

    def commit(self, snapshot_id: int) -> None:
        """Appends the staged snapshots up to `snapshot_id` not yet in the table, in one
        Delta commit with this processor's application transactions. Idempotent;
        FencedError (final) if a newer execution owns this processor's index."""
        if self._exactly_once:
            self._staged.commit(snapshot_id, lambda due, batches_of: self._commit_index(
                self.context.processor, due, batches_of))

    def _commit_index(self, processor: int, items: list, batches_of) -> bool:
        """One Delta commit for processor index `processor`: with `batches_of`, the staged
        snapshots `items` not yet in the table, and the index's snapshot version; without,
        the batches `items` (at-least-once, none). Both carry the fence. Retried after a
        reload when a concurrent commit wins; FencedError if a newer execution owns the
        index. False if nothing was committed (no table and nothing to write, or every
        staged snapshot in the table already)."""
        with self._table_lock:
            return self._commit_index_locked(processor, items, batches_of)

    def _commit_index_locked(self, processor: int, items: list, batches_of) -> bool:
        dl = self._dl
        c = self.context
        for attempt in range(_COMMIT_ATTEMPTS):
            dt = self._table()
            if dt is not None:
                owner = dt.transaction_version(self._fence_app(processor))
                if owner is not None and owner > c.execution_id:
                    raise FencedError(
                        f"{self._what()}: commit by execution {c.execution_id} refused: "
                        f"execution {owner} owns processor {processor}")
            apps = [dl.Transaction(self._fence_app(processor), c.execution_id)]
            if batches_of is None:
                batches = items
            else:
                done = dt.transaction_version(self._app(processor)) if dt is not None else None
                due = [t for t in sorted(items, key=lambda t: t["snapshot"])
                       if done is None or t["snapshot"] > done]
                if not due:
                    return False
                batches = [b for t in due for b in batches_of(t)]
                apps.append(dl.Transaction(self._app(processor), due[-1]["snapshot"]))
            try:
                return self._append(dt, batches, apps)
            except dl.exceptions.CommitFailedError as e:
                if attempt + 1 == _COMMIT_ATTEMPTS:
                    raise ConnectorError(f"{self._what()}: commit failed {attempt + 1} times, "
                                         f"the last time: {_message(e)}") from None

    def _append(self, dt, batches: list, apps: list) -> bool:
        """Appends `batches` (possibly none: a commit of the application ids only)."""
        dl, s = self._dl, self.sink
        if batches:
            # staged by another execution, a batch may differ in what casts losslessly
            # (a field's nullability): the first batch's schema is the commit's
            first = batches[0].schema
            table = pa.Table.from_batches(
                [b if b.schema.equals(first) else b.cast(first) for b in batches], first)
        elif dt is not None:
            table = pa.schema(dt.schema().to_arrow()).empty_table()
        else:
            return False    # no table and nothing to write: nothing to fence yet
        try:
            dl.write_deltalake(dt if dt is not None else s.uri, table, mode="append",
                               storage_options=None if dt is not None else s.storage_options,
                               commit_properties=dl.CommitProperties(app_transactions=apps))
        except dl.exceptions.CommitFailedError:
            raise
        except dl.exceptions.SchemaMismatchError as e:
            self._schema = None         # the table may have been created meanwhile
            raise InvalidArgumentError(
                f"{self._what()}: the rows do not match the table's schema: "
                f"{_message(e)}") from None
        except (dl.exceptions.DeltaError, OSError) as e:
            raise ConnectorError(
                f"{self._what()}: cannot write the table: {_message(e)}") from None
        return True

    # -- recovery --------------------------------------------------------------------------

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        """Commits the restored snapshot's staged transactions that the table does not hold
        yet, fences every index that maps to this processor and deletes leftovers."""
        c = self.context
        txns = prepared_transactions(prepared, DESCRIPTION_FORMAT, self._what())
        mine = {i for i in range(c.processors) if i % c.processors == c.processor}
        mine |= {t["processor"] for t in txns}
        staged = self._staged
        if staged is not None:
            mine |= {i for i in staged.staged_processors() if i % c.processors == c.processor}
        for i in sorted(mine):
            theirs = [t for t in txns if t["processor"] == i]
            if not (theirs and self._commit_index(i, theirs, staged.load)):
                self._commit_index(i, [], None)     # the fence alone
            if staged is not None:
                # in the table now, or never completed; the restored snapshot's stay
                # while it is the one a restart restores
                staged.remove_leftovers(i, txns)
        if staged is not None:
            staged.reset(snapshot_id, txns)
        self._open, self._open_rows = [], 0
        self._last_prepared = snapshot_id

    def close(self) -> None:
        """At-least-once and none: appends what is buffered. Exactly-once: discards the
        open, unprepared rows (a replay writes them again); staged snapshots stay for
        :meth:`recover` (those the last snapshot lists even when committed)."""
        if self._exactly_once:
            self._open, self._open_rows = [], 0
        else:
            self._append_open()
