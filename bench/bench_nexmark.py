"""NEXMark on sparkjet beside Spark Structured Streaming: q0, q1, q2, q5, q7, q11 and a
tumbling count per auction over the same bids, and q3 and q8 over the same persons and
auctions, in one run, each result checked against :mod:`sparkjet.testing.nexmark_reference`.

sparkjet reads ``NexmarkSource(kind="bid")`` directly (the same bids that
``bench_nexmark_streaming.write_bids`` writes as Parquet for Spark: the first ``--events``
bids of the sequence) with ``.with_timestamps("date_time", max_lag=--out-of-order-ms)``
(persons and auctions likewise, for q3 and q8),
runs ``Job(...).run(spark)`` on ``local[2]`` (2 members, ``local_parallelism=1``,
exactly-once, snapshots every 1 s) and writes to a ``TransactionalFileSink`` (Parquet), as
Spark writes to its Parquet sink: the timed run is the checked run. It is timed from
``Job.run`` to its end (the barrier stage's start and the terminal snapshot included);
events/s = bids / seconds. Structured Streaming runs through ``bench_nexmark_streaming.run``
(timed from building the query to its end), in the same Spark session, right after
sparkjet's run of the same query. Before its timed run, each query runs once on 10,000
other bids on both systems.

The queries in sparkjet:

- q0 pass-through; q1 ``price * 89 / 100`` (``map_batches``); q2 ``auction % 123 == 0`` as
  ``auction, price`` (``map_batches``).
- tumbling count: ``group_by("auction").window(tumbling(10 s)).aggregate(count="count")``.
- q5 hot items: stage 1 ``group_by("auction").window(sliding(10 s, 2 s)).aggregate(n=
  "count")`` (its rows' event time is ``window_end``); ``window_start`` renamed ``ws``;
  stage 2 ``group_by("ws").window(tumbling(2 s))`` over ``window_end`` (each stage-1
  window's end is a multiple of 2 s, so each falls alone in one stage-2 window) with
  ``most=("max", "n")`` and a user aggregation keeping every auction whose ``n`` is the
  maximum (ties all kept); the lists are then exploded into rows.
- q7 highest bid: ``window(tumbling(10 s))`` (all to one processor) with a user
  aggregation keeping every bid at the window's highest price, exploded into rows.
- q11 user sessions: ``group_by("bidder").window(session(10 s)).aggregate(count="count")``.
- q3 local item suggestion (persons in OR, ID, CA; auctions of category 10): both streams
  filtered and mapped to one schema (``id`` = person id or seller), merged with ``union``,
  then ``group_by("id").map_state(q3_join)``: Jet's ``mapStateful`` form, the state keeping
  the person once seen and the auctions waiting for them; each pair emitted once, when its
  second half arrives. Unbounded, as nexmark-flink's join: no TTL.
- q8 monitor new users: persons (``is_person`` 1, the name) and auctions (``is_person`` 0,
  ``id`` = seller) merged with ``union``; ``group_by("id").window(tumbling(10 s))`` with the
  max and min of ``is_person`` and the name (a user aggregation); the windows with both.

q3 and q8 read ``NexmarkSource(kind="person")`` and ``kind="auction"`` with the same
``total``: the persons and auctions among the first global events holding ``--events`` of
them (``bench_nexmark_streaming.join_total``), so sellers and person ids agree; events/s =
persons and auctions read / seconds.

Run: ``python bench/bench_nexmark.py --events 1000000`` (a table of events/s per query and
system, ``bench/results/nexmark.json`` and ``nexmark.png``); ``--queries q5,q7`` for some,
``--skip-sss`` for sparkjet alone. ``python -m pytest bench/bench_nexmark.py
--benchmark-only`` runs sparkjet's side on 100k bids.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_nexmark_streaming as sss  # noqa: E402 - after the path

from sparkjet.testing.nexmark_reference import Q3_CATEGORY, Q3_STATES  # noqa: E402

if __name__ != "__main__":
    # Imported (by pytest, or a test): Spark's workers and sparkjet's member processes cannot
    # import this module, so its functions travel by value, as they do when it runs as a
    # script.
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

QUERIES = ("q0", "q1", "q2", "tumbling", "q5", "q7", "q3", "q8", "q11")
JOIN_QUERIES = ("q3", "q8")   # persons and auctions; the others read bids
SIZE = timedelta(seconds=sss.SIZE_S)
SLIDE = timedelta(seconds=sss.SLIDE_S)
BID_COLUMNS = sss._BID_COLUMNS


def global_total(bids: int) -> int:
    """The global events (all kinds) whose bids are the first ``bids`` bids."""
    runs, rest = divmod(bids, 46)   # 46 bids in every 50 events, at offsets 4..49
    return runs * 50 + (4 + rest if rest else 0)


# ------------------------------------------------------------------ argmax user aggregation


def _np(column) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return np.asarray(column.to_numpy(zero_copy_only=False))


def _top_lists(groups: np.ndarray, n: int, score: np.ndarray, values: pa.Array,
               value_groups: np.ndarray | None = None, value_score: np.ndarray | None = None
               ) -> pa.Table:
    """Per group ``0..n-1``: the highest ``score`` (``best``) and the list of the ``values``
    reaching it (``items``). ``value_groups`` / ``value_score``: each value's group and
    score, when they are not ``groups`` / ``score`` (combining partial lists)."""
    best = np.full(n, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(best, groups, score.astype(np.int64))
    vg = groups if value_groups is None else value_groups
    vs = score if value_score is None else value_score
    keep = np.flatnonzero(vs == best[vg])
    order = keep[np.argsort(vg[keep], kind="stable")]
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(np.bincount(vg[order], minlength=n), out=offsets[1:])
    items = pa.ListArray.from_arrays(pa.array(offsets), values.take(pa.array(order)))
    return pa.table({"best": best, "items": items})


def argmax_aggregation(score_column: str, value_columns: tuple[str, ...]):
    """A user aggregation: the rows (as structs of ``value_columns``) whose ``score_column``
    is the group's maximum, all of them when several tie."""
    from sparkjet.windows import user_aggregation

    def accumulate(groups, n, score, *values):
        if isinstance(score, pa.ChunkedArray):
            score = score.combine_chunks()
        values = [v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v for v in values]
        rows = pa.StructArray.from_arrays(values, names=list(value_columns))
        return _top_lists(groups, n, _np(score), rows)

    def combine(groups, n, partials):
        items = partials.column("items").combine_chunks()
        best = _np(partials.column("best"))
        parent = _np(pc.list_parent_indices(items))
        return _top_lists(groups, n, best, pc.list_flatten(items),
                          value_groups=groups[parent], value_score=best[parent])

    def finish(partials):
        return partials.column("items").combine_chunks()

    return user_aggregation([score_column, *value_columns], accumulate, combine, finish)


