"""Dead letters: the one schema of the records a stage's ``on_error`` sink receives.

Whatever refused a record (a source that cannot decode it, a keyed stage given a null key,
a ``map_batches`` or ``filter`` stage that raised on it, a sink whose system would refuse
it), its dead letter is one row of :data:`DEAD_LETTER_SCHEMA`:

=============  =========  ===========================================================
column         type       what it holds
=============  =========  ===========================================================
``stage``      string     the stage that refused it: a vertex ("source", "aggregate",
                          "dedup.2"), a sink ("sink.2") or a stateless stage
                          ("map_batches", "filter") with the vertex it runs in
``column``     string     the column at fault; null when the whole record is
``reason``     string     why: the error's class and message
``partition``  int32      the source partition it came from (a Kafka partition), or null
``offset``     int64      its offset there (a Kafka offset, a file's line), or null
``position``   string     the same in words ("topic 'orders' partition 2 offset 17")
``record``     binary     the record: its bytes as the source read them (``format``
                          "raw"), or the row as a JSON object (``format`` "json")
``format``     string     "raw" or "json"
=============  =========  ===========================================================

A row that passed a Kafka source with ``metadata=("partition", "offset")`` carries its
``_partition`` and ``_offset`` columns, which fill ``partition`` and ``offset`` wherever it
is refused later. In the JSON of a row, binary values are UTF-8 text (undecodable bytes
escaped as ``\\xNN``), times ISO 8601, decimals strings.

The dead-letter sink is a sink of the DAG like any other: its rows are committed with the
snapshot that covers the records' offsets, so under exactly-once each bad record is there
once, also after failures.
"""
from __future__ import annotations

import datetime
import decimal
import json

import pyarrow as pa

from sparkjet.connectors.base import BadRecord

#: The schema of every dead letter (see the module's docstring).
DEAD_LETTER_SCHEMA = pa.schema([
    pa.field("stage", pa.string(), nullable=False),
    pa.field("column", pa.string()),
    pa.field("reason", pa.string(), nullable=False),
    pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("position", pa.string()),
    pa.field("record", pa.binary()),
    pa.field("format", pa.string(), nullable=False),
])


def from_records(stage: str, records: list[BadRecord]) -> pa.RecordBatch:
    """The dead letters of records a source could not decode (their raw bytes)."""
    return _batch(stage, [r.column for r in records], [r.reason for r in records],
                  [r.partition for r in records], [r.offset for r in records],
                  [r.position for r in records], [r.record for r in records], "raw")


def from_rows(stage: str, rows: pa.RecordBatch, columns: list[str | None],
              reasons: list[str]) -> pa.RecordBatch:
    """The dead letters of the rows of ``rows`` (each as a JSON object), refused for
    ``reasons`` (one per row) in ``columns``."""
    n = rows.num_rows
    names = rows.schema.names
    parts = rows.column("_partition").to_pylist() if "_partition" in names else [None] * n
    offsets = rows.column("_offset").to_pylist() if "_offset" in names else [None] * n
    positions = [_position(p, o) for p, o in zip(parts, offsets)]
    records = [json.dumps(r, default=_plain, ensure_ascii=False).encode()
               for r in rows.to_pylist()]
    return _batch(stage, columns, reasons, parts, offsets, positions, records, "json")


def position_of(rows: pa.RecordBatch, row: int) -> str:
    """Where row ``row`` of ``rows`` is, for a message: its Kafka partition and offset
    when the batch carries them, else its row in the batch."""
    names = rows.schema.names
    if "_partition" in names and "_offset" in names:
        return _position(rows.column("_partition")[row].as_py(),
                         rows.column("_offset")[row].as_py())
    return f"row {row} of its batch"


def _position(partition, offset) -> str | None:
    if partition is None and offset is None:
        return None
    return f"partition {partition} offset {offset}"


def _batch(stage, columns, reasons, partitions, offsets, positions, records,
           fmt: str) -> pa.RecordBatch:
    n = len(reasons)
    return pa.RecordBatch.from_arrays([
        pa.array([stage] * n, pa.string()),
        pa.array(columns, pa.string()),
        pa.array(reasons, pa.string()),
        pa.array(partitions, pa.int32()),
        pa.array(offsets, pa.int64()),
        pa.array(positions, pa.string()),
        pa.array(records, pa.binary()),
        pa.array([fmt] * n, pa.string()),
    ], schema=DEAD_LETTER_SCHEMA)


def _plain(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return repr(value)


__all__ = ["DEAD_LETTER_SCHEMA", "from_records", "from_rows", "position_of"]
