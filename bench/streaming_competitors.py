"""The competitors of ``bench_job.py``: Spark Structured Streaming and PyFlink running the same
keyed count and sum (1M int64 keys, emitting updates, output discarded) over the same events,
read from files, with exactly-once checkpoints; and their recovery after a kill -9.

Each system runs in a subprocess of its own, so one JVM never slows the next and a kill -9
hits exactly that system:

- Spark 4.x (the pyspark of this environment) runs ``bench/_sss_job.py``: ``local[2]``,
  Parquet source with ``maxFilesPerTrigger=4``, trigger ``availableNow``, 8 shuffle
  partitions, ``noop`` sink, HDFS-backed or RocksDB state store;
- PyFlink runs ``bench/_flink_job.py`` in its own virtual environment, ``bench/.flink-venv``
  (``apache-flink`` pins an older pyarrow than sparkjet's, so it cannot share ours): Table API,
  mini-cluster, parallelism 2, hashmap state, exactly-once checkpoints every 1 s or none,
  bounded CSV source (the wheel ships no Parquet format), ``blackhole`` sink.

Functions (each returns a dict of plain numbers with a ``note`` on how it was measured):
:func:`make_data`, :func:`run_sss`, :func:`recovery_sss`, :func:`ensure_flink_venv`,
:func:`run_pyflink`, :func:`recovery_pyflink`, and :func:`recovery_vs_state` for recovery
time against the number of keys.

Run: ``python bench/streaming_competitors.py --events 2000000 --only sss-hdfs,pyflink``
(prints a table; ``--help`` lists the rows). The data is written once into ``--work-dir``
and reused by later runs with the same parameters. PyFlink writes its own log to
``pyflink/log/`` inside ``bench/.flink-venv`` (each run replaces it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
EVENTS = 20_000_000
KEYS = 1_000_000
FILES = 40
SEED = 20_250_601

SSS_JOB = BENCH_DIR / "_sss_job.py"
SSS_STATE_STORES = {
    "hdfs": "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
    "rocksdb": "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
}

FLINK_JOB = BENCH_DIR / "_flink_job.py"
FLINK_VENV = BENCH_DIR / ".flink-venv"
FLINK_PACKAGE = "apache-flink==2.3.0"
#: The Java PyFlink runs on when it exists (Flink 2.3 supports Java 11, 17 and 21).
FLINK_JAVA_HOME = "/usr/lib/jvm/java-17-openjdk-amd64"


# --- data ------------------------------------------------------------------------------------

def make_data(work_dir, events: int = EVENTS, keys: int = KEYS, files: int = FILES, *,
              key_order: str = "uniform") -> dict:
    """Write the events once into ``work_dir``: ``files`` Parquet files under ``parquet/`` and
    the same rows as header-less CSV files under ``csv/``.

    Rows are ``id`` (int64, 0..events-1 in order), ``key`` (int64 in 0..keys-1) and ``value``
    (float64, uniform in [0, 1)). With ``key_order="uniform"`` keys are drawn uniformly;
    with ``"cyclic"`` the events go through one seeded permutation of all keys again and
    again, so the state holds every key after the first ``keys`` events (for recovery
    against state size). File ``i`` is drawn from its own seeded generator, so the data is
    the same on every machine. A ``manifest.json`` records the parameters; when it matches,
    nothing is written again. Returns the folders and the parameters.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if key_order not in ("uniform", "cyclic"):
        raise ValueError(f"key_order must be 'uniform' or 'cyclic', got {key_order!r}")
    suffix = "" if key_order == "uniform" else f"-{key_order}"
    root = Path(work_dir) / f"data-{events}-{keys}-{files}{suffix}"
    manifest_path = root / "manifest.json"
    wanted = {"events": events, "keys": keys, "files": files, "seed": SEED, "key_order": key_order}
    result = {"parquet_dir": str(root / "parquet"), "csv_dir": str(root / "csv"), **wanted}
    if manifest_path.exists() and json.loads(manifest_path.read_text()) == wanted:
        return {**result, "seconds": 0.0, "cached": True}

    start = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    (root / "parquet").mkdir(parents=True)
    (root / "csv").mkdir()
    bounds = np.linspace(0, events, files + 1).astype(np.int64)
    csv_options = pacsv.WriteOptions(include_header=False)
    cycle = np.random.default_rng(SEED).permutation(keys) if key_order == "cyclic" else None
    for i in range(files):
        rng = np.random.default_rng([SEED, i])
        ids = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        if cycle is None:
            key = rng.integers(0, keys, len(ids), dtype=np.int64)
        else:
            key = cycle[ids % keys]
        table = pa.table({"id": ids, "key": key, "value": rng.random(len(ids))})
        pq.write_table(table, root / "parquet" / f"part-{i:05d}.parquet")
        pacsv.write_csv(table, root / "csv" / f"part-{i:05d}.csv", csv_options)
    # Written last, so an interrupted run is redone rather than trusted.
    manifest_path.write_text(json.dumps(wanted))
    return {**result, "seconds": time.perf_counter() - start, "cached": False}


