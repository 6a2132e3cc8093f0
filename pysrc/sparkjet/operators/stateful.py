"""Keyed state of the user's own: a function called once per batch with the batch's rows
grouped by key and those keys' state, as Arrow (Jet's ``mapStateful``, Flink's keyed
process functions, Structured Streaming's ``transformWithState``, vectorized).

>>> def running_max(b):                                              # doctest: +SKIP
...     top = np.maximum.reduceat(b.rows["value"].to_numpy(), b.offsets[:-1])
...     old = b.state["top"].fill_null(-np.inf).to_numpy()
...     new = pa.table({"top": np.maximum(top, old)})
...     return b.keys.append_column("top", new["top"]), new
>>> stream.group_by("key").map_state(running_max, state=pa.schema([("top", pa.float64())]))

The function gets a :class:`KeyedBatch` and returns its output (a RecordBatch, a Table, or
None), or ``(output, new_state)`` where ``new_state`` has one row per key of the call in
the declared state schema (None: unchanged). It may also delete keys' state and set one
event-time and one processing-time timer per key; when the watermark (or the wall clock)
passes a timer, the function is called for the keys whose timers fired, with no rows.

State expires after ``ttl`` without updates: in event time (a key's state is gone for a
batch whose earliest row of that key is ``ttl`` after its last update, and once the
watermark is), or in processing time. State and timers are saved by Hazelcast partition in
every snapshot, restore at any parallelism, and expired state is evicted, so memory stays
bounded by the keys updated within ``ttl``.

:func:`map_stateful` is the per-row form (a Python object per key, Jet's shape): much
slower, for logic that is hard to vectorize.
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.base import ORDINAL, Operator, OperatorStage
from sparkjet.operators.groups import Groups
from sparkjet.operators.state_store import NO_TIMER, StateStore
from sparkjet.operators.time import MIN_TIME, EventTimeColumn, duration, in_units, seconds

#: How many rounds of timers one watermark may fire (a timer set at or below the watermark
#: by a timer call fires in the next round).
_MAX_TIMER_ROUNDS = 1000


class KeyedBatch:
    """One call of a :meth:`~sparkjet.pipeline.GroupBy.map_state` function.

    - ``keys``: the keys of this call (a Table of the key columns, one row per key);
    - ``state``: their state (a Table of the declared schema, one row per key; all null
      where ``has_state`` is False);
    - ``has_state``: numpy bool per key;
    - ``rows``: the input rows, grouped by key (key ``i``'s are ``rows[offsets[i]:offsets[i+1]]``,
      in arrival order), or None in a timer call;
    - ``offsets``: numpy int64, ``len(keys) + 1``; ``group``: the key index of every row;
    - ``fired``: in a timer call, the time of each key's timer that fired (numpy int64),
      and ``timer`` says which kind ("event" or "processing"); None in a data call;
    - ``watermark``: the processor's event-time watermark;
    - ``now``: the wall-clock time, in nanoseconds;
    - ``broadcast``: with ``map_state(broadcast=stream)``, the rows that stream has sent so
      far (the latest per ``broadcast_key`` if given), the same on every processor; None
      before the first.
    """

    def __init__(self, keys, state, has_state, rows, offsets, group, fired, timer, watermark, now,
                 broadcast=None, time_type=None):
        self.keys = keys
        self.state = state
        self.has_state = has_state
        self.rows = rows
        self.offsets = offsets
        self.group = group
        self.fired = fired
        self.timer = timer
        self.watermark = watermark
        self.now = now
        self.broadcast = broadcast
        self._time_type = time_type
        self._delete: np.ndarray | None = None
        self._timers: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # kind -> (set, times)

    def __len__(self) -> int:
        return self.keys.num_rows

    def delete(self, which=None) -> None:
        """Deletes the state of the keys ``which`` (a bool mask or indices; None: all) once
        the function returns, with their timers."""
        mask = self._mask(which, "delete")
        self._delete = mask if self._delete is None else self._delete | mask

    def set_timer(self, times, which=None, *, kind: str = "event") -> None:
        """Sets each key's timer of ``kind`` ("event": fires when the watermark reaches it,
        in the event-time column's unit or as timestamps; "processing": when the wall clock,
        in nanoseconds since the epoch or as timestamps, does) to ``times`` (one per key of
        ``which``, or a scalar; a null clears it). A key has at most one timer of each kind:
        setting it again moves it. The end of a bounded stream fires every event timer."""
        if kind not in ("event", "processing"):
            raise InvalidArgumentError(f"set_timer(kind=...) is 'event' or 'processing', got {kind!r}")
        mask = self._mask(which, "set_timer")
        n = int(mask.sum())
        arr = times if isinstance(times, (pa.Array, pa.ChunkedArray)) else pa.array(
            [times] * n if times is None or np.isscalar(times) or not hasattr(times, "__len__")
            else times)
        if len(arr) != n:
            raise InvalidArgumentError(f"set_timer(): {len(arr)} times for {n} keys")
        if pa.types.is_timestamp(arr.type):
            unit = self._time_type if kind == "event" else pa.timestamp("ns")
            if unit is None or not pa.types.is_timestamp(unit):
                raise InvalidArgumentError(f"set_timer(): timestamps for an event time of type "
                                           f"{unit}; give times in its unit")
            arr = arr.cast(pa.timestamp(unit.unit, arr.type.tz)).view(pa.int64())
        try:
            arr = arr.cast(pa.int64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise InvalidArgumentError(f"set_timer(): times must be integers or timestamps, "
                                       f"got {arr.type}: {e}") from None
        values = arr.fill_null(NO_TIMER).to_numpy()
        if (values[np.asarray(arr.is_valid())] == NO_TIMER).any():
            raise InvalidArgumentError(f"set_timer(): {NO_TIMER} (the end of time) is not a "
                                       f"timer time; the end of a bounded stream fires every "
                                       f"timer, or use {NO_TIMER - 1}")
        touched, out = self._timers.get(kind, (np.zeros(len(self), bool), np.zeros(len(self), np.int64)))
        touched[mask] = True
        out[mask] = values
        self._timers[kind] = (touched, out)

    def _mask(self, which, fn: str) -> np.ndarray:
        n = len(self)
        if which is None:
            return np.ones(n, bool)
        arr = np.asarray(which.to_numpy(zero_copy_only=False) if isinstance(which, pa.Array) else which)
        if arr.dtype == bool:
            if len(arr) != n:
                raise InvalidArgumentError(f"{fn}(): a mask of {len(arr)} for {n} keys")
            return arr
        mask = np.zeros(n, bool)
        if len(arr) and (arr.min() < 0 or arr.max() >= n):
            raise InvalidArgumentError(f"{fn}(): key indices must be in 0..{n - 1}")
        if len(np.unique(arr)) != len(arr):
            raise InvalidArgumentError(f"{fn}(): a key index is given twice")
        mask[arr.astype(np.int64)] = True
        return mask


@dataclass(frozen=True)
class KeyedStateStage(OperatorStage):
    keys: tuple = ()
    fn: Callable = None
    state: pa.Schema = None
    ttl: object = None               # event time (int or timedelta), or seconds (processing)
    ttl_in: str = "event"
    needs_time: bool = False
    label: str = ""
    broadcast: bool = False          # a second input, broadcast to every processor
    broadcast_key: tuple | None = None

    kind = "state"

    @property
    def event_time(self) -> bool:
        return self.needs_time

    @property
    def arity(self) -> int:
        return 2 if self.broadcast else 1

    @property
    def broadcast_inputs(self) -> tuple:
        return (1,) if self.broadcast else ()

    def describe(self) -> dict:
        out = {"state": [f"{f.name}: {f.type}" for f in self.state], "ttl": str(self.ttl),
               "ttl_in": self.ttl_in, "function": self.label}
        if self.broadcast:
            out["broadcast_key"] = list(self.broadcast_key or ())
        return out

    def make_operator(self, time_column):
        return KeyedStateOperator(self, time_column)


def keyed_state_stage(keys, fn, state, ttl, ttl_in, event_time, broadcast=False,
                      broadcast_key=None) -> KeyedStateStage:
    if not callable(fn):
        raise InvalidArgumentError("map_state() takes a function of a KeyedBatch")
    if not isinstance(state, pa.Schema) or not len(state):
        raise InvalidArgumentError(f"map_state(state=...) takes a pyarrow schema of the state "
                                   f"columns, got {state!r}")
    if ttl_in not in ("event", "processing"):
        raise InvalidArgumentError(f"ttl_in is 'event' or 'processing', got {ttl_in!r}")
    if ttl is not None:
        ttl = duration("ttl", ttl, allow_zero=False) if ttl_in == "event" else seconds("ttl", ttl)
    label = getattr(fn, "__qualname__", type(fn).__name__)
    if isinstance(broadcast_key, str):
        broadcast_key = (broadcast_key,)
    if broadcast_key is not None and (not broadcast or not broadcast_key
                                      or not all(isinstance(k, str) for k in broadcast_key)):
        raise InvalidArgumentError(f"broadcast_key takes column names of the broadcast stream, "
                                   f"got {broadcast_key!r}" + ("" if broadcast else
                                                               " without a broadcast stream"))
    return KeyedStateStage(tuple(keys), fn, state, ttl, ttl_in,
                           bool(event_time) or (ttl is not None and ttl_in == "event"), label,
                           bool(broadcast), None if broadcast_key is None else tuple(broadcast_key))


class KeyedStateOperator(Operator):
    """The keyed state of one processor: calls the function, keeps state and timers."""

    def __init__(self, stage: KeyedStateStage, time_column: str | None, *, clock=time.time_ns):
        self.stage = stage
        self.keys = list(stage.keys)
        self.state_key = stage.key
        self.store = StateStore(self.keys, stage.state)
        self.watermark = MIN_TIME
        self._clock = clock
        self._ttl = None if stage.ttl is None or stage.ttl_in == "event" else int(stage.ttl * 1e9)
        # event-time ttl in the time column's unit (an int is one already; a timedelta
        # once the column's type is known, from a batch or a snapshot)
        self._event_ttl = stage.ttl if isinstance(stage.ttl, int) and stage.ttl_in == "event" else None
        self._time = EventTimeColumn(time_column) if time_column is not None else None
        self._next_proc = NO_TIMER
        self._evicted_at = clock()
        self._calls = 0
        self._compact_due = False
        self.broadcast: pa.Table | None = None

    # -- the operator interface ----------------------------------------------------------

    def process(self, batch: pa.RecordBatch):
        if batch.num_rows == 0:
            return [], None
        if ORDINAL in batch.schema.names:
            ordinal = batch.column(ORDINAL)[0].as_py()
            batch = batch.drop_columns([ORDINAL])
            if ordinal == 1:
                self._add_broadcast(batch)
                return [], None
        for k in self.keys:
            if k not in batch.schema.names:
                raise InvalidArgumentError(f"map_state key {k!r} is not in the stream; it has "
                                           f"{batch.schema.names}")
        slots = self.store.slots(batch)
        order = np.argsort(slots, kind="stable")
        sorted_slots = slots[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_slots[1:] != sorted_slots[:-1]]))
        key_slots = sorted_slots[starts]
        offsets = np.append(starts, len(slots)).astype(np.int64)
        group = np.repeat(np.arange(len(key_slots), dtype=np.int64), np.diff(offsets))
        rows = pa.Table.from_batches([batch]).take(pa.array(order))
        first_time = last_time = None
        if self._time is not None:
            ts = self._times(batch)[order]
            first_time = np.minimum.reduceat(ts, starts)
            last_time = np.maximum.reduceat(ts, starts)
        self._expire(key_slots, first_time)
        out = self._call(key_slots, rows, offsets, group, None, None, self._updated(last_time, len(key_slots)))
        self._maybe_compact()
        return ([out] if out is not None else []), None

    def _updated(self, event_times: np.ndarray | None, n: int) -> np.ndarray:
        """When the state written by a call was updated, in the clock its ttl counts in."""
        if self.stage.ttl_in == "event":
            return event_times if event_times is not None else np.full(n, self.watermark)
        return np.full(n, self._clock())

    def advance(self, watermark: int) -> list[pa.RecordBatch]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        outputs = self._fire("event", watermark)
        if self._event_ttl is not None:
            self._evict(watermark - self._event_ttl)
        self._maybe_compact()
        return outputs

    def tick(self) -> list[pa.RecordBatch]:
        now = self._clock()
        outputs = self._fire("processing", now) if now >= self._next_proc else []
        if self._ttl is not None and now - self._evicted_at > 1e9:
            self._evicted_at = now
            self._evict(now - self._ttl)
        self._maybe_compact()
        return outputs

    def _evict(self, horizon: int) -> None:
        """Deletes the state last updated at or before ``horizon`` (compacted after)."""
        s = self.store
        n = len(s.groups)
        gone = np.flatnonzero(s.has[:n] & (s.updated[:n] <= horizon))
        if len(gone):
            s.delete(gone)
        self._compact_due = True

    def _maybe_compact(self) -> None:
        # never inside a call or between timer rounds: compaction renumbers the slots
        if self._compact_due:
            self._compact_due = False
            self.store.compact()

    def snapshot(self) -> pa.Table | None:
        time_type = self._time.type if self._time is not None and self.stage.ttl_in == "event" else None
        return self.store.snapshot(time_type=time_type)

    # -- the broadcast stream ------------------------------------------------------------

    def _add_broadcast(self, batch: pa.RecordBatch) -> None:
        new = pa.Table.from_batches([batch])
        if self.broadcast is not None:
            if new.schema != self.broadcast.schema:
                raise InvalidArgumentError(f"the broadcast stream changed schema from "
                                           f"{self.broadcast.schema} to {new.schema}")
            new = pa.concat_tables([self.broadcast, new])
        key = self.stage.broadcast_key
        if key is not None:
            missing = [k for k in key if k not in new.column_names]
            if missing:
                raise InvalidArgumentError(f"broadcast_key {missing} is not in the broadcast "
                                           f"stream; it has {new.column_names}")
            # the latest row of each key: its last row in arrival order
            slots = Groups(list(key)).slots(new)
            last = np.full(int(slots.max()) + 1, -1, np.int64)
            _native.agg_max_i64(slots, np.arange(len(slots), dtype=np.int64), last)
            new = new.take(pa.array(np.sort(last)))
        # appending is zero-copy; copying every row at every batch would be quadratic
        self.broadcast = new.combine_chunks() if new.column(0).num_chunks > 32 else new

    def snapshot_broadcast(self) -> pa.Table | None:
        return self.broadcast

    def restore_broadcast(self, table: pa.Table) -> None:
        self.broadcast = table.combine_chunks() if table.num_rows else None

    def restore(self, table, watermark, floors=None) -> None:
        self.watermark = watermark
        if table is not None and table.num_rows:
            time_type = self.store.restore(table)
            if self._time is not None and self.stage.ttl_in == "event" and time_type is not None:
                self._resolve_time(time_type)
            self._next_proc = int(self.store.proc_timer.min()) if self.store.capacity else NO_TIMER

    # -- calls ---------------------------------------------------------------------------

    def _times(self, batch: pa.RecordBatch) -> np.ndarray:
        values = self._time.values(batch)
        self._resolve_time(self._time.type)
        return values

    def _resolve_time(self, time_type: pa.DataType) -> None:
        self._time.type = self._time.type or time_type
        if self._event_ttl is None and self.stage.ttl is not None and self.stage.ttl_in == "event":
            self._event_ttl = in_units("ttl", self.stage.ttl, time_type)

    def _expire(self, slots: np.ndarray, horizon: np.ndarray | int | None) -> None:
        """Deletes the state that expired before a call (``ttl`` after its last update) at
        event time ``horizon`` (per key: its earliest row, or its timer; at least the
        watermark), or now in processing time."""
        s = self.store
        if self.stage.ttl is None:
            return
        has = s.has[slots]
        if self._ttl is not None:
            gone = has & (s.updated[slots] <= self._clock() - self._ttl)
        elif self._event_ttl is not None and horizon is not None:
            gone = has & (s.updated[slots] <= np.maximum(horizon, self.watermark) - self._event_ttl)
        else:
            return
        if gone.any():
            s.delete(slots[gone])

    def _fire(self, kind: str, upto: int) -> list[pa.RecordBatch]:
        s = self.store
        outputs = []
        for _ in range(_MAX_TIMER_ROUNDS):
            timers = s.event_timer if kind == "event" else s.proc_timer
            n = len(s.groups)
            due = np.flatnonzero((timers[:n] <= upto) & (timers[:n] != NO_TIMER))
            if not len(due):
                break
            times = timers[due]
            order = np.lexsort((due, times))
            due, times = due[order], times[order]
            timers[due] = NO_TIMER
            # what a timer call sees does not depend on how the watermark advanced
            self._expire(due, times if kind == "event" else None)
            out = self._call(due, None, None, None, times, kind,
                             self._updated(times if kind == "event" else None, len(due)))
            if out is not None:
                outputs.append(out)
        else:
            raise InvalidArgumentError(f"map_state: timers set at or below the {kind} time "
                                       f"{upto} kept firing {_MAX_TIMER_ROUNDS} rounds")
        if kind == "processing":
            n = len(s.groups)
            self._next_proc = int(s.proc_timer[:n].min()) if n else NO_TIMER
        return outputs

    def _call(self, slots, rows, offsets, group, fired, timer, updated) -> pa.RecordBatch | None:
        s = self.store
        keys = s.groups.keys(slots)
        has = s.has[slots].copy()
        ctx = KeyedBatch(keys, s.get(slots), has, rows, offsets, group, fired, timer,
                         self.watermark, self._clock(), self.broadcast,
                         self._time.type if self._time is not None else None)
        result = self.stage.fn(ctx)
        output, new_state = result if isinstance(result, tuple) else (result, None)
        if new_state is not None:
            if self.stage.ttl_in == "event":
                # out-of-order rows never move a key's last update back
                updated = np.where(has, np.maximum(updated, s.updated[slots]), updated)
            s.put(slots, self._state_table(new_state, len(slots)), updated)
        for kind, (touched, times) in ctx._timers.items():
            target = s.event_timer if kind == "event" else s.proc_timer
            target[slots[touched]] = times[touched]
            live = touched & (times != NO_TIMER)
            if kind == "processing" and live.any():
                self._next_proc = min(self._next_proc, int(times[live].min()))
            if kind == "event" and self._time is None and live.any():
                raise InvalidArgumentError(
                    "map_state: event-time timers need event time: call with_timestamps() "
                    "upstream (and map_state(event_time=True)), or use kind='processing'")
        if ctx._delete is not None and ctx._delete.any():
            gone = slots[ctx._delete]
            s.delete(gone)
            s.event_timer[gone] = NO_TIMER
            s.proc_timer[gone] = NO_TIMER
        self._calls += 1
        if self._calls % 64 == 0:
            self._compact_due = True
        return self._output(output)

    def _state_table(self, new_state, n: int) -> pa.Table:
        schema = self.stage.state
        if isinstance(new_state, dict):
            new_state = pa.table(new_state)
        elif isinstance(new_state, pa.RecordBatch):
            new_state = pa.Table.from_batches([new_state])
        if not isinstance(new_state, pa.Table):
            raise InvalidArgumentError(f"map_state function {self.stage.label!r}: the new state "
                                       f"must be a pyarrow Table, RecordBatch or dict of arrays, "
                                       f"got {type(new_state).__name__}")
        if new_state.num_rows != n:
            raise InvalidArgumentError(f"map_state function {self.stage.label!r}: the new state "
                                       f"has {new_state.num_rows} rows for {n} keys")
        missing = [f.name for f in schema if f.name not in new_state.column_names]
        if missing:
            raise InvalidArgumentError(f"map_state function {self.stage.label!r}: the new state "
                                       f"lacks {missing} of the declared state {schema}")
        try:
            return new_state.select(schema.names).cast(schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise InvalidArgumentError(f"map_state function {self.stage.label!r}: the new state "
                                       f"does not fit the declared state {schema}: {e}") from None

    def _output(self, output) -> pa.RecordBatch | None:
        if output is None:
            return None
        if isinstance(output, pa.Table):
            output = output.combine_chunks()
            batches = output.to_batches()
            return batches[0] if batches else None
        if isinstance(output, pa.RecordBatch):
            return output if output.num_rows else None
        raise InvalidArgumentError(f"map_state function {self.stage.label!r} returned "
                                   f"{type(output).__name__}; it returns a pyarrow RecordBatch "
                                   f"or Table (or None), or (output, new_state)")


# -- the per-row form ----------------------------------------------------------------------


def per_row(create: Callable[[], object], fn: Callable) -> Callable[[KeyedBatch], object]:
    """A :class:`KeyedBatch` function that runs ``fn(state, key, row)`` for every row (in
    arrival order per key), ``state`` being a Python object per key (``create()`` for a new
    key, kept pickled between batches). ``fn`` returns an output row (a dict) or None."""
    codec = _StateCodec(create)

    def call(b: KeyedBatch):
        if b.rows is None:
            return None
        blobs = b.state["state"].to_pylist()
        key_rows = b.keys.to_pylist()
        rows = b.rows.to_pylist()
        out, new = [], []
        for i, blob in enumerate(blobs):
            state = create() if blob is None else codec.loads(blob)
            key = tuple(key_rows[i].values())
            key = key[0] if len(key) == 1 else key
            for r in rows[b.offsets[i]:b.offsets[i + 1]]:
                res = fn(state, key, r)
                if res is not None:
                    out.append(res)
            new.append(codec.dumps(state, key))
        state_table = pa.table({"state": pa.array(new, pa.binary())})
        return (pa.Table.from_pylist(out) if out else None), state_table

    call.__qualname__ = f"per_row({getattr(fn, '__qualname__', type(fn).__name__)})"
    return call


class _StateCodec:
    """Pickles per-key state objects. An instance of the class ``create()`` returns is kept
    as its attributes, not by its class's name: a class defined in the user's script is
    ``__main__.Name`` to pickle, which a Spark worker (whose ``__main__`` is PySpark's)
    cannot find; the class itself travels with ``create``."""

    def __init__(self, create):
        self.create = create
        self._cls = None

    def cls(self):
        if self._cls is None:
            self._cls = type(self.create())
        return self._cls

    def dumps(self, state, key) -> bytes:
        try:
            if type(state) is self.cls() and hasattr(state, "__dict__") \
                    and not hasattr(type(state), "__slots__"):
                return b"d" + pickle.dumps(state.__dict__)
            return b"o" + pickle.dumps(state)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise InvalidArgumentError(
                f"map_stateful: the state of key {key!r} ({type(state).__name__}) cannot be "
                f"pickled, and it must be to be snapshotted: {e}") from None

    def loads(self, blob: bytes):
        if blob[:1] == b"d":
            state = self.cls().__new__(self.cls())
            state.__dict__.update(pickle.loads(blob[1:]))
            return state
        return pickle.loads(blob[1:])


PER_ROW_STATE = pa.schema([("state", pa.binary())])


__all__ = ["KeyedBatch", "KeyedStateOperator", "KeyedStateStage", "PER_ROW_STATE", "per_row"]
