"""Rank functions for the parameter-server mode tests: ``fn(rank, world_size, *args)``."""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import training
from models import ModelSpec, batch, build
from poseidon_torch import PoseidonDDP, ServerOptimizer
from training import OPTIMIZERS, BadBatch, Run, poseidon_options, shard


def make_optimizer(wrapped: nn.Module, model: nn.Module, wrapper: str, name: str, lazy: bool):
    """``name``'s optimizer for ``wrapper`` ("server": a ServerOptimizer, lazy pulls or not)."""
    return training.make_optimizer(wrapped, model, Run(wrapper=wrapper, optimizer=name, server={"lazy_pull": lazy}))


def full_state_bytes(spec: ModelSpec, optimizer: str) -> int:
    """Bytes of the optimizer state of one step of the whole model, on one process."""
    model = build(spec, seed=spec.seed)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    x, y = batch(spec, 0, 2, 1)
    F.mse_loss(model(x), y).backward()
    opt.step()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def delayed_pulls(rank: int, world_size: int, delay_s: float) -> dict:
    """Lazy pulls whose jobs gather and pull ``delay_s`` late: the training loop's ``zero_grad()`` must
    not take the gradients from under the job, and the next forward must wait per layer. Returns both
    runs' final states and the seconds this rank's forwards waited for new values."""
    spec = ModelSpec(widths=(16, 16), out_features=4)
    states, waited = {}, 0.0
    for wrapper in ("server", "ddp"):
        model = build(spec, seed=1)
        wrapped = PoseidonDDP(model, timeout=60, hybrid=False, fusion_bytes=0) if wrapper == "server" else DDP(model)
        opt = make_optimizer(wrapped, model, wrapper, "adamw-decay", lazy=True)
        for step in range(4):
            if wrapper == "server" and step == 1:  # the buckets are learned: slow every pull from now on
                slow(server_job(wrapped.engine, "PS"), ("network", "update"), delay_s)  # late to push, late to pull
            x, y = batch(spec, step, 2, world_size)
            start = time.monotonic()
            out = wrapped(shard(x, rank, 2))
            if wrapper == "server" and step > 1:
                waited += time.monotonic() - start
            F.mse_loss(out, shard(y, rank, 2)).backward()
            opt.step()
            opt.zero_grad()
        states[wrapper] = final_state(wrapped, model)
    return {**states, "waited_in_forward": waited}


GRAD_EDITS = {  # what training loops do to .grad between backward() and step()
    "zero_in_place": lambda params: [p.grad.zero_() for p in params if p.grad is not None],
    "clip_grad_norm_": lambda params: torch.nn.utils.clip_grad_norm_(params, 1e-3),
    "set_to_none": lambda params: [setattr(p, "grad", None) for p in params],
    "rescale": lambda params: [p.grad.mul_(100.0) for p in params if p.grad is not None],
}


def grad_edit_after_backward(rank: int, world_size: int, edit: str, lazy: bool, force: str) -> dict:
    """ServerOptimizer with sync jobs slowed before they read anything, so that from the second step
    (buckets learned: backward() returns while its jobs run) they run after backward() returned; the
    loop edits ``.grad`` right after backward(). The documented contract: the update already used this
    step's average, so the edit has no effect: the parameters are those of DDP + the same optimizer
    without the edit, whatever the timing."""
    spec = ModelSpec(widths=(16, 16), out_features=4)
    states = {}
    for wrapper in ("server", "ddp"):
        model = build(spec, seed=1)
        options = {"hybrid": False, "fusion_bytes": 0} if force == "PS" else {"force": "SFB", "fusion_bytes": 0}
        wrapped = PoseidonDDP(model, timeout=60, **poseidon_options(model, options)) if wrapper == "server" else DDP(model)
        opt = make_optimizer(wrapped, model, wrapper, "adamw-decay", lazy=lazy)
        if wrapper == "server":
            slow(server_job(wrapped.engine, "PS"), ("network",), 0.05)
            slow(wrapped.engine.paths["SFB"], ("gather",), 0.05)
        for step in range(4):
            x, y = batch(spec, step, 2, world_size)
            F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
            if wrapper == "server":
                GRAD_EDITS[edit](list(model.parameters()))
            opt.step()
            opt.zero_grad()
        if wrapper == "server":
            states["outcomes"] = dict(wrapped.comm_stats.outcome_by_bucket)
        states[wrapper] = final_state(wrapped, model)
    return states


