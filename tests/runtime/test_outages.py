"""Outages of the systems a job reads from and writes to, told apart from errors about the
data (issue 26, item 2): the real server (PostgreSQL, the Kafka broker, the S3 server,
redis-server) is stopped under a running job for longer than one backoff step and started
again on the same port with the same data. The job waits (restarts with backoff, each
failure reported as transient with its kind, never cut short by the "failed twice the same
way" rule), resumes, and its output is exactly-once as the real system holds it afterwards
(Kafka: see its test for what this broker allows to be checked).

Before the fix the PostgreSQL and Redis outages failed the job: the second (Redis: third)
identical "connection refused" was judged an error a replay repeats, with max_restarts
unused. The Kafka and S3 outages happened to cost a single restart (which the old rule
allowed), so there the old code fails only the check that each restart is reported as
transient.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from sparkjet import verify
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sources import GeneratorSource

#: How long a server stays down: several backoff steps of the jobs below.
OUTAGE_S = 3.0


class Outage:
    """Stops a server (``down()``) once the job has completed ``after`` snapshots, keeps it
    down ``seconds``, then starts it again (``up()``); records the job's progress events."""

    def __init__(self, down, up, seconds: float = OUTAGE_S, after: int = 2):
        self.down, self.up, self.seconds, self.after = down, up, seconds, after
        self.events: list[dict] = []
        self.began = threading.Event()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._snapshots = 0

    def on_progress(self, event: dict) -> None:
        self.events.append(event)
        if event["event"] == "snapshot":
            self._snapshots += 1
            if self._snapshots >= self.after:
                self.began.set()

    def _run(self) -> None:
        if not self.began.wait(120):
            return
        self.down()
        self.downtime = time.monotonic()
        time.sleep(self.seconds)
        self.up()
        self.ended.set()

    def join(self) -> None:
        self.began.set()   # a job that ended early still brings the server back
        self._thread.join(60)

    @property
    def restarts(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "restart"]


def run(job: Job, outage: Outage):
    try:
        result = job.run(on_progress=outage.on_progress)
    finally:
        outage.join()
    assert outage.ended.is_set(), "the job ended before the outage ended: it proves nothing"
    return result


def check_transient_restarts(outage: Outage, result, config: JobConfig) -> None:
    """The outage cost restarts, each reported as transient with its kind, within the
    bounds of the restart policy."""
    restarts = outage.restarts
    assert restarts, "the outage caused no restart"
    assert result.restarts == len(restarts) <= config.max_restarts
    for r in restarts:
        assert r.get("transient"), r
        assert r["message"].startswith(f"transient: {r['transient']}, retrying in "), r
        assert f"of {config.max_restarts}, window " in r["message"], r


def source(total: int = 40_000, rate: float = 8_000) -> GeneratorSource:
    return GeneratorSource(total=total, partitions=2, keys=1_000, rate=rate, batch_size=1_000)


def config(name: str, tmp_path, **overrides) -> JobConfig:
    settings = {"snapshot_store": str(tmp_path / "snapshots"), "snapshot_interval": 0.2,
                "max_restarts": 8, "restart_backoff": 0.2, **overrides}
    return JobConfig(name=name, **settings)


def check_exactly_once(ids: pa.Array | np.ndarray, total: int) -> None:
    wanted = pa.array(np.arange(total, dtype=np.int64))
    report = verify.check_events(wanted, wanted, pa.array(np.asarray(ids, dtype=np.int64)),
                                 guarantee="exactly-once")
    assert report.lost_count == 0 and report.duplicated_count == 0, str(report)
    assert report.valid, str(report)


# -- PostgreSQL ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def postgres():
    """A server of this module's own: it is stopped and restarted under the jobs."""
    import os

    from helpers import postgres_server

    try:
        s = postgres_server.start()
    except postgres_server.PostgresServerMissing as e:
        if os.environ.get("SPARKJET_CI"):
            pytest.fail(str(e), pytrace=False)
        pytest.skip(str(e))
    yield s
    s.stop()


