"""Structured Streaming in and out of sparkjet, through PySpark's Python data source API:
``register(spark)``, then

- ``spark.readStream.format("sparkjet").load(path)``: the committed output of a
  :class:`~sparkjet.sinks.TransactionalFileSink` at ``path`` as a stream, exactly once;
- ``df.writeStream.format("sparkjet-log").option("checkpointLocation", ...).start(path)``:
  a streaming query's rows appended to the Arrow log at ``path`` (created if missing),
  exactly once, for an :class:`~sparkjet.sources.ArrowLogSource` to read in a job.

**Reading committed output.** The sink names each committed file
``part-J-pP-eE-tT-K`` (job, processor, execution, transaction, file), and one processor of
one job commits its files in the order of ``(E, T, K)``, recovery included (the module doc
of :mod:`sparkjet.connectors.files.sink`). An offset is therefore, per job and processor, the greatest
committed file read: ``{"files": {"J-pP": "part-...parquet"}}``; ``partitions(start, end)``
are the committed files between the two, one partition per file, which a query restarted
from its checkpoint lists again to the same files (committed files never change). A file
that would sort below what a running query has already passed is refused with an error
rather than skipped. ``maxFilesPerTrigger`` bounds a micro-batch; ``Trigger.AvailableNow``
reads what is committed when the query starts. The schema is the first committed file's
unless given (``.schema(...)``). Parquet files on a local or mounted path.

**Feeding a log.** Each task stages its rows as one Arrow IPC file under
``path/_spark_staging`` (log partition: the task's partition id modulo the log's
partitions; option ``partitions`` sizes a new log, default 1). The driver's
``commit(messages, batchId)`` then, holding the log's writer lock:

1. if ``path/_spark_batches/{query id}/{batch}.json`` exists, the batch is in the log
   already (a replay after a crash): drops the replay's staged files;
2. else, if ``{batch}.pending.json`` exists, a commit of this batch died midway: its record
   names the staged files it was appending and where each partition's end was, so the
   messages already in the log after that position are counted and only the rest appended
   (the replay's own staged files are dropped: the first attempt's rows are what counts);
3. else writes ``{batch}.pending.json`` (those files and positions), appends;

then writes ``{batch}.json``, removes the pending record and the staged files, and releases
the log without sealing it (readers keep waiting for more). The query id is the one Spark
keeps in the checkpoint, so a query restarted from its checkpoint finds its records, while
a new checkpoint, or another query feeding the same log, starts records of its own.
``abort`` removes the staged files. Close the log (``ArrowLogWriter(path, n,
schema).close()``) once no query feeds it any more, for a job reading it to end.

Both work from a classic session. From Spark Connect, ``register`` works where the server
runs Python data sources (PySpark 4), and the paths are the server's and its executors'.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
    WriterCommitMessage,
)

from sparkjet._fs import absolute
from sparkjet.connectors.arrow_log import ArrowLogWriter, LogLockedError, _Cursor, read_log_info
from sparkjet.connectors.files.sink import TransactionalFileSink
from sparkjet.errors import CorruptDataError, InvalidArgumentError

try:  # PySpark 4.1+: the tasks get Arrow batches, not rows
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _WriterBase
except ImportError:  # pragma: no cover - PySpark 4.0
    _WriterBase = DataSourceStreamWriter
try:
    from pyspark.sql.streaming.datasource import ReadMaxFiles, SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - PySpark 4.0
    ReadMaxFiles, SupportsTriggerAvailableNow = None, object

OUTPUT_FORMAT = "sparkjet"
LOG_FORMAT = "sparkjet-log"
_FINAL = re.compile(r"part-([0-9a-f]{16})-p(\d{5,})-e(\d{12,})-t(\d{6,})-(\d{5,})\.parquet")
_LOCK_WAIT = 60.0


def register(spark) -> None:
    """Registers the ``sparkjet`` (committed output as a stream) and ``sparkjet-log`` (a
    stream into an Arrow log) formats with the session ``spark``."""
    spark.dataSource.register(CommittedOutputSource)
    spark.dataSource.register(ArrowLogSink)


# -- reading a job's committed output ---------------------------------------------------------


def _position(name: str) -> tuple[str, tuple[int, int, int]]:
    """A committed file's stream (``J-pP``) and its place in it, ``(E, T, K)``."""
    m = _FINAL.fullmatch(name)
    return f"{m[1]}-p{m[2]}", (int(m[3]), int(m[4]), int(m[5]))


