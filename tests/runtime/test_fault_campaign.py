"""The fault campaign, CI-sized: a real SIGKILL of a job member in every (guarantee, sink,
pipeline) round of the CI plan: every pipeline shape into both sinks under exactly-once,
the five dataflow shapes (keyed, events, windowed, union, branching) into the file sink and
the keyed one into SQLite under at-least-once, and the keyed pipeline under none (21 rounds
of the plan's 42). ``python -m pytest -m long`` runs the
whole plan (42 rounds), and the long one is a script: `python -m sparkjet.campaign --kills
1000`; each operator's own kill tests (tests/operators/test_stateful.py, test_windows.py, ...)
kill several times in one run. Exactly-once: nothing lost, nothing duplicated, no window
emitted twice, final state equal to a failure-free run. At-least-once: nothing lost. None:
reported as it is."""
import pytest

from sparkjet.testing.campaign import PLAN, WINDOWED, run_campaign, summary

#: The plan in CI (each round costs ~5 s). Guarantee "none" promises only that nothing
#: unexpected comes out, which one keyed pipeline into files shows. Under at-least-once the
#: SQLite sink runs the keyed pipeline only (the sinks are the same code whatever feeds them:
#: the shapes differ in the runtime, which the file sink's rounds run), and the operators'
#: rounds (state, dedup, join, enrich) are left to their own at-least-once kill tests:
#: test_stateful.py::test_map_state_job_survives_kill_9 and ::test_dedup_job_survives_kill_9,
#: test_interval_join.py::test_join_job_survives_kill_9, test_table_join.py::
#: test_job_survives_kill_9. The whole plan: ``python -m pytest -m long`` runs the ``whole``
#: case below, or ``python -m sparkjet.testing.campaign``.
CI_PLAN = [r for r in PLAN if r[0] == "exactly-once" or r[1:] == ("file", "keyed")
           or (r[0] == "at-least-once" and r[2] in ("keyed", "events", *WINDOWED)
               and (r[1] == "file" or r[2] == "keyed"))]


@pytest.mark.slow
@pytest.mark.parametrize("plan", [pytest.param(CI_PLAN, id="ci"),
                                  pytest.param(PLAN, id="whole", marks=pytest.mark.long)])
def test_a_kill_in_every_round_of_the_plan(tmp_path, capsys, plan):
    results = run_campaign(tmp_path, total_kills=len(plan), seed=11,
                           progress=lambda line: None, plan=plan)
    with capsys.disabled():
        print("\n" + summary(results))
    # A round whose job ended before its kill came has none (rare): most must have one.
    assert sum(r.kills for r in results) >= 0.9 * len(plan)
    assert {(r.guarantee, r.sink, r.pipeline) for r in results} == set(plan)
    for r in results:
        assert r.restarts >= r.kills, "every kill is followed by a restart"
        if r.guarantee == "exactly-once":
            assert (r.report.valid and r.report.lost_count == 0
                    and r.report.duplicated_count == 0 and r.duplicate_rows == 0), str(r.report)
        elif r.guarantee == "at-least-once":
            assert r.report.lost_count == 0 and r.report.valid_for("at-least-once"), str(r.report)
        else:
            assert r.report.unexpected_count == 0, str(r.report)
