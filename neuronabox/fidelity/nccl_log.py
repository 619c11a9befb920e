"""nccl-tests' text output, read back: the rows people publish and the machine they came from.

nccl-tests (all_reduce_perf, all_gather_perf, ...) prints a header (``# nThread ... minBytes
... maxBytes ...``, one ``#  Rank`` line per rank with its host and device), a column header,
one row per size and a trailer (``# Avg bus bandwidth``). Columns changed over the years
(``redop``/``root`` appeared, ``error`` became ``#wrong``), so rows are read by the column
header's names, not by position. Lines that are neither (NCCL INFO logging interleaved with
the table, MPI chatter) are skipped; a row cut short is an error naming its line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..collectives import Op, busbw_factor
from ..errors import InputError

__all__ = ["LogRow", "NcclTestsLog", "read_log", "parse_log", "OP_OF_BINARY"]

# nccl-tests binaries and the op each measures.
OP_OF_BINARY = {
    "all_reduce": Op.ALL_REDUCE,
    "all_gather": Op.ALL_GATHER,
    "reduce_scatter": Op.REDUCE_SCATTER,
    "alltoall": Op.ALL_TO_ALL,
    "broadcast": Op.BROADCAST,
    "reduce": Op.REDUCE,
    "sendrecv": Op.SEND_RECV,
    "gather": Op.GATHER,
    "scatter": Op.SCATTER,
}
_BINARY = re.compile(r"\b(all_reduce|all_gather|reduce_scatter|alltoall|broadcast|reduce|sendrecv|gather|scatter)_perf")
# Older versions print no "Group" field.
_RANK = re.compile(r"^#\s+Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(.*?)\s*$")
_HEAD = re.compile(r"minBytes\s+(\d+)\s+maxBytes\s+(\d+)")
_NCCL_VERSION = re.compile(r"NCCL version\s+(\d+\.\d+\.\d+)")
_NUM = re.compile(r"^-?\d+$")
# NCCL_DEBUG=INFO prints every NCCL_* variable it read: "host:1:1 [0] NCCL INFO NCCL_PROTO set by environment to Simple".
_ENV_SET = re.compile(r"NCCL INFO (NCCL_[A-Z0-9_]+) set by environment to (\S+)")


@dataclass(frozen=True)
class LogRow:
    """One size of the table: the out-of-place measurement, the in-place time beside it when printed."""

    size: int
    count: int
    type: str
    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    in_place_time_us: float | None
    line: int

    @property
    def measured_us(self) -> float:
        """The size's time to model: the faster of its out-of-place and in-place times, where both are printed.

        nccl-tests times every size twice, out of place and in place, with the same algorithm.
        Interference (another job, a congested link, a late thread) only ever slows a timing
        loop down, so the faster of the two is the better estimate of the collective's own time:
        published logs have one column up to 70 % slow at a size where the other is on the curve.
        """
        t = self.in_place_time_us
        return min(self.time_us, t) if t is not None and t > 0 else self.time_us

    @property
    def measured_busbw_GBps(self) -> float:
        """The bus bandwidth at ``measured_us``."""
        t = self.measured_us
        return self.busbw_GBps * self.time_us / t if t > 0 else self.busbw_GBps


@dataclass(frozen=True)
class NcclTestsLog:
    """A parsed nccl-tests output."""

    path: str
    op: Op
    rows: tuple[LogRow, ...]
    ranks: int
    hosts: tuple[str, ...]  # distinct, in rank order; empty when the log names none
    devices: tuple[str, ...]
    nccl_version: str | None
    env: tuple[tuple[str, str], ...] = ()  # NCCL_* variables the log says NCCL read (NCCL_DEBUG=INFO lines)

    @property
    def nodes(self) -> int | None:
        """Distinct hosts among the ranks, when the log lists them."""
        return len(self.hosts) or None

    def row(self, size: int) -> LogRow | None:
        """The row of ``size`` bytes, if measured."""
        return next((r for r in self.rows if r.size == size), None)

    def timing_gaps(self, over: float, lo: int = 1 << 20) -> list[tuple[int, str, float]]:
        """Sizes >= ``lo`` whose two timings are more than ``over`` apart: (size, the slower one, how much slower)."""
        out = []
        for r in self.rows:
            t_in = r.in_place_time_us
            if r.size >= lo and t_in is not None and t_in > 0 and r.time_us > 0:
                gap = max(r.time_us, t_in) / min(r.time_us, t_in) - 1
                if gap > over:
                    out.append((r.size, "out-of-place" if r.time_us > t_in else "in-place", gap))
        return out


def read_log(path: str | Path, op: Op | None = None, ranks: int | None = None,
             default_ranks: int | None = None) -> NcclTestsLog:
    """Read an nccl-tests output file; ``op`` and ``ranks`` are checked against the log when given.

    ``default_ranks``: the rank count when the log lists no ranks (the topology's world, say).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InputError(f"{p}: cannot read: {exc.strerror or exc}") from None
    return parse_log(text, str(p), op, ranks, default_ranks=default_ranks)


def parse_log(text: str, source: str, op: Op | None = None, ranks: int | None = None,
              default_ranks: int | None = None) -> NcclTestsLog:
    """Parse nccl-tests text (see ``read_log``); when neither ``op`` nor the log names the op, ``source``'s name does."""
    columns: list[str] | None = None
    rows: list[LogRow] = []
    hosts: dict[str, None] = {}
    devices: dict[str, None] = {}
    rank_ids: set[int] = set()
    binary = None
    max_bytes = None
    version = None
    trailer = False
    env: dict[str, str] = {}
    for i, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if "set by environment" in line and (m := _ENV_SET.search(line)):
            env.setdefault(m.group(1), m.group(2))  # every rank prints it: the first is the job's
        if binary is None and (m := _BINARY.search(line)):
            binary = m.group(1)  # the command line, or newer versions' "# Collective test starting"
        if (m := _NCCL_VERSION.search(line)) and version is None:
            version = m.group(1)
        if not line.strip():
            continue
        if line.lstrip().startswith("#"):
            if m := _RANK.match(line.lstrip()):
                rank_ids.add(int(m.group(1)))
                hosts.setdefault(m.group(2))
                devices.setdefault(m.group(3))
            elif m := _HEAD.search(line):
                max_bytes = int(m.group(2))
            elif re.search(r"\bsize\b", line) and ("time" in line or "busbw" in line) and "(B)" not in line:
                columns = _columns(line)  # also a published table of size and busbw alone
            elif "Avg bus bandwidth" in line:
                trailer = True
            continue
        fields = line.split()
        if columns is None or not _NUM.match(fields[0]):
            continue  # NCCL INFO lines, MPI output, shell prompts: not the table
        rows.append(_row(fields, columns, source, i, line))
    if not rows:
        raise InputError(f"{source}: no nccl-tests rows (expected the table under a '#  size  count  type ...' header)")
    named = OP_OF_BINARY.get(binary) if binary else None
    if op is not None and named is not None and named is not op:
        raise InputError(f"{source}: this is a {binary}_perf log, not {op.value}")
    # A file named after another nccl-tests binary than the one its header names: two logs mixed up.
    if named is not None and (m := _BINARY.search(Path(source).name)) and m.group(1) != binary:
        raise InputError(f"{source}: the file is named after {m.group(1)}_perf but the log is {binary}_perf's")
    op = op or named or op_from_filename(source)
    n = ranks or len(rank_ids) or default_ranks or None
    if op is None:
        raise InputError(f"{source}: the log does not say which collective it measured (name the file after it, like all_reduce_perf.txt)")
    if any(math.isnan(r.time_us) for r in rows):
        # A published table of bus bandwidth alone: the time is what nccl-tests derived it from.
        if n is None:
            raise InputError(f"{source}: a table of busbw without times needs the rank count (the log names none)")
        factor = busbw_factor(op, n) or 1.0
        rows = [_from_busbw(r, factor) for r in rows]
    _check_factor(rows, op, n, source)
    if n is None:
        n = _ranks_from_factor(rows, op, source)
    if max_bytes is not None and not trailer and rows[-1].size < max_bytes:
        raise InputError(f"{source}: line {rows[-1].line}: the log ends at {rows[-1].size} B before its maxBytes {max_bytes} (truncated)")
    return NcclTestsLog(source, op, tuple(rows), n, tuple(hosts), tuple(devices), version, tuple(env.items()))


def op_from_filename(path: str | Path) -> Op | None:
    """The op a file name like ``all_reduce_perf.txt`` or ``h100_alltoall.log`` names, if any."""
    # Without separators, so that allgather.log and all-gather.txt name all_gather, not gather.
    name = Path(path).name.lower().replace("_", "").replace("-", "")
    for key in sorted(OP_OF_BINARY, key=len, reverse=True):
        if key.replace("_", "") in name:
            return OP_OF_BINARY[key]
    return None


def _columns(header: str) -> list[str]:
    # "#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong": the second
    # time/algbw/busbw group is in-place.
    # "in-place busbw" in a published table is one column; nccl-tests prints the qualifiers on a line of their own.
    names = [n for n in header.lstrip("#").split() if n not in ("in-place", "out-of-place")]
    out, seen = [], set()
    for name in names:
        name = "wrong" if name in ("#wrong", "error", "wrong") else name
        out.append(f"in_{name}" if name in seen and name in ("time", "algbw", "busbw", "wrong") else name)
        seen.add(name)
    return out


def _row(fields: Sequence[str], columns: Sequence[str], source: str, line_no: int, line: str) -> LogRow:
    if len(fields) < min(len(columns), _needed(columns)):
        raise InputError(f"{source}: line {line_no}: a row cut short ({len(fields)} of {len(columns)} columns): {line.strip()[:80]!r}")
    values = dict(zip(columns, fields))
    try:
        size = int(values["size"])
        count = int(values["count"]) if values.get("count", "N/A") != "N/A" else 0
        if "time" not in values:
            busbw = float(values["busbw"])
            if not (math.isfinite(busbw) and busbw > 0):
                raise ValueError(busbw)
            return LogRow(size, count, values.get("type", "float"), math.nan, math.nan, busbw, None, line_no)
        algbw, busbw = float(values["algbw"]), float(values["busbw"])
        # Some runs print N/A for the time (and the error column) but keep the bandwidths.
        time_us = float(values["time"]) if values["time"] != "N/A" else (size / algbw / 1e3 if algbw > 0 else math.nan)
        in_time = values.get("in_time")
        in_time_us = float(in_time) if in_time not in (None, "N/A") else None
    except (KeyError, ValueError):
        raise InputError(f"{source}: line {line_no}: not an nccl-tests row: {line.strip()[:80]!r}") from None
    if size < 0 or count < 0 or not all(math.isfinite(v) and v >= 0 for v in (time_us, algbw, busbw)):
        raise InputError(f"{source}: line {line_no}: impossible values (negative or not finite): {line.strip()[:80]!r}")
    return LogRow(size, count, values.get("type", "float"), time_us, algbw, busbw, in_time_us, line_no)


def _from_busbw(r: LogRow, factor: float) -> LogRow:
    algbw = r.busbw_GBps / factor
    return LogRow(r.size, r.count, r.type, r.size / algbw / 1e3, algbw, r.busbw_GBps, None, r.line)


def _needed(columns: Sequence[str]) -> int:
    # A row must reach the out-of-place busbw column.
    return columns.index("busbw") + 1 if "busbw" in columns else len(columns)


def _usable(rows: Sequence[LogRow]) -> list[LogRow]:
    # Rows whose printed bandwidths carry two significant digits (tiny sizes print 0.00).
    return [r for r in rows if r.algbw_GBps >= 0.1 and r.busbw_GBps >= 0.1]


def _check_factor(rows: Sequence[LogRow], op: Op, n: int | None, source: str) -> None:
    # busbw / algbw is the op's nccl-tests factor: a log of another collective gives another one.
    if n is None or n < 2:
        return
    want = busbw_factor(op, n)
    # The most precisely printed row that disagrees (the largest bandwidths carry the most digits).
    for r in sorted(_usable(rows), key=lambda x: -x.algbw_GBps):
        got = r.busbw_GBps / r.algbw_GBps
        if abs(got / want - 1) > 0.05 + 0.01 / r.algbw_GBps:
            raise InputError(
                f"{source}: line {r.line}: busbw/algbw is {got:.3f}, not the {want:.3f} of {op.value} on {n} ranks "
                "(a log of another collective, or another rank count?)"
            )


def _ranks_from_factor(rows: Sequence[LogRow], op: Op, source: str) -> int:
    # Logs without '#  Rank' lines still print both bandwidths; their ratio gives n for the ops
    # whose factor depends on it.
    usable = _usable(rows)
    if op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL) and usable:
        r = max(usable, key=lambda x: x.algbw_GBps)
        ratio = r.busbw_GBps / r.algbw_GBps
        k = ratio / 2 if op is Op.ALL_REDUCE else ratio  # (n-1)/n
        if k < 0.99:
            return max(2, round(1 / (1 - k)))
    raise InputError(f"{source}: the log names no ranks ('#  Rank' lines) and its bandwidths do not give the count")
