"""SSP and asynchronous SGD on the parameter server (``ServerOptimizer(..., staleness=s)``): the bound
holds under random stragglers, no push is lost or applied twice, least squares converges, faults end
with a clear error on every rank, checkpoints resume, and staleness=0 is today's BSP, bit for bit."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stale_workers as sw

STEPS = 8


def check_reads(results: list[dict], staleness: int | None, world_size: int, steps: int,
                skipped: tuple[int, int] | None = None) -> int:
    """Every forward's read on every rank: each slot is 0 or -1/P (a push applied at most once), its own
    pushes of earlier clocks are all in, and (SSP) every rank's pushes of clocks <= c - s - 1. Returns
    the largest staleness seen (clocks of some rank missing that BSP would have had). ``skipped``: a
    (rank, clock) whose backward raised, so it pushed nothing."""
    applied = -1.0 / world_size
    worst = 0
    for rank, result in enumerate(results):
        for clock, read in enumerate(result["reads"]):
            ledger = torch.tensor(read).view(world_size, steps)
            assert bool(((ledger == 0) | (ledger == applied)).all()), f"rank {rank} clock {clock}: {ledger}"
            has = ledger == applied
            if skipped is not None and skipped[1] < clock:  # that (rank, clock) pushed nothing: count it as in
                has[skipped] = True
            assert bool(has[rank, :clock].all()), f"rank {rank} clock {clock} lacks its own earlier pushes: {ledger}"
            assert not bool(has[rank, clock:].any()), f"rank {rank} clock {clock} reads its own future"
            for other in range(world_size):
                missing = [c for c in range(clock) if not has[other, c]]
                if missing:
                    worst = max(worst, clock - missing[0])
                if staleness is not None:
                    assert all(c > clock - staleness - 1 for c in missing), \
                        f"rank {rank} at clock {clock} (s={staleness}) lacks rank {other}'s pushes of clocks {missing}"
    return worst


schedules = st.lists(st.lists(st.sampled_from([0.0, 0.0, 0.03, 0.12]), min_size=STEPS, max_size=STEPS),
                     min_size=3, max_size=3)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(staleness=st.sampled_from([1, 2, 3]), sleeps=schedules)
def test_ssp_bound_holds_with_random_stragglers(cluster, staleness, sleeps):
    results = cluster.run(sw.ledger_run, staleness, STEPS, sleeps, timeout=120)
    worst = check_reads(results, staleness, cluster.world_size, STEPS)
    assert worst <= staleness
    for rank, result in enumerate(results):
        assert all(0 <= r <= staleness for r in result["reported"]), (rank, result["reported"])
    assert all(torch.tensor(r["final"]).eq(-1.0 / cluster.world_size).all() for r in results)


def test_ssp_lets_the_fast_rank_run_ahead_and_no_further(cluster):
    """A persistent straggler (the last rank): the others run ahead, by at most s clocks; without the
    bound's wait they would run ahead by more (the straggler sleeps far longer than a step takes)."""
    sleeps = [[0.0] * STEPS for _ in range(cluster.world_size)]
    sleeps[-1] = [0.15] * STEPS
    results = cluster.run(sw.ledger_run, 1, STEPS, sleeps, timeout=120)
    worst = check_reads(results, 1, cluster.world_size, STEPS)
    assert worst == 1, "the fast ranks never ran ahead: the mode is BSP in disguise"
    assert max(r for res in results[:-1] for r in res["reported"]) == 1


def test_async_applies_every_push_exactly_once(cluster):
    sleeps = [[0.0] * STEPS for _ in range(cluster.world_size)]
    sleeps[0] = [0.1 if c % 2 else 0.0 for c in range(STEPS)]
    results = cluster.run(sw.ledger_run, None, STEPS, sleeps, timeout=120)
    check_reads(results, None, cluster.world_size, STEPS)
    for result in results:  # after finish(): every pushed gradient summed in once, on every rank
        assert torch.tensor(result["final"]).eq(-1.0 / cluster.world_size).all(), result["final"]


