"""Partition ids of 10M keys: sparkjet beside what Python code would use instead.

Two ways to run it (see bench/README.md):

    python bench/bench_partition.py            # summary table, under a minute
    python -m pytest bench/ --benchmark-only   # pytest-benchmark, plus the same table

Workloads: 10M random int64 keys (Hazelcast Long) and 10M random ASCII strings of 12..20
bytes (Hazelcast String). Competitors: the Hazelcast Python client and ``mmh3`` per key
(exact, checked against sparkjet), polars ``Series.hash() % 271`` and
``pandas.util.hash_array() % 271`` (other hashes: a speed reference only); beside them,
sparkjet's slower kernel sets and, for int64, the memory floor. Every figure is a median of
several rounds in one process on one core; no time is ever asserted.
"""
import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import struct
import time
from collections.abc import Callable
from importlib.metadata import version

import mmh3
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hazelcast.config import Config, IntType
from hazelcast.serialization.service import SerializationServiceV1

import sparkjet
from sparkjet import hash as sparkjet_hash

# sparkjet runs on one core, so polars gets one too. Its pool size is fixed at import.
os.environ["POLARS_MAX_THREADS"] = "1"
import polars as pl  # noqa: E402

KEYS = 10_000_000
PARTITIONS = sparkjet.DEFAULT_PARTITION_COUNT
SEED = sparkjet.HAZELCAST_SEED
DATA_SEED = 20_240_601
CHECK_KEYS = 1_000
HAZELCAST_SAMPLE = 20_000  # the client needs 4-16 us a key: 10M would take minutes
PER_KEY_SAMPLE = 1_000_000  # mmh3 per key, and pandas on object strings
INT32_MIN = -(2**31)

_PACK_LONG = struct.Struct(">q").pack
_PACK_INT = struct.Struct(">i").pack


@dataclasses.dataclass
class Workload:
    """One key column as each competitor holds it, built once."""

    name: str
    keys: pa.Array  # the whole column, as sparkjet reads it
    series: pl.Series  # the same keys in polars
    pandas_keys: np.ndarray  # int64 values, or an object array of the first PER_KEY_SAMPLE
    python_keys: list  # the first PER_KEY_SAMPLE keys as Python objects
    hazelcast: SerializationServiceV1  # configured to serialize these keys as Hazelcast does
    payload: Callable[[object], bytes]  # a key's Hazelcast payload, the bytes murmur3 hashes
    scratch: np.ndarray | None = None  # int32 x len(keys), for the memory floor


def int64_workload(count: int = KEYS) -> Workload:
    """Uniform random int64 keys: Hazelcast Long (``IntType.LONG`` in the client)."""
    rng = np.random.default_rng(DATA_SEED)
    values = rng.integers(-(2**63), 2**63 - 1, count, dtype=np.int64, endpoint=True)
    keys = pa.array(values)
    config = Config()
    config.default_int_type = IntType.LONG
    return Workload(
        name="int64",
        keys=keys,
        series=pl.from_arrow(keys),
        pandas_keys=values,
        python_keys=keys.slice(0, PER_KEY_SAMPLE).to_pylist(),
        hazelcast=SerializationServiceV1(config),
        payload=_PACK_LONG,
        scratch=np.zeros(count, dtype=np.int32),
    )


