"""The collective operations NeuronaBox knows, and the nccl-tests bus-bandwidth factors.

Byte counts follow nccl-tests: ``size`` is the full buffer of the operation (the all-reduce
buffer; the all-gather output and the reduce-scatter input, n chunks; the whole all-to-all
send buffer of one rank; the root's full gather/scatter buffer; one send/recv message).
"""

from __future__ import annotations

from enum import Enum


class Op(str, Enum):
    """A collective operation; the value is the name used in YAML, the CLI and reports."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"
    SEND_RECV = "send_recv"
    BARRIER = "barrier"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str) -> "Op":
        """Accept ``all_reduce``, ``allreduce``, ``all-reduce`` and ``AllReduce`` alike."""
        key = name.strip().lower().replace("-", "").replace("_", "")
        for op in cls:
            if op.value.replace("_", "") == key:
                return op
        raise ValueError(f"unknown collective {name!r} (choose from {', '.join(o.value for o in cls)})")


# nccl-tests (src/*.cu, getBw): busbw = algbw * factor.
def busbw_factor(op: Op, n: int) -> float:
    """The nccl-tests factor from algorithm bandwidth to bus bandwidth for ``n`` ranks."""
    if n <= 1:
        return 0.0 if op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.GATHER, Op.SCATTER) else 1.0
    if op is Op.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.GATHER, Op.SCATTER):
        return (n - 1) / n
    return 1.0


# nccl-tests names, used in the bench table header.
NCCL_TESTS_NAME = {
    Op.ALL_REDUCE: "AllReduce",
    Op.ALL_GATHER: "AllGather",
    Op.REDUCE_SCATTER: "ReduceScatter",
    Op.BROADCAST: "Broadcast",
    Op.REDUCE: "Reduce",
    Op.ALL_TO_ALL: "AlltoAll",
    Op.GATHER: "Gather",
    Op.SCATTER: "Scatter",
    Op.SEND_RECV: "SendRecv",
    Op.BARRIER: "Barrier",
}
