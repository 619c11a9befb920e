"""``nbox validate``: the real system against the emulated one, on the same shaped network.

The real system: every rank of the topology runs the user's command in its node's namespace
of a netns cluster (``nbox up``), gloo over the shaped links, ``MASTER_ADDR`` = rank 0's node
address, each rank pinned to its own core. Gloo binds the node address (see ``launch_real``
for why not ``GLOO_SOCKET_IFNAME``). The real rank's iteration times come from the
record-only ``sitecustomize`` (``recordonly/``): the same iteration marks as ``nbox run``
(end of the first optimizer's step), the real backend untouched.

The emulated system: the topology's real rank runs the same command under ``nbox run`` in
model mode (and in wire mode through ``nbox run --cluster NAME --mode wire`` where that
option exists), pinned to the core that rank had in the real system.

The load twin: here the real system's ranks share this machine (its cores, caches, memory
bandwidth), while a lone emulated rank would have the machine to itself, so the error would
mix the emulator's communication fidelity with the reference's hardware sharing. During each
emulated run every other rank of the real system also runs, as an independent ``nbox run``
of the same command whose real rank is that rank (its own emulation, model mode), pinned to
that rank's core, started at the same time, meeting the measured rank when their process
groups are created and waiting for it at the end of its first iteration (``emu/start_gate.py``);
its figures are not reported. The twin
reproduces the other ranks' compute load; in model mode its footprint (a calibrated profile's
CPU cost) also spends what those ranks' moving of bytes costs. Beside a wire-mode run the
bytes really move, the stubs and the relay spend that CPU themselves, so the twin runs without
its footprint (``NBOX_FOOTPRINT=0``). On separate machines (the paper's setting) there is
nothing to reproduce: ``twin=False``.

This machine is noisy (see DESIGN.md, "This machine"): runs are interleaved (each repeat
runs every mode once, in a rotated order, so drift hits all modes alike) and repeated, and
the real system's own run-to-run spread is reported beside each error. What the runs found
(errors, intervals, verdicts, the table) is computed in ``verdict.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from ..emu import start_gate
from ..errors import InputError, RunFailed
from ..units import parse_fraction_flag
from .real_system import (
    RECORD_ONLY_DIR,
    cluster_for,
    cores_shared,
    exit_codes_text,
    launch_real,
    rank_cores,
    rank_preexec,
    rank_ranges,
    stop_process,
    twin_ranks,
)
from .verdict import AGAIN, ModeResult, Validation, compare

__all__ = [
    "MODES",
    "RECORD_ONLY_DIR",
    "parse_tolerance",
    "parse_modes",
    "wire_available",
    "cluster_for",
    "rank_cores",
    "twin_ranks",
    "launch_real",
    "run_validation",
]

MODES = ("model", "wire", AGAIN)


def parse_tolerance(text: str) -> float:
    """``1%`` or ``0.01`` -> 0.01; errors name the flag."""
    return parse_fraction_flag(text, "--tolerance")


def parse_modes(text: str) -> list[str]:
    """``model,wire`` -> ["model", "wire"]; errors name the flag."""
    modes = [m.strip() for m in str(text).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise InputError(f"--modes: expected a comma list of {', '.join(MODES)}, got {text!r}")
    return list(dict.fromkeys(modes))


def wire_available() -> tuple[bool, str]:
    """Whether ``nbox run``'s launcher takes a cluster and a mode (wire mode), and why not."""
    # The launcher, not the CLI above this layer: `nbox run --cluster --mode` passes both to it.
    from ..launcher import runner

    params = inspect.signature(runner.run_command).parameters
    if "cluster" in params and "mode" in params:
        return True, ""
    return False, "nbox run has no --cluster/--mode wire in this build"


