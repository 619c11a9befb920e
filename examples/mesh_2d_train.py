"""2-D parallelism on a DeviceMesh: tensor parallel inside a node, FSDP2 data parallel across.

The TP degree is the number of ranks per node (LOCAL_WORLD_SIZE, as torchrun sets it), as
in torchtitan: TP traffic stays on the fast intra-node fabric.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    tp = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world % tp:
        tp = 1
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.ReLU(), nn.Linear(4 * args.dim, args.dim), nn.Linear(args.dim, 10))
    if tp > 1:
        model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        loss = nn.functional.cross_entropy(model(torch.randn(16, args.dim)), torch.randint(0, 10, (16,)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    print(f"done: dp={world // tp} x tp={tp} on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
