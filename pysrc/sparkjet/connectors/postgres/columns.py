"""Columns between Arrow and PostgreSQL: the column type each Arrow type is created with or
written into, the CSV that ``COPY ... FROM STDIN (FORMAT csv)`` takes (written by Arrow's C++
writer: no Python loop over rows), the catalog queries the writers check a table with, and
reading a table back as Arrow with the types that were written."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.csv as pacsv

from sparkjet.connectors.postgres.connection import CONNECTOR, identifier
from sparkjet.errors import InvalidArgumentError, UnsupportedTypeError

# -- types -----------------------------------------------------------------------------

def pg_type(t: pa.DataType) -> str:
    """The PostgreSQL column type a column of Arrow type `t` is created with."""
    if pa.types.is_dictionary(t):
        return pg_type(t.value_type)
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_uint8(t):
        return "smallint"
    if pa.types.is_int32(t) or pa.types.is_uint16(t):
        return "integer"
    if pa.types.is_int64(t) or pa.types.is_uint32(t):
        return "bigint"
    if pa.types.is_uint64(t):
        return "numeric(20, 0)"
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return "real"
    if pa.types.is_float64(t):
        return "double precision"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision}, {t.scale})"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "bytea"
    if pa.types.is_timestamp(t):
        return "timestamp with time zone" if t.tz is not None else "timestamp without time zone"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_time(t):
        return "time without time zone"
    raise UnsupportedTypeError(f"Arrow type {t} has no PostgreSQL mapping")


def accepts(t: pa.DataType, typname: str, category: str) -> bool:
    """Whether an existing column (``pg_type.typname``, ``typcategory``) takes values of
    Arrow type `t` without a lossy or failing conversion of every value."""
    if pa.types.is_dictionary(t):
        return accepts(t.value_type, typname, category)
    if pa.types.is_boolean(t):
        return typname == "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return category == "N"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return category == "S"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return typname == "bytea"
    if pa.types.is_timestamp(t):
        return typname in ("timestamp", "timestamptz")
    if pa.types.is_date(t):
        return typname in ("date", "timestamp", "timestamptz")
    if pa.types.is_time(t):
        return typname in ("time", "timetz")
    return False


def _arrow_type(typname: str) -> pa.DataType:
    """The Arrow type :meth:`PostgresSink.read` gives a column sparkjet did not create."""
    return {"bool": pa.bool_(), "int2": pa.int16(), "int4": pa.int32(), "int8": pa.int64(),
            "float4": pa.float32(), "float8": pa.float64(), "bytea": pa.binary(),
            "timestamptz": pa.timestamp("us", "UTC"), "timestamp": pa.timestamp("us"),
            "date": pa.date32(), "time": pa.time64("us")}.get(typname, pa.string())


# -- COPY ------------------------------------------------------------------------------

def _csv_column(column: pa.Array) -> pa.Array:
    """A column as Arrow's CSV writer must see it for PostgreSQL's CSV input."""
    t = column.type
    if pa.types.is_dictionary(t):
        return _csv_column(column.dictionary_decode())
    if pa.types.is_float16(t):
        return column.cast(pa.float32())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        # bytea's text form: \x and hex digits (binary columns are rare: a Python loop)
        return pa.array([None if v is None else "\\x" + v.hex() for v in column.to_pylist()],
                        pa.string())
    return column


def copy_csv(batch: pa.RecordBatch) -> pa.Buffer:
    """The batch as CSV without a header. Arrow quotes every string value and writes nulls
    as nothing, which is how PostgreSQL's CSV tells null from the empty string."""
    if any(not _plain(f.type) for f in batch.schema):
        batch = pa.RecordBatch.from_arrays([_csv_column(c) for c in batch.columns],
                                           names=batch.schema.names)
    out = pa.BufferOutputStream()
    pacsv.write_csv(batch, out, pacsv.WriteOptions(include_header=False,
                                                   batch_size=max(1024, batch.num_rows)))
    return out.getvalue()


def _plain(t: pa.DataType) -> bool:
    return not (pa.types.is_dictionary(t) or pa.types.is_float16(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t))


# -- the catalog and reading back -------------------------------------------------------

def table_columns(con, table: str) -> list[tuple[str, str, str]] | None:
    """(name, typname, typcategory) of each column of `table`, None if it does not exist."""
    row = con.execute("SELECT to_regclass(%s)::oid", (_regclass_name(table),)).fetchone()
    if row is None or row[0] is None:
        return None
    return con.execute(
        "SELECT a.attname, t.typname, t.typcategory FROM pg_attribute a "
        "JOIN pg_type t ON t.oid = a.atttypid "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (row[0],)).fetchall()


