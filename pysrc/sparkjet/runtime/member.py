"""A member: runs a pipeline's processors (alone: also the snapshot coordinator of
:mod:`sparkjet.runtime.coordinator`, which on Spark runs on the driver).

Threads: one per source processor (it reads, applies the fused stateless stages and routes
rows by the Hazelcast partition of the key to the keyed processor owning it), one per keyed
processor (it takes events from its BarrierAligner, updates its keyed state and writes to its
sink), and the coordinator (alone) or the link to it (on Spark). Keyed processors of other
members are fed over :mod:`sparkjet.runtime.exchange`. Snapshot n (Chandy-Lamport):

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
import os
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
from sparkjet.runtime.coordinator import SnapshotCoordinator
from sparkjet.runtime.topology import Topology
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
    """Runs one execution of a plan, or one member's share of it; :meth:`run` returns its
    metrics.

    Alone (the default), the member runs every processor and the snapshot coordinator in
    this process. As member ``index`` of an execution on Spark
    (:mod:`sparkjet.runtime.spark_runner`), it runs its share of the
    :class:`~sparkjet.runtime.topology.Topology`, exchanges batches and barriers with its
    peers over :mod:`sparkjet.runtime.exchange`, and a :class:`RemoteLink` connects it
    to the coordinator on the driver, which starts and commits snapshots.
    """

    def __init__(self, plan: Plan, config: JobConfig, execution_id: int, *, progress=None,
                 topology: Topology | None = None, index: int = 0,
                 restore_from: int | None | str = "latest"):
        self.plan = plan
        self.config = config
        self.execution_id = execution_id
        self.progress = progress or (lambda event: None)
        self.guarantee = config.processing_guarantee
        self.snapshots_on = self.guarantee != "none"
        self.store = SnapshotStore(config.snapshot_store, config.id) if self.snapshots_on else None
        self.topology = topology or Topology(1, config.local_parallelism,
                                             plan.source.partition_count(),
                                             config.partition_count, plan.aggregate is not None)
        self.index = index
        self.restore_from = restore_from
        self.link: RemoteLink | None = None
        self.peers: dict = {}       # member index -> ExchangeClient (distributed only)
        self._failure: BaseException | None = None
        self._failed = threading.Event()
        self.metrics = {"execution_id": execution_id, "member": index, "events_in": 0,
                        "events_out": 0, "snapshots": [], "restored_from": None, "latencies_ns": [],
                        "emit_latencies_ns": []}
        self._lock = threading.Lock()

        t = self.topology
        self.n_sources = t.n_sources
        self.n_keyed = t.n_keyed
        self.owner = t.owner
        mode = "at-least-once" if self.guarantee == "at-least-once" else "exactly-once"
        self.sources = [_SourceProcessor(self, g, t.source_partitions_of(g))
                        for g in t.sources_of(index)]
        self.keyed = [_KeyedProcessor(self, k) for k in t.keyed_of(index)]
        #: global keyed index -> the aligner of a keyed processor of this member
        self.aligners = {p.index: BarrierAligner(t.n_sources, mode=mode,
                                                 capacity=config.queue_capacity)
                         for p in self.keyed}
        self._sources_ended: set[int] = set()
        self._ended = threading.Event()

    # -- the distributed side ----------------------------------------------------------

    def inbound(self, vertex: str, processor: int):
        """The aligner that streams from peers to ``vertex[processor]`` feed (for the
        member's :class:`~sparkjet.runtime.exchange.ExchangeServer`)."""
        return self.aligners.get(processor) if vertex == "aggregate" else None

    def connect(self, peers: list[str], coordinator: str, security) -> None:
        """Sets the exchange locations of every member (by index) and of the coordinator,
        reached with the execution's credentials
        (:class:`~sparkjet.runtime.security.LinkSecurity`)."""
        # Lazy: the exchange loads pyarrow.flight, which a member alone never needs.
        from sparkjet.runtime.exchange import ExchangeClient

        self.peers = {i: ExchangeClient(loc, security=security)
                      for i, loc in enumerate(peers) if i != self.index}
        self.link = RemoteLink(self, ExchangeClient(coordinator, security=security,
                                                    action_timeout=30.0))

    def on_exchange_error(self, error) -> None:
        """An inbound stream broke: its sender's member died or gave up, so this execution
        cannot go on. A zombie refused by the fence is no reason to fail."""
        from sparkjet.runtime.exchange import ExchangeFencedError  # lazy: see connect()

        if not isinstance(error, ExchangeFencedError):
            self.fail(error)

    # -- failure -----------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = error
        self._failed.set()
        # Wakes every thread blocked in an aligner (a source in end() on a full channel
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

    def count(self, key: str, n: int) -> None:
        with self._lock:
            self.metrics[key] += n

    # -- run ---------------------------------------------------------------------------

    def run(self) -> dict:
        start = time.monotonic()
        threads = [*self.sources, *self.keyed]
        coordinator = None
        try:
            next_snapshot = self._restore()
            for t in threads:
                t.start()
            if self.link is not None:
                self.link.start()
            else:
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
        if self.link is not None:
            self.link.stop(self.metrics if not self.failed else None)
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
        if self.restore_from == "latest":
            self.store.register_execution(self.execution_id)
            latest = self.store.latest_complete()
            snapshot_id = None if latest is None else latest.snapshot_id
        else:
            snapshot_id = self.restore_from
        if snapshot_id is None:
            return 0
        self.metrics["restored_from"] = snapshot_id
        store, t = self.store, self.topology
        if self.sources:
            source_states = _entries_json(store.restore("source", [], snapshot_id=snapshot_id)
                                          .broadcast_entries)
            merged = merge_states(list(source_states.values()))
            for p in self.sources:
                p.restored_source_state = merged
        sinks = _entries_json(store.restore("sink", [], snapshot_id=snapshot_id).broadcast_entries)
        sink_owners, total = ((self.keyed, t.n_keyed) if self.plan.aggregate
                              else (self.sources, t.n_sources))
        # An old processor's prepared transactions go to processor (old index % total),
        # the same rule by which sinks find the leftovers they own after a rescale.
        for p in sink_owners:
            p.prepared = merge_states([s for i, s in sinks.items() if int(i) % total == p.index])
        for p in self.keyed:
            mine = np.flatnonzero(self.owner == p.index).tolist()
            p.restored_table = store.restore("aggregate", mine, snapshot_id=snapshot_id).table
        self.progress({"event": "restored", "snapshot": snapshot_id,
                       "execution": self.execution_id, "member": self.index})
        return snapshot_id + 1

    # -- the coordinator (alone) or its link ---------------------------------------------

    def source_ended(self, index: int) -> None:
        with self._lock:
            self._sources_ended.add(index)

    def _all_sources_ended(self) -> bool:
        with self._lock:
            return len(self._sources_ended) == self.n_sources

    def ack(self, processor: str, snapshot_id: int, manifest,
            alignment_s: float | None = None) -> None:
        if self.link is not None:
            self.link.ack(processor, snapshot_id, manifest, alignment_s)
        else:
            self.coordinator.ack(processor, snapshot_id, manifest, alignment_s)

    def command(self, cmd: list) -> None:
        """Runs a coordinator's command: ["barrier", id, terminal], ["commit", id], ["end"]."""
        if cmd[0] == "barrier":
            for p in self.sources:
                p.control.put(("barrier", cmd[1], bool(cmd[2])))
        elif cmd[0] == "commit":
            for p in [*self.sources, *self.keyed]:
                p.control.put(("commit", cmd[1]))
        elif cmd[0] == "end":
            for p in self.sources:
                p.control.put(("end",))
        else:
            raise MemberFailedError(f"unknown command from the coordinator: {cmd!r}")

    def _coordinate(self, snapshot_id: int) -> None:
        try:
            self.coordinator.run(snapshot_id)
        except BaseException as e:  # noqa: BLE001 - any failure ends the execution
            self.fail(e)
        with self._lock:
            self.metrics["snapshots"] = list(self.coordinator.records)

    def context(self, vertex: str, index: int, total: int) -> ProcessorContext:
        return ProcessorContext(self.config.id, self.execution_id, vertex, index, total,
                                self.guarantee)




class RemoteLink:
    """A member's connection to the coordinator on the driver.

    One thread polls the coordinator's ``poll`` action: the call is the member's heartbeat
    (it carries the counters and the ended source processors) and its answer carries the
    coordinator's commands, waiting up to a quarter of a second for one. Phase-1
    acknowledgements go from the processors' own threads (``ack``). A poll that fails
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
            return {"member": m.index, "pid": os.getpid(), "events_in": m.metrics["events_in"],
                    "events_out": m.metrics["events_out"], "ended": sorted(m._sources_ended)}

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

    def ack(self, processor: str, snapshot_id: int, manifest, alignment_s: float | None) -> None:
        self._call("ack", {"member": self.member.index, "processor": processor,
                           "snapshot": snapshot_id, "manifest": manifest.to_json(),
                           "alignment_s": alignment_s})

    def report_failure(self, error: BaseException) -> None:
        """Tells the coordinator at once (it would also notice the task fail, later)."""
        try:
            self._call("failed", {"member": self.member.index,
                                  "error": f"{type(error).__name__}: {error}"}, timeout=2.0)
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


class _Processor(threading.Thread):
    def __init__(self, member: Member, index: int, name: str):
        super().__init__(name=f"sparkjet-{name}-{index}", daemon=True)
        self.label = f"{name}-{index}"
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

    def sample_ts(self, batch: pa.RecordBatch) -> list:
        """Samples the event times (``ts``, ns) of a batch that reaches the sink: their
        latency is measured when the batch's output is committed (``latencies_ns``) and,
        by :meth:`emitted`, when it is handed to the sink (``emit_latencies_ns``)."""
        if "ts" in batch.schema.names and batch.num_rows:
            ts = batch.column("ts")
            step = max(1, batch.num_rows // 16)
            samples = ts.cast(pa.int64()).to_numpy()[::step].tolist()
            self._ts_samples.extend(samples)
            return samples
        return []

    def emitted(self, samples: list) -> None:
        if samples:
            now = time.time_ns()
            with self.member._lock:
                self.member.metrics["emit_latencies_ns"].extend(now - t for t in samples)

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
                              partition_count=m.config.partition_count,
                              codec=m.config.snapshot_codec)


class _SourceProcessor(_Processor):
    def __init__(self, member: Member, index: int, partitions: list[int]):
        super().__init__(member, index, "source")
        self.partitions = partitions
        self.restored_source_state = None
        self._channels: dict = {}   # keyed processor on a peer -> OutboundChannel

    def work(self) -> None:
        m = self.member
        plan = m.plan
        reader = plan.source.open(self.partitions,
                                  m.context(plan.source.name, self.index, m.n_sources))
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
                samples = self.sample_ts(batch) if fused_sink else []  # else the keyed ones do
                for stage in plan.before:
                    batch = stage.apply(batch)
                    if batch is None:
                        break
                if batch is None or batch.num_rows == 0:
                    continue
                if fused_sink:
                    self.write(batch)
                    self.emitted(samples)
                else:
                    self._route(batch, key)
        finally:
            for ch in self._channels.values():
                if m.failed:
                    ch.abort()
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

    def _put(self, k: int, item, barrier=None) -> None:
        """Puts a batch (or barrier ``(id, terminal)``) into keyed processor ``k``'s channel
        from this source: its aligner if ``k`` runs in this member, else the exchange."""
        m = self.member
        aligner = m.aligners.get(k)
        if aligner is None:
            ch = self._channel(k)
            if barrier is None:
                ch.put(item)
            else:
                ch.put_barrier(barrier[0], terminal=barrier[1])
            return
        while not m.failed:
            try:
                if barrier is None:
                    aligner.put(self.index, item, timeout=0.1)
                else:
                    aligner.put_barrier(self.index, barrier[0], terminal=barrier[1], timeout=0.1)
                return
            except TimeoutError:
                continue

    def _channel(self, k: int):
        ch = self._channels.get(k)
        if ch is None:
            m = self.member
            peer = m.peers[m.topology.member_of_keyed(k)]
            ch = self._channels[k] = peer.channel("aggregate", k, channel=self.index,
                                                  execution_id=m.execution_id)
        return ch

    def _end_all(self) -> None:
        """Ends this source's channel into every keyed processor; remote channels are
        closed, which waits until the peers hold everything sent."""
        m = self.member
        for k in range(m.n_keyed):
            aligner = m.aligners.get(k)
            if aligner is not None:
                aligner.end(self.index)
            else:
                self._channel(k).end()
        for ch in self._channels.values():
            ch.close()

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
                for k in range(m.n_keyed):
                    self._put(k, None, barrier=(sid, terminal))
                if terminal:
                    self._end_all()
                m.ack(self.label, sid, writer.finish())
                self._terminal = sid if terminal else None
            elif msg[0] == "commit":
                sid = msg[1]
                if fused_sink:
                    self.commit_sink(sid)
                reader.ack(sid)
                if getattr(self, "_terminal", None) == sid:
                    return True
            elif msg[0] == "end":
                self._end_all()
                return True


class _KeyedProcessor(_Processor):
    def __init__(self, member: Member, index: int):
        super().__init__(member, index, "aggregate")
        self.restored_table = None

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
                    samples = self.sample_ts(batch)
                    self.write(agg.update(batch))
                    self.emitted(samples)
                elif kind == SNAPSHOT:
                    sid, terminal = event[1], event[2]
                    writer = self.new_writer(sid, m.n_sources + self.index)
                    writer.write_table("aggregate", agg.snapshot(), key=agg_stage.key)
                    self.prepare_sink(writer, sid)
                    records = aligner.alignments  # a copy of the history: read it once
                    aligned = records[-1]["duration_s"] if records else None
                    m.ack(self.label, sid, writer.finish(), aligned)
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
