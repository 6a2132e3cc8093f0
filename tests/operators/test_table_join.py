"""join_table: the kernel against pandas, jobs on the generator compared exactly with a
pandas merge of the whole input, SIGKILLs, and table versions that change only at barriers
and survive restarts."""
import json
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers.jobs import run_with_kills

from sparkjet import verify
from sparkjet.errors import InvalidArgumentError, SnapshotIncompleteError
from sparkjet.operators.table_join import (
    TABLES_VERTEX,
    ReferenceTable,
    TableIndex,
    TableLoadError,
    TableVersion,
    ipc_bytes,
)
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.snapshotting import entries_json
from sparkjet.sinks import TransactionalFileSink
from sparkjet.snapshot.store import SnapshotStore, content_digest
from sparkjet.sources import GeneratorSource

KEYS = 100


def reference(version: str = "v1", *, duplicates: bool = False) -> pa.Table:
    """Even keys of 0..KEYS-1 (odd keys match nothing): key -> name, weight; with
    ``duplicates``, keys divisible by 10 twice."""
    keys = np.arange(0, KEYS, 2)
    if duplicates:
        keys = np.concatenate([keys, np.arange(0, KEYS, 10)])
    return pa.table({"key": keys, "name": [f"{version}-{k}" for k in keys],
                     "weight": np.arange(len(keys)) * 0.25})


def joined(batch, table, on, how, prefix=""):
    s, t = on
    return TableIndex(table, t, prefix).probe(batch, s, how)


def pandas_merge(events: pd.DataFrame, table: pa.Table, how: str) -> pd.DataFrame:
    return events.merge(table.to_pandas(), on="key", how=how)


def canonical(df: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c in df.columns if c != "ts"]
    return df[cols].sort_values(["id", "name"], na_position="first").reset_index(drop=True)


# -- the kernel -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("duplicates", [False, True])
def test_kernel_matches_pandas(how, duplicates):
    table = reference(duplicates=duplicates)
    rng = np.random.default_rng(3)
    keys = rng.integers(-5, KEYS + 5, 5_000)
    events = pa.record_batch({"id": np.arange(5_000), "key": keys})
    out = joined(events, table, (("key",), ("key",)), how).to_pandas()
    want = pandas_merge(events.to_pandas(), table, how)
    pd.testing.assert_frame_equal(canonical(out), canonical(want), check_dtype=False)
    # Events keep their order; a duplicated key gives its table rows in table order.
    assert np.all(np.diff(out["id"].to_numpy()) >= 0)


def test_inner_multiplies_duplicates_and_left_keeps_the_unmatched():
    table = pa.table({"id": [1, 2, 2], "w": [10, 20, 21]})
    events = pa.record_batch({"k": [2, 3, 1, None], "v": ["a", "b", "c", "d"]})
    on = (("k",), ("id",))
    assert joined(events, table, on, "inner").to_pylist() == [
        {"k": 2, "v": "a", "w": 20}, {"k": 2, "v": "a", "w": 21}, {"k": 1, "v": "c", "w": 10}]
    assert joined(events, table, on, "left").to_pylist() == [
        {"k": 2, "v": "a", "w": 20}, {"k": 2, "v": "a", "w": 21}, {"k": 3, "v": "b", "w": None},
        {"k": 1, "v": "c", "w": 10}, {"k": None, "v": "d", "w": None}]


def test_composite_keys_of_mixed_widths():
    table = pa.table({"user": pa.array([1, 1, 2], pa.int64()), "page": ["x", "y", "x"],
                      "title": ["one-x", "one-y", "two-x"]})
    events = pa.record_batch({"u": pa.array([1, 2, 1, 2], pa.int32()),
                              "p": pa.array(["y", "x", "z", "y"], pa.large_string())})
    out = joined(events, table, (("u", "p"), ("user", "page")), "left")
    assert out.column("title").to_pylist() == ["one-y", "two-x", None, None]
    assert out.schema.names == ["u", "p", "title"]


