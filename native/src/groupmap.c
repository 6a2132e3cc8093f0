/* The group map: open addressing (linear probing) over 16-byte buckets that hold
 * a key's 64-bit hash and a reference to the key, and an arena of key records.
 *
 * A call runs in two passes. The first reads and checks every row and writes its
 * hash into the caller's slots array, so bad input is refused before anything is
 * inserted and no scratch memory is needed; the second probes the table and
 * overwrites each hash with the slot. Keys of at most 8 bytes of integers ("word"
 * keys: one Integer or Long, two Integers) hash through a bijection, so equal
 * hashes mean equal keys: their buckets hold the slot, a probe never reads the
 * arena, and the arena holds their bytes back to back. Other keys compare their
 * payloads piece by piece with the stored bytes: their buckets hold the offset
 * of the key's record (slot, length, bytes), so a hit reads one bucket and one
 * record. Both are prefetched some rows ahead (the
 * bucket first, then the record it points to), which keeps several cache misses
 * in flight once the map outgrows the cache. The hash is sparkjet's own, never
 * stored or sent anywhere, and chosen for speed: Hazelcast's murmur is needed
 * for partitions, not for a table. */
#include <stdlib.h>
#include <string.h>

#include "payload.h"
#include "sparkjet/groupmap.h"

/* What a column's payload is: the part of a key's type the map must keep. */
enum { PT_INTEGER = 1, PT_LONG = 2, PT_BYTES = 3 };

/* Rows between a bucket's prefetch and its probe; a record is prefetched half as
 * far ahead, once its bucket has had time to arrive. */
#define PREFETCH_AHEAD 16

/* A key record in the arena: its slot and length, then its bytes. */
#define RECORD_HEADER 16

typedef struct bucket {
    uint64_t hash;
    int64_t ref; /* 0: empty; word keys: slot + 1; others: record offset + 1 */
} bucket;

struct sj_groupmap {
    bucket *table;
    uint64_t mask;    /* buckets - 1, a power of two */
    int64_t size;     /* keys */
    int64_t cap;      /* keys before the table grows: half its buckets */
    int64_t *records; /* the record offset of each slot (cap of them; not for word keys) */
    uint8_t *arena;
    int64_t arena_used, arena_cap;
    int32_t ncols;  /* 0 until the first upsert fixes the payload types */
    uint8_t *types; /* PT_* per column */
    int word;       /* keys are word keys (see above) */
    int64_t width;  /* the bytes of a word key */
};

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* splitmix64's finalizer: a bijection of 64-bit words that spreads every bit. */
static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* xxHash64's round, one 64-bit word into the running hash. */
static inline uint64_t round64(uint64_t h, uint64_t w) {
    return rotl64(h + w * 0xc2b2ae3d27d4eb4full, 31) * 0x9e3779b97f4a7c15ull;
}

/* n bytes into the hash. The length is already in it (a payload's prefix), so the
 * last word may overlap the one before and short tails need no padding rule. */
static inline uint64_t hash_span(uint64_t h, const uint8_t *p, uint32_t n) {
    if (n >= 8) {
        const uint8_t *last = p + n - 8;
        for (; p < last; p += 8) h = round64(h, load64(p));
        return round64(h, load64(last));
    }
    if (n >= 4) return round64(h, load32(p) << 32 | load32(p + n - 4));
    if (n) return round64(h, (uint64_t)p[0] << 16 | (uint64_t)p[n >> 1] << 8 | p[n - 1]);
    return h;
}

static inline int payload_type(int32_t kind) {
    switch (kind) {
    case SJ_KEY_INT32:
    case SJ_KEY_INT64_AS_INT32: return PT_INTEGER;
    case SJ_KEY_INT64: return PT_LONG;
    default: return PT_BYTES;
    }
}

/* Whether columns of these kinds make word keys. */
static int is_word(const sj_column *cols, int32_t ncols) {
    int bytes = 0;
    for (int32_t c = 0; c < ncols; c++) {
        int t = payload_type(cols[c].kind);
        if (t == PT_BYTES) return 0;
        bytes += t == PT_LONG ? 8 : 4;
        if (bytes > 8) return 0;
    }
    return 1;
}

