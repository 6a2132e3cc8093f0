# The deduplication map of native/include/sparkjet/dedup.h.
from libc.stdint cimport int64_t, uint8_t

from sparkjet.libsparkjet cimport sj_status


cdef extern from "sparkjet/dedup.h" nogil:
    ctypedef struct sj_dedupmap:
        pass

    sj_dedupmap *sj_dedupmap_new(int64_t expected)
    void sj_dedupmap_free(sj_dedupmap *map)
    int64_t sj_dedupmap_size(const sj_dedupmap *map)
    int64_t sj_dedupmap_live(const sj_dedupmap *map, int64_t limit)
    sj_status sj_dedupmap_process(sj_dedupmap *map, const int64_t *keys, const int64_t *times,
                                  int64_t n, int64_t within, int64_t evict_below, uint8_t *keep,
                                  int64_t *kept, int64_t *done)
    sj_status sj_dedupmap_evict(sj_dedupmap *map, int64_t limit)
    int64_t sj_dedupmap_export(const sj_dedupmap *map, int64_t limit, int64_t *keys,
                               int64_t *passed, int64_t cap)
    sj_status sj_dedupmap_insert(sj_dedupmap *map, const int64_t *keys, const int64_t *passed,
                                 int64_t n, int64_t *done)
