"""The one reader of ``POSEIDON_*`` environment variables (Horovod-style knobs without a code change).

Invariant: an option passed in code always wins over the environment; the environment wins over the
default; a value that does not parse raises ``ValueError`` naming the variable.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PREFIX = "POSEIDON_"


def option(value: T | None, name: str, parse: Callable[[str], T], default: T) -> T:
    """``value`` if given, else ``POSEIDON_<name>`` parsed with ``parse``, else ``default``."""
    if value is not None:
        return value
    found = from_env(name, parse)
    return default if found is None else found


def flag(text: str) -> bool:
    """A yes/no knob: 1/0, true/false, yes/no, on/off (any case)."""
    value = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
             "off": False}.get(text.lower())
    if value is None:
        raise ValueError("expected 1/0, true/false, yes/no or on/off")
    return value


def from_env(name: str, parse: Callable[[str], T]) -> T | None:
    """``POSEIDON_<name>`` parsed with ``parse``, or None when unset or empty."""
    text = os.environ.get(PREFIX + name, "").strip()
    if not text:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{PREFIX}{name}={text!r} is not valid: {exc}") from None
