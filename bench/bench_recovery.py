"""Recovery speed (issue 24 item 6): where the time from a kill to the first new output goes.

Three measurements, each on its own:

- **recovery**: an unbounded ``GeneratorSource`` (int64 keys, uniform over ``keys``) into
  ``group_by("key").aggregate(count, sum)``, exactly-once, 1 s snapshots, one member with
  ``local_parallelism=2`` under the local supervisor. Once a committed snapshot has seen
  3 x ``keys`` events (95 % of the keys in the state), the member process is killed with
  SIGKILL. Phases, in seconds from the kill, from the job's progress events: **detected**
  (``restart``: the supervisor saw the member die), **running** (``execution``: the new
  member process is started), **restored** (``restored``: every operator rebuilt its
  state; before the change this event came before the rebuild), **first commit** (the first
  ``snapshot`` after it). The ``restored`` event's own fields (snapshot read, rebuild, keys)
  are reported when it has them. A member that has committed a snapshot gets a standby
  member process beside it (its imports done) in which a restart runs: by default the kill
  waits, past that snapshot, until the standby has been up 1.5 s; ``--standby off`` runs
  without one (each restart starts a new interpreter), ``--standby any`` kills at that
  snapshot whatever the standby is doing.
- **rebuild**: ``KeyedAggregator.restore`` of a state table of ``keys`` int64 keys (count and
  float64 sum, keys in random order) into an empty operator, in process: the operator
  rebuild alone, in keys/s.
- **store vs IPC**: 5M rows (int64 key, int64 count, float64 sum) written and committed
  through ``SnapshotStore`` (lz4, fsync) and restored from it (all partitions, page cache),
  beside one ``pyarrow`` IPC file of the same rows (lz4, ``use_threads=False``, fsync) written
  and read back (memory-mapped). With the members' storage (issue 24 item 3), in the same
  rounds: the rows written into a storage slot (``/dev/shm``) and backed up to a second
  slot over a real exchange link (``slot_write`` file streams, Flight ``DoPut``), a restore
  that reads the second slot's replica over the link (``slot_read``, ``DoGet``), and that
  replica's bytes fetched alone. Server and client run in this process (one GIL); with
  ``--peer-process`` slot b and its server run in a child process, as another member's do.
- **recovery on Spark** (``--spark``): the recovery above on a ``local[2]`` Spark session,
  two members (``local_parallelism=1`` each), member 1's Python worker killed with SIGKILL,
  once per storage mode: ``shared`` (the chunk files in ``snapshot_store``, fsynced) and
  ``members`` (``backup_count=1``: each member's slot under ``/dev/shm``, every file backed
  up to the other slot; the killed member's slot is reclaimed by its next task, a local
  restore). The modes alternate, key count by key count, in one session.

Run: ``python bench/bench_recovery.py --keys 1000000 10000000`` (prints the tables),
``python bench/bench_recovery.py --spark --skip rebuild ipc`` (both storage modes on Spark) or
``python -m pytest bench/bench_recovery.py --benchmark-only`` (1M keys).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

from sparkjet.operators.rolling import KeyedAggregator
from sparkjet.partition_table import PartitionTable
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.snapshot.slots import StorageSlot
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource

BATCH = 65_536
#: Where the members' slots go, as a job's default storage_dir (memory).
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
AGGREGATIONS = {"count": "count", "sum": ("sum", "value")}
#: The store-vs-IPC rows write with the codec a job writes its snapshots with.
CODEC = JobConfig.__dataclass_fields__["snapshot_codec"].default
NAN = float("nan")


# -- recovery, end to end -----------------------------------------------------------------

def storage_options(storage: str) -> dict:
    """The JobConfig settings of a benchmark run in ``storage`` mode: none for "shared";
    for "members", one backup and slots in a fresh folder under /dev/shm (memory), which
    the caller removes (its ``storage_dir``)."""
    if storage != "members":
        return {}
    return {"storage": "members", "backup_count": 1,
            "storage_dir": tempfile.mkdtemp(prefix="bench-slots-", dir=SHM)}


def _phase_recorder(job, keys: int, victim_pid, marks: dict, fault=None, ready=None):
    """The progress callback of a recovery run: SIGKILLs ``victim_pid()`` (or calls
    ``fault()``, in a thread of its own, when given) once a snapshot covers 3 x ``keys``
    events (and ``ready()`` says so, when given), then notes in ``marks`` when each phase
    came (detected, running, restored, first commit) and stops the job after the first
    commit."""
    def progress(event):
        now = time.monotonic()
        kind = event.get("event")
        if kind == "snapshot" and "kill" not in marks and event.get("events_in", 0) >= 3 * keys \
                and (ready is None or ready()):
            pid = victim_pid() if fault is None else -1
            if pid:
                marks["state_bytes"] = event["bytes"]
                marks["snapshot_s"] = event.get("duration_s", NAN)
                marks["kill"] = now
                if fault is None:
                    os.kill(pid, signal.SIGKILL)
                else:
                    threading.Thread(target=fault, daemon=True).start()
        elif "kill" not in marks:
            return
        elif kind == "restart":
            marks.setdefault("detected", now)
        elif kind == "execution":
            marks.setdefault("running", now)
        elif kind == "restored":
            if "restored" not in marks:
                marks["restored"] = now
                marks["restored_event"] = event
        elif kind == "snapshot" and "restored" in marks and "first_commit" not in marks:
            marks["first_commit"] = now
            marks["first_commit_s"] = event.get("duration_s", NAN)
            threading.Thread(target=job.stop, daemon=True).start()
    return progress


def _phases(marks: dict, out: dict) -> dict:
    """``out`` with the seconds from the kill to each phase, the first commit's duration
    and the ``restored`` event's own figures."""
    kill = marks.get("kill", NAN)
    for phase in ("detected", "running", "restored", "first_commit"):
        out[phase] = marks.get(phase, NAN) - kill
    out["first_commit_duration_s"] = marks.get("first_commit_s", NAN)
    ev = marks.get("restored_event") or {}
    for k in ("read_s", "rebuild_s", "keys"):
        if k in ev:
            out[f"event_{k}"] = ev[k]
    return out


