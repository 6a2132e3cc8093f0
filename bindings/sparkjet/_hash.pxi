# Hazelcast hashing kernels (native/include/sparkjet/hash.h).
#
# A key column arrives as a tuple built by sparkjet._keys from an Arrow array:
# (kind, width, offset, length, values, data, variadic) where values and data are the
# array's buffers (or None) and variadic a tuple of buffers (string views). Columns takes
# each through the buffer protocol, so sizes come from the buffers themselves and
# sj_column_check refuses any offset or length that reaches past them.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.stdlib cimport calloc, free

HAZELCAST_SEED = SJ_HAZELCAST_SEED
KEY_INT32 = SJ_KEY_INT32
KEY_INT64 = SJ_KEY_INT64
KEY_INT64_AS_INT32 = SJ_KEY_INT64_AS_INT32
KEY_VAR32 = SJ_KEY_VAR32
KEY_VAR64 = SJ_KEY_VAR64
KEY_FIXED = SJ_KEY_FIXED
KEY_VIEW = SJ_KEY_VIEW


# The cimportable API (declared in _native.pxd, re-exported by hash.pxd).
cdef int32_t murmur3_32(const void *data, size_t length, uint32_t seed) noexcept nogil:
    return sj_murmur3_32(data, length, seed)

cdef int32_t partition_of_hash(int32_t hash, int32_t partition_count) noexcept nogil:
    return sj_partition_of_hash(hash, partition_count)

cdef sj_status hash_column(const sj_column *col, uint32_t seed, int32_t *out,
                           int64_t *err_index) noexcept nogil:
    return sj_hash_column(col, seed, out, err_index)

cdef sj_status partition_column(const sj_column *col, int32_t partition_count, int32_t *out,
                                int64_t *err_index) noexcept nogil:
    return sj_partition_column(col, partition_count, out, err_index)

cdef sj_status hash_rows(const sj_column *cols, int32_t ncols, uint32_t seed, int32_t *out,
                         int64_t *err_index, int32_t *err_column) noexcept nogil:
    return sj_hash_rows(cols, ncols, seed, out, err_index, err_column)


cdef class Columns:
    """sj_column structs over the buffers of key column tuples (see above), which it
    keeps alive; every column is checked against its buffers when built."""

    def __cinit__(self, list descs, list names=None):
        self.n = len(descs)
        self.rows = -1
        self.held = []
        self.cols = <sj_column *>calloc(max(self.n, 1), sizeof(sj_column))
        if self.cols == NULL:
            raise MemoryError()
        cdef sj_column *c
        cdef Buf b
        cdef Py_ssize_t i, j, nv
        cdef sj_status st
        for i, d in enumerate(descs):
            what = f"key column {names[i]!r}" if names and i < len(names) else f"key column {i}"
            if not isinstance(d, tuple) or len(d) != 7:
                raise TypeError(f"{what}: expected (kind, width, offset, length, values, "
                                f"data, variadic), not {d!r:.80}")
            kind, width, offset, length, values, data, variadic = d
            c = &self.cols[i]
            c.kind = kind
            c.width = width
            c.offset = offset
            c.length = length
            b = buf_of(values, what + " values")
            if b is not None:
                self.held.append(b)
                c.values = b.ptr
                c.values_size = b.size
            b = buf_of(data, what + " data")
            if b is not None:
                self.held.append(b)
                c.data = b.ptr
                c.data_size = b.size
            nv = len(variadic)
            c.variadic_count = nv
            if nv:
                c.variadic = <const uint8_t *const *>calloc(nv, sizeof(uint8_t *))
                c.variadic_sizes = <const int64_t *>calloc(nv, sizeof(int64_t))
                if c.variadic == NULL or c.variadic_sizes == NULL:
                    raise MemoryError()
                for j in range(nv):
                    b = Buf(variadic[j], False, what + " variadic buffer")
                    self.held.append(b)
                    (<const uint8_t **>c.variadic)[j] = b.ptr
                    (<int64_t *>c.variadic_sizes)[j] = b.size
            st = sj_column_check(c)
            if st != SJ_OK:
                check_status(st, what, -1, -1, None, "index", True)
            if self.rows >= 0 and c.length != self.rows:
                raise InvalidArgumentError(
                    f"{what} has {c.length} rows, the first column {self.rows}")
            self.rows = c.length

    def __dealloc__(self):
        if self.cols != NULL:
            for i in range(self.n):
                free(<void *>self.cols[i].variadic)
                free(<void *>self.cols[i].variadic_sizes)
            free(self.cols)


