"""``nbox run``'s messages and signals as a newcomer meets them: typos, a missing script, a script
that never calls torch.distributed, and Ctrl-C (to the whole process group, or to nbox alone)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, run_nbox, stop_nbox_when

PY = sys.executable

TOPO = """
cluster: {nodes: 8, ranks_per_node: 1}
network: {type: switch, link: {bandwidth: 10Gbps, latency: 10us}}
emulation: {library: gloo}
"""


@pytest.fixture
def topo(tmp_path):
    path = tmp_path / "topo.yaml"
    path.write_text(TOPO)
    return path


def test_a_mistyped_option_gets_clicks_error_with_a_suggestion(topo):
    r = run_nbox("run", str(topo), "--reprot", "r.json", "--", PY, "-c", "print(1)")
    assert r.returncode == 2, r.stdout + r.stderr
    text = " ".join(r.stderr.replace("│", " ").split())
    # click's own wording: "Did you mean --report?" for one close match, "Possible options: ..." for several.
    assert "No such option: --reprot" in text and "--report" in text.split("--reprot", 1)[1], r.stderr
    assert "command not found" not in r.stderr


def test_a_missing_script_says_so_in_one_line(topo, tmp_path):
    r = run_nbox("run", str(topo), "--", PY, "-u", "no_such_train.py", "--steps", "3", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == f"nbox: error: nbox run: no such script: 'no_such_train.py' (from {tmp_path})", r.stderr
    assert r.stdout == ""


def test_report_and_trace_folders_are_made(topo, tmp_path):
    pytest.importorskip("torch", reason="nbox run needs torch")
    report, trace = tmp_path / "new/run.json", tmp_path / "other/deeper/trace.json"
    script = "import torch.distributed as dist; dist.init_process_group(); dist.barrier()"
    r = run_nbox("run", str(topo), "-q", "--report", str(report), "--trace", str(trace), "--", PY, "-c", script)
    assert r.returncode == 0 and report.exists() and trace.exists(), r.stderr
    (tmp_path / "file").write_text("")
    r = run_nbox("run", str(topo), "--report", str(tmp_path / "file/run.json"), "--", PY, "-c", script)
    assert r.returncode == 2 and r.stderr.startswith("nbox: error: --report ") and "cannot make its folder" in r.stderr, r.stderr


def test_python_script_finds_the_script_behind_interpreter_options():
    from neuronabox.launcher.runner import python_script

    assert python_script(["python3", "-u", "-W", "ignore", "t.py", "--x"]) == "t.py"
    assert python_script([PY, "t.py"]) == "t.py"
    assert python_script(["python", "-m", "pkg.train"]) is None
    assert python_script(["python", "-c", "print(1)"]) is None
    assert python_script(["torchrun", "t.py"]) is None


def test_a_script_with_no_distributed_calls_gets_one_warning_line(topo):
    pytest.importorskip("torch", reason="nbox run needs torch")
    r = run_nbox("run", str(topo), "--", PY, "-c", "print('hello')")
    assert r.returncode == 0, r.stderr
    assert "hello" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nbox: warning:") and "no torch.distributed calls" in lines[0], r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("real", [1, 2], ids=["one-real-rank", "two-real-ranks"])
@pytest.mark.parametrize("to_group", [True, False], ids=["ctrl-c", "nbox-alone"])
def test_sigint_interrupts_the_script_prints_the_summary_and_exits_130(topo, tmp_path, to_group, real):
    """DDP's all-reduces start in C++: a KeyboardInterrupt there used to end in a torch traceback.

    With two real ranks torch's elastic agent stands between nbox and the workers."""
    pytest.importorskip("torch", reason="nbox run needs torch")
    report = tmp_path / "r.json"
    # Two real ranks need a node with two ranks: the demo's 16 nodes x 4.
    launch = ["--nproc-per-node", str(real)] if real > 1 else []
    where = ROOT / "topologies/cpu-64-demo.yaml" if real > 1 else topo
    rc, out, err, took = stop_nbox_when(
        ["run", str(where), *launch, "--report", str(report), "--", PY, str(ROOT / "examples/ddp_train.py"),
         "--steps", "100000"], "step  10", after_s=0.0, sig=signal.SIGINT, to_group=to_group)
    assert rc == 130, out + err
    assert "iteration time" in out and report.exists(), out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # torch's elastic agent logs its own lines as it stops the workers ("W1203 14:54:25.326000 ... closing signal").
    ours = [line for line in err.strip().splitlines() if not re.match(r"[IWE]\d{4} ", line)]
    assert len(ours) == 1 and ours[0].startswith("nbox: stopped by SIGINT"), err
    assert took < 8, took  # not a 10 s wait and a SIGKILL


@pytest.mark.slow
def test_ctrl_c_typed_at_a_terminal(topo, tmp_path):
    """The real thing: nbox in the foreground of a pseudo-terminal, ^C written to it; the kernel
    sends SIGINT to the whole foreground process group (nbox and the script)."""
    pytest.importorskip("torch", reason="nbox run needs torch")
    import fcntl
    import pty
    import select
    import termios

    master, slave = pty.openpty()

    def controlling_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    report = tmp_path / "r.json"
    p = subprocess.Popen([PY, "-m", "neuronabox.cli", "run", str(topo), "--report", str(report), "--", PY,
                          str(ROOT / "examples/ddp_train.py"), "--steps", "100000"],
                         stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env={**os.environ, "COLUMNS": "200"},
                         preexec_fn=controlling_terminal)
    os.close(slave)
    text, sent = b"", None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every process holding the terminal has ended
                    break
                if not chunk:
                    break
                text += chunk
            if sent is None and b"step  10" in text:
                os.write(master, b"\x03")  # ^C, as typed
                sent = time.monotonic()
        rc = p.wait(60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        os.close(master)
    out = text.decode(errors="replace")
    assert sent is not None, out
    assert rc == 130, out
    assert "iteration time" in out and "nbox: stopped by SIGINT" in out and report.exists(), out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