def _standby_up(job, seconds: float = 1.5):
    """True once the local runner's standby member has been up ``seconds`` (its imports
    done, on this machine)."""
    seen: dict = {}

    def ready() -> bool:
        pid = job._runner.standby_pid if job._runner is not None else None
        if pid is None:
            return False
        return time.monotonic() - seen.setdefault(pid, time.monotonic()) >= seconds
    return ready


def recovery(keys: int, work: str, rate: float = 4_000_000, standby: str = "ready") -> dict:
    """Kill -9 the member once a snapshot covers 3 x keys events; seconds from the kill to
    each phase. ``standby``: "ready" waits (past that snapshot) for the local runner's
    standby member to be up, so that the restart runs in it; "off" starts none (each
    restart starts a new interpreter); "any" kills at that snapshot whatever the standby
    is doing."""
    from sparkjet.runtime import local_runner

    saved = local_runner.STANDBY_AFTER
    if standby == "off":
        local_runner.STANDBY_AFTER = float("inf")
    source = GeneratorSource(partitions=4, keys=keys, batch_size=BATCH, rate=rate)
    p = (Pipeline().read_from(source).group_by("key").aggregate(**AGGREGATIONS)
         .write_to(DiscardSink()))
    config = JobConfig(name=f"bench-recovery-{keys}", snapshot_store=work,
                       snapshot_interval=1.0, local_parallelism=2, max_restarts=2,
                       restart_backoff=0.0)
    job = Job(p, config)
    marks: dict = {}
    try:
        job.run(on_progress=_phase_recorder(job, keys, lambda: job.member_pid, marks,
                                            ready=_standby_up(job) if standby == "ready"
                                            else None))
    finally:
        local_runner.STANDBY_AFTER = saved
    return _phases(marks, {"keys": keys, "state_mb": marks.get("state_bytes", 0) / 1e6,
                           "standby": standby})


