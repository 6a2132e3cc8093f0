"""What a processor writes into a snapshot at a barrier, and what it reads back at restore:
the one place that knows the entries of a snapshot besides the operators' state tables.

Snapshot n (Chandy-Lamport):

1. the coordinator asks every source processor for barrier n; each saves its source state
   and watermarks (:func:`write_source`), then :func:`finish_barrier`;
2. each keyed processor's aligner emits "snapshot n" once aligned (exactly-once: held
   channels; at-least-once: the last barrier); the processor saves its operator's state (by
   partition) and watermark (:func:`write_keyed`), then :func:`finish_barrier`;
3. :func:`finish_barrier`, the same for both: the table versions its joins use from now on
   are recorded, the transactions of the sinks it writes prepared, its outputs' schemas
   recorded, barrier n forwarded into every channel it feeds, and its manifest handed to
   the coordinator (the phase-1 acknowledgement, sent from a thread of its own once the
   writer's files are durable: :func:`acknowledge`). The coordinator commits the snapshot in
   the store (the commit point), then tells every processor to run phase 2 (sinks commit,
   acknowledging sources ack) on its own thread.

A snapshot holds, by vertex (or pseudo-vertex), as broadcast entries (key -> JSON, unless
said otherwise) of each processor's store writer:

- :data:`PLAN_VERTEX`: the DAG's fingerprint (key ``dag``), from the first writer, which
  :mod:`sparkjet.runtime.restore` compares with the pipeline that restores it;
- a source vertex: processor ``i``'s reader state (key ``"i"``) and, with event time, its
  watermarks by source partition (key ``"wm:i"``);
- a keyed vertex: its operator's state, a table by Hazelcast partition (a single vertex's as
  a broadcast table), the operator's shared broadcast table (from processor 0), and
  processor ``i``'s watermark with the partitions it owned (key ``"wm:i"``,
  ``{"time": t, "partitions": [...]}``);
- a sink (under the sink's name): what sink instance ``j`` prepared (key ``"j"``), which
  its :meth:`~sparkjet.connectors.base.SinkWriter.recover` commits after a restart;
- :data:`TABLES_VERTEX`: the table version each join_table stage uses after the barrier
  (key ``"vertex/i/join"``);
- :data:`SCHEMAS_VERTEX`: each output's schema (key: the output; value: the encoded schema,
  :mod:`sparkjet.runtime.schemas`);
- :data:`IN_FLIGHT_VERTEX`, only in an unaligned snapshot (``JobConfig.alignment_timeout``):
  the items a keyed processor took after it saved its state and before the last barrier
  came (:func:`write_in_flight`), which its restore replays before new input
  (:func:`in_flight_of`; a restore at another parallelism is refused).

A member that starts from a snapshot reads it once for all its processors
(:func:`restore_processors`): the source state of every source partition, the state of the
partitions its processors own, the watermarks, the table versions and schemas, and the sink
transactions prepared in that snapshot. After a rescale, what N processors saved is handed
to M: source states and prepared transactions are merged (:func:`merge_states`), an old
sink instance's transactions go to instance (old index % total), and a keyed processor
starts at the least watermark of the partitions it now owns.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from typing import TYPE_CHECKING

import pyarrow as pa

from sparkjet.errors import InFlightRescaleError, SnapshotNotFoundError
from sparkjet.operators.table_join import TABLES_VERTEX
from sparkjet.pipeline.dag import SOURCE
from sparkjet.runtime.restore import conform_state
from sparkjet.runtime.schemas import decode as decode_schema
from sparkjet.runtime.storage import slot_writer
from sparkjet.runtime.watermarks import PartitionFloors, Watermark

if TYPE_CHECKING:
    from sparkjet.runtime.restore import RestorePlan, StartPoint

#: The snapshot vertex holding the DAG's fingerprint.
PLAN_VERTEX = "plan"
#: The pseudo-vertex whose broadcast entries hold the outputs' schemas in a snapshot.
SCHEMAS_VERTEX = "__schemas"
#: The pseudo-vertex whose broadcast entries hold the items in flight of unaligned snapshots.
IN_FLIGHT_VERTEX = "__in_flight"
#: The prefix of a processor's watermark entry (``"wm:i"``) in its vertex's entries.
WATERMARK_PREFIX = "wm:"
# TABLES_VERTEX, the pseudo-vertex of the table versions, is defined with the table joins
# (sparkjet.operators.table_join), which the runtime imports and not the other way round.


def _watermark_key(index: int) -> bytes:
    return f"{WATERMARK_PREFIX}{index}".encode()


# -- at a barrier ---------------------------------------------------------------------------


def open_writer(member, vertex: str, index: int, snapshot_id: int):
    """The store writer of processor ``index`` of ``vertex`` for snapshot ``snapshot_id``;
    the first writer of the execution also records the DAG's fingerprint."""
    m = member
    writer = m.topology.offset[vertex] + index
    if m.slot is not None:   # the members' storage: into the slot, fenced by it; no store
        w = slot_writer(m.config, m.slot_link, snapshot_id, m.execution_id, writer=writer,
                        replicate=m.replicate,
                        durable=m.config.durable_tier == "sync" or m.durable_copies)
    else:
        w = m.store.writer(snapshot_id, m.execution_id, writer=writer,
                           partition_count=m.config.partition_count,
                           codec=m.config.snapshot_codec)
    if writer == 0:
        w.write_broadcast_entries(PLAN_VERTEX, [b"dag"],
                                  [json.dumps(m.dag.fingerprint()).encode()])
    return w


