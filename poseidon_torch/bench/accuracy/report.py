"""Reading time-to-accuracy runs: time to a target, the metric at a time budget, BSP parity, table, figure.

Every function reads a mode's ``evals`` (points ``{"step", "time_s", <metric>: value, ...}`` in step order, as
the worker writes them); the judged metric is lower-is-better (validation loss or bits per byte).

Invariants: nothing is interpolated (a target counts as reached at the first evaluated point at or below
it); a mode that failed has no numbers and is shown as failed.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

REFERENCE_MODE = "torch-ddp"


def time_to(evals: list[dict], metric: str, target: float) -> dict | None:
    """The first point whose ``metric`` is at or below ``target``, or None."""
    return next((point for point in evals if point[metric] <= target), None)


def value_at(evals: list[dict], metric: str, seconds: float) -> float | None:
    """``metric`` at the last point evaluated at or before ``seconds`` of training."""
    before = [point for point in evals if point["time_s"] <= seconds]
    return before[-1][metric] if before else None


def divergence_from(reference: list[dict], evals: list[dict], metric: str) -> float:
    """Largest relative difference of ``metric`` at the steps both runs evaluated (loss against steps)."""
    at_step = {point["step"]: point[metric] for point in reference}
    common = [(at_step[p["step"]], p[metric]) for p in evals if p["step"] in at_step]
    if len(common) < 2:
        raise ValueError("the runs share fewer than two evaluated steps")
    return max(abs(value - ref) / abs(ref) for ref, value in common)


def default_target(reference: dict, metric: str, every: int) -> float:
    """The value torch DDP ends at: its last point on the evaluation grid (steps that are multiples of
    ``every``), which every mode evaluates; its final point falls on another step in each run when the
    budget is time, and a loss curve moves between steps. A run that ended before the grid's first
    step after 0: its final point."""
    on_grid = [point for point in reference["evals"] if point["step"] % every == 0 and point["step"] > 0]
    return (on_grid or reference["evals"])[-1][metric]  # a run shorter than the grid: its final point


def add_derived(report: dict, target: float | None, budget_s: float | None) -> None:
    """Target (default: :func:`default_target`), time to it and value at the budget (default: the
    shortest run's training time), for every mode that ran."""
    runs = {mode: r for mode, r in report["modes"].items() if "error" not in r}
    if not runs:
        return
    metric = next(iter(runs.values()))["metric"]
    reference = runs.get(REFERENCE_MODE)
    if target is None and reference:
        target = default_target(reference, metric, report["config"]["eval_every"])
    if budget_s is None:
        budget_s = min(r["train_time_s"] for r in runs.values())
    report.update(metric=metric, target=target, budget_s=budget_s)
    for run in runs.values():
        reached = time_to(run["evals"], metric, target) if target is not None else None
        run["time_to_target_s"] = reached["time_s"] if reached else None
        run["steps_to_target"] = reached["step"] if reached else None
        run["value_at_budget"] = value_at(run["evals"], metric, budget_s)
        run["final_value"] = run["evals"][-1][metric]
        if reference and run is not reference:
            with contextlib.suppress(ValueError):  # fewer than two common steps: no curve to compare
                run["divergence_from_ddp"] = divergence_from(reference["evals"], run["evals"], metric)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict) -> str:
    """Markdown: one row per mode."""
    metric, budget = report.get("metric", "metric"), report.get("budget_s")
    lines = [f"| mode | steps | train s | samples/s | final {metric} | s to {_fmt(report.get('target'), '.4g')} "
             f"| {metric} at {_fmt(budget, '.1f')} s | vs DDP by step | extra |", "|---" * 9 + "|"]
    for mode, run in report["modes"].items():
        if "error" in run:
            lines.append(f"| {mode} | failed: {run['error']} | | | | | | | |")
            continue
        last = run["evals"][-1]
        extra = f"accuracy {last['val_accuracy']:.3f}" if "val_accuracy" in last else ""
        lines.append(f"| {mode} | {max(run['steps_by_rank'])} | {run['train_time_s']:.1f} | {run['samples_per_s']:.1f} "
                     f"| {run['final_value']:.3f} | {_fmt(run['time_to_target_s'], '.1f')} "
                     f"| {_fmt(run['value_at_budget'], '.3f')} | {_fmt(run.get('divergence_from_ddp'), '.1e')} "
                     f"| {extra} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Two panels, one curve per mode: the metric against training seconds, and against steps."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_time, by_step = fig.subplots(1, 2, sharey=True)
    metric = report.get("metric", "")
    for mode, run in report["modes"].items():
        if "error" in run:
            continue
        evals = run["evals"]
        by_time.plot([p["time_s"] for p in evals], [p[metric] for p in evals], marker=".", label=mode)
        by_step.plot([p["step"] for p in evals], [p[metric] for p in evals], marker=".", label=mode)
    if report.get("target") is not None:
        for ax in (by_time, by_step):
            ax.axhline(report["target"], color="grey", linestyle=":", linewidth=1)
    by_time.set_xlabel("training seconds")
    by_step.set_xlabel("steps")
    by_time.set_ylabel(f"validation {metric}")
    for ax in (by_time, by_step):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    cfg = report["config"]
    fig.suptitle(f"{cfg['task']}: {cfg['hosts']} hosts, {cfg['link']}, straggler {cfg['straggler']}")
    fig.savefig(path, dpi=120)
