/* Merkle forests: fused hash-and-scatter builds, lazy inner nodes, tree diff,
 * row selection under differing leaves, and the serialized tree record. */
#include <stdlib.h>
#include <string.h>

#include "murmur.h"
#include "sparkjet/merkle.h"

/* Rows hashed per step: keys, values and partitions of one block stay in L1. */
#define BLOCK 4096
/* A selection bitmap at most this many bits is checked first (it stays in L1). */
#define COARSE_BITS ((int64_t)1 << 17)
/* DFS stack of the diff: at most one pending sibling per level plus the node. */
#define DIFF_STACK (2 * SJ_MERKLE_MAX_DEPTH + 2)

int64_t sj_merkle_node_count(int32_t depth) {
    if (depth < SJ_MERKLE_MIN_DEPTH || depth > SJ_MERKLE_MAX_DEPTH) return -1;
    return ((int64_t)1 << depth) - 1;
}

/* (key_hash + 2**31) / (2**32 / leaves): adding 2**31 flips the top bit, and
 * 2**32 / 2**(depth-1) is a shift by 33 - depth. */
static inline uint32_t leaf_index(uint32_t key_hash, int shift) {
    return (key_hash ^ 0x80000000u) >> shift;
}

int32_t sj_merkle_leaf_of_hash(int32_t key_hash, int32_t depth) {
    uint32_t first_leaf = ((uint32_t)1 << (depth - 1)) - 1;
    return (int32_t)(first_leaf + leaf_index((uint32_t)key_hash, 33 - depth));
}

static inline uint32_t entry_hash(uint32_t key_hash, uint32_t value_hash) {
    return sj_fmix(value_hash ^ (key_hash * 0x9e3779b1u));
}

int32_t sj_merkle_entry_hash(int32_t key_hash, int32_t value_hash) {
    return (int32_t)entry_hash((uint32_t)key_hash, (uint32_t)value_hash);
}

sj_status sj_merkle_forest_check(const sj_merkle_forest *f) {
    if (!f || !f->nodes || !f->dirty || f->partition_count < 1) return SJ_EINVAL;
    int64_t nc = sj_merkle_node_count(f->depth);
    if (nc < 0 || f->partition_count > INT64_MAX / 4 / nc) return SJ_EINVAL;
    return SJ_OK;
}

/* Every column valid and `rows` long; *err_column = base + the bad one. */
static sj_status check_columns(const sj_column *cols, int32_t n, int64_t rows, int32_t base,
                               int32_t *err_column) {
    if (n < 0 || (n > 0 && !cols)) return SJ_EINVAL;
    for (int32_t c = 0; c < n; c++) {
        sj_status st = sj_column_check(&cols[c]);
        if (st == SJ_OK && cols[c].length != rows) st = SJ_EINVAL;
        if (st != SJ_OK) {
            *err_column = base + c;
            return st;
        }
    }
    return SJ_OK;
}

/* Hashes rows [start, start + m) of `n` columns (one: the column's hash;
 * several: the composite row hash) into out, through sub-column views. */
static sj_status hash_block(const sj_column *cols, int32_t n, sj_column *view, int64_t start,
                            int64_t m, int32_t *out, int32_t column_base, int64_t *err_index,
                            int32_t *err_column) {
    for (int32_t c = 0; c < n; c++) {
        view[c] = cols[c];
        view[c].offset += start;
        view[c].length = m;
    }
    int64_t e = -1;
    int32_t ec = 0;
    sj_status st = n == 1 ? sj_hash_column(view, SJ_HAZELCAST_SEED, out, &e)
                          : sj_hash_rows(view, n, SJ_HAZELCAST_SEED, out, &e, &ec);
    if (st != SJ_OK) {
        *err_index = e >= 0 ? start + e : -1;
        *err_column = column_base + ec;
    }
    return st;
}

/* The hot loop: one wrapping add per row into the leaf of its partition's tree.
 * Leaf positions are computed first (a vectorized pass); the adds then run
 * with a prefetch a few rows ahead, which keeps several cache misses in flight
 * when the leaves outgrow the cache (deep forests). Out of line so the compiler
 * treats it as the hot code it is. */
