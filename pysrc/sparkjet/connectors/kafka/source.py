"""A replayable source on Kafka topics (Jet's ``KafkaSources.kafka``), with ``confluent-kafka``.

**Partitions.** The source has ``partitions`` source partitions (by default the topic's
partition count when the source is built: the snapshot records it, so a job keeps it across
restarts). Kafka partition ``k`` belongs to source partition ``k % partitions``, and the
runtime spreads source partitions over the source processors (``p % processors``), so every
Kafka partition has exactly one reader in every execution, whatever the parallelism. A reader
looks for new Kafka partitions every ``discovery_interval`` seconds and reads the ones it owns
from their beginning (they did not exist when the job started).

**Offsets live in the snapshot.** A reader uses ``assign`` (never a consumer group's
rebalancing) and keeps, for every Kafka partition it owns, the offset of the next record to
return. :meth:`KafkaReader.snapshot_state` saves them; after a restart
:meth:`KafkaReader.restore_state` seeks every owned partition to its saved offset (the state
of all old readers is merged, so a rescale finds every partition's offset). A partition the
state does not name is new since the snapshot and is read from its beginning. Once a snapshot
is complete, :meth:`KafkaReader.ack` commits its offsets to the consumer group
(``sparkjet-job-{job_id}`` unless named) for monitoring tools only: they are never read back.
A saved offset is the consumer's position where every record before it was returned, so it
passes transaction markers and aborted records at the end of a partition: a lag tool shows 0
once a job has read everything, on transactional input too.

State::

    {"kafka": {"<topic>": {"offsets": {"<partition>": <next offset>, ...},
                           "ends": {"<partition>": <end offset>, ...}}}}

(``-2`` is "the partition's beginning", Kafka's ``OFFSET_BEGINNING``; ``ends`` only when
bounded.)

**Isolation.** Records are read with ``isolation.level=read_committed``: a transactional
producer's output (sparkjet's own :class:`~sparkjet.sinks.KafkaSink` among them) is read
only once committed, so exactly-once holds from Kafka to Kafka.

**Columns.** ``key`` and ``value`` are each decoded as ``"raw"`` (binary), ``"utf8"``
(string, checked), or, for the value, ``"json"`` with a declared ``schema`` (one column per
field, parsed by Arrow's JSON reader; fields not in the schema are ignored, missing ones are
null). ``metadata`` adds ``_partition`` (int32), ``_offset`` (int64) and ``_timestamp``
(``timestamp[ms]``, the record's timestamp: give it to ``with_timestamps`` for event time
from Kafka, or name a field of the value instead). A record that does not decode (a key or
value that is not UTF-8, a value that does not fit the JSON schema) goes to the source's
``on_error`` (``read_from(source, on_error=...)``, else ``JobConfig.on_error``): "fail" stops
the job with :class:`~sparkjet.errors.BadRecordError` naming its topic, partition and offset;
"skip" drops it; a dead-letter sink gets its raw bytes (:mod:`sparkjet.connectors.dead_letters`).
A read returns the records of one source partition, so event time has a watermark per
source partition.

**Never a silent rewind.** The consumer's ``auto.offset.reset`` is ``error``: when a
partition no longer holds the job's position the reader is told, and so is it when a fetch
returns a record below the offset it expects, or when a partition it reads (or a restored
state names) no longer exists. That happens when the broker lost records it had
acknowledged (a single broker's disk, an unclean leader election: the log now ends before
the job's offset), when retention or ``delete-records`` removed records the job had not read
yet (the log now starts after it), or when the topic was deleted and recreated (fewer
partitions, shorter logs). Under ``on_offset_reset="fail"`` (the default) the job fails with
:class:`~sparkjet.errors.OffsetOutOfRangeError`, naming the topic, the partition, the
offset expected and the one found; a replay would repeat it, so no restart is tried.
``"earliest"`` or ``"latest"`` continue that partition from its log's start or end (a
vanished partition is dropped) with a warning on the ``sparkjet.kafka`` logger, counted in
the reader's ``offset_resets``: records may then be read twice or never, which the user
chose. A topic recreated with as many partitions and at least as many records as the job
had read cannot be told from the old one by a broker without topic ids (the tests' broker
has none): it is read on from the saved offsets.

**Bounded.** With ``bounded=True`` a reader ends every partition at the end offset it had
when first seen (saved in the state, so a restart ends at the same place).

Needs ``confluent-kafka`` (``pip install 'sparkjet[kafka]'``).
"""
from __future__ import annotations

