"""``rebalance_delay`` on the driver, without Spark: the coordinator's joins held for a lost
slot of the previous partition table, driven by members joining over the real exchange with
slot reports of their own. A member asked to claim the lost slot is left out of placement
until it joins again (review finding 3), and the hold is a budget of its own: the members'
start gets as long more only when the joins were held."""
import threading
import time

import pytest

from sparkjet.errors import ExecutionFailedError
from sparkjet.pipeline import Pipeline
from sparkjet.runtime import JobConfig
from sparkjet.runtime import coordinator as coordinator_module
from sparkjet.runtime.coordinator import ExecutionCoordinator
from sparkjet.runtime.exchange import ExchangeClient
from sparkjet.runtime.exchange.security import LinkSecurity
from sparkjet.runtime.spark_runner import join, start_wait
from sparkjet.runtime.storage import decode_table, encode_table, table_for
from sparkjet.runtime.topology import Topology
from sparkjet.sinks import DiscardSink
from sparkjet.sources import GeneratorSource


def _slot(n: int, host: str, table: str | None = None) -> dict:
    return {"uuid": f"00000000-0000-4000-8000-00000000000{n}", "host": host,
            "path": f"/s/{n}", "execution": None, "table": table}


def _setup(tmp_path, delay: float, **settings):
    """A coordinator of 2 members after the loss of slot ``a`` (host h0) of the table over
    ``a`` and ``b`` (h1): member 1 joins with ``b``, member 0 with ``c``, a fresh slot on
    h0 (outside the table: the one asked to claim ``a``)."""
    config = JobConfig(name="rebalance-wait", processing_guarantee="none", storage="members",
                       persistence=True, storage_dir=str(tmp_path), rebalance_delay=delay,
                       **settings)
    a, b, c = _slot(1, "h0"), _slot(2, "h1"), _slot(3, "h0")
    previous = table_for(config, [a, b])
    b["table"] = a["table"] = encode_table(previous)
    plan = (Pipeline().read_from(GeneratorSource(total=10, partitions=2)).group_by("key")
            .aggregate(n="count").write_to(DiscardSink()).plan())
    security = LinkSecurity.generate(7)
    events: list[dict] = []
    lost_at = time.monotonic()
    coord = ExecutionCoordinator(config, 7, Topology(2, 1, plan, 271), host="127.0.0.1",
                                 security=security, store=None, progress=events.append,
                                 lost_at=lost_at)
    return coord, security, events, lost_at, (a, b, c)


def test_a_reclaim_in_flight_as_the_delay_ends_is_waited_for_by_placement(tmp_path,
                                                                          monkeypatch):
    """Review finding 3: member 0 is asked to claim lost slot ``a`` and verifies it past
    the end of the delay; meanwhile member 1's join is answered. Placement used to go on
    over member 0's old slot ``c`` (which it had given up), and member 0's join with ``a``
    failed the execution. Now placement waits for the reclaim: the table is the one before,
    over ``a`` and ``b``, and ``a`` counts as returned."""
    monkeypatch.setattr(coordinator_module, "JOIN_WAIT", 0.2)  # member 1 asks again often
    delay = 1.0
    coord, security, events, lost_at, (a, b, c) = _setup(tmp_path, delay)
    asked: list[tuple[float, dict]] = []        # member 1's joins: (answered at, answer)
    change = threading.Condition()
    got: dict = {}

    def member1():
        client = ExchangeClient(coord.location, security=security)
        try:
            while True:
                answer = client.action("join", {"member": 1, "location": "grpc://m1:1",
                                                "slot": b})
                with change:
                    asked.append((time.monotonic(), answer))
                    change.notify_all()
                if answer["peers"] is not None:
                    got[1] = answer
                    return
        except Exception as e:  # noqa: BLE001 - asserted below
            got[1] = e

    def reclaim(uuids):
        # the reclaim's verification outlasts the delay: it ends once member 1's join has
        # been answered after the delay was over (before the fix: placed without a)
        assert uuids == [a["uuid"]]
        with change:
            assert change.wait_for(lambda: any(t > lost_at + delay for t, _ in asked), 30)
        return a

    thread = threading.Thread(target=member1)
    try:
        thread.start()
        got[0] = join(ExchangeClient(coord.location, security=security), 0, "grpc://m0:1",
                      30, c, reclaim)
        thread.join(30)
        assert got[0] == got[1], got
        assert got[0]["slots"] == [a["uuid"], b["uuid"]]
        table = decode_table(got[0]["table"], "answer")
        assert table.version == decode_table(b["table"], "b").version   # nothing promoted
        (rebalance,) = [e for e in events if e["event"] == "rebalance"]
        assert list(rebalance["returned"]) == [a["uuid"]] and rebalance["promoted"] == {}
        # member 1 was held (not placed) while the reclaim was in flight
        assert any(answer.get("held") for _, answer in asked[:-1])
    finally:
        coord.close()
        thread.join(30)


def test_the_slot_left_for_a_reclaimed_one_goes_once_the_driver_has_taken_it(tmp_path):
    """The member lets its old slot go (``reclaimed``) only after the driver holds the
    report of the slot it claimed instead, never while the driver may still place over
    the old one."""
    coord, security, events, _, (a, b, c) = _setup(tmp_path, 30.0)
    seen = []

    def reclaimed():
        with coord._cv:
            seen.append(coord.slots[0]["uuid"])

    thread = threading.Thread(target=join, args=(
        ExchangeClient(coord.location, security=security), 1, "grpc://m1:1", 30, b))
    try:
        thread.start()
        answer = join(ExchangeClient(coord.location, security=security), 0, "grpc://m0:1",
                      30, c, lambda uuids: a, reclaimed)
        assert seen == [a["uuid"]] and answer["slots"] == [a["uuid"], b["uuid"]]
    finally:
        coord.close()
        thread.join(30)


def test_the_members_start_gets_the_delay_only_when_the_joins_were_held(tmp_path):
    """Review finding (b): ``start_wait`` no longer adds ``rebalance_delay`` to every
    start; the driver's wait for the members' start grows by how long it held their
    joins, said in its error."""
    config = JobConfig(name="w", processing_guarantee="none", storage="members",
                       persistence=True, storage_dir=str(tmp_path), rebalance_delay=600.0,
                       start_timeout=5.0, data_load_timeout=7.0)
    assert start_wait(config, verify=False) == 5.0
    assert start_wait(config, verify=True) == 12.0
    # held: member 0 (slot c) is asked to claim lost slot a and finds none
    coord, security, events, _, (a, b, c) = _setup(tmp_path, 1.5, start_timeout=3.0)
    threads = [threading.Thread(target=join, args=(
        ExchangeClient(coord.location, security=security), i, f"grpc://m{i}:1", 30, s,
        lambda uuids: None)) for i, s in ((0, c), (1, b))]
    try:
        for t in threads:
            t.start()
        with pytest.raises(ExecutionFailedError, match="held for lost slots") as raised:
            coord.wait_started(start_wait(coord.config, verify=False))
        assert "placed" in [e["event"] for e in events], raised.value
    finally:
        coord.close()
        for t in threads:
            t.join(30)
