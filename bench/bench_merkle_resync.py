"""Merkle resync of a stale slot against a full copy (issue 25 item 2's target: at 10M keys
with 0.1 % changed, <= 2 % of a full copy's bytes at the chosen depth, also reported at
depth 10, and faster than the copy).

Workload: a keyed state of ``--keys`` rows (key int64, unique, spread; value int64) written
by slot a as snapshot 0 (271 partitions, lz4, 128 KiB chunks: the runtime's defaults); slot
b gets a whole copy of it (a backup that then went away). Snapshot 1 changes ``--changed``
of the rows (80 % values updated in place, 10 % rows deleted, 10 % new rows appended: what a
keyed operator's state does). Slot b then brings its copy up to snapshot 1 from slot a over
a real exchange server on loopback (``sparkjet.runtime.resync``): by Merkle resync at the
chosen depth (``merkle_tree_depth="auto"``) and at depth 10, and by a full copy of the
byte ranges (``copy_file``: the ``slot_read`` stream). Every run's copy is checked against
the record (the persistence verification). Bytes are the payloads sent both ways (JSON
bodies of the walk's actions, chunk headers, the rows' Arrow IPC stream; for the copy, the
chunks' bytes); "copied": the partitions a Merkle resync copied whole instead (a copy
moved less for them, :mod:`sparkjet.runtime.resync`); times are wall clock, one process
holding both sides (loopback), median of ``--rounds``, and the link speed below which the
resync beats the copy follows from them (bytes saved / seconds spent). No time is asserted.

    python bench/bench_merkle_resync.py                  # 10M keys
    python bench/bench_merkle_resync.py --keys 1000000   # a quick run
    python -m pytest bench/bench_merkle_resync.py --benchmark-only   # 1M keys
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pytest

from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.persistence import _verify_file
from sparkjet.runtime.resync import MerkleHolder, copy_file, resolve_depth, resync_file
from sparkjet.runtime.storage import held_ranges, slot_read_handler
from sparkjet.snapshot import layout
from sparkjet.snapshot import records as meta
from sparkjet.snapshot.slots import REPLICAS, StorageSlot
from sparkjet.snapshot.store import SnapshotStore

JOB = 0x5EED
PARTITIONS = 271
SEED = 20_261_127


def _keys(n: int, start: int = 0) -> np.ndarray:
    x = np.arange(start, start + n, dtype=np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    return (x & np.uint64(2**62 - 1)).astype(np.int64)


def tables(keys: int, changed: float) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng(SEED)
    k = _keys(keys)
    v = rng.integers(0, 2**40, keys, dtype=np.int64)
    old = pa.table({"key": k, "v": v})
    d = max(10, int(keys * changed))
    picks = rng.choice(keys, size=d, replace=False)
    updated, deleted = picks[: d * 8 // 10], picks[d * 8 // 10: d * 9 // 10]
    v2 = v.copy()
    v2[updated] += 1
    keep = np.ones(keys, bool)
    keep[deleted] = False
    added = d - len(updated) - len(deleted)
    new = pa.table({"key": np.concatenate([k[keep], _keys(added, keys)]),
                    "v": np.concatenate([v2[keep], rng.integers(0, 2**40, added, np.int64)])})
    return old, new


class Setup:
    """Two slots, a store, snapshots 0 and 1 written by slot a, slot b's copy of 0, and a
    real exchange server serving slot a."""

    def __init__(self, keys: int, changed: float):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.root = tempfile.mkdtemp(prefix="bench-merkle-resync-", dir=shm)
        self.a = StorageSlot.claim(os.path.join(self.root, "a"), host="a")
        self.b = StorageSlot.claim(os.path.join(self.root, "b"), host="b")
        store = SnapshotStore(os.path.join(self.root, "store"), JOB)
        store.register_execution(1)
        old, new = tables(keys, changed)
        self.old = self._snapshot(store, 0, old)
        f0 = self.old.vertices["agg"].files[0]
        src = self._path(self.a, self.old, f0)
        dst = self._path(self.b, self.old, f0)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        self.record = self._snapshot(store, 1, new)
        self.file = self.record.vertices["agg"].files[0]
        self.parts = {c.partition for c in self.file.chunks}
        security = LinkSecurity.generate(1)
        self.server = ExchangeServer("127.0.0.1", execution_id=1, security=security)
        MerkleHolder(self.a, JOB).register(self.server)
        self.server.on_get("slot_read", slot_read_handler(self.a, JOB))
        self.client = ExchangeClient(self.server.location, security=security)
        self.keys, self.changed = keys, changed

    def _snapshot(self, store, sid, table):
        w = store.writer(sid, 1, writer=0, partition_count=PARTITIONS, slot=self.a)
        w.write_table("agg", table, key="key")
        store.commit(sid, 1, [w.finish()], table="dGFibGU=", plan='{"v": 1}')
        data, _, _ = store.committed_record(sid)
        return meta.decode(data, meta.ValidationRecord, f"snapshot {sid}", "record")

    @staticmethod
    def _path(slot, record, f):
        folder = layout.snapshot_dir(record.snapshot_id, record.execution_id)
        return os.path.join(slot.job_path(JOB, REPLICAS), layout.SNAPSHOTS, folder,
                            *f.path.split("/"))

    def _clear(self) -> None:
        path = self._path(self.b, self.record, self.file)
        for name in (path, path + ".ranges"):
            if os.path.exists(name):
                os.remove(name)

    def _check(self) -> None:
        path = self._path(self.b, self.record, self.file)
        _verify_file(path, self.file, JOB, 1, (held_ranges(path) or (0, None))[1])

    def merkle(self, depth):
        self._clear()
        report = resync_file(self.b, JOB, self.client, self.a.uuid, self.record, self.file,
                             self.parts, self.old, key="key", depth=depth,
                             partition_count=PARTITIONS)
        self._check()
        return report

    def copy(self):
        self._clear()
        report = copy_file(self.b, JOB, self.client, self.a.uuid, self.record, self.file,
                           self.parts)
        self._check()
        return report

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.a.release()
        self.b.release()
        shutil.rmtree(self.root, ignore_errors=True)


def measure(setup: Setup, rounds: int) -> list[dict]:
    f = setup.file
    entries = sum(c.entry_count for c in f.chunks)
    stored = sum(c.stored_size for c in f.chunks)
    chosen = resolve_depth("auto", entries, len(setup.parts), PARTITIONS, stored // entries)
    out = []
    runs = [(f"Merkle, depth {chosen} (auto)", lambda: setup.merkle("auto"))]
    if chosen != 10:
        runs.append(("Merkle, depth 10", lambda: setup.merkle(10)))
    runs.append(("full copy (slot_read)", setup.copy))
    for name, run in runs:
        reports = [run() for _ in range(rounds)]
        r = reports[-1]
        out.append({"how": name, "bytes": r.synced_bytes, "full": r.full_copy_bytes,
                    "seconds": statistics.median(x.seconds for x in reports),
                    "rows_fetched": r.rows_fetched, "leaves": r.differing_leaves,
                    "fallback": len(r.fallback), "tree": r.tree_bytes, "rows": r.row_bytes,
                    "copied": sum(w == "copy" for w in r.ways.values()),
                    "headers": r.header_bytes})
    return out


def table_text(setup: Setup, rows: list[dict]) -> str:
    lines = [f"{setup.keys:,} keys, {setup.changed:.3%} changed, {PARTITIONS} partitions, "
             f"full copy {rows[-1]['full']:,} bytes",
             f"{'':28} {'bytes':>12} {'of copy':>8} {'walk':>10} {'headers':>9} "
             f"{'rows':>10} {'rows fetched':>13} {'copied':>7} {'seconds':>8}"]
    for r in rows:
        lines.append(f"{r['how']:28} {r['bytes']:>12,} {r['bytes'] / r['full']:>8.2%} "
                     f"{r['tree']:>10,} {r['headers']:>9,} {r['rows']:>10,} "
                     f"{r['rows_fetched']:>13,} {r['copied']:>7,} {r['seconds']:>8.2f}")
    copy = rows[-1]
    for r in rows[:-1]:
        extra = r["seconds"] - copy["seconds"]
        saved = copy["bytes"] - r["bytes"]
        if extra > 0:
            # on a link of rate R the copy takes its CPU time plus bytes / R, and so does the
            # resync: it wins where saved / R > extra
            lines.append(f"{r['how']}: faster than the copy on links slower than "
                         f"{saved / extra / 1e6:,.0f} MB/s ({saved * 8 / extra / 1e9:.2f} Gb/s)")
        else:
            lines.append(f"{r['how']}: faster than the copy on this link")
    return "\n".join(lines)


# ------------------------------------------------------------------------ pytest-benchmark

@pytest.fixture(scope="module")
def setup():
    s = Setup(int(os.environ.get("BENCH_MERKLE_RESYNC_KEYS", 1_000_000)), 0.001)
    yield s
    s.close()


@pytest.mark.parametrize("depth", ["auto", 10])
def test_merkle_resync(benchmark, setup, depth):
    benchmark.group = f"resync of {setup.keys:,} keys, 0.1 % changed"
    report = benchmark.pedantic(setup.merkle, args=(depth,), rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(bytes=report.synced_bytes, full=report.full_copy_bytes)


def test_full_copy(benchmark, setup):
    benchmark.group = f"resync of {setup.keys:,} keys, 0.1 % changed"
    report = benchmark.pedantic(setup.copy, rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(bytes=report.copied_bytes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--changed", type=float, default=0.001)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="run in a network namespace of its own whose loopback is shaped "
                             "to RATE (tc tbf, e.g. 1gbit): both sides then talk over a link "
                             "of that speed, not a memory copy (needs root, ip and tc)")
    args = parser.parse_args(argv)
    if args.link:
        return _on_a_shaped_link(args.link, [a for a in (argv if argv is not None
                                                       else sys.argv[1:])])
    setup = Setup(args.keys, args.changed)
    try:
        print(table_text(setup, measure(setup, args.rounds)))
    finally:
        setup.close()
    return 0


def _on_a_shaped_link(rate: str, argv: list[str]) -> int:
    """Runs this script again (without ``--link``) in a new network namespace whose
    loopback passes at most ``rate`` (a token bucket: ``tc qdisc ... tbf``)."""
    import shlex
    import subprocess

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--link":
            skip = True
        elif not a.startswith("--link="):
            rest.append(a)
    missing = [t for t in ("unshare", "ip", "tc") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        raise SystemExit(f"--link needs root and {', '.join(('unshare', 'ip', 'tc'))} "
                         f"({'missing: ' + ', '.join(missing) if missing else 'not root'})")
    print(f"loopback shaped to {rate} (tc tbf) in a network namespace of its own", flush=True)
    script = " ".join(shlex.quote(x) for x in (sys.executable, os.path.abspath(__file__),
                                                 *rest))
    shell = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {shlex.quote(rate)} "
             f"burst 1mb latency 50ms && exec {script}")
    return subprocess.run(["unshare", "-n", "sh", "-c", shell], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
