/* Native tests of the keyed-state map and aggregate kernels. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/keyed.h"

#include "check.h"

int main(void) {
    enum { N = 100000 };
    static int64_t keys[N], slots[N], again[N];
    sj_keymap *m = sj_keymap_new(0);
    CHECK(m != NULL, "new");
    for (int64_t i = 0; i < N; i++) keys[i] = (i * 7919) % 30011 - 15000; /* repeats, negatives */
    CHECK(sj_keymap_upsert(m, keys, N, slots) == SJ_OK, "upsert");
    CHECK(sj_keymap_size(m) == 30011, "size %lld", (long long)sj_keymap_size(m));
    const int64_t *dense = sj_keymap_keys(m);
    for (int64_t i = 0; i < N; i++) CHECK(dense[slots[i]] == keys[i], "slot of row %lld", (long long)i);
    CHECK(slots[0] == 0 && dense[0] == keys[0], "first key gets slot 0");
    sj_keymap_lookup(m, keys, N, again);
    CHECK(memcmp(slots, again, sizeof slots) == 0, "lookup agrees");
    int64_t missing = 1LL << 50, slot;
    sj_keymap_lookup(m, &missing, 1, &slot);
    CHECK(slot == -1, "missing key");

    int64_t *counts = calloc(30011, sizeof(int64_t));
    double *sums = calloc(30011, sizeof(double)), *vals = malloc(N * sizeof(double));
    for (int64_t i = 0; i < N; i++) vals[i] = 1.5;
    sj_agg_count(slots, N, counts);
    sj_agg_sum(slots, vals, N, sums);
    int64_t total = 0;
    for (int s = 0; s < 30011; s++) total += counts[s];
    CHECK(total == N, "counts add up");
    CHECK(sums[0] == 1.5 * (double)counts[0], "sums");

    uint8_t *marks = calloc(30011, 1);
    int64_t *distinct = malloc(N * sizeof(int64_t)), nd;
    sj_distinct_slots(slots, N, marks, distinct, &nd);
    CHECK(nd == 30011, "distinct %lld", (long long)nd);
    int clean = 1;
    for (int s = 0; s < 30011; s++) clean &= marks[s] == 0;
    CHECK(clean, "marks cleared");
    sj_keymap_free(m);

    /* int64 combine kernels; an overflowing sum leaves every sum as it was. */
    int64_t islots[] = {0, 1, 0, 1}, ivals[] = {5, -7, INT64_MAX - 5, 3};
    int64_t isums[2] = {0, 0}, imins[2] = {INT64_MAX, INT64_MAX}, imaxs[2] = {INT64_MIN, INT64_MIN};
    int64_t err;
    CHECK(sj_agg_sum_i64(islots, ivals, 4, isums, &err) == SJ_OK, "sum i64");
    CHECK(isums[0] == INT64_MAX && isums[1] == -4, "sums %lld %lld", (long long)isums[0],
          (long long)isums[1]);
    int64_t more[] = {0, 1, 1, 0};
    CHECK(sj_agg_sum_i64(islots, more, 4, isums, &err) == SJ_ERANGE && err == 2, "overflow");
    CHECK(isums[0] == INT64_MAX && isums[1] == -4, "sums restored");
    int64_t down[] = {INT64_MIN, 0, 0, 0};
    isums[0] = -1;
    CHECK(sj_agg_sum_i64(islots, down, 4, isums, &err) == SJ_ERANGE && err == 0 && isums[0] == -1,
          "negative overflow");
    sj_agg_min_i64(islots, ivals, 4, imins);
    sj_agg_max_i64(islots, ivals, 4, imaxs);
    CHECK(imins[0] == 5 && imins[1] == -7 && imaxs[0] == INT64_MAX - 5 && imaxs[1] == 3,
          "min/max i64");
    /* NaN is kept by min and max whichever order it comes in, like sum */
    int64_t fslots[] = {0, 0, 1, 1};
    double fvals[] = {1.0, NAN, NAN, 2.0};
    double fmins[2] = {INFINITY, INFINITY}, fmaxs[2] = {-INFINITY, -INFINITY};
    sj_agg_min(fslots, fvals, 4, fmins);
    sj_agg_max(fslots, fvals, 4, fmaxs);
    CHECK(isnan(fmins[0]) && isnan(fmins[1]) && isnan(fmaxs[0]) && isnan(fmaxs[1]), "NaN kept");
    /* first and last in row order; first only where not seen */
    int64_t fl_slots[] = {1, 0, 1, 0}, fl_vals[] = {10, 20, 30, 40};
    int64_t firsts[2] = {0, 0}, lasts[2] = {0, 0};
    uint8_t seen[2] = {0, 1};
    sj_agg_first_i64(fl_slots, fl_vals, 4, firsts, seen);
    sj_agg_last_i64(fl_slots, fl_vals, 4, lasts);
    CHECK(firsts[0] == 20 && firsts[1] == 0 && seen[0] == 1, "first i64 (slot 1 seen before)");
    CHECK(lasts[0] == 40 && lasts[1] == 30, "last i64");
    double dfirst[2] = {0, 0}, dlast[2] = {0, 0};
    uint8_t dseen[2] = {0, 0};
    sj_agg_first(fslots, fvals, 4, dfirst, dseen);
    sj_agg_last(fslots, fvals, 4, dlast);
    CHECK(dfirst[0] == 1.0 && isnan(dfirst[1]) && isnan(dlast[0]) && dlast[1] == 2.0, "first/last");
    /* 128-bit sums: exact past int64, all or nothing at +-(10^38 - 1) */
    int64_t wsums[4] = {0, 0, 0, 0}, wslots[] = {0, 0, 1}, wvals[] = {INT64_MAX, INT64_MAX, -1};
    CHECK(sj_agg_sum_i128(wslots, wvals, 0, 3, wsums, &err) == SJ_OK, "sum i128");
    CHECK((uint64_t)wsums[0] == UINT64_MAX - 1 && wsums[1] == 0, "2 * INT64_MAX");
    CHECK(wsums[2] == -1 && wsums[3] == -1, "-1 sign-extended");
    /* 10^38 - 1 = 0x4b3b4ca85a86c47a098a223fffffffff */
    int64_t big[] = {(int64_t)0x098a223fffffffffull, (int64_t)0x4b3b4ca85a86c47aull, 1, 0};
    int64_t bslots[] = {1, 1}, bsums[4] = {0, 0, 0, 0};
    CHECK(sj_agg_sum_i128(bslots, big, 1, 1, bsums, &err) == SJ_OK, "10^38 - 1 fits");
    CHECK(sj_agg_sum_i128(bslots, big + 2, 1, 1, bsums, &err) == SJ_ERANGE && err == 0, "10^38");
    CHECK(bsums[2] == big[0] && bsums[3] == big[1], "sum left as it was");
    free(counts); free(sums); free(vals); free(marks); free(distinct);

    /* Bulk upsert (a restore): presized once, the same slots as one upsert at a time,
     * into an empty map and into one holding some of the keys already; a key repeated
     * within the call gets the slot of its first row. Big enough for a huge-page table. */
    {
        enum { B = 400000 };
        int64_t *bk = malloc(B * sizeof(int64_t)), *bs = malloc(B * sizeof(int64_t)),
                *ws = malloc(B * sizeof(int64_t));
        for (int64_t i = 0; i < B; i++) bk[i] = (int64_t)(test_random() % (B - B / 8));
        bk[0] = INT64_MIN;
        bk[1] = INT64_MAX;
        sj_keymap *one = sj_keymap_new(0), *bulk = sj_keymap_new(0);
        CHECK(sj_keymap_upsert(one, bk, B, ws) == SJ_OK, "upsert reference");
        CHECK(sj_keymap_upsert_bulk(bulk, bk, B, bs) == SJ_OK, "bulk upsert");
        CHECK(memcmp(bs, ws, B * sizeof(int64_t)) == 0, "bulk slots equal upsert's");
        CHECK(sj_keymap_size(bulk) == sj_keymap_size(one), "bulk size");
        CHECK(memcmp(sj_keymap_keys(bulk), sj_keymap_keys(one),
                     (size_t)sj_keymap_size(one) * sizeof(int64_t)) == 0, "bulk keys in order");
        sj_keymap_lookup(bulk, bk, B, ws);
        CHECK(memcmp(bs, ws, B * sizeof(int64_t)) == 0, "lookup after bulk");
        sj_keymap_free(bulk);
        /* into a map holding the first 1000 rows' keys */
        bulk = sj_keymap_new(0);
        CHECK(sj_keymap_upsert(bulk, bk, 1000, bs) == SJ_OK, "upsert some");
        CHECK(sj_keymap_upsert_bulk(bulk, bk + 1000, B - 1000, bs + 1000) == SJ_OK, "bulk rest");
        sj_keymap_lookup(one, bk, B, ws);
        CHECK(memcmp(bs, ws, B * sizeof(int64_t)) == 0, "bulk after upsert: same slots");
        /* reserve: bad totals refused, the map unchanged; a reserved map does not move */
        int64_t size = sj_keymap_size(bulk);
        CHECK(sj_keymap_reserve(bulk, -1) == SJ_EINVAL, "reserve -1");
        CHECK(sj_keymap_reserve(bulk, (int64_t)1 << 41) == SJ_ENOMEM, "reserve 2^41");
        CHECK(sj_keymap_upsert_bulk(bulk, bk, -1, bs) == SJ_EINVAL, "bulk n < 0");
        CHECK(sj_keymap_upsert_bulk(bulk, bk, INT64_MAX, bs) == SJ_ENOMEM, "bulk n too big");
        CHECK(sj_keymap_size(bulk) == size, "refusals add nothing");
        sj_keymap_lookup(bulk, bk, B, ws);
        CHECK(memcmp(bs, ws, B * sizeof(int64_t)) == 0, "refusals keep every key");
        CHECK(sj_keymap_reserve(bulk, 0) == SJ_OK && sj_keymap_reserve(bulk, size) == SJ_OK,
              "reserve within room");
        CHECK(sj_keymap_new((int64_t)1 << 41) == NULL, "new past the limit");
        sj_keymap *empty = sj_keymap_new(0);
        CHECK(sj_keymap_upsert_bulk(empty, bk, 0, bs) == SJ_OK && sj_keymap_size(empty) == 0,
              "bulk of nothing");
        CHECK(sj_keymap_reserve(empty, 3000000) == SJ_OK, "reserve 3M");
        const int64_t *before = sj_keymap_keys(empty);
        CHECK(sj_keymap_upsert_bulk(empty, bk, B, bs) == SJ_OK &&
              sj_keymap_keys(empty) == before, "a reserved map does not grow");
        sj_keymap_free(empty);
        /* distinct keys into an empty map: slots 0..B-1 in row order */
        for (int64_t i = 0; i < B; i++) bk[i] = (int64_t)(test_random() >> 1) ^ i;
        for (int64_t i = 0; i < B; i++) bk[i] = (int64_t)((uint64_t)bk[i] * 2u + (uint64_t)(i & 1));
        sj_keymap *ref = sj_keymap_new(0);
        sj_keymap_upsert(ref, bk, B, ws);
        CHECK(sj_keymap_size(ref) == B, "distinct keys");
        empty = sj_keymap_new(0);
        CHECK(sj_keymap_upsert_bulk(empty, bk, B, bs) == SJ_OK, "bulk distinct");
        CHECK(memcmp(bs, ws, B * sizeof(int64_t)) == 0, "bulk distinct: slots");
        CHECK(memcmp(sj_keymap_keys(empty), sj_keymap_keys(ref), B * sizeof(int64_t)) == 0,
              "bulk distinct: keys");
        sj_keymap_lookup(empty, bk, B, bs);
        CHECK(memcmp(bs, ws, B * sizeof(int64_t)) == 0, "bulk distinct: lookup");
        int64_t fresh[] = {12345678901LL, -3};
        int64_t fslots[2];
        CHECK(sj_keymap_upsert(empty, fresh, 2, fslots) == SJ_OK && fslots[0] == B &&
              fslots[1] == B + 1, "upsert after a bulk build");
        /* the last key repeats an earlier one: it gets that key's slot */
        bk[B - 1] = bk[5];
        ws[B - 1] = 5;
        sj_keymap_free(empty);
        empty = sj_keymap_new(0);
        CHECK(sj_keymap_upsert_bulk(empty, bk, B, bs) == SJ_OK, "bulk with a repeat");
        CHECK(memcmp(bs, ws, B * sizeof(int64_t)) == 0 && sj_keymap_size(empty) == B - 1,
              "bulk with a repeat: slots");
        sj_keymap_free(empty);
        sj_keymap_free(ref);
        sj_keymap_free(bulk);
        sj_keymap_free(one);
        free(bk); free(bs); free(ws);
    }
    printf("%s: keyed, %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
