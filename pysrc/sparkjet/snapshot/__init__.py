"""Snapshot storage: what a snapshot is on disk, and the one place it is read and written.

- :mod:`~sparkjet.snapshot.chunks`: keyed state as checksummed, partition-aligned chunks.
- :mod:`~sparkjet.snapshot.records`: the log events, validation and export records, as typed
  schemas; every metadata file read goes through them.
- :mod:`~sparkjet.snapshot.store`: :class:`SnapshotStore` (fenced, all-or-nothing commits,
  restore that trusts nothing) and :class:`SnapshotWriter`.
"""
from sparkjet.snapshot.store import Manifest, SnapshotInfo, SnapshotStore, SnapshotWriter

__all__ = ["Manifest", "SnapshotInfo", "SnapshotStore", "SnapshotWriter"]
