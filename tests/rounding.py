"""How far Adam can carry the rounding of an average: the tolerance the arithmetic allows.

PoseidonDDP's KV store sums the P ranks' gradients in rank order and divides once; torch DDP divides
each rank's gradient by P and lets gloo sum them in its ring order. Both are exact to fp32 rounding, and
for one element the two results differ by at most ``delta = 2 u sum_r |g_r|`` (u = 2**-24: (P - 1)
roundings of a sum in each order, and the divisions). SGD (with momentum, nesterov, weight decay) is
linear in the gradient, so that difference stays at rounding level in the parameters. Adam is not: it
divides by the gradient's own running size, so where the ranks' gradients nearly cancel (sum |g_r| much
larger than |sum g_r|), a rounding-level difference in the sum is a large relative difference in the
update (seen: a cancellation of 7.5e4 moved a weight by 1.2e-6 after 4 AdamW steps at lr 0.01).

:func:`adam_slack` replays the training run in one process (the anchors' trajectory), records every
step's per-rank gradients, and propagates ``delta`` to first order through Adam's update: at step T,
``|du_T| <= sum_s |d u_T / d g_s| delta_s`` over the steps s <= T whose gradients the moments hold,
summed over the steps times each step's lr. Where the ranks' gradients do not cancel it is far below the tests'
atol; it loosens only the elements where the arithmetic itself cannot promise more.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models import ModelSpec, batch, build
from training import OPTIMIZERS, param_groups, shard

UNIT_ROUNDOFF = 2.0 ** -24


def adam_slack(spec: ModelSpec, optimizer: str, steps: int, size: int, world_size: int, groups: str = "one",
               schedule: bool = False) -> dict[str, torch.Tensor]:
    """Per parameter name, the first-order bound on how far two valid fp32 orders of the rank sum can
    move the parameters of :func:`training.train`'s run (zeros for non-adaptive optimizers)."""
    torch.manual_seed(0)
    model = build(spec, seed=spec.seed)
    names = {id(p): n for n, p in model.named_parameters()}
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(param_groups(model, groups) or model.parameters(), **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    slack = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return slack
    history: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in slack}  # (g_s, delta_s)
    for step in range(steps):
        x, y = batch(spec, step, size, world_size)
        parts = [_local_grads(model, shard(x, r, size), shard(y, r, size)) for r in range(world_size)]
        for p in model.parameters():
            p.grad = sum(part[id(p)] for part in parts) / world_size if p.requires_grad else None
        opt.step()
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                name = names[id(p)]
                decay = group["weight_decay"] * p.detach().double() if cls is torch.optim.Adam else 0.0
                delta = 2 * UNIT_ROUNDOFF * sum(part[id(p)].double().abs() for part in parts)
                history[name].append((p.grad.double() + decay, delta))
                slack[name] += group["lr"] * _update_sensitivity(opt.state[p], group, history[name])
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return slack


def _update_sensitivity(state: dict, group: dict, history: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``sum_s |d u_T / d g_s| delta_s`` for Adam's update u_T = m_hat / (sqrt(v_hat) + eps) at this
    step T, with ``history`` the (g_s, delta_s) of steps 1..T: each partial derivative combines the
    moment and the normaliser before its absolute value (at T = 1 the update is g / |g|, insensitive
    to g's size, and the bound says so)."""
    (beta1, beta2), eps = group["betas"], group["eps"]
    t = len(history)
    m_hat = state["exp_avg"].double() / (1 - beta1 ** t)
    root = (state["exp_avg_sq"].double() / (1 - beta2 ** t)).sqrt()
    total = torch.zeros_like(m_hat)
    for s, (grad, delta) in enumerate(history, start=1):
        a = (1 - beta1) * beta1 ** (t - s) / (1 - beta1 ** t)
        c = (1 - beta2) * beta2 ** (t - s) / (1 - beta2 ** t)
        partial = a / (root + eps) - m_hat * c * grad / (root.clamp_min(1e-30) * (root + eps) ** 2)
        total += partial.abs() * delta
    return total


def _local_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[int, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    return {id(p): p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()}


def assert_close_within_slack(ours: torch.Tensor, theirs: torch.Tensor, slack: torch.Tensor, rtol: float,
                              atol: float, what: str) -> None:
    """``|ours - theirs| <= atol + rtol |theirs| + slack``, element by element."""
    excess = (ours.double() - theirs.double()).abs() - (atol + rtol * theirs.double().abs() + slack)
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{what}: element {worst} is {float(ours.reshape(-1)[worst])} against "
                               f"{float(theirs.reshape(-1)[worst])} (rounding slack {float(slack.reshape(-1)[worst]):.3g})")
