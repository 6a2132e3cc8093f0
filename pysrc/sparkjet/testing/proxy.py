"""A TCP forwarding proxy that delays, stalls, slows and resets the connections through it:
slow and lossy links without the kernel's ``netem`` (this machine's kernel has none).

A :class:`Proxy` listens on a local port and forwards every connection to its ``target``
(``host:port``); point a client (a sink's DSN, an S3 endpoint, a Redis URL) at
:attr:`Proxy.address` instead of the server's, and the link between them is in the
proxy's hands::

    with Proxy("127.0.0.1:5432") as proxy:
        dsn = f"host=127.0.0.1 port={proxy.port} ..."
        proxy.delay, proxy.jitter = 0.05, 0.05        # 50-100 ms each way, per chunk
        proxy.loss = 0.1                              # a tenth of chunks retransmitted late
        proxy.stall()                                 # a partition: nothing flows ...
        proxy.unstall()                               # ... then everything held flows
        proxy.reset()                                 # every connection cut (RST)

What a fault means on a TCP stream (the bytes of one connection are never lost or
reordered: TCP does not let them be, and a proxy that did would corrupt the protocol
rather than test it):

- **delay** and **jitter**: each chunk read from one side is written to the other
  ``delay + uniform(0, jitter)`` seconds later, never before the chunk before it (one
  connection stays in order). Chunks of *different* connections overtake each other: that
  is the reordering a client of several connections can see.
- **loss**: a chunk is "lost" with probability ``loss`` and arrives after TCP's
  retransmission timeout instead (``rto``, 0.2 s, doubling for each further loss of the
  same chunk, as Linux's does): packet loss as a TCP peer sees it, a stall of the stream.
- **stall** (a partition that leaves the connections up, as a cut link does until TCP
  gives up): nothing is forwarded, new connections are accepted but not forwarded; at
  :meth:`unstall` whatever was held flows on in order.
- **rate** (bytes per second, each direction of each connection): a bandwidth cap.
- :meth:`reset`: every open connection aborted (RST to both sides).

**Transparent** (``target=None``): the proxy forwards each connection to where its client
meant it to go (``SO_ORIGINAL_DST``), for connections that nftables redirected to it. With
``netns``, the proxy's thread enters that network namespace (``/run/netns/<name>``) before
it opens any socket, so it listens and connects there; ``mark`` puts a firewall mark on
its onward connections, so that the rule that redirected the client does not redirect
them again. :class:`sparkjet.testing.nemesis.HostLinks` sets this up for every host of a
:class:`~sparkjet.testing.netns.Network`: a slow link between live Spark workers.

The proxy runs an asyncio loop in a daemon thread; the settings are plain attributes that
any thread may change. :attr:`stats` counts connections, chunks, bytes and the faults it
applied. See :mod:`sparkjet.testing.nemesis` (``Delay``, ``Lossy``, ``Stall``,
``ResetLinks``) for the faults as nemeses with an undo.
"""
from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
from collections import Counter

from sparkjet.errors import NemesisError

__all__ = ["Proxy"]

#: Bytes read at once from one side of a connection.
CHUNK = 64 << 10


