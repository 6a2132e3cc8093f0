"""Snapshots of 10M keys of state: sparkjet beside pickle and a plain Arrow IPC file.

Two ways to run it (see bench/README.md):

    python bench/bench_snapshot.py                                # summary table, ~2 minutes
    python -m pytest bench/bench_snapshot.py --benchmark-only     # pytest-benchmark, same table

Workload: keyed state of 10M int64 keys (a random permutation of 0..10M-1, fixed seed), each
with an int64 count and a float64 sum: 240 MB as Arrow. sparkjet encodes it into chunks
(lz4 or raw), writes and commits it through ``SnapshotStore`` to a local directory (fsynced or
page cache only), and restores all 271 partitions or one. Competitors: ``pickle`` of the same
state as a dict {key: (count, sum)}, and one Arrow IPC file of the unpartitioned table
(uncompressed and lz4). Each configuration's first run is checked against the input (a
restore, a decode or a read back) before its other runs are timed. Every figure is the median
of several runs in one process, steady
state: the previous run's results are dropped and ``gc.collect()`` runs before each run. The
first run of each configuration is reported too. No time is ever asserted.
"""
import argparse
import contextlib
import dataclasses
import gc
import os
import pickle
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version

import numpy as np
import pyarrow as pa
import pytest

import sparkjet
from sparkjet.snapshot.chunks import ChunkEncoder, decode_table, read_chunks
from sparkjet.snapshot.store import SnapshotStore

KEYS = 10_000_000
PARTITIONS = sparkjet.DEFAULT_PARTITION_COUNT
DATA_SEED = 20_240_602
JOB_ID = 1
EXECUTION = 1
VERTEX = "state"
ONE_PARTITION = 42  # the partition the one-partition restore asks for (any would do)
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclasses.dataclass
class State:
    """The keyed state, as each competitor holds it, built once."""

    table: pa.Table  # key, count, sum: one chunk per column, keys in random order
    by_key: pa.Table  # the same rows sorted by key: what every restore must give back
    _dict: dict | None = None
    _pickled: bytes | None = None

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def as_dict(self) -> dict:
        """{key: (count, sum)}: what pickle gets. Built on first use (~8 s), never timed."""
        if self._dict is None:
            columns = [self.table.column(name).to_numpy().tolist() for name in ("key", "count", "sum")]
            self._dict = dict(zip(columns[0], zip(columns[1], columns[2])))
        return self._dict

    def pickled(self) -> bytes:
        """The dict pickled once (what pickle.loads is timed on)."""
        if self._pickled is None:
            self._pickled = pickle.dumps(self.as_dict(), protocol=PICKLE_PROTOCOL)
        return self._pickled

    def drop_python_objects(self) -> None:
        self._dict = self._pickled = None
        gc.collect()


def build_state(count: int = KEYS) -> State:
    rng = np.random.default_rng(DATA_SEED)
    keys = rng.permutation(count).astype(np.int64)
    counts = rng.integers(1, 1_000, count, dtype=np.int64)
    sums = rng.random(count) * 1_000
    table = pa.table({"key": keys, "count": counts, "sum": sums})
    return State(table, sorted_by_key(table))


def sorted_by_key(table: pa.Table) -> pa.Table:
    """The rows in key order, one chunk per column. Keys that are a permutation of
    0..n-1 (the whole state) are put in place in O(n): a sort of 10M rows takes ~3 s."""
    table = table.combine_chunks()
    keys = table.column("key").to_numpy()
    n = len(keys)
    if n and keys.min() == 0 and keys.max() == n - 1:
        order = np.full(n, -1, dtype=np.int64)
        order[keys] = np.arange(n)
        if (order >= 0).all():
            return table.take(order).combine_chunks()
    return table.sort_by("key").combine_chunks()