#define PREFETCH_AHEAD 32
__attribute__((noinline)) static void scatter(uint32_t *restrict nodes, int64_t node_count,
                                              uint32_t first_leaf, int shift,
                                              const int32_t *restrict part,
                                              const uint32_t *restrict kh,
                                              const uint32_t *restrict delta, int64_t m) {
    size_t at[BLOCK];
    if (!part) {
        for (int64_t i = 0; i < m; i++) at[i] = first_leaf + leaf_index(kh[i], shift);
    } else {
        for (int64_t i = 0; i < m; i++)
            at[i] = (size_t)part[i] * (size_t)node_count + first_leaf + leaf_index(kh[i], shift);
    }
    int64_t i = 0;
    for (; i + PREFETCH_AHEAD < m; i++) {
        __builtin_prefetch(nodes + at[i + PREFETCH_AHEAD], 1);
        nodes[at[i]] += delta[i];
    }
    for (; i < m; i++) nodes[at[i]] += delta[i];
}

/* Applies rows [from, to) of the batch; on error *failed_at is the start of the
 * block that failed (blocks before it were applied). */
static sj_status apply_rows(const sj_merkle_forest *f, const sj_merkle_batch *b, int32_t sign,
                            sj_column *view, int64_t from, int64_t to, int64_t *failed_at,
                            int64_t *err_index, int32_t *err_column) {
    sj_divisor div;
    sj_divisor_init(&div, f->partition_count);
    int32_t kh_buf[BLOCK], vh_buf[BLOCK], part[BLOCK];
    uint32_t delta[BLOCK];
    const uint32_t factor = sign > 0 ? (uint32_t)SJ_MERKLE_VALUE_FACTOR
                                     : (uint32_t)0 - (uint32_t)SJ_MERKLE_VALUE_FACTOR;
    const int64_t node_count = sj_merkle_node_count(f->depth);
    const uint32_t first_leaf = ((uint32_t)1 << (f->depth - 1)) - 1;
    const int shift = 33 - f->depth;
    sj_status st = SJ_OK;
    for (int64_t start = from; start < to; start += BLOCK) {
        int64_t m = to - start < BLOCK ? to - start : BLOCK;
        const int32_t *kh = kh_buf, *vh = vh_buf;
        *failed_at = start;
        if (b->key_count) {
            st = hash_block(b->keys, b->key_count, view, start, m, kh_buf, 0, err_index,
                            err_column);
            if (st != SJ_OK) return st;
        } else {
            kh = b->key_hashes + start;
        }
        if (b->value_count) {
            st = hash_block(b->values, b->value_count, view + b->key_count, start, m, vh_buf,
                            b->key_count, err_index, err_column);
            if (st != SJ_OK) return st;
        } else {
            vh = b->value_hashes ? b->value_hashes + start : kh;
        }
        if (b->mode == SJ_MERKLE_ENTRY_HASH) {
            for (int64_t i = 0; i < m; i++)
                delta[i] = entry_hash((uint32_t)kh[i], (uint32_t)vh[i]) * factor;
        } else {
            for (int64_t i = 0; i < m; i++) delta[i] = (uint32_t)vh[i] * factor;
        }
        if (f->partition_count == 1) {
            scatter((uint32_t *)f->nodes, node_count, first_leaf, shift, NULL,
                    (const uint32_t *)kh, delta, m);
            f->dirty[0] = 1;
        } else {
            for (int64_t i = 0; i < m; i++)
                part[i] = (int32_t)sj_reduce((uint32_t)kh[i], div.d, div.magic, div.shift);
            scatter((uint32_t *)f->nodes, node_count, first_leaf, shift, part,
                    (const uint32_t *)kh, delta, m);
            for (int64_t i = 0; i < m; i++) f->dirty[part[i]] = 1;
        }
    }
    return st;
}

sj_status sj_merkle_update(const sj_merkle_forest *f, const sj_merkle_batch *b, int32_t sign,
                           int64_t *err_index, int32_t *err_column) {
    *err_index = -1;
    *err_column = -1;
    if (sj_merkle_forest_check(f) != SJ_OK || !b || b->rows < 0 || (sign != 1 && sign != -1) ||
        (b->mode != SJ_MERKLE_VALUE_HASH && b->mode != SJ_MERKLE_ENTRY_HASH) ||
        b->key_count < 0 || b->value_count < 0 ||
        (b->rows > 0 && b->key_count == 0 && !b->key_hashes))
        return SJ_EINVAL;
    sj_status st = check_columns(b->keys, b->key_count, b->rows, 0, err_column);
    if (st == SJ_OK)
        st = check_columns(b->values, b->value_count, b->rows, b->key_count, err_column);
    if (st != SJ_OK || b->rows == 0) return st;
    int32_t ncols = b->key_count + b->value_count;
    sj_column *view = ncols ? (sj_column *)malloc(sizeof(sj_column) * (size_t)ncols) : NULL;
    if (ncols && !view) return SJ_ENOMEM;
    int64_t failed_at = 0, ignored_index;
    int32_t ignored_column;
    st = apply_rows(f, b, sign, view, 0, b->rows, &failed_at, err_index, err_column);
    if (st != SJ_OK) /* all or nothing: the blocks before the bad one hashed fine, and do again */
        apply_rows(f, b, -sign, view, 0, failed_at, &failed_at, &ignored_index, &ignored_column);
    free(view);
    return st;
}

