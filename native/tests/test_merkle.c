/* Native tests of the Merkle forest, runnable without Python: `make -C native test`.
 * HAZELCAST.md's vector, the fused build against a plain per-entry loop, lazy
 * inner nodes, the diff against a brute-force comparison (also across depths),
 * row selection, and the serialized record against every truncation and every
 * flipped byte. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/merkle.h"

#include "check.h"

static sj_merkle_forest new_forest(int32_t partition_count, int32_t depth) {
    sj_merkle_forest f;
    f.depth = depth;
    f.partition_count = partition_count;
    f.nodes = (int32_t *)calloc((size_t)(partition_count * sj_merkle_node_count(depth)), 4);
    f.dirty = (uint8_t *)calloc((size_t)partition_count, 1);
    return f;
}

static void free_forest(sj_merkle_forest *f) {
    free(f->nodes);
    free(f->dirty);
}

static int32_t *tree_of(const sj_merkle_forest *f, int32_t p) {
    return f->nodes + (size_t)p * (size_t)sj_merkle_node_count(f->depth);
}

static void test_hazelcast_vector(void) {
    /* {Integer 42: "hello", Integer 1: "a", String "key": Integer 7}, depth 10. */
    int32_t int_keys[] = {42, 1}, seven[] = {7};
    const char words[] = "helloakey";
    int32_t value_offsets[] = {0, 5, 6}, key_offsets[] = {6, 9};
    int32_t key_hashes[3], value_hashes[3];
    int64_t err;
    sj_column c = test_column(SJ_KEY_INT32, int_keys, 2, sizeof int_keys);
    sj_hash_column(&c, SJ_HAZELCAST_SEED, key_hashes, &err);
    c = test_column(SJ_KEY_VAR32, key_offsets, 1, sizeof key_offsets);
    c.data = (const uint8_t *)words;
    c.data_size = 9;
    sj_hash_column(&c, SJ_HAZELCAST_SEED, key_hashes + 2, &err);
    c = test_column(SJ_KEY_VAR32, value_offsets, 2, sizeof value_offsets);
    c.data = (const uint8_t *)words;
    c.data_size = 9;
    sj_hash_column(&c, SJ_HAZELCAST_SEED, value_hashes, &err);
    c = test_column(SJ_KEY_INT32, seven, 1, sizeof seven);
    sj_hash_column(&c, SJ_HAZELCAST_SEED, value_hashes + 2, &err);

    sj_merkle_forest f = new_forest(1, 10);
    sj_merkle_batch b = {0};
    b.key_hashes = key_hashes;
    b.value_hashes = value_hashes;
    b.rows = 3;
    int32_t ec;
    CHECK(sj_merkle_update(&f, &b, 1, &err, &ec) == SJ_OK, "vector update");
    CHECK(f.dirty[0] == 1, "dirty after update");
    CHECK(sj_merkle_refresh(&f) == SJ_OK && f.dirty[0] == 0, "refresh");
    int32_t leaves[] = {1014, 858, 942};
    int32_t values[] = {-1078798729, -1173672487, -1974808467};
    for (int i = 0; i < 3; i++) {
        CHECK(sj_merkle_leaf_of_hash(key_hashes[i], 10) == leaves[i], "leaf %d: %d", i,
              sj_merkle_leaf_of_hash(key_hashes[i], 10));
        CHECK(f.nodes[leaves[i]] == values[i], "leaf value %d: %d", i, f.nodes[leaves[i]]);
    }
    CHECK(f.nodes[0] == 67687613, "root %d", f.nodes[0]);
    CHECK(sj_merkle_update(&f, &b, -1, &err, &ec) == SJ_OK, "remove");
    sj_merkle_refresh(&f);
    for (int64_t i = 0; i < sj_merkle_node_count(10); i++)
        CHECK(f.nodes[i] == 0, "node %ld", (long)i);
    free_forest(&f);
}

