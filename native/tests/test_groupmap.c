/* Native tests of the composite-key group map: slots against a plain reference
 * (the int64 key map, or a linear search over encoded keys), stored keys against
 * the row hash, the same keys in other Arrow layouts, refusals that change
 * nothing, and growth. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/groupmap.h"
#include "sparkjet/keyed.h"

#include "check.h"

static void put_be(uint8_t *p, uint64_t v, int bytes) {
    for (int b = bytes - 1; b >= 0; b--, v >>= 8) p[b] = (uint8_t)v;
}

/* Slots as the definition says: the index of the first row with equal encoded
 * bytes among the distinct keys seen so far, in row order. */
static int64_t reference_slots(uint8_t *const *keys, const int64_t *lens, int64_t n,
                               int64_t *slots, int64_t *first) {
    int64_t distinct = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = 0;
        for (; s < distinct; s++) {
            int64_t r = first[s];
            if (lens[r] == lens[i] && memcmp(keys[r], keys[i], (size_t)lens[i]) == 0) break;
        }
        if (s == distinct) first[distinct++] = i;
        slots[i] = s;
    }
    return distinct;
}

static void test_int64_against_keymap(void) {
    enum { N = 200000 };
    static int64_t keys[N], slots[N], want[N], first[N], found[N];
    for (int64_t i = 0; i < N; i++) {
        keys[i] = (int64_t)(test_random() % 50000) - 25000;
        if (i % 97 == 0) keys[i] = i % 2 ? INT64_MIN : INT64_MAX;
    }
    sj_keymap *ref = sj_keymap_new(0);
    sj_groupmap *m = sj_groupmap_new(0);
    int64_t added = 0, total = 0, err;
    int32_t col;
    /* In three calls of uneven size, so that keys repeat across calls and the map grows. */
    int64_t cuts[] = {0, 7, 60000, N};
    for (int c = 0; c < 3; c++) {
        int64_t from = cuts[c], n = cuts[c + 1] - from;
        sj_column k = test_column(SJ_KEY_INT64, keys, N, sizeof keys);
        k.offset = from;
        k.length = n;
        CHECK(sj_groupmap_upsert(m, &k, 1, slots + from, first, &added, &err, &col) == SJ_OK,
              "upsert");
        sj_keymap_upsert(ref, keys + from, n, want + from);
        for (int64_t j = 0; j < added; j++)
            CHECK(want[from + first[j]] == total + j, "first row of new slot %lld",
                  (long long)(total + j));
        total += added;
    }
    CHECK(sj_groupmap_size(m) == sj_keymap_size(ref) && total == sj_keymap_size(ref), "size");
    CHECK(memcmp(slots, want, sizeof slots) == 0, "slots equal the key map's");
    sj_column k = test_column(SJ_KEY_INT64, keys, N, sizeof keys);
    CHECK(sj_groupmap_lookup(m, &k, 1, found, &err, &col) == SJ_OK, "lookup");
    CHECK(memcmp(found, want, sizeof found) == 0, "lookup agrees");
    int64_t missing[] = {1LL << 50, 25001};
    k = test_column(SJ_KEY_INT64, missing, 2, sizeof missing);
    CHECK(sj_groupmap_lookup(m, &k, 1, found, &err, &col) == SJ_OK, "lookup missing");
    CHECK(found[0] == -1 && found[1] == -1, "missing keys");
    /* A stored key is the big-endian Long, and hashes as the row does. */
    const uint8_t *bytes;
    int64_t len;
    uint8_t be[8];
    put_be(be, (uint64_t)keys[0], 8);
    CHECK(sj_groupmap_key(m, 0, &bytes, &len) == SJ_OK && len == 8 && !memcmp(bytes, be, 8),
          "stored Long");
    CHECK(sj_groupmap_key(m, total, &bytes, &len) == SJ_EINVAL, "key past the last slot");
    CHECK(sj_groupmap_key(m, -1, &bytes, &len) == SJ_EINVAL, "negative slot");
    sj_groupmap_free(m);
    sj_keymap_free(ref);
}

