"""Barrier alignment with producer threads: sparkjet's BarrierAligner beside the same
alignment over ``queue.Queue`` and over ``collections.deque`` + a lock.

Two ways to run it (see bench/README.md):

    python bench/bench_aligner.py              # summary table, about a minute
    python -m pytest bench/bench_aligner.py --benchmark-only

Workload: P producer threads (2, 3, 4), one per channel, each pushing ``items`` small
ints with a barrier every ``every`` items (snapshot ids 0, 1, ...) and then the end of its
stream, into an exactly-once aligner of ``capacity`` entries per channel; one consumer
thread (the main one) takes events until DONE. A run is timed from the moment the
producers start to the DONE event, and its totals are checked (every item, every
snapshot, in order). Competitors, all with the same alignment rules and event order:

- ``sparkjet``: the native aligner, one item per call (``put`` / ``take``);
- ``sparkjet bulk``: the same, ``put_many`` of whole segments between barriers and
  ``drain`` on the consumer side;
- ``deque + Lock``: :class:`sparkjet.runtime.aligner.ReferenceAligner` (one deque per channel, one
  lock, conditions to wait on), one item per call, and ``put_many`` / ``drain``;
- ``queue.Queue``: one ``queue.Queue(capacity)`` per channel and the reference's state
  machine on the consumer side; a consumer with nothing to take waits up to 1 ms in
  ``get`` on the next channel it may drain.

Every figure is the median of several runs in one process; no time is ever asserted.
"""
import argparse
import contextlib
import dataclasses
import os
import platform
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

import pytest

import sparkjet

# The reference's private state machine and entry markers too, so that the queue.Queue
# version differs from it in the queues only.
from sparkjet.runtime.aligner import (
    _END,
    DONE,
    ITEM,
    SNAPSHOT,
    BarrierAligner,
    ReferenceAligner,
    _Alignment,
    _Barrier,
)

PRODUCERS = (2, 3, 4)
EVERY = 1000  # items between barriers
CAPACITY = 1024
FAST_ITEMS = 200_000  # per producer, for the native aligner
SLOW_ITEMS = 20_000  # per producer, for the pure-Python ones (~20x slower)


class QueueAligner:
    """The alignment of ReferenceAligner over one ``queue.Queue`` per channel."""

    def __init__(self, channels: int, mode: str = "exactly-once", capacity: int = CAPACITY):
        self._queues = [queue.Queue(capacity) for _ in range(channels)]
        self._stash = [deque() for _ in range(channels)]  # entries already got, not taken
        self._alignment = _Alignment(channels, mode)

    def put(self, channel, item):
        self._queues[channel].put(item)

    def put_barrier(self, channel, snapshot_id, terminal=False):
        self._queues[channel].put(_Barrier(snapshot_id, terminal))

    def end(self, channel):
        self._queues[channel].put(_END)

    def _has(self, channel) -> bool:
        if self._stash[channel]:
            return True
        try:
            self._stash[channel].append(self._queues[channel].get_nowait())
        except queue.Empty:
            return False
        return True

    def _pop(self, channel):
        return self._stash[channel].popleft()

    def take(self):
        alignment = self._alignment
        while True:
            event = alignment.step(self._has, self._pop)
            if event is not None:
                return event
            # Nothing to take: wait a little on the channel the consumer would drain next.
            for i in range(alignment.channels):
                c = (alignment.rr + i) % alignment.channels
                if alignment.live[c] and not alignment.held[c]:
                    with contextlib.suppress(queue.Empty):
                        self._stash[c].append(self._queues[c].get(timeout=0.001))
                    break


# Producers and consumers, one item per call or in bulk. Each consumer returns
# (items, snapshots) it saw.


def produce_single(a, channel: int, items: int, every: int) -> None:
    segment = list(range(every))
    put = a.put
    for k, start in enumerate(range(0, items, every)):
        if k:
            a.put_barrier(channel, k - 1)
        for x in segment[:min(every, items - start)]:
            put(channel, x)
    a.end(channel)


def produce_bulk(a, channel: int, items: int, every: int) -> None:
    segment = list(range(every))
    for k, start in enumerate(range(0, items, every)):
        if k:
            a.put_barrier(channel, k - 1)
        a.put_many(channel, segment[:min(every, items - start)])
    a.end(channel)


