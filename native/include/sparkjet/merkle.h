/* Merkle trees of keyed data, as Hazelcast keeps them for persisted-data sync.
 *
 * THE TREE (Hazelcast's, exactly)
 *
 * A tree of depth d (the number of levels, 2..27) is a perfect binary tree in
 * an int32 array, breadth-first: root 0, children of node o at 2o+1 and 2o+2,
 * 2**d - 1 nodes, 2**(d-1) leaves, the first leaf at node 2**(d-1) - 1. An
 * entry (key, value) lands in leaf
 *     first_leaf + (key_hash + 2**31) / (2**32 / leaves)
 * (key_hash: the key's Hazelcast murmur hash, signed) and adds
 * 2038079003 * value_hash to it, wrapping at 32 bits; removing subtracts.
 * Every inner node is the wrapping sum of its children, so a node is the sum
 * of its subtree and the first 2**k - 1 nodes of a deeper tree are the tree of
 * depth k of the same entries: trees of different depths compare on their
 * common levels.
 *
 * A FOREST is one tree per Hazelcast partition of the key (partition_count
 * trees of one depth), in one caller-owned array: tree p at nodes + p * (2**d - 1).
 * Updates change leaves only and flag their trees dirty; sj_merkle_refresh
 * recomputes the inner nodes of dirty trees, once, after any number of updates.
 *
 * VALUE HASHES. In SJ_MERKLE_VALUE_HASH mode (Hazelcast's) the hash summed is
 * the value's own; the key only picks the leaf, so two keys of one leaf that
 * swap values, or a value moving to a new key of the same leaf, leave the tree
 * unchanged. SJ_MERKLE_ENTRY_HASH sums sj_merkle_entry_hash(key_hash, value_hash)
 * instead, which binds the value to its key (sparkjet's dataset sync uses it).
 *
 * SERIALIZED TREE (version 1; this comment is its one description). Big-endian
 * throughout, as Java's DataOutput writes; bytes 20.. are exactly what
 * Hazelcast's MerkleTreeUtil.writeLeaves sends (leaf count, then the leaves):
 *
 *   offset size field
 *        0    4 magic "SJMT"
 *        4    2 format version (1)
 *        6    1 depth (2..27)
 *        7    1 flags: bit 0 entry-hash mode; other bits 0
 *        8    4 partition (0 <= partition < partition count)
 *       12    4 partition count (>= 1)
 *       16    4 checksum: murmur3_32 of bytes 20..end, seeded with the
 *               murmur3_32 (seed 0x534a4d54) of bytes 0..15
 *       20    4 leaf count, 2**(depth - 1)
 *       24  4*n the leaves, left to right
 *
 * Inner nodes are not sent: the reader recomputes them. */
#ifndef SPARKJET_MERKLE_H
#define SPARKJET_MERKLE_H

#include <stddef.h>
#include <stdint.h>

#include "sparkjet/hash.h"
#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SJ_MERKLE_MIN_DEPTH 2
#define SJ_MERKLE_MAX_DEPTH 27
#define SJ_MERKLE_DEFAULT_DEPTH 10
#define SJ_MERKLE_VALUE_FACTOR 2038079003
#define SJ_MERKLE_FORMAT_VERSION 1
#define SJ_MERKLE_HEADER_SIZE 24
#define SJ_MERKLE_CHECKSUM_SEED 0x534a4d54u
#define SJ_MERKLE_FLAG_ENTRY_HASH 1

typedef enum sj_merkle_mode {
    SJ_MERKLE_VALUE_HASH = 0, /* Hazelcast's: the value's hash only */
    SJ_MERKLE_ENTRY_HASH = 1  /* the value's hash bound to the key's */
} sj_merkle_mode;

/* partition_count trees of one depth, in memory the caller owns. */
typedef struct sj_merkle_forest {
    int32_t depth;           /* levels, SJ_MERKLE_MIN_DEPTH..SJ_MERKLE_MAX_DEPTH */
    int32_t partition_count; /* trees, >= 1; keys go to tree sj_partition_of_hash(...) */
    int32_t *nodes;          /* partition_count * (2**depth - 1) node hashes */
    uint8_t *dirty;          /* partition_count flags: leaves changed, inner nodes stale */
} sj_merkle_forest;

/* One batch of entries. Keys are key columns (one: its Hazelcast hash; several:
 * the composite hash of sj_hash_rows) or, with key_count 0, precomputed key
 * hashes. Values likewise: value columns, or with value_count 0 precomputed
 * value_hashes, or with neither the key hash itself (a set of keys). Columns
 * must all have `rows` values. */
typedef struct sj_merkle_batch {
    const sj_column *keys;
    int32_t key_count;
    const int32_t *key_hashes;
    const sj_column *values;
    int32_t value_count;
    const int32_t *value_hashes;
    int64_t rows;
    int32_t mode; /* an sj_merkle_mode */
} sj_merkle_batch;

/* 2**depth - 1, or -1 outside SJ_MERKLE_MIN_DEPTH..SJ_MERKLE_MAX_DEPTH. */
int64_t sj_merkle_node_count(int32_t depth);

/* The node order of the leaf a key hash lands in (depth must be valid). */
int32_t sj_merkle_leaf_of_hash(int32_t key_hash, int32_t depth);

