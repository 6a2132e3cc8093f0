"""The stream-table join kernel: 1M events against a 100K-row table, sparkjet's index
(native group map, built once per table version, probed batch by batch) beside what Arrow
code would use instead.

    python bench/bench_table_join.py              # summary table, under a minute
    python -m pytest bench/bench_table_join.py --benchmark-only

Workload (fixed seed): a table of 100K unique keys with a string and a float column; 1M
events in batches of 65,536 rows whose keys draw uniformly from 125K values (80% match).
Each method gives the inner join of every batch (checked against the first before timing):

- ``sparkjet TableIndex.probe``: the join_table kernel (the index built outside the loop,
  as a processor builds it once per version);
- ``pyarrow Table.join``: Acero's hash join per batch (it rebuilds the hash table of the
  table every call; ``use_threads=False``);
- ``pyarrow index_in + take``: ``pc.index_in`` per batch (it too rebuilds its hash set of
  the table's keys every call; unique keys only).

Every figure is a median of several rounds in one process; no time is ever asserted.
"""
import statistics
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sparkjet.operators.table_join import TableIndex

EVENTS, TABLE_ROWS, BATCH = 1_000_000, 100_000, 65_536


def workload(kind: str = "int"):
    rng = np.random.default_rng(7)
    ids = rng.permutation(TABLE_ROWS).astype(np.int64) * 3
    keys = rng.integers(0, TABLE_ROWS * 5 // 4, EVENTS).astype(np.int64) * 3
    if kind == "str":
        ids = pa.array([f"k{i:012d}" for i in ids])
        keys = pa.array([f"k{i:012d}" for i in keys])
    table = pa.table({"id": ids, "name": pa.array([f"name-{i}" for i in range(TABLE_ROWS)]),
                      "weight": np.arange(TABLE_ROWS) * 0.5})
    events = pa.table({"key": keys, "value": np.arange(EVENTS, dtype=np.float64)})
    return table, events.to_batches(max_chunksize=BATCH)


def sparkjet_probe(table, batches):
    index = TableIndex(table, ("id",))
    return lambda: [index.probe(b, ("key",), "inner") for b in batches]


def arrow_join(table, batches):
    def run():
        return [pa.Table.from_batches([b]).join(table, "key", "id", join_type="inner",
                                                use_threads=False) for b in batches]
    return run


def arrow_index_in(table, batches):
    ids, rest = table.column("id"), table.drop_columns(["id"])

    def run():
        out = []
        for b in batches:
            pos = pc.index_in(b.column("key"), value_set=ids)
            mask = pos.is_valid()
            left = b.filter(mask)
            right = rest.take(pos.filter(mask))
            out.append(pa.Table.from_batches([left]).append_column("name", right["name"])
                       .append_column("weight", right["weight"]))
        return out
    return run


METHODS = {"sparkjet TableIndex.probe": sparkjet_probe, "pyarrow Table.join": arrow_join,
           "pyarrow index_in + take": arrow_index_in}


def _rows(out) -> int:
    return sum(o.num_rows for o in out)


def _canonical(out) -> pa.Table:
    t = pa.concat_tables([pa.Table.from_batches([o]) if isinstance(o, pa.RecordBatch) else o
                          for o in out]).select(["key", "value", "name", "weight"])
    return t.sort_by([("value", "ascending")])


def measure(kind: str, rounds: int = 5) -> dict[str, float]:
    table, batches = workload(kind)
    results, reference = {}, None
    for name, make in METHODS.items():
        run = make(table, batches)
        out = _canonical(run())
        if reference is None:
            reference = out
        elif not out.equals(reference):
            raise AssertionError(f"{name} disagrees with {next(iter(METHODS))}")
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        results[name] = EVENTS / statistics.median(times)
    return results


@pytest.mark.parametrize("method", list(METHODS))
def test_table_join(benchmark, method):
    table, batches = workload()
    benchmark(METHODS[method](table, batches))


def main() -> None:
    print(f"inner join, {EVENTS:,} events in batches of {BATCH:,} against a "
          f"{TABLE_ROWS:,}-row table (median of 5, events/s)")
    for kind in ("int", "str"):
        for name, rate in measure(kind).items():
            print(f"  {kind:3} key  {name:28} {rate / 1e6:6.1f} M/s")


if __name__ == "__main__":
    main()