def final_state(wrapped: nn.Module, model: nn.Module) -> dict:
    """The model's state after the last step (a PoseidonDDP is synchronized and closed first)."""
    if isinstance(wrapped, PoseidonDDP):
        wrapped.synchronize()
        wrapped.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoint_phase(rank: int, world_size: int, spec: ModelSpec, path: str, phase: str) -> dict:
    """``save``: train 3 steps, consolidate and save model and optimizer (rank 0). ``resume`` (new
    processes): an uninterrupted run of 6 steps, and a run that loads the checkpoint and does 3 more."""
    import torch.distributed as dist

    def run(steps: range, load: bool) -> dict:
        model = build(spec, seed=spec.seed)
        wrapped = PoseidonDDP(model, timeout=60)
        opt = ServerOptimizer(wrapped, torch.optim.AdamW, lr=0.01, weight_decay=0.05)
        if load:
            checkpoint = torch.load(path, weights_only=False)
            wrapped.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        for step in steps:
            x, y = batch(spec, step, 2, world_size)
            F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
            opt.step()
            opt.zero_grad()
        if phase == "save":
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                torch.save({"model": wrapped.state_dict(), "optimizer": opt.state_dict()}, path)
            dist.barrier()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        wrapped.close()
        return state

    if phase == "save":
        run(range(3), load=False)
        return {}
    return {"uninterrupted": run(range(6), load=False), "resumed": run(range(3, 6), load=True)}


def refusals(rank: int, world_size: int) -> dict:
    """Each misuse gives a clear error on every rank, and training goes on afterwards."""
    spec = ModelSpec(widths=(8,))
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60)
    errors = {}

    def capture(name, fn):
        try:
            fn()
            errors[name] = "no error"
        except (TypeError, ValueError, RuntimeError) as exc:
            errors[name] = str(exc)

    capture("lbfgs", lambda: ServerOptimizer(wrapped, torch.optim.LBFGS, lr=0.1))
    capture("subset", lambda: ServerOptimizer(wrapped, torch.optim.SGD, [next(model.parameters())], lr=0.1))
    outside = torch.nn.Parameter(torch.ones(1))
    capture("outside", lambda: ServerOptimizer(wrapped, torch.optim.SGD, [*model.parameters(), outside], lr=0.1))
    capture("per_rank_lr", lambda: ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1 * (1 + rank)))
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1)
    capture("add_group", lambda: opt.add_param_group({"params": [outside]}))
    capture("join", lambda: wrapped.join())
    x, y = batch(spec, 0, 2, world_size)
    for step in range(2):
        out = wrapped(shard(x, rank, 2))
        loss = F.mse_loss(out, shard(y, rank, 2))
        loss.backward(retain_graph=True)
    capture("second_backward", lambda: loss.backward())
    opt.step()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2))).backward()
    capture("grad_scaler", lambda: scaler.step(opt))
    opt.step()
    F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
    opt.step()
    errors["after"] = "trained"
    wrapped.close()
    return errors


def lazy_writes(rank: int, world_size: int) -> dict:
    """With lazy pulls: loading an earlier state after step() wins over the pending values (as it would
    after a plain optimizer's step); an in-place write to a parameter while its value is pending is a
    clear error, not a silent overwrite."""
    spec = ModelSpec(widths=(8,))
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, lazy_pull=True)
    x, y = batch(spec, 0, 2, world_size)

    def step() -> None:
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    earlier = {k: v.clone() for k, v in wrapped.state_dict().items()}
    step()
    wrapped.load_state_dict(earlier)
    with torch.no_grad():
        rolled_back = all(torch.equal(wrapped(x[:1]), model_at(spec, earlier)(x[:1])) for _ in range(1))
    step()
    with torch.no_grad():
        next(model.parameters()).clamp_(-0.1, 0.1)
    try:
        wrapped(shard(x, rank, 2))
        error = "no error"
    except RuntimeError as exc:
        error = str(exc)
    wrapped.close()
    return {"rolled_back": rolled_back, "error": error}


