/* Snapshot chunk headers, chunk-file scanning, scatter by partition and entry
 * lists; the format is described in sparkjet/chunk.h. Every length read from
 * input is checked against its buffer before use. */
#define _POSIX_C_SOURCE 200112L /* posix_memalign */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "sparkjet/chunk.h"
#include "sparkjet/hash.h"

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static int codec_known(uint8_t codec) { return codec <= SJ_CODEC_BLOSC2_LZ4; }

/* A Blosc2 chunk holds an Arrow record batch message: table chunks only. */
static int codec_fits(uint8_t codec, uint8_t flags) {
    return codec != SJ_CODEC_BLOSC2_LZ4 || !(flags & SJ_CHUNK_ENTRIES);
}

sj_status sj_chunk_header_encode(const sj_chunk_header *h, uint8_t out[SJ_CHUNK_HEADER_SIZE]) {
    if (!codec_known(h->codec) || (h->flags & ~(SJ_CHUNK_BROADCAST | SJ_CHUNK_ENTRIES)))
        return SJ_EINVAL;
    if (!codec_fits(h->codec, h->flags)) return SJ_EINVAL;
    if (h->codec == SJ_CODEC_RAW && h->stored_size != h->uncompressed_size) return SJ_EINVAL;
    memset(out, 0, SJ_CHUNK_HEADER_SIZE);
    put32(out, SJ_CHUNK_MAGIC);
    put16(out + 4, SJ_CHUNK_VERSION);
    out[6] = h->codec;
    out[7] = h->flags;
    put64(out + 8, h->job_id);
    put64(out + 16, (uint64_t)h->snapshot_id);
    put32(out + 24, h->vertex);
    put32(out + 28, (uint32_t)h->partition);
    put32(out + 32, h->entry_count);
    put32(out + 36, h->uncompressed_size);
    put32(out + 40, h->stored_size);
    put64(out + 48, h->checksum);
    put32(out + 56, (uint32_t)sj_murmur3_32(out, 56, SJ_CHUNK_HEADER_SEED));
    return SJ_OK;
}

#define BAD(field)              \
    do {                        \
        *bad_field = field;     \
        return SJ_ECORRUPT;     \
    } while (0)

sj_status sj_chunk_header_decode(const uint8_t *buf, size_t len, sj_chunk_header *h,
                                 const char **bad_field) {
    *bad_field = NULL;
    if (len < SJ_CHUNK_HEADER_SIZE) BAD("header (truncated)");
    if (get32(buf) != SJ_CHUNK_MAGIC) BAD("magic");
    h->version = get16(buf + 4);
    if (h->version != SJ_CHUNK_VERSION) BAD("format version");
    if (get32(buf + 56) != (uint32_t)sj_murmur3_32(buf, 56, SJ_CHUNK_HEADER_SEED))
        BAD("header checksum");
    h->codec = buf[6];
    h->flags = buf[7];
    if (!codec_known(h->codec)) BAD("codec");
    if (h->flags & ~(SJ_CHUNK_BROADCAST | SJ_CHUNK_ENTRIES)) BAD("flags");
    if (!codec_fits(h->codec, h->flags)) BAD("codec (not one for an entry list)");
    if (get32(buf + 44) != 0 || get32(buf + 60) != 0) BAD("reserved");
    h->job_id = get64(buf + 8);
    h->snapshot_id = (int64_t)get64(buf + 16);
    h->vertex = get32(buf + 24);
    h->partition = (int32_t)get32(buf + 28);
    h->entry_count = get32(buf + 32);
    h->uncompressed_size = get32(buf + 36);
    h->stored_size = get32(buf + 40);
    h->checksum = get64(buf + 48);
    if ((h->flags & SJ_CHUNK_BROADCAST) ? h->partition != -1 : h->partition < 0) BAD("partition");
    if (h->codec == SJ_CODEC_RAW && h->stored_size != h->uncompressed_size) BAD("stored size");
    if (h->stored_size > len - SJ_CHUNK_HEADER_SIZE) BAD("stored size (payload truncated)");
    return SJ_OK;
}

sj_status sj_chunk_scan(const uint8_t *buf, size_t len, int64_t *offsets, sj_chunk_header *headers,
                        size_t cap, size_t *count, size_t *err_offset, const char **bad_field) {
    size_t pos = 0, n = 0;
    *count = 0;
    *err_offset = 0;
    *bad_field = NULL;
    while (pos < len) {
        sj_chunk_header h;
        sj_status st = sj_chunk_header_decode(buf + pos, len - pos, &h, bad_field);
        if (st != SJ_OK) {
            *err_offset = pos;
            return st;
        }
        if (n == cap) {
            *err_offset = pos;
            return SJ_ERANGE;
        }
        offsets[n] = (int64_t)pos;
        headers[n++] = h;
        pos += SJ_CHUNK_HEADER_SIZE + (size_t)h.stored_size;
    }
    *count = n;
    return SJ_OK;
}

