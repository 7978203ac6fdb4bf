"""torch's own `DistributedDataParallel` behind the `Strategy` interface: the reference for BucketedDDP.

torch's DDP hooks into `module.forward`, not into `training_step`, so the task is wrapped in a small
module whose `forward` is the task's `training_step`; every training forward goes through the DDP
wrapper and torch's reducer is prepared exactly as in a hand-written DDP loop.

torch's DDP decides in its forward whether the coming backward all-reduces (`no_sync` must enclose
the forward). The loop therefore announces each micro-batch's synchronization before the forward
(`BackwardSyncControl`) and repeats it to `backward`:

    strategy.sync_next_backward = sync
    output = strategy.training_step(task, batch, batch_idx)    # forward inside ddp.no_sync() if not sync
    strategy.backward(loss, sync=sync)                         # must agree with the announcement

A disagreement raises instead of silently synchronizing (or not).

torch's DDP keeps no byte counters, so `comm/bytes` is counted analytically, without touching its C++
communication path: a synchronized backward hands every dense gradient to its bucket all-reduces
(the buckets' layout does not change their total), plus, with `find_unused_parameters`, its used-parameter
bitmap (one int32 per parameter; with `static_graph` only in the first synchronized backward); a forward
that broadcasts buffers hands them to a broadcast.

Uneven inputs (`Trainer(uneven_inputs="join")`) use torch's own join protocol, the one its `Join`
context manager drives through `DistributedDataParallel.join_hook()`: the ranks with data run DDP with
its join configuration enabled (each forward all-reduces "do I sync?" and takes the buffers from the
highest rank with data), and a rank whose data ran out launches the matching collectives of the hook's
`main_hook`. The hook is called here in two halves, because syncline's loop runs its own per-step
collectives (the batch agreement, the non-finite-loss check) between the forward and the backward, where
`Join.__exit__`'s tight loop would not. Unlike torch's `Join`, the joined rank also keeps the averaged
gradients and steps on them, so every replica stays equal without a final broadcast.

`comm_hook="powersgd"` and `comm_hook="post_local_sgd"` run torch's own relaxations at syncline's settings
(`comm/torch_relaxations.py`): the references `powersgd` and `local_sgd` are measured against.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.join import _JoinConfig
from torch.nn.parallel import DistributedDataParallel

from syncline.options import OptionError, check_int, check_number, check_passthrough
from syncline.strategies.comm.autograd_graph import grad_accumulators, parameters_reached
from syncline.strategies.comm.backward_sync import BackwardSyncControl
from syncline.strategies.comm.join import Joinable
from syncline.strategies.comm.process_group import ProcessGroupStrategy
from syncline.strategies.comm.torch_relaxations import TORCH_HOOKS, TorchRelaxation
from syncline.strategies.strategy import call_training_step

if TYPE_CHECKING:
    from syncline.trainer.task import Task

__all__ = ["NativeDDP"]


class _TrainingStepModule(nn.Module):
    """Expose `task.training_step` as `forward`, which is what torch's DDP wraps."""

    def __init__(self, task: nn.Module) -> None:
        super().__init__()
        self.task = task

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return call_training_step(self.task, batch, batch_idx)


