"""Periodic averaging, ``PoseidonDDP(model, sync_every=H, outer=...)``: local SGD and DiLoCo.

Every backward is local (no pass opens, nothing is sent): the user's optimizer (the *inner* one) steps
each rank on its own gradients. Right after every H-th ``step()`` of it, still inside that ``step()``,
the ranks sync through the engine's buckets and paths (:meth:`~.base.Engine.sync_now`, every bucket on
its path: the default one, or one an override names), and ``step()`` returns once the sync is done:
- local SGD (``outer=None``; Lin et al. 2020, torch's ``PeriodicModelAverager``): every parameter becomes
  the average over the ranks of its value;
- DiLoCo (``outer=`` an optimizer; Douillard et al. 2023): the round's pseudo-gradient, its start minus
  its end, is averaged, and the *outer* optimizer steps the round's start parameters with it (the paper's:
  Nesterov SGD, lr 0.7, momentum 0.9, :data:`DILOCO_OUTER`).
With ``broadcast_buffers`` (the default) the floating-point buffers (BatchNorm's statistics) are averaged
at the same sync; integer ones (counters) stay as they are.

What a step is: one ``step()`` of the inner optimizer, the torch optimizer over this model's parameters
whose ``step()`` runs (torchft's rule; torch's ``PostLocalSGDOptimizer`` counts its own ``step()`` too):
backwards, ``no_sync()`` and micro-batches do not count, a step that GradScaler skips does not count, a
subclass whose ``step()`` calls ``super().step()`` counts once, and so does a wrapper whose ``step()`` calls
the step() of the optimizer it wraps (SAM, ZeroRedundancyOptimizer): the outermost counts. One optimizer:
a second one stepping these parameters is refused (use param groups).

Invariants (without ``delay`` and ``fragments``, which change the first, third and fourth as below):
- after every sync all ranks hold bit-identical parameters (each average is computed once and sent to
  every rank; the outer optimizer steps the same values on every rank), and the outer optimizer's state is
  the same on every rank; the inner optimizers' states stay each rank's own, as in DiLoCo and torch;
- between syncs no rank sends anything: ``comm_stats`` counts one iteration per sync;
- nothing is in flight between two steps: a checkpoint carries the steps taken, the outer optimizer's
  state and, in the middle of a DiLoCo round, the round's start parameters (:meth:`Periodic.state_dict`);
  the parameters and the inner optimizer's state differ between ranks in the middle of a round, so every
  rank saves its own for an exact resume;
- DiLoCo takes the round's start parameters when the round's first inner step begins, so parameters the
  user loads between rounds are the next round's start.
Uneven inputs (``join()``) are refused: every rank must reach every sync.

With ``fragments=F`` (Streaming DiLoCo's schedule) the buckets, fused once, are cut into F runs of about
equal bytes; fragment f syncs alone after steps kS with (k - 1) mod F = f, S = H / F, so each parameter
syncs every H steps and only its fragment's bytes travel at a time (the other buckets' jobs send
nothing); DiLoCo's outer optimizer then steps only that fragment, whose next round starts from the
result. Only that fragment's parameters are the same on every rank right after its sync.

With ``delay=d`` (1 <= d <= S; overlapping local SGD, Wang et al. 2020; the eager outer step of Streaming
DiLoCo, Douillard et al. 2025) the sync is sent after the kS-th step as above, but ``step()`` returns at
once: the sync runs on the sync threads while the next d inner steps compute, and *lands* right after the
d-th of them (inside that ``step()``). What was sent is the parameters as they were after that step (a
copy, so the inner steps may change them meanwhile); the d steps taken while it was in flight are kept
on top of what lands:

    parameter = (local SGD: the average; DiLoCo: the outer step's result) + (parameter - what was sent)

DiLoCo's next round starts from the outer step's result (the d steps count toward it). So with a delay the
ranks hold the same values nowhere (each keeps its d steps of drift), but the round's result, the outer
optimizer's state and the next round's start are the same bits on every rank. A checkpoint taken while a
sync is in flight waits for it and carries its average, what was sent and the step it lands after; a run
that ends with a sync in flight (its ``close()``) waits for it and does not apply it. BatchNorm's
statistics are averaged when the sync lands.

With ``compression=`` (DiLoCo only: ``options.path``) every bucket of every outer sync takes that lossy
path (the coordinator routes them all there), whose error feedback carries each rank's rounding of its
pseudo-gradient into its next round's; local SGD's syncs carry the parameters, which take no residual.
A world of one sends nothing: its outer syncs stay exact, as ``compression=`` does in every mode.
"""
from __future__ import annotations

