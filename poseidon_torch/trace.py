"""``poseidon-trace``: summarize and plot Poseidon Chrome traces (per-rank or merged files).

Usage::

    poseidon-trace summary TRACE [--json]
    poseidon-trace plot TRACE -o timeline.png [--iteration N]

Definitions used by ``summary`` (time sets are unions of span intervals, see :mod:`poseidon_torch.overlap`):
- every measure is taken per rank (ranks have separate clocks and threads) and combined over ranks
  by summing lengths, bytes or times before dividing;
- a *rank-iteration* is one (rank, iteration index) pair present in the trace; "per iteration"
  values are totals divided by the number of rank-iterations, i.e. means per iteration per rank;
- comm = ``network`` spans, compute = ``forward`` + ``backward`` spans; the overlap ratio is HTA's
  ``|∪comm ∩ ∪compute| / |∪comm|`` (1.0 without comm) and exposed communication is
  ``|∪comm| - |∪comm ∩ ∪compute|``;
- a layer is the name of ``sync``/``network`` spans: its bytes come from ``args["bytes"]`` of its
  ``sync`` spans, its comm time is the summed duration of its ``network`` spans, and its hidden share
  is the part of its ``network`` time covered by the same rank's ``backward`` spans;
- iteration time is the median duration of ``iteration`` spans (``null`` without them).

Errors (missing file, malformed trace, unrecorded iteration) print
``poseidon-trace: error: ...`` on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from poseidon_torch.overlap import Interval, intersection_length, total_length
from poseidon_torch.spans import COMM_KINDS, COMPUTE_KINDS, Span
from poseidon_torch.tracefile import PathLike, TraceFormatError, load_spans, ordered_lanes

PROG = "poseidon-trace"
NS_PER_MS = 1_000_000

#: Bar style per drawn span: (legend label, face colour or None for an outline, bar height in lane units).
STYLES = {
    "forward": ("forward", "#4c72b0", 0.8),
    "backward": ("backward", "#55a868", 0.8),
    "queue": ("queued", "#ccb974", 0.5),
    "d2h": ("device→host copy", "#64b5cd", 0.5),
    "rebuild": ("SFB rebuild (GEMM)", "#da8bc3", 0.5),
    "h2d": ("host→device copy", "#dd8452", 0.5),
    "network PS": ("network, PS", "#c44e52", 0.5),
    "network SFB": ("network, SFB", "#8172b2", 0.5),
    "network": ("network, other path", "#937860", 0.5),
    "sync": ("sync job", None, 0.8),
    "iteration": ("iteration", "#e3e3e3", 0.96),
}


def summarize(spans_by_rank: dict[int, list[Span]]) -> dict:
    """Summary numbers of a trace as a JSON-ready dict (see the module docstring for definitions)."""
    samples = sum(len(_iterations(spans)) for spans in spans_by_rank.values())
    comm_ns, hidden_ns = _hidden(spans_by_rank, COMM_KINDS, COMPUTE_KINDS)
    durations = [s.duration_ns for spans in spans_by_rank.values() for s in spans if s.kind == "iteration"]
    return {
        "ranks": len(spans_by_rank),
        "iterations": len(set().union(*map(_iterations, spans_by_rank.values()))),
        "rank_iterations": samples,
        "overlap_ratio": _ratio(hidden_ns, comm_ns),
        "comm_ms_per_iteration": _per(comm_ns, samples) / NS_PER_MS,
        "exposed_comm_ms_per_iteration": _per(comm_ns - hidden_ns, samples) / NS_PER_MS,
        "iteration_ms_median": statistics.median(durations) / NS_PER_MS if durations else None,
        "layers": [_layer_row(name, spans_by_rank, samples) for name in _layer_names(spans_by_rank)],
    }


def format_summary(summary: dict, title: str) -> str:
    """``summary`` as an aligned plain-text table followed by the totals."""
    header = ("layer", "path", "bytes/iter", "comm ms/iter", "hidden")
    rows = [
        (row["layer"], row["path"], _format_bytes(row["bytes_per_iteration"]),
         f"{row['comm_ms_per_iteration']:.3f}", f"{row['hidden_share']:.1%}")
        for row in summary["layers"]
    ]
    median = summary["iteration_ms_median"]
    totals = [
        ("overlap ratio (HTA, comm hidden by compute)", f"{summary['overlap_ratio']:.1%}"),
        ("communication per iteration", f"{summary['comm_ms_per_iteration']:.3f} ms"),
        ("exposed communication per iteration", f"{summary['exposed_comm_ms_per_iteration']:.3f} ms"),
        ("iteration time (median)", "-" if median is None else f"{median:.3f} ms"),
    ]
    label_width = max(len(label) for label, _ in totals)
    lines = [f"{title}: {summary['ranks']} ranks, {summary['iterations']} iterations", ""]
    lines += _table(header, rows, left_aligned=2) if rows else ["(no sync or network spans)"]
    lines += [""] + [f"{label + ':':<{label_width + 1}} {value}" for label, value in totals]
    return "\n".join(lines)


def plot_timeline(spans_by_rank: dict[int, list[Span]], out_path: PathLike, iteration: int | None = None) -> None:
    """Draw one iteration per rank as a PNG timeline.

    ``iteration=None`` shows each rank's last recorded iteration; otherwise ranks that did not record
    ``iteration`` are left out, and ``ValueError`` is raised when no rank recorded it.
    """
    shown = {rank: _select_iteration(spans, iteration) for rank, spans in spans_by_rank.items()}
    shown = {rank: spans for rank, spans in shown.items() if spans}
    if not shown:
        raise ValueError(_missing_iteration_message(spans_by_rank, iteration))
    origin = min(s.start_ns for spans in shown.values() for s in spans)
    end = max(s.end_ns for spans in shown.values() for s in spans)
    rows = [(rank, lane) for rank, spans in shown.items() for lane in ordered_lanes(s.lane for s in spans)]
    figure = Figure(figsize=(12, 1.5 + 0.4 * len(rows)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    used = set()
    for y, (rank, lane) in enumerate(rows):
        used |= _draw_lane(axes, y, [s for s in shown[rank] if s.lane == lane], origin)
    _decorate(axes, rows, used, (end - origin) / NS_PER_MS, _window_label(shown))
    figure.savefig(out_path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``poseidon-trace`` / ``python -m poseidon_torch.trace``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        args.command(args, load_spans(args.trace))
    except TraceFormatError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    except ValueError as exc:
        return _fail(f"{args.trace}: {exc}")
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
    return parser


def _run_summary(args: argparse.Namespace, spans_by_rank: dict[int, list[Span]]) -> None:
    summary = summarize(spans_by_rank)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary, args.trace))


def _run_plot(args: argparse.Namespace, spans_by_rank: dict[int, list[Span]]) -> None:
    plot_timeline(spans_by_rank, args.output, args.iteration)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _iterations(spans: list[Span]) -> set[int]:
    return {span.iteration for span in spans}


def _intervals(spans: Iterable[Span], kinds: Iterable[str], name: str | None = None) -> list[Interval]:
    kinds = set(kinds)
    return [(s.start_ns, s.end_ns) for s in spans if s.kind in kinds and (name is None or s.name == name)]


def _hidden(
    spans_by_rank: dict[int, list[Span]], comm_kinds: Iterable[str], cover_kinds: Iterable[str], name: str | None = None
) -> tuple[int, int]:
    """``(|∪comm|, |∪comm ∩ ∪cover|)`` summed over ranks; ``name`` restricts comm to one layer."""
    comm_ns = hidden_ns = 0
    for spans in spans_by_rank.values():
        comm = _intervals(spans, comm_kinds, name)
        comm_ns += total_length(comm)
        hidden_ns += intersection_length(comm, _intervals(spans, cover_kinds))
    return comm_ns, hidden_ns


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 1.0


def _per(total: float, samples: int) -> float:
    return total / samples if samples else 0.0


def _layer_names(spans_by_rank: dict[int, list[Span]]) -> list[str]:
    """Layers in the order their first sync/network span starts."""
    first: dict[str, int] = {}
    for spans in spans_by_rank.values():
        for span in spans:
            if span.kind in ("sync", *COMM_KINDS):
                first[span.name] = min(first.get(span.name, span.start_ns), span.start_ns)
    return sorted(first, key=lambda name: (first[name], name))


def _layer_row(name: str, spans_by_rank: dict[int, list[Span]], samples: int) -> dict:
    layer = [s for spans in spans_by_rank.values() for s in spans if s.name == name]
    paths = sorted({str(s.args["path"]) for s in layer if s.kind in ("sync", *COMM_KINDS) and "path" in s.args})
    network_ns, hidden_ns = _hidden(spans_by_rank, COMM_KINDS, ("backward",), name)
    return {
        "layer": name,
        "path": "/".join(paths) or "-",
        "bytes_per_iteration": _per(sum(s.args.get("bytes", 0) for s in layer if s.kind == "sync"), samples),
        "comm_ms_per_iteration": _per(sum(s.duration_ns for s in layer if s.kind in COMM_KINDS), samples) / NS_PER_MS,
        "hidden_share": _ratio(hidden_ns, network_ns),
    }


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], left_aligned: int) -> list[str]:
    """Rows aligned in columns: the first ``left_aligned`` columns flush left, the rest flush right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: tuple[str, ...]) -> str:
        padded = [c.ljust(w) if i < left_aligned else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded).rstrip()

    return [line(header)] + [line(row) for row in rows]


