"""Integer, timestamp and duration aggregates keep their type (issue 26, item 5): sums of
integers are exact int64 (overflow reported naming stage, column and key, or widened to
decimal128 with ``overflow="decimal"``), min/max/first/last keep the column's type, in the
rolling aggregation and in windows, and the state snapshots and restores exactly, in a job
too. Every reference is pandas over exact Python or int64 integers."""
import decimal
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from pyspark import cloudpickle

from sparkjet.errors import AggregateOverflowError, InvalidArgumentError, SparkjetError
from sparkjet.operators.rolling import AggregateStage, KeyedAggregator
from sparkjet.operators.windows.operator import WindowOperator, WindowStage
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.windows import session, sliding, tumbling

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BIG = 2**53 + 1                     # the first integer float64 cannot hold
TZ = pa.timestamp("ns", "Europe/Paris")
AGGS = {"n": "count", "s": ("sum", "v"), "lo": ("min", "v"), "hi": ("max", "v"),
        "f": ("first", "v"), "l": ("last", "v"), "m": ("mean", "v"),
        "t0": ("min", "ts"), "t1": ("max", "ts"), "tf": ("first", "ts"), "tl": ("last", "ts"),
        "d": ("sum", "dur"), "dmax": ("max", "dur")}


def _batches(seed=7, n_batches=4, rows=500, keys=20):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        v = BIG + rng.integers(-1000, 1000, rows)         # odd values past 2^53
        ts = 1_700_000_000_000_000_000 + rng.integers(0, 10**12, rows)
        out.append(pa.record_batch({
            "k": pa.array(rng.integers(0, keys, rows)),
            "v": pa.array(v, mask=rng.random(rows) < 0.1),
            "ts": pa.array(ts, pa.int64()).cast(TZ),
            "dur": pa.array(rng.integers(0, 10**15, rows), pa.duration("us")),
            # event time grows batch after batch (so arrival order is time order)
            "t": pa.array(len(out) * 250 + np.sort(rng.integers(0, 250, rows))),
        }))
    return out


def _reference(batches, key="k") -> dict:
    """pandas over the rows, in int64 and timestamps, never float64."""
    df = pa.Table.from_batches(batches).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    g = df.groupby(key)
    ref = pd.DataFrame({"n": g.size(), "s": g["v"].sum(), "lo": g["v"].min(), "hi": g["v"].max(),
                        "f": g["v"].first(), "l": g["v"].last(),
                        "t0": g["ts"].min(), "t1": g["ts"].max(), "tf": g["ts"].first(),
                        "tl": g["ts"].last(), "d": g["dur"].sum(), "dmax": g["dur"].max()})
    sums = {k: sum(int(x) for x in grp.dropna()) for k, grp in g["v"]}
    return {k: {**row, "s": sums[k], "m": sums[k] / g["v"].count()[k]}
            for k, row in ref.to_dict("index").items()}


def _check(rows: list[dict], ref: dict, key="k") -> None:
    assert {r[key] for r in rows} == set(ref)
    for r in rows:
        want = ref[r[key]]
        for name in ("n", "s", "lo", "hi", "f", "l", "d", "dmax"):
            assert r[name] == want[name], (name, r[key], r[name], want[name])
        for name in ("t0", "t1", "tf", "tl"):
            assert pd.Timestamp(r[name]) == want[name], (name, r[name], want[name])
        assert r["m"] == pytest.approx(want["m"], rel=1e-15)


def _assert_types(schema: pa.Schema, sum_type: pa.DataType | None = None) -> None:
    sum_type = sum_type or pa.int64()
    assert schema.field("s").type == sum_type
    for name in ("lo", "hi", "f", "l"):
        assert schema.field(name).type == pa.int64()
    for name in ("t0", "t1", "tf", "tl"):
        assert schema.field(name).type == TZ          # unit and zone kept
    assert schema.field("d").type == pa.duration("us")
    assert schema.field("dmax").type == pa.duration("us")
    assert schema.field("m").type == pa.float64()


# ------------------------------------------------------------------ rolling aggregation

def test_rolling_integers_past_2_53_are_exact_and_typed():
    batches = _batches()
    agg = KeyedAggregator("k", AGGS)
    for b in batches:
        out = agg.update(b)
    _assert_types(out.schema)
    rows = pa.Table.from_batches([agg.update(b.slice(0, 0)), out]).to_pylist()
    _check(rows, _reference(batches))
    # the sums really are past what float64 holds exactly
    assert any(r["s"] % 2 and r["s"] > 2**53 for r in rows)


def test_rolling_state_snapshots_and_restores_exactly_split_by_key():
    batches = _batches(seed=3)
    agg = KeyedAggregator("k", AGGS)
    for b in batches[:2]:
        agg.update(b)
    snap = agg.snapshot()
    assert snap.schema.field("__sum__v").type == pa.int64()
    assert snap.schema.field("__min__ts").type == TZ
    even = pa.array(np.asarray(snap["k"]) % 2 == 0)
    parts = [KeyedAggregator("k", AGGS), KeyedAggregator("k", AGGS)]
    parts[0].restore(snap.filter(even))
    parts[1].restore(snap.filter(pa.compute.invert(even)))
    rows = {}
    for b in batches[2:]:
        for p in parts:
            mine = b.filter(pa.array((np.asarray(b["k"]) % 2 == 0) == (p is parts[0])))
            for r in p.update(mine).to_pylist():
                rows[r["k"]] = r
    ref = _reference(batches)
    _check(list(rows.values()), {k: ref[k] for k in rows})


