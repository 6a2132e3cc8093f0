"""The exchange's wire conventions (version 1): what a plain pyarrow.flight client must
send to talk to an :class:`~sparkjet.runtime.exchange.ExchangeServer`, and what it hears.

A data stream is a Flight ``DoExchange`` call. Its descriptor is a command: UTF-8 JSON
``{"protocol": "sparkjet.exchange/1", "execution_id": E, "vertex": V, "processor": P,
"channel": C}``. Every control message is a metadata-only Flight message whose
``app_metadata`` is 16 bytes, little-endian ``<4sBBHQ``: the magic ``b"SJX1"``, a kind,
flags, two reserved zero bytes, and a 64-bit value:

=========  ====  ==================================  ===========================
kind       code  value                               flags
=========  ====  ==================================  ===========================
data       0     0 (only on a batch that asks for    ``ACK_REQUEST`` (2)
                 an ack; a plain batch has no
                 metadata)
barrier    1     snapshot id                         ``TERMINAL`` (1), ``ACK_REQUEST``
end        2     0                                   ``ACK_REQUEST``
credit     3     0 (asks for an ack, carries         ``ACK_REQUEST``
                 nothing; not counted)
watermark  4     the event time, the unsigned 64     ``IDLE`` (4), ``ACK_REQUEST``
                 bits of the signed time
ack        16    messages accepted so far            (server to client)
=========  ====  ==================================  ===========================

Every call carries the header ``sparkjet-auth`` (a token signed with the execution's
secret; :mod:`sparkjet.runtime.exchange.security` gives its format); an action's body is the
JSON ``{"execution_id": E, "body": {...}}`` and names its execution, never null.

The server answers a stream it accepts with ``ack 0`` (the handshake) and every message
flagged ``ACK_REQUEST`` with an ack once the message is in the aligner. Data, barrier,
watermark and end messages count; credit requests do not. A refusal (a fence, a bad
message, an unknown processor) is a Flight error whose ``extra_info`` is one of the tags
:data:`TAG_FENCED`, :data:`TAG_REFUSED`.

File streams carry a file's bytes (a member's backup copy of a snapshot chunk file, a
peer's read of one). Their command, the ``DoPut`` descriptor's or the ``DoGet`` ticket's, is
UTF-8 JSON ``{"protocol": "sparkjet.exchange/1", "execution_id": E, "file": NAME, "body":
{...}}``: NAME picks the server's handler (``ExchangeServer.on_put``, ``on_get``), the
body is the handler's (the slot, the path, the range), and E fences the call like a data
stream's. The token of the call is bound to NAME and the command
(:func:`~sparkjet.runtime.exchange.security.action_digest` of them), as an action's is to
its body. The bytes travel as record batches of
:data:`FILE_SCHEMA`, one binary row per piece of at most :data:`FILE_PIECE` bytes, no
compression (chunk files are compressed already). A ``DoPut`` ends with a metadata-only
message, the trailer (JSON: the writer's ``size`` and ``xxh3``); the receiver checks what it
read against it and answers with one metadata message (JSON) once the copy is in place, or
refuses the call (a short stream, one without its trailer, or a checksum that does not
match). A ``DoGet`` answers with the schema, whose metadata ``sparkjet`` is JSON (the
file's ``size``), then the pieces of the range asked for.

Why ``DoExchange`` and not ``DoPut`` for data streams: a ``DoPut`` writer blocked by
backpressure cannot be
cancelled from another thread (``FlightClient.close()`` and ``writer.close()`` both hang,
pyarrow 26), so a member that fails could not free its sending threads. A ``DoExchange``
reader's ``cancel()`` ends the call at once, and the server's acks travel back on the same
call.
"""
from __future__ import annotations

import json
import struct

import pyarrow as pa
from pyarrow import flight

from sparkjet.errors import (
    ExchangeAuthError,
    ExchangeError,
    ExchangeFencedError,
    ExchangeRefusedError,
    ExchangeTimeoutError,
)

PROTOCOL = "sparkjet.exchange/1"

_CONTROL = struct.Struct("<4sBBHQ")
_MAGIC = b"SJX1"
DATA, BARRIER, END, CREDIT, WATERMARK, ACK = 0, 1, 2, 3, 4, 16
TERMINAL, ACK_REQUEST, IDLE = 1, 2, 4
ASK_CREDIT = _CONTROL.pack(_MAGIC, CREDIT, ACK_REQUEST, 0, 0)
KIND_NAMES = {DATA: "data", BARRIER: "barrier", END: "end", CREDIT: "credit",
              WATERMARK: "watermark", ACK: "ack"}

# Tags in a Flight error's extra_info: how the client tells a refusal from a broken link.
TAG_FENCED = b"sparkjet:fenced"
TAG_REFUSED = b"sparkjet:refused"


#: The record batches of a file stream: one binary row per piece of the file.
FILE_SCHEMA = pa.schema([pa.field("data", pa.binary(), nullable=False)])
#: The most bytes one piece of a file stream carries.
FILE_PIECE = 1 << 20
#: The schema metadata key of a ``DoGet`` file stream's answer (JSON).
FILE_INFO = b"sparkjet"


# ---- errors ------------------------------------------------------------------------------


def flight_error(cls, message: str, tag: bytes):
    return cls(message, extra_info=tag)


def short_message(error: BaseException) -> str:
    """The message of a Flight error without gRPC's debug context."""
    text = str(error)
    for marker in (". Detail:", ". gRPC client debug context:", " gRPC client debug context:"):
        text = text.split(marker, 1)[0]
    return text.strip() or type(error).__name__


