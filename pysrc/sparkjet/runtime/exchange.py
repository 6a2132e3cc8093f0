"""The transport between members, and between members and the coordinator, over Arrow Flight.

Two planes share one :class:`ExchangeServer` per member (and one on the driver for the
coordinator):

- **Data**: one Flight stream per edge channel carries Arrow batches and, in band, the
  snapshot barriers, the watermarks and the end of the stream, into the receiving processor's
  :class:`~sparkjet.runtime.aligner.BarrierAligner` (``put`` / ``put_barrier`` / ``end`` on the
  channel named by the stream; a watermark is put as a
  :class:`~sparkjet.runtime.watermarks.Watermark` item). Order within a stream is kept, so
  a barrier or a watermark never overtakes a batch.
- **Control**: Flight actions carry small JSON messages (the coordinator's "barrier" and
  "commit" requests, the members' phase-1 "ack" with their manifests): a name and a JSON
  object in, a JSON object out.

>>> from sparkjet.runtime.aligner import BarrierAligner
>>> from sparkjet.runtime.security import LinkSecurity
>>> security = LinkSecurity.generate(execution_id=7)
>>> aligner = BarrierAligner(channels=1, capacity=16)
>>> server = ExchangeServer(inbound={("aggregate", 0): aligner}, execution_id=7,
...                         security=security)
>>> client = ExchangeClient(server.location, security=security)
>>> ch = client.channel("aggregate", 0, channel=0, execution_id=7)
>>> ch.put(pa.record_batch({"k": [1, 2]})); ch.put_barrier(0); ch.end(); ch.close()
>>> [e[0] for e in aligner.drain(10)]
['item', 'snapshot', 'done']
>>> server.on_action("ping2", lambda body: {"pong": body["n"] + 1})
>>> client.action("ping2", {"n": 1})
{'pong': 2}
>>> client.close(); server.close()
True

Wire conventions (version 1)
----------------------------
A data stream is a Flight ``DoExchange`` call. Its descriptor is a command: UTF-8 JSON
``{"protocol": "sparkjet.exchange/1", "execution_id": E, "vertex": V, "processor": P,
"channel": C}``. Every control message is a metadata-only Flight message whose
``app_metadata`` is 16 bytes, little-endian ``<4sBBHQ``: the magic ``b"SJX1"``, a kind,
flags, two reserved zero bytes, and a 64-bit value:

========  ====  ==================================  ===========================
kind      code  value                               flags
========  ====  ==================================  ===========================
data      0     0 (only on a batch that asks for    ``ACK_REQUEST`` (2)
                an ack; a plain batch has no
                metadata)
barrier   1     snapshot id                         ``TERMINAL`` (1), ``ACK_REQUEST``
end       2     0                                   ``ACK_REQUEST``
credit    3     0 (asks for an ack, carries         ``ACK_REQUEST``
                nothing; not counted)
ack       16    messages accepted so far            (server to client)
========  ====  ==================================  ===========================

Every call carries the header ``sparkjet-auth`` (a token signed with the execution's
secret; :mod:`sparkjet.runtime.security` gives its format); an action's body is the JSON
``{"execution_id": E, "body": {...}}`` and names its execution, never null.

The server answers a stream it accepts with ``ack 0`` (the handshake) and every message
flagged ``ACK_REQUEST`` with an ack once the message is in the aligner. Data, barrier and
end messages count; credit requests do not.

Why ``DoExchange`` and not ``DoPut``: a ``DoPut`` writer blocked by backpressure cannot be
cancelled from another thread (``FlightClient.close()`` and ``writer.close()`` both hang,
pyarrow 26), so a member that fails could not free its sending threads. A ``DoExchange``
reader's ``cancel()`` ends the call at once, and the server's acks travel back on the same
call.

Backpressure
------------
The server's handler for a stream blocks in ``aligner.put`` (in slices of
``ExchangeServer.poll`` seconds, checking for shutdown and for a cancelled call) and
reads nothing meanwhile. The sender keeps at most ``window_messages`` messages and
``window_bytes`` bytes (a single larger batch is allowed alone) that the server has not
yet put into the aligner; past that, :meth:`OutboundChannel.put` waits for an ack. So
what sits between two processors is bounded by what the aligner holds (its capacity, in
entries) plus one window, whatever gRPC buffers (its HTTP/2 windows grow to tens of MB on a
fast link). The sender asks for an ack when half the window is used, so a server that keeps
up never makes it wait for a round trip.

Authentication and encryption
-----------------------------
Every call (streams, actions, ``list_actions``) carries a token signed with the
execution's secret, which the server checks in middleware before any handler runs; with
a TLS identity every link is TLS with the execution's pinned certificate. See
:mod:`sparkjet.runtime.security`.

Fencing
-------
Every stream names the execution it belongs to; a server refuses a stream (and an action
that names an execution) of any other execution with :class:`ExchangeFencedError`, so a
zombie member of an old execution cannot inject data or acks. One server serves one
execution: the coordinator starts a new one for each execution.

Threads and blocking
--------------------
The server handles each stream and action on a gRPC thread of its own (the pool grows
with the number of open streams); its Python code holds the GIL only between blocking
calls, which release it. A handler registered with :meth:`ExchangeServer.on_action` runs
on such a thread and should answer quickly. On the client, one thread uses a channel
(like an aligner's producer); :meth:`OutboundChannel.abort` may be called from any thread
and wakes a blocked ``put``. :class:`ExchangeClient` may be shared by threads. A sender
that keeps a stream open without sending keeps :meth:`ExchangeServer.close` waiting:
senders close or abort their channels when an execution ends.
"""
from __future__ import annotations

