"""sparkjet.verify: constructed cases with known lost / duplicated / unexpected ids, the
verdict per guarantee, the Jepsen-style rendering, parity with a pure-Python reference over
random histories, keyed aggregates, and a 20 M-id run."""
import json
from collections import Counter
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkjet.errors import InvalidArgumentError, UnsupportedTypeError
from sparkjet.verify import Report, check_aggregates, check_events


def reference(attempted, acknowledged, output) -> dict:
    """The same sets, the slow obvious way."""
    att, ack, out = set(attempted), set(acknowledged), Counter(output)
    return {
        "ok": sorted(ack & out.keys()), "lost": sorted(ack - out.keys()),
        "missing": sorted(att - out.keys()), "recovered": sorted((out.keys() & att) - ack),
        "duplicated": sorted(k for k, c in out.items() if c > 1),
        "unexpected": sorted(out.keys() - att),
        "duplicated_count": sum(c - 1 for c in out.values()),
        "unexpected_count": sum(c for k, c in out.items() if k not in att),
    }


def test_known_lost_duplicated_unexpected():
    report = check_events(range(10), range(8), [0, 1, 2, 2, 2, 4, 5, 6, 7, 8, 42, 42])
    assert report.lost.tolist() == [3] and report.lost_count == 1
    assert report.missing.tolist() == [3, 9] and report.missing_count == 2
    assert report.recovered.tolist() == [8]
    assert report.duplicated.tolist() == [2, 42] and report.duplicated_count == 3
    assert report.unexpected.tolist() == [42] and report.unexpected_count == 2
    assert report.ok.tolist() == [0, 1, 2, 4, 5, 6, 7] and report.ok_count == 7
    assert (report.attempted_count, report.acknowledged_count, report.output_count) == (10, 8, 12)
    assert report.lost_frac == Fraction(1, 10) and report.ok_frac == Fraction(7, 10)
    assert not report.valid
    assert [report.valid_for(g) for g in ("exactly-once", "at-least-once", "none")] == [False] * 3


@pytest.mark.parametrize("output, verdicts", [
    (range(8), (True, True, True)),                                   # exactly once
    ([*range(8), 3, 5], (False, True, True)),                         # duplicates only
    ([*range(8), 8, 9], (True, True, True)),                          # unacknowledged, recovered
    ([0, 1, 2, 4, 5, 6, 7], (False, False, True)),                    # one lost
    ([*range(8), 99], (False, False, False)),                         # unexpected
])
def test_verdict_per_guarantee(output, verdicts):
    for guarantee, want in zip(("exactly-once", "at-least-once", "none"), verdicts):
        report = check_events(range(10), range(8), output, guarantee=guarantee)
        assert report.valid is want and report.guarantee == guarantee, (guarantee, report)


def test_rendering_follows_jepsen():
    kept = [i for i in range(1865) if i not in (1703, 1704, 1706, 1707)]
    report = check_events(range(1865), kept, kept)
    text = str(report)
    assert text.startswith("{:valid? true,\n :guarantee \"exactly-once\",\n")
    assert ':lost "#{}"' in text and ':recovered "#{}"' in text
    assert ':missing "#{1703..1704 1706..1707}"' in text
    assert ":missing-frac 4/1865" in text and ":lost-frac 0" in text
    assert text.endswith("}") and ":mismatched" not in text
    lost = check_events(range(100), range(100), [i for i in range(100) if i % 10])
    assert ':lost "#{0 10 ... 80 90}"' in str(lost)
    assert ":valid? false" in str(lost) and ":lost-frac 1/10" in str(lost)


def test_to_dict_is_json():
    report = check_events(range(5), range(5), [0, 1, 1, 9])
    data = json.loads(json.dumps(report.to_dict()))
    assert data["valid"] is False and data["lost"] == [2, 3, 4] and data["duplicated"] == [1]
    assert data["unexpected"] == [9] and data["lost_frac"] == pytest.approx(0.6)
    short = report.to_dict(max_ids=1)
    assert short["lost"] == [2] and short["lost_size"] == 3


def test_accepts_arrow_numpy_and_iterables():
    output = pa.chunked_array([pa.array([0, 1], pa.int32()), pa.array([2, 2], pa.int32())])
    a = check_events(pa.array(range(4), pa.uint8()), np.arange(3), output)
    b = check_events(iter(range(4)), (i for i in range(3)), [0, 1, 2, 2])
    assert a.to_dict() == b.to_dict()
    assert check_events([], [], []).valid
    with pytest.raises(InvalidArgumentError, match="output: 1 ids are null"):
        check_events([1], [1], pa.array([1, None]))
    with pytest.raises(UnsupportedTypeError, match="attempted"):
        check_events(pa.array(["a"]), [], [])
    with pytest.raises(InvalidArgumentError, match="guarantee"):
        check_events([], [], [], guarantee="twice")


ids = st.lists(st.integers(-50, 50), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ids, ids, ids, st.booleans())
def test_parity_with_reference(attempted, acknowledged, output, spread):
    if spread:      # far-apart ids take the sorting path instead of the counting one
        attempted, acknowledged, output = ([x * 2**40 for x in v]
                                           for v in (attempted, acknowledged, output))
    report = check_events(attempted, acknowledged, output)
    want = reference(attempted, acknowledged, output)
    for name in ("ok", "lost", "missing", "recovered", "duplicated", "unexpected"):
        assert getattr(report, name).tolist() == want[name], name
    assert report.duplicated_count == want["duplicated_count"]
    assert report.unexpected_count == want["unexpected_count"]
    assert report.attempted_count == len(set(attempted))


