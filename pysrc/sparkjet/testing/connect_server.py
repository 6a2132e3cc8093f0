"""A throwaway Spark Connect server on this machine, for tests of jobs run from a Spark
Connect session (``SparkSession.builder.remote("sc://...")``).

:class:`ConnectServer` starts the server that ships inside the ``pyspark`` package
(``org.apache.spark.sql.connect.service.SparkConnectServer`` from its
``jars/spark-connect_*.jar``, what ``sbin/start-connect-server.sh`` runs) with
``spark-submit``, bound to 127.0.0.1 on a free port, with its log and an empty
configuration folder in a temporary folder it owns::

    with ConnectServer(master="local[2]") as server:
        spark = server.session()        # a pyspark.sql.connect.session.SparkSession
        Job(pipeline, config).run(spark)

The server's Python workers run this interpreter (``PYSPARK_PYTHON``) with this process's
``sparkjet`` importable (its folder is put first on ``PYTHONPATH``): the members' code is
pickled by value, but sparkjet itself is imported where they run.

``spark-submit`` execs ``spark-class``, which execs the JVM, so the process started is the
server's JVM; it runs in a process group of its own (its Python workers with it), which
:meth:`ConnectServer.stop` kills. Started from the main thread it also gets ``SIGKILL``
from the kernel when the process that started it dies (``PR_SET_PDEATHSIG``), so a killed
test process leaks no JVM.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import sparkjet
from sparkjet.errors import (
    ConnectServerError,  # noqa: F401 (defined there; named here too)
)
from sparkjet.spark.java import ensure_java
from sparkjet.testing.standalone import (
    _TRAMPOLINE,
    _conf_value,
    _free_ports,
    _kill_group,
    _port_clash,
    _spark_home,
    _tail,
)

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


class ConnectServer:
    """A Spark Connect server on 127.0.0.1 running ``master`` (``local[2]``: its own
    driver with two task slots), with ``driver_memory`` of heap and the Spark settings
    ``conf``. :meth:`start` waits until it serves (up to ``start_timeout`` seconds)."""

    def __init__(self, master: str = "local[2]", *, driver_memory: str = "512m",
                 conf: dict | None = None, start_timeout: float = 120.0,
                 directory: str | os.PathLike | None = None):
        self.master = master
        self.driver_memory = driver_memory
        self.conf = dict(conf or {})
        self.start_timeout = start_timeout
        self._given_dir = None if directory is None else Path(directory)
        self.directory: Path | None = None
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._sessions: list = []

    @property
    def url(self) -> str:
        """The ``sc://`` URL a client connects to."""
        return f"sc://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """The server JVM's log (its stdout and stderr, its Python workers' stderr too)."""
        assert self.directory is not None, "not started"
        return self.directory / "connect-server.log"

    def __enter__(self) -> ConnectServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ConnectServer:
        ensure_java()
        self.directory = self._given_dir or Path(tempfile.mkdtemp(prefix="sparkjet-connect-"))
        (self.directory / "conf").mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.start_timeout
        attempts = 0
        while True:
            attempts += 1
            self.port = _free_ports(1)[0]
            self.process = self._popen()
            problem = self._wait_serving(deadline)
            if problem is None:
                return self
            self.stop()
            # The port was taken between _free_ports and the bind: try another one.
            if attempts == 3 or time.monotonic() >= deadline or not _port_clash(self.log_path):
                raise ConnectServerError(
                    f"the Spark Connect server at {self.url} {problem}:\n{_tail(self.log_path)}")

    def session(self):
        """A new Spark Connect session on this server. Made with the Connect session's own
        builder, which (unlike ``pyspark.sql.SparkSession.builder.remote(...)``) neither
        refuses to run beside a classic session in this process nor switches later
        sessions of this process to Connect. :meth:`stop` stops it."""
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        session = ConnectSession.builder.remote(self.url).create()
        self._sessions.append(session)
        return session

    def stop(self) -> None:
        """Stops the sessions :meth:`session` made, then kills the server JVM and its
        Python workers (its process group)."""
        # First the sessions, while the server answers: a session left open retries its
        # release against a dead server for minutes when this process exits.
        sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.stop()
        process, self.process = self.process, None
        if process is None:
            return
        _kill_group(process.pid, signal.SIGKILL)
        process.wait()

    def _wait_serving(self, deadline: float) -> str | None:
        assert self.process is not None
        started = f"Spark Connect server started at: 127.0.0.1:{self.port}"
        while True:
            if self.process.poll() is not None:
                return f"exited (code {self.process.returncode}) during start"
            if started in _tail(self.log_path, 200):
                return None
            if time.monotonic() > deadline:
                return f"did not serve within {self.start_timeout:.0f} s"
            time.sleep(0.2)

    def _popen(self) -> subprocess.Popen:
        assert self.directory is not None
        home = _spark_home()
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            **{key: _conf_value(value) for key, value in self.conf.items()},
        }
        command = [os.path.join(home, "bin", "spark-submit"), "--master", self.master,
                   "--driver-memory", self.driver_memory, "--class", SERVER_CLASS,
                   "--name", "sparkjet Spark Connect server"]
        for key, value in conf.items():
            command += ["--conf", f"{key}={value}"]
        command.append("spark-internal")  # no application jar: the class is on the classpath
        if threading.current_thread() is threading.main_thread() and sys.platform == "linux":
            command = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *command]
        with open(self.log_path, "ab") as out:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self._env(),
                                    cwd=str(self.directory), start_new_session=True)

    def _env(self) -> dict:
        assert self.directory is not None

        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(sparkjet.__file__)))
        env = dict(os.environ)
        for key in ("SPARK_ENV_LOADED", "PYSPARK_SUBMIT_ARGS", "SPARK_SUBMIT_OPTS", "SPARK_REMOTE",
                    "SPARK_CONNECT_MODE_ENABLED"):
            env.pop(key, None)
        env.update({
            "SPARK_HOME": _spark_home(),
            "SPARK_CONF_DIR": str(self.directory / "conf"),  # empty: no stray spark-defaults
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_CONNECT_MODE": "0",  # as sbin/start-connect-server.sh: a classic driver
            "PYSPARK_PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [package_parent, os.environ.get("PYTHONPATH")])),
        })
        return env


__all__ = ["ConnectServer", "ConnectServerError"]
