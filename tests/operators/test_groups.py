"""The window kernels against plain references: group slots of composite keys against a
dict over the rows (and pandas' ngroup), stored keys against the Hazelcast payloads, panes
against Python's floor division, session ids against a loop, int64 combines against numpy.
Bad input to the bindings is in test_bindings.py."""
import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from helpers import reference as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjet import _native
from sparkjet._keys import describe
from sparkjet.errors import InvalidArgumentError, NullKeyError, UnsupportedTypeError
from sparkjet.operators.groups import Groups

# ------------------------------------------------------------------ composite keys

INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
             pa.uint32(), pa.uint64()]
STR_TYPES = [pa.string(), pa.large_string(), pa.string_view()]
BIN_TYPES = [pa.binary(), pa.large_binary(), pa.binary_view()]


def int_values(t):
    info = np.iinfo(t.to_pandas_dtype())
    # A few values, so keys repeat, including each type's extremes.
    return st.sampled_from(sorted({0, 1, -1 if info.min < 0 else 2, int(info.min),
                                   int(info.max)}))


# Few distinct values, so keys repeat; empty, unicode, and longer than a view's 12 inline
# bytes.
TEXTS = st.sampled_from(["", "a", "é", "日本語", "a" * 13, "ab", "zzzzzzzzzzzzzzzzzzz"])
BLOBS = st.sampled_from([b"", b"\x00", b"\x00\x00", b"\xff" * 20, b"key"])


@st.composite
def key_column_specs(draw):
    """(arrow type, value strategy) for one key column."""
    kind = draw(st.sampled_from(["int", "str", "bin", "fixed", "dict"]))
    if kind == "int":
        t = draw(st.sampled_from(INT_TYPES))
        return t, int_values(t)
    if kind == "str":
        return draw(st.sampled_from(STR_TYPES)), TEXTS
    if kind == "bin":
        return draw(st.sampled_from(BIN_TYPES)), BLOBS
    if kind == "fixed":
        width = draw(st.integers(0, 3))
        return pa.binary(width), st.sampled_from([b"a" * width, b"\x00" * width, b"z" * width])
    return pa.dictionary(pa.int32(), pa.string()), TEXTS


def make_array(values, t, pad):
    """values as an Arrow array of type t, sliced out of a longer one when pad > 0."""
    padded = [values[0]] * pad + values + [values[0]] * pad
    if pa.types.is_dictionary(t):
        arr = pa.array(padded, t.value_type).dictionary_encode()
    else:
        arr = pa.array(padded, t)
    return arr.slice(pad, len(values)) if pad else arr


@st.composite
def keyed_batches(draw):
    """Key column names, their types, and batches (RecordBatches, or Tables whose columns
    are chunked differently), some of them slices of longer arrays."""
    specs = draw(st.lists(key_column_specs(), min_size=1, max_size=3))
    names = [f"k{i}" for i in range(len(specs))]
    batches = []
    for _ in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 40))
        columns = {}
        for name, (t, values) in zip(names, specs):
            vals = draw(st.lists(values, min_size=rows, max_size=rows))
            pad = draw(st.sampled_from([0, 0, 3]))
            if draw(st.booleans()) and rows > 1:
                cut = draw(st.integers(1, rows - 1))
                columns[name] = pa.chunked_array(
                    [make_array(vals[:cut], t, pad), make_array(vals[cut:], t, 0)])
            else:
                columns[name] = make_array(vals, t, pad)
        columns["value"] = pa.array(range(rows), pa.int64())
        if any(isinstance(c, pa.ChunkedArray) for c in columns.values()):
            batches.append(pa.table(columns))
        else:
            batches.append(pa.record_batch(columns))
    return names, batches


def reference_slots(batches, names):
    """Slots by a dict over each row's tuple of values, in order of first appearance."""
    ids, out, keys = {}, [], []
    for b in batches:
        for row in zip(*(b.column(n).to_pylist() for n in names)):
            if row not in ids:
                ids[row] = len(ids)
                keys.append(row)
            out.append(ids[row])
    return out, keys


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keyed_batches())
def test_slots_match_a_dict_over_the_rows(case):
    names, batches = case
    groups = Groups(names)
    got = np.concatenate([groups.slots(b) for b in batches])
    want, keys = reference_slots(batches, names)
    assert got.tolist() == want
    assert len(groups) == len(keys)
    # The key table: every group's values, in the batches' types (dictionaries decoded).
    table = groups.keys(np.arange(len(groups)))
    assert table.column_names == names
    assert list(zip(*(table.column(n).to_pylist() for n in names))) == keys
    back = groups.keys(got)
    assert list(zip(*(back.column(n).to_pylist() for n in names))) == [keys[s] for s in want]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keyed_batches())
