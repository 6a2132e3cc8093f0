"""PostgreSQL sinks, in two modes: transactional (two-phase commit with ``PREPARE
TRANSACTION``, exactly-once) and idempotent upserts by key. Rows go in with ``COPY ... FROM
STDIN (FORMAT csv)``, the CSV written by Arrow's C++ writer (no Python loop over rows).

**Transactional mode.** Each sink processor writes the rows of a snapshot epoch into one
open transaction on its *data* connection. At :meth:`~SinkWriter.prepare` (phase 1) it
checks the fence (below) and runs ``PREPARE TRANSACTION 'sparkjet:J:T:eE:sS:pP'`` (job ``J``
in 16 hex digits, table ``T``, execution ``E``, snapshot ``S``, processor ``P``): the
transaction survives a crash of the member and of the server, invisible to readers, and
its id is saved in the snapshot. At :meth:`~SinkWriter.commit` (phase 2, after the snapshot
is complete) a second, autocommit *control* connection runs ``COMMIT PREPARED``. Until
committed, a prepared transaction stays in every later prepare result, so a restore from
any later snapshot still commits it. A commit repeated after a crash finds the id gone
from ``pg_prepared_xacts`` and counts as done (unless the fence says a newer execution took
over, which ends the writer with :class:`~sparkjet.errors.FencedError`).

**Recovery.** After a restart, :meth:`~SinkWriter.recover` commits the transactions the
restored snapshot lists, then rolls back (``ROLLBACK PREPARED``) every other prepared
transaction of this job and table that this processor owns: its own index, and after a
rescale the old indexes ``p >= processors`` with ``p % processors`` equal to it (the rule by
which the runtime merges the old processors' states). Ids are never random, so the leftovers
are found by listing ``pg_prepared_xacts``. Transactions of a newer execution are not ours
to judge. Under at-least-once and "none" nothing is prepared: rows are committed at every
barrier (and, under "none", at every batch), so a replay may repeat them.

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

**Upsert mode.** Rows are buffered and flushed in one transaction at every barrier, at
close and when the buffer is full: the last row of each key (in write order) is copied, in
key order, into a temporary table (created once per connection, emptied at every commit),
then merged into the table after the same fence check. On PostgreSQL 15 and later the merge
is ``MERGE`` (inserts without speculative insertion, updates without a separate row lock:
1.1-1.2 times ``ON CONFLICT``'s rate), joined like ``ON CONFLICT`` by probes of the key
index, in key order (hash and merge joins are turned off for it: they read the whole table
whatever the flush's size), inside a savepoint. If it fails with a unique violation (another
session inserted one of the keys meanwhile: ``MERGE`` does not wait for it) or the table
refuses ``MERGE`` (rules), the savepoint is rolled back and ``INSERT ... SELECT ... ON
CONFLICT (key) DO UPDATE`` merges instead, as it always does on older servers. (Row triggers
differ as the statements do: ``MERGE`` fires a row's insert or its update triggers, ``ON
CONFLICT`` also fires ``BEFORE INSERT`` for a row it then updates.) Replays overwrite
instead of duplicating, whatever the guarantee. Keys must not be null and must not depend on
the execution.

**Tables.** A missing table is created from the first batch's schema (upsert mode: key
columns ``NOT NULL`` and the ``PRIMARY KEY``), and the Arrow schema is kept in
``_sparkjet_tables`` so that :meth:`PostgresSink.read` returns the types that were written.
An existing table must have a column of a compatible type for every column of the batches
(and, for upserts, a primary key or unique index on exactly the key columns); otherwise the
writer refuses with an error naming the column. The server needs
``max_prepared_transactions`` > 0 for the transactional mode under exactly-once (the
PostgreSQL default is 0), and two connections per sink processor (data and control). Two
sinks of one job must not write one table.
"""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from sparkjet._batches import record_batches
from sparkjet._redact import MASK, redact
from sparkjet.connectors._prepared import check_next_snapshot, prepared_transactions
from sparkjet.connectors._upsert import BufferedUpsertWriter
from sparkjet.connectors.base import GUARANTEES, ProcessorContext, Sink, SinkWriter
from sparkjet.errors import (
    ConnectorError,
    FencedError,
    InvalidArgumentError,
    UnsupportedTypeError,
)

