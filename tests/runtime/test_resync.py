"""Merkle resync of a storage slot that missed snapshots (sparkjet.runtime.resync, issue 25
item 2): a slot holding an older snapshot's copy of a file syncs the current one from its
holder over a real exchange server (Merkle walk as fenced actions, rows as a file stream),
moves far less than a full copy, and ends with the holder's bytes, which the persistence
verification accepts against the record; rows reordered between snapshots fall back to a
range copy, said in the report; a holder whose root does not match what it sends is
refused, nothing kept; merkle_tree_depth is checked."""
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest

from sparkjet.errors import InvalidArgumentError, MerkleSyncError
from sparkjet.runtime.config import JobConfig
from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.persistence import _verify_file
from sparkjet.runtime.resync import MerkleHolder, resolve_depth, resync_file
from sparkjet.runtime.storage import held_ranges, slot_read_handler
from sparkjet.snapshot import layout
from sparkjet.snapshot import records as meta
from sparkjet.snapshot.chunks import HEADER_SIZE, decode_table, read_chunks
from sparkjet.snapshot.slots import REPLICAS, StorageSlot
from sparkjet.snapshot.store import SnapshotStore

JOB = 0xBEEF
PARTITIONS = 7
N = 20_000
#: The walk-or-copy choices these tests expect are weighed against copies of the "lz4"
#: codec's size (the default "blosc2-lz4" packs their small tables into a third less, so
#: a copy wins a few more partitions); test_blosc2_chunks_are_rebuilt_byte_for_byte
#: covers the default.
CODEC = "lz4"


def _state(values, keys=None):
    keys = list(range(len(values))) if keys is None else keys
    return pa.table({"key": pa.array(keys, pa.int64()), "v": pa.array(values, pa.float64())})


@pytest.fixture
def cluster(tmp_path):
    """Slot a (the holder, behind a real exchange server) and slot b (the stale one)."""
    a = StorageSlot.claim(tmp_path / "host-a", host="a")
    b = StorageSlot.claim(tmp_path / "host-b", host="b")
    security = LinkSecurity.generate(5)
    server = ExchangeServer("127.0.0.1", execution_id=5, security=security)
    holder = MerkleHolder(a, JOB)
    holder.register(server)
    server.on_get("slot_read", slot_read_handler(a, JOB))
    client = ExchangeClient(server.location, security=security)
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(5)
    yield a, b, client, server, store
    client.close()
    server.close()
    a.release()
    b.release()


def _snapshot(store, slot, sid, table, chunk_size=16384, codec=CODEC):
    w = store.writer(sid, 5, writer=0, partition_count=PARTITIONS, slot=slot,
                     chunk_size=chunk_size, codec=codec)
    w.write_table("agg", table, key="key")
    store.commit(sid, 5, [w.finish()], table="dGFibGU=", plan='{"v": 1}')
    data, _, _ = store.committed_record(sid)
    return meta.decode(data, meta.ValidationRecord, f"snapshot {sid}", "record")


def _rel(record, f):
    return f"{layout.SNAPSHOTS}/{layout.snapshot_dir(record.snapshot_id, record.execution_id)}/{f.path}"


def _stale_copy(a, b, record):
    """Slot b gets a whole copy of ``record``'s file, as a backup that then went away."""
    f = record.vertices["agg"].files[0]
    src = os.path.join(a.job_path(JOB, REPLICAS), *_rel(record, f).split("/"))
    dst = os.path.join(b.replicas(JOB).root, *_rel(record, f).split("/"))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(src, dst)


def _stale_slot(store, a, b, *, record: bool = False):
    """Snapshot 0 (N keys) written by slot a, a copy of its file in slot b (a backup that
    then went away) and, with ``record``, of its record too: the old state and record."""
    old = _state([float(i) for i in range(N)])
    rec0 = _snapshot(store, a, 0, old)
    _stale_copy(a, b, rec0)
    if record:
        b.write_record(JOB, 0, store.committed_record(0)[0])
    return old, rec0


