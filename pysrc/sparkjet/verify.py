"""A checker of processing guarantees, reporting like Jepsen's set checker (seed 001).

Jepsen's analysis of Hazelcast prints, for a set of elements added during a test::

    {:valid? false,
     :lost "#{1703..1704 1706..1707}",
     :recovered "#{}",
     :ok "#{1..2 4..36 ... 3724 3727..3728}",
     :recovered-frac 0,
     :unexpected-frac 0,
     :unexpected "#{}",
     :lost-frac 2/1865,
     :ok-frac 1221/1865}

:func:`check_events` gives the same report for a job: which event ids the source offered
(*attempted*), which were confirmed (*acknowledged*: covered by a completed snapshot or a
committed output), and which the sink's committed output holds, with multiplicity. It adds
what a pipeline can do and a set cannot: *duplicated* ids. :func:`check_aggregates` compares
a keyed aggregation's final rows with a failure-free run and gives the same report by key
(:func:`last_update_per_key` finds those rows in a sink that received every update).
Fractions are of the attempted events, as in Jepsen's output, and print as exact ratios.

What each guarantee promises (``Report.valid``):

- ``exactly-once``: nothing lost, nothing duplicated, nothing unexpected;
- ``at-least-once``: nothing lost, nothing unexpected (duplicates allowed);
- ``none``: nothing unexpected; loss is reported (``missing``), never hidden.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet._batches import one_array
from sparkjet.connectors.base import GUARANTEES
from sparkjet.errors import InvalidArgumentError, UnsupportedTypeError

_SHOWN_RUNS = 2     # runs printed at each end of a long set, like Jepsen's "... "


@dataclass(frozen=True, eq=False)
class Report:
    """The verdict of one check, and the ids (or keys) behind it.

    Counts are of events (rows): for :func:`check_events`, ``lost_count`` is the number of
    acknowledged ids missing from the output, ``duplicated_count`` the number of extra
    copies, ``unexpected_count`` the output rows whose id was never attempted; for
    :func:`check_aggregates` they are the events a key's count is short of, or over, the
    expected count. The id fields are sorted numpy arrays (integer ids or keys) or lists
    (other keys; tuples for keys of several columns).
    """

    kind: str                   # "events" or "aggregates"
    guarantee: str
    valid: bool
    attempted_count: int
    acknowledged_count: int
    output_count: int           # rows (events) found in the output
    ok: Sequence                # acknowledged and found (aggregates: keys that match)
    lost: Sequence              # acknowledged, not found (aggregates: keys with too low a count)
    missing: Sequence           # attempted, not found (aggregates: keys absent from the output)
    recovered: Sequence         # found though never acknowledged
    duplicated: Sequence        # found more than once (aggregates: keys with too high a count)
    unexpected: Sequence        # found, never attempted
    mismatched: Sequence        # aggregates: keys whose count is right but another column is not
    ok_count: int
    lost_count: int
    missing_count: int
    duplicated_count: int
    unexpected_count: int

    def valid_for(self, guarantee: str) -> bool:
        """Whether the output keeps `guarantee`'s promise (see the module doc)."""
        _check_guarantee(guarantee)
        if self.unexpected_count or len(self.unexpected):
            return False
        if guarantee == "none":
            return True
        if self.lost_count or len(self.lost) or len(self.mismatched):
            return False
        return guarantee == "at-least-once" or not (self.duplicated_count or len(self.duplicated))

    def _frac(self, n: int) -> Fraction:
        return Fraction(int(n), self.attempted_count) if self.attempted_count else Fraction(0)

    @property
    def ok_frac(self) -> Fraction:
        return self._frac(self.ok_count)

    @property
    def lost_frac(self) -> Fraction:
        return self._frac(self.lost_count)

    @property
    def missing_frac(self) -> Fraction:
        return self._frac(self.missing_count)

    @property
    def recovered_frac(self) -> Fraction:
        return self._frac(len(self.recovered))

    @property
    def duplicated_frac(self) -> Fraction:
        return self._frac(self.duplicated_count)

    @property
    def unexpected_frac(self) -> Fraction:
        return self._frac(self.unexpected_count)

    _SETS = ("ok", "lost", "missing", "recovered", "duplicated", "unexpected", "mismatched")
    _COUNTS = ("attempted_count", "acknowledged_count", "output_count", "ok_count", "lost_count",
               "missing_count", "duplicated_count", "unexpected_count")
    _FRACS = ("ok_frac", "lost_frac", "missing_frac", "recovered_frac", "duplicated_frac",
              "unexpected_frac")

    def to_dict(self, max_ids: int | None = None) -> dict:
        """Plain JSON-able data: counts, fractions (floats) and the ids (the first
        `max_ids` of each set when given; ``*_size`` gives each set's full size)."""
        out = {"kind": self.kind, "guarantee": self.guarantee, "valid": self.valid}
        out.update({name: int(getattr(self, name)) for name in self._COUNTS})
        out.update({name: float(getattr(self, name)) for name in self._FRACS})
        for name in self._SETS:
            values = getattr(self, name)
            out[f"{name}_size"] = len(values)
            shown = values[:max_ids] if max_ids is not None else values
            out[name] = shown.tolist() if isinstance(shown, np.ndarray) else [
                list(v) if isinstance(v, tuple) else v for v in shown]
        return out

    def __str__(self) -> str:
        lines = [f":valid? {'true' if self.valid else 'false'}",
                 f':guarantee "{self.guarantee}"']
        lines += [f":{name.replace('_', '-')} {getattr(self, name)}" for name in self._COUNTS]
        for name in self._SETS:
            if name != "mismatched" or self.kind == "aggregates":
                lines.append(f':{name} "{_render_set(getattr(self, name))}"')
        lines += [f":{name.replace('_', '-')} {getattr(self, name)}" for name in self._FRACS]
        return "{" + ",\n ".join(lines) + "}"


