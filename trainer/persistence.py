"""What a Trainer saves and restores: checkpoints, and the state a launched rank 0 sends back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from syncline.callbacks.callback import Callback
from syncline.callbacks.versioned_logger import VersionedLogger
from syncline.checkpoint_file import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointNotFoundError,
    load_checkpoint,
    require_entries,
    to_primitive,
)
from syncline.rank_zero import rank_zero_info, rank_zero_warn
from syncline.rng import training_rng
from syncline.trainer.datamodule import datamodule_checkpoint

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

#: Who reads `ckpt_path`: every rank itself, or rank 0, which broadcasts what it read.
CKPT_READ = ("every_rank", "rank_zero")

__all__ = [
    "CKPT_READ",
    "CheckpointPathError",
    "apply_worker_result",
    "best_checkpoint",
    "checkpoint_state",
    "find_last_checkpoint",
    "last_checkpoint_folders",
    "read_checkpoint",
    "restore_model",
    "restore_training",
    "resume_summary",
    "save_last_checkpoint",
    "open_checkpoint",
    "worker_result",
]


class CheckpointPathError(CheckpointError, ValueError):
    """`ckpt_path` names no checkpoint ("best" without one, an unknown word); a ValueError, as in Lightning."""


class _UnknownCheckpointPath(CheckpointPathError, CheckpointNotFoundError):
    """`ckpt_path` is neither a file nor a name: a `FileNotFoundError` too, as Lightning's missing file."""


def checkpoint_state(trainer: Trainer, weights_only: bool = False) -> dict[str, Any]:
    """Assemble everything a bit-exact resume needs (a collective: call it on every rank, with one `weights_only`).

    Lightning's top-level keys (``epoch``, ``global_step``, ``state_dict``, ``hyper_parameters``,
    ``callbacks``, ``optimizer_states``, ``lr_schedulers``) are there too, so scripts that read a Lightning
    checkpoint read this one; they share their tensors with syncline's own keys, so the file is no larger.
    With `weights_only` (``ModelCheckpoint(save_weights_only=True)``) only the weights, hyperparameters and
    DataModule state are kept, as in Lightning: `load_from_checkpoint` reads it, a resume refuses it.
    """
    task, loop, optim, strategy = trainer.task, trainer.fit_loop, trainer.optim, trainer.strategy
    # An optimizer step still in flight (deferred updates) lands first: the weights saved are every step's.
    strategy.apply_pending_updates()
    hparams = to_primitive(task.hparams)
    checkpoint: dict[str, Any] = {
        "syncline_format": FORMAT_VERSION,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "state_dict": task.state_dict(),
        "hparams": hparams,
        "hyper_parameters": hparams,
    }
    if task.hparams_name is not None:
        checkpoint["hparams_name"] = task.hparams_name
    if task.hparams_type is not None:
        checkpoint["hparams_type"] = task.hparams_type
    # The DataModule's state under its class's name, as Lightning keeps it.
    checkpoint.update(datamodule_checkpoint(trainer.datamodule))
    if weights_only:
        checkpoint["weights_only"] = True
        task.on_save_checkpoint(checkpoint)  # the task's hook, not the callbacks', as in Lightning
        return checkpoint
    checkpoint |= {
        "progress": trainer.state.state_dict(),
        "world_size": trainer.world_size,
        # Collective: every rank's RNG, so each process resumes its own random stream. Training's, not
        # validation's: a checkpoint saved from a validation hook continues the training stream.
        "rng": strategy.all_gather_object({"now": training_rng(), "epoch_start": trainer.state.epoch_start_rng}),
        # The metrics the rest of the epoch acts on (a plateau scheduler, early stopping, a monitored
        # checkpoint), as the uninterrupted run has them.
        "callback_metrics": {
            name: value.detach().cpu() for name, value in trainer.callback_metrics.items() if isinstance(value, Tensor)
        },
        "loggers": [logger.state_dict() for logger in trainer.loggers],
    }
    sampler_seed = _train_sampler_seed(trainer)
    if sampler_seed is not None:
        checkpoint["sampler_seed"] = sampler_seed
    if optim is not None:
        # Collective for strategies that spread the optimizer state over ranks: the whole state, gathered.
        checkpoint["optimizer"] = optim.state_dict(strategy.optimizer_state_dict)
        states = checkpoint["optimizer"]
        checkpoint["optimizer_states"] = states.get("optimizers", [states["optimizer"]])
        checkpoint["lr_schedulers"] = checkpoint["optimizer"]["lr_schedulers"]
        checkpoint["precision"] = trainer.precision.state_dict() if trainer.precision is not None else {}
        checkpoint["results"] = trainer.train_results.state_dict(task)
    # Collective: every rank's part of the strategy's state (error feedback, warm-start factors...) and
    # its byte counters, so a resumed run logs the totals an uninterrupted one would.
    by_rank = strategy.all_gather_object((_to_cpu(strategy.state_dict()), strategy.comm_counter.state_dict()))
    checkpoint["strategy"] = {"name": strategy.name, "by_rank": [state for state, _ in by_rank]}
    checkpoint["comm_by_rank"] = [counter for _, counter in by_rank]
    if strategy.replicas_differ and optim is not None:
        # Collective: replicas differ between averagings, so every rank's weights and optimizer state.
        checkpoint["replicas_by_rank"] = strategy.all_gather_object(
            _to_cpu({"state_dict": task.state_dict(), "optimizer": optim.state_dict()})
        )
    if optim is not None:
        grads = loop.accumulated_grads()
        if grads is not None:
            grads = [None if g is None else g.cpu() for g in grads]
        # Collective: an open window's gradients are per process (not yet averaged): keep every rank's.
        checkpoint["accumulated_grads_by_rank"] = strategy.all_gather_object(grads)
    # As in Lightning: the callbacks' states, then their on_save_checkpoint hooks, then the task's.
    checkpoint["callbacks"] = {c.state_key: c.state_dict() for c in trainer.callbacks}
    trainer.dispatcher.fire(Callback.on_save_checkpoint, checkpoint)
    return checkpoint


