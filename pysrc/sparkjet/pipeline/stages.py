"""The stateless stages of a pipeline (fused into the vertex before them), the nodes a
pipeline is made of, and where a stream's event time is.

The keyed stages are :class:`~sparkjet.operators.base.OperatorStage` subclasses, each in its
operator's module.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.connectors.base import Sink, Source
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.base import OperatorStage


@dataclass(frozen=True)
class MapStage:
    fn: Callable[[pa.RecordBatch], pa.RecordBatch]
    on_error: object = None          # "fail", "skip", a Sink of dead letters, None: the job's

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        out = self.fn(batch)
        if isinstance(out, pa.Table):
            out = out.combine_chunks().to_batches()
            out = out[0] if out else None
        if out is not None and not isinstance(out, pa.RecordBatch):
            raise InvalidArgumentError(
                f"map_batches function {getattr(self.fn, '__name__', self.fn)!r} returned "
                f"{type(out).__name__}, expected a pyarrow RecordBatch or Table")
        return out


@dataclass(frozen=True)
class FilterStage:
    expression: pc.Expression
    on_error: object = None

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch.filter(self.expression)


@dataclass(frozen=True)
class SourceStage:
    source: Source


@dataclass(frozen=True)
class SinkStage:
    sink: Sink


@dataclass(frozen=True)
class UnionStage:
    """Where streams merge: batches pass through unchanged."""


@dataclass(frozen=True)
class TimestampsStage:
    """Event time: ``column`` holds each row's time; a source partition's watermark is the
    greatest time it has emitted less ``max_lag``; a partition with no events for
    ``idle_timeout`` seconds stops holding the watermark back. ``unit`` ("s", "ms", "us",
    "ns" or None) says what an integer column counts since the epoch: only the wall-clock
    metrics (latency, lags) read it; a timestamp column has its own."""

    column: str
    max_lag: object                  # int (the column's unit) or timedelta
    idle_timeout: float
    unit: str | None = None

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch


@dataclass(frozen=True, eq=False)
class Node:
    """One step of a pipeline and the steps it reads from (identity is the object's)."""

    stage: object
    inputs: tuple[Node, ...] = ()
    #: a source's, keyed stage's or sink's ``on_error``: "fail", "skip", a Sink of dead
    #: letters, or None for the job's (stateless stages hold theirs)
    on_error: object = None


def event_time_of(node: Node) -> str | None:
    """The event-time column of a pipeline node's stream: the column of the
    ``with_timestamps`` before it, or the output time of the keyed stage before it (through
    stateless stages and stages that keep their input's time); None when it has none."""
    while node is not None:
        s = node.stage
        if isinstance(s, TimestampsStage):
            return s.column
        if isinstance(s, OperatorStage):
            if s.keeps_time and node.inputs:       # e.g. deduplicate: rows pass as they are
                node = node.inputs[0]
                continue
            return s.output_time
        if not isinstance(s, STATELESS) or not node.inputs:
            return None
        node = node.inputs[0]
    return None


#: The stages fused into the vertex before them.
STATELESS = (MapStage, FilterStage, UnionStage, TimestampsStage)

__all__ = ["STATELESS", "FilterStage", "MapStage", "Node", "SinkStage", "SourceStage",
           "TimestampsStage", "UnionStage", "event_time_of"]