/* Inner nodes from the leaves, bottom up; a level's children are one
 * contiguous run, so each level is a pairwise sum the compiler vectorizes. */
static void refresh_tree(uint32_t *t, int32_t depth) {
    for (int32_t level = depth - 2; level >= 0; level--) {
        uint32_t *parent = t + (((size_t)1 << level) - 1);
        const uint32_t *child = t + (((size_t)1 << (level + 1)) - 1);
        size_t n = (size_t)1 << level;
        for (size_t j = 0; j < n; j++) parent[j] = child[2 * j] + child[2 * j + 1];
    }
}

sj_status sj_merkle_refresh(const sj_merkle_forest *f) {
    if (sj_merkle_forest_check(f) != SJ_OK) return SJ_EINVAL;
    int64_t nc = sj_merkle_node_count(f->depth);
    for (int32_t p = 0; p < f->partition_count; p++) {
        if (!f->dirty[p]) continue;
        refresh_tree((uint32_t *)f->nodes + (size_t)p * (size_t)nc, f->depth);
        f->dirty[p] = 0;
    }
    return SJ_OK;
}

static inline int level_of(uint32_t node) { return 31 - __builtin_clz(node + 1); }

/* Depth-first with an explicit stack, right child pushed first: it compares
 * exactly the node pairs a level-by-level walk compares (the children of
 * differing nodes), needs no memory proportional to the tree, and emits the
 * differing leaves in ascending order. */
static void diff_tree(const int32_t *a, const int32_t *b, int32_t depth, int64_t base,
                      int64_t *out, int64_t capacity, int64_t *count, int64_t *compared) {
    const uint32_t first_leaf = ((uint32_t)1 << (depth - 1)) - 1;
    uint32_t stack[DIFF_STACK];
    int sp = 0;
    compared[0]++;
    if (a[0] == b[0]) return;
    stack[sp++] = 0;
    while (sp) {
        uint32_t n = stack[--sp];
        if (n >= first_leaf) {
            if (*count < capacity) out[*count] = base + (n - first_leaf);
            (*count)++;
            continue;
        }
        uint32_t l = 2 * n + 1, r = 2 * n + 2;
        compared[level_of(l)] += 2;
        if (a[r] != b[r]) stack[sp++] = r;
        if (a[l] != b[l]) stack[sp++] = l;
    }
}

sj_status sj_merkle_diff(const sj_merkle_forest *a, const sj_merkle_forest *b, int64_t *out,
                         int64_t capacity, int64_t *count, int64_t *compared) {
    *count = 0;
    if (sj_merkle_forest_check(a) != SJ_OK || sj_merkle_forest_check(b) != SJ_OK ||
        a->partition_count != b->partition_count || capacity < 0 || (capacity && !out))
        return SJ_EINVAL;
    int32_t depth = a->depth < b->depth ? a->depth : b->depth;
    int64_t nca = sj_merkle_node_count(a->depth), ncb = sj_merkle_node_count(b->depth);
    int64_t leaves = (int64_t)1 << (depth - 1);
    int64_t local[SJ_MERKLE_MAX_DEPTH] = {0};
    int64_t *levels = compared ? compared : local;
    if (compared) memset(compared, 0, sizeof(int64_t) * (size_t)depth);
    for (int32_t p = 0; p < a->partition_count; p++)
        diff_tree(a->nodes + (size_t)p * (size_t)nca, b->nodes + (size_t)p * (size_t)ncb, depth,
                  (int64_t)p * leaves, out, capacity, count, levels);
    return SJ_OK;
}

/* Key hashes of rows [start, start + m) into kh; partitions into part if asked. */
static sj_status key_block(const sj_column *keys, int32_t key_count, sj_column *view,
                           int64_t start, int64_t m, const sj_divisor *div, int32_t *kh,
                           int32_t *part, int64_t *err_index, int32_t *err_column) {
    sj_status st = hash_block(keys, key_count, view, start, m, kh, 0, err_index, err_column);
    if (st == SJ_OK && part) {
        for (int64_t i = 0; i < m; i++)
            part[i] = (int32_t)sj_reduce((uint32_t)kh[i], div->d, div->magic, div->shift);
    }
    return st;
}

