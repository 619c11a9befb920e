"""What the ``flow`` model simulates: a collective as a plan of phases, a phase as a pattern of flows.

A *pattern* is one phase's flows (src rank, dst rank, a fixed fraction ``w`` of the
collective's size) with their routes, simulated once alone for a size of 1 and memoized, so
a phase of any size costs ``latency + size * unit``. A *segment* is a run of identical phases
or a pipeline; a *plan* is the segment list of one (op, algorithm, group, root), resolved for
a size into *phases* (``Plan.phases``). ``flow.py`` decomposes collectives into plans;
``flow_sim.py`` runs several together.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from .maxmin import drain

if TYPE_CHECKING:
    from .flow import FlowModel

__all__ = ["Pattern", "Segment", "Phase", "Plan"]


class Pattern:
    """One phase's flows, bytes per flow = ``w`` times a scale, with routes and the solo simulation."""

    __slots__ = ("pid", "src", "dst", "w", "ent_flow", "ent_garc", "flow_lat", "lat", "unit", "fin", "_compact")

    def __init__(self, pid: int, model: "FlowModel", src: np.ndarray, dst: np.ndarray, w: np.ndarray):
        self.pid = pid
        self.src, self.dst, self.w = src, dst, w
        graph = model.graph
        routes = [graph.route(s, d) for s, d in zip(src.tolist(), dst.tolist())]
        lens = np.fromiter((len(r) for r in routes), dtype=np.int64, count=len(routes))
        arcs = np.fromiter(chain.from_iterable(routes), dtype=np.int64, count=int(lens.sum()))
        flows = np.repeat(np.arange(len(routes), dtype=np.int64), lens)
        lat = np.zeros(len(routes))
        np.add.at(lat, flows, graph.latency[arcs])
        self.flow_lat = lat
        self.lat = float(lat.max()) if lat.size else 0.0
        finite = np.isfinite(graph.capacity[arcs])
        self.ent_flow = flows[finite]
        self.ent_garc = arcs[finite]
        self.unit = -1.0
        self.fin = None
        self._compact = None

    @property
    def nflows(self) -> int:
        """How many flows."""
        return self.src.size

    def solve(self, capacity: np.ndarray) -> None:
        """Simulate the phase alone for scale 1 (memoized on the pattern)."""
        if self.fin is not None:
            return
        ua, inv = np.unique(self.ent_garc, return_inverse=True)
        self.fin = drain(self.ent_flow, inv.reshape(-1), capacity[ua], self.w)
        self.unit = float(self.fin.max()) if self.fin.size else 0.0


@dataclass(frozen=True)
class Segment:
    """A run of identical phases (``repeats``), or a pipeline of ``depth`` levels when ``depth`` > 0."""

    pattern: Pattern
    repeats: int
    label: str
    depth: int = 0
    lat: float = 0.0  # a pipeline's latency: its longest root-to-leaf path


@dataclass(frozen=True)
class Phase:
    """A segment resolved for one size: how many phases, each flow's bytes per unit ``w``, the latency."""

    seg: Segment
    repeats: int
    scale: float
    lat: float
    nbytes: float  # what each flow really delivers per unit w (a pipeline moves more than that per edge-step)

    def time(self) -> float:
        """Duration of one of these phases alone on the network."""
        return self.lat + self.scale * self.seg.pattern.unit


class Plan:
    """The phase list of one (op, algorithm, group, root)."""

    __slots__ = ("algorithm", "segments")

    def __init__(self, algorithm: str, segments: list[Segment]):
        self.algorithm = algorithm
        self.segments = segments

    def phases(self, nbytes: float, capacity: np.ndarray, chunk: float, min_chunks: int) -> list[Phase]:
        """Resolve the segments for ``nbytes`` (pipelines: latency per level, fill bytes)."""
        out = []
        for seg in self.segments:
            p = seg.pattern
            p.solve(capacity)
            if seg.depth:
                # chunk is per flow; in units of S it is chunk / w.
                fill = min(nbytes / min_chunks, chunk / float(p.w.max())) if p.nflows else 0.0
                out.append(Phase(seg, 1, nbytes + (seg.depth - 1) * fill, seg.lat, nbytes))
            else:
                out.append(Phase(seg, seg.repeats, nbytes, p.lat, nbytes))
        return out