DESCRIPTION_FORMAT = 1
MODES = ("transactional", "upsert")
CONNECTOR = "PostgreSQL sink"
# A prepared transaction's id is at most 200 bytes: the table's name gets at most 100.
_MAX_TABLE_NAME = 100
_GID = re.compile(r"e(\d+):s(\d+):p(\d+)")
# How long a registration waits for older prepared transactions before it rolls back the
# leftovers it owns again, and how long in all before it gives up.
_LOCK_WAIT = "2s"
_REGISTER_DEADLINE = 120.0
# Rows per CSV slice of one COPY.
_COPY_ROWS = 65_536

_META = """
CREATE TABLE IF NOT EXISTS _sparkjet_fences (
    name text NOT NULL, job text NOT NULL, processor integer NOT NULL, execution bigint NOT NULL,
    PRIMARY KEY (name, job, processor));
CREATE TABLE IF NOT EXISTS _sparkjet_tables (name text PRIMARY KEY, arrow_schema bytea NOT NULL);
"""


def _psycopg():
    try:
        import psycopg
    except ImportError:
        raise ImportError(
            "PostgreSQL sinks need psycopg 3: pip install 'sparkjet[postgres]'") from None
    return psycopg


# -- types -----------------------------------------------------------------------------

def _pg_type(t: pa.DataType) -> str:
    """The PostgreSQL column type a column of Arrow type `t` is created with."""
    if pa.types.is_dictionary(t):
        return _pg_type(t.value_type)
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_uint8(t):
        return "smallint"
    if pa.types.is_int32(t) or pa.types.is_uint16(t):
        return "integer"
    if pa.types.is_int64(t) or pa.types.is_uint32(t):
        return "bigint"
    if pa.types.is_uint64(t):
        return "numeric(20, 0)"
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return "real"
    if pa.types.is_float64(t):
        return "double precision"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision}, {t.scale})"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "bytea"
    if pa.types.is_timestamp(t):
        return "timestamp with time zone" if t.tz is not None else "timestamp without time zone"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_time(t):
        return "time without time zone"
    raise UnsupportedTypeError(f"Arrow type {t} has no PostgreSQL mapping")


def _accepts(t: pa.DataType, typname: str, category: str) -> bool:
    """Whether an existing column (``pg_type.typname``, ``typcategory``) takes values of
    Arrow type `t` without a lossy or failing conversion of every value."""
    if pa.types.is_dictionary(t):
        return _accepts(t.value_type, typname, category)
    if pa.types.is_boolean(t):
        return typname == "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return category == "N"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return category == "S"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return typname == "bytea"
    if pa.types.is_timestamp(t):
        return typname in ("timestamp", "timestamptz")
    if pa.types.is_date(t):
        return typname in ("date", "timestamp", "timestamptz")
    if pa.types.is_time(t):
        return typname in ("time", "timetz")
    return False


def _arrow_type(typname: str) -> pa.DataType:
    """The Arrow type :meth:`PostgresSink.read` gives a column sparkjet did not create."""
    return {"bool": pa.bool_(), "int2": pa.int16(), "int4": pa.int32(), "int8": pa.int64(),
            "float4": pa.float32(), "float8": pa.float64(), "bytea": pa.binary(),
            "timestamptz": pa.timestamp("us", "UTC"), "timestamp": pa.timestamp("us"),
            "date": pa.date32(), "time": pa.time64("us")}.get(typname, pa.string())


def _csv_column(column: pa.Array) -> pa.Array:
    """A column as Arrow's CSV writer must see it for PostgreSQL's CSV input."""
    t = column.type
    if pa.types.is_dictionary(t):
        return _csv_column(column.dictionary_decode())
    if pa.types.is_float16(t):
        return column.cast(pa.float32())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        # bytea's text form: \x and hex digits (binary columns are rare: a Python loop)
        return pa.array([None if v is None else "\\x" + v.hex() for v in column.to_pylist()],
                        pa.string())
    return column


def _csv(batch: pa.RecordBatch) -> pa.Buffer:
    """The batch as CSV without a header. Arrow quotes every string value and writes nulls
    as nothing, which is how PostgreSQL's CSV tells null from the empty string."""
    if any(not _plain(f.type) for f in batch.schema):
        batch = pa.RecordBatch.from_arrays([_csv_column(c) for c in batch.columns],
                                           names=batch.schema.names)
    out = pa.BufferOutputStream()
    pacsv.write_csv(batch, out, pacsv.WriteOptions(include_header=False,
                                                   batch_size=max(1024, batch.num_rows)))
    return out.getvalue()


def _plain(t: pa.DataType) -> bool:
    return not (pa.types.is_dictionary(t) or pa.types.is_float16(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t))


