"""Rank functions for the Pipe-SGD tests (``PoseidonDDP(delay=k)``, ``ServerOptimizer(delay=k)``); the
single-process references they are held to are ``training``'s."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import placement
from models import ModelSpec, batch, build
from poseidon_torch import PoseidonDDP, SyncError
from training import OPTIMIZERS, delayed_sgd, shard


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[kind]
    return cls(params, **kwargs)


def paused(job_class: type, seconds: float) -> type:
    """``job_class`` (a path's, or a mode's job's) whose jobs pause ``seconds`` first: a sync that takes
    ``seconds`` (in Python: the native core does not run it)."""

    class Paused(job_class):
        native = False

        def sync(self, bucket, groups, ctx):
            yield "network"
            time.sleep(seconds)
            return (yield from super().sync(bucket, groups, ctx))

    return Paused


def overlap(rank: int, world_size: int, delay: int, seconds: float, server: bool = False,
            idle: float = 0.0) -> dict:
    """Steps whose sync jobs each take ``seconds``, ``idle`` seconds apart (the rest of an iteration):
    how long the forward and ``backward()`` with ``step()`` took, and whether every job of the pass was
    done when they returned (after the forward: the last step's pass)."""
    spec = ModelSpec(widths=(8, 8))
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, delay=0 if server else delay, hybrid=False)
    if server:
        from server_workers import server_job

        opt = _server_optimizer(wrapped, "sgd", delay=delay)
        jobs = [server_job(wrapped.engine, "PS")]
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        jobs = list(wrapped.engine.paths.values())
    for job in jobs:
        job.__class__ = paused(type(job), seconds)
    forward_s, backward_s, done_after_forward, done_at_return = [], [], [], []
    engine = wrapped.engine
    for step in range(4):
        opt.zero_grad()
        x, y = batch(spec, step, 2, world_size)
        dist.barrier()  # the ranks start each step together: a loaded machine's skew is not waited for
        start = time.monotonic()
        out = wrapped(shard(x, rank, 2))
        forward_s.append(time.monotonic() - start)
        done_after_forward.append(all(engine.core.done(b.index) for b in engine.buckets))
        loss = F.mse_loss(out, shard(y, rank, 2))
        start = time.monotonic()
        loss.backward()
        opt.step()
        backward_s.append(time.monotonic() - start)
        done_at_return.append(all(engine.core.done(b.index) for b in engine.buckets))
        time.sleep(idle)
    wrapped.close()
    return {"forward_s": forward_s, "backward_s": backward_s, "done_after_forward": done_after_forward,
            "done_at_return": done_at_return}


def _sgd_steps(wrapped: PoseidonDDP, spec: ModelSpec, rank: int, world_size: int, steps: int, lr: float) -> None:
    """``steps`` plain SGD steps of ``wrapped`` on this rank's half of the test batches."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(spec, step, 2, world_size)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()


def _threads() -> dict[int, tuple[str, int]]:
    """This process's threads: native id -> (name, nice value)."""
    threads = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            threads[tid] = (Path(f"/proc/self/task/{tid}/comm").read_text().strip(),
                            os.getpriority(os.PRIO_PROCESS, tid))
    return threads


def thread_priorities(rank: int, world_size: int, delay: int, engine: str) -> dict:
    """The training thread's nice value before wrapping and after two steps, and the name and nice value
    of every thread that wrapping and those steps started (a local step first, so that nothing torch
    starts lazily for the compute is counted)."""
    spec = ModelSpec(widths=(16, 8))
    model = build(spec, seed=0)
    x, y = batch(spec, 0, 2, world_size)
    F.mse_loss(model(shard(x, rank, 2)), shard(y, rank, 2)).backward()
    model.zero_grad()
    training = threading.get_native_id()
    before = _threads()
    wrapped = PoseidonDDP(model, timeout=60, delay=delay, engine=engine)
    _sgd_steps(wrapped, spec, rank, world_size, steps=2, lr=0.01)
    after = _threads()
    wrapped.close()
    return {"training": (before[training][1], after[training][1]),
            "started": {tid: after[tid] for tid in after.keys() - before.keys()}}


def _server_steps(spec: ModelSpec, rank: int, world_size: int, wrapped: PoseidonDDP, opt, first: int,
                  last: int) -> None:
    """Steps ``first..last-1`` of parameter-server training (3 samples per rank)."""
    for step in range(first, last):
        x, y = batch(spec, step, 3, world_size)
        F.mse_loss(wrapped(shard(x, rank, 3)), shard(y, rank, 3)).backward()
        opt.step()
        opt.zero_grad()  # a checkpoint carries no .grad: what is pushed must not depend on one


def _consolidated_here(opt, rank: int, world_size: int) -> dict:
    """The whole optimizer state on this rank (consolidated on every rank in turn: collective)."""
    for to in range(world_size):
        opt.consolidate_state_dict(to=to)
        if to == rank:
            state = opt.state_dict()
    return state


def server_checkpoint_resume(rank: int, world_size: int, delay: int) -> dict:
    """As :func:`checkpoint_resume` with ``ServerOptimizer(AdamW, delay=k)``: the optimizer state
    consolidated on every rank in turn, the values in flight carried by the consistency state."""
    spec = ModelSpec(widths=(8, 5))

    def steps(wrapped, opt, first: int, last: int) -> None:
        _server_steps(spec, rank, world_size, wrapped, opt, first, last)

    def fresh(seed: int):
        model = build(spec, seed=seed)
        wrapped = PoseidonDDP(model, timeout=60)
        return model, wrapped, _server_optimizer(wrapped, "adamw", delay=delay)

    model, wrapped, opt = fresh(spec.seed)
    steps(wrapped, opt, 0, 6)
    straight = {"held": wrapped.consistency_state_dict()["held"], "state": dict(model.state_dict())}
    wrapped.close()

    model, wrapped, opt = fresh(spec.seed)
    steps(wrapped, opt, 0, 3)
    saved = {"model": {k: v.clone() for k, v in wrapped.state_dict().items()},
             "opt": _consolidated_here(opt, rank, world_size), "delay": wrapped.consistency_state_dict()}
    wrapped.close()
    model, wrapped, opt = fresh(spec.seed + 1)
    wrapped.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    wrapped.load_consistency_state_dict(saved["delay"])
    steps(wrapped, opt, 3, 6)
    resumed = {"held": wrapped.consistency_state_dict()["held"], "state": dict(model.state_dict())}
    wrapped.close()
    return {"straight": straight, "resumed": resumed}


def checkpoint_resume(rank: int, world_size: int, delay: int, optimizer: str) -> dict:
    """Train 5 steps straight, and 2 steps, a checkpoint (model, optimizer, the gradients in flight)
    restored into a new model and wrapper, then the other 3: both final states."""
    spec = ModelSpec(widths=(8, 5))

    def steps(wrapped, opt, first: int, last: int) -> None:
        for step in range(first, last):
            opt.zero_grad()
            x, y = batch(spec, step, 3, world_size)
            F.mse_loss(wrapped(shard(x, rank, 3)), shard(y, rank, 3)).backward()
            opt.step()

    def fresh(seed: int):
        model = build(spec, seed=seed)
        wrapped = PoseidonDDP(model, timeout=60, delay=delay)
        return model, wrapped, make_optimizer(optimizer, wrapped.parameters())

    model, wrapped, opt = fresh(spec.seed)
    steps(wrapped, opt, 0, 5)
    straight = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.close()

    model, wrapped, opt = fresh(spec.seed)
    steps(wrapped, opt, 0, 2)
    saved = {"model": {k: v.clone() for k, v in wrapped.state_dict().items()}, "opt": opt.state_dict(),
             "delay": wrapped.consistency_state_dict()}
    in_flight = len(saved["delay"]["in_flight"])
    wrapped.close()
    model, wrapped, opt = fresh(spec.seed + 1)  # other initial values: all of them come from the checkpoint
    wrapped.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    wrapped.load_consistency_state_dict(saved["delay"])
    steps(wrapped, opt, 2, 5)
    resumed = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.close()
    return {"straight": straight, "resumed": resumed, "in_flight": in_flight}


#: how each consistency mode is set up for :func:`checkpointing_keeps_the_trajectory`: the wrapper's options
#: and the optimizer (a ServerOptimizer for a server mode)
CHECKPOINTED_SETUPS = {
    "pipe-sgd": ({"delay": 2}, None),
    "server-lazy-pull": ({}, {"lazy_pull": True}),
    "server-delay": ({}, {"delay": 1}),
    "periodic-delay": ({"sync_every": 2, "delay": 1}, None),
}


def checkpointing_keeps_the_trajectory(rank: int, world_size: int, setup: str) -> dict[str, dict]:
    """8 AdamW steps over a slow link (the coordinator moves the FC layers to SFB after a few passes)
    under ``setup`` (:data:`CHECKPOINTED_SETUPS`), twice: straight, and with ``consistency_state_dict()``
    and ``synchronize()`` after every step (a checkpoint taken while a sync is in flight, training going
    on): each run's final parameters."""
    from patterns import slow_link

    from poseidon_torch import ServerOptimizer

    options, server = CHECKPOINTED_SETUPS[setup]
    spec, runs = ModelSpec(widths=(8, 5)), {}
    for name in ("straight", "checkpointed"):
        model = build(spec, seed=spec.seed)
        wrapped = PoseidonDDP(model, timeout=60, link=slow_link(), fusion_bytes=0, **options)
        opt = make_optimizer("adamw", wrapped.parameters()) if server is None else \
            ServerOptimizer(wrapped, torch.optim.AdamW, lr=0.01, **server)
        for step in range(8):
            _train_step(wrapped, opt, spec, rank, world_size, step)
            if name == "checkpointed":
                wrapped.consistency_state_dict()
                wrapped.synchronize()
        wrapped.synchronize()  # a server mode's last values landed (changes no trajectory: the run ends)
        runs[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        wrapped.close()
    return runs


def _train_step(wrapped: PoseidonDDP, opt, spec: ModelSpec, rank: int, world_size: int, step: int) -> None:
    opt.zero_grad()
    x, y = batch(spec, step, 3, world_size)
    F.mse_loss(wrapped(shard(x, rank, 3)), shard(y, rank, 3)).backward()
    opt.step()


def refused(rank: int, world_size: int, what: str) -> str:
    """The error a misuse of ``delay`` gets ("" if none)."""
    from poseidon_torch import ServerOptimizer

    model = build(ModelSpec(widths=(4,)), seed=0)
    try:
        if what == "negative":
            PoseidonDDP(model, delay=-1)
        elif what == "bool":
            PoseidonDDP(model, delay=True)
        elif what == "differs":
            PoseidonDDP(model, delay=rank)
        elif what.startswith("server_"):
            wrapped = PoseidonDDP(model)
            ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, delay=-1 if what == "server_negative" else rank)
        else:
            wrapped = PoseidonDDP(model, delay=1)
            if what == "join":
                wrapped.join()
            elif what == "server":
                ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1)
            elif what == "wrong_state":
                wrapped.load_consistency_state_dict({"delay": 2, "in_flight": []})
            wrapped.close()
    except Exception as exc:  # the test reads type and message
        return f"{type(exc).__name__}: {exc}"
    return ""