static void test_leaf_rule(void) {
    for (int32_t d = SJ_MERKLE_MIN_DEPTH; d <= SJ_MERKLE_MAX_DEPTH; d++) {
        int32_t first = (1 << (d - 1)) - 1, last = (1 << d) - 2;
        CHECK(sj_merkle_leaf_of_hash(INT32_MIN, d) == first, "depth %d min", d);
        CHECK(sj_merkle_leaf_of_hash(INT32_MAX, d) == last, "depth %d max", d);
        CHECK(sj_merkle_leaf_of_hash(0, d) == first + (1 << (d - 2)), "depth %d zero", d);
        for (int t = 0; t < 1000; t++) {
            int32_t h = (int32_t)(uint32_t)test_random();
            int64_t want = first + ((int64_t)h + 2147483648LL) / (4294967296LL >> (d - 1));
            CHECK(sj_merkle_leaf_of_hash(h, d) == want, "depth %d hash %d", d, h);
        }
    }
    CHECK(sj_merkle_node_count(1) == -1 && sj_merkle_node_count(28) == -1, "depth range");
    CHECK(sj_merkle_node_count(27) == (1 << 27) - 1, "depth 27");
}

/* The fused build equals a plain loop over entries with precomputed hashes,
 * for one and two key columns, one and two value columns, sliced columns,
 * both modes and a row count that is not a multiple of the block. */
static void test_fused_build(void) {
    enum { N = 10007, P = 13, D = 9 };
    static int64_t k1[N + 5], v1[N + 5];
    static int32_t k2[N + 5], v2[N + 5], kh[N], vh[N];
    for (int i = 0; i < N + 5; i++) {
        k1[i] = (int64_t)test_random();
        v1[i] = (int64_t)test_random();
        k2[i] = (int32_t)test_random();
        v2[i] = (int32_t)test_random();
    }
    sj_column keys[2] = {test_column(SJ_KEY_INT64, k1, N, sizeof k1),
                         test_column(SJ_KEY_INT32, k2, N, sizeof k2)};
    sj_column vals[2] = {test_column(SJ_KEY_INT64, v1, N, sizeof v1),
                         test_column(SJ_KEY_INT32, v2, N, sizeof v2)};
    for (int c = 0; c < 2; c++) {
        keys[c].offset = 3;
        vals[c].offset = 5;
    }
    int64_t err;
    int32_t ec;
    for (int nk = 1; nk <= 2; nk++) {
        for (int nv = 0; nv <= 2; nv++) {
            for (int mode = 0; mode <= 1; mode++) {
                if (nk == 1) sj_hash_column(keys, SJ_HAZELCAST_SEED, kh, &err);
                else sj_hash_rows(keys, 2, SJ_HAZELCAST_SEED, kh, &err, &ec);
                if (nv == 0) memcpy(vh, kh, sizeof vh);
                else if (nv == 1) sj_hash_column(vals, SJ_HAZELCAST_SEED, vh, &err);
                else sj_hash_rows(vals, 2, SJ_HAZELCAST_SEED, vh, &err, &ec);
                sj_merkle_forest want = new_forest(P, D), got = new_forest(P, D);
                for (int i = 0; i < N; i++) {
                    uint32_t h = mode ? (uint32_t)sj_merkle_entry_hash(kh[i], vh[i])
                                      : (uint32_t)vh[i];
                    int32_t *t = tree_of(&want, sj_partition_of_hash(kh[i], P));
                    uint32_t *leaf = (uint32_t *)&t[sj_merkle_leaf_of_hash(kh[i], D)];
                    *leaf += h * (uint32_t)SJ_MERKLE_VALUE_FACTOR;
                    want.dirty[sj_partition_of_hash(kh[i], P)] = 1;
                }
                sj_merkle_refresh(&want);
                sj_merkle_batch b = {keys, nk, NULL, vals, nv, NULL, N, mode};
                CHECK(sj_merkle_update(&got, &b, 1, &err, &ec) == SJ_OK, "update %d %d %d", nk,
                      nv, mode);
                sj_merkle_refresh(&got);
                CHECK(memcmp(want.nodes, got.nodes, (size_t)P * sj_merkle_node_count(D) * 4) == 0,
                      "fused build, keys %d values %d mode %d", nk, nv, mode);
                /* Precomputed hashes give the same forest. */
                sj_merkle_batch h = {NULL, 0, kh, NULL, 0, vh, N, mode};
                sj_merkle_update(&got, &h, -1, &err, &ec);
                sj_merkle_refresh(&got);
                int zero = 1;
                for (int64_t i = 0; i < P * sj_merkle_node_count(D); i++) zero &= got.nodes[i] == 0;
                CHECK(zero, "hashes remove what columns added, keys %d values %d mode %d", nk,
                      nv, mode);
                free_forest(&want);
                free_forest(&got);
            }
        }
    }
}

