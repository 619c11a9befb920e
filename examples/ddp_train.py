"""A small, plain DDP training script: what `make demo` runs under `nbox run`.

Nothing in it knows about NeuronaBox. Under `nbox run topology.yaml -- python examples/ddp_train.py`
it is rank 0 of the topology's world; run with torchrun it trains for real.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def build_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(build_model(args.width, args.depth), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch, 64, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        elapsed = time.perf_counter() - start
        print(f"rank {rank} of {world}: {args.steps} steps in {elapsed:.2f}s (pid {os.getpid()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
