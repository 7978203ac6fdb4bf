"""The Trainer's arguments: each checked with one clear message, and Lightning's spellings resolved.

`TrainerConf` in `config.py` is generated from these arguments for the command line; what they may hold is
decided here, before anything is launched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from syncline.callbacks.callback import Callback
from syncline.callbacks.logger import Logger
from syncline.options import OptionError, check_arguments, check_int, check_number
from syncline.rank_zero import rank_zero_info, rank_zero_warn
from syncline.strategies.comm.join import Joinable
from syncline.strategies.registry import LIGHTNING_STRATEGIES, resolve_strategy
from syncline.strategies.strategy import Strategy
from syncline.trainer.debugging import check_debugging_flags
from syncline.trainer.nonfinite import NONFINITE_LOSS
from syncline.trainer.persistence import CKPT_READ
from syncline.trainer.precision import PRECISIONS
from syncline.trainer.preemption import PREEMPTION_SIGNALS
from syncline.trainer.uneven import UNEVEN_INPUTS

__all__ = [
    "ACCELERATORS",
    "LIGHTNING_STRATEGIES",
    "TIMELINE_ENV",
    "add_timer",
    "build_callbacks",
    "build_loggers",
    "check_options",
    "default_max_epochs",
    "device_type",
    "merge_task_callbacks",
    "resolve_devices",
    "strategy_of",
]

#: An environment variable naming a Chrome-trace file: every `fit` then records its steps there (rank 0 writes
#: it), as a `CommunicationTimeline` in the callbacks would. The network lab sets it to time a user's job.
TIMELINE_ENV = "SYNCLINE_TIMELINE"
#: The accelerators `Trainer(accelerator=...)` accepts, and the device type each means.
ACCELERATORS = {"auto": None, "cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}
#: The values of `Trainer(recovery=...)`: restart from the newest checkpoint, or recover in place.
RECOVERIES = ("checkpoint", "live")


def check_options(options: dict[str, Any]) -> None:
    """Check every argument of `Trainer.__init__` (its `locals()`), each with one clear message.

    Raises:
        OptionError: a value the argument does not allow; the message names it and what is allowed.
    """
    from syncline.trainer.trainer import Trainer

    # Types first (a flag is True or False, never a truthy string such as "no"); then the values.
    check_arguments("Trainer", Trainer.__init__, {k: v for k, v in options.items() if k != "self"})
    check_int("Trainer", "max_epochs", options["max_epochs"], -1, none_ok=True, meaning="-1 for no limit")
    check_int("Trainer", "max_steps", options["max_steps"], -1, meaning="-1 for no limit")
    check_int("Trainer", "min_epochs", options["min_epochs"], 0, none_ok=True)
    check_int("Trainer", "min_steps", options["min_steps"], 0, none_ok=True)
    check_int(
        "Trainer",
        "check_val_every_n_epoch",
        options["check_val_every_n_epoch"],
        1,
        none_ok=True,
        meaning="None: validate every val_check_interval batches counted across epochs",
    )
    if options["check_val_every_n_epoch"] is None and isinstance(options["val_check_interval"], float):
        raise OptionError(
            f"Trainer(check_val_every_n_epoch=None, val_check_interval={options['val_check_interval']!r}): "
            "val_check_interval must be an int (training batches, counted across epochs) when "
            "check_val_every_n_epoch=None."
        )
    check_int("Trainer", "reload_dataloaders_every_n_epochs", options["reload_dataloaders_every_n_epochs"], 0)
    check_int("Trainer", "accumulate_grad_batches", options["accumulate_grad_batches"], 1)
    check_number("Trainer", "gradient_clip_val", options["gradient_clip_val"], above=0, none_ok=True)
    check_int("Trainer", "log_every_n_steps", options["log_every_n_steps"], 1)
    check_int("Trainer", "num_sanity_val_steps", options["num_sanity_val_steps"], -1, meaning="-1 for all batches")
    check_int("Trainer", "seed", options["seed"], 0, none_ok=True)
    check_int("Trainer", "max_restarts", options["max_restarts"], 0, meaning="restarts of the worker group")
    _check_choice("recovery", options["recovery"], RECOVERIES)
    check_int("Trainer", "num_nodes", options["num_nodes"], 1, meaning="machines, each running this script")
    _check_nodes(options["num_nodes"], options["recovery"])
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
        limit = options[name]
        if limit == 1 and not isinstance(limit, bool):
            # As Lightning says it: 1 and 1.0 mean different things, and a port may have meant the other.
            what = "1 batch per epoch" if name == "limit_train_batches" else "1 batch"
            if isinstance(limit, float):
                what = "100% of the batches per epoch" if name == "limit_train_batches" else "100% of the batches"
            rank_zero_info(f"`Trainer({name}={limit!r})` was configured so {what} will be used.")
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
    check_debugging_flags(options["fast_dev_run"], options["overfit_batches"])
    _check_choice("ckpt_read", options["ckpt_read"], CKPT_READ)
    if options["gradient_clip_algorithm"] is not None:
        _check_choice("gradient_clip_algorithm", options["gradient_clip_algorithm"], ("norm", "value"))
    _check_choice("nonfinite_loss", options["nonfinite_loss"], NONFINITE_LOSS)
    _check_choice("uneven_inputs", options["uneven_inputs"], UNEVEN_INPUTS)
    signal = options["preemption_signal"]
    if signal is not None and signal not in PREEMPTION_SIGNALS:
        raise OptionError(
            f"Trainer(preemption_signal={signal!r}): use one of {', '.join(PREEMPTION_SIGNALS)}, "
            "or None for Ctrl-C only."
        )
    precision = options["precision"]
    if str(precision) not in PRECISIONS:
        raise OptionError(
            f"Unknown precision {precision!r}. Valid values: {', '.join(PRECISIONS)} (64-bit and '-true' half "
            "precisions are not supported)."
        )


def default_max_epochs(max_epochs: int | None, max_steps: int, max_time: Any, callbacks: Any) -> int:
    """Return `max_epochs` as Lightning settles it: unset, it is 1000 (with a warning) unless `max_steps`,
    `max_time` or a `Timer` limits training, and -1 (no limit) then."""
    if max_epochs is not None:
        return max_epochs
    from syncline.callbacks.timer import Timer

    timed = max_time is not None or any(isinstance(c, Timer) for c in _as_list(callbacks))
    if max_steps == -1 and not timed:
        rank_zero_warn(
            "`max_epochs` was not set. Setting it to 1000 epochs. To train without an epoch limit, set `max_epochs=-1`."
        )
        return 1000
    return -1


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    return [callbacks] if isinstance(callbacks, Callback) else list(callbacks)


def add_timer(callbacks: list[Callback], max_time: Any) -> None:
    """Add a `Timer` that stops training after `max_time`, as `Trainer(max_time=...)` does in Lightning.

    Raises:
        OptionError: `max_time` is given and a Timer is among the callbacks too.
    """
    if max_time is None:
        return
    from syncline.callbacks.timer import Timer

    if any(isinstance(c, Timer) for c in callbacks):
        raise OptionError("Trainer(max_time=...) adds a Timer, and callbacks has one too: pass only one of them.")
    callbacks.insert(0, Timer(duration=max_time, interval="step"))


def _check_nodes(num_nodes: int, recovery: str) -> None:
    """Several nodes are launched by the Trainer under ``recovery="live"`` only; torchrun's agent cannot run it."""
    from syncline.trainer.launcher import launched_by_torchrun
    from syncline.trainer.live_launch import inside_live_worker

    if inside_live_worker():
        return
    if recovery == "live" and launched_by_torchrun():
        raise OptionError(
            'Trainer(recovery="live") under torchrun: torchrun\'s agent restarts every worker of every node after '
            "any failure. Start the script itself on each node instead (python train.py, with MASTER_ADDR, "
            'MASTER_PORT and NODE_RANK set) with Trainer(num_nodes=N, recovery="live").'
        )
    if num_nodes > 1 and recovery != "live" and not launched_by_torchrun():
        raise OptionError(
            f'Trainer(num_nodes={num_nodes}) launches the nodes itself under recovery="live" only; with '
            f'recovery="checkpoint", run each node under torchrun --nnodes {num_nodes} --node-rank i.'
        )


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise OptionError(f"Trainer({name}={value!r}): {name} must be one of {', '.join(choices)}.")


