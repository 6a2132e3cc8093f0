"""NEXMark's auction events (persons, auctions, bids) as a deterministic, replayable source.

The global event sequence follows the NEXMark generator of Apache Beam and nexmark-flink:
of every 50 events (event ``i`` at offset ``i % 50``), offset 0 is a person, 1..3 are
auctions and 4..49 are bids. Persons and auctions take increasing ids from 1000 (the
person at event ``i`` is ``1000 + i // 50``, the auction ``1000 + 3 * (i // 50) + i % 50 -
1``). A bid goes with probability ``1 - 1/hot_auction_ratio`` to the hot auction (the first
of the newest batch of 100 auctions), otherwise to one of the ``auctions`` newest ones or up
to 10 not yet created (Beam's ``AUCTION_ID_LEAD``, so that joins see a bid before its
auction); its bidder likewise (``hot_bidder_ratio``, the second person of the newest batch
of 100, ``people`` active persons, a lead of 10). An auction's seller is chosen the same way
(``hot_seller_ratio``, the first person of the batch). Prices are log-uniform cents,
``round(10 ** (6u) * 100)``. Bids carry nexmark-flink's ``channel`` and ``url`` (half the
bids on four hot channels, the others on 10,000 channels).

Event ``i``'s time is ``first_event_time_ms + i * 1000 // events_per_second`` (an event
clock, not the wall clock), minus a jitter uniform in ``0..out_of_order_ms``. Every column
of event ``i`` depends on ``(seed, i)`` and the parameters only, computed with numpy from
the index (splitmix64 draws, :mod:`sparkjet.connectors.nexmark.events`).

Departures from Beam's generator, all on purpose:

- the random draws are splitmix64's, not ``java.util.Random``'s: the same rules and
  distributions, not Beam's values;
- out-of-order events are a bounded jitter per event, not Beam's shuffled groups;
- random text (names, descriptions, e-mail addresses, extras, URLs) is picked from tables
  made once per seed, with NEXMark's lengths and characters (a few dozen to a few hundred
  strings per length): fresh text per row would cost more than the rest of the event;
- a bid's hot odds come from 16 random bits (exact for the default ratios, powers of two;
  within 2**-16 of ``1 - 1/ratio`` otherwise) and its price from 32;
- a bidder is offset by 1000 once (nexmark-flink's channel version adds it twice);
- the default ``auctions`` (in flight) is 1000; Beam's ``numInFlightAuctions`` is 100.

**Partitions and offsets.** Source partition ``p`` of ``P`` holds the events ``i`` with
``i % P == p`` of the source's ``kind``, in index order (a partition may hold none: with
``P = 50``, partition 0 holds only persons). A partition's offset is the number of its
events emitted, and a reader's state is ``{"offsets": {"<partition>": n}, "next":
<partition>}``, as for :class:`~sparkjet.sources.GeneratorSource`: states merge by uniting
offsets, so any snapshot restores at any parallelism, and a replay repeats the same batches.
``total`` bounds the *global* sequence (all kinds), so sources of different kinds with the
same ``total`` cover the same stretch of event time.

Speed (``bench/bench_nexmark_source.py``): 6 to 8.7 M bids/s from one reader on one core,
about 3 M auctions/s and 2 M persons/s (16 and 46 times rarer than bids in the stream).

>>> bids = NexmarkSource(total=100, partitions=2)
>>> [bids.partition_size(p) for p in range(2)]
[46, 46]
>>> NexmarkSource(kind="auction").events(0, 100).column("id").to_pylist()
[1000, 1001, 1002, 1003, 1004, 1005]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import pyarrow as pa
from msgspec import Meta

from sparkjet._checks import check_int
from sparkjet.connectors._settings import (
    BySettings,
    Count,
    PositiveNumber,
    Settings,
    SourcePartitions,
)
from sparkjet.connectors.base import ProcessorContext, Source
from sparkjet.connectors.generator import SEED, GeneratorReader
from sparkjet.connectors.nexmark import events as model
from sparkjet.errors import InvalidArgumentError

KINDS = ("bid", "auction", "person")
SCHEMAS = dict(model.SCHEMAS)
"""The schema of each kind's batches (``date_time`` and ``expires`` are UTC, in ms)."""
FIRST_EVENT_TIME_MS = 1_767_225_600_000
"""2026-01-01T00:00:00Z, the default time of event 0."""
# Indices stay below this so that i * 1000 and the draws' arithmetic fit in 64 bits.
MAX_INDEX = 2**53