/* Random rows of (Integer, String, Long): slots against the reference, and each
 * stored key's murmur against the composite row hash. */
static void test_composite_against_reference(void) {
    enum { N = 3000, MAXLEN = 40 };
    static int32_t a[N], off[N + 1];
    static int64_t c[N], slots[N], want[N], first[N], want_first[N], lens[N];
    static uint8_t data[N * MAXLEN], enc[N][4 + 4 + MAXLEN + 8];
    static uint8_t *encp[N];
    static int32_t hashes[N];
    off[0] = 0;
    for (int64_t i = 0; i < N; i++) {
        a[i] = (int32_t)(test_random() % 3) - 1;
        int len = (int)(test_random() % 4);
        if (test_random() % 4 == 0) len = (int)(test_random() % MAXLEN); /* long ones too */
        for (int b = 0; b < len; b++) data[off[i] + b] = (uint8_t)('a' + test_random() % 2);
        off[i + 1] = off[i] + len;
        c[i] = (int64_t)(test_random() % 2) << 40;
        uint8_t *e = enc[i];
        put_be(e, (uint32_t)a[i], 4);
        put_be(e + 4, (uint64_t)len, 4);
        memcpy(e + 8, data + off[i], (size_t)len);
        put_be(e + 8 + len, (uint64_t)c[i], 8);
        encp[i] = e;
        lens[i] = 16 + len;
    }
    sj_column cols[3];
    cols[0] = test_column(SJ_KEY_INT32, a, N, sizeof a);
    cols[1] = test_column(SJ_KEY_VAR32, off, N, sizeof off);
    cols[1].data = data;
    cols[1].data_size = off[N];
    cols[2] = test_column(SJ_KEY_INT64, c, N, sizeof c);
    int64_t distinct = reference_slots(encp, lens, N, want, want_first);
    sj_groupmap *m = sj_groupmap_new(4);
    int64_t added, err;
    int32_t col;
    CHECK(sj_groupmap_upsert(m, cols, 3, slots, first, &added, &err, &col) == SJ_OK, "upsert");
    CHECK(added == distinct && sj_groupmap_size(m) == distinct, "%lld keys, want %lld",
          (long long)added, (long long)distinct);
    CHECK(memcmp(slots, want, sizeof slots) == 0, "slots equal the reference");
    CHECK(memcmp(first, want_first, (size_t)distinct * 8) == 0, "first rows");
    CHECK(sj_hash_rows(cols, 3, SJ_HAZELCAST_SEED, hashes, &err, &col) == SJ_OK, "row hashes");
    for (int64_t s = 0; s < distinct; s++) {
        const uint8_t *bytes;
        int64_t len;
        sj_groupmap_key(m, s, &bytes, &len);
        int64_t r = want_first[s];
        CHECK(len == lens[r] && !memcmp(bytes, enc[r], (size_t)len), "stored key %lld",
              (long long)s);
        CHECK(sj_murmur3_32(bytes, (size_t)len, SJ_HAZELCAST_SEED) == hashes[r],
              "key %lld hashes as its row", (long long)s);
    }
    /* Again, one row at a time: every row is found, nothing is added. */
    for (int64_t i = 0; i < N; i++) {
        sj_column one[3];
        for (int k = 0; k < 3; k++) {
            one[k] = cols[k];
            one[k].offset = i;
            one[k].length = 1;
        }
        int64_t slot;
        CHECK(sj_groupmap_upsert(m, one, 3, &slot, first, &added, &err, &col) == SJ_OK &&
                  added == 0 && slot == want[i],
              "row %lld alone", (long long)i);
    }
    sj_groupmap_free(m);
}

/* The same keys through other layouts: large offsets, views, fixed width; Integer
 * from int32 or from int64 (as Integer); and two Integers (a word key). */