def postgres_job(server, table: str, tmp_path, total: int, **overrides) -> Job:
    pytest.importorskip("psycopg")
    from sparkjet.sinks import PostgresSink

    PostgresSink.drop(server.dsn, table)
    pipeline = Pipeline().read_from(source(total)).write_to(PostgresSink(server.dsn, table))
    return Job(pipeline, config(table, tmp_path, **overrides))


def postgres_prepared(server, table: str) -> list[str]:
    import psycopg

    with psycopg.connect(server.dsn) as con:
        return [g for (g,) in con.execute("SELECT gid FROM pg_prepared_xacts") if f":{table}:" in g]


def check_postgres(server, table: str, total: int) -> None:
    import psycopg

    with psycopg.connect(server.dsn) as con:
        ids = [i for (i,) in con.execute(f'SELECT id FROM "{table}"')]
    check_exactly_once(ids, total)
    assert postgres_prepared(server, table) == []


def test_a_postgres_outage_is_waited_out_and_the_output_is_exactly_once(postgres, tmp_path):
    total = 40_000
    job = postgres_job(postgres, "outage", tmp_path, total)
    outage = Outage(postgres.halt, postgres.restart)
    result = run(job, outage)
    check_transient_restarts(outage, result, job.config)
    kinds = {r["transient"] for r in outage.restarts}
    assert kinds & {"connection refused", "server shutting down", "connection lost"}, kinds
    check_postgres(postgres, "outage", total)


def test_an_outage_longer_than_four_backoff_steps_is_waited_out_with_the_fifth(postgres,
                                                                             tmp_path):
    """The issue's case below at a quarter of its times (CI runs this one): PostgreSQL down
    for 5 s under a job with max_restarts=5 and 0.25 s doubling, whose first four waits
    (3.75 s) end inside the outage and whose five (7.75 s) outlast it, as 20 s against 1 s
    doubling (15 s, 31 s). The old code failed it as it failed the issue's: the second
    identical "connection refused" ended the job with its restarts unused."""
    total = 40_000
    job = postgres_job(postgres, "outage5", tmp_path, total, max_restarts=5,
                       restart_backoff=0.25)
    outage = Outage(postgres.halt, postgres.restart, seconds=5.0)
    result = run(job, outage)
    check_transient_restarts(outage, result, job.config)
    check_postgres(postgres, "outage5", total)


@pytest.mark.slow
@pytest.mark.long     # ~45 s, 31 s of it waiting: the test above is it at a quarter of the times
def test_the_20_s_postgres_outage_of_issue_26(postgres, tmp_path):
    """The issue's case: PostgreSQL down for 20 s under a job with max_restarts=5 (which
    failed after 11.7 s with its restarts unused). The waits must add up to more than the
    outage: 1 s doubling is 31 s over 5 restarts (0.5 s would be 15.5 s, which covers 20 s
    only as long as each attempt takes a second to fail, so a fast machine fails it)."""
    total = 100_000
    job = postgres_job(postgres, "outage20", tmp_path, total, max_restarts=5,
                       restart_backoff=1.0)
    outage = Outage(postgres.halt, postgres.restart, seconds=20.0)
    result = run(job, outage)
    check_transient_restarts(outage, result, job.config)
    check_postgres(postgres, "outage20", total)


# -- Kafka -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A broker of this module's own: it is stopped and restarted under the jobs."""
    pytest.importorskip("confluent_kafka")
    from helpers import kafka_broker

    b = kafka_broker.start(tmp_path_factory.mktemp("kafka"))
    yield b
    b.stop()


