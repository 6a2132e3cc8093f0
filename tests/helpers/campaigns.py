"""The slot campaigns (storage, persistence) run as a person runs them: ``python -m`` with
``--json``, every round checked for the promises every kind keeps."""
import json
import subprocess
import sys


def run_cli(module: str, tag: str, args: list[str], timeout: float) -> dict[str, dict]:
    """Runs ``python -m module args --json``; asserts it exited 0 and every round is valid
    with at least one fault, nothing lost, duplicated or wrong. Returns the rounds by
    kind (the JSON line tagged ``tag``)."""
    done = subprocess.run([sys.executable, "-m", module, *args, "--json"],
                          capture_output=True, text=True, timeout=timeout, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(f"{tag} ")]
    assert lines, done.stdout[-4000:] + done.stderr[-4000:]
    found = json.loads(lines[0].split(" ", 1)[1])
    assert done.returncode == 0, done.stdout[-4000:]
    for r in found["rounds"]:
        assert r["valid"] and r["faults"] >= 1, r
        assert r["lost"] == 0 and r["duplicated"] == 0 and r["wrong"] == 0, r
    return {r["kind"]: r for r in found["rounds"]}
