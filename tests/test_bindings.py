"""Every binding of sparkjet._native refuses bad input with an exception, never a crash.

Wrong lengths, wrong types, out-of-range indices and random column descriptors go to
each function; the only acceptable outcomes are a result or a TypeError / ValueError /
MemoryError (sparkjet's errors are subclasses). CI runs this file again against an
AddressSanitizer build (SPARKJET_SANITIZE=address), where a read past a buffer aborts
the process instead of passing silently. The Merkle bindings have their own section in
test_merkle.py.
"""
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkjet import _native
from sparkjet.errors import (
    CorruptDataError,
    InvalidArgumentError,
    KeyRangeError,
    SnapshotCorruptError,
)

REFUSED = (TypeError, ValueError, MemoryError, OverflowError)
KINDS = [_native.KEY_INT32, _native.KEY_INT64, _native.KEY_INT64_AS_INT32, _native.KEY_VAR32,
         _native.KEY_VAR64, _native.KEY_FIXED, _native.KEY_VIEW]


def i32(*values):
    return np.array(values, np.int32)


def i64(*values):
    return np.array(values, np.int64)


# ------------------------------------------------------------------ hashing


def test_addresses_are_not_buffers():
    values = i64(1, 2, 3)
    desc = (_native.KEY_INT64, 0, 0, 3, values.ctypes.data, None, ())
    with pytest.raises(TypeError, match="values must be a contiguous buffer"):
        _native.column_partitions(desc, 271, np.zeros(3, np.int32))


def test_hash_output_too_short_or_wrong_type():
    desc = (_native.KEY_INT64, 0, 0, 3, i64(1, 2, 3), None, ())
    with pytest.raises(InvalidArgumentError, match="output holds 2 values, 3 are needed"):
        _native.column_partitions(desc, 271, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="dtype mismatch"):
        _native.column_partitions(desc, 271, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="read-only"):
        _native.column_hashes(desc, 0, _readonly(np.zeros(3, np.int32)))
    with pytest.raises(TypeError):
        _native.column_hashes(desc, 0, [0, 0, 0])
    with pytest.raises(InvalidArgumentError, match="partition_count must be >= 1"):
        _native.column_partitions(desc, 0, np.zeros(3, np.int32))


def _readonly(a):
    a.setflags(write=False)
    return a


def test_column_lengths_past_the_buffers_are_refused():
    with pytest.raises(CorruptDataError):  # 4 int64 values in 24 bytes
        _native.column_partitions((_native.KEY_INT64, 0, 0, 4, i64(1, 2, 3), None, ()), 271,
                                  np.zeros(4, np.int32))
    with pytest.raises(CorruptDataError):  # offset 2 + 2 values past 3
        _native.column_partitions((_native.KEY_INT32, 0, 2, 2, i32(1, 2, 3), None, ()), 271,
                                  np.zeros(2, np.int32))
    with pytest.raises(InvalidArgumentError):  # negative offset
        _native.column_partitions((_native.KEY_INT32, 0, -1, 2, i32(1, 2, 3), None, ()), 271,
                                  np.zeros(2, np.int32))
    with pytest.raises(InvalidArgumentError):  # unknown kind
        _native.column_partitions((99, 0, 0, 1, i32(1), None, ()), 271, np.zeros(1, np.int32))
    with pytest.raises(CorruptDataError):  # fixed width 8 x 2 in 12 bytes
        _native.column_partitions((_native.KEY_FIXED, 8, 0, 2, None, b"x" * 12, ()), 271,
                                  np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="expected"):
        _native.column_partitions((_native.KEY_INT32, 0, 0), 271, np.zeros(1, np.int32))


def test_composite_columns_must_agree_on_rows():
    a = (_native.KEY_INT64, 0, 0, 3, i64(1, 2, 3), None, ())
    b = (_native.KEY_INT64, 0, 0, 2, i64(1, 2), None, ())
    with pytest.raises(InvalidArgumentError, match="'b' has 2 rows, the first column 3"):
        _native.row_hashes([a, b], 0, np.zeros(3, np.int32), 0, ["a", "b"])
    with pytest.raises(InvalidArgumentError, match="at least one column"):
        _native.row_hashes([], 0, np.zeros(3, np.int32))