def model_at(spec: ModelSpec, state: dict) -> nn.Module:
    model = build(spec, seed=0)
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    return model


class AttentionNet(nn.Module):
    """nn.MultiheadAttention reads its out_proj's weight itself (out_proj's forward never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a + h)


def attention_lazy(rank: int, world_size: int, fusion_bytes: int) -> dict:
    """Lazy pulls on a model with attention, against DDP + the same optimizer (SGD: MultiheadAttention's
    key bias has an exactly zero gradient, which Adam would amplify from summation noise)."""
    states = {}
    for wrapper in ("server", "ddp"):
        torch.manual_seed(3)
        model = AttentionNet()
        wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=fusion_bytes) if wrapper == "server" else DDP(model)
        opt = make_optimizer(wrapped, model, wrapper, "nesterov", lazy=True)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(2 * world_size, 5, 6, generator=g), torch.randn(2 * world_size, 5, 3, generator=g)
            F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
            opt.step()
            opt.zero_grad()
        if wrapper == "server":
            wrapped.close()
        states[wrapper] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states


def watched(path_class: type, before=None, after=None) -> type:
    """``path_class`` whose jobs call ``before(phase, bucket)`` as each phase is reached and
    ``after(phase, bucket)`` when the job resumes from it."""

    class Watched(path_class):
        def sync(self, bucket, groups, ctx):
            phases = super().sync(bucket, groups, ctx)
            while True:
                try:
                    phase = next(phases)
                except StopIteration as stop:
                    return stop.value
                if before is not None:
                    before(phase, bucket)
                yield phase
                if after is not None:
                    after(phase, bucket)

    return Watched


def slowed(path_class: type, phase_names: tuple[str, ...], seconds: float) -> type:
    """``path_class`` whose jobs pause ``seconds`` when they reach any of ``phase_names``."""
    return watched(path_class, before=lambda phase, bucket: time.sleep(seconds) if phase in phase_names else None)


def slow(job, phase_names: tuple[str, ...], seconds: float) -> None:
    """From now on ``job`` (a path, or a mode's job) pauses ``seconds`` when it reaches any of ``phase_names``."""
    job.__class__ = slowed(type(job), phase_names, seconds)


def server_job(engine, path: str):
    """The job the engine runs in parameter-server mode for the buckets on ``path`` (one object per path)."""
    return engine.mode.job(engine.paths[path])


def caught_exception_mid_sync(rank: int, world_size: int, path: str, server: bool, bad_step: int = 1) -> dict:
    """Every layer on ``path``; at ``bad_step`` a hook on the first layer raises (a bad batch, caught on
    every rank) while the other layers' slowed-down jobs still run: nothing of that step may reach the
    parameters, as with DDP skipping the batch (the jobs finish after the user's zero_grad()). At step 0
    no optimizer state exists yet: the skipped step must not leave any behind."""
    states = {}
    for wrapper in ("poseidon", "ddp"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        if wrapper == "ddp":
            wrapped, opt = DDP(model), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        elif path == "SFB":
            wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=0, overrides={"0": "SFB", "2": "SFB", "4": "SFB"})
        else:  # the Python core runs PS jobs through the engine's PS path (the native core in C++)
            wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=0, hybrid=False, engine="python")
        if wrapper == "poseidon":
            # momentum: the skipped step must leave the optimizer state alone too, not only the values
            opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, momentum=0.9) if server else \
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            # its jobs slowed (the engine starts here, after the optimizer is built: the mode is fixed then)
            slow(wrapped.engine.paths[path], ("rebuild",) if path == "SFB" else ("network",), 0.1)
        bad = BadBatch()
        model[0].weight.register_hook(bad)
        for step in range(3):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            bad.now = step == bad_step
            if wrapper == "ddp" and step == bad_step:
                continue  # the reference skips the bad batch
            loss = F.mse_loss(wrapped(x), y)
            try:
                loss.backward()
            except ValueError:
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        states[wrapper] = final_state(wrapped, model)
    return states


