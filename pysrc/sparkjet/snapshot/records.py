"""The snapshot store's metadata as typed schemas: log events, validation records and
export records (msgspec Structs).

Every byte string the store reads back goes through :func:`decode`, which checks each
field's type and bounds while it parses: a truncated, hand-edited or hostile file raises
:class:`~sparkjet.errors.SnapshotCorruptError` naming the file and the field
(``$.vertices[...].files[0].chunks[3][1]``), never a ``KeyError`` or ``OverflowError``
later, from whatever used the value. The bounds are those of the chunk header fields the
values are compared with (``native/include/sparkjet/chunk.h``), so a value that passes
here fits every use. The JSON written is what ``json.dumps(..., sort_keys=True)`` wrote
before these schemas, less the spaces; both decode.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal, TypeVar

import msgspec

from sparkjet.errors import InvalidArgumentError, SnapshotCorruptError
from sparkjet.snapshot.chunks import HEADER_SIZE

RECORD_FORMAT = 1
#: The format of a record whose chunk files live in the members' storage slots
#: (``storage="members"``): each file names its slot, and the record holds the partition
#: table of the execution that wrote it. Format 1 (the shared store) is written as before.
RECORD_FORMAT_SLOTS = 2

# msgspec bounds stop at int64: a Uint64 field's upper bound is checked in __post_init__.
Uint64 = Annotated[int, msgspec.Meta(ge=0)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]       # sums of chunk fields
Uint32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Partition = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]  # -1: broadcast state
Seconds = Annotated[float, msgspec.Meta(ge=0)]
# Vertex and export names become path components: never empty, "." or "..", no separator.
NAME_PATTERN = r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,100}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
SnapshotDir = Annotated[str, msgspec.Meta(pattern=r"^-?[0-9]{12,20}-e[0-9]{12,20}$")]
RecordFile = Annotated[str, msgspec.Meta(pattern=r"^_validation-[0-9a-f]{16}\.json$")]
Xxh3 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}$")]
ExportData = Annotated[str, msgspec.Meta(pattern=r"^d-[0-9a-f]{16}$")]
TableDigest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
SlotUuid = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-"
                                               r"[0-9a-f]{4}-[0-9a-f]{12}$")]


_CHUNK_FILE = re.compile(r"-?[0-9]{1,20}-[0-9]{1,20}\.chunks")  # writer-call.chunks


class ChunkEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One chunk as the record lists it (a JSON array, as written since format 1)."""

    offset: Count
    stored_size: Uint32
    checksum: Uint64
    entry_count: Uint32
    partition: Partition

    def __post_init__(self):
        _check_uint64("checksum", self.checksum)


class FileRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One chunk file of a vertex: ``path`` is ``VERTEX/W-C.chunks``; ``slot``, the storage
    slot that wrote it (format 2), else the store's snapshot folder; ``replicas``, the
    slots that hold a verified copy of it (the backups of its partitions, each holding the
    byte ranges of those it backs, as the record's table says; broadcast state whole)."""

    vertex: Name
    path: str
    bytes: Count
    chunks: list[ChunkEntry]
    slot: SlotUuid | None = None
    replicas: list[SlotUuid] = []
    #: a file in a slot: whether the store's snapshot folder holds a copy too (the
    #: durable tier, ``durable_tier="sync"``; ``"async"`` uploads after the commit, which
    #: the snapshot folder's mark records instead: ``SnapshotStore.mark_durable``)
    durable: bool = False

    @property
    def holders(self) -> list[str]:
        """The slots that hold the file, the one that wrote it first."""
        return ([self.slot] if self.slot is not None else []) + list(self.replicas)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def in_store(self) -> bool:
        """Whether the store's snapshot folder holds the file: written there (the shared
        store), or a slot's file with its durable copy."""
        return self.slot is None or self.durable

    def __post_init__(self):
        vertex, _, name = self.path.partition("/")
        if vertex != self.vertex or not _CHUNK_FILE.fullmatch(name):
            raise ValueError(f"path {self.path!r} is not {self.vertex}/W-C.chunks")
        # Chunks back to back from byte 0 to the end: a reader's ranges stay in the file.
        end = 0
        for i, c in enumerate(self.chunks):
            if c.offset != end:
                raise ValueError(f"chunk {i} starts at byte {c.offset}, not {end}")
            end += HEADER_SIZE + c.stored_size
        if end != self.bytes:
            raise ValueError(f"the chunks end at byte {end}, the file at {self.bytes}")


class VertexRecord(msgspec.Struct, frozen=True):
    id: Uint32
    files: list[FileRecord]


class ValidationRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a complete snapshot holds: every file and chunk, by vertex."""

    format: Literal[1, 2]
    job_id: Uint64
    snapshot_id: Int64
    execution_id: Count
    created: Seconds
    chunk_count: Count
    bytes: Count
    entries: Count
    vertices: dict[Name, VertexRecord]
    tables: list[TableDigest] = []
    #: format 2: the execution's partition table (base64 of ``PartitionTable.to_bytes``)
    table: str | None = None
    #: format 2: the DAG's fingerprint (JSON), which a driver reads without the slots
    plan: str | None = None

    def __post_init__(self):
        _check_uint64("job_id", self.job_id)
        files = [f for v in self.vertices.values() for f in v.files]
        in_slots = any(f.slot is not None for f in files)
        if in_slots != (self.format == 2):
            raise ValueError(f"format {self.format} with files {'in' if in_slots else 'outside'} "
                             "storage slots")
        for name, v in self.vertices.items():
            if any(f.vertex != name for f in v.files):
                raise ValueError(f"vertex {name!r} lists another vertex's file")
        for field, want in (("chunk_count", sum(len(f.chunks) for f in files)),
                            ("bytes", sum(f.bytes for f in files)),
                            ("entries", sum(c.entry_count for f in files for c in f.chunks))):
            if getattr(self, field) != want:
                raise ValueError(f"{field} is {getattr(self, field)}, the files add up to {want}")


class RegisterEvent(msgspec.Struct, frozen=True, tag_field="type", tag="register"):
    """Execution ``execution`` starts; every older one is fenced off."""

    execution: Count
    time: Seconds


class CommitEvent(msgspec.Struct, frozen=True, tag_field="type", tag="commit"):
    """Snapshot ``snapshot`` of ``execution`` is complete; its record is
    ``snapshots/RECORD/RECORD_FILE`` and has the xxh3 ``record_xxh3``."""

    snapshot: Int64
    execution: Count
    record: SnapshotDir
    record_file: RecordFile
    record_xxh3: Xxh3
    time: Seconds


class RollbackEvent(msgspec.Struct, frozen=True, tag_field="type", tag="rollback"):
    """Every complete snapshot newer than ``snapshot`` committed before this event is set
    aside (``replaced``, for people): restore takes ``snapshot`` again, and snapshots
    committed after this event count as usual. Appended by an explicit rollback (``sparkjet
    snapshots rollback``, ``JobConfig.initial_snapshot``) or by a restore that fell back
    past snapshots that failed to verify (``reason`` says which)."""

    snapshot: Int64
    replaced: list[Int64]
    reason: str
    time: Seconds


LogEvent = RegisterEvent | CommitEvent | RollbackEvent


class ExportRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """``exports/NAME/_export.json``: which record an exported snapshot holds, and on object
    stores the folder under ``exports/NAME`` its files are in (``data``; on local disks and
    HDFS they are in ``exports/NAME`` itself, and the field is left out)."""

    name: Name
    snapshot: Int64
    execution: Count
    record_file: RecordFile
    record_xxh3: Xxh3
    exported: Seconds
    data: ExportData | None = None


def _check_uint64(field: str, value: int) -> None:
    if value >= 2**64:
        raise ValueError(f"{field} {value} does not fit 64 bits")


T = TypeVar("T")

_decoders: dict = {}


def decode(data, kind: type[T], path: str, what: str) -> T:
    """``data`` (JSON bytes) as a ``kind``; any other content raises
    SnapshotCorruptError naming ``path`` and the field."""
    try:
        return _decoder(kind).decode(data)
    # ValidationError is a DecodeError; a string that is not UTF-8 raises neither.
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise SnapshotCorruptError(path, 0, what, str(e)) from None


def convert(value, kind: type[T], what: str) -> T:
    """Python data (such as a writer's manifest) as a ``kind``, else InvalidArgumentError."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        raise InvalidArgumentError(f"{what}: {e}") from None


def encode(value, kind) -> bytes:
    """``value`` as compact JSON with sorted keys, checked to decode as a ``kind`` again:
    what the store writes, it can read (a value out of the schema's bounds raises
    InvalidArgumentError here, before anything is written)."""
    data = msgspec.json.encode(value, order="sorted")
    try:
        _decoder(kind).decode(data)
    except msgspec.DecodeError as e:
        raise InvalidArgumentError(f"refusing to write a {_name(kind)} that would not read "
                                   f"back: {e}") from None
    return data


def _decoder(kind) -> msgspec.json.Decoder:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    return decoder


def _name(kind) -> str:
    return getattr(kind, "__name__", "log event")
