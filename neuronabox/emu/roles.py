"""Roles: classes of ranks that run the same program, and the profiles that record each one's program.

Emulated ranks are clones of the real one by default (backend.py). That is wrong for a
pipeline stage, an expert with its own load or the rank holding the loss. A **role** is a
class of ranks running the same program; ``nbox profile`` runs one real process per role
(each as one rank of the full emulated world, with every collective instant) and records its
program here; ``nbox run --role-profile DIR`` lets the emulated ranks of each role follow it
(replay.py).

The spec (``--roles``): rank sets separated by commas, each a role (``0,1``; ``0-3,4-7``;
``0-7:2,1-7:2`` for strided sets), or mesh dimension names (``pp``; ``pp,ep``) over
``--mesh pp=2,dp=4`` (outermost first, as ``init_device_mesh``). Rank sets are disjoint,
of one size and cover the world: position *i* of every set is one replica, and the ranks of
the real rank's replica are the ones replayed (``Roles.proxy``): by symmetry every other
replica runs as its counterpart there, so the cost is O(roles), not O(world).

A profile is a folder: ``profile.json`` (what it was recorded for: topology, world, command
and script digest, torch, the roles; written last, so its absence means the profiling run
did not finish) and one ``role-NAME.json`` per role. A role file is independent of the world
size: a communicator is named by its ordinal among the groups that hold the recording rank
(0 is the world), a peer by its position in that group.

Event lists (``events``), one entry per call of the recorded rank, times in seconds of its
own compute since the previous entry (the waits are left out):

- ``["op", gap, group, op, nbytes, peer, send(, payload)]``: a collective (peer -1, send 0;
  root in ``peer`` for rooted ones) or a point-to-point op (peer = group position, send 1 or
  0); a send of up to ``PAYLOAD_BYTES`` keeps its values, ``[dtype, [values]]``, which a
  receive from a replayed rank returns (a pipeline's warm-up vote, an object list's size);
- ``["wait", gap, k]``: a wait on the op of entry ``k``;
- ``["sync", gap]``: the optimizer is about to step: every op not yet waited is done
  (DDP and FSDP wait on their futures from C++, where Python cannot see it);
- ``["mark", gap]``: an iteration ends.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..collectives import Op
from ..errors import InputError

__all__ = [
    "Roles", "parse_roles", "parse_mesh", "RoleProgram", "ProfileMeta", "read_profile", "check_profile",
    "command_digest",
    "FORMAT", "MANIFEST", "PARTIAL", "PAYLOAD_BYTES", "merge_runs", "deferred", "infer_roles",
    "roles_for_world",
]

FORMAT = "nbox-roles/1"
MANIFEST = "profile.json"
PARTIAL = "profiling.json"  # the manifest while the roles are being recorded
PAYLOAD_BYTES = 1024  # sends up to this size keep their values (pipelining's votes, object-list sizes)
_SET = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Roles:
    """Which rank runs which role; ``sets[i]`` are role ``names[i]``'s ranks, position = replica."""

    names: tuple[str, ...]
    sets: tuple[tuple[int, ...], ...]
    spec: str = ""
    _role_of: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for i, ranks in enumerate(self.sets):
            for pos, r in enumerate(ranks):
                self._role_of[r] = (i, pos)

    @property
    def world_size(self) -> int:
        """How many ranks the roles cover."""
        return len(self._role_of)

    def role_of(self, rank: int) -> str:
        """The name of ``rank``'s role."""
        return self.names[self._role_of[rank][0]]

    def representative(self, name: str) -> int:
        """The rank a role's profile is recorded on (its replica 0)."""
        return self.sets[self.names.index(name)][0]

    def proxy(self, rank: int, real: int) -> int:
        """The rank of ``rank``'s role in the real rank's replica: the one that runs as ``rank`` does."""
        role, _ = self._role_of[rank]
        _, pos = self._role_of[real]
        return self.sets[role][pos]

    def actors(self, real: int) -> dict[int, str]:
        """The ranks replayed for ``real``: its replica's rank of every other role -> that role's name."""
        _, pos = self._role_of[real]
        mine = self.role_of(real)
        return {ranks[pos]: name for name, ranks in zip(self.names, self.sets) if name != mine}

    def as_dict(self) -> dict:
        """The JSON form kept in a profile."""
        return {"spec": self.spec, "roles": {n: list(s) for n, s in zip(self.names, self.sets)}}


def _rank_set(text: str, world: int, where: str) -> tuple[int, ...]:
    m = _SET.match(text.strip())
    if not m:
        raise InputError(f"{where}: {text!r} is not a rank, a range A-B or a strided range A-B:STEP")
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    step = int(m.group(3)) if m.group(3) is not None else 1
    if step < 1 or b < a:
        raise InputError(f"{where}: {text!r} is an empty range")
    if b >= world:
        raise InputError(f"{where}: rank {b} in {text!r} is outside the world of {world} ranks (0-{world - 1})")
    return tuple(range(a, b + 1, step))


