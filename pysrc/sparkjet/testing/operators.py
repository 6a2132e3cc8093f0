"""The stateful operators the fault campaigns run, each with its reference: the storage
campaign (:mod:`sparkjet.testing.storage_campaign`) and the nemesis campaign
(:mod:`sparkjet.testing.nemesis_campaign`) take them in turn. Every one reads the events of
a :class:`~sparkjet.connectors.generator.GeneratorSource` (``id``, ``key``, ``value``; the
id is the event time) and its output, read back from the sink, is checked by
:mod:`sparkjet.verify` against what a failure-free run writes:

- ``keyed``: the rolling count and sum per key (``group_by().aggregate()``);
- ``windowed``: sliding windows of 40,000 ids every 20,000, count and sum per key;
- ``session``: session windows (a gap of :data:`SESSION_GAP` ids), count and sum per key;
- ``state``: the count and sum per key as ``map_state``;
- ``dedup``: ``deduplicate`` of a ``uid`` (one event in eight repeats the one before);
- ``join``: an interval join of the stream with itself on the key;
- ``enrich``: a join with a reference table (``join_table``).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet import verify
from sparkjet.windows import session, sliding

__all__ = ["KEYED", "OPERATORS", "SESSION_GAP", "build", "check"]

#: The stateful pipelines, in the order the campaigns take them.
OPERATORS = ("keyed", "windowed", "session", "state", "dedup", "join", "enrich")
#: The operators whose output is one row per key, updated (an upsert sink keyed by ``key``
#: can hold it).
KEYED = ("keyed", "state")
#: The session rounds' gap (event time is the event id; a key recurs every ~5000 ids).
SESSION_GAP = 4_000
#: The windowed rounds' window.
WINDOW = sliding(40_000, 20_000)


# ---- the pipelines' parts (also the kill campaign's: sparkjet.testing.campaign) -----

def _with_uid(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``uid``: the id, but one event in eight repeats the one before it."""
    ids = batch["id"]
    return batch.append_column("uid", pc.if_else(pc.equal(pc.bit_wise_and(ids, 7), 7),
                                                 pc.subtract(ids, 1), ids))


