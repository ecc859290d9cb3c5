"""One rank of one benchmark run: build a workload, wrap it per mode, warm up, time iterations, report JSON.

Usage (normally launched by ``python -m poseidon_torch.bench``)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m poseidon_torch.bench.worker --mode torch-ddp --workload fc_heavy --iters 10 --warmup 3 \\
        --result out.json [--tiny] [--threads 1] [--timeout 300] [--wire-iface veth0] [--trace-dir DIR]
        [--device cpu|cuda] [--batch-scale K]

Modes: ``compute-only`` (no sync: the plain module on this rank's batch; the process group only gathers
the timings after the timed loop), ``torch-ddp``
(torch.nn.parallel.DistributedDataParallel), ``poseidon-ps`` (PoseidonDDP(hybrid=False)) and
``poseidon-hybrid`` (PoseidonDDP(hybrid=True)), and ``poseidon-ps-python`` (PS-only on the Python
core, the native core's reference). The optimizer (``--optimizer``, SGD with momentum or AdamW) is the
user's own in those modes; three more modes shard it: ``ddp-zero`` (torch DDP +
ZeroRedundancyOptimizer(overlap_with_ddp=True), stepped in the comm hook by ``hook_with_zero_step``;
torch refuses that overlap on gloo, pytorch#62300, so on gloo ZeRO steps after backward),
``poseidon-server`` (PoseidonDDP hybrid + ServerOptimizer: the owners apply the update) and
``poseidon-server-lazy`` (the same with ``lazy_pull=True``: the pulls overlap the next forward) and
``poseidon-server-lazy-priority`` (lazy pulls, those still running at the end of backward input side
first: ``POSEIDON_PULL_PRIORITY=1``, to measure what the priority gives). ``poseidon-localsgd`` and
``poseidon-diloco`` are PoseidonDDP's periodic modes (``sync_every`` = ``--localsgd-period``, the period of
torch's local SGD baseline; DiLoCo with the paper's outer Nesterov SGD), the user's optimizer inside. The
baselines of a slow network
(:mod:`~poseidon_torch.bench.baselines`): ``torch-ddp-powersgd``, ``torch-ddp-localsgd`` and ``one-host``
(a world of one rank, the runner starts it alone). The compressed modes: ``poseidon-powersgd`` (PoseidonDDP
hybrid with ``compression={"powersgd": ...}`` at the baseline's ``--powersgd-rank`` and
``--powersgd-start-iter``, so it is compared with ``torch-ddp-powersgd`` at the same settings),
``poseidon-powersgd-delay1`` (the same with ``delay=1``), ``poseidon-bf16`` (``compression="bf16"``) and
``poseidon-int8`` (``compression="int8"``); ``poseidon-server-powersgd``, ``-bf16`` and ``-int8`` are
``poseidon-server`` with the same ``compression=`` (compressed pushes, the owners step, exact pulls).
``poseidon-localsgd-delay3`` is ``poseidon-localsgd`` with ``delay=3``: each sync overlaps the next 3
steps; ``poseidon-streaming`` is local SGD in as many fragments as the period has steps (or
``--streaming-fragments``), one synced every period / fragments steps with ``delay=1`` (or
``--streaming-delay``; Streaming DiLoCo's schedule);
``poseidon-streaming-int8`` and ``poseidon-streaming-bf16`` are the same schedule on pseudo-gradients (DiLoCo
with an outer SGD of lr 1, which is local SGD) sent as 8 bits or as bf16 with error feedback
(``compression="int8"`` or ``"bf16"``).
All modes use gloo, initialised from the env variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

Invariants:
- An iteration is: zero_grad, forward, loss, backward, optimizer step. The batch is built before the clock
  starts. Warm-up iterations are untimed; one barrier separates warm-up from the timed loop, which itself
  has no barrier; the per-rank times are gathered after the loop. The iteration time (``iter_s``) is the
  slowest rank's mean: its timed loop's wall time over the iterations (the job's throughput). The
  median over iterations of the slowest rank's time per iteration (``median_iter_s``, the headline
  until 2026-11-26) overstates it where ranks have no barrier per step (Pipe-SGD, SSP, asynchronous
  SGD): their long iterations fall on different ranks at different steps, and it took the longest of
  every step (gpt2, 4 hosts, 1 Gbit/s, ``delay=1``: 3818 ms against a loop of 3066 ms per iteration).
- CPU seconds per iteration: user + system time of all ranks' processes (every thread) over the timed
  loop, batch building left out as in the time, divided by the iterations.
- Bytes per iteration per host: with ``--wire-iface`` the interface's ``tx_bytes`` delta over the timed loop
  (real wire bytes, headers included; read inside the rank's network namespace); otherwise PoseidonDDP's
  ``comm_stats.bytes_sent_total`` grown over the timed loop, for torch DDP the ring
  all-reduce volume 2(P-1)/P x parameter bytes (buffer broadcasts not counted), and for the PowerSGD and
  local SGD baselines the bytes the rank's process wrote over the timed loop (``sent``: ``wchar`` of
  ``/proc/self/io``, i.e. its socket writes, payload without headers; the loop writes no file). The
  ``bytes_source`` field says which; ``sent_bytes_per_iter_by_rank`` holds the written bytes of every mode.
- Only rank 0 writes the result file. Any error, or running longer than ``--timeout`` seconds, ends the
  process with a non-zero status (the watchdog dumps every thread's stack to stderr first).
- PoseidonDDP is imported only by the poseidon modes, before the process group is created, so a missing
  engine fails fast with a clear message.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from poseidon_torch.bench.baselines import BASELINE_MODES, LOCALSGD, ONE_HOST, POWERSGD, Baselines, \
    add_baseline_arguments, baselines_from, local_sgd_optimizer, wrap
from poseidon_torch.bench.launch import exit_worker, worker_main
from poseidon_torch.bench.workloads import WORKLOADS, Workload, build, placed, profile

#: ServerOptimizer with SSP's bound (``staleness=s``) or asynchronous (None): ranks on their own clocks
STALE_MODES = {"poseidon-ssp1": 1, "poseidon-ssp3": 3, "poseidon-async": None}
#: a BSP ServerOptimizer with compressed pushes: the lossy path each names (``compression=``)
SERVER_COMPRESSION_MODES = {"poseidon-server-powersgd": "powersgd", "poseidon-server-bf16": "bf16",
                            "poseidon-server-int8": "int8"}
SERVER_MODES = ("poseidon-server", "poseidon-server-lazy", "poseidon-server-lazy-priority", *STALE_MODES,
                *SERVER_COMPRESSION_MODES)
#: Pipe-SGD: the default mode (hybrid) with ``delay=k``; and local SGD with ``delay=3`` (the streaming modes'
#: delay is ``--streaming-delay``: :func:`delay_for`)
DELAY_MODES = {"poseidon-delay1": 1, "poseidon-delay2": 2, "poseidon-ps-delay1": 1, "poseidon-powersgd-delay1": 1,
               "poseidon-localsgd-delay3": 3}
#: the lossy path each compressed mode names (``compression=``)
COMPRESSION_MODES = {"poseidon-powersgd": "powersgd", "poseidon-powersgd-delay1": "powersgd", "poseidon-bf16": "bf16",
                     "poseidon-int8": "int8", "poseidon-streaming-int8": "int8",
                     "poseidon-streaming-bf16": "bf16", **SERVER_COMPRESSION_MODES}
#: periodic averaging, ``sync_every`` = the local SGD baseline's period, and its outer optimizer: none (local
#: SGD on the parameters), DiLoCo's, or SGD at lr 1 (local SGD on pseudo-gradients, which a lossy path carries)
PERIODIC_MODES = {"poseidon-localsgd": "none", "poseidon-diloco": "diloco", "poseidon-localsgd-delay3": "none",
                  "poseidon-streaming": "none", "poseidon-streaming-int8": "sgd",
                  "poseidon-streaming-bf16": "sgd"}
#: periodic modes that cut the model into fragments, one per step of the period
STREAMING_MODES = ("poseidon-streaming", "poseidon-streaming-int8", "poseidon-streaming-bf16")
PS_ONLY_MODES = ("poseidon-ps", "poseidon-ps-python", "poseidon-ps-delay1")  #: every layer on the PS path
POSEIDON_MODES = ("poseidon-ps", "poseidon-hybrid", "poseidon-ps-python", *SERVER_MODES, *DELAY_MODES,
                  *COMPRESSION_MODES, *PERIODIC_MODES)
MODES = tuple(dict.fromkeys((
    "compute-only", "torch-ddp", "poseidon-ps", "poseidon-hybrid", "poseidon-ps-python", "ddp-zero", *SERVER_MODES,
    *(mode for mode in DELAY_MODES if mode not in COMPRESSION_MODES and mode not in PERIODIC_MODES), *PERIODIC_MODES,
    *BASELINE_MODES, *COMPRESSION_MODES)))
DEFAULT_MODES = MODES[:4]
#: modes whose ranks never communicate while they train
ALONE_MODES = ("compute-only", ONE_HOST)
POWERSGD_OPTIONS, LOCALSGD_OPTIONS = ("powersgd_rank", "powersgd_start_iter"), ("localsgd_period", "localsgd_warmup")


def baseline_options_of(mode: str) -> tuple[str, ...]:
    """The :class:`~poseidon_torch.bench.baselines.Baselines` fields that ``mode`` reads (none: it ignores them)."""
    if mode == POWERSGD or COMPRESSION_MODES.get(mode) == "powersgd":
        return POWERSGD_OPTIONS
    if mode == LOCALSGD:
        return LOCALSGD_OPTIONS
    if mode in STREAMING_MODES:
        return LOCALSGD_OPTIONS[0], "streaming_fragments", "streaming_delay"
    return LOCALSGD_OPTIONS[:1] if mode in PERIODIC_MODES else ()


OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
              "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m poseidon_torch.bench.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--tiny", action="store_true", help="shrunken models (smoke tests)")
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this rank")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the rank gives up")
    parser.add_argument("--result", type=Path, required=True, help="JSON result file (written by rank 0)")
    parser.add_argument("--wire-iface", help="count wire bytes from this interface's tx_bytes")
    parser.add_argument("--trace-dir", help="PoseidonDDP trace directory (poseidon modes)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--compile", action="store_true", help="torch.compile the wrapped model (as users compile DDP)")
    add_device_arguments(parser)
    add_baseline_arguments(parser)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    return args


def wrapper_for(mode: str, timeout: float, trace_dir: str | None = None,
                baselines: Baselines = Baselines()) -> Callable[[nn.Module], nn.Module]:
    """The function that wraps the module for ``mode`` (imports PoseidonDDP only when needed). PoseidonDDP
    waits at most half the rank's ``timeout`` for one sync: a wait that never ends then fails with the
    engine's error naming what it waited for, before the runner ends the rank at its ``timeout`` without
    one (with the same figure for both, the runner always came first)."""
    if mode in ALONE_MODES:
        return lambda module: module
    if mode in ("torch-ddp", "ddp-zero"):
        return nn.parallel.DistributedDataParallel
    if mode in (POWERSGD, LOCALSGD):
        return lambda module: wrap(mode, module, baselines)
    try:
        from poseidon_torch import DILOCO_OUTER, PoseidonDDP
    except ImportError as exc:
        raise RuntimeError(f"mode {mode} needs poseidon_torch.PoseidonDDP, "
                           f"which is not importable: {exc}") from exc
    hybrid = mode not in PS_ONLY_MODES
    engine = "python" if mode == "poseidon-ps-python" else "native"
    if mode == "poseidon-server-lazy-priority":
        os.environ["POSEIDON_PULL_PRIORITY"] = "1"
    return lambda module: PoseidonDDP(module, hybrid=hybrid, timeout=timeout / 2, trace_dir=trace_dir,
                                      engine=engine, delay=delay_for(mode, baselines),
                                      compression=compression_for(mode, baselines),
                                      **periodic_for(mode, baselines, DILOCO_OUTER))


def periodic_for(mode: str, baselines: Baselines, diloco_outer: tuple) -> dict:
    """``PoseidonDDP``'s periodic options of ``mode`` (none for the others): ``sync_every`` the local SGD
    baseline's period, the mode's outer optimizer, and the streaming modes' fragments."""
    if mode not in PERIODIC_MODES:
        return {}
    outer = {"none": None, "diloco": diloco_outer, "sgd": (torch.optim.SGD, {"lr": 1.0})}[PERIODIC_MODES[mode]]
    return {"sync_every": baselines.localsgd_period, "outer": outer, "fragments": fragments_for(mode, baselines)}


