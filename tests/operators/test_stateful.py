"""Keyed state of the user's own (``map_state``, ``map_stateful``) with TTL and timers, and
deduplication: the operators on their own, then jobs checked against pandas over the whole
input, under the three guarantees and with the member killed at random moments."""
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers.jobs import run_killed_once, run_with_kills

# The jobs' functions live in this module, which a member process or a Spark worker cannot
# import (tests/ is not on their path): they travel by value.
from pyspark import cloudpickle  # noqa: E402

from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.dedup import DeduplicateOperator, DeduplicateStage
from sparkjet.operators.stateful import KeyedStateOperator, keyed_state_stage
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.watermarks import MAX_TIME
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOP = pa.schema([("n", pa.int64()), ("top", pa.float64())])


def count_and_max(b):
    """Per key: the running count and greatest value (the state), emitted per batch."""
    n = np.diff(b.offsets) + b.state["n"].fill_null(0).to_numpy()
    top = np.maximum(np.maximum.reduceat(b.rows["value"].to_numpy(), b.offsets[:-1]),
                     b.state["top"].fill_null(-np.inf).to_numpy())
    state = pa.table({"n": n, "top": top})
    return pa.Table.from_arrays([*b.keys.columns, state["n"], state["top"]],
                                names=[*b.keys.column_names, "n", "top"]), state


def operator(fn, state=TOP, ttl=None, ttl_in="event", keys=("k",), clock=None):
    stage = keyed_state_stage(keys, fn, state, ttl, ttl_in, False)
    kw = {"clock": clock} if clock else {}
    return KeyedStateOperator(stage, "t", **kw)


def feed(op, t, k, v=None):
    b = pa.record_batch({"t": pa.array(t, pa.int64()), "k": k,
                         "value": pa.array(v if v is not None else [1.0] * len(t), pa.float64())})
    outs, late = op.process(b)
    return pa.Table.from_batches(outs).to_pylist() if outs else []


# -- the operator --------------------------------------------------------------------------


def test_rows_arrive_grouped_by_key_with_their_state():
    seen = []

    def fn(b):
        seen.append((b.keys["k"].to_pylist(), b.offsets.tolist(), b.rows["t"].to_pylist(),
                     b.has_state.tolist(), b.state["n"].to_pylist()))
        return count_and_max(b)

    op = operator(fn)
    assert feed(op, [1, 2, 3, 4], ["a", "b", "a", "c"], [1.0, 5.0, 3.0, 2.0]) == [
        {"k": "a", "n": 2, "top": 3.0}, {"k": "b", "n": 1, "top": 5.0}, {"k": "c", "n": 1, "top": 2.0}]
    assert feed(op, [5, 6], ["b", "d"], [1.0, 4.0]) == [{"k": "b", "n": 2, "top": 5.0},
                                                         {"k": "d", "n": 1, "top": 4.0}]
    assert seen[0] == (["a", "b", "c"], [0, 2, 3, 4], [1, 3, 2, 4], [False] * 3, [None] * 3)
    assert seen[1] == (["b", "d"], [0, 1, 2], [5, 6], [True, False], [1, None])


def test_delete_and_output_only():
    def fn(b):
        b.delete(b.rows["value"].to_numpy()[b.offsets[:-1]] < 0)   # a negative value resets
        return None, pa.table({"n": np.diff(b.offsets) + b.state["n"].fill_null(0).to_numpy(),
                               "top": np.zeros(len(b))})

    op = operator(fn)
    feed(op, [1, 2], ["a", "b"])
    feed(op, [3, 4], ["a", "b"], [-1.0, 1.0])
    assert op.store.get(op.store.slots(pa.table({"k": ["a", "b"]})))["n"].to_pylist() == [None, 2]


def test_event_time_ttl_expires_state_and_evicts_it():
    op = operator(count_and_max, ttl=10)
    feed(op, [0, 1], ["a", "b"])
    assert feed(op, [9], ["a"])[0]["n"] == 2           # 0 + 10 > 9: still there
    assert feed(op, [18], ["a"])[0]["n"] == 3          # updated at 9: 9 + 10 > 18
    assert feed(op, [28], ["a"])[0]["n"] == 1          # 18 + 10 <= 28: expired first
    op.advance(40)                                     # every key's last update + 10 <= 40
    assert len(op.store) == 0


