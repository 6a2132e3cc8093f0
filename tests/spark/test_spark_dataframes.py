"""Spark DataFrames in and out of sparkjet jobs: a bounded DataFrame as a replayable source
(materialised once), a job's committed output as a DataFrame, Structured Streaming reading
a job's committed output exactly once, and Structured Streaming feeding an Arrow log that a
job reads. Faults are real: SIGKILL of members, and of a streaming query's whole process."""
import json
import os
import signal
import sys
import time

import pandas as pd
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet  # noqa: F401 - pa.parquet
import pytest
from helpers.jobs import run_killed_once
from pyspark import cloudpickle

from sparkjet import verify
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import DataFrameSource, GeneratorSource
from sparkjet.spark import read_output, register

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


# -- a job's output as a DataFrame -----------------------------------------------------------


def test_read_output_gives_only_committed_rows(spark, tmp_path):
    n = 3_000
    job = Job(Pipeline().read_from(GeneratorSource(total=n, partitions=2, batch_size=300))
              .write_to(TransactionalFileSink(tmp_path / "out")),
              JobConfig(name="out-df", snapshot_store=str(tmp_path / "snaps"),
                        snapshot_interval=0.1))
    job.run(isolated=False)
    # A staged file of an unfinished transaction is not output.
    staged = tmp_path / "out" / "_staging" / "0000000000000001" / "p00000"
    staged.mkdir(parents=True)
    pa.parquet.write_table(pa.table({"id": [-1]}), staged / "e000000000009-t000000-00000.parquet")
    df = read_output(spark, TransactionalFileSink(tmp_path / "out"))
    got = df.toPandas().sort_values("id").reset_index(drop=True)
    assert got["id"].tolist() == list(range(n))
    assert list(got.columns) == ["id", "key", "value", "ts"]


def test_read_output_of_a_delta_table_without_delta_spark(spark, tmp_path):
    pytest.importorskip("deltalake")
    from sparkjet.sinks import DeltaSink

    sink = DeltaSink(tmp_path / "table")
    Job(Pipeline().read_from(GeneratorSource(total=2_000, partitions=2, batch_size=250))
        .write_to(sink), JobConfig(name="out-delta", snapshot_store=str(tmp_path / "snaps"),
                                   snapshot_interval=0.1)).run(isolated=False)
    assert sorted(r.id for r in read_output(spark, sink).select("id").collect()) == \
        list(range(2_000))


def test_read_output_refuses_what_it_cannot_read(spark, tmp_path):
    from sparkjet.sinks import DeltaSink, SQLiteUpsertSink

    with pytest.raises(InvalidArgumentError, match="read_output: a SQLiteUpsertSink cannot"):
        read_output(spark, SQLiteUpsertSink(str(tmp_path / "db.sqlite"), "t", key="id"))
    pytest.importorskip("deltalake")
    with pytest.raises(InvalidArgumentError, match="Delta Lake sink for table .*no table"):
        read_output(spark, DeltaSink(tmp_path / "missing"))


# -- Structured Streaming reads a job's committed output ------------------------------------


def stream_output(spark, out, checkpoint, target):
    """One run of a query over the job's committed output, from its checkpoint: everything
    committed when it starts, two files per micro-batch, into Spark's file sink."""
    query = (spark.readStream.format("sparkjet").option("maxFilesPerTrigger", 2).load(str(out))
             .writeStream.format("parquet").option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start(str(target)))
    query.awaitTermination()
    return len(query.recentProgress)


def test_a_stream_of_committed_output_exactly_once_across_restarts(spark, tmp_path):
    register(spark)
    n = 30_000
    source = GeneratorSource(total=n, partitions=2, batch_size=500, rate=15_000)
    job = Job(Pipeline().read_from(source).write_to(TransactionalFileSink(tmp_path / "out")),
              JobConfig(name="streamed", snapshot_store=str(tmp_path / "snaps"),
                        snapshot_interval=0.2))
    handle = job.submit()                     # commits while the queries read
    while not TransactionalFileSink.committed_files(str(tmp_path / "out")):
        assert not handle.done(), "the job ended before committing anything"
        time.sleep(0.05)
    runs = []
    while not handle.done():                  # each run: a restart from the checkpoint
        runs.append(stream_output(spark, tmp_path / "out", tmp_path / "ck", tmp_path / "t"))
    handle.result()
    runs.append(stream_output(spark, tmp_path / "out", tmp_path / "ck", tmp_path / "t"))
    assert len(runs) >= 2
    streamed = spark.read.parquet(str(tmp_path / "t")).select("id").toPandas()["id"]
    committed = TransactionalFileSink.read(tmp_path / "out")["id"].to_pylist()
    assert sorted(committed) == list(range(n))
    report = verify.check_events(committed, committed, streamed.tolist())
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


