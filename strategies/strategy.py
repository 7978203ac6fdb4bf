"""The interface between the training loop and everything that synchronizes processes.

The Trainer talks to exactly one `Strategy`. It asks it to set up the process group, to prepare the
task (move it, hook it, wrap it), to run the training forward, to run a backward that does or does not
synchronize gradients, to take the optimizer step, to reduce metrics, and whether this process may write
files. Everything else a strategy knows stays inside it, so that bucketed all-reduce, compression, local
SGD or a parameter server can replace one another without the loop noticing.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from syncline.options import check_arguments
from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.comm.events import CommEvents

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["ReduceOp", "Strategy", "call_training_step", "move_to_device", "replace_step", "training_step_of"]

ReduceOp = Literal["mean", "sum", "max", "min"]


class Strategy(ABC):
    """Base class of every gradient-synchronization strategy.

    Subclasses implement the collectives; the defaults here are those of a single process, so a
    strategy only overrides what it changes.
    """

    #: Name under which the strategy is registered for Hydra (`strategy=<name>`).
    name: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check every constructor argument against its annotation (`check_arguments`) before it runs."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _checked(cls.__dict__["__init__"])  # type: ignore[method-assign]

    #: Whether the backward after the next `training_step` synchronizes gradients. The loop sets it
    #: before each forward, because some strategies (torch's DDP) decide in the forward.
    sync_next_backward: bool = True

    #: Whether the strategy runs as several processes (and so can take `devices > 1`).
    multi_process: bool = False

    #: Whether replicas may hold different parameters and optimizer states between synchronizations
    #: (local SGD in the middle of a period, decentralized or asynchronous averaging). Checkpoints then
    #: keep every rank's weights and optimizer state, and each rank resumes from its own.
    replicas_differ: bool = False

    #: Why this strategy cannot train a task that steps its own optimizers (Lightning's manual optimization), or
    #: "" when it can: such a task runs several backwards per batch, each synchronizing, and steps several
    #: optimizers, which only strategies that average every backward's gradients exactly can follow.
    manual_optimization_refused: str = ""

    #: Why `Trainer(recovery="live")` is refused with this strategy ("" when it is supported): the survivors of a
    #: death must rebuild its state on a smaller group and hand it to a replacement.
    live_recovery_refused: str = "its state has not been taught to move to a smaller group or to a replacement"

    #: Whether the task being trained steps its own optimizers: every backward synchronizes, and it may run
    #: inside `training_step` (the Trainer sets it before a fit, and before launching workers).
    manual_optimization: bool = False

    #: The task's `backward` hook (Lightning's ``LightningModule.backward``), which `backward` runs autograd
    #: through once the Trainer set it for a fit; None runs ``loss.backward()``.
    backward_hook: Callable[..., None] | None = None

    #: Where the strategy reports its communication while a `CommunicationTimeline` records a step
    #: (`strategies/comm/events.py`); None, the default, records nothing.
    comm_events: CommEvents | None = None

    # ---------------------------------------------------------------- identity
    @functools.cached_property
    def comm_counter(self) -> CommCounter:
        """The counter of bytes this strategy hands to collectives (`comm/bytes`, `comm/total_bytes`).

        Made on first use and kept in the instance, so every later read (one per step) is a plain attribute.
        """
        return CommCounter()

    @property
    def global_rank(self) -> int:
        """Rank of this process among all processes."""
        return 0

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of processes taking part in training."""
        return 1

    @property
    def is_global_zero(self) -> bool:
        """Whether this process writes files, logs and progress output."""
        return self.global_rank == 0

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """Device this process computes on."""

    def use_accelerator(self, device_type: str) -> None:
        """Compute on `device_type` ("cpu" or "cuda"), as `Trainer(accelerator=...)` asks.

        Raises:
            ValueError: the strategy was configured for another kind of device.
        """
        if self.root_device.type != device_type:
            raise ValueError(
                f"{self!r} computes on {self.root_device}, but the Trainer's accelerator asks for {device_type}; "
                "make the two agree (or pass accelerator='auto')."
            )

    # --------------------------------------------------------------- lifecycle
    def check_world_size(self, world_size: int) -> None:
        """Raise `OptionError` if this strategy's options cannot work on `world_size` processes.

        The launcher calls it before starting any process, and `setup` on the real group, so that a bad
        option is one clear error rather than a failure inside every worker.
        """

    def setup_environment(self) -> None:
        """Join the process group, if there is one. Called once before anything else."""

    def setup(self, task: Task) -> None:
        """Move the task to the device and install whatever gradient synchronization needs."""
        task.to(self.root_device)

    def teardown(self) -> None:
        """Undo `setup` and `setup_environment`: remove hooks, leave the process group."""

    def on_stage_failure(self) -> None:
        """Called on a rank whose stage raised: the other ranks may be blocked waiting for it."""

    # ----------------------------------------------------------- live recovery
    def on_peer_lost(self) -> None:
        """Under ``recovery="live"``, on a survivor whose collective lost a peer, before its state is taken and the
        strategy is torn down and set up on the new group: keep the work in flight that completed here, drop what
        cannot complete. It must not wait long for a collective (its peer is gone). The default has nothing in
        flight outside the step that failed."""

    def heal_from(self, state: dict[str, Any], *, replacement: bool) -> None:
        """Under ``recovery="live"``, on every member but the one the group heals from, after healing loaded the
        state: adopt from `state` (that member's `state_dict()`) what every member must hold alike.

        Where replicas may differ (`replicas_differ`), a survivor kept its own state, and a `replacement` has loaded
        all of `state`, that member's replica included, and may start a replica of its own here. The default does
        nothing: an exact strategy's members loaded the whole state already.
        """

    # -------------------------------------------------------------- train step
    def training_step(self, task: Task, batch: Any, batch_idx: int) -> Any:
        """Run the task's forward for one micro-batch and return what `training_step` returned."""
        return call_training_step(task, batch, batch_idx)

    def backward(self, loss: Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Back-propagate `loss`; synchronize gradients across processes only when `sync` is true.

        The loop passes `sync=False` for every micro-batch but the last of an accumulation window.
        When this returns with `sync=True`, gradients are ready for clipping and the optimizer.
        `retain_graph` keeps the graph for another backward, as in `Tensor.backward`.
        """
        self._autograd_backward(loss, retain_graph)

    def _autograd_backward(self, loss: Tensor, retain_graph: bool) -> None:
        """Back-propagate `loss` through the task's `backward` hook if the Trainer set it, else autograd's."""
        if self.backward_hook is None:
            loss.backward(retain_graph=retain_graph)
        elif retain_graph:
            self.backward_hook(loss, retain_graph=True)
        else:
            self.backward_hook(loss)  # a hook overridden as Lightning documents it: backward(self, loss)

    def clip_gradients(self, parameters: list[Tensor], max_norm: float, algorithm: str = "norm") -> Tensor:
        """Clip the gradients' global 2-norm to `max_norm` and return the norm before clipping; with
        `algorithm` "value", clamp every gradient element to [-max_norm, max_norm] (and return 0).

        A sharded strategy overrides this, since no single process sees every gradient.
        """
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(parameters, max_norm)
            return torch.zeros((), device=self.root_device)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Adopt the task's optimizer once it exists, before any step or restore (a sharded strategy shards it)."""

    def optimizer_parameters(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """Return the task's parameters that `optimizer` updates, whole (a sharded strategy's optimizer holds
        slices of them): what `toggle_optimizer` freezes and a manual `clip_gradients` clips."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> None:
        """Take one optimizer step by calling `step` (which applies precision scaling).

        Strategies that average models after the step (local SGD) or replace the step (a parameter
        server) override this, and close the step's byte count as this does.
        """
        step()
        self.comm_counter.close_step()

    def apply_pending_updates(self) -> None:
        """Finish an optimizer step still in flight: the parameters and optimizer state become every step's.

        The loop calls it before validation, before a checkpoint and at the end of a fit. Only a strategy that
        defers its updates into the next forward (`BucketedDDP(deferred_update=True)`) has anything to do.
        """

    def check_fit_options(self, *, gradient_clip_val: float | None, precision: str) -> None:
        """Raise `OptionError` if the Trainer's options cannot follow this strategy's step (before any launch)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Reset gradients after an optimizer step."""
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def restore_gradients(self, parameters: list[Tensor], grads: list[Tensor | None]) -> None:
        """Give `parameters` the gradients a checkpoint kept (an open accumulation window's; None: none kept)."""
        for param, grad in zip(parameters, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.to(param.device)
            else:
                # In place: a strategy's gradients may be views into its communication buffers.
                param.grad.copy_(grad)

    # ------------------------------------------------------------- collectives
    def reduce(self, tensor: Tensor, op: ReduceOp = "mean") -> Tensor:
        """Reduce `tensor` across processes; every process gets the result."""
        return tensor

    def reduce_async(self, tensor: Tensor, op: ReduceOp = "max") -> Callable[[], Tensor]:
        """Start reducing `tensor` across processes; return a function that waits for and returns the result.

        `tensor` itself receives the result; do not use it before calling the function.
        """
        return lambda: tensor

    def any_rank_found_inf(self, found_inf: Tensor) -> Tensor:
        """Return 1 if any rank's fp16 gradients had an inf or NaN, else 0: the loss scaler's agreed verdict.

        `found_inf` is this rank's one-element float flag, as `GradScaler.unscale_` left it. With the
        agreed flag every rank skips the step, or takes it, and moves its scale alike. The default is
        one all-reduce (max) of the flag on the default group (nothing with one process); a strategy
        that cannot run a collective there at that moment overrides it.
        """
        return self.reduce(found_inf, "max")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every process, in rank order."""
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank `src`'s `obj` on every process."""
        return obj

    def barrier(self) -> None:
        """Wait until every process reaches this point."""

    # -------------------------------------------------------------------- data
    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """`num_replicas` and `rank` for a `DistributedSampler`, or None when there is one process."""
        if self.world_size == 1:
            return None
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def batch_to_device(self, batch: Any) -> Any:
        """Move every tensor in `batch` to the root device."""
        device = self.root_device
        if device.type == "cpu":
            # DataLoaders produce CPU tensors: skip walking the batch on the hot path.
            return batch
        return move_to_device(batch, device)

    # -------------------------------------------------------------- reporting
    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return this rank's part of the strategy's state (error feedback, warm-start factors, counters).

        Checkpoints gather every rank's part, and each rank gets its own back through `load_state_dict`,
        so a strategy whose ranks hold different state still resumes bit-exactly. Plain tensors,
        numbers, strings, lists and dicts only (checkpoints are read with ``weights_only=True``).
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's part of the state, as `state_dict` returned it (after `setup`)."""

    def load_state_from_other_world(self, states: list[dict[str, Any]]) -> None:
        """Adopt per-rank state saved on another number of processes (`states`: one entry per saved rank).

        Strategies that can merge or re-split their state override this and say in their docs how; the
        default refuses when there is any per-rank state, naming the strategy.

        Raises:
            ValueError: there is per-rank state this strategy cannot carry to another world size.
        """
        if any(states) or self.replicas_differ:
            raise ValueError(
                f"{type(self).__name__} keeps per-rank state, which cannot move from {len(states)} to "
                f"{self.world_size} processes; resume on {len(states)} processes, or start a new run from the "
                "weights (Task.load_from_checkpoint)."
            )

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Return the whole optimizer state as one ordinary `optimizer.state_dict()`, for a checkpoint.

        A collective for strategies whose optimizer state is spread over ranks (a parameter server, a
        sharded one); call it on every rank. The default is this rank's own `optimizer.state_dict()`.
        """
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore the whole optimizer state that `optimizer_state_dict` returned (each rank keeps its part)."""
        optimizer.load_state_dict(state)

    def communication_stats(self) -> dict[str, float]:
        """Counters of the last optimizer step: at least `comm/bytes` and `comm/total_bytes`."""
        return self.comm_counter.as_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@contextmanager
def replace_step(optimizer: torch.optim.Optimizer, update: Callable[[], Any]) -> Iterator[None]:
    """Make ``optimizer.step()`` run `update` instead, inside the block.

    For strategies whose update is not the optimizer's (QAdam after its warm-up): calling the step
    function the loop hands to `Strategy.optimizer_step` inside this block keeps the loss scaler's
    part (skip on overflow, scale update) around the strategy's own update.
    """
    had_own = "step" in optimizer.__dict__
    own = optimizer.__dict__.get("step")
    optimizer.step = lambda *args, **kwargs: update()  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            optimizer.step = own  # type: ignore[method-assign]
        else:
            del optimizer.step


def call_training_step(task: Any, batch: Any, batch_idx: int) -> Any:
    """Call ``task.training_step(batch, batch_idx)``, or ``(batch)`` where it takes no `batch_idx` (as Lightning)."""
    step = task.training_step
    if _takes_batch_idx(getattr(step, "__func__", step)):
        return step(batch, batch_idx)
    return step(batch)


def training_step_of(task: Any) -> Callable[[Any, int], Any]:
    """Return what `call_training_step(task, batch, batch_idx)` calls, decided once: the task's `training_step`,
    or a partial that drops `batch_idx` where it takes none. The loop binds it per fit where the strategy keeps
    the base's `training_step`, so a step pays for no signature lookup."""
    step = task.training_step
    if _takes_batch_idx(getattr(step, "__func__", step)):
        return step
    return functools.partial(_without_batch_idx, step)


def _without_batch_idx(step: Callable[[Any], Any], batch: Any, batch_idx: int) -> Any:
    return step(batch)


@functools.cache
def _takes_batch_idx(function: Callable[..., Any]) -> bool:
    parameters = list(inspect.signature(function).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "batch_idx" for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3  # self, batch, and an index under another name


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Return `batch` with every tensor inside lists, tuples, dicts and namedtuples moved to `device`.

    Copies to an accelerator do not block; copies to the CPU do, since their result is read at once."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=device.type != "cpu")
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()})
    return batch


def _checked(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a strategy's `__init__` so that its arguments' types are checked first, with one clear message."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def checked_init(self: Strategy, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        given = {name: value for name, value in bound.arguments.items() if name != "self"}
        extra = {p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD}
        for name in extra:
            given.update(given.pop(name, {}))  # a pass-through to the parent is checked by the parent too
        check_arguments(type(self).__name__, init, given)
        init(self, *args, **kwargs)

    return checked_init
