"""An acknowledging source on Redis Streams (Jet's JMS source, seed 000).

Source partition ``p`` is the stream ``{stream}:{p}``. Each job reads through its own
consumer group (``sparkjet-job-{job_id}`` unless named), with XREADGROUP, as the consumer
``{consumer}-e{execution_id}`` (``sparkjet-e7``): one per execution, so that entries read
by a reader of an older execution are told apart from this reader's. A reader claims
(XCLAIM) every entry pending for a consumer of an older execution -- at its start, where they
are its predecessor's, and every ``reclaim_interval`` seconds, where they were read by a
zombie (a reader of an older execution that still runs, or whose blocked XREADGROUP Redis
served while it was stopped) -- and treats them like its own pending entries below; a zombie
never claims from a newer execution's consumer. The exactly-once protocol:

1. ``read`` returns messages; their ids stay *pending* in Redis (read, not acknowledged).
2. At the barrier of snapshot n, :meth:`RedisStreamReader.snapshot_state` saves the ids
   of every message returned and not yet acknowledged.
3. When snapshot n is complete, :meth:`RedisStreamReader.ack` XACKs the ids returned
   before its barrier. The runtime calls ``ack(n)`` before the barrier of n+1 (Jet never
   overlaps snapshots); ``ack`` acknowledges every id saved by a ``snapshot_state`` call
   so far.
4. After a crash, :meth:`RedisStreamReader.restore_state` takes the saved ids as "already
   processed"; the reader first re-reads its pending entries (XREADGROUP from id ``0``),
   **drops** (and acknowledges) those whose ids are in the restored state, since their
   effects are in the snapshot, and returns the others again, since theirs were lost.
   Only then does it read new messages (id ``>``).

State::

    {"unacked": {"<partition>": ["1700000000000-0", ...], ...}, "ended": [<partition>, ...],
     "group": "sparkjet-job-7", "delivered": {"<partition>": "1700000000000-5", ...}}

**Never a silent rewind.** ``delivered`` is the newest id the reader had returned of each
partition at the snapshot. A restore checks that the job's consumer group has delivered at
least that far (``XINFO GROUPS``): a group behind it was deleted and made again (by this
reader's ``XGROUP CREATE ... MKSTREAM``, from ``start_id``), lost with its stream, or
brought back from an older copy of the server's data, and reading from it would deliver
again entries the state already holds. That is a :class:`~sparkjet.errors.SourceChangedError`
naming the stream, the group and both ids, and so is a group or stream deleted while the
job reads it (``NOGROUP``). A state saved under another group (an ``initial_snapshot`` of
another job) moves this job's new group to where that one stood (``XGROUP SETID``).

With guarantee ``"none"`` messages are read with NOACK (acknowledged on delivery, lost
if the job dies) and the state holds no ids.

**Batches.** By default a batch has a string column ``_id`` (the message id) and one
string column per field name found in the batch's messages, in first-seen order (null
where a message lacks the field), so the columns can differ between batches. Give a
``schema`` for fixed columns: ``_id`` if named, each other field by name, cast from its
UTF-8 text (binary columns keep the raw bytes). Or a ``decoder``: a picklable callable
taking ``[(id: str, fields: dict[bytes, bytes]), ...]`` and returning a RecordBatch.

**Messages that do not decode** (a field that does not convert to the schema's type, a
field that is not UTF-8 without a schema, a message the decoder raises on) go one by one to
the source's ``on_error``: "fail" stops the job with a
:class:`~sparkjet.errors.BadRecordError` naming the stream, the message id and the field;
"skip" drops them; a dead-letter sink gets each with the field as ``column``, ``position``
``"stream 'orders:2' id 1700000000000-0"``, ``partition`` the source partition and as
``record`` its fields as a JSON object of text (bytes that are not UTF-8 escaped as
``\\xNN``). The other messages of the batch go on, and every id is acknowledged with its
snapshot either way.

**End of stream.** Redis streams do not end; a producer may append an end marker
(:meth:`RedisStreamProducer.end`, a message with the field ``__sparkjet_end__``) after
which :meth:`RedisStreamReader.at_end` is true for that partition once it is read.
Nothing may follow a marker.

Needs the ``redis`` package (``pip install 'sparkjet[redis]'``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Any

import pyarrow as pa
from msgspec import Meta

from sparkjet._checks import check_distinct_ints, check_int
from sparkjet._redact import redact, redact_url
from sparkjet.connectors._settings import (
    NonNegativeOrInfinite,
    PositiveInt,
    Schema,
    Settings,
    SourcePartitions,
    Text,
)
from sparkjet.connectors.base import BadRecord, ProcessorContext, Source, SourceReader
from sparkjet.errors import (
    ConnectorError,
    CorruptDataError,
    InvalidArgumentError,
    SourceChangedError,
)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_CONSUMER = "sparkjet"
END_FIELD = "__sparkjet_end__"
ID_COLUMN = "_id"

_END = END_FIELD.encode()
_SOCKET_TIMEOUT = 10.0
# Ids per XACK command: keeps one command's size bounded whatever the snapshot interval.
_ACK_CHUNK = 10_000


def _id_order(message_id: bytes) -> tuple[int, int]:
    ms, _, seq = message_id.partition(b"-")
    return int(ms), int(seq or 0)


def stream_key(stream: str, partition: int) -> str:
    """The Redis key of one source partition: ``{stream}:{partition}``."""
    return f"{stream}:{partition}"


def _redis():
    try:
        import redis
    except ImportError:
        raise ImportError(
            "Redis Streams sources need the redis client: pip install 'sparkjet[redis]'"
        ) from None
    return redis


# A password: never shown, not even in the error about it.
Secret = Annotated[str | None, Meta(description="a str or None", extra={"secret": True})]


@dataclass(frozen=True)
class RedisStreamSourceSettings(Settings):
    """:class:`RedisStreamSource`'s arguments, checked (see
    :mod:`sparkjet.connectors._settings`). The password is never shown."""

    stream: Text
    partitions: SourcePartitions
    url: Text = DEFAULT_URL
    _: KW_ONLY
    group: Text | None = None
    consumer: Text = DEFAULT_CONSUMER
    start_id: Text = "0"
    schema: Schema | None = None
    decoder: Any = None                 # a callable: checked by check()
    block_ms: PositiveInt | None = None
    # Seconds; infinite: never reclaim another consumer's pending messages.
    reclaim_interval: NonNegativeOrInfinite = 2.0
    password: Secret = dataclasses.field(default=None, repr=False)

    def check(self) -> None:
        if self.schema is not None and self.decoder is not None:
            raise self._error("give a schema or a decoder, not both")
        if self.decoder is not None and not callable(self.decoder):
            raise self._refuse("decoder", "a callable or None")


class RedisStreamSource(Source):
    """Streams ``{stream}:0`` .. ``{stream}:{partitions-1}`` at ``url`` as an
    acknowledging source. ``start_id`` is where a new consumer group starts (``"0"``:
    every message in the stream; ``"$"``: only new ones). ``block_ms`` lets an idle read
    wait that long for messages (None: never wait). ``consumer`` is the prefix of the
    consumer names; ``reclaim_interval`` how often a reader claims entries left pending by
    readers of older executions (see the module doc). ``password`` (else the environment
    variable ``SPARKJET_REDIS_PASSWORD``, read here, or a password in ``url``) is never
    shown: ``repr`` and errors mask it.

    >>> RedisStreamSource("orders", 4, "redis://127.0.0.1:6379/0")
    RedisStreamSource('orders', 4, 'redis://127.0.0.1:6379/0')
    """

    name = "redis-stream"
    replayable = False
    acknowledging = True

    def __init__(self, stream: str, partitions: int, url: str = DEFAULT_URL, *,
                 group: str | None = None, consumer: str = DEFAULT_CONSUMER,
                 start_id: str = "0", schema: pa.Schema | None = None,
                 decoder: Callable[[list], pa.RecordBatch] | None = None,
                 block_ms: int | None = None, reclaim_interval: float = 2.0,
                 password: str | None = None):
        settings = RedisStreamSourceSettings.of(locals())
        settings.apply(self, skip=("password",))
        self._password = settings.password if settings.password is not None else os.environ.get(
            "SPARKJET_REDIS_PASSWORD")

    def partition_count(self) -> int:
        return self.partitions

    def group_name(self, context: ProcessorContext) -> str:
        """The consumer group of the job ``context`` belongs to."""
        return self.group if self.group is not None else f"sparkjet-job-{context.job_id}"

    def open(self, partitions: list[int], context: ProcessorContext) -> RedisStreamReader:
        return RedisStreamReader(self, partitions, context)

    def __repr__(self) -> str:
        return f"RedisStreamSource({self.stream!r}, {self.partitions}, {redact_url(self.url)!r})"

    def client(self, **options):
        """A redis-py client of the source's server, with its credentials."""
        if self._password is not None:
            options["password"] = self._password
        return _redis().Redis.from_url(self.url, **options)

    def redact(self, text: str) -> str:
        """``text`` without the source's credentials (for errors and logs)."""
        return redact(text.replace(self.url, redact_url(self.url)), self._password)