static sj_status check_keys(const sj_column *keys, int32_t key_count, int32_t depth,
                            int32_t partition_count, int32_t *err_column) {
    if (key_count < 1 || !keys || sj_merkle_node_count(depth) < 0 || partition_count < 1)
        return SJ_EINVAL;
    return check_columns(keys, key_count, keys[0].length, 0, err_column);
}

sj_status sj_merkle_locate(const sj_column *keys, int32_t key_count, int32_t depth,
                           int32_t partition_count, int32_t *partitions, int32_t *leaves,
                           int64_t *err_index, int32_t *err_column) {
    *err_index = -1;
    *err_column = -1;
    sj_status st = check_keys(keys, key_count, depth, partition_count, err_column);
    if (st != SJ_OK) return st;
    sj_column *view = (sj_column *)malloc(sizeof(sj_column) * (size_t)key_count);
    if (!view) return SJ_ENOMEM;
    sj_divisor div;
    sj_divisor_init(&div, partition_count);
    int32_t kh[BLOCK];
    const int shift = 33 - depth;
    const uint32_t first_leaf = ((uint32_t)1 << (depth - 1)) - 1;
    int64_t rows = keys[0].length;
    for (int64_t start = 0; start < rows && st == SJ_OK; start += BLOCK) {
        int64_t m = rows - start < BLOCK ? rows - start : BLOCK;
        st = key_block(keys, key_count, view, start, m, &div, kh,
                       partitions ? partitions + start : NULL, err_index, err_column);
        if (st == SJ_OK && leaves) {
            for (int64_t i = 0; i < m; i++)
                leaves[start + i] = (int32_t)(first_leaf + leaf_index((uint32_t)kh[i], shift));
        }
    }
    free(view);
    return st;
}

static inline uint32_t bit_set(const uint8_t *bits, uint64_t i) {
    return (bits[i >> 3] >> (i & 7)) & 1u;
}

/* Writes the mask bytes of one block (m rows, mb from a byte boundary) and
 * returns the rows set. With a coarse bitmap (few leaves differ) most rows
 * stop at a well-predicted test of a bitmap in L1; without one (many leaves
 * differ, where that branch would mispredict) every row reads the fine bitmap,
 * branch-free. */
__attribute__((noinline)) static int64_t mark_rows(const int32_t *restrict kh,
                                                   const int32_t *restrict part, int64_t m,
                                                   int shift, uint64_t leaves,
                                                   const uint8_t *restrict fine,
                                                   const uint8_t *restrict coarse, int cb,
                                                   int coarse_shift, uint8_t *restrict mb) {
    int64_t hits = 0;
    for (int64_t base = 0; base < m; base += 8) {
        int n = m - base < 8 ? (int)(m - base) : 8;
        uint32_t byte = 0;
        if (coarse) {
            for (int j = 0; j < n; j++) {
                uint64_t leaf = leaf_index((uint32_t)kh[base + j], shift);
                uint64_t p = (uint64_t)part[base + j];
                if (bit_set(coarse, (p << cb) | (leaf >> coarse_shift)))
                    byte |= bit_set(fine, p * leaves + leaf) << j;
            }
        } else {
            for (int j = 0; j < n; j++) {
                uint64_t leaf = leaf_index((uint32_t)kh[base + j], shift);
                byte |= bit_set(fine, (uint64_t)part[base + j] * leaves + leaf) << j;
            }
        }
        mb[base >> 3] = (uint8_t)byte;
        hits += __builtin_popcount(byte);
    }
    return hits;
}

