"""A throwaway Spark standalone cluster on this machine: one master and N worker JVMs.

:class:`StandaloneCluster` starts them with the ``spark-class`` script of the installed
``pyspark`` package, all bound to 127.0.0.1 on free ports, each in its own process group,
with its worker, log and work folders in a temporary folder it owns. It is for tests that
need what ``local[N]`` cannot give: executors in separate JVMs that can be killed, and
barrier stages whose tasks run in different executors::

    with StandaloneCluster(workers=2) as cluster:      # start() waits for every worker
        spark = cluster.session("demo")                # in a process without a SparkContext
        ...
        cluster.kill_worker(0)                         # SIGKILL: its executor is lost too
        cluster.restart_worker(0)

Everything it started is killed by :meth:`StandaloneCluster.stop` (also run at exit, and by
the context manager). Master and worker JVMs started from the main thread also get
``SIGKILL`` from the kernel when the process that started them dies (``PR_SET_PDEATHSIG``,
set by a small exec trampoline), their executors then exit by themselves (see below), so
even a test process killed by ``SIGKILL`` leaks no JVM; only its temporary folder stays.

What happens to an executor when its worker is killed
------------------------------------------------------
An executor is a ``CoarseGrainedExecutorBackend`` JVM, a child process of its worker JVM
(same process group). When the worker exits normally (``SIGTERM``), its shutdown hook kills
the executors (they log "RECEIVED SIGNAL TERM"). ``SIGKILL`` runs no hook, but a standalone
executor is started with ``--worker-url`` and watches its worker (``WorkerWatcher``): when
the RPC connection to the worker drops it exits by itself ("WorkerWatcher: Lost connection
to worker rpc endpoint spark://Worker@... Exiting."). Verified here (Spark 4.3, Java 17):
the executor JVM was gone 0.1-0.25 s after its worker's ``SIGKILL``, and the driver failed
the running barrier stage 0.1 s after the kill with ``ExecutorLostFailure (executor N
exited unrelated to the running tasks) Reason: worker lost: 127.0.0.1:PORT got
disassociated``: the master notices the dead worker as soon as its connection drops (not
after ``spark.worker.timeout``), marks it DEAD in ``/json`` and tells the driver.

:meth:`StandaloneCluster.kill_worker` still checks it: it waits up to ``executor_grace``
seconds for the worker's executors to exit and ``SIGKILL`` s those that did not (the
watcher cannot act in an executor that is stopped, hung in GC, or whose worker's port is
still held open; such an executor would keep running tasks the master no longer accounts
for, a zombie member and a leaked JVM, already reparented away from any worker). It returns
a :class:`WorkerKill` saying which happened. The executor's Python daemon
(``pyspark.daemon``, in a process group of its own) exits when the executor's end of its
stdin closes.

Gotcha: an executor's ``stdout``/``stderr`` files in the work folder are written by its
worker JVM (it reads the executor's pipes), so after a worker is killed the executor's last
log lines (its watcher's exit message) are missing from them.

Settings for running sparkjet members as barrier tasks on a cluster
-------------------------------------------------------------------
A barrier stage (``df.mapInArrow(f, schema, barrier=True)`` or ``rdd.barrier()``) launches
all its tasks at once or not at all, one member per task, and any task failure fails the
whole stage attempt (all its tasks are killed and the stage is retried as a whole). On a
standalone, YARN or Kubernetes cluster:

- **Slots.** A barrier stage of ``n`` tasks needs ``n`` free task slots at the same time;
  an executor has ``spark.executor.cores // spark.task.cpus`` slots. Use
  ``spark.task.cpus`` = ``spark.executor.cores`` for one member per executor (a member that
  is also a failure domain), or smaller for several members per executor JVM. On
  standalone, ``spark.cores.max`` caps the cores the application takes (set it to
  ``n * spark.task.cpus`` or more); on YARN/Kubernetes use ``spark.executor.instances``.
- **Dynamic allocation off**: ``spark.dynamicAllocation.enabled=false`` (the default on
  standalone; on Kubernetes and some YARN distributions it is on). Spark refuses a barrier
  stage with dynamic allocation on (SPARK-24942).
- **The slot check.** At job submission Spark checks the cluster has at least ``n`` slots;
  while it has not (executors still starting, an executor lost) it re-checks every
  ``spark.scheduler.barrier.maxConcurrentTasksCheck.interval`` (default 15s) up to
  ``spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures`` times (default 40) before
  failing the job. Lower the interval (1s here) and size ``maxFailures`` to how long a
  member group may wait for executors.
- **Executors before the first job**: ``spark.scheduler.minRegisteredResourcesRatio=1.0``
  with ``spark.scheduler.maxRegisteredResourcesWaitingTime`` makes session creation wait for
  the executors (standalone counts cores against ``spark.cores.max``, so set it too).
- **Failures.** A failed barrier task fails the stage attempt; the stage is retried up to
  ``spark.stage.maxConsecutiveAttempts`` (default 4) times, all members restarted.
  ``spark.task.maxFailures`` does not bound barrier retries. When sparkjet restores the
  members from its own snapshots, ``spark.stage.maxConsecutiveAttempts=1`` fails the job at
  the first lost member and leaves recovery to sparkjet; otherwise a retried attempt
  waits for enough slots (after losing an executor, until the cluster manager replaces it).
- **No speculation** (``spark.speculation=false``, the default): a speculative copy of a
  member would be a second member with the same id.
- **Locality**: ``spark.locality.wait=0`` for barrier stages, so delay scheduling never
  holds back part of a stage whose tasks must all start together.
- **Member lifetime.** A long-running member must not be mistaken for a dead executor:
  keep ``spark.network.timeout`` > ``spark.executor.heartbeatInterval`` (defaults 120s and
  10s) and ``BarrierTaskContext.barrier()``/``allGather`` calls under
  ``spark.barrier.sync.timeout`` (default 365 days). A killed task's Python worker is
  killed after ``spark.python.task.killTimeout`` (default 2s).
- **Python**: ``spark.pyspark.python`` (or ``PYSPARK_PYTHON``) must name an interpreter
  that exists on every executor host, with sparkjet installed.
- **YARN**: ``spark.yarn.maxAppAttempts=1`` unless the driver itself is meant to be
  restarted; ``spark.executor.memoryOverhead`` must cover the member's native and Arrow
  memory (Python memory is outside the JVM heap). **Kubernetes**: the same overhead
  setting, and ``spark.kubernetes.allocation.batch.size`` >= the member count so the
  executor pods of one barrier stage come up together.
"""
from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from sparkjet._checks import check_int
from sparkjet.errors import (
    InvalidArgumentError,
    StandaloneClusterError,  # noqa: F401 (defined there; named here too)
)
from sparkjet.spark.java import ensure_java

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "FAST_START_JAVA_OPTS",
    "SESSION_DEFAULTS",
    "StandaloneCluster",
    "StandaloneClusterError",
    "WorkerKill",
]

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"

