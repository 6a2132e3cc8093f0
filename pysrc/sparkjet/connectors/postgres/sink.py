"""The PostgreSQL sink (:class:`PostgresSink`): its settings, the writer of each mode, and
reading or dropping a table it wrote."""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Annotated, Literal

import pyarrow as pa
from msgspec import Meta

from sparkjet.connectors._settings import Keys, PositiveInt, PositiveNumber, Settings
from sparkjet.connectors.base import ProcessorContext, Sink, SinkWriter
from sparkjet.connectors.postgres.columns import read_table
from sparkjet.connectors.postgres.connection import (
    connect,
    describe,
    failure,
    identifier,
    psycopg_module,
)
from sparkjet.connectors.postgres.transactional import PostgresTransactionalWriter
from sparkjet.connectors.postgres.upsert import PostgresUpsertWriter

MODES = ("transactional", "upsert")
# A prepared transaction's id is at most 200 bytes: the table's name gets at most 100.
_MAX_TABLE_NAME = 100
TABLE_NAME = (f"a table name (at most {_MAX_TABLE_NAME} bytes, not starting with _sparkjet; "
              "'schema.table' names a schema)")


@dataclass(frozen=True)
class PostgresSinkSettings(Settings):
    """:class:`PostgresSink`'s arguments, checked (see :mod:`sparkjet.connectors._settings`).
    The connection string, which may hold a password, is never shown."""

    dsn: Annotated[str, Meta(description="a connection string",
                             extra={"secret": True})] = field(repr=False)
    table: Annotated[str, Meta(min_length=1, description=TABLE_NAME)]
    _: KW_ONLY
    mode: Literal["transactional", "upsert"] = "transactional"     # MODES
    key: Keys | None = None
    max_buffered_rows: PositiveInt = 1_000_000
    connect_timeout: PositiveNumber = 10.0

    def check(self) -> None:
        if self.table.startswith("_sparkjet") or len(self.table.encode()) > _MAX_TABLE_NAME:
            raise self._refuse("table", TABLE_NAME)
        keys = [self.key] if isinstance(self.key, str) else list(self.key or [])
        if self.mode == "upsert" and not keys:
            raise self._error(f"upsert mode needs key= naming one or more columns, got "
                              f"{self.key!r}")
        if self.mode == "transactional" and keys:
            raise self._error("key= is for mode='upsert'; the transactional mode appends rows")
        self._derive("key", keys)


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
        PostgresSinkSettings.of(locals()).apply(self)
        self.transactional = self.mode == "transactional"

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
