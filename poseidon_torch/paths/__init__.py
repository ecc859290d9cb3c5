"""The ways a bucket's gradient moves between the ranks: one module per path, registered here.

A path implements :class:`~.base.Path`; a new one is its module and one line in :data:`REGISTERED`.
The first registered path is the *default*: every bucket starts on it, a path that cannot sync a bucket
exactly falls back to it, a gradient that arrives after its bucket's job is averaged again through it,
the native core runs its jobs, and the parameter server's shards are its chunks. The engine, the
coordinator, the stats, the tracer and the simulator know paths only through this registry (by name:
``overrides={"fc": "SFB"}`` resolves here). Lossy paths (``exact = False``: ``lossy.py``) are used only
where ``PoseidonDDP(compression=...)`` names them by their ``option`` (checked here:
:func:`compression_option`) or an override forces them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ..bucket import Bucket
from .allreduce import AllReducePath
from .base import (AtOwners, BucketCost, FCCost, GradWriter, Job, OnEveryRank, Path, PathEnv, Prediction,
                   SyncContext, WrappedPath, drive)
from .int8 import Int8Path
from .lossy import LossyPath
from .powersgd import PowerSGDPath
from .precision import BF16Path, FP16Path
from .ps import DEFAULT_CHUNK_BYTES, PSPath
from .sfb import SFBPath

#: every path, the default first
REGISTERED: tuple[type[Path], ...] = (
    PSPath,
    SFBPath,
    AllReducePath,
    PowerSGDPath,
    BF16Path,
    FP16Path,
    Int8Path,
)


def names() -> tuple[str, ...]:
    """The registered paths' names, the default first."""
    return tuple(path.name for path in REGISTERED)


def default_name() -> str:
    return REGISTERED[0].name


def path_class(name: str) -> type[Path]:
    """The registered path called ``name`` (``ValueError`` naming the registered ones otherwise)."""
    for path in REGISTERED:
        if path.name == name:
            return path
    raise ValueError(f"no path is called {name!r}; the registered paths are {names()}")


def compression_options() -> dict[str, type[LossyPath]]:
    """The lossy paths by the name ``compression=`` gives them."""
    return {path.option: path for path in REGISTERED if issubclass(path, LossyPath)}


def compression_option(value: object) -> dict[str, dict[str, Any]]:
    """``PoseidonDDP(compression=...)`` checked: None (no lossy path), an option's name (``"powersgd"``), a
    list of names, or a dict ``{name: settings}`` (``{"powersgd": {"rank": 8}}``; None or ``{}``: the
    defaults). Per lossy path's registered name, its settings with the defaults filled in."""
    if value is None:
        return {}
    known = compression_options()
    if isinstance(value, str):
        value = {value: None}
    elif isinstance(value, (list, tuple)):
        value = dict.fromkeys(value)
    if not isinstance(value, Mapping) or not value:
        raise TypeError(f"PoseidonDDP option compression must be None, one of {sorted(known)}, a list of them, or a "
                        f"dict {{name: settings}} such as {{'powersgd': {{'rank': 4}}}}, got {value!r}")
    checked = {}
    for option, settings in value.items():
        path = known.get(option.lower() if isinstance(option, str) else option)
        if path is None:
            raise ValueError(f"PoseidonDDP option compression names {option!r}, which is no compression; the "
                             f"compressions are {sorted(known)}")
        checked[path.name] = path.checked_settings(settings)
    return checked


class Paths(dict[str, Path]):
    """One engine's paths, by name, in registration order (a test may replace one by name)."""

    @classmethod
    def build(cls, env: PathEnv) -> Paths:
        """Every registered path for ``env``; the others are built with the default one in ``env``."""
        default = REGISTERED[0](env)
        with_default = replace(env, default=default)
        return cls({default.name: default, **{path.name: path(with_default) for path in REGISTERED[1:]}})

    @classmethod
    def for_costing(cls) -> Paths:
        """Paths built only to predict costs (the coordinator's and the simulator's): no rank of their own."""
        return cls.build(PathEnv(0, 1, DEFAULT_CHUNK_BYTES, torch.device("cpu")))

    @property
    def default(self) -> Path:
        return self[REGISTERED[0].name]

    # ---- what the other paths owe a bucket (a layer that left a lossy path: ``Path.owes``) ----------

    def owed(self, bucket: Bucket, path: str) -> bool:
        """Whether a path other than ``path`` (the bucket's this pass) owes ``bucket`` something."""
        return any(other.owes(bucket) for name, other in self.items() if name != path)

    def carry_into(self, bucket: Bucket, path: str) -> None:
        """``bucket`` was staged for ``path``: every other path adds what it owes the bucket to the flat
        buffer, unless ``path`` syncs factors instead of that buffer (what is owed then waits)."""
        if not self[path].factors:
            for name, other in self.items():
                if name != path:
                    other.carry_into(bucket)

    def carried(self, bucket: Bucket, path: str, landed: bool) -> None:
        """The pass of ``bucket`` on ``path`` ended (``landed``: :meth:`Path.carried`)."""
        for name, other in self.items():
            if name != path:
                other.carried(bucket, landed)


__all__ = ["REGISTERED", "Paths", "Path", "LossyPath", "Job", "WrappedPath", "PathEnv", "SyncContext", "Prediction",
           "BucketCost", "FCCost", "GradWriter", "AtOwners", "OnEveryRank", "drive", "names", "default_name", "path_class",
           "compression_option", "compression_options"]