def read_checkpoint(trainer: Trainer, ckpt_path: Any) -> dict[str, Any] | None:
    """Load the checkpoint `ckpt_path` names, or None for None.

    "last" is the newest last checkpoint, "best" the first ModelCheckpoint's best; anything else is a path.
    A collective: rank 0 resolves "last", and every rank reads the one file it chose. If any rank cannot
    read it, every rank raises the same error naming those ranks (none waits for the others forever).

    Raises:
        CheckpointError: "best" without a best checkpoint, a word that is neither of these nor a file, or
            a file some rank cannot read.
    """
    if ckpt_path is None:
        return None
    if (
        ckpt_path not in ("best", "last")
        and not Path(ckpt_path).exists()
        and not any(c in str(ckpt_path) for c in "/\\.")
    ):
        raise _UnknownCheckpointPath(
            f"Checkpoint file not found: {ckpt_path}. ckpt_path={str(ckpt_path)!r} is neither a file nor one of "
            "the names: 'best' (the ModelCheckpoint's best), 'last' (the newest last checkpoint), a path, or None."
        )
    if ckpt_path == "best":
        path: str | None = best_checkpoint(trainer)
    else:
        path = find_last_checkpoint(trainer) if ckpt_path == "last" else str(ckpt_path)
    if path is None:
        rank_zero_warn(
            f'ckpt_path="last" is set, but there is no last checkpoint (last*.ckpt) in this run\'s checkpoint '
            f"folders ({', '.join(str(f) for f in last_checkpoint_folders(trainer))}); no checkpoint is loaded and "
            "training starts from scratch. Save one with ModelCheckpoint(save_last=True)."
        )
        return None
    if trainer.ckpt_read == "rank_zero" and trainer.world_size > 1:
        return _read_on_rank_zero(trainer, path)
    checkpoint, problem, missing = None, None, False
    try:
        checkpoint = load_checkpoint(path)
    except CheckpointError as error:
        problem, missing = str(error), isinstance(error, FileNotFoundError)
    # Collective: every rank learns which ranks could read the file, so all load or all raise.
    problems = trainer.strategy.all_gather_object(problem)
    failed = [rank for rank, problem in enumerate(problems) if problem is not None]
    if failed and trainer.world_size == 1:
        raise (CheckpointNotFoundError if missing else CheckpointError)(problems[0])
    if failed:
        ranks = ", ".join(str(rank) for rank in failed)
        everywhere = len(failed) == trainer.world_size and missing  # the file is missing on every rank
        raise (CheckpointNotFoundError if everywhere else CheckpointError)(
            f"Checkpoint {path} cannot be read on rank(s) {ranks} of {trainer.world_size}: {problems[failed[0]]} "
            "Every rank reads the checkpoint: put it on a file system all nodes share, copy it to the same "
            'path on every node, or pass Trainer(ckpt_read="rank_zero") to read it on rank 0 alone.'
        )
    checkpoint["loaded_from"] = path
    return checkpoint


