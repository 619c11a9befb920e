"""One summary: every number that says "exposed" (table, per-op rows, PNG title, report JSON) is the same one."""

from __future__ import annotations

import pytest

from neuronabox.report.run_summary import calls_text, exposed_headline, next_steps, summarize, summary_tables


def _op(seq: int, it: int, op: str, t0: float, enq: float, dur: float, wait: float) -> dict:
    return {"seq": seq, "iteration": it, "op": op, "comm": "world", "ranks": 8, "nbytes": 4096, "algorithm": "ring",
            "enqueue": t0 + enq, "start": t0 + enq, "end": t0 + enq + dur, "duration": dur, "wait": wait,
            "lateness": 0.0005}


def _record() -> dict:
    """Four 100 ms iterations: two all-reduces each (one waited on in Python, one only DDP-style), a broadcast in one."""
    ops, seq = [], 0
    for i in range(4):
        t0 = i * 0.1
        ops.append(_op(seq, i, "all_reduce", t0, 0.020, 0.030, 0.010))  # waited 10 ms in Python
        ops.append(_op(seq + 1, i, "all_reduce", t0, 0.080, 0.015, 0.0))  # nobody waited: the tail is exposed
        seq += 2
        if i == 2:
            ops.append(_op(seq, i, "broadcast", t0, 0.050, 0.005, 0.002))
            seq += 1
    return {"world_size": 8, "real_rank": 0, "model": "alpha-beta", "iterations": [0.1] * 4, "ops": ops}


def test_per_op_exposed_adds_up_to_the_run_exposed():
    rep = summarize(_record(), warmup=1)
    per_op_total = sum(s["exposed_s"] for s in rep["per_op"].values())
    measured = sum(rep["iterations"][rep["warmup"]:])
    assert per_op_total == pytest.approx(rep["exposed_ratio"] * measured, rel=1e-12)
    # 3 measured iterations x (10 ms waited + 15 ms tail), plus the broadcast's 2 ms wait.
    assert per_op_total == pytest.approx(3 * 0.025 + 0.002)
    assert rep["per_op"]["all_reduce"]["exposed_s"] == pytest.approx(0.075)


def test_calls_per_iteration_only_for_ops_every_iteration_makes():
    rep = summarize(_record(), warmup=1)
    assert rep["per_op"]["all_reduce"]["calls_per_iteration"] == 2
    assert calls_text(rep["per_op"]["all_reduce"]) == "2 per iteration"
    assert rep["per_op"]["broadcast"]["calls_per_iteration"] is None  # a one-off: never "0.333 calls per iteration"
    assert calls_text(rep["per_op"]["broadcast"]) == "1 in total"


def _text(table) -> str:
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def test_table_and_png_title_say_the_same_exposed_number():
    pytest.importorskip("matplotlib")
    from neuronabox.report.plots import suptitle

    rep = summarize(_record(), warmup=1)
    head = exposed_headline(rep)
    assert f"{rep['exposed_ratio']:.1%}" in head
    run_table, ops_table = summary_tables(rep)[:2]
    assert head in _text(run_table) and head in suptitle(rep)
    text = _text(ops_table)
    assert "2 per iteration" in text and "1 in total" in text and "add up" in text
    assert "overshoot" in _text(run_table)  # lateness says what it is


def test_next_steps_names_the_commands_to_try():
    rep = summarize(_record(), warmup=1, meta={"file": "topologies/cpu-8x1g.yaml", "command": ["python", "t.py"]})
    line = next_steps(rep, "out/run.json")
    assert line.startswith("next: nbox report out/run.json --png out/run.png")
    assert "nbox whatif topologies/cpu-8x1g.yaml --sweep" in line and line.endswith("-- python t.py")
    assert "--report run.json" in next_steps(rep)
