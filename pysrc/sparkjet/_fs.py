"""The few filesystem operations snapshot storage needs, on local disks and on any
``pyarrow.fs`` filesystem.

The one that matters is :meth:`Backend.create_exclusive`: it makes a file appear whole or
not at all, and fails if the name exists. On a local disk it is a hard link of a complete
temporary file (atomic, and refused by the kernel when the name is taken). On HDFS a
rename refuses to overwrite, which gives the same guarantee. Plain object stores (S3, GCS)
have no such primitive through pyarrow: there the check-then-write leaves a window in which
two writers racing for the same name can both succeed; sparkjet says so rather than hide it.
"""
from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import pyarrow.fs as pafs

from sparkjet.errors import InvalidArgumentError


def absolute(uri, filesystem=None) -> str:
    """``uri`` as the driver means it: a relative local path made absolute here, before a
    Spark worker (whose working directory is another) resolves it. URIs and paths on an
    explicit ``filesystem`` stay as they are."""
    text = os.fspath(uri)
    if filesystem is not None or "://" in text:
        return text
    return os.path.abspath(text)


class Backend:
    """Local (os) or pyarrow.fs file operations under one root."""

    def __init__(self, uri, filesystem: pafs.FileSystem | None = None, durable: bool = True):
        if filesystem is None:
            text = os.fspath(uri)
            if "://" in text:
                try:
                    filesystem, root = pafs.FileSystem.from_uri(text)
                except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid, ArrowIOError
                    raise InvalidArgumentError(f"cannot open {text!r}: {e}") from None
            else:
                filesystem, root = pafs.LocalFileSystem(), os.path.abspath(text)
        else:
            root = os.fspath(uri)
        self.fs = filesystem
        self.local = isinstance(filesystem, pafs.LocalFileSystem)
        self.root = root.rstrip("/") or "/"
        self.durable = durable
        self.atomic_exclusive = self.local or filesystem.type_name == "hdfs"
        self._root_checked = False

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def makedirs(self, path: str) -> None:
        """Creates ``path`` and its missing parents; on a local disk each new directory is
        its owner's only (mode 0700: a job's state and output are nobody else's to read).
        On shared or object storage, access is the storage's permissions to set."""
        if self.local:
            if not self._root_checked:
                check_owned(self.root)
                self._root_checked = True
            private_dirs(path)
        else:
            self.fs.create_dir(path, recursive=True)

    def write(self, path: str, pieces) -> None:
        """Writes a file from byte pieces (fsynced on local disks when durable)."""
        out = self.open_write(path)
        try:
            for piece in pieces:
                out.write(piece)
        except BaseException:
            out.abort()
            raise
        out.close()

    def open_write(self, path: str) -> StreamWriter:
        """A file written piece by piece; ``close()`` makes it durable (fsync on local
        disks when durable), ``abort()`` removes it."""
        return StreamWriter(self, path)

    def read(self, path: str):
        """The whole file, as a buffer (memory-mapped on local disks)."""
        if self.local:
            import pyarrow as pa

            size = os.path.getsize(path)
            if size == 0:
                return b""
            return pa.memory_map(path, "r").read_buffer(size)
        with self.fs.open_input_file(path) as f:
            return f.read_buffer()

    def range_reader(self, path: str):
        """A function (offset, length) -> bytes of the file; on local disks a memory map,
        so only the pages of the ranges asked for are read."""
        if self.local:
            buf = self.read(path)
            return lambda offset, length: buf.slice(offset, length) if length else b""
        f = self.fs.open_input_file(path)
        return lambda offset, length: f.read_at(length, offset)

    def exists(self, path: str) -> bool:
        if self.local:
            return os.path.exists(path)
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def is_dir(self, path: str) -> bool:
        if self.local:
            return os.path.isdir(path)
        return self.fs.get_file_info(path).type == pafs.FileType.Directory

    def listdir(self, path: str) -> list[str]:
        """Names in a directory ([] if it does not exist)."""
        if self.local:
            try:
                return sorted(os.listdir(path))
            except FileNotFoundError:
                return []
        infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(Path(i.path).name for i in infos)

    def size(self, path: str) -> int:
        if self.local:
            return os.path.getsize(path)
        return self.fs.get_file_info(path).size

    def mtime(self, path: str) -> float:
        if self.local:
            return os.path.getmtime(path)
        info = self.fs.get_file_info(path)
        return info.mtime.timestamp() if info.mtime else 0.0

    def remove_tree(self, path: str) -> None:
        if self.local:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        elif self.exists(path):
            self.fs.delete_dir(path)

    def remove(self, path: str) -> None:
        try:
            if self.local:
                os.unlink(path)
            else:
                self.fs.delete_file(path)
        except (FileNotFoundError, OSError):
            pass

    def sync_dir(self, path: str) -> None:
        """Makes a directory's entries durable (local disks only; a no-op elsewhere)."""
        if self.local and self.durable:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Makes `path` appear with `data`, whole, unless it exists: True if created."""
        directory = path.rsplit("/", 1)[0]
        tmp = f"{directory}/.tmp-{uuid.uuid4().hex}"
        self.write(tmp, [data])
        try:
            if self.local:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
                except OSError as e:
                    if e.errno == errno.EEXIST:
                        return False
                    raise
                self.sync_dir(directory)
                return True
            if self.exists(path):
                return False
            self.fs.move(tmp, path)
            return True
        finally:
            self.remove(tmp)

    def link_or_copy(self, src: str, dst: str) -> None:
        """A hard link on local disks (an export survives its source's cleanup), else a copy."""
        if self.local:
            try:
                os.link(src, dst)
                return
            except OSError:
                pass
        self.fs.copy_file(src, dst)


class StreamWriter:
    """One file being written (see :meth:`Backend.open_write`)."""

    # A durable local file is flushed every this many bytes while it is written, so the
    # fsync at close has little left to do (and the writing thread overlaps the flushing).
    SYNC_EVERY = 16 << 20

    def __init__(self, backend: Backend, path: str):
        self.backend, self.path = backend, path
        self._unsynced = 0
        if backend.local:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            self._out = backend.fs.open_output_stream(path)

    def write(self, piece) -> None:
        if self.backend.local:
            view = memoryview(piece).cast("B")
            self._unsynced += len(view)
            while view:
                view = view[os.write(self._fd, view):]
            if self.backend.durable and self._unsynced >= self.SYNC_EVERY:
                os.fdatasync(self._fd)
                self._unsynced = 0
        else:
            self._out.write(piece)

    def close(self) -> None:
        if self.backend.local:
            try:
                if self.backend.durable:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
        else:
            self._out.close()

    def abort(self) -> None:
        try:
            if self.backend.local:
                os.close(self._fd)
            else:
                self._out.close()
        except OSError:
            pass
        self.backend.remove(self.path)


def private_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, every directory it creates with mode 0700
    (``os.makedirs`` gives the mode to the last one only)."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise


def check_owned(path: str) -> None:
    """Refuses an existing directory of another user as the root of a store or sink
    (made first in a shared place such as /tmp, or a link to one): a job's state and
    output must not land where someone else controls the permissions."""
    try:
        owner = os.stat(path).st_uid
    except FileNotFoundError:
        return
    if owner != os.geteuid():
        raise InvalidArgumentError(
            f"{path} belongs to user {owner}, not to this process's user {os.geteuid()}: "
            "a snapshot store or sink directory must be its owner's")
