"""The parameter-server update, composed with any path (as torch's ``hook_with_zero_step`` wraps any comm
hook with ZeRO's optimizer step): one wrapper instead of a class per path and mode.

A job of :class:`ServerUpdate` runs the inner path's :meth:`~.base.Path.reduce`, then the owners of the
bucket's chunks (the default path's chunks: the shards, ``server.py``) step their pieces with the
averaged gradient, and the owners' new values are pulled by every rank:
- a path that reduces at the owners (the default path: push, aggregate) leaves each chunk's average at
  its owner, and the pull is the second half of its own sync: the bytes of a plain sync;
- any other path (SFB's rebuilt average, an all-reduce) leaves the average on every rank; the owners
  step from it and the pull of the values follows: the state stays sharded, at (P-1)/P of the layer's
  bytes per rank per step (which the coordinator charges such a path in these modes).
Either way the new values wait in the bucket's flat buffer; the mode copies them into the parameters on
the training thread. The job yields ``"update"`` between the reduction and the update, so the engine's
channel plan may cut it there (``schedule.py``): global-norm clipping then waits for every bucket's
push before the first update (the server's ``before_updates``).

Invariants: the update of a bucket no rank used, or of a pass some rank aborted, steps nothing (the
reduction says so on every rank alike); a parameter some rank used is stepped on exactly one owner.
"""
from __future__ import annotations

from collections.abc import Generator

from torch import Tensor

from ..bucket import Bucket
from ..pools import ChannelGroups
from ..server import Piece, Server
from .base import AtOwners, OnEveryRank, Path, SyncContext
from .ps import PSPath


class ServerUpdate:
    """``inner``'s job with the update at the owners (``server``: this rank's shards over ``kv``'s chunks):
    a :class:`~.base.Job`."""

    native = False

    def __init__(self, inner: Path, kv: PSPath, server: Server) -> None:
        self.inner, self.kv, self.server = inner, kv, server
        self.name = inner.name

    def stage(self, bucket: Bucket, ctx: SyncContext) -> None:
        self.inner.stage_for_update(bucket, ctx)

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        reduced = yield from self.inner.reduce(bucket, groups, ctx)
        if reduced is None:  # aborted, or no rank used the bucket: the same on every rank
            return False
        shard = self.server.shard(bucket)
        if not isinstance(reduced, AtOwners) or reduced.flags is not None:
            shard.stage(gradients(reduced, bucket, shard.pieces))
        yield "update"
        self.server.update(bucket)
        yield "network"
        sent = bucket.bytes_sent
        self.kv.pull(bucket, groups)
        bucket.bytes_sent = sent + self.kv.pull_bytes(bucket)
        if isinstance(reduced, OnEveryRank):
            bucket.upload()  # the new values replace the average the inner path left on every rank
            return True
        # .grad stays as backward left it (zero_grad() clears it, as before any optimizer step)
        synced = bucket.read_flags()
        if synced:
            bucket.dirty.zero_()
        return synced


def gradients(reduced: AtOwners | OnEveryRank, bucket: Bucket, pieces: list[Piece]) -> list[Tensor | None]:
    """Each owned piece's averaged gradient (None: not stepped: the pass was aborted, or no rank used
    its parameter)."""
    if isinstance(reduced, AtOwners):
        aborted = bool(reduced.flags[-1] > 0)
        used = (reduced.flags[:-1] > 0).tolist()
        return [None if aborted or not used[piece.position] else piece.view_of(bucket.flat) for piece in pieces]
    used = bucket.used_anywhere.tolist()
    average = reduced.average
    return [average[id(piece.param)].reshape(-1)[piece.lo:piece.hi].view(piece.tensor.shape)
            if used[piece.position] and average[id(piece.param)] is not None else None for piece in pieces]
