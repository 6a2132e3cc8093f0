/* Native tests of the hash kernels, runnable without Python: `make -C native test`.
 * Checks HAZELCAST.md's vectors, the divisor against `%` on every count up to
 * 5000 and on edge dividends, and the AVX2 kernels against the portable ones. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/hash.h"

#include "check.h"

static void test_vectors(void) {
    CHECK(sj_murmur3_32("hello", 5, 0) == 0x248bfa47, "murmur3(hello, 0)");
    int32_t ints[] = {0, 1, -1, 42, 2147483647};
    uint32_t int_hashes[] = {0x37077d1e, 0x2dd58a5a, 0xd47aa21b, 0x7bc270a3, 0xdeb6ec0d};
    int32_t int_parts[] = {11, 31, 164, 175, 129};
    int32_t out[8];
    int64_t err;
    sj_column c = test_column(SJ_KEY_INT32, ints, 5, sizeof ints);
    CHECK(sj_hash_column(&c, SJ_HAZELCAST_SEED, out, &err) == SJ_OK, "hash ints");
    for (int i = 0; i < 5; i++) CHECK((uint32_t)out[i] == int_hashes[i], "Integer %d", ints[i]);
    CHECK(sj_partition_column(&c, 271, out, &err) == SJ_OK, "partition ints");
    for (int i = 0; i < 5; i++) CHECK(out[i] == int_parts[i], "Integer %d partition %d", ints[i], out[i]);

    int64_t longs[] = {0, (int64_t)1 << 40};
    c = test_column(SJ_KEY_INT64, longs, 2, sizeof longs);
    CHECK(sj_partition_column(&c, 271, out, &err) == SJ_OK, "partition longs");
    CHECK(out[0] == 109 && out[1] == 122, "Long partitions %d %d", out[0], out[1]);

    const char data[] = "ahello\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87\xe6\x97\xa5\xe6\x9c\xac";
    int32_t offsets[] = {0, 0, 1, 6, 14, 20};
    int32_t str_parts[] = {11, 73, 270, 265, 220};
    c = test_column(SJ_KEY_VAR32, offsets, 5, sizeof offsets);
    c.data = (const uint8_t *)data;
    c.data_size = 20;
    CHECK(sj_partition_column(&c, 271, out, &err) == SJ_OK, "partition strings");
    for (int i = 0; i < 5; i++) CHECK(out[i] == str_parts[i], "String %d partition %d", i, out[i]);

    /* Java's rule for INT32_MIN, which the Python client gets wrong. */
    CHECK(sj_partition_of_hash(INT32_MIN, 271) == 0, "INT32_MIN");
    int32_t hmin = INT32_MIN;
    sj_partitions_from_hashes(&hmin, 1, 271, out);
    CHECK(out[0] == 0, "INT32_MIN via divisor");
}

static void test_divisor(void) {
    for (int32_t d = 1; d <= 5000; d++) {
        for (int t = 0; t < 200; t++) {
            int32_t h = (int32_t)(uint32_t)test_random();
            if (t == 0) h = INT32_MAX;
            if (t == 1) h = -INT32_MAX;
            if (t == 2) h = INT32_MIN;
            int32_t got;
            sj_partitions_from_hashes(&h, 1, d, &got);
            CHECK(got == sj_partition_of_hash(h, d), "d=%d h=%d got %d", d, h, got);
        }
    }
    int32_t big[] = {INT32_MAX, INT32_MAX - 1, 1 << 30, (1 << 30) + 1, 65537, 999999937};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        for (int t = 0; t < 20000; t++) {
            int32_t h = (int32_t)(uint32_t)test_random(), got;
            if (t < 3) h = t == 0 ? INT32_MAX : t == 1 ? big[i] - 1 : big[i];
            sj_partitions_from_hashes(&h, 1, big[i], &got);
            CHECK(got == sj_partition_of_hash(h, big[i]), "d=%d h=%d", big[i], h);
        }
    }
}

