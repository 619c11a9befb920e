"""The PyTorch "Getting started with DDP" tutorial's script, as people copy it: mp.spawn starts the workers.

Nothing in it knows about NeuronaBox. Run as is (`python examples/spawn_ddp.py`) it trains on
WORLD_SIZE local processes; under `nbox run topologies/cpu-8x1g.yaml -- python examples/spawn_ddp.py`
its workers are real ranks 0 and 1 of the 8 and the other six are emulated (docs/guide/spawn.md).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size, steps, port):
    print(f"Running basic DDP example on rank {rank}.")
    torch.set_num_threads(1)
    setup(rank, world_size, port)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


def run_demo(demo_fn, world_size, steps, port):
    mp.spawn(demo_fn, args=(world_size, steps, port), nprocs=world_size, join=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--port", type=int, default=12355)
    args = parser.parse_args()
    run_demo(demo_basic, args.world_size, args.steps, args.port)