def _path_option(options, what: str) -> str:
    path = options.get("path")
    if not path:
        raise InvalidArgumentError(f"{what}: give the path: load(path) / start(path)")
    return absolute(path)


class CommittedOutputSource(DataSource):
    """``format("sparkjet")``: a :class:`~sparkjet.sinks.TransactionalFileSink`'s committed
    output as a stream (see the module doc)."""

    @classmethod
    def name(cls) -> str:
        return OUTPUT_FORMAT

    def schema(self):
        from pyspark.sql.pandas.types import from_arrow_schema

        path = _path_option(self.options, f"format({OUTPUT_FORMAT!r})")
        files = _committed(path)
        if not files:
            raise InvalidArgumentError(
                f"format({OUTPUT_FORMAT!r}): {path} has no committed output yet to take the "
                "schema from; give it: spark.readStream.format('sparkjet').schema(...)")
        return from_arrow_schema(pq.read_schema(files[0][1]))

    def streamReader(self, schema) -> CommittedOutputReader:
        return CommittedOutputReader(_path_option(self.options, f"format({OUTPUT_FORMAT!r})"),
                                     schema, self.options)


def _committed(path: str) -> list[tuple[str, str]]:
    """(final name, readable path) of every committed Parquet file under ``path``."""
    if not os.path.isdir(path) and "://" not in path:
        raise InvalidArgumentError(f"format({OUTPUT_FORMAT!r}): {path} does not exist")
    out = []
    for f in TransactionalFileSink.committed_files(path):
        final = f.rsplit("/", 1)[-1]
        if _FINAL.fullmatch(final):
            out.append((final, f))
    return out


@dataclass(frozen=True)
class _FilePartition(InputPartition):
    path: str


class CommittedOutputReader(SupportsTriggerAvailableNow, DataSourceStreamReader):
    """The driver's side of ``format("sparkjet")``: offsets and the files between them."""

    def __init__(self, path: str, schema, options):
        self.path = path
        self.spark_schema = schema
        limit = options.get("maxFilesPerTrigger")
        self.max_files = None if limit is None else int(limit)
        if self.max_files is not None and self.max_files < 1:
            raise InvalidArgumentError(f"format({OUTPUT_FORMAT!r}): maxFilesPerTrigger must "
                                       f"be >= 1, got {limit!r}")
        self._known: set[str] = set()
        self._passed: dict[str, tuple] = {}   # the greatest position of each stream offered
        self._target: set[str] | None = None  # AvailableNow: the files at the start

    def initialOffset(self) -> dict:
        return {"files": {}}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {name for name, _ in _committed(self.path)}

    def getDefaultReadLimit(self):
        if self.max_files is not None and ReadMaxFiles is not None:
            return ReadMaxFiles(self.max_files)
        return super().getDefaultReadLimit()

    def latestOffset(self, start: dict, limit=None) -> dict:
        marks = {k: _position(v)[1] for k, v in start["files"].items()}
        new = []
        for name, _ in self._list():
            stream, place = _position(name)
            if stream not in marks or place > marks[stream]:
                if self._target is None or name in self._target:
                    new.append((place, stream, name))
        new.sort()
        cap = getattr(limit, "max_files", None) if limit is not None else self.max_files
        if cap is not None:
            new = new[:cap]
        files = dict(start["files"])
        for place, stream, name in new:
            files[stream] = name    # in order: the last one of each stream stays
            self._passed[stream] = max(self._passed.get(stream, place), place)
        return {"files": files}

    def _list(self) -> list[tuple[str, str]]:
        """The committed files; a new one sorting below what this reader already offered
        would be skipped by every offset, so it is refused instead."""
        files = _committed(self.path)
        for name, _ in files:
            if name in self._known:
                continue
            stream, place = _position(name)
            if stream in self._passed and place <= self._passed[stream]:
                raise CorruptDataError(
                    f"format({OUTPUT_FORMAT!r}): {self.path}: {name} was committed after "
                    f"files of {stream} that sort after it were read: the stream's order is "
                    "broken (two jobs with one id writing one directory?)")
        self._known.update(name for name, _ in files)
        return files

    def partitions(self, start: dict, end: dict) -> list[_FilePartition]:
        low = {k: _position(v)[1] for k, v in start["files"].items()}
        high = {k: _position(v)[1] for k, v in end["files"].items()}
        out = []
        for name, path in _committed(self.path):
            stream, place = _position(name)
            if stream in high and place <= high[stream] and (
                    stream not in low or place > low[stream]):
                out.append((stream, place, path))
        return [_FilePartition(path) for _, _, path in sorted(out)]

    def read(self, partition: _FilePartition):
        from pyspark.sql.pandas.types import to_arrow_schema

        schema = to_arrow_schema(self.spark_schema, timezone="UTC")
        for batch in pq.ParquetFile(partition.path).iter_batches(columns=schema.names):
            yield _conform(batch, schema, partition.path)

    def commit(self, end: dict) -> None:
        """Nothing to release: committed output is the sink's, never removed here."""


