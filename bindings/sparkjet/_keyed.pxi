# cython: freethreading_compatible = True
"""Keyed-state kernels bound to Python: an int64 key -> dense slot map and aggregate
kernels over caller-owned arrays (numpy buffers passed by address and length)."""
from libc.stdint cimport int64_t, uint8_t, uintptr_t

from sparkjet.libsparkjet cimport *


cdef class KeyMap:
    """int64 keys to dense slots 0, 1, 2, ... in insertion order."""
    cdef sj_keymap *map

    def __cinit__(self, int64_t expected=0):
        self.map = sj_keymap_new(expected)
        if self.map == NULL:
            raise MemoryError()

    def __dealloc__(self):
        sj_keymap_free(self.map)

    def __len__(self):
        return sj_keymap_size(self.map)

    def upsert(self, uintptr_t keys, int64_t n, uintptr_t slots):
        """Finds or inserts n keys; writes their slots."""
        cdef sj_status st
        with nogil:
            st = sj_keymap_upsert(self.map, <const int64_t *>keys, n, <int64_t *>slots)
        if st != SJ_OK:
            raise MemoryError("keyed state: the key map could not grow")

    def lookup(self, uintptr_t keys, int64_t n, uintptr_t slots):
        """Finds n keys (slot -1 when missing)."""
        with nogil:
            sj_keymap_lookup(self.map, <const int64_t *>keys, n, <int64_t *>slots)

    def keys_at(self, uintptr_t slots, int64_t n, uintptr_t out):
        """Writes the keys of n slots (each in 0..len(self)-1) to out."""
        cdef int64_t size = sj_keymap_size(self.map)
        cdef const int64_t *k = sj_keymap_keys(self.map)
        cdef const int64_t *s = <const int64_t *>slots
        cdef int64_t *o = <int64_t *>out
        cdef int64_t i
        for i in range(n):
            if s[i] < 0 or s[i] >= size:
                raise IndexError(f"slot {s[i]} outside 0..{size - 1}")
        with nogil:
            for i in range(n):
                o[i] = k[s[i]]


def agg_count(uintptr_t slots, int64_t n, uintptr_t counts):
    with nogil:
        sj_agg_count(<const int64_t *>slots, n, <int64_t *>counts)


def agg_sum(uintptr_t slots, uintptr_t values, int64_t n, uintptr_t sums):
    with nogil:
        sj_agg_sum(<const int64_t *>slots, <const double *>values, n, <double *>sums)


def agg_min(uintptr_t slots, uintptr_t values, int64_t n, uintptr_t mins):
    with nogil:
        sj_agg_min(<const int64_t *>slots, <const double *>values, n, <double *>mins)


def agg_max(uintptr_t slots, uintptr_t values, int64_t n, uintptr_t maxs):
    with nogil:
        sj_agg_max(<const int64_t *>slots, <const double *>values, n, <double *>maxs)


def distinct_slots(uintptr_t slots, int64_t n, uintptr_t marks, uintptr_t out):
    """Writes the distinct slots in first-appearance order to out; returns how many."""
    cdef int64_t count = 0
    with nogil:
        sj_distinct_slots(<const int64_t *>slots, n, <uint8_t *>marks, <int64_t *>out, &count)
    return count
