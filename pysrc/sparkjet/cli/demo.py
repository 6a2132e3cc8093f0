"""``sparkjet demo``: the main job. A keyed count and sum over generated events runs on
local Spark with several members and exactly-once snapshots while member Python workers
are killed with SIGKILL; it shows live progress and ends with a report and the checker's
verdict (:mod:`sparkjet.verify`) against the output a failure-free run gives."""
from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from sparkjet.cli.args import nonnegative_int, positive_float, positive_int
from sparkjet.connectors.base import GUARANTEES
from sparkjet.errors import InvalidArgumentError
from sparkjet.runtime.progress import ProgressLine, bar


def add_parser(commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="run a keyed aggregation on local Spark, crash members, check the output",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Runs a sparkjet job on Spark: RATE generated events per second for DURATION "
            "seconds (id, key uniform over KEYS keys, value, ts), a per-key count and sum "
            "emitting every update into a transactional Parquet sink, with MEMBERS members "
            "(Spark barrier tasks) and snapshots every INTERVAL seconds. CRASHES times, at "
            "evenly spread moments, a random member's Python worker is killed with SIGKILL; "
            "the coordinator on the driver restarts the job from its last snapshot.\n\n"
            "Shows live progress, then a report: events in and out, throughput, latency "
            "percentiles, snapshots and their cost, restarts and recovery times, and the "
            "checker's verdict (exactly-once: lost 0, duplicated 0). Exit code 0 when the "
            "output is valid for the guarantee, 1 when it is not, 2 on an error (such as no "
            "Java 17+)."),
    )
    demo.add_argument("--members", type=positive_int, default=2,
                      help="members (Spark barrier tasks) of each execution (default: 2)")
    demo.add_argument("--master", default=None,
                      help="Spark master URL (default: local[MEMBERS])")
    demo.add_argument("--guarantee", choices=GUARANTEES, default="exactly-once",
                      help="processing guarantee (default: exactly-once)")
    demo.add_argument("--interval", type=positive_float, default=1.0,
                      help="seconds between snapshots (default: 1.0)")
    demo.add_argument("--rate", type=positive_float, default=500_000,
                      help="events per second the generator offers (default: 500,000)")
    demo.add_argument("--duration", type=positive_float, default=30.0,
                      help="seconds of events: the job reads RATE x DURATION events (default: 30)")
    demo.add_argument("--keys", type=positive_int, default=100_000,
                      help="distinct keys (default: 100,000)")
    demo.add_argument("--crashes", type=nonnegative_int, default=3,
                      help="SIGKILLs of member Python workers while it runs (default: 3; "
                           "local masters only)")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the events and of the crash moments")
    demo.add_argument("--dir", default=None,
                      help="work directory for snapshots and output (default: a temporary one, "
                           "deleted at the end)")
    demo.set_defaults(command="demo", run=run)


class _Crasher(threading.Thread):
    """Kills a random member's Python worker at each of the planned moments (seconds after
    the first execution started), waiting for a running execution if there is none."""

    def __init__(self, job, moments: list[float], rng: random.Random):
        super().__init__(name="sparkjet-demo-crasher", daemon=True)
        self.job = job
        self.moments = moments
        self.rng = rng
        self.stop = threading.Event()
        self.started_at: float | None = None
        self.kills: list[dict] = []   # {"at", "pid", "member", "execution"}
        self.execution = None

    def run(self) -> None:
        for moment in self.moments:
            while not self.stop.is_set() and (self.started_at is None
                                              or time.monotonic() - self.started_at < moment):
                time.sleep(0.05)
            while not self.stop.is_set():
                pids = dict(self.job.member_pids)
                if pids and not any(k["execution"] == self.execution for k in self.kills):
                    member, pid = self.rng.choice(sorted(pids.items()))
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        time.sleep(0.05)
                        continue
                    self.kills.append({"at": time.monotonic(), "pid": pid, "member": member,
                                       "execution": self.execution})
                    break
                time.sleep(0.05)


