"""Interval math of poseidon_torch.trace.overlap against a brute-force reference on a small integer grid.

The reference marks unit cells ``[k, k + 1)`` covered by any interval; on integer grids the covered
time is exactly the number of marked cells.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_torch.trace.overlap import difference, intersection_length, overlap_ratio, total_length, union

GRID = 40


def cells(intervals) -> set[int]:
    return {k for start, end in intervals for k in range(start, end)}


def is_canonical(merged) -> bool:
    positive = all(start < end for start, end in merged)
    separated = all(left[1] < right[0] for left, right in zip(merged, merged[1:]))
    return positive and separated


@st.composite
def random_intervals(draw, max_size: int = 8):
    pairs = draw(st.lists(st.tuples(st.integers(0, GRID), st.integers(0, GRID)), max_size=max_size))
    return [(min(a, b), max(a, b)) for a, b in pairs]


@st.composite
def disjoint_intervals(draw):
    points = sorted(draw(st.sets(st.integers(0, GRID), max_size=10)))
    return [(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]


@st.composite
def touching_intervals(draw):
    points = sorted(draw(st.sets(st.integers(0, GRID), max_size=8)))
    chain = list(zip(points, points[1:]))
    return draw(st.permutations(chain))


@st.composite
def nested_intervals(draw):
    start = draw(st.integers(0, GRID))
    end = draw(st.integers(start, GRID))
    inner = draw(st.lists(st.tuples(st.integers(start, end), st.integers(start, end)), max_size=5))
    return [(start, end)] + [(min(a, b), max(a, b)) for a, b in inner]


@st.composite
def identical_intervals(draw):
    return draw(random_intervals(max_size=3)) * draw(st.integers(1, 3))


#: examples take microseconds; without a deadline a loaded shared machine cannot make them flaky
no_deadline = settings(deadline=None)

interval_sets = st.one_of(
    random_intervals(), disjoint_intervals(), touching_intervals(), nested_intervals(), identical_intervals()
)


@no_deadline
@given(interval_sets)
def test_union_is_canonical_and_covers_the_same_cells(intervals):
    merged = union(intervals)
    assert is_canonical(merged)
    assert cells(merged) == cells(intervals)
    assert union(merged) == merged
    assert union(reversed(intervals)) == merged


@no_deadline
@given(interval_sets)
def test_total_length_counts_covered_cells(intervals):
    assert total_length(intervals) == len(cells(intervals))


@no_deadline
@given(interval_sets, interval_sets)
def test_intersection_length_matches_reference(a, b):
    expected = len(cells(a) & cells(b))
    assert intersection_length(a, b) == expected
    assert intersection_length(b, a) == expected


@no_deadline
@given(interval_sets, interval_sets)
def test_difference_covers_the_cells_of_a_not_in_b(a, b):
    left = difference(a, b)
    assert cells(left) == cells(a) - cells(b)
    assert is_canonical(left)


def test_difference_cuts_holes_and_ends():
    assert difference([(0, 10), (20, 30)], [(2, 4), (8, 22), (29, 40)]) == [(0, 2), (4, 8), (22, 29)]
    assert difference([(0, 10)], []) == [(0, 10)]
    assert difference([(0, 10)], [(0, 10)]) == []


@no_deadline
@given(interval_sets, interval_sets)
def test_overlap_ratio_matches_reference(comm, compute):
    comm_cells = cells(comm)
    expected = len(comm_cells & cells(compute)) / len(comm_cells) if comm_cells else 1.0
    assert overlap_ratio(comm, compute) == pytest.approx(expected)
    assert 0.0 <= overlap_ratio(comm, compute) <= 1.0


@no_deadline
@given(interval_sets)
def test_interval_sets_fully_overlap_themselves(intervals):
    assert overlap_ratio(intervals, intervals) == 1.0
    assert intersection_length(intervals, intervals) == total_length(intervals)


def test_touching_intervals_merge():
    assert union([(5, 9), (0, 5)]) == [(0, 9)]
    assert union([(0, 3), (3, 3), (3, 7), (8, 10)]) == [(0, 7), (8, 10)]
    assert intersection_length([(0, 5)], [(5, 9)]) == 0


def test_nested_intervals_collapse_to_the_outer_one():
    assert union([(0, 100), (10, 20), (30, 90), (0, 100)]) == [(0, 100)]
    assert total_length([(0, 100), (10, 20)]) == 100
    assert overlap_ratio([(10, 20)], [(0, 100)]) == 1.0
    assert overlap_ratio([(0, 100)], [(10, 20), (30, 40)]) == pytest.approx(0.2)


def test_zero_length_intervals_vanish():
    assert union([(4, 4), (7, 7)]) == []
    assert total_length([(4, 4)]) == 0


def test_partial_overlap_of_backward_and_network():
    assert overlap_ratio(comm=[(50, 150)], compute=[(0, 100)]) == pytest.approx(0.5)


def test_no_communication_counts_as_fully_hidden():
    assert overlap_ratio([], [(0, 10)]) == 1.0
    assert overlap_ratio([(3, 3)], []) == 1.0


def test_reversed_interval_is_rejected():
    with pytest.raises(ValueError, match=r"\(9, 2\)"):
        union([(0, 1), (9, 2)])
