"""``ServerOptimizer``: the user's optimizer, run by the parameter-server shards (``server.py``).

The user-facing side of parameter-server mode: the optimizer class, its param groups and
hyperparameters as torch's optimizers hold them, the options every rank must agree on (``lazy_pull``,
``max_grad_norm``, Pipe-SGD's ``delay``, SSP's ``staleness``), ``step()`` / ``zero_grad()`` /
``state_dict()`` as torch's, and the
refusals (optimizers that cannot run on shards, ``GradScaler``). It hands its wrapper a plain request
(``modes.ServerRequest``: a ``ServerSpec`` of the optimizer, and the consistency options), which the
wrapper resolves into its mode when its engine starts; from then on it asks that mode (``modes/server.py``,
``modes/ssp.py``). This module imports the wrapper; nothing in the package imports this one.
"""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .ddp import PoseidonDDP
from .modes import ServerMode, ServerRequest
from .server import ServerSpec, hyperparameters, merge_exports

#: torch optimizers whose update of an element reads only that element's gradient and state: their
#: chunks may cut parameters anywhere. Any other class (subclasses of these included: a LARS written
#: as a subclass of SGD rescales per parameter) sees whole parameters.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD"))
#: optimizers that cannot run on shards: a closure re-evaluating the whole model, or sparse gradients
REFUSED = (torch.optim.LBFGS, torch.optim.SparseAdam)