def test_stream_formats_refuse_bad_input(spark, tmp_path):
    register(spark)
    with pytest.raises(Exception, match="has no committed output yet"):
        spark.readStream.format("sparkjet").load(str(tmp_path)).writeStream.format(
            "console").start().awaitTermination(5)


# -- Structured Streaming feeds a job through an Arrow log ----------------------------------

FEED = """
import sys
from pyspark.sql.types import LongType, StructField, StructType
from sparkjet.spark import local_session, register

inbox, log, checkpoint = sys.argv[1:4]
spark = local_session("local[1]", "feed", **{"spark.ui.showConsoleProgress": "false"})
register(spark)
schema = StructType([StructField("id", LongType()), StructField("key", LongType())])
(spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(inbox)
 .writeStream.format("sparkjet-log").option("partitions", 2)
 .option("checkpointLocation", checkpoint).trigger(availableNow=True).start(log)
 .awaitTermination())
"""


def log_ids(root) -> list[int]:
    from sparkjet.sources import ArrowLogReader

    reader = ArrowLogReader(str(root), [0, 1], 2)
    ids = []
    while (batch := reader.read(1 << 20)) is not None:
        ids += batch.column("id").to_pylist()
    reader.close()
    return ids


def done_batches(log) -> int:
    top = log / "_spark_batches"
    return sum(len([n for n in os.listdir(top / q) if n.endswith(".json")
                    and ".pending" not in n]) for q in os.listdir(top)) if top.exists() else 0


@pytest.mark.slow
def test_a_streaming_query_killed_feeds_a_log_exactly_once(tmp_path):
    import subprocess

    from sparkjet.sources import ArrowLogSource, ArrowLogWriter

    inbox, log, files, rows = tmp_path / "inbox", tmp_path / "log", 8, 250
    inbox.mkdir()
    for f in range(files):
        ids = pa.array(range(f * rows, (f + 1) * rows), pa.int64())
        pa.parquet.write_table(pa.table({"id": ids, "key": pa.compute.bit_wise_and(ids, 7)}),
                               inbox / f"f-{f:03d}.parquet")
    (tmp_path / "feed.py").write_text(FEED)
    # The child imports the sparkjet this process imports (an installed wheel in CI, where
    # pysrc/ holds no compiled module).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, str(tmp_path / "feed.py"), str(inbox), str(log), str(tmp_path / "ck")]
    first = subprocess.Popen(argv, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while done_batches(log) < 2:
            assert first.poll() is None, "the query ended before it was killed"
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)   # the driver, its JVM and Python workers
        first.wait()
    assert done_batches(log) < files, "killed midway"
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    want = list(range(files * rows))
    report = verify.check_events(want, want, log_ids(log))
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)
    # Sealed, the log ends, and a job reads it whole.
    schema = pa.schema([("id", pa.int64()), ("key", pa.int64())])
    ArrowLogWriter(log, 2, schema).close()
    Job(Pipeline().read_from(ArrowLogSource(log)).write_to(TransactionalFileSink(tmp_path / "out")),
        JobConfig(name="from-log", snapshot_store=str(tmp_path / "snaps"))).run(isolated=False)
    check = verify.check_events(want, want, TransactionalFileSink.read(tmp_path / "out")["id"])
    assert check.valid and check.duplicated_count == 0, str(check)


def test_a_commit_that_died_midway_is_finished_not_repeated(tmp_path):
    """The driver died while appending a batch: the replay appends only the rest."""
    from sparkjet.sources import ArrowLogWriter
    from sparkjet.spark.datasource import LogStreamWriter

    schema = pa.schema([("id", pa.int64())])
    writer = LogStreamWriter(str(tmp_path / "log"), 2, schema)
    batches = [pa.record_batch([pa.array(range(i * 10, i * 10 + 10), pa.int64())], schema=schema)
               for i in range(3)]
    message = writer.write(iter(batches))      # staged: 30 rows in 3 batches, partition 0
    message.query = "q"
    # What a commit leaves when it dies after its first append (the module doc's protocol).
    log = ArrowLogWriter(tmp_path / "log", 2, schema)
    start = {str(p): list(pos) for p, pos in log.end_positions().items()}
    pending = tmp_path / "log" / "_spark_batches" / "q" / "000000000007.pending.json"
    pending.parent.mkdir(parents=True)
    pending.write_text(json.dumps({"files": [[0, message.file]], "start": start}))
    log.append(0, batches[0])
    log.close(seal=False)
    # The replay of batch 7 staged its rows again (another file): they are not appended.
    replay = writer.write(iter(batches))
    replay.query = "q"
    writer.commit([replay], 7)
    assert sorted(log_ids(tmp_path / "log")) == list(range(30))
    assert not os.path.exists(message.file) and not os.path.exists(replay.file)
    again = writer.write(iter(batches[:1]))
    again.query = "q"
    writer.commit([again], 7)                  # done already: nothing added
    assert not os.path.exists(again.file)
    assert sorted(log_ids(tmp_path / "log")) == list(range(30))
