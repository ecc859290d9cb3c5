"""Rank functions for the periodic averaging tests (``PoseidonDDP(sync_every=H, outer=...)``); the
single-process reference they are held to is ``training.periodic``."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models import ModelSpec, batch, build
from poseidon_torch import PoseidonDDP, ServerOptimizer
from poseidon_torch.integrations.resume import in_flight_state
from training import OPTIMIZERS, shard

SPEC = ModelSpec(widths=(8, 5))
NESTEROV = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})


def _steps(spec: ModelSpec, wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, world_size: int, first: int,
           last: int, size: int = 3) -> None:
    for step in range(first, last):
        opt.zero_grad()
        x, y = batch(spec, step, size, world_size)
        F.mse_loss(wrapped(shard(x, rank, size)), shard(y, rank, size)).backward()
        opt.step()


# ---- H = 1 against BSP where every operation is exact --------------------------------------------------

def _dyadic_model() -> nn.Module:
    """A linear layer whose weights are multiples of 1/4: with inputs in {-1, 0, 1}, integer targets, a
    learning rate of 1/8 and a batch of 2 x 2 outputs per rank, every gradient and every inner SGD step
    of the first few steps is exact (each adds 5 bits after the point: the mean over 4 outputs, the
    learning rate, the average over 2 ranks)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape) / 4)
    return model


def _dyadic_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(-1, 2, (2, 4), generator=g).float(), torch.randint(-2, 3, (2, 2), generator=g).float()