def check_same_rows(got: pa.Table | None, want: pa.Table, what: str) -> None:
    """Abort unless ``got`` holds exactly the rows of ``want`` (which is sorted by key):
    a fast wrong answer is worth nothing."""
    if got is None or got.num_rows != want.num_rows:
        rows = "nothing" if got is None else f"{got.num_rows:,} rows"
        raise SystemExit(f"{what}: got {rows}, expected {want.num_rows:,}; not timing a wrong answer")
    if got.column_names != want.column_names or not sorted_by_key(got).equals(want):
        raise SystemExit(f"{what}: the rows differ from the input; not timing a wrong answer")


def evict_from_page_cache(directory: str) -> None:
    """Drops the (clean, fsynced) pages of every file under ``directory`` from this
    machine's page cache. The VM's host may still cache them."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- configurations


class Case:
    """One configuration. ``run`` is what is timed; ``prepare`` runs, untimed, before
    every run: it finishes what the previous run left (background cleanup, files), drops
    its result and collects garbage, so that each run starts from the same state."""

    group = ""
    label = ""
    rounds = 5

    def open(self, state: State, workdir: str) -> None:
        self.state = state
        self.workdir = workdir
        self.result = None

    def prepare(self) -> None:
        self.result = None
        gc.collect()

    def run(self):
        raise NotImplementedError

    def timed(self) -> None:
        # The result is kept here, not returned, so that prepare() can drop it before the
        # next run (pytest-benchmark would hold a returned value through that run).
        self.result = self.run()

    def check(self) -> None:
        """Checks the result of the first run (aborts on a wrong answer)."""

    def state_bytes(self) -> int:
        """Bytes of Arrow state one run handles (MB/s is these over the run's time)."""
        return self.state.nbytes

    def note(self) -> str:
        return ""

    def close(self) -> None:
        self.result = None

    def _fresh_dir(self, name: str) -> str:
        return tempfile.mkdtemp(prefix=f"{name}-", dir=self.workdir)


class Encode(Case):
    """ChunkEncoder(...).table(state, key="key"): partitioning, framing, compression and
    checksums, in memory."""

    group = "encode"
    rounds = 7

    def __init__(self, codec: str):
        self.codec = codec
        self.label = f"sparkjet encode, {codec}"

    def run(self):
        return ChunkEncoder(JOB_ID, 0, 1, codec=self.codec).table(self.state.table, key="key")

    def check(self) -> None:
        chunks = self.result
        tables, partitions = [], []
        for chunk in chunks:
            [(offset, header, payload)] = read_chunks(chunk.to_bytes(), self.label)
            tables.append(decode_table(header, payload, self.label, offset))
            partitions.append(np.full(header.entry_count, header.partition, dtype=np.int32))
        got = pa.concat_tables(tables)
        expected = sparkjet.partition_ids(got.column("key"), PARTITIONS).to_numpy()
        if not np.array_equal(np.concatenate(partitions), expected):
            raise SystemExit(f"{self.label}: a chunk holds keys of another partition")
        check_same_rows(got, self.state.by_key, self.label)
        self.chunks = len(chunks)
        self.stored = sum(c.nbytes for c in chunks)

    def note(self) -> str:
        return (f"{self.chunks:,} chunks, {self.stored / 1e6:.0f} MB encoded "
                f"(ratio {self.state.nbytes / self.stored:.2f}); in memory")


class Write(Case):
    """A whole snapshot through SnapshotStore: writer, write_table, finish and commit.
    Each run writes the next snapshot id into the same store; the commit starts the
    removal of the previous snapshot in a background thread."""

    group = "write + commit"

    def __init__(self, codec: str, durable: bool, overlap_cleanup: bool = False):
        self.codec, self.durable, self.overlap = codec, durable, overlap_cleanup
        disk = "fsync" if durable else "page cache"
        self.label = f"sparkjet write+commit, {codec}, {disk}"
        if overlap_cleanup:
            self.label += ", cleanup overlapping"

    def open(self, state: State, workdir: str) -> None:
        super().open(state, workdir)
        self.directory = self._fresh_dir(f"write-{self.codec}")
        self.store = SnapshotStore(self.directory, JOB_ID, durable=self.durable)
        self.store.register_execution(EXECUTION)
        self.next_snapshot = 0
        self.cleanup_seconds: list[float] = []
        self.phases: list[tuple[float, float]] = []  # (write_table, commit) seconds per run

    def prepare(self) -> None:
        if not self.overlap:
            start = time.perf_counter()
            self.store.wait_for_cleanup()
            if self.next_snapshot >= 2:  # the last commit had a previous snapshot to remove
                self.cleanup_seconds.append(time.perf_counter() - start)
        super().prepare()

    def run(self):
        snapshot, self.next_snapshot = self.next_snapshot, self.next_snapshot + 1
        writer = self.store.writer(snapshot, EXECUTION, codec=self.codec)
        start = time.perf_counter()
        writer.write_table(VERTEX, self.state.table, key="key")  # encode, then file writes
        middle = time.perf_counter()
        info = writer.commit()  # directory fsync, validation record, log event
        self.phases.append((middle - start, time.perf_counter() - middle))
        return info

    def check(self) -> None:
        self.info = self.result
        self.phases.clear()  # only the timed runs' phases are reported
        restored = self.store.restore(VERTEX)
        check_same_rows(restored.table, self.state.by_key, f"{self.label}, restored")

    def note(self) -> str:
        text = f"{self.info.bytes / 1e6:.0f} MB in {self.info.chunk_count:,} chunks, one file"
        if self.overlap:
            return text + "; not waiting for the previous cleanup (commit waits if needed)"
        waits = self.cleanup_seconds
        if waits:
            text += f"; cleanup after: {statistics.median(waits):.2f} s, not timed"
        return text

    def close(self) -> None:
        super().close()
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class Restore(Case):
    """store.restore(vertex, partitions) from a snapshot written (fsynced) beforehand:
    the validation record, every listed file, every chunk's checksum, then decoding."""

    group = "restore"

    def __init__(self, codec: str, one_partition: bool = False, evict: bool = False):
        self.codec, self.evict = codec, evict
        self.partitions = [ONE_PARTITION] if one_partition else None
        what = f"partition {ONE_PARTITION} of 271" if one_partition else "all 271 partitions"
        self.label = f"sparkjet restore {what}, {codec}"
        if evict:
            self.label += ", evicted from page cache"
        if one_partition:
            self.rounds = 15

    def open(self, state: State, workdir: str) -> None:
        super().open(state, workdir)
        self.directory = self._fresh_dir(f"restore-{self.codec}")
        self.store = SnapshotStore(self.directory, JOB_ID)
        self.store.register_execution(EXECUTION)
        writer = self.store.writer(0, EXECUTION, codec=self.codec)
        writer.write_table(VERTEX, state.table, key="key")
        self.info = writer.commit()
        if self.partitions is None:
            self.expected = state.by_key
        else:
            ids = sparkjet.partition_ids(state.by_key.column("key"), PARTITIONS).to_numpy()
            self.expected = state.by_key.filter(pa.array(ids == ONE_PARTITION))

    def prepare(self) -> None:
        super().prepare()  # unmaps the previous run's files before they are evicted
        if self.evict:
            evict_from_page_cache(self.directory)

    def run(self):
        return self.store.restore(VERTEX, self.partitions)

    def check(self) -> None:
        check_same_rows(self.result.table, self.expected, self.label)
        self.bytes_read = self.result.bytes_read
        self.chunks = self.result.chunks

    def state_bytes(self) -> int:
        return self.expected.nbytes

    def note(self) -> str:
        if self.partitions is None:
            return f"reads {self.bytes_read / 1e6:.0f} MB in {self.chunks:,} chunks"
        return (f"{self.expected.num_rows:,} rows; reads {self.bytes_read:,} B = "
                f"1/{self.info.bytes / self.bytes_read:.0f} of the snapshot")

    def read_fraction(self) -> float:
        return self.bytes_read / self.info.bytes

    def close(self) -> None:
        super().close()
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class PickleDumps(Case):
    """pickle.dumps of the dict {key: (count, sum)}; building the dict is not timed."""

    group = "pickle"
    label = "pickle.dumps of the dict"
    rounds = 5

    def open(self, state: State, workdir: str) -> None:
        super().open(state, workdir)
        self.data = state.as_dict()

    def run(self):
        return pickle.dumps(self.data, protocol=PICKLE_PROTOCOL)

    def check(self) -> None:
        self.size = len(self.result)
        if self.state._pickled is None:  # the loads row reuses it, and checks the round trip
            self.state._pickled = self.result

    def note(self) -> str:
        return f"protocol {PICKLE_PROTOCOL}, {self.size / 1e6:.0f} MB; in memory"

    def close(self) -> None:
        super().close()
        self.data = None


class PickleLoads(Case):
    group = "pickle"
    label = "pickle.loads back to the dict"
    rounds = 5

    def open(self, state: State, workdir: str) -> None:
        super().open(state, workdir)
        self.data = state.pickled()

    def run(self):
        return pickle.loads(self.data)

    def check(self) -> None:
        if self.result != self.state.as_dict():
            raise SystemExit(f"{self.label}: the dict differs from the input")

    def note(self) -> str:
        return "from memory; the garbage collector on, as in an application"

    def close(self) -> None:
        super().close()
        self.data = None


def _write_ipc_file(path: str, table: pa.Table, compression: str | None, durable: bool) -> None:
    options = pa.ipc.IpcWriteOptions(compression=compression, use_threads=False)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema, options=options) as out:
        out.write_table(table)
    if durable:  # as SnapshotStore does: the file, then its directory entry
        fsync_path(path)
        fsync_path(os.path.dirname(path))