import copy
import functools
import sys
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..bucket import Bucket
from ..paths import GradWriter, Path, SyncContext, path_class
from ..pools import ChannelGroups
from ..replicas import average_into
from .base import Engine, Mode
from .pipe_sgd import PipeSGD, delay_option
from .state import check_delay

#: DiLoCo's outer optimizer as the paper sets it: Nesterov SGD, lr 0.7, momentum 0.9
DILOCO_OUTER = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})

_OUTER_FORMS = ("None (local SGD), an optimizer class and its arguments, e.g. (torch.optim.SGD, {'lr': 0.7, "
                "'momentum': 0.9, 'nesterov': True}) (poseidon_torch.DILOCO_OUTER), or "
                "functools.partial(torch.optim.SGD, lr=0.7, ...)")


@dataclass(frozen=True)
class PeriodicOptions:
    """``PoseidonDDP(sync_every=..., outer=..., delay=...)`` checked: H, the outer optimizer's class and
    arguments (None: local SGD), whether buffers are averaged at each sync (``broadcast_buffers``), and the
    inner steps a sync stays in flight before it lands (0: ``step()`` waits for it)."""

    sync_every: int
    outer_class: type[Optimizer] | None = None
    outer_kwargs: tuple[tuple[str, Any], ...] = ()
    average_buffers: bool = True
    delay: int = 0
    fragments: int = 1
    #: the lossy path every outer sync takes (``compression=``; DiLoCo only: it carries pseudo-gradients),
    #: or None: the engine's plan (exact)
    path: str | None = None

    @property
    def spacing(self) -> int:
        """Inner steps between two syncs (of consecutive fragments)."""
        return self.sync_every // self.fragments

    def build_outer(self, params: Sequence[nn.Parameter]) -> Optimizer:
        return self.outer_class(params, **dict(self.outer_kwargs))


def periodic_option(sync_every: object, outer: object, average_buffers: bool, params: Iterable[nn.Parameter],
                    delay: object = 0, fragments: object = 1, compression: Mapping[str, Mapping[str, Any]] | None = None
                    ) -> PeriodicOptions | None:
    """The options checked (None: not periodic; ``delay`` is then Pipe-SGD's, checked elsewhere). The outer
    optimizer is built once over ``params``, so arguments it refuses are refused here, on every rank, before
    any collective. ``compression``: the lossy paths ``compression=`` names with their settings (checked),
    at most one here."""
    if sync_every is None:
        if outer is not None or fragments != 1:
            raise ValueError(f"PoseidonDDP option {'outer' if outer is not None else 'fragments'} (periodic averaging) "
                             "needs sync_every=H, the inner steps between two syncs of a parameter")
        return None
    if not isinstance(sync_every, int) or isinstance(sync_every, bool):
        raise TypeError(f"PoseidonDDP option sync_every must be an int (inner optimizer steps between two syncs), "
                        f"got {sync_every!r}")
    if sync_every < 1:
        raise ValueError(f"PoseidonDDP option sync_every must be >= 1 (inner optimizer steps between two syncs), got "
                         f"{sync_every}; leave it out for BSP")
    if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1 or sync_every % fragments:
        raise ValueError(f"PoseidonDDP option fragments must be an int >= 1 that divides sync_every={sync_every} (one "
                         f"fragment syncs every sync_every / fragments steps), got {fragments!r}")
    spacing = sync_every // fragments
    if delay_option(delay) > spacing:
        raise ValueError(f"PoseidonDDP option delay={delay} with sync_every={sync_every}, fragments={fragments}: a sync "
                         f"must land before the next one is sent, {spacing} step(s) later, so delay (the inner steps it "
                         f"stays in flight) must be at most {spacing}")
    cls, kwargs = _outer_parts(outer)
    path = _sync_path(sync_every, cls, compression or {})
    options = PeriodicOptions(sync_every, cls, tuple(sorted(kwargs.items())), average_buffers, delay, fragments, path)
    if cls is not None:
        try:
            options.build_outer([p for p in params if p.requires_grad])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"PoseidonDDP option outer: {cls.__name__} refused its arguments {kwargs}: {exc}") from exc
    return options


