"""Recovery speed (issue 24 item 6): the ``restored`` event comes once every operator has
rebuilt its state from the snapshot, before the restored execution's first output, and says
how long the phases took; a restore decodes a vertex's chunks against one schema.

Real jobs, real snapshot files. Before the change the event came as soon as the snapshot
was read, with the keyed processors' state still waiting to be rebuilt, and carried no
phases: ``test_restored_comes_after_every_operator_rebuilt`` failed on it (the processors
still held their restored tables) and so did the subprocess test (no ``keys``)."""
import threading
import time

import pyarrow as pa
import pytest

from sparkjet.errors import SnapshotCorruptError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import Job, JobConfig
from sparkjet.runtime.processors import KeyedProcessor
from sparkjet.sinks import DiscardSink
from sparkjet.snapshot.chunks import ChunkEncoder, TableDecoder, decode_table, read_chunks
from sparkjet.snapshot.store import SnapshotStore
from sparkjet.sources import GeneratorSource

KEYS = 5_000


def _job(tmp_path, total=None, rate=None):
    source = GeneratorSource(total=total, partitions=2, keys=KEYS, batch_size=2_000, rate=rate)
    pipeline = (Pipeline().read_from(source)
                .group_by("key").aggregate(count="count", sum=("sum", "value"))
                .write_to(DiscardSink()))
    config = JobConfig(name="recovery-speed", snapshot_store=str(tmp_path / "snaps"),
                       snapshot_interval=0.2, local_parallelism=2, max_restarts=1,
                       restart_backoff=0.0)
    return Job(pipeline, config)


def _run_and_stop(tmp_path):
    """A job stopped after a few snapshots: its last snapshot holds every key."""
    job = _job(tmp_path, rate=400_000)
    handle = job.submit(isolated=False)
    deadline = time.monotonic() + 120
    while (handle.metrics or {}).get("snapshots", 0) < 3:
        assert time.monotonic() < deadline and not handle.done(), handle.metrics
        time.sleep(0.05)
    result = handle.stop(timeout=120)
    assert result.stopped
    return SnapshotStore(job.config.snapshot_store, job.config.id, create=False)


def test_restored_comes_after_every_operator_rebuilt(tmp_path):
    store = _run_and_stop(tmp_path)
    restored_rows = store.restore("aggregate").table.num_rows
    store.close()
    assert restored_rows == KEYS
    job = _job(tmp_path, rate=400_000)
    seen = []

    def progress(event):
        if event["event"] == "snapshot" and not seen[-1:] == [("stop", None, None)]:
            seen.append(("stop", None, None))
            threading.Thread(target=job.stop, daemon=True).start()
        if event["event"] == "restored":
            # (in this process: the member's keyed processors, as the event goes out)
            member = job._runner._member
            keyed = [p for p in member.processors if isinstance(p, KeyedProcessor)]
            seen.append(("restored", event,
                         [p.restored_table is None for p in keyed]))
        elif event["event"] == "snapshot":
            seen.append(("snapshot", event, None))

    job.run(isolated=False, on_progress=progress)
    kinds = [k for k, _, _ in seen if k != "stop"]
    assert kinds.count("restored") == 1 and kinds[0] == "restored", kinds
    _, event, rebuilt = seen[0]
    assert rebuilt and all(rebuilt), rebuilt    # every operator holds its state already
    assert event["keys"] == KEYS
    assert 0 <= event["read_s"] <= event["seconds"] and 0 <= event["rebuild_s"] <= event["seconds"]


def test_restored_event_of_a_restarted_member_precedes_its_first_commit(tmp_path):
    """Under the supervisor (the member in a child process, killed with SIGKILL): the
    restarted member's ``restored`` comes before the first snapshot it commits."""
    import os
    import signal

    job = _job(tmp_path, rate=400_000)
    events = []

    def progress(event):
        events.append(event)
        kind = event["event"]
        # events_in is counted when a snapshot commits, and the processors go on while it
        # is acknowledged: the barrier of the snapshot *after* the first to report 4 x KEYS
        # events comes after them, so that one's state holds every key
        if kind == "snapshot" and not any(e["event"] == "restart" for e in events) \
                and job.member_pid and not hasattr(progress, "killed"):
            if hasattr(progress, "armed"):
                progress.killed = True
                os.kill(job.member_pid, signal.SIGKILL)
            elif event.get("events_in", 0) >= 4 * KEYS:
                progress.armed = True
        elif kind == "snapshot" and any(e["event"] == "restored" for e in events) \
                and not hasattr(progress, "stopping"):
            progress.stopping = True
            threading.Thread(target=job.stop, daemon=True).start()

    result = job.run(on_progress=progress)
    assert result.restarts == 1 and result.stopped
    kinds = [e["event"] for e in events]
    after = kinds[kinds.index("restart"):]
    assert "restored" in after and "snapshot" in after
    assert after.index("restored") < after.index("snapshot"), after
    restored = events[kinds.index("restored")]
    assert restored["keys"] == KEYS, restored
    assert restored["rebuild_s"] >= 0 and restored["read_s"] >= 0


def _chunks(table, codec="lz4"):
    chunks = ChunkEncoder(1, 2, 3, codec=codec, chunk_size=4096).table(table, "k")
    return read_chunks(b"".join(c.to_bytes() for c in chunks))


@pytest.mark.parametrize("codec", ["lz4", "raw"])
def test_table_decoder_gives_what_decode_table_gives(codec):
    table = pa.table({"k": pa.array(range(20_000), pa.int64()),
                      "s": [f"v{i}" if i % 7 else None for i in range(20_000)],
                      "d": pa.array(range(20_000), pa.int32()).dictionary_encode()})
    stored = _chunks(table, codec)
    assert len(stored) > 10
    decoder = TableDecoder()
    for _, header, payload in stored:
        assert decoder.decode(header, payload).equals(decode_table(header, payload))


def test_table_decoder_refuses_bad_payloads_as_decode_table_does():
    stored = _chunks(pa.table({"k": pa.array(range(5_000), pa.int64())}))
    _, header, payload = stored[0]
    decoder = TableDecoder()
    decoder.decode(header, payload)
    # the checksum is the store's check; these are payloads it would not catch
    for bad in (bytes(payload[:40]), b"\x00" * 64, bytes(payload[: len(payload) // 2])):
        with pytest.raises(SnapshotCorruptError, match="Arrow IPC payload"):
            decoder.decode(header, bad, "f", 7)
    import msgspec
    with pytest.raises(SnapshotCorruptError, match="entry count"):
        decoder.decode(msgspec.structs.replace(header, entry_count=header.entry_count + 1),
                       payload)
    from sparkjet import _native
    with pytest.raises(SnapshotCorruptError, match="an entry chunk"):
        decoder.decode(msgspec.structs.replace(header, flags=header.flags | _native.FLAG_ENTRIES),
                       payload)