def _explode(batch, column: str, fields: list[str]):
    """Each row of ``batch`` once per item of its list ``column`` (structs of ``fields``)."""
    table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
    items = table.column(column).combine_chunks()
    parent = pc.list_parent_indices(items)
    flat = pc.list_flatten(items)
    rows = table.drop_columns([column]).take(parent)
    for name in fields:
        rows = rows.append_column(name, flat.field(name))
    return rows


# --------------------------------------------------------------------------- the pipelines


def _q1(batch):
    i = batch.schema.get_field_index("price")
    price = pc.divide(pc.multiply(batch.column(i), 89), 100)
    return batch.set_column(i, "price", price) if isinstance(batch, pa.Table) else \
        pa.RecordBatch.from_arrays([price if j == i else c for j, c in enumerate(batch.columns)],
                                   schema=batch.schema)


def _q2(batch):
    mask = _np(batch.column("auction")) % 123 == 0
    return batch.filter(pa.array(mask)).select(["auction", "price"])


def _rename_ws(batch):
    # group_by keys are integer, string or binary columns: the window start as int64 ms.
    i = batch.schema.get_field_index("window_start")
    ws = batch.column(i).view(pa.int64())
    columns = [ws if j == i else c for j, c in enumerate(batch.columns)]
    names = ["ws" if j == i else n for j, n in enumerate(batch.schema.names)]
    return pa.RecordBatch.from_arrays(columns, names=names) if isinstance(
        batch, pa.RecordBatch) else pa.Table.from_arrays(columns, names=names)


