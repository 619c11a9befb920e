"""What the Prometheus exporter costs the real rank (issue 6 goal: at most 1% iteration time).

1. In one long run with the exporter on, this script alternates one-second windows in which
   it scrapes the exporter ten times a second (fifty times the compose default) with windows
   in which nothing scrapes; each iteration is put in the window it ran in (the real rank
   prints its iteration marks on the shared monotonic clock). Adjacent windows are paired, so
   the machine's drifting load cancels. The exporter does nothing between scrapes (its HTTP
   thread sleeps in select), so this isolates everything it costs while the run goes on.
2. Interleaved, repeated `nbox run` of the MLP workload (benchmarks/workloads/train_loop.py
   --arch mlp, DDP, 64 ranks, `ideal` model so that the iteration is compute plus emulator only: the most
   sensitive case), with the exporter off and on; when on, this script scrapes it like a
   Prometheus server would, every --scrape-interval seconds (default 1 s, five times the
   compose default). Reported: the median over runs of each run's median iteration time, the
   median of the paired on/off ratios, and the off runs' own spread (the noise floor).
3. The collector's CPU cost per scrape, in process: a fixed part (process gauges, text
   encoding) plus a part per collective recorded since the last scrape. With the workload's
   op rate this bounds the exporter's share of one core independently of machine noise:
   the scrape runs on its own thread, and the training thread can lose at most that much
   time to it (the GIL).

Run: `.venv/bin/python benchmarks/exporter_overhead.py` (about 3 minutes); writes
benchmarks/results/exporter_overhead.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "benchmarks" / "workloads" / "train_loop.py"
sys.path.insert(0, str(ROOT))

# The exporter starts from the environment in the real rank; until `nbox run`'s autostart calls
# start_from_env itself, this wrapper does (afterwards the call is a no-op). Both variants run
# the same wrapper, so start-up is alike.
WRAPPER = """
import json, runpy, sys
import neuronabox.metrics
from neuronabox.emu import emulator
neuronabox.metrics.start_from_env()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
# Iteration ends on the host's CLOCK_MONOTONIC (time.perf_counter), which the parent shares.
print("MARKS " + json.dumps(emulator._current.recorder.iteration_marks), flush=True)
"""


def _grab(stdout: str, tag: str):
    for line in stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise RuntimeError(f"no {tag} line in output:\n{stdout[-2000:]}")


class Scraper(threading.Thread):
    """Scrapes the exporter whose address appears in ``addr_file`` every ``interval`` s until stopped."""

    def __init__(self, addr_file: Path, interval: float):
        super().__init__(daemon=True)
        self.addr_file, self.interval = addr_file, interval
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.last_body = ""

    def run(self) -> None:
        while not self.stop.is_set() and not self.addr_file.exists():
            time.sleep(0.02)
        if self.stop.is_set():
            return
        url = f"http://{self.addr_file.read_text().strip()}/metrics"
        while not self.stop.wait(self.interval):
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    self.last_body = r.read().decode()
            except OSError:
                return  # the run ended
            self.latencies.append(time.perf_counter() - t)


def one_run(tmp: Path, exporter: bool, args) -> dict:
    """One `nbox run` of the workload; returns its median iteration time and, with the exporter, the scrapes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_")}
    env["OMP_NUM_THREADS"] = "1"
    addr_file = tmp / f"addr-{time.monotonic_ns()}"
    scraper = None
    if exporter:
        env["NBOX_METRICS_ADDR"] = "127.0.0.1:0"
        env["NBOX_METRICS_FILE"] = str(addr_file)
        scraper = Scraper(addr_file, args.scrape_interval)
        scraper.start()
    wrapper = tmp / "wrapper.py"
    cmd = [sys.executable, "-m", "neuronabox.cli", "run", "topologies/cpu-64-demo.yaml", "--model", "ideal", "-q", "--",
           sys.executable, str(wrapper), str(WORKLOAD), "--arch", "mlp", "--mode", "ddp", "--iters", str(args.iters), "--warmup", "5",
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=True).stdout
    finally:
        if scraper is not None:
            scraper.stop.set()
            scraper.join(timeout=10)
    times = _grab(out, "ITER_TIMES")
    res = {"median_s": statistics.median(times)}
    if scraper is not None:
        if not scraper.latencies:
            raise RuntimeError("the exporter was never scraped: did the real rank start it?")
        fed = [ln for ln in scraper.last_body.splitlines() if ln.startswith("nbox_iteration_duration_seconds_count")]
        res.update(scrapes=len(scraper.latencies), scrape_p50_s=statistics.median(scraper.latencies),
                   iterations_seen=float(fed[0].split()[-1]) if fed else 0.0)
    return res


