"""The Kafka source never rewinds silently (issue 26): a broker that lost its tail (killed
and started again from an earlier save of its disk), records deleted before they were
read, a topic deleted and recreated, and a fetch below the position are each an
:class:`~sparkjet.errors.OffsetOutOfRangeError` naming the topic, the partition, the offset
expected and the one found, or follow ``on_offset_reset="earliest"|"latest"`` with a
warning. Also: the group offsets committed for monitoring pass trailing transaction markers
(issue 26, item 7).

Each test has a broker of its own (``noida-db``, :mod:`kafka_broker`): they kill it."""
import logging
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from helpers import kafka_broker

from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import InvalidArgumentError, OffsetOutOfRangeError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.runtime.failures import is_deterministic
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import KafkaSource


class Brokers:
    """The test's broker; :func:`kafka_broker.lose_tail` replaces it (same address)."""

    def __init__(self, directory):
        self.current = kafka_broker.start(directory)

    @property
    def bootstrap(self):
        return self.current.bootstrap

    def lose_tail(self, earlier: bytes):
        self.current = kafka_broker.lose_tail(self.current, earlier)


@pytest.fixture
def broker(tmp_path):
    (tmp_path / "broker").mkdir()
    b = Brokers(tmp_path / "broker")
    yield b
    b.current.stop()


def new_topic(broker, partitions=1):
    topic = f"t-{uuid.uuid4().hex[:10]}"
    kafka_broker.create_topic(broker.bootstrap, topic, partitions)
    return topic


def produce(broker, topic, values, partition=0):
    p = Producer({"bootstrap.servers": broker.bootstrap})
    for v in values:
        p.produce(topic, value=str(v).encode(), partition=partition)
    assert p.flush(10) == 0


def context(execution_id=1):
    return ProcessorContext(job_id=7, execution_id=execution_id, vertex="v", processor=0,
                            processors=1)


def read_for(reader, quiet=1.0, limit=30.0):
    """The values read until nothing came for ``quiet`` seconds."""
    out, last, start = [], time.monotonic(), time.monotonic()
    while time.monotonic() - last < quiet:
        assert time.monotonic() - start < limit, "the reader never went quiet"
        batch = reader.read(1000)
        if batch is None:
            time.sleep(0.01)
        else:
            out.extend(int(v) for v in batch.column("value").to_pylist())
            last = time.monotonic()
    return out