import io
import json
import logging
import time
from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Literal

import pyarrow as pa
import pyarrow.json as pajson
from msgspec import Meta

from sparkjet._checks import check_distinct_ints, check_int
from sparkjet.connectors._settings import (
    Options,
    PositiveNumber,
    PositiveOrInfinite,
    Schema,
    Settings,
    SourcePartitions,
    Text,
)
from sparkjet.connectors.base import BadRecord, ProcessorContext, Source, SourceReader
from sparkjet.connectors.kafka.client import (
    DEFAULT_BOOTSTRAP,
    client_config,
    error_text,
    kafka_module,
    partitions_of,
    topic_partitions,
)
from sparkjet.errors import (
    ConnectorError,
    CorruptDataError,
    InvalidArgumentError,
    OffsetOutOfRangeError,
)

DECODINGS = ("raw", "utf8", "json")
METADATA = ("partition", "offset", "timestamp")
#: Kafka's "the partition's beginning" (``confluent_kafka.OFFSET_BEGINNING``).
BEGINNING = -2
#: What to do when a partition no longer holds the job's position (see the module doc).
OFFSET_RESETS = ("fail", "earliest", "latest")

log = logging.getLogger("sparkjet.kafka")


@dataclass(frozen=True)
class KafkaSourceSettings(Settings):
    """:class:`KafkaSource`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    topic: Text
    bootstrap_servers: Text = DEFAULT_BOOTSTRAP
    _: KW_ONLY
    partitions: SourcePartitions | None = None
    value: Literal["raw", "utf8", "json"] = "raw"           # DECODINGS
    schema: Schema | None = None
    key: Literal["raw", "utf8"] | None = None
    metadata: Annotated[tuple[Literal["partition", "offset", "timestamp"], ...],
                        Meta(description=f"names from {METADATA}")] = METADATA
    start: Literal["earliest", "latest"] = "earliest"
    bounded: bool = False
    group: Text | None = None
    discovery_interval: PositiveOrInfinite = 5.0
    timeout: PositiveNumber = 10.0
    config: Options | None = None
    on_offset_reset: Literal["fail", "earliest", "latest"] = "fail"     # OFFSET_RESETS

    def check(self) -> None:
        if (self.value == "json") != (self.schema is not None):
            raise self._error('value="json" needs a schema (a pyarrow.Schema), and only it '
                              "takes one")
        if self.config and "auto.offset.reset" in self.config:
            raise self._error(
                f"config sets auto.offset.reset={self.config['auto.offset.reset']!r}: the "
                "source handles a lost position itself; choose on_offset_reset='fail', "
                "'earliest' or 'latest' instead")
        self._derive("config", dict(self.config or {}))


class KafkaSource(Source):
    """Reads ``topic`` at ``bootstrap_servers`` as a replayable source (see the module doc).

    :param partitions: source partitions (default: the topic's partition count now).
    :param value: ``"raw"``, ``"utf8"`` or ``"json"`` (then ``schema`` is required).
    :param key: None (no key column), ``"raw"`` or ``"utf8"``: a column ``_key``.
    :param metadata: which of ``"partition"``, ``"offset"``, ``"timestamp"`` to add.
    :param start: where partitions known at the job's first start begin: ``"earliest"``
        or ``"latest"``; partitions found later always begin at their earliest record.
    :param bounded: end each partition at its end offset when first seen.
    :param config: further librdkafka consumer settings (security, fetch sizes, ...;
        not ``auto.offset.reset``: see ``on_offset_reset``).
    :param on_offset_reset: when a partition no longer holds the job's position (the
        broker lost records, retention removed unread ones, the topic was recreated):
        ``"fail"`` (default: :class:`~sparkjet.errors.OffsetOutOfRangeError`),
        ``"earliest"`` or ``"latest"`` (continue from the log's start or end, with a
        warning).

    >>> schema = pa.schema([("user", pa.string()), ("amount", pa.float64())])
    >>> KafkaSource("orders", "127.0.0.1:9092", value="json", schema=schema,
    ...             partitions=4)
    KafkaSource('orders', '127.0.0.1:9092', partitions=4, value='json')
    """

    name = "kafka"
    replayable = True

    def __init__(self, topic: str, bootstrap_servers: str = DEFAULT_BOOTSTRAP, *,
                 partitions: int | None = None, value: str = "raw",
                 schema: pa.Schema | None = None, key: str | None = None,
                 metadata=METADATA, start: str = "earliest", bounded: bool = False,
                 group: str | None = None, discovery_interval: float = 5.0,
                 timeout: float = 10.0, config: dict | None = None,
                 on_offset_reset: str = "fail"):
        KafkaSourceSettings.of(locals()).apply(self)
        if self.partitions is None:     # the topic's partition count now
            self.partitions = len(partitions_of(self.topic, self.bootstrap_servers,
                                                self.timeout, "Kafka source", self.config))

    def __repr__(self) -> str:
        return (f"KafkaSource({self.topic!r}, {self.bootstrap_servers!r}, "
                f"partitions={self.partitions}, value={self.value!r})")

    def partition_count(self) -> int:
        return self.partitions

    def group_name(self, context: ProcessorContext) -> str:
        """The consumer group the offsets are committed to (for monitoring only)."""
        return self.group if self.group is not None else f"sparkjet-job-{context.job_id}"

    def open(self, partitions: list[int], context: ProcessorContext) -> KafkaReader:
        return KafkaReader(self, partitions, context)


class KafkaReader(SourceReader):
    """Reads the Kafka partitions of some source partitions of a :class:`KafkaSource`."""

    def __init__(self, source: KafkaSource, partitions: list[int], context: ProcessorContext):
        self._source = source
        self._slots = set(check_distinct_ints("partitions", partitions, min=0,
                                              max=source.partitions - 1))
        kafka = self._kafka = kafka_module()
        config = client_config(source.bootstrap_servers, source.timeout, source.config)
        config.update({"group.id": source.group_name(context),
                       "enable.auto.commit": False,
                       "enable.auto.offset.store": False,
                       "isolation.level": "read_committed"})
        config.update(source.config)
        # A lost position is reported (an _AUTO_OFFSET_RESET event), never reset silently.
        config["auto.offset.reset"] = "error"
        self._consumer = kafka.Consumer(config)
        self._topic = source.topic
        self._next: dict[int, int] = {}     # owned Kafka partition -> next offset to return
        self._ends: dict[int, int] = {}     # bounded: Kafka partition -> end offset
        self._stash: list = []              # fetched records of other partitions, in order
        self._short = False                 # the last fetch gave fewer records than asked
        self._last: int | None = None
        self._restored: dict | None = None
        self._assigned = False
        self._next_discovery = 0.0
        self._acked: dict[int, int] = {}
        self._to_ack: dict[int, int] | None = None
        #: How many times a partition was moved under on_offset_reset "earliest"/"latest".
        self.offset_resets = 0
        try:
            self._known = topic_partitions(self._consumer, self._topic, source.timeout,
                                           "Kafka source", source.bootstrap_servers,
                                           config.get("logger"))
        except BaseException:
            self._consumer.close()
            raise
        self._fields = [] if source.schema is None else source.schema.names

    # -- assignment ------------------------------------------------------------------------

    def _owned(self, kafka_partitions) -> list[int]:
        n = self._source.partitions
        return [k for k in kafka_partitions if k % n in self._slots]

    def _assign(self) -> None:
        """Assigns every owned partition at its restored or starting offset."""
        restored = self._restored or {}
        offsets = restored.get("offsets", {})
        ends = restored.get("ends", {})
        first_start = self._restored is None
        known = set(self._known)
        for k in self._owned(sorted(int(k) for k in offsets)):
            if k not in known:
                self._vanished(k, int(offsets[str(k)]))
        for k in self._owned(self._known):
            if str(k) in offsets:
                self._next[k] = int(offsets[str(k)])
            elif first_start and self._source.start == "latest":
                self._next[k] = self._watermarks(k)[1]
            else:
                self._next[k] = BEGINNING
            if self._source.bounded:
                low, high = self._watermarks(k)
                self._ends[k] = int(ends[str(k)]) if str(k) in ends else high
                if self._next[k] == BEGINNING:
                    self._next[k] = low     # so that an empty partition is at its end
        self._add(list(self._next))
        self._assigned = True
        self._next_discovery = time.monotonic() + self._source.discovery_interval

    def _add(self, kafka_partitions: list[int]) -> None:
        if kafka_partitions:
            tp = self._kafka.TopicPartition
            self._consumer.incremental_assign(
                [tp(self._topic, k, self._next[k]) for k in kafka_partitions])

    def _watermarks(self, k: int) -> tuple[int, int]:
        tp = self._kafka.TopicPartition(self._topic, k)
        try:
            return self._consumer.get_watermark_offsets(tp, timeout=self._source.timeout)
        except self._kafka.KafkaException as e:
            raise ConnectorError(
                f"Kafka source: cannot read the offsets of topic {self._topic!r} partition {k} "
                f"at {self._source.bootstrap_servers}: {error_text(e)}") from None

    def _discover(self) -> None:
        """Assigns owned partitions that appeared since the last look, from their beginning."""
        self._next_discovery = time.monotonic() + self._source.discovery_interval
        try:
            md = self._consumer.list_topics(self._topic, timeout=self._source.timeout)
        except self._kafka.KafkaException:
            return      # the next read or look tells; a slow metadata answer is not an error
        topic = md.topics.get(self._topic)
        if topic is None or topic.error is not None or not topic.partitions:
            return
        self._known = sorted(topic.partitions)
        for k in [k for k in self._next if k not in topic.partitions]:
            self._vanished(k, self._next[k])
        new = [k for k in self._owned(sorted(topic.partitions)) if k not in self._next]
        for k in new:
            self._next[k] = BEGINNING
        self._add(new)

    # -- a lost position ---------------------------------------------------------------------

    def _out_of_range(self, k: int, requested: int) -> None:
        """The broker refused to fetch partition ``k`` at ``requested``: its log no longer
        holds the job's position."""
        expected = self._next.get(k, requested)
        if expected < 0:
            expected = requested
        low, high = self._watermarks(k)
        if expected < low:
            found, reason = low, (
                f"the partition's log now starts at offset {low}: records the job had not "
                "read were deleted (retention, delete-records) or the topic was recreated")
        elif expected > high:
            found, reason = high, (
                f"the partition's log now ends at offset {high}, before the job's position: "
                "the broker lost records it had acknowledged (a broker that lost its tail, an "
                "unclean leader election) or the topic was deleted and recreated")
        else:
            found, reason = high, (
                f"the broker refused the offset as out of range (its log now holds offsets "
                f"{low} to {high}): it changed under the job")
        self._rewound(k, expected, found, reason, low, high)

    def _rewound(self, k: int, expected: int, found: int, reason: str,
                 low: int | None = None, high: int | None = None) -> None:
        """Partition ``k`` no longer holds offset ``expected``: fails, or follows
        ``on_offset_reset``."""
        policy = self._source.on_offset_reset
        if policy == "fail":
            raise OffsetOutOfRangeError(self._topic, k, expected, found, reason)
        if low is None or high is None:
            low, high = self._watermarks(k)
        to = low if policy == "earliest" else high
        log.warning("Kafka source: topic %r partition %d: expected offset %d, found offset %d: "
                    "%s; on_offset_reset=%r: continuing from offset %d (records may be read "
                    "twice or never)", self._topic, k, expected, found, reason, policy, to)
        self.offset_resets += 1
        tp = self._kafka.TopicPartition
        self._consumer.incremental_unassign([tp(self._topic, k)])
        self._stash = [m for m in self._stash if m.partition() != k]
        self._next[k] = to
        self._add([k])

    def _vanished(self, k: int, expected: int) -> None:
        """Partition ``k``, which the job reads (or its restored state names), is gone."""
        reason = (f"the topic has {len(self._known)} partitions now: it was deleted and "
                  "recreated with fewer")
        if self._source.on_offset_reset == "fail":
            raise OffsetOutOfRangeError(self._topic, k, expected, None, reason)
        log.warning("Kafka source: topic %r partition %d: expected offset %d, found no such "
                    "partition: %s; on_offset_reset=%r: the partition is no longer read",
                    self._topic, k, expected, reason, self._source.on_offset_reset)
        self.offset_resets += 1
        if k in self._next:
            self._consumer.incremental_unassign([self._kafka.TopicPartition(self._topic, k)])
            del self._next[k]
            self._ends.pop(k, None)
        self._stash = [m for m in self._stash if m.partition() != k]

    # -- reading ---------------------------------------------------------------------------

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        """Up to ``max_rows`` records of one source partition; None if none are ready."""
        check_int("max_rows", max_rows, min=1)
        if not self._assigned:
            self._assign()
        if not self._source.bounded and time.monotonic() >= self._next_discovery:
            self._discover()
        if not self._stash:
            if not self._next:
                return None
            messages = self._consumer.consume(max_rows, 0)
            self._short = len(messages) < max_rows
            if not messages:
                return None
            self._stash = messages
        return self._take(max_rows)

    def caught_up(self) -> bool:
        """The client had fewer records than asked at the last fetch, and all were read."""
        return self._short and not self._stash

    def _take(self, max_rows: int) -> pa.RecordBatch | None:
        """The leading records of the stash that share the first one's source partition."""
        stash, n = self._stash, self._source.partitions
        slot = None
        take = []
        rest = []
        for i, m in enumerate(stash):
            err = m.error()
            if err is not None:
                if err.code() == self._kafka.KafkaError._PARTITION_EOF:
                    continue
                if err.code() == self._kafka.KafkaError._AUTO_OFFSET_RESET and \
                        m.partition() in self._next:
                    self._stash = take + rest + stash[i + 1:]
                    self._out_of_range(m.partition(), m.offset())
                    return self._take(max_rows) if self._stash else None
                self._stash = stash[i + 1:]
                if err.fatal() or not err.retriable():
                    raise ConnectorError(f"Kafka source: topic {self._topic!r}: {err.str()}")
                continue
            expected = self._next.get(m.partition(), BEGINNING)
            if 0 <= m.offset() < expected:
                # A fetch below the position: the client or the broker rewound.
                self._stash = take + rest + stash[i:]
                self._rewound(m.partition(), expected, m.offset(),
                              "a fetch returned a record below the job's position: the "
                              "partition's log changed under the job (or the client reset it)")
                return self._take(max_rows) if self._stash else None
            if slot is None:
                slot = m.partition() % n
            if m.partition() % n == slot and len(take) < max_rows:
                take.append(m)
            else:
                rest.append(m)
        self._stash = rest
        if not take:
            return None
        if self._source.bounded:
            take = [m for m in take if m.offset() < self._ends.get(m.partition(), 0)]
            if not take:
                return None
        for m in take:
            self._next[m.partition()] = m.offset() + 1
        self._last = slot
        return self._decode(take)

    def _decode(self, messages: list) -> pa.RecordBatch | None:
        """The records as a batch; one that does not decode goes to :meth:`bad_record`
        (the source's ``on_error``) and the others are decoded without it."""
        try:
            return self._decode_all(messages)
        except (CorruptDataError, ValueError):
            pass
        good = []
        for m in messages:
            problem = self._problem(m)
            if problem is None:
                good.append(m)
                continue
            column, reason = problem
            self.bad_record(BadRecord(
                reason, column, m.key() if column == "_key" else m.value(), m.partition(),
                m.offset(), f"topic {self._topic!r} partition {m.partition()} offset {m.offset()}"))
        return self._decode_all(good) if good else None

    def _problem(self, m) -> tuple[str, str] | None:
        """Why record ``m`` does not decode (its column and the reason), or None."""
        src, prefix = self._source, f"Kafka source: {self._where(m)}: "
        try:
            if src.key is not None:
                try:
                    self._text_or_raw([m.key()], src.key, [m], "key")
                except CorruptDataError as e:
                    return "_key", str(e).removeprefix(prefix)
            if src.value == "json":
                self._json([m.value()], [m])
            else:
                self._text_or_raw([m.value()], src.value, [m], "value")
        except (CorruptDataError, ValueError) as e:
            return "value", str(e).removeprefix(prefix)
        return None

    def _decode_all(self, messages: list) -> pa.RecordBatch:
        src = self._source
        columns, names = [], []
        if src.key is not None:
            columns.append(self._text_or_raw([m.key() for m in messages], src.key, messages,
                                             "key"))
            names.append("_key")
        values = [m.value() for m in messages]
        if src.value == "json":
            table = self._json(values, messages)
            columns.extend(table.column(i).combine_chunks() for i in range(table.num_columns))
            names.extend(table.column_names)
        else:
            columns.append(self._text_or_raw(values, src.value, messages, "value"))
            names.append("value")
        if "partition" in src.metadata:
            columns.append(pa.array([m.partition() for m in messages], pa.int32()))
            names.append("_partition")
        if "offset" in src.metadata:
            columns.append(pa.array([m.offset() for m in messages], pa.int64()))
            names.append("_offset")
        if "timestamp" in src.metadata:
            columns.append(pa.array([m.timestamp()[1] for m in messages], pa.timestamp("ms")))
            names.append("_timestamp")
        return pa.RecordBatch.from_arrays(columns, names=names)

    def _where(self, m) -> str:
        return f"topic {self._topic!r} partition {m.partition()} offset {m.offset()}"

    def _text_or_raw(self, data: list, decoding: str, messages: list, what: str) -> pa.Array:
        raw = pa.array(data, pa.binary())
        if decoding == "raw":
            return raw
        try:
            return raw.cast(pa.string())
        except pa.ArrowInvalid:
            for m, d in zip(messages, data):
                if d is not None:
                    try:
                        d.decode()
                    except UnicodeDecodeError as e:
                        raise CorruptDataError(
                            f"Kafka source: {self._where(m)}: the {what} is not UTF-8: {e}"
                        ) from None
            raise

    def _json(self, values: list, messages: list) -> pa.Table:
        """Parses the values with Arrow's JSON reader in one go; on failure finds the first
        record that does not parse or fit the schema, and names it."""
        schema = self._source.schema
        lines = [b"{}" if v is None else v for v in values]
        # JSON is UTF-8, and Arrow's reader would pass bad bytes on into string columns
        self._text_or_raw(lines, "utf8", messages, "value")
        if any(b"\n" in v for v in lines):
            # Arrow reads one document per line: take pretty-printed ones apart first.
            lines = [json.dumps(json.loads(v)).encode() if b"\n" in v else v for v in lines]
        options = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        try:
            table = pajson.read_json(io.BytesIO(b"\n".join(lines)), parse_options=options)
            if table.num_rows == len(lines):
                return table.select(schema.names).cast(schema)
            problem = f"{len(lines)} records gave {table.num_rows} rows"
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            problem = str(e)
        for m, line in zip(messages, lines):
            try:
                one = pajson.read_json(io.BytesIO(line), parse_options=options)
                if one.num_rows != 1:
                    raise pa.ArrowInvalid("not one JSON object")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                raise CorruptDataError(
                    f"Kafka source: {self._where(m)}: the value does not match the JSON "
                    f"schema ({', '.join(f'{f.name}: {f.type}' for f in schema)}): {e}"
                ) from None
        raise CorruptDataError(f"Kafka source: topic {self._topic!r}: {problem}")

    def last_partition(self) -> int | None:
        return self._last

    def at_end(self) -> bool:
        """Bounded: True once every owned partition reached its end offset. Unbounded: never."""
        if not self._source.bounded:
            return False
        if not self._assigned:
            self._assign()
        if self._stash:
            return False
        if all(self._next[k] >= e for k, e in self._ends.items()):
            return True
        self._catch_up([k for k, e in self._ends.items() if self._next[k] < e])
        return all(self._next[k] >= e for k, e in self._ends.items())

    def _catch_up(self, partitions: list[int]) -> None:
        """Moves the next offset of each of ``partitions`` none of whose fetched records
        waits in the stash to the consumer's position, if that is further: transaction
        markers and aborted records take offsets no record is returned from, and once
        nothing is waiting the position says how far the reader really is."""
        stashed = {m.partition() for m in self._stash}
        waiting = [k for k in partitions if k not in stashed]
        if not waiting:
            return
        tp = self._kafka.TopicPartition
        for p in self._consumer.position([tp(self._topic, k) for k in waiting]):
            if p.offset >= 0 and p.offset > self._next.get(p.partition, p.offset):
                self._next[p.partition] = p.offset

    # -- snapshots -------------------------------------------------------------------------

    def snapshot_state(self) -> dict:
        if not self._assigned:
            self._assign()
        # Past trailing transaction markers: the group offsets ack commits then show no lag.
        self._catch_up(list(self._next))
        offsets = {str(k): v for k, v in self._next.items()}
        self._to_ack = dict(self._next)
        state = {"offsets": offsets}
        if self._source.bounded:
            state["ends"] = {str(k): v for k, v in self._ends.items()}
        return {"kafka": {self._topic: state}}

    def restore_state(self, state: dict | None) -> None:
        """Seeks the owned partitions to the offsets in ``state`` (None: the start)."""
        restored = None
        if state is not None:
            mine = state.get("kafka", {}).get(self._topic) if isinstance(state, dict) else None
            if not isinstance(mine, dict) or not isinstance(mine.get("offsets"), dict):
                raise InvalidArgumentError(
                    f"a Kafka source state is {{'kafka': {{topic: {{'offsets': {{partition: "
                    f"offset}}}}}}}}, got {state!r}")
            restored = mine
        if self._assigned:
            self._consumer.unassign()
            self._next, self._ends, self._stash = {}, {}, []
        self._restored = restored
        self._assign()

    def ack(self, snapshot_id: int) -> None:
        """Commits the offsets of the snapshot to the consumer group, for monitoring."""
        if self._to_ack is None:
            return
        tp = self._kafka.TopicPartition
        due = [tp(self._topic, k, v) for k, v in self._to_ack.items()
               if v >= 0 and self._acked.get(k) != v]
        self._to_ack = None
        if due:
            try:
                self._consumer.commit(offsets=due, asynchronous=True)
            except self._kafka.KafkaException:
                return      # monitoring only: the next snapshot commits again
            self._acked.update({p.partition: p.offset for p in due})

    def close(self) -> None:
        self._consumer.close()


