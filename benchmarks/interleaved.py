"""Paired throughput: torch DDP and PoseidonDDP in the same processes, timed in alternating blocks.

    torchrun --nproc_per_node 2 benchmarks/interleaved.py [--workload gpt2] [--compile] \\
        [--modes torch-ddp,poseidon-ps,poseidon-hybrid] [--blocks 8] [--block-iters 4] [--out FILE]

``python -m poseidon_torch.bench`` runs each mode in processes of its own, one after the other, so a
machine that drifts by a few percent over minutes (this one does) moves every ratio by as much. Here
every rank builds each mode's model once (same seed, its own optimizer; ``--compile`` compiles each
during warm-up), then times ``--blocks`` rounds; in each round every mode runs ``--block-iters``
iterations (the batches built first, a barrier before each block), the order rotated from round to
round. An iteration's time is the slowest rank's block time over the block's iterations; CPU is every
rank's process time (all threads) over the block. Per mode: the median iteration time and, paired by
round, torch DDP's time over the mode's (> 1: faster than DDP), as median and range over the rounds.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from poseidon_torch.bench.worker import (OPTIMIZERS, POSEIDON_MODES, cpu_seconds, make_optimizer, train_step,
                                         wrapper_for)
from poseidon_torch.bench.workloads import WORKLOADS, build


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2")
    parser.add_argument("--modes", default="torch-ddp,poseidon-ps,poseidon-hybrid")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-iters", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    if args.modes[0] != "torch-ddp" or len(set(args.modes)) != len(args.modes) or args.blocks < 1 \
            or args.block_iters < 1 or args.warmup < 1:
        parser.error("--modes starts with torch-ddp and names each mode once; --blocks, --block-iters, "
                     "--warmup >= 1")
    return args


class Runner:
    """One mode on this rank: its model, optimizer, the callable it trains through, its step count."""

    def __init__(self, mode: str, args: argparse.Namespace, rank: int) -> None:
        self.mode, self.rank, self.step = mode, rank, 0
        self.workload = build(args.workload)
        self.model = wrapper_for(mode, args.timeout)(self.workload.model)
        self.optimizer = make_optimizer(mode, self.model, *OPTIMIZERS[args.optimizer])
        self.runs = torch.compile(self.model) if args.compile else self.model

    def time_block(self, iters: int) -> tuple[float, float]:
        """Seconds and CPU seconds per iteration of one block (the batches built before the clock)."""
        batches = [self.workload.make_batch(self.rank, self.step + i) for i in range(iters)]
        dist.barrier()
        cpu, start = cpu_seconds(), time.perf_counter()
        for batch in batches:
            train_step(self.runs, self.optimizer, batch, self.workload.loss_fn)
        elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        self.step += iters
        return elapsed / iters, cpu / iters

    def close(self) -> None:
        if self.mode in POSEIDON_MODES:
            self.model.close()


def summarise(args: argparse.Namespace, blocks: list[list[dict]]) -> dict:
    """``blocks[rank]``: that rank's records; per mode the slowest rank's time, the ranks' summed CPU."""
    rounds = []
    for records in zip(*blocks):
        rounds.append({mode: {"s": max(r[mode][0] for r in records), "cpu_s": sum(r[mode][1] for r in records)}
                       for mode in args.modes})
    summary = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "world_size": len(blocks),
               "rounds": rounds, "modes": {}}
    for mode in args.modes:
        ratios = [r["torch-ddp"]["s"] / r[mode]["s"] for r in rounds]
        summary["modes"][mode] = {
            "iter_ms": 1e3 * statistics.median(r[mode]["s"] for r in rounds),
            "cpu_s_per_iter": statistics.median(r[mode]["cpu_s"] for r in rounds),
            "vs_ddp_median": statistics.median(ratios), "vs_ddp_min": min(ratios), "vs_ddp_max": max(ratios)}
    return summary


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runners = [Runner(mode, args, rank) for mode in args.modes]
    try:
        for runner in runners:  # warm-up (and compilation), untimed
            runner.time_block(args.warmup)
        buckets = {r.mode: r.model.bucket_names for r in runners if r.mode in POSEIDON_MODES}
        records = []
        for round_ in range(args.blocks):
            order = runners[round_ % len(runners):] + runners[:round_ % len(runners)]
            records.append({runner.mode: runner.time_block(args.block_iters) for runner in order})
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        if rank == 0:
            summary = summarise(args, gathered)
            summary["buckets"] = buckets  # learned in warm-up: they may differ between modes and runs
            for mode, names in buckets.items():
                print(f"{mode} buckets, in sync order: {' | '.join(names)}")
            for mode, s in summary["modes"].items():
                print(f"{mode:18s} {s['iter_ms']:8.1f} ms  CPU {s['cpu_s_per_iter']:.3f} s/iter  vs DDP "
                      f"{s['vs_ddp_median']:.3f} (rounds {s['vs_ddp_min']:.3f}-{s['vs_ddp_max']:.3f})")
            if args.out:
                args.out.write_text(json.dumps(summary, indent=1))
    finally:
        for runner in runners:
            runner.close()
        runners.clear()  # torch DDP's Reducer must not be the process group's last owner (see bench.worker)
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
