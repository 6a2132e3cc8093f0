"""Event-time windows: their definitions, and the lengths of event time they take.

>>> from sparkjet.operators.windows.definitions import tumbling, sliding, session
>>> tumbling(60_000)                     # [0, 60000), [60000, 120000), ... in the column's unit
Tumbling(size=60000)
>>> sliding(10_000, 2_000)               # windows of 10 s every 2 s (size a multiple of slide)
Sliding(size=10000, slide=2000)
>>> session(30_000)                      # a key's events closer than 30 s apart
Session(gap=30000)

Lengths are integers in the unit of the event-time column (for an integer column, whatever
its numbers mean; for a ``timestamp[ms]`` column, milliseconds), or ``datetime.timedelta``
for timestamp columns. A window is ``[window_start, window_end)``: an event at ``t`` is in
the tumbling window starting at ``t - t mod size``, in the ``size / slide`` sliding windows
whose start is a multiple of ``slide`` in ``(t - size, t]``, and in a session window that
spans its key's events from the first to the last plus ``gap``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.rolling import parse_aggregations
from sparkjet.operators.time import duration, in_units

#: The event-time column of a windowed aggregation's output.
WINDOW_TIME = "window_end"


class WindowDefinition:
    """Base of the window kinds; use :func:`tumbling`, :func:`sliding`, :func:`session`."""

    kind = ""

    def resolved(self, time_type: pa.DataType) -> WindowDefinition:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class Sliding(WindowDefinition):
    size: object
    slide: object
    kind = "sliding"

    def resolved(self, time_type):
        size, slide = in_units("size", self.size, time_type), in_units("slide", self.slide, time_type)
        if size % slide:
            raise InvalidArgumentError(f"a sliding window's size ({size}) must be a multiple of "
                                       f"its slide ({slide})")
        return Sliding(size, slide)

    def describe(self) -> dict:
        return {"kind": self.kind, "size": str(self.size), "slide": str(self.slide)}

    def __repr__(self) -> str:
        return f"Sliding(size={self.size!r}, slide={self.slide!r})"


@dataclass(frozen=True, repr=False)
class Tumbling(Sliding):
    kind = "tumbling"

    def __init__(self, size):
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "slide", size)

    def resolved(self, time_type):
        return Tumbling(in_units("size", self.size, time_type))

    def describe(self) -> dict:
        return {"kind": self.kind, "size": str(self.size)}

    def __repr__(self) -> str:
        return f"Tumbling(size={self.size!r})"


@dataclass(frozen=True)
class Session(WindowDefinition):
    gap: object
    kind = "session"

    def resolved(self, time_type):
        return Session(in_units("gap", self.gap, time_type))

    def describe(self) -> dict:
        return {"kind": self.kind, "gap": str(self.gap)}

    def __repr__(self) -> str:
        return f"Session(gap={self.gap!r})"


def tumbling(size) -> Tumbling:
    """Windows of ``size``, one after the other."""
    return Tumbling(duration("size", size))


def sliding(size, slide) -> Sliding:
    """Windows of ``size`` starting every ``slide`` (``size`` a multiple of ``slide``)."""
    size, slide = duration("size", size), duration("slide", slide)
    if isinstance(size, int) and isinstance(slide, int) and size % slide:
        raise InvalidArgumentError(f"a sliding window's size ({size}) must be a multiple of "
                                   f"its slide ({slide})")
    if type(size) is not type(slide):
        raise InvalidArgumentError("give a sliding window's size and slide both as ints or "
                                   "both as timedeltas")
    return Sliding(size, slide)


def session(gap) -> Session:
    """Per key, events less than ``gap`` apart (event time) fall in one window."""
    return Session(duration("gap", gap))


@dataclass(frozen=True)
class UserAggregation:
    """A vectorized aggregation of the user's: three functions over Arrow data.

    - ``accumulate(groups, n, *columns)``: ``groups`` (numpy int64, one per row, in
      ``0..n-1``) and the rows' ``columns`` (Arrow arrays); returns the partial state of
      each of the ``n`` groups as a ``pa.Table`` of ``n`` rows (any columns);
    - ``combine(groups, n, partials)``: partial states (a ``pa.Table``, ``groups`` tells
      which of ``n`` groups each row belongs to) combined into one row per group;
    - ``finish(partials)``: the final value of each row's group, a ``pa.Array``.

    Each must be deterministic and free of side effects: a replay calls them again.
    """

    columns: tuple[str, ...]
    accumulate: Callable
    combine: Callable
    finish: Callable


def user_aggregation(columns, accumulate, combine, finish) -> UserAggregation:
    """A :class:`UserAggregation` over ``columns`` (a name or a list of names)."""
    if isinstance(columns, str):
        columns = (columns,)
    columns = tuple(columns)
    if not columns or not all(isinstance(c, str) for c in columns):
        raise InvalidArgumentError(f"user_aggregation() takes column names, got {columns!r}")
    for name, fn in (("accumulate", accumulate), ("combine", combine), ("finish", finish)):
        if not callable(fn):
            raise InvalidArgumentError(f"user_aggregation(): {name} must be a function")
    return UserAggregation(columns, accumulate, combine, finish)


WINDOW_OPERATIONS = ("count", "sum", "min", "max", "mean", "first", "last")


def parse_window_aggregations(spec: dict) -> dict:
    """{name: "count" | (operation, column) | UserAggregation} -> {name: (operation, column
    or UserAggregation)}."""
    if not spec:
        raise InvalidArgumentError("aggregate() needs at least one aggregation, e.g. count='count'")
    plain = {k: v for k, v in spec.items() if not isinstance(v, UserAggregation)}
    out = dict(parse_aggregations(plain)) if plain else {}
    for name, v in spec.items():
        if isinstance(v, UserAggregation):
            out[name] = ("user", v)
    reserved = {"window_start", "window_end"} & set(spec)
    if reserved:
        raise InvalidArgumentError(f"aggregation names {sorted(reserved)} are taken by the "
                                   f"window's own columns")
    return {name: out[name] for name in spec}


__all__ = ["WINDOW_TIME", "Session", "Sliding", "Tumbling", "UserAggregation", "WindowDefinition", "duration",
           "in_units", "parse_window_aggregations", "session", "sliding", "tumbling",
           "user_aggregation"]
