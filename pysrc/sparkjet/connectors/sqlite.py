"""An idempotent upsert sink on SQLite: rows keyed by stable columns, so a replay after a
restart overwrites what the failed execution wrote instead of adding to it.

Writes are buffered and flushed in one SQLite transaction (``INSERT ... ON CONFLICT(key)
DO UPDATE``) at every :meth:`SinkWriter.prepare`, before the barrier is acknowledged, and at
:meth:`SinkWriter.close`; a large buffer is also flushed early (harmless: upserts are
idempotent). The database runs in WAL mode with ``synchronous=FULL``, so a flushed
transaction survives a crash of the process and of the machine. Nothing is prepared,
committed or recovered: :meth:`commit` and :meth:`recover` do nothing by design.

Keys must not depend on the execution (no random ids, no processing times) and must not be
null: SQLite treats nulls in a key as distinct, so a replay would duplicate the row.

**Fencing.** A sparkjet table ``_sparkjet_fences`` holds, per (table, job), the newest
execution that opened a writer. Every flush checks it inside its own write transaction, so
a zombie of an older execution cannot overwrite a newer execution's values (for rolling
aggregates an older value would otherwise win): its flush raises
:class:`~sparkjet.errors.FencedError` and is rolled back.

The table is created from the first batch's schema if missing (key columns ``NOT NULL``,
``PRIMARY KEY`` on the key); the Arrow schema is kept in ``_sparkjet_tables`` so
:meth:`SQLiteUpsertSink.read` returns the types that were written.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import KW_ONLY, dataclass
from typing import Annotated

import pyarrow as pa
import pyarrow.compute as pc
from msgspec import Meta

from sparkjet.connectors._settings import Keys, NonNegativeNumber, Path, PositiveInt, Settings
from sparkjet.connectors._upsert import BufferedUpsertWriter
from sparkjet.connectors.base import ProcessorContext, Sink
from sparkjet.errors import (
    FencedError,
    InvalidArgumentError,
    UnsupportedTypeError,
)

TABLE_NAME = "a table name (not starting with _sparkjet)"

_META = """
CREATE TABLE IF NOT EXISTS _sparkjet_fences (
    name TEXT NOT NULL, job TEXT NOT NULL, execution INTEGER NOT NULL,
    PRIMARY KEY (name, job));
CREATE TABLE IF NOT EXISTS _sparkjet_tables (name TEXT PRIMARY KEY, arrow_schema BLOB NOT NULL);
"""


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _storage(t: pa.DataType) -> tuple[str, pa.DataType]:
    """The SQLite column type of an Arrow type, and the Arrow type its values pass as."""
    if pa.types.is_dictionary(t):
        return _storage(t.value_type)
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        return "INTEGER", pa.int64()
    if pa.types.is_floating(t):
        return "REAL", pa.float64()
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return "INTEGER", pa.int32()
    if pa.types.is_temporal(t) and not pa.types.is_interval(t):
        return "INTEGER", pa.int64()
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_decimal(t):
        return "TEXT", pa.string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "BLOB", pa.binary()
    raise UnsupportedTypeError(f"Arrow type {t} has no SQLite mapping")


def _values(column: pa.Array, t: pa.DataType) -> list:
    """A column's values as Python objects SQLite stores."""
    if pa.types.is_dictionary(t):
        column, t = column.dictionary_decode(), t.value_type
    if pa.types.is_uint64(t) and len(column) and (pc.max(column).as_py() or 0) >= 2**63:
        raise InvalidArgumentError("a uint64 value >= 2**63 does not fit SQLite's INTEGER")
    if pa.types.is_temporal(t):
        return column.view(_storage(t)[1]).to_pylist()
    if pa.types.is_decimal(t):
        return column.cast(pa.string()).to_pylist()
    if pa.types.is_float16(t):
        return column.cast(pa.float32()).to_pylist()
    return column.to_pylist()


def _arrow(values: list, t: pa.DataType) -> pa.Array:
    """Values read from SQLite, back as Arrow type `t`."""
    if pa.types.is_dictionary(t):
        return pa.array(values, _storage(t.value_type)[1]).cast(t.value_type).dictionary_encode()
    storage = _storage(t)[1]
    array = pa.array(values, storage)
    if pa.types.is_temporal(t):
        return array.view(t)
    return array.cast(t)


