# Snapshot chunk framing, scanning, scatter and entry lists
# (native/include/sparkjet/chunk.h). Corrupt stored bytes raise SnapshotCorruptError naming
# the chunk offset and the field; sparkjet.chunks adds the file name.
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

CHUNK_HEADER_SIZE = SJ_CHUNK_HEADER_SIZE
CHUNK_FORMAT_VERSION = SJ_CHUNK_VERSION
CODEC_RAW = SJ_CODEC_RAW
CODEC_LZ4 = SJ_CODEC_LZ4
CODEC_ARROW_LZ4 = SJ_CODEC_ARROW_LZ4
CODEC_BLOSC2_LZ4 = SJ_CODEC_BLOSC2_LZ4
FLAG_BROADCAST = SJ_CHUNK_BROADCAST
FLAG_ENTRIES = SJ_CHUNK_ENTRIES


# In the order of sparkjet.chunks.ChunkHeader's fields.
cdef tuple _as_tuple(const sj_chunk_header *h):
    return (h.codec, h.flags, h.job_id, h.snapshot_id, h.vertex, h.partition,
            h.entry_count, h.uncompressed_size, h.stored_size, h.checksum)


def encode_chunk_header(int codec, int flags, uint64_t job_id, int64_t snapshot_id,
                        uint32_t vertex, int32_t partition, uint32_t entry_count,
                        uint32_t uncompressed_size, uint32_t stored_size, uint64_t checksum):
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


def scan_chunks(object buf, str source=""):
    """(offset, header tuple) of every chunk of a chunk file's bytes, each header checked."""
    cdef Buf b = Buf(buf, False, "chunk file")
    cdef size_t length = b.size
    cdef size_t cap = length // SJ_CHUNK_HEADER_SIZE + 1
    cdef int64_t *offsets = <int64_t *>malloc(cap * sizeof(int64_t))
    cdef sj_chunk_header *headers = <sj_chunk_header *>malloc(cap * sizeof(sj_chunk_header))
    cdef size_t count = 0, err_offset = 0, i
    cdef const char *bad = NULL
    cdef sj_status st
    try:
        if offsets == NULL or headers == NULL:
            raise MemoryError()
        with nogil:
            st = sj_chunk_scan(b.ptr, length, offsets, headers, cap, &count, &err_offset, &bad)
        if st != SJ_OK:
            field = bad.decode() if bad != NULL else sj_status_message(st).decode()
            check_corrupt(st, source, err_offset, field)
        return [(offsets[i], _as_tuple(&headers[i])) for i in range(count)]
    finally:
        free(offsets)
        free(headers)


def scatter(const int32_t[::1] partitions, int32_t partition_count, int64_t[::1] starts,
            int64_t[::1] perm=None):
    """Stable counting sort of rows by partition id: run starts (partition_count + 1 of
    them) into starts and, unless perm is None, the row order into perm."""
    cdef int64_t n = partitions.shape[0]
    if partition_count < 1:
        raise InvalidArgumentError(f"partition_count must be >= 1, not {partition_count}")
    if starts.shape[0] < <int64_t>partition_count + 1:
        raise InvalidArgumentError(
            f"starts holds {starts.shape[0]} values, {partition_count + 1} are needed")
    if perm is not None and perm.shape[0] < n:
        raise InvalidArgumentError(f"perm holds {perm.shape[0]} values, {n} are needed")
    cdef int64_t *perm_ptr = &perm[0] if perm is not None and n else NULL
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_scatter_by_partition(&partitions[0] if n else NULL, n, partition_count,
                                     &starts[0], perm_ptr, &err)
    if st != SJ_OK:
        raise InvalidArgumentError(
            f"partition id at index {err} is outside 0..{partition_count - 1}")


