/* Barrier alignment over lock-free single-producer single-consumer rings (see
 * sparkjet/aligner.h for the semantics and the threading rules). */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sparkjet/aligner.h"

#define CACHE_LINE 64

/* A slot's tag: an item, the end marker, or a barrier (id << 1 | terminal). */
#define TAG_ITEM (-1)
#define TAG_END (-2)

typedef struct slot {
    int64_t tag;
    void *item;
} slot;

/* Written by the channel's producer on every push. */
typedef struct producer_side {
    atomic_llong tail; /* entries published */
    int64_t head_seen; /* the last head read: re-read only when the ring looks full */
    int32_t ended;     /* the end marker was pushed */
} producer_side;

/* Written by the consumer on every take. */
typedef struct consumer_side {
    atomic_llong head;  /* entries given back to the producer */
    int64_t next;       /* entries taken: ahead of head inside a drain, published after */
    int64_t tail_seen;  /* the last tail read: re-read only when the ring looks empty */
    int64_t arrived_ns; /* when this channel's barrier of the alignment was taken */
    uint8_t live, held, arrived;
} consumer_side;

/* Each part on its own cache line, so that a side's writes never invalidate what
 * the other side reads on its fast path. */
typedef struct channel {
    union {
        producer_side s;
        char pad[CACHE_LINE];
    } p;
    union {
        consumer_side s;
        char pad[CACHE_LINE];
    } c;
    union {
        atomic_llong wake_at; /* the producer sleeps on `space` until head reaches this
                                 (0: it does not sleep); rarely written */
        char pad[CACHE_LINE];
    } w;
    union {
        struct {
            slot *slots;
            pthread_cond_t space;
        } s;
        char pad[2 * CACHE_LINE];
    } r;
} channel;

struct sj_aligner {
    /* Read by every thread; written only when a side waits or the aligner closes. */
    int32_t channels;
    int32_t mode;
    int64_t capacity;
    int64_t mask;
    channel *chan;
    atomic_int state;            /* 0 open, 1 closed, 2 failed */
    atomic_int consumer_waiting; /* the consumer sleeps on `data` */
    pthread_mutex_t mu;          /* only around sleeping and waking */
    pthread_cond_t data;
    char pad[CACHE_LINE];

    /* The consumer's alone. */
    int32_t rr;    /* the channel being drained */
    int32_t taken; /* entries taken from it in a row */
    int32_t live_count;
    int32_t arrived_count; /* live channels that delivered the aligning barrier */
    int32_t aligning;
    int32_t align_terminal;
    int32_t align_blocking;
    int64_t align_id;
    int64_t align_started_ns;
    int64_t expected; /* -1: any id */
    int64_t completed;
    sj_alignment last;
    int64_t *last_held;
    sj_barrier_failure failure;
};

int64_t sj_aligner_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static struct timespec to_timespec(int64_t ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    return ts;
}

/* Sleeps on cond until signalled or the deadline; 1 if the deadline passed. */
static int sleep_on(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t deadline_ns) {
    if (deadline_ns < 0) {
        pthread_cond_wait(cond, mu);
        return 0;
    }
    struct timespec ts = to_timespec(deadline_ns);
    return pthread_cond_timedwait(cond, mu, &ts) == ETIMEDOUT;
}

static int init_cond(pthread_cond_t *cond) {
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr)) return -1;
    int rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) || pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return rc ? -1 : 0;
}

