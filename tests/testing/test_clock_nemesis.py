"""Clock skew under a running job (found by the nemesis campaign's clock kind): a reference
table's ``reload_every`` is a processing-time timer, and it was measured on the wall clock,
so a clock stepped back (NTP, a VM restored, an operator) stopped every reload for as long
as the step, and a step forward reloaded at every barrier. The member's clock is really
moved while it runs (libfaketime, sparkjet.testing.nemesis.ClockSkew)."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from sparkjet.operators.table_join import ReferenceTable
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource
from sparkjet.testing import nemesis


def _table(tag: str) -> pa.Table:
    return pa.table({"key": pa.array(range(100), pa.int64()),
                     "tag": pa.array([tag] * 100)})


def test_a_reference_table_reloads_after_the_clock_steps_back(tmp_path, monkeypatch):
    reason = nemesis.missing("clock")
    if reason:
        if os.environ.get("SPARKJET_CI") == "1":
            pytest.fail(f"CI must run the clock nemesis: {reason}", pytrace=False)
        pytest.skip(reason)
    skew = nemesis.ClockSkew(tmp_path / "clock", -3600)
    for k, v in skew.env().items():
        monkeypatch.setenv(k, v)              # the member process inherits it
    path = tmp_path / "table.parquet"
    pq.write_table(_table("v1"), path)
    source = GeneratorSource(total=120_000, partitions=2, keys=100, rate=10_000,
                             batch_size=1_000)
    pipeline = (Pipeline().read_from(source)
                .join_table(ReferenceTable.from_file(path, reload_every=0.3), on="key")
                .map_batches(lambda b: b.select(["id", "tag"]))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    job = Job(pipeline, JobConfig(name="clock-reload", snapshot_store=str(tmp_path / "snaps"),
                                  snapshot_interval=0.1, max_restarts=0))
    snapshots = []

    def progress(event):
        if event["event"] == "snapshot":
            snapshots.append(event["snapshot"])
            if len(snapshots) == 2:
                skew.start()                  # the member's clock one hour back, running
                pq.write_table(_table("v2"), path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)

    try:
        job.run(on_progress=progress)
    finally:
        skew.heal()
    assert skew.injected == 1
    out = TransactionalFileSink.read(tmp_path / "out")
    assert out.num_rows == 120_000
    tags = pc.value_counts(out["tag"]).to_pylist()
    # the table written after the step was loaded: reloads went on
    assert {t["values"] for t in tags} == {"v1", "v2"}, tags
