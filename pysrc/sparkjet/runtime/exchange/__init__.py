"""The transport between members, and between members and the coordinator, over Arrow Flight.

Two planes share one :class:`ExchangeServer` per member (and one on the driver for the
coordinator):

- **Data**: one Flight stream per edge channel carries Arrow batches and, in band, the
  snapshot barriers, the watermarks and the end of the stream, into the receiving processor's
  :class:`~sparkjet.runtime.aligner.BarrierAligner` (``put`` / ``put_barrier`` / ``end`` on the
  channel named by the stream; a watermark is put as a
  :class:`~sparkjet.runtime.watermarks.Watermark` item). Order within a stream is kept, so
  a barrier or a watermark never overtakes a batch.
- **Control**: Flight actions carry small JSON messages (the coordinator's "barrier" and
  "commit" requests, the members' phase-1 "ack" with their manifests): a name and a JSON
  object in, a JSON object out.
- **Files**: a file's bytes in pieces, as binary record batches: ``DoPut`` to a handler
  registered with ``ExchangeServer.on_put`` (:meth:`ExchangeClient.put_file`; the stream
  ends with a trailer the receiver checks the file against before it answers) and ``DoGet``
  of a range from one registered with ``on_get`` (:meth:`ExchangeClient.get_file`). The
  members' storage copies snapshot chunk files to their backup slots, and reads a peer's
  replica, this way (:mod:`sparkjet.runtime.storage`).

>>> import pyarrow as pa
>>> from sparkjet.runtime.aligner import BarrierAligner
>>> from sparkjet.runtime.exchange import ExchangeClient, ExchangeServer
>>> from sparkjet.runtime.exchange.security import LinkSecurity
>>> security = LinkSecurity.generate(execution_id=7)
>>> aligner = BarrierAligner(channels=1, capacity=16)
>>> server = ExchangeServer(inbound={("aggregate", 0): aligner}, execution_id=7,
...                         security=security)
>>> client = ExchangeClient(server.location, security=security)
>>> ch = client.channel("aggregate", 0, channel=0, execution_id=7)
>>> ch.put(pa.record_batch({"k": [1, 2]})); ch.put_barrier(0); ch.end(); ch.close()
>>> [e[0] for e in aligner.drain(10)]
['item', 'snapshot', 'done']
>>> server.on_action("ping2", lambda body: {"pong": body["n"] + 1})
>>> client.action("ping2", {"n": 1})
{'pong': 2}
>>> client.close(); server.close()
True

The modules:

- :mod:`~sparkjet.runtime.exchange.protocol`: the wire conventions (version 1): stream
  descriptors, control messages and their framing, the tags of refusals.
- :mod:`~sparkjet.runtime.exchange.security`: who may talk on a job's links: a secret per
  execution, a signed token on every call, TLS with a pinned certificate.
- :mod:`~sparkjet.runtime.exchange.server`: :class:`ExchangeServer`.
- :mod:`~sparkjet.runtime.exchange.client`: :class:`ExchangeClient` and its
  :class:`OutboundChannel`.

:class:`ExchangeServer`, :class:`ExchangeClient` and :class:`OutboundChannel` load on first
use (PEP 562): the driver imports :mod:`~sparkjet.runtime.exchange.security` to make an
execution's credentials without loading the transport.

Backpressure
------------
The server's handler for a stream blocks in ``aligner.put`` (in slices of
``ExchangeServer.poll`` seconds, checking for shutdown and for a cancelled call) and
reads nothing meanwhile. The sender keeps at most ``window_messages`` messages and
``window_bytes`` bytes (a single larger batch is allowed alone) that the server has not
yet put into the aligner; past that, :meth:`OutboundChannel.put` waits for an ack. So
what sits between two processors is bounded by what the aligner holds (its capacity, in
entries) plus one window, whatever gRPC buffers (its HTTP/2 windows grow to tens of MB on a
fast link). The sender asks for an ack when half the window is used, so a server that keeps
up never makes it wait for a round trip.

Authentication and encryption
-----------------------------
Every call (streams, actions, ``list_actions``) carries a token signed with the
execution's secret, which the server checks in middleware before any handler runs; with
a TLS identity every link is TLS with the execution's pinned certificate. See
:mod:`sparkjet.runtime.exchange.security`.

Fencing
-------
Every stream (file streams too) names the execution it belongs to; a server refuses a
stream (and an action that names an execution) of any other execution with
:class:`ExchangeFencedError`, so a zombie member of an old execution cannot inject data,
acks or backup copies. One server serves one
execution: the coordinator starts a new one for each execution.

Threads and blocking
--------------------
The server handles each stream and action on a gRPC thread of its own (the pool grows
with the number of open streams); its Python code holds the GIL only between blocking
calls, which release it. A handler registered with :meth:`ExchangeServer.on_action` runs
on such a thread and should answer quickly. On the client, one thread uses a channel
(like an aligner's producer); :meth:`OutboundChannel.abort` may be called from any thread
and wakes a blocked ``put``. :class:`ExchangeClient` may be shared by threads. A sender
that keeps a stream open without sending keeps :meth:`ExchangeServer.close` waiting:
senders close or abort their channels when an execution ends.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from sparkjet.errors import (
    ExchangeAuthError,
    ExchangeError,
    ExchangeFencedError,
    ExchangeRefusedError,
    ExchangeTimeoutError,
)
from sparkjet.runtime.exchange.protocol import PROTOCOL

if TYPE_CHECKING:
    from sparkjet.runtime.exchange.client import ExchangeClient, OutboundChannel
    from sparkjet.runtime.exchange.server import ExchangeServer

__all__ = [
    "PROTOCOL",
    "ExchangeAuthError",
    "ExchangeClient",
    "ExchangeError",
    "ExchangeFencedError",
    "ExchangeRefusedError",
    "ExchangeServer",
    "ExchangeTimeoutError",
    "OutboundChannel",
]


def __getattr__(name: str):
    """The server and the client, loaded on first use (PEP 562)."""
    # Imported here: the driver imports this package for its security module alone.
    if name in ("ExchangeClient", "OutboundChannel"):
        from sparkjet.runtime.exchange import client as module
    elif name == "ExchangeServer":
        from sparkjet.runtime.exchange import server as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
