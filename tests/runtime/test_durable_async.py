"""The asynchronous durable tier (``durable_tier="async"``, sparkjet.runtime.durable) with
real storage slots, a real snapshot store and real uploader threads: a snapshot commits
while its upload is blocked (the store's destination is a FIFO nobody reads), a newer
snapshot supersedes a waiting upload, a failed upload is never marked, and a marked one
restores with no slot left and exports; the driver's start check refuses an incomplete
durable copy under exactly-once and falls back, reporting the replay window, under
at-least-once."""
import base64
import os
import threading
import time

import pyarrow as pa
import pytest

from sparkjet.errors import InvalidArgumentError, RecoveryRefusedError, SnapshotIncompleteError
from sparkjet.runtime import JobConfig
from sparkjet.runtime.config import open_store
from sparkjet.runtime.durable import DurableUploader, async_start
from sparkjet.runtime.restore import handed_start
from sparkjet.runtime.storage import (
    SlotWriterLink,
    check_reachable,
    keep_committed,
    slot_files,
    slot_writer,
)
from sparkjet.snapshot import layout
from sparkjet.snapshot.slots import StorageSlot
from sparkjet.snapshot.store import RecordView


class _Member:
    """What check_reachable and slot_files ask of a member: its config, the slots of the
    execution and its peers."""

    def __init__(self, config, slots):
        self.config = config
        self.topology = type("T", (), {"slots": slots})()
        self.peers = {}


def _state(n, offset):
    return pa.table({"key": pa.array(range(offset, offset + n), pa.int64()),
                     "v": pa.array([float(i) for i in range(n)])})


def _config(tmp_path, **kw):
    kw.setdefault("retained_snapshots", 3)
    return JobConfig(name="async-tier", storage="members", storage_dir=str(tmp_path / "slots"),
                     snapshot_store=str(tmp_path / "store"), partition_count=7,
                     durable_tier="async", **kw)


def _snapshot(config, store, slots, sid, execution=1):
    """Each slot's member writer (as open_writer makes it for this config) writes a keyed
    table; the store commits the record. Returns each slot's manifest files."""
    manifests = []
    for i, slot in enumerate(slots):
        slot.fence(config.id, execution)
        w = slot_writer(config, SlotWriterLink(config, slot), sid, execution, writer=i,
                        replicate=None)
        w.write_table("agg", _state(1000, i * 1000), key="key")
        manifests.append(w.finish())
    store.commit(sid, execution, manifests, table="dGFibGU=")
    return [m.files for m in manifests]


