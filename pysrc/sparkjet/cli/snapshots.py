"""``sparkjet snapshots list|show|verify URI``: look inside a snapshot store, without
changing it: a missing store or job is an error, never created. ``sparkjet snapshots
rollback URI --job NAME --to ID`` changes a store: it makes one of the job's retained
snapshots the one it resumes from, and the newer ones unusable; ``sparkjet snapshots
force-start URI --job NAME --storage-dir DIR`` deletes a job of the members' storage, its
snapshots and its slots' data (``Job.force_start()``)."""
from __future__ import annotations

import argparse
import sys
import time

from sparkjet.errors import (
    JobAlreadyRunningError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
)
from sparkjet.runtime.progress import ProgressLine, bar
from sparkjet.snapshot import layout
from sparkjet.snapshot.store import SnapshotStore


def add_parser(commands) -> None:
    snaps = commands.add_parser(
        "snapshots", help="list, show or verify the snapshots in a snapshot store",
        description="Look inside a sparkjet snapshot store (a local path, or any pyarrow.fs URI).")
    sub = snaps.add_subparsers(title="actions", metavar="ACTION", required=True)
    for name, help_, run in (
        ("list", "every job's last complete snapshot and its exports", _list),
        ("show", "per vertex (and partition) bytes, chunks and entries of a snapshot", _show),
        ("verify", "read every chunk and check every checksum (exit 1 if any fails)", _verify),
    ):
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("uri", help="the store: a directory, or s3://, hdfs://, gs:// ...")
        p.add_argument("--job", type=_job_id, default=None,
                       help="job name (as `sparkjet jobs` prints it) or id (decimal or 0x "
                            "hex); default: every job in the store")
        if name != "list":
            p.add_argument("--name", default=None, help="an exported snapshot, by name")
        if name == "show":
            p.add_argument("--partitions", action="store_true", help="one line per partition")
        p.set_defaults(command=f"snapshots {name}", run=run, parser=p)
    help_ = ("make a retained snapshot of a job the one it resumes from: the newer ones are "
             "set aside for good, and output the sinks committed after it is written again")
    p = sub.add_parser("rollback", help=help_, description=help_ + (
        ". The job must not be running. Use it when the newest snapshot is damaged and the "
        "job refuses to fall back on its own (a sink committed past the older one), "
        "accepting those duplicates; or to replay from an older point on purpose."))
    p.add_argument("uri", help="the store: a directory, or s3://, hdfs://, gs:// ...")
    p.add_argument("--job", type=_job_id, required=True,
                   help="job name (as `sparkjet jobs` prints it) or id (decimal or 0x hex)")
    p.add_argument("--to", type=int, required=True, metavar="SNAPSHOT_ID",
                   help="the snapshot id to go back to (`sparkjet snapshots list` shows them)")
    p.set_defaults(command="snapshots rollback", run=_rollback, parser=p)
    help_ = ("force start a job of the members' storage that a persistence restart refuses: "
             "delete its snapshots and its data in the storage slots, so that it starts empty")
    p = sub.add_parser("force-start", help=help_, description=help_ + (
        " (Job.force_start()). The job must not be running. Removes the job's folder of the "
        "store and its data in every slot under --storage-dir on this host that no running "
        "task holds, printing each path, and marks the store so that every later run has "
        "each member, on every host, empty its slot of the job's data from before; the job's "
        "execution and snapshot ids go on above the newest that data had seen."))
    p.add_argument("uri", help="the snapshot store: a directory, or s3://, hdfs://, gs:// ...")
    p.add_argument("--job", required=True,
                   help="the job's name (JobConfig.name), or its id (decimal or 0x hex)")
    p.add_argument("--storage-dir", default=None,
                   help="JobConfig.storage_dir of the job (default: SPARKJET_STORAGE_DIR, else "
                        "JobConfig's default)")
    p.add_argument("--no-transactional-outputs", action="store_true",
                   help="say that the job runs at-least-once, or has no transactional sink and "
                        "no acknowledging source (without it, refused when the store holds no "
                        "log of the job: under exactly-once those keep the job's old execution "
                        "and snapshot ids, which are then not known; Job.force_start() checks "
                        "the pipeline itself)")
    p.set_defaults(command="snapshots force-start", run=_force_start, parser=p)


