"""The parameter-server modes (``ServerOptimizer(model, ...)``): the shards hold the optimizer state and
apply the update during backward; the forwards read the new values.

:class:`ServerMode` (BSP on the servers): every bucket's job is its path composed with the update at
the owners (``paths/update.py``), the owners' new values pulled into the bucket's flat buffer. Once the
buckets are learned a pass is *deferred*: ``backward()`` returns while its jobs run, each layer's forward
pre-hook waits for its bucket's job and copies its values in, and the pass settles (every job done,
every value applied, closed) at the end of the next synced forward or at ``step()``, which waits for it
unless ``lazy_pull``. :class:`PipeServer` is Pipe-SGD on the servers (``ServerOptimizer(..., delay=k)``):
the forward of step t reads the values of step t-1-k, while the owners step from the newest values:
w_{t+1} = opt(w_t, g(w_{t-k})).

Invariants:
- values land on the training thread only (the forward pre-hooks, the drain of a deferred pass, the
  close of a pass in its backward); a parameter written after ``backward()`` while its new value was
  pending, or read before it arrived (outside the forward of every module holding it), is an error that
  ends the engine, not a silent overwrite;
- an aborted pass's updates are taken back on every owner, and its pulled values are not read (unless
  the server keeps them: ``keeps_aborted_values``);
- a bucket rebuild carries the whole optimizer state over (gathered before, loaded after: collective);
- :class:`PipeServer`: values are held in pass order and applied in that order, each pass's values once;
  a pass that was aborted is no step (it is not counted, on any rank); the newest values are replaced
  only on the training thread, between passes, so an owner's step reads one whole pass's values.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..barrier import SyncError
from ..bucket import Bucket
from ..coordinator import PassFacts
from ..env import flag, option
from ..graph import leaves_of
from ..paths import GradWriter, Path
from ..paths.update import ServerUpdate
from ..pools import ChannelGroups
from ..schedule import SyncingAtEnd
from ..server import Server, ServerSpec, apply_values, merge_exports
from .base import Engine, Mode
from .state import checked_entries


@dataclass(frozen=True)
class ServerRequest:
    """What a ``ServerOptimizer`` asks of its wrapper's mode: the shards' spec and the consistency options
    (``delay``: Pipe-SGD's k; ``staleness``: SSP's bound, 0 for BSP, None for asynchronous;
    ``push_every`` / ``fetch_every``: Downpour's n_push / n_fetch; ``versions``: every parameter's version
    when the optimizer was built, by ``id``: where the owners hold the values, what they start from, so
    that a write after it is an edit they would overwrite)."""

    spec: ServerSpec
    delay: int = 0
    staleness: int | None = 0
    push_every: int = 1
    fetch_every: int = 1
    versions: dict[int, int] = field(default_factory=dict)


class ServerMode(Mode):
    """BSP on the parameter-server shards (see the module docstring)."""

    name = "server"
    deferral = "with a ServerOptimizer"
    #: a forward pre-hook waits for each layer's bucket and lands its values (lazy pulls)
    waits_per_layer = True

    def __init__(self, request: ServerRequest) -> None:
        self.request, self.spec = request, request.spec
        self.engine: Engine | None = None
        self.server: Server | None = None  #: this rank's shards (``server.py``), once attached
        self._jobs: dict[Path, ServerUpdate] = {}
        self._hooks: list = []
        self._modules_of: dict[int, list[nn.Module]] = {}  #: id(parameter) -> the modules whose forward reads it
        self._buckets_of_module: dict[int, list[int]] = {}
        self._carried: dict | None = None  #: the whole optimizer state across a bucket rebuild
        self._installed = False
        self._applied: list[bool] = []  #: per bucket: the deferred pass's values landed
        self._versions: dict[int, int] = {}  #: every parameter's version when the deferred pass's backward returned
        #: POSEIDON_PULL_PRIORITY=1: lazy pulls of the jobs still syncing at the end of backward run input
        #: side first (the plan splits them). Off by default: measured no faster here (README)
        self._pull_priority = option(None, "PULL_PRIORITY", flag, False)
        self._syncing_at_end = SyncingAtEnd()

    # ---- the engine starts ------------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        """The shards over the default path's chunks (every rank sends its flags to the owners, chunks
        aligned to whole parameters if the optimizer needs it), the per-layer waits hooked."""
        self.engine = engine
        self.kv = engine.paths.default
        self.kv.aligned = self.spec.aligned
        self.kv.flags_to_owners = True
        engine.coordinator.pull_values = True
        self.server = self.make_server()
        synced = {id(p) for p in engine.params}
        # a module's forward waits for the parameters of its whole subtree (nn.MultiheadAttention reads
        # out_proj.weight itself); the root's would wait for everything, so it waits for its own only
        for module in engine.module.modules():
            own = [p for p in module._parameters.values() if p is not None and id(p) in synced]
            reads = own if module is engine.module else [p for p in module.parameters() if id(p) in synced]
            for param in reads:
                self._modules_of.setdefault(id(param), []).append(module)
            if reads:
                self._hooks.append(module.register_forward_pre_hook(self._before_layer, prepend=True))
            if own:
                self._hooks.append(module.register_state_dict_pre_hook(self._before_state_dict))
                self._hooks.append(module.register_load_state_dict_pre_hook(self._before_load))

    def make_server(self) -> Server:
        """This rank's shards."""
        return Server(self.spec, self.value_source())

    def value_source(self) -> Callable[[nn.Parameter], Tensor] | None:
        """Where the owners step from (None: the live parameters)."""
        return None

    def buckets_changing(self) -> None:
        """The whole optimizer state, on every rank (collective), before the shards are rebuilt."""
        if self._installed:
            self._carried = merge_exports(self.engine.control.all_gather_objects(self.server.export()),
                                          self.spec.shapes)

    def buckets_changed(self, buckets: Sequence[Bucket]) -> None:
        engine = self.engine
        self.server.install(buckets, self.kv, engine.rank)
        self.server.load(self._carried or {})
        self._carried, self._installed = None, True
        self._syncing_at_end.reset()
        self._buckets_of_module = {}
        for layer in engine.layers:
            for _, param in layer.params:
                index = engine.bucket_of(param).index
                for module in self._modules_of.get(id(param), ()):
                    indices = self._buckets_of_module.setdefault(id(module), [])
                    if index not in indices:
                        indices.append(index)

    def job(self, path: Path) -> ServerUpdate:
        """``path`` with the update at the owners (one job per path object)."""
        job = self._jobs.get(path)
        if job is None:
            job = self._jobs[path] = ServerUpdate(path, self.kv, self.server)
        return job

    def split_buckets(self, buckets: int) -> Sequence[int]:
        """Every job is cut at its update when the owners clip by the global norm (it needs every push
        before any update); with lazy pulls and priority, the jobs seen still syncing at the end of
        backward, so the input side is pulled first."""
        if self.spec.max_grad_norm is not None:
            return range(buckets)
        tail = self._syncing_at_end.buckets if self._syncing_at_end.final else set()
        if self.spec.lazy_pull and self._pull_priority and len(tail) > 1:
            return tail
        return ()

    # ---- a step ------------------------------------------------------------------------------------

    def pass_opened(self) -> None:
        self.server.begin_pass()

    def first_slot_done(self) -> None:
        self.server.pushed()

    def second_slots_begin(self, groups: ChannelGroups, buckets: int) -> None:
        self.server.before_updates(groups, buckets, self.engine.timeout)

    def defers(self, learned: bool) -> bool:
        return learned

    def facts_known(self, aborted: bool) -> None:
        self.server.facts_known(aborted)

    def jobs_done(self, facts: PassFacts) -> None:
        """A pass closing in its backward: an aborted one's updates taken back; the new values landed."""
        if facts.aborted:
            self.server.roll_back()
        if not facts.aborted or self.server.keeps_aborted_values:
            for index in range(len(self.engine.buckets)):
                self._land(index)
            self.values_taken()

    def deferring(self) -> None:
        self._applied = [False] * len(self.engine.buckets)
        self._versions = {id(q): q._version for q in self.engine.params}

    def drained(self, output: object) -> None:
        """The values not landed yet by a layer's forward land now; ``output`` (the forward that just ran)
        must not have read any of them."""
        late = [index for index, applied in enumerate(self._applied) if not applied]
        if output is not None and late and self.waits_per_layer:
            self._check_not_read(output, late)
        for index in late:
            self._land(index, deferred=True)
        self.values_taken()

    def writer(self, live: GradWriter, settling: bool) -> None:
        return None  # the updates ran at the owners: no gradient is written

    def late_gradients(self, late: Sequence[Bucket]) -> SyncError:
        return SyncError(f"a gradient of {', '.join(repr(b.name) for b in late)} arrived after the servers applied "
                         "that bucket's update (reentrant checkpointing or a hook that runs backward again?): "
                         "the late part was not applied")

    def pass_closed(self, facts: PassFacts, learned: bool) -> bool:
        """Lazy pulls with priority: the jobs still running at the end of backward in the first passes of
        the learned buckets; once known, the channel plan splits them."""
        watching = self.spec.lazy_pull and self._pull_priority and learned
        return watching and self._syncing_at_end.observe(facts.syncing)

    def after_step(self) -> None:
        """``step()`` waits until every parameter holds its new value, unless ``lazy_pull``."""
        if not self.spec.lazy_pull:
            self.engine.settle()

    # ---- values --------------------------------------------------------------------------------------

    def _before_layer(self, module: nn.Module, args: tuple) -> None:
        """A layer's forward begins: its new parameter values first (forward pre-hook). Inside a compiled
        graph it cannot wait: a value still pending then is caught at the end of the forward."""
        if torch.compiler.is_compiling() or not self.waits_per_layer:
            return
        deferred = self.engine.pending()
        if deferred is None:
            return
        for index in self._buckets_of_module.get(id(module), ()):
            if not self._applied[index]:
                self.engine.wait_for_bucket(index, deferred, "values")
                self._land(index, deferred=True)

    def _land(self, index: int, deferred: bool = False) -> None:
        """Bucket ``index``'s new values into the parameters, or where the mode holds them (its job is
        done). For a deferred pass read per layer, a parameter written since backward returned is an
        error: the new value was computed from the old one."""
        bucket = self.engine.buckets[index]
        if deferred:
            self._applied[index] = True
        if deferred and self.waits_per_layer:
            for name, p in zip(bucket.param_names, bucket.params):
                if p._version != self._versions[id(p)]:
                    self.engine.fail(SyncError(
                        f"parameter {name!r} was written after backward() while its new value was still pending (a "
                        "ServerOptimizer with lazy_pull=True or staleness lands it at the next forward): call "
                        "model.synchronize() before writing parameters between steps"))
        self.engine.after_job(bucket)
        self.take_values(bucket)

    def _check_not_read(self, output: object, late: list[int]) -> None:
        buckets = self.engine.buckets
        names = {id(p): name for index in late for name, p in zip(buckets[index].param_names, buckets[index].params)}
        tensors, _ = tree_flatten(output)
        for param in leaves_of([t for t in tensors if isinstance(t, torch.Tensor)]):
            if id(param) in names:
                self.engine.fail(SyncError(
                    f"parameter {names[id(param)]!r} was read in a forward before its new value had arrived: it is "
                    "read outside the forward of the module that holds it (as nn.MultiheadAttention reads "
                    "out_proj.weight, or F.linear(x, self.head.weight)), or inside a torch.compile graph, where the "
                    "per-module waits cannot run; lazy_pull=True waits per module, so use lazy_pull=False for "
                    "this model"))

    def take_values(self, bucket: Bucket) -> None:
        """A bucket's new values arrived (its job is done)."""
        apply_values(bucket)

    def values_taken(self) -> None:
        """Every new value of a pass arrived."""

    def forget_values(self) -> None:
        """The user loaded parameters: they win over anything the mode holds."""

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.engine.drain()

    def _before_load(self, module: nn.Module, *args) -> None:
        """Loading parameters: the last step's values must land first, not over what is loaded; values
        held for later steps never land."""
        self.engine.drain()
        self.forget_values()

    # ---- what it supports, what the ServerOptimizer asks -------------------------------------------

    def refuse_join(self) -> None:
        raise RuntimeError("join() (uneven inputs) is not supported with a ServerOptimizer yet")

    def layout(self) -> dict:
        return {"forward_waits": self.spec.lazy_pull, "server": True}

    def finish(self) -> None:
        """End of training (``ServerOptimizer.finish``): the last step's sync done, every value held landed."""
        self.engine.settle()
        self.flush()

    def flush(self) -> None:
        """Every value the mode holds lands now."""

    def quiesce(self) -> None:
        """No update in flight anywhere, before the state is read or replaced (collective)."""
        self.engine.finish_aborted_pass()  # a skipped step's state taken back first
        self.engine.settle()

    def wait_norm(self) -> float | None:
        return self.server.wait_norm(self.engine.timeout)

    def last_staleness(self) -> int | None:
        return None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for handle in self._hooks:
            handle.remove()


