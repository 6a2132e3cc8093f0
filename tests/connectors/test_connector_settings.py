"""The connectors' settings as typed data (sparkjet.connectors._settings): every argument of
every source and sink is a field of its settings dataclass, checked by the same check_fields
as JobConfig, and a bad one raises InvalidArgumentError naming the connector, the argument
and the value (a secret's value never). The constructors' signatures stay the settings'."""
from __future__ import annotations

import dataclasses
import inspect
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from sparkjet.connectors.arrow_log import ArrowLogSourceSettings, ArrowLogWriterSettings
from sparkjet.connectors.dataframe import DataFrameSourceSettings
from sparkjet.connectors.delta import DeltaSinkSettings
from sparkjet.connectors.files.sink import TransactionalFileSinkSettings
from sparkjet.connectors.files.source import DirectorySourceSettings
from sparkjet.connectors.generator import GeneratorSourceSettings
from sparkjet.connectors.kafka.sink import KafkaSinkSettings
from sparkjet.connectors.kafka.source import KafkaSourceSettings
from sparkjet.connectors.nexmark.source import NexmarkSourceSettings
from sparkjet.connectors.postgres.sink import PostgresSinkSettings
from sparkjet.connectors.redis import RedisStreamProducerSettings, RedisStreamSourceSettings
from sparkjet.connectors.sqlite import SQLiteUpsertSinkSettings
from sparkjet.errors import InvalidArgumentError
from sparkjet.sinks import (
    DeltaSink,
    KafkaSink,
    PostgresSink,
    SQLiteUpsertSink,
    TransactionalFileSink,
)
from sparkjet.sources import (
    ArrowLogSource,
    ArrowLogWriter,
    DataFrameSource,
    DirectorySource,
    GeneratorSource,
    KafkaSource,
    NexmarkSource,
    RedisStreamProducer,
    RedisStreamSource,
)

SCHEMA = pa.schema([("x", pa.int64())])

# connector, its settings, the arguments of a valid one (``{d}``: a fresh directory)
CONNECTORS = [
    (GeneratorSource, GeneratorSourceSettings, {}),
    (NexmarkSource, NexmarkSourceSettings, {}),
    (ArrowLogWriter, ArrowLogWriterSettings, {"root": "{d}/log", "partitions": 2,
                                              "schema": SCHEMA}),
    (ArrowLogSource, ArrowLogSourceSettings, {"root": "{d}"}),
    (DirectorySource, DirectorySourceSettings, {"path": "{d}"}),
    # a DataFrame needs Spark (test_spark_dataframes constructs one); without one, every
    # other argument is still checked before df is
    (DataFrameSource, DataFrameSourceSettings, {"df": None}),
    (KafkaSource, KafkaSourceSettings, {"topic": "t", "partitions": 2}),
    (KafkaSink, KafkaSinkSettings, {"topic": "t"}),
    (RedisStreamSource, RedisStreamSourceSettings, {"stream": "s", "partitions": 2}),
    (RedisStreamProducer, RedisStreamProducerSettings, {"stream": "s", "partitions": 2}),
    (TransactionalFileSink, TransactionalFileSinkSettings, {"uri": "{d}/out"}),
    (PostgresSink, PostgresSinkSettings, {"dsn": "host=db password=hunter2", "table": "t"}),
    (DeltaSink, DeltaSinkSettings, {"uri": "{d}/table"}),
    (SQLiteUpsertSink, SQLiteUpsertSinkSettings, {"path": "{d}/x.db", "table": "t",
                                                  "key": "k"}),
]

