"""A plain all-reduce: torch DDP's own arithmetic (``dist.all_reduce`` of the bucket, then divide by P).

The bucket's whole flat buffer (gradients, used flags, aborted flag: ``bucket.py``) is summed over the
ranks in one collective on the channel's group, then divided by P: every rank ends with the average, a
flag > 0 wherever some rank set it, as the default path leaves them. It is exact (the average to fp32
rounding, summed in the bucket's dtype as DDP sums), never chosen by cost: a layer takes it only when an
override asks (``overrides={"fc": "AR"}``). Cost: a ring all-reduce sends 2 (P-1) / P of the buffer per
rank in 2 (P-1) steps. This path is a whole module and one line of registration (``paths/__init__.py``).
"""
from __future__ import annotations

from collections.abc import Generator

from ..bucket import Bucket
from ..link import LinkModel
from ..pools import ChannelGroups
from .base import BucketCost, Path, Prediction, SyncContext


def ring_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


class AllReducePath(Path):
    """The bucket all-reduced (summed) on the channel's group, then divided by the number of ranks."""

    name = "AR"

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction:
        sent = ring_bytes_per_rank(cost.nbytes, world_size)
        return Prediction(sent, link.seconds(sent, 2 * (world_size - 1)))

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        yield "network"  # staged when it was submitted (core.py)
        groups.all_reduce(bucket.flat)
        bucket.flat.div_(groups.size)
        bucket.bytes_sent = int(ring_bytes_per_rank(bucket.nbytes, groups.size))
        bucket.outcome = self.name
        return self.synced(bucket, ctx)  # the engine scatters the averages when the backward ends
