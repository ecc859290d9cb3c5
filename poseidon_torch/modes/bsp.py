"""Bulk synchronous parallel gradient averaging: the default mode (``PoseidonDDP(model)``).

A synced ``backward()`` returns when every sync is done, and ``.grad`` then holds the average over the
ranks of this step's gradients, as torch DDP's; the user's optimizer steps as it would under DDP. It is
the protocol's defaults (:class:`~.base.Mode`): every point does nothing more than the engine does.
"""
from __future__ import annotations

from .base import Mode


class BSP(Mode):
    """BSP averaging: each synced backward averages its own gradients, every rank waits for every sync."""

    name = "bsp"