def test_an_int64_sum_overflow_names_stage_column_and_key():
    agg = KeyedAggregator("k", {"s": ("sum", "v")}, stage="aggregate.2")
    agg.update(pa.record_batch({"k": ["a", "b"], "v": [2**62, 2**62]}))
    with pytest.raises(AggregateOverflowError) as e:
        agg.update(pa.record_batch({"k": ["a", "b", "b"], "v": [1, 2**62, 1]}))
    msg = str(e.value)
    assert "stage 'aggregate.2'" in msg and "column 'v'" in msg and "{'k': 'b'}" in msg
    assert 'overflow="decimal"' in msg
    assert e.value.column == "v" and e.value.key == {"k": "b"}
    # all or nothing: the batch that overflowed changed no sum
    assert agg.update(pa.record_batch({"k": ["a"], "v": [0]})).to_pylist() == [
        {"k": "a", "s": 2**62}]


def test_overflow_decimal_sums_exactly_past_int64_and_restores():
    stage = AggregateStage(("k",), {"s": ("sum", "v"), "m": ("mean", "v")}, "decimal")
    op = stage.make_operator(None)
    values = [2**63 - 1, 2**63 - 1, -5, 2**62]
    out = op.process(pa.record_batch({"k": [1, 1, 2, 1], "v": values}))[0][0]
    assert out.schema.field("s").type == pa.decimal128(38, 0)
    assert out.to_pylist() == [
        {"k": 1, "s": decimal.Decimal(2 * (2**63 - 1) + 2**62), "m": (2 * (2**63 - 1) + 2**62) / 3},
        {"k": 2, "s": decimal.Decimal(-5), "m": -5.0}]
    restored = stage.make_operator(None)
    restored.restore(op.snapshot(), 0)
    again = restored.process(pa.record_batch({"k": [1], "v": [2**63 - 1]}))[0][0]
    assert again.column("s").to_pylist() == [decimal.Decimal(3 * (2**63 - 1) + 2**62)]
    # (the default stage and its fingerprint are as before; "decimal" is recorded)
    assert "overflow" not in AggregateStage(("k",), {"s": ("sum", "v")}).fingerprint()
    assert stage.fingerprint()["overflow"] == "decimal"


def test_sum_and_mean_of_a_timestamp_are_refused_clearly():
    agg = KeyedAggregator("k", {"s": ("sum", "ts")})
    with pytest.raises(InvalidArgumentError, match=r"sum of column 'ts' \(timestamp\[ns, tz="):
        agg.update(pa.record_batch({"k": [1], "ts": pa.array([1], TZ)}))
    with pytest.raises(InvalidArgumentError, match="overflow must be one of"):
        Pipeline().read_from(GeneratorSource(total=10)).group_by("key").aggregate(
            s=("sum", "value"), overflow="wrap")


def test_a_snapshot_of_float_state_from_before_restores_as_float():
    """A job's state from before exact integers (float64 state of an int column) restores,
    and that column keeps float64 output, so the sink's schema does not change."""
    old = pa.table({"k": [1, 2], "__count": [2, 1], "__sum__v": [3.0, 5.0],
                    "__max__v": [2.0, 5.0]})
    agg = KeyedAggregator("k", {"s": ("sum", "v"), "hi": ("max", "v"), "m": ("mean", "v")})
    agg.restore(old)
    out = agg.update(pa.record_batch({"k": [1, 3], "v": [4, 7]}))
    assert out.schema.field("s").type == pa.float64()
    assert out.to_pylist() == [{"k": 1, "s": 7.0, "hi": 4.0, "m": 7 / 3},
                               {"k": 3, "s": 7.0, "hi": 7.0, "m": 7.0}]


# ------------------------------------------------------------------ windows

def _window_op(window, aggs=AGGS, overflow="fail"):
    return WindowOperator(WindowStage(("k",), window, aggs, None, 0, None, overflow), "t")


def _window_reference(batches, starts_of) -> dict:
    rows = pa.Table.from_batches(batches)
    out = {}
    for start, idx in starts_of(np.asarray(rows["t"])):
        part = rows.take(pa.array(idx))
        for k, want in _reference(part.to_batches()).items():
            out[(start, k)] = want
    return out


@pytest.mark.parametrize("window", [tumbling(100), sliding(200, 100)])
def test_windows_keep_integers_exact_and_times_typed(window):
    batches = _batches(seed=11, rows=300)
    op = _window_op(window)
    for b in batches:
        op.process(b)
    fired = pa.Table.from_batches(op.advance(10_000))
    _assert_types(fired.schema)
    size, slide = window.size, window.slide

    def starts_of(t):
        for start in range(-size + slide, 1000, slide):
            idx = np.flatnonzero((t >= start) & (t < start + size))
            if len(idx):
                yield start, idx

    ref = _window_reference(batches, starts_of)
    got = fired.to_pylist()
    assert len(got) == len(ref)
    for r in got:
        _check([r], {r["k"]: ref[(r["window_start"], r["k"])]})