def _last_per_key(table: pa.Table, keys: list[str]) -> pa.Table:
    """The last row of each key (in write order), in key order: one statement cannot change
    a row twice, and rows in key order visit the table's key index in order (random keys
    merge 1.3-2 times faster sorted, see bench/README.md)."""
    columns = [_comparable(table.column(k)) for k in keys]
    names = [f"k{i}" for i in range(len(keys))]
    order = pc.sort_indices(pa.table(columns, names=names),
                            sort_keys=[(n, "ascending") for n in names])    # a stable sort
    # The last of a run of equal keys is a row whose next row has another key.
    last = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        last[:-1] = False
        for column in columns:
            ordered = column.take(order)
            here, after = ordered[:-1], ordered[1:]
            differs = pc.not_equal(here, after)
            if pa.types.is_floating(column.type):     # NaN = NaN for PostgreSQL
                differs = pc.and_not(differs, pc.and_(pc.is_nan(here), pc.is_nan(after)))
            last[:-1] |= differs.to_numpy(zero_copy_only=False)
    rows = order.to_numpy()[last]
    if len(rows) == table.num_rows and np.array_equal(rows, np.arange(len(rows))):
        return table
    return table.take(rows)


def _comparable(column: pa.ChunkedArray) -> pa.Array:
    """A key column as one array that Arrow can sort and compare."""
    column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        return column.dictionary_decode()
    if pa.types.is_float16(column.type):
        return column.cast(pa.float32())
    return column


# -- the sink --------------------------------------------------------------------------

class PostgresSink(Sink):
    """Writes to `table` of the PostgreSQL database `dsn` (a libpq connection string or
    URL): ``mode="transactional"`` appends rows, visible once the snapshot covering them is
    complete (exactly-once with a replayable source; needs ``max_prepared_transactions`` >
    0 on the server); ``mode="upsert"`` upserts rows by the columns `key` (idempotent).

    >>> sink = PostgresSink("host=db dbname=shop user=etl", "orders")
    >>> counts = PostgresSink("postgresql://etl@db/shop", "counts", mode="upsert", key="word")
    >>> PostgresSink.read("host=db dbname=shop user=etl", "orders")   # doctest: +SKIP
    """

    name = "postgres"

    def __init__(self, dsn: str, table: str, *, mode: str = "transactional",
                 key: list[str] | str | None = None, max_buffered_rows: int = 1_000_000,
                 connect_timeout: float = 10.0):
        if mode not in MODES:
            raise InvalidArgumentError(f"{CONNECTOR}: mode must be one of {MODES}, got {mode!r}")
        keys = [key] if isinstance(key, str) else list(key or [])
        if mode == "upsert" and (not keys or not all(isinstance(k, str) and k for k in keys)):
            raise InvalidArgumentError(
                f"{CONNECTOR}: upsert mode needs key= naming one or more columns, got {key!r}")
        if mode == "transactional" and keys:
            raise InvalidArgumentError(
                f"{CONNECTOR}: key= is for mode='upsert'; the transactional mode appends rows")
        if (not isinstance(table, str) or not table or table.startswith("_sparkjet")
                or len(table.encode()) > _MAX_TABLE_NAME):
            raise InvalidArgumentError(
                f"{CONNECTOR}: bad table name {table!r} (at most {_MAX_TABLE_NAME} bytes, "
                "not starting with _sparkjet; 'schema.table' names a schema)")
        if not isinstance(dsn, str):
            raise InvalidArgumentError(f"{CONNECTOR}: dsn must be a connection string")
        self.dsn = dsn
        self.table = table
        self.mode = mode
        self.key = keys
        self.transactional = mode == "transactional"
        self.max_buffered_rows = max_buffered_rows
        self.connect_timeout = connect_timeout

    def __repr__(self) -> str:
        key = f", key={self.key!r}" if self.key else ""
        return (f"PostgresSink({_describe(self.dsn)!r}, {self.table!r}, mode={self.mode!r}"
                f"{key})")

    def open(self, context: ProcessorContext) -> SinkWriter:
        if self.mode == "upsert":
            return PostgresUpsertWriter(self, context)
        return PostgresTransactionalWriter(self, context)

    @staticmethod
    def read(dsn: str, table: str) -> pa.Table:
        """The committed rows of `table` (ordered by its primary key, if any), with the
        Arrow types written where sparkjet created the table."""
        psycopg = _psycopg()
        con = _connect(dsn, autocommit=True)
        try:
            return _read(psycopg, con, table)
        except psycopg.Error as e:
            raise _failure(e, f"reading table {table!r}", dsn) from None
        finally:
            con.close()


    @staticmethod
    def drop(dsn: str, table: str) -> None:
        """Drops `table` and everything sparkjet keeps about it: its fences, its recorded
        schema and the prepared transactions of every job writing it (tests and fresh
        starts; never while a job writes it)."""
        from psycopg import sql

        psycopg = _psycopg()
        con = _connect(dsn, autocommit=True)
        try:
            for (gid,) in con.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                    "AND starts_with(gid, 'sparkjet:') AND starts_with(substr(gid, 27), %s)",
                    (f"{table}:e",)).fetchall():  # sparkjet:<16 hex digits>:<table>:e...
                con.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            con.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_identifier(table)))
            for meta in ("_sparkjet_fences", "_sparkjet_tables"):
                if con.execute("SELECT to_regclass(%s)", (meta,)).fetchone()[0] is not None:
                    con.execute(sql.SQL("DELETE FROM {} WHERE name = %s").format(
                        sql.Identifier(meta)), (table,))
        except psycopg.Error as e:
            raise _failure(e, f"dropping table {table!r}", dsn) from None
        finally:
            con.close()


