"""The path protocol: one way of moving a bucket's gradient between the ranks (compare torch DDP's comm
hooks, one module per hook with its state explicit, ``../shared/notes/policies.md``).

A :class:`Path` says what it is (class attributes), what it would cost, and does the moving:
- ``name`` (what overrides, plans, stats and traces call it), ``exact`` (every rank ends with the
  average of the ranks' gradients, to fp32 rounding; a path that is not, a *lossy* one, is only ever
  used where the user asked for it: ``PoseidonDDP(compression=...)``, whose value names it by its
  ``option``, or an override), ``native`` (the native core runs its jobs itself
  from the schedules ``prepare`` made), ``factors`` (it syncs a lone FC layer from its sufficient factors,
  so that layer's calls are detached while it is on this path), ``by_cost`` (the coordinator puts a
  layer on it where its prediction beats the default path's);
- :meth:`Path.predict`: bytes per rank and seconds of one sync of a bucket on a link, with the
  machine's GEMM rate and memory bandwidth for its compute (None: it cannot take that bucket);
- :meth:`Path.prepare`: the buckets were rebuilt; what the path keeps per bucket carries over;
- :meth:`Path.stage`: what its job will read of ``.grad``, copied into the bucket's flat buffer on the
  thread that submits the bucket (no job ever reads ``.grad``);
- :meth:`Path.sync`: the job, as a generator of phases (``"network"``, ``"gather"``, ``"rebuild"``,
  ...; a phase lasts until the next one begins) returning whether the bucket synced (False: some rank
  aborted, or no rank used it);
- :meth:`Path.write`, :meth:`Path.settle`, :meth:`Path.keep_local`, :meth:`Path.forget`: what the sync
  left, at the end of the pass, on the training thread: into ``.grad`` (or where the mode holds a pass's
  gradients), nowhere because the owners stepped from it (a ``ServerOptimizer``), kept as this rank's
  unsynced gradient (the pass was aborted), or dropped (nothing is written);
- :meth:`Path.reduce`: the sync up to where the parameter-server update can run (the update wrapper,
  ``update.py``, composes it with any path), and :meth:`Path.predict_update`, what that job costs with
  the owners' pull of the new values;
- :meth:`Path.state_dict` / :meth:`Path.load_state_dict`: what a checkpoint must carry of it.
Invariants: a job touches only its bucket's flat buffer and the path's own state (never ``.grad``);
every rank runs the same phases and the same collectives for a bucket in a pass.
"""
from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from ..bucket import Bucket
from ..link import LinkModel
from ..pools import ChannelGroups


@dataclass(frozen=True)
class SyncContext:
    """What one sync job needs to know about its pass."""

    path: str
    task: int           #: the backward pass (graph task) whose factors to send
    aborted: bool       #: this rank's backward was aborted: send, but keep nothing
    shadow: bool        #: this rank has joined (uneven inputs): send zero gradients, write nothing
    k_pad: int = 0      #: rows per rank a factor path's all-gather makes room for


@dataclass(frozen=True)
class FCCost:
    """A lone FC layer as a prediction reads it: W is M x N, K rows per rank."""

    m: int
    n: int
    k: int
    element_size: int


@dataclass(frozen=True)
class BucketCost:
    """What a prediction reads of a bucket: its flat buffer's bytes, its parameters' bytes, its FC
    layer when it is one alone, and its parameters' shapes and element size (what a compressing path
    reads)."""

    nbytes: float
    param_bytes: float
    fc: FCCost | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    element_size: int = 4


@dataclass(frozen=True)
class Prediction:
    """Bytes one rank sends and seconds one sync takes, of which ``compute_s`` on the compute lane (a
    rebuild GEMM), not on the link."""

    bytes: float
    seconds: float
    compute_s: float = 0.0


@dataclass(frozen=True)
class PathEnv:
    """What a path is built with: this rank, the group's size, the KV store's chunk size, the device its
    messages travel from (host memory when a CUDA model is staged for gloo), the default path (None
    while the default itself is built), and per path name the settings ``compression=`` gave it (checked:
    ``paths.compression_option``)."""

    rank: int
    world_size: int
    chunk_bytes: int
    wire_device: torch.device
    default: Path | None = None
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


class GradWriter(Protocol):
    """Where a closing pass writes its averages (``.grad``, or where the mode holds a pass's gradients)."""

    def scatter(self, bucket: Bucket) -> None:
        """The averages in ``bucket``'s flat buffer, for every parameter some rank used."""

    def add(self, layer: Any, grads: tuple[Tensor, ...]) -> None:
        """An average rebuilt from factors, added to what the pass's ``.grad`` held (``layer``: its FC layer)."""


