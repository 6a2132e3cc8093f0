"""The PostgreSQL sink against a real server (tests/helpers/postgres_server.py: Debian's binaries,
``initdb`` in a temporary directory): two-phase commit visible only after phase 2,
recovery by the snapshot's record (also after a rescale), zombie fencing, upserts by key,
clear errors for bad input, and fault-campaign rounds with real SIGKILLs of the member,
checked with :mod:`sparkjet.verify` against what the server holds afterwards."""
import os
import random
import re

import psycopg
import pyarrow as pa
import pytest
from helpers import postgres_server
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import (
    ConnectorError,
    FencedError,
    InvalidArgumentError,
    NullKeyError,
    UnsupportedTypeError,
)
from sparkjet.sinks import PostgresSink
from sparkjet.testing.campaign import run_round

JOB = 7


@pytest.fixture(scope="session")
def server():
    """One server for the session. Without the binaries (and no way to install them) the
    tests are skipped, except in CI (.ci/run installs them and sets SPARKJET_CI=1), where
    they fail."""
    try:
        s = postgres_server.start()
    except postgres_server.PostgresServerMissing as e:
        missing = str(e)
    else:
        yield s
        s.stop()
        return
    if os.environ.get("SPARKJET_CI"):
        pytest.fail(missing, pytrace=False)
    pytest.skip(missing)


@pytest.fixture
def table(server, request):
    name = request.node.name.replace("[", "-").replace("]", "")[:60]
    PostgresSink.drop(server.dsn, name)
    return name


def ctx(execution, processor=0, processors=1, guarantee="exactly-once"):
    return ProcessorContext(JOB, execution, "sink", processor, processors, guarantee)


def rows(ids, processor=0):
    return pa.record_batch({"id": pa.array(ids, pa.int64()),
                            "name": pa.array([f"n{i}" for i in ids]),
                            "processor": pa.array([processor] * len(ids), pa.int32())})


def ids(server, table):
    return sorted(PostgresSink.read(server.dsn, table).column("id").to_pylist())


def prepared_ids(server):
    with psycopg.connect(server.dsn) as con:
        return sorted(r[0] for r in con.execute("SELECT gid FROM pg_prepared_xacts"))


def opened(sink, context, snapshot=None, prepared=None):
    w = sink.open(context)
    w.recover(snapshot, prepared)
    return w


# -- transactional mode ------------------------------------------------------------------

def test_rows_visible_only_after_commit_prepared(server, table):
    sink = PostgresSink(server.dsn, table)
    w = opened(sink, ctx(1))
    w.write(rows([1, 2, 3]))
    state = w.prepare(1)
    assert [t["gid"] for t in state["transactions"]] == [
        f"sparkjet:{JOB:016x}:{table}:e1:s1:p0"]
    assert ids(server, table) == []
    assert prepared_ids(server) == [state["transactions"][0]["gid"]]
    w.write(rows([4]))
    state = w.prepare(2)
    assert [t["snapshot"] for t in state["transactions"]] == [1, 2], "uncommitted ones stay"
    w.commit(1)
    assert ids(server, table) == [1, 2, 3]
    w.commit(1)     # idempotent
    w.commit(2)
    assert ids(server, table) == [1, 2, 3, 4]
    assert w.prepare(3)["transactions"] == []
    w.close()
    assert prepared_ids(server) == []


def test_types_round_trip(server, table):
    import datetime
    import decimal

    batch = pa.record_batch({
        "i8": pa.array([1, None], pa.int8()), "u64": pa.array([2**64 - 1, 0], pa.uint64()),
        "f32": pa.array([1.5, None], pa.float32()), "f64": [0.1, float("inf")],
        "s": ["a \"quoted\", line\nbreak", ""], "null_s": pa.array([None, "x"]),
        "b": pa.array([b"\x00\xff", b""]), "flag": [True, None],
        "ts": pa.array([1_700_000_000_123_456_000, None], pa.timestamp("ns", "UTC")),
        "naive": pa.array([datetime.datetime(2024, 2, 29, 12, 0, 1), None]),
        "d": pa.array([datetime.date(1999, 12, 31), None]),
        "dec": pa.array([decimal.Decimal("-12.34"), None], pa.decimal128(8, 2)),
        "cat": pa.array(["x", "y"]).dictionary_encode()})
    w = opened(PostgresSink(server.dsn, table), ctx(1))
    w.write(batch)
    w.prepare(1)
    w.commit(1)
    w.close()
    out = PostgresSink.read(server.dsn, table)
    assert out.schema.equals(batch.schema)
    assert out.to_pylist() == pa.Table.from_batches([batch]).to_pylist()


