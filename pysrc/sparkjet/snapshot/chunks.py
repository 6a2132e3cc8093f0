"""Keyed state to snapshot chunks and back.

State is split by the Hazelcast partition of its key into chunks of bounded size, each a
64-byte header and a payload; the format is described once, in
``native/include/sparkjet/chunk.h``. Two kinds of state:

- **Tables** (Arrow key and value columns): the payload is an Arrow IPC stream holding the
  chunk's rows. ``codec="blosc2-lz4"`` (the default) keeps the schema message as is and
  stores the record batch message as one Blosc2 chunk, its bytes shuffled by 8 (the first
  byte of every 8-byte value, then the second...) and compressed with lz4: Arrow pads every
  buffer to 8 bytes, so the high bytes of int64 keys and counts and the exponents of
  doubles fall together and compress. On a count+sum state of 5M rows that compresses
  about 3x faster than ``codec="lz4"``, decompresses about a third faster and stores a
  quarter less (``bench/README.md``, store vs IPC).
  ``codec="lz4"`` compresses each buffer with Arrow's own lz4 codec; ``codec="raw"`` stores
  the stream as is. A table with dictionary columns is written with ``"lz4"`` under
  ``"blosc2-lz4"`` (a dictionary travels in a message of its own).
- **Entries** (opaque bytes per key, e.g. pickled Python state): the payload is a list of
  length-prefixed key and value bytes; ``codec="lz4"`` and ``"blosc2-lz4"`` compress it
  with ``lz4.block``. A key's partition is that of a Hazelcast ``byte[]`` holding it.

*Broadcast* state (restored to every processor of a vertex) is written with partition -1
and the broadcast flag. Every chunk carries an xxh3-64 checksum of its stored payload, and
its header a checksum of its own; :func:`read_chunks` trusts nothing it reads.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import lz4.block
import msgspec
import numpy as np
import pyarrow as pa
import xxhash

from sparkjet import _native
from sparkjet._batches import copy_fixed, fixed_width, group_rows
from sparkjet.errors import InvalidArgumentError, SnapshotCorruptError
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT, partition_ids

DEFAULT_CHUNK_SIZE = 128 * 1024
HEADER_SIZE = _native.CHUNK_HEADER_SIZE
CODECS = ("blosc2-lz4", "lz4", "raw")
_MAX_PAYLOAD = 2**32 - 1


class ChunkHeader(msgspec.Struct, frozen=True, gc=False):
    """The fields of a chunk header (see native/include/sparkjet/chunk.h). A struct made
    in C (a restore of 5M rows makes 1,084 of them: about 0.1 us each, a frozen dataclass
    1.1 us); ints only, so the garbage collector need not track it."""

    codec: int
    flags: int
    job_id: int
    snapshot_id: int
    vertex: int
    partition: int
    entry_count: int
    uncompressed_size: int
    stored_size: int
    checksum: int

    @property
    def broadcast(self) -> bool:
        return bool(self.flags & _native.FLAG_BROADCAST)

    @property
    def entries(self) -> bool:
        return bool(self.flags & _native.FLAG_ENTRIES)


@dataclass(frozen=True)
class Chunk:
    """One encoded chunk: its header bytes and its payload pieces (written back to back;
    kept apart so that large payloads are never copied just to be framed)."""

    header: ChunkHeader
    header_bytes: bytes
    pieces: tuple

    @property
    def nbytes(self) -> int:
        return HEADER_SIZE + self.header.stored_size

    def to_bytes(self) -> bytes:
        return self.header_bytes + b"".join(bytes(p) for p in self.pieces)


class ChunkEncoder:
    """Encodes one vertex's state for one snapshot of one job.

    >>> enc = ChunkEncoder(job_id=7, snapshot_id=0, vertex=1)
    >>> chunks = enc.table(pa.table({"k": [1, 2, 3], "v": [1.0, 2.0, 3.0]}), key="k")
    >>> sorted(c.header.partition for c in chunks) == sorted(partition_ids(pa.array([1, 2, 3])).to_pylist())
    True
    """

    def __init__(
        self,
        job_id: int,
        snapshot_id: int,
        vertex: int,
        *,
        partition_count: int = DEFAULT_PARTITION_COUNT,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        codec: str = "blosc2-lz4",
    ):
        if codec not in CODECS:
            raise InvalidArgumentError(f"codec must be one of {CODECS}, got {codec!r}")
        if not isinstance(chunk_size, int) or not 1 <= chunk_size <= 2**31:
            raise InvalidArgumentError(f"chunk_size must be 1..2**31 bytes, got {chunk_size!r}")
        if not 0 <= job_id < 2**64 or not -(2**63) <= snapshot_id < 2**63 or not 0 <= vertex < 2**32:
            raise InvalidArgumentError(
                f"job_id, snapshot_id or vertex out of range: {job_id}, {snapshot_id}, {vertex}"
            )
        self.job_id = job_id
        self.snapshot_id = snapshot_id
        self.vertex = vertex
        self.partition_count = partition_count
        self.chunk_size = chunk_size
        self.codec = codec

    def __repr__(self) -> str:
        return (f"ChunkEncoder(job_id={self.job_id}, snapshot_id={self.snapshot_id}, "
                f"vertex={self.vertex}, partition_count={self.partition_count}, "
                f"chunk_size={self.chunk_size}, codec={self.codec!r})")

    # -- tables ------------------------------------------------------------------------

    def table(self, table: pa.Table | pa.RecordBatch, key, *, key_type=None) -> list[Chunk]:
        """Chunks of a table of keyed state, partitioned by ``key`` (a column name or a
        list of them); rows of one partition keep their order."""
        return list(self.iter_table(table, key, key_type=key_type))

    def iter_table(self, table: pa.Table | pa.RecordBatch, key, *, key_type=None,
                   alloc=None, group_later: bool = False) -> Iterable[Chunk]:
        """:meth:`table` as it goes, in partition order: bad input raises here, at the call;
        chunks are then encoded a run of a few MB at a time (a writer can store each as it
        comes). The rows are grouped by partition at the call, into buffers of their own
        (from ``alloc``, as :func:`~sparkjet._batches.group_rows` takes it): ``table``
        may change once this returns. ``group_later``: the call takes a plain copy instead
        (:func:`~sparkjet._batches.copy_fixed`, when its columns allow), and the rows are
        grouped as the first chunk is asked for (on a writer's I/O thread, not the
        caller's). No rows: an empty tuple, else a generator of at least one chunk that has
        encoded none yet."""
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if table.num_rows == 0:
            return ()
        pids = partition_ids(table, self.partition_count, key=key, key_type=key_type)
        copy = copy_fixed(table, alloc) if group_later else None
        if copy is not None:
            return self._grouped_chunks(copy, _ids(pids), alloc)
        ordered, starts = group_rows(table, _ids(pids), self.partition_count, alloc)
        return self._partition_chunks(ordered, starts)

    def _grouped_chunks(self, batch: pa.RecordBatch, ids: np.ndarray, alloc) -> Iterator[Chunk]:
        ordered, starts = group_rows(batch, ids, self.partition_count, alloc)
        del batch, ids      # (the copy is not needed once grouped)
        yield from self._partition_chunks(ordered, starts)

    def _partition_chunks(self, ordered: pa.RecordBatch, starts: np.ndarray) -> Iterator[Chunk]:
        """The chunks of ``ordered``, its rows grouped by partition (partition p's from
        ``starts[p]`` to ``starts[p + 1]``), in partition order."""
        sizes = np.diff(starts)
        filled = np.flatnonzero(sizes)
        parts = zip((ordered.slice(s, n) for s, n in zip(starts[filled].tolist(),
                                                         sizes[filled].tolist())),
                    filled.tolist())
        return self._table_chunks(parts, ordered.schema, 0, row_bytes=_row_bytes(ordered))

    def broadcast_table(self, table: pa.Table | pa.RecordBatch) -> list[Chunk]:
        """Chunks of state that every processor of the vertex restores."""
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if table.num_rows == 0:
            return []
        batch = table.combine_chunks().to_batches()[0]
        return list(self._table_chunks([(batch, -1)], batch.schema, _native.FLAG_BROADCAST,
                                       kept=True))

    def _table_chunks(self, parts, schema: pa.Schema, flags: int, kept: bool = False,
                      row_bytes: int | None = None) -> Iterator[Chunk]:
        """The chunks of ``parts``, (record batch, partition) pairs of one schema, in their
        order. With ``blosc2-lz4`` the record batch messages of up to :data:`_RUN_BYTES` are
        compressed together, in one call that holds no GIL (:meth:`_blosc2_run`), then
        framed: a snapshot's processor shares its cores with the encoding thread, which
        should ask for the GIL once per run, not once per chunk. ``kept``: the chunks are
        held (a broadcast table's), so their payloads are trimmed to their size.
        ``row_bytes``: the bytes of every row, when the schema makes them all the same
        (:func:`_row_bytes`): a part's size is then its rows times that, not asked of each
        part (a sliced batch's ``nbytes`` costs microseconds, and a snapshot's table has a
        part for each of up to 271 partitions)."""
        schema_message = schema.serialize()
        # A dictionary travels in a message of its own, which batch.serialize() leaves out:
        # such a batch is written as a whole IPC stream.
        dictionaries = _has_dictionary(schema)
        run: list[tuple] = []       # (message, rows, partition) waiting to be compressed
        held = 0
        for part, partition in parts:
            for batch in self._cuts(part, row_bytes):
                if self.codec == "blosc2-lz4" and not dictionaries:
                    message = batch.serialize()
                    if message.size <= _BLOSC2_MAX:
                        run.append((message, batch.num_rows, partition))
                        held += message.size
                        if held >= _RUN_BYTES:
                            yield from self._blosc2_run(run, flags, schema_message, kept)
                            run, held = [], 0
                        continue
                    if run:         # (chunks keep their order)
                        yield from self._blosc2_run(run, flags, schema_message, kept)
                        run, held = [], 0
                    payload = _ipc_stream(batch, _LZ4_OPTIONS)
                    yield self._frame(_native.CODEC_ARROW_LZ4, flags, partition, batch.num_rows,
                                      payload.size, (payload,))
                elif self.codec == "raw" and dictionaries:
                    payload = _ipc_stream(batch, _RAW_OPTIONS)
                    yield self._frame(_native.CODEC_RAW, flags, partition, batch.num_rows,
                                      payload.size, (payload,))
                elif self.codec == "raw":
                    message = batch.serialize()
                    size = schema_message.size + message.size
                    yield self._frame(_native.CODEC_RAW, flags, partition, batch.num_rows, size,
                                      (schema_message, message))
                else:
                    payload = _ipc_stream(batch, _LZ4_OPTIONS)
                    yield self._frame(_native.CODEC_ARROW_LZ4, flags, partition, batch.num_rows,
                                      payload.size, (payload,))
        if run:
            yield from self._blosc2_run(run, flags, schema_message, kept)

    def _cuts(self, part: pa.RecordBatch,
              row_bytes: int | None = None) -> Iterator[pa.RecordBatch]:
        """``part`` in pieces of about ``chunk_size`` bytes, by its average row size (or
        ``row_bytes``, every row's): an oversized row still gets a piece of its own."""
        rows = part.num_rows
        size = part.nbytes if row_bytes is None else rows * row_bytes
        pieces = max(1, math.ceil(size / self.chunk_size))
        if pieces == 1:
            yield part
            return
        step = max(1, math.ceil(rows / pieces))
        for start in range(0, rows, step):
            yield part.slice(start, step)

    def _blosc2_run(self, run: list[tuple], flags: int, schema_message: pa.Buffer,
                    kept: bool) -> Iterator[Chunk]:
        """Blosc2 chunks of ``run``'s record batch messages, ``(message, rows, partition)``:
        compressed together (:func:`_blosc2_many`), then framed, each checksummed after the
        schema message's digest, computed once."""
        packed = _blosc2_many([m for m, _, _ in run], kept)
        base = xxhash.xxh3_64(schema_message)
        head = schema_message.size
        for (message, rows, partition), piece in zip(run, packed):
            digest = base.copy()
            digest.update(piece)
            yield self._framed(_native.CODEC_BLOSC2_LZ4, flags, partition, rows,
                               head + message.size, (schema_message, piece),
                               digest.intdigest(), head + _size(piece))

    # -- entries -----------------------------------------------------------------------

    def entries(self, keys, values) -> list[Chunk]:
        """Chunks of opaque key/value bytes (binary Arrow arrays or lists of bytes),
        partitioned by each key as a Hazelcast byte[]."""
        return list(self.iter_entries(keys, values))

    def iter_entries(self, keys, values) -> Iterable[Chunk]:
        """:meth:`entries` as it goes, in partition order (bad input raises at the call); an
        empty tuple when there are no entries."""
        keys, values = _binary(keys, "keys"), _binary(values, "values")
        if len(keys) != len(values):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
        if len(keys) == 0:
            return ()
        pids = partition_ids(keys, self.partition_count)
        starts, perm = _scatter(pids, self.partition_count, with_perm=True)
        sizes = np.empty(len(keys), np.int64)
        kd, vd = _binary_desc(keys), _binary_desc(values)
        _native.entries_sizes(kd, vd, sizes)

        def chunks():
            for p in np.flatnonzero(np.diff(starts)):
                rows = perm[starts[p] : starts[p + 1]]
                yield from self._entry_chunks(kd, vd, rows, sizes[rows], int(p), _native.FLAG_ENTRIES)

        return chunks()

    def broadcast_entries(self, keys, values) -> list[Chunk]:
        """Entries that every processor of the vertex restores."""
        keys, values = _binary(keys, "keys"), _binary(values, "values")
        if len(keys) != len(values):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
        if len(keys) == 0:
            return []
        sizes = np.empty(len(keys), np.int64)
        kd, vd = _binary_desc(keys), _binary_desc(values)
        _native.entries_sizes(kd, vd, sizes)
        rows = np.arange(len(keys), dtype=np.int64)
        flags = _native.FLAG_ENTRIES | _native.FLAG_BROADCAST
        return list(self._entry_chunks(kd, vd, rows, sizes, -1, flags))

    def _entry_chunks(self, kd, vd, rows, sizes, partition, flags) -> Iterator[Chunk]:
        # Greedy cut: a chunk ends before the entry that would push it past chunk_size,
        # so an entry larger than chunk_size gets a chunk of its own.
        ends = np.cumsum(sizes)
        start, base = 0, 0
        while start < len(rows):
            stop = int(np.searchsorted(ends, base + self.chunk_size, side="right"))
            stop = max(stop, start + 1)
            size = int(ends[stop - 1] - base)
            if size > _MAX_PAYLOAD:
                raise InvalidArgumentError(f"an entry of {size} bytes exceeds the 4 GiB chunk limit")
            buf = bytearray(size)
            part_rows = np.ascontiguousarray(rows[start:stop])
            written = _native.entries_encode(kd, vd, part_rows, buf)
            assert written == size
            if self.codec == "raw":
                yield self._frame(_native.CODEC_RAW, flags, partition, stop - start, size, (buf,))
            else:
                packed = lz4.block.compress(buf, store_size=False)
                yield self._frame(_native.CODEC_LZ4, flags, partition, stop - start, size, (packed,))
            base = int(ends[stop - 1])
            start = stop

    def _frame(self, codec, flags, partition, count, uncompressed, pieces) -> Chunk:
        digest = xxhash.xxh3_64()
        for p in pieces:
            digest.update(p)
        return self._framed(codec, flags, partition, count, uncompressed, pieces,
                            digest.intdigest())

    def _framed(self, codec, flags, partition, count, uncompressed, pieces,
                checksum: int, stored: int | None = None) -> Chunk:
        if stored is None:
            stored = sum(_size(p) for p in pieces)
        if stored > _MAX_PAYLOAD or uncompressed > _MAX_PAYLOAD:
            raise InvalidArgumentError(f"chunk payload of {uncompressed} bytes exceeds 4 GiB")
        header = ChunkHeader(codec, flags, self.job_id, self.snapshot_id, self.vertex,
                             partition, count, uncompressed, stored, checksum)
        raw = _native.encode_chunk_header(codec, flags, self.job_id, self.snapshot_id, self.vertex,
                                          partition, count, uncompressed, stored, checksum)
        return Chunk(header, raw, tuple(pieces))


def encode_payload(header: ChunkHeader, data, clevel: int | None = None) -> list:
    """The stored payload pieces of one chunk like ``header`` (its codec and kind) holding
    ``data``: a table (a table chunk) or a ``(keys, values)`` pair of binary arrays (an
    entry chunk), encoded as :class:`ChunkEncoder` encodes a chunk of those rows. A chunk
    rebuilt from the same rows has the same bytes, so its checksum tells whether it is the
    chunk ``header`` describes (the Merkle resync, :mod:`sparkjet.runtime.resync`).
    ``clevel``: a Blosc2 chunk's level, when not today's (:data:`BLOSC2_CLEVELS`: a chunk
    does not record the level it was compressed at, and an older sparkjet wrote level 1)."""
    if header.entries:
        keys, values = _binary(data[0], "keys"), _binary(data[1], "values")
        sizes = np.empty(len(keys), np.int64)
        kd, vd = _binary_desc(keys), _binary_desc(values)
        _native.entries_sizes(kd, vd, sizes)
        buf = bytearray(int(sizes.sum()))
        _native.entries_encode(kd, vd, np.arange(len(keys), dtype=np.int64), buf)
        if header.codec == _native.CODEC_LZ4:
            return [lz4.block.compress(buf, store_size=False)]
        return [buf]
    table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
    batch = table.combine_chunks().to_batches()[0] if table.num_rows else \
        pa.RecordBatch.from_pylist([], schema=table.schema)
    if header.codec == _native.CODEC_ARROW_LZ4:
        return [_ipc_stream(batch, _LZ4_OPTIONS)]
    if header.codec == _native.CODEC_BLOSC2_LZ4:
        return [batch.schema.serialize(), _blosc2(batch.serialize(), clevel)]
    if _has_dictionary(batch.schema):
        return [_ipc_stream(batch, _RAW_OPTIONS)]
    return [batch.schema.serialize(), batch.serialize()]


def read_chunks(buf, source: str = "", base: int = 0) -> list[tuple[int, ChunkHeader, memoryview]]:
    """(offset, header, stored payload) of every chunk in a chunk file's bytes, each
    header checked and each payload's checksum verified. ``base``: where ``buf`` starts in
    the file (a range of it), which an error's offset counts from; the offsets returned
    are ``buf``'s own."""
    view = memoryview(buf).cast("B")
    out = []
    try:
        scanned = _native.scan_chunks(view, source)
    except SnapshotCorruptError as e:
        if not base:
            raise
        raise SnapshotCorruptError(e.path, base + e.offset, e.field, e.detail) from None
    digest, append = xxhash.xxh3_64_intdigest, out.append
    for offset, fields in scanned:
        header = ChunkHeader(*fields)
        start = offset + HEADER_SIZE
        payload = view[start : start + header.stored_size]
        if digest(payload) != header.checksum:
            raise SnapshotCorruptError(source, base + offset, "payload checksum")
        append((offset, header, payload))
    return out


def decode_table(header: ChunkHeader, payload, source: str = "", offset: int = 0) -> pa.Table:
    """The rows of a table chunk, fully validated: a payload whose checksum matches but
    whose Arrow offsets, lengths or dictionary indices are out of bounds (written by
    something other than sparkjet) is refused here, before any kernel reads it."""
    if header.entries:
        raise SnapshotCorruptError(source, offset, "flags", "an entry chunk, not a table")
    if header.codec == _native.CODEC_BLOSC2_LZ4:
        return TableDecoder().decode(header, payload, source, offset)
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(payload))
        table = reader.read_all()
    except (pa.ArrowException, OSError) as e:
        raise SnapshotCorruptError(source, offset, "Arrow IPC payload", str(e)) from None
    if table.num_rows != header.entry_count:
        raise SnapshotCorruptError(source, offset, "entry count",
                                   f"header says {header.entry_count}, payload has {table.num_rows}")
    _validate(table, source, offset)
    return table


class TableDecoder:
    """Decodes the table chunks of one restore, as :func:`decode_table` does (the same
    checks and errors) but without an IPC stream reader per chunk: a chunk's payload is
    a schema message and a record batch message, and a vertex's chunks share one schema.
    Each schema message is compared, by its bytes, with the one before and parsed only
    when it differs; the batch message is then read against it. A chunk with a dictionary
    (its own message) or anything else unusual goes through :func:`decode_table`.

    :meth:`decode` gives one chunk's rows. :meth:`add` and :meth:`tables` decode many at
    once (a restore): Blosc2 chunks of one schema, back to back, decompress into one
    buffer and are validated as one table, which saves most of the per-chunk cost of a
    restore of thousands of chunks.

    >>> chunks = ChunkEncoder(1, 2, 3).table(pa.table({"k": [1, 2, 3]}), "k")
    >>> stored = read_chunks(b"".join(c.to_bytes() for c in chunks))
    >>> decoder = TableDecoder()
    >>> sum(decoder.decode(header, payload).num_rows for _, header, payload in stored)
    3
    >>> for _, header, payload in stored:
    ...     decoder.add(header, payload)
    >>> sum(t.num_rows for t in decoder.tables())
    3
    """

    def __init__(self):
        self._metadata: pa.Buffer | None = None   # the last schema message's metadata
        self._schema: pa.Schema | None = None
        self._pending: list[tuple] = []

    def decode(self, header: ChunkHeader, payload, source: str = "", offset: int = 0) -> pa.Table:
        """The rows of a table chunk, fully validated (see :func:`decode_table`)."""
        if header.entries:
            raise SnapshotCorruptError(source, offset, "flags", "an entry chunk, not a table")
        buf = pa.py_buffer(payload)
        try:
            reader = pa.BufferReader(buf)
            self._read_schema(reader)
            if header.codec == _native.CODEC_BLOSC2_LZ4:
                size = reader.tell()
                return self._run_strictly([(header, payload, source, offset)], size,
                                          [header.uncompressed_size - size])
            batches = []
            while reader.tell() < buf.size:
                if buf.size - reader.tell() in (4, 8) and buf.slice(reader.tell()).equals(
                        _EOS[-(buf.size - reader.tell()):]):
                    break                         # the stream's end-of-stream marker
                message = pa.ipc.read_message(reader)
                if message.type != "record batch":
                    return decode_table(header, payload, source, offset)
                batches.append(pa.ipc.read_record_batch(message, self._schema))
        except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError) as e:
            raise SnapshotCorruptError(source, offset, "Arrow IPC payload",
                                       str(e) or type(e).__name__) from None
        return self._checked(header, batches, source, offset)

    @property
    def queued(self) -> int:
        """How many chunks :meth:`add` queued since the last :meth:`tables`."""
        return len(self._pending)

    def add(self, header: ChunkHeader, payload, source: str = "", offset: int = 0) -> None:
        """Queues a table chunk for :meth:`tables`."""
        if header.entries:
            raise SnapshotCorruptError(source, offset, "flags", "an entry chunk, not a table")
        self._pending.append((header, payload, source, offset))

    def tables(self) -> list[pa.Table]:
        """The rows of the chunks queued since the last call, in their order, as tables
        (fewer than the chunks), with every check :meth:`decode` makes."""
        pending, self._pending = self._pending, []
        out: list[pa.Table] = []
        i = 0
        while i < len(pending):
            header, payload, source, offset = pending[i]
            if header.codec != _native.CODEC_BLOSC2_LZ4:
                out.append(self.decode(header, payload, source, offset))
                i += 1
                continue
            # a run of Blosc2 chunks whose schema message is this one's, byte for byte
            buf = pa.py_buffer(payload)
            try:
                reader = pa.BufferReader(buf)
                self._read_schema(reader)
            except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError) as e:
                raise SnapshotCorruptError(source, offset, "Arrow IPC payload",
                                           str(e) or type(e).__name__) from None
            size = reader.tell()
            schema_bytes = memoryview(payload).cast("B")[:size]
            j = i + 1
            while j < len(pending) and pending[j][0].codec == _native.CODEC_BLOSC2_LZ4 and \
                    memoryview(pending[j][1]).cast("B")[:size] == schema_bytes:
                j += 1
            out.append(self._run(pending[i:j], size))
            i = j
        return out

    def _run(self, run: list[tuple], schema_size: int) -> pa.Table:
        """One table of Blosc2 chunks that share the schema just read (``schema_size``
        bytes): their batch messages decompressed back to back behind that schema message,
        read by Arrow as one IPC stream and validated as one table. When that stream does
        not read, or its batches are not one per chunk with the chunks' entry counts, the
        chunks are read again one by one (:meth:`_run_strictly`), which names the one at
        fault."""
        sizes = [header.uncompressed_size - schema_size for header, _, _, _ in run]
        if min(sizes) > 0:
            table = self._run_as_stream(run, schema_size, sizes)
            if table is not None:
                return table
        return self._run_strictly(run, schema_size, sizes)

    def _run_as_stream(self, run: list[tuple], schema_size: int,
                       sizes: list[int]) -> pa.Table | None:
        buf = pa.allocate_buffer(schema_size + sum(sizes) + _EOS.size)
        into = memoryview(buf).cast("B")
        into[:schema_size] = memoryview(run[0][1]).cast("B")[:schema_size]
        position = schema_size + sum(sizes)
        native = _blosc2_native()
        if native is not None:
            # the whole run in one call without the GIL; a chunk it refuses is read again
            # by the chunk-by-chunk path, which names what is wrong with it
            packed = [memoryview(payload).cast("B")[schema_size:] for _, payload, _, _ in run]
            if native.decompress_run(packed, into[schema_size:position],
                                     np.array(sizes, np.int64)) >= 0:
                return None
        else:
            at = schema_size
            for (_, payload, source, offset), size in zip(run, sizes):
                _unblosc2(pa.py_buffer(payload).slice(schema_size), size,
                          into[at:at + size], source, offset)
                at += size
        into[position:] = memoryview(_EOS).cast("B")
        try:
            batches = list(pa.ipc.open_stream(buf))
            if len(batches) != len(run) or any(
                    b.num_rows != header.entry_count for b, (header, _, _, _) in zip(batches, run)):
                return None
            table = pa.Table.from_batches(batches, self._schema)
            table.validate(full=True)
        except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError):
            return None
        return table

    def _run_strictly(self, run: list[tuple], schema_size: int, sizes: list[int]) -> pa.Table:
        """:meth:`_run` with each batch read from its own bytes and, when the table does
        not validate, each batch validated on its own: the first chunk at fault raises."""
        buf = pa.allocate_buffer(sum(max(n, 0) for n in sizes))
        into = memoryview(buf)
        batches, position = [], 0
        for (header, payload, source, offset), size in zip(run, sizes):
            end = position + max(size, 0)
            _unblosc2(pa.py_buffer(payload).slice(schema_size), size, into[position:end],
                      source, offset)
            try:
                batch = self._batch(buf.slice(position, end - position), source, offset)
            except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError) as e:
                raise SnapshotCorruptError(source, offset, "Arrow IPC payload",
                                           str(e) or type(e).__name__) from None
            if batch.num_rows != header.entry_count:
                raise SnapshotCorruptError(source, offset, "entry count",
                                           f"header says {header.entry_count}, payload has "
                                           f"{batch.num_rows}")
            batches.append(batch)
            position += size
        table = pa.Table.from_batches(batches, self._schema)
        try:
            table.validate(full=True)
        except pa.ArrowException as whole:
            # name the chunk: validate them one by one (only when something is wrong)
            for (_, _, source, offset), batch in zip(run, batches):
                try:
                    batch.validate(full=True)
                except pa.ArrowException as e:
                    raise SnapshotCorruptError(source, offset, "Arrow data", str(e)) from None
            _, _, source, offset = run[0]
            raise SnapshotCorruptError(source, offset, "Arrow data", str(whole)) from None
        return table

    def _read_schema(self, reader: pa.BufferReader) -> None:
        """Reads a payload's schema message, parsing it only when it is not the last one."""
        message = pa.ipc.read_message(reader)
        if message.type != "schema":
            raise pa.ArrowInvalid(f"the stream starts with a {message.type} message, "
                                  f"not a schema")
        if self._metadata is None or not message.metadata.equals(self._metadata):
            schema = pa.ipc.read_schema(message)
            _field_names(schema)
            self._metadata, self._schema = message.metadata, schema

    def _batch(self, buf: pa.Buffer, source: str, offset: int) -> pa.RecordBatch:
        """The one record batch message that ``buf`` holds, whole."""
        reader = pa.BufferReader(buf)
        message = pa.ipc.read_message(reader)
        if message.type != "record batch" or reader.tell() != buf.size:
            raise pa.ArrowInvalid("the Blosc2 chunk holds something other than one record "
                                  "batch message")
        return pa.ipc.read_record_batch(message, self._schema)

    def _checked(self, header: ChunkHeader, batches: list, source: str, offset: int) -> pa.Table:
        table = pa.Table.from_batches(batches, self._schema)
        if table.num_rows != header.entry_count:
            raise SnapshotCorruptError(source, offset, "entry count",
                                       f"header says {header.entry_count}, payload has {table.num_rows}")
        try:
            table.validate(full=True)
        except pa.ArrowException as e:
            raise SnapshotCorruptError(source, offset, "Arrow data", str(e)) from None
        return table


