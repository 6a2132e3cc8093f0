"""sparkjet._memory.small_pages: numpy's huge page advice off around a rebuild, put back after."""
from __future__ import annotations

import threading

import pytest

from sparkjet import _memory


def advice() -> bool:
    """numpy's current setting (set and put back: the setter returns the previous value)."""
    setter = _memory._set_madvise_hugepage
    now = setter(False)
    setter(now)
    return now


pytestmark = pytest.mark.skipif(_memory._set_madvise_hugepage is None,
                                reason="this numpy has no huge page setting")


@pytest.mark.parametrize("start", [True, False])
def test_the_advice_is_off_in_the_block_and_as_it_was_after(start):
    before = _memory._set_madvise_hugepage(start)
    try:
        with _memory.small_pages():
            assert advice() is False
        assert advice() is start
        with pytest.raises(RuntimeError), _memory.small_pages():
            raise RuntimeError("a failed rebuild")
        assert advice() is start
    finally:
        _memory._set_madvise_hugepage(before)


def test_overlapping_blocks_put_it_back_once_the_last_ends():
    """Two processors of one member rebuild at once: the first to end must not turn the
    advice back on under the other, nor the last leave it off."""
    before = _memory._set_madvise_hugepage(True)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def second():
        first_in.wait(10)
        with _memory.small_pages():
            second_in.set()
            first_out.wait(10)
            seen.append(advice())

    try:
        t = threading.Thread(target=second)
        t.start()
        with _memory.small_pages():
            first_in.set()
            second_in.wait(10)
        first_out.set()
        t.join(10)
        assert seen == [False]
        assert advice() is True
    finally:
        _memory._set_madvise_hugepage(before)


def test_a_keyed_processor_rebuilds_its_state_with_the_advice_off(tmp_path, monkeypatch):
    """The runtime's one bulk rebuild (KeyedProcessor: op.restore) runs in the block."""
    from sparkjet.operators.rolling import KeyedAggregator
    from sparkjet.pipeline import Pipeline
    from sparkjet.runtime import Job, JobConfig
    from sparkjet.sinks import DiscardSink
    from sparkjet.sources import GeneratorSource

    during = []
    real = KeyedAggregator.restore

    def recorded(self, table):
        during.append(advice())
        return real(self, table)

    monkeypatch.setattr(KeyedAggregator, "restore", recorded)
    pipeline = (Pipeline().read_from(GeneratorSource(total=1_000, partitions=1, keys=10))
                .group_by("key").aggregate(count="count").write_to(DiscardSink()))
    Job(pipeline, JobConfig(name="pages", local_parallelism=1,
                            snapshot_store=str(tmp_path / "s"))).run(isolated=False)
    assert during and not any(during)
