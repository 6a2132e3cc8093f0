"""SnapshotStore on real directories: round trips, partition-aligned restore, refusal of
incomplete or corrupt snapshots, fencing (with a real zombie process) and exports."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers.snapshot_data import entries, state

import sparkjet
from sparkjet.errors import (
    FencedError,
    InvalidArgumentError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
    SnapshotNotFoundError,
)
from sparkjet.snapshot.store import Manifest, SnapshotStore


def snapshot(store, sid, execution, seed, *, codec="lz4", commit=True, **kw):
    w = store.writer(sid, execution, codec=codec, **kw)
    w.write_table("agg", state(seed), key="key")
    w.write_entries("py", *entries(seed))
    w.write_broadcast_table("agg", pa.table({"watermark": [seed]}))
    if commit:
        info = w.commit()
        store.wait_for_cleanup()
        return info
    return w


def sorted_table(t):
    return t.sort_by("key")


def partition_filter(table, partitions, count=271):
    pids = sparkjet.partition_ids(table["key"], count)
    return table.filter(pc.is_in(pids, pa.array(partitions, pa.int32())))


@pytest.fixture
def store(tmp_path):
    s = SnapshotStore(tmp_path / "snaps", job_id=42)
    s.register_execution(1)
    yield s
    s.close()


@pytest.mark.parametrize("codec", ["lz4", "raw"])
def test_round_trip_and_partition_aligned_restore(store, codec):
    assert store.latest_complete() is None
    info = snapshot(store, 0, 1, seed=1, codec=codec)
    assert store.latest_complete() == info
    assert (info.job_id, info.snapshot_id, info.execution_id) == (42, 0, 1)
    assert info.entries == 3000 + 500 + 1 and info.vertices == ("agg", "py")
    full = store.restore("agg")
    assert sorted_table(full.table).equals(sorted_table(state(1)))
    assert full.broadcast_table.to_pylist() == [{"watermark": 1}]
    keys, values = store.restore("py").entries
    assert sorted(zip(keys.to_pylist(), values.to_pylist())) == sorted(zip(*entries(1)))
    part = store.restore("agg", [5, 100])
    assert sorted_table(part.table).equals(sorted_table(partition_filter(state(1), [5, 100])))
    assert part.broadcast_table is not None, "broadcast state comes with any partition"
    one = store.restore("agg", [17])
    assert one.bytes_read <= info.bytes / 200
    empty = store.restore("agg", [])
    assert empty.table is None and empty.broadcast_table is not None


def test_only_last_complete_snapshot_is_kept_and_previous_survives_until_then(store):
    snapshot(store, 0, 1, seed=1)
    dirs = lambda: sorted(os.listdir(Path(store._backend.root) / "job-000000000000002a" / "snapshots"))  # noqa: E731
    w = snapshot(store, 1, 1, seed=2, commit=False)
    w.finish()
    assert len(dirs()) == 2, "while snapshot 1 is written, snapshot 0 is still there"
    assert store.latest_complete().snapshot_id == 0
    assert sorted_table(store.restore("agg").table).equals(sorted_table(state(1)))
    w.commit()
    store.wait_for_cleanup()
    # retained=2 by default: the previous complete snapshot stays, a way back
    assert dirs() == ["000000000000-e000000000001", "000000000001-e000000000001"]
    assert sorted_table(store.restore("agg").table).equals(sorted_table(state(2)))
    assert sorted_table(store.restore("agg", snapshot_id=0).table).equals(sorted_table(state(1)))
    snapshot(store, 2, 1, seed=3)
    store.wait_for_cleanup()
    assert dirs() == ["000000000001-e000000000001", "000000000002-e000000000001"]
    assert [s.snapshot_id for s in store.complete()] == [1, 2]
    with pytest.raises(SnapshotNotFoundError, match=r"snapshot 0 is not a complete snapshot "
                                                    r"it keeps \(it keeps \[1, 2\]"):
        store.restore("agg", snapshot_id=0)


def test_retained_1_keeps_only_the_last_complete_snapshot(tmp_path):
    store = SnapshotStore(tmp_path, job_id=42, durable=False, retained=1)
    store.register_execution(1)
    snapshot(store, 0, 1, seed=1)
    snapshot(store, 1, 1, seed=2)
    store.wait_for_cleanup()
    assert os.listdir(tmp_path / "job-000000000000002a" / "snapshots") == \
        ["000000000001-e000000000001"]
    assert [s.snapshot_id for s in store.snapshots()] == [1]
    for bad in (0, 101, "2"):
        with pytest.raises(InvalidArgumentError, match="retained"):
            SnapshotStore(tmp_path, job_id=42, retained=bad)


def test_multiple_writers_commit_one_snapshot(store):
    table = state(7)
    pids = sparkjet.partition_ids(table["key"])
    manifests = []
    for member in range(3):
        mine = table.filter(pc.equal(pc.bit_wise_and(pids, 3), member % 3))
        w = store.writer(0, 1, writer=member)
        w.write_table("agg", mine, key="key")
        manifests.append(w.finish())
    store.commit(0, 1, [Manifest.from_json(json.loads(json.dumps(m.to_json()))) for m in manifests])
    assert sorted_table(store.restore("agg").table).equals(sorted_table(table.filter(
        pc.less(pc.bit_wise_and(pids, 3), 3))))
    with pytest.raises(InvalidArgumentError, match="manifest of snapshot 0"):
        store.commit(1, 1, manifests)
    with pytest.raises(InvalidArgumentError, match="not newer than the last complete snapshot 0"):
        store.commit(0, 1, manifests)
    w = store.writer(1, 1)
    w.write_table("agg", table, key="key")
    m = w.finish()
    with pytest.raises(InvalidArgumentError, match="two manifests"):
        store.commit(1, 1, [m, m])
    assert store.latest_complete().snapshot_id == 0


def chunk_files(store, vertex="agg"):
    snap = store.latest_complete()
    d = Path(store._backend.root) / "job-000000000000002a" / "snapshots" / store._snapshot_dir(
        snap.snapshot_id, snap.execution_id) / vertex
    return sorted(d.iterdir())


def test_missing_chunk_file_refuses_whole_restore(store):
    snapshot(store, 0, 1, seed=1)
    victim = max(chunk_files(store), key=lambda p: p.stat().st_size)
    victim.unlink()
    with pytest.raises(SnapshotIncompleteError, match="missing"):
        store.restore("agg")
    with pytest.raises(SnapshotIncompleteError, match="missing"):
        store.restore("agg", [17])
    with pytest.raises(SnapshotIncompleteError):
        store.verify()
    assert store.restore("py").entries is not None, "other vertices still restore"


def test_extra_chunk_file_is_refused(store):
    snapshot(store, 0, 1, seed=1)
    f = chunk_files(store)[0]
    shutil.copy(f, f.with_name("9-9.chunks"))
    with pytest.raises(SnapshotIncompleteError, match="extra file"):
        store.restore("agg")


@pytest.mark.parametrize("damage", ["truncate_boundary", "truncate_mid", "flip", "append"])
def test_damaged_file_is_detected(store, damage):
    snapshot(store, 0, 1, seed=1, chunk_size=4096)
    victim = max(chunk_files(store), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    if damage == "truncate_boundary":
        from sparkjet.snapshot.chunks import read_chunks

        data = data[: read_chunks(bytes(data))[-1][0]]
    elif damage == "truncate_mid":
        data = data[: len(data) // 2 + 3]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        data += b"\0" * 64
    victim.write_bytes(bytes(data))
    with pytest.raises((SnapshotCorruptError, SnapshotIncompleteError)) as e:
        store.restore("agg")
    assert victim.name in str(e.value)


def test_tampered_validation_record_is_refused(store):
    info = snapshot(store, 0, 1, seed=1)
    snapshots = Path(store._backend.root) / "job-000000000000002a" / "snapshots"
    record, = (snapshots / store._snapshot_dir(0, 1)).glob("_validation-*.json")
    data = json.loads(record.read_text())
    data["chunk_count"] += 1
    record.write_text(json.dumps(data, sort_keys=True))
    with pytest.raises(SnapshotCorruptError, match="validation record checksum"):
        store.restore("agg")
    assert info.chunk_count > 0


def test_snapshot_of_another_job_is_refused(tmp_path):
    a = SnapshotStore(tmp_path, job_id=1)
    a.register_execution(1)
    snapshot(a, 0, 1, seed=1)
    b = SnapshotStore(tmp_path, job_id=2)
    b.register_execution(1)
    snapshot(b, 0, 1, seed=2)
    # Swap job 1's data into job 2's snapshot, with a record that claims job 2.
    src = tmp_path / "job-0000000000000001" / "snapshots" / a._snapshot_dir(0, 1) / "agg"
    dst = tmp_path / "job-0000000000000002" / "snapshots" / b._snapshot_dir(0, 1) / "agg"
    shutil.rmtree(dst)
    shutil.copytree(src, dst)
    rec_a = json.loads(next(src.parent.glob("_validation-*.json")).read_text())
    rec_b_path = next(dst.parent.glob("_validation-*.json"))
    rec_b = json.loads(rec_b_path.read_text())
    rec_b["vertices"]["agg"] = rec_a["vertices"]["agg"]
    files = [f for v in rec_b["vertices"].values() for f in v["files"]]  # totals that add up
    rec_b["bytes"] = sum(f["bytes"] for f in files)
    rec_b["chunk_count"] = sum(len(f["chunks"]) for f in files)
    rec_b["entries"] = sum(c[3] for f in files for c in f["chunks"])
    rec_b_path.write_text(json.dumps(rec_b, sort_keys=True))
    import xxhash

    log = tmp_path / "job-0000000000000002" / "log"
    last = sorted(log.iterdir())[-1]
    event = json.loads(last.read_text())
    event["record_xxh3"] = xxhash.xxh3_64_hexdigest(rec_b_path.read_bytes())
    last.write_text(json.dumps(event, sort_keys=True))
    with pytest.raises(SnapshotCorruptError, match="job id"):
        b.restore("agg")
    assert SnapshotStore.jobs(tmp_path) == [1, 2]


def test_fencing_in_process(store):
    snapshot(store, 0, 1, seed=1)
    w = store.writer(1, 1)
    w.write_table("agg", state(2), key="key")
    store.register_execution(2)
    with pytest.raises(FencedError, match="fenced off by execution 2"):
        w.write_table("agg", state(3), key="key")
    with pytest.raises(FencedError):
        w.commit()
    with pytest.raises(FencedError, match="not newer"):
        store.register_execution(2)
    with pytest.raises(FencedError, match="never registered"):
        store.writer(5, 3)
    assert store.latest_complete().snapshot_id == 0
    assert store.current_execution() == 2


ZOMBIE = textwrap.dedent("""
    import sys, time, json
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    from helpers.snapshot_data import state
    from sparkjet.snapshot.store import SnapshotStore
    from sparkjet.errors import FencedError
    root, go, done = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    store = SnapshotStore(root, job_id=42)
    w = store.writer(1, 1)
    w.write_table("agg", state(100), key="key")
    Path(done).write_text("wrote")
    while not go.exists():          # execution 2 starts meanwhile
        time.sleep(0.01)
    outcome = {}
    try:
        w.write_table("agg", state(101), key="key")
        outcome["write"] = "accepted"
    except FencedError:
        outcome["write"] = "fenced"
    try:
        w.commit()
        outcome["commit"] = "accepted"
    except FencedError:
        outcome["commit"] = "fenced"
    # A zombie that ignores fencing altogether: it appends its commit event directly.
    import xxhash
    d = store._snapshot_dir(1, 1)
    rec = {"format": 1, "job_id": 42, "snapshot_id": 1, "execution_id": 1, "created": 0,
           "chunk_count": 0, "bytes": 0, "entries": 0, "vertices": {}}
    data = json.dumps(rec, sort_keys=True).encode()
    store._backend.makedirs(store._path("snapshots", d))
    digest = xxhash.xxh3_64_hexdigest(data)
    store._backend.write(store._path("snapshots", d, f"_validation-{digest}.json"), [data])
    from sparkjet.snapshot.records import CommitEvent
    store._append(CommitEvent(1, 1, d, f"_validation-{digest}.json", digest, 0))
    outcome["forced"] = "appended"
    Path(done).write_text(json.dumps(outcome))
