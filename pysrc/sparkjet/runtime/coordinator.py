"""The snapshot coordinator (Chandy-Lamport, two-phase commit), and its driver-side home
for executions that run on Spark.

:class:`SnapshotCoordinator` is the loop itself: every ``snapshot_interval`` it asks every
source processor for barrier *n* (``send(["barrier", n, terminal])``), collects one phase-1
acknowledgement (a manifest) from every processor, commits the snapshot in the store (the
commit point), then tells every processor to run phase 2 (``send(["commit", n])``). When
every source has ended it takes the terminal snapshot (or, with guarantee "none", sends
``["end"]``). A lone :class:`~sparkjet.runtime.member.Member` runs it on a thread.

:class:`ExecutionCoordinator` runs it on the driver for one execution on Spark: an
:class:`~sparkjet.runtime.exchange.ExchangeServer` of its own (fenced by the execution id)
answers the members' actions -- ``join`` (a member's exchange location, answered with every
member's once all have joined: how members find each other, in milliseconds where Spark's
``BarrierTaskContext.allGather`` takes a second), ``poll`` (the heartbeat; answers with the
commands queued for that member, waiting up to :data:`POLL_WAIT` for one), ``ack`` (phase
1), ``restored`` (its operators rebuilt the restored state: the "restored" event goes out
once every member has said so), ``failed`` and ``done`` -- and the loop watches for a member
that failed or went silent.

With the members' storage (``storage="members"``) the driver is the only process that opens
the snapshot store: the ``join`` answer also carries the partition table over the members'
slots and the snapshot to start from with its committed record (``start``), the
``store_read`` action serves the store's files of that snapshot (durable copies, an export)
to the members, and the phase-2 command carries the committed record, which every slot
keeps a copy of (``["commit", n, retained ids, {"execution", "record", "tables"}]``; the
table versions the retained snapshots use, when the job has any). With persistence the
placement first hands the slots' reports to ``recover``
(:func:`~sparkjet.runtime.persistence.recover`): it may pick another snapshot to start from,
tell members to empty their slot of the job (``wipe`` in their answer) or refuse the start.
"""
from __future__ import annotations

import base64
import ipaddress
import logging
import queue
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from sparkjet.errors import (
    ExecutionFailedError,  # noqa: F401 (defined there; named here too)
    )
from sparkjet.partition_table import PartitionTable
from sparkjet.runtime.config import JobConfig, open_store
from sparkjet.runtime.durable import async_start
from sparkjet.runtime.exchange.server import ExchangeServer
from sparkjet.runtime.schemas import check_agreement
from sparkjet.runtime.storage import (
    encode_table,
    partition_ranges,
    previous_table,
    record_tables,
    store_read_handler,
    table_for,
)
from sparkjet.snapshot.store import Manifest, SnapshotStore

_log = logging.getLogger("sparkjet.job")

_POLL = 0.005
#: How long a member's poll waits on the driver for a command before it returns empty.
POLL_WAIT = 0.25
#: How long a member's broken link to a peer waits for the peer to show it is alive (a live
#: member polls at least every POLL_WAIT s; one poll in the window clears it) before the
#: execution fails, naming whichever is gone. It delays every restart after a lost member
#: (except one on this machine whose process is seen gone: ``local[N]``): keep it to a few
#: polls.
LINK_VERDICT_WAIT = 3 * POLL_WAIT
#: How long a member's ``join`` waits on the driver for the other members before it
#: returns without the peers (the member then asks again).
JOIN_WAIT = 2.0
#: How long the driver holds a member's ``join`` while it waits for a lost slot
#: (``rebalance_delay``) before asking the member to claim that slot again.
RECLAIM_WAIT = 0.25


