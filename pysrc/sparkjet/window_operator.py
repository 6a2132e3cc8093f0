"""The windowed aggregation of one processor: panes, firing at the watermark, lateness.

Tumbling and sliding windows are built from **panes** of ``slide`` (Jet's frames): each
event lands in exactly one pane, ``floor(t / slide)``, whose per-key partial aggregates are
kept in native arrays indexed by the pane's group slots (:class:`sparkjet._groups.Groups`
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

Session windows keep, per key, the sessions not yet closed (:class:`_Sessions`).
"""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet._batches import split_by
from sparkjet._groups import Groups
from sparkjet.errors import InvalidArgumentError
from sparkjet.keyed_state import aggregate_column, float_column, for_operation
from sparkjet.runtime.operators import Operator
from sparkjet.runtime.watermarks import MIN_TIME
from sparkjet.windows import Session, in_units, parse_window_aggregations, time_values

_FILL = {"sum": 0.0, "min": np.inf, "max": -np.inf}


class _Partials:
    """Per-slot partial aggregates of one pane or window: counts, and for each (operation,
    column) a float64 array; user aggregations keep (slots, partial table) pieces."""

    def __init__(self, layout):
        self.layout = layout
        self.capacity = 0
        self.counts = np.zeros(0, np.int64)
        self.values = {k: np.zeros(0, np.float64) for k in layout.plain}
        # per aggregated column, its nulls by slot: made when the column first has one
        # (aggregations skip nulls, as SQL does: see sparkjet.keyed_state.float_column)
        self.nulls: dict[str, np.ndarray] = {}
        self.user: dict[str, list] = {name: [] for name in layout.user}

    def _nulls_of(self, column: str) -> np.ndarray:
        arr = self.nulls.get(column)
        if arr is None:
            arr = self.nulls[column] = np.zeros(self.capacity, np.int64)
        return arr

    def grow(self, size: int) -> None:
        if size <= self.capacity:
            return
        capacity = max(size, 2 * self.capacity, 256)
        counts = np.zeros(capacity, np.int64)
        counts[: self.capacity] = self.counts[: self.capacity]
        self.counts = counts
        for (op, c), arr in self.values.items():
            out = np.full(capacity, _FILL[op], np.float64)
            out[: self.capacity] = arr[: self.capacity]
            self.values[(op, c)] = out
        for c, arr in self.nulls.items():
            out = np.zeros(capacity, np.int64)
            out[: self.capacity] = arr[: self.capacity]
            self.nulls[c] = out
        self.capacity = capacity

    def take(self, idx: np.ndarray) -> _Partials:
        """The partials of slots ``idx``, as slots ``0..len(idx)-1`` of a new one."""
        out = _Partials(self.layout)
        n = len(idx)
        out.grow(n)
        out.counts[:n] = self.counts[idx]
        for key, arr in self.values.items():
            out.values[key][:n] = arr[idx]
        for c, arr in self.nulls.items():
            out._nulls_of(c)[:n] = arr[idx]
        if self.user:
            remap = np.full(max(self.capacity, 1), -1, np.int64)
            remap[idx] = np.arange(n, dtype=np.int64)
            for name, pieces in self.user.items():
                for slots, table in pieces:
                    new = remap[slots]
                    keep = new >= 0
                    if keep.any():
                        out.user[name].append((new[keep], table.filter(pa.array(keep))))
        return out

    def add_rows(self, slots: np.ndarray, batch: pa.RecordBatch) -> None:
        _native.agg_count(slots, self.counts)
        for (op, c), arr in self.values.items():
            values, valid = self.layout.floats(batch, c)
            kernel = getattr(_native, f"agg_{op}")
            kernel(slots, for_operation(values, valid, op), arr)
        for c in self.layout.value_columns:
            values, valid = self.layout.floats(batch, c)
            if valid is not None:
                _native.agg_count(np.ascontiguousarray(slots[~valid]), self._nulls_of(c))
        for name, udaf in self.layout.user.items():
            touched, local = np.unique(slots, return_inverse=True)
            cols = [batch.column(c) for c in udaf.columns]
            partial = _table(udaf.accumulate(local.astype(np.int64), len(touched), *cols),
                             name, "accumulate", len(touched))
            self.user[name].append((touched, partial))

    def add_partials(self, slots: np.ndarray, other: _Partials, size: int) -> None:
        """Adds ``other``'s first ``size`` slots into this one's ``slots``."""
        _native.agg_sum_i64(slots, other.counts[:size], self.counts)
        for (op, c), arr in self.values.items():
            kernel = getattr(_native, "agg_sum" if op == "sum" else f"agg_{op}")
            kernel(slots, other.values[(op, c)][:size], arr)
        for c, arr in other.nulls.items():
            _native.agg_sum_i64(slots, arr[:size], self._nulls_of(c))
        for name in self.user:
            for touched, partial in other.user[name]:
                self.user[name].append((slots[touched], partial))

    def snapshot_columns(self, size: int) -> dict:
        """The first ``size`` slots' counts and values, as snapshot columns."""
        cols = {"__count": pa.array(self.counts[:size])}
        for (op, c), arr in self.values.items():
            cols[f"__{op}__{c}"] = pa.array(arr[:size])
        for c, arr in self.nulls.items():
            cols[f"__nulls__{c}"] = pa.array(arr[:size])
        return cols

    def restore_columns(self, slots: np.ndarray, table) -> None:
        """Adds a snapshot's counts and values (rows of ``table``) into ``slots``."""
        _native.agg_sum_i64(slots, np.ascontiguousarray(table.column("__count").to_numpy()),
                            self.counts)
        for (op, c), arr in self.values.items():
            kernel = getattr(_native, "agg_sum" if op == "sum" else f"agg_{op}")
            kernel(slots, np.ascontiguousarray(table.column(f"__{op}__{c}").to_numpy()), arr)
        for name in table.column_names:
            if name.startswith("__nulls__"):
                _native.agg_sum_i64(slots, np.ascontiguousarray(table.column(name).to_numpy()),
                                    self._nulls_of(name[len("__nulls__"):]))

    def user_state(self, name: str, udaf, size: int) -> pa.Table:
        """The combined partial state of slots ``0..size-1`` (each slot has rows)."""
        self.user_values(name, udaf, np.zeros(0, np.int64))  # combines the pieces
        touched, table = self.user[name][0] if self.user[name] else (np.zeros(0, np.int64), None)
        if len(touched) != size or (size and touched[-1] != size - 1):
            raise InvalidArgumentError(f"user aggregation {name!r} lost the state of a group")
        return table

    def user_values(self, name: str, udaf, slots: np.ndarray) -> pa.Array:
        """The finished user aggregation of ``slots`` (combining its pieces, which are
        then kept combined)."""
        pieces = self.user[name]
        if not pieces:
            raise InvalidArgumentError(f"user aggregation {name!r} has no partial state")
        all_slots = np.concatenate([p[0] for p in pieces])
        table = pa.concat_tables([p[1] for p in pieces]) if len(pieces) > 1 else pieces[0][1]
        touched, local = np.unique(all_slots, return_inverse=True)
        if len(pieces) > 1 or len(touched) != len(all_slots):
            table = _table(udaf.combine(local.astype(np.int64), len(touched), table),
                           name, "combine", len(touched))
            self.user[name] = [(touched, table)]
        if not len(slots):
            return pa.array([], pa.null())
        where = np.searchsorted(touched, slots)
        found = touched[np.minimum(where, len(touched) - 1)] if len(touched) else slots - 1
        if (where >= len(touched)).any() or (found != slots).any():
            raise InvalidArgumentError(f"user aggregation {name!r} lost the state of a group")
        finished = udaf.finish(table.take(pa.array(where)))
        if isinstance(finished, pa.ChunkedArray):
            finished = finished.combine_chunks()
        if not isinstance(finished, pa.Array) or len(finished) != len(slots):
            raise InvalidArgumentError(f"user aggregation {name!r}: finish() must return a "
                                       f"pyarrow Array of one value per group")
        return finished


