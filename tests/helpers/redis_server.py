"""A throwaway ``redis-server`` for tests: a free loopback port, no persistence, its own
directory; :func:`start` waits until it answers PING."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

from helpers.local_server import LocalServer


class RedisServerMissing(RuntimeError):
    """``redis-server`` is not on PATH."""


class RedisServer(LocalServer):
    """A running ``redis-server``; :meth:`stop` ends it, :meth:`halt` and :meth:`restart`
    take it down and bring it back (same port and directory; started with ``persist=True``
    it keeps its data across: an append-only file, fsynced always)."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: str,
                 command: list[str] | None = None):
        super().__init__(process, port, log_path, command)
        self.url = f"redis://127.0.0.1:{port}/0"

    def answers(self) -> bool:
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        finally:
            client.close()


def _install() -> str | None:
    """Installs Debian's redis-server when the tests run as root on a Debian-like system
    (as CI and fresh machines of this project's kind do), so that the README's test command
    needs nothing installed by hand. Returns its path, or None where that is not possible."""
    import os

    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "redis-server"]):
        try:
            if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
                return None
        except subprocess.TimeoutExpired:
            return None
    return shutil.which("redis-server")


def start(directory, timeout: float = 10.0, attempts: int = 3, *,
          persist: bool = False) -> RedisServer:
    """Starts ``redis-server`` in ``directory``; raises :class:`RedisServerMissing` if it
    is not installed, RuntimeError (with its log) if it does not come up. ``persist``:
    keep the data in an append-only file (fsync always) so that it survives a restart."""
    binary = shutil.which("redis-server") or _install()
    if binary is None:
        raise RedisServerMissing(
            "redis-server is not installed: these tests need a real Redis "
            "(Debian/Ubuntu: apt-get install -y redis-server)")
    import redis

    last_log = ""
    for _ in range(attempts):
        # The port is free now; another process may take it before redis binds, hence
        # the retries.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log_path = f"{directory}/redis-{port}.log"
        durability = (["--appendonly", "yes", "--appendfsync", "always",
                       "--appendfilename", f"redis-{port}.aof",
                       "--appenddirname", f"aof-{port}"] if persist else ["--appendonly", "no"])
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   *durability, "--dir", str(directory), "--daemonize", "no"]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        server = RedisServer(process, port, log_path, command)
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    if client.ping():
                        return server
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
        except BaseException:
            server.stop()  # never leave a redis-server behind
            raise
        finally:
            client.close()
        server.stop()
        with open(log_path, "rb") as f:
            last_log = f.read().decode(errors="replace")[-2000:]
    raise RuntimeError(f"redis-server did not answer PING after {attempts} attempts:\n{last_log}")
