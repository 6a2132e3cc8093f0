"""The acknowledging Redis Streams source against a real ``redis-server``: acks only after
the snapshot completes, redelivery after a crash drops what the snapshot covers, and
nothing is lost or duplicated across crashes at every point of the protocol.

Needs ``redis-server`` on PATH (Debian: ``apt-get install -y redis-server``): without it
these tests fail, they do not skip."""
import json
import pickle
import random
import re
import uuid

import pyarrow as pa
import pytest
import redis
from helpers import redis_server

from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import (
    ConnectorError,
    CorruptDataError,
    InvalidArgumentError,
    SourceChangedError,
)
from sparkjet.sources import RedisStreamProducer, RedisStreamSource


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        s = redis_server.start(tmp_path_factory.mktemp("redis"))
    except redis_server.RedisServerMissing as e:
        missing = str(e)
    else:
        yield s
        s.stop()
        return
    pytest.fail(missing, pytrace=False)


@pytest.fixture
def client(server):
    c = redis.Redis.from_url(server.url)
    yield c
    c.close()


def context(job_id=1, guarantee="exactly-once", execution_id=1):
    return ProcessorContext(job_id=job_id, execution_id=execution_id, vertex="source", processor=0,
                            processors=1, guarantee=guarantee)


def setup(server, partitions=1, **kwargs):
    """A source on fresh streams and a producer for them."""
    stream = f"s-{uuid.uuid4().hex[:8]}"
    source = RedisStreamSource(stream, partitions, server.url, **kwargs)
    return source, RedisStreamProducer(stream, partitions, server.url)


def read_available(reader, max_rows=1000):
    """Every row the reader returns until it has nothing right now."""
    out = []
    while True:
        batch = reader.read(max_rows)
        if batch is None:
            return out
        out.extend(batch.column("_id").to_pylist())


def pending(client, source, partition=0, group="sparkjet-job-1"):
    return client.xpending(f"{source.stream}:{partition}", group)["pending"]


def test_default_batches_hold_the_id_and_the_fields_as_strings(server):
    source, producer = setup(server)
    ids = producer.add_many(0, [{"a": "x", "b": 1}, {"a": "y"}, {"c": b"z"}])
    batch = source.open([0], context()).read(10)
    assert batch.schema.names == ["_id", "a", "b", "c"]
    assert batch.to_pylist() == [
        {"_id": ids[0], "a": "x", "b": "1", "c": None},
        {"_id": ids[1], "a": "y", "b": None, "c": None},
        {"_id": ids[2], "a": None, "b": None, "c": "z"},
    ]


def test_a_schema_converts_fields_and_reports_bad_values(server):
    schema = pa.schema([("n", pa.int64()), ("x", pa.float64()), ("raw", pa.binary()),
                        ("_id", pa.string())])
    source, producer = setup(server, schema=schema)
    ids = producer.add_many(0, pa.table({"n": [1, 2], "x": [0.5, None], "raw": [b"\xff", b"k"]}))
    batch = source.open([0], context()).read(10)
    assert batch.schema == schema
    assert batch.to_pylist() == [{"n": 1, "x": 0.5, "raw": b"\xff", "_id": ids[0]},
                                 {"n": 2, "x": None, "raw": b"k", "_id": ids[1]}]
    producer.add(0, {"n": "seven"})
    with pytest.raises(CorruptDataError, match="field 'n' .* int64"):
        source.open([0], context(job_id=2)).read(10)


def test_a_reader_without_partitions_is_at_its_end(server):
    source, _ = setup(server)
    reader = source.open([], context())
    assert reader.at_end() and reader.read(10) is None
    assert reader.snapshot_state() == {"unacked": {}, "ended": [], "group": "sparkjet-job-1",
                                       "delivered": {}}


def test_the_source_is_picklable(server):
    source, _ = setup(server, schema=pa.schema([("n", pa.int64())]))
    again = pickle.loads(pickle.dumps(source))
    assert (again.stream, again.url, again.schema) == (source.stream, source.url, source.schema)


def _decode(entries):
    return pa.record_batch({"len": [len(fields) for _, fields in entries]})


