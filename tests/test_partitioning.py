"""partition_ids / murmur3_32: Hazelcast's vectors, the Hazelcast Python client as an
oracle, every Arrow layout, the portable and the AVX2 kernels, and bad input."""
import struct

import numpy as np
import pyarrow as pa
import pytest
from helpers import reference as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparkjet
from sparkjet import _native as native
from sparkjet.errors import (
    CorruptDataError,
    InvalidArgumentError,
    KeyRangeError,
    NullKeyError,
    UnsupportedTypeError,
)

# HAZELCAST.md §1: (Arrow array of one key, hash, partition for 271).
VECTORS = [
    (pa.array([0], pa.int32()), 0x37077D1E, 11),
    (pa.array([1], pa.int32()), 0x2DD58A5A, 31),
    (pa.array([-1], pa.int32()), 0xD47AA21B, 164),
    (pa.array([42], pa.int32()), 0x7BC270A3, 175),
    (pa.array([2**31 - 1], pa.int32()), 0xDEB6EC0D, 129),
    (pa.array([0], pa.int64()), 0xD191A721, 109),
    (pa.array([2**40], pa.int64()), 0xC5F31640, 122),
    (pa.array([""]), 0x37077D1E, 11),
    (pa.array(["a"]), 0x7D29931B, 73),
    (pa.array(["hello"]), 0x76547ED5, 270),
    (pa.array(["ключ"]), 0x7810E6F1, 265),
    (pa.array(["日本"]), 0x76E6442F, 220),
    (pa.array([b"\x00\x01"]), 0x19A05A28, 179),
]


def signed(h):
    return h - (1 << 32) if h & 0x80000000 else h


@pytest.mark.parametrize("arr,hash_,part", VECTORS, ids=lambda v: str(v)[:20])
def test_hazelcast_vectors(arr, hash_, part):
    assert sparkjet.murmur3_32(arr).to_pylist() == [signed(hash_)]
    assert sparkjet.partition_ids(arr).to_pylist() == [part]
    assert sparkjet.partition_ids(arr, 271).type == pa.int32()


def test_murmur_self_check():
    assert native.murmur3_bytes(b"hello", 0) == 0x248BFA47
    assert native.murmur3_bytes(b"", 0) == ref.murmur3_32(b"", 0)


def test_min_int_hash_follows_java_not_the_python_client():
    key = ref.integer_with_hash(-(2**31))
    arr = pa.array([key], pa.int32())
    assert sparkjet.murmur3_32(arr).to_pylist() == [-(2**31)]
    assert sparkjet.partition_ids(arr).to_pylist() == [0]
    assert sparkjet.partition_ids(arr, 7).to_pylist() == [0]
    # Same key through every kernel and as int64 with key_type="integer".
    assert sparkjet.partition_ids(pa.array([key] * 40, pa.int64()), key_type="integer").to_pylist() == [0] * 40


def _client(int_type=None):
    from hazelcast.config import Config, IntType
    from hazelcast.serialization.service import SerializationServiceV1

    config = Config()
    if int_type == "long":
        config.default_int_type = IntType.LONG
    return SerializationServiceV1(config)


@pytest.fixture(scope="module")
def hz_int():
    return _client()


@pytest.fixture(scope="module")
def hz_long():
    return _client("long")


def client_partition(svc, key):
    return ref.partition_of_hash(svc.to_data(key).get_partition_hash())


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40))
def test_ints_match_hazelcast_client(hz_int, values):
    expected = [svc_hash for svc_hash in (hz_int.to_data(v).get_partition_hash() for v in values)]
    assert sparkjet.murmur3_32(pa.array(values, pa.int32())).to_pylist() == expected
    want = [ref.partition_of_hash(h) for h in expected]
    assert sparkjet.partition_ids(pa.array(values, pa.int32())).to_pylist() == want
    # The client's default maps Python int to Integer: so does key_type="integer".
    assert sparkjet.partition_ids(values, key_type="integer").to_pylist() == want


@FAST
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40))
def test_longs_match_hazelcast_client(hz_long, values):
    expected = [hz_long.to_data(v).get_partition_hash() for v in values]
    assert sparkjet.murmur3_32(pa.array(values, pa.int64())).to_pylist() == expected
    assert sparkjet.partition_ids(values).to_pylist() == [ref.partition_of_hash(h) for h in expected]


utf8_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.sampled_from("aZ09 é߷ह€日本ключ😀𝄞"), max_size=30),
    st.text(alphabet=st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF), max_size=8),
)


