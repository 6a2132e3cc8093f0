"""Keyed state of the user's own and deduplication on sparkjet, beside what a Spark user
would write instead: Structured Streaming's ``applyInPandasWithState`` and
``dropDuplicatesWithinWatermark``.

- **map_state, running max per key**: ``GeneratorSource(total=N, partitions=4, keys=1M)``,
  ``group_by("key").map_state(running_max, state=(top: double))`` (a vectorized function:
  ``np.maximum.reduceat`` over the batch's rows grouped by key, against the keys' state),
  its output (every touched key's new max) to ``DiscardSink``; ``Job(...).run(spark)`` on
  ``local[2]``, 2 members, ``local_parallelism=1``, exactly-once snapshots every 1 s. Timed
  from ``Job.run`` to its end (the barrier stage's start included; ``after start``
  excludes it). The rows out are checked: one per (batch, key) pair, at least one per key.
- **map_stateful, the same per row**: a Python object per key, ``fn(state, key, row)``
  per event, on N / 20 events (it is that much slower): the per-row form's cost.
- **deduplicate**: the same events with one in ten repeating the one before it (``uid``),
  ``with_timestamps("id", max_lag=10).deduplicate("uid", within=10_000)``; the rows out
  are checked equal to the distinct uids.
- **Structured Streaming**: the same events as Parquet files (``maxFilesPerTrigger`` 4,
  ``availableNow``, HDFS state store, 8 shuffle partitions, ``noop`` sink, this process's
  session, after a run on smaller data): ``groupBy("key").applyInPandasWithState`` (update
  mode, the running max in the group state) and ``withWatermark("t", "10 seconds")
  .dropDuplicatesWithinWatermark(["uid"])`` on ``t = timestamp_millis(id)``; their rows
  out are checked the same way.

Run: ``python bench/bench_stateful.py --events 20000000`` (``--skip-sss`` for sparkjet
alone); writes ``bench/results/stateful.json``. ``python -m pytest bench/bench_stateful.py
--benchmark-only`` runs sparkjet's three jobs on 1M events.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_windows as windows  # noqa: E402 - after the path
import streaming_competitors as rivals  # noqa: E402

# The jobs' functions live here: Spark's workers cannot import this file, so they travel by
# value whether this runs as a script or is imported (pytest, another script).
from pyspark import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

KEYS = windows.KEYS
TOP = pa.schema([("top", pa.float64())])
WITHIN = 10_000


def running_max(b):
    top = np.maximum(np.maximum.reduceat(b.rows["value"].to_numpy(), b.offsets[:-1]),
                     b.state["top"].fill_null(-np.inf).to_numpy())
    return b.keys.append_column("top", pa.array(top)), {"top": top}


class Top:
    def __init__(self):
        self.top = -np.inf


def row_max(state, key, row):
    if row["value"] > state.top:
        state.top = row["value"]
        return {"key": key, "top": state.top}
    return None


def with_uid(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``uid``: the id, but one event in ten repeats the one before it."""
    ids = batch["id"]
    return batch.append_column("uid", pc.if_else(pc.equal(pc.remainder(ids, 10), 9),
                                                 pc.subtract(ids, 1), ids))


def pipelines(kind: str, source):
    from sparkjet.pipeline import Pipeline
    from sparkjet.sinks import DiscardSink

    p = Pipeline().read_from(source)
    if kind == "map_state":
        p = p.group_by("key").map_state(running_max, state=TOP)
    elif kind == "map_stateful":
        p = p.group_by("key").map_stateful(Top, row_max)
    else:
        p = p.map_batches(with_uid).with_timestamps("id", max_lag=10).deduplicate("uid", within=WITHIN)
    return p.write_to(DiscardSink())


def sparkjet_job(spark, kind: str, events: int, work: Path) -> dict:
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sources import GeneratorSource

    source = GeneratorSource(total=events, partitions=windows.PARTITIONS, keys=KEYS)
    snaps = work / f"{kind}-{time.time_ns()}"
    config = JobConfig(name=f"{kind}-{time.time_ns()}", members=2, local_parallelism=1,
                       processing_guarantee="exactly-once", snapshot_interval=1.0,
                       snapshot_store=str(snaps))
    return windows.timed_run(spark, Job(pipelines(kind, source), config), events, snaps, kind)


def distinct_uids(events: int) -> int:
    """Every id but those repeating the one before them (``id % 10 == 9``)."""
    return events - int((np.arange(events) % 10 == 9).sum())


def distinct_keys(events: int) -> int:
    from sparkjet.sources import GeneratorSource

    source = GeneratorSource(total=events, partitions=windows.PARTITIONS, keys=KEYS)
    seen = np.zeros(KEYS, bool)
    for start in range(0, events, 1 << 22):
        seen[source.events(start, min(events, start + (1 << 22))).column("key").to_numpy()] = True
    return int(seen.sum())


def check(kind: str, r: dict) -> None:
    if kind == "dedup":
        r["rows_expected"] = distinct_uids(r["events"])
        if r["rows_out"] != r["rows_expected"]:
            raise AssertionError(f"dedup: {r['rows_out']} rows out, expected {r['rows_expected']}")
    else:
        r["keys_expected"] = distinct_keys(r["events"])
        if r["rows_out"] < r["keys_expected"]:
            raise AssertionError(f"{kind}: {r['rows_out']} rows out for {r['keys_expected']} keys")