def string_workload(count: int = KEYS) -> Workload:
    """Random printable-ASCII strings of 12..20 bytes (mean 16): Hazelcast String.

    Built straight into Arrow buffers (lengths → offsets, random bytes) because 10M
    Python strings would take longer than the whole benchmark.
    """
    rng = np.random.default_rng(DATA_SEED + 1)
    offsets = np.zeros(count + 1, dtype=np.int32)
    np.cumsum(rng.integers(12, 20, count, dtype=np.int32, endpoint=True), out=offsets[1:])
    data = rng.integers(0x20, 0x7E, int(offsets[-1]), dtype=np.uint8, endpoint=True)
    keys = pa.Array.from_buffers(
        pa.string(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )
    python_keys = keys.slice(0, PER_KEY_SAMPLE).to_pylist()
    return Workload(
        name="string",
        keys=keys,
        series=pl.from_arrow(keys),
        pandas_keys=np.array(python_keys, dtype=object),
        python_keys=python_keys,
        hazelcast=SerializationServiceV1(Config()),
        payload=_string_payload,
    )


def _string_payload(key: str) -> bytes:
    encoded = key.encode()
    return _PACK_INT(len(encoded)) + encoded


WORKLOADS = {"int64": int64_workload, "string": string_workload}


def check_exact_methods(w: Workload) -> None:
    """Abort unless sparkjet, the Hazelcast client and mmh3 agree on the first keys:
    a fast wrong answer is worth nothing."""
    first = w.python_keys[:CHECK_KEYS]
    expected = hazelcast_client(w, first)
    got = sparkjet.partition_ids(w.keys.slice(0, CHECK_KEYS), PARTITIONS).to_pylist()
    if got != expected:
        bad = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        raise SystemExit(
            f"{w.name}: sparkjet gives partition {got[bad]} for key {first[bad]!r} "
            f"(index {bad}), the Hazelcast client {expected[bad]}; not timing a wrong answer"
        )
    if mmh3_per_key(w, first) != expected:
        raise SystemExit(f"{w.name}: mmh3 with the Hazelcast payload disagrees with the client")


def check_kernels_agree(w: Workload, reference: pa.Array | None = None) -> None:
    """Abort unless every kernel set this CPU runs gives the same partitions on the whole
    column (``reference``: the default kernel's, if already computed)."""
    for name in KERNELS:
        with kernel_set(name):
            ids = sparkjet.partition_ids(w.keys, PARTITIONS)
        if reference is None:
            reference = ids
        elif not ids.equals(reference):
            raise SystemExit(f"{w.name}: the {name} kernels disagree with the {KERNELS[0]} ones")


KERNELS = sparkjet_hash.available_kernels()  # fastest first: the default is KERNELS[0]


@contextlib.contextmanager
def kernel_set(name: str):
    sparkjet_hash.select_kernel(name)
    try:
        yield
    finally:
        sparkjet_hash.select_kernel(None)


# Each method computes the partitions of the keys it is timed on and returns them.


def sparkjet_default(w: Workload):
    return sparkjet.partition_ids(w.keys, PARTITIONS)


def sparkjet_with(kernel: str) -> Callable[[Workload], object]:
    def run(w: Workload):
        with kernel_set(kernel):
            return sparkjet.partition_ids(w.keys, PARTITIONS)

    return run


def memory_floor(w: Workload):
    """Reads the int64 keys and writes int32, like partition_ids, doing nothing else."""
    np.copyto(w.scratch, w.pandas_keys, casting="unsafe")
    return w.scratch


def hazelcast_client(w: Workload, keys: list | None = None) -> list[int]:
    to_data = w.hazelcast.to_data
    keys = w.python_keys[:HAZELCAST_SAMPLE] if keys is None else keys
    # Java's rule (HashUtil.hashToIndex): abs() of Integer.MIN_VALUE stays negative.
    return [
        0 if (h := to_data(k).get_partition_hash()) == INT32_MIN else abs(h) % PARTITIONS
        for k in keys
    ]


def mmh3_per_key(w: Workload, keys: list | None = None) -> list[int]:
    payload, murmur3 = w.payload, mmh3.hash
    keys = w.python_keys if keys is None else keys
    return [
        0 if (h := murmur3(payload(k), SEED)) == INT32_MIN else abs(h) % PARTITIONS
        for k in keys
    ]


def polars_hash(w: Workload):
    return w.series.hash() % PARTITIONS


def pandas_hash_array(w: Workload):
    return pd.util.hash_array(w.pandas_keys) % PARTITIONS


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    run: Callable[[Workload], object]
    keys: Callable[[Workload], int]  # how many keys one run covers
    rounds: int
    note: Callable[[Workload], str]
    workloads: tuple[str, ...] = ("int64", "string")


def _all_keys(w: Workload) -> int:
    return len(w.keys)


_KERNEL_NOTES = {
    "avx2": "what a CPU with AVX2 but no AVX-512 (e.g. Zen 1) runs",
    "generic": "portable C: what a CPU without AVX2 runs",
}

SPARKJET = Method(
    "sparkjet partition_ids", sparkjet_default, _all_keys, 9,
    lambda w: f"{KERNELS[0]} kernels (the fastest this CPU runs), steady state",
)
OTHER_KERNELS = {
    name: Method(
        f"sparkjet, {name} kernels", sparkjet_with(name), _all_keys, 5,
        lambda w, name=name: f"select_kernel({name!r}): " + _KERNEL_NOTES.get(name, "reference"),
    )
    for name in KERNELS[1:]
}
MEMORY_FLOOR = Method(
    "memory floor", memory_floor, _all_keys, 9,
    lambda w: "numpy int64 -> int32 copy into a reused buffer: the bytes partition_ids moves",
    workloads=("int64",),
)
HAZELCAST_CLIENT = Method(
    "Hazelcast Python client", hazelcast_client,
    lambda w: min(HAZELCAST_SAMPLE, len(w.python_keys)), 3,
    lambda w: "per key (to_data + Java reduction); a sample, too slow for 10M",
)
MMH3 = Method(
    "mmh3.hash per key", mmh3_per_key, lambda w: len(w.python_keys), 3,
    lambda w: "Hazelcast payload bytes + mmh3 + Java reduction, in Python; a sample",
)
POLARS = Method(
    "polars hash() % 271", polars_hash, _all_keys, 7,
    lambda w: "a different hash; POLARS_MAX_THREADS=1",
)
PANDAS = Method(
    "pandas hash_array % 271", pandas_hash_array, lambda w: len(w.pandas_keys), 3,
    lambda w: "a different hash"
    + ("" if w.name == "int64" else "; object array of a sample (categorize=True)"),
)
METHODS = [SPARKJET, *OTHER_KERNELS.values(), MEMORY_FLOOR, HAZELCAST_CLIENT, MMH3, POLARS, PANDAS]


@dataclasses.dataclass(frozen=True)
class Row:
    workload: str
    method: str
    keys: int
    ns_per_key: float
    note: str


def median_seconds(call: Callable[[], object], rounds: int) -> float:
    """Median wall time of ``rounds`` calls after one untimed warm-up call (which also
    faults in the memory later rounds reuse)."""
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times)


