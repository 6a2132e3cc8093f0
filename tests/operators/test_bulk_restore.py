"""Bulk restore (issue 24 item 6): a restore sizes the key map once and fills it in bulk
(``KeyMap.reserve`` / ``upsert_bulk``, ``GroupMap.reserve``, ``Groups.slots(bulk=True)``)
instead of growing it by rehashing as keys come. The state it builds must be exactly the
one the key-by-key path builds: same slots, same keys, every aggregate array bit for bit,
for every aggregate kind (int64 and decimal sums included), with keys repeated across
restored tables. Bad input to the new entry points raises a clear error and changes
nothing.

The native tests and the ``Groups`` tests failed before the change (no such methods); the
aggregator tests compare the bulk path with the key-by-key one and held before too, when
both were the same path: they guard that the bulk path changes nothing."""
import numpy as np
import pyarrow as pa
import pytest

from sparkjet import _native
from sparkjet.errors import InvalidArgumentError, NullKeyError
from sparkjet.operators.groups import Groups
from sparkjet.operators.rolling import KeyedAggregator

# -- the native entry points ---------------------------------------------------------------


def _keys(n, distinct, seed=1):
    rng = np.random.default_rng(seed)
    keys = rng.integers(-distinct, distinct, n, dtype=np.int64)
    keys[:2] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    return keys


@pytest.mark.parametrize("preloaded", [0, 1_000])
@pytest.mark.parametrize("distinct", [50_000, 10**15])   # many repeats / almost none
def test_upsert_bulk_gives_upserts_slots(preloaded, distinct):
    keys = _keys(200_000, distinct)
    one, bulk = _native.KeyMap(0), _native.KeyMap(0)
    want, got = np.empty_like(keys), np.empty_like(keys)
    one.upsert(keys, want)
    bulk.upsert(keys[:preloaded], got[:preloaded])
    bulk.upsert_bulk(keys[preloaded:], got[preloaded:])
    assert np.array_equal(got, want)
    assert len(bulk) == len(one)
    stored_one, stored_bulk = np.empty(len(one), np.int64), np.empty(len(one), np.int64)
    one.keys_at(np.arange(len(one), dtype=np.int64), stored_one)
    bulk.keys_at(np.arange(len(one), dtype=np.int64), stored_bulk)
    assert np.array_equal(stored_bulk, stored_one)
    found = np.empty_like(keys)
    bulk.lookup(keys, found)
    assert np.array_equal(found, want)


def test_keymap_bad_input_raises_and_changes_nothing():
    m = _native.KeyMap(0)
    keys = np.arange(10, dtype=np.int64)
    m.upsert_bulk(keys, np.empty(10, np.int64))
    with pytest.raises(InvalidArgumentError, match="total must be >= 0, not -1"):
        m.reserve(-1)
    with pytest.raises(MemoryError, match=r"no room for 2199023255552 keys \(at most 2\*\*32 - 2"):
        m.reserve(2**41)
    # a bucket holds slot + 1 in 32 bits: one key more than fits is refused before any
    # memory is asked for
    with pytest.raises(MemoryError, match=r"no room for 4294967295 keys"):
        m.reserve(2**32 - 1)
    with pytest.raises(MemoryError):
        _native.KeyMap(2**32 - 1)
    with pytest.raises(MemoryError):
        _native.KeyMap(2**41)
    with pytest.raises(InvalidArgumentError, match="slots"):
        m.upsert_bulk(np.arange(20, 30, dtype=np.int64), np.empty(9, np.int64))
    with pytest.raises(TypeError):
        m.upsert_bulk(None, np.empty(0, np.int64))
    with pytest.raises(TypeError):
        m.upsert_bulk(np.empty(0, np.int64), None)
    with pytest.raises(ValueError, match="dtype mismatch"):
        m.upsert_bulk(np.arange(3, dtype=np.int32), np.empty(3, np.int64))
    with pytest.raises(ValueError):
        m.upsert_bulk(np.arange(40, dtype=np.int64)[::2], np.empty(20, np.int64))
    readonly = np.empty(3, np.int64)
    readonly.flags.writeable = False
    with pytest.raises(ValueError):
        m.upsert_bulk(np.arange(3, dtype=np.int64), readonly)
    assert len(m) == 10
    slots = np.empty(10, np.int64)
    m.lookup(keys, slots)
    assert slots.tolist() == list(range(10))
    m.reserve(0)
    m.reserve(5)                 # below the size: nothing to do
    m.upsert_bulk(np.empty(0, np.int64), np.empty(0, np.int64))
    assert len(m) == 10


