"""Merkle trees: Hazelcast's vector, a pure-Python reference tree that the native forest
must match under hypothesis, incremental updates, the serialized record (golden bytes,
every truncation and flipped byte), diff and SyncSession against brute force, and
sync_plan / apply over random inserts, deletes, updates, swaps and renames."""
import itertools
import math
import pickle
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers import reference as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparkjet
from sparkjet import _native as native
from sparkjet import hash as sj_hash
from sparkjet import merkle
from sparkjet._keys import describe
from sparkjet.errors import (
    CorruptDataError,
    InvalidArgumentError,
    KeyRangeError,
    NullKeyError,
    SparkjetError,
    UnsupportedTypeError,
)
from sparkjet.merkle import (
    MerkleDiff,
    MerkleForest,
    MerkleTree,
    SyncPlan,
    SyncSession,
    apply,
    choose_depth,
    diff,
    estimate_sync,
    locate,
    protocol,
    sync_plan,
)

M32 = 0xFFFFFFFF
FACTOR = 2038079003
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def s32(x):
    x &= M32
    return x - (1 << 32) if x & 0x80000000 else x


# ------------------------------------------------------------------ the pure-Python reference


def ref_fmix(h):
    h &= M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def ref_entry_hash(key_hash, value_hash):
    return s32(ref_fmix((value_hash & M32) ^ ((key_hash * 0x9E3779B1) & M32)))


def ref_leaf(key_hash, depth):
    leaves = 2 ** (depth - 1)
    return leaves - 1 + (key_hash + 2**31) // (2**32 // leaves)


class RefForest:
    """HAZELCAST.md §4, literally: a list of leaves per partition, inner nodes summed on
    demand."""

    def __init__(self, partition_count, depth, value_hash="value"):
        self.partition_count, self.depth, self.value_hash = partition_count, depth, value_hash
        self.leaves = [[0] * 2 ** (depth - 1) for _ in range(partition_count)]

    def add(self, key_hash, value_hash, sign=1):
        p = ref.partition_of_hash(key_hash, self.partition_count)
        h = value_hash if self.value_hash == "value" else ref_entry_hash(key_hash, value_hash)
        leaf = ref_leaf(key_hash, self.depth) - (2 ** (self.depth - 1) - 1)
        self.leaves[p][leaf] = s32(self.leaves[p][leaf] + sign * FACTOR * h)

    def nodes(self, p):
        first = 2 ** (self.depth - 1) - 1
        nodes = [0] * first + list(self.leaves[p])
        for i in range(first - 1, -1, -1):
            nodes[i] = s32(nodes[2 * i + 1] + nodes[2 * i + 2])
        return nodes


# Hazelcast payloads of Python values by Arrow type (what the value hash reads).
def payload(value, t):
    if value is None:  # a null hashes as its type's zero
        value = {"string": "", "binary": b""}.get(str(t), 0)
    if t in (pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16()):
        return struct.pack(">i", value)
    if t in (pa.int64(), pa.uint32()):
        return struct.pack(">q", value)
    if t == pa.bool_():
        return struct.pack(">i", int(value))
    if t == pa.float64():
        return struct.pack(">d", value)
    if t == pa.float32():
        return struct.pack(">f", value)
    if t == pa.string():
        raw = value.encode()
        return struct.pack(">i", len(raw)) + raw
    if t == pa.binary():
        return struct.pack(">i", len(value)) + value
    raise AssertionError(t)


def ref_hash(values, types):
    """The row hash of several columns: murmur3 of the concatenated payloads, then the
    null mask folded in."""
    h = ref.murmur3_32(b"".join(payload(v, t) for v, t in zip(values, types)))
    mask = 0
    for i, v in enumerate(values):
        if v is None:
            mask |= 1 << (i % 32)
    return s32((h & M32) ^ ref_fmix(mask))


def assert_same_forest(native, reference):
    nodes = native.nodes
    for p in range(reference.partition_count):
        assert nodes[p].tolist() == reference.nodes(p), f"partition {p}"


# ------------------------------------------------------------------------- the vector


VECTOR_KEYS = [(42, pa.int32()), (1, pa.int32()), ("key", pa.string())]
VECTOR_VALUES = [("hello", pa.string()), ("a", pa.string()), (7, pa.int32())]


def vector_hashes():
    keys = [sparkjet.murmur3_32(pa.array([k], t))[0].as_py() for k, t in VECTOR_KEYS]
    values = [sparkjet.murmur3_32(pa.array([v], t))[0].as_py() for v, t in VECTOR_VALUES]
    return keys, values


def test_hazelcast_vector_from_hashes():
    tree = MerkleTree(10)
    tree.add_hashes(*vector_hashes())
    assert [tree.leaf_of(h) for h in vector_hashes()[0]] == [1014, 858, 942]
    assert [tree.node(1014), tree.node(858), tree.node(942)] == [
        -1078798729, -1173672487, -1974808467]
    assert tree.root == 67687613
    assert np.count_nonzero(tree.leaves) == 3


def test_hazelcast_vector_from_arrow_columns():
    tree = MerkleTree(10)
    tree.add(pa.array([42, 1], pa.int32()), pa.array(["hello", "a"]))
    tree.add(pa.record_batch({"k": ["key"], "v": pa.array([7], pa.int32())}), key="k")
    assert tree.root == 67687613
    assert tree.nodes[1014] == -1078798729


def test_hazelcast_vector_in_a_forest_lands_in_each_keys_partition():
    forest = MerkleForest(271, 10)
    keys, values = vector_hashes()
    forest.add_hashes(keys, values)
    partitions = [ref.partition_of_hash(h) for h in keys]
    assert partitions == [175, 31, sparkjet.partition_ids(pa.array(["key"]))[0].as_py()]
    values = [-1078798729, -1173672487, -1974808467]
    for p, leaf, value in zip(partitions, [1014, 858, 942], values):
        assert forest.nodes[p, leaf] == value
    assert sorted(np.flatnonzero(forest.roots).tolist()) == sorted(set(partitions))


def test_reference_reproduces_the_vector():
    r = RefForest(1, 10)
    for k, v in zip(*vector_hashes()):
        r.add(k, v)
    assert r.nodes(0)[0] == 67687613


# --------------------------------------------------- native against reference (hypothesis)

