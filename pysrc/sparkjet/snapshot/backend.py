"""The one interface through which a snapshot store reaches its storage.

:class:`StorageBackend` is every operation :class:`~sparkjet.snapshot.store.SnapshotStore`
performs on storage, and nothing else: write a file (whole, or as a stream), read it (whole,
or by byte ranges), list a folder, create a file exclusively (the commit point: of two writers
racing for one name exactly one wins), link or copy, rename a folder, delete. Paths are
strings under :attr:`StorageBackend.root`, joined by :meth:`StorageBackend.path`; their names
come from :mod:`~sparkjet.snapshot.layout`.

:class:`FileSystemBackend` keeps a store on a local disk or any ``pyarrow.fs`` filesystem
(S3, GCS, HDFS; the operations and their guarantees are described in :mod:`sparkjet._fs`).
Another storage (the members' own storage slots, say) is a new subclass handed to
``SnapshotStore(backend, job_id)``: the store and its callers do not change.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from sparkjet._fs import Backend


class StorageBackend(ABC):
    """Files under one root. Attributes every backend sets:

    - ``root``: where the store is (for messages and :meth:`path`);
    - ``durable``: whether writes are made durable (fsync) before they return;
    - ``atomic_rename``: a folder renamed onto a missing name appears whole, and a rename
      onto an existing name is refused (so a folder can be committed by renaming it);
    - ``atomic_exclusive``: :meth:`create_exclusive` is atomic (where it is not, it warns).
    """

    root: str
    durable: bool
    atomic_rename: bool
    atomic_exclusive: bool

    @abstractmethod
    def path(self, *parts: str) -> str:
        """``parts`` joined under the root."""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Creates a folder and its missing parents (private to their owner where storage
        has owners)."""

    @abstractmethod
    def write(self, path: str, pieces: Iterable) -> None:
        """Writes a whole file from byte pieces."""

    @abstractmethod
    def open_write(self, path: str):
        """A file written piece by piece: ``write(piece)`` or ``write_all(pieces)`` (many
        in order, as few calls to the system as it can), then ``close()`` (durable) or
        ``abort()`` (removed)."""

    @abstractmethod
    def read(self, path: str):
        """A whole file, as a buffer."""

    @abstractmethod
    def range_reader(self, path: str) -> Callable[[int, int], object]:
        """A function ``(offset, length) -> bytes`` of a file."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def is_dir(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """The names in a folder, sorted ([] when it does not exist)."""

    def listdir_stamped(self, path: str) -> list[tuple[str, tuple]]:
        """The names in a folder, sorted, each with a stamp that changes when the file is
        rewritten (size and modification time): what a reader may cache by. This default
        looks each file up; a backend that lists with sizes and times in one call says so."""
        out = []
        for name in self.listdir(path):
            p = f"{path.rstrip('/')}/{name}"
            if self.exists(p):      # (removed since the listing: left out, as if listed later)
                out.append((name, (self.size(p), self.mtime(p))))
        return out

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def mtime(self, path: str) -> float:
        """When a file was last written (seconds since the epoch)."""

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Makes ``path`` appear with ``data``, whole, unless it exists: True if created."""

    @abstractmethod
    def link_or_copy(self, src: str, dst: str) -> None:
        """``dst`` with the bytes of ``src``, which stays valid if ``src`` is removed."""

    @abstractmethod
    def rename_dir(self, src: str, dst: str) -> None:
        """Renames a folder (atomically where :attr:`atomic_rename`)."""

    @abstractmethod
    def sync_dir(self, path: str) -> None:
        """Makes a folder's entries durable (where that means anything)."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Removes a file (nothing if it is gone)."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Removes a folder and everything in it (nothing if it is gone)."""


class FileSystemBackend(Backend, StorageBackend):
    """A store on a local disk (directories owner-only, fsync when durable) or on any
    ``pyarrow.fs`` filesystem."""


def open_backend(uri, filesystem=None, durable: bool = True) -> StorageBackend:
    """The backend of a store given by a URI or local path (or a ``pyarrow.fs`` filesystem
    and a path in it)."""
    return FileSystemBackend(uri, filesystem, durable)


__all__ = ["FileSystemBackend", "StorageBackend", "open_backend"]
