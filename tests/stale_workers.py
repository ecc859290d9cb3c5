"""Rank functions for the SSP / asynchronous tests (``ServerOptimizer(..., staleness=s)``).

The *ledger* model makes every push visible: one parameter ``w`` with a slot per (rank, clock); the
loss of rank r at clock c is ``w[slot(r, c)]``, so its gradient is one-hot, and with plain SGD at lr 1
an owner that applies the push sets that slot to -1/P (the gradient divided by P). What a forward
reads therefore says exactly which pushes of which ranks and clocks it contains.
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn

from poseidon_torch import PoseidonDDP, ServerOptimizer, SyncError


class Ledger(nn.Module):
    """``w[rank * steps + clock]`` is the slot of that rank's push at that clock; the forward records
    what it read."""

    def __init__(self, world_size: int, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.w = nn.Parameter(torch.zeros(world_size * steps))
        self.reads: list[torch.Tensor] = []

    def forward(self, slot: torch.Tensor) -> torch.Tensor:
        self.reads.append(self.w.detach().clone())
        return (self.w * slot).sum()


def _one_hot(model: Ledger, rank: int, clock: int) -> torch.Tensor:
    slot = torch.zeros_like(model.w)
    slot[rank * model.steps + clock] = 1.0
    return slot


def ledger_run(rank: int, world_size: int, staleness: int | None, steps: int, sleeps: list[list[float]],
               own_steps: list[int] | None = None, raise_at: tuple[int, int] | None = None,
               push_every: int = 1, fetch_every: int = 1, timeout: float = 30) -> dict:
    """Train the ledger for ``steps`` clocks (``own_steps[rank]`` on this rank when given: uneven data),
    sleeping ``sleeps[rank][clock]`` seconds after each step (stragglers); ``raise_at`` = (rank, clock):
    that rank's backward raises there and the rank catches it and trains on. Returns what every forward
    read, the reported staleness and the bytes sent per step, and the parameters after ``finish()``."""
    model = Ledger(world_size, steps)
    wrapped = PoseidonDDP(model, timeout=timeout, hybrid=False)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=1.0, staleness=staleness, push_every=push_every,
                          fetch_every=fetch_every)
    reported, caught, sent = [], [], []
    for clock in range((own_steps or [steps] * world_size)[rank]):
        loss = wrapped(_one_hot(model, rank, clock))
        if raise_at == (rank, clock):
            loss.register_hook(_raise)
        try:
            loss.backward()
        except RuntimeError as exc:
            caught.append(clock)
            assert "injected" in str(exc), exc
        opt.step()
        opt.zero_grad()
        reported.append(opt.last_staleness)
        sent.append(wrapped.comm_stats.bytes_sent_last_iteration)
        time.sleep(sleeps[rank][clock])
    opt.finish()
    final = model.w.detach().clone()
    owns = bool(opt.server.shards)
    wrapped.close()
    return {"reads": [r.tolist() for r in model.reads], "reported": reported, "final": final.tolist(),
            "caught": caught, "sent": sent, "owns": owns}


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected failure in backward")


def least_squares(rank: int, world_size: int, staleness: int | None, steps: int, straggler_s: float,
                  **downpour: int) -> dict:
    """SGD on a least-squares problem with a known optimum; rank 1 pauses ``straggler_s`` every 3rd step;
    ``downpour``: push_every, fetch_every."""
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(512, 6, generator=gen)
    w_star = torch.randn(6, 1, generator=gen)
    y_all = x_all @ w_star
    torch.manual_seed(1)
    model = nn.Linear(6, 1, bias=False)
    wrapped = PoseidonDDP(model, timeout=30)  # hybrid, the default: an FC layer SSP keeps on PS
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, staleness=staleness, **downpour)
    batches = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        index = torch.randint(0, 512, (32,), generator=batches)
        loss = ((wrapped(x_all[index]) - y_all[index]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 1 and step % 3 == 0:
            time.sleep(straggler_s)
    opt.finish()
    error = float((model.weight.detach().t() - w_star).norm() / w_star.norm())
    wrapped.close()
    return {"relative_error": error, "weight": model.weight.detach().clone()}


def dies_or_raises(rank: int, world_size: int, staleness: int | None, how: str, chunk_bytes: int | None = 64,
                   pause_s: float = 0.05, timeout: float = 5, **downpour: int) -> dict:
    """Rank 1 exits (``how`` = "exit") or raises out of its training loop (``how`` = "raise") at step
    3; the other ranks must end with a SyncError that names the cause within the timeout. 64-byte
    chunks: every rank owns some; None: the default 2 MB ones, so rank 0 owns the one chunk."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    wrapped = PoseidonDDP(model, timeout=timeout, hybrid=False, **options)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.01, staleness=staleness, **downpour)
    start = None
    try:
        for step in range(40):
            if rank == 1 and step == 3:
                if how == "exit":
                    os._exit(3)
                raise ValueError("the user's training loop failed")
            if step == 3:
                start = time.monotonic()
            wrapped(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(pause_s)
        opt.finish()
    except SyncError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - (start or time.monotonic())}
    except ValueError as exc:
        return {"raised": str(exc)}
    return {"error": None}


