"""Pipelines as a user writes them, and the DAG they run as.

- :mod:`~sparkjet.pipeline.builder`: :class:`Pipeline`, the fluent API (sources, stateless
  stages, event time, keyed and windowed aggregations, keyed state, deduplication, joins,
  unions, sinks).
- :mod:`~sparkjet.pipeline.stages`: the stateless stages, the nodes a pipeline is made of, and
  where a stream's event time is (:func:`~sparkjet.pipeline.stages.event_time_of`).
- :mod:`~sparkjet.pipeline.dag`: the DAG a pipeline compiles to: vertices, the paths of fused
  stages, edges, names and the fingerprint a snapshot records.

The keyed stages and what they compute are in :mod:`sparkjet.operators`.
"""
from sparkjet.operators.table_join import ReferenceTable
from sparkjet.pipeline.builder import GroupBy, Pipeline, Windowed

__all__ = ["GroupBy", "Pipeline", "ReferenceTable", "Windowed"]