def test_string_keys_and_dictionary_streams():
    table = pa.table({"code": pa.array(["de", "fr", "it"], pa.large_string()),
                      "country": ["Germany", "France", "Italy"]})
    events = pa.record_batch({"code": pa.array(["it", "xx", "de"]).dictionary_encode()})
    out = joined(events, table, (("code",), ("code",)), "inner")
    assert out.column("country").to_pylist() == ["Italy", "Germany"]


def test_key_type_mismatch_is_a_clear_error():
    table = pa.table({"id": ["1", "2"], "w": [1, 2]})
    with pytest.raises(InvalidArgumentError,
                       match=r"stream key 'k' is int64 but table key 'id' is a string column"):
        joined(pa.record_batch({"k": [1, 2]}), table, (("k",), ("id",)), "inner")
    with pytest.raises(TableLoadError, match="key column 'id' has type double"):
        TableIndex(pa.table({"id": [1.5]}), ("id",))


def test_column_clash_is_an_error_unless_a_prefix_renames():
    table = pa.table({"key": [1], "value": [2.0]})
    events = pa.record_batch({"key": [1], "value": [3.0]})
    with pytest.raises(InvalidArgumentError, match=r"\['value'\] are also stream columns"):
        joined(events, table, (("key",), ("key",)), "inner")
    out = joined(events, table, (("key",), ("key",)), "inner", prefix="t_")
    assert out.to_pylist() == [{"key": 1, "value": 3.0, "t_value": 2.0}]


def test_load_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(TableLoadError, match="reference table file .*missing.parquet does not exist"):
        ReferenceTable.from_file(tmp_path / "missing.parquet")
    with pytest.raises(InvalidArgumentError, match="unknown format '.xlsx'"):
        ReferenceTable.from_file(tmp_path / "t.xlsx")
    path = tmp_path / "t.csv"
    path.write_text("id,name\n1,a\n")
    table = ReferenceTable.from_file(path)
    assert table.load().to_pylist() == [{"id": 1, "name": "a"}]
    os.remove(path)
    with pytest.raises(TableLoadError, match="t.csv does not exist"):
        table.load()
    with pytest.raises(TableLoadError, match="loader .*returned list, expected a pyarrow Table"):
        ReferenceTable.from_loader(lambda: [1, 2]).load()
    with pytest.raises(TableLoadError, match=r"has no key column 'key'; its columns are \['id'"):
        TableIndex(pa.table({"id": [1], "name": ["a"]}), ("key",), "", "file t.csv")
    with pytest.raises(InvalidArgumentError, match="stream has no key column 'key'"):
        joined(pa.record_batch({"k": [1]}), reference(), (("key",), ("key",)), "inner")


def test_pipeline_arguments_are_checked():
    stream = Pipeline().read_from(GeneratorSource(total=10))
    with pytest.raises(InvalidArgumentError, match="'inner' or 'left'"):
        stream.join_table(reference(), on="key", how="outer")
    with pytest.raises(InvalidArgumentError, match="names a column twice"):
        stream.join_table(reference(), on=("key", "key"))
    with pytest.raises(InvalidArgumentError, match="takes a ReferenceTable"):
        stream.join_table(42, on="key")
    with pytest.raises(InvalidArgumentError, match="reload_every must be a positive"):
        ReferenceTable.from_loader(reference, reload_every=0)


def test_json_lines_file_and_shorthands(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"key": 2, "name": "two"}\n{"key": 4, "name": "four"}\n')
    stream = Pipeline().read_from(GeneratorSource(total=10))
    for shorthand in (str(path), reference()):
        dag = stream.join_table(shorthand, on="key").write_to(
            TransactionalFileSink(tmp_path / "out")).plan()
        assert list(dag.table_joins) == ["table-join"]
        assert dag.fingerprint()["table_joins"] == [
            {"name": "table-join", "on": [["key", "key"]], "how": "inner", "prefix": ""}]
    assert ReferenceTable.from_file(path).load().num_rows == 2