def test_memory_stays_bounded_with_a_ttl():
    op = operator(count_and_max, ttl=1_000)
    for step in range(60):
        t = np.arange(step * 5_000, (step + 1) * 5_000)
        feed(op, t, pa.array(t))                       # every key new: 300,000 in all
        op.advance(int(t[-1]))
    assert len(op.store) <= 1_001
    assert len(op.store.groups) < 150_000              # the key map was rebuilt as keys expired


def test_processing_time_ttl_and_timers():
    now = [0]
    fired = []

    def fn(b):
        if b.rows is None:
            fired.append((b.timer, b.keys["k"].to_pylist(), b.fired.tolist()))
            return None
        b.set_timer(b.now + 5, kind="processing")
        return count_and_max(b)

    op = operator(fn, ttl=1e-9 * 20, ttl_in="processing", clock=lambda: now[0])
    feed(op, [1], ["a"])
    now[0] = 4
    assert op.tick() == [] and not fired
    now[0] = 5
    op.tick()
    assert fired == [("processing", ["a"], [5])]
    now[0] = 19
    assert feed(op, [2], ["a"])[0]["n"] == 2
    now[0] = 40                                         # 19 + 20 <= 40: expired
    assert feed(op, [3], ["a"])[0]["n"] == 1


def test_event_timers_fire_in_time_order_and_may_set_again():
    calls = []

    def fn(b):
        if b.rows is None:
            calls.append(list(zip(b.keys["k"].to_pylist(), b.fired.tolist())))
            again = np.array([k == "a" and t < 30 for k, t in zip(b.keys["k"].to_pylist(), b.fired)])
            b.set_timer(b.fired[again] + 10, again)
            return None
        b.set_timer(b.rows["t"].to_numpy()[b.offsets[1:] - 1] + 5)
        return None

    op = operator(fn)
    feed(op, [10, 3, 1], ["a", "b", "c"])
    op.advance(12)
    assert calls == [[("c", 6), ("b", 8)]]
    op.advance(100)
    assert calls[1:] == [[("a", 15)], [("a", 25)], [("a", 35)]]


def test_out_of_order_rows_never_move_the_last_update_back():
    op = operator(count_and_max, ttl=100)
    feed(op, [1000], ["a"])
    feed(op, [950], ["a"])                              # older: the last update stays 1000
    assert feed(op, [1060], ["a"])[0]["n"] == 3          # 1000 + 100 > 1060: still there


def test_what_a_timer_call_sees_does_not_depend_on_how_the_watermark_advanced():
    """TTL 100, state updated at 0, a timer at 150: the timer call sees the state expired,
    whether the watermark went to 200 at once or by 120 first, and after a restore."""
    def run(marks, restore=False):
        seen = []

        def fn(b):
            if b.rows is None:
                seen.append(b.has_state.tolist())
                return None
            b.set_timer(150)
            return count_and_max(b)

        op = operator(fn, ttl=100)
        feed(op, [0], ["a"])
        if restore:
            other = operator(fn, ttl=100)
            other.restore(op.snapshot(), op.watermark)
            op = other
        for m in marks:
            op.advance(m)
        return seen

    assert run([200]) == run([120, 200]) == run([120, 200], restore=True) == [[False]]


def test_ttl_in_timedelta_units_survives_a_restore():
    from datetime import timedelta

    def fn(b):
        return count_and_max(b)

    stage = keyed_state_stage(("k",), fn, TOP, timedelta(seconds=1), "event", False)
    op = KeyedStateOperator(stage, "t")
    ms = pa.timestamp("ms")
    op.process(pa.record_batch({"t": pa.array([0], pa.int64()).view(ms), "k": ["a"], "value": [1.0]}))
    other = KeyedStateOperator(stage, "t")
    other.restore(op.snapshot(), 0)
    other.advance(999)
    assert len(other.store) == 1
    other.advance(1000)                                 # 0 + 1 s <= 1000 ms: evicted
    assert len(other.store) == 0


def test_a_compaction_never_moves_slots_under_firing_timers():
    """Timers that keep setting themselves at or below the watermark fire round after round;
    the calls that make the store compact must not mix up keys (slots are renumbered)."""
    calls = []

    def fn(b):
        if b.rows is None:
            calls.append((b.keys["k"].to_pylist(), b.fired.tolist()))
            again = b.fired < 100
            b.set_timer(b.fired[again] + 1, again)
            return None
        b.set_timer(1, b.keys["k"].to_numpy() == 1)      # key 1 only: key 2 has none
        return None, {"n": np.zeros(len(b), np.int64), "top": np.zeros(len(b))}

    op = operator(fn, keys=("k",))
    dead = pa.array(np.arange(10, 80_010))
    op.process(pa.record_batch({"t": pa.array(np.zeros(len(dead), np.int64)), "k": dead,
                                "value": np.ones(len(dead))}))
    op.store.delete(op.store.slots(pa.table({"k": dead})))   # 80,000 dead slots
    op.process(pa.record_batch({"t": pa.array([0, 0], pa.int64()), "k": [1, 2], "value": [1.0, 1.0]}))
    op.advance(200)
    assert all(keys == [1] for keys, _ in calls)
    assert [t for _, ts in calls for t in ts] == list(range(1, 101))


