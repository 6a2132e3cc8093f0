"""The hash kernels' selection, and MurmurHash3 of raw bytes.

sparkjet hashes with the fastest kernel set the CPU runs (AVX-512, AVX2, or portable C),
chosen once per process in the one native library, so partitioning and Merkle trees
always agree. ``select_kernel`` forces another set, for parity tests and benchmarks.

>>> from sparkjet import hash
>>> hash.murmur3_bytes(b"hello", 0) == 0x248BFA47
True
>>> hash.kernel_name() in hash.available_kernels()
True
"""
from sparkjet._native import (
    HAZELCAST_SEED,
    available_kernels,
    kernel_name,
    murmur3_bytes,
    select_kernel,
)

__all__ = ["HAZELCAST_SEED", "available_kernels", "kernel_name", "murmur3_bytes", "select_kernel"]
