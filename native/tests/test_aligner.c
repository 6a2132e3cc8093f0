/* Native tests of the barrier aligner, runnable without Python: `make -C native test`.
 * Ring wraparound and backpressure, the alignment state machine in both modes (held
 * channels, ended channels, terminal barriers, faults), waits with deadlines and
 * close, release of queued items, and real producer threads against one consumer. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparkjet/aligner.h"

#include "check.h"

/* Items are small integers disguised as pointers: (channel << 32 | sequence) + 1. */
static void *item(int32_t ch, int64_t seq) { return (void *)(uintptr_t)(((uint64_t)ch << 32 | (uint64_t)seq) + 1); }
static int32_t item_channel(void *p) { return (int32_t)(((uintptr_t)p - 1) >> 32); }
static int64_t item_seq(void *p) { return (int64_t)(((uintptr_t)p - 1) & 0xffffffffu); }

static sj_aligner *make(int32_t channels, int32_t mode, int64_t capacity) {
    sj_aligner *a = NULL;
    sj_status st = sj_aligner_new(channels, mode, capacity, &a);
    CHECK(st == SJ_OK && a, "sj_aligner_new(%d, %d, %ld): %s", channels, mode,
          (long)capacity, sj_status_message(st));
    return a;
}

/* A compact trace of events: "c:s" for an item, "Sn" / "Tn" for a (terminal)
 * snapshot, "D" for done, "-" when nothing is available, "!" on a fault. */
static void trace_poll(sj_aligner *a, char *buf, size_t cap, int max_events) {
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < max_events; i++) {
        sj_event ev;
        sj_status st = sj_aligner_poll(a, &ev);
        char part[48];
        if (st == SJ_EAGAIN) snprintf(part, sizeof part, "-");
        else if (st != SJ_OK) snprintf(part, sizeof part, "!");
        else if (ev.kind == SJ_EVENT_ITEM)
            snprintf(part, sizeof part, "%d:%ld", (int)item_channel(ev.item), (long)item_seq(ev.item));
        else if (ev.kind == SJ_EVENT_SNAPSHOT)
            snprintf(part, sizeof part, "%c%ld", ev.terminal ? 'T' : 'S', (long)ev.snapshot_id);
        else snprintf(part, sizeof part, "D");
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", i ? " " : "", part);
        if (st != SJ_OK || ev.kind == SJ_EVENT_DONE) break;
    }
}

