"""Process groups, the thread pool and the CUDA stream pool that carry sync jobs.

Groups: every PoseidonDDP owns private c10d backends (``ProcessGroupGloo`` or ``ProcessGroupNCCL``
objects used directly, outside torch.distributed's registry), made over the members of the user's
process group under a store prefix unique to this wrapper. Only the members take part; nothing is
registered globally, so closing a wrapper releases them, and a group is never confused with another
wrapper's. Every one of them has PoseidonDDP's timeout.

Channels: collectives on one group must be issued in the same order on every rank, but gradients become
ready in a different order on different ranks. So the pool is a set of *channels*: each channel is one
thread with its own groups and a fixed, rank-independent schedule of job keys. Every pass, a channel runs
the jobs of its schedule strictly in that order, waiting for each to be submitted. Invariants:
- a job key belongs to exactly one channel's schedule; schedules depend only on state all ranks share;
- a channel runs at most one job at a time, so its groups are never used concurrently;
- a schedule is replaced only between passes (every job of the pass done); the channel then starts
  over with the new schedule;
- a job that raises is reported through ``on_error`` and the channel stops (later collectives on its
  groups would be out of step with the peers).

Priority: a policy whose sync is off the training thread's critical path (Pipe-SGD) starts every
thread that carries it (the channels, the private backends' worker and transport threads) at a lower
CPU priority than the training thread (:func:`started_at_lower_priority`), so where cores are short the
training thread is not the one kept waiting.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Backend = Any  #: a c10d backend object (ProcessGroupGloo / ProcessGroupNCCL)
T = TypeVar("T")


def started_at_lower_priority(nice: int, make: Callable[[], T]) -> T:
    """``make()``, run on a short-lived thread whose nice value is ``nice`` above the caller's, so every
    thread it starts (Python or native) runs at that lower CPU priority: on Linux the nice value belongs
    to a thread and a new thread inherits its creator's. With ``nice`` 0, on another system (where it
    belongs to the whole process) or where the priority cannot be changed, ``make()`` runs as it is.
    The starter thread has the caller's current CUDA device (a per-thread setting too); it is a daemon,
    so an interrupted caller's process does not wait at exit for the rendezvous it may be stuck in."""
    if nice == 0 or not sys.platform.startswith("linux"):
        return make()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    outcome: list = []

    def start() -> None:
        try:
            _lower_priority(nice, device)
            outcome.append((True, make()))
        except BaseException as exc:  # raised again on the caller's thread
            outcome.append((False, exc))

    starter = threading.Thread(target=start, name="poseidon-start", daemon=True)
    starter.start()
    starter.join()
    made, value = outcome[0]
    if not made:
        raise value
    return value


def _lower_priority(nice: int, cuda_device: int | None) -> None:
    if cuda_device is not None:
        torch.cuda.set_device(cuda_device)
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + nice)
    except OSError:
        pass  # a sandbox that forbids it: the sync runs at the training thread's priority


def unique_prefix(group: Any) -> str:
    """A store prefix all members of ``group`` agree on and no other wrapper uses (collective)."""
    token = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    return f"poseidon/{token[0]}/"


def make_backend(prefix: str, name: str, rank: int, size: int, backend: str, timeout: timedelta) -> Backend:
    """A private backend over the members (ranks 0..size-1 of the user's group), rendezvous in the
    default store under ``prefix + name``."""
    store = dist.PrefixStore(f"{prefix}{name}/", dist.distributed_c10d._get_default_store())
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _options(cls, **fields):
    options = cls()
    for key, value in fields.items():
        setattr(options, key, value)
    return options


