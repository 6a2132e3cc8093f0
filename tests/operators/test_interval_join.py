"""The stream-to-stream interval join: the operator fed by hand, then jobs on the generator
checked exactly against pandas (a merge plus a time filter over the whole input).

As in test_windows, the generator's ``id`` is the event time: it increases in each source
partition, so with per-partition watermarks no row is late and the join's output is known
exactly.
"""
import datetime

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers.jobs import run_with_kills

from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.base import ORDINAL
from sparkjet.operators.interval_join import IntervalJoinStage
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.runtime.member import MemberFailedError
from sparkjet.runtime.watermarks import MAX_TIME, MIN_TIME, PartitionFloors
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.windows import tumbling

# -- the operator, fed by hand ------------------------------------------------------------


class _Join:
    def __init__(self, lower, upper, how="inner", on=("k", "k")):
        stage = IntervalJoinStage(keys=(on[0],), right_keys=(on[1],), lower=lower, upper=upper,
                                  how=how, right_suffix="_right", output_time="t")
        self.op = stage.make_operator("t")
        self.on = on
        self.out = []
        self.late = 0

    def _feed(self, side, t, k, **cols):
        b = pa.record_batch({"t": pa.array(t, pa.int64()), self.on[side]: k, **cols,
                             ORDINAL: pa.array([side] * len(t), pa.int8())})
        outs, late = self.op.process(b)
        self.out += outs
        self.late += 0 if late is None else late.num_rows

    def left(self, t, k, **cols):
        self._feed(0, t, k, **cols)

    def right(self, t, k, **cols):
        self._feed(1, t, k, **cols)

    def wm(self, t):
        self.out += self.op.advance(t)

    def rows(self):
        if not self.out:
            return []
        return sorted(pa.Table.from_batches(self.out).to_pylist(),
                      key=lambda r: (r["t"], r.get("t_right") is None, r.get("t_right") or 0))

    def buffered(self):
        return [s.rows for s in self.op._sides]


def test_interval_bounds_are_inclusive_on_both_sides():
    j = _Join(-10, 0)
    j.right([0, 89, 90, 95, 100, 101], ["a"] * 6, v=[0, 89, 90, 95, 100, 101])
    j.left([100], ["a"])
    assert [r["v"] for r in j.rows()] == [90, 95, 100]
    assert j.rows()[0] == {"t": 100, "k": "a", "t_right": 90, "v": 90}


def test_a_pair_is_produced_when_its_second_row_arrives_and_keys_must_be_equal():
    j = _Join(-5, 5)
    j.left([10, 20], ["a", "b"])
    j.right([14, 15, 16, 20], ["a", "a", "a", "a"])     # 16 is out of 10's interval
    assert [(r["t"], r["t_right"]) for r in j.rows()] == [(10, 14), (10, 15)]
    j.left([12], ["a"])                                 # meets the buffered right rows
    assert [(r["t"], r["t_right"]) for r in j.rows()] == [
        (10, 14), (10, 15), (12, 14), (12, 15), (12, 16)]


def test_different_key_names_and_a_composite_key():
    stage = IntervalJoinStage(keys=("a", "b"), right_keys=("x", "b"), lower=0, upper=0,
                              how="inner", right_suffix="_r", output_time="t")
    op = stage.make_operator("t")
    left = pa.record_batch({"t": [1, 1], "a": [1, 1], "b": ["u", "v"],
                            ORDINAL: pa.array([0, 0], pa.int8())})
    right = pa.record_batch({"t": [1], "x": [1], "b": ["v"], "w": [7],
                             ORDINAL: pa.array([1], pa.int8())})
    op.process(left)
    out, _ = op.process(right)
    assert pa.Table.from_batches(out).to_pylist() == [{"t": 1, "a": 1, "b": "v", "t_r": 1, "x": 1, "w": 7}]


def test_left_outer_rows_appear_when_the_watermark_passes_their_interval():
    j = _Join(0, 10, how="left")
    j.left([0, 5], ["a", "b"])
    j.right([8], ["a"])
    assert [(r["k"], r["t_right"]) for r in j.rows()] == [("a", 8)]
    j.wm(15)                                            # 5 + 10 not passed: b may still match
    assert len(j.rows()) == 1
    j.wm(16)
    assert j.rows()[-1] == {"t": 5, "k": "b", "t_right": None}
    j.wm(100)
    assert len(j.rows()) == 2                           # a matched: never emitted unmatched