def delay_for(mode: str, baselines: Baselines) -> int:
    """PoseidonDDP's ``delay`` of ``mode``: the streaming modes' ``--streaming-delay``, else the mode's own."""
    return baselines.streaming_delay if mode in STREAMING_MODES else DELAY_MODES.get(mode, 0)


def fragments_for(mode: str, baselines: Baselines) -> int:
    """The fragments a periodic ``mode`` cuts the model into: one sync every period / fragments steps."""
    return baselines.fragments if mode in STREAMING_MODES else 1


def compression_for(mode: str, baselines: Baselines) -> dict | None:
    """``compression=`` of a compressed mode (None otherwise): PowerSGD at the torch baseline's settings."""
    option = COMPRESSION_MODES.get(mode)
    if option == "powersgd":
        return {option: {"rank": baselines.powersgd_rank, "start_iter": max(1, baselines.powersgd_start_iter)}}
    return None if option is None else {option: None}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the ranks compute (shared by the runner and the worker)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: rank r on GPU r mod count (ranks may share one GPU; gloo stages through host memory)")
    parser.add_argument("--batch-scale", type=_at_least_one, default=1,
                        help="each step's batch is this many of the workload's batches (GPU-sized batches)")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def rank_device(kind: str, rank: int) -> torch.device:
    """The device rank ``rank`` computes on (made current for CUDA)."""
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a GPU, and torch sees none")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def init_process_group(timeout: float) -> tuple[int, int]:
    """Join the gloo group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; (rank, world)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    return rank, world


def make_optimizer(mode: str, model: nn.Module, cls: type, kwargs: dict,
                   baselines: Baselines = Baselines()) -> torch.optim.Optimizer:
    """``mode``'s optimizer (``cls(**kwargs)``): the user's own on the whole model, sharded (ZeRO, or
    PoseidonDDP's servers), or in torch's post-local SGD optimizer."""
    if mode == LOCALSGD:
        return local_sgd_optimizer(model, cls, kwargs, baselines)
    if mode == "ddp-zero":
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # torch refuses the overlap on gloo ("may meet hangs", pytorch#62300): there ZeRO steps after backward
        overlap = dist.get_backend() != "gloo"
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, overlap_with_ddp=overlap, **kwargs)
        if overlap:
            model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
        return zero
    if mode in SERVER_MODES:
        from poseidon_torch import ServerOptimizer

        if mode in STALE_MODES:
            return ServerOptimizer(model, cls, staleness=STALE_MODES[mode], **stale_kwargs(cls, kwargs))
        return ServerOptimizer(model, cls, lazy_pull=mode.startswith("poseidon-server-lazy"), **kwargs)
    return cls(model.parameters(), **kwargs)


def stale_kwargs(cls: type, kwargs: dict) -> dict:
    """The README's recommended scaling for SSP/asynchronous modes: an owner steps once per push (with
    the gradient divided by P), so plain SGD keeps its learning rate and an adaptive optimizer, whose
    step ignores the gradient's scale, takes lr / P."""
    if cls is torch.optim.SGD:
        return kwargs
    return {**kwargs, "lr": kwargs["lr"] / dist.get_world_size()}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds."""
    if hasattr(optimizer, "local_state_bytes"):
        return optimizer.local_state_bytes()
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
    return sum(v.numel() * v.element_size() for state in inner.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def read_tx_bytes(iface: str) -> int:
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def written_bytes() -> int | None:
    """Bytes this process has written so far (``wchar`` of ``/proc/self/io``: every write and send
    call, every thread, sockets included, payload only); None where the kernel does not account them."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if line)
        return int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss.item()


