"""Stream-to-table joins (Jet's ``hashJoin``): each event enriched from a reference table.

>>> table = ReferenceTable.from_file("auctions.parquet", reload_every=600)   # doctest: +SKIP
>>> enriched = stream.join_table(table, on={"auction": "id"}, how="left")

The join is stateless per event, so it is fused into the vertex before it, like ``filter``
and ``map_batches``; every processor holds the whole table (the broadcast side). A table
is loaded as a **version**, named by the xxh3-128 of its Arrow IPC bytes. The version a
processor uses changes only at a snapshot barrier: there (with ``reload_every``, once that
many seconds have passed since its load) the processor reloads, stores the version
(content-addressed, written whole or not at all: with ``storage="shared"`` in the snapshot
store, ``job-J/tables/DIGEST.arrow``; with ``storage="members"`` in every member's storage
slot, like broadcast state, :class:`sparkjet.runtime.storage.SlotTables`) and records in
the snapshot the version it uses *after* the barrier. A restart
restores the recorded version, whatever the table's source holds by then, so the replayed
events meet the table they met before the failure.

The kernel builds a hash index of the table's keys once per version (sparkjet's native
group map) and probes each batch with it: no Python per row.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet._batches import one_array
from sparkjet._keys import join_keys
from sparkjet.errors import (
    InvalidArgumentError,
    TableLoadError,  # noqa: F401 (defined there; named here too)
)
from sparkjet.operators.groups import Groups
from sparkjet.snapshot.layout import content_digest

#: The snapshot vertex whose broadcast entries record each processor's table versions.
TABLES_VERTEX = "table-versions"

_HOWS = ("inner", "left")


# -- reference tables ---------------------------------------------------------------------


class ReferenceTable:
    """Where a join's table comes from, and how often it is reloaded (``reload_every``
    seconds, at the first snapshot barrier after that; None: loaded once per job).

    >>> ReferenceTable.from_arrow(pa.table({"id": [1, 2], "name": ["a", "b"]}))
    ReferenceTable(arrow table, 2 rows)
    """

    def __init__(self, load: Callable[[], object], description: str,
                 reload_every: float | None = None):
        self._load = load
        self.description = description
        self.reload_every = _reload_every(reload_every)

    def __repr__(self) -> str:
        every = f", reload_every={self.reload_every}" if self.reload_every else ""
        return f"ReferenceTable({self.description}{every})"

    @classmethod
    def from_file(cls, path, *, reload_every: float | None = None) -> ReferenceTable:
        """A Parquet (``.parquet``, ``.pq``), CSV (``.csv``) or JSON lines (``.json``,
        ``.jsonl``, ``.ndjson``) file, read with pyarrow at every load."""
        path = os.path.abspath(os.fspath(path))
        reader = _file_reader(path)
        if not os.path.exists(path):
            raise TableLoadError(f"reference table file {path} does not exist")
        return cls(lambda: _read_file(path, reader), f"file {path}", reload_every)

    @classmethod
    def from_arrow(cls, table) -> ReferenceTable:
        """A pyarrow Table (or RecordBatch): one version for the life of the job."""
        table = _as_table(table, "from_arrow()")
        return cls(lambda: table, f"arrow table, {table.num_rows} rows")

    @classmethod
    def from_loader(cls, fn: Callable[[], pa.Table], *,
                    reload_every: float | None = None) -> ReferenceTable:
        """``fn()`` returns the table (e.g. from a database query). It runs where the
        processors run: on a Spark executor it must reach its data from there."""
        if not callable(fn):
            raise InvalidArgumentError(f"from_loader() takes a function, got {type(fn).__name__}")
        name = getattr(fn, "__qualname__", None) or repr(fn)
        return cls(lambda: _as_table(fn(), f"loader {name}"), f"loader {name}", reload_every)

    @classmethod
    def from_spark(cls, df) -> ReferenceTable:
        """A Spark DataFrame, collected as Arrow on the driver now (``df.toArrow()``,
        PySpark 4). It is one version for the life of the job: the processors cannot reach
        the driver's session to collect it again; for reloads use :meth:`from_loader` or
        :meth:`from_file` on data the executors can read."""
        to_arrow = getattr(df, "toArrow", None)
        if to_arrow is None:
            raise InvalidArgumentError(f"from_spark() takes a Spark DataFrame with toArrow() "
                                       f"(PySpark 4 or later), got {type(df).__name__}")
        table = _as_table(to_arrow(), "DataFrame.toArrow()")
        return cls(lambda: table, f"Spark DataFrame, {table.num_rows} rows")

    def load(self) -> pa.Table:
        """Loads the table now."""
        return self._load()


def as_reference_table(table) -> ReferenceTable:
    """``join_table``'s shorthand: a ReferenceTable, a pyarrow Table, or a file path."""
    if isinstance(table, ReferenceTable):
        return table
    if isinstance(table, (pa.Table, pa.RecordBatch)):
        return ReferenceTable.from_arrow(table)
    if isinstance(table, (str, os.PathLike)):
        return ReferenceTable.from_file(table)
    raise InvalidArgumentError(f"join_table() takes a ReferenceTable, a pyarrow Table or a "
                               f"file path, got {type(table).__name__}")