def test_timer_times_negative_timestamps_and_errors():
    fired = []

    def fn(b):
        if b.rows is None:
            fired.append(b.fired.tolist())
            return None
        b.set_timer(-5)
        return None

    op = operator(fn)
    feed(op, [-10], ["a"])
    op.advance(-5)
    assert fired == [[-5]]

    def timestamps(b):
        if b.rows is not None:
            b.set_timer(pa.array([1], pa.timestamp("s")))        # 1 s, in an ms column: 1000
        return None

    stage = keyed_state_stage(("k",), timestamps, TOP, None, "event", True)
    op = KeyedStateOperator(stage, "t")
    op.process(pa.record_batch({"t": pa.array([0], pa.int64()).view(pa.timestamp("ms")), "k": ["a"]}))
    assert op.store.event_timer[0] == 1000

    for bad, match in (((MAX_TIME,), "end of time"), ((1, [0, 0]), "given twice"),
                       ((["x"],), "integers or timestamps")):
        op = operator(lambda b, bad=bad: b.set_timer(*bad))
        with pytest.raises(InvalidArgumentError, match=match):
            feed(op, [1], ["a"])


def test_state_and_timers_restore_from_a_snapshot():
    def fn(b):
        if b.rows is not None:
            b.set_timer(50)
        return count_and_max(b)

    op = operator(fn)
    feed(op, [1, 2, 3], ["a", "b", "a"], [2.0, 7.0, 1.0])
    other = operator(fn)
    other.restore(op.snapshot(), 3)
    assert feed(other, [4], ["a"]) == [{"k": "a", "n": 3, "top": 2.0}]
    assert other.store.event_timer[other.store.slots(pa.table({"k": ["b"]}))].tolist() == [50]


@pytest.mark.parametrize("state", [pa.schema([("s", pa.string()), ("l", pa.list_(pa.int64()))]),
                                   pa.schema([("ts", pa.timestamp("ms")), ("d", pa.date32())])],
                         ids=["string-list", "timestamp-date"])
def test_state_of_any_arrow_type(state):
    def value(t: pa.Array) -> dict:
        if state.names[0] == "s":
            return {"s": pc.cast(t, pa.string()), "l": pa.array([[x] for x in t.to_pylist()])}
        return {"ts": pc.cast(t, pa.timestamp("ms")), "d": pc.cast(pc.cast(t, pa.int32()), pa.date32())}

    def fn(b):
        return None, value(b.rows["t"].take(pa.array(b.offsets[1:] - 1)))

    op = operator(fn, state=state)
    for t in range(300):                        # many writes: the Arrow columns compact
        feed(op, [t, t + 1000], ["a", "b"])
    want = pa.table(value(pa.array([299, 1299], pa.int64())), schema=state).to_pylist()
    assert op.store.get(op.store.slots(pa.table({"k": ["a", "b"]}))).to_pylist() == want
    restored = operator(fn, state=state)
    restored.restore(op.snapshot(), 0)
    assert restored.store.get(restored.store.slots(pa.table({"k": ["a", "b"]}))).to_pylist() == want


def test_map_stateful_refuses_a_state_it_cannot_snapshot():
    from sparkjet.operators.stateful import PER_ROW_STATE, per_row

    def fn(state, key, row):
        state.append(lambda: None)          # a lambda cannot be pickled

    op = operator(per_row(list, fn), state=PER_ROW_STATE)
    with pytest.raises(InvalidArgumentError, match="state of key 'a' \\(list\\) cannot be pickled"):
        feed(op, [1], ["a"])


