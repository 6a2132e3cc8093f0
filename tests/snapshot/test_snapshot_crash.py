"""Crash safety with real kills: a writer process dies by SIGKILL at chosen I/O calls across
chunk writes, the validation record and the commit event; afterwards the last complete
snapshot is always the previous or the new one, never a mix, and restores exactly."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.snapshot_data import entries, state

from sparkjet.snapshot.store import SnapshotStore

CHILD = Path(__file__).parent / "snapshot_crash_child.py"


@pytest.fixture
def run_child():
    """Runs a writer process that dies at a chosen I/O call: forked, one per call, by the
    child script's server (which has made the imports once), so each writer costs its
    writing, not a new interpreter. Returns its return code, stdout and stderr."""
    server = subprocess.Popen([sys.executable, str(CHILD), "--serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def run(root, snapshot_id, execution_id, kill_at, mode="before"):
        server.stdin.write(json.dumps([str(root), snapshot_id, execution_id, kill_at, mode])
                           + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        assert answer, f"the writers' server ended (exit {server.wait(10)})"
        return SimpleNamespace(**json.loads(answer))

    yield run
    server.stdin.close()
    assert server.wait(60) == 0


def check_store(root, allowed):
    store = SnapshotStore(root, job_id=9)
    latest = store.latest_complete()
    assert latest is not None and latest.snapshot_id in allowed, (latest, allowed)
    sid = latest.snapshot_id
    agg = store.restore("agg")
    assert agg.table.sort_by("key").equals(state(sid).sort_by("key")), "restored state is a mix"
    assert agg.broadcast_table.sort_by("key").equals(state(sid, 5).sort_by("key"))
    keys, values = store.restore("py").entries
    assert sorted(zip(keys.to_pylist(), values.to_pylist())) == sorted(zip(*entries(sid)))
    store.verify()
    store.close()
    return sid


def test_kill_at_every_kind_of_point(tmp_path, run_child):
    root = tmp_path / "store"
    first = run_child(root, 0, 0, "none")
    assert first.returncode == 0, first.stderr
    counts = json.loads(first.stdout)
    assert {"register event", "chunk files", "finish", "validation record", "commit event"} <= set(
        counts), counts
    bulk = counts["chunk files"]
    assert bulk > 200
    # Every call of the short phases, and points spread over the chunk writes (kept below
    # the first run's count with a margin: the count varies a little with the data).
    plan = [(f"{p}:{i}", "before") for p in ("register event", "finish", "validation record",
                                             "commit event") for i in range(counts[p])]
    # (each point is a child process: 20 and 8 spread over the writes run the same code at
    # as many positions as 40 and 12 did, in two thirds of the time)
    plan += [(f"chunk files:{i * (bulk - 100) // 20}", "before") for i in range(20)]
    plan += [(f"chunk files:{7 + i * (bulk - 100) // 8}", "mid") for i in range(8)]
    assert len(set(plan)) >= 30

    latest, execution, seen = 0, 1, {}
    for kill_at, mode in plan:
        target = latest + 1
        result = run_child(root, target, execution, kill_at, mode)
        execution += 1
        assert result.returncode == -9, (kill_at, mode, result.returncode, result.stderr[-2000:])
        assert (root.parent / "killed-in").read_text() == f"{kill_at.split(':')[0]} {mode}"
        seen[kill_at.split(":")[0]] = seen.get(kill_at.split(":")[0], 0) + 1
        latest = check_store(root, {latest, target})
    # A clean run after all the debris still commits, restores and cleans up.
    final = run_child(root, latest + 1, execution, "none")
    assert final.returncode == 0, final.stderr
    assert check_store(root, {latest + 1}) == latest + 1
    print(f"kill points: {len(plan)}, by phase: {seen}")
