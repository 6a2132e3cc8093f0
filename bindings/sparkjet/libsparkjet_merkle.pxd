# Declarations only: native/include/sparkjet/merkle.h for Cython (see libsparkjet.pxd for
# status.h and hash.h). Downstream code that cimports these types needs
# sparkjet.get_include() on its include path; the functions are reached through
# sparkjet._merkle.
from libc.stdint cimport int32_t, int64_t, uint8_t

from sparkjet.libsparkjet cimport sj_column, sj_status


cdef extern from "sparkjet/merkle.h" nogil:
    int32_t SJ_MERKLE_MIN_DEPTH
    int32_t SJ_MERKLE_MAX_DEPTH
    int32_t SJ_MERKLE_DEFAULT_DEPTH
    int32_t SJ_MERKLE_VALUE_FACTOR
    int32_t SJ_MERKLE_FORMAT_VERSION
    int32_t SJ_MERKLE_HEADER_SIZE

    ctypedef enum sj_merkle_mode:
        SJ_MERKLE_VALUE_HASH
        SJ_MERKLE_ENTRY_HASH

    ctypedef struct sj_merkle_forest:
        int32_t depth
        int32_t partition_count
        int32_t *nodes
        uint8_t *dirty

    ctypedef struct sj_merkle_batch:
        const sj_column *keys
        int32_t key_count
        const int32_t *key_hashes
        const sj_column *values
        int32_t value_count
        const int32_t *value_hashes
        int64_t rows
        int32_t mode

    ctypedef struct sj_merkle_header:
        int32_t version
        int32_t depth
        int32_t mode
        int32_t partition
        int32_t partition_count
        int64_t size

    int64_t sj_merkle_node_count(int32_t depth)
    int32_t sj_merkle_leaf_of_hash(int32_t key_hash, int32_t depth)
    int32_t sj_merkle_entry_hash(int32_t key_hash, int32_t value_hash)
    sj_status sj_merkle_forest_check(const sj_merkle_forest *f)
    sj_status sj_merkle_update(const sj_merkle_forest *f, const sj_merkle_batch *b, int32_t sign,
                               int64_t *err_index, int32_t *err_column)
    sj_status sj_merkle_refresh(const sj_merkle_forest *f)
    sj_status sj_merkle_diff(const sj_merkle_forest *a, const sj_merkle_forest *b, int64_t *out,
                             int64_t capacity, int64_t *count, int64_t *compared)
    sj_status sj_merkle_locate(const sj_column *keys, int32_t key_count, int32_t depth,
                               int32_t partition_count, int32_t *partitions, int32_t *leaves,
                               int64_t *err_index, int32_t *err_column)
    ctypedef struct sj_merkle_leaf_set:
        int32_t depth
        int32_t partition_count
        int64_t count
        uint8_t *fine
        uint8_t *coarse
        int32_t coarse_bits

    sj_status sj_merkle_leaf_set_init(sj_merkle_leaf_set *s, int32_t depth,
                                      int32_t partition_count, const int64_t *leaf_ids,
                                      int64_t id_count, int64_t *err_index)
    void sj_merkle_leaf_set_free(sj_merkle_leaf_set *s)
    sj_status sj_merkle_select(const sj_column *keys, int32_t key_count,
                               const sj_merkle_leaf_set *s, uint8_t *mask, int64_t *selected,
                               int64_t *err_index, int32_t *err_column)
    int64_t sj_merkle_serialized_size(int32_t depth)
    sj_status sj_merkle_write(const int32_t *tree, int32_t depth, int32_t partition,
                              int32_t partition_count, int32_t mode, uint8_t *out,
                              int64_t out_size)
    sj_status sj_merkle_read_header(const uint8_t *buf, int64_t len, sj_merkle_header *h,
                                    int64_t *err_offset, const char **bad_field)
    sj_status sj_merkle_read_tree(const uint8_t *buf, int64_t len, const sj_merkle_header *h,
                                  int32_t *tree)