static void test_arguments(void) {
    sj_aligner *a = NULL;
    CHECK(sj_aligner_new(0, SJ_EXACTLY_ONCE, 4, &a) == SJ_EINVAL && !a, "0 channels");
    CHECK(sj_aligner_new(-3, SJ_EXACTLY_ONCE, 4, &a) == SJ_EINVAL, "negative channels");
    CHECK(sj_aligner_new(SJ_ALIGNER_MAX_CHANNELS + 1, SJ_EXACTLY_ONCE, 4, &a) == SJ_EINVAL,
          "too many channels");
    CHECK(sj_aligner_new(2, 7, 4, &a) == SJ_EINVAL, "bad mode");
    CHECK(sj_aligner_new(2, SJ_EXACTLY_ONCE, 0, &a) == SJ_EINVAL, "capacity 0");
    CHECK(sj_aligner_new(2, SJ_EXACTLY_ONCE, -1, &a) == SJ_EINVAL, "negative capacity");
    CHECK(sj_aligner_new(2, SJ_EXACTLY_ONCE, SJ_ALIGNER_MAX_CAPACITY + 1, &a) == SJ_EINVAL,
          "capacity too large");
    CHECK(sj_aligner_new(2, SJ_EXACTLY_ONCE, 4, NULL) == SJ_EINVAL, "NULL out");

    a = make(2, SJ_EXACTLY_ONCE, 4);
    CHECK(sj_aligner_channels(a) == 2 && sj_aligner_capacity(a) == 4 &&
          sj_aligner_mode(a) == SJ_EXACTLY_ONCE, "getters");
    CHECK(sj_aligner_offer(a, -1, item(0, 0)) == SJ_EINVAL, "channel -1");
    CHECK(sj_aligner_offer(a, 2, item(0, 0)) == SJ_EINVAL, "channel 2 of 2");
    CHECK(sj_aligner_offer_barrier(a, 0, -1, 0) == SJ_EINVAL, "negative snapshot id");
    CHECK(sj_aligner_offer_barrier(a, 0, SJ_ALIGNER_MAX_SNAPSHOT_ID + 1, 0) == SJ_EINVAL,
          "snapshot id too large");
    CHECK(sj_aligner_wait_space(a, 5, 1, SJ_ALIGNER_NO_DEADLINE) == SJ_EINVAL, "wait bad channel");
    CHECK(sj_aligner_queued(a, 9) == -1, "queued bad channel");
    int64_t accepted = 7;
    CHECK(sj_aligner_offer_many(a, 0, NULL, -1, &accepted) == SJ_EINVAL && accepted == 0,
          "offer_many negative n");
    CHECK(sj_aligner_expect(a, -2) == SJ_EINVAL, "expect -2");
    sj_event evs[2];
    int64_t count = 9;
    CHECK(sj_aligner_drain(a, evs, -1, &count) == SJ_EINVAL && count == 0, "drain -1");
    CHECK(sj_aligner_offer_end(a, 1) == SJ_OK, "end");
    CHECK(sj_aligner_offer(a, 1, item(1, 0)) == SJ_EENDED, "push after end");
    CHECK(sj_aligner_offer_end(a, 1) == SJ_EENDED, "second end");
    CHECK(sj_aligner_wait_space(a, 1, 1, 0) == SJ_EENDED, "wait after end");
    sj_aligner_free(a, NULL, NULL);
    sj_aligner_free(NULL, NULL, NULL);
}

/* Capacity 3 in a ring of 4 slots: indices wrap many times, the fourth push is
 * refused, and every item comes out once and in order. */
static void test_ring_wraparound(void) {
    sj_aligner *a = make(1, SJ_EXACTLY_ONCE, 3);
    int64_t pushed = 0, popped = 0;
    for (int round = 0; round < 2000; round++) {
        int want = 1 + round % 4;
        for (int i = 0; i < want; i++) {
            int64_t queued = sj_aligner_queued(a, 0);
            sj_status st = sj_aligner_offer(a, 0, item(0, pushed));
            if (queued < 3) {
                CHECK(st == SJ_OK, "push %ld refused", (long)pushed);
                pushed++;
            } else {
                CHECK(st == SJ_EAGAIN, "full ring: %s", sj_status_message(st));
            }
        }
        CHECK(sj_aligner_queued(a, 0) == pushed - popped && pushed - popped <= 3, "over capacity");
        int take = 1 + (round * 7) % 3;
        for (int i = 0; i < take; i++) {
            sj_event ev;
            sj_status st = sj_aligner_poll(a, &ev);
            if (popped == pushed) {
                CHECK(st == SJ_EAGAIN, "empty ring polled %s", sj_status_message(st));
                break;
            }
            CHECK(st == SJ_OK && ev.kind == SJ_EVENT_ITEM && ev.channel == 0 &&
                  item_seq(ev.item) == popped, "item %ld out of order", (long)popped);
            popped++;
        }
    }
    CHECK(pushed > 3000, "too few pushes: %ld", (long)pushed);

    /* offer_many: the prefix that fits, then nothing until the consumer takes. */
    void *batch[10];
    for (int i = 0; i < 10; i++) batch[i] = item(0, pushed + i);
    sj_event evs[16];
    int64_t count = 0, accepted = 0;
    CHECK(sj_aligner_drain(a, evs, 16, &count) == SJ_OK, "drain rest");
    popped += count;
    CHECK(popped == pushed, "drained %ld of %ld", (long)popped, (long)pushed);
    CHECK(sj_aligner_offer_many(a, 0, batch, 10, &accepted) == SJ_OK && accepted == 3,
          "offer_many accepted %ld", (long)accepted);
    CHECK(sj_aligner_offer_many(a, 0, batch + 3, 7, &accepted) == SJ_OK && accepted == 0,
          "offer_many on a full ring accepted %ld", (long)accepted);
    CHECK(sj_aligner_drain(a, evs, 2, &count) == SJ_OK && count == 2, "drain 2");
    CHECK(sj_aligner_offer_many(a, 0, batch + 3, 7, &accepted) == SJ_OK && accepted == 2,
          "offer_many after drain accepted %ld", (long)accepted);
    CHECK(sj_aligner_drain(a, evs, 16, &count) == SJ_OK && count == 3, "drain 3");
    for (int i = 0; i < 3; i++) CHECK(evs[i].item == batch[2 + i], "bulk order %d", i);
    sj_aligner_free(a, NULL, NULL);
}

