"""Reading a snapshot's chunk files back, for :class:`~sparkjet.snapshot.store.SnapshotStore`'s
``restore`` and ``verify``: each file checked against its validation record (present, at its
size, nothing extra), its chunks read by byte ranges (only the wanted partitions') and each
chunk's header checked against the record. A file of the members' storage
(``storage="members"``) is read from the storage slots that hold it through the store's
``slot_files`` (:class:`SlotFile`), or from its durable copy in the store."""
from __future__ import annotations

import base64
import binascii
import functools
import queue
import threading
from collections.abc import Callable
from typing import Protocol

import pyarrow as pa

from sparkjet.errors import (
    FencedError,
    PartitionTableError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
    SparkjetError,
)
from sparkjet.partition_table import PartitionTable
from sparkjet.snapshot import layout
from sparkjet.snapshot.backend import StorageBackend
from sparkjet.snapshot.chunks import HEADER_SIZE, read_chunks
from sparkjet.snapshot.records import FileRecord, VertexRecord


class SlotFile(Protocol):
    """A chunk file in a storage slot, as a restore reads it (from this member's own slot,
    or a peer's over the exchange): its size and a ``(offset, length) -> bytes`` reader."""

    def size(self) -> int: ...

    def range_reader(self) -> Callable[[int, int], object]: ...


class StoreView(Protocol):
    """What reading asks of the store (a protocol: this module needs no import of it)."""

    job_id: int
    who: str
    slot_files: Callable[[list[str], str], SlotFile] | None
    _backend: StorageBackend

    def _path(self, *parts: str) -> str: ...


def check_listing(store: StoreView, stored, vertex: str, v: VertexRecord) -> None:
    """The vertex's directory must hold exactly the record's files, at their sizes (a
    file in a storage slot: where the slot is, when it is reachable here)."""
    directory = store._path(*stored.dir, vertex)
    snapshot = stored.record.snapshot_id
    # a file in the slots: each copy's size is checked as read_file reads it (a copy at
    # the wrong size is passed over for the next)
    listed = {f.name: f for f in v.files if f.in_store}
    if not listed and (store.slot_files is not None or v.files):
        # a member reading slots only, or files in slots alone: nothing of it counts in
        # the store (with durable_tier="async", uploads the driver has not marked complete)
        return
    present = set(store._backend.listdir(directory))
    for file_name, f in listed.items():
        if file_name not in present:
            raise SnapshotIncompleteError(
                f"snapshot {snapshot} of {store.who}: chunk file "
                f"{directory}/{file_name} is missing; refusing to restore partial state")
        size = store._backend.size(f"{directory}/{file_name}")
        if size != f.bytes:
            raise SnapshotCorruptError(f"{directory}/{file_name}", min(size, f.bytes),
                                       "file size", f"{size} bytes, record says {f.bytes}")
    for extra in sorted(present - set(listed)):
        raise SnapshotIncompleteError(
            f"snapshot {snapshot} of {store.who}: extra file "
            f"{directory}/{extra} not in the validation record; refusing to restore")


def read_file(store: StoreView, stored, vertex: str, vid: int, f: FileRecord, wanted=None):
    """The chunks of one file for the `wanted` partitions (all when None) and the
    broadcast state, each checked against the record. Runs of adjacent chunks are read
    in one range, and only those ranges are read (the record's schema has checked
    that every chunk lies inside the file, in order)."""
    entries = [c for c in f.chunks
               if wanted is None or c.partition == -1 or c.partition in wanted]
    if not entries:
        return
    if f.slot is None or (f.durable and (store.slot_files is None
                                         or stored.dir[0] != layout.SNAPSHOTS)):
        # the store's file (a durable copy, where no slot is reachable or in an export)
        path = store._path(*stored.dir, vertex, f.name)
        yield from _checked_chunks(store, stored, vid, entries,
                                   store._backend.range_reader(path), path)
        return
    if store.slot_files is None:
        raise SnapshotIncompleteError(
            f"snapshot {stored.record.snapshot_id} of {store.who}: chunk file {f.path} "
            f"is in storage slot {f.slot}, which is not reachable here (a member of "
            f"the job reads it from its slot or a peer's)")
    yield from _from_copies(store, stored, vertex, vid, f, entries)


