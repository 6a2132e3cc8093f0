"""A job's metrics (as a dict and for Prometheus), its progress line and its log records."""
import datetime
import logging
import os
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers.jobs import scrape_while_running

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.windows import tumbling


def _job(tmp_path, name, total=60_000, rate=None):
    source = GeneratorSource(total=total, partitions=2, keys=50, batch_size=2_000, rate=rate)
    pipeline = (Pipeline().read_from(source).filter(pc.field("value") < 500)
                .group_by("key").aggregate(count="count")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name=name, snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.1,
                       local_parallelism=2)
    return Job(pipeline, config), source


def test_metrics_after_a_run_count_every_vertex(tmp_path):
    job, source = _job(tmp_path, "metrics")
    assert job.metrics is None
    result = job.run()
    m = job.metrics
    assert m["state"] == "finished" and m["job"] == "metrics"
    assert m["events_in"] == result.events_in == 60_000 and m["expected_events"] == 60_000
    assert m["events_out"] == result.events_out and m["restarts"] == 0
    assert m["snapshots"] == len(result.snapshots) >= 1
    assert m["last_snapshot"]["bytes"] > 0
    source_rows, keyed = m["vertices"]["source"], m["vertices"]["aggregate"]
    kept = int(pc.sum(pc.less(source.events(0, 60_000)["value"], 500)).as_py())
    assert source_rows == {"in": 60_000, "out": 60_000}   # filter is fused into the source
    assert keyed["in"] == kept and keyed["out"] == m["events_out"]


def test_prometheus_serves_the_metrics_while_the_job_runs(tmp_path):
    job, _ = _job(tmp_path, "scraped", total=200_000, rate=100_000)
    scraped = scrape_while_running(job, lambda: job.run(metrics_port=0), limit=40)
    assert job.metrics_port is None        # the server stops with the run
    assert scraped, "the endpoint answered while the job ran"
    last = scraped[-1]
    assert 'sparkjet_events_in_total{job="scraped"}' in last
    assert 'sparkjet_vertex_rows_total{direction="in",job="scraped",vertex="source"}' in last
    seen = [float(line.rsplit(" ", 1)[1]) for text in scraped for line in text.splitlines()
            if line.startswith('sparkjet_events_in_total{job="scraped"}')]
    assert max(seen) > 0


def test_the_progress_line_shows_a_bounded_job_to_its_end(tmp_path, capsys):
    job, _ = _job(tmp_path, "shown")
    job.run(progress=True)
    out = capsys.readouterr().out
    assert "shown finished [####################] 60,000/60,000" in out


def test_log_records_name_the_job_and_execution(tmp_path, caplog):
    job, _ = _job(tmp_path, "logged")
    with caplog.at_level(logging.INFO, logger="sparkjet"):
        job.run()
    records = [r for r in caplog.records if r.name == "sparkjet.job"]
    assert any("execution 0 starts" in r.getMessage() and r.execution == 0 for r in records)
    assert any("finished: 60000 events in" in r.getMessage() for r in records)
    assert all(r.job == "logged" for r in records)


def test_spark_jvm_logs_go_to_a_file_not_the_terminal(spark):
    """local_session routes the JVM's log4j output (where a killed Python worker is an ERROR
    with a stack trace) to a file of its own."""
    from sparkjet.spark import spark_log_path

    spark.range(10).count()
    with open(spark_log_path()) as f:
        text = f.read()
    assert "SparkContext: Running Spark version" in text
    options = spark.sparkContext.getConf().get("spark.driver.extraJavaOptions")
    assert "log4j2.configurationFile" in options


# -- one run at a time; a finished job says so ----------------------------------------------


def test_a_second_run_of_a_running_job_is_refused(tmp_path):
    from sparkjet.runtime import JobAlreadyRunningError

    job, _ = _job(tmp_path, "twice", total=400_000, rate=100_000)
    other, _ = _job(tmp_path, "twice")
    errors: list = []
    started = threading.Event()

    def second():
        while job.metrics is None or job.metrics["state"] != "running":
            time.sleep(0.02)
        started.set()
        try:
            other.run()
        except JobAlreadyRunningError as e:
            errors.append(e)

    t = threading.Thread(target=second, daemon=True)
    t.start()
    job.run()
    t.join(30)
    assert started.is_set() and len(errors) == 1
    assert "job 'twice' is already running against snapshot store" in str(errors[0])
    assert f"pid {os.getpid()}" in str(errors[0])


def test_a_finished_job_run_again_says_so(tmp_path):
    from sparkjet.runtime import JobFinishedError

    job, _ = _job(tmp_path, "done")
    job.run()
    with pytest.raises(JobFinishedError, match="job 'done' already ran to its end .* 60000 "
                                               "events read in its last run"):
        _job(tmp_path, "done")[0].run()