def recording_updates(path_class: type, log: list) -> type:
    """``path_class`` whose jobs append their bucket's index to ``log`` when their update begins (for a
    split job: when its second slot, the update and the pull, begins)."""
    return watched(path_class, after=lambda phase, bucket: log.append(bucket.index) if phase == "update" else None)


def pulls_in_order(rank: int, world_size: int, steps: int) -> dict:
    """Lazy pulls with sync jobs slow enough that every bucket still syncs when backward ends: once the
    buckets are learned and three passes watched, the pulls must run input side first. Returns both
    runs' final states, the channel plan and, per step, the order in which this rank's updates (and
    pulls) began."""
    spec = ModelSpec(widths=(16, 16, 16), out_features=4)
    states, orders = {}, []
    for wrapper in ("server", "ddp"):
        model = build(spec, seed=2)
        wrapped = PoseidonDDP(model, timeout=60, hybrid=False, fusion_bytes=0) if wrapper == "server" else DDP(model)
        opt = make_optimizer(wrapped, model, wrapper, "adamw-decay", lazy=True)
        log: list[int] = []
        if wrapper == "server":
            job = server_job(wrapped.engine, "PS")
            job.__class__ = recording_updates(slowed(type(job), ("network",), 0.03), log)
        for step in range(steps):
            x, y = batch(spec, step, 2, world_size)
            out = wrapped(shard(x, rank, 2))  # the last pass has settled: its log is complete
            orders.append(list(log))
            log.clear()
            F.mse_loss(out, shard(y, rank, 2)).backward()
            opt.step()
            opt.zero_grad()
        if wrapper == "server":
            plan = wrapped.engine.plan
        states[wrapper] = final_state(wrapped, model)
    return {**states, "plan": plan, "orders": orders[1:steps]}


def clipped_behind_a_slow_push(rank: int, world_size: int, max_norm: float) -> dict:
    """Global-norm clipping where the first update's channel is ready long before the other channel's
    push ends (the output layer's push is held back 0.3 s): the norm must still cover every bucket."""
    def slow_output_push(job_class: type) -> type:
        class SlowOutputPush(job_class):
            def sync(self, bucket, groups, ctx):
                if bucket.index == 0:
                    time.sleep(0.3)
                return (yield from super().sync(bucket, groups, ctx))

        return SlowOutputPush

    states, norms = {}, {}
    for wrapper in ("server", "ddp"):
        torch.manual_seed(4)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        if wrapper == "server":
            wrapped = PoseidonDDP(model, timeout=60, hybrid=False, fusion_bytes=0)
            opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, max_grad_norm=max_norm)
            job = server_job(wrapped.engine, "PS")
            job.__class__ = slow_output_push(type(job))
        else:
            wrapped = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        norms[wrapper] = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            F.mse_loss(wrapped(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)).backward()
            if wrapper == "ddp":
                norms[wrapper].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            opt.step()
            if wrapper == "server":
                norms[wrapper].append(opt.last_grad_norm)
            opt.zero_grad()
        if wrapper == "server":
            plan = wrapped.engine.plan
        states[wrapper] = final_state(wrapped, model)
    return {**states, "norms": norms, "plan": plan}