/* An Integer column's value i as its 32 bits (range checked by the caller). */
static inline uint32_t integer_at(const sj_column *col, int64_t i) {
    int64_t k = col->offset + i;
    if (col->kind == SJ_KEY_INT32) return (uint32_t)((const int32_t *)col->values)[k];
    return (uint32_t)((const int64_t *)col->values)[k];
}

/* A word key: its payload bytes read as one big-endian number. */
static inline uint64_t word_at(const sj_column *cols, int32_t ncols, int64_t i) {
    if (cols[0].kind == SJ_KEY_INT64)
        return (uint64_t)((const int64_t *)cols[0].values)[cols[0].offset + i];
    uint64_t w = integer_at(&cols[0], i);
    return ncols == 2 ? w << 32 | integer_at(&cols[1], i) : w;
}

static inline int64_t word_bytes(const sj_column *cols, int32_t ncols) {
    return ncols == 2 || cols[0].kind == SJ_KEY_INT64 ? 8 : 4;
}

/* Row i's payloads, one per column. */
static inline sj_status row_payloads(const sj_column *cols, int32_t ncols, int64_t i,
                                     sj_payload *pl, int32_t *err_column) {
    for (int32_t c = 0; c < ncols; c++) {
        sj_status st = sj_payload_of(&cols[c], i, &pl[c]);
        if (st != SJ_OK) {
            *err_column = c;
            return st;
        }
    }
    return SJ_OK;
}

static inline uint64_t payloads_hash(const sj_payload *pl, int32_t ncols) {
    uint64_t h = (uint64_t)ncols;
    for (int32_t c = 0; c < ncols; c++) {
        h = round64(h, pl[c].head_len == 8 ? load64(pl[c].head) : load32(pl[c].head));
        h = hash_span(h, pl[c].tail, pl[c].tail_len);
    }
    return mix64(h);
}

/* First pass: every row checked and hashed into out (the caller's slots). */
static sj_status hash_all(const sj_column *cols, int32_t ncols, int word, int64_t rows,
                          sj_payload *pl, int64_t *out, int64_t *err_index,
                          int32_t *err_column) {
    if (word) {
        for (int32_t c = 0; c < ncols; c++) {
            if (cols[c].kind != SJ_KEY_INT64_AS_INT32) continue;
            const int64_t *v = (const int64_t *)cols[c].values + cols[c].offset;
            for (int64_t i = 0; i < rows; i++) {
                if (v[i] != (int64_t)(int32_t)v[i]) {
                    *err_index = i;
                    *err_column = c;
                    return SJ_ERANGE;
                }
            }
        }
        if (ncols == 1 && cols[0].kind == SJ_KEY_INT64) {
            const int64_t *v = (const int64_t *)cols[0].values + cols[0].offset;
            for (int64_t i = 0; i < rows; i++) out[i] = (int64_t)mix64((uint64_t)v[i]);
        } else {
            for (int64_t i = 0; i < rows; i++) out[i] = (int64_t)mix64(word_at(cols, ncols, i));
        }
        return SJ_OK;
    }
    for (int64_t i = 0; i < rows; i++) {
        sj_status st = row_payloads(cols, ncols, i, pl, err_column);
        if (st != SJ_OK) {
            *err_index = i;
            return st;
        }
        out[i] = (int64_t)payloads_hash(pl, ncols);
    }
    return SJ_OK;
}

