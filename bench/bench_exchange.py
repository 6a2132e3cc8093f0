"""Arrow batches from one process to another: sparkjet's exchange (ExchangeClient ->
ExchangeServer -> BarrierAligner) beside a plain ``pyarrow.flight`` do_put and beside
pickling the batches through a ``multiprocessing`` pipe.

Two ways to run it (see bench/README.md):

    python bench/bench_exchange.py             # summary table, about 10 s
    python -m pytest bench/bench_exchange.py --benchmark-only

Workloads, 10M rows each, in batches of 65,536 rows (each batch its own buffers, not a
slice of a bigger one, so that no method ships more than the batch):

- ``int64``: one int64 column (80 MB);
- ``keyed``: key int64 (uniform over 1M keys), count int64, sum float64, the shape of
  keyed state going to its new owner (240 MB).

A sender process (spawned once, reused) builds the batches before anything is timed and
sets up its connection; this process then says "go" and stops the clock when the last row
has arrived where the method delivers it:

- ``sparkjet exchange``: one ``OutboundChannel`` (default windows: 64 messages, 8 MiB), a
  barrier after every 16 batches (about 1M rows) and the end, into an ``ExchangeServer``
  whose aligner (1 channel, capacity 16, the job's default queue) is drained by this
  process's main thread until ``DONE``; every call authenticated (a signed token);
- ``sparkjet exchange, TLS``: the same over TLS with a self-signed certificate (one per execution in a job)
  (``JobConfig.tls``, on by default on a cluster), to state what encryption costs;
- ``flight do_put``: ``FlightClient.do_put`` of the same batches into a
  ``FlightServerBase`` that reads every chunk and drops it (no aligner, no barriers);
- ``pickle + Pipe``: ``Connection.send(batch)`` (pickle) and ``Connection.recv()``.

Every figure is the median of several runs in one process; no time is ever asserted.
"""
import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import platform
import statistics
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from pyarrow import flight

import sparkjet
from sparkjet.runtime.aligner import DONE, ITEM, BarrierAligner
from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
from sparkjet.runtime.exchange.security import LinkSecurity, TLSIdentity

ROWS = 10_000_000
BATCH_ROWS = 65_536
BARRIER_EVERY = 16  # batches
CAPACITY = 16
EXECUTION = 1
WORKLOADS = ("int64", "keyed")


def make_batches(workload: str, rows: int = ROWS) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(7)
    out = []
    for start in range(0, rows, BATCH_ROWS):
        n = min(BATCH_ROWS, rows - start)
        if workload == "int64":
            columns = {"x": np.arange(start, start + n, dtype=np.int64)}
        else:
            columns = {"key": rng.integers(0, 1_000_000, n, dtype=np.int64),
                       "count": rng.integers(1, 100, n, dtype=np.int64),
                       "sum": rng.random(n)}
        out.append(pa.record_batch(columns))
    return out


# ---------------------------------------------------------------- the sender process


def _sender_main(control, data, rows: int) -> None:
    """Waits for (method, workload, location); prepares, says "ready", waits for "go",
    sends, says "sent". None ends it."""
    cache: dict[str, list] = {}
    while True:
        command = control.recv()
        if command is None:
            return
        method, workload, location, security = command
        if workload not in cache:
            cache[workload] = make_batches(workload, rows)
        batches = cache[workload]
        if method in ("exchange", "exchange_tls"):
            client = ExchangeClient(location, security=security)
            ch = client.channel("sink", 0, 0, EXECUTION)
            control.send("ready")
            control.recv()
            for i, batch in enumerate(batches):
                ch.put(batch)
                if i % BARRIER_EVERY == BARRIER_EVERY - 1:
                    ch.put_barrier(i // BARRIER_EVERY)
            ch.end()
            ch.close()
            client.close()
        elif method == "flight":
            client = flight.FlightClient(location)
            writer, _ = client.do_put(flight.FlightDescriptor.for_path("sink"),
                                      batches[0].schema)
            control.send("ready")
            control.recv()
            for batch in batches:
                writer.write_batch(batch)
            writer.close()
            client.close()
        else:
            control.send("ready")
            control.recv()
            for batch in batches:
                data.send(batch)
            data.send(None)
        control.send("sent")


class _PlainServer(flight.FlightServerBase):
    """A Flight server that reads every chunk of a do_put and drops it."""

    def __init__(self):
        super().__init__("grpc+tcp://127.0.0.1:0")
        self.rows = 0
        self.done = threading.Event()

    def do_put(self, context, descriptor, reader, writer):
        rows = 0
        for chunk in reader:
            rows += chunk.data.num_rows
        self.rows = rows
        self.done.set()


class Rig:
    """The sender process, the two servers and the pipe, for all the runs."""

    def __init__(self, rows: int = ROWS):
        self.rows = rows
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with gRPC threads
        self.control, child_control = ctx.Pipe()
        self.data_in, data_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_sender_main, args=(child_control, data_out, rows),
                                   daemon=True)
        self.process.start()
        self.inbound: dict = {}
        self.security = {"exchange": LinkSecurity.generate(EXECUTION),
                         "exchange_tls": LinkSecurity.generate(EXECUTION,
                                                               TLSIdentity.self_signed())}
        self.exchange = ExchangeServer(inbound=self.inbound, execution_id=EXECUTION,
                                       security=self.security["exchange"])
        self.exchange_tls = ExchangeServer(inbound=self.inbound, execution_id=EXECUTION,
                                           security=self.security["exchange_tls"])
        self.plain = _PlainServer()
        self.payload = {w: sum(b.nbytes for b in make_batches(w, rows)) for w in WORKLOADS}

    def close(self) -> None:
        self.control.send(None)
        self.process.join(10)
        self.exchange.close()
        self.exchange_tls.close()
        self.plain.shutdown()

    def prepare(self, method: str, workload: str):
        """Everything before the clock starts: returns the function to time."""
        location = {"exchange": self.exchange.location,
                    "exchange_tls": self.exchange_tls.location,
                    "flight": f"grpc+tcp://127.0.0.1:{self.plain.port}", "pipe": None}[method]
        if method in ("exchange", "exchange_tls"):
            aligner = BarrierAligner(1, capacity=CAPACITY)
            self.inbound[("sink", 0)] = aligner
        else:
            self.plain.done.clear()
        self.control.send((method, workload, location, self.security.get(method)))
        assert self.control.recv() == "ready"
        return {"exchange": lambda: self._drain_aligner(aligner),
                "exchange_tls": lambda: self._drain_aligner(aligner),
                "flight": self._wait_plain, "pipe": self._drain_pipe}[method]

    def run(self, timed) -> None:
        self.control.send("go")
        rows = timed()
        assert self.control.recv() == "sent"
        if rows != self.rows:
            raise SystemExit(f"received {rows} rows, expected {self.rows}; not timing a "
                             "wrong answer")

    def _drain_aligner(self, aligner) -> int:
        rows = 0
        while True:
            event = aligner.take()
            if event[0] is ITEM:
                rows += event[2].num_rows
            elif event[0] is DONE:
                return rows

    def _wait_plain(self) -> int:
        self.plain.done.wait()
        return self.plain.rows

    def _drain_pipe(self) -> int:
        rows = 0
        while (batch := self.data_in.recv()) is not None:
            rows += batch.num_rows
        return rows

    def time_once(self, method: str, workload: str) -> float:
        timed = self.prepare(method, workload)
        t0 = time.perf_counter()
        self.run(timed)
        return time.perf_counter() - t0


