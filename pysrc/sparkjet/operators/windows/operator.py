"""The windowed aggregation of one processor: panes, firing at the watermark, lateness.

Tumbling and sliding windows are built from **panes** of ``slide`` (Jet's frames): each
event lands in exactly one pane, ``floor(t / slide)``, whose per-key partial aggregates are
kept in native arrays indexed by the pane's group slots (:class:`sparkjet.operators.groups.Groups`
maps each pane's composite keys to dense slots). A window ``[s, s + size)`` is the
combination of its ``size / slide`` panes: a tumbling window is one pane; a sliding window
regroups its panes' partial aggregates (count and sum add, min and max take the least and
greatest, a user aggregation's ``combine`` runs).

When the processor's watermark passes a window's end, the window fires: one row per key,
with ``window_start`` and ``window_end``. A pane is dropped once no window containing it
can change any more (its last window's end plus ``allowed_lateness`` is at or below the
watermark), so memory is bounded by the panes of open windows. An event whose every window
is past that point is *too late*: it is counted and handed to the late side output, never
silently dropped. An event that is late but within ``allowed_lateness`` updates its pane and
each already-fired window containing it that can still change (its end plus
``allowed_lateness`` is past the watermark) emits a correction for the keys it touched; a
window past that point has lost its older panes and is left as it fired.

Session windows keep, per key, the sessions not yet closed
(:class:`~sparkjet.operators.windows.sessions.Sessions`); panes and partial aggregates are in
:mod:`~sparkjet.operators.windows.panes`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet._batches import split_by
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.base import Operator, OperatorStage
from sparkjet.operators.rolling import (
    describe_aggregations,
)
from sparkjet.operators.time import MIN_TIME, in_units, time_values
from sparkjet.operators.windows.definitions import WINDOW_TIME, Session
from sparkjet.operators.windows.panes import Layout, Pane
from sparkjet.operators.windows.sessions import Sessions

if TYPE_CHECKING:
    from sparkjet.connectors.base import Sink

@dataclass(frozen=True)
class WindowStage(OperatorStage):
    """A windowed aggregation by key (no key: one group, on one processor). Its output's
    event time is the window's end."""

    keys: tuple[str, ...] = field()  # (field(): no default, unlike OperatorStage.keys)
    window: object                   # a sparkjet.operators.windows.definitions window definition
    aggregations: dict
    early_results: float | None      # seconds between early (speculative) results, or None
    allowed_lateness: object         # int (the event time's unit) or timedelta
    late: Sink | None                # the side output of too-late events, or None
    overflow: str = "fail"           # an integer sum past int64: "fail" or "decimal"
    kind = "window"
    event_time = True
    output_time = WINDOW_TIME

    def fingerprint(self) -> dict:
        out = {"keys": list(self.keys),
               "aggregations": describe_aggregations(self.aggregations),
               "window": self.window.describe()}
        if self.overflow != "fail":      # (absent by default: older fingerprints stay equal)
            out["overflow"] = self.overflow
        return out

    def make_operator(self, time_column: str | None) -> Operator:
        return WindowOperator(self, time_column)



