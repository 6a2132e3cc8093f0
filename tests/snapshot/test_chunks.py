"""Snapshot chunks: round trips, golden files that must keep decoding byte for byte, and a
reader that turns any damage into SnapshotCorruptError (fuzzed with hypothesis)."""
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparkjet
from sparkjet import _native as native
from sparkjet.errors import InvalidArgumentError, SnapshotCorruptError
from sparkjet.snapshot.chunks import ChunkEncoder, decode_entries, decode_table, read_chunks

GOLDEN = Path(__file__).resolve().parents[1] / "golden"

import sys  # noqa: E402

sys.path.insert(0, str(GOLDEN))
import make_golden  # noqa: E402


def decode_file(data: bytes, source="f"):
    tables, broadcast, entries = [], [], []
    headers = []
    for offset, header, payload in read_chunks(data, source):
        headers.append(header)
        if header.entries:
            k, v = decode_entries(header, payload, source, offset)
            entries += list(zip(k.to_pylist(), v.to_pylist(), [header.partition] * len(k)))
        else:
            t = decode_table(header, payload, source, offset)
            (broadcast if header.broadcast else tables).append(t)
    return headers, tables, broadcast, entries


@pytest.mark.parametrize("codec", ["raw", "lz4", "blosc2-lz4"])
def test_golden_tables_decode(codec):
    headers, tables, broadcast, _ = decode_file((GOLDEN / f"table-{codec}.v1.chunks").read_bytes())
    want = make_golden.golden_table()
    got = pa.concat_tables(tables)
    assert got.sort_by("key").equals(want.sort_by("key"))
    assert pa.concat_tables(broadcast).equals(want.slice(0, 3))
    parts = sparkjet.partition_ids(want["key"], 5).to_pylist()
    for h, t in zip([h for h in headers if not h.broadcast], tables):
        assert (h.job_id, h.snapshot_id, h.vertex) == (make_golden.JOB, make_golden.SNAPSHOT, make_golden.VERTEX)
        assert set(sparkjet.partition_ids(t["key"], 5).to_pylist()) == {h.partition}
        assert h.entry_count == t.num_rows
    assert sorted(h.partition for h in headers if not h.broadcast) == sorted(
        p for p in range(5) for _ in range(sum(1 for h in headers if h.partition == p)))
    assert {h.partition for h in headers if not h.broadcast} == set(parts)
    assert [h.partition for h in headers if h.broadcast] == [-1]
    assert len(headers) > 5, "chunk_size=300 must split partitions into several chunks"


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_golden_entries_decode(codec):
    data = (GOLDEN / f"entries-{codec}.v1.chunks").read_bytes()
    headers, _, _, entries = decode_file(data)
    keys, values = make_golden.golden_entries()
    keyed = sorted((k, v) for k, v, p in entries if p >= 0)
    assert keyed == sorted(zip(keys, values))
    assert sorted((k, v) for k, v, p in entries if p == -1) == sorted(zip(keys[:2], values[:2]))
    want_parts = dict(zip(keys, sparkjet.partition_ids(pa.array(keys, pa.binary()), 5).to_pylist()))
    assert all(want_parts[k] == p for k, v, p in entries if p >= 0)


def test_golden_entries_raw_reencode_byte_for_byte():
    # The entry format is entirely sparkjet's own: today's encoder must write the same bytes.
    keys, values = make_golden.golden_entries()
    enc = ChunkEncoder(make_golden.JOB, make_golden.SNAPSHOT, make_golden.VERTEX,
                       partition_count=5, chunk_size=300, codec="raw")
    chunks = enc.entries(keys, values) + enc.broadcast_entries(keys[:2], values[:2])
    assert b"".join(c.to_bytes() for c in chunks) == (GOLDEN / "entries-raw.v1.chunks").read_bytes()


def test_header_layout_is_fixed():
    data = (GOLDEN / "entries-raw.v1.chunks").read_bytes()
    assert data[:4] == b"SJCK"
    assert int.from_bytes(data[4:6], "little") == 1
    assert int.from_bytes(data[8:16], "little") == make_golden.JOB
    assert int.from_bytes(data[16:24], "little") == make_golden.SNAPSHOT
    assert int.from_bytes(data[24:28], "little") == make_golden.VERTEX