""")


def test_zombie_process_cannot_make_anything_visible(store, tmp_path):
    snapshot(store, 0, 1, seed=1)
    go, done = tmp_path / "go", tmp_path / "done"
    zombie = subprocess.Popen([sys.executable, "-c", ZOMBIE, store._backend.root, str(go), str(done),
                               str(Path(__file__).resolve().parents[1])])
    try:
        for _ in range(3000):
            if done.exists():
                break
            zombie.poll()
            assert zombie.returncode is None, "zombie died early"
            import time

            time.sleep(0.01)
        store.register_execution(2)          # the restart
        snapshot(store, 1, 2, seed=7)        # execution 2 writes its own snapshot 1
        go.touch()
        assert zombie.wait(120) == 0
    finally:
        zombie.kill()
    outcome = json.loads(done.read_text())
    assert outcome == {"write": "fenced", "commit": "fenced", "forced": "appended"}
    latest = store.latest_complete()
    assert (latest.snapshot_id, latest.execution_id) == (1, 2)
    assert sorted_table(store.restore("agg").table).equals(sorted_table(state(7)))
    store.verify()


def test_exports_survive_cleanup_and_restore_by_name(store):
    snapshot(store, 0, 1, seed=1)
    exported = store.export(None, "before-upgrade")
    assert exported.name == "before-upgrade" and exported.snapshot_id == 0
    with pytest.raises(InvalidArgumentError, match="already exists"):
        store.export(None, "before-upgrade")
    with pytest.raises(InvalidArgumentError, match="export name"):
        store.export(None, "../escape")
    for sid in (1, 2):
        snapshot(store, sid, 1, seed=sid + 1)
    listing = store.snapshots()
    assert [(s.name, s.snapshot_id) for s in listing] == [("before-upgrade", 0), (None, 1),
                                                          (None, 2)]
    assert all(s.bytes > 0 and s.created > 0 and s.job_id == 42 for s in listing)
    got = store.restore("agg", name="before-upgrade")
    assert sorted_table(got.table).equals(sorted_table(state(1)))
    assert store.verify(name="before-upgrade").name == "before-upgrade"
    with pytest.raises(SnapshotNotFoundError):
        store.restore("agg", name="nope")
    with pytest.raises(SnapshotNotFoundError, match="not a complete snapshot it keeps"):
        store.restore("agg", snapshot_id=0)
    store.delete_export("before-upgrade")
    assert [s.name for s in store.snapshots()] == [None, None]


def test_describe_and_verify_progress(store):
    snapshot(store, 0, 1, seed=1)
    desc = store.describe()
    assert sum(p["entries"] for p in desc["agg"].values()) == 3001
    assert -1 in desc["agg"] and len(desc["agg"]) > 200
    seen = []
    info = store.verify(progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (info.bytes, info.bytes)


def test_restore_of_unknown_vertex_and_missing_snapshot(tmp_path):
    s = SnapshotStore(tmp_path, job_id=3)
    with pytest.raises(SnapshotNotFoundError, match="no complete snapshot"):
        s.restore("agg")
    s.register_execution(0)
    snapshot(s, 0, 0, seed=1)
    with pytest.raises(SnapshotNotFoundError, match="no vertex 'nope'"):
        s.restore("nope")
    with pytest.raises(InvalidArgumentError, match="vertex name"):
        s.writer(1, 0).write_table("a/b", state(1), key="key")
    with pytest.raises(InvalidArgumentError, match="job_id"):
        SnapshotStore(tmp_path, job_id=-1)


def test_dictionary_columns_with_the_raw_codec_restore(store):
    table = pa.table({"key": np.arange(50), "city": pa.array(["x", "yy"] * 25).dictionary_encode()})
    w = store.writer(0, 1, codec="raw")
    w.write_table("agg", table, key="key")
    w.commit()
    assert store.restore("agg").table.sort_by("key").to_pylist() == table.to_pylist()
    store.verify()


def job_dir(store) -> Path:
    return Path(store._backend.root) / f"job-{store.job_id:016x}"


@pytest.mark.parametrize("event, field", [
    (b'{"type": "register"}', "execution"),                       # was KeyError
    (b"[]", "object"),                                             # was TypeError
    (b'{"type": "commit", "execution": 1}', "snapshot"),           # was KeyError
    (b'{"type": "register", "execution": "1", "time": 0}', "$.execution"),
    (b'{"type": "register", "execution": 1e400, "time": 0}', "$.execution"),
    (b'{"type": "commit", "snapshot": 0, "execution": 1, "record": "../..", '
     b'"record_file": "x", "record_xxh3": "0", "time": 0}', "$.record"),
    (b'{"type": "split-brain", "time": 0}', "type"),
    (b'\xff\xfe', "log event"),
])
def test_hostile_log_event_is_a_snapshot_corrupt_error(store, event, field):
    snapshot(store, 0, 1, seed=1)
    (job_dir(store) / "log" / "000000000099.json").write_bytes(event)
    for read in (store.latest_complete, store.snapshots, lambda: store.restore("agg")):
        with pytest.raises(SnapshotCorruptError, match="000000000099.json") as e:
            read()
        assert field in str(e.value)
    # It may have been a registration: a new execution takes an id past it.
    assert store.current_execution() == 2
    # Or the commit of a newer snapshot: the restore's way back names it.
    info, unusable = store.newest_verified()
    assert info.snapshot_id == 0 and len(unusable) == 1 and unusable[0].snapshot is None
    assert "000000000099.json" in str(unusable[0]) and field in str(unusable[0])


def tamper(store, edit):
    """Edits the last validation record and recomputes the checksum its commit names."""
    import xxhash

    record_path, = job_dir(store).glob("snapshots/*/_validation-*.json")
    record = json.loads(record_path.read_text())
    edit(record)
    data = json.dumps(record).encode()
    record_path.write_bytes(data)
    log = sorted((job_dir(store) / "log").glob("*.json"))[-1]
    event = json.loads(log.read_text())
    event["record_xxh3"] = xxhash.xxh3_64_hexdigest(data)
    log.write_text(json.dumps(event))
    store._records.clear()


def first_chunk(record):
    return record["vertices"]["agg"]["files"][0]["chunks"][0]


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.pop("vertices"), "vertices"),                                 # was KeyError
    (lambda r: first_chunk(r).__setitem__(0, 2**70), "files[0].chunks[0][0]"),
    (lambda r: first_chunk(r).__setitem__(0, -5), "files[0].chunks[0][0]"),
    (lambda r: first_chunk(r).__setitem__(1, 10**9), "chunk 1 starts"),        # ArrowIndexError
    (lambda r: first_chunk(r).pop(), "files[0].chunks[0]"),     # ValueError
    (lambda r: r["vertices"]["agg"].__setitem__("files", "x"), "files"),
    (lambda r: r["vertices"]["agg"]["files"][0].__setitem__("path", "agg/../../x"), "path"),
    (lambda r: r.__setitem__("vertices", {"..": r["vertices"]["agg"]}), "$.vertices"),
    (lambda r: r.__setitem__("chunk_count", 1), "chunk_count"),
    (lambda r: r.__setitem__("job_id", 2**64), "job_id"),
])
def test_hostile_validation_record_is_a_snapshot_corrupt_error(store, edit, field):
    snapshot(store, 0, 1, seed=1)
    tamper(store, edit)
    for read in (lambda: store.restore("agg"), store.verify, store.describe, store.snapshots):
        with pytest.raises(SnapshotCorruptError, match="validation record") as e:
            read()
        assert field in str(e.value)


def test_ids_the_log_could_not_read_back_are_refused_before_writing(store):
    with pytest.raises(InvalidArgumentError, match="execution_id"):
        store.register_execution(2**70)
    with pytest.raises(InvalidArgumentError, match="snapshot_id"):
        store.commit(2**64, 1, [])
    with pytest.raises(InvalidArgumentError, match="vertex name"):
        store.writer(0, 1).write_entries("..", [b"a"], [b"b"])
    assert store.current_execution() == 1


def test_a_writer_writes_every_file_on_one_thread_of_its_own(store):
    """A processor's writer hands its files to one I/O thread (which encodes, writes and
    fsyncs them) and goes on: it started a thread per write call and waited there for the
    file's fsync, a fixed cost per file that 100 ms snapshots paid ten times a second."""
    import threading

    opened = []
    open_write = store._backend.open_write

    def recording(path):
        if path.endswith(".chunks"):
            opened.append((path.rsplit("/", 2)[-2], threading.get_ident()))
        return open_write(path)

    store._backend.open_write = recording
    snapshot(store, 0, 1, 5)
    snapshot(store, 1, 1, 6)
    assert [v for v, _ in opened] == ["agg", "py", "agg"] * 2
    first, second = {t for _, t in opened[:3]}, {t for _, t in opened[3:]}
    assert len(first) == 1 and len(second) == 1, "one thread per writer"
    assert threading.get_ident() not in first | second, "not on the caller's thread"
    assert sorted_table(store.restore("agg").table).equals(sorted_table(state(6)))