def test_source_and_watermark_lag_are_seconds_behind_the_event_times(tmp_path):
    hour = datetime.timedelta(hours=1)

    def an_hour_ago(b):
        return b.set_column(3, "ts", pc.subtract(b.column("ts"), pa.scalar(hour)))

    src = GeneratorSource(total=150_000, partitions=2, keys=20, batch_size=2_000, rate=60_000)
    pipeline = (Pipeline().read_from(src).map_batches(an_hour_ago)
                .with_timestamps("ts", max_lag=datetime.timedelta(seconds=60))
                .group_by("key").window(tumbling(datetime.timedelta(seconds=1))).count()
                .write_to(TransactionalFileSink(tmp_path / "out")))
    job = Job(pipeline, JobConfig(name="lagging", processing_guarantee="none"))
    handle = job.submit(isolated=False)
    deadline = time.monotonic() + 60
    seen = None
    while not handle.done() and time.monotonic() < deadline:
        m = handle.metrics or {}
        if m.get("watermark_lag_s") is not None and m.get("state") == "running":
            seen = m
            break
        time.sleep(0.02)
    handle.result(timeout=60)
    assert seen is not None, "no lag while the job ran"
    # events are an hour old when read (the generator stamps them with the time they are
    # made, at most the time they are read); watermarks trail them by another minute
    assert 3600 <= seen["source_lag_s"] < 3600 + 60
    assert 3660 <= seen["watermark_lag_s"] < 3660 + 60
    assert seen["vertices"]["source"]["newest_event_ns"] < time.time_ns() - 3600 * 10**9
    final = job.metrics
    assert 3600 <= final["source_lag_s"] < 3600 + 60
    assert final["watermark_lag_s"] == 0.0       # the input ended: nothing is behind


def test_lag_is_none_without_a_timestamp_event_time(tmp_path):
    pipeline = (Pipeline().read_from(GeneratorSource(total=20_000, partitions=2, keys=10))
                .with_timestamps("id").group_by("key").window(tumbling(1_000)).count()
                .write_to(TransactionalFileSink(tmp_path / "out")))
    job = Job(pipeline, JobConfig(name="integer-time", processing_guarantee="none"))
    job.run(isolated=False)
    assert job.metrics["source_lag_s"] is None and job.metrics["watermark_lag_s"] is None


def test_lags_reach_prometheus_and_the_progress_line():
    from sparkjet.runtime.observability import JobMetrics, ProgressView, _Collector

    now = time.time_ns()
    hour = 3600 * 10**9
    metrics = JobMetrics("lagging")
    metrics({"event": "execution", "execution": 0, "members": 2})
    # two members read source "a" (the newer event counts); source "b" is further behind;
    # the least watermark of the vertices (over members) is two hours old
    for member, a_newest, b_newest, mark in ((0, now - hour, now - 3 * hour, now - 2 * hour),
                                             (1, now - 2 * hour, now - 3 * hour, now - hour)):
        metrics({"event": "progress", "member": member, "vertices": {
            "a": {"in": 1, "out": 1, "newest_event_ns": a_newest, "watermark_ns": mark,
                  "watermark": mark},
            "b": {"in": 1, "out": 1, "newest_event_ns": b_newest},
            "window": {"in": 2, "out": 0, "watermark_ns": now - hour, "watermark": now - hour}}})
    m = metrics.as_dict()
    assert 3 * 3600 <= m["source_lag_s"] < 3 * 3600 + 60
    assert 2 * 3600 <= m["watermark_lag_s"] < 2 * 3600 + 60
    assert m["vertices"]["a"]["newest_event_ns"] == now - hour
    families = {f.name: f.samples[0].value for f in _Collector(metrics).collect()
                if f.name.endswith("lag_seconds")}
    assert families.keys() == {"sparkjet_source_lag_seconds", "sparkjet_watermark_lag_seconds"}
    assert 3 * 3600 <= families["sparkjet_source_lag_seconds"] < 3 * 3600 + 60
    text = ProgressView(metrics).text()
    assert " lag 3.0 h watermark lag 2.0 h" in text
    assert "lag" not in ProgressView(JobMetrics("no-time")).text()


def _millisecond_ts(batch):
    """The generator's ``ts`` as int64 milliseconds since the epoch."""
    ms = pc.divide(batch.column("ts").cast(pa.int64()), pa.scalar(1_000_000, pa.int64()))
    return batch.set_column(batch.schema.get_field_index("ts"), "ts", ms)


@pytest.mark.parametrize("unit", ["ms", None])
def test_latency_of_integer_millisecond_event_times_is_in_their_unit(tmp_path, unit):
    src = GeneratorSource(total=40_000, partitions=2, keys=20, batch_size=2_000, rate=200_000)
    pipeline = (Pipeline().read_from(src).map_batches(_millisecond_ts)
                .with_timestamps("ts", max_lag=1_000, unit=unit)
                .group_by("key").aggregate(count="count")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name=f"ms-{unit}", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.05, local_parallelism=2)
    job = Job(pipeline, config)
    result = job.run(isolated=False)
    p50, p99 = result.latency_percentiles(50, 99)
    e50, e99 = result.latency_percentiles(50, 99, until="emit")
    if unit == "ms":
        # ms since the epoch read as ms: latencies of seconds, not 57 years
        assert 0 <= p50 <= p99 < 60 and 0 <= e50 <= e99 < 60, (p50, p99, e50, e99)
        assert 0 <= job.metrics["source_lag_s"] < 60
    else:
        # an integer of no declared unit has no wall time: no latency rather than nonsense
        assert all(x != x for x in (p50, p99, e50, e99)), (p50, p99, e50, e99)
        assert job.metrics["source_lag_s"] is None


