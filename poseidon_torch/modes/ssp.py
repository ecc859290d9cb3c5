"""Stale synchronous parallel (Bosen) and asynchronous SGD (Downpour): ``ServerOptimizer(..., staleness=s)``
(s >= 1) or ``staleness=None``.

Every rank runs on its own *clock* (its count of synced passes since the last ``finish()``): the mode is
not ``lockstep``, so the engine issues no per-step collective, its buckets are fused once, in reverse
registration order (as torch DDP's), every layer on the default path, and a bucket's job, whatever its
path, pushes its chunks to their owners' server threads (``stale.py``) and takes the values they answer
once the bound allows; the forward of a layer waits for its bucket's values. Invariants: those of
``stale.py`` (every push applied once, in clock order; ``finish()`` makes every rank's parameters the
owners' values); parameters loaded or written while the owners hold the values are refused until
``finish()`` hands them to the owners.
"""
from __future__ import annotations

from collections.abc import Generator

import torch

from ..bucket import Bucket
from ..paths import Path, SyncContext
from ..pools import ChannelGroups
from ..stale import StaleServer
from .base import Engine
from .server import ServerMode, ServerRequest


class SSP(ServerMode):
    """SSP (a bound ``staleness`` >= 1) or asynchronous SGD (``staleness`` None) on the servers."""

    name = "ssp"
    lockstep = False
    #: measured (lm, 2 hosts, 1 Gbit/s, steps in 30 s, SSP s = 1 against BSP on the servers, two runs):
    #: 4 MiB 176/199 and 186/201 (the whole 3.4 MB model one bucket: its push starts after backward and
    #: the first layer's forward waits for all of it), 2 MiB 196/205, 1 MiB 197/200 and 194/196,
    #: 256 KiB 184/187 (more messages)
    first_fusion_bytes = 1 << 20

    def __init__(self, request: ServerRequest) -> None:
        super().__init__(request)
        self._exchange: StaleExchange | None = None

    def attach(self, engine: Engine) -> None:
        engine.coordinator.default_only()  # ranks on their own clocks cannot all-gather anything
        super().attach(engine)
        self._exchange = StaleExchange(self.kv.name, self.server)

    def make_server(self) -> StaleServer:
        request, engine = self.request, self.engine
        return StaleServer(self.spec, engine.control, request.staleness, engine.timeout, request.push_every,
                           request.fetch_every, request.versions)

    def job(self, path: Path) -> StaleExchange:
        return self._exchange

    def defers(self, learned: bool) -> bool:
        return True

    def take_values(self, bucket: Bucket) -> None:
        """The answered values into the parameters, in a pass that fetched them (``fetch_every``)."""
        if self.server.fetching:
            super().take_values(bucket)
            self.server.own_versions([bucket])

    def forget_values(self) -> None:
        self.server.parameters_loaded = True

    def before_forward(self) -> None:
        if torch.is_grad_enabled():
            self.server.refuse_if_loaded()

    def after_step(self) -> None:
        pass  # each rank on its own clock: the forward waits for what the bound requires

    def diagnosis(self) -> str:
        return self.server.diagnosis()

    def trace_args(self) -> dict:
        return {"clock": self.server.clock, "staleness": self.server.pass_staleness()}

    def layout(self) -> dict:
        return {"forward_waits": True, "server": True}

    def finish(self) -> None:
        """Collective: a last backward that raised pushes its clock first; every rank's parameters become
        the owners' values and the clocks restart."""
        self.engine.finish_aborted_pass()
        super().finish()
        self.server.finish()

    def quiesce(self) -> None:
        super().quiesce()
        self.server.finish()  # every push applied, on every rank (loaded parameters go to the owners)

    def last_staleness(self) -> int | None:
        """How many clocks of the slowest rank the values the next forward reads lack (None before a step)."""
        if self.server.clock < 0:
            return None
        self.engine.settle()
        return self.server.pass_staleness()


class StaleExchange:
    """A bucket's job in this mode, whatever its path: push every chunk, take the values the owners answer
    (staged as the update at the owners stages: every parameter with a ``.grad`` is stepped)."""

    native = False

    def __init__(self, name: str, server: StaleServer) -> None:
        self.name, self.server = name, server

    def stage(self, bucket: Bucket, ctx: SyncContext) -> None:
        bucket.stage(ctx.aborted, ctx.shadow, grads_present=True)

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        yield "network"
        bucket.bytes_sent = self.server.exchange(bucket)
        bucket.outcome = self.name
        bucket.dirty.zero_()
        return True
