# Keyed-state kernels (native/include/sparkjet/keyed.h): an int64 key -> dense slot map,
# and aggregate kernels over caller-owned numpy arrays indexed by slot. Every slot is
# checked against the arrays it indexes before anything is written.
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcpy


cdef class KeyMap:
    """int64 keys to dense slots 0, 1, 2, ... in insertion order."""
    cdef sj_keymap *map

    def __cinit__(self, int64_t expected=0):
        if expected < 0:
            raise InvalidArgumentError(f"expected must be >= 0, not {expected}")
        self.map = sj_keymap_new(expected)
        if self.map == NULL:
            raise MemoryError()

    def __dealloc__(self):
        sj_keymap_free(self.map)

    def __len__(self):
        return sj_keymap_size(self.map)

    def upsert(self, const int64_t[::1] keys, int64_t[::1] slots):
        """Finds or inserts every key; writes their slots."""
        cdef int64_t n = keys.shape[0]
        check_len(slots.shape[0], n, "slots")
        if n == 0:
            return
        cdef sj_status st
        with nogil:
            st = sj_keymap_upsert(self.map, &keys[0], n, &slots[0])
        if st != SJ_OK:
            raise MemoryError("keyed state: the key map could not grow")

    def reserve(self, int64_t total):
        """Makes room for ``total`` keys in all (rehashing at most once, now), so that
        adding up to that many grows nothing. InvalidArgumentError for a negative total;
        MemoryError (the map as it was) past memory or 2**32 - 2 keys."""
        if total < 0:
            raise InvalidArgumentError(f"KeyMap.reserve: total must be >= 0, not {total}")
        cdef sj_status st
        with nogil:
            st = sj_keymap_reserve(self.map, total)
        if st != SJ_OK:
            raise MemoryError(f"KeyMap.reserve: no room for {total} keys (at most 2**32 - 2, "
                              f"and memory for 16-32 bytes per key)")

    def upsert_bulk(self, const int64_t[::1] keys not None, int64_t[::1] slots not None):
        """:meth:`upsert` of many keys at once (a restore's): room for all of them is
        made first, in one rehash at most, and the buckets of later keys are fetched
        ahead. Gives the slots :meth:`upsert` gives; on MemoryError nothing is added."""
        cdef int64_t n = keys.shape[0]
        check_len(slots.shape[0], n, "slots")
        if n == 0:
            return
        cdef sj_status st
        with nogil:
            st = sj_keymap_upsert_bulk(self.map, &keys[0], n, &slots[0])
        if st != SJ_OK:
            raise MemoryError(f"KeyMap.upsert_bulk: no room for {n} more keys beside "
                              f"{sj_keymap_size(self.map)} (at most 2**32 - 2, and memory for "
                              f"16-32 bytes per key)")

    def lookup(self, const int64_t[::1] keys, int64_t[::1] slots):
        """Finds every key (slot -1 when missing)."""
        cdef int64_t n = keys.shape[0]
        check_len(slots.shape[0], n, "slots")
        if n == 0:
            return
        with nogil:
            sj_keymap_lookup(self.map, &keys[0], n, &slots[0])

    def keys_at(self, const int64_t[::1] slots, int64_t[::1] out):
        """Writes the keys of the slots (each in 0..len(self)-1) to out."""
        cdef int64_t n = slots.shape[0]
        check_len(out.shape[0], n, "out")
        cdef int64_t size = sj_keymap_size(self.map)
        _keyed_check_slots(slots, size, "slot")
        cdef const int64_t *k = sj_keymap_keys(self.map)
        cdef int64_t i
        with nogil:
            for i in range(n):
                out[i] = k[slots[i]]

    def keys_prefix(self, int64_t[::1] out):
        """Writes the keys of slots 0..len(out)-1 (at most len(self)) to out, in slot
        order: a snapshot's keys, one copy instead of a gather through every slot."""
        cdef int64_t n = out.shape[0]
        cdef int64_t size = sj_keymap_size(self.map)
        if n > size:
            raise InvalidArgumentError(f"out holds {n} values, the map {size} keys")
        if n == 0:
            return
        cdef const int64_t *k = sj_keymap_keys(self.map)
        with nogil:
            memcpy(&out[0], k, <size_t>n * sizeof(int64_t))


cdef int _keyed_check_slots(const int64_t[::1] slots, int64_t size, str what) except -1:
    """Every slot in 0..size-1, or InvalidArgumentError naming the first that is not."""
    cdef int64_t i, bad = -1, n = slots.shape[0]
    with nogil:
        for i in range(n):
            if <uint64_t>slots[i] >= <uint64_t>size:
                bad = i
                break
    if bad >= 0:
        raise InvalidArgumentError(
            f"{what} {slots[bad]} at index {bad} is outside 0..{size - 1}")
    return 0


