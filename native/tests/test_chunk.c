/* Native tests of chunk headers, scanning, scatter and entry lists. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/chunk.h"

#include "check.h"

static sj_chunk_header sample(void) {
    sj_chunk_header h;
    memset(&h, 0, sizeof h);
    h.codec = SJ_CODEC_LZ4;
    h.flags = SJ_CHUNK_ENTRIES;
    h.job_id = 0x1122334455667788ull;
    h.snapshot_id = 41;
    h.vertex = 3;
    h.partition = 270;
    h.entry_count = 5;
    h.uncompressed_size = 100;
    h.stored_size = 10;
    h.checksum = 0xdeadbeefcafef00dull;
    return h;
}

static void test_header(void) {
    uint8_t buf[SJ_CHUNK_HEADER_SIZE + 10];
    memset(buf, 0xab, sizeof buf);
    sj_chunk_header h = sample(), g;
    const char *bad;
    CHECK(sj_chunk_header_encode(&h, buf) == SJ_OK, "encode");
    CHECK(memcmp(buf, "SJCK", 4) == 0, "magic bytes");
    CHECK(sj_chunk_header_decode(buf, sizeof buf, &g, &bad) == SJ_OK, "decode");
    CHECK(g.job_id == h.job_id && g.snapshot_id == 41 && g.vertex == 3 && g.partition == 270 &&
              g.entry_count == 5 && g.uncompressed_size == 100 && g.stored_size == 10 &&
              g.checksum == h.checksum && g.codec == SJ_CODEC_LZ4 && g.flags == SJ_CHUNK_ENTRIES &&
              g.version == SJ_CHUNK_VERSION,
          "round trip");
    /* Every single-bit flip of the header is caught. */
    for (int i = 0; i < SJ_CHUNK_HEADER_SIZE * 8; i++) {
        buf[i / 8] ^= (uint8_t)(1u << (i % 8));
        CHECK(sj_chunk_header_decode(buf, sizeof buf, &g, &bad) == SJ_ECORRUPT && bad,
              "bit %d not caught", i);
        buf[i / 8] ^= (uint8_t)(1u << (i % 8));
    }
    /* Truncation anywhere is caught. */
    for (size_t n = 0; n < sizeof buf; n++)
        CHECK(sj_chunk_header_decode(buf, n, &g, &bad) == SJ_ECORRUPT, "truncated at %zu", n);
    h.codec = 9;
    CHECK(sj_chunk_header_encode(&h, buf) == SJ_EINVAL, "bad codec refused");
    h = sample();
    h.codec = SJ_CODEC_RAW;
    CHECK(sj_chunk_header_encode(&h, buf) == SJ_EINVAL, "raw with sizes that differ");
    h = sample();   /* an entry list */
    h.codec = SJ_CODEC_BLOSC2_LZ4;
    CHECK(sj_chunk_header_encode(&h, buf) == SJ_EINVAL, "a Blosc2 entry list refused");
    h.flags = 0;
    CHECK(sj_chunk_header_encode(&h, buf) == SJ_OK, "a Blosc2 table chunk");
    CHECK(sj_chunk_header_decode(buf, sizeof buf, &g, &bad) == SJ_OK && g.codec == SJ_CODEC_BLOSC2_LZ4,
          "Blosc2 decode");
    h = sample();
    h.flags = SJ_CHUNK_BROADCAST;
    h.partition = -1;
    CHECK(sj_chunk_header_encode(&h, buf) == SJ_OK, "broadcast");
    CHECK(sj_chunk_header_decode(buf, sizeof buf, &g, &bad) == SJ_OK && g.partition == -1, "broadcast decode");
    h.partition = 3;
    sj_chunk_header_encode(&h, buf);
    CHECK(sj_chunk_header_decode(buf, sizeof buf, &g, &bad) == SJ_ECORRUPT && strcmp(bad, "partition") == 0,
          "broadcast needs partition -1");
}

