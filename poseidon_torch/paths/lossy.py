"""What every lossy path shares: its settings (``PoseidonDDP(compression=...)``), when it may start, and
error feedback.

A lossy path sends less than the gradient; every rank ends with the same value, which is not exactly
the average of the ranks' gradients. With *error feedback* (Seide et al. 2014, Karimireddy et al. 2019;
PowerSGD and torch's hook use it) nothing is lost over time: each rank keeps, per parameter, a
*residual*: what its syncs so far lacked. A sync sends gradient + residual (M), and the rank's new
residual is M minus what the sync applied on its behalf, so after any number of steps

    sum of the applied averages + mean over the ranks of the residuals = sum of the averaged gradients

(exact in exact arithmetic; to rounding in floating point).

Invariants:
- a residual changes only when its sync's average is written (:meth:`LossyPath.write`, not late), or
  the owners stepped from it (:meth:`LossyPath.settle`, a ``ServerOptimizer``): an
  aborted pass, a late gradient (the bucket is then averaged again, exactly, on the default path), a
  pass that writes nothing, a pass whose average is not finite (an overflow: GradScaler skips the step)
  and a parameter no rank used (its average is not written) keep the old one;
- residuals are kept per parameter (named in the checkpoint: :meth:`LossyPath.state_dict`), so they
  survive bucket rebuilds and a layer moving between lossy paths;
- a layer that left the path (the plan changed) still owes its residual: its next sync on another path
  that averages the staged flat buffer (any but a factor path, SFB; another lossy path compresses it
  with its own residual) carries it there (:meth:`LossyPath.carry_into`), and once that average is
  applied the residual is dropped, so the sum above holds with nothing left here;
- a joined rank's shadow pass sends its residuals with zero gradients and keeps its new residuals, as
  every rank does (with ``join()``'s averages over the initial world size, the sum above then holds
  over all the ranks: a joined rank that kept its old residual would leave a share of each average
  unaccounted, which the others' error feedback would send again);
- the coordinator puts a layer on the path by cost only from the ``start_iter``-th synced pass on (torch's
  ``start_powerSGD_iter``: the first passes are exact); an override forces it from the second pass on.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..bucket import Bucket
from ..link import LinkModel
from .base import GradWriter, Path, PathEnv, Prediction, SyncContext


def all_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite, in one pass: its minimum and maximum, into which a
    NaN propagates. ``isfinite(tensor).all()`` writes a bool per element first: on a 13 M-element fp32
    buffer, one CPU thread, 66 ms against 4.7 ms, and it ran at the end of every pass on the training thread."""
    if tensor.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())


