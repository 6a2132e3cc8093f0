"""pytest glue for the benchmarks: collect ``bench_*.py`` and print their summary tables.

The project's pytest settings collect ``test_*.py`` under ``tests/`` only, so CI never runs
a benchmark; ``python -m pytest bench/ --benchmark-only`` still finds these files.
"""
from fnmatch import fnmatch

import pytest

_SUMMARIES = pytest.StashKey[list]()


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` here, unless pytest already does (the file was named on the
    command line, or ``python_files`` matches it): collecting twice would run it twice."""
    if not fnmatch(file_path.name, "bench_*.py") or parent.session.isinitpath(file_path):
        return None
    if any(fnmatch(file_path.name, p) for p in parent.config.getini("python_files")):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


@pytest.fixture(scope="session")
def bench_summaries(pytestconfig) -> list[str]:
    """Summary texts a benchmark module adds; printed after the run, uncaptured."""
    return pytestconfig.stash.setdefault(_SUMMARIES, [])


def pytest_terminal_summary(terminalreporter, config):
    for text in config.stash.get(_SUMMARIES, []):
        terminalreporter.write_sep("=", "summary (medians; see bench/README.md)")
        terminalreporter.write_line(text)