def test_round_trip_with_many_types_and_chunk_sizes():
    rng = np.random.default_rng(3)
    n = 5000
    table = pa.table({
        "k": pa.array([f"user-{i % 997}" for i in range(n)]),
        "k2": pa.array(rng.integers(0, 5, n), pa.int32()),
        "v": pa.array(rng.random(n)),
        "maybe": pa.array([None if i % 3 else i for i in range(n)], pa.int64()),
        "flag": pa.array(rng.integers(0, 2, n).astype(bool)),
        "tags": pa.array([[i % 4] * (i % 3) for i in range(n)], pa.list_(pa.int16())),
    })
    for chunk_size in (1, 500, 128 * 1024):
        for codec in ("raw", "lz4", "blosc2-lz4"):
            enc = ChunkEncoder(1, 2, 3, partition_count=271, chunk_size=chunk_size, codec=codec)
            chunks = enc.table(table, key=["k", "k2"])
            if chunk_size == 1:
                assert len(chunks) == n, "every row over the limit gets a chunk of its own"
            data = b"".join(c.to_bytes() for c in chunks)
            _, tables, _, _ = decode_file(data)
            got = pa.concat_tables(tables)
            # Rows of one partition keep their order; compare as multisets.
            order = ["k", "k2", "v"]
            assert got.sort_by([(c, "ascending") for c in order]).equals(
                table.sort_by([(c, "ascending") for c in order]))
            pids = sparkjet.partition_ids(got, 271, key=["k", "k2"])
            bounds = [c.header.entry_count for c in chunks]
            ids = np.repeat([c.header.partition for c in chunks], bounds)
            assert pids.to_numpy().tolist() == ids.tolist()


def test_oversized_entry_gets_its_own_chunk():
    keys = [b"small", b"big", b"tiny"]
    values = [b"x", b"y" * 10_000, b"z"]
    chunks = ChunkEncoder(1, 1, 1, partition_count=1, chunk_size=100, codec="lz4").entries(keys, values)
    assert [c.header.entry_count for c in chunks] == [1, 1, 1]
    _, _, _, entries = decode_file(b"".join(c.to_bytes() for c in chunks))
    assert [(k, v) for k, v, _ in entries] == list(zip(keys, values))


def test_encoder_rejects_bad_config_and_input():
    with pytest.raises(InvalidArgumentError, match="codec"):
        ChunkEncoder(1, 1, 1, codec="zstd")
    with pytest.raises(InvalidArgumentError, match="chunk_size"):
        ChunkEncoder(1, 1, 1, chunk_size=0)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        ChunkEncoder(-1, 1, 1)
    enc = ChunkEncoder(1, 1, 1)
    with pytest.raises(InvalidArgumentError, match="2 keys but 1 values"):
        enc.entries([b"a", b"b"], [b"x"])
    with pytest.raises(InvalidArgumentError, match="null"):
        enc.entries([b"a", None], [b"x", b"y"])
    with pytest.raises(sparkjet.NullKeyError):
        enc.table(pa.table({"k": [1, None]}), key="k")
    assert repr(enc).startswith("ChunkEncoder(job_id=1")


def test_decode_refuses_mismatched_kind_and_count():
    t = pa.table({"k": [1, 2, 3]})
    chunk = ChunkEncoder(1, 1, 1, partition_count=1).table(t, key="k")[0]
    (_, header, payload), = read_chunks(chunk.to_bytes())
    with pytest.raises(SnapshotCorruptError, match="flags"):
        decode_entries(header, payload)
    entry = ChunkEncoder(1, 1, 1, partition_count=1).entries([b"a"], [b"b"])[0]
    (_, eh, ep), = read_chunks(entry.to_bytes())
    with pytest.raises(SnapshotCorruptError, match="flags"):
        decode_table(eh, ep)


def _boundaries(data: bytes) -> set[int]:
    return {o for o, _, _ in read_chunks(data)} | {len(data)}