def test_from_spark_collects_on_the_driver(spark):
    df = spark.createDataFrame(reference().to_pandas())
    table = ReferenceTable.from_spark(df)
    assert table.load().equals(reference())
    with pytest.raises(InvalidArgumentError, match="Spark DataFrame with toArrow"):
        ReferenceTable.from_spark(reference().to_pandas())


# -- jobs ---------------------------------------------------------------------------------


def join_pipeline(source, table, out, how="inner"):
    return (Pipeline().read_from(source).join_table(table, on="key", how=how)
            .write_to(TransactionalFileSink(out)))


@pytest.mark.parametrize("guarantee,how", [("exactly-once", "inner"), ("at-least-once", "left"),
                                           ("none", "inner")])
def test_job_output_is_the_pandas_merge(tmp_path, guarantee, how):
    source = GeneratorSource(total=60_000, partitions=4, keys=KEYS, batch_size=4_000,
                             rate=200_000)
    table = reference(duplicates=True)
    config = JobConfig(name=f"tj-{guarantee}", processing_guarantee=guarantee,
                       snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=2)
    result = Job(join_pipeline(source, table, tmp_path / "out", how), config).run(isolated=False)
    assert result.events_in == 60_000
    out = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    want = pandas_merge(source.events(0, 60_000).to_pandas(), table, how)
    pd.testing.assert_frame_equal(canonical(out), canonical(want))


def test_join_before_a_partitioned_edge(tmp_path):
    """The join runs fused in the source's vertex; its output is grouped by a table column."""
    source = GeneratorSource(total=40_000, partitions=3, keys=KEYS, batch_size=3_000)
    table = reference()
    pipeline = (Pipeline().read_from(source).join_table(table, on="key")
                .group_by("name").aggregate(n="count")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="tj-keyed", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.05, local_parallelism=2)
    Job(pipeline, config).run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    final = out.groupby("name")["n"].max().sort_index()
    want = pandas_merge(source.events(0, 40_000).to_pandas(), table, "inner")
    assert final.to_dict() == want.groupby("name").size().sort_index().to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_job_survives_kill_9(tmp_path, guarantee):
    source = GeneratorSource(total=300_000, partitions=4, keys=KEYS, rate=100_000,
                             batch_size=5_000)
    path = tmp_path / "table.parquet"
    pq.write_table(reference(duplicates=True), path)
    table = ReferenceTable.from_file(path, reload_every=0.5)
    config = JobConfig(name=f"tj-kills-{guarantee}", processing_guarantee=guarantee,
                       snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.2,
                       local_parallelism=2, max_restarts=20, restart_backoff=0.05)
    job = Job(join_pipeline(source, table, tmp_path / "out", "left"), config)
    run_with_kills(job, 3, seed=11)
    out = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    want = pandas_merge(source.events(0, 300_000).to_pandas(), reference(duplicates=True),
                        "left")
    if guarantee == "exactly-once":
        pd.testing.assert_frame_equal(canonical(out), canonical(want))
    else:
        ids = pa.array(want["id"].unique())
        report = verify.check_events(ids, ids, pa.array(out["id"].unique()))
        assert report.lost_count == 0, str(report)
        got = set(map(tuple, canonical(out)[["id", "name"]].fillna("").to_numpy().tolist()))
        assert got == set(map(tuple, canonical(want)[["id", "name"]].fillna("")
                              .to_numpy().tolist()))


# -- versions -----------------------------------------------------------------------------

STOP = {"at": None}


def stop_at(batch):
    """Fails the job at the first event with id >= STOP["at"] (None: never)."""
    limit = STOP["at"]
    if limit is not None and pc.max(batch.column("id")).as_py() >= limit:
        raise RuntimeError("stopped by the test")
    return batch


