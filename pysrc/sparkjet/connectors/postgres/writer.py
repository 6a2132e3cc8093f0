"""What both modes' writers share (:class:`PostgresWriter`): a *data* and an autocommit
*control* connection, the fence, the table, and ``COPY``.

**Fencing.** The table ``_sparkjet_fences`` holds, per (table, job, processor), the newest
execution that registered that processor; recovery registers the execution by ``UPDATE`` on
the row of its processor and on those of the old processors it owns. Before ``PREPARE
TRANSACTION`` (or the commit of an at-least-once epoch or of an upsert flush) the writer
reads its row ``FOR SHARE`` inside the transaction and the newest execution of any row: if a
newer execution is registered, the transaction is rolled back and the writer raises
FencedError. The share lock is kept by the prepared transaction, so the newer execution's
owning processor cannot register until the older prepared transaction is committed or
rolled back: its recovery resolves the ones it finds first, and a zombie that prepares
after that is rolled back by the retries of the registration (it waits with a lock
timeout, then rolls back the leftovers it owns again). Each processor waits only on the
transactions it resolves itself. :meth:`~SinkWriter.commit` checks the fence before
``COMMIT PREPARED``, and a transaction that the newer execution's recovery rolled back
cannot be committed, so a zombie cannot make a transaction visible once a newer execution
is registered; the one gap left is a zombie processor whose fence row did not exist when
the newer execution registered (a processor index new in the zombie's execution that
opened after it): its check and commit are two steps, like the file sink's.
"""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.connectors.base import GUARANTEES, BadRecord, ProcessorContext, SinkWriter
from sparkjet.connectors.postgres.columns import (
    accepts,
    copy_csv,
    pg_type,
    table_columns,
    unique_keys,
)
from sparkjet.connectors.postgres.connection import (
    CONNECTOR,
    SinkTarget,
    connect,
    describe,
    failure,
    identifier,
    psycopg_module,
)
from sparkjet.errors import (
    ConnectorError,
    FencedError,
    InvalidArgumentError,
    UnsupportedTypeError,
)

_GID = re.compile(r"e(\d+):s(\d+):p(\d+)")
# How long a registration waits for older prepared transactions before it rolls back the
# leftovers it owns again, and how long in all before it gives up.
_LOCK_WAIT = "2s"
_REGISTER_DEADLINE = 120.0
# Rows per CSV slice of one COPY.
_COPY_ROWS = 65_536
#: The integers an existing column of these types holds (bigint: all of int64).
_INT_RANGES = {"int2": (-2**15, 2**15 - 1), "int4": (-2**31, 2**31 - 1),
               "int8": (-2**63, 2**63 - 1)}

_META = """
CREATE TABLE IF NOT EXISTS _sparkjet_fences (
    name text NOT NULL, job text NOT NULL, processor integer NOT NULL, execution bigint NOT NULL,
    PRIMARY KEY (name, job, processor));
CREATE TABLE IF NOT EXISTS _sparkjet_tables (name text PRIMARY KEY, arrow_schema bytea NOT NULL);
"""