def device_type(accelerator: str, devices: int) -> str | None:
    """Check `accelerator` against the machine and return its device type (None for "auto")."""
    if accelerator not in ACCELERATORS:
        raise OptionError(f"Unknown accelerator {accelerator!r}. Valid values: {', '.join(ACCELERATORS)}.")
    kind = ACCELERATORS[accelerator]
    if kind is None and devices > 1 and 0 < torch.cuda.device_count() < devices:
        # As Lightning: "auto" means the GPUs on a GPU machine, and there are too few for one per process.
        raise OptionError(
            f"devices={devices} with accelerator='auto' needs {devices} GPUs, and {torch.cuda.device_count()} "
            f"is visible: pass accelerator='cpu' to run {devices} processes on the CPU, or devices<="
            f"{torch.cuda.device_count()}."
        )
    if kind == "cuda":
        available = torch.cuda.device_count()
        if available == 0:
            raise OptionError(f"accelerator={accelerator!r} but no CUDA device is visible; use 'cpu' or 'auto'.")
        if devices > available:
            raise OptionError(f"devices={devices} with accelerator={accelerator!r}, but only {available} GPU(s).")
    return kind


def resolve_devices(devices: int | str, accelerator: str) -> int:
    """Return the number of processes `devices` asks for, Lightning's spellings included.

    An int or a string of digits is that many processes; "auto" is every GPU on a GPU machine (one process
    on the CPU); -1 is every GPU.
    """
    gpus = torch.cuda.device_count() if ACCELERATORS.get(accelerator, "") in (None, "cuda") else 0
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if devices == "auto":
        return max(gpus, 1)
    if devices == -1:
        if not gpus:
            raise OptionError(
                "Trainer(devices=-1) means every GPU, and none is visible; pass devices=N for N processes on the CPU."
            )
        return gpus
    check_int("Trainer", "devices", devices, 1, meaning="processes; or 'auto', or -1 for every GPU")
    return int(devices)


