"""Wait-free backpropagation: hooks -> ready -> channel -> a bucket's job -> barrier.

The engine owns the per-iteration state machine, in one place; the *core* (``core.py``, Python or
native) owns what happens per parameter and per bucket inside a pass; the *paths* (``paths/``) move a
bucket's gradient; the *mode* (``modes/``), resolved once before the engine starts, decides what happens
at the state machine's fixed points. The engine names no path and no mode.
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
  a factor path, its factors) are ready, else when the pass ends. At its end, queued on the autograd
  engine, the pass exchanges its facts (see the coordinator) while the last jobs run and waits for every
  job (the barrier), so ``backward()`` returns only when every sync is done;
- a pass that never reached its end (an exception in backward) is found open by the next forward,
  which finishes it as *aborted*: every remaining bucket still runs its collectives, so all ranks stay
  in step, but nothing is written back, and a peer that did finish its backward raises a
  ``SyncError`` saying so instead of waiting for a timeout;
- ``torch.autograd.grad`` never starts a sync: it accumulates nothing;
- where the mode ``defers`` a clean pass, ``backward()`` returns while its jobs run and the pass
  *settles* (every job done, drained, closed) at the end of the next synced forward, or, for a mode that
  ``settles_in_next_pass``, when the next synced pass opens (its first gradient, in the next backward),
  since that pass needs the core, the buckets and the plan; a ``barrier_free`` mode does not even wait
  for the facts: they are read when the pass drains, and a pass in which some ranks, not all, raised (or
  got a late gradient) ends the engine there, on every rank, with the mode's ``SyncError`` naming them;
- a mode that is not ``lockstep`` runs every rank on its own clock: a pass knows only its own facts (no
  exchange) and the buckets are fused once, when the engine starts;
- a mode that does not sync gradients opens no pass in any backward (every one is local); it runs a
  pass over every bucket where it chooses, outside any backward (:meth:`Engine.sync_now`, collective),
  its jobs staging what it sends.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .barrier import SyncError, SyncTimeout
from .bucket import Bucket, JobCost, Layer, build_buckets, find_layers, group_layers, readiness_order
from .coordinator import Coordinator, PassFacts
from .core import NativeCore, PythonCore, raise_outcome
from .fc import FCLayer, fc_layers
from .graph import hook_target
from .link import LinkModel, theil_sen
from .modes import Mode
from .paths import GradWriter, Job, PathEnv, Paths, SyncContext, drive
from .pools import Groups, StreamPool, started_at_lower_priority
from .schedule import ChannelPlan, Halves, plan_channels
from .stats import CommStats
from .trace import Recorder


class Round:
    """Identity of a round of synced forwards, when it began (the tracer's iteration starts there) and
    its tracer iteration (None: not recorded)."""

    __slots__ = ("began_ns", "traced")

    def __init__(self, traced: int | None = None) -> None:
        self.began_ns = time.monotonic_ns()
        self.traced = traced


@dataclass(eq=False)
class Pass:
    round: Round | None
    task: int
    shadow: bool = False
    aborted: bool = False
    #: when its backward reached the outputs of a synced forward (else when the pass opened): a
    #: deferred pass is recorded after the next backward began
    began_ns: int = field(default_factory=time.monotonic_ns)
    contexts: list[SyncContext] = field(default_factory=list)


@dataclass(eq=False)
class FactsExchange:
    """Every rank's end-of-pass facts, one row each, in flight (``work`` None: this rank's only)."""

    everyone: torch.Tensor
    work: Any = None


@dataclass(eq=False)
class Deferred:
    """A synced pass whose backward returned while its jobs may still run; it closes when it settles.
    Under a barrier-free mode its ``facts`` are read from ``exchange`` when it drains; ``error``: the pass
    ends the engine then (some ranks had trouble in it while the others stepped)."""

    pass_: Pass
    facts: PassFacts | None
    exchange: FactsExchange | None = None
    error: SyncError | None = None
    drained: bool = False
    #: its averages are where the mode holds them (:meth:`Engine.flush`): what remains is its close
    written: bool = False


@dataclass
class _Slot:
    """What one slot of a bucket's job runs: its pass's context, when it was due, its phases (and, for
    a split job, both halves)."""

    ctx: SyncContext
    ready_ns: int
    phases: Generator[str, None, object]
    halves: Halves | None = None


class LiveGrads:
    """The parameters' ``.grad`` as a closing pass's writer: ``scatter`` is the core's (it also marks the
    bucket synced)."""

    def __init__(self, scatter: Callable[[Bucket], None]) -> None:
        self.scatter = scatter

    def add(self, layer: FCLayer, grads: tuple[torch.Tensor, ...]) -> None:
        layer.add_to_grad(grads)


class Engine:
    """The state machine of passes over a core, the paths that sync buckets, the bucket plan, and the
    mode that decides what happens at its fixed points."""

    def __init__(self, module: nn.Module, *, groups: Groups, chunk_bytes: int, fusion_bytes: int,
                 timeout: float, staged: bool, recorder: Recorder, hybrid: bool, link: LinkModel,
                 gemm_flops: float | None, overrides: dict[str, str], native: bool, mode: Mode,
                 memory_bps: float | None = None, compression: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.rank, self.world_size = groups.control.rank, groups.control.size
        self.mode = mode  #: the consistency model, for the engine's lifetime (``modes/``)
        self.timeout, self.staged, self.recorder = timeout, staged, recorder
        self.fusion_bytes, self.link = fusion_bytes, link
        self.control = groups.control  #: the wrapper's control collectives (small objects, host tensors)
        self.module = module
        self._channels = groups.channels
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._settling = threading.Lock()  #: a deferred pass settling on an autograd thread (see _settle_if_opening)
        self._live = LiveGrads(lambda bucket: self.core.scatter(bucket))
        self.layers = find_layers(module)
        self.params = [p for layer in self.layers for _, p in layer.params]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.fc: dict[str, FCLayer] = {}
        if hybrid and self.world_size > 1:
            self.fc = fc_layers(self.layers, module, self.in_forward, self.in_synced_forward)
        #: the registered paths by name (``paths/``)
        compression = dict(compression or {})
        self.paths = Paths.build(PathEnv(self.rank, self.world_size, chunk_bytes,
                                         torch.device("cpu") if staged else device, settings=compression))
        self._default = self.paths.default  #: late gradients are synced again through it; the core runs it
        self.coordinator = Coordinator(self.fc, self.world_size, link, gemm_flops, overrides, self.paths,
                                       layers=self.layers, lossy=tuple(compression), memory_bps=memory_bps,
                                       pipelined=mode.barrier_free)
        self._streams = StreamPool(device, len(self._channels)) if device.type == "cuda" else None
        self._lanes = [f"channel-{i}" for i in range(len(self._channels))]
        make = NativeCore if native and device.type == "cpu" else PythonCore
        self.core = started_at_lower_priority(mode.sync_nice, lambda: make(
            self.params, self._channels, self._run_job, self._on_idle, self._stage, record_order=self.rank == 0))
        for layer in self.fc.values():
            layer.on_factors = self._on_factors
        self._round: Round | None = None
        self._latest_forward_synced = False
        recorder.layout = self.layout
        self._armed: dict[int, Round] = {}  # graph task -> round, for synced backwards now running
        self._backward_start_ns = 0  # when the last synced backward reached the outputs
        self._pass: Pass | None = None
        self._jobs_pass: Pass | None = None  #: the pass whose jobs run (or ran last)
        self._learned = not mode.lockstep  #: ranks on their own clocks cannot learn buckets from a common step
        self._halves: dict[int, _Slot] = {}  #: split jobs whose second slot is due
        self._never_used = {id(p) for p in self.params}  #: by any rank, so far
        self._deferred: Deferred | None = None
        self._facts_bytes = 0
        self.stats = CommStats()
        self.failure: SyncError | None = None
        self.closed = False
        self.buckets: list[Bucket] = []
        mode.attach(self)
        groups = group_layers(list(reversed(self.layers)), min(fusion_bytes, mode.first_fusion_bytes),
                              self.coordinator.wanted_solo())
        self._install(build_buckets(groups, staged, self._fc_of))

    # ---- buckets -------------------------------------------------------------------------------

    def layout(self) -> dict:
        """What a simulator needs of this model (:mod:`poseidon_torch.simulate`): the buckets in sync
        order, each layer's parameter bytes and tensors' shapes and, for an FC layer, its shape and the
        largest rows per rank of the last pass it was watched in (alone in a bucket; a layer never watched
        has no FC shape: its K is unknown); what the mode says of its forwards; the link, GEMM rate and
        memory bandwidth (probed only with ``compression=``) the coordinator costs with."""
        def describe(layer: Layer) -> dict:
            fc = self.fc.get(layer.name)
            k = self.coordinator.k_known.get(layer.name)
            shape = {"m": fc.m, "n": fc.n, "k": k} if fc is not None and k else None
            return {"name": layer.name, "bytes": layer.nbytes, "tensors": len(layer.params), "fc": shape,
                    "shapes": [list(p.shape) for _, p in layer.params]}
        return {"element_size": self.params[0].element_size() if self.params else 4, **self.mode.layout(),
                "gemm_flops": self.coordinator.gemm_flops, "memory_bps": self.coordinator.memory_bps,
                "link": {"alpha_s": self.link.alpha_s, "beta_s_per_byte": self.link.beta_s_per_byte},
                "buckets": [{"name": b.name, "layers": [describe(layer) for layer in b.layers]} for b in self.buckets]}

    def _fc_of(self, layer: Layer) -> FCLayer | None:
        return self.fc.get(layer.name)

    def _install(self, buckets: list[Bucket], ready_s: dict[str, float] | None = None) -> None:
        """Make ``buckets`` current (learned from a pass whose layers' gradients were ready at ``ready_s``,
        or not learned): the coordinator's, the paths' plans, the mode's, the core's slots and channel
        schedules (between passes only). Dirty flags carry over."""
        old = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        for bucket in buckets:
            for j, p in enumerate(bucket.params):
                if id(p) in old:
                    previous, i = old[id(p)]
                    bucket.dirty[j] = previous.dirty[i]
        self.mode.buckets_changing()
        self.buckets = buckets
        self._slot = {id(p): (b, j) for b in buckets for j, p in enumerate(b.params)}
        self._fc_bucket = {b.fc.name: b for b in buckets if b.fc is not None}
        for name, layer in self.fc.items():
            layer.watching = name in self._fc_bucket
        self.coordinator.buckets_changed(buckets, self._learned, ready_s)
        for path in self.paths.values():
            path.prepare(buckets)
        self.mode.buckets_changed(buckets)
        self._replan()
        self._profile_names = {(b.index, path): f"poseidon.sync.{path}.{b.name}" for b in buckets for path in self.paths}

    def _replan(self) -> None:
        """The channel plan again, and the core's slots (between passes): which jobs the mode splits."""
        self.plan = self._channel_plan(len(self.buckets))
        self.core.install(self.buckets, self._default, self.plan)

    def _channel_plan(self, buckets: int) -> ChannelPlan:
        """Which slots each channel runs; the mode says which jobs are cut at their update."""
        return plan_channels(buckets, len(self._channels), self.mode.split_buckets(buckets))

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        """The bucket that syncs ``param``."""
        return self._slot[id(param)][0]

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
        self._refuse_if_failed()
        if torch.is_grad_enabled():
            self._latest_forward_synced = synced
        self.mode.before_forward()
        if synced and self._round is None:
            self._round = Round(self.recorder.start_iteration())
            for name, layer in self.fc.items():
                layer.begin_round(self.coordinator.commits(name))
        self._update_ask()
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
                hook_target(t, same_elements=False).register_hook(hook)

    def _update_ask(self) -> None:
        """The core asks before treating an accumulation outside a pass as local exactly when a synced
        pass may be starting (lock held or single-threaded)."""
        self.core.set_ask(self._synced_pass_may_start())

    def _synced_pass_may_start(self) -> bool:
        """An accumulation outside a pass now opens a synced one (see :meth:`_pass_for`; lock held)."""
        return bool(self._armed) or (self._latest_forward_synced and self._round is not None)

    # ---- autograd side: events ---------------------------------------------------------------------

    def _armed_by(self, round_: Round | None) -> None:
        if self._deferred is not None and round_ is not self._round:  # not through this round's forwards
            raise RuntimeError(f"PoseidonDDP: a second synced backward before the next forward: {self.mode.deferral} "
                               "each synced backward is one optimizer step (its sync runs on after it); "
                               "accumulate with no_sync() or run one backward per forward")
        self.mode.before_backward(self.params)
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task in self._armed or round_ is None:
                return
            self._armed[task] = round_
            self._backward_start_ns = time.monotonic_ns()
            self._update_ask()
        torch.autograd.Variable._execution_engine.queue_callback(partial(self._task_ended, task))

    def _on_idle(self, param: int) -> None:
        """Parameter ``param`` accumulated while no pass was open, in ask mode (core's call)."""
        self._settle_if_opening()
        with self._lock:
            opened = self._pass_for(torch._C._current_graph_task_id()) is not None
        if opened:
            self.core.arrive_param(param)
        else:
            self.core.set_dirty(param)

    def _on_factors(self, layer: FCLayer, witness: torch.Tensor) -> None:
        """Every call of a detached FC layer that this backward reached has its output gradient."""
        task = torch._C._current_graph_task_id()
        self._settle_if_opening()
        with self._lock:
            p = self._pass_for(task)
            bucket = self._fc_bucket.get(layer.name)
            if p is None or bucket is None or witness is not layer.witness:
                return
        # W or b also used outside the captured calls in this backward: wait for them too
        more = [bucket.position[id(param)] for acc, param in zip(layer.accumulators, layer.params)
                if torch._C._will_engine_execute_node(acc)]
        self.core.arrive_factors(bucket.index, more)

    def _settle_if_opening(self) -> None:
        """A mode that ``settles_in_next_pass`` settles its deferred pass here, on the thread about to open
        the next synced pass, before that pass counts anything (its buckets, the plan and the job slots are
        the deferred pass's until it closes); outside the lock, which closing takes. Only where a pass
        opens: every rank settles at the same point of its sequence of collectives."""
        if self._deferred is None or self.failure is not None or not self.mode.settles_in_next_pass:
            return
        with self._lock:
            opening = self._pass is None and self._synced_pass_may_start()
        if opening:
            with self._settling:
                self.settle()

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
        for bucket in self.buckets:
            bucket.begin_pass()
        for layer, bucket in self._fc_buckets():
            layer.note_pass_start(bucket)
        p = Pass(round_, task, shadow=shadow, began_ns=self._backward_start_ns or time.monotonic_ns())
        self._backward_start_ns = 0
        p.contexts = [self._context(b, p) for b in self.buckets]
        committed = [b.fc is not None and b.fc.witness is not None for b in self.buckets]
        # the core may run a job itself where it is the native path's own (not a joined rank's shadow job)
        # and stages nothing another path owes the bucket (that goes through _stage)
        native = [self._job(ctx.path).native and not shadow and not self.paths.owed(b, ctx.path)
                  for b, ctx in zip(self.buckets, p.contexts)]
        self.mode.pass_opened()
        self.core.begin_pass(committed, native, self._traced(p) is not None)
        self._pass = self._jobs_pass = p
        if queue_end:
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._task_ended, task))
        return p

    def _context(self, bucket: Bucket, p: Pass) -> SyncContext:
        path = self.coordinator.path_of(bucket, p.shadow)
        k_pad = self.coordinator.k_pad(bucket) if self.paths[path].factors else 0
        return SyncContext(path, p.task, p.aborted, p.shadow, k_pad)

    def _task_ended(self, task: int) -> None:
        """End of an autograd graph task whose backward was synced, or that opened a pass."""
        with self._lock:
            self._armed.pop(task, None)
            p = self._pass
        if p is not None and p.task == task:
            self._finish(p)

    # ---- the pass: finish ----------------------------------------------------------------------

    def _fc_buckets(self) -> Iterator[tuple[FCLayer, Bucket]]:
        return ((bucket.fc, bucket) for bucket in self._fc_bucket.values())

    def _finish(self, p: Pass) -> None:
        """Submit what is not yet (parameters some rank did not use); the pass's facts are final now
        (no more gradients will arrive): exchange them while the last jobs run; wait for every job;
        close the pass. Where the mode defers a pass, unless something was aborted or late, the jobs go
        on after ``backward()`` returns: the pass is deferred (see :meth:`drain`); a barrier-free mode
        does not wait for the facts either. Then the mode says what ``.grad`` holds."""
        self.core.finish(p.aborted)
        for layer, bucket in self._fc_buckets():
            layer.note_pass_end(bucket)
        late_here = [self.core.late(b.index) for b in self.buckets]
        exchange = self._start_facts_exchange(
            self.coordinator.facts(p.aborted, late_here, [not self.core.done(b.index) for b in self.buckets]))
        may_defer = not p.aborted and self.mode.defers(self._learned)
        if may_defer and self.mode.barrier_free and not any(late_here):
            self._defer(p, None, exchange)
            return
        if not may_defer:
            self._wait_for_jobs(p)
        facts = self._read_facts(p, exchange)
        self.coordinator.plan_next()  # read before backward returns: the next forwards commit to this plan
        split = self.mode.split_pass_error(facts)
        if split is not None:  # raised when the pass settles, where the other ranks find it too
            self._wait_for_jobs(p)
            self._defer(p, facts, None, split)
            return
        self.mode.facts_known(facts.aborted)
        if may_defer and not facts.aborted and not any(facts.late):
            self._defer(p, facts, None)
            return
        if may_defer:
            self._wait_for_jobs(p)
        self.mode.jobs_done(facts)
        self._write(p, facts, self.mode.writer(self._live, settling=False))
        self._close(p, facts)
        if not (p.aborted or p.shadow):
            self.mode.backward_returned(self.buckets, averaged=True)

    def _start_facts_exchange(self, mine: torch.Tensor) -> FactsExchange:
        if not self.mode.lockstep:  # ranks on their own clocks: each pass knows its own facts only
            self._facts_bytes = 0
            return FactsExchange(mine.repeat(self.world_size))
        everyone = torch.empty(self.world_size * mine.numel(), dtype=torch.int64)
        self._facts_bytes = (self.world_size - 1) * mine.numel() * 8
        return FactsExchange(everyone, self.control.start_small_all_gather(everyone, mine))

    def _read_facts(self, p: Pass, exchange: FactsExchange) -> PassFacts:
        if exchange.work is not None:
            with self.recorder.waiting("facts"):
                self._guarded(p, partial(_collective_wait, "the end-of-pass facts exchange", exchange.work.wait))
        return self.coordinator.absorb(exchange.everyone.view(self.world_size, -1), len(self.buckets))

    def _defer(self, p: Pass, facts: PassFacts | None, exchange: FactsExchange | None,
               error: SyncError | None = None) -> None:
        """``backward()`` returns with ``p``'s jobs (or only its close) still to come: see :meth:`drain`."""
        self._deferred = Deferred(p, facts, exchange, error)
        self.mode.deferring()
        with self._lock:
            self._pass = None
            if self._round is p.round:
                self._round = None
            self._update_ask()
        if error is None:
            self.mode.backward_returned(self.buckets, averaged=False)

    def _wait_for_jobs(self, p: Pass) -> None:
        """Block until every sync job of ``p`` has run (traced as the training thread's wait)."""
        with self.recorder.waiting("jobs"):
            self._guarded(p, self._wait_jobs)

    def _wait_jobs(self) -> None:
        raise_outcome(*self.core.wait(self.timeout))

    def wait_for_peers(self, what: str, wait: Callable[[], object]) -> None:
        """Wait for a collective the wrapper issued outside any pass; its failure (a peer gone) ends
        the engine with a ``SyncError`` naming ``what``."""
        try:
            _collective_wait(what, wait)
        except SyncError as exc:
            self.failure = exc
            raise

    def _guarded(self, p: Pass, wait) -> None:
        """Run ``wait``; a SyncError ends this engine (collectives may be half issued) and the pass. A
        timeout says what the mode knows of the peers it waited for."""
        try:
            wait()
        except SyncError as exc:
            hint = self.mode.diagnosis() if isinstance(exc, SyncTimeout) else ""
            self.failure = SyncTimeout(f"{exc}; {hint}") if hint else exc
            with self._lock:
                if self._pass is p:
                    self._pass = None
            if self.failure is exc:
                raise
            raise self.failure from exc

    def fail(self, error: SyncError) -> None:
        """End the engine with ``error`` (a mode found the step cannot go on), and raise it."""
        self.failure = error
        raise error

    def _write(self, p: Pass, facts: PassFacts, grads: GradWriter | None) -> None:
        """After the barrier: device ordering, the averages into ``grads`` (None: nothing is written), late
        gradients (a deferred pass has none: it would not have been deferred) synced again."""
        if self._streams is not None:
            for bucket in self.buckets:
                torch.cuda.current_stream(bucket.device).wait_event(bucket.done_event)
        start, traced = time.monotonic_ns(), self._traced(p)
        self._write_averages(p, facts, grads)
        if traced is not None:
            self.recorder.add("scatter", "averages", "compute", start, time.monotonic_ns(), traced)
        late = self._late(facts)
        refused = self.mode.late_gradients(late) if late else None
        if refused is not None:
            self._close_pass(p)
            raise refused
        for bucket in late:  # a gradient arrived after its bucket's sync: average what .grad holds now
            ctx = SyncContext(self._default.name, p.task, p.aborted, p.shadow)
            self._default.stage(bucket, ctx)
            bucket.wait_staged()
            if drive(self._default.sync(bucket, self._channels[0], ctx)):
                grads.scatter(bucket)

    def _close(self, p: Pass, facts: PassFacts) -> None:
        """The pass is written: stats, tracing, the plan of the facts read when it drained, learning (may
        be collective); the pass ends."""
        traced = self._traced(p)
        self.stats.record(self.buckets, [ctx.path for ctx in p.contexts], self.paths, self._default.name,
                          self._late(facts), self._facts_bytes)
        if traced is not None:
            self._record_pass(p, traced)
        if not facts.aborted:
            self.coordinator.plan_next()
            if self.mode.pass_closed(facts, self._learned):
                self._replan()
            self._learn_if_needed()
        self._close_pass(p)
        # a deferred pass closes during the next round's forward: its iteration began with its own round
        self.recorder.end_iteration(traced, p.round.began_ns if p.round is not None else None,
                                    **self.mode.trace_args())
        if facts.aborted and not (p.aborted or p.shadow):  # a joined rank has no step to skip
            peers = ", ".join(map(str, facts.aborted_ranks))
            raise SyncError(f"the backward of rank(s) {peers} was aborted (an exception on that rank) in this step: "
                            "no gradient was averaged, local gradients are kept unsynced; skip the step on every rank")

    def _late(self, facts: PassFacts) -> list[Bucket]:
        return [b for b, is_late in zip(self.buckets, facts.late) if is_late]

    def _write_averages(self, p: Pass, facts: PassFacts, grads: GradWriter | None) -> None:
        """What each bucket's path left, into ``grads`` (``.grad``, or where the mode holds a deferred
        pass's gradients; training thread, after every job): sync jobs never write ``.grad``, so nothing
        of a backward that raised can land after the user's ``zero_grad()``; an aborted pass keeps its
        local gradients as unsynced. A bucket that got a gradient late keeps ``.grad`` as it is (its
        early part averaged without the late one): :meth:`_write` syncs all of it again."""
        for bucket, ctx in zip(self.buckets, p.contexts):
            path = self.paths[ctx.path]
            if (p.shadow or grads is None) and facts.aborted:
                path.forget(bucket, facts.aborted)
            elif p.shadow or grads is None:  # a joined rank, or the owners stepped from the averages: nothing to write
                path.settle(bucket, facts.late[bucket.index])
            elif facts.aborted:
                path.keep_local(bucket)
            else:
                path.write(bucket, grads, facts.late[bucket.index])
            landed = not (p.shadow or facts.aborted or facts.late[bucket.index])
            self.paths.carried(bucket, ctx.path, landed)

    def _close_pass(self, p: Pass) -> None:
        with self._lock:
            if self._pass is p:
                self._pass = None
            if self._round is p.round:
                self._round = None
            self._update_ask()

    # ---- deferred passes -----------------------------------------------------------------------------

    def pending(self) -> Deferred | None:
        """The deferred pass whose jobs may still run (not drained), or None."""
        deferred = self._deferred
        return deferred if deferred is not None and not deferred.drained else None

    def wait_for_bucket(self, index: int, deferred: Deferred, what: str) -> None:
        """Until bucket ``index``'s job of the deferred pass is done (the training thread waits on ``what``,
        as the tracer names it); a failure ends the engine."""
        with self.recorder.waiting(what):
            self._guarded(deferred.pass_, partial(self._wait_bucket, index))

    def _wait_bucket(self, index: int) -> None:
        raise_outcome(*self.core.wait_bucket(index, self.timeout))

    def after_job(self, bucket: Bucket) -> None:
        """Order the training thread's device work after ``bucket``'s job (CUDA; nothing on CPU)."""
        if self._streams is not None:
            torch.cuda.current_stream(bucket.device).wait_event(bucket.done_event)

    def drain(self, output: object = None) -> None:
        """Wait for every job of a deferred pass and let the mode take what they left (local, no
        collective). ``output``: the forward that just ran (the mode may check what it read)."""
        deferred = self.pending()
        if deferred is None:
            return
        self._wait_for_jobs(deferred.pass_)
        if deferred.facts is None:
            deferred.facts = self._read_facts(deferred.pass_, deferred.exchange)
            deferred.error = self.mode.split_pass_error(deferred.facts)
        if deferred.error is not None:
            self.fail(deferred.error)
        self.mode.drained(output)
        deferred.drained = True

    def after_forward(self, output: object, synced: bool) -> None:
        """A forward of the wrapper returned: the last step's deferred pass settles now (a synced forward)
        or drains, unless the mode ``settles_in_next_pass``."""
        if self.mode.settles_in_next_pass:
            return
        self.settle(output) if synced else self.drain(output)

    def settle(self, output: object = None) -> None:
        """Drain a deferred pass, write it and close it (stats, tracing, the plan, learning: may be
        collective, so only at points every rank reaches: the end of a synced forward, the next synced pass
        opening, the optimizer's step)."""
        self.drain(output)
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._write_deferred(deferred)
            self._close(deferred.pass_, deferred.facts)

    def flush(self) -> None:
        """Drain a deferred pass and write its averages where the mode holds them, and no more: its close
        (the plan, learning) stays where it settles, so what the next forwards read is what they would
        have read without this call. What an observation of the state needs (a checkpoint, an evaluation);
        local (no collective: one rank may call it alone)."""
        self.drain()
        if self._deferred is not None:
            self._write_deferred(self._deferred)

    def _write_deferred(self, deferred: Deferred) -> None:
        if not deferred.written:
            self._write(deferred.pass_, deferred.facts, self.mode.writer(self._live, settling=True))
            self.mode.settled()
            deferred.written = True

    def backward_raised(self) -> bool:
        """The last synced backward raised: its pass is still open outside any backward (until the next
        forward, or a collective of the optimizer, finishes it)."""
        return (self._pass is not None or bool(self._armed)) and torch._C._current_graph_task_id() == -1

    def finish_aborted_pass(self) -> None:
        """A pass still open at the next forward was aborted (its backward raised): finish it so every
        rank's collectives stay in step, keeping nothing."""
        self._settle_if_opening()
        with self._lock:
            p = self._pass
            armed = list(self._armed.values())
            self._armed.clear()
            if self.failure is not None:  # e.g. that backward's settle failed: nothing more goes over the wire
                return
            if p is None and armed:  # it raised after reaching the outputs, before any gradient arrived
                p = self._open(armed[0], -1, queue_end=False)
            if p is None:
                return
            p.aborted = True
        self._finish(p)

    def shadow_pass(self) -> None:
        """Take part in a pass of the other ranks with nothing to contribute (a joined rank); it is an
        iteration of theirs, so the tracer counts it (its window closes, with a gather, where theirs does)."""
        self._pass_now(shadow=True)

    def sync_now(self) -> None:
        """A synced pass over every bucket now, outside any backward (collective: every rank calls it at
        the same point of its training): each bucket's job stages what the mode sends (``Mode.job``), and
        the mode's writer takes the averages when the pass closes (a periodic mode's outer sync)."""
        self._refuse_if_failed()
        self._pass_now(shadow=False)

    def _refuse_if_failed(self) -> None:
        if self.failure is not None:
            raise SyncError(f"PoseidonDDP cannot continue after a failed sync: {self.failure}") from self.failure

    def _pass_now(self, shadow: bool) -> None:
        """Open a pass with every bucket ready and finish it: the tracer counts it as an iteration."""
        self.finish_aborted_pass()
        with self._lock:
            p = self._open(Round(self.recorder.start_iteration()), -1, queue_end=False, shadow=shadow)
        self._finish(p)

    # ---- sync jobs (channel threads) --------------------------------------------------------------

    def _run_job(self, key: int) -> None:
        """Slot ``key`` of the channel plan when the core does not run it itself: a bucket's whole
        job, or one of its two slots (the job's phases cut where it yields "update")."""
        index, second = self.plan.bucket_of(key), self.plan.is_second(key)
        bucket, channel = self.buckets[index], self.plan.channel_of(key)
        slot = self._halves.pop(index) if second else self._first_slot(index, channel)
        start = time.monotonic()
        after = bucket.done_event if second else bucket.ready_event  # CUDA: a second slot follows its first
        with torch.profiler.record_function(self._profile_names[index, slot.ctx.path]), \
                self._device_stream(after, channel) as stream:
            if not second:
                bucket.wait_staged()
            if key == self.plan.first_second_slot:
                self.mode.second_slots_begin(self._channels[channel], len(self.buckets))
            phases = slot.halves.second() if second else slot.phases
            traced = self._traced(self._jobs_pass)
            if traced is not None:
                sent = (lambda: 0) if index in self.plan.split and not second else (lambda: bucket.bytes_sent)
                self.recorder.run_job(phases, bucket.name, self._lanes[channel], slot.ready_ns, slot.ctx.path, sent,
                                      traced, "pull" if second else "sync")  # a split job's bytes count once
            else:
                drive(phases)
            if stream is not None:
                bucket.done_event.record(stream)
        seconds = time.monotonic() - start
        bucket.sync_seconds = bucket.sync_seconds + seconds if second else seconds
        if index in self.plan.split and not second:
            self._halves[index] = _Slot(slot.ctx, time.monotonic_ns(), slot.phases, slot.halves)
            self.mode.first_slot_done()

    def _context_of(self, index: int) -> SyncContext:
        """Bucket ``index``'s context in the pass its job belongs to (aborted if ``finish`` submitted it
        for an aborted pass)."""
        ctx = self._jobs_pass.contexts[index]  # a deferred pass's jobs run on after it is closed
        if self.core.aborted(index) and not ctx.aborted:
            ctx = SyncContext(ctx.path, ctx.task, True, ctx.shadow, ctx.k_pad)
        return ctx

    def _stage(self, index: int) -> None:
        """Bucket ``index`` is being submitted, on the thread that made it ready: what its job will read of
        ``.grad``, into its flat buffer (the core's call; no job ever reads ``.grad``)."""
        bucket, ctx = self.buckets[index], self._context_of(index)
        with self._device_stream(bucket.ready_event, self.plan.channel_of(index)):  # CUDA: copies on a side stream
            self._job(ctx.path).stage(bucket, ctx)
            if not (ctx.aborted or ctx.shadow):
                self.paths.carry_into(bucket, ctx.path)

    def _first_slot(self, index: int, channel: int) -> _Slot:
        """The phases of bucket ``index``'s job this pass (up to the update when the plan splits it)."""
        bucket = self.buckets[index]
        ctx = self._context_of(index)
        phases = self._job(ctx.path).sync(bucket, self._channels[channel], ctx)
        if index not in self.plan.split:
            return _Slot(ctx, self.core.submit_ns(index), phases)
        halves = Halves(phases, "update")
        return _Slot(ctx, self.core.submit_ns(index), halves.first(), halves)

    def _job(self, path: str) -> Job:
        """The job of a bucket on path ``path`` this pass: the path's, as the mode composes it."""
        return self.mode.job(self.paths[path])

    def _device_stream(self, after, channel: int):
        """A context on the channel's CUDA stream, ordered after the event ``after``, that gives the stream
        (on CPU a no-op giving None: it runs per bucket per pass)."""
        if self._streams is None:
            return contextlib.nullcontext()
        return _on_stream(self._streams.for_channel(channel), after)

    # ---- after the pass -----------------------------------------------------------------------------

    def _record_unsettled(self) -> None:
        """The engine closes with a deferred pass drained but not closed (closing it may be collective):
        its spans, as its iteration's, for the tracer's last local write."""
        deferred = self._deferred
        traced = self._traced(deferred.pass_) if deferred is not None else None
        if traced is not None:
            self._record_pass(deferred.pass_, traced)
            round_ = deferred.pass_.round
            self.recorder.add_iteration(traced, round_.began_ns if round_ is not None else None)

    def _traced(self, p: Pass) -> int | None:
        """The tracer's iteration of ``p`` (None: not recorded); a pass opened outside any round (a
        backward that raised before its first gradient) belongs to the training thread's iteration."""
        return p.round.traced if p.round is not None else self.recorder.current

    def _record_pass(self, p: Pass, iteration: int) -> None:
        """The compute lane's backward spans (each bucket's share, up to its submission) and the spans
        of the jobs the core ran itself, as ``iteration``'s."""
        last = p.began_ns
        for bucket in sorted(self.buckets, key=lambda b: self.core.submit_ns(b.index)):
            submitted = self.core.submit_ns(bucket.index)
            self.recorder.add("backward", bucket.name, "compute", last, max(last, submitted), iteration)
            last = max(last, submitted)
        for index, kind, start, end in self.core.native_spans():
            bucket = self.buckets[index]
            args = {"path": self._default.name}
            if kind == "sync":
                args["bytes"] = bucket.bytes_sent
            self.recorder.add(kind, bucket.name, self._lanes[index % len(self._channels)], start, end, iteration,
                              **args)

    def _learn_if_needed(self) -> None:
        """Rebuild the buckets from the readiness order of this pass (rank 0's, the same everywhere):
        once, and again only when a parameter no rank had used before gets a gradient. The first time,
        the jobs are costed by the link model: the first pass's own job times are cold (first use of
        every buffer), and a fit to them moved from run to run by 37x in seconds per byte on mlp50,
        learning 2 to 7 jobs where the link model learns 2 every time. A rebuild fits warm jobs."""
        if not self.mode.lockstep:
            return  # fused once, when the engine started
        grew = False
        for param_id in list(self._never_used):
            bucket, j = self._slot[param_id]
            if bucket.used_anywhere[j]:
                self._never_used.discard(param_id)
                grew = True
        if self._learned and not grew:
            return
        mine = (self.core.order, self.core.order_ns) if self.rank == 0 else None
        everyone = self.control.all_gather_objects((mine, [b.sync_seconds for b in self.buckets]))
        order, order_ns = everyone[0][0]
        layers, ready_s = readiness_order(self.layers, order, [t / 1e9 for t in order_ns])
        cost = self._job_cost([min(seconds) for seconds in zip(*(s for _, s in everyone))]) if self._learned \
            else self._default.job_cost(self.link)
        groups = group_layers(layers, self.fusion_bytes, self.coordinator.wanted_solo(), ready_s, cost)
        self._learned = True
        self._install(build_buckets(groups, self.staged, self._fc_of), ready_s)

    def _job_cost(self, seconds: list[float]) -> JobCost:
        """Seconds per sync job of a bucket of n bytes, fitted (Theil-Sen) to what this pass's jobs
        took (``seconds`` per bucket: the least over the ranks, the rank that came last to a job did
        not wait for its peers): latency, software and bandwidth as they really are, contention with
        backward included. Too few distinct sizes, or a fit that does not grow with the size, fall back
        to the default path's link model."""
        link_cost = self._default.job_cost(self.link)
        with contextlib.suppress(ValueError):
            alpha, beta = theil_sen([b.nbytes for b in self.buckets], seconds)
            if beta > 0:
                return JobCost(max(alpha, link_cost.alpha_s), beta)
        return link_cost

    # ---- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            # a backward that raised in the last step: its collectives let the peers name this rank
            if self.failure is None:
                with contextlib.suppress(SyncError):
                    self.finish_aborted_pass()
            if self.failure is None:  # a failed engine has said so already, and its jobs may never end
                self.drain()
                self._record_unsettled()
                for bucket in self.buckets:
                    bucket.release_device_copy()
        finally:
            self.core.close()
            self.mode.close()
        for layer in self.fc.values():
            layer.remove()


class _Arm:
    """The gradient hook on a synced forward's outputs: this backward syncs."""

    __slots__ = ("engine", "round")

    def __init__(self, engine: Engine, round_: Round | None) -> None:
        self.engine, self.round = engine, round_

    def __call__(self, grad: torch.Tensor) -> None:
        if not self.engine.closed:
            self.engine._armed_by(self.round)


def _collective_wait(what: str, wait: Callable[[], object]) -> None:
    try:
        wait()
    except RuntimeError as exc:
        raise SyncError(f"{what} failed: {exc}") from exc


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream, after: torch.cuda.Event):
    """Run the block on ``stream`` once ``after`` has passed on the stream that recorded it."""
    stream.wait_event(after)
    with torch.cuda.stream(stream):
        yield stream
