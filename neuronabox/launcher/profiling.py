"""``nbox profile``: record each role's program, one real run per role, one after another.

Each role's first rank runs the unmodified command as the real rank of the full emulated
world (``run_command``), with ``NBOX_ROLE_RECORD`` set, so its process writes its calls and
the compute between them (role_record.py). The runs take the topology's own delay model: on
a CPU host, compute that follows a wait runs slower than compute that follows an instant
collective (cold caches, an idled core): a 2-stage pipeline's heavy stage read 1.5-1.6 ms of
forward per micro-batch with instant collectives and 2.3-2.5 ms with modeled ones here. The gaps leave the waits out
either way, so the others' timing does not enter a role's program.

Nothing is half-made: role files are written into the folder as ``role-NAME.json`` only after
their run ended well, and ``profile.json``, which a replay needs, only after every role's.
A failed or stopped profiling removes what it wrote.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..emu.replay import ENV_ROLE_PARTIAL, ENV_ROLE_PROFILE
from ..emu.role_record import ENV_ROLE_NAME, ENV_ROLE_RECORD
from ..emu.roles import (
    FORMAT,
    MANIFEST,
    PARTIAL,
    ProfileMeta,
    Roles,
    check_profile,
    command_digest,
    deferred,
    infer_roles,
    merge_runs,
    parse_roles,
    read_profile,
)
from ..errors import InputError, RunFailed
from ..topology import Topology
from .runner import describe_exit, run_command

__all__ = ["record_profile", "replay_env", "torch_version", "topology_device", "RoleRun"]


def torch_version() -> str:
    """The installed torch's version, without importing it (seconds of start-up)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def topology_device(topology: Topology) -> str:
    """The devices of the topology's nodes, as a profile records them (compute is measured on them)."""
    return ",".join(sorted({n.device for n in topology.nodes}))


@dataclass
class RoleRun:
    """How one role's profiling run went."""

    role: str
    rank: int
    returncode: int
    iteration_median: float | None


def record_profile(
    topology: Topology,
    command: Sequence[str],
    roles: Roles | str,
    out: Path,
    model: str | None = None,
    on_role: Callable[[str, int], None] | None = None,
    repeats: int = 1,
    mesh: str | None = None,
) -> tuple[ProfileMeta, list[RoleRun]]:
    """Run ``command`` ``repeats`` times per role and write the profile folder ``out``; returns it read back.

    ``roles`` as text (``auto``, or mesh dimensions without ``mesh``) is resolved from what
    rank 0's run records (its DeviceMesh, its pipeline stages): rank 0 is the first rank of its
    role under any spec, so its run is always one of the profile's.
    """
    if repeats < 1:
        raise InputError(f"--repeats: must be 1 or more, got {repeats}")
    if isinstance(roles, str) and not (deferred(roles) and not mesh):
        roles = parse_roles(roles, topology.world_size, mesh)
    if isinstance(roles, Roles) and roles.world_size != topology.world_size:
        raise InputError(f"--roles: the roles cover {roles.world_size} ranks, the world has {topology.world_size}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {out} exists and is not a folder")
    created = not out.exists()
    written: list[Path] = []
    stale = [out / MANIFEST, out / PARTIAL] + sorted(out.glob("role-*.json")) if out.is_dir() else []
    runs: list[RoleRun] = []
    ok = False

    def record(name: str, rank: int, replaying: bool) -> dict:
        if on_role is not None:
            on_role(name, rank)
        recorded = []
        for k in range(repeats):
            part = out / f"role-{name}.json.part{k}"
            written.append(part)
            env = {ENV_ROLE_RECORD: str(part.resolve()), ENV_ROLE_NAME: name}
            if replaying:
                # The roles recorded so far replay in this run: what they send it (a pipeline's
                # vote) is what they recorded, not a clone's zeros.
                env.update({ENV_ROLE_PROFILE: str(out.resolve()), ENV_ROLE_PARTIAL: "1"})
            result = run_command(topology, command, rank, model=model, extra_env=env)
            its = (result.record or {}).get("iterations") or []
            median = statistics.median(its[1:] or its) if its else None
            runs.append(RoleRun(name, rank, result.returncode, median))
            if result.returncode != 0:
                raise RunFailed(f"profiling role {name} (rank {rank}): the command "
                                f"{describe_exit(result.returncode)}; no profile was written")
            if not part.exists():
                raise RunFailed(f"profiling role {name} (rank {rank}): the command made no torch.distributed calls")
            recorded.append(json.loads(part.read_text(encoding="utf-8")))
            part.unlink()
        try:
            return merge_runs(recorded)
        except ValueError as exc:
            raise RunFailed(f"profiling role {name} (rank {rank}): {exc}") from None

    def keep(name: str, data: dict) -> None:
        final = out / f"role-{name}.json"
        written.append(final)
        final.write_text(json.dumps({**data, "role": name}, separators=(",", ":")), encoding="utf-8")

    try:
        out.mkdir(parents=True, exist_ok=True)
        for path in stale:  # an older profile here is replaced as a whole, never mixed with this one
            path.unlink(missing_ok=True)
        first = None
        if not isinstance(roles, Roles):
            first = record("rank0", 0, replaying=False)
            roles = infer_roles(roles, topology.world_size, mesh, first)
            if on_role is not None:
                on_role(f"= {roles.spec}: {', '.join(roles.names)}", -1)
        manifest = {
            "format": FORMAT,
            "topology": topology.name,
            "world_size": topology.world_size,
            "device": topology_device(topology),
            "command": list(command),
            "digest": command_digest(command),
            "torch": torch_version(),
            "model": model,
            "roles": roles.as_dict(),
        }
        partial = out / PARTIAL
        written.append(partial)
        partial.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        for n, name in enumerate(roles.names):
            rank = roles.representative(name)
            if first is not None and rank == 0:
                keep(name, first)
                continue
            keep(name, record(name, rank, replaying=n > 0 or first is not None))
        os.replace(partial, out / MANIFEST)
        ok = True
    finally:
        if not ok:
            for path in written:
                path.unlink(missing_ok=True)
            if created:
                shutil.rmtree(out, ignore_errors=True)
    return read_profile(out), runs


def replay_env(folder: Path, topology: Topology, command: Sequence[str]) -> dict[str, str]:
    """Check the profile ``folder`` against this run (exit 2 on a mismatch); the environment that replays it."""
    meta = read_profile(Path(folder))
    check_profile(meta, topology=topology.name, world_size=topology.world_size, device=topology_device(topology),
                  command=command, torch_version=torch_version())
    return {ENV_ROLE_PROFILE: str(Path(folder).resolve())}
