"""The persistence campaign (sparkjet.testing.persistence_campaign, issue 25 item 3 short):
jobs whose driver and members all die, restarted by a new driver after damage to the slots
or the store, under each recovery policy.

Three rounds run by default; the others are long. Run all:
PYTHONPATH=$PWD/pysrc:$PWD/tests python -m pytest -q \
    -p no:cacheprovider -m 'long or not long' tests/testing/test_persistence_campaign.py
The long campaign: python -m sparkjet.testing.persistence_campaign --faults 200 --json
(``--standalone``: on a standalone cluster of 3 hosts)"""
import json
import random
import subprocess
import sys

import pytest
from helpers import campaigns

from sparkjet.testing import persistence_campaign as pc


def test_every_kind_is_planned_and_every_operator_taken_in_turn():
    kinds = list(pc.KINDS.values())
    planned = pc.plan(kinds, 60, random.Random(1))
    assert [k for k, _ in planned[:len(kinds)]] == kinds
    assert {op for _, op in planned} == set(pc.OPERATORS)
    assert sum(pc.FAULTS.get(k.name, 2) for k, _ in planned) >= 60
    # every recovery policy is drawn
    assert {k.policy for k in kinds} == {pc.FULL, pc.RECENT, pc.COMPLETE}


@pytest.mark.spark
@pytest.mark.long
def test_a_short_persistence_campaign_loses_and_duplicates_nothing(tmp_path):
    """One round of each kind on local[3] (each round runs Spark twice: minutes, so
    ``long``): every member and the driver killed, then a slot lost without backups (a
    refusal naming partitions), the newest snapshot lost under both partial policies at
    least once (the older one, its given-up snapshot reported) and under exactly-once (a
    refusal), corrupt and foreign metadata in a slot, the store's folder lost (rebuilt),
    a force start (also with a slot away during it, emptied when it is back). Each round
    valid: exactly once, at least once or refused as its kind says."""
    kinds = [k for k in pc.KINDS if k not in REJOIN]
    rounds = campaigns.run_cli("sparkjet.testing.persistence_campaign",
                               "PERSISTENCE-CAMPAIGN-JSON",
                               ["--faults", "21", "--seed", "3", "--kinds", ",".join(kinds),
                                "--dir", str(tmp_path)], 1800)
    assert set(rounds) == set(kinds), rounds
    # refused, or (every chunk lost had a copy elsewhere: broadcast state) restored exactly
    for k in ("slot-lost", "newest-lost-eo"):
        assert rounds[k]["refusal"] in ("RecoveryRefusedError", None), rounds[k]
    for k in ("newest-lost-recent", "newest-lost-complete"):
        assert rounds[k]["given_up"] or "nothing else" in rounds[k]["detail"], rounds[k]


#: The kinds of a member coming back (their own short run, below).
REJOIN = ("rebalance-returns", "rebalance-late", "stale-rejoin")

#: The campaign's run in the default test run (under a minute): the flows the Spark
#: persistence tests of the default run do not cover (they restart whole and refuse a lost
#: slot): a partial policy giving the newest snapshot up, the store's folder rebuilt from
#: the slots, a slot back within the rebalance delay.
SHORT = ("newest-lost-recent", "lost-metadata", "rebalance-returns")


@pytest.mark.spark
@pytest.mark.slow
def test_a_three_round_persistence_campaign_in_the_default_run(tmp_path):
    """Three rounds, one per kind of SHORT, each killing the driver and every member and
    restarting with a new driver: valid, nothing lost, duplicated or wrong (run_cli); the
    partial policy's round reports the snapshot it gave up and the rebalance round the
    slot that came back."""
    rounds = campaigns.run_cli("sparkjet.testing.persistence_campaign",
                               "PERSISTENCE-CAMPAIGN-JSON",
                               ["--faults", "6", "--seed", "3", "--kinds", ",".join(SHORT),
                                "--dir", str(tmp_path)], 900)
    assert set(rounds) == set(SHORT), rounds
    assert rounds["newest-lost-recent"]["given_up"] or "nothing else" in rounds[
        "newest-lost-recent"]["detail"], rounds
    assert "returned" in rounds["rebalance-returns"]["detail"], rounds


