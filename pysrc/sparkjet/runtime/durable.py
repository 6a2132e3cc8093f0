"""The asynchronous durable tier (``JobConfig.durable_tier="async"``, members' storage).

With ``"sync"`` every chunk file a processor writes into its slot is copied into
``snapshot_store`` before the snapshot's acknowledgement. With ``"async"`` the snapshot is
acknowledged and committed from the slots alone, and each member uploads its files of a
committed snapshot in the background (:class:`DurableUploader`, started by phase 2): one
upload at a time per member, and at most one more waiting; a newer snapshot's upload takes
the place of a waiting one that has not begun (that snapshot is *superseded*: its durable
copy is never complete). Each member reports its upload to the driver (``uploaded``);
once every member of the execution has, the driver checks each file of the record is in
the store at its size and writes the snapshot's mark
(:meth:`~sparkjet.snapshot.store.SnapshotStore.mark_durable`, a ``durable`` progress
event with the bytes and how many snapshots behind the newest commit it was): only then do
the copies count, for a restore whose slots are lost, for an export and for an
``initial_snapshot`` taken from one. A graceful end (the terminal snapshot) waits for its
upload, so a finished or stopped job's last snapshot has its durable copy.

**Retention** keeps what the uploads need however long they take: each member's phase-1
acknowledgement names the snapshots it may upload before its next commit
(:meth:`~sparkjet.runtime.member.Member.may_upload`: the one uploading, the one waiting,
those acknowledged whose commit it has not run yet); the driver's commit pins them
(``SnapshotStore.commit(pinned=...)``), so that neither the store (its folder with the
partial copy, its commit event) nor the slots (the files it copies from:
:func:`~sparkjet.runtime.storage.keep_committed`, which also keeps the member's own
:attr:`DurableUploader.pending`) drop them while the upload runs, besides the last
``retained_snapshots``. The store and the slots also keep the newest snapshot marked
durable until a newer one is marked, so a restore that needs a durable copy always has one
(on a state that takes longer to upload than a snapshot interval, the marked one lags
behind the newest by the uploads superseded meanwhile).

**Restore** (issue 24 item 4; :func:`async_start`, on the driver once the members joined):
a restore may fall back only to a durable copy *of the snapshot it restores*. When the
newest committed snapshot has partitions no joined slot holds and its durable copy is not
complete, exactly-once refuses (:class:`~sparkjet.errors.RecoveryRefusedError` naming
vertices, partitions, slots and hosts): an older snapshot would replay an epoch phase 2
committed. At-least-once restores the newest older snapshot the store keeps that is
reachable (slots or complete durable copy), with a rollback event in the log, and reports
the replay window (the snapshot ids given up) in a ``fallback`` progress event and a
warning.
"""
from __future__ import annotations

import logging
import threading

from sparkjet.errors import RecoveryRefusedError, SnapshotCorruptError, SnapshotIncompleteError
from sparkjet.runtime.restore import handed_start
from sparkjet.runtime.storage import describe_unreachable, unreachable
from sparkjet.snapshot import layout

_log = logging.getLogger("sparkjet.job")

#: Bytes per piece of an upload.
PIECE = 4 << 20