def _read_ipc_file(path: str) -> pa.Table:
    options = pa.ipc.IpcReadOptions(use_threads=False)
    with pa.memory_map(path) as source:
        return pa.ipc.open_file(source, options=options).read_all()


class ArrowWrite(Case):
    """One Arrow IPC file of the unpartitioned table (no chunks, partitions or checksums).
    Each run writes a new file; the previous one is deleted before the next run."""

    group = "Arrow IPC"

    def __init__(self, compression: str | None, durable: bool):
        self.compression, self.durable = compression, durable
        disk = "fsync" if durable else "page cache"
        self.label = f"pyarrow IPC file write, {compression or 'uncompressed'}, {disk}"

    def open(self, state: State, workdir: str) -> None:
        super().open(state, workdir)
        self.directory = self._fresh_dir(f"ipc-{self.compression or 'raw'}")
        self.count = 0

    def prepare(self) -> None:
        if self.result is not None:
            os.remove(self.result)
        super().prepare()

    def run(self):
        path = os.path.join(self.directory, f"state-{self.count}.arrow")
        self.count += 1
        _write_ipc_file(path, self.state.table, self.compression, self.durable)
        return path

    def check(self) -> None:
        self.size = os.path.getsize(self.result)
        check_same_rows(_read_ipc_file(self.result), self.state.by_key, self.label)

    def note(self) -> str:
        return f"{self.size / 1e6:.0f} MB file, one record batch, use_threads=False"

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)


