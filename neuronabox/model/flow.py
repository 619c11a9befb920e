"""The ``flow`` model: a flow-level simulation with max-min fair sharing on the synthesized cluster graph.

A collective is a sequence of *phases*; a phase is a set of flows (src rank, dst rank, bytes)
that start together, and the next phase starts when the last flow of this one has arrived.
A phase costs the largest route latency of its flows, then the time until its last flow
completes while the flows share arc capacities max-min fairly: rates come from water-filling
(progressive filling) on the finite-capacity arcs of the routes, and are recomputed at every
flow completion (event-driven). Oversubscribed uplinks, ECMP collisions and concurrent
collectives on shared links therefore slow the flows that cross them.

Because every flow of a phase carries a fixed fraction of the collective's size S, a phase's
completion times scale linearly in S: a phase *pattern* is simulated once, for S = 1, and its
time is ``latency + S * unit``. Patterns are memoized by their flows, plans (the phase list of
an op/algorithm/group/root) by their key, so a warm estimate is a few multiplications.

``auto`` runs, per call, whichever of the library's algorithms (as in the alpha-beta model:
nccl ring or tree, gloo ring or rhd) finishes first alone at that size; collectives started
together keep that choice, since a library picks by size, not by the traffic beside it.

Decompositions (n ranks, S nccl-tests bytes, c channels):
- ring: ranks
  ordered by node (nodes in order of first appearance in the group, ranks by local index), so
  the ring crosses each node boundary once. Like NCCL, c = min over the group's nodes of
  min(group ranks on the node, NICs of the node) parallel rings each carry S/c; ring j enters
  every node at the first rank of the node's j-th slice of ranks (NIC j), so the channels use
  distinct NICs. All-reduce: 2(n-1) identical phases, every rank sends S/(nc) per ring to the
  next; all-gather / reduce-scatter: n-1 such phases. Broadcast / reduce: a pipelined chain
  from (to) the root over the ring order.
- pipelines (ring broadcast/reduce, every tree): each flow's bytes are cut into K chunks of
  at most ``pipeline_chunk`` (512 KiB, NCCL's Simple step: a 4 MiB buffer in 8 steps) and at
  least ``pipeline_min_chunks`` (8, the steps NCCL keeps in flight) chunks. A pipeline of depth
  D (levels) takes D + K - 1 chunk steps in which every edge moves one chunk at the rates of
  the steady state (every edge active), while latency is paid once along the longest
  root-to-leaf path (P): one phase of latency P in which each edge moves (D + K - 1) chunks.
  Alone: ``P + (S + (D-1)*S/K) * unit``, the pipelined ring's (n-1)*alpha + S/B plus the
  pipeline fill; S/K = min(S/8, chunk) never falls as S grows, so time is monotone in S.
- tree: all-reduce is NCCL's double binary tree (a heap-ordered binary tree over the nodes, a
  chain inside each node, the second tree over the nodes in mirrored order), each tree S/2 per
  channel, reduce up and broadcast down pipelined together (depth 2d). Broadcast / reduce: one
  pipelined binary tree rooted at the root. All-gather and reduce-scatter have no tree: ring.
- rhd: recursive halving-doubling (Rabenseifner) all-reduce, recursive halving
  reduce-scatter, recursive doubling all-gather; a non-power-of-two n first folds the extra
  ranks into their neighbours and unfolds them at the end. Broadcast / reduce: binomial tree.
  All-to-all: pairwise exchange (partner i xor k when n is a power of two, else i + k).
- direct: every flow at once: all-reduce = all-to-all reduce-scatter then all-gather of S/n;
  all-gather / reduce-scatter / all-to-all one phase of n(n-1) flows of S/n; broadcast /
  reduce root to / from everyone with S.
- all-to-all: auto = direct (NCCL posts all sends and receives together); ring = pairwise
  shift exchange in n-1 phases. gather / scatter are always direct (S/n to or from the root),
  send_recv one flow of S from ``group[root]`` to ``group[(root + 1) % n]``, barrier an
  all-reduce of 0 bytes with the chosen algorithm (latency only).

``estimate_concurrent`` simulates collectives that start together in one event-driven run:
each proceeds through its own phases and the flows of all active phases share the arcs
max-min fairly. Rounds in which every collective starts and ends one phase together are
memoized and repeated, so lockstep rings cost a handful of simulations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Sequence

import numpy as np

from ..collectives import Op
from ..errors import InputError
from .alphabeta import AUTO_CANDIDATES
from .base import Collective, CommModel, Estimate, Group, Step

__all__ = ["FlowModel", "max_min_rates", "drain"]

# Completions closer than this (relative) are one event: it keeps lockstep collectives in step
# despite rounding, at an error far below anything a network model can resolve.
_TOL = 1e-12



# In a joint run (estimate_concurrent) whose draining phases hold more flow-arc entries than
# this, completions within _BATCH_WINDOW (relative) of the first are one event: collectives of
# different sizes change each other's rates at every completion, and an exact event per ECMP
# load level would cost minutes. Each flow still finishes at its own time; the others pick up
# the freed capacity up to that window late (conservative). drain() needs no such grouping.
_BATCH_ENTRIES = 50_000
_BATCH_WINDOW = 1e-3


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
        sat = np.flatnonzero(share <= lam * (1.0 + _TOL))
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
            new[1:] = ts[1:] > ts[:-1] * (1.0 + _TOL)
            starts = np.flatnonzero(new)
            # Run through events while each leaves the others' rates as they are (see _rates_hold):
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


def _rates_hold(gone: np.ndarray, left: np.ndarray) -> bool:
    """Whether max-min rates stay as they are when flows at rates ``gone`` leave and ``left`` remain.

    A flow's bottleneck arc carries no flow faster than it, so flows strictly faster than every
    remaining flow cross no remaining flow's bottleneck: their departure changes no rate. With
    equal bytes the fastest flows always finish first, so a whole phase needs one water-fill.
    """
    return left.size == 0 or gone.size == 0 or float(gone.min()) > float(left.max()) * (1.0 + 1e-9)


class _Pattern:
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
class _Segment:
    """A run of identical phases (``repeats``), or a pipeline of ``depth`` levels when ``depth`` > 0."""

    pattern: _Pattern
    repeats: int
    label: str
    depth: int = 0
    lat: float = 0.0  # a pipeline's latency: its longest root-to-leaf path


@dataclass(frozen=True)
class _Phase:
    """A segment resolved for one size: how many phases, each flow's bytes per unit ``w``, the latency."""

    seg: _Segment
    repeats: int
    scale: float
    lat: float
    nbytes: float  # what each flow really delivers per unit w (a pipeline moves more than that per edge-step)

    def time(self) -> float:
        """Duration of one of these phases alone on the network."""
        return self.lat + self.scale * self.seg.pattern.unit


