"""A member: runs a pipeline's processors and the snapshot coordinator (Chandy-Lamport).

Threads: one per source processor (it reads, applies the fused stateless stages and routes
rows by the Hazelcast partition of the key to the keyed processor owning it), one per keyed
processor (it takes events from its BarrierAligner, updates its keyed state and writes to its
sink), and the coordinator. Snapshot n:

1. the coordinator asks every source processor for barrier n; each saves its source state,
   (if the sink runs in it) prepares its sink transaction, then puts barrier n into every
   channel it feeds;
2. each keyed processor's aligner emits "snapshot n" once aligned (exactly-once: held
   channels; at-least-once: the last barrier); the processor saves its keyed state (by
   partition) and prepares its sink transaction;
3. every processor hands its manifest to the coordinator (phase-1 acknowledgement); the
   coordinator commits the snapshot in the store (the commit point), then tells every
   processor to run phase 2 (sinks commit, acknowledging sources ack) on its own thread.

A member that starts from a snapshot restores the source state of every source partition,
the keyed state of the partitions it owns, and recovers the sink transactions prepared in
that snapshot. Every execution has an id, the fencing token of store and sinks.
"""
from __future__ import annotations

import json
import queue
import threading
import time

import numpy as np
import pyarrow as pa

from sparkjet.aligner import DONE, ITEM, SNAPSHOT, BarrierAligner
from sparkjet.connectors import ProcessorContext
from sparkjet.errors import SparkjetError
from sparkjet.keyed_state import KeyedAggregator
from sparkjet.partitioning import partition_ids
from sparkjet.pipeline import Plan
from sparkjet.runtime.config import JobConfig
from sparkjet.snapshot_store import SnapshotStore

_POLL = 0.005


class MemberFailedError(SparkjetError, RuntimeError):
    """A processor of the member failed; the execution ends (the supervisor may restart)."""


def merge_states(states: list) -> dict | None:
    """Deep merge of JSON-able per-processor states (dicts are united, lists concatenated):
    how state saved by N processors is handed to M readers after a rescale."""
    out: dict = {}
    found = False
    for state in states:
        if state is None:
            continue
        found = True
        _merge_into(out, state)
    return out if found else None


def _merge_into(out: dict, state: dict) -> None:
    for k, v in state.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            _merge_into(out[k], v)
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = out[k] + v
        else:
            out[k] = v