def test_every_truncation_and_bit_flip_is_detected():
    # A cut at a chunk boundary leaves a valid, shorter chunk file: the validation record's
    # per-file size and chunk count catch those (tests/snapshot/test_snapshot_store.py).
    data = (GOLDEN / "entries-lz4.v1.chunks").read_bytes()
    boundaries = _boundaries(data)
    assert len(boundaries) > 3
    for n in range(len(data)):
        if n in boundaries:
            assert len(read_chunks(data[:n])) == sorted(boundaries).index(n)
        else:
            with pytest.raises(SnapshotCorruptError):
                read_chunks(data[:n])
    for i in range(0, len(data) * 8, 3):
        bad = bytearray(data)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(SnapshotCorruptError) as e:
            decode_file(bytes(bad), "golden.chunks")
        assert "golden.chunks" in str(e.value) and "offset" in str(e.value)


def _mutations():
    files = sorted(GOLDEN.glob("*.chunks"))
    return st.tuples(
        st.sampled_from(files),
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
        st.one_of(st.none(), st.integers(0, 10**6)),
        st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.binary(max_size=70))),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations())
def test_fuzzed_chunks_raise_only_clean_errors(mutation):
    path, edits, cut, insert = mutation
    data = bytearray(path.read_bytes())
    for pos, value in edits:
        data[pos % len(data)] = value
    if insert is not None:
        pos, blob = insert
        data[pos % len(data):pos % len(data)] = blob
    if cut is not None:
        del data[cut % (len(data) + 1):]
    original = path.read_bytes()
    try:
        decoded = decode_file(bytes(data), path.name)
    except SnapshotCorruptError as e:
        assert path.name in str(e)
        return
    # Only an unchanged file, or one cut at a chunk boundary, may decode.
    assert bytes(data) == original[: len(data)] and len(data) in _boundaries(original) | {0}, (
        "damage went undetected")
    assert len(decoded[0]) == sorted(_boundaries(original) | {0}).index(len(data))


def test_scatter_rejects_out_of_range_ids():
    ids = np.array([0, 1, 5], np.int32)
    starts = np.empty(4, np.int64)
    perm = np.empty(3, np.int64)
    with pytest.raises(InvalidArgumentError, match="index 2"):
        native.scatter(ids, 3, starts, perm)


def test_partition_order_is_stable_and_matches_take():
    from sparkjet._batches import group_rows

    rng = np.random.default_rng(5)
    n = 20_000
    table = pa.table({"k": rng.integers(0, 10**9, n), "v": rng.random(n).astype(np.float32),
                      "s": pa.array([str(i) for i in range(n)]), "b": rng.integers(0, 2, n).astype(bool),
                      "n": pa.array([None if i % 5 == 0 else i for i in range(n)], pa.int16())})
    pids = sparkjet.partition_ids(table["k"], 271)
    ordered, starts = group_rows(table, pids.to_numpy(), 271)
    perm = np.argsort(pids.to_numpy(), kind="stable")
    assert pa.Table.from_batches([ordered]).equals(table.take(perm))
    counts = np.bincount(pids.to_numpy(), minlength=271)
    assert starts.tolist() == [0, *np.cumsum(counts).tolist()]
    assert pc.all(pc.equal(sparkjet.partition_ids(ordered["k"], 271), pa.array(np.sort(pids.to_numpy())))).as_py()


def test_payload_with_out_of_bounds_offsets_and_a_recomputed_checksum_is_refused():
    # A writer other than sparkjet can produce a chunk whose checksums all match and whose
    # Arrow offsets point past their buffer: it must never come back as a table (a sort of
    # it read out of bounds).
    import struct

    import xxhash

    chunk = ChunkEncoder(1, 0, 1, codec="raw").broadcast_table(
        pa.table({"s": ["a", "bb", "ccc", "dddd"] * 4}))[0]
    payload = bytearray(b"".join(bytes(p) for p in chunk.pieces))
    at = bytes(payload).find(np.array([0, 1, 3, 6, 10], np.int32).tobytes())
    struct.pack_into("<i", payload, at + 8, 100_000)
    h = chunk.header
    header = native.encode_chunk_header(h.codec, h.flags, h.job_id, h.snapshot_id, h.vertex,
                                        h.partition, h.entry_count, h.uncompressed_size,
                                        h.stored_size, xxhash.xxh3_64_intdigest(bytes(payload)))
    (offset, header, stored), = read_chunks(bytes(header) + bytes(payload), "hostile.chunks")
    with pytest.raises(SnapshotCorruptError, match="hostile.chunks.*Arrow data.*out of bounds"):
        decode_table(header, stored, "hostile.chunks", offset)


