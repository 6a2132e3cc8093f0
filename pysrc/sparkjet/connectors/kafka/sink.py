"""A Kafka sink (Jet's ``KafkaSinks.kafka``) with ``confluent-kafka``: exactly-once through
Kafka transactions, or at-least-once without them.

**Why not Jet's or Flink's protocol.** Both keep one Kafka transaction open per processor,
*prepare* it at the barrier (flush) and commit it in phase 2. If the process dies between
the snapshot's commit and Kafka's, the new execution must commit a transaction another
process opened: Flink sets the producer id and epoch into the Java client by reflection
(``FlinkKafkaInternalProducer.resumeTransaction``); Jet (``KafkaTransactionManager``) does
the same. librdkafka, and so ``confluent-kafka``, has no such door: ``init_transactions``
with the same ``transactional.id`` *aborts* whatever was open, and the prepared records
are gone while the snapshot says they were written. So this sink does not keep the records
in the open transaction across phase 1; it keeps them in durable staging.

**The protocol (exactly-once).**

1. :meth:`KafkaWriter.write` keeps the epoch's batches in memory.
2. :meth:`KafkaWriter.prepare` (phase 1) writes them to one Arrow IPC file in ``staging``
   (``_staging/{job}/{sink}/p{processor}/e{execution}-s{snapshot}.arrow``, fsynced), and
   returns the description of every staged, not yet committed snapshot of this processor.
3. :meth:`KafkaWriter.commit` (phase 2) produces the rows of every staged snapshot up to
   *n* in **one Kafka transaction** of the producer ``{transactional_id}-p{processor}`` and,
   in the same transaction, commits the offset *n + 1* of the consumer group
   ``{transactional_id}-p{processor}`` (``send_offsets_to_transaction``; the offset is a
   marker on partition 0 of the topic, no consumer uses it). Kafka makes the records and
   the marker visible together or not at all. The staged files go once no restorable
   snapshot lists them (:mod:`sparkjet.connectors._staging`).
4. :meth:`KafkaWriter.recover` (after a restart from snapshot *n*): for every old processor
   whose staged snapshots the restored state lists, reads its group's marker ``m``: the
   snapshots below ``m`` are in Kafka already; the others are produced from their staged
   files and committed with the marker, as in 3. So a crash anywhere -- before, during or
   after Kafka's commit, or during the recovery itself -- neither loses nor repeats a record
   for a ``read_committed`` consumer. Leftover staged files (of snapshots that never
   completed, or committed but not yet deleted) are then deleted. A broker that loses a
   committed marker (and maybe the rows) has them produced again; phase 2 leaves a hint
   beside each staged file it committed, so that recovery then logs a warning naming the
   topic, the marker's partition and group, and the snapshots (when only the marker was
   lost, a ``read_committed`` consumer sees those rows twice: telling the two apart would
   take reading the topic back).

**Fencing.** Transactional ids depend on the job, the sink and the processor index, never
on the execution: a new execution's ``init_transactions`` with the same id fences the
producer of the older one (a zombie's next produce or commit fails with ``_FENCED``, which
:meth:`KafkaWriter.commit` reports as :class:`~sparkjet.errors.FencedError`) and aborts its
open transaction. At recovery a processor initialises the ids of every old processor index
that maps to it (``old % processors``), up to the largest parallelism registered under
``staging`` (``_executions/{job}/{sink}/e{execution}-n{processors}``), so that no dangling
transaction of a larger earlier execution holds back ``read_committed`` consumers.

The cost: every record is written once more, to ``staging``, and phase 2 produces the whole
epoch (Kafka's own batching and compression apply). Staging must be reachable from every
member (a local path on one machine, or a shared ``pyarrow.fs`` URI: HDFS, S3, ...).

**At-least-once** produces each batch as it comes with an idempotent producer and flushes
at every barrier (a record acknowledged by Kafka is never lost; a replay writes again).
**None** produces and flushes only at the end.

**Records.** ``value="json"`` (default) writes each row as a JSON object of its columns;
``value="<column>"`` writes that binary or string column as it is. ``key`` names a column
whose value (its text, or bytes for binary) is the record key; Kafka's partitioner then
places equal keys in one partition. ``partition`` names an integer column choosing the
partition instead.

Needs ``confluent-kafka`` (``pip install 'sparkjet[kafka]'``).
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import KW_ONLY, dataclass
from typing import Annotated

import pyarrow as pa
import pyarrow.compute as pc
from msgspec import Meta

from sparkjet._batches import record_batches
from sparkjet._fs import Backend
from sparkjet.connectors._prepared import check_next_snapshot, prepared_transactions
from sparkjet.connectors._settings import Column, Options, Path, PositiveNumber, Settings, Text
from sparkjet.connectors._staging import DESCRIPTION_FORMAT, StagedSnapshots
from sparkjet.connectors.base import GUARANTEES, ProcessorContext, Sink, SinkWriter
from sparkjet.connectors.kafka.client import (
    DEFAULT_BOOTSTRAP,
    client_config,
    error_text,
    kafka_error,
    kafka_module,
    partitions_of,
)
from sparkjet.errors import ConnectorError, FencedError, InvalidArgumentError

_REGISTERED = re.compile(r"e(\d{12,})-n(\d+)")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_log = logging.getLogger("sparkjet.connectors.kafka")


@dataclass(frozen=True)
class KafkaSinkSettings(Settings):
    """:class:`KafkaSink`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    topic: Text
    bootstrap_servers: Text = DEFAULT_BOOTSTRAP
    _: KW_ONLY
    staging: Path | None = None
    key: Column | None = None
    value: Annotated[str, Meta(min_length=1, description='"json" or a column name')] = "json"
    partition: Column | None = None
    transactional_id: Text | None = None
    timeout: PositiveNumber = 30.0
    durable: bool = True
    config: Options | None = None

    def check(self) -> None:
        self._derive("timeout", float(self.timeout))
        self._derive("config", dict(self.config or {}))


