"""A job's committed output as a Spark DataFrame, in one line: ``read_output(spark, sink)``.

Only committed rows are read. For a :class:`~sparkjet.sinks.TransactionalFileSink` that is
the list of files :meth:`~sparkjet.sinks.TransactionalFileSink.committed_files` gives (never
a staged file, never part of a transaction), fixed when ``read_output`` is called; for a
:class:`~sparkjet.sinks.DeltaSink` it is the table's newest version's file list as
``deltalake`` reads it (no delta-spark jar needed). Spark reads those Parquet files itself
when Spark and pyarrow name them alike (a local or mounted path, ``hdfs://``); elsewhere
(an object store given as a pyarrow URI or filesystem, Arrow IPC files, nanosecond
timestamps, which Spark's Parquet reader refuses, a Delta table with partition columns or
deletion vectors) the rows are read here with pyarrow and handed to
``spark.createDataFrame``, which suits outputs that fit in the driver's memory (nanosecond
timestamps are cut to Spark's microseconds).
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from sparkjet._fs import spark_names, spark_path
from sparkjet.connectors.delta import DeltaSink, _deltalake, _open_table
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.errors import InvalidArgumentError


def read_output(spark, sink):
    """The committed rows of ``sink`` (a :class:`~sparkjet.sinks.TransactionalFileSink` or
    :class:`~sparkjet.sinks.DeltaSink`) as a DataFrame of the session ``spark`` (classic or
    Spark Connect). Other sinks raise :class:`~sparkjet.errors.InvalidArgumentError`.

    >>> read_output(spark, TransactionalFileSink("/data/out")).count()   # doctest: +SKIP
    """
    if isinstance(sink, TransactionalFileSink):
        return _file_sink(spark, sink)
    if isinstance(sink, DeltaSink):
        return _delta_sink(spark, sink)
    raise InvalidArgumentError(
        f"read_output: a {type(sink).__name__} cannot be read back as a DataFrame by "
        "sparkjet (it reads TransactionalFileSink and DeltaSink output); read it with "
        "Spark's own connector for that system")


def _file_sink(spark, sink):
    files = sink.committed_files(sink.uri, filesystem=sink.filesystem)
    if not files:
        return _empty(spark)
    if (sink.format == "parquet" and sink.filesystem is None and all(map(spark_names, files))
            and not _has_nanos(pq.read_schema(files[0]))):
        return spark.read.parquet(*[spark_path(f) for f in files])
    return _from_arrow(spark, sink.read(sink.uri, filesystem=sink.filesystem))


def _delta_sink(spark, sink):
    dl = _deltalake()
    dt = _open_table(dl, sink.uri, sink.storage_options)
    if dt is None:
        raise InvalidArgumentError(f"read_output: Delta Lake sink for table {sink.uri!r}: "
                                   "there is no table there (nothing committed yet)")
    files = dt.file_uris()
    # Delta stores timestamps in microseconds: Spark reads every plain table's files.
    plain = (dt.protocol().min_reader_version == 1 and not dt.metadata().partition_columns)
    if plain and files and all(map(spark_names, files)):
        return spark.read.parquet(*[spark_path(f) for f in files])
    return _from_arrow(spark, pa.table(dt.to_pyarrow_table()))


def _has_nanos(schema: pa.Schema) -> bool:
    """Whether a column holds nanosecond timestamps, which Spark's Parquet reader refuses
    (Spark's timestamps are microseconds)."""
    return any(pa.types.is_timestamp(t) and t.unit == "ns" for t in map(_leaf_types, schema)
               for t in t)


def _leaf_types(field: pa.Field) -> list[pa.DataType]:
    t = field.type
    if t.num_fields:
        return [x for i in range(t.num_fields) for x in _leaf_types(t.field(i))]
    return [t]


def _empty(spark):
    from pyspark.sql.types import StructType

    return spark.createDataFrame([], StructType([]))


def _from_arrow(spark, table: pa.Table):
    if table.num_columns == 0:
        return _empty(spark)
    return spark.createDataFrame(_micros(table))


def _micros(table: pa.Table) -> pa.Table:
    """Top-level nanosecond timestamps cut to microseconds, Spark's unit."""
    fields = [pa.field(f.name, pa.timestamp("us", f.type.tz), f.nullable)
              if pa.types.is_timestamp(f.type) and f.type.unit == "ns" else f
              for f in table.schema]
    return table.cast(pa.schema(fields), safe=False)


__all__ = ["read_output"]