def test_find_matches_a_dict_and_adds_nothing(case):
    names, batches = case
    groups = Groups(names)
    groups.slots(batches[0])
    size = len(groups)
    known, _ = reference_slots(batches[:1], names)
    ids = dict(zip(map(tuple, _rows(batches[0], names)), known))
    for b in batches:
        want = [ids.get(row, -1) for row in map(tuple, _rows(b, names))]
        assert groups.find(b).tolist() == want
    assert len(groups) == size


def _rows(batch, names):
    return zip(*(batch.column(n).to_pylist() for n in names))


def test_slots_number_groups_as_pandas_ngroup():
    rng = np.random.default_rng(7)
    n = 20_000
    frame = pd.DataFrame({"a": rng.integers(-3, 3, n), "b": rng.choice(["x", "yy", "", "é"], n),
                          "c": rng.integers(0, 2**40, n) % 5})
    batches = pa.Table.from_pandas(frame, preserve_index=False).to_batches(max_chunksize=3000)
    groups = Groups(["a", "b", "c"])
    got = np.concatenate([groups.slots(b) for b in batches])
    want = frame.groupby(["a", "b", "c"], sort=False).ngroup().to_numpy()
    assert (got == want).all()


def test_keys_outlive_many_small_batches():
    """Keys added a few at a time (parts merged as they grow) come back in any order."""
    groups = Groups(["k", "s"])
    for start in range(0, 3000, 7):
        k = np.arange(start, start + 7) % 2000
        groups.slots(pa.record_batch({"k": k, "s": [f"s{x % 3}" for x in k]}))
    assert len(groups) == 2000
    assert len(groups._parts) <= 12  # logarithmic, not one part per batch
    order = np.random.default_rng(1).permutation(2000)
    table = groups.keys(order)
    assert table.column("k").to_pylist() == order.tolist()
    assert table.column("s").to_pylist() == [f"s{x % 3}" for x in order]
    assert groups.keys([]).num_rows == 0 and groups.keys([]).schema == groups.schema


def test_same_values_in_other_layouts_are_the_same_key():
    """The native map keys by payload: string and large_string (or int32 and int64 hashed
    as Integer) give the same slots; Groups itself refuses a type change."""
    m = _native.GroupMap()
    slots = np.empty(3, np.int64)
    first = np.empty(3, np.int64)
    for t in (pa.string(), pa.large_string(), pa.string_view()):
        arr = pa.array(["a", "", "a much longer text"], t)
        m.upsert([describe(arr, None, 0, "k")], slots, first)
        assert slots.tolist() == [0, 1, 2]
    assert len(m) == 3
    ints = _native.GroupMap()
    ints.upsert([describe(pa.array([5, 6], pa.int32()), None, 0, "k")], slots[:2], first)
    ints.lookup([describe(pa.array([6, 5, 7]), "integer", 0, "k")], slots)
    assert slots.tolist() == [1, 0, -1]
    groups = Groups("k")
    groups.slots(pa.record_batch({"k": pa.array(["a"])}))
    with pytest.raises(InvalidArgumentError, match="changed type from string to large_string"):
        groups.slots(pa.record_batch({"k": pa.array(["a"], pa.large_string())}))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), TEXTS, st.integers(-(2**63), 2**63 - 1)),
                min_size=1, max_size=30))
def test_stored_keys_are_the_hazelcast_payloads(rows):
    a, s, c = (list(x) for x in zip(*rows))
    arrays = [pa.array(a, pa.int32()), pa.array(s), pa.array(c, pa.int64())]
    descs = [describe(x, None, 0, "k") for x in arrays]
    m = _native.GroupMap()
    n = len(rows)
    slots, first = np.empty(n, np.int64), np.empty(n, np.int64)
    added = m.upsert(descs, slots, first)
    hashes = np.empty(n, np.int32)
    _native.row_hashes(descs, ref.SEED, hashes)
    for k in range(added):
        r = int(first[k])
        want = (ref.payload(a[r], "integer") + ref.payload(s[r], "string")
                + ref.payload(c[r], "long"))
        assert m.key_payload(k) == want
        assert ref.murmur3_32(want) == hashes[r]  # the key's identity is what partitions hash


