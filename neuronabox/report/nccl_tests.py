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


def format_compare(rows: Sequence[tuple[int, float, float, float, float, str]], header: Sequence[str]) -> str:
    """The model beside an nccl-tests log: (size, measured µs, model µs, measured busbw, model busbw, algorithm)."""
    lines = [f"# {h}" for h in header]
    lines += [
        "#",
        "#                       measured            modeled",
        "#       size      time    busbw      time    busbw    error  algorithm",
        "#        (B)      (us)   (GB/s)      (us)   (GB/s)   (time)",
    ]
    for size, t_meas, t_model, bw_meas, bw_model, algo in rows:
        err = t_model / t_meas - 1 if t_meas > 0 else float("nan")
        lines.append(f"{size:12d}  {_time(t_meas)}  {bw_meas:7.2f}   {_time(t_model)}  {bw_model:7.2f}  {err:+7.1%}  {algo}")
    big = [abs(r[2] / r[1] - 1) for r in rows if r[0] >= 1 << 20 and r[1] > 0]
    small = [abs(r[2] / r[1] - 1) for r in rows if r[0] < 1 << 20 and r[1] > 0]
    if big:
        lines.append(f"# Largest |error| at >=1 MiB : {max(big):.1%} (mean {sum(big) / len(big):.1%}, {len(big)} sizes)")
    if small:
        lines.append(f"# Largest |error| below 1 MiB: {max(small):.1%} (mean {sum(small) / len(small):.1%}, {len(small)} sizes)")
    return "\n".join(lines)