def checkpoint_resume(rank: int, world_size: int, staleness: int | None) -> dict:
    """Train, finish, save the model and the consolidated optimizer state; load both into a fresh
    model and optimizer (the model first, as users do); what the second ones hold after ``finish()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    wrapped = PoseidonDDP(model, timeout=30, hybrid=False)
    opt = ServerOptimizer(wrapped, torch.optim.AdamW, lr=0.01, staleness=staleness)
    data = torch.Generator().manual_seed(rank)
    for _ in range(5):
        wrapped(torch.randn(8, 6, generator=data)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    opt.consolidate_state_dict(to=0)
    saved_opt = opt.state_dict() if rank == 0 else None
    saved_opt = _broadcast(saved_opt)

    torch.manual_seed(123)  # other initial values: the load must replace them
    model2 = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    wrapped2 = PoseidonDDP(model2, timeout=30, hybrid=False)
    opt2 = ServerOptimizer(wrapped2, torch.optim.AdamW, lr=0.01, staleness=staleness)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    opt2.finish()
    params_equal = all(torch.equal(v, model2.state_dict()[k]) for k, v in saved_model.items())
    opt2.consolidate_state_dict(to=0)
    reloaded = opt2.state_dict() if rank == 0 else None
    state_equal = None
    if rank == 0:
        state_equal = all(torch.equal(saved_opt["state"][k][name], value) for k, entry in reloaded["state"].items()
                          for name, value in entry.items())
        state_equal = state_equal and saved_opt["state"].keys() == reloaded["state"].keys()
    for _ in range(3):  # and it trains on
        wrapped2(torch.randn(8, 6, generator=data)).pow(2).mean().backward()
        opt2.step()
        opt2.zero_grad()
    opt2.finish()
    after = torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
    wrapped.close()
    wrapped2.close()
    saved = torch.cat([v.reshape(-1) for v in saved_model.values()])
    return {"params_equal": params_equal, "state_equal": state_equal, "after": after, "saved": saved}


def _broadcast(obj: object) -> object:
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def loaded_without_finish(rank: int, world_size: int) -> str:
    """Loading parameters mid-training, then training on without ``finish()``: a clear refusal."""
    model = nn.Linear(3, 1)
    wrapped = PoseidonDDP(model, timeout=30, hybrid=False)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, staleness=1)
    wrapped(torch.randn(2, 3)).sum().backward()
    opt.step()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    try:
        wrapped(torch.randn(2, 3)).sum().backward()
        message = "trained on"
    except RuntimeError as exc:
        message = str(exc)
    opt.finish()
    wrapped.close()
    return message


def edited_in_place(rank: int, world_size: int, when: str) -> dict:
    """Every rank writes a parameter in place (before the first step, or after ``synchronize()`` or
    ``finish()``), then tries to train on; then ``finish()`` and two steps at lr 0: the written value
    must be what every rank holds at the end."""
    model = nn.Linear(3, 1)
    wrapped = PoseidonDDP(model, timeout=30, hybrid=False)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.0, staleness=1)
    x = torch.randn(2, 3)
    if when != "before-first-step":
        wrapped(x).sum().backward()
        opt.step()
        opt.finish() if when == "after-finish" else wrapped.synchronize()
    with torch.no_grad():
        model.weight.fill_(7.0)
    try:
        wrapped(x).sum().backward()
        message = "trained on"
    except RuntimeError as exc:
        message = str(exc)
    opt.finish()
    for _ in range(2):
        wrapped(x).sum().backward()
        opt.step()
    opt.finish()
    weight = model.weight.detach().clone()
    wrapped.close()
    return {"message": message, "weight": weight}


def written_on_one_rank(rank: int, world_size: int) -> dict:
    """Only rank 1 writes a parameter; it is refused, the others train on; ``finish()`` must say that
    the ranks held different values, and leave every rank with the same ones."""
    model = nn.Linear(3, 1)
    wrapped = PoseidonDDP(model, timeout=30, hybrid=False)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, staleness=1)
    wrapped(torch.randn(2, 3)).sum().backward()
    wrapped.synchronize()
    if rank == 1:
        with torch.no_grad():
            model.weight.fill_(7.0)
    try:
        wrapped(torch.randn(2, 3)).sum().backward()
    except RuntimeError:
        pass  # rank 1's refusal: tested elsewhere
    try:
        opt.finish()
        message = "finished"
    except RuntimeError as exc:
        message = str(exc)
    state = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    wrapped.close()
    return {"message": message, "state": state}


def same_as_default(rank: int, world_size: int) -> dict:
    """Three steps of AdamW: ``staleness=0`` passed, the argument left out, and torch DDP with a plain
    AdamW, from the same weights on the same data; and the policy the engine ran."""
    out = {}
    for name in ("zero", "default", "ddp"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
        if name == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(wrapped.parameters(), lr=0.01)
        else:
            wrapped = PoseidonDDP(model, timeout=30)
            opt = ServerOptimizer(wrapped, torch.optim.AdamW, lr=0.01, **({"staleness": 0} if name == "zero" else {}))
            out[f"{name}_lockstep"] = wrapped.engine.mode.lockstep
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            wrapped(torch.randn(4, 5, generator=data)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        if name != "ddp":
            opt.finish()
            wrapped.close()
        out[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


def refusals(rank: int, world_size: int) -> list[str]:
    model = nn.Linear(3, 1)
    messages = []
    for kwargs in ({"staleness": 1, "delay": 1}, {"staleness": None, "max_grad_norm": 1.0},
                   {"staleness": 2, "lazy_pull": True}, {"staleness": -1}, {"staleness": 1.5},
                   {"staleness": 1, "push_every": 2}, {"staleness": None, "fetch_every": 0},
                   {"staleness": None, "push_every": True}, {"staleness": 1 + rank}):
        wrapped = PoseidonDDP(model, timeout=30)
        try:
            ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, **kwargs)
            messages.append("accepted")
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
        wrapped.close()
    return messages


def traced_staleness(rank: int, world_size: int, trace_dir: str) -> dict:
    """A traced SSP run (s = 1) with the last rank a persistent straggler: the clock and staleness the
    tracer's iteration spans carry, and what ``last_staleness`` said at each step."""
    from poseidon_torch.trace import load_spans

    steps = 8
    model = Ledger(world_size, steps)
    wrapped = PoseidonDDP(model, timeout=30, hybrid=False, trace_dir=trace_dir, trace_skip=1, trace_iters=5)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=1.0, staleness=1)
    reported = []
    for clock in range(steps):
        wrapped(_one_hot(model, rank, clock)).backward()
        opt.step()
        reported.append(opt.last_staleness)
        if rank == world_size - 1:
            time.sleep(0.1)
    opt.finish()
    wrapped.close()
    spans = load_spans(f"{trace_dir}/trace_rank{rank}.json")[rank]
    return {"iterations": [span.args for span in spans if span.kind == "iteration"], "reported": reported}


def stale_buckets(rank: int, world_size: int, fusion_bytes: int | None) -> dict:
    """The sizes of the buckets SSP fuses for six 512 KiB layers (3 MiB), which two steps then train on."""
    model = nn.Sequential(*[nn.Linear(256, 512, bias=False) if i % 2 == 0 else nn.Linear(512, 256, bias=False)
                            for i in range(6)])
    wrapped = PoseidonDDP(model, timeout=30, hybrid=False, fusion_bytes=fusion_bytes)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.01, staleness=1)
    engine = wrapped.engine
    sizes = [sum(p.numel() * p.element_size() for p in bucket.params) for bucket in engine.buckets]
    x = torch.randn(4, 256)
    for _ in range(2):
        wrapped(x).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.finish()
    wrapped.close()
    return {"sizes": sizes}