def test_bad_functions_get_clear_errors():
    op = operator(lambda b: (None, pa.table({"n": [1]})))
    with pytest.raises(InvalidArgumentError, match="lacks \\['top'\\]"):
        feed(op, [1], ["a"])
    op = operator(lambda b: (None, pa.table({"n": [1, 2], "top": [1.0, 2.0]})))
    with pytest.raises(InvalidArgumentError, match="2 rows for 1 keys"):
        feed(op, [1], ["a"])
    op = operator(lambda b: (None, pa.table({"n": ["x"], "top": [1.0]})))
    with pytest.raises(InvalidArgumentError, match="does not fit the declared state"):
        feed(op, [1], ["a"])
    op = operator(lambda b: [1, 2])
    with pytest.raises(InvalidArgumentError, match="returned list"):
        feed(op, [1], ["a"])
    stage = keyed_state_stage(("k",), lambda b: b.set_timer(5), TOP, None, "event", False)
    with pytest.raises(InvalidArgumentError, match="event-time timers need event time"):
        KeyedStateOperator(stage, None).process(pa.record_batch({"k": ["a"]}))
    with pytest.raises(InvalidArgumentError, match="pyarrow schema"):
        Pipeline().read_from(GeneratorSource(total=1)).group_by("key").map_state(count_and_max, state={})
    with pytest.raises(InvalidArgumentError, match="ttl_in"):
        Pipeline().read_from(GeneratorSource(total=1)).group_by("key").map_state(
            count_and_max, state=TOP, ttl=1, ttl_in="wall")
    no_time = (Pipeline().read_from(GeneratorSource(total=1)).group_by("key")
               .map_state(count_and_max, state=TOP, ttl=5).write_to(TransactionalFileSink("/tmp/x")))
    with pytest.raises(InvalidArgumentError, match="needs event time"):
        no_time.plan()


# -- jobs ----------------------------------------------------------------------------------


def final_counts(out) -> pd.DataFrame:
    t = TransactionalFileSink.read(out).to_pandas()
    return t.sort_values("n").drop_duplicates("key", keep="last").sort_values("key").reset_index(drop=True)


def reference_counts(source) -> pd.DataFrame:
    e = source.events(0, source.total).to_pandas()
    g = e.groupby("key")["value"]
    return pd.DataFrame({"n": g.count(), "top": g.max()}).reset_index()


def state_job(source, out, **config):
    pipeline = (Pipeline().read_from(source).group_by("key").map_state(count_and_max, state=TOP)
                .write_to(TransactionalFileSink(out)))
    return Job(pipeline, JobConfig(**config))


@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once", "none"])
def test_map_state_job_matches_pandas(tmp_path, guarantee):
    source = GeneratorSource(total=120_000, partitions=4, keys=2_000, batch_size=5_000, rate=300_000)
    job = state_job(source, tmp_path / "out", name=f"state-{guarantee}", processing_guarantee=guarantee,
                    snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05, local_parallelism=2)
    job.run(isolated=False)
    got, want = final_counts(tmp_path / "out"), reference_counts(source)
    assert got[["key", "n", "top"]].equals(want[["key", "n", "top"]])


@pytest.mark.slow
@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_map_state_job_survives_kill_9(tmp_path, guarantee):
    source = GeneratorSource(total=300_000, partitions=4, keys=2_000, rate=120_000, batch_size=5_000)
    job = state_job(source, tmp_path / "out", name=f"state-kills-{guarantee}",
                    processing_guarantee=guarantee, snapshot_store=str(tmp_path / "snaps"),
                    snapshot_interval=0.2, local_parallelism=2, max_restarts=20, restart_backoff=0.05)
    run_with_kills(job, 3, seed=5)
    got, want = final_counts(tmp_path / "out"), reference_counts(source)
    rows = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    assert got["key"].tolist() == want["key"].tolist()
    assert np.array_equal(got["top"].to_numpy(), want["top"].to_numpy())
    if guarantee == "exactly-once":
        assert np.array_equal(got["n"].to_numpy(), want["n"].to_numpy())
        assert not rows.duplicated(["key", "n"]).any(), "a batch's update was committed twice"
    else:
        assert (got["n"].to_numpy() >= want["n"].to_numpy()).all()


def test_map_state_rescales_after_a_kill(tmp_path):
    source = GeneratorSource(total=200_000, partitions=4, keys=3_000, rate=60_000, batch_size=4_000)

    def job(parallelism):
        return state_job(source, tmp_path / "out", name="state-rescale",
                         snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.1,
                         local_parallelism=parallelism, max_restarts=0)

    run_killed_once(job(2), tmp_path / "snaps", after=3)
    result = job(3).run()
    assert result.executions[0]["restored_from"] is not None
    got, want = final_counts(tmp_path / "out"), reference_counts(source)
    assert got[["key", "n", "top"]].equals(want[["key", "n", "top"]])


