# cython: freethreading_compatible = True
"""Hazelcast hashing kernels, bound to Python: conversion and GIL handling only.

Columns arrive as plain tuples of buffer addresses and sizes, built by
sparkjet.partitioning from Arrow arrays, which keeps them alive for the call:
(kind, width, offset, length, values_address, values_size, data_address,
data_size, variadic_addresses, variadic_sizes).
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uintptr_t
from libc.stdlib cimport calloc, free

from sparkjet.libsparkjet cimport *

from sparkjet.errors import CorruptDataError, InvalidArgumentError, KeyRangeError

HAZELCAST_SEED = SJ_HAZELCAST_SEED
KEY_INT32 = SJ_KEY_INT32
KEY_INT64 = SJ_KEY_INT64
KEY_INT64_AS_INT32 = SJ_KEY_INT64_AS_INT32
KEY_VAR32 = SJ_KEY_VAR32
KEY_VAR64 = SJ_KEY_VAR64
KEY_FIXED = SJ_KEY_FIXED
KEY_VIEW = SJ_KEY_VIEW


# The cimportable API (declared in hash.pxd).
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


cdef int check_status(sj_status status, int64_t index, str context) except -1:
    """The one place a native status becomes an exception."""
    if status == SJ_OK:
        return 0
    where = f"{context}: " if context else ""
    at = f" at index {index}" if index >= 0 else ""
    message = f"{where}{sj_status_message(status).decode()}{at}"
    if status == SJ_ERANGE:
        raise KeyRangeError(message, index)
    if status == SJ_EBOUNDS or status == SJ_ECORRUPT:
        raise CorruptDataError(message + " (malformed Arrow buffers)", index)
    if status == SJ_ENOMEM:
        raise MemoryError(message)
    raise InvalidArgumentError(message)


cdef class Columns:
    # Declared (with its fields) in hash.pxd.

    def __cinit__(self, list descs):
        self.n = len(descs)
        self.cols = <sj_column *>calloc(max(self.n, 1), sizeof(sj_column))
        if self.cols == NULL:
            raise MemoryError()
        cdef sj_column *c
        cdef Py_ssize_t j, nv
        for i, d in enumerate(descs):
            c = &self.cols[i]
            (kind, width, offset, length, values, values_size, data, data_size,
             variadic, variadic_sizes) = d
            c.kind = kind
            c.width = width
            c.offset = offset
            c.length = length
            c.values = <const void *><uintptr_t>values
            c.values_size = values_size
            c.data = <const uint8_t *><uintptr_t>data
            c.data_size = data_size
            nv = len(variadic)
            c.variadic_count = nv
            if nv:
                c.variadic = <const uint8_t *const *>calloc(nv, sizeof(uint8_t *))
                c.variadic_sizes = <const int64_t *>calloc(nv, sizeof(int64_t))
                if c.variadic == NULL or c.variadic_sizes == NULL:
                    raise MemoryError()
                for j in range(nv):
                    (<const uint8_t **>c.variadic)[j] = <const uint8_t *><uintptr_t>variadic[j]
                    (<int64_t *>c.variadic_sizes)[j] = variadic_sizes[j]

    def __dealloc__(self):
        if self.cols != NULL:
            for i in range(self.n):
                free(<void *>self.cols[i].variadic)
                free(<void *>self.cols[i].variadic_sizes)
            free(self.cols)


def column_hashes(tuple desc, uint32_t seed, uintptr_t out, int64_t index_base=0, str context=""):
    """Writes the hashes of one column's Hazelcast payloads to `out` (int32 x length)."""
    cdef Columns cols = Columns([desc])
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_hash_column(cols.cols, seed, <int32_t *>out, &err)
    check_status(st, err + index_base if err >= 0 else -1, context)


def column_partitions(tuple desc, int32_t partition_count, uintptr_t out, int64_t index_base=0,
                      str context=""):
    """Writes the Hazelcast partition ids of one column to `out` (int32 x length)."""
    cdef Columns cols = Columns([desc])
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = sj_partition_column(cols.cols, partition_count, <int32_t *>out, &err)
    check_status(st, err + index_base if err >= 0 else -1, context)


def row_hashes(list descs, uint32_t seed, uintptr_t out, int64_t index_base=0, list names=None):
    """Writes the hash of each row's concatenated payloads (composite keys) to `out`."""
    cdef Columns cols = Columns(descs)
    cdef int64_t err = -1
    cdef int32_t err_col = -1
    cdef sj_status st
    with nogil:
        st = sj_hash_rows(cols.cols, cols.n, seed, <int32_t *>out, &err, &err_col)
    context = ""
    if err_col >= 0:
        context = f"key column {names[err_col]!r}" if names else f"key column {err_col}"
    check_status(st, err + index_base if err >= 0 else -1, context)


def partitions_from_hashes(uintptr_t hashes, int64_t n, int32_t partition_count, uintptr_t out):
    """out[i] = partition of hashes[i] by Java's rule; in place is fine."""
    cdef sj_status st
    with nogil:
        st = sj_partitions_from_hashes(<const int32_t *>hashes, n, partition_count,
                                       <int32_t *>out)
    check_status(st, -1, "partitions_from_hashes")


def murmur3_bytes(const uint8_t[::1] data, uint32_t seed):
    """MurmurHash3 x86_32 of a bytes-like object, as a signed int."""
    cdef int32_t h
    cdef const uint8_t *p = &data[0] if data.shape[0] else NULL
    with nogil:
        h = sj_murmur3_32(p, data.shape[0], seed)
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
    """Uses the named kernel set, or the fastest again with None (parity tests and
    benchmarks; not to be called while another thread hashes)."""
    if name is None:
        sj_hash_select_kernel(NULL)
        return
    encoded = name.encode()
    if sj_hash_select_kernel(encoded) != SJ_OK:
        raise InvalidArgumentError(
            f"kernel {name!r} is not available on this CPU; available: {available_kernels()}"
        )
