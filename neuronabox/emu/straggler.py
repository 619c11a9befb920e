"""Which emulated ranks compute slower than the real rank, and how many times: the what-if's data.

A straggler (``whatif.stragglers``) or a rank on a slower node (``compute_slowdown``) does the
real rank's compute f times slower (f relative to the real rank's own node); a replayed role's
rank, relative to its role's recorded program (``role_factors``). What that does to an op's
start (the group's slowest rank arrives late) is a host effect: ``host_effects/compute_skew.py``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping

from ..topology import Topology

__all__ = ["RankFactors", "compute_factors", "role_factors"]


def compute_factors(topology: Topology, real_rank: int) -> "RankFactors":
    """Ranks that compute slower than the real rank -> how many times slower (only those above 1)."""
    stragglers = topology.whatif.stragglers
    base = topology.node_of(real_rank).compute_slowdown * stragglers.get(real_rank, 1.0)
    return RankFactors(topology, base)


class RankFactors(Mapping):
    """Rank -> slow-down over the real rank (only ranks above 1), held per node plus the listed stragglers.

    A dict of every slower rank was as large as the world: a 10 M-rank world with half its nodes
    slower is 5 M entries. Reads like that dict (``get``, ``in``, iteration in rank order);
    ``pop`` takes a rank out (a replayed rank carries its own slowness).
    """

    def __init__(self, topology: Topology, base: float):
        self._topo = topology
        self._node = [n.compute_slowdown / base for n in topology.nodes]
        self._listed = {r: topology.node_of(r).compute_slowdown * f / base for r, f in topology.whatif.stragglers.items()}
        self._dropped: set[int] = set()

    def _value(self, rank: int) -> float:
        if rank in self._dropped or not 0 <= rank < self._topo.world_size:
            return 1.0
        f = self._listed.get(rank)
        return f if f is not None else self._node[self._topo.rank_node[rank]]

    def __getitem__(self, rank: int) -> float:
        f = self._value(rank) if isinstance(rank, int) else 1.0
        if f <= 1.0:
            raise KeyError(rank)
        return f

    def __iter__(self):
        listed = sorted(self._listed)
        for node, f in zip(self._topo.nodes, self._node):
            if f > 1.0:
                ranks = node.rank_range
            else:  # only the listed stragglers of this node can be slower
                lo = bisect.bisect_left(listed, node.first_rank)
                ranks = listed[lo:bisect.bisect_left(listed, node.first_rank + node.ranks)]
            for r in ranks:
                if self._value(r) > 1.0:
                    yield r

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return next(iter(self), None) is not None

    def largest(self, ranks) -> float:
        """The largest factor among ``ranks`` (1.0 when none is slower); a range is read per node, not per rank."""
        if not isinstance(ranks, range) or self._dropped or not ranks:
            return max((self.get(r, 1.0) for r in ranks), default=1.0)
        topo = self._topo
        listed = [r for r in self._listed if r in ranks]
        listed_on = Counter(topo.rank_node[r] for r in listed)
        best = max((self._listed[r] for r in listed), default=1.0)
        for i in range(topo.rank_node[ranks[0]], topo.rank_node[ranks[-1]] + 1):
            node = topo.nodes[i]
            inside = min(ranks.stop, node.first_rank + node.ranks) - max(ranks.start, node.first_rank)
            if inside > listed_on[i]:  # a rank of the node that is not listed: the node's own factor
                best = max(best, self._node[i])
        return max(1.0, best)

    def pop(self, rank: int, default=None):
        """Take ``rank`` out; its factor, or ``default`` when it had none above 1."""
        f = self.get(rank, default)
        self._dropped.add(rank)
        return f

    def __repr__(self) -> str:
        return f"RankFactors(per node, {len(self._listed)} listed, {len(self._dropped)} taken out)"


def role_factors(topology: Topology, roles=None) -> dict[int, float]:
    """Ranks that compute slower than their role's profile (what-if stragglers, slower nodes) -> how many times.

    A profile was recorded on its role's first rank, on the topology as written (no what-if):
    a rank is slower by its own factor over that rank node's (``roles``: a ``roles.Roles``).
    """
    stragglers = topology.whatif.stragglers
    out: dict[int, float] = {}
    for node in topology.nodes:
        for rank in node.rank_range:
            f = node.compute_slowdown * stragglers.get(rank, 1.0)
            if roles is not None:
                rep = roles.representative(roles.role_of(rank))
                f /= topology.node_of(rep).compute_slowdown
            if f != 1.0:
                out[rank] = f
    return out
