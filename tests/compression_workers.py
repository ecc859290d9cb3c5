"""Rank-side functions of the compression tests (``test_compression.py``): a model whose gradients are
given (so every rank's input to a lossy path is known to the test), and training runs that save and
resume.

:class:`Given` holds parameters of the drawn shapes, one layer per entry; its forward takes this rank's
gradients of the step and returns sum(p * g): backward leaves exactly g in ``.grad``, whatever the
parameters are, so the single-process references in the tests can replay a lossy path's algorithm on the
same per-rank inputs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import placement
from models import ModelSpec, batch, build
from poseidon_torch import PoseidonDDP
from poseidon_torch.paths import path_class
from training import OPTIMIZERS, BadBatch, shard

#: the layers of a :class:`Given` model: per layer, its parameters' shapes (the first one is its "weight")
Layers = tuple[tuple[tuple[int, ...], ...], ...]


class Holder(nn.Module):
    """One layer: parameters p0, p1, ... of the given shapes."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(shape, dtype=dtype)))


class Given(nn.Module):
    """Layers l0, l1, ...; ``forward(grads)`` = sum over parameters of (p * g).sum()."""

    def __init__(self, layers: Layers, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Holder(shapes, dtype) for shapes in layers)

    def forward(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.parameters(), grads))


def names(layers: Layers) -> list[str]:
    return [f"layers.{i}.p{j}" for i, shapes in enumerate(layers) for j in range(len(shapes))]


def gradients(layers: Layers, rank: int, step: int, dtype: torch.dtype, low_rank: int = 0) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients at ``step``: normal draws; with ``low_rank`` > 0, every matrix (first
    dimension by the rest) is U C V^T with U and V shared by the ranks and C (low_rank x low_rank) the
    rank's own, so the mean over the ranks has rank <= low_rank."""
    out = []
    for i, shapes in enumerate(layers):
        for j, shape in enumerate(shapes):
            own = torch.Generator().manual_seed(7919 * rank + 104729 * step + 31 * i + j)
            if low_rank and len(shape) >= 2:
                rows = shape[0]
                cols = torch.Size(shape).numel() // rows
                shared = torch.Generator().manual_seed(104729 * step + 31 * i + j)
                u = torch.randn(rows, low_rank, generator=shared, dtype=torch.float64)
                v = torch.randn(cols, low_rank, generator=shared, dtype=torch.float64)
                c = torch.randn(low_rank, low_rank, generator=own, dtype=torch.float64)
                out.append((u @ c @ v.T).reshape(shape).to(dtype))
            else:
                out.append(torch.randn(shape, generator=own, dtype=torch.float64).to(dtype))
    return out


def given_run(rank: int, world_size: int, layers: Layers, path: str, steps: int, dtype: torch.dtype,
              low_rank: int = 0, settings: dict | None = None, delay: int = 0, scale: float = 1.0,
              switch: tuple[int, str] | None = None) -> dict:
    """``steps`` backwards of :class:`Given` (its gradients times ``scale``) with ``path`` forced on every
    layer (with ``settings``: also named by ``compression={option: settings}``, which probes the rates the
    plan costs it with); per step the ``.grad`` after backward, each bucket's outcome and the bytes by
    bucket and path; the consistency state at the end; the plan's predictions per bucket and path.
    ``switch`` (step, other path): before that step every layer's override becomes the other path, as when
    the coordinator's plan moves them (a step's plan is made when the step before it ends, so the step
    after it is the first on the other path); the consistency state is then kept after every step."""
    model = Given(layers, dtype).to(placement.DEVICE)
    everything = {layer: path for layer in (f"layers.{i}" for i in range(len(layers)))}
    options = {}
    if settings is not None:
        options["compression"] = {path_class(path).option: settings}
    wrapped = PoseidonDDP(model, fusion_bytes=0, overrides=everything, timeout=60, delay=delay, **options)
    out: dict = {"grads": [], "outcomes": [], "bytes": [], "by_path": [], "states": []}
    for step in range(steps):
        if switch is not None and step == switch[0]:  # as when the coordinator's plan moves every layer
            wrapped._engine.coordinator.overrides = dict.fromkeys(everything, switch[1])
        model.zero_grad(set_to_none=True)
        grads = [g.to(placement.DEVICE) * scale for g in gradients(layers, rank, step, dtype, low_rank)]
        wrapped(grads).backward()
        out["grads"].append({n: None if p.grad is None else p.grad.detach().clone()
                             for n, p in model.named_parameters()})
        stats = wrapped.comm_stats
        out["outcomes"].append(dict(stats.outcome_by_bucket))
        out["bytes"].append(dict(stats.bytes_by_bucket))
        out["by_path"].append(dict(stats.bytes_by_path))
        if switch is not None:
            out["states"].append(own_state(wrapped))
    out["state"] = own_state(wrapped)
    plan = wrapped.plan
    out["predicted"] = {row.name: row.predictions for row in plan.rows}
    wrapped.close()
    return out