class Proxy:
    """Forwards connections on ``listen`` (``host:port``; port 0: a free one) to ``target``
    (``host:port``), applying the faults set on it (see the module doc). ``seed`` makes the
    jitter and losses repeatable."""

    def __init__(self, target: str | None, listen: str = "127.0.0.1:0", *,
                 seed: int | None = None, rto: float = 0.2, netns: str | None = None,
                 mark: int | None = None):
        self.target = _split(target, "target") if target is not None else None
        self.listen = _split(listen, "listen")
        self.netns = netns
        self.mark = mark
        self.delay = 0.0
        self.jitter = 0.0
        self.loss = 0.0
        self.rate: float | None = None
        self.rto = rto
        self.stats: Counter = Counter()
        self._rng = random.Random(seed)
        self._open = threading.Event()
        self._open.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()    # both sides of each link
        self._clients: set[asyncio.StreamWriter] = set()    # the client side of each
        self._unstalled: asyncio.Event | None = None
        self.port = 0

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> Proxy:
        if self._thread is not None:
            raise NemesisError(f"the proxy to {self.target_address} is already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                if self.netns is not None:
                    _enter_netns(self.netns)     # this thread only, before any socket
                self._unstalled = asyncio.Event()
                if self._open.is_set():
                    self._unstalled.set()
                self._server = loop.run_until_complete(asyncio.start_server(
                    self._serve, self.listen[0], self.listen[1], reuse_address=True))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # noqa: BLE001 (handed to start())
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name=f"proxy->{self.target_address}")
        self._thread.start()
        ready.wait()
        if failure:
            self._thread = None
            raise NemesisError(f"proxy on {self.listen[0]}:{self.listen[1]} to "
                               f"{self.target_address}: cannot listen: {failure[0]}")
        return self

    def stop(self) -> None:
        """Closes the listener and every connection; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._thread = None

        async def close() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._loop = None

    def __enter__(self) -> Proxy:  # noqa: PYI034 (Self needs Python 3.11)
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` where clients connect."""
        return f"{self.listen[0]}:{self.port}"

    @property
    def target_address(self) -> str:
        if self.target is None:
            return f"its clients' destinations (in {self.netns or 'this namespace'})"
        return f"{self.target[0]}:{self.target[1]}"

    # ---- faults ------------------------------------------------------------------------

    @property
    def stalled(self) -> bool:
        return not self._open.is_set()

    def stall(self) -> None:
        """Nothing flows from now on (connections stay open) until :meth:`unstall`."""
        self._open.clear()
        self._call(lambda: self._unstalled.clear())
        self.stats["stalls"] += 1

    def unstall(self) -> None:
        self._open.set()
        self._call(lambda: self._unstalled.set())

    def reset(self) -> int:
        """Aborts every open connection (both sides see a reset); returns how many."""
        async def abort() -> int:
            writers = list(self._writers)
            for w in writers:
                w.transport.abort()
            return len(self._clients & set(writers))

        if self._loop is None:
            return 0
        n = asyncio.run_coroutine_threadsafe(abort(), self._loop).result(10)
        self.stats["resets"] += n
        return n

    def connections(self) -> int:
        """Open connections now (each counted once, both its sides)."""
        return len(self._clients)

    # ---- internals ---------------------------------------------------------------------

    def _call(self, fn) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        self.stats["connections"] += 1
        self._writers.add(client_w)
        self._clients.add(client_w)
        try:
            await self._unstalled.wait()       # a partition: the connect goes nowhere yet
            try:
                server_r, server_w = await self._connect(client_w)
            except OSError:
                self.stats["refused"] += 1
                client_w.transport.abort()
                return
            self._writers.add(server_w)
            for w in (client_w, server_w):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                pumps = {asyncio.ensure_future(self._pump(client_r, server_w, "up")),
                         asyncio.ensure_future(self._pump(server_r, client_w, "down"))}
                while pumps:
                    done, pumps = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                    if not all(t.result() for t in done):   # a side failed: cut both
                        for t in pumps:
                            t.cancel()
                        await asyncio.gather(*pumps, return_exceptions=True)
                        break
            finally:
                self._writers.discard(server_w)
                server_w.transport.abort()
        finally:
            self._writers.discard(client_w)
            self._clients.discard(client_w)
            client_w.transport.abort()

    async def _connect(self, client_w: asyncio.StreamWriter):
        """The connection onward: to ``target``, or (transparent) to the client's
        original destination, marked with ``mark``."""
        target = self.target
        if target is None:
            target = _original_destination(client_w.get_extra_info("socket"))
        if self.mark is None:
            return await asyncio.open_connection(*target)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, target)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str) -> bool:
        """Reads chunks from one side and hands them, each at its due time, to a writer
        task for the other side: the reading goes on while chunks wait (a delay is not a
        bandwidth limit). True when the side ended cleanly (EOF, passed on), False when a
        read or a write failed."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def write() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._unstalled.wait()
                writer.write(data)
                await writer.drain()
                if self.rate:
                    await asyncio.sleep(len(data) / self.rate)

        writing = asyncio.ensure_future(write())
        me = asyncio.current_task()
        writing.add_done_callback(
            lambda t: me.cancel() if not t.cancelled() and t.exception() is not None else None)
        last = 0.0
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    queue.put_nowait((0.0, None))
                    break
                self.stats["chunks"] += 1
                self.stats[f"bytes_{direction}"] += len(data)
                extra = self.delay + (self._rng.uniform(0, self.jitter) if self.jitter else 0.0)
                rto = self.rto
                while self.loss and self._rng.random() < self.loss and rto < 60:
                    self.stats["lost"] += 1
                    extra += rto
                    rto *= 2
                if extra:
                    self.stats["delayed"] += 1
                last = max(last, loop.time() + extra)
                queue.put_nowait((last, data))
            await writing
            return True
        except (ConnectionError, OSError):
            return False
        except asyncio.CancelledError:
            if writing.done() and not writing.cancelled() and writing.exception() is not None:
                return False      # the other side is gone: its write failed
            raise
        finally:
            if not writing.done():
                writing.cancel()
                await asyncio.gather(writing, return_exceptions=True)


#: Linux's socket options for a firewall mark and a redirected connection's destination.
SO_MARK = getattr(socket, "SO_MARK", 36)
SO_ORIGINAL_DST = 80
#: ``setns(2)``'s flag for a network namespace.
CLONE_NEWNET = 0x40000000


def _original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where the client of a connection nftables redirected here meant to connect."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)     # a struct sockaddr_in
    return socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")


def _enter_netns(name: str) -> None:
    """Moves the calling thread into the network namespace ``name`` (``ip netns``'s
    ``/run/netns/<name>``; Python 3.11 has no ``os.setns``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _split(address: str, what: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit():
        raise NemesisError(f"proxy {what} must be host:port, got {address!r}")
    return host or "127.0.0.1", int(port)


def wait_until_quiet(proxy: Proxy, timeout: float = 10.0) -> bool:
    """True once the proxy has no open connection (within ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while proxy.connections():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
