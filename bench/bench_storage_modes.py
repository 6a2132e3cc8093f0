"""The members' storage beside the shared store, steady state (issue 24, Targets).

One job per storage mode and key count, on a ``local[2]`` Spark session, two members
(``local_parallelism=1`` each): an unbounded ``GeneratorSource`` (int64 keys uniform over
``keys``, no rate limit: as fast as the members go) into ``group_by("key").aggregate(count,
sum)`` into ``DiscardSink``, exactly-once, 1 s snapshots. The modes:

- ``shared``: the chunk files in ``snapshot_store`` (a local disk, fsynced);
- ``members``: ``storage="members"``, ``backup_count=1``: each member's files in its slot
  under ``/dev/shm`` (the default ``storage_dir``, memory) and each file streamed to the other
  member's slot (``slot_write``, Flight ``DoPut``), verified there before the snapshot's ack.

Steady state starts at the first snapshot that has seen 3 x ``keys`` events (95 % of the keys
in the state); from it, ``--snapshots`` more snapshots are taken, then the job is stopped.
Reported per run: **throughput** (events between the first and the last of those snapshots
over the time between them, from the coordinator's counts) and the **snapshot duration**
(median ``duration_s``, barrier to commit, of those snapshots) and the state's size. The modes
alternate within each round, so each ratio (members / shared) compares runs minutes apart at
most; the ratios are the medians over ``--rounds`` rounds.

Run: ``python bench/bench_storage_modes.py --keys 1000000 10000000 --json out.json`` or
``python -m pytest bench/bench_storage_modes.py --benchmark-only`` (1M keys, one round).
``--plot PNG --recovery R.json --ipc I.json`` draws the figure of ``bench/README.md`` from the
JSON this script wrote (``--json``, or ``--steady S.json`` without running anything) and
those of ``bench_recovery.py --spark --json R.json`` and ``bench_recovery.py --json I.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery import AGGREGATIONS, BATCH, storage_options  # noqa: E402 - after the path

MODES = ("shared", "members")


def steady(spark, keys: int, work: str, storage: str, snapshots: int = 6) -> dict:
    """One run of ``storage``'s job at ``keys`` keys: throughput and snapshot duration in
    steady state."""
    source = GeneratorSource(partitions=4, keys=keys, batch_size=BATCH)
    p = (Pipeline().read_from(source).group_by("key").aggregate(**AGGREGATIONS)
         .write_to(DiscardSink()))
    extra = storage_options(storage)
    config = JobConfig(name=f"bench-steady-{storage}-{keys}",
                       snapshot_store=os.path.join(work, "store"), snapshot_interval=1.0,
                       members=2, local_parallelism=1, max_restarts=0, **extra)
    job = Job(p, config)
    seen: list[tuple[float, int, float, int]] = []
    stopping = threading.Event()

    def progress(event):
        if event.get("event") != "snapshot" or stopping.is_set():
            return
        if event.get("events_in", 0) < 3 * keys:
            return
        seen.append((time.monotonic(), event["events_in"], event["duration_s"], event["bytes"]))
        if len(seen) > snapshots:
            stopping.set()
            threading.Thread(target=job.stop, daemon=True).start()

    started = time.monotonic()
    try:
        job.run(spark, on_progress=progress)
    finally:
        if "storage_dir" in extra:
            shutil.rmtree(extra["storage_dir"], ignore_errors=True)
    if len(seen) < 2:
        raise RuntimeError(f"{storage} at {keys} keys: {len(seen)} steady snapshots")
    (t0, e0, _, _), (t1, e1, _, _) = seen[0], seen[-1]
    return {"keys": keys, "storage": storage, "events_per_s": (e1 - e0) / (t1 - t0),
            "snapshot_s": statistics.median(d for _, _, d, _ in seen[1:]),
            "snapshot_s_all": [round(d, 3) for _, _, d, _ in seen[1:]],
            "state_mb": seen[-1][3] / 1e6, "fill_s": t0 - started, "snapshots": len(seen) - 1}


def compare(spark, keys: list[int], rounds: int, snapshots: int) -> dict:
    """Every key count, each round running both modes one after the other (the order
    alternates round by round)."""
    out: dict = {"load": os.getloadavg()[0], "runs": []}
    for k in keys:
        for r in range(rounds):
            for storage in (MODES if r % 2 == 0 else MODES[::-1]):
                with tempfile.TemporaryDirectory() as work:
                    run = steady(spark, k, work, storage, snapshots)
                run["round"] = r
                run["load"] = os.getloadavg()[0]
                out["runs"].append(run)
                print("  " + json.dumps(run), flush=True)
        ratios = []
        for r in range(rounds):
            pair = {x["storage"]: x for x in out["runs"] if x["keys"] == k and x["round"] == r}
            ratios.append((pair["members"]["events_per_s"] / pair["shared"]["events_per_s"],
                           pair["members"]["snapshot_s"] / pair["shared"]["snapshot_s"]))
        out[f"ratio-{k}"] = {"throughput": statistics.median(t for t, _ in ratios),
                             "snapshot_duration": statistics.median(d for _, d in ratios),
                             "per_round": ratios}
    out["load_end"] = os.getloadavg()[0]
    return out


def plot(steady_runs: dict, recovery: dict | None, ipc: dict | None, path: str) -> None:
    """Three panels: members / shared in steady state (throughput, snapshot duration) per key
    count; recovery phases per mode and key count; the store and Flight beside the IPC file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]
    keys = sorted(int(k.split("-")[1]) for k in steady_runs if k.startswith("ratio-"))
    labels = [f"{k / 1e6:g}M keys" for k in keys]
    xs = range(len(keys))
    for i, (what, name) in enumerate((("throughput", "throughput"),
                                      ("snapshot_duration", "snapshot duration"))):
        values = [steady_runs[f"ratio-{k}"][what] for k in keys]
        bars = ax.bar([x + (i - 0.5) * 0.38 for x in xs], values, 0.36, label=name)
        ax.bar_label(bars, fmt="%.2f")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.3, color="tab:orange", lw=0.8, ls="--", label="duration target 1.3")
    ax.set_xticks(list(xs), labels)
    ax.set_title("steady state: members (backup_count=1) / shared")
    ax.legend(fontsize=8)
    if recovery:
        ax = axes[1]
        runs = [v for k, v in sorted(recovery.items(), key=lambda kv: str(kv[0]))
                if isinstance(v, dict) and "storage" in v]
        runs.sort(key=lambda r: (r["keys"], r["storage"] != "shared"))
        names = [f"{r['keys'] / 1e6:g}M\n{r['storage']}" for r in runs]
        bottom = [0.0] * len(runs)
        for phase in ("detected", "running", "restored", "first_commit"):
            heights = [max(0.0, r[phase] - b) for r, b in zip(runs, bottom)]
            ax.bar(names, heights, bottom=bottom, label=phase)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for i, r in enumerate(runs):
            ax.text(i, r["restored"], f"{r['restored']:.1f}", ha="center", va="bottom",
                    fontsize=8)
        ax.set_ylabel("seconds from kill -9")
        ax.set_title("recovery on Spark local[2], per phase")
        ax.legend(fontsize=8)
    if ipc:
        ax = axes[2]
        rows = [("store write", ipc["write_ratio"]), ("store restore", ipc["restore_ratio"])]
        if "fetch_ratio" in ipc:
            rows += [("restore from a peer\nover Flight", ipc["peer_restore_ratio"]),
                     ("replica bytes\nover Flight", ipc["fetch_ratio"])]
        bars = ax.bar([n for n, _ in rows], [v for _, v in rows],
                      color=["tab:blue", "tab:blue", "tab:green", "tab:green"][:len(rows)])
        ax.bar_label(bars, fmt="%.2f")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.5, color="tab:green", lw=0.8, ls="--", label="Flight target 0.5")
        ax.set_title(f"speed / pyarrow IPC lz4 file, {ipc['rows'] / 1e6:g}M rows")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("members' storage vs shared store (one 2-vCPU machine shared with other sessions: load 10-16)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def test_storage_modes_1m(benchmark):
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "sparkjet-bench-storage",
                          **{"spark.ui.showConsoleProgress": "false"})
    try:
        benchmark.pedantic(compare, args=(spark, [1_000_000], 1, 4), rounds=1)
    finally:
        spark.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--snapshots", type=int, default=6,
                        help="steady-state snapshots per run")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--steady", help="plot this JSON of an earlier run instead of running")
    parser.add_argument("--recovery", help="bench_recovery.py --spark --json output, to plot")
    parser.add_argument("--ipc", help="bench_recovery.py --json output (store vs IPC), to plot")
    parser.add_argument("--plot", help="draw the figure into this PNG")
    args = parser.parse_args(argv)

    def load(path):
        if not path:
            return None
        with open(path) as f:
            return json.load(f)
    if args.steady:
        if args.plot:
            ipc = load(args.ipc)
            plot(load(args.steady), load(args.recovery),
                 ipc.get("store-vs-ipc") if ipc else None, args.plot)
        return
    from sparkjet.spark import local_session

    spark = local_session("local[2]", "sparkjet-bench-storage",
                          **{"spark.ui.showConsoleProgress": "false"})
    print(f"load average {os.getloadavg()[0]:.2f}")
    try:
        out = compare(spark, args.keys, args.rounds, args.snapshots)
    finally:
        spark.stop()
    print("\nmembers (backup_count=1) / shared, medians over rounds")
    for k in args.keys:
        r = out[f"ratio-{k}"]
        print(f"  {k:>12,} keys: throughput {r['throughput']:.2f}x, snapshot duration "
              f"{r['snapshot_duration']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        ipc = load(args.ipc)
        plot(out, load(args.recovery), ipc.get("store-vs-ipc") if ipc else None, args.plot)


if __name__ == "__main__":
    main()