def spark_recovery(spark, keys: int, work: str, storage: str, rate: float = 4_000_000,
                   victim: int = 1) -> dict:
    """The same measurement on Spark: two members, member ``victim``'s Python worker killed
    with SIGKILL once a snapshot covers 3 x keys events; ``storage`` is "shared" or
    "members" (backup_count=1, slots under /dev/shm)."""
    source = GeneratorSource(partitions=4, keys=keys, batch_size=BATCH, rate=rate)
    p = (Pipeline().read_from(source).group_by("key").aggregate(**AGGREGATIONS)
         .write_to(DiscardSink()))
    extra = storage_options(storage)
    config = JobConfig(name=f"bench-recovery-{storage}-{keys}",
                       snapshot_store=os.path.join(work, "store"), snapshot_interval=1.0,
                       members=2, local_parallelism=1, max_restarts=2, restart_backoff=0.0,
                       **extra)
    job = Job(p, config)
    marks: dict = {}
    progress = _phase_recorder(job, keys, lambda: job.member_pids.get(victim), marks)
    try:
        job.run(spark, on_progress=progress)
    finally:
        if "storage_dir" in extra:
            shutil.rmtree(extra["storage_dir"], ignore_errors=True)
    return _phases(marks, {"keys": keys, "storage": storage,
                           "state_mb": marks.get("state_bytes", 0) / 1e6,
                           "snapshot_before_kill_s": marks.get("snapshot_s", NAN)})


# -- the operator rebuild alone -------------------------------------------------------------

def state_table(keys: int, seed: int = 7) -> pa.Table:
    """A rolling count+sum's snapshot table of ``keys`` int64 keys in random order."""
    rng = np.random.default_rng(seed)
    return pa.table({"key": rng.permutation(keys).astype(np.int64),
                     "__count": rng.integers(1, 1000, keys, dtype=np.int64),
                     "__sum__value": rng.random(keys) * 1000.0})


def rebuild(table: pa.Table, rounds: int = 3) -> dict:
    times = []
    for _ in range(rounds):
        agg = KeyedAggregator("key", AGGREGATIONS)
        start = time.perf_counter()
        agg.restore(table)
        times.append(time.perf_counter() - start)
        assert len(agg) == table.num_rows
        del agg
    s = statistics.median(times)
    return {"keys": table.num_rows, "seconds": s, "keys_per_s": table.num_rows / s,
            "first_s": times[0]}


# -- the snapshot store beside an Arrow IPC file -----------------------------------------------

def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Slot b's member when it runs in a process of its own (``_Slots(peer_process=True)``):
# its slot and exchange server, a "drop" action for the housekeeping between rounds; it
# prints its slot's uuid and location, and ends when its stdin closes.
_PEER = """
import json, sys
from sparkjet.runtime.exchange import ExchangeServer
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.storage import drop_old_snapshots, slot_read_handler, slot_write_handler
from sparkjet.snapshot.slots import StorageSlot
b = StorageSlot.claim(sys.argv[1], host="b")
server = ExchangeServer("127.0.0.1", execution_id=1,
                        security=LinkSecurity(1, bytes.fromhex(sys.stdin.readline().strip())))
server.on_put("slot_write", slot_write_handler(b, 1))
server.on_get("slot_read", slot_read_handler(b, 1))
server.on_action("drop", lambda body: (drop_old_snapshots(b, 1, body["keep"], [body["keep"]]),
                                       {})[1])
print(json.dumps({"uuid": b.uuid, "location": server.location}), flush=True)
sys.stdin.read()
server.close()
b.release()
"""


