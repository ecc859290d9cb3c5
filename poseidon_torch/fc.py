"""Fully connected layers and their sufficient factors: what a factor path (``paths/sfb.py``) syncs.

For an FC layer ``y = x W^T + b`` (W is M x N) the weight gradient over K samples is ``dW = U^T V`` with
U (K x M) the output gradients and V (K x N) the inputs, and ``db = U.sum(0)``. A factor path moves
the (U, V) of every rank instead of the M x N gradient and rebuilds the exact average with one GEMM
(:func:`rebuild_gradients`).

Parts:
- the registry of FC module classes (:func:`register_fc`, :func:`fc_spec`), and which layers can take a
  factor path at all (:func:`fc_eligible`);
- :class:`FCLayer`: one FC module's calls. When the coordinator *commits* the layer to a factor path for
  a round of forwards, each call inside the wrapper's synced forward sees its weight and bias swapped
  for detached stand-ins, so autograd skips the local weight-gradient GEMM; the call's input V is kept
  and its output gradient U recorded when backward reaches it. A stand-in *witness* leaf (the detached
  bias, or a zero added to the output) is accumulated by autograd exactly once per backward, after every
  reached call has its U: that is the layer's readiness, and it happens only in backward passes that
  accumulate (never in ``torch.autograd.grad``).

Invariants (factors only where they are exact):
- a rank whose local gradient is not exactly its captured factors (a use of W or b outside the captured
  calls: a penalty term, a call outside the wrapper's forward, checkpoint recomputation; local no_sync
  accumulation; a call that was not detached; user hooks on W or b) can tell (:meth:`FCLayer.exact_locally`),
  and the layer's *sticky* facts (``CREATE_GRAPH`` and friends) keep it off factors for good;
- a backward with ``create_graph=True`` through a detached call cannot be exact (the higher-order
  gradient of W is lost) and raises at once; layers seen in such a pass are never committed;
- the rebuild runs in fp32; the rebuilt average is held (:attr:`FCLayer.average`) until the engine adds it
  to ``.grad`` on the training thread: a sync job never writes ``.grad``;
- copies of the module (``copy.deepcopy``, pickling) get inert hooks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from .bucket import USED, Bucket, Layer
from .graph import grad_accumulator, hook_target

@dataclass(frozen=True)
class FCSpec:
    """How to read an FC module: ``y = x W^T + b`` with W (M x N), or ``y = x W + b`` with W (N x M)
    when ``transposed``. ``bias`` is None when the module (or this instance) has no bias; the input is
    the positional forward argument ``input_arg``."""

    weight: str = "weight"
    bias: str | None = "bias"
    input_arg: int = 0
    transposed: bool = False

    def weight_of(self, module: nn.Module) -> Tensor:
        return getattr(module, self.weight)

    def out_features(self, module: nn.Module) -> int:
        """M, the number of outputs."""
        shape = self.weight_of(module).shape
        return shape[1] if self.transposed else shape[0]

    def in_features(self, module: nn.Module) -> int:
        """N, the number of inputs."""
        shape = self.weight_of(module).shape
        return shape[0] if self.transposed else shape[1]


_REGISTRY: dict[type[nn.Module], FCSpec] = {}


def register_fc(
    module_type: type[nn.Module],
    *,
    weight: str = "weight",
    bias: str | None = "bias",
    input_arg: int = 0,
    transposed: bool = False,
) -> None:
    """Declare ``module_type`` (exactly this class, not its subclasses) as a fully connected layer."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_fc expects an nn.Module subclass, got {module_type!r}")
    _REGISTRY[module_type] = FCSpec(weight, bias, input_arg, transposed)


def fc_spec(module: nn.Module) -> FCSpec | None:
    """The FC spec of ``module`` (exact type lookup), or None if it is not a registered FC layer.

    The returned spec has ``bias=None`` when this instance's bias attribute is None
    (e.g. ``nn.Linear(..., bias=False)``)."""
    spec = _REGISTRY.get(type(module))
    if spec is not None and spec.bias is not None and getattr(module, spec.bias, None) is None:
        return replace(spec, bias=None)
    return spec


register_fc(nn.Linear)


