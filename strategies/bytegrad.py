"""ByteGrad: BAGUA's centralized 8-bit gradient compression (Gan et al., VLDB 2022), as a comm hook.

For each bucket of gradients, on every one of the `W` ranks:

1. add back what the last compression dropped (error feedback, per parameter),
2. split the bucket into `W` chunks and MinMax-quantize each to uint8 (`comm.compression.minmax_quantize`),
3. scatter: send chunk `j` to rank `j` with one all-to-all (the own chunk stays home),
4. reduce: decompress the `W` versions of the own chunk and average them,
5. re-quantize the averaged own chunk and all-gather every rank's averaged chunk,
6. decompress: every rank now holds the same averaged bucket.

Steps 2-6 are `comm.compression.compressed_average`, which QAdam uses for its momentum too. A rank hands
about ``(W-1)/W + 1/W = 1`` byte per gradient value to collectives, against 4 for a float32 all-reduce.
The hook plugs into the core's reducer, so buckets, accumulation without communication and
`find_unused_parameters` are the reducer's; `ByteGrad` only fixes the bucket layout (chunking depends on
it, and a resumed run must chunk as the original did).

Steps 1-6 are a chain of blocking exchanges. Run inside the autograd hook they would hold the backward
until the bucket is averaged; the hook hands them to a communication thread instead (`comm/comm_thread.py`,
on process groups of its own, one bucket after another in launch order, as BAGUA's backend does), so
autograd computes the next buckets' gradients while this one is on the wire. When the thread falls behind,
it posts the next bucket's scatter before averaging and gathering this one (`CommThread.submit_staged`),
so the link does not idle while the CPU decodes. Each bucket computes what it computed alone: the result is
the blocking hook's to the bit (`comm_thread=False` runs it inside the hook, to compare).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.strategies.comm.comm_thread import CommThread
from syncline.strategies.comm.compression import ErrorFeedback, Scatter, finish_average, start_scatter
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.hooks import GradBucket
from syncline.strategies.reducer_strategy import ReducerStrategy

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["ByteGrad", "ByteGradState", "bytegrad_hook"]


@dataclass
class ByteGradState:
    """What `bytegrad_hook` needs.

    Attributes:
        process_group: the group to average over; None means the default group.
        error_feedback: the memory of what compression dropped, per parameter name; None sends without.
        counter: where the bytes handed to collectives are counted (set by the reducer).
        comm_thread: where the exchange runs, on the thread's own group; None runs it inside the hook.
    """

    process_group: dist.ProcessGroup | None = None
    error_feedback: ErrorFeedback | None = None
    counter: CommCounter | None = None
    comm_thread: CommThread | None = None


def bytegrad_hook(state: ByteGradState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket across the group, communicating it as 8-bit chunks (BAGUA's ByteGrad).

    Returns:
        A future whose value is `bucket.buffer`, holding the average: completed by the communication thread
        (`state.comm_thread`), or already completed when the exchange ran inside the hook.
    """
    thread = state.comm_thread
    if thread is not None:
        scatter_group, gather_group = thread.groups
        # Collectives (on the thread, its own groups): the exchange below, after the earlier buckets'; the next
        # bucket's scatter may go out while this one is averaged and gathered.
        return thread.submit_staged(
            _start_bucket, lambda started: _finish_bucket(state, bucket, started, gather_group), state, bucket,
            scatter_group,
        )  # fmt: skip
    future: Future[Tensor] = Future()
    group = state.process_group
    future.set_result(_finish_bucket(state, bucket, _start_bucket(state, bucket, group), group))
    return future


