"""Deferred optimizer updates: each bucket's step runs just before the next forward uses its parameters.

A synchronous data-parallel step overlaps only its backward with the wire: the optimizer step needs every
averaged gradient and the next forward every updated parameter. ByteScheduler (Peng et al., SOSP 2019) lifts
both limits, and `BucketedDDP(deferred_update=True)` does the same:

- the backward launches the buckets as they become ready, except the last `hold` of them (the model's front
  layers, ready last), which launch when autograd returns, front-most first (`Reducer.finalize_backward(wait=False)`);
- nothing waits at the end of the backward; the optimizer step records each parameter group's hyperparameters
  (the learning rate a scheduler is about to change) and returns;
- a forward pre-hook on every module with parameters of its own waits for their buckets and steps the optimizer
  on those parameters alone, with the recorded hyperparameters. Whatever the forward did not reach is stepped
  before the next `zero_grad` or backward, and before anything reads the parameters or the optimizer state
  (validation, a checkpoint, the end of the fit: `apply_all`).

A per-parameter optimizer (SGD, Adam, AdamW, ... every `torch.optim` optimizer but LBFGS) updates a subset of its
parameters exactly as it updates them all, so the weights equal the blocking step's to the bit. What needs every
averaged gradient at once before the step (gradient clipping, fp16's loss scaler and its overflow check, a callback
reading gradients in ``on_before_optimizer_step``) cannot follow; `BucketedDDP` refuses the first two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from syncline.strategies.comm.layer_waits import LayerWaits
from syncline.strategies.comm.reducer import Reducer

__all__ = ["DeferredUpdates", "step_subset"]


class DeferredUpdates(LayerWaits):
    """The buckets a deferred optimizer step still owes, applied module by module in the next forward.

    Args:
        reducer: the strategy's reducer, whose buckets carry the averages.
        task: the module whose submodules get forward pre-hooks.
    """

    def __init__(self, reducer: Reducer, task: nn.Module) -> None:
        super().__init__(task)
        self.reducer = reducer
        self.optimizer: torch.optim.Optimizer | None = None
        #: Each parameter group's hyperparameters at the deferred step (the schedulers step before they are applied).
        self.hyper: list[dict[str, Any]] = []
        #: Whether the optimizer step of the pending buckets was taken (before it, the forward must not apply them).
        self.stepped = False

    # ---------------------------------------------------------------- the step
    def defer(self, buckets: list[int]) -> None:
        """Remember the buckets the backward just launched without waiting."""
        self.pending = set(buckets)
        self.stepped = False

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the optimizer step later: record the hyperparameters it runs with now."""
        self.optimizer = optimizer
        self.hyper = [
            {key: _copy(value) for key, value in group.items() if key != "params"} for group in optimizer.param_groups
        ]
        self.stepped = True

    def apply_all(self) -> None:
        """Apply every pending bucket (before a backward, `zero_grad`, validation, a checkpoint, the end of the fit).

        Buckets whose step was never taken (a window dropped for a non-finite loss) are only waited for.
        """
        self.land_all()

    def apply_parameters(self, params: Any) -> None:
        """Apply the pending buckets that hold any of `params` (e.g. the task's own, read outside a forward)."""
        self.land_parameters(params)

    # --------------------------------------------------------------- internals
    def buckets_of(self, param: Tensor) -> tuple[int, ...]:
        """The reducer's bucket of `param`."""
        index = self.reducer.bucket_of(param)
        return () if index is None else (index,)

    def ready(self) -> bool:
        """Only once the optimizer step was taken."""
        return self.stepped

    @torch.no_grad()
    def land(self, index: int) -> None:
        """Wait for bucket `index`'s average and step the optimizer on its parameters alone."""
        # Collective wait: the bucket's all-reduce, launched in the last backward.
        self.reducer.wait_bucket(index)
        self.pending.discard(index)
        optimizer = self.optimizer
        if not self.stepped or optimizer is None:
            return
        mine = {id(param) for param in self.reducer.buckets[index].parameters}
        step_subset(optimizer, mine, optimizer.step, self.hyper)


def step_subset(
    optimizer: torch.optim.Optimizer,
    ids: set[int],
    step: Callable[[], Any],
    hyper: list[dict[str, Any]] | None = None,
) -> None:
    """Run `step` (the optimizer's own) with every param group restricted to the parameters whose id is in `ids`.

    Exact for a per-parameter optimizer (every `torch.optim` one but LBFGS): a subset is updated as within the
    whole. `hyper`, one dict per group, replaces the groups' hyperparameters for this step (a deferred step's).
    """
    saved = [dict(group) for group in optimizer.param_groups]
    try:
        for index, group in enumerate(optimizer.param_groups):
            if hyper is not None:
                group.update(hyper[index])
            group["params"] = [p for p in group["params"] if id(p) in ids]
        step()
    finally:
        for group, original in zip(optimizer.param_groups, saved):
            group.clear()
            group.update(original)


def _copy(value: Any) -> Any:
    """A hyperparameter as it is now (a scheduler may change a tensor learning rate in place)."""
    return value.clone() if isinstance(value, Tensor) else value