def test_groupmap_reserve_bad_input_raises():
    g = _native.GroupMap(0)
    with pytest.raises(InvalidArgumentError, match="total must be >= 0, not -3"):
        g.reserve(-3)
    with pytest.raises(MemoryError, match="2\\*\\*40"):
        g.reserve(2**41)
    g.reserve(100_000)
    assert len(g) == 0


# -- Groups ----------------------------------------------------------------------------------

def _key_tables():
    rng = np.random.default_rng(5)
    ints = rng.integers(0, 30_000, 100_000)
    strs = pa.array([f"k{i}" for i in ints])
    yield "int64", pa.table({"a": pa.array(ints, pa.int64())})
    yield "uint8", pa.table({"a": pa.array(ints % 200, pa.uint8())})
    yield "string", pa.table({"a": strs})
    yield "composite", pa.table({"a": pa.array(ints % 97, pa.int64()), "b": strs})


@pytest.mark.parametrize("name,table", list(_key_tables()), ids=lambda x: x if isinstance(x, str) else "")
def test_groups_bulk_slots_equal_slots(name, table):
    names = table.column_names
    plain, bulk = Groups(names), Groups(names)
    head, tail = table.slice(0, 1_000), table.slice(1_000)
    want = np.concatenate([plain.slots(head), plain.slots(tail)])
    got = np.concatenate([bulk.slots(head, bulk=True), bulk.slots(tail, bulk=True)])
    assert np.array_equal(got, want)
    assert len(bulk) == len(plain)
    every = np.arange(len(plain))
    assert bulk.keys(every).equals(plain.keys(every))


def test_groups_bulk_refuses_a_null_key_before_adding_any():
    g = Groups(["a", "b"])
    g.slots(pa.table({"a": [1], "b": ["x"]}))
    with pytest.raises(NullKeyError):
        g.slots(pa.table({"a": [2, None], "b": ["y", "z"]}), bulk=True)
    assert len(g) == 1
    ints = Groups("a")
    with pytest.raises(NullKeyError):
        ints.slots(pa.table({"a": pa.array([1, None], pa.int64())}), bulk=True)
    assert len(ints) == 0


# -- the aggregator: bulk restore == key-by-key restore, bit for bit -----------------------

AGGREGATIONS = {
    "n": "count",
    "fs": ("sum", "f"), "fmin": ("min", "f"), "fmax": ("max", "f"), "fmean": ("mean", "f"),
    "ffirst": ("first", "f"), "flast": ("last", "f"),
    "is": ("sum", "i"), "imin": ("min", "i"), "imax": ("max", "i"), "imean": ("mean", "i"),
    "ifirst": ("first", "i"), "ilast": ("last", "i"),
    "tmin": ("min", "t"), "tmax": ("max", "t"), "tfirst": ("first", "t"), "tlast": ("last", "t"),
}


def _batches(key, rows=30_000, batches=4, seed=3, big=False):
    """Random rows over 8,000 keys; ``big``: int values whose sums pass int64."""
    rng = np.random.default_rng(seed)
    bound = 2**61 if big else 2**50
    for _ in range(batches):
        ids = rng.integers(0, 8_000, rows)
        f = rng.normal(0, 1e6, rows)
        f[rng.random(rows) < 0.01] = -0.0
        i = rng.integers(-bound, bound, rows)
        t = rng.integers(0, 2**50, rows)
        null = rng.random(rows) < 0.05
        columns = {
            "f": pa.array(f, mask=null),
            "i": pa.array(i, pa.int64(), mask=rng.random(rows) < 0.05),
            "t": pa.array(t, pa.timestamp("us"), mask=null),
        }
        if key == "int":
            columns["k"] = pa.array(ids, pa.int64())
        elif key == "string":
            columns["k"] = pa.array([f"key-{x}" for x in ids])
        else:
            columns["k"] = pa.array(ids % 50, pa.int64())
            columns["k2"] = pa.array([f"s{x}" for x in ids])
        yield pa.record_batch(columns)


def _key(key):
    return ["k", "k2"] if key == "composite" else "k"


def _old_path(agg):
    """The key-by-key path: the same aggregator with the bulk insertion turned off, and
    every restore combined into filled arrays (none taken as it is)."""
    slots, group_slots = agg._slots, agg._group_slots
    agg._slots = lambda keys, bulk=False, grow=True: slots(keys, grow=grow)
    agg._group_slots = lambda table, bulk=False, grow=True: group_slots(table, grow=grow)
    agg._restore_as_is = agg._restore_combined
    return agg