def exact_h1_against_bsp(rank: int, world_size: int, steps: int) -> dict:
    """Plain SGD (lr 1/8) on the dyadic model: BSP, and DiLoCo with H = 1 and an outer SGD of lr 1 (and
    local SGD with H = 1): every rank's final parameters."""
    results = {}
    for name, options in (("bsp", {}), ("diloco", {"sync_every": 1, "outer": (torch.optim.SGD, {"lr": 1.0})}),
                          ("local", {"sync_every": 1})):
        model = _dyadic_model()
        wrapped = PoseidonDDP(model, timeout=60, **options)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.125)
        for step in range(steps):
            opt.zero_grad()
            x, y = _dyadic_batch(step, rank)
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
        wrapped.close()
        results[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return results


# ---- checkpoints -----------------------------------------------------------------------------------------

def checkpoint_resume(rank: int, world_size: int, options: dict, optimizer: str, stop: int, steps: int) -> dict:
    """``steps`` steps straight, and ``stop`` steps, a checkpoint (this rank's model and inner optimizer
    state, the consistency state) restored into a new model (other initial values), wrapper and optimizer,
    then the rest: both final states, the consistency state saved, and what the integrations would save."""
    cls, kwargs = OPTIMIZERS[optimizer]

    def fresh(seed: int):
        model = build(SPEC, seed=seed)
        wrapped = PoseidonDDP(model, timeout=60, **options)
        return model, wrapped, cls(wrapped.parameters(), **kwargs)

    model, wrapped, opt = fresh(SPEC.seed)
    _steps(SPEC, wrapped, opt, rank, world_size, 0, steps)
    straight = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.close()

    model, wrapped, opt = fresh(SPEC.seed)
    _steps(SPEC, wrapped, opt, rank, world_size, 0, stop)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
             "consistency": wrapped.consistency_state_dict()}
    integrations = in_flight_state(wrapped)
    wrapped.close()
    model, wrapped, opt = fresh(SPEC.seed + 1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    wrapped.load_consistency_state_dict(saved["consistency"])
    _steps(SPEC, wrapped, opt, rank, world_size, stop, steps)
    resumed = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.close()
    return {"straight": straight, "resumed": resumed, "saved": saved["consistency"],
            "integrations_saved": integrations is not None}


def bad_states(rank: int, world_size: int) -> dict:
    """What loading wrong consistency states into a DiLoCo wrapper raises, and that a refused load changed
    nothing (the state saved before and after the attempts is the same)."""
    model = build(SPEC, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, sync_every=3, outer=NESTEROV)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    _steps(SPEC, wrapped, opt, rank, world_size, 0, 4)
    good = wrapped.consistency_state_dict()
    entry = good["periodic"]
    cases = {
        "bsp state": {"delay": 0},
        "other H": {"delay": 0, "periodic": {**entry, "sync_every": 2}},
        "local sgd state": {"delay": 0, "periodic": {**entry, "mode": "local-sgd"}},
        "bad steps": {"delay": 0, "periodic": {**entry, "steps": -1}},
        "missing start": {"delay": 0, "periodic": {**entry, "start": {"head.weight": entry["start"]["head.weight"]}}},
        "bad shape": {"delay": 0, "periodic": {**entry, "start": {**entry["start"], "head.bias": torch.zeros(7)}}},
        "no start mid-round": {"delay": 0, "periodic": {**entry, "start": None}},
        "start at a round's end": {"delay": 0, "periodic": {**entry, "steps": 6}},  # H = 3
    }
    errors = {}
    for case, state in cases.items():
        try:
            wrapped.load_consistency_state_dict(state)
            errors[case] = None
        except ValueError as exc:
            errors[case] = str(exc)
    after = wrapped.consistency_state_dict()
    wrapped.close()

    bsp = PoseidonDDP(build(SPEC, seed=0), timeout=60)
    try:
        bsp.load_consistency_state_dict(good)
        errors["into bsp"] = None
    except ValueError as exc:
        errors["into bsp"] = str(exc)
    bsp.close()
    unchanged = after["periodic"]["steps"] == entry["steps"] and all(
        torch.equal(after["periodic"]["start"][n], t) for n, t in entry["start"].items())
    return {"errors": errors, "unchanged": unchanged}



def bad_flight_states(rank: int, world_size: int) -> dict:
    """DiLoCo with H = 3, delay = 2, 4 steps (the first sync in flight): what loading a wrong in-flight state
    raises, and whether the state saved after the attempts equals the one before."""
    model = build(SPEC, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, sync_every=3, outer=NESTEROV, delay=2)
    _steps(SPEC, wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05), rank, world_size, 0, 4)
    good = wrapped.consistency_state_dict()
    entry, flight = good["periodic"], good["periodic"]["in_flight"]
    cases = {
        "saved without a delay": {**good, "delay": 0},
        "no sync in flight": {**good, "periodic": {k: v for k, v in entry.items() if k != "in_flight"}},
        "in flight when none flies": {**good, "periodic": {**entry, "steps": 5}},
        "sent of one parameter": {**good, "periodic": {**entry, "in_flight": {
            **flight, "sent": {"head.weight": flight["sent"]["head.weight"]}}}},
        "average of a bad shape": {**good, "periodic": {**entry, "in_flight": {
            **flight, "averages": {**flight["averages"], "head.bias": torch.zeros(7)}}}},
        "an unknown key": {**good, "periodic": {**entry, "in_flight": {**flight, "lands": 5}}},
    }
    errors = {case: _error_of(lambda: wrapped.load_consistency_state_dict(state)) for case, state in cases.items()}
    after = wrapped.consistency_state_dict()
    wrapped.close()
    unchanged = after["periodic"]["steps"] == entry["steps"] and all(
        torch.equal(after["periodic"]["in_flight"][what][n], t)
        for what in ("sent", "averages") for n, t in flight[what].items())
    return {"errors": errors, "unchanged": unchanged}


def resume_with_another_outer(rank: int, world_size: int) -> dict:
    """A DiLoCo state (Nesterov outer, mid-round) loaded by a wrapper whose outer= differs (another class,
    another lr): what the load raises, and whether that wrapper's outer state changed."""
    model = build(SPEC, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, sync_every=2, outer=NESTEROV)
    _steps(SPEC, wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05), rank, world_size, 0, 3)
    saved = wrapped.consistency_state_dict()
    wrapped.close()
    outcomes = {}
    for case, outer in {"adam": (torch.optim.Adam, {"lr": 0.01}),
                        "lr": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "nesterov": True})}.items():
        other = PoseidonDDP(build(SPEC, seed=0), timeout=60, sync_every=2, outer=outer)
        opt = torch.optim.SGD(other.parameters(), lr=0.05)
        _steps(SPEC, other, opt, rank, world_size, 0, 2)  # one outer step: its state holds something
        before = other.consistency_state_dict()
        error = _error_of(lambda: other.load_consistency_state_dict(saved))
        after = other.consistency_state_dict()
        other.close()
        outcomes[case] = {"error": error, "unchanged": repr(after) == repr(before)}
    return outcomes

