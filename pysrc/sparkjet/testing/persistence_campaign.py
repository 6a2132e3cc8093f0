"""The persistence campaign (issue 25 item 3, a short version): jobs of ``storage="members",
persistence=True`` whose driver and members all die, restarted by a new driver after one
kind of damage to the slots or the store, under a recovery policy; each round checked by
:mod:`sparkjet.verify`.

``python -m sparkjet.testing.persistence_campaign --faults 200 --json`` runs a long
campaign on ``local[3]`` (three members, each claiming a slot under one ``storage_dir``; on
one host each slot is its own member group). The test suite's short run is marked ``long``
(each round runs Spark twice). Each round runs one stateful pipeline into files (the
operators of :mod:`sparkjet.testing.operators`, in turn) until a random committed snapshot
(1 to 3), then SIGKILLs every member's Python worker and abandons the run (its driver gone:
cancelled, no restart, nothing graceful: the ``kill-all`` fault every round has), does
what its kind does, and runs the same job again with a new :class:`~sparkjet.runtime.Job`
(a new driver):

- ``restart`` (``FULL_RECOVERY_ONLY``): nothing else: the newest snapshot, exactly once;
- ``slot-lost`` (``FULL_RECOVERY_ONLY``, ``backup_count=0``): one slot's folder removed:
  refused (``RecoveryRefusedError`` naming the partitions), nothing committed twice; or,
  when every chunk it held has a copy elsewhere, restored exactly once (broadcast state,
  partition -1, is copied whole to every slot whatever ``backup_count``: the table join's
  pipeline has no other; the slot holding the most bytes is taken);
- ``slot-lost-b1`` (``FULL_RECOVERY_ONLY``, ``backup_count=1``): the same with backups:
  exactly once;
- ``newest-lost-recent`` / ``newest-lost-complete`` (at-least-once,
  ``PARTIAL_RECOVERY_MOST_RECENT`` / ``_MOST_COMPLETE``, ``backup_count=0``): the newest
  snapshot's folder removed from one slot: the older snapshot restored, the newer reported
  given up (``given_up`` in the ``recovery`` event), nothing lost;
- ``newest-lost-eo`` (exactly-once, ``PARTIAL_RECOVERY_MOST_RECENT``): the same: refused
  (the older snapshot would replay committed output), or restored exactly once when every
  chunk of the folder has a copy elsewhere (broadcast state);
- ``corrupt-metadata``: a slot's ``TABLE.json``, ``FENCE`` or a record copy overwritten
  with garbage: that file removed alone (``auto_remove_stale_data``), exactly once;
- ``foreign-metadata``: another job's record copy put among a slot's record copies of this
  job: removed as corrupt, exactly once;
- ``lost-metadata``: the job's folder of the store removed: rebuilt from the slots' record
  copies (a ``metadata_rebuilt`` event), exactly once;
- ``force-start``: ``Job.force_start()`` before the new run: everything read again from the
  start (at-least-once output: the first run's commits stay), ids above the old ones (the
  transactional file sink's registry would fence reused ones);
- ``force-start-away``: the same with one slot moved aside during the force start (its host
  away) and put back before the new run: its member empties it (its old record copies are
  never committed again; the ``recovery`` event names it among ``wiped``);
- ``rebalance-returns`` (``rebalance_delay=60``): one slot moved aside (its host away); the
  restart's driver waits for it (a ``waiting`` event naming it) and it is put back 0.2 to
  1.5 s later: its member claims it, and the ``rebalance`` event says it returned, nothing
  promoted; exactly once;
- ``rebalance-late`` (``rebalance_delay=1.5``): the same, put back only once the driver gave
  it up: the ``rebalance`` event names its partitions, promoted to their backups; exactly
  once;
- ``stale-rejoin``: a copy of one slot as it was at the kill is kept, the job runs again (a
  new driver) until two more snapshots are committed and is killed the same way (three
  faults), and the stale copy is put back: its member syncs what it owns by Merkle trees
  (:mod:`sparkjet.runtime.resync`) before it restores (the ``restored`` event's
  ``merkle_resync``: bytes moved and a full copy's, reported per round); exactly once. The
  table join's pipeline (``enrich``) keeps only broadcast state, no partition to sync: its
  rounds check exactly once without a resync.

A round is valid when the output holds what the kind promises (exactly once: lost 0,
duplicated 0; at-least-once: lost 0), or, for a refusal, the refusal is the one the kind
allows, names what it must, and what was committed before it duplicated nothing. Per kind
the summary gives rounds, faults, refusals, lost, duplicated and the snapshots partial
policies gave up, and the bytes Merkle resyncs moved.

By default the first run's driver is abandoned in this process (the members and their
slots' locks die, the driver's state goes with the Job object); ``--driver-process`` runs
it in a process of its own with its own local Spark and kills its whole process group
(driver, JVM, members) with SIGKILL. The restart's driver is this process's.

``--standalone`` runs the campaign on a :class:`~sparkjet.testing.standalone.StandaloneCluster`
of 3 one-core workers, each a host of its own (``SPARKJET_HOST_ID`` ``worker-<i>``) with its
own storage root (:meth:`~sparkjet.testing.standalone.StandaloneCluster.storage_dir`), so
each member's slot lives on its own host and the kinds above damage a slot in its host's
root. There the kill is real everywhere: the first run's driver is a process of its own (an
application of the cluster), and at the snapshot its members' Python workers and its
process group (driver and JVM) are SIGKILLed, then every process under the workers'
folders (executor JVMs, pyspark's daemons, Python workers); in every other round (at
random) every worker JVM is SIGKILLed first and restarted after the damage, before the new
run. The restart's driver is a new session of this process on the same cluster (it waits
up to ``validation_timeout`` 30 s for the cluster's task slots), stopped after the round;
``stale-rejoin``'s second run is a killed driver process too. Every kind runs there;
``force-start-away`` proves less than on one host: the force start runs on the driver's
host, whose storage root holds no slot, so it removes no slot folder with or without the
slot away, and every member (the one away included) empties its slot at the mark.
A kill of a worker JVM alone, or a host's storage root wiped, while the job runs are the
storage campaign's (:mod:`sparkjet.testing.storage_campaign` ``--standalone``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from sparkjet.cli.args import campaign_parser
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.errors import (
    InvalidArgumentError,
    JobCancelledError,
    JobFailedError,
    SparkjetError,
)
from sparkjet.snapshot import layout
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.spark import local_session
from sparkjet.testing import operators
from sparkjet.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster
from sparkjet.testing.storage_campaign import operator_job

_log = logging.getLogger(__name__)

OPERATORS = operators.OPERATORS
FULL, RECENT, COMPLETE = ("FULL_RECOVERY_ONLY", "PARTIAL_RECOVERY_MOST_RECENT",
                          "PARTIAL_RECOVERY_MOST_COMPLETE")


@dataclass(frozen=True)
class Kind:
    """One kind of damage after the kill: its job settings, and what the restart may end
    in: "exact" (exactly-once output), "at-least" (nothing lost), "refuse" (the run failed
    with a RecoveryRefusedError, its message saying ``refusal`` and naming ``names``), or
    "either" (one of "refuse" and "exact")."""

    name: str
    expect: str
    policy: str = FULL
    guarantee: str = "exactly-once"
    backup_count: int = 1
    refusal: str = ""
    names: str = ""
    event: str = ""            # a progress event the restart must send (metadata_rebuilt)
    rebalance_delay: float = 0.0


KINDS = {k.name: k for k in [
    Kind("restart", "exact"),
    Kind("slot-lost", "either", backup_count=0,
         refusal="persistence restart refused (FULL_RECOVERY_ONLY)", names="partitions"),
    Kind("slot-lost-b1", "exact"),
    Kind("newest-lost-recent", "at-least", RECENT, "at-least-once", 0),
    Kind("newest-lost-complete", "at-least", COMPLETE, "at-least-once", 0),
    Kind("newest-lost-eo", "either", RECENT, backup_count=0,
         refusal="exactly-once refuses it", names="partitions"),
    Kind("corrupt-metadata", "exact"),
    Kind("foreign-metadata", "exact"),
    Kind("lost-metadata", "exact", event="metadata_rebuilt"),
    Kind("force-start", "at-least"),
    Kind("force-start-away", "at-least", event="wiped"),
    Kind("rebalance-returns", "exact", event="returned", rebalance_delay=60.0),
    Kind("rebalance-late", "exact", event="promoted", rebalance_delay=1.5),
    Kind("stale-rejoin", "exact", event="merkle_resync"),
]}
#: The pipelines whose only state is broadcast (partition -1, whole in every slot: the
#: table join's): a stale slot has no partition to sync by Merkle trees, its member
#: restores that state from a holder (``resync.resync_for_restore``).
BROADCAST_ONLY = ("enrich",)
#: The faults a round of each kind plans: the kill, its damage (stale-rejoin: a second run
#: killed too, then the stale slot put back).
FAULTS = {"restart": 1, "stale-rejoin": 3}


@dataclass
class RoundResult:
    kind: str
    pipeline: str
    faults: int = 0
    refusal: str | None = None
    errors: list = field(default_factory=list)
    given_up: list = field(default_factory=list)   # snapshots a partial policy gave up
    rebalance: dict | None = None   # the restart's rebalance event (rebalance_delay)
    merkle_bytes: int = 0           # what a Merkle resync moved, and a full copy's bytes
    merkle_full_bytes: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    restored_from: int | None = None
    seconds: float = 0.0
    valid: bool = False
    detail: str = ""


def _kill_all_at(job, at: int, seen: list, actions: list):
    """A progress callback: at snapshot ``at`` SIGKILLs every member's Python worker and
    cancels the run (the driver is abandoned)."""
    def progress(event):
        seen.append(event)
        if (event["event"] == "snapshot" and event["snapshot"] >= at
                and not event.get("terminal") and not actions):
            pids = dict(job.member_pids)
            for pid in pids.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            actions.append(f"kill-all after snapshot {event['snapshot']}: driver abandoned, "
                           f"SIGKILL members {sorted(pids.values())}")
            job.cancel()
    return progress


def _run_driver_process(work: Path, spec: dict, at: int, seen: list, actions: list,
                        cluster=None, kill_jvms: bool = False, name: str = "driver"):
    """The first run in a driver process of its own (``--run-driver``): its events read
    from its file as they come; at snapshot ``at`` its whole process group (the driver,
    its Spark JVM, the members) is SIGKILLed. Returns the run's error if it failed before
    (None otherwise). ``cluster``: the driver is an application of that standalone
    cluster, and after it every executor and Python worker of the cluster is SIGKILLed
    too (``kill_jvms``: the worker JVMs first; :func:`_kill_cluster`). ``name``: of its
    events file and log in ``work``."""
    events_file = work / f"{name}-events.jsonl"
    spec = dict(spec, work=str(work), events_file=str(events_file))
    env = dict(os.environ)
    if cluster is not None:
        spec.update(master=cluster.master_url, settings=cluster.session_settings(**{
            "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
            "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS}))
        env.update(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP=cluster.host)
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sparkjet.testing.persistence_campaign",
                             "--run-driver", json.dumps(spec)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)
    offset = 0
    try:
        while True:
            ended = proc.poll() is not None
            if events_file.exists():
                with open(events_file) as f:
                    f.seek(offset)
                    for line in f.readlines():
                        if not line.endswith("\n"):
                            break
                        offset += len(line.encode())
                        event = json.loads(line)
                        seen.append(event)
                        if (event["event"] == "snapshot" and event["snapshot"] >= at
                                and not event.get("terminal") and not actions):
                            # pyspark's worker daemon has a process group of its own:
                            # the members are killed by pid, then the driver's group
                            started = [e for e in seen if e["event"] == "started"]
                            pids = sorted((started[-1].get("pids") or {}).values()) \
                                if started else []
                            for pid in pids:
                                with contextlib.suppress(ProcessLookupError):
                                    os.kill(int(pid), signal.SIGKILL)
                            os.killpg(proc.pid, signal.SIGKILL)
                            actions.append(f"kill-all after snapshot {event['snapshot']}: "
                                           f"SIGKILL members {pids} and the driver's process "
                                           f"group {proc.pid} (its Spark JVM)")
                            if cluster is not None:
                                actions[-1] += "; " + _kill_cluster(cluster, kill_jvms)
            if actions or ended:
                break
            time.sleep(0.05)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    if not actions and proc.returncode != 0:
        return (work / "driver.log").read_text()[-2000:] or f"exit {proc.returncode}"
    return None


def _driver_main(spec: dict) -> int:
    """``--run-driver SPEC``: one run of the round's job, each event a line of the events
    file (flushed), until it ends or the campaign kills this process group."""
    work = Path(spec["work"])
    job, _, _ = operator_job(work, spec["op"], spec["seed"], spec["events"], spec["rate"],
                             spec["config"])
    if spec.get("master"):        # an application of the standalone cluster
        from pyspark.sql import SparkSession
        builder = SparkSession.builder.master(spec["master"]).appName(
            "sparkjet-persistence-driver")
        for key, value in spec["settings"].items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
    else:
        spark = local_session(f"local[{spec['members']}]", "sparkjet-persistence-driver",
                              **{"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("OFF")
    with open(spec["events_file"], "a") as f:
        def progress(event):
            f.write(json.dumps(event, default=str) + "\n")
            f.flush()
        try:
            job.run(spark, on_progress=progress)
        except JobFailedError as e:
            print(e)
            return 1
    return 0


def _kill_cluster(cluster, kill_jvms: bool) -> str:
    """Every process under the standalone cluster's workers' folders (the executor JVMs,
    pyspark's daemons, the members' Python workers) SIGKILLed until none is left;
    ``kill_jvms``: every worker JVM first (:meth:`StandaloneCluster.kill_worker`, its
    executors killed at once), restarted by :func:`_restart_workers` before the new run.
    Says what it did."""
    said = []
    if kill_jvms:
        for i, pid in enumerate(cluster.worker_pids()):
            if pid is not None:
                k = cluster.kill_worker(i, executor_grace=0.0)
                said.append(f"worker {i} JVM {k.worker_pid} (executors {k.executor_pids})")
    root = os.path.realpath(cluster.work_dir / "work") + os.sep
    killed: set[int] = set()
    deadline = time.monotonic() + 15
    while True:
        left = [p for p in psutil.process_iter(["cwd", "status"])
                if (p.info.get("cwd") or "").startswith(root) and p.pid != os.getpid()
                and p.info.get("status") != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
                killed.add(p.pid)
        time.sleep(0.05)
    return ((f"SIGKILL worker JVMs: {', '.join(said)}; " if said else "")
            + f"SIGKILL {len(killed)} executor and Python processes of the cluster"
            + (f" ({len(left)} still there)" if left else ""))


def _restart_workers(cluster) -> str:
    """Starts again every worker of the cluster whose JVM is gone; says which."""
    back = [i for i, pid in enumerate(cluster.worker_pids()) if pid is None]
    for i in back:
        cluster.restart_worker(i)
    return f"worker JVMs {back} restarted" if back else ""


def _slots(seen: list, storage_dir: Path, cluster=None) -> list[Path]:
    """The folders of the newest ``placed`` event's slots: under ``storage_dir``, or on
    a standalone cluster under their host's storage root (hosts ``worker-<i>``)."""
    placed = [e for e in seen if e["event"] == "placed"]
    if not placed:
        return []
    if cluster is None:
        return [storage_dir / f"slot-{s['uuid']}" for s in placed[-1]["slots"]]
    return [Path(cluster.storage_dir(int(s["host"].rsplit("-", 1)[1]))) / f"slot-{s['uuid']}"
            for s in placed[-1]["slots"]]