def test_a_kafka_broker_outage_is_waited_out_and_nothing_is_lost(broker, tmp_path):
    """The exactly-once Kafka sink's broker stopped and started again: phase 2 (the
    transaction) fails while it is down, each failure is transient, the restarted
    execution's producers connect anew and recovery produces the staged snapshots; the job
    ends well and the broker's log holds every id.

    Exactly-once as a ``read_committed`` consumer sees it cannot be checked on this broker:
    noida-db 0.2.3 does not keep its transactions across its own restart (a transaction
    committed during its shutdown reads as aborted afterwards, or one open at the halt is
    never aborted and holds back the last stable offset), see
    :func:`test_noida_db_keeps_transactions_across_a_restart`. On Kafka, whose transaction
    log survives a restart, the recovery above is what the kill campaigns check."""
    import json

    from helpers import kafka_broker

    from sparkjet.sinks import KafkaSink

    total, topic = 40_000, "outage"
    kafka_broker.create_topic(broker.bootstrap, topic, 2)
    # a short timeout: each execution fails fast while the broker is down (several
    # failures the same way, which the old rule took for an error a replay repeats)
    sink = KafkaSink(topic, broker.bootstrap, staging=tmp_path / "staging", key="key",
                     timeout=1.0)
    job = Job(Pipeline().read_from(source(total)).write_to(sink), config("kafka", tmp_path))
    outage = Outage(broker.halt, broker.restart, seconds=4.0)
    result = run(job, outage)
    check_transient_restarts(outage, result, job.config)
    kinds = {r["transient"] for r in outage.restarts}
    assert kinds <= {"connection lost", "connection refused", "brokers down", "timeout",
                     "coordinator unavailable", "coordinator loading"}, kinds
    written = {json.loads(v)["id"] for v in consume(broker.bootstrap, topic, "read_uncommitted")}
    assert written == set(range(total))


# Not strict: the loss depends on where the broker's shutdown falls in its save cycle, and
# under load the commit sometimes lands in time (an XPASS then says nothing of a fix).
@pytest.mark.xfail(strict=False, raises=AssertionError, reason="known broker defect: noida-db "
                   "0.2.3 loses a transaction committed while it shuts down (not always)")
def test_noida_db_keeps_transactions_across_a_restart(tmp_path):
    """Plain confluent-kafka, no sparkjet: a transaction whose commit the broker
    acknowledged while shutting down (SIGTERM) must stay committed after the restart."""
    pytest.importorskip("confluent_kafka")
    from confluent_kafka import Producer
    from helpers import kafka_broker

    b = kafka_broker.start(tmp_path)
    try:
        kafka_broker.create_topic(b.bootstrap, "t", 1)
        p = Producer({"bootstrap.servers": b.bootstrap, "transactional.id": "x",
                      "queue.buffering.max.messages": 1_000_000})
        p.init_transactions(10)
        p.begin_transaction()
        for n in range(100_000):
            p.produce("t", b"%d" % n, partition=0)
        committed = threading.Thread(target=p.commit_transaction, args=(30,))
        committed.start()
        b.halt()
        committed.join()
        b.restart()
        assert len(consume(b.bootstrap, "t", "read_committed")) == 100_000
    finally:
        b.stop()


def consume(bootstrap: str, topic: str, isolation: str) -> list[bytes]:
    """The values of every record of `topic` a consumer with ``isolation.level`` `isolation`
    reads from the beginning to the end of each partition (the independent check)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{isolation}",
                         "isolation.level": isolation, "enable.auto.commit": False,
                         "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        values, ended, deadline = [], set(), time.monotonic() + 60
        while len(ended) < len(partitions) and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error() is not None:
                if message.error().code() == message.error()._PARTITION_EOF:
                    ended.add(message.partition())
                    continue
                raise RuntimeError(f"reading {topic}: {message.error()}")
            values.append(message.value())
        assert len(ended) == len(partitions), f"{topic} not read to its end"
        return values
    finally:
        consumer.close()


# -- S3 ----------------------------------------------------------------------------------------

@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server of one test, and what an outage of it does: ``(s3_server, endpoint,
    outage(**kw))``; the outage halts the newest server and restarts one on the same port
    with the same objects."""
    pytest.importorskip("moto.server")
    from helpers import s3_server

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    server, endpoint = s3_server.start()
    servers = [server]

    def outage(**kw):
        return Outage(lambda: s3_server.halt(servers[-1]),
                      lambda: servers.append(s3_server.restart(endpoint)), **kw)

    try:
        yield s3_server, endpoint, outage
    finally:
        servers[-1].stop()


