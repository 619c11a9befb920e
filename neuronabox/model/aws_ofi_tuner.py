"""The aws-ofi-nccl plugin's region tuner: which algorithm/protocol NCCL runs on AWS p5/p5e.

On AWS, NCCL loads the tuner that ships with the aws-ofi-nccl network plugin (``NCCL_TUNER_PLUGIN``,
``libnccl-ofi-tuner.so``). For p5.48xlarge and p5e.48xlarge (8x H100/H200, EFA) it does not rank
NCCL's cost table: it looks the point (message bytes, communicator ranks) up in polygons drawn in
log2-log2 space and zeroes the cost of the first region's (algorithm, protocol) that contains it, so
NCCL's argmin takes that one. A point outside every region, a combination NCCL left disabled
(``NCCL_ALGO_PROTO_IGNORE``, e.g. NVLS tree without NVLS) or a communicator of two nodes or fewer falls
back to NCCL's own choice.

Source: github.com/aws/aws-ofi-nccl, src/tuner/nccl_ofi_regions.cpp at commit
228fa0eafb41c9e2b46446b86b5ab46c76410650 (``region_init_internal_p5_p5e``,
``region_get_coll_info_internal_v3``, ``is_inside_region``, ``extend_region``) and
include/tuner/nccl_ofi_tuner_region.h (TUNER_MAX_SIZE, TUNER_MAX_RANKS, ``transform_log2``);
src/tuner/nccl_ofi_tuner.cpp at commit 0e2a0f46b1d935aaeff61448afeec57f918423e0 picks the region
tuner for "p5.48xlarge"/"p5e.48xlarge". Older releases (src/tuner/nccl_ofi_regions.c) hold the same p5
vertices and the same two-node fallback but test them in linear (bytes, ranks) coordinates; at
power-of-two sizes over 32-256 ranks both geometries give the same picks. Only what p5/p5e define with 8 ranks a node is kept here:
all-reduce (the plugin has no p5 regions for the other collectives at 8 ranks a node, and its
1-rank-a-node and 2-ranks-a-node tables are not layouts this model is asked about on p5).
"""

from __future__ import annotations

import math

# NCCL's algorithm/protocol indices (nccl.py's ALGO_NAMES/PROTO_NAMES order).
TREE, RING, NVLS_TREE = 0, 1, 5
LL128, SIMPLE = 1, 2

_MAX_SIZE = 100.0 * 1024**3  # TUNER_MAX_SIZE
_MAX_RANKS = 1024.0 * 1024  # TUNER_MAX_RANKS
_EPS = 1e-10  # is_inside_region's edge tolerance, in log2 units


def _log2(x: float) -> float:
    # transform_log2 sets 0 to 1e-6 before taking log2.
    return math.log2(x if x > 0 else 1e-6)


def _pt(x: float, y: float) -> tuple[float, float]:
    return (_log2(x), _log2(y))