def measure(method: Method, w: Workload, rounds: int | None = None) -> Row:
    seconds = median_seconds(lambda: method.run(w), rounds or method.rounds)
    keys = method.keys(w)
    return Row(w.name, method.label, keys, seconds / keys * 1e9, method.note(w))


def format_table(rows: list[Row]) -> str:
    """A Markdown table: ns/key, and how many times slower each method is than sparkjet's
    default kernel on the same workload."""
    baseline = {r.workload: r.ns_per_key for r in rows if r.method == SPARKJET.label}
    header = ("workload", "method", "keys timed", "ns/key", "sparkjet is ×", "note")
    lines = [header]
    for r in rows:
        base = baseline.get(r.workload)
        ratio = f"{r.ns_per_key / base:,.1f}" if base else "—"
        lines.append((r.workload, r.method, f"{r.keys:,}", _ns(r.ns_per_key), ratio, r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    right = {2, 3, 4}

    def cells(line):
        return "| " + " | ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))
        ) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + ":" if i in right else "-" * (w + 2) for i, w in enumerate(widths)
    ) + "|"
    return "\n".join([cells(lines[0]), rule, *(cells(line) for line in lines[1:])])


def _ns(value: float) -> str:
    return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def machine_summary() -> str:
    model, flags = "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
                break
    simd = ", ".join(f for f in ("avx2", "bmi2", "avx512f", "avx512bw") if f in flags)
    return (
        f"{model}, {os.cpu_count()} CPUs, flags: {simd or 'no AVX2'}; "
        f"sparkjet kernels: {sparkjet_hash.kernel_name()} (available: {', '.join(KERNELS)}); "
        f"polars threads: {pl.thread_pool_size()}\n"
        f"Python {platform.python_version()}, numpy {np.__version__}, pyarrow {pa.__version__}, "
        f"polars {pl.__version__}, pandas {pd.__version__}, mmh3 {version('mmh3')}, "
        f"hazelcast-python-client {version('hazelcast-python-client')}"
    )


def target_report(rows: list[Row]) -> str:
    """The issue's targets, each met or MISSED, from the rows of this run."""
    ns = {(r.workload, r.method): r.ns_per_key for r in rows}
    own = {w: ns.get((w, SPARKJET.label)) for w in WORKLOADS}

    def times_faster(workload: str, method: Method) -> float | None:
        other, base = ns.get((workload, method.label)), own[workload]
        return other / base if other and base else None

    targets = [
        ("int64: <= 2.5 ns/key", own["int64"], lambda v: v <= 2.5, "{:.2f} ns"),
        ("int64: >= 1.5x polars", times_faster("int64", POLARS), lambda v: v >= 1.5, "{:.2f}x"),
        ("string: <= 5 ns/key", own["string"], lambda v: v <= 5, "{:.2f} ns"),
        *(
            (f"{w}: >= 1000x the Hazelcast Python client", times_faster(w, HAZELCAST_CLIENT),
             lambda v: v >= 1000, "{:,.0f}x")
            for w in WORKLOADS
        ),
    ]
    lines = [
        f"  {text:<44} {shown.format(value):>10}  {'met' if met(value) else 'MISSED'}"
        for text, value, met, shown in targets
        if value is not None
    ]
    return "\n".join(["targets (from the issue):", *lines]) if lines else ""


# ---------------------------------------------------------------- pytest-benchmark mode


@pytest.fixture(scope="module", params=list(WORKLOADS))
def workload(request) -> Workload:
    """Each workload built once (and checked against the Hazelcast client) for all tests."""
    w = WORKLOADS[request.param]()
    check_exact_methods(w)
    check_kernels_agree(w)
    return w