def _bias_of(module: nn.Module, spec: FCSpec) -> Tensor | None:
    return getattr(module, spec.bias) if spec.bias is not None else None


def rebuild_gradients(u_all: Tensor, v_all: Tensor, world_size: int, spec: FCSpec) -> tuple[Tensor, Tensor]:
    """The rank-averaged gradients from all ranks' factors, computed in fp32: ``grad_W = U^T V / P``
    (its transpose for transposed specs) with one matrix product, and ``grad_b = U.sum(0) / P``."""
    u_scaled = u_all.float() / world_size
    v = v_all.float()
    grad_w = v.t() @ u_scaled if spec.transposed else u_scaled.t() @ v
    return grad_w, u_scaled.sum(0)


# ---- one FC module's calls ------------------------------------------------------------------------

#: Sticky facts about a layer, shared with every rank at the end of each pass; any of them on any rank
#: keeps the layer off factor paths for good (the plan never commits it).
CREATE_GRAPH = 1   # a backward with create_graph=True went through a call of the layer
UNCOVERED = 2      # W or b got gradient from outside the captured calls (penalty, outside call, ...)
HOOKED = 4         # user hooks on W or b (tensor hooks, or post-accumulate hooks besides the engine's)
CHECKPOINTED = 8   # a call ran under saved-tensor hooks (activation checkpointing, offloading)
ACCUMULATED = 16   # its gradient accumulated locally (no_sync) before a synced backward
GRAD_CALL = 32     # torch.autograd.grad (or backward(inputs=...)) asked for W or b through its calls
UNSEEN = 64        # W or b got gradient in a round where none of its calls was seen (torch.compile traced them)
STICKY_NAMES = {CREATE_GRAPH: "create_graph backward", UNCOVERED: "gradient from outside its calls",
                HOOKED: "user hooks on its parameters", CHECKPOINTED: "activation checkpointing",
                ACCUMULATED: "gradient accumulation under no_sync",
                GRAD_CALL: "torch.autograd.grad with respect to its parameters",
                UNSEEN: "calls the engine cannot see (inside a torch.compile graph)"}

