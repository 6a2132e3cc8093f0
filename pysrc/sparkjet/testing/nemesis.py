"""Nemeses: faults injected into real processes, networks and disks, each with a clean undo,
for Jepsen-style tests of sparkjet jobs (the faults of seed 001's Hazelcast analysis:
partitions and pauses, not only kills).

Every nemesis is a :class:`Nemesis`: :meth:`~Nemesis.start` injects the fault,
:meth:`~Nemesis.heal` undoes it (safe to call twice, and on one never started), and it is a
context manager (healed on exit, an exception included). :meth:`~Nemesis.hold` injects it
now and heals it after a given time, in the background::

    from sparkjet.testing.netns import Network
    from sparkjet.testing import nemesis

    with Network(hosts=3) as net:
        with nemesis.isolate(net, net.hosts[0]):       # host 0 hears nobody, nobody hears it
            ...
        nemesis.Pause([pid]).hold(5.0)                 # SIGSTOP now, SIGCONT in 5 s

The kinds:

- **partitions** on a :class:`~sparkjet.testing.netns.Network` (nftables rules in the
  hosts' namespaces, so nothing of the machine's own firewall is touched):
  :func:`isolate` (one host from everyone, the gateway included), :func:`split` (a
  minority from a majority), :func:`bridge` (A sees B and C, B and C do not see each
  other), :func:`cut` (one link), :func:`one_way` (packets from one side to the other are
  dropped, the other direction flows), :class:`Flapping` (a partition switched on and off);
- :class:`BandwidthCap`: a token bucket (``tc tbf``) on a host's link;
  :class:`PacketLoss`: a share of a host's packets dropped at random (nftables
  ``numgen``);
- links through a :class:`~sparkjet.testing.proxy.Proxy` (a forwarding proxy in the path,
  for delay without ``netem``): :class:`Delay` (with jitter: connections reorder),
  :class:`Lossy` (chunks retransmitted late, as TCP meets loss), :class:`Stall` (a
  partition with the connections left open), :class:`ResetLinks` (every connection reset);
- :class:`Pause`: SIGSTOP of processes, SIGCONT at heal;
- disks: :class:`DiskFull` (a filler file takes the free space of a small file system, see
  :func:`tmpfs`), :class:`ReadOnly` (a read-only bind mount over a directory),
  :class:`Removed` (a directory moved away mid-run, put back at heal);
- :class:`ServerOutage`: a server with ``halt()`` and ``restart()`` (the tests' Kafka
  broker, PostgreSQL, S3 and Redis servers) stopped hard, restarted at heal;
- :class:`ClockSkew`: the wall clock of processes started with :meth:`ClockSkew.env` moved
  by an offset (libfaketime, reread from a file, so a running process jumps);
  :func:`release_clock_segments` frees the shared memory of skewed processes killed.

They need root (namespaces, mounts, ``nft``, ``tc``) and the tools: ``ip`` and ``tc``
(iproute2), ``nft`` (nftables) and libfaketime. :func:`missing` says which tool is missing
for a kind (tests skip with it); a nemesis that cannot act raises
:class:`~sparkjet.errors.NemesisError` naming the command and its error. This machine's
kernel has no ``netem``: packet loss is an nftables rule, delay and reordering a proxy
in the path (:mod:`sparkjet.testing.proxy`).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from sparkjet.errors import NemesisError

if TYPE_CHECKING:
    from sparkjet.testing.netns import Host, Network

__all__ = [
    "BandwidthCap", "ClockSkew", "Delay", "DiskFull", "Flapping", "HostLinks", "Lossy",
    "Nemesis", "NemesisError", "PacketLoss", "Partition", "Pause", "ReadOnly", "Removed", "ResetLinks",
    "ServerOutage", "Stall", "bridge", "cut", "isolate", "missing", "one_way",
    "release_clock_segments", "split", "stop_processes", "tmpfs",
]

#: Where Debian and Fedora put libfaketime (the multithreaded flavour first).
LIBFAKETIME = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
               "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
               "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
               "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
               "/usr/lib64/faketime/libfaketimeMT.so.1", "/usr/lib/faketime/libfaketimeMT.so.1")

#: The nftables table each host's namespace gets for partitions.
TABLE = "sparkjet_nemesis"


def missing(kind: str) -> str | None:
    """Why nemeses of ``kind`` ("partition", "bandwidth", "pause", "disk", "clock",
    "server") cannot run here, or None."""
    if kind in ("pause", "server"):
        return None
    if os.geteuid() != 0 and kind in ("partition", "bandwidth", "disk"):
        return f"{kind} nemeses need root (running as uid {os.geteuid()})"
    need = {"partition": ["ip", "nft"], "bandwidth": ["ip", "tc"], "disk": ["mount", "umount"],
            "clock": []}
    if kind not in need:
        raise ValueError(f"unknown nemesis kind {kind!r}; one of partition, bandwidth, pause, "
                         "disk, clock, server")
    for tool in need[kind]:
        if shutil.which(tool) is None:
            package = {"nft": "nftables", "ip": "iproute2", "tc": "iproute2"}.get(tool, tool)
            return f"{tool} is not installed (Debian: apt-get install {package})"
    if kind == "clock" and _libfaketime() is None:
        return "libfaketime is not installed (Debian: apt-get install libfaketime)"
    return None


class Nemesis:
    """A fault with its undo: :meth:`start` injects it, :meth:`heal` undoes it."""

    name = "nemesis"

    def __init__(self):
        self.active = False
        self.injected = 0          # how often start() injected the fault
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()

    def start(self) -> Nemesis:
        with self._lock:
            if not self.active:
                self._inject()
                self.active = True
                self.injected += 1
        return self

    def heal(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()
            if self.active:
                self.active = False
                self._undo()

    def hold(self, seconds: float) -> Nemesis:
        """Inject now, heal after ``seconds`` (in a timer thread); :meth:`heal` earlier
        ends it at once."""
        self.start()
        timer = threading.Timer(seconds, self.heal)
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.heal()

    def _inject(self) -> None:
        raise NotImplementedError

    def _undo(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {'active' if self.active else 'healed'}>"


# ---- partitions --------------------------------------------------------------------------

class _Drops:
    """The packets dropped on one network now: (from address, to address) -> how many
    active partitions drop them, written into the hosts' nftables tables."""

    registry: dict[str, _Drops] = {}
    registry_lock = threading.Lock()

    def __init__(self, network: Network):
        self.network = network
        self.count: Counter = Counter()
        self.lock = threading.Lock()

    @classmethod
    def of(cls, network: Network) -> _Drops:
        with cls.registry_lock:
            drops = cls.registry.get(network.token)
            if drops is None or drops.network is not network:
                drops = cls.registry[network.token] = cls(network)
            return drops

    def change(self, pairs: Iterable[tuple[str, str]], delta: int, what: str) -> None:
        with self.lock:
            pairs = list(pairs)
            for pair in pairs:
                self.count[pair] += delta
            self.count = +self.count       # drop pairs at zero
            try:
                self._write(what)
            except NemesisError:
                for pair in pairs:         # leave the bookkeeping as the rules stand
                    self.count[pair] -= delta
                self.count = +self.count
                raise

    def _write(self, what: str) -> None:
        hosts = {h.address: h for h in self.network.hosts}
        rules: dict[str, tuple[list[str], list[str]]] = {h.name: ([], []) for h in hosts.values()}
        for frm, to in self.count:
            if to in hosts:
                rules[hosts[to].name][0].append(frm)       # dropped as it arrives at `to`
            elif frm in hosts:
                rules[hosts[frm].name][1].append(to)       # dropped as it leaves `frm`
            else:
                raise NemesisError(f"{what}: neither {frm} nor {to} is a host of network "
                                   f"{self.network.token}: the link cannot be cut")
        for name, (sources, destinations) in rules.items():
            script = [f"table inet {TABLE}", f"delete table inet {TABLE}"]
            if sources or destinations:
                script.append(f"table inet {TABLE} {{")
                script.append("  chain input { type filter hook input priority -10; policy accept;")
                if sources:
                    script.append(f"    ip saddr {{ {', '.join(sorted(sources))} }} drop")
                script.append("  }")
                script.append("  chain output { type filter hook output priority -10; "
                              "policy accept;")
                if destinations:
                    script.append(f"    ip daddr {{ {', '.join(sorted(destinations))} }} drop")
                script.append("  }")
                script.append("}")
            _run(what, ["ip", "netns", "exec", name, "nft", "-f", "-"],
                 input="\n".join(script) + "\n")


