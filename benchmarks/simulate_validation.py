"""The simulator against the emulator: predicted iteration times beside the measured ones, every cell.

    python benchmarks/simulate_validation.py RUN_DIR [--reference netns_h2_10gbit] [--slowdown 1,1.5]

RUN_DIR is one run of ``benchmarks/matrix.sh`` (``OUT/run1``): one directory per configuration and
workload, ``{mode}_h{hosts}_{bandwidth}_{workload}`` with ``results.json`` and the PoseidonDDP traces.
For each workload the profile comes from the reference configuration's traces (the ``poseidon-ps`` trace
for torch DDP and WFBP, the ``poseidon-hybrid`` one for Poseidon: only it knows the FC layers' K); each
cell is predicted at its own hosts and bandwidth, with the traced run's probed latency.

Calibration, said in the table: the emulated hosts share this machine's cores, so compute at 4 hosts is
slower than in the 2-host trace; every compute time is scaled by the cell's own measured compute-only
iteration over the profile's (``scale``). ``--slowdown`` adds the simulator's compute slowdown while the
link is busy (gloo's CPU work on the same cores); each value gets its own error columns.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from poseidon_torch.bench.netns import parse_rate
from poseidon_torch.link import LinkModel
from poseidon_torch.simulate import SCHEMES, from_trace

#: measured mode -> (simulated scheme, the trace its profile comes from)
COMPARED = {"torch-ddp": ("ddp", "poseidon-ps"), "poseidon-ps": ("wfbp", "poseidon-ps"),
            "poseidon-hybrid": ("poseidon", "poseidon-hybrid")}
CELL = re.compile(r"(?P<place>\w+)_h(?P<hosts>\d+)_(?P<bandwidth>[\d.]+[kmgt]?bit)_(?P<workload>\w+)")


def cells(run_dir: Path) -> list[dict]:
    found = []
    for directory in sorted(run_dir.iterdir()):
        match = CELL.fullmatch(directory.name)
        if match and (directory / "results.json").exists():
            found.append({**match.groupdict(), "hosts": int(match["hosts"]), "dir": directory})
    return found


def measured(cell: dict) -> dict[str, float]:
    report = json.loads((cell["dir"] / "results.json").read_text())
    modes = report["workloads"][cell["workload"]]["modes"]
    return {mode: result["median_iter_s"] for mode, result in modes.items() if "error" not in result}


def rows(run_dir: Path, reference: str, slowdowns: list[float]) -> list[dict]:
    out = []
    for cell in cells(run_dir):
        times = measured(cell)
        ref = run_dir / f"{reference}_{cell['workload']}" / "traces"
        profiles = {trace: from_trace(ref / f"{cell['workload']}-{trace}" / "trace_merged.json")
                    for trace in ("poseidon-ps", "poseidon-hybrid")}
        for mode, (scheme, trace) in COMPARED.items():
            if mode not in times:
                continue
            profile = profiles[trace]
            scale = times["compute-only"] / profile.compute_s
            link = LinkModel(profile.link["alpha_s"], 8.0 / parse_rate(cell["bandwidth"]))
            predicted = [SCHEMES[scheme].run(profile.scaled(scale), cell["hosts"], link, s).iteration_s
                         for s in slowdowns]
            out.append({"workload": cell["workload"], "hosts": cell["hosts"], "bandwidth": cell["bandwidth"],
                        "mode": mode, "scheme": scheme, "compute_only_s": times["compute-only"], "scale": scale,
                        "measured_s": times[mode], "predicted_s": predicted,
                        "error": [p / times[mode] - 1 for p in predicted]})
    return out


def markdown(table: list[dict], slowdowns: list[float]) -> str:
    head = ["workload", "hosts", "bandwidth", "measured mode", "compute-only ms", "scale", "measured ms"]
    head += [f"predicted ms (s={s:g})" for s in slowdowns] + [f"error (s={s:g})" for s in slowdowns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table:
        cells = [row["workload"], str(row["hosts"]), row["bandwidth"], f"{row['mode']} ({row['scheme']})",
                 f"{row['compute_only_s'] * 1e3:.1f}", f"{row['scale']:.2f}", f"{row['measured_s'] * 1e3:.1f}"]
        cells += [f"{p * 1e3:.1f}" for p in row["predicted_s"]] + [f"{e:+.0%}" for e in row["error"]]
        lines.append("| " + " | ".join(cells) + " |")
    for i, s in enumerate(slowdowns):
        errors = [abs(row["error"][i]) for row in table]
        within = sum(e <= 0.15 for e in errors)
        lines.append(f"\nslowdown {s:g}: {within} of {len(errors)} cells within 15%; median |error| "
                     f"{statistics.median(errors):.1%}, largest {max(errors):.1%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--reference", default="netns_h2_10gbit", help="configuration whose traces make the profile")
    parser.add_argument("--slowdown", default="1", help="comma-separated compute slowdowns while communicating")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    slowdowns = [float(s) for s in args.slowdown.split(",")]
    table = rows(args.run_dir, args.reference, slowdowns)
    print(json.dumps(table, indent=1) if args.json else markdown(table, slowdowns))


if __name__ == "__main__":
    main()