class EngineHook:
    """A module hook bound to the engine. Copies of the module (``copy.deepcopy``, pickling) get an
    inert hook instead, so an EMA copy of the inner module is a plain module."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo: dict) -> Callable:
        return inert_hook

    def __reduce__(self):
        return _inert_hook_factory, ()


def inert_hook(*args) -> None:
    return None


def _inert_hook_factory() -> Callable:
    return inert_hook


class _Use:
    """One detached call: its input V and, once a backward reached it, its output gradient U and the
    graph task (backward pass) that produced U."""

    __slots__ = ("input", "grad_output", "task", "round", "__weakref__")

    def __init__(self, x: Tensor, round_: int) -> None:
        self.input = x
        self.grad_output: Tensor | None = None
        self.task = -1
        self.round = round_


class FCLayer:
    """The calls of one FC module: rows per round (K), detached calls' factors, readiness, facts.

    A use hangs on its call's output gradient hook, so a second backward through a retained graph finds
    its input again; once a backward reached it, the layer also holds it until the sync job of that
    backward consumed it (which may run after the graph is gone)."""

    def __init__(self, name: str, module: nn.Module, spec: FCSpec,
                 in_forward: Callable[[], bool], in_synced_forward: Callable[[], bool]) -> None:
        self.name, self.module, self.spec = name, module, spec
        self.weight = spec.weight_of(module)
        self.bias = _bias_of(module, spec)
        self.params = [p for p in (self.weight, self.bias) if p is not None]
        self.m, self.n = spec.out_features(module), spec.in_features(module)
        self.commit = False  #: detach this round's calls (the plan chose SFB)
        #: alone in its bucket, so the plan may choose SFB for it: its calls are watched (K, sticky facts)
        #: and may be detached. A layer fused with others cannot take SFB until a rebuild leaves it alone,
        #: and its hooks return at once (watching costs ~40 us per call in Python); it is watched for at
        #: least one pass before the plan can commit it
        self.watching = True
        self.k_round = 0     #: rows of this round's calls inside the wrapper's synced forwards
        self.sticky = 0      #: facts that keep the layer off SFB, see CREATE_GRAPH and friends
        self.on_factors: Callable[[FCLayer, Tensor], None] | None = None
        self._in_forward, self._in_synced_forward = in_forward, in_synced_forward
        #: uses a backward reached, held until their sync job consumed them: in parameter-server mode
        #: the job may run after backward() returned and the graph (which holds the uses) is gone.
        #: Uses no sync job consumes (reached by ``autograd.grad``) go two rounds later.
        self.recorded: list[_Use] = []
        self._rounds = 0
        #: the average the last SFB sync rebuilt (grad W, grad b), until the engine adds it to ``.grad``
        #: at the end of a backward that was not aborted, or the server's update consumes it: a sync job
        #: never writes ``.grad`` itself, so nothing of an aborted backward can land after the user's
        #: ``zero_grad()``
        self.average: tuple[Tensor, ...] | None = None
        #: the factors' local gradient a fallback to PS added to the flat buffer: the engine adds it to
        #: ``.grad`` if the pass ends aborted (``.grad`` then keeps this rank's whole local gradient)
        self.local: tuple[Tensor | None, ...] | None = None
        self._witness: Tensor | None = None
        self._calls: list[bool | None] = []
        self.accumulators = [grad_accumulator(p) for p in self.params]
        self._handles = [module.register_forward_pre_hook(EngineHook(self._before_call)),
                         module.register_forward_hook(EngineHook(self._after_call))]

    @property
    def witness(self) -> Tensor | None:
        """This round's stand-in leaf, None if no call was detached in this round."""
        return self._witness

    def begin_round(self, commit: bool) -> None:
        """A new round of synced forwards begins (the previous one was backpropagated)."""
        self.commit, self.k_round, self._witness = commit, 0, None
        self._rounds += 1
        self.recorded = [use for use in self.recorded if use.round >= self._rounds - 1]

    # ---- forward hooks ------------------------------------------------------------------------

    def _before_call(self, module: nn.Module, args: tuple) -> None:
        # not a candidate, or traced into a compiled graph (no capture, no graph break)
        if torch.compiler.is_compiling() or not self.watching:
            return
        state = None
        if torch.is_grad_enabled() and self.weight.requires_grad:
            if not self._in_forward():
                self.sticky |= UNCOVERED  # called outside the wrapper's forward, e.g. recomputed in backward
            elif self._in_synced_forward():
                if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
                    self.sticky |= CHECKPOINTED
                else:
                    hooked = self._hooked()  # hooks added since the plan was made act on autograd's gradient:
                    if hooked:               # no detached call, so the pass falls back to PS (exactly)
                        self.sticky |= HOOKED
                    state = self.commit and not hooked
                    if state:
                        self._swap_in()
        self._calls.append(state)

    def _after_call(self, module: nn.Module, args: tuple, output: object) -> Tensor | None:
        if torch.compiler.is_compiling() or not self.watching:
            return None
        detached = self._calls.pop() if self._calls else None
        if detached:
            self.restore()
        if detached is None or not isinstance(output, Tensor):
            return None
        x = self._input_of(args, output)
        self.k_round += x.numel() // self.n
        if not detached:
            if output.requires_grad:
                hook_target(output, same_elements=False).register_hook(self._watch)
            return None
        if self.bias is None:  # the witness keeps the call in the graph, whatever else is detached
            output = output + self._witness
        target = hook_target(output, same_elements=True)
        if target is None:  # a view whose base is not just the output: give the output its own storage
            output = target = output.clone()
        use = _Use(x.detach(), self._rounds)
        target.register_hook(_UseRecorder(self, use))
        return output

    def _input_of(self, args: tuple, output: Tensor) -> Tensor:
        arg = self.spec.input_arg
        if len(args) <= arg:
            raise RuntimeError(f"{type(self.module).__name__} {self.name!r}: FC input is positional argument "
                               f"{arg}, but forward got {len(args)} positional argument(s)")
        x = args[arg]
        if x.shape[-1] != self.n or output.shape[-1] != self.m:
            raise RuntimeError(f"{type(self.module).__name__} {self.name!r} is registered as FC with "
                               f"M={self.m}, N={self.n}, but a call mapped {tuple(x.shape)} to {tuple(output.shape)}")
        return x

    def _watch(self, grad: Tensor) -> None:
        """The gradient hook on a call that was not detached: facts that would make a detached call
        fail later (a create_graph backward, an autograd.grad asking for W or b). Once the calls are
        detached, torch prunes an autograd.grad for W or b before it reaches them: nothing to watch."""
        if torch.is_grad_enabled():
            self.sticky |= CREATE_GRAPH
        if any(_captured_by_autograd_grad(node) for node in self.accumulators):
            self.sticky |= GRAD_CALL

    def _hooked(self) -> bool:
        return any(p._backward_hooks or p._post_accumulate_grad_hooks for p in self.params)

    def _swap_in(self) -> None:
        if self._witness is None:
            stand_in = self.bias.detach() if self.bias is not None else self.weight.new_zeros(())
            self._witness = stand_in.requires_grad_()
            self._witness.register_post_accumulate_grad_hook(self._witness_accumulated)
        self.module._parameters[self.spec.weight] = self.weight.detach()
        if self.bias is not None:
            self.module._parameters[self.spec.bias] = self._witness

    def restore(self) -> None:
        """Put the parameters back after a call."""
        self.module._parameters[self.spec.weight] = self.weight
        if self.bias is not None:
            self.module._parameters[self.spec.bias] = self.bias

    def reset_calls(self) -> None:
        """After the wrapper's forward, also one that raised half way through a call."""
        if self._calls:
            self._calls.clear()
            self.restore()

    def _witness_accumulated(self, witness: Tensor) -> None:
        witness.grad = None
        if self.on_factors is not None:
            self.on_factors(self, witness)

    # ---- the sync job's side ------------------------------------------------------------------

    def local_factors(self, task: int) -> tuple[Tensor, Tensor]:
        """(U, V) of the detached calls that backward pass ``task`` reached, in the parameters' dtype."""
        uses = [use for use in list(self.recorded) if use.task == task and use.grad_output is not None]
        if not uses:
            return self.weight.new_empty((0, self.m)), self.weight.new_empty((0, self.n))
        dtype = self.weight.dtype
        u = torch.cat([use.grad_output.reshape(-1, self.m).to(dtype) for use in uses])
        v = torch.cat([use.input.reshape(-1, self.n).to(dtype) for use in uses])
        return u, v

    def consume(self, task: int) -> None:
        """Drop the output gradients pass ``task`` recorded (a retained graph records them anew)."""
        for use in list(self.recorded):
            if use.task == task:
                use.grad_output = None
        self.recorded = [use for use in self.recorded if use.grad_output is not None]

    def exact_locally(self, bucket: Bucket) -> bool:
        """Whether this rank's local gradient of the layer in this pass is exactly its captured factors
        and ``.grad`` holds only the synced past: nothing else accumulated, no unsynced local gradient,
        no user hooks that the factors would bypass."""
        return not (bucket.dirty.any() or bucket.seen.any() or self._hooked())

    def note_pass_start(self, bucket: Bucket) -> None:
        """A synced pass opens: gradient accumulated under no_sync makes SFB inexact, for good."""
        if bucket.dirty.any():
            self.sticky |= ACCUMULATED

    def note_pass_end(self, bucket: Bucket) -> None:
        """The backward is over: an accumulation into W or b while the calls were detached was a use
        outside the captured calls, for good; so is one in a round where no call was seen at all (the
        calls ran inside a compiled graph, which the layer's hooks cannot capture)."""
        if self._witness is not None and bucket.seen.any():
            self.sticky |= UNCOVERED
        if self.k_round == 0 and bucket.seen.any():
            self.sticky |= UNSEEN

    def add_local(self, bucket: Bucket, u: Tensor, v: Tensor) -> None:
        """Add the factors' local gradient, as autograd would have made it (the user's tensor hooks
        applied), to the staged ``.grad`` in the bucket's flat buffer, so the PS path averages full
        local gradients; keep it in :attr:`local`."""
        if u.shape[0] == 0:
            return
        views = dict(bucket.views())
        local = []
        for p, grad in zip(self.params, rebuild_gradients(u, v, 1, self.spec)):
            if not p.requires_grad:  # frozen since the layer went on SFB: autograd would give it nothing
                local.append(None)
                continue
            grad = grad.to(p.dtype)
            for hook in (p._backward_hooks or {}).values():
                result = hook(grad)
                grad = grad if result is None else result
            views[p] += grad.to(views[p].device)  # a GPU layer staged through host memory (gloo)
            bucket.flat[bucket.grad_numel + bucket.position[id(p)]] = USED  # not ``seen``: autograd's alone
            local.append(grad)
        self.local = tuple(local)

    def take_average(self) -> tuple[Tensor, ...] | None:
        average, self.average = self.average, None
        return average

    def take_local(self) -> tuple[Tensor | None, ...] | None:
        local, self.local = self.local, None
        return local

    def add_to_grad(self, grads: tuple[Tensor, ...]) -> None:
        """``.grad += grads`` (the training thread, at the end of a backward)."""
        for p, grad in zip(self.params, grads):
            if grad is None or not p.requires_grad:  # frozen since the layer went on SFB: no .grad, as autograd
                continue
            grad = grad.to(p.dtype)
            if grad.is_cuda:  # made on a side stream, used (and freed) on this one from now on
                grad.record_stream(torch.cuda.current_stream(grad.device))
            if p.grad is None:
                p.grad = grad
            else:
                p.grad += grad

    def remove(self) -> None:
        self.restore()
        for handle in self._handles:
            handle.remove()
        self.recorded = []
        self._witness = None