# An IPC stream's end: a continuation marker and a zero length (the older form is the zero
# length alone, the last 4 bytes).
_EOS = pa.py_buffer(b"\xff\xff\xff\xff\x00\x00\x00\x00")


def decode_entries(header: ChunkHeader, payload, source: str = "", offset: int = 0):
    """(keys, values) binary arrays of an entry chunk."""
    if not header.entries:
        raise SnapshotCorruptError(source, offset, "flags", "a table chunk, not entries")
    if header.codec == _native.CODEC_LZ4:
        try:
            raw = lz4.block.decompress(payload, uncompressed_size=header.uncompressed_size)
        except lz4.block.LZ4BlockError as e:
            raise SnapshotCorruptError(source, offset, "lz4 payload", str(e)) from None
        if len(raw) != header.uncompressed_size:
            raise SnapshotCorruptError(source, offset, "uncompressed size")
    elif header.codec == _native.CODEC_RAW:
        raw = payload
    else:
        raise SnapshotCorruptError(source, offset, "codec", "not an entry codec")
    ko, kd, vo, vd = _native.entries_decode(raw, header.entry_count, source, offset)
    n = header.entry_count
    keys = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(ko), pa.py_buffer(kd)])
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(vo), pa.py_buffer(vd)])
    _validate(keys, source, offset)
    _validate(values, source, offset)
    return keys, values


