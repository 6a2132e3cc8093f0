"""sparkjet on Spark: Hazelcast partitioning of DataFrames, local sessions, Merkle diffs of
DataFrames, and a job's committed output read back by Spark (batch or Structured Streaming).

- :mod:`~sparkjet.spark.partitioning`: :func:`with_partition_id`, :func:`repartition_by_partition`.
- :mod:`~sparkjet.spark.session`: :func:`local_session`, :func:`spark_log_path`, and what the
  runner asks of any session (classic or Spark Connect).
- :mod:`~sparkjet.spark.java`: finding Java 17+ (:func:`find_java_home`).
- :mod:`~sparkjet.spark.merkle`: :func:`merkle_diff`, :func:`merkle_forest`.
- :mod:`~sparkjet.spark.output`: :func:`read_output`.
- :mod:`~sparkjet.spark.datasource`: the Structured Streaming formats :func:`register` adds.

Spark types map to Hazelcast types as :mod:`~sparkjet.spark.partitioning` says.

Nothing here imports pyspark until a function that needs it runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from sparkjet.spark.java import JavaNotFoundError, find_java_home
from sparkjet.spark.merkle import merkle_diff, merkle_forest
from sparkjet.spark.partitioning import repartition_by_partition, with_partition_id
from sparkjet.spark.session import local_session, spark_log_path

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "JavaNotFoundError",
    "find_java_home",
    "local_session",
    "spark_log_path",
    "merkle_diff",
    "read_output",
    "register",
    "merkle_forest",
    "repartition_by_partition",
    "with_partition_id",
]


def read_output(spark: SparkSession, sink) -> DataFrame:
    """The committed rows of a job's sink (``TransactionalFileSink`` or ``DeltaSink``) as a
    DataFrame of ``spark``; see :mod:`sparkjet.spark.output`."""
    # Loads the Delta and file sinks only when output is read.
    from sparkjet.spark.output import read_output as read

    return read(spark, sink)


def register(spark: SparkSession) -> None:
    """Registers the Structured Streaming formats ``sparkjet`` (a job's committed output as
    a stream) and ``sparkjet-log`` (a stream into an Arrow log); see
    :mod:`sparkjet.spark.datasource`."""
    # Loads pyspark's data source API only when the formats are registered.
    from sparkjet.spark.datasource import register as register_formats

    register_formats(spark)
