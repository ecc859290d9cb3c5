"""Training patterns real code uses, run on every rank: ``fn(rank, world_size, *args)``.

Each pattern trains a wrapped model for a few steps and, at every step, compares the gradients the
wrapper left in ``.grad`` with the *hand-averaged* gradient: a plain copy of the module, taken before
the step, runs the same computation on this rank's data, and its gradients are all-reduced and divided
by the number of ranks. That reference is data parallelism by definition, whatever the wrapper does.
Each result carries, per step, the largest difference from the reference and a fingerprint of the
gradients, so the test can check every rank and that the ranks agree bit for bit.
"""
from __future__ import annotations

import copy
import hashlib
import pickle
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import placement
from placement import on_device
from poseidon_torch import PoseidonDDP

def slow_link():
    from poseidon_torch import LinkModel

    # so slow that every sync outlasts the backward of a test's model: SFB, where it sends fewer bytes,
    # shortens the predicted iteration whatever the measured readiness times (the coordinator chooses by it)
    return LinkModel.from_gbps(1e-4, latency_us=1.0)


class MLP(nn.Module):
    """in -> hidden (Linear, tanh) -> side branch used on demand -> head."""

    def __init__(self, n_in: int = 12, hidden: int = 16, n_out: int = 3, seed: int = 0) -> None:
        super().__init__()
        self.init_args = (n_in, hidden, n_out, seed)
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(n_in, hidden)
        self.side = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, n_out)
        self.to(placement.DEVICE)

    def forward(self, x: torch.Tensor, use_side: bool = False, inplace: bool = False) -> torch.Tensor:
        h = F.relu(self.fc1(x), inplace=True) if inplace else torch.tanh(self.fc1(x))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.head(h)


def data(step: int, rank: int, rows: int = 4, n_in: int = 12, n_out: int = 3, salt: int = 0):
    g = torch.Generator().manual_seed(10_000 * salt + 100 * step + rank)
    return on_device(torch.randn(rows, n_in, generator=g), torch.randn(rows, n_out, generator=g))


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def hand_average(module: nn.Module, group=None) -> dict[str, torch.Tensor | None]:
    """Per parameter: the sum over the ranks of ``group`` of ``.grad`` (zeros where a rank has none)
    divided by the group's size; None where no rank has a gradient."""
    size = dist.get_world_size(group)
    out = {}
    for name, p in module.named_parameters():
        present = torch.tensor([0.0 if p.grad is None else 1.0])
        dist.all_reduce(present, group=group)
        if present.item() == 0:
            out[name] = None
            continue
        total = torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.detach().float().clone()
        dist.all_reduce(total, group=group)
        out[name] = total / size
    return out


def compare(ours: dict, reference: dict) -> float:
    """Largest absolute difference; inf where one side has a gradient and the other has none."""
    worst = 0.0
    for name, ref in reference.items():
        got = ours[name]
        if (got is None) != (ref is None):
            return float("inf")
        if got is not None:
            worst = max(worst, (got.float() - ref.float()).abs().max().item())
    return worst


def fingerprint(tensors: dict) -> str:
    """A digest of the exact bits, to check that the ranks agree bit for bit."""
    digest = hashlib.sha1()
    for name, t in sorted(tensors.items()):
        digest.update(name.encode())
        if t is not None:
            digest.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def plain_copy(module: nn.Module) -> nn.Module:
    """A fresh module of the same class and constructor arguments, with ``module``'s state, no hooks."""
    plain = type(module)(*module.init_args)
    plain.load_state_dict(module.state_dict())
    return plain