@pytest.mark.parametrize("codec", ["raw", "lz4", "blosc2-lz4"])
def test_dictionary_columns_round_trip(codec):
    # batch.serialize() leaves dictionaries out: raw chunks of such a table used to be
    # written, committed, and then impossible to read.
    names = pa.array(["a", "bb", "a", "ccc"] * 25).dictionary_encode()
    tags = pa.array([["x", "y"][: i % 3] for i in range(100)],
                    pa.list_(pa.dictionary(pa.int8(), pa.string())))
    table = pa.table({"k": np.arange(100), "name": names, "tags": tags})
    enc = ChunkEncoder(1, 2, 3, partition_count=7, chunk_size=300, codec=codec)
    chunks = enc.table(table, key="k") + enc.broadcast_table(table)
    _, tables, broadcast, _ = decode_file(b"".join(c.to_bytes() for c in chunks))
    assert pa.concat_tables(tables).sort_by("k").to_pylist() == table.to_pylist()
    assert pa.concat_tables(broadcast).to_pylist() == table.to_pylist()


def _blosc2_run(rows=3000):
    """One partition's rows in several Blosc2 chunks (one run of one schema)."""
    table = pa.table({"key": pa.array(np.arange(rows) * 7, pa.int64()),
                      "v": pa.array(np.arange(rows) * 0.5)})
    chunks = ChunkEncoder(1, 2, 3, partition_count=1, chunk_size=4096).table(table, "key")
    assert len(chunks) > 3 and all(c.header.codec == native.CODEC_BLOSC2_LZ4 for c in chunks)
    return table, chunks


def test_chunks_decoded_together_are_the_chunks_decoded_one_by_one():
    from sparkjet.snapshot.chunks import TableDecoder

    table, chunks = _blosc2_run()
    stored = read_chunks(b"".join(c.to_bytes() for c in chunks))
    together = TableDecoder()
    for _, header, payload in stored:
        together.add(header, payload)
    tables = together.tables()
    assert len(tables) == 1 and tables[0].equals(table)
    one = TableDecoder()
    assert pa.concat_tables([one.decode(h, p) for _, h, p in stored]).equals(table)
    assert together.tables() == []          # what was queued is decoded once


def test_a_run_names_the_chunk_whose_entry_count_is_wrong():
    _, chunks = _blosc2_run()
    bad = chunks[2]
    h = bad.header
    header = native.encode_chunk_header(h.codec, h.flags, h.job_id, h.snapshot_id, h.vertex,
                                        h.partition, h.entry_count + 1, h.uncompressed_size,
                                        h.stored_size, h.checksum)
    data = b"".join(c.to_bytes() if c is not bad else bytes(header) + c.to_bytes()[64:]
                    for c in chunks)
    error = _run_error(data)
    assert error.field == "entry count"
    assert error.offset == sum(c.nbytes for c in chunks[:2])


def _run_error(data: bytes) -> SnapshotCorruptError:
    """The error decoding the chunk file ``data`` as one run raises."""
    from sparkjet.snapshot.chunks import TableDecoder

    decoder = TableDecoder()
    for offset, header, payload in read_chunks(data, "f"):
        decoder.add(header, payload, "f", offset)
    with pytest.raises(SnapshotCorruptError) as e:
        decoder.tables()
    return e.value


def test_a_corrupt_chunk_error_crosses_processes_whole():
    """A member's restore that finds a damaged chunk fails its execution; the error goes to
    the supervisor or the driver pickled, and arrives with its detail (what the check
    found), not only the file, offset and field."""
    import pickle

    error = SnapshotCorruptError("snaps/0-0.chunks", 4096, "Blosc2 chunk",
                                 "it says 110640 bytes in 54659")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) == ("snaps/0-0.chunks: corrupt snapshot data at offset "
                                       "4096: bad Blosc2 chunk (it says 110640 bytes in 54659)")
    assert (copy.path, copy.offset, copy.field, copy.detail) == \
        ("snaps/0-0.chunks", 4096, "Blosc2 chunk", "it says 110640 bytes in 54659")


