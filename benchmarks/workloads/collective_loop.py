"""Benchmark workload: many small blocking all-reduces; prints CPU and wall time per call."""

import json
import sys
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
x = torch.ones(256)
for _ in range(50):
    dist.all_reduce(x)
cpu0, wall0 = time.process_time(), time.perf_counter()
for _ in range(n):
    dist.all_reduce(x)
cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
print("LOOP " + json.dumps({"calls": n, "cpu_s_per_call": cpu / n, "wall_s_per_call": wall / n}), flush=True)
dist.destroy_process_group()
