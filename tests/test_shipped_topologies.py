"""The topologies a user reaches for are shipped under topologies/ and each one loads as described."""

from __future__ import annotations

import pytest

from neuronabox.topology import load_topology

from .conftest import TOPOLOGIES

# file -> (world size, nodes, device): the sizes people ask for first (2, 8, 16, 64 CPU ranks), one
# GPU server, the paper's two single-GPU nodes, and the large and mixed clusters.
SHIPPED = {
    "cpu-2x1g": (2, 2, "cpu"),
    "cpu-8x1g": (8, 8, "cpu"),
    "cpu-16x1g": (16, 16, "cpu"),
    "cpu-64-demo": (64, 16, "cpu"),
    "gpu-1x8-h100": (8, 1, "H100"),
    "paper-2x1-100g": (2, 2, "H100"),
    "dgx-h100-32": (256, 32, "H100"),
    "hetero-a100-h100": (48, 6, "H100"),
}


def test_every_shipped_topology_is_listed_here():
    assert sorted(p.stem for p in TOPOLOGIES.glob("*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_topology_loads(name):
    world, nodes, device = SHIPPED[name]
    t = load_topology(TOPOLOGIES / f"{name}.yaml")
    assert t.name == name and t.world_size == world and len(t.nodes) == nodes
    assert t.raw["cluster"].get("device", "cpu") == device
    assert t.emulation.real_ranks == [0]
