"""Partitions of a Spark standalone cluster under a running job: the ``partition`` kind of
the nemesis campaign (:mod:`sparkjet.testing.nemesis_campaign`).

:func:`run` starts a :class:`~sparkjet.testing.netns.Network` of 3 hosts and a
:class:`~sparkjet.testing.standalone.StandaloneCluster` whose worker ``i`` (its executor,
the member in it) runs in host ``i``; the master and the driver (the coordinator) are in the
root namespace, reached through the gateway. An exactly-once keyed count and sum into files
runs on every slot (3 members), and the faults, one at a time and each healed before the
next, cycle through (a round takes them in turn from a random one):

- ``isolate``: one worker cut from everyone (the driver included): its member is declared
  silent, the execution restarts on the other two (a quorum of 3 seen), and the isolated
  member, still running, is a zombie that must never commit;
- ``driver-minority``: the driver and one worker cut from the other two: the driver's side
  is a minority, so no execution may start on it until the partition heals;
- ``split``: one worker from the other two and the driver (the majority side runs on);
- ``bridge``: worker 0 sees workers 1 and 2, which do not see each other (their exchange
  stalls; the driver sees all);
- ``flapping``: a worker isolated and let back every second;
- ``one-way``: the packets from one worker to the others dropped, the other way flowing;
- ``loss``: 30% of one worker's packets dropped (nftables ``numgen``);
- ``bandwidth``: one worker's link capped at 256 kbit/s to 4 Mbit/s (``tc tbf``);
- ``delay``: every connection of one worker (to the other workers, the driver and the
  master, and from them) delayed 50-500 ms each way plus a jitter of up to 300 ms (chunks
  of different connections reorder): each host's links pass a transparent proxy
  (:class:`~sparkjet.testing.nemesis.HostLinks`, set up before the cluster starts), as
  this kernel has no ``netem``;
- ``pause-member``: a member's Python worker SIGSTOPped for 2-6 s (declared silent past
  ``heartbeat_timeout``, 3 s: a zombie when it resumes, which must never commit);
- ``pause-executor``: a worker's executor JVM SIGSTOPped for 2-16 s (its member runs on;
  past Spark's network timeout the executor is given up);
- ``pause-driver``: the driver itself (this process) SIGSTOPped for 2-6 s by a helper
  process: every member loses its coordinator for that long.

Each is held 2-8 s (isolate and split 2-16 s: some shorter than ``heartbeat_timeout``, some
longer than Spark's network timeout, after which Spark gives the executor up and the job
rescales to 2 members while the cut-off one still runs). The output is
checked with :mod:`sparkjet.verify` against the generator, read again a while after the job
ended (a zombie's late commit would show), and reported like the other kinds.
"""
from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path

from sparkjet import verify
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.connectors.generator import GeneratorSource
from sparkjet.errors import JobFailedError, NamespacesUnavailableError, NemesisError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.testing import nemesis, netns
from sparkjet.testing.nemesis_campaign import FaultRecord, NemesisRound, round_json, round_line
from sparkjet.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster

__all__ = ["FAULTS", "Cluster", "run"]

#: The faults in the order they cycle.
FAULTS = ("isolate", "driver-minority", "split", "bridge", "flapping", "one-way", "loss",
          "bandwidth", "pause-member", "pause-executor", "pause-driver", "delay")

#: Spark's own failure detection, shortened so that an executor behind a partition is given
#: up in seconds (its slot freed for a restart), not in Spark's default 120 s.
SPARK_CONF = {
    "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTS,
    "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
    "spark.stage.maxConsecutiveAttempts": "1",
    "spark.network.timeout": "10s",
    "spark.network.timeoutInterval": "2s",
    "spark.executor.heartbeatInterval": "1s",
    "spark.rpc.askTimeout": "10s",
}


def _fault(name: str, net, rng: random.Random, cluster=None, job=None,
           hold: float = 1.0, links: nemesis.HostLinks | None = None) -> nemesis.Nemesis | None:
    """The fault ``name`` of :data:`FAULTS` (None: it has nothing to act on now, such as a
    pause of a member while none runs, or a delay without ``links``)."""
    hosts = net.hosts
    one = rng.randrange(len(hosts))
    others = [h for h in hosts if h.index != one]
    if name == "delay":
        seconds, jitter = rng.uniform(0.05, 0.5), rng.uniform(0.0, 0.3)
        if links is None:
            return None
        n = nemesis.Delay(links.of(hosts[one]), seconds, jitter)
        n.name = f"delay {seconds:.2f}+{jitter:.2f} s on the links of {hosts[one].address}"
        return n
    if name == "bandwidth":
        return nemesis.BandwidthCap(net, hosts[one], rng.choice(["256kbit", "1mbit", "4mbit"]))
    if name == "pause-member":
        pids = sorted((job.member_pids or {}).values()) if job is not None else []
        return nemesis.Pause(pids[one % len(pids)], name=f"pause member {pids[one % len(pids)]}") \
            if pids else None
    if name == "pause-executor":
        pids = cluster.executor_pids(one) if cluster is not None else []
        return nemesis.Pause(pids, name=f"pause executor JVM of worker {one} {pids}") \
            if pids else None
    if name == "pause-driver":
        return nemesis.SelfPause(hold)
    if name == "isolate":
        return nemesis.isolate(net, hosts[one])
    if name == "driver-minority":
        p = nemesis.split(net, [hosts[one]], gateway_with="minority")
        p.name = f"driver-minority with {hosts[one].address}"
        return p
    if name == "split":
        return nemesis.split(net, [hosts[one]])
    if name == "bridge":
        return nemesis.bridge(net, hosts[one], [others[0]], [others[1]])
    if name == "flapping":
        return nemesis.Flapping(nemesis.isolate(net, hosts[one]), period=1.0)
    if name == "one-way":
        return nemesis.Partition(net, [(hosts[one], o) for o in others],
                                 f"one-way {hosts[one].address}->others")
    return nemesis.PacketLoss(net, hosts[one], 30)