def _validate(data, source: str, offset: int) -> None:
    """Arrow's full validation (every offset, length and dictionary index in bounds):
    the one check that makes decoded data safe to hand to compute kernels. Field names
    must be UTF-8 too, or reading one raises far from here."""
    try:
        if isinstance(data, pa.Table):
            _field_names(data.schema)
        data.validate(full=True)
    except (pa.ArrowException, UnicodeDecodeError) as e:
        raise SnapshotCorruptError(source, offset, "Arrow data", str(e)) from None


def _field_names(schema: pa.Schema) -> None:
    def walk(t: pa.DataType) -> None:
        for i in range(t.num_fields):
            t.field(i).name  # noqa: B018 - decodes the name
            walk(t.field(i).type)

    for f in schema:
        f.name  # noqa: B018 - decodes the name
        walk(f.type)


def _row_bytes(batch: pa.RecordBatch) -> int | None:
    """The bytes each row of ``batch`` takes when its columns are all of fixed width
    without nulls (each part of it then takes its rows times that); None otherwise."""
    widths = [fixed_width(c) for c in batch.columns]
    return sum(widths) if all(widths) else None


def _size(piece) -> int:
    return piece.size if isinstance(piece, pa.Buffer) else len(piece)


_LZ4_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False)
_RAW_OPTIONS = pa.ipc.IpcWriteOptions(compression=None, use_threads=False)


