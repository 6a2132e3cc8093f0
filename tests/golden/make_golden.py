"""Writes the golden snapshot chunk files the tests must keep decoding byte for byte.

Run once per format version or new codec (`python tests/golden/make_golden.py`) and commit
the output; it writes only the files that do not exist yet, as an existing file must never
be regenerated: old snapshots must stay readable.
"""
from pathlib import Path

import pyarrow as pa

from sparkjet.snapshot.chunks import ChunkEncoder

HERE = Path(__file__).parent
JOB, SNAPSHOT, VERTEX = 0x5EED, 3, 7


def golden_table() -> pa.Table:
    keys = list(range(-20, 20)) + [2**40, -(2**62)]
    return pa.table({
        "key": pa.array(keys, pa.int64()),
        "name": pa.array([f"k{k}-ключ" for k in keys]),
        "count": pa.array([abs(k) % 7 for k in keys], pa.int64()),
        "sum": pa.array([k * 0.5 for k in keys], pa.float64()),
    })


def golden_entries() -> tuple[list[bytes], list[bytes]]:
    keys = [f"key-{i}".encode() for i in range(30)] + [b"", b"\x00\xff"]
    values = [bytes([i % 256]) * (i * 7 % 40) for i in range(len(keys))]
    return keys, values


def main() -> None:
    table = golden_table()
    keys, values = golden_entries()
    def write(name: str, chunks) -> None:
        if not (HERE / name).exists():
            (HERE / name).write_bytes(b"".join(c.to_bytes() for c in chunks))

    # ("blosc2-lz4" writes entries as "lz4" does: its file would be the same)
    for codec in ("raw", "lz4", "blosc2-lz4"):
        enc = ChunkEncoder(JOB, SNAPSHOT, VERTEX, partition_count=5, chunk_size=300, codec=codec)
        write(f"table-{codec}.v1.chunks",
              enc.table(table, key="key") + enc.broadcast_table(table.slice(0, 3)))
        if codec != "blosc2-lz4":
            write(f"entries-{codec}.v1.chunks",
                  enc.entries(keys, values) + enc.broadcast_entries(keys[:2], values[:2]))


if __name__ == "__main__":
    main()