static void test_exactly_once(void) {
    char t[512];
    sj_aligner *a = make(3, SJ_EXACTLY_ONCE, 16);
    /* ch0: 0 1 B7 2   ch1: 0 B7 1   ch2: 0 1 2 B7 3 */
    sj_aligner_offer(a, 0, item(0, 0));
    sj_aligner_offer(a, 0, item(0, 1));
    sj_aligner_offer_barrier(a, 0, 7, 0);
    sj_aligner_offer(a, 0, item(0, 2));
    sj_aligner_offer(a, 1, item(1, 0));
    sj_aligner_offer_barrier(a, 1, 7, 0);
    sj_aligner_offer(a, 1, item(1, 1));
    for (int i = 0; i < 3; i++) sj_aligner_offer(a, 2, item(2, i));
    /* Round-robin with bursts: channel 0 until its barrier holds it, then 1, then 2;
     * channel 2 has not delivered B7 yet. */
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "0:0 0:1 1:0 2:0 2:1 2:2 -") == 0, "exactly-once before B7: %s", t);
    CHECK(sj_aligner_aligning(a) == 7 && sj_aligner_expected(a) == -1, "aligning 7");
    CHECK(sj_aligner_expect(a, 8) == SJ_EINVAL, "expect while aligning");
    sj_aligner_offer_barrier(a, 2, 7, 0);
    sj_aligner_offer(a, 2, item(2, 3));
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "S7 2:3 0:2 1:1 -") == 0, "exactly-once after B7: %s", t);
    sj_alignment rec;
    int64_t held[3];
    CHECK(sj_aligner_alignments(a) == 1 && sj_aligner_last_alignment(a, &rec, held) == SJ_OK,
          "one alignment");
    CHECK(rec.snapshot_id == 7 && !rec.terminal && rec.blocking && rec.duration_ns >= 0 &&
          rec.started_ns > 0, "alignment record");
    CHECK(held[0] >= held[1] && held[1] >= held[2] && held[2] >= 0 && held[0] <= rec.duration_ns,
          "held times %ld %ld %ld", (long)held[0], (long)held[1], (long)held[2]);
    CHECK(sj_aligner_expected(a) == 8 && sj_aligner_aligning(a) == -1, "expect 8 next");

    /* Ends: channel 1 ends while 0 and 2 align B8; the end completes nothing until 2
     * delivers; then everything ends and DONE repeats. */
    sj_aligner_offer_barrier(a, 0, 8, 0);
    sj_aligner_offer_end(a, 1);
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "-") == 0, "waiting for channel 2: %s", t);
    CHECK(sj_aligner_live(a) == 2, "live %d", sj_aligner_live(a));
    sj_aligner_offer_barrier(a, 2, 8, 0);
    sj_aligner_offer_end(a, 2);
    sj_aligner_offer(a, 0, item(0, 3));
    sj_aligner_offer_end(a, 0);
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "S8 0:3 D") == 0, "end of stream: %s", t);
    CHECK(sj_aligner_last_alignment(a, &rec, held) == SJ_OK && held[1] == -1 && held[0] >= 0,
          "channel 1 did not deliver B8");
    trace_poll(a, t, sizeof t, 3);
    CHECK(strcmp(t, "D") == 0, "done again: %s", t);
    sj_event evs[4];
    int64_t count = 0;
    CHECK(sj_aligner_drain(a, evs, 4, &count) == SJ_OK && count == 1 &&
          evs[0].kind == SJ_EVENT_DONE, "drain after done");
    sj_aligner_free(a, NULL, NULL);

    /* A channel that ends without delivering the barrier completes the alignment. */
    a = make(2, SJ_EXACTLY_ONCE, 8);
    sj_aligner_offer_barrier(a, 0, 0, 0);
    sj_aligner_offer(a, 0, item(0, 0));
    sj_aligner_offer(a, 1, item(1, 0));
    sj_aligner_offer_end(a, 1);
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "1:0 S0 0:0 -") == 0, "end completes: %s", t);
    sj_aligner_free(a, NULL, NULL);
}