/* Builds a and b over the same random keys, then changes a few entries of b. */
static void two_forests(sj_merkle_forest *a, sj_merkle_forest *b, int32_t *kh, int32_t *vh,
                        int n, int changes) {
    int64_t err;
    int32_t ec;
    for (int i = 0; i < n; i++) {
        kh[i] = (int32_t)test_random();
        vh[i] = (int32_t)test_random();
    }
    sj_merkle_batch all = {NULL, 0, kh, NULL, 0, vh, n, SJ_MERKLE_VALUE_HASH};
    sj_merkle_update(a, &all, 1, &err, &ec);
    sj_merkle_update(b, &all, 1, &err, &ec);
    for (int c = 0; c < changes; c++) {
        int i = (int)(test_random() % (uint64_t)n);
        int32_t newv = (int32_t)test_random();
        sj_merkle_batch old = {NULL, 0, &kh[i], NULL, 0, &vh[i], 1, SJ_MERKLE_VALUE_HASH};
        sj_merkle_batch neu = {NULL, 0, &kh[i], NULL, 0, &newv, 1, SJ_MERKLE_VALUE_HASH};
        sj_merkle_update(b, &old, -1, &err, &ec);
        sj_merkle_update(b, &neu, 1, &err, &ec);
        vh[i] = newv;
    }
    sj_merkle_refresh(a);
    sj_merkle_refresh(b);
}

static void test_diff(void) {
    enum { N = 5000, P = 7 };
    static int32_t kh[N], vh[N];
    static int64_t out[1 << 16];
    int64_t compared[SJ_MERKLE_MAX_DEPTH], count;
    for (int da = 2; da <= 12; da += 5) {
        for (int db = 2; db <= 12; db += 5) {
            for (int changes = 0; changes <= 40; changes += 20) {
                sj_merkle_forest a = new_forest(P, da), b = new_forest(P, db);
                two_forests(&a, &b, kh, vh, N, changes);
                int32_t d = da < db ? da : db;
                CHECK(sj_merkle_diff(&a, &b, out, 1 << 16, &count, compared) == SJ_OK, "diff");
                /* Brute force: every leaf of the common depth (a prefix of both trees). */
                int64_t want = 0, leaves = (int64_t)1 << (d - 1);
                for (int32_t p = 0; p < P; p++) {
                    for (int64_t l = 0; l < leaves; l++) {
                        int32_t node = (int32_t)(leaves - 1 + l);
                        if (tree_of(&a, p)[node] != tree_of(&b, p)[node]) {
                            CHECK(want < count && out[want] == p * leaves + l,
                                  "diff %d/%d leaf %ld", da, db, (long)(p * leaves + l));
                            want++;
                        }
                    }
                }
                CHECK(count == want, "diff %d/%d: %ld leaves, brute force %ld", da, db,
                      (long)count, (long)want);
                CHECK(compared[0] == P, "roots compared %ld", (long)compared[0]);
                CHECK(changes > 0 || count == 0, "identical data, no difference");
                /* Only children of differing nodes are compared: never more than
                 * two per differing leaf per level. */
                for (int32_t l = 1; l < d; l++)
                    CHECK(compared[l] <= 2 * (count < P << l ? count : P << l), "level %d", l);
                int64_t few;
                CHECK(sj_merkle_diff(&a, &b, out, 0, &few, NULL) == SJ_OK && few == count,
                      "count without room");
                free_forest(&a);
                free_forest(&b);
            }
        }
    }
    sj_merkle_forest a = new_forest(3, 4), b = new_forest(4, 4);
    CHECK(sj_merkle_diff(&a, &b, out, 1, &count, NULL) == SJ_EINVAL, "partition counts differ");
    free_forest(&a);
    free_forest(&b);
}

