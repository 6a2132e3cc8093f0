/* Hazelcast-compatible key hashing and partitioning over Arrow columns.
 *
 * A key's partition is MurmurHash3 x86_32 (seed 0x01000193) of the payload of
 * its Hazelcast serialized form, reduced as Java does:
 *     partition = (h == INT32_MIN) ? 0 : abs(h) % partition_count
 * Payloads are big-endian: Integer = 4 bytes, Long = 8 bytes, String and
 * byte[] = int32 byte count then the bytes (UTF-8 for String).
 *
 * Columns are described by sj_column, which points at Arrow buffers in place:
 * nothing is copied, and every offset read from them is checked against the
 * buffer sizes before the bytes behind it are touched. */
#ifndef SPARKJET_HASH_H
#define SPARKJET_HASH_H

#include <stddef.h>
#include <stdint.h>

#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SJ_HAZELCAST_SEED 0x01000193u
#define SJ_DEFAULT_PARTITION_COUNT 271

/* How the values of a column are laid out and which Hazelcast type they hash as. */
typedef enum sj_key_kind {
    SJ_KEY_INT32 = 1,          /* int32 values -> Integer */
    SJ_KEY_INT64 = 2,          /* int64 values -> Long */
    SJ_KEY_INT64_AS_INT32 = 3, /* int64 values -> Integer; each must fit int32 (else SJ_ERANGE) */
    SJ_KEY_VAR32 = 4,          /* int32 offsets + data (string, binary) -> String / byte[] */
    SJ_KEY_VAR64 = 5,          /* int64 offsets + data (large_string, large_binary) */
    SJ_KEY_FIXED = 6,          /* fixed_size_binary of `width` bytes -> byte[] */
    SJ_KEY_VIEW = 7            /* 16-byte views + variadic buffers (string_view, binary_view) */
} sj_key_kind;

/* One Arrow column, read in place. Sizes are in bytes and bound every read. */
typedef struct sj_column {
    int32_t kind;       /* an sj_key_kind */
    int32_t width;      /* SJ_KEY_FIXED: bytes per value */
    int64_t offset;     /* the Arrow array's offset (slices), in values */
    int64_t length;     /* number of values */
    const void *values; /* values, offsets (length + 1 of them) or views */
    int64_t values_size;
    const uint8_t *data; /* SJ_KEY_VAR32/VAR64/FIXED: the data buffer */
    int64_t data_size;
    const uint8_t *const *variadic;  /* SJ_KEY_VIEW: the data buffers */
    const int64_t *variadic_sizes;
    int64_t variadic_count;
} sj_column;

/* A partition count's precomputed exact division (multiply-shift), valid for
 * every dividend below 2**31. */
typedef struct sj_divisor {
    uint32_t d;
    uint32_t magic;
    uint32_t shift;
} sj_divisor;

/* MurmurHash3 x86_32 of `len` bytes, as a signed int32 (Java's view). */
int32_t sj_murmur3_32(const void *data, size_t len, uint32_t seed);

/* Java's partition rule for one hash. partition_count must be >= 1. */
int32_t sj_partition_of_hash(int32_t hash, int32_t partition_count);

/* SJ_EINVAL unless 1 <= partition_count <= 2**31 - 1. */
sj_status sj_divisor_init(sj_divisor *div, int32_t partition_count);

/* Checks that the column's buffers are large enough for offset + length
 * values; does not look at offsets stored in them (the kernels do). */
sj_status sj_column_check(const sj_column *col);

/* Hashes of every value's Hazelcast payload, out[0 .. col->length). On error,
 * *err_index is the first bad value's index (relative to col->offset). */
sj_status sj_hash_column(const sj_column *col, uint32_t seed, int32_t *out, int64_t *err_index);

/* Partition ids with Hazelcast's seed, fused with the hash (one pass). */
sj_status sj_partition_column(const sj_column *col, int32_t partition_count, int32_t *out,
                              int64_t *err_index);

/* Composite keys: per row, the hash of the concatenated payloads of every
 * column, in order. With one column this equals sj_hash_column. All columns
 * must have `rows` values. On error *err_index is the row, *err_column the column. */
sj_status sj_hash_rows(const sj_column *cols, int32_t ncols, uint32_t seed, int32_t *out,
                       int64_t *err_index, int32_t *err_column);

/* out[i] = sj_partition_of_hash(hashes[i], partition_count); in place is fine. */
sj_status sj_partitions_from_hashes(const int32_t *hashes, int64_t n, int32_t partition_count,
                                    int32_t *out);

/* The name of the kernel set in use: the fastest this CPU runs ("avx512",
 * "avx2", "generic") unless one was selected. */
const char *sj_hash_kernel_name(void);

/* The i-th kernel set this CPU can run, fastest first, or NULL past the last. */
const char *sj_hash_kernel_available(int i);

/* Uses the named kernel set (SJ_EINVAL if this CPU cannot run it), or returns
 * to the fastest with NULL: for tests that compare kernels and benchmarks.
 * Not thread-safe against concurrent hashing. */
sj_status sj_hash_select_kernel(const char *name);

#ifdef __cplusplus
}
#endif
#endif
