"""QAdam: Adam with a frozen variance and 8-bit compressed momentum (BAGUA, Gan et al., VLDB 2022).

Adam's variance estimate is sensitive to compression error; its momentum is not. BAGUA's QAdam therefore
runs in two stages:

    warm-up (step < warmup_steps):  gradients averaged exactly (the core's all-reduce), torch's Adam
    stage change at warmup_steps:   the variance v is frozen as it is (the `need_reset` of BAGUA)
    then, every optimizer step:
        m = beta1 m + (1 - beta1) (g + weight_decay p)      local gradient g, no gradient communication
                                                             (AdamW: p = p (1 - lr weight_decay) instead)
        m = compressed average of m over ranks               the reducer's buckets of momenta, each through
                                                             ByteGrad's 8-bit hook (scatter-reduce + all-gather,
                                                             error feedback per parameter)
        p = p - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

The momentum and the frozen variance live where torch's Adam keeps them (`optimizer.state[p]["exp_avg"]`,
`["exp_avg_sq"]`, `["step"]`), so the optimizer's checkpoint holds them; they are equal on every rank,
since every rank applies the same averaged momentum. What differs per rank, the error-feedback memory (keyed by
parameter name), is in this strategy's `state_dict`, beside the core's step counter.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from syncline.options import check_int
from syncline.strategies.bytegrad import ByteGradState, bytegrad_hook
from syncline.strategies.comm.compression import ErrorFeedback
from syncline.strategies.comm.events import collective_span
from syncline.strategies.reducer_strategy import ReducerStrategy
from syncline.strategies.strategy import replace_step

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["QAdam"]


class QAdam(ReducerStrategy):
    """Adam warm-up on exact gradients, then frozen variance and compressed momentum (BAGUA's QAdam).

    Args:
        warmup_steps: optimizer steps of exact gradient all-reduce and plain Adam before the variance
            is frozen and momentum compression starts.
        bucket_cap_mb: the most MiB of gradients per bucket during the warm-up.
        find_unused_parameters: as in `BucketedDDP` (during the warm-up).
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.

    Raises:
        ValueError: `warmup_steps` < 1 (the frozen variance must have seen gradients).
        TypeError: at the first step, when the task's optimizer is not `torch.optim.Adam` or its
            subclass `AdamW` (whose decoupled weight decay QAdam applies as AdamW does), or uses
            amsgrad or maximize.
    """

    supports_join = False  # after the warm-up the compressed momentum is not a gradient a joined rank could zero

    name = "qadam"
    manual_optimization_refused = "it replaces one optimizer's Adam step with its own compressed-momentum update"
    stages = ("warm-up", "compressed momentum")
    fixed_cap_because = "its buckets all-reduce gradients only during the warm-up (warmup_steps)"

    def __init__(
        self,
        warmup_steps: int = 100,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        backend: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        check_int("QAdam", "warmup_steps", warmup_steps, 1, meaning="Adam steps on exact gradients first")
        super().__init__(bucket_cap_mb, find_unused_parameters=find_unused_parameters, backend=backend, timeout=timeout)
        self.warmup_steps = warmup_steps
        self.error_feedback = ErrorFeedback()
        #: The momentum buckets' hook state: ByteGrad's, with this strategy's error feedback.
        self._momentum_state = ByteGradState(error_feedback=self.error_feedback)
        self._names: dict[int, str] = {}

    @property
    def warming_up(self) -> bool:
        """Whether the next optimizer step is a warm-up step (exact gradients, torch's Adam)."""
        return self.steps < self.warmup_steps

    def after_setup(self, task: Task) -> None:
        """Name every parameter: the error feedback of its momentum is kept under its name."""
        self._names = {id(param): name for name, param in task.named_parameters()}

    def stage(self) -> int:
        """0 during the warm-up, then 1 (frozen variance, compressed momentum)."""
        return 0 if self.warming_up else 1

    def syncs_gradients(self) -> bool:
        """Average gradients during the warm-up only (afterwards momentum is sent)."""
        return self.warming_up

    def stage_changed(self) -> None:
        """The variance freezes now; nothing compressed so far is owed."""
        self.error_feedback.reset()

    def apply_update(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Take torch's Adam step during the warm-up, then QAdam's compressed-momentum step."""
        _check_adam(optimizer)
        if self.warming_up:
            step()
        elif getattr(step, "__self__", None) is optimizer:
            # A hand-written loop passed `optimizer.step` itself: there is no loss scaler around it.
            self._momentum_step(optimizer)
        else:
            # Through `step`, so fp16's loss scaler skips the update on overflow and moves its scale.
            with replace_step(optimizer, lambda: self._momentum_step(optimizer)):
                step()

    @torch.no_grad()
    def _momentum_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Update the local momentum, average it compressed, and step with the frozen variance."""
        entries = []
        for group in optimizer.param_groups:
            beta1, _ = group["betas"]
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                state = _adam_state(optimizer, param)
                grad = torch.zeros_like(param) if param.grad is None else param.grad
                if group.get("decoupled_weight_decay"):
                    # AdamW: decay the weights themselves, as torch's AdamW does before its update.
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                elif group["weight_decay"]:
                    grad = grad.add(param, alpha=group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                entries.append((group, param, state))
        momenta = [(self._names[id(param)], state["exp_avg"]) for _, param, state in entries]
        self._split_legacy_memory(momenta)
        with collective_span(self.comm_events, "compressed momentum"):
            # Collectives (inside): per bucket of momenta, the 8-bit all-to-all and all-gather.
            self.reducer.average_tensors(momenta, bytegrad_hook, self._momentum_state)
        for group, param, state in entries:
            beta1, beta2 = group["betas"]
            state["step"] += 1
            t = float(state["step"])
            denominator = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
            param.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1**t))

    def algorithm_state_dict(self) -> dict[str, Any]:
        """Return this rank's error-feedback memory (momentum and variance are the optimizer's)."""
        return {"error_feedback": self.error_feedback.state_dict()}

    def load_algorithm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's error-feedback memory."""
        self.error_feedback.load_state_dict(state["error_feedback"])

    def _split_legacy_memory(self, momenta: list[tuple[str, Tensor]]) -> None:
        """Cut a checkpoint's one flat memory of every momentum (kept under "momentum" by checkpoints written before
        the momentum went through the buckets) into the per-parameter memories, in the optimizer's order."""
        flat = self.error_feedback.memory.pop("momentum", None)
        if flat is None:
            return
        for (name, _), piece in zip(momenta, flat.split([m.numel() for _, m in momenta])):
            self.error_feedback.memory[name] = piece.clone()  # flat, as the hook keeps a bucket's slice

    def __repr__(self) -> str:
        return f"QAdam(warmup_steps={self.warmup_steps}, bucket_cap_mb={self.bucket_cap_mb})"


def _check_adam(optimizer: torch.optim.Optimizer) -> None:
    """Refuse any optimizer but `torch.optim.Adam` (AdamW is one), whose state QAdam takes over."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(
            f"QAdam needs the task's optimizer to be torch.optim.Adam, but configure_optimizers returned "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}; return torch.optim.Adam(...) or pick "
            "another strategy (bucketed_ddp, bytegrad)."
        )
    for group in optimizer.param_groups:
        for option in ("amsgrad", "maximize"):
            if group.get(option):
                raise TypeError(f"QAdam supports torch.optim.Adam without {option}; set {option}=False.")


def _adam_state(optimizer: torch.optim.Optimizer, param: Tensor) -> dict[str, Any]:
    """Return Adam's state of `param`, created empty (zero moments) if the warm-up never stepped it."""
    state = optimizer.state[param]
    if "exp_avg" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state
