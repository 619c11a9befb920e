"""The topology YAML file as pydantic models, and its JSON Schema.

Every quantity with a unit is a string (``100Gbps``, ``5us``); see ``neuronabox.units``, which
also holds the bounds of every number with a unit. The bounds of the structure are here: at most
``MAX_WORLD`` ranks (10 M), ``MAX_RANKS_PER_NODE`` ranks or NICs on a node (1,024), ``MAX_NODES``
nodes (100,000), a fat-tree radix of at most 128, slow-down factors within (0, 1000]. A node or
switch name is ``NAME_PATTERN``: 1-63 letters, digits, ``_``, ``.`` or ``-``, starting with a
letter or digit, because names become namespaces' hosts, log file names and command-line
arguments of the stub (``-rf`` or ``$(touch x)`` must never reach those).
Cross-field checks (a real rank beyond the world, a link to an unknown node) live in
``topology.resolve`` so that their errors can name the exact YAML path.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from ..collectives import Op
from ..units import (
    BANDWIDTH_EXAMPLES,
    DURATION_EXAMPLES,
    RATIO_EXAMPLES,
    parse_bandwidth,
    parse_latency,
    parse_ratio,
)


def _unit_schema(kind: str, examples: str) -> WithJsonSchema:
    return WithJsonSchema(
        {"type": "string", "description": f"a {kind} with a unit, e.g. {examples}", "examples": examples.split(", ")}
    )


Bandwidth = Annotated[float, BeforeValidator(parse_bandwidth), _unit_schema("bandwidth", BANDWIDTH_EXAMPLES)]
# Every duration of a topology is a latency (a link's, a switch's, a fabric's, an injected one):
# 0-60 s (units.MAX_LATENCY).
Duration = Annotated[float, BeforeValidator(parse_latency), _unit_schema("duration", DURATION_EXAMPLES)]
Ratio = Annotated[
    float,
    BeforeValidator(parse_ratio),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "number"}], "description": f"a fraction, e.g. {RATIO_EXAMPLES}"}),
]
MAX_WORLD = 10_000_000
MAX_RANKS_PER_NODE = 1024
MAX_NODES = 100_000
MAX_FACTOR = 1000.0
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"

PositiveInt = Annotated[int, Field(ge=1, strict=True)]
PerNode = Annotated[int, Field(ge=1, le=MAX_RANKS_PER_NODE, strict=True)]
Factor = Annotated[float, Field(gt=0, le=MAX_FACTOR, allow_inf_nan=False)]
Name = Annotated[str, Field(pattern=NAME_PATTERN,
                            description="1-63 letters, digits, '_', '.' or '-', starting with a letter or digit")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FabricKind(str, Enum):
    """What connects the ranks inside one node."""

    NVLINK = "nvlink"
    PCIE = "pcie"
    SHM = "shm"


# Per-rank, per-direction defaults; NVLink 4 (H100) is 900 GB/s both ways together.
FABRIC_DEFAULTS: dict[FabricKind, tuple[float, float]] = {
    FabricKind.NVLINK: (450e9, 1e-6),
    FabricKind.PCIE: (32e9, 2e-6),
    FabricKind.SHM: (20e9, 1e-6),
}


class IntraNode(_Strict):
    """The intra-node fabric: per-rank bandwidth (one direction) and rank-to-rank latency."""

    fabric: FabricKind = FabricKind.NVLINK
    bandwidth: Bandwidth | None = Field(None, description="per rank, per direction; default by fabric")
    latency: Duration | None = Field(None, description="rank-to-rank; default by fabric")

    def resolved(self) -> tuple[float, float]:
        """Bandwidth (B/s) and latency (s), with the fabric's defaults filled in."""
        bw, lat = FABRIC_DEFAULTS[self.fabric]
        return (self.bandwidth if self.bandwidth is not None else bw, self.latency if self.latency is not None else lat)


class LinkSpec(_Strict):
    """One network link (each direction has the full bandwidth)."""

    bandwidth: Bandwidth
    latency: Duration = 0.0
    jitter: Duration = 0.0
    loss: Ratio = 0.0


class LinkOverride(_Strict):
    bandwidth: Bandwidth | None = None
    latency: Duration | None = None
    jitter: Duration | None = None
    loss: Ratio | None = None


class ExplicitLink(LinkOverride):
    """A link of an explicit network: endpoints are node names (``node3``, ``node3:1`` for NIC 1) or switches."""

    endpoints: tuple[str, str]