@dataclass(frozen=True)
class SQLiteUpsertSinkSettings(Settings):
    """:class:`SQLiteUpsertSink`'s arguments, checked (see
    :mod:`sparkjet.connectors._settings`)."""

    path: Path
    table: Annotated[str, Meta(min_length=1, description=TABLE_NAME)]
    key: Keys
    _: KW_ONLY
    max_buffered_rows: PositiveInt = 1_000_000
    timeout: NonNegativeNumber = 60.0   # seconds; SQLite's busy wait

    def check(self) -> None:
        if self.table.startswith("_sparkjet"):
            raise self._refuse("table", TABLE_NAME)
        self._derive("path", os.path.abspath(self.path))    # the driver's, not a worker's
        self._derive("key", [self.key] if isinstance(self.key, str) else list(self.key))


class SQLiteUpsertSink(Sink):
    """Upserts rows into `table` of the SQLite database at `path`, by the columns `key`.

    >>> sink = SQLiteUpsertSink("out.db", "counts", key=["word"])
    >>> SQLiteUpsertSink.read("out.db", "counts")            # doctest: +SKIP
    """

    name = "sqlite"
    transactional = False

    def __init__(self, path, table: str, key: list[str] | str, *,
                 max_buffered_rows: int = 1_000_000, timeout: float = 60.0):
        SQLiteUpsertSinkSettings.of(locals()).apply(self)

    def __repr__(self) -> str:
        return f"SQLiteUpsertSink({self.path!r}, {self.table!r}, key={self.key!r})"

    def open(self, context: ProcessorContext) -> SQLiteUpsertWriter:
        return SQLiteUpsertWriter(self, context)

    @staticmethod
    def read(path, table: str) -> pa.Table:
        """The rows of `table`, ordered by its primary key, with the Arrow types written."""
        con = sqlite3.connect(os.fspath(path))
        try:
            schema = None
            try:
                row = con.execute("SELECT arrow_schema FROM _sparkjet_tables WHERE name = ?",
                                  (table,)).fetchone()
                if row is not None:
                    schema = pa.ipc.read_schema(pa.py_buffer(row[0]))
            except sqlite3.OperationalError:
                pass
            info = con.execute(f"PRAGMA table_info({_quote(table)})").fetchall()
            if not info:
                raise InvalidArgumentError(f"{path}: no table {table!r}")
            names = [r[1] for r in info]
            keys = [r[1] for r in sorted(info, key=lambda r: r[5]) if r[5] > 0]
            order = f" ORDER BY {', '.join(map(_quote, keys))}" if keys else ""
            rows = con.execute(
                f"SELECT {', '.join(map(_quote, names))} FROM {_quote(table)}{order}").fetchall()
        finally:
            con.close()
        columns = list(zip(*rows)) if rows else [[] for _ in names]
        # The written Arrow types where sparkjet created the table, else the declared ones.
        kinds = {"INTEGER": pa.int64(), "REAL": pa.float64(), "TEXT": pa.string(),
                 "BLOB": pa.binary()}
        fields = [schema.field(r[1]) if schema is not None and r[1] in schema.names
                  else pa.field(r[1], kinds.get(r[2].upper(), pa.string())) for r in info]
        return pa.table([_arrow(list(c), f.type) for f, c in zip(fields, columns)],
                        schema=pa.schema(fields))


def _write_ahead_log(con: sqlite3.Connection, timeout: float) -> None:
    """Puts the database in WAL mode, retried for up to ``timeout`` seconds while another
    connection holds a lock: SQLite answers "database is locked" at once, without its busy
    handler, to a connection that switches a new database's journal mode while another
    does the same (the processors of one job open their writers together; seen as a job
    failing at its start about once in 200 openings of a new file by 4 threads)."""
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        try:
            con.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


