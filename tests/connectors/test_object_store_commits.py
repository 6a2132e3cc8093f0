"""Commits on S3 decided by one conditional put (``If-None-Match: *``), against a real S3
API (moto's server on 127.0.0.1): the server refuses a second put, of two racing committers
exactly one wins and the other gets the error the local path gives, readers see the
winner's whole result, and a job with its snapshot store and file sink on S3 survives a
kill exactly once."""
import threading
import time
import uuid
import warnings

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pytest
from helpers.jobs import run_with_kills
from helpers.s3_server import s3_filesystem, s3_uri

from sparkjet import verify
from sparkjet._fs import Backend, ObjectStoreRaceWarning
from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import FencedError, InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource

ROUNDS = 6      # races per test: one round may not interleave, several in a row do


def new_bucket(endpoint) -> str:
    """A bucket of its own for a test: moto lists a prefix by scanning the whole bucket."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_filesystem(endpoint, allow_bucket_creation=True).create_dir(name)
    return name


def race(*calls):
    """Runs the calls, each ``(function, *args)``, on threads released together; returns
    each one's result or exception."""
    start = threading.Barrier(len(calls))
    out = [None] * len(calls)

    def run(i, call):
        start.wait()
        try:
            out[i] = call[0](*call[1:])
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def later(delay, function, *args):
    time.sleep(delay)
    return function(*args)


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """The same store root on a local disk and on S3: (uri, filesystem) for SnapshotStore,
    so each race runs on both and must end the same way."""
    if request.param == "local":
        return str(tmp_path / "snaps"), None
    _, endpoint = request.getfixturevalue("s3")
    return f"{new_bucket(endpoint)}/snaps", s3_filesystem(endpoint)