class DurableUploader:
    """A member's background uploads of its committed snapshots' chunk files from its slot
    into ``snapshot_store`` (the members' storage with ``durable_tier="async"``).

    :param slot: the member's storage slot (the files are read from its copy).
    :param link: the member's :class:`~sparkjet.runtime.storage.SlotWriterLink`, whose
        backend is the store's (the one write a member makes there; it needs no log).
    :param report: called with each upload's report (a dict: ``snapshot``, ``execution``,
        ``files``, ``bytes``, ``superseded``, or ``error``), on the uploader's thread.
    """

    def __init__(self, slot, link, report):
        self.slot, self.link, self.report = slot, link, report
        self._cv = threading.Condition()
        self._waiting: tuple | None = None      # (snapshot id, execution id, files)
        self._busy: int | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        #: snapshot ids whose upload a newer one took the place of before it began
        self.superseded: list[int] = []
        self.uploaded_bytes = 0
        #: called on the uploader's thread before each piece it copies, with the snapshot
        #: id, the file's path and the piece's offset (a test holds an upload there)
        self.before_piece = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sparkjet-durable-upload",
                                        daemon=True)
        self._thread.start()

    def submit(self, snapshot_id: int, execution_id: int, files: list[dict]) -> None:
        """Queues the upload of committed snapshot ``snapshot_id``'s ``files`` (manifest
        entries of this member's writers); a waiting one that has not begun is superseded."""
        with self._cv:
            if self._waiting is not None:
                self.superseded.append(self._waiting[0])
            self._waiting = (snapshot_id, execution_id, list(files))
            self._cv.notify_all()

    @property
    def pending(self) -> list[int]:
        """The snapshot ids being uploaded or waiting."""
        with self._cv:
            return [s for s in (self._busy, self._waiting and self._waiting[0])
                    if s is not None]

    def drain(self, timeout: float) -> bool:
        """Waits until nothing is uploading or waiting (at most ``timeout`` s); whether so."""
        with self._cv:
            return self._cv.wait_for(lambda: self._waiting is None and self._busy is None,
                                     timeout)

    def give_up(self, execution_id: int, reason: str) -> list[int]:
        """Reports every upload still running or waiting as failed (``reason``), so that
        the driver says so; returns their snapshot ids. The running one stops at its next
        piece once :meth:`close` is called."""
        pending = self.pending
        for sid in pending:
            try:
                self.report({"snapshot": sid, "execution": execution_id, "superseded": [],
                             "error": reason})
            except Exception as e:  # noqa: BLE001 - the driver is gone already
                _log.info("could not report the unfinished upload of snapshot %d: %s", sid, e)
        return pending

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._waiting is not None)
                if self._closed:
                    return
                snapshot_id, execution_id, files = self._waiting
                self._waiting, self._busy = None, snapshot_id
                superseded, self.superseded = self.superseded, []
            try:
                done = self.upload(snapshot_id, execution_id, files)
                info = {"snapshot": snapshot_id, "execution": execution_id,
                        "files": len(done), "bytes": sum(n for _, n in done)}
            except Exception as e:  # noqa: BLE001 - the copy is incomplete; the job goes on
                error = f"{type(e).__name__}: {e}"
                if self._retired(snapshot_id, execution_id):
                    error = (f"snapshot {snapshot_id}'s files left this member's slot "
                             f"({self.slot.path}) while they were uploaded: retention keeps "
                             "a snapshot under upload, so they were removed from outside "
                             "(the slot's folder wiped, or its job data given up) "
                             f"({error})")
                _log.warning("the upload of snapshot %d into snapshot_store failed (%s): "
                             "its durable copy is not complete", snapshot_id, error)
                info = {"snapshot": snapshot_id, "execution": execution_id, "error": error}
            info["superseded"] = superseded
            try:
                self.report(info)
            except Exception as e:  # noqa: BLE001 - the driver is gone: nothing to tell
                _log.info("could not report the upload of snapshot %d: %s", snapshot_id, e)
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()

    def _retired(self, snapshot_id: int, execution_id: int) -> bool:
        """Whether the slot no longer holds the snapshot (removed while it was uploaded)."""
        try:
            source = self.slot.replicas(self.link.job_id)
            return not source.exists(source.path(
                layout.SNAPSHOTS, layout.snapshot_dir(snapshot_id, execution_id)))
        except Exception:  # noqa: BLE001 - the slot itself is gone: the first error says so
            return False

    def upload(self, snapshot_id: int, execution_id: int,
               files: list[dict]) -> list[tuple[str, int]]:
        """Copies each file from the slot into the snapshot's folder of the store, 4 MiB at
        a time, and checks each copy's size once it is closed (every chunk's checksum is
        checked as a restore reads it); returns (path, bytes) of each."""
        source = self.slot.replicas(self.link.job_id)
        store = self.link._backend
        directory = layout.snapshot_dir(snapshot_id, execution_id)
        done, folders = [], set()
        for f in files:
            vertex, name = f["path"].split("/", 1)
            size = int(f["bytes"])
            read = source.range_reader(source.path(layout.SNAPSHOTS, directory, vertex, name))
            folder = self.link._path(layout.SNAPSHOTS, directory, vertex)
            if folder not in folders:
                store.makedirs(folder)
                folders.add(folder)
            target = f"{folder}/{name}"
            out = store.open_write(target)
            try:
                for offset in range(0, size, PIECE):
                    if self.before_piece is not None:
                        self.before_piece(snapshot_id, f["path"], offset)
                    if self._closed:    # the member ended: nothing written after it
                        raise RuntimeError(f"the upload of snapshot {snapshot_id} was "
                                           "stopped: its member's execution ended")
                    out.write(read(offset, min(PIECE, size - offset)))
            except BaseException:
                out.abort()
                raise
            out.close()
            got = store.size(target)
            if got != size:
                raise SnapshotCorruptError(target, min(got, size), "file size",
                                           f"{got} bytes uploaded, the record says {size}")
            done.append((f["path"], size))
            self.uploaded_bytes += size
        for folder in folders:
            store.sync_dir(folder)
        return done


