"""The Spark standalone cluster of sparkjet.testing.standalone with each worker in a network
namespace of its own (sparkjet.testing.netns): the master and the driver bind the bridge's
gateway, each worker (its executor and the members in it) its host's address. An
exactly-once job runs on it with one member per worker, and its output is exact. The driver
runs in a subprocess (one SparkContext per process): this file run as a script."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _driver(work: str) -> None:
    from pathlib import Path

    from helpers.jobs import exact, keyed_spark_job

    from sparkjet.sources import GeneratorSource
    from sparkjet.testing.netns import Network
    from sparkjet.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster

    work = Path(work)
    with Network(hosts=2) as net, StandaloneCluster(workers=2, network=net) as cluster:
        spark = cluster.session("netns", **{
            "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
            "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
            "spark.stage.maxConsecutiveAttempts": "1"})
        source = GeneratorSource(total=300_000, partitions=4, keys=2_000, batch_size=10_000)
        job = keyed_spark_job(work, source, "netns", members=2)
        started = []
        job.run(spark, on_progress=lambda e: e["event"] == "started" and started.append(
            {str(p): [h.name for h in net.hosts if p in h.pids()]
             for p in e["pids"].values()}))
        report = exact(work, source)
        print(json.dumps({
            "master": cluster.master_url, "gateway": net.gateway,
            "workers": [w["host"] for w in cluster.alive_workers()],
            "hosts": [h.address for h in net.hosts], "members": started[0],
            "lost": report.lost_count, "duplicated": report.duplicated_count,
            "valid": report.valid}), flush=True)
        spark.stop()


@pytest.mark.slow
def test_a_job_on_a_standalone_cluster_whose_workers_are_namespaces(tmp_path):
    from sparkjet.testing import netns

    reason = netns.available()
    if reason:
        if os.environ.get("SPARKJET_CI") == "1":
            pytest.fail(f"CI must run the namespace tests: {reason}", pytrace=False)
        pytest.skip(reason)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["master"].startswith(f"spark://{out['gateway']}:")
    assert sorted(out["workers"]) == sorted(out["hosts"])
    # each member (a Python worker of an executor) runs in its worker's namespace
    assert len(out["members"]) == 2
    assert all(len(names) == 1 for names in out["members"].values()), out["members"]
    assert len({names[0] for names in out["members"].values()}) == 2, out["members"]
    assert out["valid"] and out["lost"] == 0 and out["duplicated"] == 0, out


if __name__ == "__main__":
    _driver(sys.argv[1])