sj_status sj_scatter_by_partition(const int32_t *partitions, int64_t n, int32_t partition_count,
                                  int64_t *starts, int64_t *perm, int64_t *err_index) {
    *err_index = -1;
    if (partition_count < 1 || n < 0) return SJ_EINVAL;
    memset(starts, 0, sizeof(int64_t) * ((size_t)partition_count + 1));
    /* Counts land in starts[p + 1]; a prefix sum turns them into run starts. */
    for (int64_t i = 0; i < n; i++) {
        uint32_t p = (uint32_t)partitions[i];
        if (p >= (uint32_t)partition_count) {
            *err_index = i;
            return SJ_EINVAL;
        }
        starts[p + 1]++;
    }
    for (int32_t p = 0; p < partition_count; p++) starts[p + 1] += starts[p];
    if (!perm) return SJ_OK;
    /* Fill with a moving cursor per partition, reusing starts and restoring it after. */
    for (int64_t i = 0; i < n; i++) perm[starts[partitions[i]]++] = i;
    for (int32_t p = partition_count; p > 0; p--) starts[p] = starts[p - 1];
    starts[0] = 0;
    return SJ_OK;
}

/* The next slot of partition p's run, or -1 if the id or the run is bad. The caller reads
 * the id once (another thread may change the ids while the GIL is released: what is
 * checked must be what is used). */
static inline int64_t scatter_slot(uint32_t p, const int64_t *starts, int64_t *cursor,
                                   int32_t partition_count) {
    if (p >= (uint32_t)partition_count || cursor[p] >= starts[p + 1]) return -1;
    return cursor[p]++;
}

/* Values of sizeof(T) bytes moved by memcpy, which compiles to one load and one store and
 * lets src and dst be unaligned (a cast pointer would not). */
#define SCATTER_AS(T)                                                               \
    do {                                                                            \
        for (int64_t i = 0; i < n; i++) {                                           \
            int64_t slot_ = scatter_slot((uint32_t)partitions[i], starts, cursor,   \
                                         partition_count);                          \
            if (slot_ < 0) goto bad;                                                \
            memcpy(dst + sizeof(T) * (size_t)slot_, src + sizeof(T) * (size_t)i,    \
                   sizeof(T));                                                      \
        }                                                                           \
    } while (0)

/* Write-combining scatter, for a destination too large to stay in the cache (a snapshot's
 * state grouped by partition). The plain scatter writes each value into the line of its
 * partition's run, which the CPU first reads from memory, and hundreds of runs' lines
 * evict each other; here each partition's next values gather in a 64-byte buffer laid
 * out as the destination's cache line, and a full line goes out at once with
 * non-temporal stores (no read of the line, nothing evicted). A line that a partition
 * shares with its neighbour (a run's first and last) is written with plain stores, only
 * the partition's own values. Three columns of 5M 8-byte values into 271 partitions:
 * 0.145 -> 0.071 s (a snapshot's grouping, bench_recovery.py's write). */
#define WC_LINE 64

#define SCATTER_WC_AS(T, BAD)                                                               \
    do {                                                                                 \
        enum { PER_LINE = WC_LINE / sizeof(T) };                                         \
        T *d_ = (T *)dst; /* aligned to sizeof(T): checked by the caller */              \
        T(*line_)[PER_LINE] = (T(*)[PER_LINE])lines;                                     \
        for (int64_t i = 0; i < n; i++) {                                                \
            uint32_t p_ = (uint32_t)partitions[i];                                       \
            int64_t k_ = scatter_slot(p_, starts, cursor, partition_count);              \
            if (k_ < 0) goto BAD;                                                        \
            uintptr_t at_ = (uintptr_t)(d_ + k_);                                        \
            unsigned slot_ = (unsigned)((at_ & (WC_LINE - 1)) / sizeof(T));              \
            memcpy(&line_[p_][slot_], src + sizeof(T) * (size_t)i, sizeof(T));           \
            if (slot_ == PER_LINE - 1) {                                                 \
                int64_t first_ = k_ - (PER_LINE - 1);                                    \
                if (first_ >= starts[p_])                                                \
                    store_line((void *)(at_ - (WC_LINE - sizeof(T))), line_[p_]);        \
                else                                                                     \
                    memcpy(d_ + starts[p_], &line_[p_][slot_ - (k_ - starts[p_])],       \
                           sizeof(T) * (size_t)(k_ - starts[p_] + 1));                   \
            }                                                                            \
        }                                                                                \
        for (int32_t p = 0; p < partition_count; p++) { /* the lines not full */         \
            int64_t last_ = cursor[p] - 1;                                               \
            if (last_ < starts[p]) continue;                                             \
            unsigned slot_ = (unsigned)(((uintptr_t)(d_ + last_) & (WC_LINE - 1)) / sizeof(T)); \
            if (slot_ == PER_LINE - 1) continue;                                         \
            int64_t from_ = last_ - slot_ < starts[p] ? starts[p] : last_ - slot_;       \
            memcpy(d_ + from_, &line_[p][slot_ - (last_ - from_)],                       \
                   sizeof(T) * (size_t)(last_ - from_ + 1));                             \
        }                                                                                \
    } while (0)