def test_a_store_made_again_is_another_log_of_the_job(tmp_path):
    """SnapshotStore.incarnation: the same while the job's log lasts (reopened, more
    executions), another once the store's folder is removed and made again."""
    import shutil

    store = SnapshotStore(str(tmp_path / "s"), 7)
    assert store.incarnation() is None
    store.register_execution(0)
    first = store.incarnation()
    store.register_execution(1)
    assert SnapshotStore(str(tmp_path / "s"), 7).incarnation() == first
    shutil.rmtree(tmp_path / "s")
    again = SnapshotStore(str(tmp_path / "s"), 7)
    again.register_execution(0)
    assert again.incarnation() not in (None, first)



def test_a_processors_snapshots_group_their_state_into_memory_kept_between_them(store):
    """A keyed processor's snapshots take the memory they group its state into from a
    pool (SnapshotBuffers): a writer gives it back once its files are written, and the
    next snapshot groups into the same memory; a writer not finished keeps it. Every
    snapshot still restores its own state: the files hold copies, not that memory."""
    from sparkjet.snapshot.writer import SnapshotBuffers

    pool = SnapshotBuffers()
    lease_of = []
    real_lease = pool.lease

    def recording_lease():
        lease = real_lease()
        taken = []
        take = lease.take

        def take_recorded(nbytes):
            buf = take(nbytes)
            taken.append(buf.address)
            return buf
        lease.take = take_recorded
        lease_of.append(taken)
        return lease

    pool.lease = recording_lease
    first = store.writer(0, 1, codec="blosc2-lz4")
    first.write_table("agg", state(1), key="key", buffers=pool)
    # snapshot 1 starts before snapshot 0's files are written: it cannot have its memory
    second = store.writer(1, 1, codec="blosc2-lz4")
    second.write_table("agg", state(2), key="key", buffers=pool)
    assert lease_of[0] and not set(lease_of[0]) & set(lease_of[1])
    assert pool.held_bytes == 0
    first.commit()
    store.wait_for_cleanup()
    assert pool.held_bytes > 0          # given back as its files were written
    second.commit()
    store.wait_for_cleanup()
    third = store.writer(2, 1, codec="blosc2-lz4")
    third.write_table("agg", state(3), key="key", buffers=pool)
    third.commit()
    store.wait_for_cleanup()
    assert set(lease_of[2]) <= set(lease_of[0]) | set(lease_of[1])
    # key, count, sum: copied at the call, then grouped on the I/O thread
    assert len(set(lease_of[2])) == len(lease_of[2]) == 6
    # each snapshot holds its own state, though the later ones grouped into the same memory
    assert sorted_table(store.restore("agg", snapshot_id=1).table).equals(
        sorted_table(state(2)))
    assert sorted_table(store.restore("agg", snapshot_id=2).table).equals(
        sorted_table(state(3)))
    # the pool keeps about what one snapshot took (its copy and its grouped rows, each an
    # eighth larger than asked), however many ran
    assert pool.held_bytes <= 2 * 1.125 * sum(c.nbytes for c in state(3).columns)