def joined_run(rank: int, world_size: int, layers: Layers, path: str, steps: int, dtype: torch.dtype,
               last_rank_steps: int, settings: dict, raise_at: int | None = None) -> dict:
    """:class:`Given` with ``path`` forced on every layer (and named by ``compression={option: settings}``)
    under ``join()``: the last rank runs out of data after ``last_rank_steps`` of the others' ``steps`` and
    shadows their syncs from then on; with ``raise_at``, rank 0's backward of that step raises (the others'
    raise ``SyncError``), caught: the step is skipped. Per step this rank trained, the ``.grad`` after
    backward and the outcomes; the steps it skipped; the consistency state at the end (this rank's)."""
    from poseidon_torch import SyncError

    model = Given(layers, dtype).to(placement.DEVICE)
    everything = {layer: path for layer in (f"layers.{i}" for i in range(len(layers)))}
    wrapped = PoseidonDDP(model, fusion_bytes=0, overrides=everything, timeout=60,
                          compression={path_class(path).option: settings})
    bad = BadBatch()
    next(model.parameters()).register_hook(bad)
    out: dict = {"grads": [], "outcomes": [], "skipped": []}
    with wrapped.join():
        for step in range(last_rank_steps if rank == world_size - 1 else steps):
            model.zero_grad(set_to_none=True)
            bad.now = step == raise_at and rank == 0
            try:
                wrapped([g.to(placement.DEVICE) for g in gradients(layers, rank, step, dtype)]).backward()
            except (ValueError, SyncError):
                out["skipped"].append(step)
                continue
            out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            out["outcomes"].append(dict(wrapped.comm_stats.outcome_by_bucket))
    out["state"] = own_state(wrapped)
    wrapped.close()
    return out


def given_server_run(rank: int, world_size: int, layers: Layers, path: str, steps: int, dtype: torch.dtype,
                     settings: dict | None = None, resume_at: int | None = None, server: dict | None = None,
                     scale: float = 1.0, chunk_bytes: int | None = None) -> dict:
    """``steps`` steps of :class:`Given` (parameters from zero) under a ``ServerOptimizer`` (plain SGD at
    lr 1 unless ``server`` says otherwise, so the parameters are minus the sum of the applied averages) with ``path`` forced on every layer
    and named by ``compression=`` (``settings``), its gradients times ``scale``; ``server``: more
    ``ServerOptimizer`` options; ``chunk_bytes``: the shards' chunks (the wrapper's default if None). Per step
    the parameters after ``step()``, the outcomes and bytes by path; the consistency state at the end.
    With ``resume_at``: after that many steps the model and the consistency state are saved, the wrapper
    closed, and a fresh model (other values), wrapper and optimizer load them and train on."""
    from poseidon_torch import ServerOptimizer

    def build_run(state: dict | None) -> tuple[nn.Module, PoseidonDDP, ServerOptimizer]:
        model = Given(layers, dtype).to(placement.DEVICE)
        if state is not None:
            model.load_state_dict(state["model"])
        overrides = {layer: path for layer in (f"layers.{i}" for i in range(len(layers)))}
        wrapped = PoseidonDDP(model, fusion_bytes=0, overrides=overrides, timeout=60,
                              compression={path_class(path).option: settings or {}},
                              **({} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}))
        optimizer = ServerOptimizer(wrapped, torch.optim.SGD, **{"lr": 1.0, **(server or {})})
        if state is not None:
            wrapped.load_consistency_state_dict(state["consistency"])
        return model, wrapped, optimizer

    model, wrapped, optimizer = build_run(None)
    out: dict = {"params": [], "outcomes": [], "by_path": []}
    for step in range(steps):
        if step == resume_at:
            consistency = [wrapped.consistency_state_dict()]
            dist.broadcast_object_list(consistency, src=0)  # rank 0's copy resumes every rank, as a framework's
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "consistency": consistency[0]}
            wrapped.close()
            model, wrapped, optimizer = build_run(saved)
        optimizer.zero_grad(set_to_none=True)
        grads = [g.to(placement.DEVICE) * scale for g in gradients(layers, rank, step, dtype)]
        wrapped(grads).backward()
        optimizer.step()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        stats = wrapped.comm_stats
        out["outcomes"].append(dict(stats.outcome_by_bucket))
        out["by_path"].append(dict(stats.bytes_by_path))
    out["state"] = own_state(wrapped)
    wrapped.close()
    return out


