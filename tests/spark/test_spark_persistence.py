"""Persistence restart on the members' storage (issue 25, item 1; sparkjet.runtime.persistence):
a job of ``storage="members", persistence=True`` is run until a snapshot is committed, then
every member's Python worker is SIGKILLed and the job object abandoned (its driver gone: the
run is cancelled, no restart, nothing graceful); a new Job of the same configuration (a new
driver) restarts it from the slots on disk, under the recovery policies, after faults done
to the slots and the store by hand (a slot lost, a snapshot's files lost, the store's job
folder lost, force start). Each runs for 8-15 s on Spark: the default run keeps the
whole-job restart and the refusal of FULL_RECOVERY_ONLY; the others are marked long."""
import os
import shutil
import signal

import pytest
from helpers.jobs import exact, keyed_spark_job

from sparkjet import verify
from sparkjet.errors import JobCancelledError, JobFailedError
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.verify import last_update_per_key


def _source():
    return GeneratorSource(total=600_000, partitions=4, keys=5_000, batch_size=5_000,
                           rate=200_000)


def _job(tmp_path, source, **config):
    defaults = dict(storage="members", persistence=True, storage_dir=str(tmp_path / "slots"),
                    max_restarts=2, validation_timeout=1.0, retained_snapshots=3)
    return keyed_spark_job(tmp_path, source, "persist", **{**defaults, **config})


def _run_and_kill_all(spark, job, after: int) -> list[dict]:
    """Runs ``job`` until snapshot ``after`` is committed, then SIGKILLs every member's
    Python worker and abandons the run (cancelled: no restart, nothing graceful). Returns
    the events seen."""
    events = []

    def progress(event):
        events.append(event)
        if event["event"] == "snapshot" and event["snapshot"] >= after and \
                not any(e["event"] == "killed" for e in events):
            pids = dict(job.member_pids)
            for pid in pids.values():
                os.kill(pid, signal.SIGKILL)
            events.append({"event": "killed", "pids": pids})
            job.cancel()

    with pytest.raises((JobCancelledError, JobFailedError)):
        job.run(spark, on_progress=progress)
    assert any(e["event"] == "killed" for e in events), "the job ended before the kill"
    return events


def _slots(tmp_path, events):
    """The slot folders of the last execution, by member index."""
    placed = [e for e in events if e["event"] == "placed"][-1]
    return {s["member"]: tmp_path / "slots" / f"slot-{s['uuid']}" for s in placed["slots"]}


def _committed(events):
    return [e["snapshot"] for e in events if e["event"] == "snapshot"]


def test_whole_job_restart_restores_the_newest_snapshot_exactly_once(spark, tmp_path):
    source = _source()
    events = _run_and_kill_all(spark, _job(tmp_path, source), after=2)
    newest = _committed(events)[-1]
    seen = []
    result = _job(tmp_path, source).run(spark, on_progress=seen.append)
    first = result.executions[0]
    assert first["restored_from"] == newest
    recovery = first["recovery"]
    assert recovery["policy"] == "FULL_RECOVERY_ONLY" and recovery["snapshot"] == newest
    assert recovery["given_up"] == [] and len(recovery["slots"]) == 2
    assert all(newest in s["holds"] and s["verified"] > 0 and not s["bad"]
               for s in recovery["slots"].values()), recovery
    report = exact(tmp_path, source)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


@pytest.mark.parametrize("backup_count", [0, pytest.param(1, marks=pytest.mark.long)])
def test_full_recovery_only_with_a_slot_lost(spark, tmp_path, backup_count):
    """A slot's folder is gone after the kill: with a backup of every partition on the
    other slot the restart restores the newest snapshot exactly once; without backups it is
    refused, naming the vertex, its partitions, the slot, and what to do."""
    source = _source()
    events = _run_and_kill_all(spark, _job(tmp_path, source, backup_count=backup_count),
                               after=2)
    lost = _slots(tmp_path, events)[1]
    shutil.rmtree(lost)
    job = _job(tmp_path, source, backup_count=backup_count)
    if backup_count == 0:
        with pytest.raises(JobFailedError) as e:
            job.run(spark)
        text = str(e.value)
        assert "not retried: RecoveryRefusedError: job " in text, text   # named by its class
        assert "persistence restart refused (FULL_RECOVERY_ONLY)" in text, text
        assert "partitions" in text and lost.name[len("slot-"):] in text, text
        assert "Job.force_start()" in text and "partial policy" in text, text
        return
    result = job.run(spark)
    assert result.executions[0]["restored_from"] == _committed(events)[-1]
    report = exact(tmp_path, source)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


@pytest.mark.long
def test_a_slot_that_lost_the_newest_snapshot_resyncs_it_by_merkle_trees(spark, tmp_path):
    """Slot 1 comes back without the newest snapshot's files and record copy (it holds the
    older ones): its member syncs the partitions it restores from slot 0's backups by Merkle
    trees before the restore (issue 25 item 2), the restored event says what that moved, and
    the output is exactly once."""
    source = _source()
    events = _run_and_kill_all(spark, _job(tmp_path, source, backup_count=1), after=3)
    newest = _committed(events)[-1]
    job_dir = next((_slots(tmp_path, events)[1] / "jobs").iterdir())
    for d in (job_dir / "replicas" / "snapshots").iterdir():
        if d.name.startswith(f"{newest:012d}-e"):
            shutil.rmtree(d)
    (job_dir / "records" / f"{newest:020d}").unlink(missing_ok=True)   # if phase 2 got there
    seen = []
    result = _job(tmp_path, source, backup_count=1).run(spark, on_progress=seen.append)
    assert result.executions[0]["restored_from"] == newest
    restored = [e for e in seen if e["event"] == "restored"][0]
    synced = restored.get("merkle_resync")
    print("merkle_resync:", synced)
    assert synced and synced["files"] >= 1 and 0 < synced["bytes"], restored
    report = exact(tmp_path, source)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


