"""Tests for sparkjet.partition_table: placement rules, movement bounds, versions, migrations and
the binary format."""

import functools
import hashlib
import math
import os
import pickle
import struct
import subprocess
import sys
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjet import _placement
from sparkjet.partition_table import Migration, PartitionTable, PartitionTableError, migrations

P = 271


# -- helpers -----------------------------------------------------------------------------------


def check_invariants(table):
    """Assert the placement rules every table must satisfy."""
    n = len(table.members)
    width = table.backup_count + 1
    filled = min(n, width)
    for p in range(table.partition_count):
        row = table.replicas(p)
        assert len(row) == width
        assert all(name is not None for name in row[:filled]), (p, row)
        assert all(name is None for name in row[filled:]), (p, row)
        assert len(set(row[:filled])) == filled, f"partition {p} has two replicas on one member"
        assert table.owner(p) == row[0]
    low, high = table.partition_count // n, -(-table.partition_count // n)
    for r in range(filled):
        counts = [len(table.partitions_of(m, r)) for m in table.members]
        assert sum(counts) == table.partition_count
        assert all(low <= c <= high for c in counts), (r, counts)


def changed_slots(old, new, p):
    return sum(a != b for a, b in zip(old.replicas(p), new.replicas(p)))


def changed_owners(old, new):
    return sum(old.owner(p) != new.owner(p) for p in range(old.partition_count))


def check_versions(old, new):
    """Each partition's version grows by exactly its number of changed slots."""
    for p in range(old.partition_count):
        assert new.partition_version(p) - old.partition_version(p) == changed_slots(old, new, p)
    total = sum(changed_slots(old, new, p) for p in range(old.partition_count))
    assert new.version - old.version == total
    assert (new.stamp != old.stamp) == (total > 0)


def simulate(old, new, steps):
    """Apply ``steps`` to old's replica sets; assert live copies never drop below
    min(old copies, new copies) and that the end state is exactly new's placement."""
    for p in range(old.partition_count):
        roles = {name: r for r, name in enumerate(old.replicas(p)) if name is not None}
        floor = min(len(roles), sum(name is not None for name in new.replicas(p)))
        for step in (s for s in steps if s.partition == p):
            if step.kind == "copy":
                assert step.destination not in roles
                assert step.source is None or step.source in roles, step
                roles[step.destination] = step.replica_index
            elif step.kind in ("promote", "demote"):
                assert step.source == step.destination and step.source in roles
                assert (step.replica_index < roles[step.source]) == (step.kind == "promote")
                roles[step.source] = step.replica_index
            else:
                assert step.kind == "drop" and step.destination is None
                assert roles.pop(step.source) == step.replica_index
            assert len(roles) >= floor, step
        expected = {name: r for r, name in enumerate(new.replicas(p)) if name is not None}
        assert roles == expected, p


@functools.cache
def grown(backup_count):
    """Tables with 1, 2, ..., 33 members (m0, m1, ...), each from the previous by one join."""
    tables = [PartitionTable.create(["m0"], P, backup_count)]
    for i in range(1, 33):
        tables.append(tables[-1].with_member_added(f"m{i}"))
    return tuple(tables)


def reseal(body):
    """Append a correct checksum, to test what the checks behind the checksum reject."""
    return body + struct.pack("<I", zlib.crc32(body))


# -- construction and validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partition_count": 0}, "partition_count must be in 1..2147483647, got 0"),
        ({"partition_count": -5}, "partition_count must be in 1..2147483647, got -5"),
        ({"partition_count": 2**31}, "partition_count must be in 1..2147483647, got 2147483648"),
        ({"partition_count": "271"}, "partition_count must be an int, got str"),
        ({"partition_count": True}, "partition_count must be an int, got bool"),
        ({"backup_count": 7}, "backup_count must be in 0..6, got 7"),
        ({"backup_count": -1}, "backup_count must be in 0..6, got -1"),
        ({"backup_count": 1.0}, "backup_count must be an int, got float"),
    ],
)
def test_create_rejects_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        PartitionTable.create(["a", "b"], **kwargs)
    assert isinstance(info.value, PartitionTableError)


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([], "members must not be empty"),
        (["a", "b", "a"], "duplicate member 'a'"),
        (["a", ""], "member name must not be empty"),
        (["a", 7], "member name must be a str, got int: 7"),
        ("ab", "members must be a list of names, not a single str"),
        (["\ud800"], "not valid UTF-8"),
        (["x" * 65536], "65536 UTF-8 bytes, at most 65535"),
    ],
)
def test_create_rejects_bad_members(members, message):
    with pytest.raises(PartitionTableError, match=message):
        PartitionTable.create(members)


