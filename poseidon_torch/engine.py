"""Wait-free backpropagation: hooks -> ready -> channel -> ``path.sync(bucket)`` -> barrier.

The per-iteration state machine lives here, in one place:
- a *synced forward* is the wrapper's forward with grad enabled, outside ``no_sync``. It joins the
  current *round* (the synced forwards since the last synced backward; a new round begins at the first
  synced forward after one) and hangs a gradient hook on its outputs: the decision travels with the
  graph, so a later no_grad or no_sync forward cannot change what this graph's backward does;
- a *pass* is one backward (one autograd graph task) that accumulates into the parameters. It is
  *synced* when it runs through the outputs of a synced forward (their hook fired in it), or, as torch
  DDP would, when nothing says otherwise and the latest grad-enabled forward was synced and its round
  not yet backpropagated. A pass that is not synced is local: what it accumulates is marked dirty and
  is synced by the next synced pass (the no_sync session);
- in a synced pass every bucket is synced exactly once: when all its gradients (or, for an FC layer on
  SFB, its factors) are ready, else when the pass ends. The pass ends with the facts exchange and the
  BSP barrier, queued on the autograd engine, so ``backward()`` returns only when every sync is done;
- a pass that never reached its end (an exception in backward) is found open by the next forward,
  which finishes it as *aborted*: every remaining bucket still runs its collectives, so all ranks stay
  in step, but nothing is written back, and a peer that did finish its backward raises a
  ``SyncError`` saying so instead of waiting for a timeout;
- ``torch.autograd.grad`` never starts a sync: it accumulates nothing.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .barrier import BSPBarrier, SyncError
from .bucket import Bucket, JobCost, Layer, build_buckets, find_layers, group_layers, readiness_order
from .coordinator import PS, SFB, Coordinator, PassFacts
from .kvstore import PSPath, ps_messages
from .link import LinkModel, theil_sen
from .pools import ChannelGroups, Groups, StreamPool, SyncChannel, assign_round_robin
from .sfb import FCLayer, SFBPath, fc_layers
from .trace import Recorder

FACTS = "facts"
#: Before the first backward, neighbouring layers are fused up to this size (the buckets are then
#: rebuilt from the measured order and timings).
INITIAL_FUSION_BYTES = 256 * 1024


@dataclass
class CommStats:
    """Bytes this rank handed to torch.distributed for gradient sync, and sync jobs run."""

    bytes_sent_last_iteration: int = 0
    bytes_sent_total: int = 0
    iterations: int = 0
    jobs_last_iteration: int = 0
    bytes_by_bucket: dict[str, int] = field(default_factory=dict)
    bytes_by_path: dict[str, int] = field(default_factory=dict)  #: last iteration; "facts" = the exchange
    outcome_by_bucket: dict[str, str] = field(default_factory=dict)  #: last iteration: PS, SFB or SFB->PS


@dataclass(frozen=True)
class SyncContext:
    """What one sync job needs to know about its pass."""

    path: str
    task: int           #: the backward pass (graph task) whose factors to send
    aborted: bool       #: this rank's backward was aborted: send, but keep nothing
    shadow: bool        #: this rank has joined (uneven inputs): send zeros, keep nothing
    k_pad: int = 0      #: rows per rank the SFB all-gather makes room for


class Round:
    """Identity of a round of synced forwards."""

    __slots__ = ()


@dataclass(eq=False)
class Pass:
    round: Round | None
    task: int
    shadow: bool = False
    aborted: bool = False
    began_ns: int = field(default_factory=time.monotonic_ns)
    last_ready_ns: int = 0
    order: list[int] = field(default_factory=list)     #: parameter positions in readiness order
    order_ns: list[int] = field(default_factory=list)
    local_facts: torch.Tensor | None = None
    gathered: torch.Tensor | None = None


def drive(phases: Generator[str, None, object]) -> object:
    """Run a sync job's phases to the end; its result."""
    while True:
        try:
            next(phases)
        except StopIteration as stop:
            return stop.value


