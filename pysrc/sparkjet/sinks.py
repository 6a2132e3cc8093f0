"""Sinks that keep a job's processing guarantee end to end (see :mod:`sparkjet.connectors.base`).

- :class:`TransactionalFileSink`: Parquet or Arrow IPC files on ``pyarrow.fs``, two-phase
  commit (staged per execution and transaction, made visible by rename after the snapshot).
- :class:`KafkaSink`: a Kafka topic, exactly-once by staging each snapshot's rows and
  producing them in one Kafka transaction with a commit marker, or at-least-once.
- :class:`SQLiteUpsertSink`: idempotent upserts by stable keys, flushed at every barrier.
- :class:`PostgresSink`: PostgreSQL, transactional (``PREPARE TRANSACTION`` at the barrier,
  ``COMMIT PREPARED`` after the snapshot) or idempotent upserts by key; rows go in by
  ``COPY`` (needs psycopg 3: ``pip install 'sparkjet[postgres]'``).
- :class:`DeltaSink`: a Delta Lake table, exactly-once by staging each snapshot's rows and
  appending them in one Delta commit with idempotent application transactions, or
  at-least-once by appends (needs deltalake: ``pip install 'sparkjet[delta]'``).
- :class:`DiscardSink`: keeps nothing (benchmarks).

A sink given as a stage's ``on_error`` receives dead letters of one schema,
:data:`DEAD_LETTER_SCHEMA` (:mod:`sparkjet.connectors.dead_letters`).
"""
from sparkjet.connectors.dead_letters import DEAD_LETTER_SCHEMA
from sparkjet.connectors.delta import DeltaSink, DeltaWriter
from sparkjet.connectors.discard import DiscardSink
from sparkjet.connectors.files.sink import TransactionalFileSink, TransactionalFileWriter
from sparkjet.connectors.kafka.sink import KafkaPlainWriter, KafkaSink, KafkaWriter
from sparkjet.connectors.postgres import (
    PostgresSink,
    PostgresTransactionalWriter,
    PostgresUpsertWriter,
)
from sparkjet.connectors.sqlite import SQLiteUpsertSink, SQLiteUpsertWriter

__all__ = [
    "DEAD_LETTER_SCHEMA",
    "DeltaSink",
    "DeltaWriter",
    "DiscardSink",
    "KafkaPlainWriter",
    "KafkaSink",
    "KafkaWriter",
    "PostgresSink",
    "PostgresTransactionalWriter",
    "PostgresUpsertWriter",
    "SQLiteUpsertSink",
    "SQLiteUpsertWriter",
    "TransactionalFileSink",
    "TransactionalFileWriter",
]
