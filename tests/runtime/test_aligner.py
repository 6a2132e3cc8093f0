"""BarrierAligner: every behaviour against both the native aligner and the pure-Python
ReferenceAligner; hypothesis over random interleavings of pushes and takes (native and
reference in lockstep, event for event, and the exactly-once / at-least-once promises
checked on the events); real producer threads with backpressure; errors, timeouts,
close, statistics and reference counts."""
import gc
import math
import random
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjet.errors import InvalidArgumentError, SparkjetError
from sparkjet.runtime.aligner import (
    BURST,
    DONE,
    FAULT_OTHER_ID,
    FAULT_SECOND,
    FAULT_TERMINAL,
    FAULT_UNEXPECTED_ID,
    ITEM,
    SNAPSHOT,
    AlignerClosedError,
    BarrierAligner,
    BarrierError,
    ReferenceAligner,
)

IMPLS = {"native": BarrierAligner, "reference": ReferenceAligner}
MODES = ("exactly-once", "at-least-once")
SETTINGS = settings(max_examples=250, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(params=list(IMPLS))
def Aligner(request):
    return IMPLS[request.param]


def items_of(events):
    return [e for e in events if e[0] == ITEM]


# ------------------------------------------------------------------ configuration


def test_config_repr_and_len(Aligner):
    a = Aligner(3, mode="at-least-once", capacity=5)
    assert (a.channels, a.mode, a.capacity) == (3, "at-least-once", 5)
    assert repr(a) == f"{Aligner.__name__}(channels=3, mode='at-least-once', capacity=5)"
    assert len(a) == 0 and a.live == 3 and a.expected is None and a.aligning is None
    assert not a.closed and a.alignments == []
    a.offer(0, "x")
    a.offer_barrier(1, 4)
    a.end(2)
    assert len(a) == 3 and [a.queued(c) for c in range(3)] == [1, 1, 1]
    assert Aligner(1).mode == "exactly-once" and Aligner(1).capacity == 1024


@pytest.mark.parametrize("kwargs, word", [
    ({"channels": 0}, "channels"),
    ({"channels": 65537}, "channels"),
    ({"channels": 2, "mode": "exactly_once"}, "mode"),
    ({"channels": 2, "capacity": 0}, "capacity"),
    ({"channels": 2, "capacity": -5}, "capacity"),
    ({"channels": 2, "capacity": 2**31}, "capacity"),
    ({"channels": 2, "history": -1}, "history"),
])
def test_bad_config(Aligner, kwargs, word):
    with pytest.raises(InvalidArgumentError, match=word):
        Aligner(**kwargs)


def test_bad_channel_and_arguments(Aligner):
    a = Aligner(2, capacity=4)
    for call in (lambda: a.offer(2, 1), lambda: a.put(-1, 1), lambda: a.offer_many(5, [1]),
                 lambda: a.put_many(2, [1]), lambda: a.offer_barrier(2, 0),
                 lambda: a.put_barrier(3, 0), lambda: a.end(2), lambda: a.queued(7)):
        with pytest.raises(InvalidArgumentError, match=r"channel -?\d+ out of range.*0\.\.1"):
            call()
    with pytest.raises(InvalidArgumentError, match="snapshot id -1"):
        a.offer_barrier(0, -1)
    with pytest.raises(InvalidArgumentError, match="snapshot id"):
        a.put_barrier(0, 2**62)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        a.put(0, 1, timeout=-1)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        a.take(timeout=math.nan)
    with pytest.raises(InvalidArgumentError, match="max_events"):
        a.drain(-1)
    with pytest.raises(InvalidArgumentError, match="snapshot id"):
        a.expect(-3)
    assert a.drain(0) == [] and len(a) == 0  # nothing was pushed by the failed calls
    a.put(0, "x")
    with pytest.raises(InvalidArgumentError, match="timeout"):
        a.take(timeout=-0.5)  # checked even when an event is there
    assert a.take(timeout=0) == (ITEM, 0, "x")
    a.end(1)
    for call in (lambda: a.offer(1, "x"), lambda: a.put_barrier(1, 0), lambda: a.end(1),
                 lambda: a.offer_many(1, ["x"])):
        with pytest.raises(InvalidArgumentError, match="channel 1 has ended"):
            call()


# ------------------------------------------------------------------ alignment


def test_exactly_once_holds_channels(Aligner):
    a = Aligner(3, capacity=16)
    for x in ("a0", "a1"):
        a.put(0, x)
    a.put_barrier(0, 7)
    a.put(0, "a2")
    a.put(1, "b0")
    a.put_barrier(1, 7)
    a.put(1, "b1")
    for x in ("c0", "c1", "c2"):
        a.put(2, x)
    assert a.drain(100) == [(ITEM, 0, "a0"), (ITEM, 0, "a1"), (ITEM, 1, "b0"),
                            (ITEM, 2, "c0"), (ITEM, 2, "c1"), (ITEM, 2, "c2")]
    assert a.poll() is None and a.aligning == 7 and a.expected is None
    a.put_barrier(2, 7)
    a.put(2, "c3")
    assert a.drain(100) == [(SNAPSHOT, 7, False), (ITEM, 2, "c3"), (ITEM, 0, "a2"),
                            (ITEM, 1, "b1")]
    assert a.aligning is None and a.expected == 8


def test_at_least_once_keeps_draining(Aligner):
    a = Aligner(2, mode="at-least-once")
    a.put(0, "a0")
    a.put_barrier(0, 3)
    a.put(0, "a1")
    a.put(1, "b0")
    assert a.drain(10) == [(ITEM, 0, "a0"), (ITEM, 0, "a1"), (ITEM, 1, "b0")]
    a.put_barrier(1, 3)
    a.put(1, "b1")
    assert a.drain(10) == [(SNAPSHOT, 3, False), (ITEM, 1, "b1")]
    assert a.alignments[-1]["blocking"] is False


def test_terminal_barrier_aligns_in_at_least_once(Aligner):
    a = Aligner(2, mode="at-least-once")
    a.put_barrier(0, 0, terminal=True)
    a.put(0, "after")
    a.put(1, "b0")
    assert a.drain(10) == [(ITEM, 1, "b0")]
    a.put_barrier(1, 0, terminal=True)
    assert a.drain(10) == [(SNAPSHOT, 0, True), (ITEM, 0, "after")]
    record = a.alignments[-1]
    assert record["terminal"] is True and record["blocking"] is True


@pytest.mark.parametrize("mode", MODES)
def test_ended_channels_stop_counting(Aligner, mode):
    a = Aligner(3, mode=mode)
    a.put_barrier(0, 0)
    a.put(1, "b0")
    a.end(1)
    assert a.drain(10) == [(ITEM, 1, "b0")]  # channel 2 is live and owes barrier 0
    assert a.live == 2
    a.end(2)
    assert a.take(timeout=1) == (SNAPSHOT, 0, False)
    assert set(a.alignments[-1]["held"]) == {0}
    a.put(0, "a1")
    a.end(0)
    assert a.drain(10) == [(ITEM, 0, "a1"), (DONE,)]
    # DONE again, from every call, without blocking.
    assert a.poll() == (DONE,) and a.take() == (DONE,) and a.drain(5) == [(DONE,)]
    assert a.live == 0


def test_barrier_then_end_in_at_least_once(Aligner):
    a = Aligner(2, mode="at-least-once")
    a.put_barrier(0, 5)
    a.end(0)
    a.put(1, "b0")
    assert a.drain(10) == [(ITEM, 1, "b0")]  # channel 1 still owes barrier 5
    a.put_barrier(1, 5)
    a.end(1)
    assert a.drain(10) == [(SNAPSHOT, 5, False), (DONE,)]
    assert set(a.alignments[-1]["held"]) == {0, 1}


def test_burst_alternates_channels(Aligner):
    a = Aligner(2, capacity=4 * BURST)
    a.put_many(0, [("a", i) for i in range(2 * BURST)])
    a.put_many(1, [("b", i) for i in range(BURST)])
    channels = [e[1] for e in a.drain(1000)]
    assert channels == [0] * BURST + [1] * BURST + [0] * BURST


FAULTS = [
    # (mode, pushes as (channel, snapshot_id, terminal), fault, channel, id, expected)
    ("exactly-once", [(1, 3, False)], FAULT_UNEXPECTED_ID, 1, 3, 5),  # after expect(5)
    ("exactly-once", [(0, 2, False), (1, 4, False)], FAULT_OTHER_ID, 1, 4, 2),
    ("at-least-once", [(0, 2, False), (0, 3, False)], FAULT_SECOND, 0, 3, 2),
    ("at-least-once", [(0, 2, True), (1, 2, False)], FAULT_TERMINAL, 1, 2, 2),
    ("exactly-once", [(0, 2, False), (1, 2, False), (0, 4, False)], FAULT_UNEXPECTED_ID, 0, 4, 3),
]


@pytest.mark.parametrize("mode, pushes, fault, channel, snapshot_id, expected", FAULTS)
def test_unexpected_barriers_raise(Aligner, mode, pushes, fault, channel, snapshot_id, expected):
    a = Aligner(2, mode=mode)
    if fault == FAULT_UNEXPECTED_ID and len(pushes) == 1:
        a.expect(5)
    for ch, sid, terminal in pushes:
        a.put_barrier(ch, sid, terminal=terminal)
    with pytest.raises(BarrierError) as info:
        while True:
            assert a.poll() is not None
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, SparkjetError)
    assert (e.fault, e.channel, e.snapshot_id, e.expected) == (fault, channel, snapshot_id,
                                                                expected)
    assert f"channel {channel}" in str(e) and f"snapshot {snapshot_id}" in str(e)
    if fault != FAULT_TERMINAL:
        assert f"snapshot {expected}" in str(e)
    # The aligner has failed for good: consumers raise the same, producers are refused.
    for call in (a.poll, a.take, lambda: a.drain(3)):
        with pytest.raises(BarrierError, match=str(e).replace("(", r"\(").replace(")", r"\)")):
            call()
    with pytest.raises(AlignerClosedError) as closed:
        a.put(0, "x")
    assert closed.value.failure is not None and closed.value.failure.channel == channel
    assert a.closed