class _Display:
    """Live progress: a bar when stdout is a terminal, else a line every few seconds."""

    def __init__(self, total: int, crasher: _Crasher, out=None):
        self.total = total
        self.crasher = crasher
        self.line = ProgressLine(out, redraw=0.2, every=3.0)
        self.base = 0            # events before the snapshot the execution restored
        self.in_execution = 0
        self.at_snapshot = 0     # events of this execution at its last committed snapshot
        self.snapshot = None
        self.restarts = 0
        self.members = 0
        self.execution = None
        self.rate_window: list[tuple[float, int]] = []
        self.events: list[tuple[float, dict]] = []
        self.lock = threading.Lock()

    def __call__(self, event: dict) -> None:
        now = time.monotonic()
        with self.lock:
            self.events.append((now, event))
            kind = event["event"]
            if kind == "execution":
                self.rate_window.clear()  # the count steps back to the restored snapshot
                self.base += self.at_snapshot
                self.in_execution = self.at_snapshot = 0
                self.execution = event["execution"]
                self.crasher.execution = event["execution"]
                self.members = event["members"]
                restore = event.get("restored_from")
                restoring = "" if restore is None else f", restoring snapshot {restore}"
                self._line(f"execution {event['execution']}: starting {event['members']} members "
                           f"as a Spark barrier stage{restoring}")
            elif kind == "started":
                if self.crasher.started_at is None:
                    self.crasher.started_at = now
                pids = ", ".join(str(p) for _, p in sorted(event["pids"].items()))
                self._line(f"execution {event['execution']}: running after "
                           f"{event['seconds']:.1f} s (member Python workers: pids {pids})")
            elif kind == "restart":
                self.restarts += 1
                self._line(f"restart {self.restarts} after {event['after_s']:.1f} s: "
                           f"{(event.get('error') or '')[:110]}")
            elif kind == "waiting":
                self._line(f"waiting: {event['note']}")
            elif kind == "progress":
                self.in_execution = event["events_in"]
            elif kind == "snapshot":
                self.snapshot = event
                self.at_snapshot = event["events_in"]
            self._show(now)

    def _line(self, text: str) -> None:
        self.line.print(text)

    def _show(self, now: float) -> None:
        done = min(self.total, self.base + self.in_execution)
        self.rate_window.append((now, self.base + self.in_execution))
        while len(self.rate_window) > 2 and now - self.rate_window[0][0] > 3.0:
            self.rate_window.pop(0)
        (t0, e0), (t1, e1) = self.rate_window[0], self.rate_window[-1]
        rate = (e1 - e0) / (t1 - t0) if t1 > t0 else 0.0
        frac = done / self.total if self.total else 1.0
        snap = ""
        if self.snapshot:
            s = self.snapshot
            snap = (f"  snapshot {s['snapshot']} ({s['duration_s'] * 1e3:.0f} ms, "
                    f"{s['bytes'] / 1e6:.1f} MB)")
        text = (f"{bar(frac, 28)} {frac:4.0%}  {done / 1e6:5.1f}M/{self.total / 1e6:.1f}M events  "
                f"{rate / 1e6:5.2f} M/s{snap}  members {self.members}  restarts {self.restarts}  "
                f"crashes {len(self.crasher.kills)}")
        self.line.update(text)

    def finish(self) -> None:
        self.line.close()


def run(args: argparse.Namespace) -> int:
    # The job runtime and Spark load when the demo runs, not for every `sparkjet` command.
    from sparkjet import verify
    from sparkjet.connectors.files.sink import TransactionalFileSink
    from sparkjet.connectors.generator import GeneratorSource
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.runtime.observability import LOG_FORMAT
    from sparkjet.spark import local_session, spark_log_path

    total = int(args.rate * args.duration)
    master = args.master or f"local[{args.members}]"
    if args.crashes and not master.startswith("local"):
        # The crasher kills member Python workers by pid, which only means something on
        # this machine.
        raise InvalidArgumentError(f"--crashes needs a local master (members' pids are on this "
                                   f"machine); give --crashes 0 to run on {master}")
    if args.dir and os.path.exists(args.dir):
        if not os.path.isdir(args.dir):
            raise InvalidArgumentError(f"--dir {args.dir} is not a directory")
        if os.listdir(args.dir):
            raise InvalidArgumentError(f"--dir {args.dir} is not empty (the demo starts from "
                                       "nothing)")
    print(f"sparkjet demo: per-key count and sum over {total:,} events ({args.keys:,} keys, "
          f"{args.rate:,.0f} events/s) on {master}, {args.members} members, {args.guarantee}, "
          f"snapshots every {args.interval:g} s, {args.crashes} crash(es)", flush=True)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sparkjet-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print("starting Spark (about 10 s)...", flush=True)
    spark = local_session(master, "sparkjet-demo", **{"spark.ui.showConsoleProgress": "false"})
    # The display shows restarts and their causes; the job's log records (which Python would
    # print to stderr, having no handler) join the JVM's and the members' in the log file.
    log = logging.FileHandler(spark_log_path())
    log.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger("sparkjet").addHandler(log)
    spark.sparkContext.setLogLevel("OFF")  # killed members make Spark log stack traces
    try:
        source = GeneratorSource(total=total, partitions=max(4, 2 * args.members), keys=args.keys,
                                 rate=args.rate, batch_size=16_384, seed=args.seed)
        pipeline = (Pipeline().read_from(source)
                    .group_by("key").aggregate(count="count", sum=("sum", "value"))
                    .write_to(TransactionalFileSink(work / "out")))
        store = None if args.guarantee == "none" else str(work / "snapshots")
        config = JobConfig(name="sparkjet-demo", processing_guarantee=args.guarantee,
                           snapshot_store=store, snapshot_interval=args.interval,
                           members=args.members, local_parallelism=1,
                           max_restarts=args.crashes + 3, restart_backoff=0.2)
        job = Job(pipeline, config)
        rng = random.Random(args.seed)
        moments = [args.duration * (i + 1) / (args.crashes + 1) * rng.uniform(0.85, 1.15)
                   for i in range(args.crashes)]
        crasher = _Crasher(job, moments, rng)
        display = _Display(total, crasher)
        crasher.start()
        try:
            result = job.run(spark, on_progress=display)
        finally:
            crasher.stop.set()
            display.finish()
        out = TransactionalFileSink.read(work / "out")
        actual = verify.last_update_per_key(out)
        report = verify.check_aggregates(source.expected_counts(), actual, key="key",
                                         columns=["count", "sum"], guarantee=args.guarantee)
        _report(args, total, result, out.num_rows, display, crasher, report,
                time.monotonic() - started)
        return 0 if report.valid_for(args.guarantee) else 1
    finally:
        spark.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def latency_line(summary: dict) -> str:
    """A latency summary (:attr:`JobResult.latency`'s) in milliseconds, on one line.

    >>> latency_line({"p50": 0.0012, "p99": 0.004, "p99.9": 0.0051, "p99.99": 0.02,
    ...               "max": 0.031, "count": 10})
    'p50 1.2 ms, p99 4.0 ms, p99.9 5.1 ms, p99.99 20.0 ms, max 31.0 ms (10 events)'
    """
    parts = [f"{k} {summary[k] * 1e3:.1f} ms" for k in ("p50", "p99", "p99.9", "p99.99", "max")]
    return ", ".join(parts) + f" ({summary['count']:,} events)"


