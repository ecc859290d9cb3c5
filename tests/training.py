"""The one training loop of the parity tests, and the single-process reference each mode is held to.

:func:`train` runs one :class:`Run` on a rank of a test cluster (``fn(rank, world_size, ...)``):
PoseidonDDP in any mode (the default BSP averaging, Pipe-SGD with ``delay``, a ServerOptimizer with
``server`` options: BSP, Pipe-SGD or SSP on the servers), or an anchor (torch DDP, DDP +
ZeroRedundancyOptimizer), on the same model and data, and records per step what the tests check.
Every rank trains on its shard of the step's batch; the single-process references train on the whole
(concatenated) batch as each mode's algorithm says:
- :func:`bsp`: BSP, the default mode and the server modes without delay (what torch DDP computes);
- :func:`pipe_sgd`: Pipe-SGD on gradients, w_{t+1} = opt(w_t, g(w_{t-k})), no update for the first k steps;
- :func:`server_pipe_sgd`: Pipe-SGD on the servers, the gradient of batch t at the values of step
  max(t-k, 0) applied at once to the newest values;
- :func:`periodic`: local SGD and DiLoCo, one replica per rank, each on its own shard.
(SSP and asynchronous SGD are held to their bound by the ledger model of ``stale_workers``.)
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from models import ModelSpec, batch, build
from poseidon_torch import PoseidonDDP, ServerOptimizer, SyncError
from poseidon_torch.bucket import find_layers
from poseidon_torch.fc import fc_spec


class LARS(torch.optim.SGD):
    """A layer-wise optimizer (the trust ratio reads the whole parameter), as LARS and LAMB are; a
    subclass of an elementwise one, as such optimizers often are."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                trust = p.norm() / (p.grad.norm() + 1e-6) if p.norm() > 0 else torch.tensor(1.0)
                p.add_(p.grad, alpha=-group["lr"] * float(trust))


#: the tests' optimizers by name: the class and its arguments
OPTIMIZERS = {
    "plain-sgd": (torch.optim.SGD, dict(lr=0.05)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.001)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.01)),
    "adamw-decay": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
    "lars": (LARS, dict(lr=0.05)),
}


@dataclass(frozen=True)
class Run:
    """One training run: what trains, with what optimizer, and the loop's habits."""

    #: "poseidon" (PoseidonDDP and the user's optimizer), "server" (PoseidonDDP and a ServerOptimizer),
    #: "ddp" (torch DDP), "zero" (torch DDP and ZeroRedundancyOptimizer)
    wrapper: str = "poseidon"
    optimizer: str = "sgd"
    #: PoseidonDDP's options; ``force``: that path on every FC layer alone in its bucket, ``force_all``:
    #: that path on every layer alone in its bucket
    options: dict = field(default_factory=dict)
    delay: int | None = None  #: PoseidonDDP(delay=...) (None: left out)
    server: dict = field(default_factory=dict)  #: the ServerOptimizer's options (lazy_pull, delay, ...)
    groups: str = "one"  #: "one" param group, or "two" (biases with their own lr and no weight decay)
    schedule: bool = False  #: a StepLR (step 2, gamma 0.5) after every step
    accumulate: int = 1  #: micro-batches per step, all but the last under no_sync()
    zero_grad: str = "before"  #: "before" the forward, "after" the forward, or "never" (gradients keep summing)
    set_to_none: bool = True
    rank_init: bool = False  #: every rank initialises the model its own way (the wrapper takes rank 0's)
    clip: float | None = None  #: global-norm clipping: the server's max_grad_norm, clip_grad_norm_ for the others
    skip: int | None = None  #: at this step every rank's backward raises and every rank skips the step
    timeout: float = 60.0


