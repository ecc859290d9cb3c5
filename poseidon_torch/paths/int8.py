"""8 bits per value with a scale per block, and error feedback: ``compression="int8"`` (blockwise
quantization as in 8-bit optimizers, Dettmers et al. 2022; error feedback as in 1-bit SGD, Seide et al.
2014). The bucket travels the parameter-server path's way (push to the chunk owners, aggregate, pull).

One sync, with M = gradient + residual per parameter (``lossy.py``), laid out as the bucket's flat
gradients and cut into blocks of B elements (setting ``block``, default 256; the last block padded with
zeros), and P ranks:
- every rank quantizes each block: scale = max |x| / 127 and q = round(x / scale) (halves to even, as
  ``torch.round``), an int8 in [-127, 127] (a block of zeros: scale 0, q 0), and pushes
  each chunk's values and scales (fp32, fp64 for an fp64 bucket) to the chunk's owner;
- an owner dequantizes each rank's part (q * scale), sums the parts in rank order, divides by P,
  quantizes that mean the same way and pulls its values and scales to every rank, so every rank applies

      average = deq(quant( sum over ranks in rank order of deq(quant(M_rank)) / P ))

  bit-identical on every rank; the bucket's flags travel beside the scales, in their dtype, averaged as on
  the PS path;
- each rank's new residual is M - deq(quant(M)); the owner of a chunk also keeps P times what quantizing
  the chunk's mean lost, so the mean of the residuals carries that too and error feedback loses nothing.
A value that is not finite makes its block's scale inf or NaN, so the average is not finite there on
every rank: GradScaler skips the step and the residuals stay (nothing saturates, unlike the fp16 cast).

With a BSP ``ServerOptimizer`` (:meth:`Int8Path.reduce`, composed with the update at the owners,
``update.py``): the push alone, straight to the shards. Each of the default path's chunks (the shards'
own) is cut into blocks from its own start; every rank pushes each chunk's values and scales to its
owner and its flags to every owner; the owner steps from the sum over the ranks, in rank order, of
the dequantized parts, divided by P, not quantized again (the new values are pulled exactly, in the
model's dtype). Each rank's new residual is M - deq(quant(M)); the owner's mean is not quantized, so
there is no owner's rounding to keep, but a half-precision model's mean is rounded into its dtype,
as on the exact path, and that rounding is not fed back. A chunk of flags alone (a bucket whose
gradients fill whole chunks, as a 2^k-element embedding does) has no blocks: its owner gets the flags.

Bytes one rank sends: those of the PS path for n + 4 ceil(n / B) bytes (n elements, fp32 scales; the
last block's padding is not sent), plus the flags: 2 (P-1)/P of that, about a quarter of an fp32
bucket's; pushed to the shards, half of that (a scale per started block of each chunk), then the
pull of the values in the model's dtype. Compute: a dozen passes over the bucket in memory (the
residual added, the block maxima, the division and rounding, the new residual; at the owner the
dequantized sum and its quantization; the dequantized average), costed as
:attr:`~Int8Path.bytes_per_element` bytes per fp32 element at the probed memory bandwidth: a calibration, not a count (on the 2-core CI
machine, one thread, 3.3 M elements: 11 ns of CPU per element on every rank, 14 at an owner for its
chunk's elements with P = 2, 1.3 to apply: about 19 ns, against the probe's 23 GB/s), plus
:attr:`~Int8Path.seconds_per_sync` whatever the bucket's size (0.19-0.21 ms for a 512-element one,
``benchmarks/compression_compute.py``). So on that machine it pays over 100 Mbit/s (a saved byte costs
80 ns there) and not over 10 Gbit/s.
"""
from __future__ import annotations

import math
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

#: the largest magnitude of a quantized value
_LEVELS = 127


def quantize(x: Tensor, values: Tensor, scales: Tensor) -> None:
    """``x`` (blocks x B) quantized per row into ``values`` (int8, blocks x B) and ``scales`` (blocks)."""
    scale = x.abs().amax(dim=1).div_(_LEVELS)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # a block of zeros: every q is 0
    values.copy_(torch.round(x / divisor[:, None]).clamp_(-_LEVELS, _LEVELS))
    scales.copy_(scale)


def dequantize(values: Tensor, scales: Tensor) -> Tensor:
    """What ``values`` (int8, blocks x B) with ``scales`` (blocks) stand for, in the scales' dtype."""
    return values.to(scales.dtype) * scales[:, None]


