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

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from syncline.strategies.comm.reducer import Reducer

__all__ = ["DeferredUpdates"]


class DeferredUpdates:
    """The buckets a deferred optimizer step still owes, applied module by module in the next forward.

    Args:
        reducer: the strategy's reducer, whose buckets carry the averages.
        task: the module whose submodules get forward pre-hooks.
    """

    def __init__(self, reducer: Reducer, task: nn.Module) -> None:
        self.reducer = reducer
        self.optimizer: torch.optim.Optimizer | None = None
        #: Each parameter group's hyperparameters at the deferred step (the schedulers step before they are applied).
        self.hyper: list[dict[str, Any]] = []
        #: Buckets launched by the last backward whose update is not applied yet.
        self.pending: set[int] = set()
        #: Whether the optimizer step of the pending buckets was taken (before it, the forward must not apply them).
        self.stepped = False
        self._handles: list[RemovableHandle] = []
        for module in task.modules():
            if next(module.parameters(recurse=False), None) is not None:
                self._handles.append(module.register_forward_pre_hook(self._before_forward))

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
        for index in sorted(self.pending):
            self._apply(index)

    def apply_parameters(self, params: Any) -> None:
        """Apply the pending buckets that hold any of `params` (e.g. the task's own, read outside a forward)."""
        if not (self.pending and self.stepped):
            return
        for param in params:
            index = self.reducer.bucket_of(param)
            if index is not None and index in self.pending:
                self._apply(index)

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --------------------------------------------------------------- internals
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.apply_parameters(module.parameters(recurse=False))

    @torch.no_grad()
    def _apply(self, index: int) -> None:
        """Wait for bucket `index`'s average and step the optimizer on its parameters alone."""
        # Collective wait: the bucket's all-reduce, launched in the last backward.
        self.reducer.wait_bucket(index)
        self.pending.discard(index)
        optimizer = self.optimizer
        if not self.stepped or optimizer is None:
            return
        mine = {id(param) for param in self.reducer.bucket_parameters(index)}
        saved = [dict(group) for group in optimizer.param_groups]
        try:
            for group, hyper in zip(optimizer.param_groups, self.hyper):
                group.update(hyper)
                group["params"] = [p for p in group["params"] if id(p) in mine]
            optimizer.step()
        finally:
            for group, original in zip(optimizer.param_groups, saved):
                group.clear()
                group.update(original)


def _copy(value: Any) -> Any:
    """A hyperparameter as it is now (a scheduler may change a tensor learning rate in place)."""
    return value.clone() if isinstance(value, Tensor) else value