class Member:
    """Runs one execution of a plan in this process; :meth:`run` returns its metrics."""

    def __init__(self, plan: Plan, config: JobConfig, execution_id: int, *, progress=None):
        self.plan = plan
        self.config = config
        self.execution_id = execution_id
        self.progress = progress or (lambda event: None)
        self.guarantee = config.processing_guarantee
        self.snapshots_on = self.guarantee != "none"
        self.store = SnapshotStore(config.snapshot_store, config.id) if self.snapshots_on else None
        self._failure: BaseException | None = None
        self._failed = threading.Event()
        self._acks: queue.Queue = queue.Queue()
        self.metrics = {"execution_id": execution_id, "events_in": 0, "events_out": 0,
                        "snapshots": [], "restored_from": None, "latencies_ns": []}
        self._lock = threading.Lock()

        source_parts = plan.source.partition_count()
        self.n_sources = min(config.local_parallelism, source_parts)
        self.n_keyed = config.local_parallelism if plan.aggregate else 0
        # Hazelcast partition -> keyed processor that owns it.
        self.owner = np.arange(config.partition_count, dtype=np.int64) % max(self.n_keyed, 1)
        mode = "at-least-once" if self.guarantee == "at-least-once" else "exactly-once"
        self.aligners = [BarrierAligner(self.n_sources, mode=mode, capacity=config.queue_capacity)
                         for _ in range(self.n_keyed)]
        self.sources = [_SourceProcessor(self, i, [p for p in range(source_parts) if p % self.n_sources == i])
                        for i in range(self.n_sources)]
        self.keyed = [_KeyedProcessor(self, j) for j in range(self.n_keyed)]
        self._sources_ended: set[int] = set()
        self._ended = threading.Event()

    # -- failure -----------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
        self._failed.set()
        # Wakes every thread blocked in an aligner (a source in end() on a full channel
        # whose consumer died would otherwise wait forever).
        for aligner in self.aligners:
            aligner.close()

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def count(self, key: str, n: int) -> None:
        with self._lock:
            self.metrics[key] += n

    # -- run ---------------------------------------------------------------------------

    def run(self) -> dict:
        start = time.monotonic()
        next_snapshot = self._restore()
        threads = [*self.sources, *self.keyed]
        for t in threads:
            t.start()
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
        self._ended.set()
        coordinator.join(5)
        if self.store:
            self.store.close()
        if self._failure is not None:
            raise MemberFailedError(f"execution {self.execution_id} failed: "
                                    f"{type(self._failure).__name__}: {self._failure}") from self._failure
        self.metrics["seconds"] = time.monotonic() - start
        return self.metrics

    def _restore(self) -> int:
        """Registers this execution and loads the last complete snapshot; returns the id of
        the next snapshot."""
        if not self.snapshots_on:
            return 0
        self.store.register_execution(self.execution_id)
        latest = self.store.latest_complete()
        if latest is None:
            return 0
        self.metrics["restored_from"] = latest.snapshot_id
        source_states = _entries_json(self.store.restore("source", []).broadcast_entries)
        merged = merge_states(list(source_states.values()))
        for p in self.sources:
            p.restored_source_state = merged
        sinks = _entries_json(self.store.restore("sink", []).broadcast_entries)
        sink_owners = self.keyed if self.plan.aggregate else self.sources
        for j, p in enumerate(sink_owners):
            p.prepared = merge_states([s for i, s in sinks.items() if int(i) % len(sink_owners) == j])
        if self.plan.aggregate:
            for j, p in enumerate(self.keyed):
                mine = np.flatnonzero(self.owner == j).tolist()
                p.restored_table = self.store.restore("aggregate", mine).table
        self.progress({"event": "restored", "snapshot": latest.snapshot_id,
                       "execution": self.execution_id})
        return latest.snapshot_id + 1

    # -- the coordinator ---------------------------------------------------------------

    def source_ended(self, index: int) -> None:
        with self._lock:
            self._sources_ended.add(index)

    def _all_sources_ended(self) -> bool:
        with self._lock:
            return len(self._sources_ended) == self.n_sources

    def ack(self, processor: str, snapshot_id: int, manifest) -> None:
        self._acks.put((processor, snapshot_id, manifest))

    def _coordinate(self, snapshot_id: int) -> None:
        try:
            self._coordinate_loop(snapshot_id)
        except BaseException as e:  # noqa: BLE001 - any failure ends the execution
            self.fail(e)

    def _coordinate_loop(self, snapshot_id: int) -> None:
        processors = len(self.sources) + len(self.keyed)
        next_at = time.monotonic() + self.config.snapshot_interval
        while not self.failed and not self._ended.is_set():
            terminal = self._all_sources_ended()
            if not self.snapshots_on:
                if terminal:
                    for p in self.sources:
                        p.control.put(("end",))
                    return
                time.sleep(_POLL)
                continue
            if not terminal and time.monotonic() < next_at:
                time.sleep(min(_POLL * 4, max(0.0, next_at - time.monotonic())))
                continue
            started = time.monotonic()
            for p in self.sources:
                p.control.put(("barrier", snapshot_id, terminal))
            manifests = []
            deadline = started + max(60.0, 20 * self.config.snapshot_interval)
            while len(manifests) < processors:
                if self.failed:
                    return
                try:
                    name, sid, manifest = self._acks.get(timeout=0.05)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise MemberFailedError(f"snapshot {snapshot_id}: phase 1 timed out "
                                                f"({len(manifests)} of {processors} processors)")
                    continue
                if sid != snapshot_id:
                    raise MemberFailedError(f"{name} acknowledged snapshot {sid}, expected {snapshot_id}")
                manifests.append(manifest)
            info = self.store.commit(snapshot_id, self.execution_id, manifests)
            committed = time.monotonic()
            for p in [*self.sources, *self.keyed]:
                p.control.put(("commit", snapshot_id))
            record = {"snapshot": snapshot_id, "duration_s": committed - started, "bytes": info.bytes,
                      "terminal": terminal,
                      "alignment_s": {f"aggregate-{p.index}": p.last_alignment for p in self.keyed}}
            with self._lock:
                self.metrics["snapshots"].append(record)
            self.progress({"event": "snapshot", **record, "execution": self.execution_id,
                           "events_in": self.metrics["events_in"]})
            snapshot_id += 1
            next_at = started + self.config.snapshot_interval
            if terminal:
                return

    def context(self, vertex: str, index: int, total: int) -> ProcessorContext:
        return ProcessorContext(self.config.id, self.execution_id, vertex, index, total, self.guarantee)


