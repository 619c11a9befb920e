"""Data parallel x pipeline parallel on a 2-D DeviceMesh ("pp", "dp"), pp outermost.

init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp")) as in torchtitan: on 4 ranks
with pp=2, ranks 0,1 hold stage 0 and ranks 2,3 stage 1; rank r talks to its pipeline peer
over mesh["pp"] and to its data-parallel replica over mesh["dp"]. Each iteration runs a
GPipe schedule over blocking dist.send / dist.recv on the pp group (stages of unequal
depth, --stage-cost), all-reduces the gradients over the dp group, and takes an optimizer
step on every rank. Each dp replica trains on its own data.

    torchrun --nproc-per-node 4 examples/mesh_dp_pp.py --steps 20          # pp 2 x dp 2

Every rank prints `iter_ms median=<ms>` (iterations after 2 warm-ups) at the end.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh


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
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--mb-size", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--stage-cost", default="1,6", help="layers per stage")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pp, dp = args.pp, world // args.pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    stage_id, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    cost = [int(c) for c in args.stage_cost.split(",")]
    if len(cost) != pp:
        raise SystemExit(f"--stage-cost has {len(cost)} entries, pp is {pp}")
    is_first, is_last = stage_id == 0, stage_id == pp - 1

    torch.manual_seed(stage_id)  # the same weights in every dp replica of a stage
    stage = make_stage(cost[stage_id], args.hidden, args.classes, is_last)
    params = list(stage.parameters())
    opt = torch.optim.SGD(params, lr=0.1)

    n_mb, shape = args.micro_batches, (args.mb_size, args.hidden)
    g = torch.Generator().manual_seed(dp_rank)  # each dp replica has its own data
    data = torch.randn(n_mb, *shape, generator=g)
    labels = torch.randint(0, args.classes, (n_mb, args.mb_size), generator=g)

    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        inputs, outputs = [], []
        for i in range(n_mb):  # GPipe forward over the pp group
            if is_first:
                x = data[i]
            else:
                x = torch.empty(shape)
                dist.recv(x, group=pp_group, group_src=stage_id - 1)
                x.requires_grad_()
            y = stage(x)
            if is_last:
                y = F.cross_entropy(y, labels[i]) / n_mb
            else:
                dist.send(y.detach(), group=pp_group, group_dst=stage_id + 1)
            inputs.append(x)
            outputs.append(y)
        for i in range(n_mb):  # GPipe backward
            if is_last:
                outputs[i].backward()
            else:
                grad = torch.empty(shape)
                dist.recv(grad, group=pp_group, group_src=stage_id + 1)
                outputs[i].backward(grad)
            if not is_first:
                dist.send(inputs[i].grad, group=pp_group, group_dst=stage_id - 1)
        for prm in params:  # data parallel: average the gradients over the dp group
            dist.all_reduce(prm.grad, group=dp_group)
            prm.grad /= dp
        opt.step()
        dt = (time.perf_counter() - t0) * 1e3
        times.append(dt)
        if is_last and dp_rank == 0:
            loss = sum(o.item() for o in outputs)
            print(f"step {step} loss {loss:.4f} iter {dt:.1f} ms", flush=True)

    print(f"rank {dist.get_rank()} pp {stage_id} dp {dp_rank}", flush=True)
    print(f"iter_ms median={statistics.median(times[2:] or times):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