def test_uint64_keys_above_the_long_range_group():
    groups = Groups("k")
    big = pa.array([2**64 - 1, 2**63, 2**64 - 1, 0], pa.uint64())
    assert groups.slots(pa.record_batch({"k": big})).tolist() == [0, 1, 0, 2]
    assert groups.keys([0, 1]).column("k").to_pylist() == [2**64 - 1, 2**63]


def test_groups_refuse_nulls_missing_columns_and_non_keys():
    groups = Groups(["a", "b"])
    ok = pa.record_batch({"a": [1, 2], "b": ["x", "y"]})
    assert groups.slots(ok).tolist() == [0, 1]
    # A null in the second chunk of a table: refused, and nothing of the first is added.
    table = pa.table({"a": pa.chunked_array([[3, 4], [5, None]]),
                      "b": pa.chunked_array([["p", "q"], ["r", "s"]])})
    with pytest.raises(NullKeyError, match="key column 'a' has a null at index 3") as e:
        groups.slots(table)
    assert e.value.index == 3 and len(groups) == 2
    with pytest.raises(NullKeyError, match="key column 'b'"):
        groups.slots(pa.record_batch({"a": [1], "b": pa.array([None], pa.string())}))
    with pytest.raises(InvalidArgumentError, match="no key column 'b'; columns are a, c"):
        groups.slots(pa.record_batch({"a": [1], "c": ["x"]}))
    with pytest.raises(InvalidArgumentError, match="changed type from int64 to int32"):
        groups.slots(pa.record_batch({"a": pa.array([1], pa.int32()), "b": ["x"]}))
    with pytest.raises(UnsupportedTypeError, match="key column 'f' has type double"):
        Groups("f").slots(pa.record_batch({"f": [1.5]}))
    with pytest.raises(UnsupportedTypeError, match="list"):
        Groups("l").slots(pa.record_batch({"l": [[1]]}))
    with pytest.raises(InvalidArgumentError, match="RecordBatch or Table"):
        groups.slots({"a": [1], "b": ["x"]})
    with pytest.raises(InvalidArgumentError, match="repeat"):
        Groups(["a", "a"])
    with pytest.raises(InvalidArgumentError):
        Groups([])
    assert len(groups) == 2 and groups.keys([1, 0]).to_pylist() == [
        {"a": 2, "b": "y"}, {"a": 1, "b": "x"}]


def test_keys_refuse_slots_outside_the_groups():
    groups = Groups("k")
    with pytest.raises(InvalidArgumentError, match="slot 0 at index 0 is outside"):
        groups.keys([0])
    assert groups.keys([]).num_columns == 0
    groups.slots(pa.record_batch({"k": [10, 20]}))
    for bad in ([2], [-1], [0, 5]):
        with pytest.raises(InvalidArgumentError, match="outside 0..1"):
            groups.keys(bad)
    with pytest.raises(InvalidArgumentError, match="integers"):
        groups.keys([0.5])
    assert groups.keys(np.array([[1], [0]])).column("k").to_pylist() == [20, 10]


def test_an_empty_first_batch_fixes_the_types():
    groups = Groups("k")
    assert groups.slots(pa.record_batch({"k": pa.array([], pa.string())})).tolist() == []
    assert groups.schema == pa.schema([("k", pa.string())])
    with pytest.raises(InvalidArgumentError, match="changed type"):
        groups.slots(pa.record_batch({"k": [1]}))


def test_threads_sharing_a_group_map_take_turns():
    m = _native.GroupMap()
    keys = [pa.array(np.arange(i, 200_000 + i) % 5000) for i in range(4)]
    results = [None] * 4

    def run(i):
        slots = np.empty(len(keys[i]), np.int64)
        first = np.empty(len(keys[i]), np.int64)
        for _ in range(5):
            m.upsert([describe(keys[i], None, 0, "k")], slots, first)
        results[i] = slots

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(m) == 5000
    probe = np.empty(5000, np.int64)
    m.lookup([describe(pa.array(np.arange(5000)), None, 0, "k")], probe)
    assert sorted(probe.tolist()) == list(range(5000))
    for i in range(4):
        assert (results[i] == probe[keys[i].to_numpy()]).all()


# ------------------------------------------------------------------ panes

INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(ts=st.lists(st.one_of(INT64, st.integers(-1000, 1000)), max_size=40),
       pane_size=st.one_of(st.integers(1, 100), st.integers(1, 2**63 - 1)),
       offset=st.one_of(st.integers(-100, 100), INT64),
       min_pane=st.one_of(st.integers(-10, 10), INT64))
def test_panes_are_floor_division_over_all_of_int64(ts, pane_size, offset, min_pane):
    arr = np.array(ts, np.int64)
    panes = np.full(len(ts), 7, np.int64)
    late = np.full(len(ts), 9, np.uint8)
    want = [(t - offset) // pane_size for t in ts]  # Python ints: exact
    if any(not -(2**63) <= w < 2**63 for w in want):
        with pytest.raises(InvalidArgumentError, match="does not fit int64"):
            _native.assign_panes_late(arr, pane_size, offset, min_pane, panes, late)
        return
    count = _native.assign_panes_late(arr, pane_size, offset, min_pane, panes, late)
    assert panes.tolist() == want
    assert late.tolist() == [int(w < min_pane) for w in want]
    assert count == sum(w < min_pane for w in want)


@settings(max_examples=100, deadline=None)
@given(ts=st.lists(st.integers(-(2**40), 2**40), max_size=60), pane_size=st.integers(1, 10**6),
       offset=st.integers(-(10**6), 10**6))
def test_panes_agree_with_numpy_floor_divide(ts, pane_size, offset):
    arr = np.array(ts, np.int64)
    panes = np.empty_like(arr)
    _native.assign_panes(arr, pane_size, offset, panes)
    assert (panes == np.floor_divide(arr - offset, pane_size)).all()
    _native.assign_panes(arr, pane_size, offset, arr)  # in place
    assert (arr == panes).all()


# ------------------------------------------------------------------ sessions


def reference_sessions(group, start, end):
    ids, k, reach = [], -1, None
    for i in range(len(group)):
        if i == 0 or group[i] != group[i - 1] or start[i] > reach:
            k += 1
            reach = end[i]
        reach = max(reach, end[i])
        ids.append(k)
    return ids, k + 1


@st.composite
def sorted_intervals(draw):
    rows = draw(st.lists(st.tuples(st.integers(-3, 3), st.integers(-50, 50), st.integers(0, 12)),
                         max_size=80))
    rows.sort(key=lambda r: (r[0], r[1]))
    return ([r[0] for r in rows], [r[1] for r in rows], [r[1] + r[2] for r in rows])


@settings(max_examples=300, deadline=None)
@given(sorted_intervals())
def test_session_ids_match_a_loop(rows):
    group, start, end = (np.array(x, np.int64) for x in rows)
    session = np.full(len(group), -1, np.int64)
    _native.check_sorted(group, start)
    count = _native.session_ids(group, start, end, session)
    want, k = reference_sessions(*rows)
    assert session.tolist() == want and count == k


def test_sessions_merge_touching_intervals_and_follow_the_running_end():
    group = np.array([1, 1, 1, 1, 2], np.int64)
    start = np.array([0, 5, 6, 41, 41], np.int64)
    end = np.array([5, 40, 7, 50, 42], np.int64)
    session = np.empty(5, np.int64)
    assert _native.session_ids(group, start, end, session) == 3
    assert session.tolist() == [0, 0, 0, 1, 2]


# ------------------------------------------------------------------ int64 combines


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(-(2**40), 2**40)), max_size=100))
def test_int64_combines_match_numpy(rows):
    slots = np.array([r[0] for r in rows], np.int64)
    values = np.array([r[1] for r in rows], np.int64)
    sums, mins, maxs = (np.zeros(10, np.int64), np.full(10, 2**62, np.int64),
                        np.full(10, -(2**62), np.int64))
    _native.agg_sum_i64(slots, values, sums)
    _native.agg_min_i64(slots, values, mins)
    _native.agg_max_i64(slots, values, maxs)
    want_sums, want_mins, want_maxs = (np.zeros(10, np.int64), np.full(10, 2**62, np.int64),
                                       np.full(10, -(2**62), np.int64))
    np.add.at(want_sums, slots, values)
    np.minimum.at(want_mins, slots, values)
    np.maximum.at(want_maxs, slots, values)
    assert (sums == want_sums).all() and (mins == want_mins).all()
    assert (maxs == want_maxs).all()
