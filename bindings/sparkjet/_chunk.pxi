# cython: freethreading_compatible = True
"""Snapshot chunk framing, scanning, scatter and entry lists, bound to Python
(conversion and GIL handling only; the format is in native/include/sparkjet/chunk.h).

Corrupt input raises SnapshotCorruptError naming the chunk offset and the field;
sparkjet.chunks adds the file name.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc

from sparkjet.libsparkjet cimport *

from sparkjet.errors import CorruptDataError, InvalidArgumentError, SnapshotCorruptError

HEADER_SIZE = SJ_CHUNK_HEADER_SIZE
FORMAT_VERSION = SJ_CHUNK_VERSION
CODEC_RAW = SJ_CODEC_RAW
CODEC_LZ4 = SJ_CODEC_LZ4
CODEC_ARROW_LZ4 = SJ_CODEC_ARROW_LZ4
FLAG_BROADCAST = SJ_CHUNK_BROADCAST
FLAG_ENTRIES = SJ_CHUNK_ENTRIES



# In the order of sparkjet.chunks.ChunkHeader's fields.
cdef tuple _as_tuple(const sj_chunk_header *h):
    return (h.codec, h.flags, h.job_id, h.snapshot_id, h.vertex, h.partition,
            h.entry_count, h.uncompressed_size, h.stored_size, h.checksum)


def encode_header(int codec, int flags, uint64_t job_id, int64_t snapshot_id, uint32_t vertex,
                  int32_t partition, uint32_t entry_count, uint32_t uncompressed_size,
                  uint32_t stored_size, uint64_t checksum):
    """The 64 header bytes of a chunk."""
    cdef sj_chunk_header h
    h.codec = codec
    h.flags = flags
    h.job_id = job_id
    h.snapshot_id = snapshot_id
    h.vertex = vertex
    h.partition = partition
    h.entry_count = entry_count
    h.uncompressed_size = uncompressed_size
    h.stored_size = stored_size
    h.checksum = checksum
    out = bytearray(SJ_CHUNK_HEADER_SIZE)
    cdef uint8_t[::1] view = out
    if sj_chunk_header_encode(&h, &view[0]) != SJ_OK:
        raise InvalidArgumentError(
            f"invalid chunk header: codec {codec}, flags {flags}, sizes {uncompressed_size}/{stored_size}")
    return bytes(out)


def scan(const uint8_t[::1] buf, str source=""):
    """(offset, header tuple) of every chunk of a chunk file, each header checked."""
    cdef size_t length = buf.shape[0]
    cdef size_t cap = length // SJ_CHUNK_HEADER_SIZE + 1
    cdef int64_t *offsets = <int64_t *>malloc(cap * sizeof(int64_t))
    cdef sj_chunk_header *headers = <sj_chunk_header *>malloc(cap * sizeof(sj_chunk_header))
    cdef size_t count = 0, err_offset = 0, i
    cdef const char *bad = NULL
    cdef sj_status st
    cdef const uint8_t *p = &buf[0] if length else NULL
    try:
        if offsets == NULL or headers == NULL:
            raise MemoryError()
        with nogil:
            st = sj_chunk_scan(p, length, offsets, headers, cap, &count, &err_offset, &bad)
        if st != SJ_OK:
            field = bad.decode() if bad != NULL else sj_status_message(st).decode()
            raise SnapshotCorruptError(source, err_offset, field)
        return [(offsets[i], _as_tuple(&headers[i])) for i in range(count)]
    finally:
        free(offsets)
        free(headers)


def scatter(uintptr_t partitions, int64_t n, int32_t partition_count, uintptr_t starts,
            uintptr_t perm):
    """Stable counting sort of n rows by partition id into starts (P + 1) and perm (n)."""
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_scatter_by_partition(<const int32_t *>partitions, n, partition_count,
                                     <int64_t *>starts, <int64_t *>perm, &err)
    if st != SJ_OK:
        raise InvalidArgumentError(
            f"partition id at index {err} is outside 0..{partition_count - 1}")


cdef sj_binary _binary(tuple d):
    cdef sj_binary b
    b.offsets = <const int32_t *><uintptr_t>d[0]
    b.offsets_size = d[1]
    b.data = <const uint8_t *><uintptr_t>d[2]
    b.data_size = d[3]
    b.offset = d[4]
    b.length = d[5]
    return b


def entries_sizes(tuple keys, tuple values, uintptr_t sizes):
    """Bytes each row's entry takes; keys and values are binary column tuples
    (offsets address, offsets size, data address, data size, offset, length)."""
    cdef sj_binary k = _binary(keys), v = _binary(values)
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_entries_sizes(&k, &v, <int64_t *>sizes, &err)
    if st != SJ_OK:
        raise CorruptDataError(
            f"entry list input: {sj_status_message(st).decode()} at row {err}", err)


def entries_encode(tuple keys, tuple values, uintptr_t rows, int64_t nrows, uint8_t[::1] out):
    """Encodes rows' entries into out; returns the bytes written."""
    cdef sj_binary k = _binary(keys), v = _binary(values)
    cdef size_t written = 0
    cdef sj_status st
    with nogil:
        st = sj_entries_encode(&k, &v, <const int64_t *>rows, nrows, &out[0], out.shape[0],
                               &written)
    if st != SJ_OK:
        raise CorruptDataError(f"entry list encode: {sj_status_message(st).decode()}")
    return written


def entries_decode(const uint8_t[::1] payload, uint32_t count, str source="", int64_t offset=0):
    """(key offsets, key data, value offsets, value data) as bytearrays for Arrow
    binary arrays, from an entry list of `count` entries that must fill the payload."""
    cdef int64_t kb = 0, vb = 0
    cdef size_t err = 0
    cdef size_t length = payload.shape[0]
    cdef const uint8_t *p = &payload[0] if length else NULL
    cdef sj_status st
    with nogil:
        st = sj_entries_measure(p, length, count, &kb, &vb, &err)
    if st != SJ_OK:
        raise SnapshotCorruptError(source, offset, f"entry list (at payload byte {err})")
    key_offsets = bytearray(4 * (count + 1))
    value_offsets = bytearray(4 * (count + 1))
    key_data = bytearray(kb + 1)
    value_data = bytearray(vb + 1)
    cdef uint8_t[::1] ko = key_offsets, vo = value_offsets, kd = key_data, vd = value_data
    with nogil:
        st = sj_entries_decode(p, length, count, 0, <int32_t *>&ko[0], &kd[0],
                               0, <int32_t *>&vo[0], &vd[0])
    if st != SJ_OK:
        raise SnapshotCorruptError(source, offset, "entry list")
    return key_offsets, key_data, value_offsets, value_data


def scatter_fixed(uintptr_t src, int64_t width, int64_t n, uintptr_t partitions, uintptr_t starts,
                  int32_t partition_count, uintptr_t dst):
    """Moves n fixed-width values into partition order (after scatter())."""
    cdef sj_status st
    with nogil:
        st = sj_scatter_fixed(<const uint8_t *>src, width, n, <const int32_t *>partitions,
                              <const int64_t *>starts, partition_count, <uint8_t *>dst)
    if st != SJ_OK:
        raise InvalidArgumentError(f"scatter_fixed: {sj_status_message(st).decode()}")
