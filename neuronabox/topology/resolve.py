"""Loading a topology file: YAML -> pydantic -> cross-field checks -> a resolved ``Topology``.

Every error is a ``TopologyError`` whose message is one line naming the file, the YAML path
and the offending value, which is what the CLI prints before exiting with code 2.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import itertools
import json
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import TopologyError
from .schema import MAX_NODES, MAX_WORLD, NAME_PATTERN, FabricKind, LinkSpec, NodeOverride, TopologyFile

__all__ = ["Node", "RankNodes", "Topology", "load_topology", "dump_yaml", "load_yaml", "parse_topology", "topology_from_dict"]


@dataclass(frozen=True)
class Node:
    """One machine of the resolved cluster."""

    index: int
    name: str
    ranks: int
    first_rank: int
    device: str
    compute_slowdown: float
    nics: int
    fabric: FabricKind
    intra_bandwidth: float
    intra_latency: float

    @property
    def rank_range(self) -> range:
        """The global ranks on this node."""
        return range(self.first_rank, self.first_rank + self.ranks)


class RankNodes:
    """Rank -> node index, as a read-only sequence that holds one entry per node, not per rank.

    A world of 10 M ranks would be a 10 M-entry tuple (80 MB, and seconds to build); the ranks of
    a node are consecutive, so the node of a rank is found by bisecting the nodes' first ranks.
    """

    __slots__ = ("_firsts", "_world")

    def __init__(self, firsts: tuple[int, ...], world: int):
        self._firsts = firsts  # first rank of every node, ascending (nodes have at least one rank)
        self._world = world

    def __len__(self) -> int:
        return self._world

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self._world))]
        if rank < 0:
            rank += self._world
        if not 0 <= rank < self._world:
            raise IndexError(f"rank {rank} is outside the world of {self._world} ranks")
        return bisect.bisect_right(self._firsts, rank) - 1

    def __iter__(self):
        firsts = self._firsts
        for i, first in enumerate(firsts):
            end = firsts[i + 1] if i + 1 < len(firsts) else self._world
            yield from itertools.repeat(i, end - first)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankNodes):
            return self._world == other._world and self._firsts == other._firsts
        if isinstance(other, (tuple, list)):
            return len(other) == self._world and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._firsts, self._world))

    def __repr__(self) -> str:
        return f"RankNodes({len(self._firsts)} nodes, {self._world} ranks)"


@dataclass(frozen=True)
class Topology:
    """A validated topology with every default filled in and every node resolved."""

    spec: TopologyFile
    source: str
    nodes: tuple[Node, ...]
    rank_node: RankNodes
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        """The topology's name (the file's stem when the file gives none)."""
        return self.spec.name or Path(self.source).stem

    @property
    def world_size(self) -> int:
        """How many ranks the emulated job has."""
        return len(self.rank_node)

    @property
    def network(self):
        """The ``network`` section."""
        return self.spec.network

    @property
    def emulation(self):
        """The ``emulation`` section."""
        return self.spec.emulation

    @property
    def whatif(self):
        """The ``whatif`` section."""
        return self.spec.whatif

    def node_of(self, rank: int) -> Node:
        """The node that holds ``rank``."""
        return self.nodes[self.rank_node[rank]]

    def local_rank(self, rank: int) -> int:
        """The rank's index within its node."""
        return rank - self.node_of(rank).first_rank

    def with_changes(self, **sections: dict[str, Any]) -> "Topology":
        """A new topology with fields of some sections changed, in YAML form (``whatif={'latency_scale': 2}``), re-validated."""
        raw = copy.deepcopy(self.raw)
        for section, changes in sections.items():
            current = raw.get(section) or {}
            raw[section] = {**current, **changes}
        return topology_from_dict(raw, self.source)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that rejects duplicate keys instead of silently keeping the last."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:  # `? [a, b]`, `? {a: b}`: PyYAML's own check comes after ours
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, not a {type(key).__name__}", mark) from None
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {mark.line + 1})", mark
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# A topology is a few levels deep; PyYAML composes (and constructs) recursively, so a document of
# thousands of nested brackets would end in a RecursionError with thousands of lines of traceback.
MAX_YAML_DEPTH = 32
# Aliases share, they do not copy: ten of ten of ... ("billion laughs") is a small file whose
# tree, walked by validation or printed in an error, has 10^9 leaves.
MAX_YAML_ALIASES = 100


