"""Event-time window definitions for ``Pipeline.window(...)`` and ``group_by(...).window(...)``
(defined in :mod:`sparkjet.operators.windows.definitions`).

>>> from sparkjet.windows import tumbling, sliding, session
>>> tumbling(60_000)                     # [0, 60000), [60000, 120000), ... in the column's unit
Tumbling(size=60000)
"""
from sparkjet.operators.windows.definitions import (
    Session,
    Sliding,
    Tumbling,
    UserAggregation,
    WindowDefinition,
    session,
    sliding,
    tumbling,
    user_aggregation,
)

__all__ = ["Session", "Sliding", "Tumbling", "UserAggregation", "WindowDefinition", "session",
           "sliding", "tumbling", "user_aggregation"]
