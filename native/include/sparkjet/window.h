/* Event-time windows: the pane of each row's timestamp (tumbling and sliding
 * windows are unions of panes), and session ids over sorted intervals.
 * Timestamps are int64 in any unit; nothing here overflows silently. */
#ifndef SPARKJET_WINDOW_H
#define SPARKJET_WINDOW_H

#include <stdint.h>

#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* panes[i] = floor((ts[i] - offset) / pane_size), exact for every int64 input
 * (no intermediate overflows). SJ_EINVAL unless pane_size > 0 and n >= 0;
 * SJ_ERANGE (*err_index = the row) if a pane does not fit int64, which needs
 * pane_size 1. panes may be ts itself. */
sj_status sj_assign_panes(const int64_t *ts, int64_t n, int64_t pane_size, int64_t offset,
                          int64_t *panes, int64_t *err_index);

/* sj_assign_panes, and the rows whose pane is below min_pane (late rows):
 * late[i] = 1 for them and 0 for the others (late may be NULL), *late_count
 * how many there are. */
sj_status sj_assign_panes_late(const int64_t *ts, int64_t n, int64_t pane_size, int64_t offset,
                               int64_t min_pane, int64_t *panes, uint8_t *late,
                               int64_t *late_count, int64_t *err_index);

/* SJ_OK if rows are sorted by (group, start), ascending; else SJ_EINVAL with
 * *err_index the first row smaller than the one before it. */
sj_status sj_check_sorted(const int64_t *group, const int64_t *start, int64_t n,
                          int64_t *err_index);

/* Session ids of intervals [start[i], end[i]) sorted by (group, start): a row
 * joins the session of the row before it when both have the same group and it
 * starts at or before the largest end seen in that session (intervals that
 * overlap or touch merge); otherwise it opens the next session. session[i] is
 * the dense id (0, 1, ... in row order), *count the number of sessions.
 * SJ_EINVAL (*err_index = the row) for a row out of order or with end < start;
 * session[] is then written up to that row only. */
sj_status sj_session_ids(const int64_t *group, const int64_t *start, const int64_t *end,
                         int64_t n, int64_t *session, int64_t *count, int64_t *err_index);

#ifdef __cplusplus
}
#endif
#endif
