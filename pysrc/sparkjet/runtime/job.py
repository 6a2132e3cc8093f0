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
import math
import threading
from collections.abc import Callable

from sparkjet._checks import check_int
from sparkjet.connectors.base import DriverContext
from sparkjet.errors import InvalidArgumentError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime.config import JobConfig, open_store
from sparkjet.runtime.lifecycle import (
    JobCancelledError,
    RunLock,
    check_not_finished,
    mark_finished,
    record_state,
)
from sparkjet.runtime.local_runner import LocalRunner
from sparkjet.runtime.observability import JobMetrics, MetricsServer, ProgressView
from sparkjet.runtime.persistence import force_start
from sparkjet.runtime.restore import log_plan, open_point, plan_restore, start_point
from sparkjet.runtime.snapshotting import read_fingerprint
from sparkjet.runtime.spark_runner import SparkRunner, remove_finished_on_hosts
from sparkjet.runtime.storage import remove_finished
from sparkjet.runtime.supervision import JobFailedError, JobResult, restart_or_fail
from sparkjet.snapshot.layout import check_name as _check_name

_log = logging.getLogger("sparkjet.job")


class Job:
    """A pipeline and its configuration, ready to run."""

    def __init__(self, pipeline: Pipeline, config: JobConfig):
        self.plan = pipeline.plan()
        self.config = config
        self.requested_members: int | None = None
        self._runner: LocalRunner | SparkRunner | None = None
        self._metrics: JobMetrics | None = None
        self._next_metrics: JobMetrics | None = None    # made by submit() for its run
        self._stop: tuple[bool, str | None] | None = None   # (requested, export name)
        self._running = False
        #: while run(metrics_port=...) serves Prometheus: the port it listens on
        self.metrics_port: int | None = None

    @property
    def metrics(self) -> dict | None:
        """The job's metrics as a dict (None before its first run): state, execution,
        members, restarts, events in and out, events per second, late, skipped and
        dead-lettered events, ``offset_resets`` (a source that followed its
        ``on_offset_reset`` past input it no longer held), snapshots and the last one's duration, bytes and alignment,
        ``source_lag_s`` (the wall clock minus the event time of the newest event the
        source furthest behind has read) and ``watermark_lag_s`` (the wall clock minus the
        lowest watermark of the vertices), in seconds, None unless the event time is a
        timestamp column, and per vertex the rows in and out and the watermark reached
        (``watermark_ns`` and, for sources, ``newest_event_ns``: in ns since the epoch,
        for timestamp event times). Live while
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

        ``on_progress(event)`` (an error it raises is logged, and the job goes on)
        receives dicts with an ``"event"`` key: ``execution``,
        ``started`` (with the members' ``pids``), ``restored``, ``fallback`` (the newest
        snapshot failed to verify and an older one is restored, or ``initial_snapshot``
        rolled the job back), ``snapshot``, ``progress``
        (counters, twice a second), ``restart``, ``waiting`` (quorum, or
        ``rebalance_delay``: ``slots_awaited``), ``rebalance`` (lost slots back within
        ``rebalance_delay``, or given up and their partitions' backups promoted).

        ``progress=True`` draws the job's state on one terminal line (a bar when the
        sources are bounded); ``metrics_port`` serves :attr:`metrics` for Prometheus on
        ``http://metrics_host:metrics_port/metrics`` while the job runs (0: any free port,
        then in :attr:`metrics_port`). The ``sparkjet.job`` logger's records (executions,
        restarts, the end) and the members' records carry ``job``, ``execution`` and
        ``member``.

        A run holds the job's snapshot store: a second run of the same job meanwhile is
        refused (:class:`~sparkjet.runtime.lifecycle.JobAlreadyRunningError`), and so is a
        run of a job that already ran to its end there
        (:class:`~sparkjet.runtime.lifecycle.JobFinishedError`).
        """
        # submit() made this run's metrics already, so that its handle shows them at once
        submitted, self._next_metrics = self._next_metrics, None
        try:
            self._check_snapshot()
            check_not_finished(self.config)
        except BaseException:
            if submitted is not None:       # the handle's run ends here
                submitted.finish("failed")
            raise
        self._running = True
        metrics = self._metrics = submitted or JobMetrics(self.config.name,
                                                          _bounded_total(self.plan))
        view = ProgressView(metrics) if progress else None
        server = None
        if metrics_port is not None:
            server = MetricsServer(metrics, check_int("metrics_port", metrics_port, min=0),
                                   metrics_host)
            self.metrics_port = server.port
        context = {"job": self.config.name, "member": "-"}
        callback_errors = [0]
        hosts: set[str] = set()         # whose slots held the job (members' storage)

        def report(event: dict) -> None:
            metrics(event)
            kind = event.get("event")
            if kind == "placed":
                hosts.update(s["host"] for s in event.get("slots", ()) if s.get("host"))
            extra = {**context, "execution": event.get("execution", "-")}
            if kind == "execution":
                _log.info("execution %s starts on %s member(s)%s", event.get("execution"),
                          event.get("members", 1), "" if event.get("restored_from") is None
                          else f", from snapshot {event['restored_from']}", extra=extra)
            elif kind == "restart":
                _log.warning("%s: %s", event.get("message") or f"restart {event.get('attempt')}",
                             event.get("error"), extra=extra)
            elif kind == "waiting":
                _log.warning("%s", event.get("message") or event.get("note")
                             or "waiting for task slots", extra=extra)
            if view is not None:
                view(event)
            if on_progress is not None:
                try:
                    on_progress(event)
                except Exception as e:  # noqa: BLE001 - the caller's error, not the job's
                    # as Spark's listener bus does: logged, the job goes on (raised, it
                    # failed the execution under the callback's error, unnamed); its
                    # traceback once, then a count at 10, 100, 1000... (events come twice
                    # a second, and a callback that fails on one kind fails on every one)
                    callback_errors[0] += 1
                    n = callback_errors[0]
                    if n == 1:
                        _log.exception("on_progress raised on a %r event; the job goes on",
                                       kind, extra=extra)
                    elif math.log10(n).is_integer():
                        _log.error("on_progress has raised %d times (the last on a %r event: "
                                   "%s: %s); the job goes on", n, kind, type(e).__name__, e,
                                   extra=extra)

        try:
            with RunLock(self.config):
                record_state(self.config, "running")
                try:
                    self._prepare_sources()
                    result = self._run(spark, isolated, report)
                except JobCancelledError:
                    record_state(self.config, "cancelled")
                    raise
                except BaseException as e:
                    record_state(self.config, "failed", error=f"{type(e).__name__}: {e}"[:500])
                    raise
                if self._stop is None:
                    finished = mark_finished(self.config, result.events_in)
                    self._cleanup_sources()
                    if finished and self.config.storage == "members":
                        # a rerun is refused: the job's state in the slots serves nothing
                        # (without the mark, a rerun restores from it and reads nothing)
                        with open_store(self.config) as store:
                            log, root = store.incarnation(), store.root
                        remove_finished(self.config, log, root)
                        if spark is not None:     # the other hosts of a cluster
                            remove_finished_on_hosts(spark, self.config, log, root, hosts)
                else:
                    result.stopped, result.export = True, self._export(self._stop[1])
                record_state(self.config, "stopped" if result.stopped else "finished",
                             events_in=result.events_in, export=result.export)
        except JobCancelledError:
            metrics.finish("cancelled")
            raise
        except BaseException:
            metrics.finish("failed")
            _log.error("job %r failed", self.config.name, extra={**context, "execution": "-"})
            raise
        else:
            metrics.finish("stopped" if result.stopped else "finished", result)
            _log.info("job %r finished: %s events in, %s out, %s restart(s)", self.config.name,
                      result.events_in, result.events_out, result.restarts,
                      extra={**context, "execution": "-"})
            return result
        finally:
            self._running = False
            self._stop = None
            if view is not None:
                view.close()
            if server is not None:
                server.close()
                self.metrics_port = None

    def _driver_contexts(self):
        for vertex in self.plan.sources:
            yield vertex.source, DriverContext(self.config.id, self.config.name, vertex.name,
                                               self.config.snapshot_store)

    def _prepare_sources(self) -> None:
        for source, context in self._driver_contexts():
            source.prepare(context)

    def _cleanup_sources(self) -> None:
        for source, context in self._driver_contexts():
            source.cleanup(context)

    def _run(self, spark, isolated: bool, progress: Callable[[dict], None]) -> JobResult:
        if spark is not None:
            runner = SparkRunner(self.plan, self.config, spark, progress)
            self._runner = runner
            # Read after the runner is visible to rescale(), which sets requested_members
            # before it looks for a runner: a rescale racing with this start is not lost.
            runner.requested_members = self.requested_members
        else:
            if self.config.storage == "members" and (self.config.persistence
                                                     or self.config.durable_tier != "none"):
                _log.warning(
                    "job %r runs without Spark: its one member keeps its snapshots in "
                    "snapshot_store %s, and the members' storage settings (persistence, "
                    "durable_tier) apply to jobs on Spark only", self.config.name,
                    self.config.snapshot_store)
            runner = self._runner = LocalRunner(self.plan, self.config, progress)
        if self._stop is not None:       # stop() came before the runner existed
            runner.request_stop(export=self._stop[1] is not None)
        try:
            if spark is None and not isolated:
                return runner.run_in_process()
            return runner.run()
        finally:
            self._runner = None

    # -- lifecycle -----------------------------------------------------------------------

    def submit(self, spark=None, **run_options) -> JobHandle:
        """Starts :meth:`run` in a thread and returns at once a :class:`JobHandle` to watch
        and control the run (status, metrics, stop, suspend, cancel, the result)."""
        return JobHandle(self, spark, run_options)

    def stop(self, snapshot: str | None = None) -> None:
        """Stops the running job gracefully: its next snapshot is the terminal one (the
        sources stop where they are, every sink commits), and ``run`` returns a result with
        ``stopped`` set. With ``snapshot``, that last snapshot is exported under this name
        (kept until deleted, restorable). A new :meth:`run` resumes the job from it."""
        if snapshot is not None:
            _check_name("export name", snapshot)
        if not self._running:
            raise InvalidArgumentError(f"job {self.config.name!r} is not running")
        self._stop = (True, snapshot)
        runner = self._runner
        if runner is not None:
            runner.request_stop(export=snapshot is not None)

    def suspend(self) -> None:
        """Jet's suspend: :meth:`stop` without an export; a new :meth:`run` resumes."""
        self.stop()

    def cancel(self) -> None:
        """Ends the running job now, without a snapshot: ``run`` raises
        :class:`~sparkjet.runtime.lifecycle.JobCancelledError`; a new run resumes from
        the last complete snapshot (under exactly-once, nothing is lost or duplicated)."""
        runner = self._runner
        if runner is not None:
            runner.cancel()

    def _export(self, name: str | None) -> str | None:
        if name is None or self.config.processing_guarantee == "none":
            return None

        with open_store(self.config) as store:
            store.export(None, name)
        return name

    def _check_snapshot(self) -> None:
        """Before any execution starts (every restart would fail the same way): checks
        that the snapshot the job starts from, its own last complete one or
        ``config.initial_snapshot``, verifies (or may be fallen back from, see
        :func:`~sparkjet.runtime.restore.own_start`) and fits this pipeline, vertex by
        vertex and state schema by schema (:mod:`sparkjet.runtime.restore`); logs what
        differs but restores."""
        if self.config.processing_guarantee == "none":
            return

        with open_store(self.config) as store:
            point = start_point(self.config, store, self.plan)
            if point is None:
                return
            source = open_point(self.config, point, store)
            try:
                plan = plan_restore(self.plan, read_fingerprint(source, point), point,
                                    self.config.state_mapping)
            finally:
                if source is not store:
                    source.close()
        log_plan(self.config, point, plan)

    def rescale(self, members: int) -> None:
        """On Spark: restart the running job from its last complete snapshot on ``members``
        members (from then on; still capped by the task slots there are, and never below
        the quorum). State is keyed by partition, so it is the same at any member count."""
        self.requested_members = check_int("members", members, min=1)
        runner = self._runner
        if isinstance(runner, SparkRunner):
            runner.rescale(self.requested_members)

    def force_start(self) -> dict:
        """Hazelcast's force start, for a job of the members' storage that a persistence
        restart refuses (``JobConfig.persistence``, :mod:`sparkjet.runtime.persistence`):
        deletes the job's folder of ``snapshot_store`` (its log, records, exports and table
        versions) and the job's data in every storage slot of this host that no running
        task holds, each path logged as a warning, and marks the store so that every later
        execution has each member (on every host) holding the job's data from before empty
        its slot; the job's execution and snapshot ids go on above the newest that data had
        seen. The next :meth:`run` starts fresh: from the sources' start, every snapshot
        given up. Never done implicitly; refused while the job runs. Returns the paths
        removed (``store``, ``slots``), the slots held by a running task (``held``) and the
        ``floor`` (the newest execution and snapshot ids seen before)."""
        return force_start(self.config, self.plan)