class LossyPath(Path):
    """A path that is not exact, with per-parameter error feedback (see the module docstring); a
    subclass computes each parameter's new residual in its sync and hands it to :meth:`propose`."""

    exact = False
    by_cost = True
    #: every setting ``compression={option: {...}}`` may give, with its default (its type is the setting's)
    defaults: ClassVar[dict[str, Any]] = {"start_iter": 1}
    #: the least value of each numeric setting
    minimums: ClassVar[dict[str, float]] = {"start_iter": 1}
    #: what :meth:`state_dict` may hold
    state_keys: ClassVar[tuple[str, ...]] = ("residual",)
    #: the compute of a sync, a calibration (``benchmarks/compression_compute.py``): its passes over memory
    #: in bytes per fp32 element at the probed memory bandwidth, and its seconds whatever its size (the
    #: few dozen operations a sync launches)
    bytes_per_element: ClassVar[float] = 0.0
    seconds_per_sync: ClassVar[float] = 0.0
    phase_labels = {"compress": "compression", "decompress": "decompression"}

    def __init__(self, env: PathEnv) -> None:
        super().__init__(env)
        self.settings = {**self.defaults, **env.settings.get(self.name, {})}
        #: the synced passes on exact paths before the coordinator may choose this path by cost
        self.start_iter: int = self.settings["start_iter"]
        self._residuals: dict[int, Tensor] = {}  #: id(parameter) -> its residual
        self._pending: dict[int, dict[int, Tensor]] = {}  #: id(bucket) -> its last sync's new residuals
        #: id(bucket) -> the parameters whose residuals its sync on another path carries (:meth:`carry_into`)
        self._carried: dict[int, list[int]] = {}
        self._params: dict[str, nn.Parameter] = {}  #: the buckets' parameters by name

    @classmethod
    def checked_settings(cls, given: object) -> dict[str, Any]:
        """``given`` (a dict of settings, or None for the defaults) checked: every key known, every value
        of its default's type and at least its minimum; the defaults filled in."""
        shown = f"compression={{{cls.option!r}: {given!r}}}"
        if given is None:
            given = {}
        if not isinstance(given, Mapping):
            raise TypeError(f"PoseidonDDP option {shown}: the settings of {cls.option!r} must be a dict, e.g. "
                            f"{cls.defaults}")
        unknown = sorted(map(str, set(given) - set(cls.defaults)))
        if unknown:
            raise ValueError(f"PoseidonDDP option {shown}: unknown setting(s) {unknown}; {cls.option!r} takes "
                             f"{sorted(cls.defaults)}")
        for key, value in given.items():
            _check_setting(shown, key, value, cls.defaults[key], cls.minimums.get(key))
        return {**cls.defaults, **given}

    @classmethod
    def memory_seconds(cls, elements: float, element_size: int, memory_bps: float) -> float:
        """The calibrated passes over memory of a sync of ``elements`` of ``element_size`` bytes (computed
        in at least fp32)."""
        return elements * cls.bytes_per_element * max(element_size, 4) / 4 / memory_bps

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What the path computes in for a bucket of ``dtype``: at least fp32."""
        return torch.promote_types(dtype, torch.float32)

    # ---- error feedback -------------------------------------------------------------------------

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        self._params = {name: p for b in buckets for name, p in zip(b.param_names, b.params)}
        self._pending, self._carried = {}, {}

    def with_residuals(self, bucket: Bucket, ctx: SyncContext) -> Tensor:
        """M of the bucket: a new flat tensor in the compute dtype, its staged gradients (zeros on a joined
        rank) plus their residuals, laid out as the flat buffer's gradients."""
        m = bucket.flat[:bucket.grad_numel].to(self.compute_dtype(bucket.dtype), copy=True)
        for p, piece in bucket.views(m):
            residual = self._residuals.get(id(p))
            if residual is not None:
                piece += residual
        return m

    def propose(self, bucket: Bucket, param: nn.Parameter, residual: Tensor) -> None:
        """``param``'s residual after this sync, kept if the sync's average is written (:meth:`write`)."""
        self._pending.setdefault(id(bucket), {})[id(param)] = residual

    def propose_all(self, bucket: Bucket, residuals: Tensor, ctx: SyncContext) -> bool:
        """Every parameter's new residual, ``residuals`` laid out as the bucket's flat gradients
        (:meth:`propose`); what the sync returns (:meth:`synced`)."""
        for p, residual in bucket.views(residuals):
            self.propose(bucket, p, residual)
        return self.synced(bucket, ctx)

    def write(self, bucket: Bucket, grads: GradWriter, late: bool) -> None:
        """The average into ``grads``; the sync's residuals replace the old ones of the parameters some
        rank used (late: the bucket is synced again exactly, the old residuals stay; a non-finite average,
        the same on every rank, is a step GradScaler skips: the old residuals stay, not inf or NaN for
        good)."""
        self.settle(bucket, late)
        super().write(bucket, grads, late)

    def settle(self, bucket: Bucket, late: bool) -> None:
        """The sync's residuals replace the old ones of the parameters some rank used, unless ``late`` or
        the bucket's flat buffer is not finite (the average, or with a ``ServerOptimizer`` the owners' new
        values: the same on every rank)."""
        pending = self._pending.pop(id(bucket), {})
        for key in applied_params(bucket, not late):
            if key in pending:
                self._residuals[key] = pending[key]

    def keep_local(self, bucket: Bucket) -> None:
        self._pending.pop(id(bucket), None)
        super().keep_local(bucket)

    def owes(self, bucket: Bucket) -> bool:
        return bool(self._residuals) and any(id(p) in self._residuals for p in bucket.params)

    def carry_into(self, bucket: Bucket) -> None:
        """The residuals of ``bucket``'s parameters (a layer that left this path) into its staged flat
        buffer, which another path averages: once that average is applied they are gone from here."""
        if not self.owes(bucket):
            return
        for p, piece in bucket.views(bucket.flat[:bucket.grad_numel]):
            residual = self._residuals.get(id(p))
            if residual is not None:
                piece += residual.to(piece.device, piece.dtype)
        self._carried[id(bucket)] = [id(p) for p in bucket.params if id(p) in self._residuals]

    def carried(self, bucket: Bucket, landed: bool) -> None:
        """Carried residuals whose average was applied are dropped (their mean is in it); the others stay
        (an aborted or late pass, a parameter no rank used, an average that is not finite)."""
        owed = self._carried.pop(id(bucket), None)
        if owed:
            for key in set(owed) & applied_params(bucket, landed):
                del self._residuals[key]

    def forget(self, bucket: Bucket, aborted: bool) -> None:
        self._pending.pop(id(bucket), None)

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The residuals by parameter name (empty before the path ever synced)."""
        names = {id(p): name for name, p in self._params.items()}
        residuals = {names[key]: t.detach().clone() for key, t in self._residuals.items() if key in names}
        return {"residual": residuals} if residuals else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (all of it checked before anything changes)."""
        self._residuals = {id(self._params[name]): t for name, t in self.checked_tensors(state, "residual").items()}

    def checked_tensors(self, state: object, key: str, shapes: Mapping[str, tuple[int, ...]] | None = None
                        ) -> dict[str, Tensor]:
        """``state[key]``, ``{parameter name: tensor}``, each checked against its parameter (or ``shapes``)
        and converted to the compute dtype on the path's device; a missing ``key`` is empty."""
        if not isinstance(state, Mapping):
            raise ValueError(f"path {self.name!r}: its consistency state must be a dict, got {type(state).__name__}")
        unknown = sorted(set(state) - set(self.state_keys))
        if unknown:
            raise ValueError(f"path {self.name!r} keeps {self.state_keys}, the checkpoint has {unknown} for it")
        entries = state.get(key, {})
        checked = {}
        for name, value in entries.items():
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"path {self.name!r}: the checkpoint's {key} names {name!r}, which this model does "
                                 "not sync")
            shape = tuple(param.shape) if shapes is None else shapes.get(name)
            if shape is None:
                raise ValueError(f"path {self.name!r}: the checkpoint has a {key} for {name!r}, which it does not "
                                 "compress here (other settings?)")
            if not isinstance(value, Tensor) or tuple(value.shape) != shape:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"path {self.name!r}: the checkpoint's {key} of {name!r} is {got}, expected {shape}")
            device = self.env.wire_device
            checked[name] = value.detach().to(device, self.compute_dtype(param.dtype), copy=True)
        return checked


