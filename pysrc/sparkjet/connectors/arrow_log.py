"""A partitioned, append-only log of Arrow IPC segment files on a local directory:
replayable, and readable while it is being appended.

Layout::

    root/log.json                                  {"format": "sparkjet-arrow-log", "version": 1,
                                                    "partitions": N}
    root/log.lock                                  held (flock) by the one live writer
    root/partition-00003/segment-000000000000.arrows
    root/partition-00003/segment-000000000001.arrows

A segment is an Arrow IPC *stream*: the schema message, record batch messages, and, once
the segment is **sealed**, the end-of-stream marker. :class:`ArrowLogWriter` writes each
batch as one message and flushes it to the OS before ``append`` returns, so readers in
other processes see it at once. It rolls to the next segment when the current one passes
``segment_bytes``, creating the next segment *before* sealing the current one: a sealed
segment without a successor therefore means the partition is closed
(:meth:`ArrowLogWriter.close`), which is how a reader knows a bounded log has ended.

:class:`ArrowLogReader` frames messages itself (the IPC length prefix and the message's
``bodyLength``), so a trailing message that is still being written is recognised as
incomplete, not as an error: the reader returns None and retries from the same byte
later. A complete message that does not decode raises :class:`CorruptDataError` naming
the file and byte offset.

**Offsets** (per partition, in :meth:`ArrowLogReader.snapshot_state`)::

    {"offsets": {"3": {"segment": 0, "byte": 4096, "batch": 7, "row": 100}, ...}, "next": 3}

the next row to read is row ``row`` of the record batch whose message starts at byte
``byte`` of segment ``segment`` (its ``batch``-th record batch, for people and checkers;
``byte`` is what a restore seeks to). Segments are immutable once written, so an offset
stays valid as long as its segment exists. A restore that finds its segment missing, or
shorter than the offset's byte (the log deleted, truncated or recreated under the job),
raises :class:`~sparkjet.errors.SourceChangedError` instead of waiting or reading other
data; a log recreated with segments at least as long cannot be told from the old one.
``next`` is the partition whose turn is next, so that a replay repeats the same batches.
Partition keys are strings, so the state survives a JSON round trip; states of several
readers merge by uniting their ``offsets``.

Dictionary-encoded columns are not supported (a dictionary travels in messages of its
own, which the framing above does not replay). Local directories only.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

import pyarrow as pa
from msgspec import Meta

from sparkjet._checks import check_distinct_ints, check_int
from sparkjet._fs import Backend, storage_error
from sparkjet.connectors._settings import Path, PositiveInt, Schema, Settings
from sparkjet.connectors.base import ProcessorContext, Source, SourceReader
from sparkjet.errors import (
    CorruptDataError,
    InvalidArgumentError,
    LogLockedError,  # noqa: F401 (defined there; named here too)
    SourceChangedError,
    UnsupportedTypeError,
)

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
LOG_FORMAT = "sparkjet-arrow-log"
LOG_VERSION = 1

_CONTINUATION = 0xFFFFFFFF
_EOS = struct.pack("<Ii", _CONTINUATION, 0)
_PREFIX = 8
# A sanity bound on one message's metadata: a larger length prefix means garbage.
_MAX_METADATA = 1 << 30


def partition_dir(root, partition: int) -> str:
    """The directory of one partition of the log at ``root``."""
    return os.path.join(os.fspath(root), f"partition-{partition:05d}")


def segment_path(root, partition: int, segment: int) -> str:
    """The file of one segment of one partition of the log at ``root``."""
    return os.path.join(partition_dir(root, partition), f"segment-{segment:012d}.arrows")


def read_log_info(root) -> dict:
    """The contents of ``root/log.json``, checked."""
    path = os.path.join(os.fspath(root), "log.json")
    try:
        with open(path, "rb") as f:
            info = json.loads(f.read())
    except FileNotFoundError:
        raise InvalidArgumentError(f"{root} is not an Arrow log: it has no log.json") from None
    except ValueError as e:
        raise CorruptDataError(f"{path}: not valid JSON ({e})") from None
    if (not isinstance(info, dict) or info.get("format") != LOG_FORMAT
            or info.get("version") != LOG_VERSION
            or not isinstance(info.get("partitions"), int) or info["partitions"] < 1):
        raise CorruptDataError(
            f"{path}: expected {{'format': {LOG_FORMAT!r}, 'version': {LOG_VERSION}, "
            f"'partitions': N}}, got {info!r}")
    return info


@dataclass(frozen=True)
class ArrowLogWriterSettings(Settings):
    """:class:`ArrowLogWriter`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    root: Path
    partitions: Annotated[int, Meta(ge=1, le=99999)]
    schema: Schema
    segment_bytes: PositiveInt = DEFAULT_SEGMENT_BYTES
    durable: bool = False

    def check(self) -> None:
        _check_no_dictionary(self.schema)
        self._derive("root", os.path.abspath(self.root))


