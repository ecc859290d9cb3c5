"""How close ServerOptimizer(max_grad_norm=c) stays to torch DDP + clip_grad_norm_(c) on a model of the
size people train, and what makes the difference (issue 19: the tolerance, measured and stated).

    torchrun --nproc_per_node 2 benchmarks/clip_parity.py [--workload gpt2] [--steps 16] [--clip 1.0]

Trains the workload from one initialisation with AdamW (lr 1e-3, weight decay 0.01) on the same
batches: DDP + clip_grad_norm_, DDP + the same clipping with the norm summed in float64, and
ServerOptimizer(max_grad_norm), then both without clipping; prints, per pair, the largest absolute and
relative parameter difference and the parameters where they are.
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from poseidon_torch import PoseidonDDP, ServerOptimizer
from poseidon_torch.bench.workloads import build


def train(workload: str, wrapper: str, steps: int, clip: float | None) -> dict[str, torch.Tensor]:
    w = build(workload)
    rank = dist.get_rank()
    if wrapper.startswith("ddp"):
        model = DDP(w.model)
        opt = torch.optim.AdamW(w.model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        model = PoseidonDDP(w.model, hybrid=False)
        opt = ServerOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01, max_grad_norm=clip)
    for step in range(steps):
        x, y = w.make_batch(rank, step)
        w.loss_fn(model(x), y).backward()
        if wrapper == "ddp" and clip is not None:
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), clip)
        elif wrapper == "ddp64" and clip is not None:
            clip_in_float64(w.model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    if not wrapper.startswith("ddp"):
        model.synchronize()
        model.close()
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


def clip_in_float64(params, max_norm: float) -> None:
    """clip_grad_norm_'s arithmetic with the squares summed in float64 (as the owners sum them)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    scale = min(max_norm / (total + 1e-6), 1.0)
    for g in grads:
        g.mul_(scale)


def compare(ours: dict, theirs: dict) -> str:
    worst_abs = max(((ours[n] - t).abs().max().item(), n) for n, t in theirs.items())
    rel = {n: ((ours[n] - t).abs() / t.abs().clamp_min(1e-12)).max().item() for n, t in theirs.items()}
    share = sum(int(((ours[n] - t).abs() > 1e-6 + 1e-5 * t.abs()).sum()) for n, t in theirs.items())
    total = sum(t.numel() for t in theirs.values())
    worst_rel = max((v, n) for n, v in rel.items())
    return (f"max abs diff {worst_abs[0]:.3g} ({worst_abs[1]}); max rel diff {worst_rel[0]:.3g} ({worst_rel[1]}); "
            f"{share} of {total} elements outside rtol 1e-5 + atol 1e-6")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt2")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = {(wrapper, clip): train(args.workload, wrapper, args.steps, clip)
            for wrapper, clip in (("ddp", args.clip), ("ddp64", args.clip), ("server", args.clip), ("ddp", None),
                                  ("server", None))}
    if dist.get_rank() == 0:
        print(f"{args.workload}, {args.steps} AdamW steps, {dist.get_world_size()} ranks")
        print(f"clipped at {args.clip}, vs clip_grad_norm_:        ",
              compare(runs["server", args.clip], runs["ddp", args.clip]))
        print(f"clipped at {args.clip}, vs its float64-norm twin:  ",
              compare(runs["server", args.clip], runs["ddp64", args.clip]))
        print("not clipped:                              ", compare(runs["server", None], runs["ddp", None]))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
