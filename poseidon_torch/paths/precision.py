"""Reduced precision with error feedback: the bucket travels the parameter-server path's way (push to
the chunk owners, aggregate, pull), in bf16 or fp16 instead of the bucket's dtype.
``compression="bf16"`` or ``"fp16"`` (torch's ``bf16_compress_hook`` / ``fp16_compress_hook``, with
error feedback at both ends, as DoubleSqueeze, Tang et al. 2019, compensates worker and server).

One sync, with M = gradient + residual per parameter (``lossy.py``) and P ranks:
- every rank casts M to the wire dtype (a finite value beyond its largest finite one saturates there,
  the excess staying in the residual; an inf stays inf, so the average is non-finite on every rank: a
  step GradScaler skips, whose residuals stay as they were, ``lossy.py``) and pushes each chunk's part
  to its owner;
- an owner sums the P parts of its chunk in fp32 (fp64 for an fp64 bucket), in rank order, divides by P, casts the mean to the
  wire dtype and pulls it to every rank: every rank applies

      average = wire( fp32 sum over ranks in rank order of wire(M_rank) / P )

  bit-identical on every rank; the flags travel exactly (small integers);
- each rank's new residual is M - wire(M); the owner of a chunk also keeps P times the rounding of
  the chunk's mean (fp32 mean - wire(mean)) in its residual, so the mean of the residuals carries
  that too and error feedback loses nothing.

With a BSP ``ServerOptimizer`` (:meth:`CastPath.reduce`, composed with the update at the owners,
``update.py``): the push alone, over the default path's chunks (the shards' own), and each owner steps
from the fp32 mean of its chunks' parts, not cast again; the new values are pulled in the model's dtype.
Each rank's new residual is M - wire(M) (no rounding at the owner to keep).

Bytes one rank sends: those of the PS path for a buffer of the wire dtype, 2 (P-1)/P of (flat numel x
2 bytes): half of an fp32 bucket's. Compute: a few passes over the bucket in memory (the residual
added, the saturating cast, the new residual; the owner's sum and rounding; the upcast), costed as
:attr:`~CastPath.bytes_per_element` bytes per fp32 element at the probed memory bandwidth: a calibration, not a
count (on the 2-core CI machine, one thread, 3.3 M elements: 6.9 ns of CPU per element on every rank,
8.1 at an owner for its chunk's elements with P = 2, 0.3 to apply: about 11 ns, against the probe's
23 GB/s; the earlier count of 36 bytes predicted 7 times too little), plus
:attr:`~CastPath.seconds_per_sync` whatever the bucket's size (0.08-0.09 ms for a 512-element one,
``benchmarks/compression_compute.py``). Setting: ``start_iter`` (1: from the second synced pass on, as every path off the default
one). A bucket of the wire dtype or smaller is not this path's (nothing to gain).
"""
from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..bucket import Bucket
from ..link import LinkModel
from ..pools import ChannelGroups
from .base import AtOwners, BucketCost, PathEnv, Prediction, SyncContext
from .lossy import LossyPath, add_owner_rounding, pushed_then_pulled
from .ps import Chunk, Schedule, build_schedule, plan_chunks, predict_ps, run_messages



@dataclass
class Wire:
    """A bucket's copy in the wire dtype and its push / aggregate / pull schedule."""

    buffer: Tensor
    schedule: Schedule