def test_an_s3_outage_is_waited_out_and_the_output_is_exactly_once(tmp_path, s3):
    """The transactional file sink on S3 (moto's server): the server stops answering and
    comes back on the same port with the same objects; the restarted execution's sink
    connects anew, and the committed files hold every id once."""
    from sparkjet.sinks import TransactionalFileSink

    s3_server, endpoint, s3_outage = s3
    total = 40_000
    # the helper's filesystem does not retry (pyarrow's default retries would hide a
    # short outage from the job: then nothing here would be tested)
    out, fs = f"{s3_server.BUCKET}/outage", s3_server.s3_filesystem(endpoint)
    sink = TransactionalFileSink(out, rows_per_file=5_000, filesystem=fs)
    job = Job(Pipeline().read_from(source(total)).write_to(sink), config("s3", tmp_path))
    outage = s3_outage()
    result = run(job, outage)
    check_transient_restarts(outage, result, job.config)
    check_exactly_once(TransactionalFileSink.read(out, filesystem=fs).column("id"), total)


def test_a_member_an_s3_outage_failed_while_it_wrote_files_exits(tmp_path, s3):
    """Found by the nemesis campaign's S3 rounds (issue 27): a keyed aggregate writes its
    updates to staged files on S3 at every batch; an outage fails the execution while some
    of them are open, and the member process never ended: at its exit the interpreter's
    final garbage collection closed the S3 streams left open after pyarrow had shut its S3
    client down (``atexit``), and that close waits forever. The supervisor waited for the
    member with it: the job hung without a message. Now a member process ends as soon as
    its result is written, without the interpreter's finalization; the job waits the
    outage out and its output is exactly-once."""
    from sparkjet.sinks import TransactionalFileSink

    s3_server, endpoint, s3_outage = s3
    src = GeneratorSource(total=600_000, partitions=4, keys=2_000, rate=100_000,
                          batch_size=5_000)
    out, fs = f"{s3_server.BUCKET}/open-files", s3_server.s3_filesystem(endpoint)
    job = Job(Pipeline().read_from(src).group_by("key")
              .aggregate(count="count", sum=("sum", "value"))
              .write_to(TransactionalFileSink(out, filesystem=fs)),
              config("s3-open-files", tmp_path, max_restarts=20, restart_backoff=0.05))
    outage = s3_outage(seconds=4.0)
    done: list = []
    runner = threading.Thread(target=lambda: done.append(run(job, outage)), daemon=True)
    runner.start()
    runner.join(600)
    assert done, "the job did not end (a member process hung at its exit?)"
    check_transient_restarts(outage, done[0], job.config)
    report = verify.check_aggregates(
        src.expected_counts(),
        verify.last_update_per_key(TransactionalFileSink.read(out, filesystem=fs)),
        key="key", columns=["count", "sum"], guarantee="exactly-once")
    assert report.valid, str(report)


