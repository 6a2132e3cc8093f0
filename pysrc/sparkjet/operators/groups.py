"""Groups of rows by a composite key, batch by batch: the slot of each row's key (0, 1, 2,
... in order of first appearance) from the native ``GroupMap``, and the key columns of every
group, for window operators that keep their state in arrays indexed by slot.

Key columns are read in place as the hash kernels read them (``sparkjet._keys``): integers,
strings and binaries of every Arrow layout, and dictionaries of them (decoded: the groups'
key table holds the dictionary's value type). A key is the tuple of its column values, so a
column keeps one Arrow type for the life of a ``Groups``. String and binary views are kept
as large_string / large_binary (pyarrow cannot ``take`` views) and given back as views.

A single integer column goes through ``GroupMap`` too, not the int64-only ``KeyMap``: on
1M rows of 100K int64 keys, KeyMap builds a new map faster (about 18 against 26 ns/row)
but GroupMap finds known keys faster (about 14 against 21 ns/row), which is what a keyed
window does batch after batch; bench/bench_groups.py has both.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet import _native
from sparkjet._batches import one_array
from sparkjet._keys import SUPPORTED, describe
from sparkjet._keys import key_names as check_key_names
from sparkjet.errors import InvalidArgumentError, NullKeyError, UnsupportedTypeError


class Groups:
    """Dense slots for the distinct keys of ``key_names`` columns, and their key columns.

    >>> g = Groups(["user", "page"])
    >>> g.slots(pa.record_batch({"user": [7, 7, 9], "page": ["a", "a", "b"]})).tolist()
    [0, 0, 1]
    >>> g.slots(pa.record_batch({"user": [9, 7], "page": ["b", "c"]})).tolist()
    [1, 2]
    >>> g.keys(np.array([2, 0])).to_pylist()
    [{'user': 7, 'page': 'c'}, {'user': 7, 'page': 'a'}]
    """

    def __init__(self, key_names: str | Sequence[str], *, expected: int = 0):
        self._names = check_key_names(key_names)
        if len(set(self._names)) != len(self._names):
            raise InvalidArgumentError(f"key columns repeat a name: {list(self._names)}")
        self._map = _native.GroupMap(expected)
        self._expected = expected
        self._types: tuple[pa.DataType, ...] | None = None  # as the batches give them
        self._schema: pa.Schema | None = None  # of the key table (dictionaries decoded)
        self._stored: pa.Schema | None = None  # the same, views as large types
        # The key table in parts of decreasing size (each at most half the one before),
        # so that adding keys copies each one O(log n) times; _starts[i] is part i's
        # first slot.
        self._parts: list[pa.Table] = []
        self._starts: list[int] = []
        # One integer column: the int64 key map, about five times faster at adding keys
        # (a new window pane adds most of its keys), its keys kept as int64 bits.
        self._ints: _native.KeyMap | None = None

    @property
    def key_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def schema(self) -> pa.Schema | None:
        """The key table's schema, once a batch has given the key columns' types."""
        return self._schema

    def __len__(self) -> int:
        return len(self._ints if self._ints is not None else self._map)

    def __repr__(self) -> str:
        return f"Groups({list(self._names)!r}, {len(self)} groups)"

    def slots(self, batch: pa.RecordBatch | pa.Table, *, bulk: bool = False) -> np.ndarray:
        """The slot of every row's key (int64), adding the keys not seen before.

        A missing key column, one of a type that cannot be a key (floats, lists, ...) or
        of another type than in the batches before, and a null in a key column are
        refused before any key is added.

        ``bulk=True`` is for rows that are mostly new keys, as a restore's are: the map
        first makes room for every row (one rehash at most, instead of one per doubling)
        and integer keys go in with their buckets fetched ahead. The slots are the same.
        """
        columns, types = self._key_columns(batch)
        rows = len(columns[0])
        if self._ints is not None or (self._types is None and len(types) == 1
                                      and pa.types.is_integer(types[0])):
            return self._int_slots(columns[0], types, bulk)
        out = np.empty(rows, np.int64)
        if rows == 0:
            self._fix_types(types)
            return out
        if bulk:
            self._map.reserve(len(self._map) + rows)
        if isinstance(batch, pa.Table):
            chunks = pa.table(dict(zip(self._names, columns))).to_batches()
            chunk_columns = [c.columns for c in chunks]
        else:
            chunk_columns = [columns]
        # Every chunk is described (nulls and ranges checked) before anything is added.
        described = []
        base = 0
        for cols in chunk_columns:
            cols = [_decoded(c) for c in cols]
            descs = [describe(_as_key(c), None, base, f"key column {n!r}")
                     for n, c in zip(self._names, cols)]
            described.append((base, cols, descs))
            base += len(cols[0])
        self._fix_types(types)
        first = np.empty(max(len(c[0]) for _, c, _ in described), np.int64)
        names = list(self._names)
        for base, cols, descs in described:
            n = len(cols[0])
            before = len(self._map)
            try:
                self._map.upsert(descs, out[base : base + n], first, names, base)
            finally:
                # Also after a MemoryError part way: the keys it added keep their rows.
                added = len(self._map) - before
                if added:
                    self._add_keys(cols, first[:added])
        return out

    def find(self, batch: pa.RecordBatch | pa.Table) -> np.ndarray:
        """The slot of every row's key (int64), -1 for a key not in the groups; adds
        nothing. The key columns must have the types of the batches given to
        :meth:`slots`, and no nulls.

        >>> g = Groups("user")
        >>> g.slots(pa.record_batch({"user": [7, 9]})).tolist()
        [0, 1]
        >>> g.find(pa.record_batch({"user": [9, 8, 7]})).tolist()
        [1, -1, 0]
        """
        columns, types = self._key_columns(batch)
        rows = len(columns[0])
        out = np.full(rows, -1, np.int64)
        if self._types is None or rows == 0:
            return out
        if self._ints is not None:
            column = columns[0]
            column = one_array(column)
            _check_no_nulls(self._names[0], column)
            t = column.type
            bits = column.view(pa.int64()) if t == pa.uint64() else column.cast(pa.int64())
            self._ints.lookup(np.ascontiguousarray(bits.to_numpy(zero_copy_only=False),
                                                   np.int64), out)
            return out
        if isinstance(batch, pa.Table):
            columns = [c.combine_chunks() for c in columns]
        cols = [_decoded(c) for c in columns]
        descs = [describe(_as_key(c), None, 0, f"key column {n!r}")
                 for n, c in zip(self._names, cols)]
        self._map.lookup(descs, out, list(self._names), 0)
        return out

    def _int_slots(self, column, types, bulk: bool = False) -> np.ndarray:
        keys = self._int_bits(column, types)
        if self._ints is None:
            self._ints = _native.KeyMap(self._expected)
        out = np.empty(len(keys), np.int64)
        if bulk:
            self._ints.upsert_bulk(keys, out)
        else:
            self._ints.upsert(keys, out)
        return out

    def int_bits(self, batch: pa.RecordBatch | pa.Table) -> np.ndarray | None:
        """Where the key is one integer column: every row's key as int64 (a uint64 key's
        bits), after the checks :meth:`slots` makes, and without adding anything; None
        for any other key. For operators that keep their own native map of integer keys
        (deduplication); :meth:`int_key_table` turns the bits back into keys.

        >>> Groups("k").int_bits(pa.record_batch({"k": pa.array([3, 1], pa.int8())})).tolist()
        [3, 1]
        >>> Groups("k").int_bits(pa.record_batch({"k": ["a"]})) is None
        True
        """
        columns, types = self._key_columns(batch)
        if self._types is None and not (len(types) == 1 and pa.types.is_integer(types[0])):
            return None
        if self._types is not None and not (len(self._types) == 1
                                            and pa.types.is_integer(self._types[0])):
            return None
        return self._int_bits(columns[0], types)

    def int_key_table(self, bits: np.ndarray) -> pa.Table:
        """The keys whose :meth:`int_bits` these are, as a table of the key column."""
        t = self._schema.types[0]
        column = pa.array(bits, pa.int64())
        column = column.view(t) if t == pa.uint64() else column.cast(t)
        return pa.Table.from_arrays([column], schema=self._schema)

    def _int_bits(self, column, types) -> np.ndarray:
        column = one_array(column)
        _check_no_nulls(self._names[0], column)
        self._fix_types(types)
        t = column.type
        bits = column.view(pa.int64()) if t == pa.uint64() else column.cast(pa.int64())
        return np.ascontiguousarray(bits.to_numpy(zero_copy_only=False), np.int64)

    def kept(self, slots: np.ndarray) -> Groups:
        """A new ``Groups`` holding only the keys of ``slots``, as slots ``0..len-1`` in
        that order: how a keyed operator drops the keys it no longer holds.

        >>> g = Groups("k"); _ = g.slots(pa.record_batch({"k": [5, 6, 7]}))
        >>> g.kept(np.array([2, 0])).keys(np.array([0, 1])).to_pylist()
        [{'k': 7}, {'k': 5}]
        """
        fresh = Groups(list(self._names))
        if len(slots):
            fresh.slots(self.keys(slots))
        return fresh

    def keys(self, slots: np.ndarray | Sequence[int]) -> pa.Table:
        """The key columns of these slots, one row per slot, in their order."""
        try:
            wanted = np.asarray(slots)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"slots must be an array of integers: {e}") from None
        if wanted.size and not np.issubdtype(wanted.dtype, np.integer):
            raise InvalidArgumentError(f"slots must be integers, not {wanted.dtype}")
        wanted = wanted.astype(np.int64, copy=False).reshape(-1)
        bad = np.flatnonzero((wanted < 0) | (wanted >= len(self)))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(
                f"slot {wanted[i]} at index {i} is outside 0..{len(self) - 1}")
        if self._schema is None:
            return pa.table({})
        if self._ints is not None:
            bits = np.empty(len(wanted), np.int64)
            self._ints.keys_at(np.ascontiguousarray(wanted), bits)
            t = self._schema.types[0]
            column = pa.array(bits).view(t) if t == pa.uint64() else pa.array(bits).cast(t)
            return pa.Table.from_arrays([column], schema=self._schema)
        if not self._parts or not wanted.size:
            return self._schema.empty_table()
        return self._gather(wanted).cast(self._schema)

    # -- internals ---------------------------------------------------------------------

    def _gather(self, wanted: np.ndarray) -> pa.Table:
        if len(self._parts) == 1:
            return self._parts[0].take(wanted)
        # Take from each part its own slots, then put the rows back in the order asked.
        part = np.searchsorted(self._starts, wanted, side="right") - 1
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(len(self._parts) + 1))
        pieces = [self._parts[p].take(wanted[order[lo:hi]] - self._starts[p])
                  for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if hi > lo]
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return pa.concat_tables(pieces).combine_chunks().take(inverse)

    def _key_columns(self, batch) -> tuple[list, tuple[pa.DataType, ...]]:
        """The key columns of a batch and their types, after the checks of names and
        types."""
        if not isinstance(batch, (pa.RecordBatch, pa.Table)):
            raise InvalidArgumentError(
                f"Groups.slots takes a RecordBatch or Table, not {type(batch).__name__}")
        schema = batch.schema
        columns = []
        for name in self._names:
            found = schema.get_all_field_indices(name)
            if len(found) != 1:
                problem = "no key column" if not found else "more than one column named"
                raise InvalidArgumentError(
                    f"{problem} {name!r}; columns are {', '.join(schema.names)}")
            columns.append(batch.column(found[0]))
        types = tuple(c.type for c in columns)
        if self._types is None:
            for name, t in zip(self._names, types):
                _check_key_type(name, t)
        elif types != self._types:
            i = next(i for i, (a, b) in enumerate(zip(types, self._types)) if a != b)
            raise InvalidArgumentError(
                f"key column {self._names[i]!r} changed type from {self._types[i]} to "
                f"{types[i]}")
        return columns, types

    def _fix_types(self, types: tuple[pa.DataType, ...]) -> None:
        """The key columns' types, from the first batch accepted on."""
        if self._types is None:
            self._types = types
            values = [t.value_type if pa.types.is_dictionary(t) else t for t in types]
            self._schema = pa.schema(list(zip(self._names, values)))
            self._stored = pa.schema([(n, _STORED.get(t, t)) for n, t in zip(self._names, values)])

    def _add_keys(self, cols: list[pa.Array], rows: np.ndarray) -> None:
        keys = pa.Table.from_arrays(
            [c.cast(t).take(rows) for c, t in zip(cols, self._stored.types)],
            schema=self._stored)
        self._starts.append(len(self) - keys.num_rows)
        self._parts.append(keys)
        while len(self._parts) > 1 and self._parts[-2].num_rows < 2 * self._parts[-1].num_rows:
            last = self._parts.pop()
            self._starts.pop()
            self._parts[-1] = pa.concat_tables([self._parts[-1], last]).combine_chunks()