sj_status sj_aligner_new(int32_t channels, int32_t mode, int64_t capacity,
                               sj_aligner **out) {
    if (!out) return SJ_EINVAL;
    *out = NULL;
    if (channels < 1 || channels > SJ_ALIGNER_MAX_CHANNELS) return SJ_EINVAL;
    if (mode != SJ_EXACTLY_ONCE && mode != SJ_AT_LEAST_ONCE) return SJ_EINVAL;
    if (capacity < 1 || capacity > SJ_ALIGNER_MAX_CAPACITY) return SJ_EINVAL;
    int64_t ring = 1;
    while (ring < capacity) ring <<= 1;

    sj_aligner *a = NULL;
    if (posix_memalign((void **)&a, CACHE_LINE, sizeof *a)) return SJ_ENOMEM;
    memset(a, 0, sizeof *a);
    a->channels = channels;
    a->mode = mode;
    a->capacity = capacity;
    a->mask = ring - 1;
    a->live_count = channels;
    a->expected = -1;
    a->align_id = -1;
    atomic_init(&a->state, 0);
    atomic_init(&a->consumer_waiting, 0);
    if (pthread_mutex_init(&a->mu, NULL)) {
        free(a);
        return SJ_ENOMEM;
    }
    if (init_cond(&a->data)) {
        pthread_mutex_destroy(&a->mu);
        free(a);
        return SJ_ENOMEM;
    }
    a->last_held = calloc((size_t)channels, sizeof(int64_t));
    if (!a->last_held ||
        posix_memalign((void **)&a->chan, CACHE_LINE, (size_t)channels * sizeof(channel))) {
        a->chan = NULL;
        sj_aligner_free(a, NULL, NULL);
        return SJ_ENOMEM;
    }
    memset(a->chan, 0, (size_t)channels * sizeof(channel));
    for (int32_t i = 0; i < channels; i++) {
        channel *c = &a->chan[i];
        atomic_init(&c->p.s.tail, 0);
        atomic_init(&c->c.s.head, 0);
        atomic_init(&c->w.wake_at, 0);
        c->c.s.live = 1;
        c->r.s.slots = malloc((size_t)ring * sizeof(slot));
        if (!c->r.s.slots || init_cond(&c->r.s.space)) {
            free(c->r.s.slots);
            c->r.s.slots = NULL; /* marks the channels that need no cleanup */
            sj_aligner_free(a, NULL, NULL);
            return SJ_ENOMEM;
        }
    }
    *out = a;
    return SJ_OK;
}

void sj_aligner_free(sj_aligner *a, void (*release)(void *item, void *ctx), void *ctx) {
    if (!a) return;
    for (int32_t i = 0; a->chan && i < a->channels; i++) {
        channel *c = &a->chan[i];
        if (!c->r.s.slots) break; /* a failed sj_aligner_new: later channels are untouched */
        int64_t tail = atomic_load_explicit(&c->p.s.tail, memory_order_acquire);
        for (int64_t k = c->c.s.next; release && k < tail; k++) {
            slot s = c->r.s.slots[k & a->mask];
            if (s.tag == TAG_ITEM) release(s.item, ctx);
        }
        free(c->r.s.slots);
        pthread_cond_destroy(&c->r.s.space);
    }
    free(a->chan);
    free(a->last_held);
    pthread_cond_destroy(&a->data);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

int32_t sj_aligner_channels(const sj_aligner *a) { return a->channels; }
int32_t sj_aligner_mode(const sj_aligner *a) { return a->mode; }
int64_t sj_aligner_capacity(const sj_aligner *a) { return a->capacity; }

/* ---- producer side ------------------------------------------------------------- */

/* Wakes the consumer if it sleeps. The fence pairs with the one in sj_aligner_wait:
 * either the consumer sees the entry just published or this sees its flag. */
static void wake_consumer(sj_aligner *a) {
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&a->consumer_waiting, memory_order_relaxed)) {
        pthread_mutex_lock(&a->mu);
        pthread_cond_signal(&a->data);
        pthread_mutex_unlock(&a->mu);
    }
}

static sj_status check_push(const sj_aligner *a, int32_t ch) {
    if (!a || ch < 0 || ch >= a->channels) return SJ_EINVAL;
    if (atomic_load_explicit(&a->state, memory_order_acquire)) return SJ_ECLOSED;
    if (a->chan[ch].p.s.ended) return SJ_EENDED;
    return SJ_OK;
}

