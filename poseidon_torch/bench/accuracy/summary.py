"""Summary of repeated time-to-accuracy runs: per cell, every mode's median and spread, and the winner.

    python -m poseidon_torch.bench.accuracy.summary OUT/*/results.json [--json summary.json]

A cell is one configuration (task and its size, hosts, link, latency, CPU per host, straggler, budget,
and the baselines' options such as ``--localsgd-period`` that the runs' modes read); its runs are the
repeats (a run whose modes read none of those options joins the first cell it agrees with). For every
mode of a cell: steps, seconds per step, MB sent per step per host, the metric at the budget, seconds to
the target, the speed-ups over torch DDP and over ``one-host`` at the target, and the speed-up over
``one-host`` at the level where it is smallest (every value below the first evaluation; above 1: the
mode was sooner than one host at every such value), each as the median over the repeats with the range
(``median (min-max)``). The derived fields are recomputed from each run's evaluations as the report
defines them, so runs written before a field existed get it too. The target is each run's own (by
default torch DDP's last value on its evaluation grid). The winner of a cell is the mode with the lowest
median time to the target, a run that never reached it, failed or did not run the mode counting as
infinitely slow (so a mode that reached it in fewer than half the repeats cannot win; a mode's row says
in how many runs it failed or was absent); ties go to the lower median value at the budget. Where the
initial model meets the target in some run (step 0), the cell has no winner.

Invariants: every number is read from the runs' ``results.json`` (the report's derived fields); nothing is
interpolated; a failed run of a mode is counted and shown, and leaves that mode's numbers to its other
repeats.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from poseidon_torch.bench.accuracy.report import NO_TARGET_NOTE, REFERENCE_MODE, add_derived, without_target
from poseidon_torch.bench.baselines import LOCALSGD, POWERSGD, Baselines

CELL_KEYS = ("task", "tiny", "hosts", "link", "latency", "cpus_per_host", "straggler", "time_budget_s", "steps")


def baseline_options(config: dict) -> dict:
    """The baseline options (``--powersgd-rank``, ``--powersgd-start-iter``, ``--localsgd-period``,
    ``--localsgd-warmup``) that a run's modes read: as recorded, or, in a results file written before they
    were, as its description of torch's baselines states them."""
    if "baseline_options" in config:
        return config["baseline_options"]
    options, described = {}, config.get("baselines", {})
    if POWERSGD in described:
        options.update(powersgd_rank=described[POWERSGD]["matrix_approximation_rank"],
                       powersgd_start_iter=described[POWERSGD]["start_powerSGD_iter"])
    if LOCALSGD in described:
        options.update(localsgd_period=described[LOCALSGD]["period"],
                       localsgd_warmup=described[LOCALSGD]["warmup_steps"])
    return options


def cell_of(config: dict) -> tuple:
    """The cell's key, but for the baseline options (:func:`group_cells`)."""
    return tuple(bool(config.get(key)) if key == "tiny" else config.get(key) for key in CELL_KEYS)


def group_cells(reports: list[dict]) -> list[tuple[dict, list[dict]]]:
    """The reports grouped into cells, each with its configuration: runs are repeats where their
    :data:`CELL_KEYS` agree and so do the baseline options that both read (a run at another
    ``--localsgd-period`` is another cell; a run without the modes that read an option still joins)."""
    cells: list[tuple[dict, list[dict]]] = []
    for report in reports:
        key, options = cell_of(report["config"]), baseline_options(report["config"])
        for config, members in cells:
            shared = config["baseline_options"].keys() & options.keys()
            if cell_of(config) == key and all(config["baseline_options"][name] == options[name] for name in shared):
                config["baseline_options"].update(options)
                members.append(report)
                break
        else:
            cells.append(({**dict(zip(CELL_KEYS, key)), "baseline_options": dict(options)}, [report]))
    return cells