class _Plan:
    """The phase list of one (op, algorithm, group, root)."""

    __slots__ = ("algorithm", "segments")

    def __init__(self, algorithm: str, segments: list[_Segment]):
        self.algorithm = algorithm
        self.segments = segments

    def phases(self, nbytes: float, capacity: np.ndarray, chunk: float, min_chunks: int) -> list[_Phase]:
        """Resolve the segments for ``nbytes`` (pipelines: latency per level, fill bytes)."""
        out = []
        for seg in self.segments:
            p = seg.pattern
            p.solve(capacity)
            if seg.depth:
                # chunk is per flow; in units of S it is chunk / w.
                fill = min(nbytes / min_chunks, chunk / float(p.w.max())) if p.nflows else 0.0
                out.append(_Phase(seg, 1, nbytes + (seg.depth - 1) * fill, seg.lat, nbytes))
            else:
                out.append(_Phase(seg, seg.repeats, nbytes, p.lat, nbytes))
        return out


class _GroupInfo:
    """What the plans of one group share: the node blocks and the per-channel ring orders."""

    __slots__ = ("n", "order", "channels", "channel_blocks", "channel_orders")

    def __init__(self, model: "FlowModel", group: Group):
        topo = model.topology
        blocks: dict[int, list[int]] = {}
        for r in group.ranks:
            blocks.setdefault(topo.rank_node[r], []).append(r)
        per_node = [(ni, sorted(b)) for ni, b in blocks.items()]
        self.n = group.size
        self.order = [r for _, b in per_node for r in b]
        self.channels = min(min(len(b), topo.nodes[ni].nics) for ni, b in per_node)
        c = self.channels
        self.channel_blocks: list[list[list[int]]] = []
        for j in range(c):
            rotated = []
            for _, b in per_node:
                # Channel j enters the node at the first rank of its j-th slice of ranks, so the
                # channels' inter-node hops use distinct NICs.
                s = (j * len(b)) // c
                rotated.append(b[s:] + b[:s])
            self.channel_blocks.append(rotated)
        self.channel_orders = [[r for b in blocks_j for r in b] for blocks_j in self.channel_blocks]