def consume_single(a) -> tuple[int, int]:
    take = a.take
    items = snapshots = 0
    while True:
        event = take()
        kind = event[0]
        if kind is ITEM:
            items += 1
        elif kind is SNAPSHOT:
            snapshots += 1
        elif kind is DONE:
            return items, snapshots


def consume_bulk(a) -> tuple[int, int]:
    drain, take = a.drain, a.take
    items = snapshots = 0
    while True:
        events = drain(4096) or [take()]
        for event in events:
            kind = event[0]
            if kind is ITEM:
                items += 1
            elif kind is SNAPSHOT:
                snapshots += 1
        if events[-1][0] is DONE:
            return items, snapshots


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    make: Callable[[int, int], object]  # (channels, capacity) -> aligner
    produce: Callable
    consume: Callable
    items: int  # per producer
    note: str


SPARKJET = Method("sparkjet", lambda n, cap: BarrierAligner(n, capacity=cap),
                  produce_single, consume_single, FAST_ITEMS,
                  "BarrierAligner: put / put_barrier / end, take")
SPARKJET_BULK = Method("sparkjet bulk", lambda n, cap: BarrierAligner(n, capacity=cap),
                       produce_bulk, consume_bulk, FAST_ITEMS,
                       "BarrierAligner: put_many per segment, drain(4096)")
DEQUE = Method("deque + Lock", lambda n, cap: ReferenceAligner(n, capacity=cap),
               produce_single, consume_single, SLOW_ITEMS,
               "ReferenceAligner: deques, one Lock, Conditions; put / take")
DEQUE_BULK = Method("deque + Lock bulk", lambda n, cap: ReferenceAligner(n, capacity=cap),
                    produce_bulk, consume_bulk, SLOW_ITEMS,
                    "ReferenceAligner: put_many / drain(4096)")
QUEUE = Method("queue.Queue", lambda n, cap: QueueAligner(n, capacity=cap),
               produce_single, consume_single, SLOW_ITEMS,
               "queue.Queue per channel + the same state machine; put / get")
METHODS = [SPARKJET, SPARKJET_BULK, DEQUE, DEQUE_BULK, QUEUE]


