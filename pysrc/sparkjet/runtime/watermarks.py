"""Watermarks: how far event time has progressed, generated at the sources and carried in
band on every edge (Jet's watermarks).

A source processor tracks, per source partition, the greatest event time it has emitted;
its watermark is the least of those less the allowed lag, over the partitions that are not
idle (no event for ``idle_timeout`` seconds). When every partition is idle it sends
:data:`IDLE`, which tells the receiver to leave the channel out of its minimum until a
watermark comes again; when its reader is exhausted it sends :data:`MAX_TIME`, which closes
every window. A processor with several input channels is at the least watermark of its
channels that are not idle (:class:`WatermarkTracker`). Watermarks only grow.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from sparkjet.operators.time import MAX_TIME, MIN_TIME
from sparkjet.partitioning import partition_ids


class Watermark(NamedTuple):
    """An in-band watermark: no event older than ``time`` follows on this channel (or, with
    ``idle``, the channel is idle and holds nobody back)."""

    time: int
    idle: bool = False


IDLE = Watermark(MIN_TIME, True)


class WatermarkTracker:
    """The watermark of a processor with ``channels`` inputs: the least of its inputs that
    are not idle. :meth:`update` returns the new watermark when it changed (or ``IDLE``
    when every input became idle), else None."""

    def __init__(self, channels: int, start: int = MIN_TIME):
        self._times = np.full(max(channels, 1), start, np.int64)
        self._idle = np.zeros(max(channels, 1), bool)
        self.current = start
        self.idle = False

    def update(self, channel: int, mark: Watermark) -> Watermark | None:
        if mark.idle:
            self._idle[channel] = True
        else:
            self._idle[channel] = False
            if mark.time > self._times[channel]:
                self._times[channel] = mark.time
        if self._idle.all():
            if self.idle:
                return None
            self.idle = True
            return IDLE
        low = int(self._times[~self._idle].min())
        was_idle, self.idle = self.idle, False
        if low > self.current:
            self.current = low
            return Watermark(low)
        if was_idle:
            return Watermark(self.current)
        return None


class PartitionFloors:
    """What a restarted keyed processor knows about the watermark its partitions had
    reached before the restart, by Hazelcast partition.

    Each processor saves its watermark with the partitions it owned. After a restart (or
    a rescale) a processor starts at the least of those over its partitions, so that no
    window of any of them fires early; but a partition whose old owner was further on had
    already fired (and evicted) the windows below its own watermark. Under at-least-once a
    replayed event of such a partition must not open those windows again (it would emit a
    window holding only the replayed events): :meth:`of` gives each row the watermark of its
    partition's old owner, and the operator treats rows below it as it treated them then.
    Under exactly-once no replayed event is below it, so this changes nothing.
    """

    def __init__(self, floors: np.ndarray, partition_count: int, key):
        self.floors = floors
        self.partition_count = partition_count
        self.key = key
        self.top = int(floors.max()) if len(floors) else MIN_TIME

    @classmethod
    def from_saved(cls, saved: list, mine: list[int], partition_count: int, key):
        """``saved``: the processors' saved entries, ``{"time": t, "partitions": [...]}``
        (or a bare time, from before partitions were saved: it counts for every partition).
        Returns ``(start, floors)``: the least watermark over ``mine``, and the floors when
        some partition of ``mine`` was further on (else None)."""
        if not saved:
            return MIN_TIME, None
        floors = np.full(partition_count, MIN_TIME, np.int64)
        bare = [s for s in saved if not isinstance(s, dict)]
        if bare:
            floors[:] = min(bare)
        for s in saved:
            if isinstance(s, dict):
                parts = np.asarray(s["partitions"], np.int64)
                parts = parts[(parts >= 0) & (parts < partition_count)]
                floors[parts] = s["time"] if not bare else min(int(s["time"]), min(bare))
        mine_floors = floors[np.asarray(mine, np.int64)] if mine else floors[:0]
        start = int(mine_floors.min()) if len(mine_floors) else MIN_TIME
        if not len(mine_floors) or int(mine_floors.max()) == start:
            return start, None
        kept = np.full(partition_count, MIN_TIME, np.int64)
        kept[np.asarray(mine, np.int64)] = mine_floors
        return start, cls(kept, partition_count, key)

    def of(self, batch, key=None) -> np.ndarray:
        """The floor of each row of ``batch``: its partition's old watermark (``key``: the
        batch's key columns, when its input has its own)."""
        pids = partition_ids(batch, self.partition_count,
                             key=self.key if key is None else key).to_numpy()
        return self.floors[pids]


class SourceWatermarks:
    """The watermark of a source processor reading ``partitions`` (None in the list: a
    reader that does not say which partition a batch came from, tracked as one)."""

    def __init__(self, partitions: list, max_lag: int, idle_timeout: float, *, clock=time.monotonic):
        self.max_lag = max_lag
        self.idle_timeout = idle_timeout
        self._clock = clock
        now = clock()
        self._max: dict = dict.fromkeys(partitions)
        self._seen = dict.fromkeys(partitions, now)
        self.sent: Watermark | None = None
        self.ended = False

    def restore(self, saved: dict | None) -> None:
        """Continues from the greatest times a snapshot saved (by partition)."""
        for p, t in (saved or {}).items():
            key = int(p) if p != "None" else None
            if key in self._max and t is not None:
                old = self._max[key]
                self._max[key] = t if old is None else max(old, t)

    def state(self) -> dict:
        return {str(p): t for p, t in self._max.items() if t is not None}

    def observe(self, partition, times: np.ndarray) -> None:
        if partition not in self._max:
            partition = next(iter(self._max))
        if len(times):
            top = int(times.max())
            old = self._max[partition]
            self._max[partition] = top if old is None else max(old, top)
        self._seen[partition] = self._clock()

    def newest(self) -> int | None:
        """The greatest event time read from any partition (None before the first)."""
        seen = [t for t in self._max.values() if t is not None]
        return max(seen) if seen else None

    def current(self) -> Watermark:
        if self.ended:
            return Watermark(MAX_TIME)
        now = self._clock()
        active = [p for p in self._max if now - self._seen[p] < self.idle_timeout]
        if not active:
            return IDLE
        if any(self._max[p] is None for p in active):
            return Watermark(MIN_TIME)
        low = min(self._max[p] for p in active)
        return Watermark(max(MIN_TIME, low - self.max_lag))

    def due(self) -> Watermark | None:
        """The watermark to send now, if it differs from the last one sent."""
        w = self.current()
        if self.sent is not None and not w.idle and not self.sent.idle and w.time <= self.sent.time:
            return None
        if w == self.sent or (w.time == MIN_TIME and not w.idle and self.sent is None):
            return None
        self.sent = w
        return w


__all__ = ["IDLE", "MAX_TIME", "MIN_TIME", "PartitionFloors", "SourceWatermarks", "Watermark", "WatermarkTracker"]
