# Event-time window kernels (native/include/sparkjet/groupmap.h and window.h): the
# composite-key group map, pane assignment and session ids.
#
# Key columns arrive as the tuples sparkjet._keys.describe builds for the hash kernels
# (see _hash.pxi: Columns checks each against its buffers); everything else as
# C-contiguous int64 / uint8 memoryviews, whose lengths are checked here before the GIL is
# released. The int64 combines of partial aggregates are in _keyed.pxi.
from cpython.pythread cimport (
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.stdint cimport INT64_MIN, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from sparkjet.libsparkjet_window cimport *

# The payload type of each key kind: what a GroupMap's columns must keep.
_PAYLOAD_TYPES = {SJ_KEY_INT32: "Integer", SJ_KEY_INT64_AS_INT32: "Integer",
                  SJ_KEY_INT64: "Long", SJ_KEY_VAR32: "bytes", SJ_KEY_VAR64: "bytes",
                  SJ_KEY_FIXED: "bytes", SJ_KEY_VIEW: "bytes"}


cdef class GroupMap:
    """Composite keys (one or more key columns) to dense slots 0, 1, 2, ... in insertion
    order. A key is the concatenation of its columns' Hazelcast payloads, so the same
    values in string and large_string columns (or int32 columns and int64 ones hashed as
    Integer) are the same key; the payload types (Integer, Long, bytes) of the columns are
    fixed by the first upsert. Calls from several threads take turns (a lock per map)."""
    cdef sj_groupmap *map
    cdef PyThread_type_lock lock
    cdef tuple types

    def __cinit__(self, int64_t expected=0):
        if expected < 0:
            raise InvalidArgumentError(f"expected must be >= 0, not {expected}")
        self.lock = PyThread_allocate_lock()
        self.map = sj_groupmap_new(expected)
        if self.map == NULL or self.lock == NULL:
            raise MemoryError("cannot allocate a GroupMap")

    def __dealloc__(self):
        if self.map != NULL:
            sj_groupmap_free(self.map)
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    def __len__(self):
        return sj_groupmap_size(self.map)

    def __repr__(self):
        return f"GroupMap({len(self)} keys, payload types {self.types})"

    def reserve(self, int64_t total):
        """Makes room for ``total`` keys in all (rehashing at most once, now), so that
        adding up to that many rehashes nothing. InvalidArgumentError for a negative
        total; MemoryError (the map as it was) past memory or 2**40 keys."""
        if total < 0:
            raise InvalidArgumentError(f"GroupMap.reserve: total must be >= 0, not {total}")
        cdef sj_status st
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            st = sj_groupmap_reserve(self.map, total)
            PyThread_release_lock(self.lock)
        if st != SJ_OK:
            raise MemoryError(f"GroupMap.reserve: no room for {total} keys (at most 2**40)")

    def upsert(self, list key_descs not None, int64_t[::1] slots not None,
               int64_t[::1] first_rows not None, list names=None, int64_t index_base=0):
        """Finds or inserts the key of every row: slots[i] is row i's slot, and
        first_rows[k] the row where the k-th new slot (len(self) before the call + k)
        first appeared. Returns how many slots are new. Refused input changes nothing; on
        MemoryError the keys inserted before it stay (len(self) says how many, first_rows
        where). ``names`` and ``index_base`` only go into error messages."""
        cdef Columns cols = _window_key_columns(key_descs, names)
        check_len(slots.shape[0], cols.rows, "slots")
        check_len(first_rows.shape[0], cols.rows, "first_rows")
        types = _window_check_types(self, key_descs, names)
        cdef int64_t added = 0, err = -1
        cdef int32_t err_col = -1
        cdef sj_status st
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            st = sj_groupmap_upsert(self.map, cols.cols, cols.n,
                                    &slots[0] if cols.rows else NULL,
                                    &first_rows[0] if cols.rows else NULL, &added, &err,
                                    &err_col)
            PyThread_release_lock(self.lock)
        if self.types is None and (st == SJ_OK or sj_groupmap_size(self.map)):
            self.types = types
        if st == SJ_ENOMEM:
            raise MemoryError(f"GroupMap: out of memory after inserting {added} new keys")
        _window_check_key_status(self, st, err, err_col, names, index_base)
        return added

    def lookup(self, list key_descs not None, int64_t[::1] slots not None, list names=None,
               int64_t index_base=0):
        """Finds the key of every row without inserting: slots[i] = -1 for a key not in
        the map."""
        cdef Columns cols = _window_key_columns(key_descs, names)
        check_len(slots.shape[0], cols.rows, "slots")
        _window_check_types(self, key_descs, names)
        cdef int64_t err = -1
        cdef int32_t err_col = -1
        cdef sj_status st
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            st = sj_groupmap_lookup(self.map, cols.cols, cols.n,
                                    &slots[0] if cols.rows else NULL, &err, &err_col)
            PyThread_release_lock(self.lock)
        if st == SJ_ENOMEM:
            raise MemoryError("GroupMap: out of memory")
        _window_check_key_status(self, st, err, err_col, names, index_base)

    def key_payload(self, int64_t slot):
        """The stored key of a slot: its columns' Hazelcast payloads, concatenated."""
        cdef const uint8_t *data = NULL
        cdef char *copy = NULL
        cdef int64_t length = 0
        cdef sj_status st
        with nogil:
            # Copied under the lock: another thread's upsert may move the arena.
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
            st = sj_groupmap_key(self.map, slot, &data, &length)
            if st == SJ_OK:
                copy = <char *>malloc(length if length else 1)
                if copy != NULL:
                    memcpy(copy, data, length)
            PyThread_release_lock(self.lock)
        if st != SJ_OK:
            raise InvalidArgumentError(f"slot {slot} is outside 0..{len(self) - 1}")
        if copy == NULL:
            raise MemoryError()
        try:
            return copy[:length]
        finally:
            free(copy)


cdef Columns _window_key_columns(list key_descs, list names):
    if not key_descs:
        raise InvalidArgumentError("a group key needs at least one column")
    return Columns(key_descs, names)


cdef tuple _window_check_types(GroupMap m, list key_descs, list names):
    """The payload types of the key columns, refused unless they are the map's."""
    types = tuple(_PAYLOAD_TYPES.get(d[0], "?") for d in key_descs)
    if m.types is not None and types != m.types:
        if len(types) != len(m.types):
            raise InvalidArgumentError(
                f"group key has {len(types)} columns, this map's keys have {len(m.types)}")
        c = next(i for i in range(len(types)) if types[i] != m.types[i])
        what = f"key column {names[c]!r}" if names and c < len(names) else f"key column {c}"
        raise InvalidArgumentError(
            f"{what} holds {types[c]} values, this map's keys hold {m.types[c]} there")
    return types


cdef int _window_check_key_status(GroupMap m, sj_status st, int64_t err, int32_t err_col,
                                  list names, int64_t index_base) except -1:
    if st == SJ_ERANGE:
        what = (f"key column {names[err_col]!r}" if names and 0 <= err_col < len(names)
                else f"key column {err_col}")
        raise KeyRangeError(f"{what}: value at index {err + index_base} does not fit an "
                            "Integer (int32)", err + index_base)
    check_status(st, "group key", err + index_base if err >= 0 else -1, err_col, names,
                 "index", True)
    return 0


def assign_panes(const int64_t[::1] ts not None, int64_t pane_size, int64_t offset,
                 int64_t[::1] panes not None):
    """panes[i] = floor((ts[i] - offset) / pane_size), exact over all of int64; panes may
    be ts itself."""
    assign_panes_late(ts, pane_size, offset, INT64_MIN, panes, None)


def assign_panes_late(const int64_t[::1] ts not None, int64_t pane_size, int64_t offset,
                      int64_t min_pane, int64_t[::1] panes not None, uint8_t[::1] late=None):
    """assign_panes, and the rows whose pane is below min_pane: late[i] = 1 for them, 0
    for the others (when late is given). Returns how many rows are late."""
    cdef int64_t n = ts.shape[0], late_count = 0, err = -1
    check_len(panes.shape[0], n, "panes")
    if late is not None:
        check_len(late.shape[0], n, "late")
    if pane_size <= 0:
        raise InvalidArgumentError(f"pane_size must be > 0, not {pane_size}")
    cdef uint8_t *late_ptr = &late[0] if late is not None and n else NULL
    cdef sj_status st
    with nogil:
        st = sj_assign_panes_late(&ts[0] if n else NULL, n, pane_size, offset, min_pane,
                                  &panes[0] if n else NULL, late_ptr, &late_count, &err)
    if st == SJ_ERANGE:
        raise InvalidArgumentError(
            f"the pane of timestamp {ts[err]} at index {err} (offset {offset}, pane_size "
            f"{pane_size}) does not fit int64")
    check_status(st, "assign_panes")
    return late_count


def check_sorted(const int64_t[::1] group not None, const int64_t[::1] start not None):
    """InvalidArgumentError naming the first row out of order unless the rows are sorted
    by (group, start)."""
    cdef int64_t n = group.shape[0], err = -1
    _window_check_same_len(start.shape[0], n, "start")
    cdef sj_status st
    with nogil:
        st = sj_check_sorted(&group[0] if n else NULL, &start[0] if n else NULL, n, &err)
    if st != SJ_OK:
        raise InvalidArgumentError(_window_order_message(group, start, err))


def session_ids(const int64_t[::1] group not None, const int64_t[::1] start not None,
                const int64_t[::1] end not None, int64_t[::1] session not None):
    """Session ids of the intervals [start, end) of rows sorted by (group, start): a row
    joins the session before it when it has the same group and starts at or before the
    largest end seen in that session. Writes session[i] (0, 1, ... in row order) and
    returns the number of sessions."""
    cdef int64_t n = group.shape[0], count = 0, err = -1
    _window_check_same_len(start.shape[0], n, "start")
    _window_check_same_len(end.shape[0], n, "end")
    check_len(session.shape[0], n, "session")
    cdef sj_status st
    with nogil:
        st = sj_session_ids(&group[0] if n else NULL, &start[0] if n else NULL,
                            &end[0] if n else NULL, n, &session[0] if n else NULL, &count,
                            &err)
    if st != SJ_OK:
        if end[err] < start[err]:
            raise InvalidArgumentError(
                f"interval at index {err} ends before it starts ({start[err]}, {end[err]})")
        raise InvalidArgumentError(_window_order_message(group, start, err))
    return count


cdef str _window_order_message(const int64_t[::1] group, const int64_t[::1] start, int64_t i):
    return (f"rows are not sorted by (group, start): index {i} has ({group[i]}, {start[i]}) "
            f"after ({group[i - 1]}, {start[i - 1]})")


cdef int _window_check_same_len(Py_ssize_t have, int64_t need, str what) except -1:
    if have != need:
        raise InvalidArgumentError(f"{what} holds {have} values, group {need}")
    return 0