def _sync_path(sync_every: int, outer_class: type[Optimizer] | None, compression: Mapping[str, Mapping[str, Any]]
               ) -> str | None:
    """The lossy path of the outer syncs (None: exact): only DiLoCo's pseudo-gradients, which error
    feedback carries from one round to the next as it carries gradients from one step to the next; local
    SGD's syncs carry the parameters themselves, which no residual may be added to (``outer=(SGD, {"lr":
    1.0})`` is local SGD on pseudo-gradients). Every outer sync takes the path, the first one too, so a
    ``start_iter`` other than the path's default (the passes the coordinator waits before choosing it by
    cost) is refused rather than ignored."""
    if not compression:
        return None
    if outer_class is None:
        raise ValueError(f"compression={list(compression)} with sync_every={sync_every} needs outer= (DiLoCo): the lossy "
                         "paths compress pseudo-gradients with error feedback, and local SGD (outer=None) averages the "
                         "parameters themselves; outer=(torch.optim.SGD, {'lr': 1.0}) is local SGD on pseudo-gradients")
    if len(compression) != 1:
        raise ValueError(f"compression={list(compression)} with sync_every={sync_every}: every outer sync takes one path "
                         "(the coordinator's per-layer choice costs gradients every step, not a sync every H): name one")
    [(path, settings)] = compression.items()
    start_iter = settings.get("start_iter", path_class(path).defaults["start_iter"])
    if start_iter != path_class(path).defaults["start_iter"]:
        raise ValueError(f"compression= setting start_iter={start_iter} does not apply: every outer sync takes {path} "
                         f"with sync_every={sync_every}, the first one too; drop start_iter (to keep the first outer "
                         "syncs exact, train them without compression= and resume with it)")
    return path


def _outer_parts(outer: object) -> tuple[type[Optimizer] | None, dict[str, Any]]:
    """``outer`` as (an optimizer class, its keyword arguments)."""
    if outer is None:
        return None, {}
    if isinstance(outer, Optimizer):
        raise TypeError(f"PoseidonDDP option outer must be {_OUTER_FORMS}, not an optimizer already built "
                        f"({type(outer).__name__}): the wrapper builds it over the model's parameters")
    if isinstance(outer, functools.partial) and not outer.args:
        cls, kwargs = outer.func, dict(outer.keywords)
    elif isinstance(outer, tuple) and len(outer) == 2 and isinstance(outer[1], Mapping):
        cls, kwargs = outer[0], dict(outer[1])
    else:
        cls, kwargs = outer, {}
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"PoseidonDDP option outer must be {_OUTER_FORMS}, got {outer!r}")
    return cls, kwargs


def check_periodic(options: PeriodicOptions | None, overrides: Mapping[str, str]) -> None:
    """Refuse what makes no sense with periodic averaging (at construction, on every rank): overrides onto
    paths that could not carry parameters or pseudo-gradients (factor paths, and lossy ones: a lossy
    outer sync is ``compression=``, for every bucket)."""
    if options is None:
        return
    if options.path is not None and overrides:
        raise ValueError(f"overrides= with sync_every={options.sync_every} and compression: every outer sync takes the "
                         f"{options.path} path, for every layer; drop one of them")
    lossy = sorted(name for name, path in overrides.items() if not path_class(path).exact)
    if lossy:
        raise ValueError(f"overrides put {lossy} on the lossy path(s) {sorted({overrides[n] for n in lossy})}; with "
                         f"sync_every={options.sync_every} a lossy outer sync takes every layer (compression= with "
                         "outer=, DiLoCo's pseudo-gradients): name an exact path, or leave those layers out")
    factors = sorted(name for name, path in overrides.items() if path_class(path).factors)
    if factors:
        raise ValueError(f"overrides put {factors} on {sorted({overrides[n] for n in factors})}, which syncs gradients "
                         f"from their factors; with sync_every={options.sync_every} the sync carries parameters or "
                         "pseudo-gradients: name another path, or leave those layers out")


#: the code of the wrapper torch puts around every optimizer's ``step()`` (it runs the step hooks)
_STEP_WRAPPER = Optimizer.profile_hook_step(lambda self: None).__code__


