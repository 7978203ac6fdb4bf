"""What the strategies that average *models* instead of gradients share (local SGD, D-PSGD, async averaging).

Post-local SGD (Lin et al., ICLR 2020), decentralized SGD (Lian et al., NeurIPS 2017) and BAGUA's
asynchronous model averaging (Gan et al., VLDB 2022) all run the same loop:

    for each optimizer step t:
        if t < warmup_steps:  g = allreduce_mean(local gradient)     # exact data parallel (the Reducer)
        else:                 g = local gradient                     # no gradient communication
        x = optimizer.step(x, g)
        if t >= warmup_steps: x = average(x, with whom and when the strategy says)

`ModelAveraging` is that loop on the core (`reducer_strategy.py`), whose reducer does the warm-up's exact
all-reduce: two stages, the warm-up and local steps, and the averaging after each local step; a subclass
only says how it averages (`average_after_step`). The replicas differ between averagings, so
`replicas_differ` is True and every rank's parameters and optimizer state go into checkpoints. The
optimizer state (momentum, Adam's moments) is never averaged: it stays each rank's own, as in torch's
`PostLocalSGDOptimizer`, which averages parameters alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor

from syncline.options import check_int
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.events import collective_span
from syncline.strategies.comm.flat import flatten_by_dtype, unflatten_into
from syncline.strategies.comm.transfers import all_reduce
from syncline.strategies.reducer_strategy import ReducerStrategy

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
        all_reduce(flat, counter, group=group)
        unflatten_into(tensors, flat)


class ModelAveraging(ReducerStrategy):
    """Exact data parallel for `warmup_steps` optimizer steps, then local steps and model averaging.

    Args:
        warmup_steps: optimizer steps of exact gradient all-reduce before the first local step.
        kwargs: passed to the core (the warm-up's reducer): `bucket_cap_mb`, `backend`, `timeout`, ...
    """

    supports_join = False  # a joined rank has no parameters of its own to average
    stages = ("warm-up", "local steps")
    fixed_cap_because = "its buckets all-reduce gradients only during the warm-up (warmup_steps, 0 by default)"
    manual_optimization_refused = (
        "it averages models after each optimizer step and stops averaging gradients after its warm-up, "
        "counting one optimizer step per batch"
    )

    #: Replicas hold different parameters between averagings: checkpoints keep every rank's, and its
    #: optimizer state. Resuming on another number of processes is refused (`load_state_from_other_world`).
    replicas_differ = True

    def __init__(self, warmup_steps: int = 0, **kwargs: Any) -> None:
        check_int(type(self).__name__, "warmup_steps", warmup_steps, 0, meaning="optimizer steps of exact all-reduce")
        super().__init__(**kwargs)
        self.warmup_steps = warmup_steps
        self._params: list[Tensor] = []

    @property
    def local(self) -> bool:
        """Whether the coming optimizer step is a local one (the warm-up is over)."""
        return self.steps >= self.warmup_steps

    def stage(self) -> int:
        """0 during the warm-up, then 1 (local steps and averaging)."""
        return int(self.local)

    def syncs_gradients(self) -> bool:
        """All-reduce gradients at the end of a window during the warm-up only."""
        return not self.local

    def after_setup(self, task: Task) -> None:
        """Remember what to average; a new run counts from zero (a resumed one gets its counters back)."""
        self._params = [p for p in task.parameters() if p.requires_grad]
        self.steps = 0
        self.comm_counter.reset()

    def after_optimizer_step(self) -> None:
        """After a local step, let the strategy average the models."""
        if self.steps > self.warmup_steps:
            with collective_span(self.comm_events, "model averaging"):
                self.average_after_step(self.steps - self.warmup_steps)

    def average_after_step(self, local_step: int) -> None:
        """Average parameters after local step number `local_step` (1, 2, ...) as the algorithm says."""
        raise NotImplementedError

    def communication_stats(self) -> dict[str, float]:
        """`comm/bytes` of the last optimizer step and `comm/total_bytes` since setup."""
        return self.comm_counter.as_dict()

    def algorithm_state_dict(self) -> dict[str, Any]:
        """The byte counters (the trainer gathers every rank's state)."""
        return {"bytes": self.comm_counter.state_dict()}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `algorithm_state_dict` returned."""
        self.comm_counter.load_state_dict(state["bytes"])

    def heal_from(self, state: dict[str, Any], *, replacement: bool) -> None:
        """Take the healing member's step count: the schedule of averagings follows the loop position it gave."""
        self.steps = int(state["steps"])
        self._enter_stage()
