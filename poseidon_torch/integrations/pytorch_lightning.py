"""Lightning under its ``pytorch_lightning`` package name: ``pytorch_lightning.Trainer(strategy=
PoseidonStrategy(...))``, or ``strategy="poseidon"`` once this module is imported. The same strategy as
``lightning.py`` (``_strategy.py``), derived from ``pytorch_lightning``'s own ``DDPStrategy``, since
each package's Trainer accepts only its own strategies."""
from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from ._strategy import PoseidonStrategyMixin, server_optimizer

__all__ = ["PoseidonStrategy", "server_optimizer"]


class PoseidonStrategy(PoseidonStrategyMixin, DDPStrategy):
    """``pytorch_lightning``'s DDP strategy on PoseidonDDP."""


PoseidonStrategy.register_strategies(StrategyRegistry)
