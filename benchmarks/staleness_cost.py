"""What SSP and asynchronous SGD cost per step on a time-to-accuracy task, separated into its two parts
(issue 23), in one process without any communication: P simulated ranks, the same batches as P ranks of
the benchmark would read, and the task's own optimizer.

- ``bsp``: one step per clock on the average of the P gradients (BSP, every mode's reference);
- ``push``: the parameter-server update rule of SSP and async (one optimizer step per rank's push, its
  gradient divided by P, at lr / P for an adaptive optimizer: the README's recommendation), every
  gradient computed at the newest parameters: what the update rule alone costs;
- ``push:delay=d`` (or ``bsp:delay=d``, Pipe-SGD's k): every gradient computed at the parameters of d
  clocks before (what a rank that reads values d clocks stale computes): what staleness costs on top;
- ``lr_scale=x``, ``beta1=b`` and ``warmup=n`` (comma-separated after the colon) scale the learning rate,
  set the first-moment decay (AdamW) and warm the learning rate up linearly over the first n clocks,
  e.g. ``push:delay=1,lr_scale=0.5,beta1=0`` or ``bsp:warmup=100``.

    python benchmarks/staleness_cost.py --task lm --ranks 4 --steps 300 \
        --runs bsp push push:delay=1 push:delay=1,lr_scale=0.5 bsp:lr_scale=0.5

Prints the validation metric every ``--every`` steps for each run. Deterministic (fixed seeds).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from torch import nn

from poseidon_torch.bench.accuracy.tasks import TASKS, Task


@dataclass(frozen=True)
class Run:
    rule: str  # "bsp" or "push"
    delay: int = 0
    lr_scale: float = 1.0
    beta1: float | None = None
    warmup: int = 0  #: clocks of linear learning-rate warm-up

    @classmethod
    def parse(cls, text: str) -> "Run":
        rule, _, options = text.partition(":")
        if rule not in ("bsp", "push"):
            raise argparse.ArgumentTypeError(
                f"a run is bsp or push[:delay=D,lr_scale=X,beta1=B,warmup=N], got {text!r}")
        kwargs = dict(option.split("=", 1) for option in options.split(",") if option)
        return cls(rule, int(kwargs.get("delay", 0)), float(kwargs.get("lr_scale", 1.0)),
                   float(kwargs["beta1"]) if "beta1" in kwargs else None, int(kwargs.get("warmup", 0)))


def make_optimizer(task: Task, params, run: Run, ranks: int) -> torch.optim.Optimizer:
    cls, kwargs = task.optimizer
    kwargs = dict(kwargs, lr=kwargs["lr"] * run.lr_scale / (ranks if run.rule == "push" else 1))
    if run.beta1 is not None:
        kwargs["betas"] = (run.beta1, kwargs.get("betas", (0.9, 0.999))[1])
    return cls(params, **kwargs)


def gradients(task: Task, probe: nn.Module, order: torch.Tensor, step: int, rank: int,
              ranks: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradient at clock ``step``, on its own batch (consecutive blocks of a fixed permutation)."""
    start = ((step * ranks + rank) * task.batch_size) % (len(order) - task.batch_size)
    inputs, targets = zip(*(task.train_set[int(i)] for i in order[start:start + task.batch_size]))
    probe.zero_grad(set_to_none=True)
    task.loss_fn(probe(torch.stack(inputs)), torch.stack(targets)).backward()
    return [p.grad.clone() for p in probe.parameters()]


def train(task: Task, run: Run, ranks: int, steps: int, every: int) -> list[tuple[int, float]]:
    model = task.build_model()
    probe = task.build_model()  # computes the gradients, at the parameters of ``run.delay`` clocks before
    optimizer = make_optimizer(task, model.parameters(), run, ranks)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda clock: min(1.0, (clock + 1) / max(run.warmup, 1)))
    order = torch.randperm(len(task.train_set), generator=torch.Generator().manual_seed(0))
    history: list[list[torch.Tensor]] = []
    curve = []
    for step in range(steps):
        history = (history + [[p.detach().clone() for p in model.parameters()]])[-(run.delay + 1):]
        with torch.no_grad():
            for p, value in zip(probe.parameters(), history[0]):
                p.copy_(value)
        grads = [gradients(task, probe, order, step, rank, ranks) for rank in range(ranks)]
        with torch.no_grad():  # running statistics (BatchNorm) follow the forwards, as every rank's would
            for buffer, probed in zip(model.buffers(), probe.buffers()):
                buffer.copy_(probed)
        pushes = [[sum(parts) / ranks for parts in zip(*grads)]] if run.rule == "bsp" else \
            [[g / ranks for g in rank_grads] for rank_grads in grads]
        for push in pushes:
            for p, g in zip(model.parameters(), push):
                p.grad = g
            optimizer.step()
        warmup.step()  # once per clock: the push rule's P steps of a clock share its rate
        if (step + 1) % every == 0:
            curve.append((step + 1, task.evaluate(model)[task.metric]))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="lm")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", nargs="+", type=Run.parse, default=[Run("bsp"), Run("push"), Run("push", 1)])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    task = TASKS[args.task]()
    for run in args.runs:
        start = time.monotonic()
        curve = train(task, run, args.ranks, args.steps, args.every)
        points = "  ".join(f"step {step}: {value:.3f}" for step, value in curve)
        print(f"{run}  {points}  ({time.monotonic() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