/* The hash SJ_MERKLE_ENTRY_HASH mode sums: fmix32(value_hash ^ key_hash * 0x9e3779b1),
 * all unsigned 32-bit, fmix32 being murmur3's finalizer. */
int32_t sj_merkle_entry_hash(int32_t key_hash, int32_t value_hash);

/* SJ_EINVAL unless the depth is in range, partition_count >= 1, both arrays
 * are given and the node count fits in memory arithmetic. */
sj_status sj_merkle_forest_check(const sj_merkle_forest *f);

/* Adds (sign 1) or removes (sign -1) every entry of the batch: leaves only;
 * the trees touched are flagged dirty. Keys and values are hashed in blocks
 * of 4096 rows straight into the scatter, with the vector hash kernels. All
 * or nothing: on error the leaves are as they were (the blocks applied before
 * the bad one are subtracted again). *err_index is the row, *err_column the
 * key column (0..) or key_count + the value column. */
sj_status sj_merkle_update(const sj_merkle_forest *f, const sj_merkle_batch *b, int32_t sign,
                           int64_t *err_index, int32_t *err_column);

/* Recomputes the inner nodes of every dirty tree and clears its flag. */
sj_status sj_merkle_refresh(const sj_merkle_forest *f);

/* The leaves where refreshed forests a and b (same partition count, any
 * depths) differ, compared on their common depth d = min(depths). Each tree
 * is walked from the root, comparing only the children of differing nodes.
 * Writes up to `capacity` ids p * 2**(d-1) + (leaf - first_leaf), ascending,
 * and sets *count to the number of differing leaves (which may exceed
 * capacity: call again with more room). compared, when not NULL, receives d
 * counts: the node pairs compared on each level. */
sj_status sj_merkle_diff(const sj_merkle_forest *a, const sj_merkle_forest *b, int64_t *out,
                         int64_t capacity, int64_t *count, int64_t *compared);

/* Per row, the partition (when partitions is not NULL) and the leaf node
 * order in a tree of `depth` (when leaves is not NULL) of its key. */
sj_status sj_merkle_locate(const sj_column *keys, int32_t key_count, int32_t depth,
                           int32_t partition_count, int32_t *partitions, int32_t *leaves,
                           int64_t *err_index, int32_t *err_column);

/* A set of leaves of forests of one shape, as bitmaps: built once from leaf
 * ids (as sj_merkle_diff writes them, any order), then used to select rows of
 * any number of batches. Owns its memory: sj_merkle_leaf_set_free releases it. */
typedef struct sj_merkle_leaf_set {
    int32_t depth;
    int32_t partition_count;
    int64_t count;          /* distinct leaves in the set */
    uint8_t *fine;          /* one bit per leaf of the forest */
    uint8_t *coarse;        /* one bit per group of leaves; NULL when the set is dense */
    int32_t coarse_bits;    /* leaf-index bits the coarse bitmap keeps per tree */
} sj_merkle_leaf_set;

/* On SJ_EINVAL for an id outside the forest, *err_index is its position. */
sj_status sj_merkle_leaf_set_init(sj_merkle_leaf_set *s, int32_t depth, int32_t partition_count,
                                  const int64_t *leaf_ids, int64_t id_count, int64_t *err_index);
void sj_merkle_leaf_set_free(sj_merkle_leaf_set *s);

/* Marks the rows whose key lies under a leaf of the set: `mask` receives an
 * Arrow bit-packed boolean array, (rows + 7) / 8 bytes, and *selected the
 * number of rows set. Keys as sj_merkle_locate takes them. */
sj_status sj_merkle_select(const sj_column *keys, int32_t key_count, const sj_merkle_leaf_set *s,
                           uint8_t *mask, int64_t *selected, int64_t *err_index,
                           int32_t *err_column);

/* The serialized size of a tree of this depth, or -1 for a bad depth. */
int64_t sj_merkle_serialized_size(int32_t depth);

/* Writes one tree's record (the format above) to out[0 .. sj_merkle_serialized_size). */
sj_status sj_merkle_write(const int32_t *tree, int32_t depth, int32_t partition,
                          int32_t partition_count, int32_t mode, uint8_t *out, int64_t out_size);

typedef struct sj_merkle_header {
    int32_t version;
    int32_t depth;
    int32_t mode;
    int32_t partition;
    int32_t partition_count;
    int64_t size; /* bytes of the whole record */
} sj_merkle_header;

/* Parses and checks the record at buf[0 .. len): every header field, the
 * checksum, and that len holds the whole record (len may hold more: the next
 * record). On error *err_offset is the offset of the bad field, or for a
 * truncated record the offset where bytes ran out, and *bad_field its name. */
sj_status sj_merkle_read_header(const uint8_t *buf, int64_t len, sj_merkle_header *h,
                                int64_t *err_offset, const char **bad_field);

/* Loads the leaves of a record that sj_merkle_read_header accepted into
 * tree[0 .. 2**depth - 1) and computes its inner nodes. */
sj_status sj_merkle_read_tree(const uint8_t *buf, int64_t len, const sj_merkle_header *h,
                              int32_t *tree);

#ifdef __cplusplus
}
#endif
#endif
