"""Job: a pipeline and its configuration, run under a supervisor that restarts it from the
last complete snapshot when it fails.

``Job(pipeline, config).run(spark)`` runs every execution as a Spark barrier stage
(:class:`~sparkjet.runtime.spark_runner.SparkRunner`); ``run()`` without a session runs
the job as one member in a child process (:class:`~sparkjet.runtime.local_runner.LocalRunner`),
and ``run(isolated=False)`` runs one execution in this process. Both supervisors share the
result type and restart policy of :mod:`~sparkjet.runtime.supervision`, whose
:class:`JobResult` and :class:`JobFailedError` are also importable from here.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from sparkjet._checks import check_int
from sparkjet.observability import JobMetrics, MetricsServer, ProgressView
from sparkjet.pipeline import Pipeline
from sparkjet.runtime.config import JobConfig
from sparkjet.runtime.lifecycle import RunLock, check_not_finished, mark_finished
from sparkjet.runtime.local_runner import LocalRunner
from sparkjet.runtime.spark_runner import SparkRunner
from sparkjet.runtime.supervision import JobFailedError, JobResult, restart_or_fail

_log = logging.getLogger("sparkjet.job")


class Job:
    """A pipeline and its configuration, ready to run."""

    def __init__(self, pipeline: Pipeline, config: JobConfig):
        self.plan = pipeline.plan()
        self.config = config
        self.requested_members: int | None = None
        self._runner: LocalRunner | SparkRunner | None = None
        self._metrics: JobMetrics | None = None
        #: while run(metrics_port=...) serves Prometheus: the port it listens on
        self.metrics_port: int | None = None

    @property
    def metrics(self) -> dict | None:
        """The job's metrics as a dict (None before its first run): state, execution,
        members, restarts, events in and out, events per second, late, skipped and
        dead-lettered events, snapshots and the last one's duration, bytes and alignment,
        and per vertex the rows in and out and the watermark reached. Live while
        :meth:`run` runs (from another thread), final after it."""
        return None if self._metrics is None else self._metrics.as_dict()

    def __repr__(self) -> str:
        return f"Job({self.config.name!r}, guarantee={self.config.processing_guarantee!r})"

    @property
    def member_pid(self) -> int | None:
        """Without Spark: the pid of the running member process (None between executions)."""
        runner = self._runner
        return runner.member_pid if isinstance(runner, LocalRunner) else None

    @property
    def member_pids(self) -> dict[int, int]:
        """On Spark: member index -> the pid of its Python worker, for the running execution
        (empty between executions)."""
        runner = self._runner
        return runner.member_pids if isinstance(runner, SparkRunner) else {}

    def run(self, spark=None, *, isolated: bool = True,
            on_progress: Callable[[dict], None] | None = None, progress: bool = False,
            metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> JobResult:
        """Runs the job to the end of its (bounded) source; returns what happened. Raises
        JobFailedError when it fails more than ``max_restarts`` times.

        With a Spark session, every execution is one Spark barrier stage of
        ``config.members`` members and the coordinator runs here, on the driver
        (:mod:`sparkjet.runtime.spark_runner`). Without one, the job runs as one member in
        a child process (``isolated=False``: in this process, with no restarts): a quick
        way to try a pipeline without Spark (:mod:`sparkjet.runtime.local_runner`).

        ``on_progress(event)`` receives dicts with an ``"event"`` key: ``execution``,
        ``started`` (with the members' ``pids``), ``restored``, ``snapshot``, ``progress``
        (counters, twice a second), ``restart``, ``waiting`` (quorum).

        ``progress=True`` draws the job's state on one terminal line (a bar when the
        sources are bounded); ``metrics_port`` serves :attr:`metrics` for Prometheus on
        ``http://metrics_host:metrics_port/metrics`` while the job runs (0: any free port,
        then in :attr:`metrics_port`). Records of the ``sparkjet`` loggers carry ``job``,
        ``execution`` and ``member``.

        A run holds the job's snapshot store: a second run of the same job meanwhile is
        refused (:class:`~sparkjet.runtime.lifecycle.JobAlreadyRunningError`), and so is a
        run of a job that already ran to its end there
        (:class:`~sparkjet.runtime.lifecycle.JobFinishedError`).
        """
        self._check_snapshot()
        check_not_finished(self.config)
        metrics = self._metrics = JobMetrics(self.config.name, _bounded_total(self.plan))
        view = ProgressView(metrics) if progress else None
        server = None
        if metrics_port is not None:
            server = MetricsServer(metrics, check_int("metrics_port", metrics_port, min=0),
                                   metrics_host)
            self.metrics_port = server.port
        context = {"job": self.config.name, "member": "-"}

        def report(event: dict) -> None:
            metrics(event)
            kind = event.get("event")
            extra = {**context, "execution": event.get("execution", "-")}
            if kind == "execution":
                _log.info("execution %s starts on %s member(s)%s", event.get("execution"),
                          event.get("members", 1), "" if event.get("restored_from") is None
                          else f", from snapshot {event['restored_from']}", extra=extra)
            elif kind == "restart":
                _log.warning("restart %s in %.1f s after: %s", event.get("attempt"),
                             event.get("after_s", 0.0), event.get("error"), extra=extra)
            elif kind == "waiting":
                _log.warning("%s", event.get("message") or "waiting for task slots", extra=extra)
            if view is not None:
                view(event)
            if on_progress is not None:
                on_progress(event)

        try:
            with RunLock(self.config):
                result = self._run(spark, isolated, report)
                mark_finished(self.config, result.events_in)
        except BaseException:
            metrics.finish("failed")
            _log.error("job %r failed", self.config.name, extra={**context, "execution": "-"})
            raise
        else:
            metrics.finish("finished", result)
            _log.info("job %r finished: %s events in, %s out, %s restart(s)", self.config.name,
                      result.events_in, result.events_out, result.restarts,
                      extra={**context, "execution": "-"})
            return result
        finally:
            if view is not None:
                view.close()
            if server is not None:
                server.close()
                self.metrics_port = None

    def _run(self, spark, isolated: bool, progress: Callable[[dict], None]) -> JobResult:
        if spark is not None:
            runner = SparkRunner(self.plan, self.config, spark, progress)
            self._runner = runner
            # Read after the runner is visible to rescale(), which sets requested_members
            # before it looks for a runner: a rescale racing with this start is not lost.
            runner.requested_members = self.requested_members
        else:
            runner = self._runner = LocalRunner(self.plan, self.config, progress)
        try:
            if spark is None and not isolated:
                return runner.run_in_process()
            return runner.run()
        finally:
            self._runner = None

    def _check_snapshot(self) -> None:
        """Refuses, before any execution starts, to restore a snapshot that a pipeline of
        another shape took (every restart would fail the same way)."""
        if self.config.processing_guarantee == "none":
            return
        from sparkjet.runtime.member import check_snapshot_shape
        from sparkjet.snapshot_store import SnapshotStore

        with SnapshotStore(self.config.snapshot_store, self.config.id) as store:
            check_snapshot_shape(self.plan, store, self.config.id)

    def rescale(self, members: int) -> None:
        """On Spark: restart the running job from its last complete snapshot on ``members``
        members (from then on; still capped by the task slots there are, and never below
        the quorum). State is keyed by partition, so it is the same at any member count."""
        self.requested_members = check_int("members", members, min=1)
        runner = self._runner
        if isinstance(runner, SparkRunner):
            runner.rescale(self.requested_members)


def _bounded_total(plan) -> int | None:
    """How many events the job's sources hold, when every one is bounded and says so."""
    totals = [getattr(v.source, "total", None) for v in plan.sources]
    if not totals or any(not isinstance(t, int) for t in totals):
        return None
    return sum(totals)


# JobFailedError, JobResult and restart_or_fail live in supervision (both runners use them);
# they stay importable from here, where they were first.
__all__ = ["Job", "JobFailedError", "JobResult", "restart_or_fail"]
