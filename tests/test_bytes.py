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


def sfb_block(k: int, m: int, n: int) -> int:
    return -(-(3 * 8 + k * (m + n) * 4) // 8) * 8  # a header of rows, exact, aborted; K rows of [U | V]


def test_sfb_bytes_when_k_grows_count_both_exchanges(cluster):
    """Rows grow by 3 in the second step: the all-gather padded to last step's K is not enough, the
    factors go again with room for all: both exchanges were sent and both are counted."""
    P = cluster.world_size
    sizes = tuple(range(2, 2 + P))
    old, new = max(sizes), max(sizes) + 3
    for r in cluster.run(workers.sfb_bytes, sizes, 3):
        assert r["outcomes"] == {"body.0": "SFB", "head": "SFB"}, r["outcomes"]
        assert r["by_path"]["SFB"] == (P - 1) * sum(sfb_block(k, m, n) for k in (old, new) for m, n in ((30, 20), (5, 30)))


def test_server_mode_sfb_bytes_include_the_pull_of_new_values(cluster):
    """With a ServerOptimizer the owners update an SFB layer and every other rank pulls its new values:
    over all ranks, (P - 1) times each layer's buffer on top of the factor all-gathers."""
    P = cluster.world_size
    sizes = tuple(range(2, 2 + P))
    results = cluster.run(workers.sfb_bytes, sizes, 0, True)
    gathers = (P - 1) * (sfb_block(max(sizes), 30, 20) + sfb_block(max(sizes), 5, 30))
    assert all(r["outcomes"] == {"body.0": "SFB", "head": "SFB"} for r in results)
    assert sum(r["by_path"]["SFB"] - gathers for r in results) == (P - 1) * results[0]["flat_bytes"]


@pytest.mark.parametrize("force", ["PS", "SFB"])
def test_loopback_carries_what_the_engine_counts(cluster, force):
    """The loopback device's transmitted bytes during one step, against the sum of every rank's count:
    TCP/IP and gloo framing may add a little, nothing may be missing."""
    results = cluster.run(workers.loopback_bytes, force)
    counted = sum(r["counted"] for r in results)
    wire = results[0]["loopback"]
    assert counted > 0
    assert counted <= wire <= 1.1 * counted + 64 * 1024, (counted, wire)
