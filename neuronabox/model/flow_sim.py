"""The ``flow`` model's joint run: collectives started together, their flows sharing arcs max-min fairly.

``simulate`` is event-driven: each collective (``Run``) proceeds through its own phases, the
flows of every draining phase share the arcs max-min fairly (``maxmin.py``), and rates are
recomputed when a completion or a new phase changes them. Rounds in which every collective
starts and ends one phase together are memoized and repeated, so lockstep rings cost a handful
of simulations. ``lazy_steps`` turns a run's log into the per-flow schedule an ``Estimate``
builds only when asked.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .base import Step
from .flow_phases import Phase
from .maxmin import TOL, max_min_rates, rates_hold

__all__ = ["Run", "simulate", "lazy_steps"]

# In a joint run (estimate_concurrent) whose draining phases hold more flow-arc entries than
# this, completions within _BATCH_WINDOW (relative) of the first are one event: collectives of
# different sizes change each other's rates at every completion, and an exact event per ECMP
# load level would cost minutes. Each flow still finishes at its own time; the others pick up
# the freed capacity up to that window late (conservative). drain() needs no such grouping.
_BATCH_ENTRIES = 50_000
_BATCH_WINDOW = 1e-3


class Run:
    """One collective's progress through its phases in a joint simulation."""

    __slots__ = (
        "index", "algorithm", "phases", "pi", "rep", "draining", "ready", "start", "rem", "act", "fin", "log", "end", "rate",
    )

    def __init__(self, index: int, algorithm: str, phases: list[Phase]):
        self.index = index
        self.algorithm = algorithm
        self.phases = phases
        self.pi = 0
        self.rep = 0
        self.log: list[tuple] = []
        self.end = 0.0

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self.phases[self.pi]

    def begin(self, t: float) -> None:
        """Start the current phase at ``t``: its flows inject once its latency has passed."""
        ph = self.phase
        p = ph.seg.pattern
        self.start = t
        self.ready = t + ph.lat
        self.draining = False
        self.rem = p.w * ph.scale
        self.act = self.rem > 0
        self.fin = np.full(p.nflows, ph.lat)

    def advance(self, count: int, t: float) -> bool:
        """Move past ``count`` phases ending at ``t``; start the next one, or return True when finished."""
        self.rep += count
        if self.rep >= self.phase.repeats:
            self.pi += 1
            self.rep = 0
        if self.pi >= len(self.phases):
            self.end = t
            return True
        self.begin(t)
        return False


def _after(a: float, b: float) -> bool:
    """Whether time ``a`` has been reached at time ``b`` (rounding aside)."""
    return a <= b + TOL * abs(b) + 1e-18


