"""The ``sparkjet`` command (also ``python -m sparkjet``).

``sparkjet demo`` runs the main job (:mod:`sparkjet.cli.demo`): a keyed aggregation on local
Spark with crashes, live progress and the checker's verdict. ``sparkjet partition-demo``
partitions a generated DataFrame on local Spark and prints the histogram of rows per
Hazelcast partition and the speed of the partitioning, on Spark and on the driver.
``sparkjet snapshots list|show|verify URI`` looks inside a snapshot store; ``sparkjet jobs
URI`` lists its jobs by name with their state, last snapshot and exports.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence

from sparkjet.cli.args import positive_int
from sparkjet.errors import InvalidArgumentError, SparkjetError
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT, partition_ids
from sparkjet.spark import local_session, with_partition_id

# Knuth's multiplicative constant: spreads consecutive ids over the key space, and being prime
# it makes (id * K) % keys take min(rows, keys) distinct values unless keys is a multiple of K.
_KNUTH = 2654435761
_BAR_WIDTH = 40


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code:
    0, 1 where a command says so (a failed check), 2 with a one-line error on stderr for
    bad arguments, missing paths and every other error sparkjet or the system reports."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("give a command: " + ", ".join(parser.commands.choices))
    try:
        return args.run(args)
    except (SparkjetError, OSError) as e:
        print(f"sparkjet {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sparkjet {args.command}: interrupted", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(error) -> str:
    return " ".join(str(error).split())


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sparkjet",
        description="Hazelcast Jet's partitioning and fault tolerance for PySpark.",
    )
    parser.set_defaults(command=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    parser.commands = commands
    # Each subcommand's module loads only when the parser is built for it.
    from sparkjet.cli.demo import add_parser as add_demo

    add_demo(commands)
    demo = commands.add_parser(
        "partition-demo",
        help="partition a generated DataFrame on local Spark; print the histogram and speed",
        description=(
            "Generate ROWS rows on Spark (spark.range), add the Hazelcast partition of a key "
            "column with sparkjet.spark.with_partition_id, and print the histogram of rows per "
            "partition, the wall time of the partitioning job (against the same job without "
            "it), and the speed of sparkjet.partition_ids on the driver for as many keys. "
            "Needs Java 17+ (JAVA_HOME, `java` on PATH, or a JDK in the usual folders)."
        ),
    )
    demo.add_argument("--rows", type=positive_int, default=10_000_000,
                      help="number of rows to generate, one key each (default: 10,000,000)")
    demo.add_argument("--partitions", type=positive_int, default=DEFAULT_PARTITION_COUNT,
                      help=f"Hazelcast partition count (default: {DEFAULT_PARTITION_COUNT})")
    demo.add_argument("--master", default="local[2]", help="Spark master URL (default: local[2])")
    demo.add_argument("--key-type", choices=("long", "string"), default="long",
                      help="long: (id * 2654435761) %% KEYS as a Hazelcast Long; "
                           "string: 'key-<that number>' as a Hazelcast String (default: long)")
    demo.add_argument("--keys", type=positive_int, default=None,
                      help="key space: keys are taken modulo KEYS (default: ROWS, every key "
                           "distinct)")
    demo.add_argument("--rounds", type=positive_int, default=2,
                      help="times each Spark job is timed; the best counts (default: 2)")
    demo.set_defaults(command="partition-demo", run=_demo)
    # (as above)
    from sparkjet.cli.snapshots import add_jobs_parser
    from sparkjet.cli.snapshots import add_parser as add_snapshots

    add_snapshots(commands)
    add_jobs_parser(commands)
    return parser


def _demo(args: argparse.Namespace) -> int:
    rows, count = args.rows, args.partitions
    keys = args.keys or rows
    if rows * _KNUTH > 2**63 - 1:
        raise InvalidArgumentError(
            f"--rows {rows:,} is too many: id * {_KNUTH} must fit a long, so at most "
            f"{(2**63 - 1) // _KNUTH:,} rows"
        )
    # PySpark warns about pandas versions on every mapInArrow; the demo uses no pandas.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")

    started = time.perf_counter()
    spark = local_session(args.master, "sparkjet-demo", **{"spark.ui.showConsoleProgress": False})
    session_seconds = time.perf_counter() - started
    spark_version = spark.version  # read before stop()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        frame = _key_frame(spark, rows, keys, args.key_type)
        timings = _time_jobs(spark, frame, rows, count, args.key_type, keys, args.rounds)
        histogram = _histogram(frame, count)
    finally:
        spark.stop()
    driver = _time_driver(rows, keys, count, args.key_type)

    print(f"sparkjet partition-demo: Hazelcast partitioning of {rows:,} {args.key_type} keys "
          f"on Spark {args.master}")
    print()
    _table([
        ("rows", f"{rows:,}"),
        ("keys", (f"{min(keys, rows):,} distinct {args.key_type} keys: "
                  f"{_key_formula(args.key_type, keys)}")),
        ("partition_count", f"{count:,}"),
        ("members / backups", "none: partitioning only, no partition table"),
        ("Spark", f"{spark_version} on Java at {os.environ.get('JAVA_HOME', '?')}"),
        ("session start", f"{session_seconds:.2f} s"),
    ])
    print()
    print(f"partitioning job on Spark (noop write, best of {args.rounds}; rows/s over all rows)")
    _table(_timing_rows(timings, rows))
    print()
    print("rows per partition")
    _table(_histogram_rows(histogram, rows, keys))
    print()
    _print_buckets(histogram)
    print()
    _print_extremes(histogram)
    print()
    print(f"driver: sparkjet.partition_ids on {rows:,} {args.key_type} keys (best of 3)")
    _table([
        ("wall time", _seconds(driver)),
        ("per key", f"{driver / rows * 1e9:.2f} ns/key"),
        ("throughput", f"{rows / driver / 1e6:,.1f} M keys/s"),
    ])
    return 0


def _key_formula(key_type: str, keys: int) -> str:
    number = f"(id * {_KNUTH}) % {keys:,}"
    return number if key_type == "long" else f"'key-' || {number}"


def _key_frame(spark, rows: int, keys: int, key_type: str):
    from pyspark.sql import functions as F

    number = (F.col("id") * F.lit(_KNUTH)) % F.lit(keys)
    key = number if key_type == "long" else F.concat(F.lit("key-"), number.cast("string"))
    return spark.range(rows).select("id", key.alias("key"))


def _time_jobs(
    spark, frame, rows: int, count: int, key_type: str, keys: int, rounds: int
) -> dict[str, float]:
    """Best wall times of three noop writes: the generated frame alone, a round trip of its
    Arrow batches through Python (``mapInArrow`` returning its input), and
    :func:`with_partition_id`. All three first run on up to a million rows, so the Python
    workers and the JVM's compiled code are warm for every one of them; then the three run
    in turn, ``rounds`` times."""
    jobs: dict[str, Callable] = {
        "Spark alone": lambda f: f,
        "Arrow round trip to Python": lambda f: f.mapInArrow(_identity, f.schema),
        "with_partition_id": lambda f: with_partition_id(f, "key", count),
    }
    warm_rows = min(rows, 1_000_000)
    warm = _key_frame(spark, warm_rows, min(keys, warm_rows), key_type)
    for job in jobs.values():
        _noop_write(job(warm))
    timings = dict.fromkeys(jobs, math.inf)
    for _ in range(rounds):
        for name, job in jobs.items():
            started = time.perf_counter()
            _noop_write(job(frame))
            timings[name] = min(timings[name], time.perf_counter() - started)
    return timings


def _identity(batches):
    yield from batches


def _noop_write(frame) -> None:
    frame.write.format("noop").mode("overwrite").save()


def _histogram(frame, count: int) -> list[int]:
    """Rows per partition, partitions without rows included (as 0)."""
    loads = [0] * count
    for row in with_partition_id(frame, "key", count).groupBy("partition_id").count().collect():
        loads[row["partition_id"]] = row["count"]
    return loads


def _time_driver(rows: int, keys: int, count: int, key_type: str) -> float:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc


    values = pa.array((np.arange(rows, dtype=np.int64) * _KNUTH) % keys)
    if key_type == "string":
        values = pc.binary_join_element_wise("key-", values.cast(pa.string()), "")
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        partition_ids(values, count)
        best = min(best, time.perf_counter() - started)
    return best


def _timing_rows(timings: dict[str, float], rows: int) -> list[tuple[str, str]]:
    out = [(name, f"{seconds:8.2f} s  {rows / seconds / 1e6:8.2f} M rows/s")
           for name, seconds in timings.items()]
    cost = timings["with_partition_id"] - timings["Arrow round trip to Python"]
    total = timings["with_partition_id"] - timings["Spark alone"]
    note = "with_partition_id - Arrow round trip"
    if cost < 0:
        note += "; below zero: within the noise"
    out.append(("partitioning cost", f"{cost:8.2f} s  ({note})"))
    out.append(("total overhead", f"{total:8.2f} s  (with_partition_id - Spark alone)"))
    return out


def _histogram_rows(loads: list[int], rows: int, keys: int) -> list[tuple[str, str]]:
    mean = statistics.fmean(loads)
    stddev = statistics.pstdev(loads)
    share = 1 / len(loads)
    # Keys hashed uniformly at random give each partition a binomial number of keys.
    expected = math.sqrt(min(rows, keys) * share * (1 - share)) * rows / min(rows, keys)
    return [
        ("histogram total", f"{sum(loads):,} rows"),
        ("partitions with rows", f"{sum(1 for n in loads if n):,} of {len(loads):,}"),
        ("min / max", f"{min(loads):,} / {max(loads):,} rows"),
        ("mean / stddev", (f"{mean:,.1f} / {stddev:,.1f} rows"
                           f"  (uniform random hashing: stddev ~ {expected:,.1f})")),
        ("max / mean", f"{max(loads) / mean:.3f}" if mean else "-"),
    ]


def _print_buckets(loads: list[int], buckets: int = 10) -> None:
    """Partitions grouped by load into ``buckets`` equal ranges of rows, as text bars."""
    low, high = min(loads), max(loads)
    width = max(1, math.ceil((high - low + 1) / buckets))
    counts = [0] * buckets
    for n in loads:
        counts[min((n - low) // width, buckets - 1)] += 1
    biggest = max(counts)
    label = max(len(f"{low + i * width:,} - {low + (i + 1) * width - 1:,}")
                for i in range(buckets))
    label = max(label, len("rows per partition"))
    print("partitions by load")
    print(f"  {'rows per partition':>{label}}  partitions")
    for i, c in enumerate(counts):
        if low + i * width > high:
            break
        bounds = f"{low + i * width:,} - {low + (i + 1) * width - 1:,}"
        bar = "#" * max(1 if c else 0, round(c / biggest * _BAR_WIDTH))
        print(f"  {bounds:>{label}}  {c:10,}  {bar}")


def _print_extremes(loads: list[int], n: int = 5) -> None:
    order = sorted(range(len(loads)), key=lambda p: (loads[p], p))
    fullest = ", ".join(f"{p}: {loads[p]:,}" for p in reversed(order[-n:]))
    emptiest = ", ".join(f"{p}: {loads[p]:,}" for p in order[:n])
    _table([(f"fullest {min(n, len(loads))}", fullest),
            (f"emptiest {min(n, len(loads))}", emptiest)])


def _seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _table(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")


if __name__ == "__main__":
    raise SystemExit(main())