class Partition(Nemesis):
    """Packets from ``frm`` to ``to`` dropped, for each ``(frm, to)`` of ``drops``
    (addresses or :class:`~sparkjet.testing.netns.Host`; the gateway's address names the
    root namespace). Overlapping partitions add up: a pair flows again once every
    partition dropping it has healed."""

    def __init__(self, network: Network, drops: Iterable[tuple], name: str = "partition"):
        super().__init__()
        self.network = network
        self.name = name
        self.drops = sorted({(_address(network, a), _address(network, b)) for a, b in drops
                             if _address(network, a) != _address(network, b)})

    def _inject(self) -> None:
        reason = missing("partition")
        if reason:
            raise NemesisError(f"{self.name}: {reason}")
        _Drops.of(self.network).change(self.drops, +1, self.name)

    def _undo(self) -> None:
        _Drops.of(self.network).change(self.drops, -1, f"heal {self.name}")


def cut(network: Network, a, b) -> Partition:
    """The link between ``a`` and ``b`` cut both ways."""
    return Partition(network, [(a, b), (b, a)], f"cut {_address(network, a)}-{_address(network, b)}")


def one_way(network: Network, frm, to) -> Partition:
    """Packets from ``frm`` to ``to`` dropped (on one side only: ``to``'s input, or
    ``frm``'s output when ``to`` is the gateway); the other direction flows. A TCP
    connection either way fails (its handshake needs both); datagrams show the
    difference."""
    return Partition(network, [(frm, to)],
                     f"one-way {_address(network, frm)}->{_address(network, to)}")