def test_a_buffer_lease_given_back_takes_nothing_more():
    from sparkjet.snapshot.writer import SnapshotBuffers

    pool = SnapshotBuffers()
    lease = pool.lease()
    buf = lease.take(1000)
    assert buf.size == 1000 and buf.is_mutable
    lease.give_back()
    lease.give_back()                   # once is what counts
    assert pool.held_bytes >= 1000
    with pytest.raises(InvalidArgumentError, match="given back"):
        lease.take(10)
    again = pool.lease()
    assert again.take(900).address == buf.address      # the same memory, reused
    assert again.take(900).address != buf.address      # not twice in one lease


def test_a_tables_chunks_are_all_encoded_on_the_writers_thread(store, monkeypatch):
    """write_table groups the rows at the call and returns: every chunk of the file is
    serialized and compressed on the writer's I/O thread, none on the caller's (a keyed
    processor's, which has events waiting); no rows write no file."""
    import threading

    from sparkjet.snapshot import chunks

    encoded_on = []
    real = chunks.ChunkEncoder._blosc2_run

    def recorded(self, run, *args):
        encoded_on.append(threading.current_thread().name)
        return real(self, run, *args)

    monkeypatch.setattr(chunks, "_RUN_BYTES", 10_000)      # several runs per file
    monkeypatch.setattr(chunks.ChunkEncoder, "_blosc2_run", recorded)
    w = store.writer(0, 1, codec="blosc2-lz4")
    w.write_table("agg", state(1), key="key")
    w.write_table("empty", state(1).slice(0, 0), key="key")
    info = w.commit()
    assert len(encoded_on) > 3 and set(encoded_on) == {"sparkjet-snapshot-write"}
    assert info.vertices == ("agg",)
    assert sorted_table(store.restore("agg").table).equals(sorted_table(state(1)))