KEY_TYPES = {
    "int32": (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    "int64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "string": (pa.string(), st.text(max_size=12)),
}
VALUE_TYPES = {
    "int64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "int32": (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    "string": (pa.string(), st.text(max_size=20)),
    "binary": (pa.binary(), st.binary(max_size=20)),
    "float64": (pa.float64(), st.floats(allow_nan=False)),
    "bool": (pa.bool_(), st.booleans()),
}


@st.composite
def entry_tables(draw, max_rows=40, nullable_values=True):
    key_kinds = draw(st.lists(st.sampled_from(sorted(KEY_TYPES)), min_size=1, max_size=2))
    value_kinds = draw(st.lists(st.sampled_from(sorted(VALUE_TYPES)), min_size=0, max_size=3))
    n = draw(st.integers(0, max_rows))
    columns, types = {}, {}
    for i, kind in enumerate(key_kinds):
        t, values = KEY_TYPES[kind]
        columns[f"k{i}"] = draw(st.lists(values, min_size=n, max_size=n))
        types[f"k{i}"] = t
    for i, kind in enumerate(value_kinds):
        t, values = VALUE_TYPES[kind]
        strategy = st.one_of(st.none(), values) if nullable_values else values
        columns[f"v{i}"] = draw(st.lists(strategy, min_size=n, max_size=n))
        types[f"v{i}"] = t
    table = pa.table({c: pa.array(v, types[c]) for c, v in columns.items()})
    keys = [f"k{i}" for i in range(len(key_kinds))]
    values = [f"v{i}" for i in range(len(value_kinds))]
    return table, keys, values


def reference_hashes(table, keys, values):
    rows = table.to_pylist()
    key_types = [table.schema.field(k).type for k in keys]
    value_types = [table.schema.field(v).type for v in values]
    out = []
    for row in rows:
        kh = ref.murmur3_32(b"".join(payload(row[k], t) for k, t in zip(keys, key_types)))
        vh = ref_hash([row[v] for v in values], value_types) if values else kh
        out.append((kh, vh))
    return out


@SETTINGS
@given(entry_tables(), st.integers(2, 8), st.sampled_from([1, 2, 7, 271]),
       st.sampled_from(["value", "entry"]), st.integers(1, 4))
def test_native_forest_matches_reference(data, depth, partition_count, value_hash, chunks):
    table, keys, values = data
    # Several chunks: batches and block boundaries must not matter.
    table = pa.concat_tables([table.slice(i * len(table) // chunks,
                                          (i + 1) * len(table) // chunks - i * len(table) // chunks)
                              for i in range(chunks)]) if len(table) else table
    forest = MerkleForest(partition_count, depth, value_hash=value_hash)
    forest.add(table, key=keys, value=values)
    reference = RefForest(partition_count, depth, value_hash)
    for kh, vh in reference_hashes(table, keys, values):
        reference.add(kh, vh)
    assert_same_forest(forest, reference)
    # The same entries through precomputed hashes.
    by_hashes = MerkleForest(partition_count, depth, value_hash=value_hash)
    pairs = reference_hashes(table, keys, values)
    by_hashes.add_hashes([k for k, _ in pairs], [v for _, v in pairs])
    assert by_hashes == forest


@SETTINGS
@given(st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1)),
                max_size=60),
       st.integers(2, 27))
def test_tree_of_hashes_matches_reference_at_every_depth(pairs, depth):
    tree = MerkleTree(depth)
    keys, values = [k for k, _ in pairs], [v for _, v in pairs]
    tree.add_hashes(keys, values)
    reference = RefForest(1, depth)
    for k, v in pairs:
        reference.add(k, v)
    if depth <= 16:
        assert tree.nodes.tolist() == reference.nodes(0)
    else:  # compare what the entries touched (the reference would build 2**27 nodes)
        for k in keys:
            leaf = ref_leaf(k, depth)
            assert tree.node(leaf) == reference.leaves[0][leaf - tree.first_leaf]
        assert tree.root == s32(sum(sum(x) for x in [reference.leaves[0]]))
    assert [tree.leaf_of(k) for k in keys] == [ref_leaf(k, depth) for k in keys]


def test_leaf_rule_edges():
    for depth in (2, 10, 27):
        tree = MerkleTree(depth)
        assert tree.leaf_of(-(2**31)) == tree.first_leaf
        assert tree.leaf_of(2**31 - 1) == tree.node_count - 1
        assert tree.leaf_of(0) == tree.first_leaf + tree.leaf_count // 2


def test_entry_hash_matches_reference():
    rng = np.random.default_rng(5)
    for k, v in rng.integers(-(2**31), 2**31, (200, 2)):
        assert sparkjet._native.tree_entry_hash(int(k), int(v)) == ref_entry_hash(int(k), int(v))


def test_value_types_hash_as_documented():
    import datetime
    import decimal

    day = datetime.date(2024, 6, 1)
    stamp = datetime.datetime(2024, 6, 1, 12, 30)
    cases = [
        (pa.array([1.5], pa.float64()), struct.pack(">d", 1.5)),
        (pa.array([1.5], pa.float32()), struct.pack(">f", 1.5)),
        (pa.array([True], pa.bool_()), struct.pack(">i", 1)),
        (pa.array([day], pa.date32()), struct.pack(">i", (day - datetime.date(1970, 1, 1)).days)),
        (pa.array([stamp], pa.timestamp("us")),
         struct.pack(">q", int((stamp - datetime.datetime(1970, 1, 1)).total_seconds() * 1e6))),
        (pa.array([2**64 - 1], pa.uint64()), struct.pack(">q", -1)),
        (pa.array([decimal.Decimal("1.25")], pa.decimal128(10, 2)),
         struct.pack(">i", 16) + (125).to_bytes(16, "little")),
        (pa.array(["x"]).dictionary_encode(), struct.pack(">i", 1) + b"x"),
    ]
    for arr, expected_payload in cases:
        tree = MerkleTree(4)
        tree.add(pa.array([0], pa.int32()), arr)
        want = RefForest(1, 4)
        want.add(ref.murmur3_32(struct.pack(">i", 0)), ref.murmur3_32(expected_payload))
        assert tree.nodes.tolist() == want.nodes(0), arr.type


def test_null_values_differ_from_zero_and_from_each_other():
    keys = pa.array([1, 1, 1, 1], pa.int32())
    a = pa.array([0, None, 0, None], pa.int64())
    b = pa.array(["", "", None, None])
    hashes = []
    for i in range(4):
        tree = MerkleTree(3)
        tree.add(pa.table({"k": keys.slice(i, 1), "a": a.slice(i, 1), "b": b.slice(i, 1)}), key="k")
        hashes.append(tree.root)
    assert len(set(hashes)) == 4


def test_unsupported_value_type_names_the_column():
    table = pa.table({"k": [1, 2], "tags": [[1], [2]]})
    with pytest.raises(UnsupportedTypeError, match="'tags'"):
        MerkleForest(7, 4).add(table, key="k")


# ------------------------------------------------------------------ incremental updates