def test_eviction_bounds_both_buffers():
    j = _Join(-10, 0)                                   # left kept to t, right to s + 10
    j.left([50, 60], ["a", "a"])
    j.right([45, 55, 60], ["a", "a", "a"])
    assert j.buffered() == [2, 3]
    j.wm(56)                                            # left 50 gone; right 45 (55 < 56)
    assert j.buffered() == [1, 2]
    j.wm(MAX_TIME)
    assert j.buffered() == [0, 0]


def test_rows_behind_the_watermark_are_late_and_counted():
    j = _Join(-10, 0)
    j.wm(100)
    j.left([99, 100], ["a", "a"])
    j.right([99, 100], ["a", "a"])
    assert j.late == 2
    assert [(r["t"], r["t_right"]) for r in j.rows()] == [(100, 100)]


def test_output_watermark_is_held_back_by_the_buffered_left_rows():
    j = _Join(-10, 7)
    assert j.op.output_watermark(100) == 100          # nothing buffered: nothing older to come
    j.left([95], ["a"])
    j.wm(100)
    assert j.op.output_watermark(100) == 95           # 95 may still meet a right row up to 102
    j.wm(103)                                          # 95 + 7 < 103: evicted
    assert j.op.output_watermark(103) == 103
    assert j.op.output_watermark(MAX_TIME) == MAX_TIME


def test_a_processor_that_never_sees_a_row_holds_no_watermark_back():
    from datetime import timedelta

    j = _Join(timedelta(seconds=-10), timedelta(seconds=1))   # no unit until a row comes
    j.wm(5_000)
    assert j.op.output_watermark(5_000) == 5_000


def test_a_deduplicated_stream_keeps_its_event_time_into_a_join(tmp_path):
    from sparkjet.windows import tumbling

    s = GeneratorSource(total=1_000, partitions=2, keys=10)
    stream = Pipeline().read_from(s).with_timestamps("id")
    left = stream.filter(pc.field("value") < 400).deduplicate("id", within=100)
    right = stream.filter(pc.field("value") >= 300)
    p = (left.join_interval(right, on="key", between=(LOWER, UPPER))
         .group_by("key").window(tumbling(100)).count().write_to(TransactionalFileSink(tmp_path / "o")))
    assert p.plan().vertices["window"].time_column == "id"


def test_snapshot_and_restore_continue_as_without_a_failure():
    def run(restore_at):
        j = _Join(-5, 5, how="left")
        steps = [lambda: j.left([0, 1, 2], ["a", "b", "c"], v=[1.0, 2.0, 3.0]),
                 lambda: j.right([3, 4], ["a", "z"], w=["x", "y"]),
                 lambda: j.wm(3),
                 lambda: j.left([6], ["z"], v=[4.0]),
                 lambda: j.right([6], ["b"], w=["q"]),
                 lambda: j.wm(MAX_TIME)]
        for i, step in enumerate(steps):
            if i == restore_at:
                table, wm, out = j.op.snapshot(), j.op.watermark, j.out
                j = _Join(-5, 5, how="left")
                j.op.restore(table, wm)
                j.out = out
            step()
        return j.rows()

    want = run(None)
    assert [(r["k"], r["t_right"]) for r in want] == [("a", 3), ("b", 6), ("c", None), ("z", 4)]
    for at in range(6):
        assert run(at) == want, at


def test_the_snapshot_splits_by_the_key_and_keeps_the_matched_flag():
    j = _Join(-5, 5, how="left", on=("k", "rk"))
    j.left([0, 1], ["a", "b"])
    j.right([2], ["a"])
    t = j.op.snapshot()
    assert j.op.state_key == "k"
    assert t.column("k").to_pylist() == ["a", "b", "a"]
    assert t.column("__side").to_pylist() == [0, 0, 1]
    assert t.column("__matched").to_pylist() == [True, False, False]
    assert t.column("__r__rk").to_pylist() == [None, None, "a"]


def test_restore_drops_rows_below_their_partitions_old_watermark():
    """After a rescale, a row below the watermark its partition's old owner had reached
    was too late then (its partners may be gone), and is so again."""
    from sparkjet.partitioning import partition_ids

    j = _Join(-5, 5)
    keys = ["a", "b"]
    pids = partition_ids(pa.array(keys), 271).to_pylist()
    floors = np.full(271, MIN_TIME, np.int64)
    floors[pids[0]] = 50
    j.op.restore(None, 0, PartitionFloors(floors, 271, "k"))
    j.left([10, 10], keys)
    assert j.late == 1 and j.buffered() == [1, 0]