def _describe(dsn: str) -> str:
    """Where `dsn` connects, without its password."""
    try:
        from psycopg.conninfo import conninfo_to_dict, make_conninfo
    except ImportError:
        return MASK
    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001 - a malformed DSN may hold a password anywhere
        return MASK
    if "password" in params:
        params["password"] = MASK
    return make_conninfo(**params)


def _where(dsn: str) -> str:
    """host:port, database and user of `dsn` (libpq's defaults where absent)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        p = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001
        return "(malformed connection string)"
    return (f"{p.get('host') or p.get('hostaddr') or 'localhost'}:{p.get('port') or 5432} "
            f"database {p.get('dbname') or p.get('user') or '(default)'} as user "
            f"{p.get('user') or '(default)'}")


def _password(dsn: str) -> str | None:
    from psycopg.conninfo import conninfo_to_dict

    try:
        return conninfo_to_dict(dsn).get("password")
    except Exception:  # noqa: BLE001
        return None


def _failure(e: Exception, action: str, dsn: str, table: str | None = None) -> Exception:
    """A psycopg error as sparkjet's: InvalidArgumentError where the data or the table is
    wrong, ConnectorError where the server is unreachable or refuses; the message names the
    connector, what it was doing and the server's words, never the password."""
    psycopg = _psycopg()
    diag = getattr(e, "diag", None)
    text = (diag.message_primary if diag is not None and diag.message_primary else str(e))
    text = text.strip()
    if diag is not None and diag.message_detail:
        text += f"; {diag.message_detail}"
    if diag is not None and diag.context and "COPY" in diag.context:
        # "COPY t, line 3, column id: "x"": line n is row n - 1 of the batch
        text += f" ({diag.context.strip().splitlines()[0]})"
    message = redact(f"{CONNECTOR} ({_where(dsn)}): {action} failed: {text}", _password(dsn))
    if isinstance(e, (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError)):
        return InvalidArgumentError(message)
    return ConnectorError(message)


def _connect(dsn: str, autocommit: bool, timeout: float = 10.0, name: str = "sparkjet"):
    psycopg = _psycopg()
    try:
        con = psycopg.connect(dsn, autocommit=autocommit, connect_timeout=max(1, int(timeout)),
                              application_name=name)
    except psycopg.Error as e:
        text = str(e).strip()
        if "authentication failed" in text:
            what = "authentication failed"
        elif "does not exist" in text:
            what = "refused"
        else:
            what = "unreachable"
        raise ConnectorError(redact(
            f"{CONNECTOR}: cannot connect to {_where(dsn)} ({what}): {text}",
            _password(dsn))) from None
    try:
        con.execute("SET TIME ZONE 'UTC'")
        if not autocommit:
            con.commit()
    except BaseException:
        con.close()
        raise
    return con


def _identifier(table: str):
    from psycopg import sql

    return sql.Identifier(*table.split(".", 1))


def _columns(con, table: str) -> list[tuple[str, str, str]] | None:
    """(name, typname, typcategory) of each column of `table`, None if it does not exist."""
    row = con.execute("SELECT to_regclass(%s)::oid", (_regclass_name(table),)).fetchone()
    if row is None or row[0] is None:
        return None
    return con.execute(
        "SELECT a.attname, t.typname, t.typcategory FROM pg_attribute a "
        "JOIN pg_type t ON t.oid = a.atttypid "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (row[0],)).fetchall()


def _regclass_name(table: str) -> str:
    return ".".join('"' + p.replace('"', '""') + '"' for p in table.split(".", 1))