def write_source(writer, vertex: str, index: int, state, watermarks: dict | None) -> None:
    """A source processor's reader ``state`` and, with event time, its ``watermarks``
    (:meth:`~sparkjet.runtime.watermarks.SourceWatermarks.state`)."""
    keys, values = [str(index).encode()], [json.dumps(state).encode()]
    if watermarks is not None:
        keys.append(_watermark_key(index))
        values.append(json.dumps(watermarks).encode())
    writer.write_broadcast_entries(vertex, keys, values)


def write_keyed(writer, vertex, index: int, op, watermark: int, partitions: list[int],
                buffers=None) -> None:
    """A keyed processor's operator state (``op``, of processor ``index`` of ``vertex``),
    and its ``watermark`` with the ``partitions`` it owns; ``buffers``: the processor's
    :class:`~sparkjet.snapshot.writer.SnapshotBuffers`, the state is copied and grouped
    into."""
    table = op.snapshot()
    if table is not None:
        if vertex.single:
            writer.write_broadcast_table(vertex.name, table)
        else:
            writer.write_table(vertex.name, table, key=op.state_key, buffers=buffers)
    shared = op.snapshot_broadcast() if index == 0 and not vertex.single else None
    if shared is not None:
        writer.write_broadcast_table(vertex.name, shared)
    mark = {"time": watermark, "partitions": partitions}
    writer.write_broadcast_entries(vertex.name, [_watermark_key(index)],
                                   [json.dumps(mark).encode()])


def write_prepared(writer, sink: str, instance: int, prepared) -> None:
    """What sink instance ``instance`` of ``sink`` prepared for this snapshot."""
    writer.write_broadcast_entries(sink, [str(instance).encode()],
                                   [json.dumps(prepared).encode()])


def write_tables(writer, vertex: str, index: int, versions: list[tuple[str, dict]]) -> None:
    """The table versions (join name, entry) processor ``index`` of ``vertex`` uses from
    this barrier on; the snapshot keeps the stored versions it names."""
    if not versions:
        return
    keys, values = [], []
    for name, entry in versions:
        writer.use_table_version(entry["version"])
        keys.append(f"{vertex}/{index}/{name}".encode())
        values.append(json.dumps(entry).encode())
    writer.write_broadcast_entries(TABLES_VERTEX, keys, values)


def write_schemas(writer, schemas: dict) -> None:
    """The outputs' schemas (output -> encoded schema) fixed so far."""
    if schemas:
        writer.write_broadcast_entries(SCHEMAS_VERTEX, [k.encode() for k in schemas],
                                       [v.encode() for v in schemas.values()])


