"""merkle_diff and merkle_forest on a local Spark session, against a join-based diff of
the same data and against forests built locally."""
import datetime

import numpy as np
import pyarrow as pa
import pytest

from sparkjet.errors import InvalidArgumentError, UnsupportedTypeError
from sparkjet.merkle import MerkleForest
from sparkjet.spark.merkle import merkle_diff, merkle_forest

pytestmark = pytest.mark.spark

ROWS = 20_000


@pytest.fixture(scope="module")
def tables():
    """A table and a changed copy: updates, values set to null, deletes, inserts, and
    values swapped between keys."""
    rng = np.random.default_rng(42)
    ids = rng.choice(10**12, ROWS + 40, replace=False).astype(np.int64)
    amount = rng.integers(-(10**6), 10**6, ROWS + 40)
    price = rng.normal(100, 10, ROWS + 40)
    note = np.array([f"note {x}" for x in rng.integers(0, 50, ROWS + 40)], object)
    day = [datetime.date(2024, 1, 1) + datetime.timedelta(days=int(x))
           for x in rng.integers(0, 365, ROWS + 40)]

    def table(rows, amount, price, note):
        return pa.table({
            "id": pa.array(ids[rows]),
            "region": pa.array([f"r{x % 7}" for x in ids[rows]]),
            "amount": pa.array(amount[rows]),
            "price": pa.array(price[rows], mask=np.isnan(price[rows])),
            "note": pa.array(note[rows]),
            "day": pa.array([day[i] for i in rows], pa.date32()),
        })

    old = np.arange(ROWS)
    a = table(old, amount, price, note)
    amount2, price2, note2 = amount.copy(), price.copy(), note.copy()
    amount2[rng.choice(ROWS, 60, replace=False)] += 1
    price2[rng.choice(ROWS, 15, replace=False)] = np.nan  # becomes null
    swap = rng.choice(ROWS, 10, replace=False)
    note2[swap] = note2[swap[::-1]]
    kept = np.sort(rng.choice(ROWS, ROWS - 25, replace=False))
    new = np.r_[kept, np.arange(ROWS, ROWS + 40)]
    b = table(new, amount2, price2, note2)
    return a, b


@pytest.fixture(scope="module")
def frames(spark, tables):
    a, b = tables
    # Several Spark partitions, so partial trees from different tasks must add up.
    return (spark.createDataFrame(a).repartition(4).cache(),
            spark.createDataFrame(b).repartition(3).cache())


def join_diff(df_a, df_b, keys, values):
    """The obvious way: a full outer join of everything, compared null-safe."""
    from functools import reduce

    from pyspark.sql import functions as F

    a = df_a.select(*keys, *[F.col(v).alias(f"a_{v}") for v in values], F.lit(1).alias("in_a"))
    b = df_b.select(*keys, *[F.col(v).alias(f"b_{v}") for v in values], F.lit(1).alias("in_b"))
    same = reduce(lambda x, y: x & y, [F.col(f"a_{v}").eqNullSafe(F.col(f"b_{v}")) for v in values],
                  F.lit(True))
    change = (F.when(F.col("in_a").isNull(), "added").when(F.col("in_b").isNull(), "removed")
              .when(~same, "changed"))
    joined = a.join(b, on=keys, how="full_outer").select(*keys, change.alias("change"))
    return as_set(joined.where(F.col("change").isNotNull()), keys)


def as_set(df, keys):
    return {(tuple(r[k] for k in keys), r["change"]) for r in df.collect()}


def test_merkle_diff_equals_a_join_diff(frames):
    df_a, df_b = frames
    values = ["region", "amount", "price", "note", "day"]
    got = merkle_diff(df_a, df_b, "id")
    assert got.columns == ["id", "change"]
    result = as_set(got, ["id"])
    assert result == join_diff(df_a, df_b, ["id"], values)
    counts = {c: sum(1 for _, x in result if x == c) for c in ("added", "removed", "changed")}
    assert counts["added"] == 40 and counts["removed"] == 25 and counts["changed"] >= 60


def test_composite_key_value_subset_and_other_shapes(frames):
    df_a, df_b = frames
    keys, values = ["region", "id"], ["amount", "note"]
    got = merkle_diff(df_a, df_b, keys, depth=7, partition_count=13, value=values)
    assert as_set(got, keys) == join_diff(df_a, df_b, keys, values)


def test_forest_built_in_executors_equals_a_local_one(frames, tables):
    df_a, _ = frames
    forest = merkle_forest(df_a, "id", 9, 271, value=["amount", "price"], value_hash="entry")
    local = MerkleForest(271, 9, value_hash="entry")
    local.add(tables[0], key="id", value=["amount", "price"])
    assert forest == local


def test_identical_frames_differ_nowhere(frames):
    df_a, _ = frames
    got = merkle_diff(df_a, df_a.select(*reversed(df_a.columns)), "id")
    assert got.count() == 0
    assert got.columns == ["id", "change"]


def test_bad_arguments_fail_before_any_job(spark, frames):
    df_a, df_b = frames
    with pytest.raises(InvalidArgumentError, match="'amount' is bigint in df_a but string in df_b"):
        merkle_diff(df_a, df_b.withColumn("amount", df_b["amount"].cast("string")), "id")
    with pytest.raises(InvalidArgumentError, match="no column 'nope'"):
        merkle_diff(df_a, df_b, "nope")
    with pytest.raises(InvalidArgumentError, match="depth must be an int in 2..27"):
        merkle_diff(df_a, df_b, "id", depth=30)
    tagged = spark.createDataFrame([(1, [1, 2])], "id long, tags array<int>")
    with pytest.raises(UnsupportedTypeError, match="value column 'tags'"):
        merkle_diff(tagged, tagged, "id")
    with pytest.raises(UnsupportedTypeError, match="key column 'price'"):
        merkle_diff(df_a, df_b, "price")


def test_null_key_fails_the_job_naming_the_key(spark):
    df = spark.createDataFrame([(1, 1), (None, 2)], "id long, v long")
    with pytest.raises(Exception, match="key column 'id' has a null"):
        merkle_diff(df, df, "id")