class JobHandle:
    """A job running in a thread of its own (:meth:`Job.submit`)."""

    def __init__(self, job: Job, spark, run_options: dict):
        self.job = job
        self._spark = spark
        self._options = run_options
        self._result: JobResult | None = None
        self._error: BaseException | None = None
        job._running = True     # stop() right after submit() reaches the run
        # the metrics exist from now on ("starting"), not from the run's first event
        job._next_metrics = job._metrics = JobMetrics(job.config.name, _bounded_total(job.plan))
        self._thread = threading.Thread(target=self._run, name=f"sparkjet-{job.config.name}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self.job.run(self._spark, **self._options)
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e
        finally:
            self.job._running = False

    @property
    def status(self) -> str:
        """starting, running, restarting, waiting, finished, stopped, cancelled or failed."""
        m = self.job.metrics
        return "starting" if m is None else m["state"]

    @property
    def metrics(self) -> dict:
        """The job's metrics (:attr:`Job.metrics`), from the moment it was submitted."""
        return self.job.metrics

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> JobResult:
        """Waits for the run to end; returns its result or raises its error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"job {self.job.config.name!r} still runs after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def stop(self, snapshot: str | None = None, timeout: float | None = None) -> JobResult:
        """:meth:`Job.stop`, then waits for the run to end."""
        self.job.stop(snapshot)
        return self.result(timeout)

    def suspend(self, timeout: float | None = None) -> JobResult:
        self.job.suspend()
        return self.result(timeout)

    def cancel(self, timeout: float | None = None) -> None:
        """:meth:`Job.cancel`, then waits for the run to end."""
        self.job.cancel()
        self._thread.join(timeout)

    def resume(self) -> JobHandle:
        """A new run of the stopped, suspended or cancelled job, from its last snapshot."""
        if not self.done():
            raise InvalidArgumentError(f"job {self.job.config.name!r} is still running")
        return self.job.submit(self._spark, **self._options)


def _bounded_total(plan) -> int | None:
    """How many events the job's sources hold, when every one is bounded and says so."""
    totals = [getattr(v.source, "total", None) for v in plan.sources]
    if not totals or any(not isinstance(t, int) for t in totals):
        return None
    return sum(totals)


# JobFailedError, JobResult and restart_or_fail live in supervision (both runners use them);
# they stay importable from here, where they were first.
__all__ = ["Job", "JobFailedError", "JobHandle", "JobResult", "restart_or_fail"]
