"""Per-key state of a keyed operator, in columns indexed by the key's slot.

Slots come from :class:`sparkjet.operators.groups.Groups` (dense, in order of first appearance).
Fixed-width columns (integers, floats, booleans, timestamps, dates, durations) live in
numpy arrays with a validity mask, so reading and writing the state of a batch's keys is a
gather and a scatter. Other columns (strings, binaries, lists, structs) are kept as the
Arrow arrays they were written as; a slot points at its row, and the arrays are compacted
into one when most of their rows are stale. Keys whose state is gone (deleted, expired)
keep their slot until :meth:`StateStore.compact` rebuilds the key map with the live ones.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from sparkjet.operators.groups import Groups

#: A timer slot without a timer.
NO_TIMER = 2**63 - 1
#: What a state column is called in a snapshot's table: this prefix, then its name.
STATE_PREFIX = "__s__"


def _fixed_width(t: pa.DataType) -> bool:
    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            or pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t))


class _NumpyColumn:
    def __init__(self, t: pa.DataType):
        self.type = t
        self.storage = t if (pa.types.is_integer(t) or pa.types.is_floating(t)
                             or pa.types.is_boolean(t)) else pa.int64() if t.bit_width == 64 else pa.int32()
        self.values = np.zeros(0, self.storage.to_pandas_dtype())
        self.valid = np.zeros(0, bool)

    def grow(self, n: int) -> None:
        old = len(self.values)
        values = np.zeros(n, self.values.dtype)
        values[:old] = self.values
        valid = np.zeros(n, bool)
        valid[:old] = self.valid
        self.values, self.valid = values, valid

    def get(self, slots: np.ndarray, has: np.ndarray) -> pa.Array:
        valid = self.valid[slots] & has
        arr = pa.array(self.values[slots], self.storage, mask=~valid)
        return arr if self.storage == self.type else arr.view(self.type)

    def put(self, slots: np.ndarray, arr: pa.Array) -> None:
        if arr.type != self.storage:
            arr = arr.view(self.storage)
        valid = np.asarray(arr.is_valid())
        self.values[slots] = arr.fill_null(False if pa.types.is_boolean(self.storage) else 0) \
            .to_numpy(zero_copy_only=False)
        self.valid[slots] = valid

    def take(self, live: np.ndarray) -> None:
        self.values, self.valid = self.values[live], self.valid[live]


class _ArrowColumn:
    def __init__(self, t: pa.DataType):
        self.type = t
        self.chunks: list[pa.Array] = []
        self.rows = 0
        self.row = np.zeros(0, np.int64)         # slot -> row of the chunks (-1: none)
        self._all: pa.ChunkedArray | None = None

    def grow(self, n: int) -> None:
        row = np.full(n, -1, np.int64)
        row[: len(self.row)] = self.row
        self.row = row

    def get(self, slots: np.ndarray, has: np.ndarray) -> pa.Array:
        idx = self.row[slots]
        present = has & (idx >= 0)
        if not present.any():
            return pa.nulls(len(slots), self.type)
        if self._all is None:
            self._all = pa.chunked_array(self.chunks, self.type).combine_chunks() \
                if len(self.chunks) > 1 else self.chunks[0]
            self.chunks = [self._all]
        return self._all.take(pa.array(np.where(present, idx, 0), mask=~present))

    def put(self, slots: np.ndarray, arr: pa.Array) -> None:
        self.chunks.append(arr)
        self._all = None
        self.row[slots] = self.rows + np.arange(len(slots), dtype=np.int64)
        self.rows += len(arr)

    def clear(self, slots: np.ndarray) -> None:
        self.row[slots] = -1

    def compact(self) -> None:
        """Keeps one row per slot that has one, in one array, when most rows are stale."""
        used = self.row >= 0
        if self.rows <= 2 * int(used.sum()) + 4096:
            return
        idx = self.row[used]
        self.chunks = [pa.chunked_array(self.chunks, self.type).take(pa.array(idx)).combine_chunks()] \
            if len(idx) else []
        self._all = None
        self.row[used] = np.arange(len(idx), dtype=np.int64)
        self.rows = len(idx)

    def take(self, live: np.ndarray) -> None:
        self.row = self.row[live]


class StateStore:
    """The state (a row of ``schema``) of each key of ``key_names``, when it has one, its
    last update time, and one event-time and one processing-time timer per key."""

    def __init__(self, key_names, schema: pa.Schema):
        self.key_names = key_names
        self.schema = schema
        self.groups = Groups(key_names)
        self.columns = [(_NumpyColumn if _fixed_width(f.type) else _ArrowColumn)(f.type)
                        for f in schema]
        self.has = np.zeros(0, bool)
        self.updated = np.zeros(0, np.int64)
        self.event_timer = np.zeros(0, np.int64)
        self.proc_timer = np.zeros(0, np.int64)
        self.capacity = 0

    def __len__(self) -> int:
        """How many keys have state."""
        return int(self.has[: len(self.groups)].sum())

    def slots(self, keys, *, bulk: bool = False) -> np.ndarray:
        slots = self.groups.slots(keys, bulk=bulk)
        self._grow(len(self.groups))
        return slots

    def _grow(self, n: int) -> None:
        if n <= self.capacity:
            return
        capacity = max(n, 2 * self.capacity, 1024)
        for c in self.columns:
            c.grow(capacity)
        for name, fill in (("has", False), ("updated", 0), ("event_timer", NO_TIMER),
                           ("proc_timer", NO_TIMER)):
            old = getattr(self, name)
            new = np.full(capacity, fill, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        self.capacity = capacity

    def get(self, slots: np.ndarray) -> pa.Table:
        has = self.has[slots]
        return pa.Table.from_arrays([c.get(slots, has) for c in self.columns], schema=self.schema)

    def put(self, slots: np.ndarray, table: pa.Table, updated: np.ndarray) -> None:
        for c, f in zip(self.columns, self.schema):
            c.put(slots, table.column(f.name).combine_chunks())
        self.has[slots] = True
        self.updated[slots] = updated

    def delete(self, slots: np.ndarray) -> None:
        self.has[slots] = False
        for c in self.columns:
            if isinstance(c, _ArrowColumn):
                c.clear(slots)

    def compact(self) -> None:
        """Drops the slots of keys with neither state nor timers once they are most of the
        key map (rebuilding it), and the stale rows of Arrow columns."""
        n = len(self.groups)
        for c in self.columns:
            if isinstance(c, _ArrowColumn):
                c.compact()
        keep = self.live_slots()
        if n - len(keep) <= len(keep) + 65536:
            return
        self.groups = self.groups.kept(keep)
        for c in self.columns:
            c.take(keep)
        for name in ("has", "updated", "event_timer", "proc_timer"):
            setattr(self, name, getattr(self, name)[keep])
        self.capacity = len(keep)

    def live_slots(self) -> np.ndarray:
        n = len(self.groups)
        return np.flatnonzero(self.has[:n] | (self.event_timer[:n] != NO_TIMER)
                              | (self.proc_timer[:n] != NO_TIMER))

    # -- snapshots -----------------------------------------------------------------------

    def snapshot(self, prefix: str = STATE_PREFIX, time_type: pa.DataType | None = None) -> pa.Table | None:
        """One row per key with state or timers: its key columns, ``__has``, the state
        columns (``prefix`` + name), ``__updated`` (of ``time_type`` when given: the
        event-time column's, which a restore then knows) and the two timers."""
        slots = self.live_slots()
        if not len(slots):
            return None
        keys = self.groups.keys(slots)
        state = self.get(slots)
        cols = {name: keys.column(name) for name in keys.column_names}
        cols["__has"] = pa.array(self.has[slots])
        for f in self.schema:
            cols[prefix + f.name] = state.column(f.name)
        updated = pa.array(self.updated[slots])
        if time_type is not None and time_type != pa.int64():
            updated = updated.view(time_type) if pa.types.is_timestamp(time_type) else updated.cast(time_type)
        cols["__updated"] = updated
        cols["__event_timer"] = pa.array(self.event_timer[slots])
        cols["__proc_timer"] = pa.array(self.proc_timer[slots])
        return pa.table(cols)

    def restore(self, table: pa.Table, prefix: str = STATE_PREFIX) -> pa.DataType:
        """Adds the keys of a :meth:`snapshot` table; returns the type ``__updated`` was
        saved with."""
        slots = self.slots(table.select(list(self.groups.key_names)), bulk=True)
        updated = table.column("__updated").combine_chunks()
        time_type = updated.type
        if pa.types.is_timestamp(time_type):
            updated = updated.view(pa.int64())
        has = table.column("__has").to_numpy(zero_copy_only=False)
        state = pa.table({f.name: table.column(prefix + f.name) for f in self.schema},
                         schema=self.schema)
        with_state = np.flatnonzero(has)
        if len(with_state):
            self.put(slots[with_state], state.take(pa.array(with_state)),
                     updated.cast(pa.int64()).to_numpy()[with_state])
        self.event_timer[slots] = table.column("__event_timer").to_numpy()
        self.proc_timer[slots] = table.column("__proc_timer").to_numpy()
        return time_type


__all__ = ["NO_TIMER", "STATE_PREFIX", "StateStore"]
