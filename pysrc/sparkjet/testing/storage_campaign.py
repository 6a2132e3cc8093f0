"""The storage fault campaign (issue 24 item 7): jobs with ``storage="members"`` under
random faults of their slots and members, each round checked by :mod:`sparkjet.verify`.

``python -m sparkjet.testing.storage_campaign --faults 200 --json`` runs a long campaign on
``local[3]`` (three members, each claiming a slot under one ``storage_dir``; on one host
each slot is its own member group, so "a host" below is a slot); ``--standalone`` adds the
kinds only a cluster of worker JVMs has. The test suite runs a short one. Each round runs
one stateful pipeline exactly-once into files (a rolling count and sum, sliding windows,
session windows, ``map_state``, ``deduplicate``, an interval join, a table join; in turn)
and injects one kind of fault, at a random snapshot:

- ``kill-member``: SIGKILL of a member's Python worker (twice a round): its slot is
  reclaimed by the next task, a local restore;
- ``wipe-slot``: a member killed and its slot's folder removed while it is down: its
  partitions come back from their backups;
- ``two-lost-b1`` / ``two-lost-durable`` / ``two-lost-b2``: a member killed and two of
  the three slots removed at once, with ``backup_count=1`` (a refusal,
  ``SnapshotIncompleteError`` naming the partitions whose primary and backup were both
  lost: a backup holds only the byte ranges of the partitions it backs; a round that
  restores instead is a violation, but for the table join's pipeline, whose state is all
  broadcast and so in every slot: it restores exactly once), with ``durable_tier="sync"``
  too (a restore from the durable copy) and with ``backup_count=2`` (no loss);
  ``two-lost-async``: the same with ``durable_tier="async"``: a restore from the durable
  copy when the newest snapshot's upload was complete, else a refusal naming its durable
  copy and the partitions (a restore of an older snapshot is a violation: it would replay
  committed output);
- ``zombie``: a member SIGSTOPped (it keeps its slot's lock and its links) for 1 to 8 s, or
  until the next execution has committed a snapshot, then SIGCONT: it must never commit
  (on Spark the stage's cancellation kills it, if it is still stopped then);
- ``kill-before-ack``: a member killed while a chunk file of a snapshot not yet committed
  is in the slots (a backup's copy half written, ``*.part``, when the watch sees one);
- ``kill-phase2``: a member killed as the driver announces a commit (phase 2 under way);
- ``flip-byte`` / ``truncate`` / ``delete-replica``: a member killed and its slot removed,
  and one chunk file of the newest snapshot damaged in another slot: the restore uses the
  third copy (``backup_count=2``) or, with one backup, uses another copy or refuses by
  name; never a wrong restore;
- ``foreign-slot``: a slot of another host (its ``MEMBER.json``) put into ``storage_dir``:
  a refusal (``StorageSlotError``); the job runs again once it is removed;
- ``disk-full`` / ``read-only``: ``storage_dir`` (a small tmpfs) filled up or made
  read-only: a named error, and recovery once healed;
- ``kill-jvm`` / ``wipe-host`` (``--standalone`` only): a worker JVM killed (restarted
  later), or killed with its host's storage root wiped before it comes back.

Per kind the summary gives faults injected, restarts, refusals (by error name), lost and
duplicated events, and the time from the fault to the first snapshot a later execution
committed (recovery). A round is valid when exactly-once holds (lost 0, duplicated 0), or,
for a refusal, when the refusal is the one the kind allows (naming what the kind says it
names, such as the partitions) and what was committed before it duplicated nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import uuid as uuidlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sparkjet import verify
from sparkjet.cli.args import campaign_parser
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.connectors.generator import GeneratorSource
from sparkjet.errors import JobFailedError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.snapshot import layout
from sparkjet.spark import local_session
from sparkjet.testing import nemesis, operators
from sparkjet.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster

#: The stateful pipelines, taken in turn.
OPERATORS = operators.OPERATORS


@dataclass(frozen=True)
class Kind:
    """One kind of fault: the job settings it needs and what a round may end in:
    "recover" (exactly-once output), "refuse" (a refusal named `refusals`), "either", or
    "fix" (a named error or refusal, then exactly-once output once healed)."""

    name: str
    expect: str
    config: tuple = ()
    refusals: tuple = ()
    standalone: bool = False
    mount: bool = False        # storage_dir must be a small tmpfs of its own
    names: str = ""            # what a refusal's error must name (e.g. "partitions")


#: The pipelines whose state is all broadcast (the reference table and the source's
#: offsets), copied whole to every slot whatever ``backup_count``: losing two slots of
#: three loses none of it, so a restore is right where the keyed pipelines must refuse.
BROADCAST_ONLY = frozenset({"enrich"})

KINDS = {k.name: k for k in [
    Kind("kill-member", "recover"),
    Kind("wipe-slot", "recover"),
    # a backup holds only the byte ranges of the partitions it backs: on 3 slots, two
    # lost take both copies of a third of the partitions, so the restore is refused
    # naming them; a restore without that refusal has lost them
    Kind("two-lost-b1", "refuse", refusals=("SnapshotIncompleteError",),
         names="partitions"),
    Kind("two-lost-durable", "recover", config=(("durable_tier", "sync"),)),
    # the newest snapshot's upload may not be complete when its slots go: then exactly-
    # once refuses (never an older snapshot), naming its durable copy
    Kind("two-lost-async", "either", config=(("durable_tier", "async"),),
         refusals=("RecoveryRefusedError", "durable copy of snapshot"), names="partitions"),
    Kind("two-lost-b2", "recover", config=(("backup_count", 2),)),
    Kind("all-lost", "refuse", refusals=("SnapshotIncompleteError",), names="partitions"),
    Kind("all-lost-durable", "recover", config=(("durable_tier", "sync"),)),
    Kind("zombie", "recover"),
    Kind("kill-before-ack", "recover"),
    Kind("kill-phase2", "recover"),
    *(Kind(damage, "either", refusals=("SnapshotIncompleteError", "SnapshotCorruptError",
                                       "SnapshotNotFoundError", "SnapshotUnrestorableError"))
      for damage in ("flip-byte", "truncate", "delete-replica")),
    Kind("foreign-slot", "fix", refusals=("StorageSlotError",)),
    Kind("disk-full", "fix", refusals=("StorageError",), mount=True),
    Kind("read-only", "fix", refusals=("StorageError",), mount=True),
    Kind("kill-jvm", "recover", standalone=True),
    Kind("wipe-host", "recover", standalone=True),
]}


@dataclass
class RoundResult:
    kind: str
    pipeline: str
    backup_count: int
    faults: int = 0
    restarts: int = 0
    refusal: str | None = None           # the error a refusal named (class name)
    errors: list = field(default_factory=list)   # named errors of failed executions
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0                        # mismatched or unexpected rows
    recover_s: float | None = None
    seconds: float = 0.0
    valid: bool = False
    detail: str = ""


# ---- the pipelines ------------------------------------------------------------------------

def operator_job(work: Path, op: str, seed: int, events: int, rate: float,
                 config: dict) -> tuple[Job, callable, callable]:
    """The round's job (`op` of :data:`OPERATORS`, exactly-once into files under `work`),
    a maker of the same job again (a run after a failed one resumes its snapshots) and its
    check: ``check()`` -> :class:`verify.Report` of the output and the rows of a window
    emitted twice (after a refused run, its lost count means nothing)."""
    source = GeneratorSource(total=events, partitions=4, keys=5_000, rate=rate,
                             batch_size=5_000, seed=seed)
    stream = operators.build(Pipeline().read_from(source), op)
    out = work / "out"
    settings = dict(name=f"storage-campaign-{work.name}", processing_guarantee="exactly-once",
                    snapshot_store=str(work / "snapshots"), snapshot_interval=0.3,
                    local_parallelism=1, storage="members", restart_backoff=0.2,
                    heartbeat_timeout=3.0)
    full = stream.write_to(TransactionalFileSink(out))
    job = Job(full, JobConfig(**{**settings, **config}))

    def check() -> tuple[verify.Report, int]:
        return operators.check(op, source, TransactionalFileSink.read(out))
    return job, lambda: Job(full, job.config), check


# ---- slots as the campaign sees them --------------------------------------------------------

def slot_dirs(storage_dir: Path) -> list[Path]:
    return sorted(p for p in storage_dir.glob("slot-*") if p.is_dir())


def chunk_files(slot: Path, newest_only: bool = True) -> list[Path]:
    """The chunk files a slot holds (of its newest snapshot folder, by default)."""
    folders = {}
    for d in slot.glob("jobs/*/replicas/snapshots/*"):
        ids = layout.snapshot_of(d.name)
        if ids is not None:
            folders[ids] = d
    if not folders:
        return []
    chosen = [folders[max(folders)]] if newest_only else list(folders.values())
    return sorted(f for d in chosen for f in d.glob("*/*.chunks"))


def damage(path: Path, how: str, rng: random.Random) -> str:
    """Flips one byte of, truncates or deletes a chunk file; says what it did."""
    size = path.stat().st_size
    if how == "delete-replica":
        path.unlink()
        return f"deleted {path.name}"
    if how == "truncate":
        keep = rng.randrange(0, max(size, 1))
        os.truncate(path, keep)
        return f"truncated {path.name} from {size} to {keep} bytes"
    at = rng.randrange(size)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    return f"flipped a bit of byte {at} of {path.name} ({size} bytes)"


def foreign_slot(storage_dir: Path) -> Path:
    """A slot of host ``another-host`` in `storage_dir`, as if the folder were shared."""
    ident = str(uuidlib.uuid4())
    folder = storage_dir / f"slot-{ident}"
    folder.mkdir(parents=True)
    (folder / "MEMBER.json").write_text(json.dumps(
        {"format": 1, "uuid": ident, "host": "another-host", "created": "2026-01-01T00:00:00"}))
    return folder


def _glob(folder: Path, pattern: str) -> list[Path]:
    """``folder.glob(pattern)`` while the slots change under it ([] where a folder went
    away mid-scan: the slots drop old snapshots at every commit)."""
    try:
        return list(folder.glob(pattern))
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Whether `pid` runs or is stopped (not gone, not a zombie process waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _error_name(text: str, names) -> str | None:
    for n in names:
        if n in (text or ""):
            return n
    return None


# ---- one round --------------------------------------------------------------------------------

class Round:
    """One job under one kind of fault: the progress callback injects it (at snapshot
    `at` of an execution) and does what a kind does while the member is down (at the
    driver's ``restart`` event, which comes before the next execution starts)."""

    def __init__(self, kind: Kind, job: Job, storage_dir: Path, rng: random.Random,
                 cluster=None, progress=print):
        self.kind, self.job, self.storage_dir, self.rng = kind, job, storage_dir, rng
        self.cluster, self.say = cluster, progress
        self.wanted = 2 if kind.name == "kill-member" else 1
        self.at = rng.randint(1, 3)
        self.faults = 0
        self.fault_at: float | None = None
        self.fault_execution: int | None = None
        self.recovered_at: float | None = None
        self.execution: int | None = None
        self.snapshots = 0
        self.placed: dict[int, list[dict]] = {}
        self.pending: list = []          # undo at the restart (or the round's end)
        self.actions: list[str] = []
        self.victim: int | None = None
        self.zombie: nemesis.Pause | None = None
        self.stop = threading.Event()
        self.watch: threading.Thread | None = None
        self.restart_workers: list[threading.Thread] = []
        self.pending_fix: Path | None = None     # the foreign slot to remove before a rerun
        self.zombie_slot: str | None = None
        self.lock = threading.Lock()
        self.restarts = 0       # the driver's restart events (a failed run's too)
        self.events: list[dict] = []   # the driver's events but progress lines, timed
        self.timed: list[tuple[float, str]] = []   # faults, timed

    # the slots of the current execution, by member
    def slot_of(self, member: int) -> Path:
        return self.slot_path(next(s for s in self.placed[self.execution]
                                   if s["member"] == member))

    def slot_path(self, placed: dict) -> Path:
        """The folder of a slot of a ``placed`` event: under its host's storage root."""
        root = self.storage_dir
        if self.cluster is not None:   # hosts are worker-<i>, with storage_dir(i) each
            root = Path(self.cluster.storage_dir(int(placed["host"].rsplit("-", 1)[1])))
        return root / f"slot-{placed['uuid']}"

    def all_slots(self) -> list[Path]:
        if self.cluster is None:
            return slot_dirs(self.storage_dir)
        return [p for i in range(len(self.cluster.worker_pids()))
                for p in slot_dirs(Path(self.cluster.storage_dir(i)))]

    def _mark(self, what: str) -> None:
        self.faults += 1
        self.actions.append(what)
        self.timed.append((time.monotonic(), what))
        if self.fault_at is None or self.recovered_at is not None:
            self.fault_at, self.fault_execution, self.recovered_at = (
                time.monotonic(), self.execution, None)

    def _kill(self, member: int, why: str) -> bool:
        pid = self.job.member_pids.get(member)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.victim = member
        self._mark(f"{why}: SIGKILL member {member} (pid {pid}) of execution {self.execution}")
        return True

    def on_progress(self, event: dict) -> None:
        kind = event["event"]
        if kind != "progress":
            self.events.append({"t": round(time.monotonic(), 3), **event})
        if kind == "execution":
            self.execution, self.snapshots = event["execution"], 0
        elif kind == "placed":
            self.placed[event["execution"]] = event["slots"]
        elif kind == "snapshot":
            self.snapshots += 1
            if (self.fault_at is not None and self.recovered_at is None
                    and event["execution"] != self.fault_execution):
                self.recovered_at = time.monotonic()
                if self.zombie is not None:   # the next execution committed: wake the zombie
                    self.wake_zombie()
            if event.get("terminal"):
                return          # the job's end: nothing left to hit
            watching = self.watch is not None and self.watch.is_alive()
            if (self.snapshots >= self.at and self.faults < self.wanted and not watching
                    and (self.faults == 0 or event["execution"] != self.fault_execution)):
                self.inject(event)   # (nothing hit, no pid known yet: at the next snapshot)
        elif kind == "restart":
            self.restarts += 1
            self.while_down()

    def inject(self, event: dict) -> None:
        k = self.kind.name
        members = len(self.placed.get(self.execution, ()))
        if not members:
            return
        member = self.rng.randrange(members)
        if k == "zombie":
            pid = self.job.member_pids.get(member)
            if pid is not None:
                self.zombie = nemesis.Pause(pid, f"zombie member {member}").start()
                self.zombie_slot = self.slot_of(member).name[len("slot-"):]
                # woken after a random while (before or after the heartbeat timeout fails
                # its execution, or once the next one commits, whichever comes first)
                timer = threading.Timer(self.rng.uniform(1.0, 8.0), self.wake_zombie)
                timer.daemon = True
                timer.start()
                self.victim = member
                self._mark(f"SIGSTOP member {member} (pid {pid}) of execution {self.execution}")
        elif k == "kill-before-ack":
            self.watch = threading.Thread(target=self._watch_unacked, args=(member,),
                                          daemon=True)
            self.watch.start()
        elif k in ("disk-full", "read-only"):
            fault = (nemesis.DiskFull(self.storage_dir) if k == "disk-full"
                     else nemesis.ReadOnly(self.storage_dir))
            fault.start()
            self.pending.append(fault)
            self._mark(f"{fault.name} after snapshot {event['snapshot']}")
        elif k in ("kill-jvm", "wipe-host"):
            i = self.rng.randrange(len(self.cluster.worker_pids()))
            self._mark(f"kill worker {i}'s JVM after snapshot {event['snapshot']}"
                       + (f", wipe {self.cluster.storage_dir(i)}" if k == "wipe-host" else ""))
            t = threading.Thread(target=self._lose_worker, daemon=True,
                                 args=(i, k == "wipe-host", self.rng.uniform(1, 3)))
            t.start()   # not in the driver's progress callback: the kill waits for executors
            self.restart_workers.append(t)
        else:
            self._kill(member, "phase 2" if k == "kill-phase2" else k)
            if k == "kill-member" and self.faults < self.wanted:
                self.at = self.rng.randint(1, 3)   # again in the next execution

    def _lose_worker(self, i: int, wipe: bool, down: float) -> None:
        """Worker ``i``'s JVM killed (its executors with it), its storage root wiped if
        ``wipe``, and a new worker started in its place ``down`` s later."""
        self.cluster.kill_worker(i)
        if wipe:
            shutil.rmtree(self.cluster.storage_dir(i), ignore_errors=True)
        time.sleep(down)
        self.cluster.restart_worker(i)

    def wake_zombie(self) -> None:
        """SIGCONT of the zombie, saying whether it was still alive (Spark had not killed
        it), in which execution, and whether a later one had claimed its slot."""
        with self.lock:
            zombie, self.zombie = self.zombie, None
        if zombie is None:
            return
        pid = zombie.stopped[0] if zombie.stopped else None
        alive = pid is not None and _alive(pid)
        execution = self.execution
        held = (execution != self.fault_execution and self.zombie_slot in
                {s["uuid"] for s in self.placed.get(execution, ())})
        zombie.heal()
        self.actions.append(f"SIGCONT the zombie during execution {execution} "
                            f"({'alive' if alive else 'gone'}"
                            + (f"; its slot {'reclaimed' if held else 'not reclaimed'}"
                               if execution != self.fault_execution else "") + ")")

    def _watch_unacked(self, member: int) -> None:
        """Kills a member while a chunk file of a snapshot not yet committed is in the slots:
        the member whose slot holds a backup's half-written copy (``*.part``) if the watch
        sees one within 3 s, else `member` as soon as its slot has a newer snapshot folder
        than the newest committed one."""
        committed = self._newest_committed()
        deadline = time.monotonic() + 3.0
        execution = self.execution
        while not self.stop.is_set() and self.execution == execution:
            for slot in self.all_slots():
                for part in _glob(slot, "jobs/*/replicas/snapshots/*/*/*.part"):
                    who = next((s["member"] for s in self.placed.get(execution, ())
                                if slot.name == f"slot-{s['uuid']}"), None)
                    if who is not None and self._kill(who, f"backup copy {part.name} half "
                                                           "written (before the ack)"):
                        return
            if time.monotonic() > deadline:
                mine = self.slot_of(member)
                for d in _glob(mine, "jobs/*/replicas/snapshots/*"):
                    ids = layout.snapshot_of(d.name)
                    if ids and ids[0] > committed and _glob(d, "*/*.chunks"):
                        if self._kill(member, f"snapshot {ids[0]} written in its slot, not "
                                              "yet committed"):
                            return
            time.sleep(0.002)

    def _newest_committed(self) -> int:
        newest = 0
        for slot in self.all_slots():
            for rec in _glob(slot, "jobs/*/records/*"):
                if rec.name.isdigit():
                    newest = max(newest, int(rec.name))
        return newest

    def while_down(self) -> None:
        """At the driver's restart event: what a kind does to the slots while the member is
        down, or heals."""
        k = self.kind.name
        for fault in self.pending:
            fault.heal()
            self.actions.append(f"heal {fault.name}")
        self.pending.clear()
        last = self.placed.get(self.execution)
        if self.victim is None or not last or self.faults == 0:
            return
        slots = {s["member"]: self.slot_path(s) for s in last}
        lost = slots[self.victim]
        if k == "wipe-slot" or k in ("flip-byte", "truncate", "delete-replica"):
            others = [p for m, p in slots.items() if m != self.victim]
            if k != "wipe-slot":
                files = [f for p in others for f in chunk_files(p)]
                if files:
                    self.actions.append(damage(self.rng.choice(files), k, self.rng))
            shutil.rmtree(lost, ignore_errors=True)
            self.actions.append(f"wipe {lost.name}")
        elif k.startswith(("two-lost", "all-lost")):
            wiped = list(slots.values()) if k.startswith("all-lost") else [
                lost, self.rng.choice([p for m, p in slots.items() if m != self.victim])]
            for p in wiped:
                shutil.rmtree(p, ignore_errors=True)
            self.actions.append(f"wipe {' and '.join(p.name for p in wiped)}")
        elif k == "foreign-slot" and self.pending_fix is None:
            self.pending_fix = foreign_slot(lost.parent)
            self.actions.append(f"foreign slot {self.pending_fix.name} (host another-host)")
        self.victim = None

    def finish(self) -> None:
        self.stop.set()
        if self.watch is not None:
            self.watch.join()
        self.wake_zombie()
        for fault in self.pending:
            fault.heal()
        self.pending.clear()
        for t in self.restart_workers:
            t.join()


def run_round(work: Path, kind: Kind, op: str, rng: random.Random, *, spark, members: int,
              cluster=None, events: int | None = None, rate: float = 100_000,
              progress=print) -> RoundResult:
    """One job with `op` under one fault of `kind`, on `spark` with `members` members;
    returns what happened and the checker's verdict."""
    work.mkdir(parents=True, exist_ok=True)
    if events is None:   # a few seconds of input: snapshots 1-3 come well before its end
        events = 600_000 if cluster is not None else 400_000
    config = dict(kind.config)
    backup = config.get("backup_count", 1)
    if kind.name in ("flip-byte", "truncate", "delete-replica"):
        backup = config["backup_count"] = rng.choice((1, 2))
    with contextlib.ExitStack() as stack:
        if cluster is not None:
            storage_dir = None
            config["members"] = None
        else:
            storage_dir = work / "slots"
            if kind.mount:
                stack.enter_context(nemesis.tmpfs(storage_dir, "32m"))
            config.update(members=members, storage_dir=str(storage_dir))
        config.setdefault("max_restarts", 4)
        result = RoundResult(kind.name, op, backup)
        job, again, check = operator_job(work, op, rng.randrange(2**32), events, rate, config)
        rnd = Round(kind, job, storage_dir or work / "slots", rng, cluster, progress)
        start = time.monotonic()
        failed = None
        try:
            executions = job.run(spark, on_progress=rnd.on_progress).executions
        except JobFailedError as e:
            failed, executions = str(e), []
        finally:
            rnd.finish()
        result.faults, result.restarts = rnd.faults, rnd.restarts
        restored = [e.get("restored_from") for e in executions]
        if len(restored) > 1:
            rnd.actions.append(f"restored from {restored}")
        with open(work / "errors.txt", "w") as f:   # whole, for whoever looks into a round
            for e in executions:
                if e.get("status") != "ok" and e.get("error"):
                    result.errors.append(str(e["error"]).splitlines()[0][:300])
                    f.write(f"execution {e.get('execution_id')}: {e['error']}\n\n")
            if failed is not None:
                f.write(failed + "\n")
        with open(work / "events.jsonl", "w") as f:
            for e in rnd.events + [{"t": round(t, 3), "action": a} for t, a in rnd.timed]:
                f.write(json.dumps(e, default=str) + "\n")
        if failed is not None:
            result.refusal = _error_name(failed, kind.refusals) or "JobFailedError"
            result.errors.append(failed.splitlines()[0][:1000])   # the refusal, whole
            if kind.expect == "fix":
                if rnd.pending_fix is not None:
                    shutil.rmtree(rnd.pending_fix, ignore_errors=True)
                rnd.actions.append("run again")
                again().run(spark, on_progress=rnd.on_progress)
                if rnd.recovered_at is None and rnd.fault_at is not None:
                    rnd.recovered_at = time.monotonic()
        result.seconds = time.monotonic() - start
        if rnd.fault_at is not None and rnd.recovered_at is not None:
            result.recover_s = round(rnd.recovered_at - rnd.fault_at, 2)
        partial = failed is not None and kind.expect != "fix"
        report, repeated = check()
        result.lost = 0 if partial else report.lost_count
        result.duplicated = report.duplicated_count + repeated
        result.wrong = len(report.mismatched) + report.unexpected_count if not partial else (
            report.unexpected_count)
        result.detail = "; ".join(rnd.actions)
        result.valid = _valid(kind, result, partial)
    return result


def _valid(kind: Kind, r: RoundResult, partial: bool) -> bool:
    if r.duplicated or r.wrong or (not partial and r.lost):
        return False
    if r.refusal is not None and kind.expect != "fix":
        return (kind.expect in ("refuse", "either") and r.refusal in kind.refusals
                and (not kind.names or any(kind.names in e for e in r.errors)))
    if kind.expect == "refuse":
        # a round that injected nothing proves nothing, but is no defect; nor is an exact
        # restore of a pipeline whose state is all broadcast (every slot holds it whole)
        return r.faults == 0 or (r.pipeline in BROADCAST_ONLY and kind.name != "all-lost")
    return True


# ---- the campaign ------------------------------------------------------------------------------

def plan(kinds, faults: int, rng: random.Random) -> list[tuple[Kind, str]]:
    """Rounds until `faults` faults are planned: every kind in turn first, then at random;
    operators in turn."""
    out, n = [], 0
    order = list(kinds)
    while n < faults:
        kind = order[len(out)] if len(out) < len(order) else rng.choice(order)
        out.append((kind, OPERATORS[len(out) % len(OPERATORS)]))
        n += 2 if kind.name == "kill-member" else 1
    return out


def run_campaign(work: Path, faults: int, seed: int = 0, progress=print, *, spark,
                 members: int = 3, kinds=None, cluster=None) -> list[RoundResult]:
    rng = random.Random(seed)
    chosen = [KINDS[k] for k in kinds] if kinds else [
        k for k in KINDS.values() if (cluster is not None or not k.standalone)
        and not (k.mount and (cluster is not None or nemesis.missing("disk")))]
    results = []
    for i, (kind, op) in enumerate(plan(chosen, faults, rng)):
        r = run_round(work / f"round-{i:04d}", kind, op, rng, spark=spark, members=members,
                      cluster=cluster, progress=progress)
        results.append(r)
        with open(work / "rounds.jsonl", "a") as f:   # a campaign stopped early still counts
            f.write(json.dumps(asdict(r)) + "\n")
        progress(f"round {i + 1}: {r.kind:16} {r.pipeline:8} b{r.backup_count} faults "
                 f"{r.faults} restarts {r.restarts:2} refusal {r.refusal or '-':24} lost "
                 f"{r.lost} duplicated {r.duplicated} wrong {r.wrong} recover "
                 f"{r.recover_s if r.recover_s is not None else '-'}s {r.seconds:5.1f}s "
                 f"{'valid' if r.valid else 'INVALID'}\n    {r.detail}"
                 + "".join(f"\n    error: {e}" for e in r.errors[:3]))
    return results


def per_kind(results: list[RoundResult]) -> dict:
    """Per kind: rounds, faults, restarts, refusals by name, lost, duplicated, wrong, the
    median and largest time to recover, and whether every round was valid."""
    out: dict = {}
    for r in results:
        k = out.setdefault(r.kind, {"rounds": 0, "faults": 0, "restarts": 0, "refusals": {},
                                    "lost": 0, "duplicated": 0, "wrong": 0, "recover_s": [],
                                    "valid": True})
        k["rounds"] += 1
        k["faults"] += r.faults
        k["restarts"] += r.restarts
        if r.refusal:
            k["refusals"][r.refusal] = k["refusals"].get(r.refusal, 0) + 1
        k["lost"] += r.lost
        k["duplicated"] += r.duplicated
        k["wrong"] += r.wrong
        if r.recover_s is not None:
            k["recover_s"].append(r.recover_s)
        k["valid"] = k["valid"] and r.valid
    for k in out.values():
        times = k.pop("recover_s")
        k["recover_median_s"] = float(np.median(times)) if times else None
        k["recover_max_s"] = max(times) if times else None
    return out


def summary(results: list[RoundResult]) -> str:
    lines = [f"{'kind':18}{'rounds':>7}{'faults':>7}{'restarts':>9}{'lost':>6}{'dup':>5}"
             f"{'wrong':>6}{'recover p50/max s':>19}  {'valid':6}refusals"]
    for name, k in per_kind(results).items():
        rec = ("-" if k["recover_median_s"] is None
               else f"{k['recover_median_s']:.1f}/{k['recover_max_s']:.1f}")
        lines.append(f"{name:18}{k['rounds']:>7}{k['faults']:>7}{k['restarts']:>9}"
                     f"{k['lost']:>6}{k['duplicated']:>5}{k['wrong']:>6}{rec:>19}  "
                     f"{str(k['valid']).lower():6}"
                     + ", ".join(f"{n} x{c}" for n, c in k["refusals"].items()))
    total = sum(r.faults for r in results)
    lines.append(f"{len(results)} rounds, {total} faults, "
                 f"{sum(not r.valid for r in results)} invalid")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = campaign_parser("python -m sparkjet.testing.storage_campaign", __doc__,
                             f"(default: all that can run here): {', '.join(KINDS)}")
    parser.add_argument("--standalone", action="store_true",
                        help="on a local standalone cluster of 3 one-core workers, each a host "
                             "with its own storage root (adds kill-jvm and wipe-host)")
    parser.add_argument("--json", action="store_true",
                        help="also print the results as one JSON line")
    parser.add_argument("--report", metavar="ROUNDS_JSONL", default=None,
                        help="print the summary of a campaign's rounds.jsonl (one stopped "
                             "early, say) and run nothing")
    args = parser.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            results = [RoundResult(**json.loads(line)) for line in f if line.strip()]
        print(summary(results))
        if args.json:
            print("STORAGE-CAMPAIGN-JSON " + json.dumps({"kinds": per_kind(results)}))
        return 1 if any(not r.valid for r in results) else 0
    kinds = args.kinds.split(",") if args.kinds else None
    for k in kinds or ():
        if k not in KINDS:
            parser.error(f"--kinds: no kind {k!r}; the kinds are {', '.join(KINDS)}")
    with tempfile.TemporaryDirectory(prefix="sparkjet-storage-campaign-") as tmp:
        work = Path(args.dir or tmp)
        if args.standalone:
            with StandaloneCluster(workers=3, cores=1, memory="1g") as cluster:
                spark = cluster.session("sparkjet-storage-campaign", **{
                    "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
                    "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS})
                spark.sparkContext.setLogLevel("OFF")
                try:
                    results = run_campaign(work, args.faults, args.seed, spark=spark,
                                           kinds=kinds, cluster=cluster)
                finally:
                    spark.stop()
        else:
            spark = local_session(f"local[{args.members}]", "sparkjet-storage-campaign",
                                  **{"spark.ui.showConsoleProgress": "false"})
            spark.sparkContext.setLogLevel("OFF")
            try:
                results = run_campaign(work, args.faults, args.seed, spark=spark,
                                       members=args.members, kinds=kinds)
            finally:
                spark.stop()
    print(summary(results))
    if args.json:
        print("STORAGE-CAMPAIGN-JSON " + json.dumps(
            {"kinds": per_kind(results), "rounds": [asdict(r) for r in results]}))
    return 1 if any(not r.valid for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