class Cluster:
    """The namespaced standalone cluster partition rounds run on: started at the first
    :meth:`round` and kept for the next ones (a campaign interleaves them with its local
    rounds), stopped by :meth:`close`. :attr:`why_not` says why namespaces cannot be made
    here (None where they can)."""

    def __init__(self, rate: float = 40_000):
        self.rate = rate
        self.why_not = netns.available() or nemesis.missing("partition")
        self._stack: contextlib.ExitStack | None = None

    def round(self, work: Path, faults: int, rng: random.Random, progress=print,
              kinds: tuple[str, ...] = FAULTS) -> NemesisRound:
        """One job with ``faults`` partitions, the first ``faults`` of ``kinds`` in turn."""
        if self._stack is None:
            stack = contextlib.ExitStack()
            try:
                self.net = stack.enter_context(netns.Network(hosts=3))
                # before the cluster: only connections opened after it pass the proxies
                self.links = stack.enter_context(nemesis.HostLinks(self.net))
                self.cluster = stack.enter_context(
                    StandaloneCluster(workers=3, cores=1, memory="1g", network=self.net))
                self.spark = self.cluster.session("sparkjet-partitions", **SPARK_CONF)
                stack.callback(self.spark.stop)
                self.spark.sparkContext.setLogLevel("OFF")
            except BaseException:
                stack.close()
                raise
            self._stack = stack
        # the faults in turn from a random one: with more kinds than faults a round, every
        # kind comes up over a campaign's rounds
        first = rng.randrange(len(kinds))
        names = [kinds[(first + j) % len(kinds)] for j in range(faults)]
        return run_round(work, self.net, self.cluster, self.spark, names, rng, self.rate,
                         progress, self.links)

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


def run(work: Path, faults: int, seed: int = 0, progress=print, *, rate: float = 40_000,
        kinds: tuple[str, ...] = FAULTS) -> list[NemesisRound]:
    """Runs ``faults`` partitions (cycling through ``kinds``) under one job per
    ``len(kinds)`` faults on a namespaced standalone cluster; one
    :class:`~sparkjet.testing.nemesis_campaign.NemesisRound` per job. Where namespaces
    cannot be made, says why (``progress``) and returns nothing. (``python -m
    sparkjet.campaign --nemesis partition`` runs them through
    :func:`sparkjet.testing.nemesis_campaign.run`, which interleaves them with the other
    kinds.)"""
    cluster = Cluster(rate)
    if cluster.why_not:
        progress(f"kind partition left out: {cluster.why_not}")
        return []
    rng = random.Random(seed)
    results: list[NemesisRound] = []
    try:
        done, i = 0, 0
        while done < faults:
            r = cluster.round(work / f"partition-{i:04d}", min(len(kinds), faults - done),
                              rng, progress, kinds)
            results.append(r)
            done += max(1, len(r.faults))
            i += 1
            progress(f"round {i}: " + round_line(r))
            progress(round_json(r))
    except NamespacesUnavailableError as e:
        progress(f"kind partition left out: {e}")
    finally:
        cluster.close()
    return results


