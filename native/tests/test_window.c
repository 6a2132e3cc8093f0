/* Native tests of the window kernels: panes against 128-bit floor division over
 * the whole int64 range, late rows, sortedness and session ids against a plain
 * reference. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/window.h"

#include "check.h"

typedef __int128 i128;

static i128 floor_div128(i128 a, i128 b) {
    i128 q = a / b;
    return q - (a % b != 0 && (a < 0) != (b < 0));
}

static int64_t edgy(void) {
    static const int64_t edges[] = {0, 1, -1, 2, -2, INT64_MAX, INT64_MIN, INT64_MAX - 1,
                                    INT64_MIN + 1, 1000, -1000, 1LL << 62, -(1LL << 62)};
    uint64_t r = test_random();
    if (r % 3 == 0) return edges[(r >> 8) % (sizeof edges / sizeof edges[0])];
    if (r % 3 == 1) return (int64_t)(test_random() % 20001) - 10000;
    return (int64_t)test_random();
}

static void test_panes(void) {
    enum { N = 64 };
    int64_t ts[N], panes[N], late_count, err;
    uint8_t late[N];
    for (int round = 0; round < 20000; round++) {
        int64_t size = edgy(), offset = edgy(), min_pane = edgy();
        if (size <= 0) size = size == INT64_MIN ? 1 : -size;
        if (size == 0) size = 7;
        if (round % 5 == 0) size = 1;
        for (int i = 0; i < N; i++) ts[i] = edgy();
        int64_t want_late = 0, first_bad = -1;
        for (int i = 0; i < N && first_bad < 0; i++) {
            i128 p = floor_div128((i128)ts[i] - offset, size);
            if (p > INT64_MAX || p < INT64_MIN) first_bad = i;
            else want_late += p < min_pane;
        }
        memset(late, 7, sizeof late);
        sj_status st =
            sj_assign_panes_late(ts, N, size, offset, min_pane, panes, late, &late_count, &err);
        if (first_bad >= 0) {
            CHECK(st == SJ_ERANGE && err == first_bad, "size %lld offset %lld: overflow at %lld",
                  (long long)size, (long long)offset, (long long)first_bad);
            continue;
        }
        CHECK(st == SJ_OK && late_count == want_late, "size %lld offset %lld",
              (long long)size, (long long)offset);
        for (int i = 0; i < N; i++) {
            int64_t want = (int64_t)floor_div128((i128)ts[i] - offset, size);
            CHECK(panes[i] == want, "ts %lld size %lld offset %lld: %lld, want %lld",
                  (long long)ts[i], (long long)size, (long long)offset, (long long)panes[i],
                  (long long)want);
            CHECK(late[i] == (want < min_pane), "late flag");
        }
        CHECK(sj_assign_panes(ts, N, size, offset, ts, &err) == SJ_OK, "in place");
        CHECK(memcmp(ts, panes, sizeof ts) == 0, "in place agrees");
    }
    CHECK(sj_assign_panes(ts, N, 0, 0, panes, &err) == SJ_EINVAL, "pane size 0");
    CHECK(sj_assign_panes(ts, N, -5, 0, panes, &err) == SJ_EINVAL, "negative pane size");
    CHECK(sj_assign_panes(ts, -1, 5, 0, panes, &err) == SJ_EINVAL, "negative n");
    CHECK(sj_assign_panes(NULL, 0, 5, 0, NULL, &err) == SJ_OK, "no rows");
    int64_t t[] = {-1, 0, 9, 10, -10, -11};
    int64_t want[] = {-1, 0, 0, 1, -1, -2};
    CHECK(sj_assign_panes(t, 6, 10, 0, panes, &err) == SJ_OK && !memcmp(panes, want, sizeof want),
          "floor, not truncation");
    CHECK(sj_assign_panes_late(t, 6, 10, 0, 0, panes, NULL, &late_count, &err) == SJ_OK &&
              late_count == 3,
          "late rows counted without flags");
}

/* Session ids as the definition says, over rows known to be sorted. */
static int64_t reference_sessions(const int64_t *g, const int64_t *s, const int64_t *e,
                                  int64_t n, int64_t *out) {
    int64_t k = -1, reach = 0;
    for (int64_t i = 0; i < n; i++) {
        int same = i > 0 && g[i] == g[i - 1] && s[i] <= reach;
        if (!same) {
            k++;
            reach = e[i];
        }
        reach = e[i] > reach ? e[i] : reach;
        out[i] = k;
    }
    return k + 1;
}

