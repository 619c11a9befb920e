"""GPU device names and their CUDA compute capability: how NCCL and the hardware profiles tell generations apart."""

from __future__ import annotations

__all__ = ["compute_capability", "known", "DEFAULT_CC"]

# Device name prefix -> CUDA compute capability (x10). Unknown devices, CPUs included, get 80:
# Ampere is the middle of NCCL's tables and has no architecture-specific algorithms (NVLS).
_COMPUTE_CAPABILITY = (
    (("GB200", "GB300", "B200", "B100", "B300"), 100),
    (("GH200", "H100", "H200", "H800", "H20"), 90),
    (("L40S", "L40", "L4"), 89),  # Ada: Ampere's tables in NCCL; a generation of its own for the profiles
    (("A100", "A800", "A30"), 80),
    (("V100",), 70),
)
DEFAULT_CC = 80


def compute_capability(device: str) -> int:
    """NCCL's compute capability (e.g. 90) for a topology device name."""
    name = device.strip().upper()
    for prefixes, cc in _COMPUTE_CAPABILITY:
        if name.startswith(prefixes):
            return cc
    return DEFAULT_CC


def known(device: str) -> bool:
    """Whether ``device`` names a GPU generation in the table (not a CPU or another vendor's part)."""
    return device.strip().upper().startswith(tuple(p for prefixes, _ in _COMPUTE_CAPABILITY for p in prefixes))
