"""Smoke test of an installed wheel, run by .ci/run from outside the source tree: the
compiled module loads, and each area of the native library answers correctly."""
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

import sparkjet
from sparkjet import _native, hash
from sparkjet.operators.rolling import KeyedAggregator
from sparkjet.runtime.aligner import BarrierAligner
from sparkjet.snapshot.chunks import ChunkEncoder, decode_table, read_chunks

installed = Path(sparkjet.__file__).resolve()
assert "site-packages" in installed.parts, f"sparkjet imported from {installed}, not a wheel"
assert not installed.is_relative_to(Path(__file__).resolve().parents[1]), installed
assert Path(_native.__file__).suffix in (".so", ".pyd"), _native.__file__

# Hazelcast partitions (HAZELCAST.md): "hello" -> 270, Integer 42 -> 175.
assert sparkjet.partition_ids(pa.array(["hello", "a"])).to_pylist() == [270, 73]
assert sparkjet.partition_ids([42], key_type="integer").to_pylist() == [175]
assert hash.murmur3_bytes(b"hello", 0) == 0x248BFA47
assert hash.kernel_name() in hash.available_kernels()
assert Path(sparkjet.get_include(), "sparkjet", "hash.h").is_file()

table = pa.table({"k": np.arange(1000, dtype=np.int64), "v": np.arange(1000.0)})
encoder = ChunkEncoder(job_id=1, snapshot_id=1, vertex=0)
data = b"".join(c.to_bytes() for c in encoder.table(table, key="k"))
rows = sum(decode_table(h, p).num_rows for _, h, p in read_chunks(data))
assert rows == 1000, rows

agg = KeyedAggregator("k", {"n": "count"})
out = agg.update(pa.record_batch({"k": [1, 2, 1]}))
assert out.to_pylist() == [{"k": 1, "n": 2}, {"k": 2, "n": 1}]

aligner = BarrierAligner(1)
aligner.put(0, "x")
assert aligner.poll() == ("item", 0, "x")

merkle = sparkjet.MerkleForest(7, depth=4)
merkle.add(table, key="k")
assert sparkjet.merkle.diff(merkle, merkle).leaf_count == 0

print(f"sparkjet {sparkjet.__version__} from {installed.parent}: ok "
      f"(kernel {hash.kernel_name()}, python {sys.version.split()[0]})")