def test_recover_commits_the_snapshots_transactions_and_rolls_back_the_rest(server, table):
    sink = PostgresSink(server.dsn, table)
    w = opened(sink, ctx(1))
    w.write(rows([1]))
    snapshot = w.prepare(1)
    w.write(rows([2]))
    w.prepare(2)        # never completes: the member dies before phase 2
    w.write(rows([3]))  # open, never prepared
    del w               # killed: its open transaction ends with its connection
    w2 = opened(sink, ctx(2), 1, snapshot)
    assert ids(server, table) == [1]
    assert prepared_ids(server) == []
    w2.write(rows([2, 3]))
    w2.prepare(2)
    w2.commit(2)
    w2.close()
    assert ids(server, table) == [1, 2, 3]


def test_recover_after_a_rescale_takes_the_old_processors_it_owns(server, table):
    sink = PostgresSink(server.dsn, table)
    old = [opened(sink, ctx(1, p, 3)) for p in range(3)]
    states = []
    for p, w in enumerate(old):
        w.write(rows([10 * p], p))
        states.append(w.prepare(1))
        w.write(rows([10 * p + 1], p))
        w.prepare(2)            # snapshot 2 never completes
    # Two processors now: old 0 and 2 go to new 0 (p % 2), old 1 to new 1; the runtime
    # merges their states by concatenating the transactions.
    merged0 = {"format": 1, "transactions": states[0]["transactions"] + states[2]["transactions"]}
    new = [opened(sink, ctx(2, 0, 2), 1, merged0), opened(sink, ctx(2, 1, 2), 1, states[1])]
    assert ids(server, table) == [0, 10, 20]
    assert prepared_ids(server) == []
    for w in new:
        w.close()


def test_a_zombie_cannot_prepare_or_commit_after_a_newer_execution(server, table):
    sink = PostgresSink(server.dsn, table)
    zombie = opened(sink, ctx(1))
    zombie.write(rows([1]))
    zombie.prepare(1)
    zombie.write(rows([2]))
    # Execution 2 restores no snapshot: it rolls back the zombie's prepared transaction,
    # which otherwise holds the fence row, and registers.
    newer = opened(sink, ctx(2))
    with pytest.raises(FencedError, match="PostgreSQL sink.*execution 2 is newer"):
        zombie.prepare(2)
    with pytest.raises(FencedError):
        zombie.commit(1)
    newer.write(rows([5]))
    newer.prepare(1)
    newer.commit(1)
    assert ids(server, table) == [5]
    zombie.close()
    newer.close()


def test_a_zombie_preparing_during_recovery_is_rolled_back(server, table):
    """The zombie prepares after the new execution's recovery listed the prepared
    transactions: the share lock it holds makes the registration wait, and the retry rolls
    it back."""
    sink = PostgresSink(server.dsn, table)
    zombie = opened(sink, ctx(1))
    newer = sink.open(ctx(2))
    newer._abort_leftovers()        # recovery's listing: nothing prepared yet
    zombie.write(rows([1]))
    zombie.prepare(1)
    newer.recover(None, None)       # registers: waits, rolls the zombie's back, registers
    assert prepared_ids(server) == []
    with pytest.raises(FencedError):
        zombie.commit(1)
    assert ids(server, table) == []
    zombie.close()
    newer.close()


@pytest.mark.parametrize("guarantee", ["at-least-once", "none"])
def test_without_exactly_once_rows_are_committed_early(server, table, guarantee):
    w = opened(PostgresSink(server.dsn, table), ctx(1, guarantee=guarantee))
    w.write(rows([1, 2]))
    if guarantee == "none":
        assert ids(server, table) == [1, 2]
    else:
        assert ids(server, table) == []
        assert w.prepare(1) is None
        assert ids(server, table) == [1, 2]
    w.close()
    assert prepared_ids(server) == []


# -- upsert mode -------------------------------------------------------------------------

