"""Writing one processor's share of a snapshot: :class:`SnapshotWriter` encodes keyed state as
chunks (:mod:`~sparkjet.snapshot.chunks`) into files of the store, and :meth:`SnapshotWriter.finish`
returns the :class:`Manifest` the coordinator commits with (``SnapshotStore.commit``)."""
from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import xxhash

from sparkjet.errors import InvalidArgumentError
from sparkjet.snapshot import layout
from sparkjet.snapshot.backend import StorageBackend
from sparkjet.snapshot.chunks import ChunkEncoder

#: A file's chunks are written about this many bytes at a time (one writev call): few
#: system calls, and a local file's pages cached in large folios, which a restore's memory
#: map faults in 2 MB at a time instead of 64 KB.
_WRITE_BYTES = 2 << 20


class StoreLink(Protocol):
    """What a writer asks of its :class:`~sparkjet.snapshot.store.SnapshotStore` (a protocol,
    so that this module needs no import of the store's)."""

    job_id: int
    _backend: StorageBackend

    def _path(self, *parts: str) -> str: ...

    def _snapshot_dir(self, snapshot_id: int, execution_id: int) -> str: ...

    def _table_path(self, digest: str) -> str: ...

    def check_fence(self, execution_id: int) -> None: ...

    def commit(self, snapshot_id: int, execution_id: int, manifests: Any) -> Any: ...


def vertex_id(vertex: str) -> int:
    """The 32-bit id a vertex name has in chunk headers (xxh32 of its UTF-8 name)."""
    return xxhash.xxh32_intdigest(vertex.encode())


@dataclass
class Manifest:
    """What a writer wrote: plain data that travels to whoever commits (the coordinator)."""

    snapshot_id: int
    execution_id: int
    files: list[dict] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)     # digests of table versions used

    def to_json(self) -> dict:
        return {"snapshot_id": self.snapshot_id, "execution_id": self.execution_id,
                "files": self.files, "tables": self.tables}

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        return cls(data["snapshot_id"], data["execution_id"], list(data["files"]),
                   list(data.get("tables", [])))


class SlotLink(Protocol):
    """The storage slot a writer writes into (``storage="members"``): a protocol, so that
    this module needs no import of :mod:`sparkjet.snapshot.slots`."""

    uuid: str

    def replicas(self, job_id: int) -> StorageBackend: ...


