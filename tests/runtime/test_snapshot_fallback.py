"""A damaged newest snapshot: the job falls back to the previous one (kept by
``retained_snapshots``) when no sink committed output past it, refuses with a clear error
when one did, and ``sparkjet snapshots rollback`` then goes back on purpose. Real jobs,
real files: a flipped byte in a chunk, a truncated log event."""
import re
import sqlite3
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from sparkjet import verify
from sparkjet.errors import SnapshotUnrestorableError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import SQLiteUpsertSink, TransactionalFileSink
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource

TOTAL = 1_000_000


def _source():
    return GeneratorSource(total=TOTAL, partitions=2, keys=200, batch_size=5_000, rate=200_000)


def _config(tmp_path, name):
    return JobConfig(name=name, snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.2,
                     local_parallelism=2)


def _counts_job(tmp_path, name="counts"):
    pipeline = (Pipeline().read_from(_source())
                .group_by("key").aggregate(count="count", sum=("sum", "value"))
                .write_to(SQLiteUpsertSink(tmp_path / "out.db", "counts", key="key")))
    return Job(pipeline, _config(tmp_path, name))


def _ids_job(tmp_path, name="ids"):
    pipeline = (Pipeline().read_from(_source()).map_batches(lambda b: b.select(["id"]))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    return Job(pipeline, _config(tmp_path, name))


def _run_and_stop(job, snapshots=4):
    """Runs ``job`` until it has taken ``snapshots`` snapshots, then stops it (a terminal
    snapshot): several complete snapshots, the newest two kept."""
    handle = job.submit(isolated=False)
    deadline = time.monotonic() + 120
    while (handle.metrics or {}).get("snapshots", 0) < snapshots:
        if handle.done():
            handle.result()     # raises the run's error
        assert time.monotonic() < deadline and not handle.done(), handle.metrics
        time.sleep(0.05)
    result = handle.stop(timeout=120)
    assert result.stopped and result.events_in < TOTAL
    store = SnapshotStore(job.config.snapshot_store, job.config.id, create=False)
    kept = [s.snapshot_id for s in store.complete()]
    assert len(kept) == 2, kept
    return kept


def _newest_dir(tmp_path, job) -> Path:
    job_dir = tmp_path / "snaps" / f"job-{job.config.id:016x}"
    return max((job_dir / "snapshots").iterdir())


def _flip_a_byte(snapshot_dir: Path, vertex: str) -> Path:
    chunk = max((snapshot_dir / vertex).glob("*.chunks"), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) - 10] ^= 0x40    # inside the last chunk's payload
    chunk.write_bytes(bytes(data))
    return chunk


def _truncate_newest_commit(tmp_path, job) -> Path:
    log = tmp_path / "snaps" / f"job-{job.config.id:016x}" / "log"
    newest = max(log.glob("*.json"))
    assert b'"commit"' in newest.read_bytes()
    newest.write_bytes(newest.read_bytes()[:25])
    return newest


def _source_vertex(snapshot_dir: Path) -> str:
    names = sorted(p.name for p in snapshot_dir.iterdir() if p.is_dir())
    assert "source" in names, names
    return "source"


def _sqlite_counts(tmp_path) -> pa.Table:
    with sqlite3.connect(tmp_path / "out.db") as db:
        rows = db.execute('SELECT key, "count", "sum" FROM counts').fetchall()
    return pa.table({"key": [r[0] for r in rows], "count": [r[1] for r in rows],
                     "sum": [r[2] for r in rows]})


@pytest.mark.parametrize("damage", ["flipped byte", "truncated log event"])
def test_a_damaged_newest_snapshot_falls_back_and_stays_exactly_once(tmp_path, damage):
    job = _counts_job(tmp_path)
    previous, newest = _run_and_stop(job)
    if damage == "flipped byte":
        snapshot_dir = _newest_dir(tmp_path, job)
        vertex = next(p.name for p in snapshot_dir.iterdir()
                      if p.is_dir() and p.name == "aggregate")
        _flip_a_byte(snapshot_dir, vertex)
    else:
        _truncate_newest_commit(tmp_path, job)
    events = []
    result = _counts_job(tmp_path).run(isolated=False, on_progress=events.append)
    assert [f["to"] for f in result.fallbacks] == [previous], result.fallbacks
    assert not result.fallbacks[0]["explicit"]
    if damage == "flipped byte":
        assert result.fallbacks[0]["replaced"] == [newest]
        assert f"snapshot {newest}: SnapshotCorruptError" in result.fallbacks[0]["unusable"][0]
    else:
        assert "does not read" in result.fallbacks[0]["unusable"][0]
    assert [e["to"] for e in events if e["event"] == "fallback"] == [previous]
    restored = [e["snapshot"] for e in events if e["event"] == "restored"]
    assert restored == [previous]
    # The idempotent sink overwrote what the replay wrote again: exactly the expected state.
    report = verify.check_aggregates(_source().expected_counts(), _sqlite_counts(tmp_path),
                                     key="key", columns=["count", "sum"])
    assert report.valid, str(report)


