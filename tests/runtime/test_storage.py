"""The members' storage as the runtime uses it (sparkjet.runtime.storage): a snapshot
written into storage slots, its record in the store (format 2, with the table and the
plan), a restore that reads its own slot from disk and a peer's over a real exchange
server, and the refusals: a slot no member holds, a path outside the slot, another slot;
backups as fenced file streams (Flight DoPut) that the receiver checks before it keeps
them: a corrupted, short or cut stream, another execution's, another job's credentials."""
import os
import threading

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sparkjet.errors import (
    ExchangeAuthError,
    ExchangeFencedError,
    ExchangeRefusedError,
    InvalidArgumentError,
    SnapshotIncompleteError,
)
from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.storage import drop_old_snapshots, slot_files, slot_read_handler
from sparkjet.snapshot.slots import StorageSlot
from sparkjet.snapshot.store import SnapshotStore

JOB = 0xABC


class _Member:
    """What slot_files asks of a member: the slots of the execution and its peers."""

    def __init__(self, slots, peers):
        self.topology = type("T", (), {"slots": slots})()
        self.peers = peers


def _state(n, offset):
    return pa.table({"key": pa.array(range(offset, offset + n), pa.int64()),
                     "v": pa.array([float(i) for i in range(n)])})


def _write(store, slots, snapshot_id=0, execution=1):
    """Each slot's writer writes a keyed table (as a processor would) and a broadcast
    entry; the store commits the record."""
    manifests = []
    for i, slot in enumerate(slots):
        w = store.writer(snapshot_id, execution, writer=i, partition_count=7, slot=slot)
        w.write_table("agg", _state(1000, i * 1000), key="key")
        w.write_broadcast_entries("src", [str(i).encode()], [f"state {i}".encode()])
        manifests.append(w.finish())
    return store.commit(snapshot_id, execution, manifests, table="dGFibGU=", plan='{"v": 1}')


def test_a_snapshot_in_slots_restores_from_its_own_slot_and_a_peers(tmp_path, two_slots):
    a, b = two_slots
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    _write(store, [a, b])
    stored = store._resolve(0, None)
    assert stored.record.format == 2 and stored.record.table == "dGFibGU="
    assert store.recorded_plan(0) == '{"v": 1}'
    assert {f.slot for v in stored.record.vertices.values() for f in v.files} == {a.uuid, b.uuid}
    # the driver has no slots: verify passes over their files, restore names the slot
    store.verify(0)
    with pytest.raises(SnapshotIncompleteError, match=f"storage slot {a.uuid}, which is not "
                                                      "reachable here"):
        store.restore("agg")
    security = LinkSecurity.generate(1)
    server = ExchangeServer("127.0.0.1", execution_id=1, security=security)
    server.on_get("slot_read", slot_read_handler(b, JOB))
    try:
        peer = ExchangeClient(server.location, security=security)
        member = _Member([a.uuid, b.uuid], {1: peer})
        store.slot_files = slot_files(member, a, JOB)
        got = store.restore("agg")
        want = pa.concat_tables([_state(1000, 0), _state(1000, 1000)])
        assert got.table.sort_by("key").equals(want.sort_by("key"))
        sources = store.restore("src").broadcast_entries
        assert sorted(sources[1].to_pylist()) == [b"state 0", b"state 1"]
        part = store.restore("agg", [3])           # only partition 3's ranges are read
        assert 0 < part.table.num_rows < 2000
        # the handler refuses what is not a chunk file of its own slot
        for body, match in (
            ({"slot": a.uuid, "path": "snapshots/x/agg/0-0.chunks", "offset": 0, "length": 1},
             "this member holds slot"),
            ({"slot": b.uuid, "path": "../../MEMBER.json", "offset": 0, "length": 1},
             "not a chunk file's path"),
            ({"slot": b.uuid, "path": _a_file(b), "offset": 0, "length": 1 << 40},
             "bad range"),
        ):
            with pytest.raises(ExchangeRefusedError, match=match):
                peer.get_file("slot_read", body)

        # a slot that no member of the execution holds: named, with what to do
        store.slot_files = slot_files(_Member([a.uuid], {}), a, JOB)
        with pytest.raises(SnapshotIncompleteError, match=rf"in storage slot\(s\) {b.uuid}, none "
                                                          "of which a member of this execution"):
            store.restore("agg")
    finally:
        server.close()


def test_a_record_mixing_slots_and_the_store_is_refused_and_exports_say_why(tmp_path,
                                                                           two_slots):
    a, _ = two_slots
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    in_slot = store.writer(0, 1, writer=0, slot=a)
    in_slot.write_broadcast_entries("src", [b"0"], [b"s"])
    in_store = store.writer(0, 1, writer=1)
    in_store.write_broadcast_entries("src", [b"1"], [b"s"])
    with pytest.raises(InvalidArgumentError, match="some chunk files are in storage slots"):
        store.commit(0, 1, [in_slot.finish(), in_store.finish()])
    _write(store, [a], snapshot_id=1)
    with pytest.raises(InvalidArgumentError, match="without a durable copy: an export needs the files"):
        store.export(1, "v1")


def test_slots_drop_the_snapshots_the_store_no_longer_keeps(tmp_path, two_slots):
    a, b = two_slots
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    for sid in range(4):
        _write(store, [a, b], snapshot_id=sid)
    keep = [c.snapshot for _, c in store._retained()]
    assert keep == [2, 3]
    folder = a.replicas(JOB).path("snapshots")
    before = sorted(a.replicas(JOB).listdir(folder))
    assert len(before) == 4
    drop_old_snapshots(a, JOB, 3, keep)
    after = a.replicas(JOB).listdir(folder)
    assert after == before[2:]


def test_backups_are_verified_copies_a_restore_falls_back_to(tmp_path, two_slots):
    """Each writer copies its files to the slots that back their partitions (here: the
    other slot, which backs everything) through the peer's slot_write action, which checks
    size and xxh3. When the writer's slot is gone, a restore reads the copies."""
    from sparkjet.partition_table import PartitionTable
    from sparkjet.runtime.storage import replicator, slot_write_handler

    a, b = two_slots
    table = PartitionTable.create([a.uuid, b.uuid], 7, 1, groups={a.uuid: "a", b.uuid: "b"})
    security = LinkSecurity.generate(1)
    servers = {}
    for slot in (a, b):
        servers[slot.uuid] = ExchangeServer("127.0.0.1", execution_id=1, security=security)
        servers[slot.uuid].on_put("slot_write", slot_write_handler(slot, JOB))
        servers[slot.uuid].on_get("slot_read", slot_read_handler(slot, JOB))
    try:
        clients = {i: ExchangeClient(servers[u].location, security=security)
                   for i, u in enumerate((a.uuid, b.uuid))}
        members = [_Member([a.uuid, b.uuid], {1 - i: clients[1 - i]}) for i in range(2)]
        for m in members:
            m.topology.table = table
        store = SnapshotStore(tmp_path / "store", JOB)
        store.register_execution(1)
        manifests = []
        for i, slot in enumerate((a, b)):
            w = store.writer(0, 1, writer=i, partition_count=7, slot=slot,
                             replicate=replicator(members[i], slot, JOB))
            w.write_table("agg", _state(1000, i * 1000), key="key")
            manifests.append(w.finish())
        store.commit(0, 1, manifests, table="dGFibGU=")
        files = store._resolve(0, None).record.vertices["agg"].files
        assert {(f.slot, tuple(f.replicas)) for f in files} == {(a.uuid, (b.uuid,)),
                                                                (b.uuid, (a.uuid,))}
        # slot b's own files are gone (its folder wiped); a holds copies of them
        for f in files:
            if f.slot == b.uuid:
                os.remove(os.path.join(b.replicas(JOB).root, "snapshots",
                                       "000000000000-e000000000001", f.path))
        store.slot_files = slot_files(_Member([a.uuid], {}), a, JOB)
        got = store.restore("agg").table.sort_by("key")
        assert got.equals(pa.concat_tables([_state(1000, 0), _state(1000, 1000)]).sort_by("key"))
    finally:
        for server in servers.values():
            server.close()


