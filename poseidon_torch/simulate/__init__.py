"""The scaling simulator: predict iteration time and speed-up on N machines from one traced run.

- :mod:`.profile`: what a run's trace says of the model (layers in backward order, bytes, backward
  seconds, FC shapes, the traced buckets), or a profile JSON a user writes;
- :mod:`.timeline`: one iteration on one machine, compute on one lane and jobs on the link (BSP, or
  pipelined for Pipe-SGD), with an optional compute slowdown while communicating;
- :mod:`.schemes`: torch DDP, a plain PS, WFBP and Poseidon's hybrid as the jobs they create, costed by
  the coordinator's own formulas;
- :mod:`.paper`: the Poseidon paper's VGG19-22K profile and speed-ups;
- :mod:`.predict`: rows per scheme and number of machines; :mod:`.plot`: the speed-up curves;
- :mod:`.cli`: ``python -m poseidon_torch.simulate``.

What it does not model: stragglers (SSP and asynchronous modes run as BSP would without them),
several ranks per machine, a network topology beyond one full-duplex link per machine.
"""
from .predict import Row, predict
from .profile import FCShape, LayerProfile, Profile, from_trace, load
from .schemes import SCHEMES
from .timeline import Job, Timeline, bsp, pipelined

__all__ = ["Row", "predict", "FCShape", "LayerProfile", "Profile", "from_trace", "load", "SCHEMES", "Job",
           "Timeline", "bsp", "pipelined"]