def interleaved(args) -> dict:
    """Exporter off and on, alternating which goes first, ``args.repeats`` pairs."""
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="nbox-exp-bench-") as tmp:
        (Path(tmp) / "wrapper.py").write_text(WRAPPER)
        for r in range(args.repeats):
            for variant in (("off", "on") if r % 2 == 0 else ("on", "off")):
                runs[variant].append(one_run(Path(tmp), variant == "on", args))
            print(f"  pair {r + 1}/{args.repeats}: off {runs['off'][-1]['median_s'] * 1e3:.3f} ms, "
                  f"on {runs['on'][-1]['median_s'] * 1e3:.3f} ms", flush=True)
    off = [x["median_s"] for x in runs["off"]]
    on = [x["median_s"] for x in runs["on"]]
    ratios = [b / a for a, b in zip(off, on)]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return {
        "median_iteration_s": {"off": statistics.median(off), "on": statistics.median(on)},
        "overhead_ratio_of_medians": statistics.median(on) / statistics.median(off) - 1,
        "overhead_median_paired": statistics.median(ratios) - 1,
        "overhead_paired_ci95": [boots[50] - 1, boots[1949] - 1],
        "noise_off_runs": {"min_s": min(off), "max_s": max(off), "spread": max(off) / min(off) - 1},
        "scrapes_per_run": statistics.median(x["scrapes"] for x in runs["on"]),
        "scrape_latency_p50_s": statistics.median(x["scrape_p50_s"] for x in runs["on"]),
        "iterations_seen_by_last_scrape": min(x["iterations_seen"] for x in runs["on"]),
        "runs": runs,
    }


