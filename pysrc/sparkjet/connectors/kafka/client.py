"""What the Kafka source and sink both need of ``confluent-kafka``: the module itself, the
client settings they share, librdkafka's words for a failed call, and the check that a topic
exists (asked without creating it).

Needs ``confluent-kafka`` (``pip install 'sparkjet[kafka]'``), loaded when first used.
"""
from __future__ import annotations

import collections
import logging
import re

from sparkjet.errors import ConnectorError

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

#: Where librdkafka's own log lines go, at DEBUG: a broker that is down makes it log every
#: connection attempt (about a hundred lines in five seconds), which belongs in the one error.
CLIENT_LOG = logging.getLogger(__name__)


class ClientLog:
    """A client's librdkafka log (its ``logger`` setting): each line to :data:`CLIENT_LOG`
    at DEBUG, the last few distinct ones kept for the error that ends the wait."""

    def __init__(self, keep: int = 3):
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._keep = keep

    #: What differs between two lines that say the same: the thread, the time it took.
    _NOISE = re.compile(r"\[thrd:[^\]]*\]: | \((?:after \d+ms in state \w+)?(?:, )?"
                        r"(?:\d+ identical error\(s\) suppressed)?\)")

    def log(self, level: int, fmt: str, *args) -> None:
        line = fmt % args if args else fmt
        CLIENT_LOG.debug("%s", line)
        line = self._NOISE.sub("", line)
        self._recent.pop(line, None)
        self._recent[line] = None
        while len(self._recent) > self._keep:
            self._recent.popitem(last=False)

    def recent(self) -> str:
        """The last distinct lines, for an error message ("" if none)."""
        if not self._recent:
            return ""
        return "; the client logged: " + " | ".join(self._recent)


def kafka_module():
    """``confluent_kafka``, or an ImportError that says how to install it."""
    try:
        import confluent_kafka
    except ImportError:
        raise ImportError(
            "Kafka sources and sinks need confluent-kafka: pip install 'sparkjet[kafka]'"
        ) from None
    return confluent_kafka


def client_config(bootstrap_servers: str, timeout: float, extra: dict | None) -> dict:
    """librdkafka settings shared by consumers and producers: connection attempts bounded by
    ``timeout`` so an unreachable broker is an error, not a hang."""
    ms = max(1000, int(timeout * 1000))
    config = {"bootstrap.servers": bootstrap_servers,
              "socket.connection.setup.timeout.ms": ms,
              "socket.timeout.ms": max(ms, 10_000),
              "client.id": "sparkjet",
              "logger": ClientLog()}
    config.update(extra or {})
    return config


def kafka_error(e: Exception):
    """The ``KafkaError`` a failed call raised (a ``KafkaException``'s first argument), or
    None if ``e`` carries none."""
    return e.args[0] if e.args and hasattr(e.args[0], "code") else None


def error_text(e: Exception) -> str:
    """librdkafka's words for a failed call (its ``KafkaError``'s text), else the
    exception's."""
    err = kafka_error(e)
    return err.str() if err is not None else str(e)


def topic_partitions(client, topic: str, timeout: float, connector: str,
                     bootstrap_servers: str, log: ClientLog | None = None) -> list[int]:
    """The partition ids of `topic`, through any client's ``list_topics``; ConnectorError
    (naming the connector, with the last lines of the client's `log`) if the broker is
    unreachable or the topic does not exist."""
    kafka = kafka_module()
    try:
        metadata = client.list_topics(topic, timeout=timeout)
    except kafka.KafkaException as e:
        if isinstance(log, ClientLog):
            client.poll(0)  # serves the log lines queued while it waited
        raise ConnectorError(
            f"{connector} for topic {topic!r}: cannot reach the broker(s) at "
            f"{bootstrap_servers} within {timeout:g} s: {error_text(e)}"
            f"{log.recent() if isinstance(log, ClientLog) else ''}") from None
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        why = found.error.str() if found is not None and found.error is not None else "no partitions"
        raise ConnectorError(
            f"{connector}: topic {topic!r} is not usable at {bootstrap_servers}: {why}")
    return sorted(found.partitions)


def partitions_of(topic: str, bootstrap_servers: str, timeout: float, connector: str,
                  config: dict | None = None) -> list[int]:
    """The partition ids of `topic` (see :func:`topic_partitions`), asked by a consumer:
    a consumer's metadata request never creates the topic (a producer's or an admin
    client's may, where the broker auto-creates topics)."""
    kafka = kafka_module()
    settings = {**client_config(bootstrap_servers, timeout, config), "group.id": "sparkjet-metadata"}
    consumer = kafka.Consumer(settings)
    try:
        return topic_partitions(consumer, topic, timeout, connector, bootstrap_servers,
                                settings.get("logger"))
    finally:
        consumer.close()
