"""A real Spark standalone cluster (sparkjet.testing.standalone): barrier stages across two
executor JVMs, a worker killed by SIGKILL during a barrier stage, the worker restarted.

The pytest process already holds the shared local SparkContext (conftest's ``spark``), and a
process can have only one, so the cluster and its driver run in a subprocess: this file run
as a script (:func:`driver`), which prints one JSON line per step. The test checks those
lines, then that every JVM the run started is gone."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkjet.spark.java import JavaNotFoundError, ensure_java

pytestmark = [pytest.mark.spark, pytest.mark.slow]

PREFIX = "SPARKJET-STANDALONE "


# ---- the driver (run in a subprocess) ---------------------------------------------------


def _executor_pid():
    """In a Python worker: the pid of the executor JVM above it (worker <- pyspark daemon
    <- CoarseGrainedExecutorBackend), found by walking up /proc."""
    import os

    pid = os.getpid()
    for _ in range(8):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
    return -1


def _barrier_task(hold_dir=None, hold_seconds=0.0):
    """The mapInArrow function of a barrier stage: every task allGathers its hostname,
    Python pid and executor pid and returns what it gathered. With ``hold_dir`` each task
    then writes ``<hold_dir>/<partition>`` and sleeps until ``<hold_dir>/release`` exists
    (or ``hold_seconds`` pass): a long-running member."""

    def run(batches):
        import json
        import os
        import socket
        import time

        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        ctx = BarrierTaskContext.get()
        me = {"host": socket.gethostname(), "pid": os.getpid(), "executor_pid": _executor_pid(),
              "partition": ctx.partitionId(), "attempt": ctx.attemptNumber()}
        gathered = ctx.allGather(json.dumps(me))
        if hold_dir is not None:
            with open(os.path.join(hold_dir, str(ctx.partitionId())), "w") as f:
                f.write(json.dumps(me))
            deadline = time.monotonic() + hold_seconds
            release = os.path.join(hold_dir, "release")
            while time.monotonic() < deadline and not os.path.exists(release):
                time.sleep(0.05)
        yield pa.RecordBatch.from_pydict(
            {"me": [json.dumps(me)], "gathered": [json.dumps(gathered)]})

    return run


def _barrier_stage(spark, tasks, **kwargs):
    df = spark.range(0, tasks, 1, tasks)
    rows = df.mapInArrow(_barrier_task(**kwargs), "me string, gathered string",
                         barrier=True).collect()
    return [{"me": json.loads(r.me), "gathered": sorted(json.loads(r.gathered))} for r in rows]


def driver(hold_dir):
    import threading

    from sparkjet.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster

    def emit(step, **data):
        print(PREFIX + json.dumps({"step": step, **data}), flush=True)

    cluster = StandaloneCluster(workers=2, cores=1, memory="1g")
    t0 = time.monotonic()
    with cluster.start(timeout=60):
        emit("started", seconds=round(time.monotonic() - t0, 2), master_pid=cluster.master_pid(),
             worker_pids=cluster.worker_pids(), master_url=cluster.master_url,
             alive=len(cluster.alive_workers()), work_dir=str(cluster.work_dir))
        t0 = time.monotonic()
        # A lost member fails the job at once (recovery is the caller's, as for sparkjet).
        spark = cluster.session("sparkjet-standalone-test", **{
            "spark.stage.maxConsecutiveAttempts": "1",
            "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
            "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
        })
        jvm = spark.sparkContext._jvm
        emit("session", seconds=round(time.monotonic() - t0, 2),
             driver_jvm_pid=int(jvm.java.lang.ProcessHandle.current().pid()))

        t0 = time.monotonic()
        first = _barrier_stage(spark, 2)
        emit("barrier1", seconds=round(time.monotonic() - t0, 2), rows=first,
             executor_pids=cluster.executor_pids(),
             executors_by_worker=[cluster.executor_pids(i) for i in range(2)])

        # A long-running barrier stage; worker 0 is killed while both tasks run.
        outcome = {}

        def long_stage():
            try:
                outcome["rows"] = _barrier_stage(spark, 2, hold_dir=hold_dir, hold_seconds=60)
            except Exception as e:  # noqa: BLE001 (the job failing is what this stage is for)
                outcome["error"] = f"{type(e).__name__}: {e}"
            outcome["at"] = time.monotonic()

        runner = threading.Thread(target=long_stage, daemon=True)
        runner.start()
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(hold_dir, str(p))) for p in range(2)):
            assert time.monotonic() < deadline and runner.is_alive(), outcome
            time.sleep(0.05)
        executors_before = cluster.executor_pids()
        killed_at = time.monotonic()
        kill = cluster.kill_worker(0, signal.SIGKILL)
        runner.join(timeout=60)
        failed_after = outcome.get("at", time.monotonic()) - killed_at
        deadline = time.monotonic() + 30
        while len(cluster.alive_workers()) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        emit("killed", kill=kill.__dict__, executors_before=executors_before,
             stage_finished=not runner.is_alive(), error=outcome.get("error"),
             rows=outcome.get("rows"), failed_after=round(failed_after, 2),
             alive_seconds=round(time.monotonic() - killed_at, 2),
             alive=len(cluster.alive_workers()), worker_pids=cluster.worker_pids(),
             executor_pids=cluster.executor_pids())
        Path(hold_dir, "release").touch()

        t0 = time.monotonic()
        new_pid = cluster.restart_worker(0)
        restarted = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        third = _barrier_stage(spark, 2)
        emit("barrier3", restart_seconds=restarted, seconds=round(time.monotonic() - t0, 2),
             new_worker_pid=new_pid, rows=third, alive=len(cluster.alive_workers()),
             worker_pids=cluster.worker_pids(), executor_pids=cluster.executor_pids())
        spark.stop()
    emit("stopped")


# ---- the test ---------------------------------------------------------------------------


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _is_spark_jvm(pid):
    """A JVM of Spark or a pyspark Python worker (tells them from a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"org.apache.spark" in cmdline or b"pyspark" in cmdline


def _pids_of(steps):
    """Every pid the driver reported: the master, worker, executor and driver JVMs, and the
    tasks' Python workers."""
    pids = set()
    for s in steps:
        for key in ("master_pid", "driver_jvm_pid", "new_worker_pid"):
            if s.get(key):
                pids.add(s[key])
        for key in ("worker_pids", "executor_pids", "executors_before"):
            pids.update(p for p in s.get(key) or () if p)
        for row in s.get("rows") or ():
            pids.update((row["me"]["executor_pid"], row["me"]["pid"]))
        if s.get("kill"):
            pids.add(s["kill"]["worker_pid"])
            pids.update(s["kill"]["executor_pids"])
    return {p for p in pids if p > 1}


def test_barrier_stages_and_worker_kill_on_standalone_cluster(tmp_path):
    try:
        ensure_java()
    except JavaNotFoundError as e:
        pytest.fail(f"JavaNotFoundError: {e}", pytrace=False)
    hold_dir = tmp_path / "hold"
    hold_dir.mkdir()
    env = dict(os.environ)
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    proc = subprocess.Popen([sys.executable, __file__, str(hold_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    steps = [json.loads(line[len(PREFIX):]) for line in out.splitlines() if line.startswith(PREFIX)]
    by_step = {s["step"]: s for s in steps}
    pids = _pids_of(steps)
    # Whatever happened, no process of the run may outlive it (the cluster's stop() or, if
    # the driver died, the kernel's PDEATHSIG killed them; give them a moment, then clean up
    # and fail if any was left).
    deadline = time.monotonic() + 10
    while any(_alive(p) and _is_spark_jvm(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = sorted(p for p in pids if _alive(p) and _is_spark_jvm(p))
    for p in leaked:
        os.kill(p, signal.SIGKILL)
    report = f"exit code {proc.returncode}\nsteps: {json.dumps(steps, indent=1)}\n" \
             f"stderr tail:\n{err[-5000:]}"
    assert proc.returncode == 0 and "stopped" in by_step, report
    assert not leaked, f"processes left behind: {leaked}\n{report}"

    started = by_step["started"]
    assert started["alive"] == 2 and all(started["worker_pids"]), report
    assert started["master_url"].startswith("spark://127.0.0.1:")
    assert not Path(started["work_dir"]).exists(), "the cluster's temp folder was not removed"

    # Barrier stage 1: two tasks in two executor JVMs, each saw both tasks' messages.
    first = by_step["barrier1"]
    rows = first["rows"]
    assert len(rows) == 2, report
    executors = {r["me"]["executor_pid"] for r in rows}
    assert len(executors) == 2 and -1 not in executors, report
    assert executors == set(first["executor_pids"]), report
    assert all(len(by_worker) == 1 for by_worker in first["executors_by_worker"]), report
    everyone = sorted(json.dumps(r["me"]) for r in rows)
    for r in rows:
        assert sorted(json.dumps(json.loads(m)) for m in r["gathered"]) == everyone, report

    # Barrier stage 2: SIGKILL of worker 0 fails the stage; its executor is really gone.
    killed = by_step["killed"]
    kill = killed["kill"]
    assert kill["executor_pids"] == first["executors_by_worker"][0], report
    assert killed["stage_finished"] and killed["rows"] is None, report
    assert killed["error"] and "ExecutorLostFailure" in killed["error"], report
    assert kill["executors_exited_by_themselves"], report  # the executor's WorkerWatcher
    assert killed["alive"] == 1, report
    assert killed["worker_pids"][0] is None and killed["worker_pids"][1], report
    assert killed["executor_pids"] == first["executors_by_worker"][1], report
    assert not any(_alive(p) for p in kill["executor_pids"])

    # Worker 0 restarted: a new worker and a new executor, and a barrier stage runs again.
    third = by_step["barrier3"]
    assert third["alive"] == 2, report
    assert third["new_worker_pid"] not in started["worker_pids"], report
    executors3 = {r["me"]["executor_pid"] for r in third["rows"]}
    assert len(executors3) == 2 and len(third["rows"]) == 2, report
    assert first["executors_by_worker"][1][0] in executors3, report
    assert not executors3 & set(kill["executor_pids"]), report
    print(f"timings: cluster start {started['seconds']} s, "
          f"session {by_step['session']['seconds']} s, "
          f"barrier stage {first['seconds']} s, stage failed {killed['failed_after']} s and "
          f"executor gone {kill['seconds']} s after the SIGKILL, worker restart "
          f"{third['restart_seconds']} s, barrier stage after it {third['seconds']} s")


if __name__ == "__main__":
    driver(sys.argv[1])
