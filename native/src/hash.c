/* Hazelcast partition hashing over Arrow columns: validation, dispatch to the
 * kernels chosen for this CPU, variable-width and composite keys. */
#include <stdint.h>
#include <string.h>

#include "hash_internal.h"
#include "murmur.h"
#include "payload.h"

#define SJ_K(name) name##_generic
#define SJ_KTARGET
#include "hash_kernels.inc"

static void hash8_generic(const uint8_t *const *ptr, const uint32_t *len, uint32_t seed,
                          uint32_t *out) {
    for (int j = 0; j < 8; j++) out[j] = sj_hash_bytes_payload(ptr[j], len[j], seed);
}

static const sj_hash_kernels sj_kernels_generic = {
    "generic", hash_int32_generic, hash_int64_generic, hash_int64_as_int32_generic, hash8_generic,
    NULL,
};

/* Fastest first; a kernel set is usable when the CPU has its instructions. */
static const sj_hash_kernels *all_kernels(int i) {
    switch (i) {
    case 0: return sj_cpu_has_avx512() ? &sj_kernels_avx512 : NULL;
    case 1: return sj_cpu_has_avx2() ? &sj_kernels_avx2 : NULL;
    case 2: return &sj_kernels_generic;
    default: return NULL;
    }
}
#define SJ_KERNEL_SETS 3

static const sj_hash_kernels *selected = NULL;

static const sj_hash_kernels *kernels(void) {
    const sj_hash_kernels *k = selected;
    if (k) return k;
    for (int i = 0; i < SJ_KERNEL_SETS && !k; i++) k = all_kernels(i);
    selected = k;
    return k;
}

const char *sj_hash_kernel_name(void) { return kernels()->name; }

const char *sj_hash_kernel_available(int i) {
    int seen = 0;
    for (int j = 0; j < SJ_KERNEL_SETS; j++) {
        const sj_hash_kernels *k = all_kernels(j);
        if (k && seen++ == i) return k->name;
    }
    return NULL;
}

sj_status sj_hash_select_kernel(const char *name) {
    if (!name) {
        selected = NULL;
        return SJ_OK;
    }
    for (int j = 0; j < SJ_KERNEL_SETS; j++) {
        const sj_hash_kernels *k = all_kernels(j);
        if (k && strcmp(k->name, name) == 0) {
            selected = k;
            return SJ_OK;
        }
    }
    return SJ_EINVAL;
}

int32_t sj_murmur3_32(const void *data, size_t len, uint32_t seed) {
    const uint8_t *p = (const uint8_t *)data;
    uint32_t h = seed;
    size_t blocks = len / 4;
    for (size_t b = 0; b < blocks; b++) h = sj_mix_h(h, sj_load_le32(p + 4 * b));
    const uint8_t *tail = p + 4 * blocks;
    uint32_t k = 0;
    switch (len & 3) {
    case 3: k ^= (uint32_t)tail[2] << 16; /* fall through */
    case 2: k ^= (uint32_t)tail[1] << 8;  /* fall through */
    case 1: k ^= tail[0]; h ^= sj_mix_k(k);
    }
    return (int32_t)sj_fmix(h ^ (uint32_t)len);
}

/* Granlund-Montgomery round-up division for 31-bit dividends: with
 * l = ceil(log2 d) and magic = ceil(2**(31 + l) / d), magic * d exceeds
 * 2**(31 + l) by less than 2**l, which makes (x * magic) >> (31 + l) equal to
 * x / d for every x < 2**31; magic < 2**32 and the product < 2**63. */
sj_status sj_divisor_init(sj_divisor *div, int32_t partition_count) {
    if (partition_count < 1) return SJ_EINVAL;
    uint32_t d = (uint32_t)partition_count, l = 0;
    while (((uint64_t)1 << l) < d) l++;
    uint64_t num = (uint64_t)1 << (31 + l);
    div->d = d;
    div->magic = (uint32_t)((num + d - 1) / d);
    div->shift = 31 + l;
    return SJ_OK;
}

int32_t sj_partition_of_hash(int32_t hash, int32_t partition_count) {
    if (hash == INT32_MIN) return 0;
    return (hash < 0 ? -hash : hash) % partition_count;
}

sj_status sj_partitions_from_hashes(const int32_t *hashes, int64_t n, int32_t partition_count,
                                    int32_t *out) {
    sj_divisor div;
    if (n < 0 || sj_divisor_init(&div, partition_count) != SJ_OK) return SJ_EINVAL;
    for (int64_t i = 0; i < n; i++)
        out[i] = (int32_t)sj_reduce((uint32_t)hashes[i], div.d, div.magic, div.shift);
    return SJ_OK;
}

/* Bytes `count` items of `size` bytes need, or -1 on overflow. */
static int64_t span_bytes(int64_t count, int64_t size) {
    if (count < 0 || size < 0 || (size && count > INT64_MAX / size)) return -1;
    return count * size;
}