# Blosc2: lz4 after an 8-byte shuffle, on the calling thread (a snapshot's encoding and
# decoding use the threads sparkjet gives them, and blosc2's global thread count is the
# user's); plain dicts, which blosc2 takes without building its dataclasses per call.
# Imported at first use: ``import blosc2`` takes 0.2-0.3 s where nothing else has
# imported its dependencies (a Spark worker has), and most imports of sparkjet never
# write a snapshot.
_BLOSC2_MAX = 2**31 - 256      # blosc2.MAX_BUFFERSIZE (2 GiB less its header's room)
#: The record batch messages a snapshot compresses in one call: a few MB, so that a
#: file's encoding asks for the GIL rarely and holds little beside the state.
_RUN_BYTES = 4 << 20
_BLOSC2_DPARAMS = {"nthreads": 1}
#: lz4's level in a snapshot's Blosc2 chunks. 9 rather than 1: a restore decompresses
#: 5M rows (120 MB) in 26 ms instead of 32, for 3-5 ms more of compression on the writer's
#: I/O thread (42 -> 45 ms) and chunks 0.3 % smaller; 3 and 5 decompress as slowly as 1.
#: Only new chunks change: a Blosc2 chunk names what it needs to be decompressed.
_BLOSC2_CLEVEL = 9
#: The levels a snapshot's Blosc2 chunks may have been compressed at, today's first (before
#: c1ed6eb, 1): what a chunk rebuilt from its rows tries to match (the Merkle resync), since
#: a chunk does not record its level.
BLOSC2_CLEVELS = (_BLOSC2_CLEVEL, 1)


