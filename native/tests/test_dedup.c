/* Native tests of the deduplication map against a plain reference. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/dedup.h"

#include "check.h"

enum { KEYS = 97, ROWS = 200000, WITHIN = 50 };

/* Row by row with an array indexed by key: the behaviour the map must have. */
static int64_t reference(const int64_t *keys, const int64_t *times, int64_t n, int64_t *passed,
                         uint8_t *seen, uint8_t *keep) {
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = keys[i] % KEYS;
        keep[i] = !seen[k] || times[i] >= passed[k] + WITHIN;
        if (keep[i]) {
            seen[k] = 1;
            passed[k] = times[i];
            kept++;
        }
    }
    return kept;
}

int main(void) {
    static int64_t keys[ROWS], times[ROWS], ref_passed[KEYS];
    static uint8_t keep[ROWS], want[ROWS], seen[KEYS];
    uint64_t x = 12345;
    for (int64_t i = 0; i < ROWS; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        keys[i] = (int64_t)((x >> 33) % KEYS);
        times[i] = i / 64;
    }
    sj_dedupmap *m = sj_dedupmap_new(0);
    CHECK(m != NULL, "new");
    int64_t kept, done, total = 0;
    for (int64_t lo = 0; lo < ROWS; lo += 1000) {
        CHECK(sj_dedupmap_process(m, keys + lo, times + lo, 1000, WITHIN, INT64_MIN, keep + lo,
                                  &kept, &done) == SJ_OK, "process");
        CHECK(done == 1000, "done");
        total += kept;
    }
    int64_t want_kept = reference(keys, times, ROWS, ref_passed, seen, want);
    CHECK(total == want_kept, "kept %lld, want %lld", (long long)total, (long long)want_kept);
    CHECK(memcmp(keep, want, ROWS) == 0, "same rows pass");
    CHECK(sj_dedupmap_size(m) == KEYS, "size %lld", (long long)sj_dedupmap_size(m));

    /* Export, then restore into a new map: the same entries. */
    int64_t ek[KEYS], ep[KEYS];
    CHECK(sj_dedupmap_export(m, INT64_MIN, ek, ep, KEYS) == KEYS, "export all");
    sj_dedupmap *r = sj_dedupmap_new(0);
    CHECK(r != NULL && sj_dedupmap_insert(r, ek, ep, KEYS, &done) == SJ_OK && done == KEYS, "insert");
    for (int k = 0; k < KEYS; k++) CHECK(ep[k] == ref_passed[ek[k]], "passed of key %lld", (long long)ek[k]);
    int64_t limit = times[ROWS - 1] - 10;
    int64_t live = sj_dedupmap_live(r, limit);
    CHECK(sj_dedupmap_evict(r, limit) == SJ_OK && sj_dedupmap_size(r) == live, "evict");

    /* Many distinct keys with an eviction limit: the table stays small. */
    sj_dedupmap *big = sj_dedupmap_new(0);
    CHECK(big != NULL, "new");
    for (int64_t i = 0; i < ROWS; i++) keys[i] = i, times[i] = i;
    for (int64_t lo = 0; lo < ROWS; lo += 1000) {
        CHECK(sj_dedupmap_process(big, keys + lo, times + lo, 1000, WITHIN, lo - 2000, keep + lo,
                                  &kept, &done) == SJ_OK && kept == 1000, "distinct keys pass");
    }
    CHECK(sj_dedupmap_size(big) < 20000, "held %lld", (long long)sj_dedupmap_size(big));

    /* Times near the ends of int64: no overflow decides a row. */
    int64_t k1[3] = {7, 7, 7}, t1[3] = {INT64_MAX - 1, INT64_MAX, INT64_MIN};
    sj_dedupmap *edge = sj_dedupmap_new(0);
    CHECK(sj_dedupmap_process(edge, k1, t1, 3, WITHIN, INT64_MIN, keep, &kept, &done) == SJ_OK,
          "edge");
    CHECK(kept == 1 && keep[0] == 1 && keep[1] == 0 && keep[2] == 0, "edge rows");
    CHECK(sj_dedupmap_process(edge, k1, t1, 3, -1, INT64_MIN, keep, &kept, &done) == SJ_EINVAL,
          "negative within");

    sj_dedupmap_free(m);
    sj_dedupmap_free(r);
    sj_dedupmap_free(big);
    sj_dedupmap_free(edge);
    printf("%s: dedup, %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
