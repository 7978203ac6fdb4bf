"""Per-layer waits: work owed per bucket of parameters, landed module by module just before the forward uses them.

Two schedules leave a step's last part in flight when the next forward starts, and let that forward wait layer
by layer instead of for the whole model (ByteScheduler, Peng et al., SOSP 2019; BytePS; ZeRO's prefetch):

- deferred optimizer updates (`deferred_update.py`): a bucket's optimizer step waits for its average;
- parameter exchanges (`parameter_exchange.py`): a parameter server's broadcast, a sharded server's all-gather,
  decentralized SGD's quantized differences, each landing in the parameters when its transfer completes.

`LayerWaits` is what they share: a forward pre-hook on every module with parameters of its own lands the pending
buckets that hold those parameters, and `land_all` lands the rest. Whatever reads the parameters outside a
forward (validation, a checkpoint, the end of a fit, a callback, the next backward or `zero_grad`) must call
`land_all` first: a strategy holds its one `LayerWaits` in `ReducerStrategy.in_flight`, and the core lands it at
each of those points (`apply_pending_updates`, which the loop calls, among them) and `forget`s it when the stage
fails.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["LayerWaits"]


class LayerWaits(ABC):
    """Buckets with work still owed, landed by forward pre-hooks, module by module.

    Args:
        task: the module whose submodules (those with parameters of their own) get forward pre-hooks.
    """

    def __init__(self, task: nn.Module) -> None:
        #: The buckets whose work has not landed yet.
        self.pending: set[int] = set()
        self._handles: list[RemovableHandle] = []
        for module in task.modules():
            if next(module.parameters(recurse=False), None) is not None:
                self._handles.append(module.register_forward_pre_hook(self._before_forward))

    @abstractmethod
    def buckets_of(self, param: Tensor) -> tuple[int, ...]:
        """The buckets holding (parts of) `param`; none when it is not this machinery's."""

    @abstractmethod
    def land(self, index: int) -> None:
        """Finish bucket `index`'s work (wait for its transfer, write the parameters) and drop it from `pending`."""

    def ready(self) -> bool:
        """Whether the pending work may land in a forward now (a deferred step not yet taken may not)."""
        return True

    def land_all(self) -> None:
        """Land every pending bucket, in bucket order."""
        for index in sorted(self.pending):
            self.land(index)

    def land_parameters(self, params: Iterable[Tensor]) -> None:
        """Land the pending buckets that hold any of `params` (a module's, or the task's own read outside a forward)."""
        if not (self.pending and self.ready()):
            return
        for param in params:
            for index in self.buckets_of(param):
                if index in self.pending:
                    self.land(index)

    def forget(self) -> None:
        """Drop every pending bucket unlanded (a failed stage: its collectives may never complete)."""
        self.pending.clear()

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.land_parameters(module.parameters(recurse=False))
