"""Reading a snapshot's chunk files back, for :class:`~sparkjet.snapshot.store.SnapshotStore`'s
``restore`` and ``verify``: each file checked against its validation record (present, at its
size, nothing extra), its chunks read by byte ranges (only the wanted partitions') and each
chunk's header checked against the record. A file of the members' storage
(``storage="members"``) is read from the storage slots that hold it through the store's
``slot_files`` (:class:`SlotFile`), or from its durable copy in the store."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import pyarrow as pa

from sparkjet.errors import (
    FencedError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
    SparkjetError,
)
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
    listed = {f.name: f for f in v.files if f.slot is None or f.durable}
    if not listed and store.slot_files is not None:
        return      # a member reading slots only: nothing of it is in the store
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
    # Every copy in turn, the preferred first, each read and checked whole before any of
    # its chunks is handed on: a damaged copy (flipped, truncated, deleted) is passed over
    # for the next, and the restore fails on the first copy's error only when none reads.
    first = None
    for where, open_copy in _slot_copies(store, stored, vertex, f):
        try:
            checked = list(_checked_chunks(store, stored, vid, entries, open_copy(), where))
        except FencedError:
            raise       # this execution is over (a newer one runs): no copy will do
        except (SparkjetError, OSError) as e:
            first = first or e
            continue
        yield from checked
        return
    raise first


def _slot_copies(store: StoreView, stored, vertex: str, f: FileRecord):
    """``(where, open)`` for each copy of a file in the slots, best first: the one the
    store's ``slot_files`` picks (this member's own slot, else a member's), each holder's
    in turn, then the durable copy; ``open()`` checks the copy's size and returns its
    range reader. SnapshotIncompleteError when no slot is reachable and no durable copy
    exists."""
    path = slot_path(stored, f)

    def opener(uuids):
        def open_copy():
            copy = store.slot_files(uuids, path)
            try:
                size = copy.size()
            except FileNotFoundError:
                raise SnapshotIncompleteError(
                    f"snapshot {stored.record.snapshot_id} of {store.who}: chunk file "
                    f"slot {uuids[0]}: {path} is missing") from None
            if size != f.bytes:
                raise SnapshotCorruptError(f"slot {uuids[0]}: {path}", min(size, f.bytes),
                                           "file size", f"{size} bytes, record says {f.bytes}")
            return copy.range_reader()
        return open_copy

    try:
        store.slot_files(f.holders, path)
        reachable = True
    except SnapshotIncompleteError:
        if not f.durable:
            raise
        reachable = False
    if reachable:
        yield f"slot {f.slot}: {path}", opener(f.holders)
        for uuid in f.holders:
            yield f"slot {uuid}: {path}", opener([uuid])
    if f.durable:
        durable = store._path(*stored.dir, vertex, f.name)   # no slot holds it: the copy
        yield durable, lambda: store._backend.range_reader(durable)


def _checked_chunks(store: StoreView, stored, vid: int, entries, read, path: str):
    """The chunks of ``entries`` read through ``read`` (runs of adjacent chunks in one
    range), each header checked against the record."""
    runs, run = [], [entries[0]]
    for c in entries[1:]:
        prev = run[-1]
        if c.offset == prev.offset + HEADER_SIZE + prev.stored_size:
            run.append(c)
        else:
            runs.append(run)
            run = [c]
    runs.append(run)
    for run in runs:
        start = run[0].offset
        end = run[-1].offset + HEADER_SIZE + run[-1].stored_size
        chunks = read_chunks(read(start, end - start), path)
        if len(chunks) != len(run):
            raise SnapshotIncompleteError(
                f"{path}: {len(chunks)} chunks at bytes {start}..{end}, record says {len(run)}")
        for (rel, header, payload), expected in zip(chunks, run):
            offset = start + rel
            for what, got, want in (
                ("offset", offset, expected.offset),
                ("stored size", header.stored_size, expected.stored_size),
                ("checksum", header.checksum, expected.checksum),
                ("entry count", header.entry_count, expected.entry_count),
                ("job id", header.job_id, store.job_id),
                ("snapshot id", header.snapshot_id, stored.record.snapshot_id),
                ("vertex", header.vertex, vid), ("partition", header.partition,
                                                 expected.partition),
            ):
                if got != want:
                    raise SnapshotCorruptError(path, offset, what, f"{got}, record says {want}")
            yield header, payload, path, offset


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
           "read_file", "slot_path"]