static void test_at_least_once(void) {
    char t[512];
    sj_aligner *a = make(2, SJ_AT_LEAST_ONCE, 16);
    sj_aligner_offer(a, 0, item(0, 0));
    sj_aligner_offer_barrier(a, 0, 3, 0);
    sj_aligner_offer(a, 0, item(0, 1));
    sj_aligner_offer(a, 1, item(1, 0));
    sj_aligner_offer_barrier(a, 1, 3, 0);
    sj_aligner_offer(a, 1, item(1, 1));
    /* Channel 0 keeps flowing past its barrier; S3 comes when channel 1's arrives. */
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "0:0 0:1 1:0 S3 1:1 -") == 0, "at-least-once: %s", t);
    sj_alignment rec;
    sj_aligner_last_alignment(a, &rec, NULL);
    CHECK(!rec.blocking, "at-least-once alignment does not block");

    /* A terminal barrier holds channels even here. */
    sj_aligner_offer_barrier(a, 0, 4, 1);
    sj_aligner_offer(a, 0, item(0, 2));
    sj_aligner_offer(a, 1, item(1, 2));
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "1:2 -") == 0, "terminal holds: %s", t);
    sj_aligner_offer_barrier(a, 1, 4, 1);
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "T4 0:2 -") == 0, "terminal aligned: %s", t);
    sj_aligner_last_alignment(a, &rec, NULL);
    CHECK(rec.blocking && rec.terminal && rec.snapshot_id == 4, "terminal record");

    /* A channel that delivered the barrier and then ended still completes it. */
    sj_aligner_offer_barrier(a, 0, 5, 0);
    sj_aligner_offer_end(a, 0);
    sj_aligner_offer_barrier(a, 1, 5, 0);
    sj_aligner_offer_end(a, 1);
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "S5 D") == 0, "ends after barriers: %s", t);
    sj_aligner_free(a, NULL, NULL);

    /* A channel that delivered B0 and ended no longer counts, but a live one that has
     * not delivered it still does. */
    a = make(2, SJ_AT_LEAST_ONCE, 16);
    sj_aligner_offer_barrier(a, 0, 0, 0);
    sj_aligner_offer_end(a, 0);
    sj_aligner_offer(a, 1, item(1, 0));
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "1:0 -") == 0, "channel 1 still owes B0: %s", t);
    sj_aligner_offer_barrier(a, 1, 0, 0);
    trace_poll(a, t, sizeof t, 20);
    CHECK(strcmp(t, "S0 -") == 0, "channel 1 delivered B0: %s", t);
    sj_aligner_free(a, NULL, NULL);
}