def add_jobs_parser(commands) -> None:
    p = commands.add_parser(
        "jobs", help="the jobs in a snapshot store: name, state, last snapshot, exports",
        description="List the jobs in a sparkjet snapshot store (a local path, or any pyarrow.fs "
                    "URI; names and states are known for stores on a local or mounted path).")
    p.add_argument("uri", help="the store: a directory, or s3://, hdfs://, gs:// ...")
    p.set_defaults(command="jobs", run=_jobs)


def _jobs(args) -> int:
    import os

    # The job runtime loads only to describe a local job's run state.
    from sparkjet.runtime.lifecycle import job_info

    rows = [("job", "id", "state", "last snapshot", "taken", "exports")]
    local = "://" not in args.uri
    for job in SnapshotStore.jobs(args.uri, must_exist=True):
        info = job_info(os.path.join(args.uri, layout.job_dir(job))) if local else {}
        with SnapshotStore(args.uri, job, create=False) as store:
            snaps = store.snapshots()
        latest = [s for s in snaps if s.name is None]
        last = max(latest, key=lambda s: s.snapshot_id) if latest else None
        state = info.get("state", "-")
        if state == "failed" and info.get("error"):
            state = f"failed ({info['error'][:60]})"
        rows.append((info.get("name", "-"), f"{job:#x}", state,
                     "-" if last is None else str(last.snapshot_id),
                     "-" if last is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                           time.localtime(last.created)),
                     ", ".join(sorted(s.name for s in snaps if s.name)) or "-"))
    if len(rows) == 1:
        print(f"no sparkjet jobs under {args.uri}", file=sys.stderr)
        return 0
    _print_table(rows)
    return 0


def _job_id(text: str) -> int | str:
    """A job id (decimal or 0x hex), else a job's name (resolved against the store)."""
    try:
        return int(text, 0)
    except ValueError:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"not a job name or id: {text!r}") from None
        return text


def _named_job(args, name: str) -> int:
    """The id of the job called ``name`` in the store: the one its name derives (as
    JobConfig does), else, on a local path, the one whose JOB.json records the name (a job
    given an explicit job_id); a usage error when there is none."""
    import os

    # The runtime loads only to derive a job's id from its name and read its JOB.json.
    from sparkjet.runtime.config import JobConfig
    from sparkjet.runtime.lifecycle import job_name_of

    jobs = SnapshotStore.jobs(args.uri, must_exist=True)
    derived = JobConfig(name=name, processing_guarantee="none").id
    if derived in jobs:
        return derived
    names = {}
    if "://" not in args.uri:
        names = {j: job_name_of(os.path.join(args.uri, layout.job_dir(j))) for j in jobs}
        named = [j for j, n in names.items() if n == name]
        if len(named) == 1:
            return named[0]
    known = sorted(n for n in names.values() if n)
    args.parser.error(f"--job {name!r}: no job of that name or id in {args.uri} "
                      f"(its jobs: {', '.join(known) or 'none by name'})")
    raise AssertionError("unreachable")  # parser.error exits


def _stores(args) -> list[SnapshotStore]:
    if isinstance(args.job, str):
        args.job = _named_job(args, args.job)
    if args.job is not None:
        return [SnapshotStore(args.uri, args.job, create=False)]
    jobs = SnapshotStore.jobs(args.uri, must_exist=True)
    if not jobs:
        print(f"no sparkjet snapshots under {args.uri}", file=sys.stderr)
    return [SnapshotStore(args.uri, job, create=False) for job in jobs]


def _list(args) -> int:
    rows = [("job", "snapshot", "execution", "name", "chunks", "entries", "size", "created")]
    for store in _stores(args):
        for s in store.snapshots():
            rows.append((f"{s.job_id:#x}", str(s.snapshot_id), str(s.execution_id), s.name or "-",
                         f"{s.chunk_count:,}", f"{s.entries:,}", _size(s.bytes),
                         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.created))))
    _print_table(rows)
    return 0