static inline int64_t load_i64(const uint8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Whether the record at arena offset r holds exactly these payloads. */
static int key_equals(const sj_groupmap *m, int64_t r, const sj_payload *pl, int32_t ncols) {
    const uint8_t *k = m->arena + r + RECORD_HEADER;
    const uint8_t *end = k + load_i64(m->arena + r + 8);
    for (int32_t c = 0; c < ncols; c++) {
        if (end - k < (int64_t)pl[c].head_len + pl[c].tail_len) return 0;
        if (memcmp(k, pl[c].head, pl[c].head_len) != 0) return 0;
        k += pl[c].head_len;
        if (pl[c].tail_len && memcmp(k, pl[c].tail, pl[c].tail_len) != 0) return 0;
        k += pl[c].tail_len;
    }
    return k == end;
}

/* `buckets` buckets (more than now), rehashed from the stored hashes; SJ_ENOMEM leaves
 * the map as it was (the record offsets may have grown, which changes nothing). */
static sj_status resize_table(sj_groupmap *m, uint64_t buckets) {
    if (buckets > (uint64_t)INT64_MAX / sizeof(bucket)) return SJ_ENOMEM;
    int64_t cap = (int64_t)(buckets / 2);
    if (!m->word) {
        int64_t *records = (int64_t *)realloc(m->records, sizeof(int64_t) * (size_t)cap);
        if (!records) return SJ_ENOMEM;
        m->records = records;
    }
    bucket *table = (bucket *)calloc(buckets, sizeof(bucket));
    if (!table) return SJ_ENOMEM;
    uint64_t mask = buckets - 1;
    for (uint64_t b = 0; b <= m->mask; b++) {
        if (!m->table[b].ref) continue;
        uint64_t t = m->table[b].hash & mask;
        while (table[t].ref) t = (t + 1) & mask;
        table[t] = m->table[b];
    }
    free(m->table);
    m->table = table;
    m->mask = mask;
    m->cap = cap;
    return SJ_OK;
}

/* Twice the buckets. */
static sj_status grow_table(sj_groupmap *m) { return resize_table(m, (m->mask + 1) * 2); }

sj_status sj_groupmap_reserve(sj_groupmap *m, int64_t total) {
    if (total < 0) return SJ_EINVAL;
    if (total <= m->cap) return SJ_OK;
    if (total > ((int64_t)1 << 40)) return SJ_ENOMEM;
    uint64_t buckets = (m->mask + 1) * 2;
    while (buckets < (uint64_t)total * 2) buckets <<= 1;
    return resize_table(m, buckets);
}

/* Room for `bytes` more in the arena. */
static sj_status reserve_arena(sj_groupmap *m, int64_t bytes) {
    if (bytes <= m->arena_cap - m->arena_used) return SJ_OK;
    if (bytes > INT64_MAX / 2 - m->arena_used) return SJ_ENOMEM;
    int64_t cap = m->arena_cap ? m->arena_cap : 256;
    while (cap - m->arena_used < bytes) cap *= 2;
    uint8_t *arena = (uint8_t *)realloc(m->arena, (size_t)cap);
    if (!arena) return SJ_ENOMEM;
    m->arena = arena;
    m->arena_cap = cap;
    return SJ_OK;
}

/* Adds a key of `bytes` bytes with hash h at bucket b (found empty by a probe):
 * returns where its bytes go, or NULL (SJ_ENOMEM) with the map unchanged. */
static uint8_t *insert(sj_groupmap *m, uint64_t h, uint64_t b, int64_t bytes) {
    if (m->size == m->cap) {
        if (grow_table(m) != SJ_OK) return NULL;
        b = h & m->mask;
        while (m->table[b].ref) b = (b + 1) & m->mask;
    }
    int64_t r = m->arena_used, slot = m->size;
    if (reserve_arena(m, m->word ? bytes : RECORD_HEADER + bytes) != SJ_OK) return NULL;
    uint8_t *at = m->arena + r;
    m->size++;
    m->table[b].hash = h;
    if (m->word) {
        m->table[b].ref = slot + 1;
        m->arena_used += bytes;
        return at;
    }
    memcpy(at, &slot, 8);
    memcpy(at + 8, &bytes, 8);
    m->arena_used += RECORD_HEADER + bytes;
    m->records[slot] = r;
    m->table[b].ref = r + 1;
    return at + RECORD_HEADER;
}

sj_groupmap *sj_groupmap_new(int64_t expected) {
    sj_groupmap *m = (sj_groupmap *)calloc(1, sizeof *m);
    if (!m) return NULL;
    uint64_t buckets = 16;
    while (expected > 0 && buckets < (uint64_t)expected * 2 && buckets < ((uint64_t)1 << 40))
        buckets <<= 1;
    m->mask = buckets - 1;
    m->cap = (int64_t)(buckets / 2);
    m->table = (bucket *)calloc(buckets, sizeof(bucket));
    if (!m->table) {
        sj_groupmap_free(m);
        return NULL;
    }
    return m;
}

void sj_groupmap_free(sj_groupmap *m) {
    if (!m) return;
    free(m->table);
    free(m->records);
    free(m->arena);
    free(m->types);
    free(m);
}

int64_t sj_groupmap_size(const sj_groupmap *m) { return m->size; }

sj_status sj_groupmap_key(const sj_groupmap *m, int64_t slot, const uint8_t **bytes,
                          int64_t *len) {
    if (slot < 0 || slot >= m->size) return SJ_EINVAL;
    if (m->word) {
        *bytes = m->arena + slot * m->width;
        *len = m->width;
        return SJ_OK;
    }
    const uint8_t *record = m->arena + m->records[slot];
    *bytes = record + RECORD_HEADER;
    *len = load_i64(record + 8);
    return SJ_OK;
}

/* The columns checked, and their payload types against the map's (once it has some). */
static sj_status check_columns(const sj_groupmap *m, const sj_column *cols, int32_t ncols,
                               int64_t *rows, int64_t *err_index, int32_t *err_column) {
    *err_index = -1;
    sj_status st = sj_key_columns_check(cols, ncols, rows, err_column);
    if (st != SJ_OK || !m->ncols) return st;
    if (ncols != m->ncols) return SJ_EINVAL;
    for (int32_t c = 0; c < ncols; c++) {
        if (payload_type(cols[c].kind) != m->types[c]) {
            *err_column = c;
            return SJ_EINVAL;
        }
    }
    return SJ_OK;
}

static sj_status fix_types(sj_groupmap *m, const sj_column *cols, int32_t ncols) {
    m->types = (uint8_t *)malloc((size_t)ncols);
    if (!m->types) return SJ_ENOMEM;
    for (int32_t c = 0; c < ncols; c++) m->types[c] = (uint8_t)payload_type(cols[c].kind);
    m->word = is_word(cols, ncols);
    if (m->word) {
        m->width = word_bytes(cols, ncols);
    } else {
        /* Record offsets from now on (word keys need none). */
        m->records = (int64_t *)malloc(sizeof(int64_t) * (size_t)m->cap);
        if (!m->records) {
            free(m->types);
            m->types = NULL;
            return SJ_ENOMEM;
        }
    }
    m->ncols = ncols;
    return SJ_OK;
}

/* Row i's slot, or -1 with *b the empty bucket where its key would go. The
 * row's payloads are read into pl only to compare with a stored key whose hash
 * matches (never for word keys); *have says whether they were. */
static inline int64_t probe(const sj_groupmap *m, uint64_t h, const sj_column *cols,
                            int32_t ncols, int64_t i, sj_payload *pl, int *have, uint64_t *b,
                            sj_status *st, int32_t *err_column) {
    int64_t ref;
    uint64_t at = h & m->mask;
    for (; (ref = m->table[at].ref) != 0; at = (at + 1) & m->mask) {
        if (m->table[at].hash != h) continue;
        if (m->word) return ref - 1;
        if (!*have) {
            /* Checked in the first pass: fails only if the input changed since. */
            *st = row_payloads(cols, ncols, i, pl, err_column);
            if (*st != SJ_OK) return -1;
            *have = 1;
        }
        if (key_equals(m, ref - 1, pl, ncols)) return load_i64(m->arena + ref - 1);
    }
    *b = at;
    return -1;
}

/* The key bytes of row i into a new entry at bucket b. */
static sj_status add_row(sj_groupmap *m, uint64_t h, uint64_t b, const sj_column *cols,
                         int32_t ncols, int64_t i, sj_payload *pl, int have,
                         int32_t *err_column) {
    uint8_t *at;
    if (m->word) {
        int64_t bytes = m->width;
        if (!(at = insert(m, h, b, bytes))) return SJ_ENOMEM;
        uint64_t w = word_at(cols, ncols, i);
        if (bytes == 8) sj_put_be32(at, (uint32_t)(w >> 32));
        sj_put_be32(at + bytes - 4, (uint32_t)w);
        return SJ_OK;
    }
    if (!have) {
        sj_status st = row_payloads(cols, ncols, i, pl, err_column);
        if (st != SJ_OK) return st;
    }
    int64_t bytes = 0;
    for (int32_t c = 0; c < ncols; c++) bytes += pl[c].head_len + (int64_t)pl[c].tail_len;
    if (!(at = insert(m, h, b, bytes))) return SJ_ENOMEM;
    for (int32_t c = 0; c < ncols; c++) {
        memcpy(at, pl[c].head, pl[c].head_len);
        at += pl[c].head_len;
        if (pl[c].tail_len) memcpy(at, pl[c].tail, pl[c].tail_len);
        at += pl[c].tail_len;
    }
    return SJ_OK;
}

/* Prefetches the bucket of row i + PREFETCH_AHEAD, and the record the home
 * bucket of row i + PREFETCH_AHEAD / 2 points to if its hash matches. A macro:
 * GCC takes a static function that only prefetches for one without effects and
 * drops the calls. */
#define PREFETCH(m, slots, i, rows)                                                     \
    do {                                                                                \
        if ((i) + PREFETCH_AHEAD < (rows))                                              \
            __builtin_prefetch(                                                         \
                &(m)->table[(uint64_t)(slots)[(i) + PREFETCH_AHEAD] & (m)->mask]);      \
        if (!(m)->word && (i) + PREFETCH_AHEAD / 2 < (rows)) {                          \
            uint64_t ahead_ = (uint64_t)(slots)[(i) + PREFETCH_AHEAD / 2];              \
            const bucket *home_ = &(m)->table[ahead_ & (m)->mask];                      \
            if (home_->ref && home_->hash == ahead_)                                    \
                __builtin_prefetch((m)->arena + home_->ref - 1);                        \
        }                                                                               \
    } while (0)

/* Second pass of an upsert: slots[i] holds row i's hash on entry, its slot on return. */
static sj_status upsert_rows(sj_groupmap *m, const sj_column *cols, int32_t ncols, int64_t rows,
                             sj_payload *pl, int64_t *slots, int64_t *first_rows,
                             int64_t *new_count, int64_t *err_index, int32_t *err_column) {
    for (int64_t i = 0; i < rows; i++) {
        PREFETCH(m, slots, i, rows);
        uint64_t h = (uint64_t)slots[i], b = 0;
        int have = 0;
        sj_status st = SJ_OK;
        int64_t slot = probe(m, h, cols, ncols, i, pl, &have, &b, &st, err_column);
        if (st == SJ_OK && slot < 0) {
            slot = m->size;
            st = add_row(m, h, b, cols, ncols, i, pl, have, err_column);
            if (st == SJ_OK) {
                if (first_rows) first_rows[*new_count] = i;
                (*new_count)++;
            }
        }
        if (st != SJ_OK) {
            if (st != SJ_ENOMEM) *err_index = i;
            return st;
        }
        slots[i] = slot;
    }
    return SJ_OK;
}

sj_status sj_groupmap_upsert(sj_groupmap *m, const sj_column *cols, int32_t ncols,
                             int64_t *slots, int64_t *first_rows, int64_t *new_count,
                             int64_t *err_index, int32_t *err_column) {
    int64_t rows = 0;
    *new_count = 0;
    sj_status st = check_columns(m, cols, ncols, &rows, err_index, err_column);
    if (st != SJ_OK) return st;
    sj_payload *pl = (sj_payload *)malloc(sizeof(sj_payload) * (size_t)ncols);
    if (!pl) return SJ_ENOMEM;
    int word = m->ncols ? m->word : is_word(cols, ncols);
    st = hash_all(cols, ncols, word, rows, pl, slots, err_index, err_column);
    if (st == SJ_OK && !m->ncols) st = fix_types(m, cols, ncols);
    if (st == SJ_OK)
        st = upsert_rows(m, cols, ncols, rows, pl, slots, first_rows, new_count, err_index,
                         err_column);
    free(pl);
    return st;
}

sj_status sj_groupmap_lookup(const sj_groupmap *m, const sj_column *cols, int32_t ncols,
                             int64_t *slots, int64_t *err_index, int32_t *err_column) {
    int64_t rows = 0;
    sj_status st = check_columns(m, cols, ncols, &rows, err_index, err_column);
    if (st != SJ_OK) return st;
    sj_payload *pl = (sj_payload *)malloc(sizeof(sj_payload) * (size_t)ncols);
    if (!pl) return SJ_ENOMEM;
    /* Before the first upsert the rows are still checked, and found nowhere. */
    st = hash_all(cols, ncols, m->ncols ? m->word : is_word(cols, ncols), rows, pl, slots,
                  err_index, err_column);
    for (int64_t i = 0; st == SJ_OK && i < rows; i++) {
        PREFETCH(m, slots, i, rows);
        uint64_t b;
        int have = 0;
        slots[i] = probe(m, (uint64_t)slots[i], cols, ncols, i, pl, &have, &b, &st, err_column);
        if (st != SJ_OK) *err_index = i;
    }
    free(pl);
    return st;
}
