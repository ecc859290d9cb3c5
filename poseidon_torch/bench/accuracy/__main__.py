"""Time to accuracy: every mode trains the same task on real data, side by side, with emulated stragglers.

Usage::

    python -m poseidon_torch.bench.accuracy --task lm|digits --mode localhost|netns --hosts N
        [--bandwidth 1gbit] [--modes torch-ddp,poseidon-ps,...] (--steps S | --time-budget SECONDS)
        --eval-every E [--straggler persistent:factor=2] [--target VALUE] [--budget SECONDS] --out DIR

Each mode runs after the other, in the order given (but a straggler's calibration comes from the first mode
on every host, which then runs first) (one worker process per host, :mod:`~poseidon_torch.bench.accuracy.worker`;
``one-host``: host 0's alone), from the same initial weights and the same data order. The baselines of a
slow network (:mod:`~poseidon_torch.bench.baselines`: ``torch-ddp-powersgd``, ``torch-ddp-localsgd``,
``one-host``) take ``--powersgd-rank``, ``--powersgd-start-iter``, ``--localsgd-period`` and
``--localsgd-warmup``; PoseidonDDP's periodic modes (``poseidon-localsgd``, ``poseidon-diloco``) sync every
``--localsgd-period`` steps too. The run writes ``DIR/results.json`` (every evaluated point of every mode, the
configuration, the derived numbers), ``DIR/results.png`` (validation metric against training seconds and
against steps) and prints a table (:mod:`~poseidon_torch.bench.accuracy.report`): steps, training
seconds, seconds per step, samples/s, bytes sent per step per host, the final metric, seconds to the
target (``--target``; default: torch DDP's last value on the evaluation grid), the metric at a time budget
(``--budget``; default: the shortest run's training time) and the speed-up to the target over torch DDP
and over ``one-host``. A progress line per evaluation point is echoed while a mode runs; rank logs go to
``DIR/logs``.

Invariants: the launch, placement and clean-up are the throughput benchmark's
(:mod:`poseidon_torch.bench.launch`); a failed mode is recorded with its error and the others still run
(exit status 1); a slow link needs an emulated cluster, so ``slow-link`` outside netns mode is refused.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from poseidon_torch.bench.accuracy.report import add_derived, plot, table
from poseidon_torch.bench.accuracy.stragglers import parse_straggler
from poseidon_torch.bench.accuracy.tasks import TASKS
from poseidon_torch.bench.baselines import ONE_HOST, Baselines, add_baseline_arguments, baseline_argv, baselines_from, \
    ranks_for
from poseidon_torch.bench.launch import STARTUP_GRACE_S, Placement, RankFailure, add_placement_arguments, free_port, \
    rank_env, run_placed, run_ranks, threads_per_rank, write_report
from poseidon_torch.bench.netns import parse_delay, parse_rate
from poseidon_torch.bench.worker import MODES, baseline_options_of

#: one-host in every default table: the wall time a second machine must beat to be worth having
DEFAULT_MODES = ("torch-ddp", "poseidon-ps", "poseidon-hybrid", "poseidon-server-lazy", "one-host")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m poseidon_torch.bench.accuracy",
                                     description="Time to accuracy on real data, every mode side by side.")
    parser.add_argument("--task", choices=sorted(TASKS), default="lm")
    add_placement_arguments(parser)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, help="steps per mode (with --time-budget: at most)")
    parser.add_argument("--time-budget", type=float, help="training seconds per mode (rank 0's clock)")
    parser.add_argument("--eval-every", type=int, default=20, help="evaluate every this many steps")
    parser.add_argument("--straggler", default="none",
                        help="none | persistent:factor=F[,rank=R] | transient:p=P,delay=D[,seed=S] | "
                             "slow-link:rate=RATE[,rank=R] (D: 50ms, or a fraction of a step's compute)")
    parser.add_argument("--target", type=float,
                        help="target value of the metric (default: torch DDP's last value on the evaluation grid)")
    parser.add_argument("--budget", type=float, help="report the metric at this many training seconds "
                                                     "(default: the shortest run's)")
    parser.add_argument("--tiny", action="store_true", help="shrunken models (smoke tests)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds each rank may run, wall clock: evaluations included (a periodic mode's "
                             "first averages the model over the link, 10 s per evaluation at 10 Mbit/s for lm-wide)")
    parser.add_argument("--out", type=Path, default=Path("accuracy_out"))
    add_baseline_arguments(parser)
    args = parser.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes modes of {', '.join(MODES)}")
    if args.steps is None and args.time_budget is None:
        parser.error("give --steps, --time-budget or both")
    if args.hosts < 1 or args.eval_every < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--hosts, --eval-every and --steps must be >= 1")
    if len(set(args.modes)) != len(args.modes):
        parser.error("--modes names a mode twice")
    if not all(math.isfinite(v) and v > 0 for v in (args.timeout, args.time_budget or 1.0)):
        parser.error("--timeout and --time-budget must be positive seconds")
    if not all(v is None or math.isfinite(v) for v in (args.target, args.budget)):
        parser.error("--target and --budget must be numbers")
    if args.budget is not None and args.budget <= 0:
        parser.error("--budget must be positive seconds of training (the metric is read at that time)")
    try:
        parse_rate(args.bandwidth)
        args.latency = parse_delay(args.latency) if args.latency else None
        args.straggler_spec = parse_straggler(args.straggler, args.hosts)
        baselines_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.straggler_spec.kind == "slow-link" and args.mode != "netns":
        parser.error("a slow-link straggler shapes a link: it needs --mode netns")
    for name in sorted(set(asdict(Baselines())) - set(options_read(args))):
        if getattr(args, name) != parser.get_default(name):
            print(f"warning: --{name.replace('_', '-')} {getattr(args, name)}: no mode of --modes reads it",
                  file=sys.stderr)
    return args


class ProgressEcho:
    """Prints the ``progress:`` lines rank 0 adds to its log, prefixed with the mode."""

    def __init__(self, log: Path, prefix: str) -> None:
        self.log, self.prefix, self.seen = log, prefix, 0

    def __call__(self) -> None:
        if not self.log.exists():
            return
        lines = self.log.read_text(errors="replace").splitlines()
        for line in lines[self.seen:]:
            if line.startswith("progress:"):
                print(f"[{self.prefix}] {line[len('progress:'):].strip()}", file=sys.stderr, flush=True)
        self.seen = len(lines)


def worker_argv(args: argparse.Namespace, mode: str, result: Path, threads: int,
                compute_s: list[float] | None, wire_iface: str | None) -> list[str]:
    argv = [sys.executable, "-m", "poseidon_torch.bench.accuracy.worker", "--task", args.task, "--mode", mode,
            "--eval-every", str(args.eval_every), "--straggler", args.straggler, "--threads", str(threads),
            "--timeout", str(args.timeout), "--result", str(result), *baseline_argv(baselines_from(args))]
    argv += ["--compute-s", ",".join(map(repr, compute_s))] if compute_s else []
    argv += ["--wire-iface", wire_iface] if wire_iface else []
    argv += ["--shards", str(args.hosts)] if mode == ONE_HOST else []
    argv += ["--steps", str(args.steps)] if args.steps is not None else []
    argv += ["--time-budget", str(args.time_budget)] if args.time_budget is not None else []
    return argv + ["--tiny"] * args.tiny


def run_mode(args: argparse.Namespace, placement: Placement, mode: str, compute_s: list[float] | None) -> dict:
    """One mode's result, or ``{"error", "log_tail"}``; ``compute_s``: the straggler's calibration."""
    result = args.out / "runs" / f"{mode}.json"
    result.unlink(missing_ok=True)
    threads, ranks = threads_per_rank(args.hosts), ranks_for(mode, args.hosts)  # one-host: one host's threads
    argv = worker_argv(args, mode, result, threads, compute_s, placement.wire_iface)
    port = free_port()
    logs = [args.out / "logs" / f"{mode}-rank{rank}.log" for rank in range(ranks)]
    try:
        run_ranks([placement.wrap(rank, argv) for rank in range(ranks)],
                  [rank_env(placement, rank, ranks, port, threads) for rank in range(ranks)],
                  logs, args.timeout + STARTUP_GRACE_S, ProgressEcho(logs[0], mode))
    except RankFailure as exc:
        return {"error": str(exc), "log_tail": exc.log_tail}
    return json.loads(result.read_text())


def options_read(args: argparse.Namespace) -> dict:
    """The baseline options (``--localsgd-period`` ...) that some mode of the run reads, with their values."""
    options = asdict(baselines_from(args))
    return {name: options[name] for name in sorted({name for mode in args.modes for name in baseline_options_of(mode)})}


def config(args: argparse.Namespace, placement: Placement) -> dict:
    enforced = placement.kind == "netns"
    return {"task": args.task, "mode_requested": args.mode, "mode": placement.kind, "hosts": args.hosts,
            "link": args.bandwidth if enforced else "localhost", "latency": placement.latency,
            "straggler": args.straggler, "straggler_spec": args.straggler_spec.describe(), "steps": args.steps,
            "time_budget_s": args.time_budget, "eval_every": args.eval_every, "tiny": args.tiny,
            "threads_per_rank": threads_per_rank(args.hosts), "cpus_per_host": placement.cpus_per_host,
            "warnings": placement.warnings, "baseline_options": options_read(args),
            "baselines": baselines_from(args).describe(args.modes),
            "baseline_notes": baselines_from(args).footnotes(args.modes)}


def run_order(modes: list[str], hosts: int, calibrates: bool) -> list[str]:
    """``modes`` in the order they run: as given, except that where the straggler needs its calibration the
    first mode on every host runs first, so that it calibrates every host and ``one-host`` gets host 0's
    calibration too instead of its own."""
    if not calibrates:
        return list(modes)
    first = next((mode for mode in modes if ranks_for(mode, hosts) == hosts), None)
    return list(modes) if first is None else [first, *(mode for mode in modes if mode != first)]


def run_all(args: argparse.Namespace, placement: Placement) -> dict:
    if args.straggler_spec.kind == "slow-link" and placement.kind != "netns":
        raise RuntimeError("a slow-link straggler needs the emulated cluster, which could not be built")
    report = {"config": config(args, placement), "modes": {}}
    for warning in placement.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    calibration = None  # the first mode's, handed to the others: every mode gets the same straggler
    for mode in run_order(args.modes, args.hosts, args.straggler_spec.needs_calibration):
        print(f"[{mode}] ...", file=sys.stderr, flush=True)
        run = report["modes"][mode] = run_mode(args, placement, mode, calibration)
        if "error" in run:
            print(f"[{mode}] FAILED: {run['error']}", file=sys.stderr)
        elif calibration is None and args.straggler_spec.needs_calibration and run["world_size"] == args.hosts:
            calibration = run["compute_s_by_rank"]
    report["modes"] = {mode: report["modes"][mode] for mode in args.modes}  # the table's rows as asked
    add_derived(report, args.target, args.budget)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run_placed(args, lambda placement: run_all(args, placement), args.straggler_spec.host_rates())
    if isinstance(report, int):
        return report
    write_report(args.out, report, plot, table)
    return 1 if any("error" in run for run in report["modes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
