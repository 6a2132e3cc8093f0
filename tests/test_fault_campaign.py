"""The fault campaign, CI-sized: ≥ 100 real SIGKILLs of job members across all three
guarantees, both sinks and every pipeline shape, 3 kills in each (guarantee, sink,
pipeline) round of the plan (`python -m sparkjet.campaign --kills 1000` runs the long
one). Exactly-once: nothing
lost, nothing duplicated, no window emitted twice, final state equal to a failure-free
run. At-least-once: nothing lost. None: reported as it is."""
import pytest

from sparkjet.testing.campaign import PLAN, run_campaign, summary


@pytest.mark.slow
def test_campaign_of_100_kills(tmp_path, capsys):
    results = run_campaign(tmp_path, total_kills=max(100, 3 * len(PLAN)), seed=11,
                           progress=lambda line: None)
    with capsys.disabled():
        print("\n" + summary(results))
    assert sum(r.kills for r in results) >= 100
    assert {(r.guarantee, r.sink, r.pipeline) for r in results} == set(PLAN)
    for r in results:
        assert r.restarts >= r.kills, "every kill is followed by a restart"
        if r.guarantee == "exactly-once":
            assert (r.report.valid and r.report.lost_count == 0
                    and r.report.duplicated_count == 0 and r.duplicate_rows == 0), str(r.report)
        elif r.guarantee == "at-least-once":
            assert r.report.lost_count == 0 and r.report.valid_for("at-least-once"), str(r.report)
        else:
            assert r.report.unexpected_count == 0, str(r.report)
