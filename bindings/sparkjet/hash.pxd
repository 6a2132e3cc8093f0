# The public Cython API of sparkjet's hashing: nogil functions that downstream
# extensions cimport (`from sparkjet.hash cimport partition_column`) without
# linking against anything; Cython fetches them from this module at import.
from libc.stdint cimport int32_t, int64_t, uint32_t

from sparkjet.libsparkjet cimport sj_column, sj_status


cdef class Columns:
    """sj_column structs filled from the column tuples sparkjet.partitioning builds;
    owns the arrays of variadic buffers (the other bindings cimport it)."""
    cdef sj_column *cols
    cdef int32_t n


cdef int32_t murmur3_32(const void *data, size_t length, uint32_t seed) noexcept nogil
cdef int32_t partition_of_hash(int32_t hash, int32_t partition_count) noexcept nogil
cdef sj_status hash_column(const sj_column *col, uint32_t seed, int32_t *out,
                           int64_t *err_index) noexcept nogil
cdef sj_status partition_column(const sj_column *col, int32_t partition_count, int32_t *out,
                                int64_t *err_index) noexcept nogil
cdef sj_status hash_rows(const sj_column *cols, int32_t ncols, uint32_t seed, int32_t *out,
                         int64_t *err_index, int32_t *err_column) noexcept nogil
