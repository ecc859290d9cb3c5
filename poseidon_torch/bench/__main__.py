"""Benchmark runner: compute-only, torch DDP, poseidon-ps and poseidon-hybrid on one workload, side by side.

Usage::

    python -m poseidon_torch.bench --mode localhost|netns --hosts N --bandwidth 1gbit|10gbit [--latency 0.2ms]
        --workload fc_heavy|resnet|transformer|all --iters I --warmup W --out DIR [--tiny] [--timeout S]
        [--device cpu|cuda] [--batch-scale K]

``--device cuda`` puts rank r on GPU r mod count (ranks may share one GPU; gloo stages device tensors
through host memory, as torch DDP on gloo does too); ``--batch-scale K`` makes each step's batch K of
the workload's batches (GPU-sized batches of the same data).

For every workload it runs, one after the other: ``compute-only`` (N ranks side by side that never sync,
the same per-rank batch), ``torch-ddp``, ``poseidon-ps`` (PoseidonDDP(hybrid=False)) and ``poseidon-hybrid``
(PoseidonDDP(hybrid=True)), each with N ranks (one per host), each rank a
``python -m poseidon_torch.bench.worker`` process; ``--modes`` adds others, among them the baselines of a
slow network (:mod:`~poseidon_torch.bench.baselines`): ``torch-ddp-powersgd`` (rank ``--powersgd-rank``;
here it compresses from the first timed iteration on: ``start_powerSGD_iter`` is ``--warmup``, which must
be at least 2), ``torch-ddp-localsgd`` (period ``--localsgd-period``, which must divide ``--iters`` so that
the timed loop holds whole periods, as for ``poseidon-localsgd`` and ``poseidon-diloco``; no warm-up,
torch's default) and ``one-host`` (host 0 alone: one
rank, one host's threads; its CPU floor is over one host's share of the cores). It prints a table and writes ``DIR/results.json`` and
``DIR/results.png``; per-rank logs go to ``DIR/logs``, raw worker results to ``DIR/runs``.

Columns: iteration time (the slowest rank's timed loop over its iterations: the job's throughput); samples/s over all ranks (for compute-only:
N x batch / its iteration time, i.e. perfect scaling without communication); throughput relative
to torch DDP; bytes on the wire per iteration per host and where that number comes from (``wire``: the
host veth's tx_bytes, netns mode; ``comm_stats``: PoseidonDDP's own count; ``analytic``: ring all-reduce
2(P-1)/P x parameter bytes for DDP; localhost mode); the lower bound
``max(compute-only iteration, minimal bytes / bandwidth)`` and the iteration time divided by it; the
fraction of communication hidden under compute from the PoseidonDDP trace summary (``-`` when the
run wrote no trace); CPU seconds per iteration of all ranks together, and the mode's CPU floor: those
seconds spread over the cores the ranks share (this machine's, or the hosts' quotas with
``--cpus-per-host``). No schedule runs an iteration faster than its floor: where the iteration time
reaches it, the cores, not the link or the overlap, bound the mode (the emulated hosts' communication
costs CPU on the cores that also compute).

Minimal bytes per host per iteration, for P hosts: every parameter tensor synced by a bandwidth-optimal
all-reduce (2(P-1)/P of its bytes), except that a Linear layer that ran with K rows in the forward pass
may instead use sufficient factors ((P-1) K (M+N) values), whichever is smaller.

Modes:
- ``localhost``: ranks on 127.0.0.1 (gloo over ``lo``). The bandwidth is NOT enforced; it only enters the
  lower bound. Works as any user.
- ``netns``: an emulated cluster (:mod:`poseidon_torch.bench.netns`): one network namespace per host, a
  bridge, tbf shaping both ways per link; gloo bound to each host's veth. Needs root; without it the
  runner says so and falls back to localhost.

Invariants:
- All ranks share this machine: each rank uses 1 torch thread when N > 1, all cores when N == 1; the
  compute-only ranks run side by side as the synced ones do, so each gets the same CPU share.
- Worker processes run in their own process groups and are always stopped (SIGTERM, then SIGKILL) and
  namespaces always deleted, on success, failure, exceptions, Ctrl-C, SIGTERM and SIGHUP.
- A mode that fails (e.g. PoseidonDDP missing) is recorded with its error and the other modes still run;
  the exit status is 0 only if every mode of every workload succeeded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from poseidon_torch.bench.baselines import LOCALSGD, ONE_HOST, POWERSGD, POWERSGD_MIN_START, TORCH_LOCALSGD_WARMUP, \
    Baselines, add_baseline_arguments, baseline_argv, ranks_for
from poseidon_torch.bench.launch import STARTUP_GRACE_S, Placement, RankFailure, add_placement_arguments, free_port, \
    fresh_dir, rank_env, run_placed, run_ranks, threads_per_rank, write_report
from poseidon_torch.bench.netns import parse_delay, parse_rate
from poseidon_torch.bench.worker import ALONE_MODES, DEFAULT_MODES, MODES, PERIODIC_MODES, POSEIDON_MODES, \
    add_device_arguments
from poseidon_torch.extras import require
from poseidon_torch.bench.workloads import MAIN_WORKLOADS, WORKLOADS

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m poseidon_torch.bench",
                                     description="PoseidonDDP vs torch DDP on localhost or an emulated cluster.")
    add_placement_arguments(parser)
    parser.add_argument("--workload", choices=(*sorted(WORKLOADS), "all"), default="fc_heavy")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--tiny", action="store_true", help="shrunken models (smoke tests)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="SGD with momentum, or AdamW (the sharded modes shard its state)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each rank may run")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the wrapped model in every mode (inductor; warm-up covers compilation)")
    parser.add_argument("--no-trace", dest="trace", action="store_false",
                        help="do not trace the PoseidonDDP modes (no overlap column; for short iterations, "
                             "where recording the window would weigh on the times)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, compute-only and torch-ddp included (of {', '.join(MODES)})")
    add_device_arguments(parser)
    add_baseline_arguments(parser, warm_ups=False)
    args = parser.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown or not {"compute-only", "torch-ddp"} <= set(args.modes):
        parser.error(f"--modes needs compute-only and torch-ddp, and only modes of {MODES}")
    if POWERSGD in args.modes and args.warmup < 2:
        parser.error(f"{POWERSGD} compresses from step --warmup on, so that the timed loop times compressed "
                     f"steps, and torch's PowerSGD cannot start before step 2: give --warmup 2 or more")
    periodic = sorted(set(args.modes) & {LOCALSGD, *PERIODIC_MODES})
    if periodic and args.iters % args.localsgd_period:
        parser.error(f"{', '.join(periodic)} average every --localsgd-period ({args.localsgd_period}) steps: give "
                     f"--iters a multiple of it, so that the timed loop holds whole periods")
    try:
        args.bandwidth_bps = parse_rate(args.bandwidth)
        args.latency = parse_delay(args.latency) if args.latency else None
        timed_baselines(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.hosts < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--hosts and --iters must be >= 1, --warmup >= 0")
    return args


def worker_argv(args: argparse.Namespace, mode: str, workload: str, result: Path, threads: int,
                wire_iface: str | None, trace_dir: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "poseidon_torch.bench.worker", "--mode", mode, "--workload", workload,
            "--iters", str(args.iters), "--warmup", str(args.warmup), "--threads", str(threads),
            "--timeout", str(args.timeout), "--result", str(result)]
    argv += ["--tiny"] * args.tiny
    argv += ["--optimizer", args.optimizer]
    argv += ["--compile"] * args.compile
    argv += ["--device", args.device, "--batch-scale", str(args.batch_scale)]
    argv += ["--wire-iface", wire_iface] if wire_iface else []
    argv += ["--trace-dir", str(trace_dir)] if trace_dir else []
    return argv + baseline_argv(timed_baselines(args))


def timed_baselines(args: argparse.Namespace) -> Baselines:
    """The baselines as timed here: PowerSGD compresses from the first timed iteration (from torch's
    earliest start on, where ``--warmup`` is shorter: only without ``torch-ddp-powersgd``, which the parser
    refuses then), local SGD has no warm-up (torch's default)."""
    return Baselines(args.powersgd_rank, max(args.warmup, POWERSGD_MIN_START), args.localsgd_period,
                     TORCH_LOCALSGD_WARMUP, args.streaming_fragments, args.streaming_delay)


def overlap_from_trace(trace_dir: Path | None) -> float | None:
    """The overlap ratio of the run's trace (merged one first); None without a readable trace."""
    from poseidon_torch.trace import TraceFormatError, load_spans, summarize

    traces = sorted(trace_dir.glob("*.json"), key=lambda p: ("merged" not in p.name, p.name)) if trace_dir else []
    try:
        return summarize(load_spans(traces[0]))["overlap_ratio"] if traces else None
    except (OSError, TraceFormatError):
        return None


def run_mode(args: argparse.Namespace, placement: Placement, workload: str, mode: str) -> dict:
    """One mode of one workload; the worker's result, or ``{"mode", "error", "log_tail"}``."""
    name = f"{workload}-{mode}"
    synced = mode not in ALONE_MODES
    world, threads = ranks_for(mode, args.hosts), threads_per_rank(args.hosts)
    result = args.out / "runs" / f"{name}.json"
    result.unlink(missing_ok=True)
    trace_dir = fresh_dir(args.out / "traces" / name) if mode in POSEIDON_MODES and args.trace else None
    wire_iface = placement.wire_iface if synced else None
    argv = worker_argv(args, mode, workload, result, threads, wire_iface, trace_dir)
    port = free_port()
    commands = [placement.wrap(rank, argv) for rank in range(world)]
    envs = [rank_env(placement, rank, world, port, threads) for rank in range(world)]
    logs = [args.out / "logs" / f"{name}-rank{rank}.log" for rank in range(world)]
    try:
        run_ranks(commands, envs, logs, args.timeout + STARTUP_GRACE_S)
    except RankFailure as exc:
        return {"mode": mode, "error": str(exc), "log_tail": exc.log_tail}
    report = json.loads(result.read_text())
    report["overlap"] = overlap_from_trace(trace_dir) if mode in POSEIDON_MODES else None
    return report


def minimal_sync_bytes(profile: dict, hosts: int) -> float:
    """Fewest bytes per host per iteration: all-reduce everything, or sufficient factors where cheaper."""
    if hosts == 1:
        return 0.0
    share = 2 * (hosts - 1) / hosts
    linear_bytes = sum(layer["bytes"] for layer in profile["linear"])
    total = share * (profile["param_bytes"] - linear_bytes)
    for layer in profile["linear"]:
        values = layer["M"] * layer["N"] + (layer["M"] if layer["bias"] else 0)
        factor_bytes = (hosts - 1) * layer["K"] * (layer["M"] + layer["N"]) * layer["bytes"] / values
        total += min(share * layer["bytes"], factor_bytes)
    return total


def add_derived(entry: dict, hosts: int, bandwidth_bps: int, cores: float) -> None:
    """Lower bound, ratio to DDP, ratio to the bound and each mode's CPU floor over its hosts' share of
    ``cores`` (all of them, but one host's for ``one-host``), from the modes' results in ``entry``. The
    bound is the ``hosts``-host job's (its compute and its sync): ``one-host`` runs another job, with no
    sync and without the other hosts' load, so it has no ratio to it."""
    modes = entry["modes"]
    compute = modes["compute-only"]
    ddp = modes["torch-ddp"]
    if "error" not in compute:
        compute["samples_per_s"] = hosts * compute["batch_per_rank"] / compute["iter_s"]
        entry["profile"] = compute["profile"]
        entry["minimal_bytes_per_iter_per_host"] = minimal_sync_bytes(compute["profile"], hosts)
        entry["lower_bound"] = {"compute_s": compute["iter_s"],
                                "network_s": entry["minimal_bytes_per_iter_per_host"] * 8 / bandwidth_bps}
        entry["lower_bound_s"] = max(entry["lower_bound"].values())
    for result in modes.values():
        if "error" in result:
            continue
        result["ratio_to_ddp"] = result["samples_per_s"] / ddp["samples_per_s"] if "error" not in ddp else None
        bound = entry.get("lower_bound_s")
        result["ratio_to_lower_bound"] = result["iter_s"] / bound if bound and result["mode"] != ONE_HOST else None
        result["cpu_floor_s"] = result["cpu_s_per_iter"] / (cores * result["world_size"] / hosts)


def shared_cores(placement: Placement, hosts: int) -> float:
    """The CPUs all ranks share: the hosts' quotas where set, else the cores this process may use."""
    if placement.cpus_per_host is not None:
        return placement.cpus_per_host * hosts
    return float(len(os.sched_getaffinity(0)))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict) -> str:
    header = (f"{'workload':<12} {'mode':<20} {'iter ms':>9} {'samples/s':>10} {'vs DDP':>7} {'MB/iter/host':>12} "
              f"{'source':<10} {'bound ms':>9} {'x bound':>8} {'overlap':>8} {'CPU s/iter':>10} {'CPU floor ms':>12} "
              f"{'opt MB/rank':>11}")
    lines = [header, "-" * len(header)]
    for workload, entry in report["workloads"].items():
        bound = entry.get("lower_bound_s")
        for mode, r in entry["modes"].items():
            if "error" in r:
                lines.append(f"{workload:<12} {mode:<20} FAILED: {r['error']}")
                continue
            lines.append(
                f"{workload:<12} {mode:<20} {r['iter_s'] * 1e3:>9.1f} {r['samples_per_s']:>10.1f} "
                f"{_fmt(r['ratio_to_ddp'], '.2f'):>7} {r['bytes_per_iter_per_host'] / 1e6:>12.3f} "
                f"{r['bytes_source']:<10} {_fmt(None if bound is None else bound * 1e3, '.1f'):>9} "
                f"{_fmt(r['ratio_to_lower_bound'], '.2f'):>8} {_fmt(r['overlap'], '.1%'):>8} "
                f"{_fmt(r.get('cpu_s_per_iter'), '.3f'):>10} {r['cpu_floor_s'] * 1e3:>12.1f} "
                f"{_fmt(_state_mb(r), '.1f'):>11}")
    return "\n".join(lines + report["config"].get("baseline_notes", []))