# ---------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Method:
    key: str
    label: str
    note: str


METHODS = [
    Method("exchange", "sparkjet exchange",
           "ExchangeClient -> ExchangeServer -> BarrierAligner, barrier every 16 batches"),
    Method("exchange_tls", "sparkjet exchange, TLS",
           "the same over TLS (self-signed certificate, pinned)"),
    Method("flight", "flight do_put", "plain pyarrow.flight do_put, chunks dropped"),
    Method("pipe", "pickle + Pipe", "multiprocessing Connection.send / recv"),
]


@dataclasses.dataclass(frozen=True)
class Row:
    workload: str
    method: str
    rows: int
    payload: int  # bytes
    seconds: float
    note: str


def format_table(rows: list[Row]) -> str:
    """A Markdown table: seconds, M rows/s, MB/s, and time relative to sparkjet's."""
    base = {r.workload: r.seconds for r in rows if r.method == METHODS[0].label}
    header = ("workload", "method", "rows", "MB", "s (median)", "M rows/s", "MB/s",
              "× sparkjet's time", "note")
    lines = [header]
    for r in rows:
        ratio = f"{r.seconds / base[r.workload]:.2f}" if r.workload in base else "—"
        lines.append((r.workload, r.method, f"{r.rows:,}", f"{r.payload / 1e6:,.0f}",
                      f"{r.seconds:.3f}", f"{r.rows / r.seconds / 1e6:,.1f}",
                      f"{r.payload / r.seconds / 1e6:,.0f}", ratio, r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    right = {2, 3, 4, 5, 6, 7}

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


@pytest.fixture(scope="module")
def rig():
    r = Rig()
    yield r
    r.close()


@pytest.fixture(scope="module")
def exchange_rows(bench_summaries):
    rows: list[Row] = []
    yield rows
    if rows:
        order = [m.label for m in METHODS]
        rows.sort(key=lambda r: (WORKLOADS.index(r.workload), order.index(r.method)))
        bench_summaries.append("\n\n".join([machine_summary(), format_table(rows)]))


@pytest.mark.parametrize("method", METHODS, ids=[m.key for m in METHODS])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_exchange(benchmark, rig, exchange_rows, workload, method):
    benchmark.group = f"10M rows from another process, {workload}"
    benchmark.extra_info["rows"] = rig.rows
    benchmark.extra_info["payload_bytes"] = rig.payload[workload]
    benchmark.pedantic(rig.run, setup=lambda: ((rig.prepare(method.key, workload),), {}),
                       rounds=5, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        seconds = benchmark.stats.stats.median
        exchange_rows.append(Row(workload, method.label, rig.rows, rig.payload[workload],
                                 seconds, method.note))


# ---------------------------------------------------------------- plain-module mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per row (5)")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows per run (10M)")
    args = parser.parse_args(argv)

    print(machine_summary(), flush=True)
    rig = Rig(args.rows)
    rows = []
    try:
        for workload in WORKLOADS:
            for method in METHODS:
                rig.time_once(method.key, workload)  # warm-up
                times = [rig.time_once(method.key, workload) for _ in range(args.rounds)]
                seconds = statistics.median(times)
                rows.append(Row(workload, method.label, args.rows, rig.payload[workload],
                                seconds, method.note))
                print(f"  {workload:<6} {method.label:<18} {seconds:7.3f} s  "
                      f"(runs: {', '.join(f'{t:.3f}' for t in times)})", flush=True)
    finally:
        rig.close()
    print()
    print(format_table(rows))
    print()
    print(machine_summary())


if __name__ == "__main__":
    main()