class SnapshotCoordinator:
    """Starts, collects and commits the snapshots of one execution.

    :param send: delivers a command to every member's processors.
    :param processors: how many processors acknowledge each snapshot (all members).
    :param all_sources_ended: True once every source processor has reached its end.
    :param stopped: True when the execution is over (failed, or ending); the loop returns.
    :param check: called between waits; raises to fail the execution.
    :param events_in: the events read so far (for the progress events).
    """

    def __init__(self, *, config: JobConfig, store: SnapshotStore | None, execution_id: int,
                 processors: int, send: Callable[[list], None],
                 all_sources_ended: Callable[[], bool], stopped: Callable[[], bool],
                 progress: Callable[[dict], None], events_in: Callable[[], int],
                 check: Callable[[], None] = lambda: None):
        self.config = config
        self.store = store
        self.execution_id = execution_id
        self.processors = processors
        self.send = send
        self.all_sources_ended = all_sources_ended
        self.stopped = stopped
        self.progress = progress
        self.events_in = events_in
        self.check = check
        self.records: list[dict] = []
        self._acks: queue.Queue = queue.Queue()
        #: with the members' storage: the execution's partition table (base64), which the
        #: records of its snapshots keep
        self.table: str | None = None
        #: the DAG's fingerprint (JSON), which such records keep too
        self.plan: str | None = None

    def ack(self, processor: str, snapshot_id: int, manifest: Manifest,
            alignment_s: float | None = None, schemas: dict | None = None,
            uploading=None) -> None:
        """A processor's phase-1 acknowledgement of snapshot ``snapshot_id``, with the
        schemas of the outputs it has fixed (see :mod:`sparkjet.runtime.schemas`) and
        (``durable_tier="async"``) the snapshot ids its member may upload before its next
        commit (:meth:`~sparkjet.runtime.member.Member.ack`): the commit pins them."""
        self._acks.put((processor, snapshot_id, manifest, alignment_s, schemas,
                        uploading or ()))

    def run(self, snapshot_id: int) -> None:
        """Runs until the terminal snapshot is committed (or, without snapshots, the end
        is sent) or until ``stopped()``."""
        interval = self.config.snapshot_interval
        next_at = time.monotonic() + interval
        while not self.stopped():
            self.check()
            terminal = self.all_sources_ended()
            if self.store is None:
                if terminal:
                    self.send(["end"])
                    return
                time.sleep(_POLL * 4)
                continue
            if not terminal and time.monotonic() < next_at:
                time.sleep(min(_POLL * 4, max(0.0, next_at - time.monotonic())))
                continue
            started = time.monotonic()
            if not self._snapshot(snapshot_id, terminal, started):
                return
            snapshot_id += 1
            next_at = started + interval
            if terminal:
                return

    def _snapshot(self, snapshot_id: int, terminal: bool, started: float) -> bool:
        self.send(["barrier", snapshot_id, terminal])
        manifests, alignment, schemas, uploading = [], {}, [], set()
        deadline = started + max(60.0, 20 * self.config.snapshot_interval)
        while len(manifests) < self.processors:
            if self.stopped():
                return False
            self.check()
            try:
                name, sid, manifest, aligned, fixed, uploads = self._acks.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise ExecutionFailedError(
                        f"snapshot {snapshot_id}: phase 1 timed out ({len(manifests)} of "
                        f"{self.processors} processors acknowledged)") from None
                continue
            if sid != snapshot_id:
                raise ExecutionFailedError(
                    f"{name} acknowledged snapshot {sid}, expected {snapshot_id}")
            manifests.append(manifest)
            schemas.append(fixed)
            uploading.update(int(s) for s in uploads)
            if aligned is not None:
                alignment[name] = aligned
        # processors that disagree on an output's schema: nothing of theirs is committed
        check_agreement(schemas)
        acked = time.monotonic()
        # durable_tier="async": the uploads the members may run until the next commit keep
        # their snapshots in the store and the slots (retention), so that a slow one ends
        info = self.store.commit(snapshot_id, self.execution_id, manifests, table=self.table,
                                 plan=self.plan, pinned=uploading)
        committed = time.monotonic()
        if self.table is None:
            self.send(["commit", snapshot_id])
        else:
            # phase 2 hands every slot the committed record; the slots keep the snapshots
            # the store keeps
            data, _, _ = self.store.committed_record(snapshot_id)
            phase2 = {"execution": self.execution_id, "record": base64.b64encode(data).decode()}
            if record_tables(data):
                # the table versions the retained snapshots use, from the store's records:
                # a slot lacking an older record copy can still drop the others (F5)
                phase2["tables"] = sorted(self.store._retained_tables())
            self.send(["commit", snapshot_id, [c.snapshot for _, c in self.store._retained()],
                       phase2])
        record = {"snapshot": snapshot_id, "duration_s": committed - started, "bytes": info.bytes,
                  "terminal": terminal, "alignment_s": alignment,
                  # phase 1 (barrier to the last acknowledgement) and the commit point
                  "phase1_s": acked - started, "commit_s": committed - acked}
        self.records.append(record)
        self.progress({"event": "snapshot", **record, "execution": self.execution_id,
                       "events_in": self.events_in()})
        return True