def isolate(network: Network, host) -> Partition:
    """``host`` cut from every other host and from the gateway (the root namespace)."""
    me = _address(network, host)
    others = [h.address for h in network.hosts if h.address != me] + [network.gateway]
    return Partition(network, [p for o in others for p in ((me, o), (o, me))], f"isolate {me}")


def split(network: Network, minority: Iterable, *, gateway_with: str = "majority") -> Partition:
    """The hosts of ``minority`` cut from the others (each side still sees itself); the
    gateway (the driver, a master in the root namespace) stays with ``gateway_with``
    ("majority" or "minority")."""
    if gateway_with not in ("majority", "minority"):
        raise ValueError(f"gateway_with must be 'majority' or 'minority', got {gateway_with!r}")
    small = {_address(network, h) for h in minority}
    big = {h.address for h in network.hosts} - small
    (small if gateway_with == "minority" else big).add(network.gateway)
    return Partition(network, [p for a in small for b in big for p in ((a, b), (b, a))],
                     f"split {sorted(small)} | {sorted(big)}")


def bridge(network: Network, middle, left: Iterable, right: Iterable) -> Partition:
    """``middle`` sees both sides; the hosts of ``left`` and ``right`` do not see each
    other (Jepsen's bridge partition)."""
    mid = _address(network, middle)
    lefts = {_address(network, h) for h in left} - {mid}
    rights = {_address(network, h) for h in right} - {mid}
    return Partition(network, [p for a in lefts for b in rights for p in ((a, b), (b, a))],
                     f"bridge {sorted(lefts)} <{mid}> {sorted(rights)}")


class Flapping(Nemesis):
    """``partition`` switched on and off every ``period`` seconds (on first) until healed,
    which leaves it off."""

    def __init__(self, partition: Partition, period: float = 1.0):
        super().__init__()
        self.partition = partition
        self.period = period
        self.name = f"flapping {partition.name}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _inject(self) -> None:
        self._stop.clear()
        self.partition.start()
        self._thread = threading.Thread(target=self._flap, daemon=True, name=self.name)
        self._thread.start()

    def _flap(self) -> None:
        while not self._stop.wait(self.period):
            if self.partition.active:
                self.partition.heal()
            else:
                self.partition.start()

    def _undo(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.partition.heal()


# ---- slow links --------------------------------------------------------------------------

class BandwidthCap(Nemesis):
    """A token bucket filter (``tc qdisc ... tbf``) of ``rate`` (a tc rate: "1mbit",
    "200kbit") on ``host``'s link: ``direction`` "in" (on its veth end in the root
    namespace: what the host receives), "out" (on its ``eth0``: what it sends) or "both".
    ``burst`` and ``latency`` are tbf's (a packet waiting longer than ``latency`` is
    dropped)."""

    def __init__(self, network: Network, host, rate: str = "1mbit", *, direction: str = "both",
                 burst: str = "16kb", latency: str = "500ms"):
        super().__init__()
        if direction not in ("in", "out", "both"):
            raise ValueError(f"direction must be 'in', 'out' or 'both', got {direction!r}")
        self.host: Host = network.host(host)
        self.rate, self.burst, self.latency, self.direction = rate, burst, latency, direction
        self.name = f"bandwidth {rate} {direction} {self.host.address}"

    def _devices(self) -> list[list[str]]:
        devs = []
        if self.direction in ("in", "both"):
            devs.append(["tc", "qdisc", "{op}", "dev", self.host.veth, "root"])
        if self.direction in ("out", "both"):
            devs.append(["ip", "netns", "exec", self.host.name, "tc", "qdisc", "{op}", "dev",
                         "eth0", "root"])
        return devs

    def _inject(self) -> None:
        reason = missing("bandwidth")
        if reason:
            raise NemesisError(f"{self.name}: {reason}")
        for dev in self._devices():
            _run(self.name, [w.replace("{op}", "replace") for w in dev] +
                 ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency])

    def _undo(self) -> None:
        for dev in self._devices():
            _run(f"heal {self.name}", [w.replace("{op}", "del") for w in dev], ok_if="No such")

    def installed(self) -> list[str]:
        """The tbf qdiscs on the host's link now (``tc qdisc show`` lines)."""
        lines = []
        for dev in self._devices():
            shown = subprocess.run([w.replace("{op}", "show") for w in dev[:-1]],
                                   capture_output=True, text=True).stdout
            lines += [line for line in shown.splitlines() if "tbf" in line]
        return lines


