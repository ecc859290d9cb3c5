"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019): a rank-r approximation of each gradient matrix,
found by one step of power iteration, with error feedback and a warm start. ``compression="powersgd"``.

Each parameter of the bucket is a matrix M (its first dimension by the rest: a conv weight
(out, in, k, k) is out x in*k*k) plus its residual (``lossy.py``). It is *compressed* where its rank
r' = min(r, rows, cols) shrinks it enough, r' (rows + cols) * ``min_compression_rate`` < rows * cols
(torch's rule); 1-D and small tensors go uncompressed. One sync, on every rank alike:

1. P = M Q for every compressed M (Q: cols x r', the same on every rank: from the last sync, the *warm
   start*, or at first a seeded normal draw);
2. one all-reduce (sum) of [every P | every uncompressed gradient | the used and aborted flags]: the
   uncompressed gradients are averaged exactly, and a pass some rank aborted ends here on every rank;
3. P^ = the orthonormal basis of the summed P (Householder QR: orthonormal even where P is rank
   deficient); Q = M^T P^;
4. one all-reduce of every Q, divided by the number of ranks: mean Q, kept for the warm start;
5. the average applied is P^ Q^T = P^ P^^T mean(M): the projection of the mean M onto the columns of
   P^. Hence a mean M of rank <= r' passes unchanged (to rounding). Each rank's new residual is its M
   minus that average.
A pass that is aborted (an exception in some rank's backward: no step) puts back the Q its syncs
computed, as it keeps the old residuals, so the run goes on as one that skipped the batch.

Bytes one rank sends: a ring all-reduce of each buffer, 2 (P-1)/P of (sum of rows * r' + uncompressed
elements + flags) + 2 (P-1)/P of (sum of cols * r'), in the compute dtype (fp32 for half-precision
buckets). Compute per compressed matrix: three rank-r' products (6 rows cols r' flops) and the passes
over M in memory (add the residual, two products reading M, the product writing the average, the new
residual, the copies in and out), costed as the slower of the flops at the probed GEMM rate and
:attr:`~PowerSGDPath.bytes_per_element` bytes per fp32 element at the probed memory bandwidth, plus
:attr:`~PowerSGDPath.seconds_per_matrix` (the QR and a dozen operations per matrix, whatever its size): a
calibration, not a count (``benchmarks/compression_compute.py``, one thread, a quiet 2-core machine
probed at 28 GB/s: 2.4-3.5 ns of CPU per element for 4 M-element matrices, 2.8-5.0 for lm-wide's
33 K-263 K-element ones, whose 0.16-0.74 ms a sync the model gives within 15%; the earlier count of nine
passes, 1.3 ns, predicted half of it). Settings: ``rank`` (4), ``min_compression_rate`` (2), ``start_iter`` (torch's default of
1000 synced passes on exact paths before the coordinator may choose this path by cost), ``seed`` (0)
for the first Q of each parameter (drawn from its name, with a generator of its own: the user's random
stream is untouched).
"""
from __future__ import annotations

import zlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..bucket import Bucket, flat_numel
from ..link import LinkModel
from ..pools import ChannelGroups
from .allreduce import ring_bytes_per_rank
from .base import BucketCost, PathEnv, Prediction, SyncContext
from .lossy import LossyPath, all_finite


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix a parameter of ``shape`` is compressed as: its first dimension by the rest."""
    rows = shape[0] if shape else 1
    numel = 1
    for size in shape:
        numel *= size
    return rows, numel // rows if rows else 0


def compressed_rank(shape: Sequence[int], rank: int, min_compression_rate: float) -> int:
    """The rank a parameter of ``shape`` is compressed to, or 0 where it goes uncompressed (1-D, or not
    shrunk by ``min_compression_rate``)."""
    if len(shape) < 2:
        return 0
    rows, cols = matrix_shape(shape)
    r = min(rank, rows, cols)
    return r if r * (rows + cols) * min_compression_rate < rows * cols else 0


def initial_q(name: str, cols: int, rank: int, seed: int, dtype: torch.dtype) -> Tensor:
    """The first Q of parameter ``name``: normal draws from a generator seeded by ``seed`` and the name,
    the same on every rank and in every run."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(cols, rank, generator=generator, dtype=torch.float64).to(dtype)


@dataclass
class Matrix:
    """One compressed parameter of a bucket: its place, its shape as a matrix and its rank, and its P
    and Q (views of the bucket's two message buffers)."""

    position: int
    rows: int
    cols: int
    rank: int
    p: Tensor
    q: Tensor


@dataclass
class Plan:
    """A bucket's two messages: ``first`` = [every P | every uncompressed gradient | flags] and
    ``second`` = [every Q]; ``plain``: the uncompressed parameters' positions and their views of
    ``first``."""

    matrices: list[Matrix]
    plain: list[tuple[int, Tensor]]
    first: Tensor
    flags: Tensor
    second: Tensor


class PowerSGDPath(LossyPath):
    """Rank-r PowerSGD with error feedback and warm start (see the module docstring)."""

    name = "PowerSGD"
    option = "powersgd"
    defaults = {"rank": 4, "min_compression_rate": 2.0, "start_iter": 1000, "seed": 0}
    minimums = {"rank": 1, "min_compression_rate": 0.0, "start_iter": 1, "seed": 0}
    state_keys = ("residual", "q")
    bytes_per_element = 72  # module docstring
    #: the compute of a sync per compressed matrix whatever its size (module docstring)
    seconds_per_matrix: ClassVar[float] = 60e-6

    def __init__(self, env: PathEnv) -> None:
        super().__init__(env)
        self.rank_setting: int = self.settings["rank"]
        self.min_rate: float = float(self.settings["min_compression_rate"])
        self._plans: dict[int, Plan] = {}
        self._q: dict[int, Tensor] = {}  #: id(parameter) -> its mean Q of the last sync (the warm start)
        self._warm: set[int] = set()  #: the parameters whose Q a sync computed (or a checkpoint restored)
        #: id(bucket) -> what its sync in this pass changed of the warm start: its Q buffer, the values
        #: before, the parameters it made warm (taken back if the pass is aborted, kept when it is written)
        self._undo: dict[int, tuple[Tensor, Tensor, set[int]]] = {}

    # ---- cost -----------------------------------------------------------------------------------

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction | None:
        """None where no parameter would be compressed, or without the GEMM rate and memory bandwidth."""
        ranks = [compressed_rank(shape, self.rank_setting, self.min_rate) for shape in cost.shapes]
        if not any(ranks) or gemm_flops is None or memory_bps is None:
            return None
        size = max(cost.element_size, 4)
        first = flat_numel(0, len(cost.shapes))
        second, compute_s = 0, self.seconds_per_sync
        for shape, r in zip(cost.shapes, ranks):
            rows, cols = matrix_shape(shape)
            if not r:
                first += rows * cols
                continue
            first, second = first + rows * r, second + cols * r
            memory_s = self.memory_seconds(rows * cols, cost.element_size, memory_bps)
            compute_s += max(6.0 * rows * cols * r / gemm_flops, memory_s) + self.seconds_per_matrix
        sent = ring_bytes_per_rank(first * size, world_size) + ring_bytes_per_rank(second * size, world_size)
        return Prediction(sent, link.seconds(sent, 4 * (world_size - 1)) + compute_s, compute_s)

    # ---- the buckets ------------------------------------------------------------------------------

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """Forget the old buckets' message buffers (a bucket's are made at its first sync on this path, so
        a wrapper that never uses the path holds none); every parameter keeps its Q."""
        super().prepare(buckets)
        self._plans, self._undo = {}, {}

    def _plan_of(self, bucket: Bucket) -> Plan:
        plan = self._plans.get(id(bucket))
        if plan is None:
            plan = self._plans[id(bucket)] = self._plan(bucket)
        return plan

    def _plan(self, bucket: Bucket) -> Plan:
        """The bucket's message buffers, each compressed parameter's Q in them: its last one, or a new draw."""
        dtype = self.compute_dtype(bucket.dtype)
        shapes = [(j, name, p, compressed_rank(p.shape, self.rank_setting, self.min_rate))
                  for j, (name, p) in enumerate(zip(bucket.param_names, bucket.params))]
        compressed = [(j, name, p, r) for j, name, p, r in shapes if r]
        plain = [(j, p) for j, _, p, r in shapes if not r]
        p_numel = sum(matrix_shape(p.shape)[0] * r for _, _, p, r in compressed)
        first = torch.zeros(p_numel + sum(p.numel() for _, p in plain) + len(bucket.params) + 1, dtype=dtype,
                            device=bucket.flat.device)
        second = torch.zeros(sum(matrix_shape(p.shape)[1] * r for _, _, p, r in compressed), dtype=dtype,
                             device=bucket.flat.device)
        matrices, p_at, q_at = [], 0, 0
        for j, name, p, r in compressed:
            rows, cols = matrix_shape(p.shape)
            q = second[q_at:q_at + cols * r].view(cols, r)
            old = self._q.get(id(p))
            q.copy_(old if old is not None and old.shape == q.shape else
                    initial_q(name, cols, r, self.settings["seed"], dtype))
            self._q[id(p)] = q
            matrices.append(Matrix(j, rows, cols, r, first[p_at:p_at + rows * r].view(rows, r), q))
            p_at, q_at = p_at + rows * r, q_at + cols * r
        views, at = [], p_numel
        for j, p in plain:
            views.append((j, first[at:at + p.numel()]))
            at += p.numel()
        return Plan(matrices, views, first, first[at:], second)

    # ---- the sync -------------------------------------------------------------------------------

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        plan, size = self._plan_of(bucket), groups.size
        grads = [view for _, view in bucket.views()]
        yield "compress"
        everything = dict(enumerate(v for _, v in bucket.views(self.with_residuals(bucket, ctx))))
        ms = [everything[m.position].view(m.rows, m.cols) for m in plan.matrices]
        for m, matrix in zip(plan.matrices, ms):
            torch.matmul(matrix, m.q, out=m.p)
        for j, piece in plan.plain:
            piece.copy_(grads[j].reshape(-1))
        plan.flags.copy_(bucket.flat[bucket.grad_numel:])
        yield "network"
        groups.all_reduce(plan.first)
        bucket.bytes_sent = int(ring_bytes_per_rank(plan.first.numel() * plan.first.element_size(), size))
        bucket.outcome = self.name
        bucket.flat[bucket.grad_numel:].copy_(plan.flags)
        for j, piece in plan.plain:
            grads[j].copy_(piece.view_as(grads[j]).div(size))
        if plan.flags[-1] > 0:  # some rank aborted: the same on every rank, nothing more is sent
            return bucket.read_flags()
        if not plan.matrices:  # nothing compressed (an override on a layer of vectors): all sent already
            return self.synced(bucket, ctx)
        yield "compress"
        warm = plan.second.clone()  # put back after an overflow: a non-finite Q would stay so for good
        bases = [torch.linalg.qr(m.p).Q for m in plan.matrices]
        for m, matrix, basis in zip(plan.matrices, ms, bases):
            torch.matmul(matrix.T, basis, out=m.q)
        yield "network"
        groups.all_reduce(plan.second)
        plan.second.div_(size)
        if not all_finite(plan.second):  # the same on every rank: GradScaler skips this step
            plan.second.copy_(warm)
        newly = {id(bucket.params[m.position]) for m in plan.matrices} - self._warm
        self._undo[id(bucket)] = (plan.second, warm, newly)
        self._warm |= newly
        bucket.bytes_sent += int(ring_bytes_per_rank(plan.second.numel() * plan.second.element_size(), size))
        yield "decompress"
        for m, matrix, basis in zip(plan.matrices, ms, bases):
            grad = grads[m.position].view(m.rows, m.cols)
            if grad.dtype == matrix.dtype:  # the product straight into the bucket: no 16 MB buffer per embedding
                average = torch.matmul(basis, m.q.T, out=grad)
            else:  # a half-precision bucket holds the average rounded to its dtype: the residual is taken
                grad.copy_(basis @ m.q.T)  # against that, so error feedback returns the rounding too
                average = grad.to(matrix.dtype)
            self.propose(bucket, bucket.params[m.position], matrix.sub_(average).view_as(grads[m.position]))
        return self.synced(bucket, ctx)

    # ---- the end of the pass ----------------------------------------------------------------------

    def settle(self, bucket: Bucket, late: bool) -> None:
        self._undo.pop(id(bucket), None)
        super().settle(bucket, late)

    def keep_local(self, bucket: Bucket) -> None:
        self._take_back_q(bucket)
        super().keep_local(bucket)

    def forget(self, bucket: Bucket, aborted: bool) -> None:
        """An aborted pass puts back the Q its sync computed, on every rank alike (a joined rank's shadow
        pass that was not aborted settles: it keeps the new Q, as the ranks that write theirs)."""
        if aborted:
            self._take_back_q(bucket)
        self._undo.pop(id(bucket), None)
        super().forget(bucket, aborted)

    def _take_back_q(self, bucket: Bucket) -> None:
        """An aborted pass is no step (the same on every rank): the Q its sync of ``bucket`` computed is
        put back, so the run goes on as one that skipped the batch."""
        undo = self._undo.pop(id(bucket), None)
        if undo is not None:
            second, before, newly = undo
            second.copy_(before)
            self._warm -= newly

    # ---- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The residuals and the Q (the warm start) of every parameter a sync compressed, by name."""
        state = super().state_dict()
        names = {id(p): name for name, p in self._params.items()}
        q = {names[key]: self._q[key].detach().clone() for key in self._warm if key in names and key in self._q}
        return {**state, "q": q} if q else state

    def load_state_dict(self, state: dict) -> None:
        shapes = {}
        for name, p in self._params.items():
            r = compressed_rank(p.shape, self.rank_setting, self.min_rate)
            if r:
                shapes[name] = (matrix_shape(p.shape)[1], r)
        qs = self.checked_tensors(state, "q", shapes)
        super().load_state_dict(state)
        self._plans = {}  # made again at their next sync, from the restored Q
        for name, q in qs.items():
            self._q[id(self._params[name])] = q
        self._warm = {id(self._params[name]) for name in qs}

