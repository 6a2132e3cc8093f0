"""The directory source: Parquet, CSV and JSON-lines files read exactly once, new files
picked up while a job runs, restores at the right file and row, rescales, member kills,
a real S3 API (moto's server on 127.0.0.1), and clear errors for bad input."""
import io
import json
import os
import re
import socket
import threading
import time

import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from helpers.jobs import run_killed_once, run_with_kills
from helpers.s3_server import s3_filesystem

from sparkjet import verify
from sparkjet.connectors.base import ProcessorContext
from sparkjet.connectors.files.source import partition_of
from sparkjet.errors import (
    ConnectorError,
    CorruptDataError,
    InvalidArgumentError,
    SchemaMismatchError,
    SourceChangedError,
)
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.failures import is_deterministic
from sparkjet.runtime.snapshotting import merge_states
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import DirectorySource

CTX = ProcessorContext(job_id=1, execution_id=1, vertex="source", processor=0, processors=1)
SCHEMA = pa.schema([("id", pa.int64()), ("key", pa.int64()), ("value", pa.float64()),
                    ("name", pa.string())])
FORMATS = ["parquet", "csv", "jsonl"]


def rows_of(ids) -> pa.Table:
    ids = pa.array(list(ids), pa.int64())
    return pa.table({"id": ids,
                     "key": pa.array([i % 7 for i in ids.to_pylist()], pa.int64()),
                     "value": pa.array([i * 0.5 for i in ids.to_pylist()], pa.float64()),
                     "name": pa.array([f"n{i}" for i in ids.to_pylist()], pa.string())})


def write_file(root, rel, fmt, table, filesystem=None, row_group_size=None):
    """Writes ``table`` as ``rel`` under ``root`` the way the source needs: under a hidden
    name first, renamed when complete (on an object store: one whole PUT)."""
    if filesystem is not None:
        path = f"{root}/{rel}"
        with filesystem.open_output_stream(path) as out:
            _encode(out, fmt, table, row_group_size)
        return
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as out:
        _encode(out, fmt, table, row_group_size)
    os.rename(tmp, path)


def _encode(out, fmt, table, row_group_size):
    if fmt == "parquet":
        pq.write_table(table, out, row_group_size=row_group_size)
    elif fmt == "csv":
        pcsv.write_csv(table, out)
    else:
        out.write("".join(json.dumps(r) + "\n" for r in table.to_pylist()).encode())


def make_dir(root, fmt, files=6, rows=250, row_group_size=64):
    """``files`` files of ``rows`` rows each, some in a subdirectory; returns all ids."""
    os.makedirs(root, exist_ok=True)
    for f in range(files):
        rel = f"part-{f:03d}.{fmt}" if f % 2 else f"sub/part-{f:03d}.{fmt}"
        write_file(root, rel, fmt, rows_of(range(f * rows, (f + 1) * rows)),
                   row_group_size=row_group_size)
    return list(range(files * rows))


def drain(reader, max_rows=100, limit=100_000):
    out = []
    for _ in range(limit):
        if reader.at_end():
            return out
        batch = reader.read(max_rows)
        if batch is not None:
            out.append(batch)
    raise AssertionError("the reader never reached its end")


def ids_of(batches):
    return [i for b in batches for i in b.column("id").to_pylist()]


def roundtrip(state):
    return json.loads(json.dumps(state))


