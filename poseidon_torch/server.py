"""The server side of the KV store: shards hold the optimizer state and apply the update (paper, sec. 3).

With a :class:`ServerOptimizer`, a bucket's sync no longer hands averaged gradients back to every rank:
the update wrapper (``paths/update.py``) runs the bucket's path up to where the *owner* of each chunk
(the default path's chunks are the shards) holds the chunk's averaged gradient, the owner runs the
user's optimizer on that chunk with the chunk's optimizer state (which only it holds), and the pull
carries new **parameter values** instead of gradients. The new values wait in the bucket's flat buffer;
the mode copies them into the parameters on the training thread: in the forward pre-hook of the layer
that owns them, or when it settles the pass. Every piece's averaged gradient is staged before the job
yields "update", so the engine's channel plan may cut a job there (``schedule.py``): global-norm
clipping (``max_grad_norm``) then waits, before the first update of a pass, for every bucket's push
and sums the squared norms of the staged pieces over the ranks (each element is in one owned piece),
and every update scales its gradients as ``torch.nn.utils.clip_grad_norm_`` would.

A *piece* is the part of one parameter inside one chunk. Each rank's pieces are leaf tensors that its
per-bucket inner optimizers (the user's class, the user's param groups and hyperparameters) step.
Invariants:
- every element of every trainable parameter is in exactly one owned piece over all ranks (FC buckets:
  in one piece on every rank);
- before a step a piece is refreshed from the live parameter, so edits between steps (loading a
  checkpoint, a user's in-place change) are never overwritten with stale values;
- a parameter that no rank used in the pass gets no gradient and is not stepped (as torch skips a
  parameter whose ``.grad`` is None); an aborted pass steps nothing: an owner that stepped before the
  pass was known to be aborted (a bucket synced before some rank's backward raised) keeps a copy of
  the state it replaced until the pass's facts are known, and puts it back if the pass was aborted;
- hyperparameters are read from the user-facing param groups at every step, so LR schedulers work;
- optimizers whose update of one element reads other elements of the parameter get chunks aligned to
  whole parameters (``optimizer.py`` decides, and refuses optimizers that need a closure or sparse
  gradients);
- with Pipe-SGD's ``delay`` the owners step from the newest values (the mode's ``value_source``), not
  from the parameters, which lag the servers by k steps;
- the shards know the optimizer only by a :class:`ServerSpec` (plain data): nothing here reads the
  ``ServerOptimizer`` that made it.
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .barrier import SyncError
from .bucket import Bucket
from .paths.ps import Chunk, PSPath
from .pools import ChannelGroups


@dataclass(frozen=True, eq=False)
class ServerSpec:
    """What the shards run: the user's optimizer class and the arguments it takes, its param groups (the
    user-facing list: their hyperparameters are read at every step, so LR schedulers work), each
    parameter's state_dict key (by ``id``) and group (by key), each key's shape, the clipping threshold,
    whether values are pulled lazily, and whether chunks must hold whole parameters."""

    optimizer_class: type
    init_kwargs: dict[str, Any]
    param_groups: list[dict]
    key_of: dict[int, int]
    group_of: list[int]
    shapes: dict[int, torch.Size]
    max_grad_norm: float | None = None
    lazy_pull: bool = False
    aligned: bool = False


@dataclass(eq=False)
class Piece:
    """Elements ``lo:hi`` of one flattened parameter, and the leaf tensor the inner optimizer steps."""

    param: torch.nn.Parameter
    key: int           #: the parameter's index in the optimizer's state_dict (torch's numbering)
    position: int      #: the parameter's position in its bucket
    lo: int
    hi: int
    flat_start: int    #: where the piece lies in the bucket's flat buffer
    tensor: Tensor

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.param.numel()

    def live(self, source: Callable[[torch.nn.Parameter], Tensor] | None = None) -> Tensor:
        """The parameter's current values of this piece (or those ``source`` gives for it), shaped as
        the piece."""
        values = self.param if source is None else source(self.param)
        return values.detach().reshape(-1)[self.lo:self.hi].view(self.tensor.shape)

    def view_of(self, flat: Tensor) -> Tensor:
        return flat[self.flat_start:self.flat_start + self.hi - self.lo].view(self.tensor.shape)


def pieces_of(bucket: Bucket, chunks: Iterable[Chunk], key_of: dict[int, int]) -> list[Piece]:
    """The pieces of ``bucket`` inside ``chunks`` (a whole parameter keeps its shape)."""
    pieces = []
    for chunk in chunks:
        for j, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            lo, hi = max(chunk.start - offset, 0), min(chunk.stop - offset, p.numel())
            if lo >= hi:
                continue
            shape = p.shape if (lo, hi) == (0, p.numel()) else (hi - lo,)
            tensor = torch.empty(shape, dtype=p.dtype, device=p.device)
            pieces.append(Piece(p, key_of[id(p)], j, lo, hi, offset + lo, tensor))
    return pieces


class BucketShard:
    """The pieces of one bucket that this rank updates, and the inner optimizer that steps them."""

    def __init__(self, pieces: list[Piece], spec: ServerSpec) -> None:
        self.pieces = pieces
        by_group: dict[int, list[Tensor]] = defaultdict(list)
        for piece in pieces:
            by_group[spec.group_of[piece.key]].append(piece.tensor)
        self.groups = sorted(by_group)  #: the user's param groups this bucket's pieces belong to
        self.inner = None
        self.grads: list[Tensor | None] = [None] * len(pieces)  #: staged for this pass's update
        self.undo: dict[Tensor, dict | None] | None = None  #: the state before this pass's step, while it may abort
        if pieces:
            inner_groups = [{**hyperparameters(spec.param_groups[g]), "params": by_group[g]} for g in self.groups]
            self.inner = spec.optimizer_class(inner_groups, **spec.init_kwargs)

    def stage(self, grads: Sequence[Tensor | None]) -> None:
        """This pass's averaged gradient of each piece (None: the piece is not stepped)."""
        self.grads = list(grads)

    def squared_norm(self) -> float:
        """Sum of squares of the staged gradients (float64)."""
        return sum(float(g.double().square().sum()) for g in self.grads if g is not None)

    def step(self, out: Tensor, hyper: Sequence[dict], scale: float | None = None, keep_undo: bool = False,
             source: Callable[[torch.nn.Parameter], Tensor] | None = None) -> None:
        """Step every piece with a staged gradient (times ``scale`` when given), starting from the
        live parameter (or the values ``source`` gives: Pipe-SGD's newest), with the hyperparameters
        ``hyper`` (per user param group), and write every piece's value into its place in ``out`` (a
        bucket's flat buffer). ``keep_undo``: keep a copy of the state it replaces (:meth:`roll_back`)."""
        grads, self.grads = self.grads, [None] * len(self.pieces)
        if self.inner is None:
            return
        if scale is not None:
            for grad in grads:
                if grad is not None:
                    grad.mul_(scale)
        for piece in self.pieces:
            piece.tensor.copy_(piece.live(source))
        self.apply(grads, hyper, keep_undo)
        for piece in self.pieces:
            piece.view_of(out).copy_(piece.tensor)

    def apply(self, grads: Sequence[Tensor | None], hyper: Sequence[dict], keep_undo: bool = False) -> None:
        """One step of the inner optimizer from the pieces' current values, with gradient ``grads[i]`` for
        piece i (None: not stepped) and the hyperparameters ``hyper`` (per user param group)."""
        if self.inner is None:
            return
        for piece, grad in zip(self.pieces, grads):  # a GPU model's gradients arrive in host memory over gloo
            piece.tensor.grad = None if grad is None else grad.to(piece.tensor.device)
        for inner_group, g in zip(self.inner.param_groups, self.groups):
            inner_group.update(hyper[g])
        if any(grad is not None for grad in grads):
            if keep_undo:
                self.undo = {piece.tensor: _copied(self.inner.state.get(piece.tensor)) for piece in self.pieces}
            self.inner.step()
        for piece in self.pieces:
            piece.tensor.grad = None

    def roll_back(self) -> None:
        """Put back the state this pass's step replaced (the pass was aborted)."""
        for tensor, state in (self.undo or {}).items():
            if state is None:
                self.inner.state.pop(tensor, None)
            else:
                self.inner.state[tensor] = state
        self.undo = None

    def export(self) -> dict[int, list[tuple[int, int, dict[str, Any], dict[str, Any]]]]:
        """Per parameter key: (lo, hi, sliced state, whole-parameter state) of each piece with state."""
        out: dict[int, list] = defaultdict(list)
        if self.inner is None:
            return out
        for piece in self.pieces:
            state = self.inner.state.get(piece.tensor)
            if not state:
                continue
            sliced = {k: v.detach().clone().reshape(-1) for k, v in state.items() if _is_sliced(v, piece)}
            whole = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items() if k not in sliced}
            out[piece.key].append((piece.lo, piece.hi, sliced, whole))
        return out

    def load(self, full_state: dict[int, dict[str, Any]]) -> None:
        """Take each piece's part of a torch-format state (per parameter key)."""
        if self.inner is None:
            return
        for piece in self.pieces:
            state = full_state.get(piece.key)
            if state is None:
                self.inner.state.pop(piece.tensor, None)
                continue
            self.inner.state[piece.tensor] = {k: _take(v, piece) for k, v in state.items()}

    def state_bytes(self) -> int:
        if self.inner is None:
            return 0
        return sum(v.numel() * v.element_size() for state in self.inner.state.values()
                   for v in state.values() if isinstance(v, Tensor))