class ArrowLogWriter:
    """Appends record batches to the partitions of a log (creating it if needed).

    Opening an existing log continues it: a last segment left unsealed by a writer that
    died is cut back to its last complete message and appended to; a sealed (closed)
    log gets new segments, so readers see it open again. One writer at a time (a file
    lock, released by the kernel if the writer dies). ``durable=True`` fsyncs every
    append. Not thread-safe: share it between threads behind a lock.

    >>> with ArrowLogWriter(tmp, 2, pa.schema([("x", pa.int64())])) as log:  # doctest: +SKIP
    ...     log.append(0, pa.record_batch([pa.array([1, 2])], names=["x"]))
    """

    def __init__(self, root, partitions: int, schema: pa.Schema,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, durable: bool = False):
        ArrowLogWriterSettings.of(locals()).apply(self)
        self._backend = Backend(self.root, durable=self.durable)  # directory syncs, atomic creates
        self._schema_bytes = schema.serialize().to_pybytes()
        self._fds: dict[int, int] = {}
        self._segments: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        with _storage("create directory", self.root):
            os.makedirs(self.root, exist_ok=True)
            self._lock_fd = _lock(os.path.join(self.root, "log.lock"))
        try:
            self._init_info()
            for p in range(partitions):
                self._open_partition(p)
        except BaseException:
            self._release()
            raise

    def append(self, partition: int, batch: pa.RecordBatch | pa.Table) -> None:
        """Appends ``batch`` (a RecordBatch, or a Table's batches) to ``partition``;
        visible to readers when this returns. Rows of zero-row batches carry nothing and
        are not written."""
        if self._lock_fd is None:
            raise InvalidArgumentError(f"the writer of {self.root} is closed")
        partition = check_int("partition", partition, min=0, max=self.partitions - 1)
        if isinstance(batch, pa.Table):
            batches = batch.to_batches()
        elif isinstance(batch, pa.RecordBatch):
            batches = [batch]
        else:
            raise InvalidArgumentError(
                f"append takes a RecordBatch or Table, got {type(batch).__name__}")
        if not batch.schema.equals(self.schema):
            raise InvalidArgumentError(
                f"batch schema does not match the log's:\n{batch.schema}\nexpected:\n{self.schema}")
        for b in batches:
            if b.num_rows:
                self._write(partition, b.serialize())

    def end_positions(self) -> dict[int, tuple[int, int]]:
        """Where the next append to each partition will start: ``{partition: (segment,
        byte)}``, a position a reader can seek to (the offset's ``segment`` and ``byte``)."""
        return {p: (self._segments[p], self._sizes[p]) for p in range(self.partitions)}

    def close(self, seal: bool = True) -> None:
        """Seals the last segment of every partition (readers of a closed log reach its
        end) and releases the log. ``seal=False`` only releases it: readers keep waiting
        for more, and the next writer continues the same segments. Idempotent."""
        if self._lock_fd is None:
            return
        try:
            for p, fd in list(self._fds.items()):
                with _storage("seal", segment_path(self.root, p, self._segments[p])):
                    if seal:
                        _write_all(fd, _EOS)
                    if self.durable:
                        os.fsync(fd)
                os.close(fd)
                del self._fds[p]
        finally:
            self._release()

    def __enter__(self) -> ArrowLogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ArrowLogWriter({self.root!r}, {self.partitions}, segment_bytes="
                f"{self.segment_bytes})")

    def _write(self, partition: int, message) -> None:
        fd = self._fds[partition]
        with _storage("append to", segment_path(self.root, partition, self._segments[partition])):
            _write_all(fd, message)
            if self.durable:
                os.fsync(fd)
        self._sizes[partition] += message.size
        if self._sizes[partition] >= self.segment_bytes:
            self._roll(partition)

    def _roll(self, partition: int) -> None:
        # The successor exists before the seal, so no reader ever sees a sealed last
        # segment (which would mean "closed") while the writer is still going.
        old, segment = self._fds[partition], self._segments[partition]
        self._new_segment(partition, segment + 1)
        with _storage("seal", segment_path(self.root, partition, segment)):
            _write_all(old, _EOS)
            if self.durable:
                os.fsync(old)
        os.close(old)

    def _new_segment(self, partition: int, segment: int) -> None:
        path = segment_path(self.root, partition, segment)
        with _storage("create", path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            try:
                _write_all(fd, self._schema_bytes)
                if self.durable:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
        if self.durable:
            # The new name must survive a crash before the previous segment's seal does:
            # a sealed segment with no successor means "closed" to readers.
            self._backend.sync_dir(partition_dir(self.root, partition))
        self._fds[partition] = fd
        self._segments[partition] = segment
        self._sizes[partition] = len(self._schema_bytes)

    def _open_partition(self, p: int) -> None:
        directory = partition_dir(self.root, p)
        with _storage("create directory", directory):
            os.makedirs(directory, exist_ok=True)
        segments = _list_segments(directory)
        if not segments:
            self._new_segment(p, 0)
            return
        if len(segments) > 1:
            self._seal_orphan(segment_path(self.root, p, segments[-2]))
        last = segments[-1]
        path = segment_path(self.root, p, last)
        with open(path, "rb") as f:
            schema, end, sealed = _scan(f.fileno(), path)
        if schema is not None and not schema.equals(self.schema):
            raise InvalidArgumentError(
                f"{path} holds schema\n{schema}\nbut the writer was given\n{self.schema}")
        if sealed:
            self._new_segment(p, last + 1)
            return
        with _storage("continue", path):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            # Cut a half-written message left by a writer that died: no reader has
            # consumed it (readers never return incomplete messages), so nothing seen is
            # lost.
            os.truncate(path, end)
            if self.durable:
                os.fsync(fd)
            if schema is None:
                _write_all(fd, self._schema_bytes)
                end = len(self._schema_bytes)
        self._fds[p] = fd
        self._segments[p] = last
        self._sizes[p] = end

    def _seal_orphan(self, path: str) -> None:
        # A writer that died while rolling left the successor created and this segment
        # unsealed; readers would wait on it forever.
        with open(path, "rb") as f:
            _, end, sealed = _scan(f.fileno(), path)
        if not sealed:
            with _storage("seal", path):
                os.truncate(path, end)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)
                try:
                    _write_all(fd, (b"" if end else self._schema_bytes) + _EOS)
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)

    def _init_info(self) -> None:
        path = os.path.join(self.root, "log.json")
        if os.path.exists(path):
            info = read_log_info(self.root)
            if info["partitions"] != self.partitions:
                raise InvalidArgumentError(
                    f"{self.root} has {info['partitions']} partitions, the writer was given "
                    f"{self.partitions}")
            return
        info = {"format": LOG_FORMAT, "version": LOG_VERSION, "partitions": self.partitions}
        # Appears whole or not at all (and durably, when durable); the writer lock is held.
        self._backend.create_exclusive(path, json.dumps(info).encode())

    def _release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass(frozen=True)
