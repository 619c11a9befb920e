"""Emulated ranks that reach a collective late: slower ranks and peer noise (the timelines' arrival hook).

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

import random
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from ...collectives import Op
from ...model.base import Group
from ..straggler import RankFactors, compute_factors
from .base import HostEffect, RunContext

if TYPE_CHECKING:
    from ..timeline import Recorder

__all__ = ["ComputeSkew", "CallerArrival", "StragglerHook"]

# (op, nbytes, group) -> how many seconds after the real rank the slowest rank of the group arrives
# (its arrival delays the start). It runs once per op, on the hot path: keep it cheap.
StragglerHook = Callable[[Op, int, Group], float]

# The timeline's clock (timeline.clock): perf_counter, which sleeps and deadlines agree on.
clock = time.perf_counter


class CallerArrival(HostEffect):
    """A caller's own straggler hook (``api.init(straggler=...)``), in place of the compute skew."""

    name = "arrival hook"

    def __init__(self, hook: StragglerHook):
        self.hook = hook

    @classmethod
    def build(cls, run: RunContext) -> "CallerArrival | None":
        """The hook the caller gave, if any."""
        return cls(run.arrival) if run.arrival is not None else None

    def arrival(self, op: Op, nbytes: int, group: Group) -> float:
        """The caller's hook's answer."""
        return self.hook(op, nbytes, group)

    def describe(self) -> str:
        """Names the hook."""
        return f"arrival hook: the slowest rank arrives when {getattr(self.hook, '__qualname__', self.hook)!r} says"


class ComputeSkew(HostEffect):
    """The straggler hook of the timelines: how late the slowest rank of a group arrives."""

    name = "compute skew"

    HISTORY = 64  # iterations of the real rank's compute the peers' draws come from
    MIN_HISTORY = 5  # before that many, the peers arrive with the real rank
    # Warm-up iterations are slow on every rank at once (imports, DDP's bucket rebuild), not
    # noise: the first one ran 0.53 s against 10-30 ms after, and drawn from, it made peers 0.5 s late.
    SKIP = 2

    def __init__(self, factors: dict[int, float], recorder: "Recorder", noise: bool = False, seed: int = 0):
        self.factors = factors
        self.recorder = recorder
        self.noise = noise
        self._group_factor: dict[Group, float] = {}
        self._computes: deque[float] = deque(maxlen=self.HISTORY)
        self._folded = 0
        self._draws: dict[int, tuple[int, float]] = {}  # peers -> (iteration, excess ratio)
        self._rng = random.Random(seed)

    @classmethod
    def build(cls, run: RunContext) -> "ComputeSkew | None":
        """With slower ranks (what-if stragglers, slower nodes) or peer noise; not beside a caller's own hook."""
        if run.arrival is not None:
            return None
        factors = compute_factors(run.topology, run.real_rank)
        noise = run.topology.emulation.peer_noise
        if not (factors or noise):
            return None
        skew = cls(factors, run.recorder, noise, seed=run.real_rank)
        if run.replay is not None:
            # Replayed ranks carry their own slowness; the clones' hook keeps the rest.
            for rank in run.replay.actors_ranks():
                skew.factors.pop(rank, None)
        return skew

    def describe(self) -> str:
        """Slower ranks, peer noise or both."""
        parts = (["slower ranks arrive late by their extra compute"] if self.factors else []) + (
            ["peer noise: the slowest clone's compute drawn from the real rank's"] if self.noise else [])
        return "compute skew: " + "; ".join(parts or ["no slower rank left (replayed ranks carry their own)"])

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

    def arrival(self, op: Op, nbytes: int, group: Group) -> float:
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