def test_drain_returns_events_before_a_bad_barrier(Aligner):
    a = Aligner(1)
    a.put(0, "x")
    a.put_barrier(0, 1)
    a.put(0, "y")
    a.put_barrier(0, 5)
    assert a.drain(10) == [(ITEM, 0, "x"), (SNAPSHOT, 1, False), (ITEM, 0, "y")]
    with pytest.raises(BarrierError, match="expected snapshot 2"):
        a.drain(10)


def test_expect(Aligner):
    a = Aligner(2)
    a.expect(41)
    assert a.expected == 41
    a.put_barrier(0, 41)
    a.put_barrier(1, 41)
    assert a.poll() == (SNAPSHOT, 41, False) and a.expected == 42
    a.put_barrier(0, 42)
    assert a.poll() is None and a.aligning == 42
    with pytest.raises(InvalidArgumentError, match="while snapshot 42 is aligning"):
        a.expect(100)
    a.put_barrier(1, 42)
    assert a.poll() == (SNAPSHOT, 42, False)
    a.expect(7)  # e.g. a restart from an older snapshot
    a.put_barrier(0, 7)
    a.put_barrier(1, 7)
    assert a.poll() == (SNAPSHOT, 7, False)


# ------------------------------------------------------------------ backpressure and blocking


def test_offer_reports_a_full_channel(Aligner):
    a = Aligner(2, capacity=3)
    assert [a.offer(0, i) for i in range(4)] == [True, True, True, False]
    assert a.offer_barrier(0, 0) is False
    assert a.offer(1, "other channel") is True
    assert a.offer_many(1, list(range(10))) == 2
    assert a.offer_many(1, [99]) == 0
    assert a.poll() == (ITEM, 0, 0)
    assert a.offer(0, 3) is True
    assert [e[2] for e in a.drain(10)] == [1, 2, 3, "other channel", 0, 1]


