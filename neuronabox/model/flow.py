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

This module holds the model and the decompositions; beside it ``maxmin.py`` (max-min fair
rates, ``drain``), ``flow_phases.py`` (patterns, segments, phases, plans) and ``flow_sim.py``
(the joint event-driven run).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..collectives import Op
from ..errors import InputError
from .alphabeta import AUTO_CANDIDATES
from .base import Collective, CommModel, Estimate, Group
from .flow_phases import Pattern, Plan, Segment
from .flow_sim import Run, lazy_steps, simulate

__all__ = ["FlowModel"]


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
        self._plans: dict[tuple, Plan] = {}
        self._patterns: dict[bytes, Pattern] = {}
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
        return Estimate(duration, plan.algorithm, "", lazy_steps(log))

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
                runs.append(Run(i, plan.algorithm, phases))
            else:
                out[i] = Estimate(0.0, plan.algorithm, "", lazy_steps([]))
        if runs:
            simulate(runs, self.graph.capacity)
        for run in runs:
            out[run.index] = Estimate(run.end, run.algorithm, "", lazy_steps(run.log))
        if len(self._concurrent) > 4096:
            self._concurrent.clear()
        self._concurrent[key] = out
        return list(out)

    def _chosen(self, op: Op, group: Group, root: int, s: float) -> tuple[Plan, list]:
        """The plan run for ``s`` bytes and its phases: under ``auto``, the fastest alone of the library's algorithms."""
        def phases_of(plan: Plan) -> list:
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

    def _plan(self, op: Op, group: Group, root: int, algorithm: str) -> Plan:
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
            plan = self._plans[key] = Plan(algo, segs)
        return plan

    def _pattern(self, src: Sequence[int], dst: Sequence[int], w) -> Pattern:
        src_a = np.asarray(src, dtype=np.int64)
        dst_a = np.asarray(dst, dtype=np.int64)
        w_a = np.broadcast_to(np.asarray(w, dtype=float), src_a.shape).copy()
        key = src_a.tobytes() + b"|" + dst_a.tobytes() + b"|" + w_a.tobytes()
        p = self._patterns.get(key)
        if p is None:
            p = self._patterns[key] = Pattern(len(self._patterns), self, src_a, dst_a, w_a)
        return p

    def _segments(self, op: Op, algo: str, info: _GroupInfo, group: Group, root: int) -> list[Segment]:
        n = info.n
        r0 = group.ranks[root]
        if op is Op.SEND_RECV:
            return [Segment(self._pattern([r0], [group.ranks[(root + 1) % n]], 1.0), 1, "send")]
        if op in (Op.GATHER, Op.SCATTER):
            others = [r for r in info.order if r != r0]
            if op is Op.GATHER:
                return [Segment(self._pattern(others, [r0] * len(others), 1.0 / n), 1, "gather")]
            return [Segment(self._pattern([r0] * len(others), others, 1.0 / n), 1, "scatter")]
        if algo == "ring":
            return self._ring(op, info, r0)
        if algo == "tree":
            return self._tree(op, info, r0)
        if algo == "rhd":
            return self._rhd(op, info, r0)
        return self._direct(op, info, r0)

    def _ring(self, op: Op, info: _GroupInfo, r0: int) -> list[Segment]:
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
            return [Segment(p, 1, "chain", depth=n - 1, lat=lat)]
        src = [r for o in info.channel_orders for r in o]
        dst = [r for o in info.channel_orders for r in o[1:] + o[:1]]
        p = self._pattern(src, dst, 1.0 / (n * c))
        if op is Op.ALL_REDUCE:
            return [Segment(p, n - 1, "reduce-scatter"), Segment(p, n - 1, "all-gather")]
        return [Segment(p, n - 1, "reduce-scatter" if op is Op.REDUCE_SCATTER else "all-gather")]

    def _tree(self, op: Op, info: _GroupInfo, r0: int) -> list[Segment]:
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
            return [Segment(p, 1, "tree reduce+broadcast", depth=2 * d, lat=lat)]
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
            return [Segment(p, 1, "tree", depth=d, lat=lat)]
        return self._ring(op, info, r0)

    def _exchange(self, q: list[int], dist: int, w: float, label: str) -> Segment:
        src = q
        dst = [q[i ^ dist] for i in range(len(q))]
        return Segment(self._pattern(src, dst, w), 1, label)

    def _rhd(self, op: Op, info: _GroupInfo, r0: int) -> list[Segment]:
        n, order = info.n, info.order
        if op is Op.ALL_TO_ALL:
            if n & (n - 1) == 0:
                return [
                    Segment(self._pattern(order, [order[i ^ k] for i in range(n)], 1.0 / n), 1, f"pairwise {k}")
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
                segs.append(Segment(self._pattern(*zip(*pairs), 1.0), 1, f"binomial {k}"))
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
            segs.append(Segment(self._pattern(folded, keep, pre_w), 1, "fold"))
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
            segs.append(Segment(self._pattern(keep, folded, post_w), 1, "unfold"))
        return segs

    def _shift_exchange(self, order: list[int], n: int) -> list[Segment]:
        return [
            Segment(self._pattern(order, order[k:] + order[:k], 1.0 / n), 1, f"exchange {k}/{n - 1}")
            for k in range(1, n)
        ]

    def _direct(self, op: Op, info: _GroupInfo, r0: int) -> list[Segment]:
        n, order = info.n, info.order
        if op in (Op.BROADCAST, Op.REDUCE):
            others = [r for r in order if r != r0]
            ends = (others, [r0] * len(others)) if op is Op.REDUCE else ([r0] * len(others), others)
            return [Segment(self._pattern(*ends, 1.0), 1, "direct")]
        a = np.asarray(order, dtype=np.int64)
        src = np.repeat(a, n)
        dst = np.tile(a, n)
        off = src != dst
        p = self._pattern(src[off], dst[off], 1.0 / n)
        if op is Op.ALL_REDUCE:
            return [Segment(p, 1, "direct reduce-scatter"), Segment(p, 1, "direct all-gather")]
        return [Segment(p, 1, "direct")]
