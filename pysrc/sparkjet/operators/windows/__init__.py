"""Event-time windows: :mod:`~sparkjet.operators.windows.definitions` (``tumbling``,
``sliding``, ``session``, user aggregations), :mod:`~sparkjet.operators.windows.operator` (the
stage and one processor's windowed aggregation), :mod:`~sparkjet.operators.windows.panes`
(panes and their partial aggregates), :mod:`~sparkjet.operators.windows.sessions` (each key's
open sessions). Users import the definitions from :mod:`sparkjet.windows`."""
