"""The ``sparkjet`` command, run as a user runs it: ``python -m sparkjet`` in a subprocess."""
import os
import re
import subprocess
import sys

import pytest


def sparkjet(*args, timeout=60, env=None):
    return subprocess.run(
        [sys.executable, "-m", "sparkjet", *args],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )


def test_help_lists_the_commands():
    done = sparkjet("--help")
    assert done.returncode == 0, done.stderr
    assert "demo" in done.stdout


def test_demo_help_lists_every_option():
    done = sparkjet("partition-demo", "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--rows", "--partitions", "--master", "--key-type", "--keys", "--rounds"):
        assert option in done.stdout
    assert "10,000,000" in done.stdout and "271" in done.stdout and "local[2]" in done.stdout


def test_bad_option_is_a_usage_error():
    done = sparkjet("partition-demo", "--rows", "0")
    assert done.returncode == 2
    assert "--rows" in done.stderr and "at least 1" in done.stderr


@pytest.mark.parametrize("argv, says", [
    ((), "give a command"),
    (("nope",), "invalid choice"),
    (("partition-demo", "--rows", "x"), "--rows: not an integer"),
    (("demo", "--interval", "nan"), "--interval: must be a finite number"),
    (("snapshots", "show", "/nonexistent/sparkjet", "--job", "1"), "does not exist"),
    (("snapshots", "list", "bogus://x"), "cannot open 'bogus://x'"),
])
def test_bad_arguments_and_missing_paths_give_one_line_and_exit_2(argv, says):
    done = sparkjet(*argv)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_demo_refuses_a_file_as_its_directory(tmp_path):
    (tmp_path / "f").write_text("")
    done = sparkjet("demo", "--dir", str(tmp_path / "f"), "--crashes", "0")
    assert done.returncode == 2 and "is not a directory" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_without_java_one_line_and_exit_code_2(tmp_path):
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}
    done = sparkjet("partition-demo", "--rows", "10", env=env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparkjet partition-demo: error: JAVA_HOME is")
    assert "openjdk-17-jre-headless" in lines[0]


@pytest.mark.spark
def test_demo_prints_the_histogram_and_the_speed():
    rows = 20_000
    done = sparkjet("partition-demo", "--rows", str(rows), "--partitions", "31", "--rounds", "1",
                    timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    total = re.search(r"^\s+histogram total\s+([\d,]+) rows$", out, re.MULTILINE)
    assert total and int(total.group(1).replace(",", "")) == rows, out
    for label in ("rows", "partition_count", "members / backups", "session start",
                  "Spark alone", "Arrow round trip to Python", "with_partition_id",
                  "partitioning cost", "min / max", "mean / stddev", "partitions with rows",
                  "fullest 5", "emptiest 5", "per key", "throughput"):
        assert re.search(rf"^\s+{re.escape(label)}\s", out, re.MULTILINE), f"no {label!r} in\n{out}"
    assert re.search(r"^\s+partition_count\s+31$", out, re.MULTILINE)
    assert re.search(r"^\s+partitions with rows\s+31 of 31$", out, re.MULTILINE)
    # The load buckets count every partition once.
    buckets = re.findall(r"^\s+[\d,]+ - [\d,]+\s+(\d+)\s", out, re.MULTILINE)
    assert sum(map(int, buckets)) == 31, out
    assert re.search(r"[\d.]+ ns/key", out)


@pytest.mark.spark
def test_demo_string_keys_and_histogram(spark):
    """The demo's string keys, on the shared session (a second demo JVM would cost ~10 s)."""
    from sparkjet import partition_ids
    from sparkjet.cli import main as cli

    frame = cli._key_frame(spark, 3_000, 1_000, "string")
    keys = frame.toArrow().sort_by("id").column("key")
    assert keys[:3].to_pylist() == [f"key-{i * 2654435761 % 1_000}" for i in range(3)]
    assert len(set(keys.to_pylist())) == 1_000
    loads = cli._histogram(frame, 31)
    assert sum(loads) == 3_000
    ids = partition_ids(keys, 31).to_pylist()
    assert loads == [ids.count(p) for p in range(31)]
    assert cli._time_driver(3_000, 1_000, 31, "string") > 0


def test_main_demo_help_documents_every_option():
    done = sparkjet("demo", "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--members", "--master", "--guarantee", "--interval", "--rate", "--duration",
                   "--keys", "--crashes", "--seed", "--dir"):
        assert option in done.stdout
    assert "exactly-once" in done.stdout and "SIGKILL" in done.stdout


def test_main_demo_bad_options_are_usage_errors(tmp_path):
    assert sparkjet("demo", "--members", "0").returncode == 2
    done = sparkjet("demo", "--guarantee", "twice")
    assert done.returncode == 2 and "--guarantee" in done.stderr
    done = sparkjet("demo", "--master", "spark://10.0.0.1:7077")
    assert done.returncode == 2 and "--crashes needs a local master" in done.stderr
    (tmp_path / "x").write_text("")
    done = sparkjet("demo", "--dir", str(tmp_path), "--duration", "1")
    assert done.returncode == 2 and "not empty" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.spark
def test_main_demo_crashes_and_checks(tmp_path):
    """The README's main command, small: two members, one SIGKILL, exactly-once verdict."""
    done = sparkjet("demo", "--duration", "5", "--rate", "200000", "--keys", "5000",
                    "--crashes", "1", "--interval", "0.5", "--dir", str(tmp_path / "w"), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"crashes \(SIGKILL\)\s+1: member \d \(pid \d+\)", out), out
    assert re.search(r"executions\s+2 \(members 2/2\), 1 restart", out), out
    assert re.search(r"lost 0, duplicated 0, unexpected 0, mismatched 0 -> VALID", out), out
    assert re.search(r"events in\s+1,000,000 ", out), out
    for label in ("throughput", "latency to committed output", "snapshots", "recovery"):
        assert re.search(rf"^\s+{label}\s", out, re.MULTILINE), f"no {label!r} in\n{out}"