def _restored(slot, record, f, parts):
    """The rows of ``parts`` that the slot's copy of ``f`` holds, read back from disk."""
    path = os.path.join(slot.job_path(JOB, REPLICAS), *_rel(record, f).split("/"))
    with open(path, "rb") as fh:
        data = fh.read()
    tables = []
    for c in f.chunks:
        if c.partition in parts:
            (_, header, payload), = read_chunks(data[c.offset:c.offset + HEADER_SIZE + c.stored_size])
            tables.append(decode_table(header, payload))
    return pa.concat_tables(tables), path


def _changed(old):
    """0.1 % of the values changed in place, 5 keys gone, 5 new ones appended (what a keyed
    operator's state does between two snapshots)."""
    values = old["v"].to_pylist()
    keys = old["key"].to_pylist()
    for i in range(0, N, 1000):
        values[i] += 0.5
    gone = {7, 4007, 9007, 13007, 17007}
    rows = [(k, v) for k, v in zip(keys, values) if k not in gone]
    rows += [(N + i, float(i)) for i in range(5)]
    return _state([v for _, v in rows], [k for k, _ in rows])


def test_a_stale_slot_syncs_only_what_changed_and_holds_the_current_snapshot(cluster):
    a, b, client, _, store = cluster
    old, rec0 = _stale_slot(store, a, b)
    new = _changed(old)
    rec1 = _snapshot(store, a, 1, new)
    f = rec1.vertices["agg"].files[0]
    parts = {c.partition for c in f.chunks}
    report = resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key="key", depth=10,
                         partition_count=PARTITIONS)
    assert report.fallback == {}
    assert report.copied_bytes == 0
    assert 0 < report.rows_fetched < N // 10
    assert report.synced_bytes < report.full_copy_bytes / 4, report.to_dict()
    got, path = _restored(b, rec1, f, parts)
    assert got.sort_by("key").equals(new.sort_by("key"))
    # byte for byte the holder's chunks: the persistence verification takes the copy
    _verify_file(path, f, JOB, 1, held_ranges(path)[1])


def test_blosc2_chunks_are_rebuilt_byte_for_byte(cluster):
    # The default codec: the rows a walk fetches are encoded again as the writer encoded
    # them, and the copy must be the holder's chunks byte for byte
    a, b, client, _, store = cluster
    old = _state([float(i) for i in range(N)])
    rec0 = _snapshot(store, a, 0, old, codec="blosc2-lz4")
    _stale_copy(a, b, rec0)
    new = _changed(old)
    rec1 = _snapshot(store, a, 1, new, codec="blosc2-lz4")
    f = rec1.vertices["agg"].files[0]
    parts = {c.partition for c in f.chunks}
    report = resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key="key", depth=10,
                         partition_count=PARTITIONS)
    assert report.rows_fetched > 0 and set(report.fallback) != parts, report.to_dict()
    assert report.synced_bytes < report.full_copy_bytes, report.to_dict()
    got, path = _restored(b, rec1, f, parts)
    assert got.sort_by("key").equals(new.sort_by("key"))
    _verify_file(path, f, JOB, 1, held_ranges(path)[1])


def test_rows_reordered_between_snapshots_fall_back_to_a_range_copy(cluster):
    a, b, client, _, store = cluster
    old, rec0 = _stale_slot(store, a, b)
    new = _changed(old).sort_by([("key", "descending")])   # same entries, other order
    rec1 = _snapshot(store, a, 1, new)
    f = rec1.vertices["agg"].files[0]
    parts = {c.partition for c in f.chunks}
    report = resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key="key", depth=10,
                         partition_count=PARTITIONS)
    assert set(report.fallback) == parts, report.to_dict()
    assert report.copied_bytes == report.full_copy_bytes
    got, path = _restored(b, rec1, f, parts)
    assert got.equals(new.sort_by([("key", "descending")])) or \
        got.sort_by("key").equals(new.sort_by("key"))
    _verify_file(path, f, JOB, 1, held_ranges(path)[1])