def _unique_keys(con, table: str) -> list[set[str]]:
    """The column sets of `table`'s primary key and unique indexes."""
    rows = con.execute(
        "SELECT array_agg(a.attname::text) FROM pg_index i "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = to_regclass(%s) AND i.indisunique AND i.indpred IS NULL "
        "GROUP BY i.indexrelid", (_regclass_name(table),)).fetchall()
    return [set(r[0]) for r in rows]


def _read(psycopg, con, table: str) -> pa.Table:
    from psycopg import sql

    columns = _columns(con, table)
    if columns is None:
        raise InvalidArgumentError(f"{CONNECTOR}: no table {table!r}")
    schema = None
    try:
        row = con.execute("SELECT arrow_schema FROM _sparkjet_tables WHERE name = %s",
                          (table,)).fetchone()
        if row is not None:
            schema = pa.ipc.read_schema(pa.py_buffer(row[0]))
    except psycopg.errors.UndefinedTable:
        pass
    fields, selects, storage = [], [], []
    for name, typname, _ in columns:
        field = (schema.field(name) if schema is not None and name in schema.names
                 else pa.field(name, _arrow_type(typname)))
        fields.append(field)
        ident = sql.Identifier(name)
        if typname in ("timestamp", "timestamptz", "time"):
            # microseconds since the epoch (or midnight): exact, and no time zone to parse
            selects.append(sql.SQL("(extract(epoch FROM {}) * 1000000)::int8").format(ident))
            storage.append(pa.int64())
        elif typname == "bytea":
            selects.append(sql.SQL("encode({}, 'hex')").format(ident))
            storage.append(pa.string())
        elif typname in ("bool", "int2", "int4", "int8", "float4", "float8", "date"):
            selects.append(ident)
            storage.append(_arrow_type(typname))
        else:
            selects.append(sql.SQL("{}::text").format(ident))
            storage.append(pa.string())
    order = _primary_key(con, table) or []
    query = sql.SQL("COPY (SELECT {} FROM {}{}) TO STDOUT (FORMAT csv)").format(
        sql.SQL(", ").join(selects), _identifier(table),
        sql.SQL(" ORDER BY {}").format(sql.SQL(", ").join(map(sql.Identifier, order)))
        if order else sql.SQL(""))
    chunks = []
    with con.cursor() as cur, cur.copy(query) as copy:
        for data in copy:
            chunks.append(bytes(data))
    names = [f.name for f in fields]
    if not chunks:
        return pa.table([pa.array([], f.type) for f in fields], schema=pa.schema(fields))
    parsed = pacsv.read_csv(
        pa.py_buffer(b"".join(chunks)),
        read_options=pacsv.ReadOptions(column_names=[f"c{i}" for i in range(len(names))]),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types={f"c{i}": s for i, s in enumerate(storage)}, true_values=["t"],
            false_values=["f"], null_values=[""], strings_can_be_null=True,
            quoted_strings_can_be_null=False))
    arrays = [_restore(parsed.column(i), columns[i][1], f.type) for i, f in enumerate(fields)]
    return pa.table(arrays, schema=pa.schema(fields))


def _primary_key(con, table: str) -> list[str] | None:
    rows = con.execute(
        "SELECT a.attname FROM pg_index i, unnest(i.indkey) WITH ORDINALITY k(attnum, n) "
        "JOIN pg_attribute a ON a.attnum = k.attnum "
        "WHERE i.indrelid = to_regclass(%s) AND i.indisprimary AND a.attrelid = i.indrelid "
        "ORDER BY k.n", (_regclass_name(table),)).fetchall()
    return [r[0] for r in rows] or None


def _restore(column: pa.ChunkedArray, typname: str, t: pa.DataType) -> pa.ChunkedArray:
    """A column read back as CSV, as Arrow type `t`."""
    if pa.types.is_dictionary(t):
        return _restore(column, typname, t.value_type).dictionary_encode()
    if typname in ("timestamp", "timestamptz"):
        micros = column.cast(pa.int64())
        if not pa.types.is_timestamp(t):
            return micros.cast(pa.timestamp("us", "UTC" if typname == "timestamptz" else None))
        return micros.cast(pa.timestamp("us", t.tz)).cast(t, safe=False)
    if typname == "bytea":
        values = [None if v is None else bytes.fromhex(v) for v in column.to_pylist()]
        return pa.chunked_array([pa.array(values, pa.binary())]).cast(t)
    if typname == "time":
        micros = column.cast(pa.int64())
        return micros.cast(pa.time64("us")).cast(t if pa.types.is_time(t) else pa.time64("us"),
                                                  safe=False)
    return column.cast(t)