# ---- one run of each system -------------------------------------------------------------------------
def _emulated_argv(topo_file: Path, command: Sequence[str], report: Path | None, model: str | None,
                   profile: Path | None, *, mode: str = "model", cluster: str | None = None,
                   rank: int | None = None, role_profile: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "neuronabox.cli", "run", str(topo_file), "-q"]
    if role_profile is not None:
        argv += ["--role-profile", str(role_profile)]
    if report is not None:
        argv += ["--report", str(report)]
    if rank is not None:
        argv += ["--rank", str(rank)]
    if model:
        argv += ["-m", model]
    if profile is not None:
        argv += ["--profile", str(profile)]
    if mode == "wire":
        argv += ["--cluster", cluster or "", "--mode", "wire"]
    return argv + ["--", *command]


def _run_emulated(
    topo_file: Path, command: Sequence[str], mode: str, report: Path, core: int, cluster: str | None,
    model: str | None, profile: Path | None, log: Path | None, timeout: float = 900.0,
    twins: Sequence[tuple[int, int]] = (), say: Callable[[str], None] = lambda m: None,
    rank: int | None = None, role_profile: Path | None = None, extra_env: dict[str, str] | None = None,
) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("NBOX_RECORD", "NBOX_RECORD_ONLY")}
    outs, twin_procs = [], []
    p: subprocess.Popen | None = None
    # The twins' steps run beside the measured rank's (start_gate.py): all meet when their first
    # process group exists, and the twins wait at the end of their first iteration for the
    # measured rank to end its own.
    gate = report.with_name(f"{report.stem}.gate")
    shutil.rmtree(gate, ignore_errors=True)
    if twins:
        gate.mkdir()
        env.update({start_gate.ENV_GATE: str(gate), start_gate.ENV_PARTIES: str(1 + len(twins))})
    try:
        # The twins start first (each is an nbox run in model mode of its own rank, no report,
        # no cluster), so that the measured rank never computes on an idle machine.
        for twin_rank, twin_core in twins:
            tlog = log.with_name(f"{log.stem}-twin{twin_rank}.log") if log else None
            tout = open(tlog, "wb") if tlog else subprocess.DEVNULL
            if tlog:
                outs.append(tout)
            argv = _emulated_argv(topo_file, command, None, model, profile, rank=twin_rank, role_profile=role_profile)
            # In wire mode the bytes really move: the stub and the delay relay spend what the
            # other rank's gloo and sending cost, so the twin must not spend it a second time
            # through its footprint.
            tenv = {**env, "NBOX_FOOTPRINT": "0"} if mode == "wire" else env
            twin_procs.append((twin_rank, subprocess.Popen(argv, env=tenv, stdin=subprocess.DEVNULL, stdout=tout,
                                                      stderr=subprocess.STDOUT, preexec_fn=rank_preexec(None, twin_core))))
        out = open(log, "wb") if log else subprocess.DEVNULL
        if log:
            outs.append(out)
        argv = _emulated_argv(topo_file, command, report, model, profile, mode=mode, cluster=cluster, rank=rank,
                              role_profile=role_profile)
        p = subprocess.Popen(argv, env={**env, **(extra_env or {}), start_gate.ENV_LEAD: "1"},
                             stdin=subprocess.DEVNULL, stdout=out,
                             stderr=subprocess.STDOUT, preexec_fn=rank_preexec(None, core))
        t0 = time.monotonic()
        # A process that ends early (a twin that failed, or the measured rank) must not leave the
        # others waiting at the start gate: a thread per process marks the gate abandoned.
        if twins:
            for proc in [p] + [tp for _, tp in twin_procs]:
                threading.Thread(target=_abandon_when_ended, args=(proc, gate), daemon=True).start()
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process(p)
            rc = 124
        # A twin runs the same steps and ends about when the measured rank does; one that lags
        # far behind only loads an idle machine now, so it is ended, and its status is a note.
        # Beside a failed measured rank there is nothing to wait for.
        grace = max(30.0, 0.5 * (time.monotonic() - t0)) if rc == 0 else 1.0
        for trank, tp in twin_procs:
            try:
                trc = tp.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                stop_process(tp)
                trc = 124
            grace = 1.0
            if trc != 0 and rc == 0:
                say(f"note: load twin rank {trank} ended with status {trc}"
                    + (f" (log {log.with_name(f'{log.stem}-twin{trank}.log')})" if log else ""))
        return rc
    finally:
        # Also the measured rank: a signal (nbox validate stopped) can leave its wait early.
        for proc in ([p] if p is not None else []) + [tp for _, tp in twin_procs]:
            stop_process(proc)
        for f in outs:
            f.close()
        shutil.rmtree(gate, ignore_errors=True)