def _state_mb(result: dict) -> float | None:
    """The largest optimizer state one rank holds, MB."""
    by_rank = result.get("optimizer_state_bytes_by_rank")
    return max(by_rank) / 1e6 if by_rank else None


def plot(report: dict, path: Path) -> None:
    """Grouped bars per workload: samples/s (with the lower bound's throughput) and MB per iteration per host."""
    require("matplotlib", "bench", "the benchmark plot").use("Agg")
    from matplotlib.figure import Figure

    workloads = list(report["workloads"])
    fig = Figure(figsize=(max(6, 3 * len(workloads)), 7), layout="constrained")
    speed_ax, bytes_ax = fig.subplots(2, 1)
    modes = list(report["workloads"][workloads[0]]["modes"])
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        results = [report["workloads"][w]["modes"][mode] for w in workloads]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(workloads))]
        speed_ax.bar(xs, [r.get("samples_per_s", 0.0) for r in results], width, label=mode)
        bytes_ax.bar(xs, [r.get("bytes_per_iter_per_host", 0.0) / 1e6 for r in results], width, label=mode)
    cfg = report["config"]
    for j, workload in enumerate(workloads):
        entry = report["workloads"][workload]
        if entry.get("lower_bound_s"):
            samples = cfg["hosts"] * entry["modes"]["compute-only"]["batch_per_rank"] / entry["lower_bound_s"]
            speed_ax.hlines(samples, j - 0.45, j + 0.45, colors="black", linestyles="dashed",
                            label="lower bound" if j == 0 else None)
    for ax, label in ((speed_ax, "samples/s (all ranks)"), (bytes_ax, "MB per iteration per host")):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    speed_ax.legend(fontsize="small")
    speed_ax.set_title(f"{cfg['mode']}, {cfg['hosts']} hosts, {cfg['bandwidth']}"
                       f"{'' if cfg['bandwidth_enforced'] else ' (not enforced)'}")
    fig.savefig(path, dpi=120)