def run_twice(tmp_path, reload_every):
    """Runs a job on a table file v1 until it fails part way (after some snapshots),
    rewrites the file as v2, and runs it again from the last snapshot to the end."""
    total = 60_000
    source = GeneratorSource(total=total, partitions=3, keys=KEYS, batch_size=1_000,
                             rate=40_000)
    path = tmp_path / "table.parquet"
    pq.write_table(reference("v1"), path)
    table = ReferenceTable.from_file(path, reload_every=reload_every)
    pipeline = (Pipeline().read_from(source).map_batches(stop_at)
                .join_table(table, on="key").write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="versions", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.05, local_parallelism=2)
    STOP["at"] = total // 2
    try:
        with pytest.raises(Exception, match="stopped by the test"):
            Job(pipeline, config).run(isolated=False)
    finally:
        STOP["at"] = None
    store = SnapshotStore(config.snapshot_store, config.id)
    restored = store.latest_complete().snapshot_id
    pq.write_table(reference("v2"), path)
    Job(pipeline, config).run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    recorded = entries_json(store.restore(TABLES_VERTEX, []).broadcast_entries)
    return source, out, restored, recorded, store


def digest_of(table: pa.Table) -> str:
    return TableVersion.of(table).digest


def test_a_restart_replays_with_the_recorded_version(tmp_path):
    source, out, restored, recorded, store = run_twice(tmp_path, reload_every=None)
    assert restored is not None
    # The file says v2 now, but every processor restored v1 and kept it to the end.
    want = pandas_merge(source.events(0, 60_000).to_pandas(), reference("v1"), "inner")
    pd.testing.assert_frame_equal(canonical(out), canonical(want))
    assert {e["version"] for e in recorded.values()} == {digest_of(reference("v1"))}
    assert sorted(recorded) == ["source/0/table-join", "source/1/table-join"]


def test_a_reload_switches_versions_at_a_barrier_and_is_recorded(tmp_path):
    source, out, restored, recorded, store = run_twice(tmp_path, reload_every=0.01)
    events = source.events(0, 60_000).to_pandas()
    v1 = pandas_merge(events, reference("v1"), "inner")
    v2 = pandas_merge(events, reference("v2"), "inner")
    got = canonical(out)
    # Exactly once, and each row is the row of one version or the other.
    assert got["id"].tolist() == canonical(v1)["id"].tolist()
    version = got["name"].str[:2]
    assert set(version) == {"v1", "v2"}
    both = pd.concat([canonical(v1), canonical(v2)])
    assert len(got.merge(both, how="inner")) == len(got)
    # Per source partition a version change is one switch, from v1 to v2 (at a barrier).
    for _, rows in got.assign(v=version).groupby(got["id"] % 3):
        switch = rows["v"].to_numpy() == "v2"
        assert np.all(np.diff(switch.astype(int)) >= 0)
    # The last snapshot records v2, and the store keeps only versions a snapshot uses.
    assert {e["version"] for e in recorded.values()} == {digest_of(reference("v2"))}
    tables = store._path("tables")
    assert os.listdir(tables) == [f"{digest_of(reference('v2'))}.arrow"]


def test_a_table_with_no_rows_or_only_null_keys_matches_nothing():
    events = pa.record_batch({"k": [1, 2], "v": ["a", "b"]})
    on = (("k",), ("id",))
    for table in (pa.table({"id": pa.array([], pa.int64()), "w": pa.array([], pa.int64())}),
                  pa.table({"id": pa.array([None, None], pa.int64()), "w": [1, 2]})):
        assert joined(events, table, on, "inner").num_rows == 0
        assert joined(events, table, on, "left").to_pylist() == [
            {"k": 1, "v": "a", "w": None}, {"k": 2, "v": "b", "w": None}]


def test_a_table_that_returns_to_an_earlier_content_is_stored_again(tmp_path):
    """Content A, then B (A's file removed by the commit), then A again: A must be written
    again before the snapshot that records it can commit."""
    from sparkjet.operators.table_join import TableVersion, TableVersions

    store = SnapshotStore(tmp_path, job_id=6, retained=1)  # A's file goes at once
    store.register_execution(1)
    versions = TableVersions(store)
    a, b = TableVersion.of(reference("v1")), TableVersion.of(reference("v2"))
    for sid, version in enumerate((a, b, a)):
        versions.store_version(version)
        w = store.writer(sid, 1)
        w.use_table_version(version.digest)
        w.write_broadcast_entries(TABLES_VERTEX, [b"source/0/t"],
                                  [json.dumps({"v": version.digest}).encode()])
        store.commit(sid, 1, [w.finish()])
    assert store.latest_complete().snapshot_id == 2
    assert os.listdir(store._path("tables")) == [f"{a.digest}.arrow"]
    store.close()