def _table(out, name: str, fn: str, rows: int) -> pa.Table:
    if isinstance(out, pa.RecordBatch):
        out = pa.Table.from_batches([out])
    if not isinstance(out, pa.Table) or out.num_rows != rows:
        got = f"{type(out).__name__} of {getattr(out, 'num_rows', '?')} rows"
        raise InvalidArgumentError(f"user aggregation {name!r}: {fn}() must return a pyarrow "
                                   f"Table of one row per group ({rows}), got {got}")
    return out


class _Layout:
    """Which arrays the aggregations need, and how output columns are computed."""

    def __init__(self, aggregations: dict):
        self.aggregations = parse_window_aggregations(aggregations)
        plain = set()
        self.user = {}
        for name, (op, c) in self.aggregations.items():
            if op == "user":
                self.user[name] = c
            elif op in ("sum", "min", "max"):
                plain.add((op, c))
            elif op == "mean":
                plain.add(("sum", c))
        self.plain = sorted(plain)
        self.value_columns = sorted({c for _, c in plain})
        self._float_cache: tuple | None = None

    def floats(self, batch: pa.RecordBatch, column: str) -> np.ndarray:
        if self._float_cache is not None and self._float_cache[0] is batch \
                and column in self._float_cache[1]:
            return self._float_cache[1][column]
        if column not in batch.schema.names:
            raise InvalidArgumentError(f"aggregated column {column!r} is not in the stream; "
                                       f"it has {batch.schema.names}")
        values = float_column(batch.column(column), column)
        if self._float_cache is None or self._float_cache[0] is not batch:
            self._float_cache = (batch, {})
        self._float_cache[1][column] = values
        return values

    def columns(self, partials: _Partials, slots: np.ndarray) -> dict:
        out = {}
        counts = partials.counts[slots]
        for name, (op, c) in self.aggregations.items():
            if op == "count":
                out[name] = pa.array(counts)
            elif op == "user":
                out[name] = partials.user_values(name, c, slots)
            else:
                nulls = partials.nulls.get(c)
                out[name] = aggregate_column(op, partials.values[("sum" if op == "mean" else op, c)][slots],
                                             counts, None if nulls is None else nulls[slots])
        return out