@dataclass
class Wire:
    """A bucket's quantized copy: its values (int8, whole blocks), its scales followed by the bucket's
    flags (``side``), and the push / aggregate / pull schedule of each."""

    values: Tensor
    side: Tensor
    blocks: int
    of_values: Schedule
    of_side: Schedule

    @property
    def bytes_sent(self) -> int:
        return self.of_values.bytes_sent + self.of_side.bytes_sent


@dataclass(frozen=True)
class Span:
    """One shard's chunk of a bucket's gradients in an int8 push: where it starts in the bucket, its
    elements, and its first block in the push's values (each chunk's blocks start at its own start)."""

    start: int
    numel: int
    first_block: int
    owner: int
    tag: int


@dataclass
class Push:
    """A bucket's int8 push to the shards (:meth:`Int8Path.reduce`): the values (each of the default path's
    chunks cut into whole blocks from its own start), the scales then the flags (``side``), the chunks'
    spans, and the push schedule of each buffer (the flags to every owner)."""

    values: Tensor
    side: Tensor
    blocks: int
    spans: list[Span]
    of_values: Schedule
    of_side: Schedule

    @property
    def bytes_sent(self) -> int:
        return self.of_values.bytes_sent - self.of_values.pull_bytes + self.of_side.bytes_sent - self.of_side.pull_bytes


