"""Deterministic, versioned placement of partition replicas on cluster members.

A :class:`PartitionTable` says which member holds each replica of each partition: replica index 0
is the primary (owner), indices ``1..backup_count`` are backups. Tables are immutable; a member
joining or leaving yields a new table that keeps every valid assignment and moves only what
balance needs, and :func:`migrations` lists the copy/promote/drop steps between two tables. The
rules follow Hazelcast (``shared/HAZELCAST.md`` section 2), except that placement is deterministic
and balanced to within one slot.

>>> table = PartitionTable.create(["a", "b", "c"], partition_count=7, backup_count=1)
>>> table.replicas(0)
('a', 'b')
>>> grown = table.with_member_added("d")
>>> for step in migrations(table, grown)[:2]:
...     print(step.partition, step.kind, step.source, "->", step.destination)
2 copy c -> d
2 drop b -> None
>>> PartitionTable.from_bytes(grown.to_bytes()) == grown
True
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sparkjet._placement import place
from sparkjet.errors import PartitionTableError

__all__ = [
    "DEFAULT_PARTITION_COUNT",
    "FORMAT_VERSION",
    "MAX_BACKUP_COUNT",
    "MAX_PARTITION_COUNT",
    "Migration",
    "PartitionTable",
    "PartitionTableError",
    "migrations",
]

DEFAULT_PARTITION_COUNT = 271
"""Hazelcast's default number of partitions."""

MAX_PARTITION_COUNT = 2**31 - 1
"""Largest partition count: partition ids must fit a signed 32-bit int."""

MAX_BACKUP_COUNT = 6
"""Hazelcast allows at most 6 backups (replica indices 1..6)."""

FORMAT_VERSION = 2
"""Newest version of the binary format written by :meth:`PartitionTable.to_bytes`: 2 for a
table with member groups; a table without groups is written in format 1, as before groups
existed, so its bytes (and what older readers accept) do not change."""

_MAGIC = b"SJPT"
# magic, format version, backup_count, partition_count, member count
_HEADER = struct.Struct("<4sHHII")
_NAME_LENGTH = struct.Struct("<H")
_CHECKSUM = struct.Struct("<I")
_MAX_NAME_BYTES = 0xFFFF  # a name's UTF-8 length must fit the u16 length prefix
_GROUP_INDEX = struct.Struct("<H")


@dataclass(frozen=True, slots=True)
class Migration:
    """One step that turns an old partition table into a new one.

    ``kind`` is one of:

    - ``"copy"``: ``destination`` receives a new copy of the partition from ``source`` and takes
      replica index ``replica_index``; ``source`` is ``None`` only when the old table had no copy
      at all (the replica starts empty);
    - ``"promote"`` / ``"demote"``: ``source`` (== ``destination``) already holds a copy and only
      moves to the lower / higher ``replica_index``; no data moves;
    - ``"drop"``: ``source`` discards its copy, which had replica index ``replica_index``;
      ``destination`` is ``None``.
    """

    partition: int
    kind: str
    source: str | None
    destination: str | None
    replica_index: int


def _require_int(name: str, value: object, low: int, high: int) -> int:
    # bool is an int subclass, but True partitions is always a caller's mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise PartitionTableError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise PartitionTableError(f"{name} must be in {low}..{high}, got {value}")
    return value


def _require_member_name(name: object) -> str:
    if not isinstance(name, str):
        raise PartitionTableError(
            f"member name must be a str, got {type(name).__name__}: {name!r}"
        )
    if not name:
        raise PartitionTableError("member name must not be empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PartitionTableError(
            f"member name {name!r} is not valid UTF-8: {exc.reason}"
        ) from None
    if len(encoded) > _MAX_NAME_BYTES:
        raise PartitionTableError(
            f"member name {name[:20]!r}... is {len(encoded)} UTF-8 bytes, "
            f"at most {_MAX_NAME_BYTES}"
        )
    return name