def run_once(method: Method, producers: int, items: int, every: int, capacity: int) -> float:
    """One run; its wall time in seconds, after checking what came out."""
    a = method.make(producers, capacity)
    start = threading.Barrier(producers + 1)

    def producer(channel):
        start.wait()
        method.produce(a, channel, items, every)

    threads = [threading.Thread(target=producer, args=(c,)) for c in range(producers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    got_items, got_snapshots = method.consume(a)
    seconds = time.perf_counter() - t0
    for t in threads:
        t.join()
    expected = (producers * items, (items - 1) // every)
    if (got_items, got_snapshots) != expected:
        raise SystemExit(f"{method.label}: {got_items} items and {got_snapshots} snapshots, "
                         f"expected {expected[0]} and {expected[1]}; not timing a wrong answer")
    return seconds


@dataclasses.dataclass(frozen=True)
class Row:
    producers: int
    method: str
    items: int  # in one run, all producers
    ns_per_item: float
    note: str


def measure(method: Method, producers: int, rounds: int, scale: float = 1.0,
            every: int = EVERY, capacity: int = CAPACITY) -> Row:
    items = max(every, int(method.items * scale))
    run_once(method, producers, min(items, 10 * every), every, capacity)  # warm-up
    times = [run_once(method, producers, items, every, capacity) for _ in range(rounds)]
    total = producers * items
    return Row(producers, method.label, total, statistics.median(times) / total * 1e9,
               method.note)


def format_table(rows: list[Row]) -> str:
    """A Markdown table: ns/item, million items/s, and each method's speed relative to
    queue.Queue with the same number of producers."""
    base = {r.producers: r.ns_per_item for r in rows if r.method == QUEUE.label}
    header = ("producers", "method", "items timed", "ns/item", "M items/s", "× queue.Queue",
              "note")
    lines = [header]
    for r in rows:
        ratio = f"{base[r.producers] / r.ns_per_item:,.1f}" if r.producers in base else "—"
        lines.append((str(r.producers), r.method, f"{r.items:,}", f"{r.ns_per_item:,.0f}",
                      f"{1e3 / r.ns_per_item:,.2f}", ratio, r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    right = {0, 2, 3, 4, 5}

    def cells(line):
        return "| " + " | ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))
        ) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + ":" if i in right else "-" * (w + 2) for i, w in enumerate(widths)
    ) + "|"
    return "\n".join([cells(lines[0]), rule, *(cells(line) for line in lines[1:])])


def target_report(rows: list[Row]) -> str:
    """The issue's target (>= 10x queue.Queue in items/s), met or MISSED per row."""
    base = {r.producers: r.ns_per_item for r in rows if r.method == QUEUE.label}
    lines = [
        f"  {r.producers} producers, {r.method:<14} >= 10x queue.Queue "
        f"{base[r.producers] / r.ns_per_item:8.1f}x  "
        f"{'met' if base[r.producers] / r.ns_per_item >= 10 else 'MISSED'}"
        for r in rows
        if r.method in (SPARKJET.label, SPARKJET_BULK.label) and r.producers in base
    ]
    return "\n".join(["targets (from the issue):", *lines]) if lines else ""


def machine_summary() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{model}, {os.cpu_count()} CPUs, load average {load}; Python "
            f"{platform.python_version()}, sparkjet {sparkjet.__version__}, GIL switch "
            f"interval {1e3 * __import__('sys').getswitchinterval():.0f} ms")


def one_thread_ns(bulk: bool, items: int = FAST_ITEMS, every: int = EVERY) -> float:
    """ns/item with no thread at all: one thread pushes a segment, then takes it, with the
    same per-event loop as the consumers above. What is left of a threaded run's time
    beyond this is the cost of handing work between threads under the GIL."""
    a = BarrierAligner(1, capacity=every + 1)
    segment = list(range(every))
    t0 = time.perf_counter()
    for k in range(items // every):
        if bulk:
            a.put_many(0, segment)
            events = a.drain(every)
        else:
            put, take = a.put, a.take
            for x in segment:
                put(0, x)
            events = [take() for _ in range(every)]
        for event in events:
            kind = event[0]
            if kind is ITEM or kind is SNAPSHOT:
                pass
        a.put_barrier(0, k)
        a.take()
    return (time.perf_counter() - t0) / items * 1e9


# ---------------------------------------------------------------- pytest-benchmark mode


@pytest.fixture(scope="module")
def aligner_rows(bench_summaries):
    rows: list[Row] = []
    yield rows
    if rows:
        rows.sort(key=lambda r: (r.producers, METHODS.index(
            next(m for m in METHODS if m.label == r.method))))
        bench_summaries.append(
            "\n\n".join(filter(None, [machine_summary(), format_table(rows),
                                      target_report(rows)])))


@pytest.mark.parametrize("producers", PRODUCERS)
@pytest.mark.parametrize("method", METHODS, ids=[m.label.replace(" ", "-") for m in METHODS])
def test_aligner(benchmark, aligner_rows, method, producers):
    benchmark.group = f"barrier alignment, {producers} producers"
    items = method.items
    benchmark.extra_info["items"] = producers * items
    benchmark.pedantic(run_once, args=(method, producers, items, EVERY, CAPACITY), rounds=3,
                       warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        ns = benchmark.stats.stats.median / (producers * items) * 1e9
        benchmark.extra_info["ns_per_item"] = ns
        aligner_rows.append(Row(producers, method.label, producers * items, ns, method.note))


# ---------------------------------------------------------------- plain-module mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per row (3)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies the items per producer (200k native, 20k others)")
    parser.add_argument("--every", type=int, default=EVERY, help="items between barriers")
    parser.add_argument("--capacity", type=int, default=CAPACITY, help="entries per channel")
    parser.add_argument("--producers", type=int, nargs="+", default=list(PRODUCERS))
    args = parser.parse_args(argv)

    print(machine_summary(), flush=True)
    rows = []
    for producers in args.producers:
        for method in METHODS:
            rows.append(measure(method, producers, args.rounds, args.scale, args.every,
                                args.capacity))
            r = rows[-1]
            print(f"  {producers} producers  {method.label:<18} {r.ns_per_item:8.0f} ns/item",
                  flush=True)
    print()
    print(format_table(rows))
    print()
    print(target_report(rows))
    print()
    floors = [statistics.median(one_thread_ns(bulk) for _ in range(args.rounds))
              for bulk in (False, True)]
    print(f"one thread, no handoff: sparkjet {floors[0]:.0f} ns/item, sparkjet bulk "
          f"{floors[1]:.0f} ns/item")
    print(machine_summary())


if __name__ == "__main__":
    main()