def test_a_processors_state_is_copied_at_the_call_and_grouped_on_the_writers_thread(
        store, monkeypatch):
    """With a keyed processor's buffer pool, write_table takes a plain copy of the state
    and returns; the rows are grouped by partition on the I/O thread, from that copy, so
    the state may change at once (a processor goes on with its input). A state larger than
    half the pool is grouped at the call, as before (no second copy of it is made)."""
    import threading

    from sparkjet.snapshot import chunks
    from sparkjet.snapshot.writer import SnapshotBuffers

    grouped_on = []
    real = chunks.group_rows

    def recorded(*args, **kwargs):
        grouped_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunks, "group_rows", recorded)
    want = state(4)
    live = {name: want.column(name).to_numpy().copy() for name in want.column_names}
    table = pa.table(live)            # (zero copy: the table shows the live arrays)
    w = store.writer(0, 1, codec="blosc2-lz4")
    pool = SnapshotBuffers()
    w.write_table("agg", table, key="key", buffers=pool)
    for arr in live.values():
        arr[:] = 0                      # the processor's next batch changes its state
    w.commit()
    assert grouped_on == ["sparkjet-snapshot-write"]
    assert sorted_table(store.restore("agg").table).equals(sorted_table(want))
    assert pool.held_bytes >= 2 * want.nbytes      # the copy and the grouped rows, kept
    w = store.writer(1, 1, codec="blosc2-lz4")
    w.write_table("big", state(5), key="key", buffers=SnapshotBuffers(max_bytes=1_000))
    assert grouped_on[-1] == threading.current_thread().name     # at the call
    w.commit()
    assert sorted_table(store.restore("big").table).equals(sorted_table(state(5)))


