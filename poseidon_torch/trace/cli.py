"""``poseidon-trace`` (or ``python -m poseidon_torch.trace``): summarize and plot Poseidon Chrome traces.

Usage::

    poseidon-trace summary TRACE [--json]
    poseidon-trace plot TRACE -o timeline.png [--iteration N]
    poseidon-trace merge -o trace_merged.json trace_rank0.json trace_rank1.json ...

``summary`` needs no matplotlib; ``plot`` imports it (the ``[plot]`` extra: without it, an error naming it). Errors (missing file, malformed trace, unrecorded
iteration) print ``poseidon-trace: error: ...`` on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..extras import MissingExtra
from .files import TraceFormatError, load_spans, merge_traces
from .summary import format_summary, summarize

PROG = "poseidon-trace"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``poseidon-trace`` / ``python -m poseidon_torch.trace``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        args.command(args)
    except (TraceFormatError, MissingExtra) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    except ValueError as exc:
        return _fail(f"{getattr(args, 'trace', ' '.join(getattr(args, 'traces', [])))}: {exc}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Summarize or plot a Poseidon Chrome trace.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    summary = commands.add_parser("summary", help="per-layer communication table and overlap totals")
    summary.add_argument("trace", metavar="TRACE", help="per-rank or merged trace JSON")
    summary.add_argument("--json", action="store_true", help="print the numbers as JSON")
    summary.set_defaults(command=_run_summary)
    plot = commands.add_parser("plot", help="timeline PNG of one iteration per rank")
    plot.add_argument("trace", metavar="TRACE", help="per-rank or merged trace JSON")
    plot.add_argument("-o", "--output", required=True, help="PNG file to write")
    plot.add_argument("--iteration", type=int, help="iteration to show (default: last recorded per rank)")
    plot.set_defaults(command=_run_plot)
    merge = commands.add_parser("merge", help="merge per-rank traces (a run that ended before its window closed)")
    merge.add_argument("traces", metavar="TRACE", nargs="+", help="per-rank trace JSON files")
    merge.add_argument("-o", "--output", required=True, help="merged trace JSON to write")
    merge.set_defaults(command=_run_merge)
    return parser


def _run_summary(args: argparse.Namespace) -> None:
    summary = summarize(load_spans(args.trace))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary, args.trace))


def _run_plot(args: argparse.Namespace) -> None:
    from .plot import plot_timeline

    plot_timeline(load_spans(args.trace), args.output, args.iteration)


def _run_merge(args: argparse.Namespace) -> None:
    merge_traces(args.traces, args.output)
    print(f"{PROG}: wrote {args.output} ({len(args.traces)} rank(s))")


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2
