"""`Trainer`: wires a task, a strategy, callbacks and loggers together and runs the stages."""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from syncline.callbacks.callback import Callback, CallbackDispatcher
from syncline.callbacks.logger import Logger
from syncline.options import OptionError, check_int, check_number
from syncline.strategies.comm.join import Joinable
from syncline.strategies.comm.launcher import launch, launched_by_torchrun
from syncline.strategies.registry import resolve_strategy
from syncline.strategies.strategy import Strategy
from syncline.trainer import persistence
from syncline.trainer.checkpoint import require_entries, save_checkpoint, to_primitive
from syncline.trainer.data import limit_batches, with_distributed_sampler, with_evaluation_sampler
from syncline.trainer.evaluation import run_evaluation
from syncline.trainer.fit_loop import FitLoop
from syncline.trainer.nonfinite import NONFINITE_LOSS
from syncline.trainer.optim import OptimizerSetup, parse_optimizers
from syncline.trainer.persistence import CKPT_READ
from syncline.trainer.precision import PRECISIONS, Precision
from syncline.trainer.preemption import PREEMPTION_SIGNALS, PreemptionWatch, TrainingPreempted
from syncline.trainer.results import ResultCollection
from syncline.trainer.seed import seed_everything, set_deterministic
from syncline.trainer.state import TrainerState, isolated_rng
from syncline.trainer.task import Task
from syncline.trainer.uneven import UNEVEN_INPUTS

__all__ = ["Trainer"]

R = TypeVar("R")

_LOADER_METHODS = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