class ArrowRead(Case):
    """Reading that file back (memory-mapped, as SnapshotStore reads its files)."""

    group = "Arrow IPC"
    rounds = 7

    def __init__(self, compression: str | None):
        self.compression = compression
        self.label = f"pyarrow IPC file read, {compression or 'uncompressed'}"

    def open(self, state: State, workdir: str) -> None:
        super().open(state, workdir)
        self.directory = self._fresh_dir(f"ipc-read-{self.compression or 'raw'}")
        self.path = os.path.join(self.directory, "state.arrow")
        _write_ipc_file(self.path, state.table, self.compression, durable=True)

    def run(self):
        return _read_ipc_file(self.path)

    def check(self) -> None:
        check_same_rows(self.result, self.state.by_key, self.label)

    def note(self) -> str:
        if self.compression is None:
            return "memory map, zero-copy: no byte is read or checked until used"
        return "memory map, decompressed into memory, no checksums"

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)


class CreateFiles(Case):
    """Creating (and closing) one empty file per partition in a fresh directory: what the
    store's first layout (a file per partition) paid before writing a byte. The store now
    writes one file per writer and write; this row shows what that saves."""

    group = "floor"
    label = "create 271 empty files"
    rounds = 7

    def open(self, state: State, workdir: str) -> None:
        super().open(state, workdir)
        self.directory = self._fresh_dir("files")
        self.count = 0

    def prepare(self) -> None:
        if self.result is not None:
            shutil.rmtree(self.result)
        super().prepare()

    def run(self):
        directory = os.path.join(self.directory, str(self.count))
        self.count += 1
        os.mkdir(directory)
        for partition in range(PARTITIONS):
            os.close(os.open(f"{directory}/{partition:05d}.chunks", os.O_WRONLY | os.O_CREAT, 0o644))
        return directory

    def state_bytes(self) -> int:
        return 0

    def note(self) -> str:
        return "no data, no fsync: the per-file cost of this filesystem"

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)


