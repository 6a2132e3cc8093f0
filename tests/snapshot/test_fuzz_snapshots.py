"""Hostile bytes in every file a restore reads: chunk files (headers, Arrow IPC payloads,
entry lists), log events, validation records and export records. Random, mutated, and
mutated with every checksum recomputed (so the damage reaches the decoders behind the
checksums), each must give a SparkjetError or data that is whole: never another
exception, never an Arrow array that fails full validation."""
import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sparkjet import _native
from sparkjet.errors import SparkjetError
from sparkjet.hash import murmur3_bytes
from sparkjet.snapshot.chunks import (
    HEADER_SIZE,
    ChunkEncoder,
    TableDecoder,
    decode_entries,
    decode_table,
    read_chunks,
)
from sparkjet.snapshot.store import SnapshotStore

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
HEADER_SEED = 0x53434B31  # native/include/sparkjet/chunk.h
FUZZ = settings(max_examples=250, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def assert_whole(value) -> None:
    """Every Arrow array in what a decoder returned passes full validation."""
    if isinstance(value, (pa.Array, pa.ChunkedArray, pa.Table, pa.RecordBatch)):
        value.validate(full=True)
    elif isinstance(value, (tuple, list)):
        for v in value:
            assert_whole(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            assert_whole(getattr(value, name))


def decode_file(data: bytes):
    out = []
    for offset, header, payload in read_chunks(data, "fuzz.chunks"):
        if header.entries:
            out.append(decode_entries(header, payload, "fuzz.chunks", offset))
        else:
            out.append(decode_table(header, payload, "fuzz.chunks", offset))
    return out


def decode_file_together(data: bytes):
    """decode_file as a restore decodes: the table chunks queued, then decoded at once."""
    out, decoder = [], TableDecoder()
    for offset, header, payload in read_chunks(data, "fuzz.chunks"):
        if header.entries:
            out.append(decode_entries(header, payload, "fuzz.chunks", offset))
        else:
            decoder.add(header, payload, "fuzz.chunks", offset)
    return out + decoder.tables()


#: What a decoder may do with hostile input: refuse it with a SparkjetError, or return
#: data whose every Arrow array passes full validation.
CLEAN = ("refused", "whole")


def outcome(fn, *args) -> str:
    """What ``fn(*args)`` did with hostile input: "refused", "whole", or what went wrong
    (another exception escaped, or an invalid array was returned)."""
    try:
        result = fn(*args)
    except SparkjetError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - what the assertion reports
        return f"escaped {type(e).__name__}: {e}"
    try:
        assert_whole(result)
    except pa.ArrowException as e:
        return f"returned an invalid array: {e}"
    return "whole"


def test_the_check_tells_a_clean_decoder_from_a_broken_one():
    """``outcome`` can fail a fuzz test: an escaping error and an invalid array are not clean."""
    def escapes():
        raise KeyError("vertices")

    def refuses():
        raise SparkjetError("bad")

    # offsets in bounds, bytes not UTF-8: only full validation sees it
    bad = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, 2], np.int32)),
                                                 pa.py_buffer(b"\xff\xfe")])
    assert outcome(refuses) == "refused"
    assert outcome(lambda: pa.table({"x": [1]})) == "whole"
    assert outcome(escapes) == "escaped KeyError: 'vertices'"
    assert outcome(lambda: [bad]).startswith("returned an invalid array")


def rechecksum(data: bytearray) -> bytearray:
    """Recomputes every chunk's payload xxh3 and header murmur3 in place, walking the
    (possibly damaged) stored sizes, so that only the checks behind them can fail."""
    offset = 0
    while offset + HEADER_SIZE <= len(data):
        stored = struct.unpack_from("<I", data, offset + 40)[0]
        payload = bytes(data[offset + HEADER_SIZE: offset + HEADER_SIZE + stored])
        struct.pack_into("<Q", data, offset + 48, xxhash.xxh3_64_intdigest(payload))
        header = bytes(data[offset: offset + 56])
        struct.pack_into("<I", data, offset + 56, murmur3_bytes(header, HEADER_SEED) & 0xFFFFFFFF)
        offset += HEADER_SIZE + stored
    return data