class RedisStreamReader(SourceReader):
    """Reads some partitions of a :class:`RedisStreamSource` (see the module's protocol).
    Opening creates the consumer group on each stream if it does not exist."""

    def __init__(self, source: RedisStreamSource, partitions: list[int],
                 context: ProcessorContext):
        # May be empty: a processor without partitions is at its end.
        parts = check_distinct_ints("partitions", partitions, min=0, max=source.partitions - 1)
        redis = _redis()
        self._source = source
        self._parts = parts
        self._keys = {p: stream_key(source.stream, p) for p in parts}
        self._group = source.group_name(context)
        self._execution = context.execution_id
        self._consumer = f"{source.consumer}-e{context.execution_id}"
        self._noack = context.guarantee == "none"
        self._next_reclaim = 0.0
        # A bounded socket timeout: a read must never hang on a dead server (the
        # execution fails and restarts instead).
        timeout = _SOCKET_TIMEOUT + (source.block_ms or 0) / 1000
        self._client = source.client(socket_timeout=timeout,
                                     socket_connect_timeout=_SOCKET_TIMEOUT)
        for key in self._keys.values():
            try:
                self._client.xgroup_create(key, self._group, id=source.start_id, mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise ConnectorError(source.redact(f"redis-stream source: {e}")) from None
            except redis.RedisError as e:  # unreachable, refused credentials, ...
                raise ConnectorError(source.redact(
                    f"redis-stream source at {source.url}: {type(e).__name__}: {e}")) from None
        self._turn = 0
        self.restore_state(None)

    def read(self, max_rows: int) -> pa.RecordBatch | None:
        """Up to ``max_rows`` messages of one partition: redelivered ones first after a
        restart, then new ones; None if there are none right now."""
        check_int("max_rows", max_rows, min=1)
        n = len(self._parts)
        for step in range(n):
            p = self._parts[(self._turn + step) % n]
            if p in self._recovering:
                entries = self._redeliver(p, max_rows)
                if entries:
                    self._turn = (self._turn + step + 1) % n
                    return self._emit(p, entries)
        if not self._noack and time.monotonic() >= self._next_reclaim:
            self._next_reclaim = time.monotonic() + self._source.reclaim_interval
            for p in self._parts:
                if p not in self._recovering and p not in self._ended:
                    self._buffers[p].extendleft(reversed(self._reclaim(p)))
        if not any(self._buffers.values()):
            self._fetch(max_rows)
        for step in range(n):
            p = self._parts[(self._turn + step) % n]
            buffer = self._buffers[p]
            if buffer:
                entries = [buffer.popleft() for _ in range(min(max_rows, len(buffer)))]
                self._turn = (self._turn + step + 1) % n
                return self._emit(p, entries)
        return None

    def caught_up(self) -> bool:
        """The last fetch gave fewer entries than asked and all of them were read."""
        return (self._short and not self._recovering
                and not any(self._buffers.values()))

    def at_end(self) -> bool:
        """True once every partition's end marker has been read (never, without markers)."""
        return len(self._ended) == len(self._parts)

    def snapshot_state(self) -> dict:
        delivered = {str(p): i for p, i in self._delivered.items() if i is not None}
        if self._noack:
            return {"unacked": {}, "ended": sorted(self._ended), "group": self._group,
                    "delivered": delivered}
        self._generations.append(self._returned)
        self._returned = {p: [] for p in self._parts}
        unacked = {}
        for p in self._parts:
            ids = [i for g in self._generations for i in g[p]]
            ids.extend(sorted(self._processed[p]))
            if ids:
                unacked[str(p)] = ids
        return {"unacked": unacked, "ended": sorted(self._ended), "group": self._group,
                "delivered": delivered}

    def restore_state(self, state: dict | None) -> None:
        """Takes the ids in ``state`` as processed and re-reads every pending entry first
        (None: no id is processed, every pending entry is processed again)."""
        processed = {p: set() for p in self._parts}
        ended = set()
        if state is not None:
            unacked = state.get("unacked") if isinstance(state, dict) else None
            ends = state.get("ended", []) if isinstance(state, dict) else None
            if not isinstance(unacked, dict) or not isinstance(ends, list):
                raise InvalidArgumentError(
                    "a Redis stream state is {'unacked': {partition: [id, ...]}, 'ended': "
                    f"[partition, ...]}}, got {state!r}")
            for p in self._parts:
                ids = unacked.get(str(p), unacked.get(p, []))
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise InvalidArgumentError(
                        f"unacked ids of partition {p} must be a list of str, got {ids!r}")
                processed[p] = set(ids)
            ended = {p for p in self._parts if p in ends}
        self._delivered: dict[int, str | None] = dict.fromkeys(self._parts)
        if state is not None:
            self._check_position(state)
        self._processed = processed
        self._ended = ended
        # Recovery: the position in each partition's pending entries list, from the start
        # (also for ended partitions: their processed entries still need acknowledging).
        self._recovering = {} if self._noack else dict.fromkeys(self._parts, "0")
        self._short = False     # the last fetch gave fewer entries than asked
        self._buffers = {p: deque() for p in self._parts}
        self._returned = {p: [] for p in self._parts}
        self._generations: list[dict] = []

    def _check_position(self, state: dict) -> None:
        """Refuses a restore whose group has delivered less than the state says it had
        (see the module's "Never a silent rewind"); moves a new group to a state saved
        under another group."""
        delivered = state.get("delivered")
        if not isinstance(delivered, dict):
            return  # a state from before positions were saved: nothing to check against
        own = state.get("group", self._group) == self._group
        for p in self._parts:
            want = delivered.get(str(p))
            if not isinstance(want, str):
                continue
            self._delivered[p] = want
            key = self._keys[p]
            found = self._group_position(key)
            if found is not None and _id_order(found.encode()) >= _id_order(want.encode()):
                continue
            if not own:
                self._client.xgroup_setid(key, self._group, want)
                continue
            raise SourceChangedError(self._source.redact(
                f"redis-stream source: the consumer group {self._group!r} of stream {key!r} "
                f"has delivered up to {found or 'nothing'}, but the job's snapshot had read up "
                f"to {want}: the stream or its group was deleted and made again, or the "
                f"server came back with an older copy of its data. Reading on would deliver "
                f"again entries whose effects the job's state already holds, so the job "
                f"stops. To start over, run the job with a new snapshot store (or a new "
                f"group); to go on from where the group stands, move it with XGROUP SETID "
                f"{key} {self._group} {want} if the entries are the same"))

    def _group_position(self, key: str) -> str | None:
        """The id this reader's group last delivered of ``key`` (None: no such group)."""
        try:
            groups = self._client.xinfo_groups(key)
        except _redis().ResponseError:  # no such key
            return None
        for group in groups:
            name = group.get("name")
            name = name.decode() if isinstance(name, bytes) else name
            if name == self._group:
                last = group.get("last-delivered-id")
                return last.decode() if isinstance(last, bytes) else last
        return None

    def _nogroup(self, e: Exception, key: str) -> None:
        """A read refused for a missing group or stream: they were deleted under the job."""
        if "NOGROUP" in str(e):
            raise SourceChangedError(self._source.redact(
                f"redis-stream source: stream {key!r} or its consumer group {self._group!r} "
                f"was deleted while the job read it ({e}); a new group would deliver the "
                f"stream again from {self._source.start_id!r}, so the job stops")) from None

    def ack(self, snapshot_id: int) -> None:
        """XACKs the ids of the oldest snapshot not yet acknowledged, which is snapshot
        ``snapshot_id``: each snapshot saves one generation (:meth:`snapshot_state`) and
        snapshots complete in order, so ids that only a later, unfinished snapshot covers
        are never acknowledged here."""
        if not self._generations:
            return
        oldest = self._generations[0]
        pipe = self._client.pipeline(transaction=False)
        for p in self._parts:
            ids = oldest[p]
            for lo in range(0, len(ids), _ACK_CHUNK):
                pipe.xack(self._keys[p], self._group, *ids[lo:lo + _ACK_CHUNK])
        pipe.execute()
        # Only after XACK succeeded: a failed ack leaves the ids in the next snapshot.
        self._generations.pop(0)

    def close(self) -> None:
        self._client.close()

    def _claim_foreign(self, p: int) -> list:
        """Moves the entries of ``p`` pending for consumers of older executions to this
        reader's consumer (and deletes those consumers); returns the claimed entries."""
        key = self._keys[p]
        summary = self._client.xpending(key, self._group)
        others = [c["name"] for c in summary.get("consumers") or []
                  if self._older(c["name"].decode())]
        claimed = []
        for name in others:
            while True:
                rows = self._client.xpending_range(key, self._group, min="-", max="+",
                                                   count=_ACK_CHUNK, consumername=name)
                if not rows:
                    break
                ids = [r["message_id"] for r in rows]
                got = self._client.xclaim(key, self._group, self._consumer, 0, ids)
                claimed.extend(got)
                if len(got) < len(ids):  # entries deleted from the stream leave the PEL
                    present = {m for m, _ in got}
                    gone = [i for i in ids if i not in present]
                    self._client.xack(key, self._group, *gone)
            self._client.xgroup_delconsumer(key, self._group, name)
        return claimed

    def _older(self, consumer: str) -> bool:
        """Whether ``consumer`` read for an older execution than this reader's (a zombie
        of an older execution must never claim from the live one). Names sparkjet did
        not make count as older."""
        prefix = f"{self._source.consumer}-e"
        if consumer.startswith(prefix) and consumer[len(prefix):].isdigit():
            return int(consumer[len(prefix):]) < self._execution
        return consumer != self._consumer

    def _reclaim(self, p: int) -> list:
        """Entries of ``p`` a zombie read since: claimed, less those the restored snapshot
        covers (acknowledged) and deleted ones, in id order."""
        entries = self._claim_foreign(p)
        if not entries:
            return []
        processed = self._processed[p]
        keep, done = [], []
        for message_id, fields in sorted(entries, key=lambda e: _id_order(e[0])):
            if message_id.decode() in processed or not fields:
                processed.discard(message_id.decode())
                done.append(message_id)
            else:
                keep.append((message_id, fields))
        if done:
            self._client.xack(self._keys[p], self._group, *done)
        return keep

    def _redeliver(self, p: int, max_rows: int) -> list:
        """The next pending entries of ``p`` not already processed; acknowledges the
        processed ones (the restored snapshot, which is complete, holds their effects).
        First claims what older executions' readers left pending."""
        key = self._keys[p]
        processed = self._processed[p]
        if self._recovering[p] == "0":
            self._claim_foreign(p)
        while True:
            try:
                reply = self._client.xreadgroup(self._group, self._consumer,
                                                {key: self._recovering[p]}, count=max_rows)
            except _redis().ResponseError as e:
                self._nogroup(e, key)
                raise
            entries = reply[0][1] if reply else []
            if not entries:
                # Every pending entry has been seen; a processed id that was not pending
                # had been acknowledged before the crash.
                del self._recovering[p]
                self._processed[p] = set()
                return []
            self._recovering[p] = entries[-1][0]
            keep, done = [], []
            for message_id, fields in entries:
                text = message_id.decode()
                if text in processed:
                    processed.discard(text)
                    done.append(message_id)
                elif not fields:
                    # Deleted from the stream (XDEL, trimming) while pending: nothing to
                    # replay.
                    done.append(message_id)
                else:
                    keep.append((message_id, fields))
            if done:
                self._client.xack(key, self._group, *done)
            if keep:
                return keep

    def _fetch(self, max_rows: int) -> None:
        streams = {self._keys[p]: ">" for p in self._parts
                   if p not in self._recovering and p not in self._ended}
        if not streams:
            return
        try:
            reply = self._client.xreadgroup(self._group, self._consumer, streams,
                                            count=max_rows, block=self._source.block_ms,
                                            noack=self._noack)
        except _redis().ResponseError as e:
            self._nogroup(e, ", ".join(streams))
            raise
        by_key = {k: p for p, k in self._keys.items()}
        fetched = 0
        for key, entries in reply or []:
            self._buffers[by_key[key.decode()]].extend(entries)
            fetched += len(entries)
        self._short = fetched < max_rows

    def _emit(self, p: int, entries: list) -> pa.RecordBatch | None:
        for i, (_message_id, fields) in enumerate(entries):
            if _END in fields:
                entries = entries[:i + 1]
                self._ended.add(p)
                self._buffers[p].clear()
                break
        if entries:
            last = entries[-1][0].decode()
            now = self._delivered.get(p)
            if now is None or _id_order(last.encode()) > _id_order(now.encode()):
                self._delivered[p] = last
        if not self._noack:
            self._returned[p].extend(m.decode() for m, _ in entries)
        data = [(m.decode(), f) for m, f in entries if _END not in f]
        if not data:
            return None
        return self._decode(p, data)

    def _decode(self, p: int, entries: list) -> pa.RecordBatch | None:
        """The messages as a batch; one that does not decode goes to :meth:`bad_record`
        (the source's ``on_error``) and the others are decoded without it. Its id is
        acknowledged with the snapshot like any other."""
        source, key = self._source, self._keys[p]
        try:
            return _decode(entries, source, key)
        except InvalidArgumentError:
            raise               # a decoder that returns no RecordBatch: a bug, not the data
        except Exception as e:  # noqa: BLE001 - a user decoder may raise anything
            if source.decoder is None and not isinstance(e, CorruptDataError):
                raise
        good = []
        for entry in entries:
            problem = _problem(entry, source, key)
            if problem is None:
                good.append(entry)
                continue
            column, reason = problem
            self.bad_record(BadRecord(reason, column, _raw(entry[1]), p, None,
                                      f"stream {key!r} id {entry[0]}"))
        return _decode(good, source, key) if good else None


def _decode(entries: list, source: RedisStreamSource, key: str) -> pa.RecordBatch:
    if source.decoder is not None:
        batch = source.decoder(entries)
        if not isinstance(batch, pa.RecordBatch):
            raise InvalidArgumentError(
                f"the decoder of {key} returned {type(batch).__name__}, not a RecordBatch")
        return batch
    ids = pa.array([m for m, _ in entries], pa.string())
    if source.schema is None:
        names: dict[bytes, None] = {}
        for _, fields in entries:
            names.update(dict.fromkeys(fields))
        arrays = [ids] + [_text(entries, name, key) for name in names]
        return pa.RecordBatch.from_arrays(
            arrays, names=[ID_COLUMN] + [n.decode("utf-8", "replace") for n in names])
    arrays = []
    for field in source.schema:
        if field.name == ID_COLUMN:
            arrays.append(ids.cast(field.type))
            continue
        raw = pa.array([f.get(field.name.encode()) for _, f in entries], pa.binary())
        try:
            if field.type in (pa.binary(), pa.large_binary()):
                arrays.append(raw.cast(field.type))
            else:
                arrays.append(raw.cast(pa.string()).cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise CorruptDataError(
                f"{key}: field {field.name!r} of messages {entries[0][0]}..{entries[-1][0]} "
                f"does not convert to {field.type}: {e}") from None
    return pa.RecordBatch.from_arrays(arrays, schema=source.schema)


def _problem(entry: tuple, source: RedisStreamSource, key: str) -> tuple | None:
    """Why the message ``entry`` does not decode alone (its column, None for the whole
    message, and the reason), or None."""
    _, fields = entry
    if source.decoder is not None:
        try:
            _decode([entry], source, key)
        except InvalidArgumentError:
            raise
        except Exception as e:  # noqa: BLE001 - a user decoder may raise anything
            return None, f"the decoder raised {type(e).__name__}: {e}"
        return None
    if source.schema is None:
        for name, value in fields.items():
            try:
                value.decode()
            except UnicodeDecodeError as e:
                return (name.decode("utf-8", "replace"),
                        f"field {name.decode('utf-8', 'replace')!r} is not UTF-8 text ({e}); "
                        "give a schema with a binary column for it")
        return None
    for field in source.schema:
        if field.name == ID_COLUMN or field.type in (pa.binary(), pa.large_binary()):
            continue
        value = fields.get(field.name.encode())
        try:
            pa.array([value], pa.binary()).cast(pa.string()).cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            return field.name, (f"field {field.name!r} value {value!r} does not convert to "
                                f"{field.type}: {e}")
    return None


def _raw(fields: dict) -> bytes:
    """A message's fields as the record of its dead letter: a JSON object of its field
    names and values as text (bytes that are not UTF-8 escaped as ``\\xNN``)."""
    return json.dumps({k.decode("utf-8", "backslashreplace"): v.decode("utf-8", "backslashreplace")
                       for k, v in fields.items()}, ensure_ascii=False).encode()


def _text(entries: list, name: bytes, key: str) -> pa.Array:
    raw = pa.array([f.get(name) for _, f in entries], pa.binary())
    try:
        return raw.cast(pa.string())
    except pa.ArrowInvalid:
        raise CorruptDataError(
            f"{key}: field {name!r} is not UTF-8 text; give a schema with a binary column "
            "for it") from None


@dataclass(frozen=True)
class RedisStreamProducerSettings(Settings):
    """:class:`RedisStreamProducer`'s arguments, checked (see
    :mod:`sparkjet.connectors._settings`). The password is never shown."""

    stream: Text
    partitions: SourcePartitions
    url: Text = DEFAULT_URL
    _: KW_ONLY
    password: Secret = dataclasses.field(default=None, repr=False)


class RedisStreamProducer:
    """Appends messages (XADD) to the streams of a :class:`RedisStreamSource`: for tests,
    demos and feeding a job. Field values are str, bytes, int or float."""

    def __init__(self, stream: str, partitions: int, url: str = DEFAULT_URL, *,
                 password: str | None = None):
        RedisStreamProducerSettings.of(locals()).apply(self, skip=("url", "password"))
        # The same credentials as the source's: the argument, else the environment.
        self._client = RedisStreamSource(stream, self.partitions, url,
                                         password=password).client()

    def add(self, partition: int, fields: dict) -> str:
        """Appends one message; returns its id."""
        return self.add_many(partition, [fields])[0]

    def add_many(self, partition: int, rows: Iterable[dict] | pa.RecordBatch | pa.Table,
                 chunk: int = 10_000) -> list[str]:
        """Appends messages in order (pipelined, ``chunk`` per round trip); a
        RecordBatch or Table gives one message per row. Returns their ids."""
        key = self._key(partition)
        if isinstance(rows, (pa.RecordBatch, pa.Table)):
            rows = rows.to_pylist()
        ids: list[str] = []
        pipe = self._client.pipeline(transaction=False)
        for i, fields in enumerate(rows, 1):
            if not fields:
                raise InvalidArgumentError("a Redis stream message needs at least one field")
            pipe.xadd(key, {k: v for k, v in fields.items() if v is not None})
            if i % chunk == 0:
                ids.extend(m.decode() for m in pipe.execute())
        ids.extend(m.decode() for m in pipe.execute())
        return ids

    def end(self, partitions: Iterable[int] | None = None) -> None:
        """Appends the end marker to the given partitions (all by default)."""
        for p in range(self.partitions) if partitions is None else partitions:
            self._client.xadd(self._key(p), {END_FIELD: "1"})

    def close(self) -> None:
        self._client.close()

    def _key(self, partition: int) -> str:
        partition = check_int("partition", partition, min=0, max=self.partitions - 1)
        return stream_key(self.stream, partition)
