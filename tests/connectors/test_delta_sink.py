"""The Delta Lake sink against real Delta tables on the local disk: rows visible only after
phase 2 and read back alike by the ``deltalake`` reader and by DuckDB (which reads the
Delta log and the Parquet files itself), recovery by the table's application transaction
versions at every crash point (including a process really killed between the snapshot's
commit and Delta's), zombie fencing, at-least-once and "none", clear errors for bad input,
and fault-campaign rounds with real SIGKILLs checked by :mod:`sparkjet.verify` against what
the table holds afterwards."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError

from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import ConnectorError, FencedError, InvalidArgumentError
from sparkjet.sinks import DeltaSink
from sparkjet.testing.campaign import run_round

JOB = 7
APP = f"sparkjet-{JOB:016x}"


def ctx(execution, processor=0, processors=1, guarantee="exactly-once"):
    return ProcessorContext(JOB, execution, "delta", processor, processors, guarantee)


def rows(ids, processor=0):
    return pa.record_batch({"id": pa.array(ids, pa.int64()),
                            "name": pa.array([f"n{i}" for i in ids]),
                            "processor": pa.array([processor] * len(ids), pa.int32())})


def opened(sink, context, snapshot=None, prepared=None):
    w = sink.open(context)
    w.recover(snapshot, prepared)
    return w


def ids(path):
    t = DeltaSink.read(path)
    return sorted(t.column("id").to_pylist()) if t.num_columns else []


def duckdb_read(path) -> pd.DataFrame:
    """The table as DuckDB reads it from the Delta log's JSON commits (the add actions,
    none removed by this sink) and their Parquet files: a reader that shares no code with
    delta-rs. (DuckDB's own delta extension needs a download, which CI may not allow.)"""
    con = duckdb.connect()
    files = [r[0] for r in con.execute(
        "SELECT \"add\".path FROM read_json_auto(?, union_by_name=true) "
        "WHERE \"add\" IS NOT NULL", [os.path.join(path, "_delta_log", "*.json")]).fetchall()]
    removed = con.execute(
        "SELECT count(*) FROM read_json_auto(?, union_by_name=true, columns={'remove': 'JSON'})"
        " WHERE remove IS NOT NULL", [os.path.join(path, "_delta_log", "*.json")]).fetchone()[0]
    assert removed == 0
    return con.execute("SELECT * FROM read_parquet(?)",
                       [[os.path.join(path, f) for f in files]]).df()


def test_rows_visible_only_after_phase_two_and_read_alike_by_deltalake_and_duckdb(tmp_path):
    path = str(tmp_path / "t")
    w = opened(DeltaSink(path), ctx(1))
    batches = [rows([1, 2, 3]), rows([4, 5]).to_pandas(), rows([6])]
    w.write(batches[0])
    w.write(pa.RecordBatch.from_pandas(batches[1], preserve_index=False))
    state = w.prepare(1)
    assert [(t["snapshot"], t["rows"]) for t in state["transactions"]] == [(1, 5)]
    assert not DeltaTable.is_deltatable(path), "nothing visible before phase 2"
    w.write(batches[2])
    state = w.prepare(2)
    assert [t["snapshot"] for t in state["transactions"]] == [1, 2], "uncommitted ones stay"
    w.commit(1)
    assert ids(path) == [1, 2, 3, 4, 5]
    w.commit(1)     # idempotent
    w.commit(2)
    w.close()
    reference = pd.concat([batches[0].to_pandas(), batches[1], batches[2].to_pandas()],
                          ignore_index=True)
    for got in (DeltaTable(path).to_pandas(), duckdb_read(path)):
        got = got.sort_values("id", ignore_index=True)
        pd.testing.assert_frame_equal(got, reference, check_dtype=False)
    dt = DeltaTable(path)
    assert dt.transaction_version(f"{APP}-p0") == 2
    assert dt.transaction_version(f"{APP}-p0-execution") == 1
    staged = tmp_path / "t" / "_sparkjet_staging"
    # committed files go at the next snapshot's phase 2; the last snapshot's stay while its
    # record is the one a run would restore
    listed = {t["file"].rsplit("/", 1)[1] for t in state["transactions"]}
    assert {f.name for f in staged.rglob("*.arrow")} == listed


def test_one_commit_per_phase_two_holds_every_due_snapshot(tmp_path):
    path = str(tmp_path / "t")
    w = opened(DeltaSink(path), ctx(1))
    for s in (1, 2, 3):
        w.write(rows([s]))
        w.prepare(s)
    w.prepare(4)        # an empty epoch stages nothing
    w.commit(4)
    dt = DeltaTable(path)
    assert dt.version() == 0 and len(dt.history()) == 1
    assert dt.transaction_version(f"{APP}-p0") == 3
    assert ids(path) == [1, 2, 3]
    w.close()


def test_types_round_trip(tmp_path):
    import datetime
    import decimal

    batch = pa.record_batch({
        "i8": pa.array([1, None], pa.int8()), "f32": pa.array([1.5, None], pa.float32()),
        "f64": [0.1, float("inf")], "s": ["a \"quoted\", line\nbreak", ""],
        "b": pa.array([b"\x00\xff", b""]), "flag": [True, None],
        "ts": pa.array([1_700_000_000_123_456, None], pa.timestamp("us", "UTC")),
        "d": pa.array([datetime.date(1999, 12, 31), None]),
        "dec": pa.array([decimal.Decimal("-12.34"), None], pa.decimal128(8, 2))})
    path = str(tmp_path / "t")
    w = opened(DeltaSink(path), ctx(1))
    w.write(batch)
    w.prepare(1)
    w.commit(1)
    w.write(batch)      # later batches are conformed to the table's schema
    w.prepare(2)
    w.commit(2)
    w.close()
    out = DeltaSink.read(path)
    assert out.to_pylist() == pa.Table.from_batches([batch, batch]).to_pylist()


def test_types_delta_lacks_are_written_as_the_nearest_delta_type(tmp_path):
    batch = pa.record_batch({
        "u32": pa.array([3_000_000_000, None], pa.uint32()),
        "u64": pa.array([2**63 - 1, 0], pa.uint64()),
        "ns": pa.array([1_700_000_000_123_456_789, None], pa.timestamp("ns")),
        "cat": pa.array(["x", "y"]).dictionary_encode()})
    path = str(tmp_path / "t")
    w = opened(DeltaSink(path), ctx(1))
    w.write(batch)
    with pytest.raises(InvalidArgumentError, match="column 'u64' \\(uint64\\) does not fit "
                                                   "the table's int64"):
        w.write(batch.set_column(1, "u64", pa.array([2**63, 0], pa.uint64())))
    w.prepare(1)
    w.commit(1)
    w.close()
    out = DeltaSink.read(path)
    assert out.schema == pa.schema([("u32", pa.int64()), ("u64", pa.int64()),
                                    ("ns", pa.timestamp("us")), ("cat", pa.string())])
    assert out.column("u32").to_pylist() == [3_000_000_000, None]
    assert out.column("u64").to_pylist() == [2**63 - 1, 0]
    assert out.column("ns").cast(pa.int64()).to_pylist() == [1_700_000_000_123_456, None]
    assert out.column("cat").to_pylist() == ["x", "y"]


@pytest.mark.parametrize("crash", ["before_commit", "after_delta_commit", "twice_in_recovery"])
def test_recovery_commits_each_prepared_snapshot_exactly_once(tmp_path, crash):
    path = str(tmp_path / "t")
    sink = DeltaSink(path)
    w = opened(sink, ctx(1))
    w.write(rows(range(0, 30)))
    w.prepare(1)
    w.commit(1)
    w.write(rows(range(30, 70)))
    state = json.loads(json.dumps(w.prepare(2)))
    w.write(rows(range(70, 75)))        # open, never prepared: the replay writes it again
    if crash == "after_delta_commit":
        # Delta committed, and the process died before deleting the staged file.
        staged = tmp_path / "t" / "_sparkjet_staging" / state["transactions"][0]["file"]
        kept = staged.read_bytes()
        w.commit(2)
        staged.write_bytes(kept)
    # The old process is gone without closing: a new execution restores snapshot 2.
    for e in [2, 3] if crash == "twice_in_recovery" else [2]:
        w2 = opened(sink, ctx(e), 2, state)
    assert ids(path) == list(range(70))
    w2.write(rows(range(70, 75)))
    w2.prepare(3)
    w2.commit(3)
    assert ids(path) == list(range(75))
    w2.close()
    left = (tmp_path / "t" / "_sparkjet_staging").rglob("*.arrow")
    assert all(f.name.endswith("-s3.arrow") for f in left), "only the last snapshot's stay"


_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import pyarrow as pa
    from sparkjet.connectors.base import ProcessorContext
    from sparkjet.sinks import DeltaSink

    path, crash = sys.argv[1], sys.argv[2]
    w = DeltaSink(path).open(ProcessorContext(7, 1, "delta", 0, 1, "exactly-once"))
    w.recover(None, None)
    for s, (lo, hi) in enumerate([(0, 30), (30, 70)], start=1):
        w.write(pa.record_batch({"id": pa.array(range(lo, hi), pa.int64())}))
        state = w.prepare(s)
        if s == 1:
            w.commit(1)
    # The snapshot holding `state` is complete: the coordinator would now run phase 2.
    print(json.dumps(state), flush=True)
    if crash == "after_delta_commit":
        w._commit_index(0, state["transactions"], w._staged.load)  # Delta's commit, no cleanup
    print("ready", flush=True)
    sys.stdin.readline()        # killed here
""")


@pytest.mark.parametrize("crash", ["before_delta_commit", "after_delta_commit"])
def test_a_process_killed_between_the_snapshot_and_the_delta_commit(tmp_path, crash):
    """A real process prepares snapshot 2 and is SIGKILLed before (or right after) Delta's
    commit; the next execution restores snapshot 2 from the saved state."""
    path = str(tmp_path / "t")
    # The child imports the sparkjet this process imports (an installed wheel in CI, where
    # pysrc/ holds no compiled module).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path, crash], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        state = json.loads(child.stdout.readline())
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert ids(path) == list(range(70 if crash == "after_delta_commit" else 30))
    w = opened(DeltaSink(path), ctx(2), 2, state)
    assert ids(path) == list(range(70))
    assert DeltaTable(path).transaction_version(f"{APP}-p0") == 2
    w.close()


def test_recovery_after_a_rescale_commits_every_old_processor(tmp_path):
    path = str(tmp_path / "t")
    sink = DeltaSink(path)
    old = [opened(sink, ctx(1, p, 3)) for p in range(3)]
    states = []
    for p, w in enumerate(old):
        w.write(rows([10 * p], p))
        states.append(w.prepare(1))
        w.write(rows([10 * p + 1], p))
        w.prepare(2)            # snapshot 2 never completes
    # Two processors now: old 0 and 2 go to new 0 (p % 2), old 1 to new 1; the runtime
    # merges their states by concatenating the transactions.
    merged0 = {"format": 1, "processors": 3,
               "transactions": states[0]["transactions"] + states[2]["transactions"]}
    new = [opened(sink, ctx(2, 0, 2), 1, merged0), opened(sink, ctx(2, 1, 2), 1, states[1])]
    assert ids(path) == [0, 10, 20]
    dt = DeltaTable(path)
    assert [dt.transaction_version(f"{APP}-p{p}-execution") for p in range(3)] == [2, 2, 2]
    # snapshot 2's files are gone; snapshot 1's stay while its record is the restorable one
    staged = tmp_path / "t" / "_sparkjet_staging"
    assert sorted(f.name for f in staged.rglob("*.arrow")) == ["e000000000001-s1.arrow"] * 3
    for w in new:
        w.close()
    assert len(list(staged.rglob("*.arrow"))) == 3, "kept while record 1 is the one to restore"


def test_a_zombie_of_an_older_execution_is_fenced(tmp_path):
    path = str(tmp_path / "t")
    sink = DeltaSink(path)
    zombie = opened(sink, ctx(1))
    zombie.write(rows([1]))
    state = zombie.prepare(1)
    newer = opened(sink, ctx(2), 1, state)     # commits snapshot 1 itself
    zombie.write(rows([2]))
    zombie.prepare(2)
    with pytest.raises(FencedError, match="Delta Lake sink.*execution 1 refused: "
                                          "execution 2 owns processor 0"):
        zombie.commit(2)
    with pytest.raises(FencedError):
        zombie.commit(1)
    assert ids(path) == [1]
    newer.close()


def test_a_zombie_that_read_the_table_before_the_fence_is_refused_by_delta(tmp_path):
    """The fence check and the commit are one step: a commit carrying the index's fence
    app id fails if a concurrent commit (the newer execution's recovery) changed it."""
    path = str(tmp_path / "t")
    sink = DeltaSink(path)
    zombie = opened(sink, ctx(1))
    zombie.write(rows([1]))
    zombie.prepare(1)
    zombie.commit(1)
    stale = DeltaTable(path)                    # the zombie's view, before the fence
    assert stale.transaction_version(f"{APP}-p0-execution") == 1
    opened(sink, ctx(2), 1, None).close()        # execution 2 fences processor 0
    with pytest.raises(CommitFailedError, match="Concurrent transaction"):
        write_deltalake(stale, pa.table(rows([2])), mode="append",
                        commit_properties=CommitProperties(app_transactions=[
                            Transaction(f"{APP}-p0-execution", 1),
                            Transaction(f"{APP}-p0", 2)]))
    assert ids(path) == [1]


@pytest.mark.parametrize("guarantee", ["at-least-once", "none"])
def test_without_exactly_once_rows_are_appended_without_staging(tmp_path, guarantee):
    path = str(tmp_path / "t")
    w = opened(DeltaSink(path), ctx(1, guarantee=guarantee))
    w.write(rows([1, 2]))
    assert w.prepare(1) is None
    assert ids(path) == ([1, 2] if guarantee == "at-least-once" else [])
    w.write(rows([3]))
    w.close()
    assert ids(path) == [1, 2, 3]
    assert not (tmp_path / "t" / "_sparkjet_staging").exists()
    # A replay after a restart appends again: at-least-once duplicates, never loses.
    w = opened(DeltaSink(path), ctx(2, guarantee=guarantee))
    w.write(rows([3]))
    w.close()
    assert ids(path) == [1, 2, 3, 3]


def test_none_appends_whenever_rows_per_commit_rows_are_buffered(tmp_path):
    path = str(tmp_path / "t")
    w = opened(DeltaSink(path, rows_per_commit=3), ctx(1, guarantee="none"))
    w.write(rows([1, 2]))
    assert ids(path) == []
    w.write(rows([3, 4]))
    assert ids(path) == [1, 2, 3, 4]
    w.close()


# -- bad input -----------------------------------------------------------------------------

def existing_table(path, schema):
    DeltaTable.create(path, schema=schema)


def test_a_batch_whose_column_type_does_not_match_the_table(tmp_path):
    path = str(tmp_path / "t")
    existing_table(path, pa.schema([("id", pa.int64()), ("name", pa.int64()),
                                    ("processor", pa.int32())]))
    w = opened(DeltaSink(path), ctx(1))
    with pytest.raises(InvalidArgumentError,
                       match=r"Delta Lake sink for table '.*t': column 'name' is string, "
                             "which cannot be written to the table's int64"):
        w.write(rows([1]))
    # Numbers in text are not numbers: no parsing, even where every value would parse.
    with pytest.raises(InvalidArgumentError, match="column 'name' is string"):
        w.write(rows([1]).set_column(1, "name", pa.array(["12"])))
    w.close()


def test_a_batch_with_other_columns_than_the_table(tmp_path):
    path = str(tmp_path / "t")
    existing_table(path, pa.schema([("id", pa.int64()), ("processor", pa.int32())]))
    w = opened(DeltaSink(path), ctx(1))
    with pytest.raises(InvalidArgumentError, match=r"not in the table: \['name'\]"):
        w.write(rows([1]))
    # The table created by the first commit fixes the schema for the later batches too.
    other = str(tmp_path / "u")
    w = opened(DeltaSink(other), ctx(1))
    w.write(rows([1]))
    with pytest.raises(InvalidArgumentError, match=r"missing \['processor'\]"):
        w.write(rows([2]).drop_columns(["processor"]))
    with pytest.raises(InvalidArgumentError, match="column 'processor' is list<item: int64>"):
        w.write(rows([2]).set_column(2, "processor", pa.array([[1]])))
    w.close()


def test_a_poison_record_names_the_column_and_the_value(tmp_path):
    path = str(tmp_path / "t")
    existing_table(path, pa.schema([pa.field("id", pa.int32(), nullable=False),
                                    ("name", pa.string()), ("processor", pa.int32())]))
    w = opened(DeltaSink(path), ctx(1))
    with pytest.raises(InvalidArgumentError) as e:
        w.write(rows([1, 2**40]))   # does not fit the existing int column
    message = str(e.value)
    assert message.startswith("Delta Lake sink for table")
    assert "column 'id'" in message and str(2**40) in message
    with pytest.raises(InvalidArgumentError, match="column 'id' is not nullable.*row 1"):
        w.write(rows([1, 2]).set_column(0, "id", pa.array([1, None], pa.int64())))
    w.write(rows([1, 2]))       # the good rows still go in
    w.prepare(1)
    w.commit(1)
    assert ids(path) == [1, 2]
    w.close()


def test_unwritable_storage_is_a_connector_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for guarantee in ("exactly-once", "at-least-once"):
        with pytest.raises(ConnectorError, match="Delta Lake sink for table '.*file/t': cannot"):
            DeltaSink(blocker / "t").open(ctx(1, guarantee=guarantee))


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="object store needs staging="):
        DeltaSink("s3://bucket/t")
    with pytest.raises(InvalidArgumentError, match="app_id"):
        DeltaSink(tmp_path, app_id="")
    with pytest.raises(InvalidArgumentError, match="rows_per_commit"):
        DeltaSink(tmp_path, rows_per_commit=0)
    with pytest.raises(InvalidArgumentError, match="uri"):
        DeltaSink("")
    with pytest.raises(InvalidArgumentError, match="guarantee"):
        DeltaSink(tmp_path).open(ctx(1, guarantee="twice"))
    w = opened(DeltaSink(tmp_path / "t"), ctx(1))
    with pytest.raises(InvalidArgumentError, match="prepared state has format"):
        w.recover(1, {"format": 99, "transactions": []})
    assert DeltaSink.read(tmp_path / "missing").num_columns == 0


# -- object stores (moto's S3 server) -----------------------------------------------------

@pytest.fixture(scope="module")
def s3():
    """moto's S3 API on 127.0.0.1, a free port, for this module, with a bucket "lake";
    yields its endpoint."""
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3_filesystem(f"{host}:{port}", allow_bucket_creation=True).create_dir("lake")
    yield f"{host}:{port}"
    server.stop()


def s3_filesystem(endpoint, **options):
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="x",
                             secret_key="x", region="us-east-1", connect_timeout=2,
                             request_timeout=5,
                             retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
                             **options)