def test_a_sink_that_committed_past_the_fallback_refuses_then_rollback_replays(tmp_path,
                                                                                capsys):
    from sparkjet.cli.main import main

    job = _ids_job(tmp_path)
    previous, newest = _run_and_stop(job)
    snapshot_dir = _newest_dir(tmp_path, job)
    _flip_a_byte(snapshot_dir, _source_vertex(snapshot_dir))
    committed = TransactionalFileSink.read(tmp_path / "out").num_rows
    with pytest.raises(SnapshotUnrestorableError) as e:
        _ids_job(tmp_path).run(isolated=False)
    error = e.value
    message = str(error)
    assert f"newest snapshot {newest} failed to verify" in message
    assert f"falling back to snapshot {previous} would replay" in message
    assert error.fallback == previous and len(error.replayed) == 1
    assert error.replayed[0].startswith("sink ") and f"snapshot(s) [{newest}]" in \
        error.replayed[0]
    replayed_rows = int(re.search(r"\((\d+) rows\)", error.replayed[0]).group(1))
    assert replayed_rows > 0
    assert f"sparkjet snapshots rollback {tmp_path / 'snaps'} --job ids --to {previous}" \
        in message
    # Refused before any execution: the store and the output are as they were.
    assert TransactionalFileSink.read(tmp_path / "out").num_rows == committed
    # Going back on purpose, accepting the duplicates.
    assert main(["snapshots", "rollback", str(tmp_path / "snaps"), "--job", "ids",
                 "--to", str(previous)]) == 0
    assert f"snapshots [{newest}] set aside" in capsys.readouterr().out
    result = _ids_job(tmp_path).run(isolated=False)
    assert result.fallbacks == []
    ids = pa.array(np.arange(TOTAL))
    report = verify.check_events(ids, ids, TransactionalFileSink.read(tmp_path / "out")["id"])
    # Nothing lost; exactly the rows of the replayed transactions are there twice.
    assert report.lost_count == 0 and report.unexpected_count == 0, str(report)
    assert report.duplicated_count == replayed_rows, str(report)


def test_initial_snapshot_id_rolls_back_once(tmp_path):
    job = _ids_job(tmp_path, "again")
    previous, newest = _run_and_stop(job)
    config = JobConfig(**{**job.config.to_dict(), "initial_snapshot": previous})
    pipeline = (Pipeline().read_from(_source()).map_batches(lambda b: b.select(["id"]))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    result = Job(pipeline, config).run(isolated=False)
    assert [(f["to"], f["explicit"], f["replaced"]) for f in result.fallbacks] == \
        [(previous, True, [newest])]
    store = SnapshotStore(config.snapshot_store, config.id, create=False)
    assert store.rollbacks() == [previous]


def test_a_member_start_reads_the_newest_snapshot_once(tmp_path, monkeypatch):
    """A member's start checks the newest snapshot by the restore that reads it, not by a whole read
    before it (at 50M keys that read cost 1.5 s of a recovery): every keyed chunk is read
    once (broadcast state: once per processor), and the job goes on from it exactly."""
    from sparkjet.snapshot import store as store_module
    job = _counts_job(tmp_path)
    _, newest = _run_and_stop(job)
    reads = []
    real = store_module.read_file

    def counted(store, stored, vertex, vid, f, wanted=None):
        for header, payload, path, offset in real(store, stored, vertex, vid, f, wanted):
            if header.partition >= 0:   # (broadcast chunks go to every processor)
                reads.append((stored.record.snapshot_id, path, offset))
            yield header, payload, path, offset
    monkeypatch.setattr(store_module, "read_file", counted)
    # what a member does at a restart after a kill; a run's first start also has the
    # driver check the snapshot before any execution (Job._check_snapshot), left out here
    monkeypatch.setattr(Job, "_check_snapshot", lambda self: None)
    events = []
    result = _counts_job(tmp_path).run(isolated=False, on_progress=events.append)
    assert not result.fallbacks
    assert [e["snapshot"] for e in events if e["event"] == "restored"] == [newest]
    chunks = [r for r in reads if r[0] == newest]
    twice = {r for r in chunks if chunks.count(r) > 1}
    assert chunks and not twice, sorted(twice)[:5]
    report = verify.check_aggregates(_source().expected_counts(), _sqlite_counts(tmp_path),
                                     key="key", columns=["count", "sum"])
    assert report.valid, str(report)
