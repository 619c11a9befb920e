"""A hand-written GPipe pipeline over blocking dist.send / dist.recv, with unequal stages.

Each rank is one pipeline stage. Every iteration runs all micro-batches forward (activations
go to the next stage with dist.send / dist.recv), the last stage computes a cross-entropy
loss, then all micro-batches backward (activation gradients flow back the same way), and
every stage takes an optimizer step. Stage i is `cost[i]` hidden layers deep (--stage-cost),
so the stages are deliberately unbalanced and the pipeline bubble shows in the timings.

    torchrun --nproc-per-node 2 examples/pipeline_sendrecv.py --steps 20
    torchrun --nproc-per-node 4 examples/pipeline_sendrecv.py --stage-cost 1,2,4,3

Every rank prints `iter_ms median=<ms>` (iterations after 2 warm-ups) at the end.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

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
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--mb-size", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--stage-cost", default=None, help="layers per stage, e.g. 1,6 (default by world size)")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cost = [int(c) for c in (args.stage_cost or DEFAULT_COST.get(world, ",".join(["1"] * world))).split(",")]
    if len(cost) != world:
        raise SystemExit(f"--stage-cost has {len(cost)} entries, world size is {world}")
    is_first, is_last = rank == 0, rank == world - 1

    torch.manual_seed(rank)
    stage = make_stage(cost[rank], args.hidden, args.classes, is_last)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)

    n_mb, shape = args.micro_batches, (args.mb_size, args.hidden)
    g = torch.Generator().manual_seed(0)  # the same data on every rank
    data = torch.randn(n_mb, *shape, generator=g)
    labels = torch.randint(0, args.classes, (n_mb, args.mb_size), generator=g)

    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        inputs, outputs = [], []
        # Forward: all micro-batches (GPipe fill).
        for i in range(n_mb):
            if is_first:
                x = data[i]
            else:
                x = torch.empty(shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            y = stage(x)
            if is_last:
                y = F.cross_entropy(y, labels[i]) / n_mb
            else:
                dist.send(y.detach(), dst=rank + 1)
            inputs.append(x)
            outputs.append(y)
        # Backward: all micro-batches (GPipe drain).
        for i in range(n_mb):
            if is_last:
                outputs[i].backward()
            else:
                grad = torch.empty(shape)
                dist.recv(grad, src=rank + 1)
                outputs[i].backward(grad)
            if not is_first:
                dist.send(inputs[i].grad, dst=rank - 1)
        opt.step()
        dt = (time.perf_counter() - t0) * 1e3
        times.append(dt)
        if is_last:
            loss = sum(o.item() for o in outputs)
            print(f"step {step} loss {loss:.4f} iter {dt:.1f} ms", flush=True)

    print(f"rank {rank} stage depth {cost[rank]}", flush=True)
    print(f"iter_ms median={statistics.median(times[2:] or times):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
