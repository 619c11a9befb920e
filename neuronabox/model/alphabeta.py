"""The alpha-beta (latency-bandwidth) model: closed forms of the classic collective algorithms.

For a group of n ranks, message S bytes (nccl-tests convention), per-step latency alpha and
per-rank bandwidth B, e.g. ring all-reduce ``2(n-1)·alpha + 2(n-1)/n · S/B``. Alpha and B come
from the synthesized graph, per group:

- ring: ranks ordered by node, so the ring crosses each node boundary once; alpha is the
  slowest neighbour route, B the slowest neighbour link. A ring edge that leaves a node runs
  over min(ranks of the node in the group, NICs of the node) channels (NCCL's parallel rings
  on separate NICs), so 8 GPUs with 8 NICs get 8x one NIC, capped by the intra-node fabric.
- tree / rhd / direct: alpha is the largest route latency from the first rank (the group's
  diameter on symmetric networks), B the per-rank injection bandwidth (a node's NIC
  bandwidth shared by its ranks, capped by the fabric).
- hier-X: intra-node ring reduce-scatter, then X among the nodes on S/g bytes with the node's
  NICs shared by its g local ranks, then intra-node ring all-gather.

Contention between collectives and oversubscription are ignored here: that is the flow model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from ..collectives import Op
from . import schedules
from .base import CommModel, Estimate, Group, Step, range_by_node

__all__ = ["AlphaBetaModel"]

FLAT = ("ring", "tree", "rhd", "direct")
HIER = tuple(f"hier-{a}" for a in FLAT)

# What `auto` chooses among, per collective library; a forced algorithm may be any of ALGORITHMS.
AUTO_CANDIDATES = {
    "nccl": ("ring", "tree"),
    "gloo": ("ring", "rhd"),
}
# Ops whose data movement has no sensible tree/rhd/hierarchical variant fall back to these.
_P2P_OPS = (Op.SEND_RECV,)


@dataclass(frozen=True, slots=True)
class _Params:
    """Everything about a group that the closed forms need, derived once from the graph."""

    n: int
    order: tuple[int, ...] | range  # ranks sorted by node (a large run of consecutive ranks stays a range)
    nodes: int
    g: int  # most ranks of the group on one node
    a_ring: float
    b_ring: float
    a_flat: float
    b_flat: float
    a_intra: float
    b_intra: float
    a_inter: float  # among node representatives (hier)
    a_inter_ring: float
    b_inter: float  # per local rank, for the hier inter-node phase
    reps: tuple[int, ...]  # the first rank of each node, in order
    p2p: tuple[float, float]  # latency, bandwidth from order[0] to order[1]


def _by_node(ranks, topo) -> dict[int, "list[int] | range"]:
    """A group's ranks by node, nodes in order of their ranks and each node's ranks ascending; a range's blocks are ranges."""
    if isinstance(ranks, range) and ranks.step == 1:
        return range_by_node(ranks, topo)
    rank_node = topo.rank_node
    by: dict[int, list[int]] = {}
    for r in sorted(ranks, key=lambda r: (rank_node[r], r)):
        by.setdefault(rank_node[r], []).append(r)
    return by


