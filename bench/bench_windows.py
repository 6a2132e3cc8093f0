"""A tumbling count per key and minute on sparkjet beside Spark Structured Streaming, the
rolling aggregation of ``bench_vs_streaming.py`` at the same size, and the members' peak
memory at N and 10 N events.

- **sparkjet tumbling count**: ``GeneratorSource(total=N, partitions=4, keys=1M)``,
  ``.with_timestamps("id")`` (the id read as milliseconds: 60,000 events a window),
  ``group_by("key").window(tumbling(60_000)).aggregate(count="count")`` to ``DiscardSink``;
  ``Job(...).run(spark)`` on ``local[2]``, 2 members, ``local_parallelism=1``, exactly-once
  snapshots every 1 s. Timed from ``Job.run`` to its end (the barrier stage's start and the
  terminal snapshot included; ``after start`` excludes the stage's start). The rows out are
  checked equal to the number of (window, key) pairs of the events. While it runs, the
  resident memory (RSS) of each member's Python worker (and its children) is sampled every
  50 ms with psutil: the peak, at N and at 10 N events, is the state's memory bound (a
  window's state is dropped when it fires, so it should not grow with N).
- **Structured Streaming**: the same events (``GeneratorSource.events``, written once as
  Parquet files), ``withWatermark`` 0 on ``timestamp_millis(id)``, ``groupBy(window(...,
  "1 minute"), key).count()``, append mode, ``noop`` sink, ``maxFilesPerTrigger`` 4,
  ``availableNow``, HDFS state store, 8 shuffle partitions, in this process's session; one
  more file, read last, holds an event an hour later so that append mode emits the last
  windows. Timed from building the query to its end (JVM start excluded), after one run on
  other, smaller data; its rows out (the sink's ``numOutputRows``) are checked too.
- **rolling count + sum** (``bench_vs_streaming.sparkjet_throughput``, exactly-once 1 s):
  the same N, to show the windows left it unchanged (README: 7.07 M events/s at 20M).

Run: ``python bench/bench_windows.py --events 20000000`` (the issue's size; 10 N = 200M
takes minutes), ``--skip-sss``, ``--skip-rolling``; writes ``bench/results/windows.json``.
``python -m pytest bench/bench_windows.py --benchmark-only`` runs sparkjet's tumbling count
on 2M events.
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
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_vs_streaming as vs  # noqa: E402 - after the path
import streaming_competitors as rivals  # noqa: E402

KEYS = 1_000_000
WINDOW_MS = 60_000
PARTITIONS = 4
FILES = 40


def expected_rows(events: int, keys: int = KEYS, seed: int = 0) -> int:
    """The (window, key) pairs of the first ``events`` generated events: the tumbling
    count's rows."""
    from sparkjet.sources import GeneratorSource

    source = GeneratorSource(total=events, partitions=PARTITIONS, keys=keys, seed=seed)
    total = 0
    for start in range(0, events, WINDOW_MS * 50):
        stop = min(events, start + WINDOW_MS * 50)
        table = source.events(start, stop)
        pair = (table.column("id").to_numpy() // WINDOW_MS) * keys + table.column("key").to_numpy()
        total += len(np.unique(pair))
    return total


class PeakRss:
    """Samples the RSS of ``pids()`` (and their children) every ``period`` seconds in a
    thread; ``peak`` is the greatest per-process RSS seen, ``peak_total`` the greatest sum."""

    def __init__(self, pids, period: float = 0.05):
        self.pids, self.period = pids, period
        self.peak = self.peak_total = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.period):
            total = 0
            for pid in list(self.pids()):
                try:
                    proc = psutil.Process(pid)
                    rss = proc.memory_info().rss + sum(
                        c.memory_info().rss for c in proc.children(recursive=True))
                except psutil.Error:
                    continue
                self.peak = max(self.peak, rss)
                total += rss
            if total:
                self.samples += 1
                self.peak_total = max(self.peak_total, total)


