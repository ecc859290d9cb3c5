"""Time to accuracy on real data, with stragglers: the benchmark that judges training modes by the validation
loss they reach against wall-clock time, not by seconds per iteration.

Entry point: ``python -m poseidon_torch.bench.accuracy --help`` (see :mod:`poseidon_torch.bench.accuracy.__main__`).

Layout:
- :mod:`~poseidon_torch.bench.accuracy.tasks`: the data (stdlib sources, scikit-learn's digits), models, metrics.
- :mod:`~poseidon_torch.bench.accuracy.stragglers`: the emulated stragglers (persistent, transient, slow link).
- :mod:`~poseidon_torch.bench.accuracy.worker`: one rank of one mode: train, snapshot, evaluate after.
- :mod:`~poseidon_torch.bench.accuracy.report`: time to target, metric at a budget, BSP parity, table, figure.
"""