# -- reading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_once_against_pandas(tmp_path, fmt):
    want_ids = make_dir(tmp_path / "in", fmt)
    (tmp_path / "in" / "_SUCCESS").write_text("")          # not data: starts with _
    (tmp_path / "in" / ".part-9.tmp").write_text("junk")    # not data: hidden
    (tmp_path / "in" / "README.txt").write_text("junk")     # not data: another suffix
    source = DirectorySource(tmp_path / "in", fmt, schema=SCHEMA, partitions=3, batch_size=70)
    reader = source.open([0, 1, 2], CTX)
    batches = []
    while not reader.at_end():
        batch = reader.read(1000)
        if batch is None:
            continue
        assert batch.num_rows <= 70 and batch.schema.equals(SCHEMA)
        # Every batch comes from one file of the partition last_partition names.
        files = {f"sub/part-{i // 250:03d}.{fmt}" if (i // 250) % 2 == 0
                 else f"part-{i // 250:03d}.{fmt}" for i in batch.column("id").to_pylist()}
        assert len(files) == 1 and partition_of(files.pop(), 3) == reader.last_partition()
        batches.append(batch)
    got = pa.Table.from_batches(batches).to_pandas().sort_values("id").reset_index(drop=True)
    want = rows_of(want_ids).to_pandas()
    pd.testing.assert_frame_equal(got, want)
    assert reader.read(100) is None


def test_files_spread_over_partitions_by_path_alone(tmp_path):
    make_dir(tmp_path / "in", "parquet", files=12, rows=10)
    source = DirectorySource(tmp_path / "in", partitions=4)
    per_reader = {p: ids_of(drain(source.open([p], CTX))) for p in range(4)}
    assert sorted(sum(per_reader.values(), [])) == list(range(120))
    assert sum(1 for ids in per_reader.values() if ids) >= 3   # not all in one partition
    for p, ids in per_reader.items():
        files = {i // 10 for i in ids}
        rels = [f"sub/part-{f:03d}.parquet" if f % 2 == 0 else f"part-{f:03d}.parquet"
                for f in files]
        assert all(partition_of(r, 4) == p for r in rels)


def test_schema_of_the_first_file_without_a_declared_one(tmp_path):
    make_dir(tmp_path / "in", "csv", files=3, rows=20)
    batches = drain(DirectorySource(tmp_path / "in", "csv").open([0, 1, 2, 3], CTX))
    assert {b.schema for b in batches} == {SCHEMA}
    assert sorted(ids_of(batches)) == list(range(60))


def test_a_declared_schema_selects_and_casts_columns(tmp_path):
    make_dir(tmp_path / "in", "parquet", files=2, rows=5)
    schema = pa.schema([("value", pa.float32()), ("id", pa.int32())])
    table = pa.Table.from_batches(drain(
        DirectorySource(tmp_path / "in", schema=schema, partitions=1).open([0], CTX)))
    assert table.schema.equals(schema)
    assert sorted(table.column("id").to_pylist()) == list(range(10))


# -- replay ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cut", [0, 1, 4, 9, 17])
def test_restore_resumes_at_the_file_and_row(tmp_path, fmt, cut):
    want = make_dir(tmp_path / "in", fmt, files=5, rows=100, row_group_size=30)
    source = DirectorySource(tmp_path / "in", fmt, schema=SCHEMA, partitions=2, batch_size=23)
    reader = source.open([0, 1], CTX)
    seen = []
    for _ in range(cut):
        batch = reader.read(1000)
        if batch is not None:
            seen.append(batch)
    state = roundtrip(reader.snapshot_state())
    reader.close()
    again = source.open([0, 1], CTX)
    again.restore_state(state)
    rest = ids_of(drain(again, max_rows=41))
    assert sorted(ids_of(seen) + rest) == want


def test_restore_at_every_row_of_a_parquet_file(tmp_path):
    write_file(tmp_path / "in", "a.parquet", "parquet", rows_of(range(50)), row_group_size=7)
    source = DirectorySource(tmp_path / "in", partitions=1)
    for row in range(51):
        reader = source.open([0], CTX)
        reader.restore_state({"files": {"0": {"done": [], "watermark": None,
                                              "file": "a.parquet", "row": row}}})
        assert ids_of(drain(reader, max_rows=9)) == list(range(row, 50))


def test_rescale_merged_states_restore_at_any_parallelism(tmp_path):
    want = make_dir(tmp_path / "in", "parquet", files=10, rows=40)
    source = DirectorySource(tmp_path / "in", partitions=4, batch_size=15)
    a, b = source.open([0, 2], CTX), source.open([1, 3], CTX)
    seen = []
    for _ in range(5):
        for r in (a, b):
            batch = r.read(100)
            if batch is not None:
                seen.append(batch)
    merged = merge_states([roundtrip(a.snapshot_state()), roundtrip(b.snapshot_state())])
    for layout in ([[0, 1, 2, 3]], [[0], [1], [2, 3]], [[3], [2], [1], [0]]):
        rest = []
        for parts in layout:
            r = source.open(parts, CTX)
            r.restore_state(merged)
            rest += ids_of(drain(r))
        assert sorted(ids_of(seen) + rest) == want, layout
    with pytest.raises(InvalidArgumentError, match="no position for directory source partition 1"):
        source.open([1], CTX).restore_state(a.snapshot_state())


def test_new_files_are_picked_up_and_restored_over(tmp_path):
    root = tmp_path / "in"
    write_file(root, "b.csv", "csv", rows_of(range(0, 10)))
    source = DirectorySource(root, "csv", schema=SCHEMA, partitions=1, watch=True,
                             poll_interval=0, end_marker="_DONE")
    reader = source.open([0], CTX)
    got = ids_of([reader.read(100)])
    assert reader.read(100) is None and not reader.at_end()
    write_file(root, "a.csv", "csv", rows_of(range(10, 20)))    # sorts before b.csv: still read
    got += ids_of([reader.read(100)])
    state = roundtrip(reader.snapshot_state())
    # a.csv is returned whole, but it is done only once a read finds its end.
    stamp = state["files"]["0"].pop("stamp")
    assert state["files"]["0"] == {"done": ["b.csv"], "watermark": None, "file": "a.csv",
                                   "row": 10}
    assert stamp == [os.path.getsize(root / "a.csv"), os.stat(root / "a.csv").st_mtime_ns]
    state["files"]["0"]["stamp"] = stamp
    write_file(root, "c.csv", "csv", rows_of(range(20, 30)))
    (root / "_DONE").write_text("")
    again = source.open([0], CTX)
    again.restore_state(state)
    got += ids_of(drain(again))
    assert sorted(got) == list(range(30)) and again.at_end()


def test_files_removed_after_they_are_read_leave_the_state(tmp_path):
    root = tmp_path / "in"
    write_file(root, "a.parquet", "parquet", rows_of(range(10)))
    source = DirectorySource(root, partitions=1, watch=True, poll_interval=0)
    reader = source.open([0], CTX)
    assert ids_of([reader.read(100)]) == list(range(10)) and reader.read(100) is None
    assert reader.snapshot_state()["files"]["0"]["done"] == ["a.parquet"]
    os.remove(root / "a.parquet")
    write_file(root, "b.parquet", "parquet", rows_of(range(10, 20)))
    assert ids_of([reader.read(100)]) == list(range(10, 20))
    assert reader.read(100) is None
    assert reader.snapshot_state()["files"]["0"]["done"] == ["b.parquet"]


# -- files that change under the job (issue 26) ------------------------------------------------


def read_40(root, fmt):
    """A reader that returned rows 0..39 of ``a.<fmt>`` (100 rows), its state, its source."""
    write_file(root, f"a.{fmt}", fmt, rows_of(range(100)), row_group_size=30)
    source = DirectorySource(root, fmt, schema=SCHEMA, partitions=1, batch_size=40)
    reader = source.open([0], CTX)
    assert ids_of([reader.read(1000)]) == list(range(40))
    return reader, roundtrip(reader.snapshot_state()), source


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("change", [range(1000, 1100), range(20), range(150)],
                         ids=["rewritten", "truncated", "appended"])
def test_a_file_changed_under_a_resumed_job(tmp_path, fmt, change):
    """Before, a restore skipped 40 rows of whatever the file held now and went on."""
    root = tmp_path / "in"
    reader, state, source = read_40(root, fmt)
    reader.close()
    write_file(root, f"a.{fmt}", fmt, rows_of(change), row_group_size=30)
    again = source.open([0], CTX)
    again.restore_state(state)
    with pytest.raises(SourceChangedError, match=rf"directory source: .*/in/a\.{fmt} changed "
                                                 r"since the job read its first 40 rows \("):
        drain(again)
    again.close()


def test_a_file_deleted_under_a_resumed_job(tmp_path):
    root = tmp_path / "in"
    reader, state, source = read_40(root, "parquet")
    reader.close()
    os.remove(root / "a.parquet")
    again = source.open([0], CTX)
    again.restore_state(state)
    with pytest.raises(SourceChangedError, match=r"a\.parquet is gone after the job read 40 of "
                                                 r"its rows: files must not be removed") as e:
        drain(again)
    assert is_deterministic(e.value)


def test_a_listed_file_deleted_before_it_is_read(tmp_path):
    root = tmp_path / "in"
    reader, _, _ = read_40(root, "csv")
    reader.close()
    write_file(root, "b.csv", "csv", rows_of(range(100, 110)))
    source = DirectorySource(root, "csv", schema=SCHEMA, partitions=1, batch_size=40)
    reader = source.open([0], CTX)
    reader.read(10)                     # lists a.csv and b.csv
    os.remove(root / "b.csv")
    with pytest.raises(SourceChangedError, match=r"b\.csv is gone before the job read it"):
        drain(reader)
    reader.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_replaced_while_it_is_read(tmp_path, fmt):
    root = tmp_path / "in"
    reader, _, _ = read_40(root, fmt)
    write_file(root, f"a.{fmt}", fmt, rows_of(range(1000, 1100)), row_group_size=30)
    with pytest.raises(SourceChangedError, match=rf"a\.{fmt} changed while the job read its "
                                                 r"rows \(size"):
        drain(reader)
    reader.close()


def test_a_file_shorter_than_an_older_state_says(tmp_path):
    """A state saved before the stamp existed: the row count still tells a shrunk file."""
    write_file(tmp_path / "in", "a.parquet", "parquet", rows_of(range(50)), row_group_size=7)
    reader = DirectorySource(tmp_path / "in", partitions=1).open([0], CTX)
    reader.restore_state({"files": {"0": {"done": [], "watermark": None,
                                          "file": "a.parquet", "row": 80}}})
    with pytest.raises(SourceChangedError, match=r"a\.parquet holds fewer rows than the 80 the "
                                                 r"job had read of it"):
        drain(reader)


def test_a_reader_without_partitions_is_at_its_end(tmp_path):
    assert DirectorySource(tmp_path / "nowhere", watch=True).open([], CTX).at_end()


def test_ordered_names_keep_a_watermark_and_refuse_a_late_file(tmp_path):
    root = tmp_path / "in"
    for f in range(3):
        write_file(root, f"2026-01-0{f + 1}.parquet", "parquet", rows_of(range(f * 10, f * 10 + 10)))
    source = DirectorySource(root, partitions=1, watch=True, poll_interval=0,
                             ordered_names=True)
    reader = source.open([0], CTX)
    got = ids_of([reader.read(100) for _ in range(3)])
    assert reader.read(100) is None     # finds the end of the third file
    state = roundtrip(reader.snapshot_state())
    assert state["files"]["0"] == {"done": [], "watermark": "2026-01-03.parquet",
                                   "file": None, "row": 0}
    write_file(root, "2026-01-04.parquet", "parquet", rows_of(range(30, 40)))
    again = source.open([0], CTX)
    again.restore_state(state)
    got += ids_of([again.read(100)])
    assert sorted(got) == list(range(40)) and again.read(100) is None
    write_file(root, "2026-01-00.parquet", "parquet", rows_of(range(40, 50)))
    with pytest.raises(InvalidArgumentError, match="2026-01-00.parquet appeared after "
                                                   "2026-01-04.parquet was read"):
        again.read(100)


# -- jobs ------------------------------------------------------------------------------------


def copy_job(source, out, name, guarantee="exactly-once", parallelism=2, restarts=0, snaps=None):
    pipeline = Pipeline().read_from(source).write_to(TransactionalFileSink(out))
    config = JobConfig(name=name, processing_guarantee=guarantee,
                       snapshot_store=str(snaps or out.parent / "snaps"), snapshot_interval=0.1,
                       local_parallelism=parallelism, max_restarts=restarts,
                       restart_backoff=0.05)
    return Job(pipeline, config)


def check_once(want, out, guarantee="exactly-once"):
    got = TransactionalFileSink.read(out)
    report = verify.check_events(want, want, got["id"])
    assert report.lost_count == 0, str(report)
    if guarantee == "exactly-once":
        assert report.duplicated_count == 0 and report.valid, str(report)
    return got


@pytest.mark.parametrize("fmt", FORMATS)
def test_job_reads_every_file_exactly_once(tmp_path, fmt):
    want = make_dir(tmp_path / "in", fmt, files=8, rows=300)
    source = DirectorySource(tmp_path / "in", fmt, schema=SCHEMA, partitions=4, batch_size=100)
    result = copy_job(source, tmp_path / "out", f"files-{fmt}").run(isolated=False)
    assert result.events_in == len(want)
    got = check_once(want, tmp_path / "out")
    expected = rows_of(want).to_pandas()
    pd.testing.assert_frame_equal(
        got.select(SCHEMA.names).to_pandas().sort_values("id").reset_index(drop=True), expected)


def feed(root, fmt, files, rows, pause, marker="_DONE", filesystem=None):
    """Writes ``files`` files of ``rows`` rows, ``pause`` seconds apart, then the end marker;
    returns the thread and every id it writes."""
    def run():
        for f in range(files):
            write_file(root, f"f-{f:04d}.{fmt}", fmt, rows_of(range(f * rows, (f + 1) * rows)),
                       filesystem=filesystem)
            time.sleep(pause)
        if filesystem is None:
            (root / marker).write_text("")
        else:
            with filesystem.open_output_stream(f"{root}/{marker}"):
                pass

    if filesystem is None:
        os.makedirs(root, exist_ok=True)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, list(range(files * rows))


def test_job_picks_up_files_as_they_appear(tmp_path):
    thread, want = feed(tmp_path / "in", "parquet", files=15, rows=200, pause=0.05)
    source = DirectorySource(tmp_path / "in", partitions=3, watch=True, poll_interval=0.02,
                             end_marker="_DONE")
    copy_job(source, tmp_path / "out", "files-watch").run(isolated=False)
    thread.join()
    check_once(want, tmp_path / "out")


@pytest.mark.parametrize("guarantee,store", [("exactly-once", "local"),
                                             ("at-least-once", "local"),
                                             ("exactly-once", "s3")])
def test_job_survives_kill_9(tmp_path, request, guarantee, store):
    if store == "s3":
        fs, endpoint = request.getfixturevalue("s3")
        root, reading = f"lake/kill-{guarantee}", s3_filesystem(endpoint)
    else:
        fs, root, reading = None, tmp_path / "in", None
    thread, want = feed(root, "csv", files=40, rows=500, pause=0.12, filesystem=fs)
    source = DirectorySource(root, "csv", schema=SCHEMA, partitions=4, watch=True,
                             poll_interval=0.05, end_marker="_DONE", batch_size=200,
                             filesystem=reading)
    job = copy_job(source, tmp_path / "out", f"files-kill-{guarantee}", guarantee, restarts=20)
    result = run_with_kills(job, 2, seed=11)
    thread.join()
    assert result.restarts >= 1
    check_once(want, tmp_path / "out", guarantee)


def test_job_rescales_after_a_kill(tmp_path):
    thread, want = feed(tmp_path / "in", "parquet", files=30, rows=300, pause=0.1)
    source = DirectorySource(tmp_path / "in", partitions=4, watch=True, poll_interval=0.05,
                             end_marker="_DONE", batch_size=100)
    snaps = tmp_path / "snaps"
    run_killed_once(copy_job(source, tmp_path / "out", "files-rescale", parallelism=2,
                             snaps=snaps), snaps, after=2)
    result = copy_job(source, tmp_path / "out", "files-rescale", parallelism=3,
                      snaps=snaps).run()
    thread.join()
    assert result.executions[0]["restored_from"] is not None
    check_once(want, tmp_path / "out")


# -- S3 (moto's server) ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_job_reads_s3_exactly_once(tmp_path, s3, fmt):
    fs, endpoint = s3
    want = []
    for f in range(5):
        ids = range(f * 200, (f + 1) * 200)
        write_file(f"lake/{fmt}-in", f"day={f % 2}/f-{f}.{fmt}", fmt, rows_of(ids), filesystem=fs)
        want += ids
    source = DirectorySource(f"lake/{fmt}-in", fmt, schema=SCHEMA, partitions=3,
                             filesystem=s3_filesystem(endpoint))
    assert repr(source).startswith(f"DirectorySource('s3:lake/{fmt}-in'")
    copy_job(source, tmp_path / "out", f"files-s3-{fmt}").run()    # a member process
    check_once(want, tmp_path / "out")


def test_s3_by_uri_and_restore(s3, monkeypatch):
    fs, endpoint = s3
    for f in range(3):
        write_file("lake/uri-in", f"f-{f}.parquet", "parquet",
                   rows_of(range(f * 50, (f + 1) * 50)), filesystem=fs, row_group_size=20)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    source = DirectorySource(f"s3://lake/uri-in?endpoint_override={endpoint}&scheme=http"
                             "&region=us-east-1", partitions=2, batch_size=15)
    reader = source.open([0, 1], CTX)
    seen = ids_of([reader.read(100) for _ in range(4)])
    again = source.open([0, 1], CTX)
    again.restore_state(roundtrip(reader.snapshot_state()))
    assert sorted(seen + ids_of(drain(again))) == list(range(150))


# -- bad input -------------------------------------------------------------------------------


def test_unreachable_endpoint_is_a_connector_error_in_bounded_time():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))    # bound, not listening: connections are refused
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        source = DirectorySource("lake/in", filesystem=s3_filesystem(endpoint))
        start = time.monotonic()
        with pytest.raises(ConnectorError, match="directory source: cannot list s3:lake/in"):
            source.open([0, 1, 2, 3], CTX).at_end()
    assert time.monotonic() - start < 20


