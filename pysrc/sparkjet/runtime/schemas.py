"""The schema of every output of a processor: fixed at its first batch, checked on every
batch after it, the same on every processor and across restarts.

Arrow has several encodings of one logical type: a dictionary-encoded column and a plain
one, ``string``, ``large_string`` and ``string_view``, ``binary``, ``large_binary`` and
``binary_view``. They hash alike (a key's Hazelcast partition does not depend on its
encoding) and mean the same to every sink, so :func:`normalize` turns each into its plain
form (dictionaries decoded, ``string``, ``binary``) before anything else sees the batch. What
is left is a real change of type, which :class:`SchemaGuard` refuses before the batch
reaches a sink or another vertex: nothing of it is committed.

An output's schema is fixed by the first batch of any processor. Each processor reports the
schemas it has fixed with its snapshot acknowledgement; the coordinator refuses to commit a
snapshot whose processors disagree (:func:`check_agreement`), and the snapshot records them
(:data:`~sparkjet.runtime.snapshotting.SCHEMAS_VERTEX`), so a restarted or rescaled
execution starts with the committed schemas instead of fixing new ones.
"""
from __future__ import annotations

import base64

import pyarrow as pa

from sparkjet.errors import SchemaMismatchError


def normalize_type(t: pa.DataType) -> pa.DataType:
    """The plain form of ``t``'s encoding (the same type when it has none)."""
    if pa.types.is_dictionary(t):
        return normalize_type(t.value_type)
    if pa.types.is_large_string(t) or t == pa.string_view():
        return pa.string()
    if pa.types.is_large_binary(t) or t == pa.binary_view():
        return pa.binary()
    return t


def normalize(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with every column in its plain encoding (``batch`` itself when all are)."""
    schema = batch.schema
    changed = [i for i, f in enumerate(schema) if normalize_type(f.type) != f.type]
    if not changed:
        return batch
    columns = list(batch.columns)
    fields = list(schema)
    for i in changed:
        target = normalize_type(fields[i].type)
        columns[i] = columns[i].cast(target)
        fields[i] = fields[i].with_type(target)
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields, metadata=schema.metadata))


def encode(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode(text: str) -> pa.Schema:
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (ValueError, pa.ArrowException) as e:
        raise SchemaMismatchError(f"a snapshot's recorded schema is unreadable: {e}") from None


def describe(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


class SchemaGuard:
    """The schema of one output (``where``: what to call it in errors), fixed at the first
    batch (or by a restored snapshot)."""

    def __init__(self, where: str, schema: pa.Schema | None = None):
        self.where = where
        self.schema = schema

    def check(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` normalized and in the fixed schema's column order; raises
        :class:`~sparkjet.errors.SchemaMismatchError` when it cannot be."""
        if self.schema is not None and batch.schema.equals(self.schema, check_metadata=False):
            return batch    # the fixed schema is normalised: so is this batch
        batch = normalize(batch)
        if self.schema is None:
            self.schema = batch.schema.remove_metadata()
            return batch
        if batch.schema.equals(self.schema, check_metadata=False):
            return batch
        return self._conform(batch)

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        fixed, got = self.schema, batch.schema
        missing = [n for n in fixed.names if n not in got.names]
        extra = [n for n in got.names if n not in fixed.names]
        if missing or extra or len(set(got.names)) != len(got.names):
            what = (f"lacks column {missing[0]!r}" if missing else
                    f"has a new column {extra[0]!r}" if extra else "repeats a column name")
            raise SchemaMismatchError(
                f"{self.where}: a batch {what}; the output's schema, fixed at its first "
                f"batch, is ({describe(fixed)}), this batch's is ({describe(got)})")
        columns = []
        for f in fixed:
            col = batch.column(f.name)
            if col.type != f.type:
                # a column of nulls alone carries no type of its own: it takes the fixed one
                if col.type == pa.null():
                    col = pa.nulls(len(col), f.type)
                else:
                    raise SchemaMismatchError(
                        f"{self.where}: column {f.name!r} changed type from {f.type} to "
                        f"{col.type}; an output's schema is fixed at its first batch (cast "
                        f"the column in the stage that makes it)")
            columns.append(col)
        return pa.RecordBatch.from_arrays(columns, schema=fixed)


def check_agreement(reports: list[dict]) -> dict:
    """The outputs' schemas, from the processors' ``reports`` (output -> encoded schema),
    once every processor that fixed one fixed the same; raises SchemaMismatchError naming
    the output otherwise."""
    agreed: dict = {}
    for report in reports:
        for output, text in (report or {}).items():
            seen = agreed.setdefault(output, text)
            if seen != text:
                a, b = decode(seen), decode(text)
                raise SchemaMismatchError(
                    f"{output}: processors produced different schemas, ({describe(a)}) and "
                    f"({describe(b)}); an output has one schema (cast the column in the stage "
                    f"that makes it)")
    return agreed


__all__ = ["SchemaGuard", "check_agreement", "decode", "encode", "normalize", "normalize_type"]