def finish_barrier(processor, writer, snapshot_id: int, terminal: bool,
                   alignment_s: float | None = None) -> None:
    """What every processor does at barrier ``snapshot_id`` once its own state is in
    ``writer``: records its table versions, prepares its sinks' transactions, records its
    outputs' schemas, forwards the barrier (and after the terminal one ends its outputs),
    and acknowledges phase 1 to the coordinator with the manifest (and ``alignment_s``, how
    long a keyed processor's alignment took)."""
    schemas = forward_barrier(processor, writer, snapshot_id, terminal)
    acknowledge(processor, writer, snapshot_id, alignment_s, schemas)


def forward_barrier(processor, writer, snapshot_id: int, terminal: bool) -> dict:
    """:func:`finish_barrier` up to the barrier's forwarding; returns the schemas the
    acknowledgement carries. An unaligned snapshot acknowledges later (:func:`acknowledge`),
    once its items in flight are in ``writer`` too (:func:`write_in_flight`)."""
    outbox = processor.outbox
    write_tables(writer, processor.vertex.name, processor.index,
                 outbox.table_versions(snapshot_id))
    processor.prepare_sinks(writer, snapshot_id)
    schemas = outbox.schemas()
    write_schemas(writer, schemas)
    outbox.barrier(snapshot_id, terminal)
    if terminal:
        outbox.end()
    return schemas


def acknowledge(processor, writer, snapshot_id: int, alignment_s: float | None,
                schemas: dict) -> None:
    """Phase 1 of ``processor`` done: its manifest goes to the coordinator once the
    writer's files are durable (:meth:`~sparkjet.snapshot.writer.SnapshotWriter.finish`),
    on a thread of its own, while the processor goes on with its input (Flink's
    asynchronous phase): the fsyncs and, on Spark, the round trip to the driver are off
    its path. Nothing is committed before the acknowledgement, so nothing changes for
    exactly-once; a failure fails the member, as the processor's own would."""
    member = processor.member

    def finish_and_ack():
        try:
            member.ack(processor.label, snapshot_id, writer.finish(), alignment_s,
                       schemas=schemas)
        except BaseException as e:  # noqa: BLE001 - reported to the member, which ends the execution
            member.fail(e)

    threading.Thread(target=finish_and_ack, name="sparkjet-snapshot-ack", daemon=True).start()


def write_in_flight(writer, vertex: str, index: int, items: list, parallelism: int,
                    channels: int) -> None:
    """The items in flight of an unaligned snapshot of processor ``index`` of ``vertex``
    (:class:`~sparkjet.runtime.aligner.TimeoutAligner`): (channel, batch or watermark)
    pairs, in the order the processor took them, under :data:`IN_FLIGHT_VERTEX`: key
    ``"vertex/i"`` the JSON list of them (a watermark as its time and idle flag, a batch as
    a number ``k``) with the vertex's ``parallelism`` and ``channels``, and key
    ``"vertex/i/k"`` batch ``k`` as an Arrow IPC stream."""
    if not items:
        return
    listed, keys, values = [], [], []
    for channel, item in items:
        if isinstance(item, Watermark):
            listed.append([channel, "w", item.time, item.idle])
            continue
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, item.schema) as out:
            out.write_batch(item)
        listed.append([channel, "b", len(keys)])
        keys.append(f"{vertex}/{index}/{len(keys)}".encode())
        values.append(sink.getvalue().to_pybytes())
    keys.append(f"{vertex}/{index}".encode())
    values.append(json.dumps({"parallelism": parallelism, "channels": channels,
                              "items": listed}).encode())
    writer.write_broadcast_entries(IN_FLIGHT_VERTEX, keys, values)


# -- at restore -----------------------------------------------------------------------------


def read_fingerprint(store, point: StartPoint) -> dict | None:
    """The DAG fingerprint recorded in ``point`` (None: a snapshot from before them)."""
    try:
        kept = store.recorded_plan(None if point.export else point.snapshot_id,
                                   name=point.export)
        if kept is not None:        # a record of the members' storage keeps it
            return json.loads(kept)
        entries = store.restore(PLAN_VERTEX, [], snapshot_id=None if point.export else
                                point.snapshot_id, name=point.export).broadcast_entries
    except SnapshotNotFoundError:
        return None
    if entries is None:
        return None
    for key, value in zip(entries[0].to_pylist(), entries[1].to_pylist()):
        if key == b"dag":
            return json.loads(value)
    return None