def test_missing_bucket_or_directory(tmp_path, s3):
    fs, endpoint = s3
    with pytest.raises(ConnectorError, match="directory source: cannot list s3:nobucket/in.*"
                                             "bucket does not exist"):
        DirectorySource("nobucket/in", filesystem=fs).open([0], CTX).at_end()
    with pytest.raises(InvalidArgumentError, match="directory source: s3:lake/nothing-here "
                                                   "does not exist"):
        DirectorySource("lake/nothing-here", filesystem=fs).open([0], CTX).at_end()
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        DirectorySource(tmp_path / "nope").open([0], CTX).at_end()
    # A watching source waits for the directory to appear.
    reader = DirectorySource(tmp_path / "later", watch=True).open([0], CTX)
    assert not reader.at_end() and reader.read(10) is None


def test_wrong_credentials_are_a_connector_error(s3, monkeypatch):
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    fs, endpoint = s3
    write_file("lake/auth-in", "a.parquet", "parquet", rows_of(range(3)), filesystem=fs)
    # From now on this moto server checks every request's access key (it knows none).
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    source = DirectorySource("lake/auth-in", filesystem=s3_filesystem(endpoint))
    with pytest.raises(ConnectorError, match="directory source: cannot list s3:lake/auth-in: "
                                             ".*Access Key Id you provided does not exist"):
        source.open([0], CTX).at_end()


