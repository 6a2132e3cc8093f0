"""The storage fault campaign (sparkjet.testing.storage_campaign): its pieces, a defect it
found (a foreign slot's refusal lost in a Spark stage failure and retried), and a short
campaign on local[3].

Run: PYTHONPATH=$PWD/pysrc python -m pytest -q -p no:cacheprovider tests/testing/test_storage_campaign.py
The long campaign: python -m sparkjet.testing.storage_campaign --faults 200 --json"""
import json
import os
import random
import re
from pathlib import Path

import pytest
from helpers import campaigns

from sparkjet.errors import StorageSlotError
from sparkjet.snapshot.chunks import HEADER_SIZE
from sparkjet.snapshot.slots import StorageSlot
from sparkjet.testing import storage_campaign as sc


def test_every_kind_is_planned_and_every_operator_taken_in_turn():
    kinds = [k for k in sc.KINDS.values() if not k.standalone]
    planned = sc.plan(kinds, 40, random.Random(1))
    assert [k for k, _ in planned[:len(kinds)]] == kinds
    assert {op for _, op in planned} == set(sc.OPERATORS)
    assert sum(2 if k.name == "kill-member" else 1 for k, _ in planned) >= 40


def test_an_exact_restore_of_broadcast_state_after_two_lost_slots_is_right():
    """Found by the long run: two slots of three lost with backup_count=1 must be refused
    for keyed state, but the table join's pipeline holds only broadcast state (every slot
    has it whole), so its exact restore was wrongly counted a violation."""
    def restored(kind, pipeline):
        r = sc.RoundResult(kind, pipeline, 1, faults=1, restarts=1)
        return sc._valid(sc.KINDS[kind], r, partial=False)

    assert restored("two-lost-b1", "enrich")
    assert not restored("two-lost-b1", "keyed")       # keyed state lost: must be refused
    assert not restored("all-lost", "enrich")         # nothing left anywhere
    wrong = sc.RoundResult("two-lost-b1", "enrich", 1, faults=1, duplicated=3)
    assert not sc._valid(sc.KINDS["two-lost-b1"], wrong, partial=False)


@pytest.mark.parametrize("how", ["flip-byte", "truncate", "delete-replica"])
def test_damage_changes_the_file_as_it_says(tmp_path, how):
    f = tmp_path / "0-0.chunks"
    data = bytes(range(256)) * 4
    f.write_bytes(data)
    said = sc.damage(f, how, random.Random(3))
    if how == "delete-replica":
        assert not f.exists() and "deleted" in said
    elif how == "truncate":
        assert len(f.read_bytes()) < len(data) and "truncated" in said
    else:
        got = f.read_bytes()
        assert len(got) == len(data)
        diff = [i for i in range(len(data)) if got[i] != data[i]]
        assert len(diff) == 1 and bin(got[diff[0]] ^ data[diff[0]]).count("1") == 1


def test_chunk_files_are_of_the_newest_snapshot_folder(tmp_path):
    for snap in ("000000000001-e000000000000", "000000000002-e000000000001"):
        d = tmp_path / "slot-x" / "jobs" / "job-0000000000000001" / "replicas" / "snapshots"
        (d / snap / "aggregate").mkdir(parents=True)
        (d / snap / "aggregate" / "0-0.chunks").write_bytes(b"x")
    files = sc.chunk_files(tmp_path / "slot-x")
    assert [f.parent.parent.name for f in files] == ["000000000002-e000000000001"]
    assert len(sc.chunk_files(tmp_path / "slot-x", newest_only=False)) == 2


def test_a_foreign_slot_is_refused_by_the_claim(tmp_path):
    sc.foreign_slot(tmp_path)
    with pytest.raises(StorageSlotError, match="of host 'another-host'"):
        StorageSlot.claim(str(tmp_path), host="this-host")