def _data_events(data_dir) -> int:
    """The number of events in a folder written by :func:`make_data`."""
    return json.loads((Path(data_dir).parent / "manifest.json").read_text())["events"]


# --- subprocesses ----------------------------------------------------------------------------

class _Child:
    """A benchmark subprocess in a process group of its own (the JVM it starts joins that
    group, so one ``killpg`` takes down both), whose stdout carries JSON events; the lines
    are collected by a thread as they arrive and stderr goes to ``log``. As a context
    manager, it kills the process on the way out unless it has ended."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.events: list[dict] = []
        self._changed = threading.Condition()
        self._log = open(log, "w")  # noqa: SIM115 (closed by finish())
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                with self._changed:
                    self.events.append(json.loads(line))
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, name: str, count: int = 1, timeout: float = 600.0) -> dict:
        """The ``count``-th event called ``name``, waiting for it; raises RuntimeError when the
        process ends first or the time runs out."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [e for e in self.events if e["event"] == name]
                if len(found) >= count:
                    return found[count - 1]
                if not self._reader.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"no {name!r} event from {self.process.args[1]} "
                                       f"(exit code {self.process.poll()}); see {self._log.name}")
                self._changed.wait(0.1)

    def last(self, name: str) -> dict | None:
        with self._changed:
            found = [e for e in self.events if e["event"] == name]
        return found[-1] if found else None

    def kill(self) -> None:
        """kill -9 the process and every process it started."""
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def finish(self, timeout: float = 3600.0) -> int:
        """Wait for the process to end; its exit code."""
        code = self.process.wait(timeout)
        self._reader.join(10)
        self._log.close()
        return code

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process.poll() is None:
            self.kill()
        self.finish()


def _percentile(values, q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): a value that occurred, never interpolated."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))
    return float(ordered[int(rank) - 1])


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# --- Spark Structured Streaming --------------------------------------------------------------

def _start_sss(parquet_dir, checkpoint: Path, state_store: str, log: Path,
               stop_after_batches: int = 0, driver_memory: str = "2g") -> _Child:
    if state_store not in SSS_STATE_STORES:
        raise ValueError(f"state_store must be one of {sorted(SSS_STATE_STORES)}, "
                         f"got {state_store!r}")
    argv = [sys.executable, str(SSS_JOB), "--parquet-dir", str(parquet_dir),
            "--checkpoint-dir", str(checkpoint),
            "--state-store-class", SSS_STATE_STORES[state_store],
            "--stop-after-batches", str(stop_after_batches), "--driver-memory", driver_memory]
    return _Child(argv, log)


