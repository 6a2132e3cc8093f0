"""sparkjet: Hazelcast Jet's fault-tolerance model for PySpark pipelines, with a C core.

The API in brief:

- :func:`partition_ids`, :func:`murmur3_32`, :class:`Partitioner`: Hazelcast-compatible
  partitioning of Arrow keys (:mod:`sparkjet.partitioning`).
- :class:`PartitionTable`: placement of partition replicas on members
  (:mod:`sparkjet.partition_table`).
- :mod:`sparkjet.spark`: the same on Spark DataFrames.
- :class:`Pipeline`, :class:`Job`, :class:`JobConfig`: jobs with processing guarantees
  (:mod:`sparkjet.pipeline`, :mod:`sparkjet.runtime`), over :mod:`sparkjet.sources` and
  :mod:`sparkjet.sinks` (contracts in :mod:`sparkjet.connectors.base`), checked with
  :mod:`sparkjet.verify`.
- :class:`SnapshotStore`: partition-aligned, checksummed, fenced snapshot storage
  (:mod:`sparkjet.snapshot.store`; chunk format in :mod:`sparkjet.snapshot.chunks`).
- :class:`MerkleTree`, :class:`MerkleForest`, :func:`sync_plan`: Merkle-tree sync of keyed
  Arrow data (:mod:`sparkjet.merkle`: also ``diff``, ``apply``, ``SyncSession``).
- :func:`get_include`: the C headers, for extensions built against sparkjet.

Submodules load what they need (pyspark only in :mod:`sparkjet.spark`), and :class:`Pipeline`,
:class:`Job`, :class:`JobConfig` and :class:`SnapshotStore` load on first use, so ``import
sparkjet`` stays cheap: it loads neither the job runtime nor pyspark.
"""
from pathlib import Path
from typing import TYPE_CHECKING

from sparkjet._version import __version__
from sparkjet.errors import (
    BadRecordError,
    CorruptDataError,
    InvalidArgumentError,
    KeyRangeError,
    NullKeyError,
    SparkjetError,
    UnsupportedTypeError,
)
from sparkjet.merkle import (
    MerkleDiff,
    MerkleForest,
    MerkleTree,
    SyncPlan,
    SyncSession,
    choose_depth,
    sync_plan,
)
from sparkjet.partition_table import Migration, PartitionTable, PartitionTableError
from sparkjet.partitioning import (
    DEFAULT_PARTITION_COUNT,
    HAZELCAST_SEED,
    Partitioner,
    murmur3_32,
    partition_ids,
)

if TYPE_CHECKING:
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.snapshot import SnapshotStore

#: Names loaded on first use (PEP 562), and the module each comes from.
_LAZY = {"Pipeline": "sparkjet.pipeline", "Job": "sparkjet.runtime",
         "JobConfig": "sparkjet.runtime", "SnapshotStore": "sparkjet.snapshot"}

__all__ = [
    "DEFAULT_PARTITION_COUNT",
    "HAZELCAST_SEED",
    "BadRecordError",
    "CorruptDataError",
    "InvalidArgumentError",
    "Job",
    "JobConfig",
    "KeyRangeError",
    "MerkleDiff",
    "MerkleForest",
    "MerkleTree",
    "Migration",
    "NullKeyError",
    "PartitionTable",
    "PartitionTableError",
    "Partitioner",
    "Pipeline",
    "SnapshotStore",
    "SparkjetError",
    "SyncPlan",
    "SyncSession",
    "UnsupportedTypeError",
    "__version__",
    "choose_depth",
    "get_include",
    "murmur3_32",
    "partition_ids",
    "sync_plan",
]


def get_include() -> str:
    """The folder holding sparkjet's C headers (``sparkjet/hash.h``, ...), for the
    ``include_dirs`` of an extension that uses sparkjet's C or Cython API."""
    return str(Path(__file__).parent / "include")


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkjet' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