def _from_copies(store: StoreView, stored, vertex: str, vid: int, f: FileRecord, entries):
    """The chunks of ``entries`` from the file's copies in the slots, each chunk from a copy
    that holds it (:func:`partition_holders`), the preferred first (the one the store's
    ``slot_files`` picks: this member's own slot, else a member's), then each holder in
    turn, then the durable copy. Each chunk is checked against the record (its header, its
    payload's checksum) before it is handed on, in the entries' order, as soon as those
    before it are: a chunk that fails in one copy (flipped, truncated, deleted, a range
    that copy does not hold) is read from the next, and the restore fails on the first
    error only when no copy of some chunk reads (what was handed on before is then of no
    use: a restore that raises restores nothing)."""
    path = slot_path(stored, f)
    holders_of = partition_holders(stored)
    durable = store._path(*stored.dir, vertex, f.name) if f.durable else None
    orders: dict[tuple, list] = {}
    opened: dict = {}

    def order(holders: tuple) -> list:
        """Where to read a chunk held by ``holders`` from, best first (None: the durable
        copy); the store's SnapshotIncompleteError when no slot is reachable and no
        durable copy exists."""
        if holders not in orders:
            try:
                pick = getattr(store.slot_files(list(holders), path), "slot", holders[0])
                orders[holders] = [pick, *(u for u in holders if u != pick)]
            except SnapshotIncompleteError:
                if durable is None:
                    raise
                orders[holders] = []
            except FencedError:
                raise
            except (SparkjetError, OSError):
                orders[holders] = list(holders)     # the picked copy's error comes later
            if durable is not None:
                orders[holders].append(None)
        return orders[holders]

    def open_copy(uuid):
        if uuid is None:
            return store._backend.range_reader(durable)
        copy = store.slot_files([uuid], path)
        try:
            size = copy.size()
        except FileNotFoundError:
            raise SnapshotIncompleteError(
                f"snapshot {stored.record.snapshot_id} of {store.who}: chunk file "
                f"slot {uuid}: {path} is missing") from None
        if size != f.bytes:
            raise SnapshotCorruptError(f"slot {uuid}: {path}", min(size, f.bytes),
                                       "file size", f"{size} bytes, record says {f.bytes}")
        return copy.range_reader()

    def reader(uuid):
        if uuid not in opened:
            try:
                opened[uuid] = open_copy(uuid)
            except FencedError:
                raise       # this execution is over (a newer one runs): no copy will do
            except (SparkjetError, OSError) as e:
                opened[uuid] = e
        return opened[uuid]

    def checked(uuid, which):
        """The chunks ``which`` of copy ``uuid``, each yielded once it checks out."""
        where = durable if uuid is None else f"slot {uuid}: {path}"
        return _checked_chunks(store, stored, vid, [entries[i] for i in which],
                               reader(uuid), where)

    choices = [order(tuple(holders_of(f, c.partition))) for c in entries]
    tried = [0] * len(entries)
    got: list = [None] * len(entries)
    handed = 0      # got[:handed] went out, in the entries' order, as each checked out

    def hand_on():
        nonlocal handed
        while handed < len(got) and got[handed] is not None:
            chunk, got[handed] = got[handed], None
            handed += 1
            yield chunk

    pending, first = list(range(len(entries))), None
    while pending:
        batches: dict = {}
        for i in pending:
            if tried[i] == len(choices[i]):
                raise first
            batches.setdefault(choices[i][tried[i]], []).append(i)
        pending = []
        for uuid, which in batches.items():
            if isinstance(reader(uuid), BaseException):
                first = first or reader(uuid)
                failed = which
            else:
                done = 0
                try:
                    for chunk in checked(uuid, which):
                        got[which[done]] = chunk
                        done += 1
                        yield from hand_on()    # a restore decodes it while more arrive
                    continue
                except FencedError:
                    raise
                except (SparkjetError, OSError) as e:
                    first = first or e
                failed = []
                for i in which[done:]:  # those of this copy that do check out are taken
                    try:
                        got[i] = next(checked(uuid, [i]))
                    except FencedError:
                        raise
                    except (SparkjetError, OSError):
                        failed.append(i)
            for i in failed:
                tried[i] += 1
            pending.extend(failed)
        pending.sort()
        yield from hand_on()
    assert handed == len(got)


def partition_holders(stored) -> Callable[[FileRecord, int], list[str]]:
    """``(file, partition) -> slots`` for a record of the members' storage: the slots that
    hold the file's chunks of ``partition``: the slot that wrote it, then those of its
    replicas that hold a replica of the partition in the record's partition table (its
    backups, the writer's slot being its primary: a backup holds only the byte ranges of
    the partitions it backs); every replica for broadcast state (partition -1), or when the
    record's table does not read."""
    table = _record_table(stored.record.table)

    def holders(f: FileRecord, partition: int) -> list[str]:
        if partition < 0 or table is None or partition >= table.partition_count:
            return f.holders
        backs = set(table.replicas(partition))
        return [f.slot, *(u for u in f.replicas if u in backs)]
    return holders


@functools.lru_cache(maxsize=8)
def _record_table(text: str | None) -> PartitionTable | None:
    if not text:
        return None
    try:
        return PartitionTable.from_bytes(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError, TypeError, PartitionTableError):
        return None


#: A reader that fetches from afar (a peer's slot over the exchange) is asked for runs of at
#: most this many bytes, up to AHEAD_PIECES of them ahead on a thread of their own: the
#: restore checks and decodes a piece while the next ones stream. (A 60 MB replica,
#: restored from a peer's process: 16 MiB x 4 a median 0.134-0.136 s, 4 MiB x 8
#: 0.154-0.166 s: fewer hand-offs between the fetching thread and the decoding one.)
AHEAD_BYTES = 16 << 20
AHEAD_PIECES = 4