# -- a broadcast input: every processor sees every row ------------------------------------

def test_broadcast_rows_reach_the_function_and_upsert_by_key():
    seen = []

    def fn(b):
        seen.append(None if b.broadcast is None else b.broadcast.to_pylist())
        return None

    stage = keyed_state_stage(("k",), fn, TOP, None, "event", False, True, "rule")
    op = KeyedStateOperator(stage, None)

    def rules(rule, limit):
        op.process(pa.record_batch({"rule": rule, "limit": limit,
                                    "__ordinal": pa.array([1] * len(rule), pa.int8())}))

    def event(k):
        op.process(pa.record_batch({"k": [k], "value": [1.0], "__ordinal": pa.array([0], pa.int8())}))

    event("a")
    rules(["x", "y"], [1, 2])
    event("a")
    rules(["y", "z", "x"], [3, 4, 5])
    event("b")
    assert seen == [None, [{"rule": "x", "limit": 1}, {"rule": "y", "limit": 2}],
                    [{"rule": "y", "limit": 3}, {"rule": "z", "limit": 4}, {"rule": "x", "limit": 5}]]
    other = KeyedStateOperator(stage, None)
    other.restore_broadcast(op.snapshot_broadcast())
    assert other.broadcast.equals(op.broadcast)


RULES = 2_000


def counts_with_rules(b):
    """Counts each key's events; at the end of time (a timer), emits the count beside how
    many broadcast rows this processor had received, and their ids' sum."""
    if b.rows is None:
        n_rules = 0 if b.broadcast is None else b.broadcast.num_rows
        ids = 0 if b.broadcast is None else pc.sum(b.broadcast["id"]).as_py()
        return pa.table({"key": b.keys["key"], "n": b.state["n"],
                         "rules": pa.array([n_rules] * len(b), pa.int64()),
                         "rule_ids": pa.array([ids] * len(b), pa.int64())}), None
    b.set_timer(MAX_TIME - 1)
    return None, {"n": np.diff(b.offsets) + b.state["n"].fill_null(0).to_numpy(),
                  "top": np.zeros(len(b))}


def broadcast_job(tmp_path, name, guarantee="exactly-once", parallelism=2, rate=100_000, **kw):
    events = GeneratorSource(total=200_000, partitions=4, keys=300, rate=rate, batch_size=4_000)
    rules = GeneratorSource(total=RULES, partitions=2, keys=10, rate=rate and rate / 100,
                            batch_size=50, seed=5)
    p = (Pipeline().read_from(events).with_timestamps("id").group_by("key")
         .map_state(counts_with_rules, state=TOP, event_time=True,
                    broadcast=Pipeline().read_from(rules).with_timestamps("id"))
         .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name=name, processing_guarantee=guarantee, local_parallelism=parallelism,
                       snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.1, **kw)
    want = events.events(0, 200_000).to_pandas().groupby("key").size()
    return Job(p, config), want


