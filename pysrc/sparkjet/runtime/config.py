"""JobConfig: how a job runs, as plain data."""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

import xxhash
from msgspec import Meta

from sparkjet._checks import Finite, check_fields
from sparkjet._fs import absolute
from sparkjet.errors import InvalidArgumentError
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT
from sparkjet.snapshot.records import NAME_PATTERN
from sparkjet.snapshot.store import DEFAULT_RETAINED, MAX_RETAINED, SnapshotStore

# The schema of the fields (sparkjet._checks.check_fields): an interval or a backoff must
# be finite; a timeout may be infinite (never time out).
#: Upper bounds of the sizes a job is given: far above what one machine or cluster runs
#: well, they stop a slip of the keyboard (``local_parallelism=10000``: ten thousand
#: threads per vertex on one machine, which runs for many minutes instead of seconds) with
#: a message that says how to scale instead.
MAX_LOCAL_PARALLELISM = 256
MAX_MEMBERS = 4096
MAX_PARTITION_COUNT = 100_000
MAX_QUEUE_CAPACITY = 4096
#: The longest ``max_batch_delay``, in seconds: Flink's buffer timeout is 100 ms by default.
MAX_BATCH_DELAY = 10.0

_SCALE_OUT = "to scale further, add members (JobConfig.members, on a Spark cluster)"
LocalParallelism = Annotated[int, Meta(ge=1, le=MAX_LOCAL_PARALLELISM, extra={"limit": (
    "the processors of a vertex in one member are threads on one machine; "
    f"{_SCALE_OUT}")})]
Members = Annotated[int, Meta(ge=1, le=MAX_MEMBERS, extra={"limit": (
    "each member is a Spark barrier task, and every execution waits for all of them; for more "
    "throughput per member raise local_parallelism")})]
PartitionCount = Annotated[int, Meta(ge=1, le=MAX_PARTITION_COUNT, extra={"limit": (
    "every processor keeps arrays and every snapshot writes entries per partition; the "
    "partitions only need to outnumber the processors (members x local_parallelism)")})]
RetainedSnapshots = Annotated[int, Meta(ge=1, le=MAX_RETAINED, extra={"limit": (
    "each retained snapshot is a full copy of the job's state in the snapshot store; to keep "
    "one for longer, export it (Job.stop(snapshot=...))")})]
QueueCapacity = Annotated[int, Meta(ge=1, le=MAX_QUEUE_CAPACITY, extra={"limit": (
    "each channel into a processor holds up to this many batches (of up to batch_size rows) "
    "in memory; backpressure needs no deeper queue")})]
MaxBatchDelay = Annotated[float, Meta(ge=0, le=MAX_BATCH_DELAY, extra={"limit": (
    "it bounds how long a row may wait for a batch to fill; for fewer, larger batches at a "
    "high rate nothing needs to wait longer: a busy source fills its batches by itself")})]

Guarantee = Literal["exactly-once", "at-least-once", "none"]  # sparkjet.connectors.base.GUARANTEES
Codec = Literal["blosc2-lz4", "lz4", "raw"]  # sparkjet.snapshot.chunks.CODECS
RecoveryPolicy = Literal["FULL_RECOVERY_ONLY", "PARTIAL_RECOVERY_MOST_RECENT",
                         "PARTIAL_RECOVERY_MOST_COMPLETE"]
#: The persistence settings (Hazelcast's names) and their defaults: given only with
#: ``storage="members"`` and ``persistence=True``; None elsewhere means "not given".
PERSISTENCE_DEFAULTS = {"validation_timeout": 120.0, "data_load_timeout": 900.0,
                        "cluster_data_recovery_policy": "FULL_RECOVERY_ONLY",
                        "auto_remove_stale_data": True, "rebalance_delay": 0.0}


