"""Fault campaigns: run jobs while really killing their member process (SIGKILL, as
``kill -9``) at random moments, then check the output against a failure-free run.

``python -m sparkjet.testing.campaign --kills 1000`` runs a long campaign; the test suite
runs a short one. Each round runs one job with one guarantee and one sink: a rolling keyed
count and sum over the deterministic generator ("keyed"), a stateless copy of every event
("events"), a sliding-window count and sum per key with the event id as event time
("windowed"), the same over the union of two sources ("union"), a source branching into
windowed counts and a filtered copy of the events, each to a sink of its own ("branching"),
the keyed count and sum as keyed state of the user's own ("state": ``map_state``), the
events deduplicated by an id that one event in eight repeats ("dedup"), an interval join of
two filtered branches of the source ("join"), or the events enriched from a reference table
("enrich": ``join_table``, inner, half the keys in the table). It kills its
member several times (mid-batch, mid-alignment, mid-snapshot, between prepare and commit,
during restore: the moments are random, the member is killed wherever it is), lets the
supervisor restart it from the last complete snapshot, and checks the committed output with
:mod:`sparkjet.verify`: exactly-once must lose and duplicate nothing, at-least-once must lose
nothing, and "none" is reported as it is.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet import verify
from sparkjet.cli.args import nonnegative_int, positive_int
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.connectors.generator import GeneratorSource
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.spark_runner import available_slots
from sparkjet.snapshot.layout import job_dir
from sparkjet.snapshot.slots import JOBS, SLOT_PREFIX
from sparkjet.spark import local_session
from sparkjet.testing import nemesis_cli, sinks
from sparkjet.testing.operators import (  # the operators' helpers, shared
    _BETWEEN,
    _COUNT_SUM,
    _TABLE,
    _count_and_sum,
    _enriched,
    _expected_ids,
    _final_windows,
    _pairs,
    _uids,
    _with_uid,
    expected_windows,
)
from sparkjet.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster
from sparkjet.windows import sliding, tumbling


@dataclass
class RoundResult:
    guarantee: str
    sink: str
    pipeline: str
    kills: int
    restarts: int
    seconds: float
    report: verify.Report
    failures: list      # errors of member failures that were not our kills
    duplicate_rows: int = 0   # windowed output: rows of a (key, window) emitted twice

    @property
    def valid(self) -> bool:
        if self.guarantee == "exactly-once" and self.duplicate_rows:
            return False
        return self.report.valid_for(self.guarantee)


def _members(job: Job) -> tuple:
    """The pids of the job's running member processes (Spark: its members' Python workers)."""
    if job.member_pids:
        return tuple(sorted(job.member_pids.values()))
    return (job.member_pid,) if job.member_pid is not None else ()


def _killer(job: Job, kills: int, rng: random.Random, stop: threading.Event, done: list,
            cluster=None, restarts: list | None = None, snapshots: list | None = None,
            started: list | None = None, ready=None) -> None:
    """Kills one member at a random moment of each execution. Without `snapshots`: one
    kill in four up to 1.5 s after the member's process appears (while it starts or
    restores), the others up to 1.2 s after the execution has started (`started`, which
    the caller's progress callback fills: so a member slow to start on a loaded machine
    is still killed while it runs). With `snapshots` (the snapshots of the current
    execution, kept likewise): up to 0.6 s after its first snapshot, and after `ready()`
    returns true if given (polled: an event such as the sink's first commit of the
    execution, which comes after the driver's snapshot event). With a standalone
    `cluster`,
    a third of the kills are of a whole worker JVM (its executor dies with it, so the
    execution really loses a slot), restarted a few seconds later."""
    last = ()
    while len(done) < kills and not stop.is_set():
        pids = _members(job)
        if not pids or pids == last:
            time.sleep(0.02)
            continue
        # A new execution: let it live a random while (restore, first batches, a snapshot
        # or two) and kill one member wherever it is.
        if snapshots is None and (started is None or rng.random() < 0.25):
            time.sleep(rng.uniform(0.05, 1.5))
        elif snapshots is None:
            while not started and _members(job) == pids and not stop.is_set():
                time.sleep(0.01)
            time.sleep(rng.uniform(0.05, 1.2))
        else:
            while ((not snapshots or (ready is not None and not ready()))
                   and _members(job) == pids and not stop.is_set()):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6))
        if _members(job) != pids:
            continue
        if cluster is not None and rng.random() < 1 / 3:
            alive = [i for i, w in enumerate(cluster.worker_pids()) if w is not None]
            if alive:
                i = rng.choice(alive)
                cluster.kill_worker(i)
                done.append(("worker", i))
                last = pids
                t = threading.Thread(target=_restart_worker, args=(cluster, i, rng.uniform(1, 4)),
                                     daemon=True)
                t.start()
                restarts.append(t)
                continue
        pid = rng.choice(pids)
        try:
            os.kill(pid, signal.SIGKILL)
            done.append(pid)
            last = pids
        except ProcessLookupError:
            pass


def _restart_worker(cluster, i: int, after: float) -> None:
    time.sleep(after)
    cluster.restart_worker(i)


def run_round(work: Path, guarantee: str, sink_kind: str, pipeline_kind: str, kills: int,
              rng: random.Random, events: int = 600_000, rate: float = 200_000, *,
              spark=None, members: int | None = 2, cluster=None,
              postgres: str | None = None, kafka: str | None = None,
              kill_after: str = "start", kill_when=None) -> RoundResult:
    """One job with `kills` kills of a member; returns the checker's verdict. With a Spark
    session the job runs on it with `members` members, and a kill hits one member's Python
    worker. Sink kinds "postgres" (transactional) and "postgres-upsert" write to tables named
    after the round in the database of the DSN `postgres` (dropped first). Sink "kafka"
    writes to a new topic at the broker `kafka` (bootstrap servers), staged under `work`, and
    is checked by what a ``read_committed`` consumer reads. Sink "delta" writes Delta tables
    under `work` (needs ``deltalake``), checked by what the table's newest version holds.
    ``kill_after="snapshot"`` kills each execution only after its first snapshot (between
    prepare and commit, mid-batch, mid-snapshot; never during the restore): on a loaded
    machine a member may take longer to start than the default kills wait, and a kill of a
    member still starting restarts nothing of interest to a sink. With it, `kill_when`
    (called with the current execution's number) holds each kill until it returns true,
    e.g. until the sink shows that execution's first commit."""
    work.mkdir(parents=True, exist_ok=True)
    seed = rng.randrange(2**32)
    sources = [GeneratorSource(total=events, partitions=4, keys=5_000, rate=rate, batch_size=5_000,
                               seed=seed)]
    if pipeline_kind == "union":
        sources = [GeneratorSource(total=events // 2, partitions=p, keys=5_000, rate=rate / 2,
                                   batch_size=5_000, seed=seed + i) for i, p in enumerate((4, 3))]
    windowed = pipeline_kind in WINDOWED
    window = tumbling(50_000) if pipeline_kind == "union" else sliding(40_000, 20_000)

    readers = {}

    def sink_at(name: str, key: list):
        made = sinks.make(sink_kind, work, name, key, postgres=postgres, kafka=kafka,
                          remote=f"{work.name}-{name}-{seed:x}")
        readers[name] = made.read
        return made.sink

    key = sinks.output_key(pipeline_kind)
    sink = sink_at("out", key)
    streams = [Pipeline().read_from(s) for s in sources]
    if windowed or pipeline_kind == "join":
        streams = [st.with_timestamps("id") for st in streams]
    elif pipeline_kind == "dedup":
        streams = [st.map_batches(_with_uid).with_timestamps("id", max_lag=10) for st in streams]
    pipeline = streams[0].union(*streams[1:]) if len(streams) > 1 else streams[0]
    ends = []
    if pipeline_kind == "keyed":
        pipeline = pipeline.group_by("key").aggregate(count="count", sum=("sum", "value"))
    elif pipeline_kind == "state":
        pipeline = pipeline.group_by("key").map_state(_count_and_sum, state=_COUNT_SUM)
    elif pipeline_kind == "dedup":
        pipeline = pipeline.deduplicate("uid", within=10_000).map_batches(_uids)
    elif pipeline_kind == "join":
        left, right = pipeline.filter(pc.field("value") < 600), pipeline.filter(pc.field("value") >= 400)
        pipeline = left.join_interval(right, on="key", between=_BETWEEN).map_batches(_pairs)
    elif pipeline_kind == "enrich":
        pipeline = pipeline.join_table(_TABLE, on="key").map_batches(_enriched)
    elif windowed:
        if pipeline_kind == "branching":
            ends.append(pipeline.filter(pc.field("value") < 100).map_batches(_ids)
                        .write_to(sink_at("copy", ["id"])))
        pipeline = (pipeline.group_by("key").window(window)
                    .aggregate(count="count", sum=("sum", "value")))
    else:
        pipeline = pipeline.map_batches(_ids)
    config = JobConfig(name=f"campaign-{work.name}", processing_guarantee=guarantee,
                       snapshot_store=None if guarantee == "none" else str(work / "snapshots"),
                       snapshot_interval=0.2, local_parallelism=1 if spark else 2,
                       max_restarts=kills + 5, restart_backoff=0.0,
                       members=members if spark else None)
    job = Job(Pipeline.all(pipeline.write_to(sink), *ends), config)
    if kill_after not in ("start", "snapshot"):
        raise ValueError(f"kill_after must be 'start' or 'snapshot', got {kill_after!r}")
    stop, killed, restarters = threading.Event(), [], []
    if kill_when is not None and kill_after != "snapshot":
        raise ValueError("kill_when needs kill_after='snapshot'")
    snapshots: list | None = [] if kill_after == "snapshot" else None
    started: list = []
    execution = [0]

    def on_progress(event: dict) -> None:
        if event["event"] == "execution":
            execution[0] = event["execution"]
            started.clear()
            if snapshots is not None:
                snapshots.clear()
        elif event["event"] in ("started", "restored", "progress") and not started:
            # Spark's driver says "started"; a local member's first heartbeat says it runs
            started.append(event.get("execution"))
        elif snapshots is not None and event["event"] == "snapshot":
            snapshots.append(event["snapshot"])

    killer = threading.Thread(target=_killer, daemon=True,
                              args=(job, kills, rng, stop, killed, cluster, restarters,
                                    snapshots, started,
                                    None if kill_when is None else lambda: kill_when(execution[0])))
    start = time.monotonic()
    killer.start()
    try:
        result = job.run(spark, on_progress=on_progress)
    finally:
        stop.set()
        killer.join()
        for t in restarters:  # every worker back before the next round
            t.join()
    seconds = time.monotonic() - start

    out = readers["out"]()
    duplicate_rows = 0
    if pipeline_kind in ("keyed", "state"):
        actual = (verify.last_update_per_key(out)
                  if sink_kind not in sinks.UPSERT
                  else out.select(["key", "count", "sum"]))
        report = verify.check_aggregates(sources[0].expected_counts(), actual, key="key",
                                         columns=["count", "sum"], guarantee=guarantee)
    elif windowed:
        actual, duplicate_rows = _final_windows(out)
        expected = expected_windows(sources, window)
        report = verify.check_aggregates(expected, actual, key=["key", "window_start"],
                                         columns=["count", "sum"], guarantee=guarantee)
        if pipeline_kind == "branching":
            events_ = sources[0].events(0, events)
            wanted = events_.filter(pc.less(events_["value"], 100))["id"]
            copy = readers["copy"]()
            got = copy.column("id") if copy.num_columns else pa.array([], pa.int64())
            copied = verify.check_events(wanted, wanted, got, guarantee=guarantee)
            if not copied.valid_for(guarantee):
                report = copied
    elif pipeline_kind in ("dedup", "join", "enrich"):
        column = {"dedup": "uid", "join": "pair", "enrich": "id"}[pipeline_kind]
        wanted = pa.array(_expected_ids(pipeline_kind, sources[0]))
        got = out.column(column) if out.num_columns else pa.array([], pa.int64())
        report = verify.check_events(wanted, wanted, got, guarantee=guarantee)
    else:
        ids = pa.array(np.arange(events, dtype=np.int64))
        got = out.column("id") if out.num_columns else pa.array([], pa.int64())
        report = verify.check_events(ids, ids, got, guarantee=guarantee)
    errors = [e.get("error") or "" for e in result.executions if e.get("status") != "ok"]
    if spark is None:
        # Count the kills that killed: a member that has just exited stays an unreaped
        # zombie for a moment, and a SIGKILL sent to it "succeeds" without killing anything.
        kills = sum("SIGKILL" in e for e in errors)
        failures = [e for e in errors if "SIGKILL" not in e]
    else:
        # On Spark a kill surfaces as a broken stream, a lost task or a silent member,
        # depending on who notices first; an execution that failed without a kill of its
        # own is what needs explaining.
        kills = min(len(killed), len(errors))
        failures = errors[kills:] if len(errors) > len(killed) else []
    return RoundResult(guarantee, sink_kind, pipeline_kind, kills, result.restarts, seconds,
                       report, failures, duplicate_rows)


WINDOWED = ("windowed", "union", "branching")
def _ids(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.select(["id", "key"])


#: Keyed state, deduplication and joins run into the file sink only: the sinks are the same code
#: whatever feeds them, and every other shape runs into both.
PLAN = [(g, s, p) for g in ("exactly-once", "at-least-once", "none") for s in ("file", "sqlite")
        for p in ("keyed", "events", *WINDOWED,
                  *(("state", "dedup", "join", "enrich") if s == "file" else ()))]
#: The campaigns on Spark leave out "none": it promises nothing to check across restarts.
SPARK_PLAN = [p for p in PLAN if p[0] != "none"]


def run_campaign(work: Path, total_kills: int, seed: int = 0, progress=print, *, spark=None,
                 members: int | None = 2, plan=None, cluster=None) -> list[RoundResult]:
    """Spreads `total_kills` over every (guarantee, sink, pipeline) of `plan` (default
    :data:`PLAN`); on `spark` if given."""
    plan = plan or PLAN
    rng = random.Random(seed)
    per_round = max(1, -(-total_kills // len(plan)))
    results, done, i, idle = [], 0, 0, 0
    while done < total_kills:
        g, s, p = plan[i % len(plan)]
        kills = min(per_round, total_kills - done)
        r = run_round(work / f"round-{i:04d}", g, s, p, kills, rng, spark=spark, members=members,
                      cluster=cluster)
        results.append(r)
        done += r.kills
        i += 1
        progress(f"round {i}: {g:13} {s:6} {p:9} kills {r.kills:3} restarts {r.restarts:3} "
                 f"{r.seconds:5.1f}s  lost {r.report.lost_count} duplicated "
                 f"{r.report.duplicated_count} unexpected {r.report.unexpected_count} "
                 f"repeated windows {r.duplicate_rows}  "
                 f"{'valid' if r.valid else 'INVALID'}"
                 + "".join(f"\n    member failure (not a kill): {f}" for f in r.failures))
        idle = idle + 1 if r.kills == 0 else 0
        if idle == 3:  # jobs too short to kill: don't loop forever (one such round is luck)
            break
    return results


def summary(results: list[RoundResult]) -> str:
    lines = [f"{'guarantee':14}{'sink':8}{'pipeline':10}{'rounds':>7}{'kills':>7}{'lost':>8}"
             f"{'duplicated':>12}{'unexpected':>12}{'repeated':>10}{'valid':>7}{'seconds':>9}"]
    groups: dict = {}
    for r in results:
        groups.setdefault((r.guarantee, r.sink, r.pipeline), []).append(r)
    for (g, s, p), rs in groups.items():
        lines.append(f"{g:14}{s:8}{p:10}{len(rs):>7}{sum(r.kills for r in rs):>7}"
                     f"{sum(r.report.lost_count for r in rs):>8}"
                     f"{sum(r.report.duplicated_count for r in rs):>12}"
                     f"{sum(r.report.unexpected_count for r in rs):>12}"
                     f"{sum(r.duplicate_rows for r in rs):>10}"
                     f"{str(all(r.valid for r in rs)).lower():>7}"
                     f"{sum(r.seconds for r in rs):>9.1f}")
    return "\n".join(lines)


def _scenario_job(work: Path, name: str, total: int, seed: int, **config) -> tuple:
    """A standalone scenario's source and job: a keyed count and sum into files, exactly-once,
    on every slot there is, with room for the scenario's restarts and waits."""
    source = GeneratorSource(total=total, partitions=6, keys=10_000, rate=200_000,
                             batch_size=10_000, seed=seed)
    pipeline = (Pipeline().read_from(source).group_by("key")
                .aggregate(count="count", sum=("sum", "value"))
                .write_to(TransactionalFileSink(work / "out")))
    settings = dict(name=name, snapshot_store=str(work / "snapshots"), snapshot_interval=0.3,
                    local_parallelism=1, members=None, max_restarts=10, restart_backoff=0.5,
                    quorum_timeout=180)
    return source, Job(pipeline, JobConfig(**{**settings, **config}))


def quorum_scenario(work: Path, cluster, spark, progress=print) -> dict:
    """On a standalone `cluster` of 3 one-core workers: a job on 3 members loses a worker
    JVM (restarts on the 2 slots left: rescaling), then a second one (1 slot, below the
    quorum of 2: the coordinator waits and says so) until a worker comes back (restarts on
    2). Returns what happened and the checker's report of the exactly-once output."""
    # 1.2 M events: at most ~0.3 M are behind the last complete snapshot when the second
    # worker dies (3 snapshots of the first execution at 0.3 s, 200,000 events a second,
    # and the second execution's first); the rest is the last execution's, which proves
    # nothing more by being longer. The second kill waits for one snapshot, not three:
    # the generator's events are due by the clock, so after the first kill's recovery the
    # second execution catches up at full speed, and once ran to the end before its third
    # snapshot (CI; the same race as storage_scenario's).
    source, job = _scenario_job(work, "quorum-scenario", 1_200_000, 7)
    steps: list[str] = []
    snapshots: dict[int, int] = {}
    members: dict[int, int] = {}

    def act(name, fn, *args):
        steps.append(name)
        threading.Thread(target=fn, args=args, daemon=True).start()

    def on_progress(event):
        kind = event["event"]
        if kind == "execution":
            members[event["execution"]] = event["members"]
        elif kind == "snapshot":
            e = event["execution"]
            snapshots[e] = snapshots.get(e, 0) + 1
            if members[e] == 3 and snapshots[e] == 3 and "kill worker 0" not in steps:
                act("kill worker 0", cluster.kill_worker, 0)
            elif members[e] == 2 and snapshots[e] == 1 and "kill worker 1" not in steps:
                act("kill worker 1", cluster.kill_worker, 1)
        elif kind == "waiting" and "restart worker 0" not in steps:
            act("restart worker 0", cluster.restart_worker, 0)
        if kind in ("execution", "waiting", "restart"):
            progress(f"  {kind}: "
                     + ", ".join(f"{k}={v}" for k, v in event.items() if k != "event"))

    result = job.run(spark, on_progress=on_progress)
    if "kill worker 1" not in steps:
        raise RuntimeError(f"quorum scenario: the job ended after steps {steps} "
                           f"(executions {members}, snapshots {snapshots}) before the second "
                           "worker's kill; nothing below the quorum was tried")
    cluster.restart_worker(1)
    _wait_for_every_worker(cluster, spark)
    out = verify.last_update_per_key(TransactionalFileSink.read(work / "out"))
    report = verify.check_aggregates(source.expected_counts(), out, key="key",
                                     columns=["count", "sum"], guarantee="exactly-once")
    return {"members": [e["members"] for e in result.executions], "steps": steps,
            "restarts": result.restarts, "report": report}


def _wait_for_every_worker(cluster, spark, timeout: float = 120) -> None:
    """Until every worker of ``cluster`` runs exactly one executor and the driver counts a
    task slot for each: a worker the master lists ALIVE again has not yet got its executor,
    and a killed worker's executor may outlive it a moment. The next scenario then places
    one member on each host."""
    n = len(cluster.worker_pids())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (all(len(cluster.executor_pids(i)) == 1 for i in range(n))
                and available_slots(spark) == n):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the standalone cluster's {n} workers did not each get one executor "
                       f"within {timeout:.0f} s: executors "
                       f"{[cluster.executor_pids(i) for i in range(n)]}")


def storage_scenario(work: Path, cluster, spark, progress=print) -> dict:
    """The members' storage (``storage="members"``, ``backup_count=1``) on a standalone
    ``cluster`` of 3 one-core workers, each a host with its own storage root: a member's
    Python worker killed (its slot is reclaimed on its host: local restore); worker 2's JVM
    killed and its storage root wiped before it comes back (a new slot: its partitions come
    back from their backups on the other hosts); worker 0's JVM killed and restarted (its
    slot reclaimed). Returns the steps, the slots of each execution and the checker's
    report of the exactly-once output."""
    # 1.5 M events: two executions of 3 snapshots each and the third's first before the last
    # fault (see quorum_scenario), the rest for the last execution. The last fault waits
    # for one snapshot, not three: the generator's events are due by the clock, so after the
    # second fault's recovery (a worker restarted on a wiped host) the third execution
    # catches up at full speed, and once ran to the end before its third snapshot (CI).
    source, job = _scenario_job(work, "storage-scenario", 1_500_000, 11, storage="members",
                                backup_count=1)
    steps: list[str] = []
    snapshots: dict[int, int] = {}
    slots: dict[int, list[dict]] = {}

    def act(name, fn):
        steps.append(name)
        threading.Thread(target=fn, daemon=True).start()

    def kill_member():
        os.kill(job.member_pids[1], signal.SIGKILL)

    def lose_host(i):
        def run():
            cluster.kill_worker(i)
            shutil.rmtree(cluster.storage_dir(i), ignore_errors=True)
            cluster.restart_worker(i)
        return run

    def bounce(i):
        def run():
            cluster.kill_worker(i)
            cluster.restart_worker(i)
        return run

    def on_progress(event):
        kind = event["event"]
        if kind == "placed":
            slots[event["execution"]] = event["slots"]
        elif kind == "snapshot":
            e = event["execution"]
            snapshots[e] = snapshots.get(e, 0) + 1
            if snapshots[e] != (3 if len(steps) < 2 else 1):
                return
            if not steps:
                act("kill member 1", kill_member)
            elif len(steps) == 1:
                act("kill worker 2, wipe its storage", lose_host(2))
            elif len(steps) == 2:
                act("kill worker 0", bounce(0))
        if kind in ("placed", "restart"):
            progress(f"  {kind}: " + ", ".join(f"{k}={v}" for k, v in event.items()
                                               if k != "event"))

    result = job.run(spark, on_progress=on_progress)
    out = verify.last_update_per_key(TransactionalFileSink.read(work / "out"))
    report = verify.check_aggregates(source.expected_counts(), out, key="key",
                                     columns=["count", "sum"], guarantee="exactly-once")
    # the job ran to its end: its data must have left every host's slots
    pattern = f"{SLOT_PREFIX}*/{JOBS}/{job_dir(job.config.id)}"
    left = sorted(str(p) for i in range(cluster.workers)
                  for p in cluster.storage_dir(i).glob(pattern))
    return {"steps": steps, "restarts": result.restarts,
            "slots": [[(s["host"], s["uuid"]) for s in slots[e]] for e in sorted(slots)],
            "left": left, "report": report}


def run_standalone(work: Path, total_kills: int, workers: int = 3, seed: int = 0, progress=print,
                   scenario: bool = True) -> tuple[dict | None, list[RoundResult]]:
    """Starts a local standalone cluster (:mod:`sparkjet.testing.standalone`) and runs the quorum
    scenario (if `scenario`) and a campaign of `total_kills` kills (member Python workers and
    whole worker JVMs) on it, with as many members as there are slots."""
    with StandaloneCluster(workers=workers, cores=1, memory="1g") as cluster:  # started
        spark = cluster.session("sparkjet-campaign", **{
            "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
            "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS})
        spark.sparkContext.setLogLevel("OFF")
        try:
            found = None
            if scenario:
                progress("quorum scenario (3 workers; kill 2 worker JVMs; restart one):")
                found = quorum_scenario(work / "scenario", cluster, spark, progress)
                report = found["report"]
                progress(f"  members per execution {found['members']}, steps {found['steps']}, "
                         f"lost {report.lost_count} duplicated {report.duplicated_count}")
                progress("storage scenario (storage='members', backup_count=1; kill a member, "
                         "lose a host's storage, bounce a worker):")
                found["storage"] = storage_scenario(work / "storage", cluster, spark, progress)
                report = found["storage"]["report"]
                progress(f"  steps {found['storage']['steps']}, lost {report.lost_count} "
                         f"duplicated {report.duplicated_count}")
            results = []
            if total_kills:
                results = run_campaign(work / "campaign", total_kills, seed, progress, spark=spark,
                                       members=None, plan=SPARK_PLAN, cluster=cluster)
        finally:
            spark.stop()
    return found, results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparkjet.testing.campaign",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=nonnegative_int, default=1000,
                        help="kills in all (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--master", default=None,
                       help="run the jobs on Spark with this master (e.g. local[2]), 2 members, "
                            "killing member Python workers (default: one member process, no Spark)")
    where.add_argument("--standalone", type=positive_int, metavar="WORKERS", default=None,
                       help="start a local standalone cluster of WORKERS one-core worker JVMs and "
                            "run there (kills: member Python workers and whole worker JVMs), "
                            "after the quorum scenario (needs 3 workers)")
    parser.add_argument("--json", action="store_true",
                        help="also print the results as one JSON line")
    nemesis_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.nemesis:
        return nemesis_cli.main(args)
    scenario = None
    with tempfile.TemporaryDirectory(prefix="sparkjet-campaign-") as tmp:
        work = Path(args.dir or tmp)
        if args.standalone:
            scenario, results = run_standalone(work, args.kills, args.standalone, args.seed,
                                               scenario=args.standalone == 3)
        elif args.master:
            spark = local_session(args.master, "sparkjet-campaign",
                                  **{"spark.ui.showConsoleProgress": "false"})
            spark.sparkContext.setLogLevel("OFF")
            try:
                results = run_campaign(work, args.kills, args.seed, spark=spark, plan=SPARK_PLAN)
            finally:
                spark.stop()
        else:
            results = run_campaign(work, args.kills, args.seed)
    print(summary(results))
    bad = [r for r in results if not r.valid and r.guarantee != "none"]
    if scenario is not None and not scenario["report"].valid:
        bad.append(scenario)
    if scenario is not None and not scenario["storage"]["report"].valid:
        bad.append(scenario["storage"])
    if args.json:
        import json

        print("CAMPAIGN-JSON " + json.dumps({
            "scenario": None if scenario is None else {
                "members": scenario["members"], "steps": scenario["steps"],
                "restarts": scenario["restarts"], "lost": scenario["report"].lost_count,
                "duplicated": scenario["report"].duplicated_count,
                "valid": scenario["report"].valid,
                "storage": {k: v for k, v in scenario["storage"].items() if k != "report"}
                | {"lost": scenario["storage"]["report"].lost_count,
                   "duplicated": scenario["storage"]["report"].duplicated_count,
                   "valid": scenario["storage"]["report"].valid}},
            "rounds": [{"guarantee": r.guarantee, "sink": r.sink, "pipeline": r.pipeline,
                        "kills": r.kills, "restarts": r.restarts, "lost": r.report.lost_count,
                        "duplicated": r.report.duplicated_count,
                        "repeated_windows": r.duplicate_rows,
                        "valid": r.valid, "failures": r.failures} for r in results]}))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