def test_a_decoder_builds_the_batch(server):
    source, producer = setup(server, decoder=_decode)
    producer.add_many(0, [{"a": 1, "b": 2}, {"a": 1}])
    assert source.open([0], context()).read(10).to_pylist() == [{"len": 2}, {"len": 1}]
    with pytest.raises(InvalidArgumentError, match="schema or a decoder"):
        RedisStreamSource("s", 1, schema=pa.schema([]), decoder=_decode)


def test_messages_are_acknowledged_only_after_their_snapshot_completes(server, client):
    source, producer = setup(server, partitions=2)
    for p in (0, 1):
        producer.add_many(p, [{"v": i} for i in range(10)])
    reader = source.open([0, 1], context())
    first = read_available(reader, max_rows=4)
    assert len(first) == 20
    assert pending(client, source, 0) == 10 and pending(client, source, 1) == 10
    state = reader.snapshot_state()  # barrier of snapshot 1
    assert sorted(i for ids in state["unacked"].values() for i in ids) == sorted(first)
    producer.add_many(0, [{"v": i} for i in range(10, 15)])
    after = read_available(reader)  # after the barrier: not covered by snapshot 1
    assert len(after) == 5 and pending(client, source, 0) == 15  # nothing acked yet
    reader.ack(1)  # snapshot 1 complete
    assert pending(client, source, 0) == 5 and pending(client, source, 1) == 0
    assert reader.snapshot_state()["unacked"] == {"0": after}
    reader.ack(2)
    assert pending(client, source, 0) == 0


def test_redelivery_after_a_crash_drops_what_the_snapshot_covers(server, client):
    source, producer = setup(server)
    ids = producer.add_many(0, [{"v": i} for i in range(20)])
    reader = source.open([0], context())
    before = []
    while len(before) < 8:
        before += reader.read(8).column("_id").to_pylist()
    state = reader.snapshot_state()  # snapshot 1 covers the first 8 ...
    lost = read_available(reader, max_rows=5)  # ... not these, read after its barrier
    assert before + lost == ids
    # Crash: snapshot 1 completed but ack(1) never ran; every id is still pending.
    reader.close()
    assert pending(client, source) == 20
    again = source.open([0], context())
    again.restore_state(state)
    redelivered = read_available(again, max_rows=3)
    assert redelivered == lost  # the ids in the state are dropped, the others replayed
    assert pending(client, source) == len(lost)  # the dropped ones were acknowledged
    again.snapshot_state()
    again.ack(2)
    assert pending(client, source) == 0


def _read_and_commit(source, producer, n, acked):
    """A reader that read ``n`` of 10 entries, a snapshot of it, and (``acked``) the ack
    that follows the snapshot's completion."""
    ids = producer.add_many(0, [{"v": i} for i in range(10)])
    reader = source.open([0], context())
    got = []
    while len(got) < n:
        got += reader.read(n - len(got)).column("_id").to_pylist()
    state = reader.snapshot_state()
    if acked:
        reader.ack(1)
    reader.close()
    return ids, state


@pytest.mark.parametrize("how", ["stream deleted and written again", "group destroyed",
                                 "server lost its data"])
def test_a_restore_never_rewinds_a_group_that_went_back(server, client, how):
    """The job's group delivered 6 entries, a snapshot holds them and they were acked.
    Then the group (or its stream) is gone: a new reader would make the group again from
    start_id and deliver the 6 again, duplicates the job's state already counts. The
    restore refuses, naming the stream, the group and both ids."""
    source, producer = setup(server)
    ids, state = _read_and_commit(source, producer, 6, acked=True)
    key = f"{source.stream}:0"
    if how == "group destroyed":
        client.xgroup_destroy(key, "sparkjet-job-1")
    elif how == "stream deleted and written again":
        client.delete(key)
        producer.add_many(0, [{"v": i} for i in range(10)])
    else:
        client.flushall()
    again = source.open([0], context(execution_id=2))   # makes the group again, from "0"
    with pytest.raises(SourceChangedError, match=rf"consumer group 'sparkjet-job-1' of stream "
                                                 rf"'{key}' has delivered up to .* but the "
                                                 rf"job's snapshot had read up to {ids[5]}"):
        again.restore_state(state)
    assert SourceChangedError.deterministic


