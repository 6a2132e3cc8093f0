/* Deduplication state (sparkjet/dedup.h): open addressing with linear probing over
 * {key, passed} entries and a byte per bucket saying whether it is used (keys and times
 * may be any int64, so neither can mark an empty bucket). The load stays at most 1/2. */
#include <stdlib.h>
#include <string.h>

#include "sparkjet/dedup.h"

typedef struct {
    int64_t key, passed;
} entry;

struct sj_dedupmap {
    entry *entries;
    uint8_t *used;
    uint64_t mask; /* buckets - 1, a power of two */
    int64_t size;
};

static inline uint64_t mix64(uint64_t x) {
    /* splitmix64's finalizer: consecutive keys spread over all buckets. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t buckets_for(int64_t keys) {
    uint64_t buckets = 16;
    while (keys > 0 && buckets < (uint64_t)keys * 2) buckets <<= 1;
    return buckets;
}

static sj_status alloc_table(uint64_t buckets, entry **entries, uint8_t **used) {
    *entries = (entry *)malloc(sizeof(entry) * buckets);
    *used = (uint8_t *)calloc(buckets, 1);
    if (!*entries || !*used) {
        free(*entries);
        free(*used);
        return SJ_ENOMEM;
    }
    return SJ_OK;
}

sj_dedupmap *sj_dedupmap_new(int64_t expected) {
    sj_dedupmap *m = (sj_dedupmap *)calloc(1, sizeof *m);
    if (!m) return NULL;
    uint64_t buckets = buckets_for(expected);
    if (alloc_table(buckets, &m->entries, &m->used) != SJ_OK) {
        free(m);
        return NULL;
    }
    m->mask = buckets - 1;
    return m;
}

void sj_dedupmap_free(sj_dedupmap *m) {
    if (!m) return;
    free(m->entries);
    free(m->used);
    free(m);
}

int64_t sj_dedupmap_size(const sj_dedupmap *m) { return m->size; }

int64_t sj_dedupmap_live(const sj_dedupmap *m, int64_t limit) {
    int64_t live = 0;
    for (uint64_t b = 0; b <= m->mask; b++) live += m->used[b] && m->entries[b].passed >= limit;
    return live;
}

/* Moves the entries with passed >= limit into a table of `buckets` buckets. */
static sj_status rebuild(sj_dedupmap *m, uint64_t buckets, int64_t limit) {
    entry *entries;
    uint8_t *used;
    if (alloc_table(buckets, &entries, &used) != SJ_OK) return SJ_ENOMEM;
    uint64_t mask = buckets - 1;
    int64_t size = 0;
    for (uint64_t b = 0; b <= m->mask; b++) {
        if (!m->used[b] || m->entries[b].passed < limit) continue;
        uint64_t to = mix64((uint64_t)m->entries[b].key) & mask;
        while (used[to]) to = (to + 1) & mask;
        used[to] = 1;
        entries[to] = m->entries[b];
        size++;
    }
    free(m->entries);
    free(m->used);
    m->entries = entries;
    m->used = used;
    m->mask = mask;
    m->size = size;
    return SJ_OK;
}

/* Room for one more entry: first by dropping the evictable entries, then by growing. */
static sj_status make_room(sj_dedupmap *m, int64_t evict_below) {
    uint64_t buckets = m->mask + 1;
    if ((uint64_t)(m->size + 1) * 2 <= buckets) return SJ_OK;
    int64_t live = sj_dedupmap_live(m, evict_below);
    /* Keep the load at most 1/4 right after a rebuild, so rebuilds stay O(1) per insert. */
    return rebuild(m, buckets_for(2 * (live + 1)), evict_below);
}

/* How many rows ahead sj_dedupmap_process prefetches. */
enum { PREFETCH = 16 };

static inline int passes(int64_t t, int64_t passed, int64_t within) {
    int64_t due;
    if (__builtin_add_overflow(passed, within, &due)) return 0;
    return t >= due;
}

sj_status sj_dedupmap_process(sj_dedupmap *m, const int64_t *keys, const int64_t *times,
                              int64_t n, int64_t within, int64_t evict_below, uint8_t *keep,
                              int64_t *kept, int64_t *done) {
    int64_t count = 0;
    *kept = 0;
    *done = 0;
    if (within < 0) return SJ_EINVAL;
    for (int64_t i = 0; i < n; i++) {
        int64_t key = keys[i], t = times[i];
        if (i + PREFETCH < n) {
            /* The bucket of a row a little ahead: its cache lines arrive while this row
             * is decided (the table is larger than the caches for many live keys). */
            uint64_t ahead = mix64((uint64_t)keys[i + PREFETCH]) & m->mask;
            __builtin_prefetch(&m->used[ahead]);
            __builtin_prefetch(&m->entries[ahead]);
        }
        uint64_t b = mix64((uint64_t)key) & m->mask;
        while (m->used[b] && m->entries[b].key != key) b = (b + 1) & m->mask;
        if (m->used[b]) {
            entry *e = &m->entries[b];
            if (e->passed < evict_below || passes(t, e->passed, within)) {
                e->passed = t;
                keep[i] = 1;
                count++;
            } else {
                keep[i] = 0;
            }
        } else {
            if ((uint64_t)(m->size + 1) * 2 > m->mask + 1) {
                sj_status st = make_room(m, evict_below);
                if (st != SJ_OK) {
                    *kept = count;
                    *done = i;
                    return st;
                }
                b = mix64((uint64_t)key) & m->mask;
                while (m->used[b]) b = (b + 1) & m->mask;
            }
            m->used[b] = 1;
            m->entries[b].key = key;
            m->entries[b].passed = t;
            m->size++;
            keep[i] = 1;
            count++;
        }
    }
    *kept = count;
    *done = n;
    return SJ_OK;
}

sj_status sj_dedupmap_evict(sj_dedupmap *m, int64_t limit) {
    int64_t live = sj_dedupmap_live(m, limit);
    if (live == m->size) return SJ_OK;
    uint64_t buckets = m->mask + 1, smaller = buckets_for(2 * live);
    return rebuild(m, smaller < buckets ? smaller : buckets, limit);
}

int64_t sj_dedupmap_export(const sj_dedupmap *m, int64_t limit, int64_t *keys, int64_t *passed,
                           int64_t cap) {
    int64_t k = 0;
    for (uint64_t b = 0; b <= m->mask && k < cap; b++) {
        if (!m->used[b] || m->entries[b].passed < limit) continue;
        keys[k] = m->entries[b].key;
        passed[k] = m->entries[b].passed;
        k++;
    }
    return k;
}

sj_status sj_dedupmap_insert(sj_dedupmap *m, const int64_t *keys, const int64_t *passed,
                             int64_t n, int64_t *done) {
    *done = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t key = keys[i];
        uint64_t b = mix64((uint64_t)key) & m->mask;
        while (m->used[b] && m->entries[b].key != key) b = (b + 1) & m->mask;
        if (m->used[b]) {
            if (passed[i] > m->entries[b].passed) m->entries[b].passed = passed[i];
            continue;
        }
        if ((uint64_t)(m->size + 1) * 2 > m->mask + 1) {
            /* INT64_MIN as the limit: a restore drops nothing (no passed time is below it). */
            sj_status st = rebuild(m, (m->mask + 1) * 2, INT64_MIN);
            if (st != SJ_OK) {
                *done = i;
                return st;
            }
            b = mix64((uint64_t)key) & m->mask;
            while (m->used[b]) b = (b + 1) & m->mask;
        }
        m->used[b] = 1;
        m->entries[b].key = key;
        m->entries[b].passed = passed[i];
        m->size++;
    }
    *done = n;
    return SJ_OK;
}