def test_partitions_from_hashes_checks_lengths():
    with pytest.raises(InvalidArgumentError, match="output holds 1 values, 2 are needed"):
        _native.partitions_from_hashes(i32(1, 2), 271, np.zeros(1, np.int32))
    with pytest.raises(InvalidArgumentError):
        _native.partitions_from_hashes(i32(1, 2), -5, np.zeros(2, np.int32))
    with pytest.raises(ValueError):
        _native.partitions_from_hashes(i64(1, 2), 271, np.zeros(2, np.int32))


def test_murmur3_bytes_takes_any_buffer_only():
    assert _native.murmur3_bytes(np.frombuffer(b"hello", np.uint8), 0) == 0x248BFA47
    with pytest.raises(TypeError):
        _native.murmur3_bytes("hello", 0)


def _buffers(draw, size):
    return draw(st.binary(min_size=0, max_size=size))


@st.composite
def descriptors(draw):
    kind = draw(st.sampled_from(KINDS + [0, 42]))
    length = draw(st.integers(-2, 40))
    offset = draw(st.integers(-2, 40))
    width = draw(st.integers(-1, 20))
    values = draw(st.one_of(st.none(), st.binary(max_size=400)))
    data = draw(st.one_of(st.none(), st.binary(max_size=200)))
    variadic = tuple(draw(st.lists(st.binary(max_size=64), max_size=3)))
    return (kind, width, offset, length, values, data, variadic)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(desc=descriptors(), out_len=st.integers(0, 45))
def test_random_descriptors_never_crash(desc, out_len):
    out = np.full(out_len, -1, np.int32)
    try:
        _native.column_partitions(desc, 271, out)
    except REFUSED:
        pass
    else:
        # Accepted: the descriptor was consistent, and each of its rows got a partition.
        rows = desc[3]
        assert 0 <= rows <= out_len
        assert ((out[:rows] >= 0) & (out[:rows] < 271)).all()
        assert (out[rows:] == -1).all(), "wrote past the column's rows"
    for call in (lambda: _native.column_hashes(desc, 0, out),
                 lambda: _native.row_hashes([desc, desc], 0, out)):
        try:
            call()
        except REFUSED:
            pass


# ------------------------------------------------------------------ chunks


def test_scatter_checks_its_arrays():
    with pytest.raises(InvalidArgumentError, match="starts holds 3 values, 4 are needed"):
        _native.scatter(i32(0, 1), 3, np.zeros(3, np.int64))
    with pytest.raises(InvalidArgumentError, match="perm holds 1 values, 2 are needed"):
        _native.scatter(i32(0, 1), 3, np.zeros(4, np.int64), np.zeros(1, np.int64))
    with pytest.raises(InvalidArgumentError, match="partition_count"):
        _native.scatter(i32(0, 1), 0, np.zeros(4, np.int64))


@pytest.mark.parametrize("width, dtype", [(8, np.int64), (4, np.uint32)])
def test_scatter_fixed_of_large_columns_matches_a_stable_sort(width, dtype):
    """From 1 MiB and 64 partitions up the scatter gathers each partition's values in a
    cache line and writes full lines at once: the result is still the stable order by
    partition, for runs that start anywhere in a line, skewed and empty partitions, a
    destination that starts mid-line, and one not aligned to the width (which takes the
    plain scatter)."""
    rng = np.random.default_rng(11)
    n = (3 << 20) // width + 13
    count = 271
    ids = rng.integers(0, count, n, dtype=np.int32)
    ids[rng.random(n) < 0.3] = 7                      # a hot partition
    ids[ids == 100] = 101                             # an empty one
    src = rng.integers(0, 2**31, n).astype(dtype)
    starts = np.zeros(count + 1, np.int64)
    _native.scatter(ids, count, starts)
    want = src[np.argsort(ids, kind="stable")]
    raw = np.zeros(n * width + 128, np.uint8)
    for shift in (0, width, 64 - width, 3 if width == 8 else 2):
        dst = raw[shift:shift + n * width]
        dst[:] = 0
        _native.scatter_fixed(src, width, ids, starts, dst)
        assert np.array_equal(dst.view(dtype), want), f"destination {shift} bytes into a line"
    bad = ids.copy()
    bad[-1] = 100 if bad[-1] != 100 else 101          # a value for the empty partition
    with pytest.raises(InvalidArgumentError):
        _native.scatter_fixed(src, width, bad, starts, raw[:n * width])