# For each connector, a bad value of every argument.
BAD = {
    GeneratorSource: {"total": -1, "partitions": 0, "keys": 0, "rate": 0, "batch_size": 0,
                      "seed": -1},
    NexmarkSource: {"kind": "ask", "total": -1, "partitions": 2**31, "events_per_second": 0,
                    "first_event_time_ms": 2**48, "out_of_order_ms": -1, "batch_size": 0,
                    "rate": -1.0, "seed": 2**64, "people": 0, "auctions": 0,
                    "hot_auction_ratio": 0, "hot_bidder_ratio": 0, "hot_seller_ratio": 0},
    ArrowLogWriter: {"root": "", "partitions": 100_000, "schema": "x", "segment_bytes": 0,
                     "durable": 1},
    ArrowLogSource: {"root": b"/tmp"},
    DirectorySource: {"path": "", "format": "xml", "schema": {"id": "int64"}, "partitions": 0,
                      "filesystem": "local", "watch": "yes", "poll_interval": -1,
                      "end_marker": "", "batch_size": 0, "suffixes": "abc",
                      "ordered_names": 1},
    DataFrameSource: {"partitions": 0, "path": "", "batch_size": 0, "keep": "no"},
    KafkaSource: {"topic": "", "bootstrap_servers": "", "partitions": 0, "value": "avro",
                  "schema": "x", "key": "json", "metadata": ("offset", "headers"),
                  "start": "now", "bounded": "yes", "group": "", "discovery_interval": 0,
                  "timeout": -1, "config": [("a", "b")],
                  "on_offset_reset": "smallest"},
    KafkaSink: {"topic": None, "bootstrap_servers": 5, "staging": "", "key": "", "value": "",
                "partition": 3, "transactional_id": "", "timeout": 0, "durable": None,
                "config": "x"},
    RedisStreamSource: {"stream": "", "partitions": 0, "url": None, "group": "",
                        "consumer": 7, "start_id": 0, "schema": "s", "decoder": 5,
                        "block_ms": 0, "reclaim_interval": -1, "password": b"secret"},
    RedisStreamProducer: {"stream": "", "partitions": 0, "url": "", "password": 5},
    TransactionalFileSink: {"uri": "", "format": "csv", "rows_per_file": 0,
                            "filesystem": "local", "durable": "no"},
    PostgresSink: {"dsn": 5, "table": "_sparkjet_x", "mode": "merge", "key": [""],
                   "max_buffered_rows": 0, "connect_timeout": 0},
    DeltaSink: {"uri": "", "staging": "", "staging_filesystem": 5, "app_id": "",
                "storage_options": {"a": 1}, "rows_per_commit": 0, "durable": 1},
    SQLiteUpsertSink: {"path": None, "table": "", "key": [], "max_buffered_rows": 0,
                       "timeout": float("nan")},
}
SECRETS = {(RedisStreamSource, "password"), (RedisStreamProducer, "password"),
           (PostgresSink, "dsn")}


def _args(arguments: dict, directory: Path) -> dict:
    return {k: v.format(d=directory) if isinstance(v, str) else v for k, v in arguments.items()}


def _cases():
    for connector, _, valid in CONNECTORS:
        for field, bad in BAD[connector].items():
            yield pytest.param(connector, valid, field, bad, id=f"{connector.__name__}.{field}")


@pytest.mark.parametrize("connector, settings, valid", CONNECTORS,
                         ids=[c.__name__ for c, _, _ in CONNECTORS])
def test_the_settings_are_the_constructor_s_arguments(connector, settings, valid):
    """Same names, order, kinds and defaults: the signature users call is unchanged, and
    no argument goes unchecked."""
    def shape(parameters):
        return [(p.name, p.kind, p.default) for p in parameters if p.name != "self"]
    constructor = inspect.signature(connector.__init__).parameters.values()
    fields = inspect.signature(settings).parameters.values()
    assert shape(constructor) == shape(fields)
    assert set(BAD[connector]) | ({"df"} if connector is DataFrameSource else set()) == {
        f.name for f in dataclasses.fields(settings)}, "a bad value for every argument"


@pytest.mark.parametrize("connector, valid, field, bad", list(_cases()))
def test_a_bad_argument_names_the_connector_the_argument_and_the_value(
        tmp_path, connector, valid, field, bad):
    arguments = {**_args(valid, tmp_path), field: bad}
    with pytest.raises(InvalidArgumentError) as e:
        connector(**arguments)
    message = str(e.value)
    assert message.startswith(f"{connector.__name__}: {field} must be "), message
    if (connector, field) in SECRETS:
        assert repr(bad) not in message and "hunter2" not in message
        assert message.endswith(f"got a value of type {type(bad).__name__} (not shown)")
    else:
        assert message.endswith(f", got {bad!r}"), message
    assert list(tmp_path.iterdir()) == []       # nothing made before the check


@pytest.mark.parametrize("make, message", [
    (lambda d: KafkaSource("t", partitions=1, value="json"),
     'KafkaSource: value="json" needs a schema'),
    (lambda d: KafkaSource("t", partitions=1, schema=SCHEMA),
     'KafkaSource: value="json" needs a schema'),
    (lambda d: DirectorySource(d, end_marker="_DONE"),
     "DirectorySource: end_marker ends a watching source: give watch=True"),
    (lambda d: RedisStreamSource("s", 1, schema=SCHEMA, decoder=lambda m: None),
     "RedisStreamSource: give a schema or a decoder, not both"),
    (lambda d: PostgresSink("host=db", "t", mode="upsert"),
     "PostgresSink: upsert mode needs key= naming one or more columns, got None"),
    (lambda d: PostgresSink("host=db", "t", key="k"),
     "PostgresSink: key= is for mode='upsert'"),
    (lambda d: PostgresSink("host=db", "x" * 101),
     "PostgresSink: table must be a table name (at most 100 bytes"),
    (lambda d: SQLiteUpsertSink(d / "x.db", "_sparkjet_t", "k"),
     "SQLiteUpsertSink: table must be a table name (not starting with _sparkjet), got "
     "'_sparkjet_t'"),
    (lambda d: DeltaSink("s3://bucket/table"),
     "Delta Lake sink for table 's3://bucket/table': a table on an object store needs staging="),
    (lambda d: DataFrameSource([1, 2]), "DataFrame source: df must be a Spark DataFrame, got list"),
])
def test_rules_between_arguments_name_the_connector(tmp_path, make, message):
    with pytest.raises(InvalidArgumentError) as e:
        make(tmp_path)
    assert str(e.value).startswith(message), str(e.value)