def applied_params(bucket: Bucket, applied: bool) -> set[int]:
    """The ids of ``bucket``'s parameters whose average its pass applied: those some rank used, if
    ``applied`` (not late, on no aborted pass) and the flat buffer is finite (the average, or with a
    ``ServerOptimizer`` the owners' new values: the same on every rank; GradScaler skips a step that is
    not); else none."""
    if not applied or not all_finite(bucket.flat[:bucket.grad_numel]):
        return set()
    return {id(p) for used, p in zip(bucket.used_anywhere.tolist(), bucket.params) if used}


def pushed_then_pulled(sync: Prediction | None, world_size: int, link: LinkModel, pull: Prediction
                       ) -> Prediction | None:
    """A lossy sync the parameter-server way (``sync``: push, aggregate, pull) cut after the push, then the
    owners' ``pull`` of the new values: the push is half the sync's bytes and rounds."""
    if sync is None:
        return None
    pushed = sync.bytes / 2
    seconds = link.seconds(pushed, world_size - 1) + pull.seconds + sync.compute_s
    return Prediction(pushed + pull.bytes, seconds, sync.compute_s)


def add_owner_rounding(residuals: Tensor, owned: Sequence[tuple[Tensor, list[Tensor]]], buffer: Tensor,
                       rounding: Sequence[Tensor], size: int) -> None:
    """Add ``size`` (P) times what rounding each owned chunk's mean lost (``rounding``, flat, in chunk
    order) to the ``residuals`` of its gradients: ``owned`` is the schedule's aggregate list, its chunks
    views of ``buffer``, whose first elements are laid out as the residuals (the rest are flags or
    padding). The mean of the ranks' residuals then carries the owner's rounding too."""
    for (own, _), lost in zip(owned, rounding):
        start = own.storage_offset() - buffer.storage_offset()
        stop = min(start + own.numel(), residuals.numel())
        if stop > start:
            residuals[start:stop] += lost[:stop - start].to(residuals.dtype) * size


def _check_setting(shown: str, key: str, value: object, default: object, minimum: float | None) -> None:
    """One setting of ``compression=`` (``shown``), typed like its ``default``, at least ``minimum``."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise TypeError(f"PoseidonDDP option {shown}: {key!r} must be {type(default).__name__} like its default "
                        f"{default!r}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"PoseidonDDP option {shown}: {key!r} must be at least {minimum}, got {value!r}")
