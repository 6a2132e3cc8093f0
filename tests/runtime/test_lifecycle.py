"""A job's lifecycle: submitted, watched, stopped with an exported snapshot, suspended,
cancelled, resumed; the output is exactly-once across all of it."""
import time

import numpy as np
import pyarrow as pa
import pytest

from sparkjet import verify
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobCancelledError, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource

TOTAL = 600_000


def _job(tmp_path, name, store=None):
    source = GeneratorSource(total=TOTAL, partitions=2, keys=100, batch_size=5_000, rate=100_000)
    pipeline = (Pipeline().read_from(source).map_batches(lambda b: b.select(["id"]))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name=name, snapshot_store=str(store or tmp_path / "snaps"),
                       snapshot_interval=0.2,
                       local_parallelism=2)
    return Job(pipeline, config)


def _wait_for_snapshots(handle, n=2, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = handle.metrics
        if m is not None and m["snapshots"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} snapshots within {timeout} s: {handle.metrics}")


def _exactly_once(tmp_path):
    ids = pa.array(np.arange(TOTAL))
    got = TransactionalFileSink.read(tmp_path / "out").column("id")
    report = verify.check_events(ids, ids, got)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)


def test_stop_exports_a_snapshot_and_a_new_run_resumes_from_it(tmp_path):
    job = _job(tmp_path, "stopped")
    handle = job.submit()
    _wait_for_snapshots(handle)
    result = handle.stop(snapshot="before-upgrade", timeout=60)
    assert result.stopped and result.export == "before-upgrade"
    assert handle.status == "stopped" and 0 < result.events_in < TOTAL
    with SnapshotStore(job.config.snapshot_store, job.config.id) as store:
        assert store.restore("source", [], name="before-upgrade") is not None
    # everything read before the stop is committed, nothing after it
    assert TransactionalFileSink.read(tmp_path / "out").num_rows == result.events_in
    again = handle.resume().result(timeout=120)
    assert not again.stopped and result.events_in + again.events_in == TOTAL
    _exactly_once(tmp_path)


def test_cancel_then_resume_is_exactly_once(tmp_path):
    job = _job(tmp_path, "cancelled")
    handle = job.submit()
    _wait_for_snapshots(handle)
    handle.cancel(timeout=60)
    with pytest.raises(JobCancelledError, match="job 'cancelled' was cancelled"):
        handle.result()
    assert handle.status == "cancelled"
    handle.resume().result(timeout=120)
    _exactly_once(tmp_path)


def test_suspend_and_resume_in_process(tmp_path):
    job = _job(tmp_path, "suspended")
    handle = job.submit(isolated=False)
    _wait_for_snapshots(handle)
    assert handle.suspend(timeout=60).stopped
    handle.resume().result(timeout=120)
    _exactly_once(tmp_path)


def test_stop_needs_a_running_job(tmp_path):
    job = _job(tmp_path, "idle")
    with pytest.raises(InvalidArgumentError, match="job 'idle' is not running"):
        job.stop()