class _Processor(threading.Thread):
    def __init__(self, member: Member, index: int, name: str):
        super().__init__(name=f"sparkjet-{name}-{index}", daemon=True)
        self.member = member
        self.index = index
        self.control: queue.Queue = queue.Queue()
        self.prepared = None
        self.sink = None
        self._ts_samples: list = []
        self._pending_latency: dict[int, list] = {}

    def run(self) -> None:
        try:
            self.work()
        except BaseException as e:  # noqa: BLE001 - reported to the member, which ends the execution
            self.member.fail(e)

    def open_sink(self, total: int) -> None:
        m = self.member
        self.sink = m.plan.sink.open(m.context(m.plan.sink.name, self.index, total))
        self.sink.recover(m.metrics["restored_from"], self.prepared)

    def write(self, batch: pa.RecordBatch, ts=None) -> None:
        for stage in self.member.plan.after if self.member.plan.aggregate else ():
            batch = stage.apply(batch)
            if batch is None:
                return
        if batch.num_rows:
            self.sink.write(batch)
            self.member.count("events_out", batch.num_rows)

    def sample_ts(self, batch: pa.RecordBatch) -> None:
        if "ts" in batch.schema.names and batch.num_rows:
            ts = batch.column("ts")
            step = max(1, batch.num_rows // 16)
            self._ts_samples.extend(ts.cast(pa.int64()).to_numpy()[::step].tolist())

    def prepare_sink(self, writer, snapshot_id: int) -> None:
        prepared = self.sink.prepare(snapshot_id)
        writer.write_broadcast_entries("sink", [str(self.index).encode()],
                                       [json.dumps(prepared).encode()])
        self._pending_latency[snapshot_id] = self._ts_samples
        self._ts_samples = []

    def commit_sink(self, snapshot_id: int) -> None:
        self.sink.commit(snapshot_id)
        now = time.time_ns()
        for sid in [s for s in self._pending_latency if s <= snapshot_id]:
            samples = self._pending_latency.pop(sid)
            with self.member._lock:
                self.member.metrics["latencies_ns"].extend(now - t for t in samples)

    def new_writer(self, snapshot_id: int, writer: int):
        m = self.member
        return m.store.writer(snapshot_id, m.execution_id, writer=writer,
                              partition_count=m.config.partition_count, codec=m.config.snapshot_codec)


class _SourceProcessor(_Processor):
    def __init__(self, member: Member, index: int, partitions: list[int]):
        super().__init__(member, index, "source")
        self.partitions = partitions
        self.restored_source_state = None

    def work(self) -> None:
        m = self.member
        plan = m.plan
        reader = plan.source.open(self.partitions, m.context(plan.source.name, self.index, m.n_sources))
        reader.restore_state(self.restored_source_state)
        fused_sink = plan.aggregate is None
        if fused_sink:
            self.open_sink(m.n_sources)
        key = plan.aggregate.key if plan.aggregate else None
        ended = finished = False
        try:
            while not m.failed and not finished:
                finished = self._control(reader, fused_sink)
                if finished or m.failed:
                    break
                if ended:
                    time.sleep(_POLL)
                    continue
                if reader.at_end():
                    ended = True
                    m.source_ended(self.index)
                    continue
                batch = reader.read(m.config.batch_size)
                if batch is None:
                    time.sleep(_POLL)
                    continue
                m.count("events_in", batch.num_rows)
                if fused_sink:  # else the keyed processors sample what reaches the sink
                    self.sample_ts(batch)
                for stage in plan.before:
                    batch = stage.apply(batch)
                    if batch is None:
                        break
                if batch is None or batch.num_rows == 0:
                    continue
                if fused_sink:
                    self.write(batch)
                else:
                    self._route(batch, key)
        finally:
            reader.close()
            if fused_sink and self.sink is not None and not m.failed:
                self.sink.close()

    def _route(self, batch: pa.RecordBatch, key: str) -> None:
        m = self.member
        if m.n_keyed == 1:
            self._put(0, batch)
            return
        dest = m.owner[partition_ids(batch, m.config.partition_count, key=key).to_numpy()]
        for j in range(m.n_keyed):
            mask = dest == j
            if mask.any():
                self._put(j, batch.filter(pa.array(mask)))

    def _put(self, j: int, item, barrier=None) -> None:
        aligner = self.member.aligners[j]
        while not self.member.failed:
            try:
                if barrier is None:
                    aligner.put(self.index, item, timeout=0.1)
                else:
                    aligner.put_barrier(self.index, barrier[0], terminal=barrier[1], timeout=0.1)
                return
            except TimeoutError:
                continue

    def _control(self, reader, fused_sink: bool) -> bool:
        """Handles the coordinator's requests; True when this processor is done."""
        m = self.member
        while True:
            try:
                msg = self.control.get_nowait()
            except queue.Empty:
                return False
            if msg[0] == "barrier":
                _, sid, terminal = msg
                writer = self.new_writer(sid, self.index)
                state = reader.snapshot_state()
                writer.write_broadcast_entries("source", [str(self.index).encode()],
                                               [json.dumps(state).encode()])
                if fused_sink:
                    self.prepare_sink(writer, sid)
                for j in range(m.n_keyed):
                    self._put(j, None, barrier=(sid, terminal))
                if terminal:
                    for j in range(m.n_keyed):
                        m.aligners[j].end(self.index)
                m.ack(self.name, sid, writer.finish())
                self._terminal = sid if terminal else None
            elif msg[0] == "commit":
                sid = msg[1]
                if fused_sink:
                    self.commit_sink(sid)
                reader.ack(sid)
                if getattr(self, "_terminal", None) == sid:
                    return True
            elif msg[0] == "end":
                for j in range(m.n_keyed):
                    m.aligners[j].end(self.index)
                return True


class _KeyedProcessor(_Processor):
    def __init__(self, member: Member, index: int):
        super().__init__(member, index, "aggregate")
        self.restored_table = None
        self.last_alignment = 0.0

    def work(self) -> None:
        m = self.member
        agg_stage = m.plan.aggregate
        agg = KeyedAggregator(agg_stage.key, agg_stage.aggregations)
        agg.restore(self.restored_table)
        self.restored_table = None
        self.open_sink(m.n_keyed)
        aligner = m.aligners[self.index]
        terminal_sid = None
        done = False
        try:
            while not m.failed:
                if self._control(terminal_sid):
                    return
                if done:
                    if not m.snapshots_on:
                        return
                    time.sleep(_POLL)
                    continue
                event = aligner.take(timeout=0.02)
                if event is None:
                    continue
                kind = event[0]
                if kind == ITEM:
                    batch = event[2]
                    self.sample_ts(batch)
                    self.write(agg.update(batch))
                elif kind == SNAPSHOT:
                    sid, terminal = event[1], event[2]
                    writer = self.new_writer(sid, m.n_sources + self.index)
                    writer.write_table("aggregate", agg.snapshot(), key=agg_stage.key)
                    self.prepare_sink(writer, sid)
                    records = aligner.alignments  # a copy of the history: read it once
                    if records:
                        self.last_alignment = records[-1]["duration_s"]
                    m.ack(self.name, sid, writer.finish())
                    if terminal:
                        terminal_sid = sid
                elif kind == DONE:
                    done = True
        finally:
            if self.sink is not None and not m.failed:
                self.sink.close()

    def _control(self, terminal_sid) -> bool:
        while True:
            try:
                msg = self.control.get_nowait()
            except queue.Empty:
                return False
            if msg[0] == "commit":
                self.commit_sink(msg[1])
                if msg[1] == terminal_sid:
                    return True


def _entries_json(entries) -> dict:
    """Broadcast entries (processor index -> JSON) as a dict."""
    if entries is None:
        return {}
    keys, values = entries
    return {k.decode(): json.loads(v) for k, v in zip(keys.to_pylist(), values.to_pylist())}
