"""A deterministic, replayable event generator: the source of tests, benchmarks and the
fault campaign.

Event ``i`` (its global index, from 0) belongs to source partition ``i % partitions`` and
is the ``n``-th event of that partition for ``n = i // partitions``. Its columns:

=========  ======================  ====================================================
``id``     int64                   ``i``
``key``    int64                   ``(h >> 32) * keys >> 32`` with ``h = splitmix64(i ^ seed)``
                                   (Lemire's multiply-shift reduction: uniform over
                                   ``0..keys-1``, without a slow 64-bit modulo)
``value``  float64                 ``h & 1023``: an integer-valued float, so sums are
                                   exact whatever order they are taken in
``ts``     timestamp[ns, UTC]      when the event was created (for latency): its
                                   scheduled time with a rate limit, else the read time
=========  ======================  ====================================================

``id``, ``key`` and ``value`` depend on ``i`` and ``seed`` only: :meth:`GeneratorSource.events`
and :meth:`GeneratorSource.expected_counts` give what a failure-free run sees, cheaply.

**Offsets** are per partition the number of events emitted from it. A reader's
:meth:`~GeneratorReader.snapshot_state` is ``{"offsets": {"<partition>": n, ...}, "next":
<partition>}`` (string keys, so it survives a JSON round trip; ints are accepted back;
``next`` is the partition whose turn is next, so that a replay repeats the same batches).
The states of several readers merge by uniting their ``offsets``, so any snapshot restores
at any parallelism.

>>> source = GeneratorSource(total=10, partitions=2)
>>> source.events(0, 4).column("id").to_pylist()
[0, 1, 2, 3]
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import pyarrow as pa
from msgspec import Meta

from sparkjet._checks import check_distinct_ints, check_int
from sparkjet.connectors._settings import (
    BySettings,
    Count,
    PositiveNumber,
    Settings,
    SourcePartitions,
)
from sparkjet.connectors.base import ProcessorContext, Source, SourceReader
from sparkjet.errors import InvalidArgumentError

_U = np.uint64
_GOLDEN = _U(0x9E3779B97F4A7C15)
_MIX1 = _U(0xBF58476D1CE4E5B9)
_MIX2 = _U(0x94D049BB133111EB)
_TS = pa.timestamp("ns", "UTC")
# Events per chunk in expected_counts: bounds its temporaries (~150 MB), not its result.
_COUNT_CHUNK = 1 << 22
# Up to this many keys expected_counts uses dense per-key arrays (numpy bincount).
_DENSE_KEYS = 1 << 24

SEED = "an int in 0..2**64 - 1"

SCHEMA = pa.schema([("id", pa.int64()), ("key", pa.int64()), ("value", pa.float64()),
                    ("ts", _TS)])
"""The schema of every batch a :class:`GeneratorReader` returns."""


def mix64(h: np.ndarray, t: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array, in place (``t``: a scratch array of its
    shape, or None); NEXMark's draws use it too (:mod:`sparkjet.connectors.nexmark.events`)."""
    t = np.right_shift(h, _U(30), out=t)
    h ^= t
    h *= _MIX1
    np.right_shift(h, _U(27), out=t)
    h ^= t
    h *= _MIX2
    np.right_shift(h, _U(31), out=t)
    h ^= t
    return h


