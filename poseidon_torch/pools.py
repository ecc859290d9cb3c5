"""Thread pool and CUDA stream pool that carry sync jobs.

Collectives on one process group must be issued in the same order on every rank, but gradient hooks may
fire in a different order on different ranks. So the pool is a set of *channels*: each channel is one
thread with its own process groups and a fixed, rank-independent list of syncers. A channel runs its
syncers strictly in that list order, every iteration, waiting for each to become ready. Invariants:
- a syncer belongs to exactly one channel; the assignment depends only on the syncer order;
- a channel runs at most one job at a time, so its process groups are never used concurrently;
- a job that raises is reported through ``on_error`` and the channel stops (later collectives on its
  group would be out of step with the peers).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ChannelGroups:
    """The process groups of one channel. gloo serialises a pair's send and receive on one connection
    (measured on the emulated 1 Gbit/s link: 32 MB each way took 539 ms on one group, 276 ms with one
    group per direction), so a gloo channel has a group for messages from a lower to a higher rank
    (``up``) and one for the way back (``down``); NCCL's batched point-to-point calls are duplex on one
    group. Collectives of the channel (SFB's all-gather) run on ``up``."""

    up: Any
    down: Any
    batched: bool  # issue point-to-point ops as one batch_isend_irecv on ``up`` (NCCL)

    @classmethod
    def create(cls, ranks: Sequence[int], backend: str, timeout: timedelta) -> "ChannelGroups":
        up = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if backend == "nccl":
            return cls(up, up, batched=True)
        return cls(up, dist.new_group(list(ranks), timeout=timeout, backend=backend), batched=False)

    def for_message(self, src: int, dst: int) -> Any:
        """The group that carries a message from global rank ``src`` to global rank ``dst``."""
        return self.up if src < dst else self.down


def assign_round_robin(num_syncers: int, num_channels: int) -> list[list[int]]:
    """Syncer indices per channel: syncer i goes to channel i mod C, keeping the syncer order."""
    channels = [[] for _ in range(min(num_channels, max(num_syncers, 1)))]
    for i in range(num_syncers):
        channels[i % len(channels)].append(i)
    return channels


class SyncChannel:
    """One pool thread: runs ``run_job(syncer_index, groups, ready_ns)`` for its syncers in a fixed
    order."""

    def __init__(self, index: int, group: ChannelGroups, order: Sequence[int],
                 run_job: Callable[[int, ChannelGroups, int], None],
                 on_error: Callable[[int, BaseException], None]) -> None:
        self.index = index
        self.group = group
        self.order = list(order)
        self._run_job = run_job
        self._on_error = on_error
        self._ready: dict[int, int] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"poseidon-channel-{index}", daemon=True)
        self._thread.start()

    def submit(self, syncer_index: int) -> None:
        """Mark a syncer ready (any thread); its job runs when the channel reaches it in its order."""
        with self._cond:
            self._ready[syncer_index] = time.monotonic_ns()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _next_ready(self, syncer_index: int) -> int | None:
        with self._cond:
            while syncer_index not in self._ready and not self._stopped:
                self._cond.wait()
            return None if self._stopped else self._ready.pop(syncer_index)

    def _loop(self) -> None:
        while True:
            for syncer_index in self.order:
                ready_ns = self._next_ready(syncer_index)
                if ready_ns is None:
                    return
                try:
                    self._run_job(syncer_index, self.group, ready_ns)
                except BaseException as exc:  # reported to the training thread by the barrier
                    self._on_error(syncer_index, exc)
                    return


class StreamPool:
    """A fixed set of CUDA side streams, handed out round-robin per channel (one stream per channel)."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.streams = [torch.cuda.Stream(device=device) for _ in range(size)]

    def for_channel(self, channel_index: int) -> "torch.cuda.Stream":
        return self.streams[channel_index % len(self.streams)]
