"""A calibration profile as the calibrated model reads it: the ring closed form and the fitted segments.

``nbox calibrate`` (``neuronabox.fidelity``) measures and fits; this module holds what its
document is made of and how it is read back, so that the model reads a profile without
importing the calibration. ``ring_terms`` is the op's ring closed form ``L·alpha + F·S/B``
that both the fit and the model's scaling to other group sizes use.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..collectives import Op
from ..errors import InputError
from ..jsondoc import read_document

__all__ = ["FORMAT", "OpFit", "Segment", "load_profile", "ring_terms", "topology_hash"]

FORMAT = "neuronabox-calibration/1"


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


def topology_hash(topology) -> str:
    """Hash of what the measurement depends on: network, intra-node fabric, library (not what-ifs or node count)."""
    raw = topology.raw
    key = {"network": raw.get("network"), "intra_node": raw.get("intra_node"), "library": topology.emulation.library}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and check a profile; its op fits come back as ``OpFit`` under ``fits``."""
    p = Path(path)
    doc = read_document(p, f"calibration profile {str(p)!r}", FORMAT, "nbox calibrate writes one")
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