ENCODE = {codec: Encode(codec) for codec in ("lz4", "raw")}
WRITE = {
    "lz4-fsync": Write("lz4", durable=True),
    "raw-fsync": Write("raw", durable=True),
    "lz4-page_cache": Write("lz4", durable=False),
    "raw-page_cache": Write("raw", durable=False),
    "lz4-fsync-overlap": Write("lz4", durable=True, overlap_cleanup=True),
}
RESTORE = {
    "all-lz4": Restore("lz4"),
    "all-raw": Restore("raw"),
    "all-lz4-evicted": Restore("lz4", evict=True),
    "all-raw-evicted": Restore("raw", evict=True),
    "one-lz4": Restore("lz4", one_partition=True),
    "one-raw": Restore("raw", one_partition=True),
}
ARROW = {
    "write-uncompressed-fsync": ArrowWrite(None, durable=True),
    "write-lz4-fsync": ArrowWrite("lz4", durable=True),
    "write-uncompressed-page_cache": ArrowWrite(None, durable=False),
    "write-lz4-page_cache": ArrowWrite("lz4", durable=False),
    "read-uncompressed": ArrowRead(None),
    "read-lz4": ArrowRead("lz4"),
}
PICKLE = {"dumps": PickleDumps(), "loads": PickleLoads()}
CREATE_FILES = CreateFiles()
CASES: list[Case] = [*ENCODE.values(), *WRITE.values(), CREATE_FILES, *RESTORE.values(),
                     *ARROW.values(), *PICKLE.values()]


# ---------------------------------------------------------------- measuring and reporting


@dataclasses.dataclass(frozen=True)
class Row:
    group: str
    method: str
    first: float  # seconds
    median: float  # seconds
    runs: int
    state_bytes: int
    note: str

    @property
    def mb_per_s(self) -> float | None:
        return self.state_bytes / self.median / 1e6 if self.state_bytes else None


def seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def first_run(case: Case) -> float:
    """The configuration's first run, timed, then its result checked."""
    case.prepare()
    elapsed = seconds(case.timed)
    case.check()
    return elapsed


def measure(case: Case, state: State, workdir: str, rounds: int | None = None) -> Row:
    case.open(state, workdir)
    try:
        first = first_run(case)
        times = []
        for _ in range(rounds or case.rounds):
            case.prepare()
            times.append(seconds(case.timed))
        case.prepare()  # waits for the last cleanup, for the note
        return row_of(case, first, statistics.median(times), len(times))
    finally:
        case.close()


def row_of(case: Case, first: float, median: float, runs: int) -> Row:
    return Row(case.group, case.label, first, median, runs, case.state_bytes(), case.note())