def agg_count(const int64_t[::1] slots, int64_t[::1] counts):
    """counts[slot] += 1 for every slot."""
    _keyed_check_slots(slots, counts.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_count(&slots[0], n, &counts[0])


cdef int _keyed_check_values(Py_ssize_t values, Py_ssize_t slots) except -1:
    if values != slots:
        raise InvalidArgumentError(f"{values} values for {slots} slots")
    return 0


def agg_sum(const int64_t[::1] slots, const double[::1] values, double[::1] sums):
    """sums[slots[i]] += values[i]."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, sums.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_sum(&slots[0], &values[0], n, &sums[0])


def agg_min(const int64_t[::1] slots, const double[::1] values, double[::1] mins):
    """mins[slots[i]] = min(mins[slots[i]], values[i])."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, mins.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_min(&slots[0], &values[0], n, &mins[0])


def agg_max(const int64_t[::1] slots, const double[::1] values, double[::1] maxs):
    """maxs[slots[i]] = max(maxs[slots[i]], values[i])."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, maxs.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_max(&slots[0], &values[0], n, &maxs[0])


# int64 combines: counts and event times, which float64 cannot hold exactly (the partial
# aggregates of panes and sessions).
def agg_sum_i64(const int64_t[::1] slots not None, const int64_t[::1] values not None,
                int64_t[::1] sums not None):
    """sums[slots[i]] += values[i], all or nothing: AggregateOverflowError (an
    InvalidArgumentError; ``index`` the row) if a sum would overflow int64, with every sum
    left as it was."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, sums.shape[0], "slot")
    cdef int64_t n = slots.shape[0], err = -1
    cdef sj_status st = SJ_OK
    if n:
        with nogil:
            st = sj_agg_sum_i64(&slots[0], &values[0], n, &sums[0], &err)
    if st != SJ_OK:
        raise AggregateOverflowError(
            f"agg_sum_i64: adding {values[err]} at index {err} overflows the int64 sum of "
            f"slot {slots[err]}; no sum was changed", err)


def agg_min_i64(const int64_t[::1] slots not None, const int64_t[::1] values not None,
                int64_t[::1] mins not None):
    """mins[slots[i]] = min(mins[slots[i]], values[i])."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, mins.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_min_i64(&slots[0], &values[0], n, &mins[0])


def agg_max_i64(const int64_t[::1] slots not None, const int64_t[::1] values not None,
                int64_t[::1] maxs not None):
    """maxs[slots[i]] = max(maxs[slots[i]], values[i])."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, maxs.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_max_i64(&slots[0], &values[0], n, &maxs[0])


def agg_first(const int64_t[::1] slots not None, const double[::1] values not None,
              double[::1] firsts not None, uint8_t[::1] seen not None):
    """firsts[slots[i]] = values[i] where seen[slots[i]] is 0, which then becomes 1."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, firsts.shape[0], "slot")
    check_len(seen.shape[0], firsts.shape[0], "seen")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_first(&slots[0], &values[0], n, &firsts[0], &seen[0])


def agg_last(const int64_t[::1] slots not None, const double[::1] values not None,
             double[::1] lasts not None):
    """lasts[slots[i]] = values[i], in row order."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, lasts.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_last(&slots[0], &values[0], n, &lasts[0])


def agg_first_i64(const int64_t[::1] slots not None, const int64_t[::1] values not None,
                  int64_t[::1] firsts not None, uint8_t[::1] seen not None):
    """firsts[slots[i]] = values[i] where seen[slots[i]] is 0, which then becomes 1."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, firsts.shape[0], "slot")
    check_len(seen.shape[0], firsts.shape[0], "seen")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_first_i64(&slots[0], &values[0], n, &firsts[0], &seen[0])


def agg_last_i64(const int64_t[::1] slots not None, const int64_t[::1] values not None,
                 int64_t[::1] lasts not None):
    """lasts[slots[i]] = values[i], in row order."""
    _keyed_check_values(values.shape[0], slots.shape[0])
    _keyed_check_slots(slots, lasts.shape[0], "slot")
    cdef int64_t n = slots.shape[0]
    if n:
        with nogil:
            sj_agg_last_i64(&slots[0], &values[0], n, &lasts[0])


def agg_sum_i128(const int64_t[::1] slots not None, values not None,
                 int64_t[:, ::1] sums not None):
    """Exact sums in 128 bits: sums has shape (slots, 2), each row the low then the high
    64 bits of a two's-complement integer (decimal128(38, 0)'s layout); values is int64,
    one per slot (shape (n,)) or one 128-bit integer per slot (shape (n, 2)). All or
    nothing: AggregateOverflowError (``index`` the row) if a sum would pass
    +-(10^38 - 1), with every sum left as it was."""
    cdef const int64_t[::1] narrow
    cdef const int64_t[:, ::1] wide
    cdef const int64_t *v = NULL
    cdef int is_wide = 0
    cdef int64_t n = slots.shape[0], err = -1
    if getattr(values, "ndim", 1) == 2:
        wide = values
        if wide.shape[1] != 2:
            raise InvalidArgumentError(f"values of shape (n, {wide.shape[1]}); 128-bit "
                                       f"values have shape (n, 2)")
        _keyed_check_values(wide.shape[0], n)
        if n:
            v = &wide[0, 0]
        is_wide = 1
    else:
        narrow = values
        _keyed_check_values(narrow.shape[0], n)
        if n:
            v = &narrow[0]
    if sums.shape[1] != 2:
        raise InvalidArgumentError(f"sums of shape (n, {sums.shape[1]}); 128-bit sums have "
                                   f"shape (n, 2)")
    _keyed_check_slots(slots, sums.shape[0], "slot")
    cdef sj_status st = SJ_OK
    if n:
        with nogil:
            st = sj_agg_sum_i128(&slots[0], v, is_wide, n, &sums[0, 0], &err)
    if st != SJ_OK:
        raise AggregateOverflowError(
            f"agg_sum_i128: adding the value at index {err} takes the sum of slot "
            f"{slots[err]} past +-(10^38 - 1); no sum was changed", err)


def distinct_slots(const int64_t[::1] slots, uint8_t[::1] marks, int64_t[::1] out):
    """Writes the distinct slots in first-appearance order to out; returns how many.
    marks has a zero byte per slot (zero again on return)."""
    cdef int64_t n = slots.shape[0]
    check_len(out.shape[0], n, "out")
    _keyed_check_slots(slots, marks.shape[0], "slot")
    cdef int64_t count = 0
    if n:
        with nogil:
            sj_distinct_slots(&slots[0], n, &marks[0], &out[0], &count)
    return count
