"""Three small 2-rank DDP workloads for `nbox validate` and the fidelity table: an MLP, a small CNN, a small transformer.

Nothing in it knows about NeuronaBox: run with torchrun (or as every rank of `nbox validate`'s
real system) it trains for real; under `nbox run` it is the real rank of an emulated world.

    nbox validate topo.yaml -- python examples/fidelity_models.py --arch cnn --steps 20

``--bucket-log PATH`` times each step's phases and each gradient bucket's all-reduce (through
DDP's stock all-reduce hook, wrapped) and writes them to ``PATH.rank<R>.json``; the diagnostic
``benchmarks/bucket_timeline.py`` compares them between the real and the emulated systems.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def build(arch: str, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if arch == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        x = torch.randn(batch, 256, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
    elif arch == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128 * 8 * 8, 64),
            nn.ReLU(), nn.Linear(64, 10),
        )
        x = torch.randn(max(1, batch // 4), 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (x.shape[0],), generator=g)
    else:
        model = TinyTransformer()
        x = torch.randint(0, TinyTransformer.VOCAB, (max(1, batch // 4), 32), generator=g)
        y = torch.randint(0, TinyTransformer.VOCAB, (x.shape[0], 32), generator=g)
    return model, x, y


class TinyTransformer(nn.Module):
    """Two encoder layers, d_model 128: about 0.66 M parameters."""

    VOCAB = 1000

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, self.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=["mlp", "cnn", "transformer"], default="mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-log", help="write per-step phase and per-bucket all-reduce times to PATH.rank<R>.json")
    args = p.parse_args()
    torch.set_num_threads(1)  # one core per rank, as the real system pins them
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    model, x, y = build(args.arch, args.batch)
    model = DDP(model)
    steps: list[list[float]] = []
    buckets: list[list[float]] = []
    if args.bucket_log:
        model.register_comm_hook(None, _timed_allreduce(buckets))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.zeros(())
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y.flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        steps.append([t0, t1, t2, time.perf_counter()])
    if args.bucket_log:
        with open(f"{args.bucket_log}.rank{dist.get_rank()}.json", "w") as f:
            json.dump({"steps": steps, "buckets": buckets}, f)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{args.arch}: {params} parameters, {args.steps} steps, last loss {loss.item():.4f}", flush=True)
    # Both ranks leave together: a rank that tears gloo down while its peer is still in the
    # last collective can make the peer abort (seen once in 18 runs over the delay relay).
    dist.barrier()
    dist.destroy_process_group()


def _timed_allreduce(log: list):
    """DDP's stock all-reduce hook, logging each bucket's (bytes, issue time, completion time)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        nbytes, issued = bucket.buffer().numel() * bucket.buffer().element_size(), time.perf_counter()

        def done(fut):
            log.append([nbytes, issued, time.perf_counter()])
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    return hook


if __name__ == "__main__":
    main()