def _q5_rows(batch):
    rows = _explode(batch, "top", ["auction"])
    ws = _np(rows.column("ws")).astype(np.int64)
    ms = int(SIZE.total_seconds() * 1000)
    return pa.table({"window_start": pa.array(ws).view(pa.timestamp("ms")),
                     "window_end": pa.array(ws + ms).view(pa.timestamp("ms")),
                     "auction": rows.column("auction"), "count": rows.column("most")})


def _q7_rows(batch):
    rows = _explode(batch, "top", list(BID_COLUMNS))
    return rows.select(["window_start", "window_end", *BID_COLUMNS])


# q3 and q8: persons and auctions, merged by union into one schema keyed by person id.

Q3_ROWS = pa.schema([("id", pa.int64()), ("auction", pa.int64()), ("name", pa.string()),
                     ("city", pa.string()), ("state", pa.string()),
                     ("date_time", pa.timestamp("ms"))])
Q3_STATE = pa.schema([("name", pa.string()), ("city", pa.string()), ("state", pa.string()),
                      ("pending", pa.list_(pa.int64()))])
Q8_ROWS = pa.schema([("id", pa.int64()), ("is_person", pa.int64()), ("name", pa.string()),
                     ("date_time", pa.timestamp("ms"))])


def _table(batch) -> pa.Table:
    return pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch


def _q3_persons(batch):
    """Persons in OR, ID or CA, in q3's merged schema (``auction`` null)."""
    t = _table(batch)
    t = t.filter(pc.is_in(t.column("state"), pa.array(Q3_STATES)))
    return pa.table([t.column("id"), pa.nulls(t.num_rows, pa.int64()), t.column("name"),
                     t.column("city"), t.column("state"), t.column("date_time")],
                    schema=Q3_ROWS)


def _q3_auctions(batch):
    """Auctions of category 10 as ``id`` = seller, ``auction`` = the auction's id."""
    t = _table(batch)
    t = t.filter(pc.equal(t.column("category"), Q3_CATEGORY))
    text = pa.nulls(t.num_rows, pa.string())
    return pa.table([t.column("seller"), t.column("id"), text, text, text,
                     t.column("date_time")], schema=Q3_ROWS)


def q3_join(b):
    """q3's ``map_state`` function (Jet's q3 with ``mapStateful``), per person id: the state
    keeps the person once seen (name, city, state) and, until then, the ids of the auctions
    waiting for them (``pending``). Each (person, auction) pair is emitted once, when its
    second half arrives: an auction of a known person at once; the pending auctions with
    their person. Person ids are unique, so a key holds at most one person."""
    if b.rows is None:
        return None
    n, rows, group = len(b), b.rows, b.group
    auction = rows.column("auction").combine_chunks()
    is_person = np.asarray(auction.is_null())
    person_row = np.full(n, -1, np.int64)
    person_row[group[is_person]] = np.flatnonzero(is_person)
    known_before = b.has_state & np.asarray(b.state.column("name").is_valid())
    arrives = (person_row >= 0) & ~known_before
    known = known_before | arrives
    take = pa.array(np.where(arrives, person_row, 0), mask=~arrives)
    info = {c: pc.if_else(pa.array(known_before), b.state.column(c).combine_chunks(),
                          rows.column(c).take(take)) for c in ("name", "city", "state")}
    # The batch's auctions of known persons, then the pending ones of persons arriving now.
    now = np.flatnonzero(~is_person & known[group])
    pending = b.state.column("pending").combine_chunks()
    waiting = pending.filter(pa.array(arrives))
    waiting_keys = np.flatnonzero(arrives)[_np(pc.list_parent_indices(waiting))] \
        if len(waiting) else np.zeros(0, np.int64)
    keys = np.concatenate([group[now], waiting_keys])
    ids = pa.concat_arrays([auction.take(pa.array(now)),
                            pc.list_flatten(waiting).cast(pa.int64())])
    pick = pa.array(keys)
    out = pa.table({"name": info["name"].take(pick), "city": info["city"].take(pick),
                    "state": info["state"].take(pick), "id": ids})
    # Persons still unknown: their pending auctions, old and new.
    late = np.flatnonzero(~is_person & ~known[group])
    unknown = ~known & b.has_state
    old = pending.filter(pa.array(unknown))
    old_keys = np.flatnonzero(unknown)[_np(pc.list_parent_indices(old))] \
        if len(old) else np.zeros(0, np.int64)
    wait_keys = np.concatenate([old_keys, group[late]])
    wait_ids = pa.concat_arrays([pc.list_flatten(old).cast(pa.int64()),
                                 auction.take(pa.array(late))])
    order = np.argsort(wait_keys, kind="stable")
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(np.bincount(wait_keys, minlength=n), out=offsets[1:])
    lists = pa.ListArray.from_arrays(pa.array(offsets), wait_ids.take(pa.array(order)),
                                     mask=pa.array(known))
    state = pa.table({**info, "pending": lists}, schema=Q3_STATE)
    return (out if out.num_rows else None), state


