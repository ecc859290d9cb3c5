"""The hot path of a pass: readiness counting, dispatch to the channels, running the sync jobs, the barrier.

The engine (``engine.py``) owns the state machine: when a pass opens and ends, what each bucket's job
does. The *core* owns what happens once per parameter and once per bucket in every pass:
- a hook on every parameter's gradient accumulator counts its bucket down; the bucket's job is
  submitted to its channel the moment its last gradient (or, for an FC layer on SFB, its factors) is
  ready; an accumulation while no pass is open marks the parameter dirty, or, in *ask* mode (a synced
  backward may be starting), calls the engine's ``on_idle(param)`` to decide;
- a bucket's ``.grad`` is copied into its flat buffer (*staged*) by the thread that submits it (the
  backward's thread, or the training thread for what ``finish`` submits), before its job is queued: a
  sync job never reads ``.grad``, so a ``.grad`` the user touches while jobs run (after a backward
  raised, or after ``backward()`` returned in parameter-server mode) can change nothing, and two threads
  never access one ``.grad`` at once (torch's tensor objects are not safe for that: a reader raced a
  ``zero_grad()`` into a segfault);
- channels (one thread and its process groups each) run the slots of the engine's channel plan
  (``schedule.py``) in its fixed order; a PS job may run inside the core, any other slot calls the
  engine's ``run_job(key)``. A split bucket's second slot is submitted when its first slot ends, and
  the bucket is done when its second slot is;
- ``wait`` is the BSP barrier: every job of the pass done, or the first failure, or the timeout.

Two implementations share this interface and these semantics:
- :class:`PythonCore`, the reference: Python hooks, Python channel threads, every job in Python;
- the native core (``csrc/core.cpp``, :func:`native_core`): C++ hooks on the gradient accumulators
  that never take the GIL while a pass is open, C++ channel threads, PS jobs in C++ on the c10d
  backends; other jobs take the GIL. CPU tensors only: the engine uses the Python core on CUDA.
Both write the per-bucket flags every path reads (``Bucket.seen``, ``dirty``, ``used_anywhere``),
record each bucket's submission time and (rank 0) the order in which parameters became ready.
Invariants: a bucket is submitted at most once per pass; a gradient that arrives after its bucket was
submitted marks the bucket late; after ``finish`` every bucket is submitted and the pass takes no more
arrivals (its jobs may still run: a deferred pass); ``wait`` never blocks
longer than its timeout and reports the first failed job by name.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from .barrier import BSPBarrier, SyncError, SyncTimeout
from .bucket import Bucket
from .graph import grad_accumulator
from .paths.ps import PSPath
from .pools import ChannelGroups, SyncChannel
from .schedule import ChannelPlan

OK, FAILED, TIMED_OUT = 0, 1, 2
FACTORS = -1  #: the readiness event of an FC layer's factors (the other events are parameter slots)


def raise_outcome(status: int, message: str) -> None:
    """Turn a core's ``wait`` result into the engine's exceptions."""
    if status == TIMED_OUT:
        raise SyncTimeout(message)
    if status == FAILED:
        raise SyncError(message)


@dataclass
class _Readiness:
    """One bucket's countdown in the current pass."""

    pending: set[int] = field(default_factory=set)
    submitted: bool = False
    late: bool = False
    aborted: bool = False   #: submitted by ``finish(aborted=True)``
    submit_ns: int = 0


