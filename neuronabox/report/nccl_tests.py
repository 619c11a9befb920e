"""The nccl-tests output table, which people already know how to read."""

from __future__ import annotations

from typing import Sequence

from ..collectives import NCCL_TESTS_NAME, Op
from ..model.bench import BenchRow

__all__ = ["format_table"]


def _time(us: float) -> str:
    # nccl-tests switches to fewer decimals for long times so the column keeps its width.
    return f"{us:7.2f}" if us < 10000 else f"{us:7.1f}" if us < 100000 else f"{us:7.0f}"


def format_table(rows: Sequence[BenchRow], header: Sequence[str]) -> str:
    """Rows of one op as nccl-tests prints them (out-of-place columns, plus the model's algorithm)."""
    op = Op(rows[0].op) if rows else None
    lines = [f"# {h}" for h in header]
    if op is not None:
        lines.append(f"# Collective: {NCCL_TESTS_NAME[op]}")
    lines += [
        "#",
        "#                                                              modeled",
        "#       size         count      type   redop    root     time   algbw   busbw  algorithm",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)",
    ]
    for r in rows:
        algo = r.algorithm + (f"/{r.protocol}" if r.protocol else "")
        lines.append(
            f"{r.size:12d}  {r.count:12d}  {r.type:>8s}  {r.redop:>6s}  {r.root:6d}  {_time(r.time_us)}"
            f"  {r.algbw_GBps:6.2f}  {r.busbw_GBps:6.2f}  {algo}"
        )
    if rows:
        avg = sum(r.busbw_GBps for r in rows) / len(rows)
        lines.append(f"# Avg bus bandwidth    : {avg:g} ")
    return "\n".join(lines)
