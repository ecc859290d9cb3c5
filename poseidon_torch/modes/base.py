"""The mode protocol: a consistency model as one object the engine calls at named points (compare Bagua's
per-algorithm classes and torch's comm hooks, ``../shared/notes/policies.md``).

The engine (``engine.py``) runs every synced pass the same way: hooks -> ready -> channel -> a bucket's
job -> the end of the pass. A :class:`Mode` decides what happens at its fixed points; the engine never
asks which mode it runs. The points, in the order a step meets them:

- the engine starts: :meth:`Mode.attach` (hooks, shards), then around every bucket (re)build
  :meth:`Mode.buckets_changing` / :meth:`Mode.buckets_changed`; :meth:`Mode.job` is the job a bucket on a
  path runs; :meth:`Mode.split_buckets` says which jobs the channel plan cuts at their update;
- a forward of the wrapper begins: :meth:`Mode.before_forward`;
- a synced backward starts: :meth:`Mode.before_backward`; its pass opens: :meth:`Mode.pass_opened`;
- a split job's first slot ends / the first second slot begins: :meth:`Mode.first_slot_done`,
  :meth:`Mode.second_slots_begin`;
- the backward ends (close or defer): :meth:`Mode.defers` (may ``backward()`` return while the jobs run),
  :meth:`Mode.split_pass_error` (trouble some ranks had in a pass the others stepped past),
  :meth:`Mode.facts_known`; then either the pass closes at once (:meth:`Mode.jobs_done`), or it is
  deferred (:meth:`Mode.deferring`) and closes when it *settles* (:meth:`Mode.drained` once every job is
  done, then the close, then :meth:`Mode.settled`); :meth:`Mode.writer` says where a closing pass's
  averages go, :meth:`Mode.late_gradients` whether gradients that came after their bucket's job can be
  averaged again, :meth:`Mode.backward_returned` what ``.grad`` holds once ``backward()`` returns,
  :meth:`Mode.pass_closed` what the pass's facts change;
- after the optimizer step: :meth:`Mode.after_step` (``ServerOptimizer.step``);
- a mode that does not sync gradients (``syncs_gradients`` False) runs its own passes where it chooses,
  outside any backward (:meth:`Engine.sync_now`): the same points then follow in the same order;
- what it supports: the class attributes below, and :meth:`Mode.refuse_join`;
- what a checkpoint must carry: :meth:`Mode.state_dict` / :meth:`Mode.load_state_dict`;
- for the tracer, a timeout's message and the simulator: :meth:`Mode.trace_args`, :meth:`Mode.diagnosis`,
  :meth:`Mode.layout`; the end: :meth:`Mode.close`.

Invariant: a wrapper's mode is chosen once, before its engine starts (``modes.resolve``), and never
changes; its state is explicit and checkpointable.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from torch import nn

from ..barrier import SyncError
from ..bucket import Bucket, Layer
from ..coordinator import Coordinator, PassFacts
from ..paths import GradWriter, Job, Path, Paths
from ..pools import ChannelGroups, Collectives
from ..trace import Recorder
from .state import check_delay, check_no_entries

#: Before the first backward, neighbouring layers are fused up to this size (then rebuilt from the measured
#: order and timings, in a lockstep mode).
INITIAL_FUSION_BYTES = 256 * 1024


class Engine(Protocol):
    """What a mode sees of the engine it is attached to (``engine.py``; this package never imports it)."""

    rank: int
    world_size: int
    timeout: float
    module: nn.Module
    layers: list[Layer]
    params: list[nn.Parameter]
    buckets: list[Bucket]
    paths: Paths
    coordinator: Coordinator
    control: Collectives
    recorder: Recorder

    def bucket_of(self, param: nn.Parameter) -> Bucket: ...

    def pending(self) -> Any:
        """The deferred pass whose jobs may still run, or None."""

    def wait_for_bucket(self, index: int, deferred: Any, what: str) -> None: ...

    def after_job(self, bucket: Bucket) -> None: ...

    def fail(self, error: SyncError) -> None: ...

    def drain(self, output: object = None) -> None: ...

    def settle(self, output: object = None) -> None: ...

    def finish_aborted_pass(self) -> None: ...

    def sync_now(self) -> None:
        """A pass over every bucket now, outside any backward (collective): :meth:`Mode.job` stages what
        is sent, :meth:`Mode.writer` takes the averages."""

    def backward_raised(self) -> bool: ...


class Mode:
    """A consistency model (see the module docstring). The defaults are those of BSP averaging."""

    #: what ``PoseidonDDP.consistency_state_dict()`` calls it
    name: ClassVar[str] = ""
    #: every rank takes part in every step's collectives (the facts, buffers, learning the buckets); a
    #: mode that is not runs every rank on its own clock: its buckets are fused once, on the default path
    lockstep: ClassVar[bool] = True
    #: no barrier per step: a deferred pass's end-of-pass facts are read when it settles (not before
    #: ``backward()`` returns), and rank 0's buffers, sent as a synced forward starts, land as the next starts
    barrier_free: ClassVar[bool] = False
    #: a deferred pass settles when the next synced pass opens (its first gradient, in the next backward)
    #: instead of at the end of the next synced forward: nothing a forward reads depends on it
    settles_in_next_pass: ClassVar[bool] = False
    #: how many nice steps below the training thread the threads carrying the sync run
    #: (``pools.started_at_lower_priority``)
    sync_nice: ClassVar[int] = 0
    #: what the buckets hold besides their largest layer before the first backward (or for good, when not
    #: ``lockstep``), at most the wrapper's ``fusion_bytes``
    first_fusion_bytes: ClassVar[int] = INITIAL_FUSION_BYTES
    #: what makes a synced backward return before its sync is done, in error messages
    deferral: str = ""
    #: a backward syncs its gradients (False: every backward is local, no pass opens; the mode syncs at
    #: points of its own through :meth:`Engine.sync_now`, and the wrapper's option ``hybrid`` has no use)
    syncs_gradients: ClassVar[bool] = True

    # ---- the engine starts ------------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        """The engine starts with this mode (before its first buckets are installed)."""

    def buckets_changing(self) -> None:
        """The buckets are about to be rebuilt (collective, between passes): what must survive, gather it."""

    def buckets_changed(self, buckets: Sequence[Bucket]) -> None:
        """New buckets are installed and the paths prepared for them."""

    def job(self, path: Path) -> Job:
        """The job a bucket on ``path`` runs (the path itself, or the path composed with more)."""
        return path

    def split_buckets(self, buckets: int) -> Sequence[int]:
        """The buckets whose jobs the channel plan cuts where they yield ``"update"`` (``schedule.py``)."""
        return ()

    # ---- a step ----------------------------------------------------------------------------------

    def before_forward(self) -> None:
        """A forward of the wrapper begins (training thread)."""

    def before_backward(self, params: Sequence[nn.Parameter]) -> None:
        """A synced backward starts (before its pass opens)."""

    def pass_opened(self) -> None:
        """A synced pass opens (its first gradient)."""

    def first_slot_done(self) -> None:
        """A split job's first slot is done (its channel thread)."""

    def second_slots_begin(self, groups: ChannelGroups, buckets: int) -> None:
        """The split plan's first second slot begins (its channel thread, the same slot on every rank)."""

    def defers(self, learned: bool) -> bool:
        """Whether a clean pass's ``backward()`` may return before its jobs are done (``learned``: the
        buckets are fixed)."""
        return False

    def split_pass_error(self, facts: PassFacts) -> SyncError | None:
        """The error that ends the engine when some ranks, not all, had trouble in a pass the others
        already stepped past (None: the pass closes as usual)."""
        return None

    def facts_known(self, aborted: bool) -> None:
        """The pass's facts are in (training thread)."""

    def jobs_done(self, facts: PassFacts) -> None:
        """Every job of a pass that closes in its backward is done (before the close)."""

    def deferring(self) -> None:
        """The pass's ``backward()`` returns while its jobs may still run."""

    def drained(self, output: object) -> None:
        """Every job of the deferred pass is done (``output``: the forward that just ran, or None)."""

    def writer(self, live: GradWriter, settling: bool) -> GradWriter | None:
        """Where the closing pass's averages go (``live``: ``.grad``; None: nothing is written);
        ``settling``: the pass was deferred."""
        return live

    def settled(self) -> None:
        """A deferred pass's averages are written (where :meth:`writer` said; its close may come later)."""

    def late_gradients(self, late: Sequence[Bucket]) -> SyncError | None:
        """Gradients arrived after ``late``'s jobs: None to average them again through the default path,
        or the error that says why they cannot be."""
        return None

    def backward_returned(self, buckets: Sequence[Bucket], averaged: bool) -> None:
        """A synced ``backward()`` returns (``averaged``: its pass closed, its averages are in ``.grad``)."""

    def pass_closed(self, facts: PassFacts, learned: bool) -> bool:
        """A clean pass closed; True to plan the channels again (between passes)."""
        return False

    def after_step(self) -> None:
        """The optimizer's ``step()`` ran (a ``ServerOptimizer``'s)."""

    def end_round(self, engine: Engine) -> None:
        """``PoseidonDDP.end_round()``: whatever a step left in flight lands now."""
        engine.settle()

    # ---- what it supports, what it keeps ----------------------------------------------------------

    @property
    def in_flight_steps(self) -> int:
        """How many steps' updates a step's end leaves in flight (Pipe-SGD's k): what a resume from a
        checkpoint without :meth:`state_dict` loses."""
        return 0

    def refuse_join(self) -> None:
        """Raise if this mode cannot train on uneven inputs (``PoseidonDDP.join``)."""

    def state_dict(self, names: dict[int, str]) -> dict:
        """The in-flight state a checkpoint must carry (``names``: ``id(parameter)`` -> its name)."""
        return {"delay": 0}

    def load_state_dict(self, state: dict, params: dict[str, nn.Parameter]) -> None:
        check_delay(state, 0)
        check_no_entries(state, self.name)

    def trace_args(self) -> dict:
        """What the tracer's span of the iteration that closes now carries about consistency."""
        return {}

    def diagnosis(self) -> str:
        """What this mode knows of why a wait for the sync timed out ("" when nothing)."""
        return ""

    def layout(self) -> dict:
        """What the simulator must know of this mode: whether a forward may wait for the network (its
        span is then not compute alone), and whether the owners update the parameters."""
        return {"forward_waits": False, "server": False}

    def close(self) -> None:
        """The engine closes."""