def random_table(n, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    return pa.table({"id": pa.array(keys),
                     "amount": rng.integers(-(10**9), 10**9, n),
                     "name": pa.array([f"n{x}" for x in rng.integers(0, 1000, n)])})


def test_add_in_batches_equals_one_add_in_any_order():
    table = random_table(20_000, 1)
    whole = MerkleForest(271, 10)
    whole.add(table, key="id")
    parts = MerkleForest(271, 10)
    order = np.random.default_rng(2).permutation(len(table))
    for chunk in np.array_split(order, 7):
        parts.add(table.take(chunk), key="id")
        assert parts.roots is not None  # reads in between refresh the inner nodes
    assert parts == whole


def test_remove_undoes_add_and_replace_equals_rebuild():
    table = random_table(5_000, 3)
    forest = MerkleForest(13, 8, value_hash="entry")
    forest.add(table, key="id")
    changed = table.slice(100, 50).set_column(1, "amount", pa.array(np.arange(50)))
    forest.replace(table.slice(100, 50), changed, key="id")
    rebuilt = MerkleForest(13, 8, value_hash="entry")
    rebuilt.add(pa.concat_tables([table.slice(0, 100), changed, table.slice(150)]), key="id")
    assert forest == rebuilt
    forest.remove(pa.concat_tables([table.slice(0, 100), changed, table.slice(150)]), key="id")
    assert not forest.nodes.any()


def test_replace_hashes_is_remove_then_add():
    tree = MerkleTree(6)
    tree.add_hashes([1, 2, 3], [10, 20, 30])
    tree.replace_hashes([2], [20], [99])
    want = MerkleTree(6)
    want.add_hashes([1, 2, 3], [10, 99, 30])
    assert tree == want


def test_merge_of_shards_equals_the_whole():
    table = random_table(9_000, 4)
    whole = MerkleForest(271, 9)
    whole.add(table, key="id")
    merged = MerkleForest(271, 9)
    for shard in (table.slice(0, 3000), table.slice(3000, 3000), table.slice(6000)):
        part = MerkleForest(271, 9)
        part.add(shard, key="id")
        merged.merge(part)
    assert merged == whole


def test_composite_keys_use_partition_ids_composite_hash():
    table = pa.table({"a": pa.array([1, 2, 3], pa.int32()), "b": ["x", "y", "z"], "v": [1, 2, 3]})
    partitions, leaves = locate(table, 10, 271, key=["a", "b"])
    assert partitions.to_pylist() == sparkjet.partition_ids(table, key=["a", "b"]).to_pylist()
    hashes = sparkjet.murmur3_32(table, key=["a", "b"]).to_pylist()
    assert leaves.to_pylist() == [ref_leaf(h, 10) for h in hashes]


def test_failed_update_changes_nothing():
    good = pa.table({"k": pa.array(range(10), pa.int64()), "v": range(10)})
    forest = MerkleForest(7, 5)
    forest.add(good, key="k")
    before = forest.nodes.copy()
    # A null key in the second chunk: nothing of the first chunk may stay added.
    bad = pa.concat_tables([good, pa.table({"k": pa.array([5, None], pa.int64()), "v": [1, 2]})])
    with pytest.raises(NullKeyError, match="key column 'k' has a null at index 11"):
        forest.add(bad, key="k")
    assert np.array_equal(forest.nodes, before)
    # Out of Integer range in the third chunk, found by the native kernel.
    wide = pa.concat_tables([good, good, pa.table({"k": pa.array([2**40], pa.int64()), "v": [0]})])
    with pytest.raises(KeyRangeError, match="row 20"):
        forest.add(wide, key="k", key_type="integer")
    assert np.array_equal(forest.nodes, before)


def test_bad_arguments_raise_clear_errors():
    for depth in (1, 28, "10", True, 10.0):
        with pytest.raises(InvalidArgumentError, match="depth must be an int in 2..27"):
            MerkleTree(depth)
        with pytest.raises(ValueError):
            MerkleForest(271, depth)
    with pytest.raises(InvalidArgumentError, match="partition_count"):
        MerkleForest(0)
    with pytest.raises(InvalidArgumentError, match="value_hash"):
        MerkleForest(value_hash="key")
    with pytest.raises(InvalidArgumentError, match="needs key="):
        MerkleForest().add(pa.table({"a": [1]}))
    with pytest.raises(InvalidArgumentError, match="no column 'x'"):
        MerkleForest().add(pa.table({"a": [1]}), key="x")
    with pytest.raises(InvalidArgumentError, match="both a key and a value"):
        MerkleForest().add(pa.table({"a": [1]}), key="a", value="a")
    with pytest.raises(InvalidArgumentError, match="3 keys but 2 values"):
        MerkleTree().add([1, 2, 3], [1, 2])
    with pytest.raises(InvalidArgumentError, match="int32"):
        MerkleTree().add_hashes([2**31])
    with pytest.raises(NullKeyError):
        MerkleTree().add(pa.array([1, None]))
    assert issubclass(NullKeyError, SparkjetError)


# ---------------------------------------------------------------------- serialization

# A depth-3 tree of Integer keys 1..3 with Integer values 10, 20, 30, as bytes.
GOLDEN_TREE = bytes.fromhex(
    "534a4d54" "0001" "03" "00" "00000005" "0000000b" "f58bb54e" "00000004"
    "00000000" "1f33dde4" "4d40a881" "7d9deaf2"
)


def golden_source():
    tree = MerkleTree(3, partition=5, partition_count=11)
    tree.add(pa.array([1, 2, 3], pa.int32()), pa.array([10, 20, 30], pa.int32()))
    return tree


def expected_record(tree):
    """The record as merkle.h describes it, assembled here independently."""
    leaves = RefForest(1, tree.depth)
    for k, v in ((1, 10), (2, 20), (3, 30)):
        leaves.add(ref.murmur3_32(struct.pack(">i", k)), ref.murmur3_32(struct.pack(">i", v)))
    head = b"SJMT" + struct.pack(">HBB", 1, tree.depth, 0) + struct.pack(">ii", 5, 11)
    body = struct.pack(f">i{tree.leaf_count}i", tree.leaf_count, *leaves.leaves[0])
    seed = ref.murmur3_32(head, 0x534A4D54) & M32
    return head + struct.pack(">i", ref.murmur3_32(body, seed)) + body


def test_serialized_tree_is_byte_exact():
    tree = golden_source()
    data = tree.to_bytes()
    assert data == expected_record(tree)
    assert data == GOLDEN_TREE
    # Bytes 20.. are what Hazelcast's MerkleTreeUtil.writeLeaves writes.
    assert data[20:] == struct.pack(">i", 4) + struct.pack(">4i", *tree.leaves.tolist())
    back = MerkleTree.from_bytes(GOLDEN_TREE)
    assert back == tree and back.partition == 5 and back.partition_count == 11
    assert back.nodes.tolist() == tree.nodes.tolist()


def test_forest_round_trips_through_bytes_and_pickle():
    forest = MerkleForest(29, 7, value_hash="entry")
    forest.add(random_table(3000, 5), key="id")
    data = forest.to_bytes()
    assert len(data) == 29 * (24 + 4 * 64)
    assert MerkleForest.from_bytes(data) == forest
    assert pickle.loads(pickle.dumps(forest)) == forest
    size = 24 + 4 * 64
    shuffled = b"".join(data[p * size:(p + 1) * size] for p in reversed(range(29)))
    assert MerkleForest.from_bytes(shuffled) == forest
    assert MerkleTree.from_bytes(forest.tree_bytes(3)) == forest.tree(3)
    assert forest.tree(3).nodes.tolist() == forest.nodes[3].tolist()


def test_every_truncation_and_every_flipped_bit_is_caught():
    data = golden_source().to_bytes()
    for cut in range(len(data)):
        with pytest.raises(CorruptDataError, match=f"truncated at byte {cut}") as e:
            MerkleTree.from_bytes(data[:cut])
        assert e.value.index == cut
    fields = {0: "magic", 4: "version", 6: "depth", 7: "flags", 8: "partition",
              12: "partition count", 16: "checksum", 20: "leaf count"}
    for i in range(len(data)):
        for bit in range(8):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            with pytest.raises(CorruptDataError) as e:
                MerkleTree.from_bytes(bytes(bad))
            message = str(e.value)
            assert f"at byte {e.value.index}" in message or "truncated" in message
            field = fields.get(e.value.index, "leaves")
            assert f"bad {field}" in message or "truncated" in message, message
    with pytest.raises(CorruptDataError, match="3 bytes after"):
        MerkleTree.from_bytes(data + b"abc")


def test_corrupt_forests_name_record_and_problem():
    forest = MerkleForest(3, 4)
    data = forest.to_bytes()
    size = len(data) // 3
    with pytest.raises(CorruptDataError, match="partition 0 appears twice"):
        MerkleForest.from_bytes(data[:size] * 2 + data[2 * size:])
    with pytest.raises(CorruptDataError, match="1 of 3 partitions have no record"):
        MerkleForest.from_bytes(data[:2 * size])
    with pytest.raises(CorruptDataError, match="record 2: truncated"):
        MerkleForest.from_bytes(data[:-1])
    other = MerkleTree(5, partition=2, partition_count=3).to_bytes()
    with pytest.raises(CorruptDataError, match="record 2 at byte .*depth differs"):
        MerkleForest.from_bytes(data[:2 * size] + other)
    with pytest.raises(CorruptDataError, match="no bytes"):
        MerkleForest.from_bytes(b"")


# ------------------------------------------------------------------------------- diff


def brute_force_diff(a, b):
    depth = min(a.depth, b.depth)
    first, last = 2 ** (depth - 1) - 1, 2**depth - 1
    out = {}
    for p in range(a.partition_count):
        differ = np.flatnonzero(a.nodes[p, first:last] != b.nodes[p, first:last]) + first
        if len(differ):
            out[p] = differ.tolist()
    return out


@st.composite
def forest_pairs(draw):
    partition_count = draw(st.sampled_from([1, 3, 271]))
    da, db = draw(st.integers(2, 11)), draw(st.integers(2, 11))
    n = draw(st.integers(0, 400))
    seed = draw(st.integers(0, 2**32 - 1))
    changes = draw(st.integers(0, 30))
    rng = np.random.default_rng(seed)
    keys = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    values = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    a = MerkleForest(partition_count, da)
    b = MerkleForest(partition_count, db)
    a.add_hashes(keys, values)
    b.add_hashes(keys, values)
    for _ in range(changes):
        b.add_hashes(rng.integers(-(2**31), 2**31, 1, dtype=np.int64).astype(np.int32), [1])
    return a, b


@SETTINGS
@given(forest_pairs())
def test_diff_matches_brute_force_across_depths(pair):
    a, b = pair
    found = diff(a, b)
    assert {p: found[p].tolist() for p in found} == brute_force_diff(a, b)
    assert found.depth == min(a.depth, b.depth)
    assert found.compared[0] == a.partition_count
    # Only children of differing nodes are compared.
    differing_above = [
        sum(int(np.count_nonzero(a.nodes[p, (1 << (lv - 1)) - 1:(1 << lv) - 1]
                                 != b.nodes[p, (1 << (lv - 1)) - 1:(1 << lv) - 1]))
            for p in range(a.partition_count))
        for lv in range(1, found.depth)]
    assert found.compared[1:].tolist() == [2 * n for n in differing_above]
    # The session, message by message, finds the same leaves.
    session = SyncSession(a, b)
    assert session.run().leaf_ids.tolist() == found.leaf_ids.tolist()
    assert session.run().compared.tolist() == found.compared.tolist()


def test_diff_of_identical_forests_compares_roots_only():
    table = random_table(5000, 6)
    a, b = MerkleForest(271, 12), MerkleForest(271, 12)
    a.add(table, key="id")
    b.add(table, key="id")
    found = diff(a, b)
    assert not found and found.leaf_count == 0 and len(found) == 0
    assert found.compared.tolist() == [271] + [0] * 11


def test_deeper_tree_leaf_ranges_cover_the_changed_key():
    table = random_table(2000, 7)
    shallow, deep = MerkleForest(271, 6), MerkleForest(271, 11)
    shallow.add(table, key="id")
    changed = table.slice(0, 1).set_column(1, "amount", pa.array([123]))
    deep.add(pa.concat_tables([changed, table.slice(1)]), key="id")
    found = diff(shallow, deep)
    assert found.depths == (6, 11) and found.depth == 6 and found.leaf_count == 1
    (p,) = list(found)
    (start, stop), = found.leaf_ranges(p, 11).tolist()
    partitions, leaves = locate(changed, 11, 271, key="id")
    assert partitions[0].as_py() == p and start <= leaves[0].as_py() < stop
    assert stop - start == 2 ** (11 - 6)


def test_diff_refuses_what_cannot_be_compared():
    with pytest.raises(InvalidArgumentError, match="mismatched partition counts: 271 and 7"):
        diff(MerkleForest(271), MerkleForest(7))
    with pytest.raises(InvalidArgumentError, match="hash values differently"):
        diff(MerkleForest(value_hash="value"), MerkleForest(value_hash="entry"))
    with pytest.raises(InvalidArgumentError, match="different partitions"):
        diff(MerkleTree(partition=1, partition_count=3), MerkleTree(partition=2, partition_count=3))
    with pytest.raises(UnsupportedTypeError, match="MerkleTree and a MerkleForest"):
        diff(MerkleTree(), MerkleForest())


def test_tree_diff_is_keyed_by_the_trees_partition():
    a = MerkleTree(5, partition=4, partition_count=9)
    b = a.copy()
    b.add_hashes([0], [1])
    found = diff(a, b)
    assert list(found) == [4] and found[4].tolist() == [a.leaf_of(0)]


# ---------------------------------------------------------------------------- session


def test_session_messages_and_bytes():
    table = random_table(20_000, 8)
    stale, fresh = MerkleForest(271, 12), MerkleForest(271, 14)
    stale.add(table, key="id")
    updated = table.slice(0, 10).set_column(1, "amount", pa.array(np.arange(10)))
    fresh_table = pa.concat_tables([updated, table.slice(10)])
    fresh.add(fresh_table, key="id")
    session = SyncSession(stale, fresh)
    found = session.run()
    assert found.leaf_ids.tolist() == diff(stale, fresh).leaf_ids.tolist()
    kinds = [m.kind for m in session.messages]
    assert kinds[:2] == ["hello", "hello"] and kinds[-1] == "leaves"
    assert kinds[2:-1] == ["nodes"] * 12  # one message per level of the common depth
    senders = [m.sender for m in session.messages[2:]]
    assert all(x != y for x, y in itertools.pairwise(senders))  # each message answers the last
    nodes = [m for m in session.messages if m.kind == "nodes"]
    assert [m.level for m in nodes] == list(range(12))
    assert nodes[0].items == 271
    for m in nodes:  # header, (partition, count) groups, (node, hash) pairs
        groups = (m.nbytes - 12 - 8 * m.items) / 8
        assert groups == int(groups) and 0 < groups <= min(271, m.items)
    rows = session.fetch(fresh_table, key="id")
    assert set(updated["id"].to_pylist()) <= set(rows["id"].to_pylist())
    assert session.messages[-1].kind == "rows" and session.messages[-1].items == rows.num_rows
    assert session.bytes_exchanged == sum(m.nbytes for m in session.messages)
    assert session.bytes_exchanged == session.tree_bytes + session.row_bytes
    whole = len(table.to_batches()[0].serialize()) if table.num_rows else 0
    assert session.bytes_exchanged < whole / 10


def test_session_stops_early_when_nothing_differs():
    a = MerkleForest(7, 10)
    session = SyncSession(a, a.copy())
    assert not session.run()
    assert [m.kind for m in session.messages] == ["hello", "hello", "nodes", "leaves"]


def test_party_checks_what_the_peer_sends():
    forest = MerkleForest(5, 4)
    party = protocol.Party("fresh", forest)
    party.receive_hello(protocol.Party("stale", forest).hello())
    good = protocol.Party("stale", forest).roots()
    with pytest.raises(CorruptDataError, match="bytes where the counts need"):
        party.receive_nodes(good[:-1])
    bad = bytearray(good)
    bad[0] = protocol.LEAVES
    with pytest.raises(CorruptDataError, match="kind 2 where nodes was due"):
        party.receive_nodes(bytes(bad))
    wrong_level = bytearray(good)
    wrong_level[1] = 2
    with pytest.raises(CorruptDataError, match="a node outside level 2"):
        party.receive_nodes(bytes(wrong_level))
    with pytest.raises(InvalidArgumentError, match="mismatched partition counts"):
        party.receive_hello(protocol.Party("stale", MerkleForest(6, 4)).hello())


# ------------------------------------------------------------------- sync plan and apply


@st.composite
def stale_and_fresh(draw):
    """A keyed table and a changed copy: inserts, deletes, updates, swaps of values
    between two keys, and values moved to new keys."""
    composite = draw(st.booleans())
    n = draw(st.integers(0, 40))
    ids = draw(st.lists(st.integers(-1000, 1000), min_size=n, max_size=n, unique=True))
    value = st.tuples(st.one_of(st.none(), st.integers(-5, 5)),
                      st.one_of(st.none(), st.sampled_from(["a", "b", "", "ccc"])),
                      st.one_of(st.none(), st.floats(-2, 2, allow_nan=False, width=32)))
    stale = {(i, str(i % 3)) if composite else (i,): draw(value) for i in ids}
    fresh = dict(stale)
    for _ in range(draw(st.integers(0, 12))):
        op = draw(st.sampled_from(["insert", "delete", "update", "swap", "rename"]))
        keys = sorted(fresh)
        new_id = draw(st.integers(1001, 2000))
        new_key = (new_id, str(new_id % 3)) if composite else (new_id,)
        if op == "insert":
            fresh[new_key] = draw(value)
        elif keys and op == "delete":
            del fresh[draw(st.sampled_from(keys))]
        elif keys and op == "update":
            fresh[draw(st.sampled_from(keys))] = draw(value)
        elif len(keys) > 1 and op == "swap":
            a, b = draw(st.sampled_from(keys)), draw(st.sampled_from(keys))
            fresh[a], fresh[b] = fresh[b], fresh[a]
        elif keys and op == "rename" and new_key not in fresh:
            fresh[new_key] = fresh.pop(draw(st.sampled_from(keys)))
    seed = draw(st.integers(0, 2**31))
    return composite, stale, fresh, seed


def to_table(rows: dict, composite: bool, seed: int) -> pa.Table:
    items = list(rows.items())
    np.random.default_rng(seed).shuffle(items)
    columns = {"id": pa.array([k[0] for k, _ in items], pa.int64())}
    if composite:
        columns["region"] = pa.array([k[1] for k, _ in items], pa.string())
    columns["count"] = pa.array([v[0] for _, v in items], pa.int32())
    columns["label"] = pa.array([v[1] for _, v in items], pa.string())
    columns["score"] = pa.array([v[2] for _, v in items], pa.float32())
    return pa.table(columns)


def sorted_rows(table, keys):
    return table.sort_by([(k, "ascending") for k in keys]).to_pylist()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stale_and_fresh(), st.integers(2, 5), st.sampled_from([1, 2, 5, 271]))