def bad_max_grad_norm(rank: int, world_size: int) -> list[str]:
    """The errors ServerOptimizer raises for max_grad_norm values that clip nothing sensible (inf is
    taken: the norm without clipping, which the HF Trainer's tests use)."""
    messages = []
    wrapped = PoseidonDDP(nn.Linear(4, 2), timeout=60)
    for value in (0.0, -1.0, float("nan"), "1.0", [1.0], True, torch.ones(2)):
        try:
            ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, max_grad_norm=value)
            messages.append(f"accepted {value!r}")
        except ValueError as exc:
            messages.append(str(exc))
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, max_grad_norm=torch.tensor(2.0))
    try:
        opt.max_grad_norm = 0.5  # the plan of every rank depends on it: fixed at construction
        messages.append("max_grad_norm changed after construction")
    except AttributeError:
        pass
    wrapped.close()
    return messages + [f"threshold {opt.max_grad_norm}"]


def unfrozen_later(rank: int, world_size: int) -> str:
    """A layer frozen when the model was wrapped, unfrozen later: step() must refuse, naming it."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    wrapped = PoseidonDDP(model, timeout=60)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    for step in range(2):
        if step == 1:
            model[0].weight.requires_grad_(True)
        F.mse_loss(wrapped(x), y).backward()
        try:
            opt.step()
        except RuntimeError as exc:
            return str(exc)
        opt.zero_grad()
    return "no error"


def frozen_layer_and_mid_step_consolidate(rank: int, world_size: int, lazy: bool) -> dict:
    """A frozen first layer and the default param groups (every parameter of the model, as
    ``AdamW(model.parameters())``); the state consolidated between the last backward and its step(),
    then read after step(); a later backward makes that copy stale."""
    spec = ModelSpec(widths=(8, 6), out_features=3)
    results = {}
    for wrapper in ("server", "ddp"):
        model = build(spec, seed=5)
        first = next(model.parameters())
        first.requires_grad_(False)
        wrapped = PoseidonDDP(model, timeout=60) if wrapper == "server" else DDP(model)
        opt = ServerOptimizer(wrapped, torch.optim.AdamW, lr=0.01, lazy_pull=lazy) if wrapper == "server" else \
            torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(3):
            x, y = batch(spec, step, 2, world_size)
            F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
            if wrapper == "server" and step == 2:
                opt.consolidate_state_dict(to=0)
            opt.step()
            opt.zero_grad()
        state = copy.deepcopy(opt.state_dict()) if wrapper == "ddp" or rank == 0 else None  # (torch's is live)
        stale = None
        x, y = batch(spec, 3, 2, world_size)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        if wrapper == "server":
            try:
                opt.state_dict()
            except RuntimeError as exc:
                stale = str(exc)
        opt.step()
        results[wrapper] = {"optimizer": state, "stale": stale, "state": final_state(wrapped, model)}
    return results


def checkpoint_after_a_caught_exception(rank: int, world_size: int, lazy: bool, clip: float | None) -> dict:
    """SGD momentum; step 1's backward raises (caught on every rank) after the output layer's bucket
    synced (and, without clipping, was stepped by its owners); the state is consolidated right away,
    before any other forward: it must be the state after step 0, as torch's optimizer that skipped the
    batch has; with clipping, the norm of the skipped step is None at once."""
    states = {}
    for wrapper in ("server", "ddp"):
        torch.manual_seed(6)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        if wrapper == "server":
            wrapped = PoseidonDDP(model, timeout=60, hybrid=False, fusion_bytes=0)
            opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, momentum=0.9, lazy_pull=lazy, max_grad_norm=clip)
        else:
            wrapped = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        bad = BadBatch()
        model[0].weight.register_hook(bad)
        norm_in_except, waited = "unset", 0.0
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            bad.now = step == 1
            try:
                F.mse_loss(wrapped(x), y).backward()
            except ValueError:
                if wrapper == "server":
                    start = time.monotonic()
                    norm_in_except = opt.last_grad_norm
                    waited = time.monotonic() - start
                    time.sleep(0.2)  # the output layer's job, submitted before the exception, has stepped by now
                opt.zero_grad()
                continue
            if wrapper == "ddp" and clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        if wrapper == "server":
            opt.consolidate_state_dict(to=0)
        state = copy.deepcopy(opt.state_dict()) if wrapper == "ddp" or rank == 0 else None
        states[wrapper] = {"optimizer": state, "params": final_state(wrapped, model),
                           "norm_in_except": norm_in_except, "waited": waited}
    return states


def unfrozen_on_one_rank(rank: int, world_size: int) -> str:
    """A layer frozen at wrapping, unfrozen on every rank but used only by rank 0: every rank's step()
    must refuse (the decision may not depend on which rank happened to use it)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.main, self.side = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
            return self.main(x) + (self.side(x) if use_side else 0)

    model = Net()
    model.side.requires_grad_(False)
    wrapped = PoseidonDDP(model, timeout=60)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1)
    model.side.requires_grad_(True)
    F.mse_loss(wrapped(torch.randn(4, 4), use_side=rank == 0), torch.randn(4, 2)).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    finally:
        wrapped.close()
    return "no error"


