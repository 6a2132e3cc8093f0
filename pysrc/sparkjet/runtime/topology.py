"""Topology: which member of an execution runs which processor and owns which partition.

It is derived from the DAG and three numbers (members, local parallelism, Hazelcast
partitions), so it is plain data: on Spark the driver builds it once per execution and
hands it to every member and to the coordinator; a member alone builds its own of one
member.
"""
from __future__ import annotations

import copy

import numpy as np

from sparkjet.partition_table import PartitionTable
from sparkjet.pipeline.dag import SOURCE, Dag


class Topology:
    """Where the processors of one execution run, on ``members`` members.

    Indices are per vertex and global across members, so snapshot entries, sink staging
    directories and channel numbers mean the same thing on every member. Source processor
    ``g`` of a source vertex (``min(members * local_parallelism, partitions)`` of them) runs
    on member ``g % members`` and reads the source partitions ``p`` with ``p % n == g``.
    Processor ``k`` of an aggregation vertex (``members * local_parallelism`` of them, or
    one for an aggregation without a key) runs on member ``k // local_parallelism``. The
    Hazelcast partitions are placed on members by a
    :class:`~sparkjet.partition_table.PartitionTable` of ``members`` members (no backups:
    the snapshot store holds the replicas) and, within a member, dealt round-robin to its
    processors; every keyed vertex uses the same placement, so consecutive stages keyed
    alike exchange nothing between members. State is stored by partition, so a snapshot
    taken at any member count restores at any other.

    With the members' storage (``storage="members"``) the table is the execution's own,
    built by the driver after the members joined over their storage slots: ``table`` and
    ``slots`` (slot ``slots[i]`` is member ``i``'s), and a partition's processor is on the
    member whose slot holds its primary.
    """

    def __init__(self, members: int, local_parallelism: int, dag: Dag, partition_count: int,
                 table: PartitionTable | None = None, slots: list[str] | None = None):
        self.members = members
        self.local_parallelism = local_parallelism
        self.partition_count = partition_count
        self.parallelism: dict[str, int] = {}
        for v in dag.vertices.values():
            if v.kind == SOURCE:
                n = min(members * local_parallelism, v.source.partition_count())
            else:
                n = 1 if v.single else members * local_parallelism
            self.parallelism[v.name] = n
        self.kinds = {v.name: v.kind for v in dag.vertices.values()}
        self.single = {v.name for v in dag.vertices.values() if v.single}
        #: vertex -> the first writer index of its processors (unique per snapshot).
        self.offset: dict[str, int] = {}
        total = 0
        for name, n in self.parallelism.items():
            self.offset[name] = total
            total += n
        self.processors = total
        #: (target vertex, upstream vertex) -> the first channel of the upstream's processors
        self.channel_offset: dict[tuple[str, str], int] = {}
        #: vertex -> how many channels feed it
        self.channels: dict[str, int] = {}
        for v in dag.vertices.values():
            c = 0
            for u in v.inputs:
                self.channel_offset[(v.name, u)] = c
                c += self.parallelism[u]
            self.channels[v.name] = c
        #: sink -> vertex -> the first sink-instance index of the vertex's processors
        self.sink_offset: dict[str, dict[str, int]] = {}
        self.sink_instances: dict[str, int] = {}
        for s in dag.sinks.values():
            c = 0
            self.sink_offset[s.name] = {}
            for u in s.feeders:
                self.sink_offset[s.name][u] = c
                c += self.parallelism[u]
            self.sink_instances[s.name] = c
        self.keyed = dag.keyed
        self.source_vertices = [v.name for v in dag.sources]
        self._place(table, slots)

    def _place(self, table: PartitionTable | None, slots: list[str] | None) -> None:
        members, count = self.members, self.partition_count
        if table is not None and (slots is None or len(slots) != members
                                  or sorted(slots) != sorted(table.members)
                                  or table.partition_count != count):
            raise ValueError(f"the partition table ({table!r}) does not place {count} "
                             f"partitions on these {members} members' slots")
        self.table = table
        self.slots = list(slots) if slots is not None else None
        owner = np.zeros(count, dtype=np.int32)
        if self.keyed:
            lp = self.local_parallelism
            names = self.slots or [f"member-{i}" for i in range(members)]
            if table is None:
                table = PartitionTable.create(names, count, backup_count=0)
            for i, name in enumerate(names):
                for rank, p in enumerate(table.partitions_of(name)):
                    owner[p] = i * lp + rank % lp
        #: Hazelcast partition -> the index of the keyed processor that owns it.
        self.owner = owner

    def with_placement(self, table: PartitionTable, slots: list[str]) -> Topology:
        """This topology with the partitions where ``table`` puts their primaries, member
        ``i`` being slot ``slots[i]`` (placement after join, ``storage="members"``)."""
        placed = copy.copy(self)
        placed._place(table, slots)
        return placed

    def __repr__(self) -> str:
        return (f"Topology(members={self.members}, processors={self.parallelism}, "
                f"partitions={self.partition_count})")

    @property
    def n_sources(self) -> int:
        """Every source processor of every source vertex."""
        return sum(self.parallelism[v] for v in self.source_vertices)

    def processors_of(self, vertex: str, member: int) -> list[int]:
        n = self.parallelism[vertex]
        if self.kinds[vertex] == SOURCE:
            return [g for g in range(n) if g % self.members == member]
        if vertex in self.single:
            return [0] if member == 0 else []
        lp = self.local_parallelism
        return list(range(member * lp, (member + 1) * lp))

    def member_of(self, vertex: str, k: int) -> int:
        if self.kinds[vertex] == SOURCE:
            return k % self.members
        if vertex in self.single:
            return 0
        return k // self.local_parallelism

    def source_partitions_of(self, vertex: str, g: int, partitions: int) -> list[int]:
        n = self.parallelism[vertex]
        return [p for p in range(partitions) if p % n == g]

    def partitions_of(self, vertex: str, k: int) -> list[int]:
        """The Hazelcast partitions whose state processor ``k`` of ``vertex`` holds."""
        if vertex in self.single:
            return list(range(self.partition_count))
        return np.flatnonzero(self.owner == k).tolist()


__all__ = ["Topology"]
