"""The generator and the Arrow log sources: determinism, replay from offsets, rate limits,
reading a log while it is appended, and bounded ends."""
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sparkjet.connectors.arrow_log import segment_path
from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import (
    CorruptDataError,
    InvalidArgumentError,
    SourceChangedError,
    UnsupportedTypeError,
)
from sparkjet.sources import (
    ArrowLogSource,
    ArrowLogWriter,
    GeneratorSource,
    LogLockedError,
    RedisStreamSource,
)

CTX = ProcessorContext(job_id=1, execution_id=1, vertex="source", processor=0, processors=1)
DETERMINISTIC = ["id", "key", "value"]


def drain(reader, max_rows=1000, limit=100_000):
    """Every batch a bounded reader returns until it is at its end."""
    out = []
    for _ in range(limit):
        if reader.at_end():
            return out
        batch = reader.read(max_rows)
        if batch is not None:
            out.append(batch)
    raise AssertionError("the reader never reached its end")


def rows(batches, columns=None):
    if not batches:
        return []
    table = pa.Table.from_batches(batches)
    return (table.select(columns) if columns else table).to_pylist()


# ---------------------------------------------------------------------------- generator


def test_events_are_a_function_of_index_and_seed():
    source = GeneratorSource(keys=1000, seed=7)
    a = source.events(0, 5000)
    assert a.equals(GeneratorSource(keys=1000, seed=7).events(0, 5000))
    assert a.slice(1000, 2000).equals(source.events(1000, 3000))
    assert not a.column("key").equals(GeneratorSource(keys=1000, seed=8).events(0, 5000).column("key"))
    keys = a.column("key").to_numpy()
    values = a.column("value").to_numpy()
    assert keys.min() >= 0 and keys.max() < 1000
    assert len(np.unique(keys)) > 900  # spread over the key space
    assert np.array_equal(values, np.floor(values)) and values.min() >= 0 and values.max() < 1024