def _q8_persons(batch):
    t = _table(batch)
    return pa.table([t.column("id"), pa.array(np.ones(t.num_rows, np.int64)), t.column("name"),
                     t.column("date_time")], schema=Q8_ROWS)


def _q8_auctions(batch):
    t = _table(batch)
    return pa.table([t.column("seller"), pa.array(np.zeros(t.num_rows, np.int64)),
                     pa.nulls(t.num_rows, pa.string()), t.column("date_time")],
                    schema=Q8_ROWS)


def _first_valid(groups: np.ndarray, n: int, values) -> pa.Table:
    """Per group ``0..n-1``, the first non-null of ``values`` (null if none)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    valid = np.flatnonzero(np.asarray(values.is_valid()))
    first = np.full(n, -1, np.int64)
    first[groups[valid][::-1]] = valid[::-1]
    have = first >= 0
    return pa.table({"name": values.take(pa.array(np.where(have, first, 0), mask=~have))})


def any_name():
    """A user aggregation: a group's name, from the one row that has it (the person's)."""
    from sparkjet.windows import user_aggregation

    return user_aggregation(
        "name", _first_valid, lambda groups, n, partials: _first_valid(
            groups, n, partials.column("name")),
        lambda partials: partials.column("name").combine_chunks())


def _q8_rows(batch):
    """The windows of persons who also created an auction (a person row and an auction
    row: ``is_person`` at most 1 and at least 0): ``id, name, window_start``."""
    t = _table(batch)
    both = pc.and_(pc.equal(t.column("any_person"), 1), pc.equal(t.column("all_persons"), 0))
    return t.filter(both).select(["id", "name", "window_start"])


SESSION_GAP = timedelta(seconds=sss.SESSION_GAP_S)


def pipeline(name: str, source, sink, max_lag_ms: int = 0):
    """Query ``name`` from ``source``: a bid source, or for q3 and q8 a dict of a person
    and an auction source (``{"person": ..., "auction": ...}``), into ``sink``."""
    from sparkjet.pipeline import Pipeline
    from sparkjet.windows import session, sliding, tumbling

    lag = timedelta(milliseconds=max_lag_ms)
    if name in JOIN_QUERIES:
        persons = Pipeline().read_from(source["person"]).with_timestamps("date_time",
                                                                         max_lag=lag)
        auctions = Pipeline().read_from(source["auction"]).with_timestamps("date_time",
                                                                           max_lag=lag)
        if name == "q3":
            out = (persons.map_batches(_q3_persons).union(auctions.map_batches(_q3_auctions))
                   .group_by("id").map_state(q3_join, state=Q3_STATE))
        else:
            out = (persons.map_batches(_q8_persons).union(auctions.map_batches(_q8_auctions))
                   .group_by("id").window(tumbling(SIZE))
                   .aggregate(any_person=("max", "is_person"),
                              all_persons=("min", "is_person"), name=any_name())
                   .map_batches(_q8_rows))
        return out.write_to(sink)
    bids = Pipeline().read_from(source).with_timestamps("date_time", max_lag=lag)
    if name == "q0":
        out = bids
    elif name == "q1":
        out = bids.map_batches(_q1)
    elif name == "q2":
        out = bids.map_batches(_q2)
    elif name == "tumbling":
        out = bids.group_by("auction").window(tumbling(SIZE)).aggregate(count="count")
    elif name == "q5":
        counts = bids.group_by("auction").window(sliding(SIZE, SLIDE)).aggregate(n="count")
        out = (counts.map_batches(_rename_ws).group_by("ws").window(tumbling(SLIDE))
               .aggregate(most=("max", "n"), top=argmax_aggregation("n", ("auction",)))
               .map_batches(_q5_rows))
    elif name == "q7":
        out = (bids.window(tumbling(SIZE))
               .aggregate(top=argmax_aggregation("price", BID_COLUMNS)).map_batches(_q7_rows))
    elif name == "q11":
        out = bids.group_by("bidder").window(session(SESSION_GAP)).aggregate(count="count")
    else:
        raise ValueError(f"unknown query {name!r}")
    return out.write_to(sink)


def sources(name: str, events: int, lag_ms: int = 0,
            events_per_second: int = sss.EVENTS_PER_SECOND, seed: int = 0, **kwargs):
    """What query ``name`` reads from ``NexmarkSource``, as ``pipeline`` takes it: the first
    ``events`` bids, or for q3 and q8 the persons and auctions among the first ``events`` of
    those two kinds (the same global events, so ids and times agree across the two)."""
    from sparkjet.sources import NexmarkSource

    common = dict(partitions=4, events_per_second=events_per_second, out_of_order_ms=lag_ms,
                  seed=seed, **kwargs)
    if name in JOIN_QUERIES:
        total = sss.join_total(events)
        return {kind: NexmarkSource(kind=kind, total=total, **common)
                for kind in ("person", "auction")}
    return NexmarkSource(kind="bid", total=global_total(events), **common)


def run_sparkjet(spark, name: str, events: int, work: Path, lag_ms: int = 0,
                 events_per_second: int = sss.EVENTS_PER_SECOND, seed: int = 0
                 ) -> tuple[float, pa.Table, dict]:
    """Query ``name`` on sparkjet over the first ``events`` bids (or persons and auctions,
    for q3 and q8): events/s, the committed result and how the run went."""
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import TransactionalFileSink

    out, snaps = work / f"sj-out-{name}", work / f"sj-snap-{name}"
    for folder in (out, snaps):
        shutil.rmtree(folder, ignore_errors=True)
    source = sources(name, events, lag_ms, events_per_second, seed)
    config = JobConfig(name=f"nexmark-{name}-{time.time_ns()}", members=2, local_parallelism=1,
                       processing_guarantee="exactly-once", snapshot_interval=1.0,
                       snapshot_store=str(snaps))
    marks: dict[str, float] = {}

    def progress(event):
        if event["event"] == "started":
            marks.setdefault("started", time.monotonic())

    job = Job(pipeline(name, source, TransactionalFileSink(str(out)), lag_ms), config)
    start = time.monotonic()
    result = job.run(spark, on_progress=progress)
    seconds = time.monotonic() - start
    if result.events_in != events:
        raise AssertionError(f"{name}: sparkjet read {result.events_in} events, not {events}")
    table = TransactionalFileSink.read(str(out))
    late = sum(e.get("late_events", 0) for e in result.executions)
    snapshots = result.snapshots
    return events / seconds, table, {
        "seconds": seconds, "start_s": marks.get("started", start) - start,
        "events_per_s_running": events / (start + seconds - marks.get("started", start)),
        "snapshots": len(snapshots), "restarts": result.restarts, "late_events": late,
        "events_out": result.events_out}


def _bid_at_or_after(event_ms: int, first_ms: int, events_per_second: int) -> int:
    """The number of bids before the first bid whose ``date_time`` is at least ``event_ms``
    (event ``i`` is at ``first_ms + i * 1000 // events_per_second``)."""
    i = max(0, -(-(event_ms - first_ms) * events_per_second // 1000))
    while first_ms + i * 1000 // events_per_second < event_ms:
        i += 1
    while True:
        runs, offset = divmod(i, 50)
        if offset >= 4:
            return runs * 46 + offset - 4
        i += 4 - offset


def window_latency(spark, name: str, work: Path, seconds: float = 20.0,
                   rate: float = 50_000, events_per_second: int = sss.EVENTS_PER_SECOND,
                   poll_s: float = 0.01) -> dict:
    """Per window of ``name`` (q5, q7 or tumbling): seconds from the moment the source's
    schedule lets out the first bid at or past the window's end (with ``max_lag`` 0, the
    bid that moves the watermark past it) to the moment its row is committed (seen in a
    committed file of the ``TransactionalFileSink``, polled every ``poll_s``).

    The source is rate-limited (``rate`` bids/s over its 4 partitions, batches of 2,048);
    bid ``j`` is scheduled at ``t0 + j / rate``, ``t0`` being when the coordinator reports
    the members started (the readers start their schedule at their first read, just
    after). A bid the job takes later than its schedule adds that lag to the figure, so it
    is an upper bound on watermark-to-commit; one window's commit wait is bounded by the
    snapshot interval (1 s) plus the snapshot."""
    import pyarrow.parquet as pq

    from sparkjet.connectors.nexmark.source import FIRST_EVENT_TIME_MS
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import TransactionalFileSink
    from sparkjet.sources import NexmarkSource

    bids = int(rate * seconds)
    out, snaps = work / f"lat-out-{name}", work / f"lat-snap-{name}"
    for folder in (out, snaps):
        shutil.rmtree(folder, ignore_errors=True)
    source = NexmarkSource(kind="bid", total=global_total(bids), partitions=4, rate=rate,
                           batch_size=2048, events_per_second=events_per_second)
    config = JobConfig(name=f"nexmark-lat-{name}-{time.time_ns()}", members=2,
                       local_parallelism=1, processing_guarantee="exactly-once",
                       snapshot_interval=1.0, snapshot_store=str(snaps))
    marks: dict[str, float] = {}
    seen: dict[int, float] = {}
    done = threading.Event()

    def progress(event):
        if event["event"] == "started":
            marks.setdefault("started", time.monotonic())

    def poll():
        read: set[str] = set()
        while True:
            last = done.is_set()
            if out.exists():
                for path in TransactionalFileSink.committed_files(str(out)):
                    if path in read:
                        continue
                    now = time.monotonic()
                    read.add(path)
                    ends = pq.read_table(path, columns=["window_end"]).column("window_end")
                    for end in np.unique(_np(ends.cast(pa.int64()))):
                        seen.setdefault(int(end), now)
            if last:
                return
            time.sleep(poll_s)

    job = Job(pipeline(name, source, TransactionalFileSink(str(out))), config)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    result = job.run(spark, on_progress=progress)
    done.set()
    poller.join()
    t0 = marks["started"]
    size_ms = int(SIZE.total_seconds() * 1000)
    last_bid_ms = FIRST_EVENT_TIME_MS + (global_total(bids) - 1) * 1000 // events_per_second
    lat = []
    for end, when in seen.items():
        if end > last_bid_ms:   # closed by the end of the stream, not by a bid
            continue
        j = _bid_at_or_after(end, FIRST_EVENT_TIME_MS, events_per_second)
        lat.append(when - (t0 + j / rate))
    lat_arr = np.array(lat)
    return {"query": name, "bids": bids, "rate": rate, "windows": len(lat),
            "window_ms": size_ms, "p50_s": float(np.percentile(lat_arr, 50)),
            "p99_s": float(np.percentile(lat_arr, 99)), "min_s": float(lat_arr.min()),
            "max_s": float(lat_arr.max()), "snapshots": len(result.snapshots),
            "seconds": result.seconds}


def check(name: str, result: pa.Table, bids: pa.Table) -> tuple[pa.Table, str | None]:
    """The reference of ``name`` and, when sparkjet's result differs, what differs."""
    expected = sss.QUERIES[name][1](bids)
    if result.num_columns == 0:
        return expected, f"no output rows; the reference has {expected.num_rows}"
    got = sss.comparable(result, expected)
    if got.equals(expected):
        return expected, None
    import pandas as pd

    a, b = got.to_pandas(), expected.to_pandas()
    both = a.merge(b, how="outer", indicator=True)
    only_got = both[both["_merge"] == "left_only"].drop(columns="_merge")
    only_ref = both[both["_merge"] == "right_only"].drop(columns="_merge")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        return expected, (f"sparkjet {got.num_rows} rows, reference {expected.num_rows}; "
                          f"{len(only_got)} only in sparkjet, {len(only_ref)} only in the "
                          f"reference; first of each:\n{only_got.head(5)}\n{only_ref.head(5)}")


# ------------------------------------------------------------------ pytest-benchmark mode


@pytest.fixture(scope="module")
def nexmark_sparkjet(tmp_path_factory):
    work = tmp_path_factory.mktemp("nexmark-sparkjet")
    bids = sss.write_bids(work, events=100_000)
    spark = sss.session()
    run_sparkjet(spark, "q0", 10_000, work / "warm-up", seed=1)
    yield spark, bids, work, bids.table()
    spark.stop()


@pytest.mark.parametrize("name", QUERIES)
def test_nexmark_sparkjet(benchmark, nexmark_sparkjet, name):
    spark, bids, work, table = nexmark_sparkjet
    benchmark.group = "NEXMark on sparkjet"
    rate, result, info = benchmark.pedantic(run_sparkjet, args=(spark, name, bids.events, work),
                                            rounds=1, iterations=1)
    if name in JOIN_QUERIES:
        table = {kind: s.events(0, s.total) for kind, s in sources(name, bids.events).items()}
    _, problem = check(name, result, table)
    assert problem is None, problem
    benchmark.extra_info.update(events=bids.events, events_per_s=rate, **info)


# ---------------------------------------------------------------------- plain-module mode


def plot(rows: list[dict], events: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["query"] for r in rows]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(10, 4.8))
    sj = [r["sparkjet_events_per_s"] / 1e6 for r in rows]
    ss = [r.get("sss_events_per_s", float("nan")) / 1e6 for r in rows]
    ax.bar(x - 0.2, sj, 0.4, color="#d9480f", label="sparkjet, exactly-once 1 s")
    ax.bar(x + 0.2, ss, 0.4, color="#868e96", label="Spark Structured Streaming")
    for i, r in enumerate(rows):
        if "ratio" in r:
            ax.text(i, max(sj[i], ss[i]), f"{r['ratio']:.0f}x", ha="center", va="bottom")
    ax.set_xticks(x, names)
    ax.set_yscale("log")
    ax.set_ylabel("M events/s (log scale)")
    ax.set_title(f"NEXMark, {events:,} events (bids; q3, q8: persons and auctions), local[2], "
                 f"Parquet sinks")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000,
                        help="bids, or persons and auctions for q3 and q8 (1,000,000)")
    parser.add_argument("--files", type=int, default=40, help="Parquet files for Spark")
    parser.add_argument("--files-per-trigger", type=int, default=sss.FILES_PER_TRIGGER)
    parser.add_argument("--out-of-order-ms", type=int, default=0)
    parser.add_argument("--queries", default=",".join(QUERIES))
    parser.add_argument("--skip-sss", action="store_true")
    parser.add_argument("--latency-seconds", type=float, default=20.0,
                        help="wall seconds of each rate-limited latency run (0: none)")
    parser.add_argument("--latency-rate", type=float, default=50_000, help="bids/s offered")
    parser.add_argument("--latency-queries", default="q5,q7")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(),
                                                           "sparkjet-nexmark"))
    parser.add_argument("--out", default=str(BENCH / "results" / "nexmark"))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.queries.split(",") if n.strip()]
    unknown = sorted(set(names) - set(QUERIES))
    if unknown:
        parser.error(f"unknown queries {unknown}; choose from {', '.join(QUERIES)}")
    work = Path(args.work_dir)
    bids = sss.write_bids(work, args.events, args.files, out_of_order_ms=args.out_of_order_ms,
                          files_per_trigger=args.files_per_trigger)
    joins = sss.write_persons_and_auctions(
        work, args.events, args.files, out_of_order_ms=args.out_of_order_ms,
        files_per_trigger=args.files_per_trigger) if set(names) & set(JOIN_QUERIES) else None
    tables = {"bids": bids.table(), "joins": joins.table() if joins else None}
    print(f"load average {os.getloadavg()[0]:.2f}; {bids.events:,} bids"
          + (f", {joins.events:,} persons and auctions" if joins else ""), flush=True)
    spark = sss.session()
    rows, problems, latencies = [], {}, {}
    try:
        run_sparkjet(spark, "q0", 10_000, work / "warm-up", seed=1)   # starts the workers
        for name in names:
            run_sparkjet(spark, name, 10_000, work / "warm-up", seed=1)
            rate, result, info = run_sparkjet(spark, name, bids.events, work, args.out_of_order_ms)
            inputs = sss.inputs_of(name, bids, joins)
            table = tables["joins" if name in JOIN_QUERIES else "bids"]
            expected, problem = check(name, result, table)
            row = {"query": name, "sparkjet_events_per_s": rate, "sparkjet": info,
                   "rows": expected.num_rows, "equal_to_reference": problem is None}
            if problem:
                problems[name] = problem
                row["difference"] = problem
            print(f"  sparkjet {name}: {rate:,.0f} events/s ({info['seconds']:.2f} s, "
                  f"{info['snapshots']} snapshots, late {info['late_events']}); "
                  f"{'equal to the reference' if problem is None else 'DIFFERS: ' + problem}",
                  flush=True)
            if not args.skip_sss:
                sss.warm_up(spark, name, work / "sss")
                s_rate, s_result, s_info = sss.run(spark, name, inputs, work / "sss")
                sss.check(name, s_result, table)
                row.update(sss_events_per_s=s_rate, sss=s_info, ratio=rate / s_rate)
                print(f"  sss {name}: {s_rate:,.0f} events/s ({s_info['seconds']:.1f} s); "
                      f"sparkjet is {rate / s_rate:.1f}x", flush=True)
            rows.append(row)
        if args.latency_seconds > 0:
            for name in [n.strip() for n in args.latency_queries.split(",") if n.strip()]:
                latencies[name] = window_latency(spark, name, work, args.latency_seconds,
                                                 args.latency_rate)
                print(f"  sparkjet {name} latency:", json.dumps(latencies[name]), flush=True)
    finally:
        spark.stop()
    print(f"\nNEXMark, {bids.events:,} events (bids; q3, q8: persons and auctions), local[2]; "
          f"ratio = sparkjet / Structured Streaming")
    print(f"{'query':10}{'sparkjet/s':>13}{'SSS/s':>11}{'ratio':>8}{'rows':>11}  equal")
    for r in rows:
        print(f"{r['query']:10}{r['sparkjet_events_per_s']:>13,.0f}"
              f"{r.get('sss_events_per_s', float('nan')):>11,.0f}{r.get('ratio', float('nan')):>7.1f}x"
              f"{r['rows']:>11,}  {r['equal_to_reference']}")
    for name, r in latencies.items():
        print(f"{name}: window end passing the watermark (scheduled) to committed row, "
              f"{r['windows']} windows at {r['rate']:,.0f} bids/s: p50 {r['p50_s']:.3f} s, "
              f"p99 {r['p99_s']:.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"events": bids.events, "files": args.files, "load_average": os.getloadavg()[0],
         "rows": rows, "latency": latencies}, indent=2, default=str))
    plot(rows, bids.events, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
