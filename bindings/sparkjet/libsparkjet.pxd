# Declarations only: the C API of native/include/sparkjet/, for Cython.
# Downstream code that cimports these types needs sparkjet.get_include() on
# its include path; the functions themselves are reached through sparkjet.hash.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t


cdef extern from "sparkjet/status.h" nogil:
    ctypedef enum sj_status:
        SJ_OK
        SJ_EINVAL
        SJ_EBOUNDS
        SJ_ERANGE
        SJ_ENOMEM
        SJ_ECORRUPT

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