static void test_layouts_agree(void) {
    const char *words[] = {"", "a", "bb", "hello world!", "thirteen char", "", "a",
                           "a much longer value that lives out of line", "bb"};
    enum { N = 9 };
    int32_t off32[N + 1];
    int64_t off64[N + 1];
    uint8_t data[256], views[N * 16];
    int64_t pos = 0;
    off32[0] = 0;
    off64[0] = 0;
    for (int i = 0; i < N; i++) {
        int32_t len = (int32_t)strlen(words[i]);
        memcpy(data + pos, words[i], (size_t)len);
        uint8_t *v = views + 16 * i;
        memset(v, 0, 16);
        memcpy(v, &len, 4);
        if (len <= 12) {
            memcpy(v + 4, words[i], (size_t)len);
        } else {
            int32_t buf = 0, o = (int32_t)pos;
            memcpy(v + 4, words[i], 4);
            memcpy(v + 8, &buf, 4);
            memcpy(v + 12, &o, 4);
        }
        pos += len;
        off32[i + 1] = (int32_t)pos;
        off64[i + 1] = pos;
    }
    const uint8_t *variadic[] = {data};
    int64_t variadic_sizes[] = {pos};
    sj_column var32 = test_column(SJ_KEY_VAR32, off32, N, sizeof off32);
    var32.data = data;
    var32.data_size = pos;
    sj_column var64 = test_column(SJ_KEY_VAR64, off64, N, sizeof off64);
    var64.data = data;
    var64.data_size = pos;
    sj_column view = test_column(SJ_KEY_VIEW, views, N, sizeof views);
    view.variadic = variadic;
    view.variadic_sizes = variadic_sizes;
    view.variadic_count = 1;
    int64_t want[N] = {0, 1, 2, 3, 4, 0, 1, 5, 2}, slots[N], first[N], added, err;
    int32_t col;
    sj_groupmap *m = sj_groupmap_new(0);
    sj_column layouts[] = {var32, var64, view};
    for (int l = 0; l < 3; l++) {
        memset(slots, 0xff, sizeof slots);
        CHECK(sj_groupmap_upsert(m, &layouts[l], 1, slots, first, &added, &err, &col) == SJ_OK,
              "strings, layout %d", l);
        CHECK(added == (l == 0 ? 6 : 0), "layout %d added %lld", l, (long long)added);
        CHECK(memcmp(slots, want, sizeof want) == 0, "layout %d slots", l);
    }
    sj_groupmap_free(m);

    /* Fixed width: 3-byte values, one of them repeated; width 0 is one empty key. */
    const uint8_t fixed[] = "abcxyzabc";
    sj_column fx = test_column(SJ_KEY_FIXED, NULL, 3, 0);
    fx.width = 3;
    fx.data = fixed;
    fx.data_size = 9;
    m = sj_groupmap_new(0);
    CHECK(sj_groupmap_upsert(m, &fx, 1, slots, first, &added, &err, &col) == SJ_OK, "fixed");
    CHECK(added == 2 && slots[0] == 0 && slots[1] == 1 && slots[2] == 0, "fixed slots");
    fx.width = 0;
    CHECK(sj_groupmap_upsert(m, &fx, 1, slots, first, &added, &err, &col) == SJ_OK, "width 0");
    CHECK(added == 1 && slots[0] == 2 && slots[2] == 2, "width 0 is the empty key");
    /* ...which is the empty string's key. */
    CHECK(sj_groupmap_upsert(m, &var32, 1, slots, first, &added, &err, &col) == SJ_OK &&
              slots[0] == 2,
          "empty fixed == empty string");
    sj_groupmap_free(m);

    int32_t i32[] = {5, -1, 5, 7};
    int64_t i64[] = {5, -1, 5, 7}, too_big[] = {1LL << 31};
    sj_column a = test_column(SJ_KEY_INT32, i32, 4, sizeof i32);
    sj_column b = test_column(SJ_KEY_INT64_AS_INT32, i64, 4, sizeof i64);
    sj_column pair[2] = {a, b};
    m = sj_groupmap_new(0);
    CHECK(sj_groupmap_upsert(m, pair, 2, slots, first, &added, &err, &col) == SJ_OK, "pair");
    CHECK(added == 3 && slots[0] == 0 && slots[1] == 1 && slots[2] == 0 && slots[3] == 2,
          "pair slots");
    sj_column swapped[2] = {b, a};
    CHECK(sj_groupmap_lookup(m, swapped, 2, slots, &err, &col) == SJ_OK && slots[2] == 0,
          "int64 as Integer == int32");
    const uint8_t *bytes;
    int64_t len;
    const uint8_t be[] = {0, 0, 0, 5, 0, 0, 0, 5};
    CHECK(sj_groupmap_key(m, 0, &bytes, &len) == SJ_OK && len == 8 && !memcmp(bytes, be, 8),
          "stored Integer pair");
    pair[1] = test_column(SJ_KEY_INT64_AS_INT32, too_big, 1, sizeof too_big);
    pair[0].length = 1;
    CHECK(sj_groupmap_upsert(m, pair, 2, slots, first, &added, &err, &col) == SJ_ERANGE &&
              err == 0 && col == 1 && added == 0 && sj_groupmap_size(m) == 3,
          "Integer out of range refused");
    sj_groupmap_free(m);
}