def _checked_chunks(store: StoreView, stored, vid: int, entries, read, path: str):
    """The chunks of ``entries`` read through ``read`` (runs of adjacent chunks in one
    range), each header checked against the record. A reader marked ``ahead`` (remote) is
    asked for pieces of at most :data:`AHEAD_BYTES`, fetched ahead (:func:`_fetched_ahead`)."""
    ahead = getattr(read, "ahead", False)
    runs, run = [], [entries[0]]
    for c in entries[1:]:
        prev = run[-1]
        if c.offset == prev.offset + HEADER_SIZE + prev.stored_size and not (
                ahead and prev.offset + HEADER_SIZE + prev.stored_size - run[0].offset
                >= AHEAD_BYTES):
            run.append(c)
        else:
            runs.append(run)
            run = [c]
    runs.append(run)
    spans = [(r[0].offset, r[-1].offset + HEADER_SIZE + r[-1].stored_size) for r in runs]
    fetched = (_fetched_ahead(read, spans) if ahead and len(runs) > 1
               else (read(start, end - start) for start, end in spans))
    for run, (start, end), data in zip(runs, spans, fetched):
        chunks = read_chunks(data, path, start)
        if len(chunks) != len(run):
            raise SnapshotIncompleteError(
                f"{path}: {len(chunks)} chunks at bytes {start}..{end}, record says {len(run)}")
        job_id, snapshot_id = store.job_id, stored.record.snapshot_id
        for (rel, header, payload), expected in zip(chunks, run):
            offset = start + rel
            # one comparison per chunk; field by field only to name what differs
            if (offset, header.stored_size, header.checksum, header.entry_count,
                    header.job_id, header.snapshot_id, header.vertex, header.partition) != (
                    expected.offset, expected.stored_size, expected.checksum,
                    expected.entry_count, job_id, snapshot_id, vid, expected.partition):
                _name_mismatch(path, offset, header, expected, job_id, snapshot_id, vid)
            yield header, payload, path, offset


def _name_mismatch(path: str, offset: int, header, expected, job_id: int, snapshot_id: int,
                   vid: int) -> None:
    for what, got, want in (
        ("offset", offset, expected.offset),
        ("stored size", header.stored_size, expected.stored_size),
        ("checksum", header.checksum, expected.checksum),
        ("entry count", header.entry_count, expected.entry_count),
        ("job id", header.job_id, job_id),
        ("snapshot id", header.snapshot_id, snapshot_id),
        ("vertex", header.vertex, vid), ("partition", header.partition, expected.partition),
    ):
        if got != want:
            raise SnapshotCorruptError(path, offset, what, f"{got}, record says {want}")


def _fetched_ahead(read, spans: list[tuple[int, int]]):
    """``read(start, end - start)`` of each span, in order, fetched up to
    :data:`AHEAD_PIECES` ahead of the consumer on a thread of their own; a fetch's error
    is raised in its place. A consumer that stops early stops the fetching."""
    pieces: queue.Queue = queue.Queue(AHEAD_PIECES)
    stop = threading.Event()

    def fetch():
        for start, end in spans:
            if stop.is_set():
                return
            try:
                item = (True, read(start, end - start))
            except BaseException as e:  # noqa: BLE001 - raised by the consumer
                item = (False, e)
            while not stop.is_set():
                try:
                    pieces.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[0]:
                return

    thread = threading.Thread(target=fetch, name="sparkjet-fetch-ahead", daemon=True)
    thread.start()
    try:
        for _ in spans:
            ok, value = pieces.get()
            if not ok:
                raise value
            yield value
    finally:
        stop.set()


def slot_path(stored, f: FileRecord) -> str:
    """Where a chunk file is in its slot's folder of the job (the store's layout)."""
    return "/".join((*stored.dir, f.path))


def concat_tables(tables: list[pa.Table], where: str) -> pa.Table | None:
    # Writers may hold columns others lack (a join processor that saw one side only):
    # the missing ones are null in their rows. Columns of one name must agree in type.
    if not tables:
        return None
    try:
        return pa.concat_tables(tables, promote_options="default")
    except pa.ArrowException as e:
        raise SnapshotCorruptError(where, 0, "table schema",
                                   f"the chunks' schemas do not agree: {e}") from None


def concat_entries(pairs) -> tuple[pa.Array, pa.Array] | None:
    if not pairs:
        return None
    keys = pa.chunked_array([k for k, _ in pairs]).combine_chunks()
    values = pa.chunked_array([v for _, v in pairs]).combine_chunks()
    return keys, values


__all__ = ["SlotFile", "StoreView", "check_listing", "concat_entries", "concat_tables",
           "partition_holders", "read_file", "slot_path"]
