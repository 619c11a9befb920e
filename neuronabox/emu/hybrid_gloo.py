"""The hybrid collectives' data rules on CPU tensors: each op under mirror semantics, over the real members' gloo group.

``hybrid.py`` holds the groups, their timing and their work objects; this module what the real
members run for each op so that every member ends with the data the whole group's op would give
(the mirror map in ``hybrid.py``'s docstring). ``hybrid_cuda.py`` reuses its reduction helpers for NCCL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from ..collectives import Op
from ..model.base import Group
from .mirror import fit_copy, reduce_inplace, split_offsets, tensor_bytes

if TYPE_CHECKING:
    from .hybrid import HybridGroup, HybridWork

__all__ = ["GlooRules"]

_RedOp = dist.ReduceOp.RedOpType
_P2P_META_TAG = 0x3FFF0000  # gloo tags of the p2p metas, far from any tag a script uses


def _base_op(op) -> "dist.ReduceOp":
    """The reduction the real ranks run after each one pre-reduced its own copies."""
    kind = op.op
    if kind in (_RedOp.SUM, _RedOp.AVG, _RedOp.PREMUL_SUM):
        return dist.ReduceOp.SUM
    return dist.ReduceOp(kind)


def _pre_reduce(t: torch.Tensor, op, c: int, n: int) -> bool:
    """Fold this real rank's ``c`` mirrored copies into ``t``; returns whether an integer AVG still needs ``// n``."""
    if op.op == _RedOp.AVG:
        if t.is_floating_point() or t.is_complex():
            t.mul_(c / n)
            return False
        if c != 1:
            t.mul_(c)
        return True
    if op.op == _RedOp.SUM and t.dtype == torch.bool:
        return False
    reduce_inplace(t, op, c)
    return False