def _bytes(folder: Path) -> int:
    """The bytes of the chunk files under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*.chunks") if f.is_file())


def _job_folder(slot: Path, job_id: int) -> Path | None:
    """The round's job's folder in ``slot`` (None: it holds none). Only that job's: on a
    standalone cluster the hosts' slots keep the data of earlier rounds' jobs too, and
    damage to one of those would leave the round's restart nothing to prove."""
    folder = slot / "jobs" / layout.job_dir(job_id)
    return folder if folder.is_dir() else None


def damage(kind: Kind, slots: list[Path], store: Path, job, rng: random.Random,
           committed: int, away: dict | None = None) -> str:
    """What the kind does while everything is down (``committed``: the newest snapshot
    committed before the kill); says what it did. The rebalance kinds move a slot aside
    (its host away) and say where in ``away`` (``folder``, ``aside``)."""
    k = kind.name
    if k.startswith("rebalance-"):
        victim = rng.choice(slots)
        aside = victim.parent.parent / f"away-{victim.name}"
        victim.rename(aside)
        if away is not None:
            away.update(folder=victim, aside=aside, uuid=victim.name[len("slot-"):])
        return f"moved slot {victim.name} aside (its host away)"
    if k in ("slot-lost", "slot-lost-b1"):
        # the slot holding the most (broadcast state is copied to every slot: losing a
        # slot that holds only that costs nothing)
        mine = {s: _bytes(s / "jobs" / layout.job_dir(job.config.id)) for s in slots}
        victim = rng.choice([s for s in slots if mine[s] == max(mine.values())])
        shutil.rmtree(victim)
        return f"removed slot {victim.name}"
    if k.startswith("newest-lost"):
        folders = {}
        for slot in slots:
            for d in slot.glob(f"jobs/{layout.job_dir(job.config.id)}/replicas/snapshots/*"):
                ids = layout.snapshot_of(d.name)
                if ids is not None:
                    folders.setdefault(ids, []).append(d)
        newest = [ids for ids in folders if ids[0] == committed]
        if not newest:
            return "nothing else"
        choices = folders[newest[0]]
        victim = rng.choice([d for d in choices if _bytes(d) == max(map(_bytes, choices))])
        shutil.rmtree(victim)
        return f"removed snapshot {committed}'s folder {victim}"
    if k == "corrupt-metadata":
        candidates = []
        for slot in slots:
            folder = _job_folder(slot, job.config.id)
            if folder is not None:
                candidates += [folder / "TABLE.json", folder / "FENCE",
                               *sorted((folder / "records").glob("*"))]
        victim = rng.choice([p for p in candidates if p.exists()])
        victim.write_bytes(b"\x00garbage{" + os.urandom(8))
        return f"overwrote {victim} with garbage"
    if k == "foreign-metadata":
        slot = rng.choice([s for s in slots if _job_folder(s, job.config.id) is not None])
        records = sorted((_job_folder(slot, job.config.id) / "records").glob("*"))
        source = rng.choice(records)
        data = json.loads(source.read_bytes())
        data["job_id"] = (data["job_id"] + 1) % 2**63      # another job's copy
        target = source.parent / f"{int(records[-1].name) + 1000:020d}"
        target.write_bytes(json.dumps(data).encode())
        return f"another job's record copy put in {target}"
    if k == "lost-metadata":
        (folder,) = store.glob("job-*")
        shutil.rmtree(folder)
        return f"removed the store's folder {folder}"
    if k == "force-start-away":
        away = rng.choice(slots)
        aside = away.parent.parent / f"away-{away.name}"
        away.rename(aside)
        try:
            removed = job.force_start()
        finally:
            aside.rename(away)
        return (f"force start with {away.name} away (put back after): removed "
                f"{len(removed['store'])} store paths and {len(removed['slots'])} slot "
                f"folders; ids above {removed['floor']}")
    if k == "force-start":
        removed = job.force_start()
        return (f"force start: removed {len(removed['store'])} store paths and "
                f"{len(removed['slots'])} slot folders; ids above {removed['floor']}")
    return "nothing else"


