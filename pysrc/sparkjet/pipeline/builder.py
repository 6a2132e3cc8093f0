"""Pipelines: sources, stateless stages, keyed and windowed aggregations, and sinks, as a DAG.

>>> from sparkjet.sources import GeneratorSource                     # doctest: +SKIP
>>> p = (Pipeline().read_from(GeneratorSource(total=10_000_000))
...      .filter(pc.field("value") > 0.5)
...      .group_by("key").aggregate(count="count", total=("sum", "value"))
...      .write_to(sink))

Every step returns a new pipeline and leaves the one it was called on as it was, so a
stream may feed several steps (a branch):

>>> events = Pipeline().read_from(source).with_timestamps("ts", max_lag=1_000)  # doctest: +SKIP
>>> per_minute = (events.group_by("user").window(tumbling(60_000))
...               .aggregate(n="count").write_to(counts_sink))
>>> big = events.filter(pc.field("amount") > 1000).write_to(alerts_sink)
>>> job = Job(Pipeline.all(per_minute, big))

and several streams of one schema may be merged (:meth:`Pipeline.union`). A pipeline
compiles (:meth:`Pipeline.plan`) into a :class:`~sparkjet.pipeline.dag.Dag`: one vertex per source
and per keyed stage (aggregations, windows, keyed state, deduplication, interval joins);
stateless stages (``join_table`` among them) and sinks fused into the vertex before them
(Jet's local edges); partitioned edges (by the Hazelcast partition of the key) into keyed
stages, all-to-one edges into aggregations without a key, and broadcast edges into a
``map_state(broadcast=...)`` input.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.connectors.base import Sink, Source
from sparkjet.errors import InvalidArgumentError
from sparkjet.operators.dedup import DeduplicateStage
from sparkjet.operators.interval_join import interval_join_stage
from sparkjet.operators.rolling import AggregateStage, parse_aggregations
from sparkjet.operators.stateful import PER_ROW_STATE, keyed_state_stage, per_row
from sparkjet.operators.table_join import (
    TableJoinStage,
    as_reference_table,
    check_how,
    parse_on,
)
from sparkjet.operators.time import duration, seconds
from sparkjet.operators.values import check_overflow
from sparkjet.operators.windows.definitions import WindowDefinition, parse_window_aggregations
from sparkjet.operators.windows.operator import WindowStage
from sparkjet.pipeline.dag import compile_dag
from sparkjet.pipeline.stages import (
    FilterStage,
    MapStage,
    Node,
    SinkStage,
    SourceStage,
    TimestampsStage,
    UnionStage,
    event_time_of,
)


@dataclass(frozen=True)
class Pipeline:
    """A stream under construction, or pipelines that end in sinks, ready for a job."""

    _head: Node | None = None
    _ends: tuple[Node, ...] = field(default=())

    # -- sources and sinks -------------------------------------------------------------

    def read_from(self, source: Source, *, on_error=None) -> Pipeline:
        """Starts a stream from ``source``.

        :param on_error: what a record the source cannot decode (a Kafka value that is
            not UTF-8 or does not fit the JSON schema, a file's malformed line, a Redis
            entry without its fields) does: ``"fail"``, ``"skip"`` or a dead-letter Sink;
            None (the default): ``JobConfig.on_error``. See :mod:`sparkjet.connectors.dead_letters`.
        """
        if not isinstance(source, Source):
            raise InvalidArgumentError(f"read_from() takes a sparkjet Source, got {type(source).__name__}")
        if self._head is not None or self._ends:
            raise InvalidArgumentError("this pipeline already has a source; start another with "
                                       "Pipeline().read_from(...) and merge them with union()")
        return Pipeline(Node(SourceStage(source), on_error=_on_error(on_error)))

    def write_to(self, sink: Sink, *, on_error=None) -> Pipeline:
        """Ends the stream in ``sink``; the result can be run by a Job or combined with
        other ended pipelines by :meth:`Pipeline.all`. ``on_error``: what the rows the
        sink's system would refuse (which the sink finds before writing, such as a NUL
        character in PostgreSQL text) do: ``"fail"``, ``"skip"``, a dead-letter Sink, or
        None for ``JobConfig.on_error``."""
        if not isinstance(sink, Sink):
            raise InvalidArgumentError(f"write_to() takes a sparkjet Sink, got {type(sink).__name__}")
        head = self._stream("write_to")
        return Pipeline(None, (Node(SinkStage(sink), (head,), _on_error(on_error)),))

    @staticmethod
    def all(*pipelines: Pipeline) -> Pipeline:
        """One pipeline that runs every given pipeline (each ending in a sink); the stages
        they share run once."""
        ends: list[Node] = []
        for p in pipelines:
            if not isinstance(p, Pipeline) or not p._ends or p._head is not None:
                raise InvalidArgumentError("Pipeline.all() takes pipelines that end in write_to(...)")
            ends.extend(e for e in p._ends if e not in ends)
        if not ends:
            raise InvalidArgumentError("Pipeline.all() needs at least one pipeline")
        return Pipeline(None, tuple(ends))

    def union(self, *others: Pipeline) -> Pipeline:
        """Merges this stream with ``others``, which must have the same schema."""
        heads = [self._stream("union")]
        for o in others:
            if not isinstance(o, Pipeline):
                raise InvalidArgumentError(f"union() takes pipelines, got {type(o).__name__}")
            heads.append(o._stream("union"))
        if len(heads) < 2:
            raise InvalidArgumentError("union() needs at least one other stream")
        if len(set(map(id, heads))) != len(heads):
            raise InvalidArgumentError("union() of a stream with itself would duplicate every row")
        return Pipeline(Node(UnionStage(), tuple(heads)))

    # -- stateless stages --------------------------------------------------------------

    def map_batches(self, fn: Callable[[pa.RecordBatch], pa.RecordBatch], *,
                    on_error=None) -> Pipeline:
        """Applies `fn` to every batch (it must return a RecordBatch or Table). It must be
        deterministic for exactly-once output: a replay calls it again.

        :param on_error: what a batch on which `fn` raises does. ``"fail"`` fails the job;
            None (the default) does what ``JobConfig.on_error`` says ("fail" unless set).
            ``"skip"`` splits the batch until the rows `fn` fails on are
            found alone, and drops them (counted in ``JobResult.skipped_events``); a
            :class:`~sparkjet.connectors.base.Sink` receives them instead, as dead letters
            (the row as JSON and the error: :mod:`sparkjet.connectors.dead_letters`;
            ``JobResult.dead_letters``), under the job's guarantee. A batch on which every
            row fails is not a bad record but a broken stage: the job fails.
        """
        if not callable(fn):
            raise InvalidArgumentError("map_batches() takes a function of a RecordBatch")
        return self._add(MapStage(fn, _on_error(on_error)))

    def filter(self, expression: pc.Expression, *, on_error=None) -> Pipeline:
        """Keeps the rows where a pyarrow compute expression is true (``on_error``: as
        for :meth:`map_batches`)."""
        if not isinstance(expression, pc.Expression):
            raise InvalidArgumentError("filter() takes a pyarrow.compute expression, e.g. pc.field('v') > 0")
        return self._add(FilterStage(expression, _on_error(on_error)))

    def join_table(self, table, *, on, how: str = "inner", prefix: str = "") -> Pipeline:
        """Enriches each event from a reference table (Jet's ``hashJoin``): ``table`` is a
        :class:`~sparkjet.operators.table_join.ReferenceTable` (or a pyarrow Table, or a file path);
        ``on`` a column name, a tuple of names, or ``{"stream_col": "table_col"}``.

        ``how="inner"``: one row per event and matching table row (a key the table holds
        twice gives two rows; an event without a match, or with a null key, none).
        ``how="left"``: also one row per unmatched event, with null table columns. The
        output has the event's columns, then the table's other columns (``prefix`` +
        name); a name on both sides is an error unless a prefix tells them apart.

        Stateless, it runs fused in the vertex before it, and every processor holds the
        whole table. Its version changes only at snapshot barriers, and snapshots record
        it: a restart replays with the version recorded (see :mod:`sparkjet.operators.table_join`).
        """
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"join_table(prefix=...) takes a string, got {prefix!r}")
        stream_keys, table_keys = parse_on(on)
        return self._add(TableJoinStage(as_reference_table(table), stream_keys, table_keys,
                                        check_how(how), prefix))

    def with_timestamps(self, column: str, *, max_lag=0,
                        idle_timeout: float | datetime.timedelta = 60.0,
                        unit: str | None = None) -> Pipeline:
        """Gives the stream event time: ``column`` (an integer or timestamp column) holds
        each row's time. Watermarks trail the greatest time seen in each source partition
        by ``max_lag`` (in the column's unit, or a ``timedelta`` for timestamp columns);
        a source partition silent for ``idle_timeout`` seconds stops holding them back.
        ``unit`` ("s", "ms", "us" or "ns") declares what an integer column counts since the
        epoch, so that the wall-clock metrics (latency of a ``ts`` column, source and
        watermark lag) can read it; without it an integer column has no wall time and
        reports none (a timestamp column carries its unit: ``unit`` must match it).
        It must follow ``read_from`` (stateless stages may come between)."""
        if not isinstance(column, str):
            raise InvalidArgumentError(f"with_timestamps() takes a column name, got {column!r}")
        if unit is not None and unit not in ("s", "ms", "us", "ns"):
            raise InvalidArgumentError(f"with_timestamps() unit must be one of 's', 'ms', 'us', "
                                       f"'ns' or None, got {unit!r}")
        lag = duration("max_lag", max_lag, allow_zero=True)
        return self._add(TimestampsStage(column, lag, seconds("idle_timeout", idle_timeout),
                                         unit))

    # -- keyed stages ------------------------------------------------------------------

    def group_by(self, *keys: str) -> GroupBy:
        """Groups by one or several key columns (integer, string or binary): then
        ``.aggregate(...)`` (rolling) or ``.window(...).aggregate(...)``."""
        if len(keys) == 1 and isinstance(keys[0], (list, tuple)):
            keys = tuple(keys[0])
        if not keys or not all(isinstance(k, str) for k in keys):
            raise InvalidArgumentError(f"group_by() takes one or more column names, got {keys!r}")
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError(f"group_by() names a column twice: {keys!r}")
        self._stream("group_by")
        return GroupBy(self, tuple(keys))

    def deduplicate(self, *keys: str, within, late_events: Sink | None = None,
                    on_error=None) -> Pipeline:
        """Passes the first event of each key and drops the later ones within ``within``
        of event time (an int in the time column's unit, or a timedelta) after it
        (:mod:`sparkjet.operators.dedup`). Events behind the watermark cannot be checked: they are
        counted as late and go to ``late_events`` if given. Needs ``with_timestamps``.
        ``on_error``: what rows with a null key do (as for :meth:`GroupBy.aggregate`)."""
        if len(keys) == 1 and isinstance(keys[0], (list, tuple)):
            keys = tuple(keys[0])
        if not keys or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
            raise InvalidArgumentError(f"deduplicate() takes one or more distinct column names, "
                                       f"got {keys!r}")
        if late_events is not None and not isinstance(late_events, Sink):
            raise InvalidArgumentError(f"late_events takes a sparkjet Sink, got "
                                       f"{type(late_events).__name__}")
        within = duration("within", within, allow_zero=False)
        return self._add(DeduplicateStage(tuple(keys), within, late_events), on_error)

    def window(self, window) -> Windowed:
        """A windowed aggregation over the whole stream (no key: it runs on one processor)."""
        self._stream("window")
        return Windowed(self, (), _check_window(window))

    def join_interval(self, other: Pipeline, *, on, between, how: str = "inner",
                      right_suffix: str = "_right", on_error=None) -> Pipeline:
        """Joins this stream (left) with ``other`` (right) by key and event time: a left
        row at ``t`` meets every right row of an equal key at ``s`` with ``t + lower <= s
        <= t + upper`` (``between=(lower, upper)``, inclusive; ints in the time column's
        unit, or timedeltas). Both streams need event time in a column of one name.

        ``on``: a column name, a tuple of names, or ``{left column: right column}``.
        ``how="left"`` also emits each left row that met no right row, with null right
        columns, once the watermark passes ``t + upper``. The output has the left columns,
        then the right ones (less a key named like its left key); a right name the left
        already has gets ``right_suffix``. Its event time is the left row's.
        See :mod:`sparkjet.operators.interval_join`. ``on_error``: what rows of either
        side with a null key do (as for :meth:`GroupBy.aggregate`).

        >>> clicks.join_interval(impressions, on="ad", between=(-600_000, 0))  # doctest: +SKIP
        """
        if not isinstance(other, Pipeline):
            raise InvalidArgumentError(f"join_interval() takes a pipeline, got {type(other).__name__}")
        left, right = self._stream("join_interval"), other._stream("join_interval")
        stage = interval_join_stage(on, between, how, right_suffix, same_input=left is right,
                                    times=(event_time_of(left), event_time_of(right)))
        return Pipeline(Node(stage, (left, right), _on_error(on_error)))

    # -- compiling ---------------------------------------------------------------------

    def plan(self):
        """The DAG this pipeline runs as (:class:`sparkjet.pipeline.dag.Dag`)."""
        if not self._ends:
            raise InvalidArgumentError("a pipeline needs read_from(source) and write_to(sink)")
        return compile_dag(self._ends)

    # -- helpers -----------------------------------------------------------------------

    def _stream(self, what: str) -> Node:
        if self._head is None:
            if self._ends:
                raise InvalidArgumentError("this pipeline already ends in a sink")
            raise InvalidArgumentError(f"call read_from(source) before {what}()")
        return self._head

    def _add(self, stage, on_error=None) -> Pipeline:
        head = self._stream(type(stage).__name__)
        return Pipeline(Node(stage, (head,), _on_error(on_error)))


@dataclass(frozen=True)
class GroupBy:
    pipeline: Pipeline
    keys: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.keys[0]

    def aggregate(self, *, overflow: str = "fail", on_error=None, **aggregations) -> Pipeline:
        """Rolling aggregation emitting, per batch, the updated aggregates of the keys it
        touched: ``aggregate(n="count", total=("sum", "v"), avg=("mean", "v"))``.
        Operations: count, sum, min, max, mean, first, last. An integer column's sum is
        exact int64; ``overflow`` says what a sum past int64 does: ``"fail"`` (the job fails
        naming the stage, column and key) or ``"decimal"`` (every integer sum of the stage
        is a decimal128(38, 0)). min, max, first and last keep the type of integer,
        timestamp and duration columns.

        :param on_error: what a row whose key is null does (here and in every keyed
            stage: windows, ``map_state``, ``deduplicate``, ``join_interval``):
            ``"fail"`` fails the job with :class:`~sparkjet.errors.NullKeyError` naming
            the stage, the column and the row; ``"skip"`` drops it (counted in
            ``skipped_events``); a Sink gets it as a dead letter
            (:mod:`sparkjet.connectors.dead_letters`); None: ``JobConfig.on_error``."""
        parse_aggregations(aggregations)
        check_overflow(overflow)
        return self.pipeline._add(AggregateStage(self.keys, dict(aggregations), overflow),
                                  on_error)

    def count(self) -> Pipeline:
        return self.aggregate(count="count")

    def window(self, window) -> Windowed:
        """A windowed aggregation per key: ``.window(tumbling(60_000)).aggregate(...)``."""
        return Windowed(self.pipeline, self.keys, _check_window(window))

    def map_state(self, fn, *, state: pa.Schema, ttl=None, ttl_in: str = "event",
                  event_time: bool = False, broadcast: Pipeline | None = None,
                  broadcast_key=None, on_error=None) -> Pipeline:
        """Keyed state of your own (:mod:`sparkjet.operators.stateful`): ``fn`` is called once per
        batch with a :class:`~sparkjet.operators.stateful.KeyedBatch` (the batch's rows grouped by
        key, and those keys' state: a row of the ``state`` schema each) and returns its
        output, or ``(output, new_state)``; it may delete state and set timers.

        :param ttl: a key's state expires this long after its last update: event time
            (an int in the time column's unit, or a timedelta) with ``ttl_in="event"``,
            seconds with ``ttl_in="processing"``.
        :param event_time: the stream must carry event time (for event-time timers);
            implied by an event-time ``ttl``.
        :param broadcast: a second stream (rules, thresholds, reference rows) whose rows
            reach every processor (a broadcast edge) and are given to every call as
            ``KeyedBatch.broadcast``: every row so far, or the latest per ``broadcast_key``.
            It is saved in snapshots with the state. With event time it needs
            ``with_timestamps`` too (its watermarks count; its time column's name may differ).
        :param on_error: what rows with a null key do (as for :meth:`aggregate`).
        """
        stage = keyed_state_stage(self.keys, fn, state, ttl, ttl_in, event_time,
                                  broadcast is not None, broadcast_key)
        head = self.pipeline._stream("map_state")
        on_error = _on_error(on_error)
        if broadcast is None:
            return Pipeline(Node(stage, (head,), on_error))
        if not isinstance(broadcast, Pipeline):
            raise InvalidArgumentError(f"map_state(broadcast=...) takes a pipeline, got "
                                       f"{type(broadcast).__name__}")
        return Pipeline(Node(stage, (head, broadcast._stream("map_state(broadcast=...)")),
                             on_error))

    def map_stateful(self, create: Callable[[], object], fn: Callable, *, ttl=None,
                     ttl_in: str = "event", on_error=None) -> Pipeline:
        """The per-row form of :meth:`map_state` (Jet's ``mapStateful``): ``fn(state, key,
        row)`` runs for every row, in arrival order per key, with a Python object per key
        (``create()`` for a new key, pickled between batches) and returns an output row (a
        dict) or None. Far slower than :meth:`map_state` (Python per row); for logic that
        is hard to vectorize. ``on_error``: as for :meth:`map_state`."""
        if not callable(create) or not callable(fn):
            raise InvalidArgumentError("map_stateful(create, fn) takes two functions")
        return self.pipeline._add(keyed_state_stage(self.keys, per_row(create, fn), PER_ROW_STATE,
                                                    ttl, ttl_in, False), on_error)


@dataclass(frozen=True)
class Windowed:
    pipeline: Pipeline
    keys: tuple[str, ...]
    window: object

    def aggregate(self, *, early_results=None, allowed_lateness=0, late_events: Sink | None = None,
                  overflow: str = "fail", on_error=None, **aggregations) -> Pipeline:
        """Aggregates each window and key; a row per window and key when the watermark
        passes the window's end, with ``window_start`` and ``window_end``.

        :param early_results: seconds (or a timedelta) between speculative results of
            windows still open; None for final results only.
        :param allowed_lateness: how long after its end (event time) a window still takes
            late events; each one updates it and emits a correction.
        :param late_events: a sink for events later than that (counted in the job's
            metrics either way; never dropped silently).
        :param overflow: an integer sum past int64: ``"fail"`` or ``"decimal"`` (as for
            :meth:`GroupBy.aggregate`).
        :param on_error: what rows with a null key do (as for :meth:`GroupBy.aggregate`).
        """
        parse_window_aggregations(aggregations)
        check_overflow(overflow)
        taken = {"window_start", "window_end", "early"} & (set(self.keys) | set(aggregations))
        if taken:
            raise InvalidArgumentError(f"{sorted(taken)}: these names are taken by the "
                                       f"window's own columns; rename the column first")
        lateness = duration("allowed_lateness", allowed_lateness, allow_zero=True)
        early = None if early_results is None else seconds("early_results", early_results)
        if late_events is not None and not isinstance(late_events, Sink):
            raise InvalidArgumentError(f"late_events takes a sparkjet Sink, got "
                                       f"{type(late_events).__name__}")
        head = self.pipeline._stream("aggregate")

        stage = WindowStage(self.keys, self.window, dict(aggregations), early, lateness,
                            late_events, overflow)
        return Pipeline(Node(stage, (head,), _on_error(on_error)))

    def count(self) -> Pipeline:
        return self.aggregate(count="count")


def _on_error(policy):
    if policy is None or isinstance(policy, Sink) or policy in ("fail", "skip"):
        return policy
    raise InvalidArgumentError(f"on_error takes 'fail', 'skip' or a sparkjet Sink for the "
                               f"failed rows, got {policy!r}")


def _check_window(window):
    if not isinstance(window, WindowDefinition):
        raise InvalidArgumentError(
            f"window() takes sparkjet.windows.tumbling(...), sliding(...) or session(...), "
            f"got {window!r}")
    return window


__all__ = ["GroupBy", "Pipeline", "Windowed"]