def _copy_back(fixups: list, n: int) -> Callable[[], None] | None:
    """The post step of a reduction that ran in scratch buffers: finish AVG's division, copy into the caller's tensors."""
    if not fixups:
        return None

    def post():
        for t, buf, divide in fixups:
            if divide:
                buf.div_(n, rounding_mode="trunc")
            if buf is not t:
                t.copy_(buf)

    return post


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _opts(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


class GlooRules:
    """The hybrid version of each collective on CPU tensors (the methods mirror ``NboxProcessGroup``'s)."""

    def __init__(self, g: HybridGroup):
        self.g = g

    def allreduce(self, pg, tensors, op) -> HybridWork:
        """Each real member folds in its mirrored copies, then the real members all-reduce among themselves."""
        g = self.g
        h = g.start(pg.timeline, Op.ALL_REDUCE, tensor_bytes(tensors), 0, tensors)
        c, base = g.counts[g.me], _base_op(op)
        works, fixups = [], []
        with torch.no_grad():
            for t in tensors:
                buf = _contig(t)
                divide = _pre_reduce(buf, op, c, g.n)
                works.append(g.data.allreduce([buf], _opts(dist.AllreduceOptions, reduceOp=base)))
                if buf is not t or divide:
                    fixups.append((t, buf, divide))

        return g.finish(h, works, _copy_back(fixups, g.n))

    def broadcast(self, pg, tensors, root: int) -> HybridWork:
        """From the root, or from the real member an emulated root mirrors."""
        g = self.g
        h, agreed = g.rooted(pg.timeline, Op.BROADCAST, tensor_bytes(tensors), root, tensors)
        if agreed is None:
            return g.finish(h, [])
        rr = g.mirror[agreed]  # an emulated root holds what its mirror holds
        works, fixups = [], []
        for t in tensors:
            buf = _contig(t)
            works.append(g.data.broadcast([buf], _opts(dist.BroadcastOptions, rootRank=rr, rootTensor=0)))
            if buf is not t:
                fixups.append((t, buf))
        return g.finish(h, works, (lambda: [t.copy_(b) for t, b in fixups]) if fixups else None)

    def reduce(self, pg, tensors, op, root: int) -> HybridWork:
        """Like all-reduce, into the root's buffer only (an emulated root's mirror reduces a scratch copy)."""
        g = self.g
        h, agreed = g.rooted(pg.timeline, Op.REDUCE, tensor_bytes(tensors), root, tensors)
        if agreed is None:
            with torch.no_grad():
                for t in tensors:
                    reduce_inplace(t, op, g.n)
            return g.finish(h, [])
        rr, at_root = g.mirror[agreed], agreed == g.members[g.me]
        c, base = g.counts[g.me], _base_op(op)
        works, fixups = [], []
        with torch.no_grad():
            for t in tensors:
                # Only a real root's buffer changes; the others (and an emulated root's mirror) reduce a scratch copy.
                buf = _contig(t) if at_root else t.detach().clone(memory_format=torch.contiguous_format)
                divide = _pre_reduce(buf, op, c, g.n)
                works.append(g.data.reduce([buf], _opts(dist.ReduceOptions, rootRank=rr, rootTensor=0, reduceOp=base)))
                if at_root and (buf is not t or divide):
                    fixups.append((t, buf, divide))

        return g.finish(h, works, _copy_back(fixups, g.n))

    def allgather(self, pg, output_lists, inputs, coalesced: bool) -> HybridWork:
        """``coalesced``: output_lists[i][j] is member i's input j (else output_lists[t][j] is member j's input t)."""
        g = self.g
        outs_flat = [o for outs in output_lists for o in outs]
        h = g.start(pg.timeline, Op.ALL_GATHER, tensor_bytes(outs_flat), 0, output_lists)
        bufs, works = [], []
        for x in inputs:
            buf = x.new_empty((g.k,) + tuple(x.shape))
            works.append(g.data._allgather_base(buf.view(-1), _contig(x).view(-1)))
            bufs.append(buf)

        def post():
            for t, buf in enumerate(bufs):
                for j in range(g.n):
                    dst = output_lists[j][t] if coalesced else output_lists[t][j]
                    dst.copy_(buf[g.mirror[j]])

        return g.finish(h, works, post)

    def all_gather_single(self, pg, outputs, inputs) -> HybridWork:
        """The real members' inputs gathered; each member's row is its mirror's."""
        g = self.g
        h = g.start(pg.timeline, Op.ALL_GATHER, tensor_bytes(outputs), 0, list(outputs))
        bufs, works = [], []
        for x in inputs:
            buf = x.new_empty((g.k, x.numel()))
            works.append(g.data._allgather_base(buf.view(-1), _contig(x).view(-1)))
            bufs.append(buf)

        def post():
            for out, buf in zip(outputs, bufs):
                rows = buf.index_select(0, g.mirror_index(buf.device))
                if out.is_contiguous():
                    out.view(g.n, -1).copy_(rows)
                else:
                    out.copy_(rows.reshape(out.shape))

        return g.finish(h, works, post)

    def _reduce_scatter(self, pg, outputs, stacks, nbytes: int, op) -> HybridWork:
        # stacks[t]: this rank's k chunks (one per real member, in order), already copied; reduced into outputs[t].
        g = self.g
        h = g.start(pg.timeline, Op.REDUCE_SCATTER, nbytes, 0, list(outputs))
        c, base = g.counts[g.me], _base_op(op)
        works, fixups = [], []
        with torch.no_grad():
            for y, stack in zip(outputs, stacks):
                divide = _pre_reduce(stack, op, c, g.n)
                # gloo's reduce-scatter has no future: all-reduce the k chunks and keep ours.
                works.append(g.data.allreduce([stack], _opts(dist.AllreduceOptions, reduceOp=base)))
                fixups.append((y, stack, divide))

        def post():
            for y, stack, divide in fixups:
                mine = stack[g.me]
                if divide:
                    mine = mine.div(g.n, rounding_mode="trunc")
                y.copy_(mine.reshape(y.shape))

        return g.finish(h, works, post)

    def reduce_scatter(self, pg, output_tensors, input_lists, op) -> HybridWork:
        """List form: the real members' chunks reduced; each keeps its own."""
        g = self.g
        ins_flat = [x for xs in input_lists for x in xs]
        with torch.no_grad():
            stacks = [torch.stack([xs[j].reshape(y.shape) for j in g.members])
                      for y, xs in zip(output_tensors, input_lists)]
        return self._reduce_scatter(pg, list(output_tensors), stacks, tensor_bytes(ins_flat), op)

    def reduce_scatter_single(self, pg, outputs, inputs, op) -> HybridWork:
        """Tensor form: the real members' chunks reduced; each keeps its own."""
        g = self.g
        with torch.no_grad():
            stacks = [x.reshape(g.n, -1).index_select(0, _members_index(g, x.device)) for x in inputs]
        return self._reduce_scatter(pg, list(outputs), stacks, tensor_bytes(inputs), op)

    def alltoall(self, pg, output_tensors, input_tensors) -> HybridWork:
        """List form: real members exchange their chunks; an emulated member's chunk comes from its mirror."""
        g = self.g
        h = g.start(pg.timeline, Op.ALL_TO_ALL, tensor_bytes(input_tensors), 0, list(output_tensors))
        send = torch.cat([input_tensors[j].reshape(-1) for j in g.members])
        in_splits = [input_tensors[j].numel() for j in g.members]
        out_splits = [output_tensors[j].numel() for j in g.members]
        recv = send.new_empty(sum(out_splits))
        works = [g.data.alltoall_base(recv, send, out_splits, in_splits, dist.AllToAllOptions())]

        def post():
            chunks = recv.split(out_splits)
            for j, o in enumerate(output_tensors):
                fit_copy(o, chunks[g.mirror[j]])

        return g.finish(h, works, post)

    def all_to_all_single(self, pg, output, input, output_split_sizes, input_split_sizes) -> HybridWork:  # noqa: A002
        """Tensor form with split sizes: as ``alltoall``."""
        g = self.g
        n = g.n
        h = g.start(pg.timeline, Op.ALL_TO_ALL, tensor_bytes([input]), 0, [output])
        in_splits, in_off = split_offsets(input.shape[0], input_split_sizes, n)
        out_splits, out_off = split_offsets(output.shape[0], output_split_sizes, n)
        in_row = input[0].numel() if input.shape[0] else max(1, input.numel())
        out_row = output[0].numel() if output.shape[0] else max(1, output.numel())
        send = torch.cat([input.narrow(0, in_off[j], in_splits[j]).reshape(-1) for j in g.members])
        send_counts = [in_splits[j] * in_row for j in g.members]
        recv_counts = [out_splits[j] * out_row for j in g.members]
        recv = send.new_empty(sum(recv_counts))
        works = [g.data.alltoall_base(recv, send, recv_counts, send_counts, dist.AllToAllOptions())]

        def post():
            chunks = recv.split(recv_counts)
            for j in range(n):
                fit_copy(output.narrow(0, out_off[j], out_splits[j]), chunks[g.mirror[j]])

        return g.finish(h, works, post)

    def gather(self, pg, output_tensors, input_tensors, root: int) -> HybridWork:
        """To the root (or its mirror, which keeps nothing): each member's slot holds its mirror's input."""
        g = self.g
        h, agreed = g.rooted(pg.timeline, Op.GATHER, g.n * tensor_bytes(input_tensors), root, output_tensors)
        me_group = g.members[g.me]
        if agreed is None:
            with torch.no_grad():
                for outs, x in zip(output_tensors, input_tensors):
                    for o in outs:
                        if o.data_ptr() != x.data_ptr():
                            o.copy_(x)
            return g.finish(h, [])
        rr = g.mirror[agreed]
        works, bufs = [], []
        for x in input_tensors:
            xc = _contig(x)
            if rr == g.me:
                buf = [torch.empty_like(xc) for _ in range(g.k)]
                works.append(g.data.gather([buf], [xc], _opts(dist.GatherOptions, rootRank=rr)))
                bufs.append(buf)
            else:
                works.append(g.data.gather([], [xc], _opts(dist.GatherOptions, rootRank=rr)))

        def post():
            if agreed != me_group:  # an emulated root's mirror received for nobody
                return
            for outs, buf in zip(output_tensors, bufs):
                for j, o in enumerate(outs):
                    o.copy_(buf[g.mirror[j]])

        return g.finish(h, works, post)

    def scatter(self, pg, output_tensors, input_tensors, root: int) -> HybridWork:
        """From a real root's list to the real members; an emulated root's list is held by nobody."""
        g = self.g
        h, agreed = g.rooted(pg.timeline, Op.SCATTER, g.n * tensor_bytes(output_tensors), root, list(output_tensors))
        me_group = g.members[g.me]
        if agreed is None:  # every real rank its own root: the single-real rule, keep our slot
            with torch.no_grad():
                for y, xs in zip(output_tensors, input_tensors):
                    if y.data_ptr() != xs[me_group].data_ptr():
                        y.copy_(xs[me_group])
            return g.finish(h, [])
        if agreed not in g.members:  # an emulated root's list is held by no real rank: outputs stay as they are
            return g.finish(h, [])
        rr = g.mirror[agreed]
        works, fixups = [], []
        for t, y in enumerate(output_tensors):
            buf = _contig(y)
            lists = [[_contig(input_tensors[t][j]) for j in g.members]] if agreed == me_group else []
            works.append(g.data.scatter([buf], lists, _opts(dist.ScatterOptions, rootRank=rr)))
            if buf is not y:
                fixups.append((y, buf))
        return g.finish(h, works, (lambda: [y.copy_(b) for y, b in fixups]) if fixups else None)

    def barrier(self, pg) -> HybridWork:
        """No data: the timeline alone (every real member completes at the modeled end)."""
        g = self.g
        return g.finish(g.start(pg.timeline, Op.BARRIER, 0, 0, []), [])

    def p2p(self, pg, tensors, peer: int, send: bool, tag: int) -> HybridWork:
        """send/recv between two real members: real bytes over gloo, one FIFO timeline per direction."""
        g = self.g
        me_group = g.members[g.me]
        src, dst = (me_group, peer) if send else (peer, me_group)
        tl = g._p2p.get((src, dst))
        if tl is None:
            a, b = pg.global_ranks[src], pg.global_ranks[dst]
            tl = g._p2p[(src, dst)] = pg._emu.new_timeline(Group(sorted((a, b))), kind="p2p")
        root = 0 if pg.global_ranks[src] < pg.global_ranks[dst] else 1
        peer_r = g.mirror[peer]
        # Both metas of one op travel under the tag of its data direction, so the metas of a send
        # and of a recv between the same two ranks never match each other (nor the user's tags).
        h = g.start(tl, Op.SEND_RECV, tensor_bytes(tensors), root, tensors, p2p=(peer_r, _P2P_META_TAG + root))
        works, fixups = [], []
        for t in tensors:
            buf = _contig(t)
            if send:
                works.append(g.data.send([buf], peer_r, tag))
            else:
                works.append(g.data.recv([buf], peer_r, tag))
                if buf is not t:
                    fixups.append((t, buf))
        work = g.finish(h, works, (lambda: [t.copy_(b) for t, b in fixups]) if fixups else None)
        work._source = peer
        return work


def _members_index(g: HybridGroup, device: torch.device) -> torch.Tensor:
    return torch.tensor(g.members, dtype=torch.long, device=device)