def test_put_times_out(Aligner):
    a = Aligner(1, capacity=2)
    a.put(0, 1)
    a.put(0, 2)
    for call in (lambda: a.put(0, 3, timeout=0.05), lambda: a.put_barrier(0, 0, timeout=0.05),
                 lambda: a.end(0, timeout=0)):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="channel 0"):
            call()
        assert time.monotonic() - start < 2
    assert a.put_many(0, [3, 4], timeout=0.02) == 0
    assert [e[2] for e in a.drain(10)] == [1, 2]
    assert a.put_many(0, [3, 4, 5], timeout=0.02) == 2
    assert a.poll() == (ITEM, 0, 3)
    assert a.put_many(0, [5, 6], timeout=0.02) == 1  # what fits by the deadline
    assert [e[2] for e in a.drain(10)] == [4, 5]


def test_blocked_put_resumes_when_the_consumer_takes(Aligner):
    a = Aligner(1, capacity=1)
    a.put(0, "first")
    done = threading.Event()

    def producer():
        a.put(0, "second")  # blocks until the consumer takes "first"
        a.end(0)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.05)
    assert not done.is_set()
    assert a.take(timeout=5) == (ITEM, 0, "first")
    assert a.take(timeout=5) == (ITEM, 0, "second")
    assert a.take(timeout=5) == (DONE,)
    t.join(5)
    assert done.is_set()


