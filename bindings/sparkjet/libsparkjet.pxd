# Declarations only: the C API of native/include/sparkjet/, for Cython.
# Downstream code that cimports these types needs sparkjet.get_include() on
# its include path; the functions themselves are reached through sparkjet.hash.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "sparkjet/status.h" nogil:
    ctypedef enum sj_status:
        SJ_OK
        SJ_EINVAL
        SJ_EBOUNDS
        SJ_ERANGE
        SJ_ENOMEM
        SJ_ECORRUPT
        SJ_EAGAIN
        SJ_ETIMEOUT
        SJ_ECLOSED
        SJ_EBARRIER
        SJ_EENDED

    const char *sj_status_message(sj_status status)


cdef extern from "sparkjet/hash.h" nogil:
    uint32_t SJ_HAZELCAST_SEED
    int32_t SJ_DEFAULT_PARTITION_COUNT

    ctypedef enum sj_key_kind:
        SJ_KEY_INT32
        SJ_KEY_INT64
        SJ_KEY_INT64_AS_INT32
        SJ_KEY_VAR32
        SJ_KEY_VAR64
        SJ_KEY_FIXED
        SJ_KEY_VIEW

    ctypedef struct sj_column:
        int32_t kind
        int32_t width
        int64_t offset
        int64_t length
        const void *values
        int64_t values_size
        const uint8_t *data
        int64_t data_size
        const uint8_t *const *variadic
        const int64_t *variadic_sizes
        int64_t variadic_count

    int32_t sj_murmur3_32(const void *data, size_t len, uint32_t seed)
    int32_t sj_partition_of_hash(int32_t hash, int32_t partition_count)
    sj_status sj_column_check(const sj_column *col)
    sj_status sj_hash_column(const sj_column *col, uint32_t seed, int32_t *out, int64_t *err_index)
    sj_status sj_partition_column(const sj_column *col, int32_t partition_count, int32_t *out,
                                  int64_t *err_index)
    sj_status sj_hash_rows(const sj_column *cols, int32_t ncols, uint32_t seed, int32_t *out,
                           int64_t *err_index, int32_t *err_column)
    sj_status sj_partitions_from_hashes(const int32_t *hashes, int64_t n, int32_t partition_count,
                                        int32_t *out)
    const char *sj_hash_kernel_name()
    const char *sj_hash_kernel_available(int i)
    sj_status sj_hash_select_kernel(const char *name)


cdef extern from "sparkjet/chunk.h" nogil:
    uint32_t SJ_CHUNK_MAGIC
    int SJ_CHUNK_VERSION
    int SJ_CHUNK_HEADER_SIZE
    int SJ_CODEC_RAW
    int SJ_CODEC_LZ4
    int SJ_CODEC_ARROW_LZ4
    int SJ_CODEC_BLOSC2_LZ4
    unsigned int SJ_CHUNK_BROADCAST
    unsigned int SJ_CHUNK_ENTRIES

    ctypedef struct sj_chunk_header:
        uint16_t version
        uint8_t codec
        uint8_t flags
        uint64_t job_id
        int64_t snapshot_id
        uint32_t vertex
        int32_t partition
        uint32_t entry_count
        uint32_t uncompressed_size
        uint32_t stored_size
        uint64_t checksum

    ctypedef struct sj_binary:
        const int32_t *offsets
        int64_t offsets_size
        const uint8_t *data
        int64_t data_size
        int64_t offset
        int64_t length

    sj_status sj_chunk_header_encode(const sj_chunk_header *h, uint8_t *out)
    sj_status sj_chunk_header_decode(const uint8_t *buf, size_t len, sj_chunk_header *h,
                                     const char **bad_field)
    sj_status sj_chunk_scan(const uint8_t *buf, size_t len, int64_t *offsets,
                            sj_chunk_header *headers, size_t cap, size_t *count,
                            size_t *err_offset, const char **bad_field)
    sj_status sj_scatter_by_partition(const int32_t *partitions, int64_t n,
                                      int32_t partition_count, int64_t *starts, int64_t *perm,
                                      int64_t *err_index)
    sj_status sj_entries_sizes(const sj_binary *keys, const sj_binary *values, int64_t *sizes,
                               int64_t *err_index)
    sj_status sj_entries_encode(const sj_binary *keys, const sj_binary *values,
                                const int64_t *rows, int64_t nrows, uint8_t *out, size_t cap,
                                size_t *written)
    sj_status sj_entries_measure(const uint8_t *payload, size_t len, uint32_t count,
                                 int64_t *key_bytes, int64_t *value_bytes, size_t *err_offset)
    sj_status sj_entries_decode(const uint8_t *payload, size_t len, uint32_t count,
                                int32_t key_base, int32_t *key_offsets, uint8_t *key_data,
                                int32_t value_base, int32_t *value_offsets, uint8_t *value_data)
    sj_status sj_scatter_fixed(const uint8_t *src, int64_t width, int64_t n,
                               const int32_t *partitions, const int64_t *starts,
                               int32_t partition_count, uint8_t *dst)


cdef extern from "sparkjet/keyed.h" nogil:
    ctypedef struct sj_keymap:
        pass

    sj_keymap *sj_keymap_new(int64_t expected)
    void sj_keymap_free(sj_keymap *map)
    int64_t sj_keymap_size(const sj_keymap *map)
    const int64_t *sj_keymap_keys(const sj_keymap *map)
    sj_status sj_keymap_upsert(sj_keymap *map, const int64_t *keys, int64_t n, int64_t *slots)
    sj_status sj_keymap_reserve(sj_keymap *map, int64_t total)
    sj_status sj_keymap_upsert_bulk(sj_keymap *map, const int64_t *keys, int64_t n,
                                    int64_t *slots)
    void sj_keymap_lookup(const sj_keymap *map, const int64_t *keys, int64_t n, int64_t *slots)
    void sj_agg_count(const int64_t *slots, int64_t n, int64_t *counts)
    void sj_agg_sum(const int64_t *slots, const double *values, int64_t n, double *sums)
    void sj_agg_min(const int64_t *slots, const double *values, int64_t n, double *mins)
    void sj_agg_max(const int64_t *slots, const double *values, int64_t n, double *maxs)
    sj_status sj_agg_sum_i64(const int64_t *slots, const int64_t *values, int64_t n,
                             int64_t *sums, int64_t *err_index)
    void sj_agg_min_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *mins)
    void sj_agg_max_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *maxs)
    void sj_agg_first(const int64_t *slots, const double *values, int64_t n, double *firsts,
                      uint8_t *seen)
    void sj_agg_last(const int64_t *slots, const double *values, int64_t n, double *lasts)
    void sj_agg_first_i64(const int64_t *slots, const int64_t *values, int64_t n,
                          int64_t *firsts, uint8_t *seen)
    void sj_agg_last_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *lasts)
    sj_status sj_agg_sum_i128(const int64_t *slots, const int64_t *values, int wide, int64_t n,
                              int64_t *sums, int64_t *err_index)
    void sj_distinct_slots(const int64_t *slots, int64_t n, uint8_t *marks, int64_t *out,
                           int64_t *count)
