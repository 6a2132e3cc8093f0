"""The aggregated columns of rolling and windowed aggregations: their kind, their per-slot
state arrays, the native kernels that update them, and the typed output.

Each aggregated column has one of three kinds, fixed by its Arrow type the first time the
operator sees it (in a batch, or in a restored snapshot's state):

- ``int``: integer columns. ``sum`` is exact: int64, and an overflow fails with
  :class:`~sparkjet.errors.AggregateOverflowError` naming the stage, column and key, unless
  the stage was declared with ``overflow="decimal"``, which sums into decimal128(38, 0)
  (exact up to 10^38 - 1; beyond, it fails the same way). ``mean`` sums in 128 bits when the
  column has no ``sum`` of its own, so a mean never overflows. ``min``, ``max``, ``first`` and
  ``last`` keep the column's type.
- ``time``: timestamps (any unit and time zone), durations, dates and times, kept as their
  int64 count of units: ``min``, ``max``, ``first`` and ``last`` keep the type; a duration's
  ``sum`` is a duration of the same unit (int64, overflow fails); ``mean`` and the sum of a
  point in time are refused.
- ``float``: everything else that casts to float64 (floats, decimals, booleans), aggregated
  as float64, as before sparkjet kept integers exact.

A job restored from a snapshot taken before integers were exact (its state columns of an
integer column are float64) keeps that column's aggregates in float64, so its output schema
does not change under its sinks; run the pipeline under a new job name to switch.

Nulls are skipped, as SQL skips them: a null counts for ``count`` (every row) but not for the
other operations, which are null for a group whose values are all null. NaN is a value: it
makes sum, mean, min and max NaN. ``first`` and ``last`` are the first and last non-null
values in the order the operator receives rows (for windows: within a pane, and pane after
pane in event-time order; for sessions, merged sessions in the order they began).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet._batches import one_array
from sparkjet.errors import AggregateOverflowError, InvalidArgumentError

#: What ``aggregate(..., overflow=...)`` takes: how an integer ``sum`` past int64 ends.
OVERFLOW = ("fail", "decimal")
#: The type of an integer sum with ``overflow="decimal"``.
DECIMAL = pa.decimal128(38, 0)

FLOAT, INT, TIME = "float", "int", "time"
#: The operations with a per-slot state array of their own (``mean`` uses ``sum``'s).
STATEFUL = ("sum", "min", "max", "first", "last")

_I64 = np.iinfo(np.int64)
_FILL = {FLOAT: {"sum": 0.0, "min": np.inf, "max": -np.inf, "first": 0.0, "last": 0.0},
         INT: {"sum": 0, "min": _I64.max, "max": _I64.min, "first": 0, "last": 0}}


def check_overflow(overflow) -> str:
    if overflow not in OVERFLOW:
        raise InvalidArgumentError(f"overflow must be one of {OVERFLOW}, got {overflow!r}")
    return overflow


def kind_of(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return INT
    if pa.types.is_temporal(t) and not pa.types.is_interval(t):
        return TIME
    return FLOAT


def _storage(t: pa.DataType) -> pa.DataType:
    """The integer type a temporal type is stored as."""
    return pa.int32() if t.bit_width == 32 else pa.int64()


def _plain(column) -> pa.Array:
    column = one_array(column)
    return column


class ValueColumns:
    """The aggregated columns of one operator: ``aggregations`` is {name: (operation,
    column)} as :func:`sparkjet.operators.rolling.parse_aggregations` gives it (user
    aggregations are left out by the caller); ``stage`` names the stage in errors."""

    def __init__(self, aggregations: dict, overflow: str = "fail", stage: str = "aggregate"):
        self.overflow = check_overflow(overflow)
        self.stage = stage
        ops: dict[str, set] = {}
        for op, c in aggregations.values():
            if c is not None:
                ops.setdefault(c, set()).add(op)
        self.requested = ops
        #: column -> the operations with a state array, sorted
        self.ops = {c: sorted({"sum" if op == "mean" else op for op in o}) for c, o in ops.items()}
        self.columns = sorted(ops)
        self.kinds: dict[str, str] = {}
        self.types: dict[str, pa.DataType | None] = {}   # None: an int known by its sum alone

    # -- kinds -------------------------------------------------------------------------

    def _lock(self, c: str, t: pa.DataType, *, exact: bool = True) -> None:
        kind = kind_of(t)
        if c not in self.kinds:
            if kind == TIME:
                bad = sorted(self.requested[c] & ({"mean"} if pa.types.is_duration(t)
                                                  else {"sum", "mean"}))
                if bad:
                    raise InvalidArgumentError(
                        f"stage {self.stage!r}: {' and '.join(bad)} of column {c!r} ({t}) is "
                        f"not defined; min, max, first and last keep its type"
                        + ("" if pa.types.is_duration(t) else ", and a duration sums"))
            self.kinds[c] = kind
            self.types[c] = t if exact or kind != INT else None
            return
        if self.kinds[c] == FLOAT:
            return                            # anything castable to float64, as always
        known = self.types[c]
        if kind != self.kinds[c] or known is not None and exact and t != known:
            raise InvalidArgumentError(
                f"stage {self.stage!r}: aggregated column {c!r} changed type from "
                f"{known or 'an integer'} to {t}")
        if known is None and exact:
            self.types[c] = t

    def _wide(self, c: str) -> bool:
        """Whether ``c``'s sum is kept in 128 bits."""
        return self.kinds.get(c) == INT and (self.overflow == "decimal"
                                             or "sum" not in self.requested[c])

    def lock_schema(self, schema: pa.Schema) -> None:
        """Fixes the kinds of the columns ``schema`` has (an empty batch's)."""
        for c in self.columns:
            if c in schema.names:
                self._lock(c, schema.field(c).type)

    # -- values of a batch -------------------------------------------------------------

    def values(self, column, c: str) -> tuple[np.ndarray, np.ndarray | None]:
        """A batch's column ``c`` as float64 or int64 values (nulls as 0), and the mask of
        its valid rows when it has nulls (None when it has none)."""
        column = _plain(column)
        self._lock(c, column.type)
        kind = self.kinds[c]
        if kind == FLOAT:
            try:
                values = column.cast(pa.float64())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise InvalidArgumentError(f"stage {self.stage!r}: aggregated column {c!r} is "
                                           f"not numeric: {e}") from None
            fill = 0.0
        elif kind == INT:
            try:
                values = column.cast(pa.int64())
            except pa.ArrowInvalid as e:      # a uint64 past int64
                raise AggregateOverflowError(f"stage {self.stage!r}: aggregated column {c!r} "
                                             f"has a value past int64: {e}", column=c) from None
            fill = 0
        else:
            values = column.cast(_storage(column.type)).cast(pa.int64())
            fill = 0
        if not values.null_count:
            return np.ascontiguousarray(values.to_numpy(zero_copy_only=False)), None
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        return np.ascontiguousarray(values.fill_null(fill).to_numpy()), valid

    # -- state arrays ------------------------------------------------------------------

    def keys(self):
        """The (operation, column) of every state array whose column's kind is known."""
        return [(op, c) for c in self.columns if c in self.kinds for op in self.ops[c]]

    def new_array(self, op: str, c: str, capacity: int) -> np.ndarray:
        kind = self.kinds[c]
        if op == "sum" and self._wide(c):
            return np.zeros((capacity, 2), np.int64)
        if kind == FLOAT:
            return np.full(capacity, _FILL[FLOAT][op], np.float64)
        return np.full(capacity, _FILL[INT][op], np.int64)

    def resized(self, arr: np.ndarray, op: str, c: str, capacity: int) -> np.ndarray:
        out = self.new_array(op, c, capacity)
        out[: len(arr)] = arr
        return out

    # -- updates -------------------------------------------------------------------------

    def add_rows(self, c: str, slots: np.ndarray, values: np.ndarray, valid: np.ndarray | None,
                 states: dict, seen: dict, key_of_row: Callable[[int], dict] | None) -> None:
        """Adds rows (``values``, ``valid`` from :meth:`values`) into the state arrays of
        column ``c`` (``states[(op, c)]``; ``seen[c]``, one byte per slot, for ``first``)."""
        floats = self.kinds[c] == FLOAT
        kept_slots = kept = None
        for op in self.ops[c]:
            arr = states[(op, c)]
            if op == "sum":
                self._sum(c, slots, values, arr, key_of_row, None)
            elif op in ("min", "max"):
                v = values if valid is None else np.where(
                    valid, values, _FILL[FLOAT if floats else INT][op]).astype(values.dtype)
                getattr(_native, f"agg_{op}" if floats else f"agg_{op}_i64")(slots, v, arr)
            else:
                if kept is None:
                    kept_slots, kept = ((slots, values) if valid is None else
                                        (np.ascontiguousarray(slots[valid]),
                                         np.ascontiguousarray(values[valid])))
                self._first_last(op, c, kept_slots, kept, arr, seen)

    def combine(self, c: str, slots: np.ndarray, other: dict, present: np.ndarray | None,
                size: int, states: dict, seen: dict, key_of_slot: Callable[[int], dict] | None
                ) -> None:
        """Adds the partial state of ``size`` slots (``other[(op, c)]``; ``present``: which
        of them have a value, None for all) into ``slots`` of these states."""
        floats = self.kinds[c] == FLOAT
        for op in self.ops[c]:
            arr, part = states[(op, c)], other[(op, c)][:size]
            if op == "sum":
                self._sum(c, slots, part, arr, None, key_of_slot)
            elif op in ("min", "max"):
                getattr(_native, f"agg_{op}" if floats else f"agg_{op}_i64")(slots, part, arr)
            elif present is None:
                self._first_last(op, c, slots, part, arr, seen)
            else:
                self._first_last(op, c, np.ascontiguousarray(slots[present]),
                                 np.ascontiguousarray(part[present]), arr, seen)

    def as_state(self, op: str, c: str, part: np.ndarray) -> np.ndarray | None:
        """The state array that :meth:`combine` makes of ``part`` (of a snapshot's state, by
        :meth:`restored`) in fresh arrays at slots 0, 1, ...: a new array, or None where
        only the kernels make it (first and last keep seen flags; a sum changing width)."""
        if op == "sum":
            if self.kinds[c] == FLOAT:
                return part + 0.0           # as the kernel's 0.0 + x (-0.0 becomes 0.0)
            return owned(part) if part.ndim == (2 if self._wide(c) else 1) else None
        if op in ("min", "max") and part.ndim == 1:
            return owned(part)              # x against the fill (inf; a NaN is taken)
        return None

    def _first_last(self, op, c, slots, values, arr, seen) -> None:
        suffix = "" if self.kinds[c] == FLOAT else "_i64"
        if op == "first":
            getattr(_native, "agg_first" + suffix)(slots, values, arr, seen[c])
        else:
            getattr(_native, "agg_last" + suffix)(slots, values, arr)

    def _sum(self, c, slots, values, arr, key_of_row, key_of_slot) -> None:
        if self.kinds[c] == FLOAT:
            _native.agg_sum(slots, values, arr)
            return
        try:
            if arr.ndim == 2:
                _native.agg_sum_i128(slots, values, arr)
            elif values.ndim == 2:            # a decimal partial into an int64 sum
                _native.agg_sum_i64(slots, _narrow(values, self.stage, c), arr)
            else:
                _native.agg_sum_i64(slots, values, arr)
        except AggregateOverflowError as e:
            i = e.index
            key = (key_of_row(i) if key_of_row is not None else
                   key_of_slot(int(slots[i])) if key_of_slot is not None else None)
            limit = "decimal128(38, 0)" if arr.ndim == 2 else "int64"
            hint = "" if arr.ndim == 2 else (
                "; declare the aggregate with overflow=\"decimal\" to sum into "
                "decimal128(38, 0)" if self.kinds[c] == INT else "")
            where = f"key {key}" if key is not None else f"slot {int(slots[i])}"
            raise AggregateOverflowError(
                f"stage {self.stage!r}: the sum of column {c!r} overflows {limit} for {where}"
                f"{hint}", i, c, key) from None

    # -- output --------------------------------------------------------------------------

    def output_type(self, op: str, c: str) -> pa.DataType:
        if op == "count":
            return pa.int64()
        kind = self.kinds.get(c, FLOAT)
        if op == "mean" or kind == FLOAT:
            return pa.float64()
        if op == "sum":
            return DECIMAL if self._wide(c) else (self.types[c] if kind == TIME else pa.int64())
        return self.types[c] or pa.int64()

    def output(self, op: str, c: str, values: np.ndarray, counts: np.ndarray,
               nulls: np.ndarray | None) -> pa.Array:
        """The output of ``op`` for groups whose state is ``values`` (sums for ``mean``),
        of ``counts`` rows of which ``nulls`` were null: null where all were."""
        empty = None if nulls is None else (counts - nulls) == 0
        if op == "mean":
            total = _as_float(values)
            present = counts if nulls is None else np.where(empty, 1, counts - nulls)
            return pa.array(total / present, mask=empty)
        kind = self.kinds.get(c, FLOAT)
        if kind == FLOAT:
            return pa.array(values, mask=empty)
        if values.ndim == 2:
            return _decimals(values, empty)
        out = pa.array(values, pa.int64(), mask=empty)
        t = self.output_type(op, c)
        if t == pa.int64():
            return out
        if kind == TIME:
            return out.cast(_storage(t)).cast(t)
        return out.cast(t)                    # min/max/first/last of a narrower integer

    # -- snapshots -----------------------------------------------------------------------

    def snapshot_column(self, op: str, c: str, values: np.ndarray,
                        present: np.ndarray | None) -> pa.Array:
        """A state array as a snapshot column, in the type its output has: null for the
        slots with no value (``present`` False; None: all have one)."""
        if self.kinds[c] == FLOAT:
            return pa.array(values)           # (as before: inf for a min of no value)
        n = len(values)
        nulls = None if present is None else (~present).astype(np.int64)
        return self.output(op, c, values, np.ones(n, np.int64), nulls)

    def adopt(self, table) -> None:
        """Fixes the kinds of the columns a snapshot's state (``__{op}__{column}``) has."""
        for c in self.columns:
            for op in self.ops[c]:
                name = f"__{op}__{c}"
                if name not in table.column_names:
                    continue
                t = table.schema.field(name).type
                if pa.types.is_decimal(t):
                    t = pa.int64()
                # an int's sum says it is an int, not which (min and max say which)
                self._lock(c, t, exact=op != "sum" or kind_of(t) != INT)

    def restored(self, op: str, c: str, column) -> np.ndarray:
        """A snapshot column of state, as the values :meth:`combine` takes (its nulls,
        slots with no value, as the operation's fill)."""
        column = _plain(column)
        t = column.type
        if self.kinds[c] == FLOAT:
            return np.ascontiguousarray(column.cast(pa.float64()).to_numpy(zero_copy_only=False))
        valid = column.is_valid().to_numpy(zero_copy_only=False) if column.null_count else None
        if pa.types.is_decimal(t):
            wide = _decimal_words(column.cast(DECIMAL))
            if valid is not None:
                wide[~valid] = 0
            return wide if op != "sum" or self._wide(c) else _narrow(wide, self.stage, c)
        if kind_of(t) == TIME:
            column = column.cast(_storage(t))
        ints = column.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).copy()
        if valid is not None:
            ints[~valid] = _FILL[INT][op]
        if op == "sum" and self._wide(c):
            return np.ascontiguousarray(np.stack([ints, ints >> 63], axis=1))
        return np.ascontiguousarray(ints)


