"""Merkle trees over 10M keyed rows: build rate, diff + sync plan beside a join-based diff,
and bytes exchanged by a SyncSession beside the bytes of the whole dataset.

Two ways to run it (see bench/README.md):

    python bench/bench_merkle.py              # summary tables, a few minutes
    python bench/bench_merkle.py --spark      # also Spark join diff vs merkle_diff, local[2]
    python -m pytest bench/bench_merkle.py --benchmark-only

Workload: a fresh table of 10M rows (id int64, unique, uniformly spread; value int64) and a
stale copy that differs in D rows: 80 % updated values, 10 % rows only in fresh (inserted),
10 % only in stale (deleted), for D = 0.012 % (1,200 rows), 1 % and 10 %. Every plan is
checked: applying it to stale gives fresh. sparkjet runs on one core (the GIL-free native
kernels are single-threaded); pyarrow's join is shown with its thread pool and with one
thread. No time is ever asserted.
"""
import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sparkjet.merkle import MerkleForest, SyncSession, apply, choose_depth, estimate_sync, sync_plan

ROWS = 10_000_000
# Changed fraction: 1,200 rows of 10M (the case), 1 % and 10 %.
RATES = {"0.012%": 0.00012, "1%": 0.01, "10%": 0.1}
DATA_SEED = 20_240_604
PARTITIONS = 271


@dataclasses.dataclass
class Workload:
    name: str  # the change rate, e.g. "0.01%"
    changes: int
    stale: pa.Table
    fresh: pa.Table
    depth: int  # choose_depth(rows, changes)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection, so distinct inputs give distinct ids."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x.view(np.int64)


def make_workload(name: str, rows: int = ROWS) -> Workload:
    changes = round(rows * RATES[name])
    rng = np.random.default_rng(DATA_SEED)
    deleted = inserted = changes // 10
    updated = changes - deleted - inserted
    ids = _mix64(np.arange(rows + deleted, dtype=np.uint64) + np.uint64(DATA_SEED))
    values = rng.integers(-(2**62), 2**62, rows + deleted)
    fresh = pa.table({"id": ids[:rows], "value": values[:rows]})
    picked = rng.choice(rows, inserted + updated, replace=False)
    only_fresh, touched = picked[:inserted], picked[inserted:]
    stale_values = values.copy()
    stale_values[touched] += 1
    keep = np.ones(rows + deleted, bool)
    keep[only_fresh] = False
    stale = pa.table({"id": ids[keep], "value": stale_values[keep]})
    return Workload(name, changes, stale, fresh, choose_depth(rows, changes))


def build_forest(table: pa.Table, depth: int, value_hash: str = "entry") -> MerkleForest:
    forest = MerkleForest(PARTITIONS, depth, value_hash=value_hash)
    forest.add(table, key="id")
    _ = forest.roots  # inner nodes computed here, as part of the build
    return forest


def pyarrow_join_diff(w: Workload, threads: bool = True) -> pa.Table:
    """What a user writes without Merkle trees: a full outer join of everything, then the
    rows whose values differ (added and deleted rows have a null side)."""
    joined = w.stale.rename_columns(["id", "stale"]).join(
        w.fresh.rename_columns(["id", "fresh"]), "id", join_type="full outer",
        use_threads=threads)
    return joined.filter(pc.fill_null(pc.not_equal(joined["stale"], joined["fresh"]), True))


def ipc_bytes(table: pa.Table) -> int:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().size


def median_seconds(call: Callable[[], object], rounds: int) -> float:
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclasses.dataclass
class BuildRow:
    rows: int
    depth: int
    value_hash: str
    first_s: float  # a new forest (fresh memory)
    steady_s: float  # the same forest cleared and built again

    @property
    def mrows(self) -> float:
        return self.rows / self.steady_s / 1e6


def measure_build(table: pa.Table, depth: int, value_hash: str, rounds: int = 5) -> BuildRow:
    start = time.perf_counter()
    forest = build_forest(table, depth, value_hash)
    first = time.perf_counter() - start

    def again():
        forest.clear()
        forest.add(table, key="id")
        _ = forest.roots

    return BuildRow(table.num_rows, depth, value_hash, first, median_seconds(again, rounds))


