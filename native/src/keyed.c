/* An open-addressing (linear probing) hash map from int64 keys to dense slots,
 * and the aggregate kernels of rolling keyed aggregations. */
/* (posix_memalign and madvise are POSIX/BSD, not C99) */
#define _DEFAULT_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "sparkjet/keyed.h"

/* The most keys a map holds, 2^32 - 2 (a bucket holds slot + 1 in 32 bits; 4 billion keys
 * are 32 GiB of keys alone); past it, SJ_ENOMEM. 32-bit buckets halve the table a
 * restore fills: at 23.5M keys 256 instead of 512 MB of fresh pages to fault in, and the
 * bulk insert of a snapshot's keys took 0.94-1.06 s instead of 1.14-2.36 s. */
#define MAX_KEYS ((int64_t)UINT32_MAX - 1)
/* Tables this big are asked to be backed by huge pages. */
#define HUGE_TABLE ((size_t)2 << 20)

struct sj_keymap {
    uint32_t *table; /* slot + 1 per bucket, 0 when empty */
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

/* The buckets for `keys` keys at a load of at most 1/2: a power of two, at least 16. */
static uint64_t buckets_for(int64_t keys) {
    uint64_t buckets = 16;
    while (keys > 0 && buckets < (uint64_t)keys * 2) buckets <<= 1;
    return buckets;
}

/* n int64s, not zeroed. An array of 2 MiB or more is aligned to 2 MiB and asked to be
 * backed by huge pages (where the kernel leaves that to madvise): fresh 4 KiB pages cost a
 * fault each (~10 us on a VM), and over hundreds of MB of them random probes miss the TLB
 * on nearly every key. Freed with free(). */
static int64_t *big_alloc(uint64_t n) {
    size_t bytes = (size_t)n * sizeof(int64_t);
    if (bytes < HUGE_TABLE) return (int64_t *)malloc(bytes ? bytes : 8);
    void *p = NULL;
    if (posix_memalign(&p, HUGE_TABLE, bytes) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice only: 4 KiB pages work too */
#endif
    return (int64_t *)p;
}

/* A zeroed bucket table. A big one is mapped afresh (the kernel hands out zeroed pages,
 * so it is not zeroed twice) and asked to be backed by huge pages; table_free unmaps it. */
static uint32_t *table_alloc(uint64_t buckets) {
    size_t bytes = (size_t)buckets * sizeof(uint32_t);
    if (bytes < HUGE_TABLE) return (uint32_t *)calloc(buckets, sizeof(uint32_t));
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return (uint32_t *)p;
}

static void table_free(uint32_t *table, uint64_t buckets) {
    size_t bytes = (size_t)buckets * sizeof(uint32_t);
    if (!table) return;
    if (bytes < HUGE_TABLE) free(table);
    else munmap(table, bytes);
}

sj_keymap *sj_keymap_new(int64_t expected) {
    if (expected > MAX_KEYS) return NULL;
    sj_keymap *m = (sj_keymap *)calloc(1, sizeof *m);
    if (!m) return NULL;
    uint64_t buckets = buckets_for(expected);
    m->mask = buckets - 1;
    m->table = table_alloc(buckets);
    m->keys_cap = (int64_t)(buckets / 2);
    m->keys = big_alloc((uint64_t)m->keys_cap);
    if (!m->table || !m->keys) {
        sj_keymap_free(m);
        return NULL;
    }
    return m;
}

void sj_keymap_free(sj_keymap *m) {
    if (!m) return;
    table_free(m->table, m->mask + 1);
    free(m->keys);
    free(m);
}

int64_t sj_keymap_size(const sj_keymap *m) { return m->size; }

const int64_t *sj_keymap_keys(const sj_keymap *m) { return m->keys; }

/* `buckets` buckets (more than now), rehashed from the dense keys; SJ_ENOMEM leaves the
 * map as it was. */
static sj_status resize(sj_keymap *m, uint64_t buckets) {
    uint32_t *table = table_alloc(buckets);
    int64_t *keys = big_alloc(buckets / 2);
    if (!table || !keys) {
        table_free(table, buckets);
        free(keys);
        return SJ_ENOMEM;
    }
    if (m->size) memcpy(keys, m->keys, sizeof(int64_t) * (size_t)m->size);
    free(m->keys);
    m->keys = keys;
    m->keys_cap = (int64_t)(buckets / 2);
    uint64_t mask = buckets - 1;
    for (int64_t s = 0; s < m->size; s++) {
        uint64_t b = mix64((uint64_t)m->keys[s]) & mask;
        while (table[b]) b = (b + 1) & mask;
        table[b] = (uint32_t)(s + 1);
    }
    table_free(m->table, m->mask + 1);
    m->table = table;
    m->mask = mask;
    return SJ_OK;
}

/* Doubles the buckets (keeping the load at most 1/2). */
static sj_status grow(sj_keymap *m) {
    if (m->keys_cap >= MAX_KEYS) return SJ_ENOMEM;
    return resize(m, (m->mask + 1) * 2);
}

sj_status sj_keymap_reserve(sj_keymap *m, int64_t total) {
    if (total < 0) return SJ_EINVAL;
    if (total <= m->keys_cap) return SJ_OK;
    if (total > MAX_KEYS) return SJ_ENOMEM;
    return resize(m, buckets_for(total));
}

/* Upserts into a map with room for every key (nothing grows), fetching ahead, in two
 * stages, the bucket of the key AHEAD rows on and the stored key that the bucket of the
 * key AHEAD/2 rows on points to (a probe compares it): enough misses in flight to cover
 * memory latency, few enough to stay in L1. (Measured at 10M distinct keys: 3-4x faster
 * than inserting key by key with growth; inserting by region of home bucket, to keep each
 * region in cache, was slower than this.) */
static void upsert_prefetched(sj_keymap *m, const int64_t *keys, int64_t n, int64_t *slots) {
    enum { AHEAD = 16 };
    const uint64_t mask = m->mask;
    uint32_t *table = m->table;
    int64_t *dense = m->keys;
    int64_t size = m->size;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&table[mix64((uint64_t)keys[i + AHEAD]) & mask], 1);
        if (i + AHEAD / 2 < n) {
            /* its bucket is cached by now: fetch the key it holds, which the probe reads */
            uint32_t f = table[mix64((uint64_t)keys[i + AHEAD / 2]) & mask];
            if (f) __builtin_prefetch(&dense[f - 1], 0);
        }
        int64_t key = keys[i];
        uint64_t b = mix64((uint64_t)key) & mask;
        uint32_t e;
        while ((e = table[b]) && dense[e - 1] != key) b = (b + 1) & mask;
        if (e) {
            slots[i] = (int64_t)e - 1;
            continue;
        }
        dense[size] = key;
        table[b] = (uint32_t)++size;
        slots[i] = size - 1;
    }
    m->size = size;
}

