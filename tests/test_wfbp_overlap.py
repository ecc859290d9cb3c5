"""Wait-free backprop: syncs start while backward is still computing the lower layers."""
from __future__ import annotations

import json

import workers


def test_last_layer_sync_starts_before_first_layer_backward_ends(cluster, tmp_path):
    results = cluster.run(workers.sync_timing, str(tmp_path))
    for rank, r in enumerate(results):
        last_layer = r["syncers"][0]
        assert last_layer.startswith("6"), f"syncer order should start at the output layer: {r['syncers']}"
        network = [s for s in r["spans"] if s.kind == "network" and s.name == last_layer]
        assert len(network) == 1
        lead_ms = (r["first_ready_ns"] - network[0].start_ns) / 1e6
        assert lead_ms > 0, f"rank {rank}: last layer's sync started {-lead_ms:.2f} ms after backward ended"
    merged = json.loads((tmp_path / "trace_merged.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == set(range(cluster.world_size))