def _a_file(slot) -> str:
    """The path, in the slot, of the first chunk file the slot holds."""
    root = slot.replicas(JOB).root
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".chunks"):
                return os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
    raise AssertionError(f"no chunk file in {root}")


@pytest.fixture
def receiver(tmp_path):
    """Slot b behind a real exchange server of execution 2, and a client of it."""
    from sparkjet.runtime.storage import slot_write_handler

    b = StorageSlot.claim(tmp_path / "host-b", host="b")
    security = LinkSecurity.generate(2)
    server = ExchangeServer("127.0.0.1", execution_id=2, security=security)
    server.on_put("slot_write", slot_write_handler(b, JOB))
    server.on_get("slot_read", slot_read_handler(b, JOB))
    client = ExchangeClient(server.location, security=security)
    yield b, client, security, server
    client.close()
    server.close()
    b.release()


PATH = "snapshots/000000000001-e000000000002/agg/9-0.chunks"


def _kept(slot, path=PATH) -> bool:
    folder = os.path.join(slot.replicas(JOB).root, *path.split("/")[:-1])
    return os.path.exists(os.path.join(slot.replicas(JOB).root, path)) or (
        os.path.isdir(folder) and bool(os.listdir(folder)))


def _whole(data: bytes) -> tuple[dict, dict]:
    """The body and trailer of a slot_write stream carrying all of ``data``, one range."""
    import xxhash

    return ({"slot": None, "path": PATH, "size": len(data), "ranges": [[0, len(data)]]},
            {"size": len(data), "ranges": [[0, len(data), xxhash.xxh3_64_hexdigest(data)]]})


def test_a_backup_stream_is_kept_once_its_size_and_checksum_check_out(receiver):
    import xxhash

    b, client, _, _ = receiver
    data = os.urandom(3 * (1 << 20) + 17)
    body, trailer = _whole(data)
    put = client.put_file("slot_write", {**body, "slot": b.uuid})
    for at in range(0, len(data), 1 << 20):
        put.write(data[at:at + (1 << 20)])
    answer = put.finish(trailer)
    assert answer == {"verified": [[0, len(data), xxhash.xxh3_64_hexdigest(data)]],
                      "bytes": len(data)}
    with open(os.path.join(b.replicas(JOB).root, PATH), "rb") as f:
        assert f.read() == data
    # a peer reads ranges of it back over DoGet, across pieces
    peer = slot_files(_Member([b.uuid], {0: client}), StorageSlot.claim(b.path + "-c", host="c"),
                      JOB)([b.uuid], PATH)
    assert peer.size() == len(data)
    read = peer.range_reader()
    assert bytes(read(5, len(data) - 9)) == data[5:-4]
    assert bytes(read(1 << 20, 10)) == data[1 << 20:(1 << 20) + 10]


def test_a_backup_stream_of_ranges_is_kept_sparse_and_reads_back_only_those(receiver):
    """A backup gets the byte ranges of the partitions it backs: each is written at its
    offset in a file of the writer's size (the rest a hole), its sidecar names them, and
    a read of anything else, here or from a peer, is refused (a hole reads as zeros)."""
    import xxhash

    from sparkjet.runtime.storage import held_ranges

    b, client, _, _ = receiver
    data = os.urandom(3 << 20)
    ranges = [(100, 5000), (1 << 20, (1 << 20) + 17), (2 << 20, 3 << 20)]
    put = client.put_file("slot_write", {"slot": b.uuid, "path": PATH, "size": len(data),
                                         "ranges": [[s, e - s] for s, e in ranges]})
    for s, e in ranges:
        for at in range(s, e, 700_000):      # pieces that do not line up with the ranges
            put.write(data[at:min(e, at + 700_000)])
    put.finish({"size": len(data), "ranges": [
        [s, e - s, xxhash.xxh3_64_hexdigest(data[s:e])] for s, e in ranges]})
    final = os.path.join(b.replicas(JOB).root, PATH)
    assert os.path.getsize(final) == len(data)
    assert held_ranges(final) == (len(data), ranges)
    with open(final, "rb") as f:
        copy = f.read()
    for s, e in ranges:
        assert copy[s:e] == data[s:e]
    assert copy[5000:1 << 20] == bytes((1 << 20) - 5000)   # a hole
    peer = slot_files(_Member([b.uuid], {0: client}), StorageSlot.claim(b.path + "-c", host="c"),
                      JOB)([b.uuid], PATH)
    read = peer.range_reader()
    assert bytes(read((1 << 20) + 3, 10)) == data[(1 << 20) + 3:(1 << 20) + 13]
    for offset, length in ((0, 200), (4990, 20), ((1 << 20) + 10, 10)):
        with pytest.raises(ExchangeRefusedError, match="this copy holds bytes 100..5000, "
                                                       "1048576..1048593, 2097152..3145728"):
            read(offset, length)


@pytest.mark.parametrize("fault", ["corrupted", "short", "no trailer", "after the trailer",
                                   "flipped range", "overlapping", "outside"])