@pytest.mark.long
@pytest.mark.parametrize("guarantee,policy", [
    ("exactly-once", "PARTIAL_RECOVERY_MOST_RECENT"),
    ("at-least-once", "PARTIAL_RECOVERY_MOST_RECENT"),
    ("at-least-once", "PARTIAL_RECOVERY_MOST_COMPLETE")])
def test_a_partial_policy_takes_an_older_snapshot_only_where_allowed(
        spark, tmp_path, guarantee, policy):
    """The newest snapshot's files are gone from both slots (backup_count 0, its folder
    deleted in one slot): PARTIAL_RECOVERY_MOST_RECENT finds the older snapshot complete, as
    does PARTIAL_RECOVERY_MOST_COMPLETE (both slots hold the same table).
    Under exactly-once with a transactional sink that replays output the newer snapshot's
    phase 2 committed: refused, saying so. Under at-least-once it is restored, the newer
    snapshot reported given up, and nothing is lost."""
    source = _source()
    kw = dict(backup_count=0, processing_guarantee=guarantee,
              cluster_data_recovery_policy=policy)
    events = _run_and_kill_all(spark, _job(tmp_path, source, **kw), after=2)
    committed = _committed(events)
    newest = committed[-1]
    gone = 0
    for slot in _slots(tmp_path, events).values():
        for d in slot.glob(f"jobs/*/replicas/snapshots/{newest:012d}-e*"):
            shutil.rmtree(d)
            gone += 1
    assert gone
    job = _job(tmp_path, source, **kw)
    seen = []
    if guarantee == "exactly-once":
        with pytest.raises(JobFailedError, match="exactly-once refuses it"):
            job.run(spark, on_progress=seen.append)
        recovery = [e for e in seen if e["event"] == "recovery"][-1]
        assert recovery["refused"] == "exactly-once" and recovery["snapshot"] == newest - 1
        return
    result = job.run(spark, on_progress=seen.append)
    recovery = result.executions[0]["recovery"]
    assert recovery["snapshot"] == newest - 1 and recovery["given_up"] == [newest], recovery
    assert recovery["replay_from"] == newest - 1
    assert result.executions[0]["restored_from"] == newest - 1
    out = last_update_per_key(TransactionalFileSink.read(tmp_path / "out"))
    report = verify.check_aggregates(source.expected_counts(), out, key="key",
                                     columns=["count", "sum"], guarantee="at-least-once")
    assert report.valid and report.lost_count == 0, str(report)


@pytest.mark.long
def test_lost_driver_metadata_is_rebuilt_from_the_slots_record_copies(spark, tmp_path):
    source = _source()
    """The store's folder of the job is deleted after the kill: the new driver finds no
    snapshot there, commits the newest record copy a slot holds (phase 2 keeps it in the
    slot before any sink commits, so no output is newer than it), ends its first execution
    (the slots have seen newer ones than its id) and restores it in the next: exactly once."""
    source = _source()
    events = _run_and_kill_all(spark, _job(tmp_path, source), after=2)
    copies = max(int(p.name) for p in (tmp_path / "slots").glob("slot-*/jobs/*/records/*"))
    assert copies in _committed(events)[-2:]
    (job_dir,) = (tmp_path / "snapshots").glob("job-*")
    shutil.rmtree(job_dir)
    seen = []
    result = _job(tmp_path, source).run(spark, on_progress=seen.append)
    rebuilt = [e for e in seen if e["event"] == "metadata_rebuilt"]
    assert len(rebuilt) == 1 and rebuilt[0]["snapshot"] == copies, rebuilt
    assert result.executions[0]["status"] == "failed"
    assert "driver's metadata was lost" in result.executions[0]["error"]
    assert result.executions[1]["restored_from"] == copies
    report = exact(tmp_path, source)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


@pytest.mark.long
def test_force_start_wipes_the_job_and_starts_fresh(spark, tmp_path):
    """Under exactly-once with a transactional sink: force start gives the job's data up and
    its ids go on above the old ones (the sink's registry of executions keeps them; ids from
    0 again were fenced off by it, so force start used to be refused)."""
    source = _source()
    events = _run_and_kill_all(spark, _job(tmp_path, source, backup_count=0), after=1)
    lost = _slots(tmp_path, events)[1]
    shutil.rmtree(lost)
    job = _job(tmp_path, source, backup_count=0)
    with pytest.raises(JobFailedError, match="refused"):
        job.run(spark)
    removed = job.force_start()
    assert removed["store"] and removed["slots"] and not removed["held"], removed
    assert not list((tmp_path / "slots").glob("slot-*/jobs/*"))
    old = max(e["execution"] for e in events if e["event"] == "execution")
    assert removed["floor"]["execution"] >= old, removed
    seen = []
    result = job.run(spark, on_progress=seen.append)
    assert result.executions[0]["restored_from"] is None
    assert result.executions[0]["execution_id"] > removed["floor"]["execution"]
    assert min(e["snapshot"] for e in seen if e["event"] == "snapshot") > \
        removed["floor"]["snapshot"] >= max(_committed(events))
    assert not [e for e in seen if e["event"] == "recovery" and e.get("snapshot")]
    # everything read again from the start: at least once (the first run's commits stay)
    out = last_update_per_key(TransactionalFileSink.read(tmp_path / "out"))
    report = verify.check_aggregates(source.expected_counts(), out, key="key",
                                     columns=["count", "sum"], guarantee="at-least-once")
    assert report.valid and report.lost_count == 0, str(report)
