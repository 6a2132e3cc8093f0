"""The PostgreSQL sink (:class:`PostgresSink`): its settings, the writer of each mode, and
reading or dropping a table it wrote."""
from __future__ import annotations

import pyarrow as pa

from sparkjet.connectors.base import ProcessorContext, Sink, SinkWriter
from sparkjet.connectors.postgres.columns import read_table
from sparkjet.connectors.postgres.connection import (
    CONNECTOR,
    connect,
    describe,
    failure,
    identifier,
    psycopg_module,
)
from sparkjet.connectors.postgres.transactional import PostgresTransactionalWriter
from sparkjet.connectors.postgres.upsert import PostgresUpsertWriter
from sparkjet.errors import InvalidArgumentError

MODES = ("transactional", "upsert")
# A prepared transaction's id is at most 200 bytes: the table's name gets at most 100.
_MAX_TABLE_NAME = 100


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
        return (f"PostgresSink({describe(self.dsn)!r}, {self.table!r}, mode={self.mode!r}"
                f"{key})")

    def open(self, context: ProcessorContext) -> SinkWriter:
        if self.mode == "upsert":
            return PostgresUpsertWriter(self, context)
        return PostgresTransactionalWriter(self, context)

    @staticmethod
    def read(dsn: str, table: str) -> pa.Table:
        """The committed rows of `table` (ordered by its primary key, if any), with the
        Arrow types written where sparkjet created the table."""
        psycopg = psycopg_module()
        con = connect(dsn, autocommit=True)
        try:
            return read_table(psycopg, con, table)
        except psycopg.Error as e:
            raise failure(e, f"reading table {table!r}", dsn) from None
        finally:
            con.close()

    @staticmethod
    def drop(dsn: str, table: str) -> None:
        """Drops `table` and everything sparkjet keeps about it: its fences, its recorded
        schema and the prepared transactions of every job writing it (tests and fresh
        starts; never while a job writes it)."""
        from psycopg import sql

        psycopg = psycopg_module()
        con = connect(dsn, autocommit=True)
        try:
            for (gid,) in con.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                    "AND starts_with(gid, 'sparkjet:') AND starts_with(substr(gid, 27), %s)",
                    (f"{table}:e",)).fetchall():  # sparkjet:<16 hex digits>:<table>:e...
                con.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            con.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(identifier(table)))
            for meta in ("_sparkjet_fences", "_sparkjet_tables"):
                if con.execute("SELECT to_regclass(%s)", (meta,)).fetchone()[0] is not None:
                    con.execute(sql.SQL("DELETE FROM {} WHERE name = %s").format(
                        sql.Identifier(meta)), (table,))
        except psycopg.Error as e:
            raise failure(e, f"dropping table {table!r}", dsn) from None
        finally:
            con.close()