def run_round(work: Path, kind: Kind, op: str, rng: random.Random, *, spark, members: int,
              events: int = 600_000, rate: float = 100_000, progress=print,
              driver_process: bool = False, cluster=None) -> RoundResult:
    """One job with ``op``: killed with its driver, damaged as ``kind`` says, restarted by
    a new driver; returns what happened and the checker's verdict. ``driver_process``: the
    first run's driver is a process of its own (with its own local Spark), killed with
    SIGKILL to its process group (its JVM and the members with it). ``cluster``: a
    started :class:`StandaloneCluster` (``spark`` unused): every killed run's driver is a
    process of its own on it, each kill takes every executor and Python worker of the
    cluster too (every other round the worker JVMs, restarted before the new run), and the
    restart's driver is a session of this process on it, stopped after the round."""
    work.mkdir(parents=True, exist_ok=True)
    storage_dir = work / "slots"
    if cluster is not None:
        # the members' slots are under their worker's storage root (SPARKJET_STORAGE_DIR
        # wins); this one is the driver's host's, empty: what force_start looks at here
        storage_dir, members, driver_process = work / "driver-host-slots", None, True
    config = dict(persistence=True, storage_dir=str(storage_dir), members=members,
                  validation_timeout=1.0 if cluster is None else 30.0,
                  retained_snapshots=3, max_restarts=2,
                  backup_count=kind.backup_count, processing_guarantee=kind.guarantee,
                  cluster_data_recovery_policy=kind.policy)
    if kind.rebalance_delay:
        config["rebalance_delay"] = kind.rebalance_delay
    result = RoundResult(kind.name, op)
    start = time.monotonic()
    seed, at = rng.randrange(2**32), rng.randint(1, 3)
    if kind.name == "stale-rejoin":
        # the stale copy keeps a snapshot's record copy with its files (the first
        # snapshots may hold no state yet, and the record of the snapshot killed at may
        # not have reached the slot)
        at += 2
        # and the second run has input left for two more snapshots (on a loaded machine
        # a snapshot can take seconds, while the source reads on at its rate)
        events *= 4
    job, again, check = operator_job(work, op, seed, events, rate, config)
    seen, actions = [], []
    first_error = None
    spec = dict(op=op, seed=seed, events=events, rate=rate, config=config, members=members)
    if driver_process:
        first_error = _run_driver_process(
            work, spec, at, seen, actions, cluster,
            kill_jvms=cluster is not None and rng.random() < 0.5)
    else:
        try:
            job.run(spark, on_progress=_kill_all_at(job, at, seen, actions))
        except JobCancelledError:
            pass
        except JobFailedError as e:
            first_error = str(e)
    if not actions:
        with open(work / "events.jsonl", "w") as f:
            for e in seen:
                f.write(json.dumps(e, default=str) + "\n")
        result.seconds = time.monotonic() - start
        if first_error is not None:        # failed with no fault: a defect
            result.errors.append(first_error.splitlines()[0][:1000])
            result.detail = "the job failed before the kill"
            return result
        # the input ended first: a round that proves nothing, but no defect
        result.detail, result.valid = "the job ended before the kill", True
        return result
    result.faults = 1
    committed = newest_committed(work / "snapshots", job.config.id,
                                 max(e["snapshot"] for e in seen if e["event"] == "snapshot"))
    away: dict = {}
    if kind.name == "stale-rejoin":
        what = _stale_rejoin(work, _slots(seen, storage_dir, cluster), again, committed, rng,
                             spark, seen, cluster, spec)
        result.faults += what.count("kill-all") + ("put back" in what)
        if "put back" not in what:      # the input ended first: nothing to check
            result.detail, result.valid = "; ".join(actions + [what]), True
            result.seconds = time.monotonic() - start
            return result
    else:
        what = damage(kind, _slots(seen, storage_dir, cluster), work / "snapshots", again(),
                      rng, committed, away)
        result.faults += what != "nothing else"
    actions.append(what)
    if cluster is not None:
        actions.append(_restart_workers(cluster) or "worker JVMs kept")
    restart: list[dict] = []
    failed = None
    try:
        if cluster is not None:    # a new driver on the same cluster
            spark = cluster.session("sparkjet-persistence-restart", **{
                "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
                "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS})
            spark.sparkContext.setLogLevel("OFF")
        executions = again().run(spark, on_progress=_restart_progress(
            kind, restart, away if kind.rebalance_delay else {}, rng)).executions
    except JobFailedError as e:
        failed, executions = str(e), []
    finally:
        if kind.rebalance_delay and away and away["aside"].exists():
            away["aside"].rename(away["folder"])    # its host back after the run
        if cluster is not None and spark is not None:
            spark.stop()
    with open(work / "events.jsonl", "w") as f:
        for e in seen + [{"restart": True}] + restart:
            f.write(json.dumps(e, default=str) + "\n")
    recoveries = [e for e in restart if e["event"] == "recovery"]
    for r in recoveries:
        result.given_up += [s for s in r.get("given_up") or [] if s not in result.given_up]
    result.restored_from = next((e.get("restored_from") for e in executions
                                 if e.get("status") == "ok"), None)
    for e in executions:
        if e.get("status") != "ok" and e.get("error"):
            result.errors.append(str(e["error"]).splitlines()[0][:300])
    if failed is not None:
        result.refusal = ("RecoveryRefusedError" if kind.refusal and kind.refusal in failed
                          else "JobFailedError")
        result.errors.append(failed.splitlines()[0][:1000])
    guarantee = "at-least-once" if kind.expect == "at-least" else "exactly-once"
    report, repeated = operators.check(op, _source_of(job), TransactionalFileSink.read(
        work / "out"), guarantee=guarantee)
    partial = failed is not None
    result.lost, result.duplicated, result.wrong = verdict(report, repeated, guarantee, partial)
    if kind.event == "wiped":
        if not any(e["event"] == "recovery" and e.get("wiped") for e in restart):
            actions.append("the slot away at the force start was not emptied")
            result.wrong += 1
    elif kind.event in ("returned", "promoted"):
        found = [e for e in restart if e["event"] == "rebalance"]
        result.rebalance = found[-1] if found else None
        if not found or away["uuid"] not in found[-1][kind.event] or (
                kind.event == "returned" and found[-1]["promoted"]):
            said = found[-1] if found else "no rebalance event"
            actions.append(f"the slot away was not {kind.event} ({said})")
            result.wrong += 1
        else:
            r = found[-1]
            actions.append(f"slot {away['uuid']} {kind.event} after {r['waited_s']:.1f} s "
                           f"(rebalance_delay {r['rebalance_delay']:g} s)" + (
                               f": {r['promoted_partitions']} partitions promoted"
                               if kind.event == "promoted" else ""))
    elif kind.event == "merkle_resync":
        synced = [e["merkle_resync"] for e in restart
                  if e["event"] == "restored" and e.get("merkle_resync")]
        result.merkle_bytes = sum(int(m.get("bytes") or 0) for m in synced)
        result.merkle_full_bytes = sum(int(m.get("full_copy_bytes") or 0) for m in synced)
        if not synced and op in BROADCAST_ONLY:
            actions.append(f"no Merkle resync: the {op} pipeline's only state is broadcast, "
                           f"no partition to sync")
        elif not synced:
            actions.append("no Merkle resync of the stale slot")
            result.wrong += 1
        else:
            actions.append(f"Merkle resync moved {result.merkle_bytes} bytes (a full copy: "
                           f"{result.merkle_full_bytes})")
    elif kind.event and not any(e["event"] == kind.event for e in restart):
        actions.append(f"no {kind.event} event")
        result.wrong += 1
    result.detail = "; ".join(actions + [f"restored from {result.restored_from}"])
    result.seconds = time.monotonic() - start
    result.valid = _valid(kind, result, partial)
    return result


def newest_committed(store: Path, job_id: int, seen: int) -> int:
    """The newest snapshot the store's log committed (read once everything is down), else
    ``seen``, the newest a progress event reported. The store decides: a snapshot committed
    just before the kill may not have reached this process as an event yet (a driver of its
    own relays them), and damage aimed at the older one would miss the snapshot the restart
    restores (a ``newest-lost`` round then restored it whole)."""
    try:
        with SnapshotStore(str(store), job_id, create=False) as s:
            info = s.latest_complete()
    except (OSError, SparkjetError) as e:
        _log.warning("the store's newest committed snapshot did not read (%s): taking "
                     "snapshot %d, the newest reported", e, seen)
        return seen
    return seen if info is None else max(seen, info.snapshot_id)


def verdict(report, repeated: int, guarantee: str, partial: bool) -> tuple[int, int, int]:
    """Lost, duplicated and wrong from the checker's ``report`` on a round's output
    (``repeated``: updates committed twice). ``partial``: the restart was refused, so the
    output is the first run's alone and its missing events are not lost. Wrong counts keys
    that should not be there and, except in a partial output, keys whose count is right but
    whose values are not (an event lost and another duplicated): under at-least-once too,
    which allows duplicates, never a loss."""
    lost = 0 if partial else report.lost_count
    wrong = report.unexpected_count + (0 if partial else len(report.mismatched))
    if guarantee == "at-least-once":
        return lost, 0, wrong
    return lost, report.duplicated_count + repeated, wrong


def _restart_progress(kind: Kind, events: list, away: dict, rng: random.Random):
    """The restart's progress callback: keeps the events; for ``rebalance-returns`` puts
    the slot away back (its host returns) shortly after the driver starts waiting for it,
    for ``rebalance-late`` once the driver gave it up (its backups promoted)."""
    def progress(event):
        events.append(event)
        if not away or not away["aside"].exists():
            return
        if kind.name == "rebalance-returns" and event.get("slots_awaited"):
            threading.Timer(rng.uniform(0.2, 1.5), _put_back, (away,)).start()
        elif kind.name == "rebalance-late" and event["event"] == "rebalance":
            _put_back(away)
    return progress


def _put_back(away: dict) -> None:
    with contextlib.suppress(FileNotFoundError):
        away["aside"].rename(away["folder"])


def _stale_rejoin(work: Path, slots: list[Path], again, committed: int, rng: random.Random,
                  spark, seen: list, cluster=None, spec: dict | None = None) -> str:
    """``stale-rejoin``: a copy of one slot as it was at the kill is kept, the job runs
    again (a new driver) until two more snapshots are committed and is killed the same
    way, and the slot is put back as it was: it missed those snapshots, and its member
    syncs what it owns by Merkle trees before it restores. ``cluster``: the second run's
    driver is a process of its own on it (``spec``), killed with the cluster's executors
    and Python workers (:func:`_run_driver_process`)."""
    victim = rng.choice(slots)
    stale = work / f"stale-{victim.name}"
    shutil.copytree(victim, stale, symlinks=True)
    middle: list = []
    done: list = []
    if cluster is not None:
        _restart_workers(cluster)
        _run_driver_process(work, spec, committed + 2, middle, done, cluster,
                            name="second-driver")
    else:
        job = again()
        try:
            job.run(spark, on_progress=_kill_all_at(job, committed + 2, middle, done))
        except (JobCancelledError, JobFailedError):
            pass
    seen.extend([{"event": "stale-rejoin: second run"}] + middle)
    if not done:
        shutil.rmtree(stale)
        return f"copied slot {victim.name}; the second run ended before its kill"
    shutil.rmtree(victim)
    stale.rename(victim)
    return (f"copied slot {victim.name} at snapshot {committed}; second run: {done[0]}; "
            f"put back the stale copy")


def _source_of(job):
    return next(v.source for v in job.plan.sources)


def _valid(kind: Kind, r: RoundResult, partial: bool) -> bool:
    if r.duplicated or r.wrong or (not partial and r.lost):
        return False
    if kind.expect == "refuse" or (kind.expect == "either" and r.refusal is not None):
        return r.refusal == "RecoveryRefusedError" and any(kind.names in e for e in r.errors)
    return r.refusal is None


def plan(kinds, faults: int, rng: random.Random) -> list[tuple[Kind, str]]:
    """Rounds until ``faults`` faults are planned (the kill and the damage: two a round,
    one for ``restart``): every kind in turn first, then at random; operators in turn."""
    out, n = [], 0
    order = list(kinds)
    while n < faults:
        kind = order[len(out)] if len(out) < len(order) else rng.choice(order)
        out.append((kind, OPERATORS[len(out) % len(OPERATORS)]))
        n += FAULTS.get(kind.name, 2)
    return out


def run_campaign(work: Path, faults: int, seed: int = 0, progress=print, *, spark=None,
                 members: int = 3, kinds=None, operators_=None,
                 driver_process: bool = False, cluster=None,
                 resume: bool = False) -> list[RoundResult]:
    """Rounds until ``faults`` faults are planned (:func:`plan`), on ``spark`` (``local[N]``
    with ``members`` members), or with ``cluster`` (a started :class:`StandaloneCluster` of
    3 one-core workers; ``spark`` unused, see :func:`run_round`); each round's result also
    appended to ``work/rounds.jsonl``. ``resume``: the rounds already in that file count,
    and the plan (the same seed, kinds and faults) goes on after them; the rounds after
    draw their randomness from a generator seeded anew (``seed`` and the rounds done), so
    a resumed run is not the same as one run through, only as valid."""
    rng = random.Random(seed)
    chosen = [KINDS[k] for k in kinds] if kinds else list(KINDS.values())
    planned = plan(chosen, faults, rng)
    results = read_rounds(work / "rounds.jsonl") if resume else []
    if results:
        progress(f"resuming after {len(results)} rounds of {len(planned)} "
                 f"({sum(r.faults for r in results)} faults done)")
        rng = random.Random(f"{seed}/resumed/{len(results)}")
    for i, (kind, op) in enumerate(planned):
        if i < len(results):
            continue
        if operators_:
            op = operators_[i % len(operators_)]
        r = run_round(work / f"round-{i:04d}", kind, op, rng, spark=spark, members=members,
                      progress=progress, driver_process=driver_process, cluster=cluster)
        results.append(r)
        with open(work / "rounds.jsonl", "a") as f:
            f.write(json.dumps(asdict(r)) + "\n")
        progress(f"round {i + 1}: {r.kind:21} {r.pipeline:8} faults {r.faults} refusal "
                 f"{r.refusal or '-':21} given up {r.given_up or '-'} lost {r.lost} "
                 f"duplicated {r.duplicated} wrong {r.wrong} {r.seconds:5.1f}s "
                 f"{'valid' if r.valid else 'INVALID'}\n    {r.detail}"
                 + "".join(f"\n    error: {e}" for e in r.errors[-2:]))
    return results


def check_settings(path: Path, settings: dict, resume: bool) -> None:
    """Writes a run's ``settings`` to ``path``; with ``resume`` first checks they are those
    the run it goes on with wrote, but for more ``faults``, which extend its plan
    (InvalidArgumentError naming the ones that differ): a resumed plan is that run's plan
    only with its seed and kinds."""
    if resume and path.exists():
        before = json.loads(path.read_text())
        # more faults extend the plan (its first rounds are the same); anything else differs
        differ = [f"--{k.replace('_', '-')} {before.get(k)!r} there, {v!r} now"
                  for k, v in settings.items() if before.get(k) != v
                  and not (k == "faults" and v >= (before.get(k) or 0))]
        if differ:
            raise InvalidArgumentError(f"--resume: {path} is a run with other settings: "
                                       + "; ".join(differ))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings))