class KafkaSink(Sink):
    """Writes rows to ``topic`` at ``bootstrap_servers`` (see the module doc for the
    protocol). ``staging`` (a directory or ``pyarrow.fs`` URI every member reaches) is
    needed for exactly-once; ``transactional_id`` is the prefix of the transactional ids
    and marker groups (default ``sparkjet-{job}-{topic}``: give another one when a job
    has two Kafka sinks on one topic). ``config`` adds librdkafka producer settings.

    >>> KafkaSink("counts", "127.0.0.1:9092", key="key", staging="/data/kafka-staging")
    KafkaSink('counts', '127.0.0.1:9092', key='key', value='json')
    """

    name = "kafka"
    transactional = True

    def __init__(self, topic: str, bootstrap_servers: str = DEFAULT_BOOTSTRAP, *,
                 staging=None, key: str | None = None, value: str = "json",
                 partition: str | None = None, transactional_id: str | None = None,
                 timeout: float = 30.0, durable: bool = True, config: dict | None = None):
        KafkaSinkSettings.of(locals()).apply(self)

    def __repr__(self) -> str:
        return (f"KafkaSink({self.topic!r}, {self.bootstrap_servers!r}, key={self.key!r}, "
                f"value={self.value!r})")

    def id_prefix(self, job_id: int) -> str:
        if self.transactional_id is not None:
            return self.transactional_id
        return f"sparkjet-{job_id:016x}-{_SAFE.sub('_', self.topic)}"

    def open(self, context: ProcessorContext) -> KafkaWriter:
        if context.guarantee not in GUARANTEES:
            raise InvalidArgumentError(
                f"guarantee must be one of {GUARANTEES}, got {context.guarantee!r}")
        if context.guarantee == "exactly-once":
            return KafkaWriter(self, context)
        return KafkaPlainWriter(self, context)

    @staticmethod
    def read(topic: str, bootstrap_servers: str = DEFAULT_BOOTSTRAP, *,
             schema: pa.Schema | None = None, timeout: float = 30.0) -> pa.Table:
        """What a ``read_committed`` consumer reads from ``topic`` now: with a ``schema``,
        the JSON values as columns, else the raw values (column ``value``)."""
        # Reading back is the source's work (its reader and decoding): writing never loads
        # the source module, only this checking helper does.
        from sparkjet.connectors.kafka.source import read_topic

        return read_topic(topic, bootstrap_servers, value="raw" if schema is None else "json",
                          schema=schema, metadata=("partition", "offset"), timeout=timeout)


class _Encoder:
    """Rows of a batch as Kafka keys, values and partitions (lists, None where absent)."""

    def __init__(self, sink: KafkaSink):
        self.sink = sink

    def records(self, batch: pa.RecordBatch):
        s = self.sink
        names = batch.schema.names
        for column in (s.key, s.partition, None if s.value == "json" else s.value):
            if column is not None and column not in names:
                raise InvalidArgumentError(
                    f"Kafka sink for topic {s.topic!r}: the batch has no column {column!r} "
                    f"(columns: {names})")
        values = json_objects(batch) if s.value == "json" else _as_bytes(batch.column(s.value))
        keys = _as_bytes(batch.column(s.key)) if s.key is not None else None
        parts = batch.column(s.partition).to_pylist() if s.partition is not None else None
        return keys, values, parts


