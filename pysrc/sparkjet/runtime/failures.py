"""What a failed execution tells its supervisor: the error with its type and full
traceback, and whether a replay would repeat it or an outage caused it.

A restart replays the input from the last snapshot. That cures a lost member, a killed
process, an unreachable peer or a database that was down for a while; it cannot cure a bad
record, a schema violation or a bug in a user function, which fail again on the same input,
seconds of backoff later, until ``max_restarts`` is spent. So a failure is told apart by
*kind*, here and nowhere else:

- **deterministic** (:func:`is_deterministic`): its class has ``deterministic = True``, or
  one of its causes has (sparkjet's errors about the data and the arguments). The job
  fails at once.
- **transient** (:func:`transient_kind`): the error, or an exception it was raised from
  (its ``__cause__``, or the ``__context__`` a connector's ``raise ... from None`` keeps),
  is a connection refused, reset or lost, a timeout, a server shutting down, starting up
  or in recovery, or a serialization failure or deadlock, as the client library of the
  system says it: PostgreSQL's SQLSTATE (psycopg's ``sqlstate``: classes ``08``,
  ``40001``, ``40P01``, ``53300``, ``57P01``..``57P03``; without one, libpq's words for a
  lost connection), Kafka's ``KafkaError`` (``retriable()``, or a transport, timeout,
  broker or coordinator code; never ``fatal()``), botocore's and urllib3's connection and
  timeout errors and S3's 5xx and throttling answers (pyarrow's ``AWS Error <TYPE>``),
  redis-py's ``ConnectionError`` (not ``AuthenticationError``), ``TimeoutError`` and
  ``BusyLoadingError``, the OS's connection errnos, and a full disk or quota
  (``ENOSPC``, ``EDQUOT``: the space comes back as an operator or a retention frees it;
  two disk-full episodes are not "the same failure twice"); the Rust-backed libraries
  (deltalake) carry those errnos only as "(os error N)" in their text, read there. The restart policy
  (:func:`~sparkjet.runtime.supervision.restart_or_fail`) retries these with exponential
  backoff within ``max_restarts`` per ``restart_window``.
- **unknown** (an exception of the user's own code, an error none of the above knows): it
  is retried, and the job fails if the replay ends in the same error.
"""
from __future__ import annotations

import errno
import re
import sys
import traceback

#: How much of a traceback an error message carries (the member's log has all of it).
MAX_TRACEBACK = 6000

#: How far down a chain of causes the kind of an error is looked for.
MAX_CHAIN = 16


def is_deterministic(error: BaseException | None) -> bool:
    """True when ``error`` or one of its causes says a replay would repeat it."""
    seen = set()
    while error is not None and id(error) not in seen:
        if getattr(error, "deterministic", False):
            return True
        seen.add(id(error))
        error = error.__cause__
    return False


def transient_kind(error: BaseException | None) -> str | None:
    """The kind of outage ``error`` is ("connection refused", "timeout", "server shutting
    down", "serialization failure", ...), found in it or in the exceptions it was raised
    from; None if it is not known to be transient, or if an error of the chain says a
    replay would repeat it (see the module doc)."""
    for e in _chain(error):
        if getattr(e, "deterministic", False):
            return None
        given = getattr(e, "transient", None)   # ExecutionFailedError: the member's verdict
        if isinstance(given, str) and given:
            return given
        kind = _kind(e)
        if kind is not None:
            return kind
    return None


def report(error: BaseException) -> dict:
    """A failure as plain data: ``error`` ("Type: message"), ``traceback``,
    ``deterministic`` and ``transient`` (its kind, or None)."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    if len(text) > MAX_TRACEBACK:
        text = "...\n" + text[-MAX_TRACEBACK:]
    deterministic = is_deterministic(error)
    return {"error": f"{type(error).__name__}: {error}", "traceback": text,
            "deterministic": deterministic,
            "transient": None if deterministic else transient_kind(error), "exception": True}


def _chain(error: BaseException | None):
    """``error`` and what it was raised from: the cause, else the context (also when
    suppressed: ``raise ConnectorError(...) from None`` translates the client's error)."""
    seen = set()
    while error is not None and id(error) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


# -- the kinds, by library -------------------------------------------------------------------

#: OS errnos of a connection that failed or broke.
_ERRNOS = {
    errno.ECONNREFUSED: "connection refused", errno.ECONNRESET: "connection reset",
    errno.ECONNABORTED: "connection aborted", errno.EPIPE: "connection lost",
    errno.ETIMEDOUT: "timeout", errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable", errno.ENETDOWN: "network down",
    errno.EHOSTDOWN: "host down",
}

#: OS errnos of a disk out of space: environmental, cured by freeing space, not by code.
_DISK_ERRNOS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}

