"""DiscardSink: counts what it is given and keeps nothing (benchmarks, the demo)."""
from __future__ import annotations

import pyarrow as pa

from sparkjet.connectors.base import ProcessorContext, Sink, SinkWriter


class DiscardSink(Sink):
    """A sink that drops every row: for measuring a pipeline without the cost of output."""

    name = "discard"
    transactional = False

    def open(self, context: ProcessorContext) -> DiscardWriter:
        return DiscardWriter()

    def __repr__(self) -> str:
        return "DiscardSink()"


class DiscardWriter(SinkWriter):
    def __init__(self):
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows

    def prepare(self, snapshot_id: int) -> dict | None:
        return None

    def commit(self, snapshot_id: int) -> None:
        pass

    def recover(self, snapshot_id: int | None, prepared: dict | None) -> None:
        pass