# -- the writers -----------------------------------------------------------------------

class _PostgresWriter(SinkWriter):
    """What both modes share: connections, the fence, the table and ``COPY``."""

    def __init__(self, sink: PostgresSink, context: ProcessorContext):
        if context.guarantee not in GUARANTEES:
            raise InvalidArgumentError(
                f"guarantee must be one of {GUARANTEES}, got {context.guarantee!r}")
        self._psycopg = _psycopg()
        self.sink = sink
        self.context = context
        self._job = f"{context.job_id:016x}"
        self._table = _identifier(sink.table)
        self._schema: pa.Schema | None = None
        self._copy = None
        self._lock = threading.RLock()
        self._registered = False
        name = f"sparkjet {self._job} e{context.execution_id} p{context.processor}"
        self._data = _connect(sink.dsn, False, sink.connect_timeout, name)
        try:
            self._control = _connect(sink.dsn, True, sink.connect_timeout, name)
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
        return (f"{type(self).__name__}({_describe(self.sink.dsn)!r}, {self.sink.table!r}, "
                f"execution={c.execution_id}, processor={c.processor})")

    def _failure(self, e: Exception, action: str) -> Exception:
        return _failure(e, f"{action} (table {self.sink.table!r})", self.sink.dsn)

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
                types[f.name] = _pg_type(f.type)
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
                existing = _columns(con, self.sink.table)
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
        for f in schema:
            if f.name not in found:
                raise InvalidArgumentError(
                    f"{CONNECTOR}: table {self.sink.table!r} has no column {f.name!r} "
                    f"(its columns: {list(found)})")
            typname, category = found[f.name]
            if not _accepts(f.type, typname, category):
                raise InvalidArgumentError(
                    f"{CONNECTOR}: column {f.name!r} of table {self.sink.table!r} is {typname}, "
                    f"which cannot take the batch's {f.type} values (expected "
                    f"{_pg_type(f.type)})")
        if self.sink.key and set(self.sink.key) not in _unique_keys(self._control,
                                                                   self.sink.table):
            raise InvalidArgumentError(
                f"{CONNECTOR}: table {self.sink.table!r} has no PRIMARY KEY or UNIQUE index on "
                f"exactly the key columns {self.sink.key}, which upserts need")

    def _target(self):
        return self._table

    def _copy_in(self, con, batch: pa.RecordBatch) -> None:
        """Copies `batch` in (into the open transaction of `con`)."""
        if self._schema is None or not self._schema.equals(batch.schema):
            self._prepare_table(batch.schema)
        try:
            with con.cursor() as cur, cur.copy(self._copy) as copy:
                # CSV by slices: the server parses one while the next is written, and a
                # flush of a million rows never holds all of its CSV at once.
                for start in range(0, batch.num_rows, _COPY_ROWS):
                    copy.write(_csv(batch.slice(start, _COPY_ROWS)))
        except self._psycopg.Error as e:
            raise self._failure(e, "COPY of a batch") from None

    def _close_connections(self) -> None:
        for con in (getattr(self, "_data", None), getattr(self, "_control", None)):
            if con is not None:
                con.close()


