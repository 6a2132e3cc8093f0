"""Sources of a job (the :class:`~sparkjet.connectors.base.Source` contract):

- :class:`GeneratorSource`: deterministic events, replayable by offset, rate-limited or
  as fast as possible; computes the expected output of a failure-free run.
- :class:`ArrowLogSource` and :class:`ArrowLogWriter`: a partitioned append-only log of
  Arrow IPC segment files, replayable and readable while it is being appended.
- :class:`DirectorySource`: Parquet, CSV or JSON-lines files in a directory on a local
  disk or any ``pyarrow.fs`` file system (S3, GCS, HDFS), replayable, picking up new files.
- :class:`DataFrameSource`: a bounded Spark DataFrame, materialised once on the driver as
  Parquet files and read like a :class:`DirectorySource`.
- :class:`NexmarkSource`: NEXMark's persons, auctions or bids, deterministic and replayable
  by offset like the generator, in event time from a fixed epoch.
- :class:`KafkaSource`: Kafka topics, replayable (offsets in the snapshot), decoded to
  Arrow columns (needs ``confluent-kafka``: ``pip install 'sparkjet[kafka]'``).
- :class:`RedisStreamSource` and :class:`RedisStreamProducer`: an acknowledging source on
  Redis Streams (needs the ``redis`` package: ``pip install 'sparkjet[redis]'``).
"""
from sparkjet.connectors.arrow_log import (
    ArrowLogReader,
    ArrowLogSource,
    ArrowLogWriter,
    LogLockedError,
)
from sparkjet.connectors.dataframe import DataFrameSource
from sparkjet.connectors.files.source import DirectoryReader, DirectorySource
from sparkjet.connectors.generator import GeneratorReader, GeneratorSource
from sparkjet.connectors.kafka.source import KafkaReader, KafkaSource, read_topic
from sparkjet.connectors.nexmark.source import NexmarkReader, NexmarkSource
from sparkjet.connectors.redis import (
    RedisStreamProducer,
    RedisStreamReader,
    RedisStreamSource,
)

__all__ = [
    "ArrowLogReader",
    "ArrowLogSource",
    "ArrowLogWriter",
    "DataFrameSource",
    "DirectoryReader",
    "DirectorySource",
    "GeneratorReader",
    "GeneratorSource",
    "KafkaReader",
    "KafkaSource",
    "LogLockedError",
    "NexmarkReader",
    "NexmarkSource",
    "RedisStreamProducer",
    "RedisStreamReader",
    "RedisStreamSource",
    "read_topic",
]
