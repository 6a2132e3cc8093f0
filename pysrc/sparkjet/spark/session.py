"""What sparkjet asks of a Spark session, answered alike for a classic session and a Spark
Connect one (``SparkSession.builder.remote("sc://...")``, what Databricks serverless and
shared clusters give): a Connect session has no ``sparkContext`` and no JVM gateway, only
the DataFrame API, the session's configuration (``spark.conf``) and its tags; and
:func:`local_session`, a session on this machine with a Java it finds itself and the JVM's
log in a file."""
from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import sys
from typing import TYPE_CHECKING

from sparkjet.spark.java import ensure_java

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# local, local[4], local[*], local[4,2] (retries); local-cluster[workers,cores,memory]
_LOCAL = re.compile(r"local(?:\[(\d+|\*)(?:,\d+)?\])?")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]")


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (a client of a remote server)."""
    # Not imported here: a Connect session exists only once its module is loaded, and
    # loading it on a classic session's behalf costs time and warnings (or fails without
    # pyspark[connect]'s gRPC packages).
    connect = sys.modules.get("pyspark.sql.connect.session")
    return connect is not None and isinstance(spark, connect.SparkSession)


def master(spark) -> str:
    """The session's master URL (``local[2]``, ``spark://host:7077``, ``yarn``...); on Spark
    Connect, the server's."""
    if not is_connect(spark):
        return spark.sparkContext.master
    return spark.conf.get("spark.master", None) or ""


def default_parallelism(spark) -> int:
    """The cores Spark's scheduler sees (``SparkContext.defaultParallelism``). On Spark
    Connect it is read from the partitions of a ``spark.range`` without a partition count
    (Spark gives it that many): one small query."""
    if not is_connect(spark):
        return max(1, spark.sparkContext.defaultParallelism)
    # Range splits its rows evenly, so with more rows than partitions each one has a row.
    # SQL text, not pyspark.sql.functions: those pick Connect or classic by a process-wide
    # setting, not by the session at hand.
    row = spark.range(0, 1 << 16).selectExpr("spark_partition_id() AS p").selectExpr(
        "max(p) AS last").first()
    return max(1, row[0] + 1)


def task_slots(spark) -> int:
    """How many tasks the cluster can run at once now: the executors' cores over
    ``spark.task.cpus`` (``local[N]``: N). A classic session asks the scheduler; a Connect
    session (no JVM gateway) reads the master URL, else :func:`default_parallelism`."""
    if not is_connect(spark):
        try:
            jsc = spark.sparkContext._jsc.sc()
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            return int(jsc.maxNumConcurrentTasks(profile))
        except Exception:  # noqa: BLE001 - a private API: fall back to what the master says
            pass
    url = master(spark)
    local = _LOCAL.fullmatch(url)
    if local and local[1] != "*":
        return int(local[1] or 1)
    cluster = _LOCAL_CLUSTER.fullmatch(url)
    cores = int(cluster[1]) * int(cluster[2]) if cluster else default_parallelism(spark)
    task_cpus = int(spark.conf.get("spark.task.cpus", None) or 1)
    return max(1, cores // task_cpus)


def route_address(host: str) -> str:
    """This machine's address on the route to ``host``: the interface a peer there most
    likely reaches it on. No packet is sent (connecting a UDP socket only picks the
    interface)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 15002, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(address)
        return s.getsockname()[0]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


__all__ = ["default_parallelism", "is_connect", "is_loopback", "master", "route_address",
           "task_slots"]


#: What :func:`local_session` sets unless given otherwise: few shuffle partitions (the
#: default 200 is for clusters), no web UI and no console progress bar (a job draws its
#: own: ``Job.run(progress=True)``), Arrow for pandas conversions, a moderate heap.
LOCAL_DEFAULTS = {
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.driver.memory": "2g",
}

#: Added for ``local[...]`` masters: bind the driver to the loopback interface, so a
#: machine whose hostname does not resolve still works.
LOOPBACK_DEFAULTS = {
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
}


def local_session(master: str = "local[2]", app_name: str = "sparkjet", **conf) -> SparkSession:
    """A Spark session on this machine (or the active one, as ``getOrCreate`` returns it).

    Finds a Java 17+ runtime and sets ``JAVA_HOME`` (:func:`sparkjet.spark.java.ensure_java`;
    raises :class:`~sparkjet.spark.java.JavaNotFoundError` with what to install when there is
    none), makes Python workers use this interpreter (``PYSPARK_PYTHON`` and
    ``PYSPARK_DRIVER_PYTHON``, unless already set), and applies :data:`LOCAL_DEFAULTS`
    (and, for a ``local`` master, :data:`LOOPBACK_DEFAULTS` and ``SPARK_LOCAL_IP`` unless
    set) overridden by ``conf``. Spark keys contain dots, so pass them unpacked::

        spark = local_session("local[4]", **{"spark.sql.shuffle.partitions": "16"})
    """
    ensure_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    settings = dict(LOCAL_DEFAULTS)
    if master.startswith("local"):
        settings.update(LOOPBACK_DEFAULTS)
        # Where Spark's launcher binds before it reads the configuration (it warns when the
        # hostname resolves to loopback, and picks another interface).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf)
    if not any("log4j" in str(v) for k, v in settings.items() if k.endswith("extraJavaOptions")):
        # Spark's JVM logs (a killed Python worker is an ERROR with a stack trace) go to a
        # file, not the user's terminal; sparkjet says what happened in its own errors.
        extra = settings.get("spark.driver.extraJavaOptions", "")
        settings["spark.driver.extraJavaOptions"] = (
            f"{extra} -Dlog4j2.configurationFile=file:{_log4j_config()}").strip()
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, _conf_value(value))
    from pyspark import SparkContext

    if SparkContext._gateway is not None:  # the JVM runs already: nothing to launch
        return builder.getOrCreate()
    # The JVM inherits this process's stderr: what it writes there before log4j takes over
    # (the JDK's "Using incubator modules" warning, Spark's "Setting default log level"
    # banner) and what its Python workers print go to the JVM's log file too.
    with _stderr_to(spark_log_path()):
        return builder.getOrCreate()


@contextlib.contextmanager
def _stderr_to(path: str):
    """File descriptor 2 sent to `path` (appended) inside the block, so a child process
    started there writes its stderr to the file; restored after."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


#: Where :func:`local_session` sends the JVM's log (``SPARKJET_SPARK_LOG`` overrides it).
def spark_log_path() -> str:
    """The file that Spark's JVM log goes to in sessions :func:`local_session` starts."""
    import tempfile

    return os.environ.get("SPARKJET_SPARK_LOG") or os.path.join(
        tempfile.gettempdir(), f"sparkjet-spark-{os.getpid()}.log")


def _log4j_config() -> str:
    """A log4j2 configuration sending every JVM log record (INFO and up) to
    :func:`spark_log_path` and none to the console; returns its path."""
    import tempfile

    log = spark_log_path()
    text = "\n".join([
        "status = error",
        "appender.file.type = File",
        "appender.file.name = file",
        f"appender.file.fileName = {log}",
        "appender.file.layout.type = PatternLayout",
        "appender.file.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex",
        "rootLogger.level = info",
        "rootLogger.appenderRef.file.ref = file",
        # the noisiest of Spark's own loggers, even in the file
        "logger.jetty.name = org.sparkproject.jetty",
        "logger.jetty.level = warn",
        "",
    ])
    fd, path = tempfile.mkstemp(prefix="sparkjet-log4j2-", suffix=".properties")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _conf_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
