/* AVX-512 kernels: the fixed-width loops of hash_kernels.inc compiled for
 * AVX-512, and the int32-offset String/byte[] kernel on 16 lanes. Same method
 * as hash_avx2.c (16-byte loads transposed, gathers for the remaining blocks,
 * every key's end at least 16 bytes inside the data buffer); masks replace
 * blends and the rotations are single instructions. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "hash_internal.h"
#include "murmur.h"

#define SJ_K(name) name##_avx512
#define SJ_KTARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,bmi2,prefer-vector-width=512")))
#include "hash_kernels.inc"

SJ_KTARGET static inline __m512i w_mix_k(__m512i k) {
    k = _mm512_mullo_epi32(k, _mm512_set1_epi32((int)0xcc9e2d51u));
    k = _mm512_rol_epi32(k, 15);
    return _mm512_mullo_epi32(k, _mm512_set1_epi32(0x1b873593));
}

SJ_KTARGET static inline __m512i w_mix_h(__m512i h, __m512i k) {
    h = _mm512_rol_epi32(_mm512_xor_si512(h, w_mix_k(k)), 13);
    h = _mm512_add_epi32(_mm512_slli_epi32(h, 2), h);
    return _mm512_add_epi32(h, _mm512_set1_epi32((int)0xe6546b64u));
}

SJ_KTARGET static inline __m512i w_fmix(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85ebca6bu));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xc2b2ae35u));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

SJ_KTARGET static inline __m512i w_bswap(__m512i x) {
    const __m512i m = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
    return _mm512_shuffle_epi8(x, m);
}

SJ_KTARGET static inline __m512i w_reduce(__m512i h, const sj_divisor *div) {
    const __m512i magic = _mm512_set1_epi32((int)div->magic);
    const __m128i shift = _mm_cvtsi32_si128((int)div->shift);
    __m512i x = _mm512_and_si512(_mm512_abs_epi32(h), _mm512_set1_epi32(0x7fffffff));
    __m512i qe = _mm512_srl_epi64(_mm512_mul_epu32(x, magic), shift);
    __m512i qo = _mm512_srl_epi64(_mm512_mul_epu32(_mm512_srli_epi64(x, 32), magic), shift);
    __m512i q = _mm512_mask_blend_epi32(0xaaaa, qe, _mm512_slli_epi64(qo, 32));
    return _mm512_sub_epi32(x, _mm512_mullo_epi32(q, _mm512_set1_epi32((int)div->d)));
}

#define SJ_G 2
SJ_KTARGET static int64_t var32_avx512(const int32_t *off, const uint8_t *data, int64_t data_size,
                                       int64_t n, uint32_t seed, const sj_divisor *div,
                                       int32_t *out) {
    const int32_t size32 = data_size > INT32_MAX ? INT32_MAX : (int32_t)data_size;
    const __m512i size = _mm512_set1_epi32(size32);
    const __m512i four = _mm512_set1_epi32(4);
    const __m512i three = _mm512_set1_epi32(3);
    const __m512i zero = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 * SJ_G <= n; i += 16 * SJ_G) {
        __m512i start[SJ_G], end[SJ_G], len[SJ_G], nblocks[SJ_G], h[SJ_G];
        __mmask16 bad = 0;
        __m512i maxb = zero;
        for (int g = 0; g < SJ_G; g++) {
            start[g] = _mm512_loadu_si512((const void *)(off + i + 16 * g));
            end[g] = _mm512_loadu_si512((const void *)(off + i + 16 * g + 1));
            bad |= _mm512_cmpgt_epi32_mask(start[g], end[g]);
            bad |= _mm512_cmpgt_epi32_mask(end[g], size);
            bad |= _mm512_cmpgt_epi32_mask(zero, start[g]);
            /* 16-byte loads may run up to 16 bytes past a key's end. */
            bad |= _mm512_cmpgt_epi32_mask(_mm512_add_epi32(end[g], _mm512_set1_epi32(16)), size);
            len[g] = _mm512_sub_epi32(end[g], start[g]);
            nblocks[g] = _mm512_srli_epi32(len[g], 2);
            maxb = _mm512_max_epu32(maxb, nblocks[g]);
            h[g] = w_mix_h(_mm512_set1_epi32((int)seed), w_bswap(len[g]));
        }
        if (bad) break;
        const int rounds = (int)_mm512_reduce_max_epu32(maxb);
        int b = 0;
        /* Four blocks at a time, as in hash_avx2.c: one 16-byte load per key,
         * transposed within each 128-bit lane. */
        for (; b + 4 <= rounds; b += 4) {
            for (int g = 0; g < SJ_G; g++) {
                int32_t st[16], ln[16];
                _mm512_storeu_si512((void *)st, start[g]);
                _mm512_storeu_si512((void *)ln, len[g]);
                __m512i a[4];
                for (int row = 0; row < 4; row++) {
                    __m128i r[4];
                    for (int q = 0; q < 4; q++) {
                        int j = row + 4 * q;
                        int32_t o = st[j] + (4 * b < ln[j] ? 4 * b : 0);
                        r[q] = _mm_loadu_si128((const __m128i *)(data + o));
                    }
                    __m512i v = _mm512_castsi128_si512(r[0]);
                    v = _mm512_inserti32x4(v, r[1], 1);
                    v = _mm512_inserti32x4(v, r[2], 2);
                    a[row] = _mm512_inserti32x4(v, r[3], 3);
                }
                __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpacklo_epi32(a[2], a[3]);
                __m512i t2 = _mm512_unpackhi_epi32(a[0], a[1]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
                __m512i blk[4] = {_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1),
                                  _mm512_unpacklo_epi64(t2, t3), _mm512_unpackhi_epi64(t2, t3)};
                for (int q = 0; q < 4; q++) {
                    __mmask16 active = _mm512_cmpgt_epi32_mask(nblocks[g], _mm512_set1_epi32(b + q));
                    h[g] = _mm512_mask_mov_epi32(h[g], active, w_mix_h(h[g], blk[q]));
                }
            }
        }
        for (; b < rounds; b++) {
            const __m512i bv = _mm512_set1_epi32(b);
            for (int g = 0; g < SJ_G; g++) {
                __mmask16 active = _mm512_cmpgt_epi32_mask(nblocks[g], bv);
                __m512i idx = _mm512_add_epi32(start[g], _mm512_slli_epi32(bv, 2));
                __m512i k = _mm512_mask_i32gather_epi32(zero, active, idx, (const void *)data, 1);
                h[g] = _mm512_mask_mov_epi32(h[g], active, w_mix_h(h[g], k));
            }
        }
        for (int g = 0; g < SJ_G; g++) {
            __m512i t8 = _mm512_slli_epi32(_mm512_and_si512(len[g], three), 3);
            __mmask16 longkey = _mm512_cmpgt_epi32_mask(len[g], three);
            __m512i tidx = _mm512_mask_mov_epi32(start[g], longkey, _mm512_sub_epi32(end[g], four));
            __m512i w = _mm512_i32gather_epi32(tidx, (const void *)data, 1);
            __m512i shifted = _mm512_srlv_epi32(w, _mm512_sub_epi32(_mm512_set1_epi32(32), t8));
            __m512i masked = _mm512_andnot_si512(_mm512_sllv_epi32(_mm512_set1_epi32(-1), t8), w);
            __m512i tail = _mm512_mask_mov_epi32(masked, longkey, shifted);
            __m512i hg = _mm512_xor_si512(h[g], w_mix_k(tail));
            hg = w_fmix(_mm512_xor_si512(hg, _mm512_add_epi32(len[g], four)));
            if (div) hg = w_reduce(hg, div);
            _mm512_storeu_si512((void *)(out + i + 16 * g), hg);
        }
    }
    return i;
}
#undef SJ_G

/* Eight payloads of the checked path: the portable loop, as hash.c has it. */
static void hash8_avx512(const uint8_t *const *ptr, const uint32_t *len, uint32_t seed,
                         uint32_t *out) {
    for (int j = 0; j < 8; j++) out[j] = sj_hash_bytes_payload(ptr[j], len[j], seed);
}

const sj_hash_kernels sj_kernels_avx512 = {
    "avx512", hash_int32_avx512, hash_int64_avx512, hash_int64_as_int32_avx512, hash8_avx512,
    var32_avx512,
};

int sj_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("bmi2");
}
#else
#include "hash_internal.h"
int sj_cpu_has_avx512(void) { return 0; }
const sj_hash_kernels sj_kernels_avx512 = {0};
#endif
