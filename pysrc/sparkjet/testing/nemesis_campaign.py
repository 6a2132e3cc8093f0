"""Nemesis campaigns: jobs run while every kind of nemesis of :mod:`sparkjet.testing.nemesis`
acts on them, checked by :mod:`sparkjet.verify` against what the sink holds afterwards, with
a report per kind.

``python -m sparkjet.campaign --nemesis all --faults 200`` runs one; the test suite runs a
few faults (``tests/testing/test_nemesis_campaign.py``). Each round runs one stateful
operator (:mod:`sparkjet.testing.operators`; one member process, restarted by the local
supervisor) from a deterministic generator into one sink under one guarantee, and injects
faults of one kind at random moments, each held a random while and then healed. A kind's
rounds take its sinks (:data:`SINKS`, of :mod:`sparkjet.testing.sinks`), the operators the
sink can hold and the guarantees (:data:`GUARANTEES`: two exactly-once rounds, then one
at-least-once) in turn:

=============  =================================================================  ===========
kind           fault                                                              sinks
=============  =================================================================  ===========
``kill``       the member killed (SIGKILL)                                        SQLite,
                                                                                  Delta,
                                                                                  Kafka, file
``pause``      the member stopped (SIGSTOP) and resumed                           the same
``clock``      the member's wall clock skewed or jumped by up to an hour, forward  file, Delta,
               or back (libfaketime, while it runs)                               Kafka
``disk``       the file system of the snapshot store and the sink's files (a      file, Delta
               small tmpfs) full, the store read-only, or the store's folder
               removed and put back
``server``     a server stopped hard and restarted, or paused (SIGSTOP); rounds   see below
               take the servers in turn (:data:`SERVERS`)
``network``    the link to PostgreSQL through a :class:`~.proxy.Proxy`: delayed   PostgreSQL
               (with jitter: connections reorder), lossy, stalled (a partition    2PC and
               with the connections open), or every connection reset              upsert
=============  =================================================================  ===========

The ``server`` kind's servers (the tests' launchers, ``helpers.*``; a server that cannot be
started here is left out with the reason):

- PostgreSQL under the 2PC and the upsert sink: its fast or immediate shutdown (prepared
  transactions are left behind; none may stay after the job), or paused;
- the Kafka broker (noida-db) under a Kafka source, into files: SIGTERM, SIGKILL or paused,
  and the member killed while it is down (see :func:`_server_fault`); its input is fed and
  saved by the broker before the job starts; into files or Delta. Not a Kafka sink: noida-db
  loses transactions across its own restart, so its exactly-once output could not be
  checked after one;
- the S3 server (moto) under the transactional file sink on S3: stopped and restarted;
- Redis (its data in an append-only file, fsynced) under a Redis stream source, into
  files, Delta or Kafka: SIGTERM, SIGKILL or paused.

In every round the input is the deterministic generator's, and the check is against it.

and, with network namespaces available (root, ``ip``, ``nft``), the ``partition`` kind:
:meth:`sparkjet.testing.partition_campaign.Cluster.round` on a standalone Spark cluster
whose workers are network namespaces, one such round interleaved after every few local
rounds (:func:`kind_of`) so that a run stopped early has had its share of partitions.

Each round's random draws depend only on the seed and the round's index
(:func:`round_rng`), so a run logged with ``log=`` and stopped can be resumed
(``resume=True``; ``--log FILE --resume`` on the command line) and draws the rounds an
unbroken run would.

Per kind the report gives: faults injected, restarts of the job, time to recover (from a
fault's heal, or a kill, to the next complete snapshot), lost and duplicated outputs
(:func:`sparkjet.verify` on the sink's final contents; duplicates of at-least-once rounds
apart, as they are allowed), the rounds per sink and guarantee, and stale reads:
a reader polls the sink's committed contents while the job runs, and a key whose count
goes down between two reads (committed output that went back) is a stale read.
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa

from sparkjet import verify
from sparkjet._version import __version__
from sparkjet.connectors.generator import GeneratorSource
from sparkjet.errors import JobFailedError, NemesisError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.testing import nemesis, operators, sinks
from sparkjet.testing.proxy import Proxy

__all__ = ["KINDS", "FaultRecord", "NemesisRound", "run", "summary"]

#: Every kind of a local round, in the order ``all`` cycles through them.
KINDS = ("kill", "pause", "clock", "disk", "server", "network")
#: The sinks each kind's rounds write to, taken in turn (``server``: see
#: :data:`SERVER_SINKS`; the kinds of :mod:`sparkjet.testing.sinks`, and ``s3``: the
#: transactional file sink on the S3 server). A Kafka sink needs the broker: without it the
#: rounds leave it out. The ``network`` kind's faults are on the link to PostgreSQL.
SINKS = {"kill": ("sqlite", "delta", "kafka", "file"),
         "pause": ("sqlite", "kafka", "delta", "file"),
         "clock": ("file", "delta", "kafka"),
         "disk": ("file", "delta"),
         "server": ("postgres", "postgres-upsert"),
         "network": ("postgres", "postgres-upsert")}
#: The servers the ``server`` kind stops under a running job, in the order its rounds take
#: them: PostgreSQL (the 2PC and upsert sinks), the Kafka broker (a Kafka source), the S3
#: server (the transactional file sink on S3) and Redis (a Redis stream source).
SERVERS = ("postgres", "kafka", "s3", "redis")
#: The sinks of a ``server`` round on each server, in turn. A Kafka *sink* is not used in a
#: round that restarts the broker: noida-db (the tests' broker) does not keep its
#: transactions across its own restart
#: (``tests/runtime/test_outages.py::test_noida_db_keeps_transactions_across_a_restart``),
#: so its exactly-once output could not be checked after one; a Kafka source can be, and a
#: Kafka sink is in the other kinds' rounds.
SERVER_SINKS = {"postgres": ("postgres", "postgres-upsert"), "kafka": ("file", "delta"),
                "s3": ("s3",), "redis": ("file", "delta", "kafka")}
#: The processing guarantees rounds take in turn: two exactly-once rounds, then one
#: at-least-once (nothing lost; duplicates allowed and counted apart).
GUARANTEES = ("exactly-once", "exactly-once", "at-least-once")
#: The faults of each server (all with the server's data kept: a halt is SIGTERM or the
#: server's own fast shutdown, a kill SIGKILL, a pause SIGSTOP for the hold).
SERVER_FAULTS = {"postgres": ("halt", "halt-immediate", "pause"),
                 "kafka": ("halt", "kill", "pause"), "s3": ("halt",),
                 "redis": ("halt", "kill", "pause")}


def operators_for(sink: str) -> tuple[str, ...]:
    """The stateful operators a round into ``sink`` may run, in the order rounds take them:
    an upsert sink (one row per key) holds only those whose output is a row per key."""
    return operators.KEYED if sink in sinks.UPSERT else operators.OPERATORS


def sinks_for(kind: str, server: str | None, servers: Servers | None = None) -> tuple[str, ...]:
    """The sinks rounds of ``kind`` (on ``server``) take in turn, those ``servers`` can hold
    (a Kafka sink needs the broker)."""
    every = SERVER_SINKS[server] if server else SINKS[kind]
    if servers is None or not ({"kafka"} & (servers.why_not_sink.keys()
                                            | servers.why_not_server.keys())):
        return every
    return tuple(s for s in every if s != "kafka") or every


#: Events per second fed to a Kafka or Redis source before the job (the job is slowed to
#: this rate, so that it runs while the faults come).
FEED_RATE = 10_000


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
    server: str | None = None       # the server of a ``server`` round (:data:`SERVERS`)
    operator: str = "keyed"         # the stateful operator the job ran
    repeated: int = 0               # committed rows repeating an update or a window
    guarantee: str = "exactly-once"

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
        """Outputs committed twice: the checker's duplicates, and rows that repeat an update
        (a key's count) or a window already committed. At-least-once allows them."""
        return (self.report.duplicated_count + self.repeated if self.report is not None
                else 0)

    @property
    def valid(self) -> bool:
        """The round's guarantee kept (nothing lost; under exactly-once nothing duplicated),
        no stale read from a transactional sink, or the job ended with a clear error and,
        under exactly-once, what it committed has no duplicate. An upsert sink (SQLite,
        PostgreSQL's upsert mode) may be read stale: it writes at prepare, before the
        snapshot completes, and a restart replays from the snapshot before, so a reader can
        see a value go back until the replay catches up."""
        if self.report is None or self.violations:
            return False
        exactly = self.guarantee == "exactly-once"
        stale_ok = self.sink in sinks.UPSERT or self.stale_reads == 0
        if self.error is not None:
            return (self.duplicated == 0 or not exactly) and stale_ok
        return self.report.valid and (self.repeated == 0 or not exactly) and stale_ok


class Servers:
    """The servers a campaign's rounds need, started once with the tests' launchers
    (``helpers.*``, importable when the repository's ``tests/`` folder is on the path):
    PostgreSQL behind a :class:`Proxy`, and for the ``server`` kind the Kafka broker
    (noida-db), the S3 server (moto) and Redis. A kind (or a server of the ``server`` kind)
    whose server cannot be started is left out with the reason (:attr:`why_not`,
    :attr:`why_not_server`)."""

    def __init__(self):
        self.postgres = None
        self.proxy: Proxy | None = None
        self.kafka = None
        self.redis = None
        self.s3 = None                  # an _S3 (the moto server, its endpoint, a filesystem)
        self.why_not: dict[str, str] = {}
        self.why_not_server: dict[str, str] = {}
        self.why_not_sink: dict[str, str] = {}
        self._directory: str | None = None

    @property
    def servers(self) -> list[str]:
        """The servers of the ``server`` kind that run here, in :data:`SERVERS` order."""
        return [s for s in SERVERS if s not in self.why_not_server]

    def start(self, kinds) -> Servers:
        import tempfile

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
        if "server" in kinds:
            self.why_not.pop("server", None)
            if self.postgres is None:
                self.why_not_server["postgres"] = self.why_not.get("network", "not started")
            self._directory = tempfile.mkdtemp(prefix="sparkjet-nemesis-servers-")
            for name, launch in (("kafka", self._start_kafka), ("s3", self._start_s3),
                                 ("redis", self._start_redis)):
                try:
                    launch()
                except ImportError as e:
                    self.why_not_server[name] = (
                        f"needs {e.name}: put the repository's tests/ folder on PYTHONPATH "
                        "and install the test extras (pip install '.[test]')")
                except Exception as e:  # noqa: BLE001 (reported: the server cannot start here)
                    self.why_not_server[name] = f"{type(e).__name__}: {str(e)[:300]}"
            if not self.servers:
                self.why_not["server"] = "no server could be started: " + "; ".join(
                    f"{k}: {v}" for k, v in self.why_not_server.items())
        if self.kafka is None and "kafka" not in self.why_not_server and any(
                "kafka" in SINKS.get(k, ()) for k in kinds):
            # the Kafka sink of the other kinds' rounds: without the broker they leave it out
            if self._directory is None:
                self._directory = tempfile.mkdtemp(prefix="sparkjet-nemesis-servers-")
            try:
                self._start_kafka()
            except Exception as e:  # noqa: BLE001 (reported: rounds leave the Kafka sink out)
                self.why_not_sink["kafka"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "clock" in kinds and nemesis.missing("clock"):
            self.why_not["clock"] = nemesis.missing("clock")
        if "disk" in kinds and nemesis.missing("disk"):
            self.why_not["disk"] = nemesis.missing("disk")
        return self

    def _start_kafka(self) -> None:
        import confluent_kafka  # noqa: F401 (the broker's client: ImportError if missing)
        from helpers import kafka_broker

        folder = Path(self._directory) / "kafka"
        folder.mkdir()
        self.kafka = kafka_broker.start(folder)

    def _start_s3(self) -> None:
        import logging

        import moto.server  # noqa: F401 (ImportError if missing)
        from helpers import s3_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)   # not a line per request
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
        self.s3 = _S3(s3_server)

    def _start_redis(self) -> None:
        import redis  # noqa: F401 (the client: ImportError if missing)
        from helpers import redis_server

        folder = Path(self._directory) / "redis"
        folder.mkdir()
        self.redis = redis_server.start(folder, persist=True)

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
        for server in (self.kafka, self.redis, self.s3):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


class _S3:
    """The S3 server (``helpers.s3_server``: moto, in this process) as an outage sees it:
    :meth:`halt` stops it answering, :meth:`restart` brings it back on the same endpoint
    with the same objects."""

    def __init__(self, helper):
        self.helper = helper
        self.server, self.endpoint = helper.start()
        # no retries, short timeouts: the job sees the outage (see the helper)
        self.filesystem = helper.s3_filesystem(self.endpoint)
        self.bucket = helper.BUCKET

    def halt(self) -> None:
        self.helper.halt(self.server)

    def restart(self) -> None:
        self.server = self.helper.restart(self.endpoint)

    def stop(self) -> None:
        self.server.stop()


def _throttle(rate: float, batch):
    """Slows a job reading from a server to ``rate`` rows a second (its input is there
    before it starts: without this it would end before the faults come)."""
    time.sleep(batch.num_rows / rate)
    return batch


def _feed_kafka(servers: Servers, topic: str, events) -> None:
    """``events`` (id, key, value) into a new ``topic`` of 4 partitions as JSON, event ``i``
    to partition ``i % 4`` (ids rise in every partition), once the broker saved them: its
    restart under the job then loses nothing of the input."""
    import json

    from confluent_kafka import Producer
    from helpers import kafka_broker

    kafka_broker.create_topic(servers.kafka.bootstrap, topic, 4)
    producer = Producer({"bootstrap.servers": servers.kafka.bootstrap,
                         "queue.buffering.max.messages": 2_000_000, "linger.ms": 20})
    for row in events.to_pylist():
        producer.produce(topic, json.dumps(row).encode(), partition=row["id"] % 4)
        producer.poll(0)
    if producer.flush(60) != 0:
        raise NemesisError(f"feeding Kafka topic {topic}: records not delivered in 60 s")
    n = events.num_rows
    kafka_broker.saved_copy(servers.kafka, topic, {p: len(range(p, n, 4)) for p in range(4)},
                            timeout=60)


def _feed_redis(servers: Servers, stream: str, events) -> None:
    """``events`` (id, key, value) onto the 4 partitions of a Redis stream (event ``i`` to
    partition ``i % 4``), then the end markers."""
    from sparkjet.sources import RedisStreamProducer  # loads pandas: Redis rounds only

    producer = RedisStreamProducer(stream, 4, servers.redis.url)
    try:
        ids = events.column("id").to_numpy()
        for p in range(4):
            producer.add_many(p, events.filter(pa.array(ids % 4 == p)))
        producer.end()
    finally:
        producer.close()


def run_round(work: Path, kind: str, faults: int, rng: random.Random, servers: Servers,
              *, rate: float = 100_000, server: str | None = None,
              operator: str = "keyed", sink: str | None = None,
              guarantee: str = "exactly-once") -> NemesisRound:
    """One job with ``faults`` faults of ``kind`` (see the module doc) running ``operator``
    (:data:`sparkjet.testing.operators.OPERATORS`; one :func:`operators_for` the sink); a
    ``server`` round on ``server`` (one of :data:`SERVERS`, PostgreSQL by default)."""
    work.mkdir(parents=True, exist_ok=True)
    if kind == "server":
        server = server or "postgres"
    else:
        server = None
    sink_kind = sink or sinks_for(kind, server)[0]
    if sink_kind not in sinks_for(kind, server):
        raise ValueError(f"a {kind} round{f' on {server}' if server else ''} writes to one of "
                         f"{sinks_for(kind, server)}, not {sink_kind!r}")
    if operator not in operators_for(sink_kind):
        raise ValueError(f"operator {operator!r} cannot write to the {sink_kind} sink: one of "
                         f"{operators_for(sink_kind)}")
    seed = rng.randrange(2**32)
    # long enough for the faults (each held up to ~2 s; a Redis or S3 outage up to 5 s, a
    # Kafka one until the restarted member met it) with some calm between them
    seconds = 3.0 + (6.0 if server in ("kafka", "redis", "s3") else 2.5) * faults
    if kind == "clock":
        rate /= 4       # libfaketime slows every clock call of the member several times
    fed = server in ("kafka", "redis")
    if fed:
        rate = FEED_RATE
    # the generator is the input (and the checker's reference); a Kafka or Redis round
    # feeds its events to the server, and the job reads them from there
    source = GeneratorSource(total=int(rate * seconds), partitions=4, keys=5_000, rate=rate,
                             batch_size=5_000, seed=seed)
    name = f"nemesis_{work.name}_{seed:x}".replace("-", "_")
    if server == "kafka":
        _feed_kafka(servers, name, source.events(0, source.total).select(["id", "key", "value"]))
        from sparkjet.sources import KafkaSource  # loads pandas: only for these rounds

        job_source = KafkaSource(name, servers.kafka.bootstrap, value="json", bounded=True,
                                 timeout=2.0, schema=pa.schema([("id", pa.int64()),
                                                                ("key", pa.int64()),
                                                                ("value", pa.float64())]))
    elif server == "redis":
        _feed_redis(servers, name, source.events(0, source.total).select(["id", "key", "value"]))
        from sparkjet.sources import RedisStreamSource  # loads pandas: these rounds only

        job_source = RedisStreamSource(name, 4, servers.redis.url, schema=pa.schema(
            [("id", pa.int64()), ("key", pa.int64()), ("value", pa.float64()),
             ("_id", pa.string())]))
    else:
        job_source = source
    disk = work / "disk"
    store = disk / "snapshots"      # a folder of the file system, so it can be moved away
    # a disk round's sink writes its files (staged output, Delta's log) on the same small
    # file system as the snapshot store: a full disk meets both
    folder = disk if kind == "disk" else work
    mount = contextlib.nullcontext(disk)
    if kind == "disk":
        mount = nemesis.tmpfs(disk, "48m")
    with mount:
        store.mkdir(parents=True, exist_ok=True)
        if sink_kind == "s3":
            made = sinks.make("file", servers.s3.bucket, name, [],
                              filesystem=servers.s3.filesystem)
        else:
            made = sinks.make(sink_kind, folder, name, sinks.output_key(operator),
                              postgres=servers.dsn(kind == "network") if servers.postgres
                              else None,
                              postgres_read=servers.dsn(False) if servers.postgres else None,
                              kafka=servers.kafka.bootstrap if servers.kafka else None)
        sink, read = made.sink, made.read
        config = JobConfig(name=f"nemesis-{work.name}", processing_guarantee=guarantee,
                           snapshot_store=str(store), snapshot_interval=0.2,
                           max_restarts=faults * 3 + 10, restart_backoff=0.05)
        stream = Pipeline().read_from(job_source)
        if fed:
            stream = stream.map_batches(functools.partial(_throttle, rate))
        job = Job(operators.build(stream, operator).write_to(sink), config)

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
        reader = threading.Thread(target=_stale_reader,
                                  args=(read, stop, stale, operator in operators.KEYED),
                                  daemon=True)
        injector = threading.Thread(
            target=_inject, daemon=True,
            args=(kind, faults, rng, job, servers, store, skew, records, lock, stop, active,
                  events, server))
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
            if skew is not None:       # the members SIGKILLed under the skew left theirs
                nemesis.release_clock_segments()
        elapsed = time.monotonic() - start
        try:
            out = read()
        except Exception as e:  # noqa: BLE001 (reported: the sink cannot be read back)
            return NemesisRound(kind, sink_kind, records, events["restarts"], elapsed, None,
                                stale[0], error or f"the sink could not be read: {e}",
                                server=server, operator=operator, guarantee=guarantee)
    report, repeated = operators.check(operator, source, out, guarantee=guarantee)
    notes = []
    if repeated:
        notes.append(f"{repeated} rows repeated an update or a window already committed")
    if server == "postgres":
        notes += _prepared_left(servers)
    return NemesisRound(kind, sink_kind, records,
                        result.restarts if result is not None else events["restarts"], elapsed,
                        report, stale[0], error, notes, server=server, operator=operator,
                        repeated=repeated, guarantee=guarantee)


def _stale_reader(read, stop: threading.Event, stale: list, keyed: bool) -> None:
    """Reads the sink's committed contents every 0.3 s: a key whose count went down since
    the last read (``keyed``: one row per key, updated), or fewer committed rows than the
    last read (the others: rows are only added), is a stale read."""
    seen: dict = {}
    rows = 0
    while not stop.wait(0.3):
        try:
            t = read()
        except Exception:  # noqa: BLE001, S112 (a sink down under a fault: read it next time)
            continue
        if t.num_rows == 0:
            continue
        if not keyed:
            stale[0] += t.num_rows < rows
            rows = max(rows, t.num_rows)
            continue
        t = verify.last_update_per_key(t)
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


def _inject(kind, faults, rng, job, servers, store, skew, records, lock, stop, active, events,
            server):
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
        # a Redis client retries a short outage itself: longer ones reach the job
        hold = rng.uniform(0.2, 5.0 if server in ("redis", "s3") else 2.0)
        # a fatal disk fault only ends a round that had other faults before it
        n = _nemesis(kind, rng, pid, servers, store, skew, hold, 0 < done == faults - 1,
                     server, job)
        if n is None:
            continue
        label = _LABELS.get(type(n).__name__, "kill")
        if kind == "server":
            label = n.label                             # "postgres-halt", "kafka-kill", ...
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


def _nemesis(kind, rng, pid, servers, store, skew, hold, last, server=None, job=None):
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
        server = server or "postgres"
        return _server_fault(server, rng.choice(SERVER_FAULTS[server]), servers, pid, job)
    proxy = servers.proxy
    which = rng.choice(["delay", "loss", "stall", "reset"])
    if which == "delay":
        return nemesis.Delay(proxy, rng.uniform(0.01, 0.2), rng.uniform(0, 0.2))
    if which == "loss":
        return nemesis.Lossy(proxy, rng.uniform(0.05, 0.4))
    if which == "stall":
        return nemesis.Stall(proxy)
    return nemesis.ResetLinks(proxy)


def _server_fault(server: str, which: str, servers: Servers, member: int,
                  job=None) -> nemesis.Nemesis:
    """The fault ``which`` (of :data:`SERVER_FAULTS`) of ``server``, its ``label`` set
    ("kafka-kill") for the per-kind report.

    The Kafka broker's faults come with the member killed while the broker is down: a
    running Kafka source has nothing to ask the broker for (noida-db answers a fetch with
    the whole partition, so the reader holds its input after the first fetch, and the
    group offsets it commits are asynchronous and for monitoring only), so a broker outage
    alone would go unseen. The restarted execution must reconnect to the broker while it
    is down (its restore reads the watermarks, its reader fetches again from the snapshot's
    offsets) and wait it out: the fault holds until the next member has run a while."""
    target = {"postgres": servers.postgres, "kafka": servers.kafka, "redis": servers.redis,
              "s3": servers.s3}[server]
    title = {"postgres": "PostgreSQL", "kafka": "Kafka broker", "redis": "Redis",
             "s3": "S3 server"}[server]
    if which == "pause":
        n = nemesis.Pause(target.process.pid, name=f"pause {title}")
    else:
        n = nemesis.ServerOutage(_Halt(target, which), name=f"{title} {which}")
    n.label = f"{server}-{which}"
    if server == "kafka":
        n = _AndKill(n, member, lambda: job.member_pid if job is not None else None)
    return n


class _AndKill(nemesis.Nemesis):
    """``inner`` injected, then the member SIGKILLed; healing waits until the next member
    (``current()``: its pid) has run for longer than the Kafka source's timeout (2 s), so
    that it meets the fault, then heals ``inner``."""

    def __init__(self, inner: nemesis.Nemesis, member: int, current):
        super().__init__()
        self.inner, self.member, self.current = inner, member, current
        self.name = f"{inner.name}, member {member} killed"
        self.label = inner.label

    def _inject(self) -> None:
        self.inner.start()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.member, signal.SIGKILL)

    def _undo(self) -> None:
        deadline = time.monotonic() + 30
        while self.current() in (None, self.member) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.5)
        self.inner.heal()


