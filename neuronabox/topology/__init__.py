"""Topology files: schema, loading and synthesis into a graph."""

from .resolve import Node, Topology, load_topology, parse_topology, topology_from_dict

__all__ = ["Node", "Topology", "load_topology", "parse_topology", "topology_from_dict"]