class PythonCore:
    """The reference core: Python hooks, Python channel threads, every job run by ``run_job``."""

    kind = "python"

    def __init__(self, params: Sequence[torch.nn.Parameter], channels: Sequence[ChannelGroups],
                 run_job: Callable[[int], None], on_idle: Callable[[int], None], stage: Callable[[int], None],
                 record_order: bool) -> None:
        self._params = list(params)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._run_job, self._on_idle, self._stage = run_job, on_idle, stage
        self._record = record_order
        self._lock = threading.Lock()
        self._open = False
        self._ask = False
        self._buckets: list[Bucket] = []
        self._ready: list[_Readiness] = []
        self.order: list[int] = []      #: parameters in readiness order (rank 0), this pass
        self.order_ns: list[int] = []   #: their ready times, ns after ``begin_pass``
        self._began_ns = 0
        self.barrier = BSPBarrier(lambda key: f"bucket {self._buckets[self._plan.bucket_of(key)].name!r}")
        self._channels = [SyncChannel(i, groups, self._job, self.barrier.fail) for i, groups in enumerate(channels)]
        # on the accumulator nodes, as the native core's: they fire after every post-accumulate-grad hook
        self._accumulators = [grad_accumulator(p) for p in self._params]
        self._hooks = [acc.register_hook(partial(self._accumulated, i)) for i, acc in enumerate(self._accumulators)]

    # ---- configuration (between passes) ---------------------------------------------------------

    def install(self, buckets: Sequence[Bucket], ps: PSPath, plan: ChannelPlan) -> None:
        """Make ``buckets`` current (between passes); ``ps``: the native path (the PS path), whose
        precomputed schedules a core may run itself (this one runs every job through ``run_job``);
        ``plan``: the slots each channel runs."""
        self._buckets = list(buckets)
        self._plan = plan
        self._ready = [_Readiness() for _ in buckets]
        self._slot = {}
        for b in self._buckets:
            for j, p in enumerate(b.params):
                self._slot[id(p)] = (b.index, j)
        self._where = [self._slot[id(p)] for p in self._params]
        self._channel_of = {}
        for channel, keys in zip(self._channels, plan.schedules):
            channel.set_schedule(keys)
            self._channel_of.update((key, channel) for key in keys)

    def set_ask(self, ask: bool) -> None:
        """Whether an accumulation outside a pass asks the engine (a synced backward may be starting)."""
        self._ask = ask

    # ---- a pass -------------------------------------------------------------------------------------

    def begin_pass(self, wait_factors: Sequence[bool], native_ps: Sequence[bool], trace: bool) -> None:
        with self._lock:
            for b, ready, factors in zip(self._buckets, self._ready, wait_factors):
                ready.pending = {FACTORS} if factors else set(range(len(b.params)))
                ready.submitted = ready.late = ready.aborted = False
                b.seen.zero_()
            self.order, self.order_ns = [], []
            self._began_ns = time.monotonic_ns()
            self.barrier.expect(range(len(self._buckets)))
            self._open = True

    def arrive_param(self, param: int) -> None:
        """Parameter ``param`` (its index in the core's list) accumulated in the open pass."""
        with self._lock:
            index, j = self._where[param]
            if self._record:
                self.order.append(param)
                self.order_ns.append(time.monotonic_ns() - self._began_ns)
            submit = self._arrive(index, j)
        if submit:
            self._submit(index)

    def arrive_factors(self, bucket: int, also_wait_for: Sequence[int]) -> None:
        """An FC bucket's factors are complete; ``also_wait_for``: its parameters that the running
        backward will still accumulate (uses outside the captured calls)."""
        with self._lock:
            ready = self._ready[bucket]
            b = self._buckets[bucket]
            if not ready.submitted:
                ready.pending |= {j for j in also_wait_for if not b.seen[j]}
            if self._record:
                for p in b.params:
                    self.order.append(self._index[id(p)])
                    self.order_ns.append(time.monotonic_ns() - self._began_ns)
            submit = self._arrive(bucket, FACTORS)
        if submit:
            self._submit(bucket)

    def set_dirty(self, param: int) -> None:
        index, j = self._where[param]
        self._buckets[index].dirty[j] = 1

    def finish(self, aborted: bool) -> None:
        """Submit every bucket not yet submitted (some parameter got no gradient on this rank). The
        backward is over: nothing that accumulates from now on is this pass's (a deferred pass's jobs run
        on; the next backward asks the engine, which settles it first)."""
        with self._lock:
            self._open = False
            rest = [i for i, ready in enumerate(self._ready) if not ready.submitted]
            for i in rest:
                self._ready[i].submitted = True
                self._ready[i].aborted = aborted
        for i in rest:
            self._submit(i)

    def wait(self, timeout: float) -> tuple[int, str]:
        """The barrier; (OK, "") or (FAILED / TIMED_OUT, message)."""
        return self._barrier_status(timeout)

    def wait_bucket(self, bucket: int, timeout: float) -> tuple[int, str]:
        """Until the job of ``bucket`` is done (the pass stays open); as ``wait``."""
        return self._barrier_status(timeout, bucket)

    def _barrier_status(self, timeout: float, key: int | None = None) -> tuple[int, str]:
        try:
            self.barrier.wait(timeout, key)
        except SyncTimeout as exc:
            return TIMED_OUT, str(exc)
        except SyncError as exc:
            return FAILED, str(exc)
        return OK, ""

    def scatter(self, bucket: Bucket) -> None:
        """The averages of ``bucket`` into ``.grad`` (training thread, after its job): :meth:`Bucket.scatter`."""
        bucket.scatter()

    def late(self, bucket: int) -> bool:
        return self._ready[bucket].late

    def done(self, bucket: int) -> bool:
        """The job of ``bucket`` (its last slot) is done in this pass."""
        return self.barrier.arrived(bucket)

    def aborted(self, bucket: int) -> bool:
        return self._ready[bucket].aborted

    def submit_ns(self, bucket: int) -> int:
        return self._ready[bucket].submit_ns

    def native_spans(self) -> list:
        return []  # every job ran in Python, observed by the recorder there

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for channel in self._channels:
            channel.stop()

    # ---- internals ------------------------------------------------------------------------------

    def _accumulated(self, param: int, _grad_inputs, _grad_outputs) -> None:
        if self._open:
            self.arrive_param(param)
        elif self._ask:
            self._on_idle(param)
        else:
            self.set_dirty(param)

    def _arrive(self, index: int, key: int) -> bool:
        """Count one event down (lock held); True when the bucket must be submitted now."""
        ready, b = self._ready[index], self._buckets[index]
        if key != FACTORS:
            b.seen[key] = 1
        if ready.submitted:
            ready.late = ready.late or key != FACTORS
            return False
        if key not in ready.pending:
            return False
        ready.pending.discard(key)
        if ready.pending:
            return False
        ready.submitted = True
        return True

    def _submit(self, index: int) -> None:
        b = self._buckets[index]
        if b.ready_event is not None:  # on the training stream, behind the kernels that wrote .grad
            b.ready_event.record()
        self._stage(index)
        self._ready[index].submit_ns = time.monotonic_ns()
        self._channel_of[index].submit(index)

    def _job(self, key: int, groups: ChannelGroups, ready_ns: int) -> None:
        self._run_job(key)
        if key in self._plan.split:  # a first slot: its bucket's second slot may run now
            second = key + self._plan.buckets
            self._channel_of[second].submit(second)
        else:
            self.barrier.arrive(self._plan.bucket_of(key))