#: What :meth:`StandaloneCluster.session` sets besides the master, the executor size and
#: ``spark.cores.max``; its ``conf`` overrides these. ``spark.task.maxFailures=1`` makes a
#: failed task of an ordinary stage fail its job at once, as a failed barrier task fails its
#: stage attempt (how often that is retried is ``spark.stage.maxConsecutiveAttempts``).
SESSION_DEFAULTS = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.memory": "1g",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.task.cpus": "1",
    "spark.task.maxFailures": "1",
    "spark.dynamicAllocation.enabled": "false",
    "spark.speculation": "false",
    "spark.locality.wait": "0s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "60",
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
}

#: JVM options that start a JVM with less CPU (client JIT only, serial GC): for the master
#: and worker daemons, and for short test drivers and executors on a small machine
#: (``spark.driver.extraJavaOptions`` / ``spark.executor.extraJavaOptions``).
FAST_START_JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

#: Errors of one poll of the master's /json/ while it starts or restarts: try again.
_TRANSIENT = (OSError, ValueError, http.client.HTTPException)


@dataclass
class WorkerKill:
    """What :meth:`StandaloneCluster.kill_worker` did: the worker JVM it signalled, the
    executor JVMs that worker had, whether they all exited by themselves (within
    ``seconds``) or some had to be killed (``killed_executors``)."""

    worker: int
    worker_pid: int
    signal: int
    executor_pids: list[int]
    executors_exited_by_themselves: bool
    seconds: float
    killed_executors: list[int] = field(default_factory=list)
    #: ``time.monotonic()`` when the signal was sent (what a measurement of recovery
    #: counts from)
    signalled_at: float = 0.0


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen
    port: int
    webui_port: int
    log: Path
    executors_seen: set[int] = field(default_factory=set)