def shard(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t[rank * size:(rank + 1) * size]


def fc_overrides(model: nn.Module, path: str) -> dict[str, str]:
    """Force ``path`` on every FC module (each its own syncer when fusion_bytes=0)."""
    return {name: path for name, m in model.named_modules() if fc_spec(m) is not None
            and any(p.requires_grad for p in m.parameters(recurse=False))}


def poseidon_options(model: nn.Module, options: dict | None) -> dict:
    """PoseidonDDP's keyword arguments for ``options`` (``force`` / ``force_all``: see :class:`Run`)."""
    options = dict(options or {})
    force, force_all = options.pop("force", None), options.pop("force_all", None)
    if force:
        options.update(fusion_bytes=0, overrides=fc_overrides(model, force))
    if force_all:
        options.update(fusion_bytes=0, overrides={layer.name: force_all for layer in find_layers(model)})
    return options


def param_groups(model: nn.Module, kind: str) -> list | None:
    """None (one group), or two groups with their own lr and weight decay (biases vs the rest)."""
    if kind == "one":
        return None
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") or p.dim() == 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("bias") or p.dim() == 1)]
    return [g for g in ({"params": rest}, {"params": biases, "lr": 0.003, "weight_decay": 0.0}) if g["params"]]


def make_optimizer(wrapped: nn.Module, model: nn.Module, run: Run) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[run.optimizer]
    params = param_groups(model, run.groups)
    if run.wrapper == "server":
        return ServerOptimizer(wrapped, cls, params, max_grad_norm=run.clip, **run.server, **kwargs)
    if run.wrapper == "zero":
        return ZeroRedundancyOptimizer(params or list(model.parameters()), optimizer_class=cls, **kwargs)
    return cls(params or wrapped.parameters(), **kwargs)


def wrap(model: nn.Module, spec: ModelSpec, run: Run) -> nn.Module:
    if run.wrapper in ("poseidon", "server"):
        extra = {} if run.delay is None else {"delay": run.delay}
        return PoseidonDDP(model, timeout=run.timeout, **extra, **poseidon_options(model, run.options))
    return DDP(model, find_unused_parameters=spec.unused_branch or spec.rank0_branch)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _raise(grad: torch.Tensor) -> None:
    raise ValueError("bad batch")


class BadBatch:
    """A gradient hook that raises ``ValueError("bad batch")`` while ``now`` is set: the user's exception in
    backward, on the steps and ranks a test chooses."""

    def __init__(self) -> None:
        self.now = False

    def __call__(self, grad: torch.Tensor) -> None:
        if self.now:
            raise ValueError("bad batch")


def train(rank: int, world_size: int, spec: ModelSpec, run: Run, steps: int, size: int) -> dict:
    """``run`` for ``steps`` steps of ``size`` samples per rank. Returns the final ``state``; per step
    the ``paths`` the buckets took and the bytes ``sent`` by path, ``.grad`` after backward (``grads``),
    the parameters each forward read (``read``), the ``plans`` and clipping ``norms``; the exceptions of
    skipped steps (``errors``); the consistency state in flight; for a ServerOptimizer the optimizer state
    bytes of this rank and the consolidated state, for torch DDP its optimizer's state."""
    torch.manual_seed(0)
    model = build(spec, seed=spec.seed + (7919 * rank if run.rank_init else 0))
    wrapped = wrap(model, spec, run)
    poseidon = isinstance(wrapped, PoseidonDDP)
    opt = make_optimizer(wrapped, model, run)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if run.schedule else None
    out: dict = {"paths": [], "sent": [], "total_sent": [], "grads": [], "read": [], "plans": [], "norms": [],
                 "errors": [],
                 "params": [name for name, _ in model.named_parameters()]}
    for step in range(steps):
        if run.zero_grad == "before":
            opt.zero_grad(set_to_none=run.set_to_none)
        for micro in range(run.accumulate):
            x, y = batch(spec, step * run.accumulate + micro, size, world_size)
            last = micro == run.accumulate - 1
            with contextlib.nullcontext() if last else wrapped.no_sync():
                output = wrapped(shard(x, rank, size), use_side=spec.rank0_branch and rank == 0)
                if last:
                    out["read"].append({n: p.detach().clone() for n, p in model.named_parameters()})
                if run.zero_grad == "after" and micro == 0:
                    opt.zero_grad()
                if last and step == run.skip:  # after the wrapper's own hook on its output: the backward is synced
                    output.register_hook(_raise)
                # nothing keeps the graph alive once backward returns (as in most training loops)
                try:
                    F.mse_loss(output, shard(y, rank, size)).backward()
                except (ValueError, SyncError) as exc:
                    if step != run.skip:
                        raise
                    out["errors"].append(type(exc).__name__)
        if step == run.skip:
            continue
        out["grads"].append(_grads(model))
        if run.clip is not None and run.wrapper != "server":
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if poseidon:
            out["paths"].append(dict(wrapped.comm_stats.outcome_by_bucket))
            out["sent"].append(dict(wrapped.comm_stats.bytes_by_path))
            out["total_sent"].append(wrapped.comm_stats.bytes_sent_total)
            out["plans"].append(wrapped.engine.plan)
        if run.clip is not None and run.wrapper == "server":  # right after step(), where loops log it
            out["norms"].append(opt.last_grad_norm)
    if poseidon:
        out["in_flight"] = wrapped.consistency_state_dict()
        if wrapped.options.periodic is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            out["fragments"] = [set(f) for f in wrapped.engine.mode.fragment_params(names)]
    if run.wrapper == "server":
        out["state_bytes"] = opt.local_state_bytes()
        opt.consolidate_state_dict(to=0)
        out["optimizer"] = opt.state_dict() if rank == 0 else None
    elif run.wrapper == "ddp":
        out["optimizer"] = opt.state_dict()
    if poseidon:
        wrapped.close()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def train_runs(rank: int, world_size: int, spec: ModelSpec, runs: Sequence[Run], steps: int, size: int) -> list[dict]:
    """:func:`train` for each of ``runs``, one after the other."""
    return [train(rank, world_size, spec, run, steps, size) for run in runs]


def against(rank: int, world_size: int, spec: ModelSpec, run: Run, anchors: Sequence[str], steps: int,
            size: int) -> dict[str, dict]:
    """``run`` and each anchor (``"ddp"``, ``"zero"``: the same run on that wrapper), by wrapper name."""
    return {wrapper: train(rank, world_size, spec, replace(run, wrapper=wrapper), steps, size)
            for wrapper in (run.wrapper, *anchors)}


def train_pair(rank: int, world_size: int, spec: ModelSpec, run: Run, steps: int, size: int) -> dict[str, dict]:
    """``run`` and torch DDP: :func:`against` ``("ddp",)``."""
    return against(rank, world_size, spec, run, ("ddp",), steps, size)


# ---- the single-process references -------------------------------------------------------------------

def loss_of(model: nn.Module, spec: ModelSpec, step: int, size: int, world_size: int) -> torch.Tensor:
    """The loss of the concatenated batch of ``step`` (a micro-batch index when accumulating). With
    BatchNorm or a rank-0-only branch the ranks' forwards differ, so the mean of the per-shard losses
    (the same objective)."""
    x, y = batch(spec, step, size, world_size)
    if not (spec.batchnorm or spec.rank0_branch):
        return F.mse_loss(model(x), y)
    return sum(F.mse_loss(model(shard(x, r, size), use_side=spec.rank0_branch and r == 0), shard(y, r, size))
               for r in range(world_size)) / world_size


def delayed_sgd(model: nn.Module, backward_of_step: Callable[[nn.Module, int], None], steps: int, delay: int,
                optimizer: str = "sgd", skip: int | None = None, zero_grad: str = "before") -> dict:
    """Gradients applied ``delay`` steps late, in one process: w_{t+1} = opt(w_t, g(w_{t-k})), no update
    for the first k steps (``.grad`` None); a ``skip``ped step does not exist; ``delay=0`` is BSP.
    ``backward_of_step(model, t)`` accumulates step t's gradient. The final parameters and the gradient
    each step applied."""
    params = [p for p in model.parameters() if p.requires_grad]
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(params, **kwargs)
    in_flight, applied = [], []
    for step in range(steps):
        if step == skip:
            continue
        if zero_grad != "never":
            opt.zero_grad()
        backward_of_step(model, step)
        in_flight.append([p.grad for p in params])
        due = in_flight.pop(0) if len(in_flight) > delay else [None] * len(params)
        for p, g in zip(params, due):
            p.grad = g
        applied.append({n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "grads": applied}


def pipe_sgd(spec: ModelSpec, delay: int, steps: int, size: int, world_size: int, optimizer: str = "sgd",
             skip: int | None = None, accumulate: int = 1, zero_grad: str = "before") -> dict:
    """Pipe-SGD's reference for a :class:`Run` with ``delay`` on ``spec``'s model (see :func:`delayed_sgd`)."""
    def backward(model: nn.Module, step: int) -> None:
        for micro in range(accumulate):
            loss_of(model, spec, step * accumulate + micro, size, world_size).backward()

    return delayed_sgd(build(spec, seed=spec.seed), backward, steps, delay, optimizer, skip, zero_grad)


def bsp(spec: ModelSpec, steps: int, size: int, world_size: int, optimizer: str = "sgd", accumulate: int = 1,
        zero_grad: str = "before") -> dict:
    """BSP's reference: single-process training on the concatenated batch (Pipe-SGD with no delay)."""
    return pipe_sgd(spec, 0, steps, size, world_size, optimizer, accumulate=accumulate, zero_grad=zero_grad)


def server_pipe_sgd(spec: ModelSpec, delay: int, steps: int, size: int, world_size: int, optimizer: str = "sgd") -> dict:
    """Pipe-SGD as the servers run it, in one process: the gradient of batch t at the values of step
    max(t-k, 0), applied at once to the newest values: w_{t+1} = opt(w_t, g_t(w_{max(t-k, 0)})). The
    values the next forward would read (w_{steps-k}: what the parameters hold after the last step), the
    newest (w_steps), and what every step's forward read."""
    model = build(spec, seed=spec.seed)
    reader = build(spec, seed=spec.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(params, **kwargs)
    history = [{k: v.clone() for k, v in model.state_dict().items()}]
    for step in range(steps):
        reader.load_state_dict(history[max(step - delay, 0)])
        reader.zero_grad()
        loss_of(reader, spec, step, size, world_size).backward()
        for p, q in zip(model.parameters(), reader.parameters()):
            p.grad = q.grad
        opt.step()
        history.append({k: v.clone() for k, v in model.state_dict().items()})
    names = [n for n, p in model.named_parameters()]
    return {"params": {n: history[max(steps - delay, 0)][n] for n in names},
            "newest": {n: history[steps][n] for n in names},
            "read": [{n: history[max(t - delay, 0)][n] for n in names} for t in range(steps)]}


def periodic(spec: ModelSpec, sync_every: int, outer: tuple | None, steps: int, size: int, world_size: int,
             optimizer: str = "sgd", skip: int | None = None, average_buffers: bool = True, delay: int = 0,
             fragments: list[set[str]] | None = None) -> dict:
    """Local SGD (``outer`` None) or DiLoCo (``outer``: the outer optimizer's class and arguments) in one
    process: one replica per rank, each stepping its own inner optimizer on its shard of every batch. After
    every ``sync_every``-th step taken (a ``skip``ped step is none), local SGD averages the parameters
    (summed in rank order, then divided by P); DiLoCo steps the round's start parameters with the outer
    optimizer on the average of (start - end). Floating-point buffers are averaged too when
    ``average_buffers``. With ``delay`` d the round's result lands after d more steps taken, each replica
    keeping those steps on top of it: parameter = result + (parameter - its value at the round's end), and
    DiLoCo's next round starts from the result. With ``fragments`` (F sets of parameter names) fragment f
    syncs alone after steps kS with (k - 1) mod F = f, S = ``sync_every`` / F (DiLoCo's outer optimizer
    then steps only its parameters). Per replica: its final ``params`` and ``state``, and the parameters
    every step's forward ``read``."""
    replicas = [build(spec, seed=spec.seed) for _ in range(world_size)]
    cls, kwargs = OPTIMIZERS[optimizer]
    inner = [cls(_trainable(m), **kwargs) for m in replicas]
    start = build(spec, seed=spec.seed)  # the round's start parameters, which the outer optimizer steps
    outer_opt = outer[0](_trainable(start), **outer[1]) if outer is not None else None
    read: list[list[dict]] = [[] for _ in replicas]
    names = [n for n, p in replicas[0].named_parameters() if p.requires_grad]
    fragments = fragments or [set(names)]
    spacing = sync_every // len(fragments)
    taken, landing = 0, None  # landing: (the step taken after which it lands, its mask, result, what was sent)
    for step in range(steps):
        x, y = batch(spec, step, size, world_size)
        for rank, (model, opt) in enumerate(zip(replicas, inner)):
            read[rank].append({n: p.detach().clone() for n, p in model.named_parameters()})
            if step == skip:
                continue
            opt.zero_grad()
            output = model(shard(x, rank, size), use_side=spec.rank0_branch and rank == 0)
            F.mse_loss(output, shard(y, rank, size)).backward()
            opt.step()
        if step == skip:
            continue
        taken += 1
        if landing is not None and landing[0] == taken:
            _land(replicas, *landing[1:], average_buffers)
            landing = None
        if taken % spacing == 0:
            mask = [n in fragments[(taken // spacing - 1) % len(fragments)] for n in names]
            sent = [[p.detach().clone() for p in _trainable(m)] for m in replicas]
            landing = (taken + delay, mask, _round_result(replicas, start, outer_opt, mask), sent)
            if not delay:
                _land(replicas, *landing[1:], average_buffers)
                landing = None
    return {"params": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in replicas],
            "state": [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in replicas], "read": read}


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _mean(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for value in values[1:]:
        total += value
    return total.div_(len(values))


@torch.no_grad()
def _round_result(replicas: list[nn.Module], start: nn.Module, outer: torch.optim.Optimizer | None,
                  mask: list[bool]) -> list[torch.Tensor | None]:
    """The sync of :func:`periodic` of the parameters ``mask`` picks: the values every replica takes
    (local SGD: the average; DiLoCo: the outer step of ``start``, which it updates), None elsewhere."""
    columns = list(zip(*(_trainable(m) for m in replicas)))
    if outer is None:
        return [_mean(list(column)) if chosen else None for column, chosen in zip(columns, mask)]
    for p, column, chosen in zip(_trainable(start), columns, mask):
        p.grad = _mean([p - q for q in column]) if chosen else None
    outer.step()
    return [p.detach().clone() if chosen else None for p, chosen in zip(_trainable(start), mask)]


@torch.no_grad()
def _land(replicas: list[nn.Module], mask: list[bool], result: list[torch.Tensor | None],
          sent: list[list[torch.Tensor]], buffers: bool) -> None:
    """The round's ``result`` into every replica's parameters ``mask`` picks, the steps each took since it
    ``sent`` kept on top."""
    for model, mine in zip(replicas, sent):
        for p, chosen, value, was in zip(_trainable(model), mask, result, mine):
            if chosen:
                drift = p - was
                p.copy_(value).add_(drift)
    if buffers:
        for column in zip(*(list(m.buffers()) for m in replicas)):
            if column[0].is_floating_point():
                average = _mean([b.clone() for b in column])
                for b in column:
                    b.copy_(average)
