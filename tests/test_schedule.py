"""The channel plan (schedule.py): slot placement, the deadlock-free order, the simulated tail, and
how a job's phases are cut in two."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poseidon_torch.schedule import Halves, SyncingAtEnd, plan_channels


def test_second_slots_follow_the_last_channel_input_side_first():
    plan = plan_channels(5, 2, split=[2, 4, 3])
    assert plan.schedules == ((0, 2, 4, 9, 8, 7), (1, 3))
    assert plan.first_second_slot == 9
    assert [plan.bucket_of(k) for k in (3, 8)] == [3, 3] and plan.is_second(8) and not plan.is_second(4)
    assert plan.channel_of(7) == 0 and plan.channel_of(3) == 1
    assert plan_channels(3, 2).schedules == ((0, 2), (1,)) and plan_channels(3, 2).first_second_slot is None


def test_a_bad_plan_is_refused():
    with pytest.raises(ValueError, match="outside"):
        plan_channels(3, 2, split=[3])
    with pytest.raises(ValueError, match="at least one channel"):
        plan_channels(3, 0)


def run_plan(plan, ready_order: list[int]) -> list[int]:
    """Run ``plan`` as the channels do: a channel takes its next slot once that slot may run (a first
    slot once its bucket is ready, a second slot once its first slot is done); buckets become ready in
    ``ready_order``, one more whenever no channel can move. Returns the slots in the order they ran;
    stops early (fewer slots) if the channels deadlock."""
    position, done, ready, ran = [0] * len(plan.schedules), set(), set(), []
    pending = list(ready_order)
    while True:
        moved = False
        for c, keys in enumerate(plan.schedules):
            if position[c] < len(keys):
                key = keys[position[c]]
                bucket = plan.bucket_of(key)
                if (bucket in done) if plan.is_second(key) else (bucket in ready):
                    done.add(bucket) if not plan.is_second(key) else None
                    ran.append(key)
                    position[c] += 1
                    moved = True
        if not moved:
            if not pending:
                return ran
            ready.add(pending.pop(0))


@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(1, 4), st.sets(st.integers(0, n - 1)), st.permutations(range(n)))))
def test_every_plan_runs_to_the_end_in_any_readiness_order(case):
    """No slot waits for one queued behind it: whatever order gradients become ready in (ranks differ),
    every slot runs, each once, and a bucket's second slot after its first."""
    n, channels, split, ready_order = case
    plan = plan_channels(n, channels, split)
    ran = run_plan(plan, list(ready_order))
    assert sorted(ran) == sorted(list(range(n)) + [n + i for i in split])
    assert all(ran.index(i) < ran.index(n + i) for i in split)


def test_the_jobs_still_syncing_are_those_seen_in_any_watched_pass():
    watch = SyncingAtEnd(passes=3)
    assert not watch.observe([False, False, True, True])
    assert not watch.observe([False, True, False, True])
    assert watch.observe([False, False, False, True]) and watch.final
    assert watch.buckets == {1, 2, 3}
    assert not watch.observe([True, True, True, True]) and watch.buckets == {1, 2, 3}  # final: no more changes
    watch.reset()
    assert not watch.final and watch.buckets == set()


def phases(log: list[str], boundary_reached: bool = True):
    log.append("gather")
    yield "gather"
    if not boundary_reached:
        return "early"
    log.append("push")
    yield "network"
    log.append("before update")
    yield "update"
    log.append("update")
    yield "network"
    log.append("pull")
    return "done"


def drain(generator) -> tuple[list[str], object]:
    seen = []
    while True:
        try:
            seen.append(next(generator))
        except StopIteration as stop:
            return seen, stop.value


def test_halves_cut_where_the_path_yields_the_boundary():
    log: list[str] = []
    halves = Halves(phases(log), "update")
    assert drain(halves.first()) == (["gather", "network"], None)
    assert log == ["gather", "push", "before update"]  # staged before the cut, nothing of the update
    assert drain(halves.second()) == (["update", "network"], "done")
    assert log[-2:] == ["update", "pull"]


def test_a_path_that_ends_before_the_boundary_leaves_an_empty_second_half():
    log: list[str] = []
    halves = Halves(phases(log, boundary_reached=False), "update")
    assert drain(halves.first()) == (["gather"], "early")
    assert drain(halves.second()) == ([], None)


@pytest.mark.parametrize("text,value", [("0", False), ("off", False), ("No", False), ("1", True), ("TRUE", True)])
def test_yes_no_knobs_parse(monkeypatch, text, value):
    from poseidon_torch.env import flag, option

    monkeypatch.setenv("POSEIDON_PULL_PRIORITY", text)
    assert option(None, "PULL_PRIORITY", flag, not value) is value


def test_a_bad_yes_no_knob_names_the_variable(monkeypatch):
    from poseidon_torch.env import flag, option

    monkeypatch.setenv("POSEIDON_PULL_PRIORITY", "maybe")
    with pytest.raises(ValueError, match="POSEIDON_PULL_PRIORITY='maybe'"):
        option(None, "PULL_PRIORITY", flag, True)
