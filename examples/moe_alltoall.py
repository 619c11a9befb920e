"""An expert-parallel mixture-of-experts step with uneven all-to-all (dispatch and combine).

--experts experts (default 4) are spread over the ranks (one per rank on 4 ranks, two per
rank on 2). Routing is deterministic and skewed: every rank sends a fraction --skew of its
tokens to expert 0 and splits the rest evenly, so expert 0's rank gets most of the work.
Each iteration: the token counts per expert are exchanged with an all_to_all_single, the
tokens are dispatched with an uneven all_to_all_single (input/output split sizes), each
expert runs its FFN on the tokens it got, a second all_to_all_single sends the results back,
and the backward pass runs the same two all-to-alls in reverse (a small autograd.Function).
The replicated router and input layer have their gradients all-reduced; then every rank
takes an optimizer step.

    torchrun --nproc-per-node 4 examples/moe_alltoall.py --steps 20
    torchrun --nproc-per-node 2 examples/moe_alltoall.py --skew 0.25   # balanced

Every rank prints `iter_ms median=<ms>` (iterations after 2 warm-ups) at the end.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


class AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return AllToAll.apply(grad, in_splits, out_splits), None, None


def route_counts(tokens: int, experts: int, skew: float) -> list[int]:
    """Tokens per expert: a fraction `skew` to expert 0, the rest split evenly."""
    first = round(tokens * skew)
    rest = [(tokens - first) // (experts - 1)] * (experts - 1)
    rest[0] += tokens - first - sum(rest)
    return [first] + rest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--skew", type=float, default=0.55, help="fraction of tokens routed to expert 0")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} does not split over {world} ranks")
    per_rank = args.experts // world  # local experts: rank * per_rank + j

    torch.manual_seed(0)  # replicated layers: the same on every rank
    inp = nn.Linear(args.dim, args.dim)
    router = nn.Linear(args.dim, args.experts)
    torch.manual_seed(1 + rank)
    experts = nn.ModuleList(
        nn.Sequential(nn.Linear(args.dim, args.ffn), nn.GELU(), nn.Linear(args.ffn, args.dim)) for _ in range(per_rank)
    )
    replicated = list(inp.parameters()) + list(router.parameters())
    opt = torch.optim.SGD(replicated + list(experts.parameters()), lr=0.05)

    counts = route_counts(args.tokens, args.experts, args.skew)
    expert_of_token = torch.repeat_interleave(torch.arange(args.experts), torch.tensor(counts))
    x = torch.randn(args.tokens, args.dim)
    target = torch.randn(args.tokens, args.dim)

    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        h = inp(x)
        gate = router(h).softmax(-1).gather(1, expert_of_token[:, None])  # [T, 1]

        # 1. Exchange counts: recv[src * per_rank + j] = tokens src sends to local expert j.
        recv = torch.empty(args.experts, dtype=torch.int64)
        dist.all_to_all_single(recv, torch.tensor(counts, dtype=torch.int64))
        recv = recv.tolist()
        in_splits = [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(world)]
        out_splits = [sum(recv[r * per_rank:(r + 1) * per_rank]) for r in range(world)]

        # 2. Dispatch (tokens are already sorted by expert), uneven splits.
        got = AllToAll.apply(h, out_splits, in_splits).split(recv)  # chunk per (src, expert)

        # 3. Each local expert runs on all tokens it received, from every source.
        results = [None] * len(got)
        for j, expert in enumerate(experts):
            idx = [src * per_rank + j for src in range(world)]
            out = expert(torch.cat([got[i] for i in idx]))
            for i, part in zip(idx, out.split([recv[i] for i in idx])):
                results[i] = part

        # 4. Combine: send the results back, the reverse uneven all-to-all.
        y = h + gate * AllToAll.apply(torch.cat(results), in_splits, out_splits)
        loss = (y - target).pow(2).mean()
        loss.backward()
        for prm in replicated:  # data-parallel gradients of the replicated layers
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        dt = (time.perf_counter() - t0) * 1e3
        times.append(dt)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} iter {dt:.1f} ms", flush=True)

    print(f"rank {rank} experts {[rank * per_rank + j for j in range(per_rank)]} tokens {sum(recv)}", flush=True)
    print(f"iter_ms median={statistics.median(times[2:] or times):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
