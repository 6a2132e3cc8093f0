"""The exchange (sparkjet.runtime.exchange): real Flight servers on 127.0.0.1, in this
process and in child processes, feeding real BarrierAligners. Order of batches and
barriers, exactly-once alignment across two senders, end of stream, backpressure (counts,
never times), fencing, actions, the wire format as documented, and failures: a killed
peer, an aborted or stalled sender, a server that closes. Every wait has a deadline, so a
bug fails a test instead of hanging it."""
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyarrow import flight

from sparkjet.errors import FencedError, InvalidArgumentError, SparkjetError
from sparkjet.partitioning import partition_ids
from sparkjet.runtime.aligner import DONE, ITEM, SNAPSHOT, BarrierAligner
from sparkjet.runtime.exchange import (
    PROTOCOL,
    ExchangeClient,
    ExchangeError,
    ExchangeFencedError,
    ExchangeRefusedError,
    ExchangeServer,
    ExchangeTimeoutError,
    protocol,
)
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.watermarks import IDLE, Watermark
from sparkjet.snapshot.store import Manifest
from sparkjet.testing.nemesis import stop_processes

DEADLINE = 15.0  # seconds any single wait may take before the test fails


def seq_batch(*values, name="seq"):
    return pa.record_batch({name: pa.array(values, pa.int64())})


def take_events(aligner, count, deadline=DEADLINE):
    """The next ``count`` events (fewer if DONE comes first); fails after ``deadline``."""
    events = []
    end = time.monotonic() + deadline
    while len(events) < count:
        event = aligner.take(timeout=0.05)
        if event is not None:
            events.append(event)
            if event[0] == DONE:
                break
        assert time.monotonic() < end, f"only {len(events)} of {count} events: {events}"
    return events


def wait_for(predicate, what, deadline=DEADLINE):
    end = time.monotonic() + deadline
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def simplify(events):
    """Events with batches replaced by their seq values."""
    out = []
    for e in events:
        if e[0] == ITEM:
            out.append((ITEM, e[1], tuple(e[2].column("seq").to_pylist())))
        else:
            out.append(e)
    return out


class Errors:
    """An ``on_error`` hook that keeps what it gets."""

    def __init__(self):
        self.errors: list = []
        self.event = threading.Event()

    def __call__(self, error):
        self.errors.append(error)
        self.event.set()


# The credentials of each execution id the tests use, and of each server's location (a
# client finds its server's there, as a member gets its execution's from the driver).
CREDENTIALS: dict = {}


def credentials(execution_id: int) -> LinkSecurity:
    # A fixed secret per id, so the child processes below can hold the same credentials.
    return CREDENTIALS.setdefault(execution_id, LinkSecurity(execution_id, _secret(execution_id)))


def _secret(execution_id: int) -> bytes:
    return execution_id.to_bytes(8, "little") * 4


@pytest.fixture
def make_server():
    servers = []

    def make(inbound=None, execution_id=1, **kw):
        security = credentials(execution_id)
        server = ExchangeServer(inbound=inbound or {}, execution_id=execution_id,
                                security=security, **kw)
        CREDENTIALS[server.location] = security
        servers.append(server)
        return server

    yield make
    for s in servers:
        # (its port may go to a later test's server, a child's with other credentials)
        CREDENTIALS.pop(s.location, None)
        s.close(timeout=2)


@pytest.fixture
def make_client():
    clients = []

    def make(location, **kw):
        kw.setdefault("security", CREDENTIALS.get(location, credentials(1)))
        client = ExchangeClient(location, **kw)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


# ---- data plane --------------------------------------------------------------------------


def test_batches_and_barriers_arrive_in_order(make_server, make_client):
    aligner = BarrierAligner(1, capacity=16)
    server = make_server({("aggregate", 0): aligner}, execution_id=3)
    assert server.location.startswith("grpc+tcp://127.0.0.1:")
    ch = make_client(server.location).channel("aggregate", 0, 0, execution_id=3)
    ch.put(seq_batch(0, 1))
    ch.put(seq_batch(2))
    ch.put_barrier(0)
    ch.put(seq_batch(3))
    ch.put_barrier(1, terminal=True)
    ch.end()
    ch.close()
    assert simplify(take_events(aligner, 10)) == [
        (ITEM, 0, (0, 1)), (ITEM, 0, (2,)), (SNAPSHOT, 0, False), (ITEM, 0, (3,)),
        (SNAPSHOT, 1, True), (DONE,)]
    assert server.streams == {}