class PacketLoss(Nemesis):
    """``percent`` of the packets in and out of ``host`` dropped at random (an nftables
    ``numgen random mod 100`` rule in the host's namespace: real packet loss, which TCP
    meets with retransmissions; no ``netem`` needed). ``direction`` "in", "out" or
    "both"."""

    def __init__(self, network: Network, host, percent: int = 10, *, direction: str = "both"):
        super().__init__()
        if direction not in ("in", "out", "both"):
            raise ValueError(f"direction must be 'in', 'out' or 'both', got {direction!r}")
        if not 0 < int(percent) <= 100:
            raise ValueError(f"percent must be 1..100, got {percent!r}")
        self.host: Host = network.host(host)
        self.percent, self.direction = int(percent), direction
        self.name = f"loss {self.percent}% {direction} {self.host.address}"

    def _script(self, rules: bool) -> str:
        table = f"{TABLE}_loss"
        script = [f"table inet {table}", f"delete table inet {table}"]
        if rules:
            script.append(f"table inet {table} {{")
            for chain, hook in (("input", "in"), ("output", "out")):
                script.append(f"  chain {chain} {{ type filter hook {chain} priority -5; "
                              "policy accept;")
                if self.direction in (hook, "both"):
                    share = ("" if self.percent == 100
                             else f"numgen random mod 100 < {self.percent} ")
                    script.append(f"    oifname != \"lo\" iifname != \"lo\" {share}drop")
                script.append("  }")
            script.append("}")
        return "\n".join(script) + "\n"

    def _inject(self) -> None:
        reason = missing("partition")
        if reason:
            raise NemesisError(f"{self.name}: {reason}")
        _run(self.name, ["ip", "netns", "exec", self.host.name, "nft", "-f", "-"],
             input=self._script(True))

    def _undo(self) -> None:
        _run(f"heal {self.name}", ["ip", "netns", "exec", self.host.name, "nft", "-f", "-"],
             input=self._script(False))


# ---- links through a proxy (sparkjet.testing.proxy) -----------------------------------

class Delay(Nemesis):
    """Every chunk through ``proxy`` (a :class:`~sparkjet.testing.proxy.Proxy`) delayed
    by ``seconds`` plus up to ``jitter`` (chunks of different connections reorder); the
    proxy's earlier delay back at heal."""

    def __init__(self, proxy, seconds: float, jitter: float = 0.0):
        super().__init__()
        self.proxy, self.seconds, self.jitter = proxy, float(seconds), float(jitter)
        self.name = f"delay {self.seconds:g}+{self.jitter:g} s to {proxy.target_address}"
        self._before = (0.0, 0.0)

    def _inject(self) -> None:
        self._before = (self.proxy.delay, self.proxy.jitter)
        self.proxy.delay, self.proxy.jitter = self.seconds, self.jitter

    def _undo(self) -> None:
        self.proxy.delay, self.proxy.jitter = self._before


class Lossy(Nemesis):
    """A fraction ``rate`` of the chunks through ``proxy`` lost and retransmitted after
    TCP's timeout (see :mod:`sparkjet.testing.proxy`)."""

    def __init__(self, proxy, rate: float):
        super().__init__()
        if not 0 < rate < 1:
            raise ValueError(f"rate must be in (0, 1), got {rate!r}")
        self.proxy, self.rate = proxy, float(rate)
        self.name = f"loss {self.rate:.0%} to {proxy.target_address}"

    def _inject(self) -> None:
        self.proxy.loss = self.rate

    def _undo(self) -> None:
        self.proxy.loss = 0.0


