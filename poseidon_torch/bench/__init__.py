"""Benchmarks of PoseidonDDP against torch DDP on localhost or on an emulated bandwidth-limited cluster.

Entry point: ``python -m poseidon_torch.bench --help`` (see :mod:`poseidon_torch.bench.__main__`).

Layout:
- :mod:`~poseidon_torch.bench.workloads`: the synthetic training workloads (fixed seeds).
- :mod:`~poseidon_torch.bench.worker`: one rank of one benchmark run; writes a JSON result file.
- :mod:`~poseidon_torch.bench.baselines`: what a slow network's user picks today (torch's PowerSGD hook,
  post-local SGD) and one host alone, built from torch's own implementations.
- :mod:`~poseidon_torch.bench.netns`: the emulated cluster (network namespaces, a bridge, tc shaping).
- :mod:`~poseidon_torch.bench.launch`: where ranks run (localhost or the emulated cluster) and launching them.
- :mod:`~poseidon_torch.bench.__main__`: the throughput runner that launches every mode and reports.
- :mod:`~poseidon_torch.bench.accuracy`: time to accuracy on real data, with stragglers
  (``python -m poseidon_torch.bench.accuracy``).

Invariants: no bench module imports PoseidonDDP at module level; only the worker's poseidon modes do,
lazily, so a missing or broken engine fails those modes alone (with the import error in the report). The
parent package's ``poseidon_torch/__init__.py`` still runs on any import of this package. No module
creates a process group on import.
"""