def test_membership_changes_reject_bad_members():
    table = PartitionTable.create(["a", "b"], 7)
    with pytest.raises(PartitionTableError, match="duplicate member 'b': already in the table"):
        table.with_member_added("b")
    with pytest.raises(PartitionTableError, match="member name must not be empty"):
        table.with_member_added("")
    with pytest.raises(PartitionTableError, match="unknown member 'zed': not in the table"):
        table.with_member_removed("zed")
    single = PartitionTable.create(["solo"], 7)
    with pytest.raises(PartitionTableError, match="cannot remove 'solo': it is the last member"):
        single.with_member_removed("solo")


def test_lookups_reject_bad_arguments():
    table = PartitionTable.create(["a", "b"], 7, 2)
    with pytest.raises(PartitionTableError, match="partition must be in 0..6, got 7"):
        table.owner(7)
    with pytest.raises(PartitionTableError, match="partition must be in 0..6, got -1"):
        table.replicas(-1)
    with pytest.raises(PartitionTableError, match="partition must be in 0..6"):
        table.partition_version(100)
    with pytest.raises(PartitionTableError, match="unknown member 'c'"):
        table.partitions_of("c")
    with pytest.raises(PartitionTableError, match="replica_index must be in 0..2, got 3"):
        table.partitions_of("a", 3)


def test_constructor_is_closed():
    with pytest.raises(TypeError, match=r"use PartitionTable.create\(\) or .*from_bytes\(\)"):
        PartitionTable()


def test_properties_and_repr():
    table = PartitionTable.create(["a", "b", "c"], backup_count=1)
    assert table.partition_count == 271
    assert table.backup_count == 1
    assert table.members == ("a", "b", "c")
    # Built from an empty table, every filled slot counted as one change.
    assert table.version == 2 * 271
    assert all(table.partition_version(p) == 2 for p in range(271))
    assert 0 <= table.stamp < 2**64
    assert repr(table) == (
        "PartitionTable(members=3, partitions=271, backups=1, version=542, "
        f"stamp=0x{table.stamp:016x})"
    )
    assert table.partitions_of("a", 1) == sorted(table.partitions_of("a", 1))


# -- placement rules ---------------------------------------------------------------------------


@pytest.mark.parametrize("backup_count", range(7))
@pytest.mark.parametrize("partition_count", [1, 2, 7, 64, 271])
def test_create_is_valid_and_balanced(partition_count, backup_count):
    for n in range(1, 11):
        members = [f"m{i}" for i in range(n)]
        check_invariants(PartitionTable.create(members, partition_count, backup_count))


def test_fewer_members_than_replicas_fill_only_n_indices():
    table = PartitionTable.create(["a", "b"], 271, backup_count=3)
    for p in range(271):
        row = table.replicas(p)
        assert set(row[:2]) == {"a", "b"} and row[2:] == (None, None)
    assert [len(table.partitions_of(m, r)) for r in (0, 1) for m in "ab"] == [136, 135, 135, 136]
    for r in (2, 3):
        assert table.partitions_of("a", r) == table.partitions_of("b", r) == []
    # A third member opens replica index 2 and stays balanced.
    check_invariants(table.with_member_added("c"))


def test_placement_is_deterministic():
    def history():
        table = PartitionTable.create(["a", "b", "c", "d"], 271, 2)
        table = table.with_member_added("e").with_member_removed("b").with_member_added("f")
        return table.with_member_removed("a")

    first, second = history(), history()
    assert first == second and hash(first) == hash(second)
    assert first.to_bytes() == second.to_bytes()
    assert first.stamp == second.stamp


