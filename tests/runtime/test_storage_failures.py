"""A job whose snapshot store refuses writes fails with the store's StorageError, naming the
path and the operation: at once where a replay would repeat it (a read-only store), after
restarts within max_restarts where it might clear (a full disk)."""
import pytest
from helpers.jobs import keyed_pipeline
from helpers.mounts import tmpfs

from sparkjet.errors import StorageError
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.sources import GeneratorSource


def _job(store, out, total: int = 200_000) -> Job:
    source = GeneratorSource(total=total, partitions=2, keys=50_000, batch_size=10_000,
                             rate=200_000)
    return Job(keyed_pipeline(source, out),
               JobConfig(name="storage", snapshot_store=str(store), snapshot_interval=0.1,
                         max_restarts=5, restart_backoff=0.05))


def test_a_job_on_a_read_only_store_fails_at_once_naming_it(tmp_path):
    events = []
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(StorageError) as e:
            _job(ro / "snaps", tmp_path / "out").run(on_progress=events.append)
    assert e.value.path.startswith(str(ro)) and e.value.deterministic
    assert "Read-only file system" in str(e.value)
    assert not [x for x in events if x["event"] == "restart"]


def test_a_job_on_a_full_store_fails_naming_the_file(tmp_path):
    events = []
    with tmpfs(tmp_path / "small", "64k") as small:
        with pytest.raises(JobFailedError) as e:
            _job(small / "snaps", tmp_path / "out").run(on_progress=events.append)
    message = str(e.value)
    assert "StorageError: cannot " in message and f" {small}/snaps/" in message, message[:2000]
    assert "No space left on device" in message
    # a full disk may clear (the store's cleanup, an operator): restarted like a lost
    # member, within max_restarts, and every failure says what was refused where
    restarts = [x["error"] for x in events if x["event"] == "restart"]
    assert 1 <= len(restarts) <= 5
    assert all(r.startswith("StorageError: cannot ") and f" {small}/snaps/" in r
               for r in restarts), restarts


def test_a_store_deleted_while_the_job_runs_stops_it_and_never_reuses_an_execution_id(tmp_path):
    """The store's directory removed under a running job (an operator's rm -rf, a cleanup
    cron): the job stops with an error naming the store, and no execution id repeats (a
    zombie of execution 0 would otherwise share the fencing token of a new execution 0)."""
    import shutil
    import threading

    from sparkjet.errors import SnapshotStoreLostError

    store = tmp_path / "snaps"
    events, started = [], threading.Event()

    def on_progress(event):
        events.append(event)
        if event["event"] == "snapshot" and event.get("snapshot", 0) >= 2:
            started.set()

    def delete_when_running():
        if started.wait(60):
            # as rm -rf does: files the job removes or adds meanwhile do not stop it
            for _ in range(100):
                shutil.rmtree(store, ignore_errors=True)
                if not any(store.glob("job-*/log")):
                    break

    deleter = threading.Thread(target=delete_when_running, daemon=True)
    deleter.start()
    # 10 s of input: the job is still running when the deletion lands however busy the
    # machine (it stops then; with 1 s of input, under load, it could end first)
    with pytest.raises((JobFailedError, SnapshotStoreLostError)) as e:
        _job(store, tmp_path / "out", total=2_000_000).run(on_progress=on_progress)
    deleter.join()
    assert started.is_set(), "the job ended before the store could be deleted under it"
    message = str(e.value)
    assert "SnapshotStoreLostError" in message or isinstance(e.value, SnapshotStoreLostError)
    assert str(store) in message and "deleted" in message, message[:2000]
    executions = [x["execution"] for x in events if x["event"] == "execution"]
    assert len(executions) == len(set(executions)), executions
    assert not [x for x in events if x["event"] == "execution" and x["execution"] == 0][1:]


def test_the_supervisor_hands_out_no_execution_id_a_deleted_store_forgot(tmp_path):
    import shutil

    from sparkjet.errors import SnapshotStoreLostError
    from sparkjet.runtime.config import open_store
    from sparkjet.runtime.supervision import next_execution

    config = JobConfig(name="ids", snapshot_store=str(tmp_path / "snaps"))
    assert next_execution(config, 0) == 0
    store = open_store(config)
    store.register_execution(0)
    assert next_execution(config, 1, previous=0) == 1
    store.register_execution(1)
    # execution 2 failed before it registered (a full disk): its id may be handed out again
    assert next_execution(config, 2, previous=1) == 2
    assert next_execution(config, 3, previous=2) == 2
    shutil.rmtree(tmp_path / "snaps")
    with pytest.raises(SnapshotStoreLostError, match="no longer holds execution 1"):
        next_execution(config, 3, previous=2)


def test_a_store_deleted_as_the_job_finishes_is_named_not_a_bare_file_error(tmp_path):
    """The store's folder removed after the job's last commit, before it records that it
    finished (what the test above hit when the job outran the deletion: a bare
    FileNotFoundError of a temporary file): the error names the store and what it means."""
    import shutil

    from sparkjet.errors import SnapshotStoreLostError
    from sparkjet.runtime.lifecycle import mark_finished

    config = JobConfig(name="ends", snapshot_store=str(tmp_path / "snaps"))
    job_dir = tmp_path / "snaps" / f"job-{config.id:016x}"
    job_dir.mkdir(parents=True)
    mark_finished(config, 10)                      # a store in place: recorded
    assert (job_dir / "FINISHED").exists()
    shutil.rmtree(tmp_path / "snaps")
    with pytest.raises(SnapshotStoreLostError, match="'ends' ran to its end.*snaps.*deleted"):
        mark_finished(config, 10)
