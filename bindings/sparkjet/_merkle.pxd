# The public Cython API of sparkjet's Merkle forests: nogil functions that downstream
# extensions cimport (`from sparkjet._merkle cimport merkle_update`) without linking
# against anything; Cython fetches them from this module at import. The types are in
# sparkjet.libsparkjet_merkle. (The compiled module is sparkjet._merkle because
# sparkjet.merkle is the pure-Python API over it.)
from libc.stdint cimport int32_t, int64_t, uint8_t

from sparkjet.libsparkjet cimport sj_column, sj_status
from sparkjet.libsparkjet_merkle cimport (
    sj_merkle_batch,
    sj_merkle_forest,
    sj_merkle_header,
    sj_merkle_leaf_set,
)


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