def closure_and_state_dict(rank: int, world_size: int) -> dict:
    """What Lightning and accelerate call: ``step(closure)`` (forward and backward inside) gives DDP's
    parameters and returns the closure's loss; ``state_dict()`` before any step works on every rank, with
    no collective (accelerate copies the state at set-up), and loads back; after a consolidation on
    rank 0 the other ranks are told where it is."""
    spec = ModelSpec(widths=(8, 6))
    out: dict = {}
    for wrapper in ("server", "ddp"):
        model = build(spec, seed=3)
        wrapped = PoseidonDDP(model, timeout=60) if wrapper == "server" else DDP(model)
        opt = make_optimizer(wrapped, model, wrapper, "adamw-decay", lazy=False)
        if wrapper == "server":
            start = time.monotonic()
            if rank == 0:  # on one rank only: it must not wait for the others
                out["empty"] = opt.state_dict()
                opt.load_state_dict(out["empty"])
            out["empty_seconds"] = time.monotonic() - start
        losses = []
        for step in range(3):
            x, y = batch(spec, step, 2, world_size)

            def closure():
                opt.zero_grad()
                loss = F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2))
                loss.backward()
                return loss

            losses.append(float(opt.step(closure)))
        out[wrapper] = {"state": final_state(wrapped, model) if wrapper == "ddp" else None, "losses": losses}
        if wrapper == "server":
            opt.consolidate_state_dict(to=0)
            try:
                out["consolidated"] = sorted(opt.state_dict()["state"])
            except RuntimeError as exc:
                out["consolidated"] = str(exc)
            out["server"]["state"] = final_state(wrapped, model)
    return out


