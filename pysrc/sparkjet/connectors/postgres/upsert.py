"""The upsert mode (:class:`PostgresUpsertWriter`): idempotent upserts by key.

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
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.connectors._upsert import BufferedUpsertWriter
from sparkjet.connectors.base import ProcessorContext
from sparkjet.connectors.postgres.connection import CONNECTOR, SinkTarget
from sparkjet.connectors.postgres.writer import PostgresWriter


class PostgresUpsertWriter(PostgresWriter, BufferedUpsertWriter):
    """One processor's writer of an upsert
    :class:`~sparkjet.connectors.postgres.sink.PostgresSink`: buffered rows merged by key at
    every barrier (see the module doc)."""

    connector = CONNECTOR

    def __init__(self, sink: SinkTarget, context: ProcessorContext):
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
