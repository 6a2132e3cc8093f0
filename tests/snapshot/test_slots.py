"""Storage slots (sparkjet.snapshot.slots): claimed by one process at a time with flock,
freed by the kernel when that process dies, a slot with the job's data preferred, slots of
another host refused, fencing by the newest execution seen, and clear errors for a slot that
does not parse or a storage_dir that cannot be written."""
import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import mounts

from sparkjet.errors import FencedError, StorageError, StorageSlotError
from sparkjet.snapshot.slots import MEMBER, StorageSlot

JOB = 0x5EED


def test_each_claim_gets_a_slot_of_its_own_and_a_released_one_is_reused(tmp_path):
    a = StorageSlot.claim(tmp_path, host="h1")
    b = StorageSlot.claim(tmp_path, host="h1")
    assert a.uuid != b.uuid and a.path != b.path
    assert {a.host, b.host} == {"h1"}
    a.release()
    c = StorageSlot.claim(tmp_path, host="h1")
    assert c.uuid == a.uuid                     # no third slot while one is free
    assert len([n for n in os.listdir(tmp_path) if n.startswith("slot-")]) == 2
    b.release()
    c.release()


def test_a_slot_holding_the_jobs_data_is_claimed_first(tmp_path):
    slots = [StorageSlot.claim(tmp_path, host="h1") for _ in range(3)]
    holder = slots[2]
    holder.fence(JOB, 4)
    holder.write_record(JOB, 9, b"record 9")
    for s in slots:
        s.release()
    again = StorageSlot.claim(tmp_path, job_id=JOB, host="h1")
    assert again.uuid == holder.uuid
    assert again.newest_execution(JOB) == 4
    assert again.records(JOB) == [9] and again.read_record(JOB, 9) == b"record 9"
    other = StorageSlot.claim(tmp_path, job_id=0x1234, host="h1")
    assert other.uuid != holder.uuid and other.newest_execution(0x1234) is None


CHILD = """
import sys, time
from sparkjet.snapshot.slots import StorageSlot
job, execution = int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 7
log = sys.argv[4] if len(sys.argv) > 4 else None
slot = StorageSlot.claim(sys.argv[1], job_id=job, host="h1", execution=execution, log=log)
if log:
    slot.keep_log(job, log, drop_other=True)   # as a member's claim_slot does
slot.fence(job, execution)
print(slot.uuid, flush=True)
time.sleep(600)
"""