def test_a_group_deleted_while_the_job_reads_is_named(server, client):
    source, producer = setup(server)
    producer.add_many(0, [{"v": i} for i in range(4)])
    reader = source.open([0], context())
    read_available(reader)
    client.xgroup_destroy(f"{source.stream}:0", "sparkjet-job-1")
    with pytest.raises(SourceChangedError, match="was deleted while the job read it"):
        reader.read(10)


def test_a_state_of_another_group_moves_the_new_group_to_its_position(server, client):
    """An initial snapshot of another job (its own group): this job's new group starts where
    that one stood, not at start_id, so nothing the export covers is read again."""
    source, producer = setup(server)
    ids, state = _read_and_commit(source, producer, 6, acked=True)
    other = RedisStreamSource(source.stream, 1, server.url, group="job-two")
    reader = other.open([0], context(job_id=2))
    reader.restore_state(state)
    assert read_available(reader) == ids[6:]


def test_a_restore_after_a_healthy_crash_still_replays_what_was_lost(server, client):
    """The check does not get in the way of the ordinary recovery: snapshot taken, not yet
    acknowledged, reader crashed; the group is where it was."""
    source, producer = setup(server)
    ids, state = _read_and_commit(source, producer, 6, acked=False)
    again = source.open([0], context(execution_id=2))
    again.restore_state(state)
    assert read_available(again) == ids[6:]


def test_what_a_zombie_reads_is_claimed_by_the_live_reader(server, client):
    """A reader of execution 1 that lives on after execution 2 took over (a zombie) reads
    new messages: they go pending under its consumer, where the live reader, which reads
    only new messages, would never see them. The live reader claims them."""
    source, producer = setup(server, reclaim_interval=0)
    ids = producer.add_many(0, [{"v": i} for i in range(10)])
    zombie = source.open([0], context(execution_id=1))
    covered = zombie.read(4).column("_id").to_pylist()
    state = zombie.snapshot_state()                      # the snapshot execution 2 restores
    live = source.open([0], context(execution_id=2))
    live.restore_state(state)
    got = read_available(live)
    assert got == ids[4:]                                 # the covered 4 dropped and acked
    more = producer.add_many(0, [{"v": i} for i in range(10, 15)])
    stolen = zombie.read(3).column("_id").to_pylist()     # the zombie reads on
    assert stolen == more[:3]
    got += read_available(live)
    assert sorted(got) == sorted(ids[4:] + more) and len(got) == len(set(got))
    assert covered == ids[:4]
    consumers = {c["name"].decode() for c in client.xinfo_consumers(f"{source.stream}:0", "sparkjet-job-1")}
    assert consumers == {"sparkjet-e2"}
    live.snapshot_state()
    live.ack(1)
    assert pending(client, source) == 0


def test_restart_without_a_snapshot_replays_every_pending_message(server, client):
    source, producer = setup(server)
    ids = producer.add_many(0, [{"v": i} for i in range(6)])
    reader = source.open([0], context())
    assert read_available(reader) == ids
    reader.close()
    again = source.open([0], context())
    again.restore_state(None)
    assert read_available(again) == ids


def test_deleted_pending_messages_are_not_replayed(server, client):
    source, producer = setup(server)
    ids = producer.add_many(0, [{"v": i} for i in range(4)])
    reader = source.open([0], context())
    read_available(reader)
    client.xdel(f"{source.stream}:0", ids[1])
    again = source.open([0], context())
    again.restore_state({"unacked": {"0": [ids[0]]}, "ended": []})
    assert read_available(again) == [ids[2], ids[3]]
    assert pending(client, source) == 2


def test_guarantee_none_acknowledges_on_delivery(server, client):
    source, producer = setup(server)
    producer.add_many(0, [{"v": i} for i in range(5)])
    reader = source.open([0], context(guarantee="none"))
    assert len(read_available(reader)) == 5
    assert pending(client, source) == 0
    state = reader.snapshot_state()
    assert (state["unacked"], state["ended"]) == ({}, [])
    assert list(state["delivered"]) == ["0"]  # where the group stood, all the same


def test_each_job_has_its_own_consumer_group(server):
    source, producer = setup(server)
    ids = producer.add_many(0, [{"v": i} for i in range(3)])
    assert read_available(source.open([0], context(job_id=1))) == ids
    assert read_available(source.open([0], context(job_id=2))) == ids
    assert read_available(source.open([0], context(job_id=1))) == ids  # pending, replayed


