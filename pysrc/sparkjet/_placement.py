"""The placement solver of :class:`~sparkjet.partition_table.PartitionTable`: balanced
assignments of partition replicas to members that keep what they can.

Members are numbered by join order; a slot holds a member number or -1. Replica indices are
placed one at a time, each as an assignment of every partition to a member that holds none of
its lower indices, where each member gets P // n or one more slots. Existing assignments are
kept up to a preferred target, the rest is filled greedily, and augmenting paths (chains of
re-seated slots) finish what greedy filling cannot, so a replica index never dead-ends while a
balanced assignment exists.
"""
from __future__ import annotations

from collections.abc import Callable


def place(member_count: int, rows: list[list[int]], pinned_owner: list[bool],
          groups: list[int] | None = None) -> list[list[int]]:
    """New slots for ``rows``; ``pinned_owner[p]`` asks to keep partition p's owner.

    ``groups`` (a group number per member, e.g. its host): the replicas of a partition go to
    members of distinct groups, so only as many replica indices are filled as there are
    groups. Balance is then within one slot when the groups are of equal size, and as close
    as the groups allow otherwise."""
    width = len(rows[0])
    filled = min(width, member_count if groups is None else len(set(groups)))
    placed = [[-1] * width for _ in rows]
    load = [0] * member_count  # slots per member over the replica indices placed so far
    for r in range(filled):
        pinned = pinned_owner if r == 0 else None
        column = _Column(member_count, r, filled, rows, placed, load, pinned, groups)
        for p, m in enumerate(column.solve()):
            placed[p][r] = m
            load[m] += 1
    return placed


class _Column:
    """The assignment of one replica index r, given the lower indices already placed."""

    def __init__(
        self,
        n: int,
        r: int,
        filled: int,
        rows: list[list[int]],
        placed: list[list[int]],
        load: list[int],
        pinned: list[bool] | None,
        groups: list[int] | None = None,
    ) -> None:
        count_p = len(rows)
        self.n = n
        self.pinned = pinned
        if groups is None or r == 0:
            self.blocked: list = [row[:r] for row in placed]
        else:
            # every member of a group that holds a lower replica of p
            members_of: dict[int, list[int]] = {}
            for m, g in enumerate(groups):
                members_of.setdefault(g, []).append(m)
            self.blocked = [{x for m in row[:r] for x in members_of[groups[m]]}
                            for row in placed]
        # A member holding a higher replica of p would vacate that slot if it took this one.
        self.later = [row[r + 1 :] for row in rows]
        self.current: list[list[int]] = [[] for _ in range(n)]
        for p, row in enumerate(rows):
            m = row[r]
            if m >= 0 and m not in self.blocked[p]:
                self.current[m].append(p)
        if groups is None or r == 0:
            self.low, self.high = _bounds(n, count_p, r, filled, load)
        else:
            self.low, self.high = _group_bounds(groups, placed, r, load)
        self.target = _targets(count_p, load, self.current, pinned, self.low, self.high)
        # Pair each slot with the owner; while placing owners, with the current first backup.
        partners: list[int] | None = None
        if r > 0:
            partners = [row[0] for row in placed]
        elif len(rows[0]) > 1:
            partners = [row[1] for row in rows]
        self.pairs = _PairCounts(partners, n)
        self.holder = [-1] * count_p
        self.owned: list[set[int]] = [set() for _ in range(n)]
        self.count = [0] * n

    def solve(self) -> list[int]:
        """The member for this replica index of every partition."""
        n, target, blocked, count = self.n, self.target, self.blocked, self.count
        receivers = [m for m in range(n) if len(self.current[m]) < target[m]]

        def tier(p: int) -> int:
            # Shed first the slots a receiver can take without vacating another slot, then the
            # rest; promoted owners go last.
            if self.pinned is not None and self.pinned[p]:
                return 2
            easy = any(q not in blocked[p] and q not in self.later[p] for q in receivers)
            return 0 if easy else 1

        for m, slots in enumerate(self.current):
            for p in slots:
                self.pairs.add(p, m)
            for p in _kept(m, slots, target[m], tier, self.pairs):
                self._seat(p, m)

        for p in range(len(self.holder)):
            if self.holder[p] >= 0:
                continue
            eligible = [m for m in range(n) if count[m] < target[m] and m not in blocked[p]]
            if eligible:
                later, pairs = self.later[p], self.pairs
                self._seat(p, min(eligible, key=lambda m: (
                    m in later, pairs.get(p, m), count[m] - target[m], m
                )))
            elif not (self._augment(p, target) or self._augment(p, self.high)):
                # No assignment within the bounds exists (never seen; see _bounds): exceed a
                # bound by one rather than leave the slot empty.
                open_to_p = (m for m in range(n) if m not in blocked[p])
                self._seat(p, min(open_to_p, key=lambda m: (count[m], m)))
        for m in range(n):
            while count[m] < self.low[m] and self._raise(m):
                pass
        return self.holder

    def _seat(self, p: int, m: int) -> None:
        self.holder[p] = m
        self.owned[m].add(p)
        self.count[m] += 1
        self.pairs.add(p, m)

    def _move(self, chain: list[tuple[int, int]]) -> None:
        """Give each partition of ``chain`` (partition, new member) to its new member."""
        for p, m in chain:
            old = self.holder[p]
            if old >= 0:
                self.owned[old].discard(p)
                self.count[old] -= 1
                self.pairs.add(p, old, -1)
            self._seat(p, m)

    def _augment(self, p: int, cap: list[int]) -> bool:
        """Seat unassigned partition p through the shortest chain of re-seated slots that ends
        at a member below ``cap``; False if there is none."""
        blocked, owned = self.blocked, self.owned
        parent: dict[int, tuple[int, int]] = {}
        queue = []
        for x in range(self.n):
            if x not in blocked[p]:
                parent[x] = (-1, p)
                queue.append(x)
        for x in queue:  # the queue grows while it is walked
            for q in sorted(owned[x]):
                for y in range(self.n):
                    if y in parent or y in blocked[q]:
                        continue
                    parent[y] = (x, q)
                    if self.count[y] < cap[y]:
                        chain = []
                        while y >= 0:
                            previous, taken = parent[y]
                            chain.append((taken, y))
                            y = previous
                        self._move(chain)
                        return True
                    queue.append(y)
        return False

    def _raise(self, y: int) -> bool:
        """Give member y one more slot through the shortest chain of re-seated slots that takes
        one from a member above its lower bound; False if there is none."""
        blocked, holder = self.blocked, self.holder
        parent: dict[int, tuple[int, int]] = {y: (-1, -1)}
        queue = [y]
        for z in queue:  # the queue grows while it is walked
            for q, x in enumerate(holder):
                if x in parent or z in blocked[q]:
                    continue
                parent[x] = (z, q)
                if self.count[x] > self.low[x]:
                    chain = []
                    while x != y:
                        taker, q = parent[x]
                        chain.append((q, taker))
                        x = taker
                    self._move(chain)
                    return True
                queue.append(x)
        return False