def _holder(tmp_path, job=JOB, execution=7, log=None):
    """A process holding a slot of ``job`` fenced by ``execution`` (claimed for the
    snapshot log ``log``), and that slot's uuid."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(job),
                              str(execution), *([log] if log else [])],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    held = child.stdout.readline().strip()
    if not held:
        child.kill()
        child.wait()
        raise AssertionError("the child claimed no slot")
    return child, held


def test_the_kernel_frees_the_slot_of_a_killed_process(tmp_path):
    child, held = _holder(tmp_path)
    try:
        # while it lives, its slot is not ours even though it holds the job's data
        mine = StorageSlot.claim(tmp_path, job_id=JOB, host="h1")
        assert mine.uuid != held
        mine.release()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        reclaimed = StorageSlot.claim(tmp_path, job_id=JOB, host="h1")
        assert reclaimed.uuid == held
        assert reclaimed.newest_execution(JOB) == 7
        reclaimed.release()
    finally:
        child.kill()
        child.wait()


def test_a_claim_waits_for_the_jobs_slot_an_older_execution_still_locks(tmp_path):
    """Found by running the Spark zombie test with storage="members": a SIGSTOPped member of
    execution 7 keeps its slot's lock; the next execution's task claimed a new slot at once
    and its state was out of reach (SnapshotIncompleteError, three times, the job failed).
    A claim by execution 8 now waits for the slot the older execution still locks, and gets
    it once that process is gone (Spark kills a cancelled stage's zombie). A slot locked by
    a task of the same execution is not waited for."""
    import threading

    child, held = _holder(tmp_path)
    try:
        # a sibling of execution 7 (the one that locks it) takes another slot at once
        sibling = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=7, wait=60)
        assert sibling.uuid != held
        sibling.release()
        got = {}
        claim = threading.Thread(target=lambda: got.setdefault("slot", StorageSlot.claim(
            tmp_path, job_id=JOB, host="h1", execution=8, wait=60)))
        claim.start()
        claim.join(0.5)
        assert claim.is_alive()              # waiting: the job's slot is locked by 7
        os.kill(child.pid, signal.SIGKILL)   # the zombie killed: the kernel frees its lock
        child.wait()
        claim.join(30)
        assert got["slot"].uuid == held and got["slot"].newest_execution(JOB) == 7
        got["slot"].release()
    finally:
        child.kill()
        child.wait()


def test_a_zombie_still_holding_the_jobs_slot_when_the_wait_ends_is_fenced(tmp_path):
    """Found by running the Spark zombie test with storage="members": the SIGSTOPped only
    member of execution 7 kept its slot's lock past the claim's wait, the next execution
    took an empty slot, and the job's state was out of reach (SnapshotIncompleteError three
    times). The claim now kills a holder that claimed the slot for an older execution of
    the job once its wait ends, and takes the slot, naming whom it fenced."""
    child, held = _holder(tmp_path)
    try:
        os.kill(child.pid, signal.SIGSTOP)   # a zombie: alive, silent, holding its lock
        slot = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=8, wait=0.3)
        assert slot.uuid == held and slot.newest_execution(JOB) == 7
        assert slot.fenced == [{"pid": child.pid, "job": JOB, "execution": 7,
                                "path": slot.path}]
        assert child.wait(10) == -signal.SIGKILL
        slot.release()
    finally:
        child.kill()
        child.wait()


def test_only_a_holder_of_an_older_execution_of_the_job_is_fenced(tmp_path):
    """The lock's holder record decides: a task of the same execution, or of another job
    (whose slot also holds this job's older data), is never killed; the claim takes
    another slot after its wait, as before."""
    # the slot holds JOB's data of execution 7, and a task of another job holds it now
    first = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=7)
    first.fence(JOB, 7)
    first.release()
    other, held = _holder(tmp_path, job=0x1234, execution=1)
    try:
        assert held == first.uuid
        slot = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=8, wait=0.3)
        assert slot.uuid != held and slot.fenced == []
        assert other.poll() is None                  # alive: not this job's zombie
        slot.release()
    finally:
        other.kill()
        other.wait()
    # a job of the same name (the same id) in another snapshot store: its log differs
    elsewhere = tmp_path / "elsewhere"
    stranger, held = _holder(elsewhere, execution=1, log="0@1.0")
    try:
        slot = StorageSlot.claim(elsewhere, job_id=JOB, host="h1", execution=8, wait=0.3,
                                 log="0@2.0")
        assert slot.uuid != held and slot.fenced == [] and stranger.poll() is None
        slot.release()
    finally:
        stranger.kill()
        stranger.wait()
    # a holder of execution 8 itself: the claim by execution 8 does not wait or fence
    same, held = _holder(tmp_path, execution=8)
    try:
        slot = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=8, wait=0.3)
        assert slot.uuid != held and slot.fenced == [] and same.poll() is None
        slot.release()
    finally:
        same.kill()
        same.wait()


def test_a_zombie_that_reclaimed_a_slot_by_its_folder_is_fenced_too(tmp_path):
    """rebalance_delay: a member claims a returning slot by its folder (claim_folder); its
    holder record names the job, execution and log it claimed for, so if it becomes a
    zombie the next execution fences it as any other (the pid alone was never fenced)."""
    made = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=7, log="L")
    made.fence(JOB, 7)
    made.release()
    child = subprocess.Popen(
        [sys.executable, "-c", RECLAIMER, made.path, str(JOB)], stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout.readline().strip() == made.uuid
        os.kill(child.pid, signal.SIGSTOP)
        slot = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=8, wait=0.3,
                                 log="L")
        assert slot.uuid == made.uuid and [f["pid"] for f in slot.fenced] == [child.pid]
        slot.release()
    finally:
        child.kill()
        child.wait()


RECLAIMER = """
import sys, time
from sparkjet.snapshot.slots import StorageSlot
slot = StorageSlot.claim_folder(sys.argv[1], holder={"job": int(sys.argv[2]), "execution": 7,
                                                     "log": "L"})
print(slot.uuid, flush=True)
time.sleep(600)
"""


def test_a_slot_of_another_host_is_refused(tmp_path):
    theirs = StorageSlot.claim(tmp_path, host="worker-a")
    theirs.release()
    with pytest.raises(StorageSlotError, match=r"holds slot-\S+ of host 'worker-a', and this is "
                                                r"host 'worker-b'.*SPARKJET_HOST_ID=worker-a"):
        StorageSlot.claim(tmp_path, host="worker-b")


def test_the_host_comes_from_sparkjet_host_id(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKJET_HOST_ID", "rack1-node3")
    with StorageSlot.claim(tmp_path) as slot:
        assert slot.host == "rack1-node3"
        doc = json.loads((tmp_path / os.path.basename(slot.path) / MEMBER).read_text())
        assert doc["host"] == "rack1-node3" and doc["uuid"] == slot.uuid


def test_an_older_execution_is_fenced_off(tmp_path):
    with StorageSlot.claim(tmp_path, host="h1") as slot:
        slot.fence(JOB, 3)
        slot.fence(JOB, 3)                      # the same execution again: fine
        slot.fence(JOB, 5)
        with pytest.raises(FencedError, match="execution 4 of job 0000000000005eed is fenced "
                                              "off by execution 5"):
            slot.fence(JOB, 4)
        assert slot.newest_execution(JOB) == 5


def test_a_writer_or_record_of_an_older_execution_is_refused_by_the_slot(tmp_path):
    """The members' storage fences without the store's log: once a slot has seen execution
    5 (the task of execution 5 claimed it), a writer of execution 4 (a processor thread
    left in a reused Python worker) and the record copy of a snapshot execution 4
    committed are refused, and nothing of theirs is kept."""
    with StorageSlot.claim(tmp_path, host="h1") as slot:
        slot.fence(JOB, 4)
        slot.check_fence(JOB, 4)
        slot.write_record(JOB, 7, b"record 7", execution=4)
        slot.fence(JOB, 5)
        slot.check_fence(JOB, 5)
        with pytest.raises(FencedError, match="execution 4 of job 0000000000005eed is fenced "
                                              "off by execution 5"):
            slot.check_fence(JOB, 4)
        with pytest.raises(FencedError, match="fenced off by execution 5"):
            slot.write_record(JOB, 8, b"record 8", execution=4)
        assert slot.records(JOB) == [7]
        slot.write_record(JOB, 8, b"record 8", execution=5)
        assert slot.records(JOB) == [7, 8]


def test_a_released_slot_refuses_writes(tmp_path):
    slot = StorageSlot.claim(tmp_path, host="h1")
    slot.release()
    with pytest.raises(StorageSlotError, match="was released"):
        slot.fence(JOB, 1)


def test_a_slot_whose_creator_died_before_member_json_is_completed(tmp_path):
    (tmp_path / "slot-half").mkdir()
    with StorageSlot.claim(tmp_path, host="h1") as slot:
        assert slot.path == str(tmp_path / "slot-half")
        assert json.loads((tmp_path / "slot-half" / MEMBER).read_text())["uuid"] == slot.uuid


@pytest.mark.parametrize("text,match", [
    ("{not json", "is not a slot's MEMBER.json"),
    ('{"format": 99, "uuid": "x", "host": "h1"}', "has format 99"),
    ('{"format": 1, "uuid": "nope", "host": "h1"}', "'nope' is not a UUID"),
])
def test_a_member_json_that_does_not_parse_is_named(tmp_path, text, match):
    (tmp_path / "slot-bad").mkdir()
    (tmp_path / "slot-bad" / MEMBER).write_text(text)
    with pytest.raises(StorageSlotError, match=match) as caught:
        StorageSlot.claim(tmp_path, host="h1")
    assert str(tmp_path / "slot-bad" / MEMBER) in str(caught.value)


def test_table_records_and_report(tmp_path):
    with StorageSlot.claim(tmp_path, host="h1", durable=True) as slot:
        slot.fence(JOB, 2)
        for sid in (1, 2, 3):
            slot.write_record(JOB, sid, f"r{sid}".encode())
        slot.drop_records_before(JOB, 3)
        slot.write_table(JOB, b"SJPT table bytes")
        assert slot.read_table(JOB) == b"SJPT table bytes"
        assert slot.join_report(JOB)["table"] == "U0pQVCB0YWJsZSBieXRlcw=="
        report = slot.report()
        assert report["uuid"] == slot.uuid and report["durable"] is True
        assert report["jobs"] == {f"{JOB:016x}": {"execution": 2, "records": [3]}}
        slot.remove_job(JOB)
        assert slot.jobs() == [] and slot.read_table(JOB) is None


def test_a_read_only_storage_dir_is_a_storage_error_naming_it(tmp_path):
    root = tmp_path / "ro"
    with mounts.tmpfs(root, read_only=True):
        with pytest.raises(StorageError, match=r"cannot create directory .*ro/slot-") as caught:
            StorageSlot.claim(root, host="h1")
        assert caught.value.deterministic


def test_a_full_storage_dir_is_a_storage_error_naming_the_file(tmp_path):
    root = tmp_path / "full"
    with mounts.tmpfs(root, size="64k"), StorageSlot.claim(root, host="h1") as slot:
        with pytest.raises(StorageError, match=r"cannot write .*records/0+1: .*No space") as caught:
            slot.write_record(JOB, 1, b"x" * 200_000)
        assert not caught.value.deterministic  # a full disk may clear
        assert os.listdir(slot.job_path(JOB, "records")) == []  # no temporary file left


def test_a_slot_that_cannot_be_made_whole_names_its_file_and_leaves_nothing(tmp_path):
    """A storage_dir with room for a folder but not for MEMBER.json: the error names the
    file that could not be written (it named a rename of the temporary folder), and the
    half-made `.new-` folder and its lock are gone (each retry on a full tmpfs left one)."""
    root = tmp_path / "full"
    with mounts.tmpfs(root, size="64k"):
        (root / "filler").write_bytes(b"x" * (64 << 10))     # every block taken
        for _ in range(2):
            with pytest.raises(StorageError, match=r"cannot write .*MEMBER\.json.*No space"):
                StorageSlot.claim(root, host="h1")
        assert sorted(os.listdir(root)) == ["filler"]
        (root / "filler").unlink()
        with StorageSlot.claim(root, host="h1") as slot:      # room again: a whole slot
            assert os.path.basename(slot.path).startswith("slot-")


def test_data_of_another_snapshot_log_is_given_up_at_claim(tmp_path):
    """Found by running the Spark tests with storage="members" as the default: a job run
    again with a new snapshot store (the old one removed) found its slots' FENCE from the
    earlier run newer than its execution 0 (FencedError at every attempt) or read that
    run's chunk files. A slot now records which log of the store its data of the job is
    of; data of another log is given up when the slot is claimed for the new one."""
    slot = StorageSlot.claim(tmp_path, job_id=JOB, host="h1")
    assert slot.keep_log(JOB, "0@1.5", drop_other=True) is False      # first label
    slot.fence(JOB, 4)
    slot.write_record(JOB, 3, b"record 3")
    assert slot.keep_log(JOB, "0@1.5", drop_other=True) is False      # same log: kept
    assert slot.records(JOB) == [3] and slot.newest_execution(JOB) == 4
    assert slot.keep_log(JOB, "0@2.5", drop_other=False) is False     # persistence decides
    assert slot.records(JOB) == [3] and slot.log_of(JOB) == "0@2.5"
    assert slot.keep_log(JOB, "0@9.0", drop_other=True) is True       # another log: dropped
    assert slot.records(JOB) == [] and slot.newest_execution(JOB) is None
    assert slot.log_of(JOB) == "0@9.0"
    slot.fence(JOB, 0)                                                # the new run goes on
    slot.release()



def test_a_slot_with_another_logs_data_does_not_stand_in_for_the_zombies(tmp_path):
    """Found by running the whole suite with storage="members" as the default: a slot held
    the job's data of an earlier log (the same job name run before on another store), and
    the claim by the next execution took it at once as "holding the job's data", so it
    neither waited for nor fenced the zombie holding this log's state: the job failed three
    times on SnapshotIncompleteError. Data of another log is given up at the claim, so such
    a slot ranks as an empty one, and the zombie's slot is waited for and fenced."""
    child, held = _holder(tmp_path, execution=7, log="0@2.0")
    try:
        old = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=3, log="0@1.0")
        assert old.uuid != held
        old.keep_log(JOB, "0@1.0", drop_other=True)   # (relabels the empty folder)
        old.fence(JOB, 3)
        old.write_record(JOB, 1, b"record 1 of the old log")
        old.release()
        os.kill(child.pid, signal.SIGSTOP)
        slot = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=8, wait=0.3,
                                 log="0@2.0")
        assert slot.uuid == held and [f["pid"] for f in slot.fenced] == [child.pid]
        slot.release()
    finally:
        child.kill()
        child.wait()