# ---- refusals ----------------------------------------------------------------------------------------

def _error_of(make) -> tuple[str, str] | None:
    try:
        make()
    except (TypeError, ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def constant_buffer(rank: int, world_size: int) -> bool:
    """A float buffer that never changes (random values, as rotary frequencies), through 2 syncs of local
    SGD: whether it is still the same bits."""
    model = build(SPEC, seed=0)
    model.register_buffer("frequencies", torch.rand(512, generator=torch.Generator().manual_seed(0)))
    before = model.frequencies.clone()
    wrapped = PoseidonDDP(model, timeout=60, sync_every=2)
    _steps(SPEC, wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05), rank, world_size, 0, 4)
    wrapped.close()
    return torch.equal(model.frequencies, before)


def refusals(rank: int, world_size: int) -> dict:
    """Each bad option or combination, built on every rank: the exception it raised (None: accepted)."""
    def wrap(**options):
        return PoseidonDDP(build(SPEC, seed=0), timeout=60, **options)

    cases = {
        "sync_every=0": lambda: wrap(sync_every=0),
        "sync_every=-2": lambda: wrap(sync_every=-2),
        "sync_every=True": lambda: wrap(sync_every=True),
        "sync_every=2.0": lambda: wrap(sync_every=2.0),
        "outer without sync_every": lambda: wrap(outer=NESTEROV),
        "outer an optimizer": lambda: wrap(sync_every=2, outer=torch.optim.SGD(build(SPEC, 0).parameters(), lr=1.0)),
        "outer not an optimizer": lambda: wrap(sync_every=2, outer=(nn.Linear, {})),
        "outer bad lr": lambda: wrap(sync_every=2, outer=(torch.optim.SGD, {"lr": -1.0})),
        "outer bad argument": lambda: wrap(sync_every=2, outer=functools.partial(torch.optim.SGD, lr=0.7, nesterov=True)),
        "delay above H": lambda: wrap(sync_every=2, delay=3),
        "fragments not dividing H": lambda: wrap(sync_every=4, fragments=3),
        "delay above H / fragments": lambda: wrap(sync_every=4, fragments=2, delay=3),
        "fragments without sync_every": lambda: wrap(fragments=2),
        "more fragments than buckets": lambda: wrap(sync_every=4, fragments=4)(batch(SPEC, 0, 3, world_size)[0]),
        # (SPEC has 3 layers: 3 buckets at most, whatever the cap)
        "delay not an int": lambda: wrap(sync_every=2, delay=1.0),
        "SFB override": lambda: wrap(sync_every=2, fusion_bytes=0, overrides={"head": "SFB"}),
        "compression with local SGD": lambda: wrap(sync_every=2, compression="int8"),
        "two compressions": lambda: wrap(sync_every=2, outer=NESTEROV, compression=["int8", "bf16"]),
        "compression and overrides": lambda: wrap(sync_every=2, outer=NESTEROV, compression="int8", fusion_bytes=0,
                                                  overrides={"head": "allreduce"}),
        "compression start_iter": lambda: wrap(sync_every=2, outer=NESTEROV,
                                               compression={"powersgd": {"rank": 1, "start_iter": 10}}),
        "lossy override": lambda: wrap(sync_every=2, fusion_bytes=0, overrides={"head": "BF16"}),
    }
    errors = {case: _error_of(make) for case, make in cases.items()}

    wrapped = wrap(sync_every=2)
    errors["ServerOptimizer"] = _error_of(lambda: ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1))
    errors["join"] = _error_of(lambda: wrapped.join())
    wrapped.close()
    return errors