def test_watermarks_arrive_in_band_with_their_sign_and_idleness(make_server, make_client):
    aligner = BarrierAligner(1, capacity=16)
    server = make_server({("window", 0): aligner}, execution_id=3)
    ch = make_client(server.location).channel("window", 0, 0, execution_id=3)
    ch.put(seq_batch(0))
    ch.put_watermark(Watermark(-5))
    ch.put_watermark(Watermark(2**63 - 1))
    ch.put_barrier(0)
    ch.put_watermark(IDLE)
    with pytest.raises(SparkjetError, match="takes a Watermark"):
        ch.put_watermark(7)
    ch.end()
    ch.close()
    events = take_events(aligner, 10)
    assert [e[2] for e in events if e[0] == ITEM][1:] == [Watermark(-5), Watermark(2**63 - 1),
                                                           Watermark(-(2**63), True)]
    assert [e[0] for e in events] == [ITEM, ITEM, ITEM, SNAPSHOT, ITEM, DONE]


def test_batches_keep_their_columns_and_types(make_server, make_client):
    aligner = BarrierAligner(1, capacity=16)
    server = make_server({("v", 0): aligner})
    batch = pa.record_batch({"key": pa.array([1, None, 3], pa.int64()),
                             "name": pa.array(["a", "bé", None]),
                             "sum": pa.array([0.5, 1.5, -2.0])})
    with make_client(server.location).channel("v", 0, 0, 1) as ch:
        ch.put(batch)
        ch.put(batch.slice(1, 1))
        ch.put(batch.slice(0, 0))  # zero rows: sent like any other
        ch.end()
    events = take_events(aligner, 4)
    got = [e[2] for e in events if e[0] == ITEM]
    assert [b.num_rows for b in got] == [3, 1, 0]
    assert got[0].equals(batch) and got[1].equals(batch.slice(1, 1))
    assert events[-1] == (DONE,)


def test_exactly_once_alignment_across_two_senders(make_server, make_client):
    """Channel 0 delivers its barrier and more batches; they are held until channel 1's
    barrier, so "snapshot 0" comes after exactly the batches sent before the barriers."""
    aligner = BarrierAligner(2, mode="exactly-once", capacity=16)
    server = make_server({("agg", 1): aligner})
    client = make_client(server.location)
    a = client.channel("agg", 1, 0, 1)
    b = client.channel("agg", 1, 1, 1)
    a.put(seq_batch(100))
    a.put(seq_batch(101))
    a.put_barrier(0)
    a.put(seq_batch(102))
    a.end()
    a.close()  # close: all of it is in the aligner now
    b.put(seq_batch(200))
    wait_for(lambda: aligner.queued(1) == 1, "channel 1's first batch")
    first = simplify(aligner.drain(100))
    assert first == [(ITEM, 0, (100,)), (ITEM, 0, (101,)), (ITEM, 1, (200,))]
    b.put(seq_batch(201))
    b.put_barrier(0)
    b.put(seq_batch(202))
    b.end()
    b.close()
    rest = simplify(take_events(aligner, 10))
    assert rest[:2] == [(ITEM, 1, (201,)), (SNAPSHOT, 0, False)]
    # After the snapshot, the channels interleave as the batches happen to arrive.
    assert sorted(rest[2:4]) == [(ITEM, 0, (102,)), (ITEM, 1, (202,))]
    assert rest[4:] == [(DONE,)]