def _regclass_name(table: str) -> str:
    return ".".join('"' + p.replace('"', '""') + '"' for p in table.split(".", 1))


def unique_keys(con, table: str) -> list[set[str]]:
    """The column sets of `table`'s primary key and unique indexes."""
    rows = con.execute(
        "SELECT array_agg(a.attname::text) FROM pg_index i "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = to_regclass(%s) AND i.indisunique AND i.indpred IS NULL "
        "GROUP BY i.indexrelid", (_regclass_name(table),)).fetchall()
    return [set(r[0]) for r in rows]


def read_table(psycopg, con, table: str) -> pa.Table:
    from psycopg import sql

    columns = table_columns(con, table)
    if columns is None:
        raise InvalidArgumentError(f"{CONNECTOR}: no table {table!r}")
    schema = None
    try:
        row = con.execute("SELECT arrow_schema FROM _sparkjet_tables WHERE name = %s",
                          (table,)).fetchone()
        if row is not None:
            schema = pa.ipc.read_schema(pa.py_buffer(row[0]))
    except psycopg.errors.UndefinedTable:
        pass
    fields, selects, storage = [], [], []
    for name, typname, _ in columns:
        field = (schema.field(name) if schema is not None and name in schema.names
                 else pa.field(name, _arrow_type(typname)))
        fields.append(field)
        ident = sql.Identifier(name)
        if typname in ("timestamp", "timestamptz", "time"):
            # microseconds since the epoch (or midnight): exact, and no time zone to parse
            selects.append(sql.SQL("(extract(epoch FROM {}) * 1000000)::int8").format(ident))
            storage.append(pa.int64())
        elif typname == "bytea":
            selects.append(sql.SQL("encode({}, 'hex')").format(ident))
            storage.append(pa.string())
        elif typname in ("bool", "int2", "int4", "int8", "float4", "float8", "date"):
            selects.append(ident)
            storage.append(_arrow_type(typname))
        else:
            selects.append(sql.SQL("{}::text").format(ident))
            storage.append(pa.string())
    order = _primary_key(con, table) or []
    query = sql.SQL("COPY (SELECT {} FROM {}{}) TO STDOUT (FORMAT csv)").format(
        sql.SQL(", ").join(selects), identifier(table),
        sql.SQL(" ORDER BY {}").format(sql.SQL(", ").join(map(sql.Identifier, order)))
        if order else sql.SQL(""))
    chunks = []
    with con.cursor() as cur, cur.copy(query) as copy:
        for data in copy:
            chunks.append(bytes(data))
    names = [f.name for f in fields]
    if not chunks:
        return pa.table([pa.array([], f.type) for f in fields], schema=pa.schema(fields))
    parsed = pacsv.read_csv(
        pa.py_buffer(b"".join(chunks)),
        read_options=pacsv.ReadOptions(column_names=[f"c{i}" for i in range(len(names))]),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types={f"c{i}": s for i, s in enumerate(storage)}, true_values=["t"],
            false_values=["f"], null_values=[""], strings_can_be_null=True,
            quoted_strings_can_be_null=False))
    arrays = [_restore(parsed.column(i), columns[i][1], f.type) for i, f in enumerate(fields)]
    return pa.table(arrays, schema=pa.schema(fields))


def _primary_key(con, table: str) -> list[str] | None:
    rows = con.execute(
        "SELECT a.attname FROM pg_index i, unnest(i.indkey) WITH ORDINALITY k(attnum, n) "
        "JOIN pg_attribute a ON a.attnum = k.attnum "
        "WHERE i.indrelid = to_regclass(%s) AND i.indisprimary AND a.attrelid = i.indrelid "
        "ORDER BY k.n", (_regclass_name(table),)).fetchall()
    return [r[0] for r in rows] or None


def _restore(column: pa.ChunkedArray, typname: str, t: pa.DataType) -> pa.ChunkedArray:
    """A column read back as CSV, as Arrow type `t`."""
    if pa.types.is_dictionary(t):
        return _restore(column, typname, t.value_type).dictionary_encode()
    if typname in ("timestamp", "timestamptz"):
        micros = column.cast(pa.int64())
        if not pa.types.is_timestamp(t):
            return micros.cast(pa.timestamp("us", "UTC" if typname == "timestamptz" else None))
        return micros.cast(pa.timestamp("us", t.tz)).cast(t, safe=False)
    if typname == "bytea":
        values = [None if v is None else bytes.fromhex(v) for v in column.to_pylist()]
        return pa.chunked_array([pa.array(values, pa.binary())]).cast(t)
    if typname == "time":
        micros = column.cast(pa.int64())
        return micros.cast(pa.time64("us")).cast(t if pa.types.is_time(t) else pa.time64("us"),
                                                  safe=False)
    return column.cast(t)
