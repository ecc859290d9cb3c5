"""Train a small VGG-like CNN with PoseidonDDP (and, with --compare-ddp, torch DDP in the same run).

    torchrun --nproc_per_node 2 examples/train.py [--steps N] [--batch 32] [--compare-ddp] [--server]
        [--delay K] [--staleness S|none [--push-every N] [--fetch-every M]]

Each mode runs with the optimizer settings under which it trains well (printed at the start; the rule
behind them is docs/choosing.md):
- default (hybrid BSP): SGD, lr 0.02, momentum 0.9, 30 steps;
- --delay K (Pipe-SGD, ``PoseidonDDP(model, delay=K)``): each step applies the averaged gradients of K
  steps earlier, so a step's sync runs on during the next K steps and the first K steps apply nothing.
  A stale gradient shrinks the largest step size that stays stable, and momentum shrinks it further
  instead of widening it as under BSP, so this runs SGD at lr 0.02 / K with momentum 0.5, 60 steps (with
  BSP's momentum 0.9 the loss oscillates and ends above where it started);
- --server: AdamW (lr 1e-3) in both runs, PoseidonDDP's as a ServerOptimizer: the KV-store shards hold
  the optimizer state (1/P of it each) and apply the update; the example prints the state per rank.
  With --delay K the new values reach the parameters K steps later (``ServerOptimizer(..., delay=K)``):
  AdamW at lr 1e-3 / (K + 1), beta1 0.5;
- --server --staleness S: stale synchronous parallel (no rank more than S steps ahead of the slowest;
  ``none``: asynchronous), AdamW at lr 1e-3 / P (each push is one step of it), and every rank calls
  ``opt.finish()`` at the end; asynchronous runs may push summed gradients every N steps and take new
  values every M steps (Downpour's n_push, n_fetch).

The data are synthetic but learnable: each class is a fixed random 32x32 image plus noise. Rank 0 prints
the loss, the plan (one row per bucket, its columns explained below it) and a summary.
The speed ratio against torch DDP compares two runs on this machine's loopback: it measures the
engines' CPU cost, not a network, and it is noise on a machine with fewer free cores than ranks
(docs/benchmarks.md says when a ratio means something).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from poseidon_torch import PoseidonDDP, ServerOptimizer

NUM_CLASSES = 10
PLAN_LEGEND = ("(the plan: one row per bucket, in sync order; path: PS or SFB, the one it takes; PS/SFB bytes and "
               "time: what this rank would send per iteration on each path and the cost model's time for it; K: an "
               "FC layer's rows per pass; docs/hybrid.md#the-plan)")
SUMMARY_STEPS = 5  #: the loss summary averages this many steps at each end (one batch is noisy)


def small_vgg(fc_width: int) -> nn.Module:
    """Conv features (3x32x32 -> 64x4x4) and an FC head that holds most of the parameters."""
    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 64), nn.Flatten(),
                         nn.Linear(64 * 4 * 4, fc_width), nn.ReLU(),
                         nn.Linear(fc_width, fc_width), nn.ReLU(),
                         nn.Linear(fc_width, NUM_CLASSES))


def synthetic_batch(step: int, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    prototypes = torch.randn(NUM_CLASSES, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + step * 1009 + rank)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=g)
    return prototypes[labels] + 0.8 * torch.randn(batch, 3, 32, 32, generator=g), labels


def train(wrapper: str, args: argparse.Namespace, rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    model = small_vgg(args.fc_width)
    if wrapper == "poseidon":
        wrapped = PoseidonDDP(model, delay=0 if args.server else args.delay)
    else:
        wrapped = DDP(model)
    opt = make_optimizer(wrapper, wrapped, args)
    if rank == 0:
        print(f"[{wrapper}] {describe(opt)}", flush=True)
    times, losses = [], []
    for step in range(args.steps):
        x, y = synthetic_batch(step, args.batch, rank)
        start = time.perf_counter()
        loss = F.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        # the plan once the buckets are learned from the first backward (what the rest of training runs)
        if rank == 0 and step == 1 and getattr(wrapped, "plan", None) is not None:
            print(wrapped.plan, PLAN_LEGEND, sep="\n", flush=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            rate = args.batch * world / times[-1]
            print(f"[{wrapper}] step {step:3d}  loss {loss.item():.4f}  {rate:8.1f} samples/s", flush=True)
    if rank == 0:
        first, last = (statistics.mean(losses[:SUMMARY_STEPS]), statistics.mean(losses[-SUMMARY_STEPS:]))
        print(f"[{wrapper}] loss {first:.4f} -> {last:.4f} (mean of the first and last {SUMMARY_STEPS} steps "
              f"of {args.steps})", flush=True)
    if isinstance(opt, ServerOptimizer):
        opt.finish()  # the newest values in the parameters, on every rank (with staleness: every push applied)
    if args.server:
        print(f"[{wrapper}] rank {rank}: optimizer state {state_bytes(opt) / 1e6:.2f} MB", flush=True)
    if hasattr(wrapped, "close"):
        wrapped.close()  # PoseidonDDP: end its collectives in flight now, not at the interpreter's teardown
    return times[args.warmup:]


def make_optimizer(wrapper: str, wrapped: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Each mode's settings (docs/choosing.md): SGD with momentum under BSP; under Pipe-SGD's delay k a
    smaller step and less momentum; with ``--server``, AdamW, run by PoseidonDDP's shards for PoseidonDDP
    (with Pipe-SGD's ``delay``: a smaller lr and beta1; with SSP's ``staleness``: lr / P, since each
    rank's push is one AdamW step)."""
    delay = args.delay if wrapper == "poseidon" else 0
    if not args.server:
        if delay:
            return torch.optim.SGD(wrapped.parameters(), lr=0.02 / delay, momentum=0.5)
        return torch.optim.SGD(wrapped.parameters(), lr=0.02, momentum=0.9)
    if wrapper == "poseidon" and args.staleness != 0:
        lr = 1e-3 / dist.get_world_size()  # one AdamW step per push: P of them per clock
        return ServerOptimizer(wrapped, torch.optim.AdamW, lr=lr, weight_decay=0.01, staleness=args.staleness,
                               push_every=args.push_every, fetch_every=args.fetch_every)
    if wrapper == "poseidon":
        return ServerOptimizer(wrapped, torch.optim.AdamW, lr=1e-3 / (delay + 1), betas=(0.5 if delay else 0.9, 0.999),
                               weight_decay=0.01, delay=delay)
    return torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.01)