def column_hashes(tuple desc, uint32_t seed, int32_t[::1] out, int64_t index_base=0,
                  str context="key"):
    """Writes the hashes of one column's Hazelcast payloads to out[:length]."""
    cdef Columns cols = Columns([desc])
    check_len(out.shape[0], cols.rows, "output")
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_hash_column(cols.cols, seed, &out[0] if cols.rows else NULL, &err)
    check_status(st, context, err + index_base if err >= 0 else -1, -1, None, "index", True)


def column_partitions(tuple desc, int32_t partition_count, int32_t[::1] out,
                      int64_t index_base=0, str context="key"):
    """Writes the Hazelcast partition ids of one column to out[:length]."""
    cdef Columns cols = Columns([desc])
    check_len(out.shape[0], cols.rows, "output")
    _hash_check_partition_count(partition_count)
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_partition_column(cols.cols, partition_count, &out[0] if cols.rows else NULL,
                                 &err)
    check_status(st, context, err + index_base if err >= 0 else -1, -1, None, "index", True)


def row_hashes(list descs, uint32_t seed, int32_t[::1] out, int64_t index_base=0,
               list names=None):
    """Writes the hash of each row's concatenated payloads (composite keys) to out."""
    if not descs:
        raise InvalidArgumentError("a composite key needs at least one column")
    cdef Columns cols = Columns(descs, names)
    check_len(out.shape[0], cols.rows, "output")
    cdef int64_t err = -1
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_hash_rows(cols.cols, cols.n, seed, &out[0] if cols.rows else NULL, &err,
                          &err_col)
    check_status(st, "composite key", err + index_base if err >= 0 else -1, err_col, names,
                 "index", True)


def partitions_from_hashes(const int32_t[::1] hashes, int32_t partition_count,
                           int32_t[::1] out):
    """out[i] = partition of hashes[i] by Java's rule; out may be hashes itself."""
    cdef int64_t n = hashes.shape[0]
    check_len(out.shape[0], n, "output")
    _hash_check_partition_count(partition_count)
    cdef sj_status st
    with nogil:
        st = sj_partitions_from_hashes(&hashes[0] if n else NULL, n, partition_count,
                                       &out[0] if n else NULL)
    check_status(st, "partitions_from_hashes")


cdef int _hash_check_partition_count(int32_t partition_count) except -1:
    if partition_count < 1:
        raise InvalidArgumentError(f"partition_count must be >= 1, not {partition_count}")
    return 0


def murmur3_bytes(object data, uint32_t seed):
    """MurmurHash3 x86_32 of a bytes-like object, as a signed int."""
    cdef Buf b = Buf(data, False, "data")
    cdef int32_t h
    with nogil:
        h = sj_murmur3_32(b.ptr, b.size, seed)
    return h


def kernel_name():
    """The kernel set in use: the fastest this CPU runs ("avx512", "avx2", "generic")."""
    return sj_hash_kernel_name().decode()


def available_kernels():
    """The kernel sets this CPU can run, fastest first."""
    names = []
    cdef const char *name = sj_hash_kernel_available(0)
    while name != NULL:
        names.append(name.decode())
        name = sj_hash_kernel_available(len(names))
    return names


def select_kernel(name):
    """Uses the named kernel set for every hash in the process (partitioning and Merkle
    trees alike), or the fastest again with None. For parity tests and benchmarks; not to
    be called while another thread hashes."""
    if name is None:
        sj_hash_select_kernel(NULL)
        return
    encoded = str(name).encode()
    if sj_hash_select_kernel(encoded) != SJ_OK:
        raise InvalidArgumentError(
            f"kernel {name!r} is not available on this CPU; available: {available_kernels()}"
        )