def _read_on_rank_zero(trainer: Trainer, path: str) -> dict[str, Any]:
    """Read `path` on rank 0 and send it to every rank (checkpoints on node-local disks)."""
    checkpoint: Any = None
    if trainer.is_global_zero:
        try:
            checkpoint = load_checkpoint(path)
        except CheckpointError as error:
            checkpoint = error
    # Collective: rank 0's checkpoint (pickled, so it passes through host memory once per rank), or its error.
    checkpoint = trainer.strategy.broadcast_object(checkpoint)
    if isinstance(checkpoint, CheckpointError):
        raise checkpoint
    checkpoint["loaded_from"] = path
    return checkpoint


def best_checkpoint(trainer: Trainer) -> str:
    """Return the path of the first ModelCheckpoint's best checkpoint, as ``ckpt_path="best"`` means it.

    Raises:
        CheckpointPathError: no ModelCheckpoint, or it has saved no best checkpoint yet.
    """
    callback = trainer.checkpoint_callback
    if callback is None:
        raise CheckpointPathError(
            'ckpt_path="best" is set but no ModelCheckpoint is configured; pass a path or "last" instead.'
        )
    path = getattr(callback, "best_model_path", "")
    if not path and trainer.fast_dev_run:
        stage = trainer.state.fn or "test"
        raise CheckpointPathError(
            f'You cannot execute `.{stage}(ckpt_path="best")` with `fast_dev_run=True` (it saves no checkpoint). '
            f"Please pass an exact checkpoint path to `.{stage}(ckpt_path=...)`, or the task itself."
        )
    if not path:
        raise CheckpointPathError(
            'ckpt_path="best" is set but the ModelCheckpoint has saved no checkpoint yet (fit first, or pass a path).'
        )
    return path


def find_last_checkpoint(trainer: Trainer) -> str | None:
    """Return rank 0's newest ``last*.ckpt`` in this run's checkpoint folders, or None when there is none.

    Only last checkpoints count, as in Lightning: a top-k file is never taken for the last one. Only this
    trainer's folders are searched (`last_checkpoint_folders`), so another experiment's file beside them
    is never resumed. A collective: only rank 0 searches, and every rank gets its answer.
    """
    newest = None
    if trainer.is_global_zero:
        found = [
            path
            for folder in last_checkpoint_folders(trainer)
            if folder.is_dir()
            for path in folder.glob("last*.ckpt")
            if path.is_file()
        ]
        if found:
            newest = str(max(found, key=lambda p: p.stat().st_mtime))
    # Collective: every rank resumes from the file rank 0 chose, or none does.
    return trainer.strategy.broadcast_object(newest)