@functools.cache
def _blosc2_module():
    import blosc2
    cparams = {"codec": blosc2.Codec.LZ4.value, "clevel": _BLOSC2_CLEVEL, "typesize": 8,
               "nthreads": 1, "filters": [0, 0, 0, 0, 0, blosc2.Filter.SHUFFLE.value],
               "filters_meta": [0] * 6}
    return blosc2, cparams


@functools.cache
def warm(codec: str) -> threading.Thread | None:
    """Imports what ``codec`` needs on a thread of its own, once per process (a member
    process calls this as it starts, and every member as it is made: the import then
    overlaps the member's start and join, which mostly wait, instead of stalling a
    processor's thread at its first restore or snapshot). Returns that thread (the same
    one on every call), which a member joins before its processors start, or None when
    the codec needs no import."""
    if codec != "blosc2-lz4":
        return None
    thread = threading.Thread(target=_blosc2_compressor, name="sparkjet-import-blosc2",
                              daemon=True)
    thread.start()
    return thread


def _blosc2(message: pa.Buffer, clevel: int | None = None) -> pa.Buffer | bytes:
    """``message`` as one Blosc2 chunk (lz4 after an 8-byte shuffle), as a snapshot's chunks
    are compressed (:func:`_blosc2_many`; at ``clevel``, else today's level), held at its
    compressed size."""
    return _blosc2_many([message], kept=True, clevel=clevel)[0]


