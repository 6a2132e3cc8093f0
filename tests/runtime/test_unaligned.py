"""Unaligned snapshots (JobConfig.alignment_timeout, issue 28 item 3).

The aligner's timeout path on both the native and the reference aligner: the snapshot comes
ahead of queued items once a barrier waited the timeout, the items each channel sent before
its barrier are captured as in flight (exactly those), and replayed afterwards before newer
ones; real producer threads with backpressure hold each snapshot to the exactly-once split.
Jobs under backpressure (a slow stage before the sink, in the sink's thread, and a hot key)
with real SIGKILLs of their member: the restore replays the stored items in flight, a restore
at another parallelism is refused, and every stateful operator loses and duplicates nothing
against a pandas reference."""
import random
import sys
import threading
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

# The jobs' functions live in this module, which a member process cannot import (tests/ is
# not on its path): they travel by value.
from pyspark import cloudpickle  # noqa: E402

from sparkjet import verify
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.runtime.aligner import (
    DONE,
    ITEM,
    SNAPSHOT,
    UNALIGNED,
    BarrierAligner,
    ReferenceAligner,
    TimeoutAligner,
)
from sparkjet.runtime.snapshotting import IN_FLIGHT_VERTEX
from sparkjet.sinks import TransactionalFileSink
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource
from sparkjet.testing.campaign import _count_and_sum  # the rolling count+sum's map_state
from sparkjet.windows import session, tumbling

cloudpickle.register_pickle_by_value(sys.modules[__name__])

IMPLS = {"native": BarrierAligner, "reference": ReferenceAligner}


@pytest.fixture(params=list(IMPLS))
def Aligner(request):
    return IMPLS[request.param]


def per_channel(pairs):
    out: dict = {}
    for c, x in pairs:
        out.setdefault(c, []).append(x)
    return out


# ------------------------------------------------------------------ the aligner


def test_before_the_timeout_it_aligns_as_before(Aligner):
    a = TimeoutAligner(Aligner(2, capacity=8), alignment_timeout=60)
    a.put(0, "a0")
    a.put_barrier(0, 0)
    a.put(0, "a1")
    a.put(1, "b0")
    assert [a.take(0), a.take(0), a.take(0)] == [(ITEM, 0, "a0"), (ITEM, 1, "b0"), None]
    a.put_barrier(1, 0)
    assert [a.take(0), a.take(0)] == [(SNAPSHOT, 0, False), (ITEM, 0, "a1")]
    assert a.in_flight == [] and list(a.unaligned) == []


def test_the_snapshot_goes_ahead_of_queued_items_and_captures_them(Aligner):
    a = TimeoutAligner(Aligner(2, capacity=16), alignment_timeout=0.05)
    for i in range(4):
        a.put(0, f"a{i}")
    a.put_barrier(0, 0)          # the timeout counts from here
    a.put(0, "a-after")          # sent after the barrier: not in flight
    for i in range(4):
        a.put(1, f"b{i}")
    assert a.take(0) == (ITEM, 0, "a0")
    time.sleep(0.06)
    # Seven items are still queued ahead of the barriers, one channel's has not even come:
    # the snapshot comes now, ahead of them.
    assert a.take(0) == (UNALIGNED, 0, False) and a.capturing == 0
    assert a.take(0.01) is None          # capturing until channel 1's barrier comes
    a.put(1, "b4")
    a.put_barrier(1, 0)
    a.put(1, "b-after")
    assert a.take(1) == (SNAPSHOT, 0, False) and a.capturing is None
    # exactly what each channel sent before its barrier and after the snapshot
    assert per_channel(a.in_flight) == {0: ["a1", "a2", "a3"], 1: ["b0", "b1", "b2", "b3", "b4"]}
    (record,) = a.unaligned
    assert record["snapshot_id"] == 0 and record["items"] == 8 and record["waited_s"] >= 0.05
    # replayed first, in the order taken, then what came after the barriers
    replayed = [a.take(0) for _ in range(8)]
    assert [(e[1], e[2]) for e in replayed] == a.in_flight
    assert sorted([a.take(0), a.take(0)]) == [(ITEM, 0, "a-after"), (ITEM, 1, "b-after")]
    assert a.take(0) is None