static inline void store_line(void *to, const void *line) {
#if defined(__SSE2__)
    __m128i *d = (__m128i *)to;
    const __m128i *s = (const __m128i *)line;
    _mm_stream_si128(d, _mm_load_si128(s));
    _mm_stream_si128(d + 1, _mm_load_si128(s + 1));
    _mm_stream_si128(d + 2, _mm_load_si128(s + 2));
    _mm_stream_si128(d + 3, _mm_load_si128(s + 3));
#else
    memcpy(to, line, WC_LINE);
#endif
}

/* The write-combining scatter is taken from this size and this many partitions up: below
 * 1 MiB the plain loop's lines stay in the cache, and with a few dozen partitions or fewer
 * (an exchange splitting a batch among its targets) the plain loop writes a few sequential
 * streams, twice as fast as buffering them (C harness: 271 partitions, 1 MiB of 8-byte
 * values, 8.1 against 6.8 ns a value; 4 partitions, 3.9 against 6.9). */
#define WC_MIN_BYTES (1 << 20)
#define WC_MIN_PARTITIONS 64

sj_status sj_scatter_fixed(const uint8_t *src, int64_t width, int64_t n, const int32_t *partitions,
                           const int64_t *starts, int32_t partition_count, uint8_t *dst) {
    if (width < 1 || n < 0 || partition_count < 1) return SJ_EINVAL;
    if (starts[0] < 0 || starts[partition_count] > n) return SJ_EINVAL;
    for (int32_t p = 0; p < partition_count; p++)
        if (starts[p] > starts[p + 1]) return SJ_EINVAL;
    int64_t *cursor = (int64_t *)malloc(sizeof(int64_t) * (size_t)partition_count);
    if (!cursor) return SJ_ENOMEM;
    memcpy(cursor, starts, sizeof(int64_t) * (size_t)partition_count);
    if ((width == 8 || width == 4) && n * width >= WC_MIN_BYTES &&
        partition_count >= WC_MIN_PARTITIONS &&
        ((uintptr_t)dst & (uintptr_t)(width - 1)) == 0) {
        void *lines = NULL;
        if (posix_memalign(&lines, WC_LINE, (size_t)WC_LINE * (size_t)partition_count) == 0) {
            sj_status st = SJ_OK;
            if (width == 8)
                SCATTER_WC_AS(uint64_t, bad_wc);
            else
                SCATTER_WC_AS(uint32_t, bad_wc);
            if (0) {
            bad_wc:
                st = SJ_EINVAL; /* (dst may be partly written, as by the plain loop) */
            }
#if defined(__SSE2__)
            _mm_sfence(); /* the non-temporal stores are visible before this returns */
#endif
            free(lines);
            free(cursor);
            return st;
        }
    }
    switch (width) {
    case 1: SCATTER_AS(uint8_t); break;
    case 2: SCATTER_AS(uint16_t); break;
    case 4: SCATTER_AS(uint32_t); break;
    case 8: SCATTER_AS(uint64_t); break;
    default:
        for (int64_t i = 0; i < n; i++) {
            int64_t slot = scatter_slot((uint32_t)partitions[i], starts, cursor, partition_count);
            if (slot < 0) goto bad;
            memcpy(dst + width * slot, src + width * i, (size_t)width);
        }
    }
    free(cursor);
    return SJ_OK;
bad:
    free(cursor);
    return SJ_EINVAL;
}

static sj_status binary_span(const sj_binary *b, int64_t i, const uint8_t **p, uint32_t *len) {
    int64_t k = b->offset + i;
    int64_t s = b->offsets[k], e = b->offsets[k + 1];
    if ((uint64_t)e > (uint64_t)b->data_size || (uint64_t)s > (uint64_t)e) return SJ_EBOUNDS;
    *p = b->data + s;
    *len = (uint32_t)(e - s);
    return SJ_OK;
}

