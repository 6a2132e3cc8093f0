"""Memory advice for a bulk rebuild.

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every array
of 4 MB or more. Where the kernel then compacts memory at the fault to find 2 MB of
contiguous pages (``/sys/kernel/mm/transparent_hugepage/defrag`` at ``madvise``, the default
of most distributions), a process's first large allocations wait for that compaction: the
first 24M-key rebuild of a fresh process took 3.10-3.85 s against 1.46-1.94 s with the
advice off, and later rebuilds were no faster with it (``bench/README.md``, session 25). A
member restarted after a failure is such a process. :func:`small_pages` turns the advice
off around a rebuild and back on after it, counting overlapping users (two processors of a
member rebuild at once). The setting is the process's: while a rebuild runs, the arrays
other threads make go without the advice too; outside rebuilds numpy's setting is as it
was (one changed by other code during a rebuild is put back as it was before it).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:     # numpy 1.x
    try:
        from numpy.core.multiarray import _set_madvise_hugepage
    except ImportError:
        _set_madvise_hugepage = None

_lock = threading.Lock()
_users = 0
_before = True


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """numpy's large arrays made in the block (on any thread) without the huge page advice;
    numpy's own setting is put back once the last overlapping block ends."""
    global _users, _before
    if _set_madvise_hugepage is None:
        yield
        return
    with _lock:
        if _users == 0:
            _before = _set_madvise_hugepage(False)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _set_madvise_hugepage(_before)
