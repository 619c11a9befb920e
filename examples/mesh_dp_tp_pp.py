"""Data x tensor x pipeline parallel on a 3-D DeviceMesh ("pp", "dp", "tp").

init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp")), pp outermost as in
torchtitan; 2 x 2 x 2 = 8 ranks by default (tiny sizes: it runs 8 processes on 2 cores).
Each pipeline stage is a stack of MLP blocks (--stage-cost blocks per stage) whose two
linears are tensor-parallel over mesh["tp"] (parallelize_module with ColwiseParallel /
RowwiseParallel: an all-reduce per block forward and per block backward). The stages run a
GPipe schedule over blocking dist.send / dist.recv on mesh["pp"] (activations are plain
replicated tensors between stages), gradients are all-reduced over mesh["dp"], and every
rank takes an optimizer step.

    torchrun --nproc-per-node 8 examples/mesh_dp_tp_pp.py --steps 20      # pp 2 x dp 2 x tp 2
    torchrun --nproc-per-node 4 examples/mesh_dp_tp_pp.py --tp 1          # same model, no TP

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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--mb-size", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--stage-cost", default="1,3", help="blocks per stage")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pp, tp = args.pp, args.tp
    dp = world // (pp * tp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    stage_id, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    cost = [int(c) for c in args.stage_cost.split(",")]
    if len(cost) != pp:
        raise SystemExit(f"--stage-cost has {len(cost)} entries, pp is {pp}")
    is_first, is_last = stage_id == 0, stage_id == pp - 1

    torch.manual_seed(stage_id)  # the same full weights in every dp and tp rank of a stage
    blocks = nn.Sequential(*[Block(args.hidden) for _ in range(cost[stage_id])])
    for block in blocks:  # each rank keeps its tp shard of up (columns) and down (rows)
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    head = nn.Linear(args.hidden, args.classes) if is_last else nn.Identity()  # replicated
    params = list(blocks.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=0.1, foreach=False)

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
            y = head(blocks(x))
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
        with torch.no_grad():  # data parallel: average each rank's (tp-local) grads over dp
            for prm in params:
                grad = prm.grad.to_local() if isinstance(prm.grad, DTensor) else prm.grad
                dist.all_reduce(grad, group=dp_group)
                grad /= dp
        opt.step()
        dt = (time.perf_counter() - t0) * 1e3
        times.append(dt)
        if is_last and dp_rank == 0 and mesh.get_local_rank("tp") == 0:
            loss = sum(o.item() for o in outputs)
            print(f"step {step} loss {loss:.4f} iter {dt:.1f} ms", flush=True)

    coords = {name: mesh.get_local_rank(name) for name in ("pp", "dp", "tp")}
    print(f"rank {dist.get_rank()} {coords}", flush=True)
    print(f"iter_ms median={statistics.median(times[2:] or times):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