class Engine:
    """Buckets, their readiness, the channels that sync them and the barrier that ends a pass."""

    def __init__(self, module: nn.Module, *, groups: Groups, chunk_bytes: int, fusion_bytes: int,
                 timeout: float, staged: bool, recorder: Recorder, hybrid: bool, link: LinkModel,
                 gemm_flops: float, overrides: dict[str, str] | None) -> None:
        self.rank, self.world_size = groups.control.rank, groups.control.size
        self.timeout, self.staged, self.recorder = timeout, staged, recorder
        self.fusion_bytes = fusion_bytes
        self.link = link
        self._control = groups.control
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.layers = find_layers(module)
        self._position = {id(p): i for i, p in enumerate(p for layer in self.layers for _, p in layer.params)}
        self.fc: dict[str, FCLayer] = {}
        if hybrid and self.world_size > 1:
            self.fc = fc_layers(self.layers, module, self.in_forward, self.in_synced_forward)
        self.coordinator = Coordinator(self.fc, self.world_size, link, gemm_flops, overrides)
        self.coordinator.check_overrides([layer.name for layer in self.layers])
        for layer in self.fc.values():
            layer.on_factors = self._on_factors
        self.stats = CommStats()
        self.barrier = BSPBarrier(self._describe)
        self._ps = PSPath(self.rank, self.world_size, chunk_bytes)
        device = self.layers[0].params[0][1].device if self.layers else torch.device("cpu")
        #: the sync of a bucket, per path name: ``sync(bucket, groups, ctx)`` yields its phases
        self.paths = {PS: self._ps, SFB: SFBPath(self._ps, self.world_size, torch.device("cpu") if staged else device)}
        self._streams = StreamPool(device, len(groups.channels)) if device.type == "cuda" else None
        self.channels = [SyncChannel(i, channel, self._run_job, self.barrier.fail)
                         for i, channel in enumerate(groups.channels)]
        self._lanes = [f"channel-{c.index}" for c in self.channels]
        self._round: Round | None = None
        self._latest_forward_synced = False
        self._armed: dict[int, Round] = {}  # graph task -> round, for synced backwards now running
        self._backward_start_ns = 0  # when the last synced backward reached the outputs
        self._pass: Pass | None = None
        self._contexts: dict[int, SyncContext] = {}
        self._learned = False
        self._never_used = {id(p) for layer in self.layers for _, p in layer.params}  #: by any rank, so far
        self.closed = False
        self.buckets: list[Bucket] = []
        groups = group_layers(list(reversed(self.layers)), min(fusion_bytes, INITIAL_FUSION_BYTES),
                              self.coordinator.wanted_solo())
        self._install(build_buckets(groups, staged, self._fc_of))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_accumulated)
                       for layer in self.layers for _, p in layer.params]

    # ---- buckets -------------------------------------------------------------------------------

    def _fc_of(self, layer: Layer) -> FCLayer | None:
        return self.fc.get(layer.name)

    def _install(self, buckets: list[Bucket]) -> None:
        """Make ``buckets`` current: slots, PS schedules, channel schedules (between passes only)."""
        old = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        for bucket in buckets:
            for j, p in enumerate(bucket.params):
                if id(p) in old:
                    previous, i = old[id(p)]
                    bucket.dirty[j] = previous.dirty[i]
        self.buckets = buckets
        self._slot = {id(p): (b, j) for b in buckets for j, p in enumerate(b.params)}
        self._fc_bucket = {b.fc.name: b for b in buckets if b.fc is not None}
        self.coordinator.solo = set(self._fc_bucket)
        self._ps.prepare(buckets)
        self._profile_names = {(b.index, path): f"poseidon.sync.{path}.{b.name}" for b in buckets for path in (PS, SFB)}
        schedules = assign_round_robin(list(range(len(buckets))), len(self.channels))
        schedules[0].append(FACTS)
        self._channel_of = {}
        for channel, keys in zip(self.channels, schedules):
            channel.set_schedule(keys)
            self._channel_of.update((key, channel) for key in keys)

    def _describe(self, key: Hashable) -> str:
        return "the end-of-pass facts exchange" if key == FACTS else f"bucket {self.buckets[key].name!r}"

    # ---- the training thread: forward ----------------------------------------------------------------

    def in_forward(self) -> bool:
        return getattr(self._tls, "depth", 0) > 0

    def in_synced_forward(self) -> bool:
        return self.in_forward() and self._tls.synced

    def begin_forward(self, synced: bool) -> None:
        """A forward of the wrapper begins; ``synced``: grad enabled and not inside ``no_sync``."""
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("PoseidonDDP's forward ran inside a backward pass (activation checkpointing around "
                               "the whole wrapper?); checkpoint blocks of the inner module instead")
        self.finish_aborted_pass()
        if self.barrier.failure is not None:
            raise SyncError(f"PoseidonDDP cannot continue after a failed sync: {self.barrier.failure}") \
                from self.barrier.failure
        if torch.is_grad_enabled():
            self._latest_forward_synced = synced
        if synced and self._round is None:
            self._round = Round()
            for name, layer in self.fc.items():
                layer.begin_round(self.coordinator.commits(name))
            self.recorder.start_iteration()
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        self._tls.synced = synced

    def end_forward(self) -> None:
        """The forward ended (or raised): put back any detached parameter."""
        self._tls.depth -= 1
        if self._tls.depth == 0:
            for layer in self.fc.values():
                layer.reset_calls()

    def arm(self, output: object) -> None:
        """Hang the round on the outputs of a synced forward: a backward through them syncs."""
        hook = _Arm(self, self._round)
        tensors, _ = tree_flatten(output)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    # ---- autograd side: events ---------------------------------------------------------------------

    def _armed_by(self, round_: Round | None) -> None:
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task in self._armed or round_ is None:
                return
            self._armed[task] = round_
            self._backward_start_ns = time.monotonic_ns()
        torch.autograd.Variable._execution_engine.queue_callback(partial(self._task_ended, task))

    def _on_accumulated(self, param: nn.Parameter) -> None:
        task = torch._C._current_graph_task_id()
        with self._lock:
            bucket, j = self._slot[id(param)]
            p = self._pass_for(task)
            if p is None:
                bucket.dirty[j] = True
                return
            self._note_ready(p, param)
            ready = bucket.arrive(j)
            if ready:
                bucket.submitted = True
        if ready:
            self._submit(bucket, p)

    def _on_factors(self, layer: FCLayer, witness: torch.Tensor) -> None:
        """Every call of a detached FC layer that this backward reached has its output gradient."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            p = self._pass_for(task)
            bucket = self._fc_bucket.get(layer.name)
            if p is None or bucket is None or witness is not layer.witness:
                return
            for acc, param in zip(layer.accumulators, layer.params):
                j = bucket.position[id(param)]
                if not bucket.seen[j] and torch._C._will_engine_execute_node(acc):
                    bucket.pending.add(j)  # W or b is also used outside the captured calls: wait for it
                self._note_ready(p, param)
            ready = bucket.arrive("factors")
            if ready:
                bucket.submitted = True
        if ready:
            self._submit(bucket, p)

    def _pass_for(self, task: int) -> Pass | None:
        """The synced pass an accumulation in graph task ``task`` belongs to (opened if need be), or
        None when the backward is local (lock held)."""
        if self._pass is not None:
            return self._pass
        if self._armed:  # a synced backward is running: this task is it, or nested in it (reentrant)
            root = task if task in self._armed else next(reversed(self._armed))
            return self._open(self._armed[root], root, queue_end=False)
        if self._latest_forward_synced and self._round is not None:  # torch DDP's rule
            return self._open(self._round, task, queue_end=True)
        return None

    def _open(self, round_: Round | None, task: int, queue_end: bool, shadow: bool = False) -> Pass:
        p = Pass(round_, task, shadow=shadow)
        p.last_ready_ns = self._backward_start_ns or p.began_ns
        self._backward_start_ns = 0
        for bucket in self.buckets:
            layer = bucket.fc
            committed = layer is not None and layer.witness is not None
            bucket.begin_pass({"factors"} if committed else set(range(len(bucket.params))))
        self.barrier.expect([*range(len(self.buckets)), FACTS])
        self._pass = p
        if queue_end:
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._task_ended, task))
        return p

    def _note_ready(self, p: Pass, param: nn.Parameter) -> None:
        if self.rank == 0:
            p.order.append(self._position[id(param)])
            p.order_ns.append(time.monotonic_ns() - p.began_ns)

    def _task_ended(self, task: int) -> None:
        """End of an autograd graph task whose backward was synced, or that opened a pass."""
        with self._lock:
            self._armed.pop(task, None)
            p = self._pass
        if p is not None and p.task == task:
            self._finish(p)

    # ---- the pass: submit, finish ---------------------------------------------------------------

    def _submit(self, bucket: Bucket, p: Pass) -> None:
        if bucket.ready_event is not None:
            bucket.ready_event.record()
        if self.recorder.active:
            now = time.monotonic_ns()
            self.recorder.add("backward", bucket.name, "compute", p.last_ready_ns, now)
            p.last_ready_ns = now
        path = self.coordinator.path_of(bucket)
        k_pad = self.coordinator.k_pad(bucket) if path == SFB else 0
        self._contexts[bucket.index] = SyncContext(path, p.task, p.aborted, p.shadow, k_pad)
        self._channel_of[bucket.index].submit(bucket.index)

    def _finish(self, p: Pass) -> None:
        """Submit what is not yet (parameters some rank did not use), the facts, and wait."""
        with self._lock:
            rest = [b for b in self.buckets if not b.submitted]
            for bucket in rest:
                bucket.submitted = True
        for bucket in rest:
            self._submit(bucket, p)
        self._channel_of[FACTS].submit(FACTS)
        try:
            self.barrier.wait(self.timeout)
        finally:
            if self.barrier.failure is not None:
                with self._lock:
                    self._pass = None
        self._close(p)

    def _close(self, p: Pass) -> None:
        """After the barrier: device ordering, late gradients, the next plan, learning, stats."""
        if self._streams is not None:
            for bucket in self.buckets:
                torch.cuda.current_stream().wait_event(bucket.done_event)
        facts = self.coordinator.observe(p.gathered, len(self.buckets))
        late = [b for b, is_late in zip(self.buckets, facts.late) if is_late]
        for bucket in late:  # a gradient arrived after its bucket's sync: average what .grad holds now
            drive(self._ps.sync(bucket, self.channels[0].groups, SyncContext(PS, p.task, p.aborted, p.shadow)))
        self._update_stats(p, late)
        if not facts.aborted:
            self._learn_if_needed(p)
        with self._lock:
            self._pass = None
            if self._round is p.round:
                self._round = None
        self.recorder.end_iteration()
        if facts.aborted and not p.aborted:
            raise SyncError("a peer's backward was aborted (an exception on that rank) in this step: no gradient "
                            "was averaged, local gradients are kept unsynced; skip the step on every rank")

    def finish_aborted_pass(self) -> None:
        """A pass still open at the next forward was aborted (its backward raised): finish it so every
        rank's collectives stay in step, keeping nothing."""
        with self._lock:
            p = self._pass
            self._armed.clear()
            if p is None:
                return
            p.aborted = True
        self._finish(p)

    def shadow_pass(self) -> None:
        """Take part in a pass of the other ranks with nothing to contribute (a joined rank)."""
        self.finish_aborted_pass()
        with self._lock:
            p = self._open(None, -1, queue_end=False, shadow=True)
        self._finish(p)

    # ---- sync jobs (channel threads) --------------------------------------------------------------

    def _run_job(self, key: Hashable, groups: ChannelGroups, ready_ns: int) -> None:
        if key == FACTS:
            self._exchange_facts()
        else:
            self._sync(self.buckets[key], groups, ready_ns)
        self.barrier.arrive(key)

    def _sync(self, bucket: Bucket, groups: ChannelGroups, ready_ns: int) -> None:
        ctx = self._contexts[bucket.index]
        path = self.paths[ctx.path]
        channel = self._channel_of[bucket.index].index
        start = time.monotonic()
        with torch.profiler.record_function(self._profile_names[bucket.index, ctx.path]), \
                self._device_stream(bucket, channel) as stream:
            phases = path.sync(bucket, groups, ctx)
            if self.recorder.active:
                self.recorder.run_job(phases, bucket.name, self._lanes[channel], ready_ns, ctx.path,
                                      lambda: bucket.bytes_sent)
            else:
                drive(phases)
            if stream is not None:
                bucket.done_event.record(stream)
        bucket.sync_seconds = time.monotonic() - start

    @contextlib.contextmanager
    def _device_stream(self, bucket: Bucket, channel: int):
        if self._streams is None:
            yield None
            return
        stream = self._streams.for_channel(channel)
        stream.wait_event(bucket.ready_event)
        with torch.cuda.stream(stream):
            yield stream

    def _exchange_facts(self) -> None:
        """On channel 0, once every bucket of the pass has synced (their jobs may raise sticky flags);
        the training thread does not use ``control`` meanwhile (it waits in the barrier)."""
        p = self._pass
        self.barrier.wait(self.timeout, but=FACTS)
        mine = p.local_facts = self.coordinator.facts(p.aborted, [b.late for b in self.buckets])
        everyone = torch.empty(self.world_size * mine.numel(), dtype=torch.int64)
        self._control.all_gather(everyone, mine)
        p.gathered = everyone.view(self.world_size, -1)

    # ---- after the pass -----------------------------------------------------------------------------

    def _update_stats(self, p: Pass, late: list[Bucket]) -> None:
        by_path = {PS: 0, SFB: 0, FACTS: (self.world_size - 1) * p.local_facts.numel() * 8}
        for bucket in self.buckets:
            by_path[self._contexts[bucket.index].path] += bucket.bytes_sent
        for bucket in late:
            by_path[PS] += self._ps.bytes_sent(bucket)
        total = sum(by_path.values())
        stats = self.stats
        stats.bytes_sent_last_iteration = total
        stats.bytes_sent_total += total
        stats.iterations += 1
        stats.jobs_last_iteration = len(self.buckets) + len(late)
        stats.bytes_by_bucket = {b.name: b.bytes_sent for b in self.buckets}
        stats.outcome_by_bucket = {b.name: b.outcome for b in self.buckets}
        stats.bytes_by_path = by_path

    def _learn_if_needed(self, p: Pass) -> None:
        """Rebuild the buckets from the readiness order of this pass (rank 0's, the same everywhere):
        once, and again only when a parameter no rank had used before gets a gradient."""
        grew = False
        for param_id in list(self._never_used):
            bucket, j = self._slot[param_id]
            if bucket.used_anywhere[j]:
                self._never_used.discard(param_id)
                grew = True
        if self._learned and not grew:
            return
        mine = (p.order, p.order_ns, self._job_cost()) if self.rank == 0 else None
        order, order_ns, cost = self._control.broadcast_object(mine, src=0)
        layers, ready_s = readiness_order(self.layers, order, [t / 1e9 for t in order_ns])
        groups = group_layers(layers, self.fusion_bytes, self.coordinator.wanted_solo(), ready_s, cost)
        self._install(build_buckets(groups, self.staged, self._fc_of))
        self._learned = True

    def _job_cost(self) -> JobCost:
        """Seconds per sync job of a bucket of n bytes, fitted (Theil-Sen) to what this pass's jobs
        took: latency, software and bandwidth as they really are, contention with backward included.
        Too few distinct sizes, or a fit that does not grow with the size, fall back to the link model."""
        link_cost = JobCost(self.link.alpha_s * ps_messages(self.world_size),
                            self.link.beta_s_per_byte * 2 * (self.world_size - 1) / self.world_size)
        with contextlib.suppress(ValueError):
            alpha, beta = theil_sen([b.nbytes for b in self.buckets], [b.sync_seconds for b in self.buckets])
            if beta > 0:
                return JobCost(max(alpha, link_cost.alpha_s), beta)
        return link_cost

    # ---- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for hook in self._hooks:
            hook.remove()
        for layer in self.fc.values():
            layer.remove()
        for channel in self.channels:
            channel.stop()


class _Arm:
    """The gradient hook on a synced forward's outputs: this backward syncs."""

    __slots__ = ("engine", "round")

    def __init__(self, engine: Engine, round_: Round | None) -> None:
        self.engine, self.round = engine, round_

    def __call__(self, grad: torch.Tensor) -> None:
        if not self.engine.closed:
            self.engine._armed_by(self.round)
