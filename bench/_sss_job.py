"""One Spark Structured Streaming run of the end-to-end benchmark, started by
``streaming_competitors.py`` in a process of its own (so a kill -9 takes down exactly this
driver and its JVM).

A ``local[2]`` session from :func:`sparkjet.spark.local_session` reads the Parquet events with
``maxFilesPerTrigger``, groups by key with ``count(id)`` and ``sum(value)`` in update mode and
writes to the ``noop`` sink, trigger ``availableNow``, checkpointing into
``--checkpoint-dir`` with the given state store. Restarting with the same checkpoint folder
resumes from it.

Prints one JSON object a line on stdout: ``started`` (JVM and session up), ``query`` (the query
was started), ``progress`` (one per completed micro-batch, from a query listener), then
``done``.
"""
import argparse
import json
import threading
import time


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parquet-dir", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--state-store-class", required=True)
    parser.add_argument("--max-files-per-trigger", type=int, default=4)
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--stop-after-batches", type=int, default=0,
                        help="stop the query after this many micro-batches (0: run to the end)")
    args = parser.parse_args()

    jvm_start = time.time()
    from pyspark.sql import functions as F
    from pyspark.sql.streaming import StreamingQueryListener

    from sparkjet.spark import local_session

    spark = local_session("local[2]", "sss-bench", **{
        "spark.sql.shuffle.partitions": str(args.shuffle_partitions),
        "spark.sql.streaming.stateStore.providerClass": args.state_store_class,
        "spark.driver.memory": args.driver_memory,
        "spark.ui.showConsoleProgress": "false",
    })
    spark.sparkContext.setLogLevel("WARN")
    emit("started", jvm_start=jvm_start)

    enough = threading.Event()

    class Progress(StreamingQueryListener):
        """Reports each completed micro-batch as it completes (polling lastProgress would
        add the polling period to the recovery time)."""

        def __init__(self):
            self.batches = 0

        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            p = event.progress
            state = p.stateOperators[0] if p.stateOperators else None
            emit("progress", batch=p.batchId, rows=p.numInputRows, durations_ms=dict(p.durationMs),
                 state_rows=state.numRowsTotal if state else 0,
                 state_memory_bytes=state.memoryUsedBytes if state else 0,
                 state_commit_ms=state.commitTimeMs if state else 0)
            self.batches += 1
            if args.stop_after_batches and self.batches >= args.stop_after_batches:
                enough.set()

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            pass

    spark.streams.addListener(Progress())

    query_start = time.time()
    events = (spark.readStream.schema("id long, key long, value double")
              .option("maxFilesPerTrigger", args.max_files_per_trigger)
              .parquet(args.parquet_dir))
    totals = events.groupBy("key").agg(F.count("id").alias("n"), F.sum("value").alias("total"))
    query = (totals.writeStream.format("noop").outputMode("update")
             .option("checkpointLocation", args.checkpoint_dir)
             .trigger(availableNow=True).start())
    emit("query", query_start=query_start)
    while query.isActive and not enough.is_set():
        query.awaitTermination(0.05)
    done = time.time()
    if enough.is_set():
        query.stop()
    # The listener's events arrive asynchronously; recentProgress is the full record.
    batches = [{"batch": p.batchId, "rows": p.numInputRows,
                "ms": p.durationMs.get("triggerExecution", 0)} for p in query.recentProgress]
    emit("done", jvm_start=jvm_start, query_start=query_start, done=done, batches=batches,
         exception=str(query.exception()) if query.exception() else None)
    spark.stop()


if __name__ == "__main__":
    main()
