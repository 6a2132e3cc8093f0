"""Schemas of a job's outputs: fixed at the first batch, equivalent encodings accepted and
normalised, a real change of type refused before anything of it is committed; and the
restart policy, which does not retry an error a replay would repeat."""
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from sparkjet.errors import SchemaMismatchError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig, JobFailedError
from sparkjet.runtime.schemas import SchemaGuard, check_agreement, encode, normalize
from sparkjet.sinks import TransactionalFileSink
from sparkjet.sources import GeneratorSource

# -- the guard -----------------------------------------------------------------------------


def test_equivalent_encodings_are_normalised():
    batch = pa.record_batch({
        "d": pa.array(["x", "y", "x"]).dictionary_encode(),
        "ls": pa.array(["a", "b", "c"], pa.large_string()),
        "sv": pa.array(["a", "b", "c"], pa.string_view()),
        "lb": pa.array([b"1", b"2", b"3"], pa.large_binary()),
        "n": pa.array([1, 2, 3], pa.int32()),
    })
    out = normalize(batch)
    assert out.schema.types == [pa.string(), pa.string(), pa.string(), pa.binary(), pa.int32()]
    assert out.column("d").to_pylist() == ["x", "y", "x"]
    plain = pa.record_batch({"n": pa.array([1], pa.int64())})
    assert normalize(plain) is plain


def test_the_first_batch_fixes_the_schema():
    guard = SchemaGuard("sink 'out'")
    guard.check(pa.record_batch({"k": ["a"], "v": [1.0]}))
    # another encoding of the same types, columns in another order, a column of nulls
    again = guard.check(pa.record_batch({"v": pa.array([None], pa.null()),
                                         "k": pa.array(["b"]).dictionary_encode()}))
    assert again.schema == guard.schema and again.column("v").type == pa.float64()
    with pytest.raises(SchemaMismatchError, match=r"sink 'out': column 'v' changed type from "
                                                  r"double to string"):
        guard.check(pa.record_batch({"k": ["c"], "v": ["1.5"]}))
    with pytest.raises(SchemaMismatchError, match="lacks column 'v'"):
        guard.check(pa.record_batch({"k": ["c"]}))
    with pytest.raises(SchemaMismatchError, match="has a new column 'w'"):
        guard.check(pa.record_batch({"k": ["c"], "v": [1.0], "w": [1]}))


def test_processors_must_agree_on_a_schema():
    a = encode(pa.schema([("v", pa.float64())]))
    b = encode(pa.schema([("v", pa.string())]))
    assert check_agreement([{"sink:out": a}, {}, {"sink:out": a}]) == {"sink:out": a}
    with pytest.raises(SchemaMismatchError, match="sink:out: processors produced different "
                                                  "schemas, \\(v: double\\) and \\(v: string\\)"):
        check_agreement([{"sink:out": a}, {"sink:out": b}])


# -- jobs ----------------------------------------------------------------------------------


def _to_string_after(limit: int):
    def stage(batch):
        if pc.min(batch["id"]).as_py() >= limit:
            return batch.set_column(batch.schema.get_field_index("value"), "value",
                                    pc.cast(batch["value"], pa.string()))
        return batch
    return stage


@pytest.mark.parametrize("isolated", [False, True])
def test_a_column_changing_type_fails_the_job_and_nothing_of_it_is_committed(tmp_path, isolated):
    source = GeneratorSource(total=40_000, partitions=1, keys=10, batch_size=2_000, rate=80_000)
    out = tmp_path / "out"
    pipeline = (Pipeline().read_from(source).map_batches(_to_string_after(20_000))
                .write_to(TransactionalFileSink(out)))
    config = JobConfig(name="retyped", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=1, max_restarts=5, restart_backoff=0)
    with pytest.raises(Exception, match="column 'value' changed type from double to string") as e:
        Job(pipeline, config).run(isolated=isolated)
    if isolated:
        # a replay would fail the same way: not retried, and the member's traceback is there
        assert isinstance(e.value, JobFailedError)
        assert "not retried" in str(e.value) and "Traceback" in str(e.value)
        assert "SchemaMismatchError" in str(e.value)
    else:
        assert isinstance(e.value.__cause__, SchemaMismatchError)
    # what was committed is still one table of doubles that pyarrow's own reader reads
    written = TransactionalFileSink.read(out)
    if written.num_rows:
        assert written.schema.field("value").type == pa.float64()
        assert ds.dataset(str(out), format="parquet").to_table().num_rows == written.num_rows
    assert written.num_rows <= 20_000


def test_keys_in_another_encoding_are_the_same_keys(tmp_path):
    """A dictionary-encoded key after plain ones, ``large_string`` after ``string``: one
    keyed aggregation, matching pandas."""
    source = GeneratorSource(total=30_000, partitions=2, keys=50, batch_size=1_000)

    def recode(batch):
        name = pc.cast(batch["key"], pa.string())
        first = pc.min(batch["id"]).as_py()
        if first % 3_000 < 1_000:
            name = name.dictionary_encode()
        elif first % 3_000 < 2_000:
            name = pc.cast(name, pa.large_string())
        return batch.append_column("name", name)

    pipeline = (Pipeline().read_from(source).map_batches(recode)
                .group_by("name").aggregate(count="count", total=("sum", "value"))
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="recoded", snapshot_store=str(tmp_path / "snaps"), snapshot_interval=0.05,
                       local_parallelism=2)
    Job(pipeline, config).run(isolated=False)
    got = TransactionalFileSink.read(tmp_path / "out").to_pandas()
    got = got.sort_values("count").groupby("name").last()
    events = source.events(0, 30_000).to_pandas()
    want = events.groupby(events["key"].astype(str))["value"].agg(["count", "sum"])
    assert sorted(got.index) == sorted(want.index)
    for name, row in want.iterrows():
        assert got.loc[name, "count"] == row["count"]
        assert got.loc[name, "total"] == pytest.approx(row["sum"])