class NativeDDP(BackwardSyncControl, Joinable, ProcessGroupStrategy):
    """Average gradients with `torch.nn.parallel.DistributedDataParallel`.

    Process-group handling, identity and the metric collectives are shared with `BucketedDDP`; only
    the gradient synchronization is torch's.

    Args:
        backend: "gloo", "nccl", ...; None picks NCCL with CUDA, else gloo.
        timeout: seconds a collective may take before it fails with an error.
        comm_hook: None (torch's all-reduce), or one of torch's relaxations: "powersgd" (its PowerSGD hook) or
            "post_local_sgd" (its post-local SGD hook and `PeriodicModelAverager`).
        powersgd_rank: the matrix approximation rank of "powersgd" (syncline's `PowerSGD` default, 4).
        start_iter: iterations of plain all-reduce first; None is syncline's default for the same algorithm
            (`PowerSGD(start_iter=10)`, `LocalSGD(warmup_steps=0)`).
        averaging_period: optimizer steps between "post_local_sgd"'s averagings (`LocalSGD(period=4)`).
        **ddp_kwargs: passed to `DistributedDataParallel` (`bucket_cap_mb`, `find_unused_parameters`,
            `gradient_as_bucket_view`, `broadcast_buffers`, ...).
    """

    name = "native_ddp"

    #: The options passed through to `DistributedDataParallel` (``**ddp_kwargs``) that the config lists, with torch's
    #: defaults.
    passthrough_options: dict[str, Any] = {
        "bucket_cap_mb": 25.0,
        "find_unused_parameters": False,
        "gradient_as_bucket_view": False,
        "broadcast_buffers": True,
        "static_graph": False,
    }

    def __init__(
        self,
        backend: str | None = None,
        timeout: float = 300.0,
        comm_hook: str | None = None,
        powersgd_rank: int = 4,
        start_iter: int | None = None,
        averaging_period: int = 4,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(backend=backend, timeout=timeout)
        if comm_hook is not None and comm_hook not in TORCH_HOOKS:
            raise OptionError(f"NativeDDP(comm_hook={comm_hook!r}): one of None, {', '.join(map(repr, TORCH_HOOKS))}.")
        check_int("NativeDDP", "powersgd_rank", powersgd_rank, 1, meaning="PowerSGD's matrix approximation rank")
        check_int("NativeDDP", "averaging_period", averaging_period, 1, meaning="optimizer steps between averagings")
        if start_iter is None:
            start_iter = 10 if comm_hook == "powersgd" else 0
        # torch refuses error feedback and warm start with fewer: its DDP rebuilds buckets after the first iteration.
        minimum = 2 if comm_hook == "powersgd" else 0
        check_int("NativeDDP", "start_iter", start_iter, minimum, meaning="iterations of plain all-reduce first")
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.start_iter = start_iter
        self.averaging_period = averaging_period
        #: Post-local SGD's replicas differ between averagings: checkpoints keep every rank's weights.
        self.replicas_differ = comm_hook == "post_local_sgd"
        self._relaxation: TorchRelaxation | None = None
        # Refused here, before any process starts, rather than by torch inside every worker.
        check_passthrough("NativeDDP", DistributedDataParallel.__init__, ddp_kwargs, "torch's DistributedDataParallel")
        for name in ("module", "device_ids") & ddp_kwargs.keys():
            raise OptionError(f"NativeDDP({name}=...): NativeDDP passes {name} to DistributedDataParallel itself.")
        if "bucket_cap_mb" in ddp_kwargs:
            check_number("NativeDDP", "bucket_cap_mb", ddp_kwargs["bucket_cap_mb"], minimum=0, meaning="MiB per bucket")
        if ddp_kwargs.get("broadcast_buffers") is True:
            # torch's default; given explicitly (as the Hydra config does) it only prints torch's deprecation
            # warning on every rank.
            del ddp_kwargs["broadcast_buffers"]
        self.ddp_kwargs = ddp_kwargs
        self.gradient_as_bucket_view = bool(ddp_kwargs.get("gradient_as_bucket_view", False))
        self._ddp: DistributedDataParallel | None = None
        self._forward_synced: bool | None = None
        self._synced_backwards = 0
        self._join = False
        #: Manual optimization without find_unused_parameters: each trainable parameter's AccumulateGrad node
        #: and name, to name the parameters a backward will not reach before torch's reducer waits for them.
        self._accumulators: dict[Any, int] = {}
        self._trainable: list[tuple[str, Tensor]] = []

    @property
    def manual_optimization_refused(self) -> str:  # type: ignore[override]
        """Why these options cannot follow manual optimization ("" when they can)."""
        if self.comm_hook is not None:
            return f"comm_hook={self.comm_hook!r} relaxes one optimizer step per synchronized backward"
        if self.ddp_kwargs.get("static_graph"):
            return (
                "static_graph=True promises that every backward reaches the same parameters, which the backwards "
                "of a manual step (one per optimizer) need not; drop static_graph"
            )
        return ""

    @property
    def ddp(self) -> DistributedDataParallel:
        """The `DistributedDataParallel` wrapper built by `setup`."""
        if self._ddp is None:
            raise RuntimeError("NativeDDP.setup(task) has not been called yet.")
        return self._ddp

    def setup(self, task: Task) -> None:
        """Move `task` to the device and wrap it in `DistributedDataParallel` (which copies rank 0's state)."""
        task.to(self.root_device)
        self.check_same_parameters(task)
        device_ids = [self.root_device] if self.root_device.type == "cuda" else None
        # Collective: torch's DDP broadcasts rank 0's parameters and buffers as it is built.
        self._ddp = DistributedDataParallel(_TrainingStepModule(task), device_ids=device_ids, **self.ddp_kwargs)
        self._relaxation = None
        if self.comm_hook is not None:
            self._relaxation = TorchRelaxation(
                self.comm_hook, self.comm_counter, self.powersgd_rank, self.start_iter, self.averaging_period
            )
            self._relaxation.register(self._ddp)
        if self.manual_optimization and not self._finds_unused():
            self._trainable = [(name, p) for name, p in task.named_parameters() if p.requires_grad]
            self._accumulators = grad_accumulators([p for _, p in self._trainable])
        if self._join:
            # What `Join([ddp])` sets on entry, except that syncline's loop, not Join's, says who joined.
            self._ddp._join_config = _JoinConfig(enable=True, throw_on_early_termination=False, is_first_joinable=False)
            self._ddp._divide_by_initial_world_size = True

    def teardown(self) -> None:
        """Drop the DDP wrapper; the process group stays for later stages."""
        self._ddp = None
        super().teardown()

    def training_step(self, task: Task, batch: Any, batch_idx: int) -> Any:
        """Run the forward through the DDP wrapper, inside `no_sync` unless the next backward syncs."""
        sync = self._backward_syncs(self.sync_next_backward)
        context = contextlib.nullcontext() if sync else self.ddp.no_sync()
        ddp = self.ddp
        if ddp.will_sync_module_buffers():
            self.comm_counter.add_tensors(*ddp.modules_buffers)
        with context:
            # Collective (inside torch's forward): rank 0's buffers, after a synchronized step.
            output = ddp(batch, batch_idx)
        self._forward_synced = sync
        return output

    def backward(self, loss: Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Back-propagate `loss`; torch's reducer all-reduces if the forward was prepared to.

        Raises:
            RuntimeError: `sync` disagrees with `sync_next_backward` at the forward.
        """
        if self.manual_optimization:
            self._manual_backward(loss, retain_graph)
            return
        sync = self._backward_syncs(sync)
        if self._forward_synced is not None and sync != self._forward_synced:
            raise RuntimeError(
                f"backward(sync={sync}) follows a forward run with sync_next_backward="
                f"{self._forward_synced}; torch's DDP fixes synchronization in the forward, so set "
                "strategy.sync_next_backward to the same value before training_step."
            )
        self._forward_synced = None
        self._autograd_backward(loss, retain_graph)
        if sync:
            self._count_synchronized_backward()

    def _manual_backward(self, loss: Tensor, retain_graph: bool) -> None:
        """Back-propagate inside `training_step` (manual optimization), synchronizing every backward.

        torch's DDP prepares its reducer for one backward at the end of its forward; here the backwards run
        inside the forward, so the reducer is prepared before each of them, as Lightning's DDP strategy does.

        Raises:
            RuntimeError: without `find_unused_parameters`, parameters the loss does not reach (frozen by
                `toggle_optimizer`, or unused): torch's reducer would wait for them and leave this backward's
                gradients unaveraged, so it is refused before the backward, naming them.
        """
        ddp = self.ddp
        if self._accumulators:
            self._check_reaches_every_parameter(loss)
        ddp.require_forward_param_sync = True
        roots = [loss] if self._finds_unused() else []
        ddp.reducer._rebuild_buckets()  # as the forward would; a no-op after the first synchronized backward
        ddp.reducer.prepare_for_backward(roots)
        # Collective (inside torch's reducer): every bucket's all-reduce, during this backward.
        self._autograd_backward(loss, retain_graph)
        self._count_synchronized_backward()

    def _finds_unused(self) -> bool:
        return bool(self.ddp_kwargs.get("find_unused_parameters"))

    def _check_reaches_every_parameter(self, loss: Tensor) -> None:
        reached = parameters_reached(loss, self._accumulators, {id(p): i for i, (_, p) in enumerate(self._trainable)})
        missing = [name for index, (name, _) in enumerate(self._trainable) if index not in reached]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise RuntimeError(
                f"NativeDDP, rank {self.global_rank}: manual_backward's loss does not reach parameter(s) "
                f"{', '.join(missing[:5])}{more} (frozen by toggle_optimizer, detached, or unused). torch's DDP "
                "would wait for their gradients and leave this backward's unaveraged. Pass "
                "NativeDDP(find_unused_parameters=True) (strategy='ddp_find_unused_parameters_true', or "
                "strategy.find_unused_parameters=true on the command line)."
            )

    def _count_synchronized_backward(self) -> None:
        """Count what torch's reducer handed to its all-reduces in this backward (it keeps no counter)."""
        params = [p for p in self.ddp.parameters() if p.requires_grad]
        if self._relaxation is None:  # torch's relaxations count in their hooks
            # Collective (inside torch's reducer): every dense gradient, bucket by bucket.
            dense = [p for p in params if p.grad is None or not p.grad.is_sparse]
            self.comm_counter.add(sum(p.numel() * p.element_size() for p in dense))
        first = self._synced_backwards == 0
        self._synced_backwards += 1
        static = self.ddp_kwargs.get("static_graph", False)
        if (self.ddp_kwargs.get("find_unused_parameters") and not static) or (static and first):
            # Collective (inside torch's reducer): the used-parameter bitmap, one int32 per parameter.
            self.comm_counter.add(4 * len(params))

    # -------------------------------------------------------------------- join
    def enable_join(self) -> None:
        """Run DDP with torch's join protocol, so that ranks whose data ran out can shadow the others.

        Raises:
            ValueError: `static_graph=True`, whose first-iteration bookkeeping a joined rank cannot shadow.
        """
        if self.comm_hook is not None:
            raise ValueError(
                f"NativeDDP(comm_hook={self.comm_hook!r}) cannot run with uneven_inputs='join' (a joined rank would "
                "run torch's hook on zeros); use uneven_inputs='check' with even data."
            )
        if self.ddp_kwargs.get("static_graph"):
            raise ValueError(
                "NativeDDP(static_graph=True) cannot run with uneven_inputs='join' (torch's DDP join does not "
                "support a static graph); drop static_graph, or use uneven_inputs='check' with even data."
            )
        self._join = True

    def finish_join(self) -> None:
        """Give every rank the last joiner's buffers, as torch's join hook's `post_hook` does."""
        ddp = self.ddp
        if ddp.forward_sync_buffers and ddp.modules_buffers:
            # Collective: the buffers of the rank that had data last, to every rank.
            ddp._default_broadcast_coalesced(authoritative_rank=self.buffer_source)
            self.comm_counter.add_tensors(*ddp.modules_buffers)

    def shadow_forward(self) -> None:
        """Launch what DDP's forward launches on the ranks with data (the first half of torch's join hook)."""
        ddp = self.ddp
        # Collective (once per run): the rebuilt bucket order, broadcast from rank 0.
        ddp.reducer._rebuild_buckets()
        if ddp._check_sync_bufs_pre_fwd():
            self.comm_counter.add_tensors(*ddp.modules_buffers)
        # Collectives: agree on the rank whose buffers are broadcast (never this one), then the broadcast.
        ddp._check_and_sync_module_buffers()
        # Collective: whether the ranks with data synchronize this backward (they always do under join).
        ddp.require_forward_param_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)

    def shadow_backward(self) -> None:
        """Match the others' bucket all-reduces with zeros and keep their average as this rank's gradients."""
        ddp = self.ddp
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        # Collectives: one all-reduce per bucket, in the reducer's order; the others' gradients arrive
        # already divided by the world size, so the sum is their average over every rank.
        futures = [ddp.reducer._run_comm_hook(bucket) for bucket in buckets]
        averages = []
        for future in futures:
            value = future.wait()
            averages.append(value[0] if isinstance(value, list) else value)
        used = None
        if ddp.find_unused_parameters:
            used = ddp.reducer._get_local_used_map()
            # Collective: the used-parameter bitmap, to which this rank adds nothing.
            ddp.process_group.allreduce(used).wait()
        ddp.reducer._push_all_rebuilt_params()
        index = {id(p): i for i, p in enumerate(ddp.parameters())}
        for bucket, average in zip(buckets, averages):
            offset = 0
            for param in bucket.parameters():
                count = param.numel()
                if used is not None and not used[index[id(param)]]:
                    param.grad = None  # unused on every rank: DDP leaves its gradient untouched
                else:
                    param.grad = average[offset : offset + count].view_as(param).clone()
                offset += count
        self._count_synchronized_backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Take the step; with post-local SGD, let torch's averager average the parameters when due."""
        step()
        if self._relaxation is not None:
            self._relaxation.after_step([p for p in self.ddp.parameters() if p.requires_grad])
        self.comm_counter.close_step()

    def state_dict(self) -> dict[str, Any]:
        """With torch's relaxations: their iteration counters (else nothing)."""
        return {} if self._relaxation is None else {"torch_hook": self._relaxation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if self._relaxation is not None and "torch_hook" in state:
            self._relaxation.load_state_dict(state["torch_hook"])

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Set gradients to None, as a single process does.

        Zeroing in place would keep a zero gradient on parameters that the next step does not use
        (frozen or unused layers), which weight decay and momentum then move; torch's DDP re-attaches
        its bucket views on the next backward, so None costs a copy and nothing else.
        """
        optimizer.zero_grad(set_to_none=True)

    def __repr__(self) -> str:
        hook = {} if self.comm_hook is None else {"comm_hook": self.comm_hook, "start_iter": self.start_iter}
        kwargs = ", ".join(f"{key}={value!r}" for key, value in {**hook, **self.ddp_kwargs}.items())
        return f"NativeDDP({kwargs})"