def test_apply_of_plan_turns_stale_into_fresh(case, depth, partition_count):
    composite, stale_rows, fresh_rows, seed = case
    keys = ["id", "region"] if composite else ["id"]
    stale, fresh = to_table(stale_rows, composite, seed), to_table(fresh_rows, composite, seed + 1)
    plan = sync_plan(stale, fresh, key=keys, depth=depth, partition_count=partition_count)
    assert isinstance(plan, SyncPlan)
    assert sorted_rows(apply(stale, plan), keys) == sorted_rows(fresh, keys)
    # The plan is exact: what changed, and nothing else.
    want = {"added": fresh_rows.keys() - stale_rows.keys(),
            "removed": stale_rows.keys() - fresh_rows.keys(),
            "changed": {k for k in stale_rows.keys() & fresh_rows.keys()
                        if stale_rows[k] != fresh_rows[k]}}
    got = {"added": set(), "removed": set(), "changed": set()}
    for row in plan.changes.to_pylist():
        got[row["change"]].add(tuple(row[k] for k in keys))
    assert got == want
    assert (plan.added, plan.changed, plan.removed) == tuple(len(want[c]) for c in
                                                             ("added", "changed", "removed"))
    # Only rows under differing leaves were read.
    found = plan.diff
    assert plan.fresh_rows_fetched == (pc.sum(under(fresh, keys, found)).as_py() or 0)
    assert plan.stale_rows_read <= stale.num_rows


