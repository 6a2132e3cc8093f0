"""Failures told apart by kind (sparkjet.runtime.failures), with the errors the real client
libraries raise against a port nothing listens on, and the restart policy that follows
from the kind (sparkjet.runtime.supervision.restart_or_fail): an outage is retried within
max_restarts per restart_window however often it repeats, an error about the data ends the
job at once, an error of unknown kind is retried once."""
from __future__ import annotations

import errno
import socket
import time

import pytest

from sparkjet.errors import (
    ConnectorError,
    ExecutionFailedError,
    InvalidArgumentError,
    JobFailedError,
    NullKeyError,
)
from sparkjet.runtime import JobConfig
from sparkjet.runtime.failures import report, transient_kind
from sparkjet.runtime.supervision import JobResult, restart_or_fail


@pytest.fixture
def closed_port():
    """A loopback port nothing listens on (bound, not listening, while the test runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def raised(call) -> BaseException:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the error is what is tested
        return e
    raise AssertionError("no error")


def test_postgres_unreachable_is_transient_through_the_sink(closed_port):
    pytest.importorskip("psycopg")
    from sparkjet.connectors.base import ProcessorContext
    from sparkjet.sinks import PostgresSink

    sink = PostgresSink(f"host=127.0.0.1 port={closed_port} user=u password=p dbname=d "
                        "connect_timeout=2", "t")
    e = raised(lambda: sink.open(ProcessorContext(1, 1, "sink", 0, 1, "exactly-once")))
    assert isinstance(e, ConnectorError)
    assert transient_kind(e) == "connection refused"
    assert report(e)["transient"] == "connection refused" and not report(e)["deterministic"]


def test_postgres_sqlstates_by_kind():
    psycopg = pytest.importorskip("psycopg")
    from psycopg import errors

    assert transient_kind(errors.SerializationFailure()) == "serialization failure"
    assert transient_kind(errors.DeadlockDetected()) == "deadlock"
    assert transient_kind(errors.AdminShutdown()) == "server shutting down"
    assert transient_kind(errors.CannotConnectNow()) == "server starting up"
    assert transient_kind(errors.ConnectionFailure()) == "connection failure"   # 08006
    # about the data: never transient
    assert transient_kind(errors.NumericValueOutOfRange()) is None
    assert transient_kind(errors.UniqueViolation()) is None
    assert transient_kind(psycopg.OperationalError(
        'connection failed: FATAL:  password authentication failed for user "u"')) is None


def test_redis_unreachable_is_transient(closed_port):
    redis = pytest.importorskip("redis")
    client = redis.Redis(port=closed_port, socket_connect_timeout=1)
    assert transient_kind(raised(client.ping)) == "connection refused"
    assert transient_kind(redis.exceptions.BusyLoadingError("loading")) == "server loading"
    assert transient_kind(redis.exceptions.AuthenticationError("bad password")) is None
    assert transient_kind(redis.exceptions.ResponseError("WRONGTYPE")) is None


def test_s3_unreachable_and_5xx_are_transient(closed_port):
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config
    from botocore.exceptions import ClientError

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{closed_port}",
                          aws_access_key_id="x", aws_secret_access_key="x",
                          region_name="us-east-1",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=1))
    assert transient_kind(raised(client.list_buckets)) == "connection failed"
    slow = ClientError({"Error": {"Code": "SlowDown"},
                        "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    assert transient_kind(slow) == "S3 throttling (503)"
    denied = ClientError({"Error": {"Code": "AccessDenied"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")
    assert transient_kind(denied) is None


def test_pyarrow_s3_unreachable_is_transient(closed_port):
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{closed_port}", scheme="http",
                           access_key="x", secret_key="x", region="us-east-1",
                           connect_timeout=1, request_timeout=1,
                           retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    e = raised(lambda: fs.get_file_info("bucket/key"))
    assert isinstance(e, OSError) and transient_kind(e) == "connection failed", str(e)


def test_kafka_unreachable_is_transient_through_the_connector(closed_port):
    pytest.importorskip("confluent_kafka")
    from sparkjet.connectors.kafka.client import partitions_of

    e = raised(lambda: partitions_of("t", f"127.0.0.1:{closed_port}", 1.0, "Kafka sink"))
    assert isinstance(e, ConnectorError)
    assert transient_kind(e) in {"connection lost", "timeout", "brokers down"}, repr(e)


def test_os_errors_and_what_is_never_transient():
    assert transient_kind(ConnectionRefusedError()) == "connection refused"
    assert transient_kind(ConnectionResetError()) == "connection reset"
    assert transient_kind(TimeoutError()) == "timeout"
    assert transient_kind(ValueError("a bug of the user's")) is None
    # found by the nemesis long run: two disk-full episodes in one job were taken for the
    # same failure twice and ended it; a full disk is an outage (space is freed), a
    # read-only one is not
    full = OSError(errno.ENOSPC, "No space left on device")
    assert transient_kind(full) == "disk full"
    assert transient_kind(OSError(errno.EDQUOT, "Disk quota exceeded")) == "disk quota exceeded"
    assert transient_kind(OSError(errno.EROFS, "Read-only file system")) is None
    assert report(full)["transient"] == "disk full" and not report(full)["deterministic"]
    # an error about the data wins over an outage anywhere in the chain
    try:
        try:
            raise ConnectionRefusedError()
        except ConnectionRefusedError:
            raise NullKeyError("key has a null", 3) from None
    except NullKeyError as e:
        assert transient_kind(e) is None and report(e)["deterministic"]
    wrapped = ConnectorError("sink: bad row")
    wrapped.__cause__ = InvalidArgumentError("column 'x': not an int")
    assert transient_kind(wrapped) is None
    # the member's verdict travels with the execution's failure (Spark)
    failed = ExecutionFailedError("member 0 failed", {"transient": "connection refused"})
    assert transient_kind(failed) == "connection refused"


def test_a_delta_write_on_a_full_disk_is_an_outage(tmp_path):
    """Found by the nemesis long run (round 94): a disk-full fault under the Delta sink
    ended the job, "8 times the same way": deltalake's DeltaError carries no errno, only
    Rust's "(os error 28)" in its text, so the sink's ConnectorError was of unknown kind.
    A real write into a full tmpfs is now a disk-full outage."""
    import os

    import deltalake as dl
    import pyarrow as pa
    from helpers import mounts

    root = tmp_path / "full"
    with mounts.tmpfs(root, size="256k"):
        (root / "filler").write_bytes(b"x" * (200 << 10))
        try:
            try:
                dl.write_deltalake(str(root / "t"), pa.table({"a": pa.array(os.urandom(400_000))}))
            except dl.exceptions.DeltaError as e:   # as the Delta sink translates it
                raise ConnectorError(f"Delta Lake sink: cannot write the table: {e}") from None
        except ConnectorError as e:
            error = e
        else:
            raise AssertionError("the write into a full tmpfs succeeded")
    assert "os error 28" in str(error)
    assert transient_kind(error) == "disk full" and not report(error)["deterministic"]
    assert transient_kind(RuntimeError("Read-only file system (os error 30)")) is None
    assert transient_kind(RuntimeError("Connection refused (os error 111)")) \
        == "connection refused"


# -- the policy --------------------------------------------------------------------------------

def outcome(kind: str | None, cause: str = "ConnectorError: cannot connect") -> dict:
    return {"status": "failed", "error": cause, "cause": cause, "exception": True,
            "deterministic": False, "transient": kind}


def fail_repeatedly(config: JobConfig, kind: str | None, times: int, events: list) -> int:
    """Feeds the policy `times` identical failures; returns how many it restarted."""
    result = JobResult(config.id)
    for attempt in range(1, times + 1):
        result.executions.append(outcome(kind))
        try:
            restart_or_fail(config, result, attempt, outcome(kind), events.append,
                            time.monotonic())
        except JobFailedError:
            return result.restarts
    return result.restarts


def test_an_outage_is_retried_within_max_restarts_however_often_it_repeats():
    config = JobConfig(processing_guarantee="none", max_restarts=5, restart_backoff=0.0)
    events = []
    assert fail_repeatedly(config, "connection refused", 10, events) == 5
    assert [e["restart"] for e in events] == [1, 2, 3, 4, 5]
    assert events[0]["message"] == ("transient: connection refused, retrying in 0 s "
                                    "(restart 1 of 5, window 600 s)")
    # the same failure of unknown kind: one replay, then the job fails
    assert fail_repeatedly(config, None, 10, []) == 1


def test_failures_older_than_the_restart_window_do_not_count():
    config = JobConfig(processing_guarantee="none", max_restarts=2, restart_backoff=0.0,
                       restart_window=60.0)
    result = JobResult(config.id)
    result.failure_times += [time.monotonic() - 1000.0] * 5   # long ago
    events = []
    result.executions.append(outcome("timeout"))
    restart_or_fail(config, result, 6, outcome("timeout"), events.append, time.monotonic())
    assert events[-1]["restart"] == 1
    whole_run = JobConfig(processing_guarantee="none", max_restarts=2, restart_backoff=0.0,
                          restart_window=None)
    result.failure_times = result.failure_times[:5]
    with pytest.raises(JobFailedError, match=r"failed 6 times \(max_restarts=2\)"):
        restart_or_fail(whole_run, result, 6, outcome("timeout"), events.append,
                        time.monotonic())


def test_restart_window_is_checked():
    with pytest.raises(InvalidArgumentError, match="restart_window"):
        JobConfig(processing_guarantee="none", restart_window=0)
