"""The ``nbox`` torch.distributed backend: a pure-Python ProcessGroup whose peers are emulated.

Each collective (1) applies the mirror data semantics of DESIGN.md (every emulated peer
holds the same data as the real rank: SUM all-reduce gives x*n, all-gather n copies, ...;
``mirror.py``), (2) is queued on its communicator's FIFO ``Timeline`` and (3) returns a
``Work`` that completes at the modeled finish time (``work.py``).

CPU tensors: the data is written at the call (a caller may read outputs only after
``wait()``, as with any backend); ``wait()`` sleeps until the finish time in the calling
thread; a future, when someone asks for one (DDP's reducer does), is completed by the single
``Waker`` thread at the finish time. CUDA tensors: ``cuda_wait`` enqueues a device-side timed
wait and the data operations on the communicator's stream; ``wait()`` makes the caller's
stream wait on an event, the CPU never blocks and no host thread is involved.

send/recv: a recv from an emulated peer yields a copy of the last tensor of the same shape,
dtype and device that the real rank sent to anyone in that group (mirror semantics: the
peer is at the same point of the same program and sent what we sent), else zeros.

Calls from C++ (DDP's reducer, ``_broadcast_coalesced``, functional collectives) reach
Python through the ProcessGroup trampoline (torch/csrc/distributed/c10d/PyProcessGroup.hpp),
which looks methods up by their torch 2.13 names: ``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single`` and the ``*_single_coalesced`` pair (it
falls back to the older ``allgather_into_tensor_coalesced`` / ``reduce_scatter_tensor_coalesced``
/ ``alltoall_base``). The older Python names (``_allgather_base``, ``_reduce_scatter_base``)
are kept as aliases for other torch versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from ..collectives import Op
from ..model.base import Group, rank_sequence
from . import cuda_wait, start_gate
from .group_table import TABLE
from .mirror import (UnsupportedCollective, fit_copy, no_grad_call, reduce_inplace, same_storage, split_offsets,
                     tensor_bytes)
from .timeline import Timeline, clock
from .work import FORCE_AFTER_S, GroupWork, NboxWork, ReplayedWork, done_work

if TYPE_CHECKING:
    from .emulator import Emulator

# NboxWork, ReplayedWork, FORCE_AFTER_S (work.py) and UnsupportedCollective (mirror.py) are named
# here too: the backend's face, as callers and tests have always imported them.
__all__ = [
    "BACKEND_NAME", "NboxProcessGroup", "NboxWork", "ReplayedWork", "register", "create_process_group",
    "UnsupportedCollective", "FORCE_AFTER_S",
]

BACKEND_NAME = "nbox"

_CPU = torch.device("cpu")
_warned_cuda_fallback = False


class NboxProcessGroup(dist.ProcessGroup):
    """A communicator whose other ranks are emulated: mirror data, modeled timing."""

    def __init__(self, rank: int, size: int, global_ranks: Sequence[int], emulator: Emulator):
        super().__init__(rank, size)
        if len(global_ranks) != size:
            raise ValueError(f"nbox: {size} ranks but {len(global_ranks)} global ranks")
        self._n = size
        self._me = rank
        self._emu = emulator
        self.global_ranks: tuple[int, ...] | range = rank_sequence(global_ranks)
        self.group = Group(self.global_ranks)
        self.timeline: Timeline = emulator.new_timeline(self.group)
        # Roles (roles.py): which group of the script this is, and whether its ops replay other roles.
        index = TABLE.creating if TABLE.creating is not None and TABLE.groups[TABLE.creating] == self.global_ranks \
            else TABLE.add(self.global_ranks)
        self.table_index = index
        me = self.global_ranks[rank]
        self.ordinal = TABLE.ordinal(index, me)
        replay = emulator.replay
        self._replay = replay if replay is not None and replay.involves_actor(self.global_ranks) else None
        self._record_roles = emulator.role_recorder
        self._p2p: dict[int, Timeline] = {}
        self._sent: dict[tuple, torch.Tensor] = {}
        self._coalescing: list[NboxWork] | None = None
        # Wire mode hook (neuronabox/emu/wire.py): when set, supported collectives move real bytes
        # to stub peers over the cluster's links; each method below asks it first (None: model mode).
        self._wire = getattr(emulator, "wire", None)
        # Hybrid hook (neuronabox/emu/hybrid.py): with two or more real members the real ranks run
        # each op among themselves; each method below hands it over first (None: one real member).
        hybrid = getattr(emulator, "hybrid", None)
        self._hybrid = hybrid.group_for(self.global_ranks, rank) if hybrid is not None else None

    # --- identity -------------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - the trampoline looks this name up
        """The backend's name."""
        return BACKEND_NAME

    # The C++ base keeps a group's name in its backends, which a Python group has none of
    # ("ProcessGroup name not set"); torch sets and reads them through these trampoline names.
    def setGroupName(self, name: str) -> None:  # noqa: N802
        """Called by torch when the group is registered."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        """The name torch registered the group under."""
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        """Called by torch when the group is registered."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        """The description torch gave the group."""
        return getattr(self, "_group_desc", "")

    def __repr__(self) -> str:
        return f"NboxProcessGroup(rank={self._me}, size={self._n}, {self.group!r})"

    # --- the common path ------------------------------------------------------------------------

    def _issue(
        self,
        op: Op,
        nbytes: int,
        tensors: Sequence[torch.Tensor],
        mirror: Callable[[], None] | None,
        result,
        root: int = 0,
        timeline: Timeline | None = None,
        source_rank: int = -1,
        peer: int = -1,
        send: bool = False,
    ) -> NboxWork:
        tl = timeline if timeline is not None else self.timeline
        device = tensors[0].device if tensors else _CPU
        if self._replay is not None and device.type == "cpu" and (peer < 0 or self._replay.involves_actor(
                (self.global_ranks[peer],))):
            return self._replayed(op, nbytes, root, tl, tensors, mirror, result, peer, send, source_rank)
        if self._wire is not None and self._n > 1:  # wire mode hook: this op has no wire path; say so once
            self._wire.fallback(op.value if device.type == "cpu" else f"{op.value} on {device.type}")
        if device.type == "cuda":
            if cuda_wait.available():
                rec = tl.schedule_device(op, nbytes, str(device), root)
                try:
                    event, _ = cuda_wait.issue(tl, rec, device, tensors, mirror)
                    return self._track(NboxWork(rec, result, self._emu, event, device, source_rank))
                except cuda_wait.DeviceWaitUnavailable:
                    self._emu.recorder.ops.remove(rec)  # scheduled again on the host below
            _cuda_fallback(device)
        rec = tl.schedule(op, nbytes, root)
        if self._record_roles is not None:
            self._record_roles.op(self.ordinal, op, nbytes, peer if peer >= 0 else root, send, rec, tensors)
        if mirror is not None:
            no_grad_call(mirror)
        return self._track(NboxWork(rec, result, self._emu, source_rank=source_rank))

    def _replayed(self, op, nbytes, root, tl, tensors, mirror, result, peer, send, source_rank) -> NboxWork:
        # An op shared with a rank of another role: it starts when that rank's recorded program gets there.
        now = clock()
        rec = tl._record(op, nbytes, root, now)
        rec.ready = now
        self._emu.recorder.add(rec)
        inst = self._replay.real_op(self.table_index, op, rec, self.global_ranks[peer] if peer >= 0 else -1, send)
        if self._record_roles is not None:  # a profiling run replaying the roles recorded before this one
            self._record_roles.op(self.ordinal, op, nbytes, peer if peer >= 0 else root, send, rec, tensors)
        if mirror is not None:
            no_grad_call(mirror)
        into = tensors if op is Op.SEND_RECV and not send else ()
        return self._track(ReplayedWork(rec, result, self._emu, inst, source_rank, into))

    def _real(self, tensor: torch.Tensor | None = None):
        """The hybrid rules for ``tensor``'s device (gloo for CPU, NCCL for CUDA)."""
        return self._hybrid.rules(tensor.device if tensor is not None else _CPU)

    @property
    def hybrid(self):
        """The real side of this group (hybrid.HybridGroup), or None when it holds one real rank."""
        return self._hybrid

    def _track(self, work: NboxWork) -> NboxWork:
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # --- all-reduce, broadcast, reduce ------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        """All-reduce: every peer holds the same tensor, so SUM gives x*n, AVG x, PRODUCT x**n."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        n = self._n
        if self._hybrid is not None:
            return self._track(self._real(tensors[0]).allreduce(self, tensors, op))
        if self._wire is not None and (w := self._wire.allreduce(self, tensors, op)) is not None:  # wire mode hook
            return self._track(w)

        def mirror():
            for t in tensors:
                reduce_inplace(t, op, n)

        return self._issue(Op.ALL_REDUCE, tensor_bytes(tensors), tensors, mirror, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        """Several all-reduces launched as one (NCCL groups them): one op of the total size."""
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        """Broadcast: the root's data equals ours, so the buffer stays as it is."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        root = opts.rootRank if opts is not None else 0
        if self._hybrid is not None:
            return self._track(self._real(tensors[0]).broadcast(self, tensors, root))
        if self._wire is not None and (w := self._wire.broadcast(self, tensors, root)) is not None:  # wire mode hook
            return self._track(w)
        return self._issue(Op.BROADCAST, tensor_bytes(tensors), tensors, None, tensors, root)

    def reduce(self, tensors, opts=None):
        """Reduce: on the real rank as root the result is the mirrored reduction; elsewhere the input is left."""
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if self._hybrid is not None:
            return self._track(self._real(tensors[0]).reduce(self, tensors, op, root))
        n = self._n
        mirror = None
        if root == self._me:

            def mirror():
                for t in tensors:
                    reduce_inplace(t, op, n)

        return self._issue(Op.REDUCE, tensor_bytes(tensors), tensors, mirror, tensors, root)

    # --- all-gather ---------------------------------------------------------------------------------

    def allgather(self, output_tensors, input_tensors, opts=None):
        """All-gather into lists: every output is a copy of the input."""
        if self._hybrid is not None:
            real = self._real(input_tensors[0])
            return self._track(real.allgather(self, output_tensors, input_tensors, coalesced=False))
        if self._wire is not None and len(input_tensors) == 1 and (  # wire mode hook
                w := self._wire.all_gather(self, output_tensors[0], input_tensors[0], result=output_tensors)
        ) is not None:
            return self._track(w)

        def mirror():
            for outs, x in zip(output_tensors, input_tensors):
                for o in outs:
                    if o.data_ptr() != x.data_ptr():
                        o.copy_(x)

        outs_flat = [o for outs in output_tensors for o in outs]
        return self._issue(Op.ALL_GATHER, tensor_bytes(outs_flat), outs_flat + list(input_tensors), mirror, output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """Coalesced all-gather of several tensors: output_lists[i][j] is rank i's input j."""
        if self._hybrid is not None:
            return self._track(self._real(input_list[0]).allgather(self, output_lists, input_list, coalesced=True))

        def mirror():
            for outs in output_lists:
                for o, x in zip(outs, input_list):
                    o.copy_(x)

        outs_flat = [o for outs in output_lists for o in outs]
        return self._issue(Op.ALL_GATHER, tensor_bytes(outs_flat), outs_flat + list(input_list), mirror, output_lists)

    def _gather_into(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        src = inp.clone() if same_storage(inp, output) else inp
        n = self._n
        if output.is_contiguous():
            output.view(n, -1).copy_(src.reshape(1, -1))
        else:
            output.copy_(src.reshape(1, -1).expand(n, -1).reshape(output.shape))

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        """All-gather into one tensor (``all_gather_into_tensor``): n copies of the input."""
        if self._hybrid is not None:
            return self._track(self._real(input).all_gather_single(self, [output], [input]))
        if self._wire is not None and (w := self._wire.all_gather(self, output, input)) is not None:  # wire mode hook
            return self._track(w)
        return self._issue(
            Op.ALL_GATHER, tensor_bytes([output]), [output, input], lambda: self._gather_into(output, input), [output]
        )

    _allgather_base = all_gather_single
    allgather_into_tensor = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """Several all-gathers into tensors launched as one."""
        if self._hybrid is not None:
            return self._track(self._real(inputs[0]).all_gather_single(self, list(outputs), list(inputs)))

        def mirror():
            for o, x in zip(outputs, inputs):
                self._gather_into(o, x)

        return self._issue(Op.ALL_GATHER, tensor_bytes(outputs), list(outputs) + list(inputs), mirror, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # --- reduce-scatter --------------------------------------------------------------------------

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """Reduce-scatter from lists: our chunk of every peer is our own chunk, reduced n times."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        n, me = self._n, self._me
        if self._hybrid is not None:
            return self._track(self._real(output_tensors[0]).reduce_scatter(self, output_tensors, input_tensors, op))
        if self._wire is not None and len(output_tensors) == 1 and (  # wire mode hook
                w := self._wire.reduce_scatter(self, output_tensors[0], list(input_tensors[0]), op,
                                               result=list(output_tensors))) is not None:
            return self._track(w)

        def mirror():
            for y, xs in zip(output_tensors, input_tensors):
                x = xs[me]
                if y.data_ptr() != x.data_ptr():
                    y.copy_(x)
                reduce_inplace(y, op, n)

        ins_flat = [x for xs in input_tensors for x in xs]
        return self._issue(
            Op.REDUCE_SCATTER, tensor_bytes(ins_flat), list(output_tensors) + ins_flat, mirror, list(output_tensors)
        )

    def _scatter_reduce_into(self, output: torch.Tensor, inp: torch.Tensor, op) -> None:
        chunk = inp.reshape(self._n, -1)[self._me]
        if same_storage(chunk, output):
            chunk = chunk.clone()
        output.copy_(chunk.reshape(output.shape))
        reduce_inplace(output, op, self._n)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        """Reduce-scatter of one tensor (``reduce_scatter_tensor``): our chunk, reduced n times."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if self._hybrid is not None:
            return self._track(self._real(input).reduce_scatter_single(self, [output], [input], op))
        # wire mode hook
        if self._wire is not None and (w := self._wire.reduce_scatter(self, output, input, op)) is not None:
            return self._track(w)
        return self._issue(
            Op.REDUCE_SCATTER,
            tensor_bytes([input]),
            [output, input],
            lambda: self._scatter_reduce_into(output, input, op),
            [output],
        )

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """Several reduce-scatters of tensors launched as one."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if self._hybrid is not None:
            return self._track(self._real(inputs[0]).reduce_scatter_single(self, list(outputs), list(inputs), op))

        def mirror():
            for o, x in zip(outputs, inputs):
                self._scatter_reduce_into(o, x, op)

        return self._issue(Op.REDUCE_SCATTER, tensor_bytes(inputs), list(outputs) + list(inputs), mirror, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # --- all-to-all ----------------------------------------------------------------------------------

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """All-to-all of lists: peer j sends us its chunk for us, which equals our chunk ``me``."""
        me = self._me
        if self._hybrid is not None:
            return self._track(self._real(input_tensors[0]).alltoall(self, output_tensors, input_tensors))

        def mirror():
            src = input_tensors[me]
            if any(same_storage(src, o) for o in output_tensors):
                src = src.clone()
            for o in output_tensors:
                fit_copy(o, src)

        return self._issue(
            Op.ALL_TO_ALL,
            tensor_bytes(input_tensors),
            list(output_tensors) + list(input_tensors),
            mirror,
            list(output_tensors),
        )

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        """All-to-all of one tensor (``all_to_all_single``), equal or given split sizes.

        Output chunk j is peer j's chunk for us, i.e. our input chunk ``me``; when the sizes
        differ (uneven splits) the common prefix is copied and the rest zeroed.
        """
        if self._hybrid is not None and input.dim():
            return self._track(
                self._real(input).all_to_all_single(self, output, input, output_split_sizes, input_split_sizes)
            )
        n, me = self._n, self._me
        in_splits, in_off = split_offsets(input.shape[0] if input.dim() else input.numel(), input_split_sizes, n)
        out_splits, out_off = split_offsets(output.shape[0] if output.dim() else output.numel(), output_split_sizes, n)

        def mirror():
            src = input.narrow(0, in_off[me], in_splits[me]) if input.dim() else input
            if same_storage(src, output):
                src = src.clone()
            for j in range(n):
                dst = output.narrow(0, out_off[j], out_splits[j]) if output.dim() else output
                fit_copy(dst, src)

        # Uneven splits: a rank receives another volume than it sends (an expert with many tokens); the
        # larger one bounds its time.
        nbytes = max(tensor_bytes([input]), tensor_bytes([output]))
        return self._issue(Op.ALL_TO_ALL, nbytes, [output, input], mirror, [output])

    alltoall_base = all_to_all_single

    # --- gather, scatter ----------------------------------------------------------------------------

    def gather(self, output_tensors, input_tensors, opts=None):
        """Gather: at the real rank as root every slot is a copy of the input."""
        root = opts.rootRank if opts is not None else 0
        if self._hybrid is not None:
            return self._track(self._real(input_tensors[0]).gather(self, output_tensors, input_tensors, root))
        mirror = None
        if root == self._me:

            def mirror():
                for outs, x in zip(output_tensors, input_tensors):
                    for o in outs:
                        if o.data_ptr() != x.data_ptr():
                            o.copy_(x)

        nbytes = self._n * tensor_bytes(input_tensors)
        outs_flat = [o for outs in output_tensors for o in outs]
        return self._issue(Op.GATHER, nbytes, list(input_tensors) + outs_flat, mirror, output_tensors, root)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Scatter: from the real rank it keeps our slot; from an emulated root the output stays as it is."""
        root = opts.rootRank if opts is not None else 0
        if self._hybrid is not None:
            return self._track(self._real(output_tensors[0]).scatter(self, output_tensors, input_tensors, root))
        me = self._me
        mirror = None
        if root == me and input_tensors:

            def mirror():
                for y, xs in zip(output_tensors, input_tensors):
                    if y.data_ptr() != xs[me].data_ptr():
                        y.copy_(xs[me])

        nbytes = self._n * tensor_bytes(output_tensors)
        ins_flat = [x for xs in input_tensors for x in xs]
        return self._issue(Op.SCATTER, nbytes, list(output_tensors) + ins_flat, mirror, list(output_tensors), root)

    # --- point to point ------------------------------------------------------------------------

    def _p2p_timeline(self, peer: int) -> Timeline:
        # NCCL runs p2p with a peer on its own stream, so each peer gets its own FIFO.
        tl = self._p2p.get(peer)
        if tl is None:
            a, b = self.global_ranks[self._me], self.global_ranks[peer]
            tl = self._p2p[peer] = self._emu.new_timeline(Group(sorted((a, b))), kind="p2p")
        return tl

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._n:
            raise ValueError(f"nbox: {what} peer {peer} is outside the group of {self._n} ranks")
        if peer == self._me:
            raise ValueError(f"nbox: {what} to itself (rank {peer})")

    def send(self, tensors, dst_rank, tag=0):
        """Send to an emulated peer; a copy is kept as what a later recv of that shape yields."""
        self._check_peer(dst_rank, "send")
        if self._hybrid is not None and dst_rank in self._hybrid.member_set:
            return self._track(self._real(tensors[0]).p2p(self, tensors, dst_rank, True, tag))
        with torch.no_grad():
            for t in tensors:
                key = (tuple(t.shape), t.dtype, t.device)
                if key not in self._sent and len(self._sent) >= 256:
                    self._sent.pop(next(iter(self._sent)))
                self._sent[key] = t.detach().clone()
        tl = self._p2p_timeline(dst_rank)
        root = 0 if self.global_ranks[self._me] < self.global_ranks[dst_rank] else 1
        return self._issue(Op.SEND_RECV, tensor_bytes(tensors), tensors, None, tensors, root, tl, peer=dst_rank, send=True)

    def recv(self, tensors, src_rank, tag=0):
        """Receive from an emulated peer: the last sent tensor of the same shape, dtype and device, else zeros."""
        self._check_peer(src_rank, "recv")
        if self._hybrid is not None and src_rank in self._hybrid.member_set:
            return self._track(self._real(tensors[0]).p2p(self, tensors, src_rank, False, tag))
        return self._recv(tensors, src_rank, src_rank)

    def recv_anysource(self, tensors, tag=0):
        """Receive from any source: the previous rank of the group is taken as the sender."""
        src = (self._me - 1) % self._n
        if src == self._me:
            raise ValueError("nbox: recv_anysource in a group of one rank")
        if self._hybrid is not None and src in self._hybrid.member_set:
            return self._track(self._real(tensors[0]).p2p(self, tensors, src, False, tag))
        return self._recv(tensors, src, src)

    def _recv(self, tensors, src: int, source_rank: int) -> NboxWork:
        sent = self._sent

        def mirror():
            for t in tensors:
                last = sent.get((tuple(t.shape), t.dtype, t.device))
                if last is None:
                    t.zero_()
                else:
                    t.copy_(last)

        tl = self._p2p_timeline(src)
        root = 0 if self.global_ranks[src] < self.global_ranks[self._me] else 1
        return self._issue(Op.SEND_RECV, tensor_bytes(tensors), tensors, mirror, tensors, root, tl, source_rank, peer=src)

    # --- barriers and coalescing ----------------------------------------------------------------

    def barrier(self, opts=None):
        """A barrier: every emulated peer arrives with us; it takes the model's barrier time (host-timed)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # NCCL's barrier is a device all-reduce that the CPU then waits for: the real rank
            # leaves it only once its own stream has drained. No other thread is involved.
            torch.cuda.current_stream().synchronize()
        if self._hybrid is not None:
            return self._track(self._real().barrier(self))
        if self._wire is not None and (w := self._wire.barrier(self)) is not None:  # wire mode hook
            return self._track(w)
        if self._replay is not None or self._record_roles is not None:
            return self._issue(Op.BARRIER, 0, [], None, [])
        rec = self.timeline.schedule(Op.BARRIER, 0)
        return self._track(NboxWork(rec, [], self._emu))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A blocking barrier (torch allows it only for gloo; ``launch.install`` routes nbox groups here)."""
        self.barrier().wait()

    def start_coalescing(self, device=None) -> None:
        """Collect the works issued until ``end_coalescing`` (NCCL launches them as one group)."""
        self._coalescing = []

    def end_coalescing(self, device=None):
        """One work for everything issued since ``start_coalescing``."""
        works, self._coalescing = self._coalescing or [], None
        if not works:
            return done_work(self._emu, self.timeline)
        return GroupWork(works, self._emu)

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    # --- what is not emulated ------------------------------------------------------------------

    def _unsupported(self, name: str):
        raise UnsupportedCollective(f"nbox: {name} is not supported by the nbox backend")

    def splitGroup(self, *args, **kwargs):  # noqa: N802 - the trampoline's name
        """Not emulated: use new_group."""
        self._unsupported("split_group (use new_group)")

    def mergeRemoteGroup(self, *args, **kwargs):  # noqa: N802 - the trampoline's name
        """Not emulated."""
        self._unsupported("merge_remote_group")


def _cuda_fallback(device: torch.device) -> None:
    # Without Triton, CUDA ops are timed on the host after the caller's stream has drained:
    # correct start times, but the CPU blocks and compute/communication overlap is lost.
    global _warned_cuda_fallback
    if not _warned_cuda_fallback:
        _warned_cuda_fallback = True
        import warnings

        warnings.warn(
            f"nbox: device-side timed waits are unavailable ({cuda_wait.why_unavailable()}); "
            "CUDA collectives synchronize the stream and are timed on the host (no overlap)",
            RuntimeWarning,
            stacklevel=3,
        )
    torch.cuda.current_stream(device).synchronize()


# Where a new group finds the process's emulator: given by whoever registers the backend
# (launch.install passes emulator.current), so the backend imports nothing above the ops it runs.
_emulator_source: Callable[[], Emulator] | None = None


def create_process_group(dist_opts, backend_opts=None) -> NboxProcessGroup:
    """The creator registered with torch (``extended_api=True``: it receives the group's global ranks)."""
    if _emulator_source is None:
        raise RuntimeError("nbox: the backend was registered without an emulator (use neuronabox.emu.launch.install)")
    emu = _emulator_source()
    size = dist_opts.group_size
    ranks = list(dist_opts.global_ranks_in_group) or range(size)
    if len(ranks) != size:
        raise RuntimeError(f"nbox: group of {size} ranks with {len(ranks)} global ranks")
    if not ranks or (ranks[-1] if isinstance(ranks, range) else max(ranks)) >= emu.world_size:
        raise RuntimeError(f"nbox: group ranks {ranks[:8]} exceed the emulated world of {emu.world_size}")
    group = NboxProcessGroup(dist_opts.group_rank, size, ranks, emu)
    if group.table_index == 0:
        emu.roles_start()
    start_gate.rendezvous()
    return group


def register(emulator_source: Callable[[], Emulator]) -> None:
    """Register the ``nbox`` backend with torch.distributed (idempotent); new groups use ``emulator_source()``."""
    global _emulator_source
    _emulator_source = emulator_source
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