def test_upserts_keep_the_last_row_of_each_key_and_replays_overwrite(server, table):
    sink = PostgresSink(server.dsn, table, mode="upsert", key=["k"])
    w = opened(sink, ctx(1))
    w.write(pa.record_batch({"k": [1, 2, 1], "v": ["a", "b", "c"]}))
    with pytest.raises(InvalidArgumentError, match="no table"):   # buffered until the barrier
        PostgresSink.read(server.dsn, table)
    w.prepare(1)
    w.write(pa.record_batch({"k": [2, 3], "v": ["z", "y"]}))
    w.close()
    w = opened(sink, ctx(2), 1)
    w.write(pa.record_batch({"k": [2, 3], "v": ["z", "y"]}))   # the replay
    w.close()
    out = PostgresSink.read(server.dsn, table)
    assert out.to_pydict() == {"k": [1, 2, 3], "v": ["c", "z", "y"]}


def test_upsert_flush_mixing_inserts_and_updates(server, table):
    """One flush that updates existing keys (one of them twice) and inserts new ones, on a
    two-column key, with every type of the round-trip test as values."""
    import datetime
    import decimal

    def batch(keys, tag):
        n = len(keys)
        return pa.record_batch({
            "a": pa.array([k[0] for k in keys], pa.int32()), "b": [k[1] for k in keys],
            "tag": [f"{tag}{i}" for i in range(n)],
            "u64": pa.array([2**64 - 1] * n, pa.uint64()), "f64": [float("inf")] * n,
            "s": ["a \"quoted\", line\nbreak"] * n, "null_s": pa.array([None] * n, pa.string()),
            "bin": pa.array([b"\x00\xff"] * n), "flag": [True] * n,
            "ts": pa.array([1_700_000_000_123_456_000] * n, pa.timestamp("ns", "UTC")),
            "d": pa.array([datetime.date(1999, 12, 31)] * n),
            "dec": pa.array([decimal.Decimal("-12.34")] * n, pa.decimal128(8, 2))})

    sink = PostgresSink(server.dsn, table, mode="upsert", key=["a", "b"])
    w = opened(sink, ctx(1))
    w.write(batch([(1, "x"), (2, "x"), (3, "x")], "first"))
    w.prepare(1)
    w.write(batch([(2, "x"), (4, "x"), (2, "x")], "second"))
    w.write(batch([(1, "y"), (3, "x")], "third"))
    w.prepare(2)
    w.close()
    out = PostgresSink.read(server.dsn, table)
    assert [(r["a"], r["b"], r["tag"]) for r in out.to_pylist()] == [
        (1, "x", "first0"), (1, "y", "third0"), (2, "x", "second2"), (3, "x", "third1"),
        (4, "x", "second1")]
    values = {k: v for k, v in batch([(0, "")], "").to_pylist()[0].items()
              if k not in ("a", "b", "tag")}
    assert all({k: r[k] for k in values} == values for r in out.to_pylist())
    assert out.schema.equals(batch([(0, "")], "").schema)


def test_upsert_of_key_columns_only(server, table):
    sink = PostgresSink(server.dsn, table, mode="upsert", key="k")
    w = opened(sink, ctx(1))
    w.write(pa.record_batch({"k": [3, 1, 3]}))
    w.prepare(1)
    w.write(pa.record_batch({"k": [1, 2]}))
    w.close()
    assert PostgresSink.read(server.dsn, table).to_pydict() == {"k": [1, 2, 3]}


def test_upsert_waits_for_a_concurrent_insert_of_the_same_key(server, table):
    """Another session inserts key 2 and commits while the flush waits on it: the flush
    overwrites it instead of failing with a unique violation."""
    import threading
    import time

    sink = PostgresSink(server.dsn, table, mode="upsert", key="k")
    w = opened(sink, ctx(1))
    w.write(pa.record_batch({"k": [1], "v": ["a"]}))
    w.prepare(1)
    with psycopg.connect(server.dsn) as other:
        other.execute(f'INSERT INTO "{table}" (k, v) VALUES (2, \'other\')')
        w.write(pa.record_batch({"k": [1, 2, 3], "v": ["b", "mine", "c"]}))
        flush = threading.Thread(target=w.prepare, args=(2,))
        flush.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not other.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND application_name LIKE 'sparkjet %'").fetchall():
            time.sleep(0.05)
        other.commit()
        flush.join(30)
    assert not flush.is_alive()
    w.close()
    assert PostgresSink.read(server.dsn, table).to_pydict() == {
        "k": [1, 2, 3], "v": ["b", "mine", "c"]}


