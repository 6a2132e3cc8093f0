"""Event time as operators read it: the sentinels below and above every time, lengths of
event time (an int in the column's unit, or a ``timedelta``), wall-clock lengths in seconds,
and an event-time column's values as int64."""
from __future__ import annotations

import datetime

import numpy as np
import pyarrow as pa

from sparkjet._batches import one_array
from sparkjet.errors import InvalidArgumentError

#: Below and above every event time (the watermark before any event, and at the end).
MIN_TIME = -(2**63)
MAX_TIME = 2**63 - 1

_UNIT_US = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": None}


def duration(name: str, value, *, allow_zero: bool = False):
    """Checks a length of event time: an int, or a timedelta (resolved later by
    :func:`in_units`)."""
    if isinstance(value, datetime.timedelta):
        if value < datetime.timedelta(0) or (not allow_zero and not value):
            raise InvalidArgumentError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int (the event time's unit) or a "
                                   f"datetime.timedelta, got {value!r}")
    if value < 0 or (not allow_zero and value == 0) or value >= 2**62:
        raise InvalidArgumentError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and "
                                   f"below 2**62, got {value!r}")
    return value


def in_units(name: str, value, time_type: pa.DataType) -> int:
    """A length as an int in the unit of an event-time column of type ``time_type``."""
    if not isinstance(value, datetime.timedelta):
        return value
    if not pa.types.is_timestamp(time_type):
        raise InvalidArgumentError(
            f"{name} is a timedelta but the event-time column is {time_type}, not a timestamp: "
            f"give {name} as an int in the column's unit")
    per_us = _UNIT_US[time_type.unit]
    micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    if per_us is None:
        return micros * 1_000
    if micros % per_us:
        raise InvalidArgumentError(f"{name} {value} is not a whole number of the event-time "
                                   f"column's unit ({time_type.unit})")
    return micros // per_us


class EventTimeColumn:
    """Reads the event time of a stream's batches: column ``name``, which keeps one type
    for the life of the stream (``type``, known from the first batch or a snapshot)."""

    def __init__(self, name: str):
        self.name = name
        self.type: pa.DataType | None = None

    def values(self, batch) -> np.ndarray:
        if self.name not in batch.schema.names:
            raise InvalidArgumentError(f"the stream has no event-time column {self.name!r}; "
                                       f"it has {batch.schema.names}")
        column = batch.column(self.name)
        if self.type is None:
            self.type = column.type
        elif column.type != self.type:
            raise InvalidArgumentError(f"event-time column {self.name!r} changed type from "
                                       f"{self.type} to {column.type}")
        return time_values(column, self.name)

    def array(self, values) -> pa.Array:
        """int64 times as an array of the column's type."""
        arr = pa.array(values, pa.int64())
        t = self.type
        return arr if t is None or t == pa.int64() else arr.view(t) if pa.types.is_timestamp(t) else arr.cast(t)


def time_values(column, name: str):
    """An event-time column as int64 numbers (nulls refused)."""
    import numpy as np

    column = one_array(column)
    t = column.type
    if not (pa.types.is_integer(t) or pa.types.is_timestamp(t)):
        raise InvalidArgumentError(f"event-time column {name!r} is {t}; it must be an integer "
                                   f"or timestamp column")
    if column.null_count:
        import pyarrow.compute as pc

        row = pc.index(column.is_null(), True).as_py()
        raise InvalidArgumentError(f"event-time column {name!r} has a null at row {row}")
    if pa.types.is_timestamp(t):
        column = column.view(pa.int64())
    elif t != pa.int64():
        if pa.types.is_uint64(t):
            import pyarrow.compute as pc

            if len(column) and pc.max(column).as_py() >= 2**63:
                raise InvalidArgumentError(f"event-time column {name!r} holds values above 2**63")
        column = column.cast(pa.int64())
    return np.ascontiguousarray(column.to_numpy(zero_copy_only=False), np.int64)


def seconds(name: str, value) -> float:
    """A positive wall-clock time: seconds, or a timedelta."""
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