# -- Redis -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A server of this module's own, keeping its data across a restart (an append-only file
    fsynced always): it is stopped and restarted under the job."""
    pytest.importorskip("redis")
    from helpers import redis_server as helper

    try:
        s = helper.start(tmp_path_factory.mktemp("redis"), persist=True)
    except helper.RedisServerMissing as e:
        pytest.fail(str(e), pytrace=False)
    yield s
    s.stop()


class Feeder:
    """Appends ``{"id": n}`` messages (n = 0, 1, ...) to the partitions of a Redis stream
    in turn, a chunk at a time, until :meth:`stop`; :meth:`finish` appends up to ``total``
    and the end markers. One producer, one thread: the ids are the order of the XADDs."""

    def __init__(self, stream: str, partitions: int, url: str, total: int, chunk: int = 200):
        from sparkjet.sources import RedisStreamProducer

        self.producer = RedisStreamProducer(stream, partitions, url)
        self.partitions, self.total, self.chunk, self.sent = partitions, total, chunk, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _add(self, upto: int) -> None:
        while self.sent < upto:
            n = min(self.chunk, upto - self.sent)
            partition = (self.sent // self.chunk) % self.partitions
            self.producer.add_many(partition, [{"id": self.sent + i} for i in range(n)])
            self.sent += n

    def _run(self) -> None:
        while not self._stop.is_set() and self.sent < self.total // 2:
            self._add(self.sent + self.chunk)
            time.sleep(0.05)

    def stop(self) -> None:
        """Stops feeding (before the server goes down: nothing is half sent)."""
        self._stop.set()
        self._thread.join(60)

    def finish(self) -> None:
        self.stop()
        self._add(self.total)
        self.producer.end()
        self.producer.close()


def test_a_redis_outage_is_waited_out_and_the_output_is_exactly_once(redis_server, tmp_path):
    """The acknowledging Redis stream source under a job that reads, snapshots and
    acknowledges while messages arrive: redis-server is stopped (its data kept on disk) and
    started again on the same port. Reads, acknowledgements and the next execution's
    XGROUP CREATE fail while it is down, each failure transient; the execution after the
    restart redelivers what was read and not covered by the last snapshot, drops what was,
    and reads on. Every id is in the committed output once."""
    import uuid

    from sparkjet.sinks import TransactionalFileSink
    from sparkjet.sources import RedisStreamSource

    total, stream = 40_000, f"outage-{uuid.uuid4().hex[:8]}"
    schema = pa.schema([("id", pa.int64()), ("_id", pa.string())])
    feeder = Feeder(stream, 2, redis_server.url, total)
    try:
        out = tmp_path / "out"
        pipeline = (Pipeline().read_from(RedisStreamSource(stream, 2, redis_server.url,
                                                           schema=schema))
                    .write_to(TransactionalFileSink(out)))
        job = Job(pipeline, config("redis", tmp_path))
        outage = Outage(lambda: (feeder.stop(), redis_server.halt()),
                        lambda: (redis_server.restart(), feeder.finish()), seconds=6.0)
        result = run(job, outage)
    finally:
        feeder.stop()
    check_transient_restarts(outage, result, job.config)
    kinds = {r["transient"] for r in outage.restarts}
    assert kinds <= {"connection refused", "connection failed", "server loading",
                     "timeout"}, kinds
    check_exactly_once(TransactionalFileSink.read(out).column("id"), total)
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:   # every message acknowledged once its snapshot completed
        for p in range(2):
            assert client.xpending(f"{stream}:{p}", f"sparkjet-job-{result.job_id}")[
                "pending"] == 0
    finally:
        client.close()


def test_a_kafka_broker_outage_under_a_kafka_source_is_waited_out_exactly_once(broker,
                                                                               tmp_path):
    """The broker a job reads from stopped and started again (its records saved before):
    the job waits it out and the files it commits hold every record exactly once (the
    exactly-once check the sink-side outage above cannot make on this broker)."""
    import json

    from confluent_kafka import Producer
    from helpers import kafka_broker

    from sparkjet.sinks import TransactionalFileSink
    from sparkjet.sources import KafkaSource

    total, topic = 20_000, "outage-source"
    kafka_broker.create_topic(broker.bootstrap, topic, 2)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(total):
        producer.produce(topic, json.dumps({"id": i}).encode(), partition=i % 2)
    assert producer.flush(30) == 0
    # the broker saves its state about once a second: wait until the records are in it,
    # so that the restart below loses nothing of the input
    kafka_broker.saved_copy(broker, topic, {0: total // 2, 1: total // 2})

    def slow(batch):
        time.sleep(0.002 * batch.num_rows / 100)    # the job outlasts two snapshots
        return batch

    kafka = KafkaSource(topic, broker.bootstrap, value="json", bounded=True, timeout=2.0,
                        schema=pa.schema([("id", pa.int64())]))
    out = tmp_path / "out"
    job = Job(Pipeline().read_from(kafka).map_batches(slow).write_to(TransactionalFileSink(out)),
              config("kafka-source", tmp_path))
    outage = Outage(broker.halt, broker.restart, seconds=OUTAGE_S)
    result = run(job, outage)
    assert result.restarts <= job.config.max_restarts
    for r in outage.restarts:
        assert r["transient"] is not None, r            # waited out as an outage, not data
    check_exactly_once(TransactionalFileSink.read(out).column("id"), total)
