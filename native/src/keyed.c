/* An open-addressing (linear probing) hash map from int64 keys to dense slots,
 * and the aggregate kernels of rolling keyed aggregations. */
#include <stdlib.h>
#include <string.h>

#include "sparkjet/keyed.h"

struct sj_keymap {
    int64_t *table; /* slot + 1 per bucket, 0 when empty */
    uint64_t mask;  /* buckets - 1, a power of two */
    int64_t *keys;  /* dense, by slot */
    int64_t size, keys_cap;
};

static inline uint64_t mix64(uint64_t x) {
    /* splitmix64's finalizer: consecutive keys spread over all buckets. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

sj_keymap *sj_keymap_new(int64_t expected) {
    sj_keymap *m = (sj_keymap *)calloc(1, sizeof *m);
    if (!m) return NULL;
    uint64_t buckets = 16;
    while (expected > 0 && buckets < (uint64_t)expected * 2) buckets <<= 1;
    m->table = (int64_t *)calloc(buckets, sizeof(int64_t));
    m->keys_cap = (int64_t)(buckets / 2);
    m->keys = (int64_t *)malloc(sizeof(int64_t) * (size_t)m->keys_cap);
    if (!m->table || !m->keys) {
        sj_keymap_free(m);
        return NULL;
    }
    m->mask = buckets - 1;
    return m;
}

void sj_keymap_free(sj_keymap *m) {
    if (!m) return;
    free(m->table);
    free(m->keys);
    free(m);
}

int64_t sj_keymap_size(const sj_keymap *m) { return m->size; }

const int64_t *sj_keymap_keys(const sj_keymap *m) { return m->keys; }

/* Doubles the buckets (keeping the load at most 1/2) and rehashes from the dense keys. */
static sj_status grow(sj_keymap *m) {
    uint64_t buckets = (m->mask + 1) * 2;
    int64_t *table = (int64_t *)calloc(buckets, sizeof(int64_t));
    int64_t *keys = (int64_t *)realloc(m->keys, sizeof(int64_t) * (size_t)(buckets / 2));
    if (!table || !keys) {
        free(table);
        if (keys) m->keys = keys;
        return SJ_ENOMEM;
    }
    m->keys = keys;
    m->keys_cap = (int64_t)(buckets / 2);
    uint64_t mask = buckets - 1;
    for (int64_t s = 0; s < m->size; s++) {
        uint64_t b = mix64((uint64_t)m->keys[s]) & mask;
        while (table[b]) b = (b + 1) & mask;
        table[b] = s + 1;
    }
    free(m->table);
    m->table = table;
    m->mask = mask;
    return SJ_OK;
}

sj_status sj_keymap_upsert(sj_keymap *m, const int64_t *keys, int64_t n, int64_t *slots) {
    for (int64_t i = 0; i < n; i++) {
        int64_t key = keys[i];
        uint64_t b = mix64((uint64_t)key) & m->mask;
        int64_t e;
        while ((e = m->table[b]) && m->keys[e - 1] != key) b = (b + 1) & m->mask;
        if (e) {
            slots[i] = e - 1;
            continue;
        }
        if (m->size + 1 > m->keys_cap) {
            if (grow(m) != SJ_OK) return SJ_ENOMEM;
            b = mix64((uint64_t)key) & m->mask;
            while (m->table[b]) b = (b + 1) & m->mask;
        }
        m->keys[m->size] = key;
        m->table[b] = ++m->size;
        slots[i] = m->size - 1;
    }
    return SJ_OK;
}

void sj_keymap_lookup(const sj_keymap *m, const int64_t *keys, int64_t n, int64_t *slots) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t b = mix64((uint64_t)keys[i]) & m->mask;
        int64_t e;
        while ((e = m->table[b]) && m->keys[e - 1] != keys[i]) b = (b + 1) & m->mask;
        slots[i] = e - 1;
    }
}

void sj_agg_count(const int64_t *slots, int64_t n, int64_t *counts) {
    for (int64_t i = 0; i < n; i++) counts[slots[i]]++;
}

void sj_agg_sum(const int64_t *slots, const double *values, int64_t n, double *sums) {
    for (int64_t i = 0; i < n; i++) sums[slots[i]] += values[i];
}

/* A NaN is taken and then kept (v != v holds for NaN alone; nothing compares below or
 * above it): a NaN makes min and max NaN, as it makes sum and mean NaN. */