@dataclass(frozen=True)
class JobConfig:
    """The configuration of a job.

    - ``processing_guarantee``: "exactly-once" (default), "at-least-once" or "none".
    - ``snapshot_interval``: seconds between snapshots (Jet's default is 10 s; 1 s here).
    - ``snapshot_store``: where snapshots go (a directory or a pyarrow.fs URI); required
      unless the guarantee is "none".
    - ``max_restarts``, ``restart_backoff`` and ``restart_window``: a failed execution (on
      Spark, or of the member process without it) is restarted at most ``max_restarts``
      times within any ``restart_window`` seconds (a sliding window, like Flink's
      failure-rate restart strategy; default 600 s; None: over the job's whole run), waiting
      ``restart_backoff * 2**(k-1)`` seconds (capped at 30 s) before restart k of the
      window. What failed decides whether it is restarted at all
      (:mod:`sparkjet.runtime.failures`): an error about the data ends the job at once; an
      outage (connection refused or reset, a timeout, a server shutting down or starting
      up, a serialization failure) is retried within those bounds however often it
      repeats; an error of unknown kind (a user function's exception) is retried once and
      ends the job if the replay fails the same way.
    - ``local_parallelism``: processors per vertex in a member (at most 256: to scale
      further, add members on a Spark cluster).
    - ``max_batch_delay``: the longest a row waits, in seconds, for a batch to fill before it
      moves on (Flink's buffer timeout; default 0.005, 0 to 10; 0: every batch at once): a
      source with nothing to read looks again at least this often, one whose reader gave
      all it had (a slow stream) reads again half of it later, a batch of fewer than
      ``batch_size / 16`` rows waits on its edge into the next vertex for more (sent once
      they add up to that many rows, or the oldest waited this long), and a sink that buffers
      rows (the upsert sinks, SQLite and PostgreSQL's ``key=`` mode) writes them out, and
      Kafka's producer sends them (its ``linger.ms``), once the oldest has waited this
      long. So at a low rate latency is not set by ``batch_size``; at a high rate batches
      fill first. Sinks whose rows become visible only by a commit (files, Delta, and
      every exactly-once sink) show them at the snapshot's commit, whatever this is.
    - ``alignment_timeout``: seconds a keyed processor waits, once the first barrier of a
      snapshot reached it, for the barriers of all its inputs before it takes the snapshot
      unaligned (Flink's ``execution.checkpointing.aligned-checkpoint-timeout``): it saves
      its state at once, forwards the barrier ahead of the data still queued, and stores
      the batches and watermarks its inputs sent before their barriers as part of the
      snapshot, which a restore replays before new input
      (:class:`~sparkjet.runtime.aligner.TimeoutAligner`). Under backpressure (a slow sink,
      a hot key) snapshot time is then bounded by the timeout, not by the backlog; the
      snapshot is larger by what was in flight (at most ``queue_capacity`` batches per
      channel, plus what comes until the barrier). None (the default): always aligned,
      as before (no snapshot holds data in flight); 0: unaligned as soon as a barrier
      comes. Exactly-once only; a stop, suspend or export is always aligned. A restore of
      an unaligned snapshot at another parallelism is refused
      (:class:`~sparkjet.errors.InFlightRescaleError`).
    - ``partition_count``: the Hazelcast partitions keyed state is spread over (271, at most
      100000); ``queue_capacity``: batches each channel into a processor holds (at most 4096).
    - ``members``: on Spark, how many members (barrier tasks) an execution has (at most
      4096); None (the default) takes every task slot the cluster has (``local[N]``: N). With fewer slots
      than asked, an execution runs on the slots there are (see ``quorum_timeout``).
    - ``heartbeat_timeout``: on Spark, a member silent this long (no poll reaches the
      coordinator) is declared failed, and the execution restarts.
    - ``start_timeout``: on Spark, how long the members of an execution may take to start
      (be scheduled, restore their state) before the execution counts as failed.
    - ``quorum_timeout``: split-brain protection: an execution never starts with fewer
      members than ``floor(largest member count seen / 2) + 1``; the coordinator waits for
      slots up to this long (re-checking every ``restart_backoff``; a ``rebalance_delay``
      wait for a lost member's host does not count), then fails the job.
    - ``tls``: encrypt the links between members and the coordinator on Spark: True,
      False, or None (the default) for on with a cluster master and off on ``local[N]``,
      where every link stays on one machine. Every call is authenticated either way
      (:mod:`sparkjet.runtime.exchange.security`).
    - ``tls_certificate`` and ``tls_private_key``: PEM files of the certificate to use
      instead of the one the driver makes per execution; ``tls_server_name``: a name that
      certificate holds (clients check it, not the host name).
    - ``coordinator_host``: on Spark, the address the coordinator listens on and its
      members dial: it runs where ``Job.run`` is called. None (the default): the driver's
      ``spark.driver.host`` on a classic session; on a Spark Connect session (whose
      coordinator runs in the client, not on the server's driver), this machine's address
      on the route to the Connect server. Every executor must reach it.
    - ``on_error``: what every stage that does not say otherwise does with a bad record
      (a source's undecodable record, a null key in a keyed stage, a row a
      ``map_batches`` or ``filter`` stage fails on, a row a sink refuses): "fail" (the
      default) or "skip" (see the README's "Bad records" and
      :mod:`sparkjet.connectors.dead_letters`).
    - ``retained_snapshots``: how many complete snapshots the store keeps (2, at most
      100). When the newest fails to verify at a restore, the job falls back to the newest
      older one that verifies, unless a sink committed output past it (see
      :mod:`sparkjet.runtime.restore`). With ``durable_tier="async"`` the store and the
      slots also keep the snapshots whose upload is under way and the newest one marked
      durable (:mod:`sparkjet.runtime.durable`).
    - ``initial_snapshot``: Jet's initial snapshot name: a job with no snapshot of its own
      starts from this exported snapshot, of this job (``"v1"``) or of another job in the
      same snapshot store (``"other-job/v1"``). Its sources resume from the export's
      offsets; its sinks start clean (the old job's transactions are left alone). An
      integer picks one of the job's own retained snapshots by id: the job rolls back to
      it once (as ``sparkjet snapshots rollback`` does; output committed after it is
      written again), and left in the configuration does nothing after that.
    - ``state_mapping``: for a pipeline that changed since its snapshot, what becomes of the
      state of a vertex (or sink) of the snapshot: ``{"old": "new"}`` restores it into
      vertex ``new``, ``{"old": None}`` drops it. It applies only to a snapshot that another
      pipeline took (so, left in place, it does nothing once the job has snapshots of its
      own). See :mod:`sparkjet.runtime.restore`.
    - ``storage``: where a job keeps its state between executions. "shared": every
      snapshot in ``snapshot_store``. "members" (the default, as Jet keeps snapshots in
      the members' memory): each member task claims a storage slot, a folder under
      ``storage_dir`` on its host
      (:mod:`sparkjet.snapshot.slots`), and the driver places the partitions over the slots
      after they join (a ``PartitionTable`` over slot UUIDs with ``backup_count`` backups on
      other hosts), keeping the table from one execution to the next so a slot keeps its
      partitions. Processors write their chunk files into their slot; the records (the
      commit point) stay in ``snapshot_store``; each file is copied, verified, to the
      slots that back its partitions (see the README's "Snapshots on the members").
    - ``backup_count``: backups of each partition on other hosts' slots (1; 0..6).
    - ``durable_tier``: with the members' storage, "sync" also copies every chunk file into
      ``snapshot_store`` before the snapshot's acknowledgement (the durable tier: a restore
      reads it when no slot holding the file is left, and exports need it); "async"
      acknowledges and commits without it and uploads each committed snapshot's files in
      the background (at most one snapshot waiting per member; a newer one supersedes it),
      which count once every member's upload is checked and the driver marked the
      snapshot (a ``durable`` event); a restore falls back only to the durable copy of the
      snapshot it restores: lost slots and an incomplete copy are refused under
      exactly-once, and restore an older snapshot under at-least-once, reporting the
      replay window (:mod:`sparkjet.runtime.durable`); "none" (the default) keeps the
      state in the slots alone.
    - ``persistence``: slots on disk, every write fsynced (False: tmpfs is enough).
    - ``storage_dir``: the host-local folder of the slots; None: ``/dev/shm/sparkjet-storage``
      (memory) where there is a ``/dev/shm`` of 1 GiB or more, else ``sparkjet-storage`` in
      the temporary folder (a container's ``/dev/shm`` is often 64 MB). Must
      be given with ``persistence``. ``SPARKJET_STORAGE_DIR`` on a host overrides it there.
    - Persistence restart (seed 004; Hazelcast's names and defaults), with
      ``storage="members"`` and ``persistence=True`` only (see
      :mod:`sparkjet.runtime.persistence` and the README's "Persistence restart"):
      ``validation_timeout`` (120 s): how long a new driver waits, before its first
      execution, for as many task slots as the newest committed snapshot had slots;
      ``data_load_timeout`` (900 s): how long each member may take to verify its slot's
      replicas of the committed snapshots against the records' checksums before it joins
      (what it has not verified by then counts as not held; an execution's members get
      ``start_timeout`` plus this long to start);
      ``cluster_data_recovery_policy``: "FULL_RECOVERY_ONLY" (the default: every
      partition of the newest committed snapshot must be held by a slot present, else the
      job is refused, naming the partitions, slots and hosts), "PARTIAL_RECOVERY_MOST_RECENT"
      (the newest snapshot complete over the slots present) or
      "PARTIAL_RECOVERY_MOST_COMPLETE" (the snapshot held whole by the most slots, which
      must be complete over them); a partial policy gives older snapshots up loudly, and
      under exactly-once never picks one that a committed phase 2 overtook while the
      pipeline has a transactional sink or an acknowledging source;
      ``auto_remove_stale_data`` (True): a slot whose job data is corrupt or from the future
      (newer than the driver's records) is emptied of this job's data, logged with its
      path; False: refused, naming the path; ``rebalance_delay`` (0 s): after a member left,
      how long an execution waits for a slot of the previous partition table that no
      member holds (its host coming back) before its partitions' backups are promoted and
      the table rebalanced; a slot back within it restores its own partitions (the
      ``rebalance`` event says which).
    - ``merkle_tree_depth``: levels of the Merkle trees a slot that missed snapshots syncs
      its partitions with (:mod:`sparkjet.runtime.resync`): Hazelcast's ``merkle-tree.depth``,
      default 10, an int in 2..27, or "auto" (:func:`sparkjet.merkle.choose_depth` for the
      entries synced, assuming about 0.1 % of them changed). A depth whose trees over
      ``partition_count`` partitions would take over 512 MiB is lowered to the deepest that
      fits, with a warning (at 271 partitions: 18).
    """

    name: Annotated[str, Meta(min_length=1)] = "sparkjet-job"
    processing_guarantee: Guarantee = "exactly-once"
    snapshot_interval: Annotated[Finite, Meta(ge=0.001)] = 1.0
    snapshot_store: Annotated[str, Meta(min_length=1)] | None = None
    max_restarts: Annotated[int, Meta(ge=0)] = 3
    restart_backoff: Annotated[Finite, Meta(ge=0)] = 0.5
    restart_window: Annotated[Finite, Meta(gt=0)] | None = 600.0
    local_parallelism: LocalParallelism = 2
    partition_count: PartitionCount = DEFAULT_PARTITION_COUNT
    batch_size: Annotated[int, Meta(ge=1, le=2**31 - 1)] = 65536
    max_batch_delay: MaxBatchDelay = 0.005
    queue_capacity: QueueCapacity = 16
    snapshot_codec: Codec = "blosc2-lz4"
    job_id: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    members: Members | None = None
    heartbeat_timeout: Annotated[float, Meta(ge=0.5)] = 10.0
    start_timeout: Annotated[float, Meta(ge=1)] = 120.0
    quorum_timeout: Annotated[float, Meta(ge=0)] = 300.0
    tls: bool | None = None
    tls_certificate: str | None = None
    tls_private_key: str | None = None
    tls_server_name: Annotated[str, Meta(min_length=1)] = "sparkjet"
    on_error: Literal["fail", "skip"] = "fail"
    initial_snapshot: Annotated[int, Meta(ge=0, le=2**63 - 1)] | \
        Annotated[str, Meta(min_length=1)] | None = None
    state_mapping: dict[Annotated[str, Meta(min_length=1)],
                        Annotated[str, Meta(min_length=1)] | None] | None = None
    coordinator_host: Annotated[str, Meta(min_length=1)] | None = None
    retained_snapshots: RetainedSnapshots = DEFAULT_RETAINED
    storage: Literal["shared", "members"] = "members"
    backup_count: Annotated[int, Meta(ge=0, le=6)] = 1
    persistence: bool = False
    storage_dir: Annotated[str, Meta(min_length=1)] | None = None
    durable_tier: Literal["none", "sync", "async"] = "none"
    alignment_timeout: Annotated[Finite, Meta(ge=0)] | None = None
    validation_timeout: Annotated[float, Meta(ge=0)] | None = None
    data_load_timeout: Annotated[float, Meta(ge=0)] | None = None
    cluster_data_recovery_policy: RecoveryPolicy | None = None
    auto_remove_stale_data: bool | None = None
    rebalance_delay: Annotated[Finite, Meta(ge=0)] | None = None
    merkle_tree_depth: int | str = 10

    def __post_init__(self):
        # Every field against its annotation; frozen, so the checked values (plain Python
        # data: numpy scalars and paths converted) are stored with object.__setattr__.
        for name, value in check_fields(self).items():
            object.__setattr__(self, name, value)
        if self.snapshot_store is not None:
            # a relative path is the driver's: a Spark worker runs in a directory of its own
            object.__setattr__(self, "snapshot_store", absolute(self.snapshot_store))
        if self.processing_guarantee != "none" and not self.snapshot_store:
            raise InvalidArgumentError(
                f"processing_guarantee {self.processing_guarantee!r} needs snapshot_store "
                "(a directory or a pyarrow.fs URI)")
        if (self.tls_certificate is None) != (self.tls_private_key is None):
            raise InvalidArgumentError(
                "tls_certificate and tls_private_key go together: give both or neither")
        if self.tls_certificate is not None and self.tls is False:
            raise InvalidArgumentError("tls_certificate was given, but tls=False")
        if isinstance(self.initial_snapshot, str):
            export = self.initial_snapshot.rpartition("/")[2]
            if not re.fullmatch(NAME_PATTERN, export):
                raise InvalidArgumentError(
                    f"JobConfig.initial_snapshot is an export name ({NAME_PATTERN}), or a job "
                    f"name, a slash and an export name, got {self.initial_snapshot!r}")
        if self.initial_snapshot is not None:
            if self.processing_guarantee == "none":
                raise InvalidArgumentError("JobConfig.initial_snapshot needs snapshots: "
                                           "processing_guarantee is 'none'")
        if self.alignment_timeout is not None and self.processing_guarantee != "exactly-once":
            raise InvalidArgumentError(
                "JobConfig.alignment_timeout is for exactly-once: with "
                f"{self.processing_guarantee!r} no barrier holds a channel")
        if self.durable_tier != "none" and self.storage != "members":
            raise InvalidArgumentError(
                "JobConfig.durable_tier is a copy of the members' storage in snapshot_store; "
                "with storage=\"shared\" every snapshot is there already")
        if self.durable_tier != "none" and self.processing_guarantee == "none":
            raise InvalidArgumentError(
                f"JobConfig.durable_tier={self.durable_tier!r} copies snapshots into "
                "snapshot_store: with processing_guarantee 'none' there are none")
        if self.persistence and self.storage_dir is None:
            raise InvalidArgumentError(
                "JobConfig.persistence needs storage_dir: a folder on a local disk of every "
                "host (the default is in memory, which a restart of the host empties)")
        if self.storage_dir is not None:
            object.__setattr__(self, "storage_dir", os.path.abspath(self.storage_dir))
        # not given is None; the defaults filled in below are taken for not given too, so
        # that dataclasses.replace(config, persistence=False) works
        given = [k for k, default in PERSISTENCE_DEFAULTS.items()
                 if getattr(self, k) is not None and getattr(self, k) != default]
        persisted = self.storage == "members" and self.persistence
        if not persisted:
            for k in PERSISTENCE_DEFAULTS:
                object.__setattr__(self, k, None)
        if given and not persisted:
            why = ("storage is \"shared\": every snapshot is in snapshot_store, and a restart "
                   "reads it there" if self.storage != "members" else
                   "persistence is False: the slots are in memory, and nothing of them "
                   "outlives their hosts")
            raise InvalidArgumentError(
                f"JobConfig.{given[0]} is a setting of a persistence restart, which needs "
                f"storage=\"members\" and persistence=True; {why}")
        check_merkle_depth(self.merkle_tree_depth)
        if persisted:
            for k, default in PERSISTENCE_DEFAULTS.items():
                if getattr(self, k) is None:
                    object.__setattr__(self, k, default)

    def storage_root(self) -> str:
        """The folder of this host's storage slots (evaluated where a member runs):
        ``SPARKJET_STORAGE_DIR``, else ``storage_dir``, else :func:`default_storage_root`."""
        given = os.environ.get("SPARKJET_STORAGE_DIR") or self.storage_dir
        if given:
            return given
        return default_storage_root()

    @property
    def id(self) -> int:
        """The job id: given, or derived from the name (stable across runs and restarts)."""
        if self.job_id is not None:
            return self.job_id
        return xxhash.xxh64_intdigest(self.name.encode()) & (2**63 - 1)

    def to_dict(self) -> dict:
        return asdict(self)


