"""``python -m poseidon_torch.simulate``: predict scaling from one traced run (or a profile).

Usage::

    python -m poseidon_torch.simulate TRACE --hosts 2,4,8 --bandwidth 10gbit [--latency-us 50] [--json]
        [--schemes ddp,ps,wfbp,poseidon,wfbp+delay,poseidon+delay] [--slowdown S] [--compute-scale F]
        [--gemm-gflops G] [--memory-gbps B] [--plot speedup.png] [--profile-out profile.json]

TRACE is a ``trace_merged.json`` or a rank's trace (the tracer's, with the model layout), a profile
JSON (``--profile-out`` writes one to edit), or ``vgg19-22k``: the Poseidon paper's model, printed beside
the paper's speed-ups at 40 GbE. Errors print ``poseidon-simulate: error: ...`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace

from ..coordinator import format_bytes
from ..extras import MissingExtra
from ..link import LinkModel, parse_rate
from ..trace.files import TraceFormatError
from . import paper
from .predict import Row, predict
from .profile import Profile, load
from .schemes import COMPRESSIONS, SCHEMES

PROG = "poseidon-simulate"
DEFAULT_HOSTS = "1,2,4,8,16,32,64"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(_run(args))
    except (OSError, ValueError, TraceFormatError, MissingExtra) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> str:
    """The predictions as text (a table, or JSON); the plot and the profile file written first."""
    traced = paper.vgg19_22k() if args.trace == paper.NAME else load(args.trace)
    profile = _adjusted(traced, args)
    link = LinkModel.from_gbps(parse_rate(args.bandwidth) / 1e9, args.latency_us)
    if not (math.isfinite(args.slowdown) and args.slowdown >= 1):
        raise ValueError(f"--slowdown is a finite factor >= 1 (1: communication does not slow compute), got "
                         f"{args.slowdown}")
    rows = predict(profile, args.schemes.split(","), _hosts(args.hosts), link, args.slowdown)
    figures = paper.PAPER_40GBE if args.trace == paper.NAME and link.bandwidth_gbps == paper.PAPER_BANDWIDTH_GBPS \
        else {}
    text = json.dumps([_with_paper(row.to_dict(), figures) for row in rows], indent=1) if args.json \
        else format_rows(rows, profile, link, figures)
    if args.plot:
        _plot(rows, args.plot, f"{profile.source}, {link}", figures)
    if args.profile_out:
        with open(args.profile_out, "w", encoding="utf-8") as stream:
            json.dump(traced.to_dict(), stream, indent=1)
    return text


def _plot(rows: list[Row], path: str, title: str, figures: dict) -> None:
    if os.path.isdir(path):
        raise ValueError(f"--plot {path}: a directory; give the PNG file to write")
    from .plot import plot_speedup

    plot_speedup(rows, path, title, figures)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Predict iteration time and speed-up on N machines "
                                     "from one traced run, for torch DDP, a plain PS, WFBP and Poseidon.")
    parser.add_argument("trace", metavar="TRACE", help=f"trace JSON, profile JSON, or {paper.NAME!r}")
    parser.add_argument("--hosts", default=DEFAULT_HOSTS, help=f"machines, comma-separated [{DEFAULT_HOSTS}]")
    parser.add_argument("--bandwidth", required=True, help="per machine, as tc writes it: 10gbit, 500mbit")
    parser.add_argument("--latency-us", type=float, default=50.0, help="per message [50]")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated [{','.join(SCHEMES)}]")
    parser.add_argument("--slowdown", type=float, default=1.0,
                        help="compute runs this many times slower while the link is busy [1]")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="every compute time times this (e.g. a faster or busier machine) [1]")
    parser.add_argument("--gemm-gflops", type=float, help="SFB's rebuild GEMM rate [the trace's probe]")
    parser.add_argument("--memory-gbps", type=float,
                        help="memory bandwidth in GB/s, the rate of a lossy path's compression (the poseidon+powersgd, "
                             "+int8, +bf16, +fp16 schemes) [the trace's probe, taken by a run with compression=]")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write the speed-up curves")
    parser.add_argument("--profile-out", metavar="JSON",
                        help="write the profile taken from TRACE (before --compute-scale and --gemm-gflops)")
    return parser


def _adjusted(profile: Profile, args: argparse.Namespace) -> Profile:
    """``profile`` with ``--gemm-gflops``, ``--memory-gbps`` and ``--compute-scale`` applied."""
    if args.gemm_gflops is not None:
        profile = replace(profile, gemm_flops=args.gemm_gflops * 1e9)
    if args.memory_gbps is not None:
        profile = replace(profile, memory_bps=args.memory_gbps * 1e9)
    return profile.scaled(args.compute_scale) if args.compute_scale != 1.0 else profile


def _hosts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--hosts takes comma-separated integers, got {text!r}") from None


def _with_paper(row: dict, figures: dict) -> dict:
    reported = figures.get(row["scheme"], {}).get(row["hosts"])
    return row if reported is None else {**row, "paper_speedup": reported}


def format_rows(rows: list[Row], profile: Profile, link: LinkModel, figures: dict | None = None) -> str:
    """The rows as an aligned table, with the paper's speed-up and the gap where ``figures`` has them."""
    figures = figures or {}
    header = ["scheme", "hosts", "iteration", "speed-up", "throughput", "exposed comm", "sent/machine", "layers off PS"]
    if figures:
        header += ["paper", "gap"]
    table = [header]
    for row in rows:
        cells = [row.scheme, str(row.hosts), f"{row.iteration_s * 1e3:.1f} ms", f"{row.speedup:.2f}",
                 f"{row.throughput:.1f} {row.throughput_unit}", f"{row.exposed_comm_s * 1e3:.1f} ms",
                 format_bytes(row.bytes_per_machine), str(len(row.sfb_layers))]
        reported = figures.get(row.scheme, {}).get(row.hosts)
        if figures:
            cells += ["-", "-"] if reported is None else [f"{reported:.2f}", f"{row.speedup / reported - 1:+.0%}"]
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    gemm = "-" if profile.gemm_flops is None else f"{profile.gemm_flops / 1e9:.4g} GFLOP/s"
    if not any(layer.fc for layer in profile.layers) or profile.gemm_flops is None:
        lines.append("no FC layer with a known shape and rows (K) in the profile, or no GEMM rate: poseidon syncs as "
                     "wfbp (trace the default hybrid mode on 2 ranks to record them)")
    compressions = {row.scheme.split("+")[1] for row in rows if "+" in row.scheme} & set(COMPRESSIONS)
    if profile.memory_bps is None and compressions:
        lines.append("no memory bandwidth in the profile (a run with compression= records one; or --memory-gbps): "
                     "the poseidon+<compression> schemes cannot cost a lossy path and sync as poseidon")
    if "powersgd" in compressions and not any(layer.shapes for layer in profile.layers):
        lines.append("no tensor shapes in the profile (a trace of this version records them; or 'shapes' per layer): "
                     "poseidon+powersgd compresses nothing")
    traced = "" if profile.traced_gbps is None else f"; the traced syncs moved {profile.traced_gbps:.3g} Gbit/s"
    lines.append(f"profile: {profile.source}; {len(profile.layers)} layers, {format_bytes(profile.nbytes)}, "
                 f"one machine {profile.compute_s * 1e3:.1f} ms per iteration; GEMM {gemm}{traced}; link: {link}")
    return "\n".join(lines)