def test_reader_output_equals_events_and_interleaves_partitions():
    source = GeneratorSource(total=1000, partitions=4, keys=50, batch_size=64)
    reader = source.open([0, 1, 2, 3], CTX)
    batches = drain(reader, max_rows=100)
    # Partitions take turns, one partition per batch, batches capped by batch_size.
    parts = [set((b.column("id").to_numpy() % 4).tolist()) for b in batches]
    assert all(len(p) == 1 for p in parts)
    assert [p.pop() for p in parts[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert max(b.num_rows for b in batches) == 64
    table = pa.Table.from_batches(batches)
    assert table.schema.field("ts").type == pa.timestamp("ns", "UTC")
    assert table.select(DETERMINISTIC).sort_by("id").equals(source.events(0, 1000))
    # Within a partition, events come in index order.
    for p in range(4):
        ids = [i for i in table.column("id").to_pylist() if i % 4 == p]
        assert ids == sorted(ids)
    assert reader.at_end() and reader.read(100) is None
    assert reader.snapshot_state()["offsets"] == {"0": 250, "1": 250, "2": 250, "3": 250}


def test_uneven_total_and_subset_of_partitions():
    source = GeneratorSource(total=10, partitions=4)
    assert [source.partition_size(p) for p in range(4)] == [3, 3, 2, 2]
    got = rows(drain(source.open([3, 1], CTX)), ["id"])
    assert sorted(r["id"] for r in got) == [1, 3, 5, 7, 9]


def test_same_offsets_give_the_same_data():
    source = GeneratorSource(total=5000, partitions=3, keys=100, batch_size=100)
    state = {"offsets": {"0": 17, "1": 400, "2": 0}}
    outputs = []
    for _ in range(2):
        reader = source.open([0, 1, 2], CTX)
        reader.restore_state(json.loads(json.dumps(state)))
        outputs.append(rows(drain(reader, max_rows=77), DETERMINISTIC))
    assert outputs[0] == outputs[1]
    ids = {r["id"] for r in outputs[0]}
    assert ids == {i for i in range(5000) if i // 3 >= {0: 17, 1: 400, 2: 0}[i % 3]}


@pytest.mark.parametrize("cut", [0, 1, 5, 13])
def test_replay_after_restore_equals_the_original_continuation(cut):
    source = GeneratorSource(total=3000, partitions=4, keys=100, batch_size=128)
    reader = source.open([0, 1, 2, 3], CTX)
    for _ in range(cut):
        reader.read(50)
    state = json.loads(json.dumps(reader.snapshot_state()))
    original = rows(drain(reader, max_rows=50), DETERMINISTIC)
    again = source.open([0, 1, 2, 3], CTX)
    again.restore_state(state)
    assert rows(drain(again, max_rows=50), DETERMINISTIC) == original


def test_restore_from_merged_states_of_other_readers():
    source = GeneratorSource(total=400, partitions=4, keys=10)
    a, b = source.open([0, 2], CTX), source.open([1, 3], CTX)
    seen = rows([a.read(30), b.read(20), a.read(30)], ["id"])
    merged = {"offsets": {**a.snapshot_state()["offsets"], **b.snapshot_state()["offsets"]}}
    one = source.open([0, 1, 2, 3], CTX)
    one.restore_state(merged)
    rest = rows(drain(one), ["id"])
    assert sorted(r["id"] for r in seen + rest) == list(range(400))
    with pytest.raises(InvalidArgumentError, match="no offset for generator partition 1"):
        source.open([1], CTX).restore_state(a.snapshot_state())
    with pytest.raises(InvalidArgumentError, match="0..100"):
        source.open([0], CTX).restore_state({"offsets": {"0": 101}})


def test_rate_limit_bounds_the_events_produced():
    rate, partitions = 2000.0, 4
    source = GeneratorSource(partitions=partitions, rate=rate, batch_size=1_000_000)
    began = time.monotonic()
    reader = source.open([0, 1, 2, 3], CTX)
    half = source.open([0, 1], CTX)
    produced = produced_half = 0
    deadline = began + 0.3
    while time.monotonic() < deadline:
        for r, counter in ((reader, "all"), (half, "half")):
            batch = r.read(1_000_000)
            if batch is not None:
                if counter == "all":
                    produced += batch.num_rows
                else:
                    produced_half += batch.num_rows
        elapsed = time.monotonic() - began
        # The reader's schedule starts at its first read, after `began`.
        assert produced <= rate * elapsed
        assert produced_half <= rate / 2 * elapsed
        time.sleep(0.002)
    assert produced > 0 and produced_half > 0
    assert not reader.at_end()


def test_timestamps_are_creation_times():
    before = time.time_ns()
    batch = GeneratorSource(partitions=1).open([0], CTX).read(100)
    ts = batch.column("ts").cast(pa.int64()).to_numpy()
    assert (ts >= before).all() and (ts <= time.time_ns()).all()
    limited = GeneratorSource(partitions=1, rate=100_000).open([0], CTX)
    got = []
    while sum(len(b) for b in got) < 500:
        b = limited.read(1000)
        if b is not None:
            got.append(b.column("ts").cast(pa.int64()).to_numpy())
    ts = np.concatenate(got)
    # Scheduled times: evenly spaced at 1/rate, never in the future.
    assert (np.diff(ts) >= 0).all() and ts[-1] <= time.time_ns()
    assert abs((ts[-1] - ts[0]) / (len(ts) - 1) - 10_000) < 2


@pytest.mark.parametrize("keys", [7, 100_000, 2**30])  # dense (bincount) and sparse paths
def test_expected_counts_match_a_direct_computation(keys):
    source = GeneratorSource(total=30_000, keys=keys, seed=3)
    expected = source.events(500, 30_000).group_by("key").aggregate(
        [("value", "count"), ("value", "sum")]).sort_by("key")
    got = source.expected_counts(start=500)
    assert got.column_names == ["key", "count", "sum"]
    assert got.column("key").to_pylist() == expected.column("key").to_pylist()
    assert got.column("count").to_pylist() == expected.column("value_count").to_pylist()
    assert got.column("sum").to_pylist() == expected.column("value_sum").to_pylist()
    assert pc.sum(got.column("count")).as_py() == 29_500
    assert source.expected_counts(0).num_rows == 0


def test_expected_counts_equal_what_the_reader_produces():
    source = GeneratorSource(total=20_000, partitions=3, keys=500, batch_size=999)
    table = pa.Table.from_batches(drain(source.open([0, 1, 2], CTX), max_rows=4096))
    counted = table.group_by("key").aggregate([("value", "count"), ("value", "sum")]).sort_by("key")
    expected = source.expected_counts()
    assert expected.column("count").to_pylist() == counted.column("value_count").to_pylist()
    assert expected.column("sum").to_pylist() == counted.column("value_sum").to_pylist()


def test_a_reader_without_partitions_is_at_its_end(tmp_path):
    ArrowLogWriter(tmp_path, 1, SCHEMA).close()
    for source in (GeneratorSource(), ArrowLogSource(tmp_path)):
        reader = source.open([], CTX)
        assert reader.at_end() and reader.read(10) is None
        reader.restore_state(json.loads(json.dumps(reader.snapshot_state())))


def test_sources_are_picklable(tmp_path):
    for source in (GeneratorSource(total=5, rate=10.0), ArrowLogSource(tmp_path)):
        again = pickle.loads(pickle.dumps(source))
        assert type(again) is type(source) and repr(again) == repr(source)


def test_generator_argument_errors():
    for kwargs in ({"partitions": 0}, {"keys": 0}, {"keys": 2**32 + 1}, {"rate": 0},
                   {"rate": float("inf")}, {"total": -1}, {"batch_size": 0}, {"seed": -1}):
        with pytest.raises(InvalidArgumentError):
            GeneratorSource(**kwargs)
    source = GeneratorSource(partitions=2)
    for parts in ([2], [-1], [0, 0]):
        with pytest.raises(InvalidArgumentError):
            source.open(parts, CTX)
    with pytest.raises(InvalidArgumentError, match="needs stop"):
        source.expected_counts()
    with pytest.raises(InvalidArgumentError, match="max_rows"):
        source.open([0], CTX).read(0)
    assert GeneratorSource(**source.config) == source


# ---------------------------------------------------------------------------- Arrow log

SCHEMA = pa.schema([("p", pa.int32()), ("n", pa.int64()), ("s", pa.string())])


def make_batch(p, start, count):
    n = np.arange(start, start + count, dtype=np.int64)
    return pa.record_batch([pa.array(np.full(count, p, dtype=np.int32)), pa.array(n),
                            pa.array([f"r{i}" for i in n])], schema=SCHEMA)


def by_partition(batches):
    out = {}
    for r in rows(batches):
        out.setdefault(r["p"], []).append(r["n"])
    return out


def test_log_round_trip(tmp_path):
    with ArrowLogWriter(tmp_path, 3, SCHEMA) as log:
        for i in range(4):
            for p in range(3):
                log.append(p, make_batch(p, i * 10, 10 + p))
        log.append(1, pa.Table.from_batches([make_batch(1, 100, 3), make_batch(1, 103, 2)]))
        log.append(2, make_batch(2, 0, 0))  # empty: not written
    source = ArrowLogSource(tmp_path)
    assert source.partition_count() == 3
    reader = source.open([0, 1, 2], CTX)
    batches = drain(reader, max_rows=7)
    assert all(b.schema.equals(SCHEMA) and b.num_rows <= 7 for b in batches)
    got = by_partition(batches)
    assert got[0] == [n for i in range(4) for n in range(i * 10, i * 10 + 10)]
    assert got[1] == [n for i in range(4) for n in range(i * 10, i * 10 + 11)] + list(range(100, 105))
    assert got[2] == [n for i in range(4) for n in range(i * 10, i * 10 + 12)]
    assert reader.at_end()
    # A segment is a plain Arrow IPC stream any Arrow reader opens.
    whole = pa.ipc.open_stream(segment_path(tmp_path, 2, 0)).read_all()
    assert whole.column("n").to_pylist() == got[2]


@pytest.mark.parametrize("change", ["truncated", "deleted", "recreated"])
def test_log_changed_under_a_resumed_job(tmp_path, change):
    """Before, a truncated segment left the restored reader waiting forever at an offset
    past its end, and a deleted log was a CorruptDataError a restart tried again."""
    with ArrowLogWriter(tmp_path, 1, SCHEMA) as log:
        for i in range(5):
            log.append(0, make_batch(0, i * 10, 10))
    source = ArrowLogSource(tmp_path)
    reader = source.open([0], CTX)
    assert len(rows(drain(reader, max_rows=10))) == 50
    state = json.loads(json.dumps(reader.snapshot_state()))
    reader.close()
    segment = segment_path(tmp_path, 0, 0)
    if change == "truncated":
        os.truncate(segment, os.path.getsize(segment) // 2)
    else:
        import shutil
        shutil.rmtree(tmp_path / "partition-00000")
        os.remove(tmp_path / "log.json")
        if change == "recreated":
            with ArrowLogWriter(tmp_path, 1, SCHEMA) as log:
                log.append(0, make_batch(0, 0, 3))
    again = source.open([0], CTX)
    again.restore_state(state)
    what = "fewer than the offset's byte" if change != "deleted" else "missing"
    with pytest.raises(SourceChangedError, match=rf"segment-000000000000.arrows: the segment "
                                                 rf".*{what}"):
        for _ in range(100):
            again.read(10)
    again.close()


def test_log_rolls_segments_and_seals_them(tmp_path):
    with ArrowLogWriter(tmp_path, 1, SCHEMA, segment_bytes=2000) as log:
        for i in range(30):
            log.append(0, make_batch(0, i * 20, 20))
    files = sorted(os.listdir(tmp_path / "partition-00000"))
    assert len(files) > 5 and files[0] == "segment-000000000000.arrows"
    total = []
    for name in files:
        data = (tmp_path / "partition-00000" / name).read_bytes()
        assert data.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")  # sealed
        total += pa.ipc.open_stream(data).read_all().column("n").to_pylist()
    assert total == list(range(600))
    assert by_partition(drain(ArrowLogSource(tmp_path).open([0], CTX), max_rows=9))[0] == total


def test_log_offsets_replay_from_every_point(tmp_path):
    with ArrowLogWriter(tmp_path, 2, SCHEMA, segment_bytes=1500) as log:
        for i in range(12):
            log.append(i % 2, make_batch(i % 2, i * 10, 10))
    source = ArrowLogSource(tmp_path)
    reader = source.open([0, 1], CTX)
    states, outputs = [], []
    while not reader.at_end():
        states.append(json.loads(json.dumps(reader.snapshot_state())))
        batch = reader.read(4)  # slices batches: offsets fall mid-batch
        outputs.append(rows([batch]) if batch is not None else [])
    assert any(o["row"] for s in states for o in s["offsets"].values())
    assert any(o["segment"] > 0 for s in states for o in s["offsets"].values())
    for k, state in enumerate(states):
        again = source.open([0, 1], CTX)
        again.restore_state(state)
        assert rows(drain(again, max_rows=4)) == [r for o in outputs[k:] for r in o], k


def test_log_is_readable_while_appended_by_another_thread(tmp_path):
    writer = ArrowLogWriter(tmp_path, 2, SCHEMA, segment_bytes=4000)
    count, size = 300, 17

    def produce():
        for i in range(count):
            writer.append(i % 2, make_batch(i % 2, i * size, size))
            if i % 10 == 0:
                time.sleep(0.001)
        writer.close()

    thread = threading.Thread(target=produce)
    reader = ArrowLogSource(tmp_path).open([0, 1], CTX)
    thread.start()
    batches, idle = [], 0
    try:
        while not reader.at_end():
            batch = reader.read(25)
            if batch is None:
                idle += 1
                time.sleep(0.0005)
            else:
                batches.append(batch)
    finally:
        thread.join()
    got = by_partition(batches)
    for p in (0, 1):
        assert got[p] == [n for i in range(p, count, 2) for n in range(i * size, (i + 1) * size)]


# Copies a closed log into an empty directory a few bytes at a time, as a slow writer in
# another process would: messages are seen half-written all the time. A segment's successor
# is created before the segment's end-of-stream marker, as ArrowLogWriter does.
_SLOW_COPY = """
import os, sys, time
src, dst = sys.argv[1], sys.argv[2]
part = "partition-00000"
os.makedirs(os.path.join(dst, part))
names = sorted(os.listdir(os.path.join(src, part)))
for k, name in enumerate(names):
    data = open(os.path.join(src, part, name), "rb").read()
    with open(os.path.join(dst, part, name), "ab", buffering=0) as f:
        for i in range(0, len(data) - 8, 13):
            f.write(data[i:min(i + 13, len(data) - 8)])
            if i % 520 == 0:
                time.sleep(0.001)
        if k + 1 < len(names):
            open(os.path.join(dst, part, names[k + 1]), "ab").close()
        f.write(data[-8:])
"""


def test_log_is_readable_while_another_process_writes_it_byte_by_byte(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    with ArrowLogWriter(src, 1, SCHEMA, segment_bytes=3000) as log:
        for i in range(40):
            log.append(0, make_batch(0, i * 9, 9))
    dst.mkdir()
    (dst / "log.json").write_bytes((src / "log.json").read_bytes())
    reader = ArrowLogSource(dst).open([0], CTX)
    copier = subprocess.Popen([sys.executable, "-c", _SLOW_COPY, str(src), str(dst)])
    batches, idle = [], 0
    try:
        deadline = time.monotonic() + 20
        while not reader.at_end() and time.monotonic() < deadline:
            batch = reader.read(5)
            if batch is None:
                idle += 1
            else:
                batches.append(batch)
    finally:
        assert copier.wait(20) == 0
    assert by_partition(batches)[0] == list(range(360))
    assert idle > 0  # it did catch up with the writer


def test_log_partial_trailing_message_is_retried_not_an_error(tmp_path):
    writer = ArrowLogWriter(tmp_path, 1, SCHEMA)
    writer.append(0, make_batch(0, 0, 5))
    reader = ArrowLogSource(tmp_path).open([0], CTX)
    assert reader.read(100).num_rows == 5
    message = make_batch(0, 5, 6).serialize().to_pybytes()
    path = segment_path(tmp_path, 0, 0)
    for cut in (3, 8, 20, len(message) - 1):  # inside the prefix, metadata and body
        with open(path, "ab") as f:
            f.write(message[:cut])
        state = reader.snapshot_state()
        assert reader.read(100) is None and not reader.at_end()
        assert reader.snapshot_state() == state  # nothing consumed
        os.truncate(path, os.path.getsize(path) - cut)
    with open(path, "ab") as f:
        f.write(message[:30])
    assert reader.read(100) is None
    with open(path, "ab") as f:
        f.write(message[30:])
    assert reader.read(100).column("n").to_pylist() == list(range(5, 11))
    writer.close()


def test_writer_reopened_after_a_crash_cuts_the_partial_message(tmp_path):
    writer = ArrowLogWriter(tmp_path, 1, SCHEMA, segment_bytes=1000)
    for i in range(5):
        writer.append(0, make_batch(0, i * 10, 10))
    segment = writer._segments[0]
    with open(segment_path(tmp_path, 0, segment), "ab") as f:
        f.write(make_batch(0, 999, 3).serialize().to_pybytes()[:40])  # died mid-write
    writer._release()  # the lock goes, as when the process dies
    with ArrowLogWriter(tmp_path, 1, SCHEMA, segment_bytes=1000) as log:
        log.append(0, make_batch(0, 50, 10))
    got = by_partition(drain(ArrowLogSource(tmp_path).open([0], CTX)))[0]
    assert got == list(range(60))


def test_writer_reopened_after_dying_mid_roll_seals_the_orphan(tmp_path):
    writer = ArrowLogWriter(tmp_path, 1, SCHEMA)
    writer.append(0, make_batch(0, 0, 10))
    # The successor exists but the old segment was never sealed.
    with open(segment_path(tmp_path, 0, 1), "wb") as f:
        f.write(SCHEMA.serialize().to_pybytes()[:10])
    writer._release()
    with ArrowLogWriter(tmp_path, 1, SCHEMA) as log:
        log.append(0, make_batch(0, 10, 5))
    assert by_partition(drain(ArrowLogSource(tmp_path).open([0], CTX)))[0] == list(range(15))


def test_log_end_only_once_the_writer_closes(tmp_path):
    writer = ArrowLogWriter(tmp_path, 2, SCHEMA, segment_bytes=500)
    for i in range(6):
        writer.append(i % 2, make_batch(i % 2, i, 4))
    reader = ArrowLogSource(tmp_path).open([0, 1], CTX)
    got = []
    for _ in range(50):
        batch = reader.read(100)
        if batch is not None:
            got.append(batch)
    assert sum(b.num_rows for b in got) == 24
    assert not reader.at_end()  # everything read, but the log is still open
    writer.close()
    assert not reader.at_end()  # the seal is not read yet
    assert reader.read(100) is None and reader.read(100) is None
    assert reader.at_end()
    # Reopening the log for append opens it again for readers.
    with ArrowLogWriter(tmp_path, 2, SCHEMA) as log:
        log.append(1, make_batch(1, 100, 2))
        assert reader.read(100).column("n").to_pylist() == [100, 101]
    assert reader.read(100) is None and reader.read(100) is None and reader.at_end()


def test_log_one_writer_at_a_time_and_checks(tmp_path):
    with ArrowLogWriter(tmp_path, 2, SCHEMA) as log:
        with pytest.raises(LogLockedError):
            ArrowLogWriter(tmp_path, 2, SCHEMA)
        with pytest.raises(InvalidArgumentError, match="schema"):
            log.append(0, pa.record_batch([pa.array([1])], names=["x"]))
        with pytest.raises(InvalidArgumentError, match="partition"):
            log.append(2, make_batch(0, 0, 1))
    with pytest.raises(InvalidArgumentError, match="2 partitions"):
        ArrowLogWriter(tmp_path, 3, SCHEMA)
    with pytest.raises(InvalidArgumentError, match="holds schema"):
        ArrowLogWriter(tmp_path, 2, pa.schema([("x", pa.int64())]))
    with pytest.raises(UnsupportedTypeError, match="dictionary"):
        ArrowLogWriter(tmp_path / "d", 1, pa.schema([("c", pa.dictionary(pa.int8(), pa.string()))]))
    with pytest.raises(InvalidArgumentError, match="no log.json"):
        ArrowLogSource(tmp_path / "nothing").partition_count()
    with pytest.raises(InvalidArgumentError, match="no offset for log partition 1"):
        ArrowLogSource(tmp_path).open([1], CTX).restore_state({"offsets": {"0": {}}})


def test_log_corruption_is_reported_with_file_and_offset(tmp_path):
    with ArrowLogWriter(tmp_path, 1, SCHEMA) as log:
        log.append(0, make_batch(0, 0, 5))
        log.append(0, make_batch(0, 5, 5))
    path = segment_path(tmp_path, 0, 0)
    data = bytearray(Path(path).read_bytes())
    second = len(SCHEMA.serialize()) + len(make_batch(0, 0, 5).serialize())
    data[second:second + 4] = b"\x00\x01\x02\x03"
    Path(path).write_bytes(bytes(data))
    reader = ArrowLogSource(tmp_path).open([0], CTX)
    assert reader.read(100).num_rows == 5
    with pytest.raises(CorruptDataError, match=f"segment-000000000000.arrows: .* byte {second}"):
        reader.read(100)


@pytest.mark.parametrize("make, connector, field", [
    (lambda d: ArrowLogWriter(None, 2, SCHEMA), "ArrowLogWriter", "root"),
    (lambda d: ArrowLogWriter(d, 2, SCHEMA, durable=1), "ArrowLogWriter", "durable"),
    (lambda d: ArrowLogSource(b"/tmp"), "ArrowLogSource", "root"),
    (lambda d: RedisStreamSource("s", 2, url=None), "RedisStreamSource", "url"),
    (lambda d: RedisStreamSource("s", 2, group=""), "RedisStreamSource", "group"),
    (lambda d: RedisStreamSource("s", 2, consumer=7), "RedisStreamSource", "consumer"),
    (lambda d: RedisStreamSource("s", 2, start_id=0), "RedisStreamSource", "start_id"),
    (lambda d: RedisStreamSource("s", 2, password=b"secret"), "RedisStreamSource", "password"),
])
def test_source_options_are_checked_when_constructed(tmp_path, make, connector, field):
    with pytest.raises(InvalidArgumentError, match=f"^{connector}: {field} must be") as e:
        make(tmp_path)
    assert "secret" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
