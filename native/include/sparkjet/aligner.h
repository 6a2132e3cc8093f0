/* Barrier alignment (Hazelcast Jet's, HAZELCAST.md §3) over bounded per-channel queues.
 *
 * An aligner has `channels` input channels, each a bounded queue of entries:
 * items (opaque pointers the aligner never dereferences), barriers carrying a
 * snapshot id (and a terminal flag), and one end-of-stream marker. One
 * consumer takes events out of it, in order:
 *
 *   SJ_EVENT_ITEM      an item, with the channel it came from;
 *   SJ_EVENT_SNAPSHOT  every live channel has delivered barrier n;
 *   SJ_EVENT_DONE      every channel has ended and everything was taken
 *                      (again on every later poll).
 *
 * ALIGNMENT. Exactly-once: once the consumer has taken barrier n from a
 * channel, that channel is held (not drained) until every live channel has
 * delivered n; then one SNAPSHOT n event comes out and the held channels
 * resume. At-least-once: channels are not held, and SNAPSHOT n comes out when
 * the last live channel delivers n. A terminal barrier holds its channel in
 * both modes. A channel that has ended stops counting, which may complete the
 * alignment in progress. Barrier ids: the first may be any id >= 0; after
 * SNAPSHOT n the next must be n + 1 (or whatever sj_aligner_expect set). A
 * barrier with another id, a second barrier from a channel during one
 * alignment, or a terminal flag that differs between channels is a fault: the
 * consumer call that takes it returns SJ_EBARRIER, the aligner fails for
 * good (consumer calls keep returning SJ_EBARRIER, producer calls
 * SJ_ECLOSED) and sj_aligner_failure describes it.
 *
 * ORDER. The consumer visits the channels round-robin, taking up to
 * SJ_ALIGNER_BURST consecutive entries from one channel before moving to the
 * next: deterministic for a given interleaving, so a reference implementation
 * can reproduce the exact event sequence.
 *
 * THREADS. One producer thread per channel (offer, wait_space on that channel)
 * and one consumer thread (poll, drain, wait, expect, last_alignment) may run
 * concurrently, without a lock on the fast path: each channel is a lock-free
 * single-producer single-consumer ring (C11 acquire/release atomics; each side
 * caches the other's index and re-reads it only when the ring looks full or
 * empty; the bulk calls publish their index once per batch). Only a side that
 * has to wait takes the mutex and sleeps on a condition variable, after
 * raising a "waiting" flag that the other side checks (one fence, no syscall)
 * when it publishes. sj_aligner_close, sj_aligner_size, sj_aligner_queued and
 * the configuration getters may be called from any thread. Two threads on the
 * same side of one channel are undefined behaviour.
 *
 * Functions return sparkjet/status.h's codes, which include a queue's outcomes
 * (SJ_EAGAIN: full or empty, SJ_ETIMEOUT, SJ_ECLOSED) and an alignment fault
 * (SJ_EBARRIER, SJ_EENDED), so the bindings map every code in one place. */
#ifndef SPARKJET_ALIGNER_H
#define SPARKJET_ALIGNER_H

#include <stdint.h>

#include "sparkjet/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SJ_ALIGNER_MAX_CHANNELS 65536
#define SJ_ALIGNER_MAX_CAPACITY ((int64_t)1 << 30)
#define SJ_ALIGNER_MAX_SNAPSHOT_ID (((int64_t)1 << 62) - 1)
#define SJ_ALIGNER_BURST 64        /* entries taken from one channel before the next */
#define SJ_ALIGNER_NO_DEADLINE (-1) /* a wait without a deadline */

typedef enum sj_align_mode {
    SJ_EXACTLY_ONCE = 0,
    SJ_AT_LEAST_ONCE = 1
} sj_align_mode;

typedef enum sj_event_kind {
    SJ_EVENT_ITEM = 1,
    SJ_EVENT_SNAPSHOT = 2,
    SJ_EVENT_DONE = 3
} sj_event_kind;

typedef struct sj_event {
    int32_t kind;        /* an sj_event_kind */
    int32_t channel;     /* ITEM: the channel it came from; otherwise -1 */
    int64_t snapshot_id; /* SNAPSHOT: the snapshot aligned; otherwise -1 */
    int32_t terminal;    /* SNAPSHOT: 1 if its barriers were terminal */
    void *item;          /* ITEM: the pointer that was pushed; otherwise NULL */
} sj_event;

typedef enum sj_barrier_fault {
    SJ_FAULT_NONE = 0,
    SJ_FAULT_UNEXPECTED_ID = 1, /* no alignment in progress; the id is not the expected one */
    SJ_FAULT_OTHER_ID = 2,      /* snapshot `expected` is aligning; this barrier has another id */
    SJ_FAULT_SECOND = 3,        /* the channel already delivered barrier `expected` (at-least-once) */
    SJ_FAULT_TERMINAL = 4       /* the terminal flag differs from the other channels' barriers */
} sj_barrier_fault;

typedef struct sj_barrier_failure {
    int32_t fault;       /* an sj_barrier_fault */
    int32_t channel;     /* the channel the barrier came from */
    int64_t snapshot_id; /* the barrier's id */
    int32_t terminal;    /* the barrier's terminal flag */
    int64_t expected;    /* the id expected or aligning; -1 if any id was expected */
} sj_barrier_failure;

/* One completed alignment. Times are CLOCK_MONOTONIC nanoseconds. */
typedef struct sj_alignment {
    int64_t snapshot_id;
    int32_t terminal;
    int32_t blocking;    /* 1 if the channels were held (exactly-once or terminal) */
    int64_t started_ns;  /* when the consumer took the first barrier */
    int64_t duration_ns; /* from then until the last one */
} sj_alignment;