@dataclass
class _RebalanceWait:
    """``rebalance_delay``'s state in one execution (under the coordinator's ``_cv``):
    when each slot joined, and once every member has: the previous partition table (None:
    the joined slots hold none), its slots no member joined with (``awaited``), when the
    delay counts from (``since``: the loss, else the first join) and ends, when every
    member had joined, the members asked to claim a lost slot that have not joined again
    since (``reclaiming``: placement waits for them), and when placement was made."""

    lost_at: float | None
    joined_at: dict[str, float] = field(default_factory=dict)
    previous: PartitionTable | None = None
    awaited: list[str] = field(default_factory=list)
    since: float | None = None
    deadline: float = 0.0
    all_joined: float = 0.0
    reclaiming: set[int] = field(default_factory=set)
    placed_at: float | None = None
    said: bool = False      # the "waiting" event went out

    def begin(self, previous: PartitionTable | None, joined: set[str], delay: float) -> None:
        """Every member has joined (the slots ``joined``): what is awaited, until when."""
        self.since = self.lost_at if self.lost_at is not None else min(
            self.joined_at.values())
        self.deadline = self.since + delay
        self.all_joined = time.monotonic()
        self.previous = previous
        if previous is not None:
            self.awaited = [u for u in previous.members if u not in joined]

    def held_s(self, now: float) -> float:
        """How long the joins were held for an awaited slot (until placement, at most until
        the delay's end; a reclaim in flight past it is not counted)."""
        if self.since is None or not self.awaited:
            return 0.0
        end = min(self.placed_at if self.placed_at is not None else now, self.deadline)
        return max(0.0, end - self.all_joined)


