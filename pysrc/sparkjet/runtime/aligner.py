"""Barrier alignment: Hazelcast Jet's snapshot barriers over bounded per-channel queues.

A processor with several input channels (upstream processors) takes its input through a
:class:`BarrierAligner`: each channel is a bounded queue of items (Arrow batches or any
object), snapshot barriers and one end-of-stream marker, pushed by one producer thread
per channel; one consumer thread takes *events* out of it::

    (ITEM, channel, item)              an item, with the channel it came from
    (SNAPSHOT, snapshot_id, terminal)  every live channel delivered barrier snapshot_id
    (DONE,)                            every channel ended and everything was taken

>>> from sparkjet.runtime.aligner import BarrierAligner, ITEM, SNAPSHOT, DONE
>>> a = BarrierAligner(channels=2, mode="exactly-once", capacity=8)
>>> for entry in ("a0", "barrier", "a1"):
...     _ = a.offer_barrier(0, 0) if entry == "barrier" else a.offer(0, entry)
>>> a.put(1, "b0")
>>> a.drain(10)  # channel 0 is held after its barrier 0 until channel 1 delivers one
[('item', 0, 'a0'), ('item', 1, 'b0')]
>>> a.put_barrier(1, 0); a.end(0); a.end(1)
>>> a.drain(10)
[('snapshot', 0, False), ('item', 0, 'a1'), ('done',)]

Semantics (``shared/HAZELCAST.md`` §3)
--------------------------------------
- **exactly-once**: once the consumer has taken barrier *n* from a channel, the channel is
  held (not drained) until every live channel has delivered barrier *n*; then one
  ``(SNAPSHOT, n, terminal)`` event comes out and the held channels resume. So the items
  before that event are exactly the items each channel sent before its barrier *n*.
- **at-least-once**: channels are never held; ``SNAPSHOT n`` comes out when the last live
  channel delivers barrier *n* (items a channel sent after its barrier may come out before
  the event).
- A **terminal** barrier (the last snapshot before a stop) holds its channel in both modes.
- A channel whose end was taken no longer counts: if every remaining live channel has
  delivered barrier *n*, that ends the alignment. When every channel has ended, ``(DONE,)``
  comes out, and then again from every later ``poll`` / ``take`` (``drain`` returns
  ``[(DONE,)]``): a consumer loop never blocks after the end.
- **Barrier ids**: the first may be any id >= 0; after ``SNAPSHOT n`` the next must be
  ``n + 1``; :meth:`~BarrierAligner.expect` sets the next id explicitly (after a restart
  from snapshot *k - 1*, ``expect(k)``). The check happens on the **consumer side**, when
  the barrier is taken: :class:`BarrierError` from ``poll`` / ``take`` / ``drain`` for an id
  other than the expected (or aligning) one, for a second barrier from a channel during one
  alignment (possible only in at-least-once mode), or for a terminal flag that differs
  between channels. ``drain`` first returns the events before the bad barrier; the next
  call raises. The aligner then **fails for good**: consumer calls raise the same
  :class:`BarrierError`, producer calls raise :class:`AlignerClosedError` (so that blocked
  producers wake up), and the job is expected to restart.
- **Order**: the consumer visits channels round-robin and takes at most
  :data:`BURST` consecutive entries from one channel before moving on, so a given
  interleaving of pushes and takes always gives the same events (the reference below
  reproduces them exactly).

Threads and blocking
--------------------
One producer thread per channel (``offer*`` / ``put*`` / ``end`` on that channel) and one
consumer thread (``poll`` / ``take`` / ``drain`` / ``expect``) may run concurrently;
``close``, ``len`` and ``queued`` may be called from anywhere. ``put*``, ``end`` and
``take`` release the GIL while they wait (the native waits wake up every 50 ms to let
Ctrl-C through); the non-blocking calls never release it. ``close()`` wakes every blocked
call: producers then raise :class:`AlignerClosedError`, and so do consumers.

Besides the native :class:`BarrierAligner` this module holds :class:`ReferenceAligner`,
the same API in plain Python (deques and one lock), which the tests hold the native one
to, event for event.

Alignment timeout: unaligned snapshots
--------------------------------------
:class:`TimeoutAligner` wraps an exactly-once aligner with Flink's aligned checkpoint
timeout (``JobConfig.alignment_timeout``). Once barrier *n* has reached the aligner on some
channel (pushed by its producer: it may still wait behind queued items) and ``timeout``
seconds have passed without ``SNAPSHOT n``, ``take`` returns ``(UNALIGNED, n, False)``
at once, ahead of the items still queued: the consumer saves its state and forwards
barrier *n* then. From there until ``SNAPSHOT n`` the items the inner aligner hands out
(all of them sent before barrier *n* on their channels, since the channels that delivered
it are held) are not returned but *captured*: the aligner drains them as fast as it can take
them, and ``SNAPSHOT n`` comes out as soon as every barrier *n* is taken, with the
captured ``(channel, item)`` pairs in :attr:`TimeoutAligner.in_flight` (they belong to
snapshot *n*: a restore replays them before new input). After ``SNAPSHOT n`` the captured
items come out as ordinary ``ITEM`` events, in the order they were taken, before anything
the inner aligner holds (so each channel's order is kept). A terminal barrier (stop,
suspend, export) is always aligned, so a snapshot a job stops with never holds items in
flight.

Backpressure is kept: the items captured and not replayed yet count against their
channel's ``capacity`` (:meth:`TimeoutAligner.queued` says so), and a producer waits while
its channel's queue and those items fill it. Only a channel that has not delivered the
barrier being captured may go past that (its items until the barrier belong to the
snapshot, which must complete), so each unaligned snapshot does not add a queue's worth of
buffering under a sustained overload.

>>> from sparkjet.runtime.aligner import TimeoutAligner, UNALIGNED
>>> a = TimeoutAligner(BarrierAligner(channels=2, capacity=8), alignment_timeout=0)
>>> for x in ("a0", "a1"): a.put(0, x)
>>> a.put_barrier(0, 0); a.put(0, "a2"); a.put(1, "b0"); a.put_barrier(1, 0)
>>> a.take(0)  # barrier 0 came and the timeout (0 s) passed: snapshot now
('unaligned', 0, False)
>>> a.take(0), a.in_flight  # the items queued ahead of the barriers are captured
(('snapshot', 0, False), [(0, 'a0'), (0, 'a1'), (1, 'b0')])
>>> [a.take(0) for _ in range(4)]  # then replayed, before what came after the barriers
[('item', 0, 'a0'), ('item', 0, 'a1'), ('item', 1, 'b0'), ('item', 0, 'a2')]
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

from sparkjet._native import (  # FAULT_*: why a barrier was refused (sj_barrier_fault)
    BURST,
    DONE,
    FAULT_OTHER_ID,
    FAULT_SECOND,
    FAULT_TERMINAL,
    FAULT_UNEXPECTED_ID,
    ITEM,
    MAX_SNAPSHOT_ID,
    SNAPSHOT,
    BarrierAligner,
    check_aligner_config,
)
from sparkjet.errors import (
    AlignerClosedError,
    BarrierError,
    InvalidArgumentError,
    aligner_channel_error,
    aligner_closed_error,
    aligner_ended_error,
    aligner_snapshot_id_error,
    aligner_timeout_error,
    check_aligner_timeout,
)

__all__ = [
    "BURST",
    "UNALIGNED",
    "DONE",
    "FAULT_OTHER_ID",
    "FAULT_SECOND",
    "FAULT_TERMINAL",
    "FAULT_UNEXPECTED_ID",
    "ITEM",
    "SNAPSHOT",
    "AlignerClosedError",
    "BarrierAligner",
    "BarrierError",
    "ReferenceAligner",
    "TimeoutAligner",
]

#: The event of :class:`TimeoutAligner` that says "snapshot now, unaligned".
UNALIGNED = "unaligned"

DEFAULT_CAPACITY = 1024
DEFAULT_HISTORY = 1000  # completed alignments kept in ``alignments``


def _alignment_record(snapshot_id, terminal, blocking, started_ns, done_ns, arrived_ns):
    """One entry of ``alignments``: the same dict the native aligner builds."""
    return {
        "snapshot_id": snapshot_id,
        "terminal": terminal,
        "blocking": blocking,
        "started": started_ns / 1e9,
        "duration_s": (done_ns - started_ns) / 1e9,
        "held": {c: (done_ns - t) / 1e9 for c, t in enumerate(arrived_ns) if t is not None},
    }


# ------------------------------------------------------------------ the reference


class _Barrier(NamedTuple):
    snapshot_id: int
    terminal: bool


_END = object()
_DONE_EVENT = (DONE,)


class _Alignment:
    """The consumer's state machine, on channels it reads through two callables:
    ``has(c)`` (the channel has an entry) and ``pop(c)`` (take it). The same rules, in
    the same order, as native/src/aligner.c."""

    def __init__(self, channels: int, mode: str):
        self.channels = channels
        self.at_least_once = mode == "at-least-once"
        self.live = [True] * channels
        self.held = [False] * channels
        self.arrived_ns: list[int | None] = [None] * channels
        self.live_count = channels
        self.arrived_count = 0
        self.aligning: int | None = None
        self.terminal = False
        self.blocking = False
        self.started_ns = 0
        self.expected: int | None = None
        self.rr = 0  # the channel being drained
        self.taken = 0  # entries taken from it in a row
        self.last: dict | None = None

    def finished(self) -> bool:
        return self.live_count == 0 and self.aligning is None

    def next_channel(self, has) -> int | None:
        for _ in range(self.channels + 1):
            c = self.rr
            if self.live[c] and not self.held[c] and self.taken < BURST and has(c):
                return c
            self.rr = (c + 1) % self.channels
            self.taken = 0
        return None

    def step(self, has, pop):
        """The next event, or None if nothing can be taken now; raises BarrierError."""
        if self.finished():
            return _DONE_EVENT
        while True:
            c = self.next_channel(has)
            if c is None:
                return None
            entry = pop(c)
            self.taken += 1
            if entry is _END:
                event = self._on_end(c)
            elif type(entry) is _Barrier:
                event = self._on_barrier(c, entry.snapshot_id, entry.terminal)
            else:
                return (ITEM, c, entry)
            if event is not None:
                return event
            if self.finished():
                return _DONE_EVENT

    def expect(self, snapshot_id: int) -> None:
        if self.aligning is not None:
            raise InvalidArgumentError(
                f"cannot expect snapshot {snapshot_id} while snapshot {self.aligning} "
                "is aligning")
        if not 0 <= snapshot_id <= MAX_SNAPSHOT_ID:
            raise aligner_snapshot_id_error(snapshot_id, MAX_SNAPSHOT_ID)
        self.expected = snapshot_id

    def _on_barrier(self, c, snapshot_id, terminal):
        if self.aligning is not None:
            fault = (FAULT_SECOND if self.arrived_ns[c] is not None
                     else FAULT_OTHER_ID if snapshot_id != self.aligning
                     else FAULT_TERMINAL if terminal != self.terminal else None)
            if fault:
                raise BarrierError(fault, c, snapshot_id, terminal, self.aligning)
        else:
            if self.expected is not None and snapshot_id != self.expected:
                raise BarrierError(FAULT_UNEXPECTED_ID, c, snapshot_id, terminal,
                                   self.expected)
            self.aligning = snapshot_id
            self.terminal = terminal
            self.blocking = not self.at_least_once or terminal
            self.started_ns = time.monotonic_ns()
            self.arrived_count = 0
        self.arrived_ns[c] = time.monotonic_ns()
        self.held[c] = self.blocking
        self.arrived_count += 1
        return self._complete() if self.arrived_count >= self.live_count else None

    def _on_end(self, c):
        self.live[c] = False
        self.live_count -= 1
        if self.aligning is None:
            return None
        if self.arrived_ns[c] is not None:
            self.arrived_count -= 1
        return self._complete() if self.arrived_count >= self.live_count else None

    def _complete(self):
        snapshot_id, terminal = self.aligning, self.terminal
        self.last = _alignment_record(snapshot_id, terminal, self.blocking, self.started_ns,
                                      time.monotonic_ns(), self.arrived_ns)
        self.arrived_ns = [None] * self.channels
        self.held = [False] * self.channels
        self.aligning = None
        self.expected = snapshot_id + 1
        return (SNAPSHOT, snapshot_id, terminal)


class ReferenceAligner:
    """:class:`BarrierAligner` in plain Python: one deque per channel and one lock.

    Same constructor, methods, events, errors and event order; slower (the benchmarks
    show by how much) and without the native one's lock-free fast path. Kept as the
    executable specification the native aligner is tested against.
    """

    def __init__(self, channels: int, mode: str = "exactly-once",
                 capacity: int = DEFAULT_CAPACITY, history: int = DEFAULT_HISTORY):
        check_aligner_config(channels, mode, capacity, history)
        self._channels = channels
        self._mode = mode
        self._capacity = capacity
        self._queues = [deque() for _ in range(channels)]
        self._ended = [False] * channels
        self._lock = threading.Lock()
        self._readable = threading.Condition(self._lock)
        self._writable = threading.Condition(self._lock)
        self._closed = False
        self._failure: BarrierError | None = None
        self._consumer_waits = False  # notify only when someone waits
        self._producer_waits = 0
        self._alignment = _Alignment(channels, mode)
        self._alignments: deque = deque(maxlen=history)

    # ---- configuration and state

    channels = property(lambda self: self._channels, doc="Number of input channels.")
    mode = property(lambda self: self._mode, doc='"exactly-once" or "at-least-once".')
    capacity = property(lambda self: self._capacity, doc="Entries each channel holds.")

    @property
    def expected(self) -> int | None:
        """The id the next barrier must carry, or None if any id will do."""
        return self._alignment.expected

    @property
    def aligning(self) -> int | None:
        """The snapshot being aligned, or None."""
        return self._alignment.aligning

    @property
    def live(self) -> int:
        """Channels whose end has not been taken yet."""
        return self._alignment.live_count

    @property
    def alignments(self) -> list[dict]:
        """The last ``history`` completed alignments, oldest first."""
        return list(self._alignments)

    @property
    def closed(self) -> bool:
        return self._closed or self._failure is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._queues))

    def queued(self, channel: int) -> int:
        self._check_channel(channel)
        return len(self._queues[channel])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(channels={self._channels}, mode={self._mode!r}, "
                f"capacity={self._capacity})")

    # ---- producer side

    def offer(self, channel: int, item: Any) -> bool:
        with self._lock:
            return self._push(channel, item)

    def put(self, channel: int, item: Any, timeout: float | None = None) -> None:
        self._put(channel, item, timeout)

    def offer_many(self, channel: int, items: Sequence) -> int:
        with self._lock:
            return self._push_many(channel, items, 0)

    def put_many(self, channel: int, items: Sequence, timeout: float | None = None) -> int:
        check_aligner_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            done = self._push_many(channel, items, 0)
            while done < len(items):
                if not self._wait_writable(channel, deadline):
                    break
                done = self._push_many(channel, items, done)
            return done

    def offer_barrier(self, channel: int, snapshot_id: int, terminal: bool = False) -> bool:
        barrier = self._barrier(snapshot_id, terminal)
        with self._lock:
            return self._push(channel, barrier)

    def put_barrier(self, channel: int, snapshot_id: int, terminal: bool = False,
                    timeout: float | None = None) -> None:
        self._put(channel, self._barrier(snapshot_id, terminal), timeout)

    def end(self, channel: int, timeout: float | None = None) -> None:
        self._put(channel, _END, timeout)

    # ---- consumer side

    def poll(self) -> tuple | None:
        with self._lock:
            return self._step()

    def take(self, timeout: float | None = None) -> tuple | None:
        check_aligner_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                event = self._step()
                if event is not None:
                    return event
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._consumer_waits = True
                try:
                    self._readable.wait(remaining)
                finally:
                    self._consumer_waits = False

    def drain(self, max_events: int = 1024) -> list[tuple]:
        if max_events < 0:
            raise InvalidArgumentError(f"max_events must be >= 0, not {max_events}")
        events = []
        with self._lock:
            while len(events) < max_events:
                try:
                    event = self._step()
                except BarrierError:
                    if events:
                        break  # the next call raises it
                    raise
                if event is None:
                    break
                events.append(event)
                if event is _DONE_EVENT:
                    break
        return events

    def expect(self, snapshot_id: int) -> None:
        with self._lock:
            self._alignment.expect(snapshot_id)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._readable.notify_all()
            self._writable.notify_all()

    # ---- internals (called with the lock held)

    def _check_channel(self, channel: int) -> None:
        if not 0 <= channel < self._channels:
            raise aligner_channel_error(channel, self._channels)

    def _check_push(self, channel: int) -> None:
        self._check_channel(channel)
        if self._failure is not None or self._closed:
            raise aligner_closed_error(self._failure)
        if self._ended[channel]:
            raise aligner_ended_error(channel)

    @staticmethod
    def _barrier(snapshot_id: int, terminal: bool) -> _Barrier:
        if not 0 <= snapshot_id <= MAX_SNAPSHOT_ID:
            raise aligner_snapshot_id_error(snapshot_id, MAX_SNAPSHOT_ID)
        return _Barrier(snapshot_id, bool(terminal))

    def _push(self, channel: int, entry) -> bool:
        self._check_push(channel)
        queue = self._queues[channel]
        if len(queue) >= self._capacity:
            return False
        queue.append(entry)
        if entry is _END:
            self._ended[channel] = True
        if self._consumer_waits:
            self._readable.notify()
        return True

    def _push_many(self, channel: int, items: Sequence, start: int) -> int:
        self._check_push(channel)
        queue = self._queues[channel]
        room = self._capacity - len(queue)
        accepted = items[start:start + room] if room > 0 else ()
        queue.extend(accepted)
        if accepted and self._consumer_waits:
            self._readable.notify()
        return start + len(accepted)

    def _put(self, channel: int, entry, timeout: float | None) -> None:
        check_aligner_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._push(channel, entry):
                if not self._wait_writable(channel, deadline):
                    raise aligner_timeout_error(channel, timeout)

    def _wait_writable(self, channel: int, deadline: float | None) -> bool:
        """Waits for room on the channel; False if the deadline passed first."""
        while len(self._queues[channel]) >= self._capacity:
            self._check_push(channel)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._producer_waits += 1
            try:
                self._writable.wait(remaining)
            finally:
                self._producer_waits -= 1
        return True

    def _step(self):
        if self._failure is not None:
            f = self._failure
            raise BarrierError(f.fault, f.channel, f.snapshot_id, f.terminal, f.expected)
        if self._closed:
            raise aligner_closed_error(None)
        queues = self._queues
        try:
            event = self._alignment.step(lambda c: bool(queues[c]), lambda c: queues[c].popleft())
        except BarrierError as e:
            self._failure = e
            self._readable.notify_all()
            self._writable.notify_all()
            raise
        if self._producer_waits:
            self._writable.notify_all()
        if event is not None and event[0] is SNAPSHOT:
            self._alignments.append(self._alignment.last)
        return event


# ------------------------------------------------------------------ the alignment timeout


class TimeoutAligner:
    """An exactly-once aligner (:class:`BarrierAligner` or :class:`ReferenceAligner`) whose
    alignments time out after ``alignment_timeout`` seconds, counted from the moment the
    first barrier of a snapshot reached it: then ``take`` returns ``(UNALIGNED, n,
    False)``, captures what is in flight until ``SNAPSHOT n`` and replays it afterwards
    (see the module's "Alignment timeout"). Producers use it as the inner aligner (every
    producer call is the inner one's, ``put_barrier`` / ``offer_barrier`` also note when
    the barrier came); one consumer thread calls ``take`` / ``poll``."""

    def __init__(self, aligner, alignment_timeout: float, history: int = DEFAULT_HISTORY):
        if aligner.mode != "exactly-once":
            raise InvalidArgumentError(
                f"an alignment timeout needs an exactly-once aligner, not {aligner.mode!r}: "
                "at-least-once never holds a channel")
        if not (isinstance(alignment_timeout, (int, float)) and alignment_timeout >= 0
                and alignment_timeout != float("inf")):
            raise InvalidArgumentError(
                f"alignment_timeout must be a finite number of seconds >= 0, not "
                f"{alignment_timeout!r}")
        self.aligner = aligner
        self.alignment_timeout = float(alignment_timeout)
        self.end = aligner.end
        self._arrived: dict[int, tuple[float, bool]] = {}  # snapshot id -> (when, terminal)
        self._room = threading.Condition()
        self._borrowed = [0] * aligner.channels  # captured or replayed items not taken yet
        self._barrier_put = [-1] * aligner.channels  # the last barrier pushed per channel
        self._capturing: int | None = None
        self._started = self._waited = 0.0
        self._captured: list = []
        self._replay: deque = deque()
        #: the (channel, item) pairs in flight of the last unaligned snapshot
        self.in_flight: list = []
        #: the last ``history`` unaligned snapshots: id, seconds from the first barrier's
        #: arrival to the snapshot (``waited_s``) and from there to the last barrier
        #: (``capture_s``), items captured
        self.unaligned: deque = deque(maxlen=history)

    def __getattr__(self, name):  # the rest of the inner aligner's API (len, alignments, ...)
        return getattr(self.aligner, name)

    def __len__(self) -> int:
        return len(self.aligner) + sum(self._borrowed)

    def queued(self, channel: int) -> int:
        """Entries of ``channel`` not taken yet: in the queue, captured or being replayed."""
        return self.aligner.queued(channel) + self._borrowed[channel]

    def __repr__(self) -> str:
        return f"TimeoutAligner({self.aligner!r}, alignment_timeout={self.alignment_timeout})"

    # ---- producer side

    def put(self, channel: int, item, timeout: float | None = None) -> None:
        if self._borrowed[channel]:
            self._wait_room(channel, timeout)
        self.aligner.put(channel, item, timeout=timeout)

    def offer(self, channel: int, item) -> bool:
        if self._borrowed[channel] and self._full(channel):
            return False
        return self.aligner.offer(channel, item)

    def put_many(self, channel: int, items, timeout: float | None = None) -> int:
        if self._borrowed[channel]:
            self._wait_room(channel, timeout)
        return self.aligner.put_many(channel, items, timeout=timeout)

    def offer_many(self, channel: int, items) -> int:
        if self._borrowed[channel] and self._full(channel):
            return 0
        return self.aligner.offer_many(channel, items)

    def _full(self, channel: int) -> bool:
        """The channel's queue plus its borrowed items fill its capacity, and it is not a
        channel whose items a capture still waits for."""
        capturing = self._capturing
        if capturing is not None and self._barrier_put[channel] < capturing:
            return False
        return self.aligner.queued(channel) + self._borrowed[channel] >= self.aligner.capacity

    def _wait_room(self, channel: int, timeout: float | None) -> None:
        check_aligner_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._room:
            while self._full(channel):
                if self.aligner.closed:
                    return      # the inner put raises why
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise aligner_timeout_error(channel, timeout)
                # woken when a borrowed item is taken or a capture starts; the queue's own
                # takes are not signalled here, hence the slice
                self._room.wait(0.005 if left is None else min(0.005, left))

    def announce(self, snapshot_id: int, terminal: bool = False) -> None:
        """Barrier ``snapshot_id`` is on its way (a producer will put it once its queue has
        room): the timeout counts from now."""
        self._arrived.setdefault(snapshot_id, (time.monotonic(), bool(terminal)))

    def put_barrier(self, channel: int, snapshot_id: int, terminal: bool = False,
                    timeout: float | None = None) -> None:
        self._arrived.setdefault(snapshot_id, (time.monotonic(), bool(terminal)))
        self.aligner.put_barrier(channel, snapshot_id, terminal, timeout=timeout)
        self._barrier_put[channel] = snapshot_id

    def offer_barrier(self, channel: int, snapshot_id: int, terminal: bool = False) -> bool:
        self._arrived.setdefault(snapshot_id, (time.monotonic(), bool(terminal)))
        if not self.aligner.offer_barrier(channel, snapshot_id, terminal):
            return False
        self._barrier_put[channel] = snapshot_id
        return True

    # ---- consumer side

    @property
    def capturing(self) -> int | None:
        """The snapshot whose in-flight items are being captured, or None."""
        return self._capturing

    def replay(self, items) -> None:
        """Hands out ``items`` ((channel, item) pairs: a restored snapshot's in-flight
        items) as ITEM events before anything else."""
        for c, _ in items:
            self._borrowed[c] += 1
        self._replay.extend(items)

    def poll(self) -> tuple | None:
        return self.take(0)

    def take(self, timeout: float | None = None) -> tuple | None:
        check_aligner_timeout(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            due = None
            if self._capturing is None:
                due = self._due()
                if due is not None and due[1] <= now:
                    return self._unalign(due[0], now)
                if self._replay:
                    c, item = self._replay.popleft()
                    with self._room:
                        self._borrowed[c] -= 1
                        self._room.notify_all()
                    return (ITEM, c, item)
            wait = None if end is None else max(0.0, end - now)
            if due is not None:
                wait = due[1] - now if wait is None else min(wait, due[1] - now)
            event = self.aligner.take(wait)
            if event is None:
                if end is not None and time.monotonic() >= end:
                    return None
                continue
            if self._capturing is not None and event[0] == ITEM:
                self._captured.append((event[1], event[2]))
                self._borrowed[event[1]] += 1
                # the caller's timeout holds while items flow: its loop has other work
                # (phase 2 of the last snapshot, stop, timers, a failed member)
                if end is not None and time.monotonic() >= end:
                    return None
                continue
            if event[0] == SNAPSHOT:
                self._completed(event[1])
            return event

    def _due(self) -> tuple[int, float] | None:
        """The oldest pending snapshot whose barrier came and its deadline (None: none;
        a terminal snapshot is always aligned)."""
        # (a copy first: producers' threads add snapshots while this one reads)
        pending = [(sid, t) for sid, (t, terminal) in list(self._arrived.items())
                   if not terminal]
        if not pending:
            return None
        sid, t = min(pending)
        return sid, t + self.alignment_timeout

    def _unalign(self, snapshot_id: int, now: float) -> tuple:
        self._capturing, self._started = snapshot_id, now
        # a replay not finished yet was sent before this barrier too: still in flight
        self._captured = list(self._replay)
        self._replay.clear()
        self._waited = now - self._arrived[snapshot_id][0]
        with self._room:    # producers of channels it waits for may go past their capacity
            self._room.notify_all()
        return (UNALIGNED, snapshot_id, False)

    def _completed(self, snapshot_id: int) -> None:
        for sid in [s for s in list(self._arrived) if s <= snapshot_id]:
            self._arrived.pop(sid, None)
        if self._capturing is None:
            return
        if snapshot_id != self._capturing:  # the inner aligner checks ids: cannot happen
            raise InvalidArgumentError(f"snapshot {snapshot_id} completed while snapshot "
                                       f"{self._capturing} was capturing")
        self.in_flight = self._captured
        self._replay.extend(self._captured)
        self._captured = []
        self.unaligned.append({"snapshot_id": snapshot_id, "waited_s": self._waited,
                               "capture_s": time.monotonic() - self._started,
                               "items": len(self.in_flight)})
        self._capturing = None