/* Free slots for the producer at `tail`, re-reading head only if fewer than `want`. */
static int64_t room(const sj_aligner *a, channel *c, int64_t tail, int64_t want) {
    int64_t free_slots = a->capacity - (tail - c->p.s.head_seen);
    if (free_slots < want) {
        c->p.s.head_seen = atomic_load_explicit(&c->c.s.head, memory_order_acquire);
        free_slots = a->capacity - (tail - c->p.s.head_seen);
    }
    return free_slots;
}

static sj_status push(sj_aligner *a, int32_t ch, int64_t tag, void *item) {
    sj_status st = check_push(a, ch);
    if (st != SJ_OK) return st;
    channel *c = &a->chan[ch];
    int64_t tail = atomic_load_explicit(&c->p.s.tail, memory_order_relaxed);
    if (room(a, c, tail, 1) < 1) return SJ_EAGAIN;
    slot *s = &c->r.s.slots[tail & a->mask];
    s->tag = tag;
    s->item = item;
    atomic_store_explicit(&c->p.s.tail, tail + 1, memory_order_release);
    if (tag == TAG_END) c->p.s.ended = 1;
    wake_consumer(a);
    return SJ_OK;
}

sj_status sj_aligner_offer(sj_aligner *a, int32_t channel, void *item) {
    return push(a, channel, TAG_ITEM, item);
}

sj_status sj_aligner_offer_many(sj_aligner *a, int32_t ch, void *const *items, int64_t n,
                                      int64_t *accepted) {
    if (accepted) *accepted = 0;
    if (!accepted || n < 0 || (n > 0 && !items)) return SJ_EINVAL;
    sj_status st = check_push(a, ch);
    if (st != SJ_OK || n == 0) return st;
    channel *c = &a->chan[ch];
    int64_t tail = atomic_load_explicit(&c->p.s.tail, memory_order_relaxed);
    int64_t k = room(a, c, tail, n);
    if (k > n) k = n;
    if (k <= 0) return SJ_OK;
    for (int64_t i = 0; i < k; i++) {
        slot *s = &c->r.s.slots[(tail + i) & a->mask];
        s->tag = TAG_ITEM;
        s->item = items[i];
    }
    atomic_store_explicit(&c->p.s.tail, tail + k, memory_order_release);
    *accepted = k;
    wake_consumer(a);
    return SJ_OK;
}

sj_status sj_aligner_offer_barrier(sj_aligner *a, int32_t channel, int64_t snapshot_id,
                                         int32_t terminal) {
    if (snapshot_id < 0 || snapshot_id > SJ_ALIGNER_MAX_SNAPSHOT_ID) return SJ_EINVAL;
    return push(a, channel, snapshot_id * 2 + (terminal != 0), NULL);
}

sj_status sj_aligner_offer_end(sj_aligner *a, int32_t channel) {
    return push(a, channel, TAG_END, NULL);
}

sj_status sj_aligner_wait_space(sj_aligner *a, int32_t ch, int64_t want,
                                      int64_t deadline_ns) {
    sj_status st = check_push(a, ch);
    if (st != SJ_OK) return st;
    channel *c = &a->chan[ch];
    if (want < 1) want = 1;
    if (want > a->capacity) want = a->capacity;
    /* Room for `want` entries once the consumer's head reaches wake_at (>= 1 whenever
     * there is not that much room now, since head >= 0). */
    int64_t wake_at = atomic_load_explicit(&c->p.s.tail, memory_order_relaxed) + want - a->capacity;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        if (atomic_load_explicit(&a->state, memory_order_acquire)) {
            st = SJ_ECLOSED;
            break;
        }
        atomic_store_explicit(&c->w.wake_at, wake_at > 0 ? wake_at : 1, memory_order_relaxed);
        /* Pairs with the fence in publish(): either this sees the consumer's new head
         * or the consumer sees wake_at (and signals under the mutex held here). */
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(&c->c.s.head, memory_order_acquire) >= wake_at) {
            st = SJ_OK;
            break;
        }
        if (sleep_on(&c->r.s.space, &a->mu, deadline_ns)) {
            int64_t head = atomic_load_explicit(&c->c.s.head, memory_order_acquire);
            st = head >= wake_at ? SJ_OK : SJ_ETIMEOUT;
            break;
        }
    }
    atomic_store_explicit(&c->w.wake_at, 0, memory_order_relaxed);
    pthread_mutex_unlock(&a->mu);
    return st;
}