class Sharpness(torch.optim.Optimizer):
    """An optimizer whose step() calls the step() of another one it built over the same parameters, as
    SAM (its second step), ZeroRedundancyOptimizer and other wrappers do: here plain SGD's step."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {})
        self.base = torch.optim.SGD(self.param_groups, lr=lr)
        self.param_groups = self.base.param_groups

    def step(self, closure=None):
        return self.base.step(closure)


def optimizer_steps(rank: int, world_size: int) -> dict:
    """How steps are counted: a subclass whose step() calls super().step(), and a wrapper whose step()
    calls the wrapped optimizer's, count once per call (syncs after 2 of them with sync_every=2; the
    wrapper's parameters are those of plain SGD under the same loop); a second optimizer over the
    parameters is refused."""
    class Wrapping(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch hooks SGD.step itself from now on
    out: dict = {}
    for name, cls in (("sgd", torch.optim.SGD), ("subclass", Wrapping), ("wrapper", Sharpness)):
        model = build(SPEC, seed=0)
        wrapped = PoseidonDDP(model, timeout=60, sync_every=2)
        opt = cls(wrapped.parameters(), lr=0.05)
        syncs, error = [], None
        try:
            for step in range(4):
                _steps(SPEC, wrapped, opt, rank, world_size, step, step + 1)
                syncs.append(wrapped.comm_stats.iterations)
        except RuntimeError as exc:
            error = str(exc)
        out[name] = {"syncs": syncs, "error": error, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        if name == "subclass":
            out["second"] = _error_of(torch.optim.SGD(wrapped.parameters(), lr=0.05).step)
        wrapped.close()
    return out


def peer_exits_before_a_sync(rank: int, world_size: int) -> dict:
    """sync_every=2: both ranks take step 1 (local), then rank 1 dies; rank 0's step 2 must fail within the
    timeout, keep its own round end in the parameters, and refuse the next forward."""
    import os
    import time

    model = build(SPEC, seed=0)
    wrapped = PoseidonDDP(model, timeout=10, sync_every=2)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    _steps(SPEC, wrapped, opt, rank, world_size, 0, 1)
    if rank == 1:
        os._exit(3)
    opt.zero_grad()
    x, y = batch(SPEC, 1, 3, world_size)
    F.mse_loss(wrapped(shard(x, rank, 3)), shard(y, rank, 3)).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    start, error = time.monotonic(), None
    try:
        opt.step()
    except Exception as exc:  # the test inspects type and message
        error = exc
    elapsed = time.monotonic() - start
    stepped = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    try:
        wrapped(shard(x, rank, 3))
        after = "forward ran"
    except Exception as exc:
        after = f"{type(exc).__name__}: {exc}"
    return {"error_type": type(error).__name__ if error else None, "error": str(error), "elapsed": elapsed,
            "stepped": stepped, "next_forward": after}


def closure_optimizer(rank: int, world_size: int) -> dict:
    """LBFGS (its closure runs the first forward inside the first step(), before the engine exists) under
    DiLoCo with an outer SGD of lr 1 (whose outer step gives the average of the round ends) and under local
    SGD, H = 2, 4 steps: the syncs after each step and every rank's final parameters."""
    results = {}
    for name, options in (("diloco", {"outer": (torch.optim.SGD, {"lr": 1.0})}), ("local", {})):
        model = build(SPEC, seed=0)
        wrapped = PoseidonDDP(model, timeout=60, sync_every=2, **options)
        opt = torch.optim.LBFGS(wrapped.parameters(), lr=0.1, max_iter=3)
        syncs = []
        for step in range(4):
            x, y = batch(SPEC, step, 3, world_size)

            def closure():
                opt.zero_grad()
                loss = F.mse_loss(wrapped(shard(x, rank, 3)), shard(y, rank, 3))
                loss.backward()
                return loss

            opt.step(closure)
            syncs.append(wrapped.comm_stats.iterations)
        wrapped.close()
        results[name] = {"syncs": syncs, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return results


def synchronize_mid_round(rank: int, world_size: int, options: dict) -> dict:
    """5 steps of SGD (H = 4: mid-round, maybe a sync in flight), then ``end_round()``: every rank's
    parameters before (gathered, so the test can average them) and after; then 3 more steps and a second
    ``end_round()`` at a round's end: the parameters after it."""
    import torch.distributed as dist

    model = build(SPEC, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, **options)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    _steps(SPEC, wrapped, opt, rank, world_size, 0, 5)
    wrapped.consistency_state_dict()  # settles a sync in flight (its average is kept, not applied)
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    wrapped.end_round()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    _steps(SPEC, wrapped, opt, rank, world_size, 5, 8)
    wrapped.end_round()
    later = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped.close()
    return {"before": everyone, "after": after, "later": later}


# ---- a lossy outer sync: DiLoCo's pseudo-gradients compressed, with error feedback ----------------------

def lossy_outer_sync(rank: int, world_size: int, compression: str | None, h: int, steps: int) -> dict:
    """fp64 DiLoCo with an outer SGD of lr 1 (local SGD on pseudo-gradients), H = ``h``, AdamW inside, the
    outer syncs on ``compression``'s path: each round's start (the same on every rank), this rank's
    pseudo-gradient (start minus its parameters after the round's last inner step, read by a step hook
    registered before the wrapper's, so before the sync), its final error-feedback residuals, the bytes
    each sync sent by path, and the plan's paths."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = build(SPEC, seed=0).double()
    wrapped = PoseidonDDP(model, timeout=60, sync_every=h, outer=(torch.optim.SGD, {"lr": 1.0}),
                          **({"compression": compression} if compression else {}))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    params = dict(model.named_parameters())
    starts = [{n: p.detach().clone() for n, p in params.items()}]
    pseudo, taken, sent = [], [0], []

    def before_the_sync(optimizer, args, kwargs) -> None:
        if optimizer is not opt:  # the outer optimizer's step, inside the sync
            return
        taken[0] += 1
        if taken[0] % h == 0:
            pseudo.append({n: starts[-1][n] - p.detach() for n, p in params.items()})

    hook = register_optimizer_step_post_hook(before_the_sync)
    try:
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(SPEC, step, 3, world_size)
            F.mse_loss(wrapped(shard(x, rank, 3).double()), shard(y, rank, 3).double()).backward()
            opt.step()
            if (step + 1) % h == 0:
                starts.append({n: p.detach().clone() for n, p in params.items()})
                sent.append(dict(wrapped.comm_stats.bytes_by_path))
    finally:
        hook.remove()
    state = wrapped.consistency_state_dict()
    paths = state.get("paths", {"ranks": [{}] * world_size})["ranks"][rank]
    residuals = {n: t for kept in paths.values() for n, t in kept.get("residual", {}).items()}
    plan = set(wrapped.plan.paths().values())
    wrapped.close()
    return {"starts": starts, "pseudo": pseudo, "residuals": residuals, "sent": sent, "plan": plan}


def non_finite_round(rank: int, world_size: int, compression: str | None) -> dict:
    """DiLoCo (H = 2, plain SGD inside) whose rank 1 gets an inf in a parameter after step 3 (a diverged
    replica): whether each parameter is finite at the end, and this rank's residuals."""
    model = build(SPEC, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, sync_every=2, outer=NESTEROV, fusion_bytes=0,
                          **({"compression": compression} if compression else {}))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    _steps(SPEC, wrapped, opt, rank, world_size, 0, 3)
    if rank == 1:
        with torch.no_grad():
            model.body[0].weight.view(-1)[0] = float("inf")
    _steps(SPEC, wrapped, opt, rank, world_size, 3, 4)
    paths = wrapped.consistency_state_dict().get("paths", {"ranks": [{}] * world_size})["ranks"][rank]
    wrapped.close()
    return {"finite": {n: bool(torch.isfinite(p).all()) for n, p in model.named_parameters()},
            "residuals": {n: t for kept in paths.values() for n, t in kept.get("residual", {}).items()}}
