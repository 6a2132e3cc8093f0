/* What the native tests share: the one assertion (counts and reports a failure, keeps
 * going), a deterministic random generator, and a column over a plain C array. */
#ifndef SPARKJET_TESTS_CHECK_H
#define SPARKJET_TESTS_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "sparkjet/hash.h"

static int failures = 0;

#define CHECK(cond, ...)                                    \
    do {                                                    \
        if (!(cond)) {                                      \
            failures++;                                     \
            fprintf(stderr, "%s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                   \
            fputc('\n', stderr);                            \
        }                                                   \
    } while (0)

/* xorshift64: the same sequence on every run and platform. */
static inline uint64_t test_random(void) {
    static uint64_t state = 0x9e3779b97f4a7c15ull;
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

/* A fixed-width or offsets column of n values over `values` (size bytes). */
static inline sj_column test_column(int kind, const void *values, int64_t n, int64_t size) {
    sj_column c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.length = n;
    c.values = values;
    c.values_size = size;
    return c;
}

#endif