def _copied(state: dict | None) -> dict | None:
    return None if not state else {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def hyperparameters(group: dict) -> dict:
    """A param group's hyperparameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def _is_sliced(value: Any, piece: Piece) -> bool:
    """A state entry with one value per element of the piece (momentum, exp_avg), not a scalar (step)."""
    return isinstance(value, Tensor) and value.shape == piece.tensor.shape and (value.dim() > 0 or piece.whole)


def _take(value: Any, piece: Piece) -> Any:
    """A piece's part of a whole-parameter state entry."""
    if isinstance(value, Tensor) and value.shape == piece.param.shape and (value.dim() > 0 or piece.whole):
        return value.detach().reshape(-1)[piece.lo:piece.hi].clone().view(piece.tensor.shape).to(piece.tensor.device)
    return value.clone() if isinstance(value, Tensor) else value


def export_shards(shards: Iterable[BucketShard]) -> dict[int, list]:
    """Every shard's :meth:`BucketShard.export`, per parameter key."""
    out: dict[int, list] = defaultdict(list)
    for shard in shards:
        for key, items in shard.export().items():
            out[key].extend(items)
    return dict(out)


def merge_exports(exports: Iterable[dict], shapes: dict[int, torch.Size]) -> dict[int, dict[str, Any]]:
    """Whole-parameter state (torch's format, per key) from every rank's :meth:`BucketShard.export`
    (replicated pieces, found on several ranks, are taken once)."""
    by_key: dict[int, dict[int, tuple]] = defaultdict(dict)
    for export in exports:
        for key, items in export.items():
            for lo, hi, sliced, whole in items:
                by_key[key].setdefault(lo, (hi, sliced, whole))
    full = {}
    for key, items in sorted(by_key.items()):
        ordered = [items[lo] for lo in sorted(items)]
        covered = sum(hi - lo for lo, (hi, _, _) in items.items())
        if covered != shapes[key].numel():
            raise RuntimeError(f"optimizer state of parameter {key} covers {covered} of {shapes[key].numel()} elements")
        state = dict(ordered[0][2])
        for name in ordered[0][1]:
            state[name] = torch.cat([sliced[name] for _, sliced, _ in ordered]).view(shapes[key])
        full[key] = state
    return full


class Server:
    """This rank's shards: one :class:`BucketShard` per bucket, rebuilt when the buckets change."""

    def __init__(self, spec: ServerSpec, source: Callable[[torch.nn.Parameter], Tensor] | None = None) -> None:
        self.spec = spec
        self.source = source  #: where a step starts from (None: the live parameters)
        self.passes = 0  #: passes begun (a state gathered before the last one is stale)
        self.shards: dict[int, BucketShard] = {}
        self.hyper: list[dict] = []  #: the pass's hyperparameters per user param group
        self.scale: float | None = None  #: the pass's clipping factor, once known
        self.grad_norm: float | None = None  #: the pass's global gradient norm (clipping), once known
        self._pushed = 0
        self._cond = threading.Condition()
        self._may_abort = False  #: the open pass's facts are not known yet: a step keeps an undo copy
        self._norm_known = threading.Event()
        self._norm_known.set()
        self._stepped = False  #: a pass's updates stood (it was not aborted)
        self._loaded = False   #: the state was loaded from a non-empty state dict

    def begin_pass(self) -> None:
        """A synced pass opens: its updates use the hyperparameters in effect now (an LR scheduler
        stepped after ``step()`` must not reach jobs of this pass that are still running)."""
        self.hyper = [hyperparameters(g) for g in self.spec.param_groups]
        self.passes += 1  # this pass's updates change the state
        self.scale = None
        if self.spec.max_grad_norm is not None:
            self._norm_known.clear()
        self._may_abort = True
        self._drop_undo()
        with self._cond:
            self._pushed = 0

    def pushed(self) -> None:
        """One bucket's first slot (everything before its update) is done (channel thread)."""
        with self._cond:
            self._pushed += 1
            self._cond.notify_all()

    def before_updates(self, groups: ChannelGroups, buckets: int, timeout: float) -> None:
        """The first update of the pass is next (its channel thread). With clipping: wait until all
        ``buckets`` pushed, then the global norm of the averaged gradients over the ranks (a collective
        on ``groups``, at the same slot on every rank) and the factor every update scales by."""
        max_norm = self.spec.max_grad_norm
        if max_norm is None:
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._pushed >= buckets, timeout):
                raise SyncError(f"global-norm clipping waited {timeout:.0f}s for the pushes of {buckets - self._pushed} "
                                f"of {buckets} bucket(s) (a sync job failed or hung)")
        mine = torch.tensor([sum(shard.squared_norm() for shard in self.shards.values())], dtype=torch.float64)
        everyone = torch.empty(groups.size, dtype=torch.float64)
        groups.all_gather(everyone, mine)
        self.grad_norm = math.sqrt(float(everyone.sum()))
        self.scale = min(max_norm / (self.grad_norm + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        self._norm_known.set()

    def wait_norm(self, timeout: float) -> float | None:
        """The last pass's global gradient norm, once its first update computed it."""
        if not self._norm_known.wait(timeout):
            raise SyncError(f"the gradient norm of the last step was not known after {timeout:.0f}s (a sync job failed "
                            "or hung)")
        return self.grad_norm

    def update(self, bucket: Bucket) -> None:
        """Step this rank's pieces of ``bucket`` with their staged gradients; new values into its buffer."""
        self.shard(bucket).step(bucket.flat, self.hyper, self.scale, keep_undo=self._may_abort, source=self.source)

    def facts_known(self, aborted: bool) -> None:
        """The pass's facts are in (training thread): not aborted, every step stands and later ones
        keep no copy; aborted, the jobs go on keeping copies for :meth:`roll_back`."""
        if aborted:
            return
        self._may_abort = False
        self._stepped = True
        self._drop_undo()

    def _drop_undo(self) -> None:
        for shard in self.shards.values():
            shard.undo = None

    def roll_back(self) -> None:
        """The pass was aborted and every job is done: every step it made is taken back."""
        for shard in self.shards.values():
            shard.roll_back()

    def install(self, buckets: Sequence[Bucket], ps: PSPath, rank: int) -> None:
        """Pieces for ``buckets``: the chunks this rank owns."""
        key_of = self.spec.key_of
        self.shards = {id(bucket): BucketShard(pieces_of(bucket, [c for c in ps.chunks_of(bucket) if c.owner == rank],
                                                         key_of), self.spec)
                       for bucket in buckets}

    def shard(self, bucket: Bucket) -> BucketShard:
        return self.shards[id(bucket)]

    def export(self) -> dict:
        return export_shards(self.shards.values())

    def state_bytes(self) -> int:
        return sum(shard.state_bytes() for shard in self.shards.values())

    def has_state(self) -> bool:
        """Some rank holds optimizer state: a step stood, or a state was loaded (the same on every rank)."""
        return self._stepped or self._loaded

    def close(self) -> None:
        pass

    #: an aborted pass's updates are taken back (:meth:`roll_back`): its pulled values are not read
    keeps_aborted_values = False

    def load(self, full_state: dict[int, dict[str, Any]]) -> None:
        for shard in self.shards.values():
            shard.load(full_state)
        self._loaded = bool(full_state)
        self._drop_undo()


def apply_values(bucket: Bucket) -> None:
    """Copy the new values of the parameters some rank used into the parameters (training thread; the
    in-place copy bumps their version, so a graph that saved the old values refuses to backpropagate)."""
    with torch.no_grad(), bucket.averages() as values:
        for p, value in values:
            p.copy_(value)
