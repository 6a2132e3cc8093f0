"""Jobs without Spark: one member in a child process, restarted by a local supervisor.

:class:`LocalRunner` starts the member as ``python -m sparkjet.runtime.member_main`` (so
that a crash, a ``kill -9`` or an out-of-memory kill of the member never takes the
supervisor with it), forwards its progress events, and, when it dies, starts a new
execution (a new execution id, the fencing token) that restores the last complete snapshot,
rewinds the sources and resolves the sink transactions, as the restart policy of
:mod:`~sparkjet.runtime.supervision` allows. :meth:`LocalRunner.run_in_process` runs one
execution in this process instead, with no restarts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sparkjet.pipeline.dag import Dag
from sparkjet.runtime.config import JobConfig
from sparkjet.runtime.lifecycle import JobCancelledError
from sparkjet.runtime.member import Member
from sparkjet.runtime.observability import latencies_decoded
from sparkjet.runtime.supervision import JobResult, next_execution, restart_or_fail

#: The supervisor's pid, which the local runner puts in its member's environment (here,
#: not in member_main: importing that module as part of this package made ``python -m``
#: run a second copy of it, and warn so on every member's stderr).
SUPERVISOR_ENV = "SPARKJET_SUPERVISOR_PID"

#: A member gets a standby started beside it once it has committed a snapshot (or run
#: STANDBY_LATEST seconds, for a job without snapshots), and run STANDBY_AFTER seconds: the
#: next member process, started ahead of need, which imports the runtime and loads the job
#: (about a second of a restart: interpreter, numpy, pyarrow, sparkjet) and then waits for
#: an execution. (Not at once: most short jobs never restart, and a member's start and
#: restore should not share the CPUs with another's imports.)
STANDBY_AFTER = 1.0
STANDBY_LATEST = 10.0


class LocalRunner:
    """Runs ``plan`` under ``config`` as one member, reporting to ``progress``.

    ``member_pid`` is the pid of the running member process (None between executions and
    when the member runs in this process). A job that may restart (``max_restarts`` > 0)
    keeps a standby member process ready once its member runs (:data:`STANDBY_AFTER`),
    ``standby_pid``, so that a restart does not wait for a new interpreter."""

    def __init__(self, plan: Dag, config: JobConfig, progress: Callable[[dict], None]):
        self.plan = plan
        self.config = config
        self.progress = progress
        self.member_pid: int | None = None
        self.logs: Path | None = None   # where failed members' logs are kept
        self._stop_requested = False
        self.cancelled = False
        self._stop_file: Path | None = None
        self._member: Member | None = None
        self._proc = None
        self._standby: tuple[subprocess.Popen, Path] | None = None   # (process, its log)
        self._standbys = 0

    @property
    def standby_pid(self) -> int | None:
        """The pid of the standby member process (None: there is none)."""
        standby = self._standby
        return standby[0].pid if standby is not None else None

    def request_stop(self, export: bool = False) -> None:
        """Stops the job gracefully: its next snapshot is the terminal one (``export``: it
        is to be exported; the shared store holds it whole already)."""
        self._stop_requested = True
        if self._member is not None:
            self._member.stop_requested.set()
        if self._stop_file is not None:
            self._stop_file.touch()

    def cancel(self) -> None:
        """Ends the running execution now, without a snapshot (the member is killed); no
        restart follows."""
        self.cancelled = True
        if self._member is not None:
            self._member.fail(JobCancelledError("the job was cancelled"))
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        self._drop_standby()

    def run(self) -> JobResult:
        """Runs executions in child processes until one ends well; raises JobFailedError
        once the restart policy gives up."""
        # pyspark's cloudpickle pickles the plan's functions (lambdas included); imported
        # here so that importing the runtime does not import pyspark.
        from pyspark import cloudpickle

        result = JobResult(self.config.id)
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="sparkjet-job-") as work:
            work = Path(work)
            (work / "job.pkl").write_bytes(cloudpickle.dumps((self.plan, self.config)))
            attempt, execution = 0, None
            try:
                while True:
                    execution = next_execution(self.config, attempt, execution)
                    outcome = self._run_member(work, execution)
                    result.executions.append(outcome)
                    if outcome.get("status") == "ok":
                        break
                    if self.cancelled:
                        raise JobCancelledError(
                            f"job {self.config.name!r} was cancelled (execution "
                            f"{execution}); it resumes from its last snapshot")
                    attempt += 1
                    restart_or_fail(self.config, result, attempt, outcome, self.progress, start)
            finally:
                self._drop_standby()
        result.seconds = time.monotonic() - start
        return result

    def run_in_process(self) -> JobResult:
        """Runs one execution in this process (no child, no restart): its failure raises."""
        result = JobResult(self.config.id)
        start = time.monotonic()
        execution = next_execution(self.config, 0)
        self.progress({"event": "execution", "execution": execution, "members": 1})
        member = self._member = Member(self.plan, self.config, execution, progress=self.progress)
        if self._stop_requested:
            member.stop_requested.set()
        result.executions.append(member.run())
        result.seconds = time.monotonic() - start
        return result

    def _run_member(self, work: Path, execution: int) -> dict:
        self.progress({"event": "execution", "execution": execution, "members": 1})
        events = work / f"events-{execution}.jsonl"
        out = work / f"result-{execution}.json"
        self._stop_file = work / "stop"
        if self._stop_requested:
            self._stop_file.touch()
        taken = self._take_standby([execution, str(out), str(events), str(self._stop_file)])
        if taken is not None:
            proc, log_path = taken
        else:
            cmd = [sys.executable, "-m", "sparkjet.runtime.member_main", str(work / "job.pkl"),
                   str(execution), str(out), str(events), str(self._stop_file)]
            log_path = work / f"member-{execution}.log"
            proc = self._start(cmd, log_path)
        self._proc = proc
        self.member_pid = proc.pid
        seen = 0
        started = time.monotonic()
        standby = self.config.max_restarts > 0
        committed = []

        def progress(event: dict) -> None:
            if event.get("event") == "snapshot":
                committed.append(True)
            self.progress(event)

        try:
            while proc.poll() is None:
                seen = _forward(events, seen, progress)
                ran = time.monotonic() - started
                if standby and ran >= STANDBY_AFTER and (committed or ran >= STANDBY_LATEST):
                    standby = False
                    self._start_standby(work)
                time.sleep(0.05)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            self.member_pid = None
        stderr_tail = log_path.read_text(errors="replace")[-4000:]
        _forward(events, seen, progress)
        if proc.returncode == 0 and out.exists():
            return {"status": "ok", **latencies_decoded(json.loads(out.read_text()))}
        why = (f"killed by signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        metrics = {}
        partial = work / f"result-{execution}.partial.json"
        if partial.exists():
            metrics = latencies_decoded(json.loads(partial.read_text()))
        failure = metrics.pop("failure", None) or {}
        # The work directory goes when the run ends: a failed member's log is kept.
        if self.logs is None:
            self.logs = Path(tempfile.mkdtemp(prefix=f"sparkjet-{_safe(self.config.name)}-logs-"))
        kept = self.logs / log_path.name
        shutil.copyfile(log_path, kept)
        if failure.get("error"):
            error = failure["error"]
        else:
            last = stderr_tail.strip().splitlines()[-1] if stderr_tail.strip() else ""
            error = f"member {why}" + (f": {last}" if last else "")
        return {**metrics, **failure, "status": "failed", "execution_id": execution, "failed_member": 0,
                "error": error, "cause": failure.get("error"), "log": str(kept)}

    def _start(self, cmd: list[str], log_path: Path, **popen) -> subprocess.Popen:
        # stderr goes to a file, not a pipe: a member that writes more than a pipe holds
        # would block on it while the supervisor waits for the member to end.
        with open(log_path, "w") as log:
            return subprocess.Popen(cmd, stderr=log,
                                    env={**os.environ, SUPERVISOR_ENV: str(os.getpid())},
                                    **popen)

    def _start_standby(self, work: Path) -> None:
        if self._standby is not None or self.cancelled or self._stop_requested:
            return
        self._standbys += 1
        log_path = work / f"member-standby-{self._standbys}.log"
        cmd = [sys.executable, "-m", "sparkjet.runtime.member_main", "--standby",
               str(work / "job.pkl")]
        self._standby = (self._start(cmd, log_path, stdin=subprocess.PIPE), log_path)

    def _take_standby(self, args: list) -> tuple[subprocess.Popen, Path] | None:
        """The standby member, told to run the execution ``args`` describe; None when
        there is none, or it has ended (its log then says why; the member is started
        afresh)."""
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        proc, log_path = standby
        try:
            if proc.poll() is not None:
                raise BrokenPipeError(f"the standby member ended ({proc.returncode})")
            proc.stdin.write(json.dumps(args).encode() + b"\n")
            proc.stdin.close()
        except OSError:
            proc.kill()
            proc.wait()
            return None
        return proc, log_path

    def _drop_standby(self) -> None:
        """Ends the standby member: killed, since it holds nothing yet (waiting for it to
        read a closed stdin would wait out its imports)."""
        standby, self._standby = self._standby, None
        if standby is None:
            return
        proc = standby[0]
        proc.kill()
        proc.wait()
        try:
            proc.stdin.close()
        except OSError:
            pass        # a pipe to a killed process may refuse the flush: nothing was in it


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:40] or "job"


def _forward(path: Path, seen: int, progress: Callable[[dict], None]) -> int:
    """Hands ``progress`` the complete lines of the member's event file past byte
    ``seen``; returns the new position."""
    if not path.exists():
        return seen
    with open(path) as f:
        f.seek(seen)
        for line in f:
            if line.endswith("\n"):
                progress(json.loads(line))
                seen += len(line.encode())
            else:
                break
    return seen


__all__ = ["LocalRunner"]
