"""Nemesis campaigns: exactly-once jobs run while every kind of nemesis of
:mod:`sparkjet.testing.nemesis` acts on them, checked by :mod:`sparkjet.verify` and by what
the sink holds afterwards, with a report per kind.

``python -m sparkjet.campaign --nemesis all --faults 200`` runs one; the test suite runs a
few faults (``tests/testing/test_nemesis_campaign.py``). Each round runs a keyed count and
sum (exactly-once, one member process, restarted by the local supervisor) from a
deterministic generator into one sink, and injects faults of one kind at random moments,
each held a random while and then healed:

=============  =================================================================  =========
kind           fault                                                              sink
=============  =================================================================  =========
``kill``       the member killed (SIGKILL)                                        SQLite
``pause``      the member stopped (SIGSTOP) and resumed                           SQLite
``clock``      the member's wall clock skewed or jumped by up to an hour, forward  file
               or back (libfaketime, while it runs)
``disk``       the snapshot store's file system (a small tmpfs) full, the store    file
               read-only, or the store's folder removed and put back
``server``     PostgreSQL stopped hard (``immediate``) or cleanly and restarted,   PostgreSQL
               or paused (SIGSTOP); prepared transactions are left behind         2PC
``network``    the link to PostgreSQL through a :class:`~.proxy.Proxy`: delayed   PostgreSQL
               (with jitter: connections reorder), lossy, stalled (a partition    2PC
               with the connections open), or every connection reset
=============  =================================================================  =========

and, with ``--standalone``-style namespaces available (root, ``ip``, ``nft``), the
``partition`` kind: :func:`sparkjet.testing.partition_campaign.run` on a standalone Spark
cluster whose workers are network namespaces.

Per kind the report gives: faults injected, restarts of the job, time to recover (from a
fault's heal, or a kill, to the next complete snapshot), lost and duplicated outputs
(:func:`sparkjet.verify.check_aggregates` on the sink's final contents), and stale reads:
a reader polls the sink's committed contents while the job runs, and a key whose count
goes down between two reads (committed output that went back) is a stale read.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from sparkjet import verify
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.connectors.generator import GeneratorSource
from sparkjet.connectors.postgres import PostgresSink
from sparkjet.connectors.sqlite import SQLiteUpsertSink
from sparkjet.errors import JobFailedError, NemesisError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.testing import nemesis
from sparkjet.testing.proxy import Proxy

__all__ = ["KINDS", "FaultRecord", "NemesisRound", "run", "summary"]

#: Every kind of a local round, in the order ``all`` cycles through them.
KINDS = ("kill", "pause", "clock", "disk", "server", "network")
#: The sink each kind writes to.
SINKS = {"kill": "sqlite", "pause": "sqlite", "clock": "file", "disk": "file",
         "server": "postgres", "network": "postgres"}


@dataclass
class FaultRecord:
    kind: str
    name: str
    start: float
    end: float | None = None        # healed (a kill: when it was sent)
    recovered: float | None = None  # seconds from `end` to the next complete snapshot


@dataclass
class NemesisRound:
    kind: str
    sink: str
    faults: list[FaultRecord]
    restarts: int
    seconds: float
    report: verify.Report | None
    stale_reads: int
    error: str | None = None        # the job's own failure, if it failed
    notes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)   # broken promises seen otherwise

    @property
    def lost(self) -> int:
        """Outputs missing from a job that finished (a failed job's missing outputs are
        what it never got to: :attr:`unfinished`)."""
        return self.report.lost_count if self.report is not None and not self.error else 0

    @property
    def unfinished(self) -> int:
        return self.report.lost_count if self.report is not None and self.error else 0

    @property
    def duplicated(self) -> int:
        return self.report.duplicated_count if self.report is not None else 0

    @property
    def valid(self) -> bool:
        """Exactly-once kept (nothing lost, nothing duplicated), no stale read from a
        transactional sink, or the job ended with a clear error and what it committed has
        no duplicate. An idempotent upsert sink (SQLite) may be read stale: it writes at
        prepare, before the snapshot completes, and a restart replays from the snapshot
        before, so a reader can see a value go back until the replay catches up."""
        if self.report is None or self.violations:
            return False
        stale_ok = self.sink == "sqlite" or self.stale_reads == 0
        if self.error is not None:
            return self.report.duplicated_count == 0 and stale_ok
        return self.report.valid and stale_ok


class Servers:
    """The servers a campaign's rounds need, started once: PostgreSQL (the tests' launcher,
    ``helpers.postgres_server``, when importable) behind a :class:`Proxy`."""

    def __init__(self):
        self.postgres = None
        self.proxy: Proxy | None = None
        self.why_not: dict[str, str] = {}

    def start(self, kinds) -> Servers:
        if {"server", "network"} & set(kinds):
            try:
                from helpers import postgres_server  # the tests' launcher, when on the path
            except ImportError:
                for k in ("server", "network"):
                    self.why_not[k] = ("needs PostgreSQL: put the repository's tests/ folder "
                                       "on PYTHONPATH (helpers.postgres_server starts one)")
            else:
                try:
                    self.postgres = postgres_server.start()
                except (RuntimeError, postgres_server.PostgresServerMissing) as e:
                    for k in ("server", "network"):
                        self.why_not[k] = f"needs PostgreSQL: {e}"
                else:
                    self.proxy = Proxy(f"127.0.0.1:{self.postgres.port}").start()
        if "clock" in kinds and nemesis.missing("clock"):
            self.why_not["clock"] = nemesis.missing("clock")
        if "disk" in kinds and nemesis.missing("disk"):
            self.why_not["disk"] = nemesis.missing("disk")
        return self

    def dsn(self, through_proxy: bool) -> str:
        port = self.proxy.port if through_proxy else self.postgres.port
        return (f"host=127.0.0.1 port={port} dbname=postgres user={self.postgres.user} "
                f"password={self.postgres.password} connect_timeout=5")

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.postgres is not None:
            with contextlib.suppress(Exception):
                if self.postgres.process.poll() is not None:
                    self.postgres.restart()
            self.postgres.stop()


def run_round(work: Path, kind: str, faults: int, rng: random.Random, servers: Servers,
              *, rate: float = 100_000) -> NemesisRound:
    """One job with ``faults`` faults of ``kind`` (see the module doc)."""
    work.mkdir(parents=True, exist_ok=True)
    sink_kind = SINKS[kind]
    seed = rng.randrange(2**32)
    # long enough for the faults (each held up to ~2 s) with some calm between them
    seconds = 3.0 + 2.5 * faults
    if kind == "clock":
        rate /= 4       # libfaketime slows every clock call of the member several times
    source = GeneratorSource(total=int(rate * seconds), partitions=4, keys=2_000, rate=rate,
                             batch_size=5_000, seed=seed)
    table = f"nemesis_{work.name}_{seed:x}".replace("-", "_")
    if sink_kind == "sqlite":
        sink = SQLiteUpsertSink(work / "out.sqlite", "out", key=["key"])
    elif sink_kind == "file":
        sink = TransactionalFileSink(work / "out")
    else:
        PostgresSink.drop(servers.dsn(False), table)
        sink = PostgresSink(servers.dsn(kind == "network"), table)

    disk = work / "disk"
    store = disk / "snapshots"      # a folder of the file system, so it can be moved away
    mount = contextlib.nullcontext(disk)
    if kind == "disk":
        mount = nemesis.tmpfs(disk, "48m")
    with mount:
        store.mkdir(parents=True, exist_ok=True)
        config = JobConfig(name=f"nemesis-{work.name}", processing_guarantee="exactly-once",
                           snapshot_store=str(store), snapshot_interval=0.2,
                           max_restarts=faults * 3 + 10, restart_backoff=0.05)
        job = Job(Pipeline().read_from(source).group_by("key")
                  .aggregate(count="count", sum=("sum", "value")).write_to(sink), config)

        def read():
            if sink_kind == "sqlite":
                return SQLiteUpsertSink.read(work / "out.sqlite", "out")
            if sink_kind == "file":
                return verify.last_update_per_key(TransactionalFileSink.read(work / "out"))
            return verify.last_update_per_key(PostgresSink.read(servers.dsn(False), table))

        skew = None
        env_before = {}
        if kind == "clock":
            skew = nemesis.ClockSkew(work / "faketime", 0)
            # reread the offset once a second, not at every clock call (which slows the
            # member down several times over)
            env = {k: v for k, v in skew.env().items() if k != "FAKETIME_NO_CACHE"}
            env["FAKETIME_CACHE_DURATION"] = "1"
            for k, v in env.items():
                env_before[k] = os.environ.get(k)
                os.environ[k] = v                # the member processes inherit it
        records: list[FaultRecord] = []
        lock = threading.Lock()
        events = {"snapshot": 0, "restarts": 0}
        stop = threading.Event()
        active: list[nemesis.Nemesis] = []

        def on_progress(event: dict) -> None:
            with lock:
                if event["event"] == "snapshot":
                    events["snapshot"] += 1
                    now = time.monotonic()
                    for r in records:
                        if r.end is not None and r.recovered is None and now >= r.end:
                            r.recovered = round(now - r.end, 3)
                elif event["event"] == "restart":
                    events["restarts"] += 1
                    if kind == "disk":          # an operator freeing the disk after it failed
                        for n in list(active):
                            n.heal()

        stale = [0]
        reader = threading.Thread(target=_stale_reader, args=(read, stop, stale), daemon=True)
        injector = threading.Thread(
            target=_inject, daemon=True,
            args=(kind, faults, rng, job, servers, store, skew, records, lock, stop, active,
                  events))
        start = time.monotonic()
        reader.start()
        injector.start()
        error = None
        result = None
        try:
            result = job.run(on_progress=on_progress)
        except JobFailedError as e:
            error = str(e)[:500]
        finally:
            stop.set()
            injector.join(120)
            for n in active:
                n.heal()
            reader.join(30)
            for k, v in env_before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        elapsed = time.monotonic() - start
        try:
            out = read()
        except Exception as e:  # noqa: BLE001 (reported: the sink cannot be read back)
            return NemesisRound(kind, sink_kind, records, events["restarts"], elapsed, None,
                                stale[0], error or f"the sink could not be read: {e}")
    report = verify.check_aggregates(source.expected_counts(), out.select(["key", "count", "sum"]),
                                     key="key", columns=["count", "sum"],
                                     guarantee="exactly-once")
    notes = []
    if kind == "server" and servers.postgres is not None:
        notes += _prepared_left(servers)
    return NemesisRound(kind, sink_kind, records,
                        result.restarts if result is not None else events["restarts"], elapsed,
                        report, stale[0], error, notes)


def _stale_reader(read, stop: threading.Event, stale: list) -> None:
    """Reads the sink's committed contents every 0.3 s; a key whose count went down since
    the last read is a stale read."""
    seen: dict = {}
    while not stop.wait(0.3):
        try:
            t = read()
        except Exception:  # noqa: BLE001, S112 (a sink down under a fault: read it next time)
            continue
        if t.num_rows == 0:
            continue
        for key, count in zip(t.column("key").to_pylist(), t.column("count").to_pylist(),
                              strict=True):
            if count < seen.get(key, 0):
                stale[0] += 1
            seen[key] = max(count, seen.get(key, 0))


def _prepared_left(servers: Servers) -> list[str]:
    """Prepared transactions still on the server after the job: none may stay."""
    import psycopg

    with psycopg.connect(servers.dsn(False), autocommit=True) as conn:
        left = conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()
    return [f"prepared transactions left on PostgreSQL: {[g for (g,) in left]}"] if left else []


def _inject(kind, faults, rng, job, servers, store, skew, records, lock, stop, active, events):
    """Injects ``faults`` faults of ``kind`` one after another, each at a random moment of
    the running job and held a random while."""
    done = 0
    while done < faults and not stop.is_set():
        # wait for a running member with a snapshot behind it, then a random while
        seen = events["snapshot"]
        while not stop.is_set() and (job.member_pid is None or events["snapshot"] <= seen):
            time.sleep(0.02)
        if stop.wait(rng.uniform(0.05, 0.8)):
            return
        pid = job.member_pid
        if pid is None:
            continue
        hold = rng.uniform(0.2, 2.0)
        # a fatal disk fault only ends a round that had other faults before it
        n = _nemesis(kind, rng, pid, servers, store, skew, hold, 0 < done == faults - 1)
        if n is None:
            continue
        label = _LABELS.get(type(n).__name__, "kill")
        if isinstance(n, nemesis.ServerOutage):
            label = n.name.split(" ", 1)[1]            # "halt", "halt-immediate"
        record = FaultRecord(kind, f"{label}: {n.name if isinstance(n, nemesis.Nemesis) else n}",
                             time.monotonic())
        try:
            if isinstance(n, str):            # a kill: nothing to heal
                os.kill(pid, signal.SIGKILL)
            else:
                with lock:
                    active.append(n)
                n.start()
                stop.wait(hold)
                n.heal()
                with lock:
                    active.remove(n)
        except (ProcessLookupError, NemesisError):
            continue                          # the member was already gone: not a fault
        record.end = time.monotonic()
        with lock:
            records.append(record)
        done += 1


#: The short name of each nemesis in the per-kind report.
_LABELS = {"Pause": "pause", "ClockSkew": "skew", "DiskFull": "full", "ReadOnly": "read-only",
           "Removed": "removed", "Delay": "delay", "Lossy": "loss", "Stall": "stall",
           "ResetLinks": "reset"}


def _nemesis(kind, rng, pid, servers, store, skew, hold, last):
    if kind == "kill":
        return f"kill -9 member {pid}"
    if kind == "pause":
        return nemesis.Pause(pid, name=f"pause member {hold:.1f}s")
    if kind == "clock":
        offset = rng.choice([-3600, -600, -5, 5, 600, 3600]) * rng.uniform(0.5, 1)
        skew.offset = offset
        skew.name = f"clock skew {offset:+.0f}s"
        return skew
    if kind == "disk":
        # the store's folder removed ends the job by design (SnapshotStoreLostError: what is
        # written then can be neither restored nor fenced), and so does a read-only store
        # (StorageError naming the path and EROFS, not retried): only as a round's last fault
        which = rng.choice(["full", "read-only", "removed"] if last else ["full"])
        if which == "full":
            return nemesis.DiskFull(store.parent)
        if which == "read-only":
            return nemesis.ReadOnly(store)
        return nemesis.Removed(store)
    if kind == "server":
        which = rng.choice(["halt", "halt-immediate", "pause"])
        pg = servers.postgres
        if which == "pause":
            return nemesis.Pause(pg.process.pid, name="pause PostgreSQL")
        return nemesis.ServerOutage(_Halt(pg, "immediate" if which == "halt-immediate"
                                          else "fast"), name=f"PostgreSQL {which}")
    proxy = servers.proxy
    which = rng.choice(["delay", "loss", "stall", "reset"])
    if which == "delay":
        return nemesis.Delay(proxy, rng.uniform(0.01, 0.2), rng.uniform(0, 0.2))
    if which == "loss":
        return nemesis.Lossy(proxy, rng.uniform(0.05, 0.4))
    if which == "stall":
        return nemesis.Stall(proxy)
    return nemesis.ResetLinks(proxy)


class _Halt:
    """A PostgreSQL server's halt in one mode, for :class:`nemesis.ServerOutage`."""

    def __init__(self, server, mode: str):
        self.server, self.mode = server, mode

    def halt(self) -> None:
        self.server.halt(self.mode)

    def restart(self) -> None:
        self.server.restart()