@FAST
@given(st.lists(utf8_text, max_size=40))
def test_strings_match_hazelcast_client(hz_int, values):
    expected = [hz_int.to_data(v).get_partition_hash() for v in values]
    for t in (pa.string(), pa.large_string(), pa.string_view()):
        assert sparkjet.murmur3_32(pa.array(values, t)).to_pylist() == expected, t
    assert sparkjet.partition_ids(values).to_pylist() == [ref.partition_of_hash(h) for h in expected]


@FAST
@given(st.lists(st.binary(max_size=40), max_size=30))
def test_bytes_match_hazelcast_client_bytearray(hz_int, values):
    # The client serializes bytearray as byte[] (bytes would be pickled).
    expected = [hz_int.to_data(bytearray(v)).get_partition_hash() for v in values]
    for t in (pa.binary(), pa.large_binary(), pa.binary_view()):
        assert sparkjet.murmur3_32(pa.array(values, t)).to_pylist() == expected, t


def test_string_edge_lengths_match_reference():
    # Every tail length, keys at the very end of the data buffer, and long keys.
    values = ["x" * n for n in range(70)] + ["", "ab", "abc"] + ["é" * 7, "😀"]
    want = [ref.partition("".join(v), "string") for v in values]
    assert sparkjet.partition_ids(pa.array(values)).to_pylist() == want
    for start in range(0, len(values), 7):
        sliced = pa.array(values).slice(start, 9)
        assert sparkjet.partition_ids(sliced).to_pylist() == want[start : start + 9]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.binary(max_size=45), min_size=0, max_size=120),
    st.integers(0, 10),
    st.integers(1, 5000),
    st.sampled_from([ref.SEED, 0, 0xFFFFFFFF]),
)
def test_every_kernel_agrees_with_reference(values, cut, partition_count, seed):
    arr = pa.array(values, pa.binary()).slice(min(cut, len(values)))
    vals = values[min(cut, len(values)) :]
    want_hash = [ref.murmur3_32(ref.payload(v, "bytes"), seed) for v in vals]
    want_part = [ref.partition(v, "bytes", partition_count) for v in vals]
    ints = np.frombuffer(b"".join(v.ljust(8, b"\0")[:8] for v in vals) or b"", dtype=np.int64)
    try:
        for kernel in native.available_kernels():
            native.select_kernel(kernel)
            assert sparkjet.murmur3_32(arr, seed).to_pylist() == want_hash
            assert sparkjet.partition_ids(arr, partition_count).to_pylist() == want_part
            assert sparkjet.partition_ids(ints, partition_count).to_pylist() == [
                ref.partition(int(v), "long", partition_count) for v in ints
            ]
    finally:
        native.select_kernel(None)


def test_kernels_are_reported_and_selectable():
    kernels = native.available_kernels()
    assert kernels[-1] == "generic" and native.kernel_name() == kernels[0]
    native.select_kernel("generic")
    try:
        assert native.kernel_name() == "generic"
    finally:
        native.select_kernel(None)
    with pytest.raises(ValueError, match="not available"):
        native.select_kernel("sse9")


@pytest.fixture(params=["avx512", "avx2", "generic"])
def kernel(request):
    if request.param not in native.available_kernels():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    native.select_kernel(request.param)
    yield request.param
    native.select_kernel(None)


def test_long_strings_through_each_kernel(kernel):
    rng = np.random.default_rng(7)
    words = ["".join(chr(c) for c in rng.integers(32, 0x3000, size=n)) for n in rng.integers(0, 90, 300)]
    assert sparkjet.partition_ids(pa.array(words)).to_pylist() == [ref.partition(w, "string") for w in words]


@pytest.mark.parametrize("partition_count", [1, 2, 7, 271, 1000, 65537, 2**31 - 1])
def test_reduction_matches_java_rule(partition_count):
    rng = np.random.default_rng(partition_count)
    hashes = rng.integers(-(2**31), 2**31, size=20000, dtype=np.int64).astype(np.int32)
    hashes[:4] = [-(2**31), 2**31 - 1, -(2**31) + 1, 0]
    out = np.empty_like(hashes)
    native.partitions_from_hashes(hashes, partition_count, out)
    assert out.tolist() == [ref.partition_of_hash(int(h), partition_count) for h in hashes]