static void expect_fault(int32_t mode, const char *what, int32_t fault, int32_t ch, int64_t id,
                         int64_t expected, void (*feed)(sj_aligner *)) {
    sj_aligner *a = make(2, mode, 16);
    feed(a);
    sj_event ev;
    sj_status st;
    int guard = 0;
    while ((st = sj_aligner_poll(a, &ev)) == SJ_OK && guard++ < 100) {}
    CHECK(st == SJ_EBARRIER, "%s: poll gave %s", what, sj_status_message(st));
    sj_barrier_failure f;
    sj_aligner_failure(a, &f);
    CHECK(f.fault == fault && f.channel == ch && f.snapshot_id == id && f.expected == expected,
          "%s: fault %d channel %d id %ld expected %ld", what, f.fault, f.channel,
          (long)f.snapshot_id, (long)f.expected);
    CHECK(sj_aligner_poll(a, &ev) == SJ_EBARRIER, "%s: sticky", what);
    CHECK(sj_aligner_state(a) == 2, "%s: failed state", what);
    CHECK(sj_aligner_offer(a, 0, item(0, 9)) == SJ_ECLOSED, "%s: producer sees failure", what);
    CHECK(sj_aligner_wait_space(a, 1, 1, SJ_ALIGNER_NO_DEADLINE) == SJ_ECLOSED, "%s: wait", what);
    sj_aligner_free(a, NULL, NULL);
}

static void feed_unexpected(sj_aligner *a) {
    sj_aligner_expect(a, 5);
    sj_aligner_offer_barrier(a, 1, 3, 0);
}
static void feed_other(sj_aligner *a) {
    sj_aligner_offer_barrier(a, 0, 2, 0);
    sj_aligner_offer_barrier(a, 1, 4, 0);
}
static void feed_second(sj_aligner *a) {
    sj_aligner_offer_barrier(a, 0, 2, 0);
    sj_aligner_offer_barrier(a, 0, 3, 0);
}
static void feed_terminal(sj_aligner *a) {
    sj_aligner_offer_barrier(a, 0, 2, 1);
    sj_aligner_offer_barrier(a, 1, 2, 0);
}
static void feed_skip(sj_aligner *a) {
    sj_aligner_offer_barrier(a, 0, 2, 0);
    sj_aligner_offer_barrier(a, 1, 2, 0);
    sj_aligner_offer_barrier(a, 0, 4, 0);
}

static void test_faults(void) {
    expect_fault(SJ_EXACTLY_ONCE, "unexpected", SJ_FAULT_UNEXPECTED_ID, 1, 3, 5, feed_unexpected);
    expect_fault(SJ_EXACTLY_ONCE, "other id", SJ_FAULT_OTHER_ID, 1, 4, 2, feed_other);
    expect_fault(SJ_AT_LEAST_ONCE, "second", SJ_FAULT_SECOND, 0, 3, 2, feed_second);
    expect_fault(SJ_AT_LEAST_ONCE, "terminal", SJ_FAULT_TERMINAL, 1, 2, 2, feed_terminal);
    expect_fault(SJ_EXACTLY_ONCE, "skipped id", SJ_FAULT_UNEXPECTED_ID, 0, 4, 3, feed_skip);

    /* drain returns the events before a fault, then reports it. */
    sj_aligner *a = make(1, SJ_EXACTLY_ONCE, 8);
    sj_aligner_offer(a, 0, item(0, 0));
    sj_aligner_offer_barrier(a, 0, 1, 0);
    sj_aligner_offer(a, 0, item(0, 1));
    sj_aligner_offer_barrier(a, 0, 5, 0);
    sj_event evs[8];
    int64_t count = 0;
    CHECK(sj_aligner_drain(a, evs, 8, &count) == SJ_OK && count == 2 &&
          evs[1].kind == SJ_EVENT_SNAPSHOT, "drain stops after a snapshot");
    CHECK(sj_aligner_drain(a, evs, 8, &count) == SJ_EBARRIER && count == 1 &&
          evs[0].kind == SJ_EVENT_ITEM, "drain before a fault: %ld", (long)count);
    sj_aligner_free(a, NULL, NULL);
}

static void count_release(void *p, void *ctx) {
    (void)p;
    (*(int *)ctx)++;
}