def _check_no_nulls(name: str, column: pa.Array) -> None:
    if column.null_count:
        first = pc.index(column.is_null(), True).as_py()
        raise NullKeyError(f"key column {name!r} has a null at index {first}: "
                           f"keys cannot be null", first)


def _check_key_type(name: str, t: pa.DataType) -> None:
    value = t.value_type if pa.types.is_dictionary(t) else t
    if not (pa.types.is_integer(value) or value in _BYTES_TYPES
            or pa.types.is_fixed_size_binary(value)):
        raise UnsupportedTypeError(
            f"key column {name!r} has type {t}, which cannot be a group key: keys are "
            f"{SUPPORTED}")


# How views are kept: pyarrow has no take (nor filter) for them.
_STORED = {pa.string_view(): pa.large_string(), pa.binary_view(): pa.large_binary()}

_BYTES_TYPES = (pa.string(), pa.large_string(), pa.string_view(), pa.binary(),
                pa.large_binary(), pa.binary_view())


def _decoded(column: pa.Array) -> pa.Array:
    """A dictionary column as its values (what the group's key table keeps)."""
    if pa.types.is_dictionary(column.type):
        return column.dictionary.take(column.indices)
    return column


def _as_key(column: pa.Array) -> pa.Array:
    """uint64 as the int64 of the same bits: groups need equality, not Hazelcast's Long
    (which would refuse values above 2**63 - 1)."""
    return column.view(pa.int64()) if column.type == pa.uint64() else column