def test_twenty_million_ids():
    """A performance sanity run (no time asserted): 20 M ids, a few lost and duplicated."""
    n = 20_000_000
    rng = np.random.default_rng(5)
    output = np.arange(n, dtype=np.int64)
    dropped = rng.choice(n, 100, replace=False)
    output = np.concatenate([np.delete(output, dropped), output[:30]])
    rng.shuffle(output)
    report = check_events(pa.array(np.arange(n)), np.arange(n), output)
    assert report.lost_count == 100
    assert report.duplicated_count == 30 - np.isin(np.arange(30), dropped).sum()
    assert not report.valid_for("at-least-once") and report.valid_for("none")


# -- keyed aggregates ------------------------------------------------------------------------

def aggregates(rows):
    keys, counts, sums = zip(*rows) if rows else ((), (), ())
    return pa.table({"key": pa.array(keys, pa.int64()), "count": pa.array(counts, pa.int64()),
                     "sum": pa.array(sums, pa.float64())})


EXPECTED = aggregates([(1, 10, 100.0), (2, 5, 50.0), (3, 7, 70.0), (4, 1, 1.0), (5, 3, 30.0)])


def test_aggregates_known_differences():
    actual = aggregates([(1, 10, 100.0), (2, 3, 30.0), (3, 9, 90.0), (5, 3, 31.0), (6, 2, 2.0)])
    report = check_aggregates(EXPECTED, actual, key="key", columns=["count", "sum"])
    assert report.kind == "aggregates"
    assert report.ok.tolist() == [1]
    assert report.lost.tolist() == [2, 4] and report.lost_count == 2 + 1
    assert report.missing.tolist() == [4] and report.missing_count == 1
    assert report.duplicated.tolist() == [3] and report.duplicated_count == 2
    assert report.unexpected.tolist() == [6] and report.unexpected_count == 2
    assert report.mismatched.tolist() == [5]
    assert report.attempted_count == 26 and report.output_count == 27
    assert [report.valid_for(g) for g in ("exactly-once", "at-least-once", "none")] == [False] * 3
    assert ':mismatched "#{5}"' in str(report)


@pytest.mark.parametrize("rows, verdicts", [
    ([(1, 10, 100.0), (2, 5, 50.0), (3, 7, 70.0), (4, 1, 1.0), (5, 3, 30.0)], (True, True, True)),
    ([(1, 12, 120.0), (2, 5, 50.0), (3, 7, 70.0), (4, 1, 1.0), (5, 3, 30.0)], (False, True, True)),
    ([(1, 10, 100.0), (2, 5, 50.0), (3, 7, 70.0), (5, 3, 30.0)], (False, False, True)),
    ([(1, 10, 100.0), (2, 5, 50.0), (3, 7, 70.0), (4, 1, 1.0), (5, 3, 30.0), (9, 1, 1.0)],
     (False, False, False)),
])
def test_aggregates_verdict_per_guarantee(rows, verdicts):
    for guarantee, want in zip(("exactly-once", "at-least-once", "none"), verdicts):
        report = check_aggregates(EXPECTED, aggregates(rows), "key", ["count", "sum"],
                                  guarantee=guarantee)
        assert report.valid is want, (guarantee, report)


def test_aggregates_float_sums_and_compound_keys():
    sums = pa.array([v * (1 + 1e-12) for v in EXPECTED["sum"].to_pylist()])
    actual = EXPECTED.set_column(2, "sum", sums)
    assert check_aggregates(EXPECTED, actual.to_batches()[0], "key").valid
    expected = pa.table({"a": ["x", "x", "y"], "b": [1, 2, 1], "count": [1, 2, 3]})
    actual = pa.table({"a": ["x", "y", "y"], "b": [1, 1, 2], "count": [1, 4, 1]})
    report = check_aggregates(expected, actual, ["a", "b"], count="count")
    assert report.lost == [("x", 2)] and report.duplicated == [("y", 1)]
    assert report.unexpected == [("y", 2)]
    assert '#{[\\"x\\" 2]}' in str(report)
    assert json.loads(json.dumps(report.to_dict()))["lost"] == [["x", 2]]


def test_aggregates_without_a_count_column():
    expected = pa.table({"word": ["a", "b", "c"], "last": [1, 2, 3]})
    report = check_aggregates(expected, pa.table({"word": ["a", "c", "d"], "last": [1, 0, 4]}),
                              "word", count=None)
    assert report.missing == ["b"] and report.unexpected == ["d"] and report.mismatched == ["c"]
    assert report.lost_count == 1 and report.attempted_count == 3


def test_aggregates_refuse_bad_input():
    twice = aggregates([(1, 1, 1.0), (1, 2, 2.0)])
    with pytest.raises(InvalidArgumentError, match="one final row per key"):
        check_aggregates(EXPECTED, twice, "key")
    with pytest.raises(InvalidArgumentError, match="no column 'total'"):
        check_aggregates(EXPECTED, EXPECTED, "key", ["total"])
    empty = check_aggregates(aggregates([]), aggregates([]), "key")
    assert empty.valid and isinstance(empty, Report)