def run_steps(model: PoseidonDDP, steps: int, step_fn: Callable, rank: int, group=None) -> list[dict]:
    """For each step: the reference from a plain copy of the module, then the wrapped step; returns
    per step {diff, fingerprint}. ``step_fn(m, module, step)`` runs forward(s) and backward(s) on ``m``
    (the wrapped model, or the plain copy) and may call ``module`` (the inner module) directly."""
    opt = torch.optim.SGD(model.module.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        plain = plain_copy(model.module)
        step_fn(plain, plain, step)
        reference = hand_average(plain, group)
        opt.zero_grad(set_to_none=True)
        step_fn(model, model.module, step)
        ours = grads_of(model.module)
        out.append({"diff": compare(ours, reference), "fingerprint": fingerprint(ours),
                    "outcomes": dict(model.comm_stats.outcome_by_bucket)})
        opt.step()
    return out


def simple_step(rank: int) -> Callable:
    """The plainest step: one forward, an MSE loss, one backward."""
    def step(m, module, i):
        x, y = data(i, rank)
        F.mse_loss(m(x), y).backward()
    return step


def wrap(module: nn.Module, **options) -> PoseidonDDP:
    options.setdefault("timeout", 30)
    return PoseidonDDP(module.to(placement.DEVICE), **options)


def sfb_options(*names: str) -> dict:
    return {"fusion_bytes": 0, "overrides": {n: "SFB" for n in names}}


def _raise(exc: BaseException):
    raise exc


# ---- item 1: an exception in backward that every rank catches ---------------------------------------

def caught_exception_in_backward(rank: int, world_size: int, force: str) -> dict:
    model = wrap(MLP(), **(sfb_options("fc1", "head") if force == "SFB" else {"hybrid": False}))
    results = []
    opt = torch.optim.SGD(model.module.parameters(), lr=0.05)
    for step in range(5):
        x, y = data(step, rank)
        if step == 1:  # a bad batch: backward raises half way (head synced, fc1 not), every rank skips it
            handle = model.module.fc1.register_forward_hook(
                lambda mod, args, out: [out.register_hook(lambda g: _raise(ValueError("bad batch")))] and None)
            out = model(x)
            handle.remove()
            try:
                F.mse_loss(out, y).backward()
            except ValueError:
                pass
            opt.zero_grad(set_to_none=True)
            continue
        plain = plain_copy(model.module)
        F.mse_loss(plain(x), y).backward()
        reference = hand_average(plain)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        ours = grads_of(model.module)
        results.append({"diff": compare(ours, reference), "fingerprint": fingerprint(ours)})
        opt.step()
    model.close()
    return {"steps": results}


def one_rank_raises_in_backward(rank: int, world_size: int, force: str, server: bool) -> dict:
    """At step 2 (FC layers on SFB by then, when forced) only the last rank's backward raises. Every
    other rank's ``backward()`` (or, in parameter-server mode, ``step()``) must raise ``SyncError``
    naming that rank, leave this rank's local gradient in ``.grad`` (not an average), and every rank
    skips the step. Returns, per rank, what it saw, and the final parameters of this run and of torch
    DDP skipping the same step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from poseidon_torch import ServerOptimizer, SyncError

    bad_rank, bad_step = world_size - 1, 2
    seen: dict = {"error": None, "local_diff": None, "average_diff": None}
    finals = {}
    for wrapper in ("poseidon", "ddp"):
        module = MLP()
        if wrapper == "ddp":
            model = DDP(module, find_unused_parameters=True)  # MLP.side is not used
            opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        else:
            model = wrap(module, **(sfb_options("fc1", "head") if force == "SFB" else {"hybrid": False}))
            opt = ServerOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9) if server else \
                torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        for step in range(5):
            x, y = data(step, rank)
            bad = step == bad_step
            if wrapper == "ddp" and bad:
                continue  # the reference skips the bad batch on every rank
            if bad:
                plain = plain_copy(module)
                F.mse_loss(plain(x), y).backward()
                local, average = grads_of(plain), hand_average(plain)
            out = model(x)
            if bad and rank == bad_rank:
                out.register_hook(lambda g: _raise(ValueError("bad batch")))
            try:
                F.mse_loss(out, y).backward()
                opt.step()
            except ValueError:
                assert bad and rank == bad_rank
            except SyncError as exc:
                seen["error"] = str(exc)
                if not server:  # server mode: .grad is never the average; nothing to check
                    ours = grads_of(module)
                    seen["local_diff"], seen["average_diff"] = compare(ours, local), compare(ours, average)
            opt.zero_grad()
        finals[wrapper] = {n: p.detach().clone() for n, p in module.named_parameters()}
        if wrapper == "poseidon":
            seen["outcomes"] = dict(model.comm_stats.outcome_by_bucket)
            model.close()
    return {**seen, "finals": finals, "fingerprint": fingerprint(finals["poseidon"]), "bad_rank": bad_rank}


# ---- item 2: a no_grad forward between the training forward and its backward --------------------------

def no_grad_forward_before_backward(rank: int, world_size: int, hybrid: bool) -> dict:
    options = {"link": slow_link()} if hybrid else {"hybrid": False}
    model = wrap(MLP(), **options)

    def step(m, module, i):
        x, y = data(i, rank)
        out = m(x)
        with torch.no_grad():  # a teacher or logging pass
            m(x * 2)
        F.mse_loss(out, y).backward()

    results = run_steps(model, 4, step, rank)
    model.close()
    return {"steps": results}


# ---- item 3: no_sync accumulation with a branch used only in an earlier micro-batch --------------------

def no_sync_branch_used_early(rank: int, world_size: int, force: str | None) -> dict:
    options = sfb_options("fc1", "side") if force == "SFB" else {"hybrid": False}
    model = wrap(MLP(), **options)

    def step(m, module, i):  # step 0 syncs at once, so the layers are on SFB when accumulation starts
        for micro in range(3 if i else 1):
            x, y = data(i, rank, salt=micro)
            ctx = m.no_sync() if (micro < 2 and i and isinstance(m, PoseidonDDP)) else _null()
            with ctx:
                F.mse_loss(m(x, use_side=(micro == 0)), y).backward()

    results = run_steps(model, 3, step, rank)
    model.close()
    return {"steps": results}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- item 4: SFB must add the factors to whatever else reaches the weight's gradient -------------------

def sfb_pattern(rank: int, world_size: int, pattern: str) -> dict:
    model = wrap(MLP(), link=slow_link(), **sfb_options("fc1", "side", "head"))
    mask = on_device((torch.rand(16, 12, generator=torch.Generator().manual_seed(3)) > 0.5).float())

    def step(m, module, i):
        x, y = data(i, rank)
        weight = module.fc1.weight
        from_now = not hasattr(weight, "masked") and (not pattern.startswith("late_") or i >= 2)  # late_: fc1 on SFB
        if pattern.endswith("weight_hook") and from_now:  # a pruning mask, on both models
            weight.register_hook(lambda g: g * mask)
            weight.masked = True
        if pattern.endswith("post_accumulate_hook") and from_now:  # the mask applied to .grad itself
            def apply_mask(p: torch.Tensor) -> None:
                p.grad.mul_(mask)

            weight.register_post_accumulate_grad_hook(apply_mask)
            weight.masked = True
        if pattern == "retain_graph":
            out = m(x)
            F.mse_loss(out, y).backward(retain_graph=True)
            out.pow(2).mean().backward()
        elif pattern in ("gradient_penalty", "lazy_penalty"):
            x = x.requires_grad_()
            out = m(x)
            loss = F.mse_loss(out, y)
            if pattern == "gradient_penalty" or i == 2:  # lazy: a penalty only every few steps
                (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                loss = loss + 0.1 * gx.pow(2).sum()
            loss.backward()
        elif pattern == "l2_on_weight":  # a penalty that differs by rank, so its average is not its local value
            (F.mse_loss(m(x), y) + 0.01 * (rank + 1) * module.fc1.weight.pow(2).sum()).backward()
        elif pattern.endswith(("weight_hook", "post_accumulate_hook")):
            F.mse_loss(m(x), y).backward()
        elif pattern == "siamese":
            x2, y2 = data(i, rank, rows=2 + i % 3, salt=7)
            loss = F.mse_loss(m(x), y) + F.mse_loss(m(x2), y2)
            loss.backward()
        elif pattern == "inplace_3d":  # F.linear on 3-D input returns a view; relu_ then modifies it
            F.mse_loss(m(x.view(2, 2, -1), inplace=True), y.view(2, 2, -1)).backward()
        elif pattern == "inplace_output":  # the model's output is a view, modified in place by the loss code
            out = m(x.view(2, 2, -1))
            F.mse_loss(out.mul_(2.0), y.view(2, 2, -1)).backward()
        elif pattern in ("grad_call", "lazy_grad_call"):  # local gradients by autograd.grad, then a backward
            out = m(x)
            loss = F.mse_loss(out, y)
            if pattern == "grad_call" or i == 2:
                local_grads(m is module, loss, module)
            loss.backward()
        elif pattern == "call_outside_forward":
            out = m(x)
            extra = module.head(torch.tanh(module.fc1(x * 0.5))).pow(2).mean()
            (F.mse_loss(out, y) + extra).backward()
        else:
            raise ValueError(pattern)

    local: dict[bool, list] = {True: [], False: []}  # autograd.grad results: plain, wrapped

    def local_grads(plain: bool, loss: torch.Tensor, module: nn.Module) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = torch.autograd.grad(loss, [module.fc1.weight, module.fc1.bias, module.head.weight],
                                          retain_graph=True)
            except RuntimeError as exc:
                got = str(exc)
        local[plain].append({"grads": got, "warnings": [str(w.message) for w in caught]})

    try:
        results = run_steps(model, 4, step, rank)
    except RuntimeError as exc:
        model.close()
        return {"steps": [], "error": str(exc)}
    model.close()
    return {"steps": results, "error": None, "local": _compare_local(local)}


def _compare_local(local: dict[bool, list]) -> list[dict]:
    """Per autograd.grad call: its error (or None), warnings, and the largest difference from the plain
    module's local gradients."""
    out = []
    for plain, ours in zip(local[True], local[False]):
        if isinstance(ours["grads"], str):
            out.append({"error": ours["grads"], "warnings": ours["warnings"], "diff": None})
            continue
        diff = max((a - b).abs().max().item() for a, b in zip(ours["grads"], plain["grads"]))
        out.append({"error": None, "warnings": ours["warnings"], "diff": diff})
    return out


# ---- item 5: wrapping the same module twice --------------------------------------------------------------

def wrap_twice(rank: int, world_size: int) -> dict:
    module = MLP()
    first = wrap(module, hybrid=False)
    x, y = data(0, rank)
    F.mse_loss(first(x), y).backward()  # some training with the first wrapper, then a new wrapper
    try:
        second = wrap(module, hybrid=False)
    except Exception as exc:  # failing clearly is allowed
        first.close()
        return {"error": f"{type(exc).__name__}: {exc}", "steps": []}
    first_iterations = first.comm_stats.iterations
    results = run_steps(second, 3, simple_step(rank), rank)
    first_synced = first.comm_stats.iterations - first_iterations
    second.close()
    first.close()
    return {"error": None, "steps": results, "first_still_synced": first_synced}


# ---- item 6: SFB with gradients accumulating across steps keeps the replicas bit-identical ---------------

def sfb_accumulating_grads(rank: int, world_size: int) -> dict:
    model = wrap(MLP(), **sfb_options("fc1", "side", "head"))
    opt = torch.optim.SGD(model.module.parameters(), lr=0.05)
    for step in range(6):
        x, y = data(step, rank)
        F.mse_loss(model(x), y).backward()  # no zero_grad: .grad keeps summing
        opt.step()
    params = fingerprint({n: p for n, p in model.module.named_parameters()})
    outcomes = dict(model.comm_stats.outcome_by_bucket)
    model.close()
    return {"params": params, "outcomes": outcomes}


# ---- item 7: AMP autocast and models with parameters of several dtypes -----------------------------------

def amp_autocast(rank: int, world_size: int, force: str) -> dict:
    options = sfb_options("fc1", "head") if force == "SFB" else {"hybrid": False}
    model = wrap(MLP(), **options)

    def step(m, module, i):
        x, y = data(i, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        F.mse_loss(out.float(), y).backward()

    results = run_steps(model, 4, step, rank)
    model.close()
    return {"steps": results}


class MixedDtype(nn.Module):
    """bf16 linear layers with an fp32 LayerNorm between them (a common low-precision recipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.init_args = ()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(12, 16).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3).to(torch.bfloat16)
        self.to(placement.DEVICE)

    def forward(self, x):
        h = self.norm(self.fc1(x.to(torch.bfloat16)).float())
        return self.head(h.to(torch.bfloat16)).float()


def mixed_dtypes(rank: int, world_size: int) -> dict:
    model = wrap(MixedDtype(), hybrid=False)
    results = run_steps(model, 3, simple_step(rank), rank)
    model.close()
    return {"steps": results}


class HalfMLP(nn.Module):
    """Every parameter in ``dtype`` (bf16 or fp16). ``big``: one Linear(12, 3) without bias, fed ones,
    whose loss (see :func:`half_precision_average`) makes every weight's gradient 40000 on every rank:
    their sum overflows fp16 (max 65504) unless it is taken in fp32."""

    def __init__(self, dtype: torch.dtype, big: bool) -> None:
        super().__init__()
        self.init_args = (dtype, big)
        torch.manual_seed(0)
        self.dtype = dtype
        self.fc1 = nn.Linear(12, 3 if big else 16, bias=not big).to(dtype)
        self.head = nn.Identity() if big else nn.Sequential(nn.Tanh(), nn.Linear(16, 3).to(dtype))
        self.to(placement.DEVICE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc1(x.to(self.dtype))).float()


def half_precision_average(rank: int, world_size: int, dtype_name: str, big: bool, server: bool) -> dict:
    """Two steps on the PS path with every parameter in bf16 or fp16. After each backward ``.grad``
    (default mode) must be, bit for bit, the rank-order sum of every rank's local gradient taken in
    fp32, divided by P and rounded to the dtype once; in parameter-server mode (SGD, lr 1e-3) the new
    parameters must be those torch's SGD makes from that average. Returns the number of elements that
    differ, per step."""
    from poseidon_torch import ServerOptimizer

    dtype = getattr(torch, dtype_name)
    module = HalfMLP(dtype, big)
    model = wrap(module, hybrid=False)
    opt = ServerOptimizer(model, torch.optim.SGD, lr=1e-3) if server else torch.optim.SGD(module.parameters(), lr=1e-3)
    mismatches, finite = [], []
    for step in range(2):
        x, y = data(step, rank)
        if big:
            x = torch.ones_like(x[:1])  # d loss / d W[i, j] = 40000 * x[j] = 40000, exact in fp16

        def loss_of(m: nn.Module) -> torch.Tensor:
            out = m(x)
            return out.sum() * 40000.0 if big else F.mse_loss(out, y)

        plain = plain_copy(module)
        loss_of(plain).backward()
        expected = {}
        for name, p in plain.named_parameters():
            parts = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(parts, p.grad)
            total = parts[0].float()
            for part in parts[1:]:
                total += part.float()
            expected[name] = (total / world_size).to(dtype)
        reference = plain_copy(module)  # the parameters before this step
        loss_of(model).backward()
        if server:
            for name, p in reference.named_parameters():
                p.grad = expected[name]
            torch.optim.SGD(reference.parameters(), lr=1e-3).step()
            opt.step()
            got, want = dict(module.named_parameters()), dict(reference.named_parameters())
        else:
            got, want = {n: p.grad for n, p in module.named_parameters()}, expected
            opt.step()
        mismatches.append(sum(int((got[n] != want[n]).sum()) for n in want))
        finite.append(all(bool(torch.isfinite(got[n]).all()) for n in want))
        opt.zero_grad()
    model.close()
    return {"mismatches": mismatches, "finite": finite}


# ---- item 8: activation checkpointing, reentrant and not, with FC layers inside -------------------------

class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.init_args = (reentrant,)
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.fc1 = nn.Linear(12, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)
        self.to(placement.DEVICE)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.fc1(x))
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def activation_checkpointing(rank: int, world_size: int, reentrant: bool) -> dict:
    model = wrap(Checkpointed(reentrant), link=slow_link(), fusion_bytes=0)
    results = run_steps(model, 4, simple_step(rank), rank)
    model.close()
    return {"steps": results}


class SharedInCheckpoint(nn.Module):
    """A Linear used inside a reentrantly checkpointed block and again outside it: its gradient
    arrives in two parts in one backward, the second after its bucket was submitted (late)."""

    def __init__(self) -> None:
        super().__init__()
        self.init_args = ()
        torch.manual_seed(0)
        self.fc1, self.shared, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.to(placement.DEVICE)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.fc1(x))
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.head(torch.tanh(self.shared(h)))


def late_gradient(rank: int, world_size: int) -> dict:
    model = wrap(SharedInCheckpoint(), hybrid=False, fusion_bytes=0)

    def step(m, module, i):
        x, y = data(i, rank, n_in=6)
        F.mse_loss(m(x), y).backward()

    results = run_steps(model, 3, step, rank)
    late = model.comm_stats.jobs_last_iteration > len(model.bucket_names)  # the late bucket synced twice
    model.close()
    return {"steps": results, "late": late}


def used_only_under_no_sync(rank: int, world_size: int) -> dict:
    """``side`` is used in one no_sync micro-batch at step 0 only: from step 1 on no rank uses it, so its
    ``.grad`` must stay None (as with DDP), not become the average of nothing."""
    model = wrap(MLP(), hybrid=False)

    def step(m, module, i):
        x, y = data(i, rank)
        if i == 0:
            with m.no_sync() if isinstance(m, PoseidonDDP) else _null():
                F.mse_loss(m(x, use_side=True), y).backward()
        F.mse_loss(m(x), y).backward()

    results = run_steps(model, 3, step, rank)
    model.close()
    return {"steps": results}


def join_without_initial_world_size(rank: int, world_size: int) -> str:
    model = wrap(MLP(), hybrid=False)
    try:
        model.join(divide_by_initial_world_size=False)
    except ValueError as exc:
        return str(exc)
    finally:
        model.close()
    return "accepted"


# ---- item 9: a Linear used on some ranks only, under no_sync ---------------------------------------------

def no_sync_layer_on_some_ranks(rank: int, world_size: int) -> dict:
    model = wrap(MLP(), link=slow_link(), fusion_bytes=0)

    def step(m, module, i):
        for micro in range(2):
            x, y = data(i, rank, salt=micro)
            ctx = m.no_sync() if (micro == 0 and isinstance(m, PoseidonDDP)) else _null()
            with ctx:
                F.mse_loss(m(x, use_side=(micro == 0 and rank == 0)), y).backward()

    results = run_steps(model, 4, step, rank)
    model.close()
    return {"steps": results}


# ---- item 10: a process group other than the world --------------------------------------------------------

def subgroup_training(rank: int, world_size: int, members: tuple[int, ...]) -> dict:
    group = dist.new_group(list(members), use_local_synchronization=True) if rank in members else None
    if rank not in members:
        return {"member": False}
    model = wrap(MLP(), process_group=group, link=slow_link(), fusion_bytes=0)
    results = run_steps(model, 3, simple_step(rank), rank, group=group)
    model.close()
    return {"member": True, "steps": results}


# ---- item 11: forward on one rank only; uneven inputs with join() -----------------------------------------

def forward_on_rank0_only(rank: int, world_size: int) -> dict:
    model = wrap(MLP(), link=slow_link(), fusion_bytes=0)

    def step(m, module, i):
        x, y = data(i, rank)
        F.mse_loss(m(x), y).backward()
        if rank == 0 and isinstance(m, PoseidonDDP):  # accuracy on rank 0 only, as training scripts do
            with torch.no_grad():
                m(x)
            m.eval()
            m(x).sum()  # grad-enabled, eval mode, never backpropagated
            m.train()

    start = time.monotonic()
    results = run_steps(model, 3, step, rank)
    model.close()
    return {"steps": results, "seconds": time.monotonic() - start}


def uneven_inputs_join(rank: int, world_size: int, wrapper: str, force: str = "PS") -> dict:
    """Both wrappers train inside ``join()``; returns the final parameters. PS: rank r has 3 + r batches.
    SFB (fc1 and head forced onto it): rank 0 has 1 batch, so it joins before the first pass on SFB
    (every first pass is on PS), and the others 3 + r."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = MLP(seed=5)
    options = sfb_options("fc1", "head") if force == "SFB" else {"hybrid": False}
    model = wrap(module, **options) if wrapper == "poseidon" else DDP(module, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = 1 if force == "SFB" and rank == 0 else 3 + rank
    with model.join():
        for step in range(batches):
            x, y = data(step, rank)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    if wrapper == "poseidon":
        model.close()
    return {"params": params}


# ---- item 12: deepcopy and pickling --------------------------------------------------------------------

def deepcopy_and_pickle(rank: int, world_size: int) -> dict:
    model = wrap(MLP(), link=slow_link(), fusion_bytes=0)
    x, y = data(0, rank)
    F.mse_loss(model(x), y).backward()
    ema = copy.deepcopy(model)
    inner_copy = copy.deepcopy(model.module)  # EMA of the inner module, the other common spelling
    with torch.no_grad():
        ema_out = ema(x)
        inner_out = inner_copy(x)
    restored = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        restored_out = restored(x)

    def step(m, module, i):
        xs, ys = data(i, rank)
        F.mse_loss(m(xs), ys).backward()

    results = run_steps(model, 2, step, rank)
    same = torch.equal(ema_out, restored_out) and torch.equal(ema_out, inner_out)
    model.close()
    return {"steps": results, "copies_agree": same}


def close_releases_hooks(rank: int, world_size: int, through_wrapper: bool) -> dict:
    """After close() the module trains as a plain local module, also when called through the closed
    wrapper: gradients stay rank-local and no engine starts again."""
    module = MLP()
    model = wrap(module, hybrid=False)
    x, y = data(0, rank)
    F.mse_loss(model(x), y).backward()
    model.close()
    module.zero_grad()
    with torch.no_grad():  # the ranks' parameters part ways: a new engine would broadcast rank 0's
        module.fc1.weight.add_(rank)
    F.mse_loss((model if through_wrapper else module)(x), y).backward()
    local = grads_of(module)
    plain = plain_copy(module)
    F.mse_loss(plain(x), y).backward()
    return {"diff_from_local": compare(local, grads_of(plain)), "engine": model.engine is not None,
            "weight_sum": module.fc1.weight.sum().item()}


class FrozenBiasMLP(MLP):
    """fc1's bias frozen, its weight trained (fine-tuning recipes do this)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.fc1.bias.requires_grad_(False)


def frozen_bias(rank: int, world_size: int) -> dict:
    model = wrap(FrozenBiasMLP(), link=slow_link(), fusion_bytes=0)
    results = run_steps(model, 3, simple_step(rank), rank)
    model.close()
    return {"steps": results}


def bias_frozen_midway(rank: int, world_size: int, force: str, server: bool) -> dict:
    """fc1's bias frozen after two steps on ``force``'s path (fine-tuning schedules do this): from then on it
    has no ``.grad`` and SGD leaves it where it was, on every rank, as with torch DDP (``server``: the
    owners step, in parameter-server mode)."""
    from poseidon_torch import ServerOptimizer

    module = MLP()
    model = wrap(module, link=slow_link(), **sfb_options("fc1") if force == "SFB" else {"hybrid": False, "fusion_bytes": 0})
    opt = ServerOptimizer(model, torch.optim.SGD, lr=0.1) if server else torch.optim.SGD(module.parameters(), lr=0.1)
    out = {"paths": [], "grad_after_freeze": [], "moved_after_freeze": []}
    for i in range(4):
        if i == 2:
            module.fc1.bias.requires_grad_(False)
        before = module.fc1.bias.detach().clone()
        x, y = data(i, rank)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        out["paths"].append(model.comm_stats.outcome_by_bucket.get("fc1"))
        if i >= 2:
            out["grad_after_freeze"].append(module.fc1.bias.grad is not None)
        opt.step()
        if i >= 2:
            out["moved_after_freeze"].append((module.fc1.bias - before).abs().max().item())
    model.close()
    return out


BAD_OPTIONS = [{"link": 5}, {"hybrid": "no"}, {"chunk_bytes": "64"}, {"num_channels": 1.5},
               {"overrides": [("fc1", "SFB")]}, {"timeout": "10"}, {"timeout": float("nan")},
               {"timeout": float("inf")}, {"fusion_bytes": True}]


def bad_options(rank: int, world_size: int) -> dict:
    """Each bad option fails at once on every rank (before any collective)."""
    errors = []
    for options in BAD_OPTIONS:
        start = time.monotonic()
        try:
            PoseidonDDP(MLP(), **options)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - what is raised is the result
            errors.append({"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start})
    return {"errors": errors}


# ---- torch DDP's constructor arguments -------------------------------------------------------------------

def ddp_arguments(rank: int, world_size: int, forget_notes: bool = False) -> dict:
    """What torch DDP's arguments do here: each accepted one trains exactly (the hand average), the
    refused ones fail at once with the argument's name, the honoured ones act."""
    from poseidon_torch import compat
    from poseidon_torch.compat import NOT_NEEDED

    if forget_notes:  # said once per process: this worker may have said them for an earlier test
        compat._noted.clear()
    out: dict = {"refused": {}, "accepted": {}, "notes": []}
    # a device the module is not on (on the CPU any device id; on a GPU another index than its own)
    elsewhere = 0 if placement.DEVICE.type == "cpu" else placement.DEVICE.index + 1
    out["module_device"] = str(placement.DEVICE)
    refused = {"device_ids": {"device_ids": [elsewhere]}, "output_device": {"output_device": elsewhere},
               "mixed_precision": {"mixed_precision": object()},
               "delay_all_reduce_named_params": {"delay_all_reduce_named_params": []},
               "bucket_cap_mb": {"bucket_cap_mb": 1.0, "fusion_bytes": 1024}}
    for name, kwargs in refused.items():
        try:
            PoseidonDDP(MLP(), **kwargs).close()
            out["refused"][name] = None
        except (ValueError, TypeError) as exc:
            out["refused"][name] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # positional, in DDP's order: device_ids, output_device, dim, broadcast_buffers, init_sync, process_group,
        # bucket_cap_mb, find_unused_parameters, check_reduction, gradient_as_bucket_view, static_graph
        model = PoseidonDDP(MLP(), None, None, 0, True, True, None, 0.0001, True, False, True, True, timeout=30,
                            hybrid=False)
    out["notes"] = [str(w.message) for w in caught if "PoseidonDDP:" in str(w.message)]
    out["expected_notes"] = sorted(n for n in NOT_NEEDED if n in ("find_unused_parameters", "gradient_as_bucket_view",
                                                                   "static_graph"))
    out["fusion_bytes"] = model.options.fusion_bytes
    results = run_steps(model, 3, simple_step(rank), rank)
    out["buckets"] = len(model.bucket_names)  # a 104-byte cap keeps the layers apart (the head alone holds 204 bytes)
    model.require_backward_grad_sync = False  # what accelerate and older loops set instead of no_sync()
    x, y = data(9, rank)
    plain = plain_copy(model.module)
    F.mse_loss(plain(x), y).backward()
    model.module.zero_grad()
    F.mse_loss(model(x), y).backward()
    out["local_after_flag"] = compare(grads_of(model.module), grads_of(plain))
    model.close()
    with torch.no_grad():  # init_sync=False: rank 0's state is not copied (the ranks start apart)
        module = MLP()
        module.fc1.weight.add_(rank)
    unsynced = PoseidonDDP(module, init_sync=False, hybrid=False, timeout=30)
    out["init_sync_false_weight_sum"] = module.fc1.weight.sum().item()
    unsynced.close()
    return {**out, "steps": results}
