"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al., NeurIPS 2019), as a comm hook.

Each synchronized step, for each bucket, on every rank:

    if step < start_iter:      all-reduce the whole bucket (exact averaging while gradients change fast)
    vectors, and matrices where rank-r factors do not save `min_compression_rate` times the bytes:
                               all-reduce them exactly, in one flat tensor
    every other gradient, as an n x m matrix M (dims after the first flattened):
        M = M + E                             error feedback: add what the last step dropped
        P = M Q                               Q: m x r, the last step's (warm start) or fresh random
        P = mean over ranks of P              all-reduce (all matrices' P in one flat tensor)
        P = orthogonalize(P)
        Q = mean over ranks of Mᵀ P           all-reduce (all matrices' Q in one flat tensor)
        M_avg ≈ P Qᵀ;  E = M - P Qᵀ

Which gradients are compressed depends on their shapes and the stage only, never on values or timing,
so every rank launches collectives of the same sizes in the same order. (torch's PowerSGD hook was seen
to die of a collective-size mismatch on gloo; nothing here can disagree across ranks.) The two stages,
exact and low rank, follow the core's step counter. Random initial factors come from a generator seeded
alike on every rank and kept in the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from syncline.options import check_int, check_number
from syncline.strategies.comm.compression import ErrorFeedback
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.flat import flatten, unflatten
from syncline.strategies.comm.hooks import GradBucket
from syncline.strategies.comm.transfers import all_reduce
from syncline.strategies.reducer_strategy import ReducerStrategy

__all__ = ["PowerSGD", "PowerSGDState", "powersgd_hook"]

_SEED = 0


@dataclass
class PowerSGDState:
    """What `powersgd_hook` needs, and what it carries from step to step.

    Attributes:
        rank: the rank r of the factors.
        min_compression_rate: compress an n x m matrix only if ``n m >= rate * r (n + m)``.
        warm_start: reuse each matrix's last Q instead of a fresh random one.
        error_feedback: what compression dropped, per parameter name; None sends without.
        process_group: the group to average over; None means the default group.
        low_rank: whether the exact start (`start_iter` steps) is over; set by the strategy's stage.
        factors: the last Q of each compressed matrix, by parameter name (warm start).
        generator: the source of fresh random factors, seeded alike on every rank.
        counter: where the bytes handed to collectives are counted (set by the reducer).
    """

    rank: int = 4
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: ErrorFeedback | None = None
    process_group: dist.ProcessGroup | None = None
    low_rank: bool = False
    factors: dict[str, Tensor] = field(default_factory=dict)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(_SEED))
    counter: CommCounter | None = None

    def compresses(self, shape: torch.Size) -> bool:
        """Whether a gradient of `shape` is sent as low-rank factors this step (shapes and stage only)."""
        if not self.low_rank or len(shape) < 2:
            return False
        n, m = shape[0], shape.numel() // shape[0]
        rank = min(self.rank, n, m)
        return n * m >= self.min_compression_rate * rank * (n + m)


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> Future[Tensor]:
    """Average the bucket across the group: exactly for vectors, as rank-r factors for matrices.

    Returns:
        A completed future whose value is `bucket.buffer`, holding the (approximate) average.
    """
    buffer = bucket.buffer
    spans = [(name, p.shape, start, end) for (name, start, end), p in zip(bucket.spans(), bucket.parameters)]
    exact = [span for span in spans if not state.compresses(span[1])]
    low_rank = [span for span in spans if state.compresses(span[1])]

    if exact:
        pieces = [buffer[start:end] for _, _, start, end in exact]
        # Collective: exact all-reduce of the vectors and the matrices not worth compressing.
        for piece, average in zip(pieces, _all_reduce_mean(pieces, state)):
            piece.copy_(average)

    if low_rank:
        matrices = [_corrected_matrix(state, buffer, span) for span in low_rank]
        factors = [_initial_factor(state, name, matrix) for (name, *_), matrix in zip(low_rank, matrices)]
        ps = _all_reduce_mean([m @ q for m, q in zip(matrices, factors)], state)
        ps = [torch.linalg.qr(p, mode="reduced").Q for p in ps]
        qs = _all_reduce_mean([m.T @ p for m, p in zip(matrices, ps)], state)
        for (name, _, start, end), matrix, p, q in zip(low_rank, matrices, ps, qs):
            approximation = p @ q.T
            if state.error_feedback is not None:
                state.error_feedback.remember(name, matrix, approximation)
            if state.warm_start:
                # An overflowed step (skipped by fp16's loss scaler) leaves Q inf or NaN, alike on every
                # rank; zeros instead restart the power iteration from QR(0) = the first unit vectors.
                state.factors[name] = q.nan_to_num(0.0, 0.0, 0.0)
            buffer[start:end] = approximation.reshape(-1).to(buffer.dtype)

    future: Future[Tensor] = Future()
    future.set_result(buffer)
    return future


def _corrected_matrix(state: PowerSGDState, buffer: Tensor, span: tuple[str, torch.Size, int, int]) -> Tensor:
    """Return the gradient of `span` as an n x m float32 matrix, plus its error-feedback memory."""
    name, shape, start, end = span
    matrix = buffer[start:end].float().reshape(shape[0], -1)
    return matrix if state.error_feedback is None else state.error_feedback.compensate(name, matrix)


def _initial_factor(state: PowerSGDState, name: str, matrix: Tensor) -> Tensor:
    """Return Q for `matrix`: the last step's with warm start, else fresh from the shared generator."""
    rank = min(state.rank, *matrix.shape)
    held = state.factors.get(name)
    if held is not None and held.shape == (matrix.shape[1], rank):
        return held
    fresh = torch.randn(matrix.shape[1], rank, generator=state.generator)
    return fresh.to(matrix.device)


def _all_reduce_mean(tensors: list[Tensor], state: PowerSGDState) -> list[Tensor]:
    """Average `tensors` across the group with one all-reduce of their concatenation."""
    flat = flatten(tensors).div_(dist.get_world_size(state.process_group))
    # Collective: one all-reduce of every tensor (the exact gradients, or every matrix's P or Q) of this bucket.
    all_reduce(flat, state.counter, group=state.process_group)
    return unflatten(flat, tensors)


class PowerSGD(ReducerStrategy):
    """Average gradients as rank-`rank` factors per matrix (PowerSGD), exactly for vectors.

    Args:
        rank: the rank of the factors P (n x rank) and Q (m x rank) of each n x m gradient.
        start_iter: synchronized steps of exact all-reduce before compression starts.
        error_feedback: carry what compression dropped into the next step, per rank and parameter.
        warm_start: start each step's power iteration from the last step's Q.
        min_compression_rate: compress a matrix only where the factors are this many times smaller.
        bucket_cap_mb: the most MiB of gradients per bucket.
        find_unused_parameters: as in `BucketedDDP`.
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.

    Raises:
        ValueError: `rank` < 1, `start_iter` < 0 or `min_compression_rate` not positive.
    """

    name = "powersgd"
    manual_optimization_refused = (
        "its error feedback and warm-started factors assume one synchronized backward per optimizer step"
    )
    blocking_hook = True
    stages = ("exact", "low rank")

    def __init__(
        self,
        rank: int = 4,
        start_iter: int = 10,
        error_feedback: bool = True,
        warm_start: bool = True,
        min_compression_rate: float = 2.0,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        backend: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        check_int("PowerSGD", "rank", rank, 1, meaning="the rank of the low-rank factors (1 sends the least)")
        check_int("PowerSGD", "start_iter", start_iter, 0, meaning="steps of exact all-reduce first")
        check_number(
            "PowerSGD", "min_compression_rate", min_compression_rate, above=0, meaning="how many times smaller"
        )
        state = PowerSGDState(
            rank=rank,
            min_compression_rate=min_compression_rate,
            warm_start=warm_start,
            error_feedback=ErrorFeedback() if error_feedback else None,
        )
        super().__init__(
            bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            comm_hook=powersgd_hook,
            comm_state=state,
            backend=backend,
            timeout=timeout,
        )
        self.rank, self.start_iter = rank, start_iter
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self.min_compression_rate = min_compression_rate

    def stage(self) -> int:
        """0 for the first `start_iter` steps (exact all-reduce), then 1 (low rank)."""
        return int(self.steps >= self.start_iter)

    def stage_changed(self) -> None:
        """Tell the hook whether to send low-rank factors."""
        self.comm_state.low_rank = self.stage() == 1

    def algorithm_state_dict(self) -> dict[str, Any]:
        """Return this rank's error feedback, warm-start factors and generator state."""
        state: PowerSGDState = self.comm_state
        return {
            "error_feedback": {} if state.error_feedback is None else state.error_feedback.state_dict(),
            "factors": {name: q.clone() for name, q in state.factors.items()},
            "generator": state.generator.get_state(),
        }

    def load_algorithm_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore this rank's part of the state."""
        state: PowerSGDState = self.comm_state
        if state.error_feedback is not None:
            state.error_feedback.load_state_dict(saved["error_feedback"])
        state.factors = {name: q.clone() for name, q in saved["factors"].items()}
        state.generator.set_state(saved["generator"])

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, error_feedback={self.error_feedback}, "
            f"warm_start={self.warm_start}, min_compression_rate={self.min_compression_rate})"
        )