def test_take_times_out_and_wakes_on_data(Aligner):
    a = Aligner(2)
    start = time.monotonic()
    assert a.take(timeout=0.05) is None
    assert 0.04 <= time.monotonic() - start < 2
    assert a.take(timeout=0) is None
    timer = threading.Timer(0.05, lambda: a.put(1, "late"))
    timer.start()
    assert a.take(timeout=10) == (ITEM, 1, "late")
    timer.join()
    # A held channel's entries do not count as available.
    a.put_barrier(0, 0)
    a.put(0, "held")
    assert a.take(timeout=0.05) is None


def test_close_wakes_blocked_calls(Aligner):
    a = Aligner(2, capacity=1)
    a.put(0, "x")
    errors = []

    def blocked(call):
        try:
            call()
        except AlignerClosedError as e:
            errors.append(e)

    threads = [threading.Thread(target=blocked, args=(lambda: a.put(0, "y"),))]
    b = Aligner(2)
    threads.append(threading.Thread(target=blocked, args=(b.take,)))
    for t in threads:
        t.start()
    time.sleep(0.05)
    a.close()
    b.close()
    for t in threads:
        t.join(5)
    assert len(errors) == 2 and all(e.failure is None for e in errors)
    assert a.closed
    with pytest.raises(AlignerClosedError, match="closed"):
        a.offer(1, "z")
    with pytest.raises(AlignerClosedError):
        a.poll()
    a.close()  # idempotent


# ------------------------------------------------------------------ statistics


def test_alignment_statistics(Aligner):
    a = Aligner(3, history=2)
    before = time.monotonic()
    a.put_barrier(0, 0)
    assert a.poll() is None
    time.sleep(0.05)
    a.put_barrier(1, 0)
    a.end(2)
    assert a.drain(10) == [(SNAPSHOT, 0, False)]
    (record,) = a.alignments
    assert record["snapshot_id"] == 0 and record["terminal"] is False
    assert record["blocking"] is True
    assert before <= record["started"] <= time.monotonic()
    assert 0.04 <= record["duration_s"] < 5
    assert set(record["held"]) == {0, 1}
    assert record["held"][0] >= 0.04 and 0 <= record["held"][1] < record["held"][0]
    assert record["held"][0] <= record["duration_s"]
    for k in (1, 2, 3):
        a.put_barrier(0, k)
        a.put_barrier(1, k)
        a.drain(10)
    assert [r["snapshot_id"] for r in a.alignments] == [2, 3]  # history=2


# ------------------------------------------------------------------ reference counts


def test_no_reference_leaks(Aligner):
    sentinel = object()
    base = sys.getrefcount(sentinel)
    a = Aligner(2, capacity=10)
    for _ in range(10):
        assert a.offer(0, sentinel)
    assert not a.offer(0, sentinel)
    with pytest.raises(TimeoutError):
        a.put(0, sentinel, timeout=0.01)
    many = [sentinel] * 100
    assert a.offer_many(1, many) == 10
    assert sys.getrefcount(sentinel) == base + 20 + 100
    events = a.drain(100)
    assert len(events) == 20
    del events
    gc.collect()  # tracebacks of the errors above may hold frames that hold it
    assert sys.getrefcount(sentinel) == base + 100
    a.put_many(1, many[:5])
    a.put(0, sentinel)
    with pytest.raises(InvalidArgumentError):
        a.offer(5, sentinel)
    a.end(0)
    with pytest.raises(InvalidArgumentError):
        a.put(0, sentinel)
    a.close()
    with pytest.raises(AlignerClosedError):
        a.put(1, sentinel)
    del many
    gc.collect()
    assert sys.getrefcount(sentinel) == base + 6
    del a  # the six still queued are released with the aligner
    gc.collect()
    assert sys.getrefcount(sentinel) == base