def test_end_markers_make_the_source_bounded(server, client):
    source, producer = setup(server, partitions=2)
    producer.add_many(0, [{"v": 1}])
    producer.add_many(1, [{"v": 2}, {"v": 3}])
    producer.end()
    reader = source.open([0, 1], context())
    assert not reader.at_end()
    assert len(read_available(reader)) == 3
    assert reader.at_end()
    state = reader.snapshot_state()
    assert state["ended"] == [0, 1]
    assert sum(len(v) for v in state["unacked"].values()) == 5  # the markers are acked too
    reader.ack(1)
    assert pending(client, source, 0) == pending(client, source, 1) == 0
    restored = source.open([0, 1], context())
    restored.restore_state(state)
    assert restored.at_end() and read_available(restored) == []


# -- poison messages: on_error of the source ---------------------------------------------------

POISON_SCHEMA = pa.schema([("n", pa.int64()), ("s", pa.string()), ("_id", pa.string())])
#: (partition, index in it) -> a message that does not decode with POISON_SCHEMA: a field
#: that is not an int64, one that is not UTF-8
POISON = {(0, 7): {"n": "seven", "s": "a"}, (1, 3): {"n": 3, "s": b"\xff\xfe"},
          (1, 20): {"n": "2.5", "s": "b"}}
POISON_COLUMN = {(0, 7): "n", (1, 3): "s", (1, 20): "n"}


def poisoned_streams(server, per_partition=30):
    """Two partitions of messages (end markers after them), three that do not decode
    (``POISON``). Returns the stream, the good messages' (n, partition, id) and the bad
    ones' {(partition, index): id}."""
    stream = f"s-{uuid.uuid4().hex[:8]}"
    producer = RedisStreamProducer(stream, 2, server.url)
    good, bad = [], {}
    for p in range(2):
        rows = [POISON.get((p, i), {"n": p * 1000 + i, "s": f"v{i}"}) for i in range(per_partition)]
        ids = producer.add_many(p, rows)
        for i, message_id in enumerate(ids):
            if (p, i) in POISON:
                bad[(p, i)] = message_id
            else:
                good.append((p * 1000 + i, p, message_id))
    producer.end()
    producer.close()
    return stream, sorted(good), bad


def poison_job(server, tmp_path, stream, on_error, name):
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import TransactionalFileSink

    source = RedisStreamSource(stream, 2, server.url, schema=POISON_SCHEMA)
    pipeline = (Pipeline().read_from(source, on_error=on_error)
                .write_to(TransactionalFileSink(tmp_path / "out")))
    return Job(pipeline, JobConfig(name=name, snapshot_store=str(tmp_path / "snaps"),
                                   local_parallelism=2))


def check_all_acknowledged(client, stream, job_id):
    for p in range(2):
        assert client.xpending(f"{stream}:{p}", f"sparkjet-job-{job_id}")["pending"] == 0


def test_a_message_that_does_not_decode_fails_the_job_naming_stream_id_and_field(server, tmp_path):
    from sparkjet.errors import BadRecordError, MemberFailedError

    stream, _, bad = poisoned_streams(server)
    with pytest.raises(MemberFailedError) as e:
        poison_job(server, tmp_path, stream, "fail", "redis-poison-fail").run(isolated=False)
    assert isinstance(e.value.__cause__, BadRecordError) and e.value.__cause__.deterministic
    message = str(e.value)
    where = "|".join(f"stream '{stream}:{p}' id {bad[(p, i)]}: field '{POISON_COLUMN[(p, i)]}'"
                     for p, i in bad)
    assert re.search(rf"source \(RedisStreamSource\('{stream}'.*\): ({where}) value .* does "
                     rf"not convert to (int64|string)", message), message


def test_skipped_messages_leave_the_good_ones_and_are_acknowledged(server, client, tmp_path):
    from sparkjet.sinks import TransactionalFileSink

    stream, good, _ = poisoned_streams(server)
    result = poison_job(server, tmp_path, stream, "skip", "redis-poison-skip").run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "out")
    got = sorted((n, n // 1000, i) for n, i in zip(out.column("n").to_pylist(),
                                                   out.column("_id").to_pylist()))
    assert got == good
    assert result.skipped_events == len(POISON) and result.dead_letters == 0
    check_all_acknowledged(client, stream, result.job_id)