def check_broadcast_output(out, want, exact: bool):
    got = TransactionalFileSink.read(out).to_pandas().sort_values("key").reset_index(drop=True)
    assert got["key"].tolist() == want.index.tolist(), "a key's end-of-time row is missing or twice"
    if exact:
        assert got["n"].tolist() == want.tolist()
        assert (got["rules"] == RULES).all() and (got["rule_ids"] == RULES * (RULES - 1) // 2).all()
    else:
        # At-least-once: a processor's state may already count events that the restored
        # sources replay (its snapshot is taken after theirs), so a count may exceed the
        # input's, never fall short of it.
        assert (got["n"].to_numpy() >= want.to_numpy()).all(), "an event's count was lost"
        assert (got["rules"] >= RULES).all()


def test_a_broadcast_stream_reaches_every_processor(tmp_path):
    job, want = broadcast_job(tmp_path, "broadcast", rate=None)
    job.run(isolated=False)
    check_broadcast_output(tmp_path / "out", want, exact=True)


def test_broadcast_state_rescales_after_a_kill(tmp_path):
    run_killed_once(broadcast_job(tmp_path, "broadcast-rescale", rate=60_000, max_restarts=0)[0],
                    tmp_path / "snaps", after=3)
    job, want = broadcast_job(tmp_path, "broadcast-rescale", parallelism=3, max_restarts=0)
    assert job.run().executions[0]["restored_from"] is not None
    check_broadcast_output(tmp_path / "out", want, exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_broadcast_state_survives_kill_9(tmp_path, guarantee):
    job, want = broadcast_job(tmp_path, f"broadcast-kills-{guarantee}", guarantee,
                              max_restarts=20, restart_backoff=0.05)
    run_with_kills(job, 3, seed=13)
    check_broadcast_output(tmp_path / "out", want, exact=guarantee == "exactly-once")


# -- sessions with timers: keyed state and event-time timers together ----------------------

GAP = 400
SESSION = pa.schema([("start", pa.int64()), ("last", pa.int64()), ("n", pa.int64())])


def sessions(b):
    """Per key, sessions of events less than GAP apart; a session is emitted when an event
    GAP after it arrives, or when its timer (its last event + GAP) fires."""
    if b.rows is None:
        st = b.state
        b.delete()
        return pa.table({"key": b.keys["key"], "start": st["start"],
                         "end": pc.add(st["last"], GAP), "n": st["n"]}), None
    t = b.rows["id"].to_numpy()
    firsts = b.offsets[:-1]
    prev = np.empty_like(t)
    prev[1:] = t[:-1]
    old_last = b.state["last"].fill_null(np.iinfo(np.int64).min // 2).to_numpy()
    prev[firsts] = old_last
    new = t - prev >= GAP                                  # a row opening a new session
    # Sessions of this call: the rows of one key between openings; the first may continue
    # the key's open session (state), whose start and count carry over.
    starts = np.flatnonzero(new | np.isin(np.arange(len(t)), firsts))
    key_of = b.group[starts]
    ends = np.append(starts[1:], len(t))
    start_t, last_t, n = t[starts], t[ends - 1], ends - starts
    cont = ~new[starts] & b.has_state[key_of]               # continues the stored session
    start_t = np.where(cont, b.state["start"].fill_null(0).to_numpy()[key_of], start_t)
    n = np.where(cont, n + b.state["n"].fill_null(0).to_numpy()[key_of], n)
    last_of_key = np.append(key_of[1:] != key_of[:-1], True)
    # a stored session closed by this call's first row
    closed_old = b.has_state & new[firsts]
    out = [pa.table({"key": b.keys["key"].filter(pa.array(closed_old)),
                     "start": b.state["start"].filter(pa.array(closed_old)),
                     "end": pa.array(old_last[closed_old] + GAP),
                     "n": b.state["n"].filter(pa.array(closed_old))})]
    done = ~last_of_key
    out.append(pa.table({"key": b.keys["key"].take(pa.array(key_of[done])), "start": start_t[done],
                         "end": last_t[done] + GAP, "n": n[done]}))
    open_ = np.flatnonzero(last_of_key)
    b.set_timer(last_t[open_] + GAP)
    return pa.concat_tables(out), pa.table({"start": start_t[open_], "last": last_t[open_], "n": n[open_]})


def per_partition_keys(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Each key in one source partition (4), so its events arrive in id order."""
    key = pc.add(pc.multiply(batch["key"], 4), pc.bit_wise_and(batch["id"], 3))
    return batch.set_column(batch.schema.get_field_index("key"), "key", key)


def reference_key_sessions(source) -> pd.DataFrame:
    e = pa.Table.from_batches([per_partition_keys(b) for b in
                               source.events(0, source.total).to_batches()]).to_pandas()
    e = e.sort_values(["key", "id"])
    new = (e["key"] != e["key"].shift()) | (e["id"] - e["id"].shift() >= GAP)
    g = e.assign(session=new.cumsum()).groupby(["key", "session"])["id"]
    out = pd.DataFrame({"start": g.min(), "end": g.max() + GAP, "n": g.count()}).reset_index()
    return out.drop(columns="session").sort_values(["key", "start"]).reset_index(drop=True)


def session_job(source, out, **config):
    pipeline = (Pipeline().read_from(source).map_batches(per_partition_keys).with_timestamps("id")
                .group_by("key").map_state(sessions, state=SESSION, event_time=True)
                .write_to(TransactionalFileSink(out)))
    return Job(pipeline, JobConfig(**config))


def committed_sessions(out) -> pd.DataFrame:
    t = TransactionalFileSink.read(out).to_pandas()
    return t.sort_values(["key", "start"]).reset_index(drop=True)


def test_sessions_with_timers_match_pandas(tmp_path):
    source = GeneratorSource(total=100_000, partitions=4, keys=300, batch_size=3_000, rate=300_000)
    session_job(source, tmp_path / "out", name="sessions", snapshot_store=str(tmp_path / "snaps"),
                snapshot_interval=0.05, local_parallelism=2).run(isolated=False)
    got, want = committed_sessions(tmp_path / "out"), reference_key_sessions(source)
    assert got[["key", "start", "end", "n"]].equals(want[["key", "start", "end", "n"]])


@pytest.mark.slow
def test_sessions_with_timers_survive_kill_9(tmp_path):
    source = GeneratorSource(total=240_000, partitions=4, keys=300, rate=100_000, batch_size=4_000)
    job = session_job(source, tmp_path / "out", name="sessions-kills",
                      snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.2,
                      local_parallelism=2, max_restarts=20, restart_backoff=0.05)
    run_with_kills(job, 3, seed=9)
    got, want = committed_sessions(tmp_path / "out"), reference_key_sessions(source)
    assert got[["key", "start", "end", "n"]].equals(want[["key", "start", "end", "n"]])


def test_map_stateful_per_row(tmp_path):
    class Running:                    # local: kept by its attributes, not its name
        def __init__(self):
            self.n = 0

    def step(state, key, row):
        state.n += 1
        return {"key": key, "n": state.n} if state.n % 10 == 0 else None

    source = GeneratorSource(total=20_000, partitions=2, keys=50, batch_size=2_000)
    pipeline = (Pipeline().read_from(source).group_by("key").map_stateful(Running, step)
                .write_to(TransactionalFileSink(tmp_path / "out")))
    Job(pipeline, JobConfig(name="per-row", snapshot_store=str(tmp_path / "snaps"),
                            local_parallelism=2)).run(isolated=False)
    got = TransactionalFileSink.read(tmp_path / "out").to_pandas().groupby("key")["n"].max()
    want = source.events(0, 20_000).to_pandas().groupby("key").size() // 10 * 10
    assert got.sort_index().equals(want[want > 0].sort_index().rename("n"))


# -- deduplication -------------------------------------------------------------------------


def dedup_operator(within, keys=("k",)):
    return DeduplicateOperator(DeduplicateStage(keys, within), "t")


def dedup(op, t, k):
    outs, late = op.process(pa.record_batch({"t": pa.array(t, pa.int64()), "k": k}))
    passed = pa.Table.from_batches(outs).to_pylist() if outs else []
    return [(r["t"], r["k"]) for r in passed], ([] if late is None else late["t"].to_pylist())


def test_dedup_passes_the_first_within_the_span():
    op = dedup_operator(10)
    assert dedup(op, [1, 2, 3, 3], ["a", "b", "a", "c"]) == ([(1, "a"), (2, "b"), (3, "c")], [])
    assert dedup(op, [10, 11, 12], ["a", "a", "b"]) == ([(11, "a"), (12, "b")], [])   # 1 + 10 <= 11
    assert dedup(op, [5, 30, 45], ["z", "z", "z"]) == ([(5, "z"), (30, "z"), (45, "z")], [])
    op.advance(25)                               # a (11), b (2), c (3) evicted; z (45) kept
    assert len(op) == 1
    assert dedup(op, [24, 26, 27], ["a", "a", "z"]) == ([(26, "a")], [24])   # 24: behind
    restored = dedup_operator(10)
    restored.restore(op.snapshot(), 25)
    assert dedup(restored, [30, 36], ["a", "a"]) == ([(36, "a")], [])


@pytest.mark.parametrize("key_type", [pa.int64(), pa.uint64(), pa.string()])
def test_dedup_memory_stays_bounded(key_type):
    op = dedup_operator(1_000)
    for step in range(60):
        t = np.arange(step * 5_000, (step + 1) * 5_000)
        dedup(op, t, pa.array(t).cast(key_type))
        op.advance(int(t[-1]))
    assert len(op) <= 1_001 and op.held < 150_000


def reference_dedup(rows, within):
    """Row by row: (t, k) passes when k is new or t >= the time that passed + within."""
    passed, out = {}, []
    for t, k in rows:
        if k not in passed or t >= passed[k] + within:
            passed[k] = t
            out.append((t, k))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_dedup_native_and_general_paths_agree_with_a_row_by_row_reference(seed):
    """Integer keys take the native map, string keys the slot path: both must pass exactly
    the rows a plain row-by-row loop passes, across watermarks, snapshots and restores."""
    rng = np.random.default_rng(seed)
    within, t0, rows = 50, 0, []
    ops = {"int": dedup_operator(within), "str": dedup_operator(within)}
    got = {"int": [], "str": []}
    for step in range(40):
        n = int(rng.integers(1, 400))
        t = np.sort(t0 + rng.integers(0, 40, n))     # in order; no event behind the watermark
        k = rng.integers(-30, 30, n) * int(rng.choice([1, 1 << 40]))
        rows += list(zip(t.tolist(), k.tolist()))
        for name, op in ops.items():
            keys = pa.array(k) if name == "int" else pa.array([str(x) for x in k])
            passed, late = dedup(op, t, keys)
            assert late == []
            got[name] += [(a, int(b)) for a, b in passed]
        t0 = int(t[-1])
        wm = t0 - 5
        for name in ops:
            ops[name].advance(wm)
        if step % 7 == 3:                            # a snapshot restored into a new operator
            for name in ops:
                fresh = dedup_operator(within)
                fresh.restore(ops[name].snapshot(), wm)
                ops[name] = fresh
    want = reference_dedup(rows, within)
    assert got["int"] == want
    assert got["str"] == want


def with_repeats(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``uid``: the id, except that one event in eight repeats the one before it."""
    ids = batch["id"]
    uid = pc.if_else(pc.equal(pc.bit_wise_and(ids, 7), 7), pc.subtract(ids, 1), ids)
    return batch.append_column("uid", uid)


def dedup_job(source, out, **config):
    pipeline = (Pipeline().read_from(source).map_batches(with_repeats).with_timestamps("id", max_lag=10)
                .deduplicate("uid", within=1_000).write_to(TransactionalFileSink(out)))
    return Job(pipeline, JobConfig(**config))


def reference_uids(source) -> np.ndarray:
    return np.unique(np.concatenate([with_repeats(b)["uid"].to_numpy()
                                     for b in source.events(0, source.total).to_batches()]))


@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once", "none"])
def test_dedup_job_matches_pandas(tmp_path, guarantee):
    source = GeneratorSource(total=100_000, partitions=4, keys=100, batch_size=4_000, rate=300_000)
    result = dedup_job(source, tmp_path / "out", name=f"dedup-{guarantee}", processing_guarantee=guarantee,
                       snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=2).run(isolated=False)
    uids = np.sort(TransactionalFileSink.read(tmp_path / "out")["uid"].to_numpy())
    assert np.array_equal(uids, reference_uids(source)) and result.late_events == 0


@pytest.mark.slow
@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_dedup_job_survives_kill_9(tmp_path, guarantee):
    source = GeneratorSource(total=300_000, partitions=4, keys=100, rate=120_000, batch_size=5_000)
    job = dedup_job(source, tmp_path / "out", name=f"dedup-kills-{guarantee}",
                    processing_guarantee=guarantee, snapshot_store=str(tmp_path / "snaps"),
                    snapshot_interval=0.2, local_parallelism=2, max_restarts=20, restart_backoff=0.05)
    run_with_kills(job, 3, seed=3)
    uids = TransactionalFileSink.read(tmp_path / "out")["uid"].to_numpy()
    want = reference_uids(source)
    if guarantee == "exactly-once":
        assert np.array_equal(np.sort(uids), want), "a uid lost or passed twice"
    else:
        assert np.array_equal(np.unique(uids), want), "a uid lost"


def test_dedup_rescales_after_a_kill(tmp_path):
    source = GeneratorSource(total=200_000, partitions=4, keys=100, rate=60_000, batch_size=4_000)

    def job(parallelism):
        return dedup_job(source, tmp_path / "out", name="dedup-rescale",
                         snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.1,
                         local_parallelism=parallelism, max_restarts=0)

    run_killed_once(job(2), tmp_path / "snaps", after=3)
    assert job(3).run().executions[0]["restored_from"] is not None
    uids = np.sort(TransactionalFileSink.read(tmp_path / "out")["uid"].to_numpy())
    assert np.array_equal(uids, reference_uids(source)), "a uid lost or passed twice"


def test_dedup_needs_event_time_and_keys():
    p = Pipeline().read_from(GeneratorSource(total=1))
    with pytest.raises(InvalidArgumentError, match="needs event time"):
        p.deduplicate("key", within=5).write_to(TransactionalFileSink("/tmp/x")).plan()
    with pytest.raises(InvalidArgumentError, match="column names"):
        p.deduplicate(within=5)
    with pytest.raises(InvalidArgumentError, match="within"):
        p.deduplicate("key", within=0)