def _abandon_when_ended(proc: subprocess.Popen, gate: Path) -> None:
    proc.wait()
    if gate.is_dir():
        with contextlib.suppress(OSError):
            (gate / start_gate.ABANDONED).touch()


def _measured(iterations: list[float], warmup: int, count: int | None, what: str) -> list[float]:
    if len(iterations) <= warmup:
        raise InputError(f"{what}: the command ran {len(iterations)} iterations, no more than --warmup {warmup}")
    out = iterations[warmup:]
    return out[:count] if count else out


def run_validation(
    topology_file: Path,
    command: Sequence[str],
    *,
    iterations: int | None = None,
    warmup: int = 1,
    repeats: int = 3,
    tolerance: float = 0.01,
    modes: Sequence[str] = ("model", "wire"),
    model: str | None = None,
    profile: Path | None = None,
    cluster: str | None = None,
    progress: Callable[[str], None] | None = None,
    keep_logs: Path | None = None,
    twin: bool = True,
    calibrate_ops: Sequence | None = None,
    calibrate_sizes: tuple[int, int] | None = None,
    calibrate_precision: float = 0.02,
    calibrate_budget_s: float = 0.15,
    calibrate_bucket_precision: float | None = None,
    real_rank: int | None = None,
    role_profile: Path | None = None,
    roles: str | None = None,
    mesh: str | None = None,
    role_repeats: int = 3,
    against: Sequence[Path] | None = None,
) -> Validation:
    """Run the real and the emulated systems interleaved ``repeats`` times and compare their iteration times.

    ``twin``: run the load twin beside every emulated run (see the module's notes); turn it off
    when the real system's ranks do not share one machine. ``calibrate_ops``: first calibrate
    these collectives (at sizes ``calibrate_sizes``, MIN and MAX, else calibrate's default; each
    size's median to ``calibrate_precision``, 0: the sweep's passes only; ``calibrate_budget_s`` of
    measuring a size; ``calibrate_bucket_precision``: calibrate's ``--bucket-precision``, None its default) on
    the validation's own cluster (``nbox calibrate``'s sweep) and run the
    emulated systems on that profile, written to ``profile`` (else to ``keep_logs``, else dropped).
    ``real_rank``: the emulated runs' real rank, the one the real system records (default the
    topology's first real rank). ``role_profile``: the emulated runs (and their twins) replay the
    other roles from it (``nbox run --role-profile``). ``roles``: first record that profile here
    (``nbox profile``'s spec and ``mesh``), each role under the load twin (``_profile_here``),
    ``role_repeats`` runs a role; written to ``role_profile`` if given. ``against``: the real
    system is not run here; its runs are these ``nbox record`` folders (one run each), made on
    the testbed the topology describes, and only the emulated modes run.
    """
    from ..model.calibrated import with_profile
    from ..model.registry import create_model
    from ..topology import load_topology

    say = progress or (lambda msg: None)
    if not command:
        raise InputError("nbox validate: no command to run "
                         "(usage: nbox validate TOPOLOGY [OPTIONS] -- python train.py ARGS)")
    if repeats < 1:
        raise InputError(f"--repeats: must be 1 or more, got {repeats}")
    if warmup < 0:
        raise InputError(f"--warmup: must be 0 or more, got {warmup}")
    if iterations is not None and iterations < 1:
        raise InputError(f"--iterations: must be 1 or more, got {iterations}")
    topo = load_topology(topology_file)
    if real_rank is not None and not 0 <= real_rank < topo.world_size:
        raise InputError(f"--rank: rank {real_rank} is not in 0-{topo.world_size - 1}")
    recorded: list[list[float]] = []
    if against:
        from .record import load_against

        if AGAIN in modes:
            raise InputError(f"--modes: {AGAIN} reruns the real system here, which --against reads from records instead")
        if calibrate_ops or roles is not None:
            raise InputError("--against: --calibrate and --roles need the real system here (record and calibrate apart)")
        rank0 = topo.emulation.real_ranks[0] if real_rank is None else real_rank
        recorded = [_measured(its, warmup, iterations, f"record {folder}")
                    for its, folder in zip(load_against(against, rank0, topo.world_size), against)]
    if roles is not None:
        from ..emu.roles import deferred, parse_roles

        if not (deferred(roles) and not mesh):
            parse_roles(roles, topo.world_size, mesh)  # a bad spec fails before any cluster exists
        if role_repeats < 1:
            raise InputError(f"--role-repeats: must be 1 or more, got {role_repeats}")
    elif role_profile is not None:
        from ..launcher.profiling import replay_env

        replay_env(role_profile, topo, command)  # a mismatched profile fails before any run
    if topo.emulation.library != "gloo":
        say(f"note: {topology_file} says library {topo.emulation.library}; the real system here runs gloo")
    cores = cores_shared(topo.world_size)
    if cores:
        # Round robin then: the reference shares cores where a real cluster gives each rank its own.
        say(f"note: {topo.world_size} real ranks on {cores} cores here: the real system's ranks share cores "
            f"(round robin), so it is slower than a cluster of {topo.world_size} machines")
    # A bad model or profile fails here, before any cluster exists; the emulated runs get the
    # same flags (``nbox run --profile``), so they resolve the profile the same way.
    if calibrate_ops:
        if model not in (None, "calibrated"):
            raise InputError(f"--calibrate: measures a profile for model calibrated, but --model is {model!r} "
                             "(drop one of them)")
        if topo.emulation.library != "gloo":
            raise InputError(f"--calibrate: {topology_file}: emulation.library: {topo.emulation.library}: the real "
                             "system here runs gloo, so only a gloo profile can be measured (set library: gloo)")
        calibrated_to, profile = profile, None  # written once measured; until then the topology's own
    effective = with_profile(topo, profile, model)
    create_model(effective)
    if profile is not None:
        profile = Path(profile).resolve()
    wire_ok, wire_why = wire_available()
    results = {m: ModeResult(m, *((wire_ok, wire_why) if m == "wire" else (True, ""))) for m in modes}
    real = ModeResult("real")
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nbox-validate-")))
        logs = keep_logs or tmp
        logs.mkdir(parents=True, exist_ok=True)
        if against and "wire" not in modes:
            up = None  # model mode needs no cluster: the real system ran on the testbed
        else:
            up = stack.enter_context(cluster_for(topo, cluster, say))
            say(f"cluster {up.name} up ({len(up.nodes)} nodes, {up.seconds:.1f} s)")
        real.runs.extend(recorded)
        if calibrate_ops:
            # On the cluster the runs use, right before them: a profile measured minutes or a
            # cluster instance earlier reads this machine's state then (docs/guide/validate.md).
            profile = _calibrate_here(topo, up.name, calibrate_ops, calibrate_sizes, calibrated_to, keep_logs or tmp, say,
                                      calibrate_precision, calibrate_budget_s, calibrate_bucket_precision)
            effective = with_profile(topo, profile, None)
        if roles is not None:
            role_profile = _profile_here(topology_file, topo, command, roles, mesh, role_repeats, model, profile,
                                         role_profile, tmp, logs, twin, say)
        # The emulated run's real rank gets the core that rank had in the real system.
        real_rank = topo.emulation.real_ranks[0] if real_rank is None else real_rank
        core0 = rank_cores(topo.world_size)[real_rank]
        twins = twin_ranks(topo.world_size, real_rank) if twin else []
        if twins:
            pinned = (f"pinned to core(s) {', '.join(str(c) for _, c in twins)}" if len(twins) <= 8 else
                      f"each pinned to its rank's core, cores {rank_ranges([c for _, c in twins])}")
            say(f"load twin: rank(s) {rank_ranges([r for r, _ in twins])} run beside each emulated run "
                f"(their own nbox run, {pinned})")
        systems = ([] if against else ["real"]) + [m for m in modes if results[m].available]
        real_walls: list[float] = []
        runs = 0
        for rep in range(repeats):
            # Rotate the order each repeat: no system always runs first after a quiet pause.
            order = systems[rep % len(systems):] + systems[: rep % len(systems)]
            for system in order:
                if system != "real" and results[system].failed:
                    continue
                runs += 1
                rec = tmp / f"{system}-{rep}.json"
                t0 = time.perf_counter()
                if system in ("real", AGAIN):
                    # real-again is the reference rerun in a slot of its own: the error it reads is
                    # this machine's noise alone, what a perfect emulator would read.
                    its = _run_real(up.name, topo, command, rec, logs, f"{system}-{rep}", real_rank, keep_logs, say,
                                    f"[{runs}] repeat {rep + 1} {system}")
                    (real if system == "real" else results[system]).runs.append(
                        _measured(its, warmup, iterations, "real system"))
                    real_walls.append(time.perf_counter() - t0)
                else:
                    log = logs / f"{system}-{rep}.log"
                    # A hung emulated run (seen once in wire mode) must not stall the whole validation.
                    limit = max(120.0, 10 * max(real_walls, default=60.0))
                    rc = _run_emulated(topology_file, command, system, rec, core0, up.name if up else None, model,
                                       profile, log, limit,
                                       twins=twins, say=lambda m, k=runs: say(f"[{k}] {m}"), rank=real_rank,
                                       role_profile=role_profile)
                    if rc != 0:
                        # The other modes still get their row; this one fails the validation.
                        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
                        why = f"timed out after {limit:.0f} s" if rc == 124 else f"failed with status {rc}"
                        results[system].failed = f"nbox run {why}: {(tail or ['(no output)'])[0]}"
                        results[system].runs.clear()
                        say(f"[{runs}] repeat {rep + 1} {system}: {results[system].failed}")
                        continue
                    its = json.loads(rec.read_text())["iterations"] if rec.exists() else []
                    results[system].runs.append(_measured(its, warmup, iterations, f"{system} mode"))
                last = (real.runs if system == "real" else results[system].runs)[-1]
                say(f"[{runs}/{repeats * len(systems)}] repeat {rep + 1} {system}: "
                    f"{statistics.median(last) * 1e3:.2f} ms median ({time.perf_counter() - t0:.1f} s)")
    # Every run is cut to the same number of iterations, so each system is judged on the same steps.
    n = min(len(r) for r in real.runs + [r for m in results.values() for r in m.runs])
    for m in [real, *results.values()]:
        m.runs = [r[:n] for r in m.runs]
    mode_list = [results[m] for m in modes]
    spread = compare(real, mode_list, tolerance)
    return Validation(
        topology=str(topology_file), command=list(command), iterations=n, warmup=warmup, repeats=repeats,
        tolerance=tolerance, real=real, modes=mode_list, real_spread=spread, model=effective.emulation.model,
        profile=effective.emulation.profile if effective.emulation.model == "calibrated" else None,
        seconds=time.perf_counter() - t_start, twin_ranks=[r for r, _ in twins],
        against=[str(p) for p in against or ()],
    )