class Collectives:
    """The collectives PoseidonDDP issues on one private backend (ranks are the group's ranks)."""

    def __init__(self, backend: Backend, rank: int, size: int) -> None:
        self.backend, self.rank, self.size = backend, rank, size

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        self.start_all_gather(out, mine).wait()

    def start_all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> Any:
        """An all-gather in flight; ``wait()`` on the returned work."""
        return self.backend._allgather_base(out, mine)

    def start_small_all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> Any:
        """An all-gather of a few bytes in flight, sent to every peer directly (an all-to-all of copies):
        one hop instead of the P-1 of gloo's ring, each of which may queue behind bulk traffic on a
        busy link (the end-of-pass facts while Pipe-SGD's sync runs)."""
        return self.backend.alltoall_base(out, mine.repeat(self.size), [], [], dist.AllToAllOptions())

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        self.backend.allreduce([tensor], _options(dist.AllreduceOptions, reduceOp=op)).wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.start_broadcast(tensor, src).wait()

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        return self.backend.broadcast([tensor], _options(dist.BroadcastOptions, rootRank=src, rootTensor=0))

    def all_gather_objects(self, obj: object) -> list:
        """Every rank's ``obj`` (pickled), in rank order."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.empty(self.size, dtype=torch.int64)
        self.all_gather(sizes, torch.tensor([payload.numel()]))
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:payload.numel()] = payload
        everyone = torch.empty(self.size * longest, dtype=torch.uint8)
        self.all_gather(everyone, padded)
        return [pickle.loads(everyone[r * longest:r * longest + int(sizes[r])].numpy().tobytes())
                for r in range(self.size)]

    def broadcast_object(self, obj: object, src: int) -> object:
        return self.all_gather_objects(obj if self.rank == src else None)[src]

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))


@dataclass(frozen=True)
class ChannelGroups:
    """The backends of one channel. gloo serialises a pair's send and receive on one connection
    (measured on the emulated 1 Gbit/s link: 32 MB each way took 539 ms on one group, 276 ms with one
    group per direction), so a gloo channel has a backend for messages from a lower to a higher rank
    (``up``) and one for the way back (``down``); NCCL's coalesced point-to-point calls are duplex on
    one. Collectives of the channel (all-gathers, all-reduces) run on ``up``."""

    up: Backend
    down: Backend
    rank: int
    size: int
    coalesced: bool  # NCCL: issue a round's point-to-point ops as one coalesced group

    @classmethod
    def create(cls, prefix: str, index: int, rank: int, size: int, backend: str,
               timeout: timedelta) -> ChannelGroups:
        up = make_backend(prefix, f"channel{index}-up", rank, size, backend, timeout)
        if backend == "nccl":
            return cls(up, up, rank, size, coalesced=True)
        return cls(up, make_backend(prefix, f"channel{index}-down", rank, size, backend, timeout), rank, size,
                   coalesced=False)

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return (self.up if self.rank < peer else self.down).send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return (self.up if peer < self.rank else self.down).recv([tensor], peer, tag)

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        self.up._allgather_base(out, mine).wait()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        self.up.allreduce([tensor], _options(dist.AllreduceOptions, reduceOp=dist.ReduceOp.SUM)).wait()


@dataclass
class Groups:
    """All private backends of one wrapper: ``control`` (gloo, host tensors and small objects),
    ``data`` (the training device's backend: parameter and buffer broadcasts, the link probe) and
    one :class:`ChannelGroups` per sync channel."""

    control: Collectives
    data: Collectives
    channels: list[ChannelGroups]

    @classmethod
    def create(cls, user_group: Any, backend: str, num_channels: int, timeout: timedelta) -> Groups:
        prefix = unique_prefix(user_group)
        rank, size = dist.get_rank(user_group), dist.get_world_size(user_group)
        control = Collectives(make_backend(prefix, "control", rank, size, "gloo", timeout), rank, size)
        data = Collectives(make_backend(prefix, "data", rank, size, backend, timeout), rank, size)
        channels = [ChannelGroups.create(prefix, i, rank, size, backend, timeout) for i in range(num_channels)]
        return cls(control, data, channels)


#: run(key, groups, ready_ns): the job of ``key``, submitted at ``ready_ns`` (monotonic clock)
JobRunner = Callable[[Hashable, ChannelGroups, int], None]


class SyncChannel:
    """One pool thread: runs the jobs of its schedule, in schedule order, once per pass."""

    def __init__(self, index: int, groups: ChannelGroups, run: JobRunner,
                 on_error: Callable[[Hashable, BaseException], None]) -> None:
        self.index = index
        self.groups = groups
        self.schedule: list[Hashable] = []
        self._run = run
        self._on_error = on_error
        self._ready: dict[Hashable, int] = {}
        self._generation = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"poseidon-channel-{index}", daemon=True)
        self._thread.start()

    def set_schedule(self, keys: Sequence[Hashable]) -> None:
        """Replace the schedule (between passes only)."""
        with self._cond:
            self.schedule = list(keys)
            self._generation += 1
            self._cond.notify()

    def submit(self, key: Hashable) -> None:
        """Mark a job ready (any thread); it runs when the channel reaches it in its schedule."""
        with self._cond:
            self._ready[key] = time.monotonic_ns()
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _next(self, key: Hashable, generation: int) -> int | None:
        """The ready time of ``key`` once submitted; None when stopped or the schedule changed."""
        with self._cond:
            while key not in self._ready and not self._stopped and generation == self._generation:
                self._cond.wait()
            if self._stopped or generation != self._generation:
                return None
            return self._ready.pop(key)

    def _loop(self) -> None:
        while not self._stopped:
            with self._cond:
                generation, schedule = self._generation, list(self.schedule)
                while not schedule and not self._stopped and generation == self._generation:
                    self._cond.wait()
            for key in schedule:
                ready_ns = self._next(key, generation)
                if ready_ns is None:
                    break
                try:
                    self._run(key, self.groups, ready_ns)
                except BaseException as exc:  # reported to the training thread by the barrier
                    self._on_error(key, exc)
                    return


class StreamPool:
    """A fixed set of CUDA side streams, one per channel."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.streams = [torch.cuda.Stream(device=device) for _ in range(size)]

    def for_channel(self, channel_index: int) -> torch.cuda.Stream:
        return self.streams[channel_index % len(self.streams)]