class SnapshotBuffers:
    """The memory a keyed processor's state is copied and grouped into at each snapshot,
    kept from one snapshot to the next (a pool per processor).

    A snapshot copies the whole state at the barrier, on the processor's thread, and
    groups it by partition (at the call, or from that copy on the writer's I/O thread:
    :meth:`SnapshotWriter.write_table`); into memory the process has not used before,
    grouping was 3-8 times slower on a VM guest than into memory used before (500k keys:
    17-42 ms instead of 5-6). A writer takes buffers from a :meth:`lease` while it encodes and
    gives them back when its files are written (:meth:`SnapshotWriter.finish`): the
    chunks it wrote hold copies (serialized, compressed), never these buffers. A lease
    never given back (a failed writer) leaves its buffers to the garbage collector. What
    the pool keeps is what the last lease given back used, up to ``max_bytes``: two more
    copies of the state's fixed-width columns (the copy and the grouped rows) for a state
    of up to ~5M keys per processor, one for up to ~10M (grouped at the call); a larger
    state's snapshots take fresh memory, as they did without a pool (its snapshot costs
    far more than the faults, and a copy of it kept idle would cost gigabytes)."""

    def __init__(self, max_bytes: int = 256 << 20):
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self.max_bytes = max_bytes

    def lease(self) -> BufferLease:
        return BufferLease(self)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        # an eighth more than asked: state grows, and a buffer should serve a few snapshots
        return np.empty(nbytes + nbytes // 8, np.uint8)

    def _give_back(self, used: list[np.ndarray]) -> None:
        if not used:
            return      # (a snapshot of no rows took nothing: the pool stays as it is)
        with self._lock:
            # the last snapshot's buffers, and as many of the others as it used (newest
            # first), within max_bytes: the pool does not grow past what a snapshot takes
            kept, held = [], 0
            for buf in (used + self._free)[: len(used)]:
                if held + len(buf) <= self.max_bytes:
                    kept.append(buf)
                    held += len(buf)
            self._free = kept

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers waiting for the next lease."""
        with self._lock:
            return sum(len(b) for b in self._free)


class BufferLease:
    """The buffers one writer takes from a :class:`SnapshotBuffers` (:meth:`take`, a
    writable buffer of ``nbytes``), given back together (:meth:`give_back`, once)."""

    def __init__(self, pool: SnapshotBuffers):
        self._pool = pool
        self._used: list[np.ndarray] | None = []

    def take(self, nbytes: int) -> pa.Buffer:
        if self._used is None:
            raise InvalidArgumentError("this buffer lease was given back")
        buf = self._pool._take(nbytes)
        self._used.append(buf)
        return pa.py_buffer(buf[:nbytes])

    def give_back(self) -> None:
        if self._used is not None:
            used, self._used = self._used, None
            self._pool._give_back(used)


class SnapshotWriter:
    """Writes one writer's share of a snapshot; :meth:`finish` returns its manifest.

    With a ``slot`` the chunk files go into the slot's folder of the job
    (``replicas/snapshots/...``, the store's layout) and the manifest names the slot;
    the store's record (the commit point) stays where it is."""

    def __init__(self, store: StoreLink, snapshot_id, execution_id, writer, partition_count,
                 chunk_size, codec, slot: SlotLink | None = None, replicate=None,
                 durable: bool = False):
        self.store = store
        self.slot = slot
        #: with a slot: ``(path in the slot, the file's chunks as the record lists them)
        #: -> [slot uuid, ...]``, which sends each slot that backs some of the file's
        #: partitions their byte ranges and returns those slots once each has verified them
        self.replicate = replicate
        #: with a slot: copy each file into the store's snapshot folder too (the durable
        #: tier), before the manifest goes to the commit
        self.durable = durable
        self._backend = store._backend if slot is None else slot.replicas(store.job_id)
        self.snapshot_id = snapshot_id
        self.execution_id = execution_id
        self.writer = writer
        self.partition_count = partition_count
        self.chunk_size = chunk_size
        self.codec = codec
        self._dir = store._snapshot_dir(snapshot_id, execution_id)
        self._calls = 0
        self._files: list[dict] = []
        self._tables: list[str] = []
        self._finished = False
        self._made: set[str] = set()        # folders made already
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._failed: list[BaseException] = []
        self._leases: list[BufferLease] = []

    def __repr__(self) -> str:
        return (f"SnapshotWriter(job_id={self.store.job_id}, snapshot_id={self.snapshot_id}, "
                f"execution_id={self.execution_id}, writer={self.writer})")

    def _encoder(self, vertex: str) -> ChunkEncoder:
        layout.check_name("vertex name", vertex)
        if self._finished:
            raise InvalidArgumentError("this snapshot writer has finished")
        return ChunkEncoder(self.store.job_id, self.snapshot_id, vertex_id(vertex),
                            partition_count=self.partition_count, chunk_size=self.chunk_size,
                            codec=self.codec)

    def write_table(self, vertex: str, table, key, *, key_type=None,
                    buffers: SnapshotBuffers | None = None) -> None:
        """Keyed state as an Arrow table, partitioned by `key`; grouped by partition into
        memory from ``buffers`` (a keyed processor's pool), given back by :meth:`finish`.
        With ``buffers``, a state of up to half the pool's bytes is copied at the call
        (into the pool's memory too) and grouped on the I/O thread: the processor's thread
        pays a plain copy, not the grouping, before it goes on with its input."""
        encoder = self._encoder(vertex)
        lease = None if buffers is None else buffers.lease()
        if lease is not None:
            self._leases.append(lease)
        later = buffers is not None and table.nbytes <= buffers.max_bytes // 2
        self._write(vertex, encoder.iter_table(table, key, key_type=key_type,
                                               alloc=None if lease is None else lease.take,
                                               group_later=later))

    def write_entries(self, vertex: str, keys, values) -> None:
        """Keyed state as opaque bytes per key."""
        self._write(vertex, self._encoder(vertex).iter_entries(keys, values))

    def write_broadcast_table(self, vertex: str, table) -> None:
        self._write(vertex, self._encoder(vertex).broadcast_table(table))

    def write_broadcast_entries(self, vertex: str, keys, values) -> None:
        self._write(vertex, self._encoder(vertex).broadcast_entries(keys, values))

    def use_table_version(self, digest: str) -> None:
        """Records that this snapshot uses a stored table version (kept while a retained
        snapshot uses it)."""
        self.store._table_path(digest)
        if digest not in self._tables:
            self._tables.append(digest)

    def _write(self, vertex: str, chunks) -> None:
        """Writes chunks (in partition order) to one file as they are encoded.

        One file per call, partitions back to back: one fsync per file (a file per
        partition cost 271 fsyncs, 30x the time), while the record's byte ranges still let
        a restore read only its partitions. The writer's one I/O thread (:meth:`_run_io`)
        encodes the chunks (compression, which releases the GIL), writes and closes
        (fsyncs) the file, and in a slot makes its copies (:meth:`_slot_copies`), while
        this thread goes on: :meth:`finish` waits for it before the manifest goes to the
        commit. (``chunks`` holds its own copy of the state: an encoder's table is grouped
        by partition at the call, or copied then and grouped on the I/O thread, into fresh
        memory or a lease's.)"""
        self.store.check_fence(self.execution_id)
        self._raise_io_failure()
        # (an encoder's generator is never empty, and encodes nothing on this thread: no
        # rows come as an empty tuple or list, and write no file)
        if isinstance(chunks, (list, tuple)) and not chunks:
            return
        directory = self._folder(vertex)
        if directory not in self._made:
            self._backend.makedirs(directory)
            self._made.add(directory)
        name = layout.chunk_file(self.writer, self._calls)
        self._calls += 1
        record = {"vertex": vertex, "path": f"{vertex}/{name}", "bytes": 0, "chunks": []}
        after = None if self.slot is None else self._slot_copies(vertex, name, record)
        self._io((f"{directory}/{name}", chunks, record, after))
        self._files.append(record)      # (complete once the I/O thread has written it)

    def _slot_copies(self, vertex: str, name: str, record: dict):
        """What follows a file written into the slot, on the I/O thread once it is closed
        (the caller, a processor with input waiting, goes on): its byte ranges streamed to
        the slots that back them, which each verify (``replicate``), and the durable copy
        in the store. Both read the file back; :meth:`finish` waits for them. (The function
        holds what it needs, not the writer, which the I/O thread must never keep alive.)"""
        path = "/".join((layout.SNAPSHOTS, self._dir, vertex, name))
        slot, replicate = self.slot.uuid, self.replicate
        durable = self._durable_copy(vertex, name) if self.durable else None

        def copies():
            record["slot"] = slot
            if replicate is not None:
                replicas = replicate(path, record["chunks"])
                if replicas:
                    record["replicas"] = list(replicas)
            if durable is not None:
                durable(record["bytes"])
                record["durable"] = True
        return copies

    def _io(self, op: tuple) -> None:
        """Queues a file, ``(path, chunks, record, after)``, for this writer's one I/O
        thread, started at the first: one thread per snapshot and writer, not one per
        file."""
        if self._queue is None:
            self._queue = queue.Queue()
            # The thread holds no reference to the writer: a writer dropped unfinished (its
            # processor failed) ends its thread when it is collected.
            self._thread = threading.Thread(target=self._run_io, name="sparkjet-snapshot-write",
                                            args=(self._queue, self._backend, self._failed),
                                            daemon=True)
            weakref.finalize(self, self._queue.put, None)
            self._thread.start()
        self._queue.put(op)

    @staticmethod
    def _run_io(ops: queue.Queue, backend: StorageBackend, failed: list) -> None:
        """The I/O thread: writes the queued files in order until ``None``, filling in each
        one's record (its bytes and chunks), then runs the file's ``after`` (the copies of a
        file in a slot); after a failure it writes nothing more (a failed writer's snapshot
        is never committed) and keeps the error (in ``failed``) for the encoding thread to
        raise."""
        while (op := ops.get()) is not None:
            if isinstance(op, threading.Event):
                op.set()
                continue
            if failed:
                continue
            try:
                SnapshotWriter._write_file(backend, *op)
            except BaseException as e:  # noqa: BLE001 - raised by the encoding thread
                failed.append(e)
            # nothing of this file is held while the thread waits for the next (its
            # chunks, the state's memory they were cut from, the copies' function)
            op = None

    @staticmethod
    def _write_file(backend: StorageBackend, path: str, chunks, record: dict, after) -> None:
        out = backend.open_write(path)
        entries, offset = record["chunks"], 0
        pending, held = [], 0       # pieces written together (a chunk's are never reused)
        try:
            for c in chunks:
                pending.append(c.header_bytes)
                pending.extend(c.pieces)
                held += c.nbytes
                if held >= _WRITE_BYTES:
                    out.write_all(pending)
                    pending, held = [], 0
                entries.append([offset, c.header.stored_size, c.header.checksum,
                                c.header.entry_count, c.header.partition])
                offset += c.nbytes
            out.write_all(pending)
        except BaseException:
            out.abort()
            raise
        out.close()
        record["bytes"] = offset
        if after is not None:
            after()

    def _drain(self) -> None:
        """Waits until every queued file operation has run; raises the I/O thread's error."""
        if self._queue is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()
        self._raise_io_failure()

    def _stop_io(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        self._raise_io_failure()

    def _raise_io_failure(self) -> None:
        if self._failed:
            raise self._failed[0]

    def _durable_copy(self, vertex: str, name: str):
        """The durable copy of a file written into the slot, as a function of its size: the
        same bytes in the store's snapshot folder, streamed in 4 MiB pieces."""
        source, read_from = f"{self._folder(vertex)}/{name}", self._backend
        store = self.store._backend
        folder = self.store._path(layout.SNAPSHOTS, self._dir, vertex)

        def copy(size: int) -> None:
            read = read_from.range_reader(source)
            store.makedirs(folder)
            out = store.open_write(f"{folder}/{name}")
            try:
                for offset in range(0, size, 4 << 20):
                    out.write(read(offset, min(4 << 20, size - offset)))
            except BaseException:
                out.abort()
                raise
            out.close()
        return copy

    def _folder(self, vertex: str) -> str:
        if self.slot is None:
            return self.store._path(layout.SNAPSHOTS, self._dir, vertex)
        return self._backend.path(layout.SNAPSHOTS, self._dir, vertex)

    def finish(self) -> Manifest:
        """Ends writing (making the files durable) and returns the manifest to commit."""
        if not self._finished:
            # Every file written and closed (fsynced), or the error. A fenced writer's
            # directory may already be gone (the newer execution's cleanup): say so rather
            # than fail on a missing path.
            try:
                self._stop_io()
            except BaseException:
                self.store.check_fence(self.execution_id)
                raise
            self.store.check_fence(self.execution_id)
            self._finished = True
            # every file is written: no chunk refers to the memory the state was grouped in
            for lease in self._leases:
                lease.give_back()
            self._leases = []
            for vertex in {f["vertex"] for f in self._files}:
                self._backend.sync_dir(self._folder(vertex))
                if self.slot is not None and self.durable:
                    self.store._backend.sync_dir(
                        self.store._path(layout.SNAPSHOTS, self._dir, vertex))
        return Manifest(self.snapshot_id, self.execution_id, list(self._files),
                        list(self._tables))

    def commit(self):
        """finish() and commit this writer's share alone (a single-writer snapshot)."""
        return self.store.commit(self.snapshot_id, self.execution_id, [self.finish()])


__all__ = ["BufferLease", "Manifest", "SlotLink", "SnapshotBuffers", "SnapshotWriter",
           "vertex_id"]