/* ---- consumer side ------------------------------------------------------------- */

static int has_entry(channel *c) {
    consumer_side *k = &c->c.s;
    if (k->next < k->tail_seen) return 1;
    k->tail_seen = atomic_load_explicit(&c->p.s.tail, memory_order_acquire);
    return k->next < k->tail_seen;
}

/* Gives the slots taken from the channel back to its producer, waking it if it sleeps
 * and now has the room it waits for. */
static void publish(sj_aligner *a, channel *c) {
    consumer_side *k = &c->c.s;
    if (atomic_load_explicit(&k->head, memory_order_relaxed) == k->next) return;
    atomic_store_explicit(&k->head, k->next, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    int64_t wake_at = atomic_load_explicit(&c->w.wake_at, memory_order_relaxed);
    if (wake_at && k->next >= wake_at) {
        pthread_mutex_lock(&a->mu);
        pthread_cond_signal(&c->r.s.space);
        pthread_mutex_unlock(&a->mu);
    }
}

static void wake_all(sj_aligner *a) {
    pthread_cond_broadcast(&a->data);
    for (int32_t i = 0; i < a->channels; i++) pthread_cond_broadcast(&a->chan[i].r.s.space);
}

static int fail(sj_aligner *a, int32_t fault, int32_t ch, int64_t id, int32_t terminal,
                int64_t expected) {
    sj_barrier_failure f = {fault, ch, id, terminal, expected};
    a->failure = f;
    pthread_mutex_lock(&a->mu);
    atomic_store_explicit(&a->state, 2, memory_order_release);
    wake_all(a);
    pthread_mutex_unlock(&a->mu);
    return -1;
}

/* The alignment is complete: record it, release the held channels, emit SNAPSHOT. */
static int complete(sj_aligner *a, sj_event *ev) {
    int64_t now = sj_aligner_now_ns();
    a->last.snapshot_id = a->align_id;
    a->last.terminal = a->align_terminal;
    a->last.blocking = a->align_blocking;
    a->last.started_ns = a->align_started_ns;
    a->last.duration_ns = now - a->align_started_ns;
    for (int32_t i = 0; i < a->channels; i++) {
        consumer_side *k = &a->chan[i].c.s;
        a->last_held[i] = k->arrived ? now - k->arrived_ns : -1;
        k->arrived = 0;
        k->held = 0;
    }
    a->completed++;
    a->aligning = 0;
    a->expected = a->align_id + 1;
    ev->kind = SJ_EVENT_SNAPSHOT;
    ev->channel = -1;
    ev->snapshot_id = a->align_id;
    ev->terminal = a->align_terminal;
    ev->item = NULL;
    a->align_id = -1;
    return 1;
}

/* 1 if the barrier completed an alignment (*ev is SNAPSHOT), 0 if not, -1 on a fault. */
static int on_barrier(sj_aligner *a, int32_t ch, int64_t id, int32_t terminal, sj_event *ev) {
    consumer_side *k = &a->chan[ch].c.s;
    if (a->aligning) {
        if (k->arrived) return fail(a, SJ_FAULT_SECOND, ch, id, terminal, a->align_id);
        if (id != a->align_id) return fail(a, SJ_FAULT_OTHER_ID, ch, id, terminal, a->align_id);
        if (terminal != a->align_terminal)
            return fail(a, SJ_FAULT_TERMINAL, ch, id, terminal, a->align_id);
    } else {
        if (a->expected >= 0 && id != a->expected)
            return fail(a, SJ_FAULT_UNEXPECTED_ID, ch, id, terminal, a->expected);
        a->aligning = 1;
        a->align_id = id;
        a->align_terminal = terminal;
        a->align_blocking = a->mode == SJ_EXACTLY_ONCE || terminal;
        a->align_started_ns = sj_aligner_now_ns();
        a->arrived_count = 0;
    }
    k->arrived = 1;
    k->arrived_ns = a->arrived_count ? sj_aligner_now_ns() : a->align_started_ns;
    k->held = (uint8_t)a->align_blocking;
    a->arrived_count++;
    return a->arrived_count >= a->live_count ? complete(a, ev) : 0;
}

/* The channel ended: it no longer counts, which may complete the alignment. */
static int on_end(sj_aligner *a, int32_t ch, sj_event *ev) {
    consumer_side *k = &a->chan[ch].c.s;
    k->live = 0;
    a->live_count--;
    if (!a->aligning) return 0;
    if (k->arrived) a->arrived_count--;
    return a->arrived_count >= a->live_count ? complete(a, ev) : 0;
}

/* The channel of the next entry: round-robin, at most SJ_ALIGNER_BURST entries in a
 * row from one channel, skipping ended and held ones; -1 if none has an entry now. */
static int32_t next_channel(sj_aligner *a) {
    for (int32_t i = 0; i <= a->channels; i++) {
        channel *c = &a->chan[a->rr];
        if (c->c.s.live && !c->c.s.held && a->taken < SJ_ALIGNER_BURST && has_entry(c))
            return a->rr;
        publish(a, c);
        a->rr = a->rr + 1 == a->channels ? 0 : a->rr + 1;
        a->taken = 0;
    }
    return -1;
}

static void done_event(sj_event *ev) {
    ev->kind = SJ_EVENT_DONE;
    ev->channel = -1;
    ev->snapshot_id = -1;
    ev->terminal = 0;
    ev->item = NULL;
}

static int finished(const sj_aligner *a) { return a->live_count == 0 && !a->aligning; }

/* Takes entries until one makes an event. Publishes nothing: callers do. */
static sj_status step(sj_aligner *a, sj_event *ev) {
    if (finished(a)) {
        done_event(ev);
        return SJ_OK;
    }
    for (;;) {
        int32_t ch = next_channel(a);
        if (ch < 0) return SJ_EAGAIN;
        channel *c = &a->chan[ch];
        slot s = c->r.s.slots[c->c.s.next & a->mask];
        c->c.s.next++;
        a->taken++;
        if (s.tag == TAG_ITEM) {
            ev->kind = SJ_EVENT_ITEM;
            ev->channel = ch;
            ev->snapshot_id = -1;
            ev->terminal = 0;
            ev->item = s.item;
            return SJ_OK;
        }
        int r = s.tag == TAG_END ? on_end(a, ch, ev)
                                 : on_barrier(a, ch, s.tag >> 1, (int32_t)(s.tag & 1), ev);
        if (r < 0) return SJ_EBARRIER;
        if (r > 0) return SJ_OK;
        if (finished(a)) {
            done_event(ev);
            return SJ_OK;
        }
    }
}

static sj_status check_consumer(const sj_aligner *a) {
    if (!a) return SJ_EINVAL;
    switch (atomic_load_explicit(&a->state, memory_order_acquire)) {
    case 0: return SJ_OK;
    case 1: return SJ_ECLOSED;
    default: return SJ_EBARRIER;
    }
}

sj_status sj_aligner_poll(sj_aligner *a, sj_event *ev) {
    sj_status st = check_consumer(a);
    if (st != SJ_OK) return st;
    if (!ev) return SJ_EINVAL;
    st = step(a, ev);
    publish(a, &a->chan[a->rr]);
    return st;
}

sj_status sj_aligner_drain(sj_aligner *a, sj_event *evs, int64_t max, int64_t *count) {
    if (count) *count = 0;
    sj_status st = check_consumer(a);
    if (st != SJ_OK) return st;
    if (!count || max < 0 || (max > 0 && !evs)) return SJ_EINVAL;
    int64_t n = 0;
    while (n < max) {
        st = step(a, &evs[n]);
        if (st != SJ_OK) break;
        if (evs[n++].kind != SJ_EVENT_ITEM) break;
    }
    publish(a, &a->chan[a->rr]);
    *count = n;
    return st == SJ_EAGAIN ? SJ_OK : st;
}

/* poll would return something other than SJ_EAGAIN. */
static int ready(sj_aligner *a) {
    if (finished(a)) return 1;
    for (int32_t i = 0; i < a->channels; i++) {
        channel *c = &a->chan[i];
        if (c->c.s.live && !c->c.s.held && has_entry(c)) return 1;
    }
    return 0;
}

sj_status sj_aligner_wait(sj_aligner *a, int64_t deadline_ns) {
    if (!a) return SJ_EINVAL;
    sj_status st;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        int state = atomic_load_explicit(&a->state, memory_order_acquire);
        if (state) {
            st = state == 1 ? SJ_ECLOSED : SJ_OK; /* poll reports the fault */
            break;
        }
        atomic_store_explicit(&a->consumer_waiting, 1, memory_order_relaxed);
        atomic_thread_fence(memory_order_seq_cst); /* pairs with wake_consumer() */
        if (ready(a)) {
            st = SJ_OK;
            break;
        }
        if (sleep_on(&a->data, &a->mu, deadline_ns)) {
            st = ready(a) ? SJ_OK : SJ_ETIMEOUT;
            break;
        }
    }
    atomic_store_explicit(&a->consumer_waiting, 0, memory_order_relaxed);
    pthread_mutex_unlock(&a->mu);
    return st;
}