def _bounds(
    n: int, count_p: int, r: int, filled: int, load: list[int]
) -> tuple[list[int], list[int]]:
    """Least and most slots each member may take at replica index r.

    Balance asks for ``P // n`` or one more. With no more members than replica slots
    (``filled == n``) every member holds every partition once, so the slots a member has left,
    ``P - load``, must still split into ``P // n`` or one more per remaining index. Within these
    bounds a completion always exists: the partitions still open to each member form a
    bipartite graph, which has an equitable edge colouring with any number of colours (de
    Werra), one colour per remaining index. With more members than replica slots no such proof
    is at hand; randomized tests find no case without a balanced assignment.
    """
    base, extra = divmod(count_p, n)
    top = base + (extra > 0)
    if filled < n:
        return [base] * n, [top] * n
    rest = filled - r - 1  # indices still to place after this one
    low = [max(base, count_p - load[m] - rest * top) for m in range(n)]
    high = [min(top, count_p - load[m] - rest * base) for m in range(n)]
    return low, high


def _group_bounds(groups: list[int], placed: list[list[int]], r: int, load: list[int]
                  ) -> tuple[list[int], list[int]]:
    """Least and most slots each member may take at backup index r when the replicas of a
    partition must sit in distinct groups.

    A group can take only the partitions none of whose lower replicas it holds, so groups of
    unequal size cannot all be balanced, and what one index takes decides what the next ones
    can (with as many groups as replicas, the last index has no choice left). Each group's
    share is a maximum flow (partitions by the groups their lower replicas use -> the groups
    still open to them) under capacities that keep the group's slots over indices 0..r at
    most ``ceil((r + 1) * t * size / n)``, with ``t`` the least that carries every partition:
    the most even shares that exist, here and for the indices after. A member may take
    ``ceil(share / size)`` (its group's members are interchangeable: the same groups block
    them) and should take ``P // n`` (the solver's chains raise members toward it where the
    groups allow). Groups of equal size give ``P // n`` or one more."""
    n, count_p = len(groups), len(placed)
    size: dict[int, int] = {}
    for g in groups:
        size[g] = size.get(g, 0) + 1
    kinds: dict[frozenset, int] = {}
    for row in placed:
        used = frozenset(groups[m] for m in row[:r])
        kinds[used] = kinds.get(used, 0) + 1

    held = dict.fromkeys(size, 0)                 # slots each group holds at indices < r
    for m, g in enumerate(groups):
        held[g] += load[m]

    def shares(t: int) -> dict[int, int] | None:
        caps = {g: max(0, -(-(r + 1) * t * k // n) - held[g]) for g, k in size.items()}
        return _group_flow(kinds, caps, count_p)

    lo, hi = count_p, count_p * n        # at hi every group could take every partition
    best = shares(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        found = shares(mid)
        if found is None:
            lo = mid + 1
        else:
            hi, best = mid, found
    assert best is not None
    high = [-(-best[g] // size[g]) for g in groups]
    low = [min(count_p // n, h) for h in high]
    return low, high


def _group_flow(kinds: dict[frozenset, int], caps: dict[int, int], total: int
                ) -> dict[int, int] | None:
    """How many partitions each group takes in a maximum flow from ``kinds`` (the groups a
    partition's lower replicas use -> how many partitions) to the groups open to them, each
    group at most ``caps[g]``; None if not all ``total`` partitions fit."""
    kind_list = list(kinds)
    left = [kinds[k] for k in kind_list]           # partitions of each kind not yet placed
    room = dict(caps)                              # what each group can still take
    flow: dict[tuple[int, int], int] = {}          # (kind, group) -> partitions
    carried = 0
    while True:
        # shortest augmenting path: a kind with partitions left -> ... -> a group with room,
        # through (group -> kind) edges that undo earlier flow
        parent: dict = {}
        queue = []
        for i, n_left in enumerate(left):
            if n_left > 0:
                parent[("k", i)] = None
                queue.append(("k", i))
        end = None
        for node in queue:  # the queue grows while it is walked
            side, x = node
            if side == "k":
                for g in caps:
                    if g not in kind_list[x] and ("g", g) not in parent:
                        parent[("g", g)] = node
                        if room[g] > 0:
                            end = ("g", g)
                            break
                        queue.append(("g", g))
            else:
                for i in range(len(kind_list)):
                    if flow.get((i, x), 0) > 0 and ("k", i) not in parent:
                        parent[("k", i)] = node
                        queue.append(("k", i))
            if end is not None:
                break
        if end is None:
            break
        path = [end]
        while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
        path.reverse()                             # kind, group, kind, group, ...
        amount = min(left[path[0][1]], room[end[1]])
        for a, b in zip(path, path[1:]):
            if a[0] == "g":                        # undo: group a gives back to kind b
                amount = min(amount, flow[(b[1], a[1])])
        for a, b in zip(path, path[1:]):
            if a[0] == "k":
                flow[(a[1], b[1])] = flow.get((a[1], b[1]), 0) + amount
            else:
                flow[(b[1], a[1])] -= amount
        left[path[0][1]] -= amount
        room[end[1]] -= amount
        carried += amount
    if carried < total:
        return None
    return {g: caps[g] - room[g] for g in caps}


def _targets(
    count_p: int,
    load: list[int],
    current: list[list[int]],
    pinned: list[bool] | None,
    low: list[int],
    high: list[int],
) -> list[int]:
    """Preferred number of slots per member at this replica index, between ``low`` and
    ``high`` and summing to the partition count."""
    n = len(low)
    base = count_p // n
    pinned_count = [
        sum(pinned[p] for p in slots) if pinned is not None else 0 for slots in current
    ]
    # The slots above the lower bounds go first to a member whose promoted owners need one,
    # then to the least loaded over the lower indices (spreading each member's total evenly),
    # then to the member already holding most slots here (fewer moves), then by join order.
    order = sorted(
        (m for m in range(n) if low[m] < high[m]),
        key=lambda m: (pinned_count[m] <= base, load[m], -len(current[m]), m),
    )
    target = list(low)
    for m in order[: count_p - sum(low)]:
        target[m] += 1
    return target


class _PairCounts:
    """How often each (partner, member) pair occurs at the replica index being placed.

    The partner of a backup slot is the partition's owner, and of an owner slot the current
    first backup. Spreading an owner's first backups over many members spreads the promotions
    when that owner fails, so fewer promoted owners push a member over its target and force
    more moves.
    """

    __slots__ = ("_partners", "_n", "_counts")

    def __init__(self, partners: list[int] | None, n: int) -> None:
        self._partners = partners
        self._n = n
        self._counts: dict[int, int] = {}

    def partner_of(self, p: int) -> int:
        return -1 if self._partners is None else self._partners[p]

    def get(self, p: int, m: int) -> int:
        if self._partners is None:
            return 0
        return self._counts.get(self._partners[p] * self._n + m, 0)

    def add(self, p: int, m: int, delta: int = 1) -> None:
        if self._partners is not None:
            key = self._partners[p] * self._n + m
            self._counts[key] = self._counts.get(key, 0) + delta


def _kept(
    m: int, slots: list[int], keep: int, tier: Callable[[int], int], pairs: _PairCounts
) -> list[int]:
    """The slots member m keeps out of ``slots`` (ascending) when its target is ``keep``.

    Surplus slots are shed tier by tier; within a tier one at a time, from the partner m pairs
    with most often, so that m's remaining pairs stay spread.
    """
    surplus = len(slots) - keep
    if surplus <= 0:
        return slots
    shed: set[int] = set()
    for level in (0, 1, 2):
        by_partner: dict[int, list[int]] = {}
        for p in slots:
            if tier(p) == level:
                by_partner.setdefault(pairs.partner_of(p), []).append(p)
        while len(shed) < surplus and by_partner:
            partner = max(by_partner, key=lambda o: (pairs.get(by_partner[o][-1], m), o))
            p = by_partner[partner].pop()
            if not by_partner[partner]:
                del by_partner[partner]
            pairs.add(p, m, -1)
            shed.add(p)
    return [p for p in slots if p not in shed]

__all__ = ["place"]
