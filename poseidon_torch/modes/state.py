"""What the modes' checkpoints share: every consistency state is a dict with the ``delay`` it was saved
with, and the pipelined modes' entries are ``{parameter name: tensor}``, checked whole before anything
is loaded (a bad state changes nothing)."""
from __future__ import annotations

from torch import Tensor, nn

#: what each pipelined mode's state holds its entries under, and the mode's name
ENTRIES = {"in_flight": "PoseidonDDP(delay=k) (averaged gradients)", "held": "ServerOptimizer(delay=k) (values)",
           "periodic": "PoseidonDDP(sync_every=H) (the round's state)"}


def check_no_entries(state: dict, mode: str) -> None:
    """A mode that keeps nothing refuses a state that holds another mode's entries (it would drop them)."""
    saved = [ENTRIES[key] for key in ENTRIES if key in state]
    if saved:
        raise ValueError(f"the consistency state was saved by {saved[0]}; this model runs {mode!r}, which would drop "
                         "it: resume with the options it was saved with")


def check_delay(state: object, delay: int) -> None:
    """``state`` is a consistency state saved with ``delay``."""
    if not isinstance(state, dict) or "delay" not in state:
        raise ValueError(f"not a PoseidonDDP consistency state (a dict from consistency_state_dict()): {state!r:.80}")
    saved = state["delay"]
    if not isinstance(saved, int) or isinstance(saved, bool) or saved != delay:
        raise ValueError(f"the state was saved with delay={saved!r}, this PoseidonDDP has delay={delay}")


def checked_entries(state: object, delay: int, key: str, params: dict[str, nn.Parameter]) -> list:
    """The entries of a saved state, each ``{name: tensor}`` converted to its parameter's device and dtype,
    after checking all of it (nothing is changed when a check fails)."""
    check_delay(state, delay)
    if key not in state:
        other = next((k for k in ENTRIES if k in state), None)
        saved_by = f"saved by {ENTRIES[other]}" if other else "without entries"
        raise ValueError(f"the consistency state was {saved_by}; this model runs {ENTRIES[key]}")
    entries = state[key]
    if not isinstance(entries, list):
        raise ValueError(f"consistency state {key!r} must be a list, got {type(entries).__name__}")
    checked = []
    for entry in entries:
        if key == "held" and not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], int)):
            raise ValueError(f"consistency state 'held' entries are (steps from now, {{name: tensor}}), got {entry!r:.80}")
        values = entry[1] if key == "held" else entry
        if not isinstance(values, dict):
            raise ValueError(f"consistency state {key!r} holds a {type(values).__name__}, not {{name: tensor}}")
        converted = {}
        for name, value in values.items():
            if name not in params:
                raise ValueError(f"Pipe-SGD state names a parameter this model does not sync: {name!r}")
            if not isinstance(value, Tensor) or value.shape != params[name].shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"Pipe-SGD state for {name!r} is {shape}, the parameter is {tuple(params[name].shape)}")
            converted[name] = value.detach().to(params[name].device, params[name].dtype).clone()
        checked.append((entry[0], converted) if key == "held" else converted)
    return checked
