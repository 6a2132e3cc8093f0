"""Storage that refuses a write: a read-only filesystem, a full one, a file where a folder
should be. Every failure of the snapshot store's storage (and of the file sink's) is a
StorageError naming the operation and the path, still an OSError, and says whether a
replay would repeat it."""
import errno
import pickle

import pyarrow as pa
import pytest
from helpers.mounts import tmpfs
from helpers.snapshot_data import state

from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import SparkjetError, StorageError
from sparkjet.sinks import TransactionalFileSink
from sparkjet.snapshot.store import SnapshotStore


def _refused(excinfo, operation: str, under) -> StorageError:
    e = excinfo.value
    assert isinstance(e, StorageError) and isinstance(e, SparkjetError) and isinstance(e, OSError)
    assert e.operation == operation and e.path.startswith(str(under)), (e.operation, e.path)
    assert str(e).startswith(f"cannot {operation} {e.path}: "), str(e)
    copy = pickle.loads(pickle.dumps(e))        # crosses from a member to its supervisor
    assert (str(copy), copy.errno, copy.deterministic) == (str(e), e.errno, e.deterministic)
    return e


def test_a_read_only_store_names_the_path_and_is_not_retried(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(OSError) as e:         # callers catching OSError still do
            SnapshotStore(ro / "snaps", job_id=42)
        error = _refused(e, "create directory", ro)
        assert error.errno == errno.EROFS and error.deterministic
        assert "Read-only file system" in str(error)


def test_a_file_where_the_store_directory_should_be(tmp_path):
    (tmp_path / "snaps").write_bytes(b"not a directory")
    with pytest.raises(StorageError) as e:
        SnapshotStore(tmp_path / "snaps", job_id=42)
    error = _refused(e, "create directory", tmp_path / "snaps")
    assert error.errno == errno.ENOTDIR and error.deterministic


def test_a_full_disk_names_the_file_being_written_and_may_clear(tmp_path):
    with tmpfs(tmp_path / "small", "64k") as small:
        store = SnapshotStore(small / "snaps", job_id=42)
        store.register_execution(0)
        w = store.writer(1, 0)
        with pytest.raises(StorageError) as e:
            w.write_table("agg", state(1, n=50_000), key="key")
            w.commit()
        error = _refused(e, "write", small / "snaps")
        assert error.errno == errno.ENOSPC and not error.deterministic   # cleanup may free space
        assert "No space left on device" in str(error)
        store.close()


def test_the_file_sink_on_a_full_disk_names_the_file(tmp_path):
    with tmpfs(tmp_path / "small", "64k") as small:
        sink = TransactionalFileSink(small / "out", format="arrow")
        writer = sink.open(ProcessorContext(job_id=7, execution_id=0, vertex="source", processor=0,
                                            processors=1,
                                            guarantee="exactly-once"))
        batch = pa.record_batch(state(2, n=20_000).to_batches()[0])
        with pytest.raises(StorageError) as e:
            for _ in range(10):
                writer.write(batch)
            writer.prepare(1)
        error = _refused(e, "write", small / "out")
        assert error.errno == errno.ENOSPC


def test_the_file_sink_closed_after_a_full_disk_keeps_the_error_that_names_the_file(tmp_path):
    """Found by the nemesis long run: after a write failed on a full disk, the processor
    closed its sink, whose discard of the half-written file flushed the file's last
    buffer onto the full disk and raised a bare "OSError: [Errno 28]" with no path, which
    became the execution's failure. The discard now releases the file quietly (it is
    deleted next)."""
    with tmpfs(tmp_path / "small", "64k") as small:
        sink = TransactionalFileSink(small / "out", format="parquet")
        writer = sink.open(ProcessorContext(job_id=7, execution_id=0, vertex="source",
                                            processor=0, processors=1,
                                            guarantee="exactly-once"))
        writer.write(pa.record_batch(state(2, n=100).to_batches()[0]))   # in its buffers
        with open(small / "filler", "wb", buffering=0) as filler:   # the disk fills meanwhile
            with pytest.raises(OSError) as full:
                while True:
                    filler.write(b"x" * 4096)
            assert full.value.errno == errno.ENOSPC
        writer.close()                     # raised OSError: [Errno 28] before the fix
        assert not [p for p in (small / "out").rglob("*.parquet")]


def test_the_arrow_log_on_a_full_disk_names_the_segment(tmp_path):
    from sparkjet.connectors.arrow_log import ArrowLogWriter

    schema = pa.schema([("x", pa.int64())])
    batch = pa.record_batch([pa.array(range(20_000), pa.int64())], schema=schema)
    with tmpfs(tmp_path / "small", "64k") as small:
        log = ArrowLogWriter(small / "log", 1, schema)
        with pytest.raises(StorageError) as e:
            for _ in range(10):
                log.append(0, batch)
        error = _refused(e, "append to", small / "log" / "partition-00000")
        assert error.errno == errno.ENOSPC and not error.deterministic
        assert error.path.endswith(".arrows")
        log.close(seal=False)


def test_the_arrow_log_on_a_read_only_disk_names_the_directory(tmp_path):
    from sparkjet.connectors.arrow_log import ArrowLogWriter

    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(StorageError) as e:
            ArrowLogWriter(ro / "log", 1, pa.schema([("x", pa.int64())]))
        error = _refused(e, "create directory", ro)
        assert error.errno == errno.EROFS and error.deterministic


def test_a_write_that_fails_on_the_writers_thread_fails_the_snapshot_at_finish(tmp_path):
    """The writer's files are written on its I/O thread while the processor goes on: a write
    that fails there is raised by finish(), before any manifest exists, the half-written
    file is removed and nothing is committed."""
    with tmpfs(tmp_path / "small", "64k") as small:
        store = SnapshotStore(small / "snaps", job_id=42)
        store.register_execution(0)
        w = store.writer(1, 0)
        w.write_table("agg", state(1, n=50_000), key="key")    # queued: returns at once
        with pytest.raises(StorageError) as e:
            w.finish()
        error = _refused(e, "write", small / "snaps")
        assert error.errno == errno.ENOSPC
        with pytest.raises(StorageError):
            w.finish()                      # never a manifest after a failed write
        assert store.latest_complete() is None
        assert list((small / "snaps").rglob("*.chunks")) == []
        store.close()
