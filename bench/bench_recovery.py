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
  are reported when it has them.
- **rebuild**: ``KeyedAggregator.restore`` of a state table of ``keys`` int64 keys (count and
  float64 sum, keys in random order) into an empty operator, in process: the operator
  rebuild alone, in keys/s.
- **store vs IPC**: 5M rows (int64 key, int64 count, float64 sum) written and committed
  through ``SnapshotStore`` (lz4, fsync) and restored from it (all partitions, page cache),
  beside one ``pyarrow`` IPC file of the same rows (lz4, ``use_threads=False``, fsync) written
  and read back (memory-mapped).

Run: ``python bench/bench_recovery.py --keys 1000000 10000000`` (prints the tables) or
``python -m pytest bench/bench_recovery.py --benchmark-only`` (1M keys).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

from sparkjet.operators.rolling import KeyedAggregator
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource

BATCH = 65_536
AGGREGATIONS = {"count": "count", "sum": ("sum", "value")}
NAN = float("nan")


# -- recovery, end to end -----------------------------------------------------------------

def recovery(keys: int, work: str, rate: float = 4_000_000) -> dict:
    """Kill -9 the member once a snapshot covers 3 x keys events; seconds from the kill to
    each phase."""
    source = GeneratorSource(partitions=4, keys=keys, batch_size=BATCH, rate=rate)
    p = (Pipeline().read_from(source).group_by("key").aggregate(**AGGREGATIONS)
         .write_to(DiscardSink()))
    config = JobConfig(name=f"bench-recovery-{keys}", snapshot_store=work,
                       snapshot_interval=1.0, local_parallelism=2, max_restarts=2,
                       restart_backoff=0.0)
    job = Job(p, config)
    marks: dict = {}

    def progress(event):
        now = time.monotonic()
        kind = event.get("event")
        if kind == "snapshot" and "kill" not in marks and event.get("events_in", 0) >= 3 * keys:
            pid = job.member_pid
            if pid:
                marks["state_bytes"] = event["bytes"]
                marks["kill"] = now
                os.kill(pid, signal.SIGKILL)
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

    job.run(on_progress=progress)
    kill = marks.get("kill", NAN)
    out = {"keys": keys, "state_mb": marks.get("state_bytes", 0) / 1e6}
    for phase in ("detected", "running", "restored", "first_commit"):
        out[phase] = marks.get(phase, NAN) - kill
    out["first_commit_duration_s"] = marks.get("first_commit_s", NAN)
    ev = marks.get("restored_event") or {}
    for k in ("read_s", "rebuild_s", "keys"):
        if k in ev:
            out[f"event_{k}"] = ev[k]
    return out


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


def store_vs_ipc(rows: int, work: str, rounds: int = 3) -> dict:
    table = state_table(rows)
    table = table.rename_columns(["key", "count", "sum"])
    store = SnapshotStore(os.path.join(work, "store"), 1, durable=True)
    store.register_execution(1)
    writes, restores, ipc_writes, ipc_reads = [], [], [], []
    path = os.path.join(work, "state.arrow")
    options = pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False)
    try:
        for i in range(rounds + 1):
            store.wait_for_cleanup()
            start = time.perf_counter()
            writer = store.writer(i, 1, codec="lz4")
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
    finally:
        store.close()
    med = {k: statistics.median(v[1:]) for k, v in
           (("write", writes), ("restore", restores), ("ipc_write", ipc_writes),
            ("ipc_read", ipc_reads))}
    med["write_ratio"] = med["ipc_write"] / med["write"]
    med["restore_ratio"] = med["ipc_read"] / med["restore"]
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--rows", type=int, default=5_000_000, help="store vs IPC rows")
    parser.add_argument("--skip", nargs="*", default=[], choices=["recovery", "rebuild", "ipc"])
    parser.add_argument("--json", help="also write the results to this file")
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
            r = results["store-vs-ipc"] = store_vs_ipc(args.rows, work)
        print(f"\nstore vs pyarrow IPC lz4 file, {args.rows:,} rows, fsync")
        print(f"  write+commit {r['write']:.3f} s, IPC write {r['ipc_write']:.3f} s: "
              f"{r['write_ratio']:.2f}x")
        print(f"  restore      {r['restore']:.3f} s, IPC read  {r['ipc_read']:.3f} s: "
              f"{r['restore_ratio']:.2f}x", flush=True)
    if "recovery" not in args.skip:
        print("\nrecovery after kill -9, seconds from the kill")
        for k in args.keys:
            with tempfile.TemporaryDirectory() as work:
                r = results[f"recovery-{k}"] = recovery(k, work)
            print("  " + json.dumps(r), flush=True)
    results["load_end"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