def timed_loop(args: argparse.Namespace, model: nn.Module, workload: Workload, rank: int) -> dict:
    """Warm up, then time ``args.iters`` iterations; this rank's raw measurements. With ``--compile`` the
    steps run through ``torch.compile(model)`` (compiled during warm-up); ``model`` keeps the stats."""
    optimizer = make_optimizer(args.mode, model, *OPTIMIZERS[args.optimizer], baselines_from(args))
    runs = torch.compile(model) if args.compile else model
    for step in range(args.warmup):
        train_step(runs, optimizer, workload.make_batch(rank, step), workload.loss_fn)
    if dist.is_initialized():
        dist.barrier()
    tx_start = read_tx_bytes(args.wire_iface) if args.wire_iface else 0
    written_start = written_bytes()
    cpu_start = cpu_seconds()
    times, losses = [], []
    api_start = model.comm_stats.bytes_sent_total if args.mode in POSEIDON_MODES else 0
    loop_start, batching_s, batching_cpu_s = time.perf_counter(), 0.0, 0.0
    for step in range(args.warmup, args.warmup + args.iters):
        built, built_cpu = time.perf_counter(), cpu_seconds()
        batch = workload.make_batch(rank, step)
        start = time.perf_counter()
        batching_s += start - built
        batching_cpu_s += cpu_seconds() - built_cpu
        losses.append(train_step(runs, optimizer, batch, workload.loss_fn))
        times.append(time.perf_counter() - start)
    # every pass closed in the loop (a periodic mode closes one per sync, not one per step)
    api_bytes = model.comm_stats.bytes_sent_total - api_start if args.mode in POSEIDON_MODES else 0
    loop_s = time.perf_counter() - loop_start - batching_s  # the batches are built off the clock
    tx_end = read_tx_bytes(args.wire_iface) if args.wire_iface else 0
    written_end = written_bytes()
    jobs = model.comm_stats.jobs_last_iteration if args.mode in POSEIDON_MODES else None
    paths = dict(model.comm_stats.outcome_by_bucket) if args.mode in POSEIDON_MODES else None
    return {"times": times, "loop_s": loop_s, "losses": losses, "api_bytes_per_iter": api_bytes / args.iters, "jobs_last_iter": jobs,
            "paths_last_iter": paths,
            "wire_bytes_per_iter": (tx_end - tx_start) / args.iters,
            "sent_bytes_per_iter": None if written_start is None else (written_end - written_start) / args.iters,
            "cpu_s_per_iter": (cpu_seconds() - cpu_start - batching_cpu_s) / args.iters,
            "optimizer_state_bytes": optimizer_state_bytes(optimizer)}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bytes_per_iter(args: argparse.Namespace, records: list[dict], param_bytes: int) -> tuple[float, str, list[float]]:
    """(mean bytes per iteration per host, source label, per-rank values)."""
    world = len(records)
    if args.mode in ALONE_MODES:
        per_rank, source = [0.0] * world, "none"
    elif args.wire_iface:
        per_rank, source = [r["wire_bytes_per_iter"] for r in records], "wire"
    elif args.mode in POSEIDON_MODES:
        per_rank, source = [r["api_bytes_per_iter"] for r in records], "comm_stats"
    elif args.mode in BASELINE_MODES and records[0]["sent_bytes_per_iter"] is not None:
        per_rank, source = [r["sent_bytes_per_iter"] for r in records], "sent"
    else:
        per_rank, source = [2 * (world - 1) / world * param_bytes] * world, "analytic"
    return statistics.fmean(per_rank), source, per_rank