def sample_chunk_files() -> list[bytes]:
    """The golden files and chunks of types the goldens lack (strings, lists, nulls,
    dictionaries), raw and lz4."""
    files = [p.read_bytes() for p in sorted(GOLDEN.glob("*.chunks"))]
    table = pa.table({
        "k": pa.array(np.arange(40)),
        "s": pa.array([f"s{i}" * (i % 4) for i in range(40)]),
        "l": pa.array([[i] * (i % 3) for i in range(40)], pa.list_(pa.int16())),
        "n": pa.array([None if i % 5 else i for i in range(40)], pa.float64()),
        "d": pa.array(["a", "bb", "ccc", "a"] * 10).dictionary_encode(),
    })
    for codec in ("raw", "lz4", "blosc2-lz4"):
        enc = ChunkEncoder(1, 2, 3, partition_count=3, chunk_size=400, codec=codec)
        chunks = enc.table(table, key="k") + enc.entries([b"k1", b"k22"], [b"", b"v" * 9])
        files.append(b"".join(c.to_bytes() for c in chunks))
    return files


SAMPLES = sample_chunk_files()


def byte_mutations():
    return st.tuples(
        st.sampled_from(range(len(SAMPLES))),
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
        st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.binary(max_size=16))),
        st.one_of(st.none(), st.integers(0, 10**6)),
    )


def mutate(mutation) -> bytearray:
    index, edits, insert, cut = mutation
    data = bytearray(SAMPLES[index])
    for pos, value in edits:
        data[pos % len(data)] = value
    if insert is not None:
        pos, blob = insert
        data[pos % len(data): pos % len(data)] = blob
    if cut is not None:
        del data[cut % (len(data) + 1):]
    return data


# -- chunk files -------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes(data):
    assert outcome(decode_file, data) in CLEAN


@FUZZ
@given(st.integers(0, 3), st.integers(0, 3), st.integers(0, 600), st.binary(max_size=300))
def test_random_payloads_behind_valid_headers(codec, flags, count, payload):
    """A header that passes every check, over a payload of random bytes: the Arrow IPC
    reader, Blosc2 and the entry-list decoder see garbage directly."""
    assume(not (codec == _native.CODEC_BLOSC2_LZ4 and flags & _native.FLAG_ENTRIES))
    header = _native.encode_chunk_header(codec, flags, 1, 2, 3, -1 if flags & 1 else 0, count,
                                         len(payload), len(payload),
                                         xxhash.xxh3_64_intdigest(payload))
    assert outcome(decode_file, bytes(header) + payload) in CLEAN


@FUZZ
@given(byte_mutations())
def test_mutated_chunk_files(mutation):
    assert outcome(decode_file, bytes(mutate(mutation))) in CLEAN


@settings(FUZZ, max_examples=600)
@given(byte_mutations())
def test_mutated_chunk_files_with_checksums_recomputed(mutation):
    data = bytes(rechecksum(mutate(mutation)))
    assert outcome(decode_file, data) in CLEAN
    assert outcome(decode_file_together, data) in CLEAN


BLOSC2_CHUNK = ChunkEncoder(1, 2, 3, partition_count=1, chunk_size=1 << 20).table(
    pa.table({"k": np.arange(300), "v": np.arange(300) * 0.5,
              "s": [f"s{i}" for i in range(300)]}), key="k")[0]


@settings(FUZZ, max_examples=1500)
@given(st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 2**31), st.integers(-64, 64))
def test_damaged_blosc2_chunks_behind_valid_checksums(flips, cut, size_delta):
    """Blosc2's own headers and lz4 blocks damaged (bytes changed, the chunk cut short, the
    header's uncompressed size off) with every checksum recomputed: refused, never a crash
    or a read past the payload."""
    c = BLOSC2_CHUNK
    assert c.header.codec == _native.CODEC_BLOSC2_LZ4
    schema, packed = c.pieces
    packed = bytearray(packed)
    for where, value in flips:
        packed[where % len(packed)] = value
    del packed[len(packed) - cut % 32:]
    payload = bytes(schema) + bytes(packed)
    size = max(0, c.header.uncompressed_size + size_delta)
    header = _native.encode_chunk_header(c.header.codec, 0, 1, 2, 3, 0, c.header.entry_count,
                                         size, len(payload), xxhash.xxh3_64_intdigest(payload))
    data = bytes(header) + payload
    assert outcome(decode_file, data) in CLEAN
    # twice, as a restore queues a file's chunks: the damaged one's run with a sound one
    assert outcome(decode_file_together, c.to_bytes() + data) in CLEAN


def test_rechecksum_reaches_the_decoders():
    """The recomputation is right: an undamaged file keeps its bytes, and a damaged
    payload passes read_chunks and is caught (or not) by the decoders alone."""
    for data in SAMPLES:
        assert bytes(rechecksum(bytearray(data))) == data
    data = bytearray(SAMPLES[-1])
    data[HEADER_SIZE + 10] ^= 0xFF
    assert len(list(read_chunks(bytes(rechecksum(data))))) >= 1


# -- the store's metadata ------------------------------------------------------------------


