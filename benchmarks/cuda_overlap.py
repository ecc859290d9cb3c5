"""GPU only: which CUDA streams PoseidonDDP's sync copies run on, and whether they run under backward.

    python benchmarks/cuda_overlap.py --out DIR [--workload resnet18] [--batch-scale 8] [--ranks 2]
        [--wrappers poseidon-ps,poseidon-hybrid,poseidon-delay1,torch-ddp]

Ranks share the GPU(s) over gloo (rank r on GPU r mod count). Each wrapper (PoseidonDDP PS-only,
hybrid and hybrid with Pipe-SGD ``delay=1``, torch DDP) trains a few warm-up steps, then rank 0 records 3 steps with ``torch.profiler``
(CPU and CUDA activity; Chrome trace ``DIR/<wrapper>.json``) and, for PoseidonDDP, its own tracer
(``DIR/<wrapper>-trace/``). Prints per stream the kernel and copy time
(:mod:`poseidon_torch.trace.streams`) and the tracer's overlap ratio.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from poseidon_torch import PoseidonDDP
from poseidon_torch.bench.launch import free_port
from poseidon_torch.bench.workloads import build, placed
from poseidon_torch.trace import load_spans, summarize
from poseidon_torch.trace.streams import format_report, stream_report

TRACER_FIELDS = ("overlap_ratio", "iteration_ms_median", "step_ms_median", "comm_ms_per_iteration",
                 "exposed_comm_ms_per_iteration", "waits_ms_per_iteration")
WRAPPERS = ("poseidon-ps", "poseidon-hybrid", "poseidon-delay1", "torch-ddp")


def wrap(name: str, model: torch.nn.Module, trace_dir: Path, steps: int) -> torch.nn.Module:
    if name == "torch-ddp":
        return DDP(model)
    return PoseidonDDP(model, hybrid=name != "poseidon-ps", delay=1 if name == "poseidon-delay1" else 0,
                       trace_dir=str(trace_dir), trace_skip=steps, trace_iters=3)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    for name in args.wrappers:
        workload = placed(build(args.workload), device, args.batch_scale)
        model = wrap(name, workload.model, args.out / f"{name}-trace", args.warmup)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(i: int) -> None:
            x, y = workload.make_batch(rank, i)
            opt.zero_grad(set_to_none=True)
            workload.loss_fn(model(x), y).backward()
            opt.step()

        for i in range(args.warmup):
            step(i)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for i in range(args.warmup, args.warmup + 3):
                step(i)
            torch.cuda.synchronize()
        if rank == 0:
            prof.export_chrome_trace(str(args.out / f"{name}.json"))
        if hasattr(model, "close"):
            model.close()
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workload", default="resnet18")
    parser.add_argument("--batch-scale", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--wrappers", type=lambda text: text.split(","), default=list(WRAPPERS),
                        help=f"comma-separated, of {', '.join(WRAPPERS)}")
    args = parser.parse_args()
    unknown = sorted(set(args.wrappers) - set(WRAPPERS))
    if unknown:
        parser.error(f"--wrappers: unknown {unknown}; choose from {', '.join(WRAPPERS)}")
    if not torch.cuda.is_available():
        raise SystemExit("cuda_overlap.py needs a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    mp.spawn(rank_main, args=(args.ranks, free_port(), args), nprocs=args.ranks)
    summary = {}
    for name in args.wrappers:
        report = stream_report(json.loads((args.out / f"{name}.json").read_text()))
        traces = sorted((args.out / f"{name}-trace").glob("*.json"))
        merged = [t for t in traces if "merged" in t.name] or traces
        tracer = summarize(load_spans(merged[0])) if merged else None
        tracer = {key: tracer[key] for key in TRACER_FIELDS} if tracer else None
        summary[name] = {"streams": report, "tracer": tracer}
        print(f"== {name} ({args.workload}, batch {args.batch_scale} x the workload's, {args.ranks} ranks)")
        print(format_report(report))
        if tracer is not None:
            print("PoseidonDDP tracer (ms per iteration):", json.dumps(tracer, default=str))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