def test_placement_does_not_depend_on_the_hash_seed():
    # str hashes are salted per process: run the same history under two seeds.
    script = (
        "import hashlib\n"
        "from sparkjet.partition_table import PartitionTable\n"
        "t = PartitionTable.create([f'm{i}' for i in range(9)], 271, 3)\n"
        "t = t.with_member_removed('m4').with_member_added('x').with_member_removed('m0')\n"
        "print(hashlib.sha256(t.to_bytes()).hexdigest())\n"
    )
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    here = PartitionTable.create([f"m{i}" for i in range(9)], 271, 3)
    here = here.with_member_removed("m4").with_member_added("x").with_member_removed("m0")
    assert digests == {hashlib.sha256(here.to_bytes()).hexdigest()}


# -- movement when members join and leave --------------------------------------------------------


@pytest.mark.parametrize("backup_count", range(4))
def test_join_moves_only_what_balance_needs(backup_count):
    tables = grown(backup_count)
    width = backup_count + 1
    for n in range(1, 33):
        old, new = tables[n - 1], tables[n]
        joined = f"m{n}"
        check_invariants(new)
        check_versions(old, new)
        moved = changed_owners(old, new)
        # From a balanced table every old member holds at least P // (n + 1) primaries, and the
        # extra slot goes to those holding most, so no old member is below its target: only the
        # new member receives primaries. That is tighter than the required ceil(P/(n+1)) + n.
        assert moved == len(new.partitions_of(joined)) <= math.ceil(P / (n + 1))
        assert moved <= math.ceil(P / (n + 1)) + n
        # Per replica index the same bound: the new member's share plus at most one slot per old
        # member (the +1 targets of backup indices follow the members' total load, which may
        # differ from who held the extra slot before). Newly opened slots (n < backup_count + 1)
        # are not moves.
        opened = sum(old.replicas(p)[r] is None for p in range(P) for r in range(width))
        opened -= sum(new.replicas(p)[r] is None for p in range(P) for r in range(width))
        moves = sum(changed_slots(old, new, p) for p in range(P)) - opened
        assert moves <= min(n, width) * (math.ceil(P / (n + 1)) + n)