def test_an_announced_barrier_times_out_before_it_is_put(Aligner):
    """A producer whose queue is full announces the barrier first (Outbox.barrier): the
    timeout counts from then, and the capture drains the queue so that the barrier gets in."""
    a = TimeoutAligner(Aligner(1, capacity=2), alignment_timeout=0.02)
    a.put(0, "x0")
    a.put(0, "x1")
    a.announce(0)
    put = threading.Thread(target=a.put_barrier, args=(0, 0))
    put.start()                                  # waits for room
    time.sleep(0.03)
    assert a.take(0) == (UNALIGNED, 0, False)
    assert a.take(5) == (SNAPSHOT, 0, False) and a.in_flight == [(0, "x0"), (0, "x1")]
    put.join(5)


def test_captured_items_count_against_the_capacity(Aligner):
    """The captured items left the queue but not the processor: until they are replayed,
    the producer of their channel waits as if they were still queued (backpressure holds;
    else each unaligned snapshot would add a queue's worth of buffering)."""
    a = TimeoutAligner(Aligner(2, capacity=2), alignment_timeout=0)
    a.put(0, "x0")
    a.put(0, "x1")
    a.announce(0)
    assert a.take(0) == (UNALIGNED, 0, False)
    assert a.take(0.02) is None and a.queued(0) == 2   # captured, not replayed
    a.put(0, "x2", timeout=1)   # channel 0's barrier is not in yet: the capture needs x2
    a.put_barrier(0, 0)
    a.put_barrier(1, 0)
    assert a.take(1) == (SNAPSHOT, 0, False) and a.queued(0) == 3 and len(a) == 3
    with pytest.raises(TimeoutError):
        a.put(0, "y0", timeout=0.05)     # three of two taken: it waits
    assert a.offer(0, "y0") is False
    a.put(1, "z0", timeout=0.05)         # the other channel is not held back
    assert [a.take(0)[2] for _ in range(2)] == ["x0", "x1"]
    a.put(0, "y0", timeout=1)            # one left to replay: room for one
    assert [a.take(0)[2] for _ in range(3)] in (["x2", "y0", "z0"], ["x2", "z0", "y0"])


def test_a_terminal_barrier_is_always_aligned(Aligner):
    a = TimeoutAligner(Aligner(2, capacity=8), alignment_timeout=0)
    a.put(0, "a0")
    a.put_barrier(0, 3, terminal=True)
    a.put(1, "b0")
    assert [a.take(0), a.take(0), a.take(0.02)] == [(ITEM, 0, "a0"), (ITEM, 1, "b0"), None]
    a.put_barrier(1, 3, terminal=True)
    a.end(0)
    a.end(1)
    assert [a.take(0), a.take(0)] == [(SNAPSHOT, 3, True), (DONE,)]
    assert list(a.unaligned) == []


def _next_event(a):
    """The next event take(0) gives (while a capture takes items, take(0) hands back None
    after each: its timeout is up)."""
    for _ in range(100):
        event = a.take(0)
        if event is not None:
            return event
    return None


def test_a_timeout_during_the_replay_keeps_the_rest_in_flight(Aligner):
    a = TimeoutAligner(Aligner(1, capacity=16), alignment_timeout=0)
    for i in range(3):
        a.put(0, i)
    a.put_barrier(0, 0)
    assert a.take(0) == (UNALIGNED, 0, False)
    assert _next_event(a) == (SNAPSHOT, 0, False) and a.in_flight == [(0, 0), (0, 1), (0, 2)]
    assert a.take(0) == (ITEM, 0, 0)
    a.put(0, 3)
    a.put_barrier(0, 1)
    # items 1 and 2 were sent before barrier 0, so before barrier 1 too: in flight of 1
    assert a.take(0) == (UNALIGNED, 1, False)
    assert _next_event(a) == (SNAPSHOT, 1, False) and a.in_flight == [(0, 1), (0, 2), (0, 3)]
    assert [a.take(0)[2] for _ in range(3)] == [1, 2, 3] and a.take(0) is None


