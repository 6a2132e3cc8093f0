"""Entry point of a member process: ``python -m sparkjet.runtime.member_main JOB EXECUTION
RESULT EVENTS [STOP]`` runs one execution and writes its metrics to RESULT (progress events,
one JSON object per line, to EVENTS). Exit code 0 on success, 1 on failure.

``python -m sparkjet.runtime.member_main --standby JOB`` is a member started ahead of need
(the local runner's standby): it imports the runtime and loads the job, then waits for one
line on stdin, ``[EXECUTION, RESULT, EVENTS, STOP]`` in JSON, and runs that execution as
above; stdin closed without a line ends it at once (exit code 0)."""
import json
import os
import sys
import traceback

from sparkjet.runtime import failures
from sparkjet.runtime.local_runner import SUPERVISOR_ENV
from sparkjet.runtime.member import Member
from sparkjet.runtime.observability import latencies_encoded, log_to
from sparkjet.snapshot import chunks


def end_with_supervisor(supervisor: int | None) -> None:
    """Has the kernel SIGKILL this process when the thread that started it dies (Linux's
    ``PR_SET_PDEATHSIG``; the local runner starts it from the thread that then waits for
    it), and ends it at once if its supervisor ``supervisor`` is already gone. Without
    this, a member whose supervisor was killed (SIGKILL, SIGTERM, a closed terminal) ran on
    alone: a job with an unbounded source for ever, holding its memory and both CPUs."""
    if not supervisor:
        return
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != supervisor:
        print(f"sparkjet member: its supervisor (pid {supervisor}) is gone; ending",
              file=sys.stderr)
        exit_now(1)


def main(argv: list[str]) -> int:
    end_with_supervisor(int(os.environ.get(SUPERVISOR_ENV, "0") or 0))
    from pyspark import cloudpickle

    if argv[:1] == ["--standby"]:
        with open(argv[1], "rb") as f:
            plan, config = cloudpickle.load(f)
        chunks.warm(config.snapshot_codec)
        line = sys.stdin.readline()
        if not line.strip():
            return 0            # the supervisor needs no more members
        execution, result_file, events_file, stop_file = json.loads(line)
        return run(plan, config, execution, result_file, events_file, stop_file)
    job_file, execution, result_file, events_file, *rest = argv
    with open(job_file, "rb") as f:
        plan, config = cloudpickle.load(f)
    chunks.warm(config.snapshot_codec)
    return run(plan, config, execution, result_file, events_file, rest[0] if rest else None)


def run(plan, config, execution, result_file: str, events_file: str,
        stop_file: str | None) -> int:
    # this process's stderr is the member's log, kept when it fails
    log_to(sys.stderr, job=config.name, execution=int(execution), member=0)
    events = open(events_file, "a", buffering=1)

    def progress(event: dict) -> None:
        events.write(json.dumps(event) + "\n")

    member = Member(plan, config, int(execution), progress=progress, stop_file=stop_file)
    try:
        metrics = member.run()
    except BaseException as e:  # noqa: BLE001 - the supervisor decides; report and exit non-zero
        traceback.print_exc()
        with open(result_file.replace(".json", ".partial.json"), "w") as f:
            json.dump({**latencies_encoded(member.metrics), "failure": failures.report(member.failure or e)}, f)
        return 1
    with open(result_file, "w") as f:
        json.dump(latencies_encoded(metrics), f)
    return 0


def exit_now(code: int) -> None:
    """Ends the member process with ``code`` once its result is written, without the
    interpreter's finalization: that would close what a failed execution left open (its
    staged output files, say) after the libraries' ``atexit`` hooks shut their clients
    down, and pyarrow's S3 output streams, closed then, wait forever (the supervisor with
    them). Found by the nemesis campaign's S3 outages."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass    # a closed or broken stream: nothing more can be said on it
    os._exit(code)


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 - said on stderr, the member's log; exit non-zero
        traceback.print_exc()
        code = 1
    exit_now(code)
