/* Snapshot chunks: the on-disk format of keyed state, and the scatter of
 * entries by partition.
 *
 * THE FORMAT (version 1; this comment is its one description)
 *
 * A chunk file is a sequence of chunks. A chunk is a 64-byte header followed
 * by `stored_size` payload bytes. All integers are little-endian.
 *
 *   offset size field
 *        0    4 magic "SJCK"
 *        4    2 format version (1)
 *        6    1 codec: 0 raw, 1 lz4 block over the payload,
 *                      2 Arrow IPC with lz4-frame-compressed buffers (payload as is),
 *                      3 an Arrow IPC schema message as is, then one Blosc2 chunk
 *                        (8-byte shuffle, lz4) of the record batch message; the
 *                        uncompressed size is the schema message's plus the batch
 *                        message's (table chunks only)
 *        7    1 flags: bit 0 broadcast state, bit 1 payload is an entry list
 *                      (else an Arrow IPC stream); other bits 0
 *        8    8 job id
 *       16    8 snapshot id (signed)
 *       24    4 vertex id
 *       28    4 partition (signed; -1 for broadcast state)
 *       32    4 entry count
 *       36    4 uncompressed payload size
 *       40    4 stored payload size
 *       44    4 reserved, 0
 *       48    8 xxh3-64 of the stored payload bytes
 *       56    4 murmur3_32 (seed 0x53434b31) of header bytes 0..55
 *       60    4 reserved, 0
 *
 * An entry list (opaque bytes per key) is, per entry, a uint32 key length,
 * the key bytes, a uint32 value length and the value bytes. The key's
 * partition is its Hazelcast byte[] partition.
 *
 * Readers check the magic, version, header checksum, codec, flags, reserved
 * bytes and every length against the buffer before using it; the payload
 * checksum (xxh3, computed by the caller) and the ids are checked against the
 * snapshot's validation record. */
#ifndef SPARKJET_CHUNK_H
#define SPARKJET_CHUNK_H

#include <stddef.h>
#include <stdint.h>

#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SJ_CHUNK_MAGIC 0x4b434a53u /* "SJCK" read little-endian */
#define SJ_CHUNK_VERSION 1
#define SJ_CHUNK_HEADER_SIZE 64
#define SJ_CHUNK_HEADER_SEED 0x53434b31u

#define SJ_CODEC_RAW 0
#define SJ_CODEC_LZ4 1
#define SJ_CODEC_ARROW_LZ4 2
#define SJ_CODEC_BLOSC2_LZ4 3

#define SJ_CHUNK_BROADCAST 1u
#define SJ_CHUNK_ENTRIES 2u

typedef struct sj_chunk_header {
    uint16_t version;
    uint8_t codec;
    uint8_t flags;
    uint64_t job_id;
    int64_t snapshot_id;
    uint32_t vertex;
    int32_t partition;
    uint32_t entry_count;
    uint32_t uncompressed_size;
    uint32_t stored_size;
    uint64_t checksum;
} sj_chunk_header;

/* Writes the 64 header bytes (version is set to SJ_CHUNK_VERSION).
 * SJ_EINVAL for an unknown codec or flag. */
sj_status sj_chunk_header_encode(const sj_chunk_header *h, uint8_t out[SJ_CHUNK_HEADER_SIZE]);

/* Reads and checks a header at buf[0..len); the payload must fit in len.
 * On SJ_ECORRUPT, *bad_field names the first field that failed. */
sj_status sj_chunk_header_decode(const uint8_t *buf, size_t len, sj_chunk_header *h,
                                 const char **bad_field);

/* Walks the chunks of a file: fills offsets[i] (where chunk i's header
 * starts) and headers[i] for up to `cap` chunks and sets *count. The whole
 * buffer must be chunks, back to back. On SJ_ECORRUPT *err_offset is the bad
 * chunk's offset and *bad_field the field; SJ_ERANGE if more than cap chunks. */
sj_status sj_chunk_scan(const uint8_t *buf, size_t len, int64_t *offsets, sj_chunk_header *headers,
                        size_t cap, size_t *count, size_t *err_offset, const char **bad_field);

/* Stable counting sort of rows by partition: starts[0..partition_count] are
 * the bounds of each partition's run in perm, perm[0..n) the row indices.
 * SJ_EINVAL (with *err_index) for an id outside 0..partition_count-1. */
sj_status sj_scatter_by_partition(const int32_t *partitions, int64_t n, int32_t partition_count,
                                  int64_t *starts, int64_t *perm, int64_t *err_index);

/* Moves fixed-width values (width bytes each) into partition order: value i
 * goes to the next free slot of its partition's run, runs laid out as
 * sj_scatter_by_partition computed them. One sequential read and one write
 * cursor per partition, instead of a random gather by perm. starts holds
 * partition_count + 1 run starts; a partition id outside 0..partition_count-1,
 * starts that are not a nondecreasing run table within 0..n, or more values
 * of a partition than its run holds give SJ_EINVAL (dst may then be partly
 * written), so no write ever leaves dst's n * width bytes. */
sj_status sj_scatter_fixed(const uint8_t *src, int64_t width, int64_t n, const int32_t *partitions,
                           const int64_t *starts, int32_t partition_count, uint8_t *dst);

/* Entry lists. Keys and values are Arrow binary columns (int32 offsets + data). */
typedef struct sj_binary {
    const int32_t *offsets; /* length + 1 values, from `offset` on */
    int64_t offsets_size;   /* bytes */
    const uint8_t *data;
    int64_t data_size;
    int64_t offset;
    int64_t length;
} sj_binary;

/* Per row, the bytes its entry takes (8 + key + value), checked against the
 * buffers. */
sj_status sj_entries_sizes(const sj_binary *keys, const sj_binary *values, int64_t *sizes,
                           int64_t *err_index);

/* Encodes the entries of rows[0..nrows) into out (cap bytes), *written bytes. */
sj_status sj_entries_encode(const sj_binary *keys, const sj_binary *values, const int64_t *rows,
                            int64_t nrows, uint8_t *out, size_t cap, size_t *written);

/* Checks an entry list of `count` entries filling exactly len bytes and
 * returns the total key and value bytes (to size the decode buffers). */
sj_status sj_entries_measure(const uint8_t *payload, size_t len, uint32_t count,
                             int64_t *key_bytes, int64_t *value_bytes, size_t *err_offset);

/* Decodes a measured entry list into Arrow binary layouts: key_offsets and
 * value_offsets get count + 1 int32 each (starting at the given bases), the
 * data is appended to key_data / value_data. */
sj_status sj_entries_decode(const uint8_t *payload, size_t len, uint32_t count,
                            int32_t key_base, int32_t *key_offsets, uint8_t *key_data,
                            int32_t value_base, int32_t *value_offsets, uint8_t *value_data);

#ifdef __cplusplus
}
#endif
#endif
