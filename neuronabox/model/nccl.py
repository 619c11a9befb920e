"""The ``nccl`` delay model: NCCL's own tuning model, reproduced from its source.

For every (algorithm, protocol) that NCCL would consider for a collective, NCCL's
``ncclTopoTuneModel`` precomputes a latency (µs) and an algorithm bandwidth (GB/s) at
communicator creation, and ``ncclTopoGetAlgoTime`` turns them into
``time_us = latency * latCount + bytes / (1000 * bw)``; the tuner takes the minimum. This
module does the same, with NCCL's inputs derived from the topology:

- nRanks = group size; nNodes = distinct nodes in the group; ppn = nRanks / nNodes.
- compute capability from ``node.device`` (``devices.compute_capability``), min and max over the group.
- intra link type: ``nvlink`` fabric -> NVLink (LL128 allowed, NVSwitch assumed, so NVLS when
  sm90+), ``pcie``/``shm`` -> PCI (no LL128, no NVLS).
- NCCL's channel search (src/graph/search.cc) is reproduced in its outcome, not its DFS: the
  first speed of NCCL's per-architecture speed array for which at least one channel fits,
  then as many channels as the per-rank NVLink/PCI bandwidth (``route_bandwidth`` between two
  ranks of a node) and the node's NICs (``route_bandwidth`` between ranks of two nodes, times
  min(nics, local ranks); each ring channel uses one NIC direction) allow, at most
  MAXCHANNELS/2; then NCCL's channel duplication (speed >= 25 GB/s: twice the channels at half
  the speed). NVLS channels: one per local GPU (NCCL forces minChannels = maxChannels), each
  loading every GPU's NVSwitch link once and its head's twice. bwIntra = bwInter = speed, as
  NCCL's inter-node search sets them.
- latencyInter = the topology's route latency between the group's nodes (mean over
  consecutive nodes), so ``whatif.latency_scale`` and link latencies move NCCL's interLat.
- CPU vendor for multi-node LL caps and network overhead: Intel x86 (NCCL's default branch).
- GPUDirect RDMA (NIC within PXN) is assumed for multi-node, which keeps LL128 enabled on
  NVLink systems, as on DGX/HGX machines.

Point-to-point operations (send/recv, all-to-all, gather, scatter) have no tuning model in
NCCL; they are modeled as direct transfers (see ``_P2P``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from ..collectives import Op
from ..errors import TopologyError
from ..topology import Topology
from ..topology.graph import ClusterGraph
from . import aws_ofi_tuner, hardware, schedules
from .devices import compute_capability
from .base import CommModel, Estimate, Group, Step, range_by_node

__all__ = ["NcclModel", "NCCL_RELEASE", "NCCL_SOURCE", "SUPPORTED_RELEASES"]

# ---------------------------------------------------------------------------------------------
# NCCL constants. Source: NVIDIA/nccl src/graph/tuning.cc (ncclTunerConstantsDefaults,
# nvlsEfficiency, treeCorrectionFactor, ncclTopoTuneModel, ncclTopoGetAlgoTime) at commit
# ebd1e929285881cb4df02c3459588a2e12b2d8c0: the last stored version before NCCL's SPDX/Apache
# relicensing, with the 2.28 Device API and GIN in the tree (2.28 series; the tag of that commit
# could not be confirmed from the stored copy). Speed arrays: src/graph/search.cc; NVLink and PCI
# widths: src/graph/topo.h. The Hopper/Ampere/Volta rows equal those of the following (2.29-era)
# commit 51c58fd6; only Blackwell rows differ between the two.
# ---------------------------------------------------------------------------------------------
NCCL_RELEASE = "2.28"
NCCL_SOURCE = "NVIDIA/nccl src/graph/tuning.cc @ ebd1e929285881cb4df02c3459588a2e12b2d8c0"
SUPPORTED_RELEASES = ("2.28",)

# Algorithm and protocol indices, as NCCL_ALGO_* / NCCL_PROTO_* (src/include/device.h).
TREE, RING, COLLNET_DIRECT, COLLNET_CHAIN, NVLS, NVLS_TREE, PAT = range(7)
LL, LL128, SIMPLE = range(3)
HW_NVLINK, HW_PCI, HW_NET = range(3)
VOLTA, AMPERE, HOPPER, BLACKWELL = range(4)  # NCCL_*_COMPCAP_IDX

ALGO_NAMES = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTO_NAMES = ("LL", "LL128", "Simple")

_CONSTANTS = {
    "2.28": {
        # baseLatencies[algo][proto], µs
        "base_lat": (
            (6.8, 14.0, 8.4), (6.6, 14.0, 8.4),  # Tree, Ring
            (0.0, 0.0, 0.0), (0.0, 0.0, 0.0),    # CollNet Direct, Chain
            (0.0, 0.0, 0.0), (0.0, 0.0, 0.0),    # NVLS, NVLS Tree
            (8.0, 8.0, 8.0),                     # PAT
        ),
        # hwLatencies[hw][algo][proto], µs
        "hw_lat": (
            (  # NVLINK
                (0.6, 1.25, 4.0), (0.6, 1.9, 3.4), (0, 0, 3.7), (0, 0, 2.8), (0, 0, 25.0), (0, 0, 25.0), (0, 0, 4.0),
            ),
            (  # PCI
                (1.0, 1.9, 4.0), (1.0, 2.5, 5.7), (0, 0, 3.7), (0, 0, 2.8), (0, 0, 0.0), (0, 0, 0.0), (0, 0, 4.0),
            ),
            (  # NET
                (5.0, 8.5, 14.0), (2.7, 4.0, 14.0), (0, 0, 31.0), (0, 0, 30.0), (0, 0, 18.0), (0, 0, 20.9),
                (0, 0, 14.0),
            ),
        ),
        # [compcap index or CPU vendor row][N1, N2, N4+], GB/s
        "ll_max_bws": ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0)),
        "per_ch_max_ring_ll128_bws": ((20.0,) * 3, (20.0,) * 3, (36.7,) * 3, (34.5, 34.6, 34.5)),
        "per_ch_max_tree_ll128_bws": ((20.0,) * 3, (20.0,) * 3, (36.7, 36.7, 29.0), (55.6, 31.67, 20.0)),
        "per_ch_max_tree_bws": ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0)),
        "per_ch_max_nvls_tree_bws": ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 43.8)),
        "nvls_efficiency": (0.0, 0.0, 0.85, 0.74),
        # Powers of two of nBytes>>6 (64 B .. 512 MB); applied to Tree all-reduce only.
        "tree_correction": (
            (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
            (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
            (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
        ),
        # getNetOverhead(): Intel x86 1 µs (x3 for Simple); AMD would be 2 µs.
        "net_overhead_us": 1.0,
        # search.cc speed arrays, GB/s per channel.
        "speed_intra": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
        "speed_inter": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2,
                        0.24, 0.12),
        "sm90_speed_intra": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
        "sm90_speed_inter": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24,
                             0.12),
        "sm100_speed_intra": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
        "sm100_speed_inter": (96.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0,
                              2.4, 1.2, 0.24, 0.12),
        "max_channels": 32,  # MAXCHANNELS/2: the graph search's limit before duplication
        "max_nvls_arity": 32,  # NCCL_MAX_NVLS_ARITY
        "dup_channel_speed": 25.0,  # duplicate channels when bwIntra >= 25 GB/s
    }
}


# NCCL functions (ncclFunc_t) that have a tuning model.
_BROADCAST, _REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _ALL_REDUCE = range(5)
_FUNC_OF_OP = {
    Op.BROADCAST: _BROADCAST,
    Op.REDUCE: _REDUCE,
    Op.ALL_GATHER: _ALL_GATHER,
    Op.REDUCE_SCATTER: _REDUCE_SCATTER,
    Op.ALL_REDUCE: _ALL_REDUCE,
    # torch's ProcessGroupNCCL barrier is an all-reduce of a one-element float tensor.
    Op.BARRIER: _ALL_REDUCE,
}
_BARRIER_BYTES = 4
_P2P_OPS = (Op.ALL_TO_ALL, Op.GATHER, Op.SCATTER, Op.SEND_RECV)


def _parse_choice(kind: str, value: str, names: Sequence[str]) -> tuple[tuple[str, ...] | None, str]:
    """The names ``value`` enables in NCCL_ALGO / NCCL_PROTO's syntax (case and ``_`` ignored; a leading ``^``
    excludes the list), None for auto, and the value's canonical spelling."""
    text = value.strip()
    if text.lower() == "auto":
        return None, "auto"
    exclude = text.startswith("^")
    by_key = {n.lower().replace("_", ""): n for n in names}
    listed = set()
    for part in text.lstrip("^").split(","):
        name = by_key.get(part.strip().lower().replace("_", ""))
        if name is None:
            env = "NCCL_ALGO" if kind == "algorithm" else "NCCL_PROTO"
            raise ValueError(
                f"{part.strip()!r}{f' in {value!r}' if part.strip() != text else ''} is not "
                f"a{'n' if kind[0] in 'aeiou' else ''} {kind} of model 'nccl' "
                f"(choose from auto, {', '.join(names)}; or a list as {env} takes it: {names[0]},{names[1]} or ^{names[-1]})"
            )
        listed.add(name)
    enabled = tuple(n for n in names if (n in listed) != exclude)
    if not enabled:
        raise ValueError(f"{value!r} leaves no {kind} of model 'nccl' enabled")
    canonical = ("^" if exclude else "") + ",".join(n for n in names if n in listed)
    return enabled, canonical


