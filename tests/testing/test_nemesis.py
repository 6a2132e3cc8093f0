"""Each nemesis of sparkjet.testing.nemesis checked against real processes: a TCP connection
across a cut link fails and works again after heal, a paused server does not answer and
then does, a capped link delivers fewer bytes in a fixed window, a full or read-only disk
refuses writes, a halted server does not answer, a skewed clock jumps. Hosts are network
namespaces (sparkjet.testing.netns); without root or ``ip``/``nft``/``tc`` the tests say why
and skip (under SPARKJET_CI=1 they fail instead, as CI installs what they need)."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from sparkjet.errors import NemesisError
from sparkjet.testing import nemesis, netns
from sparkjet.testing.nemesis import wait_until


def _skip_or_fail(reason: str):
    if os.environ.get("SPARKJET_CI") == "1":
        pytest.fail(f"CI must run the nemesis tests: {reason}", pytrace=False)
    pytest.skip(reason)


def _need(kind: str):
    reason = nemesis.missing(kind)
    if reason:
        _skip_or_fail(reason)


#: A TCP server answering each line with "pong <line>", on the address and port it is given.
SERVER = textwrap.dedent("""
    import socket, sys, threading
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("up", flush=True)
    def serve(c):
        with c, c.makefile("rwb", buffering=0) as f:
            for line in f:
                f.write(b"pong " + line)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