def _blosc2_many(messages: list, kept: bool, clevel: int | None = None) -> list:
    """Each of ``messages`` as one Blosc2 chunk: through c-blosc2, back to back in one
    buffer by one call that holds no GIL, when the native library gives blosc2's own
    bytes; else through blosc2's Python API, one by one (which holds the GIL as it
    compresses, and allocates and copies each result twice). ``kept``: the chunks are held
    (a broadcast table's, in a list), so their buffer is trimmed to their compressed size,
    not the messages'."""
    clevel = _BLOSC2_CLEVEL if clevel is None else clevel
    native = _blosc2_compressor()
    if native is None:
        return [_blosc2_python(m, clevel) for m in messages]
    out = pa.allocate_buffer(sum(_size(m) for m in messages)
                             + len(messages) * _native.BLOSC2_MAX_OVERHEAD, resizable=kept)
    sizes = np.empty(len(messages), np.int64)
    total = native.compress_run(messages, out, sizes, clevel)
    if kept:
        out.resize(total, shrink_to_fit=True)
    # sliced, as a resized buffer still shows its old size to memoryview
    ends = np.cumsum(sizes).tolist()
    return [out.slice(end - size, size) for end, size in zip(ends, sizes.tolist())]


def _blosc2_python(message, clevel: int = _BLOSC2_CLEVEL) -> bytes:
    blosc2, cparams = _blosc2_module()
    if clevel != cparams["clevel"]:
        cparams = {**cparams, "clevel": clevel}
    return blosc2.compress2(message, cparams=cparams)