def json_values():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1]),
                        st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=8), st.sampled_from(["..", ".", "a/b", "agg", "", "/"]))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
        max_leaves=8)


def mutate_json(value, rng: random.Random, replacement):
    """``value`` with one node, chosen by ``rng``, replaced, removed or given a sibling."""
    nodes = []

    def walk(node, parent, key):
        nodes.append((parent, key))
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, node, k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, node, i)

    root = [value]
    walk(value, root, 0)
    parent, key = rng.choice(nodes)
    action = rng.randrange(3)
    if action == 0 or parent is root:
        parent[key] = replacement
    elif action == 1:
        del parent[key]
    elif isinstance(parent, dict):
        parent[rng.choice(["x", "type", "vertices", "files", "chunks", "bytes"])] = replacement
    else:
        parent.insert(key, replacement)
    return root[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    store = SnapshotStore(root, job_id=7, durable=False)
    store.register_execution(1)
    w = store.writer(0, 1, partition_count=5, chunk_size=200)
    w.write_table("agg", pa.table({"key": np.arange(30), "s": [f"v{i}" for i in range(30)]}),
                  key="key")
    w.write_entries("py", [b"a", b"bb"], [b"1", b"22"])
    w.write_broadcast_table("agg", pa.table({"watermark": [5]}))
    w.commit()
    store.export(None, "kept")
    store.close()
    return root


@pytest.fixture
def scratch(pristine, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(pristine, root)
    job = root / "job-0000000000000007"
    files = {
        "log": sorted((job / "log").glob("*.json"))[-1],
        "record": next((job / "snapshots").glob("*/_validation-*.json")),
        "export": job / "exports" / "kept" / "_export.json",
    }
    return {"root": root, **files, "originals": {k: p.read_bytes() for k, p in files.items()}}


def restore_files(scratch) -> None:
    for name, data in scratch["originals"].items():
        scratch[name].write_bytes(data)


def every_read(root) -> list[str]:
    """The outcome of everything that reads the metadata, each on a fresh store (no cached
    record)."""
    reads = (lambda s: s.latest_complete(), lambda s: s.current_execution(),
             lambda s: s.snapshots(), lambda s: s.describe(), lambda s: s.verify(),
             lambda s: s.restore("agg"), lambda s: s.restore("py", [0, 1]),
             lambda s: s.restore("agg", name="kept"), lambda s: s.describe(name="kept"))
    return [outcome(read, SnapshotStore(root, job_id=7)) for read in reads]


def write_record(scratch, record_bytes: bytes) -> None:
    """Replaces the validation record and recomputes the checksum the commit names."""
    scratch["record"].write_bytes(record_bytes)
    event = json.loads(scratch["log"].read_text())
    event["record_xxh3"] = xxhash.xxh3_64_hexdigest(record_bytes)
    scratch["log"].write_text(json.dumps(event))


FILES = ("log", "record", "export")


@settings(FUZZ, max_examples=150)
@given(st.sampled_from(FILES), st.integers(0, 2**32), json_values(), st.booleans())
def test_structurally_mutated_metadata(scratch, which, seed, replacement, rechecked):
    path, original = scratch[which], scratch["originals"][which]
    try:
        data = json.dumps(mutate_json(json.loads(original), random.Random(seed),
                                      replacement)).encode()
        if which == "record" and rechecked:
            write_record(scratch, data)
        else:
            path.write_bytes(data)
        outcomes = every_read(scratch["root"])
        assert all(o in CLEAN for o in outcomes), outcomes
    finally:
        restore_files(scratch)


@settings(FUZZ, max_examples=150)
@given(st.sampled_from(FILES), byte_mutations(), st.booleans())
def test_byte_mutated_metadata(scratch, which, mutation, rechecked):
    path, original = scratch[which], scratch["originals"][which]
    _, edits, insert, cut = mutation
    data = bytearray(original)
    for pos, value in edits:
        data[pos % len(data)] = value
    if insert is not None:
        data[insert[0] % len(data): insert[0] % len(data)] = insert[1]
    if cut is not None:
        del data[cut % (len(data) + 1):]
    try:
        if which == "record" and rechecked:
            write_record(scratch, bytes(data))
        else:
            path.write_bytes(bytes(data))
        outcomes = every_read(scratch["root"])
        assert all(o in CLEAN for o in outcomes), outcomes
    finally:
        restore_files(scratch)


@FUZZ
@given(st.binary(max_size=200), st.sampled_from(FILES))
def test_random_metadata(scratch, data, which):
    try:
        scratch[which].write_bytes(data)
        outcomes = every_read(scratch["root"])
        assert all(o in CLEAN for o in outcomes), outcomes
    finally:
        restore_files(scratch)