def running_steps() -> list[Optimizer]:
    """The optimizers whose ``step()`` is running now, innermost first (one per level of nesting)."""
    frame, running = sys._getframe(1), []
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER:
            running.append(frame.f_locals.get("self"))
        frame = frame.f_back
    return running


class RoundJob:
    """A bucket's job in an outer sync (a :class:`~poseidon_torch.paths.Job`): ``payload(p)`` of every
    parameter staged instead of its gradient, averaged by ``path``; a bucket outside the fragment being
    synced (``member``) stages and sends nothing."""

    native = False

    def __init__(self, path: Path, payload: Callable[[nn.Parameter], Tensor], member: Callable[[Bucket], bool]
                 ) -> None:
        self.path, self.payload, self.member, self.name = path, payload, member, path.name

    def stage(self, bucket: Bucket, ctx: SyncContext) -> None:
        if self.member(bucket):
            bucket.stage_values([self.payload(p) for p in bucket.params])

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        if self.member(bucket):
            return (yield from self.path.sync(bucket, groups, ctx))
        bucket.bytes_sent, bucket.outcome = 0, "-"
        return False


class Landing:
    """Where an outer sync's averages go when its pass closes (a :class:`~poseidon_torch.paths.GradWriter`):
    ``take(p, average)`` for every parameter of the fragment synced (``member``), on the training thread."""

    def __init__(self, take: Callable[[nn.Parameter, Tensor], None], member: Callable[[Bucket], bool]) -> None:
        self.take, self.member = take, member

    def scatter(self, bucket: Bucket) -> None:
        if not self.member(bucket):
            return
        with torch.no_grad(), bucket.averages() as averages:
            for p, average in averages:
                self.take(p, average)

    def add(self, layer: object, grads: tuple[Tensor, ...]) -> None:
        raise RuntimeError("an outer sync took a factor path (internal error: refused at construction)")


@dataclass
class Flight:
    """An outer sync in flight (``delay`` >= 1): the inner step after which it lands, and what each
    parameter of its fragment sent, kept as it was (``id(param)`` -> its value after the round's last
    step)."""

    lands_after: int
    sent: dict[int, Tensor]


