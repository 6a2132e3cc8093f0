"""Spark DataFrames in and out of sparkjet jobs: a bounded DataFrame as a replayable source
(materialised once), a job's committed output as a DataFrame, Structured Streaming reading
a job's committed output exactly once, and Structured Streaming feeding an Arrow log that a
job reads. Faults are real: SIGKILL of members, and of a streaming query's whole process."""
import os
import signal
import sys
import time

import pandas as pd
import pyarrow as pa
import pytest
from pyspark import cloudpickle
from test_runtime import run_killed_once

from sparkjet import verify
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import DataFrameSource

pytestmark = [pytest.mark.spark]
# Spark's Python workers cannot import this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

COLUMNS = ["id", "key", "value", "name"]


def rows_df(spark, n, parts=6, offset=0):
    """``n`` rows with ids ``offset ..``, in ``parts`` Spark partitions."""
    return spark.range(offset, offset + n, 1, parts).selectExpr(
        "id", "id % 97 AS key", "CAST(id AS DOUBLE) * 0.5 AS value", "concat('n', id) AS name")


def reference(n, offset=0) -> pd.DataFrame:
    ids = pd.Series(range(offset, offset + n), dtype="int64")
    return pd.DataFrame({"id": ids, "key": ids % 97, "value": ids * 0.5,
                         "name": "n" + ids.astype(str)})


def sorted_frame(table: pa.Table) -> pd.DataFrame:
    return table.select(COLUMNS).to_pandas().sort_values("id").reset_index(drop=True)


def slow(batch):
    time.sleep(0.002)   # paces the job so that snapshots fall inside it, for the kills
    return batch


def copy_job(source, tmp_path, name, **config) -> Job:
    pipeline = (Pipeline().read_from(source).map_batches(slow)
                .write_to(TransactionalFileSink(tmp_path / "out")))
    defaults = dict(name=name, snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.2,
                    local_parallelism=1, restart_backoff=0.0)
    return Job(pipeline, JobConfig(**{**defaults, **config}))


def check_exactly_once(tmp_path, n, offset=0):
    got = TransactionalFileSink.read(tmp_path / "out")
    want = list(range(offset, offset + n))
    report = verify.check_events(want, want, got["id"])
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)
    pd.testing.assert_frame_equal(sorted_frame(got), reference(n, offset))


# -- a DataFrame as a source -----------------------------------------------------------------


def test_dataframe_source_on_spark_with_a_member_killed(spark, tmp_path):
    n = 60_000
    source = DataFrameSource(rows_df(spark, n), partitions=4, batch_size=200)
    job = copy_job(source, tmp_path, "df-kill", members=2, max_restarts=2)
    killed = []

    def progress(event):
        if event["event"] == "snapshot" and event["snapshot"] == 2 and not killed:
            killed.append(job.member_pids[1])
            os.kill(killed[0], signal.SIGKILL)

    result = job.run(spark, on_progress=progress)
    assert killed and result.restarts == 1
    assert result.executions[1]["restored_from"] >= 2
    check_exactly_once(tmp_path, n)
    # Run to its end: the materialised files are gone.
    assert not os.listdir(tmp_path / "snaps" / "_dataframes" / f"{job.config.id:016x}")


def test_a_rerun_reads_what_the_first_run_materialised(spark, tmp_path):
    n = 20_000
    first = DataFrameSource(rows_df(spark, n, parts=3), partitions=3, batch_size=100)
    run_killed_once(copy_job(first, tmp_path, "df-rerun", max_restarts=0), tmp_path / "snaps",
                    after=2)
    # The table behind the DataFrame changed meanwhile: the rerun (another process, another
    # DataFrame) resumes over the rows the first run wrote, or its offsets would be wrong.
    changed = DataFrameSource(rows_df(spark, n, parts=3, offset=10**6), partitions=3,
                              batch_size=100)
    result = copy_job(changed, tmp_path, "df-rerun").run()
    assert result.executions[0]["restored_from"] >= 2
    check_exactly_once(tmp_path, n)


def test_dataframe_source_refuses_bad_input(spark, tmp_path):
    stream = spark.readStream.format("rate").load()
    with pytest.raises(InvalidArgumentError, match=r"DataFrame source: .*streaming"):
        DataFrameSource(stream)
    with pytest.raises(InvalidArgumentError, match="DataFrame source: df must be a Spark DataFrame"):
        DataFrameSource(pd.DataFrame({"a": [1]}))
    source = DataFrameSource(rows_df(spark, 10))
    job = Job(Pipeline().read_from(source).write_to(TransactionalFileSink(tmp_path / "out")),
              JobConfig(name="df-none", processing_guarantee="none"))
    with pytest.raises(InvalidArgumentError, match="DataFrame source of 'source'.*give path="):
        job.run(isolated=False)