def test_a_file_without_a_column_of_the_schema(tmp_path):
    make_dir(tmp_path / "in", "parquet", files=2, rows=5)
    schema = SCHEMA.append(pa.field("price", pa.float64()))
    with pytest.raises(SchemaMismatchError, match=r"directory source: .*part-00\d\.parquet has "
                                                  r"no column 'price'"):
        drain(DirectorySource(tmp_path / "in", schema=schema).open([0, 1, 2, 3], CTX))
    make_dir(tmp_path / "csv", "csv", files=1, rows=5)
    with pytest.raises(SchemaMismatchError, match=r"part-000\.csv: Column 'price'"):
        drain(DirectorySource(tmp_path / "csv", "csv", schema=schema).open([0, 1, 2, 3], CTX))


def test_a_column_that_does_not_cast(tmp_path):
    make_dir(tmp_path / "in", "parquet", files=1, rows=5)
    schema = pa.schema([("name", pa.int64())])
    with pytest.raises(SchemaMismatchError, match=r"part-000\.parquet: column 'name' is string, "
                                                  "which does not cast to the schema's int64"):
        drain(DirectorySource(tmp_path / "in", schema=schema).open([0, 1, 2, 3], CTX))


def test_a_later_file_that_does_not_match_the_first(tmp_path):
    root = tmp_path / "in"
    write_file(root, "a.parquet", "parquet", rows_of(range(5)))
    write_file(root, "b.parquet", "parquet", rows_of(range(5, 10)).drop_columns(["key"]))
    with pytest.raises(SchemaMismatchError, match=r"b\.parquet has no column 'key'"):
        drain(DirectorySource(root).open([0, 1, 2, 3], CTX))


