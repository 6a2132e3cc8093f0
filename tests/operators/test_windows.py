"""Windows, event time and DAG pipelines, checked against pandas over the whole input.

The generator's ``id`` is the event time here: deterministic and increasing in each source
partition, so with per-partition watermarks no event is late and every window's result is
known exactly. Lateness is tested on the operator directly, where the watermark is given.
"""
import threading
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers.jobs import run_killed_once, run_with_kills

from sparkjet.connectors.base import Sink, SinkWriter, Source, SourceReader
from sparkjet.errors import InvalidArgumentError, SnapshotMismatchError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.watermarks import (
    IDLE,
    MAX_TIME,
    MIN_TIME,
    PartitionFloors,
    SourceWatermarks,
    Watermark,
    WatermarkTracker,
)
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.windows import session, sliding, tumbling, user_aggregation

AGGS = {"n": "count", "total": ("sum", "value"), "low": ("min", "value"),
        "high": ("max", "value"), "avg": ("mean", "value")}


def reference_windows(events: pd.DataFrame, size: int, slide: int, keys=("key",)) -> pd.DataFrame:
    """Every (key, window) of a sliding (tumbling when slide == size) window over ``id``."""
    parts = []
    for i in range(size // slide):
        start = (events["id"] // slide - i) * slide
        parts.append(events.assign(window_start=start))
    e = pd.concat(parts)
    e = e[e["window_start"] + size > e["id"]]
    g = e.groupby([*keys, "window_start"])["value"]
    out = pd.DataFrame({"n": g.count(), "total": g.sum(), "low": g.min(), "high": g.max(),
                        "avg": g.mean()}).reset_index()
    out["window_end"] = out["window_start"] + size
    return out.sort_values([*keys, "window_start"]).reset_index(drop=True)


def reference_sessions(events: pd.DataFrame, gap: int) -> pd.DataFrame:
    e = events.sort_values(["key", "id"])
    new = (e["key"] != e["key"].shift()) | (e["id"] - e["id"].shift() >= gap)
    e = e.assign(session=new.cumsum())
    g = e.groupby(["key", "session"])
    out = pd.DataFrame({"window_start": g["id"].min(), "window_end": g["id"].max() + gap,
                        "n": g["value"].count(), "total": g["value"].sum()}).reset_index()
    return out.drop(columns="session").sort_values(["key", "window_start"]).reset_index(drop=True)


def committed(out, keys=("key",)) -> pd.DataFrame:
    t = TransactionalFileSink.read(out).to_pandas()
    return t.sort_values([*keys, "window_start"]).reset_index(drop=True)


def assert_same(got: pd.DataFrame, want: pd.DataFrame, columns) -> None:
    assert len(got) == len(want), f"{len(got)} rows, expected {len(want)}"
    dup = got.duplicated([c for c in got.columns if c in ("key", "k2", "window_start")]).sum()
    assert dup == 0, f"{dup} duplicated windows"
    for c in columns:
        assert np.array_equal(got[c].to_numpy(), want[c].to_numpy()), c


def windowed(source, window, out, lag=0, **aggs):
    return (Pipeline().read_from(source).with_timestamps("id", max_lag=lag)
            .group_by("key").window(window).aggregate(**(aggs or AGGS))
            .write_to(TransactionalFileSink(out)))


# -- watermarks ---------------------------------------------------------------------------


def test_tracker_is_the_least_of_channels_that_are_not_idle():
    t = WatermarkTracker(3)
    assert t.update(0, Watermark(10)) is None          # channels 1 and 2 hold it at MIN
    assert t.update(1, Watermark(5)) is None
    assert t.update(2, Watermark(7)) == Watermark(5)
    assert t.update(1, IDLE) == Watermark(7)           # an idle channel holds nobody back
    assert t.update(1, Watermark(3)) is None           # back, behind: the watermark stays
    assert t.current == 7
    for c in range(3):
        t.update(c, IDLE)
    assert t.idle


def test_source_watermarks_per_partition_and_idle():
    now = [0.0]
    w = SourceWatermarks([0, 1], max_lag=2, idle_timeout=5.0, clock=lambda: now[0])
    w.observe(0, np.array([10, 12]))
    assert w.due() is None                             # partition 1 has not started
    w.observe(1, np.array([7]))
    assert w.due() == Watermark(5)
    now[0] = 4.0
    w.observe(0, np.array([20]))
    now[0] = 6.0                                       # partition 1 silent for 6 s: idle
    assert w.due() == Watermark(18)
    now[0] = 100.0
    assert w.due() == IDLE
    w.ended = True
    assert w.due() == Watermark(MAX_TIME)


# -- windows on the operator ---------------------------------------------------------------


class _Op:
    """A window operator fed by hand."""

    def __init__(self, window, keys=("k",), lateness=0, early=None, **aggs):
        from sparkjet.operators.windows.operator import WindowOperator, WindowStage

        stage = WindowStage(tuple(keys), window, aggs or {"n": "count", "s": ("sum", "v")},
                            early, lateness, None)
        self.op = WindowOperator(stage, "t")
        self.out = []
        self.late = []

    def feed(self, t, k, v=None):
        b = pa.record_batch({"t": pa.array(t, pa.int64()), "k": k,
                             "v": v if v is not None else [1.0] * len(t)})
        outs, late = self.op.process(b)
        self.out += outs
        if late is not None:
            self.late.append(late)

    def wm(self, t):
        self.out += self.op.advance(t)

    def rows(self):
        if not self.out:
            return []
        return pa.Table.from_batches(self.out).to_pylist()


def test_tumbling_fires_at_the_watermark_and_evicts():
    o = _Op(tumbling(10))
    o.feed([1, 5, 12, 9], ["a", "b", "a", "a"])
    o.wm(9)
    assert o.rows() == []
    o.wm(10)
    assert o.rows() == [{"k": "a", "window_start": 0, "window_end": 10, "n": 2, "s": 2.0},
                        {"k": "b", "window_start": 0, "window_end": 10, "n": 1, "s": 1.0}]
    assert list(o.op.panes) == [1]                      # pane 0 can no longer change
    o.feed([3], ["a"])                                 # too late: counted, not dropped
    assert pa.Table.from_batches(o.late).column("t").to_pylist() == [3]


def test_allowed_lateness_emits_a_correction():
    o = _Op(tumbling(10), lateness=5)
    o.feed([1, 2], ["a", "b"])
    o.wm(12)
    o.feed([3], ["a"])                                  # late but allowed: a correction
    rows = o.rows()
    assert rows[-1] == {"k": "a", "window_start": 0, "window_end": 10, "n": 2, "s": 2.0}
    o.wm(15)                                            # 10 + 5 <= 15: the window is gone
    o.feed([4], ["a"])
    assert len(o.late) == 1 and not o.op.panes


def test_a_sliding_window_past_its_lateness_gets_no_correction():
    """An event late for the first window of its pane but in time for the second counts
    for the second only. The first window has fired and its older pane is gone: a
    "correction" of it would hold this pane's rows alone (a replay under at-least-once
    wrote such partial windows over the full ones into an upsert sink)."""
    o = _Op(sliding(10, 5))
    o.feed([1, 6, 7], ["a", "a", "a"])
    o.wm(10)                                            # [0, 10) fires; pane 0 is gone
    assert o.rows()[-1] == {"k": "a", "window_start": 0, "window_end": 10, "n": 3, "s": 3.0}
    fired = len(o.rows())
    o.feed([8], ["a"])                                  # late for [0, 10), not for [5, 15)
    assert len(o.rows()) == fired and o.late == []
    o.wm(15)
    assert o.rows()[fired:] == [{"k": "a", "window_start": 5, "window_end": 15, "n": 3, "s": 3.0}]


def test_a_sliding_window_within_its_lateness_gets_a_whole_correction():
    o = _Op(sliding(10, 5), lateness=5)
    o.feed([1, 6], ["a", "a"])
    o.wm(10)
    o.feed([8], ["a"])                                  # [0, 10) can still change: both panes live
    assert o.rows()[-1] == {"k": "a", "window_start": 0, "window_end": 10, "n": 3, "s": 3.0}


def test_sliding_windows_combine_panes():
    o = _Op(sliding(10, 5))
    o.feed([1, 6, 7, 11], ["a", "a", "b", "a"], [1.0, 2.0, 3.0, 4.0])
    o.wm(MAX_TIME - 1)
    got = {(r["k"], r["window_start"]): (r["n"], r["s"]) for r in o.rows()}
    assert got == {("a", -5): (1, 1.0), ("a", 0): (2, 3.0), ("b", 0): (1, 3.0),
                   ("a", 5): (2, 6.0), ("b", 5): (1, 3.0), ("a", 10): (1, 4.0)}


def test_sessions_merge_and_fire():
    o = _Op(session(5))
    o.feed([1, 3, 20], ["a", "a", "a"])
    o.feed([6, 2], ["a", "b"])                           # 6 joins [1, 8); b is its own
    o.wm(11)
    got = sorted((r["k"], r["window_start"], r["window_end"], r["n"]) for r in o.rows())
    assert got == [("a", 1, 11, 3), ("b", 2, 7, 1)]
    o.wm(MAX_TIME - 1)
    assert o.rows()[-1]["window_start"] == 20


def test_early_results_are_marked():
    o = _Op(tumbling(10), early=1e-9)
    o.feed([1, 2], ["a", "a"])
    o.out += o.op.tick()
    o.wm(10)
    rows = o.rows()
    assert [r["early"] for r in rows] == [True, False] and rows[-1]["n"] == 2


def test_user_aggregation_and_composite_keys():
    def acc(groups, n, v):
        return pa.table({"sq": np.bincount(groups, weights=v.to_numpy() ** 2, minlength=n)})

    def combine(groups, n, partials):
        return pa.table({"sq": np.bincount(groups, weights=partials["sq"].to_numpy(), minlength=n)})

    squares = user_aggregation("v", acc, combine, lambda t: t["sq"].combine_chunks())
    o = _Op(sliding(4, 2), keys=("k", "j"), sq=squares)
    o.op.process(pa.record_batch({"t": [0, 1, 3], "k": ["a", "a", "a"], "j": [1, 1, 2],
                                  "v": [1.0, 2.0, 3.0]}))
    o.out += o.op.advance(4)
    got = sorted((r["k"], r["j"], r["window_start"], r["sq"]) for r in o.rows())
    assert got == [("a", 1, -2, 5.0), ("a", 1, 0, 5.0), ("a", 2, 0, 9.0)]


def test_window_state_restores_from_its_snapshot():
    o = _Op(sliding(10, 5))
    o.feed([1, 6, 7], ["a", "a", "b"])
    table = o.op.snapshot()
    p = _Op(sliding(10, 5))
    p.op.restore(table, -(2**63))
    p.wm(MAX_TIME - 1)
    o.wm(MAX_TIME - 1)
    assert sorted(map(str, o.rows())) == sorted(map(str, p.rows()))


def test_partition_floors_start_at_the_least_of_my_partitions():
    saved = [{"time": 50, "partitions": [0, 2]}, {"time": 40, "partitions": [1, 3]}]
    assert PartitionFloors.from_saved(saved, [0, 2], 4, "k") == (50, None)
    start, floors = PartitionFloors.from_saved(saved, [0, 1], 4, "k")
    assert start == 40 and floors.floors.tolist() == [50, 40, MIN_TIME, MIN_TIME]
    # a bare time, saved before partitions were: it holds for every partition
    assert PartitionFloors.from_saved([50, 40], [0, 1], 4, "k") == (40, None)
    assert PartitionFloors.from_saved([], [0], 4, "k") == (MIN_TIME, None)


@pytest.mark.parametrize("window", [tumbling(10), session(5)], ids=["tumbling", "session"])
def test_a_replayed_event_does_not_reopen_a_window_its_old_owner_fired(window):
    """At-least-once: a processor restores at the least watermark of its partitions' old
    owners; an event replayed into a window one of them had fired and evicted is too late
    for that partition, not the start of a window holding only the replays."""
    from sparkjet.partitioning import partition_ids

    keys = pa.array([f"key-{i}" for i in range(64)])
    pids = partition_ids(pa.table({"k": keys}), 4, key="k").to_numpy()
    ahead, behind = keys[int(np.flatnonzero(pids == 0)[0])], keys[int(np.flatnonzero(pids == 1)[0])]
    saved = [{"time": 30, "partitions": [0, 2]}, {"time": 8, "partitions": [1, 3]}]
    start, floors = PartitionFloors.from_saved(saved, [0, 1, 2, 3], 4, "k")
    o = _Op(window)
    o.op.restore(None, start, floors)
    o.feed([9, 9, 31], [ahead.as_py(), behind.as_py(), ahead.as_py()])
    assert pa.Table.from_batches(o.late).to_pylist() == [{"t": 9, "k": ahead.as_py(), "v": 1.0}]
    o.wm(MAX_TIME - 1)
    got = sorted((r["k"], r["window_start"], r["n"]) for r in o.rows())
    assert got == sorted([(behind.as_py(), 0 if window.kind == "tumbling" else 9, 1),
                          (ahead.as_py(), 30 if window.kind == "tumbling" else 31, 1)])


def test_bad_window_arguments():
    with pytest.raises(InvalidArgumentError, match="multiple of its slide"):
        sliding(10, 3)
    with pytest.raises(InvalidArgumentError, match="size must be > 0"):
        tumbling(0)
    src = Pipeline().read_from(GeneratorSource(total=10))
    with pytest.raises(InvalidArgumentError, match="needs event time"):
        src.group_by("key").window(tumbling(10)).count().write_to(
            TransactionalFileSink("/tmp/x")).plan()
    sink = TransactionalFileSink("/tmp/x")
    with pytest.raises(InvalidArgumentError, match="ends two branches"):
        Pipeline.all(src.write_to(sink), src.filter(pc.field("key") > 1).write_to(sink)).plan()
    with pytest.raises(InvalidArgumentError, match="taken by the"):
        src.group_by("key").window(tumbling(10)).aggregate(window_end="count")


# -- jobs: windows, unions, branches, chains -----------------------------------------------


@pytest.mark.parametrize("window", [tumbling(5_000), sliding(6_000, 2_000)])
def test_windowed_job_matches_pandas(tmp_path, window):
    source = GeneratorSource(total=60_000, partitions=4, keys=50, batch_size=3_000)
    config = JobConfig(name="windows", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.05, local_parallelism=2)
    result = Job(windowed(source, window, tmp_path / "out"), config).run(isolated=False)
    assert result.events_in == 60_000
    want = reference_windows(source.events(0, 60_000).to_pandas(), window.size, window.slide)
    assert_same(committed(tmp_path / "out"), want, ["key", "window_start", "window_end", "n",
                                                    "total", "low", "high", "avg"])


def test_session_job_matches_pandas(tmp_path):
    source = GeneratorSource(total=20_000, partitions=2, keys=400, batch_size=2_000)
    config = JobConfig(name="sessions", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.05, local_parallelism=2)
    Job(windowed(source, session(60), tmp_path / "out", n="count", total=("sum", "value")),
        config).run(isolated=False)
    want = reference_sessions(source.events(0, 20_000).to_pandas(), 60)
    assert_same(committed(tmp_path / "out"), want, ["key", "window_start", "window_end", "n", "total"])


def test_union_branches_and_a_chain_of_keyed_stages(tmp_path):
    a = GeneratorSource(total=20_000, partitions=2, keys=30, seed=1, batch_size=2_000)
    b = GeneratorSource(total=10_000, partitions=3, keys=30, seed=2, batch_size=2_000)
    both = (Pipeline().read_from(a).with_timestamps("id")
            .union(Pipeline().read_from(b).with_timestamps("id")))
    per_window = both.group_by("key").window(tumbling(1_000)).aggregate(n="count", total=("sum", "value"))
    # a second keyed stage, re-keyed: the largest per-key count of each window (rolling)
    top = (per_window.map_batches(lambda b: b.rename_columns(
               ["ws" if c == "window_start" else c for c in b.schema.names]))
           .group_by("ws").aggregate(best=("max", "n"))
           .write_to(TransactionalFileSink(tmp_path / "top")))
    counts = per_window.write_to(TransactionalFileSink(tmp_path / "counts"))
    raw = both.filter(pc.field("value") < 10).write_to(TransactionalFileSink(tmp_path / "raw"))
    config = JobConfig(name="dag", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=2)
    Job(Pipeline.all(top, counts, raw), config).run(isolated=False)
    events = pd.concat([a.events(0, 20_000).to_pandas(), b.events(0, 10_000).to_pandas()])
    want = reference_windows(events, 1_000, 1_000)
    assert_same(committed(tmp_path / "counts"), want, ["key", "window_start", "n", "total"])
    best = want.groupby("window_start")["n"].max().reset_index()
    got = TransactionalFileSink.read(tmp_path / "top").to_pandas().groupby("ws")["best"].max()
    assert got.index.tolist() == best["window_start"].tolist()
    assert got.tolist() == best["n"].astype(float).tolist()
    raw_got = TransactionalFileSink.read(tmp_path / "raw").to_pandas()
    assert sorted(raw_got["id"].tolist()) == sorted(events[events["value"] < 10]["id"].tolist())


def test_composite_key_rolling_and_windowed(tmp_path):
    source = GeneratorSource(total=20_000, partitions=2, keys=40, batch_size=2_000)
    stream = (Pipeline().read_from(source).with_timestamps("id")
              .map_batches(lambda b: b.append_column("k2", pc.cast(pc.bit_wise_and(b["key"], 3), pa.string()))))
    rolled = stream.group_by("key", "k2").aggregate(n="count").write_to(TransactionalFileSink(tmp_path / "r"))
    win = (stream.group_by("key", "k2").window(tumbling(4_000)).aggregate(n="count")
           .write_to(TransactionalFileSink(tmp_path / "w")))
    config = JobConfig(name="composite", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.05, local_parallelism=2)
    Job(Pipeline.all(rolled, win), config).run(isolated=False)
    e = source.events(0, 20_000).to_pandas()
    e["k2"] = (e["key"] & 3).astype(str)
    want = e.assign(window_start=e["id"] // 4_000 * 4_000).groupby(
        ["key", "k2", "window_start"]).size().reset_index(name="n")
    got = committed(tmp_path / "w", keys=("key", "k2"))
    assert_same(got, want.sort_values(["key", "k2", "window_start"]).reset_index(drop=True),
                ["key", "k2", "window_start", "n"])
    r = TransactionalFileSink.read(tmp_path / "r").to_pandas()
    final = r.groupby(["key", "k2"])["n"].max().reset_index()
    assert final.set_index(["key", "k2"])["n"].to_dict() == e.groupby(["key", "k2"]).size().to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_windowed_job_survives_kill_9(tmp_path, guarantee):
    source = GeneratorSource(total=300_000, partitions=4, keys=500, rate=120_000, batch_size=5_000)
    config = JobConfig(name=f"win-kills-{guarantee}", processing_guarantee=guarantee,
                       snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.2,
                       local_parallelism=2, max_restarts=20, restart_backoff=0.05)
    run_with_kills(Job(windowed(source, sliding(20_000, 10_000), tmp_path / "out"), config), 3, seed=11)
    want = reference_windows(source.events(0, 300_000).to_pandas(), 20_000, 10_000)
    got = committed(tmp_path / "out")
    if guarantee == "exactly-once":
        assert_same(got, want, ["key", "window_start", "n", "total", "low", "high"])
    else:
        # at-least-once: nothing lost; a replayed window may be emitted again, and may have
        # counted a replayed event twice, so every window is there, and every row of it
        # (never one holding only part of its events) has at least its count
        merged = got.merge(want[["key", "window_start", "n"]], on=["key", "window_start"],
                           how="left", suffixes=("", "_want"), validate="many_to_one")
        assert merged["n_want"].notna().all(), "a window that pandas does not have"
        assert got.drop_duplicates(["key", "window_start"]).shape[0] == len(want)
        short = merged[merged["n"] < merged["n_want"]]
        assert short.empty, f"{len(short)} rows with part of their window:\n{short.head()}"


def test_a_snapshot_of_another_shape_is_refused(tmp_path):
    source = GeneratorSource(total=200_000, partitions=2, keys=50, batch_size=2_000, rate=100_000)
    config = JobConfig(name="shape", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       max_restarts=0)
    job = Job(windowed(source, tumbling(1_000), tmp_path / "out"), config)
    job.run(isolated=False)
    other = (Pipeline().read_from(source).with_timestamps("id").group_by("key")
             .window(tumbling(2_000)).count().write_to(TransactionalFileSink(tmp_path / "o")))
    with pytest.raises(SnapshotMismatchError, match="vertex 'window' was .*tumbling.*1000"):
        Job(other, config).run()


def test_window_state_rescales_after_a_kill(tmp_path):
    """A member killed mid-run (no restart), then the job run again at another parallelism:
    its window state, watermarks and sink transactions restore by partition."""
    source = GeneratorSource(total=200_000, partitions=4, keys=300, rate=60_000, batch_size=4_000)

    def run(parallelism, restarts):
        config = JobConfig(name="win-rescale", snapshot_store=str(tmp_path / "snaps"),
                           snapshot_interval=0.1, local_parallelism=parallelism,
                           max_restarts=restarts)
        return Job(windowed(source, sliding(20_000, 10_000), tmp_path / "out"), config)

    run_killed_once(run(2, 0), tmp_path / "snaps", after=3)
    result = run(3, 0).run()
    assert result.executions[0]["restored_from"] is not None
    want = reference_windows(source.events(0, 200_000).to_pandas(), 20_000, 10_000)
    assert_same(committed(tmp_path / "out"), want, ["key", "window_start", "n", "total", "low", "high"])


@pytest.mark.parametrize("guarantee", ["exactly-once", "none"])
def test_a_window_without_a_key_runs_on_one_processor(tmp_path, guarantee):
    source = GeneratorSource(total=40_000, partitions=4, keys=30, batch_size=2_000)
    pipeline = (Pipeline().read_from(source).with_timestamps("id", max_lag=500)
                .window(tumbling(3_000)).aggregate(n="count", top=("max", "value"))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    assert pipeline.plan().vertices["window"].single
    config = JobConfig(name=f"global-{guarantee}", processing_guarantee=guarantee,
                       snapshot_store=None if guarantee == "none" else str(tmp_path / "snaps"),
                       snapshot_interval=0.05, local_parallelism=2)
    result = Job(pipeline, config).run(isolated=False)
    assert result.executions[0]["late_events"] == 0
    e = source.events(0, 40_000).to_pandas()
    want = e.assign(window_start=e["id"] // 3_000 * 3_000).groupby("window_start")["value"].agg(
        ["count", "max"]).reset_index()
    got = TransactionalFileSink.read(tmp_path / "out").to_pandas().sort_values("window_start")
    assert got["window_start"].tolist() == want["window_start"].tolist()
    assert got["n"].tolist() == want["count"].tolist()
    assert got["top"].tolist() == want["max"].tolist()
    assert (got["window_end"] - got["window_start"] == 3_000).all()


# -- an idle source partition in a running job ----------------------------------------------

_WINDOW_SEEN = threading.Event()
_GAVE_UP = threading.Event()


class _SeenWriter(SinkWriter):
    """Collects window rows in this process and says when the first one arrives."""

    rows: list = []

    def write(self, batch):
        _SeenWriter.rows.append(batch)
        _WINDOW_SEEN.set()

    def prepare(self, snapshot_id):
        return None

    def commit(self, snapshot_id):
        pass

    def recover(self, snapshot_id, prepared):
        pass


class _SeenSink(Sink):
    name = "seen"
    transactional = False

    def open(self, context):
        return _SeenWriter()


class _OneGoesIdle(Source):
    """Two partitions: 0 emits even ids without end; 1 emits its first 50 odd ids and then
    nothing. The source ends only once a window has reached the sink (or after 60 s, so
    that a broken idle release fails the test instead of hanging it)."""

    name = "one-goes-idle"
    replayable = True
    acknowledging = False

    def partition_count(self):
        return 2

    def open(self, partitions, context):
        return _OneGoesIdleReader(partitions)


class _OneGoesIdleReader(SourceReader):
    def __init__(self, partitions):
        self.partitions = partitions
        self.next = dict.fromkeys(partitions, 0)
        self.turn = 0
        self.last = None
        self.deadline = time.monotonic() + 60

    def read(self, max_rows):
        for _ in range(len(self.partitions)):
            p = self.partitions[self.turn % len(self.partitions)]
            self.turn += 1
            n = self.next[p]
            if p == 1 and n >= 50:
                continue
            rows = min(50 if p == 1 else 100, max_rows)
            self.next[p] = n + rows
            self.last = p
            time.sleep(0.01)               # about 10,000 events/s: a running stream
            ids = 2 * np.arange(n, n + rows, dtype=np.int64) + p
            return pa.record_batch({"id": ids, "key": np.zeros(rows, np.int64),
                                    "value": np.ones(rows)})
        return None

    def at_end(self):
        if _WINDOW_SEEN.is_set():
            return True
        if time.monotonic() > self.deadline:
            _GAVE_UP.set()
            return True
        return False

    def last_partition(self):
        return self.last

    def snapshot_state(self):
        return {"next": {str(k): v for k, v in self.next.items()}}

    def restore_state(self, state):
        for k, v in ((state or {}).get("next") or {}).items():
            self.next[int(k)] = v


def test_an_idle_source_partition_stops_holding_windows_back(tmp_path):
    """Partition 1 falls silent after id 99 while partition 0 runs on: after idle_timeout the
    watermark follows partition 0 alone, and window [0, 1000) fires while the job runs."""
    _WINDOW_SEEN.clear()
    _GAVE_UP.clear()
    _SeenWriter.rows = []
    pipeline = (Pipeline().read_from(_OneGoesIdle()).with_timestamps("id", idle_timeout=0.5)
                .group_by("key").window(tumbling(1_000)).count().write_to(_SeenSink()))
    config = JobConfig(name="idle", local_parallelism=1, snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.2)
    Job(pipeline, config).run(isolated=False)
    assert not _GAVE_UP.is_set(), "no window fired while partition 1 was idle"
    first = pa.Table.from_batches(_SeenWriter.rows).to_pylist()[0]
    # the events of [0, 1000): ids 0, 2, ..., 998 of partition 0 and 1, 3, ..., 99 of partition 1
    assert first["window_start"] == 0 and first["count"] == 500 + 50


def test_too_late_events_go_to_the_side_output_never_lost(tmp_path):
    """Out-of-order event times with a small lag: whatever the watermark's timing, every
    event is either counted in exactly one committed window or in the late side output."""
    source = GeneratorSource(total=60_000, partitions=4, keys=20, batch_size=1_000, rate=200_000)

    def jitter(b):
        t = pc.subtract(b["id"], pc.multiply(pc.bit_wise_and(b["key"], 15), 4_000))
        return b.append_column("t", t)

    pipeline = (Pipeline().read_from(source).map_batches(jitter)
                .with_timestamps("t", max_lag=1_000)
                .group_by("key").window(tumbling(2_000))
                .aggregate(n="count", late_events=TransactionalFileSink(tmp_path / "late"))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="late", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=2)
    result = Job(pipeline, config).run(isolated=False)
    late = TransactionalFileSink.read(tmp_path / "late")
    out = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    assert late.num_rows > 0, "the jitter exceeds the lag: some events must be too late"
    assert result.late_events == late.num_rows
    assert not out.duplicated(["key", "window_start"]).any()
    assert out["n"].sum() + late.num_rows == 60_000
    # and each window holds exactly the events of its own that were not too late
    e = jitter(pa.RecordBatch.from_pandas(source.events(0, 60_000).to_pandas())).to_pandas()
    late_ids = set(late.column("id").to_pylist())
    kept = e[~e["id"].isin(late_ids)]
    want = kept.assign(window_start=kept["t"] // 2_000 * 2_000).groupby(["key", "window_start"]).size()
    assert out.set_index(["key", "window_start"])["n"].sort_index().to_dict() == want.to_dict()


def test_window_state_stays_bounded_while_the_stream_runs(tmp_path):
    """Windows fire and leave the state as the watermark passes them, not at the end: every
    snapshot taken mid-run holds only the few windows still open."""
    from sparkjet.snapshot.store import SnapshotStore

    source = GeneratorSource(total=120_000, partitions=2, keys=20, batch_size=1_000, rate=100_000)
    config = JobConfig(name="bounded", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=1)
    job = Job(windowed(source, tumbling(2_000), tmp_path / "out", n="count"), config)
    sizes = []

    def on_progress(event):
        if event["event"] == "snapshot" and not event.get("terminal"):
            with SnapshotStore(config.snapshot_store, config.id) as store:
                state = store.restore("window", None, snapshot_id=event["snapshot"]).table
                sizes.append(0 if state is None else state.num_rows)

    job.run(isolated=False, on_progress=on_progress)
    assert len(sizes) >= 2 and max(sizes) > 0
    # 60 windows x 20 keys would be 1200 rows: only the windows between the watermark and
    # the newest event received (what the channels hold at most) are open; a loaded
    # machine lets one partition fall behind, holding more open, never all of them
    assert max(sizes) <= 600, sizes


def _legacy_snapshot(store_dir, job_id, source, done: int):
    """A snapshot laid out as sparkjet wrote them before DAG pipelines: vertices "source"
    (reader state by processor), "aggregate" (the rolling state by key) and "sink"
    (prepared transactions by processor), and no DAG fingerprint."""
    import json

    from sparkjet.operators.rolling import KeyedAggregator
    from sparkjet.snapshot.store import SnapshotStore

    per = done // source.partitions
    agg = KeyedAggregator("key", {"count": "count", "sum": ("sum", "value")})
    ids = [p + n * source.partitions for p in range(source.partitions) for n in range(per)]
    events = source.events(0, done).to_pandas()
    agg.update(pa.RecordBatch.from_pandas(events[events["id"].isin(ids)], preserve_index=False))
    state = {"offsets": {str(p): per for p in range(source.partitions)}, "next": 0}
    with SnapshotStore(store_dir, job_id) as store:
        store.register_execution(1)
        w = store.writer(0, 1, writer=0)
        w.write_broadcast_entries("source", [b"0"], [json.dumps(state).encode()])
        w.write_broadcast_entries("sink", [b"0"], [json.dumps(None).encode()])
        w.write_table("aggregate", agg.snapshot(), key="key")
        store.commit(0, 1, [w.finish()])


def test_a_snapshot_from_before_dags_restores_or_is_refused(tmp_path):
    from helpers.jobs import final_state, keyed_pipeline

    from sparkjet import verify

    source = GeneratorSource(total=8_000, partitions=2, keys=40, batch_size=500)
    config = JobConfig(name="legacy", snapshot_store=str(tmp_path / "snaps"), local_parallelism=1)
    _legacy_snapshot(config.snapshot_store, config.id, source, 4_000)
    windowed_job = Job(windowed(source, tumbling(1_000), tmp_path / "w"), config)
    with pytest.raises(SnapshotMismatchError, match="before DAG pipelines"):
        windowed_job.run(isolated=False)
    result = Job(keyed_pipeline(source, tmp_path / "out"), config).run(isolated=False)
    assert result.executions[0]["restored_from"] == 0
    assert result.events_in == 4_000          # the first half came from the snapshot
    report = verify.check_aggregates(source.expected_counts(), final_state(tmp_path / "out"),
                                     key="key", columns=["count", "sum"])
    assert report.valid, str(report)


def test_early_results_in_a_job_precede_the_final_ones(tmp_path):
    source = GeneratorSource(total=60_000, partitions=2, keys=10, batch_size=1_000, rate=100_000)
    pipeline = (Pipeline().read_from(source).with_timestamps("id")
                .group_by("key").window(tumbling(30_000))
                .aggregate(n="count", early_results=0.05)
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="early", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=1)
    Job(pipeline, config).run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    final = out[~out["early"]].sort_values(["key", "window_start"]).reset_index(drop=True)
    early = out[out["early"]]
    assert len(early) > 0
    e = source.events(0, 60_000).to_pandas()
    want = e.assign(window_start=e["id"] // 30_000 * 30_000).groupby(["key", "window_start"]).size()
    assert final.set_index(["key", "window_start"])["n"].to_dict() == want.to_dict()
    # a speculative count never exceeds the final one
    merged = early.merge(final, on=["key", "window_start"], suffixes=("_early", "_final"))
    assert len(merged) == len(early) and (merged["n_early"] <= merged["n_final"]).all()