class _Halt:
    """A server's halt in one way, for :class:`nemesis.ServerOutage`: ``halt`` (the
    server's own: PostgreSQL's fast shutdown, SIGTERM, moto's listener closed),
    ``halt-immediate`` (PostgreSQL's immediate shutdown, crash recovery at restart), or
    ``kill`` (SIGKILL). The data stays; ``restart`` brings it back on the same port."""

    def __init__(self, server, how: str):
        self.server, self.how = server, how

    def halt(self) -> None:
        if self.how == "kill":
            self.server.process.kill()
            self.server.process.wait()
        elif self.how == "halt-immediate":
            self.server.halt("immediate")
        else:
            self.server.halt()

    def restart(self) -> None:
        self.server.restart()


#: The faults of a partition round (that many of ``partition_campaign.FAULTS`` in turn).
PARTITION_ROUND = 7


def kind_of(index: int, kinds, faults_per_round: int) -> str:
    """The kind of round ``index`` of a campaign over ``kinds``: the local kinds in turn,
    and with ``partition`` among them one partition round (:data:`PARTITION_ROUND` faults)
    after every ``m`` rounds of each local kind, ``m`` such that each kind gets about the
    same share of the faults (``m = 2`` at 4 faults a round). So a run stopped early has
    had its partitions too."""
    local = [k for k in kinds if k != "partition"]
    if not local:
        return "partition"
    if "partition" not in kinds:
        return local[index % len(local)]
    m = max(1, round(PARTITION_ROUND / faults_per_round))
    at = index % (m * len(local) + 1)
    return "partition" if at == m * len(local) else local[at % len(local)]