def timed_run(spark, job, events: int, snaps: Path, label: str) -> dict:
    """Runs ``job`` on ``spark``, timed from ``Job.run`` to its end and from the barrier
    stage's start, with its members' peak RSS; removes its snapshots (``snaps``)."""
    marks: dict[str, float] = {}

    def progress(event):
        if event["event"] == "started":
            marks.setdefault("started", time.monotonic())

    with PeakRss(lambda: job.member_pids.values()) as rss:
        start = time.monotonic()
        result = job.run(spark, on_progress=progress)
        seconds = time.monotonic() - start
    shutil.rmtree(snaps, ignore_errors=True)
    if result.events_in != events:
        raise AssertionError(f"{label}: {result.events_in} events in, expected {events}")
    return {"events": events, "events_per_s": events / seconds, "seconds": seconds,
            "events_per_s_running": events / (start + seconds - marks["started"]),
            "start_s": marks["started"] - start, "rows_out": result.events_out,
            "snapshots": len(result.snapshots),
            "snapshot_mb": max((s["bytes"] for s in result.snapshots), default=0) / 1e6,
            "peak_rss_mb": rss.peak / 1e6, "peak_rss_total_mb": rss.peak_total / 1e6,
            "rss_samples": rss.samples}


def sparkjet_tumbling(spark, events: int, work: Path, check: bool = True) -> dict:
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import DiscardSink
    from sparkjet.sources import GeneratorSource
    from sparkjet.windows import tumbling

    source = GeneratorSource(total=events, partitions=PARTITIONS, keys=KEYS)
    pipeline = (Pipeline().read_from(source).with_timestamps("id").group_by("key")
                .window(tumbling(WINDOW_MS)).aggregate(count="count").write_to(DiscardSink()))
    snaps = work / f"tumbling-{time.time_ns()}"
    config = JobConfig(name=f"windows-{time.time_ns()}", members=2, local_parallelism=1,
                       processing_guarantee="exactly-once", snapshot_interval=1.0,
                       snapshot_store=str(snaps))
    out = timed_run(spark, Job(pipeline, config), events, snaps, "tumbling count")
    if check:
        out["rows_expected"] = expected_rows(events)
        if out["rows_expected"] != out["rows_out"]:
            raise AssertionError(f"tumbling count: {out['rows_out']} rows out, "
                                 f"expected {out['rows_expected']}")
    return out


# ------------------------------------------------------------- Structured Streaming side


