"""Slow emulated ranks: a rank that computes f times slower reaches each collective late.

A straggler (``whatif.stragglers``) or a rank on a slower node (``compute_slowdown``) does the
real rank's compute f times slower (f relative to the real rank's own node). Since the start
of the iteration the real rank has computed for ``c`` seconds (wall time minus what it waited
on collectives), so the slowest rank of the group arrives ``(f - 1) * c`` after the real rank,
and the collective cannot start before it does. With DDP's buckets this makes late buckets
later than early ones, as a slow backward pass would.

Peer noise (``emulation.peer_noise``): emulated ranks are clones of the real rank, and a
clone's compute varies from iteration to iteration as the real rank's does. A synchronous job
waits for the slowest of its ranks, so n ranks that each vary wait longer than one alone:
E[max of n] exceeds the mean by about sigma/sqrt(pi) for two ranks and more for many. With
it on, each iteration the group's slowest peer arrives late by the excess of the slowest of
its n-1 draws over a draw for the real rank (whose own variation is already real), the draws
taken from the real rank's compute times (iteration start to its last collective call) of the
last iterations.
"""

from __future__ import annotations

import bisect
import random
from collections import Counter, deque
from collections.abc import Mapping

from ..collectives import Op
from ..model.base import Group
from ..topology import Topology
from .timeline import Recorder, clock

__all__ = ["ComputeSkew", "compute_factors", "role_factors"]


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


class ComputeSkew:
    """The straggler hook of the timelines: how late the slowest rank of a group arrives."""

    HISTORY = 64  # iterations of the real rank's compute the peers' draws come from
    MIN_HISTORY = 5  # before that many, the peers arrive with the real rank
    # Warm-up iterations are slow on every rank at once (imports, DDP's bucket rebuild), not
    # noise: the first one ran 0.53 s against 10-30 ms after, and drawn from, it made peers 0.5 s late.
    SKIP = 2

    def __init__(self, factors: dict[int, float], recorder: Recorder, noise: bool = False, seed: int = 0):
        self.factors = factors
        self.recorder = recorder
        self.noise = noise
        self._group_factor: dict[Group, float] = {}
        self._computes: deque[float] = deque(maxlen=self.HISTORY)
        self._folded = 0
        self._draws: dict[int, tuple[int, float]] = {}  # peers -> (iteration, excess ratio)
        self._rng = random.Random(seed)

    def _factor(self, group: Group) -> float:
        f = self._group_factor.get(group)
        if f is None:
            factors = self.factors
            f = (factors.largest(group.ranks) if isinstance(factors, RankFactors)
                 else max((factors.get(r, 1.0) for r in group.ranks), default=1.0))
            self._group_factor[group] = f
        return f

    def _ops_of(self, index: int) -> list:
        return [r for r in self.recorder.ops[-256:] if r.iteration == index]

    def _waited(self, index: int) -> float:
        return sum(r.wait for r in self._ops_of(index))

    def _arrival(self, index: int, start: float) -> float | None:
        """Compute from the start of iteration ``index`` to its last collective call (None: it made none).

        Up to the last call, not to the iteration's end: what the peers' draws stand for is when
        they reach a collective. And a DDP job waits on its gradients' futures inside torch, where
        no wait is recorded: counted to the iteration's end, that waiting (and with it the peers'
        own lateness) became compute, and each draw fed the next (the 10 Gbit/s MLP: +30 %).
        """
        ops = self._ops_of(index)
        if not ops:
            return None
        last = max(ops, key=lambda r: r.enqueue)
        waited = sum(r.wait for r in ops if r.enqueue < last.enqueue)
        return max(0.0, last.enqueue - start - waited)

    def _excess(self, peers: int) -> float:
        """How much later than the real rank (a share of its compute) the slowest of ``peers`` clones arrives this iteration."""
        rec = self.recorder
        marks = rec.iteration_marks
        while self._folded < len(marks):
            i = self._folded
            if i >= self.SKIP:
                c = self._arrival(i, marks[i - 1])
                if c is not None:
                    self._computes.append(c)
            self._folded += 1
        index = len(marks)
        drawn = self._draws.get(peers)
        if drawn is not None and drawn[0] == index:
            return drawn[1]  # one draw per iteration: every op of it sees the same peers
        xs = sorted(self._computes)
        excess = 0.0
        if len(xs) >= self.MIN_HISTORY and xs[len(xs) // 2] > 0:
            med = xs[len(xs) // 2]

            def quantile(u: float) -> float:
                return xs[min(len(xs) - 1, int(u * len(xs)))] / med

            # The largest of n uniform draws is u ** (1/n): one draw for all the peers.
            slowest = quantile(self._rng.random() ** (1.0 / peers))
            excess = max(0.0, slowest - quantile(self._rng.random()))
        self._draws[peers] = (index, excess)
        return excess

    def __call__(self, op: Op, nbytes: int, group: Group) -> float:
        """Seconds after the real rank's call at which the group's slowest rank arrives."""
        f = self._factor(group)
        noise = self._excess(group.size - 1) if self.noise and group.size > 1 else 0.0
        if f <= 1.0 and noise <= 0.0:
            return 0.0
        rec = self.recorder
        marks = rec.iteration_marks
        since = marks[-1] if marks else rec.t0
        compute = max(0.0, clock() - since - self._waited(len(marks)))
        return (f * (1.0 + noise) - 1.0) * compute