def run_sss(parquet_dir, work_dir, state_store: str = "hdfs", events: int | None = None) -> dict:
    """Spark Structured Streaming over the Parquet events, from a fresh checkpoint to the end
    of the data (trigger ``availableNow``), in a subprocess of its own.

    ``seconds`` runs from building the query to its termination (the JVM and session start,
    reported as ``jvm_start_s``, is not included); the latencies are the nearest-rank p50
    and p99 of the micro-batch durations (``triggerExecution``): an update leaves with the
    batch its event was read in. ``checkpoints`` counts the committed micro-batches, each
    of which checkpoints offsets and state. ``events`` defaults to the data's own count.
    """
    events = events or _data_events(parquet_dir)
    work = Path(work_dir)
    checkpoint = _fresh(work / f"sss-{state_store}-checkpoint")
    with _start_sss(parquet_dir, checkpoint, state_store, work / f"sss-{state_store}.log") as child:
        code = child.finish()
    done = child.last("done")
    if code != 0 or done is None or done.get("exception"):
        raise RuntimeError(f"Spark run failed (exit code {code}): {(done or {}).get('exception')}; "
                           f"see {work / f'sss-{state_store}.log'}")
    batches = [b["ms"] / 1e3 for b in done["batches"]]
    rows = sum(b["rows"] for b in done["batches"])
    seconds = done["done"] - done["query_start"]
    last = child.last("progress") or {}
    shutil.rmtree(checkpoint, ignore_errors=True)
    return {
        "events": rows, "events_per_s": rows / seconds, "seconds": seconds,
        "p50_latency_s": _percentile(batches, 50), "p99_latency_s": _percentile(batches, 99),
        "checkpoints": len(batches), "batches": len(batches),
        "jvm_start_s": child.wait_for("started")["t"] - done["jvm_start"],
        "state_rows": last.get("state_rows", 0),
        "note": (f"Spark {state_store} state store; seconds from building the query to its end "
                 f"(JVM start excluded); latency = micro-batch duration p50/p99 over "
                 f"{len(batches)} batches of ~{rows // max(1, len(batches)):,} events"
                 + ("" if rows == events else f"; read {rows:,} events, expected {events:,}")),
    }


def recovery_sss(parquet_dir, work_dir, state_store: str = "hdfs", events: int | None = None,
                 kill_fraction: float = 0.4, driver_memory: str = "2g") -> dict:
    """kill -9 the Spark driver (the Python process and its JVM) halfway through the
    micro-batch that follows the first one ending at ``kill_fraction`` of the events (as
    estimated from that one's duration), restart it on the same checkpoint and time from
    the restart command to the end of the first micro-batch after it.

    That time includes a new JVM and Spark session (``restart_to_session_s``), planning the
    query and re-running the interrupted micro-batch in full, state loading included (its
    duration is ``first_batch_s``): in Spark the first output after a failure is that batch.
    """
    events = events or _data_events(parquet_dir)
    work = Path(work_dir)
    checkpoint = _fresh(work / f"sss-{state_store}-recovery-checkpoint")
    log = work / f"sss-{state_store}-recovery.log"
    child = _start_sss(parquet_dir, checkpoint, state_store, log, driver_memory=driver_memory)
    with child:
        seen, n = 0, 0
        while seen < kill_fraction * events:
            n += 1
            progress = child.wait_for("progress", n)
            seen += progress["rows"]
        while True:  # batch durations vary: when the next batch ends first, aim at the one after
            kill_delay = progress["durations_ms"]["triggerExecution"] / 2e3
            time.sleep(kill_delay)
            if child.last("progress")["batch"] == progress["batch"]:
                break
            if child.last("done"):
                raise RuntimeError("the Spark query ended before the kill; lower kill_fraction")
            n += 1
            progress = child.wait_for("progress", n)
            seen += progress["rows"]
        child.kill()

    restart = time.time()
    with _start_sss(parquet_dir, checkpoint, state_store, log.with_suffix(".restart.log"),
                    stop_after_batches=1, driver_memory=driver_memory) as again:
        first = again.wait_for("progress")
        again.finish()
    shutil.rmtree(checkpoint, ignore_errors=True)
    return {
        "events_committed_at_kill": seen, "state_rows": progress["state_rows"],
        "state_memory_mb": progress["state_memory_bytes"] / 1e6,
        "batch_before_kill_s": progress["durations_ms"]["triggerExecution"] / 1e3,
        "restart_to_session_s": again.wait_for("started")["t"] - restart,
        "restart_to_query_s": again.wait_for("query")["t"] - restart,
        "restart_to_first_batch_s": first["t"] - restart,
        "first_batch_s": first["durations_ms"]["triggerExecution"] / 1e3,
        "first_batch_events": first["rows"],
        "note": (f"kill -9 of driver and JVM {kill_delay:.1f} s into micro-batch "
                 f"{progress['batch'] + 1}; "
                 "restart to first completed micro-batch, including JVM + session start and "
                 "a full re-run of the interrupted batch"),
    }


