"""Merkle diff of two Spark DataFrames: the keys added, removed or changed from one to
the other, moving only tree nodes and the rows under differing leaves.

1. **Trees in the executors.** Each task (the input partitions coalesced to twice the
   default parallelism, as every task allocates a whole forest) builds a partial
   :class:`~sparkjet.merkle.MerkleForest` of its rows (``mapInArrow``) and emits the
   leaves of its non-empty trees. Leaf sums add up, so the partial trees are summed per
   Hazelcast partition, in the executors too (``groupBy().applyInArrow``). Only the
   summed leaves, ``partition_count * 4 * 2**(depth-1)`` bytes per side, reach the
   driver. Each task needs ``4 * partition_count * (2**depth - 1)`` bytes of memory.
2. **Diff on the driver** (:func:`sparkjet.merkle.diff`).
3. **Rows under differing leaves.** The set of differing (partition, leaf) is broadcast;
   the executors keep only the rows under those leaves (the same fused native pass as
   :func:`sparkjet.merkle.sync_plan`), and only those rows are joined on the key and
   compared, column by column, null-safe.

Step 1 runs one Spark job when :func:`merkle_diff` is called; the DataFrame it returns
reads the inputs again for step 3 (cache them if they are expensive to compute).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import reduce
from typing import TYPE_CHECKING

import numpy as np

from sparkjet._batches import one_array
from sparkjet._keys import (
    check_key_type as _check_key_type,
)
from sparkjet._keys import (
    check_partition_count as _check_partition_count,
)
from sparkjet._keys import (
    key_names as _key_names,
)
from sparkjet.errors import InvalidArgumentError, SparkjetError, UnsupportedTypeError
from sparkjet.merkle._hashing import column_names
from sparkjet.merkle.compare import diff, leaf_set, rows_under_leaves
from sparkjet.merkle.forest import DEFAULT_DEPTH, MerkleForest, check_depth, check_value_hash
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT
from sparkjet.spark.session import default_parallelism

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

__all__ = ["merkle_diff", "merkle_forest"]

_SIDE, _PARTITION, _LEAVES = "side", "partition", "leaves"


def merkle_forest(
    df: DataFrame,
    key: str | Sequence[str],
    depth: int = DEFAULT_DEPTH,
    partition_count: int = DEFAULT_PARTITION_COUNT,
    *,
    value: str | Sequence[str] | None = None,
    key_type: str | None = None,
    value_hash: str = "value",
) -> MerkleForest:
    """The :class:`~sparkjet.merkle.MerkleForest` of a DataFrame's rows, built in the
    executors; only its leaves travel to the driver. Arguments as
    :meth:`MerkleForest.add <sparkjet.merkle.MerkleForest.add>` takes them."""
    config = _config(df, None, key, depth, partition_count, value, key_type, value_hash)
    return _forests(df, None, config)[0]


def merkle_diff(
    df_a: DataFrame,
    df_b: DataFrame,
    key: str | Sequence[str],
    depth: int = DEFAULT_DEPTH,
    partition_count: int = DEFAULT_PARTITION_COUNT,
    *,
    value: str | Sequence[str] | None = None,
    key_type: str | None = None,
    value_hash: str = "entry",
) -> DataFrame:
    """The keys that differ from ``df_a`` to ``df_b``: a DataFrame of the key columns and
    ``change``, one of ``"added"`` (only in ``df_b``), ``"removed"`` (only in ``df_a``)
    or ``"changed"`` (a value column differs; nulls equal nulls).

    ``key`` is a column or a list of them, unique in each DataFrame and never null;
    ``value`` the columns compared (default: every other column). Both DataFrames need
    those columns with the same types. ``depth`` and ``partition_count`` shape the trees
    (see :func:`sparkjet.merkle.choose_depth` for the depth that suits a change rate);
    ``value_hash="entry"`` binds values to keys so that values swapped between keys of
    one leaf are found too.

    >>> changes = merkle_diff(yesterday, today, key="id", depth=14)  # doctest: +SKIP
    >>> changes.groupBy("change").count().show()  # doctest: +SKIP
    """
    config = _config(df_a, df_b, key, depth, partition_count, value, key_type, value_hash)
    forest_a, forest_b = _forests(df_a, df_b, config)
    found = diff(forest_a, forest_b)
    keys, values = config["key"], config["value"]
    spark = df_a.sparkSession
    if not found:
        schema = df_a.select(*keys).schema.add("change", "string")
        return spark.createDataFrame([], schema)
    leaf_ids = spark.sparkContext.broadcast(np.asarray(found.leaf_ids, np.int64))
    a = _under_leaves(df_a.select(*keys, *values), config, leaf_ids)
    b = _under_leaves(df_b.select(*keys, *values), config, leaf_ids)
    return _compare(a, b, keys, values)


def _config(df_a, df_b, key, depth, partition_count, value, key_type, value_hash) -> dict:
    """Checks the arguments against the schemas before any job runs; plain data for the
    executors."""
    check_depth(depth)
    _check_partition_count(partition_count)
    _check_key_type(key_type)
    check_value_hash(value_hash)
    keys = list(_key_names(key))
    fields = {f.name: f.dataType for f in df_a.schema.fields}
    values = ([n for n in df_a.columns if n not in keys] if value is None
              else list(column_names(value, "value")))
    for name in (*keys, *values):
        if name not in fields:
            raise InvalidArgumentError(
                f"no column {name!r}; the DataFrame's columns are "
                f"{', '.join(map(repr, df_a.columns))}")
    if set(keys) & set(values):
        both = min(set(keys) & set(values))
        raise InvalidArgumentError(f"column {both!r} is both a key and a value")
    for name in keys:
        # As in MerkleForest: in a composite key, key_type applies to the integer columns.
        _check_type(name, fields[name], "key", key_type if len(keys) == 1 else None)
    for name in values:
        _check_type(name, fields[name], "value", None)
    if df_b is not None:
        other = {f.name: f.dataType for f in df_b.schema.fields}
        for name in (*keys, *values):
            if name not in other:
                raise InvalidArgumentError(f"column {name!r} is in df_a but not in df_b")
            if other[name] != fields[name]:
                raise InvalidArgumentError(
                    f"column {name!r} is {fields[name].simpleString()} in df_a but "
                    f"{other[name].simpleString()} in df_b")
    return {"key": keys, "value": values, "depth": depth, "partition_count": partition_count,
            "key_type": key_type, "value_hash": value_hash}


def _check_type(name: str, data_type, role: str, key_type) -> None:
    from pyspark.sql import types as T

    integral = (T.IntegerType, T.ShortType, T.ByteType, T.LongType)
    text = tuple(getattr(T, t) for t in ("StringType", "CharType", "VarcharType", "BinaryType")
                 if hasattr(T, t))
    if role == "key":
        if isinstance(data_type, integral) or (isinstance(data_type, text) and key_type is None):
            return
        if isinstance(data_type, text):
            raise InvalidArgumentError(
                f"key_type={key_type!r} applies to integer keys, but key column {name!r} is "
                f"{data_type.simpleString()}")
        raise UnsupportedTypeError(
            f"key column {name!r} is {data_type.simpleString()}; Merkle keys are int, smallint, "
            "tinyint, bigint, string or binary (Hazelcast's Integer, Long, String, byte[])")
    scalar = (*integral, *text, T.BooleanType, T.FloatType, T.DoubleType, T.DecimalType,
              T.DateType, T.TimestampType, T.NullType,
              *(getattr(T, t) for t in ("TimestampNTZType", "DayTimeIntervalType")
                if hasattr(T, t)))
    if not isinstance(data_type, scalar):
        raise UnsupportedTypeError(
            f"value column {name!r} is {data_type.simpleString()}; Merkle value hashing takes "
            "numbers, booleans, strings, binary, decimals, dates and timestamps: drop it with "
            "value=[...] or turn it into one, e.g. with to_json")


def _forests(df_a, df_b, config: dict) -> list[MerkleForest]:
    """Partial forests per Spark partition, summed per (side, partition) in the
    executors; the driver gets one leaves array per non-empty tree."""
    from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

    schema = StructType([StructField(_SIDE, IntegerType(), False),
                         StructField(_PARTITION, IntegerType(), False),
                         StructField(_LEAVES, BinaryType(), False)])
    columns = [*config["key"], *config["value"]]
    sides = [df for df in (df_a, df_b) if df is not None]
    # Each task allocates a whole forest and ships its leaves: a few big tasks, not
    # one per small input partition (coalesce merges partitions without a shuffle).
    tasks = 2 * default_parallelism(sides[0].sparkSession)
    partials = [df.select(*columns).coalesce(tasks).mapInArrow(_partial_trees(config, side),
                                                               schema)
                for side, df in enumerate(sides)]
    summed = reduce(lambda x, y: x.unionAll(y), partials).groupBy(_SIDE, _PARTITION).applyInArrow(
        _sum_leaves, schema)
    leaves_per_tree = 1 << (config["depth"] - 1)
    leaves = [np.zeros((config["partition_count"], leaves_per_tree), np.int32) for _ in sides]
    for row in summed.collect():
        leaves[row[_SIDE]][row[_PARTITION]] = np.frombuffer(row[_LEAVES], "<i4")
    return [MerkleForest.from_leaves(x, value_hash=config["value_hash"]) for x in leaves]


def _partial_trees(config: dict, side: int):
    """The ``mapInArrow`` function building one Spark partition's partial forest; it
    closes over plain data only."""

    def build(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        forest = MerkleForest(config["partition_count"], config["depth"],
                              value_hash=config["value_hash"])
        for batch in batches:
            try:
                forest.add(batch, key=config["key"], value=config["value"],
                           key_type=config["key_type"])
            except SparkjetError as e:
                raise _in_executor(e, config["key"]) from None
        leaves = np.ascontiguousarray(forest.leaves).astype("<i4", copy=False)
        touched = np.flatnonzero(leaves.any(axis=1))
        if len(touched):
            yield pa.record_batch({
                _SIDE: pa.array(np.full(len(touched), side, np.int32)),
                _PARTITION: pa.array(touched.astype(np.int32)),
                _LEAVES: pa.array([leaves[p].tobytes() for p in touched], pa.binary()),
            })

    return build


def _in_executor(error: SparkjetError, key: list[str]) -> SparkjetError:
    """``error`` again, saying which call it came from; its row index counts the rows of
    one Arrow batch of one task only."""
    message = f"merkle_diff(key={key!r}): {error} (the row index is within one Arrow batch)"
    index = getattr(error, "index", None)
    return type(error)(message) if index is None else type(error)(message, index)


def _sum_leaves(table):
    """One (side, partition) group: the wrapping int32 sum of its partial leaves. (No type
    hints: applyInArrow reads them to choose its calling convention.)"""
    import pyarrow as pa

    # Every row holds one partial tree's leaves as int32 bytes of the same length: view
    # them all as one 2-D array (no per-row Python) and add up; numpy wraps at 32 bits.
    column = table.column(_LEAVES).combine_chunks()
    width = len(column[0].as_py()) // 4
    data = column.buffers()[2]
    offsets = np.frombuffer(column.buffers()[1], np.int32, len(column) + 1, column.offset * 4)
    rows = np.frombuffer(data, "<i4", (offsets[-1] - offsets[0]) // 4, offsets[0])
    total = rows.reshape(len(column), width).sum(axis=0, dtype=np.int32)
    return pa.table({_SIDE: table.column(_SIDE).slice(0, 1),
                     _PARTITION: table.column(_PARTITION).slice(0, 1),
                     _LEAVES: pa.array([total.tobytes()], pa.binary())})


def _under_leaves(df: DataFrame, config: dict, leaf_ids) -> DataFrame:
    """``df`` filtered in the executors to the rows whose key lies under a differing
    leaf (``leaf_ids``: a broadcast of the diff's leaf ids)."""
    keys, key_type = config["key"], config["key_type"]
    depth, partition_count = config["depth"], config["partition_count"]

    def keep(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        leaves = leaf_set(leaf_ids.value, depth, partition_count)  # once per task
        for batch in batches:
            mask = rows_under_leaves(pa.Table.from_batches([batch]), keys, key_type, leaves)
            yield batch.filter(one_array(mask))

    return df.mapInArrow(keep, df.schema)


def _compare(a: DataFrame, b: DataFrame, keys: list[str], values: list[str]) -> DataFrame:
    """Full outer join of the two (small) row sets on the key; what differs, and how."""
    from pyspark.sql import functions as F

    def side(df, tag):
        return df.select(*[F.col(f"`{k}`").alias(f"{tag}_k{i}") for i, k in enumerate(keys)],
                         *[F.col(f"`{v}`").alias(f"{tag}_v{i}") for i, v in enumerate(values)],
                         F.lit(True).alias(f"{tag}_present"))

    left, right = side(a, "a"), side(b, "b")
    on = reduce(lambda x, y: x & y,
                [left[f"a_k{i}"] == right[f"b_k{i}"] for i in range(len(keys))])
    joined = left.join(right, on=on, how="full_outer")
    same = reduce(lambda x, y: x & y,
                  [F.col(f"a_v{i}").eqNullSafe(F.col(f"b_v{i}")) for i in range(len(values))],
                  F.lit(True))
    change = (F.when(F.col("a_present").isNull(), F.lit("added"))
              .when(F.col("b_present").isNull(), F.lit("removed"))
              .when(~same, F.lit("changed")))
    out = joined.select(*[F.coalesce(F.col(f"a_k{i}"), F.col(f"b_k{i}")).alias(k)
                          for i, k in enumerate(keys)], change.alias("change"))
    return out.where(F.col("change").isNotNull())