# ------------------------------------------------------------------ hypothesis: interleavings


def action_strategy(channels):
    return st.one_of(
        st.tuples(st.just("push"), st.integers(0, channels - 1), st.integers(1, 8)),
        st.tuples(st.just("poll")),
        st.tuples(st.just("take")),
        st.tuples(st.just("drain"), st.integers(0, 6)),
        st.tuples(st.just("many"), st.integers(0, channels - 1), st.integers(1, 5)),
    )


def random_action(rng, channels):
    kind = rng.choice(("push", "push", "push", "poll", "take", "drain", "many"))
    if kind in ("push", "many"):
        return (kind, rng.randrange(channels), rng.randint(1, 8))
    return (kind, rng.randint(0, 6)) if kind == "drain" else (kind,)


@st.composite
def scenarios(draw, valid=True):
    """Per channel a script of items, barriers and maybe an end; and a schedule of pushes
    and takes, continued to the end from a random seed (the last action). Valid scenarios
    follow the coordinator's rule (barrier n + 1 is pushed
    only after SNAPSHOT n came out), so they never fault; invalid ones push barriers
    with random ids and flags whenever they like."""
    channels = draw(st.integers(1, 4))
    mode = draw(st.sampled_from(MODES))
    capacity = draw(st.integers(1, 6))
    start = draw(st.integers(0, 3))
    barriers = draw(st.integers(0, 3))
    last_terminal = draw(st.booleans())
    scripts = []
    for c in range(channels):
        seen = draw(st.integers(0, barriers)) if valid else barriers
        ends = seen < barriers or draw(st.booleans())
        script = []
        for k in range(seen + 1):
            script += [("item", (c, len(script), i)) for i in range(draw(st.integers(0, 4)))]
            if k < seen:
                if valid:
                    sid, terminal = start + k, last_terminal and k == barriers - 1
                else:
                    sid, terminal = draw(st.integers(0, 3)), draw(st.booleans())
                script.append(("barrier", sid, terminal))
        if ends:
            script.append(("end",))
        scripts.append(script)
    actions = draw(st.lists(action_strategy(channels), max_size=60))
    expect = draw(st.booleans())
    actions.append(("seed", draw(st.integers(0, 2**32))))
    return channels, mode, capacity, start if expect else None, scripts, actions


