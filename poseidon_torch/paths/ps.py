"""Sharded key-value store colocated with the workers: Poseidon's parameter-server path (``PSPath``),
the default path (every bucket starts on it; the others fall back to it).

The gradient space (every bucket's flat buffer, in bucket order) is cut into chunks of at most
``chunk_bytes`` (2 MB by default), dealt round-robin over the shards (one shard per rank). Chunks never
straddle two buckets, so each bucket's sync is independent; a bucket smaller than P chunks is cut into P
equal chunks, so every shard carries an equal share of every sync. All ranks compute the same plan.

One sync of a bucket, on the channel's process groups, with P ranks:
- push: every rank sends each chunk it does not own to the chunk's owner (point-to-point);
- aggregate: the owner adds its own part and exactly P - 1 pushes in rank order (rank 0's, then rank
  1's, ..., whoever owns the chunk, so the bits do not depend on the chunk plan) and divides by P
  (in fp32 for half-precision buckets, so the sum cannot overflow);
- pull: the owner sends the averaged chunk to the P - 1 other ranks.
Each phase runs in P - 1 staggered rounds (round i: send to rank + i, receive from rank - i), so no link
carries two flows at once: without it, P - 1 pushes converge on an owner's link at the same moment, which
overflows a shaped switch queue and stalls TCP on retransmission timeouts.

With a ServerOptimizer the owner also applies the update between aggregation and pull (``update.py``:
:meth:`PSPath.reduce` stops after the aggregation), so the pull carries parameter values; for that,
every rank also sends its used and aborted flags to each owner (``flags_to_owners``), and optimizers
that read whole parameters get chunks aligned to them (``aligned``). The shards of the parameter
server are these chunks.

The message schedule of a bucket (every send, receive and add, as views of its flat buffer and of the
owner's receive buffers) is computed once, when the bucket is built. Bytes sent by one rank for a chunk of
b bytes: b if it is not the owner, (P - 1) b if it is: 2 (P - 1) b per chunk over all ranks, so with
balanced owners a rank sends 2 (P - 1) / P of the bucket's bytes per sync, the volume of a
bandwidth-optimal all-reduce. Every rank ends with bit-identical averages (the owner's sum is the only
one computed).
"""
from __future__ import annotations

from collections.abc import Collection, Generator, Sequence
from dataclasses import dataclass, field

import torch

from ..bucket import Bucket, JobCost
from ..link import LinkModel
from ..pools import ChannelGroups
from .base import AtOwners, BucketCost, Path, PathEnv, Prediction, SyncContext

#: A point-to-point message: (True to send or False to receive, tensor, peer's rank, tag).
Message = tuple[bool, torch.Tensor, int, int]

#: The size of the pieces the gradient space is cut into (``PoseidonDDP(chunk_bytes=...)``).
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
#: No chunk smaller than this is cut off a bucket just to spread it: tiny messages are latency-bound.
MIN_CHUNK_BYTES = 16 * 1024


@dataclass(frozen=True)
class Chunk:
    start: int  # element offset in the bucket's flat buffer
    stop: int
    owner: int  # group rank of the shard that aggregates this chunk
    tag: int    # message tag, unique within the bucket