def test_a_root_that_does_not_match_the_rows_is_refused_and_nothing_kept(cluster):
    a, b, client, server, store = cluster
    old, rec0 = _stale_slot(store, a, b)
    rec1 = _snapshot(store, a, 1, _changed(old))
    f = rec1.vertices["agg"].files[0]
    holder = MerkleHolder(a, JOB)

    def damaged(body):          # a holder whose tree is not that of the rows it sends
        answer = holder.open(body)
        p = sorted(answer["roots"])[0]
        answer["roots"][p] = answer["roots"][p] ^ 0x5A5A
        return answer
    holder.register(server)
    server.on_action("merkle_open", damaged)
    parts = {c.partition for c in f.chunks}
    with pytest.raises(MerkleSyncError, match=r"partition \d+ rebuilt has root hash .* the "
                                              r"holder's is .*nothing of the file is kept"):
        resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key="key", depth=8,
                    partition_count=PARTITIONS)
    assert not os.path.exists(os.path.join(b.job_path(JOB, REPLICAS), *_rel(rec1, f).split("/")))


def test_when_most_entries_changed_the_ranges_are_copied_instead(cluster):
    """The walk finds nearly every leaf differing (almost nothing old): fetching their rows
    would move more than the chunks, so the partitions go as byte ranges, said so."""
    a, b, client, _, store = cluster
    rec0 = _snapshot(store, a, 0, _state([1.0] * 100))
    new = _state([float(i) for i in range(3000)])
    rec1 = _snapshot(store, a, 1, new)
    f = rec1.vertices["agg"].files[0]
    parts = {c.partition for c in f.chunks}
    report = resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key="key",
                         depth="auto", partition_count=PARTITIONS)
    assert report.rows_fetched == 0 and set(report.fallback) == parts
    assert "a copy of the ranges moves less" in report.fallback[min(parts)]
    assert report.copied_bytes == report.full_copy_bytes
    got, path = _restored(b, rec1, f, parts)
    assert got.sort_by("key").equals(new.sort_by("key"))
    _verify_file(path, f, JOB, 1, held_ranges(path)[1])


@pytest.mark.parametrize("depth", [1, 28, "deep", 10.0, True])
def test_merkle_tree_depth_is_an_int_in_2_to_27_or_auto(depth):
    with pytest.raises(InvalidArgumentError, match="merkle_tree_depth"):
        JobConfig(snapshot_store="/tmp/x", merkle_tree_depth=depth)
    assert JobConfig(snapshot_store="/tmp/x").merkle_tree_depth == 10
    assert JobConfig(snapshot_store="/tmp/x", merkle_tree_depth="auto").merkle_tree_depth == "auto"
    assert JobConfig(snapshot_store="/tmp/x", merkle_tree_depth=27).merkle_tree_depth == 27
    assert resolve_depth(12, 10, 1, 271, 16) == 12
    assert 2 <= resolve_depth("auto", 10_000_000, 271, 271, 16) <= 27
    with pytest.raises(InvalidArgumentError, match=r"2\.\.27"):
        resolve_depth(depth if depth != "deep" else 0, 10, 1, 271, 16)


