"""Timeline plot of a Poseidon trace (matplotlib, imported only here): one row per rank and lane."""
from __future__ import annotations

from collections import defaultdict

from ..extras import require

require("matplotlib", "plot", "the trace timeline plot (poseidon-trace plot)")
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ..paths import REGISTERED  # noqa: E402
from .files import PathLike, ordered_lanes  # noqa: E402
from .spans import COMM_KINDS, Span  # noqa: E402
from .summary import NS_PER_MS, iterations_of  # noqa: E402

#: the network spans' colour of each registered path, in registration order
PATH_COLORS = ("#c44e52", "#8172b2", "#8c613c", "#2ca02c", "#17becf", "#bcbd22")
#: Bar style per drawn span: (legend label, face colour or None for an outline, bar height in lane units).
STYLES = {
    "forward": ("forward", "#4c72b0", 0.8),
    "backward": ("backward", "#55a868", 0.8),
    "queue": ("queued", "#ccb974", 0.5),
    "gather": ("gather into send buffer", "#64b5cd", 0.5),
    "rebuild": ("rebuild (GEMM)", "#da8bc3", 0.5),
    "compress": ("compression", "#9467bd", 0.5),
    "decompress": ("decompression", "#e377c2", 0.5),
    "update": ("optimizer step at a shard", "#8c8c8c", 0.5),
    "scatter": ("scatter into .grad", "#dd8452", 0.5),
    **{f"network {path.name}": (f"network, {path.name}", color, 0.5) for path, color in zip(REGISTERED, PATH_COLORS)},
    "network": ("network, other path", "#937860", 0.5),
    "sync": ("sync job", None, 0.8),
    "pull": ("update and pull (split job)", None, 0.8),
    "iteration": ("iteration", "#e3e3e3", 0.96),
    "wait": ("training thread waits on the sync", "#222222", 0.3),
}
#: a path's own phases, in its words (a phase no style knows is drawn as "other")
STYLES.update({phase: (label, *STYLES.get(phase, STYLES["network"])[1:])
               for path in REGISTERED for phase, label in path.phase_labels.items()})


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


def _select_iteration(spans: list[Span], iteration: int | None) -> list[Span]:
    if not spans:
        return []
    chosen = max(iterations_of(spans)) if iteration is None else iteration
    return [span for span in spans if span.iteration == chosen]


def _missing_iteration_message(spans_by_rank: dict[int, list[Span]], iteration: int | None) -> str:
    recorded = sorted(set().union(*map(iterations_of, spans_by_rank.values())))
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
            above = {"zorder": 3} if key == "wait" else {}  # over the forward it happens in
            axes.broken_barh(bars, extent, facecolors=colour, edgecolors="white", linewidth=0.5, **above)
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
