"""Sources and sinks, one module (or package) per external system, and the contracts they
implement (:mod:`~sparkjet.connectors.base`, re-exported here).

=====================  ==================================================================
module                 what
=====================  ==================================================================
``base``               the :class:`Source` / :class:`Sink` contracts and their contexts
``generator``          deterministic events, replayable by offset
``nexmark``            NEXMark's persons, auctions and bids (``source``; ``events``: the model)
``arrow_log``          a partitioned append-only log of Arrow IPC files
``files``              directories of Parquet/CSV/JSON lines (``source``), transactional
                       Parquet/Arrow files (``sink``)
``dataframe``          a bounded Spark DataFrame, materialised once on the driver
``kafka``              Kafka topics: ``source``, ``sink``, and ``client`` (what both need
                       of confluent-kafka: settings, errors, the topic check)
``redis``              Redis Streams, an acknowledging source
``postgres``           PostgreSQL, two-phase commit or upserts
``delta``              Delta Lake tables
``sqlite``             SQLite upserts
``discard``            keeps nothing (benchmarks)
``_staging``           rows staged per snapshot until phase 2 (Kafka and Delta)
``_prepared``          what every transactional writer checks of phase 1 (snapshot ids
                       grow, the format of a restored description)
``_upsert``            the buffered upsert writer (SQLite, PostgreSQL's upsert mode)
``_settings``          each connector's arguments as a typed, checked settings dataclass
=====================  ==================================================================

Users import them from :mod:`sparkjet.sources` and :mod:`sparkjet.sinks`; importing this
package loads only the contracts, never a client library.
"""
from sparkjet.connectors.base import (
    GUARANTEES,
    DriverContext,
    ProcessorContext,
    Sink,
    SinkWriter,
    Source,
    SourceReader,
)

__all__ = ["GUARANTEES", "DriverContext", "ProcessorContext", "Sink", "SinkWriter", "Source",
           "SourceReader"]