def test_scatter_fixed_refuses_ids_that_do_not_match_the_runs():
    ids = i32(2, 0, 2, 1, 0, 2)
    starts = np.zeros(4, np.int64)
    _native.scatter(ids, 3, starts)
    src = np.arange(6, dtype=np.int64)
    dst = np.zeros(6, np.int64)
    _native.scatter_fixed(src, 8, ids, starts, dst)
    assert dst.tolist() == [1, 4, 3, 0, 2, 5]
    with pytest.raises(InvalidArgumentError):  # partition 2 gets a fourth value
        _native.scatter_fixed(src, 8, i32(2, 2, 2, 1, 0, 2), starts, dst)
    with pytest.raises(InvalidArgumentError):
        _native.scatter_fixed(src, 8, i32(2, 0, 9, 1, 0, 2), starts, dst)
    with pytest.raises(InvalidArgumentError, match="destination holds 40 bytes, 48"):
        _native.scatter_fixed(src, 8, ids, starts, np.zeros(5, np.int64))
    with pytest.raises(InvalidArgumentError, match="source holds"):
        _native.scatter_fixed(src[:5], 8, ids, starts, dst)
    with pytest.raises(InvalidArgumentError):  # runs that run past n
        _native.scatter_fixed(src, 8, ids, i64(0, 2, 3, 9), dst)
    with pytest.raises(InvalidArgumentError, match="width"):
        _native.scatter_fixed(src, 0, ids, starts, dst)
    with pytest.raises(TypeError):
        _native.scatter_fixed(src, 8, ids, starts, bytes(48))  # read-only destination


def _binary(values):
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
    return (offsets, b"".join(values), 0, len(values))