def test_a_corrupted_or_short_backup_stream_is_refused_and_not_kept(receiver, fault):
    """The receiver checks what it read against the writer's trailer: a flipped byte, a
    missing piece, a stream that ends without its trailer (the writer stopped) or goes on
    after it, a byte flipped in one range of several are refused, as are ranges that
    overlap or lie outside the file, and nothing of the copy stays in the slot."""
    import xxhash

    b, client, _, _ = receiver
    data = os.urandom(2 * (1 << 20) + 5)
    body, trailer = _whole(data)
    body["slot"] = b.uuid
    pieces = [data[:1 << 20], data[1 << 20:2 << 20], data[2 << 20:]]
    if fault == "corrupted":
        pieces[1] = pieces[1][:100] + bytes([pieces[1][100] ^ 1]) + pieces[1][101:]
    elif fault == "short":
        del pieces[1]
    elif fault == "flipped range":
        ranges = [(0, 1000), (5000, 9000), (1 << 20, 2 << 20)]
        body["ranges"] = [[s, e - s] for s, e in ranges]
        trailer["ranges"] = [[s, e - s, xxhash.xxh3_64_hexdigest(data[s:e])] for s, e in ranges]
        pieces = [data[s:e] for s, e in ranges]
        pieces[1] = pieces[1][:7] + bytes([pieces[1][7] ^ 0x10]) + pieces[1][8:]
    elif fault in ("overlapping", "outside"):
        body["ranges"] = ([[0, 1000], [999, 10]] if fault == "overlapping"
                          else [[0, 1000], [len(data) - 5, 6]])
    put = client.put_file("slot_write", body)
    if fault in ("overlapping", "outside"):
        with pytest.raises(ExchangeRefusedError, match="overlaps" if fault == "overlapping"
                           else "outside the file's 2097157 bytes"):
            put.write(data[:1000])
            put.finish(trailer)
        assert not _kept(b)
        return
    for piece in pieces:
        put.write(piece)
    if fault == "no trailer":
        put.abort()
        # the receiver saw the stream end without the trailer: nothing is kept
        assert not _kept(b)
        return
    if fault == "after the trailer":
        put._writer.write_metadata(b'{"size": 0}')
    want = {"corrupted": "the copy of .* has 2097157 bytes in ranges",
            "short": "the copy of .* has 1048581 bytes",
            "flipped range": r"the copy of .* has 1053576 bytes in ranges .*\[5000, 4000, '",
            "after the trailer": "after the trailer"}[fault]
    with pytest.raises(ExchangeRefusedError, match=want):
        put.finish(trailer)
    assert not _kept(b)


def test_a_backup_stream_of_another_execution_or_credentials_is_refused(receiver):
    """Fenced like the exchange's data streams: a stream naming an older execution (a
    zombie's) is refused before it is read, and one without this execution's credentials
    is refused before any handler runs; a read is fenced alike."""
    b, client, _, server = receiver
    with pytest.raises(ExchangeFencedError, match="belongs to execution 1, but this server "
                                                  "runs execution 2"):
        put = client.put_file("slot_write", {"slot": b.uuid, "path": PATH}, execution_id=1)
        put.write(b"abc")
        put.finish({"size": 3, "xxh3": "0"})
    with pytest.raises(ExchangeFencedError, match="belongs to execution 1"):
        client.get_file("slot_read", {"slot": b.uuid, "path": PATH, "offset": 0,
                                      "length": 0}, execution_id=1)
    stale = ExchangeClient(server.location, security=LinkSecurity.generate(2))
    try:
        with pytest.raises(ExchangeAuthError):
            put = stale.put_file("slot_write", {"slot": b.uuid, "path": PATH})
            put.write(b"abc")
            put.finish({"size": 3, "xxh3": "0"})
    finally:
        stale.close()
    assert not _kept(b)
    # a stream to another slot, or outside the slot's snapshots, is refused
    for body, match in (({"slot": "other", "path": PATH}, "this member holds slot"),
                        ({"slot": b.uuid, "path": "../../MEMBER.json"},
                         "not a chunk file's path")):
        put = client.put_file("slot_write", body)
        with pytest.raises(ExchangeRefusedError, match=match):
            put.write(b"abc")
            put.finish({"size": 3, "xxh3": "0"})


def test_backups_over_tls_links(tmp_path, two_slots):
    """With a TLS identity the file streams are TLS, like every call on the links."""
    from sparkjet.runtime.exchange.security import TLSIdentity
    from sparkjet.runtime.storage import slot_write_handler

    _, b = two_slots
    security = LinkSecurity.generate(3, tls=TLSIdentity.self_signed())
    server = ExchangeServer("127.0.0.1", execution_id=3, security=security)
    server.on_put("slot_write", slot_write_handler(b, JOB))
    server.on_get("slot_read", slot_read_handler(b, JOB))
    assert server.location.startswith("grpc+tls://")
    client = ExchangeClient(server.location, security=security)
    try:
        body, trailer = _whole(b"x" * 1000)
        put = client.put_file("slot_write", {**body, "slot": b.uuid})
        put.write(b"x" * 1000)
        put.finish(trailer)
        info, pieces = client.get_file("slot_read", {"slot": b.uuid, "path": PATH,
                                                     "offset": 10, "length": 20})
        assert info == {"size": 1000} and b"".join(p.to_pybytes() for p in pieces) == b"x" * 20
    finally:
        client.close()
        server.close()


def test_on_one_host_the_slots_are_their_own_groups():
    from sparkjet.runtime import JobConfig
    from sparkjet.runtime.storage import table_for

    config = JobConfig(name="one-host", processing_guarantee="none", storage="members")
    reports = [{"uuid": f"00000000-0000-4000-8000-00000000000{i}", "host": "vm"}
               for i in range(3)]
    table = table_for(config, reports)
    assert all(None not in table.replicas(p) for p in range(271))   # every backup placed
    assert all(len(set(table.replicas(p))) == 2 for p in range(271))


def test_the_durable_tier_restores_when_no_slot_is_left_and_allows_exports(tmp_path, two_slots):
    """durable_tier="sync": each file written into a slot is copied into the store too. A
    driver then verifies every chunk, a restore whose slots are all gone reads the copies,
    and the snapshot can be exported."""
    a, b = two_slots
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    manifests = []
    for i, slot in enumerate((a, b)):
        w = store.writer(0, 1, writer=i, partition_count=7, slot=slot, durable=True)
        w.write_table("agg", _state(1000, i * 1000), key="key")
        manifests.append(w.finish())
    store.commit(0, 1, manifests, table="dGFibGU=")
    assert all(f.durable for f in store._resolve(0, None).record.vertices["agg"].files)
    want = pa.concat_tables([_state(1000, 0), _state(1000, 1000)]).sort_by("key")
    store.verify(0)                                       # reads the copies: no slots here
    assert store.restore("agg").table.sort_by("key").equals(want)
    store.slot_files = slot_files(_Member([], {}), StorageSlot.claim(tmp_path / "c", host="c"),
                                  JOB)                    # a member that holds neither slot
    assert store.restore("agg").table.sort_by("key").equals(want)
    store.export(0, "v1")
    assert store.restore("agg", name="v1").table.sort_by("key").equals(want)


def test_durable_tier_needs_the_members_storage():
    from sparkjet.runtime import JobConfig

    with pytest.raises(InvalidArgumentError, match="durable_tier is a copy of the members'"):
        JobConfig(name="x", processing_guarantee="none", storage="shared", durable_tier="sync")


def test_a_restore_counts_every_partition_against_the_slots_it_holds(tmp_path, two_slots):
    """Before restoring, what no reachable slot holds is named at once: vertices,
    partitions (as ranges), the slots and their hosts, and what to do."""
    from sparkjet.partition_table import PartitionTable
    from sparkjet.runtime.storage import check_reachable, encode_table

    a, b = two_slots
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    table = PartitionTable.create([a.uuid, b.uuid], 7, 0, groups={a.uuid: "host-a",
                                                                  b.uuid: "host-b"})
    manifests = []
    for i, slot in enumerate((a, b)):
        w = store.writer(0, 1, writer=i, partition_count=7, slot=slot)
        w.write_table("agg", _state(1000, i * 1000), key="key")
        w.write_broadcast_entries("src", [str(i).encode()], [b"s"])
        manifests.append(w.finish())
    store.commit(0, 1, manifests, table=encode_table(table))
    check_reachable(store, 0, _Member([a.uuid, b.uuid], {}))      # both held: nothing said
    with pytest.raises(SnapshotIncompleteError) as caught:
        check_reachable(store, 0, _Member([a.uuid], {}))
    message = str(caught.value)
    assert "agg: partitions 0-6" in message and "src: broadcast state" in message
    assert f"{b.uuid} (host host-b)" in message and "backup_count" in message


