/* MurmurHash3 x86_32 building blocks, shared by the kernels (internal). */
#ifndef SPARKJET_MURMUR_H
#define SPARKJET_MURMUR_H

#include <stdint.h>
#include <string.h>

#include "sparkjet/hash.h"

static inline uint32_t sj_rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

static inline uint32_t sj_bswap32(uint32_t x) { return __builtin_bswap32(x); }

/* Murmur reads blocks little-endian whatever the host. */
static inline uint32_t sj_load_le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = sj_bswap32(v);
#endif
    return v;
}

static inline uint32_t sj_mix_k(uint32_t k) {
    k *= 0xcc9e2d51u;
    k = sj_rotl32(k, 15);
    return k * 0x1b873593u;
}

static inline uint32_t sj_mix_h(uint32_t h, uint32_t k) {
    h ^= sj_mix_k(k);
    h = sj_rotl32(h, 13);
    return h * 5u + 0xe6546b64u;
}

static inline uint32_t sj_fmix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* Java's partition rule with a precomputed divisor: abs(h) % d, and 0 for
 * INT32_MIN (whose abs overflows: masking bit 31 maps it to 0, others keep
 * their value below 2**31, the range the multiply-shift is exact for). */
static inline uint32_t sj_reduce(uint32_t h, uint32_t d, uint32_t magic, uint32_t shift) {
    uint32_t s = (uint32_t)((int32_t)h >> 31);
    uint32_t x = ((h ^ s) - s) & 0x7fffffffu;
    uint32_t q = (uint32_t)(((uint64_t)x * magic) >> shift);
    return x - q * d;
}

/* Hash of a String / byte[] payload: big-endian int32 length, then the bytes. */
static inline uint32_t sj_hash_bytes_payload(const uint8_t *p, uint32_t len, uint32_t seed) {
    uint32_t h = sj_mix_h(seed, sj_bswap32(len));
    uint32_t blocks = len >> 2;
    for (uint32_t b = 0; b < blocks; b++) h = sj_mix_h(h, sj_load_le32(p + 4 * b));
    uint32_t t = len & 3u, k = 0;
    const uint8_t *tail = p + 4 * blocks;
    switch (t) {
    case 3: k ^= (uint32_t)tail[2] << 16; /* fall through */
    case 2: k ^= (uint32_t)tail[1] << 8;  /* fall through */
    case 1: k ^= tail[0]; h ^= sj_mix_k(k);
    }
    return sj_fmix(h ^ (len + 4u));
}

#endif