def test_upsert_into_a_table_with_rules(server, table):
    """MERGE refuses a table with rules; ON CONFLICT takes one without INSERT or UPDATE
    rules."""
    with psycopg.connect(server.dsn) as con:
        con.execute(f'CREATE TABLE "{table}" (k bigint PRIMARY KEY, v text)')
        con.execute(f'CREATE RULE audit AS ON DELETE TO "{table}" DO ALSO NOTIFY deletes')
    w = opened(PostgresSink(server.dsn, table, mode="upsert", key="k"), ctx(1))
    for v in ("a", "b"):
        w.write(pa.record_batch({"k": [1, 2], "v": [v, v]}))
        w.prepare(1 if v == "a" else 2)
    w.close()
    assert PostgresSink.read(server.dsn, table).to_pydict() == {"k": [1, 2], "v": ["b", "b"]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", ""]),
                          st.sampled_from([0.0, -0.0, 1.5, float("nan")])), max_size=30),
       st.sampled_from([["i"], ["s", "i"], ["f"], ["i", "s", "f"]]), st.booleans())
def test_last_row_per_key_matches_a_python_reference(values, keys, dictionary):
    """The last row of each key in write order, in key order (no server needed). Keys equal
    for PostgreSQL are one key: -0.0 and 0.0, two NaNs."""
    from sparkjet.connectors.postgres.upsert import _last_per_key

    strings = pa.array([v[1] for v in values], pa.string())
    table = pa.table({"i": pa.array([v[0] for v in values], pa.int64()),
                      "s": strings.dictionary_encode() if dictionary else strings,
                      "f": pa.array([v[2] for v in values], pa.float64()),
                      "row": pa.array(range(len(values)), pa.int64())})
    table = pa.concat_tables([table.slice(0, len(values) // 2), table.slice(len(values) // 2)])

    def pg_key(row):
        return tuple("nan" if k == "f" and row[k] != row[k] else row[k] + 0.0 if k == "f"
                     else row[k] for k in keys)

    last = {}
    for row in table.to_pylist():
        last[pg_key(row)] = row["row"]
    out = _last_per_key(table, keys).to_pylist()
    assert sorted(r["row"] for r in out) == sorted(last.values())
    order = [pg_key(r) for r in out]
    assert order == sorted(order, key=lambda k: tuple(
        (1, 0) if v == "nan" else (0, v) for v in k))


def test_upsert_zombie_is_fenced(server, table):
    sink = PostgresSink(server.dsn, table, mode="upsert", key="k")
    zombie = opened(sink, ctx(1))
    newer = opened(sink, ctx(2))
    newer.write(pa.record_batch({"k": [1], "v": ["new"]}))
    newer.close()
    zombie.write(pa.record_batch({"k": [1], "v": ["old"]}))
    with pytest.raises(FencedError, match="PostgreSQL sink.*execution 2 is newer"):
        zombie.prepare(1)
    assert PostgresSink.read(server.dsn, table).to_pydict() == {"k": [1], "v": ["new"]}
    zombie.close()


def test_upsert_refuses_a_null_key(server, table):
    w = opened(PostgresSink(server.dsn, table, mode="upsert", key="k"), ctx(1))
    with pytest.raises(NullKeyError, match="PostgreSQL sink: key column 'k'.*row 1") as e:
        w.write(pa.record_batch({"k": [1, None], "v": ["a", "b"]}))
    assert e.value.index == 1
    w.close()


def test_upsert_needs_a_unique_index_on_the_key(server, table):
    with psycopg.connect(server.dsn) as con:
        con.execute(f'CREATE TABLE "{table}" (k bigint, v text)')
    w = opened(PostgresSink(server.dsn, table, mode="upsert", key="k"), ctx(1))
    w.write(pa.record_batch({"k": [1], "v": ["a"]}))
    with pytest.raises(InvalidArgumentError, match="no PRIMARY KEY or UNIQUE index.*'k'"):
        w.prepare(1)
    w._buffer = []
    w.close()


# -- bad input -----------------------------------------------------------------------------

def test_unreachable_server():
    with socket_bound() as port:
        sink = PostgresSink(f"host=127.0.0.1 port={port} user=u password=hunter2 dbname=d "
                            "connect_timeout=2", "t")
        with pytest.raises(ConnectorError) as e:
            sink.open(ctx(1))
    message = str(e.value)
    assert message.startswith("PostgreSQL sink: cannot connect to 127.0.0.1:")
    assert "unreachable" in message and "hunter2" not in message


def test_wrong_credentials(server):
    dsn = server.dsn.replace(server.password, "wrong-password")
    with pytest.raises(ConnectorError) as e:
        PostgresSink(dsn, "t").open(ctx(1))
    message = str(e.value)
    assert "PostgreSQL sink" in message and "authentication failed" in message
    assert 'user "postgres"' in message and "wrong-password" not in message
    assert "wrong-password" not in repr(PostgresSink(dsn, "t"))


def test_a_table_whose_column_type_does_not_match(server, table):
    with psycopg.connect(server.dsn) as con:
        con.execute(f'CREATE TABLE "{table}" (id bigint, name bigint, processor int)')
    w = opened(PostgresSink(server.dsn, table), ctx(1))
    with pytest.raises(InvalidArgumentError,
                       match="column 'name' of table .* is int8, which cannot take .* string"):
        w.write(rows([1]))
    w.close()


def test_a_table_without_a_column_of_the_batch(server, table):
    with psycopg.connect(server.dsn) as con:
        con.execute(f'CREATE TABLE "{table}" (id bigint, processor int)')
    w = opened(PostgresSink(server.dsn, table), ctx(1))
    with pytest.raises(InvalidArgumentError, match="has no column 'name'"):
        w.write(rows([1]))
    w.close()


def test_a_poison_record_names_the_row_and_column(server, table):
    with psycopg.connect(server.dsn) as con:
        con.execute(f'CREATE TABLE "{table}" (id integer, name text, processor int)')
    w = opened(PostgresSink(server.dsn, table), ctx(1))
    with pytest.raises(InvalidArgumentError) as e:
        w.write(rows([1, 2**40]))   # does not fit the existing integer column
    message = str(e.value)
    assert message.startswith("PostgreSQL sink")
    assert "out of range" in message and "line 2, column id" in message
    w.close()


def test_the_writer_finds_the_rows_postgres_would_refuse(server, table):
    with psycopg.connect(server.dsn) as con:
        con.execute(f'CREATE TABLE "{table}" (k text PRIMARY KEY, small smallint, v bigint)')
    w = opened(PostgresSink(server.dsn, table, mode="upsert", key="k"), ctx(1))
    batch = pa.record_batch({"k": ["a", "b\x00c", None, "d"],
                             "small": pa.array([1, 2, 3, 40_000], pa.int32()),
                             "v": pa.array([1, 2, 3, 4], pa.int64())})
    refused = sorted((r.row, r.column, r.reason) for r in w.refused(batch))
    assert refused == [
        (1, "k", "value 'b\\x00c' holds a NUL character (\\x00), which PostgreSQL text cannot hold"),
        (2, "k", "a null in a key column, which an upsert cannot key by"),
        (3, "small", "value 40000 is out of the range of the table's int2 column")]
    assert w.refused(batch.slice(0, 1)) == []
    w.close()


def nul_keys(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Events keyed by a text ``name``; one in 499 has a NUL character in it."""
    ids = batch["id"].to_numpy()
    names = [f"n{i}\x00x" if i % 499 == 7 else f"n{i}" for i in ids.tolist()]
    return pa.RecordBatch.from_arrays([pa.array(names), batch["id"]], ["name", "id"])


NUL_TOTAL = 6_000


def nul_job(server, table, tmp_path, on_error, name, **config):
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sources import GeneratorSource

    source = GeneratorSource(total=NUL_TOTAL, partitions=2, keys=10, batch_size=1_000)
    pipeline = (Pipeline().read_from(source).map_batches(nul_keys)
                .write_to(PostgresSink(server.dsn, table, mode="upsert", key="name"),
                          on_error=on_error))
    return Job(pipeline, JobConfig(name=name, snapshot_store=str(tmp_path / "snaps"),
                                   local_parallelism=2, **config))


def _bad_nul_ids():
    return [i for i in range(NUL_TOTAL) if i % 499 == 7]


def test_a_nul_character_in_a_key_fails_naming_sink_column_and_row(server, table, tmp_path):
    from sparkjet.errors import BadRecordError, MemberFailedError

    with pytest.raises(MemberFailedError) as e:
        nul_job(server, table, tmp_path, None, "pg-nul-fail").run(isolated=False)
    assert isinstance(e.value.__cause__, BadRecordError) and e.value.__cause__.deterministic
    message = str(e.value)
    assert re.search(r"sink \(PostgresSink\(.*\): row \d+ of its batch: column 'name': value "
                     r"'n\d+\\x00x' holds a NUL character", message), message


def test_skipped_nul_keys_leave_the_good_rows_in_postgres(server, table, tmp_path):
    result = nul_job(server, table, tmp_path, "skip", "pg-nul-skip").run(isolated=False)
    got = PostgresSink.read(server.dsn, table)
    bad = set(_bad_nul_ids())
    assert sorted(got.column("id").to_pylist()) == [i for i in range(NUL_TOTAL) if i not in bad]
    assert result.skipped_events == len(bad)


def test_nul_keys_go_to_the_dead_letters(server, table, tmp_path):
    import json

    from sparkjet.sinks import TransactionalFileSink

    dead = TransactionalFileSink(tmp_path / "dead")
    result = nul_job(server, table, tmp_path, dead, "pg-nul-dead").run(isolated=False)
    assert len(PostgresSink.read(server.dsn, table)) == NUL_TOTAL - len(_bad_nul_ids())
    letters = TransactionalFileSink.read(tmp_path / "dead").to_pylist()
    assert sorted(json.loads(r["record"])["id"] for r in letters) == _bad_nul_ids()
    for r in letters:
        assert (r["stage"], r["column"], r["format"]) == ("sink", "name", "json")
        assert "holds a NUL character" in r["reason"]
    assert result.dead_letters == len(_bad_nul_ids())


def test_unsupported_type_names_the_column(server, table):
    w = opened(PostgresSink(server.dsn, table), ctx(1))
    with pytest.raises(UnsupportedTypeError, match="column 'l'"):
        w.write(pa.record_batch({"l": pa.array([[1]])}))
    w.close()


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="key="):
        PostgresSink("host=x", "t", mode="upsert")
    with pytest.raises(InvalidArgumentError, match="mode"):
        PostgresSink("host=x", "t", mode="merge")
    with pytest.raises(InvalidArgumentError, match="table name"):
        PostgresSink("host=x", "x" * 101)


class socket_bound:
    """A loopback port nothing listens on (bound, not listening, while the test runs)."""

    def __enter__(self):
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc):
        self.s.close()


# -- fault campaign --------------------------------------------------------------------------

ROUNDS = [
    ("exactly-once", "postgres", "events"),
    ("exactly-once", "postgres", "windowed"),
    ("exactly-once", "postgres-upsert", "keyed"),
    ("at-least-once", "postgres", "events"),
    ("at-least-once", "postgres-upsert", "windowed"),
]


@pytest.mark.slow
@pytest.mark.parametrize("guarantee,sink,pipeline", ROUNDS)
def test_campaign_round_with_kills(server, tmp_path, capsys, guarantee, sink, pipeline):
    rng = random.Random(f"{guarantee}-{sink}-{pipeline}")
    work = tmp_path / f"pg-{guarantee}-{pipeline}"
    r = run_round(work, guarantee, sink, pipeline, kills=3, rng=rng, postgres=server.dsn)
    with capsys.disabled():
        print(f"\n{guarantee} {sink} {pipeline}: kills {r.kills} restarts {r.restarts} "
              f"lost {r.report.lost_count} duplicated {r.report.duplicated_count} "
              f"repeated windows {r.duplicate_rows} ({r.seconds:.1f} s)")
    assert r.kills >= 1, "the round was too short to kill its member"
    assert r.restarts >= r.kills
    assert not r.failures, r.failures
    assert r.report.lost_count == 0, str(r.report)
    if guarantee == "exactly-once":
        assert r.report.duplicated_count == 0 and r.duplicate_rows == 0, str(r.report)
        assert r.report.valid, str(r.report)
    else:
        assert r.report.valid_for("at-least-once"), str(r.report)
    assert postgres_prepared_left(server, work.name) == []


def postgres_prepared_left(server, prefix):
    return [g for g in prepared_ids(server) if f":{prefix}-" in g]