@dataclass(frozen=True)
class AtOwners:
    """:meth:`Path.reduce` left each chunk's average at its owner: ``flags`` is the sum over the ranks of
    the bucket's used flags and aborted flag at an owner (None on a rank that owns none of its chunks)."""

    flags: Tensor | None


@dataclass(frozen=True)
class OnEveryRank:
    """:meth:`Path.reduce` left the whole average on every rank: per ``id(parameter)``, its averaged
    gradient (None: not averaged); ``bucket.used_anywhere`` says which parameters some rank used."""

    average: dict[int, Tensor | None]


Reduced = AtOwners | OnEveryRank
Phases = Generator[str, None, bool]


class Job(Protocol):
    """What a bucket's job is to the engine: a path, or a path a mode composed with more (the update at
    the owners, ``update.py``): its name (the path's), whether the native core runs it, its staging and
    its phases."""

    name: str
    native: bool

    def stage(self, bucket: Bucket, ctx: SyncContext) -> None: ...

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Phases: ...


class Path:
    """One way of moving a bucket's gradient (see the module docstring); subclass it and register it."""

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = True
    native: ClassVar[bool] = False
    factors: ClassVar[bool] = False
    by_cost: ClassVar[bool] = False
    #: what ``PoseidonDDP(compression=...)`` calls a lossy path (None: an exact path, never named there)
    option: ClassVar[str | None] = None
    #: phases of its own that a trace plot names (phase -> legend label)
    phase_labels: ClassVar[dict[str, str]] = {}

    def __init__(self, env: PathEnv) -> None:
        self.env = env
        self.rank, self.world_size = env.rank, env.world_size

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction | None:
        """One sync of a bucket like ``cost`` among ``world_size`` ranks on ``link``, on a machine that
        multiplies matrices at ``gemm_flops`` and streams memory at ``memory_bps`` bytes per second (either
        None where not probed); None: it cannot take that bucket (or cannot cost it without a rate)."""
        raise NotImplementedError

    def predict_update(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                       memory_bps: float | None, pull: Prediction) -> Prediction | None:
        """One job of this path composed with the update at the owners (``update.py``), ``pull`` being the
        owners' pull of the new values: by default :meth:`reduce` is the whole sync, then the pull."""
        predicted = self.predict(cost, world_size, link, gemm_flops, memory_bps)
        if predicted is None:
            return None
        return Prediction(predicted.bytes + pull.bytes, predicted.seconds + pull.seconds, predicted.compute_s)

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """The buckets were (re)built (between passes): plan what the jobs need; carry state over."""

    def stage(self, bucket: Bucket, ctx: SyncContext) -> None:
        """What the job reads of this rank's ``.grad``, into the flat buffer (:meth:`Bucket.stage`)."""
        bucket.stage(ctx.aborted, ctx.shadow)

    def stage_for_update(self, bucket: Bucket, ctx: SyncContext) -> None:
        """As :meth:`stage`, for a job the parameter-server update follows: torch steps every parameter
        that has a ``.grad`` (zeros too), so the owners do."""
        bucket.stage(ctx.aborted, ctx.shadow, grads_present=True)

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Phases:
        """The job: average ``bucket`` over the ranks; yields its phases, returns whether it synced."""
        raise NotImplementedError

    @staticmethod
    def synced(bucket: Bucket, ctx: SyncContext) -> bool:
        """What a sync returns once the average is in ``bucket``'s flat buffer: the flags it carries
        (:meth:`Bucket.read_flags`); on a joined rank's shadow pass False (it writes nothing), having read
        which parameters some rank used, so that every rank agrees on it (learning reads it)."""
        if ctx.shadow:
            bucket.read_used()
            return False
        return bucket.read_flags()

    def reduce(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, Reduced | None]:
        """The job up to where the owners of the bucket's chunks can update it (None: nothing to update,
        the same on every rank). By default the whole sync: every rank then holds the average."""
        synced = yield from self.sync(bucket, groups, ctx)
        return OnEveryRank(self.average_of(bucket)) if synced else None

    def average_of(self, bucket: Bucket) -> dict[int, Tensor | None]:
        """After a sync: every parameter's average, by ``id``."""
        return {id(p): view for p, view in bucket.views()}

    def write(self, bucket: Bucket, grads: GradWriter, late: bool) -> None:
        """End of a pass no rank aborted: the average into ``grads`` (``late``: a gradient arrived after
        the job; the engine syncs the bucket again, so an average that would replace ``.grad`` waits)."""
        if not late:
            grads.scatter(bucket)

    def settle(self, bucket: Bucket, late: bool) -> None:
        """End of a pass no rank aborted that writes nothing here: the owners stepped from the average (a
        ``ServerOptimizer``'s mode), or this rank has joined (its shadow pass). By default what the sync
        left is dropped, as by :meth:`forget`; a path whose state outlives the pass keeps it here
        (``late``: as in :meth:`write`)."""
        self.forget(bucket, aborted=False)

    def keep_local(self, bucket: Bucket) -> None:
        """End of an aborted pass: this rank's gradient stays in ``.grad``, marked unsynced."""
        bucket.dirty |= bucket.seen

    def forget(self, bucket: Bucket, aborted: bool) -> None:
        """End of a pass some rank aborted (``aborted``) that writes nothing here (a mode that writes no
        gradient, or a joined rank): what the sync left is dropped."""

    # ---- what this path owes a bucket that syncs on another one ----------------------------------

    def owes(self, bucket: Bucket) -> bool:
        """Whether this path holds something of ``bucket``'s parameters that the bucket's sync on another
        path must carry (a lossy path's residuals of a layer that left it)."""
        return False

    def carry_into(self, bucket: Bucket) -> None:
        """``bucket`` was just staged for another path, one that averages its flat buffer: add what this
        path owes the bucket's parameters there (:meth:`carried` then says whether it landed)."""

    def carried(self, bucket: Bucket, landed: bool) -> None:
        """The pass that carried what this path owed ``bucket`` (:meth:`carry_into`) ended; ``landed``: its
        average was applied (written, or stepped from by the owners), not late, on no aborted pass."""

    def state_dict(self) -> dict:
        """What a checkpoint must carry of this path (``PoseidonDDP.consistency_state_dict``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"path {self.name!r} keeps no state, the checkpoint has {sorted(state)} for it")


class WrappedPath(Path):
    """Another path with its job changed (a subclass overrides :meth:`sync`); everything else is the
    inner path's, but its jobs run in Python (never ``native``)."""

    def __init__(self, inner: Path) -> None:
        self.inner = inner
        self.env, self.rank, self.world_size = inner.env, inner.rank, inner.world_size

    name = property(lambda self: self.inner.name)  # type: ignore[assignment]
    exact = property(lambda self: self.inner.exact)  # type: ignore[assignment]
    option = property(lambda self: self.inner.option)  # type: ignore[assignment]
    factors = property(lambda self: self.inner.factors)  # type: ignore[assignment]
    by_cost = property(lambda self: self.inner.by_cost)  # type: ignore[assignment]

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction | None:
        return self.inner.predict(cost, world_size, link, gemm_flops, memory_bps)

    def predict_update(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                       memory_bps: float | None, pull: Prediction) -> Prediction | None:
        return self.inner.predict_update(cost, world_size, link, gemm_flops, memory_bps, pull)

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        self.inner.prepare(buckets)

    def stage(self, bucket: Bucket, ctx: SyncContext) -> None:
        self.inner.stage(bucket, ctx)

    def stage_for_update(self, bucket: Bucket, ctx: SyncContext) -> None:
        self.inner.stage_for_update(bucket, ctx)

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Phases:
        return (yield from self.inner.sync(bucket, groups, ctx))

    def reduce(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, Reduced | None]:
        return (yield from self.inner.reduce(bucket, groups, ctx))

    def average_of(self, bucket: Bucket) -> dict[int, Tensor | None]:
        return self.inner.average_of(bucket)

    def write(self, bucket: Bucket, grads: GradWriter, late: bool) -> None:
        self.inner.write(bucket, grads, late)

    def settle(self, bucket: Bucket, late: bool) -> None:
        self.inner.settle(bucket, late)

    def keep_local(self, bucket: Bucket) -> None:
        self.inner.keep_local(bucket)

    def forget(self, bucket: Bucket, aborted: bool) -> None:
        self.inner.forget(bucket, aborted)

    def owes(self, bucket: Bucket) -> bool:
        return self.inner.owes(bucket)

    def carry_into(self, bucket: Bucket) -> None:
        self.inner.carry_into(bucket)

    def carried(self, bucket: Bucket, landed: bool) -> None:
        self.inner.carried(bucket, landed)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def drive(phases: Generator[str, None, object]) -> object:
    """Run a job's phases to the end; its result."""
    while True:
        try:
            next(phases)
        except StopIteration as stop:
            return stop.value