def last_checkpoint_folders(trainer: Trainer) -> list[Path]:
    """Return the folders where this trainer writes its last checkpoints, each searched without its subfolders.

    A ModelCheckpoint's `dirpath` when given. Without one it saves in ``<log_dir>/checkpoints``, and a resume
    continues the checkpointed run's version folder, so every ``<save_dir>/<name>/<version>/checkpoints`` of
    the first logger counts (only the given version's when the logger has one), or
    ``<default_root_dir>/checkpoints`` without a logger. With no ModelCheckpoint, a preemption saves in
    `default_root_dir` itself.
    """
    callbacks = trainer.checkpoint_callbacks
    if not callbacks:
        return [Path(trainer.default_root_dir)]
    folders: list[Path] = []
    for callback in callbacks:
        given = getattr(callback, "_given_dirpath", None)
        if given is not None:
            folders.append(Path(given))
        elif isinstance(trainer.logger, VersionedLogger) and trainer.logger._given_version is None:
            runs = Path(trainer.logger.root_dir)
            folders.extend(sorted(runs.glob("*/checkpoints")) if runs.is_dir() else [])
        else:
            folders.append(Path(trainer.log_dir, "checkpoints"))
    return list(dict.fromkeys(folders))


def restore_model(trainer: Trainer, checkpoint: dict[str, Any], callbacks: bool) -> None:
    """Restore the task's weights (and with `callbacks`, the callbacks' state), as Lightning does before
    `configure_optimizers`: the task's ``on_load_checkpoint`` first, then the callbacks'."""
    task = trainer.task
    source = checkpoint.get("loaded_from", "The checkpoint")
    if callbacks and checkpoint.get("weights_only"):
        raise CheckpointError(
            f"Checkpoint {source} holds the weights only (ModelCheckpoint(save_weights_only=True)): it has no "
            "optimizer, progress or RNG state to resume fit from. Resume from a full checkpoint, or load it with "
            f"{type(task).__name__}.load_from_checkpoint(path) and start a new fit without ckpt_path."
        )
    require_entries(checkpoint, _RESUME_ENTRIES if callbacks else ("state_dict",), source)
    if callbacks:
        trainer.dispatcher.fire(Callback.on_load_checkpoint, checkpoint)
    else:
        task.on_load_checkpoint(checkpoint)  # validate, test and predict restore no callback
    check_model_shapes(task, checkpoint["state_dict"], source)
    task.load_state_dict(checkpoint["state_dict"])
    if not callbacks:
        return
    saved_callbacks = checkpoint.get("callbacks", {})
    found = {id(c): _saved_key(c, saved_callbacks) for c in trainer.callbacks}
    absent = [key for key, state in saved_callbacks.items() if state and key not in found.values()]
    if absent:
        rank_zero_warn(
            "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided "
            f"during `Trainer` instantiation. Please add the following callbacks: {absent}."
        )
    for callback in trainer.callbacks:
        key = found[id(callback)]
        if key is not None:
            callback.load_state_dict(saved_callbacks[key])


def _saved_key(callback: Callback, saved: dict[str, Any]) -> str | None:
    """Return the key of `callback`'s state in a checkpoint's ``callbacks`` (its current or an older one)."""
    for key in (callback.state_key, *getattr(callback, "legacy_state_keys", ())):
        if key in saved:
            return key
    return None


