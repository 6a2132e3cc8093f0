"""Jobs on Spark: every execution is one Spark barrier stage, restarted by the driver.

``Job(pipeline, config).run(spark)`` runs each execution of the job as one barrier stage of
``members`` tasks (``DataFrame.mapInArrow(..., barrier=True)``, so it also works where only
the DataFrame API exists). Task *i* is member *i*: it builds its share of the
:class:`~sparkjet.runtime.topology.Topology` (source processors, and the keyed processors of
the Hazelcast partitions the partition table gives it), opens an
:class:`~sparkjet.runtime.exchange.ExchangeServer`, learns its peers' addresses from the
coordinator (the ``join`` action: a few milliseconds once all members have joined, where
``BarrierTaskContext.allGather`` took a second of every execution's start; the barrier
stage still starts every member at once), restores its partitions of the last complete
snapshot, and runs; batches and barriers cross between members over Arrow Flight, with
backpressure.

The coordinator runs on the driver (:class:`~sparkjet.runtime.coordinator.ExecutionCoordinator`):
it starts snapshots at the interval, collects the phase-1 acknowledgements, commits, runs
phase 2 and reports progress. Spark does not retry a failed barrier result stage, so the
driver does: when a member fails (an exception, a killed Python worker, a lost executor, a
member silent past ``heartbeat_timeout``) it cancels the stage, registers a new execution
id (the fencing token of store and sinks), and starts a new stage that restores the last
complete snapshot, rewinds the sources and resolves the sink transactions -- on as many
members as there are task slots (rescaling), never fewer than the quorum
``floor(largest member count seen / 2) + 1`` (split-brain protection): below it, the
driver waits for slots and says so.

The snapshot store (and file sinks) must be a path every executor and the driver reach:
any local path on ``local[N]``; a shared file system, HDFS or an object store on a cluster.
With the members' storage (``storage="members"``) only the driver opens the store: the
join answer hands each member the snapshot to start from with its committed record, the
members read the chunk files from their slots and their peers' (and the store's durable
copies through the driver), phase 2 hands every slot the committed record, and the slots
fence themselves; the one write a member makes there is the durable tier's copy
(``durable_tier="sync"``, or ``"async"``'s uploads after the commit), which needs no log.

A Spark Connect session (``SparkSession.builder.remote(...)``) works too: it has no
``sparkContext``, so the runner asks only the session (:mod:`sparkjet.spark.session`): its
configuration, its tags for cancelling, the DataFrame API for the stage. Its coordinator
runs in the client process (where ``Job.run`` is called), which the executors must reach
(``JobConfig.coordinator_host``); the snapshot store must be reachable from the client too.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from sparkjet.errors import RecoveryRefusedError, StorageSlotError
from sparkjet.pipeline.dag import Dag
from sparkjet.runtime.config import JobConfig, open_store
from sparkjet.runtime.coordinator import ExecutionCoordinator, ExecutionFailedError, short_error
from sparkjet.runtime.exchange.security import LinkSecurity, TLSIdentity
from sparkjet.runtime.failures import is_deterministic, transient_kind
from sparkjet.runtime.failures import report as failure_report
from sparkjet.runtime.lifecycle import JobCancelledError
from sparkjet.runtime.observability import LatencyHistogram, add_vertex_counts
from sparkjet.runtime.persistence import first_snapshot, wait_for_slots
from sparkjet.runtime.persistence import recover as persistence_recover
from sparkjet.runtime.restore import handed_start, own_start, report_fallback
from sparkjet.runtime.supervision import (
    JobFailedError,
    JobResult,
    next_execution,
    restart_or_fail,
)
from sparkjet.runtime.topology import Topology
from sparkjet.spark import session as _session

_log = logging.getLogger("sparkjet.runtime")


def available_slots(spark) -> int:
    """How many tasks the cluster can run at once now (the executors' cores over
    ``spark.task.cpus``; ``local[N]``: N), on a classic or a Spark Connect session."""
    return _session.task_slots(spark)


def coordinator_host(config: JobConfig, spark) -> str:
    """Where the coordinator listens and its members dial: ``config.coordinator_host``;
    else the driver's host on a classic session, and on a Spark Connect session (the
    coordinator runs in this client, maybe far from the server's driver) this machine's
    address on the route to the Connect server."""
    if config.coordinator_host is not None:
        return config.coordinator_host
    if _session.is_connect(spark):
        return _session.route_address(spark.client.host)
    return spark.conf.get("spark.driver.host", None) or "127.0.0.1"


class SparkRunner:
    """Runs ``plan`` under ``config`` on the Spark session ``spark``, reporting to
    ``progress``; see the module doc.

    ``requested_members`` is the member count asked for by a rescale (None: ``config.members``
    or every slot). ``member_pids`` maps each member of the running execution to the pid
    of its Python worker (empty between executions)."""

    def __init__(self, plan: Dag, config: JobConfig, spark, progress: Callable[[dict], None],
                 *, requested_members: int | None = None):
        self.plan = plan
        self.config = config
        self.spark = spark
        self.progress = progress
        self.requested_members = requested_members
        self.member_pids: dict[int, int] = {}
        self.max_members_seen = 0
        self.current: ExecutionCoordinator | None = None
        #: whether the links are TLS, and the user's own certificate if given (else one is
        #: made here on the driver for every execution)
        self.connect = _session.is_connect(spark)
        self.master = _session.master(spark)
        self.host = coordinator_host(config, spark)
        # The links stay on one machine only with a local master and, on Spark Connect, a
        # coordinator (client) on the server's machine too.
        one_machine = self.master.startswith("local") and (
            not self.connect or _session.is_loopback(self.host))
        self.tls, self.user_tls = tls_settings(config, one_machine)
        self._warned = False
        self._stop_requested = False
        self._export_requested = False
        self.cancelled = False
        #: with persistence: whether an execution of this run has started, so its slots
        #: were verified (later executions' members skip it: their restore checks every
        #: chunk it reads, and a restart is what recovery time is measured on)
        self._loaded = False
        #: ``rebalance_delay``: when the last execution lost a member (its failure), and
        #: how many slots its placement had; the next one waits for as many task slots
        #: until the delay is over (see members_for_next_execution)
        self._lost: tuple[float, int] | None = None

    def request_stop(self, export: bool = False) -> None:
        """Stops the job gracefully: its next snapshot is the terminal one (``export``: to
        be exported, so with the members' storage its files go into the store too)."""
        self._export_requested = self._export_requested or export
        self._stop_requested = True
        coord = self.current
        if coord is not None:
            coord.export_requested = self._export_requested
            coord.stop_requested.set()

    def cancel(self) -> None:
        """Ends the running execution now, without a snapshot; no restart follows."""
        self.cancelled = True
        coord = self.current
        if coord is not None:
            coord.fail(JobCancelledError("the job was cancelled"))

    def rescale(self, members: int) -> None:
        """Restarts the running execution from its last snapshot on ``members`` members."""
        self.requested_members = members
        # A deliberate resize is not a split: the requested size is the new baseline of
        # the quorum (failures afterwards are judged against it).
        self.max_members_seen = members
        coord = self.current
        if coord is not None:
            coord.fail(_RescaleRequested(f"rescale to {members} member(s) requested"))

    @property
    def quorum(self) -> int:
        return self.max_members_seen // 2 + 1 if self.max_members_seen else 1

    def members_for_next_execution(self) -> int:
        """The member count of the next execution: the slots there are (up to
        ``config.members``), waiting while that is below the quorum (``quorum_timeout``,
        which does not count the wait for a lost member's host: ``rebalance_delay``)."""
        config = self.config
        deadline = time.monotonic() + config.quorum_timeout
        said = None
        while True:
            slots = available_slots(self.spark)
            wanted = self.requested_members or config.members or slots
            n = min(wanted, slots)
            # rebalance_delay: after a lost member, fewer task slots than the lost
            # execution's slots wait (as below the quorum) for its host to come back
            short = (self._lost is not None and not self.cancelled and not self._stop_requested
                     and n < min(self._lost[1], self.requested_members or config.members
                                 or self._lost[1])
                     and time.monotonic() < self._lost[0] + (config.rebalance_delay or 0))
            if (n >= self.quorum and n >= 1 and not short) or self.cancelled:
                return n        # cancelled: the caller raises JobCancelledError
            if short and said != ("rebalance", slots):
                said = ("rebalance", slots)
                left = self._lost[0] + config.rebalance_delay - time.monotonic()
                self.progress({"event": "waiting", "slots": slots, "quorum": self.quorum,
                               "max_members_seen": self.max_members_seen,
                               "rebalance_delay": config.rebalance_delay,
                               "note": f"{slots} slot(s) where the lost execution had "
                                       f"{self._lost[1]}: waiting up to {left:.1f} s more "
                                       "(rebalance_delay) for the lost member's host to come "
                                       "back before its partitions' backups are promoted"})
            if short:
                # the delay is a budget of its own: quorum_timeout counts none of it
                slept = time.monotonic()
                time.sleep(min(1.0, max(0.05, self._lost[0] + config.rebalance_delay
                                        - time.monotonic())))
                deadline += time.monotonic() - slept
                continue
            if time.monotonic() >= deadline:
                raise JobFailedError(
                    f"job {config.name!r}: split-brain protection: {slots} task slot(s) "
                    f"available, but the quorum is {self.quorum} members (more than half of the "
                    f"largest member count seen, {self.max_members_seen}); waited "
                    f"{config.quorum_timeout:.0f} s (quorum_timeout)")
            if said != slots:  # once per change, not once per check
                said = slots
                self.progress({"event": "waiting", "slots": slots, "quorum": self.quorum,
                               "max_members_seen": self.max_members_seen,
                               "note": f"only {slots} slot(s) for a quorum of {self.quorum}: "
                                       "waiting for executors to come back"})
            time.sleep(max(1.0, config.restart_backoff))

    def run(self) -> JobResult:
        """Runs executions until one ends well; raises JobFailedError once the restart
        policy gives up (a rescale is a restart that does not count as a failure)."""
        config = self.config
        result = JobResult(config.id)
        start = time.monotonic()
        attempt, execution = 0, None
        if config.storage == "members" and config.persistence:
            # a persistence restart waits (validation_timeout) for its slots' hosts
            with open_store(config) as store:
                wait_for_slots(config, store, lambda: available_slots(self.spark),
                               self.progress)
        while True:
            members = self.members_for_next_execution()
            if self.cancelled:      # while it waited (rebalance_delay)
                raise JobCancelledError(f"job {config.name!r} was cancelled (execution "
                                        f"{execution}); it resumes from its last snapshot")
            execution = next_execution(config, len(result.executions), execution)
            outcome = self.execute(execution, members)
            result.executions.append(outcome)
            if outcome["status"] == "ok":
                break
            if outcome["status"] == "rescaled":
                continue
            if self.cancelled:
                raise JobCancelledError(f"job {config.name!r} was cancelled (execution "
                                        f"{execution}); it resumes from its last snapshot")
            attempt += 1
            restart_or_fail(config, result, attempt, outcome, self.progress, start)
        result.seconds = time.monotonic() - start
        return result

    def execute(self, execution: int, members: int) -> dict:
        """Runs one execution as one barrier stage; returns its outcome (never raises for
        a failure of the execution itself)."""
        config, plan, spark = self.config, self.plan, self.spark
        started = time.monotonic()
        store, restore_from, fallback = None, None, None
        start, start_store, log, root = None, None, None, None
        try:
            if config.processing_guarantee != "none":
                store = open_store(config)
                store.register_execution(execution)
                if config.storage == "members":
                    log, root = store.incarnation(), store.root
                restore_from, fallback = own_start(config, store, plan, execution)
                if config.storage == "members":
                    # the members never open the store: the join answer hands them the
                    # snapshot to start from, with its record
                    _, start_store, start = handed_start(config, store, restore_from)
        except Exception as e:  # noqa: BLE001 - a failure of this execution: the policy decides
            # A full disk or an object store's outage as the execution registers (or finds
            # its snapshot) is the execution's failure, retried or not by its kind, never
            # a raw error out of Job.run.
            if store is not None:
                store.close()
            failure = failure_report(e)
            self.progress({"event": "execution", "execution": execution, "members": members,
                           "quorum": self.quorum, "restored_from": None, "tls": self.tls})
            return {"execution_id": execution, "members": members, "restored_from": None,
                    "status": "failed", **failure, "cause": failure["error"],
                    "error": f"execution {execution} could not start: {short_error(e)}",
                    "failed_member": None, "events_in": 0, "events_out": 0, "snapshots": [],
                    "seconds": time.monotonic() - started}
        topology = Topology(members, config.local_parallelism, plan, config.partition_count)
        # A fresh secret (and certificate) per execution: a zombie of an older one cannot
        # even be heard.
        tls = self.user_tls or (TLSIdentity.self_signed() if self.tls else None)
        security = LinkSecurity.generate(execution, tls)
        recover = None
        if config.storage == "members" and config.persistence and store is not None:
            def recover(reports, start=start, store=store):
                return persistence_recover(config, store, plan, execution, start, reports,
                                           self.progress)
        coord = ExecutionCoordinator(config, execution, topology, host=self.host, security=security,
                                     store=store, progress=self.progress, start=start,
                                     start_store=start_store, recover=recover,
                                     lost_at=None if self._lost is None else self._lost[0])
        if config.storage == "members":  # records then keep what drivers read without slots
            coord.snapshots.plan = json.dumps(plan.fingerprint())
        task = member_task(plan, config, execution, topology, restore_from, coord.location,
                           security, verify=not self._loaded, log=log, store=root)
        member_refusals: list[int] = []
        # The stage's tag: interruptTag cancels it, on a classic session and over Spark
        # Connect alike (a job group needs the SparkContext). Tags are per thread.
        tag = f"sparkjet-{config.id}-e{execution}"

        def stage() -> None:
            try:
                spark.addTag(tag)
                if not self.connect:
                    # Connect's server interrupts its task threads on cancel by itself
                    spark.sparkContext.setInterruptOnCancel(True)
                df = spark.range(0, members, 1, members)
                rows = df.mapInArrow(task, "member long, refused long", barrier=True).collect()
                member_refusals.extend(r["refused"] for r in rows)
            except BaseException as e:  # noqa: BLE001 - handed to the coordinator
                coord.stage_error = e
            finally:
                coord.stage_ended.set()

        thread = threading.Thread(target=stage, name=f"sparkjet-stage-e{execution}", daemon=True)
        ticker_stop = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(coord, ticker_stop), daemon=True,
                                  name="sparkjet-progress")
        if not self.master.startswith("local") and not self._warned:
            self._warned = True
            warning = spark_security_warning(spark.conf)
            if warning is not None:
                _log.warning("%s", warning)
                self.progress({"event": "warning", "message": warning})
        self.progress({"event": "execution", "execution": execution, "members": members,
                       "quorum": self.quorum, "restored_from": restore_from,
                       "tls": self.tls})
        self.current = coord
        if self._stop_requested:
            coord.export_requested = self._export_requested
            coord.stop_requested.set()
        thread.start()
        # "interrupted" stays when Ctrl-C (or any BaseException) ends the wait: the stage is
        # cancelled on the way out, and the interrupt goes on to the caller
        outcome = {"execution_id": execution, "members": members, "restored_from": restore_from,
                   "status": "interrupted"}
        if fallback is not None:
            outcome["fallback"] = report_fallback(config, fallback, self.progress, execution)
        try:
            coord.wait_started(start_wait(config, not self._loaded))
            self._loaded = True
            if coord.start is not start:    # the persistence restart took another snapshot
                restore_from = outcome["restored_from"] = (
                    None if coord.start is None else coord.start["snapshot"])
                if coord.start is not None and coord.start.get("fallback"):
                    outcome["fallback"] = coord.start["fallback"]   # the async tier's
            self.max_members_seen = max(self.max_members_seen, members)
            self.member_pids = dict(coord.pids)
            self.progress({"event": "started", "execution": execution, "members": members,
                           "pids": dict(coord.pids), "seconds": time.monotonic() - started})
            # ("restored" comes from the coordinator, once every member rebuilt its state)
            ticker.start()
            # after a force start, above every snapshot id of the data it gave up
            coord.run(first_snapshot(store, restore_from) if store is not None
                      and config.storage == "members" else
                      0 if restore_from is None else restore_from + 1)
            outcome["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - the execution failed; the caller restarts
            outcome["status"] = "rescaled" if isinstance(e, _RescaleRequested) else "failed"
            # named whole: a refusal or a slot's error says which partitions, slots and
            # what to do, past short_error's three lines (a member's failure is its own)
            outcome["error"] = (
                str(e) if isinstance(e, ExecutionFailedError) else
                f"{type(e).__name__}: {e}" if isinstance(e, (RecoveryRefusedError,
                                                             StorageSlotError)) else
                short_error(e))
            report = getattr(e, "report", None) or {}
            deterministic = is_deterministic(e)
            outcome.update(deterministic=deterministic,
                           transient=None if deterministic else transient_kind(e),
                           traceback=report.get("traceback"),
                           exception=bool(report.get("exception")), cause=report.get("error"),
                           failed_member=report.get("member"))
        finally:
            self.current = None
            ticker_stop.set()
            coord.close()
            if outcome["status"] != "ok":
                spark.interruptTag(tag)
            # The stage ends once Spark has killed (or finished) its tasks, freeing their
            # slots. Don't wait long: a member that cannot be killed yet (stopped, or its
            # executor unreachable) must not hold up the restart; the next stage waits in
            # Spark's scheduler for the slots it needs.
            thread.join(10.0)
            if start_store is not None and start_store is not store:
                start_store.close()
            if store is not None:
                store.close()
            self.member_pids = {}
        if coord.recovery is not None:
            outcome["recovery"] = coord.recovery
        if coord.rebalance is not None:
            outcome["rebalance"] = {k: v for k, v in coord.rebalance.items() if k != "event"}
        if coord._placement is not None:    # this execution's slots were placed
            self._lost = None
        if (outcome["status"] == "failed" and config.rebalance_delay
                and coord._placement is not None):
            self._lost = (time.monotonic(), len(coord._placement["slots"]))
        events_in, events_out = coord.counters()
        done = coord.done.values()
        ok = outcome["status"] == "ok"
        outcome.update(
            events_in=sum(d.get("events_in", 0) for d in done) if ok else events_in,
            events_out=sum(d.get("events_out", 0) for d in done) if ok else events_out,
            late_events=sum(d.get("late_events", 0) for d in done),
            skipped_events=sum(d.get("skipped_events", 0) for d in done),
            vertices=functools.reduce(add_vertex_counts,
                                      (d.get("vertices") or {} for d in done), {}),
            dead_letters=sum(d.get("dead_letters", 0) for d in done),
            offset_resets=sum(d.get("offset_resets", 0) for d in done),
            latencies_ns=LatencyHistogram.merged(d.get("latencies_ns") for d in done),
            emit_latencies_ns=LatencyHistogram.merged(d.get("emit_latencies_ns") for d in done),
            snapshots=list(coord.snapshots.records), seconds=time.monotonic() - started,
            refused_calls=sum(coord.server.refused.values()) + sum(member_refusals))
        return outcome

    def _tick(self, coord: ExecutionCoordinator, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            events_in, events_out = coord.counters()
            self.progress({"event": "progress", "execution": coord.execution_id,
                           "events_in": events_in, "events_out": events_out,
                           "members": coord.member_counters()})


class _RescaleRequested(ExecutionFailedError):
    """Ends an execution on purpose: the next one runs on another member count."""


def tls_settings(config: JobConfig, one_machine: bool) -> tuple[bool, TLSIdentity | None]:
    """Whether the job's links are TLS (``config.tls``; None: on unless every link stays
    on ``one_machine``: a ``local`` master), and the user's certificate if one was given."""
    if config.tls_certificate is not None:
        return True, TLSIdentity.from_files(config.tls_certificate, config.tls_private_key,
                                            config.tls_server_name)
    return (config.tls if config.tls is not None else not one_machine), None


def spark_security_warning(conf) -> str | None:
    """Why the execution's credentials would cross the network readable, or None: they
    travel in Spark's task closures, which Spark encrypts only when asked to. ``conf``:
    the session's ``spark.conf`` (or a ``SparkConf``)."""
    missing = [key for key in ("spark.authenticate", "spark.network.crypto.enabled")
               if (conf.get(key, None) or "false").lower() != "true"]
    if not missing:
        return None
    return (f"{' and '.join(missing)} off on a cluster: Spark sends the job's task closures, "
            "which carry the links' secret and key, in the clear; turn them on (see the "
            "README's Security section)")


#: How long the end of a job waits for the stage that empties the other hosts' slots.
REMOVE_FINISHED_WAIT = 30.0


def remove_finished_on_hosts(spark, config: JobConfig, log: str | None,
                             store: str | None = None, hosts=()) -> list[str]:
    """After a run of ``config``'s job to its end on a cluster: one stage of four tasks per
    task slot of the cluster (an executor that is slow to take tasks, or busy with one,
    leaves them to the others, and every executor that is up gets some), the first task
    on each host removing the job's data of the store's log ``log`` (and store root
    ``store``) from the free slots of its host
    (:func:`~sparkjet.runtime.storage.remove_finished`; a slot still held is waited for,
    up to half of :data:`REMOVE_FINISHED_WAIT`); the slots' paths emptied. ``hosts``: the
    hosts whose slots held the job (its placements): while some of them ran no task (a
    bounced worker whose executor is not back yet), the stage runs again, a second
    apart. On ``local[N]`` the driver's host is the only one, and the driver does it.
    Best effort and bounded: not a barrier stage (which would wait for every slot of a
    busy cluster to be free at once), everything within :data:`REMOVE_FINISHED_WAIT` s;
    a host the stages did not reach keeps the data until its ``storage_dir`` is cleaned
    (logged), and a failed stage is logged, never raised (the job's output is
    committed)."""
    if config.storage != "members" or log is None or _session.master(spark).startswith("local"):
        return []
    deadline = time.monotonic() + REMOVE_FINISHED_WAIT
    removed: list[str] = []
    reached: set[str] = set()
    while True:
        rows = _remove_finished_stage(spark, config, log, store, deadline)
        if rows is None:
            return sorted(removed)
        reached |= {r["host"] for r in rows}
        removed += [r["slot"] for r in rows if r["slot"] is not None]
        missing = sorted(set(hosts) - reached)
        if not missing or time.monotonic() + 1.0 >= deadline:
            break
        time.sleep(1.0)
    if missing:
        _log.warning("finished job %r: no executor ran on host(s) %s within %.0f s; their "
                     "slots keep the job's data until their storage_dir is cleaned",
                     config.name, ", ".join(missing), REMOVE_FINISHED_WAIT)
    return sorted(removed)


def _remove_finished_stage(spark, config: JobConfig, log: str, store: str | None,
                           deadline: float) -> list | None:
    """One stage of :func:`remove_finished_on_hosts`: a row per host that ran it (slot
    None) and per slot emptied; None when the stage failed or was cancelled (logged)."""
    tasks = 4 * _session.task_slots(spark)
    wait = REMOVE_FINISHED_WAIT / 2

    def task(batches):
        # imported where the task runs, in a Spark Python worker (pickled by value)
        import fcntl

        import pyarrow as pa

        from sparkjet.runtime.storage import remove_finished
        from sparkjet.snapshot.slots import host_id
        for _ in batches:
            pass
        removed: list[str] = []
        here: list[str] = []
        root = config.storage_root()
        try:
            os.makedirs(root, exist_ok=True)
            fd = os.open(os.path.join(root, f".finished-{config.id:016x}"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            fd = None
        if fd is not None:
            try:
                # one task per host does it; the others find the lock held and leave
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                removed = remove_finished(config, log, store, wait=wait)
                here = [host_id()]
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
        yield pa.RecordBatch.from_pydict({
            "host": pa.array(here + [host_id()] * len(removed), pa.string()),
            "slot": pa.array([None] * len(here) + removed, pa.string())})

    tag = f"sparkjet-{config.id}-finished"
    timer = threading.Timer(max(0.0, deadline - time.monotonic()),
                            lambda: spark.interruptTag(tag))
    timer.daemon = True
    try:
        spark.addTag(tag)
        timer.start()
        return spark.range(0, tasks, 1, tasks).mapInArrow(
            task, "host string, slot string").collect()
    except Exception as e:  # noqa: BLE001 - best effort, the job is done
        _log.warning("finished job %r: its data on the cluster's hosts was not removed (%s); "
                     "it stays in their storage_dir until cleaned", config.name,
                     short_error(e))
        return None
    finally:
        timer.cancel()
        spark.removeTag(tag)


def member_task(plan, config, execution: int, topology: Topology, restore_from, coordinator: str,
                security: LinkSecurity, verify: bool = True, log: str | None = None,
                store: str | None = None):
    """The function each barrier task runs (``mapInArrow``): member ``partitionId()``. The
    execution's credentials travel inside it (the pickled closure), never through Spark's
    configuration, job descriptions or UI. ``verify``: with persistence, the member checks
    its slot's replicas against the records before it joins (the first execution of a run).
    ``log``: which log of the job's snapshot store the execution is in (the members'
    storage: a slot's data of another log is given up, :func:`claim_slot`); ``store``: the
    snapshot store's root (a slot holding a job of the same name in another store is
    left to it)."""

    def task(batches):
        # Imported where the task runs, in a Spark Python worker (this function is pickled
        # by value): BarrierTaskContext exists only there, and the exchange loads
        # pyarrow.flight, which importing the runtime on the driver does not need.
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
        from sparkjet.runtime.member import Member
        from sparkjet.runtime.observability import log_to
        from sparkjet.runtime.persistence import after_join, claim, join_report, reclaim
        from sparkjet.runtime.resync import MerkleHolder
        from sparkjet.runtime.storage import (
            decode_table,
            slot_read_handler,
            slot_table_handlers,
            slot_write_handler,
        )
        from sparkjet.snapshot import chunks

        chunks.warm(config.snapshot_codec)
        for _ in batches:  # one row per task; nothing to read
            pass
        ctx = BarrierTaskContext.get()
        index = ctx.partitionId()
        log_to(sys.stderr, job=config.name, execution=execution, member=index)
        host = ctx.getTaskInfos()[index].address.rsplit(":", 1)[0] or "127.0.0.1"
        try:
            # None: the state is in the shared store
            slot, notes = claim(config, execution, log, store)
        except Exception as e:
            _report_before_join(coordinator, security, index, e)
            raise
        late = _LateMember(start_wait(config, verify))
        held = _SlotRef(slot)

        given_up = []   # (slot, its report): left for a reclaimed slot, not yet let go

        def claim_instead(uuids):
            # rebalance_delay: the driver waits for a lost slot of the previous table,
            # which may be back on this host: this member takes it instead of its own. Its
            # own stays claimed, untouched, until the driver has taken the report of the
            # new one (release_given_up): the driver places over the slot it knows of.
            nonlocal slot, notes, report
            got = reclaim(config, uuids, execution, log)
            if got is None:
                return None
            new, new_notes = got
            try:
                new_report = join_report(config, new, new_notes, execution, verify)
            except BaseException:
                new.release()
                raise
            given_up.append((slot, report))
            slot, notes, report = new, new_notes, new_report
            held.slot = slot
            return report

        def release_given_up():
            # the driver holds the reclaimed slot's report: the one left goes
            while given_up:
                old, old_report = given_up.pop()
                try:
                    if not old_report.get("table"):  # a fresh slot: nothing of the job to keep
                        old.remove_job(config.id)
                finally:
                    old.release()   # whatever happens: a reused Python worker must not keep it
        try:
            if slot is None:
                late.set(Member(plan, config, execution, topology=topology, index=index,
                                restore_from=restore_from))
            server = ExchangeServer(host, inbound=late.inbound, execution_id=execution,
                                    security=security, on_error=late.on_exchange_error)
            if slot is not None:    # peers read, and back up into, this member's slot
                server.on_get("slot_read", slot_read_handler(held, config.id))
                server.on_put("slot_write", slot_write_handler(held, config.id))
                # the reference table versions every slot keeps (table joins)
                keep, put, get = slot_table_handlers(held, config.id)
                server.on_action("slot_table", keep)
                server.on_put("slot_table", put)
                server.on_get("slot_table", get)
                # and sync a stale replica of theirs from it by Merkle trees
                MerkleHolder(held, config.id).register(server)
            try:
                client = ExchangeClient(coordinator, security=security, action_timeout=30.0)
                report = None if slot is None else join_report(config, slot, notes,
                                                               execution, verify)
                answer = join(client, index, server.location, start_wait(config, verify),
                              report, claim_instead if slot is not None else None,
                              release_given_up)
                if slot is not None:
                    after_join(config, slot, answer, execution)
                    # placed after join: the driver's table over the members' slots
                    table = decode_table(answer["table"], "the driver's join answer")
                    slot.write_table(config.id, table.to_bytes())
                    late.set(Member(plan, config, execution,
                                    topology=topology.with_placement(table, answer["slots"]),
                                    index=index, restore_from=restore_from, slot=slot,
                                    start=answer.get("start")))
                member = late.member
                member.connect(answer["peers"], coordinator, security)
                member.run()  # its metrics reach the driver with the "done" action
            finally:
                server.close(timeout=5.0)
        finally:
            late.abandon()
            if slot is not None:
                slot.release()  # a reused Python worker must not keep it
            for old, _ in given_up:     # the driver never took the reclaimed one: kept whole
                old.release()
        refused = sum(server.refused.values())
        yield pa.RecordBatch.from_pydict({"member": pa.array([index], pa.int64()),
                                          "refused": pa.array([refused], pa.int64())})

    return task


def start_wait(config: JobConfig, verify: bool = True) -> float:
    """How long the members of an execution may take to start: ``start_timeout``, and with
    persistence ``data_load_timeout`` more when they verify their slots before they join
    (``verify``: the first execution of a run; the restarts after it do not verify). A
    ``rebalance_delay`` the driver holds the joins for comes on top only when it does
    (:meth:`~sparkjet.runtime.coordinator.ExecutionCoordinator.wait_started`, :func:`join`)."""
    if config.storage == "members" and config.persistence and verify:
        return config.start_timeout + config.data_load_timeout
    return config.start_timeout


def _report_before_join(coordinator: str, security: LinkSecurity, index: int,
                        error: BaseException) -> None:
    """Tells the coordinator that member ``index`` failed before it joined (its slot
    could not be claimed), with the error's report: the task's own failure reaches the
    driver only inside the Spark stage's, unclassified, so a refusal a replay repeats (a
    foreign slot) would be retried and end the job named as a Py4J error."""
    from sparkjet.runtime.exchange import ExchangeClient  # where the task runs: loads Flight

    try:
        client = ExchangeClient(coordinator, security=security, action_timeout=10.0)
        try:
            client.action("failed", {"member": index, **failure_report(error), "link": False})
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - best effort: the stage's failure still ends it
        _log.warning("could not tell the coordinator member %d failed: %s", index, error)


class _LateMember:
    """The member of a task, set once it is built: with the members' storage that is after
    join (its topology comes with the join answer), while its exchange server must listen
    before. A peer's stream that arrives in between waits for it (up to ``timeout`` s)."""

    def __init__(self, timeout: float):
        self.member = None
        self._timeout = timeout
        self._ready = threading.Event()

    def set(self, member) -> None:
        self.member = member
        self._ready.set()

    def abandon(self) -> None:
        self._ready.set()   # streams still waiting find no member and are refused

    def inbound(self, vertex: str, processor: int):
        if not self._ready.wait(self._timeout) or self.member is None:
            return None
        return self.member.inbound(vertex, processor)

    def on_exchange_error(self, error) -> None:
        if self.member is not None:
            self.member.on_exchange_error(error)
        else:
            _log.warning("inbound stream broke before the member was built: %s", error)


class _SlotRef:
    """The slot a member's exchange handlers serve: its claimed slot, or the lost one it
    claimed instead while the driver waited (``rebalance_delay``) before it was placed."""

    def __init__(self, slot):
        self.slot = slot

    def __getattr__(self, name):
        return getattr(self.slot, name)


def join(coordinator, index: int, location: str, timeout: float,
         slot: dict | None = None, reclaim=None, reclaimed=None) -> dict:
    """Member ``index``'s exchange ``location`` (and, with the members' storage, its
    ``slot`` report) to the ``coordinator`` (an
    :class:`~sparkjet.runtime.exchange.ExchangeClient`); returns the answer once all have
    joined: ``peers``, every member's location by index (and ``table`` and ``slots``, the
    placement over the slots, and ``start``, the snapshot to start from with its committed
    record: :func:`~sparkjet.runtime.restore.handed_start`). Gives up after ``timeout`` s (the driver's
    ``start_timeout`` fails the execution by then), counted again from every answer that
    says the driver holds the joins (``held``: ``rebalance_delay``). An answer naming lost
    slots of the previous partition table (``reclaim``, while ``rebalance_delay`` runs) is
    handed to ``reclaim``, which returns the report of the one it claimed instead, or None;
    ``reclaimed`` is called once the driver has taken that report (its next answer): the
    slot left may go then."""
    deadline = time.monotonic() + timeout
    body = {"member": index, "location": location}
    if slot is not None:
        body["slot"] = slot
    pending = False
    while True:
        answer = coordinator.action("join", body)
        if pending and reclaimed is not None:
            reclaimed()
        pending = False
        if answer["peers"] is not None:
            return answer
        if answer.get("held"):
            deadline = max(deadline, time.monotonic() + timeout)
        if answer.get("reclaim") and reclaim is not None:
            report = reclaim(list(answer["reclaim"]))
            if report is not None:
                body["slot"] = report
                pending = True
        if time.monotonic() > deadline:
            raise ExecutionFailedError(f"member {index}: the other members did not join "
                                       f"within {timeout:.0f} s (start_timeout)")


__all__ = ["SparkRunner", "available_slots", "coordinator_host", "join", "member_task"]