def read_until_error(reader, limit=30.0):
    """Reads until the reader raises; the error (a reader that never does fails the test)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            reader.read(1000)
        except OffsetOutOfRangeError as e:
            return e
        time.sleep(0.01)
    raise AssertionError(f"no OffsetOutOfRangeError within {limit:g} s")


def truncated_broker(broker, topic):
    """Partition 0 of ``topic`` holds 0..999, the broker saved 0..299: returns that save."""
    produce(broker, topic, range(300))
    earlier = kafka_broker.saved_copy(broker.current, topic, {0: 300})
    produce(broker, topic, range(300, 1000))
    return earlier


# -- a broker that lost its tail ---------------------------------------------------------------


@pytest.mark.parametrize("when", ["running", "resumed"])
def test_a_broker_that_lost_its_tail_fails_the_reader(broker, when):
    topic = new_topic(broker)
    earlier = truncated_broker(broker, topic)
    source = KafkaSource(topic, broker.bootstrap, metadata=())
    reader = source.open([0], context())
    assert read_for(reader) == list(range(1000))
    state = reader.snapshot_state()
    assert state["kafka"][topic]["offsets"] == {"0": 1000}
    if when == "resumed":
        reader.close()
    broker.lose_tail(earlier)       # the log now ends at 300: 300..999 are gone
    produce(broker, topic, range(5000, 5100))       # and the producers write on: 300..399
    if when == "resumed":
        reader = source.open([0], context(execution_id=2))
        reader.restore_state(state)
    error = read_until_error(reader)
    reader.close()
    assert (error.topic, error.partition, error.expected, error.found) == (topic, 0, 1000, 400)
    assert str(error).startswith(f"Kafka source: topic {topic!r} partition 0: expected offset "
                                 "1000, found offset 400: the partition's log now ends at "
                                 "offset 400, before the job's position")
    assert "on_offset_reset='earliest' or 'latest'" in str(error)
    assert is_deterministic(error)


@pytest.mark.parametrize("policy", ["earliest", "latest"])
def test_a_lost_tail_under_a_reset_policy_warns_and_moves(broker, caplog, policy):
    topic = new_topic(broker)
    earlier = truncated_broker(broker, topic)
    reader = KafkaSource(topic, broker.bootstrap, metadata=(),
                         on_offset_reset=policy).open([0], context())
    assert read_for(reader) == list(range(1000))
    broker.lose_tail(earlier)
    produce(broker, topic, range(5000, 5100))
    with caplog.at_level(logging.WARNING, logger="sparkjet.kafka"):
        got = read_for(reader, quiet=3.0)
        produce(broker, topic, range(9000, 9005))
        got += read_for(reader)
    state = reader.snapshot_state()
    reader.close()
    if policy == "earliest":    # the log again from its start: 0..299, then what came after
        assert got == [*range(300), *range(5000, 5100), *range(9000, 9005)]
    else:                       # from the log's end: only what came after the reset
        assert got == list(range(9000, 9005))
    assert state["kafka"][topic]["offsets"] == {"0": 405}
    assert reader.offset_resets == 1
    [warning] = [r for r in caplog.records if r.name == "sparkjet.kafka"]
    assert warning.levelno == logging.WARNING
    start = 0 if policy == "earliest" else 400
    assert (f"topic {topic!r} partition 0: expected offset 1000, found offset 400"
            in warning.getMessage())
    assert f"on_offset_reset={policy!r}: continuing from offset {start}" in warning.getMessage()


# -- records deleted before they were read, a topic recreated, a fetch below the position ------


def test_records_deleted_before_they_were_read(broker):
    topic = new_topic(broker)
    produce(broker, topic, range(100))
    # A job saved offset 20, then retention removed 0..59 before it resumed.
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.delete_records([TopicPartition(topic, 0, 60)]).values():
        f.result(10)
    source = KafkaSource(topic, broker.bootstrap, metadata=())
    reader = source.open([0], context())
    reader.restore_state({"kafka": {topic: {"offsets": {"0": 20}}}})
    error = read_until_error(reader)
    reader.close()
    assert (error.partition, error.expected, error.found) == (0, 20, 60)
    assert "the partition's log now starts at offset 60" in str(error)

    later = KafkaSource(topic, broker.bootstrap, metadata=(), on_offset_reset="earliest")
    reader = later.open([0], context())
    reader.restore_state({"kafka": {topic: {"offsets": {"0": 20}}}})
    assert read_for(reader) == list(range(60, 100))
    reader.close()


def recreate(broker, topic, partitions):
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.delete_topics([topic]).values():
        f.result(10)
    deadline = time.monotonic() + 10
    while True:
        try:
            kafka_broker.create_topic(broker.bootstrap, topic, partitions)
            return
        except Exception:  # noqa: BLE001 - the deletion not finished yet
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_topic_recreated_with_fewer_partitions(broker):
    topic = new_topic(broker, 2)
    produce(broker, topic, range(10), partition=0)
    produce(broker, topic, range(10, 20), partition=1)
    source = KafkaSource(topic, broker.bootstrap, metadata=(), discovery_interval=0.2)
    running = source.open([0, 1], context())
    assert sorted(read_for(running)) == list(range(20))
    state = running.snapshot_state()
    recreate(broker, topic, 1)
    error = read_until_error(running)
    running.close()
    assert (error.partition, error.found) == (1, None)
    assert "found no such partition: the topic has 1 partitions now" in str(error)

    resumed = source.open([0, 1], context(execution_id=2))
    with pytest.raises(OffsetOutOfRangeError, match=rf"topic '{topic}' partition 1: expected "
                                                    r"offset 10, found no such partition"):
        resumed.restore_state(state)
    resumed.close()

    # Under a policy, the gone partition is dropped; partition 0's log is empty: from 0.
    produce(broker, topic, range(100, 103), partition=0)
    lenient = KafkaSource(topic, broker.bootstrap, metadata=(), on_offset_reset="earliest",
                          partitions=2).open([0, 1], context(execution_id=3))
    lenient.restore_state(state)
    assert read_for(lenient) == [100, 101, 102]
    assert lenient.snapshot_state()["kafka"][topic]["offsets"] == {"0": 3}
    assert lenient.offset_resets == 2       # partition 1 gone, partition 0 out of range
    lenient.close()


def test_a_topic_recreated_with_as_many_partitions(broker):
    topic = new_topic(broker)
    produce(broker, topic, range(50))
    source = KafkaSource(topic, broker.bootstrap, metadata=())
    reader = source.open([0], context())
    assert read_for(reader) == list(range(50))
    recreate(broker, topic, 1)
    produce(broker, topic, range(7))
    error = read_until_error(reader)
    reader.close()
    assert (error.partition, error.expected, error.found) == (0, 50, 7)
    assert "deleted and recreated" in str(error)


def test_a_fetch_below_the_position(broker):
    """The client itself rewinds (as librdkafka's own offset reset would): the reader
    notices a record below its position."""
    topic = new_topic(broker)
    produce(broker, topic, range(30))
    reader = KafkaSource(topic, broker.bootstrap, metadata=()).open([0], context())
    assert read_for(reader) == list(range(30))
    reader._consumer.seek(TopicPartition(topic, 0, 5))
    error = read_until_error(reader)
    reader.close()
    assert (error.expected, error.found) == (30, 5)
    assert "a fetch returned a record below the job's position" in str(error)


def test_the_client_reset_setting_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"KafkaSource: config sets "
                                                   r"auto.offset.reset='earliest'.*"
                                                   r"on_offset_reset"):
        KafkaSource("t", "127.0.0.1:1", partitions=1, config={"auto.offset.reset": "earliest"})
    with pytest.raises(InvalidArgumentError, match="on_offset_reset"):
        KafkaSource("t", "127.0.0.1:1", partitions=1, on_offset_reset="smallest")


# -- a job ---------------------------------------------------------------------------------


def test_a_job_fails_when_the_broker_lost_its_tail(broker, tmp_path):
    """The issue's case: before, the job read the log again from its start under
    exactly-once, without a word. Now it fails at once (no restart would cure it), and what
    it committed is every record once."""
    topic = new_topic(broker)
    earlier = truncated_broker(broker, topic)
    out = tmp_path / "out"
    pipeline = (Pipeline().read_from(KafkaSource(topic, broker.bootstrap, metadata=()))
                .write_to(TransactionalFileSink(out)))
    config = JobConfig(name="kafka-lost-tail", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.1, local_parallelism=1, max_restarts=5,
                       restart_backoff=0.05)
    job = Job(pipeline, config)
    handle = job.submit()
    try:
        deadline = time.monotonic() + 60
        while len(committed(out)) < 1000:
            assert time.monotonic() < deadline, "the job did not commit the topic"
            time.sleep(0.1)
        broker.lose_tail(earlier)
        produce(broker, topic, range(5000, 5100))
        with pytest.raises(JobFailedError) as failed:
            handle.result(timeout=60)
    finally:
        if not handle.done():
            handle.cancel(timeout=30)
    text = str(failed.value)
    assert "OffsetOutOfRangeError" in text
    assert f"topic {topic!r} partition 0: expected offset 1000, found offset 400" in text
    assert handle.metrics["restarts"] == 0     # deterministic: no replay tried
    assert sorted(committed(out)) == list(range(1000))


@pytest.mark.parametrize("policy", ["earliest", "latest"])
def test_a_reset_under_a_job_is_counted_in_its_metrics_and_result(broker, tmp_path, policy):
    """A job whose source follows ``on_offset_reset`` past a lost tail goes on, and says so
    beyond the member's log: the live metrics and the JobResult count the reset."""
    topic = new_topic(broker)
    earlier = truncated_broker(broker, topic)
    out = tmp_path / "out"
    source = KafkaSource(topic, broker.bootstrap, metadata=(), on_offset_reset=policy)
    pipeline = Pipeline().read_from(source).write_to(TransactionalFileSink(out))
    config = JobConfig(name=f"kafka-reset-{policy}", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.1, local_parallelism=1)
    handle = Job(pipeline, config).submit()
    try:
        deadline = time.monotonic() + 60
        while len(committed(out)) < 1000:
            assert time.monotonic() < deadline, "the job did not commit the topic"
            time.sleep(0.1)
        assert handle.metrics["offset_resets"] == 0
        broker.lose_tail(earlier)
        produce(broker, topic, range(5000, 5100))
        while handle.metrics["offset_resets"] == 0:
            assert time.monotonic() < deadline + 60, "no reset counted"
            assert not handle.done(), "the job ended"
            time.sleep(0.1)
        result = handle.stop(timeout=60)
    finally:
        if not handle.done():
            handle.cancel(timeout=30)
    assert result.offset_resets == 1 and result.restarts == 0
    assert handle.metrics["offset_resets"] == 1


def committed(out):
    if not out.exists():
        return []
    try:
        t = TransactionalFileSink.read(out)
    except Exception:  # noqa: BLE001 - nothing committed yet
        return []
    return [int(v) for v in t.column("value").to_pylist()] if t.num_rows else []


# -- group offsets for monitoring (issue 26, item 7) ------------------------------------------


def test_group_offsets_pass_trailing_transaction_markers(broker):
    topic = new_topic(broker, 2)
    p = Producer({"bootstrap.servers": broker.bootstrap, "transactional.id": topic})
    p.init_transactions(10)
    for t in range(3):
        p.begin_transaction()
        for k in range(2):
            for i in range(5):
                p.produce(topic, value=str(t * 100 + k * 10 + i).encode(), partition=k)
        p.commit_transaction(10)
    source = KafkaSource(topic, broker.bootstrap, metadata=(), group=f"g-{topic}")
    reader = source.open([0, 1], context())
    assert len(read_for(reader)) == 30
    state = reader.snapshot_state()
    reader.ack(1)
    # The consumer group a lag tool reads: end offset - committed is 0 on every partition.
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"g-{topic}"})
    deadline = time.monotonic() + 10
    while True:
        got = c.committed([TopicPartition(topic, k) for k in (0, 1)], timeout=5)
        lag = {tp.partition: c.get_watermark_offsets(tp, timeout=5)[1] - tp.offset
               for tp in got}
        if lag == {0: 0, 1: 0} or time.monotonic() > deadline:
            break
        reader.read(1)      # serves the asynchronous commit's callback
        time.sleep(0.05)
    c.close()
    reader.close()
    assert lag == {0: 0, 1: 0}
    # 3 transactions of 5 records and a marker each: the snapshot passes the last marker too.
    assert state["kafka"][topic]["offsets"] == {"0": 18, "1": 18}
