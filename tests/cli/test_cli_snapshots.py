"""`sparkjet snapshots list|show|verify` on a real store."""
import numpy as np
import pyarrow as pa
import pytest

from sparkjet.cli.main import main
from sparkjet.snapshot.store import SnapshotStore


@pytest.fixture
def store_uri(tmp_path):
    store = SnapshotStore(tmp_path, job_id=0xABC)
    store.register_execution(1)
    w = store.writer(0, 1)
    w.write_table("agg", pa.table({"key": np.arange(20_000), "v": np.ones(20_000)}), key="key")
    w.write_entries("py", [b"a", b"b"], [b"1", b"22"])
    w.commit()
    store.export(None, "keep")
    store.close()
    return tmp_path


def test_list_and_show(store_uri, capsys):
    assert main(["snapshots", "list", str(store_uri)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["job", "snapshot", "execution", "name", "chunks", "entries", "size", "created"]
    assert [line.split()[:4] for line in out[1:]] == [["0xabc", "0", "1", "-"], ["0xabc", "0", "1", "keep"]]
    assert main(["snapshots", "show", str(store_uri), "--job", "0xabc", "--partitions"]) == 0
    out = capsys.readouterr().out
    assert "agg" in out and "20,000" in out and "py" in out
    assert len([line for line in out.splitlines() if line.startswith("  ")]) > 200


def test_verify_passes_then_fails_on_a_flipped_byte(store_uri, capsys):
    assert main(["snapshots", "verify", str(store_uri), "--job", "2748"]) == 0
    assert "every checksum verified" in capsys.readouterr().out
    victim = sorted(store_uri.glob("job-*/snapshots/*/agg/*.chunks"))[0]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.unlink()  # the export shares the file by hard link; replace, don't edit in place
    victim.write_bytes(bytes(data))
    assert main(["snapshots", "verify", str(store_uri)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and victim.name in out and "payload checksum" in out
    assert main(["snapshots", "verify", str(store_uri), "--name", "keep"]) == 0


def test_bad_arguments(tmp_path, capsys):
    assert main(["snapshots", "list", str(tmp_path)]) == 0
    assert "no sparkjet snapshots" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["snapshots", "list", str(tmp_path), "--job", "nope"])
    assert main(["snapshots", "show", str(tmp_path), "--job", "5"]) == 2
    assert "no snapshots of job 5" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["list", "show", "verify"])
@pytest.mark.parametrize("job", [[], ["--job", "5"]])
def test_reading_a_missing_store_is_an_error_and_creates_nothing(tmp_path, capsys, action, job):
    missing = tmp_path / "no" / "store"
    assert main(["snapshots", action, str(missing), *job]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{missing} does not exist" in err
    assert list(tmp_path.iterdir()) == []
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["snapshots", action, str(a_file), *job]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["list", "show", "verify"])
def test_reading_a_missing_job_creates_nothing(store_uri, capsys, action):
    before = sorted(store_uri.rglob("*"))
    assert main(["snapshots", action, str(store_uri), "--job", "0xdef"]) == 2
    assert "no snapshots of job 3567 (0xdef)" in capsys.readouterr().err
    assert main(["snapshots", action, str(store_uri), "--job", "0xabc"]) == 0
    assert sorted(store_uri.rglob("*")) == before


def test_hostile_metadata_is_one_line_and_exit_2(store_uri, capsys):
    log = sorted(store_uri.glob("job-*/log/*.json"))[-1]
    log.write_bytes(b'{"type": "commit"}')
    assert main(["snapshots", "show", str(store_uri)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad log event" in err and log.name in err


def test_usage_errors_are_one_line(tmp_path, capsys):
    for argv in (["snapshots"], ["snapshots", "show", str(tmp_path), "--job", "nope"], [],
                 ["snapshots", "list"], ["nope"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "--help" in err, argv
    assert list(tmp_path.iterdir()) == []


def test_job_names_as_sparkjet_jobs_prints_them(tmp_path, capsys):
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import DiscardSink
    from sparkjet.sources import GeneratorSource

    store = str(tmp_path / "snaps")
    for name, job_id in (("counts", None), ("given-id", 0x5EED)):
        pipeline = (Pipeline().read_from(GeneratorSource(total=2_000, partitions=1, keys=10))
                    .group_by("key").aggregate(count="count").write_to(DiscardSink()))
        Job(pipeline, JobConfig(name=name, job_id=job_id, snapshot_store=store)).run(isolated=False)
    assert main(["jobs", store]) == 0
    listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(listed) == {"counts", "given-id"} and listed["given-id"] == "0x5eed"
    for name, job_id in listed.items():
        for action in ("list", "show", "verify"):
            assert main(["snapshots", action, store, "--job", name]) == 0, (action, name)
            by_name = capsys.readouterr().out
            assert main(["snapshots", action, store, "--job", job_id]) == 0
            if action != "verify":         # (verify prints its speed)
                assert by_name == capsys.readouterr().out
            capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["snapshots", "show", store, "--job", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no job of that name" in err and "counts, given-id" in err