#: PostgreSQL's SQLSTATEs of an outage or a conflict that a retry resolves.
_SQLSTATES = {
    "40001": "serialization failure", "40P01": "deadlock", "53300": "too many connections",
    "57P01": "server shutting down", "57P02": "server crashed", "57P03": "server starting up",
}

#: libpq's words for a lost or refused connection (its errors carry no SQLSTATE).
_LIBPQ = [
    ("connection refused", "connection refused"),
    ("connection reset", "connection reset"),
    ("timeout expired", "timeout"), ("timed out", "timeout"),
    ("the database system is starting up", "server starting up"),
    ("the database system is not yet accepting connections", "server starting up"),
    ("the database system is shutting down", "server shutting down"),
    ("the database system is in recovery mode", "server in recovery"),
    ("server closed the connection unexpectedly", "connection lost"),
    ("terminating connection", "connection lost"),
    ("the connection is lost", "connection lost"), ("the connection is closed", "connection lost"),
    ("could not receive data from server", "connection lost"),
    ("could not send data to server", "connection lost"),
    ("consuming input failed", "connection lost"), ("no route to host", "host unreachable"),
]

#: librdkafka's codes of a broker that is down, moving or busy.
_KAFKA_CODES = {
    "_TRANSPORT": "connection lost", "_ALL_BROKERS_DOWN": "brokers down",
    "_TIMED_OUT": "timeout", "_MSG_TIMED_OUT": "timeout", "_TIMED_OUT_QUEUE": "timeout",
    "REQUEST_TIMED_OUT": "timeout", "NETWORK_EXCEPTION": "connection lost",
    "_RESOLVE": "host unreachable", "BROKER_NOT_AVAILABLE": "broker unavailable",
    "LEADER_NOT_AVAILABLE": "leader unavailable", "NOT_LEADER_FOR_PARTITION": "leader moved",
    "COORDINATOR_NOT_AVAILABLE": "coordinator unavailable", "NOT_COORDINATOR":
    "coordinator moved", "COORDINATOR_LOAD_IN_PROGRESS": "coordinator loading",
    "_WAIT_COORD": "coordinator unavailable", "CONCURRENT_TRANSACTIONS":
    "concurrent transaction", "NOT_ENOUGH_REPLICAS": "not enough replicas",
    "NOT_ENOUGH_REPLICAS_AFTER_APPEND": "not enough replicas",
    "KAFKA_STORAGE_ERROR": "broker storage unavailable",
}

#: The AWS SDK's error types (in pyarrow's "AWS Error <TYPE>") a retry resolves.
_AWS_ERRORS = {
    "NETWORK_CONNECTION": "connection failed", "REQUEST_TIMEOUT": "timeout",
    "SERVICE_UNAVAILABLE": "S3 unavailable (503)", "SLOW_DOWN": "S3 throttling (503)",
    "THROTTLING": "S3 throttling", "INTERNAL_FAILURE": "S3 internal error (500)",
}
_AWS_ERROR = re.compile(r"AWS Error ([A-Z_]+)")
_HTTP_5XX = re.compile(r"HTTP response code:? (5\d\d)\b|status code:? (5\d\d)\b", re.I)

#: S3's error codes (botocore's ClientError) a retry resolves.
_S3_CODES = {"SlowDown": "S3 throttling (503)", "ServiceUnavailable": "S3 unavailable (503)",
             "InternalError": "S3 internal error (500)", "RequestTimeout": "timeout",
             "Throttling": "S3 throttling", "ThrottlingException": "S3 throttling"}


def _kind(e: BaseException) -> str | None:
    """The transient kind of ``e`` itself (not of its causes), or None."""
    for of in (_psycopg_kind, _kafka_kind, _botocore_kind, _urllib3_kind, _redis_kind):
        kind = of(e)
        if kind is not None:
            return kind
    if isinstance(e, OSError):
        kind = _os_kind(e)
        if kind is not None:
            return kind
    return _rust_io_kind(e)