def _extend(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """Where the line through a and b (log2 space) leaves the box up to (MAX_SIZE, MAX_RANKS): extend_region."""
    zx, zy = _log2(_MAX_SIZE), _log2(_MAX_RANKS)
    if a[0] == b[0]:
        return (a[0], zy)
    if a[1] == b[1]:
        return (zx, a[1])
    m = (a[1] - b[1]) / (a[0] - b[0])
    c = b[1] - m * b[0]
    y = m * zx + c
    return (zx, y) if y < zy else ((zy - c) / m, zy)


def _p5_all_reduce() -> tuple[tuple[int, int, tuple[tuple[float, float], ...]], ...]:
    """The p5/p5e all-reduce regions for 8 ranks a node, in the plugin's order (first match wins)."""
    p = _pt
    tree_ll128 = _extend(p(402653184, 2048), p(402653184, 4096))
    nvlstree_1 = _extend(p(8053063680, 160), p(9663676416, 192))
    nvlstree_2 = tree_ll128  # the plugin extends the same two points again
    ring_simple = nvlstree_1
    return (
        (TREE, LL128, (p(0, 16), p(31457280, 16), p(37748736, 32), p(117440512, 64), p(301989888, 128),
                       p(301989888, 256), p(335544320, 512), p(536870912, 1024), p(402653184, 2048),
                       p(402653184, 4096), tree_ll128, (_log2(0), tree_ll128[1]))),
        # A degenerate polygon (a segment at 16 ranks): only its edge matches.
        (NVLS_TREE, SIMPLE, (p(31457281, 16), p(_MAX_SIZE, 16), p(31457281, 16))),
        (RING, LL128, (p(31457280, 17), p(1073741824, 17), p(2147483648, 64), p(2147483648, 128),
                       p(1342177280, 160), p(2147483648, 256), p(1074790400, 256), p(444596224, 160),
                       p(301989888, 128), p(117440512, 64), p(37748736, 32))),
        (NVLS_TREE, SIMPLE, (p(2147483648, 128), p(6442450944, 128), p(8053063680, 160), p(9663676416, 192),
                             nvlstree_1, nvlstree_2, p(402653184, 4096), p(402653184, 2048), p(536870912, 1024),
                             p(335544320, 512), p(301989888, 256), p(310378496, 160), p(444596224, 160),
                             p(1074790400, 256), p(2684354560, 256), p(2147483648, 224), p(1342177280, 160))),
        (RING, SIMPLE, (p(1073741824, 17), (ring_simple[0], _log2(17)), ring_simple, p(9663676416, 192),
                        p(8053063680, 160), p(2684354560, 64), p(1610612736, 32))),
    )


_REGIONS = {"all_reduce": _p5_all_reduce()}


def _on_segment(x: float, y: float, a: tuple[float, float], b: tuple[float, float]) -> bool:
    dx, dy = b[0] - a[0], b[1] - a[1]
    length2 = dx * dx + dy * dy
    if length2 == 0.0:
        return math.hypot(x - a[0], y - a[1]) < _EPS
    t = ((x - a[0]) * dx + (y - a[1]) * dy) / length2
    if t < -_EPS or t > 1 + _EPS:
        return False
    return math.hypot(x - (a[0] + t * dx), y - (a[1] + t * dy)) < _EPS


def _inside(x: float, y: float, poly: tuple[tuple[float, float], ...]) -> bool:
    """Inside or on the edge of a polygon (is_inside_region >= 0)."""
    n = len(poly)
    for i in range(n):
        if _on_segment(x, y, poly[i], poly[(i + 1) % n]):
            return True
    inside = False
    for i in range(n):
        (x0, y0), (x1, y1) = poly[i], poly[(i + 1) % n]
        if (y0 > y) != (y1 > y) and x < x0 + (y - y0) * (x1 - x0) / (y1 - y0):
            inside = not inside
    return inside


def applies(device: str, n_ranks: int, n_nodes: int) -> bool:
    """Whether the p5/p5e region tuner would choose for this communicator at all."""
    # p5 is H100, p5e H200; the plugin skips two nodes or fewer ("regions are not well defined").
    return device.upper().startswith(("H100", "H200")) and n_nodes > 2 and n_ranks == 8 * n_nodes


def choose(func: str, nbytes: int, n_ranks: int, allowed) -> tuple[int, int] | None:
    """The (algorithm, protocol) the tuner forces for ``nbytes`` over ``n_ranks``, or None for NCCL's own pick.

    ``allowed``: the (algorithm, protocol) pairs NCCL enabled; a region of another pair is skipped, as
    the plugin skips a pair whose cost NCCL set to NCCL_ALGO_PROTO_IGNORE.
    """
    regions = _REGIONS.get(func)
    if regions is None or nbytes > _MAX_SIZE or n_ranks > _MAX_RANKS:
        return None
    x, y = _log2(nbytes), _log2(n_ranks)
    for algo, proto, poly in regions:
        if (algo, proto) in allowed and _inside(x, y, poly):
            return algo, proto
    return None
