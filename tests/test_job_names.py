"""Messages name a job by its name, never by its hex id or its store directory (issue 14)."""
import re

import pyarrow as pa
import pytest

from sparkjet.connectors import ProcessorContext
from sparkjet.errors import FencedError, SnapshotNotFoundError
from sparkjet.runtime.config import JobConfig
from sparkjet.sinks import TransactionalFileSink
from sparkjet.snapshot_store import SnapshotStore

HEX_DIR = re.compile(r"job-[0-9a-f]{16}")


def test_the_store_names_the_job_in_its_errors(tmp_path):
    job = JobConfig(name="nightly", processing_guarantee="none").id
    store = SnapshotStore(tmp_path, job, name="nightly")
    store.register_execution(2)
    with pytest.raises(FencedError) as fenced:
        store.register_execution(1)
    with pytest.raises(FencedError) as commit:
        store.check_fence(1)
    for e in (fenced, commit):
        assert "job 'nightly'" in str(e.value)
        assert not HEX_DIR.search(str(e.value)) and f"{job:x}" not in str(e.value)
    # An explicit id that the name does not derive is shown beside the name.
    assert SnapshotStore(tmp_path, 7, name="nightly").who == "job 'nightly' [0x7]"


def test_a_store_opened_to_read_names_the_job_it_lacks(tmp_path):
    SnapshotStore(tmp_path, 1, name="other")            # the store exists, with another job
    with pytest.raises(SnapshotNotFoundError, match="no snapshots of job 'weekly'"):
        SnapshotStore(tmp_path, JobConfig(name="weekly", processing_guarantee="none").id, name="weekly", create=False)


def test_a_fenced_sink_names_the_job_whose_execution_it_refused(tmp_path):
    sink = TransactionalFileSink(tmp_path / "out")

    def ctx(execution):
        return ProcessorContext(5, execution, "sink", 0, 1, "exactly-once", job_name="orders")

    zombie = sink.open(ctx(1))
    zombie.write(pa.record_batch({"id": pa.array([1, 2], pa.int64())}))
    zombie.prepare(1)
    sink.open(ctx(2))
    with pytest.raises(FencedError, match=r"execution 1 of job 'orders' refused"):
        zombie.commit(1)
