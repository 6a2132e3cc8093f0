"""Pipelines: a source, stateless stages, an optional keyed aggregation, and a sink.

>>> from sparkjet.sources import GeneratorSource                     # doctest: +SKIP
>>> p = (Pipeline().read_from(GeneratorSource(total=10_000_000))
...      .filter(pc.field("value") > 0.5)
...      .group_by("key").aggregate(count="count", total=("sum", "value"))
...      .write_to(sink))

A pipeline compiles into a DAG of processors (:meth:`Pipeline.plan`): the source vertex, with
the stateless stages before ``group_by`` fused into it; a partitioned edge by the Hazelcast
partition of the key (every key reaches the processor that owns its partition); the keyed
vertex with the stages after the aggregation and the sink fused into it. Without
``group_by`` the sink runs in the source processors.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.connectors import Sink, Source
from sparkjet.errors import InvalidArgumentError
from sparkjet.keyed_state import parse_aggregations


@dataclass(frozen=True)
class MapStage:
    fn: Callable[[pa.RecordBatch], pa.RecordBatch]

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
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

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch.filter(self.expression)


@dataclass(frozen=True)
class AggregateStage:
    key: str
    aggregations: dict


@dataclass(frozen=True)
class Plan:
    """The compiled DAG of a pipeline."""

    source: Source
    before: tuple            # stateless stages fused into the source processors
    aggregate: AggregateStage | None
    after: tuple             # stateless stages fused into the keyed processors
    sink: Sink


@dataclass
class Pipeline:
    """A linear pipeline, built step by step; each step returns a new pipeline."""

    _source: Source | None = None
    _stages: tuple = ()
    _sink: Sink | None = None

    def read_from(self, source: Source) -> Pipeline:
        if not isinstance(source, Source):
            raise InvalidArgumentError(f"read_from() takes a sparkjet Source, got {type(source).__name__}")
        if self._source is not None:
            raise InvalidArgumentError("this pipeline already has a source")
        return Pipeline(source, self._stages, self._sink)

    def _add(self, stage) -> Pipeline:
        if self._source is None:
            raise InvalidArgumentError("call read_from(source) first")
        if self._sink is not None:
            raise InvalidArgumentError("this pipeline already ends in a sink")
        return Pipeline(self._source, (*self._stages, stage), None)

    def map_batches(self, fn: Callable[[pa.RecordBatch], pa.RecordBatch]) -> Pipeline:
        """Applies `fn` to every batch (it must return a RecordBatch or Table). It must be
        deterministic for exactly-once output: a replay calls it again."""
        if not callable(fn):
            raise InvalidArgumentError("map_batches() takes a function of a RecordBatch")
        return self._add(MapStage(fn))

    def filter(self, expression: pc.Expression) -> Pipeline:
        """Keeps the rows where a pyarrow compute expression is true."""
        if not isinstance(expression, pc.Expression):
            raise InvalidArgumentError("filter() takes a pyarrow.compute expression, e.g. pc.field('v') > 0")
        return self._add(FilterStage(expression))

    def group_by(self, key: str) -> GroupBy:
        """Starts a rolling keyed aggregation over one key column."""
        if not isinstance(key, str):
            raise InvalidArgumentError(f"group_by() takes a column name, got {key!r}")
        if any(isinstance(s, AggregateStage) for s in self._stages):
            raise InvalidArgumentError("a pipeline has at most one group_by")
        return GroupBy(self, key)

    def write_to(self, sink: Sink) -> Pipeline:
        if not isinstance(sink, Sink):
            raise InvalidArgumentError(f"write_to() takes a sparkjet Sink, got {type(sink).__name__}")
        if self._source is None:
            raise InvalidArgumentError("call read_from(source) first")
        if self._sink is not None:
            raise InvalidArgumentError("this pipeline already ends in a sink")
        return Pipeline(self._source, self._stages, sink)

    def plan(self) -> Plan:
        """The DAG this pipeline runs as (see the module docs)."""
        if self._source is None or self._sink is None:
            raise InvalidArgumentError("a pipeline needs read_from(source) and write_to(sink)")
        stages = list(self._stages)
        agg = next((i for i, s in enumerate(stages) if isinstance(s, AggregateStage)), None)
        if agg is None:
            return Plan(self._source, tuple(stages), None, (), self._sink)
        return Plan(self._source, tuple(stages[:agg]), stages[agg], tuple(stages[agg + 1:]), self._sink)


@dataclass(frozen=True)
class GroupBy:
    pipeline: Pipeline
    key: str

    def aggregate(self, **aggregations) -> Pipeline:
        """Rolling aggregation emitting, per batch, the updated aggregates of the keys it
        touched: ``aggregate(n="count", total=("sum", "v"), avg=("mean", "v"))``."""
        parse_aggregations(aggregations)
        return self.pipeline._add(AggregateStage(self.key, dict(aggregations)))

    def count(self) -> Pipeline:
        return self.aggregate(count="count")