def storage_options(endpoint, **extra):
    return {"AWS_ENDPOINT_URL": f"http://{endpoint}", "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
            **extra}


def test_a_table_on_s3_with_staging_on_s3(s3):
    uri, options = "s3://lake/t", storage_options(s3)
    sink = DeltaSink(uri, storage_options=options, staging="lake/staging/t",
                     staging_filesystem=s3_filesystem(s3))
    w = opened(sink, ctx(1))
    w.write(rows([1, 2]))
    state = json.loads(json.dumps(w.prepare(1)))
    staged = s3_filesystem(s3).get_file_info(pafs.FileSelector("lake/staging/t",
                                                               recursive=True))
    assert [f.base_name for f in staged if f.is_file] == ["e000000000001-s1.arrow"]
    assert DeltaSink.read(uri, storage_options=options).num_columns == 0
    w2 = opened(sink, ctx(2), 1, state)         # the first process died before phase 2
    w2.write(rows([3]))
    w2.prepare(2)
    w2.commit(2)
    w2.close()
    got = DeltaSink.read(uri, storage_options=options)
    assert sorted(got.column("id").to_pylist()) == [1, 2, 3]
    assert DeltaTable(uri, storage_options=options).transaction_version(f"{APP}-p0") == 2
    staged = s3_filesystem(s3).get_file_info(pafs.FileSelector("lake/staging/t",
                                                               recursive=True))
    # snapshot 1's file went at snapshot 2's phase 2; 2's stays while its record is the last
    assert [f.base_name for f in staged if f.is_file] == ["e000000000002-s2.arrow"]