""")

#: Sends ``count`` UDP datagrams to argv[1]:argv[2], one every 10 ms.
UDP_SEND = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "for i in range(int(sys.argv[3])):\n"
            "    s.sendto(b'x', (sys.argv[1], int(sys.argv[2]))); time.sleep(0.01)\n")

#: Counts the UDP datagrams arriving at argv[1]:argv[2] until 1 s passes without one.
UDP_COUNT = ("import socket, sys\n"
             "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
             "s.bind((sys.argv[1], int(sys.argv[2]))); s.settimeout(float(sys.argv[3]))\n"
             "print('up', flush=True); n = 0\n"
             "try:\n"
             "    while True:\n"
             "        s.recv(16); n += 1; s.settimeout(1.0)\n"
             "except OSError:\n"
             "    pass\n"
             "print(n)\n")

PORT = 7000


@pytest.fixture(scope="module")
def net():
    reason = netns.available() or nemesis.missing("partition")
    if reason:
        _skip_or_fail(reason)
    with netns.Network(hosts=3) as network:
        servers = [h.popen([sys.executable, "-I", "-c", SERVER, h.address, str(PORT)],
                           stdout=subprocess.PIPE, text=True) for h in network.hosts]
        for s in servers:
            assert s.stdout.readline().strip() == "up"
        network.servers = servers
        yield network


def _ok(net, frm, to) -> bool:
    """Whether a TCP connect from host ``frm`` (None: the root namespace) to host ``to``'s
    server is accepted (a cut link drops the SYN: the connect times out)."""
    return net.connected(frm, to.address, PORT, timeout=0.5)


def _links(net) -> dict:
    """Which links work now: (from, to) -> bool, "g" is the gateway (root namespace)."""
    nodes = [None, *net.hosts]
    name = {None: "g", **{h: str(h.index) for h in net.hosts}}
    return {(name[a], name[b]): _ok(net, a, b) for a in nodes for b in net.hosts if a != b}


def _all_up(net) -> bool:
    return all(_links(net).values())


def test_hosts_reach_each_other_and_their_loopback_is_their_own(net):
    assert len({h.address for h in net.hosts}) == 3
    assert all(h.address.startswith("10.213.") for h in net.hosts)
    assert _all_up(net)
    # The server of host 0 binds its own address: not the root namespace's loopback.
    assert not net.connected(None, "127.0.0.1", PORT, timeout=0.3)
    assert net.hosts[0].pids() == [net.servers[0].pid]


def test_isolate_cuts_one_host_from_everyone_and_heals(net):
    h0 = net.hosts[0]
    with nemesis.isolate(net, h0) as cut:
        links = _links(net)
        assert cut.active
        assert {k for k, up in links.items() if not up} == {
            ("g", "0"), ("1", "0"), ("2", "0"), ("0", "1"), ("0", "2")}
    assert _all_up(net)


def test_split_keeps_each_side_whole(net):
    with nemesis.split(net, [net.hosts[0]]):
        links = _links(net)
        assert links[("1", "2")] and links[("2", "1")] and links[("g", "1")]
        assert not links[("1", "0")] and not links[("g", "0")] and not links[("0", "2")]
    with nemesis.split(net, [net.hosts[0]], gateway_with="minority"):
        links = _links(net)
        assert links[("g", "0")] and not links[("g", "1")] and not links[("g", "2")]
    assert _all_up(net)


def test_bridge_lets_the_middle_see_both_sides(net):
    h0, h1, h2 = net.hosts
    with nemesis.bridge(net, h0, [h1], [h2]):
        links = _links(net)
        assert links[("0", "1")] and links[("0", "2")] and links[("1", "0")] and links[("2", "0")]
        assert not links[("1", "2")] and not links[("2", "1")]
    assert _all_up(net)


def test_overlapping_partitions_add_up(net):
    h0, h1, _ = net.hosts
    a = nemesis.cut(net, h0, h1).start()
    b = nemesis.isolate(net, h0).start()
    try:
        a.heal()
        assert not _ok(net, h1, h0), "still cut by the isolation"
    finally:
        b.heal()
        a.heal()
    assert _ok(net, h1, h0)


def _datagrams(net, frm, to, port: int, count: int = 20) -> int:
    receiver = to.popen([sys.executable, "-I", "-c", UDP_COUNT, to.address, str(port), "3"],
                        stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "up"
    frm.run([sys.executable, "-I", "-c", UDP_SEND, to.address, str(port), str(count)],
            check=True)
    return int(receiver.communicate(timeout=30)[0].strip())


def test_one_way_loss_drops_one_direction_only(net):
    h0, h1, _ = net.hosts
    with nemesis.one_way(net, h1, h0):
        assert _datagrams(net, h1, h0, 7101) == 0
        assert _datagrams(net, h0, h1, 7102) == 20
        assert not _ok(net, h1, h0), "a handshake needs both directions"
    assert _datagrams(net, h1, h0, 7103) == 20


def test_packet_loss_drops_a_share_of_a_hosts_packets_and_heals(net):
    h0, h1, _ = net.hosts
    with nemesis.PacketLoss(net, h0, 50, direction="in"):
        got = _datagrams(net, h1, h0, 7111, count=100)
        # 50% of 100 at random: far from 0 and from 100 (outside 15..85: p < 1e-12)
        assert 15 <= got <= 85, got
        assert _datagrams(net, h0, h1, 7112) == 20      # what h0 sends is untouched
    assert _datagrams(net, h1, h0, 7113) == 20
    with nemesis.PacketLoss(net, h0, 100):
        assert not _ok(net, h1, h0)
    assert _ok(net, h1, h0)


def test_one_way_to_the_gateway_is_dropped_on_the_host(net):
    h0 = net.hosts[0]
    with nemesis.one_way(net, h0, net.gateway):
        assert not _ok(net, None, h0)    # the SYN-ACK to the gateway is lost
        assert _ok(net, net.hosts[1], h0)
    assert _ok(net, None, h0)


def test_a_partition_outside_the_network_is_refused(net):
    with pytest.raises(KeyError, match="no host"):
        nemesis.cut(net, net.hosts[0], "192.0.2.1")


def test_flapping_switches_the_partition_and_heals_off(net):
    h0, h1, _ = net.hosts
    flap = nemesis.Flapping(nemesis.cut(net, h0, h1), period=0.3).start()
    seen = set()
    try:
        assert wait_until(lambda: seen.add(flap.partition.active) or len(seen) == 2, 10)
        assert wait_until(lambda: flap.partition.injected >= 2, 10)
    finally:
        flap.heal()
    assert not flap.partition.active and _ok(net, h1, h0)


def _received_in(net, frm, to, port: int, window: float) -> int:
    """Bytes a receiver in host ``to`` gets in the first ``window`` seconds after it
    accepts a connection from a sender in ``frm`` that sends as fast as it can."""
    receiver = to.popen([sys.executable, "-I", "-c", textwrap.dedent(f"""
        import socket, time
        s = socket.create_server(({to.address!r}, {port})); print("up", flush=True)
        c, _ = s.accept(); n = 0; end = time.monotonic() + {window}
        while (left := end - time.monotonic()) > 0:
            c.settimeout(left)
            try:
                n += len(c.recv(1 << 16))
            except TimeoutError:
                break
        print(n, flush=True)""")], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "up"
    sender = frm.popen([sys.executable, "-I", "-c", textwrap.dedent(f"""
        import socket
        c = socket.create_connection(({to.address!r}, {port})); chunk = bytes(1 << 16)
        try:
            while True:
                c.sendall(chunk)
        except OSError:
            pass""")])
    try:
        return int(receiver.communicate(timeout=60)[0].strip())
    finally:
        sender.kill()
        sender.wait()


def test_bandwidth_cap_installs_tbf_and_limits_bytes_in_a_window(net):
    _need("bandwidth")
    h0, h1, _ = net.hosts
    cap = nemesis.BandwidthCap(net, h0, "800kbit", direction="in")
    with cap:
        assert len(cap.installed()) == 1 and "rate 800Kbit" in cap.installed()[0]
        capped = _received_in(net, h1, h0, 7201, 2.0)
    assert cap.installed() == []
    free = _received_in(net, h1, h0, 7202, 2.0)
    # 800 kbit/s is 100 kB/s: 2 s deliver about 200 kB plus the bucket; an uncapped veth
    # carries many MB in that time.
    assert 0 < capped < 600_000, capped
    assert free > 4 * capped, (free, capped)


#: Connects to argv[1]:argv[2], sends argv[3] lines one at a time, checks each answer and
#: prints the slowest round trip in seconds.
PING = ("import socket, sys, time\n"
        "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
        "f = c.makefile('rwb', buffering=0); worst = 0.0\n"
        "for i in range(int(sys.argv[3])):\n"
        "    t = time.monotonic(); f.write(b'%d\\n' % i)\n"
        "    assert f.readline() == b'pong %d\\n' % i\n"
        "    worst = max(worst, time.monotonic() - t)\n"
        "print(worst)\n")


def _ping(net, frm, to, count=3) -> float:
    argv = [sys.executable, "-I", "-c", PING, to.address, str(PORT), str(count)]
    done = (frm.run(argv, timeout=60) if frm is not None
            else subprocess.run(argv, capture_output=True, text=True, timeout=60))
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_host_links_pass_every_connection_through_the_hosts_proxies(net):
    """A worker's links delayed while it runs (no netem here): every TCP connection a host
    opens or takes passes its transparent proxy, reaching what the client meant; a delay
    on one host's proxy slows that host's links only; partitions still cut; after stop the
    links are direct again."""
    _need("partition")
    a, b, c = net.hosts
    with nemesis.HostLinks(net, seed=3) as links:
        assert _ping(net, a, b) >= 0 and _ping(net, None, b) >= 0      # answers intact
        # a -> b passed a's proxy (its output) and b's (its input); g -> b only b's
        assert links.of(a).stats["connections"] == 1
        assert links.of(b).stats["connections"] == 2
        assert links.of(c).stats["connections"] == 0
        with nemesis.Delay(links.of(b), 0.2):
            assert _ping(net, a, b) >= 0.4           # 0.2 s each way through b's proxy
            assert _ping(net, a, c) < 0.2            # c's links are not b's
        assert _ping(net, a, b) < 0.2
        with nemesis.isolate(net, b):
            assert not _ok(net, a, b) and not _ok(net, None, b)
        assert _ok(net, a, b)
        before = links.of(b).stats["connections"]
    assert _ping(net, a, b) >= 0 and before > 0
    assert links.proxies == {}
    listed = b.run(["nft", "list", "tables"])
    assert f"{nemesis.TABLE}_links" not in listed.stdout


def test_pause_stops_a_server_answering_until_heal(net):
    h0 = net.hosts[0]
    server = net.servers[0]
    pause = nemesis.Pause(server.pid)
    ask = ("import socket, sys\n"
           f"c = socket.create_connection(('{h0.address}', {PORT}), timeout=1.0)\n"
           "c.sendall(b'ping\\n')\n"
           "sys.exit(0 if c.recv(64).startswith(b'pong') else 1)\n")
    with pause:
        assert _state(server.pid) == "T"
        # The kernel still completes the handshake (the socket listens); no answer comes.
        assert subprocess.run([sys.executable, "-c", ask], capture_output=True).returncode != 0
    assert subprocess.run([sys.executable, "-c", ask], capture_output=True).returncode == 0
    pause.hold(0.3)
    assert _state(server.pid) == "T"
    assert wait_until(lambda: _state(server.pid) != "T", 10)
    assert not pause.active


def test_pause_of_processes_all_gone_is_an_error():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(NemesisError, match="no such process"):
        nemesis.Pause(p.pid).start()


def test_a_pause_of_this_process_stops_every_thread_and_resumes_it():
    """The partition rounds' ``pause-driver``: this process (all of it) is stopped by a
    helper and resumed. A watcher process sees it in state T; a thread of its own goes on
    after it."""
    watcher = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         f"end = time.monotonic() + 5\nseen = ''\n"
         "while time.monotonic() < end and 'T' not in seen:\n"
         f"    seen += open('/proc/{os.getpid()}/stat').read().rsplit(')', 1)[1].split()[0]\n"
         "    time.sleep(0.01)\n"
         "print(seen[-1])\n"], stdout=subprocess.PIPE, text=True)
    ticks: list[float] = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.2)
    pause = nemesis.SelfPause(0.8)
    stopped_at = time.monotonic()
    pause.start()
    pause.heal()
    time.sleep(0.1)
    done.set()
    ticker.join()
    assert watcher.communicate(timeout=10)[0].strip() == "T"
    assert ticks[-1] > stopped_at         # the thread ran on after the pause
    assert not pause.active
    with pytest.raises(ValueError, match="seconds must be"):
        nemesis.SelfPause(0)


def test_teardown_removes_namespaces_and_bridge_even_after_a_failure():
    reason = netns.available()
    if reason:
        _skip_or_fail(reason)
    network = netns.Network(hosts=2)
    with pytest.raises(RuntimeError, match="the test failed"), network:
        names = [h.name for h in network.hosts]
        sleeper = network.hosts[0].popen(["sleep", "60"])
        raise RuntimeError("the test failed")
    assert sleeper.wait(10) == -signal.SIGKILL
    assert not set(names) & set(netns._namespaces())
    assert network.bridge not in subprocess.run(["ip", "-o", "link"], capture_output=True,
                                                text=True).stdout


def test_teardown_kills_a_process_not_yet_in_its_namespace(monkeypatch):
    # ``ip netns pids`` lists only processes inside the namespace: one whose ``ip netns
    # exec`` has not entered it yet (a busy machine) must still be killed by teardown.
    reason = netns.available()
    if reason:
        _skip_or_fail(reason)
    enter = netns.Host.command
    monkeypatch.setattr(netns.Host, "command", lambda self, argv: [
        "sh", "-c", 'sleep 1; exec "$@"', "sh", *enter(self, argv)])
    with netns.Network(hosts=1) as network:
        late = network.hosts[0].popen(["sleep", "60"])
    assert late.wait(10) == -signal.SIGKILL


def test_a_network_left_by_a_killed_process_is_swept():
    reason = netns.available()
    if reason:
        _skip_or_fail(reason)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from sparkjet.testing.netns import Network
        net = Network(hosts=1).start()
        print(net.token, net.hosts[0].name, flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    token, name = child.stdout.readline().split()
    assert name in netns._namespaces()
    child.kill()
    child.wait()
    assert token in netns.sweep()
    assert name not in netns._namespaces()


# ---- disks -------------------------------------------------------------------------------

def test_disk_full_refuses_writes_until_heal(tmp_path):
    _need("disk")
    with nemesis.tmpfs(tmp_path / "small", "256k") as disk:
        full = nemesis.DiskFull(disk)
        with full:
            assert full.filled > 100_000
            with pytest.raises(OSError) as e, open(disk / "data", "wb") as f:
                f.write(b"x" * 65536)
                f.flush()
            assert e.value.errno == errno.ENOSPC
        (disk / "data").write_bytes(b"x" * 65536)
        assert not full.filler.exists()


def test_disk_full_refuses_a_large_file_system(tmp_path):
    if os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize <= 256 << 20:
        pytest.skip("the temporary folder's file system is small")
    with pytest.raises(NemesisError, match="fill only a small one"):
        nemesis.DiskFull(tmp_path).start()


def test_read_only_refuses_creates_until_heal(tmp_path):
    _need("disk")
    d = tmp_path / "store"
    d.mkdir()
    (d / "old").write_text("kept")
    with nemesis.ReadOnly(d):
        with pytest.raises(OSError) as e:
            (d / "new").write_text("x")
        assert e.value.errno == errno.EROFS
        assert (d / "old").read_text() == "kept"
    (d / "new").write_text("x")
    assert os.path.ismount(d) is False


def test_removed_directory_vanishes_and_comes_back(tmp_path):
    d = tmp_path / "snapshots"
    d.mkdir()
    (d / "a").write_text("1")
    gone = nemesis.Removed(d)
    with gone:
        assert not d.exists()
        d.mkdir()
        (d / "b").write_text("2")     # the program made it again
    assert (d / "a").read_text() == "1" and not (d / "b").exists()
    assert gone.recreated is not None and (gone.recreated / "b").read_text() == "2"


# ---- servers and clocks ------------------------------------------------------------------

def test_server_outage_halts_and_restarts_a_real_redis(tmp_path):
    from helpers import redis_server

    try:
        server = redis_server.start(tmp_path)
    except redis_server.RedisServerMissing as e:
        _skip_or_fail(str(e))
    try:
        with nemesis.ServerOutage(server):
            assert not server.answers()
        assert server.answers()
    finally:
        server.stop()


def test_clock_skew_moves_a_running_process_wall_clock(tmp_path):
    _need("clock")
    skew = nemesis.ClockSkew(tmp_path / "clock", 3600)
    child = subprocess.Popen(
        [sys.executable, "-I", "-c",
         "import sys, time\nfor _ in sys.stdin:\n    print(time.time(), time.monotonic(), "
         "flush=True)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **skew.env()})

    def ask():
        child.stdin.write("?\n")
        child.stdin.flush()
        wall, mono = map(float, child.stdout.readline().split())
        return wall - time.time(), mono

    try:
        before, mono0 = ask()
        with skew:
            during, mono1 = ask()
            skew.jump(-7200)
            back, _ = ask()
        after, mono2 = ask()
    finally:
        child.kill()
        child.wait()
    assert abs(before) < 60 and abs(after) < 60
    assert 3500 < during < 3700 and -7300 < back < -7100
    assert mono0 <= mono1 <= mono2 and mono2 - mono0 < 60   # monotonic left true


def test_shared_memory_of_killed_skewed_processes_is_released(tmp_path):
    """Found after a long campaign: libfaketime leaves two files in /dev/shm for every
    skewed process killed (about sixty after the clock rounds). They are removed once
    their process is gone, and those of a process still running are kept."""
    _need("clock")
    skew = nemesis.ClockSkew(tmp_path / "clock", 60)
    env = {**os.environ, **skew.env()}
    children = [subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(600)"],
                                 env=env) for _ in range(2)]
    killed, running = children
    mine = {c.pid: [f"faketime_shm_{c.pid}", f"sem.faketime_sem_{c.pid}"] for c in children}
    try:
        assert wait_until(lambda: all(os.path.exists(f"/dev/shm/{n}")
                                      for names in mine.values() for n in names), 30), \
            "libfaketime never opened its shared memory in the children"
        killed.kill()
        killed.wait()
        removed = nemesis.release_clock_segments()
        assert set(mine[killed.pid]) <= set(removed)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in mine[killed.pid])
        assert all(os.path.exists(f"/dev/shm/{n}") for n in mine[running.pid])
    finally:
        running.kill()
        running.wait()
    nemesis.release_clock_segments()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in mine[running.pid])


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_skewed_python_process_still_sleeps_and_waits(tmp_path):
    """Found by the nemesis campaign: libfaketime 0.9.10 (with the monotonic clock left
    true) fails ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` with EINVAL, which is
    how Python sleeps, so every skewed member died at its first ``time.sleep`` ("OSError:
    [Errno 22] Invalid argument"); and its ``pthread_cond_timedwait`` returned at once on a
    monotonic condition variable, so the native aligner's waits spun (a skewed member slowed
    until its snapshots timed out). The nemesis preloads a shim for both."""
    _need("clock")
    skew = nemesis.ClockSkew(tmp_path / "clock", -600)
    code = ("import queue, threading, time\n"
            "from sparkjet._native import BarrierAligner\n"
            "t = time.monotonic(); time.sleep(0.05); threading.Event().wait(0.05)\n"
            "try:\n    queue.Queue().get(timeout=0.05)\nexcept queue.Empty:\n    pass\n"
            "a = BarrierAligner(1)\n"
            "w = time.monotonic(); assert a.take(timeout=0.3) is None\n"
            "print(time.time(), time.monotonic() - t, time.monotonic() - w)\n")
    with skew:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                              text=True, env={**os.environ, **skew.env()}, timeout=60)
    assert done.returncode == 0, done.stderr
    wall, slept, waited = map(float, done.stdout.split())
    assert -700 < wall - time.time() < -500
    assert slept >= 0.45 and waited >= 0.3
