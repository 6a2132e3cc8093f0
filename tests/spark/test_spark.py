"""sparkjet.spark on a real local session, and the Java finder it relies on."""
import os
import random
import stat
import textwrap

import pyarrow as pa
import pytest

import sparkjet
from sparkjet.spark.java import (
    JavaNotFoundError,
    ensure_java,
    find_java_home,
    parse_java_version,
)

ROWS = 5_000


# --- the Java finder ------------------------------------------------------------------------


def fake_java_home(root, version_line):
    """A folder that looks like a Java home whose ``bin/java -version`` prints
    ``version_line`` to stderr, as real ones do."""
    java = root / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            echo '{version_line}' >&2
            echo 'OpenJDK Runtime Environment (build fake)' >&2
            """
        )
    )
    java.chmod(java.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return root


def test_java_home_too_old_names_the_version(tmp_path):
    home = fake_java_home(tmp_path / "jdk11", 'openjdk version "11.0.2" 2019-01-15')
    with pytest.raises(JavaNotFoundError) as e:
        find_java_home(environ={"JAVA_HOME": str(home), "PATH": ""}, search_patterns=())
    message = str(e.value)
    assert "Java 11" in message and str(home) in message and "JAVA_HOME" in message
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, sparkjet.SparkjetError)


def test_java_home_without_bin_java_says_so(tmp_path):
    with pytest.raises(JavaNotFoundError, match="does not exist"):
        find_java_home(environ={"JAVA_HOME": str(tmp_path), "PATH": ""}, search_patterns=())


def test_no_java_anywhere_says_what_to_install(tmp_path):
    with pytest.raises(JavaNotFoundError) as e:
        find_java_home(environ={"PATH": ""}, search_patterns=(str(tmp_path / "jvm" / "*"),))
    message = str(e.value)
    assert "JAVA_HOME is not set" in message
    assert "no `java` on PATH" in message
    assert str(tmp_path / "jvm") in message
    assert "apt-get install openjdk-17-jre-headless" in message


def test_valid_java_home_is_returned(tmp_path):
    home = fake_java_home(tmp_path / "jdk17", 'openjdk version "17.0.2" 2022-01-18')
    assert find_java_home(environ={"JAVA_HOME": str(home)}, search_patterns=()) == str(home)


def test_java_on_path_resolves_symlinks_to_its_home(tmp_path):
    home = fake_java_home(tmp_path / "jdk21", 'openjdk version "21.0.1" 2023-10-17')
    bin_dir = tmp_path / "usr-bin"
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(home / "bin" / "java")
    found = find_java_home(environ={"PATH": str(bin_dir)}, search_patterns=())
    assert found == os.path.realpath(home)


def test_search_folders_pick_the_newest_usable_version(tmp_path):
    old = fake_java_home(tmp_path / "jvm" / "old", 'java version "1.8.0_292"')
    fake_java_home(tmp_path / "jvm" / "jdk17", 'openjdk version "17.0.9"')
    fake_java_home(tmp_path / "jvm" / "jdk21", 'openjdk version "21-ea"')
    (tmp_path / "jvm" / "empty").mkdir()
    old_on_path = old / "bin"
    found = find_java_home(
        environ={"PATH": str(old_on_path)}, search_patterns=(str(tmp_path / "jvm" / "*"),)
    )
    assert found == os.path.realpath(tmp_path / "jvm" / "jdk21")


def test_only_old_javas_are_listed_in_the_error(tmp_path):
    fake_java_home(tmp_path / "jvm" / "jdk11", 'openjdk version "11.0.2"')
    with pytest.raises(JavaNotFoundError, match=r"jdk11: Java 11, too old"):
        find_java_home(environ={"PATH": ""}, search_patterns=(str(tmp_path / "jvm" / "*"),))


def test_ensure_java_sets_java_home(tmp_path, monkeypatch):
    home = fake_java_home(tmp_path / "jdk17", 'openjdk version "17.0.2"')
    monkeypatch.setenv("JAVA_HOME", str(home))
    assert ensure_java() == str(home)
    assert os.environ["JAVA_HOME"] == str(home)


@pytest.mark.parametrize(
    "text, version",
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('java version "1.8.0_292"', 8),
        ('openjdk version "21-ea" 2023-09-19', 21),
        ('openjdk version "25" 2025-09-16', 25),
        ("no version here", None),
    ],
)
def test_parse_java_version(text, version):
    assert parse_java_version(text) == version


# --- Spark ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys():
    """Keys of every supported Spark type, extremes, non-ASCII and empty strings included."""
    rng = random.Random(271)
    strings = ["", "a", "hello", "ünïcödé", "日本語", "🎉 emoji", "x" * 300]
    strings += ["".join(rng.choice("abcé漢🎉 ") for _ in range(rng.randrange(0, 20)))
                for _ in range(ROWS - len(strings))]
    ints = [0, 1, -1, 2**31 - 1, -(2**31)] + [rng.randrange(-(2**31), 2**31)
                                             for _ in range(ROWS - 5)]
    longs = [0, 1, -1, 2**63 - 1, -(2**63)] + [rng.randrange(-(2**63), 2**63)
                                              for _ in range(ROWS - 5)]
    return pa.table(
        {
            "id": pa.array(range(ROWS), pa.int64()),
            "i": pa.array(ints, pa.int32()),
            "l": pa.array(longs, pa.int64()),
            "s": pa.array(strings, pa.string()),
            "b": pa.array([s.encode() for s in strings], pa.binary()),
            "h": pa.array([v % 32768 - 16384 for v in ints], pa.int16()),
            "y": pa.array([v % 256 - 128 for v in ints], pa.int8()),
        }
    )


@pytest.fixture(scope="module")
def df(spark, keys):
    # Four slices, so the executors see several Arrow batches.
    return spark.createDataFrame(keys).repartition(4).cache()


def collect(frame):
    return frame.toArrow().sort_by("id")


@pytest.mark.spark
@pytest.mark.parametrize(
    "key, key_type",
    [("i", None), ("l", None), ("s", None), ("b", None), ("h", None), ("y", None),
     ("i", "long"), (["s", "l"], None), (["i", "b", "y"], None),
     # In a composite key, key_type applies to its integer columns, as in partition_ids.
     (["s", "i"], "long"), (["b", "y"], "integer")],
)
def test_with_partition_id_equals_partition_ids(df, keys, key, key_type):
    out = collect(sparkjet.spark.with_partition_id(df, key, 271, key_type=key_type))
    assert out.num_rows == ROWS
    assert out.schema.field("partition_id").type == pa.int32()
    expected = sparkjet.partition_ids(out, 271, key=key, key_type=key_type)
    assert out.column("partition_id").combine_chunks().equals(expected)
    # And the collected keys are the ones sent: Spark did not alter them on the way.
    assert out.select(["id", *([key] if isinstance(key, str) else key)]).equals(
        keys.select(["id", *([key] if isinstance(key, str) else key)]), check_metadata=False
    )


@pytest.mark.spark
def test_with_partition_id_other_count_and_column_name(df):
    out = collect(sparkjet.spark.with_partition_id(df, "s", 7, column="p"))
    assert out.column("p").combine_chunks().equals(sparkjet.partition_ids(out, 7, key="s"))
    assert set(out.column("p").to_pylist()) == set(range(7))


@pytest.mark.spark
def test_with_partition_id_of_the_readme_keys(spark):
    frame = spark.createDataFrame([("hello",), ("a",)], "k string")
    out = sparkjet.spark.with_partition_id(frame, "k").collect()
    assert [(r.k, r.partition_id) for r in out] == [("hello", 270), ("a", 73)]


@pytest.mark.spark
def test_repartition_by_partition_keeps_each_partition_whole(df, keys):
    from pyspark.sql import functions as F

    out = sparkjet.spark.repartition_by_partition(
        df, "s", 271, num_spark_partitions=5, keep_partition_id=True
    )
    assert out.rdd.getNumPartitions() == 5
    got = collect(out.withColumn("spark_partition", F.spark_partition_id()))
    assert sorted(got.column("id").to_pylist()) == list(range(ROWS))  # none lost or doubled
    placement = {}
    for p, sp in zip(got.column("partition_id").to_pylist(),
                     got.column("spark_partition").to_pylist()):
        placement.setdefault(p, set()).add(sp)
    assert all(len(spark_partitions) == 1 for spark_partitions in placement.values())
    if hasattr(df, "repartitionById"):
        assert all(sps == {p % 5} for p, sps in placement.items())
    assert got.column("partition_id").combine_chunks().equals(
        sparkjet.partition_ids(got, 271, key="s")
    )


@pytest.mark.spark
def test_repartition_by_partition_defaults(df):
    from pyspark.sql import functions as F

    out = sparkjet.spark.repartition_by_partition(df, ["l", "s"])
    assert out.columns == df.columns  # the helper column is dropped
    shuffle = int(df.sparkSession.conf.get("spark.sql.shuffle.partitions"))
    assert out.rdd.getNumPartitions() == min(271, shuffle)
    with_ids = sparkjet.spark.with_partition_id(
        out.withColumn("spark_partition", F.spark_partition_id()), ["l", "s"]
    )
    rows = with_ids.groupBy("partition_id").agg(
        F.countDistinct("spark_partition").alias("n"), F.count("*").alias("rows")
    ).collect()
    assert {r.n for r in rows} == {1}
    assert sum(r.rows for r in rows) == ROWS


@pytest.mark.spark
def test_unknown_key_column_lists_the_columns(df):
    with pytest.raises(ValueError, match=r"no key column 'nope'.*'id', 'i', 'l', 's'"):
        sparkjet.spark.with_partition_id(df, ["s", "nope"])


@pytest.mark.spark
def test_existing_output_column_is_refused(df):
    with pytest.raises(ValueError, match="already has a column 's'"):
        sparkjet.spark.with_partition_id(df, "i", column="s")
    with pytest.raises(ValueError, match="already has a column 'partition_id'"):
        sparkjet.spark.with_partition_id(sparkjet.spark.with_partition_id(df, "i"), "l")


@pytest.mark.spark
def test_bad_arguments_are_refused_on_the_driver(df):
    with pytest.raises(ValueError, match="partition_count"):
        sparkjet.spark.with_partition_id(df, "i", 0)
    with pytest.raises(ValueError, match="num_spark_partitions"):
        sparkjet.spark.repartition_by_partition(df, "i", num_spark_partitions=0)
    with pytest.raises(ValueError, match="key_type='integer' applies to integer keys"):
        sparkjet.spark.with_partition_id(df, "s", key_type="integer")
    with pytest.raises(TypeError, match="key column 'd' is double"):
        sparkjet.spark.with_partition_id(df.withColumn("d", df.i.cast("double")), "d")


@pytest.mark.spark
def test_null_key_fails_the_job_naming_the_key(spark):
    frame = spark.createDataFrame([(1, "a"), (2, None)], "id long, k string")
    with pytest.raises(Exception, match=r"with_partition_id\(key='k'\).*null") as e:
        sparkjet.spark.with_partition_id(frame, "k").collect()
    assert "NullKeyError" in str(e.value) and "{'id': 2, 'k': None}" in str(e.value)


@pytest.mark.spark
def test_key_out_of_integer_range_fails_the_job(spark):
    frame = spark.createDataFrame([(1,), (2**40,)], "k long")
    with pytest.raises(Exception, match="does not fit a Hazelcast Integer"):
        sparkjet.spark.with_partition_id(frame, "k", key_type="integer").collect()