def _log2i(n: int) -> int:
    # NCCL's log2i: floor(log2(n)), -1 for 0.
    return n.bit_length() - 1


@dataclass(frozen=True)
class _Graph:
    """The outcome of NCCL's channel search for one pattern: channel count and per-channel GB/s."""

    n_channels: int
    bw_intra: float
    bw_inter: float


@dataclass(frozen=True)
class _Candidate:
    algo: int
    proto: int
    lat_us: float
    bw_gbps: float


class _P2P:
    """Direct transfers for NCCL's p2p-based operations.

    NCCL runs all-to-all, gather, scatter and send/recv as grouped ncclSend/ncclRecv, which have
    no tuning model. A transfer costs one ring/Simple step of NCCL latency (base + hw, plus the
    route latency between nodes when it crosses the network), and bytes move at the bottleneck:
    a rank's NVLink/PCI bandwidth for peers on its node, and its share of the node's NICs for
    peers elsewhere; all peers proceed concurrently, as NCCL spreads p2p over channels.
    """

    __slots__ = ("lat_intra_us", "lat_inter_us", "a2a_s_per_byte", "node_of", "local_count", "n",
                 "intra_bw", "nic_bw", "nic_share_bw", "half_bytes", "ramp_exponent")

    def __init__(self, lat_intra_us, lat_inter_us, node_of, local_count, n, intra_bw, nic_bw, nic_share_bw,
                 half_bytes=0.0, ramp_exponent=1.0):
        # With a hardware profile, the latencies include its launch and the bandwidths its Simple efficiency.
        self.lat_intra_us = lat_intra_us
        self.lat_inter_us = lat_inter_us
        self.node_of = node_of
        self.local_count = local_count
        self.n = n
        self.intra_bw = intra_bw  # bytes/s per rank
        self.nic_bw = nic_bw  # bytes/s of one NIC path
        self.nic_share_bw = nic_share_bw  # bytes/s per rank when every local rank uses the NICs
        worst = 0.0
        for local in local_count.values():
            worst = max(worst, self._spread(local, intra_bw, nic_share_bw))
        self.a2a_s_per_byte = worst
        # A profile's ramp: a peer's messages reach half the bandwidth at half_bytes each (per-message
        # costs of the NIC and of NCCL's p2p chunking); 0 leaves the plain latency + bytes / bandwidth.
        self.half_bytes = half_bytes
        self.ramp_exponent = ramp_exponent

    def _ramp(self, per_peer: float) -> float:
        # The bandwidth term's factor for messages of per_peer bytes (1: no ramp).
        if not self.half_bytes or per_peer <= 0:
            return 1.0
        return 1.0 + (self.half_bytes / per_peer) ** self.ramp_exponent

    def _spread(self, local: int, intra_bw: float, inter_bw: float) -> float:
        # Seconds per byte of the full buffer for one rank exchanging a 1/n chunk with every peer.
        intra = (local - 1) / self.n / intra_bw if local > 1 else 0.0
        inter = (self.n - local) / self.n / inter_bw if self.n > local else 0.0
        return max(intra, inter)

    def seconds(self, op: Op, nbytes: int, ranks: tuple[int, ...], root: int) -> float:
        """Duration of a p2p-based operation."""
        multi = len(self.local_count) > 1
        if op is Op.ALL_TO_ALL:
            lat = self.lat_inter_us if multi else self.lat_intra_us
            return lat * 1e-6 + nbytes * self.a2a_s_per_byte * self._ramp(nbytes / self.n)
        if op is Op.SEND_RECV:
            src, dst = ranks[root], ranks[(root + 1) % len(ranks)]
            ramp = self._ramp(nbytes)
            if self.node_of[src] == self.node_of[dst]:
                return self.lat_intra_us * 1e-6 + nbytes / self.intra_bw * ramp
            return self.lat_inter_us * 1e-6 + nbytes / self.nic_bw * ramp
        # Gather and scatter: the root's links carry every chunk; its NIC is its own.
        local = self.local_count[self.node_of[ranks[root]]]
        lat = self.lat_inter_us if local < self.n else self.lat_intra_us
        return lat * 1e-6 + nbytes * self._spread(local, self.intra_bw, self.nic_bw) * self._ramp(nbytes / self.n)