class ArrowLogSourceSettings(Settings):
    """:class:`ArrowLogSource`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    root: Path

    def check(self) -> None:
        self._derive("root", os.path.abspath(self.root))


class ArrowLogSource(Source):
    """The log at ``root`` as a replayable source: one source partition per log
    partition. Bounded once the writer closes the log, unbounded until then."""

    name = "arrow-log"
    replayable = True
    acknowledging = False

    def __init__(self, root):
        ArrowLogSourceSettings.of(locals()).apply(self)
        self._partitions: int | None = None

    def partition_count(self) -> int:
        if self._partitions is None:
            self._partitions = read_log_info(self.root)["partitions"]
        return self._partitions

    def open(self, partitions: list[int], context: ProcessorContext) -> ArrowLogReader:
        return ArrowLogReader(self.root, partitions, self.partition_count())

    def __repr__(self) -> str:
        return f"ArrowLogSource({self.root!r})"


class ArrowLogReader(SourceReader):
    """Reads some partitions of an Arrow log, taking turns between them."""

    def __init__(self, root: str, partitions: list[int], partition_count: int):
        # May be empty: a processor without partitions is at its end.
        parts = check_distinct_ints("partitions", partitions, min=0, max=partition_count - 1)
        self._root = root
        self._cursors = [_Cursor(root, p) for p in parts]
        self._turn = 0

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        """The next rows (at most ``max_rows``) of one partition, the next in turn that
        has complete data; None if none has any right now."""
        check_int("max_rows", max_rows, min=1)
        n = len(self._cursors)
        for step in range(n):
            batch = self._cursors[(self._turn + step) % n].read(max_rows)
            if batch is not None:
                self._turn = (self._turn + step + 1) % n
                return batch
        return None

    def at_end(self) -> bool:
        """True once every partition's last segment is sealed and read, with no
        successor: the writer closed the log."""
        return all(c.at_end() for c in self._cursors)

    def snapshot_state(self) -> dict:
        return {"offsets": {str(c.partition): c.offset() for c in self._cursors},
                "next": self._cursors[self._turn].partition if self._cursors else None}

    def restore_state(self, state: dict | None) -> None:
        """Seeks every partition of this reader to its offset in ``state`` (None: to the
        start). ``state`` may hold more partitions but must hold all of ours."""
        if state is None:
            for c in self._cursors:
                c.seek(None)
            self._turn = 0
            return
        saved = state.get("offsets") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise InvalidArgumentError(
                f"an Arrow log state is {{'offsets': {{partition: offset}}}}, got {state!r}")
        offsets = []
        for c in self._cursors:
            offset = saved.get(str(c.partition), saved.get(c.partition))
            if offset is None:
                raise InvalidArgumentError(
                    f"the state has no offset for log partition {c.partition}")
            offsets.append(_check_offset(c.partition, offset))
        for c, offset in zip(self._cursors, offsets):
            c.seek(offset)
        # Whose turn it was, so that a replay repeats the original batches exactly.
        parts = [c.partition for c in self._cursors]
        self._turn = parts.index(state.get("next")) if state.get("next") in parts else 0

    def close(self) -> None:
        for c in self._cursors:
            c.close()


class _Cursor:
    """The read position in one partition: a segment, the byte of its next message, and
    a partly returned batch."""

    def __init__(self, root: str, partition: int):
        self.root = root
        self.partition = partition
        self._fd: int | None = None
        self.seek(None)

    def seek(self, offset: dict | None) -> None:
        self.close()
        offset = offset or {"segment": 0, "byte": 0, "batch": 0, "row": 0}
        self._segment = offset["segment"]
        self._pos = offset["byte"]
        self._batch = offset["batch"]
        self._schema: pa.Schema | None = None
        self._pending: pa.RecordBatch | None = None
        self._pending_pos = 0
        self._row = 0
        self._sealed = False
        # Applied after the segment's schema has been read (it is needed to decode).
        self._skip_rows = offset["row"]

    def offset(self) -> dict:
        if self._pending is not None:
            return {"segment": self._segment, "byte": self._pending_pos, "batch": self._batch,
                    "row": self._row}
        return {"segment": self._segment, "byte": self._pos, "batch": self._batch,
                "row": self._skip_rows}

    def at_end(self) -> bool:
        return (self._sealed and self._pending is None
                and not os.path.exists(segment_path(self.root, self.partition, self._segment + 1)))

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        while self._pending is None:
            if not self._advance():
                return None
        start = self._row
        out = self._pending.slice(start, max_rows)
        self._row = start + out.num_rows
        if self._row >= self._pending.num_rows:
            self._pending = None
            self._row = 0
            self._batch += 1
        return out

    def _advance(self) -> bool:
        """Moves past the next message (decoding a record batch into ``_pending``); False
        if there is none complete yet."""
        if self._sealed:
            if not os.path.exists(segment_path(self.root, self.partition, self._segment + 1)):
                return False
            self.close()
            self._segment += 1
            self._pos = self._batch = 0
            self._schema = None
            self._sealed = False
        if self._fd is None:
            try:
                self._fd = os.open(segment_path(self.root, self.partition, self._segment),
                                   os.O_RDONLY)
            except FileNotFoundError:
                if self._segment == 0 and self._pos == 0:
                    return False  # the writer has not created the partition yet
                raise SourceChangedError(
                    f"{segment_path(self.root, self.partition, self._segment)}: the segment "
                    "an offset points into is missing: the log was deleted or recreated "
                    "under the job") from None
            size = os.fstat(self._fd).st_size
            if size < self._pos:
                # Segments only grow, and an offset is always at a complete message.
                raise SourceChangedError(
                    f"{segment_path(self.root, self.partition, self._segment)}: the segment "
                    f"holds {size} bytes, fewer than the offset's byte {self._pos}: it was "
                    "truncated, or the log recreated, under the job")
        path = segment_path(self.root, self.partition, self._segment)
        if self._schema is None:
            # Always read from byte 0: a restored offset points past the schema.
            found = _read_message(self._fd, 0, path)
            if found is None:
                return False
            message, end = found
            if message is _SEALED or message.type != "schema":
                raise CorruptDataError(f"{path}: a segment must start with a schema message", 0)
            self._schema = pa.ipc.read_schema(message)
            self._pos = max(self._pos, end)
        found = _read_message(self._fd, self._pos, path)
        if found is None:
            return False
        message, end = found
        if message is _SEALED:
            self._sealed = True  # the next call moves on to the successor, if any
            return True
        if message.type != "record batch":
            raise CorruptDataError(
                f"{path}: unexpected {message.type} message at byte {self._pos} (a log holds "
                "record batches only)", self._pos)
        try:
            batch = pa.ipc.read_record_batch(message, self._schema)
        except (pa.ArrowInvalid, pa.ArrowIOError) as e:
            raise CorruptDataError(f"{path}: bad record batch at byte {self._pos}: {e}",
                                   self._pos) from None
        skip, self._skip_rows = self._skip_rows, 0
        if skip > batch.num_rows:
            raise CorruptDataError(
                f"{path}: the offset's row {skip} is beyond the {batch.num_rows} rows of the "
                f"batch at byte {self._pos}", self._pos)
        self._pending_pos, self._pos = self._pos, end
        if skip == batch.num_rows:
            self._batch += 1
            return True
        self._pending, self._row = batch, skip
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_SEALED = object()


def _read_message(fd: int, pos: int, path: str):
    """The message at byte ``pos`` and the byte after it: (pyarrow Message or _SEALED,
    end), or None if it is not completely written yet."""
    prefix = os.pread(fd, _PREFIX, pos)
    if len(prefix) < _PREFIX:
        return None
    continuation, length = struct.unpack("<Ii", prefix)
    if continuation != _CONTINUATION or not 0 <= length <= _MAX_METADATA:
        raise CorruptDataError(f"{path}: no IPC message at byte {pos} (bad length prefix)", pos)
    if length == 0:
        return _SEALED, pos + _PREFIX
    metadata = os.pread(fd, length, pos + _PREFIX)
    if len(metadata) < length:
        return None
    body = _body_length(metadata, path, pos)
    total = _PREFIX + length + body
    # One aligned Arrow buffer for the whole message: the batch's columns point into it.
    buf = pa.allocate_buffer(total)
    view = memoryview(buf)
    got = 0
    while got < total:
        n = os.preadv(fd, [view[got:]], pos + got)
        if n == 0:
            return None
        got += n
    try:
        message = pa.ipc.read_message(buf)
    except (pa.ArrowInvalid, pa.ArrowIOError, EOFError) as e:
        raise CorruptDataError(f"{path}: bad IPC message at byte {pos}: {e}", pos) from None
    return message, pos + total


def _body_length(metadata: bytes, path: str, pos: int) -> int:
    """``bodyLength`` of a flatbuffer ``org.apache.arrow.flatbuf.Message`` (field 3)."""
    try:
        table = struct.unpack_from("<I", metadata, 0)[0]
        vtable = table - struct.unpack_from("<i", metadata, table)[0]
        vsize = struct.unpack_from("<H", metadata, vtable)[0]
        field = struct.unpack_from("<H", metadata, vtable + 10)[0] if vsize > 10 else 0
        body = struct.unpack_from("<q", metadata, table + field)[0] if field else 0
    except struct.error:
        body = -1
    if body < 0:
        raise CorruptDataError(f"{path}: bad IPC message metadata at byte {pos}", pos)
    return body


def _scan(fd: int, path: str) -> tuple[pa.Schema | None, int, bool]:
    """A segment's schema (None if not completely written), the byte after its last
    complete message, and whether it is sealed; reads only prefixes and metadata."""
    found = _read_message(fd, 0, path) if os.fstat(fd).st_size else None
    if found is None:
        return None, 0, False
    message, pos = found
    if message is _SEALED or message.type != "schema":
        raise CorruptDataError(f"{path}: a segment must start with a schema message", 0)
    schema = pa.ipc.read_schema(message)
    while True:
        prefix = os.pread(fd, _PREFIX, pos)
        if len(prefix) < _PREFIX:
            return schema, pos, False
        continuation, length = struct.unpack("<Ii", prefix)
        if continuation != _CONTINUATION or not 0 <= length <= _MAX_METADATA:
            raise CorruptDataError(f"{path}: no IPC message at byte {pos} (bad length prefix)",
                                   pos)
        if length == 0:
            return schema, pos, True
        metadata = os.pread(fd, length, pos + _PREFIX)
        if len(metadata) < length:
            return schema, pos, False
        end = pos + _PREFIX + length + _body_length(metadata, path, pos)
        if end > os.fstat(fd).st_size:
            return schema, pos, False
        pos = end


def _list_segments(directory: str) -> list[int]:
    out = []
    for name in os.listdir(directory):
        if name.startswith("segment-") and name.endswith(".arrows"):
            try:
                out.append(int(name[len("segment-"):-len(".arrows")]))
            except ValueError:
                continue
    return sorted(out)


def _check_offset(partition: int, offset) -> dict:
    fields = ("segment", "byte", "batch", "row")
    if not isinstance(offset, dict) or not all(k in offset for k in fields):
        raise InvalidArgumentError(
            f"offset of log partition {partition} must be {{'segment', 'byte', 'batch', 'row'}}"
            f" with ints >= 0, got {offset!r}")
    return {**offset, **{k: check_int(f"{k!r} of the offset of log partition {partition}",
                                      offset[k], min=0) for k in fields}}


def _check_no_dictionary(schema: pa.Schema) -> None:
    def walk(name, t):
        if pa.types.is_dictionary(t):
            raise UnsupportedTypeError(
                f"column {name!r} is dictionary-encoded ({t}): an Arrow log does not store "
                "dictionaries; decode it first (e.g. with .cast(value_type))")
        for i in range(t.num_fields):
            walk(f"{name}.{t.field(i).name}", t.field(i).type)
    for field in schema:
        walk(field.name, field.type)


def _lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LogLockedError(
                f"{os.path.dirname(path)} is held by another writer (lock {path})") from None
        raise
    return fd


@contextmanager
def _storage(operation: str, path: str):
    """The OS errors of ``operation`` on ``path`` as a StorageError naming both (a
    read-only or full disk, refused permission)."""
    try:
        yield
    except OSError as e:
        error = storage_error(operation, path, e)
        if error is e:
            raise
        raise error from e


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]