class _UseRecorder:
    """The gradient hook on a detached call's output: records U and the pass; raises for
    create_graph passes, which the detached weight cannot serve."""

    __slots__ = ("layer", "use")

    def __init__(self, layer: FCLayer, use: _Use) -> None:
        self.layer, self.use = layer, use

    def __call__(self, grad: Tensor) -> None:
        if torch.is_grad_enabled():
            self.layer.sticky |= CREATE_GRAPH
            name = self.layer.name
            raise RuntimeError(
                f"PoseidonDDP: a backward with create_graph=True (e.g. a gradient penalty) reached FC layer "
                f"{name!r}, which this step sends through SFB; SFB cannot give the higher-order gradient of "
                f"its weight. The layer stays on the PS path from the next step; pass overrides={{{name!r}: "
                "'PS'} (or hybrid=False) to avoid this error when such penalties start later in training.")
        self.use.grad_output = grad
        self.use.task = torch._C._current_graph_task_id()
        if not any(use is self.use for use in self.layer.recorded):
            self.layer.recorded.append(self.use)  # until its sync job consumes it: the graph may go first


def fc_layers(layers: list[Layer], model: nn.Module, in_forward: Callable[[], bool],
              in_synced_forward: Callable[[], bool]) -> dict[str, FCLayer]:
    """The layers that can take the SFB path (:func:`fc_eligible`), by layer name, watched."""
    return {layer.name: FCLayer(layer.name, layer.module, fc_spec(layer.module), in_forward, in_synced_forward)
            for layer in fc_eligible(layers, model)}


def fc_eligible(layers: list[Layer], model: nn.Module) -> list[Layer]:
    """The layers that can take the SFB path: exactly one registered FC module whose trainable weight
    (and bias) are all its parameters and all the layer's, none shared with another module (a weight
    tied to another module gets gradient the factors do not see; the module that registers it second
    holds only its bias as a layer, yet its calls would rebuild the weight too)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    eligible = []
    for layer in layers:
        spec = fc_spec(layer.module)
        bias = _bias_of(layer.module, spec) if spec is not None else None
        if (spec is None or not spec.weight_of(layer.module).requires_grad or layer.name.count("#")
                or (bias is not None and not bias.requires_grad)):
            continue
        own = [spec.weight_of(layer.module)] + ([bias] if bias is not None else [])
        if {id(p) for _, p in layer.params} == {id(p) for p in own} and all(owners[id(p)] == 1 for p in own):
            eligible.append(layer)
    return eligible


def _captured_by_autograd_grad(node) -> bool:
    """Whether the running backward is a ``torch.autograd.grad`` that asks for the gradient of the leaf
    whose AccumulateGrad ``node`` is (torch refuses to answer for exactly those leaves)."""
    try:
        torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True
    return False
