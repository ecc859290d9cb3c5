"""Lightning (the ``lightning`` package): ``Trainer(strategy=PoseidonStrategy(...))``, or
``strategy="poseidon"`` once this module is imported (Lightning finds strategies only in its own
registry, which has no entry-point mechanism: see docs/integrations.md). The strategy's
behaviour and invariants: ``_strategy.py``; ``pytorch_lightning.py`` is the same for the
``pytorch_lightning`` package name."""
from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from ._strategy import PoseidonStrategyMixin, server_optimizer

__all__ = ["PoseidonStrategy", "server_optimizer"]


class PoseidonStrategy(PoseidonStrategyMixin, DDPStrategy):
    """Lightning's DDP strategy on PoseidonDDP."""


PoseidonStrategy.register_strategies(StrategyRegistry)
