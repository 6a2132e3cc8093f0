"""Persistence restart without Spark (sparkjet.runtime.persistence): the settings, and what a
member and the driver do with stale slots (corrupt metadata, data from the future) and at a
force start, on real slots and a real snapshot store in a temporary folder. The restarts
themselves run on Spark: tests/spark/test_persistence.py."""
import json
import logging
import os

import pytest

from sparkjet.errors import InvalidArgumentError, StorageSlotError
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.config import open_store
from sparkjet.runtime.persistence import (
    FORCE_START,
    after_join,
    claim,
    join_report,
    recover,
)
from sparkjet.snapshot import layout
from sparkjet.snapshot.slots import StorageSlot


def _config(tmp_path, **kw):
    return JobConfig(name="persisted", snapshot_store=str(tmp_path / "store"), storage="members",
                     persistence=True, storage_dir=str(tmp_path / "slots"), **kw)


def test_the_settings_take_hazelcasts_names_and_defaults(tmp_path):
    c = _config(tmp_path)
    assert (c.validation_timeout, c.data_load_timeout, c.cluster_data_recovery_policy,
            c.auto_remove_stale_data, c.rebalance_delay) == (120.0, 900.0, "FULL_RECOVERY_ONLY",
                                                             True, 0.0)
    c = _config(tmp_path, cluster_data_recovery_policy="PARTIAL_RECOVERY_MOST_COMPLETE",
                validation_timeout=2, auto_remove_stale_data=False)
    assert c.validation_timeout == 2.0 and not c.auto_remove_stale_data
    with pytest.raises(InvalidArgumentError, match="cluster_data_recovery_policy must be one of"):
        _config(tmp_path, cluster_data_recovery_policy="PARTIAL")
    with pytest.raises(InvalidArgumentError, match="data_load_timeout must be"):
        _config(tmp_path, data_load_timeout=-1)
    with pytest.raises(InvalidArgumentError, match=r"validation_timeout .* storage is \"shared\""):
        JobConfig(snapshot_store=str(tmp_path), validation_timeout=5)
    with pytest.raises(InvalidArgumentError, match="rebalance_delay .* persistence is False"):
        JobConfig(snapshot_store=str(tmp_path), storage="members", rebalance_delay=5)
    assert JobConfig(snapshot_store=str(tmp_path)).validation_timeout is None


def _slot_with_data(config, execution: int) -> str:
    """A slot of this host holding some of ``config``'s job data, fenced at ``execution``."""
    with StorageSlot.claim(config.storage_root(), job_id=config.id, durable=True) as slot:
        slot.fence(config.id, execution)
        slot.write_table(config.id, b"not a table")
        return slot.path


@pytest.mark.parametrize("auto_remove", [True, False])
def test_a_corrupt_member_json_is_removed_or_refused(tmp_path, caplog, auto_remove):
    config = _config(tmp_path, auto_remove_stale_data=auto_remove)
    path = _slot_with_data(config, 1)
    with open(os.path.join(path, "MEMBER.json"), "w") as f:
        f.write("{not json")
    if not auto_remove:
        with pytest.raises(StorageSlotError, match=f"{path}/MEMBER.json is not a slot's"):
            claim(config, 2)
        assert os.path.isdir(path)
        return
    with caplog.at_level(logging.WARNING):
        slot, notes = claim(config, 2)
    with slot:
        assert slot.path != path and not os.path.exists(path)
        assert f"removed storage slot {path}" in caplog.text


@pytest.mark.parametrize("auto_remove", [True, False])
def test_a_corrupt_table_gives_the_jobs_data_up_or_is_refused(tmp_path, caplog, auto_remove):
    config = _config(tmp_path, auto_remove_stale_data=auto_remove)
    path = _slot_with_data(config, 1)
    table = os.path.join(path, "jobs", layout.job_dir(config.id), "TABLE.json")
    if not auto_remove:
        with pytest.raises(StorageSlotError, match=f"{table}: the partition table does not read"):
            claim(config, 2)
        assert os.path.exists(table)
        return
    with caplog.at_level(logging.WARNING):
        slot, notes = claim(config, 2)
    with slot:
        assert slot.path == path and not os.path.exists(table)
        assert notes["removed"] and table in notes["removed"][0]
        assert slot.newest_execution(config.id) == 2
        assert "is corrupt" in caplog.text and path in caplog.text