@pytest.fixture(scope="module")
def per_key_rows(bench_summaries):
    """Collects ns/key per test; at the end, the table goes into the terminal summary."""
    rows: list[Row] = []
    yield rows
    if rows:
        bench_summaries.append(
            "\n\n".join(filter(None, [machine_summary(), format_table(rows), target_report(rows)]))
        )


def _benchmark(benchmark, method: Method, w: Workload, rows: list[Row]) -> None:
    if w.name not in method.workloads:
        pytest.skip(f"{method.label} is measured on {', '.join(method.workloads)} keys only")
    benchmark.group = f"partition ids, {w.name} keys"
    keys = method.keys(w)
    benchmark.extra_info["keys"] = keys
    benchmark.pedantic(method.run, args=(w,), rounds=method.rounds, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        ns_per_key = benchmark.stats.stats.median / keys * 1e9
        benchmark.extra_info["ns_per_key"] = ns_per_key
        rows.append(Row(w.name, method.label, keys, ns_per_key, method.note(w)))


def test_sparkjet(benchmark, workload, per_key_rows):
    _benchmark(benchmark, SPARKJET, workload, per_key_rows)


@pytest.mark.parametrize("kernel", list(OTHER_KERNELS))
def test_sparkjet_kernels(benchmark, workload, per_key_rows, kernel):
    _benchmark(benchmark, OTHER_KERNELS[kernel], workload, per_key_rows)


def test_memory_floor(benchmark, workload, per_key_rows):
    _benchmark(benchmark, MEMORY_FLOOR, workload, per_key_rows)


def test_hazelcast_client(benchmark, workload, per_key_rows):
    _benchmark(benchmark, HAZELCAST_CLIENT, workload, per_key_rows)


def test_mmh3_per_key(benchmark, workload, per_key_rows):
    _benchmark(benchmark, MMH3, workload, per_key_rows)


def test_polars(benchmark, workload, per_key_rows):
    _benchmark(benchmark, POLARS, workload, per_key_rows)


def test_pandas(benchmark, workload, per_key_rows):
    _benchmark(benchmark, PANDAS, workload, per_key_rows)


# ---------------------------------------------------------------- plain-module mode


def first_call_seconds(w: Workload, held: list) -> float:
    """One partition_ids call into output memory never touched before. The result is
    held so that no later call can reuse its pages."""
    start = time.perf_counter()
    held.append(sparkjet.partition_ids(w.keys, PARTITIONS))
    return time.perf_counter() - start


def fresh_output_seconds(count: int, held: list) -> float:
    """Writing a fresh ``count`` x int32 buffer from pyarrow's pool, where partition_ids
    puts its output: the page-fault part of a first call. Median of three buffers, all
    held so that each one is new memory."""
    times = []
    for _ in range(3):
        buffer = pa.allocate_buffer(count * 4)
        start = time.perf_counter()
        np.frombuffer(buffer, dtype=np.int32).fill(0)
        times.append(time.perf_counter() - start)
        held.append(buffer)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=KEYS, help="keys per workload (10M)")
    parser.add_argument("--rounds", type=int, help="timed rounds per method (default: per method)")
    args = parser.parse_args(argv)

    print(machine_summary(), flush=True)
    sparkjet.partition_ids(pa.array([1]))  # one-time initialisation, kept out of the first call
    workloads = []
    for name, build in WORKLOADS.items():
        start = time.perf_counter()
        w = build(args.keys)
        check_exact_methods(w)
        print(f"built and checked {args.keys:,} {name} keys in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        workloads.append(w)

    held: list = []
    first_calls = [(w, first_call_seconds(w, held)) for w in workloads]
    fresh = fresh_output_seconds(args.keys, held)  # before anything frees memory to reuse
    for w, ids in zip(workloads, held):
        check_kernels_agree(w, ids)

    rows = []
    for w in workloads:
        for method in (m for m in METHODS if w.name in m.workloads):
            rows.append(measure(method, w, args.rounds))
            print(f"  {w.name:>6}  {method.label:<26} {rows[-1].ns_per_key:10.2f} ns/key",
                  flush=True)

    print()
    print(format_table(rows))
    print()
    print("sparkjet first call (fresh output memory) vs steady state, ns/key:")
    steady = {r.workload: r.ns_per_key for r in rows if r.method == SPARKJET.label}
    for w, seconds in first_calls:
        n = len(w.keys)
        print(f"  {w.name:>6}: first {seconds / n * 1e9:6.2f}, steady {steady[w.name]:6.2f}")
    print(f"  for comparison, writing a fresh {args.keys:,} x int32 pyarrow buffer (page faults): "
          f"{fresh / args.keys * 1e9:.2f} ns/key ({fresh / (args.keys * 4 / 4096) * 1e6:.1f} us "
          "per 4 KiB page)")
    print()
    print(target_report(rows))


if __name__ == "__main__":
    main()