def run(work: Path, total_faults: int, kinds=KINDS, seed: int = 0, progress=print,
        faults_per_round: int = 4, servers: Servers | None = None) -> list[NemesisRound]:
    """Rounds over ``kinds`` in turn until ``total_faults`` faults were injected. Kinds
    that cannot run here are left out with the reason (``progress``)."""
    rng = random.Random(seed)
    own = servers is None
    servers = servers or Servers().start(kinds)
    try:
        runnable = [k for k in kinds if k not in servers.why_not]
        for k in kinds:
            if k in servers.why_not:
                progress(f"kind {k} left out: {servers.why_not[k]}")
        if not runnable:
            return []
        results: list[NemesisRound] = []
        done, i, idle = 0, 0, 0
        while done < total_faults:
            kind = runnable[i % len(runnable)]
            n = min(faults_per_round, total_faults - done)
            r = run_round(work / f"round-{i:05d}", kind, n, rng, servers)
            results.append(r)
            done += len(r.faults)
            i += 1
            rec = [f.recovered for f in r.faults if f.recovered is not None]
            progress(f"round {i}: {kind:8} {r.sink:9} faults {len(r.faults):2} restarts "
                     f"{r.restarts:2} {r.seconds:5.1f}s recover max "
                     f"{max(rec) if rec else '-'} lost {r.lost} duplicated {r.duplicated} "
                     f"stale {r.stale_reads} {'valid' if r.valid else 'INVALID'}"
                     + (f"\n    failed: {r.error}" if r.error else "")
                     + "".join(f"\n    {note}" for note in r.notes)
                     + "".join(f"\n    VIOLATION: {v}" for v in r.violations))
            progress(round_json(r))
            idle = idle + 1 if not r.faults else 0
            if idle == 3:
                break
        return results
    finally:
        if own:
            servers.stop()


