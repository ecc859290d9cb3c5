"""Pipe-SGD (Li et al. 2018), ``PoseidonDDP(model, delay=k)``: ``.grad`` after step t's backward is the
average of step t-k's gradients.

``backward()`` of step t returns at once and ``.grad`` then holds the average of step t-k (None for the
first k steps, so torch's optimizers skip them). Invariants:
- the gradients of pass n are what ``.grad`` holds when its backward ends (as under BSP: with the usual
  ``zero_grad()``, the local gradient of step n); they leave ``.grad`` at once and come back averaged,
  as the ``.grad`` of every parameter, at the end of pass n+k: one object per pass, nothing of one
  pass mixes with another's;
- passes are averaged in order and handed back in order; a pass aborted on every rank (each raised in
  that backward) is not a step of the pipeline on any rank, so every rank's pipeline stays the same;
- no barrier per step (``barrier_free``): the ranks learn of each other's trouble in a pass (a rank
  raised in backward, a gradient came after its bucket's sync) when it settles, after they stepped,
  so a pass in which only some ranks had trouble ends the engine on every rank;
- the averages are deterministic: the same bits as BSP's average of the same gradients;
- the sync has a whole iteration and the training thread is the critical path: the threads that carry
  it run 10 nice steps below the training thread (measured: README, Pipe-SGD, *Measured again*).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from ..barrier import SyncError
from ..bucket import Bucket
from ..coordinator import PassFacts
from ..fc import FCLayer
from ..paths import GradWriter
from .base import Engine, Mode
from .state import checked_entries


def delay_option(delay: object) -> int:
    """``PoseidonDDP(delay=...)`` checked: an int >= 0 (steps)."""
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise TypeError(f"PoseidonDDP option delay must be an int >= 0 (steps), got {delay!r}")
    return delay


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


@dataclass
class _InFlight:
    """One pass in the pipeline: its gradients, averaged once ``averaged``."""

    grads: HeldGrads
    averaged: bool = field(default=False)


class PipeSGD(Mode):
    """Pipe-SGD on gradients: barrier-free, a step's only dependency on the other ranks is its own sync,
    k steps later."""

    name = "pipe-sgd"
    barrier_free = True
    settles_in_next_pass = True  #: the averages are handed out only when the next synced backward returns
    sync_nice = 10

    def __init__(self, delay: int) -> None:
        if delay < 1:
            raise ValueError(f"PipeSGD needs delay >= 1, got {delay}")
        self.delay = delay
        self.deferral = f"with delay={delay}"
        self.world_size = 1  #: the engine's, once attached
        self._pipeline: deque[_InFlight] = deque()
        #: id(param) -> (the averaged gradient handed to it, that tensor's version then)
        self._handed: dict[int, tuple[Tensor, int]] = {}

    def attach(self, engine: Engine) -> None:
        self.world_size = engine.world_size

    def defers(self, learned: bool) -> bool:
        return True

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

    def split_pass_error(self, facts: PassFacts) -> SyncError | None:
        """The ranks without trouble in a pass returned from its backward, and stepped, before they could
        learn of the others' trouble: the pass can then neither be skipped nor have its late gradients
        averaged on every rank. None unless some ranks, not all, had trouble."""
        troubled = set(facts.aborted_ranks) | set(facts.late_ranks)
        if not troubled or len(troubled) == self.world_size:
            return None
        if facts.aborted_ranks:
            what = f"the backward of rank(s) {', '.join(map(str, facts.aborted_ranks))} raised"
        else:
            what = (f"a gradient arrived after its bucket's sync on rank(s) {', '.join(map(str, facts.late_ranks))} "
                    "only (reentrant checkpointing or a hook that runs backward again?)")
        return SyncError(f"{what} in a step whose backward returned on the other ranks: with "
                         f"delay={self.delay} (Pipe-SGD, no barrier per step) they learn of it only "
                         "now, after their optimizer step, so that step cannot be skipped on every rank and the "
                         "ranks' parameters may differ. PoseidonDDP cannot continue: resume from a checkpoint "
                         "(delay=0 skips such a step on every rank)")

    def writer(self, live: GradWriter, settling: bool) -> GradWriter:
        """A pass closing in its backward averages into ``.grad`` (it is then taken out, see
        :meth:`backward_returned`); a deferred one into the oldest pass not yet averaged (passes settle
        in order)."""
        return self._oldest_pending().grads if settling else live

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

    def refuse_join(self) -> None:
        raise RuntimeError(f"join() (uneven inputs) is not supported with delay={self.delay} (Pipe-SGD) yet: give "
                           "every rank the same number of batches (DistributedSampler(drop_last=True))")

    @property
    def in_flight_steps(self) -> int:
        return self.delay

    def state_dict(self, names: dict[int, str]) -> dict:
        """The averaged gradients in flight, oldest first, by parameter name (every pass settled)."""
        if any(not entry.averaged for entry in self._pipeline):
            raise RuntimeError("Pipe-SGD: settle the engine before saving its pipeline (internal error)")
        return {"delay": self.delay,
                "in_flight": [{names[key]: grad.detach().clone() for key, grad in entry.grads.grads.items()}
                              for entry in self._pipeline]}

    def load_state_dict(self, state: dict, params: dict[str, nn.Parameter]) -> None:
        entries = checked_entries(state, self.delay, "in_flight", params)
        if len(entries) > self.delay:
            raise ValueError(f"Pipe-SGD state holds {len(entries)} passes in flight, more than delay={self.delay}")
        self._pipeline = deque(_InFlight(HeldGrads({id(params[n]): t for n, t in grads.items()}), averaged=True)
                               for grads in entries)
        self._handed = {}

    def layout(self) -> dict:
        return {"forward_waits": True, "server": False}