def skipped_batch(rank: int, world_size: int, server: bool, raises: bool, observe: bool = False) -> dict:
    """An MLP with every layer on PowerSGD from step 1, SGD (a ServerOptimizer if ``server``) over batches
    0-4; batch 3 is skipped: with ``raises`` its backward raises on rank 0 (a hook; caught on every rank,
    the others' error being the SyncError that names rank 0), else no rank runs it; ``observe``: every
    rank takes the consistency state where it caught the error (a checkpoint on failure). The parameters
    and this rank's PowerSGD state (residuals, Q) at the end."""
    from poseidon_torch import ServerOptimizer, SyncError
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    layers = {"0": "PowerSGD", "2": "PowerSGD", "4": "PowerSGD"}
    wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=0, overrides=layers,
                          compression={"powersgd": {"start_iter": 1, "rank": 2}})
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1) if server else torch.optim.SGD(model.parameters(), lr=0.1)
    bad = BadBatch()
    model[0].weight.register_hook(bad)
    for step in range(5):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
        if step == 3 and not raises:
            continue
        bad.now = step == 3 and rank == 0
        try:
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
        except (ValueError, SyncError):
            opt.zero_grad()
            if observe:
                own_state(wrapped)
            continue
        opt.step()
        opt.zero_grad()
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "state": own_state(wrapped)["paths"]["PowerSGD"]}
    wrapped.close()
    return out


def own_state(wrapped: PoseidonDDP) -> dict:
    """The wrapper's consistency state with ``"paths"`` narrowed to this rank's own entry."""
    state = wrapped.consistency_state_dict()
    if "paths" in state:
        state["paths"] = state["paths"]["ranks"][dist.get_rank()]
    return state


def train(rank: int, world_size: int, spec: ModelSpec, options: dict, steps: int, size: int,
          resume_at: int | None = None, load_state: bool = True) -> dict:
    """SGD with momentum on ``spec``'s model under ``PoseidonDDP(**options)``; the parameters after every
    step. With ``resume_at``: after that many steps the model, the optimizer and the consistency state are
    saved, the wrapper closed, and a fresh model, wrapper and optimizer load them (the consistency state
    only if ``load_state``) and train on."""
    cls, kwargs = OPTIMIZERS["sgd"]
    model = build(spec, seed=spec.seed)
    wrapped = PoseidonDDP(model, timeout=60, **options)
    opt = cls(model.parameters(), **kwargs)
    out: dict = {"params": [], "outcomes": []}
    for step in range(steps):
        if step == resume_at:
            consistency = [wrapped.consistency_state_dict()]
            dist.broadcast_object_list(consistency, src=0)  # rank 0's copy resumes every rank, as a framework's
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), consistency[0])
            wrapped.close()
            model = build(spec, seed=spec.seed + 1)  # other values: everything must come from the checkpoint
            model.load_state_dict(saved[0])
            wrapped = PoseidonDDP(model, timeout=60, **options)
            opt = cls(model.parameters(), **kwargs)
            opt.load_state_dict(saved[1])
            if load_state:
                wrapped.load_consistency_state_dict(saved[2])
        x, y = batch(spec, step, size, world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(shard(x, rank, size)), shard(y, rank, size)).backward()
        opt.step()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        out["outcomes"].append(dict(wrapped.comm_stats.outcome_by_bucket))
    wrapped.close()
    return out


def refused_states(rank: int, world_size: int, spec: ModelSpec, options: dict) -> dict:
    """Two steps under ``options`` (a lossy path forced), then the saved consistency state, altered, loaded
    into fresh wrappers: the error of each case ("type: message"), and whether the last case's wrapper
    then trains on as before (a refused load changed nothing)."""
    saved = train_state(rank, world_size, spec, options)
    lossless = {key: value for key, value in options.items() if key not in ("compression", "overrides")}
    cases = {
        "without compression=": (lossless, saved),
        "other world size": (options, {**saved, "paths": {**saved["paths"], "world_size": world_size + 1,
                                                           "ranks": saved["paths"]["ranks"] + saved["paths"]["ranks"][:1]}}),
        "old format": (options, {**saved, "paths": saved["paths"]["ranks"][rank]}),
        "coordinator only": (lossless, {key: value for key, value in saved.items() if key != "paths"}),
    }
    errors = {}
    for case, (wrapper_options, state) in cases.items():
        wrapped = PoseidonDDP(build(spec, seed=spec.seed), timeout=60, **wrapper_options)
        try:
            wrapped.load_consistency_state_dict(state)
            errors[case] = ""
        except Exception as exc:  # noqa: BLE001 - the test compares the type and message
            errors[case] = f"{type(exc).__name__}: {exc}"
        wrapped.close()
    return errors