def test_integer_widths_map_to_integer_and_long():
    small = [0, 1, 42, 100, 127]
    want_int = [ref.partition(v, "integer") for v in small]
    want_long = [ref.partition(v, "long") for v in small]
    for t in (pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16()):
        assert sparkjet.partition_ids(pa.array(small, t)).to_pylist() == want_int, t
        assert sparkjet.partition_ids(pa.array(small, t), key_type="long").to_pylist() == want_long, t
    for t in (pa.int64(), pa.uint32(), pa.uint64()):
        assert sparkjet.partition_ids(pa.array(small, t)).to_pylist() == want_long, t
        assert sparkjet.partition_ids(pa.array(small, t), key_type="integer").to_pylist() == want_int, t
    big = [2**32 - 1, 2**63 - 1]
    assert sparkjet.partition_ids(pa.array(big, pa.uint64())).to_pylist() == [
        ref.partition(v, "long") for v in big
    ]


def test_uint64_beyond_long_is_rejected_with_index():
    with pytest.raises(KeyRangeError, match=r"18446744073709551615 at index 2") as e:
        sparkjet.partition_ids(pa.array([1, 2, 2**64 - 1], pa.uint64()))
    assert e.value.index == 2


def test_key_type_integer_rejects_values_outside_int32():
    values = [1] * 100 + [2**31] + [3]
    with pytest.raises(KeyRangeError, match=r"2147483648 at index 100") as e:
        sparkjet.partition_ids(pa.chunked_array([values[:60], values[60:]], pa.int64()), key_type="integer")
    assert e.value.index == 100
    with pytest.raises(KeyRangeError):
        sparkjet.partition_ids(pa.array([2**40], pa.int64()), key_type="integer")


def test_layouts_agree():
    words = ["", "a", "hello", "ключ", "日本", "😀x", "a" * 13, "b" * 40] * 5
    want = [ref.partition(w, "string") for w in words]
    arrays = [
        pa.array(words),
        pa.array(words, pa.large_string()),
        pa.array(words, pa.string_view()),
        pa.array(words).dictionary_encode(),
        pa.chunked_array([words[:3], words[3:17], [], words[17:]]),
        pa.array([w.encode() for w in words], pa.binary()),
        pa.array([w.encode() for w in words], pa.large_binary()),
        pa.array([w.encode() for w in words], pa.binary_view()),
        np.array(words, dtype=object),
        words,
    ]
    for arr in arrays:
        assert sparkjet.partition_ids(arr).to_pylist() == want, type(arr)
    sliced = pa.array(words, pa.string_view()).slice(5, 20)
    assert sparkjet.partition_ids(sliced).to_pylist() == want[5:25]


def test_fixed_size_binary_is_byte_array():
    values = [b"\x00\x01", b"ab", b"\xff\xfe"]
    arr = pa.array(values, pa.binary(2))
    assert sparkjet.partition_ids(arr).to_pylist() == [ref.partition(v, "bytes") for v in values]
    assert sparkjet.partition_ids(arr).to_pylist()[0] == 179
    assert sparkjet.partition_ids(pa.array([b""] * 3, pa.binary(0))).to_pylist() == [11] * 3


def test_numpy_and_capsule_inputs():
    values = np.arange(-50, 50, dtype=np.int64)
    want = [ref.partition(int(v), "long") for v in values]
    assert sparkjet.partition_ids(values).to_pylist() == want

    class CArray:
        def __init__(self, arr):
            self.arr = arr

        def __arrow_c_array__(self, requested_schema=None):
            return self.arr.__arrow_c_array__(requested_schema)

    class CStream:
        def __init__(self, arr):
            self.arr = arr

        def __arrow_c_stream__(self, requested_schema=None):
            return self.arr.__arrow_c_stream__(requested_schema)

    assert sparkjet.partition_ids(CArray(pa.array(values))).to_pylist() == want
    chunked = pa.chunked_array([values[:30], values[30:]])
    assert sparkjet.partition_ids(CStream(chunked)).to_pylist() == want


def test_chunked_and_sliced_int_arrays():
    values = np.arange(1000, dtype=np.int64) * 7919 - 3000
    want = [ref.partition(int(v), "long", 1000) for v in values]
    chunked = pa.chunked_array([values[:1], values[1:500], values[500:]])
    assert sparkjet.partition_ids(chunked, 1000).to_pylist() == want
    assert sparkjet.partition_ids(pa.array(values).slice(333, 100), 1000).to_pylist() == want[333:433]
    assert sparkjet.partition_ids(pa.array([], pa.int64())).to_pylist() == []
    assert sparkjet.partition_ids(pa.chunked_array([], pa.string())).to_pylist() == []


def _composite_ref(row, types):
    return ref.partition_of_hash(ref.murmur3_32(b"".join(ref.payload(v, t) for v, t in zip(row, types))))