import itertools
import json
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa
from pyarrow import flight

from sparkjet._checks import check_int, check_number
from sparkjet.errors import (  # noqa: F401 (defined there; named here too)
    ExchangeAuthError,
    ExchangeError,
    ExchangeFencedError,
    ExchangeRefusedError,
    ExchangeTimeoutError,
    FencedError,
    InvalidArgumentError,
    SparkjetError,
    UnsupportedTypeError,
)
from sparkjet.runtime.security import HEADER as AUTH_HEADER
from sparkjet.runtime.security import REFUSAL, LinkSecurity, ServerAuth, action_digest
from sparkjet.runtime.watermarks import Watermark

__all__ = [
    "PROTOCOL",
    "ExchangeAuthError",
    "ExchangeClient",
    "ExchangeError",
    "ExchangeFencedError",
    "ExchangeRefusedError",
    "ExchangeServer",
    "ExchangeTimeoutError",
    "OutboundChannel",
]

PROTOCOL = "sparkjet.exchange/1"

_CONTROL = struct.Struct("<4sBBHQ")
_MAGIC = b"SJX1"
_DATA, _BARRIER, _END, _CREDIT, _WATERMARK, _ACK = 0, 1, 2, 3, 4, 16
_TERMINAL, _ACK_REQUEST, _IDLE = 1, 2, 4
_ASK_CREDIT = _CONTROL.pack(_MAGIC, _CREDIT, _ACK_REQUEST, 0, 0)
_KIND_NAMES = {_DATA: "data", _BARRIER: "barrier", _END: "end", _CREDIT: "credit",
               _WATERMARK: "watermark", _ACK: "ack"}

# Tags in a Flight error's extra_info: how the client tells a refusal from a broken link.
_TAG_FENCED = b"sparkjet:fenced"
_TAG_REFUSED = b"sparkjet:refused"

_log = logging.getLogger("sparkjet.exchange")


# ---- errors ------------------------------------------------------------------------------


def _flight_error(cls, message: str, tag: bytes):
    return cls(message, extra_info=tag)


def _short(error: BaseException) -> str:
    """The message of a Flight error without gRPC's debug context."""
    text = str(error)
    for marker in (". Detail:", ". gRPC client debug context:", " gRPC client debug context:"):
        text = text.split(marker, 1)[0]
    return text.strip() or type(error).__name__


def _check_security(security) -> None:
    if not isinstance(security, LinkSecurity):
        raise InvalidArgumentError(
            f"security must be a LinkSecurity, not {type(security).__name__}")


def _map_error(error: BaseException, peer: str, what: str) -> ExchangeError:
    """The sparkjet error for a Flight or Arrow error that ``what`` (a phrase naming the
    call and the peer) met while talking to ``peer``."""
    tag = getattr(error, "extra_info", b"") or b""
    reason = _short(error)
    if tag == _TAG_FENCED:
        return ExchangeFencedError(f"{what}: fenced: {reason}", peer)
    if tag == _TAG_REFUSED:
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


def _control(kind: int, flags: int = 0, value: int = 0) -> bytes:
    return _CONTROL.pack(_MAGIC, kind, flags, 0, value)


def _parse_control(buf) -> tuple[int, int, int]:
    """(kind, flags, value) of a control message; ValueError for anything else."""
    data = buf.to_pybytes()
    if len(data) != _CONTROL.size:
        raise ValueError(f"control message of {len(data)} bytes, expected {_CONTROL.size}")
    magic, kind, flags, _, value = _CONTROL.unpack(data)
    if magic != _MAGIC:
        raise ValueError(f"control message with magic {magic!r}, expected {_MAGIC!r}")
    if kind not in _KIND_NAMES:
        raise ValueError(f"unknown control message kind {kind}")
    return kind, flags, value


def _descriptor(execution_id: int, vertex: str, processor: int, channel: int):
    command = {"protocol": PROTOCOL, "execution_id": execution_id, "vertex": vertex,
               "processor": processor, "channel": channel}
    return flight.FlightDescriptor.for_command(json.dumps(command).encode())


def _parse_descriptor(descriptor) -> tuple[int, str, int, int]:
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


# ---- timeouts for calls that take none ---------------------------------------------------


