"""Bytes on the wire: the engine's counts against first principles, and against the loopback device."""
from __future__ import annotations

import pytest

import workers


@pytest.mark.parametrize("chunk_bytes", [64, 1024, 2 * 1024 * 1024])
def test_ps_bytes_are_conserved_and_balanced(cluster, chunk_bytes):
    results = cluster.run(workers.bytes_per_iteration, chunk_bytes)
    P = cluster.world_size
    flat_bytes = 4 * sum(results[0]["flat_elems"])  # gradients, a used flag per parameter, an aborted flag
    # each chunk of b bytes costs b from every non-owner and (P-1) b from its owner: 2 (P-1) b in all
    assert sum(r["ps"] for r in results) == 2 * (P - 1) * flat_bytes
    # the shards share the work: nobody sends more than 10% above the mean (a broken dealer that gave
    # every chunk to one rank would make it send (P-1) times the buffer)
    mean = 2 * (P - 1) / P * flat_bytes
    assert max(r["ps"] for r in results) <= 1.1 * mean
    # the end-of-pass facts: one int64 vector per rank, all-gathered (aborted; late and still syncing
    # per bucket; no FC layer here)
    assert all(r["facts"] == (P - 1) * 8 * (1 + 2 * r["buckets"]) for r in results)


def test_sfb_bytes_follow_from_the_factor_shapes(cluster):
    """SFB on a 20-30-5 MLP, rank r trains on 2 + r rows: every rank's block is padded to the largest K."""
    P = cluster.world_size
    sizes = tuple(range(2, 2 + P))
    results = cluster.run(workers.sfb_bytes, sizes)
    k = max(sizes)
    header = 3 * 8  # rows, exact, aborted

    def block(m: int, n: int) -> int:
        return -(-(header + k * (m + n) * 4) // 8) * 8

    for r in results:
        assert r["outcomes"] == {"body.0": "SFB", "head": "SFB"}, r["outcomes"]
        assert r["by_path"]["SFB"] == (P - 1) * (block(30, 20) + block(5, 30))
        assert r["by_path"]["PS"] == 0
    for name, grad in results[0]["grads"].items():
        for other in results[1:]:
            assert (other["grads"][name] == grad).all(), f"ranks disagree on {name}"


@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_loopback_carries_what_the_engine_counts(cluster, force):
    """The loopback device's transmitted bytes during one step, against the sum of every rank's count:
    TCP/IP and gloo framing may add a little, nothing may be missing."""
    results = cluster.run(workers.loopback_bytes, force)
    counted = sum(r["counted"] for r in results)
    wire = results[0]["loopback"]
    assert counted > 0
    assert counted <= wire <= 1.1 * counted + 64 * 1024, (counted, wire)