def run_round(work: Path, net, cluster, spark, names: list[str],
              rng: random.Random, rate: float = 40_000, progress=print,
              links: nemesis.HostLinks | None = None) -> NemesisRound:
    """One job on every slot with the faults ``names`` one after another (``links``: the
    hosts' proxies, for ``delay``)."""
    work.mkdir(parents=True, exist_ok=True)
    heartbeat = 3.0
    seconds = 15 + 14 * len(names)
    source = GeneratorSource(total=int(rate * seconds), partitions=6, keys=5_000, rate=rate,
                             batch_size=5_000, seed=rng.randrange(2**32))
    out = work / "out"
    job = Job(Pipeline().read_from(source).group_by("key")
              .aggregate(count="count", sum=("sum", "value"))
              .write_to(TransactionalFileSink(out)),
              JobConfig(name=f"partitions-{work.name}", snapshot_store=str(work / "snapshots"),
                        snapshot_interval=0.3, local_parallelism=1, members=None,
                        heartbeat_timeout=heartbeat, max_restarts=4 * len(names) + 6,
                        restart_backoff=0.5, quorum_timeout=120, start_timeout=60))
    records: list[FaultRecord] = []
    lock = threading.Lock()
    state = {"snapshots": 0, "members": [], "restarts": 0, "minority_runs": [],
             "minority_snapshots": []}
    started: dict[int, float] = {}
    active: list[nemesis.Nemesis] = []
    stop = threading.Event()

    def on_progress(event: dict) -> None:
        with lock:
            kind = event["event"]
            if kind == "snapshot":
                state["snapshots"] += 1
                now = time.monotonic()
                # the driver reaches one member of three: no snapshot can complete on its
                # side (acknowledgements in flight at the cut get a second's grace)
                if any(n.active and n.name.startswith("driver-minority")
                       and now - started.get(id(n), now) > 1.0 for n in active):
                    state["minority_snapshots"].append(event["snapshot"])
                for r in records:
                    if r.end is not None and r.recovered is None:
                        r.recovered = round(now - r.end, 3)
            elif kind == "execution":
                state["members"].append(event["members"])
                # an execution started below the quorum while the driver is on a
                # partition's minority side (it reaches one worker of three)
                if event["members"] < 2 and any(
                        n.active and n.name.startswith("driver-minority") for n in active):
                    state["minority_runs"].append(event["execution"])
            elif kind == "restart":
                state["restarts"] += 1
        if kind in ("restart", "waiting"):
            progress(f"  {kind}: {event.get('error') or event.get('reason') or ''}"[:200])

    def inject() -> None:
        for name in names:
            # a running execution with a couple of snapshots behind it
            seen = state["snapshots"]
            while not stop.is_set() and state["snapshots"] < seen + 2:
                time.sleep(0.05)
            if stop.is_set():
                return
            # some isolations and executor pauses outlast Spark's own network timeout
            # (10 s): the executor is given up and the job rescales to the 2 workers left
            # while the cut-off member, a zombie, still runs; member and driver pauses
            # straddle heartbeat_timeout (3 s)
            hold = rng.uniform(2.0, 16.0 if name in ("isolate", "split", "pause-executor")
                               else 6.0 if name.startswith("pause") else 8.0)
            n = _fault(name, net, rng, cluster, job, hold, links)
            if n is None:
                progress(f"  {name}: nothing to act on now, skipped")
                continue
            record = FaultRecord("partition", f"{name} ({n.name}, {hold:.1f}s)",
                                 time.monotonic())
            with lock:
                active.append(n)
            try:
                n.start()           # a pause of the driver returns once it runs again
            except NemesisError as e:     # the member or executor exited meanwhile
                progress(f"  {name}: {e}, skipped")
                with lock:
                    active.remove(n)
                continue
            started[id(n)] = time.monotonic()
            progress(f"  {record.name}: injected")
            if name != "pause-driver":
                stop.wait(hold)
            n.heal()
            progress(f"  {name}: healed")
            with lock:
                active.remove(n)
                record.end = time.monotonic()
                records.append(record)

    def proxied() -> int:
        return sum(p.stats["connections"] for p in links.proxies.values()) if links else 0

    connections = proxied()
    injector = threading.Thread(target=inject, daemon=True)
    start = time.monotonic()
    injector.start()
    error = None
    result = None
    try:
        result = job.run(spark, on_progress=on_progress)
    except JobFailedError as e:
        error = str(e)[:600]
    finally:
        stop.set()
        injector.join(60)
        for n in list(active):
            n.heal()
    elapsed = time.monotonic() - start
    first = verify.last_update_per_key(TransactionalFileSink.read(out))
    # a zombie member left on a minority side runs on for a while: its late commit would
    # change the output
    time.sleep(3 * heartbeat)
    final = verify.last_update_per_key(TransactionalFileSink.read(out))
    report = verify.check_aggregates(source.expected_counts(), final, key="key",
                                     columns=["count", "sum"], guarantee="exactly-once")
    notes = [f"members per execution {state['members']}"]
    if links is not None:       # the delay faults act only on what passes the proxies
        notes.append(f"{proxied() - connections} connections through the hosts' proxies")
    violations = []
    if not final.equals(first):
        violations.append("the output changed after the job ended: a zombie committed")
    if state["minority_snapshots"]:
        violations.append(f"snapshots {state['minority_snapshots']} completed while the "
                          "driver was on a minority side")
    if state["minority_runs"]:
        violations.append(f"executions {state['minority_runs']} started below the quorum "
                          "while the driver was on a minority side")
    return NemesisRound("partition", "file", records,
                        result.restarts if result is not None else state["restarts"], elapsed,
                        report, 0, error, notes, violations)