def under(table, keys, found):
    partitions, leaves = locate(table, found.depth, found.partition_count, key=keys)
    per = 2 ** (found.depth - 1)
    ids = np.asarray(partitions, np.int64) * per + np.asarray(leaves) - (per - 1)
    return pa.array(np.isin(ids, found.leaf_ids))


def test_value_hash_sees_swaps_only_when_bound_to_keys():
    # Two keys of one leaf (depth 2, one partition: 1 and 2 share leaf 2) swap values.
    assert ref_leaf(ref.murmur3_32(struct.pack(">q", 1)), 2) == ref_leaf(
        ref.murmur3_32(struct.pack(">q", 2)), 2) == 2
    stale = pa.table({"id": [1, 2], "v": ["x", "y"]})
    fresh = pa.table({"id": [1, 2], "v": ["y", "x"]})
    blind = sync_plan(stale, fresh, key="id", depth=2, partition_count=1, value_hash="value")
    assert blind.changed == 0  # Hazelcast's trees cannot see it
    plan = sync_plan(stale, fresh, key="id", depth=2, partition_count=1)
    assert plan.changed == 2
    assert sorted_rows(apply(stale, plan), ["id"]) == sorted_rows(fresh, ["id"])


def test_nan_and_null_values_compare_as_equal_to_themselves():
    stale = pa.table({"id": [1, 2, 3], "x": [math.nan, None, 1.0]})
    fresh = pa.table({"id": [1, 2, 3], "x": [math.nan, None, 2.0]})
    plan = sync_plan(stale, fresh, key="id", depth=2, partition_count=1)
    assert plan.changes.to_pylist() == [{"id": 3, "change": "changed"}]


