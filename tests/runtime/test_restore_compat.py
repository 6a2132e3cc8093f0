"""Starting from a named snapshot after the pipeline changed (JobConfig.initial_snapshot,
state_mapping): what restores, what is refused and how the refusal reads; job names in the
store's and the sinks' messages."""
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark import cloudpickle

from sparkjet.errors import IncompatibleSnapshotError, InvalidArgumentError, SnapshotNotFoundError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource
from sparkjet.windows import tumbling

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOTAL = 200_000
N = pa.schema([("n", pa.int64())])


def source(rate=100_000):
    """The events; the same whatever the rate (timestamps aside, which no test here uses)."""
    return GeneratorSource(total=TOTAL, partitions=2, keys=50, batch_size=2_000, rate=rate)


def count(b):
    """The running count per key (state ``n``), emitted per call."""
    n = np.diff(b.offsets) + b.state["n"].fill_null(0).to_numpy()
    return pa.table({"key": b.keys["key"], "n": n}), pa.table({"n": n})


def count_marking_old(b):
    """``count`` with a new state column ``since``: null only in state restored from a
    snapshot taken before the column existed (``restored_null`` says where it was)."""
    n = np.diff(b.offsets) + b.state["n"].fill_null(0).to_numpy()
    restored_null = b.has_state & b.state["since"].is_null().to_numpy(zero_copy_only=False)
    since = b.state["since"].fill_null(1)
    return (pa.table({"key": b.keys["key"], "n": n, "restored_null": restored_null}),
            pa.table({"n": n, "since": since}))


def count_as_float(b):
    n = np.diff(b.offsets) + b.state["n"].fill_null(0).to_numpy()
    return pa.table({"key": b.keys["key"], "n": n}), pa.table({"n": n.astype(float)})


def running_top(b):
    """The greatest ``n`` seen per key (state ``top``)."""
    top = np.maximum(np.maximum.reduceat(b.rows["n"].to_numpy(), b.offsets[:-1]),
                     b.state["top"].fill_null(0).to_numpy())
    return pa.table({"key": b.keys["key"], "top": top}), pa.table({"top": top})


def first_seen(b):
    """Passes rows through, remembering per key the first id seen (state ``first``)."""
    first = b.state["first"].fill_null(b.rows["id"].take(b.offsets[:-1]))
    return b.rows.select(["id", "key", "value"]), pa.table({"first": first})


def counting(src):
    return src.group_by("key").map_state(count, state=N)


def _config(tmp_path, name, **kw):
    return JobConfig(name=name, snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.1,
                     local_parallelism=2, **kw)


def _stop_at_v1(tmp_path, name="old"):
    """Runs the counting pipeline as job ``name`` and stops it half-way with export v1 (at a
    quarter of the rate: on a loaded machine two snapshots took longer than the whole
    input at full rate, and the job had ended before the stop)."""
    job = Job(counting(Pipeline().read_from(source(rate=25_000))).write_to(
        TransactionalFileSink(tmp_path / name)), _config(tmp_path, name))
    handle = job.submit(isolated=False)
    _wait_for_snapshots(handle, 2)
    result = handle.stop(snapshot="v1", timeout=60)
    assert result.stopped and 0 < result.events_in < TOTAL
    return result


def _reference_counts() -> pd.Series:
    """pandas: the count of events per key over the whole source."""
    reader = source().open([0, 1], None)
    keys = []
    while not reader.at_end():
        batch = reader.read(1 << 20)
        if batch is not None:
            keys.append(batch.column("key").to_numpy())
    return pd.Series(np.concatenate(keys)).value_counts().sort_index()


def _final(path, column) -> pd.Series:
    out = TransactionalFileSink.read(path).to_pandas()
    return out.groupby("key")[column].max().sort_index()


