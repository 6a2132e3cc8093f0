"""Hazelcast partitioning on Spark DataFrames.

:func:`with_partition_id` adds the Hazelcast partition of a key as a column, computed in
the executors on Arrow batches (``mapInArrow``), and :func:`repartition_by_partition`
moves all rows of one Hazelcast partition into one Spark partition.

Spark types map to Hazelcast types as the Arrow types Spark hands to Python do
(see :mod:`sparkjet.partitioning`):

==================================  =================
Spark type                          Hazelcast type
==================================  =================
IntegerType, ShortType, ByteType    Integer
LongType                            Long
StringType (any collation)          String
BinaryType                          byte[]
==================================  =================
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from sparkjet._checks import check_int
from sparkjet.errors import (
    InvalidArgumentError,
    NullKeyError,
    SparkjetError,
    UnsupportedTypeError,
)
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT, Partitioner
from sparkjet.spark.session import default_parallelism

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame


def with_partition_id(
    df: DataFrame,
    key: str | Sequence[str],
    partition_count: int = DEFAULT_PARTITION_COUNT,
    column: str = "partition_id",
    *,
    key_type: str | None = None,
) -> DataFrame:
    """``df`` with a non-null ``int`` column ``column`` holding the Hazelcast partition of
    ``key`` (a column name, or a list of names for a composite key; see
    :func:`sparkjet.partition_ids`).

    The partitions are computed in the executors, one Arrow batch at a time, by
    ``df.mapInArrow``. Arguments are checked here, before any job runs: the key columns
    must exist and have a supported type, ``column`` must be new, ``partition_count`` in
    1..2**31-1. A null key fails the job with :class:`~sparkjet.errors.NullKeyError`
    naming the key.

    >>> df = spark.createDataFrame([("hello",), ("a",)], "k string")  # doctest: +SKIP
    >>> with_partition_id(df, "k").show()  # doctest: +SKIP
    +-----+------------+
    |    k|partition_id|
    +-----+------------+
    |hello|         270|
    |    a|          73|
    +-----+------------+
    """
    from pyspark.sql.types import IntegerType, StructField, StructType

    partitioner = Partitioner(partition_count, key_type=key_type, key=key)
    names = partitioner.config["key"]
    fields = {f.name: f for f in df.schema.fields}
    missing = [n for n in names if n not in fields]
    if missing:
        raise InvalidArgumentError(
            f"no key column {', '.join(map(repr, missing))}; "
            f"the DataFrame's columns are {', '.join(map(repr, df.columns))}"
        )
    for n in names:
        # As in partition_ids: in a composite key, key_type applies to the integer columns.
        _check_key_type(n, fields[n].dataType, key_type, composite=len(names) > 1)
    if not isinstance(column, str) or not column:
        raise InvalidArgumentError(f"column must be a non-empty string, got {column!r}")
    clash = [c for c in df.columns if _same_name(df, c, column)]
    if clash:
        raise InvalidArgumentError(
            f"the DataFrame already has a column {clash[0]!r}; pass column=<a new name> "
            "for the partition id"
        )
    schema = StructType([*df.schema.fields, StructField(column, IntegerType(), nullable=False)])
    return df.mapInArrow(_append_partition_ids(partitioner.config, column), schema)


def repartition_by_partition(
    df: DataFrame,
    key: str | Sequence[str],
    partition_count: int = DEFAULT_PARTITION_COUNT,
    *,
    num_spark_partitions: int | None = None,
    key_type: str | None = None,
    keep_partition_id: bool = False,
) -> DataFrame:
    """``df`` with all rows of one Hazelcast partition of ``key`` in one Spark partition:
    Hazelcast partition ``p`` goes to Spark partition ``p % num_spark_partitions``.

    ``num_spark_partitions`` defaults to ``min(partition_count,
    spark.sql.shuffle.partitions)``. The partition id is computed by
    :func:`with_partition_id` and dropped afterwards unless ``keep_partition_id`` (then it
    is the column ``partition_id``). Rows keep no particular order within a partition.

    On Spark 4.1+ the placement uses ``DataFrame.repartitionById``; on Spark 4.0 a hash
    repartition on the partition id, which still keeps each Hazelcast partition whole but
    places it by Spark's hash rather than by ``p % num_spark_partitions``.

    >>> out = repartition_by_partition(df, "k", num_spark_partitions=4)  # doctest: +SKIP
    >>> out.rdd.getNumPartitions()  # doctest: +SKIP
    4
    """
    if num_spark_partitions is None:
        Partitioner(partition_count)  # validates partition_count before it is used here
        num_spark_partitions = min(partition_count, _default_parallelism(df))
    else:
        num_spark_partitions = check_int("num_spark_partitions", num_spark_partitions, min=1)
    column = "partition_id" if keep_partition_id else _fresh_name(df, "__sparkjet_partition_id")
    with_id = with_partition_id(df, key, partition_count, column, key_type=key_type)
    if hasattr(with_id, "repartitionById"):
        out = with_id.repartitionById(num_spark_partitions, column)
    else:
        out = with_id.repartition(num_spark_partitions, column)
    return out if keep_partition_id else out.drop(column)


def _append_partition_ids(config: dict, column: str):
    """The ``mapInArrow`` function; it closes over plain data only, so it pickles small."""

    def append(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        partitioner = Partitioner(**config)
        field = pa.field(column, pa.int32(), nullable=False)
        for batch in batches:
            try:
                ids = partitioner(batch)
            except SparkjetError as e:
                raise _with_context(e, config["key"], batch) from None
            yield batch.append_column(field, ids)

    return append


def _with_context(error: SparkjetError, key: list[str], batch: pa.RecordBatch) -> SparkjetError:
    """``error`` again, its message naming the key columns and, since an index counts rows
    of one Arrow batch only, showing the offending row so it can be found."""
    message = f"with_partition_id(key={key[0] if len(key) == 1 else key!r}): {error}"
    index = getattr(error, "index", None)
    if index is not None and 0 <= index < batch.num_rows:
        row = repr(batch.slice(index, 1).to_pylist()[0])
        message += f" (index within one Arrow batch; the row is {_shorten(row, 300)})"
    if isinstance(error, NullKeyError):
        message += f"; drop or fill null keys first, e.g. df.dropna(subset={key!r})"
    try:
        return type(error)(message) if index is None else type(error)(message, index)
    except TypeError:
        return error


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_key_type(name: str, data_type, key_type: str | None, *, composite: bool = False) -> None:
    from pyspark.sql import types as T

    integral = (T.IntegerType, T.ShortType, T.ByteType, T.LongType)
    others = tuple(
        getattr(T, t) for t in ("StringType", "CharType", "VarcharType", "BinaryType")
        if hasattr(T, t)
    )
    if isinstance(data_type, integral):
        return
    if isinstance(data_type, others):
        if key_type is not None and not composite:
            raise InvalidArgumentError(
                f"key_type={key_type!r} applies to integer keys, but key column {name!r} is "
                f"{data_type.simpleString()}"
            )
        return
    raise UnsupportedTypeError(
        f"key column {name!r} is {data_type.simpleString()}; Hazelcast partitioning supports "
        "int, smallint, tinyint (Integer), bigint (Long), string (String) and binary (byte[]) "
        f"keys; cast it first, e.g. df.withColumn({name!r}, df[{name!r}].cast('string'))"
    )


def _same_name(df: DataFrame, a: str, b: str) -> bool:
    if a == b:
        return True
    case_sensitive = df.sparkSession.conf.get("spark.sql.caseSensitive", "false")
    return str(case_sensitive).lower() != "true" and a.lower() == b.lower()


def _fresh_name(df: DataFrame, base: str) -> str:
    taken = {c.lower() for c in df.columns}
    name, n = base, 0
    while name.lower() in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def _default_parallelism(df: DataFrame) -> int:
    value = df.sparkSession.conf.get("spark.sql.shuffle.partitions", None)
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        # e.g. "auto" on some platforms: fall back to the cores Spark sees.
        return default_parallelism(df.sparkSession)  # also on Spark Connect


