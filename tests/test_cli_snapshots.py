"""`sparkjet snapshots list|show|verify` on a real store."""
import numpy as np
import pyarrow as pa
import pytest

from sparkjet.cli import main
from sparkjet.snapshot_store import SnapshotStore


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
    assert "no complete snapshot" in capsys.readouterr().err