class Periodic(Mode):
    """Periodic averaging (see the module docstring); a subclass says what a round sends and how its
    averages land."""

    lockstep = False  # no collective between syncs: no facts, no buffer broadcast, buckets fused once
    syncs_gradients = False
    first_fusion_bytes = sys.maxsize  # the wrapper's fusion_bytes: fewer, larger messages per sync
    settles_in_next_pass = True  # no pass opens in a backward: a sync in flight settles where it lands

    def __init__(self, options: PeriodicOptions) -> None:
        self.options = options
        self.sync_every = options.sync_every
        self.delay, self.fragments, self.spacing = options.delay, options.fragments, options.spacing
        self.sync_nice = PipeSGD.sync_nice if self.delay else 0  # the training thread first while a sync flies
        self._fragment_of: dict[int, int] = {}  #: id(bucket) -> its fragment
        self._at_once = False  #: syncs land at once whatever the delay (``end_round()``)
        #: the fragments whose parameters are the same on every rank (landed without drift, no step since)
        self._agreed: set[int] = set(range(options.fragments))
        self._syncing = 0  #: the fragment of the sync sent last (in flight until it lands)
        self.steps = 0  #: inner steps taken (the last sync was after step steps - steps % sync_every)
        self.averages: dict[int, Tensor] = {}  #: id(param) -> the average of what it sent, until it lands
        self._flight: Flight | None = None
        self.engine: Engine | None = None
        self.outer: Optimizer | None = None  #: DiLoCo's
        self._synced: set[int] = set()
        self._steps_model_of: weakref.WeakKeyDictionary[Optimizer, bool] = weakref.WeakKeyDictionary()
        self._inner: weakref.ref | None = None
        self._jobs: dict[Path, RoundJob] = {}
        self._landing = Landing(self.take, self._member)
        self._hooks: list = []

    # ---- what a round sends and keeps (the subclasses) ---------------------------------------------

    def round_begins(self) -> None:
        """The round's first inner step begins."""

    def payload(self, param: nn.Parameter) -> Tensor:
        """What ``param`` sends at the end of the round (its value then: :meth:`sent_value`)."""
        raise NotImplementedError

    def round_ends(self) -> None:
        """The round lands: the parameters take the round's result from :attr:`averages` (no_grad; with a
        delay, the steps taken meanwhile are added back afterwards)."""
        raise NotImplementedError

    def sent_value(self, param: nn.Parameter) -> Tensor:
        """``param`` as it was when the round ended: kept aside while a sync flies, else the parameter."""
        return param.detach() if self._flight is None else self._flight.sent[id(param)]

    def take(self, param: nn.Parameter, average: Tensor) -> None:
        """The average of what ``param`` sent, kept until the round lands."""
        self.averages[id(param)] = average.clone()

    def round_state(self, names: dict[int, str]) -> dict:
        return {}

    def load_round(self, entry: dict, params: dict[str, nn.Parameter], steps: int) -> None:
        """Restore :meth:`round_state` (checked first: a bad entry changes nothing), saved after ``steps``
        inner steps."""

    # ---- the engine starts ------------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self._synced = {id(p) for p in engine.params}
        if self.options.path is not None and engine.world_size > 1:  # a world of one sends nothing: exact
            engine.coordinator.route_all(self.options.path)
        if self.fragments > 1:  # buckets of 1/(2F) of the model besides their largest layer: F fragments can be cut
            model_bytes = sum(p.numel() * p.element_size() for p in engine.params)
            self.first_fusion_bytes = max(1, model_bytes // (2 * self.fragments))
        self._hooks = [register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step)]
        self._join_a_running_step()

    def _join_a_running_step(self) -> None:
        """The engine starts at the first forward; where that forward runs inside the inner optimizer's
        ``step()`` (a closure: LBFGS), that step began before the hooks existed: its pre-hook runs now (its
        closure's first forward comes before its update, so the parameters are still the step's start).
        The outermost ``step()`` over the model's parameters is the one that counts (:meth:`_inner_step`)."""
        outermost = next((opt for opt in reversed(running_steps()) if self._steps_model(opt)), None)
        if outermost is not None:
            self._check_one_optimizer(outermost)
            if self.steps % self.sync_every == 0:
                self.round_begins()

    def buckets_changed(self, buckets: Sequence[Bucket]) -> None:
        """Cut the buckets (fused once) into ``fragments`` runs of consecutive buckets of about equal bytes,
        none empty."""
        count, fragments = len(buckets), self.fragments
        if count < fragments:
            self.close()  # the engine does not start: its step hooks must not outlive it
            raise ValueError(f"PoseidonDDP(fragments={fragments}) cuts the model's buckets into {fragments} fragments, "
                             f"and it has {count} (buckets of whole layers, each at most 1/{2 * fragments} of the model "
                             "and fusion_bytes besides its largest layer): give fewer fragments, or a smaller "
                             "fusion_bytes (bucket_cap_mb) if it is what binds")
        total, before, previous = sum(b.nbytes for b in buckets), 0, -1
        self._fragment_of = {}
        for i, bucket in enumerate(buckets):
            ideal = int(fragments * (before + bucket.nbytes / 2) / total)  # where its middle byte falls
            lowest = max(previous, fragments - (count - i))  # the buckets left must cover the fragments left
            previous = min(max(ideal, lowest), previous + 1, fragments - 1)
            self._fragment_of[id(bucket)] = previous
            before += bucket.nbytes

    def fragment_params(self, names: dict[int, str]) -> list[list[str]]:
        """Each fragment's parameters by name (``names``: ``id(parameter)`` -> name), in sync order."""
        fragments: list[list[str]] = [[] for _ in range(self.fragments)]
        for bucket in self.engine.buckets:
            fragments[self._fragment_of[id(bucket)]] += [names[id(p)] for p in bucket.params]
        return fragments

    def _member(self, bucket: Bucket) -> bool:
        return self._fragment_of.get(id(bucket), 0) == self._syncing

    def job(self, path: Path) -> RoundJob:
        job = self._jobs.get(path)
        if job is None:
            job = self._jobs[path] = RoundJob(path, self.payload, self._member)
        return job

    def writer(self, live: GradWriter, settling: bool) -> Landing:
        return self._landing

    # ---- the inner optimizer's steps ---------------------------------------------------------------

    def _inner_step(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s ``step()``, whose hook runs now, is an inner step: it steps this model's
        parameters, and no ``step()`` of an optimizer that does runs around it (a subclass whose ``step()``
        calls ``super().step()``, a wrapper whose ``step()`` calls the wrapped optimizer's, as SAM's does:
        torch runs the hooks at every level, and the outermost counts)."""
        if not self._steps_model(optimizer) or sum(map(self._steps_model, running_steps())) > 1:
            return False
        self._check_one_optimizer(optimizer)
        return True

    def _steps_model(self, optimizer: Optimizer | None) -> bool:
        """Whether ``optimizer`` steps this model's parameters (DiLoCo's outer optimizer aside)."""
        if optimizer is None or optimizer is self.outer:
            return False
        steps_model = self._steps_model_of.get(optimizer)
        if steps_model is None:
            steps_model = self._steps_model_of[optimizer] = any(
                id(p) in self._synced for group in optimizer.param_groups for p in group["params"])
        return steps_model

    def _check_one_optimizer(self, optimizer: Optimizer) -> None:
        inner = self._inner() if self._inner is not None else None
        if inner is None:
            self._inner = weakref.ref(optimizer)
        elif inner is not optimizer:
            raise RuntimeError(
                f"PoseidonDDP(sync_every={self.sync_every}) counts the step() calls of one optimizer over the model's "
                f"parameters and syncs after every {self.sync_every} of them; a second one ({type(optimizer).__name__}, "
                f"besides {type(inner).__name__}) stepped them: use one optimizer with param groups (or drop the "
                "first one before building another)")

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        if self._inner_step(optimizer) and self.steps % self.sync_every == 0:
            self.round_begins()

    def _after_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._inner_step(optimizer):
            return
        self.steps += 1
        self._agreed.clear()
        if self._flight is not None and self.steps == self._flight.lands_after:
            self._land()
        if self.steps % self.spacing == 0:
            self._send((self.steps // self.spacing - 1) % self.fragments)

    def defers(self, learned: bool) -> bool:
        return self.delay > 0 and not self._at_once

    def _send(self, fragment: int) -> None:
        """The outer sync of ``fragment`` (collective: every rank after the H-th inner step of its round);
        without a delay it lands at once."""
        self._syncing = fragment
        deferred = self.defers(learned=True)
        if deferred:
            sent = {id(p): p.detach().clone() for b in self.engine.buckets if self._member(b) for p in b.params}
            self._flight = Flight(self.steps + self.delay, sent)
        self.engine.sync_now()  # with a delay the pass is deferred: its jobs run on while the next steps compute
        if not deferred:
            self._land()

    def end_round(self, engine: Engine) -> None:
        """End the round now (collective): the sync in flight lands, then every fragment not already the
        same on every rank syncs and lands at once (one that just synced is not synced again: DiLoCo's
        outer optimizer would take an empty step); every rank then holds the same parameters."""
        if self._flight is not None:
            self._land()
        self._at_once = True
        try:
            for fragment in sorted(set(range(self.fragments)) - self._agreed):
                self._send(fragment)
        finally:
            self._at_once = False

    @torch.no_grad()
    def _land(self) -> None:
        """The round's averages (waited for, if in flight) into the parameters, the steps taken meanwhile
        kept on top; then the buffers (collective)."""
        engine = self.engine
        engine.settle()  # a sync in flight: its averages into take() (nothing when it settled already)
        flight, self._flight = self._flight, None
        if flight is None:
            self._agreed.add(self._syncing)
        landed = [p for p in engine.params if id(p) in self.averages]
        drift = [] if flight is None else [p - flight.sent[id(p)] for p in landed]
        try:
            self.round_ends()  # before the buffers: a failure there leaves the round complete, not half applied
        finally:
            self.averages = {}
        for p, steps_meanwhile in zip(landed, drift):
            p.add_(steps_meanwhile)
        if self.options.average_buffers and engine.world_size > 1:
            average_into([b for b in engine.module.buffers() if b.is_floating_point()], engine.control)

    # ---- what it supports, what it keeps ----------------------------------------------------------

    def refuse_join(self) -> None:
        raise RuntimeError(f"join() (uneven inputs) is not supported with sync_every={self.sync_every}: every rank must "
                           "reach every outer sync; give every rank the same number of batches "
                           "(DistributedSampler(drop_last=True))")

    @property
    def in_flight_steps(self) -> int:
        return self.delay

    def state_dict(self, names: dict[int, str]) -> dict:
        """The steps taken, what the round keeps, and a sync in flight (the caller settled it: its averages
        are in): what was sent and its averages, by parameter name."""
        flight = self._flight
        entry = {"mode": self.name, "sync_every": self.sync_every, "fragments": self.fragments, "steps": self.steps,
                 **self.round_state(names)}
        if flight is not None:
            entry["in_flight"] = {"sent": {names[key]: t.clone() for key, t in flight.sent.items()},
                                  "averages": {names[key]: t.clone() for key, t in self.averages.items()}}
        return {"delay": self.delay, "periodic": entry}

    def load_state_dict(self, state: dict, params: dict[str, nn.Parameter]) -> None:
        check_delay(state, self.delay)
        entry = state.get("periodic")
        if not isinstance(entry, dict):
            raise ValueError(f"the consistency state was saved without sync_every (keys {sorted(state)}); this model "
                             f"runs {self.name} with sync_every={self.sync_every}: resume with the options it was saved "
                             "with")
        saved = (entry.get("mode"), entry.get("sync_every"), entry.get("fragments", 1))
        if saved != (self.name, self.sync_every, self.fragments):
            raise ValueError(f"the consistency state was saved by {saved[0]} with sync_every={saved[1]}, fragments="
                             f"{saved[2]}; this model runs {self.name} with sync_every={self.sync_every}, fragments="
                             f"{self.fragments}: resume with the options it was saved with")
        steps = entry.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"consistency state 'steps' must be an int >= 0, got {steps!r}")
        flight = self._checked_flight(entry.get("in_flight"), params, steps)
        self.load_round(entry, params, steps)
        self.steps = steps
        if flight is not None:
            self._syncing, self._flight, self.averages = flight
        else:
            self._flight, self.averages = None, {}
        whole_rounds = self.fragments == 1 and not self.delay and steps % self.sync_every == 0
        self._agreed = set(range(self.fragments)) if whole_rounds else set()  # saved right after a sync, or not

    def _flying_after(self, steps: int) -> bool:
        """Whether a sync is in flight after ``steps`` inner steps: sent after step kS (k >= 1, S = H /
        fragments), it lands after step kS + delay."""
        return steps >= self.spacing and steps % self.spacing < self.delay

    def _checked_flight(self, saved: object, params: dict[str, nn.Parameter], steps: int
                        ) -> tuple[int, Flight, dict[int, Tensor]] | None:
        """The saved sync in flight, checked against the step count and the parameters (nothing changes
        when a check fails), as its fragment, a :class:`Flight` and its averages."""
        if self._flying_after(steps) != (saved is not None):
            raise ValueError(f"consistency state 'in_flight' (a sync sent, not landed yet) must be there exactly when "
                             f"one flies after steps={steps} with sync_every={self.sync_every}, delay={self.delay}: it "
                             f"was {'there' if saved is not None else 'missing'}")
        if saved is None:
            return None
        fragment = (steps // self.spacing - 1) % self.fragments
        members = {id(p) for b in self.engine.buckets if self._fragment_of.get(id(b), 0) == fragment for p in b.params}
        synced = {n for n, p in params.items() if id(p) in members}
        if not isinstance(saved, dict) or set(saved) != {"sent", "averages"}:
            raise ValueError("consistency state 'in_flight' must be a dict with 'sent' and 'averages'")
        sent, averages = saved["sent"], saved["averages"]
        if not isinstance(sent, dict) or set(sent) != synced or not isinstance(averages, dict) or set(averages) - synced:
            raise ValueError(f"consistency state 'in_flight' must hold what every parameter of the fragment in flight "
                             f"sent, and averages of those only ({sorted(synced)})")
        for what, entries in (("sent", sent), ("averages", averages)):
            for name, value in entries.items():
                if not isinstance(value, Tensor) or value.shape != params[name].shape:
                    raise ValueError(f"consistency state 'in_flight' {what} for {name!r} does not have the parameter's "
                                     f"shape {tuple(params[name].shape)}")

        def restored(entries: dict) -> dict[int, Tensor]:
            return {id(params[name]): value.detach().to(params[name].device, params[name].dtype).clone()
                    for name, value in entries.items()}

        lands_after = steps - steps % self.spacing + self.delay
        return fragment, Flight(lands_after, restored(sent)), restored(averages)

    def trace_args(self) -> dict:
        return {"inner_steps": self.steps}

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class LocalSGD(Periodic):
    """Local SGD: the parameters averaged every H inner steps."""

    name = "local-sgd"

    def payload(self, param: nn.Parameter) -> Tensor:
        return self.sent_value(param)

    def round_ends(self) -> None:
        for p in self.engine.params:
            average = self.averages.get(id(p))
            if average is not None:
                p.copy_(average)


class DiLoCo(Periodic):
    """DiLoCo: the outer optimizer steps the round's start parameters with the averaged pseudo-gradient."""

    name = "diloco"

    def __init__(self, options: PeriodicOptions) -> None:
        super().__init__(options)
        #: id(param) -> its value when the round began (with a delay or fragments: its last outer step's
        #: result, kept from the first step on; else taken when a round's first step begins)
        self._start: dict[int, Tensor] | None = None
        self._keeps_start = options.delay > 0 or options.fragments > 1

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        self.outer = self.options.build_outer(engine.params)

    def round_begins(self) -> None:
        if self._start is None:
            self._start = {id(p): p.detach().clone() for p in self.engine.params}

    def payload(self, param: nn.Parameter) -> Tensor:
        return self._start[id(param)] - self.sent_value(param)

    def round_ends(self) -> None:
        """The outer step from the round's start: each parameter's ``.grad`` is its averaged pseudo-gradient
        for the step only. The next round starts from its result when a delay keeps steps on top of it,
        else where its first inner step begins."""
        params = self.engine.params
        kept = [p.grad for p in params]
        for p in params:
            if id(p) in self.averages:
                p.copy_(self._start[id(p)])
            p.grad = self.averages.get(id(p))
        try:
            self.outer.step()
        finally:
            for p, grad in zip(params, kept):
                p.grad = grad
            if self._keeps_start or self.steps % self.sync_every:  # (the latter: end_round() mid-round)
                self._start.update({id(p): p.detach().clone() for p in params if id(p) in self.averages})
            else:
                self._start = None

    def round_state(self, names: dict[int, str]) -> dict:
        start = None if self._start is None else {names[key]: value.clone() for key, value in self._start.items()}
        return {"start": start, "outer": copy.deepcopy(self.outer.state_dict()), "outer_options": self._outer_options()}

    def _outer_options(self) -> dict:
        """``outer=`` as saved: torch's ``load_state_dict`` takes the saved hyperparameters (and a state of
        another class breaks its ``step()``), so a resume with other outer options is refused instead."""
        cls = self.options.outer_class
        return {"class": f"{cls.__module__}.{cls.__qualname__}", "arguments": dict(self.options.outer_kwargs)}

    def load_round(self, entry: dict, params: dict[str, nn.Parameter], steps: int) -> None:
        start = entry.get("start")
        expected = steps > 0 if self._keeps_start else steps % self.sync_every != 0
        if expected != (start is not None):
            when = "after the first step (with a delay or fragments)" if self._keeps_start else \
                f"'steps' is not a multiple of sync_every={self.sync_every}"
            raise ValueError(f"consistency state 'start' (the round's start parameters) must be there exactly when "
                             f"{when}: it was {'missing' if expected else 'there'} at steps={steps}")
        if start is not None:
            if not isinstance(start, dict) or set(start) != {n for n, p in params.items() if id(p) in self._synced}:
                raise ValueError("consistency state 'start' must hold every synced parameter by name "
                                 f"({sorted(n for n, p in params.items() if id(p) in self._synced)})")
            for name, value in start.items():
                if not isinstance(value, Tensor) or value.shape != params[name].shape:
                    raise ValueError(f"consistency state 'start' for {name!r} does not have the parameter's shape "
                                     f"{tuple(params[name].shape)}")
        if "outer" not in entry:
            raise ValueError("the consistency state holds no outer optimizer state")
        saved, mine = entry.get("outer_options"), self._outer_options()
        if saved != mine:
            raise ValueError(f"the consistency state was saved with outer={saved}; this model has outer={mine} (the "
                             "outer optimizer's saved state and hyperparameters would replace them, or break its step): "
                             "resume with the outer= it was saved with")
        self.outer.load_state_dict(entry["outer"])
        self._start = None if start is None else {
            id(params[name]): value.detach().to(params[name].device, params[name].dtype).clone()
            for name, value in start.items()}
