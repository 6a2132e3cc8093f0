"""Every name in a snapshot store, in one place (the layout
:mod:`~sparkjet.snapshot.store` describes)::

    job-J/                         a job's directory (J: its id, 16 hex digits)
        JOB.json                   its name and run state (sparkjet.runtime.lifecycle)
        RUNNING, FINISHED          the run lock and the finished marker (lifecycle)
        log/000000000042.json      log events, by sequence number
        snapshots/S-eE/            snapshot S written by execution E (12 digits each)
            _validation-X.json     its validation record (X: the record's xxh3)
            _durable.json          with durable_tier="async": every chunk file of it is
                                   uploaded whole (written by the driver; see the store)
            VERTEX/W-C.chunks      chunks of writer W's C-th write
        exports/NAME/              an exported snapshot (+ _export.json; on object stores
            d-X/                   in a folder of its own that _export.json names)
        tables/DIGEST.arrow        a reference table version

Names beginning ``.tmp-`` are files being written; leftovers older than
:data:`STALE_TMP_SECONDS` are removed.
"""
from __future__ import annotations

import re

import xxhash

from sparkjet.errors import InvalidArgumentError
from sparkjet.snapshot.records import NAME_PATTERN

_NAME = re.compile(NAME_PATTERN)

JOB_RECORD = "JOB.json"
RUNNING = "RUNNING"
FINISHED = "FINISHED"
LOG, SNAPSHOTS, EXPORTS, TABLES = "log", "snapshots", "exports", "tables"
#: The folders of a job's directory, made when a store is created.
JOB_FOLDERS = (LOG, SNAPSHOTS, EXPORTS, TABLES)
EXPORT_RECORD = "_export.json"
#: The mark of a snapshot of the members' storage whose chunk files were all uploaded into
#: its folder of the store after its commit (``durable_tier="async"``): JSON naming the
#: record's xxh3; only then do those copies count (:meth:`SnapshotStore.mark_durable`).
DURABLE_MARK = "_durable.json"
TMP_PREFIX = ".tmp-"
#: A temporary file older than this (seconds) is a leftover of a writer that died.
STALE_TMP_SECONDS = 600

_JOB_DIR = re.compile(r"job-([0-9a-f]{16})")
_LOG_EVENT = re.compile(r"(\d{12})\.json")
_SNAPSHOT_DIR = re.compile(r"(\d{12})-e(\d{12})")
_DIGEST = re.compile(r"[0-9a-f]{32}")


def job_dir(job_id: int) -> str:
    """The directory of job ``job_id`` in a store."""
    return f"job-{job_id:016x}"


def job_id_of(name: str) -> int | None:
    """The job id a directory name stands for (None: not a job's directory)."""
    m = _JOB_DIR.fullmatch(name)
    return int(m.group(1), 16) if m else None


def log_event(seq: int) -> str:
    return f"{seq:012d}.json"


def log_sequence(name: str) -> int | None:
    """The sequence number of a log event's file name (None: not a log event)."""
    m = _LOG_EVENT.fullmatch(name)
    return int(m.group(1)) if m else None


def snapshot_dir(snapshot_id: int, execution_id: int) -> str:
    return f"{snapshot_id:012d}-e{execution_id:012d}"


def snapshot_of(name: str) -> tuple[int, int] | None:
    """(snapshot id, execution id) of a snapshot directory's name, or None."""
    m = _SNAPSHOT_DIR.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def validation_record(digest: str) -> str:
    return f"_validation-{digest}.json"


def chunk_file(writer: int, count: int) -> str:
    """The ``count``-th chunk file written by ``writer`` for one vertex."""
    return f"{writer}-{count}.chunks"


def is_table_digest(digest) -> bool:
    return isinstance(digest, str) and _DIGEST.fullmatch(digest) is not None


def table_file(digest: str) -> str:
    return f"{digest}.arrow"


def is_stale_tmp(name: str, age_seconds: float) -> bool:
    return name.startswith(TMP_PREFIX) and age_seconds > STALE_TMP_SECONDS


def is_name(name) -> bool:
    """Whether ``name`` is a safe path component for a vertex, export or table."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(what: str, name) -> None:
    """Refuses a vertex, export or table name that is not a safe path component."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(f"{what} must match {_NAME.pattern}, got {name!r}")


def content_digest(data) -> str:
    """The name of content-addressed bytes: their xxh3-128, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(memoryview(data))


__all__ = [
    "DURABLE_MARK",
    "EXPORTS",
    "EXPORT_RECORD",
    "FINISHED",
    "JOB_FOLDERS",
    "JOB_RECORD",
    "LOG",
    "RUNNING",
    "SNAPSHOTS",
    "STALE_TMP_SECONDS",
    "TABLES",
    "TMP_PREFIX",
    "check_name",
    "chunk_file",
    "content_digest",
    "is_name",
    "is_stale_tmp",
    "is_table_digest",
    "job_dir",
    "job_id_of",
    "log_event",
    "log_sequence",
    "snapshot_dir",
    "snapshot_of",
    "table_file",
    "validation_record",
]
