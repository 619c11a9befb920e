"""Benchmark workload: an MLP or a small CNN trained with SGD; prints its per-iteration wall times as JSON.

The MLP is the worst case for DDP's own cost (little compute per gradient byte); the CNN is
closer to vision training (convolutions reuse each weight many times).

--mode plain: no torch.distributed at all; --mode ddp: DDP over whatever init_process_group
gives (a real 1-rank gloo group under plain python, the nbox backend under nbox run).
"""

import argparse
import json
import time

import torch
import torch.nn as nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "ddp"], default="ddp")
    p.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.arch == "mlp":
        layers = [nn.Linear(256, args.width), nn.ReLU()]
        for _ in range(args.depth):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        model: nn.Module = nn.Sequential(*layers, nn.Linear(args.width, 10))
        x = torch.randn(args.batch, 256)
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
        )
        x = torch.randn(args.batch // 4, 3, 32, 32)
    if args.mode == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    y = torch.randint(0, 10, (x.shape[0],))
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    print("ITER_TIMES " + json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