_NEEDS_ESCAPE = r'[\x00-\x1f"\\]'


def _json_text(column: pa.Array) -> pa.Array | None:
    """The column as JSON texts ("null" for nulls) by Arrow kernels, or None if its type
    or values need Python's encoder (escapes, NaN, nested types, timestamps)."""
    t = column.type
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        text = pc.cast(column, pa.string())
    elif pa.types.is_floating(t):
        if pc.all(pc.is_finite(column)).as_py() not in (True, None):
            return None
        text = pc.cast(column, pa.string())
        # Arrow writes 1.0 as "1": keep it a float for readers that infer types.
        text = pc.if_else(pc.match_substring_regex(text, "[.eE]"), text,
                          pc.binary_join_element_wise(text, ".0", ""))
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        if pc.any(pc.match_substring_regex(column, _NEEDS_ESCAPE)).as_py():
            return None
        text = pc.binary_join_element_wise('"', column.cast(pa.string()), '"', "")
    else:
        return None
    return pc.fill_null(text, "null")


def json_objects(batch: pa.RecordBatch) -> list:
    """Each row as the bytes of a JSON object of its columns: by Arrow kernels where every
    column allows, else by Python's ``json``."""
    names = batch.schema.names
    texts = [_json_text(c) for c in batch.columns]
    if all(t is not None for t in texts):
        pieces = []
        for i, (name, text) in enumerate(zip(names, texts)):
            pieces.extend([("{" if i == 0 else ",") + json.dumps(name) + ":", text])
        pieces.append("}")
        return pc.binary_join_element_wise(*pieces, "").cast(pa.binary()).to_pylist()
    dumps = json.JSONEncoder(separators=(",", ":"), default=str).encode
    columns = [c.to_pylist() for c in batch.columns]
    return [dumps(dict(zip(names, row))).encode() for row in zip(*columns)]


def _as_bytes(column: pa.Array) -> list:
    """A key or value column as bytes: binary as it is, strings as UTF-8, other types as
    their text (an int key 42 is b"42")."""
    t = column.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return column.to_pylist()
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        try:
            column = pc.cast(column, pa.string())
        except pa.ArrowNotImplementedError:
            return [None if v is None else str(v).encode() for v in column.to_pylist()]
    return column.cast(pa.binary()).to_pylist()


