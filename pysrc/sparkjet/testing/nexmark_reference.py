"""Plain references of the NEXMark queries over a whole table of bids (the schema of
``NexmarkSource(kind="bid")``): what a correct streaming engine outputs once every window
has closed, computed with numpy and pandas, slowly and obviously.

Windows, as everywhere in sparkjet: a window is ``[window_start, window_end)`` over the
event-time column (``date_time``). Sliding windows of size ``S`` and slide ``D`` (``S`` a
multiple of ``D``) start at the multiples of ``D`` since the epoch, and an event at ``t``
belongs to the ``S / D`` windows whose start is in ``(t - S, t]``; tumbling windows are the
case ``D = S``. ``window_start`` and ``window_end`` have the type of the event-time column.
A window without events has no rows.

- :func:`q0`: pass-through.
- :func:`q1`: currency conversion, ``price * 89 / 100`` in integer cents (Beam's
  dollar-to-euro; nexmark-flink's ``0.908 * price`` is a double).
- :func:`q2`: selection of ``auction % 123 == 0`` (Beam's and nexmark-flink's form; the
  paper's ``auction in (1007, 1020, 2001, 2019, 2087)`` selects a few hundred rows however
  long the stream), as ``auction, price``.
- :func:`q5`: hot items: per sliding window (10 s every 2 s, as nexmark-flink), the
  auction(s) with the most bids, ties all kept.
- :func:`q7`: highest bid: per tumbling window (10 s), every bid with the window's highest
  price.
- :func:`window_count` and :func:`tumbling_count`: bids per auction per window.
- :func:`q3`: local item suggestion: persons in OR, ID or CA joined with the auctions of
  category 10 they sell (``auction.seller = person.id``), an unbounded join: ``name, city,
  state, id`` (the auction's id).
- :func:`q8`: monitor new users: the persons who created an auction in the tumbling window
  (10 s) in which they registered: ``id, name, window_start``, once per person and window.
- :func:`q11`: user sessions: bids per bidder per session window (a gap of 10 s):
  ``bidder, count, window_start, window_end``, the end being the last bid's time plus the
  gap. A bid exactly ``gap`` after the previous one starts a new session.

q3 and q8 take persons and auctions (the schemas of ``NexmarkSource(kind="person")`` and
``kind="auction"``); the others take bids.

Every function returns a ``pyarrow.Table`` sorted by all its columns, in their order.

>>> import pyarrow as pa
>>> bids = pa.table({"auction": [7, 7, 8], "price": [100, 300, 300],
...                  "date_time": pa.array([0, 1500, 2500], pa.timestamp("ms"))})
>>> tumbling_count(bids, size_ms=2000).to_pydict()["count"]
[2, 1]
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.errors import InvalidArgumentError

__all__ = ["q0", "q1", "q2", "q3", "q5", "q7", "q8", "q11", "tumbling_count", "window_count"]

Q3_STATES = ("OR", "ID", "CA")
Q3_CATEGORY = 10

_PER_MS = {"ms": 1, "us": 1_000, "ns": 1_000_000}


def q0(bids: pa.Table) -> pa.Table:
    """Pass-through: the bids, sorted."""
    return _sorted(bids)


def q1(bids: pa.Table) -> pa.Table:
    """The bids with ``price`` converted to euro cents: ``price * 89 / 100``, the integer
    division truncating toward zero as Java's (and Spark's ``div``)."""
    euros = pc.divide(pc.multiply(bids.column("price"), 89), 100)
    return _sorted(bids.set_column(bids.schema.get_field_index("price"), "price", euros))


def q2(bids: pa.Table, skip: int = 123) -> pa.Table:
    """``auction, price`` of the bids whose auction is a multiple of ``skip``."""
    chosen = bids.filter(pa.array(bids.column("auction").to_numpy() % skip == 0))
    return _sorted(chosen.select(["auction", "price"]))


def window_count(bids: pa.Table, size_ms: int, slide_ms: int | None = None,
                 key: str = "auction", time_column: str = "date_time") -> pa.Table:
    """Bids per ``key`` per window (sliding, or tumbling when ``slide_ms`` is None):
    ``window_start, window_end, <key>, count``.

    >>> bids = pa.table({"auction": [1, 1], "date_time": pa.array([0, 3000], pa.timestamp("ms"))})
    >>> window_count(bids, 4000, 2000).to_pydict()["count"]
    [1, 2, 1]
    """
    start, keys, size = _windows(bids, size_ms, slide_ms, key, time_column)
    counts = (pd.DataFrame({"start": start, "key": keys}).groupby(["start", "key"]).size()
              .reset_index(name="count"))
    return _window_table(bids, time_column, counts["start"].to_numpy(), size,
                         {key: pa.array(counts["key"].to_numpy(),
                                        bids.schema.field(key).type),
                          "count": pa.array(counts["count"].to_numpy(np.int64))})


def tumbling_count(bids: pa.Table, size_ms: int = 10_000, key: str = "auction",
                   time_column: str = "date_time") -> pa.Table:
    """Bids per ``key`` per tumbling window of ``size_ms``."""
    return window_count(bids, size_ms, None, key, time_column)


def q5(bids: pa.Table, size_ms: int = 10_000, slide_ms: int = 2_000,
       time_column: str = "date_time") -> pa.Table:
    """Hot items: ``window_start, window_end, auction, count`` of the auction(s) with the
    most bids in each sliding window."""
    counts = window_count(bids, size_ms, slide_ms, "auction", time_column)
    frame = pd.DataFrame({"start": _raw(counts.column("window_start")),
                          "count": counts.column("count").to_numpy()})
    best = frame.groupby("start")["count"].transform("max").to_numpy()
    return counts.filter(pa.array(frame["count"].to_numpy() == best))


def q7(bids: pa.Table, size_ms: int = 10_000, time_column: str = "date_time") -> pa.Table:
    """Highest bid: ``window_start, window_end`` and every column of the bid(s) with the
    highest price in each tumbling window."""
    start, _, size = _windows(bids, size_ms, None, "price", time_column)
    price = bids.column("price").to_numpy()
    best = pd.Series(price).groupby(start).transform("max").to_numpy()
    top = best == price
    window = _window_table(bids, time_column, start[top], size, {})
    chosen = bids.filter(pa.array(top))
    return _sorted(pa.Table.from_arrays([*window.columns, *chosen.columns],
                                        [*window.column_names, *chosen.column_names]))


def q3(persons: pa.Table, auctions: pa.Table, states=Q3_STATES,
       category: int = Q3_CATEGORY) -> pa.Table:
    """Local item suggestion: ``name, city, state`` of each person in ``states`` and ``id``
    of each auction of ``category`` that person sells; every pair, whichever came first."""
    p = persons.select(["id", "name", "city", "state"]).to_pandas()
    a = auctions.select(["id", "seller", "category"]).to_pandas()
    p = p[p["state"].isin(list(states))]
    a = a[a["category"] == category]
    both = a.merge(p, left_on="seller", right_on="id", suffixes=("", "_person"))
    return _sorted(pa.table({"name": pa.array(both["name"].to_numpy(), pa.string()),
                             "city": pa.array(both["city"].to_numpy(), pa.string()),
                             "state": pa.array(both["state"].to_numpy(), pa.string()),
                             "id": pa.array(both["id"].to_numpy(), pa.int64())}))


def q8(persons: pa.Table, auctions: pa.Table, size_ms: int = 10_000,
       time_column: str = "date_time") -> pa.Table:
    """Monitor new users: ``id, name, window_start`` of each person who created at least
    one auction (as ``seller``) in the tumbling window of ``size_ms`` they registered in."""
    p_start, _, size = _windows(persons, size_ms, None, "id", time_column)
    a_start, _, _ = _windows(auctions, size_ms, None, "seller", time_column)
    p = pd.DataFrame({"id": persons.column("id").to_numpy(),
                      "name": persons.column("name").to_numpy(zero_copy_only=False),
                      "start": p_start})
    a = pd.DataFrame({"id": auctions.column("seller").to_numpy(),
                      "start": a_start}).drop_duplicates()
    both = p.merge(a, on=["id", "start"])
    kind = persons.schema.field(time_column).type
    return _sorted(pa.table({"id": pa.array(both["id"].to_numpy(), pa.int64()),
                             "name": pa.array(both["name"].to_numpy(), pa.string()),
                             "window_start": pa.array(both["start"].to_numpy(),
                                                      pa.int64()).view(kind)}))


def q11(bids: pa.Table, gap_ms: int = 10_000, time_column: str = "date_time") -> pa.Table:
    """User sessions: ``bidder, count, window_start, window_end`` per bidder and session
    (bids less than ``gap_ms`` apart; the window ends ``gap_ms`` after its last bid)."""
    kind = bids.schema.field(time_column).type
    if not pa.types.is_timestamp(kind) or kind.unit not in _PER_MS:
        raise InvalidArgumentError(f"{time_column} must be a timestamp in ms, us or ns, "
                                   f"got {kind}")
    if gap_ms <= 0:
        raise InvalidArgumentError(f"the session gap must be positive, got {gap_ms} ms")
    gap = gap_ms * _PER_MS[kind.unit]
    e = pd.DataFrame({"bidder": bids.column("bidder").to_numpy(),
                      "t": _raw(bids.column(time_column))}).sort_values(["bidder", "t"])
    new = (e["bidder"] != e["bidder"].shift()) | (e["t"] - e["t"].shift() >= gap)
    g = e.assign(session=new.cumsum().to_numpy()).groupby(["bidder", "session"])["t"]
    out = pd.DataFrame({"count": g.size(), "start": g.min(), "end": g.max() + gap}).reset_index()
    return _sorted(pa.table({
        "bidder": pa.array(out["bidder"].to_numpy(), pa.int64()),
        "count": pa.array(out["count"].to_numpy(), pa.int64()),
        "window_start": pa.array(out["start"].to_numpy(), pa.int64()).view(kind),
        "window_end": pa.array(out["end"].to_numpy(), pa.int64()).view(kind)}))


def _windows(bids: pa.Table, size_ms: int, slide_ms: int | None, key: str,
             time_column: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Each (event, window) pair as the window's start and the event's ``key`` (in the
    time column's unit), and the size in that unit."""
    kind = bids.schema.field(time_column).type
    if not pa.types.is_timestamp(kind) or kind.unit not in _PER_MS:
        raise InvalidArgumentError(f"{time_column} must be a timestamp in ms, us or ns, "
                                   f"got {kind}")
    slide_ms = size_ms if slide_ms is None else slide_ms
    if size_ms <= 0 or slide_ms <= 0 or size_ms % slide_ms:
        raise InvalidArgumentError(f"the window size must be a positive multiple of the "
                                   f"slide, got size {size_ms} ms, slide {slide_ms} ms")
    size, slide = size_ms * _PER_MS[kind.unit], slide_ms * _PER_MS[kind.unit]
    t = _raw(bids.column(time_column))
    keys = bids.column(key).to_numpy()
    last = t // slide * slide
    starts = [last - j * slide for j in range(size // slide)]
    return np.concatenate(starts), np.tile(keys, len(starts)), size


def _raw(column) -> np.ndarray:
    """A timestamp column's values as int64 in its own unit."""
    return pc.cast(column, pa.int64()).to_numpy()


def _window_table(bids: pa.Table, time_column: str, start: np.ndarray, size: int,
                  columns: dict) -> pa.Table:
    kind = bids.schema.field(time_column).type
    table = pa.table({"window_start": pa.array(start, pa.int64()).view(kind),
                      "window_end": pa.array(start + size, pa.int64()).view(kind), **columns})
    return _sorted(table) if columns else table


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([(name, "ascending") for name in table.column_names])
