"""Roles: the spec, the profile files and their checks, the replay of other roles' programs against the real rank."""

import json

import pytest

from neuronabox.collectives import Op
from neuronabox.emu.group_table import GroupTable
from neuronabox.emu.replay import Replay
from neuronabox.emu.roles import (
    FORMAT,
    ProfileMeta,
    RoleProgram,
    check_profile,
    command_digest,
    parse_roles,
    read_profile,
)
from neuronabox.emu.timeline import OpRecord
from neuronabox.errors import InputError
from neuronabox.model.base import CommModel, Estimate

# --- the spec ------------------------------------------------------------------------------------------


def test_rank_sets_make_roles_and_replicas():
    roles = parse_roles("0-3,4-7", 8)
    assert roles.names == ("r0", "r4")
    assert roles.role_of(6) == "r4"
    assert roles.representative("r4") == 4
    # rank 6 is replica 2 of its role: as the real rank, its replica's other role is rank 2
    assert roles.actors(6) == {2: "r0"}
    assert roles.proxy(5, real=2) == 6  # rank 5 runs as the rank of its role in the real rank's replica


def test_strided_sets_and_mesh_dimensions():
    assert parse_roles("0-7:2,1-7:2", 8).sets == ((0, 2, 4, 6), (1, 3, 5, 7))
    roles = parse_roles("pp", 8, "pp=2,dp=4")
    assert roles.names == ("pp0", "pp1")
    assert roles.sets == ((0, 1, 2, 3), (4, 5, 6, 7))
    inner = parse_roles("pp", 8, "dp=4,pp=2")
    assert inner.sets == ((0, 2, 4, 6), (1, 3, 5, 7))
    both = parse_roles("pp,ep", 8, "pp=2,ep=2,dp=2")
    assert both.names == ("pp0_ep0", "pp0_ep1", "pp1_ep0", "pp1_ep1")


@pytest.mark.parametrize(
    "spec, mesh, says",
    [
        ("0,1,2,4", None, "rank 4 in '4' is outside the world of 4 ranks"),
        ("0-1,1", None, "rank 1 is in two roles"),
        ("0", None, "ranks 1, 2, 3 have no role"),
        ("0-2,3", None, "the sets differ in size"),
        ("pp", None, "give the mesh too"),
        ("tp", "pp=4", "'tp' is not a dimension"),
        ("pp", "pp=3", "holds 3 ranks but the world has 4"),
        ("0,x-1", None, "'x-1' is not a rank"),
        ("", None, "--roles: empty"),
    ],
)
def test_bad_role_specs_say_what_is_wrong(spec, mesh, says):
    with pytest.raises(InputError, match=None) as err:
        parse_roles(spec, 4, mesh)
    assert says in str(err.value)
    assert "\n" not in str(err.value)


# --- profile files ---------------------------------------------------------------------------------------

PIPE = [
    ["op", 0.001, 0, "send_recv", 4096, 0, 0],
    ["wait", 0.0, 0],
    ["op", 0.010, 0, "send_recv", 4096, 0, 1],
    ["wait", 0.0, 2],
    ["mark", 0.001],
]


def _write_profile(folder, command, *, world=2, events=PIPE, torch="2.13.0", manifest=True):
    folder.mkdir(parents=True, exist_ok=True)
    for name, rank in (("r0", 0), ("r1", 1)):
        role = {"format": FORMAT, "role": name, "rank": rank, "groups": [world], "iterations": 1, "events": events}
        (folder / f"role-{name}.json").write_text(json.dumps(role))
    if manifest:
        (folder / "profile.json").write_text(json.dumps({
            "format": FORMAT, "topology": "t", "world_size": world, "device": "cpu", "command": command,
            "digest": command_digest(command), "torch": torch,
            "roles": {"spec": "0,1", "roles": {"r0": [0], "r1": [1]}},
        }))
    return folder


RUN = dict(topology="t", world_size=2, device="cpu", torch_version="2.13.0")


def test_a_profile_is_read_and_checked(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    cmd = ["python", str(script)]
    meta = read_profile(_write_profile(tmp_path / "p", cmd))
    check_profile(meta, command=cmd, **RUN)
    assert meta.programs["r1"].events[2][3] == "send_recv"


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(topology="other"), "recorded for topology 't', this run has 'other'"),
        (dict(world_size=4), "recorded for world size 2, this run has 4"),
        (dict(torch_version="2.14.1"), "recorded for torch '2.13.0', this run has '2.14.1'"),
        (dict(device="h100"), "recorded for device 'cpu'"),
    ],
)
def test_a_profile_of_another_run_is_refused(tmp_path, change, says):
    cmd = ["python", "x.py"]
    meta = read_profile(_write_profile(tmp_path / "p", cmd))
    with pytest.raises(InputError) as err:
        check_profile(meta, command=cmd, **{**RUN, **change})
    assert says in str(err.value) and "profile.json" in str(err.value)