def format_table(rows: list[Row]) -> str:
    """A Markdown table: first run, median and MB/s of Arrow state per configuration."""
    header = ("group", "method", "first run", "median", "runs", "MB/s of state", "note")
    lines = [header] + [
        (r.group, r.method, _time(r.first), _time(r.median), str(r.runs), _rate(r.mb_per_s),
         r.note)
        for r in rows
    ]
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


def _rate(mb_per_s: float | None) -> str:
    return "—" if mb_per_s is None else f"{mb_per_s:,.0f}"


def _time(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 0.1 else f"{value:.3f} s"


def _median(rows: list[Row], case: Case) -> float | None:
    return next((r.median for r in rows if r.method == case.label), None)


def breakdown_report(rows: list[Row]) -> str:
    """Where a write's time goes: write_table (encode, then file writes) and commit,
    timed separately in every run; the encode part is the encode row's median."""
    lines = []
    for case in WRITE.values():
        encode = _median(rows, ENCODE[case.codec])
        if case.overlap or not case.phases or encode is None:
            continue
        write_table = statistics.median(p[0] for p in case.phases)
        commit = statistics.median(p[1] for p in case.phases)
        total = write_table + commit
        files = write_table - encode
        lines.append(
            f"  {case.codec}, {'fsync' if case.durable else 'page cache'}:".ljust(20)
            + f"write_table {write_table:.3f} s = encode ~{encode:.3f} s ({encode / total:.0%}) "
            f"+ file writes ~{files:.3f} s ({files / total:.0%}); commit {commit * 1e3:.1f} ms"
        )
    if not lines:
        return ""
    create = _median(rows, CREATE_FILES)
    if create is not None:
        lines.append(f"  creating the 271 files alone (no data): {create:.3f} s")
    return "\n".join(["where a write's time goes (medians; encode from the encode row):", *lines])


RATIOS = [
    ("sparkjet lz4 write+commit, fsync vs pickle.dumps", WRITE["lz4-fsync"], PICKLE["dumps"]),
    ("sparkjet lz4 write+commit, page cache vs pickle.dumps", WRITE["lz4-page_cache"],
     PICKLE["dumps"]),
    ("sparkjet lz4 encode vs pickle.dumps", ENCODE["lz4"], PICKLE["dumps"]),
    ("sparkjet restore all, lz4 vs pickle.loads", RESTORE["all-lz4"], PICKLE["loads"]),
    ("sparkjet lz4 write+commit vs Arrow IPC lz4 write, fsync", WRITE["lz4-fsync"],
     ARROW["write-lz4-fsync"]),
    ("sparkjet raw write+commit vs Arrow IPC uncompressed, fsync", WRITE["raw-fsync"],
     ARROW["write-uncompressed-fsync"]),
    ("sparkjet lz4 write+commit vs Arrow IPC lz4, page cache", WRITE["lz4-page_cache"],
     ARROW["write-lz4-page_cache"]),
    ("sparkjet restore all, lz4 vs Arrow IPC lz4 read", RESTORE["all-lz4"], ARROW["read-lz4"]),
]


def ratio_report(rows: list[Row]) -> str:
    lines = []
    for text, ours, theirs in RATIOS:
        a, b = _median(rows, ours), _median(rows, theirs)
        if a and b:
            lines.append(f"  {text:<60} {b / a:6.2f}x")
    return "\n".join(["sparkjet is N times as fast (ratio of medians):", *lines]) if lines else ""


def target_report(rows: list[Row], one_partition_fraction: float | None) -> str:
    """The issue's targets, each met or MISSED, from the rows of this run."""
    mbs = {r.method: r.mb_per_s for r in rows}

    def rate(case: Case) -> float | None:
        return mbs.get(case.label)

    dumps, write_lz4 = _median(rows, PICKLE["dumps"]), _median(rows, WRITE["lz4-fsync"])
    targets = [
        ("lz4 encode >= 600 MB/s", rate(ENCODE["lz4"]), lambda v: v >= 600, "{:,.0f} MB/s"),
        ("raw encode >= 2 GB/s (before the disk)", rate(ENCODE["raw"]), lambda v: v >= 2000,
         "{:,.0f} MB/s"),
        ("lz4 write+commit, fsync >= 600 MB/s", rate(WRITE["lz4-fsync"]), lambda v: v >= 600,
         "{:,.0f} MB/s"),
        ("lz4 write+commit, page cache >= 600 MB/s", rate(WRITE["lz4-page_cache"]),
         lambda v: v >= 600, "{:,.0f} MB/s"),
        ("lz4 write+commit, fsync >= 6x pickle.dumps",
         dumps / write_lz4 if dumps and write_lz4 else None, lambda v: v >= 6, "{:.1f}x"),
        ("one partition of 271 reads <= 1/200 of the bytes", one_partition_fraction,
         lambda v: v <= 1 / 200, "{:.5f}"),
    ]
    lines = [
        f"  {text:<50} {shown.format(value):>12}  {'met' if met(value) else 'MISSED'}"
        for text, value, met, shown in targets
        if value is not None
    ]
    return "\n".join(["targets (from the issue):", *lines]) if lines else ""


def machine_summary() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
                break
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{model}, {os.cpu_count()} CPUs, load average {load}\n"
        f"Python {platform.python_version()}, numpy {np.__version__}, pyarrow {pa.__version__} "
        f"(memory pool: {pa.default_memory_pool().backend_name}), lz4 {version('lz4')}, "
        f"xxhash {version('xxhash')}, sparkjet {version('sparkjet')}"
    )


