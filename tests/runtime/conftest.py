"""Fixtures the runtime's storage tests share."""
import pytest

from sparkjet.snapshot.slots import StorageSlot


@pytest.fixture
def two_slots(tmp_path):
    """Two storage slots claimed on two hosts ("a" and "b"), each under its own folder."""
    a = StorageSlot.claim(tmp_path / "host-a", host="a")
    b = StorageSlot.claim(tmp_path / "host-b", host="b")
    yield a, b
    a.release()
    b.release()