class _Slots:
    """Two storage slots under /dev/shm, each behind a real exchange server, and what a
    member asks of the runtime's storage functions (topology, peers): slot a's writer
    backs its files up to slot b; a restore in slot a's member reads b's replicas.
    ``peer_process``: slot b and its server are in a child process, as another member's
    are in a job; else in this process (one interpreter lock for both ends)."""

    def __init__(self, work: str, peer_process: bool = False):
        from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
        from sparkjet.runtime.exchange.security import LinkSecurity
        from sparkjet.runtime.storage import slot_read_handler, slot_write_handler

        self.root = tempfile.mkdtemp(prefix="bench-slots-", dir=SHM)
        self.a = StorageSlot.claim(os.path.join(self.root, "a"), host="a")
        self.c = StorageSlot.claim(os.path.join(self.root, "c"), host="c")   # holds nothing
        security = LinkSecurity.generate(1)
        self.b = self.server = self.peer = None
        if peer_process:
            self.peer = subprocess.Popen(
                [sys.executable, "-c", _PEER, os.path.join(self.root, "b")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.peer.stdin.write(security.secret.hex() + "\n")
            self.peer.stdin.flush()
            line = self.peer.stdout.readline()
            if not line:
                raise RuntimeError(f"slot b's process ended: {self.peer.wait()}")
            told = json.loads(line)
            b_uuid, location = told["uuid"], told["location"]
        else:
            self.b = StorageSlot.claim(os.path.join(self.root, "b"), host="b")
            self.server = ExchangeServer("127.0.0.1", execution_id=1, security=security)
            self.server.on_put("slot_write", slot_write_handler(self.b, 1))
            self.server.on_get("slot_read", slot_read_handler(self.b, 1))
            b_uuid, location = self.b.uuid, self.server.location
        self.b_uuid = b_uuid
        self.client = ExchangeClient(location, security=security)
        table = PartitionTable.create([self.a.uuid, b_uuid], 271, 1,
                                      groups={self.a.uuid: "a", b_uuid: "b"})
        topology = type("T", (), {"slots": [self.a.uuid, b_uuid], "table": table})()
        self.member = type("M", (), {"topology": topology, "peers": {1: self.client}})()

    def replicator(self):
        from sparkjet.runtime.storage import replicator
        return replicator(self.member, self.a, 1)

    def from_b(self):
        """slot_files of a member (slot c) that holds no copy but reaches b's member."""
        from sparkjet.runtime.storage import slot_files
        topology = type("T", (), {"slots": [self.c.uuid, self.b_uuid]})()
        member = type("M", (), {"topology": topology, "peers": {1: self.client}})()
        return slot_files(member, self.c, 1)

    def drop(self, keep: int) -> None:
        from sparkjet.runtime.storage import drop_old_snapshots
        drop_old_snapshots(self.a, 1, keep, [keep])
        if self.b is not None:
            drop_old_snapshots(self.b, 1, keep, [keep])
        else:
            self.client.action("drop", {"keep": keep})

    def close(self):
        self.client.close()
        if self.server is not None:
            self.server.close()
        if self.peer is not None:
            self.peer.stdin.close()
            self.peer.wait(30)
        for slot in (self.a, self.b, self.c):
            if slot is not None:
                slot.release()
        shutil.rmtree(self.root, ignore_errors=True)


def fetch_replicas(slots: _Slots, store: SnapshotStore, snapshot_id: int) -> int:
    """Every chunk file of a snapshot fetched whole from slot b over the link (bytes)."""
    from sparkjet.runtime.storage import PeerSlotFile

    stored = store._resolve(snapshot_id, None)
    n = 0
    for vertex, v in stored.record.vertices.items():
        for f in v.files:
            path = "/".join(["snapshots", stored.dir[-1], vertex, f.name])
            data = PeerSlotFile(slots.client, slots.b_uuid, path, 1).range_reader()(0, f.bytes)
            n += len(memoryview(data))
    return n


def store_vs_ipc(rows: int, work: str, rounds: int = 3, members: bool = True,
                 peer_process: bool = False) -> dict:
    table = state_table(rows)
    table = table.rename_columns(["key", "count", "sum"])
    store = SnapshotStore(os.path.join(work, "store"), 1, durable=True)
    store.register_execution(1)
    writes, restores, ipc_writes, ipc_reads = [], [], [], []
    slot_writes, backup_writes, peer_restores, fetches, fetched = [], [], [], [], []
    slots = _Slots(work, peer_process) if members else None
    if slots is not None:
        members_store = SnapshotStore(os.path.join(work, "members-store"), 1)
        members_store.register_execution(1)
    path = os.path.join(work, "state.arrow")
    options = pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False)
    try:
        for i in range(rounds + 1):
            store.wait_for_cleanup()
            start = time.perf_counter()
            writer = store.writer(i, 1, codec=CODEC)
            writer.write_table("state", table, key="key")
            writer.commit()
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            restored = store.restore("state")
            restores.append(time.perf_counter() - start)
            assert restored.table.num_rows == rows
            del restored
            start = time.perf_counter()
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema,
                                                                options=options) as out:
                out.write_table(table)
            _fsync(path)
            _fsync(work)
            ipc_writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            with pa.memory_map(path) as source:
                back = pa.ipc.open_file(
                    source, options=pa.ipc.IpcReadOptions(use_threads=False)).read_all()
            ipc_reads.append(time.perf_counter() - start)
            assert back.num_rows == rows
            del back
            os.unlink(path)
            if slots is None:
                continue
            # the members' storage: into slot a alone, then into a with a backup in b
            members_store.wait_for_cleanup()
            for sid, replicate, times in ((2 * i, None, slot_writes),
                                          (2 * i + 1, slots.replicator(), backup_writes)):
                start = time.perf_counter()
                writer = members_store.writer(sid, 1, codec=CODEC, slot=slots.a,
                                              replicate=replicate)
                writer.write_table("state", table, key="key")
                writer.commit()
                times.append(time.perf_counter() - start)
            members_store.slot_files = slots.from_b()
            start = time.perf_counter()
            restored = members_store.restore("state", snapshot_id=2 * i + 1)
            peer_restores.append(time.perf_counter() - start)
            assert restored.table.num_rows == rows
            del restored
            start = time.perf_counter()
            fetched.append(fetch_replicas(slots, members_store, 2 * i + 1))
            fetches.append(time.perf_counter() - start)
            members_store.slot_files = None
            slots.drop(2 * i + 1)
    finally:
        store.close()
        if slots is not None:
            members_store.close()
            slots.close()
    series = [("write", writes), ("restore", restores), ("ipc_write", ipc_writes),
              ("ipc_read", ipc_reads)]
    if slots is not None:
        series += [("slot_write", slot_writes), ("backup_write", backup_writes),
                   ("peer_restore", peer_restores), ("fetch", fetches)]
    med = {k: statistics.median(v[1:]) for k, v in series}
    med["write_ratio"] = med["ipc_write"] / med["write"]
    med["restore_ratio"] = med["ipc_read"] / med["restore"]
    if slots is not None:
        med["replica_bytes"] = fetched[-1]
        med["fetch_mb_s"] = fetched[-1] / med["fetch"] / 1e6
        med["peer_restore_ratio"] = med["ipc_read"] / med["peer_restore"]
        med["fetch_ratio"] = med["ipc_read"] / med["fetch"]
        med["backup_write_ratio"] = med["slot_write"] / med["backup_write"]
    med["rows"] = rows
    return med