def parse_mesh(text: str, world: int) -> tuple[tuple[str, int], ...]:
    """``pp=2,dp=4`` -> (("pp", 2), ("dp", 4)); the product must be the world size."""
    dims: list[tuple[str, int]] = []
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if not _NAME.match(name) or not size.strip().isdigit() or int(size) < 1:
            raise InputError(f"--mesh: {part.strip()!r} is not NAME=SIZE (e.g. pp=2,dp=4)")
        if name in (d for d, _ in dims):
            raise InputError(f"--mesh: dimension {name!r} is named twice")
        dims.append((name, int(size)))
    total = 1
    for _, s in dims:
        total *= s
    if total != world:
        raise InputError(f"--mesh: {text!r} holds {total} ranks but the world has {world}")
    return tuple(dims)


def parse_roles(spec: str, world: int, mesh: str | None = None) -> Roles:
    """Parse ``--roles``: rank sets (``0,1``; ``0-3,4-7``) or mesh dimension names (``pp``) over ``--mesh``."""
    spec = spec.strip()
    if not spec:
        raise InputError("--roles: empty (give rank sets like 0,1 or a mesh dimension like pp)")
    parts = [p.strip() for p in spec.split(",")]
    if all(_NAME.match(p) for p in parts):
        return _mesh_roles(spec, parts, world, mesh)
    if mesh:
        raise InputError(f"--mesh is read only with mesh dimension names in --roles, got --roles {spec!r}")
    sets = [_rank_set(p, world, "--roles") for p in parts]
    seen: dict[int, str] = {}
    for text, ranks in zip(parts, sets):
        for r in ranks:
            if r in seen:
                raise InputError(f"--roles: rank {r} is in two roles ({seen[r]!r} and {text!r})")
            seen[r] = text
    if len(seen) != world:
        missing = sorted(set(range(world)) - set(seen))
        raise InputError(f"--roles {spec!r}: ranks {_short(missing)} have no role (the sets must cover all {world})")
    if len({len(s) for s in sets}) != 1:
        raise InputError(f"--roles {spec!r}: the sets differ in size ({', '.join(str(len(s)) for s in sets)}); "
                         "each position of the sets is one replica")
    names = tuple(f"r{s[0]}" for s in sets)
    return Roles(names, tuple(sets), spec)


def _mesh_roles(spec: str, dims: list[str], world: int, mesh: str | None) -> Roles:
    if not mesh:
        raise InputError(f"--roles {spec!r} names mesh dimensions: give the mesh too (--mesh pp=2,dp=4)")
    shape = parse_mesh(mesh, world)
    names = [d for d, _ in shape]
    for d in dims:
        if d not in names:
            raise InputError(f"--roles: {d!r} is not a dimension of --mesh {mesh!r} ({', '.join(names)})")
    sizes = [s for _, s in shape]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        coords, rest = [], rank
        for s in reversed(sizes):
            coords.append(rest % s)
            rest //= s
        coords.reverse()
        key = tuple(c for c, d in zip(coords, names) if d in dims)
        groups.setdefault(key, []).append(rank)
    keys = sorted(groups)
    role_names = tuple("_".join(f"{d}{c}" for d, c in zip([d for d in names if d in dims], k)) for k in keys)
    return Roles(role_names, tuple(tuple(groups[k]) for k in keys), f"{spec} over {mesh}")


def deferred(spec: str) -> bool:
    """Whether ``spec`` needs what the script tells (``auto``, or mesh dimensions without ``--mesh``)."""
    parts = [p.strip() for p in spec.split(",")]
    return spec.strip() == "auto" or all(_NAME.match(p) for p in parts if p)


