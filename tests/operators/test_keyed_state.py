"""Rolling keyed aggregation: parity with pyarrow's group_by over random batches, updates per
batch, snapshots and restores split by partition."""
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparkjet
from sparkjet.errors import InvalidArgumentError, NullKeyError
from sparkjet.operators.rolling import KeyedAggregator

AGGS = {"n": "count", "total": ("sum", "v"), "lo": ("min", "v"), "hi": ("max", "v"), "avg": ("mean", "v")}


def expected(batches, key="k"):
    t = pa.Table.from_batches(batches)
    g = t.group_by(key).aggregate([(key, "count"), ("v", "sum"), ("v", "min"), ("v", "max"), ("v", "mean")])
    return {r[key]: (r[f"{key}_count"], r["v_sum"], r["v_min"], r["v_max"], r["v_mean"]) for r in g.to_pylist()}


def state_of(agg, key="k"):
    t = agg.snapshot()
    out = {}
    for r in t.to_pylist():
        out[r[key]] = (r["__count"], r["__sum__v"], r["__min__v"], r["__max__v"], r["__sum__v"] / r["__count"])
    return out


def close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0]
        assert np.allclose(a[k][1:], b[k][1:], rtol=1e-9, atol=1e-9), (k, a[k], b[k])


batch_strategy = st.lists(
    st.lists(st.tuples(st.integers(-50, 50), st.floats(-1e6, 1e6)), min_size=0, max_size=60),
    min_size=1, max_size=8)


@settings(max_examples=80, deadline=None)
@given(batch_strategy, st.booleans())
def test_matches_pyarrow_group_by_and_emits_touched_keys(rows_per_batch, as_strings):
    batches = []
    agg = KeyedAggregator("k", AGGS)
    for rows in rows_per_batch:
        keys = [r[0] for r in rows]
        if as_strings:
            keys = [f"key-{k}" for k in keys]
        b = pa.record_batch({"k": pa.array(keys, pa.string() if as_strings else pa.int64()),
                             "v": pa.array([r[1] for r in rows], pa.float64())})
        batches.append(b)
        out = agg.update(b)
        assert sorted(out.column("k").to_pylist()) == sorted(set(keys))
        now = expected([x for x in batches if x.num_rows], "k") if any(x.num_rows for x in batches) else {}
        for r in out.to_pylist():
            want = now[r["k"]]
            assert r["n"] == want[0] and np.isclose(r["total"], want[1]) and r["lo"] == want[2]
            assert r["hi"] == want[3] and np.isclose(r["avg"], want[4])
    if any(b.num_rows for b in batches):
        close(state_of(agg), expected([b for b in batches if b.num_rows]))


def test_snapshot_split_by_partition_restores_at_any_parallelism():
    rng = np.random.default_rng(1)
    agg = KeyedAggregator("k", AGGS)
    for _ in range(5):
        agg.update(pa.record_batch({"k": rng.integers(0, 5000, 20000), "v": rng.random(20000)}))
    snap = agg.snapshot()
    pids = sparkjet.partition_ids(snap["k"], 271).to_numpy()
    for parallelism in (1, 3, 7):
        parts = [KeyedAggregator("k", AGGS) for _ in range(parallelism)]
        for j, a in enumerate(parts):
            a.restore(snap.filter(pa.array(pids % parallelism == j)))
        merged = {}
        for a in parts:
            merged.update(state_of(a))
        close(merged, state_of(agg))
        assert sum(len(a) for a in parts) == len(agg)


def test_restored_state_keeps_aggregating():
    a = KeyedAggregator("k", {"n": "count", "s": ("sum", "v")})
    a.update(pa.record_batch({"k": [1, 2], "v": [1.0, 2.0]}))
    b = KeyedAggregator("k", {"n": "count", "s": ("sum", "v")})
    b.restore(a.snapshot())
    assert b.update(pa.record_batch({"k": [1], "v": [5.0]})).to_pylist() == [{"k": 1, "n": 2, "s": 6.0}]


def test_many_keys_grow_the_map():
    a = KeyedAggregator("k", {"n": "count"})
    keys = np.arange(300_000, dtype=np.int64) * 1_000_003
    out = a.update(pa.record_batch({"k": np.concatenate([keys, keys[:10]])}))
    assert len(a) == 300_000 and out.num_rows == 300_000
    assert pc.sum(out["n"]).as_py() == 300_010


def test_errors():
    with pytest.raises(InvalidArgumentError, match="at least one"):
        KeyedAggregator("k", {})
    with pytest.raises(InvalidArgumentError, match="operation must be one of"):
        KeyedAggregator("k", {"x": ("median", "v")})
    with pytest.raises(InvalidArgumentError, match="use 'count' or"):
        KeyedAggregator("k", {"x": ("sum",)})
    a = KeyedAggregator("k", {"s": ("sum", "v")})
    with pytest.raises(NullKeyError, match="row 1"):
        a.update(pa.record_batch({"k": [1, None], "v": [1.0, 2.0]}))
    # a null value is skipped, as SQL skips it (tests/runtime/test_schemas.py has the details)
    assert a.update(pa.record_batch({"k": [1, 2], "v": [1.0, None]})).to_pylist() == [
        {"k": 1, "s": 1.0}, {"k": 2, "s": None}]
    with pytest.raises(InvalidArgumentError, match="not numeric"):
        a.update(pa.record_batch({"k": [1], "v": ["x"]}))
    a.update(pa.record_batch({"k": [1], "v": [1.0]}))
    with pytest.raises(InvalidArgumentError, match="changed type"):
        a.update(pa.record_batch({"k": ["a"], "v": [1.0]}))