def test_resync_slot_syncs_the_files_the_record_gives_it_entries_and_broadcast_too(cluster):
    """The record's partition table says which partitions slot b holds; keyed entries (bytes)
    sync by Merkle trees like tables, broadcast state is copied whole."""
    import base64

    from sparkjet.partition_table import PartitionTable
    from sparkjet.runtime.resync import resync_slot
    from sparkjet.snapshot.chunks import decode_entries

    a, b, client, _, store = cluster
    table = base64.b64encode(PartitionTable.create([a.uuid, b.uuid], PARTITIONS, 1).to_bytes())

    def snapshot(sid, values, extra):
        w = store.writer(sid, 5, writer=0, partition_count=PARTITIONS, slot=a, chunk_size=16384,
                         codec=CODEC)
        w.write_table("agg", _state(values), key="key")
        keys = [f"k{i}".encode() for i in range(3000)] + [f"x{i}".encode() for i in range(extra)]
        w.write_entries("kv", keys, [b"v%d" % (i + sid) if i % 500 == 0 else b"v%d" % i
                                     for i in range(len(keys))])
        w.write_broadcast_entries("src", [b"0"], [f"offset {sid}".encode()])
        store.commit(sid, 5, [w.finish()], table=table.decode(), plan='{"v": 1}')
        data, _, _ = store.committed_record(sid)
        return meta.decode(data, meta.ValidationRecord, f"snapshot {sid}", "record")

    rec0 = snapshot(0, [float(i) for i in range(N)], 0)
    for v in rec0.vertices.values():
        for f in v.files:
            src = os.path.join(a.job_path(JOB, REPLICAS), *_rel(rec0, f).split("/"))
            dst = os.path.join(b.replicas(JOB).root, *_rel(rec0, f).split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
    values = [float(i) + (i % 997 == 0) for i in range(N)]
    rec1 = snapshot(1, values, 3)
    reports = {r.path.split("/")[2]: r for r in resync_slot(
        b, JOB, rec1, rec0, {a.uuid: client}, keys={"agg": "key"}, depth=12)}
    assert set(reports) == {"agg", "kv", "src"}
    assert reports["agg"].fallback == {} and reports["kv"].fallback == {}
    assert reports["kv"].rows_fetched < 100 and reports["agg"].rows_fetched < N // 10
    assert reports["src"].copied_bytes == reports["src"].full_copy_bytes > 0
    for v in rec1.vertices.values():
        for f in v.files:
            path = os.path.join(b.job_path(JOB, REPLICAS), *_rel(rec1, f).split("/"))
            _verify_file(path, f, JOB, 1, held_ranges(path)[1])
    got, _ = _restored(b, rec1, rec1.vertices["agg"].files[0], set(range(PARTITIONS)))
    assert got.sort_by("key").equals(_state(values))
    f = rec1.vertices["kv"].files[0]
    with open(os.path.join(b.job_path(JOB, REPLICAS), *_rel(rec1, f).split("/")), "rb") as fh:
        data = fh.read()
    kv = {}
    for _, header, payload in read_chunks(data):
        k, v = decode_entries(header, payload)
        kv.update(zip(k.to_pylist(), v.to_pylist()))
    assert len(kv) == 3003 and kv[b"k500"] == b"v501" and kv[b"x2"] == b"v3002"


def test_a_packed_walk_message_that_does_not_read_is_refused():
    from sparkjet.runtime.resync import _pack, _unpack

    msg = bytes.fromhex("01000000000000010000000200000000000000020000000100000001ffffff01")
    assert _unpack(_pack(msg), "m") == msg
    for bad, match in (("@@", "not base64"), ("AAAA", "not a packed"),
                       ("f////w==", "not a packed"), ("AAAAEAAAAAA=", "does not decompress")):
        with pytest.raises(InvalidArgumentError, match=match):
            _unpack(bad, "merkle_step")


class _Member:
    """What slot_files asks of a member: the slots of the execution and its peers."""

    def __init__(self, slots, peers):
        self.topology = type("T", (), {"slots": slots})()
        self.peers = peers


def test_a_restore_reads_the_resynced_copy_from_its_own_slot(cluster):
    """Once resynced, slot b's copy is a replica of the current snapshot for a restore on b:
    read from disk (chunk by chunk against the record) though the record names only slot a,
    whose member is gone."""
    from sparkjet.runtime.storage import slot_files

    a, b, client, server, store = cluster
    old, rec0 = _stale_slot(store, a, b)
    new = _changed(old)
    rec1 = _snapshot(store, a, 1, new)
    f = rec1.vertices["agg"].files[0]
    resync_file(b, JOB, client, a.uuid, rec1, f, {c.partition for c in f.chunks}, rec0,
                key="key", depth=10, partition_count=PARTITIONS)
    server.close()                      # slot a's member is gone
    store.slot_files = slot_files(_Member([a.uuid, b.uuid], {0: client}), b, JOB)
    got = store.restore("agg", snapshot_id=1)
    assert got.table.sort_by("key").equals(new.sort_by("key"))


def test_a_table_without_its_state_key_goes_as_byte_ranges(cluster):
    a, b, client, _, store = cluster
    rec0 = _snapshot(store, a, 0, _state([float(i) for i in range(2000)]))
    _stale_copy(a, b, rec0)
    new = _state([float(i) + 1 for i in range(2000)])
    rec1 = _snapshot(store, a, 1, new)
    f = rec1.vertices["agg"].files[0]
    parts = {c.partition for c in f.chunks}
    report = resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key=None,
                         partition_count=PARTITIONS)
    assert set(report.fallback) == parts and "state key" in report.fallback[min(parts)]
    assert report.copied_bytes == report.full_copy_bytes
    got, path = _restored(b, rec1, f, parts)
    assert got.sort_by("key").equals(new.sort_by("key"))
    _verify_file(path, f, JOB, 1, held_ranges(path)[1])