@pytest.mark.parametrize("fmt,poison,line,column", [
    ("csv", "id,key,value,name\n1,1,0.5,n1\n2,2,x,n2\n", 3, "value"),
    ("csv", "id,key,value,name\n1,1,0.5,n1\n2,2,1.0,n2,extra\n", 3, None),
    ("jsonl", '{"id": 1, "key": 1, "value": 0.5, "name": "n1"}\n{"id": 2, "key": \n', 2, None),
])
def test_a_poison_record_names_the_file_and_line(tmp_path, fmt, poison, line, column):
    root = tmp_path / "in"
    write_file(root, f"good.{fmt}", fmt, rows_of(range(100, 110)))
    os.makedirs(root, exist_ok=True)
    (root / f"bad.{fmt}").write_text(poison)
    what = f"column '{column}' does not convert" if column else "the record does not parse"
    with pytest.raises(CorruptDataError, match=rf"^{tmp_path}/in/bad\.{fmt} line {line}: {what}"):
        drain(DirectorySource(root, fmt, schema=SCHEMA, partitions=1).open([0], CTX))


# -- poison records: on_error of the source ---------------------------------------------------

#: Lines that do not parse, by format: (the line, the column at fault or None)
POISON_LINES = {
    "csv": [('x7,7,3.5,"n7"', "id"), ('8,1,lots,"n8"', "value"), ("9,2", None)],
    "jsonl": [('{"id": 7, "key": 7, "value": "lots", "name": "n7"}', "value"),
              ("{not json", None), ('{"id": "x8", "key": 1}', "id")],
}


