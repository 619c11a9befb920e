"""Slow emulated ranks: a rank that computes f times slower reaches each collective late.

A straggler (``whatif.stragglers``) or a rank on a slower node (``compute_slowdown``) does the
real rank's compute f times slower (f relative to the real rank's own node). Since the start
of the iteration the real rank has computed for ``c`` seconds (wall time minus what it waited
on collectives), so the slowest rank of the group arrives ``(f - 1) * c`` after the real rank,
and the collective cannot start before it does. With DDP's buckets this makes late buckets
later than early ones, as a slow backward pass would.
"""

from __future__ import annotations

from ..collectives import Op
from ..model.base import Group
from ..topology import Topology
from .timeline import Recorder, clock

__all__ = ["ComputeSkew", "compute_factors"]


def compute_factors(topology: Topology, real_rank: int) -> dict[int, float]:
    """Ranks that compute slower than the real rank -> how many times slower (only those above 1)."""
    stragglers = topology.whatif.stragglers
    base = topology.node_of(real_rank).compute_slowdown * stragglers.get(real_rank, 1.0)
    out: dict[int, float] = {}
    for node in topology.nodes:
        for rank in node.rank_range:
            f = node.compute_slowdown * stragglers.get(rank, 1.0) / base
            if f > 1.0:
                out[rank] = f
    return out


class ComputeSkew:
    """The straggler hook of the timelines: how late the slowest rank of a group arrives."""

    def __init__(self, factors: dict[int, float], recorder: Recorder):
        self.factors = factors
        self.recorder = recorder
        self._group_factor: dict[Group, float] = {}

    def _factor(self, group: Group) -> float:
        f = self._group_factor.get(group)
        if f is None:
            f = max((self.factors.get(r, 1.0) for r in group.ranks), default=1.0)
            self._group_factor[group] = f
        return f

    def __call__(self, op: Op, nbytes: int, group: Group) -> float:
        """Seconds after the real rank's call at which the group's slowest rank arrives."""
        f = self._factor(group)
        if f <= 1.0:
            return 0.0
        rec = self.recorder
        marks = rec.iteration_marks
        since = marks[-1] if marks else rec.t0
        index = len(marks)
        waited = sum(r.wait for r in reversed(rec.ops[-256:]) if r.iteration == index)
        compute = max(0.0, clock() - since - waited)
        return (f - 1.0) * compute
