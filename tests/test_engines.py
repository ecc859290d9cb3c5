"""The native core against the Python reference core: bit-identical parameters on the same inputs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workers
from models import ModelSpec, fc_specs, model_specs
from poseidon_torch.core import native_status

pytestmark = pytest.mark.skipif(bool(native_status()), reason=native_status() or "built")


def assert_identical(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        for name, value in r["python"].items():
            assert torch.equal(r["native"][name], value), f"rank {rank}: {name} differs between the cores"


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=model_specs(), size=st.integers(1, 4), accumulate=st.sampled_from([1, 2]),
       chunk_elems=st.sampled_from([3, 64, 1 << 19]))
def test_cores_agree_bit_for_bit_on_the_ps_path(cluster, spec, size, accumulate, chunk_elems):
    options = {"hybrid": False, "chunk_bytes": 4 * chunk_elems, "fusion_bytes": 512}
    assert_identical(cluster.run(workers.train_engines, spec, 3, size, accumulate, options))


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=fc_specs(), size=st.integers(1, 4), force=st.sampled_from(["SFB", "PS"]))
def test_cores_agree_bit_for_bit_with_sfb_layers(cluster, spec, size, force):
    assert_identical(cluster.run(workers.train_engines, spec, 3, size, 1, {"force": force}))


@pytest.mark.parametrize("case", ["unused_branch", "branch_used_on_rank0_only", "shared_weights"])
def test_cores_agree_on_special_models(cluster, case):
    spec = {"unused_branch": ModelSpec(widths=(8,), unused_branch=True),
            "branch_used_on_rank0_only": ModelSpec(widths=(8,), rank0_branch=True),
            "shared_weights": ModelSpec(widths=(8,), tied=True)}[case]
    assert_identical(cluster.run(workers.train_engines, spec, 3, 3, 2, {}))


def test_native_core_is_the_default_where_built(cluster):
    assert cluster.run(workers.core_kind) == ["native"] * cluster.world_size
    assert cluster.run(workers.core_kind, env={"POSEIDON_ENGINE": "python"}) == ["python"] * cluster.world_size
