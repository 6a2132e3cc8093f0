"""A throwaway Kafka-protocol broker for tests: ``noida-db`` (PyPI; a single binary that
speaks Kafka with transactions, ``read_committed`` and producer fencing) with only its
Kafka service, on a free loopback port, data in its own directory; :func:`start` waits
until it answers a metadata request."""
from __future__ import annotations

import socket
import subprocess
import time
from importlib import resources

from helpers.local_server import LocalServer


class KafkaBroker(LocalServer):
    """A running broker; :meth:`stop` ends it, :meth:`halt` and :meth:`restart` take it
    down and bring it back (same port and data directory)."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: str,
                 command: list[str] | None = None):
        super().__init__(process, port, log_path, command)
        self.bootstrap = f"127.0.0.1:{port}"

    def answers(self) -> bool:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap,
                             "socket.connection.setup.timeout.ms": 1000})
        try:
            admin.list_topics(timeout=1)
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False


def binary() -> str:
    """The noida-db executable inside its package (run directly: the ``noida-db`` script is
    a Python wrapper whose child would outlive a terminated wrapper)."""
    try:
        path = resources.files("noida_db").joinpath("noida-db")
    except ModuleNotFoundError:
        raise RuntimeError("noida-db is not installed: pip install noida-db "
                           "(or pip install '.[test]')") from None
    return str(path)


def start(directory, timeout: float = 20.0, attempts: int = 3) -> KafkaBroker:
    """Starts noida-db's Kafka in ``directory``; RuntimeError (with its log) if it does not
    come up."""
    import os

    from confluent_kafka.admin import AdminClient

    exe = binary()
    os.chmod(exe, 0o755)
    last_log = ""
    for _ in range(attempts):
        # The port is free now; another process may take it before the broker binds,
        # hence the retries.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log_path = f"{directory}/noida-{port}.log"
        command = [exe, "start", "--only", "kafka", "--kafka-port", str(port), "--host",
                   "127.0.0.1", "--data-dir", f"{directory}/data-{port}"]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        broker = KafkaBroker(process, port, log_path, command)
        admin = AdminClient({"bootstrap.servers": broker.bootstrap,
                             "socket.connection.setup.timeout.ms": 1000})
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    admin.list_topics(timeout=1)
                    return broker
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.1)
        except BaseException:
            broker.stop()  # never leave a broker behind
            raise
        broker.stop()
        with open(log_path, "rb") as f:
            last_log = f.read().decode(errors="replace")[-2000:]
    raise RuntimeError(f"noida-db's Kafka did not answer after {attempts} attempts:\n{last_log}")


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """Creates `topic` and waits until its metadata shows every partition."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                           replication_factor=1)]).values():
        f.result(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        md = admin.list_topics(topic, timeout=5).topics.get(topic)
        if md is not None and md.error is None and len(md.partitions) == partitions:
            return
        time.sleep(0.05)
    raise RuntimeError(f"topic {topic} did not show {partitions} partitions")