def read_topic(topic: str, bootstrap_servers: str = DEFAULT_BOOTSTRAP, *, value: str = "raw",
               schema: pa.Schema | None = None, key: str | None = None,
               metadata=METADATA, timeout: float = 30.0, config: dict | None = None) -> pa.Table:
    """Every committed record of ``topic`` now (``read_committed``), decoded as a
    :class:`KafkaSource` would: for checking what a job wrote. ``timeout``: the seconds
    it waits without a record before it gives up (a transaction left open holds a
    ``read_committed`` consumer back), however long a large topic takes to read."""
    source = KafkaSource(topic, bootstrap_servers, value=value, schema=schema, key=key,
                         metadata=metadata, bounded=True, timeout=min(timeout, 10.0),
                         config=config)
    context = ProcessorContext(job_id=0, execution_id=0, vertex="read_topic", processor=0,
                               processors=1)
    reader = source.open(list(range(source.partitions)), context)
    batches = []
    deadline = time.monotonic() + timeout
    try:
        reader.restore_state(None)
        while not reader.at_end():
            if time.monotonic() > deadline:
                raise ConnectorError(
                    f"Kafka source: topic {topic!r} not read to its end: no record for "
                    f"{timeout:g} s (an open transaction holds read_committed consumers back)")
            batch = reader.read(100_000)
            if batch is None:
                time.sleep(0.01)
            else:
                batches.append(batch)
                deadline = time.monotonic() + timeout
    finally:
        reader.close()
    if not batches:
        return pa.table({})
    return pa.Table.from_batches(batches)
