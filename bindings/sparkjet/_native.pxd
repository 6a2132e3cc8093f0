# The public Cython API of sparkjet's native library: nogil functions that downstream
# extensions cimport without linking against anything (Cython fetches them from the
# compiled sparkjet._native at import). hash.pxd and _merkle.pxd re-export them under
# the names downstream code has always used; the C types are in libsparkjet*.pxd.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

from sparkjet.libsparkjet cimport sj_column, sj_status
from sparkjet.libsparkjet_merkle cimport (
    sj_merkle_batch,
    sj_merkle_forest,
    sj_merkle_header,
    sj_merkle_leaf_set,
)


cdef class Columns:
    """sj_column structs over the buffers of key column tuples, which it keeps alive."""
    cdef sj_column *cols
    cdef int32_t n
    cdef int64_t rows
    cdef list held


# Hashing (sparkjet/hash.h)
cdef int32_t murmur3_32(const void *data, size_t length, uint32_t seed) noexcept nogil
cdef int32_t partition_of_hash(int32_t hash, int32_t partition_count) noexcept nogil
cdef sj_status hash_column(const sj_column *col, uint32_t seed, int32_t *out,
                           int64_t *err_index) noexcept nogil
cdef sj_status partition_column(const sj_column *col, int32_t partition_count, int32_t *out,
                                int64_t *err_index) noexcept nogil
cdef sj_status hash_rows(const sj_column *cols, int32_t ncols, uint32_t seed, int32_t *out,
                         int64_t *err_index, int32_t *err_column) noexcept nogil

# Merkle forests (sparkjet/merkle.h)
cdef int64_t merkle_node_count(int32_t depth) noexcept nogil
cdef int32_t merkle_leaf_of_hash(int32_t key_hash, int32_t depth) noexcept nogil
cdef int32_t merkle_entry_hash(int32_t key_hash, int32_t value_hash) noexcept nogil
cdef sj_status merkle_update(const sj_merkle_forest *f, const sj_merkle_batch *b, int32_t sign,
                             int64_t *err_index, int32_t *err_column) noexcept nogil
cdef sj_status merkle_refresh(const sj_merkle_forest *f) noexcept nogil
cdef sj_status merkle_diff(const sj_merkle_forest *a, const sj_merkle_forest *b, int64_t *out,
                           int64_t capacity, int64_t *count, int64_t *compared) noexcept nogil
cdef sj_status merkle_locate(const sj_column *keys, int32_t key_count, int32_t depth,
                             int32_t partition_count, int32_t *partitions, int32_t *leaves,
                             int64_t *err_index, int32_t *err_column) noexcept nogil
cdef sj_status merkle_leaf_set_init(sj_merkle_leaf_set *s, int32_t depth, int32_t partition_count,
                                    const int64_t *leaf_ids, int64_t id_count,
                                    int64_t *err_index) noexcept nogil
cdef void merkle_leaf_set_free(sj_merkle_leaf_set *s) noexcept nogil
cdef sj_status merkle_select(const sj_column *keys, int32_t key_count,
                             const sj_merkle_leaf_set *s, uint8_t *mask, int64_t *selected,
                             int64_t *err_index, int32_t *err_column) noexcept nogil
cdef sj_status merkle_write(const int32_t *tree, int32_t depth, int32_t partition,
                            int32_t partition_count, int32_t mode, uint8_t *out,
                            int64_t out_size) noexcept nogil
cdef sj_status merkle_read_header(const uint8_t *buf, int64_t len, sj_merkle_header *h,
                                  int64_t *err_offset, const char **bad_field) noexcept nogil
cdef sj_status merkle_read_tree(const uint8_t *buf, int64_t len, const sj_merkle_header *h,
                                int32_t *tree) noexcept nogil