# -- pytest-benchmark -------------------------------------------------------------------------

def test_rebuild_1m(benchmark):
    table = state_table(1_000_000)
    benchmark.pedantic(lambda: KeyedAggregator("key", AGGREGATIONS).restore(table), rounds=3)


def test_store_vs_ipc(benchmark, tmp_path):
    benchmark.pedantic(store_vs_ipc, args=(1_000_000, str(tmp_path), 1), rounds=1)


def test_recovery_1m(benchmark, tmp_path):
    benchmark.pedantic(recovery, args=(1_000_000, str(tmp_path / "rec")), rounds=1)


def save_results(results: dict, path: str | None) -> None:
    """Notes the load at the end in ``results`` and writes them to ``path`` as JSON (if
    given): what the benchmark scripts of the recovery family end with."""
    results["load_end"] = os.getloadavg()[0]
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--rows", type=int, default=5_000_000, help="store vs IPC rows")
    parser.add_argument("--skip", nargs="*", default=[], choices=["recovery", "rebuild", "ipc"])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--spark", action="store_true",
                        help="recovery on a local[2] Spark session, two members, in each of "
                             "--storage's modes (instead of the local supervisor)")
    parser.add_argument("--storage", nargs="+", default=["shared", "members"],
                        choices=["shared", "members"])
    parser.add_argument("--no-members", action="store_true",
                        help="store vs IPC without the members' slots and Flight rows")
    parser.add_argument("--standby", default="ready", choices=["ready", "off", "any"],
                        help="recovery on the local runner: kill once its standby member is "
                             "up (ready), with no standby (off), or at once (any)")
    parser.add_argument("--peer-process", action="store_true",
                        help="store vs IPC: slot b and its exchange server in a child process "
                             "(as another member's in a job), not in this one")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}")
    results: dict = {"load": os.getloadavg()[0]}
    if "rebuild" not in args.skip:
        print("\noperator rebuild (KeyedAggregator.restore into an empty operator)")
        for k in args.keys:
            r = results[f"rebuild-{k}"] = rebuild(state_table(k))
            print(f"  {k:>12,} keys: {r['seconds']:.3f} s, {r['keys_per_s'] / 1e6:.1f} M keys/s "
                  f"(first run {r['first_s']:.3f} s)", flush=True)
    if "ipc" not in args.skip:
        with tempfile.TemporaryDirectory() as work:
            r = results["store-vs-ipc"] = store_vs_ipc(args.rows, work,
                                                        members=not args.no_members,
                                                        peer_process=args.peer_process)
        r["peer_process"] = args.peer_process
        print(f"\nstore vs pyarrow IPC lz4 file, {args.rows:,} rows, fsync"
              + (", slot b's member in a child process" if args.peer_process else ""))
        print(f"  write+commit {r['write']:.3f} s, IPC write {r['ipc_write']:.3f} s: "
              f"{r['write_ratio']:.2f}x")
        print(f"  restore      {r['restore']:.3f} s, IPC read  {r['ipc_read']:.3f} s: "
              f"{r['restore_ratio']:.2f}x", flush=True)
        if "fetch" in r:
            print(f"  into a slot {r['slot_write']:.3f} s, with a backup over Flight "
                  f"{r['backup_write']:.3f} s: {r['backup_write_ratio']:.2f}x")
            print(f"  restore from a peer's replica over Flight {r['peer_restore']:.3f} s: "
                  f"{r['peer_restore_ratio']:.2f}x the IPC read")
            print(f"  the replica's {r['replica_bytes'] / 1e6:.0f} MB fetched over Flight "
                  f"{r['fetch']:.3f} s ({r['fetch_mb_s']:.0f} MB/s): {r['fetch_ratio']:.2f}x "
                  "the IPC read", flush=True)
    if "recovery" not in args.skip and args.spark:
        from sparkjet.spark import local_session

        spark = local_session("local[2]", "sparkjet-bench-recovery",
                              **{"spark.ui.showConsoleProgress": "false"})
        print("\nrecovery after kill -9 of member 1's Python worker, Spark local[2], "
              "seconds from the kill")
        try:
            for k in args.keys:
                for storage in args.storage:
                    with tempfile.TemporaryDirectory() as work:
                        r = results[f"spark-recovery-{storage}-{k}"] = spark_recovery(
                            spark, k, work, storage)
                    print("  " + json.dumps(r), flush=True)
        finally:
            spark.stop()
    elif "recovery" not in args.skip:
        print("\nrecovery after kill -9, seconds from the kill")
        for k in args.keys:
            with tempfile.TemporaryDirectory() as work:
                r = results[f"recovery-{k}"] = recovery(k, work, standby=args.standby)
            print("  " + json.dumps(r), flush=True)
    save_results(results, args.json)


if __name__ == "__main__":
    main()