static void test_sessions(void) {
    enum { N = 500 };
    int64_t g[N], s[N], e[N], got[N], want[N], count, err;
    for (int round = 0; round < 2000; round++) {
        int64_t n = (int64_t)(test_random() % N);
        int64_t group = (int64_t)(test_random() % 5) - 2, start = (int64_t)(test_random() % 20);
        for (int64_t i = 0; i < n; i++) {
            if (test_random() % 8 == 0) {
                group += 1 + (int64_t)(test_random() % 3);
                start = (int64_t)(test_random() % 20) - 10;
            }
            start += (int64_t)(test_random() % 4);
            g[i] = group;
            s[i] = start;
            e[i] = start + (int64_t)(test_random() % 6); /* empty intervals too */
        }
        int64_t k = reference_sessions(g, s, e, n, want);
        CHECK(sj_check_sorted(g, s, n, &err) == SJ_OK, "sorted");
        CHECK(sj_session_ids(g, s, e, n, got, &count, &err) == SJ_OK, "sessions");
        CHECK(count == (n ? k : 0), "round %d: %lld sessions, want %lld", round,
              (long long)count, (long long)k);
        CHECK(memcmp(got, want, (size_t)n * sizeof(int64_t)) == 0, "round %d ids", round);
    }
    /* Touching intervals merge; a gap of one splits; the running end counts, not the last. */
    int64_t g1[] = {1, 1, 1, 1, 1, 2};
    int64_t s1[] = {0, 5, 6, 20, 30, 30};
    int64_t e1[] = {5, 40, 7, 21, 31, 31};
    int64_t w1[] = {0, 0, 0, 0, 0, 1};
    CHECK(sj_session_ids(g1, s1, e1, 6, got, &count, &err) == SJ_OK && count == 2 &&
              !memcmp(got, w1, sizeof w1),
          "running end");
    e1[1] = 6;
    int64_t w2[] = {0, 0, 0, 1, 2, 3};
    CHECK(sj_session_ids(g1, s1, e1, 6, got, &count, &err) == SJ_OK && count == 4 &&
              !memcmp(got, w2, sizeof w2),
          "gaps split");
    /* Refused: out of order (start, then group), end before start. */
    int64_t g2[] = {1, 1, 0}, s2[] = {5, 4, 9}, e2[] = {6, 6, 10};
    CHECK(sj_check_sorted(g2, s2, 3, &err) == SJ_EINVAL && err == 1, "start out of order");
    CHECK(sj_session_ids(g2, s2, e2, 3, got, &count, &err) == SJ_EINVAL && err == 1,
          "sessions refuse it");
    s2[1] = 5;
    CHECK(sj_check_sorted(g2, s2, 3, &err) == SJ_EINVAL && err == 2, "group out of order");
    g2[2] = 2;
    e2[1] = 4;
    CHECK(sj_check_sorted(g2, s2, 3, &err) == SJ_OK, "sorted again");
    CHECK(sj_session_ids(g2, s2, e2, 3, got, &count, &err) == SJ_EINVAL && err == 1,
          "end before start");
    CHECK(sj_session_ids(g2, s2, e2, 0, got, &count, &err) == SJ_OK && count == 0, "no rows");
    CHECK(sj_session_ids(g2, s2, e2, -1, got, &count, &err) == SJ_EINVAL, "negative n");
}

int main(void) {
    test_panes();
    test_sessions();
    printf("%s: window, %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
