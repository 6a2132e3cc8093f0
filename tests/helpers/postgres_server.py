"""A throwaway PostgreSQL server for tests and benchmarks: Debian's binaries
(``/usr/lib/postgresql/<version>/bin``), ``initdb`` in a temporary directory, a free loopback
port, password authentication over TCP (so that wrong credentials can be tested) and
``max_prepared_transactions`` set (``PREPARE TRANSACTION`` is off by default).

PostgreSQL refuses to run as root: as root, the cluster's directory is given to the
``postgres`` system user (created if missing) and the server runs as that user.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time

USER = "postgres"
PASSWORD = "sparkjet-test-secret"


class PostgresServerMissing(RuntimeError):
    """Debian's PostgreSQL server binaries are not installed."""


def find_bindir() -> str | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding ``initdb`` and ``postgres``,
    else the folder of ``initdb`` on PATH, else None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0)
    for initdb in reversed(found):
        bindir = os.path.dirname(initdb)
        if os.path.exists(os.path.join(bindir, "postgres")):
            return bindir
    initdb = shutil.which("initdb")
    if initdb and os.path.exists(os.path.join(os.path.dirname(os.path.realpath(initdb)),
                                              "postgres")):
        return os.path.dirname(os.path.realpath(initdb))
    return None


def _install() -> str | None:
    """Installs Debian's PostgreSQL when running as root where apt-get exists (CI and fresh
    machines of this project's kind), like tests/helpers/redis_server.py does for Redis."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "postgresql"]):
        try:
            if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
                return None
        except subprocess.TimeoutExpired:
            return None
    return find_bindir()


def _run_as() -> dict:
    """Popen arguments that drop root for the ``postgres`` user (created if missing)."""
    if os.geteuid() != 0:
        return {}
    import pwd

    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        USER], check=True, capture_output=True)
    entry = pwd.getpwnam(USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


class PostgresServer:
    """A running server; :attr:`dsn` connects as its superuser, :meth:`stop` ends it and
    removes its directory. :meth:`halt` and :meth:`restart` take it down and bring it back
    (same data directory, same port): an outage, as a failover or a restart shows it."""

    def __init__(self, process: subprocess.Popen, port: int, directory: str, log_path: str,
                 command: list[str] | None = None, as_user: dict | None = None,
                 bindir: str | None = None):
        self.process = process
        self.command = command
        self.as_user = as_user or {}
        self.bindir = bindir
        self.port = port
        self.directory = directory
        self.log_path = log_path
        self.host = "127.0.0.1"
        self.user = USER
        self.password = PASSWORD
        self.dsn = (f"host=127.0.0.1 port={port} dbname=postgres user={USER} "
                    f"password={PASSWORD} connect_timeout=10")

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def halt(self, mode: str = "fast") -> None:
        """Ends the server process and keeps its data: ``mode="fast"`` (SIGINT: clients are
        disconnected with ``57P01 admin_shutdown``, open transactions roll back, prepared
        ones stay), ``"immediate"`` (SIGQUIT: no checkpoint, crash recovery at restart)."""
        import signal

        sig = {"fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode]
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self, timeout: float = 30.0) -> None:
        """Starts the halted server again, on the same port and data directory, and waits
        until it accepts connections."""
        if self.process.poll() is None:
            raise RuntimeError("the server is running: halt() it first")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, **self.as_user)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if _ready(self.bindir, self.port, self.directory):
                return
            time.sleep(0.1)
        raise RuntimeError(f"postgres did not come back on port {self.port}:\n{self.log()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()    # SIGTERM: "smart" shutdown, then fast after the wait
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def start(*, durable: bool = False, max_prepared_transactions: int = 64,
          timeout: float = 30.0, attempts: int = 3) -> PostgresServer:
    """Initializes a cluster in a new temporary directory and starts it. `durable=False`
    (tests) turns fsync off: the server is never killed, only the job's members are.
    Raises :class:`PostgresServerMissing` if the binaries are missing and cannot be
    installed, RuntimeError (with the server's log) if it does not come up."""
    bindir = find_bindir() or _install()
    if bindir is None:
        raise PostgresServerMissing(
            "PostgreSQL is not installed: these tests need a real server "
            "(Debian/Ubuntu: apt-get install -y postgresql)")
    as_user = _run_as()
    directory = tempfile.mkdtemp(prefix="sparkjet-pg-")
    data = os.path.join(directory, "data")
    pwfile = os.path.join(directory, "pwfile")
    with open(pwfile, "w") as f:
        f.write(PASSWORD + "\n")
    if as_user:
        os.chown(directory, as_user["user"], as_user["group"])
        os.chown(pwfile, as_user["user"], as_user["group"])
    init = subprocess.run(
        [os.path.join(bindir, "initdb"), "-D", data, "-U", USER, f"--pwfile={pwfile}",
         "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C",
         "--no-sync"],
        capture_output=True, **as_user)
    if init.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"initdb failed:\n{init.stdout.decode()}\n{init.stderr.decode()}")
    settings = {"listen_addresses": "127.0.0.1", "unix_socket_directories": directory,
                "max_prepared_transactions": str(max_prepared_transactions),
                "max_connections": "200", "log_min_messages": "warning"}
    if not durable:
        settings.update(fsync="off", synchronous_commit="off", full_page_writes="off")
    last_log = ""
    for _ in range(attempts):
        # The port is free now; another process may take it before postgres binds, hence
        # the retries.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log_path = os.path.join(directory, f"postgres-{port}.log")
        options = [f"-c{k}={v}" for k, v in {**settings, "port": str(port)}.items()]
        with open(log_path, "wb") as log:
            if as_user:
                os.chown(log_path, as_user["user"], as_user["group"])
            command = [os.path.join(bindir, "postgres"), "-D", data, *options]
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, **as_user)
        server = PostgresServer(process, port, directory, log_path, command, as_user, bindir)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and process.poll() is None:
                if _ready(bindir, port, directory):
                    return server
                time.sleep(0.1)
        except BaseException:
            server.stop()   # never leave a postgres behind
            raise
        last_log = server.log()
        if process.poll() is None:
            process.terminate()
            process.wait(20)
    shutil.rmtree(directory, ignore_errors=True)
    raise RuntimeError(f"postgres did not accept connections after {attempts} attempts:\n"
                       f"{last_log}")


def _ready(bindir: str, port: int, directory: str) -> bool:
    ready = subprocess.run([os.path.join(bindir, "pg_isready"), "-q", "-h", "127.0.0.1",
                            "-p", str(port), "-t", "1"], capture_output=True)
    return ready.returncode == 0