# -- Blosc2 decompression in the native module ----------------------------------------------

def _packed(n: int = 3):
    from sparkjet.snapshot.chunks import _blosc2

    data = [np.arange(i * 1_000, i * 1_000 + 5_000 + 17 * i, dtype=np.int64).tobytes()
            for i in range(n)]
    return data, [bytes(_blosc2(pa.py_buffer(d))) for d in data]


def test_the_blosc2_wheels_library_is_found_and_used():
    """The restore decompresses a run of chunks in one native call without the GIL when the
    blosc2 wheel ships its C library: with the blosc2 this project installs it does (if
    this fails, restores still work, on blosc2's Python API, but slower)."""
    from sparkjet.snapshot.chunks import _blosc2_native

    lib = _blosc2_native()
    assert lib is not None, "no usable libblosc2 beside the blosc2 package"
    assert lib.version.split(".")[0] in ("2", "3")
    data, packed = _packed()
    out = bytearray(sum(map(len, data)))
    assert lib.decompress_run(packed, out, np.array([len(d) for d in data], np.int64)) == -1
    assert bytes(out) == b"".join(data)
    assert lib.decompress_run([], bytearray(0), np.zeros(0, np.int64)) == -1


def test_native_blosc2_refuses_what_does_not_fit_and_names_the_chunk():
    from sparkjet.snapshot.chunks import _blosc2_native

    lib = _blosc2_native()
    data, packed = _packed()
    sizes = np.array([len(d) for d in data], np.int64)
    out = bytearray(int(sizes.sum()))
    wrong = sizes.copy()
    wrong[1] += 8                                      # chunk 1 says another size
    assert lib.decompress_run(packed, bytearray(int(wrong.sum())), wrong) == 1
    assert lib.decompress_run([packed[0], packed[1][:-5], packed[2]], out, sizes) == 1
    assert lib.decompress_run([packed[0], packed[1] + b"\0", packed[2]], out, sizes) == 1
    assert lib.decompress_run([packed[0], packed[1][:20]], out, sizes[:2]) == 1   # < a header
    with pytest.raises(InvalidArgumentError, match="out holds"):
        lib.decompress_run(packed, bytearray(10), sizes)
    with pytest.raises(InvalidArgumentError, match="sizes"):
        lib.decompress_run(packed, out, sizes[:2])
    with pytest.raises(InvalidArgumentError, match="sizes\\[0\\]"):
        lib.decompress_run(packed[:1], out, np.array([-1], np.int64))
    with pytest.raises(TypeError):
        lib.decompress_run([packed[0], 7], out, sizes[:2])
    with pytest.raises(TypeError):
        lib.decompress_run(packed, bytes(len(out)), sizes)       # read-only out


def test_native_blosc2_compresses_as_blosc2s_python_api_does():
    """A snapshot's chunks are compressed by one native call without the GIL, and give the
    bytes blosc2's Python API gives (a rebuilt chunk's checksum must match the stored one,
    whichever compressed it)."""
    from sparkjet.snapshot.chunks import _BLOSC2_CLEVEL, _blosc2, _blosc2_compressor, _blosc2_python

    lib = _blosc2_compressor()
    assert lib is not None, "libblosc2's compression is not used for snapshots"
    rng = np.random.default_rng(3)
    for data in (b"", b"abc", rng.bytes(131_071), np.arange(50_000, dtype=np.int64).tobytes(),
                 np.linspace(0, 1, 30_001).tobytes()):
        out = bytearray(len(data) + native.BLOSC2_MAX_OVERHEAD)
        size = lib.compress(data, out, _BLOSC2_CLEVEL)
        assert bytes(out[:size]) == _blosc2_python(data)
        assert _blosc2(pa.py_buffer(data)).to_pybytes() == _blosc2_python(data)
        back = bytearray(len(data))
        assert lib.decompress_run([bytes(out[:size])], back,
                                  np.array([len(data)], np.int64)) == -1
        assert bytes(back) == data


