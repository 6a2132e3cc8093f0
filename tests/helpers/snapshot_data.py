"""Keyed state and entries made from a seed, for the snapshot store's tests and their
crash and zombie children."""
import numpy as np
import pyarrow as pa


def state(seed: int, n: int = 3000) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"key": pa.array(rng.permutation(n * 3)[:n], pa.int64()),
                     "count": rng.integers(0, 100, n), "sum": rng.random(n)})


def entries(seed: int, n: int = 500):
    rng = np.random.default_rng(seed)
    keys = [f"k{seed}-{i}".encode() for i in range(n)]
    return keys, [rng.bytes(int(rng.integers(0, 60))) for _ in range(n)]
