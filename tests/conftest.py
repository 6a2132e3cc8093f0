"""Shared fixtures. Kept cheap to import: pyspark loads only when a test asks for ``spark``."""
import pytest


@pytest.fixture(scope="session")
def spark():
    """One local Spark session (``local[2]``) for the whole run, started by the first test
    that needs it and stopped at the end. Without Java 17+ the requesting tests fail with
    the message of :class:`sparkjet.spark.java.JavaNotFoundError` (never a silent skip)."""
    from sparkjet.spark import local_session
    from sparkjet.spark.java import JavaNotFoundError

    try:
        # A killed task's Python worker gets 60 s (not 2) before Spark kills it, so the
        # zombie test's stopped member outlives the restart; members that are not stopped
        # end by themselves as soon as their execution fails.
        session = local_session("local[2]", "sparkjet-tests",
                                **{"spark.python.task.killTimeout": "60s",
                                   "spark.ui.showConsoleProgress": "false"})
    except JavaNotFoundError as e:
        missing = f"JavaNotFoundError: {e}"
    else:
        yield session
        session.stop()
        return
    pytest.fail(missing, pytrace=False)


@pytest.fixture(scope="module")
def s3():
    """moto's S3 API on 127.0.0.1 (a free port) for one test module, with the bucket
    ``lake``; yields a pyarrow filesystem on it and its endpoint (tests/helpers/s3_server.py)."""
    pytest.importorskip("moto.server")
    from helpers import s3_server

    server, endpoint = s3_server.start()
    yield s3_server.s3_filesystem(endpoint), endpoint
    server.stop()


def pytest_collection_modifyitems(items):
    """Every test that asks for the Spark session is marked ``spark``, so that
    ``-m "not spark"`` selects the tests that need no JVM.

    The run is split over pytest-xdist's workers (``-n``, ``--dist loadgroup`` in
    pyproject.toml) by groups: the tests marked ``spark`` all go to one worker, so a run
    still starts one Spark session; the nemesis and standalone-cluster tests of
    ``tests/testing/`` (network namespaces, mounts, root-wide tables) go to one worker, one
    after the other, as they ran before; every other test goes where a worker is free."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)
        if item.get_closest_marker("spark") is not None:
            item.add_marker(pytest.mark.xdist_group("spark"))
        elif item.path.parent.name == "testing":
            item.add_marker(pytest.mark.xdist_group("host"))
