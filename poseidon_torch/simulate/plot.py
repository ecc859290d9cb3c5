"""The speed-up curves: one per scheme, the ideal line, and the paper's figures where given (matplotlib)."""
from __future__ import annotations

from collections import defaultdict

from ..extras import require

matplotlib = require("matplotlib", "plot", "the speed-up plot (poseidon-simulate --plot)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..trace.files import PathLike  # noqa: E402
from .predict import Row  # noqa: E402


def plot_speedup(rows: list[Row], out_path: PathLike, title: str, figures: dict | None = None) -> None:
    """Speed-up against machines, one predicted curve per scheme (solid) and the paper's (markers)."""
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        curves[row.scheme].append((row.hosts, row.speedup))
    figure, axes = plt.subplots(figsize=(7, 5))
    hosts = sorted({row.hosts for row in rows})
    axes.plot(hosts, hosts, color="0.7", linestyle=":", label="linear")
    for scheme, points in curves.items():
        line, = axes.plot(*zip(*sorted(points)), marker=".", label=f"{scheme} (predicted)")
        reported = (figures or {}).get(scheme)
        if reported:
            axes.plot(list(reported), list(reported.values()), linestyle="none", marker="x", markersize=8,
                      color=line.get_color(), label=f"{scheme} (paper)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    axes.set_xlabel("machines")
    axes.set_ylabel("speed-up over one machine")
    axes.set_title(title, fontsize=8)
    axes.legend(fontsize=7)
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
