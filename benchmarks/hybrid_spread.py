"""Hybrid collectives, measured: 2 real CPU ranks + emulated ones (DDP iteration times, per-op cost, failure time)."""
import json, os, signal, statistics, sys, tempfile, time
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests")); sys.path.insert(0, str(ROOT))
from test_hybrid import RealRanks, _topology_text  # noqa: E402

PY = sys.executable
def med(v): return statistics.median(v)

def ddp(bw, real, steps=30, width=256):
    tmp = Path(tempfile.mkdtemp(prefix="hybbench-"))
    run = RealRanks(tmp, _topology_text(8, 8, bandwidth=bw, latency="10us"), real=real)
    run.start([PY, str(ROOT / "examples/ddp_train.py"), "--steps", str(steps), "--width", str(width)])
    codes = run.wait(600); run.close()
    assert all(c == 0 for c in codes.values()), {r: run.output(r)[-2000:] for r in real}
    recs = {r: json.loads(run.record(r).read_text()) for r in real}
    out = {}
    for r, rec in recs.items():
        it = rec["iterations"][1:]
        late = [o["lateness"] for o in rec["ops"] if o.get("lateness") is not None and o["iteration"] >= 1]
        out[r] = {"median_s": med(it), "mean_s": statistics.fmean(it), "late_p50_s": med(late) if late else None,
                  "late_max_s": max(late) if late else None, "late_frac_over_1ms": sum(l > 1e-3 for l in late) / max(1, len(late))}
    return out

def loop(real, calls=2000):
    tmp = Path(tempfile.mkdtemp(prefix="hybbench-"))
    run = RealRanks(tmp, _topology_text(8, 8), real=real, model="ideal")
    run.start([PY, str(ROOT / "benchmarks/workloads/collective_loop.py"), str(calls)])
    run.wait(600); run.close()
    return {r: json.loads(next(l[5:] for l in run.output(r).splitlines() if l.startswith("LOOP "))) for r in real}

def kill():
    tmp = Path(tempfile.mkdtemp(prefix="hybbench-"))
    run = RealRanks(tmp, _topology_text(8, 8), real=[0, 1], timeout=300)
    run.start([PY, str(ROOT / "examples/ddp_train.py"), "--steps", "100000"])
    while "step   5" not in run.output(0): time.sleep(0.05)
    run.procs[1].send_signal(signal.SIGKILL); t = time.monotonic()
    code = run.procs[0].wait(400); took = time.monotonic() - t
    msg = next((l for l in run.output(0).splitlines() if "nbox:" in l), "")
    run.close()
    return {"exit": code, "seconds": took, "message": msg[:200]}

if __name__ == "__main__":
    res = {"load_before": os.getloadavg()}
    for bw in ("100Mbps", "1Gbps"):
        res[f"ddp_{bw}"] = []
        for _ in range(3):
            two = ddp(bw, [0, 1]); one = ddp(bw, [0])
            res[f"ddp_{bw}"].append({"two_real": two, "one_real": one})
            print(bw, json.dumps({"two": {r: round(v["median_s"] * 1e3, 2) for r, v in two.items()},
                                  "one": round(one[0]["median_s"] * 1e3, 2)}), flush=True)
    res["loop_two"] = loop([0, 1]); res["loop_one"] = loop([0])
    print("loop", json.dumps(res["loop_two"]), json.dumps(res["loop_one"]), flush=True)
    res["kill"] = [kill() for _ in range(3)]
    print("kill", json.dumps(res["kill"]), flush=True)
    res["load_after"] = os.getloadavg()
    Path("/tmp/notes/hybrid_bench.json").write_text(json.dumps(res, indent=1))