@dataclass(frozen=True)
class GeneratorSourceSettings(Settings):
    """:class:`GeneratorSource`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    total: Annotated[int, Meta(ge=0, le=2**62)] | None = None
    partitions: SourcePartitions = 4
    keys: Annotated[int, Meta(ge=1, le=2**32)] = 1_000_000
    rate: PositiveNumber | None = None      # events per second
    batch_size: Count = 65536
    seed: Annotated[int, Meta(ge=0, description=SEED)] = 0

    def check(self) -> None:
        if self.seed > 2**64 - 1:
            raise self._refuse("seed", SEED)


class GeneratorSource(BySettings, Source):
    """Deterministic events, replayable by offset, bounded (``total``) or not (None),
    as fast as possible or at ``rate`` events per second over all partitions.

    ``batch_size`` caps the rows of one batch (a read returns at most
    ``min(max_rows, batch_size)`` rows, all from one partition; partitions take turns).

    >>> GeneratorSource(total=1000, partitions=4, keys=10)
    GeneratorSource(total=1000, partitions=4, keys=10, rate=None, batch_size=65536, seed=0)
    """

    name = "generator"
    replayable = True
    acknowledging = False

    settings_type = GeneratorSourceSettings

    def __init__(self, total: int | None = None, partitions: int = 4, keys: int = 1_000_000,
                 rate: float | None = None, batch_size: int = 65536, seed: int = 0):
        GeneratorSourceSettings.of(locals()).apply(self)

    def partition_count(self) -> int:
        return self.partitions

    def partition_size(self, partition: int) -> int | None:
        """How many events partition ``partition`` holds (None: unbounded)."""
        check_int("partition", partition, min=0, max=self.partitions - 1)
        if self.total is None:
            return None
        return max(0, -(-(self.total - partition) // self.partitions))

    def open(self, partitions: list[int], context: ProcessorContext) -> GeneratorReader:
        return GeneratorReader(self, partitions)

    def events(self, start: int, stop: int) -> pa.Table:
        """The ``id``, ``key`` and ``value`` columns of the events with global index in
        ``start..stop-1`` (what a failure-free run reads, without ``ts``).

        >>> GeneratorSource(keys=10).events(5, 7).to_pylist()
        [{'id': 5, 'key': 3, 'value': 858.0}, {'id': 6, 'key': 7, 'value': 0.0}]
        """
        start = check_int("start", start, min=0, max=2**62)
        stop = check_int("stop", stop, min=start, max=2**62)
        ids = np.arange(start, stop, dtype=np.int64)
        key, value = self._key_value(ids)
        return pa.table({"id": ids, "key": key, "value": value})

    def expected_counts(self, stop: int | None = None, start: int = 0) -> pa.Table:
        """Per key, the ``count`` of events and the ``sum`` of their ``value`` over the
        global indexes ``start..stop-1`` (``stop`` defaults to ``total``), sorted by key;
        keys without events are absent. Vectorized, tens of millions of events per second;
        in bounded memory up to 2**24 keys, beyond that 8 bytes per event.

        >>> GeneratorSource(keys=3).expected_counts(6).to_pylist()
        [{'key': 0, 'count': 1, 'sum': 1005.0}, {'key': 1, 'count': 4, 'sum': 2483.0}, \
{'key': 2, 'count': 1, 'sum': 431.0}]
        """
        if stop is None:
            if self.total is None:
                raise InvalidArgumentError("expected_counts of an unbounded generator needs stop")
            stop = self.total
        start = check_int("start", start, min=0, max=2**62)
        stop = check_int("stop", stop, min=start, max=2**62)
        if stop == start:
            return pa.table({"key": pa.array([], pa.int64()), "count": pa.array([], pa.int64()),
                             "sum": pa.array([], pa.float64())})
        if self.keys <= _DENSE_KEYS:
            counts = np.zeros(self.keys, dtype=np.int64)
            sums = np.zeros(self.keys, dtype=np.float64)
            for lo in range(start, stop, _COUNT_CHUNK):
                key, value = self._key_value(
                    np.arange(lo, min(stop, lo + _COUNT_CHUNK), dtype=np.int64))
                counts += np.bincount(key, minlength=self.keys)
                sums += np.bincount(key, weights=value, minlength=self.keys)
            present = np.flatnonzero(counts)
            return pa.table({"key": present.astype(np.int64), "count": counts[present],
                             "sum": sums[present]})
        # Many keys: one sort of (key << 10 | value) words, 8 bytes per event; numpy's
        # vectorized sort of int64 is ~10x faster than a hash group-by here.
        packed = np.empty(stop - start, dtype=np.int64)
        for lo in range(start, stop, _COUNT_CHUNK):
            hi = min(stop, lo + _COUNT_CHUNK)
            key, value = self._key_value(np.arange(lo, hi, dtype=np.int64))
            np.bitwise_or(key << 10, value.astype(np.int64), out=packed[lo - start:hi - start])
        packed.sort()
        keys = packed >> 10
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        counts = np.diff(np.append(starts, len(keys))).astype(np.int64)
        sums = np.add.reduceat((packed & 1023).astype(np.float64), starts)
        return pa.table({"key": keys[starts], "count": counts, "sum": sums})

    def _key_value(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``key`` and ``value`` of the events ``ids`` (int64), in place on one copy."""
        h = ids.view(_U) ^ _U(self.seed)
        h += _GOLDEN
        # one scratch array instead of a temporary per step
        t = np.empty_like(h)
        mix64(h, t)
        np.bitwise_and(h, _U(1023), out=t)
        value = t.view(np.int64).astype(np.float64)  # int64 converts faster than uint64
        h >>= _U(32)
        h *= _U(self.keys)
        h >>= _U(32)
        return h.view(np.int64), value


