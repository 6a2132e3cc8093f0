"""The contracts between the job runtime and its sources and sinks (Jet's model).

A job's **source** has a fixed number of source partitions (Kafka-like: the unit of
parallelism and of offsets). Each source processor reads some of them through a
:class:`SourceReader`, which takes part in snapshots:

- a *replayable* source saves its offsets in :meth:`SourceReader.snapshot_state` and seeks
  back to them in :meth:`SourceReader.restore_state` (Jet: Kafka, files, the generator);
- an *acknowledging* source (Jet: JMS, here Redis Streams) saves the ids of messages it has
  read but not yet acknowledged; :meth:`SourceReader.ack` acknowledges them once the snapshot
  that covers them is complete, and after a restart redelivered messages whose ids are in the
  restored state are dropped (their effects are already in the state).

A **sink** writes each processor's output through a :class:`SinkWriter`:

- a *transactional* sink takes part in two-phase commit: :meth:`SinkWriter.prepare` (phase 1,
  when the processor's snapshot barrier is aligned) ends the open transaction and returns its
  description, which is saved in the snapshot; :meth:`SinkWriter.commit` (phase 2, after the
  snapshot is complete) makes it visible. After a restart, :meth:`SinkWriter.recover` commits
  the transactions prepared in the restored snapshot and aborts every other one it finds;
- an *idempotent* sink writes with stable keys and flushes in :meth:`SinkWriter.prepare`, so
  replays overwrite instead of duplicating.

A source may also need the driver before the job starts (:meth:`Source.prepare`, such as a
Spark DataFrame materialised once) and after it ends (:meth:`Source.cleanup`).

Everything a reader or writer returns for a snapshot is JSON-able plain data. Every context
carries the execution id, the fencing token: writers must not make data visible for an
execution older than the newest one they have seen.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import pyarrow as pa

from sparkjet.errors import BadRecordError

GUARANTEES = ("none", "at-least-once", "exactly-once")


@dataclass(frozen=True)
class ProcessorContext:
    """Where a reader or writer runs: which job, execution, vertex and processor."""

    job_id: int
    execution_id: int
    vertex: str
    processor: int          # global index of this processor among the vertex's processors
    processors: int         # the vertex's total parallelism (all members)
    guarantee: str = "exactly-once"
    job_name: str | None = None
    #: the job's ``max_batch_delay`` (seconds): the longest a writer or reader should hold
    #: rows back to fill a batch (None: its own default)
    max_batch_delay: float | None = None

    @property
    def job(self) -> str:
        """The job as messages name it: ``job 'NAME'`` (``job ID`` when it has none)."""
        return f"job {self.job_name!r}" if self.job_name is not None else f"job {self.job_id}"


@dataclass(frozen=True)
class DriverContext:
    """Where a source is prepared: on the driver (where ``Job.run`` is called), for one
    vertex of one job."""

    job_id: int
    job_name: str
    vertex: str
    snapshot_store: str | None      # the job's snapshot store (None under guarantee none)


@dataclass(frozen=True)
class BadRecord:
    """A record a source cannot decode, or a row a sink refuses (``on_error``): ``reason``
    says why, ``column`` which column (None: the whole record), ``record`` its bytes as
    read (a source) or None; ``partition`` and ``offset`` where it is (a Kafka partition
    and offset, a file's line), ``position`` the same in words ("topic 'orders'
    partition 2 offset 17"), and ``row`` its row in the batch (a sink's refusal)."""

    reason: str
    column: str | None = None
    record: bytes | None = None
    partition: int | None = None
    offset: int | None = None
    position: str | None = None
    row: int | None = None


class SourceReader(ABC):
    """Reads some partitions of a source.

    A reader that meets a record it cannot decode hands it to :meth:`bad_record` and reads
    on: the runtime sets ``on_bad_record`` to apply the source's ``on_error`` (fail, skip,
    or a dead-letter sink); without it (a reader used on its own) the record raises."""

    #: Set by the runtime: called with each :class:`BadRecord` (it raises to fail).
    on_bad_record = None

    #: How many times the reader moved on from a position its input no longer holds, as
    #: its source's policy said (Kafka's ``on_offset_reset``); the runtime counts them in
    #: the ``offset_resets`` metric.
    offset_resets = 0

    def bad_record(self, record: BadRecord) -> None:
        """Reports a record that does not decode (the reader leaves it out of its batch;
        its offset counts as read)."""
        if self.on_bad_record is None:
            where = f"{record.position}: " if record.position else ""
            raise BadRecordError(f"{where}{record.reason}", None, record.column, record.position)
        self.on_bad_record(record)

    @abstractmethod
    def read(self, max_rows: int) -> pa.RecordBatch | None:
        """The next rows (at most `max_rows`), or None if none are available right now.
        Never blocks for long: the runtime polls readers cooperatively."""

    @abstractmethod
    def at_end(self) -> bool:
        """True once every partition of this reader is exhausted (bounded sources)."""

    def caught_up(self) -> bool:
        """True when the last :meth:`read` gave all this reader had at that moment (a live
        stream read faster than it grows: a rate-limited generator, a Kafka or Redis
        consumer with nothing more fetched). The runtime then waits about half of
        ``JobConfig.max_batch_delay`` before it reads again, so that a slow stream comes in
        batches of a few milliseconds' rows rather than a handful of rows at a time. False
        (the default) when a short read says nothing of what follows (a file's last rows)."""
        return False

    @abstractmethod
    def snapshot_state(self) -> dict:
        """What to save in a snapshot taken *now* (between two reads): offsets, or the ids
        of read but unacknowledged messages. JSON-able."""

    @abstractmethod
    def restore_state(self, state: dict | None) -> None:
        """Continues from a snapshot's state (None: from the start, or for sources that
        cannot rewind, from where they are, as the guarantee allows)."""

    def last_partition(self) -> int | None:
        """The source partition the rows of the last :meth:`read` came from, if they all
        came from one (event time then has a watermark per partition); None if unknown
        (the reader's partitions then share one watermark)."""
        return None

    def ack(self, snapshot_id: int) -> None:  # noqa: B027 - optional: replayable sources need none
        """Snapshot `snapshot_id` is complete (phase 2): acknowledge what it covers."""

    def close(self) -> None:  # noqa: B027 - optional: a reader may hold nothing to release
        """Releases connections and files."""


class Source(ABC):
    """A description of a source: picklable, cheap, shipped to the members."""

    name: str = "source"
    replayable: bool = True
    acknowledging: bool = False

    @abstractmethod
    def partition_count(self) -> int:
        """The number of source partitions."""

    @abstractmethod
    def open(self, partitions: list[int], context: ProcessorContext) -> SourceReader:
        """A reader of the given source partitions."""

    def prepare(self, context: DriverContext) -> None:  # noqa: B027 - optional hook
        """Called on the driver once per run of the job, before its first execution and
        while the run holds the job's lock: what the members will read must exist when this
        returns, and be the same for every run of the job (a restore seeks into it)."""

    def cleanup(self, context: DriverContext) -> None:  # noqa: B027 - optional hook
        """Called on the driver after the job ran to its end (never after a failure, a
        stop or a cancel, after which the job may resume): drop what :meth:`prepare`
        made."""


class SinkWriter(ABC):
    """Writes one processor's output."""

    #: Rows written are held back until :meth:`flush` (or a barrier) where the guarantee
    #: would let them be seen at once: the runtime then counts an event's output as
    #: emitted when it is flushed, not when it is written.
    buffers: bool = False

    @abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Buffers or writes rows (not yet visible for a transactional sink)."""

    @abstractmethod
    def prepare(self, snapshot_id: int) -> dict | None:
        """Phase 1 at the processor's barrier for `snapshot_id`: flush (idempotent) or end the
        open transaction (transactional) and return what to save in the snapshot: the
        description of *every* prepared transaction not yet committed, not only the new one
        (a restore from this snapshot must be able to commit them all)."""

    @abstractmethod
    def commit(self, snapshot_id: int) -> None:
        """Phase 2, after snapshot `snapshot_id` is complete: make the transactions of every
        snapshot up to it visible. Must be idempotent: it is retried until it succeeds, except
        after :class:`~sparkjet.errors.FencedError` (a newer execution owns the sink), which is
        final."""

    @abstractmethod
    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        """After a restart from snapshot `snapshot_id` (None: no snapshot), before any write:
        commit what `prepared` describes and abort every other leftover transaction of this
        processor. After a rescale, `prepared` merges the states of the old processors
        mapped to this one (old index % new parallelism): dicts united, lists concatenated
        (``sparkjet.runtime.snapshotting.merge_states``)."""

    def refused(self, batch: pa.RecordBatch) -> list[BadRecord]:
        """The rows of ``batch`` the sink's system would refuse (each a :class:`BadRecord`
        with its ``row`` and ``column``), found before :meth:`write`: the runtime applies
        the sink's ``on_error`` to them and writes the rest. None found by default."""
        return []

    def flush(self) -> None:  # noqa: B027 - optional: most writers buffer nothing to show
        """Makes the rows written so far visible where the sink's guarantee lets them be
        seen before a commit (an idempotent writer's buffer, a producer's queue); a
        transactional writer keeps them for its commit. The runtime calls it once rows
        have waited ``JobConfig.max_batch_delay`` (from the processor's thread)."""

    def close(self) -> None:  # noqa: B027 - optional: a writer may hold nothing to end
        """Ends writing. With guarantee "none", makes what was written visible."""


class Sink(ABC):
    """A description of a sink: picklable, cheap, shipped to the members."""

    name: str = "sink"
    transactional: bool = False

    @abstractmethod
    def open(self, context: ProcessorContext) -> SinkWriter:
        """The writer of one processor."""
