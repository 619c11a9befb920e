"""Hardware profiles: what a GPU generation and its fabrics achieve, for the ``nccl`` model's times.

NCCL's tuning tables pick an algorithm and a protocol; they were never meant to predict times
(its latencies leave out the launch, its bandwidths are quantized guesses of line rate). A
hardware profile holds what a machine measurably achieves, in NCCL's own terms so that each
number has one meaning: per protocol, the per-channel bandwidth and the fraction of the
bottleneck link's line rate it reaches, the base and per-hop latencies, NVLS efficiency, and
the launch overhead every operation pays. The model keeps NCCL's choice and times it with the
profile (``neuronabox.model.nccl``).

A profile has a ``node`` section (groups inside one node: the link is the per-rank NVLink or
PCIe bandwidth) and a ``network`` section (groups across nodes: the link is the narrower of the
node's NICs and NVLink). Profiles ship as YAML files in ``model/hardware/``, keyed by ``match``
(device names, intra-node fabric, network fabric); a topology names one with
``emulation.hardware`` (a shipped name or a file), ``none`` for NCCL's own times, or inherits the
first shipped profile that matches its nodes. ``nbox calibrate --from-nccl-tests`` writes one.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import InputError
from .devices import compute_capability, known

__all__ = ["Section", "HardwareProfile", "Accuracy", "Resolved", "load_profile", "shipped_profiles", "resolve_sections",
           "nearest", "accuracy_note", "distinct", "PROTOCOLS", "NETWORK_FABRICS"]

PROTOCOLS = ("LL", "LL128", "Simple")
# tcpxo: GCP's GPUDirect-TCPXO (A3 Mega), which offloads what TCPX (A3 High, "tcp") leaves to the
# host: on one H100 generation and NIC speed the two reach line-rate shares 1.9x apart (all-gather).
NETWORK_FABRICS = ("ib", "roce", "efa", "tcp", "tcpxo")
SHIPPED = Path(__file__).with_name("hardware")

Latency = Annotated[float, Field(ge=0, le=1e5, allow_inf_nan=False)]  # µs
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
GBps = Annotated[float, Field(gt=0, le=1e5, allow_inf_nan=False)]
Overlap = Annotated[float, Field(ge=1, le=8, allow_inf_nan=False)]  # Section.overlap's exponent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PerProtocol(_Strict):
    """One value per NCCL protocol."""

    LL: float
    LL128: float
    Simple: float

    def get(self, proto: int) -> float:
        """The value of NCCL protocol index ``proto`` (0 LL, 1 LL128, 2 Simple)."""
        return (self.LL, self.LL128, self.Simple)[proto]


class Latencies(PerProtocol):
    """µs per protocol."""

    LL: Latency
    LL128: Latency
    Simple: Latency


class Fractions(PerProtocol):
    """A fraction (0, 1] per protocol."""

    LL: Fraction
    LL128: Fraction
    Simple: Fraction


class Bandwidths(PerProtocol):
    """GB/s per protocol."""

    LL: GBps
    LL128: GBps
    Simple: GBps


class Overlaps(PerProtocol):
    """How far each protocol's step latencies hide behind its transfer (1 to 8)."""

    LL: Overlap
    LL128: Overlap
    Simple: Overlap


class Section(_Strict):
    """What one scope (inside a node, or across nodes) achieves."""

    launch_us: Latency = Field(description="paid once by every operation: launch and kernel start (µs)")
    base_us: Latencies = Field(description="NCCL's baseLatencies for ring and tree, measured (µs)")
    hop_us: Latencies = Field(description="per ring/tree step inside a node (NCCL's NVLink/PCI hwLatencies), µs")
    net_hop_us: Latencies | None = Field(None, description="per step across nodes, beside the route's latency (µs)")
    channel_GBps: Bandwidths = Field(description="bus bandwidth one channel (one thread block) moves")
    efficiency: Fractions = Field(description="fraction of the bottleneck link's line rate reached with every channel")
    nvls_efficiency: Fraction = Field(0.6, description="NVLS: algorithm bandwidth as a fraction of NVLink line rate")
    nvls_us: Latency = Field(25.0, description="NVLS latency (µs)")
    tree_efficiency: Fraction = Field(1.0, description="tree bus bandwidth against ring's")
    half_bytes: float = Field(
        0.0, ge=0, le=1e12, allow_inf_nan=False,
        description="bytes per rank at which an operation reaches half its bandwidth (0: at once); published "
        "curves rise over three decades of size, more slowly than one latency and one bandwidth allow",
    )
    ramp_exponent: float = Field(1.0, gt=0, le=4, allow_inf_nan=False, description="how steeply it rises there (1: as a latency would)")
    overlap: Overlaps = Field(
        Overlaps(LL=1.0, LL128=1.0, Simple=1.0),
        description="how a collective's step latencies overlap its data movement once a channel has several slices "
        "in flight: time = launch + (latency^k + transfer^k)^(1/k); 1 adds them (one slice), large k takes the larger. "
        "Per protocol (one number is taken for all three): LL and LL128 carry a flag inside every 8- or 128-byte "
        "line, so data is consumed as it lands, where Simple waits for a flag written after each step's data",
    )

    @field_validator("overlap", mode="before")
    @classmethod
    def _one_overlap_for_all(cls, value: Any) -> Any:
        # Profiles written before the overlap was per protocol hold one number.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {p: value for p in PROTOCOLS}
        return value

    p2p_half_bytes: float = Field(
        0.0, ge=0, le=1e12, allow_inf_nan=False,
        description="direct transfers (all-to-all, send/recv): bytes per peer at which they reach half their "
        "bandwidth (0: at once); many small messages to many peers pay per-message costs a collective's ring does not",
    )
    p2p_ramp_exponent: float = Field(1.0, gt=0, le=4, allow_inf_nan=False, description="how steeply direct transfers rise there")