def test_a_buffer_pool_keeps_no_more_than_its_bound():
    """A state too large for the pool's bound is grouped into fresh memory each time, as
    without a pool: nothing of it is kept idle between snapshots."""
    from sparkjet.snapshot.writer import SnapshotBuffers

    pool = SnapshotBuffers(max_bytes=10_000)
    lease = pool.lease()
    small, large = lease.take(4_000), lease.take(20_000)
    lease.give_back()
    assert 4_000 <= pool.held_bytes <= 10_000
    again = pool.lease()
    assert again.take(4_000).address == small.address
    assert again.take(20_000).address != large.address


def test_a_file_in_a_slot_is_backed_up_after_the_write_call_returns(tmp_path):
    """With the members' storage a file's backup (and durable copy) is made on the
    writer's thread once the file is written: the processor that wrote its state goes on
    at once; finish() waits for the copies, and a copy that fails fails the snapshot."""
    import threading
    import uuid

    from sparkjet.snapshot.slots import StorageSlot

    b = str(uuid.uuid4())
    a = StorageSlot.claim(tmp_path / "host-a", host="a")
    store = SnapshotStore(tmp_path / "store", 42)
    store.register_execution(1)
    returned = threading.Event()
    seen = []

    def replicate(path, chunks):        # a backup that takes a while
        seen.append((threading.current_thread().name, returned.wait(10), len(chunks)))
        return [b]

    try:
        w = store.writer(0, 1, writer=0, slot=a, replicate=replicate, durable=True)
        w.write_table("agg", state(1), key="key")
        returned.set()
        manifest = w.finish()
        assert seen == [("sparkjet-snapshot-write", True, len(manifest.files[0]["chunks"]))]
        (f,) = manifest.files
        assert f["slot"] == a.uuid and f["replicas"] == [b] and f["durable"]
        store.commit(0, 1, [manifest])
        assert sorted_table(store.restore("agg").table).equals(sorted_table(state(1)))

        def refused(path, chunks):
            raise OSError(28, "No space left on device")

        w = store.writer(1, 1, writer=0, slot=a, replicate=refused)
        w.write_table("agg", state(2), key="key")           # returns; the copy fails later
        with pytest.raises(OSError, match="No space left"):
            w.finish()
    finally:
        store.close()
        a.release()


