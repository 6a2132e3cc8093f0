"""Schemas of a job's outputs: fixed at the first batch, equivalent encodings accepted and
normalised, a real change of type refused before anything of it is committed; and the
restart policy, which does not retry an error a replay would repeat."""
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from sparkjet._schemas import SchemaGuard, check_agreement, encode, normalize
from sparkjet.errors import SchemaMismatchError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig, JobFailedError
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
