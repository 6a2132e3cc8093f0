/* Deduplication state: int64 key -> the event time of the event of that key that last
 * passed. One pass over a batch's rows, in order, decides each row: the first event of a
 * key passes, a later one passes only once it is `within` (event time) after the one that
 * passed, and then takes its place. Entries older than an eviction limit set by the
 * caller (the watermark less `within`, plus one) are dropped lazily, when the table would grow, so
 * the table holds about the keys of the last `within`. */
#ifndef SPARKJET_DEDUP_H
#define SPARKJET_DEDUP_H

#include <stdint.h>

#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sj_dedupmap sj_dedupmap;

/* A map sized for about `expected` keys (it grows as needed); NULL if out of memory. */
sj_dedupmap *sj_dedupmap_new(int64_t expected);
void sj_dedupmap_free(sj_dedupmap *map);

/* Entries held, the evictable ones (passed <= limit) included. */
int64_t sj_dedupmap_size(const sj_dedupmap *map);

/* Entries with passed >= limit: what a snapshot keeps. */
int64_t sj_dedupmap_live(const sj_dedupmap *map, int64_t limit);

/* Decides rows 0..n-1 in order: keep[i] = 1 if row i passes (its key unseen, or
 * times[i] >= passed + within without overflow), else 0; a passing row's time becomes
 * its key's passed time. *kept = how many passed. within >= 0 (SJ_EINVAL otherwise).
 * Entries with passed < evict_below are treated as absent and may be dropped when the
 * table needs room. SJ_ENOMEM if the table could not grow: rows before *kept's count
 * were decided and recorded: keep is valid for rows [0, *done). INT64_MIN as evict_below
 * drops nothing. */
sj_status sj_dedupmap_process(sj_dedupmap *map, const int64_t *keys, const int64_t *times,
                              int64_t n, int64_t within, int64_t evict_below, uint8_t *keep,
                              int64_t *kept, int64_t *done);

/* Drops every entry with passed < limit now, shrinking the table when it is mostly
 * empty. SJ_ENOMEM leaves the map as it was. */
sj_status sj_dedupmap_evict(sj_dedupmap *map, int64_t limit);

/* Writes the entries with passed >= limit (at most cap) to keys and passed, in table
 * order; returns how many. */
int64_t sj_dedupmap_export(const sj_dedupmap *map, int64_t limit, int64_t *keys, int64_t *passed,
                           int64_t cap);

/* Sets keys[i]'s passed time to passed[i] (the later of the two if the key is there):
 * restoring a snapshot. SJ_ENOMEM if the table could not grow (*done entries set). */
sj_status sj_dedupmap_insert(sj_dedupmap *map, const int64_t *keys, const int64_t *passed,
                             int64_t n, int64_t *done);

#ifdef __cplusplus
}
#endif
#endif