class _Pane:
    def __init__(self, keys: tuple[str, ...], layout: _Layout):
        self.groups = Groups(list(keys)) if keys else None
        self.partials = _Partials(layout)
        self.size = 0

    def add(self, batch: pa.RecordBatch) -> np.ndarray:
        if self.groups is None:
            slots = np.zeros(batch.num_rows, np.int64)
            self.size = 1
        else:
            slots = self.groups.slots(batch)
            self.size = len(self.groups)
        self.partials.grow(self.size)
        self.partials.add_rows(slots, batch)
        return slots

    def key_table(self, slots: np.ndarray) -> pa.Table | None:
        return None if self.groups is None else self.groups.keys(slots)


class WindowOperator(Operator):
    """The windowed aggregation of one processor of a window vertex."""

    def __init__(self, stage, time_column: str):
        self.stage = stage
        self.keys = tuple(stage.keys)
        self.time_column = time_column
        self.layout = _Layout(stage.aggregations)
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
            from sparkjet.session_windows import Sessions

            self._sessions = Sessions(self)
        else:
            self.panes: dict[int, _Pane] = {}
            self._early_dirty: dict[int, set] = {}

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
                pane = self.panes[q] = _Pane(self.keys, self.layout)
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
            merged = _Pane(self.keys, self.layout)
            for _, pane in panes:
                if pane.groups is None:
                    into = np.zeros(pane.size, np.int64)
                    merged.size = 1
                else:
                    into = merged.groups.slots(pane.groups.keys(np.arange(pane.size, dtype=np.int64)))
                    merged.size = len(merged.groups)
                merged.partials.grow(merged.size)
                merged.partials.add_partials(into, pane.partials, pane.size)
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
                pane = self.panes[q] = _Pane(self.keys, self.layout)
            if pane.groups is None:
                slots = np.zeros(rows.num_rows, np.int64)
                pane.size = 1
            else:
                slots = pane.groups.slots(rows.select(list(self.keys)))
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


__all__ = ["WindowOperator"]
