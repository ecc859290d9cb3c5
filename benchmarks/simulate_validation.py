"""The simulator against the emulator: predicted iteration times beside the measured ones, every cell.

    python benchmarks/simulate_validation.py OUT/run1 [OUT/run2 ...] [--reference netns_h2_10gbit]
        [--slowdown 1,2] [--json]

Each RUN directory is one run of ``benchmarks/matrix.sh``: one directory per configuration and workload,
``{mode}_h{hosts}_{bandwidth}_{workload}`` with ``results.json`` and the PoseidonDDP traces. A cell's
measured time is the median over the runs. For each workload the profile comes from the first run's
reference configuration (the ``poseidon-ps`` trace for torch DDP and WFBP, the ``poseidon-hybrid`` one
for Poseidon: only it knows the FC layers' K), and every cell is predicted at its own hosts and
bandwidth with the traced run's probed latency, two ways:

- *nominal*: the link at the emulated bandwidth;
- *calibrated*: this machine cannot move bytes at 10 Gbit/s (two cores copy and run TCP for every
  emulated host): a per-byte host cost in series with the link, fitted once per workload from the
  reference trace (what its syncs achieved on the wire against the nominal bandwidth). It is CPU
  time, so it grows with the cell's compute contention as compute does (times the cell's compute-only
  iteration over the reference configuration's).

Both scale every compute time by the cell's own measured compute-only iteration over the profile's
(``scale``: the emulated hosts share this machine's two cores, so 4 hosts compute about twice as
slowly as 2). ``--slowdown`` adds the simulator's compute slowdown while the link is busy.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from poseidon_torch.bench.netns import parse_rate
from poseidon_torch.link import LinkModel
from poseidon_torch.simulate import SCHEMES, Profile, from_trace

#: measured mode -> (simulated scheme, the trace its profile comes from)
COMPARED = {"torch-ddp": ("ddp", "poseidon-ps"), "poseidon-ps": ("wfbp", "poseidon-ps"),
            "poseidon-hybrid": ("poseidon", "poseidon-hybrid")}
CELL = re.compile(r"(?P<place>\w+)_h(?P<hosts>\d+)_(?P<bandwidth>[\d.]+[kmgt]?bit)_(?P<workload>\w+)")


def cells(run_dirs: list[Path]) -> dict[str, dict]:
    """Per cell name: hosts, bandwidth, workload, and each mode's median iteration over the runs."""
    found: dict[str, dict] = {}
    for run_dir in run_dirs:
        for directory in sorted(run_dir.iterdir()):
            match = CELL.fullmatch(directory.name)
            if not (match and (directory / "results.json").exists()):
                continue
            cell = found.setdefault(directory.name, {**match.groupdict(), "hosts": int(match["hosts"]), "times": {}})
            report = json.loads((directory / "results.json").read_text())
            for mode, result in report["workloads"][cell["workload"]]["modes"].items():
                if "error" not in result:
                    cell["times"].setdefault(mode, []).append(result["iter_s"])
    for cell in found.values():
        cell["runs"] = min(len(times) for times in cell["times"].values())
        cell["times"] = {mode: statistics.median(times) for mode, times in cell["times"].items()}
    return found


def host_seconds_per_byte(profile: Profile, nominal_bps: float) -> float:
    """The per-byte cost in series with the link that makes it achieve what the trace saw."""
    if profile.traced_gbps is None:
        return 0.0
    return max(0.0, 8.0 / (profile.traced_gbps * 1e9) - 8.0 / nominal_bps)


def rows(run_dirs: list[Path], reference: str, slowdowns: list[float]) -> list[dict]:
    out = []
    reference_bps = parse_rate(reference.rsplit("_", 1)[-1])  # e.g. netns_h2_10gbit
    all_cells = cells(run_dirs)
    for cell in sorted(all_cells.values(), key=lambda c: (c["hosts"], -parse_rate(c["bandwidth"]), c["workload"])):
        times, traces = cell["times"], run_dirs[0] / f"{reference}_{cell['workload']}" / "traces"
        profiles = {trace: from_trace(traces / f"{cell['workload']}-{trace}" / "trace_merged.json")
                    for trace in ("poseidon-ps", "poseidon-hybrid")}
        contention = times["compute-only"] / all_cells[f"{reference}_{cell['workload']}"]["times"]["compute-only"]
        host = host_seconds_per_byte(profiles["poseidon-ps"], reference_bps) * contention
        for mode, (scheme, trace) in COMPARED.items():
            if mode not in times:
                continue
            profile = profiles[trace]
            scale = times["compute-only"] / profile.compute_s
            nominal = LinkModel(profile.link["alpha_s"], 8.0 / parse_rate(cell["bandwidth"]))
            links = {"nominal": nominal, "calibrated": LinkModel(nominal.alpha_s, nominal.beta_s_per_byte + host)}
            predicted = {f"{name} s={s:g}": SCHEMES[scheme].run(profile.scaled(scale), cell["hosts"], link, s).iteration_s
                         for name, link in links.items() for s in slowdowns}
            out.append({"workload": cell["workload"], "hosts": cell["hosts"], "bandwidth": cell["bandwidth"],
                        "mode": mode, "scheme": scheme, "runs": cell["runs"], "compute_only_s": times["compute-only"],
                        "scale": scale, "measured_s": times[mode], "predicted_s": predicted,
                        "error": {key: p / times[mode] - 1 for key, p in predicted.items()}})
    return out


def markdown(table: list[dict]) -> str:
    keys = list(table[0]["predicted_s"])
    head = ["workload", "hosts", "bandwidth", "measured mode (scheme)", "compute-only ms", "scale", "measured ms"]
    head += [f"{key}: ms, error" for key in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table:
        cells = [row["workload"], str(row["hosts"]), row["bandwidth"], f"{row['mode']} ({row['scheme']})",
                 f"{row['compute_only_s'] * 1e3:.0f}", f"{row['scale']:.2f}", f"{row['measured_s'] * 1e3:.0f}"]
        cells += [f"{row['predicted_s'][key] * 1e3:.0f}, {row['error'][key]:+.0%}" for key in keys]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for key in keys:
        errors = [abs(row["error"][key]) for row in table]
        lines.append(f"- {key}: {sum(e <= 0.15 for e in errors)} of {len(errors)} cells within 15%; median |error| "
                     f"{statistics.median(errors):.1%}, largest {max(errors):.1%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--reference", default="netns_h2_10gbit", help="configuration whose traces make the profile")
    parser.add_argument("--slowdown", default="1", help="comma-separated compute slowdowns while communicating")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = rows(args.run_dirs, args.reference, [float(s) for s in args.slowdown.split(",")])
    print(json.dumps(table, indent=1) if args.json else markdown(table))


if __name__ == "__main__":
    main()