def summarise(args: argparse.Namespace, records: list[dict], workload: Workload, param_bytes: int) -> dict:
    world = len(records)
    iter_times = [max(ts) for ts in zip(*(r["times"] for r in records))]
    iter_s = max(r["loop_s"] for r in records) / args.iters
    mean_bytes, source, per_rank_bytes = bytes_per_iter(args, records, param_bytes)
    result = {
        "mode": args.mode, "workload": args.workload, "tiny": args.tiny, "compiled": args.compile, "world_size": world,
        "batch_per_rank": workload.batch_size, "threads": args.threads, "iters": args.iters, "warmup": args.warmup,
        "iter_s": iter_s, "iter_s_by_rank": [r["loop_s"] / args.iters for r in records],
        "iter_times_s": iter_times, "median_iter_s": statistics.median(iter_times),
        "samples_per_s": world * workload.batch_size / iter_s,
        "bytes_per_iter_per_host": mean_bytes, "bytes_source": source, "bytes_per_iter_by_rank": per_rank_bytes,
        "cpu_s_per_iter": sum(r["cpu_s_per_iter"] for r in records),
        "losses_rank0": records[0]["losses"], "optimizer": args.optimizer,
        "optimizer_state_bytes_by_rank": [r["optimizer_state_bytes"] for r in records],
        "sent_bytes_per_iter_by_rank": [r["sent_bytes_per_iter"] for r in records],
    }
    if args.mode in POSEIDON_MODES:
        result["comm_stats_bytes_per_iter_by_rank"] = [r["api_bytes_per_iter"] for r in records]
        result["sync_jobs_last_iter"] = records[0]["jobs_last_iter"]  # the learned buckets (+ late re-syncs)
        result["paths_last_iter"] = records[0]["paths_last_iter"]  # each bucket's path (the same on every rank)
    if args.mode == "compute-only":
        result["profile"] = profile(workload)
    return result