def test_a_changed_script_is_another_program(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    cmd = ["python", str(script)]
    meta = read_profile(_write_profile(tmp_path / "p", cmd))
    script.write_text("print(2)\n")
    with pytest.raises(InputError, match="recorded for another command or script"):
        check_profile(meta, command=cmd, **RUN)


def test_partial_and_corrupt_profiles_are_refused(tmp_path):
    part = _write_profile(tmp_path / "part", ["x"], manifest=False)
    with pytest.raises(InputError, match="did not finish"):
        read_profile(part)
    bad = _write_profile(tmp_path / "bad", ["x"])
    (bad / "role-r1.json").write_text("{not json")
    with pytest.raises(InputError, match=r"role-r1.json: not a role profile \(JSONDecodeError"):
        read_profile(bad)
    waits = _write_profile(tmp_path / "waits", ["x"], events=[["wait", 0.0, 3]])
    with pytest.raises(InputError, match=r"events\[0\] waits on entry 3"):
        read_profile(waits)
    with pytest.raises(InputError, match="is not a folder"):
        read_profile(tmp_path / "missing")


# --- replay ----------------------------------------------------------------------------------------------


class Fixed(CommModel):
    """Every op takes ``d`` seconds."""

    name = "fixed"

    def __init__(self, d):
        self.d = d

    def estimate(self, op, nbytes, group, root=0):
        return Estimate(self.d, "fixed")


def _replay(programs: dict, sets, real, groups, d=0.001, origin=100.0):
    from neuronabox.emu.roles import Roles

    names = tuple(programs)
    roles = Roles(names, tuple(sets), "test")
    progs = {n: RoleProgram(n, roles.representative(n), (), tuple(tuple(e) for e in ev), 1)
             for n, ev in programs.items()}
    meta = ProfileMeta(None, "t", len(groups[0]), "cpu", (), "", "", roles, progs)
    table = GroupTable()
    table.start_world(len(groups[0]))
    for g in groups[1:]:
        table.add(g)
    rp = Replay(meta, real, table, Fixed(d))
    rp.start(origin)
    return rp


def _rec(op, t, nbytes=4096, d=0.001, group=(0, 1)):
    from neuronabox.model.base import Group

    r = OpRecord(0, "c", op, Group(group), nbytes, 0, "fixed", 0, t, d, 0.0)
    r.ready = t
    return r


def test_a_receive_waits_for_the_emulated_stage_s_recorded_compute():
    # stage 1 (replayed) receives from stage 0, computes 10 ms, sends back
    rp = _replay({"r0": [], "r1": PIPE}, [(0,), (1,)], real=0, groups=[(0, 1)])
    send = _rec(Op.SEND_RECV, 100.002)
    inst = rp.real_op(0, Op.SEND_RECV, send, peer=1, send=True)
    assert inst.start == pytest.approx(100.002)  # stage 1 posted its receive at 100.001
    assert send.end == pytest.approx(100.003)
    recv = _rec(Op.SEND_RECV, 100.004)
    inst2 = rp.real_op(0, Op.SEND_RECV, recv, peer=1, send=False)
    # stage 1 sends after its receive ended (100.003) and 10 ms of compute
    assert inst2.start == pytest.approx(100.013)
    assert recv.end == pytest.approx(100.014)
    assert rp.actors[1].marks == [pytest.approx(100.015)]
    assert not rp.instances and not rp.actors[1].ops  # a long run keeps only what is still open


def test_an_op_waiting_for_a_later_call_resolves_then():
    # the real stage posts its receive first; stage 1 sends only after receiving from it
    rp = _replay({"r0": [], "r1": PIPE}, [(0,), (1,)], real=0, groups=[(0, 1)])
    recv = _rec(Op.SEND_RECV, 100.0)
    pending = rp.real_op(0, Op.SEND_RECV, recv, peer=1, send=False)
    assert pending.end is None and not rp.settle(pending, force=False)
    seen = []
    rp.when_resolved(pending, seen.append)
    send = _rec(Op.SEND_RECV, 100.005)
    rp.real_op(0, Op.SEND_RECV, send, peer=1, send=True)
    assert send.end == pytest.approx(100.006)
    assert recv.end == pytest.approx(100.006 + 0.010 + 0.001)
    assert seen == [recv.end]


def test_a_wait_the_program_never_answers_resolves_with_a_warning(capsys):
    rp = _replay({"r0": [], "r1": [["mark", 0.0]]}, [(0,), (1,)], real=0, groups=[(0, 1)])
    recv = _rec(Op.SEND_RECV, 100.0)
    inst = rp.real_op(0, Op.SEND_RECV, recv, peer=1, send=False)
    assert rp.settle(inst, force=True)
    assert recv.end == pytest.approx(100.001)
    assert "reached the end of its recorded program" in capsys.readouterr().err


def test_a_collective_starts_when_the_last_role_arrives_and_clones_follow_the_real_rank():
    # roles {0,1} and {2,3}: the real rank 0's replica holds rank 2 (replayed); 1 and 3 are proxies
    slow = [["op", 0.020, 0, "all_reduce", 1024, -1, 0], ["wait", 0.0, 0], ["mark", 0.0]]
    rp = _replay({"r0": [], "r2": slow}, [(0, 1), (2, 3)], real=0, groups=[(0, 1, 2, 3)])
    assert set(rp.actors) == {2}
    rec = _rec(Op.ALL_REDUCE, 100.001, group=(0, 1, 2, 3))
    inst = rp.real_op(0, Op.ALL_REDUCE, rec)
    assert inst.participants == frozenset({0, 2})
    assert rec.start == pytest.approx(100.020) and rec.end == pytest.approx(100.021)
    assert rp.actors[2].waited[0] == pytest.approx(0.001)


def test_a_replica_s_actor_uses_its_own_groups():
    # DP x PP, pp outermost: stages {0,1} and {2,3}; pp groups {0,2}, {1,3}; dp groups {0,1}, {2,3}.
    # Stage 1 was recorded on rank 2, whose 2nd group is {0,2}; replayed for real rank 1 it is rank 3,
    # whose 2nd group is {1,3}.
    stage1 = [["op", 0.0, 1, "send_recv", 64, 0, 0], ["wait", 0.0, 0], ["mark", 0.0]]
    rp = _replay({"r0": [], "r2": stage1}, [(0, 1), (2, 3)], real=1,
                 groups=[(0, 1, 2, 3), (0, 2), (1, 3), (0, 1), (2, 3)])
    assert set(rp.actors) == {3}
    send = _rec(Op.SEND_RECV, 100.0, group=(1, 3))
    inst = rp.real_op(2, Op.SEND_RECV, send, peer=3, send=True)
    assert inst.key == ("p", 2, 1, 3, 0)
    assert send.end == pytest.approx(100.001)


def test_a_mesh_profile_grows_its_data_parallel_dimension_with_the_world(tmp_path):
    from neuronabox.emu.roles import Roles, roles_for_world

    mesh = parse_roles("pp", 4, "pp=2,dp=2")
    meta = ProfileMeta(tmp_path, "t", 4, "cpu", (), "", "", mesh, {})
    grown = roles_for_world(meta, 8)
    assert grown.sets == ((0, 1, 2, 3), (4, 5, 6, 7)) and grown.names == ("pp0", "pp1")
    with pytest.raises(InputError, match="recorded for world size 4, this run has 7; its mesh pp=2,dp=2 has no"):
        roles_for_world(meta, 7)
    sets = ProfileMeta(tmp_path, "t", 2, "cpu", (), "", "", Roles(("r0", "r1"), ((0,), (1,)), "0,1"), {})
    with pytest.raises(InputError, match="only roles over mesh dimensions"):
        roles_for_world(sets, 4)


def test_a_straggler_of_another_role_runs_its_program_slower():
    slow = [["op", 0.010, 0, "send_recv", 64, 0, 0], ["wait", 0.0, 0], ["mark", 0.0]]
    rp = _replay({"r0": [], "r1": slow}, [(0,), (1,)], real=0, groups=[(0, 1)])
    fast = rp.real_op(0, Op.SEND_RECV, _rec(Op.SEND_RECV, 100.0), peer=1, send=True)
    assert fast.start == pytest.approx(100.010)
    from neuronabox.emu.roles import Roles

    meta = ProfileMeta(None, "t", 2, "cpu", (), "", "", Roles(("r0", "r1"), ((0,), (1,)), "t"),
                       {"r1": RoleProgram("r1", 1, (), tuple(tuple(e) for e in slow), 1)})
    table = GroupTable()
    table.start_world(2)
    rp = Replay(meta, 0, table, Fixed(0.001), stragglers={1: 2.0})
    rp.start(100.0)
    late = rp.real_op(0, Op.SEND_RECV, _rec(Op.SEND_RECV, 100.0), peer=1, send=True)
    assert late.start == pytest.approx(100.020)


def test_a_future_on_an_op_no_later_call_resolves_completes_after_a_while():
    # DDP waits on its futures from C++: no Python call of the real rank comes to resolve a pending
    # op there, so after FORCE_AFTER_S without a call it is taken to have its ranks there.
    import time
    from types import SimpleNamespace

    pytest.importorskip("torch")
    from neuronabox.emu import backend
    from neuronabox.emu.timeline import Waker, clock

    rp = _replay({"r0": [], "r1": PIPE}, [(0,), (1,)], real=0, groups=[(0, 1)], origin=clock())
    recv = _rec(Op.SEND_RECV, clock())
    inst = rp.real_op(0, Op.SEND_RECV, recv, peer=1, send=False)
    assert inst.end is None  # stage 1 first waits for a send the real rank never makes
    waker = Waker()
    try:
        work = backend.ReplayedWork(recv, [], SimpleNamespace(replay=rp, waker=waker), inst)
        fut = work.get_future()
        t0 = time.monotonic()
        while not fut.done() and time.monotonic() - t0 < backend.FORCE_AFTER_S + 3:
            time.sleep(0.05)
        assert fut.done() and inst.forced
        assert time.monotonic() - t0 >= backend.FORCE_AFTER_S - 0.1
    finally:
        waker.stop()