def test_restored_items_come_before_new_input(Aligner):
    a = TimeoutAligner(Aligner(2, capacity=8), alignment_timeout=1)
    a.put(0, "new")
    a.replay([(1, "old0"), (0, "old1")])
    assert [a.take(0) for _ in range(3)] == [(ITEM, 1, "old0"), (ITEM, 0, "old1"),
                                             (ITEM, 0, "new")]


def test_bad_arguments(Aligner):
    with pytest.raises(InvalidArgumentError, match="exactly-once"):
        TimeoutAligner(Aligner(1, mode="at-least-once"), 1)
    for bad in (-1, float("inf"), "1"):
        with pytest.raises(InvalidArgumentError, match="alignment_timeout"):
            TimeoutAligner(Aligner(1), bad)
    with pytest.raises(InvalidArgumentError, match="exactly-once"):
        JobConfig(snapshot_store="/tmp/x", processing_guarantee="at-least-once",
                  alignment_timeout=1.0)
    with pytest.raises(InvalidArgumentError, match="alignment_timeout"):
        JobConfig(snapshot_store="/tmp/x", alignment_timeout=-1.0)


@pytest.mark.parametrize("timeout", [0.0, 0.002, 0.02])
def test_threads_every_snapshot_splits_each_channel_at_its_barrier(Aligner, timeout):
    """Producer threads push numbered items with barriers (the coordinator's rule: barrier
    n + 1 after snapshot n); a consumer slower than them (backpressure on small rings)
    keeps, per channel, what it processed. At an unaligned snapshot n what it had processed
    plus what was in flight must be exactly what each channel sent before barrier n; at an
    aligned one, what it had processed. Every item comes out once, in order."""
    channels, items, every = 3, 3000, 250
    a = TimeoutAligner(Aligner(channels, capacity=4), alignment_timeout=timeout)
    done = threading.Condition()
    state = {"done": -1}
    errors = []

    def produce(c):
        try:
            for i in range(items):
                if i and i % every == 0:
                    n = i // every - 1
                    with done:
                        done.wait_for(lambda n=n: state["done"] >= n - 1, timeout=30)
                    a.put_barrier(c, n)
                a.put(c, (c, i))
            a.end(c)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(c,)) for c in range(channels)]
    for t in threads:
        t.start()
    processed = [0] * channels
    at_unaligned = None
    unaligned = 0
    rng = random.Random(7)
    while True:
        e = a.take(timeout=30)
        assert e is not None, "consumer starved"
        if e[0] == ITEM:
            c, (c2, i) = e[1], e[2]
            assert c == c2 and i == processed[c], "every item once, in order"
            processed[c] += 1
            if rng.random() < 0.02:
                time.sleep(0.001)      # slower than the producers: the rings fill
        elif e[0] == UNALIGNED:
            at_unaligned = list(processed)
        elif e[0] == SNAPSHOT:
            n = e[1]
            before = (n + 1) * every
            if at_unaligned is not None:
                unaligned += 1
                flight = per_channel(a.in_flight)
                for c in range(channels):
                    assert flight.get(c, []) == [(c, i) for i in range(at_unaligned[c], before)]
                at_unaligned = None
            else:
                assert processed == [before] * channels
            with done:
                state["done"] = n
                done.notify_all()
        elif e[0] == DONE:
            break
    for t in threads:
        t.join(10)
    assert not errors and processed == [items] * channels
    if timeout == 0:
        assert unaligned == items // every - 1  # every snapshot unaligned


# ------------------------------------------------------------------ jobs