sj_status sj_merkle_leaf_set_init(sj_merkle_leaf_set *s, int32_t depth, int32_t partition_count,
                                  const int64_t *leaf_ids, int64_t id_count, int64_t *err_index) {
    *err_index = -1;
    if (!s) return SJ_EINVAL;
    memset(s, 0, sizeof *s);
    if (sj_merkle_node_count(depth) < 0 || partition_count < 1 || id_count < 0 ||
        (id_count && !leaf_ids))
        return SJ_EINVAL;
    const int64_t leaves = (int64_t)1 << (depth - 1);
    if (partition_count > INT64_MAX / leaves / 2) return SJ_EINVAL;
    const int64_t total = partition_count * leaves;
    /* coarse: the top `cb` leaf bits of each tree, a bitmap small enough for L1
     * that rejects most rows before the fine bitmap is touched. */
    int cb = 0;
    while (cb + 1 < depth - 1 && ((int64_t)partition_count << (cb + 1)) <= COARSE_BITS) cb++;
    const int64_t coarse_total = (int64_t)partition_count << cb;
    const int coarse_shift = (depth - 1) - cb;
    s->depth = depth;
    s->partition_count = partition_count;
    s->coarse_bits = cb;
    s->fine = (uint8_t *)calloc((size_t)((total + 7) / 8), 1);
    s->coarse = (uint8_t *)calloc((size_t)((coarse_total + 7) / 8), 1);
    if (!s->fine || !s->coarse) {
        sj_merkle_leaf_set_free(s);
        return SJ_ENOMEM;
    }
    int64_t coarse_set = 0;
    for (int64_t j = 0; j < id_count; j++) {
        int64_t id = leaf_ids[j];
        if (id < 0 || id >= total) {
            *err_index = j;
            sj_merkle_leaf_set_free(s);
            return SJ_EINVAL;
        }
        s->count += !bit_set(s->fine, (uint64_t)id);
        s->fine[id >> 3] |= (uint8_t)(1u << (id & 7));
        int64_t c = ((id / leaves) << cb) | ((id % leaves) >> coarse_shift);
        coarse_set += !bit_set(s->coarse, (uint64_t)c);
        s->coarse[c >> 3] |= (uint8_t)(1u << (c & 7));
    }
    if (coarse_set * 8 > coarse_total || cb >= depth - 1) { /* dense: the filter would not pay */
        free(s->coarse);
        s->coarse = NULL;
    }
    return SJ_OK;
}

void sj_merkle_leaf_set_free(sj_merkle_leaf_set *s) {
    if (!s) return;
    free(s->fine);
    free(s->coarse);
    s->fine = s->coarse = NULL;
}

sj_status sj_merkle_select(const sj_column *keys, int32_t key_count, const sj_merkle_leaf_set *s,
                           uint8_t *mask, int64_t *selected, int64_t *err_index,
                           int32_t *err_column) {
    *err_index = -1;
    *err_column = -1;
    *selected = 0;
    if (!s || !s->fine || !mask) return SJ_EINVAL;
    sj_status st = check_keys(keys, key_count, s->depth, s->partition_count, err_column);
    if (st != SJ_OK) return st;
    sj_column *view = (sj_column *)malloc(sizeof(sj_column) * (size_t)key_count);
    if (!view) return SJ_ENOMEM;
    sj_divisor div;
    sj_divisor_init(&div, s->partition_count);
    int32_t kh[BLOCK], part[BLOCK];
    const int shift = 33 - s->depth;
    const uint64_t leaves = (uint64_t)1 << (s->depth - 1);
    const int coarse_shift = (s->depth - 1) - s->coarse_bits;
    int64_t rows = keys[0].length, hits = 0;
    for (int64_t start = 0; start < rows; start += BLOCK) {
        int64_t m = rows - start < BLOCK ? rows - start : BLOCK;
        st = key_block(keys, key_count, view, start, m, &div, kh, part, err_index, err_column);
        if (st != SJ_OK) break;
        /* start is a multiple of 8 */
        hits += mark_rows(kh, part, m, shift, leaves, s->fine, s->coarse, s->coarse_bits,
                          coarse_shift, mask + start / 8);
    }
    *selected = hits;
    free(view);
    return st;
}

int64_t sj_merkle_serialized_size(int32_t depth) {
    if (sj_merkle_node_count(depth) < 0) return -1;
    return SJ_MERKLE_HEADER_SIZE + 4 * ((int64_t)1 << (depth - 1));
}

static void put_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static uint32_t get_be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint32_t record_checksum(const uint8_t *buf, int64_t size) {
    uint32_t seed = (uint32_t)sj_murmur3_32(buf, 16, SJ_MERKLE_CHECKSUM_SEED);
    return (uint32_t)sj_murmur3_32(buf + 20, (size_t)(size - 20), seed);
}