def _require_group_name(member: str, group: object) -> str:
    if not isinstance(group, str) or not group:
        raise PartitionTableError(f"the group of member {member!r} must be a non-empty str, "
                                  f"got {group!r}")
    if len(group.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES:
        raise PartitionTableError(f"the group of member {member!r} is longer than "
                                  f"{_MAX_NAME_BYTES} UTF-8 bytes")
    try:
        group.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PartitionTableError(f"group {group!r} is not valid UTF-8: {exc.reason}") from None
    return group


def _require_groups(members: tuple[str, ...], groups: object) -> tuple[str, ...] | None:
    """The group of each of ``members`` from the mapping ``groups`` (None: no groups)."""
    if groups is None:
        return None
    if not isinstance(groups, Mapping):
        raise PartitionTableError(f"groups must map each member to its group, got "
                                  f"{type(groups).__name__}")
    missing = [m for m in members if m not in groups]
    if missing:
        raise PartitionTableError(f"groups names no group for member(s) {missing[:5]}")
    unknown = [m for m in groups if m not in set(members)]
    if unknown:
        raise PartitionTableError(f"groups names member(s) not in the table: {unknown[:5]}")
    return tuple(_require_group_name(m, groups[m]) for m in members)


class PartitionTable:
    """Immutable, versioned placement of ``backup_count + 1`` replicas of every partition.

    Build one with :meth:`create` or :meth:`from_bytes`; change membership with
    :meth:`with_member_added` and :meth:`with_member_removed`, which return new tables.

    Guarantees of every table this class builds:

    - the replicas of one partition sit on distinct members;
    - for each replica index, every member holds ``partition_count // n`` or one more of that
      index's slots (``n`` members);
    - with fewer members than replicas (``n < backup_count + 1``) only replica indices
      ``0..n-1`` are filled, every member holds every partition once, and slots ``n..`` are
      ``None``;
    - placement depends only on the inputs (no randomness, no salted ``hash()``), so the same
      sequence of calls gives equal tables and equal bytes;
    - with member **groups** (Hazelcast's partition groups; sparkjet's are hosts), the replicas
      of one partition sit in distinct groups, so a host that fails takes at most one replica
      of each partition; only as many replica indices as there are groups are filled, and
      balance is within one slot when the groups are of equal size (as close as they allow
      otherwise).

    Each partition has a version that grows by one for every replica slot (partition, replica
    index) whose member changes; :attr:`version` sums them and :attr:`stamp` hashes them.
    """

    __slots__ = ("_members", "_positions", "_rows", "_versions", "_backup_count", "_stamp",
                 "_hash", "_groups")

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("use PartitionTable.create() or PartitionTable.from_bytes()")

    @classmethod
    def _make(
        cls,
        members: tuple[str, ...],
        backup_count: int,
        rows: tuple[tuple[str | None, ...], ...],
        versions: tuple[int, ...],
        groups: tuple[str, ...] | None = None,
    ) -> PartitionTable:
        table = object.__new__(cls)
        table._groups = groups
        table._members = members
        table._positions = {name: i for i, name in enumerate(members)}
        table._backup_count = backup_count
        table._rows = rows
        table._versions = versions
        packed = struct.pack(f"<{len(versions)}Q", *versions)
        table._stamp = int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")
        table._hash = hash((members, backup_count, rows, versions, groups))
        return table

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        members: Iterable[str],
        partition_count: int = DEFAULT_PARTITION_COUNT,
        backup_count: int = 1,
        groups: Mapping[str, str] | None = None,
    ) -> PartitionTable:
        """Place every replica of ``partition_count`` partitions on ``members``.

        ``members`` (unique, non-empty names) keep their order as the join order, which breaks
        ties in placement. ``groups`` maps every member to its group (its host, say): replicas
        of a partition then sit in distinct groups. Raises :class:`PartitionTableError` (a
        ``ValueError``) naming the bad argument.

        >>> PartitionTable.create(["a", "b"], partition_count=4, backup_count=1).replicas(1)
        ('b', 'a')
        """
        _require_int("partition_count", partition_count, 1, MAX_PARTITION_COUNT)
        _require_int("backup_count", backup_count, 0, MAX_BACKUP_COUNT)
        if isinstance(members, (str, bytes)):
            raise PartitionTableError(
                f"members must be a list of names, not a single {type(members).__name__}"
            )
        names = tuple(_require_member_name(name) for name in members)
        if not names:
            raise PartitionTableError("members must not be empty")
        seen: dict[str, None] = {}
        for name in names:
            if name in seen:
                raise PartitionTableError(f"duplicate member {name!r}")
            seen[name] = None
        group_names = _require_groups(names, groups)
        width = backup_count + 1
        empty_rows = ((None,) * width,) * partition_count
        empty = cls._make(names, backup_count, empty_rows, (0,) * partition_count, group_names)
        return empty._rebalanced(names, [[-1] * width for _ in range(partition_count)], [],
                                 group_names)

    # -- properties and lookups ------------------------------------------------------------

    @property
    def partition_count(self) -> int:
        """Number of partitions."""
        return len(self._rows)

    @property
    def backup_count(self) -> int:
        """Backups per partition (0..6); each partition has ``backup_count + 1`` slots."""
        return self._backup_count

    @property
    def members(self) -> tuple[str, ...]:
        """Member names in the order they joined."""
        return self._members

    @property
    def groups(self) -> dict[str, str] | None:
        """Each member's group, or None for a table without groups."""
        return None if self._groups is None else dict(zip(self._members, self._groups))

    def group_of(self, member: str) -> str | None:
        """``member``'s group (None in a table without groups)."""
        if member not in self._positions:
            raise PartitionTableError(f"unknown member {member!r}")
        return None if self._groups is None else self._groups[self._positions[member]]

    @property
    def version(self) -> int:
        """Table version: the sum of all partition versions; it grows with every change."""
        return sum(self._versions)

    @property
    def stamp(self) -> int:
        """Unsigned 64-bit BLAKE2b hash of all partition versions, equal across processes."""
        return self._stamp

    def _check_partition(self, partition: int) -> int:
        return _require_int("partition", partition, 0, len(self._rows) - 1)

    def owner(self, partition: int) -> str | None:
        """The member holding the primary replica of ``partition``, or ``None`` if unassigned."""
        return self._rows[self._check_partition(partition)][0]

    def replicas(self, partition: int) -> tuple[str | None, ...]:
        """Members holding replica indices ``0..backup_count`` of ``partition``; ``None`` marks
        an empty slot."""
        return self._rows[self._check_partition(partition)]

    def partition_version(self, partition: int) -> int:
        """Version of ``partition``: how many times one of its replica slots changed member."""
        return self._versions[self._check_partition(partition)]

    def partitions_of(self, member: str, replica_index: int = 0) -> list[int]:
        """Ascending ids of the partitions whose replica ``replica_index`` sits on ``member``."""
        if member not in self._positions:
            raise PartitionTableError(f"unknown member {member!r}")
        _require_int("replica_index", replica_index, 0, self._backup_count)
        return [p for p, row in enumerate(self._rows) if row[replica_index] == member]

    # -- membership changes ----------------------------------------------------------------

    def with_member_added(self, member: str, group: str | None = None) -> PartitionTable:
        """A new table with ``member`` joined (last in join order), rebalanced; ``group`` is
        its group, required in a table with groups and refused in one without.

        Every existing assignment stays unless its member must give up slots to reach balance.
        From a balanced table the primaries that change owner are exactly those the new member
        takes, at most ``ceil(partition_count / (n + 1))``.
        """
        _require_member_name(member)
        if member in self._positions:
            raise PartitionTableError(f"duplicate member {member!r}: already in the table")
        if (group is None) != (self._groups is None):
            raise PartitionTableError(
                f"member {member!r} needs a group: the table's members have groups"
                if group is None else
                f"member {member!r} has group {group!r}, but the table's members have none")
        groups = None if group is None else self._groups + (_require_group_name(member, group),)
        positions = self._positions
        rows = [[-1 if name is None else positions[name] for name in row] for row in self._rows]
        return self._rebalanced(self._members + (member,), rows, [], groups)

    def with_member_removed(self, member: str) -> PartitionTable:
        """A new table without ``member``, as after that member failed.

        For each partition ``member`` owned, the first surviving backup becomes owner and the
        other backups shift up one index; backups ``member`` held leave an empty slot. Empty
        slots are then filled on other members and balance is restored. From a balanced table
        the promoted owners always stay, and at most twice as many primaries change owner as
        ``member`` held.
        """
        if member not in self._positions:
            raise PartitionTableError(f"unknown member {member!r}: not in the table")
        if len(self._members) == 1:
            raise PartitionTableError(f"cannot remove {member!r}: it is the last member")
        members = tuple(name for name in self._members if name != member)
        groups = None if self._groups is None else tuple(
            g for name, g in zip(self._members, self._groups) if name != member)
        positions = {name: i for i, name in enumerate(members)}
        rows = []
        promoted = []
        for p, row in enumerate(self._rows):
            slots = [-1 if name is None or name == member else positions[name] for name in row]
            if row[0] == member:
                # Promotion: the surviving replicas close up in order, so the first backup leads.
                survivors = [m for m in slots if m >= 0]
                slots = survivors + [-1] * (len(slots) - len(survivors))
                if survivors:
                    promoted.append(p)
            rows.append(slots)
        return self._rebalanced(members, rows, promoted, groups)

    def _rebalanced(
        self, members: tuple[str, ...], rows: list[list[int]], promoted: list[int],
        groups: tuple[str, ...] | None,
    ) -> PartitionTable:
        """The table placing ``rows`` (member numbers into ``members``, -1 empty) in balance,
        keeping the owners of the ``promoted`` partitions where balance allows; replicas in
        distinct ``groups`` (one per member) when given."""
        pinned = [False] * len(rows)
        for p in promoted:
            pinned[p] = True
        numbers = None
        if groups is not None:
            index: dict[str, int] = {}
            numbers = [index.setdefault(g, len(index)) for g in groups]
        placed = place(len(members), rows, pinned, numbers)
        new_rows = tuple(tuple(None if m < 0 else members[m] for m in row) for row in placed)
        versions = tuple(
            version + sum(a != b for a, b in zip(old, new))
            for version, old, new in zip(self._versions, self._rows, new_rows)
        )
        return PartitionTable._make(members, self._backup_count, new_rows, versions, groups)

    # -- comparison between tables ---------------------------------------------------------

    def check_compatible(self, other: PartitionTable) -> None:
        """Raise :class:`PartitionTableError` unless ``other`` has the same partition count.

        Tables of different partition counts describe different key spaces and must never be
        compared or migrated between.
        """
        if not isinstance(other, PartitionTable):
            raise TypeError(f"expected a PartitionTable, got {type(other).__name__}")
        if other.partition_count != self.partition_count:
            raise PartitionTableError(
                f"incompatible partition tables: {self.partition_count} partitions "
                f"vs {other.partition_count}"
            )

    def is_stale_relative_to(self, other: PartitionTable) -> bool:
        """True if this table has a lower version than ``other``, so it must not replace it.

        Raises :class:`PartitionTableError` if the partition counts differ.
        """
        self.check_compatible(other)
        return self.version < other.version

    # -- serialization ---------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Serialize to the versioned binary format read by :meth:`from_bytes`.

        Layout, all little-endian: magic ``b"SJPT"``; u16 format version (1 without groups,
        2 with); u16 backup_count; u32 partition_count; u32 member count; per member (join
        order) a u16 byte length and the UTF-8 name; in format 2, a u32 group count, per group
        (order of first appearance) a u16 byte length and the UTF-8 name, and per member its
        u16 group index; per partition a u64 version and ``backup_count + 1`` i32 member
        indices (``-1`` for an empty slot); finally the u32 CRC-32 (``zlib.crc32``) of all
        preceding bytes.
        """
        header = _HEADER.pack(
            _MAGIC, 1 if self._groups is None else 2, self._backup_count, len(self._rows),
            len(self._members)
        )
        parts = [header]
        for name in self._members:
            encoded = name.encode("utf-8")
            parts.append(_NAME_LENGTH.pack(len(encoded)))
            parts.append(encoded)
        if self._groups is not None:
            index: dict[str, int] = {}
            numbers = [index.setdefault(g, len(index)) for g in self._groups]
            parts.append(struct.pack("<I", len(index)))
            for group in index:
                encoded = group.encode("utf-8")
                parts.append(_NAME_LENGTH.pack(len(encoded)))
                parts.append(encoded)
            parts.extend(_GROUP_INDEX.pack(n) for n in numbers)
        record = struct.Struct(f"<Q{self._backup_count + 1}i")
        positions = self._positions
        for version, row in zip(self._versions, self._rows):
            indices = (-1 if name is None else positions[name] for name in row)
            parts.append(record.pack(version, *indices))
        body = b"".join(parts)
        return body + _CHECKSUM.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> PartitionTable:
        """Read a table written by :meth:`to_bytes`.

        Every length is checked before use; truncated, corrupt or foreign input raises
        :class:`PartitionTableError` naming the problem and its byte offset, and input that is
        not bytes-like raises ``TypeError``.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"expected bytes, got {type(data).__name__}")
        members, backup_count, rows, versions, groups = _decode(bytes(data))
        return cls._make(members, backup_count, rows, versions, groups)

    # -- object protocol -------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PartitionTable):
            return NotImplemented
        return (
            self._members == other._members
            and self._backup_count == other._backup_count
            and self._versions == other._versions
            and self._rows == other._rows
            and self._groups == other._groups
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (
            f"PartitionTable(members={len(self._members)}, partitions={len(self._rows)}, "
            f"backups={self._backup_count}, version={self.version}, stamp=0x{self._stamp:016x})"
        )

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        # Pickling goes through the checked binary format because __init__ is closed.
        return (PartitionTable.from_bytes, (self.to_bytes(),))

    @staticmethod
    def migrations(old: PartitionTable, new: PartitionTable) -> list[Migration]:
        """Steps that turn ``old`` into ``new``; see the module function :func:`migrations`."""
        return migrations(old, new)


def migrations(old: PartitionTable, new: PartitionTable) -> list[Migration]:
    """Steps that turn ``old`` into ``new``, partition by partition in ascending order.

    Per partition: first ``"copy"`` steps (replica index order), then ``"promote"`` /
    ``"demote"`` role changes of members that already hold a copy, then ``"drop"`` steps.
    Copies come before drops so a partition never has fewer live copies than
    ``min(old copies, new copies)``. A copy's source is the first old replica (owner first)
    whose member is still in ``new``, else the first old replica. Raises
    :class:`PartitionTableError` if the partition counts differ.
    """
    old.check_compatible(new)
    new_members = set(new.members)
    steps: list[Migration] = []
    for p in range(old.partition_count):
        before = old.replicas(p)
        after = new.replicas(p)
        if before == after:
            continue
        held = {name: r for r, name in enumerate(before) if name is not None}
        wanted = {name: r for r, name in enumerate(after) if name is not None}
        # A member missing from the new table may have failed, so copy from a survivor if any.
        survivors = [name for name in held if name in new_members]
        source = survivors[0] if survivors else next(iter(held), None)
        for name, r in wanted.items():
            if name not in held:
                steps.append(Migration(p, "copy", source, name, r))
        for name, r in wanted.items():
            if name in held and held[name] != r:
                kind = "promote" if r < held[name] else "demote"
                steps.append(Migration(p, kind, name, name, r))
        for name, r in held.items():
            if name not in wanted:
                steps.append(Migration(p, "drop", name, None, r))
    return steps


# -- binary format -----------------------------------------------------------------------------


def _decode(
    data: bytes,
) -> tuple[tuple[str, ...], int, tuple[tuple[str | None, ...], ...], tuple[int, ...],
           tuple[str, ...] | None]:
    """Members, backup count, rows, versions and groups from :meth:`PartitionTable.to_bytes`
    output.

    First every length is checked against the data and the checksum verified; then the content
    is checked against the table's rules.
    """
    size = len(data)
    minimum = _HEADER.size + _CHECKSUM.size
    if size < minimum:
        raise PartitionTableError(
            f"truncated partition table: {size} bytes, the header alone needs {minimum}"
        )
    magic, fmt, backup_count, partition_count, member_count = _HEADER.unpack_from(data, 0)
    if magic != _MAGIC:
        raise PartitionTableError(
            f"not a partition table: magic {magic!r} at offset 0, expected {_MAGIC!r}"
        )
    if fmt not in (1, FORMAT_VERSION):
        raise PartitionTableError(
            f"unsupported partition table format version {fmt} at offset 4 "
            f"(this build reads 1 and {FORMAT_VERSION})"
        )
    end = size - _CHECKSUM.size
    offset = _HEADER.size
    # Each name takes at least its 2-byte prefix: reject absurd counts before looping over them.
    if member_count * _NAME_LENGTH.size > end - offset:
        raise PartitionTableError(
            f"truncated partition table: {member_count} members announced at offset 12 "
            f"but only {end - offset} bytes follow the header"
        )
    raw_names = []
    for i in range(member_count):
        if offset + _NAME_LENGTH.size > end:
            raise PartitionTableError(
                f"truncated partition table: length of member {i} at offset {offset}"
            )
        (length,) = _NAME_LENGTH.unpack_from(data, offset)
        offset += _NAME_LENGTH.size
        if offset + length > end:
            raise PartitionTableError(
                f"truncated partition table: member {i} needs {length} bytes at offset "
                f"{offset}, {end - offset} left"
            )
        raw_names.append((offset, data[offset : offset + length]))
        offset += length
    raw_groups: list[tuple[int, bytes]] = []
    group_numbers: list[tuple[int, int]] = []
    if fmt == 2:
        if offset + 4 > end:
            raise PartitionTableError(f"truncated partition table: group count at offset {offset}")
        (group_count,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if group_count * _NAME_LENGTH.size + member_count * _GROUP_INDEX.size > end - offset:
            raise PartitionTableError(
                f"truncated partition table: {group_count} groups announced at offset "
                f"{offset - 4} but only {end - offset} bytes follow")
        for i in range(group_count):
            if offset + _NAME_LENGTH.size > end:
                raise PartitionTableError(
                    f"truncated partition table: length of group {i} at offset {offset}")
            (length,) = _NAME_LENGTH.unpack_from(data, offset)
            offset += _NAME_LENGTH.size
            if offset + length > end:
                raise PartitionTableError(
                    f"truncated partition table: group {i} needs {length} bytes at offset "
                    f"{offset}, {end - offset} left")
            raw_groups.append((offset, data[offset : offset + length]))
            offset += length
        if offset + member_count * _GROUP_INDEX.size > end:
            raise PartitionTableError(
                f"truncated partition table: group indices of {member_count} members at "
                f"offset {offset}")
        for _ in range(member_count):
            group_numbers.append((offset, _GROUP_INDEX.unpack_from(data, offset)[0]))
            offset += _GROUP_INDEX.size
    record = struct.Struct(f"<Q{backup_count + 1}i")
    needed = partition_count * record.size
    if end - offset != needed:
        problem = "truncated" if end - offset < needed else "trailing bytes in"
        raise PartitionTableError(
            f"{problem} partition table: {partition_count} partitions need {needed} bytes "
            f"at offset {offset}, found {end - offset} before the checksum"
        )
    (stored,) = _CHECKSUM.unpack_from(data, end)
    computed = zlib.crc32(data[:end])
    if computed != stored:
        raise PartitionTableError(
            f"partition table checksum mismatch: stored 0x{stored:08x} at offset {end}, "
            f"computed 0x{computed:08x} (corrupt data)"
        )

    def invalid(problem: str) -> PartitionTableError:
        return PartitionTableError(f"invalid partition table: {problem}")

    if backup_count > MAX_BACKUP_COUNT:
        raise invalid(f"backup_count {backup_count} > {MAX_BACKUP_COUNT}")
    if not 1 <= partition_count <= MAX_PARTITION_COUNT:
        raise invalid(f"partition_count {partition_count}")
    if member_count == 0:
        raise invalid("no members")
    names: dict[str, None] = {}
    for i, (at, raw) in enumerate(raw_names):
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid(f"member {i} at offset {at} is not UTF-8") from None
        if not name:
            raise invalid(f"member {i} at offset {at} is empty")
        if name in names:
            raise invalid(f"duplicate member {name!r} at offset {at}")
        names[name] = None
    members = tuple(names)
    groups: tuple[str, ...] | None = None
    if fmt == 2:
        group_names = []
        for i, (at, raw) in enumerate(raw_groups):
            try:
                group = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise invalid(f"group {i} at offset {at} is not UTF-8") from None
            if not group or group in group_names:
                raise invalid(f"group {i} at offset {at} is empty or repeated")
            group_names.append(group)
        for at, number in group_numbers:
            if number >= len(group_names):
                raise invalid(f"group index {number} at offset {at}, table has "
                              f"{len(group_names)} groups")
        groups = tuple(group_names[n] for _, n in group_numbers)
    rows = []
    versions = []
    for p, (version, *row) in enumerate(record.iter_unpack(data[offset:end])):
        where = f"partition {p} (offset {offset + p * record.size})"
        for m in row:
            if not -1 <= m < member_count:
                raise invalid(f"{where} names member index {m}, table has {member_count} members")
        holders = [m for m in row if m >= 0]
        if len(set(holders)) != len(holders):
            raise invalid(f"{where} places two replicas on one member")
        if groups is not None and len({groups[m] for m in holders}) != len(holders):
            raise invalid(f"{where} places two replicas in one group")
        rows.append(tuple(None if m < 0 else members[m] for m in row))
        versions.append(version)
    return members, backup_count, tuple(rows), tuple(versions), groups