@pytest.mark.parametrize("in_slot", [False, True], ids=["store", "slot"])
def test_a_writer_dropped_unfinished_ends_its_thread(tmp_path, in_slot):
    """A writer whose processor failed is dropped without finish(): its I/O thread, which
    holds nothing of it (nor, in a slot, of the copies' work), ends once it is collected."""
    import gc

    from sparkjet.snapshot.slots import StorageSlot

    slot = StorageSlot.claim(tmp_path / "host-a", host="a") if in_slot else None
    store = SnapshotStore(tmp_path / "store", 42)
    store.register_execution(1)
    try:
        w = store.writer(0, 1, writer=0, slot=slot,
                         replicate=(lambda path, chunks: []) if in_slot else None,
                         durable=in_slot)
        w.write_table("agg", state(1), key="key")
        w._drain()          # the file written (and copied): the thread waits for the next
        thread = w._thread
        del w
        gc.collect()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        store.close()
        if slot is not None:
            slot.release()


def test_a_lease_that_took_nothing_leaves_the_pool_as_it_is():
    """A snapshot of no rows (a processor with no keys yet) takes no buffer: giving its
    lease back keeps what the pool held for the next snapshot."""
    from sparkjet.snapshot.writer import SnapshotBuffers

    pool = SnapshotBuffers()
    lease = pool.lease()
    taken = [lease.take(1000).address for _ in range(3)]
    lease.give_back()
    held = pool.held_bytes
    pool.lease().give_back()
    assert pool.held_bytes == held
    again = pool.lease()
    assert sorted(again.take(1000).address for _ in range(3)) == sorted(taken)