#: The c-blosc2 major versions whose ``blosc2_dparams`` the native module knows (2.x, 3.x).
_BLOSC2_KNOWN = ("2", "3")


@functools.cache
def _blosc2_native():
    """c-blosc2 as the ``blosc2`` wheel ships it (``blosc2/lib/libblosc2.so``), loaded into
    sparkjet's native module (``_native.Blosc2Library``) to decompress a run of chunks in
    one call that holds no GIL; None when the wheel has no such library, or when the one
    found does not give back what blosc2's Python API compressed (a layout this code does
    not know, or a major version it was not written for), and the restore then decompresses
    through blosc2's Python API."""
    blosc2, _ = _blosc2_module()
    root = os.path.dirname(blosc2.__file__)
    found = sorted({os.path.realpath(p) for pattern in ("lib*/libblosc2.so*", "lib*/libblosc2*.dylib")
                    for p in glob.glob(os.path.join(root, pattern))})
    sample = np.arange(-40_000, 40_000, 7, dtype=np.int64).tobytes()
    packed = _blosc2_python(pa.py_buffer(sample))
    for path in found:
        try:
            lib = _native.Blosc2Library(path)
            if lib.version.split(".")[0] not in _BLOSC2_KNOWN:
                continue    # its decompression parameters may be laid out otherwise
            out = bytearray(len(sample))
            if (lib.decompress_run([packed], out, np.array([len(sample)], np.int64)) == -1
                    and out == sample):
                return lib
        except OSError:
            continue
    return None