def test_compressed_chunks_hold_their_compressed_size():
    """A chunk compressed natively keeps a buffer of its compressed size (not its message's):
    a broadcast table's chunks are all held at once in a list."""
    table = pa.table({"k": np.arange(2_000_000), "v": np.arange(2_000_000) * 1.0})
    before = pa.total_allocated_bytes()
    chunks = ChunkEncoder(1, 1, 1).broadcast_table(table)
    held = pa.total_allocated_bytes() - before
    stored = sum(c.header.stored_size for c in chunks)
    assert len(chunks) > 100 and held < 2 * stored, (held, stored)
    for c in chunks:
        assert sum(len(memoryview(p)) for p in c.pieces) == c.header.stored_size


def test_native_blosc2_compression_refuses_bad_buffers():
    from sparkjet.snapshot.chunks import _blosc2_compressor

    lib = _blosc2_compressor()
    data = np.arange(1_000, dtype=np.int64).tobytes()
    with pytest.raises(InvalidArgumentError, match="out holds 8031 bytes, 8032"):
        lib.compress(data, bytearray(len(data) + native.BLOSC2_MAX_OVERHEAD - 1))
    with pytest.raises(TypeError, match="out must be a writable"):
        lib.compress(data, bytes(len(data) + 64))
    with pytest.raises(TypeError, match="source must be"):
        lib.compress(7, bytearray(64))
    with pytest.raises(InvalidArgumentError, match="clevel 10"):
        lib.compress(data, bytearray(len(data) + 64), clevel=10)
    with pytest.raises(InvalidArgumentError, match="typesize 0"):
        lib.compress(data, bytearray(len(data) + 64), typesize=0)


def test_native_blosc2_compresses_a_run_as_it_compresses_each_chunk():
    """compress_run (a file's chunks in one call) gives each chunk the bytes compress and
    blosc2's Python API give it, back to back, and says how long each is."""
    from sparkjet.snapshot.chunks import _BLOSC2_CLEVEL, _blosc2_compressor, _blosc2_python

    lib = _blosc2_compressor()
    rng = np.random.default_rng(5)
    sources = [b"", b"abc", rng.bytes(131_071), np.arange(50_000, dtype=np.int64).tobytes(),
               pa.py_buffer(np.linspace(0, 1, 30_001).tobytes()), b"",
               np.repeat(np.arange(100, dtype=np.int64), 700).tobytes()]
    room = sum(len(memoryview(s)) for s in sources) + len(sources) * native.BLOSC2_MAX_OVERHEAD
    out = bytearray(room + 16)
    out[room:] = b"\xee" * 16
    sizes = np.full(len(sources), -1, np.int64)
    written = lib.compress_run(sources, out, sizes, _BLOSC2_CLEVEL)
    assert written == int(sizes.sum())
    at = 0
    for source, size in zip(sources, sizes.tolist()):
        assert bytes(out[at:at + size]) == _blosc2_python(bytes(memoryview(source)))
        at += size
    assert out[room:] == b"\xee" * 16
    assert lib.compress_run([], bytearray(0), np.empty(0, np.int64)) == 0


def test_native_blosc2_run_compression_refuses_bad_buffers_before_writing():
    from sparkjet.snapshot.chunks import _blosc2_compressor

    lib = _blosc2_compressor()
    data = [np.arange(1_000, dtype=np.int64).tobytes(), b"xyz"]
    need = 8_003 + 2 * native.BLOSC2_MAX_OVERHEAD
    sizes = np.zeros(2, np.int64)
    short = bytearray(need - 1)
    with pytest.raises(InvalidArgumentError, match=f"out holds {need - 1} bytes, {need}"):
        lib.compress_run(data, short, sizes)
    assert short == bytearray(need - 1)         # nothing compressed into it
    with pytest.raises(InvalidArgumentError, match="sizes holds 1 values, 2"):
        lib.compress_run(data, bytearray(need), sizes[:1])
    with pytest.raises(TypeError):
        lib.compress_run([data[0], 7], bytearray(need), sizes)
    with pytest.raises(TypeError, match="out must be a writable"):
        lib.compress_run(data, bytes(need), sizes)
    with pytest.raises(InvalidArgumentError, match="clevel 10"):
        lib.compress_run(data, bytearray(need), sizes, clevel=10)
    with pytest.raises(InvalidArgumentError, match="typesize 256"):
        lib.compress_run(data, bytearray(need), sizes, typesize=256)


