"""Kafka in and out: the Kafka source alone (raw values, and JSON decoded with a schema, to
``DiscardSink``), and a keyed count from Kafka to Kafka with exactly-once snapshots every
1 s; beside them, the broker's own limit: ``confluent-kafka``'s producer filling the topic,
and a bare consumer loop reading it (``consume`` in batches, nothing decoded).

Records are 100-byte JSON objects (``{"key": "k000123", "value": 123456, "pad": "..."}``,
10,000 distinct keys) in a 2-partition topic. The jobs run in process, one member with
``local_parallelism=2`` (two source processors, two keyed processors: what ``local[2]``
gives a job on Spark, without Spark's start-up). By default the broker is ``noida-db``,
started here as the tests start it (``--bootstrap`` to use another).

Run: ``python bench/bench_kafka.py`` (prints a table; ``--records N``) or
``python -m pytest bench/bench_kafka.py --benchmark-only``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink, KafkaSink
from sparkjet.sources import KafkaSource

KEYS = 10_000
PARTITIONS = 2
SCHEMA = pa.schema([("key", pa.string()), ("value", pa.int64()), ("pad", pa.string())])


def record(i: int) -> bytes:
    head = json.dumps({"key": f"k{i % KEYS:06d}", "value": i, "pad": ""}, separators=(",", ":"))
    return head.replace('"pad":""', '"pad":"' + "x" * (100 - len(head)) + '"').encode()


def broker():
    """A noida-db broker, started like the tests' (tests/helpers/kafka_broker.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import kafka_broker

    return kafka_broker


def new_topic(bootstrap: str, partitions: int = PARTITIONS) -> str:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    broker().create_topic(bootstrap, topic, partitions)
    return topic


def fill(bootstrap: str, topic: str, records: int) -> dict:
    """The producer's limit: `records` records produced and flushed."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10_000,
                  "queue.buffering.max.messages": 1_000_000})
    payloads = [record(i) for i in range(min(records, 100_000))]
    start = time.perf_counter()
    for i in range(records):
        while True:
            try:
                p.produce(topic, payloads[i % len(payloads)], partition=i % PARTITIONS)
                break
            except BufferError:
                p.poll(0.01)
    p.flush(120)
    seconds = time.perf_counter() - start
    return {"records_per_s": records / seconds, "seconds": seconds}


def consume_all(bootstrap: str, topic: str, records: int) -> dict:
    """The consumer's limit: every record read by a bare ``consume`` loop (at most 120 s)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", "enable.auto.commit": False,
                  "isolation.level": "read_committed"})
    c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    n, start = 0, time.perf_counter()
    while n < records and time.perf_counter() - start < 120:
        n += sum(1 for m in c.consume(10_000, 1.0) if m.error() is None)
    seconds = time.perf_counter() - start
    c.close()
    # A stall (see bench/README.md: noida-db after a large burst) shows as a low rate.
    return {"records_per_s": n / seconds, "seconds": seconds}


def source_alone(bootstrap: str, topic: str, records: int, value: str) -> dict:
    source = KafkaSource(topic, bootstrap, value=value,
                         schema=SCHEMA if value == "json" else None, metadata=(), bounded=True)
    config = JobConfig(name=f"bench-kafka-source-{value}", processing_guarantee="none",
                       local_parallelism=2, batch_size=10_000)
    result = Job(Pipeline().read_from(source).write_to(DiscardSink()), config).run(isolated=False)
    return {"records_per_s": records / result.seconds, "seconds": result.seconds}


def keyed_count(bootstrap: str, topic: str, records: int, work: str) -> dict:
    """Kafka -> keyed count -> Kafka, exactly-once, snapshots every 1 s."""
    out = new_topic(bootstrap)
    source = KafkaSource(topic, bootstrap, value="json", schema=SCHEMA, metadata=(), bounded=True)
    pipeline = (Pipeline().read_from(source).group_by("key").aggregate(count="count")
                .write_to(KafkaSink(out, bootstrap, staging=os.path.join(work, "staging"),
                                    key="key")))
    config = JobConfig(name=f"bench-kafka-{out}", processing_guarantee="exactly-once",
                       snapshot_store=os.path.join(work, "snapshots"), snapshot_interval=1.0,
                       local_parallelism=2, batch_size=10_000)
    result = Job(pipeline, config).run(isolated=False)
    written = KafkaSink.read(out, bootstrap).num_rows
    return {"records_per_s": records / result.seconds, "seconds": result.seconds,
            "written": written, "snapshots": len(result.snapshots)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--bootstrap", default=None, help="a running broker (default: noida-db)")
    args = parser.parse_args(argv)
    n = args.records
    with tempfile.TemporaryDirectory() as work:
        server = None
        bootstrap = args.bootstrap
        if bootstrap is None:
            server = broker().start(work)
            bootstrap = server.bootstrap
        try:
            topic = new_topic(bootstrap)
            rows = [("broker: confluent-kafka producer alone", fill(bootstrap, topic, n)),
                    ("broker: confluent-kafka consumer alone", consume_all(bootstrap, topic, n)),
                    ("Kafka source, raw values", source_alone(bootstrap, topic, n, "raw")),
                    ("Kafka source, JSON with a schema", source_alone(bootstrap, topic, n, "json")),
                    ("Kafka -> keyed count -> Kafka, exactly-once 1 s",
                     keyed_count(bootstrap, topic, n, work))]
        finally:
            if server is not None:
                server.stop()
    print(f"load average {os.getloadavg()[0]:.2f}; {n:,} records of 100 bytes, {KEYS:,} keys, "
          f"{PARTITIONS} partitions, one member, local_parallelism 2")
    print(f"{'what':50}{'records/s':>14}{'seconds':>10}")
    for label, r in rows:
        extra = (f"  ({r['written']:,} counts written, {r['snapshots']} snapshots)"
                 if "written" in r else "")
        print(f"{label:50}{r['records_per_s'] / 1e6:>12.2f} M{r['seconds']:>10.2f}{extra}")


def test_kafka_source_and_keyed_count(benchmark, tmp_path):
    server = broker().start(tmp_path)
    try:
        topic = new_topic(server.bootstrap)
        fill(server.bootstrap, topic, 500_000)
        benchmark.pedantic(source_alone, args=(server.bootstrap, topic, 500_000, "json"), rounds=2)
        keyed_count(server.bootstrap, topic, 500_000, str(tmp_path / "job"))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