def plan_chunks(numels: Sequence[int], element_sizes: Sequence[int], world_size: int,
                chunk_bytes: int) -> list[list[Chunk]]:
    """Cut each bucket's flat buffer into chunks of at most ``chunk_bytes`` and deal them round-robin
    over the shards (chunk i of the whole gradient space goes to shard i mod P). A bucket smaller than
    P chunks is cut into P equal chunks (none under ``MIN_CHUNK_BYTES``), so every shard takes an equal
    share of every sync: a sync lasts as long as its busiest owner."""
    plan, dealt = [], 0
    for numel, element_size in zip(numels, element_sizes):
        if chunk_bytes < element_size:
            raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one element ({element_size} bytes)")
        max_elems = chunk_bytes // element_size
        min_elems = max(1, MIN_CHUNK_BYTES // element_size)
        elems = min(max_elems, max(-(-numel // world_size), min_elems))
        chunks = [Chunk(start, min(start + elems, numel), (dealt + tag) % world_size, tag)
                  for tag, start in enumerate(range(0, numel, elems))]
        dealt += len(chunks)
        plan.append(chunks)
    return plan


def plan_aligned_chunks(param_numels: Sequence[Sequence[int]], flat_numels: Sequence[int],
                        element_sizes: Sequence[int], world_size: int, chunk_bytes: int) -> list[list[Chunk]]:
    """Chunks of whole parameters, for optimizers whose update of one element reads the whole
    parameter (LAMB, LARS): consecutive parameters fill a chunk up to ``chunk_bytes``, a larger one is a
    chunk alone; the flags after the last parameter ride with the last chunk. Dealt round-robin over
    the shards, as :func:`plan_chunks`."""
    plan, dealt = [], 0
    for numels, flat_numel, element_size in zip(param_numels, flat_numels, element_sizes):
        max_elems = max(1, chunk_bytes // element_size)
        starts, start, filled = [0], 0, 0
        for numel in numels:
            if filled and filled + numel > max_elems:
                start += filled
                starts.append(start)
                filled = 0
            filled += numel
        stops = starts[1:] + [flat_numel]
        plan.append([Chunk(a, b, (dealt + tag) % world_size, tag) for tag, (a, b) in enumerate(zip(starts, stops))])
        dealt += len(starts)
    return plan


def ps_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """Mean bytes one rank sends on the PS path for a flat buffer of ``nbytes``: it pushes the
    (P-1)/P it does not own once and sends its own 1/P to each of the P-1 peers."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def ps_messages(world_size: int) -> int:
    """Latency rounds of one PS sync: push, then pull, each in P - 1 staggered rounds."""
    return 2 * (world_size - 1)


def predict_ps(nbytes: float, world_size: int, link: LinkModel) -> tuple[float, float]:
    """(bytes per rank, seconds) of one PS sync of a flat buffer of ``nbytes``."""
    sent = ps_bytes_per_rank(nbytes, world_size)
    return sent, link.seconds(sent, ps_messages(world_size))


@dataclass
class Schedule:
    """Every message and add of one bucket's sync, precomputed."""

    push: list[list[Message]] = field(default_factory=list)  # per staggered round
    pull: list[list[Message]] = field(default_factory=list)
    #: per owned chunk: its piece of the flat buffer, and every rank's part in rank order (the piece
    #: itself at this rank's place, receive buffers elsewhere)
    aggregate: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)
    #: with ``flags_to_owners``, on a rank that owns a chunk: every rank's flags in rank order
    flags: list[torch.Tensor] = field(default_factory=list)
    bytes_sent: int = 0
    pull_bytes: int = 0  #: of which the pull


class PSPath(Path):
    """The sharded KV store's sync of one bucket: gather, push, aggregate, pull (the engine scatters)."""

    name = "PS"
    native = True

    def __init__(self, env: PathEnv) -> None:
        super().__init__(env)
        self.chunk_bytes = env.chunk_bytes
        #: chunks of whole parameters (:func:`plan_aligned_chunks`) instead of cut anywhere
        self.aligned = False
        #: every rank also pushes its used and aborted flags to each owner of a chunk of the bucket, so
        #: an owner knows them before its pull (the server's update needs them)
        self.flags_to_owners = False
        self._schedules: dict[int, Schedule] = {}
        self._chunks: dict[int, list[Chunk]] = {}

    def predict(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                memory_bps: float | None = None) -> Prediction:
        return Prediction(*predict_ps(cost.nbytes, world_size, link))

    def predict_update(self, cost: BucketCost, world_size: int, link: LinkModel, gemm_flops: float | None,
                       memory_bps: float | None, pull: Prediction) -> Prediction:
        """Its reduce is the push: with the pull of the new values it is a sync's bytes."""
        return self.predict(cost, world_size, link, gemm_flops, memory_bps)

    def predict_pull(self, nbytes: float, world_size: int, link: LinkModel) -> Prediction:
        """The pull alone (the owners' new values of ``nbytes``, after an update at the owners)."""
        pulled = ps_bytes_per_rank(nbytes, world_size) / 2
        return Prediction(pulled, link.seconds(pulled, world_size - 1))

    def job_cost(self, link: LinkModel) -> JobCost:
        """Seconds per job of a bucket of n bytes by the link model: its latency per message round, its
        bandwidth for the bytes a job sends per rank."""
        size = self.world_size
        return JobCost(link.alpha_s * ps_messages(size), link.beta_s_per_byte * 2 * (size - 1) / size)

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """Deal the chunks of ``buckets`` over the shards and compute every bucket's schedule."""
        sizes = [b.flat.element_size() for b in buckets]
        if self.aligned:
            plan = plan_aligned_chunks([[p.numel() for p in b.params] for b in buckets],
                                       [b.flat.numel() for b in buckets], sizes, self.world_size, self.chunk_bytes)
        else:
            plan = plan_chunks([b.flat.numel() for b in buckets], sizes, self.world_size, self.chunk_bytes)
        self._chunks = {id(b): chunks for b, chunks in zip(buckets, plan)}
        self._schedules = {id(b): self._schedule(b, chunks) for b, chunks in zip(buckets, plan)}

    def chunks_of(self, bucket: Bucket) -> list[Chunk]:
        return self._chunks[id(bucket)]

    def schedule_of(self, bucket: Bucket) -> Schedule:
        return self._schedules[id(bucket)]

    def bytes_sent(self, bucket: Bucket) -> int:
        return self._schedules[id(bucket)].bytes_sent

    def pull_bytes(self, bucket: Bucket) -> int:
        return self._schedules[id(bucket)].pull_bytes

    def sync(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, bool]:
        """Average ``bucket``'s gradients over all ranks; yields the phases as they begin. ``ctx`` says
        whether this rank's backward was aborted or it has joined."""
        yield "network"  # staged when it was submitted (core.py)
        self.average(bucket, groups)
        bucket.bytes_sent = self.bytes_sent(bucket)
        bucket.outcome = self.name
        return self.synced(bucket, ctx)  # the engine scatters the averages when the backward ends

    def reduce(self, bucket: Bucket, groups: ChannelGroups, ctx: SyncContext) -> Generator[str, None, AtOwners]:
        """Push and aggregate: each owner holds its chunks' averages and every rank's flags (the pull
        follows the update, ``update.py``)."""
        yield "network"  # staged when it was submitted (core.py)
        self.push(bucket, groups)
        flags = self.owner_flags(bucket)
        self.aggregate(bucket)
        bucket.bytes_sent = self.bytes_sent(bucket) - self.pull_bytes(bucket)
        bucket.outcome = self.name
        return AtOwners(flags)

    def average(self, bucket: Bucket, groups: ChannelGroups) -> None:
        """Push, aggregate and pull ``bucket.flat`` in place (the network part of a sync)."""
        self.push(bucket, groups)
        self.aggregate(bucket)
        self.pull(bucket, groups)

    def push(self, bucket: Bucket, groups: ChannelGroups) -> None:
        """Send every part of the bucket to its owner; receive the parts of the chunks this rank owns."""
        for messages in self._schedules[id(bucket)].push:
            run_messages(messages, groups)

    def aggregate(self, bucket: Bucket) -> None:
        """Average the chunks this rank owns, in place."""
        for own, contributions in self._schedules[id(bucket)].aggregate:
            _aggregate_into(own, contributions, self.world_size)

    def pull(self, bucket: Bucket, groups: ChannelGroups) -> None:
        """Send the chunks this rank owns to every peer; receive the others from their owners."""
        for messages in self._schedules[id(bucket)].pull:
            run_messages(messages, groups)

    def owner_flags(self, bucket: Bucket) -> torch.Tensor | None:
        """With ``flags_to_owners``, after the push and before the aggregation: the sum over all ranks
        of the bucket's used and aborted flags (None on a rank that owns no chunk of it)."""
        parts = self._schedules[id(bucket)].flags
        if not parts:
            return None
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def _schedule(self, bucket: Bucket, chunks: Sequence[Chunk]) -> Schedule:
        return build_schedule(bucket.flat, bucket.grad_numel, chunks, self.rank, self.world_size, self.flags_to_owners)


def build_schedule(flat: torch.Tensor, grad_numel: int, chunks: Sequence[Chunk], rank: int, size: int,
                   flags_to_owners: bool = False, owners: Collection[int] | None = None) -> Schedule:
    """Every message and add of one sync of ``flat`` (gradients up to ``grad_numel``, then the flags)
    cut into ``chunks``, for ``rank`` of ``size``: the views it sends, receives and sums, precomputed.
    With ``flags_to_owners`` every rank's flags also go to ``owners`` (by default the chunks' owners)."""
    schedule = Schedule()
    inbox: dict[tuple[Chunk, int], torch.Tensor] = {}
    flags = flat[grad_numel:]
    owners = {c.owner for c in chunks} if owners is None else set(owners)
    flag_tag = len(chunks)
    for shift in range(1, size):
        to, frm = (rank + shift) % size, (rank - shift) % size
        push, pull = [], []
        if flags_to_owners and to in owners:
            push.append((True, flags, to, flag_tag))
        if flags_to_owners and rank in owners:
            push.append((False, inbox.setdefault((None, frm), torch.empty_like(flags)), frm, flag_tag))
        for c in chunks:
            piece = flat[c.start:c.stop]
            if c.owner == to:  # push my part of the chunk ``to`` owns
                push.append((True, piece, to, c.tag))
            if c.owner == rank:  # receive ``frm``'s part of my chunk; later send ``to`` the average
                push.append((False, inbox.setdefault((c, frm), torch.empty_like(piece)), frm, c.tag))
                pull.append((True, piece, to, c.tag))
            if c.owner == frm:  # receive the average of the chunk ``frm`` owns
                pull.append((False, piece, frm, c.tag))
        schedule.push.append(push)
        schedule.pull.append(pull)
    for c in chunks:
        if c.owner == rank:
            own = flat[c.start:c.stop]
            parts = [own if peer == rank else inbox[(c, peer)] for peer in range(size)]
            schedule.aggregate.append((own, parts))
    if flags_to_owners and rank in owners:
        schedule.flags = [flags if peer == rank else inbox[(None, peer)] for peer in range(size)]
    schedule.bytes_sent = sum(t.numel() * t.element_size() for round_ in schedule.push + schedule.pull
                              for is_send, t, _, _ in round_ if is_send)
    schedule.pull_bytes = sum(t.numel() * t.element_size() for round_ in schedule.pull
                              for is_send, t, _, _ in round_ if is_send)
    return schedule


def run_messages(messages: list[Message], groups: ChannelGroups) -> None:
    """Issue one round's messages, each on the group of its direction, and wait for all (each wait is
    bounded by the groups' timeout, PoseidonDDP's ``timeout``)."""
    if not messages:
        return
    if groups.coalesced:
        device = messages[0][1].device
        groups.up._start_coalescing(device)
        for is_send, t, peer, tag in messages:
            (groups.send if is_send else groups.recv)(t, peer, tag)
        groups.up._end_coalescing(device).wait()
        return
    works = [(groups.send if is_send else groups.recv)(t, peer, tag) for is_send, t, peer, tag in messages]
    for work, (is_send, _, peer, _) in zip(works, messages):
        try:
            work.wait()
        except RuntimeError as exc:  # name the peer: a dead rank shows up here
            raise RuntimeError(f"{'sending to' if is_send else 'receiving from'} rank {peer}: {exc}") from exc


def _aggregate_into(own: torch.Tensor, parts: list[torch.Tensor], world_size: int) -> None:
    """Sum every rank's part in rank order into ``own`` (deterministic, whoever owns the chunk), then
    average; half-precision chunks are summed in fp32."""
    if own.element_size() < 4:
        total = parts[0].float()
        for part in parts[1:]:
            total += part.float()
        own.copy_(total.div_(world_size))
        return
    # the sum starts with rank 0's part: own, or a receive buffer this sync may overwrite; when own is
    # rank 1's part, rank 0's + own goes straight into own (same operands, same order, no copy back)
    total, rest = parts[0], parts[1:]
    if rest and rest[0] is own:
        total, rest = torch.add(parts[0], own, out=own), rest[1:]
    for part in rest:
        total += part
    if total is not own:
        own.copy_(total)
    own.div_(world_size)