def _run_real(cluster: str, topo, command: Sequence[str], rec: Path, logs: Path, label: str, real_rank: int,
              keep_logs: Path | None, say, where: str) -> list[float]:
    """One run of the real system on ``cluster``; the recorded rank's iteration times."""
    rc, codes = launch_real(cluster, topo, command, rec, log_dir=_sub(logs, label), record_rank=real_rank)
    if rc != 0 and _teardown_abort_only(codes, real_rank, rec):
        # gloo sometimes aborts a rank in destroy_process_group after the last
        # iteration (peer already gone); the record was written before teardown.
        say(f"{where}: a rank aborted at teardown (exit codes {codes}); its iterations were complete")
        rc = 0
    if rc != 0:
        bad = next(i for i, c in enumerate(codes) if c != 0)
        log = logs / label / f"rank{bad}.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        place = f" (logs in {log.parent})" if keep_logs else ""
        raise RunFailed(f"the real system failed (exit status {exit_codes_text(codes)}); rank {bad}: "
                        f"{(tail or ['(no output)'])[0]}{place}")
    return json.loads(rec.read_text())["iterations"] if rec.exists() else []


def _calibrate_here(topo, cluster: str, ops: Sequence, sizes: tuple[int, int] | None, out: Path | None, folder: Path,
                    say, precision: float = 0.02, budget_s: float = 0.15, bucket_precision: float | None = None) -> Path:
    """``nbox calibrate``'s network sweep of ``ops`` on ``cluster``; the profile's path (``out``, else in ``folder``)."""
    from .calibrate import BUCKET_PRECISION, DEFAULT_SIZES, default_sizes, parse_size_range, run_calibration
    from .profile import save_profile

    say(f"calibrating {', '.join(o.value for o in ops)} on this cluster")
    doc = run_calibration(topo, ops, default_sizes(*(sizes or parse_size_range(DEFAULT_SIZES))), cluster=cluster,
                          precision=precision, budget_s=budget_s,
                          bucket_precision=BUCKET_PRECISION if bucket_precision is None else bucket_precision, progress=say)
    path = Path(out if out is not None else folder / "profile.json").resolve()
    save_profile(doc, path)
    say(f"calibrated in {doc['meta']['seconds']:.0f} s: {path}")
    return path


