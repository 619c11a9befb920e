"""Pipeline parallelism with torch.distributed.pipelining: PipelineStage + a schedule.

The model is split into stages of deliberately unequal cost (--stage-cost: hidden layers per
stage). --schedule picks ScheduleGPipe, Schedule1F1B (one stage per rank) or
ScheduleInterleaved1F1B (two stages per rank: rank r holds stages r and r + world). Each
PipelineStage gets input_args / output_args, so the schedule skips its runtime shape
inference (no send_object_list / recv_object_list); only a small vote tensor is exchanged
on the first step. Every rank takes an optimizer step per iteration.

    torchrun --nproc-per-node 2 examples/pipeline_schedule.py --schedule 1f1b --steps 20
    torchrun --nproc-per-node 2 examples/pipeline_schedule.py --schedule interleaved

Every rank prints `iter_ms median=<ms>` (iterations after 2 warm-ups) at the end.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

DEFAULT_COST = {2: "1,6", 4: "1,2,4,3"}


def make_stage(depth: int, hidden: int, classes: int, is_last: bool) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    if is_last:
        layers.append(nn.Linear(hidden, classes))
    return nn.Sequential(*layers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="gpipe")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--mb-size", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--stage-cost", default=None, help="layers per stage, e.g. 1,6 (default by stage count)")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 2 if args.schedule == "interleaved" else 1
    n_stages = world * per_rank
    default = DEFAULT_COST.get(n_stages) or ",".join(str([1, 2, 4, 3][i % 4]) for i in range(n_stages))
    cost = [int(c) for c in (args.stage_cost or default).split(",")]
    if len(cost) != n_stages:
        raise SystemExit(f"--stage-cost has {len(cost)} entries, the pipeline has {n_stages} stages")

    mb_shape = (args.mb_size, args.hidden)
    stages, params = [], []
    for idx in range(rank, n_stages, world):  # stage indices of this rank
        torch.manual_seed(idx)
        is_last = idx == n_stages - 1
        mod = make_stage(cost[idx], args.hidden, args.classes, is_last)
        params += list(mod.parameters())
        # Example tensors: their shape, dtype and requires_grad are all the stage needs (the
        # grad of a tensor is only sent back when requires_grad is set: the first stage's data
        # needs none).
        example_in = torch.empty(mb_shape, requires_grad=idx > 0)
        example_out = torch.empty((args.mb_size, args.classes) if is_last else mb_shape, requires_grad=True)
        stages.append(
            PipelineStage(mod, idx, n_stages, torch.device("cpu"), input_args=example_in, output_args=example_out)
        )

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)

    n_mb = args.micro_batches
    if args.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    opt = torch.optim.SGD(params, lr=0.1)

    g = torch.Generator().manual_seed(0)  # the same data on every rank
    x = torch.randn(n_mb * args.mb_size, args.hidden, generator=g)
    y = torch.randint(0, args.classes, (n_mb * args.mb_size,), generator=g)

    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        inputs = (x,) if has_first else ()
        if has_last:
            schedule.step(*inputs, target=y, losses=losses)
        else:
            schedule.step(*inputs)
        opt.step()
        dt = (time.perf_counter() - t0) * 1e3
        times.append(dt)
        if has_last:
            loss = torch.stack(losses).mean().item()
            print(f"step {step} loss {loss:.4f} iter {dt:.1f} ms", flush=True)

    print(f"rank {rank} stages {[s.stage_index for s in stages]} schedule {args.schedule}", flush=True)
    print(f"iter_ms median={statistics.median(times[2:] or times):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