def restore_processors(member, store, point: StartPoint, plan: RestorePlan) -> None:
    """Hands each of ``member``'s processors its share of snapshot ``point`` (read from
    ``store``, restored as ``plan`` says): source state and watermarks, operator state,
    watermark and floors, table versions, outputs' schemas, and the prepared transactions
    of the sink instances it runs."""
    dag, t = member.dag, member.topology
    at = {"snapshot_id": None, "name": point.export} if point.export else \
        {"snapshot_id": point.snapshot_id}
    tables = {}
    if dag.table_joins and not point.initial:
        # (another job's table versions are in its own directory: an initial
        # snapshot's joins load their tables afresh)
        try:
            tables = entries_json(store.restore(TABLES_VERTEX, [], **at).broadcast_entries)
        except SnapshotNotFoundError:
            pass    # a snapshot from before table joins: they load their tables afresh
    schemas = {}
    if plan.same and not point.initial:
        # a changed pipeline's outputs may have other schemas: they are fixed afresh
        try:
            schemas = {k: decode_schema(v.decode()) for k, v in
                       _raw_entries(store.restore(SCHEMAS_VERTEX, [], **at)
                                    .broadcast_entries).items()}
        except SnapshotNotFoundError:
            schemas = {}    # a snapshot from before schemas were recorded: fixed afresh
    in_flight = None        # the in-flight items of unaligned snapshots, read when needed
    states = _operator_states(member, store, plan, at)
    sinks_prepared: dict[str, dict] = {}
    for name in dag.sinks:
        old = plan.sinks.get(name)
        sinks_prepared[name] = {} if old is None else entries_json(
            store.restore(old, [], **at).broadcast_entries)
    for p in member.processors:
        v = p.vertex
        old = plan.vertices.get(v.name)
        p.restored_schemas = schemas
        if old is None:
            pass        # a new vertex: it starts empty
        elif v.kind == SOURCE:
            p.restored_tables = _tables_of(tables, old, p.index)
            entries = entries_json(store.restore(old, [], **at).broadcast_entries)
            p.restored_source_state = merge_states(
                [s for k, s in entries.items() if not k.startswith(WATERMARK_PREFIX)])
            p.restored_times = _max_times([s for k, s in entries.items()
                                           if k.startswith(WATERMARK_PREFIX)])
        else:
            p.restored_tables = _tables_of(tables, old, p.index)
            state = states[p.label]
            p.restored_table = conform_state(
                v, state.table if not v.single else state.broadcast_table)
            p.restored_broadcast = None if v.single else state.broadcast_table
            marks = [s for k, s in entries_json(state.broadcast_entries).items()
                     if k.startswith(WATERMARK_PREFIX)]
            p.restored_watermark, p.restored_floors = PartitionFloors.from_saved(
                marks, t.partitions_of(v.name, p.index), member.config.partition_count,
                None if v.single else v.stage.key)
            if in_flight is None:
                in_flight = _in_flight_entries(store, at)
            p.restored_in_flight = in_flight_of(in_flight, old, p, t)
        # An old sink instance's prepared transactions go to instance (old index %
        # total), the rule by which sinks find the leftovers they own after a rescale.
        for sink in p.sink_names:
            total = t.sink_instances[sink]
            mine = t.sink_offset[sink][v.name] + p.index
            p.prepared[sink] = merge_states([s for i, s in sinks_prepared[sink].items()
                                             if int(i) % total == mine])


def _operator_states(member, store, plan: RestorePlan, at: dict) -> dict:
    """Each operator processor's share of the snapshot (``store.restore``), by label: read
    side by side, a thread per processor up to the CPUs, when the member runs several
    (decompression holds no GIL, so one share decodes while another's Python runs); the
    first processor's error, in their order, is raised."""
    t = member.topology
    wanted = [(p.label, plan.vertices[p.vertex.name], t.partitions_of(p.vertex.name, p.index))
              for p in member.processors
              if plan.vertices.get(p.vertex.name) is not None and p.vertex.kind != SOURCE]
    workers = min(len(wanted), os.cpu_count() or 1)
    if workers <= 1:
        return {label: store.restore(old, parts, **at) for label, old, parts in wanted}
    with concurrent.futures.ThreadPoolExecutor(workers, "sparkjet-restore") as pool:
        futures = [(label, pool.submit(store.restore, old, parts, **at))
                   for label, old, parts in wanted]
        return {label: f.result() for label, f in futures}