class _ProducerBase(SinkWriter):
    """What both writers share: the producer's settings and producing rows."""

    def __init__(self, sink: KafkaSink, context: ProcessorContext):
        self.sink = sink
        self.context = context
        self._kafka = kafka_module()
        self._encoder = _Encoder(sink)
        self._error = None
        self._fatal = None      # the first fatal error a call reported (_fatal_cause)

    def _on_error(self, err) -> None:
        """librdkafka's error callback (without one it prints every error to stderr): the
        calls that fail raise their own errors, so this only logs."""
        _log.debug("%s: librdkafka reported %s", self._what(), err)

    def _fatal_cause(self, producer, wait: float = 2.0):
        """The error that made `producer` fatal, or None. Its calls after a fatal error
        fail with librdkafka's _FATAL, which does not say why; confluent-kafka raises the
        error itself once, from the poll() that serves it (not through the error
        callback), so a poll that comes first has it. librdkafka marks the producer failed
        a moment before it queues why: this polls for up to `wait` seconds. The first
        fatal error a call of this writer reported is kept for the calls after it (every
        producer of a writer has its execution's ids: one fenced, all are)."""
        if self._fatal is None and producer is not None:
            deadline = time.monotonic() + wait
            while self._fatal is None:
                try:
                    producer.poll(0.02)
                except self._kafka.KafkaException as e:
                    self._keep_fatal(kafka_error(e))
                if time.monotonic() >= deadline:
                    break
        return self._fatal

    def _keep_fatal(self, err) -> None:
        if (err is not None and err.fatal() and self._fatal is None
                and err.code() != self._kafka.KafkaError._FATAL):
            self._fatal = err

    def _config(self, **extra) -> dict:
        # librdkafka holds records back up to linger.ms to fill a batch: the job's
        # max_batch_delay (a config= of the sink's own wins, as for every setting)
        delay = self.context.max_batch_delay
        linger = 20 if delay is None else delay * 1e3
        config = client_config(self.sink.bootstrap_servers, self.sink.timeout, {
            "linger.ms": linger, "batch.num.messages": 10_000,
            "queue.buffering.max.messages": 1_000_000,
            "queue.buffering.max.kbytes": 1_048_576, "error_cb": self._on_error})
        config.update(extra)
        config.update(self.sink.config)
        return config

    def _what(self) -> str:
        return f"Kafka sink for topic {self.sink.topic!r}"

    def _fail(self, action: str, e, producer=None) -> None:
        """Raises the error of a failed Kafka call (of `producer`, if a producer's) as
        sparkjet's: FencedError if a newer producer took over, ConnectorError otherwise."""
        err, text = kafka_error(e), error_text(e)
        fenced = (self._kafka.KafkaError._FENCED, self._kafka.KafkaError.PRODUCER_FENCED,
                  self._kafka.KafkaError.INVALID_PRODUCER_EPOCH)
        self._keep_fatal(err)
        if err is not None and err.code() == self._kafka.KafkaError._FATAL:
            # a call after the producer's fatal error: under load a zombie's produce()
            # failed so before any call had reported the fencing itself (CI)
            first = self._fatal_cause(producer)
            if first is not None:
                err, text = first, f"{first.str()}; then: {text}"
        if err is not None and err.code() in fenced:
            raise FencedError(
                f"{self._what()}: {action} by execution {self.context.execution_id} refused: "
                f"a newer producer with the same transactional id took over ({text})") from None
        raise ConnectorError(
            f"{self._what()} at {self.sink.bootstrap_servers}: {action} failed: {text}") from None

    def _on_delivery(self, err, _msg) -> None:
        if err is not None and self._error is None:
            self._error = err

    def _produce(self, producer, batch: pa.RecordBatch, on_delivery=None) -> None:
        """Produces the batch's rows. Deliveries are reported to `on_delivery` if given
        (a Python call per record: only at-least-once needs it; a transaction's commit
        fails by itself if a record was not delivered)."""
        keys, values, parts = self._encoder.records(batch)
        n = len(values)
        produce, topic = producer.produce, self.sink.topic
        rows = zip(values, keys or [None] * n,
                   [-1 if p is None else p for p in parts] if parts is not None else [-1] * n)
        for value, key, partition in rows:
            while True:
                try:
                    if on_delivery is None:
                        produce(topic, value, key, partition)
                    else:
                        produce(topic, value, key, partition, on_delivery)
                    break
                except BufferError:
                    producer.poll(0.05)     # the local queue is full: let deliveries drain
                except self._kafka.KafkaException as e:
                    self._fail("produce", e, producer)
        try:
            producer.poll(0)    # raises a fatal error it serves
        except self._kafka.KafkaException as e:
            self._fail("produce", e, producer)

    def _check_topic(self) -> None:
        partitions_of(self.sink.topic, self.sink.bootstrap_servers, self.sink.timeout,
                      "Kafka sink", self.sink.config)


class KafkaPlainWriter(_ProducerBase):
    """At-least-once (idempotent producer, flushed at every barrier) or none (flushed at
    the end); no transactions."""

    def __init__(self, sink: KafkaSink, context: ProcessorContext):
        super().__init__(sink, context)
        extra = {"enable.idempotence": True} if context.guarantee == "at-least-once" else {}
        self._producer = self._kafka.Producer(self._config(**extra))
        self._check_topic()

    def write(self, batch: pa.RecordBatch) -> None:
        self._produce(self._producer, batch, self._on_delivery)

    def _flush(self) -> None:
        try:
            left = self._producer.flush(self.sink.timeout)
        except self._kafka.KafkaException as e:     # a fatal error flush() served
            self._fail("flush", e, self._producer)
        if left:
            raise ConnectorError(
                f"{self._what()}: {left} records not acknowledged within {self.sink.timeout:g} s")
        if self._error is not None:
            err, self._error = self._error, None
            raise ConnectorError(f"{self._what()}: a record was not written: {err.str()}")

    def prepare(self, snapshot_id: int) -> dict | None:
        if self.context.guarantee == "at-least-once":
            self._flush()
        return None

    def commit(self, snapshot_id: int) -> None:
        pass

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        pass

    def close(self) -> None:
        self._flush()