def chunks_must_align(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` needs whole parameters in a chunk; raises for refused classes."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if issubclass(optimizer_class, REFUSED):
        raise ValueError(f"{optimizer_class.__name__} cannot run on parameter-server shards (it needs a closure "
                         "over the whole model or sparse gradients); use it with PoseidonDDP's default mode")
    return optimizer_class not in ELEMENTWISE


def _staleness(value: Any, delay: int, max_grad_norm: float | None, lazy_pull: bool) -> int | None:
    """``staleness`` checked: an int >= 0 or None, and not combined with options that need lockstep."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise TypeError(f"ServerOptimizer option staleness must be an int >= 0 (clocks) or None (asynchronous), "
                        f"got {value!r}")
    if value != 0:
        clash = [name for name, on in (("delay", delay), ("max_grad_norm", max_grad_norm is not None),
                                       ("lazy_pull", lazy_pull)) if on]
        if clash:
            raise ValueError(f"ServerOptimizer(staleness={value}) cannot be combined with {', '.join(clash)}: "
                             "they need every rank at the same step (staleness pulls lazily already)")
    return value


def _every(name: str, value: Any, staleness: int | None) -> int:
    """``push_every`` / ``fetch_every`` checked: an int >= 1, other than 1 only when asynchronous."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TypeError(f"ServerOptimizer option {name} must be an int >= 1 (passes), got {value!r}")
    if value != 1 and staleness is not None:
        raise ValueError(f"ServerOptimizer({name}={value}) is Downpour's, for staleness=None (asynchronous); with "
                         f"staleness={staleness} every pass pushes and fetches, and the bound decides what is read")
    return value


def _max_norm(value: Any) -> float | None:
    """``max_grad_norm`` checked: None, or a number > 0 (``inf``: the norm is computed, nothing is clipped)."""
    if value is None:
        return None
    number = None
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        number = float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    if number is None or math.isnan(number) or number <= 0:
        raise ValueError(f"max_grad_norm must be a number > 0 (inf: compute the norm, clip nothing; None: neither), "
                         f"got {value!r}")
    return number


class ServerOptimizer(torch.optim.Optimizer):
    """The user's optimizer, run by the parameter-server shards of a :class:`PoseidonDDP`.

    ``ServerOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)`` (or ``params=`` param
    groups over ``model``'s parameters, as for any torch optimizer). From then on each synced
    ``backward()`` is one optimizer step: the owner of each 2 MB chunk applies the update with the
    chunk's optimizer state (1/P of it per rank), and the new values are pulled. ``step()`` waits until
    every parameter holds its new value (with ``lazy_pull=True`` it returns at once, and each layer's
    new values land just before its next forward). ``zero_grad()`` is harmless: the server spends the
    gradients. With ``delay=k`` (Pipe-SGD) the new values land k steps later: the forward of step t
    reads the values of step t-1-k while the owners step from the newest (``modes/server.py``, ``PipeServer``), and
    ``step()`` returns at once. With ``staleness=s`` (stale synchronous parallel) or ``staleness=None``
    (asynchronous, Downpour) each rank runs on its own clock: the owners apply every push when it
    arrives (gradient / P) and a forward reads values that lack at most s clocks of any rank
    (``stale.py``); every rank calls :meth:`finish` at the end. Asynchronous only: ``push_every=n``
    sums a rank's gradients over n passes and pushes the sum once (one step at the owners),
    ``fetch_every=m`` takes new values every m passes (Downpour's n_push, n_fetch).

    Gradient clipping by the global norm is an option here, ``max_grad_norm=1.0``: the owners scale
    the averaged gradients as ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` would before
    ``step()``, and :attr:`last_grad_norm` is the norm it returns (``max_grad_norm=inf``: the norm
    only, as ``clip_grad_norm_(..., inf)`` gives it). ``clip_grad_norm_`` itself, called
    between ``backward()`` and ``step()``, cannot work: the update already ran on the servers. ``state_dict()`` after ``consolidate_state_dict(to)`` on every rank, as
    ``ZeroRedundancyOptimizer``; ``load_state_dict`` takes torch's format (also a plain optimizer's).
    Once the wrapper is closed its shards are gone: a state consolidated before that stays available
    (``consolidate_state_dict`` to the same rank is then a no-op), anything else raises.
    Build it before the model's first forward: the wrapper's consistency mode is chosen once, when its
    engine starts.
    """

    #: so that a ``torch.amp.GradScaler`` hands its verdict to :meth:`step` (which refuses it) instead
    #: of unscaling ``.grad`` and stepping: the shards already stepped on the scaled gradients
    _step_supports_amp_scaling = True

    def __init__(self, model: Any, optimizer_class: type, params: Iterable | None = None, *,
                 lazy_pull: bool = False, max_grad_norm: float | None = None, delay: int = 0,
                 staleness: int | None = 0, push_every: int = 1, fetch_every: int = 1, **defaults: Any) -> None:
        if not isinstance(model, PoseidonDDP):
            raise TypeError(f"ServerOptimizer needs the PoseidonDDP that trains the model, got {type(model).__name__}")
        self.aligned = chunks_must_align(optimizer_class)
        self.optimizer_class = optimizer_class
        self.lazy_pull = bool(lazy_pull)
        if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
            raise TypeError(f"ServerOptimizer option delay must be an int >= 0 (steps), got {delay!r}")
        #: Pipe-SGD: the forward of step t reads the values of step t-1-delay
        self.delay = delay
        self._max_grad_norm = _max_norm(max_grad_norm)
        #: SSP's bound in clocks (0: BSP; None: asynchronous, no bound): ``stale.py``
        self.staleness = _staleness(staleness, delay, self._max_grad_norm, self.lazy_pull)
        #: asynchronous mode: push the summed gradients every ``push_every`` passes, take new values every
        #: ``fetch_every`` passes (Downpour's n_push, n_fetch)
        self.push_every = _every("push_every", push_every, self.staleness)
        self.fetch_every = _every("fetch_every", fetch_every, self.staleness)
        self.model = model
        # the class's own defaults, completed as it completes them, so param_groups read as torch's
        defaults = optimizer_class([torch.zeros(1)], **defaults).defaults
        super().__init__(list(model.parameters()) if params is None else params, defaults)
        accepted = inspect.signature(optimizer_class).parameters
        #: the defaults the class takes as arguments (the groups carry every hyperparameter anyway)
        self.init_kwargs = {k: v for k, v in defaults.items() if k in accepted}
        optimizable = [p for g in self.param_groups for p in g["params"]]
        # frozen parameters may be listed, as torch allows (never stepped: they get no gradient), so that
        # the default groups and their state_dict keys are those of ``optimizer_class(model.parameters())``
        own = {id(p) for p in model.module.parameters()}
        outside = [i for i, p in enumerate(optimizable) if id(p) not in own]
        if outside:
            raise ValueError(f"ServerOptimizer optimizes the parameters of the model it serves; "
                             f"parameter(s) {outside[:8]} (in param group order) are not among them (keep "
                             "parameters outside the model, e.g. a learnable loss weight, in an optimizer of their own)")
        self.key_of = {id(p): i for i, p in enumerate(optimizable)}
        self.group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        self.shapes = {i: p.shape for i, p in enumerate(optimizable)}  #: per state_dict key
        self._consolidated: dict | None = None
        self._consolidated_to: int | None = None  #: the rank the last consolidation gathered on
        self._consolidated_at = 0  #: the passes the shards had begun then (a later one makes it stale)
        #: listed parameters that were frozen when the model was wrapped: no bucket syncs them
        self._unsynced = [(n, p) for n, p in model.module.named_parameters()
                          if id(p) in self.key_of and id(p) not in model.synced_parameters]
        missing = [n for n, p in model.module.named_parameters() if p.requires_grad and id(p) not in self.key_of]
        if missing:
            raise ValueError("ServerOptimizer must optimize every trainable parameter of the model; "
                             f"missing: {missing[:8]}")
        self._inner_probe()
        self._initialized = True
        spec = ServerSpec(optimizer_class, self.init_kwargs, self.param_groups, self.key_of, self.group_of, self.shapes,
                          self._max_grad_norm, self.lazy_pull, self.aligned)
        versions = {id(p): p._version for p in model.module.parameters()}  # what the owners start from
        model.attach_server(ServerRequest(spec, delay, self.staleness, self.push_every, self.fetch_every, versions),
                            self.describe())

    @classmethod
    def from_optimizer(cls, model: Any, optimizer: torch.optim.Optimizer, **server_options: Any) -> ServerOptimizer:
        """The same class, param groups and hyperparameters as ``optimizer`` (a torch optimizer built over
        ``model.module``'s parameters that has not stepped yet), run by the shards: for frameworks that
        build the optimizer themselves (the HF ``Trainer``). ``server_options``: ``lazy_pull``,
        ``max_grad_norm``."""
        if optimizer.state:
            raise ValueError("ServerOptimizer.from_optimizer takes an optimizer that has not stepped yet (its state "
                             "would be lost); load a checkpoint into the ServerOptimizer instead")
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
        return cls(model, type(optimizer), groups, **server_options, **defaults)

    def _inner_probe(self) -> None:
        """Build the class once on the user's groups, so bad hyperparameters fail here, on every rank."""
        probe = [{**hyperparameters(g), "params": [torch.zeros(1, dtype=g["params"][0].dtype)]} for g in self.param_groups
                 if g["params"]]
        self.optimizer_class(probe, **self.init_kwargs)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_initialized", False):
            raise NotImplementedError("ServerOptimizer.add_param_group after construction is not supported: the "
                                      "shards are planned over the model's parameters once; construct it with all groups")
        super().add_param_group(param_group)

    def describe(self) -> dict[str, object]:
        """What every rank must agree on, by name (checked across ranks when the model attaches this)."""
        groups = [(repr(sorted(hyperparameters(g).items())), [self.key_of[id(p)] for p in g["params"]])
                  for g in self.param_groups]
        name = f"{self.optimizer_class.__module__}.{self.optimizer_class.__qualname__}"
        return {"class": name, "lazy_pull": self.lazy_pull, "max_grad_norm": self.max_grad_norm, "delay": self.delay,
                "staleness": self.staleness, "push_every": self.push_every, "fetch_every": self.fetch_every,
                "param groups (hyperparameters, parameters)": groups}

    @property
    def stale(self) -> bool:
        """SSP or asynchronous: every rank on its own clock."""
        return self.staleness != 0

    def _mode(self) -> ServerMode:
        """The wrapper's mode (its engine started now if need be): the one this optimizer's request made."""
        self._refuse_closed()
        return self.model.engine.mode

    def _started_mode(self) -> ServerMode | None:
        """The wrapper's mode if its engine has started and is not closed (None: no step has run, no state
        exists, or the shards are gone)."""
        engine = self.model._engine
        return engine.mode if engine is not None else None

    def _refuse_closed(self) -> None:
        if self.model._closed:
            raise RuntimeError("the PoseidonDDP this ServerOptimizer runs on was closed (close(), or a framework's teardown "
                               "at the end of training), and its shards with it: gather the state before closing "
                               "(consolidate_state_dict(to) on every rank), or train on a new ServerOptimizer")

    @property
    def server(self):
        """This rank's shards (``server.py``, or ``stale.py`` with staleness)."""
        return self._mode().server

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold (fixed at construction: every rank's plan depends on it)."""
        return self._max_grad_norm

    @property
    def last_grad_norm(self) -> float | None:
        """With ``max_grad_norm``: the global norm of the averaged gradients before clipping, of the
        last synced backward (what ``clip_grad_norm_`` returns; with lazy pulls it waits for that step's
        norm, not for its pulls); None without clipping, before the first step, or after a backward that
        raised (that step is skipped)."""
        mode = self._started_mode()
        if self.max_grad_norm is None or mode is None or self.model.engine.backward_raised():
            return None
        return mode.wait_norm()

    def step(self, closure: Any = None) -> Any:
        """The update already ran at the shards during ``backward()``: wait until every parameter holds
        its new value (unless ``lazy_pull``). With a ``closure`` (forward and backward, as Lightning
        passes it), call it first, as torch's optimizers do: its backward runs the update; returns its
        loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaled = self.__dict__.pop("found_inf", None) is not None
        self.__dict__.pop("grad_scale", None)
        if scaled:
            raise RuntimeError(
                "ServerOptimizer does not support torch.amp.GradScaler: the shards apply the update "
                "during backward(), on the gradients as they arrive, so a scaler can neither unscale them "
                "nor skip a step with inf/NaN; this backward's update already used the scaled gradients. "
                "Use bf16 autocast (no scaler), or PoseidonDDP with a plain optimizer and the scaler")
        unfrozen = [name for name, p in self._unsynced if p.requires_grad]  # the same on every rank, used or not
        if unfrozen:
            raise RuntimeError(f"parameter(s) {unfrozen[:8]} were frozen when the model was wrapped and have a gradient "
                               "now: nothing syncs or steps them; unfreeze before wrapping with PoseidonDDP (or wrap again)")
        mode = self._started_mode()
        if mode is not None:
            mode.after_step()
        return loss

    @property
    def last_staleness(self) -> int | None:
        """With ``staleness``: how many clocks of the slowest rank the values read by the next forward
        lack (0 = what BSP would read; at most ``staleness``); None in the other modes or before a step."""
        mode = self._started_mode()
        return None if mode is None else mode.last_staleness()

    def finish(self) -> None:
        """End of training: wait for the last step's sync and put the newest values into the parameters.
        With ``delay=k`` the parameters hold what the next forward would read (k steps behind the
        servers) until this is called; afterwards they hold the servers' newest values, and training may
        go on (the pipeline refills). Without ``delay`` it is :meth:`PoseidonDDP.synchronize`. Not
        collective (every rank computes the same values), but call it on every rank at the same step: a rank
        that calls it alone mid-training reads newer values than the others for k forwards. With
        ``staleness`` it is collective: it waits until every rank called it (the others train on meanwhile:
        uneven data), then every rank's parameters are the owners' newest values and the clocks restart."""
        self._mode().finish()

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        mode = self._started_mode()
        return 0 if mode is None else mode.server.state_bytes()

    def _forget_consolidated(self) -> None:
        self._consolidated = self._consolidated_to = None

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (collective: every rank calls it); ``to=None``:
        on every rank (for frameworks that call ``state_dict()`` everywhere, as accelerate's
        ``save_state``; each rank then holds the whole state, as a torch optimizer under DDP does). After
        the wrapper closed, a state gathered on ``to`` before that is kept (nothing can change it)."""
        to = self.model.rank if to is None else to
        if self.model._closed and self._consolidated_to == to:
            return
        mode = self._mode()
        mode.quiesce()  # a skipped step's state taken back, every update (every push) applied
        engine = self.model.engine
        exports = engine.control.all_gather_objects(mode.server.export())
        self._consolidated, self._consolidated_to = None, to
        self._consolidated_at = mode.server.passes
        if engine.rank == to:
            self._consolidated = merge_exports(exports, self.shapes)

    def state_dict(self) -> dict:
        """torch's optimizer format: after :meth:`consolidate_state_dict` on every rank, on rank ``to``.
        While no step has made any state (as when accelerate copies the state at set-up, on every rank)
        it is the empty state, anywhere, with no collective."""
        mode = self._started_mode()  # None once closed: a state gathered before stays
        if mode is not None and mode.server.passes != self._consolidated_at:  # a step's updates began since
            self._forget_consolidated()
        if self._consolidated is not None:
            state = {k: dict(v) for k, v in self._consolidated.items()}
        elif self._consolidated_to is not None:
            rank = self.model.rank
            raise RuntimeError(f"the optimizer state was consolidated on rank {self._consolidated_to}, not on this rank "
                               f"({rank}): call state_dict() there, or consolidate_state_dict(to={rank}) on every rank")
        elif mode is None or not mode.server.has_state():
            self._refuse_closed()  # closed, nothing gathered: the shards are gone
            state = {}
        else:
            raise RuntimeError("call consolidate_state_dict(to=...) on every rank first (as with "
                               "ZeroRedundancyOptimizer), then state_dict() on rank `to`")
        groups = [{**hyperparameters(g), "params": [self.key_of[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's format (every rank the whole dict; each keeps its pieces' parts)."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("loaded state_dict has param groups of other sizes than this optimizer's")
        mode = self._mode()
        mode.quiesce()  # or a skipped step's roll-back would land on the loaded state; no push in flight
        for group, saved in zip(self.param_groups, groups):
            group.update(hyperparameters(saved))
        state = {int(k): v for k, v in state_dict["state"].items()}
        for key, entry in state.items():
            shape = self.shapes[key]
            for name, value in entry.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape != shape:
                    raise ValueError(f"state {name!r} of parameter {key} has shape {tuple(value.shape)}, "
                                     f"the parameter {tuple(shape)}")
        mode.server.load(state)
        self._forget_consolidated()

    def __repr__(self) -> str:
        return f"ServerOptimizer({self.optimizer_class.__name__}, {len(self.param_groups)} group(s))"
