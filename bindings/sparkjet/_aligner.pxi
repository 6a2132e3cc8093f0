# The barrier aligner (native/include/sparkjet/aligner.h).
#
# Items are Python objects stored in the C rings as plain pointers that own a reference:
# a push takes one (Py_INCREF, with the GIL held) and the event that returns the item hands
# it to the caller; whatever is still queued is released when the aligner is deallocated.
# Non-blocking calls keep the GIL (they are a few dozen nanoseconds of C); blocking ones
# release it only to sleep, in slices of _WAIT_SLICE_NS so that signals are handled.
# The semantics are described in sparkjet.aligner and native/include/sparkjet/aligner.h.

from collections import deque

from cpython.exc cimport PyErr_CheckSignals
from cpython.ref cimport PyObject, Py_XDECREF, Py_XINCREF
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc

from sparkjet.libsparkjet_aligner cimport *

from sparkjet.errors import BarrierFault, check_aligner_timeout

MAX_CHANNELS = SJ_ALIGNER_MAX_CHANNELS
MAX_CAPACITY = SJ_ALIGNER_MAX_CAPACITY
MAX_SNAPSHOT_ID = SJ_ALIGNER_MAX_SNAPSHOT_ID
BURST = SJ_ALIGNER_BURST
FAULT_UNEXPECTED_ID = SJ_FAULT_UNEXPECTED_ID
FAULT_OTHER_ID = SJ_FAULT_OTHER_ID
FAULT_SECOND = SJ_FAULT_SECOND
FAULT_TERMINAL = SJ_FAULT_TERMINAL
MODES = ("exactly-once", "at-least-once")

cdef object _ITEM = "item"
cdef object _SNAPSHOT = "snapshot"
cdef object _DONE = "done"
cdef tuple _DONE_EVENT = (_DONE,)
ITEM = _ITEM
SNAPSHOT = _SNAPSHOT
DONE = _DONE

if tuple(BarrierFault) != (SJ_FAULT_UNEXPECTED_ID, SJ_FAULT_OTHER_ID, SJ_FAULT_SECOND,
                          SJ_FAULT_TERMINAL):
    raise ImportError("sparkjet.errors.BarrierFault disagrees with sj_barrier_fault")


def check_aligner_config(channels, mode, capacity, history):
    """Refuses an aligner configuration outside its limits (the reference aligner's too)."""
    if not 1 <= channels <= SJ_ALIGNER_MAX_CHANNELS:
        raise InvalidArgumentError(
            f"channels must be 1..{SJ_ALIGNER_MAX_CHANNELS}, not {channels}")
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {', '.join(map(repr, MODES))}, "
                                   f"not {mode!r}")
    if not 1 <= capacity <= SJ_ALIGNER_MAX_CAPACITY:
        raise InvalidArgumentError(
            f"capacity must be 1..{SJ_ALIGNER_MAX_CAPACITY}, not {capacity}")
    if history < 0:
        raise InvalidArgumentError(f"history must be >= 0, not {history}")


cdef enum:
    _DRAIN_CHUNK = 256  # events converted per native drain call
cdef int64_t _WAIT_SLICE_NS = 50_000_000
cdef int64_t _MAX_TIMEOUT_NS = 10**18  # ~31 years: longer timeouts wait forever


cdef void _release(void *item, void *ctx) noexcept nogil:
    with gil:  # already held (called from __dealloc__): this only satisfies the type
        Py_XDECREF(<PyObject *>item)


cdef int64_t _deadline(object timeout) except -2:
    """The CLOCK_MONOTONIC deadline of a timeout in seconds (None: no deadline)."""
    if timeout is None:
        return SJ_ALIGNER_NO_DEADLINE
    cdef double seconds = timeout
    if not seconds >= 0:  # also NaN
        check_aligner_timeout(timeout)
    if seconds * 1e9 >= _MAX_TIMEOUT_NS:
        return SJ_ALIGNER_NO_DEADLINE
    return sj_aligner_now_ns() + <int64_t>(seconds * 1e9)


