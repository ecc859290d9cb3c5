"""Loads a script of ``benchmarks/`` as a module, so a test can call its functions without running it.

The module is registered in ``sys.modules`` while it is loaded and used (a dataclass in the script looks its
module up there) and removed afterwards, so two tests never share a half-loaded script."""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextmanager
def benchmark_script(name: str) -> Iterator[ModuleType]:
    """``benchmarks/<name>.py``, loaded as the module ``name`` for the duration of the block."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