sj_status sj_column_check(const sj_column *col) {
    if (!col || col->length < 0 || col->offset < 0 || col->length > INT64_MAX - col->offset)
        return SJ_EINVAL;
    int64_t end = col->offset + col->length, need;
    switch (col->kind) {
    case SJ_KEY_INT32: need = span_bytes(end, 4); break;
    case SJ_KEY_INT64:
    case SJ_KEY_INT64_AS_INT32: need = span_bytes(end, 8); break;
    case SJ_KEY_VAR32: need = col->length ? span_bytes(end + 1, 4) : 0; break;
    case SJ_KEY_VAR64: need = col->length ? span_bytes(end + 1, 8) : 0; break;
    case SJ_KEY_VIEW:
        need = span_bytes(end, 16);
        if (col->variadic_count < 0 || (col->variadic_count && (!col->variadic || !col->variadic_sizes)))
            return SJ_EINVAL;
        break;
    case SJ_KEY_FIXED:
        if (col->width < 0) return SJ_EINVAL;
        need = span_bytes(end, col->width);
        if (need < 0) return SJ_EBOUNDS;
        if (need > col->data_size || (need && !col->data)) return SJ_EBOUNDS;
        return SJ_OK;
    default: return SJ_EINVAL;
    }
    if (need < 0 || need > col->values_size || (need && !col->values)) return SJ_EBOUNDS;
    if ((col->kind == SJ_KEY_VAR32 || col->kind == SJ_KEY_VAR64) && col->data_size < 0)
        return SJ_EBOUNDS;
    return SJ_OK;
}

static sj_status hash_var(const sj_hash_kernels *kern, const sj_column *col, uint32_t seed,
                          const sj_divisor *div, int32_t *out, int64_t *err_index) {
    static const uint8_t empty[1];
    const uint8_t *ptr[8];
    uint32_t len[8], h[8];
    int64_t done = 0;
    if (col->kind == SJ_KEY_VAR32 && kern->var32)
        done = kern->var32((const int32_t *)col->values + col->offset, col->data, col->data_size,
                           col->length, seed, div, out);
    for (int64_t base = done; base < col->length; base += 8) {
        int m = col->length - base < 8 ? (int)(col->length - base) : 8;
        for (int j = 0; j < m; j++) {
            sj_status st = sj_var_span(col, base + j, &ptr[j], &len[j]);
            if (st != SJ_OK) {
                *err_index = base + j;
                return st;
            }
        }
        for (int j = m; j < 8; j++) {
            ptr[j] = empty;
            len[j] = 0;
        }
        kern->hash8(ptr, len, seed, h);
        if (div) {
            for (int j = 0; j < m; j++)
                out[base + j] = (int32_t)sj_reduce(h[j], div->d, div->magic, div->shift);
        } else {
            memcpy(out + base, h, (size_t)m * 4);
        }
    }
    return SJ_OK;
}

static sj_status hash_column(const sj_column *col, uint32_t seed, const sj_divisor *div,
                             int32_t *out, int64_t *err_index) {
    *err_index = -1;
    sj_status st = sj_column_check(col);
    if (st != SJ_OK) return st;
    if (col->length == 0) return SJ_OK;
    const sj_hash_kernels *kern = kernels();
    switch (col->kind) {
    case SJ_KEY_INT32:
        kern->int32((const int32_t *)col->values + col->offset, col->length, seed, div, out);
        return SJ_OK;
    case SJ_KEY_INT64:
        kern->int64((const int64_t *)col->values + col->offset, col->length, seed, div, out);
        return SJ_OK;
    case SJ_KEY_INT64_AS_INT32: {
        int64_t bad = kern->int64_as_int32((const int64_t *)col->values + col->offset,
                                           col->length, seed, div, out);
        if (bad >= 0) {
            *err_index = bad;
            return SJ_ERANGE;
        }
        return SJ_OK;
    }
    default: return hash_var(kern, col, seed, div, out, err_index);
    }
}

sj_status sj_hash_column(const sj_column *col, uint32_t seed, int32_t *out, int64_t *err_index) {
    return hash_column(col, seed, NULL, out, err_index);
}

sj_status sj_partition_column(const sj_column *col, int32_t partition_count, int32_t *out,
                              int64_t *err_index) {
    sj_divisor div;
    *err_index = -1;
    if (sj_divisor_init(&div, partition_count) != SJ_OK) return SJ_EINVAL;
    return hash_column(col, SJ_HAZELCAST_SEED, &div, out, err_index);
}

/* Incremental murmur over a payload fed in pieces (composite keys). */
typedef struct {
    uint32_t h, carry, carry_len, total;
} mm_state;

static void mm_feed(mm_state *s, const uint8_t *p, size_t n) {
    while (s->carry_len && n) {
        s->carry |= (uint32_t)*p++ << (8 * s->carry_len++);
        n--;
        s->total++;
        if (s->carry_len == 4) {
            s->h = sj_mix_h(s->h, s->carry);
            s->carry = s->carry_len = 0;
        }
    }
    for (; n >= 4; n -= 4, p += 4, s->total += 4) s->h = sj_mix_h(s->h, sj_load_le32(p));
    for (; n; n--, s->total++) s->carry |= (uint32_t)*p++ << (8 * s->carry_len++);
}

static uint32_t mm_final(mm_state *s) {
    uint32_t h = s->h;
    if (s->carry_len) h ^= sj_mix_k(s->carry);
    return sj_fmix(h ^ s->total);
}

sj_status sj_hash_rows(const sj_column *cols, int32_t ncols, uint32_t seed, int32_t *out,
                       int64_t *err_index, int32_t *err_column) {
    int64_t rows = 0;
    *err_index = -1;
    sj_status checked = sj_key_columns_check(cols, ncols, &rows, err_column);
    if (checked != SJ_OK) return checked;
    for (int64_t i = 0; i < rows; i++) {
        mm_state s = {seed, 0, 0, 0};
        for (int32_t c = 0; c < ncols; c++) {
            sj_payload p;
            sj_status st = sj_payload_of(&cols[c], i, &p);
            if (st != SJ_OK) {
                *err_index = i;
                *err_column = c;
                return st;
            }
            mm_feed(&s, p.head, p.head_len);
            if (p.tail_len) mm_feed(&s, p.tail, p.tail_len);
        }
        out[i] = (int32_t)mm_final(&s);
    }
    return SJ_OK;
}