void sj_agg_min(const int64_t *slots, const double *values, int64_t n, double *mins) {
    for (int64_t i = 0; i < n; i++) {
        double v = values[i];
        if (v < mins[slots[i]] || v != v) mins[slots[i]] = v;
    }
}

void sj_agg_max(const int64_t *slots, const double *values, int64_t n, double *maxs) {
    for (int64_t i = 0; i < n; i++) {
        double v = values[i];
        if (v > maxs[slots[i]] || v != v) maxs[slots[i]] = v;
    }
}

sj_status sj_agg_sum_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *sums,
                         int64_t *err_index) {
    *err_index = -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t sum;
        if (!__builtin_add_overflow(sums[slots[i]], values[i], &sum)) {
            sums[slots[i]] = sum;
        } else {
            /* Undo the rows before, last first: every sum passes back through the
             * values it held, so no subtraction overflows. */
            for (int64_t j = i - 1; j >= 0; j--) sums[slots[j]] -= values[j];
            *err_index = i;
            return SJ_ERANGE;
        }
    }
    return SJ_OK;
}

void sj_agg_min_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *mins) {
    for (int64_t i = 0; i < n; i++)
        if (values[i] < mins[slots[i]]) mins[slots[i]] = values[i];
}

void sj_agg_max_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *maxs) {
    for (int64_t i = 0; i < n; i++)
        if (values[i] > maxs[slots[i]]) maxs[slots[i]] = values[i];
}

void sj_agg_first(const int64_t *slots, const double *values, int64_t n, double *firsts,
                  uint8_t *seen) {
    for (int64_t i = 0; i < n; i++)
        if (!seen[slots[i]]) {
            firsts[slots[i]] = values[i];
            seen[slots[i]] = 1;
        }
}

void sj_agg_last(const int64_t *slots, const double *values, int64_t n, double *lasts) {
    for (int64_t i = 0; i < n; i++) lasts[slots[i]] = values[i];
}

void sj_agg_first_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *firsts,
                      uint8_t *seen) {
    for (int64_t i = 0; i < n; i++)
        if (!seen[slots[i]]) {
            firsts[slots[i]] = values[i];
            seen[slots[i]] = 1;
        }
}

void sj_agg_last_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *lasts) {
    for (int64_t i = 0; i < n; i++) lasts[slots[i]] = values[i];
}

/* (GCC and Clang's 128-bit integers; __extension__ keeps -pedantic quiet under C99.) */
__extension__ typedef __int128 sj_i128;
__extension__ typedef unsigned __int128 sj_u128;

static inline sj_i128 load_i128(const int64_t *p) {
    return (sj_i128)(((sj_u128)(uint64_t)p[1] << 64) | (sj_u128)(uint64_t)p[0]);
}

static inline void store_i128(int64_t *p, sj_i128 v) {
    p[0] = (int64_t)(uint64_t)(sj_u128)v;
    p[1] = (int64_t)(uint64_t)((sj_u128)v >> 64);
}

sj_status sj_agg_sum_i128(const int64_t *slots, const int64_t *values, int wide, int64_t n,
                          int64_t *sums, int64_t *err_index) {
    /* 10^38 - 1: the largest decimal128(38, 0). Every sum and value stays within
     * +-(10^38 - 1) < 2^127, so no addition below overflows sj_i128 itself. */
    const sj_i128 limit = (sj_i128)10000000000000000000ull * (sj_i128)10000000000000000000ull - 1;
    *err_index = -1;
    for (int64_t i = 0; i < n; i++) {
        sj_i128 v = wide ? load_i128(values + 2 * i) : (sj_i128)values[i];
        sj_i128 sum;
        if (v <= limit && v >= -limit) {
            sum = load_i128(sums + 2 * slots[i]) + v;
            if (sum <= limit && sum >= -limit) {
                store_i128(sums + 2 * slots[i], sum);
                continue;
            }
        }
        for (int64_t j = i - 1; j >= 0; j--) {
            sj_i128 u = wide ? load_i128(values + 2 * j) : (sj_i128)values[j];
            store_i128(sums + 2 * slots[j], load_i128(sums + 2 * slots[j]) - u);
        }
        *err_index = i;
        return SJ_ERANGE;
    }
    return SJ_OK;
}

void sj_distinct_slots(const int64_t *slots, int64_t n, uint8_t *marks, int64_t *out,
                       int64_t *count) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!marks[slots[i]]) {
            marks[slots[i]] = 1;
            out[k++] = slots[i];
        }
    }
    for (int64_t j = 0; j < k; j++) marks[out[j]] = 0;
    *count = k;
}
