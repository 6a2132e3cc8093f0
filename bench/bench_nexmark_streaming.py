"""NEXMark on Spark Structured Streaming: q0, q1, q2, q5, q7, q11 and a tumbling count per
auction over the same bids, and q3 and q8 over persons and auctions, each result checked
against :mod:`sparkjet.testing.nexmark_reference`.
The Structured Streaming side of the NEXMark comparison; sparkjet's side comes with its
window operators (``Pipeline().read_from(NexmarkSource(...)).with_timestamps("date_time",
max_lag=...).group_by("auction").window(sparkjet.operators.windows.definitions.sliding(size, slide))...``).

Feeding and measuring follow ``bench_vs_streaming.py``: the bids of
``NexmarkSource(kind="bid")`` (``--events`` bids, 10,000 events/s of event time) are
written first as ``--files`` Parquet files in event order; each query reads them as a
file stream with ``maxFilesPerTrigger`` (4), trigger ``availableNow``, on ``local[2]`` with
8 shuffle partitions, writing to a Parquet sink in append mode, and is timed from building
the query to its end (the JVM and session start excluded); events/s = bids / seconds.
Before its timed run, each query runs once on 10,000 other bids, so that the timed run does
not pay for the JVM's first plan of that shape (code generation, class loading: 5-10 s
here, more than the rest of a 200k-bid run).

- q0 pass-through, q1 ``price * 89 div 100``, q2 ``auction % 123 = 0``: stateless.
- tumbling count: ``count(*)`` per auction per 10 s window.
- q5 hot items: the count per auction per sliding window (10 s every 2 s), then per window
  the auctions whose count is the maximum (a second aggregation over the first one's
  ``window``: max count and the list of (auction, count), exploded and filtered).
- q7 highest bid: per 10 s window, the maximum price and the list of the window's bids,
  those at the maximum kept (one aggregation); ``q7-join`` is nexmark-flink's form, the
  maximum per window joined back to the bids (an interval join on ``window_time``), 1.5 to
  2.7 times slower on Spark here.

- q11 user sessions: ``count(*)`` per bidder per ``session_window`` (gap 10 s).
- q3 local item suggestion: persons (state in OR, ID, CA) and auctions (category 10), each a
  file stream, in an inner stream-stream join on ``seller = id``, without watermarks (the
  join keeps both sides for ever, as nexmark-flink's does).
- q8 monitor new users: persons with their 10 s ``window`` joined with the distinct
  (``dropDuplicates``) sellers and windows of the auctions, on id and window equality, with
  watermarks on both sides (a window-equality join, whose state goes once the watermark
  passes the window).

q3 and q8 read the persons and auctions among the first global events holding ``--events``
of those two kinds (:func:`write_persons_and_auctions`), each kind in ``--files`` files;
file ``i`` of both kinds covers the same stretch of event time, and each stream reads
``maxFilesPerTrigger`` files a trigger, so both sides move together.

Windowed queries carry a watermark on ``date_time`` of ``--out-of-order-ms`` (the
generator's bound on lateness, 0 by default: the bids are in order). Spark emits a window
in append mode once the watermark passes its end, and the watermark only moves with data:
the windowed queries read one more file, last, holding a single bid (auction -1) an hour
after the others, which closes every real window and is itself never output (q8: a person,
id -1, and an auction, seller -2, which match nothing).

Run: ``python bench/bench_nexmark_streaming.py --events 200000`` (a table of events/s per
query; ``--queries q5,q7`` for some), or ``python -m pytest bench/bench_nexmark_streaming.py
--benchmark-only`` (one round per query, 100k bids). ``tests/connectors/test_nexmark.py`` runs q5,
q7, q11, q3 and q8 on a few thousand events against the reference (marked ``spark`` and
``slow``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from sparkjet.sources import NexmarkSource
from sparkjet.testing import nexmark_reference as ref

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from streaming_competitors import SSS_STATE_STORES  # noqa: E402 - after the path

EVENTS = 200_000
FILES = 20
FILES_PER_TRIGGER = 4
EVENTS_PER_SECOND = 10_000
SIZE_S, SLIDE_S = 10, 2
SESSION_GAP_S = 10
BID_DDL = ("auction BIGINT, bidder BIGINT, price BIGINT, channel STRING, url STRING, "
           "date_time TIMESTAMP, extra STRING")
PERSON_DDL = ("id BIGINT, name STRING, email_address STRING, credit_card STRING, city STRING, "
              "state STRING, date_time TIMESTAMP, extra STRING")
AUCTION_DDL = ("id BIGINT, item_name STRING, description STRING, initial_bid BIGINT, "
               "reserve BIGINT, date_time TIMESTAMP, expires TIMESTAMP, seller BIGINT, "
               "category BIGINT, extra STRING")
_FLUSH_AFTER_MS = 3_600_000
_BID_COLUMNS = ("auction", "bidder", "price", "channel", "url", "date_time", "extra")


@dataclasses.dataclass(frozen=True)
class Bids:
    """The bids of one run as files: ``plain`` (the bids) and ``flushed`` (the same files
    and the closing bid, for windowed queries), and how they were made."""

    plain: str
    flushed: str
    events: int
    lag_ms: int
    files_per_trigger: int

    def table(self) -> pa.Table:
        """The bids as the reference reads them (``date_time`` as timestamp[ms])."""
        return _read_back(self.plain)


def write_bids(work: Path, events: int = EVENTS, files: int = FILES,
               events_per_second: int = EVENTS_PER_SECOND, out_of_order_ms: int = 0,
               seed: int = 0, files_per_trigger: int = FILES_PER_TRIGGER) -> Bids:
    """The first ``events`` bids of the NEXMark sequence as ``files`` Parquet files in
    event order, ``date_time`` as a UTC timestamp (Spark's ``TIMESTAMP``)."""
    runs, rest = divmod(events, 46)   # 46 bids in every 50 events, at offsets 4..49
    stop = runs * 50 + (4 + rest if rest else 0)
    plain, flushed = _write_kind(work, "bid", stop, files, events_per_second, out_of_order_ms,
                                 seed, {"auction": -1, "bidder": -1})
    return Bids(plain, flushed, events, out_of_order_ms, files_per_trigger)


def join_total(events: int) -> int:
    """The global events (all kinds) holding the first ``events`` persons and auctions."""
    runs, rest = divmod(events, 4)    # a person and 3 auctions in every 50 events, at 0..3
    return runs * 50 + rest


@dataclasses.dataclass(frozen=True)
class PersonsAndAuctions:
    """The persons and auctions of one run (q3, q8) as files, as :class:`Bids` (``plain``
    and ``flushed`` are dicts by kind); ``events`` counts both kinds."""

    plain: dict
    flushed: dict
    events: int
    lag_ms: int
    files_per_trigger: int

    def table(self) -> dict:
        """``{"person": ..., "auction": ...}`` as the references read them."""
        return {kind: _read_back(path) for kind, path in self.plain.items()}


def write_persons_and_auctions(work: Path, events: int = EVENTS, files: int = FILES,
                               events_per_second: int = EVENTS_PER_SECOND,
                               out_of_order_ms: int = 0, seed: int = 0,
                               files_per_trigger: int = FILES_PER_TRIGGER) -> PersonsAndAuctions:
    """The first ``events`` persons and auctions of the NEXMark sequence (a quarter
    persons), each kind as ``files`` Parquet files in event order, file ``i`` of both kinds
    covering the same stretch of event time. The closing person (id -1) and auction (seller
    -2) of the flushed folders match nothing."""
    stop = join_total(events)
    plain, flushed = {}, {}
    for kind, closing in (("person", {"id": -1, "state": ""}),
                          ("auction", {"id": -1, "seller": -2, "category": -1})):
        plain[kind], flushed[kind] = _write_kind(work, kind, stop, files, events_per_second,
                                                 out_of_order_ms, seed, closing)
    return PersonsAndAuctions(plain, flushed, events, out_of_order_ms, files_per_trigger)


def _write_kind(work: Path, kind: str, stop: int, files: int, events_per_second: int,
                out_of_order_ms: int, seed: int, closing: dict) -> tuple[str, str]:
    """The ``kind`` events among the first ``stop`` global events as ``files`` Parquet
    files (``<kind>s/``) and, in ``<kind>s-flushed/``, the same files and a last one holding
    one event an hour after the others (``closing``'s values, the rest zero or empty)."""
    source = NexmarkSource(kind=kind, events_per_second=events_per_second,
                           out_of_order_ms=out_of_order_ms, seed=seed)
    plain, flushed = work / f"{kind}s", work / f"{kind}s-flushed"
    for folder in (plain, flushed):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    utc = pa.timestamp("ms", "UTC")
    times = [i for i, f in enumerate(source.schema) if pa.types.is_timestamp(f.type)]
    schema = source.schema
    for at in times:
        schema = schema.set(at, pa.field(schema.field(at).name, utc))
    last = 0
    for i in range(files):
        table = source.events(stop * i // files, stop * (i + 1) // files).cast(schema)
        name = f"part-{i:05d}.parquet"
        pq.write_table(table, plain / name)
        _link(plain / name, flushed / name)
        if table.num_rows:
            last = max(last, pc.max(table.column("date_time")).value)
    row = {}
    for field in schema:
        if field.name in closing:
            row[field.name] = [closing[field.name]]
        elif pa.types.is_timestamp(field.type):
            row[field.name] = [last + _FLUSH_AFTER_MS]
        else:
            row[field.name] = [0 if pa.types.is_integer(field.type) else ""]
    # Newest of all, so that the file source (oldest first) reads it last.
    path = flushed / f"part-{files:05d}-closing.parquet"
    pq.write_table(pa.table(row, schema=schema), path)
    later = time.time_ns() + 10**9
    os.utime(path, ns=(later, later))
    return str(plain), str(flushed)


def _read_back(path: str) -> pa.Table:
    """Parquet files as the references read them (timestamps as timestamp[ms])."""
    table = pq.read_table(path)
    for at, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type):
            table = table.set_column(at, field.name, table.column(at).cast(pa.timestamp("ms")))
    return table


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:   # a filesystem without hard links
        shutil.copy2(source, target)


# --------------------------------------------------------------------------- the queries


def _read(spark, bids: Bids, windowed: bool):
    stream = (spark.readStream.schema(BID_DDL)
              .option("maxFilesPerTrigger", bids.files_per_trigger)
              .parquet(bids.flushed if windowed else bids.plain))
    return stream.withWatermark("date_time", f"{bids.lag_ms} milliseconds") if windowed \
        else stream


def plan_q0(spark, bids: Bids):
    return _read(spark, bids, False)


def plan_q1(spark, bids: Bids):
    return _read(spark, bids, False).withColumn("price", _expr("price * 89 div 100"))


def plan_q2(spark, bids: Bids):
    return _read(spark, bids, False).where("auction % 123 = 0").select("auction", "price")


def plan_tumbling_count(spark, bids: Bids):
    from pyspark.sql import functions as F

    counts = (_read(spark, bids, True).groupBy(F.window("date_time", f"{SIZE_S} seconds"),
                                               "auction").agg(F.count("*").alias("count")))
    return counts.select(F.col("window.start").alias("window_start"),
                         F.col("window.end").alias("window_end"), "auction", "count")


def plan_q5(spark, bids: Bids):
    from pyspark.sql import functions as F

    counts = (_read(spark, bids, True)
              .groupBy(F.window("date_time", f"{SIZE_S} seconds", f"{SLIDE_S} seconds"),
                       "auction").agg(F.count("*").alias("count")))
    # A second stateful aggregation, over the first one's window (Spark 3.4+ chains them).
    best = counts.groupBy("window").agg(
        F.max("count").alias("most"),
        F.collect_list(F.struct("auction", "count")).alias("counts"))
    return (best.select("window", "most", F.explode("counts").alias("c"))
            .where("c.count = most")
            .select(F.col("window.start").alias("window_start"),
                    F.col("window.end").alias("window_end"), "c.auction", "c.count"))


def plan_q7(spark, bids: Bids):
    from pyspark.sql import functions as F

    # One aggregation per window: the highest price and the window's bids, those at the
    # highest price kept when the window closes (faster on Spark than the join below).
    windows = (_read(spark, bids, True).groupBy(F.window("date_time", f"{SIZE_S} seconds"))
               .agg(F.max("price").alias("highest"),
                    F.collect_list(F.struct(*_BID_COLUMNS)).alias("bids")))
    return (windows.select("window", "highest", F.explode("bids").alias("bid"))
            .where("bid.price = highest")
            .select(F.col("window.start").alias("window_start"),
                    F.col("window.end").alias("window_end"), "bid.*"))


def plan_q7_join(spark, bids: Bids):
    from pyspark.sql import functions as F

    # nexmark-flink's form: the highest price per window joined back to the bids (an
    # interval join on the window's last instant, which carries the watermark).
    highest = (_read(spark, bids, True).groupBy(F.window("date_time", f"{SIZE_S} seconds"))
               .agg(F.max("price").alias("highest"))
               .select(F.window_time("window").alias("last_instant"), "highest"))
    stream = _read(spark, bids, True)
    joined = stream.join(highest, (stream.price == highest.highest)
                         & (stream.date_time > highest.last_instant - _expr(
                             f"INTERVAL {SIZE_S} SECONDS"))
                         & (stream.date_time <= highest.last_instant))
    end = F.col("last_instant") + _expr("INTERVAL 1 MICROSECOND")
    return joined.select((end - _expr(f"INTERVAL {SIZE_S} SECONDS")).alias("window_start"),
                         end.alias("window_end"), *_BID_COLUMNS)


def _read_kind(spark, inputs: PersonsAndAuctions, kind: str, windowed: bool):
    ddl = {"person": PERSON_DDL, "auction": AUCTION_DDL}[kind]
    stream = (spark.readStream.schema(ddl).option("maxFilesPerTrigger", inputs.files_per_trigger)
              .parquet((inputs.flushed if windowed else inputs.plain)[kind]))
    return stream.withWatermark("date_time", f"{inputs.lag_ms} milliseconds") if windowed \
        else stream


def plan_q3(spark, inputs: PersonsAndAuctions):
    from pyspark.sql import functions as F

    # nexmark-flink's q3: an unbounded stream-stream inner join (no watermark: both sides'
    # state is kept for ever, as Flink keeps it).
    states = ", ".join(f"'{s}'" for s in ref.Q3_STATES)
    persons = _read_kind(spark, inputs, "person", False).where(f"state IN ({states})").alias("P")
    auctions = (_read_kind(spark, inputs, "auction", False)
                .where(f"category = {ref.Q3_CATEGORY}").alias("A"))
    return auctions.join(persons, F.col("A.seller") == F.col("P.id")).select(
        "P.name", "P.city", "P.state", "A.id")


def plan_q8(spark, inputs: PersonsAndAuctions):
    from pyspark.sql import functions as F

    # nexmark-flink's q8: persons per 10 s window joined with the distinct sellers of that
    # window's auctions, on id and window equality (the window carries the watermark, so
    # both sides' state is dropped once the watermark passes a window's end).
    persons = (_read_kind(spark, inputs, "person", True)
               .select("id", "name", F.window("date_time", f"{SIZE_S} seconds").alias("pw")))
    sellers = (_read_kind(spark, inputs, "auction", True)
               .select("seller", F.window("date_time", f"{SIZE_S} seconds").alias("aw"))
               .dropDuplicates(["seller", "aw"]))
    joined = persons.join(sellers, (persons.id == sellers.seller) & (persons.pw == sellers.aw))
    return joined.select("id", "name", F.col("pw.start").alias("window_start"))


def plan_q11(spark, bids: Bids):
    from pyspark.sql import functions as F

    sessions = (_read(spark, bids, True)
                .groupBy(F.session_window("date_time", f"{SESSION_GAP_S} seconds"), "bidder")
                .agg(F.count("*").alias("count")))
    return sessions.select("bidder", "count",
                           F.col("session_window.start").alias("window_start"),
                           F.col("session_window.end").alias("window_end"))


def _expr(sql: str):
    from pyspark.sql import functions as F

    return F.expr(sql)


QUERIES: dict[str, tuple[Callable, Callable[[pa.Table], pa.Table]]] = {
    "q0": (plan_q0, ref.q0),
    "q1": (plan_q1, ref.q1),
    "q2": (plan_q2, ref.q2),
    "tumbling": (plan_tumbling_count, lambda t: ref.tumbling_count(t, SIZE_S * 1000)),
    "q5": (plan_q5, lambda t: ref.q5(t, SIZE_S * 1000, SLIDE_S * 1000)),
    "q7": (plan_q7, lambda t: ref.q7(t, SIZE_S * 1000)),
    "q7-join": (plan_q7_join, lambda t: ref.q7(t, SIZE_S * 1000)),
    "q3": (plan_q3, lambda t: ref.q3(t["person"], t["auction"])),
    "q8": (plan_q8, lambda t: ref.q8(t["person"], t["auction"], SIZE_S * 1000)),
    "q11": (plan_q11, lambda t: ref.q11(t, SESSION_GAP_S * 1000)),
}
JOIN_QUERIES = ("q3", "q8")
"""The queries over persons and auctions (:func:`write_persons_and_auctions`); the others
read bids (:func:`write_bids`)."""
"""Each query's Structured Streaming plan and its reference."""


def run(spark, name: str, bids: Bids, work: Path) -> tuple[float, pa.Table, dict]:
    """Query ``name`` on Structured Streaming from a fresh checkpoint to the end of the bids:
    events/s, the result (Spark's rows, in no order) and how the run went: ``seconds``,
    micro-batches with input (``batches``) and without (``empty_batches``, which only move
    the watermark), and where the time went (``phases_s``, summed over the batches)."""
    plan = QUERIES[name][0](spark, bids)
    out, checkpoint = work / f"out-{name}", work / f"checkpoint-{name}"
    for folder in (out, checkpoint):
        shutil.rmtree(folder, ignore_errors=True)
    started = time.perf_counter()
    query = (plan.writeStream.format("parquet").outputMode("append")
             .option("path", str(out)).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    seconds = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(f"{name} failed on Structured Streaming: {query.exception()}")
    progress = query.recentProgress
    phases: dict[str, float] = {}
    for p in progress:
        for phase, ms in p.durationMs.items():
            phases[phase] = phases.get(phase, 0.0) + ms / 1e3
    batches = sum(1 for p in progress if p.numInputRows)
    # Read back through Spark, which keeps to the files the sink's log committed.
    result = spark.read.schema(plan.schema).parquet(str(out)).toArrow()
    return bids.events / seconds, result, {"seconds": seconds, "batches": batches,
                                           "empty_batches": len(progress) - batches,
                                           "phases_s": phases}


def comparable(result: pa.Table, expected: pa.Table) -> pa.Table:
    """Spark's result with the reference's columns, types and order."""
    columns = [pc.cast(result.column(f.name), f.type) for f in expected.schema]
    table = pa.Table.from_arrays(columns, schema=expected.schema)
    return table.sort_by([(n, "ascending") for n in table.column_names])


def check(name: str, result: pa.Table, bids: pa.Table) -> pa.Table:
    """The reference of ``name``; raises AssertionError when ``result`` differs."""
    expected = QUERIES[name][1](bids)
    got = comparable(result, expected)
    if not got.equals(expected):
        raise AssertionError(f"{name}: Structured Streaming gave {got.num_rows} rows, the "
                             f"reference {expected.num_rows}; first rows\n"
                             f"{got.slice(0, 5).to_pandas()}\n{expected.slice(0, 5).to_pandas()}")
    return expected


def session(state_store: str = "hdfs"):
    """The local[2] session of the comparison (sparkjet's defaults, 8 shuffle partitions)."""
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "nexmark-sss", **{
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.stateStore.providerClass": SSS_STATE_STORES[state_store]})
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# ------------------------------------------------------------------ pytest-benchmark mode


WARM_UP_EVENTS = 10_000


def warm_up(spark, name: str, work: Path) -> None:
    """Query ``name`` once on other events (its first run in a JVM pays for the plan)."""
    write = write_persons_and_auctions if name in JOIN_QUERIES else write_bids
    run(spark, name, write(work / "warm-up", WARM_UP_EVENTS, files=2, seed=1), work / "warm-up")


def inputs_of(name: str, bids: Bids, joins: PersonsAndAuctions | None):
    """What query ``name`` reads: ``joins`` for q3 and q8, else ``bids``."""
    return joins if name in JOIN_QUERIES else bids


@pytest.fixture(scope="module")
def nexmark_sss(tmp_path_factory):
    work = tmp_path_factory.mktemp("nexmark-sss")
    bids = write_bids(work, events=100_000)
    joins = write_persons_and_auctions(work, events=100_000)
    spark = session()
    yield spark, bids, joins, work
    spark.stop()


@pytest.mark.parametrize("name", list(QUERIES))
def test_nexmark_sss(benchmark, nexmark_sss, name):
    spark, bids, joins, work = nexmark_sss
    benchmark.group = "NEXMark on Structured Streaming"
    warm_up(spark, name, work)
    inputs = inputs_of(name, bids, joins)
    rate, result, info = benchmark.pedantic(run, args=(spark, name, inputs, work), rounds=1,
                                            iterations=1)
    check(name, result, inputs.table())
    benchmark.extra_info.update(events=bids.events, events_per_s=rate, **info)


# ---------------------------------------------------------------------- plain-module mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=EVENTS,
                        help="bids, or persons and auctions for q3 and q8 (200,000)")
    parser.add_argument("--files", type=int, default=FILES)
    parser.add_argument("--files-per-trigger", type=int, default=FILES_PER_TRIGGER)
    parser.add_argument("--events-per-second", type=int, default=EVENTS_PER_SECOND,
                        help="the generator's event-time rate (all kinds)")
    parser.add_argument("--out-of-order-ms", type=int, default=0)
    parser.add_argument("--state-store", choices=sorted(SSS_STATE_STORES), default="hdfs")
    parser.add_argument("--queries", default=",".join(QUERIES),
                        help=f"comma-separated, from {', '.join(QUERIES)}")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(),
                                                           "sparkjet-nexmark-sss"))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.queries.split(",") if n.strip()]
    unknown = sorted(set(names) - set(QUERIES))
    if unknown:
        parser.error(f"unknown queries {unknown}; choose from {', '.join(QUERIES)}")
    work = Path(args.work_dir)
    began = time.perf_counter()
    bids = write_bids(work, args.events, args.files, args.events_per_second,
                      args.out_of_order_ms, files_per_trigger=args.files_per_trigger)
    joins = write_persons_and_auctions(
        work, args.events, args.files, args.events_per_second, args.out_of_order_ms,
        files_per_trigger=args.files_per_trigger) if set(names) & set(JOIN_QUERIES) else None
    table = bids.table()
    tables = {id(bids): table, id(joins): joins.table() if joins else None}
    span = (pc.max(table.column("date_time")).value - pc.min(table.column("date_time")).value)
    print(f"load average {os.getloadavg()[0]:.2f}; {bids.events:,} bids over {span / 1000:.1f} s "
          f"of event time in {args.files} files, written in {time.perf_counter() - began:.1f} s",
          flush=True)
    spark = session(args.state_store)
    rows = []
    try:
        for name in names:
            warm_up(spark, name, work)
            inputs = inputs_of(name, bids, joins)
            rate, result, info = run(spark, name, inputs, work)
            expected = check(name, result, tables[id(inputs)])
            rows.append((name, rate, info, expected.num_rows))
            print(f"  {name}: {rate:,.0f} events/s ({info['seconds']:.1f} s, "
                  f"{info['batches']} + {info['empty_batches']} empty micro-batches, "
                  f"{expected.num_rows:,} rows, equal to the reference); "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(info["phases_s"].items())),
                  flush=True)
    finally:
        spark.stop()
    print(f"\nStructured Streaming, local[2], {args.state_store} state store, "
          f"{bids.events:,} bids (q3, q8: persons and auctions), {args.files_per_trigger} of "
          f"{args.files} files per trigger")
    print(f"{'query':10}{'events/s':>12}{'seconds':>9}{'batches':>9}{'empty':>7}{'rows out':>10}")
    for name, rate, info, out in rows:
        print(f"{name:10}{rate:>12,.0f}{info['seconds']:>9.1f}{info['batches']:>9}"
              f"{info['empty_batches']:>7}{out:>10,}")


if __name__ == "__main__":
    main()