def _compose_node(loader: _UniqueKeyLoader, parent: Any, index: Any) -> Any:
    depth = getattr(loader, "_nbox_depth", 0)
    if depth >= MAX_YAML_DEPTH:
        raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                          loader.peek_event().start_mark)
    if loader.check_event(yaml.AliasEvent):
        loader._nbox_aliases = getattr(loader, "_nbox_aliases", 0) + 1
        if loader._nbox_aliases > MAX_YAML_ALIASES:
            raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_ALIASES} aliases (*name)",
                                              loader.peek_event().start_mark)
    loader._nbox_depth = depth + 1
    try:
        return yaml.composer.Composer.compose_node(loader, parent, index)
    finally:
        loader._nbox_depth = depth


_UniqueKeyLoader.compose_node = _compose_node


_BRACKETS = re.compile(r"[\[\]{}]")


def _bracket_depth(text: str) -> tuple[int, int]:
    """How deep flow brackets (``[``, ``{``) nest in ``text``, and the offset where they pass MAX_YAML_DEPTH (or -1)."""
    depth = 0
    for m in _BRACKETS.finditer(text):
        depth = depth + 1 if m.group() in "[{" else max(0, depth - 1)
        if depth > MAX_YAML_DEPTH:
            return depth, m.start()
    return depth, -1


def load_yaml(text: str) -> Any:
    """YAML text as data with duplicate keys and deep nesting refused; raises yaml.YAMLError or ValueError."""
    # PyYAML's scanner looks ahead to the end of every open flow collection (each bracket may
    # start a key), so n nested brackets cost O(n^2) before the composer sees the first level:
    # 2,000 took 4 s. Counted first, here; a bracket inside quotes counts too, which errs on the
    # side of refusing a string of 33 unclosed brackets.
    _, at = _bracket_depth(text)
    if at >= 0:
        line = text.count("\n", 0, at)
        mark = yaml.Mark("<text>", at, line, at - (text.rfind("\n", 0, at) + 1), None, None)
        raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", mark)
    # ValueError: an integer of more than 4,300 digits (Python's limit on int() of a string).
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def dump_yaml(topology: "Topology") -> str:
    """The topology's raw document as YAML text (what-ifs applied): the file a child, a container or a job reads."""
    return yaml.safe_dump(_jsonable(topology.raw), sort_keys=False)


