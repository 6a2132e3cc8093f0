"""Connections to PostgreSQL, and its errors as sparkjet's: what every part of the sink
shares. No message and no ``repr`` ever holds the connection string's password.

Needs psycopg 3 (``pip install 'sparkjet[postgres]'``), loaded when first used.
"""
from __future__ import annotations

from typing import Any, Protocol

from sparkjet._redact import MASK, redact
from sparkjet.errors import ConnectorError, InvalidArgumentError

CONNECTOR = "PostgreSQL sink"


def psycopg_module():
    """``psycopg``, or an ImportError that says how to install it."""
    try:
        import psycopg
    except ImportError:
        raise ImportError(
            "PostgreSQL sinks need psycopg 3: pip install 'sparkjet[postgres]'") from None
    return psycopg


def describe(dsn: str) -> str:
    """Where `dsn` connects, without its password."""
    try:
        from psycopg.conninfo import conninfo_to_dict, make_conninfo
    except ImportError:
        return MASK
    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001 - a malformed DSN may hold a password anywhere
        return MASK
    if "password" in params:
        params["password"] = MASK
    return make_conninfo(**params)


def where(dsn: str) -> str:
    """host:port, database and user of `dsn` (libpq's defaults where absent)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        p = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001
        return "(malformed connection string)"
    return (f"{p.get('host') or p.get('hostaddr') or 'localhost'}:{p.get('port') or 5432} "
            f"database {p.get('dbname') or p.get('user') or '(default)'} as user "
            f"{p.get('user') or '(default)'}")


def _password(dsn: str) -> str | None:
    from psycopg.conninfo import conninfo_to_dict

    try:
        return conninfo_to_dict(dsn).get("password")
    except Exception:  # noqa: BLE001
        return None


def failure(e: Exception, action: str, dsn: str, table: str | None = None) -> Exception:
    """A psycopg error as sparkjet's: InvalidArgumentError where the data or the table is
    wrong, ConnectorError where the server is unreachable or refuses; the message names the
    connector, what it was doing and the server's words, never the password."""
    psycopg = psycopg_module()
    diag = getattr(e, "diag", None)
    text = (diag.message_primary if diag is not None and diag.message_primary else str(e))
    text = text.strip()
    if diag is not None and diag.message_detail:
        text += f"; {diag.message_detail}"
    if diag is not None and diag.context and "COPY" in diag.context:
        # "COPY t, line 3, column id: "x"": line n is row n - 1 of the batch
        text += f" ({diag.context.strip().splitlines()[0]})"
    message = redact(f"{CONNECTOR} ({where(dsn)}): {action} failed: {text}", _password(dsn))
    if isinstance(e, (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError)):
        return InvalidArgumentError(message)
    return ConnectorError(message)


def connect(dsn: str, autocommit: bool, timeout: float = 10.0, name: str = "sparkjet"):
    """A connection to `dsn` in UTC, named `name` (``application_name``); ConnectorError
    saying why (unreachable, refused, authentication failed) if there is none."""
    psycopg = psycopg_module()
    try:
        con = psycopg.connect(dsn, autocommit=autocommit, connect_timeout=max(1, int(timeout)),
                              application_name=name)
    except psycopg.Error as e:
        text = str(e).strip()
        if "authentication failed" in text:
            what = "authentication failed"
        elif "does not exist" in text:
            what = "refused"
        else:
            what = "unreachable"
        raise ConnectorError(redact(
            f"{CONNECTOR}: cannot connect to {where(dsn)} ({what}): {text}",
            _password(dsn))) from None
    try:
        con.execute("SET TIME ZONE 'UTC'")
        if not autocommit:
            con.commit()
    except BaseException:
        con.close()
        raise
    return con


def identifier(table: str):
    """`table` as an SQL identifier (``schema.table`` names a schema)."""
    from psycopg import sql

    return sql.Identifier(*table.split(".", 1))


class SinkTarget(Protocol):
    """What the writers read of their :class:`~sparkjet.connectors.postgres.sink.PostgresSink`
    (a protocol, so that the writers' modules need no import of the sink's)."""

    dsn: str
    table: str
    key: Any
    connect_timeout: float
