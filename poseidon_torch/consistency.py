"""The consistency model: when the averages of a synced pass become visible, as one policy object.

The engine (``engine.py``) runs every synced pass the same way (hooks -> ready -> channel -> path); a
policy decides what happens at its fixed points (compare Bagua's per-algorithm classes and torch DDP's
comm hooks, ``../shared/notes/policies.md``):
- ``defers``: whether ``backward()`` may return while the pass's jobs still run (the engine then
  *settles* the pass at the end of the next synced forward, or with ``settles_in_next_pass`` when the
  next synced backward produces its first gradient);
- ``writer_for_settle()``: where the averages of a deferred pass go when it settles;
- ``backward_returned(buckets)``: what ``.grad`` holds once a synced ``backward()`` returns;
- parameter-server mode: ``take_values(bucket)`` (a bucket's new values arrived), ``values_taken()``
  (all of a pass's), ``before_forward()`` (what a forward reads), ``value_source`` (what the owners
  step from), ``forget_values()`` (the user loaded parameters);
- ``state_dict()`` / ``load_state_dict()``: the in-flight state a checkpoint must carry;
- ``sync_nice``: how many nice steps below the training thread the threads that carry the sync run.

:class:`BSP` (the default): a synced backward returns when every sync is done and ``.grad`` holds the
average of its own gradients. :class:`Delayed` (Pipe-SGD, Li et al. 2018): ``backward()`` of step t
returns at once and ``.grad`` then holds the average of step t-k (None for the first k steps, so
torch's optimizers skip them). Invariants of :class:`Delayed`:
- the gradients of pass n are what ``.grad`` holds when its backward ends (as under BSP: with the usual
  ``zero_grad()``, the local gradient of step n); they leave ``.grad`` at once and come back averaged,
  as the ``.grad`` of every parameter, at the end of pass n+k: one object per pass, nothing of one
  pass mixes with another's;
- passes are averaged in order and handed back in order; a pass aborted on every rank (each raised in
  that backward) is not a step of the pipeline on any rank, so every rank's pipeline stays the same;
- no barrier per step (``barrier_free``): the ranks learn of each other's trouble in a pass (a rank
  raised in backward, a gradient came after its bucket's sync) when it settles, after they stepped,
  so a pass in which only some ranks had trouble ends the engine on every rank;
- the averages are deterministic: the same bits as BSP's average of the same gradients.
:class:`DelayedValues` is Pipe-SGD in parameter-server mode: the forward of step t reads the values of
step t-1-k, while the owners step from the newest values: w_{t+1} = opt(w_t, g(w_{t-k})).
SSP and asynchronous SGD (``ServerOptimizer(..., staleness=s)``) are the policy ``Stale`` in ``stale.py``:
its ranks run on their own clocks, so it is not ``lockstep`` (the engine then issues no per-step
collective) and it builds its own server and paths (``server_for``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .bucket import Bucket
from .fc import FCLayer
from .paths import GradWriter
from .paths.ps import PSPath
from .pools import Collectives
from .server import Server, apply_values


class LiveGrads:
    """The parameters' ``.grad`` (BSP): ``scatter`` is the core's (it also marks the bucket synced)."""

    def __init__(self, scatter: Callable[[Bucket], None]) -> None:
        self.scatter = scatter

    def add(self, layer: FCLayer, grads: tuple[Tensor, ...]) -> None:
        layer.add_to_grad(grads)


class HeldGrads:
    """A pass's gradients held aside (``id(param)`` -> tensor): the ``.grad`` objects its backward left,
    overwritten with the averages as BSP would overwrite ``.grad``."""

    def __init__(self, grads: dict[int, Tensor]) -> None:
        self.grads = grads

    def scatter(self, bucket: Bucket) -> None:
        with bucket.averages() as averages:
            for p, averaged in averages:
                held = self.grads.get(id(p))
                if held is None:
                    self.grads[id(p)] = averaged.clone()
                else:
                    held.copy_(averaged)

    def add(self, layer: FCLayer, grads: tuple[Tensor, ...]) -> None:
        for p, grad in zip(layer.params, grads):
            held, grad = self.grads.get(id(p)), grad.to(p.dtype)
            self.grads[id(p)] = grad if held is None else held + grad


class BSP:
    """Bulk synchronous parallel: ``.grad`` holds this step's average when ``backward()`` returns; in
    parameter-server mode a forward reads the values of the last step (the engine's per-layer waits)."""

    delay = 0
    defers = False
    value_source = None  #: the owners step from the live parameters
    waits_per_layer = True  #: the per-layer forward waits of lazy pulls apply
    lockstep = True  #: every rank takes part in every step's collectives (the facts, buffers, learning)
    #: no barrier per step: a deferred pass's end-of-pass facts are read when it settles (not before
    #: ``backward()`` returns) and rank 0's buffers, sent as a synced forward starts, land as the next
    #: one starts
    barrier_free = False
    #: a deferred pass settles when the next synced pass opens (its first gradient, in the next backward)
    #: instead of at the end of the next synced forward: nothing a forward reads depends on it, so its
    #: jobs get the next forward and the first part of the next backward to finish in
    settles_in_next_pass = False
    #: how many nice steps below the training thread the threads carrying the sync run
    #: (``pools.started_at_lower_priority``): under BSP the sync is what the end of backward waits for
    sync_nice = 0
    #: a policy that is not ``lockstep`` cannot learn buckets from a common step: its buckets are fused
    #: once, in reverse registration order, up to this many bytes besides the largest layer (or the
    #: engine's ``fusion_bytes`` when smaller)
    fixed_fusion_bytes: int | None = None

    def server_for(self, facade, kv: PSPath, control: Collectives, timeout: float) -> tuple[Server, None]:
        """Parameter-server mode: the shards over ``kv``'s chunks (every path's job gets the update at the
        owners, ``paths/update.py``), and no job of the policy's own."""
        return Server(facade, self.value_source), None

    def take_values(self, bucket: Bucket) -> None:
        apply_values(bucket)

    def values_taken(self) -> None:
        pass

    def before_forward(self) -> None:
        pass

    def before_backward(self, params: Sequence[nn.Parameter]) -> None:
        pass

    def forget_values(self) -> None:
        pass

    def diagnosis(self) -> str:
        """What this policy knows of why a wait for the sync jobs timed out ("" when nothing)."""
        return ""

    def flush(self) -> None:
        pass

    def writer_for_settle(self) -> GradWriter | None:
        return None  # a BSP pass is deferred only in parameter-server mode, which writes no gradient

    def settled(self) -> None:
        pass

    def backward_returned(self, buckets: Sequence[Bucket], averaged: bool) -> None:
        pass

    def state_dict(self, names: dict[int, str]) -> dict:
        return {"delay": 0}

    def trace_args(self) -> dict:
        """What the tracer's span of the iteration that closes now carries about consistency."""
        return {}

    def load_state_dict(self, state: dict, params: dict[str, nn.Parameter]) -> None:
        _check_delay(state, 0)


@dataclass
class _InFlight:
    """One pass in the pipeline: its gradients, averaged once ``averaged``."""

    grads: HeldGrads
    averaged: bool = field(default=False)


class Delayed(BSP):
    """Pipe-SGD: ``.grad`` after step t's backward is the average of step t-k's gradients. Barrier-free:
    a step's only dependency on the other ranks is its own sync, k steps later."""

    defers = True
    barrier_free = True
    settles_in_next_pass = True  #: the averages are handed out only when the next synced backward returns
    #: the sync has a whole iteration and the training thread is the critical path: it gets the cores
    #: first (measured: README, Pipe-SGD, *Measured again*)
    sync_nice = 10

    def __init__(self, delay: int) -> None:
        if delay < 1:
            raise ValueError(f"Delayed needs delay >= 1, got {delay}")
        self.delay = delay
        self._pipeline: deque[_InFlight] = deque()
        #: id(param) -> (the averaged gradient handed to it, that tensor's version then)
        self._handed: dict[int, tuple[Tensor, int]] = {}

    def before_backward(self, params: Sequence[nn.Parameter]) -> None:
        """A synced backward starts: the averaged gradients the last one handed out must have been used
        and cleared (each synced backward is one step of the pipeline). Accumulating on top of them
        (several synced backwards per optimizer step, or no ``zero_grad()`` at all) would sync a mix of
        steps: refused."""
        kept = [p for p in params if id(p) in self._handed and p.grad is self._handed[id(p)][0]
                and p.grad._version == self._handed[id(p)][1]]
        if kept:
            raise RuntimeError(
                f"PoseidonDDP(delay={self.delay}): a synced backward started while .grad still holds, untouched, the "
                f"averaged gradients the last backward handed out ({len(kept)} parameter(s)): each synced backward is "
                "one step of the pipeline, so step and call zero_grad() between synced backwards; accumulate "
                "micro-batches under no_sync()")

    def writer_for_settle(self) -> GradWriter:
        """The oldest pass not yet averaged: the one that settles (passes settle in order)."""
        return self._oldest_pending().grads

    def settled(self) -> None:
        self._oldest_pending().averaged = True

    def _oldest_pending(self) -> _InFlight:
        for entry in self._pipeline:
            if not entry.averaged:
                return entry
        raise RuntimeError("Pipe-SGD: no pass in flight to settle (internal error)")

    def backward_returned(self, buckets: Sequence[Bucket], averaged: bool) -> None:
        """Take this pass's gradients out of ``.grad`` (already averaged into it when the pass closed
        before returning) and put back the average of the pass ``delay`` steps older; what ``.grad``
        holds now is synced (no bucket is dirty)."""
        params = [p for bucket in buckets for p in bucket.params]
        for bucket in buckets:
            bucket.dirty.zero_()
        self._pipeline.append(_InFlight(HeldGrads({id(p): p.grad for p in params if p.grad is not None}), averaged))
        due = self._pipeline.popleft() if len(self._pipeline) > self.delay else None
        if due is not None and not due.averaged:
            raise RuntimeError("Pipe-SGD: the pass due now was never settled (internal error)")
        held = due.grads.grads if due is not None else {}
        for p in params:
            p.grad = held.get(id(p))
        self._handed = {id(p): (p.grad, p.grad._version) for p in params if p.grad is not None}

    def state_dict(self, names: dict[int, str]) -> dict:
        """The averaged gradients in flight, oldest first, by parameter name (every pass settled)."""
        if any(not entry.averaged for entry in self._pipeline):
            raise RuntimeError("Pipe-SGD: settle the engine before saving its pipeline (internal error)")
        return {"delay": self.delay,
                "in_flight": [{names[key]: grad.detach().clone() for key, grad in entry.grads.grads.items()}
                              for entry in self._pipeline]}

    def load_state_dict(self, state: dict, params: dict[str, nn.Parameter]) -> None:
        entries = _checked_entries(state, self.delay, "in_flight", params)
        if len(entries) > self.delay:
            raise ValueError(f"Pipe-SGD state holds {len(entries)} passes in flight, more than delay={self.delay}")
        self._pipeline = deque(_InFlight(HeldGrads({id(params[n]): t for n, t in grads.items()}), averaged=True)
                               for grads in entries)
        self._handed = {}


#: what each mode's state holds its entries under, and the mode's name
_ENTRIES = {"in_flight": "PoseidonDDP(delay=k) (averaged gradients)", "held": "ServerOptimizer(delay=k) (values)"}


def _check_delay(state: object, delay: int) -> None:
    if not isinstance(state, dict) or "delay" not in state:
        raise ValueError(f"not a PoseidonDDP consistency state (a dict from consistency_state_dict()): {state!r:.80}")
    saved = state["delay"]
    if not isinstance(saved, int) or isinstance(saved, bool) or saved != delay:
        raise ValueError(f"the state was saved with delay={saved!r}, this PoseidonDDP has delay={delay}")


def _checked_entries(state: object, delay: int, key: str, params: dict[str, nn.Parameter]) -> list[dict]:
    """The entries of a saved state, each ``{name: tensor}`` converted to its parameter's device and dtype,
    after checking all of it (nothing is changed when a check fails)."""
    _check_delay(state, delay)
    if key not in state:
        other = next((k for k in _ENTRIES if k in state), None)
        saved_by = f"saved by {_ENTRIES[other]}" if other else "without entries"
        raise ValueError(f"the consistency state was {saved_by}; this model runs {_ENTRIES[key]}")
    entries = state[key]
    if not isinstance(entries, list):
        raise ValueError(f"consistency state {key!r} must be a list, got {type(entries).__name__}")
    checked = []
    for entry in entries:
        if key == "held" and not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], int)):
            raise ValueError(f"consistency state 'held' entries are (steps from now, {{name: tensor}}), got {entry!r:.80}")
        values = entry[1] if key == "held" else entry
        if not isinstance(values, dict):
            raise ValueError(f"consistency state {key!r} holds a {type(values).__name__}, not {{name: tensor}}")
        converted = {}
        for name, value in values.items():
            if name not in params:
                raise ValueError(f"Pipe-SGD state names a parameter this model does not sync: {name!r}")
            if not isinstance(value, Tensor) or value.shape != params[name].shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"Pipe-SGD state for {name!r} is {shape}, the parameter is {tuple(params[name].shape)}")
            converted[name] = value.detach().to(params[name].device, params[name].dtype).clone()
        checked.append((entry[0], converted) if key == "held" else converted)
    return checked


