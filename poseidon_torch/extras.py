"""Optional dependencies: what the core install leaves out, and the error that names the extra to install.

``pip install poseidon-torch`` needs torch and numpy only. Plotting (``poseidon-trace plot``, the
simulator's ``--plot``) needs matplotlib, the ``[plot]`` extra; the benchmark harness
(``poseidon_torch.bench``) needs matplotlib and scikit-learn, the ``[bench]`` extra; the framework glue
needs ``[lightning]`` or ``[hf]``. Invariant: no module of the core (the wrapper, the engine, the
optimizer, the tracer's recording and summary, the simulator's prediction) imports an optional package;
the modules that do import it through :func:`require`, at their first use.
"""
from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib"``) for ``needed_by`` (what the user asked for), or raise
    :class:`MissingExtra` saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        raise MissingExtra(f"{needed_by} needs {package}, which is not installed: "
                           f"pip install 'poseidon-torch[{extra}]'") from exc
