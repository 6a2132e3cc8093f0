"""Group slots of 1M rows with 100K distinct keys: sparkjet's GroupMap beside what Arrow
code would use instead.

Two ways to run it (see bench/README.md):

    python bench/bench_groups.py              # summary table, under a minute
    python -m pytest bench/bench_groups.py --benchmark-only

Workloads (fixed seed): 1M rows drawing uniformly from 100K distinct keys, as one Arrow
column of random int64 (Hazelcast Long), of random printable-ASCII strings of 12..20 bytes,
and as a composite key of both (two columns). Each method turns the rows into dense group
ids in order of first appearance (or, for ``group_by``, into the groups themselves):

- ``GroupMap.upsert, new map``: the native map, built from empty by the one call;
- ``GroupMap.upsert, every key known``: the same rows again into that map (the steady
  state of a keyed window: the hit-heavy case);
- ``Groups.slots, new``: the Python helper over it, with its checks and key table;
- ``KeyMap.upsert, new map`` (int64 only): the older int64-only map that ``Groups`` could
  use for one integer column;
- ``pyarrow dictionary_encode``: its indices are the same ids (checked before timing);
- ``pyarrow Table.group_by count``: ``group_by(keys, use_threads=False)`` with
  ``count_all``, the groups without per-row ids.

sparkjet is single-threaded, and so is pyarrow here. Every figure is a median of several
rounds in one process; no time is ever asserted.
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
import pytest

import sparkjet
from sparkjet import _native
from sparkjet._keys import describe
from sparkjet.operators.groups import Groups

ROWS = 1_000_000
DISTINCT = 100_000
DATA_SEED = 20_240_917


@dataclasses.dataclass
class Workload:
    """Key columns as each competitor reads them, built once."""

    name: str
    table: pa.Table  # one chunk per column
    names: list[str]
    descs: list  # the native column tuples GroupMap reads
    warm: _native.GroupMap  # holds every key already
    slots: np.ndarray  # int64 x rows, reused
    first: np.ndarray  # int64 x rows, reused


def _int64_pool(rng, count):
    return pa.array(rng.integers(-(2**63), 2**63 - 1, count, dtype=np.int64, endpoint=True))


def _string_pool(rng, count):
    """Random printable-ASCII strings of 12..20 bytes, built straight into Arrow buffers."""
    offsets = np.zeros(count + 1, dtype=np.int32)
    np.cumsum(rng.integers(12, 20, count, dtype=np.int32, endpoint=True), out=offsets[1:])
    data = rng.integers(0x20, 0x7E, int(offsets[-1]), dtype=np.uint8, endpoint=True)
    return pa.Array.from_buffers(pa.string(), count, [None, pa.py_buffer(offsets),
                                                       pa.py_buffer(data)])


def make_workload(name: str, rows: int = ROWS, distinct: int = DISTINCT) -> Workload:
    rng = np.random.default_rng(DATA_SEED)
    draw = pa.array(rng.integers(0, distinct, rows))
    columns = {}
    if name in ("int64", "composite"):
        columns["id"] = _int64_pool(rng, distinct).take(draw)
    if name in ("string", "composite"):
        columns["name"] = _string_pool(rng, distinct).take(draw)
    table = pa.table(columns).combine_chunks()
    names = list(columns)
    descs = [describe(table.column(n).chunk(0), None, 0, n) for n in names]
    warm = _native.GroupMap()
    slots = np.empty(rows, np.int64)
    first = np.empty(rows, np.int64)
    warm.upsert(descs, slots, first)
    return Workload(name, table, names, descs, warm, slots, first)


def check(w: Workload) -> None:
    """Abort unless sparkjet's ids are dictionary_encode's (or, for a composite key, a
    dict's over the rows): a fast wrong answer is worth nothing."""
    w.warm.lookup(w.descs, w.slots)
    if len(w.names) == 1:
        want = w.table.column(0).chunk(0).dictionary_encode().indices.to_numpy()
    else:
        ids: dict = {}
        rows = zip(*(w.table.column(n).to_pylist() for n in w.names))
        want = np.array([ids.setdefault(r, len(ids)) for r in rows], np.int64)
    if not (w.slots == want).all():
        bad = int(np.flatnonzero(w.slots != want)[0])
        raise SystemExit(f"{w.name}: GroupMap gives slot {w.slots[bad]} to row {bad}, the "
                         f"reference {want[bad]}; not timing a wrong answer")
    keymap_slots = np.empty_like(w.slots)
    if w.name == "int64":
        _native.KeyMap().upsert(w.table.column(0).chunk(0).to_numpy(), keymap_slots)
        if not (keymap_slots == want).all():
            raise SystemExit("int64: KeyMap disagrees with dictionary_encode")


# Each method takes the workload and returns something that holds the result.


def groupmap_new(w: Workload):
    m = _native.GroupMap()
    m.upsert(w.descs, w.slots, w.first)
    return m


def groupmap_warm(w: Workload):
    return w.warm.upsert(w.descs, w.slots, w.first)


def groups_new(w: Workload):
    g = Groups(w.names)
    return g, g.slots(w.table)


def keymap_new(w: Workload):
    m = _native.KeyMap()
    m.upsert(w.table.column(0).chunk(0).to_numpy(), w.slots)
    return m


def arrow_dictionary_encode(w: Workload):
    return w.table.column(0).chunk(0).dictionary_encode()


def arrow_group_by(w: Workload):
    return w.table.group_by(w.names, use_threads=False).aggregate([([], "count_all")])


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    run: Callable[[Workload], object]
    note: str
    workloads: tuple[str, ...] = ("int64", "string", "composite")


GROUPMAP_NEW = Method("GroupMap.upsert, new map", groupmap_new,
                      "from an empty map: 100K inserts, growth included")
GROUPMAP_WARM = Method("GroupMap.upsert, every key known", groupmap_warm,
                       "the same rows again: the hit-heavy steady state")
GROUPS_NEW = Method("Groups.slots, new", groups_new,
                    "the Python helper: checks, a new 8 MB output, key table of 100K groups")
KEYMAP_NEW = Method("KeyMap.upsert, new map", keymap_new, "the int64-only map",
                    workloads=("int64",))
DICTIONARY_ENCODE = Method("pyarrow dictionary_encode", arrow_dictionary_encode,
                           "the same ids, one column only", workloads=("int64", "string"))
GROUP_BY = Method("pyarrow Table.group_by count", arrow_group_by,
                  "use_threads=False; the groups, no per-row ids")
METHODS = [GROUPMAP_NEW, GROUPMAP_WARM, GROUPS_NEW, KEYMAP_NEW, DICTIONARY_ENCODE, GROUP_BY]
WORKLOADS = ("int64", "string", "composite")


@dataclasses.dataclass(frozen=True)
class Row:
    workload: str
    method: str
    rows: int
    ns_per_row: float
    note: str


def median_seconds(call: Callable[[], object], rounds: int) -> float:
    """Median wall time of ``rounds`` calls after one untimed warm-up call."""
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times)