def test_entry_lists_check_offsets_rows_and_room():
    keys, values = _binary([b"k1", b"key2"]), _binary([b"v", b"vv"])
    sizes = np.zeros(2, np.int64)
    _native.entries_sizes(keys, values, sizes)
    assert sizes.tolist() == [11, 14]
    with pytest.raises(InvalidArgumentError, match="sizes holds 1 values"):
        _native.entries_sizes(keys, values, np.zeros(1, np.int64))
    bad = (np.array([0, 2, 99], np.int32), b"k1key2", 0, 2)
    with pytest.raises(CorruptDataError):
        _native.entries_sizes(bad, values, sizes)
    with pytest.raises(CorruptDataError):  # 3 rows need 4 offsets
        _native.entries_sizes((np.array([0, 2, 6], np.int32), b"k1key2", 0, 3),
                              _binary([b"v", b"vv", b""]), np.zeros(3, np.int64))
    with pytest.raises(InvalidArgumentError, match="bad offset"):
        _native.entries_sizes((keys[0], keys[1], -1, 2), values, sizes)
    out = bytearray(25)
    assert _native.entries_encode(keys, values, i64(0, 1), out) == 25
    with pytest.raises(InvalidArgumentError, match="too small"):
        _native.entries_encode(keys, values, i64(0, 1), bytearray(24))
    with pytest.raises(InvalidArgumentError, match="row index"):
        _native.entries_encode(keys, values, i64(0, 2), out)
    with pytest.raises(InvalidArgumentError, match="row index"):
        _native.entries_encode(keys, values, i64(-1), out)
    with pytest.raises(TypeError):
        _native.entries_encode(keys, values, i64(0, 1), bytes(25))


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=200), count=st.integers(0, 20))
def test_random_entry_lists_decode_or_refuse(payload, count):
    try:
        ko, kd, vo, vd = _native.entries_decode(payload, count, "fuzz", 0)
    except SnapshotCorruptError:
        return
    # Decoded: Arrow offsets that stay inside their data, as the payload said.
    for offsets, data in ((ko, kd), (vo, vd)):
        o = np.frombuffer(offsets, np.int32)
        assert len(o) == count + 1 and o[0] == 0 and (np.diff(o) >= 0).all()
        assert o[-1] <= len(data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_chunk_files_scan_or_refuse(data):
    try:
        chunks = _native.scan_chunks(data, "fuzz")
    except SnapshotCorruptError:
        return
    # Scanned: every chunk's header and stored payload lie inside the file.
    for offset, header in chunks:
        stored = header[8]
        assert 0 <= offset and offset + _native.CHUNK_HEADER_SIZE + stored <= len(data)


# ------------------------------------------------------------------ keyed state


def test_keymap_checks_lengths_and_slots():
    m = _native.KeyMap(4)
    slots = np.zeros(3, np.int64)
    m.upsert(i64(10, 20, 10), slots)
    assert slots.tolist() == [0, 1, 0] and len(m) == 2
    with pytest.raises(InvalidArgumentError, match="slots holds 2 values, 3 are needed"):
        m.upsert(i64(1, 2, 3), np.zeros(2, np.int64))
    with pytest.raises(InvalidArgumentError):
        m.lookup(i64(1, 2, 3), np.zeros(2, np.int64))
    with pytest.raises(InvalidArgumentError, match="slot 2 at index 1 is outside 0..1"):
        m.keys_at(i64(0, 2), np.zeros(2, np.int64))
    with pytest.raises(InvalidArgumentError, match="slot -1"):
        m.keys_at(i64(-1), np.zeros(1, np.int64))
    with pytest.raises(InvalidArgumentError):
        _native.KeyMap(-1)
    with pytest.raises(ValueError):
        m.upsert(i32(1, 2), np.zeros(2, np.int64))


def test_keymap_keys_prefix_copies_the_first_slots_keys_and_no_more():
    """keys_prefix: the keys of slots 0..n-1 in slot order, as keys_at of those slots
    gives them; asking more than the map holds is refused before anything is written."""
    rng = np.random.default_rng(3)
    keys = rng.integers(-2**62, 2**62, 5_000)
    m = _native.KeyMap(0)
    slots = np.zeros(len(keys), np.int64)
    m.upsert(keys, slots)
    n = len(m)
    whole, gathered = np.empty(n, np.int64), np.empty(n, np.int64)
    m.keys_prefix(whole)
    m.keys_at(np.arange(n, dtype=np.int64), gathered)
    assert whole.tolist() == gathered.tolist() == list(dict.fromkeys(keys.tolist()))
    some = np.empty(7, np.int64)
    m.keys_prefix(some)
    assert some.tolist() == whole[:7].tolist()
    m.keys_prefix(np.empty(0, np.int64))
    out = np.full(n + 1, -1, np.int64)
    with pytest.raises(InvalidArgumentError, match=f"out holds {n + 1} values, the map {n}"):
        m.keys_prefix(out)
    assert (out == -1).all()


def test_dedupmap_checks_lengths_and_round_trips():
    m = _native.DedupMap(0)
    keep = np.zeros(4, np.uint8)
    assert m.process(i64(1, 2, 1, 1), i64(0, 0, 5, 10), 10, -(2**63), keep) == 3
    assert keep.tolist() == [1, 1, 0, 1] and len(m) == 2 and m.live(1) == 1
    with pytest.raises(InvalidArgumentError, match="times holds 1 values, 2 are needed"):
        m.process(i64(1, 2), i64(0), 10, 0, np.zeros(2, np.uint8))
    with pytest.raises(InvalidArgumentError, match="keep holds 1 values, 2 are needed"):
        m.process(i64(1, 2), i64(0, 0), 10, 0, np.zeros(1, np.uint8))
    with pytest.raises(InvalidArgumentError, match="within must be >= 0"):
        m.process(i64(1), i64(0), -1, 0, np.zeros(1, np.uint8))
    with pytest.raises(ValueError):
        m.process(i32(1), i64(0), 1, 0, np.zeros(1, np.uint8))
    with pytest.raises(InvalidArgumentError, match="passed holds 1 values, 2 are needed"):
        m.insert(i64(1, 2), i64(0))
    keys, passed = np.zeros(2, np.int64), np.zeros(1, np.int64)
    with pytest.raises(InvalidArgumentError, match="passed holds 1 values, 2 are needed"):
        m.export(-(2**63), keys, passed)
    passed = np.zeros(1, np.int64)
    assert m.export(-(2**63), keys[:1], passed) == 1          # capped at the arrays' size
    keys, passed = np.zeros(2, np.int64), np.zeros(2, np.int64)
    assert m.export(-(2**63), keys, passed) == 2
    assert sorted(zip(keys.tolist(), passed.tolist())) == [(1, 10), (2, 0)]
    restored = _native.DedupMap(0)
    restored.insert(keys, passed)
    restored.evict(1)                                          # key 2 (passed 0) is gone
    assert len(restored) == 1 and restored.live(-(2**63)) == 1
    with pytest.raises(InvalidArgumentError):
        _native.DedupMap(-1)


def test_aggregates_refuse_slots_outside_their_arrays():
    counts = np.zeros(2, np.int64)
    sums = np.zeros(2, np.float64)
    _native.agg_count(i64(0, 1, 1), counts)
    _native.agg_sum(i64(0, 1, 1), np.array([1.0, 2.0, 3.0]), sums)
    assert counts.tolist() == [1, 2] and sums.tolist() == [1.0, 5.0]
    with pytest.raises(InvalidArgumentError, match="slot 2 at index 1 is outside 0..1"):
        _native.agg_count(i64(0, 2), counts)
    for kernel in (_native.agg_sum, _native.agg_min, _native.agg_max):
        with pytest.raises(InvalidArgumentError, match="slot 5"):
            kernel(i64(5), np.array([1.0]), sums)
        with pytest.raises(InvalidArgumentError, match="2 values for 1 slots"):
            kernel(i64(0), np.array([1.0, 2.0]), sums)
        with pytest.raises(ValueError):
            kernel(i64(0), np.array([1], np.float32), sums)
    assert counts.tolist() == [1, 2] and sums.tolist() == [1.0, 5.0]  # nothing written
    marks = np.zeros(2, np.uint8)
    out = np.zeros(3, np.int64)
    assert _native.distinct_slots(i64(1, 0, 1), marks, out) == 2 and out[:2].tolist() == [1, 0]
    with pytest.raises(InvalidArgumentError):
        _native.distinct_slots(i64(1, 3), marks, out)
    with pytest.raises(InvalidArgumentError, match="out holds 1 values"):
        _native.distinct_slots(i64(1, 0), marks, np.zeros(1, np.int64))


def test_int64_combines_refuse_bad_slots_and_overflow():
    sums = i64(0, 2**63 - 2)
    _native.agg_sum_i64(i64(0, 1), i64(5, 1), sums)
    assert sums.tolist() == [5, 2**63 - 1]
    with pytest.raises(InvalidArgumentError, match="overflows the int64 sum of slot 1; no sum"):
        _native.agg_sum_i64(i64(0, 1, 0), i64(1, 1, 1), sums)
    assert sums.tolist() == [5, 2**63 - 1]  # the first add was undone
    for kernel in (_native.agg_sum_i64, _native.agg_min_i64, _native.agg_max_i64):
        with pytest.raises(InvalidArgumentError, match="slot 2 at index 0 is outside 0..1"):
            kernel(i64(2), i64(1), sums)
        with pytest.raises(InvalidArgumentError, match="2 values for 1 slots"):
            kernel(i64(0), i64(1, 2), sums)
        with pytest.raises(ValueError):
            kernel(i64(0), np.array([1.0]), sums)
        with pytest.raises(ValueError, match="read-only"):
            kernel(i64(0), i64(1), _readonly(i64(0, 0)))
        with pytest.raises(TypeError):
            kernel(None, i64(1), sums)
    assert sums.tolist() == [5, 2**63 - 1]


def test_first_and_last_kernels_keep_row_order_and_refuse_bad_input():
    firsts, lasts = i64(0, 0, 0), i64(0, 0, 0)
    seen = np.array([0, 0, 1], np.uint8)                 # slot 2 already has its first
    _native.agg_first_i64(i64(1, 0, 1, 2), i64(2**62 + 1, -5, 7, 9), firsts, seen)
    _native.agg_last_i64(i64(1, 0, 1, 2), i64(2**62 + 1, -5, 7, 9), lasts)
    assert firsts.tolist() == [-5, 2**62 + 1, 0] and seen.tolist() == [1, 1, 1]
    assert lasts.tolist() == [-5, 7, 9]
    ffirsts, fseen = np.zeros(2), np.zeros(2, np.uint8)
    _native.agg_first(i64(1, 1), np.array([1.5, 2.5]), ffirsts, fseen)
    flasts = np.zeros(2)
    _native.agg_last(i64(1, 1), np.array([1.5, 2.5]), flasts)
    assert ffirsts.tolist() == [0.0, 1.5] and flasts.tolist() == [0.0, 2.5]
    for kernel, out, vals in ((_native.agg_first_i64, firsts, i64(1)),
                              (_native.agg_first, ffirsts, np.array([1.0]))):
        with pytest.raises(InvalidArgumentError, match="slot 3 at index 0 is outside"):
            kernel(i64(3), vals, out, np.zeros(len(out), np.uint8))
        with pytest.raises(InvalidArgumentError, match="seen holds 1 values"):
            kernel(i64(0), vals, out, np.zeros(1, np.uint8))
        with pytest.raises(InvalidArgumentError, match="2 values for 1 slots"):
            kernel(i64(0), np.concatenate([vals, vals]), out, np.zeros(len(out), np.uint8))
        with pytest.raises(TypeError):
            kernel(i64(0), vals, out, None)
    for kernel, out, vals in ((_native.agg_last_i64, lasts, i64(1)),
                              (_native.agg_last, flasts, np.array([1.0]))):
        with pytest.raises(InvalidArgumentError, match="slot -1 at index 0 is outside"):
            kernel(i64(-1), vals, out)
        with pytest.raises(ValueError, match="read-only"):
            kernel(i64(0), vals, _readonly(out.copy()))
    assert firsts.tolist() == [-5, 2**62 + 1, 0] and lasts.tolist() == [-5, 7, 9]


def test_128_bit_sums_are_exact_and_all_or_nothing():
    sums = np.zeros((2, 2), np.int64)
    _native.agg_sum_i128(i64(0, 0, 0, 1), i64(2**63 - 1, 2**63 - 1, 3, -1), sums)
    as_int = [int(lo) % 2**64 + int(hi) * 2**64 for lo, hi in sums]
    assert as_int == [2 * (2**63 - 1) + 3, -1]
    # (n, 2) values add 128-bit partials; decimal128's layout, so Arrow reads them back
    wide = np.array([[-2, -1]], np.int64)                 # -2
    _native.agg_sum_i128(i64(0), wide, sums)
    read = pa.Array.from_buffers(pa.decimal128(38, 0), 2, [None, pa.py_buffer(sums)])
    assert [int(x) for x in read.to_pylist()] == [2 * (2**63 - 1) + 1, -1]
    limit = 10**38 - 1
    top = np.array([[limit % 2**64 - 2**64 * (limit % 2**64 >= 2**63), limit >> 64]], np.int64)
    before = sums.copy()
    with pytest.raises(InvalidArgumentError, match="index 1 takes the sum of slot 0 past") as e:
        _native.agg_sum_i128(i64(1, 0), np.array([[5, 0], top[0]], np.int64), sums)
    assert e.value.index == 1 and (sums == before).all()     # slot 1's +5 was undone
    with pytest.raises(InvalidArgumentError, match="slot 2 at index 0 is outside 0..1"):
        _native.agg_sum_i128(i64(2), i64(1), sums)
    with pytest.raises(InvalidArgumentError, match="2 values for 1 slots"):
        _native.agg_sum_i128(i64(0), np.zeros((2, 2), np.int64), sums)
    with pytest.raises(InvalidArgumentError, match=r"shape \(n, 3\)"):
        _native.agg_sum_i128(i64(0), np.zeros((1, 3), np.int64), sums)
    with pytest.raises(InvalidArgumentError, match=r"sums of shape \(n, 1\)"):
        _native.agg_sum_i128(i64(0), i64(1), np.zeros((2, 1), np.int64))
    with pytest.raises(ValueError):
        _native.agg_sum_i128(i64(0), np.array([1.0]), sums)
    with pytest.raises(ValueError):
        _native.agg_sum_i128(i64(0), i64(1), np.zeros(4, np.int64))
    with pytest.raises(TypeError):
        _native.agg_sum_i128(i64(0), None, sums)
    assert (sums == before).all()


# ------------------------------------------------------------------ windows


def _key(values, kind=_native.KEY_INT64):
    return (kind, 0, 0, len(values), values, None, ())


def test_group_map_refuses_bad_outputs_and_columns():
    m = _native.GroupMap()
    keys = [_key(i64(5, 6, 5))]
    slots, first = np.zeros(3, np.int64), np.zeros(3, np.int64)
    assert m.upsert(keys, slots, first) == 2 and slots.tolist() == [0, 1, 0]
    with pytest.raises(InvalidArgumentError, match="slots holds 2 values, 3 are needed"):
        m.upsert(keys, np.zeros(2, np.int64), first)
    with pytest.raises(InvalidArgumentError, match="first_rows holds 2 values, 3 are needed"):
        m.upsert(keys, slots, np.zeros(2, np.int64))
    with pytest.raises(InvalidArgumentError, match="slots holds 1 values"):
        m.lookup(keys, np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="dtype mismatch"):
        m.upsert(keys, np.zeros(3, np.int32), first)
    with pytest.raises(ValueError, match="read-only"):
        m.upsert(keys, _readonly(np.zeros(3, np.int64)), first)
    with pytest.raises(ValueError, match="read-only"):
        m.lookup(keys, _readonly(np.zeros(3, np.int64)))
    with pytest.raises(InvalidArgumentError, match="at least one column"):
        m.upsert([], slots, first)
    with pytest.raises(TypeError):
        m.upsert(None, slots, first)
    with pytest.raises(InvalidArgumentError, match="has 2 columns, this map's keys have 1"):
        m.upsert(keys + keys, slots, first)
    with pytest.raises(InvalidArgumentError, match="'k' holds Integer values, this map's keys"):
        m.upsert([_key(i32(1, 2, 3), _native.KEY_INT32)], slots, first, ["k"])
    with pytest.raises(InvalidArgumentError, match="has 2 rows, the first column 3"):
        _native.GroupMap().upsert(keys + [_key(i64(1, 2))], slots, first)
    with pytest.raises(InvalidArgumentError):
        _native.GroupMap(-1)
    with pytest.raises(InvalidArgumentError, match="slot 2 is outside 0..1"):
        m.key_payload(2)
    assert len(m) == 2 and m.key_payload(1) == b"\0" * 7 + b"\x06"


def test_group_map_refuses_malformed_columns_before_adding_any_key():
    m = _native.GroupMap()
    slots, first = np.zeros(3, np.int64), np.zeros(3, np.int64)
    # The third string's offset runs past the data: the first two are not added either.
    bad = (_native.KEY_VAR32, 0, 0, 3, i32(0, 1, 2, 99), b"xy", ())
    with pytest.raises(CorruptDataError, match="column 's': offset .* at index 12") as e:
        m.upsert([bad], slots, first, ["s"], 10)
    assert e.value.index == 12 and len(m) == 0
    with pytest.raises(CorruptDataError):  # 4 values in 24 bytes
        m.upsert([(_native.KEY_INT64, 0, 0, 4, i64(1, 2, 3), None, ())], np.zeros(4, np.int64),
                 np.zeros(4, np.int64))
    with pytest.raises(KeyRangeError, match="'k': value at index 1 does not fit"):
        m.upsert([_key(i64(1, 2**31, 3), _native.KEY_INT64_AS_INT32)], slots, first, ["k"])
    assert len(m) == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(desc=descriptors(), other=descriptors(), out_len=st.integers(0, 45))
def test_random_descriptors_never_crash_the_group_map(desc, other, out_len):
    m = _native.GroupMap()
    for descs in ([desc], [desc, other], [other]):
        # fresh outputs each time: what an earlier, longer upsert wrote is not this one's
        slots, first = np.full(out_len, -7, np.int64), np.full(out_len, -7, np.int64)
        try:
            added = m.upsert(descs, slots, first)
        except REFUSED:
            continue
        # Accepted: every row got a slot of the map, and each new slot a row.
        rows = descs[0][3]
        assert 0 <= rows <= out_len
        assert ((slots[:rows] >= 0) & (slots[:rows] < len(m))).all()
        assert ((first[:added] >= 0) & (first[:added] < rows)).all()
        assert (slots[rows:] == -7).all(), "wrote past the column's rows"
        try:
            m.lookup(descs, slots)
        except REFUSED:
            pass


def test_panes_refuse_bad_sizes_lengths_and_outputs():
    ts = i64(-5, 0, 5)
    panes = np.zeros(3, np.int64)
    _native.assign_panes(ts, 5, 0, panes)
    assert panes.tolist() == [-1, 0, 1]
    for size in (0, -5):
        with pytest.raises(InvalidArgumentError, match=f"pane_size must be > 0, not {size}"):
            _native.assign_panes(ts, size, 0, panes)
    with pytest.raises(InvalidArgumentError, match="panes holds 2 values, 3 are needed"):
        _native.assign_panes(ts, 5, 0, np.zeros(2, np.int64))
    with pytest.raises(InvalidArgumentError, match="late holds 2 values"):
        _native.assign_panes_late(ts, 5, 0, 0, panes, np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        _native.assign_panes(ts, 5, 0, _readonly(np.zeros(3, np.int64)))
    with pytest.raises(ValueError, match="read-only"):
        _native.assign_panes_late(ts, 5, 0, 0, panes, _readonly(np.zeros(3, np.uint8)))
    with pytest.raises(ValueError):
        _native.assign_panes(np.array([1.0, 2.0, 3.0]), 5, 0, panes)
    late = np.zeros(3, bool)  # numpy's bool is a byte: taken as it is
    assert _native.assign_panes_late(ts, 5, 0, 0, panes, late) == 1
    assert late.tolist() == [True, False, False]
    with pytest.raises(TypeError):
        _native.assign_panes(ts, 5, 0, None)
    with pytest.raises(OverflowError):
        _native.assign_panes(ts, 2**63, 0, panes)
    with pytest.raises(InvalidArgumentError, match="pane of timestamp -9223372036854775808 at index 1"):
        _native.assign_panes(i64(0, -(2**63)), 1, 1, np.zeros(2, np.int64))


def test_sessions_refuse_unsorted_rows_and_bad_arrays():
    group, start, end = i64(1, 1, 2), i64(0, 4, 1), i64(5, 6, 2)
    session = np.zeros(3, np.int64)
    assert _native.session_ids(group, start, end, session) == 2
    with pytest.raises(InvalidArgumentError, match=r"index 1 has \(1, 3\) after \(1, 4\)"):
        _native.check_sorted(i64(1, 1), i64(4, 3))
    with pytest.raises(InvalidArgumentError, match=r"not sorted by \(group, start\): index 2"):
        _native.session_ids(i64(1, 1, 0), start, end, session)
    with pytest.raises(InvalidArgumentError, match=r"index 1 ends before it starts \(4, 3\)"):
        _native.session_ids(group, start, i64(5, 3, 2), session)
    with pytest.raises(InvalidArgumentError, match="start holds 2 values, group 3"):
        _native.session_ids(group, i64(0, 4), end, session)
    with pytest.raises(InvalidArgumentError, match="end holds 4 values, group 3"):
        _native.session_ids(group, start, i64(5, 6, 2, 9), session)
    with pytest.raises(InvalidArgumentError, match="session holds 2 values, 3 are needed"):
        _native.session_ids(group, start, end, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="read-only"):
        _native.session_ids(group, start, end, _readonly(np.zeros(3, np.int64)))
    with pytest.raises(ValueError):
        _native.session_ids(i32(1, 1, 2), start, end, session)
    with pytest.raises(InvalidArgumentError, match="start holds 1 values, group 2"):
        _native.check_sorted(i64(1, 2), i64(0))
    assert _native.session_ids(i64(), i64(), i64(), np.zeros(0, np.int64)) == 0


# ------------------------------------------------------------------ the aligner


def test_aligner_refuses_bad_channels_and_config():
    a = _native.BarrierAligner(2)
    for bad in (-1, 2, 2**20):
        with pytest.raises(InvalidArgumentError, match="out of range"):
            a.offer(bad, "x")
    with pytest.raises(OverflowError):
        a.offer(2**40, "x")
    with pytest.raises(InvalidArgumentError):
        _native.BarrierAligner(0)
    with pytest.raises(InvalidArgumentError):
        _native.BarrierAligner(2, mode="sometimes")
    with pytest.raises(InvalidArgumentError, match="timeout"):
        a.put(0, "x", timeout=float("nan"))
    with pytest.raises(InvalidArgumentError, match="snapshot id"):
        a.offer_barrier(0, -5)
    a.close()


def test_blosc2_bindings_refuse_short_buffers_and_never_write_past_them():
    """Run under AddressSanitizer in CI: compression into an ``out`` of exactly the size
    allowed, and every buffer too short refused before c-blosc2 sees it."""
    from sparkjet.snapshot.chunks import _blosc2_compressor

    lib = _blosc2_compressor()
    assert lib is not None
    rng = np.random.default_rng(5)
    for data in (rng.bytes(4_099), np.arange(3_001, dtype=np.int64).tobytes(), b""):
        out = np.empty(len(data) + _native.BLOSC2_MAX_OVERHEAD, np.uint8)  # exact: no slack
        size = lib.compress(data, out)
        back = np.empty(len(data), np.uint8)
        assert lib.decompress_run([out[:size]], back, np.array([len(data)], np.int64)) == -1
        assert back.tobytes() == data
        with pytest.raises(InvalidArgumentError, match="out holds"):
            lib.compress(data, out[:-1])
        assert lib.decompress_run([out[:size - 1]], back, np.array([len(data)], np.int64)) == 0
