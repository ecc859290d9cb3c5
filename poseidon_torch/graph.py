"""Where in the autograd graph the engine hooks: parameters' gradient accumulators, and forward outputs
in a way that survives what user code does to them.

A parameter is ready when a hook on its accumulator node (:func:`grad_accumulator`) fires: torch runs
node hooks after the accumulation *and* after every post-accumulate-grad hook of the parameter, also
those registered after the engine's, so what the engine reads of ``.grad`` is what those hooks left.

torch drops a tensor hook registered on a *view* when the view is later modified in place (autograd
regenerates the view's ``grad_fn``), e.g. ``F.relu(linear(x3d), inplace=True)``: ``F.linear`` on a 3-D
input returns a view of a 2-D result, and a hook on it never fires. A hook on the view's base survives
the in-place op (it then sees the gradient of the base before the op, which is what the engine needs).

Invariant: the tensor returned carries a gradient exactly when a backward runs through ``t``; with
``same_elements`` its gradient also holds ``t``'s gradient, element for element in the same order.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.graph import Node


def grad_accumulator(p: Tensor) -> Node:
    """The node that accumulates leaf ``p``'s gradient (hold it: torch keeps it only while referenced)."""
    with torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


def hook_target(t: Tensor, *, same_elements: bool) -> Tensor | None:
    """Where to register a gradient hook meant for ``t``: ``t`` unless it is a view of a non-leaf;
    else its base, when any base will do or when the base holds exactly ``t``'s elements in order;
    None when neither (the caller must make ``t`` a tensor of its own)."""
    if not t._is_view():
        return t
    base = t._base
    if base.grad_fn is None or not base.requires_grad:
        # a view of a leaf: a hook on the leaf would fire for every later backward through it
        return t if not same_elements else None
    if not same_elements:
        return base
    whole = base.numel() == t.numel() and base.is_contiguous() and t.is_contiguous()
    return base if whole and t.data_ptr() == base.data_ptr() else None


def leaves_of(tensors: list[Tensor]) -> Iterator[Tensor]:
    """The leaf tensors an autograd graph through ``tensors`` accumulates into."""
    seen, stack = set(), [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            yield variable
        stack.extend(next_node for next_node, _ in node.next_functions)
