"""The DAG a pipeline runs as (Jet's DAG of vertices and edges).

A **vertex** is a source, an aggregation (rolling or windowed) or a keyed stage that brings
its own operator (keyed state, deduplication, interval join: an ``OperatorStage``): each runs as
``parallelism`` processors spread over the members. Stateless stages never get a vertex of
their own: they are fused into the vertex before them (Jet's local edge), and so are sinks.
A vertex's output therefore is a set of **paths**: the stateless stages a batch goes
through, and where it ends: a sink, or an **edge** into another vertex. An edge into a
keyed aggregation is *partitioned* (each row goes to the processor owning the Hazelcast
partition of its key); into an aggregation without a key it is *all-to-one* (that vertex
has one processor); into an input a stage declares broadcast (``map_state(broadcast=...)``)
it is *broadcast* (every row to every processor). Barriers and watermarks flow in band on
every edge.

Names are derived from the DAG's shape ("source", "source.2", "aggregate", "window",
"state", "dedup", "sink", "sink.2", ...), so the same pipeline gets the same names in every run: they name
the state in snapshots. :meth:`Dag.fingerprint` describes the shape; a snapshot records it,
and :mod:`sparkjet.runtime.restore` checks a changed pipeline against it vertex by vertex.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sparkjet.connectors.base import Sink, Source
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.base import OperatorStage
from sparkjet.operators.table_join import TableJoinStage
from sparkjet.operators.windows.definitions import WINDOW_TIME
from sparkjet.pipeline.stages import (
    STATELESS,
    Node,
    SinkStage,
    SourceStage,
    TimestampsStage,
    UnionStage,
)

#: Kinds of vertex: a source, and the kinds of the rolling aggregation and the window
#: stages (the others are named by their stage's ``kind``).
SOURCE, AGGREGATE, WINDOW = "source", "aggregate", "window"


@dataclass(frozen=True)
class Path:
    """From a vertex's output: ``stages`` (stateless, applied in order), then either a sink
    (``sink``: its name) or an edge into vertex ``target``."""

    stages: tuple
    sink: str | None = None
    target: str | None = None
    timed: bool = False                  # from a source: it went through with_timestamps()
    ordinal: int = 0                     # which input of the target it feeds


@dataclass
class Vertex:
    name: str
    kind: str                            # SOURCE or its OperatorStage's kind
    stage: object                        # SourceStage or an OperatorStage
    inputs: list[str] = field(default_factory=list)   # upstream vertices, channel order
    paths: list[Path] = field(default_factory=list)
    timestamps: TimestampsStage | None = None          # sources: their event-time policy
    time_column: str | None = None       # windows: the event-time column of their input
    #: bad records (a source: undecodable; a keyed stage: null keys): "fail", "skip", a
    #: dead-letter Sink, or None for the job's ``on_error``
    on_error: object = None

    @property
    def arity(self) -> int:
        """How many input streams the vertex's stage takes (ordinals)."""
        return getattr(self.stage, "arity", 1)

    @property
    def broadcast_inputs(self) -> tuple:
        """The ordinals of its inputs that reach every processor (broadcast edges)."""
        return tuple(getattr(self.stage, "broadcast_inputs", ()))

    def key_of(self, ordinal: int):
        """The key its input ``ordinal`` is partitioned by."""
        return self.stage.key_of(ordinal)

    @property
    def needs_event_time(self) -> bool:
        return getattr(self.stage, "event_time", False)

    @property
    def output_time(self) -> str | None:
        """The event-time column of its output (None: its output has no event time)."""
        if getattr(self.stage, "keeps_time", False):
            return self.time_column
        return getattr(self.stage, "output_time", None)

    @property
    def keys(self) -> tuple[str, ...]:
        return getattr(self.stage, "keys", ())

    @property
    def single(self) -> bool:
        """True for an aggregation without a key: one processor, all-to-one edges."""
        return self.kind != SOURCE and not self.keys

    @property
    def source(self) -> Source:
        return self.stage.source

    @property
    def targets(self) -> list[str]:
        """The vertices this one feeds, each once, in path order."""
        out: list[str] = []
        for p in self.paths:
            if p.target is not None and p.target not in out:
                out.append(p.target)
        return out


@dataclass
class SinkSpec:
    name: str
    sink: Sink
    feeders: list[str]                   # the vertices whose processors write to it
    late: bool = False                   # the late-event side output of a window
    dead_letters: bool = False           # the failed rows of a stage's on_error
    on_error: object = None              # the rows this sink refuses (as Vertex.on_error)