class GeneratorReader(SourceReader):
    """Reads some partitions of a :class:`GeneratorSource`, taking turns between them."""

    def __init__(self, source: GeneratorSource, partitions: list[int]):
        self._source = source
        self._partitions = check_distinct_ints("partitions", partitions, min=0,
                                               max=source.partitions - 1)
        self._offsets = dict.fromkeys(self._partitions, 0)
        self._sizes = {p: source.partition_size(p) for p in self._partitions}
        self._turn = 0
        self._last: int | None = None
        # This reader's share of the overall rate, and its schedule: the events it may
        # have emitted by now, counted from the first read after opening or restoring.
        self._rate = (source.rate * len(self._partitions) / source.partitions
                      if source.rate is not None else None)
        self._start_mono: float | None = None
        self._start_wall_ns = 0
        self._emitted = 0
        self._caught_up = False

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        """The next events of one partition (the next one in turn that has any), at most
        ``min(max_rows, batch_size)``; None when every partition is exhausted or the rate
        limit allows nothing yet."""
        check_int("max_rows", max_rows, min=1, max=2**62)
        rows = min(max_rows, self._source.batch_size)
        if self._rate is not None:
            now = time.monotonic()
            if self._start_mono is None:
                self._start_mono, self._start_wall_ns = now, time.time_ns()
            allowed = int(self._rate * (now - self._start_mono)) - self._emitted
            self._caught_up = allowed <= rows
            if allowed <= 0:
                return None
            rows = min(rows, allowed)
        n = len(self._partitions)
        for step in range(n):
            p = self._partitions[(self._turn + step) % n]
            size, offset = self._sizes[p], self._offsets[p]
            if size is not None and offset >= size:
                continue
            count = rows if size is None else min(rows, size - offset)
            self._turn = (self._turn + step + 1) % n
            self._last = p
            return self._emit(p, offset, count)
        return None

    def last_partition(self) -> int | None:
        return self._last

    def caught_up(self) -> bool:
        """At a rate: the last read gave every event its schedule allowed by then."""
        return self._caught_up

    def _emit(self, partition: int, offset: int, count: int) -> pa.RecordBatch:
        source = self._source
        first = partition + offset * source.partitions
        ids = np.arange(first, first + count * source.partitions, source.partitions,
                        dtype=np.int64)
        key, value = source._key_value(ids)
        if self._rate is None:
            ts = np.full(count, time.time_ns(), dtype=np.int64)
        else:
            # Each event's scheduled creation time: latency then includes any time it
            # waited in the source because the pipeline was slow (no coordinated omission).
            seq = np.arange(self._emitted, self._emitted + count, dtype=np.float64)
            ts = (seq * (1e9 / self._rate)).astype(np.int64) + self._start_wall_ns
        self._offsets[partition] = offset + count
        self._emitted += count
        return pa.RecordBatch.from_arrays(
            [pa.array(ids), pa.array(key), pa.array(value), pa.array(ts).view(_TS)],
            schema=SCHEMA)

    def at_end(self) -> bool:
        return all(size is not None and self._offsets[p] >= size
                   for p, size in self._sizes.items())

    def snapshot_state(self) -> dict:
        return {"offsets": {str(p): n for p, n in self._offsets.items()},
                "next": self._partitions[self._turn] if self._partitions else None}

    def restore_state(self, state: dict | None) -> None:
        """Seeks every partition of this reader to its offset in ``state`` (None: to 0).
        ``state`` may hold more partitions (another reader's) but must hold all of ours."""
        if state is None:
            offsets = dict.fromkeys(self._partitions, 0)
        else:
            offsets = _offsets_of(state, self._partitions)
        self._offsets = {p: check_int(f"offset of generator partition {p}", n, min=0,
                                      max=self._sizes[p]) for p, n in offsets.items()}
        self._turn = _turn_of(state, self._partitions)
        self._start_mono = None
        self._emitted = 0


def _turn_of(state: dict | None, partitions: list[int]) -> int:
    # The partition whose turn it was, so that a replay repeats the original batches
    # exactly; after a rescale it may belong to another reader (then start anywhere).
    nxt = state.get("next") if isinstance(state, dict) else None
    return partitions.index(nxt) if nxt in partitions else 0


def _offsets_of(state: dict, partitions: list[int]) -> dict:
    saved = state.get("offsets") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        raise InvalidArgumentError(
            f"a generator state is {{'offsets': {{partition: count}}}}, got {state!r}")
    out = {}
    for p in partitions:
        n = saved.get(str(p), saved.get(p))
        if n is None:
            raise InvalidArgumentError(
                f"the state has no offset for generator partition {p} "
                f"(it holds partitions {sorted(saved, key=int)})")
        out[p] = n
    return out