@pytest.mark.spark
@pytest.mark.long
def test_members_back_within_and_after_the_rebalance_delay_and_a_stale_one_synced(tmp_path):
    """One round of each kind of a member coming back: a slot away is waited for and comes
    back within ``rebalance_delay`` (nothing promoted), one comes back after it (its
    partitions promoted), and a slot that missed two snapshots is put back and synced by
    Merkle trees (bytes reported). Each exactly once."""
    rounds = campaigns.run_cli("sparkjet.testing.persistence_campaign",
                               "PERSISTENCE-CAMPAIGN-JSON",
                               ["--faults", "7", "--seed", "3", "--kinds", ",".join(REJOIN),
                                "--dir", str(tmp_path)], 1800)
    assert set(rounds) == set(REJOIN), rounds
    assert rounds["stale-rejoin"]["merkle_bytes"] > 0 or "ended" in rounds["stale-rejoin"][
        "detail"], rounds


@pytest.mark.spark
@pytest.mark.long
def test_a_driver_process_killed_with_its_jvm_and_members_restarts_exactly(tmp_path):
    """``--driver-process``: the first driver runs in a process of its own (its own local
    Spark) and is SIGKILLed with its JVM and members; a new driver restarts the job, the
    store's folder lost (rebuilt from the slots' record copies), and after a force start
    with a slot away."""
    kinds = ["restart", "lost-metadata", "force-start-away"]
    done = subprocess.run(
        [sys.executable, "-m", "sparkjet.testing.persistence_campaign", "--faults", "5",
         "--kinds", ",".join(kinds), "--driver-process", "--seed", "5", "--json",
         "--dir", str(tmp_path)], capture_output=True, text=True, timeout=1800, check=False)
    lines = [ln for ln in done.stdout.splitlines()
             if ln.startswith("PERSISTENCE-CAMPAIGN-JSON ")]
    assert lines, done.stdout[-4000:] + done.stderr[-4000:]
    found = json.loads(lines[0].split(" ", 1)[1])
    assert done.returncode == 0, done.stdout[-4000:]
    assert {r["kind"] for r in found["rounds"]} == set(kinds)
    for r in found["rounds"]:
        assert r["valid"] and r["faults"] >= 1 and "driver's process group" in r["detail"], r
        assert r["lost"] == 0 and r["duplicated"] == 0 and r["wrong"] == 0, r


@pytest.mark.spark
@pytest.mark.long
def test_on_a_standalone_cluster_every_process_killed_and_a_new_driver_restarts(tmp_path):
    """``--standalone``: 3 one-core workers, each a host with its own storage root; each
    round's first driver is a process of its own SIGKILLed with its JVM, every executor
    and Python worker of the cluster (the worker JVMs too in some rounds, restarted before
    the new run), then a host's slot removed (backups: exactly once) or the store's folder
    lost (rebuilt from the slots' record copies), and a new driver restarts the job on the
    same cluster."""
    kinds = ["restart", "slot-lost-b1", "lost-metadata"]
    rounds = campaigns.run_cli("sparkjet.testing.persistence_campaign",
                               "PERSISTENCE-CAMPAIGN-JSON",
                               ["--standalone", "--faults", "5", "--seed", "2", "--kinds",
                                ",".join(kinds), "--dir", str(tmp_path)], 1800)
    assert set(rounds) == set(kinds), rounds
    for r in rounds.values():
        assert "executor and Python processes of the cluster" in r["detail"], r
        assert "driver's process group" in r["detail"], r
    assert "removed slot" in rounds["slot-lost-b1"]["detail"], rounds
    # restored from a snapshot of the first run, not started over
    assert all(r["restored_from"] for r in rounds.values()), rounds


def test_an_at_least_once_round_counts_a_wrong_value_as_wrong():
    """A key whose count is right but whose sum is not (an event lost and another of the
    same key duplicated) is wrong under at-least-once too: the guarantee allows
    duplicates, never a loss. The round's verdict used to count only unexpected keys
    there, so such output passed."""
    import pyarrow as pa

    from sparkjet import verify

    expected = pa.table({"key": [1, 2, 3], "count": [2, 2, 2], "sum": [3.0, 5.0, 7.0]})
    actual = pa.table({"key": [1, 2, 3], "count": [2, 3, 2], "sum": [3.0, 7.5, 6.0]})
    report = verify.check_aggregates(expected, actual, key="key", columns=["count", "sum"],
                                     guarantee="at-least-once")
    # key 2 duplicated (allowed), key 3's count right but its sum wrong
    assert pc.verdict(report, 0, "at-least-once", partial=False) == (0, 0, 1)
    assert pc.verdict(report, 0, "exactly-once", partial=False)[1:] == (1, 1)
    assert pc.verdict(report, 0, "at-least-once", partial=True) == (0, 0, 0)


