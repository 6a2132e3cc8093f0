"""One PyFlink run of the end-to-end benchmark, started by ``streaming_competitors.py`` with
the interpreter of ``bench/.flink-venv`` (never imported: pyflink is not in sparkjet's
environment).

Table API on a local mini-cluster: a bounded CSV source of (id, key, value), per key
``COUNT(id)`` and ``SUM(value)`` emitting updates, ``blackhole`` sink; hashmap state,
exactly-once checkpoints every ``--interval-ms`` into ``--checkpoint-dir`` (or none), and
optionally a restore from a retained checkpoint. The REST API listens on ``--rest-port`` so
that the parent can follow checkpoints and kill this process at a chosen moment.

Prints one JSON object a line on stdout: ``started`` (JVM and table environment up),
``submitted`` (job id), then ``done`` (times) or ``failed``.
"""
import argparse
import json
import sys
import time


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv-dir", required=True)
    parser.add_argument("--checkpoint-dir", help="checkpoints are off without it")
    parser.add_argument("--interval-ms", type=int, default=1000)
    parser.add_argument("--restore-from", help="a retained checkpoint (chk-N folder) to start from")
    parser.add_argument("--rest-port", type=int, required=True)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--latency-interval-ms", type=int, default=0,
                        help="emit Flink latency markers this often (0: off)")
    args = parser.parse_args()

    jvm_start = time.time()
    from pyflink.common import Configuration
    from pyflink.table import EnvironmentSettings, TableEnvironment

    config = Configuration()
    config.set_string("parallelism.default", str(args.parallelism))
    config.set_string("rest.bind-address", "127.0.0.1")
    config.set_string("rest.address", "127.0.0.1")
    config.set_string("rest.port", str(args.rest_port))
    config.set_string("state.backend.type", "hashmap")
    if args.checkpoint_dir:
        config.set_string("execution.checkpointing.interval", f"{args.interval_ms} ms")
        config.set_string("execution.checkpointing.mode", "EXACTLY_ONCE")
        config.set_string("execution.checkpointing.dir", "file://" + args.checkpoint_dir)
        # Retained checkpoints are not deleted when the job fails or is cancelled, so a later
        # run can restore from one (a job that finishes still deletes its own).
        config.set_string("execution.checkpointing.externalized-checkpoint-retention",
                          "RETAIN_ON_CANCELLATION")
    if args.restore_from:
        config.set_string("execution.state-recovery.path", "file://" + args.restore_from)
    if args.latency_interval_ms:
        config.set_string("metrics.latency.interval", str(args.latency_interval_ms))
        # Every marker of the run stays in the histograms (the default keeps the last 128).
        config.set_string("metrics.latency.history-size", "100000")
    # The parent reads progress and latency from the REST API: refresh it every second.
    config.set_string("metrics.fetcher.update-interval", "1000")
    t_env = TableEnvironment.create(
        EnvironmentSettings.new_instance().in_streaming_mode().with_configuration(config).build())
    emit("started", jvm_start=jvm_start)

    t_env.execute_sql(f"""
        CREATE TABLE events (id BIGINT, `key` BIGINT, `value` DOUBLE)
        WITH ('connector' = 'filesystem', 'path' = 'file://{args.csv_dir}', 'format' = 'csv')""")
    t_env.execute_sql("""
        CREATE TABLE totals (`key` BIGINT, n BIGINT, total DOUBLE)
        WITH ('connector' = 'blackhole')""")
    # No other thread may start before this first job is submitted: PyFlink's planner then
    # fails with a NullPointerException.
    submit = time.time()
    result = t_env.execute_sql(
        "INSERT INTO totals SELECT `key`, COUNT(id), SUM(`value`) FROM events GROUP BY `key`")
    client = result.get_job_client()
    emit("submitted", job_id=str(client.get_job_id()), submit=submit)
    try:
        result.wait()
    except Exception as e:  # noqa: BLE001 (py4j wraps whatever the job failed with)
        emit("failed", error=str(e).splitlines()[0][:500])
        sys.exit(1)
    done = time.time()
    emit("done", jvm_start=jvm_start, submit=submit, done=done)


if __name__ == "__main__":
    main()