def write_events(work: Path, events: int, files: int = FILES) -> Path:
    """The generator's first ``events`` events (id, key, value) as Parquet files, and a
    last file (newest) with one event an hour after them (cached by size)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparkjet.sources import GeneratorSource

    root = work / f"gen-{events}-{files}"
    if (root / "DONE").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    source = GeneratorSource(total=events, partitions=PARTITIONS, keys=KEYS)
    for i in range(files):
        table = source.events(events * i // files, events * (i + 1) // files)
        pq.write_table(table.select(["id", "key", "value"]), root / f"part-{i:05d}.parquet")
    closing = root / f"part-{files:05d}-closing.parquet"
    pq.write_table(pa.table({"id": [events + 3_600_000], "key": [-1], "value": [0.0]}), closing)
    later = time.time_ns() + 10**9
    os.utime(closing, ns=(later, later))
    (root / "DONE").write_text("")
    return root


def sss_tumbling(spark, parquet_dir: Path, events: int, work: Path) -> dict:
    from pyspark.sql import functions as F

    started = time.perf_counter()
    stream = (spark.readStream.schema("id BIGINT, key BIGINT, value DOUBLE")
              .option("maxFilesPerTrigger", 4).parquet(str(parquet_dir))
              .withColumn("t", F.timestamp_millis("id")).withWatermark("t", "0 seconds"))
    counts = stream.groupBy(F.window("t", "1 minute"), "key").agg(F.count("*").alias("count"))
    return run_sss_query(counts, "append", events, work, started)


def run_sss_query(out, mode: str, events: int, work: Path, started: float) -> dict:
    """Runs the streaming DataFrame ``out`` to the ``noop`` sink (``availableNow``, a fresh
    checkpoint under ``work``) and times it from ``started`` (when the query was built)."""
    checkpoint = work / f"sss-checkpoint-{time.time_ns()}"
    query = (out.writeStream.format("noop").outputMode(mode)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination()
    seconds = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(f"Structured Streaming failed: {query.exception()}")
    progress = query.recentProgress
    rows_out = sum(p.sink.numOutputRows for p in progress if p.sink.numOutputRows > 0)
    shutil.rmtree(checkpoint, ignore_errors=True)
    return {"events": events, "events_per_s": events / seconds, "seconds": seconds,
            "rows_out": rows_out, "batches": sum(1 for p in progress if p.numInputRows),
            "micro_batches": len(progress)}


# ------------------------------------------------------------------ pytest-benchmark mode


@pytest.fixture(scope="module")
def spark_session():
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "bench-windows", **{"spark.ui.showConsoleProgress": "false"})
    yield spark
    spark.stop()


def test_tumbling_count(benchmark, spark_session, tmp_path):
    benchmark.group = "tumbling count per key and minute"
    sparkjet_tumbling(spark_session, 200_000, tmp_path, check=False)   # starts the workers
    r = benchmark.pedantic(sparkjet_tumbling, args=(spark_session, 2_000_000, tmp_path),
                           rounds=1, iterations=1)
    benchmark.extra_info.update(r)


# ---------------------------------------------------------------------- plain-module mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000_000, help="N (20,000,000)")
    parser.add_argument("--scale", type=int, default=10, help="the memory run's N multiple")
    parser.add_argument("--skip-sss", action="store_true")
    parser.add_argument("--skip-rolling", action="store_true")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(),
                                                           "sparkjet-windows-bench"))
    parser.add_argument("--out", default=str(BENCH / "results" / "windows"))
    args = parser.parse_args(argv)
    n = args.events
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    parquet = None if args.skip_sss else write_events(work, n)
    data = None if args.skip_rolling else rivals.make_data(work, n, KEYS, rivals.FILES)
    log_root = None if data is None else vs.arrow_log(data, work)
    print(f"load average {os.getloadavg()[0]:.2f}; N = {n:,} events, {KEYS:,} keys", flush=True)

    from sparkjet.spark import local_session

    spark = local_session("local[2]", "bench-windows", **{
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.stateStore.providerClass": rivals.SSS_STATE_STORES["hdfs"]})
    spark.sparkContext.setLogLevel("ERROR")
    results: dict = {"events": n, "keys": KEYS}
    try:
        sparkjet_tumbling(spark, 500_000, work, check=False)   # starts the Python workers
        results["tumbling"] = sparkjet_tumbling(spark, n, work)
        print("  sparkjet tumbling N:", json.dumps(results["tumbling"]), flush=True)
        results["tumbling_10n"] = sparkjet_tumbling(spark, n * args.scale, work, check=False)
        print(f"  sparkjet tumbling {args.scale}N:", json.dumps(results["tumbling_10n"]),
              flush=True)
        if log_root is not None:
            results["rolling"] = vs.sparkjet_throughput(spark, log_root, n, "exactly-once", work)
            print("  sparkjet rolling:", json.dumps(results["rolling"]), flush=True)
        if parquet is not None:
            warm = write_events(work / "warm-up", 200_000, files=4)
            sss_tumbling(spark, warm, 200_000, work)
            results["sss"] = sss_tumbling(spark, parquet, n, work)
            results["sss"]["rows_expected"] = results["tumbling"]["rows_expected"]
            print("  sss tumbling:", json.dumps(results["sss"]), flush=True)
    finally:
        spark.stop()
    results["load_average_end"] = os.getloadavg()[0]
    t, t10 = results["tumbling"], results["tumbling_10n"]
    print(f"\ntumbling count per key and minute, {KEYS:,} keys, local[2], exactly-once 1 s")
    print(f"{'run':38}{'events':>13}{'events/s':>12}{'after start':>13}{'peak RSS/member':>17}")
    for label, r in (("sparkjet tumbling, N", t), (f"sparkjet tumbling, {args.scale}N", t10)):
        print(f"{label:38}{r['events']:>13,}{r['events_per_s'] / 1e6:>10.2f} M"
              f"{r['events_per_s_running'] / 1e6:>11.2f} M{r['peak_rss_mb']:>14.0f} MB")
    if "rolling" in results:
        r = results["rolling"]
        print(f"{'sparkjet rolling count+sum, N':38}{n:>13,}{r['events_per_s'] / 1e6:>10.2f} M"
              f"{r['events_per_s_running'] / 1e6:>11.2f} M")
    if "sss" in results:
        r = results["sss"]
        print(f"{'Structured Streaming tumbling, N':38}{n:>13,}{r['events_per_s'] / 1e6:>10.2f} M"
              f"   (sparkjet is {t['events_per_s'] / r['events_per_s']:.1f}x; rows out "
              f"{r['rows_out']:,}, expected {r['rows_expected']:,})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