def test_composite_keys():
    batch = pa.record_batch(
        {
            "a": pa.array([1, -2, 3, 2**40, 0], pa.int64()),
            "b": pa.array(["x", "", "ключ", "hello world!", "日本"]),
            "c": pa.array([7, 8, 9, 10, 11], pa.int32()),
            "d": pa.array([b"", b"\x00", b"ab", b"abc", b"abcd"], pa.binary()),
        }
    )
    rows = batch.to_pylist()
    want = [_composite_ref((r["a"], r["b"], r["c"], r["d"]), ("long", "string", "integer", "bytes")) for r in rows]
    assert sparkjet.partition_ids(batch, key=["a", "b", "c", "d"]).to_pylist() == want
    # A table whose columns are chunked differently gives the same answer.
    table = pa.table({"a": pa.chunked_array([batch["a"][:2], batch["a"][2:]]),
                      "b": pa.chunked_array([batch["b"][:3], batch["b"][3:]]),
                      "c": batch["c"], "d": batch["d"]})
    assert sparkjet.partition_ids(table, key=["a", "b", "c", "d"]).to_pylist() == want
    # One key column is that column's Hazelcast partition.
    assert sparkjet.partition_ids(batch, key="b") == sparkjet.partition_ids(batch["b"])
    assert sparkjet.partition_ids(table, key=["a"]) == sparkjet.partition_ids(batch["a"])
    with_int = [_composite_ref((r["a"], r["c"]), ("integer", "integer")) for r in rows[:3]]
    assert sparkjet.partition_ids(batch.slice(0, 3), key=["a", "c"], key_type="integer").to_pylist() == with_int
    hashes = sparkjet.murmur3_32(batch, key=["b", "c"]).to_pylist()
    assert hashes == [ref.murmur3_32(ref.payload(r["b"], "string") + ref.payload(r["c"], "integer")) for r in rows]


def test_composite_errors_name_the_column():
    batch = pa.record_batch({"a": pa.array([1, None], pa.int64()), "b": pa.array(["x", "y"])})
    with pytest.raises(NullKeyError, match=r"'a'.*index 1"):
        sparkjet.partition_ids(batch, key=["b", "a"])
    with pytest.raises(InvalidArgumentError, match=r"no key column 'z'; columns are a, b"):
        sparkjet.partition_ids(batch, key=["a", "z"])
    with pytest.raises(InvalidArgumentError, match="needs key="):
        sparkjet.partition_ids(batch)
    with pytest.raises(InvalidArgumentError, match="selects columns"):
        sparkjet.partition_ids(pa.array([1]), key="a")
    with pytest.raises(KeyRangeError):
        sparkjet.partition_ids(pa.record_batch({"a": [2**40], "b": ["x"]}), key=["a", "b"], key_type="integer")


def test_null_key_names_first_index():
    with pytest.raises(NullKeyError, match="index 3") as e:
        sparkjet.partition_ids(pa.chunked_array([[1, 2], [3, None, None]]))
    assert e.value.index == 3
    with pytest.raises(NullKeyError, match="index 0"):
        sparkjet.partition_ids(pa.array([None, "a"]))
    with pytest.raises(NullKeyError):
        sparkjet.partition_ids(pa.array([None], pa.null()))


@pytest.mark.parametrize("arr", [pa.array([1.5]), pa.array([True]), pa.array([[1]]), pa.array([{"x": 1}])])
def test_unsupported_types_raise_type_error_naming_the_type(arr):
    with pytest.raises(UnsupportedTypeError, match=str(arr.type).split("<")[0]) as e:
        sparkjet.partition_ids(arr)
    assert isinstance(e.value, TypeError)


def test_unreadable_input_is_a_type_error():
    with pytest.raises(TypeError):
        sparkjet.partition_ids([1, "a"])
    with pytest.raises(TypeError):
        sparkjet.partition_ids(object())


@pytest.mark.parametrize("count", [0, -1, 2**31, True, 1.5, "271"])
def test_bad_partition_count(count):
    with pytest.raises(ValueError, match="partition_count"):
        sparkjet.partition_ids([1], count)


def test_bad_key_type_and_seed():
    with pytest.raises(ValueError, match="key_type"):
        sparkjet.partition_ids([1], key_type="short")
    with pytest.raises(ValueError, match="key_type='integer' applies to integer keys"):
        sparkjet.partition_ids(["a"], key_type="integer")
    with pytest.raises(ValueError, match="seed"):
        sparkjet.murmur3_32([1], seed=-1)