/* Refused input leaves the map as it was. */
static void test_refusals(void) {
    int64_t longs[] = {1, 2, 3}, slots[3], first[3], added, err;
    int32_t ints[] = {1, 2, 3}, col;
    sj_groupmap *m = sj_groupmap_new(0);
    sj_column l = test_column(SJ_KEY_INT64, longs, 3, sizeof longs);
    sj_column i = test_column(SJ_KEY_INT32, ints, 3, sizeof ints);
    CHECK(sj_groupmap_upsert(m, &l, 1, slots, first, &added, &err, &col) == SJ_OK, "longs");
    CHECK(sj_groupmap_upsert(m, &i, 1, slots, first, &added, &err, &col) == SJ_EINVAL && col == 0,
          "Integer where the map has Long");
    CHECK(sj_groupmap_lookup(m, &i, 1, slots, &err, &col) == SJ_EINVAL, "lookup too");
    sj_column two[2] = {l, l};
    CHECK(sj_groupmap_upsert(m, two, 2, slots, first, &added, &err, &col) == SJ_EINVAL,
          "two columns where the map has one");
    CHECK(sj_groupmap_upsert(m, &l, 0, slots, first, &added, &err, &col) == SJ_EINVAL,
          "no columns");
    two[1].length = 2;
    sj_groupmap *m2 = sj_groupmap_new(0);
    CHECK(sj_groupmap_upsert(m2, two, 2, slots, first, &added, &err, &col) == SJ_EINVAL &&
              col == 1,
          "columns of different lengths");
    l.length = 4;
    CHECK(sj_groupmap_upsert(m2, &l, 1, slots, first, &added, &err, &col) == SJ_EBOUNDS,
          "past the buffer");

    /* An offset past the data at row 2: rows 0 and 1 are not inserted either. */
    int32_t off[] = {0, 1, 2, 99};
    const uint8_t data[] = "xy";
    sj_column s = test_column(SJ_KEY_VAR32, off, 3, sizeof off);
    s.data = data;
    s.data_size = 2;
    CHECK(sj_groupmap_upsert(m2, &s, 1, slots, first, &added, &err, &col) == SJ_EBOUNDS &&
              err == 2 && col == 0 && added == 0,
          "bad offset refused");
    CHECK(sj_groupmap_size(m2) == 0, "nothing inserted");
    CHECK(sj_groupmap_lookup(m2, &s, 1, slots, &err, &col) == SJ_EBOUNDS && err == 2,
          "lookup checks too");
    s.length = 2;
    CHECK(sj_groupmap_lookup(m2, &s, 1, slots, &err, &col) == SJ_OK && slots[0] == -1 &&
              slots[1] == -1,
          "lookup in an empty map");
    CHECK(sj_groupmap_upsert(m2, &s, 1, slots, NULL, &added, &err, &col) == SJ_OK &&
              added == 2 && slots[1] == 1,
          "first_rows may be NULL");
    CHECK(sj_groupmap_size(m) == 3, "first map untouched");
    sj_groupmap_free(m);
    sj_groupmap_free(m2);
}

