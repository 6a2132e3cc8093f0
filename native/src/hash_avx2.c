/* AVX2 kernels: the fixed-width loops of hash_kernels.inc compiled for AVX2,
 * and an 8-lane hash of variable-length payloads (String, byte[]).
 *
 * Variable-length keys defeat a scalar loop through branch mispredictions on
 * the length; here eight keys advance in lockstep, one 4-byte block per round,
 * and lanes whose key is shorter keep their hash through a blend. Only bytes
 * inside each key are read. Compiled with a target attribute, so the file
 * builds for baseline x86-64 and hash.c calls in only after CPU detection. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "hash_internal.h"
#include "murmur.h"

#define SJ_K(name) name##_avx2
#define SJ_KTARGET __attribute__((target("avx2,bmi2")))
#define SJ_OWN_INT64_KERNEL
#include "hash_kernels.inc"

SJ_KTARGET static inline __m256i v_rotl(__m256i x, int r) {
    return _mm256_or_si256(_mm256_slli_epi32(x, r), _mm256_srli_epi32(x, 32 - r));
}

SJ_KTARGET static inline __m256i v_mix_k(__m256i k) {
    k = _mm256_mullo_epi32(k, _mm256_set1_epi32((int)0xcc9e2d51u));
    k = v_rotl(k, 15);
    return _mm256_mullo_epi32(k, _mm256_set1_epi32(0x1b873593));
}

SJ_KTARGET static inline __m256i v_mix_h(__m256i h, __m256i k) {
    h = _mm256_xor_si256(h, v_mix_k(k));
    h = v_rotl(h, 13);
    h = _mm256_add_epi32(_mm256_slli_epi32(h, 2), h);
    return _mm256_add_epi32(h, _mm256_set1_epi32((int)0xe6546b64u));
}

SJ_KTARGET static inline __m256i v_fmix(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85ebca6bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xc2b2ae35u));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

SJ_KTARGET static inline __m256i v_bswap(__m256i x) {
    const __m256i m = _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12, 3, 2,
                                       1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
    return _mm256_shuffle_epi8(x, m);
}

/* sj_reduce on eight lanes: abs maps INT32_MIN to itself, which the mask
 * turns into 0; the 32x32->64 multiplies run on even and odd lanes. */
SJ_KTARGET static inline __m256i v_reduce(__m256i h, const sj_divisor *div) {
    const __m256i magic = _mm256_set1_epi32((int)div->magic);
    const __m128i shift = _mm_cvtsi32_si128((int)div->shift);
    __m256i x = _mm256_and_si256(_mm256_abs_epi32(h), _mm256_set1_epi32(0x7fffffff));
    __m256i qe = _mm256_srl_epi64(_mm256_mul_epu32(x, magic), shift);
    __m256i qo = _mm256_srl_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), magic), shift);
    __m256i q = _mm256_blend_epi32(qe, _mm256_slli_epi64(qo, 32), 0xaa);
    return _mm256_sub_epi32(x, _mm256_mullo_epi32(q, _mm256_set1_epi32((int)div->d)));
}

/* Long keys, eight at a time: two loads hold four keys each as (low, high)
 * word pairs; one permute per load gathers the low words in the lower half
 * and the high words in the upper half, and two lane swaps give a vector of
 * eight high words and one of eight low words. The scalar remainder uses the
 * same inline hash as the other kernel sets. */
SJ_KTARGET static void hash_long8_avx2(const int64_t *restrict v, int64_t n, uint32_t seed,
                                       const sj_divisor *div, int32_t *restrict out) {
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i seedv = _mm256_set1_epi32((int)seed);
    const __m256i eight = _mm256_set1_epi32(8);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i a = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(v + i)), split);
        __m256i b =
            _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(v + i + 4)), split);
        __m256i lo = _mm256_permute2x128_si256(a, b, 0x20);
        __m256i hi = _mm256_permute2x128_si256(a, b, 0x31);
        __m256i h = v_mix_h(seedv, v_bswap(hi));
        h = v_fmix(_mm256_xor_si256(v_mix_h(h, v_bswap(lo)), eight));
        if (div) h = v_reduce(h, div);
        _mm256_storeu_si256((__m256i *)(out + i), h);
    }
    for (; i < n; i++) {
        uint32_t h = sj_hash_long((uint64_t)v[i], seed);
        out[i] = (int32_t)(div ? sj_reduce(h, div->d, div->magic, div->shift) : h);
    }
}

