"""Functions that run on every rank of a test cluster: ``fn(rank, world_size, *args)``."""
from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from models import ModelSpec, batch, build
from patterns import slow_link
from poseidon_torch import PoseidonDDP
from poseidon_torch.paths import WrappedPath
from training import OPTIMIZERS, Run, poseidon_options, shard, train


def sync_timing(rank: int, world_size: int, trace_dir: str) -> dict:
    """One traced iteration of a model whose first layer is heavy; returns when the first layer's
    gradient was ready (test hook) and the recorded spans."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 7, padding=3), torch.nn.ReLU(), torch.nn.Conv2d(64, 8, 3, padding=1),
        torch.nn.Flatten(), torch.nn.Linear(8 * 48 * 48, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    wrapped = PoseidonDDP(model, timeout=60, trace_dir=trace_dir, trace_skip=1, trace_iters=1,
                          fusion_bytes=0)
    first_ready: list[int] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: first_ready.append(time.monotonic_ns()))
    for _ in range(2):
        x = torch.randn(8, 3, 48, 48)
        wrapped(x).square().mean().backward()
    names = wrapped.bucket_names
    spans = list(wrapped.recorder.spans)
    offset = wrapped.recorder.clock_offset_ns
    wrapped.close()
    return {"first_ready_ns": first_ready[-1] - offset, "spans": spans, "syncers": names}


def mismatched_models(rank: int, world_size: int) -> str:
    """Rank 1 builds a wider hidden layer; construction must fail on every rank."""
    from poseidon_torch import ModelMismatchError

    model = build(ModelSpec(widths=(8 + (rank == 1),)), seed=0)
    try:
        PoseidonDDP(model, timeout=20)
    except ModelMismatchError as exc:
        return str(exc)
    return "no error"


class FailingPath(WrappedPath):
    """A path that fails for one bucket and otherwise does what the path it replaces does."""

    def __init__(self, inner, bucket: str) -> None:
        super().__init__(inner)
        self.bucket = bucket

    def sync(self, bucket, groups, ctx):
        if bucket.name == self.bucket:
            raise RuntimeError("injected failure")
        return (yield from self.inner.sync(bucket, groups, ctx))


#: the sync timeout of :func:`failing_sync_job` (the peer of the failing rank may wait it out)
FAILING_JOB_TIMEOUT_S = 2.5


def failing_sync_job(rank: int, world_size: int, layer: str, path: str) -> dict:
    """Rank 0's sync job for ``layer`` on ``path`` raises; both ranks must see an error ending the step."""
    spec = ModelSpec(widths=(8, 8))
    options = {"hybrid": False} if path == "PS" else {"overrides": {layer: "SFB"}}
    wrapped = PoseidonDDP(build(spec, seed=0), timeout=FAILING_JOB_TIMEOUT_S, fusion_bytes=0, **options)
    x, y = batch(spec, 0, 2, 1)
    if path == "SFB":  # the first step always syncs through PS; SFB runs from the second
        F.mse_loss(wrapped(x), y).backward()
    if rank == 0:
        wrapped.engine.paths[path] = FailingPath(wrapped.engine.paths[path], layer)
    return _time_failing_step(wrapped, spec)


def peer_exits_mid_step(rank: int, world_size: int) -> dict:
    """Rank 1 dies after its forward; rank 0's backward must fail within the timeout, not hang."""
    import os

    spec = ModelSpec(widths=(16, 16))
    wrapped = PoseidonDDP(build(spec, seed=0), timeout=10)
    if rank == 1:
        x, _ = batch(spec, 0, 2, world_size)
        wrapped(x)
        os._exit(3)
    return _time_failing_step(wrapped, spec)


def _time_failing_step(wrapped: PoseidonDDP, spec: ModelSpec) -> dict:
    x, y = batch(spec, 0, 2, 1)
    start = time.monotonic()
    try:
        F.mse_loss(wrapped(x), y).backward()
        error = None
    except Exception as exc:  # the test inspects type and message
        error = exc
    elapsed = time.monotonic() - start
    try:
        wrapped(x)
        after = "forward ran"
    except Exception as exc:
        after = f"{type(exc).__name__}: {exc}"
    return {"error_type": type(error).__name__ if error else None, "error": str(error), "elapsed": elapsed,
            "next_forward": after}


