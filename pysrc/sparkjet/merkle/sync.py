"""Syncing a stale table to a fresh one: :func:`sync_plan` diffs their forests and
compares only the rows under differing leaves into a :class:`SyncPlan` (rows to upsert,
keys to delete), which :func:`apply` carries out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet._keys import check_key_type, check_partition_count
from sparkjet.errors import InvalidArgumentError
from sparkjet.merkle._hashing import as_table, entry_columns
from sparkjet.merkle.compare import (
    MerkleDiff,
    diff,
    diff_leaf_set,
    rows_under_diff,
    rows_under_leaves,
)
from sparkjet.merkle.forest import DEFAULT_DEPTH, MerkleForest, check_depth
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT


@dataclass(frozen=True)
class SyncPlan:
    """What turns a stale table into the fresh one: write :attr:`upserts` (fresh rows,
    added or changed), delete the keys in :attr:`deletes`. :attr:`changes` lists every
    key with ``"added"``, ``"changed"`` or ``"removed"``. Apply it with :func:`apply`."""

    key: tuple[str, ...]
    upserts: pa.Table
    deletes: pa.Table
    changes: pa.Table
    diff: MerkleDiff
    key_type: str | None
    stale_rows_read: int  # stale rows under differing leaves
    fresh_rows_fetched: int  # fresh rows under differing leaves: what a remote sync moves

    @property
    def added(self) -> int:
        return self._count("added")

    @property
    def changed(self) -> int:
        return self._count("changed")

    @property
    def removed(self) -> int:
        return self.deletes.num_rows

    def _count(self, what: str) -> int:
        return pc.sum(pc.equal(self.changes["change"], what)).as_py() or 0

    def __repr__(self) -> str:
        return (f"SyncPlan(key={list(self.key)}, added={self.added}, changed={self.changed}, "
                f"removed={self.removed}, differing_leaves={self.diff.leaf_count}, "
                f"fresh_rows_fetched={self.fresh_rows_fetched})")


def sync_plan(stale, fresh, key, *, value=None, depth: int = DEFAULT_DEPTH,
              partition_count: int = DEFAULT_PARTITION_COUNT, key_type: str | None = None,
              value_hash: str = "entry",
              forests: tuple[MerkleForest, MerkleForest] | None = None) -> SyncPlan:
    """The rows to upsert and the keys to delete so that ``stale`` becomes ``fresh``.

    Both are Arrow tables (or record batches) with the same columns and unique keys
    (``key``: a column or a list of them). The two forests are built (or taken from
    ``forests``, built over these tables with the same key and value columns), diffed,
    and only the rows under differing leaves are read from either table and compared,
    column by column (nulls equal nulls, NaN equals NaN). ``value`` picks the value
    columns hashed into the trees (default: every non-key column). ``value_hash="entry"``
    (the default) also finds values that swap between keys of one leaf, which
    Hazelcast's ``"value"`` cannot see (see the module doc).

    Keys must be unique: a key that one side holds more than once while the other side
    holds it too (under a differing leaf) raises :class:`~sparkjet.errors.InvalidArgumentError`.
    With ``forests`` given, ``depth``, ``partition_count`` and ``value_hash`` come from
    them.

    >>> plan = sync_plan(stale, fresh, key="id")
    >>> apply(stale, plan).sort_by("id") == fresh.sort_by("id")
    True
    """
    check_key_type(key_type)
    stale, fresh = as_table(stale), as_table(fresh)
    keys, values = entry_columns(fresh, key, value)
    _check_same_columns(stale, fresh)
    if forests is None:
        check_depth(depth)
        check_partition_count(partition_count)
        sides = []
        for table in (stale, fresh):
            forest = MerkleForest(partition_count, depth, value_hash=value_hash)
            forest.add(table, key=keys, value=values, key_type=key_type)
            sides.append(forest)
        forests = (sides[0], sides[1])
    elif not (isinstance(forests, tuple) and len(forests) == 2
              and all(isinstance(f, MerkleForest) for f in forests)):
        raise InvalidArgumentError("forests must be a (stale, fresh) pair of MerkleForests")
    found = diff(forests[0], forests[1])
    if not found:
        empty = fresh.schema.empty_table()
        return SyncPlan(keys, empty, empty.select(list(keys)), _changes_table(empty, keys, []),
                        found, key_type, 0, 0)
    leaves = diff_leaf_set(found)
    stale_rows = stale.filter(rows_under_leaves(stale, keys, key_type, leaves))
    fresh_rows = fresh.filter(rows_under_leaves(fresh, keys, key_type, leaves))
    added, changed, removed = _compare(stale_rows, fresh_rows, keys, values)
    upserts = fresh_rows.take(np.sort(np.concatenate([added, changed])))
    deletes = stale_rows.select(list(keys)).take(removed)
    changes = _changes_table(fresh_rows.select(list(keys)), keys, [
        (fresh_rows.select(list(keys)).take(added), "added"),
        (fresh_rows.select(list(keys)).take(changed), "changed"),
        (deletes, "removed"),
    ])
    return SyncPlan(keys, upserts, deletes, changes, found, key_type, stale_rows.num_rows,
                    fresh_rows.num_rows)


def _changes_table(template: pa.Table, keys, parts) -> pa.Table:
    tables = [t.append_column("change", pa.array([what] * t.num_rows, pa.string()))
              for t, what in parts]
    if not tables:
        return template.select(list(keys)).append_column("change", pa.array([], pa.string()))
    return pa.concat_tables(tables)


def _check_same_columns(stale: pa.Table, fresh: pa.Table) -> None:
    a, b = stale.schema, fresh.schema
    for name in sorted(set(a.names) ^ set(b.names)):
        side = "stale" if name in a.names else "fresh"
        raise InvalidArgumentError(
            f"column {name!r} is only in the {side} table: both need the same columns")
    for name in a.names:
        if a.field(name).type != b.field(name).type:
            raise InvalidArgumentError(
                f"column {name!r} is {a.field(name).type} in the stale table but "
                f"{b.field(name).type} in the fresh one")


def _joinable(table: pa.Table, keys) -> pa.Table:
    """Key columns in types Arrow's hash join takes (dictionaries decoded, views cast)."""
    columns = []
    for name in keys:
        column = table.column(name)
        t = column.type
        if pa.types.is_dictionary(t):
            column = pc.cast(column, t.value_type)
            t = column.type
        if t in (pa.string_view(), pa.binary_view()):
            wide = pa.large_string() if t == pa.string_view() else pa.large_binary()
            column = pc.cast(column, wide)
        columns.append(column)
    return pa.table(columns, names=list(keys))


