"""What sparkjet asks of a Spark session, answered alike for a classic session and a Spark
Connect one (``SparkSession.builder.remote("sc://...")``, what Databricks serverless and
shared clusters give): a Connect session has no ``sparkContext`` and no JVM gateway, only
the DataFrame API, the session's configuration (``spark.conf``) and its tags."""
from __future__ import annotations

import ipaddress
import re
import socket
import sys

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
