"""A job's metrics (as a dict and for Prometheus), its progress line and its log records."""
import logging
import os
import threading
import time
import urllib.request

import pyarrow.compute as pc
import pytest

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource


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
    scraped: list[str] = []

    def scrape():
        while job.metrics_port is None:
            time.sleep(0.02)
        while job.metrics_port is not None and len(scraped) < 40:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{job.metrics_port}/metrics",
                                            timeout=2) as r:
                    scraped.append(r.read().decode())
            except OSError:
                break
            time.sleep(0.1)

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    job.run(metrics_port=0)
    t.join(10)
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