def infer_roles(spec: str, world: int, mesh: str | None, recorded: dict) -> Roles:
    """The roles of ``spec`` given what rank 0's profiling run recorded (its mesh, its pipeline stages).

    ``auto``: the mesh's ``pp`` and ``ep`` dimensions; else the pipeline stages (each stage's
    ranks one role, the stage group's stride telling the layout); else an ``InputError``.
    """
    shape = recorded.get("mesh")
    mesh_text = mesh or (",".join(f"{n}={s}" for n, s in shape) if shape else None)
    if spec.strip() != "auto":
        if not mesh_text:
            raise InputError(f"--roles {spec!r} names mesh dimensions, but the script built no DeviceMesh with "
                             "dimension names: give --mesh (e.g. --mesh pp=2,dp=4) or rank sets")
        return parse_roles(spec, world, mesh_text)
    if shape:
        dims = [n for n, _ in shape if n in ("pp", "ep")]
        if dims:
            return parse_roles(",".join(dims), world, mesh_text)
    stages = recorded.get("stages") or []
    if stages:
        group = stages[0]["ranks"]
        p = len(group)
        stride = group[1] - group[0] if p > 1 else 1
        if p > 1 and group == [group[0] + i * stride for i in range(p)] and world % p == 0 and group[0] == 0:
            sets = [tuple(r for r in range(world) if (r // stride) % p == i) for i in range(p)]
            if sorted(r for s in sets for r in s) == list(range(world)):
                return Roles(tuple(f"stage{i}" for i in range(p)), tuple(sets), f"auto: {p} pipeline ranks")
    raise InputError("--roles auto: the script tells no layout (no DeviceMesh with a pp or ep dimension, no "
                     "pipeline stage group); name the roles: --roles 0,1 or --roles pp --mesh pp=2,dp=4")


def _short(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def command_digest(command: Sequence[str]) -> str:
    """A digest of the command line and of every file it names (the script): a changed script is another program."""
    h = hashlib.sha256()
    for arg in command:
        h.update(arg.encode() + b"\0")
        p = Path(arg)
        if arg.endswith(".py") and p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class RoleProgram:
    """One role's recorded program: the events of its representative rank, and the groups it belonged to."""

    name: str
    rank: int
    groups: tuple[int, ...]  # the sizes of the groups that held the recording rank, by ordinal
    events: tuple[tuple, ...]
    iterations: int


@dataclass(frozen=True)
class ProfileMeta:
    """What a profile was recorded for."""

    path: Path
    topology: str
    world_size: int
    device: str
    command: tuple[str, ...]
    digest: str
    torch: str
    roles: Roles
    programs: dict[str, RoleProgram]


def merge_runs(runs: Sequence[dict]) -> dict:
    """One role file from several recordings of the same role: each event's gap is the median of its runs'.

    One run of a CPU process reads its compute 10-20% off another's on a busy machine (whole
    runs, not iterations, differ); the median of a few is the program the role typically runs.
    The runs must have made the same calls; a ``ValueError`` says where they part.
    """
    first = runs[0]
    events = first["events"]
    for k, other in enumerate(runs[1:], 2):
        theirs = other["events"]
        for i, (a, b) in enumerate(zip(events, theirs)):
            if a[0] != b[0] or a[2:7] != b[2:7]:
                raise ValueError(f"run {k} of role {first['role']} made another call at entry {i} ({b[:1] + b[2:7]} "
                                 f"against {a[:1] + a[2:7]}): its program depends on timing or data")
        if len(theirs) != len(events):
            raise ValueError(f"run {k} of role {first['role']} made {len(theirs)} calls, run 1 {len(events)}")
    merged = []
    for i, e in enumerate(events):
        gaps = sorted(r["events"][i][1] for r in runs)
        merged.append([e[0], gaps[len(gaps) // 2]] + list(e[2:]))
    return {**first, "events": merged, "runs": len(runs)}


def _fail(path: Path, what: str) -> InputError:
    return InputError(f"{path}: {what}")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(path, "not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"not a role profile ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise _fail(path, "not a role profile (not a JSON object)")
    return data


def _field(data: dict, key: str, kind, path: Path):
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _fail(path, f"field {key!r} is missing or not {getattr(kind, '__name__', kind)} (got {value!r:.60})")
    return value


_OPS = frozenset(o.value for o in Op)


def _payload_ok(p) -> bool:
    return (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
            and all(isinstance(v, (int, float)) for v in p[1]))


def _program(path: Path, name: str) -> RoleProgram:
    data = _read_json(path)
    if data.get("format") != FORMAT:
        raise _fail(path, f"field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    events = _field(data, "events", list, path)
    num, ops = (int, float), _OPS
    for i, e in enumerate(events):  # a loop a start-up pays per recorded call: plain checks, no generators
        ok = type(e) is list and len(e) >= 2 and type(e[1]) in num and e[1] >= 0
        kind = e[0] if ok else None
        if kind == "op":
            ok = (len(e) in (7, 8) and type(e[2]) is int and e[3] in ops and type(e[4]) is int
                  and type(e[5]) is int and type(e[6]) is int and (len(e) == 7 or _payload_ok(e[7])))
        elif kind == "wait":
            ok = len(e) == 3 and type(e[2]) is int
            if ok and not (0 <= e[2] < i and events[e[2]][0] == "op"):
                raise _fail(path, f"events[{i}] waits on entry {e[2]!r}, which is no earlier op")
        else:
            ok = ok and kind in ("sync", "mark") and len(e) == 2
        if not ok:
            raise _fail(path, f"events[{i}] is not a role event: {e!r:.80}")
    groups = _field(data, "groups", list, path)
    if data.get("role") != name:
        raise _fail(path, f"field 'role' is {data.get('role')!r}, expected {name!r}")
    return RoleProgram(name, _field(data, "rank", int, path), tuple(groups), tuple(tuple(e) for e in events),
                       _field(data, "iterations", int, path))


def read_profile(folder: Path, partial: bool = False) -> ProfileMeta:
    """Read a role profile and check that it is whole; an ``InputError`` names the file and field.

    ``partial``: the profile being recorded (``PARTIAL`` instead of ``MANIFEST``), with the
    roles recorded so far; the others have no program and run as clones.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"--role-profile: {folder} is not a folder (record one with `nbox profile`)")
    manifest = folder / (PARTIAL if partial else MANIFEST)
    if not manifest.exists():
        parts = sorted(p.name for p in folder.glob("role-*.json*"))
        what = f"holds {', '.join(parts)} but no {MANIFEST}" if parts else f"has no {MANIFEST}"
        raise _fail(folder, f"{what}: the profiling run did not finish (partial profile); record it again")
    data = _read_json(manifest)
    if data.get("format") != FORMAT:
        raise _fail(manifest, f"field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    world_size = _field(data, "world_size", int, manifest)
    spec = _field(data, "roles", dict, manifest)
    table = spec.get("roles")
    if not isinstance(table, dict) or not table:
        raise _fail(manifest, "field 'roles.roles' is missing or empty")
    try:
        names = tuple(table)
        sets = tuple(tuple(int(r) for r in table[n]) for n in names)
    except (TypeError, ValueError):
        raise _fail(manifest, "field 'roles.roles' is not NAME -> [ranks]") from None
    if sorted(r for s in sets for r in s) != list(range(world_size)) or len({len(s) for s in sets}) != 1:
        raise _fail(manifest, f"field 'roles.roles' does not split the world of {world_size} ranks into equal sets")
    roles = Roles(names, sets, str(spec.get("spec", "")))
    programs = {}
    for name in names:
        if partial and not (folder / f"role-{name}.json").exists():
            continue
        prog = _program(folder / f"role-{name}.json", name)
        if prog.rank != roles.representative(name):
            raise _fail(folder / f"role-{name}.json", f"recorded on rank {prog.rank}, the role's first rank is "
                                                      f"{roles.representative(name)}")
        programs[name] = prog
    command = _field(data, "command", list, manifest)
    return ProfileMeta(folder, _field(data, "topology", str, manifest), world_size,
                       _field(data, "device", str, manifest), tuple(str(c) for c in command),
                       _field(data, "digest", str, manifest), _field(data, "torch", str, manifest), roles, programs)


_DATA_DIMS = ("dp", "dp_replicate", "dp_shard", "data", "replica")


def roles_for_world(meta: ProfileMeta, world: int) -> Roles:
    """The profile's roles in a world of ``world`` ranks: mesh roles grow their data-parallel dimension (what-if)."""
    if world == meta.world_size:
        return meta.roles
    why = f"recorded for world size {meta.world_size}, this run has {world}"
    dims, sep, mesh = meta.roles.spec.partition(" over ")
    if not sep:
        raise _fail(meta.path / MANIFEST, f"{why}; only roles over mesh dimensions (--roles pp) follow the world's size")
    shape = [(n, int(v)) for n, _, v in (d.partition("=") for d in mesh.split(","))]
    role_dims = {d.strip() for d in dims.split(",")}
    free = [n for n, _ in shape if n not in role_dims]
    data = next((n for n in free if n in _DATA_DIMS), free[0] if free else None)
    if data is None or world % (meta.world_size // dict(shape)[data]):
        raise _fail(meta.path / MANIFEST, f"{why}; its mesh {mesh} has no data-parallel dimension that grows to it")
    grown = ",".join(f"{n}={v * world // meta.world_size if n == data else v}" for n, v in shape)
    return parse_roles(dims, world, grown)


def check_profile(meta: ProfileMeta, *, topology: str, world_size: int, device: str, command: Sequence[str],
                  torch_version: str) -> None:
    """Refuse a profile recorded for another run: the first mismatch, as an ``InputError``."""
    manifest = meta.path / MANIFEST
    roles_for_world(meta, world_size)  # another world: only mesh roles grow to it
    for key, recorded, now in (
        ("topology", meta.topology, topology),
        ("device", meta.device, device),
        ("torch", meta.torch, torch_version),
    ):
        if recorded != now:
            raise _fail(manifest, f"recorded for {key} {recorded!r}, this run has {now!r}")
    digest = command_digest(command)
    if meta.digest != digest:
        raise _fail(manifest, f"recorded for another command or script ({' '.join(meta.command)!r}, digest "
                              f"{meta.digest}); this run: {' '.join(command)!r}, digest {digest}")