def _in_flight_entries(store, at: dict) -> dict:
    """The raw entries of :data:`IN_FLIGHT_VERTEX` in the snapshot (none: it was aligned)."""
    try:
        return _raw_entries(store.restore(IN_FLIGHT_VERTEX, [], **at).broadcast_entries)
    except SnapshotNotFoundError:
        return {}


def in_flight_of(entries: dict, old: str, processor, topology) -> list:
    """The (channel, item) pairs in flight that processor ``processor`` (of the vertex
    the snapshot called ``old``) replays before new input. Refused
    (:class:`~sparkjet.errors.InFlightRescaleError`) when the vertex's parallelism or
    channel count changed since: each channel's items must go back to where they were
    taken, in order, which another layout has no place for."""
    v = processor.vertex
    parallelism, channels = topology.parallelism[v.name], topology.channels[v.name]
    # Every processor of the vertex checks every processor's entry, not only its own: at a
    # smaller parallelism the processors that held items may have no successor to notice.
    for key, raw in entries.items():
        index = key[len(old) + 1:]
        if not (key.startswith(f"{old}/") and index.isdigit()):
            continue
        meta = json.loads(raw)
        if (meta["parallelism"], meta["channels"]) != (parallelism, channels):
            raise InFlightRescaleError(
                f"{v.name}: the snapshot is unaligned (JobConfig.alignment_timeout) and "
                f"holds {len(meta['items'])} items in flight of processor {index}, taken at "
                f"parallelism {meta['parallelism']} with {meta['channels']} input channels; "
                f"this execution has parallelism {parallelism} with {channels}. Restore it at "
                f"the same parallelism, then stop the job (Job.stop or suspend take an "
                f"aligned snapshot) and rescale from that one")
    meta = entries.get(f"{old}/{processor.index}")
    if meta is None:
        return []
    meta = json.loads(meta)
    items = []
    for channel, kind, *rest in meta["items"]:
        if kind == "w":
            items.append((channel, Watermark(rest[0], rest[1])))
        else:
            data = entries[f"{old}/{processor.index}/{rest[0]}"]
            items.append((channel, pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()))
    return items


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


def _tables_of(entries: dict, vertex: str, index: int) -> dict:
    """The table versions processor ``index`` of ``vertex`` recorded (join name -> entry).
    After a rescale a processor the snapshot did not have takes those of the vertex's
    lowest-numbered processor."""
    mine: dict = {}
    for key in sorted(entries, key=lambda k: (int(k.split("/")[1]), k)):
        v, i, name = key.split("/", 2)
        if v != vertex:
            continue
        if int(i) == index:
            mine[name] = entries[key]
        else:
            mine.setdefault(name, entries[key])
    return mine


def _max_times(states: list) -> dict:
    out: dict = {}
    for s in states:
        for p, t in (s or {}).items():
            out[p] = t if p not in out else max(out[p], t)
    return out


def _raw_entries(entries) -> dict:
    """Broadcast entries as a dict of bytes (str key -> bytes value)."""
    if entries is None:
        return {}
    keys, values = entries
    return {k.decode(): v for k, v in zip(keys.to_pylist(), values.to_pylist())}


def entries_json(entries) -> dict:
    """Broadcast entries (processor index -> JSON) as a dict."""
    if entries is None:
        return {}
    keys, values = entries
    return {k.decode(): json.loads(v) for k, v in zip(keys.to_pylist(), values.to_pylist())}


__all__ = ["IN_FLIGHT_VERTEX", "PLAN_VERTEX", "SCHEMAS_VERTEX", "TABLES_VERTEX",
           "WATERMARK_PREFIX", "acknowledge", "entries_json", "finish_barrier",
           "forward_barrier", "in_flight_of", "merge_states", "open_writer",
           "read_fingerprint", "restore_processors", "write_in_flight", "write_keyed",
           "write_prepared", "write_schemas", "write_source", "write_tables"]