sj_status sj_merkle_write(const int32_t *tree, int32_t depth, int32_t partition,
                          int32_t partition_count, int32_t mode, uint8_t *out, int64_t out_size) {
    int64_t size = sj_merkle_serialized_size(depth);
    if (!tree || !out || size < 0 || partition_count < 1 || partition < 0 ||
        partition >= partition_count ||
        (mode != SJ_MERKLE_VALUE_HASH && mode != SJ_MERKLE_ENTRY_HASH))
        return SJ_EINVAL;
    if (out_size < size) return SJ_EBOUNDS;
    uint32_t leaves = (uint32_t)1 << (depth - 1);
    memcpy(out, "SJMT", 4);
    out[4] = 0;
    out[5] = SJ_MERKLE_FORMAT_VERSION;
    out[6] = (uint8_t)depth;
    out[7] = mode == SJ_MERKLE_ENTRY_HASH ? SJ_MERKLE_FLAG_ENTRY_HASH : 0;
    put_be32(out + 8, (uint32_t)partition);
    put_be32(out + 12, (uint32_t)partition_count);
    put_be32(out + 20, leaves);
    const int32_t *leaf = tree + (leaves - 1);
    for (uint32_t i = 0; i < leaves; i++) put_be32(out + 24 + 4 * (size_t)i, (uint32_t)leaf[i]);
    put_be32(out + 16, record_checksum(out, size));
    return SJ_OK;
}

static sj_status bad(int64_t *err_offset, const char **bad_field, int64_t offset,
                     const char *field, sj_status st) {
    *err_offset = offset;
    *bad_field = field;
    return st;
}

sj_status sj_merkle_read_header(const uint8_t *buf, int64_t len, sj_merkle_header *h,
                                int64_t *err_offset, const char **bad_field) {
    *err_offset = -1;
    *bad_field = NULL;
    if (len < 0 || (len && !buf) || !h) return SJ_EINVAL;
    if (len < SJ_MERKLE_HEADER_SIZE) return bad(err_offset, bad_field, len, "header", SJ_EBOUNDS);
    if (memcmp(buf, "SJMT", 4) != 0) return bad(err_offset, bad_field, 0, "magic", SJ_ECORRUPT);
    int32_t version = (int32_t)buf[4] << 8 | buf[5];
    if (version != SJ_MERKLE_FORMAT_VERSION)
        return bad(err_offset, bad_field, 4, "version", SJ_ECORRUPT);
    int32_t depth = buf[6];
    if (depth < SJ_MERKLE_MIN_DEPTH || depth > SJ_MERKLE_MAX_DEPTH)
        return bad(err_offset, bad_field, 6, "depth", SJ_ECORRUPT);
    if (buf[7] & ~SJ_MERKLE_FLAG_ENTRY_HASH)
        return bad(err_offset, bad_field, 7, "flags", SJ_ECORRUPT);
    int32_t partition = (int32_t)get_be32(buf + 8);
    int32_t partition_count = (int32_t)get_be32(buf + 12);
    if (partition_count < 1)
        return bad(err_offset, bad_field, 12, "partition count", SJ_ECORRUPT);
    if (partition < 0 || partition >= partition_count)
        return bad(err_offset, bad_field, 8, "partition", SJ_ECORRUPT);
    if (get_be32(buf + 20) != (uint32_t)1 << (depth - 1))
        return bad(err_offset, bad_field, 20, "leaf count", SJ_ECORRUPT);
    int64_t size = sj_merkle_serialized_size(depth);
    if (len < size) return bad(err_offset, bad_field, len, "leaves", SJ_EBOUNDS);
    if (get_be32(buf + 16) != record_checksum(buf, size))
        return bad(err_offset, bad_field, 16, "checksum", SJ_ECORRUPT);
    h->version = version;
    h->depth = depth;
    h->mode = buf[7] & SJ_MERKLE_FLAG_ENTRY_HASH ? SJ_MERKLE_ENTRY_HASH : SJ_MERKLE_VALUE_HASH;
    h->partition = partition;
    h->partition_count = partition_count;
    h->size = size;
    return SJ_OK;
}

sj_status sj_merkle_read_tree(const uint8_t *buf, int64_t len, const sj_merkle_header *h,
                              int32_t *tree) {
    if (!buf || !h || !tree || sj_merkle_serialized_size(h->depth) != h->size) return SJ_EINVAL;
    if (len < h->size) return SJ_EBOUNDS;
    uint32_t leaves = (uint32_t)1 << (h->depth - 1);
    uint32_t *leaf = (uint32_t *)tree + (leaves - 1);
    for (uint32_t i = 0; i < leaves; i++) leaf[i] = get_be32(buf + 24 + 4 * (size_t)i);
    refresh_tree((uint32_t *)tree, h->depth);
    return SJ_OK;
}