/* Many distinct string keys from an empty map, in blocks: growth of the table and
 * the arena, and nothing lost on the way. */
static void test_growth(void) {
    enum { N = 300000 };
    int32_t *off = malloc((N + 1) * sizeof(int32_t));
    char *data = malloc((size_t)N * 12);
    int64_t *slots = malloc(N * sizeof(int64_t)), *first = malloc(N * sizeof(int64_t));
    off[0] = 0;
    for (int64_t i = 0; i < N; i++) off[i + 1] = off[i] + sprintf(data + off[i], "k%lld", (long long)(i / 2));
    sj_groupmap *m = sj_groupmap_new(0);
    int64_t added, err, total = 0;
    int32_t col;
    for (int64_t from = 0; from < N; from += 65536) {
        sj_column s = test_column(SJ_KEY_VAR32, off, N, (N + 1) * sizeof(int32_t));
        s.data = (const uint8_t *)data;
        s.data_size = off[N];
        s.offset = from;
        s.length = N - from < 65536 ? N - from : 65536;
        CHECK(sj_groupmap_upsert(m, &s, 1, slots + from, first, &added, &err, &col) == SJ_OK,
              "block at %lld", (long long)from);
        total += added;
    }
    CHECK(total == N / 2 && sj_groupmap_size(m) == N / 2, "%lld keys", (long long)total);
    int ok = 1;
    for (int64_t i = 0; i < N; i++) ok &= slots[i] == i / 2;
    CHECK(ok, "slots in insertion order");
    free(off);
    free(data);
    free(slots);
    free(first);
    sj_groupmap_free(m);
}

/* Reserve: room made once, the same slots as a map grown as keys came; bad totals refused. */
static void test_reserve(void) {
    enum { N = 50000 };
    static int64_t keys[N], a[N], b[N], first[N];
    for (int64_t i = 0; i < N; i++) keys[i] = (int64_t)(test_random() % 30000);
    sj_groupmap *grown = sj_groupmap_new(0), *reserved = sj_groupmap_new(0);
    int64_t added, err;
    int32_t col;
    CHECK(sj_groupmap_reserve(reserved, -1) == SJ_EINVAL, "reserve -1");
    CHECK(sj_groupmap_reserve(reserved, (int64_t)1 << 41) == SJ_ENOMEM, "reserve 2^41");
    CHECK(sj_groupmap_reserve(reserved, 0) == SJ_OK, "reserve 0");
    sj_column k = test_column(SJ_KEY_INT64, keys, 100, sizeof keys);
    CHECK(sj_groupmap_upsert(reserved, &k, 1, b, first, &added, &err, &col) == SJ_OK, "some");
    CHECK(sj_groupmap_reserve(reserved, N) == SJ_OK, "reserve N");
    CHECK(sj_groupmap_reserve(reserved, 10) == SJ_OK, "reserve below the size");
    k = test_column(SJ_KEY_INT64, keys, N, sizeof keys);
    CHECK(sj_groupmap_upsert(grown, &k, 1, a, first, &added, &err, &col) == SJ_OK, "grown");
    CHECK(sj_groupmap_upsert(reserved, &k, 1, b, first, &added, &err, &col) == SJ_OK, "reserved");
    CHECK(memcmp(a, b, sizeof a) == 0, "same slots");
    CHECK(sj_groupmap_size(grown) == sj_groupmap_size(reserved), "same size");
    sj_groupmap_free(grown);
    sj_groupmap_free(reserved);
}

int main(void) {
    test_reserve();
    test_int64_against_keymap();
    test_composite_against_reference();
    test_layouts_agree();
    test_refusals();
    test_growth();
    printf("%s: groupmap, %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