@dataclass
class Dag:
    vertices: dict[str, Vertex]          # topological order
    sinks: dict[str, SinkSpec]
    #: join_table stages by name ("table-join", "table-join.2", ...): their versions are
    #: recorded under these names in snapshots
    table_joins: dict[str, TableJoinStage] = field(default_factory=dict)

    def dead_letter_sink(self, policy: Sink) -> str:
        """The name of the sink of dead letters ``policy`` (an ``on_error`` Sink) is."""
        return next(name for name, s in self.sinks.items()
                    if s.dead_letters and s.sink is policy)

    def table_join_name(self, stage: TableJoinStage) -> str:
        return next(name for name, s in self.table_joins.items() if s is stage)

    @property
    def sources(self) -> list[Vertex]:
        return [v for v in self.vertices.values() if v.kind == SOURCE]

    @property
    def keyed(self) -> list[Vertex]:
        return [v for v in self.vertices.values() if v.kind != SOURCE]

    def fingerprint(self) -> dict:
        """The shape that names the state in a snapshot: vertices, keys, aggregations,
        windows, and sinks with what feeds them."""
        vertices = []
        for v in self.vertices.values():
            d = {"name": v.name, "kind": v.kind, "inputs": v.inputs}
            if v.kind == SOURCE:
                d["source"] = type(v.source).__name__
                d["partitions"] = v.source.partition_count()
            else:
                d.update(v.stage.fingerprint())
            vertices.append(d)
        sinks = [{"name": s.name, "sink": type(s.sink).__name__, "feeders": s.feeders}
                 for s in self.sinks.values()]
        out = {"format": 1, "vertices": vertices, "sinks": sinks}
        if self.table_joins:
            out["table_joins"] = [{"name": name, **s.describe()}
                                  for name, s in self.table_joins.items()]
        return out

    def legacy_shape(self) -> bool:
        """True for the shape every snapshot before DAG fingerprints had: one source,
        at most one rolling aggregation over one key, one sink."""
        keyed = self.keyed
        return (len(self.sources) == 1 and len(self.sinks) == 1 and len(keyed) <= 1
                and all(v.kind == AGGREGATE and len(v.keys) == 1 for v in keyed))


def _check_new_sink(sink: Sink, sinks: dict) -> None:
    for spec in sinks.values():
        if spec.sink is sink:
            raise InvalidArgumentError(
                f"{sink!r} ends two branches of the pipeline; its writers would collide. Merge "
                f"the branches with union() before write_to(), or give each its own sink")


_STATELESS = (*STATELESS, TableJoinStage)


def _add_feeders(spec: SinkSpec, feeders: list[str]) -> None:
    for f in feeders:
        if f not in spec.feeders:
            spec.feeders.append(f)


