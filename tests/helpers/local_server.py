"""What the tests' throwaway servers (redis-server, the Kafka broker) share: the process,
its loopback port and log, a stop that waits, then kills, and an outage: :meth:`halt` ends
the process, :meth:`restart` starts it again with the same command (same port, same data
directory) and waits until it answers."""
from __future__ import annotations

import subprocess
import time


class LocalServer:
    """A running server process on 127.0.0.1:``port``; :meth:`stop` ends it. ``command``
    is how it was started (for :meth:`restart`)."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: str,
                 command: list[str] | None = None):
        self.process = process
        self.port = port
        self.log_path = log_path
        self.command = command

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def halt(self) -> None:
        """Ends the server (SIGTERM, then SIGKILL after 10 s) and keeps its data."""
        self.stop()

    def restart(self, timeout: float = 20.0) -> None:
        """Starts the halted server again with the same command and waits until it
        answers (RuntimeError with its log if it does not)."""
        if self.process.poll() is None:
            raise RuntimeError("the server is running: halt() it first")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if self.answers():
                return
            time.sleep(0.1)
        with open(self.log_path, "rb") as f:
            log = f.read().decode(errors="replace")[-2000:]
        raise RuntimeError(f"{type(self).__name__} did not come back on port {self.port}:\n{log}")

    def answers(self) -> bool:
        """Whether the server answers a request now (each kind of server says how)."""
        raise NotImplementedError
