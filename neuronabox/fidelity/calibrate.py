"""``nbox calibrate``: measure the collectives on the real links, fit a piecewise alpha-beta model, save a profile.

Measurement: every rank of the topology runs for real in its node's namespace of a netns
cluster (the launcher of ``validate``), gloo over the shaped links. For each op and size,
nccl-tests' way: a barrier, then k back-to-back ops timed on every rank; the sample is the
slowest rank's time / k (an op is over when its last rank is done). k grows for small sizes
so a sample lasts a few tens of ms, the sample count is bounded by a time budget per size,
and an op's sweep stops after the first size whose op takes longer than ``max_op_s``:
that keeps the default run (4 B to 256 MiB, every op gloo has) to a few minutes on a
100 Mbit link, where 256 MiB alone would take 20 s an op.

Fit: per op, time t(S) is piecewise linear in the size S, ``t = a + b·S`` on each segment
(a: latency terms, b: seconds per byte). Segments are found by dynamic programming over the
sorted sizes (least squares on relative error, so 4 B counts as much as 256 MiB) and their
number by BIC. A breakpoint is where two adjacent lines cross when they cross near the gap
between their sizes (a library choosing the faster algorithm, like NCCL's tuner, makes t
continuous there), else the geometric middle of the gap (a protocol switch: a jump).
Each segment is then expressed in the op's ring closed form for the measured group size n,
``t = L(n)·alpha + F(n)·S/B`` (all-reduce: L = 2(n-1), F = 2(n-1)/n), so the calibrated model
can scale it to other group sizes (``neuronabox.model.calibrated``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..collectives import Op
from ..errors import InputError

__all__ = [
    "FORMAT",
    "CALIBRATABLE",
    "ring_terms",
    "Segment",
    "OpFit",
    "fit_piecewise",
    "parse_size_range",
    "parse_ops",
    "default_sizes",
    "topology_hash",
    "network_summary",
    "make_profile",
    "link_estimate",
    "save_profile",
    "load_profile",
    "profile_reference",
    "write_profile_field",
    "load_for_calibration",
    "run_calibration",
    "run_intra_node",
    "pair_ratios",
    "DEFAULT_SIZES",
]

FORMAT = "neuronabox-calibration/1"
DEFAULT_SIZES = "4B:256MiB"  # the sweep's sizes unless told (nbox calibrate --sizes; nbox validate --calibrate)
# What gloo (torch's CPU backend) runs among real ranks; the others are its internals or absent.
CALIBRATABLE = (
    Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.BROADCAST, Op.REDUCE, Op.ALL_TO_ALL,
    Op.GATHER, Op.SCATTER, Op.SEND_RECV, Op.BARRIER,
)
_CHUNKED = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.GATHER, Op.SCATTER)


def ring_terms(op: Op, n: int) -> tuple[float, float]:
    """(L, F): the op's ring closed form is ``L·alpha + F·S/B`` for n ranks (DESIGN.md, alpha-beta)."""
    if n <= 1:
        return 0.0, 0.0
    if op is Op.ALL_REDUCE:
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op is Op.BARRIER:
        return 2.0 * (n - 1), 0.0
    if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.GATHER, Op.SCATTER):
        return float(n - 1), (n - 1) / n
    if op in (Op.BROADCAST, Op.REDUCE):
        return float(n - 1), 1.0
    return 1.0, 1.0  # send_recv: one message


# ---- the fit ----------------------------------------------------------------------------------------
@dataclass
class Segment:
    """One size regime: ``t = latency_s + S / throughput`` for sizes in [lo, hi), as alpha and bus bandwidth."""

    lo: float  # bytes (0 for the first segment)
    hi: float  # bytes (inf for the last)
    latency_s: float  # a: the fitted intercept
    sec_per_byte: float  # b: the fitted slope
    alpha_s: float  # per-step latency of the ring closed form at the calibrated n
    bandwidth_Bps: float  # bus bandwidth B of the closed form (inf: no size dependence)
    points: int = 0
    first_size: int = 0
    last_size: int = 0

    def time(self, nbytes: float) -> float:
        """The fitted time at ``nbytes`` (calibrated group size)."""
        return self.latency_s + self.sec_per_byte * nbytes

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (inf as null)."""
        d = asdict(self)
        for k in ("hi", "bandwidth_Bps"):
            if math.isinf(d[k]):
                d[k] = None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Segment":
        """Inverse of ``as_dict``."""
        d = dict(d)
        for k in ("hi", "bandwidth_Bps"):
            if d.get(k) is None:
                d[k] = math.inf
        return cls(**d)


@dataclass
class OpFit:
    """The fitted segments of one op, the breakpoints between them, and how well they fit."""

    op: str
    n: int
    segments: list[Segment]
    rms_rel_error: float
    max_rel_error: float
    outliers: list[int] = field(default_factory=list)  # sizes left out of the fit

    @property
    def breakpoints(self) -> list[float]:
        """Sizes (bytes) where one segment hands over to the next."""
        return [s.lo for s in self.segments[1:]]

    def time(self, nbytes: float) -> float:
        """The fitted time at ``nbytes`` for the calibrated group size."""
        return self.segment(nbytes).time(nbytes)

    def segment(self, nbytes: float) -> Segment:
        """The segment whose size range holds ``nbytes``."""
        for s in self.segments:
            if nbytes < s.hi:
                return s
        return self.segments[-1]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"op": self.op, "n": self.n, "segments": [s.as_dict() for s in self.segments],
                "breakpoints": self.breakpoints, "rms_rel_error": self.rms_rel_error,
                "max_rel_error": self.max_rel_error,
                "outliers": self.outliers}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpFit":
        """Inverse of ``as_dict``."""
        return cls(d["op"], int(d["n"]), [Segment.from_dict(s) for s in d["segments"]],
                   float(d.get("rms_rel_error", 0.0)), float(d.get("max_rel_error", 0.0)), list(d.get("outliers", [])))


def _line(s: Sequence[float], t: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of ``t = a + b·s`` on relative error with a, b >= 0; returns (a, b, sum of squared errors)."""
    # Normal equations of min sum ((a + b s - t) / t)^2, in closed form (segments are short).
    w = [1.0 / (x * x) for x in t]
    sw = sum(w)
    sws = sum(wi * si for wi, si in zip(w, s))
    swss = sum(wi * si * si for wi, si in zip(w, s))
    swt = sum(wi * ti for wi, ti in zip(w, t))
    swst = sum(wi * si * ti for wi, si, ti in zip(w, s, t))
    det = sw * swss - sws * sws
    a = b = None
    if det > 1e-300 * max(1.0, sw * swss) and len(s) > 1:
        a = (swss * swt - sws * swst) / det
        b = (sw * swst - sws * swt) / det
    if a is None or a < 0 or b < 0:
        # One parameter only: the better of a pure latency and a pure bandwidth line.
        cand = [(swt / sw, 0.0)]
        if swss > 0:
            cand.append((0.0, swst / swss))
        best = None
        for ca, cb in cand:
            sse = sum(((ca + cb * si - ti) / ti) ** 2 for si, ti in zip(s, t))
            if best is None or sse < best[2]:
                best = (ca, cb, sse)
        return best  # type: ignore[return-value]
    sse = sum(((a + b * si - ti) / ti) ** 2 for si, ti in zip(s, t))
    return a, b, sse