def test_an_added_stage_restores_and_matches_pandas(tmp_path):
    _stop_at_v1(tmp_path)
    changed = (counting(Pipeline().read_from(source())).group_by("key")
               .map_state(running_top, state=pa.schema([("top", pa.int64())]))
               .write_to(TransactionalFileSink(tmp_path / "new")))
    result = Job(changed, _config(tmp_path, "new", initial_snapshot="old/v1")).run(isolated=False)
    assert result.executions[0]["initial_snapshot"].startswith("export 'v1' of job 'old'")
    # the counts go on from the old job's state, and the source from its offsets: each
    # key's final count is its count over the whole source, neither short nor doubled
    want = _reference_counts()
    got = _final(tmp_path / "new", "top")
    assert got.index.tolist() == want.index.tolist()
    assert np.array_equal(got.to_numpy(), want.to_numpy())


@pytest.mark.parametrize("whose", ["another job's", "its own"])
def test_an_added_nullable_state_column_restores_as_nulls(tmp_path, whose):
    stopped = _stop_at_v1(tmp_path)
    state = pa.schema([("n", pa.int64()), ("since", pa.int64())])
    changed = (Pipeline().read_from(source()).group_by("key")
               .map_state(count_marking_old, state=state)
               .write_to(TransactionalFileSink(tmp_path / "new")))
    # resuming its own snapshot, the job writes to a new directory: its old sink's
    # transactions (all committed at the stop) are dropped explicitly
    config = (_config(tmp_path, "new", initial_snapshot="old/v1") if whose == "another job's"
              else _config(tmp_path, "old", state_mapping={"sink": None}))
    Job(changed, config).run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "new").to_pandas()
    assert np.array_equal(_final(tmp_path / "new", "n").to_numpy(), _reference_counts().to_numpy())
    # every key the old job counted had its state restored, with a null in the new column
    # (once: the first call writes it)
    marked = out[out["restored_null"]]
    assert 0 < len(marked) and marked["key"].is_unique
    old_out = TransactionalFileSink.read(tmp_path / "old").to_pandas()
    assert sorted(marked["key"]) == sorted(old_out["key"].unique())
    assert stopped.events_in < TOTAL


def test_a_changed_state_type_is_refused_naming_vertex_and_column(tmp_path):
    _stop_at_v1(tmp_path)
    changed = (Pipeline().read_from(source()).group_by("key")
               .map_state(count_as_float, state=pa.schema([("n", pa.float64())]))
               .write_to(TransactionalFileSink(tmp_path / "new")))
    job = Job(changed, _config(tmp_path, "new", initial_snapshot="old/v1"))
    with pytest.raises(IncompatibleSnapshotError) as e:
        job.run(isolated=False)
    assert e.value.differences == [
        "vertex 'state': state column 'n' changed type int64 -> double"]
    assert "export 'v1' of job 'old'" in str(e.value)
    assert job.metrics is None and not (tmp_path / "new").exists()   # refused before running


def test_a_removed_vertex_is_refused_then_dropped_explicitly(tmp_path):
    stopped = _stop_at_v1(tmp_path)

    def ids_only():
        return (Pipeline().read_from(source()).map_batches(lambda b: b.select(["id", "key"]))
                .write_to(TransactionalFileSink(tmp_path / "new")))

    with pytest.raises(IncompatibleSnapshotError, match=r"vertex 'state' \(state\) this "
                       r"pipeline lacks.*state_mapping=\{'state': None\}"):
        Job(ids_only(), _config(tmp_path, "new", initial_snapshot="old/v1")).run(isolated=False)
    result = Job(ids_only(), _config(tmp_path, "new", initial_snapshot="old/v1",
                                     state_mapping={"state": None})).run(isolated=False)
    ids = TransactionalFileSink.read(tmp_path / "new").column("id")
    # the source went on from the export's offsets: the rest of the events, each once
    assert result.events_in == len(ids) == TOTAL - stopped.events_in
    assert pc.count_distinct(ids).as_py() == len(ids)


def _wait_for_snapshots(handle, n):
    deadline = time.monotonic() + 60
    while (handle.metrics or {}).get("snapshots", 0) < n:
        assert time.monotonic() < deadline, f"no {n} snapshots in 60 s: {handle.metrics}"
        time.sleep(0.02)


