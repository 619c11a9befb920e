"""The long hostile-input fuzz of issue 31: at least 10,000 generated inputs per surface.

Surfaces (strategies and checks in ``tests/fuzzing.py``): topology documents (a valid file with
fields replaced by values past any sense), raw YAML text, and requests to the shaping agent's
own HTTP handler (bodies and Content-Length headers sent raw; the link store needs no kernel).
Each input must be accepted within the stated bounds or refused with one line (exit 2 / 4xx),
never a traceback, a 5xx, or more than 2 s. Writes ``benchmarks/results/fuzz_hostile.json``.
Run: ``make fuzz`` (``.venv/bin/python benchmarks/fuzz_hostile.py --examples 10000``).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.fuzzing import AgentHarness, check_topology, documents, requests, yaml_texts  # noqa: E402


def run_surface(name: str, strategy, check, examples: int, seed: int) -> dict:
    """Feed ``examples`` inputs of ``strategy`` to ``check``; outcomes, slowest input, failures (none expected)."""
    outcomes: collections.Counter = collections.Counter()
    slowest = 0.0
    failure = None

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def feed(value):
        nonlocal slowest
        t0 = time.monotonic()
        outcomes[str(check(value))] += 1
        slowest = max(slowest, time.monotonic() - t0)

    t0 = time.monotonic()
    try:
        import random

        random.seed(seed)
        feed()
    except Exception as exc:  # noqa: BLE001 - the result file says what failed
        parts = getattr(exc, "exceptions", None) or [exc]  # hypothesis groups distinct failures
        failure = "; ".join(f"{type(e).__name__}: {str(e)[:1000]}" for e in parts)
    took = time.monotonic() - t0
    total = sum(outcomes.values())
    print(f"{name}: {total} inputs in {took:.0f} s, {dict(outcomes)}, slowest {slowest:.3f} s, "
          f"{'FAILED: ' + failure[:300] if failure else 'no failure'}", flush=True)
    return {"inputs": total, "outcomes": dict(outcomes), "seconds": round(took, 1), "slowest_s": round(slowest, 4),
            "failure": failure}


def main() -> int:
    """Run every surface and write the result file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_hostile.json"))
    args = ap.parse_args()
    harness = AgentHarness()
    n = args.examples
    try:
        results = {
            "topology_documents": run_surface("topology documents", documents(), check_topology, n, args.seed),
            "yaml_texts": run_surface("yaml texts", yaml_texts, check_topology, n, args.seed),
            "agent_requests": run_surface("agent requests", requests, lambda r: harness.check(*r), n, args.seed),
        }
    finally:
        harness.close()
    doc = {
        "what": "issue 31 hostile-input fuzz: each input accepted within the bounds or refused with one line "
                "(TopologyError / HTTP 4xx), no traceback, no 5xx, each under 2 s",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "examples_per_surface": args.examples,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "surfaces": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(r["failure"] for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