def _segment_dp(s: list[float], t: list[float], kmax: int, min_points: int) -> dict[int, tuple[float, list[int]]]:
    """For each segment count k, the least total error and the start indices of the segments."""
    m = len(s)
    cost = [[math.inf] * (m + 1) for _ in range(m + 1)]
    for i in range(m):
        for j in range(i + min_points, m + 1):
            cost[i][j] = _line(s[i:j], t[i:j])[2]
    # dp[k][j]: best error of the first j points cut into k segments
    dp = [[(math.inf, [])] * (m + 1) for _ in range(kmax + 1)]
    dp[0][0] = (0.0, [])
    for k in range(1, kmax + 1):
        for j in range(1, m + 1):
            cands = [(dp[k - 1][i][0] + cost[i][j], dp[k - 1][i][1] + [i])
                     for i in range(j) if dp[k - 1][i][0] < math.inf and cost[i][j] < math.inf]
            if cands:
                dp[k][j] = min(cands, key=lambda c: c[0])
    return {k: dp[k][m] for k in range(1, kmax + 1) if dp[k][m][0] < math.inf}


def fit_piecewise(
    sizes: Sequence[float],
    times: Sequence[float],
    op: Op | str = Op.ALL_REDUCE,
    n: int = 2,
    max_segments: int = 4,
    min_points: int = 3,
    noise_floor: float = 2e-3,
    outlier_floor: float = 0.25,
) -> OpFit:
    """Fit a piecewise ``t = a + b·S`` to (size, time) points; segments and breakpoints in the op's closed form."""
    op = Op.parse(op) if isinstance(op, str) else op
    pts = sorted((float(x), float(y)) for x, y in zip(sizes, times) if y > 0)
    if len(pts) < 2:
        raise InputError(f"calibration of {op.value}: need at least 2 measured sizes, got {len(pts)}")
    # A shared machine adds time to whole sizes now and then (a size whose samples were all
    # disturbed). First: a size much slower than some larger size was disturbed, since
    # moving more bytes does not get faster.
    keep, fastest_above = [], math.inf
    for x, y in reversed(pts):
        if y <= 1.5 * fastest_above:
            keep.append((x, y))
            fastest_above = min(fastest_above, y)
    keep.reverse()
    if len(keep) < 2:
        keep = pts
    fit = _fit_points(keep, op, n, max_segments, min_points, noise_floor)
    # Then: points far off that fit, by a robust scale; fit again without them.
    rel = [(fit.time(x) - y) / y for x, y in keep]
    scale = 1.4826 * statistics.median(abs(r) for r in rel)
    kept = [p for p, r in zip(keep, rel) if abs(r) <= max(5 * scale, outlier_floor)]
    if len(kept) < len(keep) and len(kept) >= max(2, len(pts) // 2):
        keep = kept
    if len(keep) < len(pts):
        fit = _fit_points(keep, op, n, max_segments, min_points, noise_floor)
        fit.outliers = [int(x) for x, y in pts if (x, y) not in keep]
    return fit


def _fit_points(pts, op: Op, n: int, max_segments: int, min_points: int, noise_floor: float) -> OpFit:
    s = [p[0] for p in pts]
    t = [p[1] for p in pts]
    m = len(s)
    kmax = max(1, min(max_segments, m // min_points))
    options = _segment_dp(s, t, kmax, min(min_points, m))
    # BIC on relative error; the floor keeps perfect synthetic data from rewarding extra segments.
    def bic(k: int) -> float:
        sse = max(options[k][0], m * noise_floor ** 2)
        return m * math.log(sse / m) + (3 * k - 1) * math.log(m)

    k = min(options, key=lambda k: (bic(k), k))
    starts = options[k][1] + [m]
    lines = []
    for i, j in zip(starts, starts[1:]):
        a, b, _ = _line(s[i:j], t[i:j])
        lines.append((a, b, i, j))
    bounds = [0.0]
    for (a1, b1, i1, j1), (a2, b2, i2, j2) in zip(lines, lines[1:]):
        left, right = s[j1 - 1], s[i2]
        cross = (a2 - a1) / (b1 - b2) if b1 != b2 else math.nan
        # A crossing inside the neighbouring points' span is where the library switches; else a jump.
        lo_ok = s[max(i1, j1 - 2)]
        hi_ok = s[min(j2 - 1, i2 + 1)]
        bounds.append(min(max(cross, left), right) if lo_ok <= cross <= hi_ok else math.sqrt(left * right))
    bounds.append(math.inf)
    big_l, big_f = ring_terms(op, n)
    segments = []
    for (a, b, i, j), lo, hi in zip(lines, bounds, bounds[1:]):
        alpha = a / big_l if big_l else 0.0
        bw = (big_f / b) if (b > 0 and big_f > 0) else math.inf
        segments.append(Segment(lo, hi, a, b, alpha, bw, j - i, int(s[i]), int(s[j - 1])))
    fit = OpFit(op.value, n, segments, 0.0, 0.0)
    rel = [(fit.time(x) - y) / y for x, y in zip(s, t)]
    fit.rms_rel_error = math.sqrt(sum(r * r for r in rel) / m)
    fit.max_rel_error = max(abs(r) for r in rel)
    return fit


# ---- options ------------------------------------------------------------------------------------------
def parse_size_range(text: str) -> tuple[int, int]:
    """``4B:256MiB`` -> (4, 268435456); errors name the flag."""
    from ..units import UnitError, parse_size

    lo, sep, hi = str(text).partition(":")
    try:
        a, b = parse_size(lo.strip()), parse_size(hi.strip()) if sep else parse_size(lo.strip())
    except UnitError as exc:
        raise InputError(f"--sizes: {exc}") from None
    if not 1 <= a <= b:
        raise InputError(f"--sizes: expected MIN:MAX with 1 <= MIN <= MAX (e.g. 4B:256MiB), got {text!r}")
    return a, b


def parse_ops(text: str, flag: str = "--ops") -> list[Op]:
    """``all`` or ``all_reduce,broadcast`` -> ops; errors name the flag."""
    if text.strip() == "all":
        return list(CALIBRATABLE)
    ops = []
    for name in (x for x in text.split(",") if x.strip()):
        try:
            op = Op.parse(name)
        except ValueError as exc:
            raise InputError(f"{flag}: {exc}") from None
        if op not in CALIBRATABLE:
            raise InputError(f"{flag}: {op.value} cannot be measured among real gloo ranks")
        ops.append(op)
    if not ops:
        raise InputError(f"{flag}: give at least one op, or all")
    return list(dict.fromkeys(ops))


def default_sizes(lo: int, hi: int, factor: float = 2.0) -> list[int]:
    """Sizes from ``lo`` to ``hi`` by ``factor``, multiples of 4 bytes (float32 elements), ``hi`` included."""
    if factor <= 1:
        raise InputError(f"--step: must be greater than 1, got {factor}")
    out, x = [], float(lo)
    while x <= hi * (1 + 1e-9):
        v = max(4, int(round(x / 4)) * 4)
        if not out or v > out[-1]:
            out.append(v)
        x *= factor
    if out[-1] != max(4, hi // 4 * 4):
        out.append(max(4, hi // 4 * 4))
    return out


# ---- the profile ----------------------------------------------------------------------------------------
def topology_hash(topology) -> str:
    """Hash of what the measurement depends on: network, intra-node fabric, library (not what-ifs or node count)."""
    raw = topology.raw
    key = {"network": raw.get("network"), "intra_node": raw.get("intra_node"), "library": topology.emulation.library}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def network_summary(topology) -> dict[str, Any]:
    """The nominal link between the calibrated ranks (rate, latency) as the topology states it."""
    from ..topology.graph import ClusterGraph

    g = ClusterGraph(topology)
    first = [nd.first_rank for nd in topology.nodes]
    if len(first) < 2:
        return {"nodes": len(first)}
    return {"nodes": len(first), "type": topology.network.type,
            "route_bandwidth_Bps": g.route_bandwidth(first[0], first[1]),
            "route_latency_s": g.route_latency(first[0], first[1]), "link": topology.raw.get("network", {}).get("link")}


def make_profile(topology, fits: dict[str, OpFit], measurements: dict[str, list[dict]], unsupported: dict[str, str],
                 meta: dict[str, Any] | None = None, backend: str = "gloo") -> dict[str, Any]:
    """The profile document: topology hash, library, network, fitted segments, raw measurements."""
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "topology": {"name": topology.name, "file": str(topology.source), "hash": topology_hash(topology),
                     "world_size": topology.world_size, "nodes": len(topology.nodes)},
        "library": library_info(backend),
        "network": network_summary(topology),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "ranks": topology.world_size,
        "ops": {k: v.as_dict() for k, v in fits.items()},
        "link_estimate": link_estimate(fits),
        "unsupported": unsupported,
        "measurements": measurements,
        **({"meta": meta} if meta else {}),
    }


def library_info(backend: str) -> dict[str, str]:
    """What measured: the library, torch's version, the transport."""
    import torch

    return {"name": backend, "torch": torch.__version__, "transport": "tcp" if backend == "gloo" else "nccl"}


# Ethernet frame (1514 B with a 1500 B MTU) per TCP payload (1448 B with timestamps): rate
# shapers count frames, collectives count payload.
WIRE_PER_PAYLOAD = 1514 / 1448


def link_estimate(fits: dict[str, OpFit]) -> dict[str, Any]:
    """The link rate the fits imply: the median over ops of the large-size bus bandwidth, as payload and as frames."""
    bws = {name: f.segments[-1].bandwidth_Bps for name, f in fits.items()
           if f.segments[-1].points >= 3 and not math.isinf(f.segments[-1].bandwidth_Bps)}
    if not bws:
        return {}
    # The median, not the best: a 3-point last segment of one op can overshoot.
    best = statistics.median(bws.values())
    return {"ops": sorted(bws), "payload_Bps": best, "wire_Bps": best * WIRE_PER_PAYLOAD,
            "all_reduce_payload_Bps": bws.get("all_reduce")}


def save_profile(profile: dict[str, Any], path: Path) -> None:
    """Write a profile as JSON."""
    path.write_text(json.dumps(profile, indent=1) + "\n", encoding="utf-8")


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and check a profile; its op fits come back as ``OpFit`` under ``fits``."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"calibration profile {str(p)!r}: no such file (nbox calibrate writes one)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"calibration profile {str(p)!r}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise InputError(f"calibration profile {str(p)!r}: format is {got!r}, expected {FORMAT!r}")
    try:
        doc["fits"] = {Op.parse(k): OpFit.from_dict(v) for k, v in doc.get("ops", {}).items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"calibration profile {str(p)!r}: ops: {exc}") from None
    intra = doc.get("intra_node")
    try:
        doc["intra_fits"] = ({Op.parse(k): OpFit.from_dict(v) for k, v in intra.get("ops", {}).items()}
                             if isinstance(intra, dict) else {})
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"calibration profile {str(p)!r}: intra_node.ops: {exc}") from None
    return doc


def profile_reference(topology_file: Path, profile: Path) -> str:
    """How the topology file should name ``profile``: relative to the file's folder (a path that moves with both)."""
    import os.path

    folder = Path(topology_file).resolve().parent
    target = Path(profile).resolve()
    rel = os.path.relpath(target, folder)
    # Beyond the topology's folder tree an absolute path reads better than a chain of ../
    return target.as_posix() if rel.startswith(".." + os.sep + "..") else Path(rel).as_posix()


def write_profile_field(topology_file: Path, profile: Path) -> str:
    """Set ``emulation.profile`` in the topology file, keeping its other lines (and comments) as they are.

    Handles a missing ``emulation`` section, a block one and a one-line flow one
    (``emulation: {library: gloo}``); anything else is left to the user (InputError naming the
    line to add). The result is loaded back, and the original restored if it does not load.
    Returns the value written.
    """
    import re

    import yaml

    from ..topology import load_topology

    path = Path(topology_file)
    ref = profile_reference(path, profile)
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    value = json.dumps(ref)  # a quoted YAML scalar: any path stays a string
    hand = f"{path}: emulation.profile: add `profile: {value}` under `emulation:` by hand"
    head = [i for i, ln in enumerate(lines) if re.match(r"^emulation\s*:", ln)]
    if not head:
        lines += ["emulation:", f"  profile: {value}"]
    else:
        i = head[0]
        rest = lines[i].split(":", 1)[1]
        body, _, comment = rest.partition(" #")
        if body.strip().startswith("{") and body.strip().endswith("}"):
            try:
                mapping = yaml.safe_load(body) or {}
            except yaml.YAMLError:
                raise InputError(hand) from None
            mapping["profile"] = ref
            flow = yaml.safe_dump(mapping, default_flow_style=True, sort_keys=False, width=10**6).strip()
            lines[i] = f"emulation: {flow}" + (f"  #{comment}" if comment else "")
        elif not body.strip():
            j = i + 1
            block = []
            while j < len(lines) and (not lines[j].strip() or lines[j][:1] in (" ", "\t") or lines[j].lstrip().startswith("#")):
                block.append(j)
                j += 1
            indents = [len(lines[k]) - len(lines[k].lstrip()) for k in block if lines[k].strip() and not lines[k].lstrip().startswith("#")]
            pad = " " * (min(indents) if indents else 2)
            existing = [k for k in block if re.match(rf"^{pad}profile\s*:", lines[k])]
            if existing:
                lines[existing[0]] = f"{pad}profile: {value}"
            else:
                lines.insert(i + 1, f"{pad}profile: {value}")
        else:
            raise InputError(hand)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        load_topology(path)
    except InputError as exc:
        path.write_text(text, encoding="utf-8")
        raise InputError(f"{hand} (writing it made the file invalid: {exc})") from None
    return ref


# ---- measuring -------------------------------------------------------------------------------------------
# Sizes below the main one at which two all-reduces at once are also timed: DDP's buckets.
PAIR_SIZES = (256 << 10, 1 << 20, 4 << 20)


@dataclass
class WorkerPlan:
    """What every calibration rank runs (written to a JSON file that all ranks read)."""

    ops: list[str]
    sizes: list[int]
    budget_s: float = 0.15
    sample_s: float = 0.02
    max_op_s: float = 0.5
    min_samples: int = 3
    # The budget decides below this. At 100 Mbit/s one 2 MiB all-reduce takes 182-228 ms (the
    # same cluster, minutes apart): the median of 9 moved 192-204 ms between calibrations, and
    # DDP's buckets sit there; a longer budget may now buy more samples.
    max_samples: int = 40
    backend: str = "gloo"  # nccl: the ranks' tensors on GPUs (each rank the GPU of its index)
    device: str = "cpu"
    out: str = ""
    extra: dict = field(default_factory=dict)
    busy_repeats: int = 21  # samples of the busy-progress measurement (0: skip it)
    busy_target_s: float = 0.03  # its all-reduce lasts about this long on an idle host
    # Samples of two all-reduces at once (0: skip it). The model's overlap turns a small change
    # of its figure into a large one of the idle link it fills (1 - x*S/T): at 100 Mbit/s two
    # calibrations of 7 read 93.7 and 86.5 ns/B, and the DDP CNN +6.9 and +1.5 % (one pair
    # spread 187-208 ms within a calibration). 21 cost 4-9 s more.
    pair_repeats: int = 21
    # The sweep visits every size this many times, each with a share of the budget, and the
    # two-at-once measurement runs a share after each visit: an op's level moves over seconds here.
    # At 100 Mbit/s the 1 MiB all-reduce's median read 93.3-99.8 ms in eight calibrations of one
    # cluster, each from one 4 s window (92.8-94.8 in eight with three passes), and the MLP's
    # model-mode iteration followed it (each profile within +-0.7 ms over three runs).
    sweep_passes: int = 3
    stall_repeats: int = 32  # samples per (size, gap) of the op-after-compute measurement (0: skip it)
    stall_groups: int = 4  # spread over this many fresh process groups
    stall_gaps_s: tuple[float, ...] = (0.002, 0.006, 0.02)  # the compute before each of its ops
    stall_budget_s: float = 60.0


def load_for_calibration(path: Path):
    """The topology to calibrate, where its profile goes (the file ``emulation.profile`` names, else ``<topology>.profile.json`` beside it), and whether the topology named it.

    A named profile that does not exist yet is what this run is about to write, so it is no error here.
    """
    from ..topology import load_topology
    from ..topology.resolve import named_profile

    path = Path(path)
    target = named_profile(path)
    topo = load_topology(path, profile_may_be_missing=True)
    if target is not None:
        return topo, target, True
    return topo, path.with_name(f"{path.stem}.profile.json"), False


def run_calibration(
    topology,
    ops: Sequence[Op],
    sizes: Sequence[int],
    *,
    max_op_s: float = 0.5,
    budget_s: float = 0.15,
    cluster: str | None = None,
    progress: Callable[[str], None] | None = None,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Bring the cluster up, measure ``ops`` at ``sizes`` among all ranks of ``topology``, fit; returns the profile."""
    from .validate import cluster_for, launch_real

    say = progress or (lambda msg: None)
    if topology.world_size < 2:
        raise InputError(f"{topology.source}: calibration needs at least 2 ranks, "
                         f"the topology has {topology.world_size}")
    backend, device = _backend_for(topology, topology.world_size, "the network part")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbox-calibrate-") as tmp:
        # The stall measurement takes the sweep's care: 100 of its per-size budgets, 5-60 s.
        plan = WorkerPlan([o.value for o in ops], list(sizes), budget_s=budget_s, max_op_s=max_op_s,
                          out=str(Path(tmp) / "measured.json"), stall_budget_s=min(60.0, max(5.0, 100 * budget_s)),
                          backend=backend, device=device)
        if backend != "gloo":  # the host-coupling figures are a CPU library's
            plan.busy_repeats = plan.pair_repeats = plan.stall_repeats = 0
        worker = _worker_command(plan, Path(tmp))
        with cluster_for(topology, cluster, say) as up:
            say(f"cluster {up.name} up; measuring {len(ops)} ops x up to {len(sizes)} sizes "
                f"on {topology.world_size} ranks ({backend})")
            _, codes = launch_real(up.name, topology, worker, None, timeout=timeout, record_only=False,
                                   log_dir=Path(tmp))
            measured = _read_measured(plan, codes, Path(tmp))
    n = topology.world_size
    fits = _fit_measured(measured, n)
    meta = _meta(t0, max_op_s, budget_s, sizes, measured)
    profile = make_profile(topology, fits, measured["ops"], measured.get("unsupported", {}), meta, backend)
    for key in ("busy_progress", "cpu_cost", "concurrency", "spin_stall"):
        if measured.get(key):
            profile[key] = measured[key]
    return profile


def run_intra_node(
    topology,
    ops: Sequence[Op],
    sizes: Sequence[int],
    *,
    max_op_s: float = 0.5,
    budget_s: float = 0.15,
    progress: Callable[[str], None] | None = None,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Measure ``ops`` at ``sizes`` among the ranks of one node on this machine, over its own fabric; the profile's ``intra_node`` part.

    No namespaces and no shaping: a node's ranks talk over what the node really has (loopback
    and shared memory for CPU ranks, NVLink or PCIe for GPUs with NCCL), so this machine stands
    for one node of the topology's first kind. Each CPU rank is pinned to its own core (round
    robin past the cores); a GPU rank uses the GPU of its index.
    """
    from ..emu.launch import child_pythonpath, free_port
    from .validate import rank_preexec, run_ranks

    say = progress or (lambda msg: None)
    node = topology.nodes[0]
    n = node.ranks
    if n < 2:
        raise InputError(f"{topology.source}: cluster.ranks_per_node: {n}: no intra-node part to calibrate "
                         f"(one rank per node)")
    backend, device = _backend_for(topology, n, "the intra-node part")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbox-calibrate-") as tmp:
        plan = WorkerPlan([o.value for o in ops], list(sizes), budget_s=budget_s, max_op_s=max_op_s,
                          out=str(Path(tmp) / "measured.json"), backend=backend, device=device,
                          busy_repeats=0, pair_repeats=0, stall_repeats=0)
        worker = _worker_command(plan, Path(tmp))
        say(f"measuring {len(ops)} ops x up to {len(sizes)} sizes among {n} ranks of one {node.device} node "
            f"on this machine ({backend})")
        base = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_")}
        port, path = free_port(), child_pythonpath()
        envs = [dict(base, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=path) for r in range(n)]
        cores = sorted(os.sched_getaffinity(0))
        pres = [rank_preexec(None, cores[r % len(cores)] if device == "cpu" else None) for r in range(n)]
        codes = run_ranks(worker, envs, pres, timeout=timeout, log_dir=Path(tmp))
        measured = _read_measured(plan, codes, Path(tmp))
    return {"ranks": n, "device": node.device, "library": library_info(backend),
            "ops": {k: v.as_dict() for k, v in _fit_measured(measured, n).items()},
            "unsupported": measured.get("unsupported", {}), "measurements": measured["ops"],
            "meta": _meta(t0, max_op_s, budget_s, sizes, measured)}


def _backend_for(topology, ranks: int, part: str) -> tuple[str, str]:
    """(backend, device) the real ranks measure with: the topology's library; NCCL needs a GPU per rank here."""
    if topology.emulation.library != "nccl":
        return "gloo", "cpu"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < ranks:
        raise InputError(f"{topology.source}: emulation.library: nccl: {part} runs one real rank per GPU on this "
                         f"machine ({ranks} ranks, {gpus} GPUs here); set library: gloo to calibrate with CPU ranks")
    return "nccl", "cuda"


def _worker_command(plan: "WorkerPlan", folder: Path) -> list[str]:
    """The calibration ranks' command line, with ``plan`` written beside it for every rank to read."""
    plan_file = folder / "plan.json"
    plan_file.write_text(json.dumps(asdict(plan)))
    return [sys.executable, "-m", "neuronabox.fidelity.calibrate", str(plan_file)]


def _read_measured(plan: "WorkerPlan", codes: list[int], logs: Path) -> dict:
    """What rank 0 wrote, or the ranks' failure with rank 0's last lines."""
    if any(codes) or not Path(plan.out).exists():
        log = logs / "rank0.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        raise _CalibrationFailed(f"the calibration ranks failed (exit codes {codes}): "
                                 f"{' | '.join(tail) or '(no output)'}")
    return json.loads(Path(plan.out).read_text())


def _meta(t0: float, max_op_s: float, budget_s: float, sizes: Sequence[int], measured: dict) -> dict[str, Any]:
    """How a part was measured: its time, limits, the sizes asked for and where ops were cut short."""
    return {"seconds": time.perf_counter() - t0, "max_op_s": max_op_s, "budget_s": budget_s,
            "sizes_requested": [min(sizes), max(sizes)], "truncated": measured.get("truncated", {})}


def _fit_measured(measured: dict, n: int) -> dict[str, OpFit]:
    fits: dict[str, OpFit] = {}
    for op_name, rows in measured["ops"].items():
        if len(rows) >= 2:
            fits[op_name] = fit_piecewise([r["size"] for r in rows], [r["time_s"] for r in rows], op_name, n)
        elif rows:  # barrier: one latency, no size
            big_l = ring_terms(Op.parse(op_name), n)[0] or 1.0
            t = rows[0]["time_s"]
            seg = Segment(0.0, math.inf, t, 0.0, t / big_l, math.inf, 1, rows[0]["size"], rows[0]["size"])
            fits[op_name] = OpFit(op_name, n, [seg], 0.0, 0.0)
    return fits


class _CalibrationFailed(InputError):
    exit_code = 1


def _worker(plan_path: str) -> None:
    """One calibration rank (``python -m neuronabox.fidelity.calibrate PLAN``): measure every op and size."""
    import torch
    import torch.distributed as dist

    plan = WorkerPlan(**json.loads(Path(plan_path).read_text()))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if plan.device == "cuda":
        # One GPU per rank, by its index; NCCL's ops are asynchronous on the GPU: sync() ends a timing.
        device = torch.device("cuda", int(os.environ.get("RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(plan.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    results: dict[str, list[dict]] = {}
    unsupported: dict[str, str] = {}
    truncated: dict[str, int] = {}

    def decide(values: list[float]) -> list[float]:
        # Every rank must run the same number of ops, and a timing is the slowest rank's: the max
        # is everyone's. A block of timings is gathered once after the block: an op gathering each
        # sample right after it slows the next (100 Mbit/s, 1 ms: 1 MiB 98.9-99.2 ms against
        # 92.3-94.2 with only the barrier between samples, 92.9-93.4 with compute).
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    passes = max(1, plan.sweep_passes)
    for op_name in plan.ops:
        op = Op.parse(op_name)
        rows: list[dict] = []
        for size in plan.sizes:
            try:
                call, nbytes = _op_call(op, size, rank, n, device)
                call()  # warm-up; also finds ops this library lacks
                sync()
                ok = 1.0
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                ok, why = 0.0, str(exc).splitlines()[0][:200]
            if decide([1.0 - ok])[0] > 0:
                if not rows:
                    unsupported[op.value] = why if ok == 0.0 else "failed on another rank"
                break
            dist.barrier()
            sync()
            t = time.perf_counter()
            call()
            sync()
            first = decide([time.perf_counter() - t])[0]
            k = max(1, min(1000, int(plan.sample_s / max(first, 1e-7))))
            samples_n = max(-(-plan.min_samples // passes),
                            min(plan.max_samples // passes, int(plan.budget_s / passes / max(first * k, 1e-7))))
            samples = _sweep_samples(call, k, samples_n, sync, decide)
            med = statistics.median(samples)
            rows.append({"size": nbytes, "time_s": med, "k": k, "samples": samples, "per_pass": samples_n})
            if rank == 0:
                print(f"{op.value:>14} {nbytes:>11} B  {med * 1e6:12.1f} us  (k={k}, {samples_n} samples)", flush=True)
            if op is Op.BARRIER:
                break  # no size
            if med > plan.max_op_s:
                truncated[op.value] = nbytes
                break
        if rows:
            results[op.value] = rows
    # Two all-reduces at once, in a share after each pass: its figure is a ratio of two times,
    # and both move with the level as the sweep's do.
    ar_rows = results.get(Op.ALL_REDUCE.value, [])
    pair_sizes = _pair_sizes(plan, ar_rows) if plan.pair_repeats > 0 and len(ar_rows) >= 2 else []
    pairs: dict[int, tuple[list[float], list[float]]] = {}
    for p in range(passes):
        if p > 0:
            for op_name, rows in results.items():
                op = Op.parse(op_name)
                for row in rows:
                    call, _ = _op_call(op, row["size"], rank, n, device)
                    call()
                    sync()
                    row["samples"] += _sweep_samples(call, row["k"], row["per_pass"], sync, decide)
                    row["time_s"] = statistics.median(row["samples"])
        for size in pair_sizes:
            single, two = _pair_samples(size, -(-plan.pair_repeats // passes), decide)
            singles, twos = pairs.setdefault(size, ([], []))
            singles.extend(single)
            twos.extend(two)
    busy = cpu = pair = stall = None
    if plan.stall_repeats > 0 and results.get(Op.ALL_REDUCE.value):
        stall = _spin_stall(plan, results[Op.ALL_REDUCE.value], decide)
        if rank == 0:
            for c in stall["cells"]:
                print(f"{c['gap_s'] * 1e3:.0f} ms after compute: a {c['size']} B all-reduce took "
                      f"{c['median_excess_s'] * 1e3:.2f} ms more than in the sweep (median); a rank spun in "
                      f"{c['spun']:.0%} of {len(c['samples'])} (median {c['median_spin_stall_s'] * 1e3:.2f} ms)", flush=True)
    if plan.busy_repeats > 0 and results.get(Op.ALL_REDUCE.value):
        busy = _busy_progress(plan, results[Op.ALL_REDUCE.value], decide)
        cpu = _cpu_cost(results[Op.ALL_REDUCE.value], n, decide)
        if rank == 0:
            print(f"busy progress: rate {busy['rate']:.3f} at {busy['size']} B "
                  f"(idle {busy['idle_s'] * 1e3:.2f} ms, computing {busy['compute_s'] * 1e3:.2f} ms)", flush=True)
        if rank == 0 and cpu:
            print(f"cpu cost per rank: {cpu['per_op_s'] * 1e6:.1f} us + {cpu['per_byte_s'] * 1e9:.3f} ns/B "
                  f"(all-reduce)", flush=True)
    if pairs:
        pair = _concurrency(ar_rows, n, pairs)
        if rank == 0:
            print(f"two at once: {pair['size']} B all-reduce {pair['single_s'] * 1e3:.2f} ms alone, "
                  f"{pair['pair_s'] * 1e3:.2f} ms for two", flush=True)
    if rank == 0:
        Path(plan.out).write_text(json.dumps({"ops": results, "unsupported": unsupported, "truncated": truncated,
                                              "busy_progress": busy, "cpu_cost": cpu, "concurrency": pair,
                                              "spin_stall": stall}))
    dist.destroy_process_group()


def _sweep_samples(call: Callable[[], object], k: int, count: int, sync, decide) -> list[float]:
    """``count`` samples of ``k`` back-to-back calls each, every rank starting each after a barrier; seconds per call, the slowest rank's."""
    import torch.distributed as dist

    samples = []
    for _ in range(count):
        dist.barrier()
        sync()
        t = time.perf_counter()
        for _ in range(k):
            call()
        sync()
        samples.append((time.perf_counter() - t) / k)
    return decide(samples)


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores; user, system, irq, softirq, steal)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


CPU_COST_MIN_BYTES = 64 << 10  # DDP's gradient buckets and up: the line must hold where training's ops are
CPU_COST_POINTS = 6


def cpu_cost_rows(rows: list[dict]) -> list[dict]:
    """The sweep rows the CPU cost is measured at: up to six, evenly spread over those from 64 KiB that take at most 0.2 s.

    The line fitted through them is what model mode spends for every op, so it has to hold at a
    gradient bucket's size. Three sizes of 5-200 ms (4, 16 and 64 MiB at 10 Gbit/s) put its
    intercept at 1.75 ms, and a 1 MiB all-reduce at 3.1 ms of CPU per rank, more than its 2.5 ms
    of wall time: the 10 Gbit/s MLP's backward lost 1.2 ms more to the footprint than to gloo
    (its second bucket issued 3.1 ms after the forward, 2.0 in the real system). Measured from
    128 KiB up, 1 MiB cost 1.5 ms and the fit 0.26 ms + 1.29 ns/B; the bucket issued at 1.8 ms.
    """
    picks = [r for r in rows if r["size"] >= CPU_COST_MIN_BYTES and r["time_s"] <= 0.2]
    if len(picks) <= CPU_COST_POINTS:
        return picks
    at = sorted({round(i * (len(picks) - 1) / (CPU_COST_POINTS - 1)) for i in range(CPU_COST_POINTS)})
    return [picks[i] for i in at]


def _cpu_cost(rows: list[dict], n: int, decide) -> dict | None:
    """CPU per rank that an all-reduce costs the host, as a line in the size; and the ranks' own share.

    Every rank of the calibration runs on this machine, so the machine's busy time while the
    ranks run k ops, less the idle machine's own rate, over k·n is one rank's share: gloo's
    threads, the kernel's TCP and softirqs, and, on an ``nbox up`` cluster, the relay that delays
    its links (at 100 Mbit/s 32 ms per 2 MiB all-reduce against 4.6 ms in each rank's process).
    That is what the compute beside the op loses on this host, so it is what model mode spends.
    ``process_per_byte_s`` (each rank's own process CPU) is kept for the record. Measured at the
    sizes of ``cpu_cost_rows``; each window lasts at least 1 s (the kernel counts in
    10 ms ticks), and the idle rate comes from 0.5 s idle windows before each, pooled (it was
    one 0.3 s window: 3 ticks of noise). The cost itself still varies between calibrations: at
    100 Mbit/s 5.6, 9.4 and 12.3 ns/B per rank with the shorter windows, 7.5, 9.8 and 9.6 in
    three with these (the relay's CPU per byte depends on how its reads fall).
    """
    import torch
    import torch.distributed as dist

    picks = cpu_cost_rows(rows)
    if not picks:
        return None
    idle_busy = idle_wall = 0.0
    windows, own = [], []
    for r in picks:
        dist.barrier()
        t, b = time.perf_counter(), _machine_busy_s()
        time.sleep(0.5)
        idle_busy += _machine_busy_s() - b
        idle_wall += time.perf_counter() - t
        x = torch.ones(max(1, r["size"] // 4))
        k = max(2, int(1.0 / r["time_s"]))
        dist.barrier()
        t, b, c = time.perf_counter(), _machine_busy_s(), time.process_time()
        for _ in range(k):
            dist.all_reduce(x)
        mine = torch.tensor([(time.process_time() - c) / k], dtype=torch.float64)
        dist.barrier()
        windows.append((float(x.numel() * 4), k, time.perf_counter() - t, _machine_busy_s() - b))
        dist.all_reduce(mine)
        own.append((float(x.numel() * 4), mine.item() / n))  # summed over the ranks: the same on each
    base_rate = decide([max(0.0, idle_busy / idle_wall)])[0]
    pts = [(size, decide([max(0.0, busy - base_rate * wall) / k / n])[0]) for size, k, wall, busy in windows]
    extra = {"points": pts, "idle_rate": base_rate,
             "process_per_byte_s": sum(y for _, y in own) / max(sum(x for x, _ in own), 1.0), "process_points": own}
    measured = [p for p in pts if p[1] > 0]
    if len(measured) < 2:  # one point (or none above the noise): all of it per byte
        per_byte = measured[0][1] / measured[0][0] if measured else 0.0
        return {"per_op_s": 0.0, "per_byte_s": per_byte, **extra}
    # The same line fit as the op times: relative error, intercept and slope >= 0.
    per_op, per_byte, _ = _line([p[0] for p in measured], [p[1] for p in measured])
    return {"per_op_s": per_op, "per_byte_s": per_byte, **extra}


def _after_barrier(call: Callable[[], object]) -> float:
    """Seconds ``call()`` took on this rank, every rank starting it after a barrier."""
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def _busy_progress(plan: WorkerPlan, rows: list[dict], decide) -> dict:
    """How fast an all-reduce progresses while every rank computes, relative to idle ranks (0..1).

    A sample: all ranks start an async all-reduce of S bytes, compute (matrix products on the
    main thread) for ``Tc`` = its time in the sweep, then wait; the op took ``T``, and ``W``
    idle. Work left after computing was ``W - r·Tc``, so ``T = Tc + W - r·Tc`` and
    ``r = 1 - (T - W)/Tc``. ``Tc ≈ W`` spans r = 0..1 over T = 2W..W, so a few ms of noise in
    one sample moves r little (with W/2 the rate at 100 Mbit/s swung between 0.6 and 1.0). Idle
    and busy samples alternate, so drift hits both; the rate is the median of 21 (of 9, it read
    0.71-1.00 in six calibrations of one 1 Gbit/s network).
    """
    import torch
    import torch.distributed as dist

    # The smallest measured size whose all-reduce lasts the target: long enough to time well.
    # Its sweep time is the compute window: agreed already, so every rank computes as long.
    row = next((r for r in rows if r["time_s"] >= plan.busy_target_s), rows[-1])
    x = torch.ones(max(1, row["size"] // 4))
    a = torch.randn(128, 128)
    tc = row["time_s"]

    def compute(until: float) -> int:
        done = 0
        while time.perf_counter() < until:
            torch.mm(a, a)
            done += 1
        return done

    def beside_op() -> None:
        t = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        beside.append(compute(t + tc))
        work.wait()

    idle, busy, alone, beside = [], [], [], []
    dist.all_reduce(x)
    for _ in range(plan.busy_repeats):
        # Samples are gathered once after the block: an op agreeing each right after it slowed
        # the next one timed (the sweep's lesson, 2a044bc).
        idle.append(_after_barrier(lambda: dist.all_reduce(x)))
        dist.barrier()
        alone.append(compute(time.perf_counter() + tc))  # the same compute with no op in flight
        busy.append(_after_barrier(beside_op))
    both = decide(idle + busy)
    idle, busy = both[:len(idle)], both[len(idle):]
    w = statistics.median(idle)
    rates = [max(0.0, min(1.0, 1.0 - (took - w) / tc)) for took in busy]
    # Compute each rank lost beside the op: its matrix products against the same window alone.
    rank, n = dist.get_rank(), dist.get_world_size()
    lost = torch.zeros(n, dtype=torch.float64)
    lost[rank] = w * max(0.0, 1.0 - statistics.median(beside) / max(statistics.median(alone), 1))
    dist.all_reduce(lost)
    return {"rate": statistics.median(rates), "size": x.numel() * 4, "idle_s": w, "compute_s": tc,
            "idle_samples": idle, "busy_samples": busy, "rates": rates, "lost_compute_s": lost.tolist()}


STALL_MIN_S = 0.3e-3  # a rank's CPU in an op beyond its fast runs: below this, noise, not a spin


def _spin_stall(plan: WorkerPlan, rows: list[dict], decide) -> dict:
    """The op's wall time beyond the sweep's and each rank's CPU beyond its fast runs, for ops issued after compute.

    Gloo's I/O thread handles a socket only when it gets the pair's lock without waiting; while
    another thread of the rank holds it, epoll reports the socket again and again and the I/O
    thread spins. With one core per rank the holder waits for that core, so the op stalls until
    the scheduler rotates, and the spin burns the rank's core meanwhile. Measured on the 2-core
    machine, 10 Gbit/s: after 20 ms of compute a 0.37 MB all-reduce took 3.4-6.5 ms where the
    sweep's back-to-back loop takes 0.6, and the slow ones spent that time in CPU on one or both
    ranks; after 2 ms of compute it stalled in some runs and not in others. So the gap matters:
    a sample is ``gap`` seconds of matrix products on every rank, then one all-reduce timed in
    wall and process CPU time per rank, in one block per cell and group. Kept per
    (size, gap): samples of (wall excess, CPU excess of rank 0, of rank 1, ...), each with the
    process group it ran in (``stall_groups`` fresh ones, as each stalls at a rate of its own).
    """
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    a = torch.randn(128, 128)
    # Three sizes a training step issues: a tiny op, a small bucket, DDP's first bucket (1 MiB);
    # of each, the largest that the sweep measured under 50 ms.
    picks: dict[int, float] = {}
    for want in (4, 256 << 10, 1 << 20):
        cands = [r for r in rows if r["size"] <= want and r["time_s"] < 0.05]
        if cands:
            picks[cands[-1]["size"]] = cands[-1]["time_s"]
    bufs = {size: torch.ones(max(1, size // 4)) for size in picks}
    cells = [(size, gap) for size in picks for gap in plan.stall_gaps_s]
    walls: dict[tuple, list[float]] = {c: [] for c in cells}
    cpus: dict[tuple, list[list[float]]] = {c: [] for c in cells}
    groups: dict[tuple, list[int]] = {c: [] for c in cells}
    per_group = max(1, plan.stall_repeats // plan.stall_groups)
    t_all = time.perf_counter()
    for gi in range(plan.stall_groups):
        # Each group is a fresh gloo context (its own threads and sockets), and how often its ops
        # stall is its own: 1 MiB after 2 ms, 0 to 21 of 22 in six groups of one process. A job
        # keeps one for its life, so the samples keep their group and a run draws from one.
        pg = dist.new_group(backend="gloo")
        for x in bufs.values():
            dist.all_reduce(x, group=pg)
        # A cell's samples run as one block, each op after the same compute and the same op: a
        # training step repeats one pattern. Cells interleaved stalled more (10 Gbit/s, 1 MiB
        # after 2 ms: a 4.0-5.6 ms median against 2.6-3.1 in blocks, three pairs of runs; 4 B
        # 0.9-2.4 against 0.6-0.9), more than DDP's ops did (its MLP's 1 MiB bucket 3.5-4.8 ms
        # with a 0.5 MiB one beside it). A block's first op follows another cell: left out.
        order = [cell for cell in cells for _ in range(per_group + 1)]
        mine = torch.zeros(len(order), n + 1, dtype=torch.float64)
        for i, (size, gap) in enumerate(order):
            # Compute, then the op, and nothing else between ops: as in a training step, the
            # op before is what the compute follows. A barrier (or an op gathering the figures)
            # before each made it stall more (10 Gbit/s, 0.37 MB after 6 ms: 6.7 ms median with
            # a barrier, 1.2 without); the figures are gathered once the group is done.
            until = time.perf_counter() + gap
            while time.perf_counter() < until:
                torch.mm(a, a)
            t, c = time.perf_counter(), time.process_time()
            dist.all_reduce(bufs[size], group=pg)
            mine[i, 0], mine[i, 1 + rank] = time.perf_counter() - t, time.process_time() - c
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=pg)
        for i, (cell, row) in enumerate(zip(order, mine.tolist())):
            if i % (per_group + 1) == 0:
                continue
            walls[cell].append(row[0])
            cpus[cell].append(row[1:])
            groups[cell].append(gi)
        dist.destroy_process_group(pg)
        if decide([time.perf_counter() - t_all])[0] > plan.stall_budget_s:
            break  # a slow network: what was measured will do

    def excess(values: list[float]) -> list[float]:
        base = sorted(values)[len(values) // 10]
        return [v - base if v - base >= STALL_MIN_S else 0.0 for v in values]

    cells_out = []
    for (size, gap), w in walls.items():
        # Wall time against the sweep's (what the profile's fit holds): an op after compute is
        # slower even when no rank spins (10 Gbit/s, 2 MiB: 3.8 ms at best, 2.6 in the sweep).
        # Signed: the sweep's own samples can be two modes (10 Gbit/s, 512 KiB: 0.55 ms or 2-3.6),
        # its median between them, and an op after compute that took the fast one took less.
        # Clamped at 0, the draws averaged more than the samples did: every sample's noise below
        # the sweep's median counted as none, every one above it as a stall.
        w_ex = [v - picks[size] for v in w]
        c_ex = list(zip(*[excess([c[r] for c in cpus[(size, gap)]]) for r in range(n)]))
        spun = [x for x, c in zip(w_ex, c_ex) if max(c) > 0]
        cells_out.append({"size": bufs[size].numel() * 4, "gap_s": gap, "swept_s": picks[size],
                          "samples": [[x, *c] for x, c in zip(w_ex, c_ex)], "groups": groups[(size, gap)],
                          "spun": len(spun) / len(w_ex), "median_excess_s": statistics.median(w_ex),
                          "median_spin_stall_s": statistics.median(spun) if spun else 0.0})
    return {"ranks": n, "cells": cells_out}


def _pair_sizes(plan: WorkerPlan, rows: list[dict]) -> list[int]:
    """The sizes ``_concurrency`` measures: the main one (the smallest that takes ``busy_target_s`` x 3) and DDP's bucket sizes below it."""
    main = next((r["size"] for r in rows if r["time_s"] >= 3 * plan.busy_target_s), rows[-1]["size"])
    return sorted({s for s in PAIR_SIZES if s < main} | {main})


def _concurrency(rows: list[dict], n: int, pairs: dict[int, tuple[list[float], list[float]]]) -> dict:
    """Link time per byte of all-reduce when two run at once (gloo runs two ops of a group together), by size.

    One all-reduce leaves the link idle part of its time (the ring waits on each step's
    reduction and round trip); a second op in flight fills it. Measured at 100 Mbit/s, 1 ms: a
    2.1 MB all-reduce alone 193 ms, with a 0.37 MB one issued 36 ms in 214 ms together where
    one after the other is 228. Two all-reduces of S bytes started together take ``T2``; their
    bytes share the link, so its time per byte is ``(T2 - t(4 B)) / 2S`` (the latency once).
    The main S is the smallest measured size that takes ``busy_target_s`` x 3 (long enough that
    the link, not the start, dominates); ``points`` adds DDP's bucket sizes below it, where the
    share differs: at 10 Gbit/s two 64 MiB ops read 1.4 ns/B, a 1 MiB and a 0.5 MiB one 2.9-4.0
    ms together against 3.3-4.6 one after the other (0.9 of serial, where the 64 MiB figure lets
    the model overlap a third of each). ``pairs``: per size, the samples of one alone and of two
    at once (``_pair_samples``); medians.
    """
    latency = rows[0]["time_s"]
    points = []
    for size, (single, two) in sorted(pairs.items()):
        t1, t2 = statistics.median(single), statistics.median(two)
        points.append({"size": size, "single_s": t1, "pair_s": t2,
                       "sec_per_byte": max(t2 - latency, 0.0) / (2 * size),
                       "single_samples": single, "pair_samples": two})
    top = points[-1]
    return {**top, "ranks": n, "points": [{k: v for k, v in pt.items() if not k.endswith("_samples")} for pt in points]}


def pair_ratios(concurrency: dict) -> list[tuple[int, float]]:
    """(size, two at once over one after the other) per size the profile's ``concurrency`` measured."""
    return [(pt["size"], pt["pair_s"] / (2 * pt["single_s"])) for pt in concurrency.get("points") or []
            if pt["single_s"] > 0]


def _pair_samples(size: int, repeats: int, decide) -> tuple[list[float], list[float]]:
    """Seconds of one all-reduce of ``size`` bytes alone and of two at once, alternating; the slowest rank's."""
    import torch
    import torch.distributed as dist

    a, b = torch.ones(max(1, size // 4)), torch.ones(max(1, size // 4))
    dist.all_reduce(a)

    def two() -> None:
        for w in [dist.all_reduce(x, async_op=True) for x in (a, b)]:
            w.wait()

    single, pair = [], []
    for _ in range(repeats):
        single.append(_after_barrier(lambda: dist.all_reduce(a)))
        pair.append(_after_barrier(two))
    both = decide(single + pair)
    return both[:repeats], both[repeats:]


def _op_call(op: Op, size: int, rank: int, n: int, device=None):
    """A zero-argument function running ``op`` on ``size`` bytes (nccl-tests size) on ``device``, and the bytes it really moves."""
    import functools

    import torch
    import torch.distributed as dist

    ones = functools.partial(torch.ones, device=device)
    empty = functools.partial(torch.empty, device=device)

    elems = max(1, size // 4)
    if op in _CHUNKED:
        elems = max(n, (elems + n - 1) // n * n)  # n equal chunks of at least one element
    nbytes = elems * 4
    if op is Op.ALL_REDUCE:
        x = ones(elems)
        return (lambda: dist.all_reduce(x)), nbytes
    if op is Op.BROADCAST:
        x = ones(elems)
        return (lambda: dist.broadcast(x, 0)), nbytes
    if op is Op.REDUCE:
        x = ones(elems)
        return (lambda: dist.reduce(x, 0)), nbytes
    if op is Op.ALL_GATHER:
        out, inp = empty(elems), ones(elems // n)
        return (lambda: dist.all_gather_into_tensor(out, inp)), nbytes
    if op is Op.REDUCE_SCATTER:
        inp, out = ones(elems), empty(elems // n)
        return (lambda: dist.reduce_scatter_tensor(out, inp)), nbytes
    if op is Op.ALL_TO_ALL:
        inp, out = ones(elems), empty(elems)
        return (lambda: dist.all_to_all_single(out, inp)), nbytes
    if op is Op.GATHER:
        inp = ones(elems // n)
        outs = [empty(elems // n) for _ in range(n)] if rank == 0 else None
        return (lambda: dist.gather(inp, outs, dst=0)), nbytes
    if op is Op.SCATTER:
        out = empty(elems // n)
        ins = [ones(elems // n) for _ in range(n)] if rank == 0 else None
        return (lambda: dist.scatter(out, ins, src=0)), nbytes
    if op is Op.SEND_RECV:
        # nccl-tests SendRecv: every rank sends to the next and receives from the previous, at once.
        send, recv = ones(elems), empty(elems)

        def sendrecv() -> None:
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % n),
                                           dist.P2POp(dist.irecv, recv, (rank - 1) % n)])
            for r in reqs:
                r.wait()

        return sendrecv, nbytes
    if op is Op.BARRIER:
        return (lambda: dist.barrier()), 0
    raise ValueError(f"{op.value} cannot be calibrated")


if __name__ == "__main__":
    _worker(sys.argv[1])
