"""Fault campaigns: run jobs while really killing their member process (SIGKILL, as
``kill -9``) at random moments, then check the output against a failure-free run.

``python -m sparkjet.campaign --kills 1000`` runs a long campaign; the test suite runs a short
one. Each round runs one job (a keyed count and sum over the deterministic generator, or a
stateless copy of every event) with one guarantee and one sink, kills its member several
times (mid-batch, mid-alignment, mid-snapshot, between prepare and commit, during restore: the
moments are random, the member is killed wherever it is), lets the supervisor restart it from
the last complete snapshot, and checks the committed output with :mod:`sparkjet.verify`:
exactly-once must lose and duplicate nothing, at-least-once must lose nothing, and "none"
is reported as it is.
"""
from __future__ import annotations

import argparse
import os
import random
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
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import SQLiteUpsertSink, TransactionalFileSink
from sparkjet.sources import GeneratorSource


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

    @property
    def valid(self) -> bool:
        return self.report.valid_for(self.guarantee)


def _members(job: Job) -> tuple:
    """The pids of the job's running member processes (Spark: its members' Python workers)."""
    if job.member_pids:
        return tuple(sorted(job.member_pids.values()))
    return (job.member_pid,) if job.member_pid is not None else ()


def _killer(job: Job, kills: int, rng: random.Random, stop: threading.Event, done: list) -> None:
    last = ()
    while len(done) < kills and not stop.is_set():
        pids = _members(job)
        if not pids or pids == last:
            time.sleep(0.02)
            continue
        # A new execution: let it live a random while (restore, first batches, a snapshot
        # or two) and kill one member wherever it is.
        time.sleep(rng.uniform(0.05, 1.5))
        if _members(job) != pids:
            continue
        pid = rng.choice(pids)
        try:
            os.kill(pid, signal.SIGKILL)
            done.append(pid)
            last = pids
        except ProcessLookupError:
            pass


def _last_update_per_key(table: pa.Table) -> pa.Table:
    t = table.sort_by([("key", "ascending"), ("count", "descending")])
    keys = t.column("key").to_numpy()
    first = np.concatenate([[True], keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, bool)
    return t.filter(pa.array(first)).select(["key", "count", "sum"])


def run_round(work: Path, guarantee: str, sink_kind: str, pipeline_kind: str, kills: int,
              rng: random.Random, events: int = 600_000, rate: float = 200_000, *,
              spark=None, members: int = 2) -> RoundResult:
    """One job with `kills` kills of a member; returns the checker's verdict. With a Spark
    session the job runs on it with `members` members, and a kill hits one member's Python
    worker."""
    work.mkdir(parents=True, exist_ok=True)
    source = GeneratorSource(total=events, partitions=4, keys=5_000, rate=rate, batch_size=5_000,
                             seed=rng.randrange(2**32))
    if sink_kind == "file":
        sink = TransactionalFileSink(work / "out")
    else:
        key = ["key"] if pipeline_kind == "keyed" else ["id"]
        sink = SQLiteUpsertSink(work / "out.sqlite", "out", key=key)
    pipeline = Pipeline().read_from(source)
    if pipeline_kind == "keyed":
        pipeline = pipeline.group_by("key").aggregate(count="count", sum=("sum", "value"))
    else:
        pipeline = pipeline.map_batches(lambda b: b.select(["id", "key"]))
    config = JobConfig(name=f"campaign-{work.name}", processing_guarantee=guarantee,
                       snapshot_store=None if guarantee == "none" else str(work / "snapshots"),
                       snapshot_interval=0.2, local_parallelism=1 if spark else 2,
                       max_restarts=kills + 5, restart_backoff=0.0,
                       members=members if spark else None)
    job = Job(pipeline.write_to(sink), config)
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_killer, args=(job, kills, rng, stop, killed), daemon=True)
    start = time.monotonic()
    killer.start()
    try:
        result = job.run(spark)
    finally:
        stop.set()
        killer.join()
    seconds = time.monotonic() - start
    out = (TransactionalFileSink.read(work / "out") if sink_kind == "file"
           else SQLiteUpsertSink.read(work / "out.sqlite", "out"))
    if pipeline_kind == "keyed":
        actual = _last_update_per_key(out) if sink_kind == "file" else out.select(["key", "count", "sum"])
        report = verify.check_aggregates(source.expected_counts(), actual, key="key",
                                         columns=["count", "sum"], guarantee=guarantee)
    else:
        ids = pa.array(np.arange(events, dtype=np.int64))
        report = verify.check_events(ids, ids, out.column("id") if out.num_columns else pa.array([], pa.int64()),
                                     guarantee=guarantee)
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
                       report, failures)


PLAN = [(g, s, p) for g in ("exactly-once", "at-least-once", "none") for s in ("file", "sqlite")
        for p in ("keyed", "events")]


def run_campaign(work: Path, total_kills: int, seed: int = 0, progress=print, *, spark=None,
                 members: int = 2, plan=None) -> list[RoundResult]:
    """Spreads `total_kills` over every (guarantee, sink, pipeline) of `plan` (default
    :data:`PLAN`); on `spark` if given."""
    plan = plan or PLAN
    rng = random.Random(seed)
    per_round = max(1, -(-total_kills // len(plan)))
    results, done, i = [], 0, 0
    while done < total_kills:
        g, s, p = plan[i % len(plan)]
        kills = min(per_round, total_kills - done)
        r = run_round(work / f"round-{i:04d}", g, s, p, kills, rng, spark=spark, members=members)
        results.append(r)
        done += r.kills
        i += 1
        progress(f"round {i}: {g:13} {s:6} {p:6} kills {r.kills:3} restarts {r.restarts:3} "
                 f"{r.seconds:5.1f}s  lost {r.report.lost_count} duplicated "
                 f"{r.report.duplicated_count} unexpected {r.report.unexpected_count}  "
                 f"{'valid' if r.valid else 'INVALID'}"
                 + "".join(f"\n    member failure (not a kill): {f}" for f in r.failures))
        if r.kills == 0:  # a job too short to kill: don't loop forever
            break
    return results


def summary(results: list[RoundResult]) -> str:
    lines = [f"{'guarantee':14}{'sink':8}{'pipeline':10}{'rounds':>7}{'kills':>7}{'lost':>8}"
             f"{'duplicated':>12}{'unexpected':>12}{'valid':>7}"]
    groups: dict = {}
    for r in results:
        groups.setdefault((r.guarantee, r.sink, r.pipeline), []).append(r)
    for (g, s, p), rs in groups.items():
        lines.append(f"{g:14}{s:8}{p:10}{len(rs):>7}{sum(r.kills for r in rs):>7}"
                     f"{sum(r.report.lost_count for r in rs):>8}"
                     f"{sum(r.report.duplicated_count for r in rs):>12}"
                     f"{sum(r.report.unexpected_count for r in rs):>12}"
                     f"{str(all(r.valid for r in rs)).lower():>7}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparkjet.campaign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=1000, help="kills in all (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sparkjet-campaign-") as tmp:
        results = run_campaign(Path(args.dir or tmp), args.kills, args.seed)
    print(summary(results))
    bad = [r for r in results if not r.valid and r.guarantee != "none"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