static void test_scan(void) {
    uint8_t buf[3 * SJ_CHUNK_HEADER_SIZE + 30];
    sj_chunk_header h = sample(), hs[4];
    int64_t offs[4];
    size_t count, err;
    const char *bad;
    size_t pos = 0;
    for (int i = 0; i < 3; i++) {
        h.partition = i;
        sj_chunk_header_encode(&h, buf + pos);
        memset(buf + pos + SJ_CHUNK_HEADER_SIZE, i, 10);
        pos += SJ_CHUNK_HEADER_SIZE + 10;
    }
    CHECK(sj_chunk_scan(buf, pos, offs, hs, 4, &count, &err, &bad) == SJ_OK && count == 3, "scan");
    CHECK(offs[2] == 2 * (SJ_CHUNK_HEADER_SIZE + 10) && hs[2].partition == 2, "scan offsets");
    CHECK(sj_chunk_scan(buf, pos, offs, hs, 2, &count, &err, &bad) == SJ_ERANGE, "scan cap");
    CHECK(sj_chunk_scan(buf, pos - 1, offs, hs, 4, &count, &err, &bad) == SJ_ECORRUPT &&
              err == 2 * (SJ_CHUNK_HEADER_SIZE + 10),
          "truncated last chunk at its offset");
    CHECK(sj_chunk_scan(buf, pos + 0, offs, hs, 4, &count, &err, &bad) == SJ_OK, "exact");
}

/* The write-combining path (from 1 MiB and 64 partitions): the same order as moving the
 * values one by one, for 8- and 4-byte values, a destination starting anywhere in a cache
 * line, a hot partition and an empty one; guard bytes around the destination stay as they
 * were, and an id past its run is refused. */
static void test_scatter_large(void) {
    enum { N = 300000, P = 200, GUARD = 64 };
    int32_t *parts = malloc(sizeof(int32_t) * N);
    int64_t *starts = malloc(sizeof(int64_t) * (P + 1)), err;
    uint64_t *vals = malloc(sizeof(uint64_t) * N), *want = malloc(sizeof(uint64_t) * N);
    int64_t *cur = malloc(sizeof(int64_t) * P);
    uint8_t *raw = malloc(sizeof(uint64_t) * N + 2 * GUARD + 64);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < N; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        parts[i] = (x % 10 < 3) ? 5 : (int32_t)(x % P);
        if (parts[i] == 9) parts[i] = 10; /* partition 9 stays empty */
        vals[i] = x;
    }
    CHECK(sj_scatter_by_partition(parts, N, P, starts, NULL, &err) == SJ_OK, "large starts");
    for (int width = 8; width >= 4; width -= 4) {
        memcpy(cur, starts, sizeof(int64_t) * P);
        for (int i = 0; i < N; i++)
            memcpy((uint8_t *)want + (size_t)width * (size_t)cur[parts[i]]++,
                   (uint8_t *)vals + (size_t)width * (size_t)i, (size_t)width);
        int64_t n = N; /* 2.4 and 1.2 MB: both past 1 MiB */
        for (int shift = 0; shift < 64; shift += width) {
            uint8_t *dst = raw + GUARD + shift;
            memset(raw, 0xa5, sizeof(uint64_t) * N + 2 * GUARD + 64);
            CHECK(sj_scatter_fixed((const uint8_t *)vals, width, n, parts, starts, P, dst) == SJ_OK,
                  "large scatter");
            CHECK(memcmp(dst, want, (size_t)width * (size_t)n) == 0, "large scatter order");
            int clean = 1;
            for (int g = 0; g < GUARD + shift; g++) clean &= raw[g] == 0xa5;
            for (int g = 0; g < GUARD; g++) clean &= dst[(size_t)width * (size_t)n + g] == 0xa5;
            CHECK(clean, "large scatter writes nothing outside dst");
        }
    }
    parts[N - 1] = 9; /* a value for the empty partition */
    CHECK(sj_scatter_fixed((const uint8_t *)vals, 8, N, parts, starts, P, raw + GUARD) == SJ_EINVAL,
          "large scatter refuses an overfull run");
    free(parts), free(starts), free(vals), free(want), free(cur), free(raw);
}