def _check_guarantee(guarantee: str) -> None:
    if guarantee not in GUARANTEES:
        raise InvalidArgumentError(f"guarantee must be one of {GUARANTEES}, got {guarantee!r}")


def _render_set(values: Sequence) -> str:
    """Jepsen's set notation: ``#{1..2 4..36 ... 3724 3727..3728}`` (runs of consecutive
    integers; the first and last few runs or values of a long set)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu" and len(values):
        breaks = np.flatnonzero(np.diff(values) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(values)])) - 1
        shown = _ends(len(starts))
        items = ["..." if i is None else str(values[starts[i]]) if starts[i] == ends[i]
                 else f"{values[starts[i]]}..{values[ends[i]]}" for i in shown]
    else:
        items = ["..." if i is None else _render_value(values[i]) for i in _ends(len(values))]
    return "#{" + " ".join(items) + "}"


def _ends(n: int) -> list:
    """Indexes of the items to print, None where some are left out."""
    if n <= 2 * _SHOWN_RUNS + 1:
        return list(range(n))
    return [*range(_SHOWN_RUNS), None, *range(n - _SHOWN_RUNS, n)]


def _render_value(v) -> str:
    if isinstance(v, tuple):
        return "[" + " ".join(_render_value(x) for x in v) + "]"
    if v is None:
        return "nil"
    if isinstance(v, (str, bytes)):
        # An EDN string literal, escaped again to sit inside the set's own quotes.
        literal = json.dumps(v if isinstance(v, str) else v.decode("utf-8", "replace"))
        return literal.replace("\\", "\\\\").replace('"', '\\"')
    return str(v)


# -- events ------------------------------------------------------------------------------

def _ids(values, name: str) -> np.ndarray:
    """Event ids as an int64 numpy array (copied only when the input needs converting)."""
    if isinstance(values, pa.ChunkedArray):
        values = one_array(values)
    if not isinstance(values, (pa.Array, np.ndarray)) and hasattr(values, "__arrow_c_array__"):
        values = pa.array(values)
    if isinstance(values, pa.Array):
        if not pa.types.is_integer(values.type):
            raise UnsupportedTypeError(
                f"{name}: ids must be integers, got Arrow type {values.type}")
        if values.null_count:
            raise InvalidArgumentError(f"{name}: {values.null_count} ids are null")
        array = values.to_numpy(zero_copy_only=False)
    elif isinstance(values, range):
        array = np.arange(values.start, values.stop, values.step, dtype=np.int64)
    elif isinstance(values, np.ndarray) or hasattr(values, "__array__"):
        array = np.asarray(values)
    elif isinstance(values, (list, tuple)):
        array = np.asarray(values, dtype=np.int64) if values else np.empty(0, np.int64)
    elif isinstance(values, Iterable):
        array = np.fromiter(values, dtype=np.int64)
    else:
        raise UnsupportedTypeError(f"{name}: expected ids (an Arrow array or an iterable of ints), "
                                   f"got {type(values).__name__}")
    if array.ndim != 1:
        raise InvalidArgumentError(f"{name}: ids must be one-dimensional, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        if array.size == 0:
            return np.empty(0, np.int64)
        raise UnsupportedTypeError(f"{name}: ids must be integers, got dtype {array.dtype}")
    if array.dtype == np.uint64 and array.size and array.max() >= 2**63:
        raise InvalidArgumentError(f"{name}: an id >= 2**63 does not fit int64")
    return array.astype(np.int64, copy=False)


def _unique(values: np.ndarray, counts: bool = False):
    """The sorted distinct values (and their counts). numpy 2.x's ``np.unique`` without
    counts takes a hash path that is ~100x slower on random int64 than this sort."""
    ordered = np.sort(values)
    first = np.empty(len(ordered), bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    if not counts:
        return ordered[first]
    return ordered[first], np.diff(np.flatnonzero(first), append=len(ordered))


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """For each of `values`, whether it is in `sorted_set` (sorted, unique)."""
    if len(sorted_set) == 0:
        return np.zeros(len(values), bool)
    at = np.searchsorted(sorted_set, values)
    at[at == len(sorted_set)] = 0
    return sorted_set[at] == values


def check_events(attempted, acknowledged, output, guarantee: str = "exactly-once") -> Report:
    """Checks a sink's committed output against the source's history, by event id.

    `attempted`: the ids the source produced; `acknowledged`: the ids whose processing was
    confirmed; `output`: the ids in the committed output, one per row (Arrow arrays,
    numpy arrays, ranges or iterables of int64). Vectorized: 20 M ids take seconds.

    >>> print(check_events(range(10), range(8), [0, 1, 2, 2, 4, 5, 6, 7, 8, 42]))  # doctest: +SKIP
    """
    _check_guarantee(guarantee)
    att, ack = _ids(attempted, "attempted"), _ids(acknowledged, "acknowledged")
    out = _ids(output, "output")
    present = [a for a in (att, ack, out) if len(a)]
    lo = min(int(a.min()) for a in present) if present else 0
    hi = max(int(a.max()) for a in present) if present else -1
    span, total = hi - lo + 1, len(att) + len(ack) + len(out)
    if span <= max(1 << 16, 2 * total):
        # Ids from a compact range (the usual case): counting beats sorting.
        counts = np.bincount(out - lo, minlength=span) if len(out) else np.zeros(span, np.int64)
        in_att = np.zeros(span, bool)
        in_att[att - lo] = True
        in_ack = np.zeros(span, bool)
        in_ack[ack - lo] = True
        found = counts > 0

        def ids(mask):
            return np.flatnonzero(mask) + lo
        ok, lost, missing = ids(in_ack & found), ids(in_ack & ~found), ids(in_att & ~found)
        recovered = ids(found & in_att & ~in_ack)
        dup = counts > 1
        duplicated, duplicated_count = ids(dup), int((counts[dup] - 1).sum())
        strange = found & ~in_att
        unexpected, unexpected_count = ids(strange), int(counts[strange].sum())
        attempted_count, acknowledged_count = int(in_att.sum()), int(in_ack.sum())
    else:
        (u_out, c_out), u_att, u_ack = _unique(out, counts=True), _unique(att), _unique(ack)
        out_att, out_ack = _member(u_out, u_att), _member(u_out, u_ack)
        ok = u_out[out_ack]
        lost = u_ack[~_member(u_ack, u_out)]
        missing = u_att[~_member(u_att, u_out)]
        recovered = u_out[out_att & ~out_ack]
        dup = c_out > 1
        duplicated, duplicated_count = u_out[dup], int((c_out[dup] - 1).sum())
        unexpected, unexpected_count = u_out[~out_att], int(c_out[~out_att].sum())
        attempted_count, acknowledged_count = len(u_att), len(u_ack)
    fields = dict(kind="events", guarantee=guarantee, attempted_count=attempted_count,
                  acknowledged_count=acknowledged_count, output_count=len(out), ok=ok, lost=lost,
                  missing=missing, recovered=recovered, duplicated=duplicated,
                  unexpected=unexpected, mismatched=np.empty(0, np.int64),
                  ok_count=len(ok), lost_count=len(lost), missing_count=len(missing),
                  duplicated_count=duplicated_count, unexpected_count=unexpected_count)
    return _report(fields)


def _report(fields: dict) -> Report:
    draft = Report(valid=True, **fields)
    return Report(valid=draft.valid_for(fields["guarantee"]), **fields)


# -- keyed aggregates ----------------------------------------------------------------------

def _table(data, name: str) -> pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    try:
        return pa.table(data)
    except (TypeError, ValueError, pa.ArrowException) as e:
        raise InvalidArgumentError(
            f"{name}: expected a table, got {type(data).__name__} ({e})") from None


def _unique_keys(table: pa.Table, keys: list[str], name: str) -> None:
    counts = table.group_by(keys).aggregate([([], "count_all")])
    repeated = counts.filter(pc.greater(counts["count_all"], 1))
    if repeated.num_rows:
        first = {k: repeated[k][0].as_py() for k in keys}
        raise InvalidArgumentError(
            f"{name}: key {first} is in {repeated['count_all'][0].as_py()} rows; give one final "
            "row per key (for a rolling aggregation, the last update of each key)")


def _key_values(table: pa.Table, keys: list[str], mask: np.ndarray) -> Sequence:
    picked = table.filter(pa.array(mask)).select(keys).sort_by([(k, "ascending") for k in keys])
    if len(keys) == 1:
        column = picked[keys[0]]
        if pa.types.is_integer(column.type):
            return column.to_numpy()
        return column.to_pylist()
    return list(zip(*(picked[k].to_pylist() for k in keys)))


def _equal(a: pa.ChunkedArray, b: pa.ChunkedArray, rel_tol: float) -> np.ndarray:
    """Element-wise equality, nulls equal to nulls, floats within `rel_tol`."""
    if pa.types.is_floating(a.type) and pa.types.is_floating(b.type):
        x = a.to_numpy(zero_copy_only=False).astype(float)
        y = b.to_numpy(zero_copy_only=False).astype(float)
        with np.errstate(invalid="ignore"):
            same = np.abs(x - y) <= rel_tol * np.maximum(np.abs(x), np.abs(y))
        return same | (x == y) | (np.isnan(x) & np.isnan(y))
    eq = pc.fill_null(pc.equal(a, b), False)
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    return pc.or_(eq, both_null).to_numpy(zero_copy_only=False)


def check_aggregates(expected, actual, key: str | list[str], columns: list[str] | None = None, *,
                     count: str | None = "count", guarantee: str = "exactly-once",
                     rel_tol: float = 1e-9) -> Report:
    """Compares a keyed aggregation's final rows (`actual`, one row per key) with those of a
    failure-free run (`expected`).

    Per key, the `count` column measures events: a count too low is lost events (a key
    absent from `actual` lost all of its), too high is duplicated events; keys in `actual`
    only are unexpected. The other `columns` (default: every non-key column of `expected`)
    must match where the count does (floats within `rel_tol`: a sum's rounding depends on
    the order events arrived in); a key whose count matches but a sum does not is
    *mismatched* (an event lost and another duplicated), invalid for both guarantees that
    promise no loss. Without a `count` column every key weighs one event.

    >>> check_aggregates(expected, actual, key="key", columns=["count", "sum"])  # doctest: +SKIP
    """
    _check_guarantee(guarantee)
    exp, act = _table(expected, "expected"), _table(actual, "actual")
    keys = [key] if isinstance(key, str) else list(key)
    if columns is None:
        columns = [n for n in exp.column_names if n not in keys]
    columns = list(columns)
    if count is not None and count not in columns:
        columns.insert(0, count)
    for table, name in ((exp, "expected"), (act, "actual")):
        absent = [c for c in keys + columns if c not in table.column_names]
        if absent:
            raise InvalidArgumentError(f"{name} has no column {absent[0]!r} ({table.column_names})")
        _unique_keys(table, keys, name)
    marker = "__sparkjet_present"
    left = exp.select(keys + columns).append_column(marker, pa.array(np.ones(exp.num_rows, bool)))
    right = act.select(keys + columns).append_column(marker, pa.array(np.ones(act.num_rows, bool)))
    joined = left.join(right, keys=keys, join_type="full outer", left_suffix=".expected",
                       right_suffix=".actual", coalesce_keys=True)
    in_exp = joined[marker + ".expected"].is_valid().to_numpy(zero_copy_only=False)
    in_act = joined[marker + ".actual"].is_valid().to_numpy(zero_copy_only=False)
    both = in_exp & in_act
    if count is not None:
        want, got = (pc.fill_null(joined[f"{count}.{side}"], 0).to_numpy(zero_copy_only=False)
                     .astype(np.int64) for side in ("expected", "actual"))
    else:
        want, got = in_exp.astype(np.int64), in_act.astype(np.int64)
    delta = np.where(both, got - want, 0)
    same = both.copy()
    for c in columns:
        same &= _equal(joined[c + ".expected"], joined[c + ".actual"], rel_tol)
    short, over = both & (delta < 0), both & (delta > 0)
    absent, extra = in_exp & ~in_act, in_act & ~in_exp
    mismatched = both & (delta == 0) & ~same
    fields = dict(
        kind="aggregates", guarantee=guarantee,
        attempted_count=int(want[in_exp].sum()), acknowledged_count=int(want[in_exp].sum()),
        output_count=int(got[in_act].sum()),
        ok=_key_values(joined, keys, same), lost=_key_values(joined, keys, short | absent),
        missing=_key_values(joined, keys, absent),
        recovered=_key_values(joined, keys, np.zeros_like(both)),
        duplicated=_key_values(joined, keys, over), unexpected=_key_values(joined, keys, extra),
        mismatched=_key_values(joined, keys, mismatched),
        ok_count=int(want[same].sum()), lost_count=int(-delta[short].sum() + want[absent].sum()),
        missing_count=int(want[absent].sum()), duplicated_count=int(delta[over].sum()),
        unexpected_count=int(got[extra].sum()))
    return _report(fields)


def last_update_per_key(updates, key: str = "key", count: str = "count",
                        columns: Sequence[str] = ("count", "sum")) -> pa.Table:
    """The final row of each key in the output of a keyed aggregation that emits every
    update (such as a ``TransactionalFileSink`` after ``group_by(key).aggregate(count=...)``):
    per key, the row with the largest `count` (a count only grows), reduced to `key` and
    `columns`. That is the `actual` :func:`check_aggregates` compares with a failure-free run.

    >>> check_aggregates(expected, last_update_per_key(out), key="key")  # doctest: +SKIP
    """
    t = _table(updates, "updates").sort_by([(key, "ascending"), (count, "descending")])
    keys = t.column(key).to_numpy()
    first = np.concatenate([[True], keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, bool)
    return t.filter(pa.array(first)).select([key, *columns])
