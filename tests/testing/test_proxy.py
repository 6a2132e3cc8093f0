"""sparkjet.testing.proxy, the forwarding proxy for slow and lossy links without netem, and
its nemeses (Delay, Lossy, Stall, ResetLinks), against a real TCP echo server and a real
Redis server: bytes pass both ways intact and in order whatever the faults, a delay delays,
chunks of two connections overtake each other under jitter, a stall holds everything until
heal, a reset cuts every connection, and a client of a real server rides through them."""
from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest

from sparkjet.errors import NemesisError
from sparkjet.testing import nemesis
from sparkjet.testing.proxy import Proxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture(scope="module")
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _client(proxy: Proxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=20)


def _roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed early"
        got += chunk
    return got


def test_bytes_pass_both_ways_intact_under_delay_jitter_and_loss(echo):
    payload = bytes(range(256)) * 4096           # 1 MiB, many chunks
    with Proxy(echo, seed=1) as proxy, _client(proxy) as c:
        assert _roundtrip(c, b"hello") == b"hello"
        with nemesis.Delay(proxy, 0.01, 0.02), nemesis.Lossy(proxy, 0.2):
            assert _roundtrip(c, payload) == payload
        assert proxy.stats["lost"] > 0 and proxy.stats["delayed"] > 0
        assert proxy.delay == 0 and proxy.loss == 0      # healed
        assert _roundtrip(c, b"after") == b"after"


def test_a_delay_delays_each_way(echo):
    with Proxy(echo) as proxy, _client(proxy) as c:
        with nemesis.Delay(proxy, 0.3):
            start = time.monotonic()
            _roundtrip(c, b"x")
            # there and back: at least twice the delay (a lower bound holds on any machine)
            assert time.monotonic() - start >= 0.6


def test_jitter_reorders_chunks_of_different_connections(echo):
    """Two connections, each sending numbered messages: one connection's replies stay in
    order, but across the two the arrival order differs from the sending order."""
    with Proxy(echo, seed=7) as proxy, nemesis.Delay(proxy, 0.0, 0.2):
        a, b = _client(proxy), _client(proxy)
        arrived: list[tuple[str, int]] = []
        lock = threading.Lock()

        def read(sock, name):
            buf = b""
            while buf.count(b"\n") < 20:
                buf += sock.recv(4096)
            for line in buf.splitlines():
                with lock:
                    arrived.append((name, int(line)))

        readers = [threading.Thread(target=read, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
        for t in readers:
            t.start()
        sent = []
        for i in range(20):
            for sock, name in ((a, "a"), (b, "b")):
                sock.sendall(b"%d\n" % i)
                sent.append((name, i))
                time.sleep(0.01)
        for t in readers:
            t.join(30)
        a.close()
        b.close()
    assert sorted(arrived) == sorted(sent)
    for name in "ab":
        assert [i for n, i in arrived if n == name] == list(range(20))
    assert arrived != sent


def test_a_stall_holds_everything_until_heal_and_then_delivers_in_order(echo):
    with Proxy(echo) as proxy, _client(proxy) as c:
        assert _roundtrip(c, b"before") == b"before"
        stall = nemesis.Stall(proxy).start()
        c.sendall(b"held-1 ")
        c.sendall(b"held-2")
        c.settimeout(0.5)
        with pytest.raises(TimeoutError):
            c.recv(100)
        # a new connection is accepted but goes nowhere either
        late = _client(proxy)
        late.settimeout(0.5)
        late.sendall(b"late")
        with pytest.raises(TimeoutError):
            late.recv(100)
        stall.heal()
        c.settimeout(20)
        late.settimeout(20)
        got = b""
        while len(got) < len(b"held-1 held-2"):
            got += c.recv(100)
        assert got == b"held-1 held-2"
        assert late.recv(100) == b"late"
        late.close()


def test_reset_cuts_every_connection(echo):
    with Proxy(echo) as proxy:
        a, b = _client(proxy), _client(proxy)
        assert _roundtrip(a, b"1") == b"1" and _roundtrip(b, b"2") == b"2"
        cut = nemesis.ResetLinks(proxy)
        with cut:
            pass
        assert cut.reset == 2
        for s in (a, b):
            try:
                assert s.recv(10) == b""        # EOF, or ...
            except ConnectionResetError:        # ... the reset itself
                pass
            s.close()
        with _client(proxy) as c:               # new connections work
            assert _roundtrip(c, b"3") == b"3"


def test_a_refused_target_closes_the_client_and_bad_addresses_are_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]            # nothing listens there once closed
    with Proxy(f"127.0.0.1:{port}") as proxy, _client(proxy) as c:
        try:
            assert c.recv(10) == b""
        except ConnectionResetError:
            pass
        assert proxy.stats["refused"] == 1
    with pytest.raises(NemesisError, match="host:port"):
        Proxy("localhost")


def test_a_real_redis_client_rides_through_delay_stall_and_reset(tmp_path):
    redis = pytest.importorskip("redis")
    from helpers import redis_server

    try:
        server = redis_server.start(tmp_path)
    except redis_server.RedisServerMissing as e:
        pytest.skip(str(e))
    try:
        with Proxy(f"127.0.0.1:{server.port}") as proxy:
            client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=10,
                                 retry_on_error=[redis.ConnectionError])
            client.set("k", 1)
            with nemesis.Delay(proxy, 0.05, 0.05):
                assert client.incr("k") == 2
            stall = nemesis.Stall(proxy).hold(0.5)
            assert client.incr("k") == 3           # waits out the stall
            assert not stall.active
            with nemesis.ResetLinks(proxy):
                pass
            assert client.incr("k") == 4           # reconnects after the reset
    finally:
        server.stop()