class _GroupTables:
    """Everything NCCL derives at communicator creation, for one group."""

    __slots__ = ("candidates", "p2p", "n_ranks", "n_nodes", "n_channels", "min_cc", "ring_order", "node_ranks",
                 "hw", "hw_c", "line_gbps", "nvlink_gbps", "hw_lat", "ppn", "intra_hw", "lat_inter_us", "node_net_gbps",
                 "tuned")

    def __init__(self, candidates, p2p, n_ranks, n_nodes, n_channels, min_cc, ring_order, node_ranks, hw=None,
                 hw_c=None, line_gbps=math.inf, nvlink_gbps=math.inf, ppn=1.0, intra_hw=HW_NVLINK, lat_inter_us=0.0,
                 node_net_gbps=math.inf, tuned=None):
        self.candidates: dict[int, tuple[_Candidate, ...]] = candidates
        self.p2p: _P2P = p2p
        self.n_ranks = n_ranks
        self.n_nodes = n_nodes
        self.n_channels = n_channels
        self.min_cc = min_cc
        self.ring_order: tuple[int, ...] = ring_order
        self.node_ranks: tuple[tuple[int, ...], ...] = node_ranks
        self.hw: hardware.Section | None = hw  # the hardware profile's section that times this group
        self.hw_c = hw_c  # NCCL's constants with the profile's latencies in place
        self.line_gbps = line_gbps  # the bottleneck link's line rate, GB/s per rank (NVLink/PCIe, or the NICs)
        self.nvlink_gbps = nvlink_gbps
        self.hw_lat: dict[tuple[int, int, int], tuple] = {}  # (func, algo, proto) -> _hw_terms, filled on use
        # The AWS tuner plugin's picks, bytes -> candidate or None (NCCL's own), filled on use; None: no plugin.
        self.tuned: dict[int, _Candidate | None] | None = tuned
        self.ppn = ppn
        self.intra_hw = intra_hw
        self.lat_inter_us = lat_inter_us
        self.node_net_gbps = node_net_gbps  # every NIC of a node together, GB/s (inf: one node)