HOT = 4         # one event in HOT has key 0


def hot_key(b: pa.RecordBatch) -> pa.RecordBatch:
    key = pc.if_else(pc.equal(pc.bit_wise_and(b["id"], HOT - 1), 0), 0, b["key"])
    return b.set_column(b.schema.get_field_index("key"), "key", key)


def slow(b: pa.RecordBatch) -> pa.RecordBatch:
    """Before the sink, in its thread: a sink slower than the input."""
    time.sleep(2e-3 + b.num_rows * 3e-6)
    return b


def _with_uid(b):
    ids = b["id"]
    return b.append_column("uid", pc.if_else(pc.equal(pc.bit_wise_and(ids, 7), 7),
                                             pc.subtract(ids, 1), ids))


BETWEEN = (-100, 60)


def _pairs(b):
    left, right = b["id"], b["id_right"]
    pair = pc.add(pc.multiply(left, 4096), pc.subtract(pc.subtract(right, left), BETWEEN[0]))
    return pa.record_batch({"pair": pair, "id": left})


TUMBLING, GAP = 2_000, 400
COUNT_SUM = pa.schema([("count", pa.int64()), ("sum", pa.float64())])


KINDS = ["rolling", "map_state", "tumbling", "session", "dedup", "join"]


def branch(kind: str, root, out):
    """One stateful operator on the hot-keyed events, through the slow stage into its sink."""
    if kind == "rolling":
        p = root.group_by("key").aggregate(count="count", sum=("sum", "value"))
    elif kind == "map_state":
        p = root.group_by("key").map_state(_count_and_sum, state=COUNT_SUM)
    elif kind == "tumbling":
        p = root.group_by("key").window(tumbling(TUMBLING)).aggregate(count="count",
                                                                       sum=("sum", "value"))
    elif kind == "session":
        p = root.group_by("key").window(session(GAP)).aggregate(count="count",
                                                                 sum=("sum", "value"))
    elif kind == "dedup":
        p = (root.map_batches(_with_uid).deduplicate("uid", within=10_000)
             .map_batches(lambda b: b.select(["uid", "id"])))
    else:
        left, right = root.filter(pc.field("value") < 600), root.filter(pc.field("value") >= 400)
        p = left.join_interval(right, on="key", between=BETWEEN).map_batches(_pairs)
    return p.map_batches(slow).write_to(TransactionalFileSink(out / kind))


def pipeline_of(source, out, kinds=KINDS):
    """Every stateful operator, each a branch of one source with a hot key, each into a
    slow sink of its own."""
    root = Pipeline().read_from(source).with_timestamps("id", max_lag=10).map_batches(hot_key)
    return Pipeline.all(*(branch(kind, root, out) for kind in kinds))


def events_of(source) -> pd.DataFrame:
    e = source.events(0, source.total).to_pandas()
    e.loc[e["id"] % HOT == 0, "key"] = 0
    return e


def join_pairs(left: pd.DataFrame, right: pd.DataFrame) -> np.ndarray:
    """The pairs of the interval join, per key by binary search (a merge on the key would
    build the hot key's whole cross product)."""
    rights = {k: np.sort(g["id"].to_numpy()) for k, g in right.groupby("key")}
    out = []
    for k, g in left.groupby("key"):
        rid = rights.get(k)
        if rid is None:
            continue
        lid = g["id"].to_numpy()
        lo = np.searchsorted(rid, lid + BETWEEN[0], "left")
        hi = np.searchsorted(rid, lid + BETWEEN[1], "right")
        n = hi - lo
        at = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(n.sum())
        lids = np.repeat(lid, n)
        out.append(lids * 4096 + (rid[at] - lids - BETWEEN[0]))
    return np.concatenate(out) if out else np.array([], np.int64)


