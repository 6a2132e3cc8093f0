"""Snapshot storage: what a snapshot is on disk, and the one place it is read and written.

- :mod:`~sparkjet.snapshot.chunks`: keyed state as checksummed, partition-aligned chunks.
- :mod:`~sparkjet.snapshot.records`: the log events, validation and export records, as typed
  schemas; every metadata file read goes through them.
- :mod:`~sparkjet.snapshot.store`: :class:`SnapshotStore` (the log as commit point and fence,
  all-or-nothing commits, exports, restore that trusts nothing).
- :mod:`~sparkjet.snapshot.writer`: :class:`SnapshotWriter`, one processor's share of a
  snapshot, and the :class:`Manifest` it hands to the commit.
- :mod:`~sparkjet.snapshot.layout`: every name in a store.
- :mod:`~sparkjet.snapshot.backend`: :class:`StorageBackend`, the one interface through which
  the store reaches storage, and the file-system backend.
"""
from sparkjet.snapshot.backend import FileSystemBackend, StorageBackend
from sparkjet.snapshot.store import SnapshotInfo, SnapshotStore
from sparkjet.snapshot.writer import Manifest, SnapshotWriter

__all__ = ["FileSystemBackend", "Manifest", "SnapshotInfo", "SnapshotStore", "SnapshotWriter",
           "StorageBackend"]