def _until(condition, what):
    """Waits for ``condition`` (a state of the uploader threads, not a time)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


WANT = pa.concat_tables([_state(1000, 0), _state(1000, 1000)]).sort_by("key")


def test_async_commits_while_the_upload_is_blocked_and_counts_only_once_marked(tmp_path,
                                                                              two_slots):
    a, b = two_slots
    config = _config(tmp_path)
    store = open_store(config)
    store.register_execution(1)
    files0 = _snapshot(config, store, [a, b], 0)
    # acknowledged and committed with no durable copy: the store holds the record alone
    assert not [f for _, _, fs in os.walk(tmp_path / "store") for f in fs
                if f.endswith(".chunks")]
    assert not store.durable_complete(0)
    lost = _Member(config, [])          # an execution holding neither slot
    with pytest.raises(SnapshotIncompleteError, match="the durable copy of snapshot 0 was "
                                                      "not complete"):
        check_reachable(store, 0, lost)

    # the store's destination of a's file is a FIFO nobody reads: its upload blocks
    folder = store._path(layout.SNAPSHOTS, layout.snapshot_dir(0, 1), "agg")
    os.makedirs(folder)
    fifo = f"{folder}/{files0[0][0]['path'].split('/')[1]}"
    os.mkfifo(fifo)
    reports = {a.uuid: [], b.uuid: []}
    up = {s.uuid: DurableUploader(s, SlotWriterLink(config, s), reports[s.uuid].append)
          for s in (a, b)}
    for u in up.values():
        u.start()
    up[a.uuid].submit(0, 1, files0[0])
    _until(lambda: up[a.uuid].pending == [0], "a's upload of snapshot 0 began")
    # snapshots 1 and 2 are acknowledged and committed while it is blocked
    files1 = _snapshot(config, store, [a, b], 1)
    files2 = _snapshot(config, store, [a, b], 2)
    assert store.latest_complete().snapshot_id == 2 and reports[a.uuid] == []
    up[a.uuid].submit(1, 1, files1[0])
    up[a.uuid].submit(2, 1, files2[0])      # supersedes 1, which had not begun
    assert up[a.uuid].pending == [0, 2]
    up[b.uuid].submit(2, 1, files2[1])
    _until(lambda: len(reports[b.uuid]) == 1, "b uploaded snapshot 2")
    assert reports[a.uuid] == []            # still blocked

    drained = []
    reader = threading.Thread(target=lambda: drained.append(open(fifo, "rb").read()))
    reader.start()
    assert up[a.uuid].drain(60)
    reader.join()
    first, second = reports[a.uuid]
    assert first["snapshot"] == 0 and first["error"]      # a FIFO is no copy
    assert second["snapshot"] == 2 and second["superseded"] == [1] and "error" not in second
    assert second["bytes"] == sum(f["bytes"] for f in files2[0]) > 0
    for u in up.values():
        u.close()

    # snapshot 0's copy failed its check: never marked, never counted
    with pytest.raises(SnapshotIncompleteError, match="is 0 bytes, the record says"):
        store.mark_durable(0)
    assert not store.durable_complete(0)
    with pytest.raises(SnapshotIncompleteError, match="durable copy of snapshot 0"):
        check_reachable(store, 0, lost)
    # snapshot 1 was superseded: nothing of it was uploaded
    with pytest.raises(SnapshotIncompleteError, match="is missing"):
        store.mark_durable(1)
    # snapshot 2: every file uploaded and checked, marked; it restores with no slot left
    assert store.mark_durable(2)["files"] == 2
    assert store.durable_complete(2)
    check_reachable(store, 2, lost)
    store.verify(2)
    with StorageSlot.claim(tmp_path / "c", host="c") as c:
        store.slot_files = slot_files(_Member(config, [c.uuid]), c, config.id)
        assert store.restore("agg", snapshot_id=2).table.sort_by("key").equals(WANT)
        # what the driver hands a member: the record and that its uploads are complete
        _, _, start = handed_start(config, store, 2)
        assert start["durable"] is True
        view = RecordView(config.id, base64.b64decode(start["record"]),
                          start["dir"], start["file"], backend=store._backend,
                          durable=start["durable"])
        view.slot_files = store.slot_files
        assert view.restore("agg").table.sort_by("key").equals(WANT)
    store.slot_files = None
    # and it exports: the export holds the copies and the mark, and restores alone
    store.export(2, "v2")
    assert store.restore("agg", name="v2").table.sort_by("key").equals(WANT)
    assert store.durable_complete(name="v2")
    with pytest.raises(InvalidArgumentError, match="durable_tier=\"async\", export a snapshot "
                                                   "whose upload is complete"):
        store.export(1, "v1")


def test_an_upload_whose_files_left_the_slot_says_so(tmp_path, two_slots):
    """An upload whose files are removed from the slot while it runs (retention keeps a
    snapshot under upload, so only a wipe from outside does that) says so and names the
    slot, rather than only FileNotFoundError."""
    import shutil

    a, b = two_slots
    config = _config(tmp_path)
    store = open_store(config)
    store.register_execution(1)
    files0 = _snapshot(config, store, [a, b], 0)
    # the slot's folder of snapshot 0 wiped from outside
    shutil.rmtree(a.replicas(config.id).path(layout.SNAPSHOTS, layout.snapshot_dir(0, 1)))
    reports = []
    up = DurableUploader(a, SlotWriterLink(config, a), reports.append)
    up.start()
    up.submit(0, 1, files0[0])
    assert up.drain(60)
    up.close()
    (report,) = reports
    assert report["snapshot"] == 0 and "files left this member's slot" in report["error"]
    assert a.path in report["error"] and "removed from outside" in report["error"]


def test_a_lost_slot_and_an_incomplete_async_copy_is_refused_under_exactly_once(tmp_path,
                                                                               two_slots):
    """Snapshot 0's upload is complete, snapshot 1's is not, and no slot joined: exactly-
    once refuses (an older snapshot would replay what phase 2 of 1 committed), naming the
    vertex, partitions, slots and hosts; at-least-once restores 0 after a rollback and
    reports the replay window."""
    from sparkjet.partition_table import PartitionTable
    from sparkjet.runtime.storage import encode_table

    a, b = two_slots
    for guarantee, damaged in (("exactly-once", False), ("at-least-once", False),
                               ("at-least-once", True)):
        config = _config(tmp_path / f"{guarantee}-{damaged}", processing_guarantee=guarantee)
        store = open_store(config)
        store.register_execution(1)
        table = encode_table(PartitionTable.create([a.uuid, b.uuid], 7, 0,
                                                   groups={a.uuid: "host-a", b.uuid: "host-b"}))
        for sid in (0, 1):
            manifests = []
            for i, slot in enumerate((a, b)):
                slot.fence(config.id, 1)
                w = slot_writer(config, SlotWriterLink(config, slot), sid, 1, writer=i,
                                replicate=None)
                w.write_table("agg", _state(1000, i * 1000), key="key")
                manifests.append(w.finish())
                if sid == 0:
                    DurableUploader(slot, SlotWriterLink(config, slot), None).upload(
                        0, 1, manifests[-1].files)
            store.commit(sid, 1, manifests, table=table)
        store.mark_durable(0)
        store.register_execution(2)
        _, _, start = handed_start(config, store, 1)
        events = []
        # every slot joined: nothing to decide
        assert async_start(config, store, start, [a.uuid, b.uuid], 2, events.append) is start
        if guarantee == "exactly-once":
            with pytest.raises(RecoveryRefusedError) as refused:
                async_start(config, store, start, [], 2, events.append)
            text = str(refused.value)
            assert "newest committed snapshot 1 lacks agg: partitions 0-6" in text
            assert f"{a.uuid} (host host-a)" in text and f"{b.uuid} (host host-b)" in text
            assert "durable copy of snapshot 1 in snapshot_store was not complete" in text
            assert "no older snapshot is restored" in text and "at-least-once" in text
            assert store.latest_complete().snapshot_id == 1 and not events
        elif damaged:
            # snapshot 0's durable copy damaged after its mark: passed over and named (it
            # raised a bare SnapshotCorruptError from the rollback's check)
            chunk = next((tmp_path / f"{guarantee}-{damaged}" / "store").rglob("*.chunks"))
            data = bytearray(chunk.read_bytes())
            data[len(data) // 2] ^= 0xFF
            chunk.write_bytes(bytes(data))
            with pytest.raises(RecoveryRefusedError, match="no older snapshot the store keeps "
                                                           r"\(\[0\]\) is reachable either "
                                                           r"whole \(snapshot 0: "):
                async_start(config, store, start, [], 2, events.append)
            assert store.latest_complete().snapshot_id == 1 and not events   # no rollback
        else:
            got = async_start(config, store, start, [], 2, events.append)
            assert got["snapshot"] == 0 and got["durable"] is True
            fallback, = events
            assert fallback["event"] == "fallback" and fallback["to"] == 0
            assert fallback["replayed"] == [1] and "replay window" in fallback["message"]
            # the start carries it, for the execution's record (JobResult.fallbacks)
            assert got["fallback"] == {k: fallback[k] for k in
                                       ("to", "unusable", "replaced", "replayed", "explicit")}
            assert store.latest_complete().snapshot_id == 0     # the rollback is in the log


def test_async_durable_tier_settings():
    with pytest.raises(InvalidArgumentError, match="durable_tier is a copy of the members'"):
        JobConfig(name="x", snapshot_store="/tmp/x", storage="shared", durable_tier="async")
    with pytest.raises(InvalidArgumentError, match="durable_tier='async' copies snapshots"):
        JobConfig(name="x", processing_guarantee="none", storage="members",
                  durable_tier="async")
    with pytest.raises(InvalidArgumentError, match="durable_tier"):
        JobConfig(name="x", snapshot_store="/tmp/x", storage="members", durable_tier="later")
    assert JobConfig(name="x", snapshot_store="/tmp/x", storage="members",
                     durable_tier="async").durable_tier == "async"


@pytest.mark.parametrize("marked", [True, False])
def test_a_persistence_restart_counts_the_async_uploads_once_marked(tmp_path, marked):
    """persistence=True with durable_tier="async": slot b's files are gone, and the
    FULL_RECOVERY_ONLY policy restores the newest snapshot from the store's copies when
    their upload was marked complete, and refuses when it was not (the copies do not
    count)."""
    from sparkjet.partition_table import PartitionTable
    from sparkjet.runtime.persistence import join_report, recover

    config = JobConfig(name="persisted-async", snapshot_store=str(tmp_path / "store"),
                       storage="members", persistence=True, partition_count=7,
                       storage_dir=str(tmp_path / "slots"), durable_tier="async")
    a = StorageSlot.claim(str(tmp_path / "host-a"), host="a", durable=True)
    b = StorageSlot.claim(str(tmp_path / "host-b"), host="b", durable=True)
    with a, b:
        store = open_store(config)
        store.register_execution(1)
        table = PartitionTable.create([a.uuid, b.uuid], 7, 0, groups={a.uuid: "a", b.uuid: "b"})
        manifests = []
        for i, slot in enumerate((a, b)):
            slot.fence(config.id, 1)
            w = slot_writer(config, SlotWriterLink(config, slot), 0, 1, writer=i,
                            replicate=None)
            w.write_table("agg", _state(100, i * 100), key="key")
            manifests.append(w.finish())
            DurableUploader(slot, SlotWriterLink(config, slot), None).upload(
                0, 1, manifests[-1].files)
        store.commit(0, 1, manifests, table=base64.b64encode(table.to_bytes()).decode())
        if marked:
            store.mark_durable(0)
        for d, _, fs in os.walk(b.job_path(config.id)):
            for f in fs:
                if f.endswith(".chunks"):
                    os.remove(os.path.join(d, f))
        store.register_execution(2)
        reports = [join_report(config, s, {"seen": s.newest_execution(config.id)}, 2)
                   for s in (a, b)]
        start = handed_start(config, store, 0)[2]
        events = []
        if marked:
            recovery = recover(config, store, None, 2, start, reports, events.append)
            assert recovery.report["snapshot"] == 0 and "missing" not in recovery.report
        else:
            with pytest.raises(RecoveryRefusedError, match="lacks agg: partitions"):
                recover(config, store, None, 2, start, reports, events.append)


# -- retention keeps what the uploads need (review finding 1 of item 5) ----------------------


class _Members:
    """The member and driver sides of the async tier over real slots, a real store and real
    uploader threads, step by step as an execution runs them: each member's writer writes
    its part of a snapshot and acknowledges it with what it may upload before its next
    commit (Member.may_upload), the driver commits pinning those, each member runs phase 2
    in its slot (keep_committed with the store's retained ids and its uploader's pending)
    and submits the upload; the driver marks a snapshot once every member's upload of it
    ended well (ExecutionCoordinator._uploaded)."""

    @classmethod
    def of(cls, tmp_path, slots, **settings):
        """A job of ``settings`` (see _config), its store with execution 1 registered, and
        its members over ``slots``."""
        config = _config(tmp_path, **settings)
        store = open_store(config)
        store.register_execution(1)
        return config, store, cls(config, store, slots)

    def __init__(self, config, store, slots):
        self.config, self.store, self.slots = config, store, slots
        self.reports = {s.uuid: [] for s in slots}
        self.up = {s.uuid: DurableUploader(s, SlotWriterLink(config, s),
                                           self.reports[s.uuid].append) for s in slots}
        self.written = {s.uuid: {} for s in slots}     # Member._written
        self.marked: list[int] = []
        self.failed: list[str] = []
        for u in self.up.values():
            u.start()

    def snapshot(self, sid, execution=1, *, upload=True):
        manifests, pinned = [], set()
        for i, slot in enumerate(self.slots):
            slot.fence(self.config.id, execution)
            w = slot_writer(self.config, SlotWriterLink(self.config, slot), sid, execution,
                            writer=i, replicate=None)
            w.write_table("agg", _state(1000, i * 1000), key="key")
            manifest = w.finish()
            manifests.append(manifest)
            written = self.written[slot.uuid]
            written[sid] = list(manifest.files)
            pinned |= set(self.up[slot.uuid].pending) | {s for s in written if s < sid}
        self.store.commit(sid, execution, manifests, table="dGFibGU=", pinned=pinned)
        record = self.store.committed_record(sid)[0]
        keep = [c.snapshot for _, c in self.store._retained()]
        for slot in self.slots:
            keep_committed(slot, self.config.id, sid, execution, record, keep,
                           self.up[slot.uuid].pending)
            files = self.written[slot.uuid].pop(sid)
            for old in [s for s in self.written[slot.uuid] if s < sid]:
                del self.written[slot.uuid][old]
            if upload:
                self.up[slot.uuid].submit(sid, execution, files)

    def mark(self):
        """Marks every snapshot all members reported uploaded (as the driver does)."""
        ended = [{r["snapshot"]: r for r in self.reports[s.uuid]} for s in self.slots]
        for sid in sorted(set.intersection(*(set(e) for e in ended))):
            if sid in self.marked or any("error" in e[sid] for e in ended):
                self.failed += [e[sid]["error"] for e in ended if "error" in e[sid]]
                continue
            self.store.mark_durable(sid)
            self.marked.append(sid)

    def drain(self):
        for u in self.up.values():
            assert u.drain(60)
        self.mark()

    def close(self):
        for u in self.up.values():
            u.close()


def _slot_holds(slot, config, sid, execution=1):
    """Whether ``slot`` holds its chunk files and record copy of snapshot ``sid``."""
    folder = slot.replicas(config.id).path(layout.SNAPSHOTS, layout.snapshot_dir(sid, execution))
    files = [f for _, _, fs in os.walk(folder) for f in fs if f.endswith(".chunks")]
    return bool(files) and sid in slot.records(config.id)


def test_an_upload_slower_than_retention_keeps_its_files_and_ends_marked(tmp_path,
                                                                          two_slots):
    """Review finding 1: member a's upload of snapshot 0 is held (inside its first piece)
    while five more snapshots commit with retained_snapshots=2, far more than retained x
    interval. Retention keeps snapshot 0 in a's slot (the files it copies from) and in the
    store (its commit and the partial copy), so once let go it ends, is marked, and restores
    from the store alone; then the snapshot marked after it lets it go."""
    a, b = two_slots
    config, store, m = _Members.of(tmp_path, [a, b], retained_snapshots=2)
    began, release = threading.Event(), threading.Event()

    def hold(sid, path, offset):
        if sid == 0:
            began.set()
            assert release.wait(60)
    m.up[a.uuid].before_piece = hold
    try:
        m.snapshot(0)
        assert began.wait(30)
        for sid in range(1, 6):
            m.snapshot(sid)
            # b's uploads end as they come; a's is held, the newest one waits behind it
            assert m.up[a.uuid].pending == [0, sid]
            assert _slot_holds(a, config, 0), f"snapshot 0 left a's slot at commit {sid}"
            assert 0 in [s.snapshot_id for s in store.complete()]
            assert store._backend.exists(store._path(layout.SNAPSHOTS,
                                                     layout.snapshot_dir(0, 1), "agg"))
        # the snapshots neither retained nor uploading left the store and the slots
        assert [s.snapshot_id for s in store.complete()] == [0, 4, 5]
        assert not _slot_holds(b, config, 2) and not _slot_holds(a, config, 3)
        release.set()
        m.drain()
        assert not m.failed, m.failed
        # 0 ended and was marked; 1-4 were superseded behind it in a; 5 ran after it
        assert m.marked == [0, 5]
        assert [r["snapshot"] for r in m.reports[a.uuid]] == [0, 5]
        assert m.reports[a.uuid][1]["superseded"] == [1, 2, 3, 4]
        assert store.durable_complete(0)
        with StorageSlot.claim(tmp_path / "c", host="c") as c:
            store.slot_files = slot_files(_Member(config, [c.uuid]), c, config.id)
            assert store.restore("agg", snapshot_id=0).table.sort_by("key").equals(WANT)
        store.slot_files = None
        # snapshot 5 is marked: the next commit lets 0 go, in the store and the slots
        m.snapshot(6, upload=False)
        store.wait_for_cleanup()
        assert [s.snapshot_id for s in store.complete()] == [5, 6]
        assert not _slot_holds(a, config, 0) and not _slot_holds(b, config, 0)
        assert not store._backend.exists(store._path(layout.SNAPSHOTS,
                                                     layout.snapshot_dir(0, 1)))
    finally:
        release.set()
        m.close()


def test_the_newest_marked_snapshot_stays_until_a_newer_one_is_marked(tmp_path, two_slots):
    """retained_snapshots=1: snapshot 0 is uploaded and marked, the uploads of 1-3 never
    end (not submitted: failed, or superseded). 0 stays in the store and both slots while
    1 and 2 go. With every slot wiped, at-least-once restores 0 from the store's copies
    (exactly-once would refuse: the newest, 3, is not durable). Once the next execution's
    snapshot is marked, 0 goes."""
    a, b = two_slots
    config, store, m = _Members.of(tmp_path, [a, b], retained_snapshots=1, processing_guarantee="at-least-once")
    try:
        m.snapshot(0)
        m.drain()
        assert m.marked == [0]
        for sid in (1, 2, 3):
            m.snapshot(sid, upload=False)
            store.wait_for_cleanup()
            assert [s.snapshot_id for s in store.complete()] == [0, sid]
            assert _slot_holds(a, config, 0) and _slot_holds(b, config, 0)
            if sid > 1:
                assert not _slot_holds(a, config, sid - 1)
        assert store.durable_complete(0) and not store.durable_complete(3)

        # every slot wiped: the durable copy of 0 is what is left
        for slot in (a, b):
            slot.remove_job(config.id)
        store.register_execution(2)
        _, _, start = handed_start(config, store, 3)
        events = []
        got = async_start(config, store, start, [], 2, events.append)
        assert got["snapshot"] == 0 and got["durable"] is True
        (fallback,) = events
        assert fallback["to"] == 0 and fallback["replayed"] == [1, 2, 3]
        assert "snapshot(s) 1-3 are replayed" in fallback["message"]
        with StorageSlot.claim(tmp_path / "c", host="c") as c:
            store.slot_files = slot_files(_Member(config, [c.uuid]), c, config.id)
            assert store.restore("agg", snapshot_id=0).table.sort_by("key").equals(WANT)
        store.slot_files = None

        # the next execution goes on from 0 (ids continue from it); 1 is marked: 0 goes
        m.snapshot(1, execution=2)
        m.drain()
        assert m.marked == [0, 1]
        m.snapshot(2, execution=2, upload=False)
        store.wait_for_cleanup()
        assert [s.snapshot_id for s in store.complete()] == [1, 2]
        assert not _slot_holds(a, config, 0) and not _slot_holds(b, config, 0)
        assert _slot_holds(a, config, 1, execution=2) and _slot_holds(b, config, 1, execution=2)
    finally:
        m.close()


def test_exactly_once_refuses_when_only_an_older_marked_snapshot_is_left(tmp_path,
                                                                        two_slots):
    """The newest marked snapshot kept does not weaken exactly-once: with every slot wiped
    and the newest committed snapshot not durable, the start is refused even though the
    store keeps an older marked one (it would replay what phase 2 committed)."""
    a, b = two_slots
    config, store, m = _Members.of(tmp_path, [a, b], retained_snapshots=1)
    try:
        m.snapshot(0)
        m.drain()
        m.snapshot(1, upload=False)
        m.snapshot(2, upload=False)
        store.wait_for_cleanup()        # (snapshot 1 is removed by a background thread)
        assert [s.snapshot_id for s in store.complete()] == [0, 2]
    finally:
        m.close()
    for slot in (a, b):
        slot.remove_job(config.id)
    store.register_execution(2)
    _, _, start = handed_start(config, store, 2)
    with pytest.raises(RecoveryRefusedError, match="newest committed snapshot 2 lacks agg"):
        async_start(config, store, start, [], 2, lambda e: None)


def test_a_long_run_of_marked_snapshots_is_remembered_within_a_bound(tmp_path, two_slots,
                                                                     monkeypatch):
    """The store remembers the durable marks it has read, the newest few only (one per
    snapshot would grow for as long as the job runs): past the bound, each snapshot it
    keeps still counts as durable, read from its mark again where forgotten."""
    from sparkjet.snapshot import store as store_module

    monkeypatch.setattr(store_module, "_KEPT_MARKS", 2)
    config, store, m = _Members.of(tmp_path, list(two_slots), retained_snapshots=3)
    try:
        for sid in range(6):
            m.snapshot(sid)
            m.drain()
            store.wait_for_cleanup()
            kept = [s.snapshot_id for s in store.complete()]
            assert all(store.durable_complete(k) for k in kept), kept
            assert len(store._durable_marks) <= 2
        assert m.marked == list(range(6)) and kept == [3, 4, 5]
    finally:
        m.close()
