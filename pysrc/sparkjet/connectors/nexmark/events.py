"""NEXMark's persons, auctions and bids as Arrow record batches, computed column by column
from their global event indices with numpy (no Python per row): the model behind
:class:`~sparkjet.sources.NexmarkSource`.

Every random choice of event ``i`` is a draw ``splitmix64(seed + (i * 16 + stream + 1) *
golden)`` of the splitmix64 sequence, one ``stream`` per purpose, so an event depends on
``(seed, i)`` and the source's parameters only, never on which batch or reader made it.
Bounded integers come from 32 random bits by Lemire's multiply-shift (``u32 * n >> 32``).

Text is drawn, not written per row: each text column picks an entry of a table of random
strings made once per seed (:func:`_texts`), ``variants`` strings for each length NEXMark's
rule can give, so a pick is uniform over lengths as NEXMark's is. A row then costs one Arrow
``take`` (a copy) instead of generating and compacting random bytes.

The rules are those of the NEXMark generator of Apache Beam and nexmark-flink (constants
named as there); the departures are listed in :mod:`sparkjet.connectors.nexmark.source`.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkjet.connectors.generator import mix64

PROPORTION_DENOMINATOR = 50
PERSON_PROPORTION = 1
AUCTION_PROPORTION = 3
BID_PROPORTION = 46
FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
NUM_CATEGORIES = 5
PERSON_ID_LEAD = 10
AUCTION_ID_LEAD = 10
# Hot auctions, bidders and sellers are the first of each batch of this many (Beam's
# HOT_AUCTION_RATIO, HOT_BIDDER_RATIO and HOT_SELLER_RATIO constants).
HOT_BATCH = 100
HOT_CHANNELS = ("Google", "Facebook", "Baidu", "Apple")
HOT_CHANNELS_RATIO = 2
CHANNELS = 10_000
AVG_PERSON_BYTES, AVG_AUCTION_BYTES, AVG_BID_BYTES = 200, 500, 100
# Bytes of a bid other than its extra (NEXMark's "currentSize"), and of an auction other
# than its name, description and extra.
BID_FIXED_BYTES, AUCTION_FIXED_BYTES = 32, 48
# Extras of persons and auctions are picked by length below this (their rule gives at most
# 541 bytes with the averages above) and variant.
EXTRA_LENGTHS, EXTRA_VARIANTS = 600, 16
# Variants per length of the other texts (more where the table stays small).
BID_EXTRA_VARIANTS, NAME_VARIANTS, DESCRIPTION_VARIANTS, EMAIL_VARIANTS = 128, 256, 64, 256

US_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
US_CITIES = ("Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland", "Bend",
             "Redmond", "Seattle", "Kent", "Cheyenne")
FIRST_NAMES = ("Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah",
               "Deiter", "Walter")
LAST_NAMES = ("Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones",
              "Noris")

TIME = pa.timestamp("ms")
SCHEMAS = {
    "person": pa.schema([("id", pa.int64()), ("name", pa.string()),
                         ("email_address", pa.string()), ("credit_card", pa.string()),
                         ("city", pa.string()), ("state", pa.string()), ("date_time", TIME),
                         ("extra", pa.string())]),
    "auction": pa.schema([("id", pa.int64()), ("item_name", pa.string()),
                          ("description", pa.string()), ("initial_bid", pa.int64()),
                          ("reserve", pa.int64()), ("date_time", TIME), ("expires", TIME),
                          ("seller", pa.int64()), ("category", pa.int64()),
                          ("extra", pa.string())]),
    "bid": pa.schema([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()),
                      ("channel", pa.string()), ("url", pa.string()), ("date_time", TIME),
                      ("extra", pa.string())]),
}
# The offsets within each run of PROPORTION_DENOMINATOR events that hold each kind.
KIND_OFFSETS = {"person": (0, PERSON_PROPORTION),
                "auction": (PERSON_PROPORTION, PERSON_PROPORTION + AUCTION_PROPORTION),
                "bid": (PERSON_PROPORTION + AUCTION_PROPORTION, PROPORTION_DENOMINATOR)}

_U = np.uint64
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LOW32 = _U(0xFFFFFFFF)
_STREAMS = 16
_S_TIME, _S_A, _S_B, _S_C, _S_D, _S_E, _S_F = range(7)   # draw streams; each kind uses its own
_SPACE, _UNDERSCORE = 0x20, 0x5F
# Salts of the text tables (xored into the seed), so that no two tables share draws.
_T_CHANNEL, _T_BID_EXTRA, _T_EXTRA, _T_NAME, _T_DESCRIPTION, _T_LOCAL, _T_DOMAIN = (
    0xC4A, 0xB1D, 0xE87, 0x1A3, 0xDE5, 0x10C, 0xD03)


# ------------------------------------------------------------------------------- draws


def empty(n: int, dtype=np.int64) -> np.ndarray:
    """An uninitialized numpy array in Arrow's memory pool. The pool keeps freed memory for
    the next batch; numpy's allocator (glibc) returns blocks this big to the system and
    faults them in again on every batch, which cost a third of a bid's time."""
    dtype = np.dtype(dtype)
    return np.frombuffer(pa.allocate_buffer(n * dtype.itemsize), dtype=dtype)