# -- the API ------------------------------------------------------------------------------


def _timed(source=None, col="id"):
    return Pipeline().read_from(source or GeneratorSource(total=10)).with_timestamps(col)


def test_argument_errors_are_clear():
    a, b = _timed(), _timed(GeneratorSource(total=10, seed=1))
    with pytest.raises(InvalidArgumentError, match="lower 5 is above upper 1"):
        a.join_interval(b, on="key", between=(5, 1))
    with pytest.raises(InvalidArgumentError, match="how=.*'inner', 'left'.*'outer'"):
        a.join_interval(b, on="key", between=(0, 1), how="outer")
    with pytest.raises(InvalidArgumentError, match="two ints or two timedeltas"):
        a.join_interval(b, on="key", between=(0, datetime.timedelta(seconds=1)))
    with pytest.raises(InvalidArgumentError, match="on=.*column name"):
        a.join_interval(b, on=3, between=(0, 1))
    with pytest.raises(InvalidArgumentError, match="with itself.*filter"):
        a.join_interval(a, on="key", between=(0, 1))
    with pytest.raises(InvalidArgumentError, match="columns 'id' and 'value'"):
        a.join_interval(_timed(col="value"), on="key", between=(0, 1))
    untimed = Pipeline().read_from(GeneratorSource(total=10, seed=2))
    p = a.join_interval(untimed, on="key", between=(0, 1)).write_to(TransactionalFileSink("x"))
    with pytest.raises(InvalidArgumentError, match="needs event time.*with_timestamps"):
        p.plan()


def test_a_missing_key_column_fails_the_job_clearly(tmp_path):
    a, b = _timed(GeneratorSource(total=100)), _timed(GeneratorSource(total=100, seed=1))
    b = b.map_batches(lambda x: x.rename_columns(["id", "k2", "value", "ts"]))
    p = a.join_interval(b, on="key", between=(0, 1)).write_to(TransactionalFileSink(tmp_path / "o"))
    config = JobConfig(name="nokey", snapshot_store=str(tmp_path / "snaps"), max_restarts=0)
    with pytest.raises(MemberFailedError, match="no key column 'key'; columns are id, k2"):
        Job(p, config).run(isolated=False)


# -- jobs against pandas ------------------------------------------------------------------

LOWER, UPPER = -40, 25


def merged(left: pd.DataFrame, right: pd.DataFrame, how: str, lower=LOWER, upper=UPPER):
    """The join by its definition: a merge on the key, then the time filter (a left outer
    row is a left row that no right row met). A merge on the key alone pairs every row with
    every other of its key first (~28 M rows for the kill tests' 200,000 events, over a
    minute here): :func:`reference` computes the same rows by bisection, and
    test_the_reference_is_the_merge checks that on the jobs' own inputs."""
    m = left.merge(right, on="key", suffixes=("", "_right"))
    m = m[(m["id_right"] >= m["id"] + lower) & (m["id_right"] <= m["id"] + upper)]
    if how == "left":
        unmatched = left[~left["id"].isin(m["id"])]
        m = pd.concat([m, unmatched])
    return _sorted(m)


def reference(left: pd.DataFrame, right: pd.DataFrame, how: str, lower=LOWER, upper=UPPER):
    """The join over the whole input (what :func:`merged` gives): the right rows sorted by
    (key, id) as one number, each left row's interval found in them by bisection."""
    span = 1 << 40  # > every id + the interval's width: a key's range never meets the next
    r_at = right["key"].to_numpy(np.int64) * span + right["id"].to_numpy(np.int64)
    order = np.argsort(r_at, kind="stable")
    l_at = left["key"].to_numpy(np.int64) * span + left["id"].to_numpy(np.int64)
    lo = np.searchsorted(r_at[order], l_at + lower, "left")
    hi = np.searchsorted(r_at[order], l_at + upper, "right")
    n = hi - lo
    # The indices lo[i] .. hi[i] - 1 of every left row, one after the other.
    at = order[np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)]
    m = left.iloc[np.repeat(np.arange(len(left)), n)].reset_index(drop=True)
    m["id_right"] = right["id"].to_numpy()[at]
    m["value_right"] = right["value"].to_numpy()[at]
    if how == "left":
        m = pd.concat([m, left[n == 0]])
    return _sorted(m)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    cols = ["id", "key", "value", "id_right", "value_right"]
    return df[cols].sort_values(["id", "id_right"]).reset_index(drop=True)