def test_messages_that_do_not_decode_go_to_the_dead_letters_with_their_ids(server, client,
                                                                           tmp_path):
    from sparkjet.sinks import DEAD_LETTER_SCHEMA, TransactionalFileSink

    stream, good, bad = poisoned_streams(server)
    dead = TransactionalFileSink(tmp_path / "dead")
    result = poison_job(server, tmp_path, stream, dead, "redis-poison-dead").run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "out")
    assert sorted((n, n // 1000, i) for n, i in zip(out.column("n").to_pylist(),
                                                    out.column("_id").to_pylist())) == good
    letters = TransactionalFileSink.read(tmp_path / "dead")
    assert letters.schema.equals(DEAD_LETTER_SCHEMA, check_metadata=False)
    rows = sorted(letters.to_pylist(), key=lambda r: r["position"])
    want = sorted(((p, i) for p, i in bad), key=lambda k: f"stream '{stream}:{k[0]}' id {bad[k]}")
    assert [r["position"] for r in rows] == [f"stream '{stream}:{p}' id {bad[(p, i)]}"
                                             for p, i in want]
    for r, (p, i) in zip(rows, want):
        assert (r["stage"], r["partition"], r["offset"], r["format"]) == ("source", p, None, "raw")
        assert r["column"] == POISON_COLUMN[(p, i)]
        assert r["reason"].startswith(f"field '{r['column']}' value "), r["reason"]
        assert json.loads(r["record"]) == {
            k: v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else str(v)
            for k, v in POISON[(p, i)].items()}
    assert result.dead_letters == len(POISON)
    check_all_acknowledged(client, stream, result.job_id)


def _poison_decoder(entries):
    values = []
    for _, fields in entries:
        if b"boom" in fields:
            raise ValueError("boom in the message")
        values.append(int(fields[b"v"]))
    return pa.record_batch({"v": pa.array(values, pa.int64())})


@pytest.mark.parametrize("kind", ["no schema", "decoder"])
def test_a_reader_hands_each_bad_message_to_on_error_and_returns_the_rest(server, kind):
    """Without a schema a field must be UTF-8; a decoder may raise on a message: either
    way the bad message alone is reported (its field, id and fields), the others read."""
    kwargs = {"decoder": _poison_decoder} if kind == "decoder" else {}
    source, producer = setup(server, **kwargs)
    bad = {"v": 2, "boom": b"\xff"}
    ids = producer.add_many(0, [{"v": 1}, bad, {"v": 3}])
    reader = source.open([0], context())
    records = []
    reader.on_bad_record = records.append
    batch = reader.read(10)
    if kind == "decoder":
        assert batch.column("v").to_pylist() == [1, 3]
    else:
        assert batch.column("_id").to_pylist() == [ids[0], ids[2]]
        assert batch.schema.names == ["_id", "v"]
    [record] = records
    assert record.position == f"stream '{source.stream}:0' id {ids[1]}"
    assert record.partition == 0 and json.loads(record.record) == {"v": "2", "boom": "\\xff"}
    if kind == "decoder":
        assert record.column is None
        assert record.reason == "the decoder raised ValueError: boom in the message"
    else:
        assert record.column == "boom" and "is not UTF-8" in record.reason
    assert reader.snapshot_state()["unacked"] == {"0": ids}   # the bad one is acked too


class _Job:
    """A model of the runtime around one reader: the job's state is the list of ids it
    has processed (what a sink would hold), saved with the source state at each barrier
    and restored with it after a crash."""

    def __init__(self, source):
        self.source = source
        self.snapshot = None  # (source state, processed) of the last complete snapshot
        self.snapshot_id = 0
        self.start()

    def start(self):
        self.reader = self.source.open(list(range(self.source.partitions)), context())
        if self.snapshot is None:
            self.reader.restore_state(None)
            self.processed = []
        else:
            self.reader.restore_state(self.snapshot[0])
            self.processed = list(self.snapshot[1])

    def read(self, max_rows):
        batch = self.reader.read(max_rows)
        if batch is not None:
            # Ids are unique per stream only: a message is (partition, id).
            self.processed += zip(batch.column("p").to_pylist(), batch.column("_id").to_pylist())

    def barrier(self):
        self.snapshot_id += 1
        return self.snapshot_id, (self.reader.snapshot_state(), list(self.processed))

    def complete(self, taken):
        self.snapshot = taken

    def crash(self):
        self.reader.close()  # no ack, no further snapshot: the process is gone
        self.start()