def test_sync_plan_at_scale_reads_few_rows():
    table = random_table(200_000, 9)
    rng = np.random.default_rng(10)
    rows = rng.choice(table.num_rows, 30, replace=False)
    amounts = table["amount"].to_numpy().copy()
    amounts[rows] += 1
    fresh = table.set_column(1, "amount", pa.array(amounts)).slice(5)
    fresh = pa.concat_tables([fresh, pa.table({"id": pa.array([2**41]), "amount": [1],
                                               "name": ["new"]})])
    depth = choose_depth(table.num_rows, 36)
    plan = sync_plan(table, fresh, key="id", depth=depth)
    assert plan.removed == 5 and plan.added == 1
    assert plan.changed == len(set(rows.tolist()) - set(range(5)))
    assert plan.fresh_rows_fetched < 2 * estimate_sync(table.num_rows, 36, depth).rows_fetched
    assert plan.fresh_rows_fetched < table.num_rows / 1000
    assert sorted_rows(apply(table, plan), ["id"]) == sorted_rows(fresh, ["id"])


def test_sync_plan_with_prebuilt_forests():
    stale, fresh = random_table(3000, 11), random_table(3000, 12)
    forests = []
    for t in (stale, fresh):
        f = MerkleForest(31, 9, value_hash="entry")
        f.add(t, key="id")
        forests.append(f)
    plan = sync_plan(stale, fresh, key="id", forests=tuple(forests))
    assert plan.diff.depth == 9 and plan.diff.partition_count == 31
    assert sorted_rows(apply(stale, plan), ["id"]) == sorted_rows(fresh, ["id"])


def test_identical_tables_give_an_empty_plan():
    table = random_table(1000, 13)
    plan = sync_plan(table, table.take(np.arange(999, -1, -1)), key="id")
    assert (plan.added, plan.changed, plan.removed, plan.fresh_rows_fetched) == (0, 0, 0, 0)
    assert apply(table, plan) is table


def test_sync_plan_errors_name_the_problem():
    a = pa.table({"id": [1, 2, 2], "v": [1, 2, 3]})
    b = pa.table({"id": [1, 2], "v": [1, 5]})
    with pytest.raises(InvalidArgumentError, match=r"key \{'id': 2\} appears 2 times in the stale"):
        sync_plan(a, b, key="id", depth=2, partition_count=1)
    with pytest.raises(InvalidArgumentError, match="column 'w' is only in the fresh table"):
        sync_plan(b, b.append_column("w", pa.array([1, 2])), key="id")
    with pytest.raises(InvalidArgumentError, match="'v' is int64 in the stale table but string"):
        sync_plan(b, pa.table({"id": [1, 2], "v": ["1", "5"]}), key="id")
    with pytest.raises(NullKeyError, match="key column 'id' has a null"):
        sync_plan(b, pa.table({"id": [1, None], "v": [1, 5]}), key="id")


# ----------------------------------------------------------------------- choosing depth


def test_estimate_matches_measured_differing_leaves():
    rows, changes, depth = 100_000, 3_000, 9
    table = random_table(rows, 14)
    stale, fresh = MerkleForest(271, depth), MerkleForest(271, depth)
    stale.add(table, key="id")
    amounts = table["amount"].to_numpy().copy()
    amounts[:changes] += 7
    fresh.add(table.set_column(1, "amount", pa.array(amounts)), key="id")
    measured = diff(stale, fresh).leaf_count
    expected = estimate_sync(rows, changes, depth).differing_leaves
    assert abs(measured - expected) < 0.05 * expected
    session = SyncSession(stale, fresh)
    session.run()
    modelled = estimate_sync(rows, changes, depth).tree_bytes
    assert abs(session.tree_bytes - modelled) < 0.1 * session.tree_bytes


def test_choose_depth_follows_the_change_rate():
    assert choose_depth(10_000_000, 1_200) == 16
    assert choose_depth(10_000_000, 1_200, memory_limit=20 * 2**20) == 14
    assert choose_depth(100_000, 100) < choose_depth(10_000_000, 1_200)
    depths = [choose_depth(1_000_000, c) for c in (10, 1_000, 100_000)]
    assert all(2 <= d <= 27 for d in depths)
    for rows, changes in ((10_000_000, 1_200), (1_000_000, 1_000)):
        best = estimate_sync(rows, changes, choose_depth(rows, changes)).total_bytes
        assert best <= min(estimate_sync(rows, changes, d).total_bytes for d in range(2, 15))


# ------------------------------------------------------------------------ kernel parity


@pytest.fixture(scope="module")
def kernel_tables():
    """Tables over every key layout the kernels vectorize (int64, strings long and short,
    composite), several 4096-row blocks each, in chunks that start at odd offsets, with
    null values in places (hashed outside the fused kernel)."""
    rng = np.random.default_rng(21)
    n = 10_000
    ids = rng.choice(2**62, n, replace=False).astype(np.int64) - 2**61
    words = ["".join(chr(c) for c in rng.integers(32, 0x3000, size=k))
             for k in rng.integers(0, 70, n)]
    amount = rng.integers(-(10**9), 10**9, n)
    price = rng.normal(100, 10, n)
    note = pa.array([None if i % 97 == 0 else f"note {x}" for i, x in
                     enumerate(rng.integers(0, 500, n))])
    flag = pa.array(rng.integers(0, 2, n).astype(bool))
    tables = {
        "int64": (pa.table({"id": ids, "amount": amount, "note": note}), ["id"]),
        "string": (pa.table({"word": words, "price": price, "flag": flag}), ["word"]),
        "composite": (pa.table({"region": pa.array((ids % 1000).astype(np.int32)),
                                "word": words, "amount": amount, "note": note}),
                      ["region", "word"]),
    }
    # Chunks starting at odd offsets: block and buffer boundaries must not matter.
    return {kind: (pa.concat_tables([table.slice(7, 4099), table.slice(4106)]), keys)
            for kind, (table, keys) in tables.items()}


@pytest.mark.parametrize("kind", ["int64", "string", "composite"])
@pytest.mark.parametrize("value_hash", ["value", "entry"])
def test_every_kernel_builds_the_same_forest(kernel_tables, kind, value_hash):
    table, keys = kernel_tables[kind]
    nodes, located = {}, {}
    try:
        for kernel in sj_hash.available_kernels():
            sj_hash.select_kernel(kernel)
            assert sj_hash.kernel_name() == kernel
            forest = MerkleForest(271, 12, value_hash=value_hash)
            forest.add(table, key=keys)
            nodes[kernel] = forest.nodes.copy()
            located[kernel] = [a.to_numpy() for a in locate(table, 12, 271, key=keys)]
    finally:
        sj_hash.select_kernel(None)
    assert "generic" in nodes and np.count_nonzero(nodes["generic"][:, 0]) > 200
    for kernel, forest_nodes in nodes.items():
        assert np.array_equal(forest_nodes, nodes["generic"]), kernel
        for got, want in zip(located[kernel], located["generic"]):
            assert np.array_equal(got, want), kernel


# ----------------------------------------------------------- bindings refuse bad input