def test_a_renamed_vertex_is_refused_then_mapped(tmp_path):
    _stop_at_v1(tmp_path)

    def two_stages():
        # the new stage comes first, so it takes the name "state"; the counting one is
        # "state.2" now
        first = (Pipeline().read_from(source()).group_by("key")
                 .map_state(first_seen, state=pa.schema([("first", pa.int64())])))
        return counting(first).write_to(TransactionalFileSink(tmp_path / "new"))

    with pytest.raises(IncompatibleSnapshotError) as e:
        Job(two_stages(), _config(tmp_path, "new", initial_snapshot="old/v1")).run(isolated=False)
    assert e.value.differences == ["vertex 'state': state column 'n' (int64) was removed"]
    mapped = Job(two_stages(), _config(tmp_path, "new", initial_snapshot="old/v1",
                                       state_mapping={"state": "state.2"}))
    handle = mapped.submit(isolated=False)
    _wait_for_snapshots(handle, 2)
    assert handle.stop(timeout=60).stopped
    # resumed from its own snapshot, the mapping left in its configuration does nothing
    # (applied again, it would hand "state.2" the first-seen state of "state")
    handle.resume().result(timeout=120)
    assert np.array_equal(_final(tmp_path / "new", "n").to_numpy(), _reference_counts().to_numpy())


def test_a_state_mapping_naming_what_is_not_there_is_refused(tmp_path):
    _stop_at_v1(tmp_path)
    pipeline = (Pipeline().read_from(source()).group_by("key")      # a changed pipeline
                .map_state(count_marking_old, state=pa.schema([("n", pa.int64()),
                                                               ("since", pa.int64())]))
                .write_to(TransactionalFileSink(tmp_path / "new")))
    config = _config(tmp_path, "new", initial_snapshot="old/v1",
                     state_mapping={"stat": None, "state": "state.9"})
    with pytest.raises(IncompatibleSnapshotError) as e:
        Job(pipeline, config).run(isolated=False)
    assert [d.split(",")[0] for d in e.value.differences] == [
        "state_mapping names 'stat'", "state_mapping maps 'state' to 'state.9'"]


def test_every_refused_difference_is_listed_at_once(tmp_path):
    from sparkjet.connectors.discard import DiscardSink
    from sparkjet.runtime.restore import StartPoint, plan_restore

    def pipeline(partitions, aggregations, size, sink):
        src = Pipeline().read_from(GeneratorSource(total=10, partitions=partitions))
        return Pipeline.all(
            src.group_by("key").aggregate(**aggregations).write_to(sink),
            src.with_timestamps("id").group_by("key").window(tumbling(size)).count()
            .write_to(TransactionalFileSink(tmp_path / "w")))

    old = pipeline(2, {"n": "count", "s": ("sum", "value")}, 10, TransactionalFileSink(tmp_path))
    new = pipeline(4, {"n": "count", "m": ("max", "value")}, 20, DiscardSink())
    own = StartPoint(1, "job", 5)
    with pytest.raises(IncompatibleSnapshotError) as e:
        plan_restore(new.plan(), old.plan().fingerprint(), own, None)
    assert [d.split(":")[0].split(" was ")[0] for d in e.value.differences] == [
        "vertex 'source'", "vertex 'aggregate'", "vertex 'aggregate'", "vertex 'window'",
        "sink 'sink'"]
    text = "\n".join(e.value.differences)
    for part in ("partitions=2, is now partitions=4", "aggregation 's' (['sum', 'value']) was "
                 "removed", "aggregation 'm' (['max', 'value']) was added",
                 "'size': '10'", "sink 'sink' was TransactionalFileSink, is now DiscardSink"):
        assert part in text
    # from another job's export, the sinks are not the new job's concern
    initial = StartPoint(1, "job", 5, "v1", initial=True)
    with pytest.raises(IncompatibleSnapshotError) as e:
        plan_restore(new.plan(), old.plan().fingerprint(), initial, None)
    assert len(e.value.differences) == 4
    plan = plan_restore(old.plan(), old.plan().fingerprint(), own, {"aggregate": None})
    assert plan.same and plan.vertices["aggregate"] == "aggregate"   # its own: no mapping