static void test_release(void) {
    sj_aligner *a = make(2, SJ_EXACTLY_ONCE, 8);
    for (int i = 0; i < 5; i++) sj_aligner_offer(a, 0, item(0, i));
    sj_aligner_offer_barrier(a, 0, 0, 0);
    sj_aligner_offer(a, 0, item(0, 5));
    sj_aligner_offer(a, 1, item(1, 0));
    sj_aligner_offer_end(a, 1);
    sj_event ev;
    sj_aligner_poll(a, &ev);
    sj_aligner_poll(a, &ev);
    int released = 0;
    sj_aligner_free(a, count_release, &released);
    CHECK(released == 5, "released %d items, not the 5 left queued", released);
}

static int64_t after_ms(int ms) { return sj_aligner_now_ns() + (int64_t)ms * 1000000; }

typedef struct taker_arg {
    sj_aligner *a;
    int n;
} taker_arg;

/* Takes n entries, one every millisecond. */
static void *take_slowly(void *p) {
    taker_arg *arg = p;
    for (int i = 0; i < arg->n; i++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        sj_event ev;
        while (sj_aligner_poll(arg->a, &ev) != SJ_OK) nanosleep(&ts, NULL);
    }
    return NULL;
}

static void *close_later(void *p) {
    struct timespec ts = {0, 20 * 1000000};
    nanosleep(&ts, NULL);
    sj_aligner_close((sj_aligner *)p);
    return NULL;
}

static void test_waits(void) {
    sj_aligner *a = make(2, SJ_EXACTLY_ONCE, 2);
    int64_t t0 = sj_aligner_now_ns();
    CHECK(sj_aligner_wait(a, after_ms(10)) == SJ_ETIMEOUT, "wait on nothing times out");
    CHECK(sj_aligner_now_ns() - t0 >= 9000000, "waited the deadline");
    CHECK(sj_aligner_wait_space(a, 0, 1, after_ms(10)) == SJ_OK, "room");
    sj_aligner_offer(a, 0, item(0, 0));
    sj_aligner_offer(a, 0, item(0, 1));
    CHECK(sj_aligner_wait_space(a, 0, 1, after_ms(10)) == SJ_ETIMEOUT, "full times out");
    CHECK(sj_aligner_wait_space(a, 0, 1, 0) == SJ_ETIMEOUT, "past deadline");
    CHECK(sj_aligner_wait(a, SJ_ALIGNER_NO_DEADLINE) == SJ_OK, "data ready");
    /* A held channel's entries do not wake the consumer. */
    sj_aligner_offer_barrier(a, 1, 0, 0);
    sj_aligner_offer(a, 1, item(1, 0));
    sj_event evs[4];
    int64_t count;
    sj_aligner_drain(a, evs, 4, &count);
    CHECK(count == 2, "drained %ld", (long)count);
    CHECK(sj_aligner_wait(a, after_ms(5)) == SJ_ETIMEOUT, "held channel is not ready");

    /* close wakes a consumer without a deadline, and refuses everything after. */
    pthread_t th;
    pthread_create(&th, NULL, close_later, a);
    CHECK(sj_aligner_wait(a, SJ_ALIGNER_NO_DEADLINE) == SJ_ECLOSED, "close wakes the consumer");
    pthread_join(th, NULL);
    CHECK(sj_aligner_poll(a, &evs[0]) == SJ_ECLOSED, "poll after close");
    CHECK(sj_aligner_offer(a, 0, item(0, 2)) == SJ_ECLOSED, "offer after close");
    sj_aligner_close(a);
    CHECK(sj_aligner_state(a) == 1, "closed");
    int released = 0;
    sj_aligner_free(a, count_release, &released);
    CHECK(released == 1, "released %d", released);

    /* A producer waiting for room for 6 wakes only once 6 entries were taken. */
    a = make(1, SJ_EXACTLY_ONCE, 8);
    for (int i = 0; i < 8; i++) sj_aligner_offer(a, 0, item(0, i));
    taker_arg slow = {a, 8};
    pthread_create(&th, NULL, take_slowly, &slow);
    CHECK(sj_aligner_wait_space(a, 0, 6, SJ_ALIGNER_NO_DEADLINE) == SJ_OK, "room for 6");
    /* What the wake-up promises is room, so read the ring, not the taker's counter: the
     * taker counts a take only after the poll that woke us, and under load we can read
     * its counter in between. */
    int64_t queued = sj_aligner_queued(a, 0);
    CHECK(queued <= 2, "woke with %ld of 8 still queued", (long)queued);
    CHECK(sj_aligner_wait_space(a, 0, 100, SJ_ALIGNER_NO_DEADLINE) == SJ_OK,
          "want is clamped to the capacity");
    pthread_join(th, NULL);
    CHECK(sj_aligner_queued(a, 0) == 0, "all taken");
    sj_aligner_free(a, NULL, NULL);

    a = make(1, SJ_EXACTLY_ONCE, 1);
    sj_aligner_offer(a, 0, item(0, 0));
    pthread_create(&th, NULL, close_later, a);
    CHECK(sj_aligner_wait_space(a, 0, 1, SJ_ALIGNER_NO_DEADLINE) == SJ_ECLOSED,
          "close wakes a producer");
    pthread_join(th, NULL);
    sj_aligner_free(a, NULL, NULL);
}