class FatTree(_Strict):
    """A k-ary fat-tree (k pods of k/2 edge and k/2 aggregation switches, (k/2)^2 cores)."""

    k: int | None = Field(None, ge=2, le=128,
                          description="switch radix, even; default: the smallest that holds the nodes")
    oversubscription: float = Field(1.0, ge=1.0, le=MAX_FACTOR, allow_inf_nan=False,
                                    description="edge down:up bandwidth ratio")

    @field_validator("k")
    @classmethod
    def _even(cls, k: int | None) -> int | None:
        if k is not None and k % 2:
            raise ValueError(f"k must be even, got {k}")
        return k


class Rail(_Strict):
    """Rail-optimized: NIC i of every node on leaf i; leaves joined by spines."""

    spines: int | None = Field(None, ge=1, le=MAX_NODES, description="default: one per rail")
    spine_link: LinkOverride | None = None


NetworkType = Literal["ring", "switch", "fat-tree", "rail-optimized", "links"]


class Network(_Strict):
    """The inter-node network."""

    type: NetworkType = "switch"
    nics_per_node: int | None = Field(None, ge=1, le=MAX_RANKS_PER_NODE,
                                      description="default 1 (rail-optimized: ranks per node)")
    link: LinkSpec = Field(description="every link's parameters unless a link says otherwise")
    switch_latency: Duration = Field(0.0, description="forwarding latency per switch crossed")
    mtu: int = Field(1500, ge=576, le=9216, description="IP MTU; with library gloo (TCP) it sets the payload share of a link")
    fabric: Literal["ib", "roce", "efa", "tcp", "tcpxo"] = Field(
        "ib", description="the network's transport (InfiniBand, RoCE, AWS EFA, TCP sockets or GCP's GPUDirect-TCPX, "
        "GCP's GPUDirect-TCPXO of A3 Mega): picks the hardware profile"
    )
    fat_tree: FatTree | None = None
    rail: Rail | None = None
    switches: list[Name] = Field(default_factory=list, description="type links: switch names")
    links: list[ExplicitLink] = Field(default_factory=list, description="type links: the links")


class NodeOverride(_Strict):
    """What one node changes from the cluster's defaults (heterogeneous clusters)."""

    ranks: PerNode | None = None
    device: str | None = None
    compute_slowdown: Factor | None = Field(None, description="emulated compute on this node takes this many times longer")
    nics: PerNode | None = None
    intra_node: IntraNode | None = None


class NodeSpec(NodeOverride):
    """One node of an explicit node list."""

    name: Name | None = None


def _nodes_from_count(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a node count or a list of nodes, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"a cluster needs at least one node, got {value}")
        if value > MAX_NODES:  # checked before a list of that many entries is made
            raise ValueError(f"at most {MAX_NODES} nodes, got {value}")
        return [{} for _ in range(value)]
    if isinstance(value, list):
        if len(value) > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} nodes, got a list of {len(value)}")
        return value
    raise ValueError(f"expected a node count or a list of nodes, got {value!r}")


# The JSON Schema of `nodes` (count or list) is patched in json_schema(): WithJsonSchema here
# would drop NodeSpec from $defs.
Nodes = Annotated[list[NodeSpec], BeforeValidator(_nodes_from_count)]


class Cluster(_Strict):
    """The machines: how many nodes, how many ranks on each, and what they are."""

    nodes: Nodes
    ranks_per_node: PerNode = Field(1, description="GPUs (or CPU ranks) per node")
    device: str = Field("cpu", description="device type, e.g. H100, A100, cpu")
    overrides: dict[str, NodeOverride] = Field(
        default_factory=dict, description="per-node changes, keyed by node index, index range (4-7) or name"
    )

    @field_validator("overrides", mode="before")
    @classmethod
    def _keys_as_strings(cls, value: Any) -> Any:
        # YAML turns `3:` into an int key; the schema keys are strings.
        if isinstance(value, dict):
            return {str(k): v for k, v in value.items()}
        return value


Library = Literal["nccl", "gloo"]