class StandaloneCluster:
    """A local Spark standalone cluster: a master and ``workers`` worker JVMs of ``cores``
    cores and ``memory`` memory each (a Spark size: ``"1g"``, ``"512m"``).

    ``work_dir`` is where the logs (``logs/``) and the workers' folders (``work/``, where
    executors run and write their ``stdout``/``stderr``) go; by default a temporary folder
    that :meth:`stop` removes (a given ``work_dir`` is kept). ``daemon_memory`` is the heap
    of the master and worker JVMs themselves (``SPARK_DAEMON_MEMORY``), ``daemon_java_opts``
    their JVM options (``SPARK_DAEMON_JAVA_OPTS``, also used for ``spark-class``'s launcher
    JVM; by default :data:`FAST_START_JAVA_OPTS`, as these JVMs do little work).

    Worker ``i`` runs with ``SPARKJET_HOST_ID=worker-i`` and ``SPARKJET_STORAGE_DIR`` set to
    :meth:`storage_dir` ``(i)``, which its executors inherit: with ``storage="members"`` each
    worker is a host with storage of its own, as on a real cluster.

    ``network``: a started :class:`sparkjet.testing.netns.Network` with at least
    ``workers`` hosts: worker ``i`` (and its executors and their Python workers, the
    members) runs in host ``i``'s network namespace, bound to its address; the master and
    the driver of :meth:`session` bind the network's gateway (the root namespace's address on
    the bridge), so each worker's links can be cut by :mod:`sparkjet.testing.nemesis`.
    None (the default): everything on 127.0.0.1.
    """

    def __init__(
        self,
        workers: int = 3,
        cores: int = 1,
        memory: str = "1g",
        work_dir: str | os.PathLike | None = None,
        *,
        daemon_memory: str = "512m",
        daemon_java_opts: str = FAST_START_JAVA_OPTS,
        network=None,
    ):
        workers = check_int("workers", workers, min=1)
        cores = check_int("cores", cores, min=1)
        if not isinstance(memory, str) or not memory.strip():
            raise InvalidArgumentError(f"memory must be a Spark size like '1g', got {memory!r}")
        self.workers = workers
        if network is not None and len(network.hosts) < workers:
            raise InvalidArgumentError(
                f"the network has {len(network.hosts)} host(s) for {workers} workers "
                "(start it first, with a host per worker)")
        self.network = network
        #: The address the master and the driver bind (the gateway with a network).
        self.host = network.gateway if network is not None else "127.0.0.1"
        self.cores = cores
        self.memory = memory.strip()
        self.daemon_memory = daemon_memory
        self.daemon_java_opts = daemon_java_opts
        self._given_dir = None if work_dir is None else Path(work_dir)
        self._dir: Path | None = None
        self._master: subprocess.Popen | None = None
        self._master_log: Path | None = None
        self._master_port = 0
        self._webui_port = 0
        self._workers: list[_Worker | None] = [None] * workers
        self._generation = 0
        self._lock = threading.RLock()
        self._atexit_registered = False
        self._owner_pid = os.getpid()
        self._spark_home = _spark_home()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, timeout: float = 60) -> StandaloneCluster:
        """Start the master, then every worker, and wait (up to ``timeout`` seconds) until
        the master's ``/json`` lists every worker ALIVE. Raises
        :class:`StandaloneClusterError` with the logs' tails (and stops what it started) if
        a process exits or the time runs out. Returns the cluster."""
        with self._lock:
            if self._master is not None:
                raise StandaloneClusterError("the cluster is already started")
            ensure_java()
            deadline = time.monotonic() + timeout
            self._owner_pid = os.getpid()
            self._make_dirs()
            if not self._atexit_registered:
                atexit.register(self.stop)
                self._atexit_registered = True
            try:
                self._start_master(deadline)
                for i in range(self.workers):
                    self._spawn_worker(i)
                self._wait_workers(range(self.workers), deadline)
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        """Kill every process of the cluster (workers with their executors, then the
        master) with ``SIGKILL``, wait for them to be gone, and remove the temporary
        folder. Safe to call twice, and on a cluster that never started. Does nothing in
        a forked child of the process that started the cluster."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            procs = [w.proc for w in self._workers if w is not None]
            if self._master is not None:
                procs.append(self._master)
            pgids = [p.pid for p in procs]
            seen = [pid for w in self._workers if w is not None for pid in w.executors_seen]
            for pgid in pgids:
                _kill_group(pgid, signal.SIGKILL)
            # Anything that left the groups (pyspark daemons make their own) but still runs
            # in the cluster's folders: executors, their Python workers.
            leftovers = set(seen) | set(self._processes_under_dir())
            for pid in leftovers:
                _kill(pid, signal.SIGKILL)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                pending = [pid for pid in leftovers if _alive(pid)]
                pending += [pid for pid in self._processes_under_dir() if _alive(pid)]
                groups = [g for g in pgids if _group_alive(g)]
                if not pending and not groups:
                    break
                for pid in pending:
                    _kill(pid, signal.SIGKILL)
                for pgid in groups:
                    _kill_group(pgid, signal.SIGKILL)
                time.sleep(0.05)
            self._master = None
            self._workers = [None] * self.workers
            if self._dir is not None and self._given_dir is None:
                shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            if self._atexit_registered:
                atexit.unregister(self.stop)
                self._atexit_registered = False

    def __enter__(self) -> StandaloneCluster:  # noqa: PYI034 (Self needs Python 3.11)
        if self._master is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what is running -----------------------------------------------------------

    @property
    def master_url(self) -> str:
        """``spark://HOST:PORT`` (127.0.0.1, or the network's gateway), for
        ``SparkSession.builder.master``."""
        self._require_started()
        return self._url()

    @property
    def webui_url(self) -> str:
        """The master's web UI, ``http://127.0.0.1:PORT`` (``/json/`` for its state)."""
        self._require_started()
        return f"http://{self.host}:{self._webui_port}"

    @property
    def work_dir(self) -> Path:
        """The folder holding ``logs/`` and the workers' ``work/`` folders."""
        self._require_started()
        assert self._dir is not None
        return self._dir

    def master_pid(self) -> int:
        """The pid of the master JVM."""
        self._require_started()
        assert self._master is not None
        return self._master.pid

    def worker_pids(self) -> list[int | None]:
        """The pid of each worker slot's JVM, None for a slot whose worker has exited."""
        return [
            w.proc.pid if w is not None and w.proc.poll() is None else None
            for w in self._workers
        ]

    def executor_pids(self, worker: int | None = None) -> list[int]:
        """The pids of the executor JVMs (``CoarseGrainedExecutorBackend`` processes whose
        parent is a worker JVM, found with psutil) of every live worker, or of slot
        ``worker`` only. An executor appears once its worker has launched it, which is
        after an application connects, not when :meth:`session` returns."""
        with self._lock:
            slots = self._workers if worker is None else [self._slot(worker)]
            by_parent = {w.proc.pid: w for w in slots if w is not None and w.proc.poll() is None}
            found = []
            for proc in psutil.process_iter(["ppid", "cmdline"]):
                parent = proc.info.get("ppid")
                if parent in by_parent and EXECUTOR_CLASS in _cmdline(proc):
                    by_parent[parent].executors_seen.add(proc.pid)
                    found.append(proc.pid)
            return sorted(found)

    def status(self) -> dict:
        """The master's ``/json/``: ``workers`` (with ``state``), ``activeapps``, ..."""
        self._require_started()
        return self._json()

    def alive_workers(self) -> list[dict]:
        """The workers the master lists as ALIVE in ``/json/`` (dicts with ``id``,
        ``host``, ``port``, ``cores``, ``coresused``, ...)."""
        return [w for w in self.status().get("workers", []) if w.get("state") == "ALIVE"]

    # ---- faults ----------------------------------------------------------------------

    def kill_worker(
        self, i: int, sig: int = signal.SIGKILL, *, executor_grace: float = 10.0
    ) -> WorkerKill:
        """Send ``sig`` to the JVM of worker ``i`` (only to it, not to its process group),
        wait for it to exit, then wait up to ``executor_grace`` seconds for its executor
        JVMs to exit by themselves (they watch their worker, see the module docs) and
        ``SIGKILL`` those still running, so that an executor never outlives its worker.
        Returns what happened as a :class:`WorkerKill` (``executors_exited_by_themselves``
        is also true when the worker had no executor). Waits for nothing else: the master
        and the driver learn of the loss by themselves, at once for a ``SIGKILL``."""
        with self._lock:
            w = self._slot(i)
            if w.proc.poll() is not None:
                raise StandaloneClusterError(f"worker {i} (pid {w.proc.pid}) is not running")
            executors = set(self.executor_pids(i)) | set(self._group_executors(w.proc.pid))
            start = time.monotonic()
            os.kill(w.proc.pid, sig)
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            # Also executors launched just before the kill, now orphans: same process group.
            executors |= set(self._group_executors(w.proc.pid))
            w.executors_seen |= executors
            deadline = start + executor_grace
            while time.monotonic() < deadline and any(_alive(p) for p in executors):
                time.sleep(0.02)
            seconds = time.monotonic() - start
            survivors = sorted(p for p in executors if _alive(p))
            for pid in survivors:
                _kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(p) for p in survivors):
                time.sleep(0.02)
            return WorkerKill(
                worker=i,
                worker_pid=w.proc.pid,
                signal=int(sig),
                executor_pids=sorted(executors),
                executors_exited_by_themselves=not survivors,
                seconds=round(seconds, 3),
                killed_executors=survivors,
                signalled_at=start,
            )

    def storage_dir(self, i: int) -> Path:
        """Worker ``i``'s storage root (``SPARKJET_STORAGE_DIR`` of its members: the folder
        of their storage slots with ``storage="members"``), kept across its restarts."""
        if self._dir is None:
            raise StandaloneClusterError("the cluster is not started; call start() first")
        return self._dir / "storage" / f"worker-{i}"

    def restart_worker(self, i: int, timeout: float = 60) -> int:
        """Start a new worker JVM in slot ``i`` (whose worker must have exited; it gets a
        new port and registers as a new worker) and wait until the master lists it ALIVE.
        Returns its pid."""
        with self._lock:
            w = self._slot(i)
            if w.proc.poll() is None:
                raise StandaloneClusterError(
                    f"worker {i} (pid {w.proc.pid}) is still running; kill_worker({i}) first"
                )
            old_seen = w.executors_seen
            self._spawn_worker(i)
            new = self._workers[i]
            assert new is not None
            new.executors_seen |= old_seen  # stop() still sweeps them
            try:
                self._wait_workers([i], time.monotonic() + timeout)
            except StandaloneClusterError:
                _kill_group(new.proc.pid, signal.SIGKILL)
                new.proc.wait()
                raise
            return new.proc.pid

    # ---- a driver ------------------------------------------------------------------

    def session(self, app_name: str = "sparkjet-standalone", **conf) -> SparkSession:
        """A SparkSession on this cluster, with one executor of the worker's size on each
        worker (``spark.executor.cores``/``memory`` = ``cores``/``memory``,
        ``spark.cores.max`` = all of them), waiting until they have registered, and the
        settings of :data:`SESSION_DEFAULTS` for barrier stages (overridden by ``conf``;
        Spark keys contain dots, so pass them unpacked: ``**{"spark.task.cpus": "1"}``).

        Spark allows one SparkContext per process, and ``getOrCreate`` would silently return
        an existing one (with another master): this raises instead. Use it in a process of
        its own (a subprocess in tests)."""
        self._require_started()
        ensure_java()
        from pyspark import SparkContext
        from pyspark.sql import SparkSession

        if SparkContext._active_spark_context is not None:
            raise StandaloneClusterError(
                "this process already has a SparkContext "
                f"({SparkContext._active_spark_context.master}); a session on the standalone "
                "cluster needs a process without one (run the driver in a subprocess)"
            )
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", self.host)
        settings = self.session_settings(**conf)
        builder = SparkSession.builder.master(self.master_url).appName(app_name)
        for key, value in settings.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()

    def session_settings(self, **conf) -> dict[str, str]:
        """The Spark settings :meth:`session` gives its builder (besides the master, which
        is :attr:`master_url`): :data:`SESSION_DEFAULTS`, the executor size and
        ``spark.cores.max``, then ``conf``. For a driver in another process, which has no
        cluster object: ``SparkSession.builder.master(url)`` with each of these."""
        self._require_started()
        settings = dict(SESSION_DEFAULTS)
        settings.update({
            "spark.driver.host": self.host,
            "spark.driver.bindAddress": self.host,
            "spark.executor.cores": str(self.cores),
            "spark.executor.memory": self.memory,
            "spark.cores.max": str(self.cores * self.workers),
            "spark.pyspark.python": sys.executable,
        })
        settings.update({k: _conf_value(v) for k, v in conf.items()})
        return settings

    # ---- internals -----------------------------------------------------------------

    def _url(self) -> str:
        return f"spark://{self.host}:{self._master_port}"

    def _require_started(self) -> None:
        if self._master is None:
            raise StandaloneClusterError("the cluster is not started; call start() first")

    def _slot(self, i: int) -> _Worker:
        i = check_int("worker index", i, min=0, max=self.workers - 1)
        self._require_started()
        w = self._workers[i]
        assert w is not None
        return w

    def _make_dirs(self) -> None:
        if self._given_dir is not None:
            self._dir = self._given_dir
            self._dir.mkdir(parents=True, exist_ok=True)
        else:
            self._dir = Path(tempfile.mkdtemp(prefix="sparkjet-standalone-"))
        for sub in ("logs", "work", "conf"):
            (self._dir / sub).mkdir(exist_ok=True)

    def _env(self, host: str | None = None) -> dict:
        """The daemons' environment; ``host`` is the address the JVM binds (its web UI
        too): the master's by default."""
        assert self._dir is not None
        host = host or self.host
        env = dict(os.environ)
        env.update({
            "SPARK_HOME": self._spark_home,
            "SPARK_LOCAL_IP": host,
            "SPARK_LOCAL_HOSTNAME": host,
            "SPARK_WORKER_DIR": str(self._dir / "work"),
            "SPARK_LOG_DIR": str(self._dir / "logs"),
            "SPARK_PID_DIR": str(self._dir / "logs"),
            "SPARK_CONF_DIR": str(self._dir / "conf"),  # empty: no stray spark-defaults
            "SPARK_DAEMON_MEMORY": self.daemon_memory,
            "SPARK_DAEMON_JAVA_OPTS": " ".join(
                filter(None, [self.daemon_java_opts, os.environ.get("SPARK_DAEMON_JAVA_OPTS")])),
            "SPARK_LAUNCHER_OPTS": " ".join(
                filter(None, [self.daemon_java_opts, os.environ.get("SPARK_LAUNCHER_OPTS")])),
            "PYSPARK_PYTHON": sys.executable,
            # The master's REST submission server would take the fixed port 6066 (a second
            # cluster on the machine then logs a clash and moves on); nothing here uses it.
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
        })
        # A driver's or test's settings must not leak into the daemons.
        for key in ("SPARK_WORKER_OPTS", "SPARK_ENV_LOADED", "PYSPARK_SUBMIT_ARGS",
                    "SPARK_SUBMIT_OPTS"):
            env.pop(key, None)
        return env

    def _popen(self, args: list[str], log: Path, worker: int | None = None) -> subprocess.Popen:
        spark_class = os.path.join(self._spark_home, "bin", "spark-class")
        command = ["bash", spark_class, *args]
        host = None
        if worker is not None and self.network is not None:
            # ip netns exec execs the command: the pid stays the JVM's (spark-class execs
            # java), and PR_SET_PDEATHSIG, set before, survives both execs.
            netns_host = self.network.hosts[worker]
            command, host = netns_host.command(command), netns_host.address
        if threading.current_thread() is threading.main_thread() and sys.platform == "linux":
            # PR_SET_PDEATHSIG fires when the *thread* that started the child ends: only
            # worth it from the main thread. Set by a trampoline, not preexec_fn (unsafe
            # with threads, and a driver has py4j's).
            command = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *command]
        env = self._env(host)
        if worker is not None:
            # each worker a host of its own for the members' storage slots (its executors
            # and their Python workers inherit it): a host id and a storage root
            env["SPARKJET_HOST_ID"] = f"worker-{worker}"
            env["SPARKJET_STORAGE_DIR"] = str(self.storage_dir(worker))
        with open(log, "ab") as out:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self._dir),
                start_new_session=True,  # its own process group, with its executors
            )

    def _start_master(self, deadline: float) -> None:
        assert self._dir is not None
        self._master_log = self._dir / "logs" / "master.out"
        for attempt in range(3):
            self._master_port, self._webui_port = _free_ports(2)
            self._master = self._popen(
                [MASTER_CLASS, "--host", self.host, "--port", str(self._master_port),
                 "--webui-port", str(self._webui_port)],
                self._master_log,
            )
            problem = None
            while problem is None:
                if self._master.poll() is not None:
                    problem = f"exited (code {self._master.returncode}) during start"
                    break
                try:
                    state = self._json()
                except _TRANSIENT:
                    state = None
                if state is not None and state.get("url") != self._url():
                    # The port was taken between _free_ports and the bind, and Spark moved
                    # to another one (or another server answers): start again.
                    problem = f"answered as {state.get('url')!r}, not {self._url()!r}"
                elif state is not None and state.get("status") == "ALIVE":
                    return
                elif time.monotonic() > deadline:
                    problem = "did not come up in time"
                else:
                    time.sleep(0.1)
            _kill_group(self._master.pid, signal.SIGKILL)
            self._master.wait()
            retry = attempt < 2 and time.monotonic() < deadline and (
                "answered as" in problem or _port_clash(self._master_log))
            if not retry:
                log = _tail(self._master_log)
                self._master = None
                raise StandaloneClusterError(
                    f"the Spark master at {self._url()} {problem}:\n{log}"
                )

    def _spawn_worker(self, i: int) -> None:
        assert self._dir is not None
        self._generation += 1
        port, webui_port = _free_ports(2)
        log = self._dir / "logs" / f"worker-{i}-{self._generation}.out"
        work = self._dir / "work" / f"worker-{i}"
        work.mkdir(parents=True, exist_ok=True)
        host = self.network.hosts[i].address if self.network is not None else "127.0.0.1"
        proc = self._popen(
            [WORKER_CLASS, "--host", host, "--port", str(port),
             "--webui-port", str(webui_port), "--cores", str(self.cores),
             "--memory", self.memory, "--work-dir", str(work), self._url()],
            log, worker=i,
        )
        self._workers[i] = _Worker(i, proc, port, webui_port, log)

    def _wait_workers(self, slots, deadline: float) -> None:
        slots = list(slots)
        while True:
            for i in slots:
                w = self._workers[i]
                assert w is not None
                if w.proc.poll() is not None:
                    raise StandaloneClusterError(
                        f"Spark worker {i} exited (code {w.proc.returncode}) during start:\n"
                        f"{_tail(w.log)}\nmaster log:\n{_tail(self._master_log, 15)}"
                    )
            try:
                alive = {w.get("port") for w in self.alive_workers()}
            except _TRANSIENT:
                alive = set()
            missing = [i for i in slots if self._workers[i].port not in alive]
            if not missing:
                return
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"worker {i} (pid {self._workers[i].proc.pid}):\n{_tail(self._workers[i].log)}"
                    for i in missing
                )
                raise StandaloneClusterError(
                    f"Spark workers {missing} were not ALIVE at {self._url()} in time:\n"
                    f"{logs}\nmaster log:\n{_tail(self._master_log, 15)}"
                )
            time.sleep(0.1)

    def _json(self) -> dict:
        with self._opener.open(f"http://{self.host}:{self._webui_port}/json/", timeout=5) as r:
            return json.loads(r.read().decode())

    def _group_executors(self, pgid: int) -> list[int]:
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if _pgid(p.pid) == pgid and EXECUTOR_CLASS in _cmdline(p)]

    def _processes_under_dir(self) -> list[int]:
        """Processes whose working folder is in the cluster's folder: executors run in
        ``work/worker-i/<app>/<executor>``, and their Python daemons and workers too."""
        if self._dir is None:
            return []
        root = os.path.realpath(self._dir)
        found = []
        for proc in psutil.process_iter(["cwd"]):
            cwd = proc.info.get("cwd")  # None when gone or not ours to read
            if cwd and proc.pid != os.getpid() and (cwd == root or cwd.startswith(root + os.sep)):
                found.append(proc.pid)
        return found


# ---- helpers ---------------------------------------------------------------------------


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def _conf_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (the OS picks them; held open
    together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_clash(log: Path | None) -> bool:
    text = _tail(log, 200)
    return "Address already in use" in text or "BindException" in text


#: Run as ``python -c _TRAMPOLINE <parent pid> <command...>``: ask the kernel for SIGKILL
#: when the parent (thread) ends, then exec the command; the setting survives exec (bash
#: and then java, as spark-class execs it), so a killed test process leaves no JVM behind.
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent died before prctl
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None:
        return "(no log)"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path} is empty)"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _cmdline(proc: psutil.Process) -> str:
    """The command line of a process from ``psutil.process_iter(["cmdline"])``, as one
    string ("" when it is gone or not ours to read)."""
    return " ".join(proc.info.get("cmdline") or ())


def _group_alive(pgid: int) -> bool:
    return any(_pgid(p.pid) == pgid and _alive(p.pid) for p in psutil.process_iter())


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
