"""A member's (or the coordinator's) end of the exchange: :class:`ExchangeServer` receives the
streams of the processors' input channels into their aligners, answers actions, and
refuses the calls of any other execution (see :mod:`sparkjet.runtime.exchange` for the
backpressure, the fencing and the threads; :mod:`~sparkjet.runtime.exchange.protocol` for
the wire).
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa
from pyarrow import flight

from sparkjet._checks import check_int, check_number
from sparkjet.errors import (
    ExchangeError,
    ExchangeFencedError,
    InvalidArgumentError,
    SparkjetError,
)
from sparkjet.runtime.exchange.protocol import (
    ACK,
    ACK_REQUEST,
    BARRIER,
    CREDIT,
    DATA,
    END,
    FILE_INFO,
    FILE_SCHEMA,
    IDLE,
    KIND_NAMES,
    TAG_FENCED,
    TAG_REFUSED,
    TERMINAL,
    WATERMARK,
    control,
    file_batch,
    file_pieces,
    flight_error,
    parse_control,
    parse_descriptor,
    parse_file_command,
    short_message,
)
from sparkjet.runtime.exchange.security import HEADER as AUTH_HEADER
from sparkjet.runtime.exchange.security import (
    REFUSAL,
    LinkSecurity,
    ServerAuth,
    action_digest,
    check_link_security,
)
from sparkjet.runtime.watermarks import Watermark

_log = logging.getLogger("sparkjet.exchange")


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
    :param security: the execution's :class:`~sparkjet.runtime.exchange.security.LinkSecurity`:
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
        check_link_security(security)
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
        self._puts: dict[str, Callable] = {}
        self._gets: dict[str, Callable] = {}
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
            raise ExchangeError(f"cannot listen on {host}:{port}: {short_message(e)} (gRPC logs "
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

    def on_put(self, name: str, handler: Callable[[dict, InboundFile], dict]) -> None:
        """Registers ``handler(body, stream) -> dict`` for the file streams (``DoPut``)
        named ``name``: it iterates ``stream`` (an :class:`InboundFile`: the pieces, as
        pyarrow buffers, in order), then finds the writer's trailer in ``stream.trailer``
        (None if the stream ended without one: the writer died or gave up), and answers
        once the file is in place. What it raises reaches the writer as
        :class:`ExchangeRefusedError`. Runs on a server thread, as long as the stream lasts."""
        self._register(self._puts, name, handler)

    def on_get(self, name: str, handler: Callable[[dict], tuple[dict, Any]]) -> None:
        """Registers ``handler(body) -> (info, pieces)`` for the file streams (``DoGet``)
        named ``name``: ``info`` (a JSON object) goes first, in the schema's metadata, then
        each piece of the iterable ``pieces`` (bytes-like, at most
        :data:`~sparkjet.runtime.exchange.protocol.FILE_PIECE` bytes each is the rule) as
        a batch. What it raises reaches the reader as :class:`ExchangeRefusedError`."""
        self._register(self._gets, name, handler)

    def _register(self, table: dict, name: str, handler) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"a stream name must be a non-empty str, not {name!r}")
        if not callable(handler):
            raise InvalidArgumentError(f"the handler of stream {name!r} is not callable")
        with self._lock:
            table[name] = handler

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
        raise flight_error(flight.FlightUnauthorizedError, message, TAG_FENCED)

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
            raise flight_error(flight.FlightServerError,
                               f"action {name!r}: not a sparkjet action request ({e})",
                               TAG_REFUSED) from None
        # Every action names its execution: a null or missing id is no wildcard.
        if type(execution_id) is not int:
            raise flight_error(flight.FlightServerError,
                               f"action {name!r}: no execution id", TAG_REFUSED)
        self._fence(execution_id, f"action {name!r}", context.peer())
        if self._closing.is_set():
            raise flight_error(flight.FlightServerError,
                               f"action {name!r}: the server is shutting down", TAG_REFUSED)
        with self._lock:
            handler = self._actions.get(name)
            known = sorted(self._actions)
        if handler is None:
            raise flight_error(flight.FlightServerError,
                               f"no action {name!r} (this server has {', '.join(known)})",
                               TAG_REFUSED)
        try:
            result = handler(body)
            if result is None:
                result = {}
            if not isinstance(result, dict):
                raise TypeError(f"the handler returned a {type(result).__name__}, not a dict")
            answer = json.dumps(result).encode()
        except Exception as e:  # sent to the caller, who decides
            raise flight_error(flight.FlightServerError,
                               f"action {name!r} failed: {type(e).__name__}: {e}",
                               TAG_REFUSED) from e
        return [answer]

    # -- file streams

    def _file_call(self, context, raw: bytes, kind: str, table: dict):
        """(name, body, handler) of a file stream's command, after the checks every
        call has: its token bound to this command, its execution, the server open, a
        handler for its name."""
        try:
            execution_id, name, body = parse_file_command(raw)
        except ValueError as e:
            raise flight_error(flight.FlightServerError,
                               f"not a sparkjet file stream: {e}", TAG_REFUSED) from None
        call = context.get_middleware(AUTH_HEADER)
        if call is None or call.digest != action_digest(name, raw):
            self._auth.count("body mismatch")
            raise flight.FlightUnauthenticatedError(REFUSAL)
        self._fence(execution_id, f"the {kind} stream {name!r}", context.peer())
        if self._closing.is_set():
            raise flight_error(flight.FlightServerError,
                               f"{kind} {name!r}: the server is shutting down", TAG_REFUSED)
        with self._lock:
            handler = table.get(name)
            known = sorted(table)
        if handler is None:
            raise flight_error(flight.FlightServerError,
                               f"no {kind} stream {name!r} (this server has "
                               f"{', '.join(known) or 'none'})", TAG_REFUSED)
        return name, body, handler

    def do_put(self, context, descriptor, reader, writer):
        if descriptor.descriptor_type != flight.DescriptorType.CMD:
            raise flight_error(flight.FlightServerError,
                               "not a sparkjet file stream: the descriptor is a path",
                               TAG_REFUSED)
        name, body, handler = self._file_call(context, descriptor.command, "put", self._puts)
        if not reader.schema.equals(FILE_SCHEMA):
            raise flight_error(flight.FlightServerError,
                               f"put {name!r}: batches of {reader.schema}, expected "
                               f"{FILE_SCHEMA}", TAG_REFUSED)
        stream = InboundFile(reader, context, self._closing, name)
        try:
            result = handler(body, stream)
            answer = json.dumps({} if result is None else result).encode()
        except flight.FlightError:
            raise
        except Exception as e:  # sent to the writer, who decides
            raise flight_error(flight.FlightServerError,
                               f"put {name!r} failed: {type(e).__name__}: {e}",
                               TAG_REFUSED) from e
        writer.write(pa.py_buffer(answer))

    def do_get(self, context, ticket):
        name, body, handler = self._file_call(context, ticket.ticket, "get", self._gets)
        try:
            info, pieces = handler(body)
            schema = FILE_SCHEMA.with_metadata({FILE_INFO: json.dumps(info).encode()})
        except Exception as e:  # sent to the reader, who decides
            raise flight_error(flight.FlightServerError,
                               f"get {name!r} failed: {type(e).__name__}: {e}",
                               TAG_REFUSED) from e
        closing = self._closing

        def batches():
            for piece in pieces:
                if closing.is_set():
                    raise flight_error(flight.FlightServerError,
                                       f"get {name!r}: the server is shutting down",
                                       TAG_REFUSED)
                yield file_batch(piece, schema)
        return flight.GeneratorStream(schema, batches())

    # -- data plane

    def do_exchange(self, context, descriptor, reader, writer):
        peer = context.peer()
        try:
            execution_id, vertex, processor, channel = parse_descriptor(descriptor)
        except ValueError as e:
            raise flight_error(flight.FlightServerError,
                               f"not a sparkjet exchange stream: {e}", TAG_REFUSED) from None
        where = f"{vertex}[{processor}] channel {channel}"
        self._fence(execution_id, f"the stream to {where}", peer)
        aligner = self._target(vertex, processor, channel, where)
        key = (vertex, processor, channel)
        with self._lock:
            if self._closing.is_set():
                raise flight_error(flight.FlightServerError,
                                   "the server is shutting down", TAG_REFUSED)
            if key in self._streams:
                raise flight_error(flight.FlightServerError,
                                   f"{where} already has a stream open (from "
                                   f"{self._streams[key]})", TAG_REFUSED)
            self._streams[key] = peer
        try:
            writer.write_metadata(control(ACK, 0, 0))
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
            raise flight_error(flight.FlightServerError,
                               f"no inbound processor {vertex}[{processor}] here",
                               TAG_REFUSED)
        channels = getattr(aligner, "channels", None)
        if isinstance(channels, int) and not 0 <= channel < channels:
            raise flight_error(flight.FlightServerError,
                               f"{vertex}[{processor}] has channels 0..{channels - 1}, "
                               f"not {channel}", TAG_REFUSED)
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
                self._report_broken(where, peer, accepted,
                                    f"{type(e).__name__}: {short_message(e)}")
                raise
            if self._closing.is_set():
                raise flight_error(flight.FlightServerError,
                                   "the server is shutting down", TAG_REFUSED)
            try:
                kind, flags, value = ((DATA, 0, 0) if chunk.app_metadata is None
                                      else parse_control(chunk.app_metadata))
                if (chunk.data is not None) != (kind == DATA):
                    raise ValueError(f"a {KIND_NAMES[kind]} message "
                                     f"{'with' if chunk.data is not None else 'without'} a batch")
            except ValueError as e:
                raise flight_error(flight.FlightServerError,
                                   f"{where}: bad message {accepted} from {peer}: {e}",
                                   TAG_REFUSED) from None
            if kind == DATA:
                delivered = self._deliver(context, where, aligner.put, channel, chunk.data)
            elif kind == BARRIER:
                delivered = self._deliver(context, where, aligner.put_barrier, channel, value,
                                          bool(flags & TERMINAL))
            elif kind == END:
                delivered = self._deliver(context, where, aligner.end, channel)
            elif kind == WATERMARK:
                # The value travels as the unsigned 64 bits of the signed time.
                mark = Watermark(value - 2**64 if value >= 2**63 else value, bool(flags & IDLE))
                delivered = self._deliver(context, where, aligner.put, channel, mark)
            else:
                delivered = True
            if not delivered:
                self._report_broken(where, peer, accepted, "the call was cancelled")
                return
            if kind != CREDIT:
                accepted += 1
            if flags & ACK_REQUEST:
                try:
                    writer.write_metadata(control(ACK, 0, accepted))
                except (pa.ArrowException, OSError) as e:
                    self._report_broken(where, peer, accepted, f"sending an ack failed: "
                                        f"{type(e).__name__}: {short_message(e)}")
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
                    raise flight_error(flight.FlightServerError,
                                       "the server is shutting down", TAG_REFUSED) from None
                if context.is_cancelled():
                    return False
            except SparkjetError as e:
                raise flight_error(flight.FlightServerError,
                                   f"{where}: {type(e).__name__}: {e}", TAG_REFUSED) from e


class InboundFile:
    """The pieces of a file stream (``DoPut``) as its handler reads them: iterating
    gives each piece (a pyarrow buffer, not copied) in order until the stream ends;
    :attr:`trailer` is then the writer's trailer (a dict), or None when the stream ended
    without one (the writer died, gave up, or was cancelled). Anything after the trailer,
    or a trailer that is not a JSON object, is refused."""

    def __init__(self, reader, context, closing: threading.Event, name: str):
        self._reader, self._context, self._closing = reader, context, closing
        self.name = name
        self.trailer: dict | None = None
        self.received = 0

    def __iter__(self):
        while True:
            try:
                chunk = self._reader.read_chunk()
            except StopIteration:
                return
            if self._closing.is_set():
                raise flight_error(flight.FlightServerError,
                                   f"put {self.name!r}: the server is shutting down",
                                   TAG_REFUSED)
            if self.trailer is not None:
                raise ValueError(f"a message after the trailer, at byte {self.received}")
            if chunk.app_metadata is not None:
                if chunk.data is not None:
                    raise ValueError("a piece with metadata")
                try:
                    trailer = json.loads(chunk.app_metadata.to_pybytes())
                except ValueError as e:
                    raise ValueError(f"the trailer is not JSON ({e})") from None
                if not isinstance(trailer, dict):
                    raise ValueError("the trailer is not a JSON object")
                self.trailer = trailer
                continue
            for piece in file_pieces(chunk.data):
                self.received += piece.size
                yield piece


__all__ = ["ExchangeServer", "InboundFile"]