def describe(opt: torch.optim.Optimizer) -> str:
    """The optimizer and the settings that matter under staleness, e.g. ``SGD: lr 0.02, momentum 0.9``."""
    group = opt.param_groups[0]
    server = isinstance(opt, ServerOptimizer)
    name = f"{opt.optimizer_class.__name__} on the parameter servers" if server else type(opt).__name__
    return f"{name}: " + ", ".join(f"{key} {group[key]:.3g}" if key == "lr" else f"{key} {group[key]}"
                                   for key in ("lr", "momentum", "betas") if key in group)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, ServerOptimizer):
        return opt.local_state_bytes()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def staleness(text: str) -> int | None:
    return None if text == "none" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default 30; 60 with --delay, whose smaller steps need more)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--fc-width", type=int, default=1024)
    parser.add_argument("--compare-ddp", action="store_true", help="also train with torch DDP and compare")
    parser.add_argument("--server", action="store_true", help="AdamW; PoseidonDDP's run by its parameter servers")
    parser.add_argument("--delay", type=int, default=0, help="Pipe-SGD: apply the gradients of K steps earlier")
    parser.add_argument("--staleness", type=staleness, default=0,
                        help="with --server: SSP's bound in steps, or 'none' (asynchronous); 0: BSP")
    parser.add_argument("--push-every", type=int, default=1,
                        help="with --staleness none: push the summed gradients every N steps (Downpour)")
    parser.add_argument("--fetch-every", type=int, default=1,
                        help="with --staleness none: take new values every N steps (Downpour)")
    args = parser.parse_args()
    if args.staleness != 0 and not args.server:
        parser.error("--staleness needs --server (SSP runs on the parameter servers)")
    if "RANK" not in os.environ:
        parser.error("launch it with torchrun, which starts one process per rank: "
                     "torchrun --nproc_per_node 2 examples/train.py [options]")
    args.steps = args.steps or (60 if args.delay else 30)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    results = {w: train(w, args, rank, world) for w in (["ddp"] if args.compare_ddp else []) + ["poseidon"]}
    if rank == 0:
        for wrapper, times in results.items():
            median = statistics.median(times)
            print(f"{wrapper:9s} median iteration {median * 1e3:7.1f} ms  "
                  f"{args.batch * world / median:8.1f} samples/s ({world} ranks)")
        if args.compare_ddp:
            ratio = statistics.median(results["ddp"]) / statistics.median(results["poseidon"])
            print(f"PoseidonDDP speed vs torch DDP: {ratio:.2f}x (ranks on one machine's loopback: the engines' "
                  f"CPU cost, not a network; noise unless every rank has a free core)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
