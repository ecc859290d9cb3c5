"""The simulator on the Poseidon paper's VGG19-22K (40 GbE), beside the paper's speed-ups.

    python benchmarks/simulate_paper.py [--plot docs/simulate_vgg19_22k.png]

Prints three tables: the prediction at the nominal 40 Gbit/s, at 10 Gbit/s, and at the effective
bandwidth that makes WFBP's predicted speed-up at 2 machines equal the paper's (one number fitted to one
of the paper's 15 points; the other 14 are then predictions), with the gap to the paper in each cell.
"""
from __future__ import annotations

import argparse

from poseidon_torch.link import LinkModel
from poseidon_torch.simulate import paper, predict
from poseidon_torch.simulate.cli import format_rows

HOSTS = [2, 4, 8, 16, 32]
SCHEMES = ["poseidon", "wfbp", "ps"]
LATENCY_US = 50.0


def link(gbps: float) -> LinkModel:
    return LinkModel.from_gbps(gbps, LATENCY_US)


def fitted_bandwidth(profile, scheme: str = "wfbp", hosts: int = 2) -> float:
    """The bandwidth (Gbit/s) at which ``scheme``'s predicted speed-up at ``hosts`` is the paper's
    (bisection on a log scale: the speed-up grows with the bandwidth)."""
    target = paper.PAPER_40GBE[scheme][hosts]
    low, high = 0.1, 400.0
    for _ in range(60):
        middle = (low * high) ** 0.5
        (row,) = predict(profile, [scheme], [hosts], link(middle))
        low, high = (middle, high) if row.speedup < target else (low, middle)
    return (low * high) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", help="PNG of the 40 GbE prediction with the paper's points")
    args = parser.parse_args()
    profile = paper.vgg19_22k()
    effective = fitted_bandwidth(profile)
    for gbps, title in ((40.0, "nominal 40 GbE"), (10.0, "10 GbE"),
                        (effective, f"effective {effective:.2f} Gbit/s (fitted to WFBP at 2 machines)")):
        rows = predict(profile, SCHEMES, HOSTS, link(gbps))
        print(f"## {title}\n\n{format_rows(rows, profile, link(gbps), paper.PAPER_40GBE)}\n")
    if args.plot:
        from poseidon_torch.simulate.plot import plot_speedup

        rows = predict(profile, SCHEMES, [1, *HOSTS], link(effective))
        plot_speedup(rows, args.plot, f"VGG19-22K, {effective:.1f} Gbit/s effective (fitted to WFBP at 2), "
                     "paper at 40 GbE", paper.PAPER_40GBE)


if __name__ == "__main__":
    main()