def restore_training(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Restore the optimizer, progress, metrics and the point in the loop the checkpoint was taken."""
    loop, optim = trainer.fit_loop, trainer.optim
    assert optim is not None and trainer.precision is not None
    optim.load_state_dict(checkpoint["optimizer"], trainer.strategy.load_optimizer_state_dict)
    trainer.precision.load_state_dict(checkpoint.get("precision", {}))
    trainer.state.load_state_dict(checkpoint["progress"])
    trainer.train_results.load_state_dict(checkpoint.get("results", {}), trainer.task)
    trainer.callback_metrics.update(checkpoint.get("callback_metrics", {}))
    saved_world = int(checkpoint.get("world_size", len(checkpoint["rng"])))
    _restore_strategy(trainer, checkpoint, saved_world)
    if saved_world == trainer.world_size:
        loop.restore_accumulated_grads(_own_accumulated_grads(trainer, checkpoint))
    else:
        open_window = _own_accumulated_grads(trainer, checkpoint) is not None
        _adapt_to_world_size(trainer, saved_world, open_window)
    if "sampler_seed" in checkpoint and _train_sampler_seed(trainer) is not None:
        # The data order of the run being resumed, whatever `seed` the resumed run was given.
        trainer.train_dataloader.sampler.seed = checkpoint["sampler_seed"]
    rng_states = checkpoint["rng"]
    # A run resumed on more processes than it was saved with gives the extra ranks rank 0's streams.
    mine = rng_states[trainer.global_rank] if trainer.global_rank < len(rng_states) else rng_states[0]
    loop.resume_rng = mine["now"]
    trainer.state.epoch_start_rng = mine["epoch_start"]
    rank_zero_info(resume_summary(trainer, checkpoint))


def resume_summary(trainer: Trainer, checkpoint: dict[str, Any]) -> str:
    """Say which file a resumed fit read, where in training it continues, and what it restored."""
    state, optim = trainer.state, trainer.optim
    source = checkpoint.get("loaded_from", "the checkpoint")
    where = f"epoch {state.current_epoch}, global step {state.global_step}"
    if state.batch_idx:
        where += f", after batch {state.batch_idx} of the epoch"
    restored = ["the weights"]
    if optim is not None:
        optimizers = [type(o).__name__ for o in optim.optimizers]
        restored.append(f"optimizer state ({', '.join(optimizers)})")
        schedulers = len(checkpoint.get("lr_schedulers") or [])
        if schedulers:
            restored.append(f"{schedulers} learning-rate scheduler{'s' if schedulers > 1 else ''}")
    restored.append("the progress and random generators")
    if any((checkpoint.get("strategy") or {}).get("by_rank") or []):
        restored.append(f"the {trainer.strategy.name} strategy's state")
    if _own_accumulated_grads(trainer, checkpoint) is not None:
        restored.append("the open accumulation window's gradients")
    saved_callbacks = checkpoint.get("callbacks", {})
    # Those with a state to restore (not a ModelSummary's or a ProgressBar's empty one), under any of their keys.
    keys = [_saved_key(c, saved_callbacks) for c in trainer.callbacks]
    callbacks = [type(c).__name__ for c, key in zip(trainer.callbacks, keys) if key and saved_callbacks[key]]
    if callbacks:
        restored.append(f"callbacks ({', '.join(dict.fromkeys(callbacks))})")
    if checkpoint.get("loggers") and trainer.loggers:
        restored.append(f"the loggers' folder {trainer.log_dir}")
    return f"Resumed from {source} at {where}; restored {', '.join(restored)}."


#: What a resume of `fit` cannot do without.
_RESUME_ENTRIES = ("state_dict", "optimizer", "progress", "rng")


def check_model_shapes(task: Task, saved: dict[str, Any], source: str) -> None:
    """Raise one error naming the first parameter or buffer whose saved shape differs from the task's.

    Raises:
        CheckpointError: a missing, unexpected or differently shaped entry; names `source` and the entry.
    """
    expected = task.state_dict()
    name = type(task).__name__
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not fit {name}: missing {missing[:5]}, unexpected {unexpected[:5]}. Resume with "
            "the task (and hyperparameters) that wrote it."
        )
    for key, value in expected.items():
        shape = getattr(saved[key], "shape", None)
        if shape is not None and tuple(shape) != tuple(value.shape):
            raise CheckpointError(
                f"{source} does not fit {name}: parameter {key!r} was saved with shape {tuple(shape)}, the "
                f"task has {tuple(value.shape)}. Resume with the task (and hyperparameters) that wrote it."
            )


def _restore_strategy(trainer: Trainer, checkpoint: dict[str, Any], saved_world: int) -> None:
    """Give each rank its own part of the strategy's state (and its own replica where replicas differ).

    Raises:
        CheckpointError: the state belongs to another strategy or world size, or a stateful strategy's
            state is missing (unless the task's `strict_loading` is False); the message names the file.
    """
    strategy, rank = trainer.strategy, trainer.global_rank
    source = checkpoint.get("loaded_from", "The checkpoint")
    saved = checkpoint.get("strategy") or {"name": strategy.name, "by_rank": []}
    states: list[dict[str, Any]] = saved.get("by_rank") or []
    replicas = checkpoint.get("replicas_by_rank")
    if any(states) and saved.get("name") != strategy.name:
        raise CheckpointError(
            f"Checkpoint {source} holds per-rank state of strategy {saved.get('name')!r}, not of {strategy.name!r}; "
            f"resume with strategy={saved.get('name')!r}, or start a new run from the weights."
        )
    own = strategy.state_dict()
    if own and not any(states) and getattr(trainer.task, "strict_loading", True):
        raise CheckpointError(
            f"Checkpoint {source} holds no state of strategy {strategy.name!r} ({', '.join(sorted(own))} on every "
            "rank), which a bit-exact resume needs. Resume from a checkpoint this strategy wrote, or set "
            "`strict_loading = False` on the task to start the strategy's state afresh."
        )
    if saved_world != trainer.world_size:
        try:
            strategy.load_state_from_other_world(states)
        except ValueError as error:
            raise CheckpointError(f"Checkpoint {source} was saved on {saved_world} processes: {error}") from None
        return
    if replicas is not None:
        trainer.task.load_state_dict(replicas[rank]["state_dict"])
        assert trainer.optim is not None
        trainer.optim.load_state_dict(replicas[rank]["optimizer"])
    if any(states):
        strategy.load_state_dict(states[rank])
    counters = checkpoint.get("comm_by_rank")
    if counters:
        strategy.comm_counter.load_state_dict(counters[rank])


def _to_cpu(value: Any) -> Any:
    """Return `value` with every tensor inside dicts, lists and tuples on the CPU (for gathering)."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _own_accumulated_grads(trainer: Trainer, checkpoint: dict[str, Any]) -> list[Tensor | None] | None:
    """Return this rank's gradients of the open accumulation window (None when the window was closed)."""
    by_rank = checkpoint.get("accumulated_grads_by_rank")
    if by_rank is None:
        return checkpoint.get("accumulated_grads")  # older checkpoints: rank 0's alone
    return by_rank[trainer.global_rank] if trainer.global_rank < len(by_rank) else by_rank[0]


def _adapt_to_world_size(trainer: Trainer, saved: int, open_window: bool) -> None:
    """Continue a checkpoint saved on `saved` processes on `trainer.world_size` (elastic jobs shrink and grow).

    At an epoch boundary nothing is lost: the next epoch is split the new number of ways. Mid-epoch, the
    run continues after as many samples as the checkpoint had seen (each process's batches hold the same
    number of samples), from the start of an accumulation window; that order differs from the
    uninterrupted run's.
    """
    state, now = trainer.state, trainer.world_size
    if state.batches_done or state.batch_idx == 0:
        rank_zero_info(
            f"Resuming a checkpoint saved on {saved} process(es) on {now}: it was taken at an epoch boundary, "
            f"so training continues exactly, with each epoch's data split {now} ways."
        )
        return
    accumulate = trainer.accumulate_grad_batches
    seen = state.batch_idx * saved  # batches of every process: the samples seen, in units of one batch
    batch_idx = round(seen / now)
    batch_idx -= batch_idx % accumulate
    message = (
        f"Resuming a checkpoint saved on {saved} process(es) in the middle of epoch {state.current_epoch} on "
        f"{now}: training continues after {batch_idx} batches per process ({batch_idx * now} batches of "
        f"samples; the checkpoint had seen {seen}). The order of the rest of the epoch differs from the "
        "uninterrupted run's, so the result is not bit-exact."
    )
    if open_window:
        message += (
            " The gradients accumulated in the open window (per-process state) are dropped: the window starts again."
        )
    if state.validated_after >= 0:
        state.validated_after = min(state.validated_after, batch_idx - 1)
    state.batch_idx = batch_idx
    rank_zero_warn(message)


def _train_sampler_seed(trainer: Trainer) -> int | None:
    """Return the seed of the training data's DistributedSampler (None without one)."""
    sampler = getattr(trainer.train_dataloader, "sampler", None)
    seed = getattr(sampler, "seed", None)
    return seed if isinstance(seed, int) else None


def worker_result(trainer: Trainer, task: Task, returned: Any) -> dict[str, Any]:
    """Return what a launched rank 0 sends back to the process that launched it."""
    return {
        "return": returned,
        "state_dict": {name: value.cpu() for name, value in task.state_dict().items()},
        "progress": trainer.state.state_dict(),
        "callback_metrics": {name: value.cpu() for name, value in trainer.callback_metrics.items()},
        "logged_metrics": {name: value.cpu() for name, value in trainer.logged_metrics.items()},
        "callbacks": {c.state_key: c.state_dict() for c in trainer.callbacks},
        "loggers": [logger.state_dict() for logger in trainer.loggers],
    }


def apply_worker_result(trainer: Trainer, task: Task, result: dict[str, Any]) -> None:
    """Load what a launched rank 0 sent back, so this process holds the trained task and metrics."""
    task.load_state_dict(result["state_dict"])
    trainer.state.load_state_dict(result["progress"])
    for mine, theirs in ((trainer.callback_metrics, "callback_metrics"), (trainer.logged_metrics, "logged_metrics")):
        mine.clear()
        mine.update(result[theirs])
    for callback in trainer.callbacks:
        if callback.state_key in result["callbacks"]:
            callback.load_state_dict(result["callbacks"][callback.state_key])
    for logger, state in zip(trainer.loggers, result["loggers"]):
        logger.load_state_dict(state)


def save_last_checkpoint(trainer: Trainer) -> str:
    """Write the last checkpoint where the first ModelCheckpoint keeps it (else in `default_root_dir`), on
    every rank (a collective); return its path. A preemption stops with it."""
    callback = trainer.checkpoint_callback
    path = None
    if trainer.is_global_zero:
        path = callback.last_checkpoint_path(trainer) if callback is not None else None  # type: ignore[attr-defined]
        path = os.path.abspath(path or os.path.join(trainer.default_root_dir, "last.ckpt"))
    # Collective: the name is rank 0's (it looks at the directory), so every rank saves the same file.
    path = trainer.strategy.broadcast_object(path)
    trainer.save_checkpoint(path)  # collective
    return path


def open_checkpoint(trainer: Trainer, ckpt_path: Any, resume: bool) -> dict[str, Any] | None:
    """Read the checkpoint a stage starts from (a collective), and make every rank's loggers agree.

    With `resume` (fit), a run an elastic agent restarted continues from the newest last checkpoint, and
    the loggers continue the checkpoint's version directory.
    """
    if resume and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # An elastic agent restarted the group after a failure: continue from the newest last.ckpt
        # (collective), or from where the first attempt started when none was written yet.
        ckpt_path = find_last_checkpoint(trainer) or ckpt_path
    checkpoint = read_checkpoint(trainer, ckpt_path)
    # The file a "best" or "last" resolved to, as Lightning's trainer.ckpt_path.
    trainer.ckpt_path = None if checkpoint is None else str(checkpoint.get("loaded_from", ckpt_path))
    if resume and checkpoint is not None:
        for logger, state in zip(trainer.loggers, checkpoint.get("loggers", [])):
            logger.load_state_dict(state)
    _share_logger_state(trainer)
    return checkpoint


def _share_logger_state(trainer: Trainer) -> None:
    """Make every rank's loggers agree with rank 0's (its run directory), so `log_dir` is one path."""
    if trainer.world_size == 1 or not trainer.loggers:
        return
    states = [logger.state_dict() for logger in trainer.loggers] if trainer.is_global_zero else None
    # Collective: rank 0 picked the version directory; the others adopt it.
    states = trainer.strategy.broadcast_object(states)
    if not trainer.is_global_zero:
        for logger, state in zip(trainer.loggers, states):
            logger.load_state_dict(state)