def test_downpour_pushes_summed_gradients_and_fetches_every_few_passes(cluster):
    """push_every=3, fetch_every=2 over 8 clocks: pushes at clocks 2 and 5 (the sums of clocks 0-2 and
    3-5), the sum of 6-7 pushed by finish(); new values at clocks 1, 3, 5, 7. A forward reads exactly
    its own pushes sent by the last fetch before it, the same values as the forward before it unless
    a fetch came between, and after finish() every push is in once."""
    sleeps = [[0.0] * STEPS for _ in range(cluster.world_size)]
    sleeps[0] = [0.05 if c % 2 else 0.0 for c in range(STEPS)]
    results = cluster.run(sw.ledger_run, None, STEPS, sleeps, None, None, 3, 2, timeout=120)
    applied = -1.0 / cluster.world_size
    for rank, result in enumerate(results):
        reads = [torch.tensor(read).view(cluster.world_size, STEPS) for read in result["reads"]]
        for clock, ledger in enumerate(reads):
            assert bool(((ledger == 0) | (ledger == applied)).all()), (rank, clock, ledger)
            fetched = [f for f in (1, 3, 5) if f < clock]
            pushed_clocks = 3 * ((fetched[-1] + 1) // 3) if fetched else 0
            assert (ledger[rank] == applied).tolist() == [c < pushed_clocks for c in range(STEPS)], (rank, clock)
            if clock % 2:  # no fetch at clock - 1
                assert torch.equal(ledger, reads[clock - 1]), (rank, clock)
        assert torch.tensor(result["final"]).eq(applied).all(), (rank, result["final"])
    pushing = {c for result in results for c, sent in enumerate(result["sent"]) if sent > 0}
    assert pushing == {2, 5}, [result["sent"] for result in results]


@pytest.mark.slow
@pytest.mark.parametrize("downpour", [(1, 1), (8, 8)], ids=["every-step", "push-fetch-every-8"])
@pytest.mark.parametrize("early", ["first", "last"])
def test_finish_waits_for_a_rank_that_trains_on_without_pushing_to_it(cluster, downpour, early):
    """One rank finishes after a step while the others train on for 1.5 times the timeout: whether the
    finished rank owns no chunk (it hears none of their pushes) or they push and fetch only every 8
    steps, the others are alive, and finish() must wait for them, not call them dead."""
    finisher = 0 if early == "first" else cluster.world_size - 1
    own = [STEPS] * cluster.world_size
    own[finisher] = 1
    timeout = 2.5
    sleeps = [[0.0 if rank == finisher else 1.5 * timeout / STEPS] * STEPS for rank in range(cluster.world_size)]
    results = cluster.run(sw.ledger_run, None, STEPS, sleeps, own, None, *downpour, timeout, timeout=120)
    expected = torch.zeros(cluster.world_size, STEPS)
    for rank, n in enumerate(own):
        expected[rank, :n] = -1.0 / cluster.world_size
    for result in results:
        assert torch.equal(torch.tensor(result["final"]).view_as(expected), expected)
    assert not all(result["owns"] for result in results)  # one chunk: some rank owns none


@pytest.mark.parametrize("staleness", [1, None], ids=["ssp1", "async"])
def test_uneven_data_a_finished_rank_holds_nobody_back(cluster, staleness):
    """Rank 0 stops after 3 steps and waits in finish(); the others train on to 8."""
    own = [3] + [STEPS] * (cluster.world_size - 1)
    sleeps = [[0.0] * STEPS for _ in range(cluster.world_size)]
    results = cluster.run(sw.ledger_run, staleness, STEPS, sleeps, own, timeout=120)
    ledger = torch.tensor(results[0]["final"]).view(cluster.world_size, STEPS)
    expected = torch.zeros_like(ledger)
    for rank, n in enumerate(own):
        expected[rank, :n] = -1.0 / cluster.world_size
    for result in results:
        assert torch.equal(torch.tensor(result["final"]).view_as(ledger), expected)


@pytest.mark.parametrize("clock", [2, STEPS - 1], ids=["mid-run", "last-step-before-finish"])
def test_caught_exception_in_backward_skips_that_push_only(cluster, clock):
    """Rank 1's backward raises before any gradient (mid-run, or in the step right before ``finish()``):
    that clock pushes nothing (the slot stays 0), every clock still counts, and training goes on under
    the bound on every rank."""
    sleeps = [[0.0] * STEPS for _ in range(cluster.world_size)]
    results = cluster.run(sw.ledger_run, 1, STEPS, sleeps, None, (1, clock), timeout=120)
    check_reads(results, 1, cluster.world_size, STEPS, (1, clock))
    assert results[1]["caught"] == [clock]
    ledger = torch.tensor(results[0]["final"]).view(cluster.world_size, STEPS)
    expected = torch.full_like(ledger, -1.0 / cluster.world_size)
    expected[1, clock] = 0.0
    for result in results:
        assert torch.equal(torch.tensor(result["final"]).view_as(ledger), expected)


@pytest.mark.slow
@pytest.mark.parametrize("staleness, downpour", [(0, {}), (1, {}), (3, {}), (None, {}),
                                                 (None, {"push_every": 2, "fetch_every": 3})],
                         ids=["bsp", "ssp1", "ssp3", "async", "async-push2-fetch3"])
def test_least_squares_converges(cluster, staleness, downpour):
    results = cluster.run(partial(sw.least_squares, **downpour), staleness, 150, 0.02, timeout=200)
    for result in results:
        assert result["relative_error"] < 1e-2, result["relative_error"]
        assert torch.equal(result["weight"], results[0]["weight"])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "raise"])
@pytest.mark.parametrize("staleness, downpour", [(1, {}), (None, {}), (None, {"push_every": 5, "fetch_every": 5})],
                         ids=["ssp1", "async", "async-push5-fetch5"])