#: The least size of a ``/dev/shm`` the slots go to by default: a container's is often 64 MB
#: (Docker's default), which a keyed state of a few million keys and its backups outgrow.
SHM_MIN_BYTES = 1 << 30


def default_storage_root(shm: str = "/dev/shm", minimum: int = SHM_MIN_BYTES) -> str:
    """Where a host's slots go when nothing says: ``shm``/sparkjet-storage (memory) where
    that file system holds at least ``minimum`` bytes in all, else ``sparkjet-storage`` in
    the temporary folder; a ``shm``/sparkjet-storage that exists already is kept whatever
    the size (its slots must stay reachable). Its size, not its free space, decides: the
    answer must not change between executions, or a slot would be out of reach of the
    next."""
    there = os.path.join(shm, "sparkjet-storage")
    try:
        st = os.statvfs(shm)
        # slots already there stay reachable (a job suspended before this rule resumes)
        if st.f_blocks * st.f_frsize >= minimum or os.path.isdir(there):
            return there
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), "sparkjet-storage")


MERKLE_DEPTHS = (2, 27)


def check_merkle_depth(depth) -> None:
    """Raises InvalidArgumentError naming ``depth`` unless it is an int in 2..27 or
    "auto" (``JobConfig.merkle_tree_depth``)."""
    low, high = MERKLE_DEPTHS
    if depth == "auto" or (type(depth) is int and low <= depth <= high):
        return
    raise InvalidArgumentError(
        f"JobConfig.merkle_tree_depth={depth!r}: the depth of the Merkle trees of a resync "
        f"is an int in {low}..{high} (levels; Hazelcast's default is 10) or \"auto\"")


def open_store(config: JobConfig, *, job_id: int | None = None, job_name: str | None = None,
               create: bool = True) -> SnapshotStore:
    """The snapshot store of ``config``'s job (or of job ``job_id``, named ``job_name``, in
    the same place: the job an ``initial_snapshot`` comes from): the one place the runtime
    opens a store. ``create=False`` only reads (see :class:`SnapshotStore`)."""
    if job_id is None:
        job_id, job_name = config.id, config.name
    return SnapshotStore(config.snapshot_store, job_id, create=create, name=job_name,
                         retained=config.retained_snapshots,
                         keep_marked=config.durable_tier == "async")