def _server_optimizer(wrapped: PoseidonDDP, optimizer: str, **options):
    from poseidon_torch import ServerOptimizer

    cls, kwargs = OPTIMIZERS[optimizer]
    return ServerOptimizer(wrapped, cls, **options, **kwargs)


def misused_loop(rank: int, world_size: int, loop: str) -> str:
    """A loop with more than one synced backward per optimizer step under delay=1: the error, or ""."""
    spec = ModelSpec(widths=(6,))
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=30, delay=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    previous = None
    try:
        for step in range(3):
            opt.zero_grad()
            x, y = batch(spec, step, 4, world_size)
            if loop == "previous_steps_graph":  # again through the last step's graph, no forward since
                loss = F.mse_loss(wrapped(shard(x, rank, 4)), shard(y, rank, 4))
                loss.backward(retain_graph=True)
                if previous is not None:
                    opt.zero_grad()
                    previous.backward()
                previous = loss
            elif loop == "accumulate_without_no_sync":
                for half in (slice(0, 2), slice(2, 4)):
                    F.mse_loss(wrapped(shard(x, rank, 4)[half]), shard(y, rank, 4)[half]).backward()
            elif loop == "retained_graph":
                loss = F.mse_loss(wrapped(shard(x, rank, 4)), shard(y, rank, 4))
                loss.backward(retain_graph=True)
                loss.backward()
            else:  # never zero_grad: the handed-out average would be synced again with the next gradient
                F.mse_loss(wrapped(shard(x, rank, 4)), shard(y, rank, 4)).backward()
                opt.step()
                opt.zero_grad = lambda: None
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    finally:
        wrapped.close()
    return ""


