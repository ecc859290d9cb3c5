"""Sharded key-value store colocated with the workers: Poseidon's parameter-server path.

The flattened gradient space (every syncer's flat buffer, in syncer order) is cut into chunks of at most
``chunk_bytes`` (2 MB by default), dealt round-robin over the shards (one shard per rank). Chunks never
straddle two syncers, so each syncer's sync is independent; a syncer smaller than P chunks is cut into P
equal chunks, so every shard carries an equal share of every sync. All ranks compute the same plan.

One sync of a syncer, on the channel's process groups, with P ranks:
- push: every rank sends each chunk it does not own to the chunk's owner (point-to-point);
- aggregate: the owner adds exactly P - 1 pushes (its counter) to its own part, in rank order, and
  divides by P;
- pull: the owner sends the averaged chunk to the P - 1 other ranks.
Each phase runs in P - 1 staggered rounds (round i: send to rank + i, receive from rank - i), so no link
carries two flows at once: without it, P - 1 pushes converge on an owner's link at the same moment, which
overflows a shaped switch queue and stalls TCP on retransmission timeouts.
Bytes sent by one rank for a chunk of b bytes: b if it is not the owner, (P - 1) b if it is. Over all ranks
that is 2 (P - 1) b per chunk, so with balanced owners a rank sends 2 (P - 1) / P of the model's gradient
bytes per iteration: the same volume as a bandwidth-optimal all-reduce.
Every rank ends with bit-identical averages (the owner's sum is the only one computed).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .pools import ChannelGroups

#: A point-to-point message: (dist.isend or dist.irecv, tensor, peer rank, tag).
Message = tuple[Callable, torch.Tensor, int, int]


@dataclass(frozen=True)
class Chunk:
    start: int  # element offset in the syncer's flat buffer
    stop: int
    owner: int  # rank of the shard that aggregates this chunk
    tag: int    # message tag, unique within the syncer


#: No chunk smaller than this is cut off a syncer just to spread it: tiny messages are latency-bound.
MIN_CHUNK_BYTES = 16 * 1024


def plan_chunks(syncer_numels: Sequence[int], element_size: int, world_size: int,
                chunk_bytes: int) -> list[list[Chunk]]:
    """Cut each syncer's flat buffer into chunks of at most ``chunk_bytes`` and deal them round-robin
    over the shards (chunk i of the whole gradient space goes to shard i mod P). A syncer smaller than
    P chunks is cut into P equal chunks (none under ``MIN_CHUNK_BYTES``), so every shard takes an equal
    share of every sync: syncs run one after another, and a sync lasts as long as its busiest owner."""
    if chunk_bytes < element_size:
        raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one element ({element_size} bytes)")
    max_elems = chunk_bytes // element_size
    min_elems = max(1, MIN_CHUNK_BYTES // element_size)
    plan, dealt = [], 0
    for numel in syncer_numels:
        elems = min(max_elems, max(-(-numel // world_size), min_elems))
        chunks = []
        for tag, start in enumerate(range(0, numel, elems)):
            chunks.append(Chunk(start, min(start + elems, numel), (dealt + tag) % world_size, tag))
        dealt += len(chunks)
        plan.append(chunks)
    return plan


def bytes_sent_by(rank: int, chunks: Sequence[Chunk], element_size: int, world_size: int) -> int:
    """The formula: what ``ShardedKVStore.push_pull`` sends from ``rank`` for one syncer."""
    total = 0
    for c in chunks:
        size = (c.stop - c.start) * element_size
        total += (world_size - 1) * size if c.owner == rank else size
    return total


class ShardedKVStore:
    """The chunk plan of all syncers, and this rank's inbox: one receive buffer per peer for every
    chunk it owns, allocated on first use and kept, so the hot path allocates nothing (about one model
    size of memory per rank, as torch DDP's buckets)."""

    def __init__(self, syncer_numels: Sequence[int], element_size: int, rank: int, world_size: int,
                 chunk_bytes: int) -> None:
        self.rank, self.world_size, self.element_size = rank, world_size, element_size
        self.chunks = plan_chunks(syncer_numels, element_size, world_size, chunk_bytes)
        self._inbox: dict[tuple[int, int], dict[int, torch.Tensor]] = {}

    def bytes_formula(self, syncer_index: int) -> int:
        return bytes_sent_by(self.rank, self.chunks[syncer_index], self.element_size, self.world_size)

    def push_pull(self, syncer_index: int, flat: torch.Tensor, groups: ChannelGroups) -> int:
        """Average ``flat`` over all ranks in place through the sharded store; returns the bytes sent,
        counted from the tensors actually handed to ``isend``."""
        chunks = self.chunks[syncer_index]
        received, pushed = _push(flat, chunks, self.rank, self.world_size, groups,
                                 lambda c, piece: self._inbox_for(syncer_index, c, piece))
        for chunk, contributions in received.items():
            _aggregate_into(flat[chunk.start:chunk.stop], contributions, self.world_size)
        return pushed + _pull(flat, chunks, self.rank, self.world_size, groups)

    def _inbox_for(self, syncer_index: int, chunk: Chunk, piece: torch.Tensor) -> dict[int, torch.Tensor]:
        key = (syncer_index, chunk.tag)
        if key not in self._inbox:
            self._inbox[key] = {peer: torch.empty_like(piece) for peer in _peers(self.rank, self.world_size)}
        return self._inbox[key]


def _peers(rank: int, world_size: int) -> list[int]:
    return [r for r in range(world_size) if r != rank]


def _run_staggered(sends: dict[int, list[Message]], recvs: dict[int, list[Message]], rank: int,
                   world_size: int, groups: ChannelGroups) -> int:
    """Run the messages in P - 1 rounds: in round i this rank sends only to rank + i and receives only
    from rank - i, so every link carries one flow at a time (no incast at an owner). Returns bytes
    sent."""
    sent = 0
    for shift in range(1, world_size):
        to, frm = (rank + shift) % world_size, (rank - shift) % world_size
        sent += _run(sends.get(to, []) + recvs.get(frm, []), rank, groups)
    return sent


def _run(messages: list[Message], rank: int, groups: ChannelGroups) -> int:
    """Issue the messages, each on the group of its direction, and wait for all; returns bytes sent."""
    if not messages:
        return 0
    if groups.batched:
        works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, groups.up, tag) for op, t, peer, tag in messages])
    else:
        works = [op(t, peer, group=groups.for_message(*((rank, peer) if op is dist.isend else (peer, rank))),
                    tag=tag) for op, t, peer, tag in messages]
    for work in works:
        work.wait()  # bounded by the channel groups' timeout (PoseidonDDP's ``timeout``)
    return sum(t.numel() * t.element_size() for op, t, _, _ in messages if op is dist.isend)


