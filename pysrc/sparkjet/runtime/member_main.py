"""Entry point of a member process: ``python -m sparkjet.runtime.member_main JOB EXECUTION
RESULT EVENTS`` runs one execution and writes its metrics to RESULT (progress events, one
JSON object per line, to EVENTS). Exit code 0 on success, 1 on failure."""
import json
import sys
import traceback

from sparkjet.runtime import failures
from sparkjet.runtime.member import Member
from sparkjet.runtime.observability import latencies_encoded, log_to


def main(argv: list[str]) -> int:
    job_file, execution, result_file, events_file, *rest = argv
    stop_file = rest[0] if rest else None
    from pyspark import cloudpickle

    with open(job_file, "rb") as f:
        plan, config = cloudpickle.load(f)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
