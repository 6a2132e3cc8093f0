"""One run of a job at a time, and a finished job known as finished.

A job's snapshots live in its directory of the snapshot store (``job-<id>``, the id derived
from its name). Two runs of one job against one store would fence each other's executions
and both fail; so :class:`RunLock` makes a run hold an exclusive lock on
``job-<id>/RUNNING`` (``flock``: released by the kernel when the driver dies) for as long
as it runs, and a second run is refused at once with the first one's pid, host and start.

A run that ends well leaves ``job-<id>/FINISHED`` (when, and how many events): its sources
were read to the end and its output committed, so running it again would read nothing and
return as if it had worked. :func:`check_not_finished` refuses that with what to do instead.

Both need a file system with locks and the store as a local path (a local disk, or a shared
one such as NFS mounted on the driver); with a ``pyarrow.fs`` URI (HDFS, S3) there is no
lock and no marker, and running a job twice at once is the user's to avoid.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from sparkjet._fs import storage_error
from sparkjet.errors import (
    JobAlreadyRunningError,
    JobCancelledError,  # noqa: F401 (defined there; named here too)
    JobFinishedError,
    SnapshotStoreLostError,
)
from sparkjet.snapshot import layout


def _job_dir(config) -> Path | None:
    root = config.snapshot_store
    if root is None or "://" in str(root):
        return None
    return Path(root) / layout.job_dir(config.id)


class RunLock:
    """Held by one run of ``config``'s job while it runs (a context manager)."""

    def __init__(self, config):
        self.config = config
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        import fcntl

        d = _job_dir(self.config)
        if d is None:
            return self
        path = d / layout.RUNNING
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise storage_error("create", str(path), e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_json(path)
            os.close(fd)
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['since']))}"
                   if holder.get("since") else "another process")
            raise JobAlreadyRunningError(
                f"job {self.config.name!r} is already running against snapshot store "
                f"{self.config.snapshot_store!r} ({who}); two runs of one job would fence "
                f"each other. Wait for it, stop it, or give this run another name") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "since": time.time()}).encode())
        except OSError as e:
            os.close(fd)
            raise storage_error("write", str(path), e) from None
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)      # closing releases the lock
            self._fd = None


def check_not_finished(config) -> None:
    """Raises :class:`JobFinishedError` when ``config``'s job ran to its end before."""
    d = _job_dir(config)
    if d is None or not (d / layout.FINISHED).exists():
        return
    done = _read_json(d / layout.FINISHED)
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(done["at"]))
            if done.get("at") else "earlier")
    raise JobFinishedError(
        f"job {config.name!r} already ran to its end against snapshot store "
        f"{config.snapshot_store!r} ({when}, {done.get('events_in', '?')} events read in its "
        f"last run): its sources are exhausted and its output committed, so a rerun would "
        f"read nothing. Run it under another name (or another snapshot store) to process the "
        f"input again")


def record_state(config, state: str, **details) -> None:
    """Writes ``job-<id>/JOB.json``: the job's name and how its last run stands (running,
    finished, stopped, cancelled, failed), for ``sparkjet jobs``. A store that refuses it
    raises :class:`~sparkjet.errors.StorageError`, except for "failed": the run's own error,
    being raised, says more (a full store fails the run, then this record too)."""
    d = _job_dir(config)
    if d is None:
        return
    tmp = d / f".{layout.JOB_RECORD}.{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"name": config.name, "state": state, "at": time.time(),
                                   "guarantee": config.processing_guarantee, **details}))
        os.replace(tmp, d / layout.JOB_RECORD)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if state != "failed":
            raise storage_error("write", str(d / layout.JOB_RECORD), e) from None


def job_info(job_dir) -> dict:
    """What ``job-<id>/JOB.json`` says, with ``state`` "running" only while a run holds
    the lock (a driver that died mid-run leaves "running" in the file: "interrupted")."""
    import fcntl

    d = Path(job_dir)
    info = _read_json(d / layout.JOB_RECORD)
    lock = d / layout.RUNNING
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return {**info, "state": "running"}
        finally:
            os.close(fd)
    if info.get("state") == "running":
        info["state"] = "interrupted"
    return info


def job_name_of(job_dir) -> str | None:
    """The name ``job-<id>/JOB.json`` records (None: no such file, or no name in it)."""
    name = _read_json(Path(job_dir) / layout.JOB_RECORD).get("name")
    return name if isinstance(name, str) else None


def mark_finished(config, events_in: int) -> bool:
    """Records that ``config``'s job ran to its end; False when it cannot be recorded (a
    store given as a URI keeps no mark: a rerun is not refused)."""
    d = _job_dir(config)
    if d is None:
        return False
    tmp = d / f".FINISHED.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"at": time.time(), "events_in": events_in}))
        os.replace(tmp, d / layout.FINISHED)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, FileNotFoundError) and not d.is_dir():
            raise SnapshotStoreLostError(
                f"job {config.name!r} ran to its end, but its folder {d} in snapshot store "
                f"{config.snapshot_store} was deleted while it finished: its output is "
                f"committed, but nothing records that it finished, so a new run of this job "
                f"would start again from its first input") from None
        raise storage_error("write", str(d / layout.FINISHED), e) from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


__all__ = ["JobAlreadyRunningError", "JobCancelledError", "JobFinishedError", "RunLock",
           "check_not_finished", "job_info", "job_name_of", "mark_finished", "record_state"]