def _start_bucket(state: ByteGradState, bucket: GradBucket, group: dist.ProcessGroup | None) -> Scatter:
    """Steps 1-3 for one bucket over `group`: error feedback, quantize, post the scatter."""
    buffer = bucket.buffer
    feedback = state.error_feedback
    if feedback is None:
        corrected = buffer
    else:
        # Error feedback keyed by parameter name: each gradient plus what its last compression dropped.
        corrected = torch.empty_like(buffer)
        for name, start, end in bucket.spans():
            feedback.compensate_into(name, buffer[start:end], corrected[start:end])
    # Collective (posted, not waited for): the 8-bit all-to-all of the bucket's chunks.
    return start_scatter(corrected, group, state.counter)


def _finish_bucket(
    state: ByteGradState, bucket: GradBucket, scatter: Scatter, group: dist.ProcessGroup | None
) -> Tensor:
    """Steps 4-6 after `_start_bucket`, the all-gather over `group`; return `bucket.buffer`, holding the average."""
    # Collectives (inside, blocking this thread): the scatter's completion, then the 8-bit all-gather.
    average, sent = finish_average(scatter, group, state.counter)
    feedback = state.error_feedback
    if feedback is not None:
        for name, start, end in bucket.spans():
            feedback.remember(name, scatter.values[start:end], sent[start:end])
    bucket.buffer.copy_(average)
    return bucket.buffer


class ByteGrad(ReducerStrategy):
    """Average gradients with BAGUA's 8-bit scatter-reduce and all-gather, bucket by bucket.

    Args:
        bucket_cap_mb: the most MiB of gradients per bucket (one compressed scatter-reduce each).
        error_feedback: carry what quantization drops into the next step, per rank and parameter.
        find_unused_parameters: as in `BucketedDDP`.
        comm_thread: run each bucket's exchange on a communication thread, so the backward goes on while it is
            on the wire; False runs it inside the autograd hook, blocking the backward (the same result).
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.

    Error-feedback memories differ per rank and are part of `state_dict`; they are keyed by parameter
    name, so a checkpoint resumes with the same number of processes only (each rank takes its own).
    """

    name = "bytegrad"
    manual_optimization_refused = (
        "its error feedback carries each bucket's quantization error from one synchronized backward per "
        "optimizer step to the next"
    )
    # Every bucket gets the cap, a joined rank's zero bucket would still carry its error feedback: the core's
    # settings for a hook that compresses whole buckets.
    blocking_hook = True
    # Chunks follow the bucket layout: keep the layout of construction so a resumed run chunks alike.
    fixed_layout = True

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        error_feedback: bool = True,
        find_unused_parameters: bool = False,
        comm_thread: bool = True,
        backend: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        state = ByteGradState(error_feedback=ErrorFeedback() if error_feedback else None)
        super().__init__(
            bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            comm_hook=bytegrad_hook,
            comm_state=state,
            backend=backend,
            timeout=timeout,
        )
        self.error_feedback = error_feedback
        self.comm_thread = comm_thread

    def after_setup(self, task: Task) -> None:
        """Start the communication thread and its group (with `comm_thread`, on several processes)."""
        if self.comm_thread and self.world_size > 1 and self.comm_state.comm_thread is None:
            # Two groups: the scatters on one, the gathers on the other (`CommThread.submit_staged`).
            self.comm_state.comm_thread = CommThread("syncline-bytegrad", self.timeout, groups=2)

    def teardown(self) -> None:
        """Stop the communication thread (idle: the last backward waited for every bucket), then the core's."""
        thread, self.comm_state.comm_thread = self.comm_state.comm_thread, None
        if thread is not None:
            thread.close()
        super().teardown()

    def algorithm_state_dict(self) -> dict[str, Any]:
        """Return this rank's error-feedback memory."""
        feedback = self.comm_state.error_feedback
        return {"error_feedback": {} if feedback is None else feedback.state_dict()}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's error-feedback memory."""
        if self.comm_state.error_feedback is not None:
            self.comm_state.error_feedback.load_state_dict(state["error_feedback"])

    def __repr__(self) -> str:
        return (
            f"ByteGrad(bucket_cap_mb={self.bucket_cap_mb}, error_feedback={self.error_feedback}, "
            f"comm_thread={self.comm_thread})"
        )