def cell_title(config: dict, runs: int) -> str:
    tiny = " (tiny)" if config["tiny"] else ""
    latency = f", {config['latency']} latency" if config["latency"] else ""
    cpus = f", {config['cpus_per_host']} CPU per host" if config["cpus_per_host"] else ""
    straggler = f", straggler {config['straggler']}" if config["straggler"] != "none" else ""
    budget = f"{config['time_budget_s']:g} s" if config["time_budget_s"] else f"{config['steps']} steps"
    defaults = asdict(Baselines())
    options = "".join(f", --{name.replace('_', '-')} {value}"
                      for name, value in sorted(config["baseline_options"].items()) if value != defaults[name])
    return (f"{config['task']}{tiny}, {config['hosts']} hosts, {config['link']}{latency}{cpus}{straggler}, "
            f"{budget} per mode{options}, {runs} run{'s' * (runs != 1)}")


def _speedup(run: dict, reference: str) -> float | None:
    value = run.get("speedup_over", {}).get(reference)
    return None if value is None else value["x"]


def _bound(run: dict, reference: str) -> bool:
    """Whether the run's speed-up over ``reference`` is a lower bound (the reference never reached the target)."""
    value = run.get("speedup_over", {}).get(reference)
    return bool(value and value["at_least"])


SPEEDUPS = {"speedup_over_ddp": REFERENCE_MODE, "speedup_over_one_host": "one-host"}


#: per mode and run, the numbers the summary takes the median of (None: not reached or not measured)
COLUMNS = {
    "steps": lambda run: max(run["steps_by_rank"]),
    "s_per_step": lambda run: run.get("s_per_step"),
    "mb_per_step": lambda run: None if run.get("bytes_per_step_per_host") is None
    else run["bytes_per_step_per_host"] / 1e6,
    "value_at_budget": lambda run: run.get("value_at_budget"),
    "time_to_target_s": lambda run: run.get("time_to_target_s"),
    **{name: (lambda run, reference=reference: _speedup(run, reference)) for name, reference in SPEEDUPS.items()},
    "slowest_level_vs_one_host": lambda run: (run.get("slowest_level_speedup_over", {}).get("one-host") or {}).get("x"),
}


def spread(values: list[float | None]) -> dict:
    """Median, min and max of the values that exist, and how many runs had none."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "missing": len(values)}
    return {"median": statistics.median(present), "min": min(present), "max": max(present),
            "missing": len(values) - len(present)}


def summarise_cell(reports: list[dict]) -> dict:
    """Every mode's spreads over the repeats, the failures, and the winner with its margins."""
    modes: dict[str, list[dict]] = defaultdict(list)
    failures: dict[str, int] = defaultdict(int)
    for report in reports:
        for mode, run in report["modes"].items():
            if "error" in run:
                failures[mode] += 1
            else:
                modes[mode].append(run)
    rows = {mode: {name: spread([column(run) for run in runs]) for name, column in COLUMNS.items()}
            for mode, runs in modes.items()}
    for mode, row in rows.items():  # a run that never reached the target is infinitely slow for the ranking,
        # as is one where the mode failed or did not run at all
        times = [COLUMNS["time_to_target_s"](run) for run in modes[mode]]
        times += [None] * (len(reports) - len(times))
        row["median_time_ranked"] = statistics.median(math.inf if t is None else t for t in times)
        row["failed"], row["absent"] = failures[mode], len(reports) - len(modes[mode]) - failures[mode]
        row["lower_bounds"] = {name: sum(_bound(run, reference) for run in modes[mode])
                               for name, reference in SPEEDUPS.items()}
    ranking = sorted(rows, key=lambda m: (rows[m]["median_time_ranked"],
                                          rows[m]["value_at_budget"]["median"] or math.inf))
    return {"runs": len(reports), "modes": rows, "ranking": ranking, "failed_only": sorted(set(failures) - set(rows)),
            "target_met_untrained": sum(bool(report.get("target_met_untrained")) for report in reports),
            "without_target": sum(without_target(report) for report in reports)}


