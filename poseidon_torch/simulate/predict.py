"""Predictions: every scheme at every number of machines, as rows a table, JSON or a plot can show.

Speed-up over one machine: ``hosts x compute_s / iteration_s`` (one machine has no communication);
throughput: samples per second over all machines when the profile knows its batch, else iterations
per second over all machines. Bytes per machine: what one machine sends per iteration.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from ..link import LinkModel
from .profile import Profile
from .schemes import ALL_REDUCE, PATHS, SCHEMES


@dataclass(frozen=True)
class Row:
    scheme: str
    hosts: int
    iteration_s: float
    speedup: float
    throughput: float
    throughput_unit: str          #: "samples/s" or "iterations/s" (over all machines)
    exposed_comm_s: float
    bytes_per_machine: float
    sfb_layers: tuple[str, ...]   #: layers the scheme syncs off the default path (on SFB) at this size

    def to_dict(self) -> dict:
        return asdict(self)


def predict(profile: Profile, schemes: Iterable[str], hosts: Sequence[int], link: LinkModel,
            slowdown: float = 1.0) -> list[Row]:
    """One row per scheme and number of machines."""
    unknown = [name for name in schemes if name not in SCHEMES]
    if unknown:
        raise ValueError(f"unknown scheme(s) {unknown}: choose from {sorted(SCHEMES)}")
    if not hosts or any(n < 1 for n in hosts):
        raise ValueError(f"numbers of machines must be >= 1, got {list(hosts)}")
    rows = []
    for name in schemes:
        for n in hosts:
            timeline = SCHEMES[name].run(profile, n, link, slowdown)
            per_iteration = profile.samples or 1
            rows.append(Row(name, n, timeline.iteration_s, n * profile.compute_s / timeline.iteration_s,
                            n * per_iteration / timeline.iteration_s,
                            "samples/s" if profile.samples else "iterations/s", timeline.exposed_s,
                            timeline.nbytes, tuple(s.job.name for s in timeline.spans
                                                   if s.job.path not in (PATHS.default.name, ALL_REDUCE))))
    return rows