/* The last len % 4 bytes of a key as murmur's tail word, reading only the key. */
static inline uint32_t tail_word(const uint8_t *p, uint32_t len) {
    uint32_t t = len & 3u;
    /* Branch-free for the usual key of 4+ bytes; a shift by 32 yields 0 (t == 0). */
    if (len >= 4) return (uint32_t)((uint64_t)sj_load_le32(p + len - 4) >> (8 * (4 - t)));
    if (t == 0) return 0;
    uint32_t k = p[0];
    if (t > 1) k |= (uint32_t)p[1] << 8;
    if (t > 2) k |= (uint32_t)p[2] << 16;
    return k;
}

SJ_KTARGET static void hash8_avx2(const uint8_t *const *ptr, const uint32_t *len, uint32_t seed,
                                  uint32_t *out) {
    static const uint8_t zero[4];
    const __m256i lenv = _mm256_loadu_si256((const __m256i *)len);
    const __m256i nblocks = _mm256_srli_epi32(lenv, 2);
    __m256i h = v_mix_h(_mm256_set1_epi32((int)seed), v_bswap(lenv));

    uint32_t rounds = 0;
    for (int j = 0; j < 8; j++) rounds = (len[j] >> 2) > rounds ? (len[j] >> 2) : rounds;

    for (uint32_t b = 0; b < rounds; b++) {
        uint32_t k[8];
        for (int j = 0; j < 8; j++) {
            const uint8_t *p = b < (len[j] >> 2) ? ptr[j] + 4 * (size_t)b : zero;
            k[j] = sj_load_le32(p);
        }
        __m256i kv = _mm256_setr_epi32((int)k[0], (int)k[1], (int)k[2], (int)k[3], (int)k[4],
                                       (int)k[5], (int)k[6], (int)k[7]);
        __m256i active = _mm256_cmpgt_epi32(nblocks, _mm256_set1_epi32((int)b));
        h = _mm256_blendv_epi8(h, v_mix_h(h, kv), active);
    }

    __m256i tail = _mm256_setr_epi32(
        (int)tail_word(ptr[0], len[0]), (int)tail_word(ptr[1], len[1]),
        (int)tail_word(ptr[2], len[2]), (int)tail_word(ptr[3], len[3]),
        (int)tail_word(ptr[4], len[4]), (int)tail_word(ptr[5], len[5]),
        (int)tail_word(ptr[6], len[6]), (int)tail_word(ptr[7], len[7]));
    /* A zero tail word mixes to zero, so lanes without a tail are unchanged. */
    h = _mm256_xor_si256(h, v_mix_k(tail));
    h = _mm256_xor_si256(h, _mm256_add_epi32(lenv, _mm256_set1_epi32(4)));
    _mm256_storeu_si256((__m256i *)out, v_fmix(h));
}

/* Arrow string/binary with int32 offsets, the common key column: offsets are
 * loaded and validated eight at a time, blocks fetched with masked gathers
 * (masked-off lanes read nothing), and the tail word is the key's last four
 * bytes shifted down. Four groups of eight keys go together: four independent
 * hash chains hide the multiply latency, and the round count (the longest of
 * 32 keys) rarely changes, so its loop predicts well. Whole 16-byte chunks of
 * keys are loaded directly and transposed, which beats gathers. Loads may run
 * up to 16 bytes past a key's end, so every end must be 16 bytes inside the
 * data buffer; the last keys of a buffer, and any block with a bad offset, are
 * left to the checked 8-lane path. Returns the number of values done. */