/* ---- threads ----------------------------------------------------------------------- */

enum { THREAD_ITEMS = 300000, BARRIER_EVERY = 1000, PRODUCERS = 3 };

typedef struct producer_arg {
    sj_aligner *a;
    int32_t ch;
    int bulk;
    atomic_llong *completed; /* at-least-once: snapshots seen by the consumer */
} producer_arg;

static void push_blocking(sj_aligner *a, int32_t ch, sj_status (*try_push)(sj_aligner *, int32_t, void *), void *arg) {
    sj_status st;
    while ((st = try_push(a, ch, arg)) == SJ_EAGAIN)
        st = sj_aligner_wait_space(a, ch, sj_aligner_capacity(a) / 2, SJ_ALIGNER_NO_DEADLINE);
    if (st != SJ_OK) {
        failures++;
        fprintf(stderr, "producer %d: %s\n", ch, sj_status_message(st));
    }
}

static sj_status push_item(sj_aligner *a, int32_t ch, void *p) { return sj_aligner_offer(a, ch, p); }
static sj_status push_barrier(sj_aligner *a, int32_t ch, void *p) {
    return sj_aligner_offer_barrier(a, ch, (int64_t)(intptr_t)p, 0);
}
static sj_status push_end(sj_aligner *a, int32_t ch, void *p) {
    (void)p;
    return sj_aligner_offer_end(a, ch);
}

static void *producer(void *p) {
    producer_arg *arg = p;
    void *batch[37];
    int64_t seq = 0;
    while (seq < THREAD_ITEMS) {
        int64_t snapshot = seq / BARRIER_EVERY;
        if (seq % BARRIER_EVERY == 0 && seq) {
            /* At-least-once: barrier n + 1 only after snapshot n completed, as the
             * coordinator guarantees (exactly-once needs no such help). */
            while (arg->completed && atomic_load(arg->completed) < snapshot - 2) sched_yield();
            push_blocking(arg->a, arg->ch, push_barrier, (void *)(intptr_t)(snapshot - 1));
        }
        if (arg->bulk) {
            int64_t n = BARRIER_EVERY - seq % BARRIER_EVERY;
            if (n > 37) n = 37;
            for (int64_t i = 0; i < n; i++) batch[i] = item(arg->ch, seq + i);
            int64_t done = 0;
            while (done < n) {
                int64_t accepted;
                sj_aligner_offer_many(arg->a, arg->ch, batch + done, n - done, &accepted);
                done += accepted;
                if (done < n) sj_aligner_wait_space(arg->a, arg->ch, n - done, SJ_ALIGNER_NO_DEADLINE);
            }
            seq += n;
        } else {
            push_blocking(arg->a, arg->ch, push_item, item(arg->ch, seq));
            seq++;
        }
    }
    push_blocking(arg->a, arg->ch, push_end, NULL);
    return NULL;
}

