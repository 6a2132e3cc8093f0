"""What an aggregation vertex's processor computes, behind one small interface.

An operator takes the batches of its partitions' keys (:meth:`Operator.process`) and the
processor's watermark (:meth:`Operator.advance`), returns output batches, and saves and
restores its state as one Arrow table keyed by its key columns, so the state splits by
Hazelcast partition and restores at any parallelism.
"""
from __future__ import annotations

import pyarrow as pa

from sparkjet.dag import AGGREGATE, WINDOW, Vertex
from sparkjet.keyed_state import KeyedAggregator
from sparkjet.pipeline import OperatorStage


class Operator:
    """``process`` and ``advance`` return ``(outputs, late)``: output batches, and the
    batch of events too late to count (or None)."""

    def process(self, batch: pa.RecordBatch) -> tuple[list[pa.RecordBatch], pa.RecordBatch | None]:
        raise NotImplementedError

    def advance(self, watermark: int) -> list[pa.RecordBatch]:
        return []

    def output_watermark(self, watermark: int) -> int:
        """The watermark sent downstream after :meth:`advance` to ``watermark``: lower
        when the operator may still emit rows older than ``watermark``."""
        return watermark

    def tick(self) -> list[pa.RecordBatch]:
        """Called often (between events): output due by wall-clock time."""
        return []

    def snapshot(self) -> pa.Table | None:
        raise NotImplementedError

    def restore(self, table: pa.Table | None, watermark: int, floors=None) -> None:
        """``floors``: a :class:`~sparkjet.runtime.watermarks.PartitionFloors` when some of
        this processor's partitions had reached a later watermark than ``watermark``."""
        raise NotImplementedError

    def snapshot_broadcast(self) -> pa.Table | None:
        """State every processor holds alike (from broadcast inputs): saved once, by
        processor 0, and given to every processor at restore."""
        return None

    def restore_broadcast(self, table: pa.Table) -> None:
        """Restores what :meth:`snapshot_broadcast` saved."""

    #: The key column(s) the snapshot table is partitioned by (None: one group).
    state_key: str | list | None = None


class RollingAggregate(Operator):
    def __init__(self, vertex: Vertex):
        stage = vertex.stage
        self._agg = KeyedAggregator(stage.key, stage.aggregations)
        self.state_key = stage.key

    def process(self, batch):
        return [self._agg.update(batch)], None

    def snapshot(self):
        return self._agg.snapshot()

    def restore(self, table, watermark, floors=None):
        self._agg.restore(table)


def make_operator(vertex: Vertex) -> Operator:
    if isinstance(vertex.stage, OperatorStage):
        return vertex.stage.make_operator(vertex.time_column)
    if vertex.kind == AGGREGATE:
        return RollingAggregate(vertex)
    if vertex.kind == WINDOW:
        from sparkjet.window_operator import WindowOperator

        return WindowOperator(vertex.stage, vertex.time_column)
    raise ValueError(f"no operator for a {vertex.kind} vertex")


__all__ = ["Operator", "RollingAggregate", "make_operator"]