def test_dead_or_failed_peer_ends_with_a_clear_error(fresh_cluster, how, staleness, downpour):
    timeout = 2.5
    outcomes = fresh_cluster.run_outcomes(partial(sw.dies_or_raises, timeout=timeout, **downpour), staleness, how,
                                          timeout=90)
    survivor = outcomes[0]
    assert survivor.ok, survivor.value
    assert survivor.value["error"] is not None, "the survivor trained on alone to the end"
    assert survivor.value["elapsed"] < timeout * 3 + 10, survivor.value
    assert "rank 1" in survivor.value["error"] or "[1]" in survivor.value["error"], survivor.value["error"]
    if how == "raise":
        assert outcomes[1].value == {"raised": "the user's training loop failed"}


@pytest.mark.slow
def test_a_dead_peer_is_named_when_the_survivor_owns_every_chunk(fresh_cluster):
    """With the default chunks the survivor owns the model's one chunk, so no answer fails: its server
    thread loses the connection, or the wait for the dead rank's push times out (as the barrier's or the
    bound's wait); each names the rank."""
    outcomes = fresh_cluster.run_outcomes(partial(sw.dies_or_raises, chunk_bytes=None, pause_s=0.0, timeout=20), 3,
                                          "exit", timeout=90)
    assert outcomes[0].ok, outcomes[0].value
    error = outcomes[0].value["error"]
    assert error is not None and "rank(s) [1]" in error, error


@pytest.mark.parametrize("staleness", [1, None], ids=["ssp1", "async"])
def test_checkpoint_resume(cluster, staleness):
    results = cluster.run(sw.checkpoint_resume, staleness, timeout=120)
    assert all(r["params_equal"] for r in results)
    assert results[0]["state_equal"]
    for result in results:  # it trained on from there, and finish() left every rank with the same values
        assert not torch.equal(result["after"], result["saved"])
        assert torch.equal(result["after"], results[0]["after"])


def test_loading_parameters_mid_training_needs_finish(cluster):
    for message in cluster.run(sw.loaded_without_finish, timeout=60):
        assert "call opt.finish()" in message


@pytest.mark.parametrize("when", ["before-first-step", "after-synchronize", "after-finish"])
def test_an_in_place_write_is_refused_until_finish_then_kept(cluster, when):
    """The owners hold the values in this mode: a parameter written in place would be overwritten by
    them without a word, so the next training forward refuses, and ``finish()`` makes the owners take it."""
    for result in cluster.run(sw.edited_in_place, when, timeout=60):
        assert "'weight' was written in place" in result["message"]
        assert torch.equal(result["weight"], torch.full((1, 3), 7.0))


def test_a_write_on_one_rank_is_named_at_finish_and_the_ranks_end_equal(cluster):
    results = cluster.run(sw.written_on_one_rank, timeout=60)
    for result in results:
        assert "rank(s) [1] loaded or wrote parameters and the other ranks did not" in result["message"], result
        assert torch.equal(result["state"], results[0]["state"])


def test_staleness_zero_is_todays_bsp_bit_for_bit(cluster):
    """``staleness=0`` runs the lockstep engine, bit for bit as without the argument, and trains as torch
    DDP with AdamW does."""
    for result in cluster.run(sw.same_as_default):
        assert result["zero_lockstep"] and result["default_lockstep"]
        assert torch.equal(result["zero"], result["default"])
        torch.testing.assert_close(result["zero"], result["ddp"], rtol=1e-5, atol=1e-6)


def test_refusals(cluster):
    every_rank = cluster.run(sw.refusals)
    for messages in every_rank:  # a bound that differs between ranks: named, on every rank
        assert "differs between rank 0 and rank 1: staleness: 1 vs 2" in messages[8]
    messages = every_rank[0]
    assert "cannot be combined with delay" in messages[0]
    assert "max_grad_norm" in messages[1]
    assert "lazy_pull" in messages[2]
    assert "int >= 0" in messages[3] and "int >= 0" in messages[4]
    assert "Downpour's, for staleness=None" in messages[5]
    assert "fetch_every must be an int >= 1" in messages[6] and "push_every must be an int >= 1" in messages[7]


def test_the_tracer_records_each_iterations_clock_and_staleness(cluster, tmp_path):
    results = cluster.run(sw.traced_staleness, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        iterations = result["iterations"]
        assert [it["clock"] for it in iterations] == list(range(1, 6)), iterations
        assert [it["staleness"] for it in iterations] == result["reported"][1:6], (rank, iterations)
    assert max(it["staleness"] for it in results[0]["iterations"]) == 1  # the fast rank ran ahead


def test_ssp_fuses_buckets_small_enough_to_start_during_backward(cluster):
    """Ranks on their own clocks fuse once, with no timings: up to 1 MiB besides the largest layer (a
    4 MiB cap made this whole model one bucket, whose push could only start after backward), or the
    user's smaller ``fusion_bytes``."""
    layer = 256 * 512 * 4
    default, = {tuple(r["sizes"]) for r in cluster.run(sw.stale_buckets, None, timeout=60)}
    assert sum(default) == 6 * layer and len(default) >= 2 and max(default) <= layer + (1 << 20)
    alone, = {tuple(r["sizes"]) for r in cluster.run(sw.stale_buckets, 0, timeout=60)}
    assert alone == (layer,) * 6