def test_an_unreachable_object_store_is_a_connector_error_in_bounded_time():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))    # bound, not listening: connections are refused
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        sink = DeltaSink("s3://lake/t", staging="unused",
                         storage_options=storage_options(endpoint, max_retries="1"))
        start = time.monotonic()
        with pytest.raises(ConnectorError) as e:
            sink.open(ctx(1, guarantee="at-least-once"))
    assert time.monotonic() - start < 20
    message = str(e.value)
    assert message.startswith("Delta Lake sink for table 's3://lake/t': cannot read the table: ")
    assert "Connection refused" in message and "\x1b" not in message and "\n" not in message


# -- fault campaign --------------------------------------------------------------------------

#: (guarantee, pipeline, events): a windowed job's first rows reach the table about a second
#: after its first events (windows close, then a commit), so it runs longer to leave time for
#: its kills after that.
ROUNDS = [
    ("exactly-once", "events", 300_000),
    ("exactly-once", "windowed", 600_000),
    ("at-least-once", "events", 300_000),
]


def executions_that_appended(path) -> set:
    """The executions (the versions of the fence app ids) of the table's commits that
    added rows, read from the Delta log."""
    found = set()
    for name in sorted(os.listdir(os.path.join(path, "_delta_log"))):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(path, "_delta_log", name)) as f:
            actions = [json.loads(line) for line in f if line.strip()]
        if any("add" in a for a in actions):
            found |= {a["txn"]["version"] for a in actions
                      if "txn" in a and a["txn"]["appId"].endswith("-execution")}
    return found