# ------------------------------------------------------------- Structured Streaming side


def sss_job(spark, kind: str, parquet_dir: Path, events: int, work: Path) -> dict:
    import pandas as pd
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    started = time.perf_counter()
    stream = (spark.readStream.schema("id BIGINT, key BIGINT, value DOUBLE")
              .option("maxFilesPerTrigger", 4).parquet(str(parquet_dir)))
    if kind == "map_state":
        def update(key, frames, state):
            top = state.get[0] if state.exists else -np.inf
            for f in frames:
                top = max(top, float(f["value"].max()))
            state.update((top,))
            yield pd.DataFrame({"key": [key[0]], "top": [top]})

        out = stream.groupBy("key").applyInPandasWithState(
            update, "key LONG, top DOUBLE", "top DOUBLE", "update", GroupStateTimeout.NoTimeout)
        mode = "update"
    else:
        out = (stream.withColumn("uid", F.when(F.col("id") % 10 == 9, F.col("id") - 1).otherwise(F.col("id")))
               .withColumn("t", F.timestamp_millis("id")).withWatermark("t", "10 seconds")
               .dropDuplicatesWithinWatermark(["uid"]))
        mode = "append"
    r = windows.run_sss_query(out, mode, events, work, started)
    r["rows_out"] -= 1       # the closing file's event (an hour later) is one more row of each
    return r


# ------------------------------------------------------------------ pytest-benchmark mode


@pytest.fixture(scope="module")
def spark_session():
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "bench-stateful", **{"spark.ui.showConsoleProgress": "false"})
    yield spark
    spark.stop()


@pytest.mark.parametrize("kind", ["map_state", "dedup"])
def test_stateful(benchmark, spark_session, tmp_path, kind):
    benchmark.group = "keyed state and deduplication, 1M events"
    sparkjet_job(spark_session, kind, 100_000, tmp_path)     # starts the workers
    r = benchmark.pedantic(sparkjet_job, args=(spark_session, kind, 1_000_000, tmp_path),
                           rounds=1, iterations=1)
    check(kind, r)
    benchmark.extra_info.update(r)


# ---------------------------------------------------------------------- plain-module mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000_000, help="N (20,000,000)")
    parser.add_argument("--per-row-fraction", type=int, default=20,
                        help="map_stateful runs on N / this many events (20)")
    parser.add_argument("--skip-sss", action="store_true")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(),
                                                           "sparkjet-stateful-bench"))
    parser.add_argument("--out", default=str(BENCH / "results" / "stateful"))
    args = parser.parse_args(argv)
    n = args.events
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    parquet = None if args.skip_sss else windows.write_events(work, n)
    print(f"load average {os.getloadavg()[0]:.2f}; N = {n:,} events, {KEYS:,} keys", flush=True)

    from sparkjet.spark import local_session

    spark = local_session("local[2]", "bench-stateful", **{
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.stateStore.providerClass": rivals.SSS_STATE_STORES["hdfs"]})
    spark.sparkContext.setLogLevel("ERROR")
    results: dict = {"events": n, "keys": KEYS}
    try:
        sparkjet_job(spark, "map_state", 200_000, work)        # starts the Python workers
        for kind, events in (("map_state", n), ("map_stateful", n // args.per_row_fraction),
                             ("dedup", n)):
            r = results[kind] = sparkjet_job(spark, kind, events, work)
            check(kind, r)
            print(f"  sparkjet {kind}:", json.dumps(r), flush=True)
        if parquet is not None:
            warm = windows.write_events(work / "warm-up", 200_000, files=4)
            for kind in ("map_state", "dedup"):
                sss_job(spark, kind, warm, 200_000, work)
                r = results[f"sss_{kind}"] = sss_job(spark, kind, parquet, n, work)
                check(kind, r)
                print(f"  sss {kind}:", json.dumps(r), flush=True)
    finally:
        spark.stop()
    results["load_average_end"] = os.getloadavg()[0]
    print(f"\nkeyed state and deduplication, {KEYS:,} keys, local[2], exactly-once 1 s")
    print(f"{'run':44}{'events':>13}{'events/s':>12}{'after start':>13}{'vs SSS':>9}")
    for kind, label in (("map_state", "sparkjet map_state (running max)"),
                        ("map_stateful", "sparkjet map_stateful (per row)"),
                        ("dedup", "sparkjet deduplicate (10% repeats)"),
                        ("sss_map_state", "SSS applyInPandasWithState"),
                        ("sss_dedup", "SSS dropDuplicatesWithinWatermark")):
        r = results.get(kind)
        if r is None:
            continue
        rival = results.get(f"sss_{kind}")
        ratio = f"{r['events_per_s'] / rival['events_per_s']:>8.1f}x" if rival else ""
        running = f"{r['events_per_s_running'] / 1e6:>11.2f} M" if "events_per_s_running" in r else " " * 13
        print(f"{label:44}{r['events']:>13,}{r['events_per_s'] / 1e6:>10.2f} M{running}{ratio}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