class WindowOperator(Operator):
    """The windowed aggregation of one processor of a window vertex."""

    def __init__(self, stage, time_column: str):
        self.stage = stage
        self.keys = tuple(stage.keys)
        self.time_column = time_column
        self.layout = Layout(stage.aggregations, stage.overflow, stage.kind)
        self.state_key = stage.key if self.keys else None
        self.definition = stage.window
        self._resolved = False
        self.watermark = MIN_TIME
        self._floors = None
        self._early_every = stage.early_results
        self._early_at = time.monotonic()
        self._time_type: pa.DataType | None = None
        self._key_types: dict | None = None
        self.session = isinstance(stage.window, Session)
        if self.session:
            self._sessions = Sessions(self)
        else:
            self.panes: dict[int, Pane] = {}
            self._early_dirty: dict[int, set] = {}

    @property
    def name(self) -> str:
        return self.layout.value_columns.stage

    @name.setter
    def name(self, name: str) -> None:
        self.layout.value_columns.stage = name

    # -- setup ---------------------------------------------------------------------------

    def _resolve(self, time_type: pa.DataType) -> None:
        if self._resolved:
            if time_type != self._time_type:
                raise InvalidArgumentError(
                    f"event-time column {self.time_column!r} changed type from {self._time_type} "
                    f"to {time_type}")
            return
        self._time_type = time_type
        w = self.definition.resolved(time_type)
        self.lateness = in_units("allowed_lateness", self.stage.allowed_lateness, time_type)
        if self.session:
            self.gap = w.gap
        else:
            self.size, self.slide = w.size, w.slide
        self._resolved = True

    # -- the operator interface ----------------------------------------------------------

    def process(self, batch: pa.RecordBatch):
        if batch.num_rows == 0:
            return [], None
        if self.time_column not in batch.schema.names:
            raise InvalidArgumentError(f"the windowed stream has no event-time column "
                                       f"{self.time_column!r}; it has {batch.schema.names}")
        column = batch.column(self.time_column)
        self._resolve(column.type)
        for k in self.keys:
            if k not in batch.schema.names:
                raise InvalidArgumentError(f"group_by key {k!r} is not in the stream; it has "
                                           f"{batch.schema.names}")
        ts = time_values(column, self.time_column)
        replayed = None
        if self._floors is not None:
            batch, ts, replayed = self._below_floors(batch, ts)
            if batch.num_rows == 0:
                return [], replayed
        if self.session:
            outputs, late = self._sessions.process(batch, ts)
        else:
            outputs, late = self._process_panes(batch, ts)
        if replayed is not None:
            late = replayed if late is None else pa.concat_batches([replayed, late])
        return outputs, late

    def _below_floors(self, batch: pa.RecordBatch, ts: np.ndarray):
        """Splits off the rows that were too late for their partition's watermark before a
        restart (see :class:`~sparkjet.runtime.watermarks.PartitionFloors`): they go where
        too-late events go, as they did then."""
        if self.watermark >= self._floors.top:
            self._floors = None
            return batch, ts, None
        floor = self._floors.of(batch)
        ahead = floor > self.watermark
        if not ahead.any():
            return batch, ts, None
        bound = np.maximum(floor, -(2**62)) - self.lateness
        if self.session:
            too_late = ahead & (ts <= bound - self.gap)
        else:
            # as _min_live_pane: pane q is closed when q * slide + size + lateness <= floor
            too_late = ahead & (ts // self.slide < (bound - self.size) // self.slide + 1)
        if not too_late.any():
            return batch, ts, None
        keep = ~too_late
        return batch.filter(pa.array(keep)), ts[keep], batch.filter(pa.array(too_late))

    def advance(self, watermark: int) -> list[pa.RecordBatch]:
        if watermark <= self.watermark:
            return []
        old, self.watermark = self.watermark, watermark
        if not self._resolved:
            return []
        if self.session:
            return self._sessions.advance(old, watermark)
        return self._fire(old, watermark)

    def tick(self) -> list[pa.RecordBatch]:
        """Early results, when they are due."""
        if self._early_every is None or not self._resolved:
            return []
        now = time.monotonic()
        if now - self._early_at < self._early_every:
            return []
        self._early_at = now
        if self.session:
            return self._sessions.early()
        return self._early()

    # -- panes ---------------------------------------------------------------------------

    def _min_live_pane(self, watermark: int) -> int | None:
        """The least pane some window can still change: panes below it are gone."""
        if watermark == MIN_TIME:
            return None
        # pane q is closed when q * slide + size + lateness <= watermark
        bound = watermark - self.size - self.lateness
        return bound // self.slide + 1 if bound >= -(2**62) else None

    def _process_panes(self, batch: pa.RecordBatch, ts: np.ndarray):
        panes = np.empty(len(ts), np.int64)
        low = self._min_live_pane(self.watermark)
        marks = np.empty(len(ts), np.uint8)
        late = None
        if _native.assign_panes_late(ts, self.slide, 0, -(2**63) if low is None else low,
                                     panes, marks):
            too_late = marks.view(bool)
            late = batch.filter(pa.array(too_late))
            keep = ~too_late
            batch, panes = batch.filter(pa.array(keep)), panes[keep]
            if batch.num_rows == 0:
                return [], late
        outputs = []
        for q, rows in split_by(batch, panes):
            pane = self.panes.get(q)
            if pane is None:
                pane = self.panes[q] = Pane(self.keys, self.layout)
            slots = pane.add(rows)
            if self._early_every is not None:
                self._early_dirty.setdefault(q, set()).update(np.unique(slots).tolist())
            # Windows of this pane that already fired but can still change (their end plus
            # the allowed lateness is past the watermark, so all their panes are kept) get
            # a correction. A window past that point has lost its older panes: the event
            # counts for this pane's later windows only, as it would in Flink or Jet.
            fired = [s for s in self._window_starts(q)
                     if s + self.size <= self.watermark < s + self.size + self.lateness]
            if fired:
                touched = pane.key_table(np.unique(slots))
                for s in fired:
                    out = self._window_result(s, touched)
                    if out is not None:
                        outputs.append(out)
        return outputs, late

    def _window_starts(self, q: int) -> list[int]:
        """The starts of the windows containing pane ``q``."""
        last = q * self.slide
        return [last - i * self.slide for i in range(self.size // self.slide)][::-1]

    def _fire(self, old: int, watermark: int) -> list[pa.RecordBatch]:
        starts = set()
        for q in self.panes:
            for s in self._window_starts(q):
                end = s + self.size
                if (old == MIN_TIME or end > old) and end <= watermark:
                    starts.add(s)
        outputs = [out for s in sorted(starts)
                   if (out := self._window_result(s)) is not None]
        low = self._min_live_pane(watermark)
        if low is not None:
            for q in [q for q in self.panes if q < low]:
                del self.panes[q]
                if self._early_every is not None:
                    self._early_dirty.pop(q, None)
        return outputs

    def _window_result(self, start: int, only: pa.Table | None = None,
                       early: bool = False) -> pa.RecordBatch | None:
        """The window ``[start, start + size)``: every key's row, or ``only`` those keys'."""
        first = start // self.slide
        panes = [(q, self.panes[q]) for q in range(first, first + self.size // self.slide)
                 if q in self.panes and self.panes[q].size]
        if not panes:
            return None
        if len(panes) == 1:
            pane = panes[0][1]
            partials, size = pane.partials, pane.size
            keys_of = pane.key_table
            slots = np.arange(size, dtype=np.int64)
            if only is not None:
                slots = pane.groups.slots(only) if pane.groups is not None else slots
        else:
            merged = Pane(self.keys, self.layout)
            for _, pane in panes:
                if pane.groups is None:
                    into = np.zeros(pane.size, np.int64)
                    merged.size = 1
                else:
                    into = merged.groups.slots(pane.groups.keys(np.arange(pane.size, dtype=np.int64)))
                    merged.size = len(merged.groups)
                merged.partials.grow(merged.size)
                merged.partials.add_partials(into, pane.partials, pane.size, merged.key_of_slot)
            partials, size, keys_of = merged.partials, merged.size, merged.key_table
            slots = np.arange(size, dtype=np.int64)
            if only is not None and merged.groups is not None:
                slots = merged.groups.slots(only)
        return self._rows(keys_of(slots), slots, partials, start, start + self.size, early)

    def _rows(self, keys: pa.Table | None, slots, partials, start: int, end: int,
              early: bool) -> pa.RecordBatch:
        n = len(slots)
        columns = {}
        if keys is not None:
            for name in keys.column_names:
                columns[name] = keys.column(name).combine_chunks()
        columns["window_start"] = self._times(np.full(n, start, np.int64))
        columns["window_end"] = self._times(np.full(n, end, np.int64))
        columns.update(self.layout.columns(partials, slots))
        if self._early_every is not None:
            columns["early"] = pa.array(np.full(n, early))
        return pa.RecordBatch.from_pydict(columns)

    def _times(self, values: np.ndarray) -> pa.Array:
        arr = pa.array(values, pa.int64())
        t = self._time_type
        return arr.view(t) if pa.types.is_timestamp(t) else arr.cast(t)

    def _early(self) -> list[pa.RecordBatch]:
        starts = set()
        for q in self._early_dirty:
            for s in self._window_starts(q):
                if s + self.size > self.watermark:
                    starts.add(s)
        outputs = []
        for s in sorted(starts):
            first = s // self.slide
            keys = [self.panes[q].key_table(np.array(sorted(self._early_dirty[q]), np.int64))
                    for q in range(first, first + self.size // self.slide)
                    if q in self._early_dirty and q in self.panes]
            keys = [k for k in keys if k is not None]
            only = _distinct(pa.concat_tables(keys)) if keys else None
            out = self._window_result(s, only, early=True)
            if out is not None:
                outputs.append(out)
        self._early_dirty = {}
        return outputs

    # -- snapshots -----------------------------------------------------------------------

    def snapshot(self) -> pa.Table | None:
        """Every pane's (or session's) partial aggregates, one row per (key, pane)."""
        if self.session:
            return self._sessions.snapshot()
        tables = []
        for q, pane in sorted(self.panes.items()):
            if not pane.size:
                continue
            slots = np.arange(pane.size, dtype=np.int64)
            cols = {}
            keys = pane.key_table(slots)
            if keys is not None:
                for name in keys.column_names:
                    cols[name] = keys.column(name)
            cols["__pane"] = pa.array(np.full(pane.size, q, np.int64))
            cols["__pane_start"] = self._times(np.full(pane.size, q * self.slide, np.int64))
            cols.update(pane.partials.snapshot_columns(pane.size))
            for name, udaf in self.layout.user.items():
                partial = pane.partials.user_state(name, udaf, pane.size)
                for col in partial.column_names:
                    cols[f"__user__{name}__{col}"] = partial.column(col)
            tables.append(pa.table(cols))
        if not tables:
            return None
        return pa.concat_tables(tables)

    def restore(self, table: pa.Table | None, watermark: int, floors=None) -> None:
        self.watermark = watermark
        self._floors = floors
        if table is None or table.num_rows == 0:
            return
        if self.session:
            self._sessions.restore(table)
            return
        self._resolve(table.column("__pane_start").type)
        panes = table.column("__pane").to_numpy()
        for q in np.unique(panes).tolist():
            rows = table.filter(pa.array(panes == q))
            pane = self.panes.get(q)
            if pane is None:
                pane = self.panes[q] = Pane(self.keys, self.layout)
            if pane.groups is None:
                slots = np.zeros(rows.num_rows, np.int64)
                pane.size = 1
            else:
                slots = pane.groups.slots(rows.select(list(self.keys)), bulk=True)
                pane.size = len(pane.groups)
            pane.partials.grow(pane.size)
            pane.partials.restore_columns(slots, rows)
            for name in self.layout.user:
                prefix = f"__user__{name}__"
                names = [c for c in rows.column_names if c.startswith(prefix)]
                partial = rows.select(names).rename_columns([c[len(prefix):] for c in names])
                pane.partials.user[name].append((slots, partial))


def _distinct(keys: pa.Table) -> pa.Table:
    return keys.group_by(keys.column_names).aggregate([])


__all__ = ["WindowOperator", "WindowStage"]
