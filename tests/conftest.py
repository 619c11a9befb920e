"""Shared fixtures: topologies written as YAML text, the way users write them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuronabox.topology import parse_topology

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ROOT / "topologies"


def topo(text: str, source: str = "test.yaml"):
    """A resolved topology from YAML text."""
    return parse_topology(text, source)


def switch_topology(nodes: int, bandwidth: str = "100Gbps", latency: str = "5us", ranks: int = 1, extra: str = ""):
    """n nodes on one switch."""
    return topo(
        f"cluster: {{nodes: {nodes}, ranks_per_node: {ranks}}}\n"
        f"network: {{type: switch, link: {{bandwidth: {bandwidth}, latency: {latency}}}}}\n" + extra
    )


def run_nbox(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real ``nbox`` command (the console script's entry point) in a subprocess."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "neuronabox.cli", *args], capture_output=True, text=True, cwd=cwd or ROOT, env=env
    )


@pytest.fixture
def tmp_yaml(tmp_path):
    """Write YAML text to a file and return its path."""

    def write(text: str, name: str = "topo.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return write
