"""The channel plan: which job slots each channel runs, in which order (computed once per bucket plan).

A bucket's sync is one job, or, when the plan *splits* it, two slots: the first runs the path up to
the update at the owners (gather, push, aggregate; an SFB layer's whole exchange), the second runs the
update and the pull. Slot keys: ``i`` for bucket i's job or first slot, ``n + i`` for its second slot
(n buckets). Splitting lets the plan reorder the pulls (ByteScheduler's and P3's priority: the layers
the next forward needs first are pulled first) and puts a point between every push and any update
(global-norm clipping needs every gradient's norm before the first update).

Invariants:
- bucket i's job or first slot runs on channel ``i mod C``, channels keep bucket order (the order in
  which backward makes them ready), as before any split;
- every second slot sits on the channel of the last bucket, after that channel's first slots, in
  input-first order (highest bucket index first); a second slot waits only for its own first slot,
  and first slots wait for nothing but readiness, so no slot ever waits for one queued behind it and
  no pass can deadlock;
- the plan depends only on what every rank shares (bucket count, channels, rank 0's timings, the
  options), so every rank runs the same slots in the same order on every channel.
"""
from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class ChannelPlan:
    """Per channel, the slot keys it runs in order; ``split``: the buckets that have two slots."""

    schedules: tuple[tuple[int, ...], ...]
    split: frozenset[int]
    buckets: int

    @property
    def first_second_slot(self) -> int | None:
        """The key of the second slot that runs before every other second slot (None: no split)."""
        if not self.split:
            return None
        return self.schedules[(self.buckets - 1) % len(self.schedules)][-len(self.split)]

    @cached_property
    def _channel(self) -> dict[int, int]:
        return {key: c for c, keys in enumerate(self.schedules) for key in keys}

    def channel_of(self, key: int) -> int:
        return self._channel[key]

    def is_second(self, key: int) -> bool:
        return key >= self.buckets

    def bucket_of(self, key: int) -> int:
        return key - self.buckets if key >= self.buckets else key


def plan_channels(buckets: int, channels: int, split: Iterable[int] = ()) -> ChannelPlan:
    """Bucket i on channel i mod ``channels``; the second slots of ``split`` at the end of the last
    bucket's channel, input side first."""
    if channels < 1:
        raise ValueError(f"a channel plan needs at least one channel, got {channels}")
    split = frozenset(split)
    if any(not 0 <= i < buckets for i in split):
        raise ValueError(f"split buckets {sorted(split)} outside 0..{buckets - 1}")
    schedules: list[list[int]] = [[] for _ in range(channels)]
    for i in range(buckets):
        schedules[i % channels].append(i)
    if split:
        schedules[(buckets - 1) % channels].extend(buckets + i for i in sorted(split, reverse=True))
    return ChannelPlan(tuple(map(tuple, schedules)), split, buckets)


class SyncingAtEnd:
    """The buckets whose job was still running, on some rank, when backward ended, over the first
    ``passes`` passes of a bucket plan (from the end-of-pass facts, so every rank sees the same): the
    pulls the next forward may wait for. Measured, not simulated: a simulation from the first pass's
    job times predicted no such job where the traces showed two to five (2 and 4 emulated hosts)."""

    def __init__(self, passes: int = 3) -> None:
        self.passes = passes
        self.reset()

    def reset(self) -> None:
        """A new bucket plan: watch again."""
        self.buckets: set[int] = set()
        self.observed = 0

    @property
    def final(self) -> bool:
        return self.observed >= self.passes

    def observe(self, syncing: Sequence[bool]) -> bool:
        """One more pass's flags; True when this pass made the set final."""
        if self.final:
            return False
        self.buckets |= {i for i, running in enumerate(syncing) if running}
        self.observed += 1
        return self.final


class Halves:
    """A sync job's phases cut where the path yields ``boundary``: :meth:`first` runs the phases before
    it, :meth:`second` the rest (from the boundary on). A path that ends before the boundary (an
    aborted or unused SFB layer) leaves an empty second half."""

    def __init__(self, phases: Generator[str, None, object], boundary: str) -> None:
        self._phases, self._boundary = phases, boundary
        self._cut = False

    def first(self) -> Generator[str, None, object]:
        while True:
            try:
                phase = next(self._phases)
            except StopIteration as stop:
                return stop.value
            if phase == self._boundary:
                self._cut = True
                return None
            yield phase

    def second(self) -> Generator[str, None, object]:
        if not self._cut:
            return None
        yield self._boundary
        return (yield from self._phases)
