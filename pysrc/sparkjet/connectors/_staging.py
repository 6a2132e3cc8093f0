"""Rows staged per snapshot until phase 2: what the Kafka and Delta Lake sinks share.

Both sinks make a snapshot's rows visible in one transaction of their system (a Kafka
transaction, a Delta commit), which a restarted execution must be able to redo from the
snapshot alone. So at phase 1 a writer stages the epoch's rows durably, one Arrow IPC file
per processor and snapshot::

    {staging}/{directory}/p{P:05d}/e{execution:012d}-s{snapshot}.arrow      (fsynced)

and the snapshot saves the description of every staged, not yet committed snapshot of the
processor: ``{"format": 1, "processors": N, "transactions": [{"processor", "execution",
"snapshot", "file", "rows"}, ...]}``. Phase 2 and recovery hand the rows (from memory while
the writer that staged them lives, else from their file) to the sink's one transaction,
then delete the files. What says that a snapshot is in the system already (Kafka's marker,
Delta's application transaction version) is the sink's own.

With ``hints`` (a backend of the same root, not fsynced: the Kafka sink's), phase 2 also
leaves ``{file}.committed`` beside a staged file once the system took it, removed with the
file: a recovery that the system's marker sends to produce it again can say that it was
committed before (:meth:`StagedSnapshots.was_committed`): the system lost its marker (and
maybe the rows). A hint lost in a crash only means that nothing is said.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable

import pyarrow as pa

from sparkjet._fs import Backend
from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import SnapshotIncompleteError

DESCRIPTION_FORMAT = 1
COMMITTED_HINT = ".committed"
_STAGED = re.compile(r"e(\d{12,})-s(\d+)\.arrow")
_PROCESSOR_DIR = re.compile(r"p(\d{5,})")


class StagedSnapshots:
    """One writer's staged, not yet committed snapshots, under ``directory`` (relative to
    the root of ``backend``). ``what`` names the writer in errors; ``not_committed`` ends
    the error of a staged file gone while its snapshot is not committed (what the sink's
    system says). Thread-safe: phase 2 may run beside the next epoch's phase 1."""

    def __init__(self, backend: Backend, directory: str, context: ProcessorContext,
                 what: str, not_committed: str, hints: Backend | None = None):
        self.backend = backend
        self.hints = hints
        self.directory = directory
        self.context = context
        self._what = what
        self._not_committed = not_committed
        self._pending: list[dict] = []          # staged, not yet committed; oldest first
        self._memory: dict[int, list] = {}      # snapshot -> its batches, while in memory
        # committed, kept while a restorable snapshot may list them: (the newest snapshot
        # staged when they were committed, file)
        self._committed: list[tuple[int, str]] = []
        self._last_staged = -1
        self._lock = threading.Lock()

    def processor_dir(self, processor: int) -> str:
        """Where processor index `processor` stages its files (relative to the root)."""
        return f"{self.directory}/p{processor:05d}"

    # -- phase 1 ---------------------------------------------------------------------------

    def stage(self, snapshot_id: int, batches: list) -> dict:
        """Stages `batches` (the epoch's rows; none: nothing) as snapshot `snapshot_id`
        and returns the description of every staged, not yet committed snapshot."""
        c = self.context
        with self._lock:
            if batches:
                rel = (f"{self.processor_dir(c.processor)}/"
                       f"e{c.execution_id:012d}-s{snapshot_id}.arrow")
                self._write(rel, batches)
                self._pending.append({"processor": c.processor, "execution": c.execution_id,
                                      "snapshot": snapshot_id, "file": rel,
                                      "rows": sum(b.num_rows for b in batches)})
                self._memory[snapshot_id] = batches
            self._last_staged = max(self._last_staged, snapshot_id)
            pending = [dict(t) for t in self._pending]
        return {"format": DESCRIPTION_FORMAT, "processors": c.processors,
                "transactions": pending}

    def _write(self, rel: str, batches: list) -> None:
        b = self.backend
        out = b.open_write(b.path(rel))
        try:
            buffer = pa.BufferOutputStream()
            schema = batches[0].schema
            with pa.ipc.new_file(buffer, schema) as w:
                for batch in batches:
                    w.write_batch(batch if batch.schema.equals(schema) else batch.cast(schema))
            out.write(buffer.getvalue())
        except BaseException:
            out.abort()
            raise
        out.close()
        b.sync_dir(b.path(rel.rsplit("/", 1)[0]))

    # -- phase 2 ---------------------------------------------------------------------------

    def commit(self, snapshot_id: int, commit: Callable[[list, Callable], object]) -> None:
        """Phase 2 of `snapshot_id`: hands the staged snapshots up to it to ``commit(due,
        batches_of)``, the sink's one transaction (``batches_of(t)``: the rows of staged
        snapshot ``t``), then forgets them, and deletes the files no restorable snapshot
        lists any more: those committed before `snapshot_id` was staged (its record, now
        the one a restart restores, was written without them)."""
        with self._lock:
            due = [t for t in self._pending if t["snapshot"] <= snapshot_id]
        if due:
            commit(due, self.batches)
            if self.hints is not None:
                for t in due:
                    self._hint(t)
        with self._lock:
            for t in due:
                self._memory.pop(t["snapshot"], None)
                self._committed.append((self._last_staged, t["file"]))
            self._pending = [t for t in self._pending if t["snapshot"] > snapshot_id]
            gone = [f for stamp, f in self._committed if stamp < snapshot_id]
            self._committed = [(stamp, f) for stamp, f in self._committed
                               if stamp >= snapshot_id]
        for f in gone:
            self._remove(f)

    def _hint(self, txn: dict) -> None:
        try:
            self.hints.write(self.hints.path(txn["file"] + COMMITTED_HINT),
                             [str(self.context.execution_id).encode()])
        except OSError:
            pass        # a hint: without it a lost marker goes unreported, nothing more

    def _remove(self, rel: str) -> None:
        self.backend.remove(self.backend.path(rel))
        if self.hints is not None and self.hints.exists(self.hints.path(rel + COMMITTED_HINT)):
            self.hints.remove(self.hints.path(rel + COMMITTED_HINT))

    def was_committed(self, txn: dict) -> bool:
        """Whether phase 2 left its hint that the system took staged snapshot ``txn``
        (with ``hints`` only)."""
        return self.hints is not None and \
            self.hints.exists(self.hints.path(txn["file"] + COMMITTED_HINT))

    def batches(self, txn: dict) -> list:
        """The rows of staged snapshot `txn`: in memory if this writer staged them, else
        read back from their file."""
        return self._memory.get(txn["snapshot"]) or self.load(txn)

    def load(self, txn: dict) -> list:
        """The rows of staged snapshot `txn`, read back from their file (checked against
        the row count the snapshot saved)."""
        b = self.backend
        path = b.path(txn["file"])
        if not b.exists(path):
            raise SnapshotIncompleteError(
                f"{self._what}: staged snapshot {txn['snapshot']} of processor "
                f"{txn['processor']} ({path}) is gone and {self._not_committed}")
        table = pa.ipc.open_file(b.read(path)).read_all()
        if table.num_rows != txn["rows"]:
            raise SnapshotIncompleteError(
                f"{self._what}: staged file {path} has {table.num_rows} rows, "
                f"the snapshot says {txn['rows']}")
        return table.to_batches()

    # -- recovery --------------------------------------------------------------------------

    def reset(self, snapshot_id: int | None = None, committed: list[dict] = ()) -> None:
        """Forgets every staged snapshot after a recovery from `snapshot_id` committed or
        dropped them; the files of `committed` (the restored snapshot's, in the system
        now) are kept until the first snapshot after it commits."""
        with self._lock:
            self._pending, self._memory = [], {}
            self._committed = [(-1 if snapshot_id is None else snapshot_id, t["file"])
                               for t in committed]
            self._last_staged = -1 if snapshot_id is None else snapshot_id

    def staged_processors(self) -> list[int]:
        """The processor indexes that have a staging directory."""
        b = self.backend
        return [int(m[1]) for n in b.listdir(b.path(self.directory))
                if (m := _PROCESSOR_DIR.fullmatch(n))]

    def remove_leftovers(self, processor: int, keep: list[dict] = ()) -> None:
        """Deletes the staged files of processor index `processor` from this or older
        executions but those of `keep` (the restored snapshot's transactions): at recovery
        every snapshot they hold is committed now, or never completed. (A newer execution's
        files are not ours to judge.)"""
        b = self.backend
        kept = {t["file"].rsplit("/", 1)[-1] for t in keep if t["processor"] == processor}
        names = b.listdir(b.path(self.processor_dir(processor)))
        for name in names:
            m = _STAGED.fullmatch(name)
            if m is not None and int(m[1]) <= self.context.execution_id and name not in kept:
                self._remove(f"{self.processor_dir(processor)}/{name}")
        for name in names:          # hints whose file went (a crash between the two)
            if name.endswith(COMMITTED_HINT) and name[:-len(COMMITTED_HINT)] not in names:
                b.remove(b.path(self.processor_dir(processor), name))