def bytes_per_iteration(rank: int, world_size: int, chunk_bytes: int) -> dict:
    """Two steps on the PS path; the second step's bytes (after the buckets were learned) and the
    flat buffer size of every bucket, from the parameters."""
    spec = ModelSpec(conv_channels=(4,), widths=(64, 32), image=6, batchnorm=True)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, chunk_bytes=chunk_bytes, hybrid=False)
    for step in range(2):
        x, y = batch(spec, step, 2, world_size)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
    stats = wrapped.comm_stats
    names = dict(model.named_parameters())
    flat = [sum(names[p].numel() + 1 for p in _bucket_params(name, names)) + 1 for name in wrapped.bucket_names]
    out = {"ps": stats.bytes_by_path["PS"], "facts": stats.bytes_by_path["facts"], "flat_elems": flat,
           "buckets": len(wrapped.bucket_names)}
    wrapped.close()
    return out


def _bucket_params(bucket: str, names: dict) -> list[str]:
    """The parameter names of a bucket named "layer+layer+...": each layer's own parameters."""
    layers = bucket.split("+")
    return [n for n in names if n.rsplit(".", 1)[0] in layers]


def sfb_bytes(rank: int, world_size: int, sizes: tuple[int, ...], grow: int = 0, server: bool = False) -> dict:
    """Two steps with every FC layer forced to SFB (the second runs on SFB); rank r trains on
    sizes[r] samples, plus ``grow`` more in the second step than in the first (K grows: the factors are
    exchanged again with room for all). ``server``: a ServerOptimizer (SGD), whose owners' new values
    of the SFB layers are pulled too."""
    from poseidon_torch import ServerOptimizer

    spec = ModelSpec(in_features=20, widths=(30,), out_features=5)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, **poseidon_options(model, {"force": "SFB"}))
    opt = ServerOptimizer(wrapped, torch.optim.SGD, lr=0.01) if server else None
    for step in range(2):
        rows = sizes[rank] + grow * step
        x, y = batch(spec, step, max(sizes) + grow, world_size)
        model.zero_grad()
        F.mse_loss(wrapped(x[:rows]), y[:rows]).backward()
        if opt is not None:
            opt.step()
    stats = wrapped.comm_stats
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    out = {"by_path": dict(stats.bytes_by_path), "outcomes": dict(stats.outcome_by_bucket), "grads": grads,
           "flat_bytes": sum(b.nbytes for b in wrapped.engine.buckets)}
    wrapped.close()
    return out


def plan_printout(rank: int, world_size: int, link) -> tuple[str, str]:
    """The plan of a small CNN after one forward, and the error of forcing SFB on a conv layer."""
    spec = ModelSpec(conv_channels=(4,), widths=(64,), image=6)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=0, link=link)
    x, y = batch(spec, 0, 2, world_size)
    F.mse_loss(wrapped(x), y[:, :3]).backward()
    text = str(wrapped.plan)
    wrapped.close()
    try:
        PoseidonDDP(model, timeout=60, fusion_bytes=0, link=link, overrides={"features.0": "SFB"})
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return text, error


def replan_on_new_k(rank: int, world_size: int, link, sizes: tuple[int, ...]) -> list[dict]:
    """Train one step per entry of ``sizes`` (samples per rank); record each step's plan."""
    spec = ModelSpec(in_features=64, widths=(64,), out_features=4)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=0, link=link)
    plans = []
    for step, size in enumerate(sizes):
        x, y = batch(spec, step, size, world_size)
        F.mse_loss(wrapped(shard(x, rank, size)), shard(y, rank, size)).backward()
        plans.append({row.name: (row.k, row.path) for row in wrapped.plan.rows})
    wrapped.close()
    return plans


def traced_training(rank: int, world_size: int, trace_dir: str, iters: int, delay: int = 0) -> dict:
    """Train the example-like CNN with the tracer on for ``iters`` iterations after one skipped (and
    ``delay`` more, in which the last traced passes close)."""
    spec = ModelSpec(conv_channels=(4,), batchnorm=True, widths=(64, 32), image=6)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, trace_dir=trace_dir, trace_skip=1, trace_iters=iters,
                          link=slow_link(), fusion_bytes=0, delay=delay)
    sent = []
    for step in range(1 + iters + delay):
        wrapped.zero_grad(set_to_none=True)  # Pipe-SGD refuses to accumulate on an average it handed out
        x, y = batch(spec, step, 2, world_size)
        F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        sent.append(dict(wrapped.comm_stats.bytes_by_bucket))
    names = wrapped.bucket_names
    wrapped.close()
    return {"syncers": names, "bytes_by_syncer": sent[1:1 + iters]}


