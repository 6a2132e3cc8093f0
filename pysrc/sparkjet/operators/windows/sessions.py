"""Session windows of one processor: per key, events closer than ``gap`` form one window.

Every row is the interval ``[t, t + gap)``; a key's overlapping intervals merge into one
session ``[first, last + gap)``: events less than ``gap`` apart share a session. The open
sessions are kept as flat arrays (key id, start, end) beside their partial aggregates. A
batch is sorted by (key, time), merged into sessions of its own (native ``session_ids``),
then merged with the open sessions of the same keys. A session fires when the watermark
reaches its end; it is dropped once its end plus ``allowed_lateness`` is at or below the
watermark. A row is too late when its own interval would already be dropped:
``t + gap + allowed_lateness <= watermark``.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from sparkjet import _native
from sparkjet.operators.groups import Groups
from sparkjet.operators.windows.panes import Partials, _row_key


class Sessions:
    def __init__(self, op):
        self.op = op
        self.groups = Groups(list(op.keys)) if op.keys else None
        self._empty()

    def _empty(self) -> None:
        self.key = np.zeros(0, np.int64)
        self.start = np.zeros(0, np.int64)
        self.end = np.zeros(0, np.int64)
        self.fired = np.zeros(0, bool)
        self.dirty = np.zeros(0, bool)
        self.partials = Partials(self.op.layout)

    def _ids(self, batch) -> np.ndarray:
        if self.groups is None:
            return np.zeros(batch.num_rows, np.int64)
        return self.groups.slots(batch)

    # -- process -------------------------------------------------------------------------

    def process(self, batch: pa.RecordBatch, ts: np.ndarray):
        op = self.op
        gap, wm = op.gap, op.watermark
        late = None
        if wm != -(2**63):
            too_late = ts <= wm - gap - op.lateness
            if too_late.any():
                late = batch.filter(pa.array(too_late))
                keep = ~too_late
                batch, ts = batch.filter(pa.array(keep)), ts[keep]
                if batch.num_rows == 0:
                    return [], late
        ids = self._ids(batch)
        order = np.lexsort((ts, ids))
        ids_s, ts_s = ids[order], ts[order]
        sess = np.empty(len(order), np.int64)
        # Intervals merge when they overlap: the kernel merges touching ones, so it is given
        # the last instant of each, end - 1 (times are integers).
        k = _native.session_ids(ids_s, ts_s, ts_s + (gap - 1), sess)
        rows = batch.take(pa.array(order))
        fresh = Partials(op.layout)
        fresh.grow(k)
        fresh.add_rows(sess, rows, lambda i: _row_key(rows, op.keys, i))
        firsts = np.flatnonzero(np.concatenate(([True], sess[1:] != sess[:-1])))
        lasts = np.concatenate((firsts[1:] - 1, [len(sess) - 1]))
        b_key, b_start, b_end = ids_s[firsts], ts_s[firsts], ts_s[lasts] + gap
        # The open sessions of the batch's keys merge with the batch's sessions.
        sel = np.flatnonzero(np.isin(self.key, np.unique(b_key)))
        # (in the order they began: first and last combine in that order)
        sel = sel[np.argsort(self.start[sel], kind="stable")]
        c_key = np.concatenate((self.key[sel], b_key))
        c_start = np.concatenate((self.start[sel], b_start))
        c_end = np.concatenate((self.end[sel], b_end))
        c_fired = np.concatenate((self.fired[sel], np.zeros(k, bool)))
        corder = np.lexsort((c_start, c_key))
        merged = np.empty(len(corder), np.int64)
        m = _native.session_ids(c_key[corder], c_start[corder],
                                np.ascontiguousarray(c_end[corder] - 1), merged)
        target = np.empty(len(corder), np.int64)
        target[corder] = merged
        n_key = np.zeros(m, np.int64)
        n_key[target] = c_key
        new = Partials(op.layout)
        new.grow(m)
        old = self.partials.take(sel)

        def key_of(session: int) -> dict | None:
            return None if self.groups is None else {
                k: v[0] for k, v in self.groups.keys(n_key[[session]]).to_pydict().items()}

        new.add_partials(target[: len(sel)], old, len(sel), key_of)
        new.add_partials(target[len(sel):], fresh, k, key_of)
        n_start = np.full(m, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(n_start, target, c_start)
        n_end = np.full(m, np.iinfo(np.int64).min, np.int64)
        np.maximum.at(n_end, target, c_end)
        was_fired = np.zeros(m, bool)
        np.logical_or.at(was_fired, target, c_fired)
        keep = np.ones(len(self.key), bool)
        keep[sel] = False
        self._replace(keep, n_key, n_start, n_end, was_fired, new, m)
        # Sessions already past the watermark (late events within the lateness) fire now.
        outputs = []
        base = int(keep.sum())
        corrected = np.flatnonzero(self.end[base:] <= wm) + base
        if len(corrected):
            outputs.append(self._rows(corrected, early=False))
            self.fired[corrected] = True
        return outputs, late

    def _replace(self, keep, n_key, n_start, n_end, n_fired, new_partials, m) -> None:
        kept = np.flatnonzero(keep)
        parts = Partials(self.op.layout)
        parts.grow(len(kept) + m)
        old = self.partials.take(kept)
        parts.add_partials(np.arange(len(kept), dtype=np.int64), old, len(kept))
        parts.add_partials(np.arange(len(kept), len(kept) + m, dtype=np.int64), new_partials, m)
        self.key = np.concatenate((self.key[kept], n_key))
        self.start = np.concatenate((self.start[kept], n_start))
        self.end = np.concatenate((self.end[kept], n_end))
        self.fired = np.concatenate((self.fired[kept], n_fired))
        self.dirty = np.concatenate((self.dirty[kept], np.ones(m, bool)))
        self.partials = parts

    # -- firing --------------------------------------------------------------------------

    def advance(self, old: int, watermark: int) -> list[pa.RecordBatch]:
        due = np.flatnonzero((self.end <= watermark) & ~self.fired)
        outputs = [self._rows(due, early=False)] if len(due) else []
        self.fired[due] = True
        gone = self.end <= watermark - self.op.lateness if watermark > -(2**62) else None
        if gone is not None and gone.any():
            keep = ~gone
            kept = np.flatnonzero(keep)
            self.partials = self.partials.take(kept)
            self.key, self.start, self.end = self.key[kept], self.start[kept], self.end[kept]
            self.fired, self.dirty = self.fired[kept], self.dirty[kept]
            self._compact_keys()
        return outputs

    def early(self) -> list[pa.RecordBatch]:
        due = np.flatnonzero(self.dirty & ~self.fired)
        self.dirty[:] = False
        return [self._rows(due, early=True)] if len(due) else []

    def _compact_keys(self) -> None:
        """Rebuilds the key map once most keys it holds have no session left, so memory
        follows the open sessions, not every key ever seen."""
        if self.groups is None or len(self.groups) < 65_536 or len(self.groups) < 4 * len(self.key):
            return
        keys = self.groups.keys(self.key)
        self.groups = Groups(list(self.op.keys))
        self.key = self.groups.slots(keys) if len(self.key) else np.zeros(0, np.int64)

    def _rows(self, idx: np.ndarray, early: bool) -> pa.RecordBatch:
        op = self.op
        columns = {}
        if self.groups is not None:
            keys = self.groups.keys(self.key[idx])
            for name in keys.column_names:
                columns[name] = keys.column(name).combine_chunks()
        columns["window_start"] = op._times(self.start[idx])
        columns["window_end"] = op._times(self.end[idx])
        columns.update(op.layout.columns(self.partials, np.ascontiguousarray(idx, np.int64)))
        if op._early_every is not None:
            columns["early"] = pa.array(np.full(len(idx), early))
        return pa.RecordBatch.from_pydict(columns)

    # -- snapshots -----------------------------------------------------------------------

    def snapshot(self) -> pa.Table | None:
        n = len(self.key)
        if not n:
            return None
        op = self.op
        cols = {}
        if self.groups is not None:
            keys = self.groups.keys(self.key)
            for name in keys.column_names:
                cols[name] = keys.column(name)
        cols["__start"] = op._times(self.start)
        cols["__end"] = op._times(self.end)
        cols["__fired"] = pa.array(self.fired)
        cols.update(self.partials.snapshot_columns(n))
        for name, udaf in op.layout.user.items():
            partial = self.partials.user_state(name, udaf, n)
            for col in partial.column_names:
                cols[f"__user__{name}__{col}"] = partial.column(col)
        return pa.table(cols)

    def restore(self, table: pa.Table) -> None:
        op = self.op
        op._resolve(table.column("__start").type)
        n = table.num_rows
        ids = self._ids(table.select(list(op.keys))) if self.groups is not None \
            else np.zeros(n, np.int64)
        start = table.column("__start").combine_chunks().view(pa.int64()).to_numpy() \
            if pa.types.is_timestamp(table.column("__start").type) \
            else table.column("__start").to_numpy()
        end = table.column("__end").combine_chunks().view(pa.int64()).to_numpy() \
            if pa.types.is_timestamp(table.column("__end").type) else table.column("__end").to_numpy()
        parts = Partials(op.layout)
        parts.grow(n)
        slots = np.arange(n, dtype=np.int64)
        parts.restore_columns(slots, table)
        for name in op.layout.user:
            prefix = f"__user__{name}__"
            names = [c for c in table.column_names if c.startswith(prefix)]
            parts.user[name].append((slots, table.select(names).rename_columns(
                [c[len(prefix):] for c in names])))
        keep = np.ones(len(self.key), bool)
        self._replace(keep, ids, np.ascontiguousarray(start, np.int64),
                      np.ascontiguousarray(end, np.int64),
                      table.column("__fired").to_numpy(zero_copy_only=False), parts, n)
