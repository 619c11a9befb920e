"""Mirror data semantics on tensors: what identical peers make of the real rank's own data.

DESIGN.md, "Timing semantics": every emulated peer is assumed to hold the same data as the real
rank, so a collective's result is computed from the real rank's tensors alone: SUM all-reduce
gives x*n, AVG x, PRODUCT x**n, all-gather n copies, reduce-scatter our chunk reduced n times,
all-to-all our own chunk in every slot. These helpers do that in place; the backend (one real
rank) and the hybrid rules (several real ranks, ``hybrid_gloo.py``) both use them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "UnsupportedCollective", "tensor_bytes", "reduce_inplace", "no_grad_call", "same_storage", "fit_copy",
    "split_offsets",
]

_RedOp = dist.ReduceOp.RedOpType


class UnsupportedCollective(NotImplementedError):
    """A torch.distributed call the nbox backend does not emulate."""


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes the tensors hold (what an op moves is counted from them)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def reduce_inplace(t: torch.Tensor, op, n: int) -> None:
    """Reduce ``n`` identical copies of ``t`` into ``t`` (``op`` is a ReduceOp)."""
    kind = op.op
    if kind == _RedOp.SUM:
        if n != 1 and t.dtype != torch.bool:  # a bool SUM is an OR: x | x = x
            t.mul_(n)
    elif kind == _RedOp.AVG or kind == _RedOp.MAX or kind == _RedOp.MIN or kind == _RedOp.BAND or kind == _RedOp.BOR:
        pass
    elif kind == _RedOp.PRODUCT:
        if n != 1:
            t.pow_(n)
    elif kind == _RedOp.PREMUL_SUM:
        # torch: every rank multiplies its input by the factor, then the inputs are summed.
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            t.mul_(factor.to(device=t.device, dtype=t.dtype) * n)
        else:
            t.mul_(factor * n)
    elif kind == _RedOp.BXOR:
        if n % 2 == 0:
            t.zero_()
    else:
        raise UnsupportedCollective(f"nbox: reduce operation {kind} is not supported")


def no_grad_call(fn: Callable[[], None]) -> None:
    """Run ``fn`` with autograd off (a mirror writes into tensors that may require grad)."""
    # torch.no_grad() as a context manager costs a few microseconds per op; the raw switch does not.
    if torch.is_grad_enabled():
        torch._C._set_grad_enabled(False)
        try:
            fn()
        finally:
            torch._C._set_grad_enabled(True)
    else:
        fn()


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (an in-place output must not read what it overwrote)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def fit_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst``; when the element counts differ copy the common prefix and zero the rest."""
    if dst.numel() == src.numel():
        dst.copy_(src.reshape(dst.shape))
        return
    k = min(dst.numel(), src.numel())
    flat = dst.view(-1) if dst.is_contiguous() else None
    if flat is None:
        tmp = torch.zeros(dst.numel(), dtype=dst.dtype, device=dst.device)
        tmp[:k].copy_(src.reshape(-1)[:k])
        dst.copy_(tmp.view(dst.shape))
        return
    flat[:k].copy_(src.reshape(-1)[:k])
    flat[k:].zero_()


def split_offsets(total: int, splits: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    """All-to-all's split sizes (equal when none are given) and where each chunk begins."""
    if not splits:
        if total % n:
            raise ValueError(f"nbox: all_to_all_single: dim 0 ({total}) is not divisible by the group size ({n})")
        splits = [total // n] * n
    offsets, acc = [], 0
    for s in splits:
        offsets.append(acc)
        acc += s
    return list(splits), offsets
