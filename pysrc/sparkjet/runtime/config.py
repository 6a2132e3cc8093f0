"""JobConfig: how a job runs, as plain data."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import xxhash

from sparkjet._checks import check_int, check_number
from sparkjet.connectors import GUARANTEES
from sparkjet.errors import InvalidArgumentError
from sparkjet.partitioning import DEFAULT_PARTITION_COUNT


@dataclass(frozen=True)
class JobConfig:
    """The configuration of a job.

    - ``processing_guarantee``: "exactly-once" (default), "at-least-once" or "none".
    - ``snapshot_interval``: seconds between snapshots (Jet's default is 10 s; 1 s here).
    - ``snapshot_store``: where snapshots go (a directory or a pyarrow.fs URI); required
      unless the guarantee is "none".
    - ``max_restarts`` and ``restart_backoff``: a failed execution (on Spark, or of the
      member process without it) is restarted at most this many times over the job's run,
      waiting ``restart_backoff * 2**(k-1)`` seconds (capped at 30 s) before restart k.
    - ``local_parallelism``: processors per vertex in a member.
    - ``members``: on Spark, how many members (barrier tasks) an execution has; None (the
      default) takes every task slot the cluster has (``local[N]``: N). With fewer slots
      than asked, an execution runs on the slots there are (see ``quorum_timeout``).
    - ``heartbeat_timeout``: on Spark, a member silent this long (no poll reaches the
      coordinator) is declared failed, and the execution restarts.
    - ``start_timeout``: on Spark, how long the members of an execution may take to start
      (be scheduled, restore their state) before the execution counts as failed.
    - ``quorum_timeout``: split-brain protection: an execution never starts with fewer
      members than ``floor(largest member count seen / 2) + 1``; the coordinator waits for
      slots up to this long (re-checking every ``restart_backoff``), then fails the job.
    - ``tls``: encrypt the links between members and the coordinator on Spark: True,
      False, or None (the default) for on with a cluster master and off on ``local[N]``,
      where every link stays on one machine. Every call is authenticated either way
      (:mod:`sparkjet.runtime.security`).
    - ``tls_certificate`` and ``tls_private_key``: PEM files of the certificate to use
      instead of the one the driver makes per execution; ``tls_server_name``: a name that
      certificate holds (clients check it, not the host name).
    """

    name: str = "sparkjet-job"
    processing_guarantee: str = "exactly-once"
    snapshot_interval: float = 1.0
    snapshot_store: str | None = None
    max_restarts: int = 3
    restart_backoff: float = 0.5
    local_parallelism: int = 2
    partition_count: int = DEFAULT_PARTITION_COUNT
    batch_size: int = 65536
    queue_capacity: int = 16
    snapshot_codec: str = "lz4"
    job_id: int | None = None
    members: int | None = None
    heartbeat_timeout: float = 10.0
    start_timeout: float = 120.0
    quorum_timeout: float = 300.0
    tls: bool | None = None
    tls_certificate: str | None = None
    tls_private_key: str | None = None
    tls_server_name: str = "sparkjet"

    def __post_init__(self):
        if self.processing_guarantee not in GUARANTEES:
            raise InvalidArgumentError(
                f"processing_guarantee must be one of {GUARANTEES}, "
                f"got {self.processing_guarantee!r}")
        if self.processing_guarantee != "none" and not self.snapshot_store:
            raise InvalidArgumentError(
                f"processing_guarantee {self.processing_guarantee!r} needs snapshot_store "
                "(a directory or a pyarrow.fs URI)")
        # Frozen: the checked values (plain Python numbers) are stored with object.__setattr__.
        # A timeout may be infinite (never time out); an interval or a backoff may not.
        for name, low, finite in (("snapshot_interval", 0.001, True), ("restart_backoff", 0, True),
                                  ("heartbeat_timeout", 0.5, False), ("start_timeout", 1, False),
                                  ("quorum_timeout", 0, False)):
            object.__setattr__(self, name, check_number(name, getattr(self, name), min=low,
                                                        finite=finite))
        for name, low in (("max_restarts", 0), ("local_parallelism", 1), ("batch_size", 1),
                          ("queue_capacity", 1)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), min=low))
        object.__setattr__(self, "members", check_int("members", self.members, min=1,
                                                      none_ok=True))
        if self.snapshot_store is not None:
            object.__setattr__(self, "snapshot_store", os.fspath(self.snapshot_store))
        if self.tls not in (None, True, False):
            raise InvalidArgumentError(f"tls must be True, False or None (auto), got {self.tls!r}")
        if (self.tls_certificate is None) != (self.tls_private_key is None):
            raise InvalidArgumentError(
                "tls_certificate and tls_private_key go together: give both or neither")
        if self.tls_certificate is not None and self.tls is False:
            raise InvalidArgumentError("tls_certificate was given, but tls=False")

    @property
    def id(self) -> int:
        """The job id: given, or derived from the name (stable across runs and restarts)."""
        if self.job_id is not None:
            return self.job_id
        return xxhash.xxh64_intdigest(self.name.encode()) & (2**63 - 1)

    def to_dict(self) -> dict:
        return asdict(self)