class _Watchdog:
    """Runs a function at a deadline unless disarmed first. Flight's streaming reads and
    writes take no timeout (a call deadline would end a long-lived stream), so a timeout
    on them is a cancel of the call from this thread."""

    def __init__(self):
        self._cv = threading.Condition()
        self._timers: dict[int, tuple[float, Callable[[], None]]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, fn: Callable[[], None]) -> int:
        with self._cv:
            token = next(self._tokens)
            self._timers[token] = (time.monotonic() + seconds, fn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparkjet-exchange-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()
            return token

    def disarm(self, token: int) -> None:
        with self._cv:
            self._timers.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    due = [t for t, (deadline, _) in self._timers.items() if deadline <= now]
                    if due:
                        fns = [self._timers.pop(t)[1] for t in due]
                        break
                    nearest = min((d for d, _ in self._timers.values()), default=None)
                    self._cv.wait(None if nearest is None else nearest - now)
            for fn in fns:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a cancel that fails must not stop the others
                    _log.exception("exchange watchdog callback failed")


_WATCHDOG = _Watchdog()


# ---- server ------------------------------------------------------------------------------


class ExchangeServer(flight.FlightServerBase):
    """A member's (or the coordinator's) end of the exchange: receives the streams of
    the processors' input channels and answers actions.

    It listens from construction on (gRPC's own threads serve it; nothing to start) until
    :meth:`close`.

    :param host: the interface to listen on; ``location`` advertises ``advertise_host`` if
        given, else ``host``.
    :param port: 0 picks a free port.
    :param inbound: where streams go: a mapping ``{(vertex, processor): aligner}`` or a
        function ``(vertex, processor) -> aligner | None``. An aligner is a
        :class:`~sparkjet.runtime.aligner.BarrierAligner` or any object with its producer methods
        (``put``, ``put_barrier``, ``end``, each taking ``timeout=``), looked up when a
        stream opens. A stream names the aligner's channel it feeds; one stream at a time
        per channel.
    :param execution_id: the execution this server belongs to; streams and actions of any
        other execution are refused.
    :param security: the execution's :class:`~sparkjet.runtime.security.LinkSecurity`:
        every call must carry a token signed with its secret (checked before any handler
        runs), and with a TLS identity the server speaks TLS only.
    :param on_error: called with an :class:`ExchangeError` (naming the peer) when an
        inbound stream breaks (its sender died or aborted) or a zombie is refused; by
        default it is logged. A member passes its ``fail``.
    :param poll: how long one ``aligner.put`` waits before the handler checks for
        shutdown and for a cancelled call.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 inbound: Mapping | Callable | None = None, execution_id: int,
                 security: LinkSecurity,
                 on_error: Callable[[ExchangeError], Any] | None = None,
                 advertise_host: str | None = None, poll: float = 0.1):
        poll = check_number("poll", poll, above=0)
        self._execution_id = check_int("execution_id", execution_id, min=0)
        _check_security(security)
        if security.execution_id != self._execution_id:
            raise InvalidArgumentError(
                f"the credentials are execution {security.execution_id}'s, but this server "
                f"runs execution {self._execution_id}")
        self._security = security
        if inbound is None:
            inbound = {}
        if not (isinstance(inbound, Mapping) or callable(inbound)):
            raise InvalidArgumentError(
                f"inbound must be a mapping or a function, not {type(inbound).__name__}")
        self._inbound = inbound
        self._on_error = on_error
        self._poll = poll
        self._actions: dict[str, Callable[[dict], dict]] = {"ping": self._ping}
        self._lock = threading.Lock()
        self._streams: dict[tuple[str, int, int], str] = {}
        self._closing = threading.Event()
        self._closed: bool | None = None
        try:
            location = (flight.Location.for_grpc_tls(host, port) if security.tls is not None
                        else flight.Location.for_grpc_tcp(host, port))
            options = security.server_options()
            self._auth: ServerAuth = options["middleware"][AUTH_HEADER]
            super().__init__(location, **options)
        except (pa.ArrowException, OSError) as e:
            raise ExchangeError(f"cannot listen on {host}:{port}: {_short(e)} (gRPC logs "
                                "the cause, such as an address in use, to stderr)") from e
        self._location = f"{security.scheme}://{advertise_host or host}:{self.port}"
        # Tokens name the server they are for: one captured here is worthless elsewhere.
        self._auth.audience = self._location

    def __repr__(self) -> str:
        return f"ExchangeServer({self._location!r}, execution_id={self._execution_id})"

    @property
    def location(self) -> str:
        """Where peers reach this server: ``grpc+tcp://host:port``, or ``grpc+tls://``
        when its credentials carry a TLS identity (tokens name this location)."""
        return self._location

    @property
    def execution_id(self) -> int:
        return self._execution_id

    @property
    def refused(self) -> dict[str, int]:
        """Calls refused for their credentials so far, by reason."""
        return self._auth.refused

    @property
    def streams(self) -> dict[tuple[str, int, int], str]:
        """The inbound streams open now: ``(vertex, processor, channel) -> peer``."""
        with self._lock:
            return dict(self._streams)

    def on_action(self, name: str, handler: Callable[[dict], dict]) -> None:
        """Registers ``handler(body) -> dict`` for the action ``name`` (replacing any
        earlier one). It runs on a server thread; what it raises reaches the caller as
        :class:`ExchangeRefusedError` with the exception's type and message. ``ping`` is
        built in: it answers ``{"execution_id": ...}``."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"an action name must be a non-empty str, not {name!r}")
        if not callable(handler):
            raise InvalidArgumentError(f"the handler of action {name!r} is not callable")
        with self._lock:
            self._actions[name] = handler

    def close(self, timeout: float = 5.0) -> bool:
        """Stops the server: new connections are refused at once, streams waiting on a
        full aligner end (their senders get :class:`ExchangeRefusedError`), and nothing
        read afterwards is delivered. Waits up to ``timeout`` s for open calls to end and
        returns whether they all did. A stream whose sender is idle (neither sending nor
        closing) keeps its call open until the sender writes, closes or dies; gRPC offers
        no way to end it from this side, so ``close`` returns False and leaves it to end
        on its own. Calling it again waits again."""
        self._closing.set()
        if self._closed is None:
            self._closed = False
            self._shutdown_thread = threading.Thread(target=self._shutdown, daemon=True,
                                                     name="sparkjet-exchange-shutdown")
            self._shutdown_thread.start()
        self._shutdown_thread.join(timeout)
        return not self._shutdown_thread.is_alive()

    def _shutdown(self) -> None:
        self.shutdown()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reporting

    def _report(self, error: ExchangeError) -> None:
        if self._on_error is None:
            _log.warning("%s", error)
            return
        try:
            self._on_error(error)
        except Exception:  # noqa: BLE001 - the hook must not break the server thread
            _log.exception("on_error hook of %r failed", self)

    def _fence(self, execution_id: int, what: str, peer: str):
        if execution_id == self._execution_id:
            return
        message = (f"{what} belongs to execution {execution_id}, but this server "
                   f"runs execution {self._execution_id}")
        self._report(ExchangeFencedError(f"fenced at {self._location}: {message} "
                                         f"(from {peer})", peer))
        raise _flight_error(flight.FlightUnauthorizedError, message, _TAG_FENCED)

    # -- control plane

    def _ping(self, body: dict) -> dict:
        return {"execution_id": self._execution_id}

    def list_actions(self, context):
        with self._lock:
            return [(name, "sparkjet exchange action") for name in sorted(self._actions)]

    def do_action(self, context, action):
        name = action.type
        raw = action.body.to_pybytes() if action.body is not None else b""
        # The token was checked before this handler; it also promised this very action.
        call = context.get_middleware(AUTH_HEADER)
        if call is None or call.digest != action_digest(name, raw):
            self._auth.count("body mismatch")
            raise flight.FlightUnauthenticatedError(REFUSAL)
        try:
            envelope = json.loads(raw)
            if not isinstance(envelope, dict):
                raise TypeError("the request is not a JSON object")
            execution_id, body = envelope.get("execution_id"), envelope["body"]
            if not isinstance(body, dict):
                raise TypeError("the body is not a JSON object")
        except (ValueError, KeyError, TypeError) as e:
            raise _flight_error(flight.FlightServerError,
                                f"action {name!r}: not a sparkjet action request ({e})",
                                _TAG_REFUSED) from None
        # Every action names its execution: a null or missing id is no wildcard.
        if type(execution_id) is not int:
            raise _flight_error(flight.FlightServerError,
                                f"action {name!r}: no execution id", _TAG_REFUSED)
        self._fence(execution_id, f"action {name!r}", context.peer())
        if self._closing.is_set():
            raise _flight_error(flight.FlightServerError,
                                f"action {name!r}: the server is shutting down", _TAG_REFUSED)
        with self._lock:
            handler = self._actions.get(name)
            known = sorted(self._actions)
        if handler is None:
            raise _flight_error(flight.FlightServerError,
                                f"no action {name!r} (this server has {', '.join(known)})",
                                _TAG_REFUSED)
        try:
            result = handler(body)
            if result is None:
                result = {}
            if not isinstance(result, dict):
                raise TypeError(f"the handler returned a {type(result).__name__}, not a dict")
            answer = json.dumps(result).encode()
        except Exception as e:  # sent to the caller, who decides
            raise _flight_error(flight.FlightServerError,
                                f"action {name!r} failed: {type(e).__name__}: {e}",
                                _TAG_REFUSED) from e
        return [answer]

    # -- data plane

    def do_exchange(self, context, descriptor, reader, writer):
        peer = context.peer()
        try:
            execution_id, vertex, processor, channel = _parse_descriptor(descriptor)
        except ValueError as e:
            raise _flight_error(flight.FlightServerError,
                                f"not a sparkjet exchange stream: {e}", _TAG_REFUSED) from None
        where = f"{vertex}[{processor}] channel {channel}"
        self._fence(execution_id, f"the stream to {where}", peer)
        aligner = self._target(vertex, processor, channel, where)
        key = (vertex, processor, channel)
        with self._lock:
            if self._closing.is_set():
                raise _flight_error(flight.FlightServerError,
                                    "the server is shutting down", _TAG_REFUSED)
            if key in self._streams:
                raise _flight_error(flight.FlightServerError,
                                    f"{where} already has a stream open (from "
                                    f"{self._streams[key]})", _TAG_REFUSED)
            self._streams[key] = peer
        try:
            writer.write_metadata(_control(_ACK, 0, 0))
            self._pump(context, reader, writer, aligner, channel, where, peer)
        finally:
            with self._lock:
                self._streams.pop(key, None)

    def _target(self, vertex: str, processor: int, channel: int, where: str):
        if isinstance(self._inbound, Mapping):
            aligner = self._inbound.get((vertex, processor))
        else:
            aligner = self._inbound(vertex, processor)
        if aligner is None:
            raise _flight_error(flight.FlightServerError,
                                f"no inbound processor {vertex}[{processor}] here",
                                _TAG_REFUSED)
        channels = getattr(aligner, "channels", None)
        if isinstance(channels, int) and not 0 <= channel < channels:
            raise _flight_error(flight.FlightServerError,
                                f"{vertex}[{processor}] has channels 0..{channels - 1}, "
                                f"not {channel}", _TAG_REFUSED)
        return aligner

    def _pump(self, context, reader, writer, aligner, channel, where, peer) -> None:
        """Moves the stream's messages into the aligner, in order, until the sender
        closes the stream."""
        accepted = 0
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                # gRPC ends the reads alike when the sender closes the stream (after its
                # end, or to switch schema) and when the call is cancelled (the sender
                # died or aborted); only the second is a failure.
                if context.is_cancelled():
                    self._report_broken(where, peer, accepted, "the call was cancelled")
                return
            except (pa.ArrowException, OSError) as e:
                self._report_broken(where, peer, accepted, f"{type(e).__name__}: {_short(e)}")
                raise
            if self._closing.is_set():
                raise _flight_error(flight.FlightServerError,
                                    "the server is shutting down", _TAG_REFUSED)
            try:
                kind, flags, value = ((_DATA, 0, 0) if chunk.app_metadata is None
                                      else _parse_control(chunk.app_metadata))
                if (chunk.data is not None) != (kind == _DATA):
                    raise ValueError(f"a {_KIND_NAMES[kind]} message "
                                     f"{'with' if chunk.data is not None else 'without'} a batch")
            except ValueError as e:
                raise _flight_error(flight.FlightServerError,
                                    f"{where}: bad message {accepted} from {peer}: {e}",
                                    _TAG_REFUSED) from None
            if kind == _DATA:
                delivered = self._deliver(context, where, aligner.put, channel, chunk.data)
            elif kind == _BARRIER:
                delivered = self._deliver(context, where, aligner.put_barrier, channel, value,
                                          bool(flags & _TERMINAL))
            elif kind == _END:
                delivered = self._deliver(context, where, aligner.end, channel)
            elif kind == _WATERMARK:
                # The value travels as the unsigned 64 bits of the signed time.
                mark = Watermark(value - 2**64 if value >= 2**63 else value, bool(flags & _IDLE))
                delivered = self._deliver(context, where, aligner.put, channel, mark)
            else:
                delivered = True
            if not delivered:
                self._report_broken(where, peer, accepted, "the call was cancelled")
                return
            if kind != _CREDIT:
                accepted += 1
            if flags & _ACK_REQUEST:
                try:
                    writer.write_metadata(_control(_ACK, 0, accepted))
                except (pa.ArrowException, OSError) as e:
                    self._report_broken(where, peer, accepted, f"sending an ack failed: "
                                        f"{type(e).__name__}: {_short(e)}")
                    raise

    def _report_broken(self, where: str, peer: str, accepted: int, reason: str) -> None:
        if not self._closing.is_set():
            self._report(ExchangeError(f"inbound stream {where} from {peer} broke after "
                                       f"{accepted} messages: {reason}", peer))

    def _deliver(self, context, where: str, put, *args) -> bool:
        """``put(*args)``, waiting as long as the aligner is full: that wait is the
        backpressure, since the stream is not read meanwhile. False if the sender
        cancelled the call meanwhile."""
        while True:
            try:
                put(*args, timeout=self._poll)
                return True
            except TimeoutError:
                if self._closing.is_set():
                    raise _flight_error(flight.FlightServerError,
                                        "the server is shutting down", _TAG_REFUSED) from None
                if context.is_cancelled():
                    return False
            except SparkjetError as e:
                raise _flight_error(flight.FlightServerError,
                                    f"{where}: {type(e).__name__}: {e}", _TAG_REFUSED) from e


# ---- client ------------------------------------------------------------------------------


class ExchangeClient:
    """Talks to one peer's :class:`ExchangeServer`: opens data channels and sends actions.

    :param location: the peer's ``ExchangeServer.location``.
    :param security: the execution's credentials: every call carries a token signed with
        its secret, and with a TLS identity the client trusts only that certificate (a
        plain ``grpc+tcp`` location is then refused, so a link cannot be downgraded).
    :param connect_timeout: how long opening a channel waits for the server's handshake.
    :param action_timeout: the default deadline of :meth:`action`.

    Connecting is lazy: an unreachable peer is reported by the first channel or action
    (gRPC fails fast on a refused connection, so that takes milliseconds).
    """

    def __init__(self, location: str, *, security: LinkSecurity, connect_timeout: float = 10.0,
                 action_timeout: float = 30.0):
        self.location = str(location)
        self.connect_timeout = check_number("connect_timeout", connect_timeout, above=0)
        self.action_timeout = check_number("action_timeout", action_timeout, above=0)
        _check_security(security)
        if not self.location.startswith(security.scheme + "://"):
            raise InvalidArgumentError(
                f"exchange location {self.location!r} does not use {security.scheme}, as this "
                f"execution's links must")
        self._security = security
        try:
            self._client = flight.FlightClient(self.location, **security.client_options())
        except (pa.ArrowException, OSError) as e:
            raise InvalidArgumentError(f"bad exchange location {self.location!r}: {e}") from e
        self._lock = threading.Lock()
        self._channels: set[OutboundChannel] = set()

    def __repr__(self) -> str:
        return f"ExchangeClient({self.location!r})"

    def channel(self, vertex: str, processor: int, channel: int, execution_id: int, *,
                window_bytes: int = 8 << 20, window_messages: int = 64,
                stall_timeout: float | None = None) -> OutboundChannel:
        """Opens the stream into channel ``channel`` of processor ``processor`` of
        ``vertex`` on the peer, for execution ``execution_id``; waits for the server's
        handshake, so a fenced, unknown or busy channel or an unreachable peer raises
        here.

        :param window_bytes: bytes sent and not yet in the peer's aligner, at most
            (a larger batch alone is allowed).
        :param window_messages: messages (batches, barriers, end) sent and not yet in the
            peer's aligner, at most.
        :param stall_timeout: if set, a ``put`` (or ``close``) that waits longer than this
            for the peer to accept anything fails with :class:`ExchangeTimeoutError` and
            the channel is broken. None: wait as long as the peer is alive (a stuck
            consumer then stalls the sender; that is the backpressure).
        """
        if not isinstance(vertex, str) or not vertex:
            raise InvalidArgumentError(f"vertex must be a non-empty str, not {vertex!r}")
        processor = check_int("processor", processor, min=0)
        channel = check_int("channel", channel, min=0)
        execution_id = check_int("execution_id", execution_id, min=0)
        window_bytes = check_int("window_bytes", window_bytes, min=1)
        window_messages = check_int("window_messages", window_messages, min=1)
        stall_timeout = check_number("stall_timeout", stall_timeout, above=0, none_ok=True)
        out = OutboundChannel(self, vertex, processor, channel, execution_id,
                              window_bytes, window_messages, stall_timeout)
        with self._lock:
            self._channels.add(out)
        return out

    def action(self, name: str, body: dict | None = None, *, execution_id: int | None = None,
               timeout: float | None = None) -> dict:
        """Runs the peer's handler of action ``name`` on ``body`` and returns its answer.

        :param execution_id: the execution the action belongs to (default: the
            credentials'); the peer refuses it (:class:`ExchangeFencedError`) unless it
            runs that execution.
        :param timeout: the call's deadline (default ``action_timeout``).
        """
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InvalidArgumentError(f"an action body must be a dict, not {type(body).__name__}")
        execution_id = check_int("execution_id", execution_id, min=0, none_ok=True)
        if execution_id is None:
            execution_id = self._security.execution_id
        timeout = check_number("timeout", timeout, above=0, none_ok=True)
        try:
            request = json.dumps({"execution_id": execution_id, "body": body}).encode()
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"action {name!r}: the body is not JSON: {e}") from None
        options = self._security.call_options("DO_ACTION", self.location,
                                              timeout=timeout or self.action_timeout,
                                              action=name, body=request)
        what = f"action {name!r} to {self.location}"
        try:
            results = list(self._client.do_action(flight.Action(name, request), options))
        except (pa.ArrowException, OSError) as e:
            raise _map_error(e, self.location, what) from e
        if len(results) != 1:
            raise ExchangeRefusedError(f"{what}: {self.location} sent {len(results)} "
                                       "results, expected 1", self.location)
        try:
            answer = json.loads(results[0].body.to_pybytes())
        except ValueError as e:
            raise ExchangeRefusedError(f"{what}: {self.location} answered with bad JSON ({e})",
                                       self.location) from None
        return answer

    def ping(self, timeout: float | None = None) -> dict:
        """The built-in ``ping`` action: ``{"execution_id": ...}`` of the peer's server."""
        return self.action("ping", {}, timeout=timeout)

    def abort(self) -> None:
        """Aborts every channel still open (from any thread)."""
        with self._lock:
            channels = list(self._channels)
        for ch in channels:
            ch.abort()

    def close(self) -> None:
        """Aborts the channels still open and disconnects."""
        self.abort()
        try:
            self._client.close()
        except (pa.ArrowException, OSError):
            pass  # closing a connection that already broke has nothing left to report

    def _forget(self, channel: OutboundChannel) -> None:
        with self._lock:
            self._channels.discard(channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OutboundChannel:
    """One edge channel to a peer's aligner: batches, barriers and the end, in order.

    Made by :meth:`ExchangeClient.channel`. One thread uses it; :meth:`abort` may be
    called from any thread. Any error leaves it broken: later calls raise the same
    :class:`ExchangeError`.

    Schemas: the first batch's schema starts the Arrow stream (barriers and the end may
    come before any batch). A batch with another schema (columns, types or nullability;
    field and schema metadata are ignored) first closes the stream, which waits for the
    peer to accept everything sent before, then opens a new one on the same channel,
    so order still holds; it costs a round trip, so an edge's batches should share a
    schema. A zero-row batch is sent like any other (it reaches the aligner).
    """

    def __init__(self, client: ExchangeClient, vertex: str, processor: int, channel: int,
                 execution_id: int, window_bytes: int, window_messages: int,
                 stall_timeout: float | None):
        self._client = client
        self.peer = client.location
        self.vertex = vertex
        self.processor = processor
        self.channel = channel
        self.execution_id = execution_id
        self._window_bytes = window_bytes
        self._window_messages = window_messages
        self._stall_timeout = stall_timeout
        self._schema: pa.Schema | None = None
        self._sent = 0  # messages counted by the server (not credit requests)
        self._acked = 0
        self._unacked: deque[tuple[int, int]] = deque()  # (message number, bytes)
        self._unacked_bytes = 0
        self._requested: int | None = None  # the message number an ack was asked for
        self._ended = False
        self._closed = False
        self._broken: ExchangeError | None = None
        self._aborted = False
        self._timed_out: float | None = None
        self._state_lock = threading.Lock()
        self._writer = self._reader = None
        self.streams_opened = 0
        self._open()

    def __repr__(self) -> str:
        return (f"OutboundChannel({self.peer!r}, {self.vertex}[{self.processor}] channel "
                f"{self.channel}, execution {self.execution_id})")

    @property
    def _where(self) -> str:
        return (f"channel {self.channel} of {self.vertex}[{self.processor}] at {self.peer} "
                f"(execution {self.execution_id})")

    @property
    def in_flight(self) -> tuple[int, int]:
        """(messages, bytes) sent and not yet acknowledged as in the peer's aligner (as
        far as this side has read the acks)."""
        return len(self._unacked), self._unacked_bytes

    # -- the producer's calls

    def put(self, batch: pa.RecordBatch) -> None:
        """Sends ``batch``; waits while the window is full (backpressure)."""
        if not isinstance(batch, pa.RecordBatch):
            raise UnsupportedTypeError(
                f"OutboundChannel.put takes a pyarrow.RecordBatch, not {type(batch).__name__}")
        self._check_usable()
        if self._schema is not None and not batch.schema.equals(self._schema,
                                                                check_metadata=False):
            self._switch_stream()
        if self._schema is None:
            self._call("start the stream", lambda: self._writer.begin(batch.schema), None)
            self._schema = batch.schema
        size = batch.nbytes
        self._await_credit(size)
        ask = self._ask_ack(size)
        if ask:
            meta = _control(_DATA, _ACK_REQUEST)
            self._call("send a batch", lambda: self._writer.write_with_metadata(batch, meta), None)
        else:
            self._call("send a batch", lambda: self._writer.write_batch(batch), None)
        self._count(size, ask)

    def put_barrier(self, snapshot_id: int, terminal: bool = False) -> None:
        """Sends the barrier of snapshot ``snapshot_id``, after everything put before."""
        snapshot_id = check_int("snapshot_id", snapshot_id, min=0)
        self._check_usable()
        self._send_control(_BARRIER, _TERMINAL if terminal else 0, snapshot_id, "send a barrier")

    def put_watermark(self, mark: Watermark) -> None:
        """Sends a watermark, after everything put before."""
        if not isinstance(mark, Watermark):
            raise UnsupportedTypeError(f"put_watermark takes a Watermark, not {type(mark).__name__}")
        self._check_usable()
        self._send_control(_WATERMARK, _IDLE if mark.idle else 0, mark.time & (2**64 - 1),
                           "send a watermark")

    def end(self) -> None:
        """Sends the end of the channel: the peer's aligner takes no more from it. Call
        :meth:`close` afterwards."""
        self._check_usable()
        self._send_control(_END, 0, 0, "send the end")
        self._ended = True

    def close(self) -> None:
        """Closes the stream once the peer has put everything sent into its aligner
        (waiting for that, within ``stall_timeout`` if set). Without :meth:`end` before,
        the peer's channel stays open (another stream may continue it). Does nothing if
        already closed; raises the channel's error if it broke."""
        if self._closed:
            return
        if self._broken is not None:
            self._release()
            if self._aborted:
                return  # the caller gave up on the channel already
            raise self._broken
        try:
            self._finish_stream()
        finally:
            self._release()

    def abort(self) -> None:
        """Cancels the stream at once, from any thread: a ``put`` blocked in it raises
        :class:`ExchangeError`, and the peer sees a broken stream (its aligner channel
        gets nothing more, not even an end)."""
        with self._state_lock:
            if self._closed:
                return
            self._aborted = True
            reader = self._reader
        if reader is not None:
            reader.cancel()
        if self._broken is None:
            self._broken = ExchangeError(f"{self._where}: aborted", self.peer)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
            self._release()

    # -- internals

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise InvalidArgumentError(f"{self._where}: the channel is closed")
        if self._ended:
            raise InvalidArgumentError(f"{self._where}: the channel has ended: nothing can "
                                       "follow end()")

    def _open(self) -> None:
        descriptor = _descriptor(self.execution_id, self.vertex, self.processor, self.channel)
        try:
            options = self._client._security.call_options("DO_EXCHANGE", self._client.location)
            writer, reader = self._client._client.do_exchange(descriptor, options)
        except (pa.ArrowException, OSError) as e:
            raise self._fail(e, "open the stream") from e
        with self._state_lock:
            self._writer, self._reader = writer, reader
            aborted = self._aborted
        if aborted:
            reader.cancel()
        self.streams_opened += 1
        try:  # the handshake: an ack of 0 messages (_read_control checks the count)
            self._read_control("open the stream", self._client.connect_timeout)
        except StopIteration:
            raise self._protocol_error("the peer ended the stream before its "
                                       "handshake") from None

    def _switch_stream(self) -> None:
        self._finish_stream()
        # The new stream's server counts from 0 again (its handshake acks 0 messages).
        self._schema = None
        self._sent = self._acked = self._unacked_bytes = 0
        self._unacked.clear()
        self._requested = None
        self._open()

    def _finish_stream(self) -> None:
        """Half-closes the stream, reads the acks the server still sends, and its final
        status, which comes once it has delivered everything."""
        self._call("close the stream", self._writer.done_writing, None)
        while True:
            try:
                self._read_control("close the stream", self._stall_timeout)
            except StopIteration:
                break
        self._call("close the stream", self._writer.close, None)

    def _release(self) -> None:
        with self._state_lock:
            self._closed = True
            writer, self._writer = self._writer, None
            self._reader = None
        if writer is not None and self._broken is not None:
            try:
                writer.close()  # else its destructor logs the cancelled call to stderr
            except (pa.ArrowException, OSError):
                pass  # the error was reported when the stream broke
        self._client._forget(self)

    def _send_control(self, kind: int, flags: int, value: int, what: str) -> None:
        self._await_credit(0)
        ask = self._ask_ack(0)
        meta = _control(kind, flags | (_ACK_REQUEST if ask else 0), value)
        self._call(what, lambda: self._writer.write_metadata(meta), None)
        self._count(0, ask)

    def _ask_ack(self, size: int) -> bool:
        """Whether the message about to go should ask for an ack: when it fills half the
        window and no ack is awaited, so credit comes back before the window is full."""
        if self._requested is not None:
            return False
        return (len(self._unacked) + 1 >= (self._window_messages + 1) // 2
                or self._unacked_bytes + size >= self._window_bytes // 2)

    def _count(self, size: int, asked: bool) -> None:
        self._sent += 1
        self._unacked.append((self._sent, size))
        self._unacked_bytes += size
        if asked:
            self._requested = self._sent

    def _full(self, size: int) -> bool:
        if len(self._unacked) >= self._window_messages:
            return True
        return self._unacked_bytes > 0 and self._unacked_bytes + size > self._window_bytes

    def _await_credit(self, size: int) -> None:
        while self._full(size):
            if self._requested is None:
                self._call("ask for credit", lambda: self._writer.write_metadata(_ASK_CREDIT),
                           None)
                self._requested = self._sent
            try:
                self._read_control("wait for credit", self._stall_timeout)
            except StopIteration:
                raise self._set_broken(ExchangeError(
                    f"{self._where}: the peer ended the stream while "
                    f"{len(self._unacked)} messages were unacknowledged", self.peer)) from None

    def _read_control(self, what: str, timeout: float | None):
        """The server's next message (an ack, applied here); StopIteration when the
        server ended the call cleanly."""
        chunk = self._call(what, self._reader.read_chunk, timeout, stop_ok=True)
        if chunk.data is not None or chunk.app_metadata is None:
            raise self._protocol_error("the server sent a batch")
        try:
            kind, flags, value = _parse_control(chunk.app_metadata)
        except ValueError as e:
            raise self._protocol_error(str(e)) from None
        if kind != _ACK:
            raise self._protocol_error(f"the server sent a {_KIND_NAMES[kind]} message")
        if not self._acked <= value <= self._sent:
            raise self._protocol_error(f"ack of {value} messages; {self._acked} were acked "
                                       f"and {self._sent} sent")
        self._acked = value
        while self._unacked and self._unacked[0][0] <= value:
            self._unacked_bytes -= self._unacked.popleft()[1]
        if self._requested is not None and self._requested <= value:
            self._requested = None
        return kind, flags, value

    def _call(self, what: str, fn, timeout: float | None, stop_ok: bool = False):
        """``fn()`` with Flight errors mapped to sparkjet's, and cancelled after
        ``timeout`` s if given."""
        # `live` ends with this call: a deadline that fires after it (the watchdog pops a
        # timer before running it, so disarm can come too late) must not cancel a later call.
        live = [True]
        token = (None if timeout is None
                 else _WATCHDOG.arm(timeout, lambda: self._expire(timeout, live)))
        try:
            return fn()
        except StopIteration:
            if stop_ok:
                raise
            raise self._set_broken(ExchangeError(f"{self._where}: {what}: the peer ended the "
                                                 "stream", self.peer)) from None
        except (pa.ArrowException, OSError) as e:
            raise self._fail(e, what) from e
        finally:
            if token is not None:
                with self._state_lock:
                    live[0] = False
                _WATCHDOG.disarm(token)

    def _expire(self, timeout: float, live: list) -> None:
        # Under the lock, so the call cannot end (and a next one start) between the
        # check and the cancel.
        with self._state_lock:
            if not live[0]:
                return
            self._timed_out = timeout
            if self._reader is not None:
                self._reader.cancel()

    def _fail(self, error: BaseException, what: str) -> ExchangeError:
        if self._aborted:
            mapped = ExchangeError(f"{self._where}: {what}: aborted", self.peer)
        elif self._timed_out is not None:
            mapped = ExchangeTimeoutError(
                f"{self._where}: {what}: no answer from the peer in {self._timed_out} s",
                self.peer)
        else:
            mapped = _map_error(self._server_status(error), self.peer,
                                f"{self._where}: {what}")
        return self._set_broken(mapped)

    def _server_status(self, error: BaseException) -> BaseException:
        """A write that fails with a plain Arrow error says only that the stream is
        closed; the server's own error (a refusal, a fence) comes from closing the call."""
        if isinstance(error, flight.FlightError):
            return error
        with self._state_lock:
            writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        except (pa.ArrowException, OSError) as status:
            return status
        return error

    def _protocol_error(self, detail: str) -> ExchangeError:
        return self._set_broken(ExchangeRefusedError(
            f"{self._where}: protocol error: {detail}", self.peer))

    def _set_broken(self, error: ExchangeError) -> ExchangeError:
        """Keeps ``error`` as the channel's and ends the call (on the channel's thread)."""
        if self._broken is None:
            self._broken = error
        with self._state_lock:
            reader, writer = self._reader, self._writer
            self._writer = None
        if reader is not None:
            reader.cancel()
        if writer is not None:
            try:
                writer.close()  # else its destructor logs the dead call to stderr
            except (pa.ArrowException, OSError):
                pass  # the error is the one just kept
        return self._broken
