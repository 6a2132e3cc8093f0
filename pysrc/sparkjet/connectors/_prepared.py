"""What every transactional sink's writer checks about phase 1 (the file, Kafka, PostgreSQL and
Delta Lake sinks): snapshot ids grow from one :meth:`~sparkjet.connectors.base.SinkWriter.prepare`
to the next, and the description a restored snapshot hands back to
:meth:`~sparkjet.connectors.base.SinkWriter.recover` has the format the writer writes."""
from __future__ import annotations

from sparkjet.errors import InvalidArgumentError


def check_next_snapshot(snapshot_id: int, last_prepared: int | None) -> None:
    """Refuses a :meth:`prepare` whose snapshot id does not exceed the last one's."""
    if last_prepared is not None and snapshot_id <= last_prepared:
        raise InvalidArgumentError(
            f"prepare({snapshot_id}) after prepare({last_prepared}): snapshot ids must grow")


def prepared_transactions(prepared: dict | None, expected_format: int,
                          what: str | None = None) -> list:
    """The ``transactions`` of the description ``prepared`` (None: no snapshot, none),
    once its ``format`` is ``expected_format``; otherwise InvalidArgumentError, its
    message starting with ``what`` (the writer, as errors name it) if given. Every
    description a writer returns has ``transactions`` (a merge of several keeps it)."""
    if prepared is None:
        return []
    if prepared.get("format") != expected_format:
        raise InvalidArgumentError(
            (f"{what}: " if what else "") + f"prepared state has format "
            f"{prepared.get('format')!r}, expected {expected_format}")
    return list(prepared["transactions"])
