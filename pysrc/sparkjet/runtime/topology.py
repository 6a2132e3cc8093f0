"""Topology: which member of an execution runs which processor and owns which partition.

It is derived from four numbers only (members, local parallelism, source partitions,
Hazelcast partitions), so it is plain data: on Spark the driver builds it once per
execution and hands it to every member and to the coordinator; a member alone builds its
own of one member.
"""
from __future__ import annotations

import numpy as np

from sparkjet.partition_table import PartitionTable


class Topology:
    """Where the processors of one execution run, on ``members`` members.

    Indices are global across members, so snapshot entries, sink staging directories and
    channel numbers mean the same thing on every member: source processor ``g`` (of
    ``n_sources``) runs on member ``g % members`` and reads the source partitions ``p``
    with ``p % n_sources == g``; keyed processor ``k`` (of ``n_keyed``) runs on member
    ``k // local_parallelism``. The Hazelcast partitions are placed on members by a
    :class:`~sparkjet.partition_table.PartitionTable` of ``members`` members (no backups:
    the snapshot store holds the replicas) and, within a member, dealt round-robin to its
    keyed processors. Keyed state is stored by partition, so a snapshot taken at any
    member count restores at any other.
    """

    def __init__(self, members: int, local_parallelism: int, source_partitions: int,
                 partition_count: int, keyed: bool):
        self.members = members
        self.local_parallelism = local_parallelism
        self.source_partitions = source_partitions
        self.partition_count = partition_count
        self.n_sources = min(members * local_parallelism, source_partitions)
        self.n_keyed = members * local_parallelism if keyed else 0
        owner = np.zeros(partition_count, dtype=np.int64)
        if keyed:
            table = PartitionTable.create([f"member-{i}" for i in range(members)],
                                          partition_count, backup_count=0)
            for i in range(members):
                for rank, p in enumerate(table.partitions_of(f"member-{i}")):
                    owner[p] = i * local_parallelism + rank % local_parallelism
        #: Hazelcast partition -> the global index of the keyed processor that owns it.
        self.owner = owner

    def __repr__(self) -> str:
        return (f"Topology(members={self.members}, sources={self.n_sources}, "
                f"keyed={self.n_keyed}, partitions={self.partition_count})")

    @property
    def processors(self) -> int:
        return self.n_sources + self.n_keyed

    def sources_of(self, member: int) -> list[int]:
        return [g for g in range(self.n_sources) if g % self.members == member]

    def source_partitions_of(self, g: int) -> list[int]:
        return [p for p in range(self.source_partitions) if p % self.n_sources == g]

    def keyed_of(self, member: int) -> list[int]:
        if not self.n_keyed:
            return []
        lp = self.local_parallelism
        return list(range(member * lp, (member + 1) * lp))

    def member_of_keyed(self, k: int) -> int:
        return k // self.local_parallelism


__all__ = ["Topology"]
