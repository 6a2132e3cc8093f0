"""The two contracts every keyed stage implements, and nothing that knows a concrete one.

- :class:`OperatorStage`: what a pipeline holds for a keyed step (rolling aggregation, window,
  keyed state, deduplication, joins): its keys, inputs, event time, what a snapshot of it
  depends on, and the operator each of its processors runs (:meth:`OperatorStage.make_operator`).
- :class:`Operator`: what one processor of that vertex computes. It takes the batches of its
  partitions' keys (:meth:`Operator.process`) and the processor's watermark
  (:meth:`Operator.advance`), returns output batches, and saves and restores its state as
  one Arrow table keyed by its key columns, so the state splits by Hazelcast partition and
  restores at any parallelism.

A new keyed stage is a subclass of each, in a module of its own; the DAG
(:mod:`sparkjet.pipeline.dag`) and the runtime need no change.
"""
from __future__ import annotations

import pyarrow as pa

#: The int8 column naming the input each row came from, on the batches of a stage with
#: several inputs (``arity > 1``).
ORDINAL = "__ordinal"


class OperatorStage:
    """Base of the keyed stages that bring their own operator (keyed state, deduplication,
    joins): each runs as a vertex of its own, reached by partitioned edges (all-to-one
    without a key). A subclass is a frozen dataclass and sets:

    - ``kind``: the vertex's kind, which also names it ("dedup", "dedup.2", ...);
    - ``keys``: the key columns (the same on every input; see :meth:`key_of`);
    - ``arity``: how many input streams it takes (the node's inputs, in order; each
      batch reaches the operator with an ``__ordinal`` int8 column when ``arity > 1``);
    - ``broadcast_inputs``: the ordinals whose rows reach every processor (a broadcast
      edge) instead of the one owning their key;
    - ``event_time``: True when every input must carry event time (``with_timestamps``);
    - ``output_time``: the event-time column of its output, when it has one (a later
      window or event-time stage may follow), else None; or ``keeps_time``: its output
      rows keep their input's event-time column;

    and implements :meth:`describe` (what a snapshot's state depends on: a changed
    description refuses to restore) and :meth:`make_operator`. The DAG and the runtime know
    no stage by its class: everything they ask of one is here.
    """

    kind: str = ""
    keys: tuple = ()
    arity: int = 1
    broadcast_inputs: tuple = ()
    event_time: bool = False
    output_time: str | None = None
    keeps_time: bool = False

    @property
    def key(self):
        return self.keys[0] if len(self.keys) == 1 else list(self.keys)

    def key_of(self, ordinal: int):
        """The key column(s) of input ``ordinal`` (its rows are partitioned by them)."""
        return self.key

    def describe(self) -> dict:
        raise NotImplementedError

    def fingerprint(self) -> dict:
        """What the DAG's fingerprint records of this stage's vertex (after its name, kind
        and inputs): the keys, then :meth:`describe`."""
        return {"keys": list(self.keys), **self.describe()}

    def make_operator(self, time_column: str | None):
        """The :class:`sparkjet.operators.base.Operator` of one processor."""
        raise NotImplementedError


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

    #: The vertex's name, for errors about the data (set by the processor that runs it).
    name: str = ""


__all__ = ["ORDINAL", "Operator", "OperatorStage"]