@pytest.mark.spark
def test_a_foreign_slot_fails_a_spark_job_at_once_naming_it(spark, tmp_path):
    """A member that cannot claim its slot (here: storage_dir holds another host's slot)
    fails before it joins. Its error used to reach the driver only as the Spark stage's
    failure (a Py4J error with the Python traceback inside): not classified, so the job
    retried it max_restarts times and then failed naming a Py4JJavaError. Now the member
    reports it to the coordinator: the job fails at once on StorageSlotError, naming the
    slot's host and what to do."""
    from sparkjet.connectors.generator import GeneratorSource
    from sparkjet.errors import JobFailedError
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import TransactionalFileSink

    sc.foreign_slot(tmp_path / "slots")
    source = GeneratorSource(total=50_000, partitions=2, keys=100, batch_size=5_000)
    job = Job(Pipeline().read_from(source).group_by("key").aggregate(count="count")
              .write_to(TransactionalFileSink(tmp_path / "out")),
              JobConfig(name=f"foreign-{tmp_path.name}", snapshot_store=str(tmp_path / "snaps"),
                        storage="members", storage_dir=str(tmp_path / "slots"), members=2,
                        local_parallelism=1, max_restarts=2, restart_backoff=0.0))
    events = []
    with pytest.raises(JobFailedError) as failed:
        job.run(spark, on_progress=events.append)
    message = str(failed.value)
    assert "StorageSlotError" in message and "another-host" in message, message
    assert "SPARKJET_HOST_ID" in message, message      # what to do
    assert not [e for e in events if e["event"] == "restart"], "a replay repeats it"


@pytest.mark.spark
@pytest.mark.slow
def test_a_short_storage_campaign_loses_and_duplicates_nothing(tmp_path):
    """Five kinds of fault, one round each, on local[3] (three members, three slots): a
    slot wiped while its member is down, every slot wiped (a refusal naming partitions),
    a kill as phase 2 runs, a truncated replica with the primary's slot wiped, a foreign
    slot (a refusal, then the job resumes once it is removed). Every round exactly-once or
    refused by name."""
    kinds = ["wipe-slot", "all-lost", "kill-phase2", "truncate", "foreign-slot"]
    rounds = campaigns.run_cli("sparkjet.testing.storage_campaign", "STORAGE-CAMPAIGN-JSON",
                               ["--faults", "5", "--kinds", ",".join(kinds), "--seed", "3",
                                "--dir", str(tmp_path)], 900)
    assert set(rounds) == set(kinds), rounds
    assert rounds["all-lost"]["refusal"] == "SnapshotIncompleteError", rounds["all-lost"]
    assert any("partitions" in e for e in rounds["all-lost"]["errors"]), rounds["all-lost"]
    assert rounds["foreign-slot"]["refusal"] == "StorageSlotError", rounds["foreign-slot"]
    assert "run again" in rounds["foreign-slot"]["detail"]
    assert rounds["wipe-slot"]["refusal"] is None and rounds["kill-phase2"]["refusal"] is None