def test_with_timestamps_refuses_an_unknown_unit_and_a_mismatched_timestamp(tmp_path):
    from sparkjet.errors import InvalidArgumentError, SparkjetError

    with pytest.raises(InvalidArgumentError, match="unit must be one of"):
        Pipeline().read_from(GeneratorSource(total=1)).with_timestamps("ts", unit="days")
    pipeline = (Pipeline().read_from(GeneratorSource(total=1_000, partitions=1))
                .with_timestamps("ts", unit="ms").group_by("key").aggregate(count="count")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    with pytest.raises(SparkjetError, match="a timestamp column's unit is its own"):
        Job(pipeline, JobConfig(name="mismatch", snapshot_store=str(tmp_path / "s"),
                                max_restarts=0)).run(isolated=False)


def test_latency_histogram_percentiles_match_a_known_distribution():
    import pickle

    import numpy as np

    from sparkjet.runtime.observability import LatencyHistogram

    rng = np.random.default_rng(3)
    samples = rng.lognormal(np.log(50e6), 1.0, 200_000).astype(np.int64)   # ~50 ms median
    a, b = LatencyHistogram(), LatencyHistogram()
    a.record(samples[:120_000].tolist())
    b.record(samples[120_000:].tolist())
    merged = LatencyHistogram.merged([a, b.encode(), None])      # as members hand them over
    assert merged.count == 200_000
    for q in (1, 50, 90, 99, 99.9):
        want = float(np.percentile(samples, q))
        assert merged.percentile(q) == pytest.approx(want, rel=0.01), q
    assert pickle.loads(pickle.dumps(merged)).percentile(99) == merged.percentile(99)
    assert len(repr(merged)) < 120 and "p99=" in repr(merged)
    assert LatencyHistogram().percentile(50) != LatencyHistogram().percentile(50)   # NaN
    clamped = LatencyHistogram()
    clamped.record([-5, 2**63 - 1])             # a clock ahead of ours; absurdly late
    assert clamped.count == 2 and clamped.percentile(0) == 0


@pytest.mark.parametrize("isolated", [False, True])
def test_job_result_repr_stays_short_with_many_events(tmp_path, isolated):
    source = GeneratorSource(total=400_000, partitions=2, keys=100, batch_size=500)
    pipeline = (Pipeline().read_from(source).group_by("key").aggregate(count="count")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="many", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=30,
                       local_parallelism=2)
    result = Job(pipeline, config).run(isolated=isolated)
    assert result.events_in == 400_000
    # 16 samples a batch were kept in lists: 12,800 here (2M events: 8M characters)
    assert len(repr(result)) < 4_000, len(repr(result))
    p50, p99 = result.latency_percentiles(50, 99)
    assert 0 <= p50 <= p99 < 60
    e50, = result.latency_percentiles(50, until="emit")
    assert 0 <= e50 < 60


def test_a_submitted_job_has_metrics_at_once(tmp_path):
    job, _ = _job(tmp_path, "submitted", total=100_000, rate=100_000)
    handle = job.submit(isolated=False)
    m = handle.metrics       # right after submit: before the run's first event
    assert m is not None and m["state"] in ("starting", "running"), m
    assert m["job"] == "submitted" and m["expected_events"] == 100_000
    assert handle.status == m["state"] or handle.status == "running"
    handle.result(timeout=60)
    assert handle.metrics["state"] == "finished" and handle.metrics["events_in"] == 100_000


def test_a_run_refused_before_it_starts_shows_as_failed(tmp_path):
    from sparkjet.runtime.lifecycle import JobFinishedError

    job, _ = _job(tmp_path, "refused")
    job.run(isolated=False)
    again = _job(tmp_path, "refused")[0]
    handle = again.submit(isolated=False)
    with pytest.raises(JobFinishedError):
        handle.result(timeout=30)
    assert handle.status == "failed"


@pytest.mark.spark
def test_a_new_spark_session_prints_nothing_to_the_terminal(tmp_path):
    """The JVM's start-up lines (the JDK's incubator warning, Spark's "Setting default log
    level" banner) and its Python workers' stderr (PySpark's pandas warnings) go to the log
    file, not the terminal. A session of its own, in a child: this run's JVM is up already."""
    log = tmp_path / "spark.log"
    code = ("from sparkjet.spark import local_session\n"
            "spark = local_session('local[1]')\n"
            "rows = spark.range(100).mapInArrow(lambda it: it, 'id long').count()\n"
            "print('rows', rows)\n"
            "spark.stop()\n")
    env = {**os.environ, "SPARKJET_SPARK_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rows 100"
    assert done.stderr == ""
    assert "Setting default log level" in log.read_text()  # it went to the file