def test_moto_refuses_a_second_conditional_put(s3):
    import boto3
    from botocore.exceptions import ClientError

    _, endpoint = s3
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x")
    client.put_object(Bucket="lake", Key="once/a", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket="lake", Key="once/a", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert client.get_object(Bucket="lake", Key="once/a")["Body"].read() == b"first"


def test_exclusive_create_races_have_one_winner_whose_bytes_stay(where):
    uri, fs = where
    backend = Backend(uri, fs)
    backend.makedirs(backend.root)
    assert backend.atomic_exclusive
    for r in range(ROUNDS):
        path = backend.path(f"r{r}")
        got = race((backend.create_exclusive, path, b"A" * 1000),
                   (backend.create_exclusive, path, b"B" * 1000))
        assert sorted(got) == [False, True], got
        winner = b"A" if got[0] else b"B"
        assert bytes(backend.read(path)) == winner * 1000
    # A name once taken stays refused, and a retry of the winner's own put is its own.
    assert not backend.create_exclusive(backend.path("r0"), b"C")


def test_racing_registrations_of_one_execution(where):
    uri, fs = where
    a, b = SnapshotStore(uri, 1, filesystem=fs), SnapshotStore(uri, 1, filesystem=fs)
    for execution in range(1, ROUNDS + 1):
        got = race((a.register_execution, execution), (b.register_execution, execution))
        assert sorted(type(g).__name__ for g in got) == ["FencedError", "NoneType"], got
        assert [e.execution for _, e in a._events()] == list(range(1, execution + 1))


def test_a_zombie_commit_racing_a_new_execution_loses_nothing_acknowledged(where):
    """Execution n commits while execution n + 1 registers: the register always lands, and
    the commit counts exactly when it was acknowledged (never both written to one log
    entry)."""
    uri, fs = where
    old, new = SnapshotStore(uri, 1, filesystem=fs), SnapshotStore(uri, 1, filesystem=fs)
    old.register_execution(1)
    last = None
    for snap in range(10):
        execution = snap + 1
        table = pa.table({"key": pa.array(range(snap, snap + 100), pa.int64())})
        w = old.writer(snap, execution)
        w.write_table("counts", table, key="key")
        manifest = w.finish()
        # The commit's own checks and writes come before its log entry: the register
        # starts a little later each round, to meet that entry's creation.
        committed, registered = race((old.commit, snap, execution, [manifest]),
                                     (later, snap * 0.03, new.register_execution, execution + 1))
        assert registered is None, registered
        assert new.current_execution() == execution + 1
        if isinstance(committed, FencedError):
            assert new.latest_complete() == last
        else:
            assert not isinstance(committed, Exception), committed
            last = new.latest_complete()
            assert (last.snapshot_id, last.execution_id) == (snap, execution)
            assert new.restore("counts").table.sort_by("key").equals(table)
        old.wait_for_cleanup()


def test_racing_commits_of_one_snapshot(where):
    uri, fs = where
    a, b = SnapshotStore(uri, 1, filesystem=fs), SnapshotStore(uri, 1, filesystem=fs)
    a.register_execution(1)
    for snap in range(ROUNDS):
        table = pa.table({"key": pa.array(range(snap, snap + 50), pa.int64())})
        w = a.writer(snap, 1)
        w.write_table("t", table, key="key")
        manifest = w.finish()
        got = race((a.commit, snap, 1, [manifest]), (b.commit, snap, 1, [manifest]))
        errors = [g for g in got if isinstance(g, Exception)]
        assert len(errors) == 1 and isinstance(errors[0], InvalidArgumentError), got
        assert f"not newer than the last complete snapshot {snap}" in str(errors[0])
        commits = [e for _, e in a._events() if type(e).__name__ == "CommitEvent"]
        assert commits[-1].snapshot == snap and len({c.snapshot for c in commits}) == len(commits)
        assert b.restore("t").table.sort_by("key").equals(table)
        a.wait_for_cleanup()
        b.wait_for_cleanup()


def test_racing_exports_of_one_name_on_s3(s3):
    _, endpoint = s3
    fs, uri = s3_filesystem(endpoint), f"{new_bucket(endpoint)}/snaps"
    a = SnapshotStore(uri, 1, filesystem=fs)
    a.register_execution(1)
    tables = {}
    for snap in range(ROUNDS // 2):
        tables[snap] = pa.table({"key": pa.array(range(snap * 10, snap * 10 + 40), pa.int64())})
        w = a.writer(snap, 1)
        w.write_table("t", tables[snap], key="key")
        w.commit()
        a.wait_for_cleanup()
        b = SnapshotStore(uri, 1, filesystem=fs)
        got = race((a.export, None, f"keep-{snap}"), (b.export, None, f"keep-{snap}"))
        errors = [g for g in got if isinstance(g, Exception)]
        assert len(errors) == 1 and isinstance(errors[0], InvalidArgumentError), got
        assert "already exists" in str(errors[0])
        # The winner's folder alone remains, and it restores whole.
        folders = [n for n in a._backend.listdir(a._path("exports", f"keep-{snap}"))
                   if n.startswith("d-")]
        assert len(folders) == 1
        assert b.restore("t", name=f"keep-{snap}").table.sort_by("key").equals(tables[snap])
    assert [s.name for s in a.snapshots() if s.name] == [f"keep-{s}" for s in range(ROUNDS // 2)]
    a.delete_export("keep-0")
    assert not a._backend.exists(a._path("exports", "keep-0"))


def sink_writer(sink, execution=1, processor=0):
    ctx = ProcessorContext(job_id=9, execution_id=execution, vertex="sink", processor=processor,
                           processors=1, guarantee="exactly-once")
    return sink.open(ctx)


def test_two_writers_of_one_file_sink_transaction_one_commit_wins(s3):
    """A duplicated task: two writers of the same processor and execution, each with its
    own rows; of their racing commits one wins, the other is fenced, and the output is the
    winner's transaction whole."""
    _, endpoint = s3
    for _ in range(ROUNDS // 2):
        uri = f"{new_bucket(endpoint)}/out"
        sink = TransactionalFileSink(uri, rows_per_file=40, filesystem=s3_filesystem(endpoint))
        writers = [sink_writer(sink), sink_writer(sink)]
        rows = {0: pa.table({"id": pa.array(range(0, 100))}),
                1: pa.table({"id": pa.array(range(1000, 1100))})}
        for i, w in enumerate(writers):
            w.write(rows[i])
            w.prepare(0)
        got = race((writers[0].commit, 0), (writers[1].commit, 0))
        errors = [g for g in got if isinstance(g, Exception)]
        assert len(errors) == 1 and isinstance(errors[0], FencedError), got
        assert "committed it first" in str(errors[0])
        winner = got.index(None)
        out = TransactionalFileSink.read(uri, filesystem=s3_filesystem(endpoint))
        assert out.sort_by("id").equals(rows[winner])
        assert len(TransactionalFileSink.committed_files(uri, filesystem=sink.filesystem)) == 3
        staged = sink.filesystem.get_file_info(pafs.FileSelector(f"{uri}/_staging",
                                                                 recursive=True))
        assert [i.path for i in staged if i.type == pafs.FileType.File] == []


def test_a_transaction_is_read_whole_from_its_marker_until_recovery_copies_it(s3):
    """The state a crash right after the commit point leaves: the marker is written, no file
    is copied yet. Readers take the staged files; the recovery finishes the copy."""
    _, endpoint = s3
    uri, fs = f"{new_bucket(endpoint)}/out", s3_filesystem(endpoint)
    sink = TransactionalFileSink(uri, format="arrow", rows_per_file=25, filesystem=fs)
    w = sink_writer(sink)
    rows = pa.table({"id": pa.array(range(100))})
    w.write(rows)
    prepared = w.prepare(0)
    assert TransactionalFileSink.read(uri, filesystem=fs).num_rows == 0     # not committed
    txn = prepared["transactions"][0]
    w._mark_committed("", txn["writer"], txn["files"], txn)    # the commit point, then a crash
    assert TransactionalFileSink.committed_files(uri, filesystem=fs) == \
        [f"{uri}/{staged}" for staged, _ in txn["files"]]
    assert TransactionalFileSink.read(uri, filesystem=fs).sort_by("id").equals(rows)
    again = sink_writer(sink, execution=2)
    again.recover(0, prepared)
    assert TransactionalFileSink.committed_files(uri, filesystem=fs) == \
        [f"{uri}/{final}" for _, final in txn["files"]]
    assert TransactionalFileSink.read(uri, filesystem=fs).sort_by("id").equals(rows)


def test_guarantee_none_marks_each_rolled_file(s3):
    _, endpoint = s3
    uri, fs = f"{new_bucket(endpoint)}/out", s3_filesystem(endpoint)
    sink = TransactionalFileSink(uri, rows_per_file=30, filesystem=fs)
    ctx = ProcessorContext(job_id=9, execution_id=1, vertex="sink", processor=0, processors=1,
                           guarantee="none")
    w = sink.open(ctx)
    w.write(pa.table({"id": pa.array(range(100))}))
    w.close()
    markers = fs.get_file_info(pafs.FileSelector(f"{uri}/_committed", recursive=True))
    assert sorted(m.base_name for m in markers if m.type == pafs.FileType.File) == \
        [f"p00000-e000000000001-t000000-{k:05d}.json" for k in range(4)]
    assert TransactionalFileSink.read(uri, filesystem=fs).sort_by("id")["id"].to_pylist() == \
        list(range(100))


def test_a_store_without_conditional_create_warns():
    local = pafs.LocalFileSystem()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            backend = Backend("store", pafs.SubTreeFileSystem(d, local))
            backend.makedirs(backend.root)
            assert not backend.atomic_exclusive
            assert backend.create_exclusive(backend.path("x"), b"1")
            assert not backend.create_exclusive(backend.path("x"), b"2")
    assert caught and {w.category for w in caught} == {ObjectStoreRaceWarning}
    assert "two committers racing for one name can both succeed" in str(caught[0].message)


def test_job_on_s3_exactly_once_through_a_kill(s3, tmp_path, monkeypatch):
    """Snapshot store and file sink on S3 (by URI, credentials from the environment, as a
    member process gets them); the member is SIGKILLed and the job restarts from the last
    snapshot; the output is every event once."""
    _, endpoint = s3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    source = GeneratorSource(total=120_000, partitions=2, keys=500, batch_size=2_000,
                             rate=40_000)
    bucket = new_bucket(endpoint)
    out = s3_uri(f"{bucket}/out", endpoint)
    pipeline = (Pipeline().read_from(source)
                .filter(pc.field("value") < 700)
                .map_batches(lambda b: b.select(["id", "key"]))
                .write_to(TransactionalFileSink(out, rows_per_file=5_000)))
    config = JobConfig(name="s3-commits", snapshot_store=s3_uri(f"{bucket}/snaps", endpoint),
                       processing_guarantee="exactly-once", snapshot_interval=0.2,
                       local_parallelism=2, max_restarts=10, restart_backoff=0.05)
    result = run_with_kills(Job(pipeline, config), 1, seed=5)
    assert result.restarts >= 1
    events = source.events(0, 120_000)
    wanted = events.filter(pc.less(events["value"], 700))["id"]
    got = TransactionalFileSink.read(out)
    report = verify.check_events(wanted, wanted, got["id"])
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)
    markers = s3_filesystem(endpoint).get_file_info(
        pafs.FileSelector(f"{bucket}/out/_committed", recursive=True))
    assert [m for m in markers if m.type == pafs.FileType.File], "commits went through markers"