static sj_status binary_check(const sj_binary *b, int64_t length) {
    if (b->length != length || b->offset < 0 || b->length < 0) return SJ_EINVAL;
    if (b->length && (b->offset + b->length + 1 > b->offsets_size / 4 || !b->offsets))
        return SJ_EBOUNDS;
    return SJ_OK;
}

sj_status sj_entries_sizes(const sj_binary *keys, const sj_binary *values, int64_t *sizes,
                           int64_t *err_index) {
    *err_index = -1;
    sj_status st = binary_check(keys, keys->length);
    if (st == SJ_OK) st = binary_check(values, keys->length);
    if (st != SJ_OK) return st;
    for (int64_t i = 0; i < keys->length; i++) {
        const uint8_t *p;
        uint32_t kl, vl;
        if (binary_span(keys, i, &p, &kl) != SJ_OK || binary_span(values, i, &p, &vl) != SJ_OK) {
            *err_index = i;
            return SJ_EBOUNDS;
        }
        sizes[i] = 8 + (int64_t)kl + vl;
    }
    return SJ_OK;
}

sj_status sj_entries_encode(const sj_binary *keys, const sj_binary *values, const int64_t *rows,
                            int64_t nrows, uint8_t *out, size_t cap, size_t *written) {
    size_t pos = 0;
    *written = 0;
    sj_status st = binary_check(keys, keys->length);
    if (st == SJ_OK) st = binary_check(values, keys->length);
    if (st != SJ_OK) return st;
    for (int64_t r = 0; r < nrows; r++) {
        int64_t i = rows[r];
        const uint8_t *kp, *vp;
        uint32_t kl, vl;
        if (i < 0 || i >= keys->length) return SJ_EINVAL;
        if (binary_span(keys, i, &kp, &kl) != SJ_OK || binary_span(values, i, &vp, &vl) != SJ_OK)
            return SJ_EBOUNDS;
        if (cap - pos < 8 || cap - pos - 8 < (size_t)kl + vl) return SJ_ERANGE;
        put32(out + pos, kl);
        memcpy(out + pos + 4, kp, kl);
        pos += 4 + kl;
        put32(out + pos, vl);
        memcpy(out + pos + 4, vp, vl);
        pos += 4 + vl;
    }
    *written = pos;
    return SJ_OK;
}

sj_status sj_entries_measure(const uint8_t *payload, size_t len, uint32_t count,
                             int64_t *key_bytes, int64_t *value_bytes, size_t *err_offset) {
    size_t pos = 0;
    int64_t kb = 0, vb = 0;
    *err_offset = 0;
    for (uint32_t e = 0; e < count; e++) {
        for (int part = 0; part < 2; part++) {
            if (len - pos < 4) {
                *err_offset = pos;
                return SJ_ECORRUPT;
            }
            uint32_t n = get32(payload + pos);
            if (len - pos - 4 < n) {
                *err_offset = pos;
                return SJ_ECORRUPT;
            }
            pos += 4 + (size_t)n;
            if (part) vb += n;
            else kb += n;
        }
    }
    if (pos != len || kb > INT32_MAX || vb > INT32_MAX) {
        *err_offset = pos;
        return SJ_ECORRUPT;
    }
    *key_bytes = kb;
    *value_bytes = vb;
    return SJ_OK;
}

sj_status sj_entries_decode(const uint8_t *payload, size_t len, uint32_t count,
                            int32_t key_base, int32_t *key_offsets, uint8_t *key_data,
                            int32_t value_base, int32_t *value_offsets, uint8_t *value_data) {
    int64_t kb, vb;
    size_t err;
    sj_status st = sj_entries_measure(payload, len, count, &kb, &vb, &err);
    if (st != SJ_OK) return st;
    if ((int64_t)key_base + kb > INT32_MAX || (int64_t)value_base + vb > INT32_MAX)
        return SJ_ERANGE;
    size_t pos = 0;
    int32_t ko = 0, vo = 0;
    key_offsets[0] = key_base;
    value_offsets[0] = value_base;
    for (uint32_t e = 0; e < count; e++) {
        uint32_t n = get32(payload + pos);
        memcpy(key_data + ko, payload + pos + 4, n);
        ko += (int32_t)n;
        key_offsets[e + 1] = key_base + ko;
        pos += 4 + n;
        n = get32(payload + pos);
        memcpy(value_data + vo, payload + pos + 4, n);
        vo += (int32_t)n;
        value_offsets[e + 1] = value_base + vo;
        pos += 4 + n;
    }
    return SJ_OK;
}
