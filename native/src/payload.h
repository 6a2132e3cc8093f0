/* The Hazelcast payload of one value of an sj_column (internal): shared by the
 * composite row hash (hash.c), which hashes the concatenated payloads of a row,
 * and the group map (groupmap.c), which uses them as the identity of a key.
 * Both read a column through these functions only, so that a row hashes and
 * groups by the same bytes, checked against the same buffers. */
#ifndef SPARKJET_PAYLOAD_H
#define SPARKJET_PAYLOAD_H

#include <stdint.h>
#include <string.h>

#include "sparkjet/hash.h"

static inline void sj_put_be32(uint8_t *p, uint32_t v) {
    v = __builtin_bswap32(v);
    memcpy(p, &v, 4);
}

/* The bytes of value i of a String/byte[] column (SJ_KEY_VAR32, VAR64, FIXED,
 * VIEW), checked against its buffers: SJ_EBOUNDS for an offset, view or
 * length outside them, SJ_ERANGE for a value longer than Java's int32 length
 * prefix allows. The column itself must have passed sj_column_check. */
static inline sj_status sj_var_span(const sj_column *col, int64_t i, const uint8_t **ptr,
                                    uint32_t *len) {
    static const uint8_t empty[1];
    int64_t s, e;
    int64_t k = col->offset + i;
    switch (col->kind) {
    case SJ_KEY_VAR32:
        s = ((const int32_t *)col->values)[k];
        e = ((const int32_t *)col->values)[k + 1];
        break;
    case SJ_KEY_VAR64:
        s = ((const int64_t *)col->values)[k];
        e = ((const int64_t *)col->values)[k + 1];
        break;
    case SJ_KEY_FIXED:
        *ptr = col->width ? col->data + k * col->width : empty;
        *len = (uint32_t)col->width;
        return SJ_OK;
    default: { /* SJ_KEY_VIEW: length, then 12 inline bytes or prefix, buffer, offset */
        const uint8_t *view = (const uint8_t *)col->values + 16 * k;
        int32_t n, buf, off;
        memcpy(&n, view, 4);
        if (n < 0) return SJ_EBOUNDS;
        *len = (uint32_t)n;
        if (n <= 12) {
            *ptr = view + 4;
            return SJ_OK;
        }
        memcpy(&buf, view + 8, 4);
        memcpy(&off, view + 12, 4);
        if (buf < 0 || buf >= col->variadic_count || off < 0 ||
            (int64_t)off + n > col->variadic_sizes[buf] || !col->variadic[buf])
            return SJ_EBOUNDS;
        *ptr = col->variadic[buf] + off;
        return SJ_OK;
    }
    }
    /* Unsigned compares also reject negative offsets. */
    if ((uint64_t)e > (uint64_t)col->data_size || (uint64_t)s > (uint64_t)e) return SJ_EBOUNDS;
    if (e - s > INT32_MAX - 4) return SJ_ERANGE; /* Java's int32 length prefix */
    *ptr = e > s ? col->data + s : empty;
    *len = (uint32_t)(e - s);
    return SJ_OK;
}

/* One value's payload in two pieces: `head`, its fixed bytes (a big-endian
 * Integer or Long, or the big-endian int32 length of a String/byte[]), and
 * `tail`, the bytes of a String/byte[] (none for integers). */
typedef struct sj_payload {
    uint8_t head[8];
    uint32_t head_len;
    const uint8_t *tail;
    uint32_t tail_len;
} sj_payload;

/* The payload of value i of a column that passed sj_column_check: SJ_ERANGE
 * for an SJ_KEY_INT64_AS_INT32 value outside int32, else as sj_var_span. */
static inline sj_status sj_payload_of(const sj_column *col, int64_t i, sj_payload *p) {
    int64_t k = col->offset + i;
    p->tail = NULL;
    p->tail_len = 0;
    switch (col->kind) {
    case SJ_KEY_INT32:
        sj_put_be32(p->head, (uint32_t)((const int32_t *)col->values)[k]);
        p->head_len = 4;
        return SJ_OK;
    case SJ_KEY_INT64: {
        uint64_t v = (uint64_t)((const int64_t *)col->values)[k];
        sj_put_be32(p->head, (uint32_t)(v >> 32));
        sj_put_be32(p->head + 4, (uint32_t)v);
        p->head_len = 8;
        return SJ_OK;
    }
    case SJ_KEY_INT64_AS_INT32: {
        int64_t v = ((const int64_t *)col->values)[k];
        if (v != (int64_t)(int32_t)v) return SJ_ERANGE;
        sj_put_be32(p->head, (uint32_t)v);
        p->head_len = 4;
        return SJ_OK;
    }
    default: {
        sj_status st = sj_var_span(col, i, &p->tail, &p->tail_len);
        if (st != SJ_OK) return st;
        sj_put_be32(p->head, p->tail_len);
        p->head_len = 4;
        return SJ_OK;
    }
    }
}

/* The columns of a composite key: at least one, each valid (sj_column_check)
 * and as long as the first, whose length goes to *rows. On error
 * *err_column is the bad column (-1 when there is none). */
static inline sj_status sj_key_columns_check(const sj_column *cols, int32_t ncols, int64_t *rows,
                                             int32_t *err_column) {
    *err_column = -1;
    if (ncols < 1 || !cols) return SJ_EINVAL;
    *rows = cols[0].length;
    for (int32_t c = 0; c < ncols; c++) {
        sj_status st = sj_column_check(&cols[c]);
        if (st == SJ_OK && cols[c].length != *rows) st = SJ_EINVAL;
        if (st != SJ_OK) {
            *err_column = c;
            return st;
        }
    }
    return SJ_OK;
}

#endif
