"""A directory of Parquet, CSV or JSON-lines files as a replayable source, on a local disk
or any ``pyarrow.fs`` file system (S3, GCS, HDFS), picking up new files as they appear.

**Files to partitions.** A data file belongs to source partition
``blake2b(relative path) % partitions``: a function of its path relative to the root only,
so every reader, at any parallelism and in any execution, agrees on it whatever order the
listing comes in. Names whose path has a part starting with ``.`` or ``_`` are not data
(temporary files, ``_SUCCESS``), nor are names without one of the format's suffixes.

**The contract with the writer of the directory.** A file is complete when its name
appears and is never modified or removed afterwards: write it under a temporary name
(``.part-0001.parquet``, ``_tmp/...``) and rename it, or upload it whole (an S3 ``PUT`` or a
completed multipart upload appears whole). A file modified after it was read whole is not
read again (its rows are already in the job's state: nothing is replayed from it).

**A file that changes under the job** is never read again silently. The reader notes the
size and modification time of the file it starts, and saves them with its position; when
it reopens that file after a restore, and when it reaches the file's end, it compares them.
A file modified, replaced or truncated since (or one that now holds fewer rows than the
position says were read), and a listed file that vanished before it was read whole, stop the
job with :class:`~sparkjet.errors.SourceChangedError` naming the file and what changed: a
restore would otherwise skip the saved number of rows of *other* data, or lose the rest. A
replay repeats it, so no restart is tried. A rewrite that keeps both the size and the
modification time (to the file system's precision: a second on S3) cannot be told.

**Replay.** Each partition reads its files one at a time, the smallest path first among
those it knows and has not read. A reader's :meth:`~DirectoryReader.snapshot_state` is, per
partition, the files it has read completely, the file it is reading and how many of its
rows it has returned::

    {"files": {"3": {"done": ["2026/01/a.csv", ...], "watermark": null,
                     "file": "2026/01/b.csv", "row": 4096,
                     "stamp": [<size>, <mtime ns>]}, ...}, "next": 3}

(``stamp``, the size and modification time of ``file``, only once the file was opened.)

A restore reopens ``file``, skips ``row`` rows (Parquet seeks to the row group holding the
row; CSV and JSON-lines parse the rows before it again) and goes on with every listed file
that is not ``done``. Files that appear after a snapshot are read after the restore as
well: which files exist is the directory's, not the snapshot's. So every row of every file
is returned once between a snapshot and the next (the runtime's exactly-once), whatever
order files appear in. States of several readers merge by uniting their ``files``, so any
snapshot restores at any parallelism.

**The cost of the done list**: every file a partition has read and that is still in the
directory stays in its state, so a snapshot grows with the number of files read and kept
(about the length of their relative paths each: 100,000 files of 40 characters are 4 MB per
snapshot). A file removed after it was read leaves the state at the next listing, so
expiring read files keeps it small. When new files always sort
after every file already there (names that start with a time stamp or a sequence number),
``ordered_names=True`` keeps one ``watermark`` per partition instead: the path of the last
file read completely, every file sorting at or before it being done. A file that appears
after files sorting later were read breaks that promise; the reader refuses it
(:class:`~sparkjet.errors.InvalidArgumentError` naming both files) when it can tell, which
is for files it did not list before (the first listing after a restore is taken as is).

**Listing.** Every reader lists the whole directory, recursively (on S3 one request per
1,000 names): once at its start, and with ``watch`` again whenever it has read everything it
knows and ``poll_interval`` has passed. Keep a watched directory to what lists quickly
(move or expire old files, or point the source at a narrower prefix).

**Ends.** With ``watch=False`` (the default) the source reads the files its first listing
finds and then ends. With ``watch=True`` it lists the directory again every
``poll_interval`` seconds when it has nothing left to read and never ends, unless an
``end_marker`` is given: a file of that name (relative to the root, say ``_DONE``) written
after every data file ends the source once everything listed with it has been read.

**Schemas.** Every batch has one schema: the declared ``schema`` or, without one, the schema
of the directory's first data file (by path; take a declared schema for CSV and JSON-lines,
where a type guessed from one file may not fit the next). Each file's columns are taken by
name and cast to it (columns the schema does not name are not read); a missing column, or
one that does not cast, is a :class:`~sparkjet.errors.SchemaMismatchError` naming the file
and the column. A file system that cannot be reached or refuses the credentials is a
:class:`~sparkjet.errors.ConnectorError`.

**Records that do not parse.** A CSV or JSON-lines record that does not parse or whose value
does not convert to the schema's type goes to the source's ``on_error``: "fail" stops the job
with a :class:`~sparkjet.errors.BadRecordError` naming the file, the line (from 1, the CSV
header being line 1) and the column (None: the record itself is malformed); "skip" drops it;
a dead-letter sink gets the line's bytes with ``offset`` its line number and ``position``
``"<directory>/<file> line <n>"``. The other records of the file go on. Files are parsed a
block at a time; from a block that fails on, the file is parsed in chunks of lines, halved
until the bad lines are alone. A record that did not parse counts as one of the file's
``row`` in the reader's position, so a restore neither reports it again nor skips a good
row. (Without a ``schema``, a record that does not parse in the first block of the first
file, which the schema is inferred from, still fails with a
:class:`~sparkjet.errors.CorruptDataError`: declare the schema.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
import os
import re
import time
from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Literal

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.fs as pafs
import pyarrow.json as pjson
import pyarrow.parquet as pq
from msgspec import Meta

from sparkjet._checks import check_distinct_ints, check_int
from sparkjet._redact import redact_url
from sparkjet.connectors._settings import (
    Count,
    FileSystem,
    NonNegativeNumber,
    Path,
    Schema,
    Settings,
    SourcePartitions,
    Text,
)
from sparkjet.connectors.base import BadRecord, ProcessorContext, Source, SourceReader
from sparkjet.errors import (
    ConnectorError,
    CorruptDataError,
    InvalidArgumentError,
    SchemaMismatchError,
    SourceChangedError,
)

FORMATS = ("parquet", "csv", "jsonl")
SUFFIXES = {
    "parquet": (".parquet", ".parq"),
    "csv": (".csv", ".csv.gz", ".csv.bz2", ".csv.zst"),
    "jsonl": (".jsonl", ".ndjson", ".json", ".jsonl.gz", ".ndjson.gz", ".json.gz"),
}
"""The names each format reads by default (``suffixes=`` changes them); compressed text
files are decompressed by their suffix (``pyarrow.fs``'s ``compression="detect"``)."""

_WHAT = "directory source"
# Bytes per parsed block of CSV and JSON-lines: the unit a poison record is located in.
_TEXT_BLOCK = 1 << 20


def partition_of(relative_path: str, partitions: int) -> int:
    """The source partition of the file at ``relative_path`` (relative to the root, with
    ``/`` separators): stable across processes, machines and Python versions.

    >>> partition_of("2026/01/a.parquet", 4)
    1
    """
    digest = hashlib.blake2b(relative_path.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % partitions


@dataclass(frozen=True)
class DirectorySourceSettings(Settings):
    """:class:`DirectorySource`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    path: Path
    format: Literal["parquet", "csv", "jsonl"] = "parquet"     # FORMATS
    _: KW_ONLY
    schema: Schema | None = None
    partitions: SourcePartitions = 4
    filesystem: FileSystem | None = None
    watch: bool = False
    poll_interval: NonNegativeNumber = 1.0
    end_marker: Annotated[str, Meta(min_length=1, description="a file name")] | None = None
    batch_size: Count = 65536
    suffixes: Annotated[tuple[Text, ...], Meta(description="a tuple of file name suffixes")] \
        | None = None
    ordered_names: bool = False

    def check(self) -> None:
        if self.end_marker is not None and not self.watch:
            raise self._error("end_marker ends a watching source: give watch=True")
        if self.filesystem is None and "://" not in self.path:
            self._derive("path", os.path.abspath(self.path))  # members may run elsewhere
        if self.schema is not None:
            self._derive("schema", self.schema.remove_metadata())
        if self.end_marker is not None:
            self._derive("end_marker", self.end_marker.strip("/"))
        if self.suffixes is None:
            self._derive("suffixes", SUFFIXES[self.format])


class DirectorySource(Source):
    """The ``format`` files under ``path`` as a replayable source of ``partitions`` source
    partitions (see the module doc for the replay protocol and the writer's contract).

    ``path`` is a local directory, a URI (``s3://bucket/prefix``, ``gs://bucket/prefix``,
    ``hdfs://namenode:8020/dir``, resolved by ``pyarrow.fs.FileSystem.from_uri`` on the
    members, with the environment's credentials), or a path inside ``filesystem``, a
    ``pyarrow.fs.FileSystem`` (such as ``S3FileSystem(endpoint_override=...)``; it travels
    to the members pickled, credentials included). ``batch_size`` caps the rows of one batch.

    >>> DirectorySource("/data/orders", "csv", partitions=8)
    DirectorySource('/data/orders', format='csv', partitions=8, watch=False)
    """

    name = "directory"
    replayable = True
    acknowledging = False

    def __init__(self, path, format: str = "parquet", *, schema: pa.Schema | None = None,
                 partitions: int = 4, filesystem: pafs.FileSystem | None = None,
                 watch: bool = False, poll_interval: float = 1.0,
                 end_marker: str | None = None, batch_size: int = 65536,
                 suffixes: tuple[str, ...] | None = None, ordered_names: bool = False):
        DirectorySourceSettings.of(locals()).apply(self)

    def __repr__(self) -> str:
        return (f"DirectorySource({self.where!r}, format={self.format!r}, "
                f"partitions={self.partitions}, watch={self.watch})")

    @property
    def where(self) -> str:
        """The directory, for messages (without credentials)."""
        if self.filesystem is not None:
            return f"{self.filesystem.type_name}:{self.path}"
        return redact_url(self.path)

    def partition_count(self) -> int:
        return self.partitions

    def open(self, partitions: list[int], context: ProcessorContext) -> DirectoryReader:
        return DirectoryReader(self, partitions)

    def resolve(self) -> tuple[pafs.FileSystem, str]:
        """The file system and the root path in it."""
        if self.filesystem is not None:
            return self.filesystem, self.path.rstrip("/") or "/"
        if "://" not in self.path:
            return pafs.LocalFileSystem(), self.path
        try:
            fs, root = pafs.FileSystem.from_uri(self.path)
        except (pa.ArrowInvalid, ValueError) as e:
            raise InvalidArgumentError(
                f"{_WHAT}: {self.where} is not a usable URI: {self._masked(e)}") from None
        except OSError as e:
            raise ConnectorError(f"{_WHAT}: cannot reach {self.where}: {self._masked(e)}") \
                from None
        return fs, root.rstrip("/") or "/"

    def _masked(self, error: Exception) -> str:
        """pyarrow's message, with the URI (which may hold credentials) masked."""
        return str(error).replace(self.path, self.where)


class DirectoryReader(SourceReader):
    """Reads some partitions of a :class:`DirectorySource`, taking turns between them."""

    def __init__(self, source: DirectorySource, partitions: list[int]):
        self._source = source
        parts = check_distinct_ints("partitions", partitions, min=0, max=source.partitions - 1)
        self._fs: pafs.FileSystem | None = None
        self._root = ""
        self._schema = source.schema
        self._parts = {p: _Partition(p) for p in parts}
        self._order = parts
        self._turn = 0
        self._last: int | None = None
        self._listings = 0
        self._listed_at = 0.0
        self._marker_seen = False

    # -- the SourceReader contract -------------------------------------------------------

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        """The next rows (at most ``min(max_rows, batch_size)``) of one partition, the next
        in turn that has any; None if none has rows right now."""
        check_int("max_rows", max_rows, min=1)
        rows = min(max_rows, self._source.batch_size)
        self._list_if_due()
        n = len(self._order)
        for step in range(n):
            part = self._parts[self._order[(self._turn + step) % n]]
            batch = self._next(part, rows)
            if batch is not None:
                self._turn = (self._turn + step + 1) % n
                self._last = part.index
                return batch
        return None

    def at_end(self) -> bool:
        """Without ``watch``: once the files of the first listing are read. With ``watch``:
        once the end marker was listed and everything listed with it is read."""
        if not self._parts:
            return True     # more processors than partitions: this one has none
        if self._listings == 0:
            self._list()
        if self._source.watch and not self._marker_seen:
            return False
        return all(p.idle() for p in self._parts.values())

    def last_partition(self) -> int | None:
        return self._last

    def snapshot_state(self) -> dict:
        return {"files": {str(p.index): p.state() for p in self._parts.values()},
                "next": self._order[self._turn] if self._order else None}

    def restore_state(self, state: dict | None) -> None:
        """Continues every partition of this reader from ``state`` (None: from the start).
        ``state`` may hold more partitions (another reader's) but must hold all of ours."""
        self._listings = 0
        self._marker_seen = False
        if state is None:
            self._parts = {p: _Partition(p) for p in self._order}
            self._turn = 0
            return
        saved = state.get("files") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise InvalidArgumentError(
                f"a {_WHAT} state is {{'files': {{partition: position}}}}, got {state!r}")
        parts = {}
        for p in self._order:
            position = saved.get(str(p), saved.get(p))
            if position is None:
                raise InvalidArgumentError(
                    f"the state has no position for {_WHAT} partition {p} "
                    f"(it holds partitions {sorted(saved, key=int)})")
            parts[p] = _Partition.restored(p, position)
        self._parts = parts
        nxt = state.get("next")
        self._turn = self._order.index(nxt) if nxt in self._order else 0

    def close(self) -> None:
        for part in self._parts.values():
            part.close()

    # -- listing -------------------------------------------------------------------------

    def _filesystem(self) -> tuple[pafs.FileSystem, str]:
        if self._fs is None:
            self._fs, self._root = self._source.resolve()
        return self._fs, self._root

    def _list_if_due(self) -> None:
        if self._listings == 0:
            self._list()
        elif (self._source.watch and not self._marker_seen
              and all(p.idle() for p in self._parts.values())
              and time.monotonic() - self._listed_at >= self._source.poll_interval):
            self._list()

    def _list(self) -> None:
        """Lists the directory and queues the data files of this reader's partitions
        that are new to it."""
        files = self._data_files()
        first = self._listings == 0
        self._listings += 1
        self._listed_at = time.monotonic()
        if self._schema is None and files:
            self._schema = self._infer_schema(files[0])
        ordered = self._source.ordered_names
        partitions = self._source.partitions
        listed = set(files)
        for part in self._parts.values():
            part.forget_all_but(listed)
        for rel in files:
            part = self._parts.get(partition_of(rel, partitions))
            if part is None or part.knows(rel):
                continue
            floor = part.floor()
            if ordered and floor is not None and rel <= floor:
                if first and part.watermark is not None and rel <= part.watermark:
                    part.read_below.add(rel)    # read before the snapshot restored from
                    continue
                raise InvalidArgumentError(
                    f"{_WHAT} {self._source.where}: {rel} appeared after {floor} was read, "
                    "but with ordered_names=True new files must sort after every file "
                    "already read")
            part.enqueue(rel)

    def _data_files(self) -> list[str]:
        """The relative paths of the data files under the root, sorted."""
        fs, root = self._filesystem()
        source = self._source
        try:
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        except FileNotFoundError:
            if source.watch:
                return []   # it may yet be created
            raise InvalidArgumentError(f"{_WHAT}: {source.where} does not exist") from None
        except NotADirectoryError:
            raise InvalidArgumentError(f"{_WHAT}: {source.where} is not a directory") from None
        except OSError as e:
            raise ConnectorError(f"{_WHAT}: cannot list {source.where}: {e}") from None
        prefix = root.rstrip("/") + "/"
        out = []
        for info in infos:
            if info.type != pafs.FileType.File or not info.path.startswith(prefix):
                continue
            rel = info.path[len(prefix):]
            if rel == source.end_marker:
                self._marker_seen = True
                continue
            if any(part[:1] in (".", "_") for part in rel.split("/")):
                continue
            if source.suffixes and not rel.endswith(source.suffixes):
                continue
            out.append(rel)
        out.sort()
        return out

    # -- files ---------------------------------------------------------------------------

    def _next(self, part: _Partition, rows: int) -> pa.RecordBatch | None:
        """The next rows of one partition, moving on to its next file when one ends."""
        while part.pending is None:
            if part.batches is None:
                if part.file is None:
                    if not part.queue:
                        return None
                    part.start(heapq.heappop(part.queue))
                self._check_unchanged(part, opening=True)
                part.batches = self._open(part.file, part.row)
            batch = self._pull(part)
            if batch is None:
                self._check_unchanged(part, opening=False)
                part.finish(self._source.ordered_names)
            elif isinstance(batch, BadRecord):
                part.row += 1           # a record of the file, as a row is
                self.bad_record(dataclasses.replace(batch, partition=part.index))
            elif batch.num_rows:
                part.pending = batch
        out = part.pending.slice(0, rows)
        part.row += out.num_rows
        part.pending = part.pending.slice(out.num_rows) if out.num_rows < part.pending.num_rows \
            else None
        return out

    def _pull(self, part: _Partition) -> pa.RecordBatch | None:
        """The next batch of the partition's open file (None at its end), with the
        errors of reading it named."""
        try:
            return next(part.batches, None)
        except SchemaMismatchError:
            raise
        except FileNotFoundError:
            raise self._gone(part) from None
        except (pa.ArrowInvalid, pa.ArrowKeyError, pa.ArrowTypeError) as e:
            raise self._parse_error(part.file, part.row, e) from None
        except OSError as e:
            raise ConnectorError(f"{_WHAT}: cannot read {self._name(part.file)}: {e}") from None

    def _stamp(self, rel: str) -> list | None:
        """``[size, modification time in ns]`` of a file (None: it does not exist)."""
        fs, root = self._filesystem()
        try:
            info = fs.get_file_info(f"{root.rstrip('/')}/{rel}")
        except OSError as e:
            raise ConnectorError(f"{_WHAT}: cannot read {self._name(rel)}: {e}") from None
        if info.type == pafs.FileType.NotFound:
            return None
        return [info.size, info.mtime_ns]

    def _check_unchanged(self, part: _Partition, opening: bool) -> None:
        """The partition's file is as it was when the reader started it (its stamp, saved
        with the position); SourceChangedError if not. Opening it for the first time notes
        the stamp; at its end a file already gone was read whole, and is no error."""
        now = self._stamp(part.file)
        if now is None and opening:
            raise self._gone(part)
        if part.stamp is None:
            part.stamp = now
            return
        if now is None or now == part.stamp:
            return
        size, mtime = part.stamp
        what = [f"size {size} -> {now[0]} bytes"] if now[0] != size else []
        if now[1] != mtime:
            what.append(f"modified at {now[1]} ns, not {mtime}")
        when = "since the job read its first " if opening else "while the job read "
        raise SourceChangedError(
            f"{_WHAT}: {self._name(part.file)} changed {when}"
            f"{part.row if opening else 'its'} rows ({', '.join(what)}): files must not be "
            "modified or replaced once they appear; the job stops rather than read other "
            "data from the saved position")

    def _gone(self, part: _Partition) -> SourceChangedError:
        done = f"after the job read {part.row} of its rows" if part.row else \
            "before the job read it"
        return SourceChangedError(
            f"{_WHAT}: {self._name(part.file)} is gone {done}: files must not be removed "
            "until the job has read them")

    def _open(self, rel: str, skip: int):
        """The batches of one file from row ``skip`` on, in the source's schema."""
        fs, root = self._filesystem()
        path = f"{root.rstrip('/')}/{rel}"
        if self._schema is None:    # a restored file, the directory listing nothing else
            self._schema = self._infer_schema(rel)
        fmt = self._source.format
        if fmt == "parquet":
            batches = self._parquet(fs, path, rel, skip)
        else:
            batches = self._text(fs, path, rel, fmt)
            if skip:
                batches = _skip_rows(batches, skip, self._name(rel))
        return batches

    def _parquet(self, fs, path: str, rel: str, skip: int):
        schema = self._schema
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            _check_columns(pf.schema_arrow, schema, self._name(rel))
            meta = pf.metadata
            # Seek to the row group holding row `skip`: a restore reads no group before it.
            group, before = 0, 0
            while (group < meta.num_row_groups
                   and before + meta.row_group(group).num_rows <= skip):
                before += meta.row_group(group).num_rows
                group += 1
            batches = pf.iter_batches(batch_size=self._source.batch_size,
                                      row_groups=range(group, meta.num_row_groups),
                                      columns=schema.names)
            if skip > before:
                batches = _skip_rows(batches, skip - before, self._name(rel), skip)
            for batch in batches:
                yield _conform(batch, schema, self._name(rel))

    def _text(self, fs, path: str, rel: str, fmt: str):
        """The batches of a CSV or JSON-lines file, parsed a block at a time; from a block
        that does not parse on, line by line (:meth:`_by_line`), which yields each record
        that does not parse as a :class:`BadRecord` in its place."""
        schema = self._schema
        returned = 0
        stream = fs.open_input_stream(path)
        try:
            if fmt == "csv":
                reader = pcsv.open_csv(
                    stream, read_options=pcsv.ReadOptions(block_size=_TEXT_BLOCK),
                    convert_options=_csv_conversion(schema))
            else:
                reader = _open_json(stream, schema)
            for batch in reader:
                batch = _conform(batch, schema, self._name(rel))
                yield batch
                returned += batch.num_rows
            return
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            if "does not exist in CSV file" in str(e):
                raise               # a missing column (SchemaMismatchError), not a record
        finally:
            stream.close()
        # the rows returned so far were good: each was one record of the file
        yield from _skip_rows(self._by_line(fs, path, rel, fmt), returned, self._name(rel))

    def _by_line(self, fs, path: str, rel: str, fmt: str):
        """The records of a text file parsed in chunks of lines (the header first, for
        CSV); a chunk that does not parse is halved until the lines that do not parse are
        alone, and each of those is a :class:`BadRecord` (offset: its line, from 1)."""
        with fs.open_input_stream(path) as stream:
            lines = _lines(stream)
            header = None
            if fmt == "csv":
                header = next((line for _, line in lines if line), b"")
            chunk = []
            for number, line in lines:
                if not (line if fmt == "csv" else line.strip()):
                    continue        # empty lines hold no record (as pyarrow reads them)
                chunk.append((number, line))
                if len(chunk) >= self._source.batch_size:
                    yield from self._halving(chunk, header, rel)
                    chunk = []
            if chunk:
                yield from self._halving(chunk, header, rel)

    def _halving(self, chunk: list, header: bytes | None, rel: str):
        schema = self._schema
        try:
            table = _parse_lines([line for _, line in chunk], header, schema)
            if table.num_rows == len(chunk):
                for batch in table.to_batches():
                    yield _conform(batch, schema, self._name(rel))
                return
            error = f"{len(chunk)} lines gave {table.num_rows} records"
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            error = str(e)
        if len(chunk) > 1:
            half = len(chunk) // 2
            yield from self._halving(chunk[:half], header, rel)
            yield from self._halving(chunk[half:], header, rel)
            return
        [(number, line)] = chunk
        column = _column_at_fault(line, header, schema)
        what = (f"column {column!r} does not convert to {schema.field(column).type}"
                if column is not None else "the record does not parse")
        yield BadRecord(f"{what}: {_ROW_IN_MESSAGE.sub('', error)}", column, line, None,
                        number, f"{self._name(rel)} line {number}")

    def _infer_schema(self, rel: str) -> pa.Schema:
        """The schema of the first data file, which every file is then read in."""
        fs, root = self._filesystem()
        path = f"{root.rstrip('/')}/{rel}"
        try:
            if self._source.format == "parquet":
                schema = pq.read_schema(fs.open_input_file(path))
            else:
                with fs.open_input_stream(path) as stream:
                    if self._source.format == "csv":
                        schema = pcsv.open_csv(stream).schema
                    else:
                        schema = _open_json(stream, None).schema
        except FileNotFoundError:
            raise CorruptDataError(f"{_WHAT}: {self._name(rel)} is gone") from None
        except (pa.ArrowInvalid, pa.ArrowKeyError, pa.ArrowTypeError) as e:
            raise self._parse_error(rel, 0, e) from None
        except OSError as e:
            raise ConnectorError(f"{_WHAT}: cannot read {self._name(rel)}: {e}") from None
        return schema.remove_metadata()

    def _parse_error(self, rel: str, row: int, e: Exception) -> Exception:
        text = str(e).strip("'\"")
        missing = "does not exist in CSV file" in text
        if missing:
            return SchemaMismatchError(
                f"{_WHAT}: {self._name(rel)}: {text} (the schema wants columns "
                f"{self._schema.names})")
        return CorruptDataError(
            f"{_WHAT}: {self._name(rel)}: cannot read the records after row {row}: {text}", row)

    def _name(self, rel: str) -> str:
        """A file, for messages: the directory (without credentials) and its path in it."""
        return f"{self._source.where.rstrip('/')}/{rel}"


class _Partition:
    """One source partition's files: those read, the one being read, those queued."""

    def __init__(self, index: int):
        self.index = index
        self.done: set[str] = set()
        self.watermark: str | None = None
        # ordered_names: the files at or below the watermark this reader has read or
        # listed (in memory only, to tell an out-of-order newcomer from an old file).
        self.read_below: set[str] = set()
        self.queue: list[str] = []      # a heap of relative paths
        self._queued: set[str] = set()
        self.file: str | None = None
        self.row = 0                    # rows of `file` returned
        self.stamp: list | None = None  # `file`'s [size, mtime_ns] when started
        self.batches = None             # the open file's batches
        self.pending: pa.RecordBatch | None = None

    @classmethod
    def restored(cls, index: int, position) -> _Partition:
        fields = ("done", "watermark", "file", "row")
        if (not isinstance(position, dict) or not all(k in position for k in fields)
                or not isinstance(position["done"], list)):
            raise InvalidArgumentError(
                f"the position of {_WHAT} partition {index} must be {{'done': [...], "
                f"'watermark', 'file', 'row'}}, got {position!r}")
        part = cls(index)
        part.done = set(position["done"])
        part.watermark = position["watermark"]
        part.file = position["file"]
        part.row = check_int(f"'row' of {_WHAT} partition {index}", position["row"], min=0)
        stamp = position.get("stamp")   # absent in states of older versions: not checked
        part.stamp = list(stamp) if isinstance(stamp, list) and len(stamp) == 2 else None
        return part

    def state(self) -> dict:
        state = {"done": sorted(self.done), "watermark": self.watermark, "file": self.file,
                 "row": self.row}
        if self.stamp is not None:
            state["stamp"] = self.stamp
        return state

    def knows(self, rel: str) -> bool:
        return (rel in self.done or rel in self._queued or rel == self.file
                or rel in self.read_below)

    def forget_all_but(self, listed: set[str]) -> None:
        """Drops the read files that are gone from the directory: they cannot come back
        (files are never re-created), and the state stays as small as the directory."""
        if not self.done.issubset(listed):
            self.done &= listed
        if not self.read_below.issubset(listed):
            self.read_below &= listed

    def floor(self) -> str | None:
        """The greatest path read or being read (ordered_names: nothing may appear below)."""
        marks = [m for m in (self.watermark, self.file) if m is not None]
        return max(marks) if marks else None

    def enqueue(self, rel: str) -> None:
        heapq.heappush(self.queue, rel)
        self._queued.add(rel)

    def start(self, rel: str) -> None:
        self._queued.discard(rel)
        self.file, self.row, self.stamp = rel, 0, None

    def finish(self, ordered: bool) -> None:
        if ordered:
            self.watermark = max(self.watermark or self.file, self.file)
            self.read_below.add(self.file)
        else:
            self.done.add(self.file)
        self.close()
        self.file, self.row, self.stamp = None, 0, None

    def idle(self) -> bool:
        return self.file is None and not self.queue

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
        self.batches = self.pending = None


def _skip_rows(batches, skip: int, name: str, position: int | None = None):
    """The rows of ``batches`` after the first ``skip``; SourceChangedError if there are
    fewer (the file shrank since the position ``position``, default ``skip``, was saved)."""
    wanted = skip if position is None else position
    for batch in batches:
        if isinstance(batch, BadRecord):    # a record that does not parse counts as a row
            if skip:
                skip -= 1
            else:
                yield batch
            continue
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        yield batch.slice(skip) if skip else batch
        skip = 0
    if skip:
        raise SourceChangedError(
            f"{_WHAT}: {name} holds fewer rows than the {wanted} the job had read of it: it "
            "changed since; files must not be modified once they appear")


def _csv_conversion(schema: pa.Schema) -> pcsv.ConvertOptions:
    return pcsv.ConvertOptions(column_types=schema, include_columns=schema.names)


def _json_parsing(schema: pa.Schema | None) -> pjson.ParseOptions:
    return pjson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore") \
        if schema is not None else pjson.ParseOptions()


def _lines(stream):
    """``(number, line)`` of each line of a text stream, from 1, without its line end."""
    number, rest = 0, b""
    while True:
        block = stream.read(_TEXT_BLOCK)
        if not block:
            break
        parts = (rest + block).split(b"\n")
        rest = parts.pop()
        for line in parts:
            number += 1
            yield number, line.removesuffix(b"\r")
    if rest:
        yield number + 1, rest.removesuffix(b"\r")


def _parse_lines(lines: list, header: bytes | None, schema: pa.Schema) -> pa.Table:
    """Lines of a CSV (under ``header``) or JSON-lines file, parsed as the block reader
    parses them."""
    if header is not None:
        data = b"\n".join([header, *lines])
        return pcsv.read_csv(pa.py_buffer(data), read_options=pcsv.ReadOptions(use_threads=False),
                             convert_options=_csv_conversion(schema))
    return pjson.read_json(pa.py_buffer(b"\n".join(lines)),
                           read_options=pjson.ReadOptions(use_threads=False),
                           parse_options=_json_parsing(schema))


def _column_at_fault(line: bytes, header: bytes | None, schema: pa.Schema) -> str | None:
    """The first column of ``schema`` that a record which does not parse fails on alone;
    None when every column fails (the record itself is malformed)."""
    failed = []
    for field in schema:
        try:
            _parse_lines([line], header, pa.schema([field]))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            failed.append(field.name)
    return failed[0] if failed and len(failed) < len(schema) else None


#: Where pyarrow says the record is in what it parsed (one line, or a chunk): not the file.
_ROW_IN_MESSAGE = re.compile(r"Row #\d+: | in row \d+")


def _open_json(stream, schema: pa.Schema | None):
    parse = _json_parsing(schema)
    read = pjson.ReadOptions(block_size=_TEXT_BLOCK)
    if hasattr(pjson, "open_json"):
        return pjson.open_json(stream, read_options=read, parse_options=parse)
    # pyarrow < 19 has no streaming JSON reader.
    table = pjson.read_json(stream, read_options=read, parse_options=parse)
    return iter(table.to_batches()) if schema is not None else _TableReader(table)


class _TableReader:
    """A table in the shape of a streaming reader (a schema, then batches)."""

    def __init__(self, table: pa.Table):
        self.schema = table.schema
        self._batches = iter(table.to_batches())

    def __iter__(self):
        return self._batches


def _check_columns(have: pa.Schema, want: pa.Schema, name: str) -> None:
    for field in want:
        if have.get_field_index(field.name) < 0:
            raise SchemaMismatchError(
                f"{_WHAT}: {name} has no column {field.name!r} (it has {have.names}; the "
                f"schema wants {want.names})")


def _conform(batch: pa.RecordBatch, schema: pa.Schema, name: str) -> pa.RecordBatch:
    """``batch``'s columns of ``schema``, by name, cast to its types."""
    if batch.schema.equals(schema):
        return batch
    _check_columns(batch.schema, schema, name)
    columns = []
    for field in schema:
        column = batch.column(field.name)
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                raise SchemaMismatchError(
                    f"{_WHAT}: {name}: column {field.name!r} is {column.type}, which does not "
                    f"cast to the schema's {field.type}: {e}") from None
        columns.append(column)
    return pa.RecordBatch.from_arrays(columns, schema=schema)