def resume_with_scheduler(rank: int, world_size: int) -> dict:
    """Save after 2 of 4 steps (model, ServerOptimizer, StepLR), load into fresh objects, finish: the
    parameters must be those of the uninterrupted run, and the loaded learning rate the saved one."""
    import torch.distributed as dist

    spec = ModelSpec(widths=(16,), out_features=4)

    def make() -> tuple:
        model = build(spec, seed=0)
        wrapped = PoseidonDDP(model, timeout=60, hybrid=False)
        opt = ServerOptimizer(wrapped, torch.optim.AdamW, lr=0.01)
        return model, wrapped, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def train(wrapped, opt, sched, steps: range) -> None:
        for step in steps:
            x, y = batch(spec, step, 2, world_size)
            F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    model, wrapped, opt, sched = make()
    train(wrapped, opt, sched, range(4))
    uninterrupted = final_state(wrapped, model)
    model, wrapped, opt, sched = make()
    train(wrapped, opt, sched, range(2))
    opt.consolidate_state_dict(to=0)
    saved = [{"model": wrapped.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()} if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    wrapped.close()
    model, wrapped, opt, sched = make()
    wrapped.load_state_dict(saved[0]["model"])
    opt.load_state_dict(saved[0]["opt"])
    sched.load_state_dict(saved[0]["sched"])
    loaded_lr = opt.param_groups[0]["lr"]
    train(wrapped, opt, sched, range(2, 4))
    return {"uninterrupted": uninterrupted, "resumed": final_state(wrapped, model),
            "saved_lr": saved[0]["opt"]["param_groups"][0]["lr"], "loaded_lr": loaded_lr}


def side_used_only_under_no_sync(rank: int, world_size: int) -> dict:
    """AdamW with weight decay: ``side`` is used once, in a no_sync micro-batch of step 0; afterwards no
    rank uses it, so torch leaves it alone (no .grad) and the servers must not step it either."""
    from patterns import MLP, data

    states = {}
    for wrapper in ("server", "ddp"):
        module = MLP()
        if wrapper == "server":
            model = PoseidonDDP(module, hybrid=False, timeout=60)
            opt = ServerOptimizer(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        else:
            model = DDP(module, find_unused_parameters=True)
            opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
        for step in range(4):
            x, y = data(step, rank)
            if step == 0:
                with model.no_sync():
                    F.mse_loss(model(x, use_side=True), y).backward()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        states[wrapper] = final_state(model, module)
    return states


class ReadsChildParameter(nn.Module):
    """The root's forward reads a child's parameter itself (``self.offset.bias``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.offset = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))) + self.offset.bias


def lazy_root_reads_child(rank: int, world_size: int) -> str:
    """With lazy pulls the root waits for its own parameters only: such a read must fail clearly, not
    train on last step's value."""
    from poseidon_torch import SyncError

    model = PoseidonDDP(ReadsChildParameter(), hybrid=False, fusion_bytes=0, timeout=60)
    opt = ServerOptimizer(model, torch.optim.SGD, lr=0.1, lazy_pull=True)
    try:
        for step in range(5):
            g = torch.Generator().manual_seed(10 * step + rank)
            F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)).backward()
            opt.step()
            opt.zero_grad()
    except SyncError as exc:
        return str(exc)
    finally:
        model.close()
    return "trained"


def traced_split_jobs(rank: int, world_size: int, trace_dir: str) -> dict:
    """A traced run with max_grad_norm (every job split in two slots: push, then update and pull): the
    bytes the trace gives each bucket per iteration, and the engine's own count."""
    from poseidon_torch.trace import load_spans, summarize

    spec = ModelSpec(in_features=32, widths=(64,), out_features=4)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, hybrid=False, fusion_bytes=0, timeout=60, trace_dir=trace_dir, trace_skip=2,
                          trace_iters=3)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, max_grad_norm=0.01)
    for step in range(6):
        x, y = batch(spec, step, 2, world_size)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()
        opt.zero_grad()
    wrapped.synchronize()
    counted = dict(wrapped.comm_stats.bytes_by_bucket)
    split = len(wrapped.engine.plan.split) == len(wrapped.engine.buckets)
    wrapped.close()
    traced = {row["layer"]: row["bytes_per_iteration"]
              for row in summarize(load_spans(f"{trace_dir}/trace_rank{rank}.json"))["layers"]}
    return {"counted": counted, "traced": traced, "split": split}


def traced_pull_waits(rank: int, world_size: int, trace_dir: str, lazy: bool) -> dict:
    """ServerOptimizer with every job's network phase slowed by 50 ms once the buckets are learned,
    traced over steps 2-3: the training thread's waits per rank-iteration, by what it waited on (rank 0,
    which writes the merged trace; the others return nothing)."""
    from poseidon_torch.trace import load_spans, summarize

    spec = ModelSpec(widths=(16, 16), out_features=4)
    model = build(spec, seed=1)
    wrapped = PoseidonDDP(model, timeout=60, hybrid=False, fusion_bytes=0, trace_dir=trace_dir, trace_skip=2,
                          trace_iters=2)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, lazy_pull=lazy)
    for step in range(5):
        if step == 1:
            slow(server_job(wrapped.engine, "PS"), ("network",), 0.05)
        x, y = batch(spec, step, 2, world_size)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()
        opt.zero_grad()
    wrapped.close()  # waits for this rank's trace writer: rank 0's writes the merged trace
    return summarize(load_spans(f"{trace_dir}/trace_merged.json"))["waits_ms_per_iteration"] if rank == 0 else {}