def test_a_files_pieces_are_written_together_and_every_byte_lands(tmp_path, monkeypatch):
    """StreamWriter.write_all writes many pieces in few writev calls (at most IOV_MAX
    buffers each) and writes again what a short write left, empty pieces and all."""
    from sparkjet import _fs

    calls = []
    real = os.writev

    def short(fd, buffers):
        buffers = list(buffers)
        assert len(buffers) <= _fs._IOV_MAX
        calls.append(len(buffers))
        room, part = 777, []          # at most 777 bytes a call, cut anywhere
        for b in buffers:
            take = memoryview(b)[:room]
            part.append(take)
            room -= take.nbytes
            if not room:
                break
        return real(fd, part)

    monkeypatch.setattr(os, "writev", short)
    rng = np.random.default_rng(4)
    pieces = [rng.bytes(int(n)) for n in rng.integers(0, 300, 3_000)]
    pieces[5:5] = [b"", pa.py_buffer(b"arrow"), memoryview(b"view"), bytearray(b"ba")]
    backend = _fs.Backend(str(tmp_path), durable=True)
    out = backend.open_write(str(tmp_path / "f"))
    out.write_all(pieces)
    out.write_all([])
    out.close()
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(memoryview(p)) for p in pieces)
    assert 1 < len(calls) < 3_000


def test_a_snapshot_file_is_written_a_few_megabytes_a_call(store, monkeypatch):
    """A file's chunks (a header, a schema message and a payload each) go to the file
    system ~2 MB per writev call, not one write per piece, and restore whole."""
    from sparkjet.snapshot import writer

    sizes = []
    real = os.writev

    def counted(fd, buffers):
        n = real(fd, buffers)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".chunks"):  # (the log's writes too)
            sizes.append(n)
        return n

    monkeypatch.setattr(os, "writev", counted)
    rng = np.random.default_rng(9)
    table = pa.table({"key": rng.permutation(1_000_000).astype(np.int64),
                      "n": rng.integers(0, 1 << 40, 1_000_000)})
    w = store.writer(0, 1, codec="blosc2-lz4")
    w.write_table("agg", table, key="key")
    w.commit()
    assert len(sizes) >= 2 and all(n >= writer._WRITE_BYTES for n in sizes[:-1])
    assert sorted_table(store.restore("agg").table).equals(sorted_table(table))


def test_a_failed_flush_of_pieces_names_the_file(tmp_path, monkeypatch):
    """write_all starts a durable file's writeback as write() does; a disk that refuses it
    raises the StorageError that names the file, not a bare OSError."""
    import errno

    from sparkjet import _fs
    from sparkjet.errors import StorageError

    def refused(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_fs, "_SYNC_FILE_RANGE", None)
    monkeypatch.setattr(os, "fdatasync", refused)
    backend = _fs.Backend(str(tmp_path), durable=True)
    out = backend.open_write(str(tmp_path / "f"))
    with pytest.raises(StorageError, match="f"):
        out.write_all([bytes(1 << 20)] * (_fs.StreamWriter.SYNC_EVERY // (1 << 20) + 1))
    out.abort()