class SQLiteUpsertWriter(BufferedUpsertWriter):
    """One processor's writer of a :class:`SQLiteUpsertSink`: buffered rows upserted at
    every barrier (see the module doc)."""

    connector = "SQLite sink"

    def __init__(self, sink: SQLiteUpsertSink, context: ProcessorContext):
        self.sink = sink
        self.context = context
        self._start_buffer()
        self._statement: str | None = None
        self._schema: pa.Schema | None = None
        # One connection per writer, used by whichever thread calls (never two at once).
        self._lock = threading.RLock()
        self._con = sqlite3.connect(sink.path, timeout=sink.timeout, isolation_level=None,
                                    check_same_thread=False)
        try:
            _write_ahead_log(self._con, sink.timeout)
            self._con.execute("PRAGMA synchronous=FULL")
            self._con.executescript(_META)
            self._in_transaction(self._register)
        except BaseException:
            self._con.close()
            raise

    def __repr__(self) -> str:
        return (f"SQLiteUpsertWriter({self.sink.path!r}, {self.sink.table!r}, "
                f"execution={self.context.execution_id}, processor={self.context.processor})")

    def _in_transaction(self, fn):
        with self._lock:
            self._con.execute("BEGIN IMMEDIATE")
            try:
                result = fn()
            except BaseException:
                self._con.execute("ROLLBACK")
                raise
            self._con.execute("COMMIT")
            return result

    def _register(self) -> None:
        """Records this execution as the table's newest, unless a newer one is there."""
        self._check_fence("start")
        self._con.execute(
            "INSERT INTO _sparkjet_fences (name, job, execution) VALUES (?, ?, ?) "
            "ON CONFLICT(name, job) DO UPDATE SET execution = max(execution, excluded.execution)",
            (self.sink.table, f"{self.context.job_id:016x}", self.context.execution_id))

    def _check_fence(self, action: str) -> None:
        row = self._con.execute("SELECT execution FROM _sparkjet_fences WHERE name = ? AND job = ?",
                                (self.sink.table, f"{self.context.job_id:016x}")).fetchone()
        if row is not None and row[0] > self.context.execution_id:
            raise FencedError(
                f"{self.sink.path}: {action} of table {self.sink.table!r} by execution "
                f"{self.context.execution_id} of {self.context.job} refused: execution "
                f"{row[0]} is newer")

    def _flush(self) -> int:
        if not self._buffer:
            return 0
        batches, rows = self._buffer, self._buffered

        def upsert():
            self._check_fence("flush")
            for batch in batches:
                self._upsert(batch)

        try:
            self._in_transaction(upsert)
        except FencedError:
            self._buffer, self._buffered = [], 0
            raise
        self._buffer, self._buffered = [], 0
        return rows

    def _upsert(self, batch: pa.RecordBatch) -> None:
        if self._schema is None or not self._schema.equals(batch.schema):
            self._statement = self._prepare_table(batch.schema)
            self._schema = batch.schema
        columns = [_values(batch.column(i), f.type) for i, f in enumerate(batch.schema)]
        try:
            self._con.executemany(self._statement, zip(*columns))
        except sqlite3.OperationalError as e:
            raise InvalidArgumentError(
                f"{self.sink.path}: upsert into {self.sink.table!r} failed: {e} (the table must "
                f"have the batch's columns and a PRIMARY KEY or UNIQUE index on {self.sink.key})"
            ) from None

    def _prepare_table(self, schema: pa.Schema) -> str:
        """Creates the table if missing; returns the upsert statement for `schema`."""
        table, keys = _quote(self.sink.table), self.sink.key
        types = {}
        for f in schema:
            try:
                types[f.name] = _storage(f.type)[0]
            except UnsupportedTypeError as e:
                raise UnsupportedTypeError(f"column {f.name!r}: {e}") from None
        if not self._con.execute(f"PRAGMA table_info({table})").fetchall():
            columns = [f"{_quote(n)} {t}{' NOT NULL' if n in keys else ''}"
                       for n, t in types.items()]
            columns.append(f"PRIMARY KEY ({', '.join(map(_quote, keys))})")
            self._con.execute(f"CREATE TABLE {table} ({', '.join(columns)})")
            self._con.execute(
                "INSERT OR REPLACE INTO _sparkjet_tables (name, arrow_schema) VALUES (?, ?)",
                (self.sink.table, schema.serialize().to_pybytes()))
        names = ", ".join(_quote(n) for n in schema.names)
        marks = ", ".join("?" for _ in schema.names)
        update = [f"{_quote(n)} = excluded.{_quote(n)}" for n in schema.names if n not in keys]
        action = f"DO UPDATE SET {', '.join(update)}" if update else "DO NOTHING"
        return (f"INSERT INTO {table} ({names}) VALUES ({marks}) "
                f"ON CONFLICT({', '.join(map(_quote, keys))}) {action}")

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        """Nothing to do: the replay from the restored snapshot overwrites by key what the
        failed execution wrote after it. (This execution is registered at open.)"""

    def _close_connections(self) -> None:
        self._con.close()