static void test_locate_and_select(void) {
    enum { N = 9000, P = 271, D = 11 };
    static int64_t keys[N], ids[30000];
    static int32_t parts[N], leaves[N];
    static uint8_t mask[(N + 7) / 8];
    for (int i = 0; i < N; i++) keys[i] = (int64_t)test_random();
    sj_column c = test_column(SJ_KEY_INT64, keys, N, sizeof keys);
    int64_t err, selected;
    int32_t ec;
    CHECK(sj_merkle_locate(&c, 1, D, P, parts, leaves, &err, &ec) == SJ_OK, "locate");
    int32_t kh[N];
    sj_hash_column(&c, SJ_HAZELCAST_SEED, kh, &err);
    for (int i = 0; i < N; i++) {
        CHECK(parts[i] == sj_partition_of_hash(kh[i], P), "partition of row %d", i);
        CHECK(leaves[i] == sj_merkle_leaf_of_hash(kh[i], D), "leaf of row %d", i);
    }
    const int64_t nleaves = 1 << (D - 1);
    /* 64 leaves: the coarse filter path; 30000: the dense, branch-free path. */
    static const int counts[] = {64, 30000};
    for (int k = 0; k < 2; k++) {
        int nids = counts[k];
        for (int j = 0; j < nids; j++) {
            int i = (int)(test_random() % N);
            ids[j] = k == 0 ? parts[i] * nleaves + (leaves[i] - (nleaves - 1))
                            : (int64_t)(test_random() % (uint64_t)(P * nleaves));
        }
        sj_merkle_leaf_set set;
        CHECK(sj_merkle_leaf_set_init(&set, D, P, ids, nids, &err) == SJ_OK, "leaf set");
        CHECK((set.coarse != NULL) == (k == 0), "coarse filter only for a sparse set");
        CHECK(sj_merkle_select(&c, 1, &set, mask, &selected, &err, &ec) == SJ_OK, "select");
        sj_merkle_leaf_set_free(&set);
        static uint8_t wanted[P * (1 << (D - 1))];
        memset(wanted, 0, sizeof wanted);
        for (int j = 0; j < nids; j++) wanted[ids[j]] = 1;
        int64_t want = 0;
        for (int i = 0; i < N; i++) {
            int64_t id = parts[i] * nleaves + (leaves[i] - (nleaves - 1));
            want += wanted[id];
            CHECK(((mask[i >> 3] >> (i & 7)) & 1) == wanted[id], "row %d, %d ids", i, nids);
        }
        CHECK(selected == want && want >= (k == 0 ? nids / 2 : N / 20), "selected %ld of %ld",
              (long)selected, (long)want);
    }
    ids[3] = P * nleaves;
    sj_merkle_leaf_set set;
    CHECK(sj_merkle_leaf_set_init(&set, D, P, ids, 64, &err) == SJ_EINVAL && err == 3 &&
              set.fine == NULL, "leaf id out of range");
    CHECK(sj_merkle_leaf_set_init(&set, D, P, ids, 3, &err) == SJ_OK && set.count <= 3, "set");
    c.length = 0;
    CHECK(sj_merkle_select(&c, 1, &set, mask, &selected, &err, &ec) == SJ_OK && selected == 0,
          "no rows");
    sj_merkle_leaf_set_free(&set);
    sj_merkle_leaf_set_free(&set); /* twice is harmless */
}

static void test_serialization(void) {
    enum { D = 5, P = 9 };
    static int32_t kh[300], vh[300];
    sj_merkle_forest a = new_forest(P, D), b = new_forest(P, D);
    two_forests(&a, &b, kh, vh, 300, 0);
    int64_t size = sj_merkle_serialized_size(D);
    CHECK(size == 24 + 4 * 16, "size %ld", (long)size);
    uint8_t *buf = (uint8_t *)malloc((size_t)size + 8);
    CHECK(sj_merkle_write(tree_of(&a, 4), D, 4, P, SJ_MERKLE_ENTRY_HASH, buf, size) == SJ_OK,
          "write");
    CHECK(sj_merkle_write(tree_of(&a, 4), D, 4, P, 0, buf, size - 1) == SJ_EBOUNDS, "short out");
    CHECK(sj_merkle_write(tree_of(&a, 4), D, P, P, 0, buf, size) == SJ_EINVAL,
          "partition >= count");
    sj_merkle_write(tree_of(&a, 4), D, 4, P, SJ_MERKLE_ENTRY_HASH, buf, size);
    sj_merkle_header h;
    int64_t off;
    const char *field;
    CHECK(sj_merkle_read_header(buf, size, &h, &off, &field) == SJ_OK, "read header");
    CHECK(h.depth == D && h.partition == 4 && h.partition_count == P && h.size == size &&
              h.mode == SJ_MERKLE_ENTRY_HASH, "header fields");
    int32_t tree[31];
    memset(tree, 0x5a, sizeof tree);
    CHECK(sj_merkle_read_tree(buf, size, &h, tree) == SJ_OK, "read tree");
    CHECK(memcmp(tree, tree_of(&a, 4), sizeof tree) == 0, "round trip, inner nodes recomputed");
    for (int64_t cut = 0; cut < size; cut++) {
        sj_status st = sj_merkle_read_header(buf, cut, &h, &off, &field);
        CHECK(st == SJ_EBOUNDS && off == cut && field, "truncated at %ld: %d", (long)cut, st);
    }
    for (int64_t i = 0; i < size; i++) {
        for (int bit = 0; bit < 8; bit++) {
            buf[i] ^= (uint8_t)(1u << bit);
            sj_status st = sj_merkle_read_header(buf, size, &h, &off, &field);
            CHECK(st != SJ_OK && field && off >= 0 && off < size, "flipped bit %d of byte %ld", bit,
                  (long)i);
            buf[i] ^= (uint8_t)(1u << bit);
        }
    }
    CHECK(sj_merkle_read_header(buf, size + 8, &h, &off, &field) == SJ_OK,
          "trailing bytes are the next record's");
    buf[6] = 28;
    CHECK(sj_merkle_read_header(buf, size, &h, &off, &field) == SJ_ECORRUPT && off == 6 &&
              strcmp(field, "depth") == 0, "depth 28");
    free(buf);
    free_forest(&a);
    free_forest(&b);
}