class PostgresWriter(SinkWriter):
    """What both modes share: connections, the fence, the table and ``COPY``."""

    def __init__(self, sink: SinkTarget, context: ProcessorContext):
        if context.guarantee not in GUARANTEES:
            raise InvalidArgumentError(
                f"guarantee must be one of {GUARANTEES}, got {context.guarantee!r}")
        self._psycopg = psycopg_module()
        self.sink = sink
        self.context = context
        self._job = f"{context.job_id:016x}"
        self._table = identifier(sink.table)
        self._schema: pa.Schema | None = None
        self._copy = None
        self._pg_types: dict[str, str] = {}   # column -> pg_type.typname of an existing table
        self._lock = threading.RLock()
        self._registered = False
        name = f"sparkjet {self._job} e{context.execution_id} p{context.processor}"
        self._data = connect(sink.dsn, False, sink.connect_timeout, name)
        try:
            self._control = connect(sink.dsn, True, sink.connect_timeout, name)
        except BaseException:
            self._data.close()
            raise
        try:
            with self._control.transaction():
                self._control.execute("SELECT pg_advisory_xact_lock(hashtext('sparkjet:meta'))")
                self._control.execute(_META)
        except self._psycopg.Error as e:
            self._close_connections()
            raise self._failure(e, "creating sparkjet's tables") from None
        except BaseException:
            self._close_connections()
            raise

    def __repr__(self) -> str:
        c = self.context
        return (f"{type(self).__name__}({describe(self.sink.dsn)!r}, {self.sink.table!r}, "
                f"execution={c.execution_id}, processor={c.processor})")

    def _failure(self, e: Exception, action: str) -> Exception:
        return failure(e, f"{action} (table {self.sink.table!r})", self.sink.dsn)

    # -- fencing -----------------------------------------------------------------------

    def _check_fence(self, con, action: str, lock: bool) -> None:
        """Raises FencedError if a newer execution is registered (by any processor). `lock`:
        inside the caller's transaction, share-locks this processor's fence row until the
        transaction ends (prepared: until it is committed or rolled back), so the newer
        execution's processor that owns this one cannot register meanwhile."""
        c = self.context
        if lock:
            con.execute("SELECT 1 FROM _sparkjet_fences WHERE name = %s AND job = %s "
                        "AND processor = %s FOR SHARE", (self.sink.table, self._job, c.processor))
        newest = con.execute("SELECT max(execution) FROM _sparkjet_fences WHERE name = %s "
                             "AND job = %s", (self.sink.table, self._job)).fetchone()[0]
        if newest is not None and newest > c.execution_id:
            raise FencedError(
                f"{CONNECTOR}: {action} of table {self.sink.table!r} by execution "
                f"{c.execution_id} of {c.job} refused: execution {newest} is newer")

    def _register(self) -> None:
        """Records this execution in the fence rows of this processor and of the old ones
        it owns after a rescale, unless a newer execution is registered. Waits for older
        prepared transactions that share-lock those rows: recovery has resolved the ones it
        found; between waits (a lock timeout) it rolls back again the leftovers it owns, in
        case a zombie has prepared one since."""
        c, con = self.context, self._control
        deadline = time.monotonic() + _REGISTER_DEADLINE
        while True:
            try:
                with con.transaction():
                    con.execute(f"SET LOCAL lock_timeout = '{_LOCK_WAIT}'")
                    con.execute(
                        "INSERT INTO _sparkjet_fences (name, job, processor, execution) "
                        "VALUES (%s, %s, %s, %s) ON CONFLICT (name, job, processor) DO NOTHING",
                        (self.sink.table, self._job, c.processor, c.execution_id))
                    # The WHERE is evaluated before a row is locked: rows this execution
                    # holds already are not waited on.
                    con.execute(
                        "UPDATE _sparkjet_fences SET execution = %s WHERE name = %s AND job = %s "
                        "AND (processor = %s OR (processor >= %s AND processor %% %s = %s)) "
                        "AND execution < %s",
                        (c.execution_id, self.sink.table, self._job, c.processor, c.processors,
                         c.processors, c.processor, c.execution_id))
                    self._check_fence(con, "start", lock=False)
                self._registered = True
                return
            except self._psycopg.errors.LockNotAvailable:
                if time.monotonic() > deadline:
                    raise ConnectorError(
                        f"{CONNECTOR}: execution {c.execution_id} of {c.job} waited "
                        f"{_REGISTER_DEADLINE:.0f} s to register processor {c.processor} on "
                        f"table {self.sink.table!r}: prepared transactions hold its fence row "
                        f"({self._prepared_ids()})") from None
                self._abort_leftovers()

    def _ensure_registered(self) -> None:
        if not self._registered:
            self._register()

    # -- prepared transactions (used by recovery of both modes) -------------------------

    def _prefix(self) -> str:
        return f"sparkjet:{self._job}:{self.sink.table}:"

    def _prepared_ids(self) -> list[str]:
        return [r[0] for r in self._control.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
            "AND starts_with(gid, %s)", (self._prefix(),)).fetchall()]

    def _owns(self, gid: str) -> bool:
        m = _GID.fullmatch(gid[len(self._prefix()):])
        if m is None:
            return False
        c = self.context
        execution, processor = int(m[1]), int(m[3])
        mine = processor == c.processor or (processor >= c.processors
                                            and processor % c.processors == c.processor)
        # A newer execution's transactions are not ours to judge (we would be fenced anyway).
        return mine and execution <= c.execution_id

    def _abort_leftovers(self) -> None:
        from psycopg import sql

        for gid in self._prepared_ids():
            if self._owns(gid):
                try:
                    self._control.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
                except self._psycopg.errors.UndefinedObject:
                    pass    # resolved meanwhile by its owner

    def _commit_prepared(self, gid: str) -> None:
        """``COMMIT PREPARED``; an id no longer prepared was committed already, unless a
        newer execution has taken over (then it may have been rolled back: fenced)."""
        from psycopg import sql

        try:
            self._control.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
        except self._psycopg.errors.UndefinedObject:
            self._check_fence(self._control, "commit", lock=False)

    # -- the table -----------------------------------------------------------------------

    def _prepare_table(self, schema: pa.Schema) -> None:
        """Creates the table from `schema` if missing, else checks it takes the batch's
        columns; prepares the COPY statement."""
        from psycopg import sql

        types = {}
        for f in schema:
            try:
                types[f.name] = pg_type(f.type)
            except UnsupportedTypeError as e:
                raise UnsupportedTypeError(
                    f"{CONNECTOR}: column {f.name!r} for table {self.sink.table!r}: {e}") from None
        keys = self.sink.key
        for k in keys:
            if k not in types:
                raise InvalidArgumentError(
                    f"{CONNECTOR}: key column {k!r} is not in the batch ({schema.names})")
        con = self._control
        try:
            with con.transaction():
                con.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                            (f"sparkjet:table:{self.sink.table}",))
                existing = table_columns(con, self.sink.table)
                if existing is None:
                    columns = [sql.SQL("{} {}{}").format(
                        sql.Identifier(n), sql.SQL(t), sql.SQL(" NOT NULL" if n in keys else ""))
                        for n, t in types.items()]
                    if keys:
                        columns.append(sql.SQL("PRIMARY KEY ({})").format(
                            sql.SQL(", ").join(map(sql.Identifier, keys))))
                    con.execute(sql.SQL("CREATE TABLE {} ({})").format(
                        self._table, sql.SQL(", ").join(columns)))
                    con.execute(
                        "INSERT INTO _sparkjet_tables (name, arrow_schema) VALUES (%s, %s) "
                        "ON CONFLICT (name) DO UPDATE SET arrow_schema = excluded.arrow_schema",
                        (self.sink.table, schema.serialize().to_pybytes()))
                else:
                    self._check_table(schema, existing)
        except self._psycopg.Error as e:
            raise self._failure(e, "preparing the table") from None
        self._copy = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            self._target(), sql.SQL(", ").join(map(sql.Identifier, schema.names)))
        self._schema = schema

    def _check_table(self, schema: pa.Schema, existing: list) -> None:
        found = {name: (typname, category) for name, typname, category in existing}
        self._pg_types = {name: typname for name, (typname, _) in found.items()}
        for f in schema:
            if f.name not in found:
                raise InvalidArgumentError(
                    f"{CONNECTOR}: table {self.sink.table!r} has no column {f.name!r} "
                    f"(its columns: {list(found)})")
            typname, category = found[f.name]
            if not accepts(f.type, typname, category):
                raise InvalidArgumentError(
                    f"{CONNECTOR}: column {f.name!r} of table {self.sink.table!r} is {typname}, "
                    f"which cannot take the batch's {f.type} values (expected "
                    f"{pg_type(f.type)})")
        if self.sink.key and set(self.sink.key) not in unique_keys(self._control,
                                                                   self.sink.table):
            raise InvalidArgumentError(
                f"{CONNECTOR}: table {self.sink.table!r} has no PRIMARY KEY or UNIQUE index on "
                f"exactly the key columns {self.sink.key}, which upserts need")

    def _target(self):
        return self._table

    def refused(self, batch: pa.RecordBatch) -> list[BadRecord]:
        """The rows PostgreSQL would refuse, found before ``COPY``: a text value with a NUL
        character (PostgreSQL text cannot hold one), an integer out of the range of an
        existing smallint, integer or bigint column, a null in a key column (upserts)."""
        if self._schema is None or not self._schema.equals(batch.schema):
            self._prepare_table(batch.schema)
        out: list[BadRecord] = []
        keys = set(self.sink.key or ())
        for name, column in zip(batch.schema.names, batch.columns):
            if pa.types.is_dictionary(column.type):
                column = column.dictionary_decode()
            t = column.type
            bad, why = None, None
            if pa.types.is_string(t) or pa.types.is_large_string(t):
                bad = pc.match_substring(column, "\x00")
                why = "a NUL character (\\x00), which PostgreSQL text cannot hold"
            elif pa.types.is_integer(t) and self._pg_types.get(name) in _INT_RANGES:
                lo, hi = _INT_RANGES[self._pg_types[name]]
                bad = pc.greater(column, pa.scalar(hi).cast(t)) if hi < _max(t) else None
                if pa.types.is_signed_integer(t) and lo > -_max(t) - 1:
                    low = pc.less(column, pa.scalar(lo).cast(t))
                    bad = low if bad is None else pc.or_(bad, low)
                why = f"out of the range of the table's {self._pg_types[name]} column"
            if bad is not None:
                for i in np.flatnonzero(bad.fill_null(False).to_numpy(zero_copy_only=False)):
                    value = column[int(i)].as_py()
                    out.append(BadRecord(f"value {_short(value)} holds {why}" if "NUL" in why
                                         else f"value {value} is {why}", name, row=int(i)))
            if name in keys and column.null_count:
                for i in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)):
                    out.append(BadRecord("a null in a key column, which an upsert cannot "
                                         "key by", name, row=int(i)))
        return out

    def _copy_in(self, con, batch: pa.RecordBatch) -> None:
        """Copies `batch` in (into the open transaction of `con`)."""
        if self._schema is None or not self._schema.equals(batch.schema):
            self._prepare_table(batch.schema)
        try:
            with con.cursor() as cur, cur.copy(self._copy) as copy:
                # CSV by slices: the server parses one while the next is written, and a
                # flush of a million rows never holds all of its CSV at once.
                for start in range(0, batch.num_rows, _COPY_ROWS):
                    copy.write(copy_csv(batch.slice(start, _COPY_ROWS)))
        except self._psycopg.Error as e:
            raise self._failure(e, "COPY of a batch") from None

    def _close_connections(self) -> None:
        for con in (getattr(self, "_data", None), getattr(self, "_control", None)):
            if con is not None:
                con.close()


def _max(t: pa.DataType) -> int:
    """The greatest value of integer type ``t``."""
    return int(np.iinfo(t.to_pandas_dtype()).max)


def _short(value) -> str:
    """A value for a message: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
