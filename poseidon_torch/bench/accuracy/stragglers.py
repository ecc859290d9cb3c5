"""Emulated stragglers, named on the command line and reproducible.

``--straggler`` takes one of::

    none
    persistent:factor=F[,rank=R][,by=B]   host R (default: the last) computes F times slower
    transient:p=P,delay=D[,seed=S][,by=B] each step, each host pauses with probability P for D
    slow-link:rate=RATE[,rank=R]          host R's link shaped at RATE both ways (netns mode only)

A duration ``D`` is ``50ms`` / ``0.05s``, or a bare number: that fraction of the host's calibrated step
compute time (``delay=0.5``: half an iteration, as the SSP paper's background-load stragglers).
``by`` is how a host pauses: ``sleep`` (the default) or ``load``, busy with a background computation for
the pause. On real hosts the two are the same for the others; on a machine with fewer cores than emulated
hosts a sleeping host gives its CPU share to the others, a loaded one keeps it, as a host of its own would.

Invariants:
- A pause happens before the step's forward and is part of the timed step; a persistent straggler pauses
  ``(F - 1)`` x its calibrated compute time every step, so its steps take about F times as long.
- Whether host ``r`` pauses at step ``t`` depends only on ``(seed, r, t)``: the same in every mode and run.
- The calibrated compute time is one training step without sync (zero_grad, forward, backward, optimizer
  step), measured once per run on a copy of the model, so calibrating changes neither the weights nor the
  BatchNorm statistics that training starts from.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from poseidon_torch.bench.netns import parse_rate

KINDS = ("none", "persistent", "transient", "slow-link")
PAUSES = ("sleep", "load")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s)?")


@dataclass(frozen=True)
class Straggler:
    """A parsed ``--straggler``; :meth:`pause_s` is what a host sleeps before a step."""
    kind: str = "none"
    rank: int | None = None
    factor: float = 1.0
    probability: float = 0.0
    delay: str = "0"
    rate: str | None = None
    seed: int = 0
    by: str = "sleep"

    @property
    def needs_calibration(self) -> bool:
        """Whether pauses are relative to the step's compute time (so it must be measured first)."""
        return self.kind == "persistent" or (self.kind == "transient" and _DURATION.fullmatch(self.delay)[2] is None)

    def pause_s(self, rank: int, step: int, compute_s: float) -> float:
        """Seconds host ``rank`` pauses before step ``step`` (``compute_s``: its calibrated step compute)."""
        if self.kind == "persistent":
            return (self.factor - 1.0) * compute_s if rank == self.rank else 0.0
        if self.kind == "transient":
            draw = np.random.default_rng([self.seed, rank, step]).random()
            return self._delay_s(compute_s) if draw < self.probability else 0.0
        return 0.0

    def wait_out(self, seconds: float) -> None:
        """Pause for ``seconds``: asleep, or (``by=load``) computing a background load until then."""
        if self.by == "sleep":
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        a, out = torch.ones(128, 128), torch.empty(128, 128)
        while time.perf_counter() < deadline:
            torch.mm(a, a, out=out)

    def host_rates(self) -> dict[int, str]:
        """Link rates that differ from the cluster's (the slow link)."""
        return {self.rank: self.rate} if self.kind == "slow-link" else {}

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def _delay_s(self, compute_s: float) -> float:
        value, unit = _DURATION.fullmatch(self.delay).groups()
        return float(value) * {"ms": 1e-3, "s": 1.0, None: compute_s}[unit]


def parse_straggler(text: str, hosts: int) -> Straggler:
    """The :class:`Straggler` that ``text`` names, for a cluster of ``hosts``; ValueError saying what is wrong."""
    kind, _, rest = text.strip().partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown straggler {kind!r}: expected one of {', '.join(KINDS)}")
    items = [item.split("=", 1) if "=" in item else (item, "") for item in rest.split(",") if item]
    fields = dict(items)
    if len(fields) != len(items):
        raise ValueError(f"straggler {text!r} names a field twice")
    allowed = {"none": set(), "persistent": {"factor", "rank", "by"}, "transient": {"p", "delay", "seed", "by"},
               "slow-link": {"rate", "rank"}}[kind]
    required = {"none": set(), "persistent": {"factor"}, "transient": {"p", "delay"}, "slow-link": {"rate"}}[kind]
    if set(fields) - allowed or required - set(fields):
        raise ValueError(f"straggler {kind!r} takes {sorted(allowed) or 'no fields'} "
                         f"(required: {sorted(required) or 'none'}), got {text!r}")
    try:
        rank = int(fields.get("rank", hosts - 1)) if kind in ("persistent", "slow-link") else None
        straggler = Straggler(kind, rank=rank,
                              factor=float(fields.get("factor", 1.0)), probability=float(fields.get("p", 0.0)),
                              delay=fields.get("delay", "0"), rate=fields.get("rate"), seed=int(fields.get("seed", 0)),
                              by=fields.get("by", "sleep"))
    except ValueError as exc:
        raise ValueError(f"bad straggler {text!r}: {exc}") from exc
    _check(straggler, hosts, text)
    return straggler


def _check(straggler: Straggler, hosts: int, text: str) -> None:
    if straggler.rank is not None and not 0 <= straggler.rank < hosts:
        raise ValueError(f"straggler {text!r}: rank must be in 0..{hosts - 1}")
    if straggler.kind == "persistent" and not 1.0 <= straggler.factor < math.inf:
        raise ValueError(f"straggler {text!r}: factor must be a number >= 1 (how many times slower)")
    if not 0.0 <= straggler.probability <= 1.0:
        raise ValueError(f"straggler {text!r}: p must be a probability in [0, 1]")
    if not _DURATION.fullmatch(straggler.delay):
        raise ValueError(f"straggler {text!r}: delay must be e.g. 50ms, 0.05s, or 0.5 (of a step's compute)")
    if straggler.by not in PAUSES:
        raise ValueError(f"straggler {text!r}: by must be one of {', '.join(PAUSES)}")
    if straggler.rate is not None and parse_rate(straggler.rate) <= 0:
        raise ValueError(f"straggler {text!r}: rate must be above 0")