class PostgresTransactionalWriter(_PostgresWriter):
    """One processor's writer of a transactional :class:`PostgresSink` (see the module
    doc): one transaction per snapshot epoch, prepared at the barrier, committed after it."""

    def __init__(self, sink: PostgresSink, context: ProcessorContext):
        super().__init__(sink, context)
        try:
            if context.guarantee == "exactly-once":
                n = int(self._control.execute("SHOW max_prepared_transactions").fetchone()[0])
                if n == 0:
                    raise ConnectorError(
                        f"{CONNECTOR} ({_where(sink.dsn)}): the server has "
                        "max_prepared_transactions = 0, so PREPARE TRANSACTION is disabled; "
                        "exactly-once needs it (set it to at least the sink's parallelism "
                        "times 2 in postgresql.conf and restart the server), or use "
                        "mode='upsert'")
        except BaseException:
            self._close_connections()
            raise
        self._rows = 0          # in the open transaction
        self._pending: list[dict] = []  # prepared, not yet committed
        self._last_prepared: int | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        with self._lock:
            self._ensure_registered()
            for b in record_batches(batch):
                self._copy_in(self._data, b)
                self._rows += b.num_rows
                if self.context.guarantee == "none":
                    self._commit_open("write")

    def _commit_open(self, action: str) -> None:
        """Commits the open transaction after a share-locked fence check."""
        try:
            self._check_fence(self._data, action, lock=True)
            self._data.commit()
        except FencedError:
            self._data.rollback()
            raise
        except self._psycopg.Error as e:
            self._data.rollback()
            raise self._failure(e, f"{action}: commit") from None
        self._rows = 0

    def prepare(self, snapshot_id: int) -> dict | None:
        """Ends the open transaction. Exactly-once: prepares it and returns ``{"format": 1,
        "transactions": [{"gid", "snapshot", "rows"}, ...]}``, every prepared, not yet
        committed transaction of this writer. At-least-once: commits it, returns None."""
        from psycopg import sql

        with self._lock:
            check_next_snapshot(snapshot_id, self._last_prepared)
            self._ensure_registered()
            self._last_prepared = snapshot_id
            if self.context.guarantee != "exactly-once":
                if self._rows:
                    self._commit_open("prepare")
                return None
            if self._rows:
                c = self.context
                gid = f"{self._prefix()}e{c.execution_id}:s{snapshot_id}:p{c.processor}"
                try:
                    self._check_fence(self._data, "prepare", lock=True)
                    self._data.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
                except FencedError:
                    self._data.rollback()
                    raise
                except self._psycopg.Error as e:
                    self._data.rollback()
                    raise self._failure(e, "PREPARE TRANSACTION") from None
                self._pending.append({"gid": gid, "snapshot": snapshot_id, "rows": self._rows})
                self._rows = 0
            return {"format": DESCRIPTION_FORMAT, "transactions": [dict(t) for t in self._pending]}

    def commit(self, snapshot_id: int) -> None:
        """Commits the prepared transactions of snapshots up to `snapshot_id`. Idempotent;
        raises FencedError (final) if a newer execution took over."""
        with self._lock:
            due = [t for t in self._pending if t["snapshot"] <= snapshot_id]
            if not due:
                return
            try:
                self._check_fence(self._control, "commit", lock=False)
                for txn in due:
                    self._commit_prepared(txn["gid"])
                    self._pending.remove(txn)
            except self._psycopg.Error as e:
                raise self._failure(e, "COMMIT PREPARED") from None

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        """Commits the transactions `prepared` lists (the restored snapshot's; states of
        several old processors are merged by concatenating ``transactions``), rolls back
        every other prepared transaction this processor owns, then registers this
        execution (see the module doc)."""
        with self._lock:
            txns = prepared_transactions(prepared, DESCRIPTION_FORMAT, CONNECTOR)
            for txn in txns:
                if not str(txn.get("gid", "")).startswith(self._prefix()):
                    raise InvalidArgumentError(
                        f"{CONNECTOR}: prepared state names a transaction of another job or "
                        f"table: {txn.get('gid')!r}")
            try:
                self._check_fence(self._control, "recovery", lock=False)
                for txn in sorted(txns, key=lambda t: t["snapshot"]):
                    self._commit_prepared(txn["gid"])
                self._abort_leftovers()
                self._register()
            except self._psycopg.Error as e:
                raise self._failure(e, "recovery") from None
            self._pending = []
            self._last_prepared = snapshot_id

    def close(self) -> None:
        """Rolls back the open, unprepared transaction (the snapshot's replay rewrites it;
        under "none" there is none: every batch is committed). Prepared, uncommitted
        transactions stay for :meth:`recover`."""
        with self._lock:
            try:
                if not self._data.closed:
                    self._data.rollback()
            finally:
                self._close_connections()