def _select_iteration(spans: list[Span], iteration: int | None) -> list[Span]:
    if not spans:
        return []
    chosen = max(_iterations(spans)) if iteration is None else iteration
    return [span for span in spans if span.iteration == chosen]


def _missing_iteration_message(spans_by_rank: dict[int, list[Span]], iteration: int | None) -> str:
    recorded = sorted(set().union(*map(_iterations, spans_by_rank.values())))
    if not recorded:
        return "the trace has no spans to plot"
    return f"iteration {iteration} is not recorded (recorded iterations: {recorded[0]}..{recorded[-1]})"


def _style_key(span: Span) -> str:
    if span.kind in COMM_KINDS:
        key = f"network {span.args.get('path')}"
        return key if key in STYLES else "network"
    return span.kind


def _draw_lane(axes: Axes, y: int, spans: list[Span], origin: int) -> set[str]:
    """Draw one lane's spans at row ``y`` (ms from ``origin``); returns the style keys used."""
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for span in spans:
        groups[_style_key(span)].append(((span.start_ns - origin) / NS_PER_MS, span.duration_ns / NS_PER_MS))
    for key, bars in groups.items():
        _, colour, height = STYLES[key]
        extent = (y - height / 2, height)
        if key == "iteration":
            axes.broken_barh(bars, extent, facecolors=colour, edgecolors="none", zorder=0.5)
        elif colour is None:
            axes.broken_barh(bars, extent, facecolors="none", edgecolors="0.4", linewidth=0.8)
        else:
            axes.broken_barh(bars, extent, facecolors=colour, edgecolors="white", linewidth=0.5)
    return set(groups)