def compile_dag(ends: tuple[Node, ...]) -> Dag:
    """The DAG of the pipelines ending in the sink nodes ``ends``."""
    order: list[Node] = []
    seen: set[int] = set()

    def visit(node: Node, path: tuple = ()) -> None:
        if id(node) in path:
            raise InvalidArgumentError("the pipeline has a cycle")
        if id(node) in seen:
            return
        for i in node.inputs:
            visit(i, (*path, id(node)))
        seen.add(id(node))
        order.append(node)

    for end in ends:
        visit(end)
    consumers: dict[int, list[Node]] = {id(n): [] for n in order}
    for n in order:
        for i in n.inputs:
            consumers[id(i)].append(n)

    counters: dict[str, int] = {}

    def name_for(kind: str) -> str:
        counters[kind] = counters.get(kind, 0) + 1
        return kind if counters[kind] == 1 else f"{kind}.{counters[kind]}"

    vertex_of: dict[int, Vertex] = {}
    sink_of: dict[int, SinkSpec] = {}
    vertices: dict[str, Vertex] = {}
    sinks: dict[str, SinkSpec] = {}
    table_joins: dict[str, TableJoinStage] = {}
    for n in order:
        s = n.stage
        if isinstance(s, TableJoinStage):
            table_joins[name_for("table-join")] = s
            continue
        if isinstance(s, SourceStage):
            kind = SOURCE
        elif isinstance(s, OperatorStage):
            kind = s.kind
            if len(n.inputs) != s.arity:
                raise InvalidArgumentError(f"a {kind} stage takes {s.arity} input streams, "
                                           f"got {len(n.inputs)}")
            if len(set(map(id, n.inputs))) != len(n.inputs):
                raise InvalidArgumentError(f"a {kind} stage of a stream with itself: branch it "
                                           f"through a stateless step (filter, map_batches) first")
        elif isinstance(s, SinkStage):
            _check_new_sink(s.sink, sinks)
            spec = SinkSpec(name_for("sink"), s.sink, [], on_error=n.on_error)
            sink_of[id(n)] = sinks[spec.name] = spec
            continue
        else:
            continue
        v = Vertex(name_for(kind), kind, s, on_error=n.on_error)
        vertex_of[id(n)] = vertices[v.name] = v
        if getattr(s, "late", None) is not None:
            _check_new_sink(s.late, sinks)
            spec = SinkSpec(name_for("sink"), s.late, [v.name], late=True)
            sinks[spec.name] = spec
    # The dead-letter sinks of on_error policies (one sink may take the dead letters of
    # several stages: they share one schema). A stateless stage's is fed by the vertices
    # whose paths pass it; a source's by its vertex; a keyed stage's by the vertices feeding
    # it (their outputs check its keys); a sink's by the sink's feeders.
    letters: dict[int, SinkSpec] = {}       # id(Sink) -> its spec
    dead_letters: dict[int, SinkSpec] = {}  # id(stateless stage) -> the spec of its policy
    for n in order:
        s = n.stage
        policy = n.on_error if n.on_error is not None else getattr(s, "on_error", None)
        if isinstance(policy, Sink):
            if id(policy) not in letters:
                _check_new_sink(policy, sinks)
                spec = SinkSpec(name_for("sink"), policy, [], dead_letters=True)
                letters[id(policy)] = sinks[spec.name] = spec
            if isinstance(s, _STATELESS):
                dead_letters[id(s)] = letters[id(policy)]

    # Paths: from each vertex through stateless nodes to sinks and other vertices.
    for n in order:
        v = vertex_of.get(id(n))
        if v is None:
            continue
        stack = [(c, (), False, n) for c in reversed(consumers[id(n)])]
        while stack:
            node, stages, timed, came_from = stack.pop()
            s = node.stage
            if id(node) in sink_of:
                spec = sink_of[id(node)]
                v.paths.append(Path(stages, sink=spec.name, timed=timed))
                if v.name not in spec.feeders:
                    spec.feeders.append(v.name)
            elif id(node) in vertex_of:
                w = vertex_of[id(node)]
                ordinal = next(i for i, x in enumerate(node.inputs) if x is came_from)
                v.paths.append(Path(stages, target=w.name, timed=timed, ordinal=ordinal))
                if v.name not in w.inputs:
                    w.inputs.append(v.name)
            elif isinstance(s, _STATELESS):
                spec = dead_letters.get(id(s))
                if spec is not None and v.name not in spec.feeders:
                    spec.feeders.append(v.name)
                if isinstance(s, TimestampsStage):
                    if v.kind != SOURCE:
                        raise InvalidArgumentError(
                            "with_timestamps() must follow read_from(...) (stateless stages may "
                            "come between): event time starts at the source")
                    if v.timestamps is not None and v.timestamps != s:
                        raise InvalidArgumentError(
                            f"source vertex {v.name!r} has two different with_timestamps(); "
                            f"give each source one")
                    v.timestamps = s
                    timed = True
                # with_timestamps stays in the path: there the source observes event time
                nxt = stages if isinstance(s, UnionStage) else (*stages, s)
                for c in reversed(consumers[id(node)]):
                    stack.append((c, nxt, timed, node))
            else:
                raise InvalidArgumentError(f"unknown pipeline stage {s!r}")

    for v in vertices.values():
        if isinstance(v.on_error, Sink):
            feeders = [v.name] if v.kind == SOURCE else v.inputs
            _add_feeders(letters[id(v.on_error)], feeders)
    for spec in list(sinks.values()):
        if isinstance(spec.on_error, Sink):
            _add_feeders(letters[id(spec.on_error)], spec.feeders)

    # Event time: every path into a window (or a stage that needs it) must carry it; other
    # keyed stages get it (for their timers) when every input has it in one column.
    for w in vertices.values():
        if w.kind == SOURCE:
            continue
        what = "window()" if w.kind == WINDOW else f"a {w.kind} stage"
        columns, missing = set(), None
        for u_name in w.inputs:
            u = vertices[u_name]
            for p in u.paths:
                if p.target != w.name:
                    continue
                # A broadcast input must carry watermarks, but its rows' times are not read
                # (its event-time column may have another name).
                into = None if p.ordinal in w.broadcast_inputs else columns
                if u.kind == SOURCE and p.timed:
                    if into is not None:
                        into.add(u.timestamps.column)
                elif u.kind != SOURCE and u.output_time is not None:
                    if into is not None:
                        into.add(u.output_time)
                elif u.kind == SOURCE:
                    missing = (f"{w.name}: {what} needs event time on every input: call "
                               f".with_timestamps(column, max_lag=...) after read_from("
                               f"{u.source!r})")
                else:
                    missing = (f"{w.name}: {what} cannot follow {u.name} ({u.kind}): its "
                               f"output has no event time")
        if missing is None and len(columns) == 1:
            w.time_column = columns.pop()
        elif w.needs_event_time:
            raise InvalidArgumentError(missing or (
                f"{w.name}: the merged streams' event times are in different columns "
                f"{sorted(columns)}; rename them to one"))
    return Dag(vertices, sinks, table_joins)


__all__ = ["AGGREGATE", "SOURCE", "WINDOW", "WINDOW_TIME", "Dag", "Path", "SinkSpec", "Vertex",
           "compile_dag"]