def test_before_a_restore_a_member_resyncs_what_its_slot_missed_and_reads_it_locally(cluster):
    """resync_for_restore (what Member._restore_handed calls): slot b keeps the record copy
    and files of snapshot 0; the record of snapshot 1 names only slot a. b resyncs the
    partitions it restores, says so in a merkle_resync event, and its restore then reads
    them from its own slot (slot a's member gone)."""
    from sparkjet.runtime.resync import resync_for_restore
    from sparkjet.runtime.storage import slot_files

    a, b, client, server, store = cluster
    old, rec0 = _stale_slot(store, a, b, record=True)
    new = _changed(old)
    rec1 = _snapshot(store, a, 1, new)
    member = _Member([a.uuid, b.uuid], {0: client})
    events = []
    restored = {0, 2, 5}
    reports = resync_for_restore(member, b, JOB, rec1, {"agg": (restored, "key")}, depth=10,
                                 partition_count=PARTITIONS, progress=events.append)
    assert [r.partitions for r in reports] == [sorted(restored)]
    (event,) = events
    assert event["event"] == "merkle_resync" and 0 < event["bytes"] < event["full_copy_bytes"]
    # done once: a copy in place is not synced again
    assert resync_for_restore(member, b, JOB, rec1, {"agg": (restored, "key")}) == []
    server.close()
    store.slot_files = slot_files(member, b, JOB)
    got = store.restore("agg", sorted(restored), snapshot_id=1).table
    want = new.filter(pa.array([p in restored for p in _partitions(new)]))
    assert got.sort_by("key").equals(want.sort_by("key"))


def _partitions(table):
    from sparkjet.partitioning import partition_ids

    return partition_ids(table, PARTITIONS, key="key").to_pylist()


def test_a_malformed_holder_answer_leaves_the_restore_to_the_holders(cluster):
    """Review finding: a holder answering the walk with malformed data (here counts that
    are not numbers, as a buggy or hostile peer might) made resync_for_restore raise a raw
    ValueError, failing the restore it only meant to speed up. It is logged now, nothing
    is written, and the restore reads from the holders."""
    from sparkjet.runtime.resync import resync_for_restore

    a, b, client, server, store = cluster
    old, rec0 = _stale_slot(store, a, b, record=True)
    rec1 = _snapshot(store, a, 1, _changed(old))
    holder = MerkleHolder(a, JOB)

    def malformed(body):
        answer = holder.open(body)
        answer["counts"] = {p: "many" for p in answer["counts"]}
        return answer
    holder.register(server)
    server.on_action("merkle_open", malformed)
    member = _Member([a.uuid, b.uuid], {0: client})
    assert resync_for_restore(member, b, JOB, rec1, {"agg": ({0, 2, 5}, "key")},
                              partition_count=PARTITIONS) == []
    f = rec1.vertices["agg"].files[0]
    assert not os.path.exists(os.path.join(b.job_path(JOB, REPLICAS), *_rel(rec1, f).split("/")))
    assert holder._sessions == {}          # the stale side closed the session it gave up


def test_a_slot_without_older_files_resyncs_nothing(cluster):
    """Review finding: a slot keeping only an older record (its files gone) ran a whole walk
    and wrote a copy of every byte to read it back; now there is nothing to start from, so
    the restore reads from the holders directly."""
    from sparkjet.runtime.resync import resync_for_restore

    a, b, client, server, store = cluster
    old = _state([float(i) for i in range(N)])
    _snapshot(store, a, 0, old)
    b.write_record(JOB, 0, store.committed_record(0)[0])     # the record, not the files
    rec1 = _snapshot(store, a, 1, _changed(old))
    MerkleHolder(a, JOB).register(server)
    member = _Member([a.uuid, b.uuid], {0: client})
    assert resync_for_restore(member, b, JOB, rec1, {"agg": ({0, 2, 5}, "key")},
                              partition_count=PARTITIONS) == []