def test_a_files_chunks_compressed_in_runs_are_each_chunks_own_bytes(monkeypatch):
    """The encoder compresses a file's chunks a run of messages at a time; each chunk is,
    byte for byte, what encoding its rows alone gives (encode_payload, the Merkle
    resync's rebuild), whatever the run's bounds (here a few chunks per run)."""
    import sparkjet.snapshot.chunks as chunks

    monkeypatch.setattr(chunks, "_RUN_BYTES", 50_000)
    n = 60_000
    rng = np.random.default_rng(11)
    table = pa.table({"k": rng.permutation(n).astype(np.int64), "c": np.ones(n, np.int64),
                      "v": rng.random(n)})
    encoded = ChunkEncoder(3, 4, 5, partition_count=7, chunk_size=16_384).table(table, key="k")
    assert len(encoded) > 4 * 7     # several chunks per partition, several runs
    for c in encoded:
        assert c.header.codec == native.CODEC_BLOSC2_LZ4
        rows = decode_table(c.header, c.to_bytes()[chunks.HEADER_SIZE:])
        rebuilt = chunks.encode_payload(c.header, rows)
        assert [bytes(memoryview(p)) for p in rebuilt] == [bytes(memoryview(p)) for p in c.pieces]
    back = pa.concat_tables(decode_table(c.header, c.to_bytes()[chunks.HEADER_SIZE:])
                            for c in encoded).sort_by("k")
    assert back.equals(table.sort_by("k"))


def test_native_blosc2_survives_fuzzed_chunks():
    """Bytes flipped anywhere in a Blosc2 chunk: the call returns (a refusal, or bytes the
    chunk's checksum would refuse), it never crashes or writes past its share."""
    import random

    from sparkjet.snapshot.chunks import _blosc2_native

    lib = _blosc2_native()
    data, packed = _packed(1)
    size = len(data[0])
    rng = random.Random(5)
    refused = 0
    for _ in range(3_000):
        chunk = bytearray(packed[0])
        for _ in range(rng.randint(1, 4)):
            chunk[rng.randrange(len(chunk))] = rng.randrange(256)
        out = bytearray(size + 64)
        refused += lib.decompress_run([bytes(chunk)], memoryview(out)[:size],
                                      np.array([size], np.int64)) == 0
        assert out[size:] == bytes(64)                  # nothing past its share
    assert refused > 0


def test_a_run_names_the_chunk_whose_blosc2_bytes_are_wrong():
    """A Blosc2 chunk that decompresses to other sizes (its checksum recomputed, as a
    writer other than sparkjet might): the run's native call refuses it, and the chunk
    by chunk path names it."""
    import xxhash

    _, chunks = _blosc2_run()
    bad = chunks[2]
    schema, packed = bad.pieces
    broken = bytearray(bytes(packed))
    broken[4:8] = (int.from_bytes(broken[4:8], "little") + 8).to_bytes(4, "little")  # nbytes
    payload = bytes(schema) + bytes(broken)
    h = bad.header
    header = native.encode_chunk_header(h.codec, h.flags, h.job_id, h.snapshot_id, h.vertex,
                                        h.partition, h.entry_count, h.uncompressed_size,
                                        len(payload), xxhash.xxh3_64_intdigest(payload))
    data = b"".join(c.to_bytes() if c is not bad else bytes(header) + payload for c in chunks)
    error = _run_error(data)
    assert error.field == "Blosc2 chunk"
    assert error.offset == sum(c.nbytes for c in chunks[:2])


