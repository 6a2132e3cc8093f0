"""A member: runs its share of a DAG's processors (alone: all of them, and also the
snapshot coordinator of :mod:`sparkjet.runtime.coordinator`, which on Spark runs on the
driver).

The :class:`Member` makes one thread per processor (:mod:`sparkjet.runtime.processors`:
source processors, and keyed processors fed by a
:class:`~sparkjet.runtime.aligner.BarrierAligner` each), keeps their metrics, wires them to
the coordinator (on a thread of its own alone, through a :class:`RemoteLink` on Spark) and to
the processors of other members (:mod:`sparkjet.runtime.exchange`), and fails the whole
execution when any of them fails. The coordinator's commands ("barrier", "commit", "end")
reach the processors through :meth:`Member.command`; what each writes at a barrier and reads
back at restore is :mod:`sparkjet.runtime.snapshotting`'s.

A member that starts from a snapshot (alone: the last complete one; on Spark: the one the
driver names; else the job's initial snapshot, if any) checks it against the pipeline
(:mod:`sparkjet.runtime.restore`) and hands each processor its share of it. Every
execution has an id, the fencing token of store and sinks.
"""
from __future__ import annotations

import base64
import logging
import os
import threading
import time

import pyarrow as pa

from sparkjet.connectors.base import ProcessorContext
from sparkjet.errors import (
    ExchangeError,
    ExchangeFencedError,
    FencedError,
    MemberFailedError,  # noqa: F401 (defined there; named here too)
    SnapshotCorruptError,
    SnapshotIncompleteError,
    )
from sparkjet.operators.table_join import TableVersions
from sparkjet.pipeline.dag import SOURCE, Dag
from sparkjet.runtime import failures
from sparkjet.runtime.aligner import BarrierAligner, TimeoutAligner
from sparkjet.runtime.config import JobConfig, open_store
from sparkjet.runtime.coordinator import SnapshotCoordinator
from sparkjet.runtime.durable import DurableUploader
from sparkjet.runtime.exchange.client import ExchangeClient
from sparkjet.runtime.observability import LATENCY_FIELDS, LatencyHistogram, latencies_encoded
from sparkjet.runtime.processors import KeyedProcessor, Processor, SourceProcessor
from sparkjet.runtime.restore import (
    StartPoint,
    handed_point,
    initial_point,
    open_point,
    own_start,
    plan_restore,
    report_fallback,
    unchecked_start,
)
from sparkjet.runtime.resync import resync_for_restore
from sparkjet.runtime.snapshotting import (
    read_fingerprint,
    restore_processors,
)
from sparkjet.runtime.storage import (
    DriverStoreFiles,
    SlotTables,
    SlotWriterLink,
    check_reachable,
    keep_committed,
    replicator,
    slot_files,
)
from sparkjet.runtime.topology import Topology
from sparkjet.runtime.watermarks import MAX_TIME, MIN_TIME
from sparkjet.snapshot import chunks
from sparkjet.snapshot.store import RecordView

_log = logging.getLogger(__name__)

_NS_PER_UNIT = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
#: The longest a member's processors wait for the snapshot codec's import to finish
#: (0.2-0.3 s on a quiet machine, about 1 s on a slow one); past it they start anyway and
#: the import goes on beside them.
_CODEC_WAIT = 5.0