class PipeServer(ServerMode):
    """Pipe-SGD on the servers: the new values of step n are held until the forward of step n+1+k; the
    owners step from the newest values meanwhile."""

    name = "server-pipe-sgd"
    waits_per_layer = False

    def __init__(self, request: ServerRequest) -> None:
        super().__init__(request)
        self.delay = request.delay
        self._ended = 0  #: synced passes whose backward returned (not aborted)
        self._taken = 0  #: passes whose values are all held
        self._filling: dict[nn.Parameter, Tensor] = {}
        self._held: deque[tuple[int, dict[nn.Parameter, Tensor]]] = deque()  #: (pass, values), oldest first
        self._newest: dict[int, Tensor] = {}  #: id(param) -> its newest value (what the owners step from)
        self._restored = False  #: values loaded from a checkpoint, no forward since: loading the model keeps them

    def value_source(self) -> Callable[[nn.Parameter], Tensor]:
        return self._newest_value

    def _newest_value(self, param: nn.Parameter) -> Tensor:
        return self._newest.get(id(param), param)

    def defers(self, learned: bool) -> bool:
        return True

    def take_values(self, bucket: Bucket) -> None:
        with bucket.averages() as values:
            for p, value in values:
                self._filling[p] = value.clone()

    def values_taken(self) -> None:
        values, self._filling = self._filling, {}
        self._held.append((self._taken, values))
        self._taken += 1
        self._newest.update((id(p), value) for p, value in values.items())

    def backward_returned(self, buckets: Sequence[Bucket], averaged: bool) -> None:
        """A step ended: the values its successor reads land now (the parameters always hold what the
        next forward reads, for ``state_dict()`` and evaluation as much as for training)."""
        self._ended += 1
        self._apply_due()

    def before_forward(self) -> None:
        self._restored = False
        self._apply_due()

    def _apply_due(self) -> None:
        """Apply the values of every pass n <= ended - 1 - k (the forward of step t reads step t-1-k's)."""
        while self._held and self._held[0][0] <= self._ended - 1 - self.delay:
            self._apply(self._held.popleft()[1])

    @staticmethod
    def _apply(values: dict[nn.Parameter, Tensor]) -> None:
        with torch.no_grad():
            for p, value in values.items():
                p.copy_(value)

    def after_step(self) -> None:
        pass  # the values land k steps later: nothing to wait for

    def flush(self) -> None:
        """End of training: every value held lands now, the newest last (the pipeline restarts empty)."""
        while self._held:
            self._apply(self._held.popleft()[1])
        self._newest.clear()

    def forget_values(self) -> None:
        """The user loaded parameters: they are the newest values now, nothing held lands on them;
        unless the held values were just restored from the same checkpoint (no forward since)."""
        if self._restored:
            return
        self._held.clear()
        self._newest.clear()

    def layout(self) -> dict:
        return {"forward_waits": True, "server": True}

    @property
    def in_flight_steps(self) -> int:
        return self.delay

    def state_dict(self, names: dict[int, str]) -> dict:
        """The values held (not yet read by a forward), oldest first, by parameter name, with how many
        steps from now each one lands."""
        return {"delay": self.delay,
                "held": [(n - self._ended, {names[id(p)]: v.clone() for p, v in values.items()})
                         for n, values in self._held]}

    def load_state_dict(self, state: dict, params: dict[str, nn.Parameter]) -> None:
        """Restore :meth:`state_dict`'s values (checked first: a bad state changes nothing); loading the
        model's own state before or after this, before the next forward, keeps them."""
        entries = checked_entries(state, self.delay, "held", params)
        self._held = deque((self._ended + offset, {params[n]: v for n, v in values.items()}) for offset, values in entries)
        self._newest = {id(p): v for _, values in self._held for p, v in values.items()}
        self._taken = self._ended
        self._restored = True