def _reload_every(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"reload_every must be a positive number of seconds or "
                                   f"None, got {value!r}")
    return float(value)


_READERS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".json": "json",
            ".jsonl": "json", ".ndjson": "json"}


def _file_reader(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _READERS:
        raise InvalidArgumentError(f"reference table file {path}: unknown format {suffix!r}; "
                                   f"use one of {', '.join(sorted(_READERS))}")
    return _READERS[suffix]


def _read_file(path: str, reader: str) -> pa.Table:
    if not os.path.exists(path):
        raise TableLoadError(f"reference table file {path} does not exist")
    try:
        if reader == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        if reader == "csv":
            import pyarrow.csv as pcsv

            return pcsv.read_csv(path)
        import pyarrow.json as pjson

        return pjson.read_json(path)
    except (pa.ArrowException, OSError) as e:
        raise TableLoadError(f"reference table file {path}: {e}") from e


def _as_table(value, what: str) -> pa.Table:
    if isinstance(value, pa.RecordBatch):
        return pa.Table.from_batches([value])
    if not isinstance(value, pa.Table):
        raise TableLoadError(f"{what} returned {type(value).__name__}, expected a pyarrow Table")
    return value


# -- the stage ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TableJoinStage:
    """``stream.join_table(...)``: the stream's ``stream_keys`` matched to the table's
    ``table_keys``; the output is the event's columns then the table's other columns
    (renamed ``prefix + name`` when a prefix is given)."""

    table: ReferenceTable
    stream_keys: tuple[str, ...]
    table_keys: tuple[str, ...]
    how: str = "inner"
    prefix: str = ""

    def describe(self) -> dict:
        """What the DAG's fingerprint records of the join."""
        return {"on": [list(p) for p in zip(self.stream_keys, self.table_keys)],
                "how": self.how, "prefix": self.prefix}

    def join(self, batch: pa.RecordBatch, version: TableVersion) -> pa.RecordBatch:
        """``batch`` joined with ``version`` of the table."""
        return version.index(self).probe(batch, self.stream_keys, self.how)


def parse_on(on) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``on="k"``, ``on=("a", "b")`` (same names on both sides) or ``on={"stream_col":
    "table_col"}`` as (stream keys, table keys)."""
    return join_keys(on, "join_table", ("stream", "table"))


def check_how(how) -> str:
    if how not in _HOWS:
        raise InvalidArgumentError(f"join_table(how=...) is 'inner' or 'left', got {how!r}")
    return how


# -- versions and their index -------------------------------------------------------------


def _at(values: np.ndarray, slots: np.ndarray, found: np.ndarray, fill: int) -> np.ndarray:
    """``values[slots]`` where a key was found, else ``fill`` (``values`` may be empty)."""
    out = np.full(len(slots), fill, np.int64)
    out[found] = values[slots[found]]
    return out


class TableVersion:
    """One loaded content of a reference table: its Arrow IPC bytes, named by their digest,
    and the hash index of each join that uses it (built once)."""

    def __init__(self, data, digest: str, table: pa.Table | None = None):
        self.data = data
        self.digest = digest
        self.table = table if table is not None else pa.ipc.open_stream(data).read_all()
        self._indexes: dict[tuple, TableIndex] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, table: pa.Table) -> TableVersion:
        data = ipc_bytes(table)
        return cls(data, content_digest(data), table)

    def index(self, stage: TableJoinStage) -> TableIndex:
        key = (stage.table_keys, stage.prefix)
        found = self._indexes.get(key)
        if found is None:
            with self._lock:
                found = self._indexes.get(key)
                if found is None:
                    found = self._indexes[key] = TableIndex(self.table, stage.table_keys,
                                                            stage.prefix,
                                                            stage.table.description)
        return found


def ipc_bytes(table: pa.Table) -> pa.Buffer:
    """A table as an Arrow IPC stream (what a version is stored and named by)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


class TableIndex:
    """A table's key columns in a hash index (slot per distinct key), its rows grouped by
    slot, and its other columns, ready to be taken by row.

    >>> ix = TableIndex(pa.table({"id": [1, 2, 2], "w": [10, 20, 21]}), ("id",))
    >>> ix.probe(pa.record_batch({"k": [2, 3, 1]}), ("k",), "inner").to_pylist()
    [{'k': 2, 'w': 20}, {'k': 2, 'w': 21}, {'k': 1, 'w': 10}]
    """

    def __init__(self, table: pa.Table, keys: tuple[str, ...], prefix: str = "",
                 description: str = "the reference table"):
        missing = [k for k in keys if k not in table.schema.names]
        if missing:
            raise TableLoadError(f"{description} has no key column {missing[0]!r}; its "
                                 f"columns are {table.schema.names}")
        self.keys = keys
        self.kinds = tuple(_kind(k, table.schema.field(k).type, description) for k in keys)
        key_columns = [_normal(table.column(k).combine_chunks(), kind)
                       for k, kind in zip(keys, self.kinds)]
        valid = None
        for c in key_columns:
            if c.null_count:
                valid = c.is_valid() if valid is None else pc.and_(valid, c.is_valid())
        rest = table.drop_columns(list(keys))
        if valid is not None:          # a null key matches nothing
            key_columns = [c.filter(valid) for c in key_columns]
            rest = rest.filter(valid)
        self.groups = Groups(list(keys), expected=len(key_columns[0]))
        slots = self.groups.slots(pa.RecordBatch.from_arrays(key_columns, names=list(keys)))
        n = len(self.groups)
        names = [prefix + name for name in rest.schema.names]
        self.payload = pa.RecordBatch.from_arrays(
            [_one_array(c) for c in rest.columns], names=names)
        self.unique = n == len(slots)
        if self.unique:
            self.row_of = np.empty(n, np.int64)
            self.row_of[slots] = np.arange(n, dtype=np.int64)
        else:
            self.order = np.argsort(slots, kind="stable")
            self.counts = np.bincount(slots, minlength=n).astype(np.int64)
            self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self._checked: pa.Schema | None = None

    def probe(self, batch: pa.RecordBatch, stream_keys: tuple[str, ...], how: str):
        """``batch`` joined: inner (one row per event and matching table row) or left
        (unmatched events once, with null table columns)."""
        if self._checked is not batch.schema and self._checked != batch.schema:
            self._check(batch.schema, stream_keys)
            self._checked = batch.schema
        n = batch.num_rows
        columns = [_normal(_decoded(batch.column(k)), kind)
                   for k, kind in zip(stream_keys, self.kinds)]
        valid = None
        for c in columns:
            if c.null_count:
                valid = c.is_valid() if valid is None else pc.and_(valid, c.is_valid())
        if valid is None:
            slots = self.groups.find(pa.RecordBatch.from_arrays(columns, names=list(self.keys)))
        else:                          # a null key matches nothing
            rows = np.flatnonzero(valid.to_numpy(zero_copy_only=False))
            slots = np.full(n, -1, np.int64)
            slots[rows] = self.groups.find(pa.RecordBatch.from_arrays(
                [c.filter(valid) for c in columns], names=list(self.keys)))
        found = slots >= 0
        if self.unique:
            if how == "inner":
                if found.all():
                    return self._glue(batch, None, self.row_of[slots])
                events = np.flatnonzero(found)
                return self._glue(batch, events, self.row_of[slots[events]])
            return self._glue(batch, None, _at(self.row_of, slots, found, -1))
        counts = _at(self.counts, slots, found, 0)
        out_counts = np.maximum(counts, 1) if how == "left" else counts
        events = np.repeat(np.arange(n, dtype=np.int64), out_counts)
        # Output row j of event i takes table row order[starts[slot_i] + j - first_i],
        # first_i being event i's first output row.
        first = np.cumsum(out_counts) - out_counts
        within = np.arange(len(events), dtype=np.int64) - np.repeat(first, out_counts)
        starts = _at(self.starts, slots, found, 0)
        matched = np.repeat(found, out_counts)
        rows = np.full(len(events), -1, np.int64)
        rows[matched] = self.order[np.repeat(starts, out_counts)[matched] + within[matched]]
        return self._glue(batch, events, rows)

    def _glue(self, batch, events, rows) -> pa.RecordBatch:
        left = batch if events is None else batch.take(pa.array(events))
        if len(rows) and rows.min() < 0:
            taken = self.payload.take(pa.array(rows, mask=rows < 0))
        else:
            taken = self.payload.take(pa.array(rows))
        return pa.RecordBatch.from_arrays([*left.columns, *taken.columns],
                                          names=[*left.schema.names, *taken.schema.names])

    def _check(self, schema: pa.Schema, stream_keys: tuple[str, ...]) -> None:
        for s, t, kind in zip(stream_keys, self.keys, self.kinds):
            if s not in schema.names:
                raise InvalidArgumentError(f"join_table: the stream has no key column {s!r}; "
                                           f"its columns are {schema.names}")
            got = schema.field(s).type
            value = got.value_type if pa.types.is_dictionary(got) else got
            mine = _KINDS.get(_family(value))
            if mine != kind:
                raise InvalidArgumentError(
                    f"join_table: stream key {s!r} is {got} but table key {t!r} is a "
                    f"{kind} column; cast one side (map_batches) so both are {kind}s")
        clash = sorted(set(schema.names) & set(self.payload.schema.names))
        if clash:
            raise InvalidArgumentError(
                f"join_table: table columns {clash} are also stream columns; pass "
                f"prefix='...' to rename the table's columns, or drop them first")


_KINDS = {"int": "integer", "str": "string", "bin": "binary", "fixed": "fixed-size binary"}


def _family(t: pa.DataType) -> str | None:
    if pa.types.is_integer(t):
        return "int"
    if t in (pa.string(), pa.large_string(), pa.string_view()):
        return "str"
    if t in (pa.binary(), pa.large_binary(), pa.binary_view()):
        return "bin"
    if pa.types.is_fixed_size_binary(t):
        return "fixed"
    return None


def _kind(name: str, t: pa.DataType, description: str) -> str:
    value = t.value_type if pa.types.is_dictionary(t) else t
    family = _family(value)
    if family is None:
        raise TableLoadError(f"{description}: key column {name!r} has type {t}; join keys are "
                             f"integers, strings or binaries")
    return _KINDS[family]


_NORMAL = {"integer": pa.int64(), "string": pa.large_string(), "binary": pa.large_binary()}


def _normal(column, kind: str):
    """A key column in the one type both sides are matched in."""
    column = _decoded(column)
    column = one_array(column)
    target = _NORMAL.get(kind)
    if target is None or column.type == target:
        return column
    if column.type == pa.uint64():
        return column.view(pa.int64())
    return column.cast(target)


def _decoded(column):
    if pa.types.is_dictionary(column.type):
        column = one_array(column)
        return column.dictionary.take(column.indices)
    return column


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    if column.num_chunks == 1:
        return column.chunk(0)
    if column.num_chunks == 0:
        return pa.array([], column.type)
    return pa.concat_arrays(column.chunks)


# -- a processor's versions ---------------------------------------------------------------


class TableVersions:
    """The table versions of one member's processors: loads shared by the processors that
    ask for the same moment (the start, or snapshot ``n``), versions shared by digest, and
    each one stored durably before a snapshot records it (``store``: the job's
    :class:`~sparkjet.snapshot.store.SnapshotStore`, or with the members' storage a
    :class:`~sparkjet.runtime.storage.SlotTables`; None without snapshots)."""

    def __init__(self, store=None):
        self.store = store
        self._lock = threading.Lock()
        self._loads: dict[str, tuple[object, TableVersion, float]] = {}
        self._versions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def load(self, name: str, table: ReferenceTable, moment) -> tuple[TableVersion, float]:
        """Table ``name``'s version loaded at ``moment`` (once per moment) and when."""
        with self._lock:
            last = self._loads.get(name)
            if last is not None and last[0] == moment:
                return last[1], last[2]
            loaded_at = time.time()
            fresh = TableVersion.of(table.load())
            version = self._versions.setdefault(fresh.digest, fresh)
            self._loads[name] = (moment, version, loaded_at)
            return version, loaded_at

    def restored(self, digest: str) -> TableVersion:
        """The version ``digest``, read from where versions are stored (checked against
        its digest)."""
        with self._lock:
            version = self._versions.get(digest)
            if version is None:
                version = TableVersion(self.store.read_table_version(digest), digest)
                self._versions[digest] = version
            return version

    def store_version(self, version: TableVersion, snapshot_id: int | None = None) -> None:
        """Makes ``version`` durable (before snapshot ``snapshot_id`` records it). Asked
        each time (a no-op when the file is there): a commit removes the versions no
        retained snapshot uses, and a table may come back to an earlier content."""
        with self._lock:
            self.store.write_table_version(version.data, version.digest,
                                           snapshot_id=snapshot_id)


@dataclass
class TableJoiner:
    """One processor's side of a table join: the version it uses and when it was loaded."""

    stage: TableJoinStage
    name: str
    versions: TableVersions
    restored: dict | None = None
    version: TableVersion = field(init=False)
    loaded_at: float = field(init=False)
    _loaded_mono: float = field(init=False)

    def __post_init__(self):
        if self.restored is not None:
            self.version = self.versions.restored(self.restored["version"])
            self._loaded(float(self.restored["loaded_at"]))
        else:
            self.version, loaded_at = self.versions.load(self.name, self.stage.table, "start")
            self._loaded(loaded_at)
        self.version.index(self.stage)   # a key column missing fails now, not mid-stream

    def _loaded(self, loaded_at: float) -> None:
        """Records a load at wall time ``loaded_at`` (kept in the snapshot) and when it
        was on the monotonic clock, which :meth:`_due` measures: a wall clock stepped back
        would hold every reload for as long as the step, one stepped forward reload at each
        barrier. A load before a restore counts as at most ``reload_every`` old."""
        self.loaded_at = loaded_at
        every = self.stage.table.reload_every or 0.0
        self._loaded_mono = time.monotonic() - min(max(time.time() - loaded_at, 0.0), every)

    def apply(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self.versions.store is None and self._due():
            # Without snapshots there is no barrier to wait for, nor a replay to repeat.
            self.version, loaded_at = self.versions.load(self.name, self.stage.table,
                                                         time.monotonic())
            self._loaded(loaded_at)
        return self.stage.join(batch, self.version)

    def at_barrier(self, snapshot_id: int) -> dict:
        """At barrier ``snapshot_id``: reloads if due, stores the version, and returns the
        entry that records it (the version used after the barrier)."""
        if self._due():
            version, loaded_at = self.versions.load(self.name, self.stage.table, snapshot_id)
            version.index(self.stage)
            self.version = version
            self._loaded(loaded_at)
        self.versions.store_version(self.version, snapshot_id)
        return {"version": self.version.digest, "loaded_at": self.loaded_at}

    def _due(self) -> bool:
        every = self.stage.table.reload_every
        return every is not None and time.monotonic() - self._loaded_mono >= every


__all__ = ["TABLES_VERTEX", "ReferenceTable", "TableIndex", "TableJoinStage", "TableJoiner",
           "TableLoadError", "TableVersion", "TableVersions", "as_reference_table", "ipc_bytes"]