def round_json(r: NemesisRound) -> str:
    """One round as a ``ROUND-JSON`` line: a long run's log can be summed up while it runs
    (:func:`from_log`)."""
    import json

    return "ROUND-JSON " + json.dumps({
        "kind": r.kind, "sink": r.sink, "faults": [f.name for f in r.faults],
        "recovered": [f.recovered for f in r.faults], "restarts": r.restarts,
        "seconds": round(r.seconds, 1), "lost": r.lost, "unfinished": r.unfinished,
        "duplicated": r.duplicated, "stale_reads": r.stale_reads, "error": r.error,
        "notes": r.notes, "violations": r.violations, "valid": r.valid})


def from_log(lines) -> list[NemesisRound]:
    """The rounds of a campaign's output (its ``ROUND-JSON`` lines), for :func:`summary`
    of a run still going or cut short."""
    import json

    rounds = []
    for line in lines:
        if not line.startswith("ROUND-JSON "):
            continue
        d = json.loads(line[len("ROUND-JSON "):])
        # the counts the summary needs, standing in for the checker's report
        report = SimpleNamespace(lost_count=d["lost"] + d["unfinished"],
                                 duplicated_count=d["duplicated"],
                                 valid=d["valid"] or d["error"] is not None)
        faults = [FaultRecord(d["kind"], n, 0.0, 0.0, rec)
                  for n, rec in zip(d["faults"], d["recovered"], strict=True)]
        rounds.append(NemesisRound(d["kind"], d["sink"], faults, d["restarts"], d["seconds"],
                                   report, d["stale_reads"], d["error"], d["notes"],
                                   d["violations"]))
    return rounds