@dataclasses.dataclass
class SyncRow:
    rows: int
    rate: str
    changes: int
    depth: int
    plan_s: float  # sync_plan with both forests given (each replica keeps its own)
    end_to_end_s: float  # sync_plan building both forests
    join_s: float  # pyarrow join diff, thread pool
    join_1t_s: float  # pyarrow join diff, one thread
    differing_leaves: int
    fresh_rows_fetched: int
    changed_bytes: int  # Arrow IPC of the plan's upserts + deletes
    tree_bytes: int  # SyncSession: hellos, node pairs, leaf list
    row_bytes: int  # SyncSession: fresh rows under differing leaves (Arrow IPC)
    dataset_bytes: int  # Arrow IPC of the whole fresh table
    messages: int


def measure_sync(w: Workload, depth: int, join: dict, rounds: int = 5) -> SyncRow:
    forests = (build_forest(w.stale, depth), build_forest(w.fresh, depth))
    plan = sync_plan(w.stale, w.fresh, key="id", forests=forests)
    check_plan(w, plan)
    plan_s = median_seconds(lambda: sync_plan(w.stale, w.fresh, key="id", forests=forests), rounds)
    end_to_end = median_seconds(lambda: sync_plan(w.stale, w.fresh, key="id", depth=depth),
                                max(1, rounds // 2))
    session = SyncSession(*forests)
    session.run()
    session.fetch(w.fresh, key="id")
    return SyncRow(
        w.fresh.num_rows, w.name, w.changes, depth, plan_s, end_to_end, join[True], join[False],
        plan.diff.leaf_count, plan.fresh_rows_fetched,
        ipc_bytes(plan.upserts) + ipc_bytes(plan.deletes), session.tree_bytes,
        session.row_bytes, ipc_bytes(w.fresh), session.message_count)


def check_plan(w: Workload, plan) -> None:
    """The plan must turn stale into fresh, and find exactly the changes made."""
    assert plan.added == plan.removed == w.changes // 10, plan
    assert plan.changed == w.changes - 2 * (w.changes // 10), plan
    synced = apply(w.stale, plan).sort_by("id")
    assert synced.equals(w.fresh.sort_by("id")), "apply(stale, plan) != fresh"


def measure_joins(w: Workload, rounds: int = 3) -> dict:
    assert pyarrow_join_diff(w).num_rows == w.changes
    return {threads: median_seconds(lambda t=threads: pyarrow_join_diff(w, t), rounds)
            for threads in (True, False)}


# ------------------------------------------------------------------------------- tables


def format_build(rows: list[BuildRow]) -> str:
    lines = ["| depth | value_hash | forest MiB | first build | steady build | M rows/s (steady) |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        mib = 4 * PARTITIONS * ((1 << r.depth) - 1) / 2**20
        lines.append(f"| {r.depth} | {r.value_hash} | {mib:,.1f} | {r.first_s * 1e3:,.0f} ms "
                     f"| {r.steady_s * 1e3:,.0f} ms | {r.mrows:,.0f} |")
    return "\n".join(lines)


def format_sync(rows: list[SyncRow]) -> str:
    lines = [("| changed | depth | diff+plan (trees given) | end to end (builds both) "
              "| pyarrow join (threads / 1 thread) | join / diff+plan | join / end to end "
              "| differing leaves | fresh rows fetched |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.rate} ({r.changes:,}) | {r.depth} | {r.plan_s * 1e3:,.0f} ms "
            f"| {r.end_to_end_s * 1e3:,.0f} ms "
            f"| {r.join_s * 1e3:,.0f} / {r.join_1t_s * 1e3:,.0f} ms "
            f"| {r.join_s / r.plan_s:,.1f}x / {r.join_1t_s / r.plan_s:,.1f}x "
            f"| {r.join_s / r.end_to_end_s:,.1f}x / {r.join_1t_s / r.end_to_end_s:,.1f}x "
            f"| {r.differing_leaves:,} | {r.fresh_rows_fetched:,} |")
    return "\n".join(lines)


def format_bytes(rows: list[SyncRow]) -> str:
    lines = [("| changed | depth | messages | tree bytes | row bytes | changed-row bytes "
              "| row bytes / changed | total / whole dataset | model (estimate_sync) total |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        model = estimate_sync(r.rows, r.changes, r.depth, PARTITIONS, row_bytes=16).total_bytes
        total = r.tree_bytes + r.row_bytes
        lines.append(
            f"| {r.rate} | {r.depth} | {r.messages} | {r.tree_bytes:,} | {r.row_bytes:,} "
            f"| {r.changed_bytes:,} | {r.row_bytes / r.changed_bytes:.2f} "
            f"| {total / r.dataset_bytes:.4%} of {r.dataset_bytes / 2**20:,.0f} MiB "
            f"| {model:,.0f} |")
    return "\n".join(lines)


def target_report(builds: list[BuildRow], syncs: list[SyncRow]) -> str:
    lines = ["targets (from the issue):"]

    def check(text, ok, shown):
        lines.append(f"  {text:<66} {shown:>14}  {'met' if ok else 'MISSED'}")

    for b in builds:
        if b.value_hash == "value":
            check(f"build >= 100 M rows/s (int64 key + value, depth {b.depth})", b.mrows >= 100,
                  f"{b.mrows:,.0f} M/s")
    for r in syncs:
        if r.rate == "0.012%":
            check(f"0.012%, depth {r.depth}: diff + plan <= 150 ms", r.plan_s <= 0.15,
                  f"{r.plan_s * 1e3:,.0f} ms")
            check(f"0.012%, depth {r.depth}: >= 15x the pyarrow join (threads)",
                  r.join_s / r.plan_s >= 15, f"{r.join_s / r.plan_s:,.1f}x")
            check(f"0.012%, depth {r.depth}: row bytes <= 2x changed-row bytes",
                  r.row_bytes <= 2 * r.changed_bytes, f"{r.row_bytes / r.changed_bytes:.2f}x")
    return "\n".join(lines)


def machine_summary() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (f"{model}, {os.cpu_count()} CPUs; Python {platform.python_version()}, "
            f"pyarrow {pa.__version__} ({pa.cpu_count()} threads), numpy {np.__version__}")


# ------------------------------------------------------------------------------- Spark


def spark_rows(w: Workload, spark) -> dict:
    """Spark join diff vs sparkjet.spark.merkle.merkle_diff on the same DataFrames (8
    partitions, cached, so neither pays for building them). One timed run each after a
    warm-up."""
    from pyspark.sql import functions as F

    from sparkjet.spark.merkle import merkle_diff

    # createDataFrame makes one partition per 10k rows; files would give a few big ones.
    a = spark.createDataFrame(w.stale).coalesce(8).cache()
    b = spark.createDataFrame(w.fresh).coalesce(8).cache()
    a.count(), b.count()

    def join_diff():
        joined = a.withColumnRenamed("value", "a").join(
            b.withColumnRenamed("value", "b"), "id", "full_outer")
        return joined.where(~F.col("a").eqNullSafe(F.col("b"))).count()

    def merkle():
        return merkle_diff(a, b, "id", depth=w.depth).count()

    out = {}
    for name, call in (("Spark join diff", join_diff), ("Spark merkle_diff", merkle)):
        assert call() == w.changes, name
        start = time.perf_counter()
        call()
        out[name] = time.perf_counter() - start
    a.unpersist(), b.unpersist()
    return out


# ------------------------------------------------------------------------ pytest-benchmark


@pytest.fixture(scope="module", params=list(RATES))
def workload(request) -> Workload:
    return make_workload(request.param)


@pytest.fixture(scope="module")
def report(bench_summaries):
    found: dict = {"build": [], "sync": []}
    yield found
    if found["build"] or found["sync"]:
        bench_summaries.append("\n\n".join(filter(None, [
            machine_summary(), found["build"] and format_build(found["build"]),
            found["sync"] and format_sync(found["sync"]),
            found["sync"] and format_bytes(found["sync"])])))


@pytest.mark.parametrize("depth", [10, 17])
def test_build(benchmark, workload, report, depth):
    if workload.name != "0.012%":
        pytest.skip("the build rate does not depend on the change rate")
    forest = build_forest(workload.fresh, depth, "value")

    def again():
        forest.clear()
        forest.add(workload.fresh, key="id")
        _ = forest.roots

    benchmark.group = "Merkle build, 10M rows"
    benchmark.pedantic(again, rounds=5, warmup_rounds=1)
    if benchmark.stats is not None:
        report["build"].append(BuildRow(workload.fresh.num_rows, depth, "value", float("nan"),
                                        benchmark.stats.stats.median))


def test_sync_plan(benchmark, workload, report):
    forests = (build_forest(workload.stale, workload.depth),
               build_forest(workload.fresh, workload.depth))
    check_plan(workload, sync_plan(workload.stale, workload.fresh, key="id", forests=forests))
    benchmark.group = f"diff + sync plan, {workload.name} changed"
    benchmark.pedantic(sync_plan, args=(workload.stale, workload.fresh),
                       kwargs={"key": "id", "forests": forests}, rounds=5, warmup_rounds=1)
    if benchmark.stats is not None:
        join = measure_joins(workload)
        row = measure_sync(workload, workload.depth, join, rounds=3)
        report["sync"].append(dataclasses.replace(row, plan_s=benchmark.stats.stats.median))


def test_pyarrow_join_diff(benchmark, workload):
    benchmark.group = f"diff + sync plan, {workload.name} changed"
    benchmark.pedantic(pyarrow_join_diff, args=(workload,), rounds=3, warmup_rounds=1)


# ----------------------------------------------------------------------------- as a script


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spark", action="store_true",
                        help="also time a Spark join diff and merkle_diff (local[2], 0.012%%)")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows a side (10M)")
    args = parser.parse_args(argv)
    print(machine_summary(), flush=True)

    workloads = {name: make_workload(name, args.rows) for name in RATES}
    builds = []
    for depth in (10, 14, 17):
        for value_hash in ("value", "entry"):
            builds.append(measure_build(workloads["0.012%"].fresh, depth, value_hash))
            print(f"  build depth {depth} {value_hash}: {builds[-1].mrows:,.0f} M rows/s",
                  flush=True)

    syncs = []
    for w in workloads.values():
        join = measure_joins(w)
        depths = sorted({w.depth, 10} | ({17} if w.name == "0.012%" else set()))
        for depth in depths:
            syncs.append(measure_sync(w, depth, join))
            r = syncs[-1]
            print(f"  {w.name} depth {depth}: plan {r.plan_s * 1e3:,.0f} ms, end to end "
                  f"{r.end_to_end_s * 1e3:,.0f} ms, join {r.join_s * 1e3:,.0f} ms", flush=True)

    print()
    print(f"Build, {args.rows:,} rows (int64 id, int64 value), {PARTITIONS} partitions:")
    print(format_build(builds))
    print()
    print(f"Diff + sync plan, {args.rows:,} rows a side "
          "(chosen depth = choose_depth(rows, changes)):")
    print(format_sync(syncs))
    print()
    print("Bytes a SyncSession exchanges (stale and fresh parties, Arrow IPC for rows):")
    print(format_bytes(syncs))
    print()
    print(target_report(builds, syncs))
    if args.spark:
        from sparkjet.spark import local_session

        spark = local_session("local[2]", "sparkjet-bench-merkle",
                              **{"spark.driver.memory": "6g"})
        w = workloads["0.012%"]
        times = spark_rows(w, spark)
        print()
        print(f"Spark local[2], {args.rows:,} rows a side, 0.012% changed, cached DataFrames:")
        for name, seconds in times.items():
            print(f"  {name:<20} {seconds:8.2f} s")
        print(f"  merkle_diff is {times['Spark join diff'] / times['Spark merkle_diff']:.1f}x "
              "the join")
        spark.stop()


if __name__ == "__main__":
    main()