def round_rng(seed: int, index: int) -> random.Random:
    """Round ``index``'s random draws: the same whatever ran before it, so that a resumed
    run (``--resume``) draws what an unbroken one would."""
    return random.Random(f"sparkjet-nemesis/{seed}/{index}")


def build_info() -> dict:
    """The package version and, from a checkout, the git commit (``+dirty`` with changes):
    what a log's rounds ran."""
    import subprocess

    commit = None
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        if commit and subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                     cwd=here, capture_output=True, text=True,
                                     timeout=10).stdout.strip():
            commit += "+dirty"
    except (OSError, subprocess.SubprocessError):
        pass
    return {"version": __version__, "commit": commit}


def read_log(path) -> tuple[list[dict], list[dict]]:
    """A campaign log's ``RUN-JSON`` headers (one per sitting) and ``ROUND-JSON`` rounds, as
    dicts; a line cut short by a stopped run is skipped."""
    import json

    headers, rounds = [], []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            for tag, into in (("RUN-JSON ", headers), ("ROUND-JSON ", rounds)):
                if line.startswith(tag):
                    with contextlib.suppress(json.JSONDecodeError):
                        into.append(json.loads(line[len(tag):]))
    return headers, rounds


def run(work: Path, total_faults: int, kinds=KINDS, seed: int = 0, progress=print,
        faults_per_round: int = 4, servers: Servers | None = None, *, partition=None,
        log=None, resume: bool = False, runner=None) -> list[NemesisRound]:
    """Rounds over ``kinds`` (:func:`kind_of`) until ``total_faults`` faults were injected.
    Kinds that cannot run here are left out with the reason (``progress``). The ``server``
    kind's rounds take the servers that run here in turn (:data:`SERVERS`).

    ``partition``: a :class:`sparkjet.testing.partition_campaign.Cluster` for the
    ``partition`` kind. ``log``: a file every round's ``ROUND-JSON`` line is appended to
    (with its index, the seed, the package version and git commit), after a ``RUN-JSON``
    header per sitting; ``resume``: continue the run ``log`` holds (same seed, kinds and
    faults per round), from the round after its last, and return its rounds with the new
    ones. ``runner(kind, index, faults, rng, server, operator, sink=, guarantee=)`` replaces the real rounds
    (tests).

    Rounds of a kind take its sinks in turn (:func:`sinks_for`); once the sinks have
    turned, the stateful operators of :mod:`sparkjet.testing.operators` the sink can hold
    (:func:`operators_for`) and the guarantees (:data:`GUARANTEES`) turn too. A
    ``server`` round takes the next server, and each server its sinks and operators so."""
    import json

    info = build_info()
    done_rounds: list[dict] = []
    headers: list[dict] = []
    if log is not None:
        headers, done_rounds = read_log(log)
        if done_rounds and not resume:
            raise NemesisError(f"{log} holds {len(done_rounds)} rounds of a campaign: "
                               "--resume to continue it, or log to another file")
        if resume and headers:
            first = headers[0]
            wanted = {"seed": seed, "kinds": list(kinds), "faults_per_round": faults_per_round}
            differ = {k: (first.get(k), v) for k, v in wanted.items() if first.get(k) != v}
            if differ:
                raise NemesisError(f"--resume: {log} is a run with " + ", ".join(
                    f"{k} {was!r} (not {now!r})" for k, (was, now) in differ.items())
                    + ": resume it with the same command")
        done_rounds = [d for d in done_rounds if d.get("seed") == seed]
    own = servers is None and runner is None
    servers = servers or (Servers() if runner else Servers().start(kinds))
    if "partition" in kinds and runner is None:
        why = "needs a partition_campaign.Cluster" if partition is None else partition.why_not
        if why:
            servers.why_not["partition"] = why
    try:
        runnable = [k for k in kinds if k not in servers.why_not]
        for k in kinds:
            if k in servers.why_not:
                progress(f"kind {k} left out: {servers.why_not[k]}")
        if not runnable:
            return []
        if "server" in runnable:
            for k, why in servers.why_not_server.items():
                progress(f"server {k} left out of kind server: {why}")
        if resume and headers and (headers[0].get("runnable"), headers[0].get("servers")) != (
                runnable, servers.servers):
            raise NemesisError(
                f"--resume: the kinds and servers that run here ({runnable}, servers "
                f"{servers.servers}) are not those of {log} ({headers[0].get('runnable')}, "
                f"servers {headers[0].get('servers')}): its rounds would not be drawn again")
        header = {"seed": seed, "kinds": list(kinds), "faults_per_round": faults_per_round,
                  "faults": total_faults, "runnable": runnable, "servers": servers.servers,
                  **info, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if resume and done_rounds:
            progress(f"resuming {log}: {len(done_rounds)} rounds, "
                     f"{sum(len(d['faults']) for d in done_rounds)} faults done")
        if log is not None:
            _append(log, "RUN-JSON " + json.dumps(header))
        results = from_log("ROUND-JSON " + json.dumps(d) for d in done_rounds)
        done = sum(len(r.faults) for r in results)
        i = max((d["index"] for d in done_rounds), default=-1) + 1
        seen: dict[str, int] = {}           # rounds of each kind before round i
        for j in range(i):
            k = kind_of(j, runnable, faults_per_round)
            seen[k] = seen.get(k, 0) + 1
        idle = 0
        while done < total_faults:
            kind = kind_of(i, runnable, faults_per_round)
            ordinal = seen.get(kind, 0)
            seen[kind] = ordinal + 1
            rng = round_rng(seed, i)
            # a partition round's job is keyed, exactly-once, into files
            server, operator, sink, guarantee = None, "keyed", "file", "exactly-once"
            turn = ordinal
            if kind == "server":
                server = servers.servers[ordinal % len(servers.servers)]
                turn = ordinal // len(servers.servers)    # each server through every operator
            if kind != "partition":
                kinds_of_sink = sinks_for(kind, server, servers)
                sink = kinds_of_sink[turn % len(kinds_of_sink)]
                # each sink through every operator it holds and every guarantee: they turn
                # once the sinks have
                cycle = turn // len(kinds_of_sink)
                ops = operators_for(sink)
                operator = ops[cycle % len(ops)]
                guarantee = GUARANTEES[cycle % len(GUARANTEES)]
            if kind == "partition":
                n = min(PARTITION_ROUND, total_faults - done)
            else:
                n = min(faults_per_round, total_faults - done)
            if runner is not None:
                r = runner(kind, i, n, rng, server, operator, sink=sink, guarantee=guarantee)
            else:
                folder = work / f"{'partition' if kind == 'partition' else 'round'}-{i:05d}"
                shutil.rmtree(folder, ignore_errors=True)   # a round cut short before
                if kind == "partition":
                    r = partition.round(folder, n, rng, progress)
                else:
                    r = run_round(folder, kind, n, rng, servers, server=server,
                                  operator=operator, sink=sink, guarantee=guarantee)
            results.append(r)
            done += len(r.faults)
            line = round_json(r, index=i, seed=seed, **info)
            if log is not None:
                _append(log, line)
            i += 1
            progress(f"round {i}: " + round_line(r))
            progress(line)
            idle = idle + 1 if not r.faults else 0
            if idle == 3:
                break
        return results
    finally:
        if own:
            servers.stop()


def _append(log, line: str) -> None:
    """``line`` at the end of ``log``, on a line of its own (after a line a stopped run cut
    short), flushed to disk: a run stopped any time keeps every round it finished."""
    with open(log, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def round_line(r: NemesisRound) -> str:
    """A round as a line of the campaign's output."""
    rec = [f.recovered for f in r.faults if f.recovered is not None]
    return (f"{r.kind:9} {r.server or '':8} {r.operator:8} {r.sink:15} "
            f"{'EO' if r.guarantee == 'exactly-once' else 'ALO'} faults "
            f"{len(r.faults):2} restarts {r.restarts:2} {r.seconds:5.1f}s recover max "
            f"{max(rec) if rec else '-'} lost {r.lost} duplicated {r.duplicated} "
            f"stale {r.stale_reads} {'valid' if r.valid else 'INVALID'}"
            + "".join(f"\n    {f.name}" for f in r.faults if r.kind == "partition")
            + (f"\n    failed: {r.error}" if r.error else "")
            + "".join(f"\n    {note}" for note in r.notes)
            + "".join(f"\n    VIOLATION: {v}" for v in r.violations))


def round_json(r: NemesisRound, **extra) -> str:
    """One round as a ``ROUND-JSON`` line (with ``extra``: the round's index, the seed, the
    build): a long run's log can be summed up while it runs (:func:`from_log`)."""
    import json

    return "ROUND-JSON " + json.dumps({**extra,
        "kind": r.kind, "sink": r.sink, "faults": [f.name for f in r.faults],
        "recovered": [f.recovered for f in r.faults], "restarts": r.restarts,
        "seconds": round(r.seconds, 1), "lost": r.lost, "unfinished": r.unfinished,
        "duplicated": r.duplicated, "stale_reads": r.stale_reads, "error": r.error,
        "notes": r.notes, "violations": r.violations, "valid": r.valid, "server": r.server,
        "operator": r.operator, "guarantee": r.guarantee})


def from_log(lines) -> list[NemesisRound]:
    """The rounds of a campaign's output (its ``ROUND-JSON`` lines), for :func:`summary`
    of a run still going or cut short."""
    import json

    rounds = []
    for line in lines:
        if not line.startswith("ROUND-JSON "):
            continue
        try:
            d = json.loads(line[len("ROUND-JSON "):])
        except json.JSONDecodeError:
            continue            # the last line of a run stopped while writing it

        # the counts the summary needs, standing in for the checker's report
        report = SimpleNamespace(lost_count=d["lost"] + d["unfinished"],
                                 duplicated_count=d["duplicated"],
                                 valid=d["valid"] or d["error"] is not None)
        faults = [FaultRecord(d["kind"], n, 0.0, 0.0, rec)
                  for n, rec in zip(d["faults"], d["recovered"], strict=True)]
        rounds.append(NemesisRound(d["kind"], d["sink"], faults, d["restarts"], d["seconds"],
                                   report, d["stale_reads"], d["error"], d["notes"],
                                   d["violations"], d.get("server"),
                                   d.get("operator", "keyed"),
                                   guarantee=d.get("guarantee", "exactly-once")))
    return rounds


def per_kind(results: list[NemesisRound]) -> dict[str, dict]:
    """Per kind: rounds, faults, restarts, recovery times (p50, max), lost, duplicated
    under exactly-once (``duplicated``) and at-least-once (``alo_duplicated``, allowed),
    stale reads, failed jobs, invalid rounds, and the rounds per sink and guarantee."""
    out: dict[str, dict] = {}
    for r in results:
        k = out.setdefault(r.kind, {"rounds": 0, "faults": 0, "restarts": 0, "recover": [],
                                    "lost": 0, "unfinished": 0, "duplicated": 0,
                                    "alo_duplicated": 0, "stale_reads": 0, "failed": 0,
                                    "invalid": 0, "names": {}, "sinks": {}})
        k["rounds"] += 1
        k["faults"] += len(r.faults)
        k["restarts"] += r.restarts
        k["recover"] += [f.recovered for f in r.faults if f.recovered is not None]
        k["lost"] += r.lost
        k["unfinished"] += r.unfinished
        k["duplicated" if r.guarantee == "exactly-once" else "alo_duplicated"] += r.duplicated
        k["stale_reads"] += r.stale_reads
        tag = f"{r.sink} {'EO' if r.guarantee == 'exactly-once' else 'ALO'}"
        k["sinks"][tag] = k["sinks"].get(tag, 0) + 1
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
    """The per-kind table of :func:`per_kind`: ``duplicated`` counts exactly-once rounds
    (must be 0), ``dup ALO`` at-least-once ones (allowed)."""
    lines = [f"{'kind':10}{'rounds':>7}{'faults':>7}{'restarts':>9}{'recover p50':>12}"
             f"{'max':>7}{'lost':>6}{'duplicated':>11}{'dup ALO':>8}{'stale':>7}{'failed':>7}"
             f"{'invalid':>8}"]
    total = {"faults": 0, "lost": 0, "duplicated": 0, "alo_duplicated": 0, "stale_reads": 0,
             "invalid": 0}
    for kind, k in per_kind(results).items():
        p50 = f"{k['recover_p50']:.2f}s" if k["recover_p50"] is not None else "-"
        mx = f"{k['recover_max']:.1f}s" if k["recover_max"] is not None else "-"
        lines.append(f"{kind:10}{k['rounds']:>7}{k['faults']:>7}{k['restarts']:>9}{p50:>12}"
                     f"{mx:>7}{k['lost']:>6}{k['duplicated']:>11}{k['alo_duplicated']:>8}"
                     f"{k['stale_reads']:>7}{k['failed']:>7}{k['invalid']:>8}")
        for t in total:
            total[t] += k[t]
        lines.append("    " + ", ".join(f"{n} {c}" for n, c in sorted(k["names"].items())))
        lines.append("    rounds into " + ", ".join(f"{n} {c}"
                                                    for n, c in sorted(k["sinks"].items())))
    lines.append("all: " + ", ".join(f"{t} {v}" for t, v in total.items()))
    return "\n".join(lines)
