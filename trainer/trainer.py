"""`Trainer`: wires a task, a strategy, callbacks and loggers together and runs the stages."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import Tensor

from syncline.callbacks.callback import Callback, CallbackDispatcher
from syncline.callbacks.logger import Logger
from syncline.checkpoint_file import save_checkpoint
from syncline.strategies.strategy import Strategy
from syncline.trainer import persistence
from syncline.trainer.arguments import (
    add_timer,
    build_callbacks,
    build_loggers,
    check_options,
    default_max_epochs,
    device_type,
    merge_task_callbacks,
    resolve_devices,
    strategy_of,
)
from syncline.trainer.datamodule import DataModule, check_datamodule
from syncline.trainer.debugging import apply_debugging_flags
from syncline.trainer.evaluation import EvaluationLoop
from syncline.trainer.fit_loop import FitLoop
from syncline.trainer.launcher import launch, launched_by_torchrun
from syncline.trainer.live_launch import check_live_recovery, launch_live
from syncline.trainer.manual import check_optimization_mode
from syncline.trainer.optim import OptimizerSetup
from syncline.trainer.precision import Precision
from syncline.trainer.preemption import PreemptionWatch, TrainingPreempted
from syncline.trainer.results import ResultCollection
from syncline.trainer.seed import seed_everything, set_deterministic
from syncline.trainer.stages import evaluation_stage, evaluation_target, fit_stage, release_device
from syncline.trainer.state import TrainerState
from syncline.trainer.task import Task

__all__ = ["Trainer"]

R = TypeVar("R")


class Trainer:
    """Train, validate, test and predict with a `Task`, as Lightning's Trainer does.

    Args:
        max_epochs: stop after this many epochs (1000 when neither this nor `max_steps` is set; -1: no limit).
        max_steps: stop after this many optimizer steps; -1 for no limit.
        strategy: "auto", a registered strategy name (Lightning's "ddp" is "native_ddp"), or a
            `strategies.Strategy` instance.
        devices: number of processes on this machine (the distributed strategies launch them); "auto" is
            every GPU (one process on the CPU), -1 every GPU.
        accumulate_grad_batches: micro-batches per optimizer step; the loss is divided by it and only the
            last micro-batch of a window synchronizes gradients.
        min_epochs: a stop request (early stopping) ends training only after this many epochs.
        min_steps: ... and after this many optimizer steps.
        gradient_clip_val: clip the gradients to this value before each step.
        gradient_clip_algorithm: "norm" (their global 2-norm, the default) or "value" (each element).
        precision: "32", "bf16-mixed" or "16-mixed" (fp16 autocast with loss scaling, CPU or CUDA); also
            Lightning's "32-true", "16" and "bf16".
        callbacks: `Callback` instances, called in this order (before the task's own hooks, as in Lightning).
        logger: True for a TensorBoardLogger under the run directory, False for none, or Logger(s).
        default_root_dir: where logs and checkpoints go; the working directory when None.
        enable_checkpointing: add a default `ModelCheckpoint` (last epoch) when none is given.
        enable_progress_bar: add a `ProgressBar` when none is given.
        log_every_n_steps: send step values to the loggers every this many optimizer steps.
        val_check_interval: float: validate after this fraction of each epoch (and at its end);
            int: validate every this many training batches.
        limit_train_batches: use only this many (int) or this fraction (float) of the training batches.
        limit_val_batches: likewise for validation.
        limit_test_batches: likewise for `test`.
        limit_predict_batches: likewise for `predict`.
        check_val_every_n_epoch: validate in every this-many-th epoch only; None: an int `val_check_interval`
            counts training batches across epochs (Lightning's).
        num_sanity_val_steps: validation batches run before training to catch errors early.
        use_distributed_sampler: shard the data across processes with a `DistributedSampler`.
        accelerator: "auto" (CUDA when there is a GPU, else the CPU), "cpu", or "gpu"/"cuda"; with
            several `devices` it picks the backend too (gloo on the CPU, NCCL on GPUs).
        seed: seed python, numpy and torch now (before the task is trained) and in every worker.
        deterministic: use deterministic algorithms only.
        ckpt_read: "every_rank": every process reads `ckpt_path` itself (a shared file system);
            "rank_zero": rank 0 reads it and sends it to the others (checkpoints on node-local disks).
        nonfinite_loss: a NaN or inf loss on any rank: "raise" stops every rank naming the rank and step;
            "skip" drops the whole accumulation window on every rank (docs/guide.md, "A NaN or inf loss").
        uneven_inputs: ranks whose data run out at different times: "check" raises on every rank naming the
            one that ran out; "join" shadows the others' steps (Joinable strategies); "off" (docs/guide.md).
        max_restarts: with `devices` > 1, restart the worker group this many times after a failure; a
            restarted `fit` resumes from the newest ``last.ckpt``, as under ``torchrun --max-restarts``.
        recovery: what a worker's death costs, with `devices` > 1: "checkpoint" restarts every worker from the
            newest ``last.ckpt``; "live" keeps the survivors training at the smaller size, re-shards the epoch's
            rest, and admits a restarted worker (at most `max_restarts` in all) with a healthy peer's state.
        num_nodes: machines of a ``recovery="live"`` run, each running this script with MASTER_ADDR, MASTER_PORT
            (node 0's address and a free port on it: node 0 hosts the run's store there) and NODE_RANK set, as
            Lightning's general cluster does; under torchrun, torchrun's ``--nnodes`` decides instead.
        preemption_signal: "SIGTERM", "SIGUSR1", "SIGUSR2" or None: this signal (or Ctrl-C) stops every rank
            after the current step with ``last.ckpt`` and exit status 75 (`TrainingPreempted`).
        fast_dev_run: True or n: n batches (True: 1) of every stage, one epoch, no sanity check, checkpoint or log.
        overfit_batches: train and validate on this many batches (int) or fraction (float), in order (unshuffled).
        enable_model_summary: print the task's `ModelSummary` (parameters per top-level module) when fit starts.
        inference_mode: evaluate under `torch.inference_mode()`; False (the default) evaluates under
            `torch.no_grad()` (docs/from_lightning.md says why the default differs from Lightning's).
        detect_anomaly: run `fit` under `torch.autograd.set_detect_anomaly(True)` (slow; for debugging NaNs).
        reload_dataloaders_every_n_epochs: ask the task (or DataModule) for new training and validation loaders
            every this many epochs (0: never).
        max_time: stop training after this long: "DD:HH:MM:SS", a `timedelta` or a dict of its arguments
            (a `Timer` callback, as in Lightning).
    """

    def __init__(
        self,
        max_epochs: int | None = None,
        max_steps: int = -1,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        strategy: str | Strategy = "auto",
        devices: int | str = 1,
        accelerator: str = "auto",
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        precision: str | int = "32",
        callbacks: Sequence[Callback] | Callback | None = None,
        logger: bool | Logger | Sequence[Logger] = True,
        default_root_dir: str | os.PathLike[str] | None = None,
        enable_checkpointing: bool = True,
        enable_progress_bar: bool = True,
        log_every_n_steps: int = 50,
        val_check_interval: int | float = 1.0,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int = 2,
        use_distributed_sampler: bool = True,
        seed: int | None = None,
        deterministic: bool = False,
        ckpt_read: str = "every_rank",
        nonfinite_loss: str = "raise",
        uneven_inputs: str = "check",
        max_restarts: int = 0,
        recovery: str = "checkpoint",
        num_nodes: int = 1,
        preemption_signal: str | None = "SIGTERM",
        fast_dev_run: bool | int = False,
        overfit_batches: int | float = 0.0,
        enable_model_summary: bool = True,
        inference_mode: bool = False,
        detect_anomaly: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        max_time: str | timedelta | dict[str, int] | None = None,
    ) -> None:
        check_options(locals())
        devices = resolve_devices(devices, accelerator)
        self.max_epochs = default_max_epochs(max_epochs, max_steps, max_time, callbacks)
        self.max_steps = max_steps
        self.min_epochs = min_epochs
        self.min_steps = min_steps
        self.gradient_clip_algorithm = gradient_clip_algorithm or "norm"
        self.limit_test_batches = limit_test_batches
        self.limit_predict_batches = limit_predict_batches
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.devices = devices
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.precision_name = str(precision)
        self.default_root_dir = os.path.expanduser(default_root_dir) if default_root_dir is not None else os.getcwd()
        self.inference_mode = inference_mode
        self.detect_anomaly = detect_anomaly
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self.log_every_n_steps = log_every_n_steps
        self.val_check_interval = val_check_interval
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.num_sanity_val_steps = num_sanity_val_steps
        self.use_distributed_sampler = use_distributed_sampler
        self.seed = seed
        self.deterministic = deterministic
        self.ckpt_read = ckpt_read
        self.nonfinite_loss = nonfinite_loss
        self.uneven_inputs = uneven_inputs
        self.max_restarts = max_restarts
        self.recovery = recovery
        self._num_nodes = num_nodes
        #: The loop's side of ``recovery="live"`` in a live worker (None elsewhere: nothing runs per step).
        self.live: Any = None
        self.preemption = PreemptionWatch(preemption_signal)
        # Every node's processes: a live run's other nodes start the same script.
        self.strategy = strategy_of(strategy, devices * num_nodes, accumulate_grad_batches, uneven_inputs)
        if recovery == "live":
            check_live_recovery(self.strategy)
        self.accelerator = accelerator
        kind = device_type(accelerator, devices)
        if kind is not None:
            self.strategy.use_accelerator(kind)
        self.loggers = build_loggers(logger, self.default_root_dir)
        self.callbacks = build_callbacks(callbacks, enable_checkpointing, enable_progress_bar, enable_model_summary)
        add_timer(self.callbacks, max_time)
        apply_debugging_flags(self, fast_dev_run, overfit_batches)  # sets fast_dev_run and overfit_batches

        self.state = TrainerState()
        #: Whether the training batch in progress is its epoch's last (set by the fit loop).
        self.is_last_batch = False
        self.callback_metrics: dict[str, Tensor] = {}
        self.progress_bar_metrics: dict[str, Tensor] = {}
        self.logged_metrics: dict[str, Tensor] = {}
        self.num_training_batches: int | float = 0
        self.num_val_batches: list[int | float] = []
        #: Batches per loader of the evaluation run in progress (validation, sanity check, test, predict).
        self.num_eval_batches: list[int | float] = []
        self.train_dataloader: Any = None
        self.val_dataloaders: list[Any] = []
        #: The values `self.log` records in training, and in the evaluation run in progress.
        self.train_results = ResultCollection(True, self.strategy, self.callback_metrics, self.progress_bar_metrics)
        self.eval_results = ResultCollection(False, self.strategy, self.callback_metrics, self.progress_bar_metrics)
        #: The collection `self.log` writes to now (the evaluation one while evaluating).
        self.results = self.train_results
        self.dispatcher = CallbackDispatcher(self, None, self.callbacks, task_base=Task)
        #: The precision of the stage in progress (it depends on the device, known once a stage starts).
        self.precision: Precision | None = None
        #: The optimizer and schedulers of the task being fitted (None outside `fit`).
        self.optim: OptimizerSetup | None = None
        self.fit_loop = FitLoop(self)
        self.evaluation = EvaluationLoop(self)
        self._task: Task | None = None
        #: The checkpoint the last stage loaded (its path), as Lightning's ``trainer.ckpt_path``.
        self.ckpt_path: str | None = None
        #: The DataModule of the stage in progress (or the last one), as Lightning's ``trainer.datamodule``.
        self.datamodule: DataModule | None = None

        set_deterministic(deterministic)
        if seed is not None:
            seed_everything(seed)

    # -------------------------------------------------------------- properties
    @property
    def task(self) -> Task:
        """The task of the stage in progress."""
        if self._task is None:
            raise RuntimeError("The Trainer has no task yet; call fit, validate, test or predict.")
        return self._task

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        """Epochs finished so far, as Lightning counts them: the index of the epoch in progress."""
        return self.state.current_epoch

    @property
    def should_stop(self) -> bool:
        """Whether training stops at the next opportunity; callbacks set it to True."""
        return self.state.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.state.should_stop = value

    @property
    def sanity_checking(self) -> bool:
        """Whether the sanity validation is running."""
        return self.state.sanity_checking

    @property
    def global_rank(self) -> int:
        """Rank of this process."""
        return self.strategy.global_rank

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this process writes files and prints."""
        return self.strategy.is_global_zero

    @property
    def logger(self) -> Logger | None:
        """The first logger, or None."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The first logger's directory, or `default_root_dir` without loggers."""
        return self.loggers[0].log_dir if self.loggers else self.default_root_dir

    @property
    def checkpoint_callbacks(self) -> list[Callback]:
        """The ModelCheckpoint callbacks."""
        from syncline.callbacks.model_checkpoint import ModelCheckpoint

        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Callback | None:
        """The first ModelCheckpoint, or None."""
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def lightning_module(self) -> Task:
        """The task of the stage in progress (Lightning's name)."""
        return self.task

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        """Schedulers of the task being fitted, with their interval and frequency."""
        return self.optim.schedulers if self.optim is not None else []

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of the task being fitted (a list, as in Lightning)."""
        return list(self.optim.optimizers) if self.optim is not None else []

    # ------------------------------------------------- Lightning's public surface
    @property
    def model(self) -> torch.nn.Module | None:
        """The task of the stage in progress or last run (None before any)."""
        return self._task

    @property
    def interrupted(self) -> bool:
        """Whether the last stage ended with an exception (Ctrl-C, a preemption signal, or an error)."""
        return self.state.status == "interrupted"

    @property
    def training(self) -> bool:
        """Whether the training loop is running (not its validation)."""
        return self.state.stage == "train"

    @property
    def validating(self) -> bool:
        """Whether validation (not the sanity check) is running."""
        return self.state.stage == "validate"

    @property
    def testing(self) -> bool:
        """Whether `test` is running."""
        return self.state.stage == "test"

    @property
    def predicting(self) -> bool:
        """Whether `predict` is running."""
        return self.state.stage == "predict"

    @property
    def evaluating(self) -> bool:
        """Whether validation or test is running."""
        return self.state.stage in ("validate", "test")

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine."""
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """Index of this machine (``GROUP_RANK`` under torchrun; 0 otherwise)."""
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))

    @property
    def num_nodes(self) -> int:
        """Number of machines: `num_nodes` of a live run; under torchrun, the processes over those on each machine."""
        if self.recovery == "live" or not launched_by_torchrun():
            return self._num_nodes
        return max(1, self.world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", self.devices))))

    @property
    def num_devices(self) -> int:
        """Processes (devices) per machine, as `devices` asked for."""
        return self.devices

    @property
    def early_stopping_callbacks(self) -> list[Callback]:
        """The EarlyStopping callbacks."""
        from syncline.callbacks.early_stopping import EarlyStopping

        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> Callback | None:
        """The first EarlyStopping, or None."""
        found = self.early_stopping_callbacks
        return found[0] if found else None

    @property
    def progress_bar_callback(self) -> Callback | None:
        """The ProgressBar, or None."""
        from syncline.callbacks.progress import ProgressBar

        return next((c for c in self.callbacks if isinstance(c, ProgressBar)), None)

    @property
    def enable_validation(self) -> bool:
        """Whether this fit validates: it has validation batches."""
        return any(self.num_val_batches)

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps this fit will take, as Lightning estimates them (for a OneCycleLR in
        `configure_optimizers`): batches per epoch over `accumulate_grad_batches`, times `max_epochs`, capped by
        `max_steps`; `max_steps` (or inf) for endless data or no epoch limit."""
        if self.max_epochs in (None, -1):
            return float("inf") if self.max_steps == -1 else self.max_steps
        batches = self.num_training_batches
        if batches == float("inf"):
            return self.max_steps
        steps = math.ceil(batches / self.accumulate_grad_batches) * max(self.max_epochs, 1)
        return min(steps, self.max_steps) if self.max_steps != -1 else steps

    @property
    def test_dataloaders(self) -> list[Any]:
        """The loaders of the test run in progress (or the last one)."""
        return list(self.evaluation.loaders.get("test", []))

    @property
    def predict_dataloaders(self) -> list[Any]:
        """The loaders of the predict run in progress (or the last one)."""
        return list(self.evaluation.loaders.get("predict", []))

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ stages
    def fit(
        self,
        task: Task | None = None,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        model: Task | None = None,
    ) -> None:
        """Train `task` (or `model=`, Lightning's name) on the loaders or `datamodule`; resume from `ckpt_path`.

        `ckpt_path` is a checkpoint's path, "last" (the newest last checkpoint), "best" (the first
        ModelCheckpoint's best) or None.
        """
        if (task is None) == (model is None):
            raise TypeError("Trainer.fit takes one task: pass it positionally or as model=..., not both or neither.")
        loaders = {"train_dataloaders": train_dataloaders, "val_dataloaders": val_dataloaders}
        self._stage("fit", task if task is not None else model, ckpt_path, loaders, datamodule)

    def validate(
        self,
        task: Task | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        datamodule: DataModule | None = None,
        model: Task | None = None,
    ) -> list[dict[str, float]]:
        """Run the validation loop once and return its epoch metrics, one dict per loader.

        Without a task, the task of the previous `fit` is used with its best checkpoint, as in Lightning.
        `ckpt_path`: None (the task's current weights), "best", "last", or a checkpoint's path.
        """
        return self._stage(
            "validate", *evaluation_target("validate", task, model, ckpt_path, self._task), dataloaders, datamodule
        )

    def test(
        self,
        task: Task | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        datamodule: DataModule | None = None,
        model: Task | None = None,
    ) -> list[dict[str, float]]:
        """Run the test loop once and return its epoch metrics, one dict per loader (see `validate`)."""
        return self._stage(
            "test", *evaluation_target("test", task, model, ckpt_path, self._task), dataloaders, datamodule
        )

    def predict(
        self,
        task: Task | None = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        model: Task | None = None,
    ) -> list[Any] | None:
        """Return `predict_step`'s outputs per batch (per loader with several); None if return_predictions=False."""
        chosen = evaluation_target("predict", task, model, ckpt_path, self._task)
        return self._stage("predict", *chosen, dataloaders, datamodule, return_predictions=return_predictions)

    def _stage(self, stage: str, task: Any, ckpt_path: Any, data: Any, datamodule: Any, **options: Any) -> Any:
        """Run `stage` here, or launch `devices` workers that run it (not when torchrun started us)."""
        self._task = task
        self.datamodule, kwargs = check_datamodule(stage, datamodule, data if stage == "fit" else {"dataloaders": data})
        data = kwargs.get("dataloaders")
        if stage == "fit" and isinstance(task, Task):
            check_optimization_mode(self, task)  # Lightning's rules for manual optimization, before any launch
            self.strategy.check_fit_options(gradient_clip_val=self.gradient_clip_val, precision=self.precision_name)
        if (self.devices > 1 or self._num_nodes > 1) and not launched_by_torchrun():
            # The launcher checks the options against the world size before it looks at the task.
            start = launch_live if self.recovery == "live" else launch
            return start(self, stage, task, dict(kwargs, datamodule=self.datamodule, ckpt_path=ckpt_path, **options))
        if not isinstance(task, Task):
            raise TypeError(f"Trainer.{stage} needs a trainer.Task, got {type(task).__name__}.")
        if stage == "fit":
            return self._run(stage, task, lambda: fit_stage(self, ckpt_path=ckpt_path, **kwargs))
        return self._run(stage, task, lambda: evaluation_stage(self, stage, data, ckpt_path, **options))

    def worker_result(self, task: Task, returned: Any) -> dict[str, Any]:
        """Return what a launched rank 0 sends back to the process that launched it."""
        return persistence.worker_result(self, task, returned)

    def apply_worker_result(self, task: Task, result: dict[str, Any]) -> None:
        """Load what a launched rank 0 sent back, so this process holds the trained task and metrics."""
        persistence.apply_worker_result(self, task, result)

    def _run(self, stage: str, task: Task, body: Callable[[], R]) -> R:
        task._trainer = self
        self.state.fn, self.state.stage = stage, "train" if stage == "fit" else stage
        self.state.status = "running"
        self.is_last_batch = False
        # Every stage starts with no metrics, as in Lightning: `validate` after `fit` shows its own values.
        for metrics in (self.callback_metrics, self.progress_bar_metrics, self.logged_metrics):
            metrics.clear()
        self.train_results.reset()
        self.eval_results.reset()
        self.results = self.train_results
        self.evaluation.reset()
        # As in Lightning, every stage asks the task for its own callbacks (they replace the Trainer's of their type).
        self.callbacks = merge_task_callbacks(self.callbacks, task.configure_callbacks(), type(task).__name__)
        self.dispatcher.bind(task, self.callbacks)
        self.strategy.setup_environment()
        self.precision = Precision(self.precision_name, self.strategy.root_device, self.strategy)
        status = "failed"
        try:
            # Only switched on, never off: a program that enabled anomaly detection itself keeps it.
            with torch.autograd.set_detect_anomaly(True) if self.detect_anomaly else contextlib.nullcontext():
                result = body()
            status = "success"
            self.state.status = "finished"
            return result
        except BaseException as error:
            # As in Lightning, any exception leaves the Trainer interrupted (`trainer.interrupted`).
            self.state.status = "interrupted"
            if isinstance(error, (KeyboardInterrupt, TrainingPreempted)):
                status = "interrupted"
            if not isinstance(error, TrainingPreempted):
                # Every rank stops together on a preemption; after anything else the others may be stuck.
                self.strategy.on_stage_failure()
            self.dispatcher.fire(Callback.on_exception, error)
            if self.datamodule is not None:
                self.datamodule.on_exception(error)
            raise
        finally:
            try:
                if self.datamodule is not None:
                    self.datamodule.teardown(stage=stage)  # before the callbacks' and the task's, as in Lightning
                self.dispatcher.fire(Callback.teardown, stage=stage)
                if self.is_global_zero:
                    for logger in self.loggers:
                        logger.finalize(status)
            finally:
                self.strategy.teardown()
                self.state.stage = None
                release_device(task, self.optimizers, self.strategy.root_device)

    # ----------------------------------------------------------------- logging
    def log_metrics(self, metrics: dict[str, Tensor | float], step: int | None = None) -> None:
        """Write `metrics` to every logger (rank 0), with the epoch, at Lightning's step (or `step`)."""
        if not metrics:
            return
        self.logged_metrics.update({k: v if isinstance(v, Tensor) else torch.tensor(v) for k, v in metrics.items()})
        values = {name: float(value) for name, value in metrics.items()}  # host sync: logging step only
        if step is None and "step" in values:
            step = int(values.pop("step"))  # a logged "step" is the loggers' step, as in Lightning
        elif step is None:
            step = self.fit_loop.log_step() if self.state.fn == "fit" else self.state.global_step
            values.setdefault("epoch", float(self.state.current_epoch))  # unless the task logged its own
        if self.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(values, step)
                logger.save()  # as Lightning: a CSV logger's rows reach the file at every logging step

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | os.PathLike[str], weights_only: bool = False) -> None:
        """Write a checkpoint of everything a bit-exact resume needs (or the weights only). Call it on every process."""
        checkpoint = persistence.checkpoint_state(self, weights_only)
        if self.is_global_zero:
            save_checkpoint(checkpoint, path)
        # Collective: nobody reads the file before rank 0 has finished writing it.
        self.strategy.barrier()