def test_session_windows_keep_integers_exact_and_restore():
    batches = _batches(seed=5, rows=200, keys=5)
    op = _window_op(session(10_000))          # one session per key over every row
    op.process(batches[0])
    restored = _window_op(session(10_000))
    restored.restore(op.snapshot(), op.watermark)
    for b in batches[1:]:
        restored.process(b)
    fired = pa.Table.from_batches(restored.advance(10**9))
    _assert_types(fired.schema)
    # first and last: in the order rows arrive, sessions merged in the order they began;
    # one session per key here, whose rows arrive batch after batch in time order
    _check(fired.to_pylist(), _reference(batches))


def test_window_state_snapshots_exactly_and_overflow_names_the_window_key():
    op = _window_op(sliding(200, 100), {"s": ("sum", "v")})
    op.process(pa.record_batch({"t": [10, 150], "k": ["x", "x"], "v": [2**62, 2**62]}))
    restored = _window_op(sliding(200, 100), {"s": ("sum", "v")})
    snap = op.snapshot()
    assert snap.schema.field("__sum__v").type == pa.int64()
    restored.restore(snap, op.watermark)
    # each pane alone fits; the window [0, 200) adds both panes: 2^63 overflows there
    with pytest.raises(AggregateOverflowError, match=r"stage 'window'.*column 'v'.*'k': 'x'"):
        restored.advance(200)
    wide = _window_op(sliding(200, 100), {"s": ("sum", "v")}, overflow="decimal")
    wide.restore(snap, op.watermark)                  # int64 state widens to decimal
    rows = pa.Table.from_batches(wide.advance(200)).to_pylist()
    assert [r["s"] for r in rows] == [decimal.Decimal(2**62), decimal.Decimal(2**63)]


# ------------------------------------------------------------------ in a job

TOTAL = 60_000


def _source():
    return GeneratorSource(total=TOTAL, partitions=2, keys=30, batch_size=1_000, rate=30_000)


def with_big_ints(batch):
    """Exact integers past 2^53 (odd, so float64 rounds them) and a zoned timestamp."""
    ids = batch.column("id").to_numpy()
    return batch.append_column("big", pa.array(BIG + 2 * ids)).append_column(
        "at", pa.array(1_700_000_000_000_000_001 + ids * 997, pa.int64()).cast(TZ))


def _pipeline(out, overflow="decimal"):
    return (Pipeline().read_from(_source()).map_batches(with_big_ints).group_by("key")
            .aggregate(n="count", s=("sum", "big"), hi=("max", "big"), t0=("min", "at"),
                       tl=("last", "at"), overflow=overflow)
            .write_to(TransactionalFileSink(out)))


def test_a_job_stopped_and_resumed_keeps_integer_state_exact(tmp_path):
    config = JobConfig(name="ints", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.1, local_parallelism=2)
    handle = Job(_pipeline(tmp_path / "out"), config).submit(isolated=False)
    deadline = time.monotonic() + 60
    while (handle.metrics or {}).get("snapshots", 0) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stopped = handle.stop(snapshot="v1", timeout=60)
    assert stopped.stopped and 0 < stopped.events_in < TOTAL
    Job(_pipeline(tmp_path / "out"), config).run(isolated=False)      # resumes from it
    out = TransactionalFileSink.read(tmp_path / "out")
    assert out.schema.field("s").type == pa.decimal128(38, 0)
    assert out.schema.field("t0").type == TZ and out.schema.field("tl").type == TZ
    final = out.to_pandas().sort_values("n").groupby("key").last()
    events = with_big_ints(_source().events(0, TOTAL).combine_chunks().to_batches()[0])
    ref = events.to_pandas().groupby("key")
    assert (final["n"] == ref.size()).all()
    sums = {k: sum(int(x) for x in g) for k, g in ref["big"]}
    assert {k: int(v) for k, v in final["s"].items()} == sums
    assert (final["hi"] == ref["big"].max()).all()
    assert (final["t0"] == ref["at"].min()).all()


def test_an_overflow_in_a_job_fails_it_naming_the_vertex(tmp_path):
    def huge(batch):
        return batch.append_column("big", pa.array(np.full(batch.num_rows, 2**62)))

    pipeline = (Pipeline().read_from(GeneratorSource(total=1_000, partitions=1, keys=3))
                .map_batches(huge).group_by("key").aggregate(s=("sum", "big"))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="overflow", snapshot_store=str(tmp_path / "snaps"), max_restarts=2,
                       restart_backoff=0)
    # (in process the member's error; a job of its own raises JobFailedError, not retried)
    with pytest.raises(SparkjetError, match=r"AggregateOverflowError: stage 'aggregate': the "
                                            r"sum of column 'big' overflows int64 for key "
                                            r"\{'key': \d\}"):
        Job(pipeline, config).run(isolated=False)