# What a binding may raise for input it refuses: never a crash, never a write.
REFUSED = (SparkjetError, TypeError, ValueError)


def native_forest(partition_count=3, depth=4):
    return (np.zeros(partition_count * native.tree_node_count(depth), np.int32),
            np.zeros(partition_count, np.uint8))


def readonly(arr):
    arr = arr.copy()
    arr.flags.writeable = False
    return arr


def key_desc(values):
    return describe(pa.array(values), None, 0, "key")


def test_tree_functions_refuse_bad_depths_and_types():
    assert native.tree_node_count(1) == native.tree_node_count(28) == -1
    assert native.tree_serialized_size(1) == native.tree_serialized_size(28) == -1
    for depth in (1, 28, -5):
        with pytest.raises(InvalidArgumentError, match="depth"):
            native.tree_leaf_of_hash(0, depth)
    for bad in ("1", None, [1]):
        with pytest.raises(TypeError):
            native.tree_node_count(bad)
        with pytest.raises(TypeError):
            native.tree_entry_hash(bad, 0)
    # Beyond the C int32 range: Python's own OverflowError, before any C runs.
    with pytest.raises(OverflowError):
        native.tree_leaf_of_hash(2**40, 10)


def test_forest_update_refuses_bad_forests_and_batches():
    depth, mode = 4, native.MODE_VALUE
    nodes, dirty = native_forest(3, depth)
    hashes = np.arange(10, dtype=np.int32)
    desc = key_desc(range(10))
    past_its_buffer = (*desc[:3], 11, *desc[4:])  # 11 rows in a buffer of 10

    def update(n=nodes, d=dirty, dp=depth, m=mode, sign=1, key_descs=(), key_hashes=hashes,
               value_descs=(), value_hashes=None):
        native.forest_update(n, d, dp, m, sign, list(key_descs), key_hashes, list(value_descs),
                             value_hashes)

    bad_calls = [
        {"n": nodes[:-1]}, {"n": np.zeros(len(nodes) + 1, np.int32)},  # not 3 trees
        {"d": dirty[:0]}, {"d": np.zeros(4, np.uint8)},  # no tree, or a 4th flag
        {"dp": 1}, {"dp": 28}, {"dp": 5},  # bad depth, or not the arrays' depth
        {"n": nodes.astype(np.float32)}, {"n": nodes.astype(np.int64)},
        {"n": nodes.tolist()}, {"n": readonly(nodes)}, {"n": None},
        {"d": dirty.astype(np.int32)}, {"d": readonly(dirty)}, {"d": None},
        {"n": np.zeros((3, 15), np.int32)},  # 2-d: the flat array is wanted
        {"m": 7}, {"sign": 0}, {"sign": 2},
        {"key_hashes": None},  # neither key columns nor key hashes
        {"key_descs": [key_desc(range(10))]},  # both
        {"key_hashes": hashes.astype(np.int64)}, {"key_hashes": hashes.tolist()},
        {"value_hashes": hashes[:9]}, {"value_hashes": np.arange(11, dtype=np.int32)},
        {"value_hashes": hashes.astype(np.float32)},
        {"value_descs": [key_desc(range(9))]},  # 9 values for 10 keys
        {"value_descs": [key_desc(range(10))], "value_hashes": hashes},  # both
        {"key_hashes": None, "key_descs": [("int64", 8)]},  # not a column tuple
        {"key_hashes": None, "key_descs": [past_its_buffer]},
    ]
    for kwargs in bad_calls:
        with pytest.raises(REFUSED):
            update(**kwargs)
        assert not nodes.any() and not dirty.any(), kwargs
    update()  # the same call with good arguments works
    assert dirty.any() and nodes.any()


def test_forest_refresh_and_diff_refuse_bad_input():
    depth = 4
    a, b = native_forest(3, depth), native_forest(3, depth)
    native.forest_update(*a, depth, native.MODE_VALUE, 1, [], np.arange(50, dtype=np.int32),
                         [], None)
    for nodes, dirty, d in [(a[0][:-1], a[1], depth), (a[0], a[1][:2], depth),
                            (a[0], a[1], 5), (a[0].astype(np.int64), a[1], depth),
                            (readonly(a[0]), a[1], depth), (a[0], readonly(a[1]), depth),
                            ([0] * len(a[0]), a[1], depth), (None, a[1], depth)]:
        with pytest.raises(REFUSED):
            native.forest_refresh(nodes, dirty, d)
    out, compared = np.zeros(64, np.int64), np.zeros(depth, np.int64)
    with pytest.raises(InvalidArgumentError, match="refresh"):  # stale inner nodes
        native.forest_diff(*a, depth, *b, depth, out, compared)
    native.forest_refresh(*a, depth)
    assert native.forest_diff(*a, depth, *b, depth, out, compared) > 0
    other = native_forest(4, depth)
    out.fill(-7)
    compared.fill(-7)
    bad_calls = [
        (*a, depth, *other, depth, out, compared),  # 3 trees against 4
        (*a, depth, *b, depth, out, compared[:-1]),  # a level short
        (*a, depth, *b, depth, readonly(out), compared),
        (*a, depth, *b, depth, out.astype(np.int32), compared),
        (*a, depth, *b, depth, out.tolist(), compared),
        (*a, depth, *b, depth, None, compared),
        (*a, depth, *b, depth, out, compared.astype(np.float64)),
        (a[0][:-1], a[1], depth, *b, depth, out, compared),
        (*a, 27, *b, depth, out, compared),
    ]
    for args in bad_calls:
        with pytest.raises(REFUSED):
            native.forest_diff(*args)
    assert (out == -7).all() and (compared == -7).all()
    # A diff with no room still counts (the caller asks again with more).
    count = native.forest_diff(*a, depth, *b, depth, out, compared)
    assert native.forest_diff(*a, depth, *b, depth, out[:0]) == count