def _uids(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.select(["uid", "id"])


#: The "join" round's interval: a left row at t meets right rows of its key in [t - 2000, t + 1000].
_BETWEEN = (-2_000, 1_000)
#: The "enrich" round's table: the even keys, with a weight.
_TABLE = pa.table({"key": pa.array(np.arange(0, 5_000, 2), pa.int64()),
                   "weight": pa.array(np.arange(0, 5_000, 2) * 0.5)})


def _pairs(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A joined pair as one int: the left id and where the right one falls in the interval."""
    left, right = batch["id"], batch["id_right"]
    pair = pc.add(pc.multiply(left, 4096), pc.subtract(pc.subtract(right, left), _BETWEEN[0]))
    return pa.record_batch({"pair": pair, "id": left})


def _enriched(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.select(["id", "key", "weight"])


def _expected_ids(kind: str, source) -> np.ndarray:
    """What a failure-free run of a "dedup", "join" or "enrich" round writes, as ids."""
    e = source.events(0, source.total).select(["id", "key", "value"]).to_pandas()
    if kind == "dedup":
        ids = e["id"].to_numpy()
        return ids[ids % 8 != 7]
    if kind == "enrich":
        return e["id"].to_numpy()[e["key"].to_numpy() % 2 == 0]
    ids, keys, values = (e[c].to_numpy().astype(np.int64) for c in ("id", "key", "value"))
    left, right = values < 600, values >= 400
    # Every right row of a left row's key whose id falls in its interval: the right rows
    # sorted by (key, id) as one number, and each left row's interval found by bisection
    # (a merge on the key alone pairs every row with every other of its key first: ~25 M
    # rows for 600,000 events).
    span = 1 << 32  # > every id + the interval's width: a key's range never meets the next
    r_ids = ids[right]
    order = np.argsort(keys[right] * span + r_ids, kind="stable")
    r_sorted, r_ids = (keys[right] * span + r_ids)[order], r_ids[order]
    l_ids, l_at = ids[left], keys[left] * span + ids[left]
    lo = np.searchsorted(r_sorted, l_at + _BETWEEN[0], "left")
    hi = np.searchsorted(r_sorted, l_at + _BETWEEN[1], "right")
    n = hi - lo
    left_id = np.repeat(l_ids, n)
    # The indices lo[i] .. hi[i] - 1 of every left row, one after the other.
    at = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
    return left_id * 4096 + (r_ids[at] - left_id - _BETWEEN[0])


_COUNT_SUM = pa.schema([("count", pa.int64()), ("sum", pa.float64())])


def _count_and_sum(b):
    """The keyed count and sum, as keyed state: the rolling aggregate's output."""
    count = b.state["count"].fill_null(0).to_numpy() + np.diff(b.offsets)
    total = b.state["sum"].fill_null(0.0).to_numpy() + np.add.reduceat(
        b.rows["value"].to_numpy(), b.offsets[:-1])
    state = pa.table({"count": count, "sum": total})
    return b.keys.append_column("count", state["count"]).append_column("sum", state["sum"]), state


def expected_windows(sources: list, window) -> pa.Table:
    """Every (key, window_start) of ``window`` over the events of ``sources`` with ``id``
    as event time, with its count and sum: what a failure-free run emits."""
    import pandas as pd

    events = pd.concat([s.events(0, s.total).select(["id", "key", "value"]).to_pandas()
                        for s in sources])
    parts = []
    for i in range(window.size // window.slide):
        start = (events["id"] // window.slide - i) * window.slide
        part = events.assign(window_start=start)
        parts.append(part[part["window_start"] + window.size > part["id"]])
    g = pd.concat(parts).groupby(["key", "window_start"])["value"]
    out = pd.DataFrame({"count": g.count(), "sum": g.sum()}).reset_index()
    return pa.Table.from_pandas(out, preserve_index=False)


def _final_windows(out: pa.Table) -> tuple[pa.Table, int]:
    """Per (key, window), the row with the largest count (at-least-once may emit a window
    again after a replay, with a count at least as large), and how many rows repeated a
    window."""
    if out.num_rows == 0:
        return pa.table({"key": pa.array([], pa.int64()), "window_start": pa.array([], pa.int64()),
                         "count": pa.array([], pa.int64()), "sum": pa.array([], pa.float64())}), 0
    t = out.select(["key", "window_start", "count", "sum"]).sort_by(
        [("key", "ascending"), ("window_start", "ascending"), ("count", "descending")])
    k, w = t.column("key").to_numpy(), t.column("window_start").to_numpy()
    first = np.concatenate([[True], (k[1:] != k[:-1]) | (w[1:] != w[:-1])])
    return t.filter(pa.array(first)), int((~first).sum())



def build(stream, op: str):
    """``stream`` (the generator's events) through operator ``op`` of :data:`OPERATORS`."""
    if op in ("windowed", "session", "join"):
        stream = stream.with_timestamps("id")
    elif op == "dedup":
        stream = stream.map_batches(_with_uid).with_timestamps("id", max_lag=10)
    if op == "keyed":
        return stream.group_by("key").aggregate(count="count", sum=("sum", "value"))
    if op == "state":
        return stream.group_by("key").map_state(_count_and_sum, state=_COUNT_SUM)
    if op == "windowed":
        return stream.group_by("key").window(WINDOW).aggregate(count="count",
                                                               sum=("sum", "value"))
    if op == "session":
        return stream.group_by("key").window(session(SESSION_GAP)).aggregate(
            count="count", sum=("sum", "value"))
    if op == "dedup":
        return stream.deduplicate("uid", within=10_000).map_batches(_uids)
    if op == "join":
        left = stream.filter(pc.field("value") < 600)
        right = stream.filter(pc.field("value") >= 400)
        return left.join_interval(right, on="key", between=_BETWEEN).map_batches(
            _pairs)
    if op == "enrich":
        return stream.join_table(_TABLE, on="key").map_batches(_enriched)
    raise ValueError(f"operator must be one of {OPERATORS}, got {op!r}")


def check(op: str, source, got: pa.Table, *,
          guarantee: str = "exactly-once") -> tuple[verify.Report, int]:
    """The checker's report on ``got`` (every row the sink committed, in commit order) for
    operator ``op`` over ``source``'s events, and the rows that repeated an update or a
    window (an update committed twice, which the last update per key would not show)."""
    if op in KEYED:
        actual = (verify.last_update_per_key(got) if got.num_rows else
                  pa.table({"key": pa.array([], pa.int64()),
                            "count": pa.array([], pa.int64()),
                            "sum": pa.array([], pa.float64())}))
        repeated = (got.num_rows - got.group_by(["key", "count"]).aggregate([]).num_rows
                    if got.num_rows else 0)
        return verify.check_aggregates(source.expected_counts(),
                                       actual.select(["key", "count", "sum"]), key="key",
                                       columns=["count", "sum"], guarantee=guarantee), repeated
    if op in ("windowed", "session"):
        actual, repeated = _final_windows(got)
        expected = (expected_windows([source], WINDOW) if op == "windowed"
                    else _sessions_expected(source))
        return verify.check_aggregates(expected, actual, key=["key", "window_start"],
                                       columns=["count", "sum"], guarantee=guarantee), repeated
    column = {"dedup": "uid", "join": "pair", "enrich": "id"}[op]
    wanted = pa.array(_expected_ids(op, source))
    ids = got.column(column) if got.num_columns else pa.array([], pa.int64())
    return verify.check_events(wanted, wanted, ids, guarantee=guarantee), 0


def _sessions_expected(source) -> pa.Table:
    import pandas as pd  # heavy: the session check only

    e = source.events(0, source.total).select(["id", "key", "value"]).to_pandas()
    e = e.sort_values(["key", "id"])
    new = (e["key"] != e["key"].shift()) | (e["id"] - e["id"].shift() >= SESSION_GAP)
    g = e.assign(session=new.cumsum()).groupby(["key", "session"])
    out = pd.DataFrame({"window_start": g["id"].min(), "count": g["value"].count(),
                        "sum": g["value"].sum()}).reset_index().drop(columns="session")
    return pa.Table.from_pandas(out, preserve_index=False)