class CastPath(LossyPath):
    """The bucket sent in ``wire_dtype`` through the chunk owners, with error feedback at both ends."""

    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
    bytes_per_element = 250  # module docstring
    seconds_per_sync = 80e-6

    def __init__(self, env: PathEnv) -> None:
        super().__init__(env)
        self._chunks: dict[int, list[Chunk]] = {}  #: id(bucket) -> its wire buffer's chunks
        self._wires: dict[int, Wire] = {}  #: id(bucket) -> its wire buffer, from its first sync on
        #: id(bucket) -> its wire buffer pushed over the default path's chunks, from its first reduce on
        self._pushes: dict[int, Wire] = {}

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction | None:
        """None for a bucket no wider than the wire dtype, or without the memory bandwidth."""
        wire_size = self.wire_dtype.itemsize
        if cost.element_size <= wire_size or memory_bps is None:
            return None
        elements = cost.nbytes / cost.element_size
        sent, seconds = predict_ps(elements * wire_size, world_size, link)
        compute_s = self.seconds_per_sync + self.memory_seconds(elements, cost.element_size, memory_bps)
        return Prediction(sent, seconds + compute_s, compute_s)

    def predict_update(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                       memory_bps: float | None, pull: Prediction) -> Prediction | None:
        """:meth:`reduce` is the push alone, in the wire dtype: half a sync's bytes and rounds."""
        return pushed_then_pulled(self.predict(cost, world_size, link, gemm_flops, memory_bps), world_size, link, pull)

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """Plan the chunks of every bucket's wire buffer (at most ``chunk_bytes`` of the wire dtype each,
        dealt as the PS path deals its own); the buffers are made at a bucket's first sync on this path,
        so a wrapper that never uses the path holds none."""
        super().prepare(buckets)
        sizes = [self.wire_dtype.itemsize] * len(buckets)
        plan = plan_chunks([b.flat.numel() for b in buckets], sizes, self.world_size, self.env.chunk_bytes)
        self._chunks = {id(bucket): chunks for bucket, chunks in zip(buckets, plan)}
        self._wires, self._pushes = {}, {}

    def _wire_of(self, bucket: Bucket) -> Wire:
        wire = self._wires.get(id(bucket))
        if wire is None:
            buffer = torch.zeros(bucket.flat.numel(), dtype=self.wire_dtype, device=bucket.flat.device)
            schedule = build_schedule(buffer, bucket.grad_numel, self._chunks[id(bucket)], self.rank, self.world_size)
            wire = self._wires[id(bucket)] = Wire(buffer, schedule)
        return wire

    def _push_of(self, bucket: Bucket) -> Wire:
        wire = self._pushes.get(id(bucket))
        if wire is None:
            buffer = torch.zeros(bucket.flat.numel(), dtype=self.wire_dtype, device=bucket.flat.device)
            chunks = self.env.default.chunks_of(bucket)
            schedule = build_schedule(buffer, bucket.grad_numel, chunks, self.rank, self.world_size, True)
            wire = self._pushes[id(bucket)] = Wire(buffer, schedule)
        return wire

    def _cast(self, bucket: Bucket, ctx: SyncContext, buffer: Tensor) -> Tensor:
        """M of the bucket cast into ``buffer`` (saturating), the flags after it; the new residuals."""
        m = self.with_residuals(bucket, ctx)
        gradients = buffer[:bucket.grad_numel]
        limit = torch.finfo(self.wire_dtype).max
        gradients.copy_(torch.where(m.isinf(), m, m.clamp(-limit, limit)))  # an inf (an overflow) stays inf
        m -= gradients  # the new residuals: what the cast dropped
        buffer[bucket.grad_numel:].copy_(bucket.flat[bucket.grad_numel:])
        return m

    def reduce(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, AtOwners]:
        """Compressed pushes to the parameter server: every rank pushes its parts of M in the wire dtype
        over the default path's chunks (the shards' own), and each owner sums its chunks' parts in fp32
        (fp64 for an fp64 bucket), in rank order, divided by P, into the bucket's flat buffer (in the
        bucket's dtype, as the PS path's average): the average the owner steps from, not cast to the wire
        dtype again (the new values are pulled exactly). The rank's new residual is what its cast dropped."""
        wire = self._push_of(bucket)
        yield "compress"
        m = self._cast(bucket, ctx, wire.buffer)
        yield "network"
        for messages in wire.schedule.push:
            run_messages(messages, groups)
        owned = [c for c in self.env.default.chunks_of(bucket) if c.owner == self.rank]
        for chunk, (_, parts) in zip(owned, wire.schedule.aggregate):  # the rounding into a half bucket: dropped
            _average_into(bucket.flat[chunk.start:chunk.stop], parts, groups.size, m.dtype)
        flags = wire.schedule.flags
        bucket.bytes_sent = wire.schedule.bytes_sent - wire.schedule.pull_bytes
        bucket.outcome = self.name
        for p, residual in bucket.views(m):
            self.propose(bucket, p, residual)
        return AtOwners(sum(part.float() for part in flags) if flags else None)

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        wire, size = self._wire_of(bucket), groups.size
        yield "compress"
        m = self._cast(bucket, ctx, wire.buffer)
        yield "network"
        for messages in wire.schedule.push:
            run_messages(messages, groups)
        rounding = [_average_into(own, parts, size, m.dtype) for own, parts in wire.schedule.aggregate]
        for messages in wire.schedule.pull:
            run_messages(messages, groups)
        bucket.bytes_sent = wire.schedule.bytes_sent
        bucket.outcome = self.name
        yield "decompress"
        bucket.flat.copy_(wire.buffer)
        add_owner_rounding(m, wire.schedule.aggregate, wire.buffer, rounding, size)
        return self.propose_all(bucket, m, ctx)


def _average_into(own: Tensor, parts: list[Tensor], world_size: int, dtype: torch.dtype) -> Tensor:
    """The mean of every rank's part, summed in ``dtype`` (fp32, or fp64 for an fp64 bucket) in rank
    order, cast into ``own``; what the cast lost."""
    total = parts[0].to(dtype)
    for part in parts[1:]:
        total += part.to(dtype)
    mean = total.div_(world_size)
    own.copy_(mean)
    return mean.sub_(own.to(dtype))


class BF16Path(CastPath):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa."""

    name = "BF16"
    option = "bf16"
    wire_dtype = torch.bfloat16


class FP16Path(CastPath):
    """float16 on the wire: 11 bits of mantissa, finite values beyond 65504 saturate (the excess stays in
    the residual)."""

    name = "FP16"
    option = "fp16"
    wire_dtype = torch.float16