@pytest.mark.parametrize("backup_count", range(4))
def test_leave_promotes_first_backup_and_moves_little(backup_count):
    width = backup_count + 1
    for before in grown(backup_count)[1:]:
        n = len(before.members)
        share = math.ceil(P / (n - 1))
        for gone in sorted({before.members[0], before.members[n // 2], before.members[-1]}):
            after = before.with_member_removed(gone)
            check_invariants(after)
            check_versions(before, after)
            owned = before.partitions_of(gone)
            held_slots = sum(len(before.partitions_of(gone, r)) for r in range(width))
            if backup_count:
                for p in owned:
                    assert after.owner(p) == before.replicas(p)[1], p
            # Owners change for the partitions `gone` owned, plus those shed by members pushed
            # over their target by promotions. Targets can be chosen so no member is over before
            # its promotions, and the +1 targets go to the members holding most, so the shed
            # surplus is at most the number of promotions: moved <= 2 * owned, which is below the
            # required owned + ceil(P/(n-1)) because owned <= ceil(P/n).
            moved = changed_owners(before, after)
            assert moved <= 2 * len(owned) <= len(owned) + share
            if backup_count == 0:
                assert moved == len(owned)
            # Slots change where `gone` held one, where a backup shifted up behind a promotion
            # (mandated), and where balance needs a move: promotions and shifts add at most one
            # slot per partition `gone` owned to any replica index, so each index moves at most
            # ceil(P/(n-1)) more.
            shifted = sum(
                before.replicas(p)[r] is not None for p in owned for r in range(1, width)
            )
            filled = min(n - 1, width)
            changed = sum(changed_slots(before, after, p) for p in range(P))
            assert changed <= held_slots + shifted + filled * share
            # Partitions `gone` had no replica of mostly keep their replica sets.
            untouched = [p for p in range(P) if gone not in before.replicas(p)]
            disturbed = sum(before.replicas(p) != after.replicas(p) for p in untouched)
            assert disturbed <= filled * share


def test_leave_then_join_keeps_balance_and_promotion_with_six_backups():
    table = PartitionTable.create([f"m{i}" for i in range(9)], 271, 6)
    for gone in ("m3", "m0", "m8"):
        smaller = table.with_member_removed(gone)
        check_invariants(smaller)
        owned = table.partitions_of(gone)
        for p in owned:
            assert smaller.owner(p) == table.replicas(p)[1]
        # The other backups shift up in order; restoring balance afterwards may move a few.
        shifted = sum(smaller.replicas(p)[1:6] == table.replicas(p)[2:7] for p in owned)
        assert shifted >= 0.75 * len(owned)
        table = smaller.with_member_added(gone + "-again")
        check_invariants(table)


# -- migrations ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backup_count", range(4))
def test_migrations_replay_joins_and_leaves(backup_count):
    tables = grown(backup_count)
    for n in (1, 2, 3, 5, 8, 32):
        old, new = tables[n - 1], tables[n]
        simulate(old, new, migrations(old, new))
        shrunk = new.with_member_removed("m0")
        steps = PartitionTable.migrations(new, shrunk)
        # Copies come from survivors; without backups the leaver holds the only copy.
        sources = {step.source for step in steps if step.kind == "copy"}
        assert ("m0" in sources) == (backup_count == 0)
        simulate(new, shrunk, steps)


def test_migration_kinds():
    old = PartitionTable.create(["a", "b", "c"], 7, 1)
    new = old.with_member_removed("a")
    steps = migrations(old, new)
    assert steps == sorted(steps, key=lambda s: s.partition)
    promoted = {s.partition for s in steps if s.kind == "promote"}
    assert promoted == set(old.partitions_of("a"))
    for s in steps:
        if s.kind == "promote":
            assert s.replica_index == 0 and s.source == s.destination == new.owner(s.partition)
    # The lost member's copies are dropped last within each partition.
    for p in {s.partition for s in steps}:
        kinds = [s.kind for s in steps if s.partition == p]
        assert kinds == sorted(kinds, key=["copy", "promote", "demote", "drop"].index)
    assert migrations(old, old) == []
    step = steps[0]
    assert isinstance(step, Migration)
    with pytest.raises(AttributeError):
        step.kind = "copy"


def test_migrations_between_partition_counts_fail():
    small = PartitionTable.create(["a"], 7)
    with pytest.raises(PartitionTableError, match="incompatible partition tables: 7 .* vs 271"):
        migrations(small, PartitionTable.create(["a"]))


# -- staleness and compatibility -----------------------------------------------------------------


def test_staleness_follows_version():
    old = PartitionTable.create(["a", "b"], 31, 1)
    new = old.with_member_added("c")
    assert new.version > old.version
    assert old.is_stale_relative_to(new)
    assert not new.is_stale_relative_to(old)
    assert not new.is_stale_relative_to(new)
    old.check_compatible(new)


def test_compatibility_requires_same_partition_count():
    table = PartitionTable.create(["a"], 271)
    other = PartitionTable.create(["a"], 1024)
    with pytest.raises(PartitionTableError, match="incompatible partition tables: 271 .* vs 1024"):
        table.check_compatible(other)
    with pytest.raises(PartitionTableError, match="incompatible"):
        table.is_stale_relative_to(other)
    with pytest.raises(TypeError, match="expected a PartitionTable, got bytes"):
        table.check_compatible(b"SJPT")


def test_equality_and_hash():
    a = PartitionTable.create(["a", "b"], 7)
    assert a == PartitionTable.create(["a", "b"], 7)
    assert a != PartitionTable.create(["b", "a"], 7)
    assert a != PartitionTable.create(["a", "b"], 7, 0)
    assert a != a.with_member_added("c").with_member_removed("c")  # same members, newer versions
    assert len({a, PartitionTable.create(["a", "b"], 7)}) == 1
    assert a != "a"


# -- binary format -------------------------------------------------------------------------------

GOLDEN = bytes.fromhex(
    "534a5054"  # magic "SJPT"
    "0100"  # format version 1
    "0200"  # backup_count 2
    "02000000"  # partition_count 2
    "02000000"  # 2 members, in join order:
    "0100" "61"  # "a"
    "0200" "c3a9"  # "é"
    "0200000000000000" "00000000" "01000000" "ffffffff"  # partition 0: version 2, a, é, empty
    "0200000000000000" "01000000" "00000000" "ffffffff"  # partition 1: version 2, é, a, empty
    "13b4e267"  # CRC-32 of everything before
)


def test_golden_bytes_keep_decoding():
    table = PartitionTable.from_bytes(GOLDEN)
    assert table.members == ("a", "é")
    assert table.backup_count == 2
    assert [table.replicas(p) for p in range(2)] == [("a", "é", None), ("é", "a", None)]
    assert [table.partition_version(p) for p in range(2)] == [2, 2]
    assert table.to_bytes() == GOLDEN


@pytest.mark.parametrize(
    "table",
    [
        PartitionTable.create(["a"], 1, 0),
        PartitionTable.create(["a", "b", "c"], 271, 6),
        PartitionTable.create(["ключ", "日本", "x" * 300], 64, 2)
        .with_member_added("a")
        .with_member_removed("日本"),
        grown(3)[20],
    ],
)
def test_round_trip(table):
    data = table.to_bytes()
    assert data[:4] == b"SJPT"
    back = PartitionTable.from_bytes(data)
    assert back == table and back.to_bytes() == data
    assert back.stamp == table.stamp and back.version == table.version
    assert PartitionTable.from_bytes(bytearray(data)) == table
    assert PartitionTable.from_bytes(memoryview(data)) == table
    assert pickle.loads(pickle.dumps(table)) == table


def test_every_truncation_is_rejected():
    data = PartitionTable.create(["a", "bb", "ccc"], 5, 2).to_bytes()
    for size in range(len(data)):
        with pytest.raises(PartitionTableError):
            PartitionTable.from_bytes(data[:size])
    with pytest.raises(PartitionTableError, match="truncated partition table: 0 bytes"):
        PartitionTable.from_bytes(b"")
    with pytest.raises(PartitionTableError, match="trailing bytes"):
        PartitionTable.from_bytes(data + b"\0")


def test_every_bit_flip_is_rejected():
    # CRC-32 detects every single-bit error; the structural checks may fire first.
    data = PartitionTable.create(["a", "bb", "ccc"], 5, 2).to_bytes()
    for bit in range(8 * len(data)):
        corrupt = bytearray(data)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(PartitionTableError):
            PartitionTable.from_bytes(bytes(corrupt))


def test_corruption_messages_name_the_problem():
    data = PartitionTable.create(["a", "b"], 3, 1).to_bytes()
    with pytest.raises(PartitionTableError, match=r"not a partition table: magic b'XXXX'"):
        PartitionTable.from_bytes(b"XXXX" + data[4:])
    future = data[:4] + struct.pack("<H", 3) + data[6:]
    with pytest.raises(PartitionTableError, match="unsupported partition table format version 3"):
        PartitionTable.from_bytes(future)
    flipped = data[:-6] + bytes([data[-6] ^ 0x40]) + data[-5:]
    with pytest.raises(PartitionTableError, match="checksum mismatch: stored 0x"):
        PartitionTable.from_bytes(flipped)
    huge = data[:12] + struct.pack("<I", 2**32 - 1) + data[16:]
    with pytest.raises(PartitionTableError, match="4294967295 members announced at offset 12"):
        PartitionTable.from_bytes(huge)
    with pytest.raises(TypeError, match="expected bytes, got str"):
        PartitionTable.from_bytes("SJPT")


def _body(backup_count=1, partition_count=1, names=(b"a", b"b"), records=((0, 0, 1),)):
    parts = [struct.pack("<4sHHII", b"SJPT", 1, backup_count, partition_count, len(names))]
    parts += [struct.pack("<H", len(name)) + name for name in names]
    parts += [struct.pack(f"<Q{len(rec) - 1}i", *rec) for rec in records]
    return b"".join(parts)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_body(), None),
        (_body(names=(b"a", b"a")), "duplicate member 'a'"),
        (_body(names=(b"a", b"")), "member 1 at offset 21 is empty"),
        (_body(names=(b"a", b"\xff")), "member 1 at offset 21 is not UTF-8"),
        (_body(names=()), "no members"),
        (_body(records=((0, 0, 2),)), "partition 0 .offset 22. names member index 2, table has 2"),
        (_body(records=((0, -2, 1),)), "partition 0 .offset 22. names member index -2"),
        (_body(records=((0, 1, 1),)), "partition 0 .* places two replicas on one member"),
        (_body(backup_count=7, records=((0, 0, 1, -1, -1, -1, -1, -1, -1),)), "backup_count 7 > 6"),
        (_body(partition_count=0, records=()), "partition_count 0"),
    ],
)
def test_well_sealed_but_invalid_tables_are_rejected(body, message):
    if message is None:
        assert PartitionTable.from_bytes(reseal(body)).replicas(0) == ("a", "b")
    else:
        with pytest.raises(PartitionTableError, match=f"invalid partition table: {message}"):
            PartitionTable.from_bytes(reseal(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_is_rejected(data):
    with pytest.raises(PartitionTableError):
        PartitionTable.from_bytes(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_garbage_after_a_valid_header_is_rejected(tail):
    with pytest.raises(PartitionTableError):
        PartitionTable.from_bytes(b"SJPT\x01\x00" + tail)


# -- randomized histories ----------------------------------------------------------------------

# (remove?, which member) pairs; a removal from a single-member table becomes a join.
operations = st.lists(
    st.tuples(st.booleans(), st.integers(min_value=0, max_value=1000)), max_size=12
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    partition_count=st.integers(min_value=1, max_value=60),
    backup_count=st.integers(min_value=0, max_value=6),
    initial=st.integers(min_value=1, max_value=9),
    ops=operations,
)
def test_random_histories_keep_every_rule(partition_count, backup_count, initial, ops):
    table = PartitionTable.create([f"m{i}" for i in range(initial)], partition_count, backup_count)
    check_invariants(table)
    joined = initial
    for remove, pick in ops:
        if remove and len(table.members) > 1:
            gone = table.members[pick % len(table.members)]
            new = table.with_member_removed(gone)
            owned = table.partitions_of(gone)
            if backup_count:
                for p in owned:
                    assert new.owner(p) == table.replicas(p)[1]
            assert changed_owners(table, new) <= 2 * len(owned)
        else:
            new = table.with_member_added(f"m{joined}")
            assert changed_owners(table, new) == len(new.partitions_of(f"m{joined}"))
            joined += 1
        check_invariants(new)
        check_versions(table, new)
        simulate(table, new, migrations(table, new))
        assert PartitionTable.from_bytes(new.to_bytes()) == new
        table = new


def test_column_overflows_rather_than_leaving_a_slot_empty():
    # Only reachable if no balanced assignment exists, which tables built by this module never
    # produce: here every partition already has member 0 at replica index 0, so members 1 and 2
    # must take all three backup slots although balance allows one each.
    placed = [[0, -1], [0, -1], [0, -1]]
    rows = [[-1, -1] for _ in range(3)]
    column = _placement._Column(3, 1, 2, rows, placed, [3, 0, 0], None).solve()
    assert sorted(column) == [1, 1, 2]


# -- member groups (hosts) -----------------------------------------------------------------------


def check_groups(table, balanced=True):
    """Replicas of a partition in distinct groups, as many filled as there are groups (up to
    the width), and per replica index each member within one slot of P // n when
    ``balanced`` (groups of equal size)."""
    groups = table.groups
    width = table.backup_count + 1
    filled = min(width, len(set(groups.values())))
    for p in range(table.partition_count):
        row = table.replicas(p)
        assert all(m is not None for m in row[:filled]) and all(m is None for m in row[filled:])
        assert len({groups[m] for m in row[:filled]}) == filled, (p, row)
    if balanced:
        n = len(table.members)
        low, high = table.partition_count // n, -(-table.partition_count // n)
        for r in range(filled):
            counts = [len(table.partitions_of(m, r)) for m in table.members]
            assert all(low <= c <= high for c in counts), (r, counts)


HOSTS = {f"s{h}{k}": f"host{h}" for h in range(3) for k in range(2)}


@pytest.mark.parametrize("backup_count", [1, 2, 3])
def test_replicas_sit_on_distinct_hosts_and_stay_balanced(backup_count):
    table = PartitionTable.create(list(HOSTS), P, backup_count, groups=HOSTS)
    check_groups(table)
    assert table.group_of("s10") == "host1"
    # a host's two members fail one after the other: each partition keeps a replica elsewhere
    for gone in ("s00", "s01"):
        before, table = table, table.with_member_removed(gone)
        for p in before.partitions_of(gone):
            assert table.owner(p) == before.replicas(p)[1]   # the first backup is promoted
        check_groups(table, balanced=False)
        simulate(before, table, migrations(before, table))
    back = table.with_member_added("s00", "host0").with_member_added("s01", "host0")
    check_groups(back)


def test_unequal_groups_still_keep_replicas_apart():
    groups = {"a": "h1", "b": "h2", "c": "h2", "d": "h2"}
    table = PartitionTable.create(list(groups), P, 1, groups=groups)
    check_groups(table, balanced=False)
    # the lone member of h1 backs every partition h2 owns: as balanced as the groups allow
    assert len(table.partitions_of("a", 1)) == P - len(table.partitions_of("a"))


def test_one_group_holds_primaries_only():
    table = PartitionTable.create(["a", "b", "c"], 12, 2, groups=dict.fromkeys("abc", "one"))
    assert all(table.replicas(p)[1:] == (None, None) for p in range(12))
    check_groups(table)


def test_groups_round_trip_and_tables_without_keep_format_1():
    table = PartitionTable.create(list(HOSTS), 31, 1, groups=HOSTS)
    data = table.to_bytes()
    assert struct.unpack_from("<H", data, 4)[0] == 2
    back = PartitionTable.from_bytes(data)
    assert back == table and back.groups == HOSTS
    assert pickle.loads(pickle.dumps(table)) == table
    plain = PartitionTable.create(list(HOSTS), 31, 1)
    assert struct.unpack_from("<H", plain.to_bytes(), 4)[0] == 1 and plain.groups is None
    assert plain != PartitionTable.create(list(HOSTS), 31, 1, groups=dict.fromkeys(HOSTS, "x"))
    for cut in range(len(data) - 1):
        with pytest.raises(PartitionTableError):
            PartitionTable.from_bytes(data[:cut])


def test_decoding_refuses_two_replicas_in_one_group():
    table = PartitionTable.create(["a", "b"], 1, 1, groups={"a": "h1", "b": "h2"})
    body = bytearray(table.to_bytes()[:-4])
    # the group indices (one u16 per member) sit just before the one partition record
    record = struct.calcsize("<Q2i")
    struct.pack_into("<H", body, len(body) - record - 2, 0)   # b now in h1 as well
    with pytest.raises(PartitionTableError, match="places two replicas in one group"):
        PartitionTable.from_bytes(reseal(bytes(body)))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: PartitionTable.create(["a", "b"], 4, 1, groups={"a": "h"}),
     r"no group for member\(s\) \['b'\]"),
    (lambda: PartitionTable.create(["a"], 4, 1, groups={"a": "h", "z": "h"}),
     r"not in the table: \['z'\]"),
    (lambda: PartitionTable.create(["a"], 4, 1, groups={"a": ""}), "must be a non-empty str"),
    (lambda: PartitionTable.create(["a"], 4, 1, groups=["h"]), "must map each member"),
    (lambda: PartitionTable.create(["a"], 4, 1, groups={"a": "h"}).with_member_added("b"),
     "needs a group"),
    (lambda: PartitionTable.create(["a"], 4, 1).with_member_added("b", "h"),
     "the table's members have none"),
])
def test_bad_groups_are_named(call, message):
    with pytest.raises(PartitionTableError, match=message):
        call()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    partition_count=st.integers(min_value=1, max_value=60),
    backup_count=st.integers(min_value=0, max_value=4),
    hosts=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=8),
    ops=operations,
)
def test_random_histories_with_groups_keep_replicas_apart(partition_count, backup_count, hosts,
                                                          ops):
    groups = {f"m{i}": f"h{h}" for i, h in enumerate(hosts)}
    table = PartitionTable.create(list(groups), partition_count, backup_count, groups=groups)
    check_groups(table, balanced=False)
    joined = len(hosts)
    for remove, pick in ops:
        if remove and len(table.members) > 1:
            new = table.with_member_removed(table.members[pick % len(table.members)])
        else:
            new = table.with_member_added(f"m{joined}", f"h{pick % 4}")
            joined += 1
        check_groups(new, balanced=False)
        check_versions(table, new)
        simulate(table, new, migrations(table, new))
        assert PartitionTable.from_bytes(new.to_bytes()) == new
        table = new
