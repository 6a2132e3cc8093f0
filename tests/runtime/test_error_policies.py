"""Bad records: a stage's ``on_error`` skips the rows it fails on, or sends them with the
error to a dead-letter sink under the job's guarantee, and a stage that fails on every row
still fails the job."""
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers.jobs import run_with_kills
from pyspark import cloudpickle

from sparkjet import verify
from sparkjet.errors import InvalidArgumentError, MemberFailedError, NullKeyError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.sinks import DEAD_LETTER_SCHEMA, TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.windows import session, tumbling

# member processes cannot import this module: its functions travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOTAL = 60_000


def poisoned(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A parser that fails on one event in 997, as a malformed record would make it."""
    ids = batch["id"].to_numpy()
    bad = ids[ids % 997 == 3]
    if len(bad):
        raise ValueError(f"malformed record {int(bad[0])}")
    return batch.select(["id", "key"])


def _poison_ids(total: int = TOTAL) -> np.ndarray:
    ids = np.arange(total)
    return ids[ids % 997 == 3]


def test_skip_drops_the_bad_rows_alone_and_counts_them(tmp_path):
    source = GeneratorSource(total=TOTAL, partitions=2, keys=100, batch_size=4_000)
    pipeline = (Pipeline().read_from(source).map_batches(poisoned, on_error="skip")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="skip", snapshot_store=str(tmp_path / "snaps"), local_parallelism=2)
    result = Job(pipeline, config).run(isolated=False)
    got = np.sort(TransactionalFileSink.read(tmp_path / "out").column("id").to_numpy())
    want = np.setdiff1d(np.arange(TOTAL), _poison_ids())
    assert np.array_equal(got, want)
    assert result.skipped_events == len(_poison_ids()) and result.dead_letters == 0


def test_dead_letters_hold_each_bad_row_once_with_its_error_under_kills(tmp_path):
    source = GeneratorSource(total=TOTAL * 4, partitions=4, keys=100, batch_size=4_000,
                             rate=120_000)
    dead = TransactionalFileSink(tmp_path / "dead")
    pipeline = (Pipeline().read_from(source).map_batches(poisoned, on_error=dead)
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="dead-letters", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.2, local_parallelism=2, max_restarts=20,
                       restart_backoff=0.05)
    run_with_kills(Job(pipeline, config), 2, seed=3)
    ids = np.arange(TOTAL * 4)
    bad = ids[ids % 997 == 3]
    good = np.setdiff1d(ids, bad)
    out = TransactionalFileSink.read(tmp_path / "out").column("id")
    report = verify.check_events(pa.array(good), pa.array(good), out)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)
    letters = TransactionalFileSink.read(tmp_path / "dead")
    assert letters.schema.equals(DEAD_LETTER_SCHEMA, check_metadata=False)
    rows = [json.loads(r) for r in letters.column("record").to_pylist()]
    assert np.array_equal(np.sort([r["id"] for r in rows]), bad)   # each once
    for row, letter in zip(rows, letters.to_pylist()):
        assert letter["reason"] == f"ValueError: malformed record {row['id']}"
        assert letter["stage"] == "source/map_batches" and letter["format"] == "json"


def test_a_stage_failing_on_every_row_still_fails_the_job(tmp_path):
    source = GeneratorSource(total=10_000, partitions=1, keys=10, batch_size=1_000)
    pipeline = (Pipeline().read_from(source).filter(pc.field("no_such_column") > 1, on_error="skip")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="broken", snapshot_store=str(tmp_path / "snaps"), max_restarts=3,
                       restart_backoff=0)
    with pytest.raises(JobFailedError, match="no_such_column") as e:
        Job(pipeline, config).run()
    assert "failed 2 times the same way" in str(e.value)    # one replay, then no more


def test_on_error_takes_fail_skip_or_a_sink():
    stream = Pipeline().read_from(GeneratorSource(total=10))
    with pytest.raises(InvalidArgumentError, match="on_error takes 'fail', 'skip' or a sparkjet Sink"):
        stream.map_batches(poisoned, on_error="ignore")
    with pytest.raises(InvalidArgumentError, match="on_error"):
        stream.filter(pc.field("id") > 1, on_error=print)


def test_the_jobs_on_error_is_the_default_of_its_stages(tmp_path):
    source = GeneratorSource(total=TOTAL, partitions=2, keys=100, batch_size=4_000)
    out = TransactionalFileSink(tmp_path / "out")
    pipeline = Pipeline().read_from(source).map_batches(poisoned).write_to(out)
    config = JobConfig(name="skip-all", snapshot_store=str(tmp_path / "snaps"), on_error="skip")
    result = Job(pipeline, config).run(isolated=False)
    assert result.skipped_events == len(_poison_ids())
    assert TransactionalFileSink.read(tmp_path / "out").num_rows == TOTAL - len(_poison_ids())
    with pytest.raises(InvalidArgumentError, match="on_error"):
        JobConfig(snapshot_store="x", on_error="ignore")


# -- null keys in keyed stages -------------------------------------------------------------

KEYED_TOTAL = 40_000
COUNTS = pa.schema([("n", pa.int64())])


def null_keys(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The generator's events, with a null key in one event in 997."""
    ids = batch["id"].to_numpy()
    key = pa.array(batch["key"].to_numpy(), mask=ids % 997 == 3)
    return pa.RecordBatch.from_arrays([batch["id"], key, batch["value"]], ["id", "key", "value"])


def good_keys(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The reference's input: the same events less those with a null key."""
    return null_keys(batch).filter(batch["id"].to_numpy() % 997 != 3)


def count_rows(b):
    """map_state: the running count per key."""
    n = np.diff(b.offsets) + b.state["n"].fill_null(0).to_numpy()
    state = pa.table({"n": n})
    return pa.Table.from_arrays([*b.keys.columns, state["n"]], names=[*b.keys.column_names, "n"]), state


def _stream(prepare, seed=0, partitions=2):
    source = GeneratorSource(total=KEYED_TOTAL, partitions=partitions, keys=500,
                             batch_size=3_000, seed=seed)
    return Pipeline().read_from(source).map_batches(prepare)


#: Each keyed stage: (its vertex name, a pipeline through it fed by a stream built by
#: ``stream(seed)``, the columns that identify its final output, how to reduce it to that).
KEYED = {
    "aggregate": lambda s, on_error: s(0).group_by("key").aggregate(n="count", on_error=on_error),
    "window": lambda s, on_error: (s(0).with_timestamps("id").group_by("key")
                                   .window(tumbling(5_000)).aggregate(n="count", on_error=on_error)),
    "session": lambda s, on_error: (s(0).with_timestamps("id").group_by("key")
                                    .window(session(400)).aggregate(n="count", on_error=on_error)),
    # one source partition: which of a key's rows dedup keeps depends on their arrival
    # order, which two source processors interleave differently from run to run
    "dedup": lambda s, on_error: (s(0, 1).with_timestamps("id")
                                  .deduplicate("key", within=10_000, on_error=on_error)),
    "state": lambda s, on_error: s(0).group_by("key").map_state(count_rows, state=COUNTS,
                                                                 on_error=on_error),
    "interval_join": lambda s, on_error: (
        s(0).with_timestamps("id").join_interval(s(1).with_timestamps("id"), on="key",
                                                 between=(-50, 50), on_error=on_error)),
}


def _final(table: pa.Table, stage: str) -> list:
    """What a stage's output comes to: the last count per key for the rolling stages (whose
    intermediate updates depend on batching), every row for the others."""
    rows = table.to_pylist()
    if stage in ("aggregate", "state"):
        last: dict = {}
        for r in rows:
            last[r["key"]] = max(last.get(r["key"], 0), r["n"])
        return sorted(last.items())
    return sorted(tuple(sorted(r.items())) for r in rows)


def _run_keyed(tmp_path, stage, prepare, policy, name, **config):
    out = tmp_path / name
    pipeline = KEYED[stage](lambda seed, parts=2: _stream(prepare, seed, parts), policy).write_to(
        TransactionalFileSink(out))
    config = JobConfig(name=name, snapshot_store=str(tmp_path / f"snaps-{name}"),
                       local_parallelism=2, **config)
    return Job(pipeline, config).run(isolated=False), TransactionalFileSink.read(out)


@pytest.mark.parametrize("stage", sorted(KEYED))
def test_a_null_key_fails_the_job_naming_the_stage_column_and_row(tmp_path, stage):
    with pytest.raises(MemberFailedError) as e:
        _run_keyed(tmp_path, stage, null_keys, None, "fail")
    assert isinstance(e.value.__cause__, NullKeyError) and e.value.__cause__.deterministic
    vertex = "window" if stage == "session" else stage          # sessions are windows
    assert f"{vertex}: key column 'key' is null at row" in str(e.value)
    assert "of the stream from 'source" in str(e.value)


@pytest.mark.parametrize("stage", sorted(KEYED))
def test_skipped_null_keys_leave_the_output_of_the_good_rows(tmp_path, stage):
    result, got = _run_keyed(tmp_path, stage, null_keys, "skip", "skip")
    _, want = _run_keyed(tmp_path, stage, good_keys, "fail", "reference")
    assert want.num_rows > 0
    assert _final(got, stage) == _final(want, stage)
    bad = len(_poison_ids(KEYED_TOTAL)) * (2 if stage == "interval_join" else 1)
    assert result.skipped_events == bad and result.dead_letters == 0


def test_the_jobs_skip_covers_null_keys(tmp_path):
    result, got = _run_keyed(tmp_path, "dedup", null_keys, None, "skip-job", on_error="skip")
    _, want = _run_keyed(tmp_path, "dedup", good_keys, None, "reference")
    assert _final(got, "dedup") == _final(want, "dedup")
    assert result.skipped_events == len(_poison_ids(KEYED_TOTAL))


def test_null_keys_go_to_the_dead_letters_once_under_kills(tmp_path):
    """Two keyed stages share one dead-letter sink; the job's member is killed twice."""
    dead = TransactionalFileSink(tmp_path / "dead")
    source = GeneratorSource(total=KEYED_TOTAL * 4, partitions=4, keys=500, batch_size=3_000,
                             rate=100_000)
    stream = Pipeline().read_from(source).map_batches(null_keys)
    counts = (stream.group_by("key").aggregate(n="count", on_error=dead)
              .write_to(TransactionalFileSink(tmp_path / "counts")))
    firsts = (stream.with_timestamps("id").deduplicate("key", within=10_000, on_error=dead)
              .write_to(TransactionalFileSink(tmp_path / "firsts")))
    config = JobConfig(name="null-key-letters", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.2, local_parallelism=2, max_restarts=20,
                       restart_backoff=0.05)
    run_with_kills(Job(Pipeline.all(counts, firsts), config), 2, seed=5)
    bad = _poison_ids(KEYED_TOTAL * 4)
    letters = TransactionalFileSink.read(tmp_path / "dead")
    for stage in ("aggregate", "dedup"):
        mine = letters.filter(pc.equal(letters["stage"], stage))
        ids = np.sort([json.loads(r)["id"] for r in mine.column("record").to_pylist()])
        assert np.array_equal(ids, bad), stage                  # each bad row once
        assert set(mine.column("column").to_pylist()) == {"key"}
        assert set(mine.column("reason").to_pylist()) == {"NullKeyError: key column 'key' is null"}
    counted = _final(TransactionalFileSink.read(tmp_path / "counts"), "aggregate")
    assert sum(n for _, n in counted) == KEYED_TOTAL * 4 - len(bad)


def test_a_key_column_of_a_type_no_key_has_fails_naming_stage_and_column(tmp_path):
    source = GeneratorSource(total=1_000, partitions=1, keys=10, batch_size=500)
    pipeline = (Pipeline().read_from(source).group_by("value").aggregate(n="count", on_error="skip")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="float-key", snapshot_store=str(tmp_path / "snaps"), max_restarts=0)
    with pytest.raises(MemberFailedError, match="aggregate: key column 'value' has type double"):
        Job(pipeline, config).run(isolated=False)
