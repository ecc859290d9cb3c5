"""Bytes on the PS path: what each rank hands to isend equals the formula of kvstore.py."""
from __future__ import annotations

import pytest

import workers


@pytest.mark.parametrize("chunk_bytes", [64, 1024, 2 * 1024 * 1024])
def test_bytes_sent_match_the_sharded_store_formula(cluster, chunk_bytes):
    results = cluster.run(workers.bytes_per_iteration, chunk_bytes)
    P = cluster.world_size
    model_bytes = 4 * sum(results[0]["numels"])  # gradients + one used flag per parameter
    for r in results:
        assert r["sent"] == r["formula"]
    # each chunk of b bytes costs b from each non-owner and (P-1) b from its owner: 2 (P-1) b in all
    assert sum(r["sent"] for r in results) == 2 * (P - 1) * model_bytes
    # owners are balanced: no rank sends more than one chunk's worth above the mean
    mean = 2 * (P - 1) / P * model_bytes
    assert max(r["sent"] for r in results) <= mean + (P - 1) * chunk_bytes