sj_status sj_aligner_expect(sj_aligner *a, int64_t snapshot_id) {
    if (!a || a->aligning || snapshot_id < 0 || snapshot_id > SJ_ALIGNER_MAX_SNAPSHOT_ID)
        return SJ_EINVAL;
    a->expected = snapshot_id;
    return SJ_OK;
}

int64_t sj_aligner_expected(const sj_aligner *a) { return a->expected; }
int64_t sj_aligner_aligning(const sj_aligner *a) { return a->aligning ? a->align_id : -1; }
int32_t sj_aligner_live(const sj_aligner *a) { return a->live_count; }
int64_t sj_aligner_alignments(const sj_aligner *a) { return a->completed; }

sj_status sj_aligner_last_alignment(const sj_aligner *a, sj_alignment *out,
                                          int64_t *held_ns) {
    if (!a || !out) return SJ_EINVAL;
    if (!a->completed) return SJ_EAGAIN;
    *out = a->last;
    if (held_ns) memcpy(held_ns, a->last_held, (size_t)a->channels * sizeof(int64_t));
    return SJ_OK;
}

/* ---- any thread ---------------------------------------------------------------- */

int64_t sj_aligner_queued(const sj_aligner *a, int32_t ch) {
    if (!a || ch < 0 || ch >= a->channels) return -1;
    const channel *c = &a->chan[ch];
    int64_t head = atomic_load_explicit(&c->c.s.head, memory_order_acquire);
    return atomic_load_explicit(&c->p.s.tail, memory_order_acquire) - head;
}

int64_t sj_aligner_size(const sj_aligner *a) {
    int64_t n = 0;
    for (int32_t i = 0; a && i < a->channels; i++) n += sj_aligner_queued(a, i);
    return n;
}

void sj_aligner_close(sj_aligner *a) {
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    int open = 0;
    atomic_compare_exchange_strong(&a->state, &open, 1);
    wake_all(a);
    pthread_mutex_unlock(&a->mu);
}

int32_t sj_aligner_state(const sj_aligner *a) {
    return atomic_load_explicit(&a->state, memory_order_acquire);
}

void sj_aligner_failure(const sj_aligner *a, sj_barrier_failure *out) {
    if (atomic_load_explicit(&a->state, memory_order_acquire) == 2) {
        *out = a->failure;
    } else {
        memset(out, 0, sizeof *out);
        out->channel = -1;
        out->snapshot_id = -1;
        out->expected = -1;
    }
}