def winner_line(cell: dict) -> str:
    ranking, rows = cell["ranking"], cell["modes"]
    if cell.get("target_met_untrained"):
        return (f"No winner: the initial model meets the target in {cell['target_met_untrained']} of "
                f"{cell['runs']} runs (at step 0, before any training); give a lower --target.")
    if cell["without_target"] and cell["without_target"] == cell["runs"]:
        return f"No winner: {NO_TARGET_NOTE}."
    if not ranking or math.isinf(rows[ranking[0]]["median_time_ranked"]):
        return "No mode reached the target in most of its runs."
    best = rows[ranking[0]]
    parts = [f"**{ranking[0]}** reaches the target first: {best['median_time_ranked']:.1f} s (the median of its "
             f"runs, one that failed, missed the target or did not run counting as never)"]
    for name, reference in SPEEDUPS.items():
        if best[name]["median"] is not None and reference != ranking[0]:
            at_least = "at least " if best["lower_bounds"][name] else ""
            parts.append(f"{at_least}{best[name]['median']:.2f}x sooner than {reference}")
    if len(ranking) > 1:
        second = ranking[1]
        runner_up = rows[second]["median_time_ranked"]
        parts.append(f"{runner_up / best['median_time_ranked']:.2f}x sooner than the runner-up {second}"
                     if not math.isinf(runner_up) else f"the runner-up {second} did not reach it")
    return ", ".join(parts) + "."


def _cell_text(spread_: dict, spec: str, bounds: int = 0) -> str:
    """``median (min-max)``; ``>= `` first where ``bounds`` runs gave only a lower bound."""
    if spread_["median"] is None:
        return "-"
    text = (">= " if bounds else "") + format(spread_["median"], spec)
    if spread_["min"] != spread_["max"]:
        text += f" ({format(spread_['min'], spec)}-{format(spread_['max'], spec)})"
    return text + (f", {spread_['missing']} not" if spread_["missing"] else "")


def markdown(summary: list[dict]) -> str:
    lines = []
    for entry in summary:
        cell = entry["summary"]
        lines += [f"### {entry['title']}", "",
                  "| mode | steps | s/step | MB/step/host | value at budget | s to target | vs DDP | vs one-host "
                  "| vs one-host, slowest level |", "|---" * 9 + "|"]
        for mode in cell["ranking"]:
            row = cell["modes"][mode]
            failed = "".join(f" ({row[key]} {key})" for key in ("failed", "absent") if row[key])
            lines.append(f"| {mode}{failed} | {_cell_text(row['steps'], '.0f')} | {_cell_text(row['s_per_step'], '.3f')} "
                         f"| {_cell_text(row['mb_per_step'], '.3f')} | {_cell_text(row['value_at_budget'], '.3f')} "
                         f"| {_cell_text(row['time_to_target_s'], '.1f')} "
                         + "".join(f"| {_cell_text(row[name], '.2f', row['lower_bounds'][name])} " for name in SPEEDUPS)
                         + f"| {_cell_text(row['slowest_level_vs_one_host'], '.2f')} |")
        lines += [f"| {mode} (every run failed) |" + " |" * 8 for mode in cell["failed_only"]]
        lines += ["", winner_line(cell), ""]
    return "\n".join(lines)


def load_report(path: Path) -> dict:
    """A run's ``results.json`` with its derived fields recomputed; ValueError naming the file if it is not one."""
    try:
        report = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(report, dict) or not {"config", "modes"} <= report.keys():
        other = " (a throughput benchmark's: python -m poseidon_torch.bench.report reads those)" \
            if isinstance(report, dict) and "workloads" in report else ""
        raise ValueError(f"{path} is not the results.json of a time-to-accuracy run{other}")
    add_derived(report, report.get("target"), report.get("budget_s"))
    return report


def summarise(paths: list[Path]) -> list[dict]:
    reports = [load_report(path) for path in paths]
    return [{"cell": config, "title": cell_title(config, len(members)), "summary": summarise_cell(members)}
            for config, members in group_cells(reports)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poseidon_torch.bench.accuracy.summary",
                                     description="Median and spread per cell over repeated time-to-accuracy runs.")
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of the runs")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        parser.error(f"no such results file: {', '.join(missing)}")
    named = [p.resolve() for p in args.results]
    twice = sorted({str(p) for p in named if named.count(p) > 1})
    if twice:
        parser.error(f"results file named more than once: {', '.join(twice)}; each run counts once")
    try:
        summary = summarise(args.results)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