def simulate(runs: list[Run], capacity: np.ndarray) -> None:
    """Event-driven joint run: flows of every draining phase share arcs max-min fairly."""
    rates_memo: dict[tuple, list[np.ndarray]] = {}
    rounds: dict[tuple, tuple[float, list[np.ndarray]]] = {}
    t = 0.0
    for r in runs:
        r.begin(t)
    live = [r for r in runs if not _skip_empty(r, t)]
    recording: tuple | None = None
    rates_valid = False
    while live:
        if all(not r.draining and r.start == t for r in live):
            key = tuple((r.phase.seg.pattern.pid, r.phase.scale, r.phase.lat) for r in live)
            hit = rounds.get(key)
            if hit is not None:
                # Every collective repeats the same synchronized round: jump over all repeats at once.
                dur, fins = hit
                count = min(r.phase.repeats - r.rep for r in live)
                for r, f in zip(live, fins):
                    r.log.append((r.phase, r.rep, t, dur, count, f))
                t_end = t + dur * count
                live = [r for r in live if not r.advance(count, t_end) and not _skip_empty(r, t_end)]
                t = t_end
                recording = None
                continue
            recording = (key, t)
        draining = [r for r in live if r.draining]
        first = math.inf
        rates: list[np.ndarray] = []
        ttfs: list[np.ndarray] = []
        if draining:
            if not rates_valid:
                for r, rate in zip(draining, _joint_rates(draining, capacity, rates_memo)):
                    r.rate = rate
                rates_valid = True
            rates = [r.rate for r in draining]
            with np.errstate(divide="ignore", invalid="ignore"):
                for r, rate in zip(draining, rates):
                    ttf = np.where(r.act, np.where(np.isinf(rate), 0.0, r.rem / rate), np.inf)
                    ttfs.append(ttf)
                    first = min(first, float(ttf.min()))
        wake = min((max(r.ready - t, 0.0) for r in live if not r.draining), default=math.inf)
        dt = min(first, wake)
        if dt == first and sum(int(r.act.sum()) * 8 for r in draining) > _BATCH_ENTRIES:
            # Group close completions, but never past a phase that is about to inject.
            late = first * (1.0 + _BATCH_WINDOW)
            dt = min(max(float(ttf[ttf <= late].max(initial=first)) for ttf in ttfs), wake)
        t_new = t + dt
        completed: list[Run] = []
        gone, left = [], []
        with np.errstate(invalid="ignore"):
            for r, rate, ttf in zip(draining, rates, ttfs):
                done = ttf <= dt * (1.0 + TOL)
                r.rem = np.where(r.act & ~done, r.rem - np.where(np.isinf(rate), 0.0, rate) * dt, 0.0)
                r.fin[done] = np.minimum(t + ttf[done], t_new) - r.start
                gone.append(rate[done])
                r.act = r.act & ~done
                left.append(rate[r.act])
                if not r.act.any():
                    completed.append(r)
        if gone and not rates_hold(np.concatenate(gone), np.concatenate(left)):
            rates_valid = False
        for r in live:
            if not r.draining and _after(r.ready, t_new):
                r.draining = True
                # New flows join: everyone's share changes.
                rates_valid = False
                if not r.act.any():
                    completed.append(r)
        if completed:
            if recording is not None and len(completed) == len(live):
                rounds[recording[0]] = (t_new - recording[1], [r.fin.copy() for r in live])
            recording = None
            for r in completed:
                r.log.append((r.phase, r.rep, r.start, t_new - r.start, 1, r.fin.copy()))
            gone = {id(r) for r in completed if r.advance(1, t_new) or _skip_empty(r, t_new)}
            live = [r for r in live if id(r) not in gone]
        t = t_new


def _skip_empty(run: Run, t: float) -> bool:
    # A phase with no flows would never produce an event: move past it (True when the run ends).
    while run.phase.seg.pattern.nflows == 0:
        if run.advance(run.phase.repeats - run.rep, t):
            return True
    return False


def _joint_rates(draining: list[Run], capacity: np.ndarray, memo: dict) -> list[np.ndarray]:
    """Max-min rates of the active flows of several phases sharing arcs (memoized by active set)."""
    key = tuple((r.phase.seg.pattern.pid, None if r.act.all() else r.act.tobytes()) for r in draining)
    hit = memo.get(key)
    if hit is not None:
        return hit
    efs, eas, acts, offs = [], [], [], [0]
    for r in draining:
        p = r.phase.seg.pattern
        keep = r.act[p.ent_flow]
        efs.append(p.ent_flow[keep] + offs[-1])
        eas.append(p.ent_garc[keep])
        acts.append(r.act)
        offs.append(offs[-1] + p.nflows)
    ea = np.concatenate(eas)
    ua, inv = np.unique(ea, return_inverse=True)
    rate = max_min_rates(np.concatenate(efs), inv.reshape(-1), capacity[ua], np.concatenate(acts))
    out = [rate[offs[i] : offs[i + 1]] for i in range(len(draining))]
    if len(memo) > 65536:
        memo.clear()
    memo[key] = out
    return out


def lazy_steps(log: list[tuple]) -> Callable[[], list[Step]]:
    """A lazy schedule: one Step per flow per phase, from (phase, first rep, start, duration, count, fins) records."""

    def build() -> list[Step]:
        steps: list[Step] = []
        for ph, rep0, start, dur, count, fins in log:
            p = ph.seg.pattern
            if fins is None:
                fins = ph.lat + ph.scale * p.fin
            src, dst = p.src.tolist(), p.dst.tolist()
            nbytes = (p.w * ph.nbytes).tolist()
            ends = fins.tolist()
            for k in range(count):
                rep = rep0 + k
                t0 = start + k * dur
                label = f"{ph.seg.label} {rep + 1}/{ph.repeats}" if ph.repeats > 1 else ph.seg.label
                for f in range(len(src)):
                    steps.append(Step(t0, t0 + ends[f], src[f], dst[f], nbytes[f], label))
        return steps

    return build