def _members_config(tmp_path, **kw):
    from sparkjet.runtime import JobConfig

    return JobConfig(name="driver-only", storage="members", storage_dir=str(tmp_path / "slots"),
                     snapshot_store=str(tmp_path / "store"), partition_count=7, **kw)


def test_a_writer_in_a_slot_is_fenced_by_the_slot_and_never_opens_the_store(tmp_path):
    """A member's writer (members' storage) checks the slot's FENCE, not the store's log:
    it writes with no store at all, and once a newer execution has fenced the slot (its
    task claimed it), the older execution's writer is refused, mid-snapshot or new."""
    from sparkjet.errors import FencedError
    from sparkjet.runtime.storage import SlotWriterLink, slot_writer

    config = _members_config(tmp_path)
    with StorageSlot.claim(config.storage_root(), host="a") as slot:
        slot.fence(config.id, 1)
        link = SlotWriterLink(config, slot)
        w = slot_writer(config, link, 0, 1, writer=0, replicate=None)
        w.write_table("agg", _state(100, 0), key="key")
        manifest = w.finish()
        assert {f["slot"] for f in manifest.files} == {slot.uuid}
        w = slot_writer(config, link, 1, 1, writer=0, replicate=None)
        slot.fence(config.id, 2)
        with pytest.raises(FencedError, match="execution 1 .* fenced off by execution 2"):
            w.write_table("agg", _state(100, 0), key="key")
        with pytest.raises(FencedError, match="fenced off by execution 2"):
            slot_writer(config, link, 1, 1, writer=0, replicate=None)
        with pytest.raises(InvalidArgumentError, match="only the driver commits"):
            link.commit(0, 1, [manifest])
    assert not (tmp_path / "store").exists(), "the member never touched snapshot_store"


def _committed_in_slots(tmp_path, config, slots, **writer):
    """Each slot's writer (as a member's) writes; the driver's store commits the record."""
    from sparkjet.runtime.storage import SlotWriterLink, slot_writer

    store = SnapshotStore(config.snapshot_store, config.id)
    store.register_execution(1)
    manifests = []
    for i, slot in enumerate(slots):
        slot.fence(config.id, 1)
        w = slot_writer(config, SlotWriterLink(config, slot), 0, 1, writer=i, **writer)
        w.write_table("agg", _state(1000, i * 1000), key="key")
        w.write_broadcast_entries("src", [str(i).encode()], [f"state {i}".encode()])
        manifests.append(w.finish())
    store.commit(0, 1, manifests, table="dGFibGU=", plan='{"v": 1}')
    return store


def test_a_member_restores_from_the_record_the_driver_hands_it(tmp_path, two_slots):
    """The driver hands the committed record (its bytes, folder and name); the member
    reads the snapshot from it and the slots alone (RecordView: no log, no store), and a
    record that does not match its name, or another snapshot, is refused."""
    from sparkjet.errors import SnapshotCorruptError, SnapshotNotFoundError
    from sparkjet.runtime.storage import check_reachable
    from sparkjet.snapshot.store import RecordView

    a, b = two_slots
    config = _members_config(tmp_path)
    store = _committed_in_slots(tmp_path, config, [a, b], replicate=None)
    data, directory, file = store.committed_record(0)
    view = RecordView(config.id, data, directory, file, name=config.name)
    security = LinkSecurity.generate(1)
    server = ExchangeServer("127.0.0.1", execution_id=1, security=security)
    server.on_get("slot_read", slot_read_handler(b, config.id))
    try:
        member = _Member([a.uuid, b.uuid], {1: ExchangeClient(server.location, security=security)})
        view.slot_files = slot_files(member, a, config.id)
        check_reachable(view, 0, member)
        assert view.recorded_plan(0) == '{"v": 1}'
        got = view.restore("agg", snapshot_id=0).table.sort_by("key")
        assert got.equals(pa.concat_tables([_state(1000, 0), _state(1000, 1000)]).sort_by("key"))
        with pytest.raises(SnapshotNotFoundError, match="only snapshot 0 is readable here"):
            view.restore("agg", snapshot_id=1)
        with pytest.raises(InvalidArgumentError, match="it has no log"):
            view.latest_complete()
    finally:
        server.close()
    with pytest.raises(SnapshotCorruptError, match="validation record checksum"):
        RecordView(config.id, data.replace(b'"agg"', b'"agh"', 1), directory, file)


def test_phase_2_keeps_the_record_in_every_slot_and_drops_what_the_store_does_not_keep(
        tmp_path, two_slots):
    from sparkjet.errors import FencedError
    from sparkjet.runtime.storage import keep_committed

    a, _ = two_slots
    config = _members_config(tmp_path)
    store = SnapshotStore(config.snapshot_store, config.id)
    store.register_execution(1)
    a.fence(config.id, 1)
    for sid in range(4):
        _write(store, [a], snapshot_id=sid)
        data, _, _ = store.committed_record(sid)
        keep_committed(a, config.id, sid, 1, data, [c.snapshot for _, c in store._retained()])
    assert a.records(config.id) == [2, 3]
    assert a.read_record(config.id, 3) == store.committed_record(3)[0]
    assert len(a.replicas(config.id).listdir(a.replicas(config.id).path("snapshots"))) == 2
    a.fence(config.id, 2)                  # a newer execution's task claimed the slot
    with pytest.raises(FencedError, match="fenced off by execution 2"):
        keep_committed(a, config.id, 4, 1, b"zombie", [3, 4])
    assert a.records(config.id) == [2, 3]