def _profile_here(topology_file: Path, topo, command: Sequence[str], spec: str, mesh: str | None, repeats: int,
                  model: str | None, profile: Path | None, out: Path | None, tmp: Path, logs: Path, twin: bool,
                  say) -> Path:
    """Record the role profile on this machine as the runs will load it; the profile folder (``out``, else in ``tmp``).

    A role's compute depends on what shares the machine with it: here the real system's other
    ranks, and in an emulated run the load twin. So each role is recorded twice: alone
    (``nbox profile``, which also tells the roles and what each sends), then as the emulated
    runs are measured, its rank under the load twin, both replaying the first profile; the
    second recording is the profile.
    """
    from ..emu.role_record import ENV_ROLE_NAME, ENV_ROLE_RECORD
    from ..emu.roles import MANIFEST, merge_runs
    from ..launcher.profiling import record_profile

    say(f"recording the roles ({spec}) alone")
    alone, _ = record_profile(topo, command, spec, tmp / "roles-alone", model, mesh=mesh)
    folder = Path(out if out is not None else tmp / "roles").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    cores = rank_cores(topo.world_size)
    for name in alone.roles.names:
        rank = alone.roles.representative(name)
        twins = twin_ranks(topo.world_size, rank) if twin else []
        runs = []
        for k in range(repeats):
            part = tmp / f"role-{name}-{k}.json"
            env = {ENV_ROLE_RECORD: str(part), ENV_ROLE_NAME: name}
            rc = _run_emulated(topology_file, command, "model", tmp / f"profile-{name}-{k}.json", cores[rank], None,
                               model, profile, logs / f"profile-{name}-{k}.log", twins=twins, rank=rank,
                               role_profile=alone.path, extra_env=env)
            if rc != 0 or not part.exists():
                raise RunFailed(f"recording role {name} (rank {rank}) under the load twin failed (status {rc}); "
                                f"log {logs / f'profile-{name}-{k}.log'}")
            runs.append(json.loads(part.read_text(encoding="utf-8")))
        (folder / f"role-{name}.json").write_text(json.dumps(merge_runs(runs), separators=(",", ":")),
                                                  encoding="utf-8")
        say(f"role {name} (rank {rank}) recorded under the load twin ({repeats} runs)")
    shutil.copy(alone.path / MANIFEST, folder / MANIFEST)
    return folder


def _teardown_abort_only(codes: list[int], recorded: int, record: Path) -> bool:
    """True when ranks died only of SIGABRT after the recorded rank wrote its record at teardown."""
    if any(c not in (0, -6) for c in codes) or not record.exists():
        return False
    return bool(json.loads(record.read_text()).get("iterations"))


def _sub(base: Path, name: str) -> Path:
    d = base / name
    d.mkdir(parents=True, exist_ok=True)
    return d