def scatter_fixed(object src, int64_t width, const int32_t[::1] partitions,
                  const int64_t[::1] starts, object dst):
    """Moves len(partitions) values of `width` bytes from src into partition order in dst,
    by the run starts scatter() computed (len(starts) - 1 partitions)."""
    cdef int64_t n = partitions.shape[0]
    cdef int32_t partition_count = <int32_t>(starts.shape[0] - 1)
    if width < 1:
        raise InvalidArgumentError(f"width must be >= 1, not {width}")
    if starts.shape[0] < 2 or starts.shape[0] - 1 > 2**31 - 1:
        raise InvalidArgumentError(f"starts needs 2..2**31 values, not {starts.shape[0]}")
    if n > INT64_MAX // width:
        raise InvalidArgumentError(f"{n} values of {width} bytes overflow")
    cdef Buf s = sized_buf(src, n * width, "scatter source")
    cdef Buf d = sized_buf(dst, n * width, "scatter destination", True)
    cdef sj_status st
    with nogil:
        st = sj_scatter_fixed(s.ptr, width, n, &partitions[0] if n else NULL, &starts[0],
                              partition_count, <uint8_t *>d.ptr)
    check_status(st, "scatter_fixed (partition ids that do not match the run starts)")


cdef class _Binary:
    """An sj_binary over a binary column tuple (offsets, data, offset, length), holding
    its buffers."""
    cdef sj_binary b
    cdef Buf offsets, data

    def __cinit__(self, tuple d, str what):
        if len(d) != 4:
            raise TypeError(f"{what}: expected (offsets, data, offset, length), not {d!r:.80}")
        offsets, data, offset, length = d
        if offset < 0 or length < 0 or offset > INT64_MAX - 1 - length:
            raise InvalidArgumentError(f"{what}: bad offset {offset} or length {length}")
        self.b.offset = offset
        self.b.length = length
        self.offsets = buf_of(offsets, what + " offsets")
        self.data = buf_of(data, what + " data")
        self.b.offsets = <const int32_t *>self.offsets.ptr if self.offsets is not None else NULL
        self.b.offsets_size = self.offsets.size if self.offsets is not None else 0
        self.b.data = self.data.ptr if self.data is not None else NULL
        self.b.data_size = self.data.size if self.data is not None else 0


def entries_sizes(tuple keys, tuple values, int64_t[::1] sizes):
    """Bytes each row's entry takes, into sizes; keys and values are binary column tuples
    (offsets buffer, data buffer, offset, length) of the same length."""
    cdef _Binary k = _Binary(keys, "keys"), v = _Binary(values, "values")
    if sizes.shape[0] < k.b.length:
        raise InvalidArgumentError(f"sizes holds {sizes.shape[0]} values, {k.b.length} are needed")
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_entries_sizes(&k.b, &v.b, &sizes[0] if sizes.shape[0] else NULL, &err)
    check_status(st, "entry list input", err)


def entries_encode(tuple keys, tuple values, const int64_t[::1] rows, object out):
    """Encodes the entries of `rows` into out (a writable buffer); the bytes written."""
    cdef _Binary k = _Binary(keys, "keys"), v = _Binary(values, "values")
    cdef Buf o = Buf(out, True, "entry list output")
    cdef int64_t nrows = rows.shape[0]
    cdef size_t written = 0
    cdef sj_status st
    with nogil:
        st = sj_entries_encode(&k.b, &v.b, &rows[0] if nrows else NULL, nrows,
                               <uint8_t *>o.ptr, o.size, &written)
    if st == SJ_ERANGE:
        raise InvalidArgumentError(f"entry list output of {o.size} bytes is too small")
    check_status(st, "entry list encode (a row index outside the columns, or bad offsets)")
    return written


def entries_decode(object payload, uint32_t count, str source="", int64_t offset=0):
    """(key offsets, key data, value offsets, value data) as bytearrays for Arrow
    binary arrays, from an entry list of `count` entries that must fill the payload."""
    cdef Buf b = Buf(payload, False, "entry list")
    cdef int64_t kb = 0, vb = 0
    cdef size_t err = 0
    cdef size_t length = b.size
    cdef sj_status st
    with nogil:
        st = sj_entries_measure(b.ptr, length, count, &kb, &vb, &err)
    if st != SJ_OK:
        check_corrupt(st, source, offset, f"entry list (at payload byte {err})")
    key_offsets = bytearray(4 * (count + 1))
    value_offsets = bytearray(4 * (count + 1))
    key_data = bytearray(kb + 1)
    value_data = bytearray(vb + 1)
    cdef uint8_t[::1] ko = key_offsets, vo = value_offsets, kd = key_data, vd = value_data
    with nogil:
        st = sj_entries_decode(b.ptr, length, count, 0, <int32_t *>&ko[0], &kd[0],
                               0, <int32_t *>&vo[0], &vd[0])
    check_corrupt(st, source, offset, "entry list")
    return key_offsets, key_data, value_offsets, value_data