def test_exactly_once_with_concurrent_senders(make_server, make_client):
    """Two sender threads, a barrier every 7 batches, small windows and a small aligner:
    before "snapshot n" the consumer has taken exactly the batches the two channels sent
    before their barrier n, no more, no fewer."""
    per_sender, every = 140, 7
    aligner = BarrierAligner(2, mode="exactly-once", capacity=4)
    server = make_server({("agg", 0): aligner})
    client = make_client(server.location)

    def send(channel):
        with client.channel("agg", 0, channel, 1, window_messages=3) as ch:
            for i in range(per_sender):
                ch.put(pa.record_batch({"seq": [channel * 1000 + i]}))
                if (i + 1) % every == 0:
                    ch.put_barrier(i // every)
            ch.end()

    threads = [threading.Thread(target=send, args=(c,), daemon=True) for c in (0, 1)]
    for t in threads:
        t.start()
    taken, snapshots = [], []
    for event in take_events(aligner, 10_000, deadline=30):
        if event[0] == ITEM:
            taken.append(event[2].column("seq")[0].as_py())
        elif event[0] == SNAPSHOT:
            n = event[1]
            snapshots.append(n)
            before = sorted(taken)
            want = sorted(c * 1000 + i for c in (0, 1) for i in range(every * (n + 1)))
            assert before == want, f"snapshot {n}"
    for t in threads:
        t.join(DEADLINE)
    assert snapshots == list(range(per_sender // every))
    assert sorted(taken) == sorted(c * 1000 + i for c in (0, 1) for i in range(per_sender))


def test_end_of_stream_and_channel_lifecycle(make_server, make_client):
    aligner = BarrierAligner(2, capacity=8)
    server = make_server({("v", 0): aligner})
    client = make_client(server.location)
    # A stream closed without end() leaves the channel open; a new stream continues it.
    first = client.channel("v", 0, 0, 1)
    first.put(seq_batch(1))
    first.close()
    first.close()  # idempotent
    with pytest.raises(InvalidArgumentError, match="closed"):
        first.put(seq_batch(9))
    second = client.channel("v", 0, 0, 1)
    second.put_barrier(0)  # a barrier before any batch: fine
    second.put(seq_batch(2))
    second.end()
    with pytest.raises(InvalidArgumentError, match="ended"):
        second.put(seq_batch(3))
    second.close()
    # The other channel ends without sending anything.
    other = client.channel("v", 0, 1, 1)
    other.end()
    other.close()
    events = simplify(take_events(aligner, 10))
    assert events == [(ITEM, 0, (1,)), (SNAPSHOT, 0, False), (ITEM, 0, (2,)), (DONE,)]
    # Nothing follows an end on the server either: the aligner refuses, the sender hears.
    third = client.channel("v", 0, 0, 1)
    third.put(seq_batch(4))
    with pytest.raises(ExchangeRefusedError, match="has ended") as info:
        third.close()
    assert info.value.peer == server.location


def test_a_new_schema_opens_a_new_stream_in_order(make_server, make_client):
    aligner = BarrierAligner(1, capacity=16)
    server = make_server({("v", 0): aligner})
    with make_client(server.location).channel("v", 0, 0, 1) as ch:
        ch.put(seq_batch(1))
        ch.put_barrier(0)
        ch.put(seq_batch(2, name="other"))
        ch.put(seq_batch(3, name="other"))
        ch.put(seq_batch(4))
        ch.end()
        assert ch.streams_opened == 3
    events = take_events(aligner, 10)
    names = [(e[2].schema.names[0], e[2].column(0).to_pylist()) if e[0] == ITEM else e
             for e in events]
    assert names == [("seq", [1]), (SNAPSHOT, 0, False), ("other", [2]), ("other", [3]),
                     ("seq", [4]), (DONE,)]


def test_a_new_schema_after_acks_keeps_the_channel_working(make_server, make_client):
    # A small window makes the sender ask for acks before the switch; the new stream's
    # server counts from 0 again.
    aligner = BarrierAligner(1, capacity=64)
    server = make_server({("v", 0): aligner})
    with make_client(server.location).channel("v", 0, 0, 1, window_messages=4) as ch:
        for i in range(5):
            ch.put(seq_batch(i))
        for i in range(5, 12):
            ch.put(seq_batch(i, name="other"))
        ch.end()
        assert ch.streams_opened == 2
    events = take_events(aligner, 20)
    assert [e[2].column(0).to_pylist() for e in events if e[0] == ITEM] == [[i] for i in range(12)]
    assert events[-1] == (DONE,)


def test_one_stream_per_channel(make_server, make_client):
    aligner = BarrierAligner(1, capacity=8)
    server = make_server({("v", 0): aligner})
    client = make_client(server.location)
    first = client.channel("v", 0, 0, 1)
    with pytest.raises(ExchangeRefusedError, match="already has a stream open"):
        client.channel("v", 0, 0, 1)
    first.close()
    client.channel("v", 0, 0, 1).close()  # free again


@pytest.mark.parametrize("window", ["messages", "bytes"])
def test_backpressure_bounds_what_is_in_flight(make_server, make_client, window):
    """A consumer that does not take stalls the sender: what the sender got rid of stays
    within the aligner's capacity plus one window, whatever gRPC would buffer; then a slow
    consumer lets it through, one window at a time, and everything arrives in order."""
    capacity, total = 2, 60
    batch_bytes = 8 * 4096
    if window == "messages":
        options, window_count = {"window_messages": 4}, 4
    else:
        options = {"window_messages": 1000, "window_bytes": 3 * batch_bytes}
        window_count = 3
    bound = capacity + window_count
    aligner = BarrierAligner(1, capacity=capacity)
    server = make_server({("v", 0): aligner})
    ch = make_client(server.location).channel("v", 0, 0, 1, **options)
    sent = [0]

    def send():
        for i in range(total):
            ch.put(pa.record_batch({"seq": pa.array([i] * 4096, pa.int64())}))
            sent[0] += 1
        ch.end()
        ch.close()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    wait_for(lambda: aligner.queued(0) == capacity, "the aligner to fill")
    wait_for(lambda: sent[0] >= window_count, "the sender to fill its window")
    time.sleep(0.3)  # room for anything that would overshoot; the asserts are on counts
    assert sent[0] <= bound < total
    assert sender.is_alive()
    taken = 0
    while True:
        event = take_events(aligner, 1)[0]
        if event[0] == DONE:
            break
        assert event[2].column("seq")[0].as_py() == taken
        taken += 1
        assert sent[0] - taken <= bound
        if taken % 10 == 0:
            time.sleep(0.02)  # a slow consumer
    sender.join(DEADLINE)
    assert taken == total and not sender.is_alive()


def test_a_batch_larger_than_the_window_goes_alone(make_server, make_client):
    aligner = BarrierAligner(1, capacity=1)
    server = make_server({("v", 0): aligner})
    ch = make_client(server.location).channel("v", 0, 0, 1, window_bytes=1000)
    big = pa.record_batch({"seq": pa.array(range(1000), pa.int64())})  # 8000 bytes
    sent = [0]

    def send():
        for _ in range(10):
            ch.put(big)
            sent[0] += 1
        ch.end()
        ch.close()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    taken = 0
    while take_events(aligner, 1)[0][0] != DONE:
        taken += 1
        assert sent[0] - taken <= 2  # one in the aligner, one in flight
    sender.join(DEADLINE)
    assert taken == 10


def test_abort_wakes_a_blocked_sender(make_server, make_client):
    aligner = BarrierAligner(1, capacity=1)
    errors = Errors()
    server = make_server({("v", 0): aligner}, on_error=errors)
    ch = make_client(server.location).channel("v", 0, 0, 1, window_messages=2)
    outcome = queue.Queue()

    def send():
        try:
            for i in range(100):
                ch.put(seq_batch(i))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.put(e)

    threading.Thread(target=send, daemon=True).start()
    wait_for(lambda: ch.in_flight[0] == 2, "the window to fill")
    ch.abort()
    error = outcome.get(timeout=DEADLINE)
    assert isinstance(error, ExchangeError) and "aborted" in str(error)
    assert server.location in str(error)
    ch.close()  # after abort: nothing to report
    assert errors.event.wait(DEADLINE)
    assert "broke" in str(errors.errors[0]) and "v[0] channel 0" in str(errors.errors[0])


def test_stall_timeout(make_server, make_client):
    aligner = BarrierAligner(1, capacity=1)
    server = make_server({("v", 0): aligner})
    ch = make_client(server.location).channel("v", 0, 0, 1, window_messages=1,
                                              stall_timeout=0.3)
    ch.put(seq_batch(0))  # in the aligner
    ch.put(seq_batch(1))  # blocked in the server's put: no ack
    with pytest.raises(ExchangeTimeoutError, match="no answer from the peer in 0.3 s") as info:
        ch.put(seq_batch(2))
    assert isinstance(info.value, TimeoutError) and info.value.peer == server.location
    with pytest.raises(ExchangeTimeoutError):  # the channel stays broken
        ch.put_barrier(0)


def test_server_close_ends_blocked_streams_and_refuses_new_ones(make_server, make_client):
    aligner = BarrierAligner(1, capacity=1)
    server = make_server({("v", 0): aligner}, poll=0.05)
    client = make_client(server.location)
    ch = client.channel("v", 0, 0, 1, window_messages=2)
    outcome = queue.Queue()

    def send():
        try:
            for i in range(100):
                ch.put(seq_batch(i))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.put(e)

    threading.Thread(target=send, daemon=True).start()
    wait_for(lambda: ch.in_flight[0] == 2, "the window to fill")
    assert server.close(timeout=DEADLINE)
    error = outcome.get(timeout=DEADLINE)
    assert isinstance(error, ExchangeRefusedError) and "shutting down" in str(error)
    with pytest.raises(ExchangeError, match="unreachable"):
        client.channel("v", 0, 0, 1)


def test_two_members_and_a_coordinator(make_server, make_client):
    """Issue 6's runtime in miniature: two members, each with a source and a keyed
    processor. Sources route rows by Hazelcast partition (even partitions to member 0,
    odd to member 1) over the exchange; the coordinator asks both sources for barrier 0
    with an action; each keyed processor acks "snapshot 0" to the coordinator with the
    rows it counted. The acks add up to exactly what the sources sent before the barrier."""
    execution = 2
    coordinator = make_server(execution_id=execution)
    acks = queue.Queue()
    coordinator.on_action("ack", lambda body: acks.put(body))
    servers, aligners, requests = [], [], []
    for m in range(2):
        aligners.append(BarrierAligner(2, capacity=4))
        servers.append(make_server({("aggregate", m): aligners[m]}, execution_id=execution))
        requests.append(queue.Queue())
        servers[m].on_action("barrier", lambda body, q=requests[m]: q.put(body["snapshot"]))
    clients = [make_client(s.location) for s in servers]
    sent_before = [0, 0]
    failures = queue.Queue()

    def source(m):
        outs = [clients[d].channel("aggregate", d, m, execution) for d in range(2)]
        after_barrier = None
        for i in range(10_000):
            if after_barrier is None and not requests[m].empty():
                snapshot = requests[m].get()
                for out in outs:
                    out.put_barrier(snapshot)
                after_barrier = 0
            if after_barrier == 3:
                break
            keys = pa.array(range(m * 1_000_000 + 10 * i, m * 1_000_000 + 10 * i + 10))
            batch = pa.record_batch({"key": keys})
            owner = pc.bit_wise_and(partition_ids(batch, key="key"), 1).to_numpy()
            for d in range(2):
                part = batch.filter(pa.array(owner == d))
                if part.num_rows:
                    outs[d].put(part)
            if after_barrier is None:
                sent_before[m] += 10
            else:
                after_barrier += 1
        for out in outs:
            out.end()
            out.close()

    def keyed(m):
        to_coordinator = make_client(coordinator.location)
        rows = 0
        while (event := aligners[m].take(timeout=DEADLINE))[0] != DONE:
            if event[0] == ITEM:
                pids = partition_ids(event[2], key="key").to_numpy()
                if (pids % 2 != m).any():
                    failures.put(f"member {m} got a row of another member's partition")
                rows += event[2].num_rows
            else:
                to_coordinator.action(
                    "ack", {"processor": m, "snapshot": event[1], "rows": rows},
                    execution_id=execution)

    threads = [threading.Thread(target=f, args=(m,), daemon=True)
               for f in (source, keyed) for m in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: min(sent_before) >= 50, "both sources to send")
    for client in clients:
        assert client.action("barrier", {"snapshot": 0}, execution_id=execution) == {}
    got = [acks.get(timeout=DEADLINE) for _ in range(2)]
    for t in threads:
        t.join(DEADLINE)
    assert failures.empty(), failures.get()
    assert {a["snapshot"] for a in got} == {0}
    assert sum(a["rows"] for a in got) == sum(sent_before)


# ---- fencing and refusals ----------------------------------------------------------------


def test_a_stream_of_another_execution_is_fenced(make_server, make_client):
    aligner = BarrierAligner(1, capacity=8)
    errors = Errors()
    server = make_server({("v", 0): aligner}, execution_id=5, on_error=errors)
    client = make_client(server.location)
    with pytest.raises(ExchangeFencedError) as info:
        client.channel("v", 0, 0, execution_id=4)
    error = info.value
    assert isinstance(error, FencedError) and isinstance(error, ConnectionError)
    assert isinstance(error, SparkjetError)
    assert error.peer == server.location
    assert "execution 4" in str(error) and "execution 5" in str(error)
    assert server.location in str(error)
    assert errors.event.is_set() and "fenced" in str(errors.errors[0])
    assert len(aligner) == 0 and server.streams == {}
    # The current execution is served.
    with client.channel("v", 0, 0, execution_id=5) as ch:
        ch.put(seq_batch(1))
    assert aligner.queued(0) == 1


def test_refusals_name_what_was_wrong(make_server, make_client):
    server = make_server({("v", 0): BarrierAligner(2, capacity=8)})
    client = make_client(server.location)
    with pytest.raises(ExchangeRefusedError, match=r"no inbound processor w\[0\]"):
        client.channel("w", 0, 0, 1)
    with pytest.raises(ExchangeRefusedError, match=r"v\[0\] has channels 0..1, not 2"):
        client.channel("v", 0, 2, 1)
    with pytest.raises(InvalidArgumentError, match="window_messages"):
        client.channel("v", 0, 0, 1, window_messages=0)
    ch = client.channel("v", 0, 0, 1)
    with pytest.raises(TypeError, match="RecordBatch"):
        ch.put(pa.table({"seq": [1]}))
    ch.close()


def test_inbound_may_be_a_function(make_server, make_client):
    aligners = {}

    def lookup(vertex, processor):
        if vertex != "agg":
            return None
        return aligners.setdefault(processor, BarrierAligner(1, capacity=8))

    server = make_server(lookup)
    client = make_client(server.location)
    with client.channel("agg", 7, 0, 1) as ch:
        ch.put(seq_batch(7))
        ch.end()
    assert simplify(take_events(aligners[7], 2)) == [(ITEM, 0, (7,)), (DONE,)]
    with pytest.raises(ExchangeRefusedError, match="no inbound processor"):
        client.channel("src", 0, 0, 1)


# ---- control plane -----------------------------------------------------------------------


def test_actions_round_trip_json(make_server, make_client):
    coordinator = make_server(execution_id=9)
    acks = []

    def on_ack(body):
        acks.append((body["processor"], Manifest.from_json(body["manifest"])))
        return {"ok": True, "count": len(acks)}

    coordinator.on_action("ack", on_ack)
    coordinator.on_action("fail", lambda body: 1 / 0)
    client = make_client(coordinator.location)
    manifest = Manifest(3, 9, [{"path": "x/y.arrow", "rows": 12, "crc": 123, "é": None}])
    answer = client.action("ack", {"processor": "aggregate-1", "manifest": manifest.to_json()},
                           execution_id=9)
    assert answer == {"ok": True, "count": 1}
    assert acks == [("aggregate-1", manifest)]
    assert client.ping() == {"execution_id": 9}
    assert client.action("ack", {"processor": "p", "manifest": manifest.to_json()}) == \
        {"ok": True, "count": 2}  # no execution id given: the credentials' (9)
    with pytest.raises(ExchangeFencedError, match="execution 8"):
        client.action("ack", {}, execution_id=8)
    with pytest.raises(ExchangeRefusedError, match="no action 'nope'.*ack, fail, ping"):
        client.action("nope", {})
    with pytest.raises(ExchangeRefusedError, match="ZeroDivisionError") as info:
        client.action("fail", {})
    assert info.value.peer == coordinator.location
    with pytest.raises(InvalidArgumentError, match="dict"):
        client.action("ack", [1, 2])
    with pytest.raises(InvalidArgumentError, match="not JSON"):
        client.action("ack", {"x": object()})
    coordinator.on_action("list", lambda body: [1])
    with pytest.raises(ExchangeRefusedError, match="returned a list, not a dict"):
        client.action("list")
    assert len(acks) == 2


def test_action_timeout(make_server, make_client):
    server = make_server()
    release = threading.Event()
    server.on_action("slow", lambda body: release.wait(DEADLINE) and {})
    client = make_client(server.location)
    with pytest.raises(ExchangeTimeoutError, match="did not answer in time") as info:
        client.action("slow", {}, timeout=0.2)
    assert isinstance(info.value, TimeoutError)
    release.set()


def test_an_unreachable_peer_is_reported_at_once(make_client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket closes
    location = f"grpc+tcp://127.0.0.1:{port}"
    client = make_client(location, connect_timeout=5)
    with pytest.raises(ExchangeError, match="unreachable") as info:
        client.channel("v", 0, 0, 1)
    assert info.value.peer == location and location in str(info.value)
    with pytest.raises(ExchangeError, match="unreachable"):
        client.ping(timeout=5)


# ---- the wire format, by hand ------------------------------------------------------------


def test_the_documented_wire_format(make_server):
    """A plain pyarrow.flight client that follows the conventions of the protocol module's
    docstring."""
    aligner = BarrierAligner(1, capacity=8)
    server = make_server({("v", 2): aligner}, execution_id=4)
    assert protocol.control(protocol.BARRIER, 1, 7) == \
        b"SJX1\x01\x01\x00\x00\x07\x00\x00\x00\x00\x00\x00\x00"
    # Without the sparkjet-auth header (the package's "Authentication"), nothing is heard.
    with pytest.raises(flight.FlightUnauthenticatedError, match="call refused"):
        flight.FlightClient(server.location).list_actions()
    client = flight.FlightClient(server.location)
    command = ('{"protocol": "' + PROTOCOL + '", "execution_id": 4, "vertex": "v", '
               '"processor": 2, "channel": 0}')
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command.encode()),
                                        credentials(4).call_options("DO_EXCHANGE",
                                                                    server.location))
    hello = reader.read_chunk()
    assert hello.data is None and hello.app_metadata.to_pybytes() == b"SJX1\x10" + bytes(11)
    batch = seq_batch(5)
    writer.begin(batch.schema)
    writer.write_batch(batch)
    writer.write_metadata(b"SJX1\x01\x01\x00\x00" + (0).to_bytes(8, "little"))  # terminal 0
    writer.write_metadata(b"SJX1\x02\x02\x00\x00" + bytes(8))  # end, asking for an ack
    ack = reader.read_chunk().app_metadata.to_pybytes()
    assert ack == b"SJX1\x10\x00\x00\x00" + (3).to_bytes(8, "little")
    writer.done_writing()
    with pytest.raises(StopIteration):
        reader.read_chunk()
    writer.close()
    assert simplify(take_events(aligner, 3)) == [(ITEM, 0, (5,)), (SNAPSHOT, 0, True), (DONE,)]
    # Not the protocol: refused with the reason.
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("v", "2"),
                                        credentials(4).call_options("DO_EXCHANGE",
                                                                    server.location))
    with pytest.raises(flight.FlightServerError, match="not a sparkjet exchange stream"):
        reader.read_chunk()
    client.close()


def test_a_busy_port_is_a_clear_error(make_server):
    server = make_server()
    with pytest.raises(ExchangeError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        ExchangeServer(port=server.port, execution_id=1, security=credentials(1))


def test_errors_pickle_with_their_peer():
    for cls in (ExchangeError, ExchangeTimeoutError, ExchangeFencedError, ExchangeRefusedError):
        error = pickle.loads(pickle.dumps(cls("it broke", "grpc+tcp://h:1")))
        assert type(error) is cls and str(error) == "it broke"
        assert error.peer == "grpc+tcp://h:1"


# ---- other processes ---------------------------------------------------------------------

_RECEIVER = """
import sys, time
from sparkjet.runtime.aligner import BarrierAligner
from sparkjet.runtime.exchange import ExchangeServer
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.watermarks import IDLE, Watermark
aligner = BarrierAligner(1, capacity=2)  # nobody takes: the sender fills it and blocks
security = LinkSecurity(1, (1).to_bytes(8, "little") * 4)  # the tests' credentials(1)
server = ExchangeServer(inbound={("agg", 0): aligner}, execution_id=1, security=security)
print(server.location, flush=True)
time.sleep(120)
"""

_SENDER = """
import sys, time
import pyarrow as pa
from sparkjet.runtime.exchange import ExchangeClient
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.watermarks import IDLE, Watermark
security = LinkSecurity(1, (1).to_bytes(8, "little") * 4)  # the tests' credentials(1)
ch = ExchangeClient(sys.argv[1], security=security).channel("agg", 0, 0, 1)
for i in range(5):
    ch.put(pa.record_batch({"seq": pa.array([i], pa.int64())}))
ch.put_barrier(0)
ch.put(pa.record_batch({"seq": pa.array([5], pa.int64())}))
print("sent", flush=True)
time.sleep(120)
"""


def spawn(script, *args):
    """A Python child running ``script``, and the first line it prints."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=30)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"the child printed nothing: {proc.stderr.read()}")
    if not line:
        pytest.fail(f"the child failed: {proc.communicate()[1]}")
    return proc, line.strip()


@pytest.fixture
def children():
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_a_killed_receiver_is_an_exchange_error(make_client, children):
    proc, location = spawn(_RECEIVER)
    children.append(proc)
    client = make_client(location)
    assert client.ping()["execution_id"] == 1
    ch = client.channel("agg", 0, 0, 1, window_messages=2)
    outcome = queue.Queue()

    def send():
        try:
            for i in range(100):
                ch.put(seq_batch(i))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.put(e)

    threading.Thread(target=send, daemon=True).start()
    wait_for(lambda: ch.in_flight[0] == 2, "the sender to block on the child")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(DEADLINE)
    error = outcome.get(timeout=DEADLINE)  # the blocked put fails, it does not hang
    assert isinstance(error, ExchangeError) and error.peer == location
    assert location in str(error)
    with pytest.raises(ExchangeError, match="unreachable") as info:
        client.ping(timeout=5)
    assert location in str(info.value)
    with pytest.raises(ExchangeError, match="unreachable"):
        client.channel("agg", 0, 0, 1)


def test_a_stopped_peer_times_out(make_client, children):
    """A peer that is alive but does not run (SIGSTOP, like a zombie member) is reported
    by the timeouts, not waited for."""
    proc, location = spawn(_RECEIVER)
    children.append(proc)
    client = make_client(location, connect_timeout=0.5)
    assert client.ping()["execution_id"] == 1  # connected
    # Every thread stopped before the stream opens: `kill` alone returns while the
    # receiver's gRPC threads may still answer (CI saw the handshake come back).
    assert stop_processes(proc.pid) == [proc.pid]
    try:
        with pytest.raises(ExchangeTimeoutError, match="open the stream: no answer") as info:
            client.channel("agg", 0, 0, 1)
        assert info.value.peer == location and location in str(info.value)
        with pytest.raises(ExchangeTimeoutError, match="did not answer in time"):
            client.ping(timeout=0.5)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_batches_from_another_process_and_its_death(make_server, children):
    aligner = BarrierAligner(1, capacity=16)
    errors = Errors()
    server = make_server({("agg", 0): aligner}, on_error=errors)
    proc, line = spawn(_SENDER, server.location)
    children.append(proc)
    assert line == "sent"
    events = simplify(take_events(aligner, 7))
    assert events == [(ITEM, 0, (i,)) for i in range(5)] + [(SNAPSHOT, 0, False),
                                                             (ITEM, 0, (5,))]
    assert not errors.event.is_set()
    os.kill(proc.pid, signal.SIGKILL)
    assert errors.event.wait(DEADLINE), "the server did not notice the dead sender"
    error = errors.errors[0]
    assert isinstance(error, ExchangeError)
    assert error.peer.startswith("ipv4:127.0.0.1:") and error.peer in str(error)
    assert "agg[0] channel 0" in str(error) and "broke after 7 messages" in str(error)
    wait_for(lambda: server.streams == {}, "the stream to be dropped")
