"""A member's processors: one thread each, running one vertex's share of a DAG.

A :class:`SourceProcessor` reads its source partitions, sends each batch along its vertex's
paths (:mod:`sparkjet.runtime.outbox`: fused stateless stages, then sinks or edges into
other vertices) and generates watermarks. A :class:`KeyedProcessor` takes the events of
its :class:`~sparkjet.runtime.aligner.BarrierAligner` (batches and watermarks from every
processor feeding it, and barriers), runs its vertex's operator
(:mod:`sparkjet.operators.base`) and sends the output along its own paths. At a snapshot
barrier each saves its state and forwards the barrier (:mod:`sparkjet.runtime.snapshotting`
says what it writes, and what it reads back at restore); both hand their sinks'
transactions through the two phases of a snapshot (prepare at the barrier, commit when the
coordinator says so), and count what they see in the metrics of their
:class:`~sparkjet.runtime.member.Member`, which owns them and wires them to the coordinator
and to the processors of other members.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Protocol

import pyarrow as pa

from sparkjet._memory import small_pages
from sparkjet.connectors import dead_letters
from sparkjet.errors import BadRecordError, InvalidArgumentError
from sparkjet.operators.time import EventTimeColumn, in_units
from sparkjet.runtime.aligner import DONE, ITEM, SNAPSHOT, UNALIGNED
from sparkjet.runtime.observability import weighted_samples
from sparkjet.runtime.outbox import Outbox
from sparkjet.runtime.snapshotting import (
    acknowledge,
    finish_barrier,
    forward_barrier,
    open_writer,
    write_in_flight,
    write_keyed,
    write_prepared,
    write_source,
)
from sparkjet.runtime.watermarks import (
    MAX_TIME,
    MIN_TIME,
    SourceWatermarks,
    Watermark,
    WatermarkTracker,
)
from sparkjet.snapshot.writer import SnapshotBuffers


class MemberLink(Protocol):
    """What a processor asks of the member that runs it (:class:`sparkjet.runtime.member.Member`
    is the one implementation; a protocol here, so that this module needs no import of it)."""

    dag: Any
    topology: Any

    @property
    def failed(self) -> bool: ...

    def fail(self, error: BaseException) -> None: ...

    def count(self, key: str, n: int) -> None: ...

    def count_vertex(self, vertex: str, direction: str, n: int) -> None: ...

    def add_latencies(self, key: str, latencies: Any, counts: Any = None) -> None: ...

    def watermark_of(self, vertex: str, time: int) -> None: ...

    def event_time_of(self, vertex: str, newest: int | None, time_type: Any) -> None: ...

    def wall_ns_per_unit(self, column: str, time_type: Any) -> int | None: ...

    def operator_restored(self, label: str, seconds: float, keys: int) -> None: ...

_POLL = 0.005
_TAKE = 0.02            # a keyed processor's wait for input (it wakes when input comes)
_MIN_WAIT = 0.0005      # the shortest sleep of an idle loop (max_batch_delay=0 would spin)


class Processor(threading.Thread):
    def __init__(self, member: MemberLink, vertex, index: int):
        super().__init__(name=f"sparkjet-{vertex.name}-{index}", daemon=True)
        self.label = f"{vertex.name}-{index}"
        self.member = member
        self.vertex = vertex
        self.index = index
        self.control: queue.Queue = queue.Queue()
        self.sink_names = list(dict.fromkeys(p.sink for p in vertex.paths if p.sink is not None))
        late = [s.name for s in member.dag.sinks.values() if s.late and vertex.name in s.feeders]
        self.late_sink = late[0] if late else None
        if self.late_sink is not None:
            self.sink_names.append(self.late_sink)
        self.sink_names += [s.name for s in member.dag.sinks.values()
                            if s.dead_letters and vertex.name in s.feeders]
        self.forget_restored()
        self.sinks: dict = {}           # sink name -> SinkWriter
        self.outbox: Outbox | None = None
        self._ts_samples: list = []
        self._unseen: list = []         # samples whose output a sink's buffer holds
        self._pending_latency: dict[int, list] = {}

    def forget_restored(self) -> None:
        """What a restore hands the processor (:func:`~sparkjet.runtime.snapshotting.
        restore_processors`) set back to nothing restored: before the processor starts, a
        restore that failed half way is forgotten and another snapshot restored."""
        self.prepared: dict = {}        # sink name -> what the restored snapshot prepared
        self.restored_tables: dict = {}  # join_table stage -> its restored version entry
        self.restored_schemas: dict = {}  # output -> the schema the snapshot recorded

    def run(self) -> None:
        try:
            self.work()
        except BaseException as e:  # noqa: BLE001 - reported to the member, which ends the execution
            self.member.fail(e)

    def open_outputs(self, on_timestamps=None) -> None:
        m, t = self.member, self.member.topology
        for name in self.sink_names:
            spec = m.dag.sinks[name]
            writer = spec.sink.open(m.context(spec.sink.name,
                                              t.sink_offset[name][self.vertex.name] + self.index,
                                              t.sink_instances[name]))
            writer.recover(m.metrics["restored_from"], self.prepared.get(name))
            self.sinks[name] = writer
        self.outbox = Outbox(self, self.vertex, self.sinks, on_timestamps)

    def close_sinks(self) -> None:
        if not self.member.failed:
            for writer in self.sinks.values():
                writer.close()
            if self.outbox is not None:      # closed sinks hold nothing back
                self.outbox.flushed()
                self.emitted(None)

    def emit(self, batch: pa.RecordBatch) -> None:
        written = self.outbox.emit(batch)
        self.member.count_vertex(self.vertex.name, "out", batch.num_rows)
        if written:
            self.member.count("events_out", written)

    def write_late(self, batch: pa.RecordBatch | None) -> None:
        if batch is None or batch.num_rows == 0:
            return
        self.member.count("late_events", batch.num_rows)
        if self.late_sink is not None:
            self.outbox.write_sink(self.late_sink, batch)

    def sample_ts(self, batch: pa.RecordBatch) -> tuple | None:
        """Samples the event times (``ts``, as ns since the epoch) of a batch on its way to
        the output: their latency is measured when the output is committed
        (``latencies_ns``) and, by :meth:`emitted`, when it is handed to the sinks
        (``emit_latencies_ns``). Up to 16 rows per batch, each counted for its share of the
        batch's rows (:func:`~sparkjet.runtime.observability.weighted_samples`), so every
        event weighs the same in the percentiles however large its batch was. A ``ts``
        column with no wall time (an integer whose unit ``with_timestamps`` did not
        declare) gives no samples. Returns (times, counts), or None."""
        if "ts" in batch.schema.names and batch.num_rows and self.sinks:
            ts = batch.column("ts")
            per_unit = self.member.wall_ns_per_unit("ts", ts.type)
            if per_unit is None:
                return None
            index, counts = weighted_samples(batch.num_rows)
            times = ts.cast(pa.int64()).to_numpy()[index] * per_unit
            if self.member.snapshots_on:      # kept for the commit (none: no commits)
                self._ts_samples.append((times, counts))
            return times, counts
        return None

    def emitted(self, samples: tuple | None) -> None:
        """The output of ``samples``' events was handed to the sinks: it is emitted now,
        or, while a sink that buffers holds rows, when that sink flushes them."""
        if samples is not None:
            self._unseen.append(samples)
        if self._unseen and not self.outbox.holding:
            now = time.time_ns()
            for times, counts in self._unseen:
                self.member.add_latencies("emit_latencies_ns", now - times, counts)
            self._unseen = []

    def flush_due(self) -> float | None:
        """Flushes the sinks whose rows waited ``max_batch_delay`` (and counts the output
        they held as emitted); returns the seconds until the next flush is due."""
        due = self.outbox.flush_due()
        if self._unseen:
            self.emitted(None)
        return due

    def idle_wait(self, poll: float) -> float:
        """How long this processor's loop may wait for input before it looks again: ``poll``
        (a source's: at most ``max_batch_delay``, as its reader may have rows by then), and
        no longer than until the next sink flush is due."""
        wait = poll
        due = self.flush_due() if self.outbox is not None else None
        return wait if due is None else max(min(wait, due), _MIN_WAIT)

    def prepare_sinks(self, writer, snapshot_id: int) -> None:
        t = self.member.topology
        for name, sink in self.sinks.items():
            prepared = sink.prepare(snapshot_id)
            instance = t.sink_offset[name][self.vertex.name] + self.index
            write_prepared(writer, name, instance, prepared)
        if self.outbox is not None:
            self.outbox.flushed()
            self.emitted(None)
        self._pending_latency[snapshot_id] = self._ts_samples
        self._ts_samples = []

    def commit_sinks(self, snapshot_id: int) -> None:
        for sink in self.sinks.values():
            sink.commit(snapshot_id)
        now = time.time_ns()
        for sid in [s for s in self._pending_latency if s <= snapshot_id]:
            for times, counts in self._pending_latency.pop(sid):
                self.member.add_latencies("latencies_ns", now - times, counts)


class SourceProcessor(Processor):
    def __init__(self, member: MemberLink, vertex, index: int, partitions: list[int]):
        super().__init__(member, vertex, index)
        self.partitions = partitions
        self._reader = None
        self._resets = 0       # the reader's offset_resets counted so far
        self._partition = None
        self._terminal = None
        ts = vertex.timestamps
        self.watermarks = None
        if ts is not None:
            self.watermarks = SourceWatermarks(list(partitions) or [None], 0, ts.idle_timeout)
            self._lag = ts.max_lag
            self._time = EventTimeColumn(ts.column)

    def forget_restored(self) -> None:
        super().forget_restored()
        self.restored_source_state = None
        self.restored_times: dict = {}

    def _observe(self, batch: pa.RecordBatch) -> None:
        """At the path's with_timestamps stage: the batch's greatest event time."""
        first = self._time.type is None
        times = self._time.values(batch)
        if first:
            self.watermarks.max_lag = in_units("max_lag", self._lag, self._time.type)
            unit, t = self.vertex.timestamps.unit, self._time.type
            if unit is not None and pa.types.is_timestamp(t) and t.unit != unit:
                raise InvalidArgumentError(
                    f"with_timestamps({self._time.name!r}, unit={unit!r}) but the column is "
                    f"{t}: a timestamp column's unit is its own")
        self.watermarks.observe(self._partition, times)
        self.member.event_time_of(self.vertex.name, self.watermarks.newest(), self._time.type)

    def work(self) -> None:
        m = self.member
        v = self.vertex
        reader = self._reader = v.source.open(self.partitions,
                                              m.context(v.source.name, self.index,
                                                        m.topology.parallelism[v.name]))
        reader.restore_state(self.restored_source_state)
        if self.watermarks is not None:
            self.watermarks.restore(self.restored_times)
        self.open_outputs(self._observe if self.watermarks is not None else None)
        reader.on_bad_record = self._bad_record
        ended = finished = False
        unaligned = m.config.alignment_timeout is not None and m.snapshots_on
        # an idle reader is asked again after at most max_batch_delay
        poll = min(_POLL, max(m.config.max_batch_delay, _MIN_WAIT))
        # a reader that gave all it had (SourceReader.caught_up) is read again half of
        # max_batch_delay later: a slow stream then comes in batches of a few
        # milliseconds' rows, not a handful of rows a thousand times a second
        gap = min(m.config.max_batch_delay / 2, _POLL)
        try:
            while not m.failed and not finished:
                self._count_resets(reader)
                finished = self._control(reader)
                if finished or m.failed:
                    break
                if ended or self._terminal is not None:
                    # read to its end, or stopped: after the terminal barrier nothing more
                    # is read (a resumed job reads on from the snapshot's offsets)
                    time.sleep(self.idle_wait(_POLL))
                    continue
                if unaligned and not self.outbox.has_room():
                    # (see Outbox.has_room: free to take the next barrier at once)
                    time.sleep(_MIN_WAIT)
                    self.flush_due()
                    continue
                if reader.at_end():
                    ended = True
                    if self.watermarks is not None:
                        self.watermarks.ended = True
                        self._send_watermark()
                    m.source_ended(self.label)
                    continue
                began = time.monotonic()
                batch = reader.read(m.config.batch_size)
                if batch is None:
                    self._send_watermark()
                    time.sleep(self.idle_wait(poll))
                    continue
                self._partition = reader.last_partition()
                m.count("events_in", batch.num_rows)
                m.count_vertex(v.name, "in", batch.num_rows)
                samples = self.sample_ts(batch)
                self.emit(batch)
                self.emitted(samples)
                self._send_watermark()
                due = self.flush_due()
                if gap and reader.caught_up():
                    left = began + gap - time.monotonic()
                    if left > 0:        # (due, if any, is > 0: what was due is sent)
                        time.sleep(left if due is None else min(left, due))
        finally:
            self._count_resets(reader)
            if m.failed and self.outbox is not None:
                self.outbox.abort()
            reader.close()
            self.close_sinks()

    def _count_resets(self, reader) -> None:
        """Counts the reader's new ``offset_resets`` (its source's on_offset_reset)."""
        resets = reader.offset_resets
        if resets != self._resets:
            self.member.count("offset_resets", resets - self._resets)
            self._resets = resets

    def _bad_record(self, record) -> None:
        """A record the reader could not decode: the source's ``on_error`` applies."""
        v = self.vertex
        where = f"{record.position}: " if record.position else ""
        error = BadRecordError(
            f"{v.name} ({v.source!r}): {where}{record.reason} (on_error='skip' or a "
            f"dead-letter sink keeps the job going)", v.name, record.column, record.position)
        self.outbox.refuse(v.on_error, dead_letters.from_records(v.name, [record]), error)

    def _send_watermark(self) -> None:
        if self.watermarks is not None:
            mark = self.watermarks.due()
            if mark is not None:
                self.outbox.watermark(mark)
                if not mark.idle:
                    self.member.watermark_of(self.vertex.name, mark.time)

    def _control(self, reader) -> bool:
        """Handles the coordinator's requests; True when this processor is done."""
        while True:
            try:
                msg = self.control.get_nowait()
            except queue.Empty:
                return False
            if msg[0] == "barrier":
                _, sid, terminal = msg
                writer = open_writer(self.member, self.vertex.name, self.index, sid)
                write_source(writer, self.vertex.name, self.index, reader.snapshot_state(),
                             None if self.watermarks is None else self.watermarks.state())
                finish_barrier(self, writer, sid, terminal)
                self._terminal = sid if terminal else None
            elif msg[0] == "commit":
                sid = msg[1]
                self.commit_sinks(sid)
                reader.ack(sid)
                if self._terminal == sid:
                    return True
            elif msg[0] == "end":
                self.outbox.end()
                return True


