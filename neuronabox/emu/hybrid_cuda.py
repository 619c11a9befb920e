"""Hybrid collectives on CUDA tensors: NCCL among the real ranks, device-side timing (UNTESTED: CI has no GPU).

Everything runs on the communicator's own stream, in stream order, with no host thread and
no CPU block (DESIGN.md, "Timing semantics"):

1. the stream waits for the caller's stream (inputs ready);
2. a one-thread kernel stamps this rank's arrival (``%globaltimer`` mapped to the host clock
   shared by the real ranks, plus the straggler delay) into a one-element int64 tensor;
3. NCCL all-reduces that stamp with MAX: every real rank now holds the latest arrival;
4. the data op(s) run on NCCL among the real ranks (the mirror rules of hybrid.py: each rank
   pre-reduces its own copies, the emulated chunks are filled from their mirrors afterwards);
5. a timed-wait kernel spins until latest arrival + the model's duration for the whole group
   and stamps start and end for ``cuda_wait.resolve``;
6. an event recorded after it is what ``Work.wait()`` makes the caller's stream wait on.

Step 5 starts after the real transfer (stream order), so completion is never earlier than the
transfer, and FIFO holds because step 2 of op i runs after step 5 of op i-1. Supported on
CUDA: all_reduce, broadcast, all_gather (list and into tensor), reduce_scatter_tensor, barrier;
the others raise ``UnsupportedCollective``.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..collectives import Op
from . import cuda_wait
from .hybrid_gloo import _base_op, _opts, _pre_reduce
from .mirror import UnsupportedCollective, tensor_bytes
from .work import NboxWork

if TYPE_CHECKING:
    from .hybrid import HybridGroup

__all__ = ["NcclRules"]

_kernels = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["bias"])
    def _arrive(out, bias):
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(out, now + bias.to(tl.int64))

    @triton.jit(do_not_specialize=["slot", "back", "wait_ns", "lead_ns"])
    def _until(arrival, stamps, slot, back, wait_ns, lead_ns):
        deadline = tl.load(arrival) + back.to(tl.int64) + wait_ns.to(tl.int64)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        while now < deadline:
            now = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
        tl.store(stamps + 2 * slot, deadline - lead_ns.to(tl.int64))
        tl.store(stamps + 2 * slot + 1, now)

    return _arrive, _until


def _get_kernels():
    global _kernels
    if _kernels is None:
        _kernels = _build()
    return _kernels


class NcclRules:
    """The hybrid ops of one group on CUDA tensors."""

    def __init__(self, g: HybridGroup):
        if not cuda_wait.available():
            why = cuda_wait.why_unavailable()
            raise UnsupportedCollective(f"nbox: hybrid CUDA collectives need device-side waits ({why})")
        self.g = g
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=g.ctx.timeout)
        store = dist.PrefixStore(f"{g.key}/nccl/", g.ctx.store)
        self.pg = dist.ProcessGroupNCCL(store, g.me, g.k, opts)
        self._streams: dict[tuple[int, torch.device], torch.cuda.Stream] = {}

    def _run(self, pg, op: Op, nbytes: int, root: int, tensors, data, post, result) -> NboxWork:
        g, tl = self.g, pg.timeline
        device = tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        rec = tl.schedule_device(op, nbytes, str(device), root)
        dc = cuda_wait._device_clock(device)
        recorder = tl.recorder
        if id(recorder) not in cuda_wait._recorders_hooked:
            cuda_wait._recorders_hooked.add(id(recorder))
            recorder.resolvers.append(lambda: cuda_wait.resolve(recorder))
            recorder.iteration_listeners.append(lambda index: cuda_wait._mark_on_device(recorder, index))
        stream = self._streams.get((id(tl), device))
        if stream is None:
            stream = self._streams[(id(tl), device)] = torch.cuda.Stream(device=device)
        arrive, until = _get_kernels()
        buf, slot = dc.take()
        shared_ns = int(round(g.shared_offset * 1e9))
        extra_ns = int(round(rec.extra * 1e9))
        duration_ns = int(round(rec.duration * 1e9))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stamp = torch.empty(1, dtype=torch.int64, device=device)
            arrive[(1,)](stamp, shared_ns - dc.offset_ns + extra_ns, num_warps=1)
            self.pg.allreduce([stamp], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.MAX)).wait()
            with torch.no_grad():
                for w in data():
                    w.wait()  # NCCL: the current (comm) stream waits, the CPU does not
                if post is not None:
                    post()
            until[(1,)](stamp, buf, slot, dc.offset_ns - shared_ns, duration_ns, duration_ns + extra_ns, num_warps=1)
            event = torch.cuda.Event()
            event.record(stream)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(stream)
        rec.device_slot = (dc, buf, slot)
        dc.pending.append(rec)
        return NboxWork(rec, result, g.ctx.emu, event, device)

    def allreduce(self, pg, tensors, op):
        """On the device stream: each real member folds in its mirrored copies, then NCCL all-reduces the real ones."""
        g = self.g
        c, base = g.counts[g.me], _base_op(op)

        def data():
            works = []
            for t in tensors:
                if _pre_reduce(t, op, c, g.n):
                    raise UnsupportedCollective("nbox: integer AVG on CUDA in hybrid groups is not supported")
                works.append(self.pg.allreduce([t], _opts(dist.AllreduceOptions, reduceOp=base)))
            return works

        return self._run(pg, Op.ALL_REDUCE, tensor_bytes(tensors), 0, tensors, data, None, tensors)

    def broadcast(self, pg, tensors, root: int):
        """From the root, or from the real member an emulated root mirrors."""
        rr = self.g.mirror[root]

        def data():
            return [self.pg.broadcast([t], _opts(dist.BroadcastOptions, rootRank=rr, rootTensor=0)) for t in tensors]

        return self._run(pg, Op.BROADCAST, tensor_bytes(tensors), root, tensors, data, None, tensors)

    def _gather_rows(self, inputs):
        g = self.g
        bufs = [x.new_empty((g.k, x.numel())) for x in inputs]

        def data():
            return [self.pg._allgather_base(b.view(-1), x.contiguous().view(-1)) for b, x in zip(bufs, inputs)]

        return bufs, data

    def all_gather_single(self, pg, outputs, inputs):
        """The real members' inputs gathered; each member's row is its mirror's."""
        g = self.g
        bufs, data = self._gather_rows(inputs)

        def post():
            for out, b in zip(outputs, bufs):
                rows = b.index_select(0, g.mirror_index(b.device))
                out.copy_(rows.reshape(out.shape))

        tensors = list(outputs) + list(inputs)
        return self._run(pg, Op.ALL_GATHER, tensor_bytes(outputs), 0, tensors, data, post, list(outputs))

    def allgather(self, pg, output_lists, inputs, coalesced: bool):
        """List form of ``all_gather_single``."""
        g = self.g
        bufs, data = self._gather_rows(inputs)

        def post():
            for t, b in enumerate(bufs):
                for j in range(g.n):
                    dst = output_lists[j][t] if coalesced else output_lists[t][j]
                    dst.copy_(b[g.mirror[j]].reshape(dst.shape))

        outs = [o for outs in output_lists for o in outs]
        return self._run(pg, Op.ALL_GATHER, tensor_bytes(outs), 0, outs + list(inputs), data, post, output_lists)

    def reduce_scatter_single(self, pg, outputs, inputs, op):
        """The real members' chunks reduced; each keeps its own."""
        g = self.g
        c, base = g.counts[g.me], _base_op(op)
        members = torch.tensor(g.members, dtype=torch.long, device=inputs[0].device)
        stacks = []

        def data():
            works = []
            for y, x in zip(outputs, inputs):
                stack = x.reshape(g.n, -1).index_select(0, members)
                if _pre_reduce(stack, op, c, g.n):
                    raise UnsupportedCollective("nbox: integer AVG on CUDA in hybrid groups is not supported")
                stacks.append(stack)
                works.append(self.pg.allreduce([stack], _opts(dist.AllreduceOptions, reduceOp=base)))
            return works

        def post():
            for y, stack in zip(outputs, stacks):
                y.copy_(stack[g.me].reshape(y.shape))

        return self._run(pg, Op.REDUCE_SCATTER, tensor_bytes(inputs), 0, list(outputs) + list(inputs), data, post,
                         list(outputs))

    def barrier(self, pg):
        """No data: the timeline alone."""
        return self._run(pg, Op.BARRIER, 0, 0, [], lambda: [], None, [])

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def unsupported(*args, **kwargs):
            raise UnsupportedCollective(f"nbox: {name} on CUDA tensors in a group of several real ranks is not "
                                        "supported yet (all_reduce, broadcast, all_gather, reduce_scatter_tensor, "
                                        "barrier are); use CPU tensors or one real rank per group")

        return unsupported