sj_status sj_keymap_upsert_bulk(sj_keymap *m, const int64_t *keys, int64_t n, int64_t *slots) {
    if (n < 0) return SJ_EINVAL;
    if (n > MAX_KEYS - m->size) return SJ_ENOMEM;
    sj_status st = sj_keymap_reserve(m, m->size + n);
    if (st != SJ_OK) return st;
    upsert_prefetched(m, keys, n, slots);
    return SJ_OK;
}

sj_status sj_keymap_upsert(sj_keymap *m, const int64_t *keys, int64_t n, int64_t *slots) {
    for (int64_t i = 0; i < n; i++) {
        int64_t key = keys[i];
        uint64_t b = mix64((uint64_t)key) & m->mask;
        uint32_t e;
        while ((e = m->table[b]) && m->keys[e - 1] != key) b = (b + 1) & m->mask;
        if (e) {
            slots[i] = (int64_t)e - 1;
            continue;
        }
        if (m->size >= MAX_KEYS) return SJ_ENOMEM;
        if (m->size + 1 > m->keys_cap) {
            if (grow(m) != SJ_OK) return SJ_ENOMEM;
            b = mix64((uint64_t)key) & m->mask;
            while (m->table[b]) b = (b + 1) & m->mask;
        }
        m->keys[m->size] = key;
        m->table[b] = (uint32_t)++m->size;
        slots[i] = m->size - 1;
    }
    return SJ_OK;
}

void sj_keymap_lookup(const sj_keymap *m, const int64_t *keys, int64_t n, int64_t *slots) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t b = mix64((uint64_t)keys[i]) & m->mask;
        uint32_t e;
        while ((e = m->table[b]) && m->keys[e - 1] != keys[i]) b = (b + 1) & m->mask;
        slots[i] = (int64_t)e - 1;
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