class Member:
    """Runs one execution of a DAG, or one member's share of it; :meth:`run` returns its
    metrics.

    Alone (the default), the member runs every processor and the snapshot coordinator in
    this process. As member ``index`` of an execution on Spark
    (:mod:`sparkjet.runtime.spark_runner`), it runs its share of the
    :class:`~sparkjet.runtime.topology.Topology`, exchanges batches, watermarks and
    barriers with its peers over :mod:`sparkjet.runtime.exchange`, and a
    :class:`RemoteLink` connects it to the coordinator on the driver, which starts and
    commits snapshots.
    """

    def __init__(self, dag: Dag, config: JobConfig, execution_id: int, *, progress=None,
                 topology: Topology | None = None, index: int = 0,
                 restore_from: int | None | str = "latest", stop_file: str | None = None,
                 slot=None, start: dict | None = None):
        self.dag = dag
        #: with ``storage="members"``: this member's storage slot, where its processors
        #: write their snapshot files, and what copies them to their backups
        #: (:mod:`sparkjet.runtime.storage`)
        self.slot = slot
        self.replicate = None
        #: with a slot: what the driver's join answer handed this member to start from
        #: (:func:`~sparkjet.runtime.restore.handed_start`; None: nothing to restore)
        self.start = start
        #: with a slot: what its snapshot writers ask of a store, fenced by the slot
        self.slot_link = SlotWriterLink(config, slot) if slot is not None else None
        #: set (or, for a member in a child process, ``stop_file`` created) to stop the job
        #: gracefully: the next snapshot is the terminal one, as if every source had ended
        self.stop_requested = threading.Event()
        self.stop_file = stop_file
        self.config = config
        self.execution_id = execution_id
        self.progress = progress or (lambda event: None)
        self.guarantee = config.processing_guarantee
        self.snapshots_on = self.guarantee != "none"
        if self.snapshots_on:
            # the codec's import (blosc2: ~1 s on a slow machine) runs beside the start,
            # not on a keyed thread at its first snapshot (a member process started it
            # already; a member in the caller's process, run(isolated=False), had not);
            # run() lets it finish before the processors start (_codec_ready)
            chunks.warm(config.snapshot_codec)
        # With the members' storage only the driver opens the store (the join answer, the
        # slots and the phase-2 record copies stand in for its log); the table versions of
        # table joins are kept in every slot (and durable copies written into the store).
        self.store = open_store(config) if self.snapshots_on and slot is None else None
        self.table_versions = TableVersions(
            SlotTables(self, slot, config.id) if self.snapshots_on and slot is not None
            else self.store)
        self.topology = t = topology or Topology(1, config.local_parallelism, dag,
                                                 config.partition_count)
        self.index = index
        self.restore_from = restore_from
        self.link: RemoteLink | None = None
        self.peers: dict = {}       # member index -> ExchangeClient (distributed only)
        self._failure: BaseException | None = None
        self._failed = threading.Event()
        self.metrics = {"execution_id": execution_id, "member": index, "events_in": 0,
                        "events_out": 0, "late_events": 0, "skipped_events": 0, "dead_letters": 0,
                        "offset_resets": 0,
                        "snapshots": [], "restored_from": None,
                        "latencies_ns": LatencyHistogram(),
                        "emit_latencies_ns": LatencyHistogram(),
                        # per vertex: rows in and out, and the watermark it has reached
                        "vertices": {v: {"in": 0, "out": 0} for v in dag.vertices}}
        self._lock = threading.Lock()
        #: ns per unit of the event time, once a source has read a timestamp column
        self._ns_per_unit: int | None = None
        #: ns per unit of the integer event-time columns whose unit with_timestamps declared
        self._declared_units = {v.timestamps.column: _NS_PER_UNIT[v.timestamps.unit]
                                for v in dag.vertices.values()
                                if v.timestamps is not None and v.timestamps.unit is not None}
        self.n_sources = t.n_sources
        mode = "at-least-once" if self.guarantee == "at-least-once" else "exactly-once"
        self.processors: list[Processor] = []
        #: (vertex, processor index) -> the aligner of a processor of this member
        self.aligners: dict[tuple[str, int], BarrierAligner] = {}
        for v in dag.vertices.values():
            for k in t.processors_of(v.name, index):
                if v.kind == SOURCE:
                    parts = t.source_partitions_of(v.name, k, v.source.partition_count())
                    self.processors.append(SourceProcessor(self, v, k, parts))
                else:
                    aligner = BarrierAligner(t.channels[v.name], mode=mode,
                                             capacity=config.queue_capacity)
                    if config.alignment_timeout is not None and mode == "exactly-once":
                        aligner = TimeoutAligner(aligner, config.alignment_timeout)
                    self.aligners[(v.name, k)] = aligner
                    self.processors.append(KeyedProcessor(self, v, k))
        self._sources_ended: set[str] = set()
        self._ended = threading.Event()
        #: the restore under way: what the "restored" event will say, and the keyed
        #: processors whose operators are still rebuilding their state (None: no restore)
        self._restoring: dict | None = None
        #: what a Merkle resync before the restore moved (see _resync), for "restored"
        self._resynced: dict | None = None
        #: writers copy their files into the store (a stop exporting its terminal snapshot)
        self.durable_copies = False
        self._rebuilding: set[str] = set()
        #: durable_tier="async": the background uploads of committed snapshots, and the
        #: files this member's writers wrote, by snapshot, until its commit
        #: (:mod:`sparkjet.runtime.durable`)
        self.uploads = None
        self._written: dict[int, list] = {}

    # -- the distributed side ----------------------------------------------------------

    def inbound(self, vertex: str, processor: int):
        """The aligner that streams from peers to ``vertex[processor]`` feed (for the
        member's :class:`~sparkjet.runtime.exchange.ExchangeServer`)."""
        return self.aligners.get((vertex, processor))

    def connect(self, peers: list[str], coordinator: str, security) -> None:
        """Sets the exchange locations of every member (by index) and of the coordinator,
        reached with the execution's credentials
        (:class:`~sparkjet.runtime.exchange.security.LinkSecurity`)."""
        self.peers = {i: ExchangeClient(loc, security=security)
                      for i, loc in enumerate(peers) if i != self.index}
        self.link = RemoteLink(self, ExchangeClient(coordinator, security=security,
                                                    action_timeout=30.0))
        if self.slot is not None:
            self.replicate = replicator(self, self.slot, self.config.id)
            if self.config.durable_tier == "async" and self.snapshots_on:
                self.uploads = DurableUploader(self.slot, self.slot_link, self.link.uploaded)
                self.uploads.start()

    def on_exchange_error(self, error) -> None:
        """An inbound stream broke: its sender's member died or gave up, so this execution
        cannot go on. A zombie refused by the fence is no reason to fail."""
        if not isinstance(error, ExchangeFencedError):
            self.fail(error)

    # -- failure -----------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = error
        self._failed.set()
        # Wakes every thread blocked in an aligner (a processor in end() on a full channel
        # whose consumer died would otherwise wait forever) or on a peer's window.
        for aligner in self.aligners.values():
            aligner.close()
        for client in self.peers.values():
            client.abort()
        if first and self.link is not None:
            self.link.report_failure(error)

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    @property
    def failure(self) -> BaseException | None:
        """The first error that failed this member (None while it has not failed)."""
        return self._failure

    def count(self, key: str, n: int) -> None:
        with self._lock:
            self.metrics[key] += n

    def count_vertex(self, vertex: str, direction: str, n: int) -> None:
        with self._lock:
            self.metrics["vertices"][vertex][direction] += n

    def add_latencies(self, key: str, latencies, counts=None) -> None:
        """Adds samples (ns; each counted once, or ``counts[i]`` times) to ``latencies_ns``
        or ``emit_latencies_ns``."""
        with self._lock:
            self.metrics[key].record(latencies, counts)

    def watermark_of(self, vertex: str, time: int) -> None:
        with self._lock:
            v = self.metrics["vertices"][vertex]
            if time > v.get("watermark", MIN_TIME):
                v["watermark"] = time
                if time == MAX_TIME:        # the input ended: no wall time
                    v.pop("watermark_ns", None)
                elif self._ns_per_unit is not None:
                    v["watermark_ns"] = time * self._ns_per_unit

    def wall_ns_per_unit(self, column: str, time_type) -> int | None:
        """ns per unit of a time column named ``column`` of type ``time_type``, read as time
        since the epoch: a timestamp's own unit, an integer's as ``with_timestamps(column,
        unit=...)`` declared it; None when it has no wall time (an undeclared integer)."""
        if pa.types.is_timestamp(time_type):
            return _NS_PER_UNIT[time_type.unit]
        if pa.types.is_integer(time_type):
            return self._declared_units.get(column)
        return None

    def event_time_of(self, vertex: str, newest: int | None, time_type) -> None:
        """A source vertex has read events up to event time ``newest`` (in the units of
        its event-time column, of ``time_type``): kept in ns since the epoch when the
        column is a timestamp or an integer of a declared unit (otherwise an integer
        column's unit is the user's: no wall time)."""
        with self._lock:
            if self._ns_per_unit is None:
                ts = self.dag.vertices[vertex].timestamps
                self._ns_per_unit = self.wall_ns_per_unit(
                    ts.column if ts is not None else "", time_type)
            if newest is None or self._ns_per_unit is None:
                return
            v = self.metrics["vertices"][vertex]
            ns = newest * self._ns_per_unit
            if ns > v.get("newest_event_ns", MIN_TIME):
                v["newest_event_ns"] = ns

    def counters(self) -> dict:
        """What the progress events and the heartbeat carry: the counters so far, and the
        latency histograms of this execution (``latency``: each field's encoding, for the
        live metrics: :class:`~sparkjet.runtime.observability.JobMetrics`)."""
        with self._lock:
            return {k: self.metrics[k] for k in
                    ("events_in", "events_out", "late_events", "skipped_events", "dead_letters",
                     "offset_resets")} | \
                {"vertices": {v: dict(c) for v, c in self.metrics["vertices"].items()},
                 "latency": {k: self.metrics[k].encode() for k in LATENCY_FIELDS
                             if self.metrics[k].count}}

    # -- run ---------------------------------------------------------------------------

    def _codec_ready(self) -> None:
        """Waits (up to :data:`_CODEC_WAIT` s) for the snapshot codec's import, started as
        the member was made (:func:`~sparkjet.snapshot.chunks.warm`), before the
        processors start: beside them it held the GIL in the job's first second (at 1M
        events/s, emitted latency 55-90 ms for the first 0.25 s, about 1 % of a 10 s run's
        events). Sources have read nothing yet, so no event waits for it; a member process
        started the import long before and rarely waits here."""
        warming = chunks.warm(self.config.snapshot_codec) if self.snapshots_on else None
        if warming is not None:
            warming.join(_CODEC_WAIT)

    def run(self) -> dict:
        start = time.monotonic()
        threads = self.processors
        coordinator = None
        try:
            next_snapshot = self._restore()
            self._codec_ready()
            for t in threads:
                t.start()
            if self.link is not None:
                self.link.start()
            else:
                ticker = threading.Thread(target=self._tick, name="sparkjet-progress", daemon=True)
                ticker.start()
                self.coordinator = SnapshotCoordinator(
                    config=self.config, store=self.store, execution_id=self.execution_id,
                    processors=self.topology.processors, send=self.command,
                    all_sources_ended=self._all_sources_ended,
                    stopped=lambda: self.failed or self._ended.is_set(), progress=self.progress,
                    events_in=lambda: self.metrics["events_in"])
                coordinator = threading.Thread(target=self._coordinate, args=(next_snapshot,),
                                               name="sparkjet-coordinator", daemon=True)
                coordinator.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.1)
                    if self.failed:
                        break
                if self.failed:
                    break
        except BaseException as e:  # noqa: BLE001 - reported like a processor's failure
            self.fail(e)
        self._ended.set()
        if coordinator is not None:
            coordinator.join(5)
        if self.failed:
            # Threads see the failure within a poll; wait a little so that none outlives
            # the execution (a Spark Python worker is reused by the next task).
            deadline = time.monotonic() + 2.0
            for t in threads:
                if t.ident is not None:
                    t.join(max(0.0, deadline - time.monotonic()))
        if self.uploads is not None:
            # a graceful end waits for its terminal snapshot's upload (bounded): a finished
            # or stopped job's last snapshot has its durable copy
            if not self.failed and not self.uploads.drain(self.config.start_timeout):
                # the driver reports it (durable_failed), not only this member's log
                pending = self.uploads.give_up(
                    self.execution_id, f"the upload did not end within start_timeout="
                                       f"{self.config.start_timeout:g} s of the job's end")
                _log.warning("the upload of snapshot(s) %s into snapshot_store did not end "
                             "within start_timeout=%g s: its durable copy is not complete",
                             pending, self.config.start_timeout)
            self.uploads.close()
        if self.link is not None:
            self.link.stop(latencies_encoded(self.metrics) if not self.failed else None)
        for client in self.peers.values():
            client.close()
        if self.store:
            self.store.close()
        if self._failure is not None:
            failure = self._failure
            raise MemberFailedError(f"execution {self.execution_id} failed: "
                                    f"{type(failure).__name__}: {failure}") from failure
        self.metrics["seconds"] = time.monotonic() - start
        return self.metrics

    def _restore(self) -> int:
        """Loads this member's share of the snapshot to start from (alone: registers the
        execution and takes the last complete snapshot); returns the next snapshot id."""
        if not self.snapshots_on:
            return 0
        if self.slot is not None:
            return self._restore_handed()
        if self.restore_from == "latest":
            self.store.register_execution(self.execution_id)
            newest = unchecked_start(self.config, self.store)
            if newest is not None:
                try:
                    return self._restore_from(
                        StartPoint(self.config.id, self.config.name, newest), self.store)
                except (SnapshotCorruptError, SnapshotIncompleteError, FileNotFoundError) as e:
                    # checked below, which falls back when it may
                    _log.warning("snapshot %d does not restore (%s: %s); checking the "
                                 "snapshots kept", newest, type(e).__name__, e)
                    for p in self.processors:
                        p.forget_restored()
            snapshot_id, fallback = own_start(self.config, self.store, self.dag,
                                              self.execution_id)
            if fallback is not None:
                self.metrics["fallback"] = report_fallback(
                    self.config, fallback, self.progress, self.execution_id)
        else:
            snapshot_id = self.restore_from
        if snapshot_id is not None:
            point = StartPoint(self.config.id, self.config.name, snapshot_id)
        elif isinstance(self.config.initial_snapshot, str):
            point = initial_point(self.config)
        else:
            return 0
        store = open_point(self.config, point, self.store)
        return self._restore_from(point, store)

    def _restore_handed(self) -> int:
        """With the members' storage: restores the snapshot the driver's join answer named,
        from the record it handed (:class:`~sparkjet.snapshot.store.RecordView`), reading
        the chunk files from this member's slot and its peers' and what the store holds
        (durable copies, an export) through the driver: never from the store."""
        if self.start is None:
            return 0
        start = self.start
        point = handed_point(start)
        view = RecordView(point.job_id, base64.b64decode(start["record"]), start["dir"],
                          start["file"], name=point.job_name,
                          backend=None if self.link is None else DriverStoreFiles(
                              self.link.client), durable=bool(start.get("durable")))
        view.slot_files = slot_files(self, self.slot, point.job_id)
        if point.export is None:
            if self.slot is not None and not self.config.state_mapping:
                try:
                    self._resync(view, point)
                except FencedError:
                    raise
                except Exception as e:  # noqa: BLE001 (an optimization: the restore goes on)
                    _log.warning("Merkle resync before the restore of snapshot %d failed "
                                 "(%s: %s): the restore reads from the holders",
                                 point.snapshot_id, type(e).__name__, e)
            check_reachable(view, point.snapshot_id, self)
        return self._restore_from(point, view)

    def _resync(self, view: RecordView, point: StartPoint) -> None:
        """Merkle resync of the keyed partitions this member restores from files its slot
        does not hold, when the slot keeps an older snapshot's copies of them (it missed
        the snapshots since): :func:`~sparkjet.runtime.resync.resync_for_restore`."""
        wanted: dict = {}
        for p in self.processors:
            v = p.vertex
            if v.kind == SOURCE or v.single:
                continue
            parts, _ = wanted.setdefault(v.name, (set(), v.stage.key))
            parts.update(self.topology.partitions_of(v.name, p.index))
        if wanted:
            record = view._resolve(point.snapshot_id, None).record
            reports = resync_for_restore(self, self.slot, point.job_id, record, wanted,
                                         depth=self.config.merkle_tree_depth,
                                         partition_count=self.config.partition_count,
                                         progress=lambda e: self.progress(
                                             {**e, "execution": self.execution_id}))
            if reports:     # goes with "restored" (on Spark, through the coordinator)
                self._resynced = {
                    "files": len(reports), "bytes": sum(r.synced_bytes for r in reports),
                    "full_copy_bytes": sum(r.full_copy_bytes for r in reports),
                    "rows_fetched": sum(r.rows_fetched for r in reports),
                    "fallback_partitions": sum(len(r.fallback) for r in reports)}

    def _restore_from(self, point: StartPoint, store) -> int:
        """Restores ``point`` from ``store``; returns the next snapshot id."""
        snapshot_id = point.snapshot_id
        plan = plan_restore(self.dag, read_fingerprint(store, point), point,
                            self.config.state_mapping)
        if point.initial:
            self.metrics["initial_snapshot"] = str(point)
        else:
            self.metrics["restored_from"] = snapshot_id
        read_start = time.monotonic()
        restore_processors(self, store, point, plan)
        if store is not self.store:
            store.close()
        # "restored" waits for every keyed processor's operator to rebuild its state from
        # what was read (on the processor's own thread: operator_restored)
        with self._lock:
            self._restoring = {"snapshot": point.snapshot_id, "export": point.export,
                               "job": point.job_name, "read_s": time.monotonic() - read_start,
                               "rebuild_s": 0.0, "keys": 0, "started": read_start}
            if self._resynced is not None:
                self._restoring["merkle_resync"] = self._resynced
            self._rebuilding = {p.label for p in self.processors if p.vertex.kind != SOURCE}
        if not self._rebuilding:
            self._report_restored()
        return 0 if point.initial else point.snapshot_id + 1

    def operator_restored(self, label: str, seconds: float, keys: int) -> None:
        """Keyed processor ``label`` rebuilt its operator from the restored state (``keys``
        rows in ``seconds``); after the last one, the member reports "restored"."""
        with self._lock:
            if self._restoring is None or label not in self._rebuilding:
                return
            self._rebuilding.discard(label)
            self._restoring["rebuild_s"] = max(self._restoring["rebuild_s"], seconds)
            self._restoring["keys"] += keys
            last = not self._rebuilding
        if last:
            self._report_restored()

    def _report_restored(self) -> None:
        """The "restored" event, once the state is read and every operator rebuilt: with
        the phases' seconds (``read_s``: the snapshot read; ``rebuild_s``: the slowest
        operator rebuild, the processors rebuilding side by side) and the ``keys`` (rows)
        restored. Alone it goes to the progress events; on Spark to the coordinator, which
        reports it once every member has."""
        info = dict(self._restoring)
        info["seconds"] = time.monotonic() - info.pop("started")
        self.metrics["restore"] = {k: info[k] for k in ("read_s", "rebuild_s", "keys",
                                                        "seconds")}
        if self.link is not None:
            self.link.restored(info)
        else:
            self.progress({"event": "restored", **info, "execution": self.execution_id,
                           "member": self.index})

    # -- the coordinator (alone) or its link ---------------------------------------------

    def source_ended(self, label: str) -> None:
        with self._lock:
            self._sources_ended.add(label)

    def _all_sources_ended(self) -> bool:
        if self.stop_requested.is_set() or (self.stop_file and os.path.exists(self.stop_file)):
            return True
        with self._lock:
            return len(self._sources_ended) == self.n_sources

    def ack(self, processor: str, snapshot_id: int, manifest,
            alignment_s: float | None = None, schemas: dict | None = None) -> None:
        uploading = None
        if self.uploads is not None:        # uploaded once the snapshot is committed
            with self._lock:
                self._written.setdefault(snapshot_id, []).extend(
                    f for f in manifest.files if f.get("slot") and not f.get("durable"))
                uploading = self.may_upload(snapshot_id)
        if self.link is not None:
            self.link.ack(processor, snapshot_id, manifest, alignment_s, schemas, uploading)
        else:
            self.coordinator.ack(processor, snapshot_id, manifest, alignment_s, schemas,
                                 uploading)

    def may_upload(self, snapshot_id: int) -> list[int]:
        """durable_tier="async": the older snapshots this member may upload until it runs
        the commit after ``snapshot_id`` (called with its acknowledgement, under the lock):
        the one uploading and the one waiting, and the ones acknowledged whose commit it has
        not run yet (a newer one's submit supersedes them, but one may begin first). The
        driver's commit of ``snapshot_id`` keeps them (``pinned``), in the store and in the
        slots, so that an upload slower than retention still ends and gets its mark."""
        return sorted(set(self.uploads.pending)
                      | {s for s in self._written if s < snapshot_id})

    def command(self, cmd: list) -> None:
        """Runs a coordinator's command: ["barrier", id, terminal], ["commit", id], ["end"],
        ["durable"]."""
        if cmd[0] == "barrier":
            for p in self.processors:
                if p.vertex.kind == SOURCE:
                    p.control.put(("barrier", cmd[1], bool(cmd[2])))
        elif cmd[0] == "commit":
            if self.slot is not None and len(cmd) > 3:
                # phase 2 in the slot: the committed record's copy (cmd[3]), and what the
                # store no longer keeps dropped (cmd[2]: the retained snapshot ids). Kept
                # before any sink commits: a driver that lost its metadata rebuilds it from
                # the newest copy a slot holds (sparkjet.runtime.persistence), which must
                # be no older than any output committed
                # (and, durable_tier="async", what this member may still upload)
                keep_committed(self.slot, self.config.id, cmd[1], int(cmd[3]["execution"]),
                               base64.b64decode(cmd[3]["record"]), cmd[2],
                               () if self.uploads is None else self.uploads.pending,
                               cmd[3].get("tables"))
                if self.uploads is not None:
                    # durable_tier="async": its upload begins after the commit, off the
                    # snapshot's path (a newer one supersedes it while it waits)
                    # (submitted under the lock: an ack's may_upload in between would
                    # find the snapshot neither written nor pending, and not pin it)
                    with self._lock:
                        files = self._written.pop(cmd[1], [])
                        for sid in [s for s in self._written if s < cmd[1]]:
                            del self._written[sid]
                        self.uploads.submit(cmd[1], self.execution_id, files)
            for p in self.processors:
                p.control.put(("commit", cmd[1]))
        elif cmd[0] == "end":
            for p in self.processors:
                if p.vertex.kind == SOURCE:
                    p.control.put(("end",))
        elif cmd[0] == "durable":
            # a stop that exports its terminal snapshot: from now on every writer copies
            # its files into the store too (the durable tier for the snapshots left)
            self.durable_copies = True
        else:
            raise MemberFailedError(f"unknown command from the coordinator: {cmd!r}")

    def _tick(self) -> None:
        """Alone (no driver polling it): the counters as a progress event, twice a second."""
        while not self._ended.wait(0.5):
            self.progress({"event": "progress", "execution": self.execution_id,
                           "member": self.index, **self.counters()})

    def _coordinate(self, snapshot_id: int) -> None:
        try:
            self.coordinator.run(snapshot_id)
        except BaseException as e:  # noqa: BLE001 - any failure ends the execution
            self.fail(e)
        with self._lock:
            self.metrics["snapshots"] = list(self.coordinator.records)

    def context(self, vertex: str, index: int, total: int) -> ProcessorContext:
        return ProcessorContext(self.config.id, self.execution_id, vertex, index, total,
                                self.guarantee, self.config.name, self.config.max_batch_delay)