SOURCES_WITH_PARTITIONS = [c for c in CONNECTORS if c[0] in (
    GeneratorSource, NexmarkSource, DirectorySource, DataFrameSource, KafkaSource,
    RedisStreamSource, RedisStreamProducer)]


@pytest.mark.parametrize("connector, settings, valid", SOURCES_WITH_PARTITIONS,
                         ids=[c.__name__ for c, _, _ in SOURCES_WITH_PARTITIONS])
def test_source_partitions_are_bounded(tmp_path, connector, settings, valid):
    """A source of a million partitions reads, watermarks and snapshots each on its own for
    minutes: the bound names the connector, the limit and why, and lets the limit itself in."""
    from sparkjet.connectors._settings import MAX_SOURCE_PARTITIONS

    arguments = _args(valid, tmp_path)
    if connector is not DataFrameSource:        # (its df=None fails after the fields)
        assert settings(**{**arguments, "partitions": MAX_SOURCE_PARTITIONS}).partitions == \
            MAX_SOURCE_PARTITIONS
    with pytest.raises(InvalidArgumentError) as e:
        connector(**{**arguments, "partitions": MAX_SOURCE_PARTITIONS + 1})
    message = str(e.value)
    assert message.startswith(f"{connector.__name__}: partitions must be `int` <= "
                              f"{MAX_SOURCE_PARTITIONS} (each source partition"), message
    assert message.endswith(f", got {MAX_SOURCE_PARTITIONS + 1}"), message


@pytest.mark.parametrize("connector, settings, valid",
                         [c for c in CONNECTORS if c[0] is not DataFrameSource],
                         ids=[c.__name__ for c, _, _ in CONNECTORS if c is not DataFrameSource])
def test_valid_arguments_still_construct(tmp_path, connector, settings, valid):
    made = connector(**_args(valid, tmp_path))
    try:
        hidden = {"password"} | ({"url"} if connector is RedisStreamProducer else set())
        for f in dataclasses.fields(settings):
            if f.name not in hidden:
                assert hasattr(made, f.name), f"{connector.__name__} lost attribute {f.name}"
        if not isinstance(made, (ArrowLogWriter, RedisStreamProducer)):
            pickle.loads(pickle.dumps(made))        # shipped to the members
    finally:
        if hasattr(made, "close"):
            made.close()


def test_checked_values_are_plain_python_and_normalised(tmp_path):
    g = GeneratorSource(total=np.int64(100), partitions=np.int32(2), rate=np.float64(5.5))
    assert type(g.total) is int and type(g.partitions) is int and type(g.rate) is float
    assert g == GeneratorSource(**g.config) and repr(g).startswith("GeneratorSource(total=100,")
    assert GeneratorSource(rate=5).rate == 5 and type(GeneratorSource(rate=5).rate) is int
    sink = SQLiteUpsertSink(tmp_path / "x.db", "t", ("a", "b"))
    assert sink.path == str(tmp_path / "x.db") and sink.key == ["a", "b"]
    assert PostgresSink("host=db", "t", mode="upsert", key="k").key == ["k"]
    assert PostgresSink("host=db", "t").key == [] and PostgresSink("host=db", "t").transactional
    kafka = KafkaSource("t", partitions=np.int64(3), metadata=["offset"], config=None)
    assert kafka.partitions == 3 and kafka.metadata == ("offset",) and kafka.config == {}
    assert KafkaSink("t", timeout=5).timeout == 5.0
    assert KafkaSink("t", staging=tmp_path).staging == str(tmp_path)
    files = DirectorySource(tmp_path, "csv", end_marker="/_DONE/", watch=True)
    assert files.path == str(tmp_path) and files.end_marker == "_DONE"
    assert files.suffixes[0] == ".csv"
    delta = DeltaSink(tmp_path / "t", storage_options={"a": "b"})
    assert delta.local and delta.staging == str(tmp_path / "t" / "_sparkjet_staging")
    assert TransactionalFileSink("out", filesystem=pafs.LocalFileSystem()).uri == "out"
    source = RedisStreamSource("s", 1, password="hunter2")
    assert "hunter2" not in repr(source) and not hasattr(source, "password")


def test_the_settings_are_frozen_typed_data():
    settings = KafkaSourceSettings(topic="t", partitions=2)
    assert settings.timeout == 10.0 and settings.config == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.timeout = 1
    assert settings.as_dict()["topic"] == "t"
    with pytest.raises(InvalidArgumentError, match=r"^KafkaSource: timeout must be a finite "
                                                   r"number > 0, got -1$"):
        KafkaSourceSettings(topic="t", timeout=-1)