class KeyedProcessor(Processor):
    def forget_restored(self) -> None:
        super().forget_restored()
        self.restored_table = None
        self.restored_watermark = MIN_TIME
        self.restored_floors = None
        self.restored_broadcast = None
        self.restored_in_flight: list = []  # (channel, item): an unaligned snapshot's

    def work(self) -> None:
        m = self.member
        v = self.vertex
        op = v.stage.make_operator(v.time_column)
        op.name = v.name
        rebuild_start = time.monotonic()
        with small_pages():     # a fresh process's rebuild, without waiting on compaction
            op.restore(self.restored_table, self.restored_watermark, self.restored_floors)
        if self.restored_broadcast is not None:
            op.restore_broadcast(self.restored_broadcast)
        keys = 0 if self.restored_table is None else self.restored_table.num_rows
        self.restored_broadcast = None
        self.restored_table = None
        m.operator_restored(self.label, time.monotonic() - rebuild_start, keys)
        self.open_outputs()
        aligner = m.aligners[(v.name, self.index)]
        tracker = WatermarkTracker(m.topology.channels[v.name], self.restored_watermark)
        # an unaligned snapshot's items in flight come first, as they came before
        for channel, item in self.restored_in_flight:
            self._item(op, tracker, channel, item)
        self.restored_in_flight = []
        terminal_sid = None
        unaligned = None        # (snapshot id, writer, schemas) until its last barrier
        buffers = SnapshotBuffers()     # the memory its snapshots group the state into
        done = False
        after = None            # an event taken while gathering batches, handled next
        # (a stage of one input: the batches of two inputs, tagged with their ordinal or
        # told apart by their channel, are never mixed)
        gather = v.arity == 1 and not v.broadcast_inputs
        try:
            while not m.failed:
                if self._control(terminal_sid):
                    return
                if done:
                    if not m.snapshots_on:
                        return
                    time.sleep(_POLL)
                    continue
                event, after = after or aligner.take(timeout=self.idle_wait(_TAKE)), None
                for out in op.tick():
                    self.emit(out)
                if event is None:
                    continue
                kind = event[0]
                if kind == ITEM:
                    item = event[2]
                    if gather and isinstance(item, pa.RecordBatch):
                        item, after = self._gather(aligner, item)
                    self._item(op, tracker, event[1], item)
                elif kind == UNALIGNED:
                    # The alignment timed out (JobConfig.alignment_timeout): the state is
                    # saved and the barrier forwarded now, ahead of the items still queued;
                    # the aligner captures those until the last barrier comes (SNAPSHOT).
                    sid = event[1]
                    writer = open_writer(m, v.name, self.index, sid)
                    write_keyed(writer, v, self.index, op, tracker.current,
                                m.topology.partitions_of(v.name, self.index), buffers)
                    unaligned = (sid, writer, forward_barrier(self, writer, sid, False))
                elif kind == SNAPSHOT:
                    sid, terminal = event[1], event[2]
                    records = aligner.alignments  # a copy of the history: read it once
                    aligned = records[-1]["duration_s"] if records else None
                    if unaligned is not None and unaligned[0] == sid:
                        _, writer, schemas = unaligned
                        unaligned = None
                        write_in_flight(writer, v.name, self.index, aligner.in_flight,
                                        m.topology.parallelism[v.name],
                                        m.topology.channels[v.name])
                        acknowledge(self, writer, sid, aligned, schemas)
                        continue
                    writer = open_writer(m, v.name, self.index, sid)
                    write_keyed(writer, v, self.index, op, tracker.current,
                                m.topology.partitions_of(v.name, self.index), buffers)
                    # (this thread is the aligner's consumer: its alignment of this
                    # snapshot is the last one recorded until it takes again)
                    finish_barrier(self, writer, sid, terminal, aligned)
                    if terminal:
                        terminal_sid = sid
                elif kind == DONE:
                    # Every input ended. Without snapshots the end of the input is the end
                    # of time (with them, the terminal barrier has ended the outputs).
                    done = True
                    if not self.outbox.ended:
                        if tracker.current < MAX_TIME:
                            self._advance(op, Watermark(MAX_TIME))
                        self.outbox.end()
        finally:
            if m.failed and self.outbox is not None:
                self.outbox.abort()
            self.close_sinks()

    def _gather(self, aligner, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, tuple | None]:
        """``batch`` and the batches queued right behind it, as one (up to ``batch_size``
        rows): a processor that fell behind takes its backlog in large batches, paying the
        operator's fixed cost per batch once, as Jet's processors drain their whole inbox.
        Taking them one after another would give the same state; only the updates a
        rolling aggregate emits in between are skipped. Returns the batch and the event
        that ended the run (a watermark, a barrier, a batch of another schema; None when
        the queues were empty), which the caller handles next."""
        limit = self.member.config.batch_size
        if batch.num_rows >= limit:
            return batch, None
        batches, rows = [batch], batch.num_rows
        nxt = None
        while rows < limit:
            nxt = aligner.take(timeout=0)
            if (nxt is None or nxt[0] != ITEM or not isinstance(nxt[2], pa.RecordBatch)
                    or nxt[2].schema != batch.schema):
                break
            batches.append(nxt[2])
            rows += nxt[2].num_rows
            nxt = None
        return (batch if len(batches) == 1 else pa.concat_batches(batches)), nxt

    def _item(self, op, tracker: WatermarkTracker, channel: int, item) -> None:
        """One item of input channel ``channel``: a watermark or a batch."""
        if isinstance(item, Watermark):
            mark = tracker.update(channel, item)
            if mark is not None:
                self._advance(op, mark)
            return
        samples = self.sample_ts(item)
        self.member.count_vertex(self.vertex.name, "in", item.num_rows)
        outputs, late = op.process(item)
        for out in outputs:
            self.emit(out)
        self.write_late(late)
        self.emitted(samples)
        self.flush_due()

    def _advance(self, op, mark: Watermark) -> None:
        if not mark.idle:
            self.member.watermark_of(self.vertex.name, mark.time)
            for out in op.advance(mark.time):
                self.emit(out)
            # an operator whose output may trail its input's event time holds it back
            mark = Watermark(op.output_watermark(mark.time))
        self.outbox.watermark(mark)

    def _control(self, terminal_sid) -> bool:
        while True:
            try:
                msg = self.control.get_nowait()
            except queue.Empty:
                return False
            if msg[0] == "commit":
                self.commit_sinks(msg[1])
                if msg[1] == terminal_sid:
                    return True


__all__ = ["KeyedProcessor", "Processor", "SourceProcessor"]
