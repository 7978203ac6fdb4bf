"""What the strategies that average *models* instead of gradients share (local SGD, D-PSGD, async averaging).

Post-local SGD (Lin et al., ICLR 2020), decentralized SGD (Lian et al., NeurIPS 2017) and BAGUA's
asynchronous model averaging (Gan et al., VLDB 2022) all run the same loop:

    for each optimizer step t:
        if t < warmup_steps:  g = allreduce_mean(local gradient)     # exact data parallel (the Reducer)
        else:                 g = local gradient                     # no gradient communication
        x = optimizer.step(x, g)
        if t >= warmup_steps: x = average(x, with whom and when the strategy says)

`ModelAveraging` is that loop on top of `BucketedDDP` (whose reducer does the warm-up's exact
all-reduce); a subclass only says how it averages (`average_after_step`). The replicas differ between
averagings, so `replicas_differ` is True and every rank's parameters and optimizer state go into
checkpoints. The optimizer state (momentum, Adam's moments) is never averaged: it stays each rank's own,
as in torch's `PostLocalSGDOptimizer`, which averages parameters alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from syncline.options import check_int
from syncline.strategies.bucketed_ddp import BucketedDDP
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.events import collective_span
from syncline.strategies.comm.flat import flatten_by_dtype, unflatten_into

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["ModelAveraging", "average_parameters"]


def average_parameters(params: list[Tensor], group: Any = None, counter: CommCounter | None = None) -> None:
    """Replace `params` by their mean over the ranks of `group`: one coalesced all-reduce per dtype.

    As torch's `average_parameters`, the flat copy is divided before the sum, so low precision cannot
    overflow.
    """
    size = dist.get_world_size(group)
    for tensors, flat in flatten_by_dtype(params):
        flat /= size
        # Collective: one flat all-reduce of every parameter of this dtype.
        dist.all_reduce(flat, group=group)
        if counter is not None:
            counter.add(flat.numel() * flat.element_size())
        unflatten_into(tensors, flat)


class ModelAveraging(BucketedDDP):
    """Exact data parallel for `warmup_steps` optimizer steps, then local steps and model averaging.

    Args:
        warmup_steps: optimizer steps of exact gradient all-reduce before the first local step.
        kwargs: passed to `BucketedDDP` (the warm-up's reducer): `bucket_cap_mb`, `backend`, `timeout`, ...
    """

    supports_join = False  # a joined rank has no parameters of its own to average
    autotune_refusal = "its buckets all-reduce gradients only during the warm-up (warmup_steps, 0 by default)"

    #: Replicas hold different parameters between averagings: checkpoints keep every rank's, and its
    #: optimizer state. Resuming on another number of processes is refused (`load_state_from_other_world`).
    replicas_differ = True

    def __init__(self, warmup_steps: int = 0, **kwargs: Any) -> None:
        check_int(type(self).__name__, "warmup_steps", warmup_steps, 0, meaning="optimizer steps of exact all-reduce")
        super().__init__(**kwargs)
        self.warmup_steps = warmup_steps
        #: Optimizer steps taken since setup (restored from checkpoints).
        self.steps = 0
        self._params: list[Tensor] = []

    @property
    def local(self) -> bool:
        """Whether the coming optimizer step is a local one (the warm-up is over)."""
        return self.steps >= self.warmup_steps

    # --------------------------------------------------------------- lifecycle
    def setup(self, task: Task) -> None:
        """Set up the warm-up's reducer (rank 0's weights on every rank) and remember what to average."""
        super().setup(task)
        self._params = [p for p in task.parameters() if p.requires_grad]
        # A new run; a resumed one gets its counters back from `load_state_dict` after this.
        self.steps = 0
        self.comm_counter.reset()

    # -------------------------------------------------------------- train step
    def backward(self, loss: Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Back-propagate; all-reduce gradients only at the end of a window during the warm-up."""
        super().backward(loss, sync=sync and not self.local, retain_graph=retain_graph)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> None:
        """Step on this rank's gradients, then let the strategy average the models."""
        step()
        self.steps += 1
        if self.steps > self.warmup_steps:
            with collective_span(self.comm_events, "model averaging"):
                self.average_after_step(self.steps - self.warmup_steps)
        self.comm_counter.close_step()

    def average_after_step(self, local_step: int) -> None:
        """Average parameters after local step number `local_step` (1, 2, ...) as the algorithm says."""
        raise NotImplementedError

    def _check_before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # After the warm-up, stepping on unaveraged gradients is the algorithm.
        if not self.local:
            super()._check_before_step(optimizer, args, kwargs)

    # -------------------------------------------------------------- reporting
    def communication_stats(self) -> dict[str, float]:
        """`comm/bytes` of the last optimizer step and `comm/total_bytes` since setup."""
        return self.comm_counter.as_dict()

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return this rank's part of the strategy's state (the trainer gathers every rank's)."""
        return {"steps": self.steps, "bytes": self.comm_counter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.steps = int(state["steps"])
        self.comm_counter.load_state_dict(state["bytes"])