def train_state(rank: int, world_size: int, spec: ModelSpec, options: dict) -> dict:
    """The consistency state after two SGD steps of ``spec``'s model under ``PoseidonDDP(**options)``."""
    model = build(spec, seed=spec.seed)
    wrapped = PoseidonDDP(model, timeout=60, **options)
    for step in range(2):
        x, y = batch(spec, step, 4, world_size)
        torch.nn.functional.mse_loss(wrapped(shard(x, rank, 4)), shard(y, rank, 4)).backward()
    state = wrapped.consistency_state_dict()
    wrapped.close()
    return state


def construct(rank: int, world_size: int, options: dict, server: dict | None = None) -> str:
    """Build PoseidonDDP with ``options`` on a small model (and a ServerOptimizer with ``server``'s options
    on it, unless None); the error's type and message, or "" when nothing was refused."""
    from poseidon_torch import ServerOptimizer
    model = build(ModelSpec(widths=(8,)), seed=0)
    wrapped = None
    try:
        wrapped = PoseidonDDP(model, timeout=30, **options)
        if server is not None:
            ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, **server)
    except (TypeError, ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if wrapped is not None:
            wrapped.close()
    return ""


def late_gradient(rank: int, world_size: int, path: str) -> dict:
    """``patterns.SharedInCheckpoint`` with ``path`` forced on its shared layer, whose gradient arrives
    after its bucket's sync in every step (the bucket is then averaged again, exactly, on the default
    path): per step the gradients against the hand average, whether a gradient came late, each layer's
    planned path (an outcome shows the last job: the default path's), and the consistency state at the end."""
    from patterns import SharedInCheckpoint, data, run_steps, wrap

    settings = {"start_iter": 1, "rank": 1} if path == "PowerSGD" else {"start_iter": 1}  # rank 1 compresses 8 x 8
    model = wrap(SharedInCheckpoint(), fusion_bytes=0, overrides={"shared": path},
                 compression={path_class(path).option: settings})

    def step(m, module, i):
        x, y = data(i, rank, n_in=6)
        torch.nn.functional.mse_loss(m(x), y).backward()

    results = run_steps(model, 4, step, rank)
    out = {"steps": results, "late": model.comm_stats.jobs_last_iteration > len(model.bucket_names),
           "planned": model.plan.layer_paths(), "state": own_state(model)}
    model.close()
    return out


def refused_load_changes_nothing(rank: int, world_size: int, spec: ModelSpec, saved_with: dict, loaded_with: dict
                                 ) -> tuple[str, dict, dict]:
    """The consistency state after two backwards under ``saved_with``, loaded into a fresh wrapper built
    with ``loaded_with``: the error, and the fresh wrapper's consistency state before and after the load."""
    saved = train_state(rank, world_size, spec, saved_with)
    wrapped = PoseidonDDP(build(spec, seed=spec.seed), timeout=60, **loaded_with)
    before = wrapped.consistency_state_dict()
    try:
        wrapped.load_consistency_state_dict(saved)
        error = ""
    except ValueError as exc:
        error = str(exc)
    after = wrapped.consistency_state_dict()
    wrapped.close()
    return error, before, after


def overflow_once(rank: int, world_size: int, layers: Layers, path: str, steps: int, bad_step: int) -> dict:
    """``steps`` backwards of :class:`Given` with ``path`` forced on every layer, rank 0's first gradient
    entry inf at ``bad_step`` (an fp16 overflow, whose step GradScaler skips); per step whether every
    averaged gradient is finite, and the residuals before and after the bad step."""
    model = Given(layers, torch.float32).to(placement.DEVICE)
    everything = {f"layers.{i}": path for i in range(len(layers))}
    settings = {"start_iter": 1, **({"rank": 1} if path == "PowerSGD" else {})}
    wrapped = PoseidonDDP(model, fusion_bytes=0, overrides=everything, timeout=60,
                          compression={path_class(path).option: settings})
    out: dict = {"finite": [], "residuals": []}
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        grads = [g.to(placement.DEVICE) for g in gradients(layers, rank, step, torch.float32)]
        if step == bad_step and rank == 0:
            grads[0].view(-1)[0] = float("inf")
        wrapped(grads).backward()
        out["finite"].append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        if step in (bad_step - 1, bad_step):
            out["residuals"].append(own_state(wrapped)["paths"][path]["residual"])
    wrapped.close()
    return out
