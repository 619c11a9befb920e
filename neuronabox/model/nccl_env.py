"""NCCL's environment variables that limit what a communicator may run, applied to a topology for the nccl model.

On the real cluster NCCL reads NCCL_ALGO, NCCL_PROTO, NCCL_NVLS_ENABLE and the channel bounds from the
job's environment (cloud images set them: GCP's TCPXO profile runs Ring,Tree with Simple and NVLS off).
A job launched as it is there, its NCCL profile sourced and then ``nbox run``, gets the same limits in the
nccl model. What the topology's ``emulation`` section sets itself wins: it describes the emulated cluster.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import InputError
from ..topology import Topology

__all__ = ["VARIABLES", "from_environment"]

# (variable, emulation field); of two spellings of one bound the first set wins, as in NCCL (CTAS is the newer).
VARIABLES = (
    ("NCCL_ALGO", "algorithm"),
    ("NCCL_PROTO", "protocol"),
    ("NCCL_NVLS_ENABLE", "algorithm"),
    ("NCCL_MIN_CTAS", "min_channels"),
    ("NCCL_MIN_NCHANNELS", "min_channels"),
    ("NCCL_MAX_CTAS", "max_channels"),
    ("NCCL_MAX_NCHANNELS", "max_channels"),
)
_NVLS = ("nvls", "nvls_tree")


def from_environment(topology: Topology, environ: Mapping[str, str], model: str | None = None,
                     ) -> tuple[Topology, list[str]]:
    """The topology with the environment's NCCL limits where its emulation section leaves them open, and the
    ``NAME=value`` of each one taken; a value NCCL would not take is an InputError naming the variable.

    ``model``: the model that times it (default: the topology's); any other than nccl takes nothing.
    """
    if (model or topology.emulation.model) != "nccl":
        return topology, []
    from .nccl import NcclModel  # only now: a run on another model does not import it at start-up

    em = topology.emulation
    changes: dict[str, object] = {}
    taken: list[str] = []

    def take(name: str, field: str, value: object) -> None:
        changes[field] = value
        taken.append(f"{name}={environ[name]}")

    for name, field in VARIABLES:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        if name == "NCCL_NVLS_ENABLE":
            if raw not in ("0", "1", "2"):
                raise InputError(f"environment {name}={raw!r}: expected 0, 1 or 2")
            # Off takes NVLS out of what NCCL_ALGO left, unless the topology names the algorithm itself.
            if raw == "0" and (em.algorithm == "auto" or "algorithm" in changes):
                take(name, "algorithm", _without_nvls(str(changes.get("algorithm", "auto"))))
        elif field in ("algorithm", "protocol"):
            if getattr(em, field) == "auto":
                try:
                    take(name, field, NcclModel.check_choice(field, raw))
                except ValueError as exc:
                    raise InputError(f"environment {name}={raw!r}: {exc}") from None
        elif getattr(em, field) is None and field not in changes:
            count = int(raw) if raw.isdigit() else 0
            if not 1 <= count <= 64:
                raise InputError(f"environment {name}={raw!r}: expected a channel count from 1 to 64")
            take(name, field, count)
    if not changes:
        return topology, []
    lo, hi = changes.get("min_channels", em.min_channels), changes.get("max_channels", em.max_channels)
    if lo is not None and hi is not None and lo > hi:
        raise InputError(f"environment: NCCL's minimum channel count {lo} is above its maximum {hi}")
    return topology.with_changes(emulation=changes), taken


def _without_nvls(algorithm: str) -> str:
    # NCCL_NVLS_ENABLE=0 takes NVLS and NVLS tree out of whatever NCCL_ALGO leaves (nothing left: NCCL's ring backup).
    if algorithm == "auto":
        return "^" + ",".join(_NVLS)
    if algorithm.startswith("^"):
        names = algorithm[1:].split(",")
        return "^" + ",".join(dict.fromkeys(names + list(_NVLS)))
    kept = [a for a in algorithm.split(",") if a not in _NVLS]
    return ",".join(kept) if kept else "ring"