def _compare(stale: pa.Table, fresh: pa.Table, keys, values):
    """Row positions (in fresh) of added and changed rows, and (in stale) of removed ones.
    A key twice on one side shows as a row matched twice, and is refused."""
    left, right = _joinable(stale, keys), _joinable(fresh, keys)
    s_col, f_col = "__sparkjet_stale_row", "__sparkjet_fresh_row"
    left = left.append_column(s_col, pa.array(np.arange(stale.num_rows, dtype=np.int64)))
    right = right.append_column(f_col, pa.array(np.arange(fresh.num_rows, dtype=np.int64)))
    joined = left.join(right, keys=list(keys), join_type="full outer")
    s_rows = pc.fill_null(joined[s_col], -1).to_numpy()
    f_rows = pc.fill_null(joined[f_col], -1).to_numpy()
    s_missing, f_missing = s_rows < 0, f_rows < 0
    both = ~s_missing & ~f_missing
    s_both, f_both = s_rows[both], f_rows[both]
    _check_matched_once(s_both, stale, keys, "fresh")
    _check_matched_once(f_both, fresh, keys, "stale")
    same = np.ones(len(s_both), bool)
    for name in values:
        same &= _same(stale[name].take(s_both), fresh[name].take(f_both))
    return np.sort(f_rows[s_missing]), np.sort(f_both[~same]), np.sort(s_rows[f_missing])


def _check_matched_once(rows: np.ndarray, table: pa.Table, keys, other: str) -> None:
    """Rows of `table` that met more than one row of the other side: their key is there
    more than once. (A duplicate key that only one side has still syncs right: every copy
    is deleted, or every copy upserted.)"""
    if not len(rows):
        return
    counts = np.bincount(rows, minlength=table.num_rows)
    worst = int(np.argmax(counts))
    if counts[worst] > 1:
        key = table.select(list(keys)).slice(worst, 1).to_pylist()[0]
        raise InvalidArgumentError(
            f"key {key} appears {counts[worst]} times in the {other} table: a sync needs "
            "unique keys")


def _same(a, b) -> np.ndarray:
    """Null-safe equality (null == null), NaN equal to NaN."""
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    if pa.types.is_null(a.type):
        return both_null.to_numpy(zero_copy_only=False)
    t = a.type.value_type if pa.types.is_dictionary(a.type) else a.type
    if pa.types.is_dictionary(a.type):
        a, b = pc.cast(a, t), pc.cast(b, t)
    same = pc.or_(pc.fill_null(pc.equal(a, b), False), both_null)
    if pa.types.is_floating(t):
        same = pc.or_(same, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return same.to_numpy(zero_copy_only=False)


def apply(stale, plan: SyncPlan) -> pa.Table:
    """``stale`` with ``plan`` applied: the rows whose key is upserted or deleted are
    dropped (they can only lie under the plan's differing leaves, so only those rows are
    looked at) and the upserts appended. Rows keep their order; the upserts come last,
    cast to ``stale``'s schema. ``stale`` must be the table the plan was made from."""
    stale = as_table(stale)
    if not isinstance(plan, SyncPlan):
        raise InvalidArgumentError(f"plan must be a SyncPlan, got {type(plan).__name__}")
    keys = plan.key
    _check_same_columns(stale, plan.upserts)
    if plan.upserts.num_rows == 0 and plan.deletes.num_rows == 0:
        return stale
    candidates = pc.indices_nonzero(rows_under_diff(stale, keys, plan.key_type, plan.diff))
    candidates = candidates.to_numpy().astype(np.int64)
    row_col = "__sparkjet_row"
    near = _joinable(stale.select(list(keys)).take(candidates), keys).append_column(
        row_col, pa.array(candidates))
    gone = pa.concat_tables([_joinable(plan.upserts, keys), _joinable(plan.deletes, keys)])
    hits = near.join(gone, keys=list(keys), join_type="left semi")
    keep = np.ones(stale.num_rows, bool)
    keep[hits[row_col].to_numpy()] = False
    upserts = plan.upserts.select(stale.schema.names).cast(stale.schema)
    return pa.concat_tables([stale.filter(pa.array(keep)), upserts])