def _show(args) -> int:
    for store in _stores(args):
        described = store.describe(name=args.name)
        latest = store.latest_complete() if args.name is None else None
        title = store.who + (f", export {args.name!r}" if args.name else
                                           f", snapshot {latest.snapshot_id}" if latest else "")
        print(title)
        rows = [("vertex", "partitions", "chunks", "entries", "size")]
        for vertex, parts in described.items():
            keyed = {p: v for p, v in parts.items() if p != -1}
            rows.append((vertex, f"{len(keyed)}" + (" + broadcast" if -1 in parts else ""),
                         f"{sum(v['chunks'] for v in parts.values()):,}",
                         f"{sum(v['entries'] for v in parts.values()):,}",
                         _size(sum(v['bytes'] for v in parts.values()))))
            if args.partitions:
                for p, v in parts.items():
                    rows.append((f"  {'broadcast' if p == -1 else p}", "", f"{v['chunks']:,}",
                                 f"{v['entries']:,}", _size(v["bytes"])))
        _print_table(rows)
    return 0


def _verify(args) -> int:
    failed = 0
    for store in _stores(args):
        label = store.who + (f" {args.name!r}" if args.name else "")
        line = ProgressLine(sys.stderr)
        start = time.monotonic()

        def progress(done: int, total: int, line=line, label=label, start=start) -> None:
            frac = done / total if total else 1.0
            rate = done / max(time.monotonic() - start, 1e-9)
            line.update(f"{label} {bar(frac)} {frac:6.1%} {_size(done)}/{_size(total)} "
                        f"{_size(rate)}/s", force=done == total)

        try:
            info = store.verify(name=args.name, progress=progress)
        except (SnapshotCorruptError, SnapshotIncompleteError) as e:
            line.close()
            print(f"{label}: FAILED: {e}")
            failed += 1
            continue
        line.close()
        away = store.unverifiable(name=args.name)
        print(f"{label}: snapshot {info.snapshot_id} ok: {info.chunk_count:,} chunks, "
              f"{info.entries:,} entries, {_size(info.bytes)}, " + (
                  "every checksum verified" if not away else
                  f"the store's files verified; {away:,} chunk files are in the members' "
                  f"storage slots (storage=\"members\"), not here: a restore checks them as it "
                  f"reads them"))
    return 1 if failed else 0


def _rollback(args) -> int:
    import fcntl
    import os

    store, = _stores(args)
    with store:
        lock = None
        if "://" not in args.uri:
            # the run lock (sparkjet.runtime.lifecycle.RunLock), held while a run goes on
            path = os.path.join(args.uri, layout.job_dir(store.job_id), layout.RUNNING)
            if os.path.exists(path):
                lock = os.open(path, os.O_RDWR)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(lock)
                    raise JobAlreadyRunningError(
                        f"{store.who} is running; stop it before rolling it back") from None
        try:
            replaced = store.rollback(args.to, reason="sparkjet snapshots rollback")
        finally:
            if lock is not None:
                os.close(lock)
    print(f"{store.who}: rolled back to snapshot {args.to}; "
          + (f"snapshots {replaced} set aside (no longer restorable). " if replaced else "")
          + f"The next run resumes from snapshot {args.to}: output its sinks committed after "
            f"it is written again.")
    return 0


def _force_start(args) -> int:
    # The job runtime loads only for this action (it deletes what the runtime keeps).
    from sparkjet.runtime.config import JobConfig
    from sparkjet.runtime.persistence import force_start

    try:
        job_id, name = int(args.job, 0), f"job {args.job}"
    except ValueError:
        job_id, name = None, args.job
    config = JobConfig(name=name, job_id=job_id, snapshot_store=args.uri, storage="members",
                       storage_dir=args.storage_dir)
    removed = force_start(config, without_transactions=args.no_transactional_outputs)
    for path in removed["store"] + removed["slots"]:
        print(f"removed {path}")
    for path in removed["held"]:
        print(f"held by a running task (emptied by the next execution): {path}")
    floor = removed["floor"]
    print(f"job {args.job!r}: force start: its next run starts empty, with execution and "
          f"snapshot ids above {floor['execution']} and {floor['snapshot']}; every member "
          f"holding the job's data from before empties its slot when it joins")
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _print_table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))
