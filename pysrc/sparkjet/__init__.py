"""sparkjet: Hazelcast Jet's fault-tolerance model for PySpark pipelines, with a C core.

The API in brief:

- :func:`partition_ids`, :func:`murmur3_32`, :class:`Partitioner`: Hazelcast-compatible
  partitioning of Arrow keys (:mod:`sparkjet.partitioning`).
- :class:`PartitionTable`: placement of partition replicas on members
  (:mod:`sparkjet.partition_table`).
- :mod:`sparkjet.spark`: the same on Spark DataFrames.
- :func:`get_include`: the C headers, for extensions built against sparkjet.
"""
from pathlib import Path

from sparkjet.errors import (
    CorruptDataError,
    InvalidArgumentError,
    KeyRangeError,
    NullKeyError,
    SparkjetError,
    UnsupportedTypeError,
)
from sparkjet.partition_table import Migration, PartitionTable, PartitionTableError
from sparkjet.partitioning import (
    DEFAULT_PARTITION_COUNT,
    HAZELCAST_SEED,
    Partitioner,
    murmur3_32,
    partition_ids,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PARTITION_COUNT",
    "HAZELCAST_SEED",
    "CorruptDataError",
    "InvalidArgumentError",
    "KeyRangeError",
    "Migration",
    "NullKeyError",
    "PartitionTable",
    "PartitionTableError",
    "Partitioner",
    "SparkjetError",
    "UnsupportedTypeError",
    "get_include",
    "murmur3_32",
    "partition_ids",
]


def get_include() -> str:
    """The folder holding sparkjet's C headers (``sparkjet/hash.h``, ...), for the
    ``include_dirs`` of an extension that uses sparkjet's C or Cython API."""
    return str(Path(__file__).parent / "include")