def test_a_missing_initial_snapshot_names_the_job_and_its_exports(tmp_path):
    _stop_at_v1(tmp_path)
    pipeline = counting(Pipeline().read_from(source())).write_to(
        TransactionalFileSink(tmp_path / "new"))
    with pytest.raises(SnapshotNotFoundError, match=r"job 'old' has no exported snapshot "
                       r"'v2' \(its exports: \['v1'\]\)"):
        Job(pipeline, _config(tmp_path, "new", initial_snapshot="old/v2")).run(isolated=False)
    with pytest.raises(SnapshotNotFoundError, match="job 'nobody' has no snapshots"):
        Job(pipeline, _config(tmp_path, "new", initial_snapshot="nobody/v1")).run(isolated=False)
    with pytest.raises(InvalidArgumentError, match="initial_snapshot"):
        _config(tmp_path, "new", initial_snapshot="old/no such export")


def test_store_messages_name_the_job_not_its_id(tmp_path):
    _stop_at_v1(tmp_path)
    derived = JobConfig(name="old", processing_guarantee="none").id
    with SnapshotStore(tmp_path / "snaps", derived) as store:    # the name from JOB.json
        assert store.who == "job 'old'"
        with pytest.raises(SnapshotNotFoundError, match="^job 'old' has no exported snapshot 'v9'$"):
            store.restore("source", [], name="v9")
        with pytest.raises(InvalidArgumentError, match="^export 'v1' of job 'old' already exists$"):
            store.export(None, "v1")
    with SnapshotStore(tmp_path / "snaps", 7, name="explicit") as store:
        assert store.who == "job 'explicit' [0x7]"       # a job_id its name does not derive
    with SnapshotStore(tmp_path / "other", 7) as store:
        assert store.who == "job 7 (0x7)"                # no name known


def test_a_fenced_sink_names_the_job(tmp_path):
    from sparkjet.connectors.base import ProcessorContext
    from sparkjet.errors import FencedError

    sink = TransactionalFileSink(tmp_path / "out")
    zombie = sink.open(ProcessorContext(7, 1, "sink", 0, 1, job_name="nightly"))
    zombie.write(pa.record_batch({"id": pa.array([1, 2], pa.int64())}))
    zombie.prepare(1)
    sink.open(ProcessorContext(7, 2, "sink", 0, 1, job_name="nightly"))
    with pytest.raises(FencedError, match="by execution 1 of job 'nightly' refused"):
        zombie.commit(1)


def test_a_job_on_spark_starts_from_another_jobs_export(spark, tmp_path):
    # each member restores its share of the export (the runner has no snapshot to name)
    stopped = _stop_at_v1(tmp_path)
    changed = (counting(Pipeline().read_from(source())).group_by("key")
               .map_state(running_top, state=pa.schema([("top", pa.int64())]))
               .write_to(TransactionalFileSink(tmp_path / "new")))
    config = _config(tmp_path, "new", initial_snapshot="old/v1", members=2)
    result = Job(changed, config).run(spark)
    assert result.events_in == TOTAL - stopped.events_in
    assert np.array_equal(_final(tmp_path / "new", "top").to_numpy(),
                          _reference_counts().to_numpy())


def test_fencing_and_a_missing_job_name_the_job_too(tmp_path):
    from sparkjet.errors import FencedError

    job = JobConfig(name="nightly", processing_guarantee="none").id
    store = SnapshotStore(tmp_path, job, name="nightly")
    store.register_execution(2)
    for stale in (store.register_execution, store.check_fence):
        with pytest.raises(FencedError, match="^job 'nightly': execution 1 ") as e:
            stale(1)
        assert f"{job:x}" not in str(e.value)
    with pytest.raises(SnapshotNotFoundError, match="^no snapshots of job 'weekly' in "):
        SnapshotStore(tmp_path, JobConfig(name="weekly", processing_guarantee="none").id,
                      name="weekly", create=False)