@pytest.mark.slow
@pytest.mark.parametrize("guarantee,pipeline,events", ROUNDS)
def test_campaign_round_with_kills(tmp_path, capsys, guarantee, pipeline, events):
    rng = random.Random(f"{guarantee}-delta-{pipeline}")
    work = tmp_path / f"delta-{guarantee}-{pipeline}"
    # A member may take seconds to start on a loaded machine, and the sink commits after the
    # driver's snapshot event: each kill waits until its execution has added rows to the
    # table, so that every kill hits an execution that writes to it.
    table = work / "out.delta"

    def appended_rows(execution: int) -> bool:
        try:
            return execution in executions_that_appended(str(table))
        except (FileNotFoundError, json.JSONDecodeError):   # no table yet, or a log entry mid-write
            return False

    r = run_round(work, guarantee, "delta", pipeline, kills=2, rng=rng, events=events,
                  kill_after="snapshot", kill_when=appended_rows)
    appended = executions_that_appended(str(table))
    with capsys.disabled():
        print(f"\n{guarantee} delta {pipeline}: kills {r.kills} restarts {r.restarts} "
              f"lost {r.report.lost_count} duplicated {r.report.duplicated_count} "
              f"repeated windows {r.duplicate_rows} executions that appended "
              f"{sorted(appended)} ({r.seconds:.1f} s)")
    assert r.kills >= 1, "the round was too short to kill its member"
    assert len(appended) >= 2, "no kill hit an execution that had appended to the table"
    assert r.restarts >= r.kills
    assert not r.failures, r.failures
    assert r.report.lost_count == 0, str(r.report)
    if guarantee == "exactly-once":
        assert r.report.duplicated_count == 0 and r.duplicate_rows == 0, str(r.report)
        assert r.report.valid, str(r.report)
    else:
        assert r.report.valid_for("at-least-once"), str(r.report)
