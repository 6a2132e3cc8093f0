"""Uses sparkjet's typed public API the way a user's code would; .ci/run checks this file
with ``mypy --strict`` against the installed wheel (its .pyi stubs and py.typed), so a
stub that disagrees with the package, or a public signature that loses its types, fails."""
import numpy as np
import pyarrow as pa

import sparkjet
from sparkjet import _native, hash
from sparkjet.errors import InvalidArgumentError, SparkjetError

ids: pa.Int32Array = sparkjet.partition_ids(pa.array(["hello", "a"]), 271)
hashes: pa.Int32Array = sparkjet.murmur3_32([1, 2, 3], key_type="integer")
partitioner = sparkjet.Partitioner(271, key=["a", "b"])
count: int = partitioner.partition_count

kernel: str = hash.kernel_name()
kernels: list[str] = hash.available_kernels()
hash.select_kernel(None)
h: int = hash.murmur3_bytes(b"hello", 0)

out = np.zeros(3, np.int32)
_native.partitions_from_hashes(np.array([1, 2, 3], np.int32), 271, out)
slots = np.zeros(2, np.int64)
keymap = _native.KeyMap(16)
keymap.upsert(np.array([5, 6], np.int64), slots)
size: int = len(keymap)
aligner = _native.BarrierAligner(2, "exactly-once")
accepted: bool = aligner.offer(0, "item")
event = aligner.poll()

include: str = sparkjet.get_include()
version: str = sparkjet.__version__

try:
    sparkjet.partition_ids([1], 0)
except InvalidArgumentError as e:
    error: SparkjetError = e