def _decorate(axes: Axes, rows: list[tuple[int, str]], used: set[str], width_ms: float, window: str) -> None:
    axes.set_yticks(range(len(rows)), [f"rank {rank} {lane}" for rank, lane in rows])
    axes.set_ylim(len(rows) - 0.5, -0.5)
    for y in range(1, len(rows)):
        if rows[y][0] != rows[y - 1][0]:
            axes.axhline(y - 0.5, color="0.6", linewidth=0.8)
    axes.set_xlim(0, max(width_ms, 1e-6))
    axes.set_xlabel("time (ms) since the first shown event")
    axes.set_title(f"Poseidon timeline, {window}")
    handles = [_legend_patch(key) for key in STYLES if key in used]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def _legend_patch(key: str) -> Patch:
    label, colour, _ = STYLES[key]
    if colour is None:
        return Patch(facecolor="none", edgecolor="0.4", label=label)
    return Patch(facecolor=colour, label=label)


def _window_label(shown: dict[int, list[Span]]) -> str:
    chosen = sorted({spans[0].iteration for spans in shown.values()})
    if len(chosen) == 1:
        return f"iteration {chosen[0]}"
    return "iterations " + ", ".join(f"{spans[0].iteration} (rank {rank})" for rank, spans in shown.items())


if __name__ == "__main__":
    sys.exit(main())
