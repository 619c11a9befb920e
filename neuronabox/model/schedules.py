"""Per-step schedules of the classic collective algorithms: who sends how many bytes to whom, when.

Each builder returns ``Step`` records with times relative to the collective's start. They are
called lazily (``Estimate.steps()``), never on the estimate hot path, so clarity beats speed.
``order`` is the ranks in algorithm order (ring order, or tree/rhd order with the root first).
"""

from __future__ import annotations

from typing import Sequence

from .base import Step

__all__ = ["ring", "chain", "binary_tree", "halving_doubling", "direct", "concat"]


def ring(order: Sequence[int], nsteps: int, chunk: float, step_time: float, phase: str, t0: float = 0.0) -> list[Step]:
    """``nsteps`` ring steps: in each, every rank sends ``chunk`` bytes to the next rank."""
    n = len(order)
    out: list[Step] = []
    for k in range(nsteps):
        start = t0 + k * step_time
        end = start + step_time
        for i in range(n):
            out.append(Step(start, end, order[i], order[(i + 1) % n], chunk, f"{phase} {k}"))
    return out


def chain(order: Sequence[int], nbytes: float, hop_latency: float, transfer: float, phase: str, t0: float = 0.0) -> list[Step]:
    """A pipelined chain from ``order[0]``: hop k starts after k hop latencies and streams ``nbytes``."""
    return [
        Step(t0 + k * hop_latency, t0 + k * hop_latency + hop_latency + transfer, order[k], order[k + 1], nbytes, f"{phase} hop {k}")
        for k in range(len(order) - 1)
    ]


def _tree_edges(n: int) -> list[list[tuple[int, int]]]:
    """Binomial-tree edges (parent index, child index) per level, root 0, level 0 nearest the root."""
    levels: list[list[tuple[int, int]]] = []
    span = 1
    while span < n:
        levels.append([(i, i + span) for i in range(0, span) if i + span < n])
        span *= 2
    return levels


def binary_tree(
    order: Sequence[int], nbytes: float, alpha: float, transfer: float, phase: str, up: bool, down: bool, t0: float = 0.0
) -> list[Step]:
    """A pipelined reduce up the tree and/or broadcast down it: levels start one ``alpha`` apart, each streams for ``transfer``."""
    levels = _tree_edges(len(order))
    out: list[Step] = []
    t = t0
    if up:
        for j, lvl in enumerate(reversed(levels)):
            start = t + j * alpha
            out.extend(Step(start, start + alpha + transfer, order[c], order[p], nbytes, f"{phase} up") for p, c in lvl)
        t += len(levels) * alpha + transfer
    if down:
        for j, lvl in enumerate(levels):
            start = t + j * alpha
            out.extend(Step(start, start + alpha + transfer, order[p], order[c], nbytes, f"{phase} down") for p, c in lvl)
    return out


def halving_doubling(
    order: Sequence[int], nbytes: float, alpha: float, byte_time: float, phase: str, halving: bool, t0: float = 0.0
) -> list[Step]:
    """Recursive halving (message halves each round) or doubling (message doubles) over a power-of-two prefix."""
    p = 1
    while p * 2 <= len(order):
        p *= 2
    rounds = p.bit_length() - 1
    out: list[Step] = []
    t = t0
    for r in range(rounds):
        dist = (p >> (r + 1)) if halving else (1 << r)
        size = nbytes / (2 ** (r + 1)) if halving else nbytes * (1 << r) / p
        dur = alpha + size * byte_time
        for i in range(p):
            out.append(Step(t, t + dur, order[i], order[i ^ dist], size, f"{phase} round {r}"))
        t += dur
    return out


def direct(pairs: Sequence[tuple[int, int]], nbytes: float, duration: float, phase: str, t0: float = 0.0) -> list[Step]:
    """Every (src, dst) pair sends ``nbytes`` at once."""
    return [Step(t0, t0 + duration, s, d, nbytes, phase) for s, d in pairs]


def concat(*parts: list[Step]) -> list[Step]:
    """Join schedules that were already placed in time."""
    out: list[Step] = []
    for p in parts:
        out.extend(p)
    return out
