"""The ways a bucket's gradient moves between the ranks: one module per path, registered here.

A path implements :class:`~.base.Path`; a new one is its module and one line in :data:`REGISTERED`.
The first registered path is the *default*: every bucket starts on it, a path that cannot sync a bucket
exactly falls back to it, a gradient that arrives after its bucket's job is averaged again through it,
the native core runs its jobs, and the parameter server's shards are its chunks. The engine, the
coordinator, the stats, the tracer and the simulator know paths only through this registry (by name:
``overrides={"fc": "SFB"}`` resolves here).
"""
from __future__ import annotations

import torch

from .allreduce import AllReducePath
from .base import (AtOwners, BucketCost, FCCost, GradWriter, Job, OnEveryRank, Path, PathEnv, Prediction,
                   SyncContext, WrappedPath, drive)
from .ps import DEFAULT_CHUNK_BYTES, PSPath
from .sfb import SFBPath

#: every path, the default first
REGISTERED: tuple[type[Path], ...] = (
    PSPath,
    SFBPath,
    AllReducePath,
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


class Paths(dict[str, Path]):
    """One engine's paths, by name, in registration order (a test may replace one by name)."""

    @classmethod
    def build(cls, env: PathEnv) -> Paths:
        """Every registered path for ``env``; the others are built with the default one in ``env``."""
        default = REGISTERED[0](env)
        with_default = PathEnv(env.rank, env.world_size, env.chunk_bytes, env.wire_device, default)
        return cls({default.name: default, **{path.name: path(with_default) for path in REGISTERED[1:]}})

    @classmethod
    def for_costing(cls) -> Paths:
        """Paths built only to predict costs (the coordinator's and the simulator's): no rank of their own."""
        return cls.build(PathEnv(0, 1, DEFAULT_CHUNK_BYTES, torch.device("cpu")))

    @property
    def default(self) -> Path:
        return self[REGISTERED[0].name]


__all__ = ["REGISTERED", "Paths", "Path", "Job", "WrappedPath", "PathEnv", "SyncContext", "Prediction", "BucketCost", "FCCost",
           "GradWriter", "AtOwners", "OnEveryRank", "drive", "names", "default_name", "path_class"]
