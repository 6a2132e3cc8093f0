"""What the tests' throwaway servers (redis-server, the Kafka broker) share: the process,
its loopback port and log, and a stop that waits, then kills."""
from __future__ import annotations

import subprocess


class LocalServer:
    """A running server process on 127.0.0.1:``port``; :meth:`stop` ends it."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: str):
        self.process = process
        self.port = port
        self.log_path = log_path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