def test_a_run_decodes_alike_without_the_native_library(monkeypatch):
    """A blosc2 wheel without its C library: the run decompresses through blosc2's Python
    API, to the same table, and still names a chunk at fault."""
    import sparkjet.snapshot.chunks as chunks_module
    from sparkjet.snapshot.chunks import TableDecoder

    monkeypatch.setattr(chunks_module, "_blosc2_native", lambda: None)
    table, chunks = _blosc2_run()
    decoder = TableDecoder()
    for _, header, payload in read_chunks(b"".join(c.to_bytes() for c in chunks)):
        decoder.add(header, payload)
    assert decoder.tables()[0].equals(table)
    test_a_run_names_the_chunk_whose_blosc2_bytes_are_wrong()


def test_a_chunk_an_older_sparkjet_compressed_is_rebuilt_byte_for_byte():
    """The golden Blosc2 file was compressed at level 1 (today's chunks: 9). A chunk does
    not record its level, so the Merkle resync's rebuild from the rows tries today's level
    and then the older one: every one of the file's table chunks is matched, none falls
    back to a whole copy (before, each mismatched and was copied)."""
    import base64
    from types import SimpleNamespace

    from sparkjet.runtime import resync
    from sparkjet.snapshot.chunks import HEADER_SIZE, decode_table, read_chunks

    data = (GOLDEN / "table-blosc2-lz4.v1.chunks").read_bytes()
    stored = [(o, h, p) for o, h, p in read_chunks(data) if not h.broadcast]
    keyed, headers, parts = [], [], {}
    for offset, h, payload in stored:
        keyed.append(SimpleNamespace(offset=offset, partition=h.partition,
                                     entry_count=h.entry_count, stored_size=h.stored_size,
                                     checksum=h.checksum))
        headers.append((base64.b64encode(data[offset:offset + HEADER_SIZE]).decode(),
                        h.codec, h.flags))
        parts.setdefault(h.partition, []).append(decode_table(h, payload))
    rebuilt = {p: pa.concat_tables(t) for p, t in parts.items()}
    levels = []
    real = resync.encode_payload

    def recorded(header, data, clevel=None):
        levels.append(clevel)
        return real(header, data, clevel)

    resync.encode_payload = recorded
    try:
        built, mismatched = resync._encode(keyed, headers, rebuilt, False, "agg/0-0.chunks",
                                           "golden")
    finally:
        resync.encode_payload = real
    assert not mismatched
    # today's level is tried once; the rest of the file's chunks go straight to level 1
    assert levels == [9, 1] + [1] * (len(stored) - 1)
    assert {o: bytes(c) for o, c in built.items()} == {
        o: data[o:o + HEADER_SIZE + h.stored_size] for o, h, _ in stored}


@pytest.mark.parametrize("chunk_size", [1 << 10, 40 << 10, 128 << 10])
def test_a_fixed_width_table_is_cut_by_its_row_size_as_by_each_parts_bytes(chunk_size,
                                                                           monkeypatch):
    """iter_table cuts a table of fixed-width columns by one row size for all its parts
    (asking each sliced part its nbytes cost microseconds a part): the chunks are the ones
    each part's own nbytes gives, byte for byte; a table with a column of variable width
    or nulls has no one row size."""
    from sparkjet.snapshot import chunks as chunks_module

    rng = np.random.default_rng(chunk_size)
    n = 40_000
    table = pa.table({"key": rng.permutation(n * 2)[:n].astype(np.int64),
                      "count": rng.integers(0, 9, n).astype(np.int32),
                      "sum": rng.random(n)})
    enc = ChunkEncoder(7, 1, 3, chunk_size=chunk_size)
    fast = [c.to_bytes() for c in enc.iter_table(table, "key")]
    with monkeypatch.context() as m:
        m.setattr(chunks_module, "_row_bytes", lambda batch: None)
        slow = [c.to_bytes() for c in enc.iter_table(table, "key")]
    assert fast == slow and len(fast) > (271 if chunk_size < 40 << 10 else 0)
    assert chunks_module._row_bytes(pa.record_batch({"s": ["a", "bb"]})) is None
    assert chunks_module._row_bytes(pa.record_batch({"n": [1, None]})) is None
    assert chunks_module._row_bytes(pa.record_batch({"n": pa.array([1, 2], pa.int16())})) == 2
