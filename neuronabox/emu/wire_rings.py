"""The ring algorithms a wire lane runs: all-reduce, reduce-scatter, all-gather, broadcast, barrier.

Each runs the real rank's part of the ring over a lane's session with the stubs (``wire.py``):
it announces to the previous rank's stub when that stub's frames may leave (the model's
schedule), sends its own frames to the next rank's stub as the ring's data dependencies allow,
and folds the received bytes in. Mirror semantics (every emulated rank holds the real rank's
input) make a reduce-scatter partial at ring step k stand for k+1 identical contributions,
reduced with that multiplicity; all-gather phases apply the n-fold reduction.

``RingRuns`` is a base of ``WireClient``: it uses the lane's ring geometry (``_ring``,
``_peer``, ``_node``), its schedule (``_times``), its frames (``_announce``, ``_recv_frame``,
``_sent``, ``_deadline``) and its arena (``_publish``, ``_scratch``).
"""

from __future__ import annotations

from ..wireproto import FRAME, SLICE
from .wire_peer import byte_view

__all__ = ["RingRuns"]


class RingRuns:
    """The ring collectives of one wire lane (mixed into ``WireClient``)."""

    def _neighbours(self, pg):
        order, me, prev, nxt = self._ring(pg)
        pp, pn = self._peer(self._node(prev)), self._peer(self._node(nxt))
        return order, me, prev, nxt, pp, pn

    def _t0(self, job) -> float:
        # The emulated ranks reach the op with us, or later by the straggler delay.
        return job.t0 + job.rec.extra

    def _pipeline(self, job, pg, chunks: list, arena_off, first: int, nsteps: int, receive) -> None:
        """A ring of ``nsteps`` steps over ``chunks`` (1-D tensors by chunk index), pipelined in slices.

        Step k receives chunk ``recv(k)`` from the previous rank and forwards it, once
        ``receive`` has stored it, as step k+1 to the next rank (in a ring the chunk received at
        step k is the one sent at step k+1); step 0 sends chunk ``first``. Slices (``SLICE``
        bytes) let step k+1 start before step k has fully arrived, as NCCL's ring does.
        """
        order, me, prev, nxt, pp, pn = self._neighbours(pg)
        n = len(order)
        esize = chunks[first].element_size()
        J = max(1, -(-max(c.numel() for c in chunks) * esize // SLICE))

        def parts(c: int) -> list[tuple[int, int]]:
            m = chunks[c].numel()
            return [(m * j // J, m * (j + 1) // J) for j in range(J)]

        def recv_idx(k: int) -> int:
            return order[(me - 1 - k) % n] if first == order[me] else order[(me - 2 - k) % n]

        offs = self._times(job.tl, job.rec.op, job.rec.nbytes, 0, prev, pg.global_ranks[pg.rank()], nsteps, job.rec)
        two = pp is pn
        t0 = self._t0(job)
        sends = []
        for k in range(nsteps):
            c = recv_idx(k)
            for j, (lo, hi) in enumerate(parts(c)):
                # A 2-rank ring: the stub is also our next rank, whose slice j of step k is what
                # it got from us at step k-1.
                sends.append([t0 + offs[k], k * J + j, arena_off(c) + lo * esize, (hi - lo) * esize,
                              (k - 1) * J + j if two and k else -1])
        self._announce(job, pp, sends)
        seq, sender = job.seq, pn.sender
        tickets: dict[tuple[int, int], int] = {}
        for j, (lo, hi) in enumerate(parts(first)):
            tickets[(first, j)] = sender.put(FRAME.pack(seq, j, (hi - lo) * esize), byte_view(chunks[first][lo:hi]))
        for k in range(nsteps):
            c = recv_idx(k)
            for j, (lo, hi) in enumerate(parts(c)):
                dst = chunks[c][lo:hi]
                sender.wait(tickets.get((c, j), 0), self._deadline)  # an earlier send of this slice must have left
                receive(k, dst, lambda buf: self._recv_frame(pp, seq, k * J + j, buf))
                if k + 1 < nsteps:
                    tickets[(c, j)] = sender.put(FRAME.pack(seq, (k + 1) * J + j, (hi - lo) * esize), byte_view(dst))
        self._sent(pn)

    def _ring_reduce(self, job, pg, chunks: list, redop, allgather: bool, arena_off) -> None:
        """Ring reduce-scatter (then all-gather) over ``chunks``, reducing the received bytes for real."""
        import torch
        import torch.distributed as dist

        R = dist.ReduceOp.RedOpType
        kind = redop.op if hasattr(redop, "op") else redop
        n = pg.size()
        tmp_all = self._scratch(max(c.numel() for c in chunks) * chunks[0].element_size())

        def receive(k: int, dst, frame) -> None:
            tmp = tmp_all[: dst.numel() * dst.element_size()].view(dst.dtype)
            frame(byte_view(tmp))
            if k < n - 1:  # reduce-scatter: the previous rank's partial stands for k+1 inputs equal to ours
                m = k + 1
                if kind in (R.SUM, R.AVG):
                    dst.add_(tmp, alpha=m)
                elif kind == R.MAX:
                    torch.maximum(dst, tmp, out=dst)
                elif kind == R.MIN:
                    torch.minimum(dst, tmp, out=dst)
                else:  # PRODUCT
                    dst.mul_(tmp.pow(m))
                if k == n - 2 and kind == R.AVG:
                    dst.div_(n)
            elif kind == R.SUM:  # all-gather: a finished chunk, the n-fold reduction of its input
                torch.mul(tmp, n, out=dst)
            elif kind == R.PRODUCT:
                torch.pow(tmp, n, out=dst)
            else:  # AVG, MAX, MIN of n equal values
                dst.copy_(tmp)

        order, me = self._ring(pg)[:2]
        first = order[(me - 1) % n]
        self._pipeline(job, pg, chunks, arena_off, first, (n - 1) * (2 if allgather else 1), receive)

    def _run_allreduce(self, job, pg, tensors, redop) -> None:
        import torch

        single = len(tensors) == 1 and tensors[0].is_contiguous()
        acc = tensors[0].view(-1) if single else torch.cat([t.reshape(-1) for t in tensors])
        n, e, es = pg.size(), acc.numel(), acc.element_size()
        self._publish(acc.view(torch.uint8) if e else acc)
        bounds = [e * i // n for i in range(n + 1)]
        chunks = [acc[bounds[c] : bounds[c + 1]] for c in range(n)]
        self._ring_reduce(job, pg, chunks, redop, True, lambda c: bounds[c] * es)
        if not single:
            pos = 0
            for t in tensors:
                t.copy_(acc[pos : pos + t.numel()].view(t.shape))
                pos += t.numel()

    def _run_reduce_scatter(self, job, pg, output, ins, redop) -> None:
        import torch

        acc = torch.cat([t.reshape(-1) for t in ins]) if len(ins) > 1 else ins[0].reshape(-1).clone()
        n, m, es = pg.size(), output.numel(), acc.element_size()
        self._publish(acc.view(torch.uint8))
        chunks = [acc[c * m : (c + 1) * m] for c in range(n)]
        self._ring_reduce(job, pg, chunks, redop, False, lambda c: c * m * es)
        output.copy_(chunks[pg.rank()].view(output.shape))

    def _run_all_gather(self, job, pg, outs, inp) -> None:
        import torch

        n = pg.size()
        if len(outs) == 1:
            if not outs[0].is_contiguous():
                raise RuntimeError("nbox wire: all_gather into a non-contiguous tensor")
            flat, m = outs[0].view(-1), inp.numel()
            chunks = [flat[i * m : (i + 1) * m] for i in range(n)]
        else:
            if not all(o.is_contiguous() for o in outs):
                raise RuntimeError("nbox wire: all_gather into non-contiguous tensors")
            chunks = [o.view(-1) for o in outs]
        src = inp.reshape(-1).contiguous()
        self._publish(src.view(torch.uint8))
        mine = chunks[pg.rank()]
        if mine.data_ptr() != src.data_ptr():
            mine.copy_(src)
        # Every peer's chunk is its input, which mirror semantics says equals ours: arena offset 0.
        self._pipeline(job, pg, chunks, lambda c: 0, pg.rank(), n - 1, lambda k, dst, frame: frame(byte_view(dst)))

    def _run_broadcast(self, job, pg, tensors, root: int) -> None:
        import torch

        order, me, prev, nxt, pp, pn = self._neighbours(pg)
        n = len(order)
        single = len(tensors) == 1 and tensors[0].is_contiguous()
        buf = tensors[0].view(-1) if single else torch.cat([t.reshape(-1) for t in tensors])
        raw = buf.view(torch.uint8) if buf.numel() else torch.empty(0, dtype=torch.uint8)
        size = raw.numel()
        slices = [(i, min(i + SLICE, size)) for i in range(0, size, SLICE)] or [(0, 0)]
        hop = (me - order.index(root)) % n  # our place in the chain from the root
        mv = byte_view(raw)
        if hop > 0:
            # The previous rank forwards the root's data, which mirror semantics says is ours.
            self._publish(raw)
            offs = self._times(job.tl, job.rec.op, job.rec.nbytes, root, prev, pg.global_ranks[pg.rank()], 1, job.rec)
            t = self._t0(job) + offs[0]
            self._announce(job, pp, [[t, j, lo, hi - lo, -1] for j, (lo, hi) in enumerate(slices)])
        for j, (lo, hi) in enumerate(slices):
            if hop > 0:
                self._recv_frame(pp, job.seq, j, mv[lo:hi])
            if hop < n - 1:
                pn.sender.put(FRAME.pack(job.seq, j, hi - lo), mv[lo:hi])
        if hop < n - 1:
            self._sent(pn)
        if not single:
            pos = 0
            for t in tensors:
                t.copy_(buf[pos : pos + t.numel()].view(t.shape))
                pos += t.numel()

    def _run_barrier(self, job, pg) -> None:
        order, me, prev, nxt, pp, pn = self._neighbours(pg)
        n = len(order)
        steps = 2 * (n - 1)
        offs = self._times(job.tl, job.rec.op, 0, 0, prev, pg.global_ranks[pg.rank()], steps, job.rec)
        two = pp is pn
        t0 = self._t0(job)
        self._announce(job, pp, [[t0 + offs[k], k, 0, 0, k - 1 if two and k else -1] for k in range(steps)])
        empty = memoryview(b"")
        for k in range(steps):
            pn.sender.put(FRAME.pack(job.seq, k, 0), None)
            self._recv_frame(pp, job.seq, k, empty)
        self._sent(pn)