def _conform(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> pa.RecordBatch:
    try:
        return pa.RecordBatch.from_arrays(
            # unsafe: nanosecond timestamps are cut to Spark's microseconds
            [batch.column(f.name).cast(f.type, safe=False) for f in schema], schema=schema)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise InvalidArgumentError(f"{where}: its columns do not fit the stream's schema "
                                   f"{schema.names}: {e}") from None


# -- feeding an Arrow log ---------------------------------------------------------------------


class ArrowLogSink(DataSource):
    """``format("sparkjet-log")``: a streaming query's rows appended to an Arrow log
    exactly once (see the module doc)."""

    @classmethod
    def name(cls) -> str:
        return LOG_FORMAT

    def streamWriter(self, schema, overwrite: bool) -> LogStreamWriter:
        from pyspark.sql.pandas.types import to_arrow_schema


        if overwrite:
            raise InvalidArgumentError(f"format({LOG_FORMAT!r}): an Arrow log is append-only; "
                                       "use outputMode('append')")
        root = _path_option(self.options, f"format({LOG_FORMAT!r})")
        asked = self.options.get("partitions")
        partitions = int(asked) if asked is not None else None
        if os.path.exists(os.path.join(root, "log.json")):
            have = read_log_info(root)["partitions"]
            if partitions is not None and partitions != have:
                raise InvalidArgumentError(
                    f"format({LOG_FORMAT!r}): {root} has {have} partitions, the option "
                    f"says {partitions}")
            partitions = have
        arrow = pa.schema([f.with_nullable(True) for f in to_arrow_schema(schema, timezone="UTC")])
        return LogStreamWriter(root, partitions or 1, arrow)


@dataclass
class LogCommitMessage(WriterCommitMessage):
    query: str | None
    partition: int
    file: str | None     # the staged Arrow IPC file (None: the task had no rows)


class LogStreamWriter(_WriterBase):
    """Stages rows in the tasks, appends them on the driver at commit (the module doc)."""

    def __init__(self, root: str, partitions: int, schema: pa.Schema):
        self.root = root
        self.partitions = partitions
        self.schema = schema

    # -- in the tasks ------------------------------------------------------------------

    def write(self, iterator) -> LogCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        query = ctx.getLocalProperty("sql.streaming.queryId") if ctx is not None else None
        partition = (ctx.partitionId() if ctx is not None else 0) % self.partitions
        staging = os.path.join(self.root, "_spark_staging")
        os.makedirs(staging, exist_ok=True)
        path = os.path.join(staging, f"{uuid.uuid4().hex}.arrow")
        rows = 0
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, self.schema) as out:
            for batch in self._batches(iterator):
                if batch.num_rows:
                    out.write_batch(batch)
                    rows += batch.num_rows
        if not rows:
            os.unlink(path)
            path = None
        else:
            _fsync(path)
        return LogCommitMessage(query, partition, path)

    def _batches(self, iterator):
        if _WriterBase is DataSourceStreamWriter:     # rows (PySpark 4.0)
            chunk = []
            for row in iterator:
                chunk.append(row)
                if len(chunk) == 8192:
                    yield pa.RecordBatch.from_pylist([r.asDict() for r in chunk], self.schema)
                    chunk = []
            if chunk:
                yield pa.RecordBatch.from_pylist([r.asDict() for r in chunk], self.schema)
            return
        for batch in iterator:
            yield _conform(batch, self.schema, f"format({LOG_FORMAT!r}) {self.root}")

    # -- on the driver -----------------------------------------------------------------

    def commit(self, messages, batchId: int) -> None:
        mine = [m for m in messages if m is not None]
        staged = sorted((m.partition, m.file) for m in mine if m.file is not None)
        query = next((m.query for m in mine if m.query), None) or "unknown-query"
        records = os.path.join(self.root, "_spark_batches", query)
        done = os.path.join(records, f"{batchId:012d}.json")
        pending = os.path.join(records, f"{batchId:012d}.pending.json")
        writer = self._open_log()
        try:
            if os.path.exists(done):
                _remove(f for _, f in staged)
                return
            if os.path.exists(pending):
                with open(pending, "rb") as f:
                    record = json.loads(f.read())
                items = [tuple(x) for x in record["files"]]
                to_skip = _count_appended(self.root, record["start"])
                _remove(f for p, f in staged if (p, f) not in items)
            else:
                if not staged:
                    return
                items = staged
                start = {str(p): list(pos) for p, pos in writer.end_positions().items()}
                _write_record(pending, {"batch": batchId, "query": query,
                                        "files": [list(x) for x in items], "start": start})
                to_skip = {}
            # Files in the recorded order, batch by batch: the first to_skip[p] messages of
            # partition p are in the log already.
            for partition, path in items:
                for batch in _staged_batches(path):
                    if to_skip.get(partition, 0):
                        to_skip[partition] -= 1
                        continue
                    writer.append(partition, batch)
            _write_record(done, {"batch": batchId, "query": query,
                                 "files": [list(x) for x in items]})
            os.unlink(pending)
            _remove(f for _, f in items)
        finally:
            writer.close(seal=False)

    def abort(self, messages, batchId: int) -> None:
        _remove(m.file for m in messages if m is not None and m.file is not None)

    def _open_log(self):
        deadline = time.monotonic() + _LOCK_WAIT
        while True:
            try:
                return ArrowLogWriter(self.root, self.partitions, self.schema, durable=True)
            except LogLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _staged_batches(path: str):
    with pa.memory_map(path) as source:
        for batch in pa.ipc.open_file(source).read_all().to_batches():
            if batch.num_rows:
                yield batch


def _count_appended(root: str, start: dict) -> dict[int, int]:
    """Per partition, how many messages follow the recorded position: what a commit that
    died appended (the writer lock keeps every other appender out)."""
    counts = {}
    for key, (segment, byte) in start.items():
        cursor = _Cursor(root, int(key))
        cursor.seek({"segment": segment, "byte": byte, "batch": 0, "row": 0})
        n = 0
        while cursor.read(1 << 62) is not None:
            n += 1
        cursor.close()
        counts[int(key)] = n
    return counts


def _write_record(path: str, record: dict) -> None:
    """Makes ``path`` appear whole and durable."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(json.dumps(record).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(path))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


__all__ = ["ArrowLogSink", "CommittedOutputSource", "LogStreamWriter", "register"]
