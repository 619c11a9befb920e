"""A size sweep of a model, the rows that ``nbox bench`` prints (what nccl-tests would measure)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from ..collectives import Op, busbw_factor
from ..errors import InputError
from ..units import UnitError, parse_size
from .base import CommModel, Group

__all__ = ["DTYPES", "BenchRow", "parse_bench_size", "sweep_sizes", "run_bench", "parse_ranks"]

DTYPES = {"int8": 1, "uint8": 1, "half": 2, "bfloat16": 2, "float": 4, "int32": 4, "double": 8, "int64": 8}
_REDUCING = (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.REDUCE)
_ROOTED = (Op.BROADCAST, Op.REDUCE, Op.GATHER, Op.SCATTER)
# Ops whose nccl-tests size is n equal chunks: the size is rounded to a multiple of n elements.
_CHUNKED = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.GATHER, Op.SCATTER)

_NCCL_TESTS_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class BenchRow:
    """One line of the table."""

    op: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    algorithm: str
    protocol: str

    def as_dict(self) -> dict:
        """The row as JSON-ready data."""
        return asdict(self)


def parse_bench_size(text: str, flag: str) -> int:
    """nccl-tests sizes (``8``, ``128M``: K/M/G are powers of 1024) or NeuronaBox sizes (``64MiB``, ``1GB``)."""
    m = _NCCL_TESTS_SIZE.match(text)
    if m:
        return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    try:
        return parse_size(text)
    except UnitError as exc:
        raise InputError(f"{flag}: {exc}") from None


def sweep_sizes(min_bytes: int, max_bytes: int, factor: float = 2.0, step_bytes: int | None = None) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``, multiplied by ``factor`` (or increased by ``step_bytes``)."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise InputError(f"--minbytes/--maxbytes: need 0 <= min <= max, got {min_bytes} and {max_bytes}")
    if step_bytes is None and factor <= 1:
        raise InputError(f"--stepfactor: must be greater than 1, got {factor}")
    if step_bytes is not None and step_bytes <= 0:
        raise InputError(f"--stepbytes: must be greater than 0, got {step_bytes}")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(int(s))
        nxt = s + step_bytes if step_bytes is not None else max(s * factor, s + 1)
        s = nxt
    return out


def parse_ranks(spec: str, world: int) -> Group:
    """``0-7,16,18`` -> a group of those global ranks."""
    ranks: list[int] = []
    try:
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            ranks.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise InputError(f"--ranks: expected a list like 0-7,16, got {spec!r}") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise InputError(f"--ranks: rank {bad[0] if bad else spec!r} is not in 0-{world - 1}")
    if len(set(ranks)) != len(ranks):
        raise InputError(f"--ranks: {spec!r} lists a rank twice")
    return Group(ranks)


def run_bench(
    model: CommModel, ops: Sequence[Op], sizes: Iterable[int], group: Group, dtype: str = "float", root: int = 0
) -> list[BenchRow]:
    """Estimate every op at every size, as nccl-tests rows."""
    width = DTYPES[dtype]
    n = group.size
    rows: list[BenchRow] = []
    sizes = list(sizes)
    for op in ops:
        factor = busbw_factor(op, n)
        for size in sizes:
            unit = width * (n if op in _CHUNKED else 1)
            size = (size // unit) * unit
            count = size // width
            est = model.estimate(op, size, group, root)
            t = est.duration
            algbw = size / t / 1e9 if t > 0 else 0.0
            rows.append(
                BenchRow(
                    op=op.value, size=size, count=count, type=dtype,
                    redop="sum" if op in _REDUCING else "none", root=root if op in _ROOTED else -1,
                    time_us=t * 1e6, algbw_GBps=algbw, busbw_GBps=algbw * factor,
                    algorithm=est.algorithm, protocol=est.protocol,
                )
            )
    return rows