static void test_scatter(void) {
    int32_t parts[] = {2, 0, 2, 1, 0, 2};
    int64_t starts[4], perm[6], err;
    CHECK(sj_scatter_by_partition(parts, 6, 3, starts, perm, &err) == SJ_OK, "scatter");
    int64_t want_starts[] = {0, 2, 3, 6}, want_perm[] = {1, 4, 3, 0, 2, 5};
    CHECK(memcmp(starts, want_starts, sizeof starts) == 0, "starts");
    CHECK(memcmp(perm, want_perm, sizeof perm) == 0, "stable perm");
    int64_t vals[6] = {10, 11, 12, 13, 14, 15}, moved[6];
    CHECK(sj_scatter_fixed((const uint8_t *)vals, 8, 6, parts, starts, 3, (uint8_t *)moved) == SJ_OK, "scatter fixed");
    int64_t want_moved[] = {11, 14, 13, 10, 12, 15};
    CHECK(memcmp(moved, want_moved, sizeof moved) == 0, "scatter fixed order");
    char wide[6][3] = {"a0", "b1", "c2", "d3", "e4", "f5"}, wide_out[6][3];
    sj_scatter_fixed((const uint8_t *)wide, 3, 6, parts, starts, 3, (uint8_t *)wide_out);
    CHECK(strcmp(wide_out[0], "b1") == 0 && strcmp(wide_out[5], "f5") == 0, "scatter odd width");
    /* Ids or run starts that do not match are refused, never written past dst. */
    int64_t good_starts[4];
    memcpy(good_starts, starts, sizeof starts);
    parts[1] = 2; /* partition 2 now has four values for a run of three */
    CHECK(sj_scatter_fixed((const uint8_t *)vals, 8, 6, parts, starts, 3, (uint8_t *)moved) == SJ_EINVAL, "overfull run");
    parts[1] = 7;
    CHECK(sj_scatter_fixed((const uint8_t *)vals, 8, 6, parts, starts, 3, (uint8_t *)moved) == SJ_EINVAL, "bad id, fixed");
    parts[1] = 0;
    starts[3] = 7;
    CHECK(sj_scatter_fixed((const uint8_t *)vals, 8, 6, parts, starts, 3, (uint8_t *)moved) == SJ_EINVAL, "starts past n");
    memcpy(starts, good_starts, sizeof starts);
    starts[1] = 4;
    CHECK(sj_scatter_fixed((const uint8_t *)wide, 3, 6, parts, starts, 3, (uint8_t *)wide_out) == SJ_EINVAL, "decreasing starts");
    parts[4] = 3;
    CHECK(sj_scatter_by_partition(parts, 6, 3, starts, perm, &err) == SJ_EINVAL && err == 4, "bad id");
    parts[4] = -1;
    CHECK(sj_scatter_by_partition(parts, 6, 3, starts, perm, &err) == SJ_EINVAL && err == 4, "negative id");
}

static void test_entries(void) {
    const char *kd = "k1key2", *vd = "valuevv";
    int32_t ko[] = {0, 2, 2, 6}, vo[] = {0, 5, 7, 7};
    sj_binary keys = {ko, sizeof ko, (const uint8_t *)kd, 6, 0, 3};
    sj_binary values = {vo, sizeof vo, (const uint8_t *)vd, 7, 0, 3};
    int64_t sizes[3], err, rows[] = {2, 0};
    CHECK(sj_entries_sizes(&keys, &values, sizes, &err) == SJ_OK, "sizes");
    CHECK(sizes[0] == 15 && sizes[1] == 10 && sizes[2] == 12, "sizes values");
    uint8_t out[64];
    size_t written, eo;
    CHECK(sj_entries_encode(&keys, &values, rows, 2, out, sizeof out, &written) == SJ_OK && written == 27, "encode");
    size_t short_written;
    uint8_t small[26];
    CHECK(sj_entries_encode(&keys, &values, rows, 2, small, sizeof small, &short_written) == SJ_ERANGE,
          "encode cap");
    int64_t kb, vb;
    CHECK(sj_entries_measure(out, written, 2, &kb, &vb, &eo) == SJ_OK && kb == 6 && vb == 5, "measure");
    for (size_t n = 0; n < written; n++)
        CHECK(sj_entries_measure(out, n, 2, &kb, &vb, &eo) == SJ_ECORRUPT, "truncated %zu", n);
    CHECK(sj_entries_measure(out, written, 1, &kb, &vb, &eo) == SJ_ECORRUPT, "count too small");
    CHECK(sj_entries_measure(out, written, 3, &kb, &vb, &eo) == SJ_ECORRUPT, "count too large");
    int32_t dko[3], dvo[3];
    uint8_t dk[16], dv[16];
    CHECK(sj_entries_decode(out, written, 2, 10, dko, dk, 0, dvo, dv) == SJ_OK, "decode");
    CHECK(dko[0] == 10 && dko[1] == 14 && dko[2] == 16 && memcmp(dk, "key2k1", 6) == 0, "keys");
    CHECK(dvo[0] == 0 && dvo[1] == 0 && dvo[2] == 5 && memcmp(dv, "value", 5) == 0, "values");
    ko[2] = 99; /* an offset outside the data */
    CHECK(sj_entries_sizes(&keys, &values, sizes, &err) == SJ_EBOUNDS && err == 1, "bounds");
}

int main(void) {
    test_header();
    test_scan();
    test_scatter();
    test_scatter_large();
    test_entries();
    printf("%s: chunk, %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
