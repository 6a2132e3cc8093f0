"""Pure-Python references for sparkjet's native kernels, written from HAZELCAST.md.

Slow and obvious on purpose: the native code must agree with these.
"""
import struct

SEED = 0x01000193
INT32_MIN = -(2**31)
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_M = 0xFFFFFFFF


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & _M


def _mix_k(k):
    return (_rotl((k * _C1) & _M, 15) * _C2) & _M


def _fmix(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M
    return h ^ (h >> 16)


def murmur3_32(data: bytes, seed: int = SEED) -> int:
    """MurmurHash3 x86_32 as a signed int."""
    h = seed
    n = len(data) // 4 * 4
    for i in range(0, n, 4):
        h ^= _mix_k(int.from_bytes(data[i : i + 4], "little"))
        h = (_rotl(h, 13) * 5 + 0xE6546B64) & _M
    tail = data[n:]
    if tail:
        h ^= _mix_k(int.from_bytes(tail, "little"))
    h = _fmix(h ^ len(data))
    return h - (1 << 32) if h & 0x80000000 else h


def partition_of_hash(h: int, partition_count: int = 271) -> int:
    """Java's rule (not the Hazelcast Python client's, which is wrong for -2**31)."""
    return 0 if h == INT32_MIN else abs(h) % partition_count


def payload(value, hz_type: str) -> bytes:
    """The payload Hazelcast hashes: Integer, Long, String or byte[]."""
    if hz_type == "integer":
        return struct.pack(">i", value)
    if hz_type == "long":
        return struct.pack(">q", value)
    raw = value.encode("utf-8") if hz_type == "string" else bytes(value)
    return struct.pack(">i", len(raw)) + raw


def partition(value, hz_type: str, partition_count: int = 271) -> int:
    return partition_of_hash(murmur3_32(payload(value, hz_type)), partition_count)


def integer_with_hash(target: int, seed: int = SEED) -> int:
    """The one int32 whose Integer payload hashes to `target`: murmur3 of a single
    4-byte block is a bijection, so every step can be run backwards."""
    inv = lambda a: pow(a, -1, 1 << 32)  # noqa: E731
    rotr = lambda x, r: _rotl(x, 32 - r)  # noqa: E731
    h = target & _M
    h ^= h >> 16
    h = (h * inv(0xC2B2AE35)) & _M
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * inv(0x85EBCA6B)) & _M
    h ^= h >> 16
    h ^= 4
    h = rotr(((h - 0xE6546B64) * inv(5)) & _M, 13)
    k = h ^ seed
    k = (rotr((k * inv(_C2)) & _M, 15) * inv(_C1)) & _M
    value = int.from_bytes(k.to_bytes(4, "little"), "big")
    return value - (1 << 32) if value & 0x80000000 else value
