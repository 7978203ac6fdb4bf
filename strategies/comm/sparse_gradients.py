"""Sparse gradients (`nn.Embedding(sparse=True)`): which parameters have them, and a rank's empty share.

As in torch's reducer, sparse gradients stay out of the flat buckets; the reducer averages each with a
sparse all-reduce of its own after the dense buckets. A rank that did not use the parameter still
takes part, with an empty sparse tensor of the right shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from syncline.strategies.comm.reducer_errors import CollectiveError, dense_gradient_message, first_line

__all__ = ["average_sparse_gradients", "empty_sparse_like", "sparse_gradient_parameters"]


def sparse_gradient_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Return the parameters whose gradients are sparse: those of embeddings built with `sparse=True`."""
    return [
        param
        for sub in module.modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
        for param in sub.parameters(recurse=False)
        if param.requires_grad
    ]


def empty_sparse_like(param: Tensor) -> Tensor:
    """Return an all-zero sparse gradient of `param`'s shape, laid out as an embedding's (one sparse dim)."""
    indices = torch.empty(1, 0, dtype=torch.int64, device=param.device)
    values = torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=True)


def average_sparse_gradients(
    params: Sequence[Tensor], names: Sequence[str], group: dist.ProcessGroup | None, timeout: float
) -> list[Tensor]:
    """Return the average across `group` of each parameter's sparse gradient, in the same order on every rank.

    A parameter whose `.grad` is None contributes an empty sparse tensor, so every rank launches the
    same collectives. Gradients are not modified.

    Raises:
        TypeError: a parameter's gradient is dense.
        CollectiveError: an all-reduce failed or did not finish within `timeout` seconds.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    works = []
    for param, name in zip(params, names):
        grad = param.grad
        if grad is None:
            contribution = empty_sparse_like(param)
        elif not grad.is_sparse:
            raise TypeError(dense_gradient_message(rank, name))
        else:
            contribution = grad.coalesce() / world_size
        # Collective: sparse all-reduce of one parameter's gradient (gloo gathers indices and values).
        works.append(dist.all_reduce(contribution, group=group, async_op=True))
    averaged = []
    for work, name in zip(works, names):
        try:
            # Host sync: wait for the sparse all-reduce.
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as error:
            raise CollectiveError(
                f"Rank {rank}: sparse all-reduce of {name}'s gradient failed: {first_line(error)}"
            ) from error
        averaged.append(work.get_future().value()[0].coalesce())
    return averaged