def consistency_for(delay: int) -> BSP | Delayed:
    """The policy of ``PoseidonDDP(delay=...)``."""
    return Delayed(delay) if delay else BSP()


def check_delay(delay: object) -> int:
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise TypeError(f"PoseidonDDP option delay must be an int >= 0 (steps), got {delay!r}")
    return delay



class DelayedValues(BSP):
    """Pipe-SGD in parameter-server mode (``ServerOptimizer(..., delay=k)``): the new values of step n
    are held until the forward of step n+1+k; the owners step from the newest values meanwhile.
    Invariants: values are held in pass order and applied in that order, each pass's values once; a
    pass that was aborted is no step (it is not counted, on any rank); the newest values are replaced
    only on the training thread, between passes, so an owner's step reads one whole pass's values."""

    defers = True
    waits_per_layer = False

    def __init__(self, delay: int) -> None:
        if delay < 1:
            raise ValueError(f"DelayedValues needs delay >= 1, got {delay}")
        self.delay = delay
        self._ended = 0  #: synced passes whose backward returned (not aborted)
        self._taken = 0  #: passes whose values are all held
        self._filling: dict[nn.Parameter, Tensor] = {}
        self._held: deque[tuple[int, dict[nn.Parameter, Tensor]]] = deque()  #: (pass, values), oldest first
        self._newest: dict[int, Tensor] = {}  #: id(param) -> its newest value (what the owners step from)
        self._restored = False  #: values loaded from a checkpoint, no forward since: loading the model keeps them

    def value_source(self, param: nn.Parameter) -> Tensor:
        return self._newest.get(id(param), param)

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

    def state_dict(self, names: dict[int, str]) -> dict:
        """The values held (not yet read by a forward), oldest first, by parameter name, with how many
        steps from now each one lands."""
        return {"delay": self.delay,
                "held": [(n - self._ended, {names[id(p)]: v.clone() for p, v in values.items()})
                         for n, values in self._held]}

    def load_state_dict(self, state: dict, params: dict[str, nn.Parameter]) -> None:
        """Restore :meth:`state_dict`'s values (checked first: a bad state changes nothing); loading the
        model's own state before or after this, before the next forward, keeps them."""
        entries = _checked_entries(state, self.delay, "held", params)
        self._held = deque((self._ended + offset, {params[n]: v for n, v in values.items()}) for offset, values in entries)
        self._newest = {id(p): v for _, values in self._held for p, v in values.items()}
        self._taken = self._ended
        self._restored = True
