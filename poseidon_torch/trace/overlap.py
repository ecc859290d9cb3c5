"""Interval arithmetic for communication/computation overlap.

An interval is a ``(start, end)`` pair of integer nanoseconds covering the half-open range
``[start, end)``; its length is ``end - start``.

Invariants:
- every input interval satisfies ``start <= end`` (otherwise ``ValueError``);
- :func:`union` returns intervals sorted by start, each of positive length, pairwise disjoint and
  non-touching: touching intervals (``(0, 5)`` and ``(5, 9)``) merge into one and zero-length
  intervals vanish, so ``union(union(x)) == union(x)`` and the result does not depend on input order;
- lengths count covered time once: ``total_length(x) == sum of lengths of union(x)``, and
  ``intersection_length(a, b) == total_length of union(a) ∩ union(b)``;
- :func:`difference` is ``union(a)`` without ``union(b)``, canonical as :func:`union`'s result;
- :func:`overlap_ratio` follows Holistic Trace Analysis (HTA): the share of communication time
  during which computation also runs, ``|∪comm ∩ ∪compute| / |∪comm|``, in ``[0, 1]``. With no
  communication time at all there is nothing left exposed, so the ratio is defined as ``1.0``.
"""
from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[int, int]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge ``intervals`` into sorted, disjoint, non-touching intervals of positive length."""
    merged: list[Interval] = []
    for start, end in sorted(_checked(intervals)):
        if start == end:
            continue
        if merged and start <= merged[-1][1]:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals: Iterable[Interval]) -> int:
    """Time covered by at least one interval (overlaps counted once)."""
    return sum(end - start for start, end in union(intervals))


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> int:
    """Length of ``union(a) ∩ union(b)``."""
    left, right = union(a), union(b)
    i = j = covered = 0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        covered += max(0, end - start)
        if left[i][1] <= right[j][1]:
            i += 1
        else:
            j += 1
    return covered


def difference(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """``union(a)`` with the time ``union(b)`` covers cut out."""
    cuts = union(b)
    left: list[Interval] = []
    j = 0
    for start, end in union(a):
        while j < len(cuts) and cuts[j][1] <= start:
            j += 1
        k = j
        while k < len(cuts) and cuts[k][0] < end:
            if cuts[k][0] > start:
                left.append((start, cuts[k][0]))
            start = max(start, cuts[k][1])
            k += 1
        if start < end:
            left.append((start, end))
    return left


def overlap_ratio(comm: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """HTA comm/compute overlap: ``|∪comm ∩ ∪compute| / |∪comm|``; ``1.0`` when ``comm`` covers no time."""
    comm = union(comm)
    comm_time = total_length(comm)
    if comm_time == 0:
        return 1.0
    return intersection_length(comm, compute) / comm_time


def _checked(intervals: Iterable[Interval]) -> Iterable[Interval]:
    for start, end in intervals:
        if start > end:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        yield start, end
