"""Compute off the CPU: a workload whose compute waits on an emulated accelerator instead of the cores.

On the 2-core development machine the ranks' compute fills the cores, so every CPU second a sync spends
lengthens the iteration: how much communication a mode hides is then capped by CPU, not by the link
(README, Pipe-SGD). On GPUs the compute runs on the device while the CPU drives the communication.
:func:`off_cpu` keeps a workload's model (its parameters, their gradients, the order in which they are
ready) and replaces most of its compute by waits: each module, after its forward, sleeps its share of
``seconds / 3`` and, in backward, twice that before its own gradients are computed. A module's share is
its own part (its children's excluded) of the FLOPs of one forward at the workload's batch, counted by
``torch.utils.flop_counter``; so a transformer's tied output projection, computed in the model's own
``forward``, waits at the model's output, first in backward, as on a device. The real forward and
backward run on the first sample of each batch only (for the language model its first 16 positions: a
few percent of the CPU compute), so the cores are left to the sync.

Invariants:
- the waits depend only on the model and the batch shape: identical on every rank and in every run;
- a wait holds no lock (``time.sleep`` releases the GIL), so the sync threads have the cores meanwhile;
- the gradients are real and full size (dense), those of the one-sample batch: the bytes a step syncs
  are the model's, whatever the batch;
- the model is the workload's own object: a wrapper (DDP, PoseidonDDP) sees the same modules and
  parameters, with forward hooks of this module on them.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Protocol

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

Batch = tuple[torch.Tensor, torch.Tensor]


class Workload(Protocol):
    """What this module reads of a ``workloads.Workload`` (which imports this module)."""

    model: nn.Module

    def make_batch(self, rank: int, step: int) -> Batch: ...

    def _replace(self, **fields: object) -> Workload: ...

BACKWARD_PER_FORWARD = 2.0  #: a backward costs about twice its forward (two matmuls per forward one)


class _Wait(torch.autograd.Function):
    """Identity on a module's output that sleeps in forward and, in backward, before the module's own
    gradients are computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()  # not a view: the output may be modified in place (ReLU(inplace=True))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


def own_flops(model: nn.Module, example: torch.Tensor) -> tuple[dict[nn.Module, int], Counter]:
    """Each module's own forward FLOPs (children excluded) on ``example``, and how often each runs."""
    calls: Counter = Counter()
    handles = [m.register_forward_pre_hook(lambda m, _: calls.update([m])) for m in model.modules()]
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    inclusive = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    own = {}
    for name, module in model.named_modules():
        key = f"{root}.{name}" if name else root
        children = sum(inclusive.get(f"{key}.{child}", 0) for child, _ in module.named_children())
        own[module] = max(inclusive.get(key, 0) - children, 0)
    return own, calls


def install_waits(model: nn.Module, example: torch.Tensor, seconds: float) -> dict[str, float]:
    """Hooks that make one forward + backward of ``model`` at ``example``'s shape wait ``seconds`` in all,
    a forward wait and twice that in backward per module call, split by each module's own FLOPs; returns
    each waiting module's forward wait per call, by name."""
    own, calls = own_flops(model, example)
    total = sum(own.values())
    if total == 0:
        raise ValueError("the model's forward counted no FLOPs: nothing to split the waits by")
    forward_s = seconds / (1.0 + BACKWARD_PER_FORWARD)
    names = {module: name for name, module in model.named_modules()}
    waits = {}
    for module, flops in own.items():
        if flops == 0:
            continue
        wait = waits[names[module]] = forward_s * flops / total / calls[module]

        def after(m: nn.Module, args: tuple, output: object, wait: float = wait) -> object:
            return _waited(output, wait)

        module.register_forward_hook(after)
    return waits


def _waited(output: object, wait: float) -> object:
    """``output`` with its first grad-requiring tensor passed through a wait (a plain sleep without one)."""
    if isinstance(output, torch.Tensor) and output.requires_grad:
        return _Wait.apply(output, wait, wait * BACKWARD_PER_FORWARD)
    if isinstance(output, tuple):
        for i, item in enumerate(output):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return (*output[:i], _Wait.apply(item, wait, wait * BACKWARD_PER_FORWARD), *output[i + 1:])
    time.sleep(wait)
    return output


def off_cpu(workload: Workload, seconds: float, positions: int | None = None) -> Workload:
    """``workload`` with its compute waiting ``seconds`` per iteration on the emulated accelerator and run
    for real on the first sample of each batch (and its first ``positions`` along dimension 1, for a
    sequence model); see the module docstring."""
    example, _ = workload.make_batch(0, 0)
    install_waits(workload.model, example, seconds)

    def first_sample(rank: int, step: int) -> Batch:
        x, y = workload.make_batch(rank, step)
        if positions is None:
            return x[:1], y[:1]
        return x[:1, :positions], y[:1, :positions]

    return workload._replace(make_batch=first_sample, batch_size=1)