class KafkaWriter(_ProducerBase):
    """One processor's exactly-once writer of a :class:`KafkaSink` (see the module doc)."""

    def __init__(self, sink: KafkaSink, context: ProcessorContext):
        super().__init__(sink, context)
        if sink.staging is None:
            raise InvalidArgumentError(
                f"{self._what()}: exactly-once needs staging=, a directory or pyarrow.fs URI "
                "every member reaches, where prepared transactions wait for Kafka's commit")
        self._backend = Backend(sink.staging, durable=sink.durable)
        self._prefix = sink.id_prefix(context.job_id)
        job = f"{context.job_id:016x}"
        sink_dir = _SAFE.sub("_", self._prefix)
        self._registry = self._backend.path("_executions", job, sink_dir)
        self._staged = StagedSnapshots(self._backend, f"_staging/{job}/{sink_dir}", context,
                                       self._what(), "its marker says it is not in Kafka",
                                       hints=Backend(sink.staging, durable=False))
        self._open: list[pa.RecordBatch] = []
        self._last_prepared: int | None = None
        self._producer = None
        self._marker_consumer = None

    def __repr__(self) -> str:
        c = self.context
        return (f"KafkaWriter({self.sink.topic!r}, job={c.job_id}, execution={c.execution_id}, "
                f"processor={c.processor})")

    # -- names -----------------------------------------------------------------------------

    def _id(self, processor: int) -> str:
        """The transactional id, and marker group, of processor index `processor`."""
        return f"{self._prefix}-p{processor}"

    def _transactional_producer(self, processor: int):
        """A producer of `processor`'s id, initialised: fences older holders of the id and
        aborts their open transaction."""
        producer = self._kafka.Producer(self._config(**{
            "transactional.id": self._id(processor),
            "transaction.timeout.ms": max(60_000, int(self.sink.timeout * 2000)),
            # librdkafka waits for send_offsets_to_transaction's requests as long as
            # socket.timeout.ms, whatever timeout the call is given (10 s, or librdkafka's
            # 60 s, against a dead broker): the sink's timeout bounds every call
            "socket.timeout.ms": max(1000, int(self.sink.timeout * 1000))}))
        try:
            producer.init_transactions(self.sink.timeout)
        except self._kafka.KafkaException as e:
            self._fail(f"init_transactions({self._id(processor)!r})", e, producer)
        return producer

    def _marker(self, processor: int) -> int:
        """The marker of `processor`'s group: snapshots below it are in Kafka."""
        consumer = self._kafka.Consumer(self._config(**{"group.id": self._id(processor)}))
        tp = self._kafka.TopicPartition(self.sink.topic, 0)
        try:
            [found] = consumer.committed([tp], timeout=self.sink.timeout)
        except self._kafka.KafkaException as e:
            self._fail(f"reading the commit marker of group {self._id(processor)!r}", e)
        finally:
            consumer.close()
        return max(found.offset, 0)

    # -- phase 1 ---------------------------------------------------------------------------

    def write(self, batch: pa.RecordBatch) -> None:
        self._open.extend(record_batches(batch))

    def prepare(self, snapshot_id: int) -> dict:
        """Stages the epoch's rows durably. Returns ``{"format": 1, "processors": N,
        "transactions": [{"processor", "execution", "snapshot", "file", "rows"}, ...]}``:
        every staged, not yet committed snapshot of this processor."""
        check_next_snapshot(snapshot_id, self._last_prepared)
        batches, self._open = self._open, []
        description = self._staged.stage(snapshot_id, batches)
        self._last_prepared = snapshot_id
        return description

    # -- phase 2 ---------------------------------------------------------------------------

    def commit(self, snapshot_id: int) -> None:
        """Produces the staged snapshots up to `snapshot_id` and commits them with the
        marker in one Kafka transaction. FencedError if a newer execution took the id."""
        self._staged.commit(snapshot_id, lambda due, batches_of: self._transaction(
            self._producer, self._marker_group(), due, batches_of))

    def _marker_group(self):
        if self._marker_consumer is None:
            self._marker_consumer = self._kafka.Consumer(
                self._config(**{"group.id": self._id(self.context.processor)}))
        return self._marker_consumer.consumer_group_metadata()

    def _transaction(self, producer, group, txns: list, batches_of) -> None:
        """One Kafka transaction: the rows of `txns` and the marker (last snapshot + 1)."""
        kafka = self._kafka
        marker = kafka.TopicPartition(self.sink.topic, 0, max(t["snapshot"] for t in txns) + 1)
        try:
            producer.begin_transaction()
        except kafka.KafkaException as e:
            self._fail("begin_transaction", e, producer)
        try:
            for t in txns:
                for batch in batches_of(t):
                    self._produce(producer, batch)
            producer.send_offsets_to_transaction([marker], group, self.sink.timeout)
            producer.commit_transaction(self.sink.timeout)
        except kafka.KafkaException as e:
            err = e.args[0]
            if not err.fatal() and err.txn_requires_abort():
                try:
                    producer.abort_transaction(self.sink.timeout)
                except kafka.KafkaException:
                    pass    # the restart's init_transactions aborts it
            self._fail("commit_transaction", e, producer)

    # -- recovery --------------------------------------------------------------------------

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        """Commits the restored snapshot's staged transactions that the markers say are not
        in Kafka yet, fences every id that maps to this processor, and deletes leftovers."""
        c = self.context
        b = self._backend
        b.makedirs(self._registry)
        b.makedirs(b.path(self._staged.processor_dir(c.processor)))
        b.create_exclusive(f"{self._registry}/e{c.execution_id:012d}-n{c.processors}", b"{}")
        txns = prepared_transactions(prepared, DESCRIPTION_FORMAT, self._what())
        newest = max((int(m[1]) for n in b.listdir(self._registry)
                      if (m := _REGISTERED.fullmatch(n))), default=c.execution_id)
        if newest > c.execution_id:
            raise FencedError(f"{self._what()}: recovery by execution {c.execution_id} refused: "
                              f"execution {newest} is newer")
        widest = max([c.processors] + [int(m[2]) for n in b.listdir(self._registry)
                                       if (m := _REGISTERED.fullmatch(n))])
        mine = [i for i in range(widest) if i % c.processors == c.processor]
        mine.extend(t["processor"] for t in txns if t["processor"] not in mine)
        for i in sorted(set(mine)):
            producer = self._transactional_producer(i)
            theirs = sorted((t for t in txns if t["processor"] == i),
                            key=lambda t: t["snapshot"])
            if theirs:
                marker = self._marker(i)
                due = [t for t in theirs if t["snapshot"] >= marker]
                self._report_lost_marker(i, marker, due)
                if due:
                    consumer = self._kafka.Consumer(self._config(**{"group.id": self._id(i)}))
                    try:
                        self._transaction(producer, consumer.consumer_group_metadata(), due,
                                          self._staged.load)
                    finally:
                        consumer.close()
            if i == c.processor:
                self._check_topic()
                self._producer = producer
            else:
                try:
                    producer.flush(self.sink.timeout)
                except self._kafka.KafkaException as e:
                    self._fail(f"flush({self._id(i)!r})", e, producer)
            # in Kafka now, or never completed; the restored snapshot's stay while it is
            # the one a restart restores
            self._staged.remove_leftovers(i, txns)
        self._staged.reset(snapshot_id, txns)
        self._open = []
        self._last_prepared = snapshot_id

    def _report_lost_marker(self, processor: int, marker: int, due: list) -> None:
        """Staged snapshots that the marker says are not in Kafka but that phase 2 left its
        hint on (it committed them): the broker lost its commit marker, and maybe the rows
        too (noida-db forgets a transaction committed while it shuts down). They are
        produced again, which is right when the rows went too; when only the marker went, a
        ``read_committed`` consumer sees them twice. Which of the two is not known here
        (it would take reading the topic back), so it is logged loudly, naming the topic,
        the marker's partition, the group and the snapshots."""
        lost = [t for t in due if self._staged.was_committed(t)]
        if lost:
            _log.warning(
                "%s: the commit marker of group %r on topic %r partition 0 reads %d, but this "
                "sink committed snapshot(s) %s to Kafka before (staged files %s): the broker "
                "lost the marker, and maybe the rows. They are produced again: if the rows "
                "stayed, a read_committed consumer of topic %r sees those %d rows twice",
                self._what(), self._id(processor), self.sink.topic, marker,
                [t["snapshot"] for t in lost], [t["file"] for t in lost], self.sink.topic,
                sum(t["rows"] for t in lost))

    def close(self) -> None:
        """Discards the open, unprepared rows (a replay writes them again); staged snapshots
        stay for :meth:`recover`."""
        self._open = []
        if self._producer is not None:
            try:
                self._producer.flush(self.sink.timeout)
            except self._kafka.KafkaException as e:
                # a fatal error (a zombie's fencing): its open transaction never commits
                _log.debug("%s: closing: %s", self._what(), error_text(e))
        if self._marker_consumer is not None:
            self._marker_consumer.close()
            self._marker_consumer = None