#: How Rust's std::io::Error shows an errno ("No space left on device (os error 28)"): the
#: errors of the Rust-backed libraries (deltalake, polars, object_store) carry no errno.
_RUST_IO = re.compile(r"\(os error (\d+)\)")


def _rust_io_kind(e: BaseException) -> str | None:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - an error whose text cannot be had says nothing here
        return None
    found = _RUST_IO.search(text)
    if found is None:
        return None
    code = int(found.group(1))
    return _ERRNOS.get(code) or _DISK_ERRNOS.get(code)


def _os_kind(e: OSError) -> str | None:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, ConnectionResetError):
        return "connection reset"
    if isinstance(e, ConnectionAbortedError):
        return "connection aborted"
    if isinstance(e, BrokenPipeError):
        return "connection lost"
    if isinstance(e, TimeoutError):
        return "timeout"
    if e.errno in _ERRNOS:
        return _ERRNOS[e.errno]
    if e.errno in _DISK_ERRNOS:
        return _DISK_ERRNOS[e.errno]
    # pyarrow's S3 errors are OSErrors without an errno, saying the SDK's error type
    text = str(e)
    found = _AWS_ERROR.search(text)
    if found is not None and found.group(1) in _AWS_ERRORS:
        return _AWS_ERRORS[found.group(1)]
    if found is not None:
        status = _HTTP_5XX.search(text)
        if status is not None:
            return f"S3 server error ({status.group(1) or status.group(2)})"
    return None


def _module(name: str):
    """A client library if something already imported it (if not, no error of it exists:
    nothing is imported here)."""
    return sys.modules.get(name)


def _psycopg_kind(e: BaseException) -> str | None:
    psycopg = _module("psycopg")
    if psycopg is None or not isinstance(e, psycopg.Error):
        return None
    state = getattr(e, "sqlstate", None)
    if state:
        if state in _SQLSTATES:
            return _SQLSTATES[state]
        return "connection failure" if state.startswith("08") else None
    if isinstance(e, psycopg.OperationalError):
        text = str(e).lower()
        if "authentication failed" in text or "does not exist" in text:
            return None
        for words, kind in _LIBPQ:
            if words in text:
                return kind
    return None


def _kafka_kind(e: BaseException) -> str | None:
    kafka = _module("confluent_kafka")
    if kafka is None:
        return None
    err = e.args[0] if isinstance(e, kafka.KafkaException) and e.args else None
    if not isinstance(err, kafka.KafkaError) or err.fatal():
        return None
    name = err.name()
    if name in _KAFKA_CODES:
        return _KAFKA_CODES[name]
    if err.retriable():
        return f"Kafka retriable error {name}"
    return None


def _botocore_kind(e: BaseException) -> str | None:
    exceptions = _module("botocore.exceptions")
    if exceptions is None:
        return None
    if isinstance(e, (exceptions.ConnectTimeoutError, exceptions.ReadTimeoutError)):
        return "timeout"
    if isinstance(e, exceptions.EndpointConnectionError):
        return "connection failed"
    if isinstance(e, exceptions.ConnectionClosedError):
        return "connection lost"
    if isinstance(e, exceptions.ClientError):
        response = getattr(e, "response", None) or {}
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _S3_CODES:
            return _S3_CODES[code]
        if isinstance(status, int) and 500 <= status < 600:
            return f"S3 server error ({status})"
    return None


def _urllib3_kind(e: BaseException) -> str | None:
    exceptions = _module("urllib3.exceptions")
    if exceptions is None:
        return None
    if isinstance(e, (exceptions.NewConnectionError, exceptions.ProtocolError)):
        return "connection failed"  # (a NewConnectionError is also a TimeoutError)
    if isinstance(e, exceptions.TimeoutError):
        return "timeout"
    return None


def _redis_kind(e: BaseException) -> str | None:
    exceptions = _module("redis.exceptions")
    if exceptions is None:
        return None
    if isinstance(e, exceptions.AuthenticationError):
        return None
    if isinstance(e, exceptions.BusyLoadingError):
        return "server loading"
    if isinstance(e, exceptions.TimeoutError):
        return "timeout"
    if isinstance(e, exceptions.ConnectionError):
        return "connection refused" if "refused" in str(e).lower() else "connection failed"
    if isinstance(e, (exceptions.TryAgainError, exceptions.ReadOnlyError)):
        return "server failing over"
    return None


__all__ = ["MAX_TRACEBACK", "is_deterministic", "report", "transient_kind"]