def async_start(config, store, start: dict | None, slots: list[str], execution: int,
                progress) -> dict | None:
    """The driver's check of what an execution starts from, once its members joined with
    ``slots`` (their uuids), with ``durable_tier="async"`` (see the module doc): ``start``
    (the join answer's, :func:`~sparkjet.runtime.restore.handed_start`) when every partition
    of its snapshot is reachable (a joined slot, or a complete durable copy); under
    at-least-once the newest older snapshot that is, after a rollback to it (reported: a
    ``fallback`` event, and the start's ``fallback``, which ``JobResult.fallbacks`` lists);
    else RecoveryRefusedError."""
    if start is None or start.get("export") is not None or start.get("initial"):
        return start
    newest = int(start["snapshot"])
    held = set(slots)
    stored = store._resolve(newest, None)
    lost = unreachable(stored, held)
    if lost is None:
        return start
    what = describe_unreachable(stored, lost)
    head = (f"job {config.name!r}: the newest committed snapshot {newest} lacks {what}, and "
            f"the durable copy of snapshot {newest} in snapshot_store was not complete "
            f"(durable_tier=\"async\": its upload had not ended, failed, or was superseded)")
    if config.processing_guarantee == "exactly-once":
        raise RecoveryRefusedError(
            f"{head}. Under exactly-once no older snapshot is restored in its place: phase 2 "
            f"of snapshot {newest} committed output and acknowledgements past it, which an "
            f"older one would replay. Bring those slots back and run again, run with "
            f"processing_guarantee=\"at-least-once\" to accept the replay, or run with "
            f"durable_tier=\"sync\" or more backups (backup_count) to survive this loss")
    older = [s.snapshot_id for s in store.complete() if s.snapshot_id < newest]
    unusable = []      # older snapshots reachable but whose durable copy failed its check
    for candidate in reversed(older):
        if unreachable(store._resolve(candidate, None), held) is not None:
            continue
        try:      # the rollback verifies the copy: a damaged one is passed over, named
            replaced = store.rollback(candidate, execution_id=execution,
                                      reason=f"durable_tier=async: snapshot {newest} "
                                             "incomplete")
            break
        except (SnapshotCorruptError, SnapshotIncompleteError) as e:
            unusable.append(f"snapshot {candidate}: {e}")
    else:
        raise RecoveryRefusedError(
            f"{head}; no older snapshot the store keeps ({older or 'none'}) is reachable "
            f"either{' whole' if unusable else ''}"
            f"{(' (' + '; '.join(unusable) + ')') if unusable else ''}. Bring those slots "
            f"back and run again, or run with durable_tier=\"sync\" or more backups "
            f"(backup_count)")
    # the window is every snapshot after the candidate up to the newest: the store may keep
    # a marked snapshot older than the retained ones, whose commits in between it dropped
    # (so the rollback does not list them)
    replayed = sorted(set(replaced) | set(range(candidate + 1, newest + 1)))
    message = (f"{head}; at-least-once restores snapshot {candidate} instead: the output "
               f"and acknowledgements of snapshot(s) {_ids(replayed)} are replayed (the "
               f"replay window, from snapshot {candidate})")
    _log.warning("%s", message, extra={"job": config.name, "execution": execution,
                                       "member": "-"})
    fallback = {"to": candidate,
                "unusable": [f"snapshot {newest}: {what}; its durable copy was not complete"],
                "replaced": list(replaced), "replayed": replayed, "explicit": False}
    progress({"event": "fallback", "execution": execution, **fallback, "message": message})
    _, _, handed = handed_start(config, store, candidate)
    # the execution's record keeps it (JobResult.fallbacks), as a fallback the driver
    # decides before the execution
    return {**handed, "fallback": fallback}


def _ids(ids: list[int]) -> str:
    """``ids`` for a message: a run of consecutive ones as its ends."""
    if len(ids) > 2 and ids[-1] - ids[0] == len(ids) - 1:
        return f"{ids[0]}-{ids[-1]}"
    return str(ids)


__all__ = ["DurableUploader", "async_start"]
