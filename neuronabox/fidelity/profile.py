"""The calibration profile file: what ``nbox calibrate`` writes and how a topology names it (read back: ``neuronabox.model.profile``)."""

from __future__ import annotations

import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..model.profile import FORMAT, topology_hash
from .fit import OpFit, link_estimate

__all__ = ["network_summary", "make_profile", "library_info", "save_profile",
           "profile_reference", "write_profile_field"]



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
    # The installed distribution's version is torch.__version__ without importing torch (2-8 s on a
    # busy 2-core host, paid by every calibrate and validate).
    return {"name": backend, "torch": metadata.version("torch"), "transport": "tcp" if backend == "gloo" else "nccl"}


def save_profile(profile: dict[str, Any], path: Path) -> None:
    """Write a profile as JSON."""
    path.write_text(json.dumps(profile, indent=1) + "\n", encoding="utf-8")


def profile_reference(topology_file: Path, profile: Path) -> str:
    """How the topology file should name ``profile``: relative to the file's folder (a path that moves with both)."""
    import os.path

    folder = Path(topology_file).resolve().parent
    target = Path(profile).resolve()
    rel = os.path.relpath(target, folder)
    # Beyond the topology's folder tree an absolute path reads better than a chain of ../
    return target.as_posix() if rel.startswith(".." + os.sep + "..") else Path(rel).as_posix()


def write_profile_field(topology_file: Path, profile: Path, field: str = "profile") -> str:
    """Set ``emulation.<field>`` (``profile``, ``hardware``) in the topology file, keeping its other lines (and comments) as they are.

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
    hand = f"{path}: emulation.{field}: add `{field}: {value}` under `emulation:` by hand"
    head = [i for i, ln in enumerate(lines) if re.match(r"^emulation\s*:", ln)]
    if not head:
        lines += ["emulation:", f"  {field}: {value}"]
    else:
        i = head[0]
        rest = lines[i].split(":", 1)[1]
        body, _, comment = rest.partition(" #")
        if body.strip().startswith("{") and body.strip().endswith("}"):
            try:
                mapping = yaml.safe_load(body) or {}
            except yaml.YAMLError:
                raise InputError(hand) from None
            mapping[field] = ref
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
            existing = [k for k in block if re.match(rf"^{pad}{field}\s*:", lines[k])]
            if existing:
                lines[existing[0]] = f"{pad}{field}: {value}"
            else:
                lines.insert(i + 1, f"{pad}{field}: {value}")
        else:
            raise InputError(hand)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        load_topology(path)
    except InputError as exc:
        path.write_text(text, encoding="utf-8")
        raise InputError(f"{hand} (writing it made the file invalid: {exc})") from None
    return ref