/* Every kernel the CPU offers must agree with the portable ones. */
static void test_kernels_agree(void) {
    enum { N = 4099 };
    static int64_t longs[N];
    static int32_t ints[N], a[N], b[N];
    static int32_t offsets[N + 1];
    static uint8_t data[N * 80];
    int64_t err;
    int32_t pos = 0;
    for (int i = 0; i < N; i++) {
        longs[i] = (int64_t)test_random();
        ints[i] = (int32_t)test_random();
        offsets[i] = pos;
        int len = (int)(test_random() % 80);
        for (int j = 0; j < len; j++) data[pos++] = (uint8_t)test_random();
    }
    offsets[N] = pos;
    sj_column cols[3] = {test_column(SJ_KEY_INT32, ints, N, sizeof ints),
                         test_column(SJ_KEY_INT64, longs, N, sizeof longs),
                         test_column(SJ_KEY_VAR32, offsets, N, sizeof offsets)};
    cols[2].data = data;
    cols[2].data_size = pos;
    const char *name;
    for (int k = 0; (name = sj_hash_kernel_available(k)) != NULL; k++) {
        for (int c = 0; c < 3; c++) {
            for (int part = 0; part < 2; part++) {
                sj_hash_select_kernel("generic");
                if (part) sj_partition_column(&cols[c], 271, a, &err);
                else sj_hash_column(&cols[c], SJ_HAZELCAST_SEED, a, &err);
                CHECK(sj_hash_select_kernel(name) == SJ_OK, "select %s", name);
                if (part) sj_partition_column(&cols[c], 271, b, &err);
                else sj_hash_column(&cols[c], SJ_HAZELCAST_SEED, b, &err);
                CHECK(memcmp(a, b, sizeof a) == 0, "kernel %s disagrees on column %d", name, c);
            }
        }
    }
    sj_hash_select_kernel(NULL);
    CHECK(sj_hash_select_kernel("no-such-kernel") == SJ_EINVAL, "unknown kernel");
    /* A composite of one column is that column's hash. */
    int32_t rc;
    for (int c = 0; c < 3; c++) {
        sj_hash_column(&cols[c], SJ_HAZELCAST_SEED, a, &err);
        CHECK(sj_hash_rows(&cols[c], 1, SJ_HAZELCAST_SEED, b, &err, &rc) == SJ_OK, "rows");
        CHECK(memcmp(a, b, sizeof a) == 0, "composite of column %d", c);
    }
}

static void test_bounds(void) {
    int32_t offsets[] = {0, 3, 100};
    int32_t out[2];
    int64_t err;
    sj_column c = test_column(SJ_KEY_VAR32, offsets, 2, sizeof offsets);
    c.data = (const uint8_t *)"abcdef";
    c.data_size = 6;
    CHECK(sj_partition_column(&c, 271, out, &err) == SJ_EBOUNDS && err == 1, "offset past data");
    offsets[1] = -1;
    CHECK(sj_partition_column(&c, 271, out, &err) == SJ_EBOUNDS && err == 0, "negative offset");
    c.values_size = 8; /* only two offsets for two values */
    CHECK(sj_partition_column(&c, 271, out, &err) == SJ_EBOUNDS, "short offsets buffer");
    int64_t big[] = {1, (int64_t)1 << 31};
    c = test_column(SJ_KEY_INT64_AS_INT32, big, 2, sizeof big);
    CHECK(sj_partition_column(&c, 271, out, &err) == SJ_ERANGE && err == 1, "int64 as Integer");
    CHECK(sj_partition_column(&c, 0, out, &err) == SJ_EINVAL, "partition_count 0");
}

int main(void) {
    test_vectors();
    test_divisor();
    test_kernels_agree();
    test_bounds();
    printf("%s: kernels", failures ? "FAIL" : "ok");
    for (int k = 0; sj_hash_kernel_available(k); k++) printf(" %s", sj_hash_kernel_available(k));
    printf(", %d failed\n", failures);
    return failures != 0;
}