def one_time_setup(workdir: str) -> None:
    """First-use costs that are not a snapshot's (kernel selection, codecs), paid on a
    tiny table so that no configuration's first run carries them."""
    tiny = pa.table({"key": pa.array(range(1_000), pa.int64()),
                     "count": pa.array(range(1_000), pa.int64()),
                     "sum": pa.array([0.5] * 1_000)})
    directory = tempfile.mkdtemp(prefix="warm-up-", dir=workdir)
    try:
        with SnapshotStore(directory, JOB_ID) as store:
            store.register_execution(EXECUTION)
            for snapshot, codec in enumerate(("lz4", "raw")):
                writer = store.writer(snapshot, EXECUTION, codec=codec)
                writer.write_table(VERTEX, tiny, key="key")
                writer.commit()
                store.restore(VERTEX)
        _write_ipc_file(os.path.join(directory, "t.arrow"), tiny, "lz4", durable=False)
        _read_ipc_file(os.path.join(directory, "t.arrow"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------- pytest-benchmark mode


@pytest.fixture(scope="module")
def state() -> State:
    return build_state()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("snapshot-bench"))
    one_time_setup(directory)
    return directory


@pytest.fixture(scope="module")
def snapshot_rows(bench_summaries):
    """Collects a row per test; at the end, the tables go into the terminal summary."""
    rows: list[Row] = []
    fraction: list[float] = []
    yield rows, fraction
    if rows:
        bench_summaries.append("\n\n".join(filter(None, [
            "bench_snapshot.py: seconds per snapshot of 240 MB of state (medians)",
            machine_summary(), format_table(rows), breakdown_report(rows), ratio_report(rows),
            target_report(rows, fraction[0] if fraction else None),
        ])))


def _benchmark(benchmark, case: Case, state: State, workdir: str, snapshot_rows) -> None:
    rows, fraction = snapshot_rows
    case.open(state, workdir)
    try:
        first = first_run(case)
        benchmark.group = f"snapshot: {case.group}"
        benchmark.extra_info["state_bytes"] = case.state_bytes()
        benchmark.extra_info["first_run_s"] = first
        benchmark.pedantic(case.timed, setup=case.prepare, rounds=case.rounds)
        case.prepare()
        if benchmark.stats is not None:  # None under --benchmark-disable
            rows.append(row_of(case, first, benchmark.stats.stats.median, case.rounds))
            benchmark.extra_info["mb_per_s"] = rows[-1].mb_per_s
            if case is RESTORE["one-lz4"]:
                fraction.append(case.read_fraction())
    finally:
        case.close()


@pytest.mark.parametrize("codec", list(ENCODE))
def test_encode(benchmark, state, workdir, snapshot_rows, codec):
    _benchmark(benchmark, ENCODE[codec], state, workdir, snapshot_rows)


@pytest.mark.parametrize("config", list(WRITE))
def test_write(benchmark, state, workdir, snapshot_rows, config):
    _benchmark(benchmark, WRITE[config], state, workdir, snapshot_rows)


def test_create_files(benchmark, state, workdir, snapshot_rows):
    _benchmark(benchmark, CREATE_FILES, state, workdir, snapshot_rows)


@pytest.mark.parametrize("config", list(RESTORE))
def test_restore(benchmark, state, workdir, snapshot_rows, config):
    _benchmark(benchmark, RESTORE[config], state, workdir, snapshot_rows)


@pytest.mark.parametrize("config", list(ARROW))
def test_arrow_ipc(benchmark, state, workdir, snapshot_rows, config):
    _benchmark(benchmark, ARROW[config], state, workdir, snapshot_rows)


@pytest.mark.parametrize("config", list(PICKLE))
def test_pickle(benchmark, state, workdir, snapshot_rows, config):
    _benchmark(benchmark, PICKLE[config], state, workdir, snapshot_rows)


# ---------------------------------------------------------------- plain-module mode


def fresh_memory_seconds(nbytes: int, held: list) -> float:
    """Writing ``nbytes`` of memory the process has never touched (pyarrow's pool): the
    page-fault cost a first snapshot pays on every buffer it allocates."""
    buffer = pa.allocate_buffer(nbytes)
    held.append(buffer)
    return seconds(lambda: np.frombuffer(buffer, dtype=np.uint8).fill(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=KEYS, help="keys of state (10M)")
    parser.add_argument("--rounds", type=int, help="timed runs per configuration (default: per row)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the snapshot directories go (default: %(default)s)")
    args = parser.parse_args(argv)

    print(machine_summary(), flush=True)
    start = time.perf_counter()
    state = build_state(args.keys)
    print(f"built {args.keys:,} keys of state ({state.nbytes / 1e6:.0f} MB as Arrow) in "
          f"{time.perf_counter() - start:.1f} s", flush=True)

    workdir = tempfile.mkdtemp(prefix="sparkjet-bench-snapshot-", dir=args.dir)
    held: list = []
    try:
        one_time_setup(workdir)
        # Measured before anything else frees memory that this buffer could reuse.
        fresh = fresh_memory_seconds(state.nbytes, held)  # held: nothing may reuse it
        rows, fraction = [], None
        for case in CASES:
            rows.append(measure(case, state, workdir, args.rounds))
            r = rows[-1]
            print(f"  {r.method:<64} first {_time(r.first):>9}  median {_time(r.median):>9}  "
                  f"{_rate(r.mb_per_s):>8} MB/s", flush=True)
            if case is RESTORE["one-lz4"]:
                fraction = case.read_fraction()
            if case is PICKLE["loads"]:
                state.drop_python_objects()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    pages = state.nbytes / 4096
    print()
    print(format_table(rows))
    print()
    print(f"first runs: only the first row's meets memory the process never touched; later "
          f"ones reuse memory earlier rows freed. Writing a fresh {state.nbytes / 1e6:.0f} MB "
          f"buffer alone takes {fresh:.3f} s ({fresh / pages * 1e6:.1f} us per 4 KiB page).")
    print()
    print(breakdown_report(rows))
    print()
    print(ratio_report(rows))
    print()
    print(target_report(rows, fraction))
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