class Lockstep:
    """Runs one scenario on the native and the reference aligner side by side; every
    call must give the same result (or raise the same error) on both."""

    def __init__(self, channels, mode, capacity, expect, scripts, valid):
        self.aligners = [BarrierAligner(channels, mode=mode, capacity=capacity),
                         ReferenceAligner(channels, mode=mode, capacity=capacity)]
        if expect is not None:
            for a in self.aligners:
                a.expect(expect)
        self.scripts = scripts
        self.pos = [0] * channels
        self.valid = valid
        self.events: list = []
        self.snapshots: set = set()
        self.failed = False

    def both(self, call):
        results = []
        for a in self.aligners:
            try:
                results.append(("ok", call(a)))
            except (BarrierError, AlignerClosedError) as e:
                results.append((type(e).__name__, str(e)))
        assert results[0] == results[1]
        if results[0][0] != "ok":
            self.failed = True
        return results[0][1] if results[0][0] == "ok" else None

    def allowed(self, c) -> bool:
        if self.pos[c] >= len(self.scripts[c]) or self.failed:
            return False
        entry = self.scripts[c][self.pos[c]]
        if self.valid and entry[0] == "barrier":
            # The coordinator starts snapshot n + 1 only after snapshot n completed.
            first = min(e[1] for s in self.scripts for e in s if e[0] == "barrier")
            return entry[1] == first or entry[1] - 1 in self.snapshots
        return True

    def push(self, c) -> bool:
        if not self.allowed(c):
            return False
        entry = self.scripts[c][self.pos[c]]
        if entry[0] == "item":
            ok = self.both(lambda a: a.offer(c, entry[1]))
        elif entry[0] == "barrier":
            ok = self.both(lambda a: a.offer_barrier(c, entry[1], terminal=entry[2]))
        else:
            ok = self.both(lambda a: _offer_end(a, c))
        if ok:
            self.pos[c] += 1
        return bool(ok)

    def push_many(self, c, n):
        items = []
        for entry in self.scripts[c][self.pos[c]:self.pos[c] + n]:
            if entry[0] != "item":
                break
            items.append(entry[1])
        if items and not self.failed:
            accepted = self.both(lambda a: a.offer_many(c, items))
            if accepted is not None:
                self.pos[c] += accepted

    def record(self, events):
        for e in events or ():
            if e is not None:
                self.events.append(e)
                if e[0] == SNAPSHOT:
                    self.snapshots.add(e[1])

    def act(self, action):
        if self.failed:
            return
        kind = action[0]
        if kind == "push":
            for _ in range(action[2]):
                if not self.push(action[1]):
                    break
        elif kind == "many":
            self.push_many(action[1], action[2])
        elif kind == "poll":
            self.record([self.both(lambda a: a.poll())])
        elif kind == "take":
            self.record([self.both(lambda a: a.take(timeout=0))])
        else:
            self.record(self.both(lambda a: a.drain(action[1])))

    def finish(self, seed):
        """Random pushes and takes, with a sweep (every channel pushes, one poll) between
        runs of them, until a sweep makes no progress."""
        rng = random.Random(seed)
        channels = len(self.scripts)
        while not self.failed:
            for _ in range(rng.randint(0, 8)):
                self.act(random_action(rng, channels))
            pushed = [self.push(c) for c in range(channels)]  # every channel, not any()
            event = self.both(lambda a: a.poll())
            self.record([event])
            if (not any(pushed) and event is None) or event == (DONE,):
                break

    def run(self, actions):
        *actions, (_, seed) = actions
        for action in actions:
            self.act(action)
        self.finish(seed)


def _offer_end(a, c):
    """end() without blocking: the schedule pushes it only when there is room."""
    if a.queued(c) >= a.capacity:
        return False
    a.end(c)
    return True


def check_promises(mode, scripts, events):
    """Exactly-once: the items before SNAPSHOT n are exactly, per channel and in order,
    those the channel sent before its barrier n (all of them if it ended before one).
    At-least-once: at least those. Both: every item once, in order per channel."""
    sent = [[e[1] for e in s if e[0] == "item"] for s in scripts]
    out = [[] for _ in scripts]
    for e in events:
        if e[0] == ITEM:
            out[e[1]].append(e[2])
        elif e[0] == SNAPSHOT:
            for c, script in enumerate(scripts):
                before = []
                for entry in script:
                    if entry[0] == "barrier" and entry[1] == e[1]:
                        break
                    if entry[0] == "item":
                        before.append(entry[1])
                if mode == "exactly-once":
                    assert out[c] == before, (c, e)
                else:
                    assert out[c][:len(before)] == before, (c, e)
    for c in range(len(scripts)):
        assert out[c] == sent[c][:len(out[c])]


@SETTINGS
@given(scenarios())
def test_interleavings_match_the_reference_and_keep_the_promises(scenario):
    channels, mode, capacity, expect, scripts, actions = scenario
    run = Lockstep(channels, mode, capacity, expect, scripts, valid=True)
    run.run(actions)
    assert not run.failed
    events = run.events
    check_promises(mode, scripts, events)
    # Everything came out: every item once, every snapshot once, in order, then DONE.
    assert sorted(e[2] for e in items_of(events)) == sorted(
        e[1] for s in scripts for e in s if e[0] == "item")
    barrier_ids = sorted({e[1] for s in scripts for e in s if e[0] == "barrier"})
    assert [e[1] for e in events if e[0] == SNAPSHOT] == barrier_ids
    ended = all(s and s[-1] == ("end",) for s in scripts)
    assert (events[-1:] == [(DONE,)]) == ended
    native, reference = run.aligners
    assert ([r["snapshot_id"] for r in native.alignments]
            == [r["snapshot_id"] for r in reference.alignments] == barrier_ids)
    assert ([sorted(r["held"]) for r in native.alignments]
            == [sorted(r["held"]) for r in reference.alignments])


