/* The kernel table hash.c dispatches through (internal). */
#ifndef SPARKJET_HASH_INTERNAL_H
#define SPARKJET_HASH_INTERNAL_H

#include <stdint.h>

#include "sparkjet/hash.h"

typedef struct sj_hash_kernels {
    const char *name;
    /* Fixed width: when div is non-NULL, out receives partitions instead of hashes. */
    void (*int32)(const int32_t *v, int64_t n, uint32_t seed, const sj_divisor *div, int32_t *out);
    void (*int64)(const int64_t *v, int64_t n, uint32_t seed, const sj_divisor *div, int32_t *out);
    int64_t (*int64_as_int32)(const int64_t *v, int64_t n, uint32_t seed, const sj_divisor *div,
                              int32_t *out);
    /* Eight String/byte[] payloads given by pointer and length. */
    void (*hash8)(const uint8_t *const *ptr, const uint32_t *len, uint32_t seed, uint32_t *out);
    /* Optional fast path for int32 offsets over one data buffer: returns how
     * many leading values it did; the checked 8-lane path does the rest. */
    int64_t (*var32)(const int32_t *off, const uint8_t *data, int64_t data_size, int64_t n,
                     uint32_t seed, const sj_divisor *div, int32_t *out);
} sj_hash_kernels;

extern const sj_hash_kernels sj_kernels_avx2;
extern const sj_hash_kernels sj_kernels_avx512;
int sj_cpu_has_avx2(void);
int sj_cpu_has_avx512(void);

#endif
