"""The sending end of the exchange: :class:`ExchangeClient` talks to one peer's server,
opening :class:`OutboundChannel` streams (each with a window of messages the peer has not
yet put into its aligner: the backpressure) and running actions with a deadline (see
:mod:`sparkjet.runtime.exchange` for the backpressure and the threads;
:mod:`~sparkjet.runtime.exchange.protocol` for the wire).
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import pyarrow as pa
from pyarrow import flight

from sparkjet._checks import check_int, check_number
from sparkjet.errors import (
    ExchangeError,
    ExchangeRefusedError,
    ExchangeTimeoutError,
    InvalidArgumentError,
    UnsupportedTypeError,
)
from sparkjet.runtime.exchange.protocol import (
    ACK,
    ACK_REQUEST,
    ASK_CREDIT,
    BARRIER,
    DATA,
    END,
    FILE_INFO,
    FILE_SCHEMA,
    IDLE,
    KIND_NAMES,
    TERMINAL,
    WATERMARK,
    control,
    file_batch,
    file_command,
    file_pieces,
    map_error,
    parse_control,
    stream_descriptor,
)
from sparkjet.runtime.exchange.security import LinkSecurity, check_link_security
from sparkjet.runtime.watermarks import Watermark

_log = logging.getLogger("sparkjet.exchange")


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
        check_link_security(security)
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
            raise map_error(e, self.location, what) from e
        if len(results) != 1:
            raise ExchangeRefusedError(f"{what}: {self.location} sent {len(results)} "
                                       "results, expected 1", self.location)
        try:
            answer = json.loads(results[0].body.to_pybytes())
        except ValueError as e:
            raise ExchangeRefusedError(f"{what}: {self.location} answered with bad JSON ({e})",
                                       self.location) from None
        return answer

    def put_file(self, name: str, body: dict, *, timeout: float | None = None,
                 execution_id: int | None = None) -> FilePut:
        """Opens a file stream (``DoPut``) to the peer's handler of ``name``
        (``ExchangeServer.on_put``) with ``body``: write the pieces into the
        :class:`FilePut`, then :meth:`FilePut.finish` with the trailer.

        :param timeout: the deadline of the whole stream (default ``action_timeout``):
            past it the stream fails with :class:`ExchangeTimeoutError`, so a peer that
            stops reading cannot hold the writer.
        :param execution_id: as for :meth:`action`.
        """
        return FilePut(self, name, self._file_command(name, body, execution_id),
                       timeout or self.action_timeout)

    def get_file(self, name: str, body: dict, *, timeout: float | None = None,
                 execution_id: int | None = None) -> tuple[dict, Iterator[pa.Buffer]]:
        """Opens a file stream (``DoGet``) from the peer's handler of ``name``
        (``ExchangeServer.on_get``): its info (a dict) and an iterator of the pieces
        (pyarrow buffers, not copied). A refusal raises here; a stream that breaks
        raises :class:`ExchangeError` from the iterator.

        :param timeout: the deadline of the whole stream (default ``action_timeout``).
        """
        command = self._file_command(name, body, execution_id)
        what = f"get {name!r} from {self.location}"
        options = self._security.call_options("DO_GET", self.location,
                                              timeout=timeout or self.action_timeout,
                                              action=name, body=command)
        try:
            reader = self._client.do_get(flight.Ticket(command), options)
            schema = reader.schema
        except (pa.ArrowException, OSError) as e:
            raise map_error(e, self.location, what) from e
        try:
            info = json.loads((schema.metadata or {})[FILE_INFO])
            if not isinstance(info, dict) or not schema.remove_metadata().equals(FILE_SCHEMA):
                raise ValueError(f"a stream of {schema}")
        except (KeyError, ValueError) as e:
            reader.cancel()
            raise ExchangeRefusedError(f"{what}: not a file stream ({e})", self.location) from None

        def pieces():
            try:
                for chunk in reader:
                    yield from file_pieces(chunk.data)
            except (pa.ArrowException, OSError) as e:
                raise map_error(e, self.location, what) from e
            finally:
                reader.cancel()     # a reader that stops early ends the call
        return info, pieces()

    def _file_command(self, name: str, body: dict, execution_id: int | None) -> bytes:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"a stream name must be a non-empty str, not {name!r}")
        if not isinstance(body, dict):
            raise InvalidArgumentError(f"a stream body must be a dict, not {type(body).__name__}")
        execution_id = check_int("execution_id", execution_id, min=0, none_ok=True)
        if execution_id is None:
            execution_id = self._security.execution_id
        try:
            return file_command(execution_id, name, body)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"stream {name!r}: the body is not JSON: {e}") from None

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


class FilePut:
    """A file stream to a peer's ``on_put`` handler (made by :meth:`ExchangeClient.put_file`):
    :meth:`write` each piece in order, then :meth:`finish` with the trailer, which returns
    the peer's answer once it has checked and kept the file. Any error leaves it broken
    (later calls raise the same :class:`ExchangeError`); :meth:`abort` gives up, and the
    peer sees a stream without its trailer."""

    def __init__(self, client: ExchangeClient, name: str, command: bytes, timeout: float):
        self.peer = client.location
        self.name = name
        self._what = f"put {name!r} to {self.peer}"
        self._broken: ExchangeError | None = None
        self.written = 0
        options = client._security.call_options("DO_PUT", client.location, timeout=timeout,
                                                action=name, body=command)
        try:
            self._writer, self._answers = client._client.do_put(
                flight.FlightDescriptor.for_command(command), FILE_SCHEMA, options)
        except (pa.ArrowException, OSError) as e:
            raise self._fail(e) from e

    def __repr__(self) -> str:
        return f"FilePut({self._what}, {self.written} bytes written)"

    def write(self, piece) -> None:
        """Sends ``piece`` (bytes-like, at most
        :data:`~sparkjet.runtime.exchange.protocol.FILE_PIECE` bytes is the rule)."""
        if self._broken is not None:
            raise self._broken
        data = pa.py_buffer(piece)
        try:
            self._writer.write_batch(file_batch(data))
        except (pa.ArrowException, OSError) as e:
            raise self._fail(e) from e
        self.written += data.size

    def finish(self, trailer: dict) -> dict:
        """Sends the trailer (a JSON object: what the peer checks the file against), ends
        the stream and returns the peer's answer (a dict)."""
        if self._broken is not None:
            raise self._broken
        try:
            self._writer.write_metadata(pa.py_buffer(json.dumps(trailer).encode()))
            self._writer.done_writing()
            answer = self._answers.read()
            self._writer.close()
        except (pa.ArrowException, OSError) as e:
            raise self._fail(e) from e
        if answer is None:
            raise self._set_broken(ExchangeRefusedError(f"{self._what}: the peer ended the "
                                                        "stream without an answer", self.peer))
        try:
            result = json.loads(answer.to_pybytes())
        except ValueError as e:
            raise self._set_broken(ExchangeRefusedError(
                f"{self._what}: the peer answered with bad JSON ({e})", self.peer)) from None
        self._broken = ExchangeError(f"{self._what}: the stream is finished", self.peer)
        return result

    def abort(self) -> None:
        """Gives up: the stream ends without its trailer, so the peer keeps nothing."""
        if self._broken is None:
            self._broken = ExchangeError(f"{self._what}: aborted", self.peer)
        try:
            self._writer.close()
        except (pa.ArrowException, OSError):
            pass  # a stream given up on has nothing left to report

    def _fail(self, error: BaseException) -> ExchangeError:
        """The peer's own status (a refusal, a fence) comes from closing the call; a
        failed write says only that the stream is closed."""
        writer = getattr(self, "_writer", None)
        if writer is not None and not isinstance(error, flight.FlightError):
            try:
                writer.close()
            except (pa.ArrowException, OSError) as status:
                error = status
        return self._set_broken(map_error(error, self.peer, self._what))

    def _set_broken(self, error: ExchangeError) -> ExchangeError:
        if self._broken is None:
            self._broken = error
        return self._broken


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
            meta = control(DATA, ACK_REQUEST)
            self._call("send a batch", lambda: self._writer.write_with_metadata(batch, meta), None)
        else:
            self._call("send a batch", lambda: self._writer.write_batch(batch), None)
        self._count(size, ask)

    def put_barrier(self, snapshot_id: int, terminal: bool = False) -> None:
        """Sends the barrier of snapshot ``snapshot_id``, after everything put before."""
        snapshot_id = check_int("snapshot_id", snapshot_id, min=0)
        self._check_usable()
        self._send_control(BARRIER, TERMINAL if terminal else 0, snapshot_id, "send a barrier")

    def put_watermark(self, mark: Watermark) -> None:
        """Sends a watermark, after everything put before."""
        if not isinstance(mark, Watermark):
            raise UnsupportedTypeError(f"put_watermark takes a Watermark, not {type(mark).__name__}")
        self._check_usable()
        self._send_control(WATERMARK, IDLE if mark.idle else 0, mark.time & (2**64 - 1),
                           "send a watermark")

    def end(self) -> None:
        """Sends the end of the channel: the peer's aligner takes no more from it. Call
        :meth:`close` afterwards."""
        self._check_usable()
        self._send_control(END, 0, 0, "send the end")
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
        descriptor = stream_descriptor(self.execution_id, self.vertex, self.processor,
                                       self.channel)
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
        meta = control(kind, flags | (ACK_REQUEST if ask else 0), value)
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
                self._call("ask for credit", lambda: self._writer.write_metadata(ASK_CREDIT),
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
            kind, flags, value = parse_control(chunk.app_metadata)
        except ValueError as e:
            raise self._protocol_error(str(e)) from None
        if kind != ACK:
            raise self._protocol_error(f"the server sent a {KIND_NAMES[kind]} message")
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
            mapped = map_error(self._server_status(error), self.peer,
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


__all__ = ["ExchangeClient", "FilePut", "OutboundChannel"]