class RemoteLink:
    """A member's connection to the coordinator on the driver.

    One thread polls the coordinator's ``poll`` action: the call is the member's heartbeat
    (it carries the counters and the ended source processors) and its answer carries the
    coordinator's commands, waiting up to a quarter of a second for one. Phase-1
    acknowledgements go from a thread of each processor's snapshot, once its files are
    durable (``ack``, :func:`~sparkjet.runtime.snapshotting.acknowledge`). A poll that fails
    (the coordinator ended this execution, or is gone) fails the member.
    """

    def __init__(self, member: Member, client):
        self.member = member
        self.client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkjet-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _body(self) -> dict:
        m = self.member
        with m._lock:
            ended = sorted(m._sources_ended)
        return {"member": m.index, "pid": os.getpid(), **m.counters(), "ended": ended}

    def _call(self, action: str, body: dict, timeout: float | None = None) -> dict:
        return self.client.action(action, body, execution_id=self.member.execution_id,
                                  timeout=timeout)

    def _run(self) -> None:
        m = self.member
        try:
            while not self._stop.is_set() and not m.failed:
                answer = self._call("poll", self._body(), timeout=15.0)
                for cmd in answer.get("commands", []):
                    m.command(cmd)
        except BaseException as e:  # noqa: BLE001 - without its coordinator a member cannot go on
            if not self._stop.is_set():
                m.fail(e)

    def ack(self, processor: str, snapshot_id: int, manifest, alignment_s: float | None,
            schemas: dict | None = None, uploading: list[int] | None = None) -> None:
        self._call("ack", {"member": self.member.index, "processor": processor,
                           "snapshot": snapshot_id, "manifest": manifest.to_json(),
                           "alignment_s": alignment_s, "schemas": schemas or {},
                           **({"uploading": uploading} if uploading else {})})

    def uploaded(self, info: dict) -> None:
        """Tells the coordinator how this member's upload of a committed snapshot ended
        (durable_tier="async": :class:`~sparkjet.runtime.durable.DurableUploader`)."""
        self._call("uploaded", {"member": self.member.index, **info})

    def restored(self, info: dict) -> None:
        """Tells the coordinator this member's state is restored (``info``: the phases'
        seconds and the keys, :meth:`Member._report_restored`)."""
        self._call("restored", {"member": self.member.index, **info})

    def report_failure(self, error: BaseException) -> None:
        """Tells the coordinator at once (it would also notice the task fail, later), with
        the traceback and whether a replay would repeat the error."""
        try:
            self._call("failed", {"member": self.member.index, **failures.report(error),
                                  "link": _is_link_failure(error)}, timeout=2.0)
        except Exception:  # noqa: BLE001 - best effort: the coordinator may be gone already
            pass

    def stop(self, metrics: dict | None) -> None:
        self._stop.set()
        if metrics is not None:
            try:
                self._call("done", {**self._body(), "metrics": metrics}, timeout=10.0)
            except Exception:  # noqa: BLE001 - the task's result row carries them too
                pass
        self._thread.join(2.0)
        self.client.close()


def _is_link_failure(error: BaseException | None) -> bool:
    """Whether a member failed because a link to a peer broke (an exchange error, or one
    caused by it): then the peer, not this member, is the likelier culprit."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, ExchangeError):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