def _future_slot(config) -> str:
    """A slot that has seen execution 7 of the job (a table and a fence, no records)."""
    from sparkjet.partition_table import PartitionTable

    with StorageSlot.claim(config.storage_root(), job_id=config.id, durable=True) as slot:
        slot.fence(config.id, 7)
        slot.write_table(config.id, PartitionTable.create(
            [slot.uuid], config.partition_count, 0, groups={slot.uuid: slot.uuid}).to_bytes())
        return slot.path


@pytest.mark.parametrize("auto_remove", [True, False])
def test_a_slot_from_the_future_is_emptied_or_refused(tmp_path, auto_remove):
    """The store has registered executions up to 4; a slot has seen execution 7 of the job
    (the store is an older copy): its data is from the future. Another job's data in the
    same slot is left alone."""
    config = _config(tmp_path, auto_remove_stale_data=auto_remove)
    path = _future_slot(config)
    other = JobConfig(name="other", snapshot_store=str(tmp_path / "store"), storage="members",
                      persistence=True, storage_dir=str(tmp_path / "slots"))
    with StorageSlot.claim(other.storage_root(), job_id=other.id) as slot:
        slot.fence(other.id, 9)
    store = open_store(config)
    for e in range(5):
        store.register_execution(e)
    slot, notes = claim(config, 4)
    events = []
    with slot:
        assert slot.path == path and notes["seen"] == 7
        report = join_report(config, slot, notes, 4)
        if not auto_remove:
            with pytest.raises(StorageSlotError, match=f"storage slot {path} .* has seen "
                                                       "execution 7 .* from the future"):
                recover(config, store, None, 4, None, [report], events.append)
            return
        recovery = recover(config, store, None, 4, None, [report], events.append)
        assert list(recovery.wipe) == [0] and "from the future" in recovery.wipe[0]
        assert events[-1]["event"] == "recovery" and path in events[-1]["removed"][0]
        after_join(config, slot, {"wipe": recovery.wipe[0]}, 4)
        assert slot.newest_execution(config.id) == 4 and slot.read_table(config.id) is None
        assert slot.newest_execution(other.id) == 9       # another job's: left alone


def test_force_start_removes_the_jobs_data_and_marks_the_store(tmp_path):
    from sparkjet.pipeline import Pipeline
    from sparkjet.sinks import DiscardSink
    from sparkjet.sources import GeneratorSource

    config = _config(tmp_path)
    held = StorageSlot.claim(config.storage_root(), job_id=config.id)   # a running task's
    held.fence(config.id, 3)
    free = _future_slot(config)
    store = open_store(config)
    store.register_execution(3)
    store.close()
    job = Job(Pipeline().read_from(GeneratorSource(total=10)).write_to(DiscardSink()), config)
    with held:
        removed = job.force_start()
        job_folder = os.path.join(config.snapshot_store, layout.job_dir(config.id))
        assert os.path.join(job_folder, "log") in removed["store"]
        assert removed["slots"] == [os.path.join(free, "jobs", layout.job_dir(config.id))]
        assert len(removed["held"]) == 1 and held.path in removed["held"][0]
        assert not os.path.exists(os.path.join(free, "jobs", layout.job_dir(config.id)))
        assert json.load(open(os.path.join(job_folder, FORCE_START)))["time"] > 0
        # the next execution: every member holding the job's data empties its slot
        store = open_store(config)
        assert store.current_execution() is None
        store.register_execution(0)
        report = join_report(config, held, {"seen": 3}, 0)
        events = []
        recovery = recover(config, store, None, 0, None, [report], events.append)
        assert recovery.wipe == {0: "force start"} and recovery.start is None
        assert not os.path.exists(os.path.join(job_folder, FORCE_START))
        after_join(config, held, {"wipe": "force start"}, 0)
        assert held.newest_execution(config.id) == 0
