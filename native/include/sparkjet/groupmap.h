/* Groups of rows by a composite key: a hash map from the key of a row, given by
 * one or more sj_column (the columns sj_hash_rows reads, with the same checks),
 * to a dense slot 0, 1, 2, ... in insertion order.
 *
 * A key's identity is the concatenation of each column's Hazelcast payload
 * (sparkjet/hash.h: big-endian Integer or Long, int32 length + bytes for
 * String and byte[]), so the same values in columns of the same payload types
 * are the same key whatever their Arrow layout (string or large_string, int32
 * or int64 hashed as Integer), and sj_murmur3_32 of a stored key with
 * Hazelcast's seed is the row's sj_hash_rows. The map copies each distinct key's
 * bytes into an arena it owns. It learns the payload types of its columns
 * (Integer, Long, bytes) from the first upsert and refuses columns of other
 * types afterwards: without that, differently typed keys could share bytes. */
#ifndef SPARKJET_GROUPMAP_H
#define SPARKJET_GROUPMAP_H

#include <stdint.h>

#include "sparkjet/hash.h"
#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sj_groupmap sj_groupmap;

/* A map sized for about `expected` keys (it grows as needed); NULL if out of memory. */
sj_groupmap *sj_groupmap_new(int64_t expected);
void sj_groupmap_free(sj_groupmap *map);
int64_t sj_groupmap_size(const sj_groupmap *map);

/* Room for `total` keys in all, so that adding up to that many rehashes nothing (at most
 * once, here; the key bytes still grow as they come). SJ_EINVAL for a negative total,
 * SJ_ENOMEM (the map as it was) if memory or the limit of 2^40 keys is short. */
sj_status sj_groupmap_reserve(sj_groupmap *map, int64_t total);

/* Finds or inserts the key of every row of `cols` (ncols >= 1 columns of one
 * length): slots[i] is row i's slot, and a key not in the map gets the next
 * slot. *new_count is how many keys this call inserted, and first_rows[k] the
 * row at which slot (size before the call + k) first appeared; first_rows needs
 * room for one value per row (or is NULL). Validity bitmaps are not read (nulls are the
 * caller's to refuse).
 *
 * Every column and value is checked before the first insertion, so SJ_EINVAL
 * (bad columns, lengths that differ, payload types unlike the map's), SJ_EBOUNDS
 * (offsets outside their buffers) and SJ_ERANGE (an SJ_KEY_INT64_AS_INT32 value
 * outside int32) leave the map as it was; *err_column is the column and
 * *err_index the row (-1 when not about one). SJ_ENOMEM if the map could not
 * grow: the keys inserted before stay (reported in *new_count and first_rows),
 * the slots of the rows before the failure are written, and the map stays
 * usable. */
sj_status sj_groupmap_upsert(sj_groupmap *map, const sj_column *cols, int32_t ncols,
                             int64_t *slots, int64_t *first_rows, int64_t *new_count,
                             int64_t *err_index, int32_t *err_column);

/* Finds every row's key without inserting: slots[i] = -1 for a key not in the
 * map. The same checks and errors as sj_groupmap_upsert. */
sj_status sj_groupmap_lookup(const sj_groupmap *map, const sj_column *cols, int32_t ncols,
                             int64_t *slots, int64_t *err_index, int32_t *err_column);

/* The stored key of a slot (its concatenated payloads), valid until the next
 * upsert; SJ_EINVAL for a slot outside 0..size-1. */
sj_status sj_groupmap_key(const sj_groupmap *map, int64_t slot, const uint8_t **bytes,
                          int64_t *len);

#ifdef __cplusplus
}
#endif
#endif
