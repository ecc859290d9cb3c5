"""The SFB path and the coordinator inside the engine: exact gradients, chosen where cheaper."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import training
import workers
from models import ModelSpec, fc_specs
from training import Run
from test_parity import RTOL, ATOL, STEPS, assert_parity

SLOW_LINK = workers.slow_link()


def assert_path_ran(results: list[dict], layers, path: str) -> None:
    """On every rank, every step after the first synced ``layers`` through ``path`` (the first step
    always runs on PS: it is when the coordinator learns K and the layers' facts)."""
    for rank, result in enumerate(results):
        for step, outcomes in enumerate(result["poseidon"]["paths"]):
            expected = "PS" if step == 0 else path
            assert all(outcomes[n] == expected for n in layers), (rank, step, outcomes)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=fc_specs(), size=st.integers(1, 4), force=st.sampled_from(["SFB", "PS"]))
def test_forced_paths_match_single_process_and_ddp(cluster, spec, size, force):
    results = cluster.run(training.train_pair, spec, Run(options={"force": force}), STEPS, size)
    assert_parity(results, spec, size, cluster.world_size)
    assert_path_ran(results, training.fc_overrides(training.build(spec, 0), force), force)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(64, 160), size=st.integers(1, 3), seed=st.integers(0, 1000))
def test_cost_model_picks_sfb_for_wide_layers_and_stays_exact(cluster, width, size, seed):
    spec = ModelSpec(in_features=width, widths=(width,), out_features=4, seed=seed)
    results = cluster.run(training.train_pair, spec, Run(options={"link": SLOW_LINK, "fusion_bytes": 0}), STEPS, size)
    assert_path_ran(results, ["body.0"], "SFB")
    assert all(r["poseidon"]["sent"][-1]["SFB"] > 0 for r in results)
    assert_parity(results, spec, size, cluster.world_size)


def test_a_weight_shared_by_two_modules_stays_on_ps_and_exact(cluster):
    """One weight in two Linear modules (``twin.weight = square.weight``, as a head tied to a layer of the
    trunk): neither module's factors see the other's share of the gradient, so neither may take SFB
    whatever the link says, while the other FC layers still do (a break-test found a ``KeyError`` in
    backward when the cost model picked SFB for the module that owns only the bias)."""
    spec = ModelSpec(in_features=64, widths=(64,), out_features=4, shared_across=True)
    results = cluster.run(training.train_pair, spec, Run(options={"link": SLOW_LINK, "fusion_bytes": 0}), STEPS, 2)
    assert_parity(results, spec, 2, cluster.world_size)
    assert_path_ran(results, ["body.0"], "SFB")
    assert_path_ran(results, ["square", "twin"], "PS")


