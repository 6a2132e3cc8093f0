"""The few filesystem operations snapshot storage needs, on local disks and on any
``pyarrow.fs`` filesystem.

The one that matters is :meth:`Backend.create_exclusive`: it makes a file appear whole or
not at all, and fails if the name exists, so of two writers racing for one name exactly one
wins. On a local disk it is a hard link of a complete temporary file (atomic, and refused by
the kernel when the name is taken). On HDFS a rename refuses to overwrite, which gives the
same guarantee. On S3 it is one ``PUT`` with ``If-None-Match: *`` (S3's conditional write,
sent through boto3, ``pip install sparkjet[s3]``: pyarrow cannot send the header), which S3
refuses with 412 Precondition Failed once the name exists. The boto3 client is built from
the pyarrow ``S3FileSystem``'s own settings (endpoint, scheme, region, keys, timeouts, CA
file, proxy); what pyarrow finds itself (no keys given) boto3 finds through the same chain
(environment, ``~/.aws``, instance role). Other object stores (GCS, filesystems through
fsspec) have no conditional create through the libraries sparkjet uses: there the
check-then-write leaves a window in which two writers racing for one name can both succeed,
and an exclusive create on such a store warns (``ObjectStoreRaceWarning``).

Whole-directory renames are copies on object stores, so commit decisions never rest on one
there: callers that rename on local disks and HDFS (snapshot exports, the file sink's
commits) decide by one exclusive create of a small record on object stores (see
:attr:`Backend.atomic_rename`).

Every failure of storage (a read-only or full filesystem, a file where a folder should be,
refused permission) raises :class:`~sparkjet.errors.StorageError`, naming the operation and
the path (:func:`storage_error`); ``FileNotFoundError`` and ``FileExistsError``, which
callers test for, keep their types.

Paths as the driver and Spark name them are here too: :func:`absolute` (a relative path is
the driver's), :func:`spark_names` and :func:`spark_path` (whether Spark reads a path under
pyarrow's name, and that name as Spark takes it), for the connectors and the Spark
integration alike.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import time
import urllib.parse
import uuid
import warnings
from pathlib import Path

import pyarrow.fs as pafs

from sparkjet.errors import (
    ConnectorError,
    InvalidArgumentError,
    ObjectStoreRaceWarning,  # noqa: F401 (defined there; named here too)
    StorageError,
)


def storage_error(operation: str, path: str, error: OSError) -> OSError:
    """``error``, raised by ``operation`` on ``path``, as the error to raise: a
    :class:`StorageError` naming both (the path the system names, where it says which:
    a parent that could not be made, say), unless it is one already, or a
    ``FileNotFoundError`` or ``FileExistsError`` (what callers test for; those name their
    path already)."""
    if isinstance(error, (StorageError, FileNotFoundError, FileExistsError)):
        return error
    where = error.filename if isinstance(error.filename, str) and error.filename else path
    reason = f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)
    return StorageError(operation, where, error.errno, reason)


def absolute(uri, filesystem=None) -> str:
    """``uri`` as the driver means it: a relative local path made absolute here, before a
    Spark worker (whose working directory is another) resolves it. URIs and paths on an
    explicit ``filesystem`` stay as they are."""
    text = os.fspath(uri)
    if filesystem is not None or "://" in text:
        return text
    return os.path.abspath(text)


def spark_names(path: str) -> bool:
    """Whether Spark reads ``path`` under the name pyarrow gave it (a local or mounted
    path, ``file://``, ``hdfs://``)."""
    return "://" not in path or path.startswith(("file://", "hdfs://"))


def spark_path(path: str) -> str:
    """``path`` as Spark names it: a local path explicitly on the local file system (a
    cluster's default file system may be HDFS)."""
    return f"file://{os.path.abspath(path)}" if "://" not in path else path


def _uri_identity(uri: str) -> str:
    """A store URI without what does not name the store: its query but for the endpoint
    (never credentials, which must not be written into slots), user info, a trailing
    slash."""
    parts = urllib.parse.urlsplit(uri)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    query = urllib.parse.parse_qs(parts.query)
    endpoint = query.get("endpoint_override", [""])[0]
    return (f"{parts.scheme}://{host}{parts.path.rstrip('/')}"
            + (f"?endpoint_override={endpoint}" if endpoint else ""))


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
        #: what tells this store apart from another: a local root's real path (a symlink
        #: to it is the same store), else the URI given (scheme and host with the path:
        #: two clusters' /stores are two stores)
        if self.local:
            self.identity = os.path.realpath(self.root)
        elif "://" in os.fspath(uri):
            self.identity = _uri_identity(os.fspath(uri))
        else:
            self.identity = f"{filesystem.type_name}:{self.root}"
        self.durable = durable
        kind = filesystem.type_name
        # Renames that refuse to overwrite, so a directory can be committed by renaming it.
        self.atomic_rename = self.local or kind == "hdfs"
        # S3's conditional put; its boto3 client is made at the first exclusive create, so
        # reading needs no boto3.
        self._s3 = kind == "s3"
        self._put_if_absent = None
        self.atomic_exclusive = self.atomic_rename or self._s3
        self._root_checked = False

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def makedirs(self, path: str) -> None:
        """Creates ``path`` and its missing parents; on a local disk each new directory is
        its owner's only (mode 0700: a job's state and output are nobody else's to read).
        On shared or object storage, access is the storage's permissions to set."""
        try:
            if self.local:
                if not self._root_checked:
                    check_owned(self.root)
                    self._root_checked = True
                private_dirs(path)
            else:
                self.fs.create_dir(path, recursive=True)
        except OSError as e:
            raise storage_error("create directory", path, e) from None

    def write(self, path: str, pieces) -> None:
        """Writes a file from byte pieces (fsynced on local disks when durable)."""
        out = self.open_write(path)
        try:
            out.write_all(pieces)
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
        try:
            if self.local:
                import pyarrow as pa

                size = os.path.getsize(path)
                if size == 0:
                    return b""
                return pa.memory_map(path, "r").read_buffer(size)
            with self.fs.open_input_file(path) as f:
                return f.read_buffer()
        except OSError as e:
            raise storage_error("read", path, e) from None

    def range_reader(self, path: str):
        """A function (offset, length) -> bytes of the file; on local disks a memory map,
        so only the pages of the ranges asked for are read."""
        if self.local:
            buf = self.read(path)
            return lambda offset, length: buf.slice(offset, length) if length else b""
        try:
            f = self.fs.open_input_file(path)
        except OSError as e:
            raise storage_error("read", path, e) from None

        def read_at(offset, length):
            try:
                return f.read_at(length, offset)
            except OSError as e:
                raise storage_error("read", path, e) from None
        return read_at

    def exists(self, path: str) -> bool:
        if self.local:
            return os.path.exists(path)
        return self._info(path).type != pafs.FileType.NotFound

    def is_dir(self, path: str) -> bool:
        if self.local:
            return os.path.isdir(path)
        return self._info(path).type == pafs.FileType.Directory

    def _info(self, path: str) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(path)
        except OSError as e:
            raise storage_error("look up", path, e) from None

    def listdir(self, path: str) -> list[str]:
        """Names in a directory ([] if it does not exist)."""
        try:
            if self.local:
                try:
                    return sorted(os.listdir(path))
                except FileNotFoundError:
                    return []
            infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except OSError as e:
            raise storage_error("list", path, e) from None
        return sorted(Path(i.path).name for i in infos)

    def listdir_stamped(self, path: str) -> list[tuple[str, tuple]]:
        """The names in a directory, sorted, each with (size, modification time): one
        listing (``scandir`` locally, one ``get_file_info`` otherwise); a file removed
        between the listing and its lookup is left out."""
        try:
            if self.local:
                out = []
                try:
                    entries = list(os.scandir(path))
                except FileNotFoundError:
                    return []
                for entry in entries:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    out.append((entry.name, (st.st_size, st.st_mtime_ns)))
                return sorted(out)
            infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except OSError as e:
            raise storage_error("list", path, e) from None
        return sorted((Path(i.path).name, (i.size, i.mtime_ns)) for i in infos)

    def size(self, path: str) -> int:
        if self.local:
            try:
                return os.path.getsize(path)
            except OSError as e:
                raise storage_error("look up", path, e) from None
        return self._info(path).size

    def mtime(self, path: str) -> float:
        if self.local:
            try:
                return os.path.getmtime(path)
            except OSError as e:
                raise storage_error("look up", path, e) from None
        info = self._info(path)
        return info.mtime.timestamp() if info.mtime else 0.0

    def remove_tree(self, path: str) -> None:
        if self.local:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        elif self.exists(path):
            try:
                self.fs.delete_dir(path)
            except FileNotFoundError:
                pass    # removed by another process since (object stores: a prefix)
            except OSError as e:
                raise storage_error("remove", path, e) from None

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
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                raise storage_error("sync directory", path, e) from None

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Makes `path` appear with `data`, whole, unless it exists: True if created."""
        if self._s3:
            if self._put_if_absent is None:
                self._put_if_absent = _S3PutIfAbsent.of(self.fs)
            return self._put_if_absent(path, bytes(data))
        directory = path.rsplit("/", 1)[0]
        tmp = f"{directory}/.tmp-{uuid.uuid4().hex}"
        try:
            self.write(tmp, [data])
        except StorageError as e:
            # named by the file it was to create, not the random temporary one: a retry that
            # fails the same way says the same (the restart policy compares the messages)
            raise StorageError("create", path, e.errno, e.reason) from None
        try:
            if self.local:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
                except OSError as e:
                    if e.errno == errno.EEXIST:
                        return False
                    raise storage_error("create", path, e) from None
                self.sync_dir(directory)
                return True
            if not self.atomic_rename:
                _warn_racy(self.fs.type_name)
            if self.exists(path):
                return False
            try:
                self.fs.move(tmp, path)
            except OSError as e:
                raise storage_error("create", path, e) from None
            return True
        finally:
            self.remove(tmp)

    def rename_dir(self, src: str, dst: str) -> None:
        """Renames a directory: one atomic rename on local disks (refused onto a folder
        that is not empty) and HDFS (refused onto an existing name); a copy of every object
        on object stores, where commits never rest on it (see :attr:`atomic_rename`)."""
        try:
            if self.local:
                os.rename(src, dst)
            else:
                self.fs.move(src, dst)
        except OSError as e:
            raise storage_error("rename", f"{src} to {dst}", e) from None

    def link_or_copy(self, src: str, dst: str) -> None:
        """A hard link on local disks (an export survives its source's cleanup), else a copy."""
        if self.local:
            try:
                os.link(src, dst)
                return
            except OSError:
                pass
        try:
            self.fs.copy_file(src, dst)
        except OSError as e:
            raise storage_error("copy", f"{src} to {dst}", e) from None


def _warn_racy(kind: str) -> None:
    # Python's default warning filter shows it once per calling line.
    warnings.warn(
        f"sparkjet: the {kind} filesystem has no conditional create here, so commit "
        "records are created by check-then-write: two committers racing for one name can "
        "both succeed (run one job execution at a time; S3 has none of this window)",
        ObjectStoreRaceWarning, stacklevel=3)


class _S3PutIfAbsent:
    """``PUT`` with ``If-None-Match: *`` through boto3, on the bucket and with the settings
    of a pyarrow S3FileSystem. One client per distinct setting (boto3 clients are
    thread-safe, and building one costs tens of milliseconds)."""

    _clients: dict = {}
    _lock = threading.Lock()
    # S3 answers 409 ConditionalRequestConflict to a put racing another one for the same
    # key (AWS asks clients to retry); a retry then gets 412 or succeeds.
    CONFLICT_RETRIES = 10

    def __init__(self, client):
        self.client = client

    @classmethod
    def of(cls, filesystem) -> _S3PutIfAbsent:
        options = filesystem.__reduce__()[1][0]
        key = repr(sorted(options.items(), key=lambda kv: kv[0]))
        with cls._lock:
            client = cls._clients.get(key)
            if client is None:
                client = cls._clients[key] = _boto3_client(options)
        return cls(client)

    def __call__(self, path: str, data: bytes) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _, key = path.partition("/")
        for attempt in range(self.CONFLICT_RETRIES + 1):
            try:
                self.client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                code = e.response.get("Error", {}).get("Code")
                if status == 412 or code == "PreconditionFailed":
                    # Taken. It may be by this very put, retried by botocore after its
                    # answer was lost: the same bytes there are this writer's own.
                    return self._holds(bucket, key, data)
                if (status == 409 or code == "ConditionalRequestConflict") \
                        and attempt < self.CONFLICT_RETRIES:
                    time.sleep(0.01 * (attempt + 1))
                    continue
                raise ConnectorError(f"s3: conditional put of {path} failed: {e}") from None
            except BotoCoreError as e:
                raise ConnectorError(f"s3: conditional put of {path} failed: {e}") from None
        raise AssertionError("unreachable")

    def _holds(self, bucket: str, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError:
            return False
        return body == data


def _boto3_client(options: dict):
    """A boto3 S3 client with a pyarrow S3FileSystem's settings (``__reduce__`` gives them)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise InvalidArgumentError(
            "s3: commits on S3 are conditional puts (If-None-Match), which need boto3: "
            "pip install 'sparkjet[s3]'") from None
    import botocore.session

    model = botocore.session.get_session().get_service_model("s3")
    if "IfNoneMatch" not in model.operation_model("PutObject").input_shape.members:
        raise InvalidArgumentError(
            f"s3: botocore {botocore.__version__} cannot send If-None-Match on PutObject; "
            "pip install 'boto3>=1.35.10'")
    if options.get("role_arn"):
        raise InvalidArgumentError(
            "s3: an S3FileSystem with role_arn is not supported for commits (boto3 would not "
            "assume the role); give the role to both through the environment (AWS_ROLE_ARN, "
            "AWS_PROFILE) instead")
    config = {"retries": {"mode": "standard"}, "s3": {"addressing_style": "virtual"
                                                      if options.get("force_virtual_addressing")
                                                      else "auto"}}
    if options.get("connect_timeout", -1) > 0:
        config["connect_timeout"] = options["connect_timeout"]
    if options.get("request_timeout", -1) > 0:
        config["read_timeout"] = options["request_timeout"]
    proxy = options.get("proxy_options") or {}
    if proxy.get("host"):
        auth = f"{proxy['username']}:{proxy['password']}@" if proxy.get("username") else ""
        port = f":{proxy['port']}" if proxy.get("port", -1) > 0 else ""
        config["proxies"] = {"http": f"{proxy['scheme'] or 'http'}://{auth}{proxy['host']}{port}",
                             "https": f"{proxy['scheme'] or 'http'}://{auth}{proxy['host']}{port}"}
    kwargs = {}
    endpoint = options.get("endpoint_override")
    if endpoint:
        kwargs["endpoint_url"] = endpoint if "://" in endpoint else \
            f"{options.get('scheme') or 'https'}://{endpoint}"
    elif options.get("scheme") == "http":
        kwargs["use_ssl"] = False
    if options.get("tls_ca_file_path"):
        kwargs["verify"] = options["tls_ca_file_path"]
    if options.get("anonymous"):
        from botocore import UNSIGNED

        config["signature_version"] = UNSIGNED
    elif options.get("access_key"):
        kwargs.update(aws_access_key_id=options["access_key"],
                      aws_secret_access_key=options["secret_key"],
                      aws_session_token=options.get("session_token") or None)
    return boto3.session.Session().client("s3", region_name=options.get("region") or None,
                                          config=Config(**config), **kwargs)


def _start_writeback():
    """``sync_file_range(fd, offset, count, SYNC_FILE_RANGE_WRITE)`` of Linux's C library:
    starts writing a file's dirty range to disk and returns at once; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _start_writeback()
#: The buffers one writev call takes (POSIX guarantees 16; Linux takes 1,024).
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16
_SYNC_FILE_RANGE_WRITE = 2


class StreamWriter:
    """One file being written (see :meth:`Backend.open_write`)."""

    # A durable local file's writeback is started every this many bytes while it is
    # written (sync_file_range, which does not wait: the disk writes while the next
    # chunks are encoded), so the fsync at close has little left to do. Where that call
    # is missing, the file is flushed with fdatasync instead (which waits).
    SYNC_EVERY = 4 << 20

    def __init__(self, backend: Backend, path: str):
        self.backend, self.path = backend, path
        self._unsynced = 0
        self._written = 0
        try:
            if backend.local:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            else:
                self._out = backend.fs.open_output_stream(path)
        except OSError as e:
            raise storage_error("create", path, e) from None

    def write(self, piece) -> None:
        """Writes one piece (:meth:`write_all`)."""
        self.write_all((piece,))

    def write_all(self, pieces) -> None:
        """Writes ``pieces`` in order: on a local disk in as few ``writev`` calls as the
        system takes buffers (a snapshot file's chunks are thousands of pieces, a header, a
        schema message and a payload each: one write per piece cost a system call each,
        and left the file in the page cache as small pages, which a restore's memory map
        then faults in 64 KB at a time); a durable file's writeback is started every
        :attr:`SYNC_EVERY` bytes. A failure raises the StorageError naming the file."""
        try:
            if not self.backend.local:
                for piece in pieces:
                    self._out.write(piece)
                return
            views = [v for v in (memoryview(p).cast("B") for p in pieces) if v.nbytes]
            at = 0
            while at < len(views):
                n = os.writev(self._fd, views[at:at + _IOV_MAX])
                self._unsynced += n
                while n:            # what a short write left goes again
                    if n >= views[at].nbytes:
                        n -= views[at].nbytes
                        at += 1
                    else:
                        views[at], n = views[at][n:], 0
            if self.backend.durable and self._unsynced >= self.SYNC_EVERY:
                self._flush()
        except OSError as e:
            raise storage_error("write", self.path, e) from None

    def _flush(self) -> None:
        if _SYNC_FILE_RANGE is None or _SYNC_FILE_RANGE(
                self._fd, self._written, self._unsynced, _SYNC_FILE_RANGE_WRITE) != 0:
            os.fdatasync(self._fd)     # (a file system that refuses the call)
        self._written += self._unsynced
        self._unsynced = 0

    def close(self) -> None:
        try:
            if self.backend.local:
                try:
                    if self.backend.durable:
                        os.fsync(self._fd)
                finally:
                    os.close(self._fd)
            else:
                self._out.close()
        except OSError as e:
            raise storage_error("write", self.path, e) from None

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
                raise NotADirectoryError(errno.ENOTDIR, "a file where a directory is expected",
                                         directory) from None


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
