"""Job: runs a pipeline under a supervisor that restarts its member from the last complete
snapshot when it dies.

``Job(pipeline, config).run()`` starts the member in a child process (so that a crash, a
``kill -9`` or an out-of-memory kill of the member never takes the supervisor with it),
follows its progress, and, when it dies, starts a new execution (a new execution id, the
fencing token) that restores the last complete snapshot, rewinds the sources and resolves the
sink transactions. ``run(isolated=False)`` runs one execution in this process instead.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkjet.errors import SparkjetError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime.config import JobConfig


class JobFailedError(SparkjetError, RuntimeError):
    """The job could not finish: its member kept failing past ``max_restarts``."""


@dataclass
class JobResult:
    """What a run did, across all its executions."""

    job_id: int
    executions: list[dict] = field(default_factory=list)   # each member's metrics (or failure)
    restarts: int = 0
    seconds: float = 0.0

    @property
    def events_in(self) -> int:
        return sum(e.get("events_in", 0) for e in self.executions)

    @property
    def events_out(self) -> int:
        return sum(e.get("events_out", 0) for e in self.executions)

    @property
    def snapshots(self) -> list[dict]:
        return [s for e in self.executions for s in e.get("snapshots", [])]

    def latency_percentiles(self, *qs: float, until: str = "commit") -> list[float]:
        """Latency percentiles in seconds, from an event's creation (its ``ts``) to the
        commit of the output it led to (``until="commit"``: when a transactional sink
        makes it visible) or to the moment the output is handed to the sink
        (``until="emit"``: what an idempotent or at-least-once sink sees)."""
        import numpy as np

        field = {"commit": "latencies_ns", "emit": "emit_latencies_ns"}[until]
        samples = [x for e in self.executions for x in e.get(field, [])]
        if not samples:
            return [float("nan")] * len(qs)
        return [float(np.percentile(samples, q)) / 1e9 for q in qs]


def restart_or_fail(config: JobConfig, result: JobResult, attempt: int, outcome: dict,
                    progress, start: float) -> None:
    """The restart policy of both supervisors (a child process, or Spark): after failure
    number ``attempt``, raises JobFailedError past ``max_restarts``; otherwise reports the
    restart and waits ``restart_backoff * 2**(attempt - 1)`` s, at most 30."""
    if attempt > config.max_restarts:
        result.seconds = time.monotonic() - start
        raise JobFailedError(f"job {config.name!r} failed {attempt} times (max_restarts="
                             f"{config.max_restarts}); last failure: {outcome.get('error')}")
    result.restarts += 1
    delay = min(30.0, config.restart_backoff * 2 ** (attempt - 1))
    progress({"event": "restart", "attempt": attempt, "after_s": delay,
              "error": outcome.get("error"), "guarantee": config.processing_guarantee,
              "note": None if config.processing_guarantee != "none" else
              "guarantee 'none': no snapshot; the sources restart from their start"})
    time.sleep(delay)


class Job:
    """A pipeline and its configuration, ready to run."""

    def __init__(self, pipeline: Pipeline, config: JobConfig):
        self.plan = pipeline.plan()
        self.config = config
        self.member_pid: int | None = None    # the member process (without Spark)
        self.member_pids: dict[int, int] = {}  # member index -> Python worker pid (on Spark)
        self.requested_members: int | None = None
        self._runner = None

    def __repr__(self) -> str:
        return f"Job({self.config.name!r}, guarantee={self.config.processing_guarantee!r})"

    def run(self, spark=None, *, isolated: bool = True, on_progress=None) -> JobResult:
        """Runs the job to the end of its (bounded) source; returns what happened. Raises
        JobFailedError when it fails more than ``max_restarts`` times.

        With a Spark session, every execution is one Spark barrier stage of
        ``config.members`` members and the coordinator runs here, on the driver
        (:mod:`sparkjet.runtime.spark_runner`). Without one, the job runs as one member in
        a child process (``isolated=False``: in this process, with no restarts): a quick
        way to try a pipeline without Spark.

        ``on_progress(event)`` receives dicts with an ``"event"`` key: ``execution``,
        ``started`` (with the members' ``pids``), ``restored``, ``snapshot``, ``progress``
        (counters, twice a second on Spark), ``restart``, ``waiting`` (quorum).
        """
        progress = on_progress or (lambda event: None)
        if spark is not None:
            from sparkjet.runtime.spark_runner import SparkRunner

            self._runner = SparkRunner(self, spark, progress)
            try:
                return self._runner.run()
            finally:
                self._runner = None
        result = JobResult(self.config.id)
        start = time.monotonic()
        if not isolated:
            from sparkjet.runtime.member import Member

            result.executions.append(Member(self.plan, self.config, self._next_execution(0),
                                            progress=progress).run())
            result.seconds = time.monotonic() - start
            return result
        from pyspark import cloudpickle

        with tempfile.TemporaryDirectory(prefix="sparkjet-job-") as work:
            work = Path(work)
            (work / "job.pkl").write_bytes(cloudpickle.dumps((self.plan, self.config)))
            attempt = 0
            while True:
                execution = self._next_execution(attempt)
                outcome = self._run_member(work, execution, progress)
                result.executions.append(outcome)
                if outcome.get("status") == "ok":
                    break
                attempt += 1
                restart_or_fail(self.config, result, attempt, outcome, progress, start)
        result.seconds = time.monotonic() - start
        return result

    def rescale(self, members: int) -> None:
        """On Spark: restart the running job from its last complete snapshot on ``members``
        members (from then on; still capped by the task slots there are, and never below
        the quorum). State is keyed by partition, so it is the same at any member count."""
        if not isinstance(members, int) or isinstance(members, bool) or members < 1:
            from sparkjet.errors import InvalidArgumentError

            raise InvalidArgumentError(f"members must be an int >= 1, got {members!r}")
        self.requested_members = members
        runner = self._runner
        if runner is not None:
            runner.rescale(members)

    def _next_execution(self, attempt: int) -> int:
        if self.config.processing_guarantee == "none":
            return attempt
        from sparkjet.snapshot_store import SnapshotStore

        current = SnapshotStore(self.config.snapshot_store, self.config.id).current_execution()
        return 0 if current is None else current + 1

    def _run_member(self, work: Path, execution: int, progress) -> dict:
        events = work / f"events-{execution}.jsonl"
        out = work / f"result-{execution}.json"
        cmd = [sys.executable, "-m", "sparkjet.runtime.member_main", str(work / "job.pkl"),
               str(execution), str(out), str(events)]
        # stderr goes to a file, not a pipe: a member that writes more than a pipe holds
        # would block on it while the supervisor waits for the member to end.
        log_path = work / f"member-{execution}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stderr=log)
        self.member_pid = proc.pid
        seen = 0
        try:
            while proc.poll() is None:
                seen = _forward(events, seen, progress)
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
            return {"status": "ok", **json.loads(out.read_text())}
        why = (f"killed by signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        metrics = {}
        partial = work / f"result-{execution}.partial.json"
        if partial.exists():
            metrics = json.loads(partial.read_text())
        last = stderr_tail.strip().splitlines()[-1] if stderr_tail.strip() else ""
        return {**metrics, "status": "failed", "execution_id": execution,
                "error": f"member {why}" + (f": {last}" if last else "")}


def _forward(path: Path, seen: int, progress) -> int:
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