def strategy_of(strategy: str | Strategy, devices: int, accumulate_grad_batches: int, uneven_inputs: str) -> Strategy:
    """Return the Strategy `strategy` names (Lightning's "ddp" is `native_ddp`), checked against the other options."""
    resolved = resolve_strategy(strategy, devices)  # Lightning's names too, case-insensitively
    if uneven_inputs == "join":
        _check_joinable(resolved, accumulate_grad_batches)
    if devices > 1 and not resolved.multi_process:
        raise OptionError(
            f"devices={devices} needs a data-parallel strategy, but {resolved!r} trains in one "
            "process. Use strategy='auto', 'bucketed_ddp' or 'native_ddp', or devices=1."
        )
    return resolved


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


def build_loggers(logger: bool | Logger | Sequence[Logger], default_root_dir: str) -> list[Logger]:
    """Return the loggers `Trainer(logger=...)` asks for: True is a TensorBoardLogger under `default_root_dir`."""
    if logger is True:
        from syncline.callbacks.tensorboard import TensorBoardLogger

        return [TensorBoardLogger(save_dir=default_root_dir)]
    if logger is False or logger is None:
        return []
    if isinstance(logger, Logger):
        return [logger]
    loggers = list(logger)
    for item in loggers:
        if not isinstance(item, Logger):
            raise TypeError(f"logger entries must be callbacks.Logger instances, got {type(item).__name__}.")
    return loggers


def build_callbacks(
    callbacks: Sequence[Callback] | Callback | None, checkpointing: bool, progress_bar: bool, summary: bool = True
) -> list[Callback]:
    """Return the callbacks, with a ProgressBar, a ModelSummary and a ModelCheckpoint unless switched off;
    checkpoints last."""
    from syncline.callbacks.model_checkpoint import ModelCheckpoint
    from syncline.callbacks.model_summary import ModelSummary
    from syncline.callbacks.progress import ProgressBar
    from syncline.callbacks.timeline import CommunicationTimeline

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
    if summary and not any(isinstance(c, ModelSummary) for c in result):
        result.append(ModelSummary())
    if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in result):
        result.append(ModelCheckpoint())
    trace = os.environ.get(TIMELINE_ENV)
    if trace and not any(isinstance(c, CommunicationTimeline) for c in result):
        # The network lab asks every fit for its step times, whatever script or command line runs it.
        result.append(CommunicationTimeline(trace, num_steps=None))
    # Checkpoints go last, so the state they save includes what other callbacks did at the same event.
    result.sort(key=lambda c: isinstance(c, ModelCheckpoint))
    if not checkpointing and any(isinstance(c, ModelCheckpoint) for c in result):
        raise OptionError("enable_checkpointing=False but a ModelCheckpoint was passed in callbacks; drop one.")
    return result


def merge_task_callbacks(
    callbacks: list[Callback], returned: Sequence[Callback] | Callback | None, task_name: str
) -> list[Callback]:
    """Return the Trainer's `callbacks` with those `Task.configure_callbacks` returned, as Lightning merges them.

    A returned callback replaces every Trainer callback of exactly its type (not of a subclass or base class);
    the others keep their order, the task's follow, and ModelCheckpoints move to the end, in their order.

    Raises:
        TypeError: something returned is not a `Callback`.
    """
    from syncline.callbacks.model_checkpoint import ModelCheckpoint

    if not returned:
        return callbacks
    own = [returned] if isinstance(returned, Callback) else list(returned)
    bad = [type(c).__name__ for c in own if not isinstance(c, Callback)]
    if bad:
        raise TypeError(f"{task_name}.configure_callbacks() must return Callback instances, got {', '.join(bad)}.")
    replaced = {type(c) for c in own} & {type(c) for c in callbacks}
    if replaced:
        names = ", ".join(sorted(kind.__name__ for kind in replaced))
        rank_zero_info(f"{task_name}.configure_callbacks() replaces the Trainer's callbacks of type {names}.")
    merged = [c for c in callbacks if type(c) not in replaced] + own
    # Checkpoints go last, so the state they save includes what other callbacks did at the same event.
    return sorted(merged, key=lambda c: isinstance(c, ModelCheckpoint))
