"""What keyed stages compute, one module each, behind the two contracts of
:mod:`~sparkjet.operators.base` (:class:`~sparkjet.operators.base.OperatorStage`, what a
pipeline holds, and :class:`~sparkjet.operators.base.Operator`, what a processor runs).

- :mod:`~sparkjet.operators.rolling`: rolling count/sum/min/max/mean per key.
- :mod:`~sparkjet.operators.windows`: tumbling, sliding and session windows.
- :mod:`~sparkjet.operators.stateful`: ``map_state`` and ``map_stateful``, keyed state of the
  user's own, over :mod:`~sparkjet.operators.state_store`.
- :mod:`~sparkjet.operators.dedup`: ``deduplicate``.
- :mod:`~sparkjet.operators.interval_join`: the stream-to-stream join.
- :mod:`~sparkjet.operators.table_join`: the stream-to-table join (a stateless stage).
- :mod:`~sparkjet.operators.groups`: dense slots of composite keys over the native group map.
- :mod:`~sparkjet.operators.time`: event time as operators read it.
"""