class Emulation(_Strict):
    """Which ranks are real and how the rest are modeled."""

    real_ranks: list[Annotated[int, Field(ge=0, lt=MAX_WORLD, strict=True)]] = Field(default_factory=lambda: [0])
    library: Library = "nccl"
    algorithm: str = Field(
        "auto",
        description="auto, or an algorithm of the model (ring, tree, rhd, direct, hier-ring, …); model nccl also takes a "
        "list as NCCL_ALGO does (ring,tree; ^nvls,nvls_tree to disable NVLS)",
    )
    protocol: str = Field(
        "auto", description="auto, LL, LL128 or Simple (model nccl); a list as NCCL_PROTO takes it (Simple,LL128; ^LL)"
    )
    model: str = Field("alpha-beta", description="delay model: alpha-beta, nccl, flow, or a plugin's name")
    nccl_version: str = Field("2.28", description="NCCL release whose tuning constants the nccl model uses")
    nccl_tuner: Literal["auto", "nccl", "aws-ofi"] = Field(
        "auto",
        description="who picks the nccl model's algorithm/protocol: nccl (NCCL's own tuning), aws-ofi (the "
        "aws-ofi-nccl plugin's p5/p5e region tuner, where it applies), auto (aws-ofi when network.fabric is efa)",
    )
    min_channels: int | None = Field(
        None, ge=1, le=64, strict=True,
        description="NCCL_MIN_CTAS (NCCL_MIN_NCHANNELS): the nccl model runs each communicator on at least this many "
        "channels, as NCCL duplicates its rings; the algorithm NCCL picks stays that of its searched graph",
    )
    max_channels: int | None = Field(
        None, ge=1, le=64, strict=True,
        description="NCCL_MAX_CTAS (NCCL_MAX_NCHANNELS): the nccl model runs each communicator on at most this many channels",
    )
    hardware: str | None = Field(
        None,
        description="hardware profile that times the nccl model's choices: a shipped profile's name, a file (relative "
        "to this file's folder), or none for NCCL's own tuning times; default: the shipped profile matching the nodes",
    )
    gloo_threads: int = Field(
        2, ge=1, le=64, strict=True,
        description="worker threads per gloo process group (torch's ProcessGroupGloo Options.threads): with library "
        "gloo, model mode runs this many ops of a group at once; 1 makes it FIFO like NCCL's one stream",
    )
    peer_noise: bool = Field(
        False,
        description="emulated ranks' compute varies as the real rank's does: each iteration a group's slowest peer "
        "arrives as late as the slowest of its draws from the real rank's recent compute times (a synchronous job "
        "waits for it); off, every peer arrives with the real rank",
    )
    profile: str | None = Field(
        None,
        description="calibration profile (written by nbox calibrate) that model calibrated reads; a path, relative "
        "to this file's folder; naming one makes calibrated the default model",
    )

    @field_validator("protocol")
    @classmethod
    def _nccl_protocols(cls, value: str) -> str:
        # NCCL's protocols are the same for every model that has any: refuse a typo when the file loads.
        if value.strip().lower() != "auto":
            for name in value.strip().lstrip("^").split(","):
                if name.strip().lower() not in ("ll", "ll128", "simple"):
                    raise ValueError(f"{name.strip()!r} is not a protocol (auto, LL, LL128, Simple, or a list of them as NCCL_PROTO takes it)")
        return value

    @model_validator(mode="after")
    def _channel_bounds(self) -> "Emulation":
        if self.min_channels is not None and self.max_channels is not None and self.min_channels > self.max_channels:
            raise ValueError(f"min_channels {self.min_channels} is above max_channels {self.max_channels}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _profile_selects_calibrated(cls, value: Any) -> Any:
        # A profile is only read by the calibrated model: a file that names a profile and no
        # model means that model (one that names another model keeps it, for comparisons).
        if isinstance(value, dict) and value.get("profile") is not None and "model" not in value:
            return {**value, "model": "calibrated"}
        return value


class WhatIf(_Strict):
    """What-if knobs applied on top of the topology."""

    inject: dict[Op, Duration] = Field(default_factory=dict, description="extra latency per collective type")
    latency_scale: Factor = 1.0
    bandwidth_scale: Factor = 1.0
    stragglers: dict[Annotated[int, Field(ge=0, lt=MAX_WORLD)], Factor] = Field(
        default_factory=dict, description="rank -> compute slow-down factor"
    )
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD, strict=True)] | None = Field(
        None, description="grow or shrink the cluster to this many ranks")

    @field_validator("inject", mode="before")
    @classmethod
    def _op_names(cls, value: Any) -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                out[Op.parse(str(k)).value] = v
            return out
        return value


class TopologyFile(_Strict):
    """A NeuronaBox topology file."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="NeuronaBox topology")

    name: str | None = None
    description: str = ""
    cluster: Cluster
    intra_node: IntraNode = IntraNode()
    network: Network
    emulation: Emulation = Emulation()
    whatif: WhatIf = WhatIf()


def json_schema() -> dict[str, Any]:
    """The JSON Schema of topology files."""
    schema = TopologyFile.model_json_schema()
    nodes = schema["$defs"]["Cluster"]["properties"]["nodes"]
    nodes["minItems"] = 1
    schema["$defs"]["Cluster"]["properties"]["nodes"] = {
        "anyOf": [{"type": "integer", "minimum": 1}, nodes],
        "description": "a node count, or a list of nodes",
        "title": "Nodes",
    }
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