class Stall(Nemesis):
    """The link through ``proxy`` partitioned: nothing flows, connections stay open (as
    over a cut cable), until heal."""

    def __init__(self, proxy):
        super().__init__()
        self.proxy = proxy
        self.name = f"stall of {proxy.target_address}"

    def _inject(self) -> None:
        self.proxy.stall()

    def _undo(self) -> None:
        self.proxy.unstall()


class ResetLinks(Nemesis):
    """Every connection through ``proxy`` reset at start (``reset`` says how many);
    heal has nothing to undo."""

    def __init__(self, proxy):
        super().__init__()
        self.proxy = proxy
        self.reset = 0
        self.name = f"reset links to {proxy.target_address}"

    def _inject(self) -> None:
        self.reset = self.proxy.reset()

    def _undo(self) -> None:
        pass


class HostLinks:
    """A transparent :class:`~sparkjet.testing.proxy.Proxy` in the namespace of each host of
    ``network``, through which every TCP connection the host opens to the network or takes
    from it passes (nftables redirects them: connections the host opens, in its ``output``
    hook; connections arriving on its ``eth0``, in ``prerouting``). Clients reach the
    addresses and ports they meant; a server sees a connection from another host come from
    its own host's address (the proxy's), not the peer's.
    :meth:`of` a host is the proxy of that host's links, for :class:`Delay`, :class:`Lossy`,
    :class:`Stall` and :class:`ResetLinks`: delay and reordering on a live worker's links,
    which this kernel (no ``netem``) cannot do to packets.

    Only connections opened after :meth:`start` pass through the proxies, so start it
    before the processes (a Spark cluster) that use the network. A connection between two
    hosts passes both their proxies; the packets on the bridge keep the hosts' addresses,
    so the partitions above cut it as before. :meth:`stop` (also at the context manager's
    exit) removes the rules and closes every proxied connection."""

    MARK = 0x51E7         # on the proxies' own onward connections: never redirected again

    def __init__(self, network: Network, *, seed: int | None = None):
        self.network = network
        self.seed = seed
        self.proxies: dict[str, object] = {}

    def start(self) -> HostLinks:
        from sparkjet.testing.proxy import Proxy  # asyncio, loaded only where links proxy

        reason = missing("partition")
        if reason:
            raise NemesisError(f"proxied host links: {reason}")
        try:
            for h in self.network.hosts:
                proxy = Proxy(None, "0.0.0.0:0", netns=h.name, mark=self.MARK,
                              seed=None if self.seed is None else self.seed + h.index)
                self.proxies[h.address] = proxy.start()
                script = "\n".join([
                    f"table ip {TABLE}_links", f"delete table ip {TABLE}_links",
                    f"table ip {TABLE}_links {{",
                    "  chain out { type nat hook output priority -100; policy accept;",
                    f"    meta mark {self.MARK} return",
                    f"    ip daddr {self.network.subnet} ip daddr != {h.address} "
                    f"meta l4proto tcp redirect to :{proxy.port}",
                    "  }",
                    "  chain in { type nat hook prerouting priority -100; policy accept;",
                    f"    iifname \"eth0\" meta l4proto tcp redirect to :{proxy.port}",
                    "  }",
                    "}"]) + "\n"
                _run(f"redirect {h.address}'s links through its proxy",
                     ["ip", "netns", "exec", h.name, "nft", "-f", "-"], input=script)
        except BaseException:
            self.stop()
            raise
        return self

    def of(self, host):
        """The proxy of ``host``'s links (a host, its index or its address)."""
        return self.proxies[_address(self.network, host)]

    def stop(self) -> None:
        for address, proxy in list(self.proxies.items()):
            with contextlib.suppress(NemesisError, KeyError):
                _run("remove the links' redirection",
                     ["ip", "netns", "exec", self.network.host(address).name, "nft",
                      "delete", "table", "ip", f"{TABLE}_links"], ok_if="No such file")
            proxy.stop()
        self.proxies = {}

    def __enter__(self) -> HostLinks:  # noqa: PYI034 (Self needs Python 3.11)
        return self.start() if not self.proxies else self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- processes ---------------------------------------------------------------------------