def per_kind(results: list[NemesisRound]) -> dict[str, dict]:
    """Per kind: rounds, faults, restarts, recovery times (p50, max), lost, duplicated,
    stale reads, failed jobs, invalid rounds."""
    out: dict[str, dict] = {}
    for r in results:
        k = out.setdefault(r.kind, {"rounds": 0, "faults": 0, "restarts": 0, "recover": [],
                                    "lost": 0, "unfinished": 0, "duplicated": 0, "stale_reads": 0,
                                    "failed": 0,
                                    "invalid": 0, "names": {}})
        k["rounds"] += 1
        k["faults"] += len(r.faults)
        k["restarts"] += r.restarts
        k["recover"] += [f.recovered for f in r.faults if f.recovered is not None]
        k["lost"] += r.lost
        k["unfinished"] += r.unfinished
        k["duplicated"] += r.duplicated
        k["stale_reads"] += r.stale_reads
        k["failed"] += r.error is not None
        k["invalid"] += not r.valid
        for f in r.faults:
            head = f.name.split(":")[0]          # "label: what", or the name's first word
            name = head if " " not in head else f.name.split(" ")[0]
            k["names"][name] = k["names"].get(name, 0) + 1
    for k in out.values():
        rec = sorted(k.pop("recover"))
        k["recover_p50"] = rec[len(rec) // 2] if rec else None
        k["recover_max"] = rec[-1] if rec else None
    return out


def summary(results: list[NemesisRound]) -> str:
    lines = [f"{'kind':10}{'rounds':>7}{'faults':>7}{'restarts':>9}{'recover p50':>12}"
             f"{'max':>7}{'lost':>6}{'duplicated':>11}{'stale':>9}{'failed':>7}{'invalid':>8}"]
    total = {"faults": 0, "lost": 0, "duplicated": 0, "stale_reads": 0, "invalid": 0}
    for kind, k in per_kind(results).items():
        p50 = f"{k['recover_p50']:.2f}s" if k["recover_p50"] is not None else "-"
        mx = f"{k['recover_max']:.1f}s" if k["recover_max"] is not None else "-"
        lines.append(f"{kind:10}{k['rounds']:>7}{k['faults']:>7}{k['restarts']:>9}{p50:>12}"
                     f"{mx:>7}{k['lost']:>6}{k['duplicated']:>11}{k['stale_reads']:>9}"
                     f"{k['failed']:>7}{k['invalid']:>8}")
        for t in total:
            total[t] += k[t]
        lines.append("    " + ", ".join(f"{n} {c}" for n, c in sorted(k["names"].items())))
    lines.append("all: " + ", ".join(f"{t} {v}" for t, v in total.items()))
    return "\n".join(lines)