def _native_partitions(kind, values: np.ndarray, data: bytes = b"", length=None, variadic=()):
    """Calls the binding on hand-made buffers: pyarrow refuses to build most malformed
    arrays, but the C data interface and unvalidated IPC can still hand them over."""
    data_buf = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(1, np.uint8)
    n = len(values) - 1 if length is None else length
    out = np.zeros(max(n, 1), np.int32)
    desc = (kind, 0, 0, n, values, data_buf[: len(data)], tuple(variadic))
    native.column_partitions(desc, 271, out)
    return out[:n].tolist()


@pytest.mark.parametrize(
    "offsets,index",
    [([0, 3, 100], 1), ([0, -4, 2], 0), ([0, 4, 2], 1), ([-8, 0, 2], 0), ([0, 1, 2**31 - 1], 1)],
)
def test_malformed_offsets_raise_instead_of_reading_out_of_bounds(offsets, index, kernel):
    for kind, dtype in ((native.KEY_VAR32, np.int32), (native.KEY_VAR64, np.int64)):
        with pytest.raises(CorruptDataError, match=f"index {index}") as e:
            _native_partitions(kind, np.array(offsets, dtype), b"abcdef")
        assert e.value.index == index
    # 99 good keys before and 40 after, so the vectorized path (blocks of 32 keys)
    # meets the bad one; keys after it may be bad too, the first is reported.
    good = list(range(0, 198, 2))
    if offsets[0] == 0 and offsets[-1] < 2**31 - 400:
        tail = [198 + offsets[-1] + 2 * k for k in range(1, 41)]
        bad = np.array(good + [198 + o for o in offsets] + tail, np.int32)
        with pytest.raises(CorruptDataError, match=f"index {len(good) + index}"):
            _native_partitions(native.KEY_VAR32, bad, b"x" * 198 + b"abcdef")
    # The same buffers, well formed, hash fine.
    assert _native_partitions(native.KEY_VAR32, np.array(good, np.int32), b"x" * 200) == [
        ref.partition("xx", "string")] * (len(good) - 1)


def test_short_key_at_the_end_of_data_is_read_safely():
    # 40 keys where the last ones are shorter than 4 bytes and end the buffer.
    words = ["abcdefgh"] * 38 + ["ab", "c"]
    offsets = np.cumsum([0] + [len(w) for w in words]).astype(np.int32)
    assert _native_partitions(native.KEY_VAR32, offsets, "".join(words).encode()) == [
        ref.partition(w, "string") for w in words]


def test_malformed_views_raise():
    view = np.frombuffer(struct.pack("<i4sii", 20, b"abcd", 3, 0), np.uint8).copy()  # buffer 3 of none
    with pytest.raises(CorruptDataError, match="index 0"):
        _native_partitions(native.KEY_VIEW, view, length=1)
    data = np.frombuffer(b"x" * 10, np.uint8).copy()
    view = np.frombuffer(struct.pack("<i4sii", 20, b"xxxx", 0, 0), np.uint8).copy()  # 20 bytes of 10
    with pytest.raises(CorruptDataError, match="index 0"):
        _native_partitions(native.KEY_VIEW, view, length=1, variadic=(data,))
    view = np.frombuffer(struct.pack("<i4sii", -1, b"xxxx", 0, 0), np.uint8).copy()
    with pytest.raises(CorruptDataError):
        _native_partitions(native.KEY_VIEW, view, length=1, variadic=(data,))


def test_short_buffers_are_rejected():
    values = np.zeros(2, np.int64)
    with pytest.raises(CorruptDataError):
        _native_partitions(native.KEY_INT64, values, length=10)
    with pytest.raises(CorruptDataError):  # n strings need n + 1 offsets
        _native_partitions(native.KEY_VAR32, np.zeros(3, np.int32), length=3)


def test_partitioner_is_plain_reusable_config():
    p = sparkjet.Partitioner(1000, key=["a", "b"])
    assert repr(p) == "Partitioner(1000, key=['a', 'b'])"
    assert sparkjet.Partitioner(**p.config) == p
    batch = pa.record_batch({"a": [1, 2], "b": ["x", "y"]})
    assert p(batch) == sparkjet.partition_ids(batch, 1000, key=["a", "b"])
    assert p.partition_count == 1000
    with pytest.raises(ValueError):
        sparkjet.Partitioner(0)


def test_gil_is_released_and_results_are_thread_safe():
    from concurrent.futures import ThreadPoolExecutor

    values = pa.array(np.arange(200_000, dtype=np.int64))
    want = sparkjet.partition_ids(values)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: sparkjet.partition_ids(values), range(8)))
    assert all(r == want for r in results)
