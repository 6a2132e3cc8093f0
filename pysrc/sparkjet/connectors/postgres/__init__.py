"""PostgreSQL sinks, in two modes: transactional (two-phase commit with ``PREPARE
TRANSACTION``, exactly-once) and idempotent upserts by key. Rows go in with ``COPY ... FROM
STDIN (FORMAT csv)``, the CSV written by Arrow's C++ writer (no Python loop over rows).

**Tables.** A missing table is created from the first batch's schema (upsert mode: key
columns ``NOT NULL`` and the ``PRIMARY KEY``), and the Arrow schema is kept in
``_sparkjet_tables`` so that :meth:`PostgresSink.read` returns the types that were written.
An existing table must have a column of a compatible type for every column of the batches
(and, for upserts, a primary key or unique index on exactly the key columns); otherwise the
writer refuses with an error naming the column. The server needs
``max_prepared_transactions`` > 0 for the transactional mode under exactly-once (the
PostgreSQL default is 0), and two connections per sink processor (data and control). Two
sinks of one job must not write one table.

=================  ========================================================================
module             what
=================  ========================================================================
``sink``           :class:`PostgresSink`: its settings, ``read`` and ``drop``
``transactional``  :class:`PostgresTransactionalWriter`: two-phase commit (exactly-once)
``upsert``         :class:`PostgresUpsertWriter`: idempotent upserts by key
``writer``         what both writers share: connections, the fence, the table, ``COPY``
``columns``        Arrow and PostgreSQL types, ``COPY``'s CSV, the catalog, reading back
``connection``     connecting, and PostgreSQL's errors as sparkjet's (never a password)
=================  ========================================================================
"""
from sparkjet.connectors.postgres.connection import CONNECTOR
from sparkjet.connectors.postgres.sink import MODES, PostgresSink
from sparkjet.connectors.postgres.transactional import (
    DESCRIPTION_FORMAT,
    PostgresTransactionalWriter,
)
from sparkjet.connectors.postgres.upsert import PostgresUpsertWriter

__all__ = ["CONNECTOR", "DESCRIPTION_FORMAT", "MODES", "PostgresSink",
           "PostgresTransactionalWriter", "PostgresUpsertWriter"]