def raise_in_last_step(rank: int, world_size: int, delay: int) -> dict:
    """The last rank's backward raises in the last step and it closes its wrapper: how long the others
    waited and what they got."""
    spec = ModelSpec(widths=(6,))
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, delay=delay)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome = ""
    for step in range(3):
        opt.zero_grad()
        x, y = batch(spec, step, 2, world_size)
        out = wrapped(shard(x, rank, 2))
        if step == 2 and rank == world_size - 1:
            out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("bad batch")))
        start = time.monotonic()
        try:
            F.mse_loss(out, shard(y, rank, 2)).backward()
        except (ValueError, SyncError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        waited = time.monotonic() - start
        opt.step()
    closed, close_s = timed_close(wrapped)
    return {"outcome": outcome, "waited_s": waited, "closed": closed, "close_s": close_s}


def timed_close(wrapped: PoseidonDDP) -> tuple[str, float]:
    """``close()``: "" or the error it raised, and the seconds it took."""
    start = time.monotonic()
    try:
        wrapped.close()
        closed = ""
    except Exception as exc:  # the tests inspect it
        closed = f"{type(exc).__name__}: {exc}"
    return closed, time.monotonic() - start


def raise_alone(rank: int, world_size: int, delay: int) -> list[tuple[int, str, str]]:
    """The last rank's backward raises at step 2 and every rank catches what it gets, as a loop that
    skips bad batches would; (step, where, what) of every exception, until the engine refuses to go on."""
    spec = ModelSpec(widths=(6,))
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=30, delay=delay)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []
    for step in range(5):
        opt.zero_grad()
        x, y = batch(spec, step, 2, world_size)
        where = "forward"
        try:
            out = wrapped(shard(x, rank, 2))
            if step == 2 and rank == world_size - 1:
                out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("bad batch")))
            where = "backward"
            F.mse_loss(out, shard(y, rank, 2)).backward()
            opt.step()
        except (ValueError, SyncError) as exc:
            events.append((step, where, f"{type(exc).__name__}: {exc}"))
            if str(exc).startswith("PoseidonDDP cannot continue after a failed sync"):
                break
    with contextlib.suppress(SyncError):
        wrapped.close()
    return events


