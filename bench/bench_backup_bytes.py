"""Bytes written to backup slots by the members' storage (issue 24 item 3), per snapshot.

A bounded ``GeneratorSource`` (``6 x keys`` events, int64 keys uniform over ``keys``) into
``group_by("key").aggregate(count, sum)`` into ``DiscardSink``, exactly-once, 0.5 s
snapshots, ``storage="members"`` with ``--backup-count`` on ``local[N]`` with N members
(``local_parallelism=1``), slots under ``/dev/shm``. At each committed snapshot, for each of
its chunk files in the slots: the writer's copy is the file; every other copy is a backup,
whose bytes written are the lengths of the ranges its ``.ranges`` sidecar names (a backup of
byte ranges) or its size (a whole-file backup, as before backups carried ranges), and whose
memory is its allocated blocks (``st_blocks``; a range backup is sparse, but a page holding
part of a range is whole). Reported: per snapshot and in total, the files' bytes (the
state), the bytes written to backup slots and their ratio to the state, and the backups'
blocks.

Run: ``python bench/bench_backup_bytes.py --keys 1000000`` (about 40 s here).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource
from sparkjet.spark import local_session


def written(path: Path) -> int:
    """The bytes a copy in a slot was sent: its ranges' (sidecar), else the whole file."""
    side = Path(f"{path}.ranges")
    if side.exists():
        return sum(r[1] for r in json.loads(side.read_text())["ranges"])
    return path.stat().st_size


def snapshot_bytes(slots: Path, snapshot: int, execution: int) -> tuple[int, int, int] | None:
    """(files' bytes, bytes written to backups, backups' allocated bytes) of one snapshot."""
    folder = f"{snapshot:012d}-e{execution:012d}"
    copies: dict[str, list[Path]] = {}
    for f in slots.rglob(f"replicas/snapshots/{folder}/*/*.chunks"):
        copies.setdefault(str(f.relative_to(f.parents[1])), []).append(f)
    if not copies:
        return None
    state = backup = blocks = 0
    for fs in copies.values():
        size = max(f.stat().st_size for f in fs)
        allocated = [f.stat().st_blocks * 512 for f in fs]
        primary = next((f for f in fs if not Path(f"{f}.ranges").exists()), fs[0])
        state += size
        backup += sum(written(f) for f in fs if f != primary)
        blocks += sum(a for f, a in zip(fs, allocated) if f != primary)
    return state, backup, blocks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--backup-count", type=int, default=1)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-backup-bytes-", dir="/dev/shm"))
    rows = []

    def progress(event):
        if event.get("event") == "snapshot":
            got = snapshot_bytes(root / "slots", event["snapshot"], event["execution"])
            if got is not None:
                rows.append((event["snapshot"], *got))

    spark = local_session(f"local[{args.members}]")
    source = GeneratorSource(total=6 * args.keys, partitions=args.members, keys=args.keys,
                             rate=2_000_000, batch_size=20_000, seed=1)
    stream = Pipeline().read_from(source).group_by("key").aggregate(
        count="count", sum=("sum", "value"))
    config = JobConfig(name="bench-backup-bytes", processing_guarantee="exactly-once",
                       snapshot_store=str(root / "store"), snapshot_interval=0.5,
                       storage="members", backup_count=args.backup_count,
                       storage_dir=str(root / "slots"), members=args.members,
                       local_parallelism=1)
    try:
        Job(stream.write_to(DiscardSink()), config).run(spark, on_progress=progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not rows:
        print("no snapshot was measured", file=sys.stderr)
        return 1
    print(f"{'snapshot':>8} {'files (state)':>14} {'to backups':>11} {'ratio':>6} "
          f"{'backup blocks':>14}")
    for sid, state, backup, blocks in rows:
        print(f"{sid:>8} {state:>14} {backup:>11} {backup / state:>6.2f} {blocks:>14}")
    state, backup, blocks = (sum(r[i] for r in rows) for i in (1, 2, 3))
    print(f"total: state {state} B, written to backup slots {backup} B "
          f"({backup / state:.2f}x the state), backups' blocks {blocks} B "
          f"({blocks / state:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
