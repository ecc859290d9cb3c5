"""``benchmarks/staleness_cost.py`` simulates what it says: its rules coincide where they must and differ
where they must (run on the digits task, a few seconds)."""
from __future__ import annotations

import pytest

from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def script():
    with benchmark_script("staleness_cost") as module:
        yield module


@pytest.fixture(scope="module")
def digits():
    from poseidon_torch.bench.accuracy.tasks import TASKS
    return TASKS["digits"](True)


def curve(script, task, text: str, ranks: int) -> list[tuple[int, float]]:
    return script.train(task, script.Run.parse(text), ranks, steps=6, every=3)


def test_one_rank_makes_the_push_rule_bsp(script, digits) -> None:
    """P = 1: one push per clock at lr / 1 on the gradient / 1 is BSP's step, bit for bit."""
    assert curve(script, digits, "push", 1) == curve(script, digits, "bsp", 1)


def test_staleness_warmup_and_the_push_rule_each_change_the_trajectory(script, digits) -> None:
    bsp = curve(script, digits, "bsp", 2)
    assert curve(script, digits, "bsp:warmup=1", 2) == bsp  # a one-clock warm-up is no warm-up
    for other in ("bsp:delay=1", "bsp:warmup=4", "push", "push:delay=1,lr_scale=0.5,beta1=0"):
        assert curve(script, digits, other, 2) != bsp, other


def test_a_malformed_run_is_refused(script) -> None:
    with pytest.raises(Exception, match="a run is bsp or push"):
        script.Run.parse("ssp:delay=1")