class NativeCore:
    """The native core (``csrc/core.cpp``) behind the same interface: PS jobs run in C++, every other
    job through ``run_job`` (with the GIL)."""

    kind = "native"

    def __init__(self, params: Sequence[torch.nn.Parameter], channels: Sequence[ChannelGroups],
                 run_job: Callable[[int], None], on_idle: Callable[[int], None], stage: Callable[[int], None],
                 record_order: bool) -> None:
        from . import _native

        self._params = list(params)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._core = _native.Core(self._params, [(c.up, c.down, c.coalesced) for c in channels],
                                  channels[0].rank, channels[0].size, run_job, on_idle, stage, record_order)
        self._buckets: list[Bucket] = []
        self._native: list[bool] = []
        self._native_name = ""

    def install(self, buckets: Sequence[Bucket], ps: PSPath, plan: ChannelPlan) -> None:
        self._buckets = list(buckets)
        self._native_name = ps.name
        self._core.reset_buckets()
        for b in self._buckets:
            s = ps.schedule_of(b)
            self._core.add_bucket(b.name, [self._index[id(p)] for p in b.params], b.offsets, b.grad_numel,
                                  b.flat, b.seen, b.dirty, b.used_anywhere, s.push, s.pull, s.aggregate,
                                  s.bytes_sent)
        self._core.commit([list(keys) for keys in plan.schedules])

    def set_ask(self, ask: bool) -> None:
        self._core.set_ask(ask)

    def begin_pass(self, wait_factors: Sequence[bool], native_ps: Sequence[bool], trace: bool) -> None:
        self._native = list(native_ps)
        self._core.begin_pass(list(wait_factors), self._native, trace)

    def arrive_param(self, param: int) -> None:
        self._core.arrive_param(param)

    def arrive_factors(self, bucket: int, also_wait_for: Sequence[int]) -> None:
        self._core.arrive_factors(bucket, list(also_wait_for))

    def set_dirty(self, param: int) -> None:
        self._core.set_dirty(param)

    def finish(self, aborted: bool) -> None:
        self._core.finish(aborted)

    def wait(self, timeout: float) -> tuple[int, str]:
        status = self._core.wait(timeout)
        for b, native in zip(self._buckets, self._native):
            if native:  # what the C++ job did, on the bucket as a Python job would have left it
                b.bytes_sent, b.sync_seconds, b.outcome = self._core.bytes_sent(b.index), \
                    self._core.sync_seconds(b.index), self._native_name
        return status

    def wait_bucket(self, bucket: int, timeout: float) -> tuple[int, str]:
        return self._core.wait_bucket(bucket, timeout)

    def scatter(self, bucket: Bucket) -> None:
        """As :meth:`Bucket.scatter`, in C++ (one call per bucket instead of Python per parameter)."""
        self._core.scatter(bucket.index)

    def late(self, bucket: int) -> bool:
        return self._core.late(bucket)

    def done(self, bucket: int) -> bool:
        return self._core.done(bucket)

    def aborted(self, bucket: int) -> bool:
        return self._core.aborted(bucket)

    def submit_ns(self, bucket: int) -> int:
        return self._core.submit_ns(bucket)

    @property
    def order(self) -> list[int]:
        return self._core.order()

    @property
    def order_ns(self) -> list[int]:
        return self._core.order_ns()

    def native_spans(self) -> list:
        return self._core.spans()

    def close(self) -> None:
        self._core.stop()


def native_status() -> str:
    """"" when the native core is built and loads, else why not."""
    try:
        from . import _native  # noqa: F401
    except ImportError as exc:
        return f"the native core is not built ({exc})"
    return ""
