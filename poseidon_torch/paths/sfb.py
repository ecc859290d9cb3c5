"""Sufficient-factor broadcasting (SFB): the path of a bucket that is one FC layer alone (``fc.py``).

Every rank all-gathers every rank's factors (U, V) with a header (rows, exact, aborted) in one
collective, each block padded to the rows of the last pass (again with room for all when a rank has
more), and rebuilds the exact average with one GEMM (:func:`~poseidon_torch.fc.rebuild_gradients`),
which the engine *adds* to ``.grad`` at the end of the pass: ``.grad`` then holds only the previous,
already synced value (identical on every rank), so every rank computes the same bits.

Invariants (SFB only where it is exact): a rank whose local gradient is more than its captured
factors, or whose backward was aborted, says so in its header, and every rank then sends the layer
through the default path for this pass (outcome ``"SFB-><default>"``), with each rank's whole local
gradient (the factors' part added to the staged flat buffer, the user's tensor hooks applied):
exact in every case. Factors travel in the parameter's dtype.

Cost (the coordinator's and the simulator's): a ring all-gather of P blocks sends P - 1 per rank in
P - 1 steps, plus the rebuild GEMM of M x PK x N at the probed rate, on the compute lane.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..bucket import Bucket
from ..fc import rebuild_gradients
from ..link import LinkModel
from ..pools import ChannelGroups
from .base import BucketCost, GradWriter, Path, PathEnv, Prediction, SyncContext

HEADER = ("rows", "exact", "aborted")  # int64 fields before the factors
_HEADER_BYTES = 8 * len(HEADER)


def block_bytes(k: int, m: int, n: int, element_size: int) -> int:
    """Bytes of one rank's block: the header, then K rows of [U | V], padded to a multiple of 8."""
    return -(-(_HEADER_BYTES + k * (m + n) * element_size) // 8) * 8


def sfb_bytes_per_rank(k: int, m: int, n: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in one factor all-gather padded to K rows: a ring all-gather of P blocks
    sends P - 1 blocks per rank."""
    return (world_size - 1) * block_bytes(k, m, n, element_size)


def sfb_messages(world_size: int) -> int:
    """Sequential ring steps of the one all-gather."""
    return world_size - 1


@dataclass
class Gathered:
    """Every rank's header and factors after an all-gather, rows in rank order, padding stripped."""

    headers: list[dict[str, int]]
    u: Tensor  # (sum K) x M
    v: Tensor  # (sum K) x N
    bytes_sent: int


def exchange_factors(header: dict[str, int], u: Tensor, v: Tensor, k_pad: int, groups: ChannelGroups,
                     wire_device: torch.device) -> Gathered:
    """All-gather every rank's (header, U, V) in one collective, each block padded to ``k_pad`` rows
    (a rank with more rows sends the first ``k_pad``; its header says how many it has, so the caller
    can exchange again with room for all)."""
    world_size = groups.size
    (k, m), n = u.shape, v.shape[1]
    nbytes = block_bytes(k_pad, m, n, u.element_size())
    block = torch.zeros(nbytes, dtype=torch.uint8, device=wire_device)
    block[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor([header[f] for f in HEADER]))
    rows = min(k, k_pad)
    payload = _payload(block, k_pad, m + n, u.dtype)
    payload[:rows, :m] = u[:rows]
    payload[:rows, m:] = v[:rows]
    everyone = torch.empty(world_size * nbytes, dtype=torch.uint8, device=wire_device)
    groups.all_gather(everyone, block)
    headers, us, vs = [], [], []
    for r in range(world_size):
        own = everyone[r * nbytes:(r + 1) * nbytes]
        fields = own[:_HEADER_BYTES].view(torch.int64).tolist()
        headers.append(dict(zip(HEADER, fields)))
        data = _payload(own, k_pad, m + n, u.dtype)[:min(fields[0], k_pad)]
        us.append(data[:, :m])
        vs.append(data[:, m:])
    return Gathered(headers, torch.cat(us), torch.cat(vs), (world_size - 1) * nbytes)


def _payload(block: Tensor, rows: int, width: int, dtype: torch.dtype) -> Tensor:
    return block[_HEADER_BYTES:_HEADER_BYTES + rows * width * dtype.itemsize].view(dtype).view(rows, width)


def predict_sfb(k: int, m: int, n: int, element_size: int, world_size: int, link: LinkModel,
                gemm_flops: float) -> tuple[float, float]:
    """(bytes per rank, seconds) of one SFB sync at K rows per rank: the all-gather and the rebuild."""
    sent = sfb_bytes_per_rank(k, m, n, world_size, element_size)
    return sent, link.seconds(sent, sfb_messages(world_size)) + sfb_rebuild_seconds(k, m, n, world_size, gemm_flops)


def sfb_rebuild_seconds(k: int, m: int, n: int, world_size: int, gemm_flops: float) -> float:
    """SFB's rebuild of the gradient from every rank's factors: a GEMM of M x PK x N."""
    return 2.0 * m * (world_size * k) * n / gemm_flops


class SFBPath(Path):
    """The sync of a one-layer FC bucket: all-gather the factors, rebuild the average."""

    name = "SFB"
    factors = True
    by_cost = True
    phase_labels = {"rebuild": "SFB rebuild (GEMM)"}

    def __init__(self, env: PathEnv) -> None:
        super().__init__(env)
        self.default, self.wire_device = env.default, env.wire_device
        #: the outcome of a sync that fell back to the default path
        self.fallback = f"{self.name}->{self.default.name}"

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction | None:
        fc = cost.fc
        if fc is None or gemm_flops is None:
            return None
        sent, seconds = predict_sfb(fc.k, fc.m, fc.n, fc.element_size, world_size, link, gemm_flops)
        return Prediction(sent, seconds, sfb_rebuild_seconds(fc.k, fc.m, fc.n, world_size, gemm_flops))

    def stage(self, bucket: Bucket, ctx: SyncContext) -> None:
        """What a fallback to the default path reads of ``.grad`` (the factors themselves are held by the
        layer): the ``.grad`` that exist; the zeros of the others only if the fallback happens."""
        bucket.stage(ctx.aborted, ctx.shadow, defer_zeros=True)

    def stage_for_update(self, bucket: Bucket, ctx: SyncContext) -> None:
        self.stage(bucket, ctx)

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        """Sync one FC layer's bucket through SFB (``ctx``: with the pass's backward ``task`` and the rows
        ``k_pad`` to make room for)."""
        layer = bucket.fc
        yield "gather"
        u, v = layer.local_factors(ctx.task)
        if ctx.shadow:
            u, v = u[:0], v[:0]
        exact = ctx.shadow or (not ctx.aborted and layer.exact_locally(bucket))
        header = {"rows": u.shape[0], "exact": int(exact), "aborted": int(ctx.aborted)}
        wire_u, wire_v = u.to(self.wire_device), v.to(self.wire_device)
        yield "network"
        got = exchange_factors(header, wire_u, wire_v, ctx.k_pad, groups, self.wire_device)
        sent = got.bytes_sent
        if any(h["aborted"] for h in got.headers) or not all(h["exact"] for h in got.headers):
            # someone's local gradient is more than its factors (or a backward was aborted): every
            # rank sends its whole local gradient through the default path instead, exact in every case.
            # An aborted backward of this rank is drained at the next forward, after the user may
            # have zeroed .grad: its factors are dropped, as the rest of that backward is.
            bucket.fill_missing()
            if not (ctx.shadow or ctx.aborted):
                layer.add_local(bucket, u, v)
            layer.consume(ctx.task)
            synced = yield from self.default.sync(bucket, groups, ctx)
            bucket.bytes_sent += sent
            bucket.outcome = self.fallback
            return synced
        k_max = max(h["rows"] for h in got.headers)
        if k_max > ctx.k_pad:  # more rows than last pass: again, with room for all
            got = exchange_factors(header, wire_u, wire_v, k_max, groups, self.wire_device)
            sent += got.bytes_sent
        bucket.bytes_sent = sent
        bucket.outcome = self.name
        for j, p in enumerate(bucket.params):  # a parameter frozen since the layer went on SFB gets nothing
            bucket.used_anywhere[j] = int(k_max > 0 and p.requires_grad)
        layer.consume(ctx.task)
        if ctx.shadow or k_max == 0:  # no rank used the layer: its gradients stay untouched, as in DDP
            return k_max > 0
        yield "rebuild"
        # on the layer's device (a GPU rebuilds on the channel's side stream, not on the sync thread's CPU)
        layer.average = rebuild_gradients(got.u.to(bucket.device), got.v.to(bucket.device), self.world_size,
                                          layer.spec)
        return True

    def average_of(self, bucket: Bucket) -> dict[int, Tensor | None]:
        """The rebuilt average (taken from the layer), or after a fallback the default path's."""
        rebuilt = bucket.fc.take_average()
        if rebuilt is None:
            return super().average_of(bucket)
        return dict(zip(map(id, bucket.fc.params), rebuilt))

    def write(self, bucket: Bucket, grads: GradWriter, late: bool) -> None:
        """The rebuilt average *added* to ``.grad`` (late or not: the late part survives it), or after a
        fallback the default path's average."""
        layer = bucket.fc
        layer.take_local()
        average = layer.take_average()
        if bucket.outcome == self.fallback:
            super().write(bucket, grads, late)
        elif average is not None:
            grads.add(layer, average)

    def keep_local(self, bucket: Bucket) -> None:
        """The local gradient stays, a fallback's factor part (which autograd never computed) included."""
        layer = bucket.fc
        layer.take_average()
        super().keep_local(bucket)
        local = layer.take_local()
        if local is not None:
            layer.add_to_grad(local)
            bucket.dirty.fill_(1)  # the bucket is the FC layer alone

    def forget(self, bucket: Bucket, aborted: bool) -> None:
        bucket.fc.take_average()
        bucket.fc.take_local()
