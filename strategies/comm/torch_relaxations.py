"""torch's own relaxations of DDP, for `NativeDDP(comm_hook=...)`: its PowerSGD hook and its post-local SGD.

They are the references syncline's `powersgd` and `local_sgd` are measured against in the lab's trade-off grid,
so they run at the same settings:

- ``"powersgd"``: `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook` with `PowerSGDState` of the same
  rank (4), exact start (10 iterations of plain all-reduce), error feedback, warm start and minimum compression
  rate (2) as `PowerSGD`'s defaults.
- ``"post_local_sgd"``: `post_localSGD_hook` with `PostLocalSGDState` (plain all-reduce for the warm-up, then no
  gradient communication at all: ``post_local_gradient_allreduce=False``, as syncline's local steps) and
  `PeriodicModelAverager` after every optimizer step, of the same period (4) as `LocalSGD`'s. torch's averager
  averages after steps 1, 1 + period, ... where `LocalSGD` averages after steps period, 2 period, ...

torch's hooks keep no byte counters, so each is wrapped in a hook that counts what torch's would hand to its
collectives (the same arithmetic as torch's `_should_compress`), without touching torch's communication path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.futures import Future

from syncline.strategies.comm.counter import CommCounter

__all__ = ["TORCH_HOOKS", "CountedState", "TorchRelaxation", "counted_post_local_sgd_hook", "counted_powersgd_hook"]

#: The hooks `NativeDDP(comm_hook=...)` accepts.
TORCH_HOOKS = ("powersgd", "post_local_sgd")


@dataclass
class CountedState:
    """torch's hook state, and the counter its wrapper counts into."""

    inner: Any
    counter: CommCounter


def counted_powersgd_hook(state: CountedState, bucket: dist.GradBucket) -> Future[Tensor]:
    """torch's `powerSGD_hook`, counting what it hands to its all-reduces."""
    inner: PowerSGDState = state.inner
    element = bucket.buffer().element_size()
    if inner.iter < inner.start_powerSGD_iter:
        state.counter.add(bucket.buffer().numel() * element)
    else:
        values = 0
        for gradient in bucket.gradients():
            if gradient.ndim <= 1:
                values += gradient.numel()
                continue
            rows = gradient.shape[0]
            compress, uncompressed, compressed = _should_compress(
                rows, gradient.numel() // rows, inner.matrix_approximation_rank, inner.min_compression_rate
            )
            values += compressed if compress else uncompressed
        state.counter.add(values * element)
    # Collectives (inside torch's hook): the uncompressed all-reduce, then P's and Q's.
    return powerSGD_hook(inner, bucket)


def counted_post_local_sgd_hook(state: CountedState, bucket: dist.GradBucket) -> Future[Tensor]:
    """torch's `post_localSGD_hook`, counting its all-reduces of the warm-up (afterwards it sends nothing)."""
    inner: PostLocalSGDState = state.inner
    if inner.iter < inner.start_localSGD_iter:
        state.counter.add(bucket.buffer().numel() * bucket.buffer().element_size())
    # Collective (inside torch's hook, during the warm-up): the bucket's all-reduce.
    return post_localSGD_hook(inner, bucket)


# torch's DDP reads a hook's annotations as objects, and `from __future__ import annotations` leaves strings.
for _hook in (counted_powersgd_hook, counted_post_local_sgd_hook):
    _hook.__annotations__.update(bucket=dist.GradBucket, state=CountedState, **{"return": Future[Tensor]})


class TorchRelaxation:
    """One of torch's relaxations on a `DistributedDataParallel`: its hook state, and post-local SGD's averager.

    Args:
        kind: "powersgd" or "post_local_sgd".
        counter: the strategy's byte counter.
        rank: PowerSGD's matrix approximation rank.
        start_iter: iterations of plain all-reduce first (PowerSGD's `start_powerSGD_iter`, post-local SGD's
            `start_localSGD_iter`).
        period: post-local SGD's averaging period.
    """

    def __init__(self, kind: str, counter: CommCounter, rank: int, start_iter: int, period: int) -> None:
        self.kind = kind
        self.counter = counter
        self.averager: PeriodicModelAverager | None = None
        if kind == "powersgd":
            inner: Any = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=start_iter,
                min_compression_rate=2,
                use_error_feedback=True,
                warm_start=True,
            )
        else:
            inner = PostLocalSGDState(
                process_group=None, subgroup=None, start_localSGD_iter=start_iter, post_local_gradient_allreduce=False
            )
            self.averager = PeriodicModelAverager(period=period, warmup_steps=start_iter)
        self.state = CountedState(inner, counter)

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register the counted hook on `ddp`."""
        hook = counted_powersgd_hook if self.kind == "powersgd" else counted_post_local_sgd_hook
        ddp.register_comm_hook(self.state, hook)

    def after_step(self, params: list[Tensor]) -> None:
        """Post-local SGD: let the averager average the parameters when its period says so, and count it."""
        averager = self.averager
        if averager is None:
            return
        if averager.step >= averager.warmup_steps and (averager.step - averager.warmup_steps) % averager.period == 0:
            self.counter.add(sum(p.numel() * p.element_size() for p in params))
        # Collective (every `period` steps): torch's all-reduce of the parameters.
        averager.average_parameters(params)

    def state_dict(self) -> dict[str, Any]:
        """The iteration counters (the stage, the averaging period's phase).

        Not PowerSGD's error feedback and warm-start factors: torch keys them by bucket, and a new process's DDP
        lays its buckets out anew (reverse registration order, then the observed order after its first
        iteration), so restored memories would be added to other gradients. torch's PowerSGD therefore resumes
        with fresh memories, not bit-exactly (syncline's `powersgd` keys its memories by parameter name).
        """
        state: dict[str, Any] = {"iter": self.state.inner.iter}
        if self.averager is not None:
            state["averager_step"] = self.averager.step
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.state.inner.iter = int(state["iter"])
        if self.averager is not None:
            self.averager.step = int(state["averager_step"])
