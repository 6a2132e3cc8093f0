"""A bounded Spark DataFrame (or table) as a replayable source: materialised once, on the
driver, as Parquet files that the members then read as a :class:`DirectorySource`.

A DataFrame is a query, not data: run twice, it may give other rows (a table that changed,
``rand()``, a non-deterministic join order), and a restore seeks into what was read. So the
source writes the DataFrame once (``df.write.parquet``, by the DataFrame's own session:
classic or Spark Connect) when the job first starts, and every execution and every later run
of the job reads those files, with the file being read and its row in the snapshot.

**Where.** ``path=`` if given, else ``{snapshot_store}/_dataframes/{job id}/{vertex}`` (the
job's snapshot store must then be a local or mounted path, or ``hdfs://``: somewhere Spark
writes and pyarrow reads under one name). Layout::

    path/d-{uuid}/part-*.parquet         one Spark write (one file per Spark partition)
    path/_sparkjet_dataframe.json        {"data": "d-{uuid}"}: the write that counts

**When.** At the start of each run of the job (:meth:`Source.prepare`, under the job's run
lock): when ``_sparkjet_dataframe.json`` exists, its files are read and nothing is written
(a rerun after a failure, a stop or a driver crash reads what the first run wrote);
otherwise the DataFrame is written under a fresh ``d-{uuid}`` (what an earlier write that
did not finish left there is removed first) and the record is created exclusively, which is
the commit point. Constructing the source runs nothing.

**Never a silent rewind.** The query is never run again, so what it would give now cannot
change the job's input; the files it wrote are read by :class:`DirectorySource`, which
refuses a file changed, truncated or deleted under the job
(:class:`~sparkjet.errors.SourceChangedError`, naming the file).

**Cleanup.** Once the job has run to its end the files are removed (``keep=True`` keeps
them); after a failure, a stop or a cancel they stay, for the run that resumes.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import KW_ONLY, dataclass
from typing import Any

from sparkjet._fs import Backend, absolute, spark_names, spark_path
from sparkjet.connectors._settings import Path, PositiveInt, Settings, SourcePartitions
from sparkjet.connectors.base import DriverContext, ProcessorContext, Source, SourceReader
from sparkjet.connectors.files.source import DirectorySource
from sparkjet.errors import ConnectorError, InvalidArgumentError

RECORD = "_sparkjet_dataframe.json"
_WHAT = "DataFrame source"


@dataclass(frozen=True)
class DataFrameSourceSettings(Settings):
    """:class:`DataFrameSource`'s arguments, checked (see :mod:`sparkjet.connectors._settings`)."""

    df: Any     # a bounded Spark DataFrame: checked by check(), without importing pyspark
    _: KW_ONLY
    partitions: SourcePartitions = 4
    path: Path | None = None
    batch_size: PositiveInt = 65536
    keep: bool = False

    def check(self) -> None:
        if not _is_dataframe(self.df):
            raise InvalidArgumentError(
                f"{_WHAT}: df must be a Spark DataFrame, got {type(self.df).__name__}")
        if self.df.isStreaming:
            raise InvalidArgumentError(
                f"{_WHAT}: the DataFrame is a streaming one (df.isStreaming); a job reads a "
                "bounded DataFrame once. Feed a stream into an Arrow log instead: "
                "df.writeStream.format('sparkjet-log') (sparkjet.spark.register), read by "
                "ArrowLogSource")
        if self.path is not None:
            self._derive("path", absolute(self.path))


class DataFrameSource(Source):
    """The rows of the bounded Spark DataFrame ``df`` (classic or Spark Connect), in
    ``partitions`` source partitions, exactly once (see the module doc).

    >>> source = DataFrameSource(spark.table("orders"), partitions=4)   # doctest: +SKIP
    """

    name = "dataframe"
    replayable = True
    acknowledging = False

    def __init__(self, df, *, partitions: int = 4, path=None, batch_size: int = 65536,
                 keep: bool = False):
        DataFrameSourceSettings.of(locals()).apply(self, skip=("df",))
        self._df = df   # not shipped to the members (see __getstate__)
        self._files: DirectorySource | None = None

    def __getstate__(self) -> dict:
        # A DataFrame does not travel (a classic one holds JVM references): the members
        # read the files that prepare() wrote.
        state = dict(self.__dict__)
        state["_df"] = None
        return state

    def __repr__(self) -> str:
        columns = "?" if self._df is None else ", ".join(self._df.columns)
        return f"DataFrameSource(DataFrame[{columns}], partitions={self.partitions})"

    def partition_count(self) -> int:
        return self.partitions

    def location(self, context: DriverContext) -> str:
        """The directory this source materialises into for the job of ``context``."""
        if self.path is not None:
            return self.path
        store = context.snapshot_store
        if store is None:
            raise InvalidArgumentError(
                f"{_WHAT} of {context.vertex!r} in job {context.job_name!r}: the job has no "
                "snapshot_store to keep the DataFrame's files beside; give path=")
        if not spark_names(store):
            raise InvalidArgumentError(
                f"{_WHAT} of {context.vertex!r} in job {context.job_name!r}: the snapshot "
                f"store {store.split('?')[0]} is not a path Spark writes under the name "
                "pyarrow reads; give path= (a shared directory, or hdfs://)")
        return f"{store.rstrip('/')}/_dataframes/{context.job_id:016x}/{context.vertex}"

    def prepare(self, context: DriverContext) -> None:
        location = self.location(context)
        backend = Backend(location)
        record = backend.path(RECORD)
        if not backend.exists(record):
            if self._df is None:
                raise InvalidArgumentError(
                    f"{_WHAT}: {location} holds no materialised DataFrame, and this copy of "
                    "the source has none to write (it was unpickled)")
            for name in backend.listdir(location):
                if name.startswith("d-"):   # a write that never committed
                    backend.remove_tree(backend.path(name))
            data = f"d-{uuid.uuid4().hex}"
            target = backend.path(data)
            try:
                self._df.write.mode("error").parquet(spark_path(target))
            except Exception as e:
                if type(e).__module__.startswith("pyspark"):
                    raise ConnectorError(
                        f"{_WHAT}: writing the DataFrame to {target} failed: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
                raise
            backend.makedirs(location)
            backend.create_exclusive(record, json.dumps({"data": data}).encode())
        try:
            data = json.loads(bytes(backend.read(record)))["data"]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"{_WHAT}: {record} is not a record of a "
                                       f"materialised DataFrame: {e}") from None
        self._files = DirectorySource(backend.path(data), "parquet", partitions=self.partitions,
                                      batch_size=self.batch_size)

    def cleanup(self, context: DriverContext) -> None:
        if not self.keep:
            location = self.location(context)
            Backend(location).remove_tree(location)

    def open(self, partitions: list[int], context: ProcessorContext) -> SourceReader:
        if self._files is None:
            raise InvalidArgumentError(
                f"{_WHAT}: not materialised; a job prepares it on the driver (Job.run)")
        return self._files.open(partitions, context)


def _is_dataframe(df) -> bool:
    """Whether ``df`` is a PySpark DataFrame, classic or Spark Connect (both derive from
    ``pyspark.sql.DataFrame``); without importing pyspark for anything else."""
    if not type(df).__module__.startswith("pyspark."):
        return False
    from pyspark.sql import DataFrame

    return isinstance(df, DataFrame)


__all__ = ["DataFrameSource"]