def _nic_classes(rs, topo) -> list[int]:
    """The first rank of ``rs`` (one node's, ascending) on each of its NICs: a route's other end differs only by these."""
    node = topo.node_of(rs[0])
    nics, ranks, first = node.nics, node.ranks, node.first_rank
    if isinstance(rs, range):  # local rank l is on NIC l * nics // ranks; NIC j starts at ceil(j * ranks / nics)
        lo, hi = rs[0] - first, rs[-1] - first
        return [first + max(lo, -(-j * ranks // nics)) for j in range(lo * nics // ranks, hi * nics // ranks + 1)]
    out, last = [], None
    for r in rs:
        nic = (r - first) * nics // ranks
        if nic != last:
            out.append(r)
            last = nic
    return out


def _log2(n: int) -> int:
    return (n - 1).bit_length()  # ceil(log2 n) for n >= 1


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


# ---- closed forms: f(n, S, alpha, B) -> seconds -------------------------------------------------
def _ring_allreduce(n, s, a, b):
    return 2 * (n - 1) * a + 2 * (n - 1) / n * s / b


def _ring_gather_like(n, s, a, b):
    # all-gather, reduce-scatter: n-1 steps of S/n
    return (n - 1) * a + (n - 1) / n * s / b


def _chain(n, s, a, b):
    # pipelined ring broadcast/reduce: the pipeline fills in n-1 hops, then streams S
    return (n - 1) * a + s / b


def _pairwise_alltoall(n, s, a, b):
    return (n - 1) * (a + s / n / b)


def _tree_allreduce(n, s, a, b):
    # double binary tree: reduce up, broadcast down, each tree on S/2. A rank is interior in one
    # tree (2 children) and a leaf in the other, so it sends and receives 2S in all, versus
    # 2(n-1)/n·S on a ring: fewer latency steps, slightly more bytes.
    return 2 * _log2(n) * a + 2 * s / b


def _tree_bcast(n, s, a, b):
    return _log2(n) * a + s / b


def _tree_gather(n, s, a, b):
    return _log2(n) * a + (n - 1) / n * s / b


def _tree_barrier(n, s, a, b):
    return 2 * _log2(n) * a


def _rhd_extra(n, s, a, b):
    # non-power-of-two: the excess ranks fold into partners before and unfold after (Thakur et al.)
    return 0.0 if n == _pow2_floor(n) else 2 * (a + s / b)


def _rhd_allreduce(n, s, a, b):
    p = _pow2_floor(n)
    return 2 * math.log2(p) * a + 2 * (p - 1) / p * s / b + _rhd_extra(n, s, a, b)


def _rhd_gather_like(n, s, a, b):
    p = _pow2_floor(n)
    return math.log2(p) * a + (p - 1) / p * s / b + _rhd_extra(n, s, a, b) / 2


def _rhd_bcast(n, s, a, b):
    # van de Geijn: binomial scatter then recursive-doubling all-gather
    p = _pow2_floor(n)
    return 2 * math.log2(p) * a + 2 * (p - 1) / p * s / b + _rhd_extra(n, s, a, b) / 2


def _bruck_alltoall(n, s, a, b):
    k = _log2(n)
    return k * a + k * s / 2 / b


def _dissemination_barrier(n, s, a, b):
    return _log2(n) * a


def _direct_allreduce(n, s, a, b):
    return 2 * a + 2 * (n - 1) / n * s / b


def _direct_gather_like(n, s, a, b):
    return a + (n - 1) / n * s / b


def _direct_rooted_full(n, s, a, b):
    # the root sends (or receives) the whole buffer to (from) each of the n-1 others
    return a + (n - 1) * s / b


def _direct_barrier(n, s, a, b):
    return 2 * a


_Formula = Callable[[int, float, float, float], float]

FORMULAS: dict[str, dict[Op, _Formula]] = {
    "ring": {
        Op.ALL_REDUCE: _ring_allreduce,
        Op.ALL_GATHER: _ring_gather_like,
        Op.REDUCE_SCATTER: _ring_gather_like,
        Op.BROADCAST: _chain,
        Op.REDUCE: _chain,
        Op.ALL_TO_ALL: _pairwise_alltoall,
        Op.GATHER: _direct_gather_like,
        Op.SCATTER: _direct_gather_like,
        Op.BARRIER: _ring_allreduce,
    },
    "tree": {
        Op.ALL_REDUCE: _tree_allreduce,
        Op.BROADCAST: _tree_bcast,
        Op.REDUCE: _tree_bcast,
        Op.GATHER: _tree_gather,
        Op.SCATTER: _tree_gather,
        Op.BARRIER: _tree_barrier,
    },
    "rhd": {
        Op.ALL_REDUCE: _rhd_allreduce,
        Op.ALL_GATHER: _rhd_gather_like,
        Op.REDUCE_SCATTER: _rhd_gather_like,
        Op.BROADCAST: _rhd_bcast,
        Op.REDUCE: _rhd_bcast,
        Op.ALL_TO_ALL: _bruck_alltoall,
        Op.GATHER: _tree_gather,
        Op.SCATTER: _tree_gather,
        Op.BARRIER: _dissemination_barrier,
    },
    "direct": {
        Op.ALL_REDUCE: _direct_allreduce,
        Op.ALL_GATHER: _direct_gather_like,
        Op.REDUCE_SCATTER: _direct_gather_like,
        Op.BROADCAST: _direct_rooted_full,
        Op.REDUCE: _direct_rooted_full,
        Op.ALL_TO_ALL: _direct_gather_like,
        Op.GATHER: _direct_gather_like,
        Op.SCATTER: _direct_gather_like,
        Op.BARRIER: _direct_barrier,
    },
}
# The inter-node phase of hier-X: X where X has the op (no tree all-gather), a ring otherwise.
_INNER = {a: {**FORMULAS["ring"], **FORMULAS[a]} for a in FLAT}
# Hierarchical variants exist for the ops whose data can be pre-reduced or pre-gathered in the node.
_HIER_OPS = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST, Op.REDUCE, Op.BARRIER)
# all-to-all, gather and scatter under nccl are grouped point-to-point: all peers at once.
_NCCL_P2P_LIKE = {Op.ALL_TO_ALL: "direct", Op.GATHER: "direct", Op.SCATTER: "direct"}


class AlphaBetaModel(CommModel):
    """Closed-form latency-bandwidth model with ring, tree, rhd, direct and hierarchical algorithms."""

    name = "alpha-beta"
    description = "closed forms: ring, double binary tree, recursive halving-doubling, direct, hierarchical"
    algorithms = FLAT + HIER
    protocols = ()

    def __init__(self, topology, graph=None, *, algorithm=None, protocol=None):
        super().__init__(topology, graph, algorithm=algorithm, protocol=protocol)
        self._params: dict[Group, _Params] = {}
        auto = AUTO_CANDIDATES.get(topology.emulation.library, ("ring",))
        # Per op, the candidates that have it (nccl has no tree all-gather).
        self._auto = {op: tuple(a for a in auto if op in FORMULAS[a]) or ("ring",) for op in Op}

    # ---- per-group parameters ------------------------------------------------------------
    def params(self, group: Group) -> _Params:
        """The group's derived latencies and bandwidths (cached)."""
        p = self._params.get(group)
        if p is None:
            p = self._derive(group)
            self._params[group] = p
        return p

    def _derive(self, group: Group) -> _Params:
        topo, g = self.topology, self.graph
        rank_node = topo.rank_node
        per_node = _by_node(group.ranks, topo)
        # Ranks sorted by node: a run of consecutive ranks already is (nodes hold consecutive ranks).
        order = group.ranks if isinstance(group.ranks, range) else tuple(r for rs in per_node.values() for r in rs)
        n = len(order)
        counts = {nd: len(rs) for nd, rs in per_node.items()}
        gmax = max(counts.values())

        a_intra, b_intra = 0.0, math.inf
        for rs in per_node.values():
            if len(rs) > 1:
                a_intra = max(a_intra, g.route_latency(rs[0], rs[1]))
                b_intra = min(b_intra, g.route_bandwidth(rs[0], rs[1]))

        def channels(rank: int) -> int:
            nd = rank_node[rank]
            return min(counts[nd], topo.nodes[nd].nics)

        def link_bw(src: int, dst: int) -> float:
            bw = g.route_bandwidth(src, dst)
            return bw if rank_node[src] == rank_node[dst] else bw * channels(src)

        # The ring visits ``order``. Every pair of consecutive ranks on one node crosses that node's
        # fabric alike (rank -> host -> rank), so one pair a node stands for them; the pairs across
        # nodes are each node's last rank and the next node's first.
        a_ring, b_ring = 0.0, math.inf
        if n > 1:
            blocks = list(per_node.values())
            pairs = [(rs[0], rs[1]) for rs in blocks if len(rs) > 1]
            if len(blocks) > 1:
                pairs += [(rs[-1], blocks[(i + 1) % len(blocks)][0]) for i, rs in enumerate(blocks)]
            for src, dst in pairs:
                a_ring = max(a_ring, g.route_latency(src, dst))
                b_ring = min(b_ring, link_bw(src, dst))

        first = order[0]
        # From ``first`` a route differs only by the destination's node and NIC: one rank of each.
        a_flat = max((g.route_latency(first, r) for rs in per_node.values() for r in _nic_classes(rs, topo)
                      if r != first), default=0.0)
        if n > 1 and len(per_node[rank_node[first]]) > 1:  # ``first``'s own node: its second rank
            a_flat = max(a_flat, g.route_latency(first, per_node[rank_node[first]][1]))
        a_flat = max(a_flat, a_intra)
        reps = tuple(rs[0] for rs in per_node.values())
        # Per-rank injection: a node's NIC capacity is shared by its ranks in the group.
        b_inter = math.inf
        for i, rep in enumerate(reps if len(reps) > 1 else ()):
            nxt = reps[(i + 1) % len(reps)]
            nd = rank_node[rep]
            share = g.route_bandwidth(rep, nxt) * min(counts[nd], topo.nodes[nd].nics) / counts[nd]
            b_inter = min(b_inter, share)
        b_flat = min(b_intra, b_inter)
        a_inter = max((g.route_latency(reps[0], r) for r in reps[1:]), default=0.0)
        a_inter_ring = max(
            (g.route_latency(reps[i], reps[(i + 1) % len(reps)]) for i in range(len(reps))), default=0.0
        ) if len(reps) > 1 else 0.0
        p2p = (g.route_latency(order[0], order[1]), g.route_bandwidth(order[0], order[1])) if n > 1 else (0.0, math.inf)
        return _Params(
            n=n, order=order, nodes=len(per_node), g=gmax, a_ring=a_ring, b_ring=b_ring, a_flat=a_flat,
            b_flat=b_flat, a_intra=a_intra, b_intra=b_intra, a_inter=a_inter, a_inter_ring=a_inter_ring,
            b_inter=b_inter, reps=reps, p2p=p2p,
        )

    # ---- estimates ------------------------------------------------------------------------
    def estimate(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> Estimate:
        """Closed-form duration of ``op`` on ``group``; ``auto`` takes the fastest of the library's algorithms."""
        group = Group.of(group)
        p = self.params(group)
        if p.n == 1:
            return Estimate(0.0, "local")
        if op is Op.SEND_RECV:
            return self._send_recv(group, nbytes, root)
        algo = self.algorithm
        if algo == "auto":
            choice = _NCCL_P2P_LIKE.get(op) if self.topology.emulation.library == "nccl" else None
            if choice is None:
                best, choice = math.inf, "ring"
                for cand in self._auto[op]:
                    t = self._time(cand, op, p, nbytes)
                    if t < best:
                        best, choice = t, cand
            return Estimate(self._time(choice, op, p, nbytes), choice, "", partial(self._steps, choice, op, p, nbytes))
        used = self._applicable(algo, op, p)
        return Estimate(self._time(used, op, p, nbytes), used, "", partial(self._steps, used, op, p, nbytes))

    def _applicable(self, algo: str, op: Op, p: _Params) -> str:
        """The algorithm actually used when ``algo`` is forced: a variant without this op falls back to ring."""
        if algo.startswith("hier-"):
            if op not in _HIER_OPS or p.nodes == 1 or p.g == 1:
                return self._applicable(algo[5:], op, p)
            return algo
        return algo if op in FORMULAS[algo] else "ring"

    def _time(self, algo: str, op: Op, p: _Params, s: float) -> float:
        if algo.startswith("hier-"):
            return self._hier_time(algo[5:], op, p, s)
        if algo == "ring":
            return FORMULAS["ring"][op](p.n, 0.0 if op is Op.BARRIER else s, p.a_ring, p.b_ring)
        return FORMULAS[algo][op](p.n, 0.0 if op is Op.BARRIER else s, p.a_flat, p.b_flat)

    def _hier_time(self, inner: str, op: Op, p: _Params, s: float) -> float:
        g, nn = p.g, p.nodes
        a_i, b_i = p.a_intra, p.b_intra
        a_x = p.a_inter_ring if inner == "ring" else p.a_inter
        f = _INNER[inner]
        if op is Op.BARRIER:
            s, op = 0.0, Op.ALL_REDUCE
        if op is Op.ALL_REDUCE:
            return 2 * _ring_gather_like(g, s, a_i, b_i) + f[Op.ALL_REDUCE](nn, s / g, a_x, p.b_inter)
        if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
            return _ring_gather_like(g, s, a_i, b_i) + f[op](nn, s / g, a_x, p.b_inter)
        # broadcast / reduce: across the nodes first (or last), then inside every node
        return f[op](nn, s, a_x, p.b_inter * g) + _chain(g, s, a_i, b_i)

    def _send_recv(self, group: Group, nbytes: int, root: int) -> Estimate:
        ranks = group.ranks
        src = ranks[root] if root < len(ranks) else ranks[0]
        dst = next((r for r in ranks if r != src), src)
        lat, bw = self.graph.route_latency(src, dst), self.graph.route_bandwidth(src, dst)
        dur = lat + nbytes / bw
        return Estimate(dur, "p2p", "", lambda: [Step(0.0, dur, src, dst, nbytes, "p2p")])

    # ---- schedules ------------------------------------------------------------------------
    def _steps(self, algo: str, op: Op, p: _Params, s: float) -> list[Step]:
        if op is Op.BARRIER:
            s = 0.0
        n, order = p.n, tuple(p.order)  # a schedule names every rank anyway; schedules slice and join tuples
        if algo.startswith("hier-"):
            return self._hier_steps(algo[5:], op, p, s)
        a, b = (p.a_ring, p.b_ring) if algo == "ring" else (p.a_flat, p.b_flat)
        if algo == "ring":
            if op in (Op.ALL_REDUCE, Op.BARRIER):
                return schedules.ring(order, 2 * (n - 1), s / n, a + s / n / b, "ring")
            if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
                return schedules.ring(order, n - 1, s / n, a + s / n / b, "ring")
            if op in (Op.BROADCAST, Op.REDUCE):
                return schedules.chain(order, s, a, s / b, "chain")
            if op is Op.ALL_TO_ALL:
                return [
                    st
                    for k in range(1, n)
                    for st in schedules.direct(
                        [(order[i], order[(i + k) % n]) for i in range(n)], s / n, a + s / n / b, f"pairwise {k}",
                        (k - 1) * (a + s / n / b),
                    )
                ]
        if algo == "tree" and op in (Op.ALL_REDUCE, Op.BROADCAST, Op.REDUCE, Op.BARRIER, Op.GATHER, Op.SCATTER):
            transfer = ((n - 1) / n if op in (Op.GATHER, Op.SCATTER) else 1.0) * s / b
            return schedules.binary_tree(
                order, s, a, transfer, "tree", up=op in (Op.ALL_REDUCE, Op.REDUCE, Op.BARRIER, Op.GATHER),
                down=op in (Op.ALL_REDUCE, Op.BROADCAST, Op.BARRIER, Op.SCATTER),
            )
        if algo == "rhd" and op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
            rs = schedules.halving_doubling(order, s, a, 1 / b, "halving", halving=True)
            if op is Op.REDUCE_SCATTER:
                return rs
            t0 = max((st.end for st in rs), default=0.0) if op is Op.ALL_REDUCE else 0.0
            ag = schedules.halving_doubling(order, s, a, 1 / b, "doubling", halving=False, t0=t0)
            return ag if op is Op.ALL_GATHER else rs + ag
        # Direct and the rest: every needed pair at once for the op's whole duration.
        dur = self._time(algo, op, p, s)
        root = order[0]
        if op in (Op.BROADCAST, Op.SCATTER):
            pairs = [(root, r) for r in order[1:]]
        elif op in (Op.REDUCE, Op.GATHER):
            pairs = [(r, root) for r in order[1:]]
        else:
            pairs = [(x, y) for x in order for y in order if x != y]
        per = s if op in (Op.BROADCAST, Op.REDUCE) else s / n
        return schedules.direct(pairs, per, dur, algo)

    def _hier_steps(self, inner: str, op: Op, p: _Params, s: float) -> list[Step]:
        g = p.g
        by_node: dict[int, list[int]] = {}
        for r in p.order:
            by_node.setdefault(self.topology.rank_node[r], []).append(r)
        intra = _ring_gather_like(g, s, p.a_intra, p.b_intra)
        out: list[Step] = []
        if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.BARRIER):
            for rs in by_node.values():
                out += schedules.ring(rs, len(rs) - 1, s / g, intra / max(1, len(rs) - 1), "intra reduce-scatter")
        t0 = intra if out else 0.0
        inner_op = Op.ALL_REDUCE if op is Op.BARRIER else op
        dur = self._hier_time(inner, op, p, s) - (2 * intra if op in (Op.ALL_REDUCE, Op.BARRIER) else intra)
        for local in range(g):
            members = [rs[local] for rs in by_node.values() if local < len(rs)]
            if len(members) > 1:
                out += schedules.direct(
                    [(members[i], members[(i + 1) % len(members)]) for i in range(len(members))],
                    s / g, dur, f"inter {inner} {inner_op.value}", t0,
                )
        if op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.BARRIER):
            t1 = t0 + dur
            for rs in by_node.values():
                out += schedules.ring(rs, len(rs) - 1, s / g, intra / max(1, len(rs) - 1), "intra all-gather", t1)
        return out