@functools.cache
def _blosc2_compressor():
    """:func:`_blosc2_native`'s library when its compression gives, byte for byte, what
    blosc2's Python API gives for the same input (so a chunk has the same bytes and
    checksum whichever compressed it: the Merkle resync rebuilds chunks and compares
    them); None otherwise, and snapshots are compressed through the Python API."""
    lib = _blosc2_native()
    blosc2, _ = _blosc2_module()
    if lib is None or lib.version != str(blosc2.blosclib_version).split()[0]:
        return None     # (the library blosc2 itself runs, or its bytes may differ)
    rng = np.random.default_rng(7)
    samples = (np.arange(-40_000, 40_000, 7, dtype=np.int64).tobytes(), b"", b"x",
               rng.bytes(70_001),
               np.cumsum(rng.integers(0, 9, 40_000)).astype(np.float64).tobytes()[:-3])
    for sample in samples:
        out = bytearray(len(sample) + _native.BLOSC2_MAX_OVERHEAD)
        try:
            size = lib.compress(sample, out, _BLOSC2_CLEVEL)
        except (RuntimeError, MemoryError):
            return None
        if out[:size] != _blosc2_python(sample):
            return None
    return lib


def _unblosc2(packed: pa.Buffer, size: int, out: memoryview, source: str, offset: int) -> None:
    """Decompresses a Blosc2 chunk into ``out`` (``size`` writable bytes), after its header's sizes
    are checked against ``packed`` and ``size`` (so nothing is read past ``packed`` or
    written past ``out``)."""
    blosc2, _ = _blosc2_module()
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(packed)
    except (ValueError, RuntimeError) as e:
        raise SnapshotCorruptError(source, offset, "Blosc2 chunk", str(e)) from None
    if cbytes != packed.size or nbytes != size or size < 0 or out.nbytes != size:
        raise SnapshotCorruptError(source, offset, "Blosc2 chunk",
                                   f"it says {nbytes} bytes in {cbytes}, the chunk header "
                                   f"{size} bytes in {packed.size}")
    try:
        blosc2.decompress2(packed, dst=out, dparams=_BLOSC2_DPARAMS)
    except (ValueError, RuntimeError) as e:
        raise SnapshotCorruptError(source, offset, "Blosc2 chunk", str(e)) from None


def _ipc_stream(batch: pa.RecordBatch, options: pa.ipc.IpcWriteOptions) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def _has_dictionary(schema: pa.Schema) -> bool:
    def walk(t: pa.DataType) -> bool:
        return pa.types.is_dictionary(t) or any(walk(t.field(i).type)
                                                for i in range(t.num_fields))
    return any(walk(f.type) for f in schema)


def _ids(pids: pa.Int32Array) -> np.ndarray:
    """Partition ids as an int32 numpy view (no copy)."""
    return np.frombuffer(pids.buffers()[1], np.int32, len(pids), pids.offset * 4)


def _scatter(pids: pa.Int32Array, partition_count: int, *, with_perm: bool):
    n = len(pids)
    starts = np.empty(partition_count + 1, np.int64)
    perm = np.empty(n if with_perm else 0, np.int64)
    _native.scatter(_ids(pids), partition_count, starts, perm if with_perm else None)
    return starts, perm


def _binary(values, what: str) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        try:
            values = pa.array(values, pa.binary())
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
            raise InvalidArgumentError(f"{what} must be bytes: {e}") from None
    if values.type in (pa.large_binary(), pa.binary_view(), pa.string(), pa.large_string()):
        values = values.cast(pa.binary())
    if values.type != pa.binary():
        raise InvalidArgumentError(f"{what} must be binary, got {values.type}")
    if values.null_count:
        raise InvalidArgumentError(f"{what} cannot be null (first null at index "
                                   f"{values.is_null().index(True).as_py()})")
    return values


def _binary_desc(arr: pa.Array) -> tuple:
    """The binary column tuple sparkjet._native reads: (offsets, data, offset, length)."""
    bufs = arr.buffers()
    return (bufs[1], bufs[2], arr.offset, len(arr))