def test_sparkjet_jobs_lists_each_job_by_name_with_its_state(tmp_path, capsys):
    from sparkjet.cli.main import main

    handle = _job(tmp_path / "a", "nightly", store=tmp_path / "store").submit()
    _wait_for_snapshots(handle)
    handle.stop(snapshot="v1", timeout=60)
    done = Job(Pipeline().read_from(GeneratorSource(total=1_000, partitions=1))
               .write_to(TransactionalFileSink(tmp_path / "b")),
               JobConfig(name="once", snapshot_store=str(tmp_path / "store")))
    done.run()
    capsys.readouterr()
    assert main(["jobs", str(tmp_path / "store")]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["nightly"][2] == "stopped" and lines["nightly"][-1] == "v1"
    assert lines["once"][2] == "finished" and lines["once"][-1] == "-"
    assert main(["jobs", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "missing").exists()


_SUPERVISOR = """
import sys, time
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

source = GeneratorSource(partitions=2, keys=100, batch_size=1_000, rate=20_000)  # unbounded
job = Job(Pipeline().read_from(source).write_to(DiscardSink()),
          JobConfig(name="orphan", snapshot_store=sys.argv[1], snapshot_interval=0.5))
handle = job.submit()
while job.member_pid is None or not (handle.metrics or {}).get("snapshots"):
    time.sleep(0.05)
print("MEMBER", job.member_pid, flush=True)
time.sleep(600)
"""


def test_the_member_entry_point_runs_once_without_a_warning():
    """The local runner starts a member as ``python -m sparkjet.runtime.member_main``. When
    the package's own imports loaded that module first, runpy ran a second copy and warned
    so on the member's stderr, which a failed member's message then carried ("member killed
    by signal SIGKILL: <frozen runpy>:128: RuntimeWarning: ..."). With warnings as errors,
    the entry point now gets as far as its arguments."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "error", "-m", "sparkjet.runtime.member_main"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "RuntimeWarning" not in done.stderr and "sys.modules" not in done.stderr, done.stderr
    assert "in main" in done.stderr and "job_file, execution" in done.stderr, done.stderr


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_a_member_ends_when_its_supervisor_is_killed(tmp_path, signal_name):
    """The local runner's member process (an unbounded job) goes when the process that
    supervises it is killed, instead of running on alone for ever (found: a benchmark
    stopped with SIGTERM left its member at 100 % CPU and 4.7 GB)."""
    import os
    import select
    import signal
    import subprocess
    import sys

    import psutil

    script = tmp_path / "supervisor.py"
    script.write_text(_SUPERVISOR)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "snaps")],
                            stdout=subprocess.PIPE, text=True)
    member = None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, "the supervisor's job took no snapshot within 300 s"
        line = proc.stdout.readline()
        assert line.startswith("MEMBER "), line
        member = psutil.Process(int(line.split()[1]))
        assert member.ppid() == proc.pid and member.is_running()
        os.kill(proc.pid, getattr(signal, signal_name))
        proc.wait(60)
        try:
            member.wait(60)     # gone (its new parent reaps it), or left as a zombie
        except psutil.TimeoutExpired:
            assert member.status() == psutil.STATUS_ZOMBIE, member.status()
    finally:
        proc.kill()
        proc.wait()
        if member is not None and member.is_running():
            member.kill()   # (what the test is about; left running only if it failed)


def test_an_on_progress_callback_that_raises_is_logged_and_the_job_goes_on(tmp_path, caplog):
    """A user's progress callback is the user's code: an error it raises is logged with
    its traceback under ``sparkjet.job`` and the job runs on, as Spark's listener bus
    does with a listener's. (Before, it failed the execution under the callback's bare
    error: a restart, counted against max_restarts, that named nothing of the callback.)"""
    job = _job(tmp_path, "callback")
    seen = []

    def on_progress(event):
        seen.append(event["event"])
        if event["event"] == "snapshot":
            raise FileNotFoundError("the callback's own file")

    with caplog.at_level("ERROR", logger="sparkjet.job"):
        result = job.run(on_progress=on_progress)
    assert result.restarts == 0 and result.events_in == TOTAL
    assert seen.count("snapshot") >= 1
    logged = [r for r in caplog.records if "on_progress raised" in r.getMessage()]
    assert logged and logged[0].exc_info[0] is FileNotFoundError
    assert "'snapshot' event" in logged[0].getMessage()


def test_a_callback_that_raises_on_every_event_logs_its_traceback_once(tmp_path, caplog):
    """Progress events come twice a second: a callback failing on each is logged with its
    traceback once, then counted (at 10, 100, ... failures), not a traceback per event."""
    job = _job(tmp_path, "every-event")
    calls = []

    def on_progress(event):
        calls.append(event["event"])
        raise ValueError(f"no {event['event']}")

    with caplog.at_level("ERROR", logger="sparkjet.job"):
        result = job.run(on_progress=on_progress)
    assert result.restarts == 0 and result.events_in == TOTAL
    assert len(calls) >= 10
    records = [r for r in caplog.records if "on_progress" in r.getMessage()]
    assert [r.exc_info is not None for r in records] == [True] + [False] * (len(records) - 1)
    assert len(records) == 1 + sum(1 for k in (10, 100, 1000) if len(calls) >= k)
    assert "on_progress has raised 10 times" in records[1].getMessage()
    assert "ValueError: no " in records[1].getMessage()
    _exactly_once(tmp_path)


# -- the local runner's standby member ---------------------------------------------------------

def _standby_of(job, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = job._runner.standby_pid if job._runner is not None else None
        if pid is not None and job.member_pid is not None:
            return pid
        time.sleep(0.02)
    raise AssertionError(f"no standby member within {timeout} s")


def test_a_restart_runs_in_the_standby_member_and_stays_exactly_once(tmp_path):
    """A member that has run a second gets a standby beside it (the next member process,
    its imports done); a kill's restart runs in it instead of a new interpreter, and the
    output stays exactly-once. The standby is gone once the job ends."""
    import os
    import signal

    import psutil

    job = _job(tmp_path, "standby")
    handle = job.submit()
    _wait_for_snapshots(handle)
    standby, first = _standby_of(job), job.member_pid
    assert standby != first and psutil.Process(standby).ppid() == os.getpid()
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while job.member_pid in (None, first) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.member_pid == standby
    result = handle.result(timeout=120)
    assert result.restarts == 1 and [e["status"] for e in result.executions] == ["failed", "ok"]
    _exactly_once(tmp_path)
    assert _members_alive() == []       # the second execution's standby went with the job


def _members_alive() -> list:
    import psutil

    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "sparkjet.runtime.member_main" in child.cmdline() and \
                    child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_standby_that_died_is_replaced_by_a_member_started_afresh(tmp_path):
    import os
    import signal

    job = _job(tmp_path, "standby-died")
    handle = job.submit()
    _wait_for_snapshots(handle)
    standby, first = _standby_of(job), job.member_pid
    os.kill(standby, signal.SIGKILL)
    time.sleep(0.2)
    os.kill(first, signal.SIGKILL)
    result = handle.result(timeout=120)
    assert result.restarts == 1 and [e["status"] for e in result.executions] == ["failed", "ok"]
    _exactly_once(tmp_path)


def test_the_standby_entry_point_ends_when_its_stdin_closes(tmp_path):
    """A standby the supervisor no longer needs (stdin closed without an execution) exits
    at once with code 0, having run nothing."""
    import subprocess
    import sys

    from pyspark import cloudpickle

    job = _job(tmp_path, "unused")
    (tmp_path / "job.pkl").write_bytes(cloudpickle.dumps((job.plan, job.config)))
    done = subprocess.run([sys.executable, "-m", "sparkjet.runtime.member_main", "--standby",
                           str(tmp_path / "job.pkl")], input=b"", capture_output=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and not done.stderr, done.stderr.decode()
    assert not (tmp_path / "snaps").exists()