def _tree_edges(blocks: list[list[int]]) -> tuple[list[tuple[int, int, int]], int]:
    """(parent, child, child depth) of a heap binary tree over blocks with a chain in each; and the depth."""
    edges = []
    depth = 0
    for b, blk in enumerate(blocks):
        nd = (b + 1).bit_length() - 1
        if b > 0:
            edges.append((blocks[(b - 1) // 2][0], blk[0], nd))
        for i in range(1, len(blk)):
            edges.append((blk[i - 1], blk[i], nd + i))
        depth = max(depth, nd + len(blk) - 1)
    return edges, depth


def _path_latency(graph, edges: list[tuple[int, int]], up: bool) -> float:
    """Longest root-to-leaf latency of a tree given as (parent, child) edges, parents listed first."""
    dist: dict[int, float] = {}
    best = 0.0
    for parent, child in edges:
        hop = graph.route_latency(child, parent) if up else graph.route_latency(parent, child)
        d = dist[child] = dist.get(parent, 0.0) + hop
        best = max(best, d)
    return best


def _rotate_to(seq: list[int], first: int) -> list[int]:
    i = seq.index(first)
    return seq[i:] + seq[:i]


class FlowModel(CommModel):
    """Flow-level simulation on the cluster graph with max-min fair link sharing and contention."""

    name = "flow"
    description = "flow-level simulation, max-min fair sharing: oversubscription, ECMP collisions, concurrent collectives"
    algorithms = ("ring", "tree", "rhd", "direct")
    protocols = ()
    # Bytes per flow per pipeline step (NCCL Simple: 4 MiB buffer / 8 steps).
    pipeline_chunk: float = 512 * 1024
    pipeline_min_chunks: int = 8

    def __init__(self, topology, graph=None, *, algorithm=None, protocol=None):
        super().__init__(topology, graph, algorithm=algorithm, protocol=protocol)
        if self.algorithm != "auto" and self.algorithm not in self.algorithms:
            raise InputError(
                f"{self.algorithm!r} is not an algorithm of model 'flow' (choose from auto, {', '.join(self.algorithms)})"
            )
        # What auto chooses among (the library's algorithms, as in the alpha-beta model); all-to-all
        # stays direct (NCCL posts every send and receive together).
        self._auto = tuple(a for a in AUTO_CANDIDATES.get(topology.emulation.library, ("ring",)) if a in self.algorithms) or ("ring",)
        self._choices: dict[tuple, str] = {}
        self._groups: dict[Group, _GroupInfo] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._patterns: dict[bytes, _Pattern] = {}
        self._concurrent: dict[tuple, list[Estimate]] = {}

    # ---- public ---------------------------------------------------------------------------
    def estimate(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> Estimate:
        """Duration of one collective alone on the network, from memoized phase patterns."""
        group = Group.of(group)
        s = 0.0 if op is Op.BARRIER else float(nbytes)
        plan, phases = self._chosen(op, group, root, s)
        duration = 0.0
        log = []
        for ph in phases:
            dur = ph.time()
            log.append((ph, 0, duration, dur, ph.repeats, None))
            duration += ph.repeats * dur
        return Estimate(duration, plan.algorithm, "", _builder(log))

    def estimate_concurrent(self, collectives: Sequence[Collective]) -> list[Estimate]:
        """Collectives that start together, simulated in one run in which their flows share arcs max-min fairly."""
        key = tuple((c.op, 0 if c.op is Op.BARRIER else c.nbytes, c.group, c.root) for c in collectives)
        hit = self._concurrent.get(key)
        if hit is not None:
            return list(hit)
        runs = []
        out: list[Estimate | None] = [None] * len(collectives)
        for i, c in enumerate(collectives):
            # Each runs the algorithm it would run alone: a library picks by size, not by the traffic beside it.
            plan, phases = self._chosen(c.op, Group.of(c.group), c.root, 0.0 if c.op is Op.BARRIER else float(c.nbytes))
            if phases:
                runs.append(_Run(i, plan.algorithm, phases))
            else:
                out[i] = Estimate(0.0, plan.algorithm, "", _builder([]))
        if runs:
            _simulate(runs, self.graph.capacity)
        for run in runs:
            out[run.index] = Estimate(run.end, run.algorithm, "", _builder(run.log))
        if len(self._concurrent) > 4096:
            self._concurrent.clear()
        self._concurrent[key] = out
        return list(out)

    def _chosen(self, op: Op, group: Group, root: int, s: float) -> tuple[_Plan, list]:
        """The plan run for ``s`` bytes and its phases: under ``auto``, the fastest alone of the library's algorithms."""
        def phases_of(plan: _Plan) -> list:
            return plan.phases(s, self.graph.capacity, self.pipeline_chunk, self.pipeline_min_chunks)

        if self.algorithm != "auto":
            plan = self._plan(op, group, root, self.algorithm)
            return plan, phases_of(plan)
        # A training run asks about the same few sizes every iteration: the choice is kept.
        key = (op, group, root, s)
        algo = self._choices.get(key)
        if algo is not None:
            plan = self._plan(op, group, root, algo)
            return plan, phases_of(plan)
        best = None
        auto = ("direct",) if op is Op.ALL_TO_ALL else self._auto
        for cand in dict.fromkeys(self._resolve(op, a) for a in auto):
            plan = self._plan(op, group, root, cand)
            phases = phases_of(plan)
            t = sum(ph.repeats * ph.time() for ph in phases)
            if best is None or t < best[0]:
                best = (t, plan, phases)
        if len(self._choices) > 65536:
            self._choices.clear()
        self._choices[key] = best[1].algorithm
        return best[1], best[2]

    # ---- plans ----------------------------------------------------------------------------
    def _info(self, group: Group) -> _GroupInfo:
        info = self._groups.get(group)
        if info is None:
            n = self.topology.world_size
            bad = [r for r in group.ranks if not 0 <= r < n]
            if bad:
                raise InputError(f"rank {bad[0]} is not in the topology (world size {n})")
            if len(set(group.ranks)) != group.size:
                raise InputError(f"a group lists a rank twice: {group!r}")
            info = self._groups[group] = _GroupInfo(self, group)
        return info

    @staticmethod
    def _resolve(op: Op, algo: str) -> str:
        """The algorithm actually run for a chosen one: fallbacks for ops it does not cover."""
        if op in (Op.GATHER, Op.SCATTER, Op.SEND_RECV):
            return "direct"
        if op is Op.ALL_TO_ALL:
            return "direct" if algo in ("tree", "direct") else algo
        if algo == "tree" and op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
            return "ring"
        return algo

    def _plan(self, op: Op, group: Group, root: int, algorithm: str) -> _Plan:
        n = group.size
        if op in (Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER, Op.SEND_RECV):
            if not 0 <= root < n:
                raise InputError(f"root {root} is not a group index (group of {n})")
        else:
            root = 0
        key = (op, group, root, algorithm)
        plan = self._plans.get(key)
        if plan is None:
            algo = self._resolve(op, algorithm)
            info = self._info(group)
            segs = [] if n < 2 else self._segments(op if op is not Op.BARRIER else Op.ALL_REDUCE, algo, info, group, root)
            plan = self._plans[key] = _Plan(algo, segs)
        return plan

    def _pattern(self, src: Sequence[int], dst: Sequence[int], w) -> _Pattern:
        src_a = np.asarray(src, dtype=np.int64)
        dst_a = np.asarray(dst, dtype=np.int64)
        w_a = np.broadcast_to(np.asarray(w, dtype=float), src_a.shape).copy()
        key = src_a.tobytes() + b"|" + dst_a.tobytes() + b"|" + w_a.tobytes()
        p = self._patterns.get(key)
        if p is None:
            p = self._patterns[key] = _Pattern(len(self._patterns), self, src_a, dst_a, w_a)
        return p

    def _segments(self, op: Op, algo: str, info: _GroupInfo, group: Group, root: int) -> list[_Segment]:
        n = info.n
        r0 = group.ranks[root]
        if op is Op.SEND_RECV:
            return [_Segment(self._pattern([r0], [group.ranks[(root + 1) % n]], 1.0), 1, "send")]
        if op in (Op.GATHER, Op.SCATTER):
            others = [r for r in info.order if r != r0]
            if op is Op.GATHER:
                return [_Segment(self._pattern(others, [r0] * len(others), 1.0 / n), 1, "gather")]
            return [_Segment(self._pattern([r0] * len(others), others, 1.0 / n), 1, "scatter")]
        if algo == "ring":
            return self._ring(op, info, r0)
        if algo == "tree":
            return self._tree(op, info, r0)
        if algo == "rhd":
            return self._rhd(op, info, r0)
        return self._direct(op, info, r0)

    def _ring(self, op: Op, info: _GroupInfo, r0: int) -> list[_Segment]:
        n, c = info.n, info.channels
        if op is Op.ALL_TO_ALL:
            return self._shift_exchange(info.order, n)
        if op in (Op.BROADCAST, Op.REDUCE):
            src, dst = [], []
            lat = 0.0
            for order in info.channel_orders:
                o = _rotate_to(order, r0)
                head, tail = o[:-1], o[1:]
                src += head if op is Op.BROADCAST else tail
                dst += tail if op is Op.BROADCAST else head
                lat = max(lat, _path_latency(self.graph, list(zip(head, tail)), op is Op.REDUCE))
            p = self._pattern(src, dst, 1.0 / c)
            return [_Segment(p, 1, "chain", depth=n - 1, lat=lat)]
        src = [r for o in info.channel_orders for r in o]
        dst = [r for o in info.channel_orders for r in o[1:] + o[:1]]
        p = self._pattern(src, dst, 1.0 / (n * c))
        if op is Op.ALL_REDUCE:
            return [_Segment(p, n - 1, "reduce-scatter"), _Segment(p, n - 1, "all-gather")]
        return [_Segment(p, n - 1, "reduce-scatter" if op is Op.REDUCE_SCATTER else "all-gather")]

    def _tree(self, op: Op, info: _GroupInfo, r0: int) -> list[_Segment]:
        c = info.channels
        if op is Op.ALL_TO_ALL:
            return self._direct(op, info, r0)
        src, dst = [], []
        if op is Op.ALL_REDUCE:
            trees = []
            for blocks in info.channel_blocks:
                nb = len(blocks)
                # NCCL's second tree: mirrored for an even node count, shifted by one for odd.
                other = blocks[::-1] if nb % 2 == 0 else blocks[1:] + blocks[:1]
                trees += [_tree_edges(blocks), _tree_edges(other)]
            d = max(depth for _, depth in trees)
            lat = 0.0
            for edges, _ in trees:
                pc = [(parent, child) for parent, child, _ in edges]
                for parent, child in pc:
                    src += [child, parent]
                    dst += [parent, child]
                # The first chunk climbs to the root, then descends to the farthest leaf.
                lat = max(lat, _path_latency(self.graph, pc, True) + _path_latency(self.graph, pc, False))
            p = self._pattern(src, dst, 1.0 / (2 * c))
            return [_Segment(p, 1, "tree reduce+broadcast", depth=2 * d, lat=lat)]
        if op in (Op.BROADCAST, Op.REDUCE):
            trees = []
            for blocks in info.channel_blocks:
                bi = next(i for i, b in enumerate(blocks) if r0 in b)
                first = _rotate_to(blocks[bi], r0)
                trees.append(_tree_edges([first] + blocks[:bi] + blocks[bi + 1 :]))
            d = max(depth for _, depth in trees)
            down = op is Op.BROADCAST
            lat = 0.0
            for edges, _ in trees:
                pc = [(parent, child) for parent, child, _ in edges]
                for parent, child in pc:
                    src.append(parent if down else child)
                    dst.append(child if down else parent)
                lat = max(lat, _path_latency(self.graph, pc, not down))
            p = self._pattern(src, dst, 1.0 / c)
            return [_Segment(p, 1, "tree", depth=d, lat=lat)]
        return self._ring(op, info, r0)

    def _exchange(self, q: list[int], dist: int, w: float, label: str) -> _Segment:
        src = q
        dst = [q[i ^ dist] for i in range(len(q))]
        return _Segment(self._pattern(src, dst, w), 1, label)

    def _rhd(self, op: Op, info: _GroupInfo, r0: int) -> list[_Segment]:
        n, order = info.n, info.order
        if op is Op.ALL_TO_ALL:
            if n & (n - 1) == 0:
                return [
                    _Segment(self._pattern(order, [order[i ^ k] for i in range(n)], 1.0 / n), 1, f"pairwise {k}")
                    for k in range(1, n)
                ]
            return self._shift_exchange(order, n)
        if op in (Op.BROADCAST, Op.REDUCE):
            o = _rotate_to(order, r0)
            segs = []
            k = 1
            while k < n:
                pairs = [(o[p], o[p + k]) for p in range(k) if p + k < n]
                if op is Op.REDUCE:
                    pairs = [(b, a) for a, b in pairs]
                segs.append(_Segment(self._pattern(*zip(*pairs), 1.0), 1, f"binomial {k}"))
                k <<= 1
            return segs[::-1] if op is Op.REDUCE else segs
        n2 = 1 << (n.bit_length() - 1)
        extra = n - n2
        keep = [order[2 * i] for i in range(extra)]
        folded = [order[2 * i + 1] for i in range(extra)]
        q = keep + order[2 * extra :]
        steps = n2.bit_length() - 1
        pre_w, post_w = {
            Op.ALL_REDUCE: (1.0, 1.0),
            Op.REDUCE_SCATTER: (1.0, 1.0 / n),
            Op.ALL_GATHER: (1.0 / n, (n - 1) / n),
        }[op]
        segs = []
        if extra:
            segs.append(_Segment(self._pattern(folded, keep, pre_w), 1, "fold"))
        if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
            for k in range(steps):
                segs.append(self._exchange(q, n2 >> (k + 1), 1.0 / (2 << k), f"halving {k + 1}/{steps}"))
        if op is Op.ALL_REDUCE:
            for k in reversed(range(steps)):
                segs.append(self._exchange(q, n2 >> (k + 1), 1.0 / (2 << k), f"doubling {steps - k}/{steps}"))
        if op is Op.ALL_GATHER:
            for k in range(steps):
                segs.append(self._exchange(q, 1 << k, (1 << k) / n2, f"doubling {k + 1}/{steps}"))
        if extra:
            segs.append(_Segment(self._pattern(keep, folded, post_w), 1, "unfold"))
        return segs

    def _shift_exchange(self, order: list[int], n: int) -> list[_Segment]:
        return [
            _Segment(self._pattern(order, order[k:] + order[:k], 1.0 / n), 1, f"exchange {k}/{n - 1}")
            for k in range(1, n)
        ]

    def _direct(self, op: Op, info: _GroupInfo, r0: int) -> list[_Segment]:
        n, order = info.n, info.order
        if op in (Op.BROADCAST, Op.REDUCE):
            others = [r for r in order if r != r0]
            ends = (others, [r0] * len(others)) if op is Op.REDUCE else ([r0] * len(others), others)
            return [_Segment(self._pattern(*ends, 1.0), 1, "direct")]
        a = np.asarray(order, dtype=np.int64)
        src = np.repeat(a, n)
        dst = np.tile(a, n)
        off = src != dst
        p = self._pattern(src[off], dst[off], 1.0 / n)
        if op is Op.ALL_REDUCE:
            return [_Segment(p, 1, "direct reduce-scatter"), _Segment(p, 1, "direct all-gather")]
        return [_Segment(p, 1, "direct")]


class _Run:
    """One collective's progress through its phases in a joint simulation."""

    __slots__ = (
        "index", "algorithm", "phases", "pi", "rep", "draining", "ready", "start", "rem", "act", "fin", "log", "end", "rate",
    )

    def __init__(self, index: int, algorithm: str, phases: list[_Phase]):
        self.index = index
        self.algorithm = algorithm
        self.phases = phases
        self.pi = 0
        self.rep = 0
        self.log: list[tuple] = []
        self.end = 0.0

    @property
    def phase(self) -> _Phase:
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
    return a <= b + _TOL * abs(b) + 1e-18


def _simulate(runs: list[_Run], capacity: np.ndarray) -> None:
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
        completed: list[_Run] = []
        gone, left = [], []
        with np.errstate(invalid="ignore"):
            for r, rate, ttf in zip(draining, rates, ttfs):
                done = ttf <= dt * (1.0 + _TOL)
                r.rem = np.where(r.act & ~done, r.rem - np.where(np.isinf(rate), 0.0, rate) * dt, 0.0)
                r.fin[done] = np.minimum(t + ttf[done], t_new) - r.start
                gone.append(rate[done])
                r.act = r.act & ~done
                left.append(rate[r.act])
                if not r.act.any():
                    completed.append(r)
        if gone and not _rates_hold(np.concatenate(gone), np.concatenate(left)):
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


def _skip_empty(run: _Run, t: float) -> bool:
    # A phase with no flows would never produce an event: move past it (True when the run ends).
    while run.phase.seg.pattern.nflows == 0:
        if run.advance(run.phase.repeats - run.rep, t):
            return True
    return False


def _joint_rates(draining: list[_Run], capacity: np.ndarray, memo: dict) -> list[np.ndarray]:
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


def _builder(log: list[tuple]) -> Callable[[], list[Step]]:
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