def draw(ids: np.ndarray, seed: int, stream: int, out: np.ndarray | None = None,
         scratch: np.ndarray | None = None) -> np.ndarray:
    """64 random bits per event index (int64 array): element ``i * 16 + stream`` of the
    splitmix64 sequence seeded with ``seed`` (into ``out`` if given)."""
    h = np.multiply(ids.view(_U), _U(_STREAMS * _GOLDEN & _M64), out=out)
    h += _U((seed + (stream + 1) * _GOLDEN) & _M64)
    return mix64(h, scratch)


def _low(h: np.ndarray) -> np.ndarray:
    return h & _LOW32


def _high(h: np.ndarray) -> np.ndarray:
    return h >> _U(32)


def _below(bits32: np.ndarray, n) -> np.ndarray:
    """Uniform integers in ``0..n-1`` (n an int or an int64 array, below 2**32) from
    32-bit draws, as int64 (a new array)."""
    out = bits32 * (_U(n) if isinstance(n, int) else n.view(_U))
    out >>= _U(32)
    return out.view(np.int64)


def _hot_threshold(ratio: int, bits: int = 32) -> int:
    """``u >= threshold`` (``u`` of ``bits`` random bits) exactly when ``u * ratio >>
    bits > 0``: NEXMark's "hot with probability 1 - 1/ratio" in one comparison (exactly
    for a power of two, else within 2**-bits)."""
    return -(-(1 << bits) // ratio)


def _price(h: np.ndarray, scratch: np.ndarray | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """NEXMark's price in cents, ``round(10 ** (6u) * 100)`` for u uniform in [0, 1) from
    the high 32 bits of ``h`` (steps below a cent): log-uniform from 1 $ to 1,000,000 $."""
    high = np.right_shift(h, _U(32), out=scratch).view(np.int64)   # int64 converts faster
    x = np.multiply(high, 6 * math.log(10) / (1 << 32),
                    out=None if scratch is None else scratch.view(np.float64))
    x += math.log(100)
    np.exp(x, out=x)
    x += 0.5
    if out is None:
        return x.astype(np.int64)   # positive: truncation is floor
    np.copyto(out, x, casting="unsafe")
    return out


# ------------------------------------------------------------------------------ text


def _strings(keys: np.ndarray, lengths: np.ndarray, special: int | None = None,
             trim: bool = False) -> pa.Array:
    """One random string per key (building tables only: a byte matrix as wide as the
    longest): ``lengths[r]`` characters from the bytes of ``splitmix64(keys[r] + (j + 1) *
    golden)``. Lowercase letters (NEXMark's ``nextExactString``); with ``special``, each
    character is that byte instead with probability 20/256 (NEXMark: 1/13), and with
    ``trim`` leading and trailing spaces are dropped (NEXMark's ``nextString``)."""
    n = len(keys)
    width = int(lengths.max()) if n else 0
    if width == 0:
        return pa.StringArray.from_buffers(n, pa.py_buffer(np.zeros(n + 1, np.int32)),
                                           pa.py_buffer(b""))
    words = -(-width // 8)
    h = keys[:, None] + (_U(_GOLDEN) * np.arange(1, words + 1, dtype=_U))[None, :]
    v = mix64(h).view(np.uint8).reshape(n, words * 8)[:, :width]
    if special is None:
        chars = (v.astype(np.uint16) * 26 >> 8).astype(np.uint8) + np.uint8(ord("a"))
    else:
        letters = ((v.astype(np.uint16) - 20) * 26 // 236).astype(np.uint8) + np.uint8(ord("a"))
        chars = np.where(v < 20, np.uint8(special), letters)
    col = np.arange(width)[None, :]
    keep = col < lengths[:, None]
    if trim:
        solid = keep & (chars != _SPACE)
        some = solid.any(axis=1)
        first = solid.argmax(axis=1)
        last = width - 1 - solid[:, ::-1].argmax(axis=1)
        keep = (col >= first[:, None]) & (col <= last[:, None]) & some[:, None]
        lengths = np.where(some, last - first + 1, 0)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars[keep]))


def string_lengths(array: pa.Array) -> np.ndarray:
    """The byte length of each string of a string array, as int64."""
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[array.offset:]
    return np.diff(offsets[:len(array) + 1]).astype(np.int64)


@functools.lru_cache(maxsize=32)
def _texts(seed: int, salt: int, low: int, high: int, variants: int,
           special: int | None = None, trim: bool = False) -> tuple[pa.Array, np.ndarray]:
    """A table of random strings, ``variants`` of each length ``low..high-1`` (entry
    ``(length - low) * variants + k``; ``trim`` may shorten them), and their lengths."""
    count = (high - low) * variants
    keys = draw(np.arange(count, dtype=np.int64), seed ^ salt, _S_A)
    texts = _strings(keys, low + np.arange(count) // variants, special, trim)
    return texts, string_lengths(texts)


def _next_string(seed: int, salt: int, bits32: np.ndarray, max_length: int, variants: int,
                 special: int = _SPACE) -> tuple[pa.Array, np.ndarray]:
    """NEXMark's ``nextString(maxLength)`` per row, picked by ``bits32``: 3 to
    ``max_length - 1`` characters, trimmed; and their lengths."""
    table, lengths = _texts(seed, salt, 3, max_length, variants, special, trim=True)
    pick = _below(bits32, len(table))
    return table.take(pa.array(pick)), lengths[pick]


def _extra_lengths(bits32: np.ndarray, current: np.ndarray, average: int) -> np.ndarray:
    """NEXMark's ``nextExtra`` length: about ``average - current`` (+-20 %), 0 if negative."""
    desired = average - current
    delta = np.floor(desired * 0.2 + 0.5).astype(np.int64)   # Java's Math.round
    size = desired - delta + np.where(delta > 0, _below(bits32, np.maximum(2 * delta, 1)), 0)
    return np.where(current > average, 0, size)


def _extras(seed: int, lengths_bits32: np.ndarray, variant_bits32: np.ndarray,
            current: np.ndarray, average: int) -> pa.Array:
    """NEXMark's ``nextExtra`` per row: letters up to ``average`` bytes with the rest."""
    table, _ = _texts(seed, _T_EXTRA, 0, EXTRA_LENGTHS, EXTRA_VARIANTS)
    pick = _extra_lengths(lengths_bits32, current, average) * EXTRA_VARIANTS
    pick += _below(variant_bits32, EXTRA_VARIANTS)
    return table.take(pa.array(pick))


@functools.lru_cache(maxsize=8)
def _bid_extras(seed: int) -> pa.Array:
    """The table of bid extras: every length NEXMark's rule gives a bid (all bids have the
    same fixed part), BID_EXTRA_VARIANTS of each; a uniform pick follows the rule."""
    desired = AVG_BID_BYTES - BID_FIXED_BYTES
    delta = math.floor(desired * 0.2 + 0.5)
    return _texts(seed, _T_BID_EXTRA, desired - delta, desired + delta, BID_EXTRA_VARIANTS)[0]


@functools.lru_cache(maxsize=8)
def _channels(seed: int) -> tuple[pa.Array, pa.Array, np.ndarray]:
    """Channel names and their URLs: CHANNELS ordinary channels ``channel-<n>`` (nine in
    ten URLs end with ``&channel_id=<|Integer.reverse(n)|>``), then the HOT_CHANNELS; the
    URLs' three path parts are NEXMark's ``nextString(5, '_')``. And the slots a bid picks
    its channel from, uniformly: nexmark-flink's odds (1 - 1/HOT_CHANNELS_RATIO for a hot
    channel, each equally likely, else any channel) as entries of the tables."""
    count = CHANNELS + len(HOT_CHANNELS)
    index = np.arange(count, dtype=np.int64)
    parts = [_next_string(seed, _T_CHANNEL + s, _low(draw(index, seed ^ _T_CHANNEL, s)), 5,
                          variants=64, special=_UNDERSCORE)[0] for s in (_S_B, _S_C, _S_D)]
    base = pc.binary_join_element_wise("https://www.nexmark.com", *parts,
                                       "item.htm?query=1", "/")
    n = np.arange(CHANNELS, dtype=np.uint32)
    reversed_bits = np.zeros(CHANNELS, dtype=np.uint32)
    for bit in range(32):
        reversed_bits |= ((n >> np.uint32(bit)) & np.uint32(1)) << np.uint32(31 - bit)
    channel_id = pc.cast(pa.array(np.abs(reversed_bits.view(np.int32).astype(np.int64))),
                         pa.string())
    with_id = pc.binary_join_element_wise(base[:CHANNELS], channel_id, "&channel_id=")
    tagged = _below(_low(draw(index[:CHANNELS], seed ^ _T_CHANNEL, _S_A)), 10) > 0
    urls = pa.concat_arrays([pc.if_else(pa.array(tagged), with_id, base[:CHANNELS]),
                             base[CHANNELS:]])
    names = pa.concat_arrays([
        pc.binary_join_element_wise("channel", pc.cast(pa.array(n.astype(np.int64)), pa.string()),
                                    "-"),
        pa.array(HOT_CHANNELS, pa.string())])
    hot_slots = CHANNELS * (HOT_CHANNELS_RATIO - 1)
    slots = np.concatenate([np.arange(CHANNELS),
                            CHANNELS + np.arange(hot_slots) * len(HOT_CHANNELS) // hot_slots])
    return names, urls, slots.astype(np.int16)   # small, so that picks stay in cache


_PERSON_NAMES = pa.array([f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES])
_CITIES = pa.array(US_CITIES)
_STATES = pa.array(US_STATES)


# ------------------------------------------------------------------------------ events


def last_base0_person_id(ids: np.ndarray) -> np.ndarray:
    """The newest person id (from 0) at event ``ids``: this event's own if it is a person."""
    return ids // PROPORTION_DENOMINATOR * PERSON_PROPORTION + np.minimum(
        ids % PROPORTION_DENOMINATOR, PERSON_PROPORTION - 1)


def last_base0_auction_id(ids: np.ndarray) -> np.ndarray:
    """The newest auction id (from 0) at event ``ids``: this event's own if it is an
    auction (-1 before the first auction)."""
    epoch, offset = np.divmod(ids, PROPORTION_DENOMINATOR)
    offset = offset - PERSON_PROPORTION
    before = offset < 0   # a person: the last auction of the previous run
    epoch = epoch - before
    offset = np.where(before, AUCTION_PROPORTION - 1,
                      np.minimum(offset, AUCTION_PROPORTION - 1))
    return epoch * AUCTION_PROPORTION + offset


def event_time_ms(ids: np.ndarray, source, out: np.ndarray | None = None) -> np.ndarray:
    """Each event's time: ``first_event_time_ms + i * 1000 // events_per_second``, minus a
    jitter uniform in ``0..out_of_order_ms`` (into ``out`` if given)."""
    t = np.multiply(ids, 1000, out=out)
    t //= source.events_per_second
    t += source.first_event_time_ms
    if source.out_of_order_ms:
        t -= _below(_low(draw(ids, source.seed, _S_TIME)), source.out_of_order_ms + 1)
    return t


def _timestamps(ms: np.ndarray) -> pa.Array:
    return pa.array(ms, pa.int64()).view(TIME)


def _random_person(bits32: np.ndarray, last_person: np.ndarray, people: int) -> np.ndarray:
    """Beam's ``nextBase0PersonId``: one of the ``people`` newest persons, or one of the
    PERSON_ID_LEAD next ones, not yet created."""
    known = last_person + 1
    active = np.minimum(known, people)
    return known - active + _below(bits32, active + PERSON_ID_LEAD)


def _bounded(h: np.ndarray, n: int, out: np.ndarray, high: bool = False) -> np.ndarray:
    """``_below`` of the low (or high) half of ``h``, into ``out`` (uint64), as int64."""
    if high:
        np.right_shift(h, _U(32), out=out)
    else:
        np.bitwise_and(h, _LOW32, out=out)
    out *= _U(n)
    out >>= _U(32)
    return out.view(np.int64)


def bids(ids: np.ndarray, source) -> pa.RecordBatch:
    """The bids at event indices ``ids`` (int64, each a bid's index). The hot path of the
    generator: three draws for a bid's eight choices, every array from :func:`empty` and
    computed in place, scalar spans once past the first ``people`` persons and ``auctions``
    auctions."""
    n, seed = len(ids), source.seed
    h, scratch, bits = empty(n, _U), empty(n, _U), empty(n, _U)
    last_person = np.floor_divide(ids, PROPORTION_DENOMINATOR, out=empty(n))  # 1 person a run
    last_auction = np.multiply(last_person, AUCTION_PROPORTION, out=empty(n))
    last_auction += AUCTION_PROPORTION - 1
    warm = n and int(ids.min()) // PROPORTION_DENOMINATOR >= max(source.people,
                                                                 source.auctions)

    # Draw A: hot auction (bits 0-15), hot bidder (16-31), price (32-63).
    draw(ids, seed, _S_A, h, scratch)
    np.bitwise_and(h, _U(0xFFFF), out=bits)
    hot_auction = np.greater_equal(bits, _U(_hot_threshold(source.hot_auction_ratio, 16)),
                                   out=empty(n, np.bool_))
    np.bitwise_and(h, _U(0xFFFF0000), out=bits)
    hot_bidder = np.greater_equal(bits, _U(_hot_threshold(source.hot_bidder_ratio, 16) << 16),
                                  out=empty(n, np.bool_))
    price = _price(h, bits, out=empty(n))

    # Draw B: which auction (low half) and which bidder (high half) when not hot.
    draw(ids, seed, _S_B, h, scratch)
    if warm:
        auction = np.add(_bounded(h, source.auctions + 1 + AUCTION_ID_LEAD, bits),
                         last_auction, out=empty(n))
        auction -= source.auctions
        bidder = np.add(_bounded(h, source.people + PERSON_ID_LEAD, bits, high=True),
                        last_person, out=empty(n))
        bidder += 1 - source.people
    else:
        oldest = np.maximum(last_auction - source.auctions, 0)
        auction = oldest + _below(_low(h), last_auction - oldest + 1 + AUCTION_ID_LEAD)
        bidder = _random_person(_high(h), last_person, source.people)
    last_auction //= HOT_BATCH
    last_auction *= HOT_BATCH
    np.copyto(auction, last_auction, where=hot_auction)
    last_person //= HOT_BATCH
    last_person *= HOT_BATCH
    last_person += 1
    np.copyto(bidder, last_person, where=hot_bidder)
    auction += FIRST_AUCTION_ID
    bidder += FIRST_PERSON_ID

    # Draw C: the channel (low half) and the extra (high half).
    draw(ids, seed, _S_C, h, scratch)
    names, urls, slots = _channels(seed)
    pick = pa.array(np.take(slots, _bounded(h, len(slots), bits), out=empty(n, slots.dtype)))
    channel, url = names.take(pick), urls.take(pick)
    extras = _bid_extras(seed)
    extra = extras.take(pa.array(_bounded(h, len(extras), bits, high=True)))
    return pa.RecordBatch.from_arrays(
        [pa.array(auction), pa.array(bidder), pa.array(price), channel, url,
         _timestamps(event_time_ms(ids, source, out=empty(n))), extra],
        schema=SCHEMAS["bid"])


def auctions(ids: np.ndarray, source) -> pa.RecordBatch:
    """The auctions at event indices ``ids`` (int64, each an auction's index)."""
    seed = source.seed
    last_person = last_base0_person_id(ids)
    h = draw(ids, seed, _S_A)
    seller = np.where(_low(h) >= _U(_hot_threshold(source.hot_seller_ratio)),
                      last_person // HOT_BATCH * HOT_BATCH,
                      _random_person(_high(h), last_person, source.people))
    h = draw(ids, seed, _S_B)
    category = FIRST_CATEGORY_ID + _below(_low(h), NUM_CATEGORIES)
    name, name_lengths = _next_string(seed, _T_NAME, _high(h), 20, NAME_VARIANTS)
    initial_bid = _price(draw(ids, seed, _S_C))
    h = draw(ids, seed, _S_D)
    reserve = initial_bid + _price(h)
    description, description_lengths = _next_string(seed, _T_DESCRIPTION, _low(h), 100,
                                                     DESCRIPTION_VARIANTS)
    # An auction lasts on average as long as it takes to create `auctions` more of them.
    date_time = event_time_ms(ids, source)
    ahead = source.auctions * PROPORTION_DENOMINATOR // AUCTION_PROPORTION
    horizon = ((ids + ahead) * 1000 // source.events_per_second
               - ids * 1000 // source.events_per_second)
    h = draw(ids, seed, _S_E)
    expires = date_time + 1 + (h % np.maximum(2 * horizon, 1).view(_U)).view(np.int64)
    current = AUCTION_FIXED_BYTES + name_lengths + description_lengths
    h = draw(ids, seed, _S_F)
    extra = _extras(seed, _low(h), _high(h), current, AVG_AUCTION_BYTES)
    return pa.RecordBatch.from_arrays(
        [pa.array(last_base0_auction_id(ids) + FIRST_AUCTION_ID), name, description,
         pa.array(initial_bid), pa.array(reserve), _timestamps(date_time), _timestamps(expires),
         pa.array(seller + FIRST_PERSON_ID), pa.array(category), extra],
        schema=SCHEMAS["auction"])


def persons(ids: np.ndarray, source) -> pa.RecordBatch:
    """The persons at event indices ``ids`` (int64, each a person's index)."""
    seed = source.seed
    h = draw(ids, seed, _S_A)
    name = _PERSON_NAMES.take(pa.array(_below(_low(h), len(_PERSON_NAMES))))
    city = _CITIES.take(pa.array(_below(_high(h), len(US_CITIES))))
    h = draw(ids, seed, _S_B)
    state = _STATES.take(pa.array(_below(_low(h), len(US_STATES))))
    local, local_lengths = _next_string(seed, _T_LOCAL, _high(h), 7, EMAIL_VARIANTS)
    h = draw(ids, seed, _S_C)
    domain, domain_lengths = _next_string(seed, _T_DOMAIN, _low(h), 5, EMAIL_VARIANTS)
    email = pc.binary_join_element_wise(local, pc.binary_join_element_wise(domain, "com", "."),
                                        "@")
    # Four groups of four digits, each from 16 bits reduced to 0..9999.
    cards = draw(ids, seed, _S_D)
    groups = np.stack([_below(((cards >> _U(16 * g)) & _U(0xFFFF)) << _U(16), 10_000)
                       for g in range(4)], axis=1)
    card = np.full((len(ids), 4, 5), _SPACE, dtype=np.uint8)
    card[:, :, :4] = groups[:, :, None] // np.array([1000, 100, 10, 1]) % 10 + ord("0")
    credit_card = pa.StringArray.from_buffers(
        len(ids), pa.py_buffer(np.arange(0, 19 * (len(ids) + 1), 19, dtype=np.int32)),
        pa.py_buffer(card.reshape(len(ids), 20)[:, :19].copy()))
    current = (8 + string_lengths(name) + local_lengths + domain_lengths + 5 + 19
               + string_lengths(city) + string_lengths(state))
    extra = _extras(seed, _low(draw(ids, seed, _S_E)), _high(h), current, AVG_PERSON_BYTES)
    return pa.RecordBatch.from_arrays(
        [pa.array(last_base0_person_id(ids) + FIRST_PERSON_ID), name, email, credit_card, city,
         state, _timestamps(event_time_ms(ids, source)), extra],
        schema=SCHEMAS["person"])


EVENTS = {"person": persons, "auction": auctions, "bid": bids}