static void run_threads(int32_t mode, int bulk) {
    sj_aligner *a = make(PRODUCERS, mode, 64);
    atomic_llong completed;
    atomic_init(&completed, -1);
    pthread_t th[PRODUCERS];
    producer_arg args[PRODUCERS];
    for (int i = 0; i < PRODUCERS; i++) {
        producer_arg arg = {a, i, bulk && i != 1, mode == SJ_AT_LEAST_ONCE ? &completed : NULL};
        args[i] = arg;
        pthread_create(&th[i], NULL, producer, &args[i]);
    }
    int64_t seen[PRODUCERS] = {0};
    int64_t snapshots = 0, done = 0, events = 0;
    sj_event evs[50];
    while (!done) {
        int64_t count = 0;
        sj_status st = (events & 1) ? sj_aligner_drain(a, evs, 50, &count)
                                          : sj_aligner_poll(a, &evs[0]);
        if (st == SJ_OK && !(events & 1)) count = 1;
        if (st == SJ_EAGAIN || (st == SJ_OK && count == 0)) {
            sj_aligner_wait(a, SJ_ALIGNER_NO_DEADLINE);
            continue;
        }
        events++;
        if (st != SJ_OK) {
            CHECK(0, "consumer: %s", sj_status_message(st));
            break;
        }
        for (int64_t i = 0; i < count; i++) {
            sj_event *ev = &evs[i];
            if (ev->kind == SJ_EVENT_ITEM) {
                int32_t ch = item_channel(ev->item);
                if (ch != ev->channel || item_seq(ev->item) != seen[ch]) {
                    CHECK(0, "channel %d: item %ld after %ld", ev->channel, (long)item_seq(ev->item),
                          (long)seen[ch]);
                    done = 1;
                }
                seen[ch]++;
            } else if (ev->kind == SJ_EVENT_SNAPSHOT) {
                CHECK(ev->snapshot_id == snapshots, "snapshot %ld, expected %ld",
                      (long)ev->snapshot_id, (long)snapshots);
                int64_t before = (snapshots + 1) * BARRIER_EVERY;
                for (int c = 0; c < PRODUCERS; c++) {
                    if (mode == SJ_EXACTLY_ONCE)
                        CHECK(seen[c] == before, "snapshot %ld: channel %d gave %ld items, not %ld",
                              (long)snapshots, c, (long)seen[c], (long)before);
                    else
                        CHECK(seen[c] >= before, "snapshot %ld: channel %d gave %ld < %ld items",
                              (long)snapshots, c, (long)seen[c], (long)before);
                }
                atomic_store(&completed, snapshots);
                snapshots++;
            } else {
                done = 1;
            }
        }
    }
    for (int i = 0; i < PRODUCERS; i++) pthread_join(th[i], NULL);
    for (int c = 0; c < PRODUCERS; c++)
        CHECK(seen[c] == THREAD_ITEMS, "channel %d: %ld items", c, (long)seen[c]);
    CHECK(snapshots == THREAD_ITEMS / BARRIER_EVERY - 1, "%ld snapshots", (long)snapshots);
    CHECK(sj_aligner_size(a) == 0, "left %ld", (long)sj_aligner_size(a));
    sj_aligner_free(a, NULL, NULL);
}

static void test_threads(void) {
    run_threads(SJ_EXACTLY_ONCE, 0);
    run_threads(SJ_EXACTLY_ONCE, 1);
    run_threads(SJ_AT_LEAST_ONCE, 1);
}

int main(void) {
    test_arguments();
    test_ring_wraparound();
    test_exactly_once();
    test_at_least_once();
    test_faults();
    test_release();
    test_waits();
    test_threads();
    printf("%s: aligner, %d failed\n", failures ? "FAIL" : "ok", failures);
    return failures != 0;
}