def owned(arr: np.ndarray) -> np.ndarray:
    """``arr`` if it owns its memory and may be written (an integer column :meth:`restored`
    copied), else a copy (a view of Arrow's read-only buffers)."""
    return arr if arr.flags.owndata and arr.flags.writeable else np.array(arr)


def _decimals(words: np.ndarray, empty: np.ndarray | None) -> pa.Array:
    words = np.ascontiguousarray(words, np.int64)
    n = len(words)
    validity = None
    if empty is not None and empty.any():
        validity = pa.array(~empty).buffers()[1]
    return pa.Array.from_buffers(DECIMAL, n, [validity, pa.py_buffer(words)],
                                 null_count=-1 if validity is not None else 0)


def _decimal_words(column: pa.Array) -> np.ndarray:
    """A decimal128 array's values as (n, 2) int64 words (a copy)."""
    data = np.frombuffer(column.buffers()[1], np.int64, count=2 * (column.offset + len(column)))
    return data[2 * column.offset:].reshape(-1, 2).copy()


def _narrow(words: np.ndarray, stage: str, c: str) -> np.ndarray:
    lo, hi = words[:, 0], words[:, 1]
    fits = hi == (lo >> 63)
    if not fits.all():
        i = int(np.flatnonzero(~fits)[0])
        raise AggregateOverflowError(
            f"stage {stage!r}: a restored sum of column {c!r} does not fit int64 (it was "
            f"taken with overflow=\"decimal\"); keep overflow=\"decimal\"", i, c)
    return np.ascontiguousarray(lo)


def _as_float(values: np.ndarray) -> np.ndarray:
    if values.ndim == 2:
        lo, hi = values[:, 0], values[:, 1]
        # (a sum that fits int64 directly: -1 * 2^64 + (2^64 - 5) would cancel to 0)
        return np.where(hi == lo >> 63, lo.astype(np.float64),
                        hi.astype(np.float64) * 2.0**64 + lo.view(np.uint64).astype(np.float64))
    return values.astype(np.float64, copy=False)


__all__ = ["DECIMAL", "FLOAT", "INT", "OVERFLOW", "STATEFUL", "TIME", "ValueColumns",
           "check_overflow", "kind_of"]
