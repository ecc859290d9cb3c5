"""What a framework's checkpoint must carry, besides the model and the optimizer, for a resumed run to
continue the same trajectory: PoseidonDDP's consistency state (Pipe-SGD's averaged gradients in flight
with ``delay=k``, a ``ServerOptimizer(delay=k)``'s values not read yet, or with ``sync_every=H`` the
steps taken, DiLoCo's outer optimizer state and, with a ``delay``, the sync in flight).

Invariants: the state is the same on every rank (the averages and the pulled values are bit-identical
on every rank, and so are a periodic mode's step count, round start and outer state; the lossy paths'
residuals, which differ, are gathered into every rank's copy, each rank loading its own), so the copy
the main process writes serves every rank; a run that keeps nothing (BSP, SSP) saves nothing, so its
checkpoints load into any mode, as before.
"""
from __future__ import annotations

import warnings

from ..ddp import PoseidonDDP

#: where the Lightning checkpoint dict holds it
CHECKPOINT_KEY = "poseidon_consistency"
#: the file next to the HF Trainer's ``optimizer.pt``
FILE_NAME = "poseidon_consistency.pt"


def in_flight_state(wrapper: PoseidonDDP) -> dict | None:
    """The consistency state when it holds anything (``delay >= 1``, ``sync_every``), else None. Collective:
    call it on every rank (it waits for the last step's sync)."""
    state = wrapper.consistency_state_dict()
    return state if state["delay"] or set(state) != {"delay"} else None


def restore_in_flight_state(wrapper: PoseidonDDP, state: dict | None) -> None:
    """Load what :func:`in_flight_state` saved, before the first step of the resumed run. A pipelined
    run resumed from a checkpoint without it (saved by another mode, or by an older version) starts
    with an empty pipeline: its first k steps make no update; said with a warning."""
    delay = wrapper.engine.mode.in_flight_steps if wrapper.engine is not None else 0
    if state is not None:
        saved = state.get("delay") if isinstance(state, dict) else None
        if saved != delay:
            raise ValueError(f"this checkpoint holds the in-flight state of a run with delay={saved!r}, and this "
                             f"PoseidonDDP has delay={delay}: resume with delay={saved!r}, or drop the {saved!r} pending "
                             f"step(s) knowingly by deleting the checkpoint's '{CHECKPOINT_KEY}' entry (Lightning) or "
                             f"its {FILE_NAME} file (HF Trainer)")
        wrapper.load_consistency_state_dict(state)
        return
    if delay:
        lost = "the sync in flight is lost and the rounds count from 0" if wrapper.options.periodic else \
            f"the pipeline restarts empty, so the first {delay} step(s) make no update"
        warnings.warn(f"PoseidonDDP: resumed from a checkpoint without the in-flight state (delay={delay}): {lost}",
                      stacklevel=3)