def measure(args: argparse.Namespace, wrap: Callable[[nn.Module], nn.Module], workload: Workload,
            rank: int) -> dict:
    """The timed loop on the wrapped model; the wrapper is freed on return, while the group is still up.

    torch DDP's Reducer holds the process group: freed after ``destroy_process_group`` it is the last
    owner, and the group's destructor joins gloo's worker thread with the GIL held while that thread waits
    for the GIL to free a finished collective's tensors (a deadlock seen in CI after the result gather).
    """
    model = wrap(workload.model)
    record = timed_loop(args, model, workload, rank)
    if args.mode in POSEIDON_MODES:
        model.close()
    return record


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    wrap = wrapper_for(args.mode, args.timeout, args.trace_dir, baselines_from(args))
    # compute-only ranks join the group too, but only to gather their timings after the timed loop:
    # they run side by side, so each gets the CPU share a host gets in the synced modes
    rank, _ = init_process_group(args.timeout)
    try:
        workload = placed(build(args.workload, args.tiny), rank_device(args.device, rank), args.batch_scale)
        param_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters())
        record = measure(args, wrap, workload, rank)
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
        if rank == 0:
            result = summarise(args, records, workload, param_bytes)
            args.result.write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker_main(lambda: run(args), args.timeout, f"{args.mode}/{args.workload}")


if __name__ == "__main__":
    exit_worker(main())
