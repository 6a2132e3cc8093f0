"""Panes and their partial aggregates, shared by tumbling, sliding and session windows.

A :class:`Pane` holds the keys of one slice of event time (:class:`~sparkjet.operators.groups.Groups`
maps them to dense slots) and their :class:`Partials`: counts, and per (operation, column)
an array of sums, minima, maxima, first or last values (float64, int64 or 128-bit sums, by
the column's kind: :mod:`sparkjet.operators.values`), and the partial tables of user
aggregations. A :class:`Layout` says which of those arrays the window's aggregations need and
turns partials into output columns.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.groups import Groups
from sparkjet.operators.values import ValueColumns
from sparkjet.operators.windows.definitions import parse_window_aggregations


class Partials:
    """Per-slot partial aggregates of one pane or window: counts, and for each (operation,
    column) an array; user aggregations keep (slots, partial table) pieces."""

    def __init__(self, layout):
        self.layout = layout
        self.capacity = 0
        self.counts = np.zeros(0, np.int64)
        self.values: dict[tuple[str, str], np.ndarray] = {}   # made once the kind is known
        self.seen: dict[str, np.ndarray] = {}                  # a first value, by slot
        # per aggregated column, its nulls by slot: made when the column first has one
        # (aggregations skip nulls, as SQL does: see sparkjet.operators.values)
        self.nulls: dict[str, np.ndarray] = {}
        self.user: dict[str, list] = {name: [] for name in layout.user}

    def _nulls_of(self, column: str) -> np.ndarray:
        arr = self.nulls.get(column)
        if arr is None:
            arr = self.nulls[column] = np.zeros(self.capacity, np.int64)
        return arr

    def _arrays(self) -> None:
        """The arrays of the columns whose kind became known, at the capacity."""
        vc = self.layout.value_columns
        for op, c in vc.keys():
            if (op, c) not in self.values:
                self.values[(op, c)] = vc.new_array(op, c, self.capacity)
            if op == "first" and c not in self.seen:
                self.seen[c] = np.zeros(self.capacity, np.uint8)

    def present(self, column: str, size: int) -> np.ndarray | None:
        """Which of the first ``size`` slots have a value of ``column`` (None: all that
        have rows)."""
        nulls = self.nulls.get(column)
        return None if nulls is None else self.counts[:size] > nulls[:size]

    def grow(self, size: int) -> None:
        if size <= self.capacity:
            return
        capacity = max(size, 2 * self.capacity, 256)
        counts = np.zeros(capacity, np.int64)
        counts[: self.capacity] = self.counts[: self.capacity]
        self.counts = counts
        vc = self.layout.value_columns
        for (op, c), arr in self.values.items():
            self.values[(op, c)] = vc.resized(arr, op, c, capacity)
        for c, arr in self.seen.items():
            out = np.zeros(capacity, np.uint8)
            out[: self.capacity] = arr[: self.capacity]
            self.seen[c] = out
        for c, arr in self.nulls.items():
            out = np.zeros(capacity, np.int64)
            out[: self.capacity] = arr[: self.capacity]
            self.nulls[c] = out
        self.capacity = capacity

    def take(self, idx: np.ndarray) -> Partials:
        """The partials of slots ``idx``, as slots ``0..len(idx)-1`` of a new one."""
        out = Partials(self.layout)
        n = len(idx)
        out.grow(n)
        out._arrays()
        out.counts[:n] = self.counts[idx]
        for key, arr in self.values.items():
            out.values[key][:n] = arr[idx]
        for c, arr in self.seen.items():
            out.seen[c][:n] = arr[idx]
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

    def add_rows(self, slots: np.ndarray, batch: pa.RecordBatch,
                 key_of_row: Callable[[int], dict] | None = None) -> None:
        vc = self.layout.value_columns
        columns = {c: self.layout.column_values(batch, c) for c in vc.columns}
        self._arrays()
        _native.agg_count(slots, self.counts)
        for c, (values, valid) in columns.items():
            vc.add_rows(c, slots, values, valid, self.values, self.seen, key_of_row)
            if valid is not None:
                _native.agg_count(np.ascontiguousarray(slots[~valid]), self._nulls_of(c))
        for name, udaf in self.layout.user.items():
            touched, local = np.unique(slots, return_inverse=True)
            cols = [batch.column(c) for c in udaf.columns]
            partial = _user_table(udaf.accumulate(local.astype(np.int64), len(touched), *cols),
                             name, "accumulate", len(touched))
            self.user[name].append((touched, partial))

    def add_partials(self, slots: np.ndarray, other: Partials, size: int,
                     key_of_slot: Callable[[int], dict] | None = None) -> None:
        """Adds ``other``'s first ``size`` slots into this one's ``slots``."""
        vc = self.layout.value_columns
        self._arrays()
        for c in vc.columns:
            if c in vc.kinds and (vc.ops[c][0], c) in other.values:
                vc.combine(c, slots, other.values, other.present(c, size), size, self.values,
                           self.seen, key_of_slot)
        _native.agg_sum_i64(slots, other.counts[:size], self.counts)
        for c, arr in other.nulls.items():
            _native.agg_sum_i64(slots, arr[:size], self._nulls_of(c))
        for name in self.user:
            for touched, partial in other.user[name]:
                self.user[name].append((slots[touched], partial))

    def snapshot_columns(self, size: int) -> dict:
        """The first ``size`` slots' counts and values, as snapshot columns."""
        cols = {"__count": pa.array(self.counts[:size])}
        vc = self.layout.value_columns
        for (op, c), arr in sorted(self.values.items()):
            cols[f"__{op}__{c}"] = vc.snapshot_column(op, c, arr[:size], self.present(c, size))
        for c, arr in self.nulls.items():
            cols[f"__nulls__{c}"] = pa.array(arr[:size])
        return cols

    def restore_columns(self, slots: np.ndarray, table) -> None:
        """Adds a snapshot's counts and values (rows of ``table``) into ``slots``."""
        vc = self.layout.value_columns
        for c in vc.columns:
            for op in vc.ops[c]:
                if f"__{op}__{c}" not in table.column_names:
                    raise InvalidArgumentError(f"snapshot state lacks column "
                                               f"{f'__{op}__{c}'!r}")
        vc.adopt(table)
        self._arrays()
        counts = np.ascontiguousarray(table.column("__count").to_numpy())
        nulls = {name[len("__nulls__"):]: np.ascontiguousarray(table.column(name).to_numpy())
                 for name in table.column_names if name.startswith("__nulls__")}
        for c in vc.columns:
            other = {(op, c): vc.restored(op, c, table.column(f"__{op}__{c}"))
                     for op in vc.ops[c]}
            vc.combine(c, slots, other, counts > nulls[c] if c in nulls else None, len(slots),
                       self.values, self.seen, None)
        _native.agg_sum_i64(slots, counts, self.counts)
        for c, n in nulls.items():
            _native.agg_sum_i64(slots, n, self._nulls_of(c))

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
            table = _user_table(udaf.combine(local.astype(np.int64), len(touched), table),
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


def _user_table(out, name: str, fn: str, rows: int) -> pa.Table:
    if isinstance(out, pa.RecordBatch):
        out = pa.Table.from_batches([out])
    if not isinstance(out, pa.Table) or out.num_rows != rows:
        got = f"{type(out).__name__} of {getattr(out, 'num_rows', '?')} rows"
        raise InvalidArgumentError(f"user aggregation {name!r}: {fn}() must return a pyarrow "
                                   f"Table of one row per group ({rows}), got {got}")
    return out


class Layout:
    """Which arrays the aggregations need, and how output columns are computed."""

    def __init__(self, aggregations: dict, overflow: str = "fail", stage: str = "window"):
        self.aggregations = parse_window_aggregations(aggregations)
        self.user = {name: c for name, (op, c) in self.aggregations.items() if op == "user"}
        plain = {name: spec for name, spec in self.aggregations.items() if spec[0] != "user"}
        self.value_columns = ValueColumns(plain, overflow, stage)
        self._cache: tuple | None = None

    def column_values(self, batch: pa.RecordBatch, column: str):
        """``column`` of ``batch`` as :meth:`ValueColumns.values` gives it (cached for the
        batch: several panes' rows come from one)."""
        if self._cache is not None and self._cache[0] is batch and column in self._cache[1]:
            return self._cache[1][column]
        if column not in batch.schema.names:
            raise InvalidArgumentError(f"stage {self.value_columns.stage!r}: aggregated column "
                                       f"{column!r} is not in the stream; it has "
                                       f"{batch.schema.names}")
        values = self.value_columns.values(batch.column(column), column)
        if self._cache is None or self._cache[0] is not batch:
            self._cache = (batch, {})
        self._cache[1][column] = values
        return values

    def columns(self, partials: Partials, slots: np.ndarray) -> dict:
        out = {}
        counts = partials.counts[slots]
        vc = self.value_columns
        for name, (op, c) in self.aggregations.items():
            if op == "count":
                out[name] = pa.array(counts)
            elif op == "user":
                out[name] = partials.user_values(name, c, slots)
            else:
                nulls = partials.nulls.get(c)
                out[name] = vc.output(op, c, partials.values[("sum" if op == "mean" else op, c)][slots],
                                      counts, None if nulls is None else nulls[slots])
        return out


class Pane:
    def __init__(self, keys: tuple[str, ...], layout: Layout):
        self.keys = tuple(keys)
        self.groups = Groups(list(keys)) if keys else None
        self.partials = Partials(layout)
        self.size = 0

    def add(self, batch: pa.RecordBatch) -> np.ndarray:
        if self.groups is None:
            slots = np.zeros(batch.num_rows, np.int64)
            self.size = 1
        else:
            slots = self.groups.slots(batch)
            self.size = len(self.groups)
        self.partials.grow(self.size)
        self.partials.add_rows(slots, batch, lambda i: _row_key(batch, self.keys, i))
        return slots

    def key_of_slot(self, slot: int) -> dict | None:
        if self.groups is None:
            return None
        return {k: v[0] for k, v in self.groups.keys(np.array([slot], np.int64)).to_pydict().items()}

    def key_table(self, slots: np.ndarray) -> pa.Table | None:
        return None if self.groups is None else self.groups.keys(slots)


def _row_key(batch: pa.RecordBatch, keys, i: int) -> dict | None:
    """Row ``i``'s key, for an error about it."""
    return {k: batch.column(k)[i].as_py() for k in keys} if keys else None


__all__ = ["Layout", "Pane", "Partials"]