def test_a_job_of_the_same_name_in_another_store_keeps_its_slot(tmp_path):
    """Two jobs of one name (one id) in two snapshot stores on one host: with the members'
    storage as the default, the second one's claim took the first one's free slot as
    holding "its" data of another log and gave that data up, so the first job (stopped,
    to be resumed) lost its state. A slot records its job's store; a claim for another
    store passes it over and the data stays for its own job."""
    a = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=1, log="0@1.0",
                          store="/data/a")
    a.keep_log(JOB, "0@1.0", drop_other=True, store="/data/a")
    a.fence(JOB, 1)
    a.write_record(JOB, 5, b"record 5 of store a")
    a.release()
    b = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=0, log="0@2.0",
                          store="/data/b")
    assert b.uuid != a.uuid
    b.keep_log(JOB, "0@2.0", drop_other=True, store="/data/b")
    b.release()
    again = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=2, log="0@1.0",
                              store="/data/a")
    assert again.uuid == a.uuid and again.records(JOB) == [5]
    again.release()
    # the same store made anew (another log): its old data is given up, as before
    fresh = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", execution=0, log="0@3.0",
                              store="/data/a")
    assert fresh.uuid == a.uuid
    assert fresh.keep_log(JOB, "0@3.0", drop_other=True, store="/data/a")
    assert fresh.records(JOB) == []
    fresh.release()


def test_keep_log_never_drops_another_stores_data(tmp_path):
    """Review H1: a claim ranked a slot before its wait, another store's job of the same
    name took it meanwhile, and keep_log(drop_other=True) then gave that job's data up as
    "another log". Data of another store is never dropped: the claim re-checks the slot
    once locked, and keep_log refuses it."""
    from sparkjet.errors import StorageSlotError

    a = StorageSlot.claim(tmp_path, job_id=JOB, host="h1", log="0@1.0", store="/data/a")
    a.keep_log(JOB, "0@1.0", drop_other=True, store="/data/a")
    a.write_record(JOB, 5, b"record 5 of store a")
    with pytest.raises(StorageSlotError, match="another job of the same name"):
        a.keep_log(JOB, "0@2.0", drop_other=True, store="/data/b")
    assert a.records(JOB) == [5]
    a.release()
