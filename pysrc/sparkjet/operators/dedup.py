"""Deduplication by key within a span of event time.

>>> stream.with_timestamps("ts", max_lag=5_000).deduplicate("event_id", within=600_000)  # doctest: +SKIP

The first event of each key passes; a later event of that key passes only once it is
``within`` (event time) after the one that passed, and then takes its place. A key's entry
is evicted when the watermark is ``within`` past it, so memory holds the keys seen in the
last ``within``. An event behind the watermark cannot be checked (its key's entry may be
gone): it is a late event, counted and handed to the optional ``late_events`` sink, never
passed as new. The entries are saved by Hazelcast partition in every snapshot, so under
exactly-once a replayed event is not passed twice to the committed output.

For a key of one integer column (the common case: an event id) the whole batch is decided
in one native pass over its rows (:class:`sparkjet._native.DedupMap`, a hash map from key
to the time that passed), and entries past the watermark are dropped lazily when the map
would grow. Other keys take a native key lookup and native scatter-min/max by key slot
(each key's first row and latest time in the batch): no sort and no per-row Python, except
for a key repeated in one batch over more than ``within``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet.connectors.base import Sink
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.base import Operator, OperatorStage
from sparkjet.operators.groups import Groups
from sparkjet.operators.time import MIN_TIME, EventTimeColumn, in_units

_NONE = MIN_TIME
_MAX = np.iinfo(np.int64).max
_MIN = np.iinfo(np.int64).min


@dataclass(frozen=True)
class DeduplicateStage(OperatorStage):
    keys: tuple = ()
    within: object = None            # int (the time column's unit) or timedelta
    late: Sink | None = None

    kind = "dedup"
    event_time = True
    keeps_time = True                # its output rows are input rows: same event time

    def describe(self) -> dict:
        return {"within": str(self.within)}

    def make_operator(self, time_column):
        return DeduplicateOperator(self, time_column)


class DeduplicateOperator(Operator):
    def __init__(self, stage: DeduplicateStage, time_column: str):
        self.stage = stage
        self.keys = list(stage.keys)
        self.state_key = stage.key
        self.groups = Groups(self.keys)
        self.passed = np.zeros(0, np.int64)   # per slot: the time of the event that passed
        self._first = np.zeros(0, np.int64)   # scratch per slot: a batch's first row
        self._latest = np.zeros(0, np.int64)  # scratch per slot: a batch's latest time
        self.watermark = MIN_TIME
        # in the time column's unit (an int is; a timedelta once the column's type is known)
        self.within: int | None = stage.within if isinstance(stage.within, int) else None
        self._time = EventTimeColumn(time_column)
        #: the native map of a one-integer-column key (made at the first batch or restore
        #: that shows such a key; None for other keys)
        self._map: _native.DedupMap | None = None

    def __len__(self) -> int:
        """How many keys are remembered."""
        if self._map is not None:
            return self._map.live(self._evict_below())
        return int((self.passed[: len(self.groups)] != _NONE).sum())

    @property
    def held(self) -> int:
        """How many keys are in memory, those that may still be evicted included: what
        bounds the operator's memory."""
        return len(self._map) if self._map is not None else len(self.groups)

    def _evict_below(self) -> int:
        """The passed time below which an entry is gone: past ``watermark - within``."""
        if self.watermark == MIN_TIME or self.within is None:
            return _MIN
        return max(_MIN, min(_MAX, self.watermark - self.within + 1))

    def _native_map(self, bits: np.ndarray | None) -> _native.DedupMap | None:
        if bits is not None and self._map is None:
            self._map = _native.DedupMap(0)
        return self._map if bits is not None else None

    def process(self, batch: pa.RecordBatch):
        if batch.num_rows == 0:
            return [], None
        ts = self._times(batch)
        late = None
        if self.watermark != MIN_TIME:
            behind = ts < self.watermark
            if behind.any():
                late = batch.filter(pa.array(behind))
                batch, ts = batch.filter(pa.array(~behind)), ts[~behind]
                if batch.num_rows == 0:
                    return [], late
        bits = self.groups.int_bits(batch)
        native = self._native_map(bits)
        if native is not None:
            keep = np.empty(len(ts), np.uint8)
            kept = native.process(bits, np.ascontiguousarray(ts, np.int64), self.within,
                                  self._evict_below(), keep)
            out = batch if kept == len(ts) else batch.filter(pa.array(keep.view(bool)))
            return ([out] if out.num_rows else []), late
        slots = self.groups.slots(batch)
        self._grow(len(self.groups))
        # Each key's first row and latest time in the batch, by native scatter-min/max
        # into scratch arrays indexed by slot (reset after): O(rows), no sort.
        rows = np.arange(len(ts), dtype=np.int64)
        _native.agg_min_i64(slots, rows, self._first)
        is_first = self._first[slots] == rows
        uniq, first = slots[is_first], rows[is_first]
        _native.agg_max_i64(slots, ts, self._latest)
        latest = self._latest[uniq]
        self._first[uniq] = _MAX
        self._latest[uniq] = _MIN
        before = self.passed[uniq]
        t0 = ts[first]
        ok = (before == _NONE) | (t0 >= before + self.within)
        keep = np.zeros(len(ts), bool)
        keep[first[ok]] = True
        last = np.where(ok, t0, before)
        # A key whose later rows in the batch reach `within` past the one that passed:
        # those rows are decided one by one (rare: a key repeated over a long span).
        for i in np.flatnonzero(latest >= last + self.within).tolist():
            t = last[i]
            for r in np.flatnonzero(slots == uniq[i]).tolist():
                if r > first[i] and ts[r] >= t + self.within:
                    keep[r] = True
                    t = ts[r]
            last[i] = t
        self.passed[uniq] = last
        out = batch if keep.all() else batch.filter(pa.array(keep))
        return ([out] if out.num_rows else []), late

    def advance(self, watermark: int) -> list[pa.RecordBatch]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        if self.within is None or self._map is not None:   # the native map evicts lazily
            return []
        n = len(self.groups)
        passed = self.passed[:n]
        gone = (passed != _NONE) & (passed <= watermark - self.within)
        if gone.any():
            passed[gone] = _NONE
            self._compact()
        return []

    def _compact(self) -> None:
        n = len(self.groups)
        live = np.flatnonzero(self.passed[:n] != _NONE)
        if n - len(live) <= len(live) + 65536:
            return
        self.groups = self.groups.kept(live)
        self.passed = self.passed[live]

    def snapshot(self) -> pa.Table | None:
        if self._map is not None:
            limit = self._evict_below()
            keys = np.empty(self._map.live(limit), np.int64)
            passed = np.empty(len(keys), np.int64)
            got = self._map.export(limit, keys, passed)
            if not got:
                return None
            return self.groups.int_key_table(keys[:got]).append_column(
                "__passed", pa.array(passed[:got]))
        n = len(self.groups)
        live = np.flatnonzero(self.passed[:n] != _NONE)
        if not len(live):
            return None
        keys = self.groups.keys(live)
        return keys.append_column("__passed", pa.array(self.passed[live]))

    def restore(self, table, watermark, floors=None) -> None:
        self.watermark = watermark
        if table is None or not table.num_rows:
            return
        bits = self.groups.int_bits(table.select(self.keys))
        native = self._native_map(bits)
        if native is not None:
            passed = table.column("__passed").combine_chunks().to_numpy(zero_copy_only=False)
            native.insert(bits, np.ascontiguousarray(passed, np.int64))
            return
        slots = self.groups.slots(table.select(self.keys), bulk=True)
        self._grow(len(self.groups))
        self.passed[slots] = table.column("__passed").to_numpy()

    # -- helpers -------------------------------------------------------------------------

    def _grow(self, n: int) -> None:
        if n <= len(self.passed):
            return
        size = max(n, 2 * len(self.passed), 1024)
        passed = np.full(size, _NONE, np.int64)
        passed[: len(self.passed)] = self.passed
        self.passed = passed
        self._first = np.full(size, _MAX, np.int64)
        self._latest = np.full(size, _MIN, np.int64)

    def _times(self, batch: pa.RecordBatch) -> np.ndarray:
        for k in self.keys:
            if k not in batch.schema.names:
                raise InvalidArgumentError(f"deduplicate key {k!r} is not in the stream; it has "
                                           f"{batch.schema.names}")
        values = self._time.values(batch)
        if self.within is None:
            self.within = in_units("within", self.stage.within, self._time.type)
        return values


__all__ = ["DeduplicateOperator", "DeduplicateStage"]