def trace_cut_short(rank: int, world_size: int, trace_dir: str, steps: int, skip: int, iters: int = 10,
                    delay: int = 0) -> dict:
    """A run of ``steps`` iterations with a trace window (skip ``skip``, ``iters`` iterations) that never
    closes: ``close()`` must write what was recorded, or say that nothing was; returns the tracer's
    warnings."""
    spec = ModelSpec(widths=(16, 8))
    model = build(spec, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = PoseidonDDP(model, timeout=60, trace_dir=trace_dir, trace_skip=skip, trace_iters=iters, hybrid=False,
                              delay=delay)
        for step in range(steps):
            wrapped.zero_grad(set_to_none=True)
            x, y = batch(spec, step, 2, world_size)
            F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        wrapped.close()
    return {"warnings": [str(w.message) for w in caught if "tracer" in str(w.message)]}


class _BusyBackward(torch.autograd.Function):
    """Identity whose backward first keeps the GPU busy for about ``CYCLES`` clock cycles, so the gradients
    of the layer before it are written long after their hooks fired on the CPU: a sync copy that is not
    ordered after them on the device reads the previous values."""

    CYCLES = 20_000_000  # ~10 ms at the H100's/H200's ~2 GHz

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(_BusyBackward.CYCLES)
        return grad


def busy_backward(model: torch.nn.Module) -> None:
    """Delay on the GPU the gradients of every Linear and Conv2d of ``model`` (see :class:`_BusyBackward`)."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            module.register_forward_hook(lambda mod, args, out: _BusyBackward.apply(out))


def train_pair_group(rank: int, world_size: int, spec: ModelSpec, steps: int, size: int, backend: str,
                     force: str, busy: bool = False, alone: bool = False, device: str = "cuda",
                     unordered: bool = False, late_uploads: str = "") -> dict:
    """Like ``train_pair`` in a process group of ``backend`` made for the call, on ``device`` (CUDA: rank
    r on GPU r mod count; "gloo" stages through pinned host buffers, "nccl" needs one GPU per rank).
    ``busy``: every layer's gradient is written ~10 ms after its hook fired (:func:`busy_backward`).
    ``alone``: every rank trains in a group of its own (a world of one: NCCL with ranks sharing a GPU),
    on the whole batch. ``unordered``: PoseidonDDP's side streams ignore the ready events (the negative
    control of the CUDA ordering tests). ``late_uploads``: every upload of the averages to the GPU starts
    ~10 ms late, on the job's stream ("ordered") or on a stream of its own that nothing waits for
    ("unordered", the negative control); the uploads are counted. Also returns which paths ran."""
    import torch.distributed as dist

    if device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if alone:
        groups = [dist.new_group([r], backend=backend) for r in range(world_size)]
        group, rank, world_size = groups[rank], 0, 1
    else:
        group = dist.new_group(backend=backend)
    out = {}
    for wrapper in ("poseidon", "ddp"):
        model = build(spec, seed=spec.seed).to(device)
        if busy:
            busy_backward(model)
        wrapped = (PoseidonDDP(model, timeout=60, process_group=group, **poseidon_options(model, {"force": force}))
                   if wrapper == "poseidon" else DDP(model, process_group=group))
        if unordered and wrapper == "poseidon":
            ordered = wrapped.engine._device_stream
            wrapped.engine._device_stream = lambda after, channel: ordered(torch.cuda.Event(), channel)
        cls, kwargs = OPTIMIZERS["sgd"]
        opt = cls(wrapped.parameters(), **kwargs)
        with _late_uploads(late_uploads if wrapper == "poseidon" else "") as uploads:
            for step in range(steps):
                x, y = batch(spec, step, size, world_size)
                opt.zero_grad()
                F.mse_loss(wrapped(shard(x, rank, size).to(device)), shard(y, rank, size).to(device)).backward()
                opt.step()
        out[wrapper] = {"state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
        if wrapper == "poseidon":
            out["paths"] = dict(wrapped.comm_stats.outcome_by_bucket)
            out["uploads"] = uploads[0]
            wrapped.close()
    return out


@contextlib.contextmanager
def _late_uploads(how: str):
    """Within the block, every :meth:`Bucket.upload` of a staged CUDA bucket first keeps the GPU busy
    ~10 ms on the job's stream ("ordered"), or runs late on a fresh stream and then records the bucket's
    upload event again on the job's stream, which never waited for that copy ("unordered": the event the
    readers wait on covers nothing of the upload); "" changes nothing. Yields a one-element list: the
    uploads so far."""
    from poseidon_torch.bucket import Bucket

    uploads, original = [0], Bucket.upload

    def late(bucket: Bucket) -> None:
        if bucket.device_averages is None:
            return
        uploads[0] += 1
        job_stream = torch.cuda.current_stream(bucket.device)
        with torch.cuda.stream(torch.cuda.Stream() if how == "unordered" else job_stream):
            torch.cuda._sleep(_BusyBackward.CYCLES)
            original(bucket)
        if how == "unordered":
            bucket.uploaded_event.record(job_stream)

    if how:
        Bucket.upload = late
    try:
        yield uploads
    finally:
        Bucket.upload = original


class RecordingEvent:
    """A stand-in for a CUDA event that logs what is done with it (CPU tests of the stream order of a
    staged CUDA bucket's device copy): ``("record", name, device)`` and ``("synchronize", name)``."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream.device))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


def device_copies_after_close(rank: int, world_size: int) -> dict:
    """One synced step on the CPU, then every bucket gets a stand-in device copy and upload event (what
    a CUDA bucket staged through host memory holds); then ``close()``: which buckets still hold their
    copy, and which uploads were waited for."""
    spec = ModelSpec(widths=(16, 8))
    model = build(spec, seed=spec.seed)
    wrapped = PoseidonDDP(model, timeout=60, hybrid=False, fusion_bytes=0)
    x, y = batch(spec, 0, 2, world_size)
    F.mse_loss(wrapped(shard(x, rank, 2)), shard(y, rank, 2)).backward()
    buckets, log = wrapped.engine.buckets, []
    for bucket in buckets:
        bucket.device_averages = torch.zeros(bucket.grad_numel)
        bucket.uploaded_event = RecordingEvent(bucket.name, log)
    wrapped.close()
    return {"buckets": [b.name for b in buckets], "held": [b.name for b in buckets if b.device_averages is not None],
            "waited": [name for what, name in log if what == "synchronize"]}


def profiled_step(rank: int, world_size: int) -> dict:
    """One step under the user's torch.profiler (all threads): the sync ranges must show."""
    model = build(ModelSpec(in_features=32, widths=(32,), out_features=4), seed=0)
    wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=0)
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    x, y = batch(ModelSpec(in_features=32, widths=(32,), out_features=4), 0, 4, world_size)
    with torch.profiler.profile(experimental_config=config) as prof:
        F.mse_loss(wrapped(x), y[:, :4]).backward()
    paths = wrapped.comm_stats.outcome_by_bucket
    wrapped.close()
    return {"events": sorted({e.name for e in prof.events() if e.name.startswith("poseidon.")}),
            "expected": sorted(f"poseidon.sync.{path}.{name}" for name, path in paths.items())}