# --- PyFlink ---------------------------------------------------------------------------------

def ensure_flink_venv(path=FLINK_VENV) -> str:
    """The Python executable of a virtual environment at ``path`` holding PyFlink, creating
    it (``python3 -m venv`` + ``pip install apache-flink``) when it is missing or broken.

    It is kept apart from sparkjet's environment because ``apache-flink`` pins an older
    pyarrow. Raises RuntimeError saying what failed and what to run by hand.
    """
    path = Path(path)
    python = path / "bin" / "python"
    probe = [str(python), "-c", "import pyflink.table"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return str(python)
    steps = [[sys.executable, "-m", "venv", str(path)],
             [str(python), "-m", "pip", "install", "--quiet", FLINK_PACKAGE]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise RuntimeError(
                f"cannot set up PyFlink in {path}: `{' '.join(step)}` failed "
                f"(exit code {done.returncode}):\n{tail}\n"
                f"Run by hand: python3 -m venv {path} && {python} -m pip install {FLINK_PACKAGE}")
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        raise RuntimeError(f"{FLINK_PACKAGE} installed in {path}, but `import pyflink.table` fails")
    return str(python)


def _flink_env() -> dict:
    """The environment of a PyFlink subprocess: JAVA_HOME is :data:`FLINK_JAVA_HOME` when it
    exists (Flink 2.3 supports Java 11, 17 and 21, and the newest Java here may be newer),
    else the caller's JAVA_HOME, else the Java sparkjet finds."""
    env = dict(os.environ)
    if Path(FLINK_JAVA_HOME, "bin", "java").exists():
        env["JAVA_HOME"] = FLINK_JAVA_HOME
    elif "JAVA_HOME" not in env:
        from sparkjet.spark.java import find_java_home

        env["JAVA_HOME"] = find_java_home()
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FlinkRest:
    """The few REST calls of a mini-cluster the benchmark reads; every call returns None once
    the cluster is gone (it shuts down when its job ends)."""

    def __init__(self, port: int, job_id: str):
        self.base = f"http://127.0.0.1:{port}/jobs/{job_id}"

    def get(self, path: str = ""):
        try:
            with urllib.request.urlopen(self.base + path, timeout=2) as response:
                return json.load(response)
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def source_records(self) -> int | None:
        """Records the source has emitted so far (refreshed about every second)."""
        job = self.get()
        return job["vertices"][0]["metrics"]["write-records"] if job else None

    def all_running_at(self) -> float | None:
        """When the last task switched to RUNNING (tasks restore their state before that), as
        a Unix time; None while some task has not yet. The REST API serves a cached job
        graph, seconds old at times, but the timestamps in it are exact."""
        job = self.get()
        if not job:
            return None
        latest = 0
        for vertex in job["vertices"]:
            times = self.get(f"/vertices/{vertex['id']}/subtasktimes") or {}
            stamps = [s.get("timestamps", {}).get("RUNNING", 0) for s in times.get("subtasks", [])]
            if not stamps or min(stamps) <= 0:
                return None
            latest = max(latest, *stamps)
        return latest / 1e3

    def latency_ms(self) -> dict | None:
        """The worst p50 and p99 over all (source subtask, operator subtask) pairs of Flink's
        latency-marker histograms, read on the last vertex (aggregation and sink)."""
        job = self.get()
        if not job:
            return None
        vertex = f"/vertices/{job['vertices'][-1]['id']}/metrics"
        names = [m["id"] for m in self.get(vertex) or [] if ".latency.source_id." in m["id"]]
        wanted = [n for n in names if n.endswith(("latency_median", "latency_p99"))]
        if not wanted:
            return None
        values = self.get(vertex + "?get=" + ",".join(wanted)) or []
        p50 = [float(v["value"]) for v in values if v["id"].endswith("latency_median")]
        p99 = [float(v["value"]) for v in values if v["id"].endswith("latency_p99")]
        return {"p50": max(p50), "p99": max(p99)} if p50 and p99 else None


def _completed(checkpoint_stats: dict | None) -> int:
    """Completed checkpoints in a ``/checkpoints`` answer (-1 without one)."""
    return checkpoint_stats["counts"]["completed"] if checkpoint_stats else -1


def _start_flink(python: str, csv_dir, log: Path, port: int, checkpoint: Path | None = None,
                 restore_from: str | None = None, latency_interval_ms: int = 200) -> _Child:
    argv = [python, str(FLINK_JOB), "--csv-dir", str(csv_dir), "--rest-port", str(port),
            "--latency-interval-ms", str(latency_interval_ms)]
    if checkpoint is not None:
        argv += ["--checkpoint-dir", str(checkpoint)]
    if restore_from:
        argv += ["--restore-from", restore_from]
    return _Child(argv, log, env=_flink_env())


def run_pyflink(csv_dir, work_dir, checkpoints: bool = True, events: int | None = None,
                python: str | None = None) -> dict:
    """PyFlink over the CSV events, bounded, in a subprocess of its own run by the interpreter
    of :func:`ensure_flink_venv` (or ``python``).

    ``seconds`` runs from submitting the INSERT (planning and the mini-cluster's start
    included, as Spark's planning is) to the job's end; ``jvm_start_s`` is reported apart.
    ``checkpoints`` is the completed count of the last REST poll (every 0.5 s, so one at
    the very end can be missed; ``failed_checkpoints`` includes the first trigger, which
    usually comes before the tasks run). Latency comes from Flink's latency markers (every
    200 ms per source subtask): the time a marker takes from leaving the source to reaching
    the sink, queues included, the worst of the subtask pairs over the whole run as of the
    last poll.
    """
    python = python or ensure_flink_venv()
    events = events or _data_events(csv_dir)
    work = Path(work_dir)
    name = "pyflink" if checkpoints else "pyflink-nocp"
    checkpoint = _fresh(work / f"{name}-checkpoints") if checkpoints else None
    port = _free_port()
    stats, latency, running_at = None, None, None
    with _start_flink(python, csv_dir, work / f"{name}.log", port, checkpoint) as child:
        rest = _FlinkRest(port, child.wait_for("submitted")["job_id"])
        polls = 0
        while child.process.poll() is None:
            if running_at is None and (job := rest.get()) and job["timestamps"].get("RUNNING"):
                running_at = job["timestamps"]["RUNNING"] / 1e3
            stats = (rest.get("/checkpoints") if checkpoints else None) or stats
            # The histograms hold every marker of the run: an occasional read is enough.
            if polls % 4 == 0:
                latency = rest.latency_ms() or latency
            polls += 1
            time.sleep(0.5)
        code = child.finish()
    done = child.last("done")
    if code != 0 or done is None:
        raise RuntimeError(f"PyFlink run failed (exit code {code}); see {work / f'{name}.log'}")
    if checkpoint is not None:
        shutil.rmtree(checkpoint, ignore_errors=True)
    seconds = done["done"] - done["submit"]
    counts = (stats or {}).get("counts", {})
    summary = (stats or {}).get("summary", {})
    return {
        "events": events, "events_per_s": events / seconds, "seconds": seconds,
        "running_s": done["done"] - running_at if running_at else float("nan"),
        "jvm_start_s": child.wait_for("started")["t"] - done["jvm_start"],
        "p50_latency_s": latency["p50"] / 1e3 if latency else float("nan"),
        "p99_latency_s": latency["p99"] / 1e3 if latency else float("nan"),
        "checkpoints": counts.get("completed", 0),
        "failed_checkpoints": counts.get("failed", 0),
        "checkpoint_mb": summary.get("state_size", {}).get("avg", 0) / 1e6,
        "checkpoint_s": summary.get("end_to_end_duration", {}).get("avg", 0) / 1e3,
        "note": ("PyFlink, "
                 + ("exactly-once checkpoints every 1 s" if checkpoints else "checkpoints off")
                 + "; seconds from submitting the INSERT to the job's end (JVM start excluded); "
                 "latency = latency markers source to sink, worst subtask pair, whole run"),
    }


def recovery_pyflink(csv_dir, work_dir, events: int | None = None, kill_fraction: float = 0.4,
                     kill_delay: float = 0.5, python: str | None = None) -> dict:
    """kill -9 the whole PyFlink process (JVM: job manager and task manager together, as a
    mini-cluster cannot lose a task manager alone) ``kill_delay`` seconds after the first
    checkpoint completed once the source had emitted ``kill_fraction`` of the events,
    then start a new process restoring from that retained checkpoint and time from the
    restart command to: the JVM up, the job submitted, every task running (state restored),
    and the first new checkpoint completed (the first committed progress, since the sink
    here writes nothing an observer could see). The restarted run is killed once measured.
    """
    python = python or ensure_flink_venv()
    events = events or _data_events(csv_dir)
    work = Path(work_dir)
    checkpoint = _fresh(work / "pyflink-recovery-checkpoints")
    port = _free_port()
    with _start_flink(python, csv_dir, work / "pyflink-recovery.log", port, checkpoint) as child:
        rest = _FlinkRest(port, child.wait_for("submitted")["job_id"])
        while (rest.source_records() or 0) < kill_fraction * events:
            if child.process.poll() is not None:
                raise RuntimeError("the PyFlink job ended before the kill; lower kill_fraction or "
                                   "use more events (a few million at least)")
            time.sleep(0.1)
        before = _completed(rest.get("/checkpoints"))
        while (stats := rest.get("/checkpoints")) and _completed(stats) == before:
            time.sleep(0.05)
        seen = rest.source_records()
        time.sleep(kill_delay)
        # A finishing job deletes its checkpoints while its process still runs.
        if stats is None or seen is None or (rest.get() or {}).get("state") != "RUNNING":
            raise RuntimeError("the PyFlink job ended before the kill; lower kill_fraction or "
                               "use more events (a few million at least)")
        child.kill()
    retained = sorted(checkpoint.glob("*/chk-*/_metadata"), key=lambda p: int(p.parent.name[4:]))
    if not retained:
        raise RuntimeError(f"no retained checkpoint under {checkpoint} after the kill")
    checkpoint_mb = stats["latest"]["completed"]["state_size"] / 1e6

    port = _free_port()
    restart = time.time()
    running = first = None
    restored: dict = {}
    with _start_flink(python, csv_dir, work / "pyflink-recovery.restart.log", port,
                      _fresh(work / "pyflink-recovery-checkpoints-2"),
                      restore_from=str(retained[-1].parent)) as again:
        rest = _FlinkRest(port, again.wait_for("submitted")["job_id"])
        while (running is None or first is None) and again.process.poll() is None:
            running = running or rest.all_running_at()
            if first is None and _completed(stats := rest.get("/checkpoints")) >= 1:
                first = stats["latest"]["completed"]["latest_ack_timestamp"] / 1e3
                restored = stats["latest"].get("restored") or {}
            time.sleep(0.1)
        # Measured: the restarted run is killed on the way out of this block.
    for folder in ("pyflink-recovery-checkpoints", "pyflink-recovery-checkpoints-2"):
        shutil.rmtree(work / folder, ignore_errors=True)
    if running is None or first is None:
        raise RuntimeError("the restarted PyFlink job ended before it ran and completed a "
                           f"checkpoint; see {work / 'pyflink-recovery.restart.log'}")
    return {
        "events_read_at_kill": seen, "checkpoint_mb": checkpoint_mb,
        "restored_checkpoint": restored.get("id", -1),
        "restart_to_jvm_s": again.wait_for("started")["t"] - restart,
        "restart_to_submitted_s": again.wait_for("submitted")["t"] - restart,
        "restart_to_running_s": running - restart,
        "restart_to_first_checkpoint_s": first - restart,
        "note": (f"kill -9 of the whole PyFlink JVM {kill_delay} s after a checkpoint; new process "
                 "restoring from it; restart to first completed checkpoint (its last "
                 "acknowledgement), JVM start included"),
    }


def recovery_vs_state(work_dir, key_counts=(1_000_000, 10_000_000), systems=("sss", "pyflink"),
                      kill_fraction: float = 0.5) -> dict:
    """:func:`recovery_sss` (HDFS state store) and :func:`recovery_pyflink` against the size of
    the state: for each key count K, 3K events going through all K keys three times
    (``key_order="cyclic"``), killed at ``kill_fraction`` of them, so the state holds nearly
    every key (each system reports what it held) and the run goes on well past the kill.
    Returns ``{"sss-K": ..., "pyflink-K": ...}``; a size a system cannot hold on this
    machine (see :func:`_heap_needed`) gets ``{"error": ...}`` without running.
    """
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    results = {}
    for keys in key_counts:
        runnable = []
        for system in systems:
            need, limit, what = _heap_needed(system, keys, memory)
            if need > limit:
                results[f"{system}-{keys}"] = {
                    "error": f"{what} needs ~{need / 2**30:.0f} GiB of heap for {keys:,} keys; "
                             f"at most {limit / 2**30:.0f} GiB here"}
            else:
                runnable.append((system, need))
        if not runnable:
            continue  # and writes no data set of 3K events for nothing
        data = make_data(work_dir, events=3 * keys, keys=keys, key_order="cyclic")
        for system, need in runnable:
            if system == "sss":
                results[f"sss-{keys}"] = _attempt(
                    recovery_sss, data["parquet_dir"], work_dir, "hdfs",
                    kill_fraction=kill_fraction, driver_memory=f"{-(-need // 2**30)}g")
            else:
                results[f"pyflink-{keys}"] = _attempt(recovery_pyflink, data["csv_dir"], work_dir,
                                                      kill_fraction=kill_fraction)
    return results


def _heap_needed(system: str, keys: int, memory: int) -> tuple[int, int, str]:
    """(heap the system needs for ``keys`` keys of state, the most it can have on a machine
    with ``memory`` bytes, what it is), from rough per-key figures.

    Spark's HDFS-backed store keeps its state on the driver's heap in several versions
    (~270 bytes a key measured at 1M and 10M keys): 2 GiB plus 600 bytes a key, up to 3/4
    of the memory. PyFlink's local JVM has Java's default heap, a quarter of the memory, and
    the hashmap backend keeps Java objects on it (a 385 MB checkpoint for 10M keys; ~400
    bytes a key on the heap, estimated) plus ~1 GiB for the rest.
    """
    if system == "sss":
        return 2 * 2**30 + 600 * keys, int(0.75 * memory), "Spark's HDFS state store"
    if system == "pyflink":
        return 2**30 + 400 * keys, memory // 4, "PyFlink's hashmap state"
    raise ValueError(f"systems are 'sss' and 'pyflink', got {system!r}")


def _attempt(run, *args, **kwargs) -> dict:
    """``run(*args, **kwargs)``, or ``{"error": ...}`` when it fails: one system failing must
    not hide the others' figures."""
    try:
        return run(*args, **kwargs)
    except (RuntimeError, OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


# --- command line ----------------------------------------------------------------------------

#: The rows ``main`` runs by default, in order: name -> (label, function of (data, work dir)).
RUNS = {
    "sss-hdfs": ("Spark SSS, HDFS state store",
                 lambda d, w: run_sss(d["parquet_dir"], w, "hdfs")),
    "sss-rocksdb": ("Spark SSS, RocksDB state store",
                    lambda d, w: run_sss(d["parquet_dir"], w, "rocksdb")),
    "pyflink": ("PyFlink, checkpoints every 1 s",
                lambda d, w: run_pyflink(d["csv_dir"], w, checkpoints=True)),
    "pyflink-nocp": ("PyFlink, checkpoints off",
                     lambda d, w: run_pyflink(d["csv_dir"], w, checkpoints=False)),
    "sss-recovery": ("Spark SSS recovery, HDFS store",
                     lambda d, w: recovery_sss(d["parquet_dir"], w, "hdfs")),
    "pyflink-recovery": ("PyFlink recovery",
                         lambda d, w: recovery_pyflink(d["csv_dir"], w)),
}
#: Asked for by name only (it writes data sets of 3x each key count and takes minutes).
STATE_SIZE_ROW = "recovery-vs-state"


def _recovery_line(label: str, r: dict) -> str:
    """One line of the recovery table, from a :func:`recovery_sss` or :func:`recovery_pyflink`
    result."""
    if "restart_to_first_batch_s" in r:  # Spark
        state = f"{r['state_rows'] / 1e6:.2f}M keys, {r['state_memory_mb']:.0f} MB heap"
        up, ready, first = (r["restart_to_session_s"], r["restart_to_query_s"],
                            r["restart_to_first_batch_s"])
    else:
        state = f"{r['checkpoint_mb']:.0f} MB checkpoint"
        up, ready, first = (r["restart_to_jvm_s"], r["restart_to_running_s"],
                            r["restart_to_first_checkpoint_s"])
    return f"{label:34}{state:>30}{up:>8.1f}{ready:>8.1f}{first:>8.1f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=EVENTS)
    parser.add_argument("--keys", type=int, default=KEYS)
    parser.add_argument("--files", type=int, default=FILES)
    parser.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                           "sparkjet-streaming-bench"),
                        help="data (kept for later runs), checkpoints and logs")
    parser.add_argument("--only", default=",".join(RUNS),
                        help=f"comma-separated rows, from: {', '.join([*RUNS, STATE_SIZE_ROW])} "
                             f"(default: all but {STATE_SIZE_ROW})")
    parser.add_argument("--state-keys", default="1000000,10000000",
                        help=f"key counts of {STATE_SIZE_ROW} (default: %(default)s)")
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in RUNS and name != STATE_SIZE_ROW]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join([*RUNS, STATE_SIZE_ROW])}")

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.2f}; work folder {work}", flush=True)
    data = None
    if any(name in RUNS for name in chosen):
        data = make_data(work, args.events, args.keys, args.files)
        written = "cached" if data["cached"] else f"written in {data['seconds']:.1f} s"
        print(f"{args.events:,} events, {args.keys:,} keys, {args.files} files ({written})",
              flush=True)
    results = {}
    for name in chosen:
        if name == STATE_SIZE_ROW:
            results[name] = recovery_vs_state(work, [int(k) for k in args.state_keys.split(",")])
        else:
            results[name] = _attempt(RUNS[name][1], data, work)
        print(f"  {name}: {json.dumps(results[name])}", flush=True)

    throughput = {name: r for name, r in results.items() if "events_per_s" in r}
    if throughput:
        print(f"\n{'system':34}{'events/s':>10}{'seconds':>9}{'p50 s':>8}{'p99 s':>8}{'ckpts':>7}")
    for name, r in throughput.items():
        print(f"{RUNS[name][0]:34}{r['events_per_s'] / 1e6:>8.2f} M{r['seconds']:>9.1f}"
              f"{r['p50_latency_s']:>8.2f}{r['p99_latency_s']:>8.2f}{r['checkpoints']:>7}")
    recoveries = [(RUNS[n][0], r) for n, r in results.items() if n in RUNS and "recovery" in n]
    for label, r in results.get(STATE_SIZE_ROW, {}).items():
        recoveries.append((f"recovery, {label} keys", r))
    if recoveries:
        print("\nafter kill -9, seconds from the restart command to: JVM up, query running "
              "(Spark) or tasks running (Flink), first micro-batch (Spark) or checkpoint (Flink)")
        print(f"{'system':34}{'state at the kill':>30}{'JVM':>8}{'ready':>8}{'first':>8}")
        for label, r in recoveries:
            print(f"{label:34}  could not run: {r['error']}" if "error" in r
                  else _recovery_line(label, r))
    for name, r in results.items():
        if "error" in r and name in RUNS and "recovery" not in name:
            print(f"{RUNS[name][0]}: could not run: {r['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"data": data, "results": results}, indent=2))


if __name__ == "__main__":
    main()