@dataclass(frozen=True)
class NexmarkSourceSettings(Settings):
    """:class:`NexmarkSource`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    kind: Literal["bid", "auction", "person"] = "bid"   # KINDS
    total: Annotated[int, Meta(ge=0, le=MAX_INDEX)] | None = None
    partitions: SourcePartitions = 4
    events_per_second: Annotated[int, Meta(ge=1, le=10**9)] = 10_000
    first_event_time_ms: Annotated[int, Meta(ge=-2**47, le=2**47)] = FIRST_EVENT_TIME_MS
    out_of_order_ms: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    batch_size: Count = 65536
    rate: PositiveNumber | None = None
    seed: Annotated[int, Meta(ge=0, description=SEED)] = 0
    people: Count = 1000
    auctions: Count = 1000
    hot_auction_ratio: Count = 2
    hot_bidder_ratio: Count = 4
    hot_seller_ratio: Count = 4

    def check(self) -> None:
        if self.seed > 2**64 - 1:
            raise self._refuse("seed", SEED)


class NexmarkSource(BySettings, Source):
    """NEXMark's ``kind`` events ("bid", "auction" or "person") of the global sequence,
    bounded by ``total`` global events (None: unbounded), in ``partitions`` partitions;
    replayable by offset, as fast as possible or at ``rate`` rows per second (wall clock)
    over all partitions. ``batch_size`` caps the rows of one batch (one partition per
    batch; partitions take turns).

    >>> NexmarkSource(total=1000, partitions=4)  # doctest: +NORMALIZE_WHITESPACE
    NexmarkSource(kind='bid', total=1000, partitions=4, events_per_second=10000,
    first_event_time_ms=1767225600000, out_of_order_ms=0, batch_size=65536, rate=None,
    seed=0, people=1000, auctions=1000, hot_auction_ratio=2, hot_bidder_ratio=4,
    hot_seller_ratio=4)
    """

    name = "nexmark"
    replayable = True
    acknowledging = False

    settings_type = NexmarkSourceSettings

    def __init__(self, kind: str = "bid", total: int | None = None, partitions: int = 4,
                 events_per_second: int = 10_000,
                 first_event_time_ms: int = FIRST_EVENT_TIME_MS, out_of_order_ms: int = 0,
                 batch_size: int = 65536, rate: float | None = None, seed: int = 0,
                 people: int = 1000, auctions: int = 1000, hot_auction_ratio: int = 2,
                 hot_bidder_ratio: int = 4, hot_seller_ratio: int = 4):
        NexmarkSourceSettings.of(locals()).apply(self)

    @property
    def schema(self) -> pa.Schema:
        """The schema of this source's batches."""
        return SCHEMAS[self.kind]

    def partition_count(self) -> int:
        return self.partitions

    def open(self, partitions: list[int], context: ProcessorContext) -> NexmarkReader:
        return NexmarkReader(self, partitions)

    def _layout(self, partition: int) -> tuple[int, np.ndarray]:
        """The period ``L`` of event kinds along partition ``partition`` (its n-th event is
        global event ``partition + n * P``, whose kind depends on it modulo 50) and the
        positions ``n`` in ``0..L-1`` that hold this source's kind."""
        check_int("partition", partition, min=0, max=self.partitions - 1)
        period = model.PROPORTION_DENOMINATOR // math.gcd(self.partitions,
                                                          model.PROPORTION_DENOMINATOR)
        n = np.arange(period, dtype=np.int64)
        offset = (partition + n * self.partitions) % model.PROPORTION_DENOMINATOR
        low, high = model.KIND_OFFSETS[self.kind]
        return period, n[(offset >= low) & (offset < high)]

    def partition_size(self, partition: int) -> int | None:
        """How many events of this kind partition ``partition`` holds (None: unbounded)."""
        period, positions = self._layout(partition)
        if self.total is None:
            return None if len(positions) else 0
        slots = max(0, -(-(self.total - partition) // self.partitions))
        full, rest = divmod(slots, period)
        return full * len(positions) + int(np.searchsorted(positions, rest))

    def partition_indices(self, partition: int, start: int, stop: int) -> np.ndarray:
        """The global indices (int64) of partition ``partition``'s events ``start..stop-1``.

        >>> NexmarkSource(partitions=4).partition_indices(1, 0, 5).tolist()
        [5, 9, 13, 17, 21]
        """
        period, positions = self._layout(partition)
        start = check_int("start", start, min=0, max=MAX_INDEX)
        stop = check_int("stop", stop, min=start, max=MAX_INDEX)
        if stop > start and not len(positions):
            raise InvalidArgumentError(
                f"nexmark partition {partition} of {self.partitions} holds no {self.kind}s")
        if stop == start:
            return np.zeros(0, dtype=np.int64)
        # Whole periods of positions, then the slice wanted: no division per event.
        first, last = start // len(positions), (stop - 1) // len(positions)
        runs = np.arange(first, last + 1, dtype=np.int64) * (period * self.partitions)
        steps = positions * self.partitions + partition
        spread = np.add(runs[:, None], steps[None, :],
                        out=model.empty(len(runs) * len(steps)).reshape(len(runs), -1)).ravel()
        skip = start - first * len(positions)
        return spread[skip:skip + stop - start]

    def events(self, start: int, stop: int) -> pa.Table:
        """The events of this kind among global indices ``start..stop-1``, in index order
        (what a failure-free run reads, whatever the partitions).

        >>> NexmarkSource(kind="person").events(0, 101).column("id").to_pylist()
        [1000, 1001, 1002]
        """
        start = check_int("start", start, min=0, max=MAX_INDEX)
        stop = check_int("stop", stop, min=start, max=MAX_INDEX)
        ids = np.arange(start, stop, dtype=np.int64)
        low, high = model.KIND_OFFSETS[self.kind]
        offset = ids % model.PROPORTION_DENOMINATOR
        return pa.Table.from_batches([self._batch(ids[(offset >= low) & (offset < high)])])

    def _batch(self, ids: np.ndarray) -> pa.RecordBatch:
        return model.EVENTS[self.kind](ids, self)


class NexmarkReader(GeneratorReader):
    """Reads some partitions of a :class:`NexmarkSource`: a
    :class:`~sparkjet.sources.GeneratorReader` (same turns between partitions, offsets,
    rate limit and state) whose rows are NEXMark events."""

    def _emit(self, partition: int, offset: int, count: int) -> pa.RecordBatch:
        source = self._source
        batch = source._batch(source.partition_indices(partition, offset, offset + count))
        self._offsets[partition] = offset + count
        self._emitted += count
        return batch
