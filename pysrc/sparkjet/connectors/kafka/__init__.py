"""Kafka topics with ``confluent-kafka``: :mod:`~sparkjet.connectors.kafka.source` (a
replayable source), :mod:`~sparkjet.connectors.kafka.sink` (an exactly-once sink) and
:mod:`~sparkjet.connectors.kafka.client`, what both need of the client library."""
