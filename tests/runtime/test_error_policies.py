"""Bad records: a stage's ``on_error`` skips the rows it fails on, or sends them with the
error to a dead-letter sink under the job's guarantee, and a stage that fails on every row
still fails the job."""
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers.jobs import run_with_kills
from pyspark import cloudpickle

from sparkjet import verify
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource

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


def _poison_ids() -> np.ndarray:
    ids = np.arange(TOTAL)
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
    assert np.array_equal(np.sort(letters.column("id").to_numpy()), bad)   # each once
    assert letters.schema.field("sparkjet_error").type == pa.string()
    for row in letters.select(["id", "sparkjet_error"]).to_pylist():
        assert row["sparkjet_error"] == f"ValueError: malformed record {row['id']}"


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
