"""The transactional mode (:class:`PostgresTransactionalWriter`): two-phase commit with
``PREPARE TRANSACTION``, exactly-once.

**Transactional mode.** Each sink processor writes the rows of a snapshot epoch into one
open transaction on its *data* connection. At :meth:`~SinkWriter.prepare` (phase 1) it
checks the fence (see :mod:`~sparkjet.connectors.postgres.writer`) and runs ``PREPARE
TRANSACTION 'sparkjet:J:T:eE:sS:pP'`` (job ``J`` in 16 hex digits, table ``T``, execution
``E``, snapshot ``S``, processor ``P``): the transaction survives a crash of the member
and of the server, invisible to readers, and
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
"""
from __future__ import annotations

import pyarrow as pa

from sparkjet._batches import record_batches
from sparkjet.connectors._prepared import check_next_snapshot, prepared_transactions
from sparkjet.connectors.base import ProcessorContext
from sparkjet.connectors.postgres.connection import CONNECTOR, SinkTarget, where
from sparkjet.connectors.postgres.writer import PostgresWriter
from sparkjet.errors import ConnectorError, FencedError, InvalidArgumentError

DESCRIPTION_FORMAT = 1


class PostgresTransactionalWriter(PostgresWriter):
    """One processor's writer of a transactional
    :class:`~sparkjet.connectors.postgres.sink.PostgresSink` (see the module doc): one
    transaction per snapshot epoch, prepared at the barrier, committed after it."""

    def __init__(self, sink: SinkTarget, context: ProcessorContext):
        super().__init__(sink, context)
        try:
            if context.guarantee == "exactly-once":
                n = int(self._control.execute("SHOW max_prepared_transactions").fetchone()[0])
                if n == 0:
                    raise ConnectorError(
                        f"{CONNECTOR} ({where(sink.dsn)}): the server has "
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