#define SJ_G 4
SJ_KTARGET static int64_t var32_avx2(const int32_t *off, const uint8_t *data, int64_t data_size,
                                     int64_t n, uint32_t seed, const sj_divisor *div,
                                     int32_t *out) {
    const int32_t size32 = data_size > INT32_MAX ? INT32_MAX : (int32_t)data_size;
    const __m256i size = _mm256_set1_epi32(size32);
    const __m256i four = _mm256_set1_epi32(4);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i sixteen = _mm256_set1_epi32(16);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi32(-1);
    int64_t i = 0;
    for (; i + 8 * SJ_G <= n; i += 8 * SJ_G) {
        __m256i start[SJ_G], end[SJ_G], len[SJ_G], nblocks[SJ_G], h[SJ_G];
        __m256i bad = zero, maxb = zero;
        for (int g = 0; g < SJ_G; g++) {
            start[g] = _mm256_loadu_si256((const __m256i *)(off + i + 8 * g));
            end[g] = _mm256_loadu_si256((const __m256i *)(off + i + 8 * g + 1));
            bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(start[g], end[g]));
            bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(end[g], size));
            bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(zero, start[g]));
            /* 16-byte loads may run up to 16 bytes past a key's end. */
            bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(_mm256_add_epi32(end[g], sixteen), size));
            len[g] = _mm256_sub_epi32(end[g], start[g]);
            nblocks[g] = _mm256_srli_epi32(len[g], 2);
            maxb = _mm256_max_epu32(maxb, nblocks[g]);
            h[g] = v_mix_h(_mm256_set1_epi32((int)seed), v_bswap(len[g]));
        }
        if (!_mm256_testz_si256(bad, bad)) break;
        __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(maxb), _mm256_extracti128_si256(maxb, 1));
        m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4e));
        m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xb1));
        const int rounds = _mm_cvtsi128_si32(m4);

        int b = 0;
        /* Four blocks at a time: one 16-byte load per key, transposed so that
         * vector q holds block b + q of eight keys. A key with fewer blocks
         * loads from its start instead (in bounds; its lanes are masked). */
        for (; b + 4 <= rounds; b += 4) {
            for (int g = 0; g < SJ_G; g++) {
                int32_t st[8], ln[8];
                _mm256_storeu_si256((__m256i *)st, start[g]);
                _mm256_storeu_si256((__m256i *)ln, len[g]);
                __m128i r[8];
                for (int j = 0; j < 8; j++) {
                    int32_t o = st[j] + (4 * b < ln[j] ? 4 * b : 0);
                    r[j] = _mm_loadu_si128((const __m128i *)(data + o));
                }
                __m256i a0 = _mm256_inserti128_si256(_mm256_castsi128_si256(r[0]), r[4], 1);
                __m256i a1 = _mm256_inserti128_si256(_mm256_castsi128_si256(r[1]), r[5], 1);
                __m256i a2 = _mm256_inserti128_si256(_mm256_castsi128_si256(r[2]), r[6], 1);
                __m256i a3 = _mm256_inserti128_si256(_mm256_castsi128_si256(r[3]), r[7], 1);
                __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpacklo_epi32(a2, a3);
                __m256i t2 = _mm256_unpackhi_epi32(a0, a1), t3 = _mm256_unpackhi_epi32(a2, a3);
                __m256i blk[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1),
                                  _mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3)};
                for (int q = 0; q < 4; q++) {
                    __m256i active = _mm256_cmpgt_epi32(nblocks[g], _mm256_set1_epi32(b + q));
                    h[g] = _mm256_blendv_epi8(h[g], v_mix_h(h[g], blk[q]), active);
                }
            }
        }
        for (; b < rounds; b++) {
            const __m256i bv = _mm256_set1_epi32(b);
            for (int g = 0; g < SJ_G; g++) {
                __m256i active = _mm256_cmpgt_epi32(nblocks[g], bv);
                __m256i idx = _mm256_add_epi32(start[g], _mm256_slli_epi32(bv, 2));
                __m256i k = _mm256_mask_i32gather_epi32(zero, (const int *)data, idx, active, 1);
                h[g] = _mm256_blendv_epi8(h[g], v_mix_h(h[g], k), active);
            }
        }
        for (int g = 0; g < SJ_G; g++) {
            /* Tail: len >= 4 reads the last 4 bytes and shifts by 8 * (4 - t)
             * (32 when t == 0, which srlv turns into 0); len < 4 reads from
             * the start and keeps the low t bytes. */
            __m256i t8 = _mm256_slli_epi32(_mm256_and_si256(len[g], three), 3);
            __m256i longkey = _mm256_cmpgt_epi32(len[g], three);
            __m256i tidx = _mm256_blendv_epi8(start[g], _mm256_sub_epi32(end[g], four), longkey);
            __m256i w = _mm256_i32gather_epi32((const int *)data, tidx, 1);
            __m256i shifted = _mm256_srlv_epi32(w, _mm256_sub_epi32(_mm256_set1_epi32(32), t8));
            __m256i masked = _mm256_andnot_si256(_mm256_sllv_epi32(ones, t8), w);
            __m256i tail = _mm256_blendv_epi8(masked, shifted, longkey);
            __m256i hg = _mm256_xor_si256(h[g], v_mix_k(tail));
            hg = v_fmix(_mm256_xor_si256(hg, _mm256_add_epi32(len[g], four)));
            if (div) hg = v_reduce(hg, div);
            _mm256_storeu_si256((__m256i *)(out + i + 8 * g), hg);
        }
    }
    return i;
}
#undef SJ_G

const sj_hash_kernels sj_kernels_avx2 = {
    "avx2", hash_int32_avx2, hash_long8_avx2, hash_int64_as_int32_avx2, hash8_avx2, var32_avx2,
};

int sj_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
}
#else
#include "hash_internal.h"
int sj_cpu_has_avx2(void) { return 0; }
const sj_hash_kernels sj_kernels_avx2 = {0};
#endif