def late_rank(rank: int, world_size: int, delay: int, seconds: float) -> dict:
    """A BatchNorm CNN; the last rank sleeps ``seconds`` before its forward at step 2. Rank by rank:
    how long step 2 (forward to optimizer step) took, and the final state."""
    spec = ModelSpec(conv_channels=(4,), batchnorm=True)
    model = build(spec, seed=spec.seed)
    wrapped = PoseidonDDP(model, timeout=60, delay=delay)
    opt = make_optimizer("sgd", model.parameters())
    step_s = []
    for step in range(5):
        opt.zero_grad()
        x, y = batch(spec, step, 2, world_size)
        if step == 2 and rank == world_size - 1:
            time.sleep(seconds)
        start = time.monotonic()
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()
        step_s.append(time.monotonic() - start)
    wrapped.close()
    return {"step_s": step_s, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class _WithMean(torch.nn.Module):
    """A model that keeps a running mean of its outputs in a buffer it *replaces* in every forward."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("output_mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.output_mean = 0.9 * self.output_mean + 0.1 * out.detach().mean(0)
        return out


def buffers_at_forward(rank: int, world_size: int, delay: int, replaced: bool = False) -> list[dict[str, torch.Tensor]]:
    """The buffers (BatchNorm's running statistics; with ``replaced`` also a buffer the forward replaces
    instead of updating in place) each synced training forward starts from."""
    spec = ModelSpec(conv_channels=(4,), batchnorm=True)
    model = build(spec, seed=spec.seed)
    model = _WithMean(model).to(placement.DEVICE) if replaced else model
    seen = []
    model.register_forward_pre_hook(lambda m, _: seen.append({k: b.clone() for k, b in m.named_buffers()}))
    wrapped = PoseidonDDP(model, timeout=60, delay=delay)
    _sgd_steps(wrapped, spec, rank, world_size, steps=4, lr=0.1)
    wrapped.close()
    return seen


def server_final_model(rank: int, world_size: int, delay: int) -> dict:
    """ServerOptimizer(delay=k): the parameters after training (what the next forward reads), after an
    evaluation forward, and after ``finish()``; the newest values held."""
    spec = ModelSpec(widths=(8, 5))
    model = build(spec, seed=spec.seed)
    wrapped = PoseidonDDP(model, timeout=60)
    opt = _server_optimizer(wrapped, "sgd", delay=delay)
    for step in range(STEPS_FINAL):
        x, y = batch(spec, step, 3, world_size)
        F.mse_loss(wrapped(shard(x, rank, 3)), shard(y, rank, 3)).backward()
        opt.step()
        opt.zero_grad()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        wrapped(batch(spec, 0, 3, world_size)[0])
    after_eval = {k: v.clone() for k, v in model.state_dict().items()}
    newest = dict(wrapped.consistency_state_dict()["held"][-1][1])
    opt.finish()
    finished = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped.close()
    return {"after": after, "after_eval": after_eval, "newest": newest, "finished": finished}


STEPS_FINAL = 5


def server_resume_order(rank: int, world_size: int, order: str) -> dict:
    """Resume a ServerOptimizer(delay=1) run loading the checkpoint's parts in ``order``; then a bad
    consistency state is refused and changes nothing. The newest values after 2 more steps, and what
    the bad load said."""
    spec = ModelSpec(widths=(8, 5))

    def steps(wrapped, opt, first: int, last: int) -> None:
        _server_steps(spec, rank, world_size, wrapped, opt, first, last)

    model = build(spec, seed=spec.seed)
    wrapped = PoseidonDDP(model, timeout=60)
    opt = _server_optimizer(wrapped, "sgd", delay=1)
    steps(wrapped, opt, 0, 3)
    saved_opt = _consolidated_here(opt, rank, world_size)
    saved = {"model": {k: v.clone() for k, v in wrapped.state_dict().items()},
             "delay": wrapped.consistency_state_dict()}
    steps(wrapped, opt, 3, 5)
    straight = dict(wrapped.consistency_state_dict()["held"][-1][1])
    wrapped.close()
    model = build(spec, seed=spec.seed + 1)
    wrapped = PoseidonDDP(model, timeout=60)
    opt = _server_optimizer(wrapped, "sgd", delay=1)
    opt.load_state_dict(saved_opt)
    for part in order.split(","):
        if part == "model":
            wrapped.load_state_dict(saved["model"])
        else:
            wrapped.load_consistency_state_dict(saved["delay"])
    errors = []
    for bad in ({"delay": 1, "in_flight": []}, {"delay": True, "held": []}, {"delay": 1, "held": [(0, {"x": 1})]},
                {"delay": 1, "held": [(-1, {"head.weight": torch.zeros(2, 2)})]}):
        try:
            wrapped.load_consistency_state_dict(bad)
        except ValueError as exc:
            errors.append(str(exc))
    steps(wrapped, opt, 3, 5)
    resumed = dict(wrapped.consistency_state_dict()["held"][-1][1])
    wrapped.close()
    return {"straight": straight, "resumed": resumed, "errors": errors}


def late_gradient_delayed(rank: int, world_size: int, delay: int) -> dict:
    """A layer used inside a reentrant checkpoint and outside it, so on every rank part of its gradient
    arrives after its bucket's sync: the parameters after 4 steps, and whether that happened."""
    from patterns import SharedInCheckpoint, data

    model = SharedInCheckpoint()
    wrapped = PoseidonDDP(model, timeout=60, delay=delay, hybrid=False, fusion_bytes=0)
    opt = make_optimizer("sgd", model.parameters())
    late = []
    for step in range(4):
        opt.zero_grad()
        x, y = data(step, rank, n_in=6)
        F.mse_loss(wrapped(x), y).backward()
        late.append(any(wrapped.engine.core.late(b.index) for b in wrapped.engine.buckets))
        opt.step()
    wrapped.close()
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "late": late}


