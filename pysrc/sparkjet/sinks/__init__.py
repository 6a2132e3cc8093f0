"""Sinks that keep a job's processing guarantee end to end (see :mod:`sparkjet.connectors`).

- :class:`TransactionalFileSink`: Parquet or Arrow IPC files on ``pyarrow.fs``, two-phase
  commit (staged per execution and transaction, made visible by rename after the snapshot).
- :class:`KafkaSink`: a Kafka topic, exactly-once by staging each snapshot's rows and
  producing them in one Kafka transaction with a commit marker, or at-least-once.
- :class:`SQLiteUpsertSink`: idempotent upserts by stable keys, flushed at every barrier.
- :class:`DiscardSink`: keeps nothing (benchmarks).
"""
from sparkjet.sinks.discard import DiscardSink
from sparkjet.sinks.files import TransactionalFileSink, TransactionalFileWriter
from sparkjet.sinks.kafka import KafkaPlainWriter, KafkaSink, KafkaWriter
from sparkjet.sinks.sqlite import SQLiteUpsertSink, SQLiteUpsertWriter

__all__ = [
    "DiscardSink",
    "KafkaPlainWriter",
    "KafkaSink",
    "KafkaWriter",
    "SQLiteUpsertSink",
    "SQLiteUpsertWriter",
    "TransactionalFileSink",
    "TransactionalFileWriter",
]