class Match(_Strict):
    """Which topologies inherit a shipped profile."""

    devices: list[str] = Field(description="device name prefixes (H100 matches H100-SXM)")
    intra: Literal["nvlink", "pcie", "shm"] = Field("nvlink", description="the nodes' intra_node.fabric")
    network: list[Literal["ib", "roce", "efa", "tcp", "tcpxo"]] = Field(
        default_factory=lambda: list(NETWORK_FABRICS), description="the topologies' network.fabric (default: any)")


Percent = Annotated[float, Field(ge=0, le=1e4, allow_inf_nan=False)]


class Accuracy(_Strict):
    """How far the profile's times are from the nccl-tests logs it was fitted on (sizes >= 1 MiB), and from others."""

    logs: int = Field(ge=1, description="the logs measured (those with sizes of 1 MiB and up)")
    mean_pct: Percent = Field(description="the median over those logs of each log's mean |time error|, per cent")
    largest_pct: Percent = Field(description="the largest |time error| of any size of any of them, per cent")
    unseen_pct: Percent | None = Field(
        None, description="mean_pct with each log's system left out of the fit (leave-one-out): what a machine the "
        "profile was not fitted on can expect; absent where the profile was fitted on one system")
    stand_in_pct: Percent | None = Field(
        None, description="mean_pct over the logs of systems it stood in for as the nearest generation's profile, "
        "each fitted without them (leave-one-out): what a generation without a profile of its own can expect")
    stand_in_logs: int | None = Field(None, ge=1, description="how many logs stand_in_pct is over")
    by: str = Field("", description="the command that measured it")


class HardwareProfile(_Strict):
    """A hardware profile file."""

    name: str = Field(min_length=1, max_length=64, description="what reports call it (emulation.hardware may name a shipped one)")
    description: str = ""
    match: Match | None = Field(None, description="which topologies inherit it (shipped profiles); none: only naming selects it")
    fitted_on: list[str] = Field(default_factory=list, description="the measurements it was fitted on")
    accuracy: Accuracy | None = Field(None, description="how well it times those measurements, and others")
    node: Section | None = Field(None, description="groups inside one node: the link is the per-rank NVLink or PCIe bandwidth")
    network: Section | None = Field(
        None, description="groups across nodes: the link is the narrower of the node's NICs and NVLink; needs net_hop_us")

    @field_validator("network")
    @classmethod
    def _net_hops(cls, value: Section | None) -> Section | None:
        if value is not None and value.net_hop_us is None:
            raise ValueError("a network section needs net_hop_us (the latency of a step across nodes)")
        return value

    def matches(self, device: str, intra: str, network: str) -> bool:
        """Whether a node of this device and fabrics inherits this profile."""
        if self.match is None:
            return False
        name = device.strip().upper()
        return (
            any(name.startswith(d.upper()) for d in self.match.devices)
            and intra == self.match.intra
            and network in self.match.network
        )


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile file; a bad one is refused with the file, field and value."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{p}: no such hardware profile") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{p}: YAML syntax error: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{p}: expected a mapping at the top level")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        raise InputError(f"{p}: {where}: {err['msg']}{shown}") from None


@functools.cache
def shipped_profiles() -> tuple[HardwareProfile, ...]:
    """The profiles in ``model/hardware/``, in file-name order."""
    return tuple(load_profile(f) for f in sorted(SHIPPED.glob("*.yaml")))


def named(value: str, source: str) -> HardwareProfile | None:
    """``emulation.hardware``: a shipped profile's name, a file (relative to ``source``'s folder), or none."""
    if value == "none":
        return None
    for prof in shipped_profiles():
        if prof.name == value:
            return prof
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = Path(source).resolve().parent / path
    if not path.exists():
        names = ", ".join(p.name for p in shipped_profiles())
        raise InputError(f"{source}: emulation.hardware: {value!r} is neither a shipped profile ({names}) nor a file")
    return load_profile(path)


