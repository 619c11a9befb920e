"""Max-min fair sharing of link capacities: water-filling, and flows drained to completion.

The numeric core of the ``flow`` model (``flow.py``), on arrays: a flow x arc incidence
(entries pair a flow with a finite-capacity arc), rates by progressive filling (raise every
unfrozen flow together, freeze the flows of each arc that fills), and ``drain``, which runs
flows that start together to completion, recomputing rates only when a completion changes
them (``rates_hold``): with equal bytes a whole phase costs one water-fill.
"""

from __future__ import annotations

import numpy as np

__all__ = ["max_min_rates", "drain", "rates_hold", "TOL"]

# Completions closer than this (relative) are one event: it keeps lockstep collectives in step
# despite rounding, at an error far below anything a network model can resolve.
TOL = 1e-12


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + l) for every (s, l), vectorized."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(total)


class _Incidence:
    """A flow x arc incidence (arcs compact, finite only) indexed both by flow and by arc."""

    __slots__ = ("ent_flow", "ent_arc", "nflows", "narcs", "f_arc", "f_start", "f_len", "a_flow", "a_start", "a_len")

    def __init__(self, ent_flow: np.ndarray, ent_arc: np.ndarray, nflows: int, narcs: int):
        self.ent_flow, self.ent_arc, self.nflows, self.narcs = ent_flow, ent_arc, nflows, narcs
        by_flow = np.argsort(ent_flow, kind="stable")
        self.f_arc = ent_arc[by_flow]
        self.f_len = np.bincount(ent_flow, minlength=nflows)
        self.f_start = np.cumsum(self.f_len) - self.f_len
        by_arc = np.argsort(ent_arc, kind="stable")
        self.a_flow = ent_flow[by_arc]
        self.a_len = np.bincount(ent_arc, minlength=narcs)
        self.a_start = np.cumsum(self.a_len) - self.a_len


def _water_fill(inc: _Incidence, cap: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Max-min fair rates of the active flows: raise all unfrozen flows together, freeze those on full arcs."""
    rate = np.zeros(inc.nflows)
    crosses = inc.f_len > 0
    # A flow that crosses no finite arc is limited by nothing the model knows about.
    rate[active & ~crosses] = np.inf
    live = active & crosses
    nlive = int(live.sum())
    cnt = np.bincount(inc.ent_arc[live[inc.ent_flow]], minlength=inc.narcs).astype(float)
    resid = cap.astype(float)
    share = np.empty(inc.narcs)
    while nlive:
        share.fill(np.inf)
        np.divide(np.maximum(resid, 0.0), cnt, out=share, where=cnt > 0)
        lam = float(share.min())
        # Every arc whose fair share is the lowest is now full: its flows stop at this level.
        sat = np.flatnonzero(share <= lam * (1.0 + TOL))
        flows = inc.a_flow[_ranges(inc.a_start[sat], inc.a_len[sat])]
        flows = np.unique(flows[live[flows]])
        rate[flows] = lam
        live[flows] = False
        nlive -= flows.size
        dec = np.bincount(inc.f_arc[_ranges(inc.f_start[flows], inc.f_len[flows])], minlength=inc.narcs)
        cnt -= dec
        resid -= lam * dec
    return rate


def max_min_rates(ent_flow: np.ndarray, ent_arc: np.ndarray, cap: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Max-min fair rates (bytes/s); entries pair a flow with a finite arc (compact ids indexing ``cap``)."""
    return _water_fill(_Incidence(ent_flow, ent_arc, active.size, cap.size), cap, active)


def drain(ent_flow: np.ndarray, ent_arc: np.ndarray, cap: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Completion time of every flow that starts at 0 with ``nbytes``, rates recomputed when a completion changes them."""
    rem = np.asarray(nbytes, dtype=float).copy()
    fin = np.zeros(rem.size)
    active = rem > 0
    inc = _Incidence(ent_flow, ent_arc, rem.size, cap.size)
    t = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        while active.any():
            idx = np.flatnonzero(active)
            r = _water_fill(inc, cap, active)[idx]
            ttf = np.where(np.isinf(r), 0.0, rem[idx] / r)
            order = np.argsort(ttf, kind="stable")
            ts, rs = ttf[order], r[order]
            # Events: completion times that differ by more than rounding.
            new = np.ones(ts.size, dtype=bool)
            new[1:] = ts[1:] > ts[:-1] * (1.0 + TOL)
            starts = np.flatnonzero(new)
            # Run through events while each leaves the others' rates as they are (see rates_hold):
            # with equal bytes that is every event, and a phase costs one water-fill.
            slowest = np.minimum.reduceat(rs, starts)
            later = np.append(np.maximum.accumulate(rs[::-1])[::-1][starts[1:]], -np.inf)
            broken = np.flatnonzero(slowest <= later * (1.0 + 1e-9))
            last = int(broken[0]) if broken.size else starts.size - 1
            stop = int(starts[last + 1]) if last + 1 < starts.size else ts.size
            done, rest = order[:stop], order[stop:]
            dt = float(ts[stop - 1])
            fin[idx[done]] = t + ttf[done]
            rem[idx[rest]] -= r[rest] * dt
            rem[idx[done]] = 0.0
            active[idx[done]] = False
            t += dt
    return fin


def rates_hold(gone: np.ndarray, left: np.ndarray) -> bool:
    """Whether max-min rates stay as they are when flows at rates ``gone`` leave and ``left`` remain.

    A flow's bottleneck arc carries no flow faster than it, so flows strictly faster than every
    remaining flow cross no remaining flow's bottleneck: their departure changes no rate. With
    equal bytes the fastest flows always finish first, so a whole phase needs one water-fill.
    """
    return left.size == 0 or gone.size == 0 or float(gone.min()) > float(left.max()) * (1.0 + 1e-9)