def test_a_resync_of_a_fenced_execution_writes_no_copy(cluster):
    """Review finding: the copy was renamed into place without the slot's fence; an
    execution the slot has moved past now gets FencedError and leaves no file."""
    from sparkjet.errors import FencedError

    a, b, client, server, store = cluster
    old, rec0 = _stale_slot(store, a, b)
    rec1 = _snapshot(store, a, 1, _changed(old))
    f = rec1.vertices["agg"].files[0]
    MerkleHolder(a, JOB).register(server)
    b.fence(JOB, 9)                          # a newer execution has claimed the slot
    with pytest.raises(FencedError):
        resync_file(b, JOB, client, a.uuid, rec1, f, {c.partition for c in f.chunks}, rec0,
                    key="key", depth=8, partition_count=PARTITIONS, execution=5)
    assert not os.path.exists(os.path.join(b.job_path(JOB, REPLICAS), *_rel(rec1, f).split("/")))


def test_an_explicit_depth_too_deep_for_memory_is_lowered():
    """Review finding: merkle_tree_depth 27 asked for about 145 GB of trees; the deepest
    depth within 512 MiB is used instead (18 at 271 partitions), said in a warning."""
    assert resolve_depth(27, 1000, 1, 271, 16) == 18
    assert resolve_depth(12, 1000, 1, 271, 16) == 12


def test_a_file_whose_partitions_two_backups_share_is_resynced_from_both(tmp_path):
    """Found by the persistence campaign's stale-rejoin round: with backup_count=1 on three
    slots, the stale slot b wrote its own partitions' file, and its backups a and c each
    hold the ranges of only some of them. The resync took one of them for the whole file,
    which refused the ranges it does not hold (nothing synced); it syncs each partition from
    a slot that backs it, into one copy the restore reads from b."""
    import pyarrow.compute as pc

    from sparkjet.partition_table import PartitionTable
    from sparkjet.runtime.resync import resync_for_restore
    from sparkjet.runtime.storage import (
        encode_table,
        replicator,
        slot_files,
        slot_write_handler,
    )

    slots = [StorageSlot.claim(tmp_path / f"host-{h}", host=h) for h in "abc"]
    security = LinkSecurity.generate(5)
    servers = [ExchangeServer("127.0.0.1", execution_id=5, security=security) for _ in slots]
    for slot, server in zip(slots, servers):
        server.on_put("slot_write", slot_write_handler(slot, JOB))
        server.on_get("slot_read", slot_read_handler(slot, JOB))
        MerkleHolder(slot, JOB).register(server)
    clients = [ExchangeClient(s.location, security=security) for s in servers]
    try:
        uuids = [s.uuid for s in slots]
        table = PartitionTable.create(uuids, PARTITIONS, 1,
                                      groups={s.uuid: f"host-{h}" for s, h in zip(slots, "abc")})
        store = SnapshotStore(tmp_path / "store", JOB)
        store.register_execution(5)
        old = _state([float(i) for i in range(N)])
        owner = [uuids.index(table.owner(p)) for p in range(PARTITIONS)]

        def snapshot(sid, state):
            mine = pa.array([owner[p] for p in _partitions(state)])
            manifests = []
            for i, slot in enumerate(slots):
                member = _Member(uuids, {j: c for j, c in enumerate(clients) if j != i})
                member.topology.table = table
                w = store.writer(sid, 5, writer=i, partition_count=PARTITIONS, slot=slot,
                                 chunk_size=16384, replicate=replicator(member, slot, JOB))
                w.write_table("agg", state.filter(pc.equal(mine, i)), key="key")
                manifests.append(w.finish())
            store.commit(sid, 5, manifests, table=encode_table(table), plan='{"v": 1}')
            data, _, _ = store.committed_record(sid)
            return meta.decode(data, meta.ValidationRecord, f"snapshot {sid}", "record")

        snapshot(0, old)
        b = slots[1]
        b.write_record(JOB, 0, store.committed_record(0)[0])
        new = _changed(old)
        rec1 = snapshot(1, new)
        # b missed snapshot 1: its folder of it gone
        shutil.rmtree(os.path.join(b.replicas(JOB).root, layout.SNAPSHOTS,
                                   layout.snapshot_dir(1, 5)))
        (f,) = [f for f in rec1.vertices["agg"].files if f.slot == b.uuid]
        restored = set(table.partitions_of(b.uuid))
        backups = {table.replicas(p)[1] for p in restored}
        assert backups == {slots[0].uuid, slots[2].uuid}, "both backups share b's partitions"
        member = _Member(uuids, {0: clients[0], 2: clients[2]})
        events = []
        reports = resync_for_restore(member, b, JOB, rec1, {"agg": (restored, "key")},
                                     depth=10, partition_count=PARTITIONS,
                                     progress=events.append)
        assert len(reports) == 1 and sorted(reports[0].partitions) == sorted(restored)
        assert set(reports[0].holder.split(", ")) == backups
        (event,) = events
        assert 0 < event["bytes"] and event["full_copy_bytes"] > 0
        for s in servers:           # b reads its partitions from its own slot
            s.close()
        store.slot_files = slot_files(member, b, JOB)
        got = store.restore("agg", sorted(restored), snapshot_id=1).table
        want = new.filter(pa.array([p in restored for p in _partitions(new)]))
        assert got.sort_by("key").equals(want.sort_by("key"))
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()
        for s in slots:
            s.release()