def windowed(args) -> dict:
    """One long run, scraped hard in every other window; per-window median iteration times, paired."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBOX_")}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="nbox-exp-win-") as tmp:
        tmp = Path(tmp)
        (tmp / "wrapper.py").write_text(WRAPPER)
        addr_file = tmp / "addr"
        env.update(NBOX_METRICS_ADDR="127.0.0.1:0", NBOX_METRICS_FILE=str(addr_file))
        cmd = [sys.executable, "-m", "neuronabox.cli", "run", "topologies/cpu-64-demo.yaml", "--model", "ideal", "-q", "--",
               sys.executable, str(tmp / "wrapper.py"), str(WORKLOAD), "--arch", "mlp", "--mode", "ddp",
               "--iters", str(args.window_iters), "--warmup", "5", "--width", str(args.width), "--depth", str(args.depth),
               "--batch", str(args.batch)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        windows: list[tuple[float, float, bool]] = []
        scrapes = 0
        out_box: list[str] = []
        reader = threading.Thread(target=lambda: out_box.append(proc.communicate()[0]), daemon=True)
        reader.start()
        while not addr_file.exists() and proc.poll() is None:
            time.sleep(0.02)
        url = f"http://{addr_file.read_text().strip()}/metrics"
        time.sleep(2.0)  # past start-up and DDP's first iterations
        on = False
        while proc.poll() is None:
            start = time.perf_counter()
            end = start + args.window
            while time.perf_counter() < end and proc.poll() is None:
                if on:
                    try:
                        with urllib.request.urlopen(url, timeout=5) as r:
                            r.read()
                        scrapes += 1
                    except OSError:
                        break
                    time.sleep(max(0.0, args.hard_interval - 0.001))
                else:
                    time.sleep(0.02)
            windows.append((start, time.perf_counter(), on))
            on = not on
        reader.join(timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"the windowed run failed ({proc.returncode})")
    marks = _grab(out_box[0], "MARKS")
    per_window: list[tuple[bool, float]] = []
    for a, b, is_on in windows:
        its = [y - x for x, y in zip(marks, marks[1:]) if a <= x and y <= b]
        if len(its) >= 20:
            per_window.append((is_on, statistics.median(its)))
    ratios = []
    for (on1, m1), (on2, m2) in zip(per_window, per_window[1:]):
        if on1 != on2:  # an adjacent off/on pair, in either order
            ratios.append((m2 / m1) if on2 else (m1 / m2))
    rng = random.Random(1)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    # Scraping is the exporter's only work while a run goes on, so its cost scales with the scrape
    # rate: extrapolate the stress rate down to the rates people configure.
    per_scrape = (statistics.median(ratios) - 1) * args.hard_interval
    on_med = [m for o, m in per_window if o]
    off_med = [m for o, m in per_window if not o]
    return {
        "windows": len(per_window),
        "scrapes": scrapes,
        "scrape_interval_s": args.hard_interval,
        "median_iteration_s": {"off": statistics.median(off_med), "on": statistics.median(on_med)},
        "overhead_median_paired": statistics.median(ratios) - 1,
        "overhead_paired_ci95": [boots[50] - 1, boots[1949] - 1],
        "overhead_at_1s_scrapes": per_scrape / 1.0,
        "overhead_at_5s_scrapes": per_scrape / 5.0,
        "window_medians": per_window,
    }


def collector_cost(op_counts=(0, 100, 1000, 10000), repeats: int = 7) -> dict:
    """CPU seconds of one scrape (collect + text encoding) after N new collectives, in this process."""
    from prometheus_client import CollectorRegistry, generate_latest

    from neuronabox.collectives import Op
    from neuronabox.emu.timeline import OpRecord, Recorder
    from neuronabox.metrics.exporter import RunCollector
    from neuronabox.model.base import Group

    group = Group(range(64))
    out = {}
    for n in op_counts:
        samples = []
        for _ in range(repeats):
            rec = Recorder()
            emu = type("E", (), {"recorder": rec, "world_size": 64, "real_rank": 0, "topology": None,
                                 "model": type("M", (), {"name": "ideal"})()})()
            col = RunCollector(cluster="bench", run="bench", emulator_source=lambda: emu, gpu=False)
            reg = CollectorRegistry(auto_describe=False)
            reg.register(col)
            generate_latest(reg)  # attach and warm up
            now = time.perf_counter()
            for i in range(n):
                r = OpRecord(i, "comm0", Op.ALL_REDUCE if i % 5 else Op.ALL_GATHER, group, 4 << 20, 0, "ring",
                             rec.iteration, now, 1e-3, 0.0)
                r.ready, r.start, r.end = now, now, now + 1e-3
                rec.add(r)
                if i % 5 == 4:
                    rec.mark_iteration()
            t = time.thread_time()
            generate_latest(reg)
            samples.append(time.thread_time() - t)
        out[str(n)] = statistics.median(samples)
    per_op = (out[str(op_counts[-1])] - out[str(op_counts[0])]) / op_counts[-1]
    return {"scrape_cpu_s_by_new_ops": out, "fixed_s": out[str(op_counts[0])], "per_op_s": per_op}


def main() -> None:
    """Measure, print, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--scrape-interval", type=float, default=1.0)
    ap.add_argument("--window-iters", type=int, default=4000, help="iterations of the windowed run")
    ap.add_argument("--window", type=float, default=1.0, help="seconds per window of the windowed run")
    ap.add_argument("--hard-interval", type=float, default=0.1, help="scrape interval in the scraped windows")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/exporter_overhead.json"))
    args = ap.parse_args()
    cost = collector_cost()
    print(f"collector: {cost['fixed_s'] * 1e6:.0f} us CPU per scrape + {cost['per_op_s'] * 1e6:.2f} us per new collective")
    print(f"one run, MLP {args.width}x{args.depth} DDP, 64 ranks, ideal model, {args.window:g} s windows, scraped every "
          f"{args.hard_interval:g} s in every other window:")
    w = windowed(args)
    print(f"  {w['windows']} windows, {w['scrapes']} scrapes; iteration time (median of window medians): "
          f"idle {w['median_iteration_s']['off'] * 1e3:.3f} ms, scraped {w['median_iteration_s']['on'] * 1e3:.3f} ms")
    print(f"  overhead while scraped: {w['overhead_median_paired']:+.2%} (median of adjacent-window ratios; 95% CI "
          f"{w['overhead_paired_ci95'][0]:+.2%} .. {w['overhead_paired_ci95'][1]:+.2%}); scaled to one scrape per "
          f"1 s: {w['overhead_at_1s_scrapes']:+.3%}, per 5 s: {w['overhead_at_5s_scrapes']:+.3%}")
    print(f"nbox run, MLP {args.width}x{args.depth} DDP, 64 ranks, ideal model, {args.iters} iterations, "
          f"{args.repeats} interleaved pairs, scraped every {args.scrape_interval:g} s when on:")
    o = interleaved(args)
    med = o["median_iteration_s"]
    ops_per_iteration = None
    with tempfile.TemporaryDirectory() as tmp:  # the workload's op rate, for the bound
        rep = Path(tmp) / "r.json"
        subprocess.run([sys.executable, "-m", "neuronabox.cli", "run", "topologies/cpu-64-demo.yaml", "--model", "ideal",
                        "-q", "--report", str(rep), "--", sys.executable, str(WORKLOAD), "--arch", "mlp", "--mode", "ddp", "--iters", "20",
                        "--warmup", "0", "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)],
                       capture_output=True, text=True, cwd=ROOT, check=True)
        doc = json.loads(rep.read_text())
        ops_per_iteration = len([x for x in doc["ops"] if x["iteration"] >= 1]) / max(1, len(doc["iterations"]) - 1)
    ops_per_s = ops_per_iteration / med["off"]
    bound = (cost["fixed_s"] + cost["per_op_s"] * ops_per_s * args.scrape_interval) / args.scrape_interval
    bound_5s = (cost["fixed_s"] + cost["per_op_s"] * ops_per_s * 5.0) / 5.0
    o["ops_per_iteration"] = ops_per_iteration
    o["cpu_share_bound"] = {f"scrape every {args.scrape_interval:g} s": bound, "scrape every 5 s": bound_5s}
    print(f"  iteration time, median of run medians: off {med['off'] * 1e3:.3f} ms, on {med['on'] * 1e3:.3f} ms")
    print(f"  overhead: {o['overhead_median_paired']:+.2%} (median of paired ratios; 95% CI "
          f"{o['overhead_paired_ci95'][0]:+.2%} .. {o['overhead_paired_ci95'][1]:+.2%}), "
          f"{o['overhead_ratio_of_medians']:+.2%} (ratio of medians); goal <= 1%")
    print(f"  noise floor: the off runs alone spread {o['noise_off_runs']['spread']:.2%} (max/min)")
    print(f"  scrapes per run {o['scrapes_per_run']:.0f}, scrape latency p50 {o['scrape_latency_p50_s'] * 1e3:.2f} ms, "
          f"last scrape saw {o['iterations_seen_by_last_scrape']:.0f}+ iterations")
    print(f"  cost bound from the collector's CPU time ({ops_per_iteration:.1f} collectives/iteration): "
          f"{bound:.3%} of the run at one scrape per {args.scrape_interval:g} s, {bound_5s:.4%} at one per 5 s")
    doc = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
           "args": vars(args), "collector": cost, "windowed": w, "overhead": o}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
