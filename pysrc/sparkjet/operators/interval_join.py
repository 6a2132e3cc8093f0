"""The stream-to-stream interval join: its stage and the operator of one processor.

A left row at event time ``t`` joins every right row with the same key whose event time
``s`` satisfies ``t + lower <= s <= t + upper`` (both bounds inclusive). Each processor
buffers both sides' rows of its partitions as Arrow tables; a batch arriving on one side
is matched against the other side's buffer by a hash join of row indices on the key
columns (:meth:`pyarrow.Table.join`) and a vectorized filter of the times, so a pair is
produced exactly once: when the second of its two rows arrives.

The watermark ``W`` (no row older than ``W`` follows) bounds the state:

- a left row can meet no further right row once ``W > t + upper``: it is dropped then
  (for ``how="left"``, emitted with null right columns if nothing ever matched it);
- a right row can meet no further left row once ``W > s - lower``: it is dropped then.

A row older than the watermark when it arrives may have lost its partners already: it is
too late, counted in the job's late events like a window's, and not joined.

The output's event time is the left row's (its column keeps the left input's name). A
pair can be produced up to ``upper`` after the watermark has passed its left time, so the
processor holds its output watermark back by ``max(upper, 0)``: a window after the join
sees no late rows.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sparkjet._batches import split_by
from sparkjet._keys import join_keys
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.base import ORDINAL, Operator, OperatorStage
from sparkjet.operators.time import MAX_TIME, MIN_TIME, in_units, time_values

HOWS = ("inner", "left")
LEFT, RIGHT = 0, 1
_SIDE = "__side"
_MATCHED = "__matched"
_PREFIX = ("__l__", "__r__")
_INDEX = "__row"
_MAX_CHUNKS = 32


@dataclass(frozen=True, kw_only=True)
class IntervalJoinStage(OperatorStage):
    """``keys`` of the left input joined to ``right_keys`` of the right one, for right
    times in ``[t + lower, t + upper]``; ``how`` is "inner" or "left". Right columns whose
    name the left side already has get ``right_suffix`` (a right key named like its left
    key is left out: it holds the same values)."""

    keys: tuple
    right_keys: tuple
    lower: object                    # int (the time column's unit) or timedelta
    upper: object
    how: str
    right_suffix: str
    output_time: str | None = None   # the left input's event-time column

    kind = "interval_join"
    arity = 2
    event_time = True

    def key_of(self, ordinal: int):
        keys = self.keys if ordinal == LEFT else self.right_keys
        return keys[0] if len(keys) == 1 else list(keys)

    def describe(self) -> dict:
        return {"on": [list(self.keys), list(self.right_keys)],
                "between": [str(self.lower), str(self.upper)], "how": self.how,
                "right_suffix": self.right_suffix}

    def make_operator(self, time_column: str | None):
        return IntervalJoinOperator(self, time_column)


def interval_join_stage(on, between, how: str, right_suffix: str, *, same_input: bool,
                        times: tuple) -> IntervalJoinStage:
    """Checks the arguments of :meth:`sparkjet.pipeline.Pipeline.join_interval` and builds
    its stage: ``same_input`` when both sides are one stream, ``times`` the event-time
    columns of the two inputs (None: none yet; the DAG then refuses the join with its own
    message)."""
    if how not in HOWS:
        raise InvalidArgumentError(f"join_interval(how=...) takes one of {list(HOWS)}, got {how!r}")
    left_keys, right_keys = join_keys(on, "join_interval", ("left", "right"))
    lower, upper = _parse_between(between)
    if not isinstance(right_suffix, str) or not right_suffix:
        raise InvalidArgumentError(f"right_suffix must be a non-empty string, got {right_suffix!r}")
    if same_input:
        raise InvalidArgumentError(
            "join_interval() of a stream with itself: branch it through a stateless step "
            "first, e.g. stream.filter(...).join_interval(stream.filter(...), ...), so that "
            "each side is its own input")
    if None not in times and times[0] != times[1]:
        raise InvalidArgumentError(
            f"join_interval(): the two inputs' event times are in columns {times[0]!r} and "
            f"{times[1]!r}; give them one name (map_batches or rename before with_timestamps)")
    return IntervalJoinStage(keys=left_keys, right_keys=right_keys, lower=lower, upper=upper,
                             how=how, right_suffix=right_suffix, output_time=times[0])


def _parse_between(between) -> tuple:
    if not isinstance(between, (tuple, list)) or len(between) != 2:
        raise InvalidArgumentError(f"join_interval(between=...) takes (lower, upper), got {between!r}")
    lower, upper = between
    for name, v in (("lower", lower), ("upper", upper)):
        if isinstance(v, datetime.timedelta):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or abs(v) >= 2**62:
            raise InvalidArgumentError(f"join_interval(between=...): {name} must be an int (the "
                                       f"event time's unit, |v| < 2**62) or a timedelta, got {v!r}")
    if isinstance(lower, datetime.timedelta) != isinstance(upper, datetime.timedelta):
        raise InvalidArgumentError(f"join_interval(between=...) takes two ints or two "
                                   f"timedeltas, got {between!r}")
    if lower > upper:
        raise InvalidArgumentError(f"join_interval(between=(lower, upper)): lower {lower!r} is "
                                   f"above upper {upper!r}; no row could ever match")
    return lower, upper


def _clip(v: int) -> int:
    return max(MIN_TIME, min(MAX_TIME, v))


class _Side:
    """The buffered rows of one input: a table, their times, and (left) whether each has
    matched a right row yet."""

    def __init__(self):
        self.schema: pa.Schema | None = None
        self.table: pa.Table | None = None
        self.times = np.zeros(0, np.int64)
        self.matched = np.zeros(0, bool)

    @property
    def rows(self) -> int:
        return len(self.times)

    def append(self, rows: pa.Table, times: np.ndarray, matched: np.ndarray) -> None:
        if not rows.num_rows:
            return
        if self.table is not None and not rows.schema.equals(self.table.schema):
            rows = rows.cast(self.table.schema)
        self.table = rows if self.table is None else pa.concat_tables([self.table, rows])
        if self.table.num_columns and self.table.column(0).num_chunks > _MAX_CHUNKS:
            # every match reads the whole buffer: many small chunks make that slow
            self.table = self.table.combine_chunks()
        self.times = np.concatenate([self.times, times])
        self.matched = np.concatenate([self.matched, matched])

    def keep(self, mask: np.ndarray) -> None:
        if mask.all():
            return
        self.table = self.table.filter(pa.array(mask)).combine_chunks() if mask.any() else None
        self.times = self.times[mask]
        self.matched = self.matched[mask]


class IntervalJoinOperator(Operator):
    """The interval join of one processor (see the module docstring)."""

    def __init__(self, stage: IntervalJoinStage, time_column: str | None):
        self.stage = stage
        self.time_column = time_column
        self.key_columns = (list(stage.keys), list(stage.right_keys))
        self.state_key = stage.key
        self.outer = stage.how == "left"
        self.watermark = MIN_TIME
        self._floors = None
        self._time_type: pa.DataType | None = None
        self.lower = self.upper = None
        if not isinstance(stage.lower, datetime.timedelta):
            self.lower, self.upper = stage.lower, stage.upper
        self._sides = (_Side(), _Side())
        self._out_names: list[str] | None = None

    # -- setup ---------------------------------------------------------------------------

    def _resolve(self, time_type: pa.DataType) -> None:
        if self._time_type is not None:
            if time_type != self._time_type:
                raise InvalidArgumentError(
                    f"join_interval: event-time column {self.time_column!r} is {time_type} on "
                    f"one side and {self._time_type} on the other (or changed type)")
            return
        self._time_type = time_type
        self.lower = in_units("join_interval lower bound", self.stage.lower, time_type)
        self.upper = in_units("join_interval upper bound", self.stage.upper, time_type)

    def _check_schema(self, side: int, schema: pa.Schema) -> None:
        s = self._sides[side]
        if s.schema is not None:
            # names and types: a restored table's fields may differ in nullability only
            if [(f.name, f.type) for f in schema] != [(f.name, f.type) for f in s.schema]:
                raise InvalidArgumentError(
                    f"join_interval: the {_NAME[side]} input's schema changed from\n{s.schema}\n"
                    f"to\n{schema}")
            return
        what = f"join_interval: the {_NAME[side]} input"
        if self.time_column not in schema.names:
            raise InvalidArgumentError(f"{what} has no event-time column {self.time_column!r}; "
                                       f"it has {schema.names}")
        for k in self.key_columns[side]:
            if k not in schema.names:
                raise InvalidArgumentError(f"{what} has no key column {k!r}; it has {schema.names}")
        other = self._sides[1 - side].schema
        if other is not None:
            for a, b in zip(self.key_columns[side], self.key_columns[1 - side]):
                if schema.field(a).type != other.field(b).type:
                    raise InvalidArgumentError(
                        f"join_interval: key {a!r} is {schema.field(a).type} on the {_NAME[side]} "
                        f"side but {b!r} is {other.field(b).type} on the other; cast one so "
                        f"that equal keys land in the same partition")
        s.schema = schema
        self._out_names = None

    # -- the operator interface ----------------------------------------------------------

    def process(self, batch: pa.RecordBatch):
        if batch.num_rows == 0:
            return [], None
        if ORDINAL not in batch.schema.names:
            raise InvalidArgumentError(f"join_interval: a batch without its {ORDINAL!r} column")
        ordinals = batch.column(ORDINAL).to_numpy(zero_copy_only=False)
        batch = batch.drop_columns([ORDINAL])
        outputs, late = [], []
        for side, rows in split_by(batch, ordinals):
            out, too_late = self._process_side(side, rows)
            outputs += out
            if too_late is not None:
                late.append(too_late)
        # the late rows are counted (the stage has no late sink): one batch of either side
        return outputs, (late[0] if len(late) == 1 else _count_only(late))

    def _process_side(self, side: int, batch: pa.RecordBatch):
        self._check_schema(side, batch.schema)
        column = batch.column(self.time_column)
        self._resolve(column.type)
        ts = time_values(column, self.time_column)
        on_time = ts >= self.watermark
        if self._floors is not None:
            on_time &= ts >= self._floor_of(side, batch)
        late = None
        if not on_time.all():
            late = batch.filter(pa.array(~on_time))
            batch, ts = batch.filter(pa.array(on_time)), ts[on_time]
            if batch.num_rows == 0:
                return [], late
        rows = pa.Table.from_batches([batch])
        outputs = []
        matched = np.zeros(len(ts), bool)
        other = self._sides[1 - side]
        if other.rows:
            mine_idx, other_idx = self._match(side, rows, ts, other)
            if len(mine_idx):
                if side == LEFT:
                    matched[mine_idx] = True
                    outputs.append(self._pairs(rows, mine_idx, other.table, other_idx))
                else:
                    other.matched[other_idx] = True
                    outputs.append(self._pairs(other.table, other_idx, rows, mine_idx))
        self._sides[side].append(rows, ts, matched)
        return outputs, late

    def _floor_of(self, side: int, batch: pa.RecordBatch) -> np.ndarray:
        """Each row's partition's watermark before a restart (see
        :class:`~sparkjet.runtime.watermarks.PartitionFloors`): a row below it was too
        late then, and is so now."""
        if self.watermark >= self._floors.top:
            self._floors = None
            return np.full(batch.num_rows, MIN_TIME, np.int64)
        return self._floors.of(batch, key=self.stage.key_of(side))

    def _match(self, side: int, rows: pa.Table, ts: np.ndarray, other: _Side):
        """Row indices ``(mine, other's)`` of the pairs whose keys are equal and whose
        times are within the interval."""
        mine_keys, other_keys = self.key_columns[side], self.key_columns[1 - side]
        names = [f"__k{i}" for i in range(len(mine_keys))]
        a = pa.table([*(rows.column(k) for k in mine_keys),
                      pa.array(np.arange(rows.num_rows, dtype=np.int64))], names=[*names, _INDEX])
        b = pa.table([*(other.table.column(k) for k in other_keys),
                      pa.array(np.arange(other.rows, dtype=np.int64))], names=[*names, "__other"])
        # the smaller table is the build side (Acero builds the hash table on the right)
        j = a.join(b, names, join_type="inner") if rows.num_rows >= other.rows \
            else b.join(a, names, join_type="inner")
        mine = j.column(_INDEX).to_numpy()
        theirs = j.column("__other").to_numpy()
        t_mine, t_other = ts[mine], other.times[theirs]
        left_t, right_t = (t_mine, t_other) if side == LEFT else (t_other, t_mine)
        d = right_t - left_t
        ok = (d >= self.lower) & (d <= self.upper)
        return mine[ok], theirs[ok]

    def advance(self, watermark: int) -> list[pa.RecordBatch]:
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        outputs = []
        left, right = self._sides
        if left.rows:
            gone = left.times < _clip(watermark - self.upper)
            if self.outer and gone.any():
                unmatched = gone & ~left.matched
                if unmatched.any():
                    outputs.append(self._unmatched(left.table.filter(pa.array(unmatched))))
            left.keep(~gone)
        if right.rows:
            right.keep(right.times >= _clip(watermark + self.lower))
        return outputs

    def output_watermark(self, watermark: int) -> int:
        """The watermark the output can promise. An output row's event time is its left
        row's: a left row still buffered (it may yet meet a right row, or be emitted
        unmatched), or one still to come, at or after ``watermark`` (else it is late). So
        the promise is the least of ``watermark`` and the buffered left times: it never
        goes back, and needs no unit for the bounds."""
        if watermark == MAX_TIME:
            return MAX_TIME
        left = self._sides[LEFT]
        return min(watermark, int(left.times.min())) if len(left.times) else watermark

    # -- output --------------------------------------------------------------------------

    def _output_names(self) -> list[str]:
        if self._out_names is None:
            left, right = self._sides[LEFT].schema, self._sides[RIGHT].schema
            names = list(left.names)
            same = {b for a, b in zip(*self.key_columns) if a == b}
            for c in right.names:
                if c in same:
                    continue
                name = c if c not in left.names else c + self.stage.right_suffix
                if name in names:
                    raise InvalidArgumentError(
                        f"join_interval: the right column {c!r} would be named {name!r}, which "
                        f"the output already has; pick another right_suffix or rename it")
                names.append(name)
            self._out_names = names
        return self._out_names

    def _right_columns(self) -> list[str]:
        same = {b for a, b in zip(*self.key_columns) if a == b}
        return [c for c in self._sides[RIGHT].schema.names if c not in same]

    def _pairs(self, left: pa.Table, li: np.ndarray, right: pa.Table, ri: np.ndarray):
        lt = left.take(pa.array(li))
        rt = right.select(self._right_columns()).take(pa.array(ri))
        return _batch([*lt.columns, *rt.columns], self._output_names())

    def _unmatched(self, left: pa.Table) -> pa.RecordBatch:
        right = self._sides[RIGHT].schema
        if right is None:
            # no right row has reached this processor yet: its columns are unknown
            return _batch(left.columns, left.column_names)
        n = left.num_rows
        nulls = [pa.nulls(n, right.field(c).type) for c in self._right_columns()]
        return _batch([*left.columns, *nulls], self._output_names())

    # -- snapshots -----------------------------------------------------------------------

    def snapshot(self) -> pa.Table | None:
        """Both sides' buffered rows in one table: the key (under the left key's names,
        so the table splits by partition), ``__side``, ``__matched``, then the left and
        the right columns prefixed ``__l__`` and ``__r__`` (null in the other side's rows;
        absent while this processor has seen no row of that side)."""
        parts = [self._side_table(side) for side in (LEFT, RIGHT) if self._sides[side].rows]
        return pa.concat_tables(parts) if parts else None

    def _side_table(self, side: int) -> pa.Table:
        s = self._sides[side]
        n = s.rows
        columns = {k: s.table.column(own)
                   for k, own in zip(self.key_columns[LEFT], self.key_columns[side])}
        columns[_SIDE] = pa.array(np.full(n, side, np.int8))
        columns[_MATCHED] = pa.array(s.matched)
        for which in (LEFT, RIGHT):
            schema = self._sides[which].schema
            if schema is None:
                continue
            for c in schema.names:
                columns[_PREFIX[which] + c] = (s.table.column(c) if which == side
                                               else pa.nulls(n, schema.field(c).type))
        return pa.table(columns)

    def restore(self, table: pa.Table | None, watermark: int, floors=None) -> None:
        self.watermark = watermark
        self._floors = floors
        if table is None:
            return
        sides = table.column(_SIDE).to_numpy(zero_copy_only=False) if table.num_rows else \
            np.zeros(0, np.int8)
        for side in (LEFT, RIGHT):
            names = [c for c in table.column_names if c.startswith(_PREFIX[side])]
            if not names:
                continue
            rows = table.filter(pa.array(sides == side)).select(names)
            rows = rows.rename_columns([c[len(_PREFIX[side]):] for c in names])
            self._check_schema(side, rows.schema)
            if not rows.num_rows:
                continue
            column = rows.column(self.time_column)
            self._resolve(column.type)
            matched = table.filter(pa.array(sides == side)).column(_MATCHED)
            self._sides[side].append(rows.combine_chunks(), time_values(column, self.time_column),
                                     matched.to_numpy(zero_copy_only=False).astype(bool))


_NAME = ("left", "right")


def _batch(columns, names) -> pa.RecordBatch:
    arrays = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in columns]
    return pa.RecordBatch.from_arrays(arrays, names=names)


def _count_only(late: list) -> pa.RecordBatch | None:
    """Late rows of both sides (of two schemas) as one batch of as many rows: only
    their number is kept, as the stage has no late side output."""
    if not late:
        return None
    return pa.record_batch({"rows": pa.array(np.zeros(sum(b.num_rows for b in late), np.int8))})


__all__ = ["IntervalJoinOperator", "IntervalJoinStage", "interval_join_stage"]