def test_locate_and_select_refuse_bad_outputs():
    keys = [key_desc(range(100))]
    parts, leaves = np.zeros(100, np.int32), np.zeros(100, np.int32)
    native.locate_keys(keys, 10, 271, parts, leaves)
    native.locate_keys(keys, 10, 271, None, leaves)
    parts.fill(-7)
    leaves.fill(-7)
    bad_calls = [
        ([], 10, 271, parts, leaves),  # no key column
        (keys, 1, 271, parts, leaves), (keys, 28, 271, parts, leaves),
        (keys, 10, 0, parts, leaves), (keys, 10, -1, parts, leaves),
        (keys, 10, 271, parts[:99], leaves), (keys, 10, 271, parts, leaves[:99]),
        (keys, 10, 271, np.zeros(101, np.int32), leaves),
        (keys, 10, 271, parts.astype(np.float32), leaves),
        (keys, 10, 271, parts, readonly(leaves)),
        (keys, 10, 271, parts.tolist(), leaves),
        ([("int64", 8)], 10, 271, parts, leaves),
        (None, 10, 271, parts, leaves),
    ]
    for args in bad_calls:
        with pytest.raises(REFUSED):
            native.locate_keys(*args)
    assert (parts == -7).all() and (leaves == -7).all()

    leaf_set = native.LeafSet(10, 271, np.array([0, 5, 271 * 512 - 1], np.int64))
    assert leaf_set.count == 3
    for args in [(10, 271, np.array([271 * 512], np.int64)),  # past the last leaf
                 (10, 271, np.array([3, -1], np.int64)),
                 (1, 271, np.zeros(1, np.int64)), (28, 271, np.zeros(1, np.int64)),
                 (10, 0, np.zeros(1, np.int64)),
                 (10, 271, np.zeros(1, np.int32)), (10, 271, np.zeros(1, np.float64)),
                 (10, 271, [0, 1]), (10, 271, None)]:
        with pytest.raises(REFUSED):
            native.LeafSet(*args)

    mask = bytearray(b"\xaa" * 13)  # ceil(100 / 8)
    native.select_keys(keys, leaf_set, mask)
    mask = bytearray(b"\xee" * 13)
    for args in [(keys, leaf_set, bytearray(12)),  # a byte short
                 (keys, leaf_set, bytes(13)),  # read-only
                 (keys, leaf_set, readonly(np.zeros(13, np.uint8))),
                 (keys, leaf_set, [0] * 13), (keys, leaf_set, None),
                 (keys, None, mask), (keys, object(), mask), ([], leaf_set, mask)]:
        with pytest.raises(REFUSED):
            native.select_keys(*args)
    assert mask == b"\xee" * 13


def test_tree_records_refuse_bad_buffers_and_headers():
    depth = 3
    tree = np.zeros(native.tree_node_count(depth), np.int32)
    tree[3:] = [1, 2, 3, 4]
    size = native.tree_serialized_size(depth)
    out = bytearray(size)
    native.write_tree(tree, depth, 1, 5, native.MODE_VALUE, out)
    record = bytes(out)
    out = bytearray(b"\xee" * size)
    bad_writes = [
        (tree, depth, 1, 5, native.MODE_VALUE, bytearray(size - 1)),  # too small
        (tree, depth, 1, 5, native.MODE_VALUE, bytes(size)),  # read-only
        (tree, depth, 1, 5, native.MODE_VALUE, None),
        (tree[:-1], depth, 1, 5, native.MODE_VALUE, out),
        (np.zeros(len(tree) + 1, np.int32), depth, 1, 5, native.MODE_VALUE, out),
        (tree.astype(np.float32), depth, 1, 5, native.MODE_VALUE, out),
        (tree.tolist(), depth, 1, 5, native.MODE_VALUE, out),
        (tree, 1, 1, 5, native.MODE_VALUE, out),
        (tree, depth, 5, 5, native.MODE_VALUE, out),  # partition >= count
        (tree, depth, -1, 5, native.MODE_VALUE, out),
        (tree, depth, 0, 0, native.MODE_VALUE, out),
        (tree, depth, 1, 5, 9, out),
    ]
    for args in bad_writes:
        with pytest.raises(REFUSED):
            native.write_tree(*args)
    assert out == b"\xee" * size

    header = native.read_tree_header(record, 0)
    assert header[1:5] == (depth, native.MODE_VALUE, 1, 5)
    for args in [(record, -1), (record, len(record) + 1), (list(record), 0), (None, 0)]:
        with pytest.raises(REFUSED):
            native.read_tree_header(*args)
    with pytest.raises(CorruptDataError, match="truncated"):
        native.read_tree_header(record, len(record))

    back = np.full(len(tree), 7, np.int32)
    native.read_tree(record, 0, header, back)
    assert back.tolist() == [10, 3, 7, 1, 2, 3, 4]
    bigger = native.tree_node_count(depth + 1)
    bad_reads = [
        (record[:-1], 0, header, back),  # truncated leaves
        (record, 1, header, back),  # the record does not fit from there
        (record, -1, header, back),
        (record, 0, header[:5], back),
        (record, 0, (1, 28, 0, 1, 5, size), back),  # no such depth
        (record, 0, (1, depth + 1, 0, 1, 5, size), np.zeros(bigger, np.int32)),  # size
        (record, 0, (1, depth, 0, 1, 5, size + 4), back),
        (record, 0, header, back[:-1]), (record, 0, header, np.zeros(bigger, np.int32)),
        (record, 0, header, back.astype(np.int64)), (record, 0, header, readonly(back)),
        (record, 0, header, None), (record, 0, list(header), back),
    ]
    for args in bad_reads:
        with pytest.raises(REFUSED):
            native.read_tree(*args)
    assert back.tolist() == [10, 3, 7, 1, 2, 3, 4]


# ------------------------------------------------------------------ the public C API

PYX = '''
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memset
from sparkjet.libsparkjet cimport sj_status, SJ_OK
from sparkjet.libsparkjet_merkle cimport sj_merkle_forest, sj_merkle_batch, SJ_MERKLE_VALUE_HASH
from sparkjet._merkle cimport merkle_update, merkle_refresh, merkle_leaf_of_hash

def root(const int32_t[::1] keys, const int32_t[::1] values, int32_t depth):
    nodes = bytearray(4 * ((1 << depth) - 1))
    dirty = bytearray(1)
    cdef unsigned char[::1] n = nodes
    cdef unsigned char[::1] d = dirty
    cdef sj_merkle_forest f
    f.depth = depth
    f.partition_count = 1
    f.nodes = <int32_t *>&n[0]
    f.dirty = <uint8_t *>&d[0]
    cdef sj_merkle_batch b
    memset(&b, 0, sizeof(b))
    b.key_hashes = &keys[0]
    b.value_hashes = &values[0]
    b.rows = keys.shape[0]
    b.mode = SJ_MERKLE_VALUE_HASH
    cdef int64_t err
    cdef int32_t col
    cdef sj_status st
    with nogil:
        st = merkle_update(&f, &b, 1, &err, &col)
        if st == SJ_OK:
            st = merkle_refresh(&f)
    if st != SJ_OK:
        raise ValueError(st)
    return (<int32_t *>&n[0])[0], merkle_leaf_of_hash(keys[0], depth)
'''

SETUP = '''
import sparkjet
from Cython.Build import cythonize
from setuptools import Extension, setup
setup(name="downstream_merkle", ext_modules=cythonize(
    [Extension("downstream_merkle", ["downstream_merkle.pyx"],
               include_dirs=[sparkjet.get_include()])],
    compiler_directives={"language_level": "3"}))
'''


def test_downstream_extension_cimports_the_merkle_api(tmp_path):
    (tmp_path / "downstream_merkle.pyx").write_text(textwrap.dedent(PYX))
    (tmp_path / "setup.py").write_text(SETUP)
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    keys, values = vector_hashes()
    code = ("import sys, numpy as np; sys.path.insert(0, '.'); import downstream_merkle as d;"
            f"print(*d.root(np.array({keys}, np.int32), np.array({values}, np.int32), 10))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["67687613", "1014"]


def test_public_names():
    for name in merkle.__all__:
        assert hasattr(merkle, name), name
    assert isinstance(diff(MerkleForest(3, 3), MerkleForest(3, 3)), MerkleDiff)
    assert repr(MerkleForest(3, 3)) == (
        "MerkleForest(partition_count=3, depth=3, value_hash='value')")
