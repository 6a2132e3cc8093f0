"""Jobs run from a Spark Connect session (``SparkSession.builder.remote(...)``): no
``sparkContext`` on this side. The server is the one shipped in pyspark's jars, a JVM of its
own (``local[2]``) started once for this file; the members run on its Python workers, the
coordinator here in the client. Faults are real: SIGKILL of a member's Python worker."""
import os
import signal
from pathlib import Path

import psutil
import pytest
from helpers.jobs import exact, keyed_spark_job
from pyspark.errors import PySparkAttributeError

from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.spark_runner import available_slots, coordinator_host
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.spark import session as _session
from sparkjet.testing.connect_server import ConnectServer
from sparkjet.verify import last_update_per_key

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """A Spark Connect server on a free port of 127.0.0.1, ``local[2]`` with a small heap
    (the run's classic session is another JVM), its log in a temporary folder; killed at
    the end."""
    server = ConnectServer("local[2]", driver_memory="512m",
                           directory=tmp_path_factory.mktemp("connect-server"),
                           conf={"spark.sql.shuffle.partitions": "4"})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def connect(connect_server):
    """A Spark Connect session on that server."""
    return connect_server.session()


def keyed_job(tmp_path: Path, source: GeneratorSource, **config) -> Job:
    return keyed_spark_job(tmp_path, source, "connect", **config)


def in_server(server: ConnectServer, pid: int) -> bool:
    """Whether ``pid`` is a process the Connect server's JVM started (its Python workers
    descend from it), not one of this client's."""
    return server.process.pid in {p.pid for p in psutil.Process(pid).parents()}


def test_connect_session_is_told_apart(connect, connect_server):
    assert _session.is_connect(connect)
    with pytest.raises(PySparkAttributeError, match="sparkContext"):
        connect.sparkContext  # noqa: B018 - what failed before: no JVM gateway here
    assert _session.master(connect) == "local[2]"
    assert available_slots(connect) == 2
    assert _session.default_parallelism(connect) == 2
    config = JobConfig(processing_guarantee="none")
    assert coordinator_host(config, connect) == "127.0.0.1"  # the route to sc://127.0.0.1
    assert coordinator_host(JobConfig(processing_guarantee="none", coordinator_host="10.0.0.7"),
                            connect) == "10.0.0.7"
    with pytest.raises(InvalidArgumentError, match="coordinator_host"):
        JobConfig(processing_guarantee="none", coordinator_host="")


def test_job_over_connect_exactly_once(connect, connect_server, tmp_path):
    source = GeneratorSource(total=400_000, partitions=4, keys=5_000, batch_size=20_000)
    where = {}  # member pid -> whether it is a process of the Connect server

    def progress(event):
        if event["event"] == "started":
            where.update((pid, in_server(connect_server, pid)) for pid in event["pids"].values())

    result = keyed_job(tmp_path, source).run(connect, on_progress=progress)
    report = exact(tmp_path, source)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)
    assert result.restarts == 0 and [e["members"] for e in result.executions] == [2]
    assert result.events_in == 400_000
    assert len(where) == 2 and all(where.values()), f"two of the server's workers: {where}"
    assert result.snapshots and result.snapshots[-1]["terminal"]


def test_member_killed_over_connect_restarts_exactly_once(connect, connect_server, tmp_path):
    source = GeneratorSource(total=800_000, partitions=4, keys=5_000, batch_size=10_000,
                             rate=200_000)
    job = keyed_job(tmp_path, source, max_restarts=2)
    killed = []

    def progress(event):
        if event["event"] == "snapshot" and event["snapshot"] == 2 and not killed:
            pid = job.member_pids[1]
            killed.append((pid, in_server(connect_server, pid)))
            os.kill(pid, signal.SIGKILL)

    events = []
    result = job.run(connect, on_progress=lambda e: (events.append(e), progress(e)))
    assert killed and killed[0][1], f"a worker of the Connect server was killed: {killed}"
    assert result.restarts == 1
    assert result.executions[0]["status"] == "failed"
    assert (result.executions[1]["restored_from"] is not None
            and result.executions[1]["restored_from"] >= 2)
    assert ([e["event"] for e in events if e["event"] in ("restart", "restored")]
            == ["restart", "restored"])
    report = exact(tmp_path, source)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


def test_a_dataframe_source_and_read_output_from_connect(connect, tmp_path):
    """A Connect DataFrame as a job's source (written once by the server) and the job's
    committed output read back as a Connect DataFrame, equal to pandas over the input."""
    from sparkjet.sources import DataFrameSource
    from sparkjet.spark import read_output

    df = connect.range(0, 20_000).selectExpr("id", "id % 97 AS key")
    sink = TransactionalFileSink(tmp_path / "out")
    pipeline = (Pipeline().read_from(DataFrameSource(df, partitions=2))
                .group_by("key").aggregate(count="count").write_to(sink))
    Job(pipeline, JobConfig(name=f"connect-df-{tmp_path.name}", local_parallelism=1, members=2,
                            snapshot_store=str(tmp_path / "snapshots"))).run(connect)
    got = last_update_per_key(TransactionalFileSink.read(tmp_path / "out"),
                              columns=["count"]).to_pandas()
    want = df.toPandas().groupby("key").size()
    assert dict(zip(got["key"], got["count"])) == want.to_dict()
    back = read_output(connect, sink).toPandas()
    assert len(back) >= len(want)       # every update committed, the last per key above
    assert set(back["key"]) == set(want.index)
