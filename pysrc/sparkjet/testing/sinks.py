"""The sinks the fault campaigns write to, each made and read back one way for every
campaign (:mod:`sparkjet.testing.campaign`, :mod:`sparkjet.testing.nemesis_campaign`):

- ``file``: :class:`~sparkjet.connectors.files.sink.TransactionalFileSink`;
- ``delta``: :class:`~sparkjet.connectors.delta.DeltaSink`, read back with ``deltalake``;
- ``kafka``: :class:`~sparkjet.connectors.kafka.sink.KafkaSink` on a new 4-partition topic,
  read back by a ``read_committed`` consumer;
- ``postgres``: :class:`~sparkjet.connectors.postgres.PostgresSink`, two-phase commit;
- ``postgres-upsert``: the same sink in ``upsert`` mode, one row per key;
- ``sqlite``: :class:`~sparkjet.connectors.sqlite.SQLiteUpsertSink`, one row per key.

What a sink holds afterwards is read from the real system, never from the job.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from sparkjet.connectors.delta import DeltaSink
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.connectors.kafka.sink import KafkaSink
from sparkjet.connectors.postgres import PostgresSink
from sparkjet.connectors.sqlite import SQLiteUpsertSink

__all__ = ["KINDS", "POSTGRES", "UPSERT", "Made", "kafka_read", "kafka_sink", "make",
           "output_key"]

#: Every sink kind a campaign can write to.
KINDS = ("file", "delta", "kafka", "postgres", "postgres-upsert", "sqlite")
#: The sinks that hold one row per key (updated in place): only operators whose output is
#: one row per key (:data:`sparkjet.testing.operators.KEYED`) can write to them.
UPSERT = ("sqlite", "postgres-upsert")
#: The PostgreSQL sink kinds and the settings of their mode, given the output's key.
POSTGRES = {"postgres": lambda key: {},
            "postgres-upsert": lambda key: {"mode": "upsert", "key": key}}


def output_key(operator: str) -> list[str]:
    """The columns that identify an output row of a campaign pipeline (the upsert sinks'
    key, the Kafka record key's column)."""
    if operator in ("windowed", "session", "union", "branching"):
        return ["key", "window_start"]
    return {"keyed": ["key"], "state": ["key"], "dedup": ["uid"], "join": ["pair"]}.get(
        operator, ["id"])


@dataclass
class Made:
    """A sink and how to read back every row it committed, in commit order."""
    sink: object
    read: Callable[[], pa.Table]


def make(kind: str, folder: Path | str, name: str, key: list[str], *, postgres: str | None = None,
         postgres_read: str | None = None, kafka: str | None = None,
         filesystem=None, remote: str | None = None) -> Made:
    """A sink of ``kind`` named ``name``: files ``folder``/``name`` (on ``filesystem``, a
    ``pyarrow.fs`` one, for the file sink; ``name``.delta, ``name``.sqlite), or, named
    ``remote`` (default ``name``: unique on the server), a PostgreSQL table (dropped first)
    in the database of DSN ``postgres`` (read back through ``postgres_read``, default the
    same) or a Kafka topic on the broker at ``kafka``."""
    remote = remote or name
    if kind not in KINDS:
        raise ValueError(f"sink kind must be one of {KINDS}, got {kind!r}")
    if kind == "file":
        path = f"{folder}/{name}" if filesystem is not None else Path(folder) / name
        return Made(TransactionalFileSink(path, filesystem=filesystem),
                    lambda: TransactionalFileSink.read(path, filesystem=filesystem))
    if kind == "delta":
        path = Path(folder) / f"{name}.delta"
        return Made(DeltaSink(path), lambda: DeltaSink.read(path))
    if kind == "kafka":
        if kafka is None:
            raise ValueError("a kafka sink needs the broker's bootstrap address")
        return Made(kafka_sink(kafka, remote, Path(folder) / f"{name}-staging", key[0]),
                    lambda: kafka_read(kafka, remote))
    if kind in POSTGRES:
        if postgres is None:
            raise ValueError(f"a {kind} sink needs a PostgreSQL DSN")
        PostgresSink.drop(postgres_read or postgres, remote)
        return Made(PostgresSink(postgres, remote, **POSTGRES[kind](key)),
                    lambda: PostgresSink.read(postgres_read or postgres, remote))
    path = Path(folder) / f"{name}.sqlite"
    return Made(SQLiteUpsertSink(path, "out", key=key), lambda: SQLiteUpsertSink.read(path, "out"))


def kafka_sink(bootstrap: str, topic: str, staging: Path, key: str) -> KafkaSink:
    """A Kafka sink on a new 4-partition ``topic`` (created here), keyed by ``key``."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, num_partitions=4,
                                           replication_factor=1)]).values():
        f.result(30)
    return KafkaSink(topic, bootstrap, staging=staging, key=key)


def kafka_read(bootstrap: str, topic: str) -> pa.Table:
    """The JSON rows a ``read_committed`` consumer reads from ``topic`` now."""
    values = KafkaSink.read(topic, bootstrap)
    if values.num_rows == 0:
        return pa.table({})
    return pa.Table.from_pylist([json.loads(v) for v in values.column("value").to_pylist()])