def measure(method: Method, w: Workload, rounds: int) -> Row:
    rows = w.table.num_rows
    seconds = median_seconds(lambda: method.run(w), rounds)
    return Row(w.name, method.label, rows, seconds / rows * 1e9, method.note)


def format_table(rows: list[Row]) -> str:
    """A Markdown table: ns/row, million rows/s, and how many times faster GroupMap (new
    map) is than each method on the same workload."""
    base = {r.workload: r.ns_per_row for r in rows if r.method == GROUPMAP_NEW.label}
    header = ("workload", "method", "rows", "ns/row", "M rows/s", "GroupMap new is ×", "note")
    lines = [header]
    for r in rows:
        ratio = f"{r.ns_per_row / base[r.workload]:,.2f}" if r.workload in base else "—"
        lines.append((r.workload, r.method, f"{r.rows:,}", f"{r.ns_per_row:,.1f}",
                      f"{1e3 / r.ns_per_row:,.1f}", ratio, r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    right = {2, 3, 4, 5}

    def cells(line):
        return "| " + " | ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))
        ) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + ":" if i in right else "-" * (w + 2) for i, w in enumerate(widths)
    ) + "|"
    return "\n".join([cells(lines[0]), rule, *(cells(line) for line in lines[1:])])


def machine_summary() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{model}, {os.cpu_count()} CPUs, load average {load}; Python "
            f"{platform.python_version()}, pyarrow {pa.__version__}, sparkjet "
            f"{sparkjet.__version__}")


# ---------------------------------------------------------------- pytest-benchmark mode


@pytest.fixture(scope="module", params=WORKLOADS)
def workload(request):
    w = make_workload(request.param)
    check(w)
    return w


@pytest.fixture(scope="module")
def group_rows(bench_summaries):
    rows: list[Row] = []
    yield rows
    if rows:
        order = [m.label for m in METHODS]
        rows.sort(key=lambda r: (WORKLOADS.index(r.workload), order.index(r.method)))
        bench_summaries.append("\n\n".join([machine_summary(), format_table(rows)]))


@pytest.mark.parametrize("method", METHODS, ids=[m.label for m in METHODS])
def test_groups(benchmark, group_rows, method, workload):
    if workload.name not in method.workloads:
        pytest.skip(f"{method.label} does not apply to {workload.name} keys")
    benchmark.group = f"group ids, {workload.name} keys"
    benchmark.extra_info["rows"] = workload.table.num_rows
    benchmark.pedantic(method.run, args=(workload,), rounds=7, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        ns = benchmark.stats.stats.median / workload.table.num_rows * 1e9
        group_rows.append(Row(workload.name, method.label, workload.table.num_rows, ns,
                              method.note))


# ---------------------------------------------------------------- plain-module mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed runs per row (7)")
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--distinct", type=int, default=DISTINCT)
    args = parser.parse_args(argv)

    print(machine_summary(), flush=True)
    rows = []
    for name in WORKLOADS:
        w = make_workload(name, args.rows, args.distinct)
        check(w)
        for method in METHODS:
            if name in method.workloads:
                rows.append(measure(method, w, args.rounds))
                print(f"  {name:<9} {method.label:<34} {rows[-1].ns_per_row:8.1f} ns/row",
                      flush=True)
    print()
    print(format_table(rows))
    print()
    print(machine_summary())


if __name__ == "__main__":
    main()