def config(args: argparse.Namespace, placement: Placement, workloads: list[str]) -> dict:
    return {
        "mode_requested": args.mode, "mode": placement.kind, "hosts": args.hosts, "bandwidth": args.bandwidth,
        "bandwidth_bps": args.bandwidth_bps, "bandwidth_enforced": placement.kind == "netns",
        "latency": args.latency, "latency_applied": placement.latency is not None,
        "mtu": args.mtu if placement.kind == "netns" else None,
        "threads_per_rank": threads_per_rank(args.hosts), "cpus_per_host": placement.cpus_per_host,
        "shared_cores": shared_cores(placement, args.hosts),
        "iters": args.iters, "warmup": args.warmup,
        "tiny": args.tiny, "workloads": workloads, "warnings": placement.warnings,
        "device": args.device, "batch_scale": args.batch_scale,
        "baselines": timed_baselines(args).describe(args.modes),
        "baseline_notes": timed_baselines(args).footnotes(args.modes),
    }


def run_all(args: argparse.Namespace, placement: Placement) -> dict:
    workloads = list(MAIN_WORKLOADS) if args.workload == "all" else [args.workload]
    report = {"config": config(args, placement, workloads), "workloads": {}}
    for warning in placement.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for workload in workloads:
        entry = {"modes": {}}
        for mode in args.modes:
            print(f"[{workload}] {mode} ...", file=sys.stderr, flush=True)
            entry["modes"][mode] = run_mode(args, placement, workload, mode)
            if "error" in entry["modes"][mode]:
                print(f"[{workload}] {mode} FAILED: {entry['modes'][mode]['error']}", file=sys.stderr)
        add_derived(entry, args.hosts, args.bandwidth_bps, report["config"]["shared_cores"])
        report["workloads"][workload] = entry
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run_placed(args, lambda placement: run_all(args, placement))
    if isinstance(report, int):
        return report
    write_report(args.out, report, plot, table)
    failed = [m for e in report["workloads"].values() for m in e["modes"].values() if "error" in m]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
