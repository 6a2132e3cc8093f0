"""A job whose snapshot store refuses writes fails with the store's StorageError, naming the
path and the operation: at once where a replay would repeat it (a read-only store), after
restarts within max_restarts where it might clear (a full disk)."""
import pytest
from helpers.jobs import keyed_pipeline
from helpers.mounts import tmpfs

from sparkjet.errors import StorageError
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.sources import GeneratorSource


def _job(store, out) -> Job:
    source = GeneratorSource(total=200_000, partitions=2, keys=50_000, batch_size=10_000,
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
