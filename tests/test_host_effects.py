"""Host effects are one family: the registry builds a run's effects, the timeline asks each one's hooks."""

from __future__ import annotations

import pytest

from neuronabox.collectives import Op
from neuronabox.emu.emulator import Emulator
from neuronabox.emu.host_effects import EFFECTS, HostEffect
from neuronabox.emu.host_effects.compute_skew import CallerArrival, ComputeSkew
from neuronabox.emu.host_effects.footprint import Footprint
from neuronabox.emu.host_effects.host_coupling import HostCoupling
from neuronabox.emu.host_effects.spin_stall import SpinStall
from neuronabox.emu.timeline import Recorder, Timeline
from neuronabox.model.base import CommModel, Estimate, Group
from neuronabox.report.run_summary import summarize, summary_tables
from neuronabox.topology import parse_topology

PROFILE = {
    "busy_progress": {"rate": 0.5},
    "cpu_cost": {"per_op_s": 1e-4, "per_byte_s": 1e-9},
    "spin_stall": {"ranks": 2, "cells": [{"size": 4, "gap_s": 0.02, "samples": [[0.003, 0.003, 0.0]]}]},
}


def _topo(extra: str = "", library: str = "gloo"):
    return parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 1Gbps, latency: 10us}}\n"
                          f"emulation: {{library: {library}}}\n{extra}")


class Const(CommModel):
    name = "const"

    def __init__(self, topology, profile=None):
        super().__init__(topology)
        if profile is not None:
            self.profile = profile

    def estimate(self, op, nbytes, group, root=0):
        return Estimate(0.001, "const")


def _kinds(emu: Emulator) -> list[type]:
    return [type(e) for e in emu.effects]


@pytest.mark.parametrize("library, profile, extra, expect", [
    ("gloo", None, "", []),  # nothing calibrated, no what-if: an idle host
    ("gloo", PROFILE, "", [SpinStall, HostCoupling, Footprint]),  # a calibrated CPU library
    ("nccl", PROFILE, "", []),  # a GPU library does not share the host's core
    ("nccl", None, "whatif: {stragglers: {1: 2.0}}\n", [ComputeSkew]),
    ("nccl", None, "emulation: {library: nccl, peer_noise: true}\n", [ComputeSkew]),
])
def test_the_registry_builds_the_effects_the_run_has(library, profile, extra, expect, monkeypatch):
    monkeypatch.delenv("NBOX_FOOTPRINT", raising=False)
    if extra.startswith("emulation"):
        topo = parse_topology("cluster: {nodes: 2}\nnetwork: {link: {bandwidth: 1Gbps, latency: 10us}}\n" + extra)
    else:
        topo = _topo(extra, library)
    emu = Emulator(topo, 0, Const(topo, profile))
    try:
        assert _kinds(emu) == expect
        assert all(e.describe() for e in emu.effects)
        # Each communicator gets its own part: a fresh accounting, a view, or the effect itself.
        tl = emu.new_timeline(Group((0, 1)))
        assert [type(e) for e in tl.effects] == expect
        if HostCoupling in expect:
            assert tl.effect(HostCoupling) is not emu.effect(HostCoupling)
        if Footprint in expect:
            assert tl.effect(Footprint) is emu.effect(Footprint)
    finally:
        for e in emu.effects:
            e.stop()


def test_a_callers_own_straggler_hook_replaces_the_skew_and_nbox_footprint_0_turns_the_footprint_off(monkeypatch):
    monkeypatch.setenv("NBOX_FOOTPRINT", "0")
    topo = _topo("whatif: {stragglers: {1: 2.0}}\n")
    emu = Emulator(topo, 0, Const(topo, PROFILE), straggler=lambda op, nbytes, group: 0.5)
    assert _kinds(emu) == [CallerArrival, SpinStall, HostCoupling]
    r = emu.new_timeline(Group((0, 1))).schedule(Op.ALL_REDUCE, 4)
    assert r.extra == 0.5


def test_every_registered_effect_is_a_host_effect_with_a_builder_and_a_name():
    assert len(set(EFFECTS)) == len(EFFECTS)
    for cls in EFFECTS:
        assert issubclass(cls, HostEffect) and cls.build is not HostEffect.build and cls.name != HostEffect.name


class LateStart(HostEffect):
    """A new mechanism, as a test would add one: every op's bytes move 2 ms late; it counts what it saw."""

    name = "late start"

    def __init__(self):
        self.queued = []

    def on_start(self, r, gap):
        r.start += 0.002

    def on_queued(self, r, beside):
        self.queued.append(r.seq)


def test_a_new_effect_is_one_class_whose_hooks_the_timeline_asks():
    topo = _topo()
    tl = Timeline("c", Group((0, 1)), Const(topo), Recorder())
    late = LateStart()
    tl.attach(late)
    r = tl.schedule(Op.ALL_REDUCE, 4, ready=10.0)
    assert r.start == pytest.approx(10.002) and r.end == pytest.approx(10.003)
    assert late.queued == [r.seq] and r.holds == ()  # it holds nothing: completion is the modeled end
    # hooks it does not override are never asked (the hot path calls only the overridden ones)
    assert tl._arrivals == () and tl._admit is None and tl._settlers == ()


def test_two_effects_cannot_both_take_over_an_ops_end():
    tl = Timeline("c", Group((0, 1)), Const(_topo()), Recorder())
    tl.attach(HostCoupling(0.5))
    with pytest.raises(ValueError, match="two host effects"):
        tl.attach(HostCoupling(0.5))


def test_the_run_summary_names_the_effects_of_the_run():
    record = {"world_size": 2, "real_rank": 0, "model": "const", "iterations": [0.01, 0.01, 0.01], "ops": [],
              "host_effects": ["host coupling: an op progresses at 0.50 of its rate while the host computes"]}
    report = summarize(record)
    assert report["host_effects"] == record["host_effects"]
    cells = [c for col in summary_tables(report)[0].columns for c in col._cells]
    assert "host effects" in cells and record["host_effects"][0] in cells
    assert "host_effects" not in summarize({**record, "host_effects": []})  # a run without any: as before
