"""Which parameters a loss depends on: a walk of its autograd graph down to the AccumulateGrad nodes.

Every path of a graph ends, for a parameter, in that parameter's `AccumulateGrad` node. Holding each
parameter's node (`grad_accumulators`) keeps it the one every later graph uses, so the walk
recognizes a parameter by a dictionary look-up instead of inspecting every node, as torch's DDP does
in C++.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["grad_accumulators", "iter_tensors", "parameters_reached"]


def grad_accumulators(params: Sequence[Tensor]) -> dict[Any, int]:
    """Return each parameter's AccumulateGrad node mapped to the parameter's index; keep it alive."""
    with torch.enable_grad():
        return {param.view_as(param).grad_fn.next_functions[0][0]: index for index, param in enumerate(params)}


def parameters_reached(roots: Any, accumulators: dict[Any, int], index_of: dict[int, int]) -> set[int]:
    """Return the indices of the parameters the autograd graph of the tensors in `roots` reaches.

    Args:
        roots: a tensor, or tensors in any nesting of lists, tuples, dicts and dataclasses.
        accumulators: from `grad_accumulators`.
        index_of: `id(parameter)` to index, for a root that is itself a parameter.
    """
    reached: set[int] = set()
    stack = []
    for tensor in iter_tensors(roots):
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif id(tensor) in index_of:
            reached.add(index_of[id(tensor)])
    seen = set(stack)
    while stack:
        node = stack.pop()
        index = accumulators.get(node)
        if index is not None:
            reached.add(index)
            continue  # an AccumulateGrad node: a leaf of the graph
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
    return reached


def iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Yield every tensor inside lists, tuples, dicts and dataclasses of `obj`."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