@pytest.mark.parametrize("seed", range(6))
def test_nothing_is_lost_or_duplicated_across_crashes_at_every_point(server, client, seed):
    rng = random.Random(seed)
    source, producer = setup(server, partitions=3)
    produced = []
    job = _Job(source)
    crashes = 0
    for round_ in range(12):
        for p in range(3):
            ids = producer.add_many(p, [{"p": p, "r": round_} for _ in range(rng.randint(0, 9))])
            produced += [(str(p), i) for i in ids]
        for _ in range(rng.randint(0, 4)):
            job.read(rng.randint(1, 7))
        point = rng.choice(["after reads", "after barrier", "after complete", "mid ack",
                            "after ack", "no crash", "no crash"])
        if point == "after reads":
            job.crash()
            crashes += 1
            continue
        sid, taken = job.barrier()
        for _ in range(rng.randint(0, 2)):
            job.read(rng.randint(1, 7))  # reads after the barrier, before completion
        if point == "after barrier":  # snapshot never completes
            job.crash()
            crashes += 1
            continue
        job.complete(taken)
        if point == "after complete":  # crash between completion and ack
            job.crash()
            crashes += 1
            continue
        if point == "mid ack":  # some ids acknowledged, the process dies before the rest
            ids = taken[0]["unacked"].get("0", [])
            if len(ids) > 1:
                client.xack(f"{source.stream}:0", "sparkjet-job-1", *ids[: len(ids) // 2])
            job.crash()
            crashes += 1
            continue
        job.reader.ack(sid)
        if point == "after ack":
            job.crash()
            crashes += 1
    producer.end()
    while not job.reader.at_end():
        job.read(50)
    sid, taken = job.barrier()  # the terminal snapshot
    job.complete(taken)
    job.reader.ack(sid)
    assert crashes > 0
    assert sorted(job.processed) == sorted(produced)  # nothing lost, nothing duplicated
    assert len(set(job.processed)) == len(job.processed)
    for p in range(3):
        assert pending(client, source, p) == 0


def test_credentials_are_used_and_never_shown(tmp_path, monkeypatch):
    """A Redis that requires a password: given in the URL, as an argument or in the
    environment, it authenticates the reader; a wrong one is a ConnectorError; neither
    shows in a repr or a message."""
    secured = redis_server.start(tmp_path)
    try:
        redis.Redis(port=secured.port).config_set("requirepass", "s3cret-pw")
        base = f"redis://127.0.0.1:{secured.port}/0"
        in_url = RedisStreamSource("creds", 1, f"redis://:s3cret-pw@127.0.0.1:{secured.port}/0")
        assert "s3cret" not in repr(in_url) and "***" in repr(in_url)
        as_argument = RedisStreamSource("creds", 1, base, password="s3cret-pw")
        monkeypatch.setenv("SPARKJET_REDIS_PASSWORD", "s3cret-pw")
        from_env = RedisStreamSource("creds", 1, base)
        monkeypatch.delenv("SPARKJET_REDIS_PASSWORD")
        for source in (in_url, as_argument, from_env):
            assert "s3cret" not in repr(source)
            reader = source.open([0], context())
            assert reader.read(10) is None  # authenticated: an empty stream, no error
            reader.close()
        wrong = RedisStreamSource("creds", 1, f"redis://:wrong-pw@127.0.0.1:{secured.port}/0")
        with pytest.raises(ConnectorError, match="redis-stream source") as info:
            wrong.open([0], context())
        assert "wrong-pw" not in str(info.value) and "s3cret" not in str(info.value)
        with pytest.raises(ConnectorError):
            RedisStreamSource("creds", 1, base).open([0], context())  # no password at all
    finally:
        secured.stop()