typedef struct sj_aligner sj_aligner;

/* CLOCK_MONOTONIC in nanoseconds: the clock of every deadline and alignment time. */
int64_t sj_aligner_now_ns(void);

/* A new aligner: 1 <= channels <= SJ_ALIGNER_MAX_CHANNELS, mode an sj_align_mode,
 * 1 <= capacity <= SJ_ALIGNER_MAX_CAPACITY entries per channel (items, barriers
 * and the end marker all count). SJ_EINVAL or SJ_ENOMEM otherwise. */
sj_status sj_aligner_new(int32_t channels, int32_t mode, int64_t capacity,
                               sj_aligner **out);

/* Frees the aligner, first calling release(item, ctx) for every item still queued
 * (release may be NULL). No other thread may be using it. NULL is a no-op. */
void sj_aligner_free(sj_aligner *a, void (*release)(void *item, void *ctx), void *ctx);

int32_t sj_aligner_channels(const sj_aligner *a);
int32_t sj_aligner_mode(const sj_aligner *a);
int64_t sj_aligner_capacity(const sj_aligner *a);

/* ---- producer side: one thread per channel ------------------------------------ */

/* Pushes one item: SJ_OK, or SJ_EAGAIN if the channel is full. */
sj_status sj_aligner_offer(sj_aligner *a, int32_t channel, void *item);

/* Pushes the longest prefix of items[0 .. n) that fits; *accepted says how long. */
sj_status sj_aligner_offer_many(sj_aligner *a, int32_t channel, void *const *items,
                                      int64_t n, int64_t *accepted);

/* Pushes barrier `snapshot_id` (0 ..= SJ_ALIGNER_MAX_SNAPSHOT_ID). Its id is checked
 * when the consumer takes it. */
sj_status sj_aligner_offer_barrier(sj_aligner *a, int32_t channel, int64_t snapshot_id,
                                         int32_t terminal);

/* Pushes the end-of-stream marker; afterwards every push to the channel returns
 * SJ_EENDED. */
sj_status sj_aligner_offer_end(sj_aligner *a, int32_t channel);

/* Blocks until the channel has room for `want` entries (clamped to 1 ..= capacity):
 * SJ_OK; until the deadline passes (SJ_ETIMEOUT; deadline_ns from
 * sj_aligner_now_ns, or SJ_ALIGNER_NO_DEADLINE); or until the aligner is closed
 * (SJ_ECLOSED). Waiting for more than one entry (say half the capacity) wakes
 * the producer less often; the consumer always frees that much unless the channel
 * is held by an alignment, which the producer could not get past anyway. */
sj_status sj_aligner_wait_space(sj_aligner *a, int32_t channel, int64_t want,
                                      int64_t deadline_ns);

/* ---- consumer side: one thread -------------------------------------------------- */

/* The next event, without blocking: SJ_OK with *ev filled, SJ_EAGAIN if
 * nothing can be taken now, SJ_EBARRIER, or SJ_ECLOSED. */
sj_status sj_aligner_poll(sj_aligner *a, sj_event *ev);

/* Up to max events that are available now, in order, into evs; *count says how many.
 * Stops after a SNAPSHOT event (so that sj_aligner_last_alignment describes it) and
 * after DONE. On SJ_EBARRIER the *count events before the fault are valid. */
sj_status sj_aligner_drain(sj_aligner *a, sj_event *evs, int64_t max, int64_t *count);

/* Blocks until poll has something to return (SJ_OK: an event, DONE or a
 * fault), the deadline passes (SJ_ETIMEOUT) or the aligner is closed. */
sj_status sj_aligner_wait(sj_aligner *a, int64_t deadline_ns);

/* The id the next barrier must carry (after a restart from snapshot k - 1: k).
 * SJ_EINVAL while an alignment is in progress or if the id is out of range. */
sj_status sj_aligner_expect(sj_aligner *a, int64_t snapshot_id);

/* The id the next alignment must have, or -1 if any id will do. */
int64_t sj_aligner_expected(const sj_aligner *a);

/* The snapshot being aligned, or -1. */
int64_t sj_aligner_aligning(const sj_aligner *a);

/* Channels that have not ended (as the consumer has seen). */
int32_t sj_aligner_live(const sj_aligner *a);

/* How many alignments completed; the last one's record, and per channel the
 * nanoseconds from its barrier being taken to completion (-1 if the channel did
 * not deliver that barrier) into held_ns[0 .. channels) unless NULL.
 * SJ_EAGAIN if none completed yet. */
int64_t sj_aligner_alignments(const sj_aligner *a);
sj_status sj_aligner_last_alignment(const sj_aligner *a, sj_alignment *out,
                                          int64_t *held_ns);

/* ---- any thread ------------------------------------------------------------------ */

/* Entries queued and not yet taken: on one channel, or on all of them. A snapshot
 * when other threads are running. sj_aligner_queued returns -1 for a bad channel. */
int64_t sj_aligner_queued(const sj_aligner *a, int32_t channel);
int64_t sj_aligner_size(const sj_aligner *a);

/* Closes the aligner: later pushes and polls return SJ_ECLOSED and every
 * blocked wait wakes up. Queued items stay until sj_aligner_free. Idempotent. */
void sj_aligner_close(sj_aligner *a);

/* 0 open, 1 closed, 2 failed (a barrier fault). */
int32_t sj_aligner_state(const sj_aligner *a);

/* The fault that failed the aligner (fault SJ_FAULT_NONE if none). Safe from a
 * producer thread once it has seen SJ_ECLOSED. */
void sj_aligner_failure(const sj_aligner *a, sj_barrier_failure *out);

#ifdef __cplusplus
}
#endif
#endif
