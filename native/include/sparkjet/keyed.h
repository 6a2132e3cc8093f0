/* Keyed state for rolling aggregations: a hash map from int64 keys to dense
 * slots (0, 1, 2, ... in insertion order) and aggregate kernels over arrays
 * indexed by slot. The map owns only keys and slots; the aggregate arrays
 * belong to the caller, which grows them as slots are added. */
#ifndef SPARKJET_KEYED_H
#define SPARKJET_KEYED_H

#include <stdint.h>

#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sj_keymap sj_keymap;

/* A map sized for about `expected` keys (it grows as needed); NULL if out of memory. */
sj_keymap *sj_keymap_new(int64_t expected);
void sj_keymap_free(sj_keymap *map);
int64_t sj_keymap_size(const sj_keymap *map);

/* The dense keys, slot order: valid until the next insertion. */
const int64_t *sj_keymap_keys(const sj_keymap *map);

/* Finds or inserts every key: slots[i] is key i's slot; new keys get the next
 * slots. SJ_ENOMEM if the map could not grow (keys inserted so far remain). */
sj_status sj_keymap_upsert(sj_keymap *map, const int64_t *keys, int64_t n, int64_t *slots);

/* Room for `total` keys in all, so that inserting up to that many grows nothing (the
 * buckets are rehashed at most once, here). SJ_EINVAL for a negative total, SJ_ENOMEM
 * (the map as it was) if memory or the limit of 2^32 - 2 keys is short. */
sj_status sj_keymap_reserve(sj_keymap *map, int64_t total);

/* sj_keymap_upsert for many keys at once, as a restore adds a snapshot's keys: reserves
 * room for all of them first (one rehash at most), then inserts with the buckets of later
 * keys prefetched. Same slots as sj_keymap_upsert. SJ_EINVAL for n < 0; SJ_ENOMEM with the
 * map unchanged (nothing inserted) if the room cannot be had. */
sj_status sj_keymap_upsert_bulk(sj_keymap *map, const int64_t *keys, int64_t n, int64_t *slots);

/* Finds keys without inserting: slots[i] = -1 for a missing key. */
void sj_keymap_lookup(const sj_keymap *map, const int64_t *keys, int64_t n, int64_t *slots);

/* Aggregates row values into per-slot arrays (the caller sized them to the map). A NaN
 * value makes its slot's sum, min and max NaN (IEEE arithmetic for the sum; min and max
 * take a NaN and keep it), so every aggregation treats NaN alike. */
void sj_agg_count(const int64_t *slots, int64_t n, int64_t *counts);
void sj_agg_sum(const int64_t *slots, const double *values, int64_t n, double *sums);
void sj_agg_min(const int64_t *slots, const double *values, int64_t n, double *mins);
void sj_agg_max(const int64_t *slots, const double *values, int64_t n, double *maxs);

/* The same over int64 values: counts and event times, which float64 cannot hold
 * exactly (merging partial aggregates of panes and sessions). sj_agg_sum_i64
 * returns SJ_ERANGE (*err_index = the row) if a sum would overflow int64, with
 * sums as they were before the call. */
sj_status sj_agg_sum_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *sums,
                         int64_t *err_index);
void sj_agg_min_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *mins);
void sj_agg_max_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *maxs);

/* First and last values in row order. sj_agg_first* takes a value only for a slot whose
 * seen byte is 0, and sets it to 1; sj_agg_last* always takes it. The caller leaves out
 * the rows that are null. */
void sj_agg_first(const int64_t *slots, const double *values, int64_t n, double *firsts,
                  uint8_t *seen);
void sj_agg_last(const int64_t *slots, const double *values, int64_t n, double *lasts);
void sj_agg_first_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *firsts,
                      uint8_t *seen);
void sj_agg_last_i64(const int64_t *slots, const int64_t *values, int64_t n, int64_t *lasts);

/* Exact sums wider than int64: sums holds two int64 per slot, the low 64 bits then the
 * high 64 bits of a two's-complement 128-bit integer (Arrow's decimal128 layout on a
 * little-endian machine). values holds one int64 per row (wide = 0) or two, in the same
 * layout (wide = 1). A sum is kept within +-(10^38 - 1), what decimal128(38, 0) holds:
 * SJ_ERANGE (*err_index = the row) past it, with sums as they were before the call. */
sj_status sj_agg_sum_i128(const int64_t *slots, const int64_t *values, int wide, int64_t n,
                          int64_t *sums, int64_t *err_index);

/* The distinct slots of slots[0..n) in first-appearance order into out
 * (*count of them). marks has one byte per slot, all 0 on entry and on return. */
void sj_distinct_slots(const int64_t *slots, int64_t n, uint8_t *marks, int64_t *out,
                       int64_t *count);

#ifdef __cplusplus
}
#endif
#endif