def test_user_code_failing_the_same_way_twice_is_not_retried_further(tmp_path):
    def explode(batch):
        raise RuntimeError("boom on every batch")

    pipeline = (Pipeline().read_from(GeneratorSource(total=10_000, partitions=1))
                .map_batches(explode).write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="explode", snapshot_store=str(tmp_path / "snaps"), max_restarts=10,
                       restart_backoff=0)
    with pytest.raises(JobFailedError, match="failed 2 times the same way") as e:
        Job(pipeline, config).run()
    message = str(e.value)
    assert "RuntimeError: boom on every batch" in message
    assert "in explode" in message             # the user's frame, from the member's traceback
    log = message.rsplit("(the member's log: ", 1)[1].rstrip(")")
    assert "boom on every batch" in open(log).read()


# -- nulls and NaN in aggregated values ----------------------------------------------------


def _reference():
    """What SQL gives, row by row in plain Python: count(*) counts every row; sum, min, max
    and mean skip nulls and are null for a group whose values are all null; NaN is a value
    that makes them NaN."""
    import math

    out = {}
    for k in sorted(set(_KEYS)):
        rows = [v for key, v in zip(_KEYS, _VALUES) if key == k]
        present = [v for v in rows if v is not None]
        nan = any(math.isnan(v) for v in present)

        def agg(fn, present=present, nan=nan):
            return None if not present else float("nan") if nan else float(fn(present))
        out[k] = {"n": len(rows), "s": agg(sum), "lo": agg(min), "hi": agg(max),
                  "m": agg(lambda xs: sum(xs) / len(xs))}
    return out


def _same(got, want):
    import math
    for name in ("n", "s", "lo", "hi", "m"):
        a, b = got[name], want[name]
        if b is None or a is None:
            assert a is b, (name, got, want)
        elif isinstance(b, float) and math.isnan(b):
            assert math.isnan(a), (name, got, want)
        else:
            assert a == pytest.approx(b), (name, got, want)


_VALUES = [1.0, None, 3.0, None, None, float("nan"), 2.5, None, -1.0, 4.0]
_KEYS = ["a", "a", "a", "b", "b", "c", "c", "d", "e", "e"]
_AGGS = {"n": "count", "s": ("sum", "v"), "lo": ("min", "v"), "hi": ("max", "v"), "m": ("mean", "v")}


def test_the_rolling_aggregation_skips_nulls_as_sql_does():
    from sparkjet.operators.rolling import KeyedAggregator

    values = pa.array(_VALUES, pa.float64())
    agg = KeyedAggregator("k", _AGGS)
    agg.update(pa.record_batch({"k": _KEYS[:5], "v": values[:5]}))
    restored = KeyedAggregator("k", _AGGS)            # the nulls survive a snapshot
    restored.restore(agg.snapshot())
    restored.update(pa.record_batch({"k": _KEYS[5:], "v": values[5:]}))
    keys = sorted(set(_KEYS))                          # one more null row for every key
    out = restored.update(pa.record_batch({"k": keys, "v": pa.nulls(len(keys), pa.float64())}))
    got = {r["k"]: r for r in out.to_pylist()}
    for k, want in _reference().items():
        _same({**got[k], "n": got[k]["n"] - 1}, want)
    assert got["b"]["s"] is None and got["b"]["m"] is None    # all null: null, as in SQL


def test_windows_skip_nulls_as_sql_does():
    from sparkjet.operators.windows.operator import WindowOperator, WindowStage
    from sparkjet.windows import sliding

    def operator():
        return WindowOperator(WindowStage(("k",), sliding(100, 50), _AGGS, None, 0, None), "t")

    values = pa.array(_VALUES, pa.float64())
    times = pa.array([10, 60, 20, 70, 30, 80, 40, 90, 45, 95], pa.int64())
    op = operator()
    op.process(pa.record_batch({"t": times[:5], "k": _KEYS[:5], "v": values[:5]}))
    restored = operator()                             # the nulls survive a snapshot
    restored.restore(op.snapshot(), op.watermark)
    restored.process(pa.record_batch({"t": times[5:], "k": _KEYS[5:], "v": values[5:]}))
    rows = pa.Table.from_batches(restored.advance(200)).to_pylist()
    got = {r["k"]: r for r in rows if r["window_start"] == 0}   # [0, 100) holds every row
    for k, want in _reference().items():
        _same(got[k], want)
    assert got["b"]["s"] is None and got["d"]["lo"] is None


def test_a_null_key_fails_the_job_at_once_not_after_every_restart(tmp_path):
    """A null key is bad data: a replay meets it again, so the job is not restarted."""
    source = GeneratorSource(total=10_000, partitions=1, keys=10, batch_size=1_000)

    def null_keys(batch):
        return batch.set_column(batch.schema.get_field_index("key"), "key",
                                pa.nulls(batch.num_rows, pa.int64()))

    pipeline = (Pipeline().read_from(source).map_batches(null_keys)
                .group_by("key").aggregate(n="count")
                .write_to(TransactionalFileSink(tmp_path / "out")))
    config = JobConfig(name="null-keys", snapshot_store=str(tmp_path / "snaps"), max_restarts=5,
                       restart_backoff=0)
    with pytest.raises(JobFailedError, match="not retried: NullKeyError") as e:
        Job(pipeline, config).run()
    assert "Traceback" in str(e.value)