# -- the store ------------------------------------------------------------------------------


def test_store_keeps_table_versions_while_a_snapshot_uses_them(tmp_path):
    store = SnapshotStore(tmp_path, job_id=5)
    store.register_execution(1)
    v1, v2 = (ipc_bytes(reference(v)) for v in ("v1", "v2"))
    d1, d2 = content_digest(v1), content_digest(v2)
    store.write_table_version(v1, d1)
    store.write_table_version(v1, d1)               # stored once, a repeat is a no-op
    w = store.writer(0, 1)
    w.use_table_version(d1)
    w.write_broadcast_entries(TABLES_VERTEX, [b"source/0/t"], [json.dumps({"v": d1}).encode()])
    store.commit(0, 1, [w.finish()])
    assert pa.ipc.open_stream(store.read_table_version(d1)).read_all().equals(reference("v1"))
    store.export(0, "keep")
    store.write_table_version(v2, d2)
    w = store.writer(1, 1)
    w.use_table_version(d2)
    w.write_broadcast_entries(TABLES_VERTEX, [b"source/0/t"], [json.dumps({"v": d2}).encode()])
    store.commit(1, 1, [w.finish()])
    assert sorted(os.listdir(store._path("tables"))) == sorted([f"{d1}.arrow", f"{d2}.arrow"])
    store.delete_export("keep")
    w = store.writer(2, 1)
    w.use_table_version(d2)
    w.write_broadcast_entries(TABLES_VERTEX, [b"source/0/t"], [json.dumps({"v": d2}).encode()])
    store.commit(2, 1, [w.finish()])
    assert os.listdir(store._path("tables")) == [f"{d2}.arrow"]
    # A snapshot that names a version the store lacks is refused, never committed.
    w = store.writer(3, 1)
    w.use_table_version(d1)
    w.write_broadcast_entries(TABLES_VERTEX, [b"source/0/t"], [json.dumps({"v": d1}).encode()])
    with pytest.raises(SnapshotIncompleteError, match=f"table version {d1}, which is missing"):
        store.commit(3, 1, [w.finish()])
    assert store.latest_complete().snapshot_id == 2
    with pytest.raises(InvalidArgumentError, match="the bytes have another digest"):
        store.write_table_version(v1, d2)
    store.close()


def test_a_table_loaded_from_a_database(tmp_path):
    """The reference table is a query of a real database (SQLite, a file the loader opens
    on whichever processor loads it); the job's output is pandas' merge with the rows the
    database held."""
    import sqlite3

    db = str(tmp_path / "ref.db")
    want_table = reference()
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE ref (key INTEGER PRIMARY KEY, name TEXT, weight REAL)")
        con.executemany("INSERT INTO ref VALUES (?, ?, ?)",
                        zip(*(want_table.column(c).to_pylist() for c in want_table.column_names)))

    def query():
        with sqlite3.connect(db) as con:
            rows = con.execute("SELECT key, name, weight FROM ref ORDER BY key").fetchall()
        return pa.table({"key": pa.array([r[0] for r in rows], pa.int64()),
                         "name": [r[1] for r in rows], "weight": [r[2] for r in rows]})

    source = GeneratorSource(total=20_000, partitions=2, keys=KEYS, batch_size=4_000)
    config = JobConfig(name="tj-db", processing_guarantee="exactly-once",
                       snapshot_store=str(tmp_path / "snaps"), local_parallelism=2)
    Job(join_pipeline(source, ReferenceTable.from_loader(query), tmp_path / "out", "left"),
        config).run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    want = pandas_merge(source.events(0, 20_000).to_pandas(), want_table, "left")
    pd.testing.assert_frame_equal(canonical(out), canonical(want))