@SETTINGS
@given(scenarios(valid=False))
def test_random_barriers_fail_like_the_reference(scenario):
    channels, mode, capacity, expect, scripts, actions = scenario
    run = Lockstep(channels, mode, capacity, expect, scripts, valid=False)
    run.run(actions)
    # Lockstep compared every event and every error message; a failure is for good.
    if run.failed:
        for a in run.aligners:
            assert a.closed
            with pytest.raises(BarrierError):
                a.poll()


# ------------------------------------------------------------------ real threads


def run_threads(Aligner, mode, items, producers=3, every=1000, capacity=64, bulk=False):
    """Producer threads push `items` items each with a barrier every `every` items (with
    put / put_many, so a small capacity blocks them often); one consumer takes."""
    a = Aligner(producers, mode=mode, capacity=capacity)
    completed = threading.Condition()
    state = {"done": -1}
    errors = []

    def produce(c):
        try:
            for start in range(0, items, every):
                if start:
                    n = start // every - 1
                    if mode == "at-least-once":  # the coordinator's rule
                        with completed:
                            completed.wait_for(lambda n=n: state["done"] >= n - 1, timeout=30)
                    a.put_barrier(c, n)
                batch = [(c, i) for i in range(start, min(start + every, items))]
                if bulk:
                    assert a.put_many(c, batch) == len(batch)
                else:
                    for x in batch:
                        a.put(c, x)
            a.end(c)
        except Exception as e:  # noqa: BLE001 - a failing producer is reported below
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(c,)) for c in range(producers)]
    for t in threads:
        t.start()
    seen = [0] * producers
    snapshots = []
    while True:
        events = a.drain(500) if bulk else [a.take(timeout=30)]
        if not events:
            events = [a.take(timeout=30)]
        assert events[0] is not None, "consumer starved"
        for e in events:
            if e[0] == ITEM:
                assert e[2] == (e[1], seen[e[1]])
                seen[e[1]] += 1
            elif e[0] == SNAPSHOT:
                n = e[1]
                assert n == len(snapshots)
                for c in range(producers):
                    if mode == "exactly-once":
                        assert seen[c] == (n + 1) * every
                    else:
                        assert seen[c] >= (n + 1) * every
                snapshots.append(n)
                with completed:
                    state["done"] = n
                    completed.notify_all()
        if events[-1] == (DONE,):
            break
    for t in threads:
        t.join(10)
    assert not errors
    assert seen == [items] * producers
    assert len(snapshots) == (items - 1) // every
    records = a.alignments
    assert [r["snapshot_id"] for r in records] == snapshots
    assert all(r["duration_s"] >= 0 and r["started"] > 0 for r in records)
    assert all(0 <= h <= r["duration_s"] + 1e-6 for r in records for h in r["held"].values())
    assert len(a) == 0
    return sum(seen), len(snapshots)


@pytest.mark.parametrize("mode", MODES)
def test_threads_native(mode):
    assert run_threads(BarrierAligner, mode, 100_000) == (300_000, 99)


def test_threads_native_bulk():
    assert run_threads(BarrierAligner, "exactly-once", 100_000, capacity=256, bulk=True) == (300_000, 99)


@pytest.mark.parametrize("mode", MODES)
def test_threads_reference(mode):
    assert run_threads(ReferenceAligner, mode, 10_000, every=500) == (30_000, 19)


def test_threads_leave_no_references():
    sentinel = object()
    base = sys.getrefcount(sentinel)
    a = BarrierAligner(4, capacity=8)

    def produce(c):
        for _ in range(5000):
            a.put(c, sentinel)
        a.end(c)

    threads = [threading.Thread(target=produce, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    taken = 0
    while (e := a.take(timeout=30)) != (DONE,):
        taken += e[0] == ITEM
    for t in threads:
        t.join()
    del e
    assert taken == 20_000 and sys.getrefcount(sentinel) == base
