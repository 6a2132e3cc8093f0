"""On Spark, the ``restored`` event of a restarted execution (issue 24 item 6): sent by the
driver's coordinator once every member has rebuilt its operators' state, so after the
restart and before the restored execution's first commit, with the keys restored by all
members and the slowest member's phases. Before the change the driver sent it as soon as
the members had polled once, operators not yet rebuilt, without ``members`` or ``keys``
(this test failed on them). A real SIGKILL of a member's Python worker."""
import os
import signal

from helpers.jobs import exact, keyed_spark_job

from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource


def test_restored_after_a_kill_counts_every_members_keys_before_the_first_commit(spark, tmp_path):
    keys = 20_000
    source = GeneratorSource(total=1_000_000, partitions=4, keys=keys, batch_size=10_000,
                             rate=200_000)
    # the shared store: the test reads each snapshot's state from it between executions
    job = keyed_spark_job(tmp_path, source, "spark", max_restarts=2, storage="shared")
    events = []

    held = []

    def progress(event):
        events.append(event)
        if event["event"] == "snapshot" and event["snapshot"] == 3 and \
                not any(e["event"] == "restart" for e in events):
            os.kill(job.member_pids[1], signal.SIGKILL)
        elif event["event"] == "restart":
            # between executions: the newest complete snapshot is the one restored next
            with SnapshotStore(job.config.snapshot_store, job.config.id, create=False) as store:
                state = store.restore("aggregate")
                held.append((store.complete()[-1].snapshot_id, state.table.num_rows))

    result = job.run(spark, on_progress=progress)
    assert result.restarts == 1
    kinds = [e["event"] for e in events]
    after = kinds[kinds.index("restart"):]
    assert after.count("restored") == 1, after
    assert after.index("restored") < after.index("snapshot"), after
    restored = events[kinds.index("restored")]
    snapshot, rows = held[0]
    assert snapshot >= 3 and restored["snapshot"] == snapshot
    assert result.executions[1]["restored_from"] == snapshot
    assert 0 < rows <= keys
    assert restored["members"] == 2 and restored["keys"] == rows, restored
    assert 0 <= restored["rebuild_s"] <= restored["seconds"]
    report = exact(tmp_path, source)
    assert report.valid and report.lost_count == 0 and report.duplicated_count == 0, str(report)