class Pause(Nemesis):
    """SIGSTOP of ``pids`` (a pid or several); SIGCONT of the same at heal. A process gone
    meanwhile is skipped. With ``hold(seconds)``: paused for that long."""

    def __init__(self, pids, name: str | None = None):
        super().__init__()
        self.pids = [int(pids)] if isinstance(pids, int) else [int(p) for p in pids]
        self.name = name or f"pause {self.pids}"
        self.stopped: list[int] = []

    def _inject(self) -> None:
        self.stopped = stop_processes(self.pids)
        if not self.stopped:
            raise NemesisError(f"{self.name}: no such process (all of {self.pids} are gone)")

    def _undo(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class SelfPause(Nemesis):
    """This process (the driver, where a campaign runs it) SIGSTOPped for ``seconds`` and
    then SIGCONTed by a helper process, the only way a process can be stopped and resumed
    whole (every thread stops, the one that asked included). :meth:`start` returns once
    the process runs again; :meth:`heal` waits for the helper and resumes the process
    should the helper have failed to."""

    def __init__(self, seconds: float, name: str | None = None):
        super().__init__()
        if not 0 < seconds <= 300:
            raise ValueError(f"seconds must be in (0, 300], got {seconds!r}")
        self.seconds = seconds
        self.name = name or f"pause driver {seconds:.1f}s"
        self._helper: subprocess.Popen | None = None

    def _inject(self) -> None:
        pid = os.getpid()
        # the helper stops this process, sleeps, resumes it; SIGCONT is sent again on any
        # way out of it (dash runs no EXIT trap when a signal ends it, so the signals are
        # trapped too); a second, independent guard resumes it a while later should the
        # helper be SIGKILLed
        resume = f"kill -CONT {pid}"
        subprocess.Popen(["sh", "-c", f"sleep {self.seconds + 5:.3f}; {resume}"],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        self._helper = subprocess.Popen(
            ["sh", "-c", f"trap '{resume}; exit' EXIT INT TERM HUP; kill -STOP {pid}; "
                         f"sleep {self.seconds:.3f}"], start_new_session=True)
        # the helper's SIGSTOP lands while this thread waits for it to exit
        self._helper.wait()

    def _undo(self) -> None:
        helper, self._helper = self._helper, None
        if helper is not None and helper.poll() is None:
            helper.wait(self.seconds + 10)


class ServerOutage(Nemesis):
    """``server.halt()`` (it ends hard, keeping its data), ``server.restart()`` at heal
    (same port and data; it waits until the server answers). Any object with those two
    methods: the tests' Kafka broker, PostgreSQL, S3 and Redis servers have them."""

    def __init__(self, server, name: str | None = None):
        super().__init__()
        self.server = server
        self.name = name or f"outage of {type(server).__name__}"

    def _inject(self) -> None:
        self.server.halt()

    def _undo(self) -> None:
        self.server.restart()


# ---- disks -------------------------------------------------------------------------------

@contextlib.contextmanager
def tmpfs(path, size: str = "1m"):
    """A tmpfs of ``size`` mounted at ``path`` (made if missing) while the block runs: a
    small file system for :class:`DiskFull` to fill. Raises :class:`NemesisError` where
    mounting is refused (not root, no ``CAP_SYS_ADMIN``)."""
    os.makedirs(path, exist_ok=True)
    _run(f"tmpfs at {path}", ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    try:
        yield Path(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class DiskFull(Nemesis):
    """The file system holding ``path`` filled up: a filler file takes its free space (so
    writes there fail with ENOSPC), removed at heal. Refuses a file system with more than
    ``limit`` bytes free (256 MiB): filling a real disk would hurt the machine; mount a
    small :func:`tmpfs` for it."""

    def __init__(self, path, limit: int = 256 << 20):
        super().__init__()
        self.path = Path(path)
        self.limit = limit
        self.filler = self.path / ".sparkjet-nemesis-fill"
        self.filled = 0
        self.name = f"disk full at {self.path}"

    def _inject(self) -> None:
        stats = os.statvfs(self.path)
        free = stats.f_bavail * stats.f_frsize
        if free > self.limit:
            raise NemesisError(f"{self.name}: its file system has {free} bytes free, more than "
                               f"{self.limit}: fill only a small one (nemesis.tmpfs)")
        self.filled = 0
        chunk = b"\0" * (64 << 10)
        with open(self.filler, "wb", buffering=0) as f:
            while True:
                try:
                    self.filled += f.write(chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        break
                    chunk = chunk[: len(chunk) // 2]

    def _undo(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()


class ReadOnly(Nemesis):
    """``path`` (a directory) made read-only: a read-only bind mount of it over itself
    (files opened before keep their access; a new open for writing, a create, a rename
    or a removal fails with EROFS); unmounted at heal."""

    def __init__(self, path):
        super().__init__()
        self.path = Path(path)
        self.name = f"read-only {self.path}"

    def _inject(self) -> None:
        reason = missing("disk")
        if reason:
            raise NemesisError(f"{self.name}: {reason}")
        _run(self.name, ["mount", "--bind", str(self.path), str(self.path)])
        try:
            _run(self.name, ["mount", "-o", "remount,bind,ro", str(self.path)])
        except NemesisError:
            subprocess.run(["umount", str(self.path)], capture_output=True)
            raise

    def _undo(self) -> None:
        _run(f"heal {self.name}", ["umount", "-l", str(self.path)])


class Removed(Nemesis):
    """The directory ``path`` removed mid-run: moved to a sibling named
    ``.<name>.sparkjet-removed`` (one rename: processes see it vanish at once). Heal puts
    it back; if something made ``path`` again meanwhile, that new directory is kept beside
    it as ``.<name>.sparkjet-recreated`` (``recreated`` says so). With ``restore=False``
    the directory is deleted for good and heal does nothing."""

    def __init__(self, path, restore: bool = True):
        super().__init__()
        self.path = Path(path)
        self.restore = restore
        self.aside = self.path.with_name(f".{self.path.name}.sparkjet-removed")
        self.recreated: Path | None = None
        self.name = f"removed {self.path}"

    def _inject(self) -> None:
        if not self.path.is_dir():
            raise NemesisError(f"{self.name}: no such directory")
        if self.aside.exists():
            shutil.rmtree(self.aside)
        os.rename(self.path, self.aside)
        if not self.restore:
            shutil.rmtree(self.aside)

    def _undo(self) -> None:
        if not self.restore:
            return
        if self.path.exists():
            self.recreated = self.path.with_name(f".{self.path.name}.sparkjet-recreated")
            if self.recreated.exists():
                shutil.rmtree(self.recreated)
            os.rename(self.path, self.recreated)
        os.rename(self.aside, self.path)


# ---- clocks ------------------------------------------------------------------------------

class ClockSkew(Nemesis):
    """The wall clock of processes started with :meth:`env` in their environment, moved by
    ``offset`` seconds (negative: back) at start and back to true time at heal, while they
    run: libfaketime rereads ``FAKETIME_TIMESTAMP_FILE`` (``file``) on every call. The
    monotonic clock stays true unless ``monotonic`` (a JVM wants it true). :meth:`jump`
    sets another offset while active."""

    def __init__(self, file, offset: float, *, monotonic: bool = False):
        super().__init__()
        self.file = Path(file)
        self.offset = float(offset)
        self.monotonic = monotonic
        self.name = f"clock skew {self.offset:+g} s"
        self._write(0.0)

    def env(self) -> dict[str, str]:
        """What a process's environment needs for this skew (``LD_PRELOAD`` and
        libfaketime's settings); raises :class:`NemesisError` without libfaketime."""
        library = _libfaketime()
        if library is None:
            raise NemesisError(f"{self.name}: {missing('clock')}")
        shim = _sleep_shim() if not self.monotonic else None
        preload = " ".join(filter(None, [shim, library, os.environ.get("LD_PRELOAD")]))
        env = {"LD_PRELOAD": preload, "FAKETIME_TIMESTAMP_FILE": str(self.file),
               "FAKETIME_NO_CACHE": "1"}
        if not self.monotonic:
            env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
        return env

    def jump(self, offset: float) -> None:
        self.offset = float(offset)
        if self.active:
            self._write(self.offset)

    def _write(self, offset: float) -> None:
        tmp = self.file.with_name(self.file.name + ".tmp")
        tmp.write_text(f"{offset:+f}\n")
        os.replace(tmp, self.file)     # a reader sees the old offset or the new, never ""

    def _inject(self) -> None:
        self._write(self.offset)

    def _undo(self) -> None:
        self._write(0.0)


def release_clock_segments(folder: str | os.PathLike = "/dev/shm") -> list[str]:
    """Removes the shared memory libfaketime left behind by processes that are gone, and
    returns the names removed.

    libfaketime (0.9.10) opens ``/dev/shm/faketime_shm_<pid>`` and
    ``/dev/shm/sem.faketime_sem_<pid>`` in every process it is preloaded into and removes
    them only when that process exits normally: every member SIGKILLed under a
    :class:`ClockSkew` left two files in memory (about sixty after a long campaign). A
    segment whose ``<pid>`` still runs is kept; call this once the skewed processes have
    ended (a child that outlived its creator keeps its mapping, and libfaketime makes the
    segment again where one is missing)."""
    removed = []
    for path in Path(folder).glob("*faketime_s[he]m_*"):
        prefix, _, pid = path.name.rpartition("_")
        if prefix not in ("faketime_shm", "sem.faketime_sem") or not pid.isdigit():
            continue
        if _state(int(pid)) is not None:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed


# ---- helpers -----------------------------------------------------------------------------

def _address(network: Network, which) -> str:
    if isinstance(which, str) and which == network.gateway:
        return which
    return network.host(which).address


def stop_processes(pids, timeout: float = 10.0) -> list[int]:
    """SIGSTOPs each of ``pids`` and returns once every thread of each has stopped (or
    ``timeout`` s passed); the pids that were there to stop.

    ``kill`` returns before the process stops: only the thread that takes the signal
    starts the group stop, when the scheduler next runs it, and until then the others
    run on. On a busy machine that window is milliseconds, long enough for a server
    thread to answer a request sent right after the ``kill``.
    """
    stopped = []
    for pid in [pids] if isinstance(pids, int) else pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGSTOP)
            stopped.append(int(pid))
    wait_until(lambda: all(_all_stopped(p) for p in stopped), timeout, interval=0.005)
    return stopped


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (or the process is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return True
    # a thread gone meanwhile (None) counts as stopped
    return all(_state(pid, task) in ("T", "t", "Z", "X", None) for task in tasks)


def _state(pid: int, task: str | None = None) -> str | None:
    """A process's state letter (``T``: stopped), or one of its threads', None when it is
    gone."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


#: libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC fails every
#: ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` with EINVAL, which is how Python's
#: ``time.sleep`` sleeps: a skewed Python process died at its first sleep. And it returns
#: ETIMEDOUT at once from every ``pthread_cond_timedwait`` on a condition variable of the
#: monotonic clock (sparkjet's native barrier aligner waits on those): each wait became a
#: busy loop, which slowed a skewed member until its snapshots timed out. This shim,
#: preloaded before libfaketime, sends monotonic sleeps straight to the kernel (the
#: monotonic clock is not faked, so that is the right answer) and the others on to
#: libfaketime, and every condition wait to glibc's own (a condition variable on the wall
#: clock then waits for the true time, not the skewed one).
_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
int clock_nanosleep(clockid_t id, int flags, const struct timespec *req, struct timespec *rem) {
    if (id == CLOCK_MONOTONIC || id == CLOCK_BOOTTIME) {
        long r = syscall(SYS_clock_nanosleep, id, flags, req, rem);
        return r == 0 ? 0 : errno;
    }
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
    if (!next) next = dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(id, flags, req, rem);
}
int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *t) {
    static int (*real)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
    if (!real) {
        void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
        if (libc) real = dlvsym(libc, "pthread_cond_timedwait", "GLIBC_2.3.2");
        if (!real) real = dlsym(RTLD_NEXT, "pthread_cond_timedwait");
    }
    return real(c, m, t);
}
"""


def _sleep_shim() -> str:
    """The shim's shared library (built once per machine with the C compiler, in the temp
    folder); raises :class:`NemesisError` without a compiler."""
    import hashlib
    import tempfile

    digest = hashlib.sha256(_SHIM_SOURCE.encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"sparkjet-faketime-shim-{digest}.so"
    if target.exists():
        return str(target)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NemesisError("clock skew of Python processes needs a C compiler (cc) for the "
                           "sleep shim: libfaketime 0.9.10 fails Python's time.sleep")
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "shim.c"
        source.write_text(_SHIM_SOURCE)
        built = Path(tmp) / "shim.so"
        _run("build the libfaketime sleep shim",
             [compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(source), "-ldl",
              "-lpthread"])
        os.replace(built, target.with_suffix(f".{os.getpid()}.tmp"))
        os.replace(target.with_suffix(f".{os.getpid()}.tmp"), target)
    return str(target)


def _libfaketime() -> str | None:
    return next((p for p in LIBFAKETIME if os.path.exists(p)), None)


def _run(what: str, argv: list[str], *, input: str | None = None, ok_if: str | None = None) -> None:
    if shutil.which(argv[0]) is None:
        raise NemesisError(f"{what}: {argv[0]} is not installed")
    done = subprocess.run(argv, input=input, capture_output=True, text=True)
    if done.returncode != 0 and not (ok_if and ok_if in done.stderr):
        raise NemesisError(f"{what}: {' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}")


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Polls ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
