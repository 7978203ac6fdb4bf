"""What the reducer tells the user when something is wrong: the errors, messages that say where the fix goes,
and waits that end in an error instead of a hang.

Each message names the parameters involved and the change that fixes it, in code and, where the
option has one, on the command line (`strategy=bucketed_ddp strategy.<option>=...`). A wait that fails
or times out says where the ranks' collective logs diverge (`collective_log.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.collective_log import COLLECTIVES, diagnosis_wait

__all__ = [
    "CollectiveError",
    "UnusedParametersError",
    "check_thawed",
    "dense_gradient_message",
    "first_line",
    "ready_twice_message",
    "sparse_gradient_message",
    "thawed_message",
    "unsynced_message",
    "unused_message",
    "wait_for_future",
    "wait_for_work",
]


class UnusedParametersError(RuntimeError):
    """A synchronizing backward ended with parameters that never received a gradient."""


class CollectiveError(RuntimeError):
    """A bucket's collective failed or did not complete within the timeout."""


def unused_message(rank: int, missing: Sequence[tuple[str, Tensor]]) -> str:
    """Explain which parameters (name, parameter) got no gradient, why that is an error, and where the fix goes."""
    unused = [name for name, param in missing if param.requires_grad]
    frozen = [name for name, param in missing if not param.requires_grad]
    parts = [
        f"Rank {rank}: {len(unused) + len(frozen)} parameter(s) received no gradient in this backward, so "
        "their buckets could not be reduced."
    ]
    if unused:
        parts.append(f"Not used by the loss: {', '.join(unused)}.")
    if frozen:
        parts.append(f"Frozen (requires_grad=False) after the strategy was set up: {', '.join(frozen)}.")
    parts.append(
        "If the model does not use every parameter in every step, or layers are frozen during training, turn "
        "on unused-parameter detection: Trainer(strategy=BucketedDDP(find_unused_parameters=True)) in code, "
        "or `strategy=bucketed_ddp strategy.find_unused_parameters=true` on the command line. Otherwise make "
        "sure the loss depends on every parameter that requires grad."
    )
    return " ".join(parts)


def ready_twice_message(rank: int, name: str) -> str:
    """A parameter's gradient arrived twice in one synchronized backward."""
    return (
        f"Rank {rank}: parameter {name} became ready twice in one backward. Either it received a gradient "
        "although the loss's graph did not reach it (was a different tensor back-propagated than the one "
        "passed to strategy.backward?), or it took part in several backward passes (reentrant "
        "checkpointing), which the reducer does not support."
    )


def thawed_message(rank: int, names: Sequence[str]) -> str:
    """Parameters left out of the buckets at setup (frozen then) require grad now."""
    return (
        f"Rank {rank}: parameter(s) {', '.join(names)} did not require grad when the strategy was set up, so "
        "their gradients are not averaged across ranks and the replicas would drift apart. Make them require "
        "grad before the strategy is set up (before trainer.fit) and freeze layers after it instead, which "
        "find_unused_parameters=True supports, or keep them frozen."
    )


def check_thawed(rank: int, frozen_at_setup: Sequence[tuple[str, Tensor]]) -> None:
    """Raise `thawed_message` if any (name, parameter) left out of the buckets at setup requires grad now."""
    thawed = [name for name, param in frozen_at_setup if param.requires_grad]
    if thawed:
        raise RuntimeError(thawed_message(rank, thawed))


def unsynced_message(rank: int, names: Sequence[str]) -> str:
    """An optimizer is about to step on gradients a bare `loss.backward()` left unaveraged."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"Rank {rank}: the optimizer is about to step with gradients that were never averaged across ranks "
        f"({shown}): they came from a backward that the strategy did not run, so the replicas would drift "
        "apart. In a task's manual optimization, call self.manual_backward(loss) instead of loss.backward(); in "
        "a loop of your own, strategy.backward(loss, sync=True), or to accumulate locally "
        "strategy.backward(loss, sync=False) or `with strategy.no_sync():`."
    )


def sparse_gradient_message(rank: int, name: str, layout: object) -> str:
    """A parameter not declared sparse received a sparse gradient."""
    return (
        f"Rank {rank}: parameter {name} received a {layout} gradient, but only the parameters of "
        "nn.Embedding and nn.EmbeddingBag with sparse=True are reduced as sparse. Compute it with one of "
        "those modules, or with sparse=False."
    )


def dense_gradient_message(rank: int, name: str) -> str:
    """A parameter of a sparse embedding received a dense gradient."""
    return (
        f"Rank {rank}: parameter {name} belongs to a module with sparse=True but received a dense gradient "
        "(is it also used by another module, e.g. a tied output layer?). Use sparse=False for it."
    )


def wait_for_future(future: Future[Tensor], timeout: float, what: str) -> Tensor:
    """Return the value of a collective's `future`, waiting at most `timeout` seconds for it.

    Raises:
        CollectiveError: the collective `what` (e.g. "Rank 0: allreduce_hook of gradient bucket 2 of step 7
            (4096 bytes)") failed or did not complete in time, with where the ranks diverged.
    """
    if not future.done():
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        # Host sync: block until the collective has completed.
        if not done.wait(timeout):
            raise CollectiveError(
                f"{what} did not complete within {timeout:g} s; another rank is probably stuck or launched "
                "different collectives." + _diagnose(None, timeout)
            )
    try:
        # Not value(): on NCCL a future can be done once the collective is enqueued; wait() also
        # makes the current CUDA stream wait for it, so the optimizer never reads a half-reduced
        # bucket (as torch's reducer does). On CPU it returns at once.
        return future.wait()
    except RuntimeError as error:
        raise CollectiveError(f"{what} failed: {first_line(error)}." + _diagnose(error, timeout)) from error


def wait_for_work(work: dist.Work, timeout: float, what: str) -> None:
    """Wait at most `timeout` seconds for an asynchronous collective's `work`.

    Raises:
        CollectiveError: the collective `what` failed or timed out, with where the ranks diverged.
    """
    try:
        # Host sync: wait for the collective.
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        raise CollectiveError(f"{what} failed: {first_line(error)}." + _diagnose(error, timeout)) from error


def first_line(error: BaseException) -> str:
    """The first line of a collective's error (torch's and gloo's texts may go on with a C++ trace or end in a line
    break), so that the message naming the collective stays one line."""
    return next(iter(str(error).strip().splitlines()), type(error).__name__)


def _diagnose(error: BaseException | None, timeout: float) -> str:
    """Compare the ranks' collective logs for the message of `error` (None: a timeout)."""
    return COLLECTIVES.diagnose(diagnosis_wait(error, timeout))