def test_the_damage_aims_at_the_snapshot_the_store_committed(tmp_path):
    """The newest committed snapshot is the store's answer, not the newest a progress event
    reported: a driver of its own relays events, and a snapshot it committed just before
    the kill may not have reached the campaign (a standalone newest-lost round removed the
    older snapshot's folder, and the restart restored the newer one whole)."""
    import pyarrow as pa

    from sparkjet.snapshot.store import SnapshotStore

    with SnapshotStore(str(tmp_path), 77) as store:
        store.register_execution(0)
        for sid in (1, 2):
            w = store.writer(snapshot_id=sid, execution_id=0)
            w.write_table("counts", pa.table({"key": [1, 2], "n": [sid, sid]}), key="key")
            w.commit()
    assert pc.newest_committed(tmp_path, 77, seen=1) == 2
    assert pc.newest_committed(tmp_path / "nowhere", 77, seen=1) == 1


def test_a_resumed_campaign_goes_on_after_the_rounds_done(tmp_path):
    """--resume reads the rounds a run wrote (a last line cut short by a kill left out),
    and refuses a run with other settings, naming them."""
    done = [pc.RoundResult("restart", "keyed", faults=1, valid=True),
            pc.RoundResult("slot-lost", "dedup", faults=2, refusal="RecoveryRefusedError",
                           valid=True)]
    log = tmp_path / "rounds.jsonl"
    log.write_text("".join(json.dumps(pc.asdict(r)) + "\n" for r in done) + '{"kind": "re')
    assert pc.read_rounds(log) == done
    assert pc.read_rounds(tmp_path / "absent.jsonl") == []
    settings = {"faults": 200, "seed": 1, "kinds": None}
    pc.check_settings(tmp_path / "campaign.json", settings, resume=False)
    pc.check_settings(tmp_path / "campaign.json", settings, resume=True)
    with pytest.raises(pc.InvalidArgumentError, match="--seed 1 there, 2 now"):
        pc.check_settings(tmp_path / "campaign.json", {**settings, "seed": 2}, resume=True)
    # more faults extend the plan: its first rounds are the same
    kinds = list(pc.KINDS.values())
    assert pc.plan(kinds, 300, random.Random(1))[:40] == pc.plan(kinds, 200, random.Random(1))[:40]
    pc.check_settings(tmp_path / "campaign.json", {**settings, "faults": 300}, resume=True)
    with pytest.raises(pc.InvalidArgumentError, match="--faults 300 there, 100 now"):
        pc.check_settings(tmp_path / "campaign.json", {**settings, "faults": 100}, resume=True)


@pytest.mark.parametrize("kind", ["newest-lost-recent", "corrupt-metadata", "slot-lost"])
def test_the_damage_hits_the_rounds_job_not_an_earlier_rounds(tmp_path, kind):
    """On a standalone cluster the hosts' slots keep the data of earlier rounds' jobs:
    the damage took the first job folder it found, or any job's folder of the snapshot
    id, and the round then restored its own job whole (two rounds of a 200-fault run did).
    Only the round's job's data is damaged now; a slot is lost by the bytes of that job."""
    from types import SimpleNamespace

    from sparkjet.runtime import JobConfig
    from sparkjet.snapshot import layout

    mine = JobConfig(name="round-0002", processing_guarantee="none")
    other = 0x0123456789abcdef
    slots = []
    for n, (own_bytes, other_bytes) in enumerate([(10, 5000), (900, 10)]):
        slot = tmp_path / f"slot-{n}"
        for job_id, size in ((mine.id, own_bytes), (other, other_bytes)):
            folder = slot / "jobs" / layout.job_dir(job_id)
            snap = folder / "replicas" / "snapshots" / layout.snapshot_dir(3, 0)
            snap.mkdir(parents=True)
            (snap / "v.chunks").write_bytes(b"x" * size)
            (folder / "FENCE").write_text("0")
            (folder / "TABLE.json").write_text("{}")
            (folder / "records").mkdir()
        slots.append(slot)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    said = pc.damage(pc.KINDS[kind], slots, tmp_path / "store",
                     SimpleNamespace(config=mine), random.Random(4), committed=3)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    changed = {p for p in before if after.get(p) != before[p]}
    assert changed, said
    own = [p for p in changed if layout.job_dir(mine.id) in p.parts]
    if kind == "slot-lost":         # the slot holding most of the round's job's bytes
        assert said == "removed slot slot-1" and not (tmp_path / "slot-1").exists()
    else:
        assert changed == set(own), said
