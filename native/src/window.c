/* Pane assignment with floor division that never overflows, and session merging. */
#include <stddef.h>

#include "sparkjet/window.h"

/* Floor division and its non-negative remainder, for b > 0 (C truncates toward 0). */
static inline int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b < 0); }
static inline int64_t floor_mod(int64_t a, int64_t b) {
    int64_t r = a % b;
    return r < 0 ? r + b : r;
}

/* With ts = q*p + r and offset = q0*p + r0 (0 <= r, r0 < p), the pane is
 * q - q0 - (r < r0): no ts - offset, which can overflow. q - q0 itself only
 * overflows for p = 1 (for p >= 2 both quotients lie within +-2**62). */
sj_status sj_assign_panes_late(const int64_t *ts, int64_t n, int64_t pane_size, int64_t offset,
                               int64_t min_pane, int64_t *panes, uint8_t *late,
                               int64_t *late_count, int64_t *err_index) {
    *err_index = -1;
    *late_count = 0;
    if (pane_size <= 0 || n < 0) return SJ_EINVAL;
    const int64_t q0 = floor_div(offset, pane_size), r0 = floor_mod(offset, pane_size);
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t t = ts[i], q = t / pane_size, r = t % pane_size, pane;
        if (r < 0) {
            q -= 1;
            r += pane_size;
        }
        if (__builtin_sub_overflow(q, q0, &pane) || __builtin_sub_overflow(pane, r < r0, &pane)) {
            *err_index = i;
            *late_count = count;
            return SJ_ERANGE;
        }
        panes[i] = pane;
        int is_late = pane < min_pane;
        if (late) late[i] = (uint8_t)is_late;
        count += is_late;
    }
    *late_count = count;
    return SJ_OK;
}

sj_status sj_assign_panes(const int64_t *ts, int64_t n, int64_t pane_size, int64_t offset,
                          int64_t *panes, int64_t *err_index) {
    int64_t late_count;
    return sj_assign_panes_late(ts, n, pane_size, offset, INT64_MIN, panes, NULL, &late_count,
                                err_index);
}

/* Whether row i sorts before row i - 1. */
static inline int out_of_order(const int64_t *group, const int64_t *start, int64_t i) {
    return group[i] < group[i - 1] || (group[i] == group[i - 1] && start[i] < start[i - 1]);
}

sj_status sj_check_sorted(const int64_t *group, const int64_t *start, int64_t n,
                          int64_t *err_index) {
    *err_index = -1;
    if (n < 0) return SJ_EINVAL;
    for (int64_t i = 1; i < n; i++) {
        if (out_of_order(group, start, i)) {
            *err_index = i;
            return SJ_EINVAL;
        }
    }
    return SJ_OK;
}

sj_status sj_session_ids(const int64_t *group, const int64_t *start, const int64_t *end,
                         int64_t n, int64_t *session, int64_t *count, int64_t *err_index) {
    *err_index = -1;
    *count = 0;
    if (n < 0) return SJ_EINVAL;
    int64_t k = 0, reach = 0; /* sessions so far; the largest end of the current one */
    for (int64_t i = 0; i < n; i++) {
        if (end[i] < start[i] || (i && out_of_order(group, start, i))) {
            *err_index = i;
            *count = k;
            return SJ_EINVAL;
        }
        if (i && group[i] == group[i - 1] && start[i] <= reach) {
            if (end[i] > reach) reach = end[i];
        } else {
            k++;
            reach = end[i];
        }
        session[i] = k - 1;
    }
    *count = k;
    return SJ_OK;
}
