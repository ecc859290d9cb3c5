"""Reading time-to-accuracy runs: time to a target, the metric at a time budget, BSP parity, table, figure.

Every function reads a mode's ``evals`` (points ``{"step", "time_s", <metric>: value, ...}`` in step order, as
the worker writes them); the judged metric is lower-is-better (validation loss or bits per byte).

Speed-ups are taken at equal validation value, the target: a reference mode's time to it over this mode's.
Where the reference never reached it, the speed-up is at least the reference's training time over this
mode's time to it (a lower bound, shown as ">= x"). A target the initial model meets (step 0, the same
model in every mode) gives no speed-up, and the table says so.

Invariants: nothing is interpolated (a target counts as reached at the first evaluated point at or below
it); a mode that failed has no numbers and is shown as failed.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from poseidon_torch.extras import require

REFERENCE_MODE = "torch-ddp"
#: the modes every speed-up is stated over: torch DDP, and one host training alone
SPEEDUP_REFERENCES = (REFERENCE_MODE, "one-host")


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
    report["target_met_untrained"] = any(run["steps_to_target"] == 0 for run in runs.values())
    for run in runs.values():
        run["speedup_over"] = {name: speedup(runs[name], run) for name in SPEEDUP_REFERENCES if name in runs}
        run["slowest_level_speedup_over"] = {name: slowest_level_speedup(runs[name], run, metric)
                                             for name in SPEEDUP_REFERENCES if name in runs and runs[name] is not run}


def speedup(reference: dict, run: dict) -> dict | None:
    """``{"x": reference's time to the target / run's, "at_least": whether the reference never reached it
    (then x is its training time over run's time to the target)}``; None if ``run`` never reached it, or
    reached it untrained (step 0: every mode starts from the same model, and the time of that point is
    the snapshot's, not training's)."""
    if run["time_to_target_s"] is None or run["steps_to_target"] == 0:
        return None
    if reference["time_to_target_s"] is not None:
        return {"x": reference["time_to_target_s"] / run["time_to_target_s"], "at_least": False}
    return {"x": reference["train_time_s"] / run["time_to_target_s"], "at_least": True}


def slowest_level_speedup(reference: dict, run: dict, metric: str) -> dict | None:
    """The speed-up over ``reference`` at the level where it is smallest, over every value that either
    run evaluated below both runs' first evaluation after the start (step 0): ``{"x", "value",
    "at_least", "levels"}``, or None where there is no such level. The first evaluation is left out as
    the issue's criterion does ("at every value below the first evaluation"): before it the curves are
    one grid step apart by construction, not by the mode.

    At each level v the speed-up is the reference's time to v over the run's (:func:`time_to` on both
    curves); a level the run never reached counts 0, one the reference never reached gives the lower
    bound of its training time over the run's time. Both times are step functions that change only at
    evaluated values, so these levels cover every value down to the lowest one evaluated: x > 1 means
    the run reached every such value sooner than the reference."""
    if min(len(reference["evals"]), len(run["evals"])) < 2:
        return None
    first = min(reference["evals"][1][metric], run["evals"][1][metric])
    levels = sorted({point[metric] for curve in (reference, run) for point in curve["evals"][1:]
                     if point[metric] < first}, reverse=True)
    worst = None
    for level in levels:
        ours, theirs = time_to(run["evals"], metric, level), time_to(reference["evals"], metric, level)
        if ours is None:
            x, at_least = 0.0, False
        elif theirs is None:
            x, at_least = reference["train_time_s"] / ours["time_s"], True
        else:
            x, at_least = theirs["time_s"] / ours["time_s"], False
        if worst is None or x < worst["x"]:
            worst = {"x": x, "value": level, "at_least": at_least}
    return None if worst is None else {**worst, "levels": len(levels)}


def speedup_text(value: dict | None) -> str:
    if value is None:
        return "-"
    return f"{'>= ' if value['at_least'] else ''}{value['x']:.2f}x"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict) -> str:
    """Markdown: one row per mode, then a line per baseline saying how it was set up."""
    metric, budget = report.get("metric", "metric"), report.get("budget_s")
    sources = {run.get("bytes_source") for run in report["modes"].values() if "error" not in run}
    sent = "on the wire" if sources == {"wire"} else "sent"
    lines = [f"| mode | steps | train s | s/step | samples/s | MB/step/host {sent} | final {metric} "
             f"| s to {_fmt(report.get('target'), '.4g')} | {metric} at {_fmt(budget, '.1f')} s "
             f"| vs DDP | vs one-host | vs DDP by step | extra |", "|---" * 13 + "|"]
    for mode, run in report["modes"].items():
        if "error" in run:
            lines.append(f"| {mode} | failed: {run['error']} |" + " |" * 11)
            continue
        last = run["evals"][-1]
        extra = f"accuracy {last['val_accuracy']:.3f}" if "val_accuracy" in last else ""
        speedups = run.get("speedup_over", {})
        mb = run.get("bytes_per_step_per_host")
        lines.append(f"| {mode} | {max(run['steps_by_rank'])} | {run['train_time_s']:.1f} "
                     f"| {_fmt(run.get('s_per_step'), '.3f')} | {run['samples_per_s']:.1f} "
                     f"| {_fmt(None if mb is None else mb / 1e6, '.3f')} "
                     f"| {run['final_value']:.3f} | {_fmt(run['time_to_target_s'], '.1f')} "
                     f"| {_fmt(run['value_at_budget'], '.3f')} | {speedup_text(speedups.get(REFERENCE_MODE))} "
                     f"| {speedup_text(speedups.get('one-host'))} | {_fmt(run.get('divergence_from_ddp'), '.1e')} "
                     f"| {extra} |")
    notes = [f"- {note}" for note in report["config"].get("baseline_notes", [])]
    if report.get("target_met_untrained"):
        notes.append(f"- {untrained_target_note(report)}")
    if without_target(report):
        notes.append(f"- {NO_TARGET_NOTE}")
    return "\n".join(lines + ([""] + notes if notes else []))


NO_TARGET_NOTE = (f"no target, so no time to it and no speed-up: {REFERENCE_MODE} (whose last value on the "
                  f"evaluation grid is the default) did not run or failed; give --target")


def without_target(report: dict) -> bool:
    """Whether :func:`add_derived` found no target for ``report`` (see :data:`NO_TARGET_NOTE`)."""
    return "target" in report and report["target"] is None


def untrained_target_note(report: dict) -> str:
    """Why a run shows no speed-up to a target that its initial model meets already."""
    start = next(run["evals"][0][report["metric"]] for run in report["modes"].values() if "error" not in run)
    return (f"the target {report['target']:.4g} is met by the initial model ({report['metric']} {start:.4g} at "
            f"step 0): no mode trains to reach it, so no speed-up is given; give a --target below {start:.4g}")


def plot(report: dict, path: Path) -> None:
    """Two panels, one curve per mode: the metric against training seconds, and against steps."""
    require("matplotlib", "bench", "the accuracy benchmark's plot").use("Agg")
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