def state_dict_roundtrip(rank: int, world_size: int) -> dict:
    """PoseidonDDP's state_dict has DDP's keys; loading one restores the wrapped module exactly."""
    spec = ModelSpec(conv_channels=(3,), batchnorm=True, widths=(6,), image=4)
    ours = PoseidonDDP(build(spec, seed=0), timeout=60)
    theirs = DDP(build(spec, seed=0))
    saved = {k: v.clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        for p in ours.module.parameters():
            p.add_(1.0)
    ours.load_state_dict(saved)
    restored = all(torch.equal(v, saved[k]) for k, v in ours.state_dict().items())
    ours.close()
    return {"ours": sorted(saved), "ddp": sorted(theirs.state_dict()), "restored": restored,
            "module_is_model": isinstance(ours.module, torch.nn.Module) and "module.head.weight" in saved}


def commit_and_switch(rank: int, world_size: int, link, sizes: tuple[int, ...]) -> list[dict]:
    """Per step: how body.0 synced, whether its weight was in the autograd graph (autograd computes the
    local weight gradient only then), and the largest difference of every .grad from torch DDP's."""
    spec = ModelSpec(in_features=64, widths=(64,), out_features=4)
    ours_model, ddp_model = build(spec, seed=0), build(spec, seed=0)
    ours = PoseidonDDP(ours_model, timeout=60, fusion_bytes=0, link=link)
    theirs = DDP(ddp_model)
    steps = []
    for step, size in enumerate(sizes):
        x, y = batch(spec, step, size, world_size)
        weight_in_graph = None
        for model, wrapped in ((ours_model, ours), (ddp_model, theirs)):
            model.zero_grad()
            out = wrapped(shard(x, rank, size))
            if wrapped is ours:
                weight_in_graph = reaches(out.grad_fn, ours_model.body[0].weight)
            F.mse_loss(out, shard(y, rank, size)).backward()
        worst = max((a.grad - b.grad).abs().max().item()
                    for a, b in zip(ours_model.parameters(), ddp_model.parameters()))
        steps.append({"outcome": ours.comm_stats.outcome_by_bucket["body.0"], "weight_in_graph": weight_in_graph,
                      "max_grad_diff": worst})
    ours.close()
    return steps


def reaches(node, param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient accumulator is reachable from autograd node ``node``."""
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "variable", None) is param:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def loopback_bytes(rank: int, world_size: int, force: str) -> dict:
    """Bytes the loopback device transmitted during one synced step (all ranks) and this rank's
    count of what it handed to its backends in that step."""
    import torch.distributed as dist

    spec = ModelSpec(in_features=256, widths=(256, 256), out_features=8)
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, **poseidon_options(model, {"force": force}))
    for step in range(3):  # the buckets are learned after the first step, SFB runs from the second
        x, y = batch(spec, step, 4, world_size)
        if step == 2:
            dist.barrier()
            before = _tx_bytes("lo")
            dist.barrier()
        F.mse_loss(wrapped(shard(x, rank, 4)), shard(y, rank, 4)).backward()
    dist.barrier()
    after = _tx_bytes("lo")
    counted = wrapped.comm_stats.bytes_sent_last_iteration
    outcomes = dict(wrapped.comm_stats.outcome_by_bucket)
    wrapped.close()
    return {"counted": counted, "loopback": after - before, "outcomes": outcomes}


def _tx_bytes(iface: str) -> int:
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def exchange_factors_roundtrip(rank: int, world_size: int) -> dict:
    """Every rank sends rank + 1 rows of known factors, padded to 2 rows (rank >= 2 overflows):
    what comes back, against what every rank sent."""
    from datetime import timedelta

    import torch.distributed as dist

    from poseidon_torch.pools import Groups
    from poseidon_torch.paths.sfb import exchange_factors

    groups = Groups.create(dist.group.WORLD, "gloo", 1, timedelta(seconds=30))
    m, n, pad = 3, 2, 2

    def factors(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = r + 1
        u = torch.arange(rows * m, dtype=torch.float32).view(rows, m) + 100 * r
        return u, -torch.arange(rows * n, dtype=torch.float32).view(rows, n) - 100 * r

    u, v = factors(rank)
    header = {"rows": u.shape[0], "exact": 1, "aborted": 0}
    got = exchange_factors(header, u, v, pad, groups.channels[0], torch.device("cpu"))
    sent = [factors(r) for r in range(world_size)]
    return {"headers": got.headers,
            "expected_headers": [{"rows": r + 1, "exact": 1, "aborted": 0} for r in range(world_size)],
            "u": got.u, "v": got.v,
            "expected_u": torch.cat([s[0][:pad] for s in sent]), "expected_v": torch.cat([s[1][:pad] for s in sent]),
            "bytes": got.bytes_sent, "block_bytes": -(-(24 + pad * (m + n) * 4) // 8) * 8}


class TwoBranches(torch.nn.Module):
    """Two parallel branches whose forward order depends on the rank, so their gradients become
    ready in a different order on different ranks."""

    def __init__(self, flip: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.flip = flip
        self.stem = torch.nn.Linear(8, 16)
        self.left = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
        self.right = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if self.flip:
            b = self.right(h)
            a = self.left(h)
        else:
            a = self.left(h)
            b = self.right(h)
        return self.head(a + b)


def learned_buckets(rank: int, world_size: int) -> dict:
    """Train TwoBranches (rank-dependent readiness order) with small fusion: the learned buckets and
    this rank's own order of gradient readiness in the last step."""
    model = TwoBranches(flip=rank % 2 == 0)
    wrapped = PoseidonDDP(model, timeout=60, hybrid=False, fusion_bytes=4096)
    order: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    initial = wrapped.bucket_names
    for step in range(3):
        order.clear()
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        model.zero_grad()
        F.mse_loss(wrapped(x), y).backward()
    out = {"initial": initial, "learned": wrapped.bucket_names, "order": list(order),
           "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    wrapped.close()
    return out


def train_engines(rank: int, world_size: int, spec: ModelSpec, steps: int, size: int, accumulate: int,
                  options: dict) -> dict:
    """The same training with the Python core and with the native core; both final states."""
    return {engine: train(rank, world_size, spec, Run(options=dict(options, engine=engine), accumulate=accumulate),
                          steps, size)["state"] for engine in ("python", "native")}


def core_kind(rank: int, world_size: int) -> str:
    wrapped = PoseidonDDP(build(ModelSpec(), seed=0), timeout=30)
    kind = wrapped.engine.core.kind
    wrapped.close()
    return kind


def train_chunkings(rank: int, world_size: int, spec: ModelSpec, chunks: tuple[int, ...]) -> list[dict]:
    """The same training on the PS path with different chunk sizes (different owners per element)."""
    return [train(rank, world_size, spec, Run(options={"hybrid": False, "chunk_bytes": c, "fusion_bytes": 0}), 3,
                  3)["state"] for c in chunks]


def compiled_training(rank: int, world_size: int, how: str, options: dict, server: str | None = None,
                      split: bool = True) -> dict:
    """A small GPT-like LM trained 4 steps with ``torch.compile`` (backend aot_eager: dynamo and AOT
    autograd as in production, without code generation): ``how`` is "inner" (compile, then wrap),
    "outer" (wrap, then compile) or "eager" (the reference: torch DDP, not compiled). ``server``: a
    ServerOptimizer ("step-waits" or "lazy-pull"). ``split=False``: dynamo's DDP optimisation off (the
    control). Returns the parameters, the dynamo graph breaks, the buckets' outcomes, and how spread over
    a backward the buckets' submissions were (the median of the steps after the buckets are learned)."""
    import torch._dynamo

    with torch._dynamo.config.patch(optimize_ddp=split):
        return _compiled_training(rank, how, options, server)


def _compiled_backward_nodes(loss: torch.Tensor) -> int:
    """How many compiled graphs' backward functions the loss's autograd graph holds: one per piece
    dynamo cut the forward into (1 when it was not cut)."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return sum("CompiledFunctionBackward" in node.name() for node in seen)


def _compiled_training(rank: int, how: str, options: dict, server: str | None) -> dict:
    import torch._dynamo

    from poseidon_torch import ServerOptimizer
    from poseidon_torch.bench.workloads import GPTLike

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = GPTLike(256, 128, 4, 4, 32)
    if how == "eager":
        wrapped = DDP(model)
    elif how == "inner":
        wrapped = PoseidonDDP(torch.compile(model, backend="aot_eager"), timeout=60, **options)
    else:
        wrapped = torch.compile(PoseidonDDP(model, timeout=60, **options), backend="aot_eager")
    engine_owner = getattr(wrapped, "_orig_mod", wrapped)
    # SGD with momentum: this model's attention key bias has an exactly zero gradient, whose rounding
    # noise (another sum order at P = 3) Adam would turn into full steps
    if server is not None:
        opt = ServerOptimizer(engine_owner, torch.optim.SGD, lr=0.05, momentum=0.9, lazy_pull=server == "lazy-pull")
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    out: dict = {"error": None}
    spreads: list[float] = []
    try:
        for step in range(4):
            ids = torch.randint(0, 256, (4, 33), generator=g)
            logits = wrapped(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
            out["compiled_backwards"] = _compiled_backward_nodes(loss)
            start = time.monotonic_ns()
            loss.backward()
            if isinstance(engine_owner, PoseidonDDP) and step > 0:  # buckets learned: how spread their submissions
                submits = [engine_owner.engine.core.submit_ns(b.index) for b in engine_owner.engine.buckets]
                spreads.append((max(submits) - min(submits)) / (max(submits) - start))  # of backward's compute
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out["error"] = f"{type(exc).__name__}: {exc}"
    if isinstance(engine_owner, PoseidonDDP) and out["error"] is None:
        out["spread"] = sorted(spreads)[len(spreads) // 2]  # the median step
        out["outcomes"] = set(engine_owner.engine.stats.outcome_by_bucket.values())
        engine_owner.synchronize()
    if isinstance(engine_owner, PoseidonDDP):
        engine_owner.close()
    out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    out["graphs_compiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# ---- replicas: construction checks and buffers (from the mutation sweep of issue 18) -----------------

class NormNet(torch.nn.Module):
    """A BatchNorm between two Linear layers: buffers that each rank's data move differently."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def buffers_against_ddp(rank: int, world_size: int, case: str) -> dict:
    """The model's whole state (buffers included) after training with PoseidonDDP and with torch DDP:
    ``join`` (uneven inputs, 1 + 2 rank batches: the buffers of the last rank to finish win) or
    ``no_broadcast`` (``broadcast_buffers=False``: every rank keeps its own statistics)."""
    states = {}
    for wrapper in ("poseidon", "ddp"):
        module = NormNet()
        kwargs = {"broadcast_buffers": False} if case == "no_broadcast" else {}
        model = PoseidonDDP(module, hybrid=False, timeout=30, **kwargs) if wrapper == "poseidon" else DDP(module, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        steps = 1 + 2 * rank if case == "join" else 3
        with model.join() if case == "join" else contextlib.nullcontext():
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(4, 6, generator=g) + 3 * rank, torch.randn(4, 3, generator=g)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        states[wrapper] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        if wrapper == "poseidon":
            model.close()
    return states


class MixedInit(torch.nn.Module):
    """fp32 and bf16 parameters and a buffer, initialised differently on every rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(rank)
        self.norm = torch.nn.BatchNorm1d(12)
        self.fc1 = torch.nn.Linear(12, 16).to(torch.bfloat16)
        self.head = torch.nn.Linear(16, 3)
        self.norm.running_mean.fill_(float(rank))  # statistics of a per-rank warm-up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc1(self.norm(x).to(torch.bfloat16)).float())


def state_after_construction(rank: int, world_size: int) -> dict:
    """Right after wrapping, every parameter (of every dtype) and buffer must be rank 0's."""
    import torch.distributed as dist

    module = MixedInit(rank)
    model = PoseidonDDP(module, hybrid=False, timeout=30)
    differs = {}
    for name, t in module.state_dict().items():
        reference = t.detach().float().clone()
        dist.broadcast(reference, 0)
        differs[name] = float((t.detach().float() - reference).abs().max())
    model.close()
    return differs


def mismatched_construction(rank: int, world_size: int, case: str) -> str:
    """The last rank differs from the others (an option, or one more parameter): every rank must get
    ModelMismatchError at construction, before any training collective."""
    from poseidon_torch import ModelMismatchError

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    odd = rank == world_size - 1
    options = {"hybrid": False, "timeout": 30}
    if case == "option" and odd:
        options["chunk_bytes"] = 64
    if case == "extra_parameter" and odd:
        module.append(torch.nn.Linear(3, 3))
    try:
        PoseidonDDP(module, **options).close()
    except ModelMismatchError as exc:
        return str(exc)
    return "constructed"


def compile_split_caps(rank: int, world_size: int) -> list[int]:
    """Where dynamo would cut a compiled module under PoseidonDDP: by default, with ``fusion_bytes`` and
    with torch DDP's ``bucket_cap_mb``."""
    caps = []
    for options in ({}, {"fusion_bytes": 2 << 20}, {"bucket_cap_mb": 3}):
        wrapped = PoseidonDDP(torch.nn.Linear(4, 4), timeout=30, **options)
        caps.append(wrapped._split.bucket_bytes_cap)
        wrapped.close()
    return caps


class MixedKinds(torch.nn.Module):
    """Three fp32 Linear layers and an fp64 one: kinds never share a bucket, so even the first pass's
    buckets have two sizes a job cost could be fitted to."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16).double()
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.double())).float()
        for layer in self.hidden:
            h = torch.tanh(layer(h))
            h.register_hook(lambda grad: time.sleep(0.03))  # 30 ms of "backward compute" between layers
        return h


def buckets_learned_after_cold_jobs(rank: int, world_size: int, cold_seconds_per_byte: float) -> list[str]:
    """The buckets learned from a first pass whose sync jobs took ``cold_seconds_per_byte`` per byte
    (slowed on purpose, as a cold first use is), with a fast link model given."""
    from server_workers import watched

    from poseidon_torch.link import LinkModel

    wrapped = PoseidonDDP(MixedKinds(), timeout=60, hybrid=False, engine="python", fusion_bytes=1 << 20,
                          link=LinkModel(1e-3, 1e-9))
    ps = wrapped.engine.paths["PS"]
    warm = ps.__class__
    ps.__class__ = watched(warm, before=lambda phase, bucket: time.sleep(bucket.nbytes * cold_seconds_per_byte)
                           if phase == "network" else None)
    for step in range(2):
        g = torch.Generator().manual_seed(step * 10 + rank)
        wrapped.module.zero_grad()
        wrapped(torch.randn(4, 8, generator=g)).square().mean().backward()
        ps.__class__ = warm
    names = wrapped.bucket_names
    wrapped.close()
    return names


def fc_layers_watched_after_learning(rank: int, world_size: int) -> dict[str, tuple[bool, int, bool]]:
    """Three small FC layers, the last forced onto SFB: after the buckets are learned, each layer's
    (watched, rows seen in the last round, committed to SFB)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(2)), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    wrapped = PoseidonDDP(model, timeout=60, hybrid=True, engine="python", overrides={"3": "SFB"})
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        wrapped.module.zero_grad()
        wrapped(torch.randn(5, 8, generator=g)).square().mean().backward()
    seen = {name: (layer.watching, layer.k_round, layer.commit) for name, layer in wrapped.engine.fc.items()}
    wrapped.close()
    return seen



CPU_GEMM_FLOPS = 3e10  #: about what the GEMM probe measures on one core of this project's CI machines


def _train_with_link(rank: int, world_size: int, spec: ModelSpec, link, plan, steps: int = 4, size: int = 2) -> dict:
    """``steps`` steps of SGD with ``link`` as the cost model's link (the probe's result) and ``plan``
    given back (or None); the final parameters and the plan the run ended with."""
    model = build(spec, seed=0)
    wrapped = PoseidonDDP(model, timeout=60, fusion_bytes=0, link=link, plan=plan)
    cls, kwargs = OPTIMIZERS["sgd"]
    opt = cls(wrapped.parameters(), **kwargs)
    for step in range(steps):
        x, y = batch(spec, step, size, world_size)
        opt.zero_grad()
        F.mse_loss(wrapped(shard(x, rank, size)), shard(y, rank, size)).backward()
        opt.step()
    plan = wrapped.plan
    wrapped.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "plan": plan,
            "paths": plan.layer_paths()}


def runs_given_a_recorded_plan(rank: int, world_size: int, record_path: str) -> dict:
    """Runs whose timing probe sees a slow link (SFB wins) and a fast one (PS wins), without a plan and
    with the slow run's recorded plan given back, as the Plan object and as the file it saved. The GEMM
    probe reads a CPU's rate on any device (on a GPU SFB's compute is so cheap that it wins on both)."""
    from unittest import mock

    from poseidon_torch import LinkModel

    spec = ModelSpec(in_features=64, widths=(64,), out_features=4)
    slow, fast = slow_link(), LinkModel.from_gbps(400.0)
    with mock.patch("poseidon_torch.ddp.probe_gemm_flops", return_value=CPU_GEMM_FLOPS):
        recorded = _train_with_link(rank, world_size, spec, slow, None)
        if rank == 0:
            recorded["plan"].save(record_path)
        torch.distributed.barrier()
        return {"recorded": recorded, "fast": _train_with_link(rank, world_size, spec, fast, None),
                "fast, plan": _train_with_link(rank, world_size, spec, fast, recorded["plan"]),
                "slow, plan file": _train_with_link(rank, world_size, spec, slow, record_path)}


def unmaterialised_model(rank: int, world_size: int, kind: str) -> dict:
    """Every rank wraps a model on the meta device or with a lazy layer: construction must refuse it
    before any collective, so the ranks are still in step (a collective afterwards agrees) and quick."""
    first = torch.nn.Linear(4, 8).to("meta") if kind == "meta" else torch.nn.LazyLinear(8)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), torch.nn.Linear(8, 2))
    start = time.perf_counter()
    try:
        PoseidonDDP(model, timeout=20)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    elapsed = time.perf_counter() - start
    total = torch.tensor([float(rank)])
    torch.distributed.all_reduce(total)
    return {"error": error, "elapsed": elapsed, "sum_of_ranks": total.item()}


def sparse_embedding(rank: int, world_size: int, options: dict) -> dict:
    """An nn.Embedding(sparse=True) under ``PoseidonDDP(**options)``: the error construction raises (None:
    accepted), and when accepted, whether 3 steps of SparseAdam trained."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    try:
        wrapped = PoseidonDDP(model, timeout=20, **options)
    except ValueError as exc:
        return {"error": str(exc)}
    before = model[0].weight.detach().clone()
    opt = torch.optim.SparseAdam(list(model[0].parameters()), lr=0.01)
    for step in range(3):
        x = torch.randint(0, 20, (3, 2), generator=torch.Generator().manual_seed(3 * step + rank))
        opt.zero_grad()
        wrapped(x).sum().backward()
        opt.step()
    wrapped.close()
    return {"error": None, "trained": not torch.equal(model[0].weight, before)}