def map_error(error: BaseException, peer: str, what: str) -> ExchangeError:
    """The sparkjet error for a Flight or Arrow error that ``what`` (a phrase naming the
    call and the peer) met while talking to ``peer``."""
    tag = getattr(error, "extra_info", b"") or b""
    reason = short_message(error)
    if tag == TAG_FENCED:
        return ExchangeFencedError(f"{what}: fenced: {reason}", peer)
    if tag == TAG_REFUSED:
        return ExchangeRefusedError(f"{what}: refused: {reason}", peer)
    if isinstance(error, flight.FlightUnauthenticatedError):
        return ExchangeAuthError(f"{what}: not authenticated: {reason}", peer)
    if isinstance(error, flight.FlightTimedOutError):
        return ExchangeTimeoutError(f"{what}: the peer did not answer in time ({reason})", peer)
    if isinstance(error, flight.FlightUnavailableError):
        return ExchangeError(f"{what}: the peer is unreachable ({reason})", peer)
    return ExchangeError(f"{what}: the connection failed ({type(error).__name__}: {reason})",
                         peer)


# ---- wire encoding -----------------------------------------------------------------------


def control(kind: int, flags: int = 0, value: int = 0) -> bytes:
    return _CONTROL.pack(_MAGIC, kind, flags, 0, value)


def parse_control(buf) -> tuple[int, int, int]:
    """(kind, flags, value) of a control message; ValueError for anything else."""
    data = buf.to_pybytes()
    if len(data) != _CONTROL.size:
        raise ValueError(f"control message of {len(data)} bytes, expected {_CONTROL.size}")
    magic, kind, flags, _, value = _CONTROL.unpack(data)
    if magic != _MAGIC:
        raise ValueError(f"control message with magic {magic!r}, expected {_MAGIC!r}")
    if kind not in KIND_NAMES:
        raise ValueError(f"unknown control message kind {kind}")
    return kind, flags, value


def stream_descriptor(execution_id: int, vertex: str, processor: int, channel: int):
    command = {"protocol": PROTOCOL, "execution_id": execution_id, "vertex": vertex,
               "processor": processor, "channel": channel}
    return flight.FlightDescriptor.for_command(json.dumps(command).encode())


def parse_descriptor(descriptor) -> tuple[int, str, int, int]:
    """(execution_id, vertex, processor, channel) of a stream's descriptor; ValueError
    with the reason if it is not a sparkjet exchange stream."""
    if descriptor.descriptor_type != flight.DescriptorType.CMD:
        raise ValueError("the descriptor is a path, expected a sparkjet exchange command")
    try:
        command = json.loads(descriptor.command)
    except ValueError as e:
        raise ValueError(f"the descriptor's command is not JSON ({e})") from None
    if not isinstance(command, dict) or command.get("protocol") != PROTOCOL:
        got = command.get("protocol") if isinstance(command, dict) else None
        raise ValueError(f"protocol {got!r}, expected {PROTOCOL!r}")
    fields = {"execution_id": int, "vertex": str, "processor": int, "channel": int}
    for name, kind in fields.items():
        if type(command.get(name)) is not kind:
            raise ValueError(f"descriptor field {name!r} is {command.get(name)!r}, "
                             f"expected {kind.__name__}")
    return (command["execution_id"], command["vertex"], command["processor"],
            command["channel"])


def file_command(execution_id: int, name: str, body: dict) -> bytes:
    """The command of a file stream (a ``DoPut`` descriptor's, a ``DoGet`` ticket's)."""
    return json.dumps({"protocol": PROTOCOL, "execution_id": execution_id, "file": name,
                       "body": body}).encode()


def parse_file_command(raw: bytes) -> tuple[int, str, dict]:
    """(execution_id, name, body) of a file stream's command; ValueError with the reason
    if it is not one."""
    try:
        command = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the command is not JSON ({e})") from None
    if not isinstance(command, dict) or command.get("protocol") != PROTOCOL:
        got = command.get("protocol") if isinstance(command, dict) else None
        raise ValueError(f"protocol {got!r}, expected {PROTOCOL!r}")
    for name, kind in (("execution_id", int), ("file", str), ("body", dict)):
        if type(command.get(name)) is not kind:
            raise ValueError(f"file stream field {name!r} is {command.get(name)!r}, "
                             f"expected {kind.__name__}")
    return command["execution_id"], command["file"], command["body"]


def file_batch(piece, schema: pa.Schema = FILE_SCHEMA) -> pa.RecordBatch:
    """One piece of a file (bytes-like, at most 2 GiB) as a one-row batch, not copied."""
    data = pa.py_buffer(piece)
    offsets = pa.py_buffer(struct.pack("<ii", 0, data.size))
    return pa.RecordBatch.from_arrays(
        [pa.Array.from_buffers(pa.binary(), 1, [None, offsets, data])], schema=schema)


def file_pieces(batch: pa.RecordBatch):
    """The pieces (pyarrow buffers, not copied) a file stream's batch carries."""
    for value in batch.column(0):
        yield value.as_buffer()


__all__ = ["ACK", "ACK_REQUEST", "ASK_CREDIT", "BARRIER", "CREDIT", "DATA", "END", "FILE_INFO",
           "FILE_PIECE", "FILE_SCHEMA", "IDLE", "KIND_NAMES", "PROTOCOL", "TAG_FENCED",
           "TAG_REFUSED", "TERMINAL", "WATERMARK",
           "control", "file_batch", "file_command", "file_pieces", "flight_error", "map_error",
           "parse_control", "parse_descriptor", "parse_file_command", "short_message",
           "stream_descriptor"]