def _report(args, total, result, committed_rows, display, crasher, report, wall) -> None:
    first_start = next((t for t, e in display.events if e["event"] == "started"), None)
    processing = (display.events[-1][0] - first_start) if first_start else result.seconds
    snaps = result.snapshots
    latency = result.latency
    recoveries = []
    for kill in crasher.kills:
        after = [t for t, e in display.events if e["event"] == "snapshot" and t > kill["at"]
                 and e["execution"] != kill["execution"]]
        if after:
            recoveries.append(after[0] - kill["at"])
    rows = [
        ("events in", f"{total:,} (+{max(0, result.events_in - total):,} replayed after restarts)"),
        ("updates out (committed)", f"{committed_rows:,} rows"),
        ("throughput", f"{total / processing / 1e6:.2f} M events/s over {processing:.1f} s of "
                       f"processing ({wall:.1f} s with Spark's start); "
                       f"offered {args.rate / 1e6:.2f} M/s"),
    ]
    for output, name in (("committed", "latency to committed output"),
                         ("emitted", "latency to emitted update")):
        if latency[output]["count"]:
            rows.append((name, latency_line(latency[output])))
    if snaps:
        durations = sorted(s["duration_s"] for s in snaps)
        mean_ms = sum(durations) / len(durations) * 1e3
        mean_mb = sum(s["bytes"] for s in snaps) / len(snaps) / 1e6
        rows.append(("snapshots", f"{len(snaps)} taken, {mean_ms:.0f} ms mean, "
                                  f"{durations[-1] * 1e3:.0f} ms max, {mean_mb:.1f} MB each"))
    else:
        rows.append(("snapshots", "none (guarantee 'none')"))
    kills = ", ".join(f"member {k['member']} (pid {k['pid']})" for k in crasher.kills) or "none"
    rows.append(("crashes (SIGKILL)", f"{len(crasher.kills)}: {kills}"))
    members = "/".join(str(e["members"]) for e in result.executions)
    rows.append(("executions", f"{len(result.executions)} (members {members}), "
                               f"{result.restarts} restart(s)"))
    if recoveries:
        rows.append(("recovery", "kill to first new snapshot: "
                                 + ", ".join(f"{r:.2f} s" for r in recoveries)))
    verdict = "VALID" if report.valid_for(args.guarantee) else "INVALID"
    rows.append(("checker (sparkjet.verify)",
                 f"{args.guarantee}: {report.attempted_count:,} events over {args.keys:,} keys; "
                 f"lost {report.lost_count}, duplicated {report.duplicated_count}, unexpected "
                 f"{report.unexpected_count}, mismatched {len(report.mismatched)} -> {verdict}"))
    from sparkjet.spark import spark_log_path  # loaded with the session, as in run()

    rows.append(("log (job, members, JVM)", spark_log_path()))
    width = max(len(r[0]) for r in rows)
    print("\nreport")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