def test_slots_claimed_at_once_on_an_empty_storage_dir_are_distinct_and_whole(tmp_path):
    """Members that start together on an empty storage_dir each make a new slot. A slot
    used to appear (mkdir) before its creator locked it and wrote its MEMBER.json: a
    claim listing the folder in between took it for a slot whose creator had died,
    locked it and wrote an identity of its own into it, and the creator failed with "a new
    slot was locked by someone else" (the storage campaign's first executions hit it).
    Each claim must end with a slot of its own whose MEMBER.json names its folder."""
    import threading

    for attempt in range(40):
        root = tmp_path / f"storage-{attempt}"
        start = threading.Barrier(12)
        claimed, errors = [], []

        def claim(start=start, root=root, claimed=claimed, errors=errors):
            start.wait()
            try:
                claimed.append(StorageSlot.claim(str(root), host="h"))
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)

        threads = [threading.Thread(target=claim) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            assert not errors, errors
            assert len({s.uuid for s in claimed}) == 12
            for s in claimed:
                member = json.loads((root / f"slot-{s.uuid}" / "MEMBER.json").read_text())
                assert member["uuid"] == s.uuid and s.path == str(root / f"slot-{s.uuid}")
        finally:
            for s in claimed:
                s.release()


@pytest.mark.parametrize("how", ["flip-byte", "truncate", "delete-replica"])
def test_a_restore_passes_over_a_damaged_copy_for_a_good_one(tmp_path, how):
    """A chunk file in slot a (the member's own) and its backup in slot b (a peer's,
    read over a real exchange server). Slot a's copy damaged: the restore used to read
    only the copy slot_files picked (its own) and fail with SnapshotCorruptError while
    slot b held a good copy (the storage campaign's flip-byte rounds ended so). It reads
    b's now, each chunk from a copy where it checks out, and fails naming a's copy only
    when no copy of some chunk is good."""
    import shutil

    import pyarrow as pa

    from sparkjet.errors import SnapshotCorruptError, SnapshotIncompleteError
    from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
    from sparkjet.runtime.exchange.security import LinkSecurity
    from sparkjet.runtime.storage import slot_files, slot_read_handler
    from sparkjet.snapshot.store import SnapshotStore

    job = 0xABC
    a = StorageSlot.claim(tmp_path / "host-a", host="a")
    b = StorageSlot.claim(tmp_path / "host-b", host="b")
    security = LinkSecurity.generate(1)
    server = ExchangeServer("127.0.0.1", execution_id=1, security=security)
    server.on_get("slot_read", slot_read_handler(b, job))
    client = ExchangeClient(server.location, security=security)
    try:
        def replicate(path, partitions):   # a backup copy into slot b, as slot_write makes
            target = os.path.join(b.replicas(job).root, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(a.replicas(job).root, path), target)
            return [b.uuid]

        store = SnapshotStore(tmp_path / "store", job)
        store.register_execution(1)
        state = pa.table({"key": pa.array(range(2000), pa.int64()),
                          "v": pa.array([float(i) for i in range(2000)])})
        w = store.writer(0, 1, writer=0, partition_count=7, slot=a, replicate=replicate)
        w.write_table("agg", state, key="key")
        store.commit(0, 1, [w.finish()], table="dGFibGU=")
        (f,) = store._resolve(0, None).record.vertices["agg"].files
        assert f.holders == [a.uuid, b.uuid]
        member = type("M", (), {"topology": type("T", (), {"slots": [a.uuid, b.uuid]})(),
                                "peers": {1: client}})()
        store.slot_files = slot_files(member, a, job)
        mine = next(Path(a.replicas(job).root).rglob("*.chunks"))
        rng = random.Random(7)
        done = sc.damage(mine, how, rng)
        got = store.restore("agg").table.sort_by("key")
        assert got.equals(state), "the good copy in slot b"
        theirs = next(Path(b.replicas(job).root).rglob("*.chunks"))
        if how == "flip-byte":
            # each chunk is checked on its own: a flip in another chunk of b's copy still
            # leaves a good copy of every chunk, and the restore takes each from where it
            # checks out; the same byte flipped in both leaves none of that chunk
            at = int(re.search(r"byte (\d+)", done).group(1))
            other = next(c for c in f.chunks
                         if not c.offset <= at < c.offset + HEADER_SIZE + c.stored_size)
            last = other.offset + HEADER_SIZE + other.stored_size - 1
            _flip(theirs, last)
            assert store.restore("agg").table.sort_by("key").equals(state)
            _flip(theirs, last)
            _flip(theirs, at)
        else:
            sc.damage(theirs, "flip-byte" if how == "delete-replica" else how, rng)
        with pytest.raises((SnapshotCorruptError, SnapshotIncompleteError)) as failed:
            store.restore("agg")
        assert f"slot {a.uuid}" in str(failed.value), failed.value
    finally:
        client.close()
        server.close()
        a.release()
        b.release()


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
