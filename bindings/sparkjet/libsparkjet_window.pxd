# Declarations only: native/include/sparkjet/groupmap.h and window.h for Cython (see
# libsparkjet.pxd for status.h and hash.h, whose sj_column the group map reads).
# Downstream code that cimports these needs sparkjet.get_include() on its include path;
# the Python API is sparkjet._native's GroupMap, assign_panes and session_ids.
from libc.stdint cimport int32_t, int64_t, uint8_t

from sparkjet.libsparkjet cimport sj_column, sj_status


cdef extern from "sparkjet/groupmap.h" nogil:
    ctypedef struct sj_groupmap:
        pass

    sj_groupmap *sj_groupmap_new(int64_t expected)
    void sj_groupmap_free(sj_groupmap *map)
    int64_t sj_groupmap_size(const sj_groupmap *map)
    sj_status sj_groupmap_reserve(sj_groupmap *map, int64_t total)
    sj_status sj_groupmap_upsert(sj_groupmap *map, const sj_column *cols, int32_t ncols,
                                 int64_t *slots, int64_t *first_rows, int64_t *new_count,
                                 int64_t *err_index, int32_t *err_column)
    sj_status sj_groupmap_lookup(const sj_groupmap *map, const sj_column *cols, int32_t ncols,
                                 int64_t *slots, int64_t *err_index, int32_t *err_column)
    sj_status sj_groupmap_key(const sj_groupmap *map, int64_t slot, const uint8_t **bytes,
                              int64_t *len)


cdef extern from "sparkjet/window.h" nogil:
    sj_status sj_assign_panes(const int64_t *ts, int64_t n, int64_t pane_size, int64_t offset,
                              int64_t *panes, int64_t *err_index)
    sj_status sj_assign_panes_late(const int64_t *ts, int64_t n, int64_t pane_size,
                                   int64_t offset, int64_t min_pane, int64_t *panes,
                                   uint8_t *late, int64_t *late_count, int64_t *err_index)
    sj_status sj_check_sorted(const int64_t *group, const int64_t *start, int64_t n,
                              int64_t *err_index)
    sj_status sj_session_ids(const int64_t *group, const int64_t *start, const int64_t *end,
                             int64_t n, int64_t *session, int64_t *count, int64_t *err_index)
