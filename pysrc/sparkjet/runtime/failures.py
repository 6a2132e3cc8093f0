"""What a failed execution tells its supervisor: the error with its type and full
traceback, and whether a replay would repeat it.

A restart replays the input from the last snapshot. That cures a lost member, a killed
process or an unreachable peer; it cannot cure a bad record, a schema violation or a bug in
a user function, which fail again on the same input, seconds of backoff later, until
``max_restarts`` is spent. So an error says whether it is *deterministic* (its class has
``deterministic = True``, or one of its causes has: sparkjet's errors about the data and the
arguments), and the restart policy (:func:`~sparkjet.runtime.supervision.restart_or_fail`)
does not retry those. An exception of the user's own code is not known to be either: it is
retried once, and the job fails if the replay ends in the same error.
"""
from __future__ import annotations

import traceback

#: How much of a traceback an error message carries (the member's log has all of it).
MAX_TRACEBACK = 6000


def is_deterministic(error: BaseException | None) -> bool:
    """True when ``error`` or one of its causes says a replay would repeat it."""
    seen = set()
    while error is not None and id(error) not in seen:
        if getattr(error, "deterministic", False):
            return True
        seen.add(id(error))
        error = error.__cause__
    return False


def report(error: BaseException) -> dict:
    """A failure as plain data: ``error`` ("Type: message"), ``traceback`` and
    ``deterministic``."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    if len(text) > MAX_TRACEBACK:
        text = "...\n" + text[-MAX_TRACEBACK:]
    return {"error": f"{type(error).__name__}: {error}", "traceback": text,
            "deterministic": is_deterministic(error), "exception": True}


__all__ = ["MAX_TRACEBACK", "is_deterministic", "report"]