def _push(flat, chunks, rank, world_size, groups, inbox) -> tuple[dict[Chunk, dict[int, torch.Tensor]], int]:
    sends: dict[int, list[Message]] = {}
    recvs: dict[int, list[Message]] = {}
    received = {}
    for c in chunks:
        piece = flat[c.start:c.stop]
        if c.owner == rank:
            received[c] = inbox(c, piece)
            for peer, buf in received[c].items():
                recvs.setdefault(peer, []).append((dist.irecv, buf, peer, c.tag))
        else:
            sends.setdefault(c.owner, []).append((dist.isend, piece, c.owner, c.tag))
    return received, _run_staggered(sends, recvs, rank, world_size, groups)


def _aggregate_into(own: torch.Tensor, contributions: dict[int, torch.Tensor], world_size: int) -> None:
    """Add the P - 1 pushed contributions into ``own`` in rank order (deterministic), then average."""
    for peer in sorted(contributions):
        own += contributions[peer]
    own.div_(world_size)


def _pull(flat, chunks, rank, world_size, groups) -> int:
    sends: dict[int, list[Message]] = {}
    recvs: dict[int, list[Message]] = {}
    for c in chunks:
        piece = flat[c.start:c.stop]
        if c.owner == rank:
            for peer in _peers(rank, world_size):
                sends.setdefault(peer, []).append((dist.isend, piece, peer, c.tag))
        else:
            recvs.setdefault(c.owner, []).append((dist.irecv, piece, c.owner, c.tag))
    return _run_staggered(sends, recvs, rank, world_size, groups)