def nearest(profiles, device: str, intra: str, network: str, scope: Literal["node", "network"]) -> HardwareProfile | None:
    """The profile with a ``scope`` section for the same fabrics and the GPU generation nearest ``device``'s (newer on a tie)."""
    if not known(device):  # no generation to be near to: NCCL's own times, as before
        return None
    cc = compute_capability(device)
    best: tuple[tuple[int, int], HardwareProfile] | None = None
    for prof in profiles:
        m = prof.match
        if m is None or getattr(prof, scope) is None or m.intra != intra or network not in m.network:
            continue
        theirs = compute_capability(m.devices[0])
        key = (abs(theirs - cc), -theirs)
        if best is None or key < best[0]:
            best = (key, prof)
    return best[1] if best else None


class Resolved(NamedTuple):
    """A topology's hardware sections, where they came from (for reports), and the profiles behind them."""

    node: Section | None
    network: Section | None
    where: str
    # (profile, whether it stands in as the nearest generation's), each profile once
    used: tuple[tuple[HardwareProfile, bool], ...] = ()


def resolve_sections(hardware: str | None, source: str, device: str, intra: str, network: str) -> Resolved:
    """The (node, network) sections a topology's nodes use, and where they came from (for reports)."""
    chosen = named(hardware, source) if hardware else None
    if hardware == "none":
        return Resolved(None, None, "none (NCCL's own tuning times)")
    node, net = (chosen.node, chosen.network) if chosen else (None, None)
    names = [chosen.name] if chosen else []
    used = [(chosen, False)] if chosen else []
    for prof in shipped_profiles():
        if (node is None or net is None) and prof.matches(device, intra, network):
            if node is None and prof.node is not None:
                node = prof.node
                names.append(prof.name)
                used.append((prof, False))
            if net is None and prof.network is not None:
                net = prof.network
                names.append(prof.name)
                used.append((prof, False))
    # No profile of this generation on these fabrics: the nearest generation's on the same fabrics.
    # Across nodes the NIC and its transport set what a profile holds more than the GPU does (an
    # A100 InfiniBand cluster timed by the H100 InfiniBand profile: 11.4 % mean error at >= 1 MiB,
    # by NCCL's own tuning times 18.1 %; benchmarks/results/published_accuracy.md, leave-one-out).
    if node is None and (prof := nearest(shipped_profiles(), device, intra, network, "node")) is not None:
        node = prof.node
        names.append(f"{prof.name} (nearest generation)")
        used.append((prof, True))
    if net is None and (prof := nearest(shipped_profiles(), device, intra, network, "network")) is not None:
        net = prof.network
        names.append(f"{prof.name} (nearest generation)")
        used.append((prof, True))
    return Resolved(node, net, " + ".join(dict.fromkeys(names)) or "none matched (NCCL's own tuning times)",
                    distinct(used))


def distinct(used) -> tuple[tuple[HardwareProfile, bool], ...]:
    """(profile, stand-in) pairs, each once, in order (profiles are not hashable: their lists)."""
    return tuple({(p.name, stand_in): (p, stand_in) for p, stand_in in used}.values())


def accuracy_note(profile: HardwareProfile, stand_in: bool = False) -> str:
    """One line on what error to expect of ``profile``'s times ('' where nothing was measured)."""
    a = profile.accuracy
    if stand_in:
        text = f"{profile.name} stands in for a GPU generation that no profile's logs measured on these fabrics: "
        if a is None or a.stand_in_pct is None:
            return text + "expect larger errors than on the logs it was fitted on"
        where = "the log" if a.stand_in_logs == 1 else f"the {a.stand_in_logs} logs"
        return text + f"where it stood in for one, off by {a.stand_in_pct:.1f} % on {where} (mean |time error| at >= 1 MiB)"
    if a is None:
        return ""
    logs = "the log" if a.logs == 1 else f"the {a.logs} logs"
    text = (f"{profile.name}: off by {a.mean_pct:.1f} % on {logs} it was fitted on (mean |time error| at >= 1 MiB"
            f"{', median over logs' if a.logs > 1 else ''}; largest {a.largest_pct:.1f} %), ")
    if a.unseen_pct is None:
        return text + "not measured on another machine"
    return text + f"{a.unseen_pct:.1f} % on a system left out of its fit"


def as_yaml(profile: HardwareProfile) -> str:
    """The profile as a YAML file (what ``nbox calibrate --from-nccl-tests`` writes)."""
    data: dict[str, Any] = profile.model_dump(exclude_none=True)
    for section in (data.get("node"), data.get("network")):
        if section and len(set(section["overlap"].values())) == 1:
            section["overlap"] = section["overlap"]["Simple"]  # one number for all three, as most profiles have
    return yaml.safe_dump(_rounded(data), sort_keys=False)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