@pytest.mark.parametrize("zero_grad", ["after", "never"])
def test_sfb_keeps_gradients_that_were_already_there(cluster, zero_grad):
    spec = ModelSpec(in_features=10, widths=(12,), out_features=3)
    results = cluster.run(training.train_pair, spec, Run(options={"force": "SFB"}, zero_grad=zero_grad), STEPS, 2)
    reference = training.bsp(spec, STEPS, 2, cluster.world_size, zero_grad=zero_grad)["params"]
    assert_path_ran(results, ["body.0", "head"], "SFB")
    for rank, result in enumerate(results):
        for name, value in reference.items():
            torch.testing.assert_close(result["poseidon"]["state"][name], value, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(result["poseidon"]["state"][name], result["ddp"]["state"][name],
                                       rtol=RTOL, atol=ATOL)
            assert torch.equal(result["poseidon"]["state"][name], results[0]["poseidon"]["state"][name])


def test_no_sync_accumulation_with_sfb_layers(cluster):
    spec = ModelSpec(in_features=10, widths=(12,), out_features=3)
    results = cluster.run(training.train_pair, spec, Run(options={"force": "SFB"}, accumulate=2), STEPS, 2)
    assert_parity(results, spec, 2, cluster.world_size, accumulate=2)
    # accumulated gradients are more than the factors: the first synced pass (on PS, as every first
    # pass) already sees them, so the layer never goes to SFB (test_patterns covers the fallback when
    # accumulation starts later)
    for result in results:
        assert [p["body.0"] for p in result["poseidon"]["paths"]] == ["PS", "PS", "PS"]


@pytest.mark.parametrize("case", ["shared_weights", "seq_inputs", "custom_head", "unused_branch"])
def test_sfb_special_models(cluster, case):
    spec = {"shared_weights": ModelSpec(widths=(8,), tied=True),
            "seq_inputs": ModelSpec(widths=(9, 7), seq=4),
            "custom_head": ModelSpec(widths=(8,), custom_head=True),
            "unused_branch": ModelSpec(widths=(8,), unused_branch=True)}[case]
    results = cluster.run(training.train_pair, spec, Run(options={"force": "SFB"}), STEPS, 3)
    assert_parity(results, spec, 3, cluster.world_size)
    assert_path_ran(results, ["body.0", "head"], "SFB")
    initial = training.build(spec, seed=spec.seed).state_dict()
    if spec.unused_branch:  # no rank used it: no gradient, so weight decay left it alone
        assert torch.equal(results[0]["poseidon"]["state"]["unused.weight"], initial["unused.weight"])


def test_plan_is_printable_and_overrides_are_checked(cluster):
    for text, error in cluster.run(workers.plan_printout, SLOW_LINK):
        print(text)
        for needle in ("features.0", "Conv2d", "body.0", "head", "SFB", "PS", "Linear", "P="):
            assert needle in text
        assert "cannot force SFB on layer 'features.0': it is not an FC layer" in error


def test_coordinator_replans_when_k_changes(cluster):
    """The plan for the next step, after each step: 64 samples per rank make the 64x64 layer cheaper
    through PS; a last batch of 2 makes it cheaper through SFB."""
    plans = cluster.run(workers.replan_on_new_k, SLOW_LINK, (64, 64, 2))[0]
    assert plans[0]["body.0"] == (64, "PS") and plans[1] == plans[0]
    assert plans[2]["body.0"] == (2, "SFB")


def test_committed_sfb_layers_skip_the_local_weight_gradient(cluster):
    """Once the plan puts a layer on SFB, its forward leaves the weight out of the autograd graph
    (autograd computes no local dW; the rebuild does); a step whose K grew still finishes on SFB
    (padding grows), and the next step goes back to PS with the weight in the graph."""
    for steps in cluster.run(workers.commit_and_switch, SLOW_LINK, (2, 64, 64)):
        assert [s["outcome"] for s in steps] == ["PS", "SFB", "PS"]
        assert [s["weight_in_graph"] for s in steps] == [True, False, True]
        assert all(s["max_grad_diff"] < 1e-6 for s in steps), steps


def test_a_recorded_plan_makes_runs_identical_whatever_the_probe_says(cluster, tmp_path):
    """Issue 44 item 5: the probe decides the paths (a slow link puts the FC layers on SFB, a fast one on
    PS, and the parameters differ in rounding); a run given an earlier run's plan, as the Plan or as
    the file Plan.save() wrote, takes the recorded path on every layer whatever the probe says, so two
    such runs are bitwise identical."""
    results = cluster.run(workers.runs_given_a_recorded_plan, str(tmp_path / "plan.json"), timeout=120)
    for result in results:
        recorded, fast = result["recorded"], result["fast"]
        assert recorded["paths"]["body.0"] == "SFB" and fast["paths"]["body.0"] == "PS"
        assert any(not torch.equal(recorded["params"][n], fast["params"][n]) for n in fast["params"])
        for run in ("fast, plan", "slow, plan file"):
            assert result[run]["paths"] == recorded["paths"], run
        for name, value in result["fast, plan"]["params"].items():
            assert torch.equal(value, result["slow, plan file"]["params"][name]), name
    for name, value in results[0]["fast, plan"]["params"].items():
        assert all(torch.equal(value, r["fast, plan"]["params"][name]) for r in results), name