def read_rounds(path: Path) -> list[RoundResult]:
    """The rounds a run wrote to ``path`` (one JSON object a line; none if it is absent). A
    last line cut short by a kill is left out."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for n, line in enumerate(lines):
        try:
            out.append(RoundResult(**json.loads(line)))
        except (ValueError, TypeError):
            if n == len(lines) - 1:
                break           # the line a kill cut short
            raise InvalidArgumentError(f"{path}:{n + 1}: not a round of this campaign: "
                                       f"{line[:200]!r}") from None
    return out


def per_kind(results: list[RoundResult]) -> dict:
    out: dict = {}
    for r in results:
        k = out.setdefault(r.kind, {"rounds": 0, "faults": 0, "refusals": 0, "lost": 0,
                                    "duplicated": 0, "wrong": 0, "given_up": 0,
                                    "merkle_bytes": 0, "merkle_full_bytes": 0,
                                    "valid": True})
        k["rounds"] += 1
        k["faults"] += r.faults
        k["refusals"] += r.refusal is not None
        k["lost"] += r.lost
        k["duplicated"] += r.duplicated
        k["wrong"] += r.wrong
        k["given_up"] += len(r.given_up)
        k["merkle_bytes"] += r.merkle_bytes
        k["merkle_full_bytes"] += r.merkle_full_bytes
        k["valid"] = k["valid"] and r.valid
    return out


def summary(results: list[RoundResult]) -> str:
    lines = [f"{'kind':22}{'rounds':>7}{'faults':>7}{'refused':>8}{'lost':>6}{'dup':>5}"
             f"{'wrong':>6}{'given up':>9}{'merkle B':>10}{'full B':>10}  valid"]
    for name, k in per_kind(results).items():
        lines.append(f"{name:22}{k['rounds']:>7}{k['faults']:>7}{k['refusals']:>8}"
                     f"{k['lost']:>6}{k['duplicated']:>5}{k['wrong']:>6}{k['given_up']:>9}"
                     f"{k['merkle_bytes']:>10}{k['merkle_full_bytes']:>10}  "
                     f"{str(k['valid']).lower()}")
    lines.append(f"{len(results)} rounds, {sum(r.faults for r in results)} faults, "
                 f"{sum(not r.valid for r in results)} invalid")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = campaign_parser("python -m sparkjet.testing.persistence_campaign", __doc__,
                             f"(default: all): {', '.join(KINDS)}")
    parser.add_argument("--operators", default=None,
                        help=f"comma-separated operators taken in turn (default: all): "
                             f"{', '.join(OPERATORS)}")
    parser.add_argument("--driver-process", action="store_true",
                        help="run each round's first driver as a process of its own (its own "
                             "local Spark), killed with its JVM and members by SIGKILL to its "
                             "process group")
    parser.add_argument("--standalone", action="store_true",
                        help="on a local standalone cluster of 3 one-core workers, each a host "
                             "with its own storage root: every killed driver a process of its "
                             "own, every executor and Python worker killed with it (the worker "
                             "JVMs too every other round), the restart a new driver on the "
                             "same cluster")
    parser.add_argument("--run-driver", metavar="SPEC", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true",
                        help="also print the results as one JSON line")
    parser.add_argument("--resume", action="store_true",
                        help="go on from the rounds in DIR/rounds.jsonl (needs --dir, and the "
                             "same --seed and --kinds; --faults may grow)")
    args = parser.parse_args(argv)
    if args.resume and not args.dir:
        parser.error("--resume needs --dir, the work directory of the run to go on with")
    if args.run_driver:
        return _driver_main(json.loads(args.run_driver))
    kinds = args.kinds.split(",") if args.kinds else None
    for k in kinds or ():
        if k not in KINDS:
            parser.error(f"--kinds: no kind {k!r}; the kinds are {', '.join(KINDS)}")
    with tempfile.TemporaryDirectory(prefix="sparkjet-persistence-campaign-") as tmp:
        work = Path(args.dir or tmp)
        chosen = args.operators.split(",") if args.operators else None
        settings = {"faults": args.faults, "seed": args.seed, "kinds": kinds,
                    "operators": chosen, "standalone": args.standalone,
                    "members": args.members, "driver_process": args.driver_process}
        try:
            check_settings(work / "campaign.json", settings, args.resume)
        except InvalidArgumentError as e:
            parser.error(str(e))
        if args.standalone:
            with StandaloneCluster(workers=3, cores=1, memory="1g") as cluster:
                results = run_campaign(work, args.faults, args.seed, kinds=kinds,
                                       operators_=chosen, cluster=cluster,
                                       resume=args.resume)
        else:
            spark = local_session(f"local[{args.members}]", "sparkjet-persistence-campaign",
                                  **{"spark.ui.showConsoleProgress": "false"})
            spark.sparkContext.setLogLevel("OFF")
            try:
                results = run_campaign(work, args.faults, args.seed, spark=spark,
                                       members=args.members, kinds=kinds, operators_=chosen,
                                       driver_process=args.driver_process,
                                       resume=args.resume)
            finally:
                spark.stop()
    print(summary(results))
    if args.json:
        print("PERSISTENCE-CAMPAIGN-JSON " + json.dumps(
            {"kinds": per_kind(results), "rounds": [asdict(r) for r in results]}))
    return 1 if any(not r.valid for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