class Int8Path(LossyPath):
    """The bucket sent as int8 with a scale per block, through the chunk owners, with error feedback at
    both ends."""

    name = "INT8"
    option = "int8"
    defaults: ClassVar[dict[str, int]] = {"start_iter": 1, "block": 256}
    minimums: ClassVar[dict[str, float]] = {"start_iter": 1, "block": 1}
    bytes_per_element = 440  # module docstring
    seconds_per_sync = 200e-6

    def __init__(self, env: PathEnv) -> None:
        super().__init__(env)
        self.block: int = self.settings["block"]
        self._chunks: dict[int, list[Chunk]] = {}  #: id(bucket) -> its chunks, in blocks
        self._wires: dict[int, Wire] = {}  #: id(bucket) -> its wire, from its first sync on
        #: id(bucket) -> its push to the shards, from its first reduce on
        self._pushes: dict[int, Push] = {}

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction | None:
        """The bytes of :meth:`sync` (n values, a scale per started block and the flags, in the compute
        dtype); None for a bucket of bytes already, or without the memory bandwidth."""
        if cost.element_size <= 1 or memory_bps is None:
            return None
        elements = cost.nbytes / cost.element_size
        values = sum(math.prod(shape) for shape in cost.shapes) if cost.shapes else elements
        side = -(-values // self.block) + elements - values  # the scales, then the flags
        sent, seconds = predict_ps(values + side * max(cost.element_size, 4), world_size, link)
        compute_s = self.seconds_per_sync + self.memory_seconds(elements, cost.element_size, memory_bps)
        return Prediction(sent, seconds + compute_s, compute_s)

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """Plan every bucket's chunks in whole blocks (a block and its scale: B + 4 bytes; at least one
        block per chunk, whatever ``chunk_bytes``), dealt as the PS path deals its own; the wires are made at
        a bucket's first sync on this path."""
        super().prepare(buckets)
        blocks = [-(-b.grad_numel // self.block) for b in buckets]
        block_bytes = self.block + 4
        plan = plan_chunks(blocks, [block_bytes] * len(buckets), self.world_size, max(self.env.chunk_bytes, block_bytes))
        self._chunks = {id(bucket): chunks for bucket, chunks in zip(buckets, plan)}
        self._wires, self._pushes = {}, {}

    def predict_update(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                       memory_bps: float | None, pull: Prediction) -> Prediction | None:
        """:meth:`reduce` is the push alone: half a sync's bytes and rounds."""
        return pushed_then_pulled(self.predict(cost, world_size, link, gemm_flops, memory_bps), world_size, link, pull)

    def _wire_of(self, bucket: Bucket) -> Wire:
        wire = self._wires.get(id(bucket))
        if wire is None:
            wire = self._wires[id(bucket)] = self._new_wire(bucket)
        return wire

    def _new_wire(self, bucket: Bucket) -> Wire:
        """The buffers and schedules of ``bucket``: chunk i carries blocks [a, b) as values [a B, min(b B,
        n)) (the last block's zero padding stays home: every rank's is 0) and side [a, b) (the last one
        the flags too), under tags i and i + chunks."""
        chunks, block, device, n = self._chunks[id(bucket)], self.block, bucket.flat.device, bucket.grad_numel
        blocks = -(-n // block)
        flags = bucket.flat.numel() - n
        values = torch.zeros(blocks * block, dtype=torch.int8, device=device)
        side = torch.zeros(blocks + flags, dtype=self.compute_dtype(bucket.dtype), device=device)
        value_chunks = [Chunk(c.start * block, min(c.stop * block, n), c.owner, c.tag) for c in chunks]
        side_chunks = [Chunk(c.start, side.numel() if c is chunks[-1] else c.stop, c.owner, c.tag + len(chunks))
                       for c in chunks]
        return Wire(values, side, blocks, build_schedule(values, values.numel(), value_chunks, self.rank, self.world_size),
                    build_schedule(side, side.numel(), side_chunks, self.rank, self.world_size))

    def _push_of(self, bucket: Bucket) -> Push:
        push = self._pushes.get(id(bucket))
        if push is None:
            push = self._pushes[id(bucket)] = self._new_push(bucket)
        return push

    def _new_push(self, bucket: Bucket) -> Push:
        """The buffers and schedules of ``bucket``'s push over the default path's chunks (the shards' own):
        chunk i's gradients as blocks from its own start (its last block's padding stays home) under tag
        i, their scales under tag i + chunks + 1, and the flags to every chunk's owner (under the number of
        chunks with blocks: ``build_schedule``'s flag tag, which no value or scale message uses). A chunk of flags
        alone (a bucket whose gradients fill whole chunks, as a 2^k-element embedding does) has no blocks:
        its owner gets the flags only."""
        chunks, block, n = self.env.default.chunks_of(bucket), self.block, bucket.grad_numel
        spans, blocks = [], 0
        for chunk in chunks:
            numel = min(chunk.stop, n) - chunk.start
            if numel > 0:
                spans.append(Span(chunk.start, numel, blocks, chunk.owner, chunk.tag))
                blocks += -(-numel // block)
        device, flags = bucket.flat.device, bucket.flat.numel() - n
        values = torch.zeros(blocks * block, dtype=torch.int8, device=device)
        side = torch.zeros(blocks + flags, dtype=self.compute_dtype(bucket.dtype), device=device)
        value_chunks = [Chunk(s.first_block * block, s.first_block * block + s.numel, s.owner, s.tag) for s in spans]
        side_chunks = [Chunk(s.first_block, s.first_block + -(-s.numel // block), s.owner, s.tag + len(chunks) + 1)
                       for s in spans]
        owners = {c.owner for c in chunks}
        return Push(values, side, blocks, spans,
                    build_schedule(values, values.numel(), value_chunks, self.rank, self.world_size),
                    build_schedule(side, blocks, side_chunks, self.rank, self.world_size, True, owners))

    def reduce(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, AtOwners | None]:
        """Compressed pushes to the parameter server: every rank quantizes M chunk by chunk of the default
        path's (the shards' own, each cut into blocks from its own start) and pushes each chunk's values
        and scales to its owner, its flags to every owner; each owner dequantizes the ranks' parts, sums
        them in rank order and divides by P into the bucket's flat buffer: the average the owner steps
        from, not quantized again (the new values are pulled exactly). The rank's new residual is what its
        quantization dropped."""
        push = self._push_of(bucket)
        yield "compress"
        m = self.with_residuals(bucket, ctx)
        self._quantize_chunks(push, m)
        push.side[push.blocks:].copy_(bucket.flat[bucket.grad_numel:])
        yield "network"
        for values, side in zip(push.of_values.push, push.of_side.push):
            run_messages(values + side, groups)
        flags = self._average_at_owner(push, bucket, groups.size)
        bucket.bytes_sent = push.bytes_sent
        bucket.outcome = self.name
        for p, residual in bucket.views(m):
            self.propose(bucket, p, residual)
        return AtOwners(flags)

    def _quantize_chunks(self, push: Push, m: Tensor) -> None:
        """M (flat, the bucket's gradients) quantized chunk by chunk into the push's values and scales; what
        the quantization dropped left in ``m`` (the new residuals)."""
        block, values, scales = self.block, push.values.view(push.blocks, self.block), push.side[:push.blocks]
        padded = m.new_zeros(push.values.numel())
        for span in push.spans:
            padded[span.first_block * block:][:span.numel] = m[span.start:span.start + span.numel]
        quantize(padded.view(push.blocks, block), values, scales)
        sent = dequantize(values, scales).view(-1)
        for span in push.spans:
            m[span.start:span.start + span.numel] -= sent[span.first_block * block:][:span.numel]

    def _average_at_owner(self, push: Push, bucket: Bucket, size: int) -> Tensor | None:
        """After the push, on an owner: each owned chunk's mean of the ranks' dequantized parts (summed in
        rank order) into the bucket's flat buffer, and the flags' mean after them; the sum of every rank's
        flags (None on a rank that owns no chunk)."""
        owned = [span for span in push.spans if span.owner == self.rank]
        for span, (_, parts), (_, side_parts) in zip(owned, push.of_values.aggregate, push.of_side.aggregate):
            blocks = -(-span.numel // self.block)
            mean = _dequantized_sum(parts, [side[:blocks] for side in side_parts], blocks, self.block).div_(size)
            bucket.flat[span.start:span.start + span.numel].copy_(mean.view(-1)[:span.numel])
        if not push.of_side.flags:
            return None
        total = torch.stack(push.of_side.flags).sum(dim=0)
        bucket.flat[bucket.grad_numel:].copy_(total / size)
        return total

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        wire, n, size = self._wire_of(bucket), bucket.grad_numel, groups.size
        yield "compress"
        m = self.with_residuals(bucket, ctx)
        padded = torch.zeros(wire.values.numel(), dtype=m.dtype, device=m.device)
        padded[:n] = m
        blocks = padded.view(wire.blocks, self.block)
        quantize(blocks, wire.values.view(wire.blocks, self.block), wire.side[:wire.blocks])
        m -= dequantize(wire.values.view(wire.blocks, self.block), wire.side[:wire.blocks]).view(-1)[:n]
        wire.side[wire.blocks:].copy_(bucket.flat[n:])
        yield "network"
        for values, side in zip(wire.of_values.push, wire.of_side.push):
            run_messages(values + side, groups)
        rounding = [self._average_into(own, parts, side_own, side_parts, size)
                    for (own, parts), (side_own, side_parts) in zip(wire.of_values.aggregate, wire.of_side.aggregate)]
        for values, side in zip(wire.of_values.pull, wire.of_side.pull):
            run_messages(values + side, groups)
        bucket.bytes_sent = wire.bytes_sent
        bucket.outcome = self.name
        yield "decompress"
        average = dequantize(wire.values.view(wire.blocks, self.block), wire.side[:wire.blocks]).view(-1)
        bucket.flat[:n].copy_(average[:n])
        bucket.flat[n:].copy_(wire.side[wire.blocks:])
        add_owner_rounding(m, wire.of_values.aggregate, wire.values, rounding, size)
        return self.propose_all(bucket, m, ctx)

    def _average_into(self, own: Tensor, parts: list[Tensor], side_own: Tensor, side_parts: list[Tensor],
                      size: int) -> Tensor:
        """An owned chunk: the mean of every rank's dequantized part (summed in rank order), quantized into
        ``own`` and the scales of ``side_own``, its flags (if it carries them) averaged; what the
        quantization of the mean lost, flat (the last chunk's parts end where the bucket does: their
        last block is padded with zeros here)."""
        blocks = -(-own.numel() // self.block)
        mean = _dequantized_sum(parts, [side[:blocks] for side in side_parts], blocks, self.block).div_(size)
        quantized = _whole_blocks(own, blocks, self.block)
        quantize(mean, quantized, side_own[:blocks])
        own.copy_(quantized.view(-1)[:own.numel()])
        flags = [side[blocks:] for side in side_parts]
        if flags[0].numel():
            side_own[blocks:].copy_(torch.stack(flags).sum(dim=0).div_(size))
        return mean.sub_(dequantize(quantized, side_own[:blocks])).view(-1)


def _dequantized_sum(parts: Sequence[Tensor], scales: Sequence[Tensor], blocks: int, block: int) -> Tensor:
    """The sum, in rank order, of every rank's part of a chunk (int8, flat) dequantized with its
    ``scales``: ``blocks`` rows of ``block``, in the scales' dtype."""
    total = None
    for part, scale in zip(parts, scales):
        value = dequantize(_whole_blocks(part, blocks, block), scale)
        total = value if total is None else total.add_(value)
    return total


def _whole_blocks(values: Tensor, blocks: int, block: int) -> Tensor:
    """``values`` (int8, flat) as ``blocks`` rows of ``block``: a view when it fills them, else a copy
    padded with zeros."""
    if values.numel() == blocks * block:
        return values.view(blocks, block)
    padded = values.new_zeros(blocks * block)
    padded[:values.numel()] = values
    return padded.view(blocks, block)
