"""The nccl-tests output table, which people already know how to read."""

from __future__ import annotations

from typing import Sequence

from ..collectives import NCCL_TESTS_NAME, Op
from ..model.bench import BenchRow

__all__ = ["format_table", "format_compare", "departures", "ROUGH"]

# A row further than this from the line through its neighbours is flagged under a comparison: half
# of it, 3 %, is what `calibrate --from-nccl-tests` aims for at every size of 1 MiB and up.
ROUGH = 0.06
_MIB = 1 << 20


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


def format_compare(rows: Sequence[tuple[int, float, float, float, float, str]], header: Sequence[str],
                   gaps: Sequence[tuple[int, str, float]] = ()) -> str:
    """The model beside an nccl-tests log: (size, measured µs, model µs, measured busbw, model busbw, algorithm).

    ``gaps``: sizes whose out-of-place and in-place timings are far apart (``NcclTestsLog.timing_gaps``).
    """
    lines = [f"# {h}" for h in header]
    lines += [
        "# measured: each size's faster of its out-of-place and in-place times (where the log prints both)",
        "#",
        "#                       measured            modeled",
        "#       size      time    busbw      time    busbw    error  algorithm",
        "#        (B)      (us)   (GB/s)      (us)   (GB/s)   (time)",
    ]
    for size, t_meas, t_model, bw_meas, bw_model, algo in rows:
        # A row of 0 B (a count that rounds to nothing) times no collective: NCCL launches nothing for it.
        err = f"{t_model / t_meas - 1:+7.1%}" if t_meas > 0 and size > 0 else "      -"
        lines.append(f"{size:12d}  {_time(t_meas)}  {bw_meas:7.2f}   {_time(t_model)}  {bw_model:7.2f}  {err}  {algo}")
    big = [abs(r[2] / r[1] - 1) for r in rows if r[0] >= 1 << 20 and r[1] > 0]
    small = [abs(r[2] / r[1] - 1) for r in rows if 0 < r[0] < 1 << 20 and r[1] > 0]
    if big:
        lines.append(f"# Largest |error| at >=1 MiB : {max(big):.1%} (mean {sum(big) / len(big):.1%}, {len(big)} sizes)")
    if small:
        lines.append(f"# Largest |error| below 1 MiB: {max(small):.1%} (mean {sum(small) / len(small):.1%}, {len(small)} sizes)")
    rough = _spikes(departures([(r[0], r[1]) for r in rows]))
    if rough:
        lines.append(f"# Off the line through the sizes beside them by more than {ROUGH:.0%} (the log's noise, or NCCL "
                     "switching protocol there; no smooth model comes closer than half of it): "
                     + ", ".join(f"{size} ({d:+.1%})" for size, d in rough))
    if gaps:
        lines.append(f"# Out of place and in place more than {ROUGH:.0%} apart (interference in the slower loop; the "
                     "faster is the measured time): " + ", ".join(f"{size} ({which} {g:+.1%})" for size, which, g in gaps))
    return "\n".join(lines)


def departures(points: Sequence[tuple[int, float]], lo: int = _MIB) -> list[tuple[int, float, float]]:
    """(size, relative, µs) departure of each size >= ``lo`` between two others from the line through their times.

    An alpha-beta model is a straight line in the size; three rows that are not on one line leave it
    at least about half the middle one's relative departure at one of them. The departure is the
    log's own roughness: measurement noise, or a protocol switch between the neighbours.
    """
    pts = sorted((s, t) for s, t in points if t > 0)
    out = []
    for (s0, t0), (s1, t1), (s2, t2) in zip(pts, pts[1:], pts[2:]):
        if s1 >= lo and s2 > s0:
            w = (s1 - s0) / (s2 - s0)
            off = t1 - ((1 - w) * t0 + w * t2)
            out.append((s1, off / t1, off))
    return out


def _spikes(deps: Sequence[tuple[int, float, float]]) -> list[tuple[int, float]]:
    """Rows off by more than ROUGH that stand out from their neighbours (a spike bends both neighbours' lines too)."""
    out = []
    for i, (size, rel, off) in enumerate(deps):
        beside = [abs(deps[j][2]) for j in (i - 1, i + 1) if 0 <= j < len(deps)]
        if abs(rel) > ROUGH and all(abs(off) >= b for b in beside):
            out.append((size, rel))
    return out