class NcclModel(CommModel):
    """NCCL's tuning model (ncclTopoTuneModel + ncclTopoGetAlgoTime) for the topology's release."""

    name = "nccl"
    description = "NCCL's own tuning model (src/graph/tuning.cc): min over algorithm x protocol of latency + bytes/bw"
    algorithms = ("ring", "tree", "nvls", "nvls_tree", "pat")
    protocols = PROTO_NAMES

    @classmethod
    def check_choice(cls, kind: str, value: str) -> str:
        """One name, or a list as NCCL_ALGO / NCCL_PROTO take it (``ring,tree``, ``^nvls,nvls_tree``), made canonical."""
        return _parse_choice(kind, value, cls.algorithms if kind == "algorithm" else cls.protocols)[1]

    def __init__(self, topology: Topology, graph: ClusterGraph | None = None, **choices: str | None):
        # algorithm/protocol are checked against `algorithms`/`protocols` by the registry.
        super().__init__(topology, graph, **choices)
        version = topology.emulation.nccl_version
        release = next((r for r in SUPPORTED_RELEASES if version == r or version.startswith(r + ".")), None)
        if release is None:
            raise TopologyError(
                topology.source,
                "emulation.nccl_version",
                f"no tuning constants for NCCL {version!r} (supported releases: {', '.join(SUPPORTED_RELEASES)})",
            )
        self.release = release
        self.c = _CONSTANTS[release]
        enabled = {}
        for kind, value, names in (("algorithm", self.algorithm, self.algorithms), ("protocol", self.protocol, self.protocols)):
            try:
                enabled[kind] = _parse_choice(kind, value, names)[0]
            except ValueError as exc:
                raise TopologyError(topology.source, f"emulation.{kind}", str(exc)) from None
        algos, protos = enabled["algorithm"], enabled["protocol"]
        # The enabled sets (None: NCCL's defaults), and whether LL128 was named outright, which turns it on
        # where NCCL's default leaves it off (pEnable 1, not 2); "^LL" leaves LL128 at its default.
        self._algos = None if algos is None else frozenset(ALGO_NAMES.index(a) for a in algos)
        self._protos = None if protos is None else frozenset(PROTO_NAMES.index(p) for p in protos)
        self._ll128_named = protos is not None and "LL128" in protos and not self.protocol.strip().startswith("^")
        self._tables: dict[Group, _GroupTables] = {}
        self._sections: dict[tuple[str, str], tuple] = {}
        self._override: tuple | None = None  # use_hardware's sections
        self.hardware_source = ""  # where the hardware sections came from, for reports
        self.hardware_used: tuple[tuple[hardware.HardwareProfile, bool], ...] = ()  # and the profiles, for their accuracy

    def accuracy_notes(self) -> list[str]:
        """What error the hardware profiles behind the times so far showed against measurements, one line each."""
        return [note for prof, stand_in in self.hardware_used if (note := hardware.accuracy_note(prof, stand_in))]

    def use_hardware(self, node: hardware.Section | None, network: hardware.Section | None) -> None:
        """Time every group with these sections from now on, whatever the topology names (what a fit tries)."""
        self._override = (node, network)
        self._tables.clear()

    def group_tables(self, group: Group) -> _GroupTables:
        """What NCCL derives for ``group`` at communicator creation (made once, then cached)."""
        tables = self._tables.get(group)
        if tables is None:
            tables = self._tables[group] = self._derive(group)
        return tables

    def hardware_sections(self, device: str, intra: str) -> tuple[hardware.Section | None, hardware.Section | None]:
        """The (node, network) sections of the hardware profile for nodes of this device and fabric."""
        if self._override is not None:
            return self._override
        key = (device, intra)
        if key not in self._sections:
            topo = self.topology
            found = hardware.resolve_sections(
                topo.emulation.hardware, topo.source, device, intra, topo.network.fabric
            )
            self._sections[key] = (found.node, found.network)
            self.hardware_source = found.where
            # Every profile behind the groups timed so far (a mixed cluster resolves one per node kind).
            self.hardware_used = hardware.distinct(self.hardware_used + found.used)
        return self._sections[key]

    # ---- hot path -----------------------------------------------------------------------------
    def estimate(self, op: Op, nbytes: int, group: Group | Sequence[int], root: int = 0) -> Estimate:
        """Duration and breakdown of one collective of ``nbytes`` (nccl-tests size) over ``group``."""
        group = Group.of(group)
        tables = self._tables.get(group) or self.group_tables(group)
        if tables.n_ranks == 1:
            # NCCL returns at once for a single rank (the cost table is Ring/Simple = 0).
            return Estimate(0.0, "ring", "Simple", None)
        if nbytes <= 0 and op not in (Op.SEND_RECV, Op.BARRIER):
            # NCCL drops a collective of count 0 before it is queued (taskAppend), and nccl-tests reads
            # 0.13-0.25 us for such rows, all-to-all's too: nothing is launched.
            return Estimate(0.0, "ring", "Simple", None)
        if not 0 <= root < tables.n_ranks:
            root = 0
        if op in _P2P_OPS:
            seconds = tables.p2p.seconds(op, nbytes, group.ranks, root)
            builder = functools.partial(_p2p_steps, op, nbytes, group.ranks, root, seconds)
            return Estimate(seconds, "p2p", "Simple", builder)
        if op is Op.BARRIER:
            nbytes = _BARRIER_BYTES
        func = _FUNC_OF_OP[op]
        best = None
        best_us = math.inf
        # NCCL's tuner picks the fastest it believes in; with a hardware profile, the fastest the
        # measured hardware gives among the same candidates (NCCL's tables are tuned on real
        # machines, so its picks follow them where the two agree; where the profile shows its
        # guess far off, keeping its pick would make a larger size faster than a smaller one).
        timer = self._hw_time if tables.hw is not None else self._algo_time
        # On AWS p5/p5e the aws-ofi-nccl tuner plugin forces its own pick by (bytes, ranks) region.
        if tables.tuned is not None and func == _ALL_REDUCE:
            best = self._plugin_pick(tables, func, nbytes)
        if best is not None:
            best_us = timer(tables, func, best, nbytes)
        else:
            for cand in tables.candidates[func]:
                us = timer(tables, func, cand, nbytes)
                if us < best_us:
                    best_us, best = us, cand
        seconds = best_us * 1e-6
        builder = functools.partial(
            _collective_steps, func, best.algo, nbytes, tables, group.ranks[root], seconds, best.lat_us * 1e-6
        )
        return Estimate(seconds, ALGO_NAMES[best.algo], PROTO_NAMES[best.proto], builder)

    def _plugin_pick(self, t: _GroupTables, func: int, nbytes: int) -> _Candidate | None:
        """The candidate the aws-ofi-nccl tuner forces for ``nbytes`` (None: NCCL's own argmin), cached per size."""
        if nbytes in t.tuned:
            return t.tuned[nbytes]
        cands = t.candidates[func]
        pick = aws_ofi_tuner.choose("all_reduce", nbytes, t.n_ranks, {(c.algo, c.proto) for c in cands})
        best = next((c for c in cands if (c.algo, c.proto) == pick), None) if pick else None
        if len(t.tuned) > 4096:  # many distinct sizes (a sweep): keep the cache bounded
            t.tuned.clear()
        t.tuned[nbytes] = best
        return best

    def _tuner_plugin(self, device: str, n_ranks: int, n_nodes: int) -> bool:
        """Whether NCCL runs with the aws-ofi-nccl tuner for this communicator (emulation.nccl_tuner)."""
        mode = self.topology.emulation.nccl_tuner
        if mode == "nccl":
            return False
        if mode == "auto" and self.topology.network.fabric != "efa":
            return False
        return aws_ofi_tuner.applies(device, n_ranks, n_nodes)

    def _algo_time(self, t: _GroupTables, func: int, cand: _Candidate, nbytes: int) -> float:
        """ncclTopoGetAlgoTime with numPipeOps = 1, in µs."""
        bw = cand.bw_gbps
        lat = cand.lat_us
        log_size = _log2i(nbytes >> 6)
        if cand.algo == TREE and func == _ALL_REDUCE and 0 <= log_size < 23:
            bw *= self.c["tree_correction"][cand.proto][log_size]
        elif cand.algo == NVLS_TREE and func == _ALL_REDUCE and 0 <= log_size < 24 and t.min_cc >= 100:
            bw *= self.c["tree_correction"][cand.proto][log_size]  # x86 hosts, which we assume
        elif (
            cand.algo == RING and cand.proto == SIMPLE and t.n_nodes > 1 and func == _ALL_REDUCE
            and nbytes // (t.n_channels * t.n_ranks) >= 64
        ):
            lat *= 1.9 if t.min_cc < 80 else 1.4  # NCCL's "plateau effect of ring"
        return lat + nbytes / (1000.0 * bw)

    def _hw_time(self, t: _GroupTables, func: int, cand: _Candidate, nbytes: int) -> float:
        """What the profiled hardware takes for one of NCCL's candidates, in µs (the hot path: arithmetic on cached terms)."""
        terms = t.hw_lat.get((func, cand.algo, cand.proto))
        if terms is None:
            terms = t.hw_lat[(func, cand.algo, cand.proto)] = self._hw_terms(t, func, cand)
        lat, threshold, ch_bw, cap, mult, k = terms
        h = t.hw
        if threshold:
            # NCCL runs small operations on fewer channels than the communicator has (enqueue's
            # `while (nBytes < nc*nt*threadThreshold) nc--`); each channel moves channel_GBps.
            # Continuous here, so that a time never drops as the bytes grow.
            nc = max(1.0, min(t.n_channels, nbytes / threshold))
            bw = min(nc * ch_bw, cap) * mult
        else:
            bw = cap
        transfer = nbytes / (1000.0 * bw)
        if h.half_bytes and nbytes:
            transfer *= 1.0 + (h.half_bytes * t.n_ranks / nbytes) ** h.ramp_exponent
        if k != 1.0 and transfer > 0:
            # Pipelining: NCCL keeps several slices of a channel in flight (NCCL_STEPS), so once the
            # transfer is long the per-step handshakes hide behind it; the launch never does.
            steps = lat - h.launch_us
            return h.launch_us + (steps ** k + transfer ** k) ** (1.0 / k)
        return lat + transfer

    def _hw_terms(self, t: _GroupTables, func: int, cand: _Candidate) -> tuple[float, float, float, float, float, float]:
        """(latency µs, channel threshold bytes or 0, GB/s a channel, GB/s cap, algorithm factor, overlap) of a candidate."""
        h = t.hw
        a, p = cand.algo, cand.proto
        n = t.n_ranks
        nsteps = _nsteps(func, n)
        hw_ring = t.intra_hw if t.n_nodes == 1 else HW_NET
        lat = h.launch_us + self._latency(func, a, p, n, t.n_nodes, t.ppn, nsteps, t.intra_hw, hw_ring, t.lat_inter_us,
                                          t.hw_c)
        k = h.overlap.get(p)
        # Across nodes NVLS tree and tree move the buffer over NCCL's double binary tree, whose
        # busiest node carries _tree_load times the buffer on its NICs.
        tree_net = t.node_net_gbps / _tree_load(t.n_nodes)
        if a in (NVLS, NVLS_TREE):
            # NVSwitch reduces and multicasts: every rank's NVLink carries the data about once each way.
            algbw = h.nvls_efficiency * t.nvlink_gbps
            if func != _ALL_REDUCE:
                algbw *= n / (n - 1)
            if a == NVLS_TREE:
                algbw = min(algbw, h.efficiency.Simple * min(t.nvlink_gbps, tree_net))
            return lat, 0.0, 0.0, algbw, 1.0, k
        threshold = _MAX_THREADS[p] * _THREAD_THRESHOLD[p] * (n if (a == RING and p == LL) else 1)
        if a == TREE:
            # NCCL's tree: a chain inside each node, whose GPU links carry the buffer twice (NCCL's
            # tuning halves the tree's bandwidth); a ring sends 2(n-1)/n of it per rank instead.
            tree_line = min(0.5 * t.nvlink_gbps, t.line_gbps if t.n_nodes == 1 else tree_net)
            return lat, threshold, h.channel_GBps.get(p), h.efficiency.get(p) * tree_line, h.tree_efficiency, k
        mult = 1.0
        if a == PAT:
            mult = 0.75
        elif not (a != RING and func in (_ALL_GATHER, _REDUCE_SCATTER)):
            mult = n / nsteps
        return lat, threshold, h.channel_GBps.get(p), h.efficiency.get(p) * t.line_gbps, mult, k

    # ---- communicator creation ----------------------------------------------------------------
    def _derive(self, group: Group) -> _GroupTables:
        topo, g, c = self.topology, self.graph, self.c
        ranks = group.ranks
        if isinstance(ranks, range):  # a large run of consecutive ranks: one range a node, not a list
            by_node: dict[int, list[int] | range] = range_by_node(ranks, topo)
        else:
            by_node = {}
            for r in ranks:
                by_node.setdefault(topo.rank_node[r], []).append(r)
        node_ranks = tuple(v if isinstance(v, range) else tuple(v) for v in by_node.values())
        n_ranks, n_nodes = len(ranks), len(by_node)
        if n_ranks == 1:
            return _GroupTables({}, None, 1, 1, 1, 0, ranks, node_ranks)
        nodes = [topo.nodes[i] for i in by_node]
        ccs = [compute_capability(nd.device) for nd in nodes]
        min_cc, max_cc = min(ccs), max(ccs)
        cc_idx = BLACKWELL if min_cc >= 100 else HOPPER if min_cc >= 90 else AMPERE if min_cc >= 80 else VOLTA
        nvlink = all(nd.fabric.value == "nvlink" for nd in nodes)
        intra_hw = HW_NVLINK if nvlink else HW_PCI
        ppn = n_ranks / n_nodes
        max_local = max(len(v) for v in node_ranks)
        # NCCL's ring visits a node's GPUs before leaving it; group order within nodes is kept.
        ring_order = ranks if isinstance(ranks, range) else tuple(r for v in node_ranks for r in v)

        # Per-rank intra bandwidth (GB/s) and the nodes' NIC bandwidth, from the graph (what-ifs applied).
        intra_bps = min((g.route_bandwidth(v[0], v[1]) for v in node_ranks if len(v) > 1), default=math.inf)
        nic_bps, lat_inter_s = math.inf, 0.0
        if n_nodes > 1:
            firsts = [v[0] for v in node_ranks]
            # Consecutive nodes in ring order; two nodes have one pair of directions, not two.
            pairs = list(zip(firsts, firsts[1:] + firsts[:1]))[: 1 if n_nodes == 2 else n_nodes]
            nic_bps = min(g.route_bandwidth(a, b) for a, b in pairs)
            lat_inter_s = sum(g.route_latency(a, b) for a, b in pairs) / len(pairs)
        nics = min(min(nd.nics for nd in nodes), min(len(v) for v in node_ranks))
        intra_gbps = intra_bps / 1e9
        nic_gbps = nic_bps / 1e9
        ring_graph = self._search(min_cc, intra_gbps, nic_gbps, nics, n_nodes)
        nvls_support = nvlink and min_cc >= 90 and max_local >= 2
        nvls_graph = self._search_nvls(min_cc, intra_gbps, nic_gbps * nics, max_local) if nvls_support else None

        candidates = {
            func: tuple(
                self._tune(func, n_ranks, n_nodes, ppn, cc_idx, min_cc, max_cc, intra_hw, nvlink, ring_graph,
                           nvls_graph, lat_inter_s * 1e6, self._algos, self._protos)
            )
            for func in range(5)
        }

        node_sec, net_sec = self.hardware_sections(nodes[0].device, nodes[0].fabric.value)
        hw = node_sec if n_nodes == 1 else net_sec
        hw_c = _with_profile(c, hw, intra_hw) if hw is not None else None
        lat_intra_us = c["base_lat"][RING][SIMPLE] + c["hw_lat"][intra_hw][RING][SIMPLE]
        lat_inter_us = c["base_lat"][RING][SIMPLE] + c["hw_lat"][HW_NET][RING][SIMPLE] + lat_inter_s * 1e6
        p2p_intra_bps, p2p_nic_bps = intra_bps, nic_bps
        if hw is not None:
            # Direct transfers go at Simple's achieved share of the links, after the launch.
            lat_intra_us = hw.launch_us + hw.base_us.Simple + hw.hop_us.Simple
            if hw.net_hop_us is not None:  # a network section (a node section times one node only)
                lat_inter_us = hw.launch_us + hw.base_us.Simple + hw.net_hop_us.Simple + lat_inter_s * 1e6
            p2p_intra_bps *= hw.efficiency.Simple
            p2p_nic_bps *= hw.efficiency.Simple
        node_of = topo.rank_node  # read for the group's ranks only: the topology's own map, not a copy per rank
        local_count = {topo.rank_node[v[0]]: len(v) for v in node_ranks}
        # Measured hardware: p2p spreads over every NIC of the node (PXN), more NICs than GPUs too.
        p2p_nics = min(nd.nics for nd in nodes) if hw is not None else nics
        nic_share = p2p_nic_bps * p2p_nics / max_local if n_nodes > 1 else math.inf
        p2p = _P2P(lat_intra_us, lat_inter_us, node_of, local_count, n_ranks, p2p_intra_bps, p2p_nic_bps, nic_share,
                   hw.p2p_half_bytes if hw is not None else 0.0, hw.p2p_ramp_exponent if hw is not None else 1.0)
        # A ring's every channel crosses each node boundary, so across nodes it moves at most what
        # all the node's NICs carry (NCCL spreads channels over every NIC, more NICs than GPUs too).
        node_net_gbps = nic_gbps * min(nd.nics for nd in nodes) if n_nodes > 1 else math.inf
        line_gbps = min(intra_gbps, node_net_gbps)
        return _GroupTables(candidates, p2p, n_ranks, n_nodes, self._comm_channels(ring_graph.n_channels), min_cc,
                            ring_order, node_ranks,
                            hw, hw_c, line_gbps, intra_gbps, ppn, intra_hw, lat_inter_s * 1e6, node_net_gbps,
                            {} if self._tuner_plugin(nodes[0].device, n_ranks, n_nodes) else None)

    def _comm_channels(self, searched: int) -> int:
        """The channels a communicator runs: its searched graph's, within NCCL_MAX_CTAS / NCCL_MIN_CTAS (``emulation``).

        NCCL (``ncclTopoPostset``) cuts the rings to the maximum, then copies them up to the
        minimum, at most MAXCHANNELS; its tuning keeps the searched graph's channel count, so the
        algorithm it picks does not change, while the time does: each channel moves at most
        ``channel_GBps``, and small operations use fewer (``_hw_time``). 2 nodes x 8 H100 with
        NCCL_MIN_CTAS=24 reached 392 GB/s ring bus bandwidth (98 % of the NICs); 4 of the same
        cluster's nodes with NCCL's own 16, 325.
        """
        em = self.topology.emulation
        n = min(searched, em.max_channels) if em.max_channels else searched
        return min(2 * self.c["max_channels"], max(n, em.min_channels or 0))

    def _speeds(self, min_cc: int, inter: bool) -> tuple[float, ...]:
        c = self.c
        prefix = "sm100_" if min_cc >= 100 else "sm90_" if min_cc >= 90 else ""
        return c[f"{prefix}speed_{'inter' if inter else 'intra'}"]

    def _search(self, min_cc: int, intra_gbps: float, nic_gbps: float, nics: int, n_nodes: int) -> _Graph:
        """The ring/tree graph NCCL's search would find: first speed that fits, most channels, then duplication."""
        c = self.c
        limit = c["max_channels"]
        speed, n = 0.0, 0
        for s in self._speeds(min_cc, n_nodes > 1):
            n = int(intra_gbps // s) if math.isfinite(intra_gbps) else limit
            if n_nodes > 1:
                n = min(n, nics * int(nic_gbps // s))
            n = min(n, limit)
            if n >= 1:
                speed = s
                break
        if n < 1:
            # Slower than NCCL's smallest speed: NCCL falls back to one channel; keep the real
            # bottleneck so that bandwidth what-ifs still act.
            n, speed = 1, min(intra_gbps, nic_gbps * nics)
        if speed >= c["dup_channel_speed"]:
            dup = min(2 * n, limit)
            speed /= -(-dup // n)
            n = dup
        return _Graph(n, speed, speed)

    def _search_nvls(self, min_cc: int, intra_gbps: float, inter_gbps: float, local: int) -> _Graph:
        """NVLS graph: one channel per local GPU; every channel loads each NVSwitch link once, its head twice."""
        n = min(self.c["max_nvls_arity"], local)
        for s in self._speeds(min_cc, False):
            if (n + 1) * s <= intra_gbps:
                break
        else:
            s = intra_gbps / (n + 1)
        return _Graph(n, s, min(s, inter_gbps / n) if math.isfinite(inter_gbps) else s)

    def _tune(self, func, n_ranks, n_nodes, ppn, cc_idx, min_cc, max_cc, intra_hw, nvlink, ring, nvls, lat_inter_us,
              algos, protos):
        """ncclTopoTuneModel for one function: the enabled (algo, proto) candidates with latency and bandwidth.

        ``algos`` / ``protos``: the sets NCCL_ALGO / NCCL_PROTO enable (None: every one NCCL's defaults allow).
        """
        c = self.c
        index2 = n_nodes - 1 if n_nodes <= 2 else 2
        index1 = cc_idx if n_nodes == 1 else 0  # multi-node LL cap follows the CPU: Intel row
        ll_max_bw = c["ll_max_bws"][index1][index2]
        per_ch_tree = c["per_ch_max_tree_bws"][cc_idx][index2]
        per_ch_ring_ll128 = c["per_ch_max_ring_ll128_bws"][cc_idx][index2]
        per_ch_tree_ll128 = c["per_ch_max_tree_ll128_bws"][cc_idx][index2]
        per_ch_nvls_tree = c["per_ch_max_nvls_tree_bws"][cc_idx][index2]
        nsteps = _nsteps(func, n_ranks)
        hw_ring = intra_hw if n_nodes == 1 else HW_NET
        # Hopper+ searches degrade BALANCED_TREE to TREE, which the model penalizes by 15%.
        tree_pattern_penalty = min_cc >= 90
        pat_enabled = n_nodes == n_ranks and min_cc >= 60
        # LL128: NVLink inside the node, GPUDirect RDMA across, one architecture (or Hopper+ mixes).
        ll128_enabled = nvlink and (min_cc == max_cc or min_cc >= 90) and min_cc >= 70
        out: list[_Candidate] = []
        for a in (TREE, RING, NVLS, NVLS_TREE, PAT):  # CollNet needs SHARP hardware: never enabled
            if func in (_BROADCAST, _REDUCE) and a != RING:
                continue
            if func in (_ALL_GATHER, _REDUCE_SCATTER) and a not in (PAT, RING, NVLS):
                continue
            if func == _ALL_REDUCE and a == PAT:
                continue
            if a in (NVLS, NVLS_TREE) and nvls is None:
                continue
            if a == NVLS and n_nodes > 1:  # without CollNet, NVLS is single-node only
                continue
            if a == NVLS_TREE and n_nodes == 1:
                continue
            graph = nvls if a in (NVLS, NVLS_TREE) else ring
            for p in (LL, LL128, SIMPLE):
                if a in (NVLS, NVLS_TREE, PAT) and p != SIMPLE:
                    continue
                if a == PAT and not pat_enabled:
                    continue
                # NCCL's default leaves LL128 off outside NVLink (untested there, it says); a user who
                # names it in NCCL_PROTO turns it on anyway (pEnable 1, not the default 2).
                if p == LL128 and not ll128_enabled and not self._ll128_named:
                    continue
                if algos is not None and a not in algos:
                    continue
                if protos is not None and p not in protos:
                    continue
                bw = graph.bw_intra if n_nodes <= 2 else graph.bw_inter
                if a in (NVLS, NVLS_TREE):
                    if graph.n_channels < 2:
                        continue
                    intra_bw = graph.bw_intra * c["nvls_efficiency"][cc_idx] * (graph.n_channels - 1) / graph.n_channels
                    intra_bw *= 2.0 if func == _ALL_REDUCE else (ppn - 1) / ppn
                    inter_bw = graph.bw_inter * (2 if (n_nodes <= 2 and a == NVLS_TREE) else 1)
                    if n_nodes == 1:
                        inter_bw = math.inf
                    bw = min(intra_bw, inter_bw, per_ch_nvls_tree if a == NVLS_TREE else math.inf)
                bus_bw = graph.n_channels * bw
                if a == RING and p == LL:
                    bus_bw = min(ll_max_bw, bus_bw * 0.5)
                if a == RING and p == LL128:
                    bus_bw = min(bus_bw * 0.92, graph.n_channels * per_ch_ring_ll128)
                if a == TREE and func == _ALL_REDUCE:
                    bus_bw = min(bus_bw * 0.92, graph.n_channels * per_ch_tree)
                if a == TREE and p == LL:
                    bus_bw = min(bus_bw / 3.8, ll_max_bw)
                if a == TREE and p == LL128:
                    factor = 7.0 / 9.0 if n_nodes == 1 else 120.0 / 128.0
                    bus_bw = min(bus_bw * factor, graph.n_channels * per_ch_tree_ll128)
                if a == TREE and tree_pattern_penalty:
                    bus_bw *= 0.85
                if a == PAT:
                    bus_bw *= 0.75
                # Bus bandwidth to algorithm bandwidth; NCCL leaves non-ring AG/RS as they are.
                if not (a != RING and func in (_ALL_GATHER, _REDUCE_SCATTER)):
                    bus_bw *= n_ranks / nsteps if a in (RING, NVLS, NVLS_TREE) else 0.5
                if bus_bw <= 0:
                    continue
                lat = self._latency(func, a, p, n_ranks, n_nodes, ppn, nsteps, intra_hw, hw_ring, lat_inter_us)
                out.append(_Candidate(a, p, lat, bus_bw))
        if not out and (algos is not None or protos is not None):
            # A forced algorithm/protocol that this function lacks (tree for all-gather, LL for NVLS):
            # NCCL keeps ring available as a backup; its protocols compete as usual.
            return self._tune(func, n_ranks, n_nodes, ppn, cc_idx, min_cc, max_cc, intra_hw, nvlink, ring, nvls,
                              lat_inter_us, frozenset((RING,)), None)
        return out

    def _latency(self, func, a, p, n_ranks, n_nodes, ppn, nsteps, intra_hw, hw_ring, lat_inter_us, c=None) -> float:
        """NCCL's latency (µs) for one function/algorithm/protocol (``c``: constants other than the release's)."""
        c = c or self.c
        hw_lat = c["hw_lat"]
        lat = c["base_lat"][a][p]
        intra_lat = hw_lat[intra_hw][a][p]
        # With one rank per node latencies are fully exposed: NCCL uses the Tree network latency.
        inter_lat = (hw_lat[HW_NET][TREE][p] if ppn == 1 else hw_lat[HW_NET][a][p]) + lat_inter_us
        if p == SIMPLE:
            inter_lat += lat_inter_us  # NCCL adds latencyInter again for the flush
        if a == RING:
            if func in (_REDUCE, _BROADCAST):
                # Symmetric systems give identical channels (sameChannels): one hop of latency.
                # NCCL adds no latencyInter here (IB reports ~0); we add the topology's network
                # latency once so that latency what-ifs reach broadcast and reduce too.
                return lat + hw_lat[hw_ring][RING][p] + (lat_inter_us if n_nodes > 1 else 0.0)
            net_overhead = 0.0
            if n_nodes > 1:
                net_overhead = c["net_overhead_us"] * (3 if p == SIMPLE else 1)
            intra_lat = max(intra_lat, net_overhead)
            n_inter = 0 if n_nodes == 1 else 2 * (n_nodes - 1) if func == _ALL_REDUCE else n_nodes - 1
            return lat + (nsteps - n_inter) * intra_lat + n_inter * inter_lat
        if a == TREE:
            return lat + 2 * ((n_ranks // n_nodes - 1) * intra_lat + _log2i(n_nodes) * inter_lat)
        if a == NVLS:
            return intra_lat + (inter_lat if n_nodes > 1 else 0.0)
        if a == NVLS_TREE:
            return lat + intra_lat + 2 * _log2i(n_nodes) * inter_lat
        # PAT
        return lat + _log2i(n_nodes) * (inter_lat / 3.5) + n_ranks * 2.8


# enqueue's channel reduction: NCCL_{LL,LL128,SIMPLE}_MAX_NTHREADS and *_THREAD_THRESHOLD
# (src/include/device.h, comm.h), by protocol index.
_MAX_THREADS = (512, 640, 512)
_THREAD_THRESHOLD = (8, 8, 64)


def _tree_load(n_nodes: int) -> float:
    """How many times the buffer the busiest node's NICs carry each way in NCCL's double binary tree."""
    # Each of the two trees (graph/trees.cc, ncclGetDtree) carries half the buffer, reduced up and
    # broadcast down, so a node moves half a buffer each way per tree edge it has: 0.5 as a leaf or as
    # the root (NCCL's root has one child), 1.0 in a chain (a parent and one child), 1.5 as an inner
    # node with two children. Two nodes: each is the root of one tree and the leaf of the other, 1.0.
    # Three: both trees are chains (0->2->1, shifted 1->0->2); a node in the middle of one is an end of
    # the other, 1.5. From four on a node with two children in one tree is a leaf of the other
    # (mirrored for even counts, shifted for odd), 2.0.
    if n_nodes <= 2:
        return 1.0
    return 1.5 if n_nodes == 3 else 2.0


def _nsteps(func: int, n: int) -> int:
    """A ring's steps for NCCL function ``func`` on n ranks (as tuning.cc counts them)."""
    if func == _ALL_REDUCE:
        return 2 * (n - 1)
    return n - 1 if func in (_ALL_GATHER, _REDUCE_SCATTER) else n


def _with_profile(c: dict, hw: "hardware.Section", intra_hw: int) -> dict:
    """NCCL's constants with a hardware section's base and per-hop latencies for ring and tree, and its NVLS latency."""
    base = [list(row) for row in c["base_lat"]]
    hw_lat = [[list(row) for row in table] for table in c["hw_lat"]]
    for a in (TREE, RING, PAT):
        for p in (LL, LL128, SIMPLE):
            base[a][p] = hw.base_us.get(p)
            hw_lat[intra_hw][a][p] = hw.hop_us.get(p)
            if hw.net_hop_us is not None:
                hw_lat[HW_NET][a][p] = hw.net_hop_us.get(p)
    for a in (NVLS, NVLS_TREE):
        hw_lat[intra_hw][a][SIMPLE] = hw.nvls_us
    return {**c, "base_lat": base, "hw_lat": hw_lat, "net_overhead_us": 0.0}


# ---- schedules (built lazily by Estimate.steps) ---------------------------------------------
def _collective_steps(func: int, algo: int, nbytes: int, t: _GroupTables, root_rank: int, duration: float,
                      latency: float) -> list[Step]:
    n = t.n_ranks
    order = tuple(t.ring_order)  # a schedule names every rank anyway; schedules slice and join tuples
    if algo == RING:
        if func == _ALL_REDUCE:
            nsteps = 2 * (n - 1)
            dt = duration / nsteps
            return schedules.concat(
                schedules.ring(order, n - 1, nbytes / n, dt, "reduce-scatter"),
                schedules.ring(order, n - 1, nbytes / n, dt, "all-gather", t0=(n - 1) * dt),
            )
        if func in (_ALL_GATHER, _REDUCE_SCATTER):
            phase = "all-gather" if func == _ALL_GATHER else "reduce-scatter"
            return schedules.ring(order, n - 1, nbytes / n, duration / (n - 1), phase)
        # Broadcast/reduce: a pipelined chain that starts (broadcast) or ends (reduce) at the root.
        start = order.index(root_rank)
        chain = order[start:] + order[:start]
        if func == _REDUCE:
            chain = chain[::-1]
        hop = min(latency, duration / 2) / max(1, n - 1)
        transfer = max(0.0, duration - hop * (n - 1) - hop)
        return schedules.chain(chain, nbytes, hop, transfer, "broadcast" if func == _BROADCAST else "reduce")
    if algo == TREE:
        return _tree_steps(t, nbytes, duration, "tree")
    if algo == NVLS:
        pairs = [(s, d) for s in order for d in order if s != d]
        half = duration / 2
        return schedules.concat(
            schedules.direct(pairs, nbytes / n, half, "nvls reduce"),
            schedules.direct(pairs, nbytes / n, half, "nvls multicast", t0=half),
        )
    if algo == NVLS_TREE:
        third = duration / 3
        intra = [(s, d) for v in t.node_ranks for s in v for d in v if s != d]
        chunk = nbytes / max(len(v) for v in t.node_ranks)
        out = schedules.direct(intra, chunk, third, "nvls reduce")
        leaders = [v[0] for v in t.node_ranks]
        level = third / (2 * max(1, _log2i(len(leaders)) + 1))
        out += _leader_tree(leaders, nbytes, level, "nvls tree", third)
        out += schedules.direct(intra, chunk, third, "nvls multicast", t0=2 * third)
        return out
    # PAT (one rank per node): Bruck-style rounds, distance doubling, chunks of nbytes/n.
    out: list[Step] = []
    rounds = max(1, (n - 1).bit_length())
    dt = duration / rounds
    for k in range(rounds):
        dist = 1 << k
        count = min(dist, n - dist)
        for i in range(n):
            dst = order[(i - dist) % n]
            out.append(Step(k * dt, (k + 1) * dt, order[i], dst, count * nbytes / n, f"pat round {k}"))
    return out


def _tree_steps(t: _GroupTables, nbytes: int, duration: float, phase: str) -> list[Step]:
    # NCCL's tree: a chain inside each node, a binary tree across node leaders; reduce up, broadcast down.
    leaders = [v[0] for v in t.node_ranks]
    depth = max(len(v) for v in t.node_ranks) - 1 + max(1, len(leaders)).bit_length()
    level = duration / (2 * max(1, depth))
    up: list[Step] = []
    down: list[Step] = []
    for v in t.node_ranks:
        for k in range(len(v) - 1, 0, -1):
            s = (len(v) - 1 - k) * level
            up.append(Step(s, s + level, v[k], v[k - 1], nbytes, f"{phase} up"))
            down.append(Step(duration - s - level, duration - s, v[k - 1], v[k], nbytes, f"{phase} down"))
    t_inter = max(len(v) for v in t.node_ranks) - 1
    inter = []
    if len(leaders) > 1:
        inter = _leader_tree(leaders, nbytes, level, phase, t_inter * level)
    return up + inter + down


def _leader_tree(leaders: Sequence[int], nbytes: int, level: float, phase: str, t0: float) -> list[Step]:
    # NCCL's inter-node tree is binary (leader i has children 2i+1, 2i+2): reduce up, then broadcast down.
    n = len(leaders)
    depth = max(1, n.bit_length() - 1)
    edges = [(i, c) for i in range(n) for c in (2 * i + 1, 2 * i + 2) if c < n]
    out = []
    for p, c in edges:
        d = (c + 1).bit_length() - 1  # depth of the child
        up = t0 + (depth - d) * level
        down = t0 + (depth + d - 1) * level
        out.append(Step(up, up + level, leaders[c], leaders[p], nbytes, f"{phase} up"))
        out.append(Step(down, down + level, leaders[p], leaders[c], nbytes, f"{phase} down"))
    return out


def _p2p_steps(op: Op, nbytes: int, ranks: tuple[int, ...], root: int, duration: float) -> list[Step]:
    n = len(ranks)
    if op is Op.SEND_RECV:
        return [Step(0.0, duration, ranks[root], ranks[(root + 1) % n], nbytes, "send")]
    if op is Op.ALL_TO_ALL:
        pairs = [(s, d) for s in ranks for d in ranks if s != d]
    elif op is Op.GATHER:
        pairs = [(s, ranks[root]) for s in ranks if s != ranks[root]]
    else:
        pairs = [(ranks[root], d) for d in ranks if d != ranks[root]]
    return schedules.direct(pairs, nbytes / n, duration, op.value)