def test_phase_2_in_a_slot_that_cannot_drop_an_old_snapshot_goes_on(tmp_path, two_slots, caplog):
    """A committed snapshot's housekeeping that fails (an old record copy that cannot be
    removed: here a file bind-mounted over it, EBUSY) is a warning, not a failed execution
    (it failed the member, and so restarted the job, after a commit that had succeeded)."""
    import subprocess

    from sparkjet.runtime.storage import keep_committed

    a, _ = two_slots
    config = _members_config(tmp_path)
    store = SnapshotStore(config.snapshot_store, config.id)
    store.register_execution(1)
    a.fence(config.id, 1)
    _write(store, [a], snapshot_id=0)
    keep_committed(a, config.id, 0, 1, store.committed_record(0)[0], [0])
    pinned = a.job_path(config.id, "records", f"{0:020d}")
    (tmp_path / "over").write_bytes(b"x")
    mounted = subprocess.run(["mount", "--bind", str(tmp_path / "over"), pinned],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        for sid in (1, 2):
            _write(store, [a], snapshot_id=sid)
            keep_committed(a, config.id, sid, 1, store.committed_record(sid)[0], [sid])
        assert a.records(config.id)[-1] == 2         # each commit's copy kept all the same
        assert "could not drop snapshots older than" in caplog.text
    finally:
        subprocess.run(["umount", pinned], check=False)


def test_durable_copies_reach_a_member_through_the_driver(tmp_path, two_slots):
    """durable_tier="sync" and no slot left: the member reads the store's copies through
    the driver's store_read action (DriverStoreFiles), which serves that snapshot's folder
    and nothing else."""
    from sparkjet.runtime.storage import DriverStoreFiles, store_read_handler
    from sparkjet.snapshot.store import RecordView

    a, b = two_slots
    config = _members_config(tmp_path, durable_tier="sync")
    store = _committed_in_slots(tmp_path, config, [a, b], replicate=None)
    data, directory, file = store.committed_record(0)
    security = LinkSecurity.generate(1)
    driver = ExchangeServer("127.0.0.1", execution_id=1, security=security)
    driver.on_action("store_read", store_read_handler(store, directory))
    try:
        client = ExchangeClient(driver.location, security=security)
        view = RecordView(config.id, data, directory, file, backend=DriverStoreFiles(client))
        with StorageSlot.claim(tmp_path / "c", host="c") as c:  # holds neither slot's files
            view.slot_files = slot_files(_Member([c.uuid], {}), c, config.id)
            got = view.restore("agg").table.sort_by("key")
        assert got.equals(pa.concat_tables([_state(1000, 0), _state(1000, 1000)]).sort_by("key"))
        for path in ("log", f"job-{config.id:016x}/log/000000000000.json",
                     "/".join((f"job-{config.id:016x}", *directory, "..", "..", "log"))):
            with pytest.raises(ExchangeRefusedError, match="is not a file of the snapshot"):
                client.action("store_read", {"op": "list", "path": path})
    finally:
        driver.close()


@pytest.fixture
def three_hosts(tmp_path):
    """Three slots (hosts a, b, c), each behind a real exchange server with slot_write and
    slot_read, and a client of each."""
    from sparkjet.runtime.storage import slot_write_handler

    slots = [StorageSlot.claim(tmp_path / f"host-{h}", host=h) for h in "abc"]
    security = LinkSecurity.generate(1)
    servers = [ExchangeServer("127.0.0.1", execution_id=1, security=security) for _ in slots]
    for slot, server in zip(slots, servers):
        server.on_put("slot_write", slot_write_handler(slot, JOB))
        server.on_get("slot_read", slot_read_handler(slot, JOB))
    clients = [ExchangeClient(s.location, security=security) for s in servers]
    yield slots, clients
    _close(clients, servers, slots)


def _close(clients, servers, slots) -> None:
    """A fixture's teardown: its exchange clients, then servers, then slots."""
    for c in clients:
        c.close()
    for s in servers:
        s.close()
    for slot in slots:
        slot.release()


def _replicated(tmp_path, slots, clients, backup_count):
    """A snapshot of 12 partitions over three slots with ``backup_count``: each slot's
    writer writes the keys of the partitions its slot is primary of (as a processor does)
    and a broadcast entry, replicated by the real replicator; the record holds the table."""
    from sparkjet.partition_table import PartitionTable
    from sparkjet.partitioning import partition_ids
    from sparkjet.runtime.storage import encode_table, replicator

    uuids = [s.uuid for s in slots]
    table = PartitionTable.create(uuids, 12, backup_count,
                                  groups={s.uuid: f"host-{h}" for s, h in zip(slots, "abc")})
    state = _state(6000, 0)
    owner = [uuids.index(table.owner(p)) for p in range(12)]
    mine = pa.array([owner[p] for p in partition_ids(state, 12, key="key").to_pylist()])
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    manifests = []
    for i, slot in enumerate(slots):
        member = _Member(uuids, {j: c for j, c in enumerate(clients) if j != i})
        member.topology.table = table
        w = store.writer(0, 1, writer=i, partition_count=12, slot=slot,
                         replicate=replicator(member, slot, JOB))
        w.write_table("agg", state.filter(pc.equal(mine, i)), key="key")
        w.write_broadcast_entries("src", [str(i).encode()], [f"state {i}".encode()])
        manifests.append(w.finish())
    store.commit(0, 1, manifests, table=encode_table(table))
    return store, table, state


def test_a_backup_slot_holds_only_the_ranges_of_the_partitions_it_backs(tmp_path, three_hosts):
    """With backup_count=1 on three slots, each backup's copy of a processor's file holds
    the byte ranges of the partitions it backs and nothing else (the rest a hole), named by
    its sidecar; the backups hold the state once, not once per slot; broadcast state goes
    whole to every slot. A slot lost, each partition restores from its backup's ranges."""
    import shutil

    from sparkjet.runtime.storage import check_reachable, held_ranges
    from sparkjet.snapshot.chunks import HEADER_SIZE
    from sparkjet.snapshot.reading import slot_path

    slots, clients = three_hosts
    store, table, state = _replicated(tmp_path, slots, clients, 1)
    stored = store._resolve(0, None)
    by_uuid = {s.uuid: s for s in slots}
    backed = 0
    for f in stored.record.vertices["agg"].files:
        primary = by_uuid[f.slot].replicas(JOB).root
        assert held_ranges(os.path.join(primary, slot_path(stored, f))) is None   # whole
        assert all(table.owner(c.partition) == f.slot for c in f.chunks)
        for u in f.replicas:
            want = []
            for c in f.chunks:
                if u in table.replicas(c.partition)[1:]:
                    start, end = c.offset, c.offset + HEADER_SIZE + c.stored_size
                    if want and want[-1][1] == start:
                        want[-1] = (want[-1][0], end)
                    else:
                        want.append((start, end))
            copy = os.path.join(by_uuid[u].replicas(JOB).root, slot_path(stored, f))
            assert want and held_ranges(copy) == (f.bytes, want)
            with open(copy, "rb") as fh:
                data = fh.read()
            held = sum(e - s for s, e in want)
            assert held < f.bytes, "a partial copy"
            backed += held
            gaps = [(e, s) for (_, e), (s, _) in zip([(0, 0), *want], [*want, (f.bytes, 0)])]
            assert all(data[s:e] == bytes(e - s) for s, e in gaps)     # holes read as zeros
    # every partition backed once: the backups hold the keyed state once
    assert backed == sum(f.bytes for f in stored.record.vertices["agg"].files)
    for f in stored.record.vertices["src"].files:     # broadcast state: whole, everywhere
        assert sorted(f.replicas) == sorted(u for u in by_uuid if u != f.slot)
        for u in f.replicas:
            copy = os.path.join(by_uuid[u].replicas(JOB).root, slot_path(stored, f))
            assert held_ranges(copy) == (f.bytes, [(0, f.bytes)])
    # slot a lost (its folder wiped): b and c restore every partition from what they hold
    a, b, c = slots
    shutil.rmtree(a.replicas(JOB).root)
    member = _Member([b.uuid, c.uuid], {1: clients[2]})
    check_reachable(store, 0, member)
    store.slot_files = slot_files(member, b, JOB)
    assert store.restore("agg").table.sort_by("key").equals(state.sort_by("key"))
    lost = [p for p in range(12) if table.owner(p) == a.uuid]
    got = store.restore("agg", lost).table
    assert got.num_rows > 0 and got.sort_by("key").equals(
        state.filter(pc.is_in(state["key"], got["key"])).sort_by("key"))
    assert sorted(store.restore("src").broadcast_entries[1].to_pylist()) == [
        b"state 0", b"state 1", b"state 2"]


@pytest.mark.parametrize("backup_count", [1, 2])
def test_two_lost_slots_of_three_are_refused_by_partition_with_one_backup(tmp_path, three_hosts,
                                                                          backup_count):
    """Slots a and b lost together: with one backup the partitions whose primary and backup
    were both on them have no copy left, and the restore is refused before anything is
    read, naming those partitions (and only those), the slots and their hosts; a restore
    tried anyway is refused rather than handing on a hole's zeros. With two backups slot
    c holds every partition and the state comes back whole."""
    import shutil

    from sparkjet.runtime.storage import check_reachable, partition_ranges

    slots, clients = three_hosts
    store, table, state = _replicated(tmp_path, slots, clients, backup_count)
    a, b, c = slots
    for slot in (a, b):
        shutil.rmtree(slot.replicas(JOB).root)
    member = _Member([c.uuid], {})
    store.slot_files = slot_files(member, c, JOB)
    gone = [p for p in range(12) if set(table.replicas(p)) <= {a.uuid, b.uuid}]
    if backup_count == 2:
        assert not gone
        check_reachable(store, 0, member)
        assert store.restore("agg").table.sort_by("key").equals(state.sort_by("key"))
        return
    assert gone and len(gone) < 12
    with pytest.raises(SnapshotIncompleteError) as caught:
        check_reachable(store, 0, member)
    message = str(caught.value)
    assert f"agg: partitions {partition_ranges(set(gone))};" in message, message
    assert f"{a.uuid} (host host-a)" in message and f"{b.uuid} (host host-b)" in message
    assert c.uuid not in message and "src" not in message    # broadcast state: c has it
    with pytest.raises(SnapshotIncompleteError):
        store.restore("agg")
    kept = [p for p in range(12) if p not in gone]
    got = store.restore("agg", kept).table      # what c holds restores
    assert got.num_rows > 0 and got.sort_by("key").equals(
        state.filter(pc.is_in(state["key"], got["key"])).sort_by("key"))


def test_a_finished_jobs_data_leaves_the_free_slots_of_its_host(tmp_path):
    """A job that ran to its end never runs again: remove_finished empties its folder in
    every free slot of this host (in /dev/shm it held the last state for good), and leaves
    a slot a task still holds, other jobs' data, and the data of a job of the same name
    (the same id) in another snapshot store (another log) where they are."""
    from sparkjet.runtime.config import JobConfig
    from sparkjet.runtime.storage import remove_finished

    root = tmp_path / "slots"
    config = JobConfig(name="done", snapshot_store=str(tmp_path / "s"), storage="members",
                       storage_dir=str(root))
    other = 0x0DD
    slots = [StorageSlot.claim(root, job_id=config.id, execution=1) for _ in range(4)]
    for slot in slots:
        slot.keep_log(config.id, "0@1.0", drop_other=True)
        slot.fence(config.id, 1)
        slot.write_record(config.id, 4, b"record 4")
    slots[0].fence(other, 2)
    held, elsewhere = slots[2], slots[3]
    elsewhere.keep_log(config.id, "0@2.0", drop_other=False)   # the same name, another store
    for slot in slots:
        if slot is not held:
            slot.release()
    removed = remove_finished(config, "0@1.0")
    assert sorted(removed) == sorted(s.path for s in slots[:2])
    for slot in slots:
        gone = not os.path.exists(slot.job_path(config.id))
        assert gone == (slot in slots[:2]), slot
    assert os.path.isdir(slots[0].job_path(other))
    assert elsewhere.records(config.id) == [4]
    assert not [n for s in slots for n in os.listdir(os.path.join(s.path, "jobs"))
                if n.startswith(".gone-")]            # renamed away, then deleted
    held.release()
    # the shared store keeps its state in the store: nothing of the slots' is touched
    assert remove_finished(JobConfig(name="done", snapshot_store=str(tmp_path / "s"),
                                     storage="shared", storage_dir=str(root)), "0@1.0") == []
def test_a_finished_jobs_slot_held_a_little_longer_is_waited_for(tmp_path):
    """On a cluster a member's Python worker may hold its slot a little after the job's
    end (its executor was killed, it has not noticed yet): remove_finished waits for a held
    slot up to ``wait`` seconds, and empties it once it is free; a slot held past the wait
    keeps its data, as without one."""
    from sparkjet.runtime.config import JobConfig
    from sparkjet.runtime.storage import remove_finished

    root = tmp_path / "slots"
    config = JobConfig(name="done", snapshot_store=str(tmp_path / "s"), storage="members",
                       storage_dir=str(root))
    slots = [StorageSlot.claim(root, job_id=config.id, execution=1) for _ in range(2)]
    for slot in slots:
        slot.keep_log(config.id, "0@1.0", drop_other=True)
        slot.fence(config.id, 1)
        slot.write_record(config.id, 4, b"record 4")
    late, stuck = slots
    tried = threading.Event()
    real = StorageSlot.claim_folder.__func__

    def claim_folder(cls, folder, **kw):
        got = real(cls, folder, **kw)
        if got is None and folder == late.path:
            tried.set()             # the first try found it held: the task lets it go
        return got

    releaser = threading.Thread(target=lambda: (tried.wait(60), late.release()))
    releaser.start()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(StorageSlot, "claim_folder", classmethod(claim_folder))
        removed = remove_finished(config, "0@1.0", wait=2.0)
    releaser.join()
    assert tried.is_set() and removed == [late.path]
    assert not os.path.exists(late.job_path(config.id))
    assert stuck.records(config.id) == [4]          # held past the wait: it stays
    stuck.release()
    assert remove_finished(config, "0@1.0") == [stuck.path]


# -- reference table versions in every slot (issue 24 item 3) ----------------------------------


class _TableMember(_Member):
    """What SlotTables asks of a member: its slots, peers, settings and start."""

    def __init__(self, config, slots, peers, slot):
        from sparkjet.runtime.storage import SlotWriterLink

        super().__init__(slots, peers)
        self.config, self.start, self.link = config, None, None
        self.slot_link, self.durable_copies = SlotWriterLink(config, slot), False


@pytest.fixture
def three_served(tmp_path):
    """Slots of hosts a, b and c, each behind a real exchange server of execution 1 that
    serves its table versions (slot_table), and a client of each."""
    from sparkjet.runtime.storage import slot_table_handlers

    slots = [StorageSlot.claim(tmp_path / f"host-{h}", host=h) for h in "abc"]
    security = LinkSecurity.generate(1)
    servers, clients = [], []
    for slot in slots:
        slot.fence(JOB, 1)
        server = ExchangeServer("127.0.0.1", execution_id=1, security=security)
        keep, put, get = slot_table_handlers(slot, JOB)
        server.on_action("slot_table", keep)
        server.on_put("slot_table", put)
        server.on_get("slot_table", get)
        servers.append(server)
        clients.append(ExchangeClient(server.location, security=security))
    yield slots, clients
    _close(clients, servers, slots)


def _tables_of(tmp_path, slots, clients, i):
    """Member ``i``'s SlotTables (its peers: the others' servers)."""
    from sparkjet.runtime import JobConfig
    from sparkjet.runtime.storage import SlotTables

    config = JobConfig(name="tables", storage="members", storage_dir=str(tmp_path / "slots"),
                       snapshot_store=str(tmp_path / "store"))
    uuids = [s.uuid for s in slots]
    peers = {j: c for j, c in enumerate(clients) if j != i}
    return SlotTables(_TableMember(config, uuids, peers, slots[i]), slots[i], JOB)


def _version(n=50):
    from sparkjet.operators.table_join import TableVersion

    return TableVersion.of(pa.table({"key": pa.array(range(n), pa.int64())}))


def test_a_table_version_goes_to_every_slot_and_restores_from_a_peer_or_the_store(
        tmp_path, three_served):
    """A member keeps each version its processors use in its own slot and every peer's
    (checked against its digest there), never in snapshot_store; a restore reads its own
    slot's, else a peer's (kept locally then), else the store's (where slots written before
    versions were kept in them left it), and names every place when none holds it."""
    slots, clients = three_served
    v = _version()
    _tables_of(tmp_path, slots, clients, 0).write_table_version(v.data, v.digest, snapshot_id=3)
    for slot in slots:
        assert slot.read_table_version(JOB, v.digest) == bytes(v.data), slot
    assert not (tmp_path / "store").exists(), "no table version in snapshot_store"
    # slot b holds it: read from its own slot, without asking anyone
    b = _tables_of(tmp_path, slots, clients, 1)
    assert b.read_table_version(v.digest) == bytes(v.data)
    # slots a and b lost it: a reads it from c and keeps it
    for slot in slots[:2]:
        os.remove(slot.job_path(JOB, "tables", f"{v.digest}.arrow"))
    a = _tables_of(tmp_path, slots, clients, 0)
    assert a.read_table_version(v.digest) == bytes(v.data)
    assert slots[0].read_table_version(JOB, v.digest) == bytes(v.data)
    # a flipped byte in a peer's copy is never taken
    os.remove(slots[0].job_path(JOB, "tables", f"{v.digest}.arrow"))
    c_copy = slots[2].job_path(JOB, "tables", f"{v.digest}.arrow")
    data = bytearray(open(c_copy, "rb").read())
    data[-9] ^= 0xFF
    open(c_copy, "wb").write(bytes(data))
    with pytest.raises(SnapshotIncompleteError) as e:
        _tables_of(tmp_path, slots, clients, 0).read_table_version(v.digest)
    assert f"table version {v.digest}" in str(e.value) and slots[2].uuid in str(e.value)
    assert "snapshot_store" in str(e.value)
    # slots that hold no versions (written by older code): the store's copy is read
    store = SnapshotStore(tmp_path / "store", JOB)
    store.write_table_version(v.data, v.digest)
    assert _tables_of(tmp_path, slots, clients, 1).read_table_version(v.digest) == bytes(v.data)
    # c's own flipped copy is given up for the one read elsewhere
    assert _tables_of(tmp_path, slots, clients, 2).read_table_version(v.digest) == bytes(v.data)
    assert slots[2].read_table_version(JOB, v.digest) == bytes(v.data)


def test_phase_2_drops_the_table_versions_no_retained_snapshot_uses(tmp_path, three_served):
    """The store's rule in each slot: a version stays while a retained snapshot uses it, or
    while a barrier after the committed snapshot stored it (that snapshot is not committed
    yet: phase 2 of the one before may run after a peer's barrier wrote it)."""
    from sparkjet.runtime.storage import keep_committed

    slots, clients = three_served
    a = slots[0]
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    old, new, later = _version(10), _version(20), _version(30)
    tables = _tables_of(tmp_path, slots, clients, 0)
    for sid, v in enumerate([old, new, new]):
        tables.write_table_version(v.data, v.digest, snapshot_id=sid)
        w = store.writer(sid, 1, writer=0, partition_count=7, slot=a)
        w.write_table("agg", _state(10, 0), key="key")
        w.use_table_version(v.digest)
        store.commit(sid, 1, [w.finish()], table="dGFibGU=")
        if sid == 2:    # a barrier of snapshot 3 stored another version before phase 2 of 2
            tables.write_table_version(later.data, later.digest, snapshot_id=3)
        keep_committed(a, JOB, sid, 1, store.committed_record(sid)[0],
                       [c.snapshot for _, c in store._retained()])
    assert a.table_versions(JOB) == sorted([new.digest, later.digest])
    # the peers' slots were told which snapshot uses them too
    assert slots[1].table_versions(JOB) == sorted([old.digest, new.digest, later.digest])
    keep_committed(slots[1], JOB, 2, 1, store.committed_record(2)[0], [1, 2])
    assert slots[1].table_versions(JOB) == sorted([old.digest, new.digest, later.digest]), \
        "a slot without the retained snapshots' record copies removes nothing"
    for sid in (1, 2):
        slots[1].write_record(JOB, sid, store.committed_record(sid)[0])
    keep_committed(slots[1], JOB, 2, 1, store.committed_record(2)[0], [1, 2])
    assert slots[1].table_versions(JOB) == sorted([new.digest, later.digest])
    # review F5: with the driver's word on the versions the retained snapshots use (the
    # phase-2 command's "tables"), a slot lacking their record copies drops the others too
    assert slots[2].table_versions(JOB) == sorted([old.digest, new.digest, later.digest])
    keep_committed(slots[2], JOB, 2, 1, store.committed_record(2)[0], [1, 2],
                   kept_tables=sorted(store._retained_tables()))
    assert slots[2].table_versions(JOB) == sorted([new.digest, later.digest])


def test_a_durable_tier_also_copies_table_versions_into_the_store_read_through_the_driver(
        tmp_path, three_served):
    """With a durable tier the version is also written into snapshot_store (the one copy a
    restore with no slot left, or an export, reads), and the driver's store_read serves
    a member the store's versions, and no other file outside the snapshot's folder."""
    import dataclasses

    from sparkjet.runtime.storage import store_read_handler

    slots, clients = three_served
    tables = _tables_of(tmp_path, slots, clients, 0)
    tables.member.config = dataclasses.replace(tables.member.config, durable_tier="sync")
    v = _version(7)
    tables.write_table_version(v.data, v.digest, snapshot_id=0)
    store = SnapshotStore(tmp_path / "store", JOB)
    assert store.read_table_version(v.digest) == bytes(v.data)
    read = store_read_handler(store, ["snapshots", "000000000000-e000000000001"])
    path = f"{store._path('tables').split('/')[-2]}/tables/{v.digest}.arrow"
    assert read({"op": "size", "path": path})["size"] == len(v.data)
    with pytest.raises(InvalidArgumentError, match="is not a file of the snapshot"):
        read({"op": "size", "path": path.replace("tables/", "exports/")})


def test_the_default_storage_root_passes_over_a_small_dev_shm(tmp_path, monkeypatch):
    """The slots go to /dev/shm (memory) by default, but a container's is often 64 MB
    (Docker's default), which a state of a few million keys outgrows at its first snapshot:
    a /dev/shm smaller than 1 GiB in all sends them to the temporary folder. The size
    decides, never the free space (the root must not move between executions); a given
    storage_dir or SPARKJET_STORAGE_DIR wins."""
    import tempfile

    from sparkjet.runtime.config import JobConfig, default_storage_root

    size = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    assert default_storage_root(str(tmp_path), minimum=size) == str(tmp_path / "sparkjet-storage")
    temp = os.path.join(tempfile.gettempdir(), "sparkjet-storage")
    assert default_storage_root(str(tmp_path), minimum=size + 1) == temp
    assert default_storage_root(str(tmp_path / "absent")) == temp
    (tmp_path / "sparkjet-storage").mkdir()      # slots there already: they stay reachable
    assert default_storage_root(str(tmp_path), minimum=size + 1) == str(
        tmp_path / "sparkjet-storage")
    monkeypatch.delenv("SPARKJET_STORAGE_DIR", raising=False)
    config = JobConfig(processing_guarantee="none", storage_dir=str(tmp_path / "mine"))
    assert config.storage_root() == str(tmp_path / "mine")
    monkeypatch.setenv("SPARKJET_STORAGE_DIR", str(tmp_path / "host"))
    assert config.storage_root() == str(tmp_path / "host")


def test_partition_ranges_name_broadcast_state_alone_or_after_the_ranges():
    """A table version's missing entry is broadcast state only: it read "partitions:  and
    broadcast state" in the recovery event (an empty list of ranges, then the suffix)."""
    from sparkjet.runtime.storage import partition_ranges

    assert partition_ranges({-1}) == "broadcast state"
    assert partition_ranges({0, 1, 2, 5, -1}) == "0-2, 5 and broadcast state"
    assert partition_ranges({3, 4, 9}) == "3-4, 9"


def _written_behind_a_server(tmp_path, slots):
    """A store with snapshot 0 written into ``slots`` (a, b), and an exchange server of
    execution 1 for b's member (its handlers are the test's to register)."""
    store = SnapshotStore(tmp_path / "store", JOB)
    store.register_execution(1)
    _write(store, list(slots))
    security = LinkSecurity.generate(1)
    return store, ExchangeServer("127.0.0.1", execution_id=1, security=security), security


def test_a_peers_file_is_fetched_ahead_in_pieces_and_decoded_as_they_come(tmp_path, two_slots,
                                                                          monkeypatch):
    """A restore asks a peer for a file in pieces (here of one chunk each), fetched ahead of
    the checks and the decoding, which run while the next pieces stream: the rows are the
    same; a flipped byte in a later piece still refuses the restore, naming the chunk."""
    from sparkjet.errors import SnapshotCorruptError
    from sparkjet.snapshot import reading
    from sparkjet.snapshot import store as store_module

    monkeypatch.setattr(reading, "AHEAD_BYTES", 1)      # every chunk a piece of its own
    monkeypatch.setattr(store_module, "_DECODE_EVERY", 2)
    (a, b), (store, server, security) = two_slots, _written_behind_a_server(tmp_path, two_slots)
    asked = []
    real = slot_read_handler(b, JOB)
    server.on_get("slot_read", lambda body: (asked.append(body["length"]), real(body))[1])
    try:
        peer = ExchangeClient(server.location, security=security)
        store.slot_files = slot_files(_Member([a.uuid, b.uuid], {1: peer}), a, JOB)
        got = store.restore("agg")
        want = pa.concat_tables([_state(1000, 0), _state(1000, 1000)])
        assert got.table.sort_by("key").equals(want.sort_by("key"))
        record = store._resolve(0, None).record
        b_file = next(f for f in record.vertices["agg"].files if f.slot == b.uuid)
        assert len([n for n in asked if n]) == len(b_file.chunks) > 2   # a piece per chunk
        # the last chunk of b's file flipped: the pieces before it check out, it does not
        last = b_file.chunks[-1]
        path = os.path.join(b.replicas(JOB).root, "snapshots", "000000000000-e000000000001",
                            b_file.path)
        data = bytearray(open(path, "rb").read())
        data[last.offset + last.stored_size] ^= 0x40
        open(path, "wb").write(bytes(data))
        with pytest.raises(SnapshotCorruptError, match=f"at offset {last.offset}: bad payload checksum"):
            store.restore("agg")
    finally:
        server.close()


def test_a_range_a_peer_sends_in_several_pieces_is_joined_whole(tmp_path, two_slots,
                                                                 monkeypatch):
    """A peer's server sends a range in pieces of at most READ_PIECE bytes (here 1,000:
    every range the restore asks for arrives in several); the reader joins them into one
    buffer, and the restore reads the same rows as from the slots' own copies."""
    from sparkjet.runtime import storage
    from sparkjet.runtime.storage import PeerSlotFile

    monkeypatch.setattr(storage, "READ_PIECE", 1000)
    (a, b), (store, server, security) = two_slots, _written_behind_a_server(tmp_path, two_slots)
    pieces = []
    real = slot_read_handler(b, JOB)

    def counted(body):
        info, got = real(body)
        return info, (pieces.append(len(p)) or p for p in got)
    server.on_get("slot_read", counted)
    try:
        peer = ExchangeClient(server.location, security=security)
        record = store._resolve(0, None).record
        b_file = next(f for f in record.vertices["agg"].files if f.slot == b.uuid)
        path = f"snapshots/000000000000-e000000000001/{b_file.path}"
        whole = open(os.path.join(b.replicas(JOB).root, *path.split("/")), "rb").read()
        read = PeerSlotFile(peer, b.uuid, path, 1).range_reader()
        assert bytes(memoryview(read(10, len(whole) - 20))) == whole[10:-10]
        assert len(pieces) > 2 and max(pieces) == 1000
        store.slot_files = slot_files(_Member([a.uuid, b.uuid], {1: peer}), a, JOB)
        got = store.restore("agg")
        want = pa.concat_tables([_state(1000, 0), _state(1000, 1000)])
        assert got.table.sort_by("key").equals(want.sort_by("key"))
    finally:
        server.close()


def test_pieces_fetched_ahead_come_in_order_and_a_failed_fetch_raises_in_its_place():
    import threading

    from sparkjet.snapshot.reading import _fetched_ahead

    spans = [(i * 10, i * 10 + 10) for i in range(40)]

    def read(start, length):
        if start == 250:
            raise OSError("peer gone")
        return (start, length)

    got = []
    with pytest.raises(OSError, match="peer gone"):
        for piece in _fetched_ahead(read, spans):
            got.append(piece)
    assert got == [(s, 10) for s, _ in spans[:25]]
    # a consumer that stops early stops the fetching thread too
    pieces = _fetched_ahead(lambda s, n: (s, n), spans)
    assert next(pieces) == (0, 10)
    pieces.close()
    for t in threading.enumerate():
        if t.name == "sparkjet-fetch-ahead":
            t.join(10)
            assert not t.is_alive()
