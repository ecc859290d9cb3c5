"""Where users already train: thin glue for Lightning (``lightning``, ``pytorch_lightning``), accelerate
(``accelerate``) and the Hugging Face ``Trainer`` (``hf``). Each module imports its framework, an
optional dependency, only when it is itself imported; the machinery stays in PoseidonDDP and
ServerOptimizer. What they share: ``resume`` (the Pipe-SGD state a checkpoint must carry) and
:func:`swapped`, for the frameworks that construct torch DDP (or their accelerator) by name in a
function we cannot otherwise reach."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def swapped(namespace: Any, name: str, value: Any) -> Iterator[None]:
    """``namespace.name`` is ``value`` inside the block, its old value again after it (also on error).
    Process-wide while it lasts: use it only around a framework's own call that looks ``name`` up."""
    saved = getattr(namespace, name)
    setattr(namespace, name, value)
    try:
        yield
    finally:
        setattr(namespace, name, saved)
