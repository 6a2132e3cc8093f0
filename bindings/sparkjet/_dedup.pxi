# The deduplication map (native/include/sparkjet/dedup.h): int64 key -> the event time of
# the event that last passed, decided row by row in one native pass. Arrays arrive as
# C-contiguous int64 / uint8 memoryviews whose lengths are checked before the GIL is
# released; calls from several threads take turns (a lock per map).
from cpython.pythread cimport (
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.stdint cimport int64_t, uint8_t

from sparkjet.libsparkjet_dedup cimport *


cdef class DedupMap:
    """int64 keys -> the time of the event of that key that passed last."""
    cdef sj_dedupmap *map
    cdef PyThread_type_lock lock

    def __cinit__(self, int64_t expected=0):
        if expected < 0:
            raise InvalidArgumentError(f"expected must be >= 0, not {expected}")
        self.lock = PyThread_allocate_lock()
        self.map = sj_dedupmap_new(expected)
        if self.map == NULL or self.lock == NULL:
            raise MemoryError("cannot allocate a DedupMap")

    def __dealloc__(self):
        if self.map != NULL:
            sj_dedupmap_free(self.map)
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    def __len__(self):
        """Entries held, evictable ones included (see :meth:`live`)."""
        return sj_dedupmap_size(self.map)

    def live(self, int64_t limit):
        """How many entries have a passed time >= limit."""
        cdef int64_t n
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            n = sj_dedupmap_live(self.map, limit)
            PyThread_release_lock(self.lock)
        return n

    def process(self, const int64_t[::1] keys, const int64_t[::1] times, int64_t within,
                int64_t evict_below, uint8_t[::1] keep):
        """Decides every row in order (keep[i] = 1: row i passes) and returns how many
        passed. An entry whose passed time is below evict_below counts as absent."""
        cdef int64_t n = keys.shape[0], kept = 0, done = 0
        check_len(times.shape[0], n, "times")
        check_len(keep.shape[0], n, "keep")
        if within < 0:
            raise InvalidArgumentError(f"within must be >= 0, not {within}")
        if n == 0:
            return 0
        cdef sj_status st
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            st = sj_dedupmap_process(self.map, &keys[0], &times[0], n, within, evict_below,
                                     &keep[0], &kept, &done)
            PyThread_release_lock(self.lock)
        if st == SJ_ENOMEM:
            raise MemoryError(f"DedupMap: out of memory after {done} of {n} rows")
        check_status(st, "DedupMap.process")
        return kept

    def evict(self, int64_t limit):
        """Drops the entries whose passed time is below limit now."""
        cdef sj_status st
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            st = sj_dedupmap_evict(self.map, limit)
            PyThread_release_lock(self.lock)
        if st == SJ_ENOMEM:
            raise MemoryError("DedupMap: out of memory while evicting")
        check_status(st, "DedupMap.evict")

    def export(self, int64_t limit, int64_t[::1] keys, int64_t[::1] passed):
        """Writes the entries with a passed time >= limit (as many as fit; size the arrays
        with :meth:`live`) to keys and passed, in table order; returns how many."""
        cdef int64_t cap = keys.shape[0], got = 0
        check_len(passed.shape[0], cap, "passed")
        if cap == 0:
            return 0
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            got = sj_dedupmap_export(self.map, limit, &keys[0], &passed[0], cap)
            PyThread_release_lock(self.lock)
        return got

    def insert(self, const int64_t[::1] keys, const int64_t[::1] passed):
        """Sets each key's passed time (the later one where the key is there already)."""
        cdef int64_t n = keys.shape[0], done = 0
        check_len(passed.shape[0], n, "passed")
        if n == 0:
            return
        cdef sj_status st
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            st = sj_dedupmap_insert(self.map, &keys[0], &passed[0], n, &done)
            PyThread_release_lock(self.lock)
        if st == SJ_ENOMEM:
            raise MemoryError(f"DedupMap: out of memory after {done} of {n} entries")
        check_status(st, "DedupMap.insert")
