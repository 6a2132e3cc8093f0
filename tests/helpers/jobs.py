"""Jobs run as the tests run them: under SIGKILLs of their member at random moments, or killed
once after a given snapshot; and the final state of a rolling count written to files."""
import os
import random
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobFailedError
from sparkjet.sinks import TransactionalFileSink


def final_state(out) -> pa.Table:
    """The last update per key of a rolling count: counts only grow, so the largest wins."""
    t = TransactionalFileSink.read(out)
    t = t.sort_by([("key", "ascending"), ("count", "descending")])
    keys = t.column("key").to_numpy()
    first = np.concatenate([[True], keys[1:] != keys[:-1]]) if len(keys) else np.array([], bool)
    return t.filter(pa.array(first)).select(["key", "count", "sum"])


def keyed_pipeline(source, out):
    return (Pipeline().read_from(source)
            .group_by("key").aggregate(count="count", sum=("sum", "value"))
            .write_to(TransactionalFileSink(out)))


def kill_member_repeatedly(job: Job, kills: int, rng: random.Random, stop: threading.Event, done: list):
    """Kills the job's member process `kills` times at random moments."""
    while len(done) < kills and not stop.is_set():
        time.sleep(rng.uniform(0.3, 1.2))
        pid = job.member_pid
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            done.append(pid)
        except ProcessLookupError:
            pass


def run_killed_once(job: Job, store_path, after: int) -> None:
    """Runs the job (without restarts) and kills its member once snapshot ``after`` is
    complete: the run fails, leaving its snapshots for a run at another parallelism."""
    from sparkjet.snapshot.store import SnapshotStore

    stop = threading.Event()

    def kill_after_snapshots():
        store = SnapshotStore(str(store_path), job.config.id)
        while not stop.is_set():
            latest = store.latest_complete()
            if latest is not None and latest.snapshot_id >= after and job.member_pid:
                os.kill(job.member_pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_snapshots, daemon=True)
    killer.start()
    try:
        with pytest.raises(JobFailedError, match="SIGKILL"):
            job.run()
    finally:
        stop.set()
        killer.join()


def run_with_kills(job: Job, kills: int, seed: int):
    """Runs the supervised job while its member is killed `kills` times at random moments;
    checks that a kill ended at least one execution (else the test would prove nothing)."""
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=kill_member_repeatedly,
                              args=(job, kills, random.Random(seed), stop, killed), daemon=True)
    killer.start()
    try:
        result = job.run()
    finally:
        stop.set()
        killer.join()
    assert [e for e in result.executions if "SIGKILL" in (e.get("error") or "")], \
        "the killer must have killed at least one member"
    return result


def keyed_spark_job(tmp_path, source, prefix: str, **config) -> Job:
    """A rolling count+sum by key into files, on Spark with 2 members (``config`` overrides)."""
    from sparkjet.runtime import JobConfig

    pipeline = (Pipeline().read_from(source)
                .group_by("key").aggregate(count="count", sum=("sum", "value"))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    defaults = dict(name=f"{prefix}-{tmp_path.name}", snapshot_store=str(tmp_path / "snapshots"),
                    snapshot_interval=0.3, local_parallelism=1, members=2, restart_backoff=0.0)
    return Job(pipeline, JobConfig(**{**defaults, **config}))


def exact(tmp_path, source):
    """The checker's exactly-once report of that job's output against the source."""
    from sparkjet import verify
    from sparkjet.verify import last_update_per_key

    out = last_update_per_key(TransactionalFileSink.read(tmp_path / "out"))
    return verify.check_aggregates(source.expected_counts(), out, key="key",
                                   columns=["count", "sum"], guarantee="exactly-once")


def scrape_while_running(job: Job, run, limit: int | None = None) -> list[str]:
    """Calls ``run()`` (which runs ``job`` with a metrics port) while a thread reads its
    Prometheus endpoint every 0.1 s (up to ``limit`` times); returns the texts read."""
    import urllib.request

    scraped: list[str] = []

    def scrape():
        while job.metrics_port is None:
            time.sleep(0.02)
        while job.metrics_port is not None and (limit is None or len(scraped) < limit):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{job.metrics_port}/metrics",
                                            timeout=2) as r:
                    scraped.append(r.read().decode())
            except OSError:
                break
            time.sleep(0.1)

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    run()
    t.join(10)
    return scraped


def kill_member_at(job: Job, snapshot: int, member: int, killed: list):
    """A progress callback that SIGKILLs ``member``'s Python worker once snapshot
    ``snapshot`` is complete (once; its pid goes to ``killed``)."""
    def progress(event):
        if event["event"] == "snapshot" and event["snapshot"] == snapshot and not killed:
            killed.append(job.member_pids[member])
            os.kill(killed[0], signal.SIGKILL)
    return progress
