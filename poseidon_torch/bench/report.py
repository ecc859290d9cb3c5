"""Markdown results table from benchmark runs: one row per (hosts, bandwidth, workload, mode).

    python -m poseidon_torch.bench.report bench_out/*/results.json

Invariant: every number is read from the runs' ``results.json``; nothing is recomputed but the
ratio of each mode's iteration time to the compute-only lower bound, which the runner also reports.
Files written before the CPU floor existed print ``-`` in its column.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("| hosts | link | workload | mode | iteration ms | samples/s | vs DDP | MB/iter/host | x bound | overlap "
          "| CPU s/iter | CPU floor ms | optimizer MB/rank |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def rows(path: Path) -> list[str]:
    results = json.loads(path.read_text())
    if any("median_iter_s" in run and "iter_s" not in run for entry in results["workloads"].values()
           for run in entry["modes"].values()):
        raise SystemExit(f"{path}: written before 2026-11-26, without iter_s (its median_iter_s is another "
                         "metric, see bench/worker.py); run it again to put it in this table")
    config = dict(results["config"])
    if not config.get("bandwidth_enforced"):
        config["bandwidth"] = "localhost"  # the bandwidth was only the lower bound's assumption
    out = []
    for workload, entry in results["workloads"].items():
        for mode, run in entry["modes"].items():
            if "error" in run:
                out.append(f"| {config['hosts']} | {config['bandwidth']} | {workload} | {mode} | failed | | | | | | | | |")
                continue
            state = run.get("optimizer_state_bytes_by_rank")
            out.append("| {} | {} | {} | {} | {:.0f} | {:.0f} | {} | {:.2f} | {} | {} | {} | {} | {} |".format(
                config["hosts"], config["bandwidth"], workload, mode, run["iter_s"] * 1e3,
                run["samples_per_s"], _or_dash(run.get("ratio_to_ddp"), "{:.2f}x"),
                run["bytes_per_iter_per_host"] / 1e6, _or_dash(run.get("ratio_to_lower_bound"), "{:.2f}"),
                _or_dash(run.get("overlap"), "{:.0%}"), _or_dash(run.get("cpu_s_per_iter"), "{:.2f}"),
                _or_dash(run["cpu_floor_s"] * 1e3 if "cpu_floor_s" in run else None, "{:.0f}"),
                _or_dash(max(state) / 1e6 if state else None, "{:.1f}")))
    return out


def _or_dash(value: float | None, fmt: str) -> str:
    """A missing number (its run failed, or it had nothing to measure) prints as "-"."""
    return "-" if value is None else fmt.format(value)


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m poseidon_torch.bench.report RESULTS.json ...", file=sys.stderr)
        return 2
    print(HEADER)
    for path in paths:
        print("\n".join(rows(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