def committed(out) -> pd.DataFrame:
    return _sorted(TransactionalFileSink.read(out).to_pandas())


def assert_same(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert len(got) == len(want), f"{len(got)} rows, expected {len(want)}"
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def two_sources(how, out, **kw):
    joined, want = two_sources_joined(how, **kw)
    return joined.write_to(TransactionalFileSink(out)), want


def two_sources_joined(how, total=(12_000, 8_000), rate=None, keys=300, want=True):
    """The join of two generated streams, and (``want``) the reference's output: a pandas
    merge on the key, ``total[0] * total[1] / keys`` rows before the interval filter."""
    a = GeneratorSource(total=total[0], partitions=3, keys=keys, batch_size=500, rate=rate)
    b = GeneratorSource(total=total[1], partitions=2, keys=keys, batch_size=400, rate=rate, seed=9)
    left = Pipeline().read_from(a).with_timestamps("id")
    right = Pipeline().read_from(b).with_timestamps("id")
    joined = left.join_interval(right, on="key", between=(LOWER, UPPER), how=how)
    if not want:
        return joined, None
    return joined, reference(a.events(0, total[0]).to_pandas(), b.events(0, total[1]).to_pandas(),
                             how)


def one_source_two_filters(how, out, total=20_000, rate=None):
    """NEXMark q8's shape: both sides from one source, through two filters."""
    s = GeneratorSource(total=total, partitions=4, keys=200, batch_size=500, rate=rate)
    stream = Pipeline().read_from(s).with_timestamps("id")
    left = stream.filter(pc.field("value") < 400)
    right = stream.filter(pc.field("value") >= 300)
    p = (left.join_interval(right, on="key", between=(LOWER, UPPER), how=how)
         .write_to(TransactionalFileSink(out)))
    e = s.events(0, total).to_pandas()
    want = reference(e[e["value"] < 400], e[e["value"] >= 300], how)
    return p, want


def _config(name, tmp_path, guarantee, snapshot_interval=0.05, **kw):
    return JobConfig(name=name, processing_guarantee=guarantee, local_parallelism=2,
                     snapshot_store=None if guarantee == "none" else str(tmp_path / "snaps"),
                     snapshot_interval=snapshot_interval, **kw)


@pytest.mark.parametrize("how", ["inner", "left"])
def test_the_reference_is_the_merge(how):
    """The bisection reference gives the merge's rows on the jobs' inputs: both shapes, and
    the kill tests' source on a slice the merge computes in a second."""
    a = GeneratorSource(total=12_000, partitions=3, keys=300).events(0, 12_000).to_pandas()
    b = GeneratorSource(total=8_000, partitions=2, keys=300, seed=9).events(0, 8_000).to_pandas()
    e = GeneratorSource(total=20_000, partitions=4, keys=200).events(0, 20_000).to_pandas()
    for left, right in ((a, b), (e[e["value"] < 400], e[e["value"] >= 300])):
        want = merged(left, right, how)
        assert len(want) > 1_000
        pd.testing.assert_frame_equal(reference(left, right, how), want, check_dtype=False)


@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once", "none"])
@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("shape", [two_sources, one_source_two_filters])
def test_join_job_equals_pandas(tmp_path, shape, how, guarantee):
    p, want = shape(how, tmp_path / "out")
    assert len(want) > 1_000
    result = Job(p, _config(f"ij-{how}-{guarantee}", tmp_path, guarantee)).run(isolated=False)
    assert result.late_events == 0
    assert_same(committed(tmp_path / "out"), want)


def test_a_window_after_the_join_sees_every_row(tmp_path):
    """The output watermark trails by the upper bound, so a window counting the pairs
    by the left time loses none of them as late."""
    joined, want = two_sources_joined("left")
    counts = (joined.group_by("key").window(tumbling(1_000)).count()
              .write_to(TransactionalFileSink(tmp_path / "w")))
    result = Job(counts, _config("ij-window", tmp_path, "exactly-once")).run(isolated=False)
    assert result.late_events == 0
    want = want.assign(window_start=want["id"] // 1_000 * 1_000).groupby(
        ["key", "window_start"]).size()
    got = TransactionalFileSink.read(tmp_path / "w").to_pandas()
    assert got.set_index(["key", "window_start"])["count"].sort_index().to_dict() == want.to_dict()


def test_join_state_stays_bounded_while_the_stream_runs(tmp_path):
    """Rows leave the buffers as the watermark passes their interval, not at the end:
    every snapshot taken mid-run holds no row the watermark has made useless, the rows it
    holds move on with the stream, and they are a fraction of the stream."""
    import json

    from sparkjet.snapshot.store import SnapshotStore

    total = (150_000, 100_000)
    # no reference: its merge on 50 keys would be 300M rows (about 24 GB)
    p, _ = two_sources("left", tmp_path / "out", total=total, rate=60_000, keys=50, want=False)
    config = _config("ij-bounded", tmp_path, "exactly-once", snapshot_interval=0.2)
    held = []

    def on_progress(event):
        if event["event"] == "snapshot" and not event.get("terminal"):
            with SnapshotStore(config.snapshot_store, config.id) as store:
                state = store.restore("interval_join", None, snapshot_id=event["snapshot"])
            if state.table is None:
                return
            marks = [json.loads(v)["time"] for v in state.broadcast_entries[1].to_pylist()]
            t = state.table.to_pandas()
            left, right = t[t["__side"] == 0], t[t["__side"] == 1]
            held.append((min(marks), len(t), left["__l__id"].min(), right["__r__id"].min()))

    Job(p, config).run(isolated=False, on_progress=on_progress)
    assert len(held) >= 3
    for mark, _, oldest_left, oldest_right in held:
        assert not oldest_left < mark - UPPER, (mark, oldest_left)     # NaN: none held
        assert not oldest_right < mark + LOWER, (mark, oldest_right)
    assert held[-1][2] > held[0][2] or held[-1][3] > held[0][3]
    assert max(n for _, n, _, _ in held) < sum(total) / 2, held


def test_join_state_rescales_after_a_kill(tmp_path):
    """A member killed mid-run (no restart), then the job run again at another parallelism:
    both sides' buffered rows, their matched flags and the watermarks restore by partition."""
    import os
    import signal
    import threading
    import time

    from sparkjet.snapshot.store import SnapshotStore

    def run(parallelism):
        p, want = one_source_two_filters("left", tmp_path / "out", total=150_000, rate=60_000)
        config = JobConfig(name="ij-rescale", snapshot_store=str(tmp_path / "snaps"),
                           snapshot_interval=0.1, local_parallelism=parallelism, max_restarts=0)
        return Job(p, config), want

    job, want = run(2)
    stop = threading.Event()

    def kill_after_snapshots():
        store = SnapshotStore(str(tmp_path / "snaps"), job.config.id)
        while not stop.is_set():
            latest = store.latest_complete()
            if latest is not None and latest.snapshot_id >= 3 and job.member_pid:
                os.kill(job.member_pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_snapshots, daemon=True)
    killer.start()
    with pytest.raises(JobFailedError, match="SIGKILL"):
        job.run()
    stop.set()
    killer.join()
    job, _ = run(3)
    assert job.run().executions[0]["restored_from"] is not None
    assert_same(committed(tmp_path / "out"), want)


@pytest.mark.slow
# Each join kind under one guarantee (the guarantee is the runtime's, the same for every
# operator; the fault campaigns run the join under both): the four pairs were among the
# slowest tests of CI.
@pytest.mark.parametrize(("how", "guarantee"), [("left", "exactly-once"),
                                                ("inner", "at-least-once")])
def test_join_job_survives_kill_9(tmp_path, guarantee, how):
    p, want = one_source_two_filters(how, tmp_path / "out", total=200_000, rate=80_000)
    config = _config(f"ij-kills-{how}-{guarantee}", tmp_path, guarantee, snapshot_interval=0.2,
                     max_restarts=20, restart_backoff=0.05)
    run_with_kills(Job(p, config), 3, seed=13)
    got = committed(tmp_path / "out")
    if guarantee == "exactly-once":
        assert_same(got, want)
    else:
        # at-least-once: every pair is there, and nothing pandas lacks
        assert_same(got.drop_duplicates().reset_index(drop=True), want)
