"""The simulator on the Poseidon paper's VGG19-22K (40 GbE), beside the paper's speed-ups.

    python benchmarks/simulate_paper.py [--plot docs/simulate_vgg19_22k.png]

Prints three tables: the prediction at the nominal 40 Gbit/s, at 10 Gbit/s, and at the effective
bandwidth that makes WFBP's predicted speed-up at 2 machines equal the paper's (one number fitted to one
of the paper's 15 points; the other 14 are then predictions), with the gap to the paper in each cell;
``--markdown``: one table of speed-ups, the paper's beside each prediction.
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


def markdown(profile, effective: float) -> str:
    """Speed-ups per size: for each scheme the paper's, then the predictions at 40 and 10 Gbit/s, with
    the gap to the paper (the fitted bandwidth is said below the table)."""
    bandwidths = (40.0, 10.0)
    speedup = {(row.scheme, row.hosts, gbps): row.speedup for gbps in bandwidths
               for row in predict(profile, SCHEMES, HOSTS, link(gbps))}
    head = ["machines"]
    for scheme in SCHEMES:
        head += [f"{scheme}: paper", "40 GbE", "10 GbE"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for hosts in HOSTS:
        cells = [str(hosts)]
        for scheme in SCHEMES:
            reported = paper.PAPER_40GBE[scheme][hosts]
            cells.append(f"**{reported:.2f}**")
            cells += [f"{speedup[scheme, hosts, g]:.2f} ({speedup[scheme, hosts, g] / reported - 1:+.0%})"
                      for g in bandwidths]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\nWFBP's speed-up at 2 machines is the paper's at an effective {effective:.2f} Gbit/s.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", help="PNG of the prediction at the fitted bandwidth with the paper's points")
    parser.add_argument("--markdown", action="store_true", help="one compact table of speed-ups")
    args = parser.parse_args()
    profile = paper.vgg19_22k()
    effective = fitted_bandwidth(profile)
    if args.markdown:
        print(markdown(profile, effective))
        return
    for gbps, title in ((40.0, "nominal 40 GbE"), (10.0, "10 GbE"),
                        (effective, f"effective {effective:.2f} Gbit/s (fitted to WFBP at 2 machines)")):
        rows = predict(profile, SCHEMES, HOSTS, link(gbps))
        print(f"## {title}\n\n{format_rows(rows, profile, link(gbps), paper.PAPER_40GBE)}\n")
    if args.plot:
        from poseidon_torch.simulate.plot import plot_speedup

        rows = predict(profile, SCHEMES, [1, *HOSTS], link(10.0))
        plot_speedup(rows, args.plot, "VGG19-22K predicted at 10 Gbit/s (about WFBP's effective bandwidth in the "
                     "paper), paper's figures at 40 GbE", paper.PAPER_40GBE)


if __name__ == "__main__":
    main()