cdef class BarrierAligner:
    """Bounded per-channel queues of items, barriers and end-of-stream markers, with
    Hazelcast Jet's barrier alignment on the way out (see :mod:`sparkjet.aligner`).

    ``BarrierAligner(channels, mode="exactly-once", capacity=1024, history=1000)``:
    ``channels`` input channels (1..65536), ``mode`` ``"exactly-once"`` or
    ``"at-least-once"``, ``capacity`` entries per channel (items, barriers and the end
    marker all count), ``history`` completed alignments kept in :attr:`alignments`.
    """
    cdef sj_aligner *a
    cdef sj_event *buf
    cdef int64_t *held_ns
    cdef object _alignments
    cdef str _mode
    cdef int64_t _half  # put_many waits for this much room (or what it has left): fewer wake-ups

    def __cinit__(self, int32_t channels, str mode="exactly-once", int64_t capacity=1024,
                  Py_ssize_t history=1000):
        check_aligner_config(channels, mode, capacity, history)
        cdef sj_status st = sj_aligner_new(
            channels, SJ_AT_LEAST_ONCE if mode == "at-least-once" else SJ_EXACTLY_ONCE,
            capacity, &self.a)
        if st != SJ_OK:
            self._raise(st, -1, None)
        self.buf = <sj_event *>malloc(_DRAIN_CHUNK * sizeof(sj_event))
        self.held_ns = <int64_t *>malloc(channels * sizeof(int64_t))
        if self.buf == NULL or self.held_ns == NULL:
            raise MemoryError()
        self._alignments = deque(maxlen=history)
        self._mode = mode
        self._half = max(1, capacity // 2)

    def __dealloc__(self):
        sj_aligner_free(self.a, _release, NULL)
        free(self.buf)
        free(self.held_ns)

    # ---- configuration and state

    @property
    def channels(self) -> int:
        """Number of input channels."""
        return sj_aligner_channels(self.a)

    @property
    def mode(self) -> str:
        """``"exactly-once"`` or ``"at-least-once"``."""
        return self._mode

    @property
    def capacity(self) -> int:
        """Entries (items, barriers, end marker) each channel holds."""
        return sj_aligner_capacity(self.a)

    @property
    def expected(self):
        """The id the next barrier must carry, or None if any id will do."""
        cdef int64_t k = sj_aligner_expected(self.a)
        return None if k < 0 else k

    @property
    def aligning(self):
        """The snapshot being aligned, or None."""
        cdef int64_t k = sj_aligner_aligning(self.a)
        return None if k < 0 else k

    @property
    def live(self) -> int:
        """Channels whose end the consumer has not taken yet."""
        return sj_aligner_live(self.a)

    @property
    def alignments(self) -> list:
        """The last ``history`` completed alignments, oldest first, as dicts:
        ``snapshot_id``, ``terminal``, ``blocking`` (whether the channels were held:
        exactly-once or a terminal barrier), ``started`` (``time.monotonic()`` seconds
        when the first barrier was taken), ``duration_s`` (until the last one) and
        ``held`` ({channel: seconds from its barrier being taken to the end of the
        alignment}, for every channel that delivered the barrier)."""
        return list(self._alignments)

    @property
    def closed(self) -> bool:
        """True once closed, or failed on an unexpected barrier."""
        return sj_aligner_state(self.a) != 0

    def __len__(self):
        """Entries queued on all channels and not taken yet (a snapshot, if threads run)."""
        return sj_aligner_size(self.a)

    def queued(self, int32_t channel) -> int:
        """Entries queued on one channel and not taken yet."""
        cdef int64_t n = sj_aligner_queued(self.a, channel)
        if n < 0:
            raise aligner_channel_error(channel, sj_aligner_channels(self.a))
        return n

    def __repr__(self):
        return (f"BarrierAligner(channels={self.channels}, mode={self._mode!r}, "
                f"capacity={self.capacity})")

    # ---- producer side: one thread per channel

    def offer(self, int32_t channel, item) -> bool:
        """Pushes an item; False if the channel is full (backpressure)."""
        Py_XINCREF(<PyObject *>item)
        cdef sj_status st = sj_aligner_offer(self.a, channel, <void *>item)
        if st == SJ_OK:
            return True
        Py_XDECREF(<PyObject *>item)
        if st == SJ_EAGAIN:
            return False
        self._raise(st, channel, None)

    def put(self, int32_t channel, item, timeout=None) -> None:
        """Pushes an item, waiting (GIL released) while the channel is full; TimeoutError
        after ``timeout`` seconds."""
        Py_XINCREF(<PyObject *>item)
        try:
            self._put(channel, 0, <void *>item, 0, 0, timeout)
        except BaseException:
            Py_XDECREF(<PyObject *>item)
            raise

    def offer_many(self, int32_t channel, items) -> int:
        """Pushes the longest prefix of ``items`` (a sequence) that fits; returns its length."""
        seq = PySequence_Fast(items, "offer_many() needs a sequence of items")
        return self._offer_many(channel, seq, 0)

    def put_many(self, int32_t channel, items, timeout=None) -> int:
        """Pushes every item of ``items`` (a sequence), waiting while the channel is full;
        returns how many were pushed: ``len(items)`` unless ``timeout`` seconds passed."""
        seq = PySequence_Fast(items, "put_many() needs a sequence of items")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        cdef int64_t deadline = _deadline(timeout)
        cdef Py_ssize_t last, done = self._offer_many(channel, seq, 0)
        cdef sj_status st
        while done < n:
            # It blocks until all are pushed, so waiting for room for more than one item
            # (at most half the channel) never delays it, and wakes it less often.
            st = self._wait_space(channel, min(n - done, self._half), deadline)
            if st != SJ_OK and st != SJ_ETIMEOUT:
                self._raise(st, channel, timeout)
            last = done
            done = self._offer_many(channel, seq, done)  # after a timeout: what fits now
            if st == SJ_ETIMEOUT and done == last:
                break
        return done

    def offer_barrier(self, int32_t channel, int64_t snapshot_id, bint terminal=False) -> bool:
        """Pushes barrier ``snapshot_id``; False if the channel is full. Its id is checked
        when the consumer takes it."""
        cdef sj_status st = sj_aligner_offer_barrier(self.a, channel, snapshot_id,
                                                            terminal)
        if st == SJ_OK:
            return True
        if st == SJ_EAGAIN:
            return False
        self._raise(st, channel, None, snapshot_id)

    def put_barrier(self, int32_t channel, int64_t snapshot_id, bint terminal=False,
                    timeout=None) -> None:
        """Pushes barrier ``snapshot_id``, waiting while the channel is full."""
        self._put(channel, 1, NULL, snapshot_id, terminal, timeout)

    def end(self, int32_t channel, timeout=None) -> None:
        """Pushes the end of the channel's stream (queued like an item: waits while the
        channel is full). Nothing can be pushed to the channel afterwards."""
        self._put(channel, 2, NULL, 0, 0, timeout)

    # ---- consumer side: one thread

    def poll(self):
        """The next event, or None if nothing can be taken now (never blocks)."""
        cdef sj_event ev
        cdef sj_status st = sj_aligner_poll(self.a, &ev)
        if st == SJ_OK:
            return self._event(&ev)
        if st == SJ_EAGAIN:
            return None
        self._raise(st, -1, None)

    def take(self, timeout=None):
        """The next event, waiting (GIL released) up to ``timeout`` seconds; None on
        timeout."""
        cdef sj_event ev
        cdef int64_t until, deadline = _deadline(timeout)
        cdef sj_status st = sj_aligner_poll(self.a, &ev)
        while st == SJ_EAGAIN:
            until = _slice(deadline)
            with nogil:
                st = sj_aligner_wait(self.a, until)
            if st == SJ_ETIMEOUT:
                if until == deadline:
                    return None
                PyErr_CheckSignals()
            if st != SJ_ECLOSED:
                st = sj_aligner_poll(self.a, &ev)
        if st == SJ_OK:
            return self._event(&ev)
        self._raise(st, -1, None)

    def drain(self, Py_ssize_t max_events=1024) -> list:
        """Up to ``max_events`` events that are available now, in order (never blocks).
        If a bad barrier follows them, they are returned and the next call raises."""
        if max_events < 0:
            raise InvalidArgumentError(f"max_events must be >= 0, not {max_events}")
        cdef list out = []
        cdef int64_t count, i, chunk
        cdef sj_status st
        while max_events > 0:
            chunk = min(max_events, _DRAIN_CHUNK)
            st = sj_aligner_drain(self.a, self.buf, chunk, &count)
            for i in range(count):
                out.append(self._event(&self.buf[i]))
            if st != SJ_OK:
                if out:
                    break
                self._raise(st, -1, None)
            # The C drain stops after each SNAPSHOT (to let us record it) and after DONE.
            if count == 0 or self.buf[count - 1].kind == SJ_EVENT_DONE:
                break
            if count < chunk and self.buf[count - 1].kind == SJ_EVENT_ITEM:
                break
            max_events -= count
        return out

    def expect(self, int64_t snapshot_id) -> None:
        """Makes ``snapshot_id`` the id the next barrier must carry (after a restart from
        snapshot k - 1: ``expect(k)``). Not while an alignment is in progress."""
        if sj_aligner_expect(self.a, snapshot_id) != SJ_OK:
            if self.aligning is not None:
                raise InvalidArgumentError(
                    f"cannot expect snapshot {snapshot_id} while snapshot {self.aligning} "
                    "is aligning")
            raise aligner_snapshot_id_error(snapshot_id, SJ_ALIGNER_MAX_SNAPSHOT_ID)

    # ---- any thread

    def close(self) -> None:
        """Wakes every blocked call; afterwards every push and take raises
        AlignerClosedError. Queued items are released with the aligner."""
        sj_aligner_close(self.a)

    # ---- internals

    cdef object _event(self, sj_event *ev):
        cdef object item
        if ev.kind == SJ_EVENT_ITEM:
            item = <object>ev.item
            Py_XDECREF(<PyObject *>ev.item)  # the ring's reference; `item` holds one
            return (_ITEM, ev.channel, item)
        if ev.kind == SJ_EVENT_SNAPSHOT:
            self._record_alignment()
            return (_SNAPSHOT, ev.snapshot_id, ev.terminal != 0)
        return _DONE_EVENT

    cdef _record_alignment(self):
        cdef sj_alignment rec
        cdef int32_t c
        if sj_aligner_last_alignment(self.a, &rec, self.held_ns) != SJ_OK:
            return
        self._alignments.append({
            "snapshot_id": rec.snapshot_id,
            "terminal": rec.terminal != 0,
            "blocking": rec.blocking != 0,
            "started": rec.started_ns / 1e9,
            "duration_s": rec.duration_ns / 1e9,
            "held": {c: self.held_ns[c] / 1e9
                     for c in range(sj_aligner_channels(self.a)) if self.held_ns[c] >= 0},
        })

    cdef Py_ssize_t _offer_many(self, int32_t channel, object seq, Py_ssize_t start) except -1:
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) - start
        cdef PyObject **items = PySequence_Fast_ITEMS(seq) + start
        cdef Py_ssize_t i, held = min(n, <Py_ssize_t>sj_aligner_capacity(self.a))
        cdef int64_t accepted = 0
        for i in range(held):  # at most `capacity` can be accepted
            Py_XINCREF(items[i])
        cdef sj_status st = sj_aligner_offer_many(self.a, channel, <void **>items, held,
                                                        &accepted)
        for i in range(accepted, held):
            Py_XDECREF(items[i])
        if st != SJ_OK:
            self._raise(st, channel, None)
        return start + accepted

    cdef sj_status _push(self, int32_t channel, int kind, void *item, int64_t snapshot_id,
                               bint terminal) noexcept:
        if kind == 0:
            return sj_aligner_offer(self.a, channel, item)
        if kind == 1:
            return sj_aligner_offer_barrier(self.a, channel, snapshot_id, terminal)
        return sj_aligner_offer_end(self.a, channel)

    cdef int _put(self, int32_t channel, int kind, void *item, int64_t snapshot_id,
                  bint terminal, object timeout) except -1:
        """Pushes an item (kind 0), a barrier (1) or the end (2), waiting for room."""
        cdef int64_t deadline = _deadline(timeout)  # checks it even if no wait is needed
        cdef sj_status st = self._push(channel, kind, item, snapshot_id, terminal)
        while st == SJ_EAGAIN:
            # Room for one entry, not more: a put blocks only while the channel is full.
            st = self._wait_space(channel, 1, deadline)
            if st == SJ_OK:
                st = self._push(channel, kind, item, snapshot_id, terminal)
        if st != SJ_OK:
            self._raise(st, channel, timeout, snapshot_id)
        return 0

    cdef sj_status _wait_space(self, int32_t channel, int64_t want,
                                     int64_t deadline) except *:
        """Waits for room for `want` entries with the GIL released, a slice at a time."""
        cdef sj_status st
        cdef int64_t until
        while True:
            until = _slice(deadline)
            with nogil:
                st = sj_aligner_wait_space(self.a, channel, want, until)
            if st != SJ_ETIMEOUT or until == deadline:
                return st
            PyErr_CheckSignals()

    cdef int _raise(self, sj_status st, int32_t channel, object timeout,
                    int64_t snapshot_id=-1) except -1:
        """Raises what _status.pxi maps a failed status to, with this aligner's context."""
        cdef sj_barrier_failure f
        cdef int32_t channels = sj_aligner_channels(self.a) if self.a != NULL else 0
        failure = None
        if self.a != NULL and (st == SJ_EBARRIER or st == SJ_ECLOSED):
            sj_aligner_failure(self.a, &f)
            if f.fault != SJ_FAULT_NONE:
                failure = BarrierError(f.fault, f.channel, f.snapshot_id, f.terminal != 0,
                                       None if f.expected < 0 else f.expected)
        raise aligner_status_error(st, channel, channels, timeout, snapshot_id, failure)


cdef inline int64_t _slice(int64_t deadline) noexcept:
    """The deadline of the next wait: at most _WAIT_SLICE_NS from now."""
    cdef int64_t until = sj_aligner_now_ns() + _WAIT_SLICE_NS
    if deadline >= 0 and deadline < until:
        return deadline
    return until