class Trainer:
    """Train, validate, test and predict with a `Task`, as Lightning's Trainer does.

    Args:
        max_epochs: stop after this many epochs (1000 when neither this nor `max_steps` is set).
        max_steps: stop after this many optimizer steps; -1 for no limit.
        strategy: "auto", a registered strategy name, or a `strategies.Strategy` instance.
        devices: number of processes on this machine (the distributed strategies launch them).
        accumulate_grad_batches: micro-batches per optimizer step; the loss is divided by it and only the
            last micro-batch of a window synchronizes gradients.
        gradient_clip_val: clip the gradients' global 2-norm to this value before each step.
        precision: "32", "bf16-mixed" or "16-mixed" (fp16 autocast with loss scaling, CPU or CUDA).
        callbacks: `Callback` instances, called in this order after the task's own hooks.
        logger: True for a TensorBoardLogger under the run directory, False for none, or Logger(s).
        default_root_dir: where logs and checkpoints go; the working directory when None.
        enable_checkpointing: add a default `ModelCheckpoint` (last epoch) when none is given.
        enable_progress_bar: add a `ProgressBar` when none is given.
        log_every_n_steps: send step values to the loggers every this many optimizer steps.
        val_check_interval: float: validate after this fraction of each epoch (and at its end);
            int: validate every this many training batches.
        limit_train_batches: use only this many (int) or this fraction (float) of the training batches.
        limit_val_batches: likewise for validation.
        num_sanity_val_steps: validation batches run before training to catch errors early.
        use_distributed_sampler: shard the data across processes with a `DistributedSampler`.
        accelerator: "auto" (CUDA when there is a GPU, else the CPU), "cpu", or "gpu"/"cuda"; with
            several `devices` it picks the backend too (gloo on the CPU, NCCL on GPUs).
        seed: seed python, numpy and torch now (before the task is trained) and in every worker.
        deterministic: use deterministic algorithms only.
        ckpt_read: "every_rank": every process reads `ckpt_path` itself (a shared file system);
            "rank_zero": rank 0 reads it and sends it to the others (checkpoints on node-local disks).
        nonfinite_loss: a NaN or inf loss on any rank, checked once per optimizer step on every rank
            alike: "raise" stops every rank with an error naming the rank and step; "skip" drops the
            whole accumulation window and takes no step (and warns).
        uneven_inputs: "check": with several processes and a training loader syncline does not shard
            (an IterableDataset, a sampler of your own, use_distributed_sampler=False), the ranks agree
            before every batch that each has one (one small all-reduce), and raise the same error on every
            rank, naming the rank that ran out first, instead of hanging; "join": a rank whose data ran out
            shadows the others' steps with zero gradients until every rank ran out (as torch's DDP
            `join()`; strategies that are `Joinable`: bucketed_ddp, native_ddp; accumulate_grad_batches=1;
            no sync_dist logging in training_step); "off" skips the check.
        max_restarts: with `devices` > 1 (outside torchrun), restart the worker group this many times after
            a worker fails; a restarted `fit` resumes from the newest ``last.ckpt``, as under
            ``torchrun --max-restarts``.
        preemption_signal: "SIGTERM", "SIGUSR1" or "SIGUSR2": on this signal (or Ctrl-C) to any rank,
            every rank stops after the current optimizer step, writes ``last.ckpt`` and exits with
            status 75 (`TrainingPreempted`); None: only Ctrl-C does.
    """

    def __init__(
        self,
        max_epochs: int | None = None,
        max_steps: int = -1,
        strategy: str | Strategy = "auto",
        devices: int = 1,
        accelerator: str = "auto",
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
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
        num_sanity_val_steps: int = 2,
        use_distributed_sampler: bool = True,
        seed: int | None = None,
        deterministic: bool = False,
        ckpt_read: str = "every_rank",
        nonfinite_loss: str = "raise",
        uneven_inputs: str = "check",
        max_restarts: int = 0,
        preemption_signal: str | None = "SIGTERM",
    ) -> None:
        _check_options(locals())
        if ckpt_read not in CKPT_READ:
            raise OptionError(f"Trainer(ckpt_read={ckpt_read!r}): ckpt_read must be one of {', '.join(CKPT_READ)}.")
        if nonfinite_loss not in NONFINITE_LOSS:
            raise OptionError(
                f"Trainer(nonfinite_loss={nonfinite_loss!r}): nonfinite_loss must be one of "
                f"{', '.join(NONFINITE_LOSS)}."
            )
        if uneven_inputs not in UNEVEN_INPUTS:
            raise OptionError(
                f"Trainer(uneven_inputs={uneven_inputs!r}): uneven_inputs must be one of {', '.join(UNEVEN_INPUTS)}."
            )
        if preemption_signal is not None and preemption_signal not in PREEMPTION_SIGNALS:
            raise OptionError(
                f"Trainer(preemption_signal={preemption_signal!r}): use one of {', '.join(PREEMPTION_SIGNALS)}, "
                "or None for Ctrl-C only."
            )
        if str(precision) not in PRECISIONS:
            raise ValueError(f"Unknown precision {precision!r}. Valid values: {', '.join(PRECISIONS)}.")

        if max_epochs is None and max_steps == -1:
            max_epochs = 1000
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.devices = devices
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.precision_name = str(precision)
        self.default_root_dir = str(default_root_dir) if default_root_dir is not None else os.getcwd()
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
        self.preemption = PreemptionWatch(preemption_signal)
        self.strategy = resolve_strategy(strategy, devices)
        if uneven_inputs == "join":
            _check_joinable(self.strategy, accumulate_grad_batches)
        self.accelerator = accelerator
        device_type = _device_type(accelerator, devices)
        if device_type is not None:
            self.strategy.use_accelerator(device_type)
        if devices > 1 and not self.strategy.multi_process:
            raise ValueError(
                f"devices={devices} needs a data-parallel strategy, but {self.strategy!r} trains in one "
                "process. Use strategy='auto', 'bucketed_ddp' or 'native_ddp', or devices=1."
            )
        self.loggers = self._build_loggers(logger)
        self.callbacks = self._build_callbacks(callbacks, enable_checkpointing, enable_progress_bar)

        self.state = TrainerState()
        self.callback_metrics: dict[str, Tensor] = {}
        self.progress_bar_metrics: dict[str, Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.num_training_batches: int | float = 0
        self.num_val_batches: list[int | float] = []
        #: Batches per loader of the evaluation run in progress (validation, sanity check, test, predict).
        self.num_eval_batches: list[int | float] = []
        self.train_dataloader: Any = None
        self.val_dataloaders: list[Any] = []
        self._task: Task | None = None
        self._fit_loop: FitLoop | None = None
        #: The optimizer and schedulers of the task being fitted (None outside `fit`).
        self.optim: OptimizerSetup | None = None

        set_deterministic(deterministic)
        if seed is not None:
            seed_everything(seed)

    # ------------------------------------------------------------------ wiring
    def _build_loggers(self, logger: bool | Logger | Sequence[Logger]) -> list[Logger]:
        if logger is True:
            from syncline.callbacks.tensorboard import TensorBoardLogger

            return [TensorBoardLogger(save_dir=self.default_root_dir)]
        if logger is False or logger is None:
            return []
        if isinstance(logger, Logger):
            return [logger]
        loggers = list(logger)
        for item in loggers:
            if not isinstance(item, Logger):
                raise TypeError(f"logger entries must be callbacks.Logger instances, got {type(item).__name__}.")
        return loggers

    def _build_callbacks(
        self, callbacks: Sequence[Callback] | Callback | None, checkpointing: bool, progress_bar: bool
    ) -> list[Callback]:
        from syncline.callbacks.checkpoint import ModelCheckpoint
        from syncline.callbacks.progress import ProgressBar

        if isinstance(callbacks, Callback):
            callbacks = [callbacks]
        result = list(callbacks or [])
        for callback in result:
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks must be Callback instances, got {type(callback).__name__}.")
        if progress_bar and not any(isinstance(c, ProgressBar) for c in result):
            result.insert(0, ProgressBar())
        if not progress_bar:
            result = [c for c in result if not isinstance(c, ProgressBar)]
        if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in result):
            result.append(ModelCheckpoint())
        # Checkpoints go last, so the state they save includes what other callbacks did at the same event.
        result.sort(key=lambda c: isinstance(c, ModelCheckpoint))
        if not checkpointing and any(isinstance(c, ModelCheckpoint) for c in result):
            raise ValueError("enable_checkpointing=False but a ModelCheckpoint was passed in callbacks; drop one.")
        return result

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
        """Index of the current training epoch."""
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
        from syncline.callbacks.checkpoint import ModelCheckpoint

        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Callback | None:
        """The first ModelCheckpoint, or None."""
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        """Schedulers of the task being fitted, with their interval and frequency."""
        return self.optim.schedulers if self.optim is not None else []

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer of the task being fitted (a list, as in Lightning)."""
        return [self.optim.optimizer] if self.optim is not None else []

    # ------------------------------------------------------------------ stages
    def fit(
        self,
        task: Task | None = None,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        model: Task | None = None,
    ) -> None:
        """Train `task` (or `model=`, Lightning's name); resume from `ckpt_path` if given.

        `ckpt_path` is a checkpoint's path, "last" (the newest last checkpoint), "best" (the first
        ModelCheckpoint's best) or None.
        """
        task = _task_argument("fit", task, model)
        if self._must_launch():
            return launch(
                self,
                "fit",
                task,
                {"train_dataloaders": train_dataloaders, "val_dataloaders": val_dataloaders, "ckpt_path": ckpt_path},
            )
        self._run("fit", task, lambda: self._fit(train_dataloaders, val_dataloaders, ckpt_path))

    def validate(
        self,
        task: Task | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        model: Task | None = None,
    ) -> list[dict[str, float]]:
        """Run the validation loop once and return its epoch metrics.

        `ckpt_path`: None (the task's current weights), "best", "last", or a checkpoint's path.
        """
        task = _task_argument("validate", task, model)
        if self._must_launch():
            return launch(self, "validate", task, {"dataloaders": dataloaders, "ckpt_path": ckpt_path})
        return self._run("validate", task, lambda: self._evaluate("validate", dataloaders, ckpt_path))

    def test(
        self,
        task: Task | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        model: Task | None = None,
    ) -> list[dict[str, float]]:
        """Run the test loop once and return its epoch metrics.

        `ckpt_path`: None (the task's current weights), "best", "last", or a checkpoint's path.
        """
        task = _task_argument("test", task, model)
        if self._must_launch():
            return launch(self, "test", task, {"dataloaders": dataloaders, "ckpt_path": ckpt_path})
        return self._run("test", task, lambda: self._evaluate("test", dataloaders, ckpt_path))

    def predict(
        self,
        task: Task | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        model: Task | None = None,
    ) -> list[Any]:
        """Run `predict_step` over the data and return its outputs, batch by batch.

        `ckpt_path`: None (the task's current weights), "best", "last", or a checkpoint's path.
        """
        task = _task_argument("predict", task, model)
        if self._must_launch():
            return launch(self, "predict", task, {"dataloaders": dataloaders, "ckpt_path": ckpt_path})
        return self._run("predict", task, lambda: self._evaluate("predict", dataloaders, ckpt_path))

    def worker_result(self, task: Task, returned: Any) -> dict[str, Any]:
        """Return what a launched rank 0 sends back to the process that launched it."""
        return persistence.worker_result(self, task, returned)

    def apply_worker_result(self, task: Task, result: dict[str, Any]) -> None:
        """Load what a launched rank 0 sent back, so this process holds the trained task and metrics."""
        persistence.apply_worker_result(self, task, result)

    def _must_launch(self) -> bool:
        """Whether this call must start `devices` worker processes (not when torchrun started us)."""
        return self.devices > 1 and not launched_by_torchrun()

    def _run(self, stage: str, task: Task, body: Callable[[], R]) -> R:
        if not isinstance(task, Task):
            raise TypeError(f"Trainer.{stage} needs a trainer.Task, got {type(task).__name__}.")
        self._task = task
        task._trainer = self
        self.state.stage = stage
        self.dispatcher = CallbackDispatcher(self, task, self.callbacks)
        self.strategy.setup_environment()
        self.precision = Precision(self.precision_name, self.strategy.root_device, self.strategy)
        self._train_results = ResultCollection(True, self.strategy, self.callback_metrics, self.progress_bar_metrics)
        self._eval_results = ResultCollection(False, self.strategy, self.callback_metrics, self.progress_bar_metrics)
        self.results = self._train_results
        status = "failed"
        try:
            result = body()
            status = "success"
            return result
        except BaseException as error:
            if isinstance(error, (KeyboardInterrupt, TrainingPreempted)):
                status = "interrupted"
            if not isinstance(error, TrainingPreempted):
                # Every rank stops together on a preemption; after anything else the others may be stuck.
                self.strategy.on_stage_failure()
            self.dispatcher.fire(Callback.on_exception, error)
            raise
        finally:
            try:
                self.dispatcher.fire(Callback.teardown, stage)
                if self.is_global_zero:
                    for logger in self.loggers:
                        logger.finalize(status)
            finally:
                self.strategy.teardown()
                self.state.stage = ""

    def _fit(self, train_dataloaders: Any, val_dataloaders: Any, ckpt_path: Any) -> None:
        task, strategy = self.task, self.strategy
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            # An elastic agent restarted the group after a failure: continue from the newest last.ckpt
            # (collective), or from where the first attempt started when none was written yet.
            ckpt_path = persistence.find_last_checkpoint(self) or ckpt_path
        checkpoint = persistence.read_checkpoint(self, ckpt_path)
        if checkpoint is not None:
            for logger, state in zip(self.loggers, checkpoint.get("loggers", [])):
                logger.load_state_dict(state)
        self._share_logger_state()
        self.dispatcher.fire(Callback.setup, "fit")
        loader = train_dataloaders if train_dataloaders is not None else task.train_dataloader()
        self.train_dataloader = self._prepare_loader(loader)
        self.num_training_batches = limit_batches(
            self.train_dataloader, self.limit_train_batches, "limit_train_batches"
        )
        self._set_val_loaders(val_dataloaders if val_dataloaders is not None else task.val_dataloader())
        strategy.setup(task)
        self.optim = parse_optimizers(task.configure_optimizers(), type(task).__name__)
        strategy.setup_optimizer(self.optim.optimizer)
        self._fit_loop = FitLoop(self)
        if checkpoint is not None:
            persistence.restore(self, checkpoint)
        self.dispatcher.fire(Callback.on_fit_start)
        if self.is_global_zero:
            for logger in self.loggers:
                logger.log_hyperparams(to_primitive(task.hparams))
        self._sanity_check()
        # What exists now (imports, the task, the data) lives through training: freeze it, so that the
        # garbage collector's full passes during training walk only objects made since, rather than
        # pausing the loop for the whole heap (100-200 ms each on a heap with torch imported).
        gc.collect()
        gc.freeze()
        self.preemption.install()
        try:
            self._fit_loop.run()
        finally:
            self.preemption.uninstall()
            gc.unfreeze()
        self.dispatcher.fire(Callback.on_fit_end)

    def _evaluate(self, stage: str, dataloaders: Any, ckpt_path: Any) -> Any:
        task = self.task
        checkpoint = persistence.read_checkpoint(self, ckpt_path)
        self._share_logger_state()
        self.dispatcher.fire(Callback.setup, stage)
        if dataloaders is None:
            dataloaders = getattr(task, _LOADER_METHODS[stage])()
        if dataloaders is None:
            raise ValueError(
                f"Trainer.{stage} has no data: pass `dataloaders=` or override "
                f"{type(task).__name__}.{_LOADER_METHODS[stage]}()."
            )
        loaders = [self._prepare_loader(d, evaluation=True) for d in _as_list(dataloaders)]
        limit = self.limit_val_batches if stage == "validate" else None
        num_batches = [limit_batches(d, limit, "limit_val_batches") for d in loaders]
        self.strategy.setup(task)
        if checkpoint is not None:
            require_entries(checkpoint, ("state_dict",), checkpoint.get("loaded_from", ckpt_path))
            task.load_state_dict(checkpoint["state_dict"])
        self.results = self._eval_results
        metrics, predictions = run_evaluation(self, stage, loaders, num_batches)
        self.log_metrics(metrics)
        if stage == "predict":
            return predictions
        return [{name: float(value) for name, value in metrics.items()}]

    def _share_logger_state(self) -> None:
        """Make every rank's loggers agree with rank 0's (its run directory), so `log_dir` is one path."""
        if self.world_size == 1 or not self.loggers:
            return
        states = [logger.state_dict() for logger in self.loggers] if self.is_global_zero else None
        # Collective: rank 0 picked the version directory; the others adopt it.
        states = self.strategy.broadcast_object(states)
        if not self.is_global_zero:
            for logger, state in zip(self.loggers, states):
                logger.load_state_dict(state)

    # -------------------------------------------------------------- validation
    def _set_val_loaders(self, loaders: Any) -> None:
        self.val_dataloaders = (
            [self._prepare_loader(d, evaluation=True) for d in _as_list(loaders)] if loaders is not None else []
        )
        self.num_val_batches = [
            limit_batches(d, self.limit_val_batches, "limit_val_batches") for d in self.val_dataloaders
        ]
        interval = self.val_check_interval
        #: Training batches between validations: a float for fractions of an epoch, so that e.g. 0.25
        #: validates after batches 110, 220, 330 and 439 of 439 rather than 109, 218, 327, 436 and 439.
        self._val_every: float | None = None
        if isinstance(interval, float):
            if interval < 1.0 and self.num_training_batches != math.inf:
                self._val_every = max(1.0, self.num_training_batches * interval)
        else:
            self._val_every = float(interval)

    def validation_due(self, batch_idx: int, is_last: bool) -> bool:
        """Whether validation runs after training batch `batch_idx` of this epoch."""
        if not any(self.num_val_batches):
            return False
        if is_last and isinstance(self.val_check_interval, float):
            return True
        every = self._val_every
        # Due when this batch crosses a multiple of `every`.
        return every is not None and int((batch_idx + 1) / every) > int(batch_idx / every)

    def run_validation(self) -> None:
        """Validate during fit, without moving the training RNG streams."""
        with isolated_rng():
            self.results = self._eval_results
            try:
                metrics, _ = run_evaluation(self, "validate", self.val_dataloaders, self.num_val_batches)
            finally:
                self.results = self._train_results
        self.log_metrics(metrics)

    def _sanity_check(self) -> None:
        steps = self.num_sanity_val_steps
        if steps == 0 or not any(self.num_val_batches):
            return
        limits = [math.inf if steps == -1 else min(steps, n) for n in self.num_val_batches]
        saved_metrics = dict(self.callback_metrics), dict(self.progress_bar_metrics)
        self.state.sanity_checking = True
        self.dispatcher.fire(Callback.on_sanity_check_start)
        with isolated_rng():
            self.results = self._eval_results
            try:
                run_evaluation(self, "validate", self.val_dataloaders, limits)
            finally:
                self.results = self._train_results
                self._eval_results.reset()
        self.dispatcher.fire(Callback.on_sanity_check_end)
        self.state.sanity_checking = False
        # Sanity metrics come from a few batches of an untrained task: nobody should act on them.
        self.callback_metrics.clear()
        self.callback_metrics.update(saved_metrics[0])
        self.progress_bar_metrics.clear()
        self.progress_bar_metrics.update(saved_metrics[1])

    # ----------------------------------------------------------------- logging
    def flush_step_logs(self, force: bool = False) -> None:
        """Send the step values to the loggers when a logging step is reached (or `force`)."""
        if not force and self.state.global_step % self.log_every_n_steps:
            return
        logs = self.results.pop_step_logs()
        if logs:
            self.log_metrics({**logs, **self.strategy.communication_stats()})

    def log_metrics(self, metrics: dict[str, Tensor | float]) -> None:
        """Write `metrics` to every logger (rank 0) at the current global step."""
        if not metrics:
            return
        values = {name: float(value) for name, value in metrics.items()}  # host sync: logging step only
        values["epoch"] = float(self.state.current_epoch)
        self.logged_metrics.update(values)
        if self.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(values, self.state.global_step)

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint of everything a bit-exact resume needs. Call it on every process."""
        checkpoint = persistence.checkpoint_state(self)
        if self.is_global_zero:
            save_checkpoint(checkpoint, path)
        # Collective: nobody reads the file before rank 0 has finished writing it.
        self.strategy.barrier()

    def save_preemption_checkpoint(self) -> str:
        """Write ``last.ckpt`` where the first ModelCheckpoint keeps it (else `default_root_dir`); return its path."""
        callback = self.checkpoint_callback
        directory = getattr(callback, "dirpath", None) or self.default_root_dir
        path = os.path.abspath(os.path.join(directory, "last.ckpt"))
        self.save_checkpoint(path)  # collective
        return path

    # -------------------------------------------------------------------- data
    def _prepare_loader(self, loader: Any, evaluation: bool = False) -> Any:
        if not (self.use_distributed_sampler and isinstance(loader, DataLoader)):
            return loader
        if evaluation:
            # Every sample exactly once, so metrics over several processes equal the one-process values.
            return with_evaluation_sampler(loader, self.strategy.distributed_sampler_kwargs)
        return with_distributed_sampler(loader, self.strategy.distributed_sampler_kwargs, seed=self.seed or 0)


def _task_argument(stage: str, task: Task | None, model: Task | None) -> Task:
    """Return the task given positionally or as `model=` (Lightning's keyword), exactly one of them."""
    if (task is None) == (model is None):
        raise TypeError(f"Trainer.{stage} takes one task: pass it positionally or as model=..., not both or neither.")
    return task if task is not None else model  # type: ignore[return-value]


#: The accelerators `Trainer(accelerator=...)` accepts, and the device type each means.
ACCELERATORS = {"auto": None, "cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def _device_type(accelerator: str, devices: int) -> str | None:
    """Check `accelerator` against the machine and return its device type (None for "auto")."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"Unknown accelerator {accelerator!r}. Valid values: {', '.join(ACCELERATORS)}.")
    device_type = ACCELERATORS[accelerator]
    if device_type == "cuda":
        available = torch.cuda.device_count()
        if available == 0:
            raise ValueError(f"accelerator={accelerator!r} but no CUDA device is visible; use 'cpu' or 'auto'.")
        if devices > available:
            raise ValueError(f"devices={devices} with accelerator={accelerator!r}, but only {available} GPU(s).")
    return device_type


def _check_joinable(strategy: Strategy, accumulate_grad_batches: int) -> None:
    """Refuse uneven_inputs="join" where a joined rank could not shadow the others' collectives."""
    if not (isinstance(strategy, Joinable) and strategy.supports_join):
        raise OptionError(
            f"Trainer(uneven_inputs='join'): strategy {strategy.name or type(strategy).__name__!r} cannot shadow "
            "its collectives on a rank whose data ran out. Use strategy='bucketed_ddp' or 'native_ddp', or "
            "uneven_inputs='check' with the same number of batches on every rank."
        )
    if accumulate_grad_batches != 1:
        raise OptionError(
            f"Trainer(uneven_inputs='join', accumulate_grad_batches={accumulate_grad_batches}): join shadows "
            "one step per batch; use accumulate_grad_batches=1, or uneven_inputs='check' with even data."
        )
    try:
        strategy.enable_join()
    except ValueError as error:
        raise OptionError(str(error)) from None


def _check_options(options: dict[str, Any]) -> None:
    """Check every numeric argument of `Trainer.__init__` (its `locals()`), each with one clear message."""
    check_int("Trainer", "max_epochs", options["max_epochs"], 0, none_ok=True)
    check_int("Trainer", "max_steps", options["max_steps"], -1, meaning="-1 for no limit")
    check_int("Trainer", "devices", options["devices"], 1)
    check_int("Trainer", "accumulate_grad_batches", options["accumulate_grad_batches"], 1)
    check_number("Trainer", "gradient_clip_val", options["gradient_clip_val"], above=0, none_ok=True)
    check_int("Trainer", "log_every_n_steps", options["log_every_n_steps"], 1)
    check_int("Trainer", "num_sanity_val_steps", options["num_sanity_val_steps"], -1, meaning="-1 for all batches")
    check_int("Trainer", "seed", options["seed"], 0, none_ok=True)
    check_int("Trainer", "max_restarts", options["max_restarts"], 0, meaning="restarts of the worker group")
    for name in ("limit_train_batches", "limit_val_batches"):
        limit = options[name]
        if isinstance(limit, float):
            check_number("Trainer", name, limit, minimum=0, meaning="a float is a fraction of the batches, up to 1.0")
            if limit > 1.0:
                raise OptionError(
                    f"Trainer({name}={limit!r}): a float is a fraction up to 1.0; pass an int of batches."
                )
        else:
            check_int("Trainer", name, limit, 0, none_ok=True, meaning="batches; or a float fraction in [0, 1]")
    interval = options["val_check_interval"]
    if isinstance(interval, float):
        if not (0 < interval <= 1.0):
            raise OptionError(
                f"Trainer(val_check_interval={interval!r}): a float is a fraction of the epoch in (0, 1]; "
                "pass an int for a number of batches."
            )
    else:
        check_int("Trainer", "val_check_interval", interval, 1, meaning="batches; or a float fraction in (0, 1]")


def _as_list(loaders: Any) -> list[Any]:
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