def reference_late_gradient(delay: int, world_size: int) -> dict[str, torch.Tensor]:
    """:func:`late_gradient_delayed`'s model under k-delayed SGD in one process, on every rank's data."""
    from patterns import SharedInCheckpoint, data

    def backward(model: torch.nn.Module, step: int) -> None:
        batches = [data(step, r, n_in=6) for r in range(world_size)]
        (sum(F.mse_loss(model(x), y) for x, y in batches) / world_size).backward()

    return delayed_sgd(SharedInCheckpoint(), backward, 4, delay)["params"]


def peer_exits_under_delay(rank: int, world_size: int, server: bool) -> dict:
    """``delay=1``: rank 1 dies after two steps. Rank 0 must learn it within the timeout (at whichever
    forward or backward first waits for the dead rank), refuse to train on, and ``close()`` must return
    promptly (it must not drain a pipeline whose peer is gone)."""
    import os

    from poseidon_torch import ServerOptimizer

    spec = ModelSpec(widths=(16, 16))
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=DEAD_PEER_TIMEOUT_S, delay=0 if server else 1, fusion_bytes=0)
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.1, delay=1) if server else \
        torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> None:
        x, y = batch(spec, i, 2, world_size)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        opt.step()

    for i in range(2):
        step(i)
    if rank == 1:
        os._exit(3)
    start, error = time.monotonic(), None
    try:
        for i in range(2, 6):
            step(i)
    except Exception as exc:  # the test inspects type and message
        error = exc
    elapsed = time.monotonic() - start
    try:
        step(6)
        after = "step ran"
    except Exception as exc:
        after = f"{type(exc).__name__}: {exc}"
    closed, close_s = timed_close(wrapped)
    return {"error_type": type(error).__name__ if error else None, "error": str(error), "elapsed": elapsed,
            "after": after, "closed": closed, "close_s": close_s}


DEAD_PEER_TIMEOUT_S = 10.0