def check(kind: str, source, out) -> None:
    """Exactly-once against pandas: nothing lost, nothing duplicated."""
    got = TransactionalFileSink.read(out / kind)
    e = events_of(source)
    if kind in ("rolling", "map_state"):
        g = e.groupby("key")["value"]
        want = pd.DataFrame({"count": g.count(), "sum": g.sum()}).reset_index()
        report = verify.check_aggregates(pa.Table.from_pandas(want, preserve_index=False),
                                         verify.last_update_per_key(got), key="key",
                                         columns=["count", "sum"], guarantee="exactly-once")
        assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, \
            str(report)
        return
    if kind in ("tumbling", "session"):
        if kind == "tumbling":
            e = e.assign(window_start=e["id"] // TUMBLING * TUMBLING)
        else:
            e = e.sort_values(["key", "id"])
            new = (e["key"] != e["key"].shift()) | (e["id"] - e["id"].shift() >= GAP)
            e = e.assign(session=new.cumsum())
            e["window_start"] = e.groupby("session")["id"].transform("min")
        g = e.groupby(["key", "window_start"])["value"]
        want = pd.DataFrame({"count": g.count(), "sum": g.sum()}).reset_index()
        got = got.to_pandas()[["key", "window_start", "count", "sum"]]
        dup = int(got.duplicated(["key", "window_start"]).sum())
        assert dup == 0, f"{dup} windows emitted twice"
        merged = want.merge(got, on=["key", "window_start"], how="outer", indicator=True,
                            suffixes=("", "_got"))
        lost = merged[merged["_merge"] == "left_only"]
        extra = merged[merged["_merge"] == "right_only"]
        assert len(lost) == 0 and len(extra) == 0, (lost.head(), extra.head())
        assert (merged["count"] == merged["count_got"]).all()
        assert np.allclose(merged["sum"], merged["sum_got"])
        return
    if kind == "dedup":
        ids = e["id"].to_numpy()
        wanted = pa.array(ids[ids % 8 != 7])
        column = "uid"
    else:
        wanted = pa.array(join_pairs(e[e["value"] < 600], e[e["value"] >= 400]))
        column = "pair"
    report = verify.check_events(wanted, wanted, got.column(column), guarantee="exactly-once")
    assert report.lost_count == 0 and report.duplicated_count == 0 and report.valid, str(report)


def config_of(tmp_path, name: str, **over) -> JobConfig:
    return JobConfig(**{**dict(name=f"{name}-{tmp_path.name}",
                               snapshot_store=str(tmp_path / "snapshots"),
                               snapshot_interval=0.1, local_parallelism=2,
                               alignment_timeout=0.0, retained_snapshots=100,
                               restart_backoff=0.0, max_restarts=10), **over})


def in_flight_items(store: SnapshotStore, snapshot_id: int) -> int:
    """How many batches and watermarks snapshot ``snapshot_id`` holds in flight."""
    try:
        entries = store.restore(IN_FLIGHT_VERTEX, [], snapshot_id=snapshot_id).broadcast_entries
    except Exception:  # noqa: BLE001 - SnapshotNotFoundError: an aligned snapshot
        return 0
    return sum(1 for k in entries[0].to_pylist() if k.count(b"/") == 2)


def run_killed_after_unaligned(job: Job, store: SnapshotStore, kills: int):
    """Runs ``job`` while a thread SIGKILLs its member right after a complete snapshot
    that holds items in flight (a newer one each time), ``kills`` times: each restart
    restores from such a snapshot (the snapshots it kills after go to ``job.killed_at``).
    Returns the run's result (or raises its failure)."""
    import os
    import signal

    stop = threading.Event()
    job.killed_at = []

    def kill():
        while not stop.is_set() and len(job.killed_at) < kills:
            latest = store.latest_complete()
            if (latest is not None and job.member_pid
                    and latest.snapshot_id not in job.killed_at
                    and in_flight_items(store, latest.snapshot_id)):
                try:
                    os.kill(job.member_pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                job.killed_at.append(latest.snapshot_id)
            time.sleep(0.01)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        return job.run()
    finally:
        stop.set()
        killer.join()


def test_every_stateful_operator_is_exactly_once_under_backpressure_and_kills(tmp_path):
    """Rolling aggregate, tumbling and session windows, map_state, deduplication and the
    interval join, each behind a hot key and before a slow sink, unaligned at once
    (``alignment_timeout=0``). The member is SIGKILLed right after a snapshot that holds
    items in flight; a restore at another parallelism is refused with a clear error; at
    the same one the job restores (replaying those items), is killed the same way once
    more, and finishes: nothing lost, nothing duplicated, against pandas. Without the
    replay the restores lose rows."""
    source = GeneratorSource(total=30_000, partitions=4, keys=2_000, rate=30_000,
                             batch_size=1_000, seed=5)
    out = tmp_path / "out"
    config = config_of(tmp_path, "unaligned", max_restarts=0)
    store = SnapshotStore(str(tmp_path / "snapshots"), config.id)
    job = Job(pipeline_of(source, out), config)
    with pytest.raises(JobFailedError, match="SIGKILL"):
        run_killed_after_unaligned(job, store, kills=1)
    assert job.killed_at, "no snapshot held items in flight before the job ended"
    with pytest.raises(JobFailedError, match="InFlightRescaleError.*same parallelism"):
        Job(pipeline_of(source, out),
            config_of(tmp_path, "unaligned", local_parallelism=3, max_restarts=0)).run()
    job = Job(pipeline_of(source, out), config_of(tmp_path, "unaligned", max_restarts=3))
    result = run_killed_after_unaligned(job, store, kills=1)
    assert len(job.killed_at) == 1 and result.restarts == 1
    # (a killed execution reports no metrics: the restore after the last kill does)
    restored = [e["restored_from"] for e in result.executions
                if e.get("restored_from") is not None]
    assert restored and in_flight_items(store, restored[-1]), restored
    for kind in KINDS:
        check(kind, source, out)


def test_a_smaller_parallelism_is_refused_when_only_a_vanished_processor_held_items():
    """Only processor 2 of 3 held items in flight; restored at parallelism 2, processors 0
    and 1 have no entry of their own: the restore is still refused (it returned nothing
    for both, and processor 2's items were lost, before)."""
    import json
    from types import SimpleNamespace

    from sparkjet.errors import InFlightRescaleError
    from sparkjet.runtime.snapshotting import in_flight_of

    entries = {"agg/2": json.dumps({"parallelism": 3, "channels": 3,
                                    "items": [[0, "w", 5, 0]]}).encode()}
    topology = SimpleNamespace(parallelism={"agg": 2}, channels={"agg": 2})
    for index in (0, 1):
        processor = SimpleNamespace(vertex=SimpleNamespace(name="agg"), index=index)
        with pytest.raises(InFlightRescaleError, match="processor 2, taken at parallelism 3"):
            in_flight_of(entries, "agg", processor, topology)
    # at the same layout, a processor without items of its own replays nothing
    same = SimpleNamespace(parallelism={"agg": 3}, channels={"agg": 3})
    processor = SimpleNamespace(vertex=SimpleNamespace(name="agg"), index=0)
    assert in_flight_of(entries, "agg", processor, same) == []


def test_take_keeps_its_timeout_while_a_capture_takes_items(Aligner):
    """While a capture runs and items keep coming, take(timeout) still returns (None) once
    its time is up instead of capturing until the last barrier: the processor's loop has
    phase 2 of the last snapshot, stop requests and a failed member to see to."""
    a = TimeoutAligner(Aligner(2, capacity=64), alignment_timeout=0)
    for i in range(10):
        a.put(1, f"x{i}")
    a.announce(0)
    a.put_barrier(0, 0)             # channel 1's barrier is still behind its items
    assert a.take(0) == (UNALIGNED, 0, False)
    assert a.take(0) is None        # one item captured, then back to the caller
    assert a.aligner.queued(1) == 9