@pytest.mark.parametrize("depth", [10, "auto"])
def test_a_dense_change_moves_no_more_than_a_copy_and_a_bounded_overhead(cluster, depth):
    """Every key's value changed between the snapshots: the trees differ everywhere, so each
    partition's walk stops after a few levels and the partition goes as byte ranges; the
    resync moves a copy's bytes plus the open and those few levels, never (much) more. The
    copy is the holder's, bit for bit."""
    a, b, client, _, store = cluster
    old, rec0 = _stale_slot(store, a, b)
    new = _state([float(i) + 0.25 for i in range(N)])
    rec1 = _snapshot(store, a, 1, new)
    f = rec1.vertices["agg"].files[0]
    parts = {c.partition for c in f.chunks}
    report = resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key="key", depth=depth,
                         partition_count=PARTITIONS)
    assert report.ways == {p: "copy" for p in parts}
    assert report.copied_bytes == report.full_copy_bytes
    assert report.synced_bytes <= report.full_copy_bytes * 1.02 + 2048, report.to_dict()
    got, path = _restored(b, rec1, f, parts)
    assert got.sort_by("key").equals(new.sort_by("key"))
    _verify_file(path, f, JOB, 1, held_ranges(path)[1])


def test_a_sparse_change_goes_by_merkle_and_moves_under_2_percent_of_a_copy(cluster):
    """0.1 % of the values of 200k spread keys changed: every partition still goes by
    Merkle, and the resync (walk, headers, rows) moves at most 2 % of a copy's bytes."""
    a, b, client, _, store = cluster
    n, rng = 200_000, np.random.default_rng(25)
    keys = rng.choice(2**40, n, replace=False)
    values = rng.random(n)
    rec0 = _snapshot(store, a, 0, _state(values, keys), chunk_size=128 * 1024)
    _stale_copy(a, b, rec0)
    values[17::1000] += 1
    new = _state(values, keys)
    rec1 = _snapshot(store, a, 1, new, chunk_size=128 * 1024)
    f = rec1.vertices["agg"].files[0]
    parts = {c.partition for c in f.chunks}
    report = resync_file(b, JOB, client, a.uuid, rec1, f, parts, rec0, key="key", depth="auto",
                         partition_count=PARTITIONS)
    assert report.ways == {p: "merkle" for p in parts} and report.copied_bytes == 0
    assert report.synced_bytes <= 0.02 * report.full_copy_bytes, report.to_dict()
    got, path = _restored(b, rec1, f, parts)
    assert got.sort_by("key").equals(new.sort_by("key"))
    _verify_file(path, f, JOB, 1, held_ranges(path)[1])
