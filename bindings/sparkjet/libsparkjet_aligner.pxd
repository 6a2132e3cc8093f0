# Declarations only: native/include/sparkjet/aligner.h for Cython. Downstream code that
# cimports these needs sparkjet.get_include() on its include path; the Python API is
# sparkjet.runtime.aligner. Status codes are sparkjet/status.h's (libsparkjet.pxd).
from libc.stdint cimport int32_t, int64_t

from sparkjet.libsparkjet cimport sj_status


cdef extern from "sparkjet/aligner.h" nogil:
    int32_t SJ_ALIGNER_MAX_CHANNELS
    int64_t SJ_ALIGNER_MAX_CAPACITY
    int64_t SJ_ALIGNER_MAX_SNAPSHOT_ID
    int32_t SJ_ALIGNER_BURST
    int64_t SJ_ALIGNER_NO_DEADLINE

    ctypedef enum sj_align_mode:
        SJ_EXACTLY_ONCE
        SJ_AT_LEAST_ONCE

    ctypedef enum sj_event_kind:
        SJ_EVENT_ITEM
        SJ_EVENT_SNAPSHOT
        SJ_EVENT_DONE

    ctypedef struct sj_event:
        int32_t kind
        int32_t channel
        int64_t snapshot_id
        int32_t terminal
        void *item

    ctypedef enum sj_barrier_fault:
        SJ_FAULT_NONE
        SJ_FAULT_UNEXPECTED_ID
        SJ_FAULT_OTHER_ID
        SJ_FAULT_SECOND
        SJ_FAULT_TERMINAL

    ctypedef struct sj_barrier_failure:
        int32_t fault
        int32_t channel
        int64_t snapshot_id
        int32_t terminal
        int64_t expected

    ctypedef struct sj_alignment:
        int64_t snapshot_id
        int32_t terminal
        int32_t blocking
        int64_t started_ns
        int64_t duration_ns

    ctypedef struct sj_aligner:
        pass

    int64_t sj_aligner_now_ns()
    sj_status sj_aligner_new(int32_t channels, int32_t mode, int64_t capacity,
                                   sj_aligner **out)
    void sj_aligner_free(sj_aligner *a, void (*release)(void *item, void *ctx), void *ctx)
    int32_t sj_aligner_channels(const sj_aligner *a)
    int32_t sj_aligner_mode(const sj_aligner *a)
    int64_t sj_aligner_capacity(const sj_aligner *a)

    sj_status sj_aligner_offer(sj_aligner *a, int32_t channel, void *item)
    sj_status sj_aligner_offer_many(sj_aligner *a, int32_t channel, void *const *items,
                                          int64_t n, int64_t *accepted)
    sj_status sj_aligner_offer_barrier(sj_aligner *a, int32_t channel, int64_t snapshot_id,
                                             int32_t terminal)
    sj_status sj_aligner_offer_end(sj_aligner *a, int32_t channel)
    sj_status sj_aligner_wait_space(sj_aligner *a, int32_t channel, int64_t want,
                                          int64_t deadline_ns)

    sj_status sj_aligner_poll(sj_aligner *a, sj_event *ev)
    sj_status sj_aligner_drain(sj_aligner *a, sj_event *evs, int64_t max, int64_t *count)
    sj_status sj_aligner_wait(sj_aligner *a, int64_t deadline_ns)
    sj_status sj_aligner_expect(sj_aligner *a, int64_t snapshot_id)
    int64_t sj_aligner_expected(const sj_aligner *a)
    int64_t sj_aligner_aligning(const sj_aligner *a)
    int32_t sj_aligner_live(const sj_aligner *a)
    int64_t sj_aligner_alignments(const sj_aligner *a)
    sj_status sj_aligner_last_alignment(const sj_aligner *a, sj_alignment *out,
                                              int64_t *held_ns)

    int64_t sj_aligner_queued(const sj_aligner *a, int32_t channel)
    int64_t sj_aligner_size(const sj_aligner *a)
    void sj_aligner_close(sj_aligner *a)
    int32_t sj_aligner_state(const sj_aligner *a)
    void sj_aligner_failure(const sj_aligner *a, sj_barrier_failure *out)
