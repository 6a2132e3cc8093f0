"""Hosts as network namespaces: a throwaway network of ``N`` hosts on this machine, so that
the links between processes can be cut one by one (see :mod:`sparkjet.testing.nemesis`).

:class:`Network` makes a Linux bridge in the root namespace with the address
``10.213.S.1/24`` (the *gateway*: processes of the root namespace, a Spark master or the
driver, reach the hosts through it), and for each host a network namespace joined to the
bridge by a veth pair, its end ``eth0`` holding ``10.213.S.(i+2)/24``::

    with Network(hosts=3) as net:                     # needs root (CAP_NET_ADMIN)
        server = net.hosts[0].popen(["python", "-m", "http.server", "--bind",
                                     net.hosts[0].address, "8000"])
        net.hosts[1].run(["curl", f"http://{net.hosts[0].address}:8000/"])

The subnet ``10.213.S.0/24`` is one no interface of the machine uses yet (``S`` from 1 to
254, chosen under a lock file so that two networks made at once differ); the addresses
stay on the bridge, which has no route out of the machine and forwards nothing. Each
host's own ``127.0.0.1`` is its own: a process that binds only the loopback cannot be
reached from another host.

Teardown (:meth:`Network.stop`, also run by the context manager and at exit) deletes the
namespaces (their veth ends and every rule or qdisc inside go with them) and the bridge,
after killing the processes still running in a namespace and those :meth:`Host.popen`
started (one may not have entered its namespace yet). A process killed with SIGKILL
cannot tear down: the next :meth:`Network.start` on the machine removes networks whose
owner process is gone (each network writes its owner's pid under ``/run/sparkjet-netns``).
Where namespaces cannot be made, :meth:`Network.start` raises
:class:`~sparkjet.errors.NamespacesUnavailableError` saying why (tests skip with it).
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkjet._checks import check_int
from sparkjet.errors import NamespacesUnavailableError

__all__ = ["Host", "Network", "NamespacesUnavailableError", "available"]

#: Where each network records its owner's pid (``<token>.pid``), and the allocation lock.
STATE_DIR = Path("/run/sparkjet-netns")
#: The first two octets of every network's subnet (a private range, never routed here).
BASE = "10.213"
#: Interface and namespace names start with this (then a 4-hex token), so that a sweep
#: recognises what a network of another (dead) process left behind.
PREFIX = "sj"


@dataclass(frozen=True)
class Host:
    """One host: the network namespace ``name``, its address on the bridge, and ``veth``,
    the name of its veth pair's end in the root namespace (on the bridge)."""

    index: int
    name: str
    address: str
    veth: str
    #: What :meth:`popen` started: teardown kills these by pid as well, since ``ip netns
    #: pids`` misses a process whose ``ip netns exec`` has not entered the namespace yet.
    started: list[subprocess.Popen] = field(default_factory=list, compare=False, repr=False)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run in this host's namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """:func:`subprocess.run` of ``argv`` in this host's namespace (text output,
        captured, unless ``kwargs`` say otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """:class:`subprocess.Popen` of ``argv`` in this host's namespace (``ip netns
        exec`` execs it: the pid is the process's own)."""
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.started[:] = [p for p in self.started if p.poll() is None]
        self.started.append(proc)
        return proc

    def pids(self) -> list[int]:
        """The processes running in this namespace now (``ip netns pids``)."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def available() -> str | None:
    """None where a :class:`Network` can be made here, else why not (for a skip)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN); running as uid {os.geteuid()}"
    probe = f"{PREFIX}probe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Network:
    """``hosts`` network namespaces on one bridge (see the module doc). :meth:`start`
    makes them, :meth:`stop` removes everything; ``hosts`` is the list of :class:`Host`,
    ``gateway`` the root namespace's address on the bridge."""

    def __init__(self, hosts: int = 3):
        self.size = check_int("hosts", hosts, min=1, max=250)
        self.token = secrets.token_hex(2)
        self.bridge = f"{PREFIX}{self.token}br"
        self.hosts: list[Host] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""
        self._owner = os.getpid()
        self._lock = threading.RLock()
        self._atexit = False

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> Network:
        """Make the bridge and the hosts; raises :class:`NamespacesUnavailableError` (and
        removes what it made) if a step is refused."""
        with self._lock:
            if self.hosts:
                raise NamespacesUnavailableError("the network is already started")
            reason = available()
            if reason is not None:
                raise NamespacesUnavailableError(reason)
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            if not self._atexit:
                atexit.register(self.stop)
                self._atexit = True
            self._owner = os.getpid()
            with open(STATE_DIR / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                sweep()
                try:
                    self._make()
                except BaseException:
                    self.stop()
                    raise
        return self

    def stop(self) -> None:
        """Kill what still runs in the namespaces, delete them and the bridge. Safe to call
        twice, on a network that never started, and does nothing in a forked child."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            for host in self.hosts:
                for proc in host.started:
                    if proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)
                host.started.clear()
            _remove(self.token, [h.name for h in self.hosts] or
                    [f"{PREFIX}{self.token}h{i}" for i in range(self.size)])
            self.hosts = []
            if self._atexit:
                atexit.unregister(self.stop)
                self._atexit = False

    def __enter__(self) -> Network:  # noqa: PYI034 (Self needs Python 3.11)
        if not self.hosts:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- use ---------------------------------------------------------------------------

    def host(self, which: int | str | Host) -> Host:
        """A host by index, namespace name, address or itself."""
        for h in self.hosts:
            if which in (h, h.index, h.name, h.address):
                return h
        raise KeyError(f"no host {which!r} in network {self.token} "
                       f"({', '.join(h.address for h in self.hosts)})")

    def connected(self, frm: Host | None, to: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from host ``frm`` (None: the root namespace) to
        ``to:port`` is accepted within ``timeout`` seconds."""
        code = ("import socket, sys\n"
                "try:\n"
                f"    socket.create_connection(({to!r}, {port}), timeout={timeout}).close()\n"
                "except OSError:\n"
                "    sys.exit(1)\n")
        argv = [sys.executable, "-I", "-c", code]
        done = (frm.run(argv, timeout=timeout + 10) if frm is not None
                else subprocess.run(argv, capture_output=True, timeout=timeout + 10))
        return done.returncode == 0

    # ---- internals ---------------------------------------------------------------------

    def _make(self) -> None:
        third = _free_subnet()
        self.subnet = ipaddress.IPv4Network(f"{BASE}.{third}.0/24")
        self.gateway = f"{BASE}.{third}.1"
        (STATE_DIR / f"{self.token}.pid").write_text(str(self._owner))
        _must(f"make the bridge {self.bridge}", "link", "add", self.bridge, "type", "bridge")
        _must("address the bridge", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _must("bring the bridge up", "link", "set", self.bridge, "up")
        for i in range(self.size):
            name, veth = f"{PREFIX}{self.token}h{i}", f"{PREFIX}{self.token}v{i}"
            address = f"{BASE}.{third}.{i + 2}"
            _must(f"make namespace {name}", "netns", "add", name)
            self.hosts.append(Host(i, name, address, veth))
            _must(f"make the veth pair of {name}", "link", "add", veth, "type", "veth",
                  "peer", "name", "eth0", "netns", name)
            _must(f"attach {veth} to the bridge", "link", "set", veth, "master", self.bridge, "up")
            for args in (["link", "set", "lo", "up"],
                         ["addr", "add", f"{address}/24", "dev", "eth0"],
                         ["link", "set", "eth0", "up"]):
                _must(f"set up {name}", "-n", name, *args)


def sweep() -> list[str]:
    """Remove the networks whose owner process is gone (left by a test killed with
    SIGKILL); returns their tokens."""
    if not STATE_DIR.is_dir():
        return []
    swept = []
    for pidfile in STATE_DIR.glob("*.pid"):
        try:
            owner = int(pidfile.read_text())
        except (OSError, ValueError):
            owner = -1
        if owner > 0 and _alive(owner):
            continue
        token = pidfile.stem
        names = [n for n in _namespaces() if n.startswith(f"{PREFIX}{token}h")]
        _remove(token, names)
        swept.append(token)
    return swept


def _remove(token: str, namespaces: list[str]) -> None:
    for name in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split() if pids.returncode == 0 else ():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        # SIGKILL ends even a stopped process, but it may take a moment to leave.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            if left.returncode != 0 or not left.stdout.split():
                break
            time.sleep(0.05)
        _ip("netns", "del", name)
    _ip("link", "del", f"{PREFIX}{token}br")
    with contextlib.suppress(OSError):
        (STATE_DIR / f"{token}.pid").unlink()


def _free_subnet() -> int:
    used = set()
    out = _ip("-o", "-4", "addr", "show").stdout
    for word in out.split():
        if word.startswith(f"{BASE}."):
            used.add(int(word.split(".")[2]))
    for third in range(1, 255):
        if third not in used:
            return third
    raise NamespacesUnavailableError(f"every subnet {BASE}.1-254.0/24 is in use here")


def _namespaces() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _must(what: str, *args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise NamespacesUnavailableError(
            f"cannot {what}: ip {' '.join(args)}: {done.stderr.strip() or 'refused'}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