def poisoned_dir(root, fmt, big_rows=60_000):
    """CSV or JSON-lines files whose lines ``POISON_LINES`` break: one in a small file, two
    in a big one (past its first block, so good blocks come before them). Returns the good
    ids and the bad lines' {(file, line number): (line, column)}."""
    os.makedirs(root, exist_ok=True)
    good, bad = [], {}
    poison = POISON_LINES[fmt]
    plan = {"sub/small." + fmt: (range(0, 50), {20: poison[0]}),
            "big." + fmt: (range(1000, 1000 + big_rows), {big_rows - 100: poison[1],
                                                         big_rows - 5: poison[2]}),
            "clean." + fmt: (range(100_000, 100_040), {})}
    for rel, (ids, inserts) in plan.items():
        buffer = io.BytesIO()
        _encode(buffer, fmt, rows_of(ids), None)
        lines = buffer.getvalue().decode().splitlines()
        head = 1 if fmt == "csv" else 0
        for at, (line, _) in sorted(inserts.items(), reverse=True):
            lines.insert(head + at, line)
        for line, column in inserts.values():
            bad[(rel, lines.index(line) + 1)] = (line, column)
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        good.extend(ids)
    return sorted(good), bad


def poison_job(tmp_path, fmt, on_error, name):
    source = DirectorySource(tmp_path / "in", fmt, schema=SCHEMA, partitions=3)
    pipeline = (Pipeline().read_from(source, on_error=on_error)
                .write_to(TransactionalFileSink(tmp_path / "out")))
    return Job(pipeline, JobConfig(name=name, snapshot_store=str(tmp_path / "snaps"),
                                   local_parallelism=2))


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_a_record_that_does_not_parse_fails_the_job_naming_file_line_and_column(tmp_path, fmt):
    from sparkjet.errors import BadRecordError, MemberFailedError

    _, bad = poisoned_dir(tmp_path / "in", fmt)
    with pytest.raises(MemberFailedError) as e:
        poison_job(tmp_path, fmt, "fail", f"files-poison-fail-{fmt}").run(isolated=False)
    assert isinstance(e.value.__cause__, BadRecordError) and e.value.__cause__.deterministic
    message = str(e.value)
    where = "|".join(
        re.escape(f"{tmp_path}/in/{rel} line {n}: ") +
        (f"column '{column}' does not convert to" if column else "the record does not parse")
        for (rel, n), (_, column) in bad.items())
    assert re.search(rf"source \(DirectorySource\('{tmp_path}/in'.*\): ({where})", message), message


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_skipped_records_leave_the_good_ones(tmp_path, fmt):
    good, bad = poisoned_dir(tmp_path / "in", fmt)
    result = poison_job(tmp_path, fmt, "skip", f"files-poison-skip-{fmt}").run(isolated=False)
    out = TransactionalFileSink.read(tmp_path / "out")
    assert sorted(out.column("id").to_pylist()) == good
    assert result.skipped_events == len(bad) == 3 and result.dead_letters == 0


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_records_that_do_not_parse_go_to_the_dead_letters_with_file_and_line(tmp_path, fmt):
    from sparkjet.sinks import DEAD_LETTER_SCHEMA

    good, bad = poisoned_dir(tmp_path / "in", fmt)
    dead = TransactionalFileSink(tmp_path / "dead")
    result = poison_job(tmp_path, fmt, dead, f"files-poison-dead-{fmt}").run(isolated=False)
    assert sorted(TransactionalFileSink.read(tmp_path / "out").column("id").to_pylist()) == good
    letters = TransactionalFileSink.read(tmp_path / "dead")
    assert letters.schema.equals(DEAD_LETTER_SCHEMA, check_metadata=False)
    rows = sorted(letters.to_pylist(), key=lambda r: r["position"])
    assert [(r["position"], r["offset"], r["record"].decode(), r["column"]) for r in rows] == \
        sorted((f"{tmp_path}/in/{rel} line {n}", n, line, column)
               for (rel, n), (line, column) in bad.items())
    for r in rows:
        assert r["stage"] == "source" and r["format"] == "raw"
        want = (f"column '{r['column']}' does not convert to {SCHEMA.field(r['column']).type}: "
                if r["column"] else "the record does not parse: ")
        assert r["reason"].startswith(want), r["reason"]
    assert result.dead_letters == len(bad)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_a_restore_past_a_bad_record_neither_reports_it_again_nor_loses_a_row(tmp_path, fmt):
    """The position counts a record that did not parse as a row of its file: a reader
    restored from a snapshot taken after it goes on after it, without reporting it again
    (its dead letter was committed with that snapshot)."""
    good, bad = poisoned_dir(tmp_path / "in", fmt)
    source = DirectorySource(tmp_path / "in", fmt, schema=SCHEMA, partitions=1,
                             batch_size=500)
    reader, seen, reported = source.open([0], CTX), [], []
    reader.on_bad_record = reported.append
    states = []
    while not reader.at_end():
        batch = reader.read(500)
        if batch is not None:
            seen.extend(batch.column("id").to_pylist())
        states.append((reader.snapshot_state(), len(seen), len(reported)))
    assert sorted(seen) == good and len(reported) == len(bad)
    # restore from each snapshot taken just after a bad record was reported
    after = [s for s, before in zip(states, [(None, 0, 0), *states]) if s[2] > before[2]]
    assert len(after) == len(bad)
    for state, rows, letters in after:
        again = source.open([0], CTX)
        more = []
        again.on_bad_record = more.append
        again.restore_state(state)
        ids = seen[:rows]
        while not again.at_end():
            batch = again.read(500)
            if batch is not None:
                ids.extend(batch.column("id").to_pylist())
        assert sorted(ids) == good
        assert [r.position for r in reported[:letters] + more] == [r.position for r in reported]


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="format must be one of"):
        DirectorySource(tmp_path, "xml")
    with pytest.raises(InvalidArgumentError, match="schema must be a pyarrow.Schema"):
        DirectorySource(tmp_path, schema={"id": "int64"})
    with pytest.raises(InvalidArgumentError, match="end_marker ends a watching source"):
        DirectorySource(tmp_path, end_marker="_DONE")
    with pytest.raises(InvalidArgumentError, match="partitions"):
        DirectorySource(tmp_path, partitions=0)
    with pytest.raises(InvalidArgumentError, match="not a usable URI"):
        DirectorySource("s3://bucket/x?nonsense=1").open([0], CTX).at_end()
    hidden = DirectorySource("s3://AKIA:s3cret@bucket/x?secret_key=s3cret")
    assert "s3cret" not in repr(hidden) and "AKIA:***@bucket" in repr(hidden)
    with pytest.raises(InvalidArgumentError, match="'files'"):
        DirectorySource(tmp_path, partitions=1).open([0], CTX).restore_state({"offsets": {}})