static void test_bad_input(void) {
    int64_t err;
    int32_t ec, k[4] = {1, 2, 3, 4};
    sj_merkle_forest f = new_forest(2, 3);
    sj_column keys = test_column(SJ_KEY_INT32, k, 4, sizeof k);
    sj_column short_values = test_column(SJ_KEY_INT32, k, 3, sizeof k);
    sj_merkle_batch b = {&keys, 1, NULL, &short_values, 1, NULL, 4, SJ_MERKLE_VALUE_HASH};
    CHECK(sj_merkle_update(&f, &b, 1, &err, &ec) == SJ_EINVAL && ec == 1, "value column too short");
    keys.values_size = 8;
    b.values = NULL;
    b.value_count = 0;
    CHECK(sj_merkle_update(&f, &b, 1, &err, &ec) == SJ_EBOUNDS && ec == 0, "key buffer too small");
    keys.values_size = sizeof k;
    CHECK(sj_merkle_update(&f, &b, 2, &err, &ec) == SJ_EINVAL, "sign 2");
    b.mode = 7;
    CHECK(sj_merkle_update(&f, &b, 1, &err, &ec) == SJ_EINVAL, "mode 7");
    b.mode = 0;
    b.keys = NULL;
    b.key_count = 0;
    CHECK(sj_merkle_update(&f, &b, 1, &err, &ec) == SJ_EINVAL, "no keys");
    f.depth = 28;
    CHECK(sj_merkle_refresh(&f) == SJ_EINVAL, "depth 28");
    f.depth = 1;
    CHECK(sj_merkle_forest_check(&f) == SJ_EINVAL, "depth 1");
    f.depth = 3;
    int64_t big[] = {(int64_t)1 << 40};
    sj_column wide = test_column(SJ_KEY_INT64_AS_INT32, big, 1, sizeof big);
    b.keys = &wide;
    b.key_count = 1;
    b.rows = 1;
    CHECK(sj_merkle_update(&f, &b, 1, &err, &ec) == SJ_ERANGE && err == 0 && ec == 0, "range");
    free_forest(&f);

    /* All or nothing: a bad key in the third block leaves the forest untouched. */
    enum { N = 3 * 4096 + 10 };
    static int64_t wide_keys[N];
    for (int i = 0; i < N; i++) wide_keys[i] = (int32_t)test_random();
    wide_keys[2 * 4096 + 7] = (int64_t)1 << 33;
    f = new_forest(5, 6);
    sj_column narrow = test_column(SJ_KEY_INT64_AS_INT32, wide_keys, N, sizeof wide_keys);
    sj_merkle_batch all = {&narrow, 1, NULL, NULL, 0, NULL, N, SJ_MERKLE_ENTRY_HASH};
    CHECK(sj_merkle_update(&f, &all, 1, &err, &ec) == SJ_ERANGE && err == 2 * 4096 + 7,
          "range in block 3: %ld", (long)err);
    sj_merkle_refresh(&f);
    int zero = 1;
    for (int64_t i = 0; i < 5 * sj_merkle_node_count(6); i++) zero &= f.nodes[i] == 0;
    CHECK(zero, "failed update rolled back");
    free_forest(&f);
}

int main(void) {
    test_hazelcast_vector();
    test_leaf_rule();
    test_fused_build();
    test_diff();
    test_locate_and_select();
    test_serialization();
    test_bad_input();
    printf("%s: merkle, %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