class PostgresUpsertWriter(_PostgresWriter, BufferedUpsertWriter):
    """One processor's writer of an upsert :class:`PostgresSink`: buffered rows merged by
    key at every barrier (see the module doc)."""

    connector = CONNECTOR

    def __init__(self, sink: PostgresSink, context: ProcessorContext):
        super().__init__(sink, context)
        try:
            # The staging table lives in the session's temporary buffers (8 MB by default,
            # then spilled to disk); settable only before the session's first temporary table.
            self._data.execute("SET temp_buffers = '128MB'")
            self._data.commit()
        except BaseException:
            self._close_connections()
            raise
        self._start_buffer()
        # MERGE (PostgreSQL 15+) inserts without ON CONFLICT's speculative insertion and
        # updates without its row lock (see bench/README.md). ON CONFLICT stays the
        # fallback where MERGE cannot be used.
        self._use_merge = self._data.info.server_version >= 150000
        self._merge = None
        self._upsert = None

    def _flush(self) -> int:
        if not self._buffer:
            return 0
        self._ensure_registered()
        batches, rows = self._buffer, self._buffered
        self._buffer, self._buffered = [], 0
        # Runs of batches of one schema, each merged as one table.
        runs: list[list[pa.RecordBatch]] = []
        for b in batches:
            if runs and runs[-1][0].schema.equals(b.schema):
                runs[-1].append(b)
            else:
                runs.append([b])
        con = self._data
        try:
            self._check_fence(con, "flush", lock=True)
            for run in runs:
                table = _last_per_key(pa.Table.from_batches(run), self.sink.key)
                for b in table.combine_chunks().to_batches():
                    self._copy_in(con, b)
                self._merge_stage(con)
            con.commit()
        except BaseException as e:
            con.rollback()
            self._schema = None     # the staging table may have been created in this transaction
            if isinstance(e, self._psycopg.Error):
                raise self._failure(e, "upsert") from None
            raise
        return rows

    def _merge_stage(self, con) -> None:
        """Merges the staging table into the table, in the open transaction of `con`."""
        if self._use_merge:
            errors = self._psycopg.errors
            try:
                with con.transaction():     # a savepoint: the fallback keeps the COPY
                    # The planner's hash join reads the whole table for a flush of a tenth
                    # of it (5 times slower than index probes at 10,000 rows into 1M);
                    # probes of the key index in key order are what ON CONFLICT does.
                    con.execute("SET LOCAL enable_hashjoin = off; "
                                "SET LOCAL enable_mergejoin = off")
                    con.execute(self._merge)
                return
            except errors.UniqueViolation:
                # MERGE does not wait for a concurrent insert of the same key (another
                # processor's); ON CONFLICT does. A violation of another unique index
                # fails again below, with the same message.
                pass
            except errors.FeatureNotSupported:
                self._use_merge = False     # e.g. a table with rules
        con.execute(self._upsert)

    def _prepare_table(self, schema: pa.Schema) -> None:
        from psycopg import sql

        super()._prepare_table(schema)
        names = list(map(sql.Identifier, schema.names))
        stage = sql.Identifier(f"_sparkjet_stage_{self.context.processor}")
        keys = self.sink.key
        con = self._data
        try:
            # The stage has the table's column types: a value that does not fit fails in
            # COPY, which names the column and the line.
            con.execute(sql.SQL("DROP TABLE IF EXISTS pg_temp.{}").format(stage))
            con.execute(sql.SQL(
                "CREATE TEMP TABLE {} ON COMMIT DELETE ROWS AS SELECT {} FROM {} WITH NO DATA"
            ).format(stage, sql.SQL(", ").join(names), self._table))
        except self._psycopg.Error as e:
            raise self._failure(e, "creating the staging table") from None
        self._stage = stage
        self._copy = sql.SQL("COPY pg_temp.{} ({}) FROM STDIN (FORMAT csv)").format(
            stage, sql.SQL(", ").join(names))
        values = [n for n in schema.names if n not in keys]
        update = [sql.SQL("{} = excluded.{}").format(sql.Identifier(n), sql.Identifier(n))
                  for n in values]
        action = (sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(update)) if update
                  else sql.SQL("DO NOTHING"))
        self._upsert = sql.SQL(
            "INSERT INTO {table} ({cols}) SELECT {cols} FROM pg_temp.{stage} "
            "ON CONFLICT ({keys}) {action}").format(
            table=self._table, cols=sql.SQL(", ").join(names), stage=stage,
            keys=sql.SQL(", ").join(map(sql.Identifier, keys)), action=action)
        matched = (sql.SQL(" WHEN MATCHED THEN UPDATE SET {}").format(sql.SQL(", ").join(
            sql.SQL("{} = s.{}").format(sql.Identifier(n), sql.Identifier(n)) for n in values))
            if values else sql.SQL(""))
        self._merge = sql.SQL(
            "MERGE INTO {table} AS t USING pg_temp.{stage} AS s ON {on}{matched} "
            "WHEN NOT MATCHED THEN INSERT ({cols}) VALUES ({staged})").format(
            table=self._table, stage=stage, matched=matched, cols=sql.SQL(", ").join(names),
            on=sql.SQL(" AND ").join(
                sql.SQL("t.{} = s.{}").format(sql.Identifier(k), sql.Identifier(k))
                for k in keys),
            staged=sql.SQL(", ").join(sql.SQL("s.{}").format(n) for n in names))

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        """Registers this execution: the replay from the restored snapshot overwrites by
        key what the failed execution wrote after it."""
        with self._lock:
            try:
                self._register()
            except self._psycopg.Error as e:
                raise self._failure(e, "registering the execution") from None
