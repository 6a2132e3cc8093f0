"""A processor's output: the fused stateless stages of each path, its sinks, and the
channels of its edges into other vertices (local aligners or exchange streams).

A batch of at least :attr:`Outbox.small` rows goes on as it comes (split by destination on
a partitioned edge), into a local aligner or an exchange stream, which sends it at once.
Smaller batches (a source read at a low rate, say) are held per edge, before they are split
by destination, and sent as one once they add up to ``small`` rows or
the oldest has waited ``JobConfig.max_batch_delay`` (Flink's buffer timeout): each batch
costs its consumer the same fixed work whatever its rows, and thousands of few-row batches
a second kept both threads busy and every row waiting behind the others. Held rows go
before any barrier, watermark or end of the channel, so nothing overtakes them.

Sinks may buffer: the outbox notes when each sink got its first row since the last flush
(:attr:`Outbox.unflushed`), and :meth:`Outbox.flush_due` has the writers whose oldest row
has waited ``max_batch_delay`` show it (:meth:`~sparkjet.connectors.base.SinkWriter.flush`),
and sends the held batches that waited as long."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet._batches import split_by
from sparkjet._keys import SUPPORTED, is_key_type
from sparkjet.connectors import dead_letters
from sparkjet.connectors.base import Sink
from sparkjet.errors import BadRecordError, NullKeyError, SchemaMismatchError, UnsupportedTypeError
from sparkjet.operators.base import ORDINAL
from sparkjet.operators.table_join import TableJoiner, TableJoinStage
from sparkjet.partitioning import partition_ids
from sparkjet.pipeline.dag import Vertex
from sparkjet.pipeline.stages import FilterStage, MapStage, TimestampsStage
from sparkjet.runtime.schemas import SchemaGuard, encode

#: A batch smaller than ``batch_size`` divided by this is held to be sent with the next.
SMALL_BATCH_DIVISOR = 16


class Outbox:
    """Sends one processor's output along its vertex's paths.

    ``on_timestamps(batch)`` is called where a path passes the vertex's ``with_timestamps``
    stage (sources only). Items for another vertex go into the channel of this processor
    there: the aligner of that processor if it runs in this member, else an exchange
    stream to the member running it.
    """

    def __init__(self, processor, vertex: Vertex, sinks: dict, on_timestamps=None):
        self.processor = processor
        self.member = processor.member
        self.vertex = vertex
        self.sinks = sinks                 # sink name -> SinkWriter
        self.on_timestamps = on_timestamps
        t = self.member.topology
        self.targets = vertex.targets
        dag = self.member.dag
        self._broadcast = {(p.target, p.ordinal) for p in vertex.paths if p.target is not None
                           and p.ordinal in dag.vertices[p.target].broadcast_inputs}
        self._keys = {(p.target, p.ordinal): dag.vertices[p.target].key_of(p.ordinal)
                      for p in vertex.paths
                      if p.target is not None and (p.target, p.ordinal) not in self._broadcast}
        self._tagged = {w for w in self.targets if dag.vertices[w].arity > 1}
        self._width = {w: t.parallelism[w] for w in self.targets}
        self._channel_of = {w: t.channel_offset[(w, vertex.name)] + processor.index
                            for w in self.targets}
        self._remote: dict = {}           # (vertex, k) -> OutboundChannel
        self._key_types_checked: set = set()   # (target, ordinal) whose key types were checked
        self.ended = False
        #: sink name -> time.monotonic() of its first row written since its last flush
        self.unflushed: dict[str, float] = {}
        self._max_delay = self.member.config.max_batch_delay
        #: Batches under this many rows wait (at most ``max_batch_delay``) to go on as one.
        self.small = (max(1, self.member.config.batch_size // SMALL_BATCH_DIVISOR)
                      if self._max_delay > 0 else 0)
        #: (target, ordinal) -> the small batches held for that edge
        self._held: dict[tuple[str, int], _Held] = {}
        # Each output's schema (sink or edge into another vertex), fixed at its first batch
        # or by the restored snapshot: see sparkjet.runtime.schemas.
        restored_schemas = getattr(processor, "restored_schemas", None) or {}
        self._guards: dict[str, SchemaGuard] = {}
        for p in vertex.paths:
            key = _output(p)
            where = (f"sink {p.sink!r}" if p.sink is not None else
                     f"the edge from {vertex.name!r} into {p.target!r}"
                     + (f" (input {p.ordinal})" if dag.vertices[p.target].arity > 1 else ""))
            self._guards.setdefault(key, SchemaGuard(where, restored_schemas.get(key)))
        for name in sinks:
            self._guards.setdefault(f"sink:{name}", SchemaGuard(f"sink {name!r}",
                                                                restored_schemas.get(f"sink:{name}")))
        # One joiner per join_table stage on the paths (a stage on several paths: one).
        self._joiners: dict[int, TableJoiner] = {}
        restored = getattr(processor, "restored_tables", None) or {}
        for path in vertex.paths:
            for stage in path.stages:
                if isinstance(stage, TableJoinStage) and id(stage) not in self._joiners:
                    name = dag.table_join_name(stage)
                    self._joiners[id(stage)] = TableJoiner(stage, name, self.member.table_versions,
                                                           restored.get(name))

    # -- data ----------------------------------------------------------------------------

    def emit(self, batch: pa.RecordBatch) -> int:
        """Sends ``batch`` along every path; returns the rows written to sinks."""
        written = 0
        for path in self.vertex.paths:
            out = batch
            for stage in path.stages:
                if isinstance(stage, TimestampsStage):
                    if self.on_timestamps is not None:
                        self.on_timestamps(out)
                    continue
                if isinstance(stage, TableJoinStage):
                    out = self._joiners[id(stage)].apply(out)
                elif self._policy(stage) != "fail":
                    out = self._apply_isolating(stage, out)
                else:
                    out = stage.apply(out)
                if out is None:
                    break
            if out is None or out.num_rows == 0:
                continue
            if path.sink is not None:
                out = self._refused_by_sink(path.sink, out)
            elif (path.target, path.ordinal) in self._keys:
                out = self._check_keys(path.target, path.ordinal, out)
            if out is None or out.num_rows == 0:
                continue
            out = self._guards[_output(path)].check(out)
            if path.sink is not None:
                self.sinks[path.sink].write(out)
                self.unflushed.setdefault(path.sink, time.monotonic())
                written += out.num_rows
            else:
                self._route(path.target, out, path.ordinal)
        return written

    # -- bad records (on_error) ----------------------------------------------------------

    def resolve(self, policy):
        """An ``on_error`` policy, or the job's when it is None."""
        return self.member.config.on_error if policy is None else policy

    def refuse(self, policy, letters: pa.RecordBatch, error: BaseException) -> None:
        """Applies ``policy`` (resolved) to bad records: "fail" raises ``error``, "skip"
        counts them, a Sink gets ``letters`` (:mod:`sparkjet.connectors.dead_letters`)."""
        policy = self.resolve(policy)
        m = self.member
        if policy == "skip":
            m.count("skipped_events", letters.num_rows)
        elif isinstance(policy, Sink):
            self.write_sink(m.dag.dead_letter_sink(policy), letters)
            m.count("dead_letters", letters.num_rows)
        else:
            raise error

    def _check_keys(self, target: str, ordinal: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The rows of ``batch`` whose keys stage ``target`` can key by; the others (a null
        in a key column) go to its ``on_error``. A key column of a type no key can have
        fails the job: every row would fail."""
        key = self._keys[(target, ordinal)]
        names = [key] if isinstance(key, str) else list(key)
        present = [n for n in names if n in batch.schema.names]
        if (target, ordinal) not in self._key_types_checked and len(present) == len(names):
            for n in names:
                t = batch.schema.field(n).type
                if not is_key_type(t):
                    raise UnsupportedTypeError(
                        f"{target}: key column {n!r} has type {t}, which cannot be a key: "
                        f"keys are {SUPPORTED}")
            self._key_types_checked.add((target, ordinal))
        if not any(batch.column(n).null_count for n in present):
            return batch
        null = None
        for n in present:
            col = batch.column(n).is_null()
            null = col if null is None else pc.or_(null, col)
        rows = np.flatnonzero(null.to_numpy(zero_copy_only=False))
        bad = batch.take(pa.array(rows))
        columns = [next(n for n in present if not batch.column(n)[int(r)].is_valid)
                   for r in rows]
        first, column = int(rows[0]), columns[0]
        where = dead_letters.position_of(batch, first)
        fed = f" (input {ordinal})" if self.member.dag.vertices[target].arity > 1 else ""
        error = NullKeyError(
            f"{target}: key column {column!r} is null at {where} of the stream from "
            f"{self.vertex.name!r} into it{fed}; keys cannot be null (on_error='skip' or a "
            f"dead-letter sink keeps the job going)", first, column=column, stage=target)
        letters = dead_letters.from_rows(target, bad, columns,
                                         [f"NullKeyError: key column {c!r} is null"
                                          for c in columns])
        self.refuse(self.member.dag.vertices[target].on_error, letters, error)
        good = np.ones(batch.num_rows, bool)
        good[rows] = False
        return batch.filter(pa.array(good))

    def _refused_by_sink(self, name: str, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The rows of ``batch`` sink ``name`` takes; the ones it says its system would
        refuse go to its ``on_error``."""
        refused = self.sinks[name].refused(batch)
        if not refused:
            return batch
        refused = sorted(refused, key=lambda r: r.row)
        rows = [r.row for r in refused]
        first = refused[0]
        where = dead_letters.position_of(batch, first.row)
        spec = self.member.dag.sinks[name]
        column = f"column {first.column!r}: " if first.column is not None else ""
        error = BadRecordError(
            f"{name} ({spec.sink!r}): {where}: {column}{first.reason} (on_error='skip' or a "
            f"dead-letter sink keeps the job going)", name, first.column, where)
        letters = dead_letters.from_rows(name, batch.take(pa.array(rows)),
                                         [r.column for r in refused],
                                         [r.reason for r in refused])
        self.refuse(spec.on_error, letters, error)
        good = np.ones(batch.num_rows, bool)
        good[rows] = False
        return batch.filter(pa.array(good))

    def _policy(self, stage):
        """A stage's on_error, or the job's when the stage leaves it to the job."""
        policy = getattr(stage, "on_error", "fail")
        return self.member.config.on_error if policy is None else policy

    def _apply_isolating(self, stage, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        """``stage.apply(batch)``; when it raises, the batch is split until the rows it
        fails on are alone, and those are skipped or dead-lettered (``stage.on_error``)."""
        try:
            return stage.apply(batch)
        except Exception as error:  # noqa: BLE001 - the user's code: isolated below
            outputs: list = []
            failed: list = []
            _bisect(stage, batch, outputs, failed, error)
        if len(failed) == batch.num_rows:
            # every row fails: a broken stage (a missing column, a bug), not bad records
            raise failed[0][1]
        rows = pa.concat_batches([row for row, _ in failed])
        label = f"{self.vertex.name}/{_STAGE_NAMES.get(type(stage), type(stage).__name__)}"
        letters = dead_letters.from_rows(label, rows, [None] * len(failed),
                                         [f"{type(e).__name__}: {e}" for _, e in failed])
        self.refuse(self._policy(stage), letters, failed[0][1])
        outputs = [o for o in outputs if o is not None and o.num_rows]
        if not outputs:
            return None
        if len(outputs) == 1:
            return outputs[0]
        try:
            return pa.concat_batches(outputs)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise SchemaMismatchError(f"a stage returned batches of different schemas for the "
                                      f"parts of one batch: {e}") from None

    def write_sink(self, name: str, batch: pa.RecordBatch) -> None:
        """Writes ``batch`` to sink ``name`` directly (a late side output)."""
        self.sinks[name].write(self._guards[f"sink:{name}"].check(batch))
        self.unflushed.setdefault(name, time.monotonic())

    @property
    def holding(self) -> bool:
        """Whether a sink that buffers (:attr:`SinkWriter.buffers`) holds rows not yet
        flushed: output written to it is not visible yet."""
        return any(self.sinks[name].buffers for name in self.unflushed)

    def flush_due(self, now: float | None = None) -> float | None:
        """Flushes each sink whose first unflushed row has waited ``max_batch_delay``;
        sends the held batches that waited as long; returns the seconds until the next
        flush is due (None: nothing waits)."""
        if not self.unflushed and not self._held:
            return None
        now = time.monotonic() if now is None else now
        nearest = None
        for edge, held in list(self._held.items()):
            left = held.since + self._max_delay - now
            if left <= 0:
                self._send_held(edge)
            elif nearest is None or left < nearest:
                nearest = left
        for name, since in list(self.unflushed.items()):
            left = since + self._max_delay - now
            if left <= 0:
                del self.unflushed[name]
                self.sinks[name].flush()
            elif nearest is None or left < nearest:
                nearest = left
        return nearest

    def flushed(self) -> None:
        """Every sink was flushed (prepared at a barrier): nothing waits any more."""
        self.unflushed.clear()

    def schemas(self) -> dict:
        """The schemas fixed so far, by output (encoded): what the snapshot acknowledgement
        carries for the coordinator to compare across processors."""
        return {k: encode(g.schema) for k, g in self._guards.items() if g.schema is not None}

    def _route(self, target: str, batch: pa.RecordBatch, ordinal: int = 0) -> None:
        """Sends ``batch`` along the edge into ``target`` (its input ``ordinal``), or holds
        it with the other small batches for that edge (see the module doc)."""
        # (the edge's SchemaGuard gave every batch on it the same schema: they concatenate)
        edge = (target, ordinal)
        held = self._held.get(edge)
        if batch.num_rows >= self.small:
            if held is not None:
                self._send_held(edge)
            self._route_now(target, batch, ordinal)
            return
        if held is None:
            held = self._held[edge] = _Held(time.monotonic())
        held.batches.append(batch)
        held.rows += batch.num_rows
        if held.rows >= self.small:
            self._send_held(edge)

    def _send_held(self, edge: tuple[str, int]) -> None:
        batches = self._held.pop(edge).batches
        self._route_now(edge[0], batches[0] if len(batches) == 1 else pa.concat_batches(batches),
                        edge[1])

    def _route_now(self, target: str, batch: pa.RecordBatch, ordinal: int) -> None:
        if target in self._tagged:
            batch = batch.append_column(ORDINAL, pa.array(np.full(batch.num_rows, ordinal, np.int8)))
        width = self._width[target]
        if width == 1:
            self._put(target, 0, batch)
            return
        if (target, ordinal) in self._broadcast:
            for k in range(width):
                self._put(target, k, batch)
            return
        m = self.member
        pids = partition_ids(batch, m.config.partition_count,
                             key=self._keys[(target, ordinal)]).to_numpy()
        for k, rows in split_by(batch, m.topology.owner[pids]):
            self._put(target, k, rows)

    def send_held(self) -> None:
        """Sends every held batch now (before a barrier, a watermark or the end)."""
        for edge in list(self._held):
            self._send_held(edge)

    # -- in-band control -----------------------------------------------------------------

    def table_versions(self, snapshot_id: int) -> list[tuple[str, dict]]:
        """At barrier ``snapshot_id``, before it is forwarded: each table join reloads if
        due; returns the version each uses from now on (join name, entry), which the
        snapshot records (:func:`sparkjet.runtime.snapshotting.write_tables`)."""
        return [(joiner.name, joiner.at_barrier(snapshot_id))
                for joiner in self._joiners.values()]

    def barrier(self, snapshot_id: int, terminal: bool) -> None:
        # Every local target with an alignment timeout learns of the barrier first: its
        # timeout counts from now, even if the barrier waits here for room in the queue
        # of a target before it (the timed-out target drains its queues).
        for aligner in self._local_aligners():
            announce = getattr(aligner, "announce", None)
            if announce is not None:
                announce(snapshot_id, terminal)
        self.send_held()
        for w in self.targets:
            for k in range(self._width[w]):
                self._put(w, k, None, barrier=(snapshot_id, terminal))

    def has_room(self) -> bool:
        """Whether every channel of this processor into a processor of this member has
        room for a batch, so that the next batch sent will not wait (a remote channel's
        window is not known here: it counts as room). With unaligned snapshots a source
        reads its next batch only then: it stays free to inject a barrier at once instead
        of waiting inside a full queue."""
        return all(aligner.queued(c) < aligner.capacity
                   for aligner, c in self._local_channels())

    def _local_aligners(self) -> list:
        return [aligner for aligner, _ in self._local_channels()]

    def _local_channels(self) -> list:
        """(aligner, channel) of each channel into a processor of this member."""
        local = self.__dict__.get("_local")
        if local is None:
            m = self.member
            local = self._local = [(m.aligners[(w, k)], self._channel_of[w])
                                   for w in self.targets for k in range(self._width[w])
                                   if (w, k) in m.aligners]
        return local

    def watermark(self, mark) -> None:
        self.send_held()
        for w in self.targets:
            for k in range(self._width[w]):
                self._put(w, k, mark)

    def end(self) -> None:
        """Ends this processor's channel into every processor it feeds; remote channels
        are closed, which waits until the peers hold everything sent."""
        if self.ended:
            return
        self.send_held()
        self.ended = True
        m = self.member
        for w in self.targets:
            c = self._channel_of[w]
            for k in range(self._width[w]):
                aligner = m.aligners.get((w, k))
                if aligner is not None:
                    aligner.end(c)
                else:
                    self._remote_channel(w, k).end()
        for ch in self._remote.values():
            ch.close()

    def abort(self) -> None:
        for ch in self._remote.values():
            ch.abort()

    # -- channels ------------------------------------------------------------------------

    def _put(self, target: str, k: int, item, barrier=None) -> None:
        m = self.member
        c = self._channel_of[target]
        aligner = m.aligners.get((target, k))
        if aligner is None:
            ch = self._remote_channel(target, k)
            if barrier is not None:
                ch.put_barrier(barrier[0], terminal=barrier[1])
            elif isinstance(item, pa.RecordBatch):
                ch.put(item)
            else:
                ch.put_watermark(item)
            return
        while not m.failed:
            try:
                if barrier is None:
                    aligner.put(c, item, timeout=0.1)
                else:
                    aligner.put_barrier(c, barrier[0], terminal=barrier[1], timeout=0.1)
                return
            except TimeoutError:
                continue

    def _remote_channel(self, target: str, k: int):
        ch = self._remote.get((target, k))
        if ch is None:
            m = self.member
            peer = m.peers[m.topology.member_of(target, k)]
            ch = self._remote[(target, k)] = peer.channel(
                target, k, channel=self._channel_of[target], execution_id=m.execution_id)
        return ch


def _bisect(stage, batch: pa.RecordBatch, outputs: list, failed: list, error=None) -> None:
    """Applies ``stage`` to ``batch`` (which failed with ``error`` when given), halving it
    where it fails: ``outputs`` gets the results in row order, ``failed`` each row it
    fails on alone, with its error."""
    if error is None:
        try:
            outputs.append(stage.apply(batch))
            return
        except Exception as e:  # noqa: BLE001 - the user's code
            error = e
    if batch.num_rows == 1:
        failed.append((batch, error))
        return
    half = batch.num_rows // 2
    _bisect(stage, batch.slice(0, half), outputs, failed)
    _bisect(stage, batch.slice(half), outputs, failed)


_STAGE_NAMES = {MapStage: "map_batches", FilterStage: "filter"}


@dataclass
class _Held:
    """The small batches an edge holds (:meth:`Outbox._route`): since when, how many rows."""

    since: float
    rows: int = 0
    batches: list = field(default_factory=list)


def _output(path) -> str:
    """An output's name: ``sink:NAME``, or ``edge:VERTEX:ORDINAL`` for an edge's input."""
    return f"sink:{path.sink}" if path.sink is not None else f"edge:{path.target}:{path.ordinal}"


__all__ = ["ORDINAL", "Outbox"]