def _jsonable(value: Any) -> Any:
    """The raw topology with enum keys (from what-if merges) turned back into YAML scalars."""
    if isinstance(value, dict):
        return {(k.value if hasattr(k, "value") else k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value.value if hasattr(value, "value") else value


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.maxlist = _REPR.maxdict = 8
_REPR.maxlevel = 3


def _short(value: Any) -> str:
    # reprlib: a value may be a large tree or a long string; its repr is cut while it is made.
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Mappings whose keys may be integers: their keys print as `.3`, list indices as `[3]`.
_MAPPING_FIELDS = {"stragglers", "overrides", "inject"}


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    prev: Any = None
    for part in loc:
        is_key, prev = prev in _MAPPING_FIELDS, part
        if isinstance(part, int) and not is_key:
            out += f"[{part}]"
        else:
            text = str(part)
            # An unknown key is the user's text: a newline in it would break the one-line error.
            if not text.isprintable() or len(text) > 40:
                text = _short(text)
            out += ("." if out else "") + text
    return out


def _pydantic_error(source: str, exc: ValidationError) -> TopologyError:
    err = exc.errors(include_url=False)[0]
    path = _path(tuple(err["loc"]))
    kind = err["type"]
    value = err.get("input")
    if kind == "missing":
        message = "required field is missing"
    elif kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == NAME_PATTERN:
        message = (f"a name is 1-63 letters, digits, '_', '.' or '-', starting with a letter or digit "
                   f"(got {_short(value)})")
    elif kind == "extra_forbidden":
        message = f"unknown field (value {_short(value)})"
    elif kind == "value_error":
        message = str(err["msg"]).removeprefix("Value error, ")
        if repr(value) not in message and not isinstance(value, (dict, list)):
            message += f" (got {_short(value)})"
    else:
        message = f"{err['msg']} (got {_short(value)})"
    return TopologyError(source, path, message)


def parse_topology(text: str, source: str = "<string>") -> Topology:
    """Parse YAML text into a resolved ``Topology``."""
    try:
        data = load_yaml(text)
    except ValueError:
        # int() of a string of more than 4,300 digits: the only ValueError a safe load raises.
        raise TopologyError(source, "", "YAML value out of range: an integer of more than 4300 digits") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TopologyError(where, "", f"YAML syntax error: {problem}") from None
    if data is None:
        raise TopologyError(source, "", "the file is empty")
    if not isinstance(data, dict):
        raise TopologyError(source, "", f"expected a mapping at the top level, got {type(data).__name__}")
    return topology_from_dict(data, source)


def load_topology(path: str | Path, profile_may_be_missing: bool = False) -> Topology:
    """Read and resolve a topology file.

    ``profile_may_be_missing``: a profile that ``emulation.profile`` names but that does not exist
    yet is left out instead of refused; for the verbs that come before it (``nbox up`` brings up
    the cluster that ``nbox calibrate`` then measures to write it) and use no model.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(str(p), "", "no such file") from None
    except IsADirectoryError:
        raise TopologyError(str(p), "", "is a directory, expected a topology YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(str(p), "", f"cannot read: {exc}") from None
    if profile_may_be_missing:
        with contextlib.suppress(yaml.YAMLError, ValueError):  # parse_topology names the problem
            raw = load_yaml(text)
            named = named_profile(p, raw)
            if named is not None and not named.exists():
                raw["emulation"] = {k: v for k, v in raw["emulation"].items() if k != "profile"}
                text = yaml.safe_dump(raw, sort_keys=False)
    return parse_topology(text, str(p))


def named_profile(path: str | Path, raw: Any = None) -> Path | None:
    """The profile file that ``emulation.profile`` of a topology file names (relative to the file), or None.

    ``raw``: the file's YAML content when the caller has it already (else the file is read).
    """
    path = Path(path)
    if raw is None:
        try:
            raw = load_yaml(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError):
            return None  # loading the topology names the problem
    emu = raw.get("emulation") if isinstance(raw, dict) else None
    named = emu.get("profile") if isinstance(emu, dict) else None
    return _profile_path(named, str(path)) if isinstance(named, str) and named else None


def _profile_path(value: str, source: str) -> Path:
    """``emulation.profile`` as a path: ``~`` expanded, relative to the topology file's folder."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path(source).resolve().parent / path


def topology_from_dict(data: dict[str, Any], source: str = "<dict>") -> Topology:
    """Validate a dict (the YAML's content) and resolve it."""
    try:
        spec = TopologyFile.model_validate(data)
    except ValidationError as exc:
        raise _pydantic_error(source, exc) from None
    return _resolve(spec, source, data)


_RANGE = re.compile(r"^(\d+)-(\d+)$")


def _override_targets(key: str, names: dict[str, int], count: int, source: str) -> list[int]:
    path = f"cluster.overrides.{key}"
    if key.isdigit():
        idx = int(key)
        if idx >= count:
            raise TopologyError(source, path, f"node index {idx} is out of range (the cluster has {count} nodes)")
        return [idx]
    m = _RANGE.match(key)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi or hi >= count:
            raise TopologyError(source, path, f"node range {key!r} is not within 0-{count - 1}")
        return list(range(lo, hi + 1))
    if key in names:
        return [names[key]]
    raise TopologyError(source, path, f"no node named {key!r} (use a node name, an index or a range like 0-3)")


def _resolve(spec: TopologyFile, source: str, raw: dict[str, Any]) -> Topology:
    cl = spec.cluster
    net = spec.network
    # Per-node settings: cluster defaults < node list entry < overrides.
    entries: list[dict[str, Any]] = []
    names: dict[str, int] = {}
    for i, n in enumerate(cl.nodes):
        name = n.name or f"node{i}"
        if name in names:
            raise TopologyError(source, f"cluster.nodes[{i}].name", f"duplicate node name {name!r}")
        names[name] = i
        entries.append({**_override_fields(n), "name": name})
    for key, ov in cl.overrides.items():
        for idx in _override_targets(key, names, len(entries), source):
            entries[idx].update(_override_fields(ov))

    wi = spec.whatif
    if wi.world_size is not None:
        entries = _resize(entries, cl.ranks_per_node, wi.world_size, source)

    # The world is counted before a structure of its size is made.
    world = sum(e.get("ranks", cl.ranks_per_node) for e in entries)
    if world > MAX_WORLD:
        where = "whatif.world_size" if wi.world_size is not None else "cluster"
        raise TopologyError(source, where, f"{world} ranks: at most {MAX_WORLD} ranks")
    default_nics = net.nics_per_node or (cl.ranks_per_node if net.type == "rail-optimized" else 1)
    nodes: list[Node] = []
    first = 0
    for i, e in enumerate(entries):
        ranks = e.get("ranks", cl.ranks_per_node)
        intra = e.get("intra_node", spec.intra_node)
        bw, lat = intra.resolved()
        nodes.append(
            Node(
                index=i,
                name=e["name"],
                ranks=ranks,
                first_rank=first,
                device=e.get("device", cl.device),
                compute_slowdown=float(e.get("compute_slowdown", 1.0)),
                nics=e.get("nics", default_nics),
                fabric=intra.fabric,
                intra_bandwidth=bw,
                intra_latency=lat,
            )
        )
        first += ranks
    world = first
    rank_node = RankNodes(tuple(n.first_rank for n in nodes), world)

    em = spec.emulation
    seen: set[int] = set()
    for j, r in enumerate(em.real_ranks):
        if r >= world:
            raise TopologyError(source, f"emulation.real_ranks[{j}]", f"rank {r} does not exist (world size {world})")
        if r in seen:
            raise TopologyError(source, f"emulation.real_ranks[{j}]", f"rank {r} is listed twice")
        seen.add(r)
    if not em.real_ranks:
        raise TopologyError(source, "emulation.real_ranks", "at least one rank must be real")
    for r in wi.stragglers:
        if r >= world:
            raise TopologyError(source, f"whatif.stragglers.{r}", f"rank {r} does not exist (world size {world})")

    _check_network(spec, nodes, source)
    if em.profile is not None:
        spec, raw = _with_absolute_profile(spec, source, raw)
    return Topology(spec=spec, source=source, nodes=tuple(nodes), rank_node=rank_node, raw=raw)


# The profile's own format string lives with its writer (fidelity.profile), above this layer:
# here only its family is checked; the calibrated model reads the rest when it is built.
_PROFILE_FORMAT_PREFIX = "neuronabox-calibration/"


def _with_absolute_profile(spec: TopologyFile, source: str, raw: dict[str, Any]) -> tuple[TopologyFile, dict[str, Any]]:
    """Check ``emulation.profile`` (exists, is a calibration profile) and make it absolute in the spec and the raw YAML.

    Relative paths are relative to the topology file's folder. Absolute in ``raw`` too, because
    ``nbox run`` and the what-if sweep write the effective topology to a temporary file elsewhere.
    """
    value = spec.emulation.profile
    path = _profile_path(value, source).resolve()
    where = "emulation.profile"
    if not path.is_file():
        raise TopologyError(source, where, f"no such profile file {value!r} ({path})")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TopologyError(source, where, f"{value!r} is not a readable JSON profile ({exc})") from None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if not isinstance(fmt, str) or not fmt.startswith(_PROFILE_FORMAT_PREFIX):
        raise TopologyError(source, where, f"{value!r} is not a calibration profile (format {fmt!r}; nbox calibrate writes one)")
    em = spec.emulation.model_copy(update={"profile": str(path)})
    raw = {**raw, "emulation": {**(raw.get("emulation") or {}), "profile": str(path)}}
    return spec.model_copy(update={"emulation": em}), raw


def _override_fields(ov: NodeOverride) -> dict[str, Any]:
    """The fields a node entry or an override sets (a NodeSpec's name is the caller's business)."""
    out = {k: v for k, v in ov.model_dump(exclude={"intra_node", "name"}).items() if v is not None}
    if ov.intra_node is not None:
        out["intra_node"] = ov.intra_node
    return out


def _resize(entries: list[dict[str, Any]], rpn: int, world_size: int, source: str) -> list[dict[str, Any]]:
    ranks = {e.get("ranks", rpn) for e in entries}
    if len(ranks) != 1:
        raise TopologyError(source, "whatif.world_size", "resizing needs every node to have the same number of ranks")
    per = ranks.pop()
    if world_size % per:
        raise TopologyError(source, "whatif.world_size", f"{world_size} is not a multiple of {per} ranks per node")
    count = world_size // per
    if count > MAX_NODES:
        raise TopologyError(source, "whatif.world_size",
                            f"{world_size} ranks at {per} a node make {count} nodes: at most {MAX_NODES}")
    out = entries[:count]
    taken = {e["name"] for e in out}
    i = len(out)
    while len(out) < count:
        name = f"node{i}"
        while name in taken:
            name += "x"
        taken.add(name)
        out.append({"name": name, "ranks": per})
        i += 1
    return out


def _check_network(spec: TopologyFile, nodes: list[Node], source: str) -> None:
    net = spec.network
    sections = {"fat_tree": "fat-tree", "rail": "rail-optimized"}
    for section, kind in sections.items():
        if getattr(net, section) is not None and net.type != kind:
            raise TopologyError(source, f"network.{section}", f"only allowed with type {kind!r} (type is {net.type!r})")
    if net.type != "links":
        if net.links:
            raise TopologyError(source, "network.links", f"only allowed with type 'links' (type is {net.type!r})")
        if net.switches:
            raise TopologyError(source, "network.switches", f"only allowed with type 'links' (type is {net.type!r})")
    if net.type == "fat-tree":
        k = net.fat_tree.k if net.fat_tree else None
        ports = sum(n.nics for n in nodes)
        if k is not None and k**3 // 4 < ports:
            raise TopologyError(
                source, "network.fat_tree.k", f"k={k} holds {k**3 // 4} NICs, the cluster has {ports}"
            )
    if net.type == "links":
        _check_links(net, nodes, source)


def _check_links(net, nodes: list[Node], source: str) -> None:
    if not net.links:
        raise TopologyError(source, "network.links", "type 'links' needs at least one link")
    by_name = {n.name: n for n in nodes}
    switches: set[str] = set()
    for i, s in enumerate(net.switches):
        if s in by_name or s in switches:
            raise TopologyError(source, f"network.switches[{i}]", f"duplicate name {s!r}")
        switches.add(s)
    for i, link in enumerate(net.links):
        a, b = link.endpoints
        if a == b:
            raise TopologyError(source, f"network.links[{i}].endpoints", f"a link needs two different ends, got {a!r} twice")
        for j, end in enumerate((a, b)):
            if end in switches:
                continue
            name, _, nic = end.partition(":")
            node = by_name.get(name)
            if node is None:
                raise TopologyError(
                    source, f"network.links[{i}].endpoints[{j}]", f"{end!r} is neither a node nor a listed switch"
                )
            if nic and (not nic.isdigit() or int(nic) >= node.nics):
                raise TopologyError(
                    source, f"network.links[{i}].endpoints[{j}]", f"{end!r}: node {name} has NICs 0-{node.nics - 1}"
                )


def effective_link(base: LinkSpec, override: Any) -> LinkSpec:
    """``base`` with the fields that ``override`` sets replaced."""
    if override is None:
        return base
    changes = {k: v for k, v in override.model_dump(include={"bandwidth", "latency", "jitter", "loss"}).items() if v is not None}
    return base.model_copy(update=changes)