def _state(agg):
    """Everything a restore builds, as bytes: sizes, keys, every state array."""
    n = len(agg)
    out = {"size": n, "counts": agg._counts[:n].tobytes(),
           "keys": agg.snapshot().select(agg.key if isinstance(agg.key, list) else [agg.key])}
    for name, arrays in (("state", agg._state), ("nulls", agg._nulls), ("seen", agg._seen)):
        for k, arr in sorted(arrays.items()):
            out[f"{name}:{k}"] = np.ascontiguousarray(arr[:n]).tobytes()
    return out


def _assert_same(a, b):
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        if k == "keys":
            assert sa[k].equals(sb[k]), k
        else:
            assert sa[k] == sb[k], k


@pytest.mark.parametrize("overflow", ["fail", "decimal"])
@pytest.mark.parametrize("key", ["int", "string", "composite"])
def test_bulk_restore_builds_the_old_paths_state_exactly(key, overflow):
    original = KeyedAggregator(_key(key), AGGREGATIONS, overflow=overflow)
    big = overflow == "decimal"
    for batch in _batches(key, big=big):
        original.update(batch)
    snap = original.snapshot()
    if overflow == "decimal":
        assert pa.types.is_decimal(snap.schema.field("__sum__i").type)
    else:
        assert snap.schema.field("__sum__i").type == pa.int64()
    # as two partitions' tables, the second restored twice (its keys repeat): the
    # bulk path meets keys it holds already
    half = snap.num_rows // 2
    parts = [snap.slice(0, half), snap.slice(half), snap.slice(half)]
    new = KeyedAggregator(_key(key), AGGREGATIONS, overflow=overflow)
    old = _old_path(KeyedAggregator(_key(key), AGGREGATIONS, overflow=overflow))
    for part in parts:
        new.restore(part)
        old.restore(part)
    _assert_same(new, old)
    # whole, into an empty aggregator (its state arrays taken from the columns, not
    # combined): the original state back, the combining path's bytes (-0.0 sums, seen
    # flags, nulls), and updates go on alike
    whole = KeyedAggregator(_key(key), AGGREGATIONS, overflow=overflow)
    whole.restore(snap)
    assert whole.snapshot().equals(snap)
    _assert_same(whole, original)
    combined = _old_path(KeyedAggregator(_key(key), AGGREGATIONS, overflow=overflow))
    combined.restore(snap)
    _assert_same(whole, combined)
    more = next(_batches(key, seed=11, big=big))
    assert whole.update(more).equals(original.update(more))


@pytest.mark.parametrize("overflow", ["fail", "decimal"])
@pytest.mark.parametrize("key", ["int", "string", "composite"])
def test_a_restore_into_an_empty_state_takes_the_columns_as_the_kernels_make_them(
        key, overflow, monkeypatch):
    """Sums, means, minima and maxima restored into an empty aggregator are its state
    columns taken as they are, with no kernel run (first and last keep seen flags and go
    through the kernels): byte for byte the state the combining path makes, -0.0 sums,
    nulls, NaN and decimal sums included."""
    aggregations = {k: v for k, v in AGGREGATIONS.items()
                    if not (isinstance(v, tuple) and v[0] in ("first", "last"))}
    original = KeyedAggregator(_key(key), aggregations, overflow=overflow)
    big = overflow == "decimal"
    for batch in _batches(key, big=big):
        original.update(batch)
    nan = next(_batches(key, rows=3, seed=5))
    nan = nan.set_column(nan.schema.get_field_index("f"), "f",
                         pa.array([float("nan"), -0.0, None], pa.float64()))
    original.update(nan)

    def no_kernels(*args, **kwargs):
        raise AssertionError("a kernel combined state that could be taken as it is")
    snap = original.snapshot()
    # (a kernel's sum is never -0.0, 0.0 + -0.0 being 0.0; a snapshot's may be, and the
    # combining path makes it 0.0)
    sums = snap.column("__sum__f").to_numpy().copy()
    sums[0] = -0.0
    signed = snap.set_column(snap.schema.get_field_index("__sum__f"), "__sum__f", pa.array(sums))
    for table in (signed, snap):
        combined = _old_path(KeyedAggregator(_key(key), aggregations, overflow=overflow))
        combined.restore(table)
        taken = KeyedAggregator(_key(key), aggregations, overflow=overflow)
        monkeypatch.setattr(taken.values, "combine", no_kernels)
        taken.restore(table)
        monkeypatch.undo()
        _assert_same(taken, combined)   # (bytes: a NaN is not equal to itself)
    whole = taken
    _assert_same(whole, original)
    more = next(_batches(key, seed=11, big=big))
    whole.update(more)
    original.update(more)
    _assert_same(whole, original)
