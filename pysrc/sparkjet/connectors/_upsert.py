"""What the idempotent upsert sinks' writers share (SQLite, and PostgreSQL's upsert mode): rows
are checked for their key columns, buffered, and flushed in one transaction of the database
at every barrier (:meth:`~sparkjet.connectors.base.SinkWriter.prepare`, before it is
acknowledged), at close, and whenever ``max_buffered_rows`` rows wait. Replays overwrite by
key instead of duplicating, so nothing is prepared or committed. How a flush upserts, and
what a recovery registers, are the writer's own."""
from __future__ import annotations

from abc import abstractmethod

import pyarrow as pa

from sparkjet._batches import record_batches
from sparkjet._keys import refuse_nulls
from sparkjet.connectors.base import SinkWriter
from sparkjet.errors import InvalidArgumentError


class BufferedUpsertWriter(SinkWriter):
    """A writer that upserts by ``sink.key`` into ``sink.table``, flushing every
    ``sink.max_buffered_rows`` rows. The writer's ``__init__`` sets ``self.sink``,
    ``self._lock`` (a ``threading.RLock``: one flush at a time, whichever thread calls) and
    calls :meth:`_start_buffer`; :attr:`connector` names the sink in errors."""

    connector = "upsert sink"
    buffers = True

    def _start_buffer(self) -> None:
        self._buffer: list[pa.RecordBatch] = []
        self._buffered = 0

    def write(self, batch: pa.RecordBatch) -> None:
        for b in record_batches(batch):
            for k in self.sink.key:
                index = b.schema.get_field_index(k)
                if index < 0:
                    raise InvalidArgumentError(f"{self.connector}: key column {k!r} is not in "
                                               f"the batch ({b.schema.names})")
                refuse_nulls(b.column(index), f"{self.connector}: key column {k!r} for table "
                             f"{self.sink.table!r}", " of the batch")
            with self._lock:
                self._buffer.append(b)
                self._buffered += b.num_rows
                if self._buffered >= self.sink.max_buffered_rows:
                    self._flush()

    def flush(self) -> int:
        """Upserts the buffered rows in one transaction; returns how many."""
        with self._lock:
            return self._flush()

    @abstractmethod
    def _flush(self) -> int:
        """Upserts the buffered rows in one transaction (the lock held) and empties the
        buffer; returns how many rows it held."""

    def _close_connections(self) -> None:
        """Closes the writer's database connections."""
        raise NotImplementedError

    def prepare(self, snapshot_id: int) -> None:
        """Flushes the buffered writes (before the barrier is acknowledged). Nothing to save
        in the snapshot: returns None."""
        self.flush()

    def commit(self, snapshot_id: int) -> None:
        """Nothing to do: flushed rows are visible already."""

    def close(self) -> None:
        """Flushes what is buffered and closes the connections (every guarantee)."""
        with self._lock:
            try:
                self._flush()
            finally:
                self._close_connections()