class ExecutionCoordinator:
    """The driver's side of one execution on Spark: the members' actions and the
    snapshot loop.

    :param members: how many members the execution has.
    :param topology: the execution's :class:`~sparkjet.runtime.topology.Topology`.
    :param host: the interface to listen on (the driver's host, reachable by executors).
    :param security: the execution's credentials
        (:class:`~sparkjet.runtime.exchange.security.LinkSecurity`), which every member's
        call must carry.
    """

    def __init__(self, config: JobConfig, execution_id: int, topology, *, host: str,
                 security, store: SnapshotStore | None, progress: Callable[[dict], None],
                 start: dict | None = None, start_store: SnapshotStore | None = None,
                 recover: Callable[[list[dict]], object] | None = None,
                 lost_at: float | None = None):
        self.config = config
        #: ``rebalance_delay``: the wait for lost slots of the previous partition table
        #: (``lost_at``: when a member of the execution before this one was lost; None:
        #: this driver's first execution, whose delay counts from its members' joins)
        self._wait = _RebalanceWait(lost_at)
        self.rebalance: dict | None = None
        #: with persistence: the driver's decision over the joined slots' reports
        #: (:func:`~sparkjet.runtime.persistence.recover`), its report once made, and the
        #: members told to empty their slot of the job (index -> why)
        self.recover = recover
        self.recovery: dict | None = None
        self._wipe: dict[int, str] = {}
        self._start_store = start_store
        #: with the members' storage: what the join answer hands the members to start
        #: from (:func:`~sparkjet.runtime.restore.handed_start`), and the store it is in
        self.start = start
        self.execution_id = execution_id
        self.topology = topology
        self.members = topology.members
        self.progress = progress
        self._cv = threading.Condition()
        self._commands: dict[int, list] = {i: [] for i in range(self.members)}
        self.seen: dict[int, float] = {}
        # a pause of this process (SIGSTOP, a VM stall) must not count as the members'
        # silence: _watch notices its own gaps (see there)
        self._watching = threading.Event()
        self._failed = threading.Event()    # before the watch thread, which reads it
        threading.Thread(target=self._watch, name=f"sparkjet-pause-watch-e{execution_id}",
                         daemon=True).start()
        self.pids: dict[int, int] = {}
        #: each member's exchange location, as it joined
        self.locations: dict[int, str] = {}
        #: with the members' storage: each member's slot report, as it joined
        self.slots: dict[int, dict] = {}
        self._placement: dict | None = None
        self._counters: dict[int, tuple[int, int]] = {}
        self._member_counters: dict[int, dict] = {}
        self._ended: dict[int, set] = {}
        self.done: dict[int, dict] = {}
        #: each member's "restored" report (the phases' seconds and the keys it restored)
        self.restored: dict[int, dict] = {}
        self.failure: BaseException | None = None
        #: members that reported a failure, and when; the first link failure awaiting its
        #: verdict (reporter, error, when)
        self._reported: dict[int, float] = {}
        self._link_failure: tuple[int, ExecutionFailedError, float] | None = None
        self._finished = threading.Event()
        self.stage_error: BaseException | None = None
        self.stage_ended = threading.Event()
        self.stop_requested = threading.Event()
        #: a graceful stop that exports its terminal snapshot: with the members' storage
        #: (and no durable tier) the members first copy what they write into the store
        self.export_requested = False
        self._durable_announced = False
        #: durable_tier="async": each member's report of its upload, by snapshot id
        self._uploads: dict[int, dict[int, dict]] = {}
        self._mark_store: SnapshotStore | None = None
        self._mark_lock = threading.Lock()
        self._polls: dict[int, int] = {}
        self.snapshots = SnapshotCoordinator(
            config=config, store=store, execution_id=execution_id,
            processors=topology.processors, send=self.send,
            all_sources_ended=self._all_sources_ended,
            stopped=lambda: self._failed.is_set() or self._finished.is_set(),
            progress=progress, events_in=lambda: self.counters()[0], check=self.check)
        self.security = security
        self.server = ExchangeServer(host, execution_id=execution_id, security=security)
        for name, handler in (("join", self._join), ("poll", self._poll), ("ack", self._ack),
                              ("restored", self._restored), ("failed", self._member_failed),
                              ("done", self._done), ("uploaded", self._uploaded)):
            self.server.on_action(name, handler)
        if start is not None and start_store is not None:
            # the members read what the store holds of it (durable copies, an export)
            # through the driver: they never open the store
            self.server.on_action("store_read", store_read_handler(start_store, start["dir"]))

    @property
    def location(self) -> str:
        return self.server.location

    # -- the members' actions (on server threads)

    def _member(self, body: dict) -> int:
        i = body.get("member")
        if not isinstance(i, int) or not 0 <= i < self.members:
            raise ValueError(f"no member {i!r} in an execution of {self.members}")
        return i

    def _join(self, body: dict) -> dict:
        """A member's exchange location; the answer holds every member's (by index) once
        all have joined, else none (after up to :data:`JOIN_WAIT` s: ask again)."""
        i = self._member(body)
        location = body.get("location")
        if not isinstance(location, str) or not location:
            raise ValueError(f"member {i} joined without an exchange location")
        slot = body.get("slot")
        members_storage = self.config.storage == "members"
        if members_storage and not (isinstance(slot, dict) and isinstance(slot.get("uuid"), str)
                                    and isinstance(slot.get("host"), str)):
            raise ValueError(f"member {i} joined without its storage slot")
        deadline = time.monotonic() + JOIN_WAIT
        with self._cv:
            if self.locations.setdefault(i, location) != location:
                raise ValueError(f"member {i} joined twice, from {self.locations[i]} and "
                                 f"{location}")
            if members_storage:
                if self._placement is None:     # a member that reclaimed a slot says so
                    self.slots[i] = slot
                elif self.slots.setdefault(i, slot)["uuid"] != slot["uuid"]:
                    # (placement waits for a reclaim in flight: not expected)
                    error = ExecutionFailedError(
                        f"member {i} joined with storage slot {slot['uuid']} after the "
                        f"placement over its slot {self.slots[i]['uuid']}; the execution "
                        "restarts")
                    self.fail(error)
                    raise error
                self._wait.joined_at.setdefault(slot["uuid"], time.monotonic())
                # its reclaim (if it was asked for one) is over: this is its slot now
                self._wait.reclaiming.discard(i)
            self._cv.notify_all()
            while len(self.locations) < self.members and not self._failed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"peers": None}
                self._cv.wait(left)
            while not self._failed.is_set() and members_storage:
                # rebalance_delay: a slot of the previous table that no member holds may
                # come back; a member holding a slot outside that table is asked to claim
                # it instead, the others wait with it. A member asked is left out of
                # placement until it joins again with the slot it holds then: placed
                # meanwhile, the table would be over a slot it has given up.
                awaited, claimers = self._rebalance_wait()
                if not awaited and not self._wait.reclaiming:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"peers": None, "held": True}
                self._cv.wait(min(left, RECLAIM_WAIT))
                if i in claimers:
                    awaited = self._rebalance_wait()[0]
                    if awaited:
                        self._wait.reclaiming.add(i)
                        return {"peers": None, "held": True, "reclaim": awaited}
            if self._failed.is_set():
                raise ExecutionFailedError(f"execution {self.execution_id} has ended: "
                                           f"{self.failure}")
            answer = {"peers": [self.locations[m] for m in range(self.members)]}
            if members_storage:
                answer.update(self._place())
                answer["start"] = self.start
                if i in self._wipe:
                    answer["wipe"] = self._wipe[i]
            return answer

    def _rebalance_wait(self) -> tuple[list[str], set[int]]:
        """(Under ``_cv``, once every member joined.) With ``rebalance_delay`` and the
        members' storage with persistence: the slots of the previous partition table (the
        newest the joined slots hold) that no member holds while the delay runs (counted
        from the loss of a member, else from this driver's first joins), and the members
        that may claim one instead: those holding a slot outside that table (on the host
        the slot was on it may be back). Nothing is awaited once every slot is back, the
        delay is over, no member could claim one, a stop was asked for, or placement is
        done. (Members with a reclaim in flight are waited for apart from this:
        ``_RebalanceWait.reclaiming``.)"""
        delay = self.config.rebalance_delay
        if not delay or self._placement is not None:
            return [], set()
        wait = self._wait
        reports = [self.slots[m] for m in range(self.members)]
        joined = {r["uuid"] for r in reports}
        if wait.since is None:
            wait.begin(previous_table(reports), joined, delay)
        if wait.previous is None or not wait.awaited:
            return [], set()
        awaited = [u for u in wait.awaited if u not in joined]
        members = set(wait.previous.members)
        claimers = {m for m, r in enumerate(reports) if r["uuid"] not in members}
        if (not awaited or not claimers or self.stop_requested.is_set()
                or time.monotonic() >= wait.deadline):
            return [], set()
        if not wait.said:
            wait.said = True
            left = wait.deadline - time.monotonic()
            groups = wait.previous.groups or {}
            self.progress({"event": "waiting", "execution": self.execution_id,
                           "rebalance_delay": delay, "slots_awaited": awaited,
                           "note": f"storage slot(s) {', '.join(awaited)} of the previous "
                                   f"partition table (host(s) "
                                   f"{', '.join(groups.get(u, u) for u in awaited)}) not "
                                   f"claimed: waiting up to {left:.1f} s more "
                                   "(rebalance_delay) before their backups are promoted"})
        return awaited, claimers

    def _rebalanced(self, reports: list[dict]) -> None:
        """The ``rebalance`` event and report, once placed: which lost slots came back
        within ``rebalance_delay`` (``returned``: seconds from the loss to their join), and
        which were given up (``promoted``: their partitions, whose backups were promoted;
        ``gave_up``: why); ``waited_s`` from the loss (a new driver: its first join) to the
        placement, ``held_s`` of it with every member joined (the joins held)."""
        wait = self._wait
        now = time.monotonic()
        wait.placed_at = now
        if wait.previous is None or not wait.awaited:
            return
        joined = {r["uuid"] for r in reports}
        table, since = wait.previous, wait.since
        returned = {u: round(wait.joined_at[u] - since, 3) for u in wait.awaited
                    if u in joined}
        gone = [u for u in wait.awaited if u not in joined]
        promoted = {u: table.partitions_of(u) for u in gone}
        why = ("stop requested" if gone and self.stop_requested.is_set() and
               now < wait.deadline else "no member could claim it" if gone and
               now < wait.deadline else "delay over")
        groups = table.groups or {}
        self.rebalance = {
            "event": "rebalance", "execution": self.execution_id,
            "rebalance_delay": self.config.rebalance_delay, "waited_s": round(now - since, 3),
            "held_s": round(now - wait.all_joined, 3),
            "returned": returned, "promoted": {u: partition_ranges(set(p))
                                               for u, p in promoted.items()},
            "promoted_partitions": sum(len(p) for p in promoted.values()),
            "hosts": {u: groups.get(u, u) for u in wait.awaited},
            "gave_up": why if gone else None}
        if gone:
            _log.warning("execution %d: gave up waiting for storage slot(s) %s after %.1f s "
                         "(rebalance_delay=%g s: %s): their backups were promoted for "
                         "partitions %s", self.execution_id, ", ".join(gone), now - since,
                         self.config.rebalance_delay, why,
                         "; ".join(f"{u}: {r}" for u, r in self.rebalance["promoted"].items()))
        if returned:
            _log.info("execution %d: storage slot(s) %s came back within rebalance_delay=%g s "
                      "(after %s s): they restore their own partitions", self.execution_id,
                      ", ".join(returned), self.config.rebalance_delay,
                      ", ".join(f"{s:.1f}" for s in returned.values()))
        self.progress(dict(self.rebalance))

    def _place(self) -> dict:
        """The partition table over the joined members' slots (built once, by the first
        join answered after all joined), as the join answer carries it."""
        if self._placement is None:
            reports = [self.slots[m] for m in range(self.members)]
            try:
                if self.recover is not None:
                    self._recovered(self.recover(reports))
                    # a slot emptied of the job keeps no table of it
                    reports = [dict(r, table=None) if m in self._wipe else r
                               for m, r in enumerate(reports)]
                if (self.recover is None and self.config.durable_tier == "async"
                        and self._start_store is not None):
                    # a snapshot whose lost slots its incomplete durable copy cannot stand
                    # in for: refused, or (at-least-once) an older one, reported
                    start = async_start(self.config, self._start_store, self.start,
                                        [r["uuid"] for r in reports], self.execution_id,
                                        self.progress)
                    if start is not self.start:
                        self._recovered(_Started(start))
                table = table_for(self.config, reports)
            except Exception as e:  # noqa: BLE001 - ends the execution, named
                self.fail(e)
                raise
            slots = [r["uuid"] for r in reports]
            self._rebalanced(reports)
            self.topology = self.topology.with_placement(table, slots)
            self._placement = {"table": encode_table(table), "slots": slots}
            self.snapshots.table = self._placement["table"]
            self.progress({"event": "placed", "execution": self.execution_id,
                           "table_version": table.version, "backup_count": table.backup_count,
                           "slots": [{"member": m, "uuid": r["uuid"], "host": r["host"],
                                      **({"fenced": r["fenced"]} if r.get("fenced") else {})}
                                     for m, r in enumerate(reports)]})
        return self._placement

    def _recovered(self, recovery) -> None:
        """Takes the persistence restart's decision: what to start from (the store's
        files of it served from its folder) and which slots empty themselves."""
        self.recovery, self._wipe = recovery.report, dict(recovery.wipe)
        if recovery.start is not self.start:
            self.start = recovery.start
            if self.start is not None and self._start_store is not None:
                self.server.on_action("store_read", store_read_handler(self._start_store,
                                                                       self.start["dir"]))

    def _poll(self, body: dict) -> dict:
        i = self._member(body)
        with self._cv:
            self._polls[i] = self._polls.get(i, 0) + 1
            self.seen[i] = time.monotonic()
            self.pids[i] = body.get("pid")
            self._counters[i] = (int(body.get("events_in", 0)), int(body.get("events_out", 0)))
            self._member_counters[i] = {k: body.get(k) for k in
                                        ("events_in", "events_out", "late_events",
                                         "skipped_events", "dead_letters", "offset_resets",
                                         "vertices", "latency")}
            self._ended[i] = set(body.get("ended", ()))
            self._cv.notify_all()
            if not self._commands[i] and not self._failed.is_set():
                self._cv.wait(POLL_WAIT)
            commands, self._commands[i] = self._commands[i], []
        if self._failed.is_set():
            raise ExecutionFailedError(f"execution {self.execution_id} has ended: {self.failure}")
        return {"commands": commands}

    def _restored(self, body: dict) -> dict:
        """A member restored its state and rebuilt its operators; after the last one, the
        "restored" event: the snapshot, the slowest member's phases (``read_s``,
        ``rebuild_s``, ``seconds``), the keys restored by all and, when members synced stale
        copies by Merkle trees first, what that moved (``merkle_resync``)."""
        i = self._member(body)
        with self._cv:
            if i in self.restored:
                return {}
            self.restored[i] = body
            if len(self.restored) < self.members:
                return {}
            reports = list(self.restored.values())
        event = {"event": "restored", "snapshot": body.get("snapshot"),
                 "export": body.get("export"), "job": body.get("job"),
                 "execution": self.execution_id, "members": self.members}
        for k in ("read_s", "rebuild_s", "seconds"):
            event[k] = max(float(r.get(k) or 0.0) for r in reports)
        event["keys"] = sum(int(r.get("keys") or 0) for r in reports)
        synced = [r["merkle_resync"] for r in reports if isinstance(r.get("merkle_resync"), dict)]
        if synced:      # members that resynced stale copies before they restored
            event["merkle_resync"] = {k: sum(int(x.get(k) or 0) for x in synced) for k in (
                "files", "bytes", "full_copy_bytes", "rows_fetched", "fallback_partitions")}
        self.progress(event)
        return {}

    def _uploaded(self, body: dict) -> dict:
        """A member's upload of committed snapshot ``snapshot`` ended (durable_tier="async",
        :mod:`sparkjet.runtime.durable`); once every member's has, the snapshot is marked
        durable in the store and a ``durable`` event says so (its files and bytes, and
        ``behind``: how many snapshots were committed after it meanwhile), or, when an
        upload failed or the store no longer keeps it, a ``durable_failed`` event."""
        i = self._member(body)
        sid = int(body["snapshot"])
        with self._cv:
            reports = self._uploads.setdefault(sid, {})
            reports[i] = body
            if len(reports) < self.members:
                return {}
            for old in [s for s in self._uploads if s <= sid]:   # older: superseded
                del self._uploads[old]
        records = self.snapshots.records
        newest = records[-1]["snapshot"] if records else sid
        event = {"execution": self.execution_id, "snapshot": sid, "behind": newest - sid,
                 "superseded": sorted({s for r in reports.values()
                                       for s in r.get("superseded") or ()})}
        failed = [f"member {m}: {r['error']}" for m, r in sorted(reports.items())
                  if r.get("error")]
        if not failed:
            try:
                # one mark at a time (the exchange serves actions on a pool of threads), on
                # a store object of its own: the snapshot loop's is not shared between
                # threads; opened outside _cv, so that polls never wait for a connect
                with self._mark_lock:
                    if self._mark_store is None:
                        self._mark_store = open_store(self.config)
                    event.update(self._mark_store.mark_durable(sid))
            except Exception as e:  # noqa: BLE001 - the copy is incomplete; the job goes on
                failed.append(f"{type(e).__name__}: {e}")
        self.progress({"event": "durable_failed" if failed else "durable", **event,
                       **({"errors": failed} if failed else {})})
        return {}

    def _ack(self, body: dict) -> dict:
        self._member(body)
        self.snapshots.ack(body["processor"], int(body["snapshot"]),
                           Manifest.from_json(body["manifest"]), body.get("alignment_s"),
                           body.get("schemas"), body.get("uploading"))
        return {}

    def _who(self, i: int, pid=None) -> str:
        """"member i (pid N)", or "member i" while its pid is not known (it failed before
        it joined)."""
        pid = self.pids.get(i) or pid
        return f"member {i} (pid {pid})" if pid else f"member {i}"

    def _member_failed(self, body: dict) -> dict:
        """A member failed. When its failure is a broken link to a peer (``link``), the
        peer is the likelier culprit (its worker died, so its streams broke): the verdict
        waits :data:`LINK_VERDICT_WAIT` s for the member that then neither reported nor
        polled, and names it; else the reporter."""
        i = self._member(body)
        report = {k: body.get(k) for k in ("error", "traceback", "deterministic", "transient",
                                           "exception")}
        error = ExecutionFailedError(
            f"{self._who(i, body.get('pid'))} failed: {body.get('error')}",
            {**report, "member": i})
        with self._cv:
            self._reported.setdefault(i, time.monotonic())
            if not body.get("link"):
                self._link_failure = None
            elif self.failure is None and self._link_failure is None:
                self._link_failure = (i, error, time.monotonic())
                gone = [j for j in range(self.members)
                        if j != i and j not in self.done and self._gone_here(j)]
                if len(gone) == 1:
                    # a peer on this machine whose process is gone: named at once (outside
                    # this lock), not after the wait for who stops polling
                    verdict = threading.Thread(target=self._link_verdict, args=(gone[0],),
                                               daemon=True)
                    verdict.start()
                    return {}
                verdict = threading.Timer(LINK_VERDICT_WAIT, self._link_verdict)
                verdict.daemon = True
                verdict.start()
                return {}
            elif self._link_failure is not None:
                return {}
        self.fail(error)
        return {}

    def _gone_here(self, j: int) -> bool:
        """Whether member ``j`` runs on this machine (its exchange server listens on the
        loopback interface: ``local[N]``) and its process is gone (or a zombie): its
        death is then known at once, not after :data:`LINK_VERDICT_WAIT`."""
        location, pid = self.locations.get(j), self.pids.get(j)
        if not location or not pid:
            return False
        try:
            host = urllib.parse.urlparse(location).hostname or ""
            if not (host == "localhost" or ipaddress.ip_address(host).is_loopback):
                return False
        except ValueError:
            return False
        try:
            with open(f"/proc/{int(pid)}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
        except (OSError, IndexError, ValueError):
            return False

    def _link_verdict(self, gone_member: int | None = None) -> None:
        """Fails the execution for the link failure reported first: naming the member that
        neither reported a failure nor polled since (its worker is gone) if there is one,
        or ``gone_member``, whose process is known gone."""
        with self._cv:
            if self._link_failure is None or self.failure is not None:
                return
            i, error, when = self._link_failure
            gone = [gone_member] if gone_member is not None else [
                j for j in range(self.members) if j not in self._reported
                and j not in self.done and self.seen.get(j, 0.0) < when]
        if len(gone) == 1:
            j = gone[0]
            error = ExecutionFailedError(
                f"{self._who(j)} died or stopped answering: member {i} "
                f"lost its link to it ({error.report.get('error')})",
                {**error.report, "member": j, "traceback": None, "exception": False,
                 "deterministic": False})
        self.fail(error)

    def _done(self, body: dict) -> dict:
        i = self._member(body)
        with self._cv:
            self.done[i] = body.get("metrics") or {}
            self._counters[i] = (int(body.get("events_in", 0)), int(body.get("events_out", 0)))
            self._cv.notify_all()
        return {}

    # -- state

    def send(self, command: list) -> None:
        with self._cv:
            for q in self._commands.values():
                q.append(command)
            self._cv.notify_all()

    def member_counters(self) -> dict:
        """Each member's counters as its last heartbeat carried them."""
        with self._cv:
            return {i: dict(c) for i, c in self._member_counters.items()}

    def counters(self) -> tuple[int, int]:
        with self._cv:
            return (sum(c[0] for c in self._counters.values()),
                    sum(c[1] for c in self._counters.values()))

    def _all_sources_ended(self) -> bool:
        if self.stop_requested.is_set():      # a graceful stop: the next snapshot is terminal
            if self.export_requested and not self._durable_announced:
                self._announce_durable()
            return True
        with self._cv:
            ended = set().union(*self._ended.values()) if self._ended else set()
        return len(ended) == self.topology.n_sources

    def _announce_durable(self) -> None:
        """Before the terminal snapshot of a stop that exports it, with the members' storage
        and no sync durable tier (``"async"`` uploads only after the commit, too late for the
        export): every member is told to copy the files it writes from now on
        into the store (``["durable"]``), and has run that command (it polled twice since:
        the poll that took it and the next, begun after the command ran) before the
        terminal barrier goes out, so that no processor opens that snapshot's writer
        without it. Bounded by twice the heartbeat timeout; past it the export says which
        files have no durable copy."""
        self._durable_announced = True
        if self.config.storage != "members" or self.config.durable_tier == "sync":
            return
        with self._cv:
            for q in self._commands.values():
                q.append(["durable"])
            base = {i: self._polls.get(i, 0) for i in range(self.members)}
            self._cv.notify_all()
            deadline = time.monotonic() + 2 * self.config.heartbeat_timeout
            while (any(self._polls.get(i, 0) < base[i] + 2 for i in base)
                   and not self._failed.is_set() and time.monotonic() < deadline):
                self._cv.wait(0.05)

    def fail(self, error: BaseException) -> None:
        with self._cv:
            if self.failure is None:
                self.failure = error
            self._failed.set()
            self._cv.notify_all()

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def check(self) -> None:
        """Raises if the execution cannot go on: a member failed, its Spark stage ended
        early, or a member has been silent past the heartbeat timeout."""
        if self.failure is not None:
            raise self.failure
        if self._link_failure is not None:
            return          # a member lost a link: the verdict names who failed, shortly
        if self.stage_ended.is_set() and len(self.done) < self.members:
            raise ExecutionFailedError(
                f"the Spark stage of execution {self.execution_id} ended before its members did: "
                f"{short_error(self.stage_error) if self.stage_error else 'no error reported'}")
        now = time.monotonic()
        timeout = self.config.heartbeat_timeout
        with self._cv:
            silent = [(i, now - t) for i, t in self.seen.items()
                      if i not in self.done and now - t > timeout]
        if silent:
            i, quiet = silent[0]
            raise ExecutionFailedError(f"{self._who(i)} silent for "
                                       f"{quiet:.1f} s (heartbeat_timeout={timeout} s)",
                                       {"member": i})

    def _watch(self) -> None:
        """Ticks every 50 ms until the execution ends. A tick that comes over half the
        heartbeat timeout after the one before means this whole process did not run
        meanwhile (stopped, paused, its VM stalled): no member's poll could be taken
        either, so every member's silence counts from then, not from before the pause
        (as Hazelcast resets its heartbeat times after a pause of the detector). A member
        that died meanwhile is found one heartbeat_timeout later. A slow phase of the
        snapshot loop is no pause: this thread runs on through it, and the polls with it."""
        gap = self.config.heartbeat_timeout / 2
        last = time.monotonic()
        while not self._watching.wait(0.05) and not self._failed.is_set():
            now = time.monotonic()
            if now - last > gap:
                with self._cv:
                    for i in self.seen:
                        self.seen[i] = max(self.seen[i], now)
            last = now

    def wait_started(self, timeout: float) -> None:
        """Waits until every member has polled once (it restored its state and runs):
        ``timeout`` s, and as long more as the joins were held for lost slots
        (``rebalance_delay``: :meth:`_RebalanceWait.held_s`)."""
        started = time.monotonic()
        with self._cv:
            while len(self.seen) < self.members:
                if self.failure is not None:
                    raise self.failure
                if self.stage_ended.is_set():
                    why = short_error(self.stage_error) if self.stage_error else "no error"
                    raise ExecutionFailedError(
                        f"the Spark stage of execution {self.execution_id} ended before its "
                        f"members started: {why}")
                now = time.monotonic()
                held = self._wait.held_s(now)
                if now > started + timeout + held:
                    raise ExecutionFailedError(
                        f"only {len(self.seen)} of {self.members} members of execution "
                        f"{self.execution_id} started within {timeout + held:.0f} s "
                        "(start_timeout"
                        + (", and data_load_timeout for the members to verify their slots"
                           if timeout > self.config.start_timeout else "")
                        + (f", and {held:.0f} s the joins were held for lost slots "
                           "(rebalance_delay)" if held else "") + ")")
                self._cv.wait(0.1)

    def run(self, snapshot_id: int) -> None:
        """The snapshot loop, then waits for every member to finish."""
        self.snapshots.run(snapshot_id)
        while True:
            self.check()
            with self._cv:
                if len(self.done) == self.members:
                    break
                self._cv.wait(0.1)
        self._finished.set()

    def close(self) -> None:
        self._watching.set()
        self.fail(ExecutionFailedError(f"execution {self.execution_id} is over"))
        self.server.close(timeout=2.0)
        with self._mark_lock:
            if self._mark_store is not None:
                self._mark_store.close()
                self._mark_store = None


class _Started:
    """A start the driver picked itself, as :meth:`ExecutionCoordinator._recovered`
    takes it (durable_tier="async": :func:`~sparkjet.runtime.durable.async_start`)."""

    def __init__(self, start: dict | None):
        self.start, self.report, self.wipe = start, None, {}


def short_error(error: BaseException) -> str:
    """The type and first lines of an error (a Spark error carries a Java stack trace)."""
    text = str(error).strip()
    # Spark errors carry a Java stack trace; its first lines say what happened.
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return f"{type(error).__name__}: " + " | ".join(lines[:3])[:600]
