"""`ModelCheckpoint`: save the best k checkpoints by a monitored metric, and optionally the last one."""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from time import monotonic
from typing import TYPE_CHECKING, Any

import yaml

from syncline.callbacks.callback import Callback
from syncline.callbacks.checkpoint_leftovers import find_top_k_files, remove_stale_temporaries
from syncline.checkpoint_file import check_writable_folder
from syncline.options import MisconfigurationException, check_int
from syncline.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["ModelCheckpoint"]

#: A ``{name}`` or ``{name:format_spec}`` field of a filename template.
_FIELD = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


@dataclass
class _Plan:
    """What one save does; decided on rank 0 and broadcast, so every rank saves the same files."""

    error: Exception | None = None
    #: Top-k file to write, and the top-k file it pushes out (deleted once the new one exists).
    save_path: str | None = None
    drop_path: str | None = None
    best_k_models: dict[str, float] = field(default_factory=dict)
    best_model_path: str = ""
    best_model_score: float | None = None
    #: The monitored score of the top-k file written (None when none is, or without a monitor).
    current_score: float | None = None
    last_path: str | None = None


class ModelCheckpoint(Callback):
    """Save checkpoints during `fit`, keeping the best `save_top_k` by `monitor`, as Lightning does.

    Args:
        dirpath: directory of the files; None for ``<trainer.log_dir>/checkpoints``.
        filename: template of the file name without extension, with fields from `trainer.callback_metrics`
            plus ``epoch`` and ``step``, e.g. ``"{epoch:02d}-{val_loss:.3f}"``; default ``"{epoch}-{step}"``.
            With `auto_insert_metric_name` a field renders as ``name=value``; a metric not logged is 0.
            `CHECKPOINT_NAME_LAST` is a template of the same kind (default ``"last"``).
        monitor: metric to rank checkpoints by (a logged key, ``"epoch"`` or ``"step"``); None keeps the most
            recent ones.
        mode: "min" or "max": whether a lower or a higher `monitor` is better.
        save_top_k: how many checkpoints to keep; -1 keeps all, 0 none (only `save_last`).
        save_last: also write ``last.ckpt`` at every save, replacing the previous one (``last-v1.ckpt``... when
            the directory holds another run's).
        every_n_epochs: save every this many epochs (1 unless `every_n_train_steps` or `train_time_interval` is
            given; 0 never).
        every_n_train_steps: save every this many optimizer steps, after the step's micro-batch.
        train_time_interval: save after the first optimizer step at least this `datetime.timedelta` after the
            previous time save (or the start of training); rank 0's clock decides for every rank.
        save_on_train_epoch_end: save epoch checkpoints at the end of the training epoch (True) or after
            each validation (False). None: at epoch end when validation runs once per epoch at its end
            (``check_val_every_n_epoch=1``, ``val_check_interval=1.0``) or not at all; else after validation.
        save_weights_only: write the weights, hyperparameters and DataModule state only (no optimizer,
            progress, RNG or callback state): `load_from_checkpoint` reads the file, `fit(ckpt_path=...)` refuses it.
        auto_insert_metric_name: render template fields as ``name=value``.
        save_on_exception: when `fit` raises, save a checkpoint named by `filename` (and ``last`` with
            `save_last`) of the state at the error, as Lightning does; one-process runs only (on several, the
            other ranks may be inside a collective the failed one never joins).
        enable_version_counter: give a file whose name another file has a ``-v1``, ``-v2``... suffix; False
            overwrites it.

    Nothing is saved under `Trainer(fast_dev_run=...)`, as in Lightning.

    Attributes:
        best_model_path: the best checkpoint so far ("" before the first save).
        best_model_score: its `monitor` value (None without a monitor).
        best_k_models: every kept top-k checkpoint with its score (its global step without a monitor).
        kth_best_model_path: the worst kept top-k checkpoint once `save_top_k` are kept (with -1, always), the
            one a better score replaces ("" before that); `kth_value` is its score.
        current_score: the monitored score of the latest top-k checkpoint written (None before one is).
        last_model_path: the last ``last.ckpt`` written ("" if none).
    """

    #: Saving lands a step in flight itself (`checkpoint_state`); nothing else here reads the weights.
    reads_parameters = False
    acts_on_monitor = True

    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | None = None,
        every_n_epochs: int | None = None,
        every_n_train_steps: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        auto_insert_metric_name: bool = True,
        train_time_interval: timedelta | None = None,
        save_weights_only: bool = False,
        save_on_exception: bool = False,
        enable_version_counter: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint mode must be 'min' or 'max', got {mode!r}.")
        check_int("ModelCheckpoint", "save_top_k", save_top_k, -1, meaning="-1 keeps all, 0 none")
        check_int("ModelCheckpoint", "every_n_epochs", every_n_epochs, 0, none_ok=True)
        check_int("ModelCheckpoint", "every_n_train_steps", every_n_train_steps, 0, none_ok=True)
        if train_time_interval is not None and (
            not isinstance(train_time_interval, timedelta) or train_time_interval.total_seconds() < 0
        ):
            raise MisconfigurationException(
                f"ModelCheckpoint(train_time_interval={train_time_interval!r}): pass a datetime.timedelta >= 0, "
                "e.g. timedelta(minutes=30) (0: after every optimizer step)."
            )
        # A time interval of 0 is a trigger too (a save after every step), as in Lightning.
        triggers = (bool(every_n_epochs), bool(every_n_train_steps), train_time_interval is not None)
        if sum(triggers) > 1:
            raise MisconfigurationException(
                f"ModelCheckpoint: every_n_epochs={every_n_epochs}, every_n_train_steps={every_n_train_steps} and "
                f"train_time_interval={train_time_interval} are exclusive; pass one of them."
            )
        self._given_dirpath = _real_dir(dirpath)
        self.dirpath: str | None = self._given_dirpath
        self.filename = filename
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = bool(save_last)
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        no_trigger = not every_n_train_steps and train_time_interval is None
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else int(no_trigger)
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.auto_insert_metric_name = auto_insert_metric_name
        self.save_weights_only = save_weights_only
        self.save_on_exception = save_on_exception
        self._enable_version_counter = enable_version_counter
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise MisconfigurationException(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration. No quantity "
                "for top_k to track: pass a monitor, or save_top_k=-1 to keep every checkpoint."
            )

        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.kth_best_model_path = ""
        self.kth_value = math.inf if mode == "min" else -math.inf
        self.current_score: float | None = None
        self.last_model_path = ""
        self._last_global_step_saved = -1
        #: When the time trigger last fired (or training started), on rank 0's monotonic clock.
        self._last_time_checked: float | None = None
        #: Global step at the previous train batch end, to notice the micro-batch that took a step.
        self._step_seen = 0
        #: Whether this fit resumed this callback's bookkeeping for the same directory.
        self._resumed = False
        #: Whether a validation has run in this fit (before that, a validation metric cannot exist yet).
        self._validated = False
        self._warned_missing = False

    @property
    def state_key(self) -> str:
        """Key of this callback's state, distinct for checkpoint callbacks with different settings (Lightning's)."""
        return f"{type(self).__qualname__}{_settings(self)}"

    @property
    def legacy_state_keys(self) -> list[str]:
        """Keys this callback's state had in checkpoints of earlier syncline versions (no time interval)."""
        if self.train_time_interval is not None:
            return []
        settings = {k: v for k, v in _settings(self).items() if k != "train_time_interval"}
        return [f"{type(self).__qualname__}{settings}"]

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, task: Task, stage: str) -> None:
        """Resolve the directory: the given one, or ``<trainer.log_dir>/checkpoints`` as rank 0 sees it."""
        if stage != "fit" or self._given_dirpath is not None:
            return
        dirpath = _real_dir(os.path.join(trainer.log_dir, "checkpoints")) if trainer.is_global_zero else None
        # Collective: the logger picks its version directory on rank 0; every rank must use that one.
        self.dirpath = trainer.strategy.broadcast_object(dirpath)

    def on_fit_start(self, trainer: Trainer, task: Task) -> None:
        """Clean up after a crash: stale temporary files go; a resumed run re-finds its top-k files."""
        tidy = self._tidy_directory() if trainer.is_global_zero else None
        # Collective: every rank keeps rank 0's view of the files (only rank 0 reads the directory).
        tidy = trainer.strategy.broadcast_object(tidy)
        if isinstance(tidy, Exception):
            raise tidy
        self.best_k_models, self.best_model_path, self.best_model_score = tidy
        self._update_kth()
        self._resumed = False
        self._validated = self._warned_missing = False

    def _tidy_directory(self) -> tuple[dict[str, float], str, float | None] | Exception:
        try:
            # Before any training: a folder that cannot be written would otherwise cost the whole run.
            check_writable_folder(self._dir())
            remove_stale_temporaries(self._dir())
            kept = {path: score for path, score in self.best_k_models.items() if os.path.exists(path)}
            if self._resumed:
                # A run killed after a top-k save and resumed from an older checkpoint does not list that
                # file; each top-k file records its own score, so the list is rebuilt from the files.
                kept.update(find_top_k_files(self._dir(), [self.state_key, *self.legacy_state_keys]))
            else:
                self._warn_about_other_runs(kept)
            if self.save_top_k != -1:
                while len(kept) > self.save_top_k:
                    worst = self._worst(kept)
                    del kept[worst]
                    _remove(worst)
            if not kept:
                return {}, self.best_model_path, self.best_model_score
            best = self._best(kept)
            return kept, best, kept[best] if self.monitor is not None else None
        except Exception as error:
            return error

    def _warn_about_other_runs(self, kept: dict[str, float]) -> None:
        """Say once that a fresh run writes into a directory that already holds another run's checkpoints."""
        directory = self._dir()
        if not os.path.isdir(directory):
            return
        others = sorted(name for name in os.listdir(directory) if name.endswith(self.FILE_EXTENSION))
        others = [name for name in others if os.path.join(directory, name) not in kept]
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            rank_zero_warn(
                f"ModelCheckpoint: {directory} already holds {len(others)} checkpoint(s) of another run ({shown}). "
                "This run neither counts nor deletes them in its top-k (clashing names get a -v1 suffix). Pass "
                "another dirpath, or resume that run with ckpt_path='last'."
            )

    def on_train_start(self, trainer: Trainer, task: Task) -> None:
        """Start watching for optimizer steps from the (possibly resumed) global step, and the clock."""
        self._step_seen = trainer.global_step
        self._last_time_checked = monotonic()

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Save when this micro-batch's optimizer step reached a multiple of `every_n_train_steps`, or
        `train_time_interval` has passed."""
        step = trainer.global_step
        if step == self._step_seen:  # inside an accumulation window: no optimizer step this micro-batch
            return
        self._step_seen = step
        due = bool(self.every_n_train_steps) and step % self.every_n_train_steps == 0
        if self.train_time_interval is not None and not trainer.fast_dev_run:
            now = monotonic()
            previous = self._last_time_checked
            elapsed = previous is not None and now - previous >= self.train_time_interval.total_seconds()
            # Collective: rank 0's clock decides, so no rank waits in a save the others skip.
            if trainer.strategy.broadcast_object(elapsed if trainer.is_global_zero else None):
                self._last_time_checked, due = now, True
        if due:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, task: Task) -> None:
        """Save every `every_n_epochs` epochs, after the epoch's validation."""
        if self._epoch_due(trainer) and self._saves_on_train_epoch_end(trainer):
            self._save(trainer)

    def on_validation_end(self, trainer: Trainer, task: Task) -> None:
        """Save after a validation that runs within the epoch, where epoch-end saving is off."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._validated = True
        if self._epoch_due(trainer) and not self._saves_on_train_epoch_end(trainer):
            self._save(trainer)

    def on_train_end(self, trainer: Trainer, task: Task) -> None:
        """Write ``last.ckpt`` for the final state when training stopped between saves (max_steps)."""
        if not self.save_last or trainer.global_step == self._last_global_step_saved or trainer.fast_dev_run:
            return
        self._last_global_step_saved = trainer.global_step
        path = self.last_checkpoint_path(trainer) if trainer.is_global_zero else None
        # Collective: the name is rank 0's (it looks at the directory), so every rank saves the same file.
        self._save_last(trainer, trainer.strategy.broadcast_object(path))

    def on_exception(self, trainer: Trainer, task: Task, exception: BaseException) -> None:
        """With `save_on_exception`, save the state at the error (one-process `fit` only)."""
        if (
            not self.save_on_exception
            or trainer.state.fn != "fit"
            or trainer.fast_dev_run
            or trainer.sanity_checking
            or trainer.global_step == self._last_global_step_saved
        ):
            return
        if trainer.world_size > 1:
            rank_zero_warn(
                "ModelCheckpoint(save_on_exception=True) saves nothing with several processes: the other ranks "
                "may be inside a collective the failed one never joins."
            )
            return
        candidates = self._candidates(trainer)
        path = self.format_checkpoint_name(candidates)
        trainer.save_checkpoint(path, self.save_weights_only)
        if self.save_last:
            self._save_last(trainer, self.last_checkpoint_path(trainer))
        rank_zero_info(
            f"An {type(exception).__name__} was raised with message: {exception}, saved checkpoint to {path}"
        )

    def to_yaml(self, filepath: str | os.PathLike[str] | None = None) -> None:
        """Write `best_k_models` (path: score) to `filepath`, by default ``<dirpath>/best_k_models.yaml`` (rank 0)."""
        path = os.path.join(self._dir(), "best_k_models.yaml") if filepath is None else os.fspath(filepath)
        with open(path, "w") as file:
            yaml.dump({name: float(score) for name, score in self.best_k_models.items()}, file)

    def _epoch_due(self, trainer: Trainer) -> bool:
        return self.every_n_epochs > 0 and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _saves_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if not any(trainer.num_val_batches):
            return True
        if trainer.check_val_every_n_epoch != 1:
            return False  # as in Lightning: save after the validations, in the epochs that have them
        # Validating only at the end of each epoch: its metrics are there when the epoch ends.
        interval = trainer.val_check_interval
        return isinstance(interval, float) and interval == 1.0

    # ----------------------------------------------------------------- saving
    def _save(self, trainer: Trainer) -> None:
        """Decide on rank 0 what to write and delete, then write it on every rank."""
        if trainer.global_step == self._last_global_step_saved or trainer.fast_dev_run:
            return  # one save per optimizer step, however many triggers fire at it; none in a debugging run
        plan = self._plan(trainer) if trainer.is_global_zero else None
        # Collective: the files to write and delete are rank 0's choice, so every rank joins the same saves.
        plan = trainer.strategy.broadcast_object(plan)
        if plan.error is not None:
            raise plan.error
        self._last_global_step_saved = trainer.global_step
        if plan.save_path is not None:
            previous = (dict(self.best_k_models), self.best_model_path, self.best_model_score)
            # The checkpoint's own copy of this callback's state must already list the file it is written to.
            previous_kth = (self.kth_best_model_path, self.kth_value, self.current_score)
            self.best_k_models = plan.best_k_models
            self.best_model_path, self.best_model_score = plan.best_model_path, plan.best_model_score
            self._update_kth()
            if plan.current_score is not None:
                self.current_score = plan.current_score
            try:
                trainer.save_checkpoint(plan.save_path, self.save_weights_only)  # collective; atomic on rank 0
            except BaseException:
                self.best_k_models, self.best_model_path, self.best_model_score = previous
                self.kth_best_model_path, self.kth_value, self.current_score = previous_kth
                raise
            if plan.drop_path is not None and trainer.is_global_zero:
                # Only now: until the new file exists, the dropped one may be the only good checkpoint.
                _remove(plan.drop_path)
        if plan.last_path is not None:
            self._save_last(trainer, plan.last_path)

    def _save_last(self, trainer: Trainer, path: str) -> None:
        """Write the last checkpoint to `path`; a previous last file of this run with another name goes."""
        previous, self.last_model_path = self.last_model_path, path
        try:
            trainer.save_checkpoint(path, self.save_weights_only)  # collective; replaces the file atomically
        except BaseException:
            self.last_model_path = previous
            raise
        if previous and previous != path and trainer.is_global_zero and os.path.dirname(previous) == self._dir():
            _remove(previous)

    def last_checkpoint_path(self, trainer: Trainer) -> str:
        """Return where this run's last checkpoint goes: `CHECKPOINT_NAME_LAST` formatted like `filename`,
        with ``-v1``, ``-v2``... when another run's file has that name (Lightning's versioning)."""
        name = self._format(self.CHECKPOINT_NAME_LAST, self._candidates(trainer))
        path = os.path.join(self._dir(), name + self.FILE_EXTENSION)
        version = 1
        while self._enable_version_counter and os.path.exists(path) and path != self.last_model_path:
            path = os.path.join(self._dir(), f"{name}-v{version}{self.FILE_EXTENSION}")
            version += 1
        return path

    def _plan(self, trainer: Trainer) -> _Plan:
        """Return which files this save writes and deletes (rank 0), or the error to raise on every rank."""
        try:
            plan = _Plan(best_k_models=dict(self.best_k_models))
            if self.save_top_k != 0:
                self._plan_top_k(trainer, plan)
            if self.save_last:
                plan.last_path = self.last_checkpoint_path(trainer)
            return plan
        except Exception as error:
            # Raised on every rank after the broadcast, so no rank waits for a save that never comes.
            return _Plan(error=error)

    def _candidates(self, trainer: Trainer) -> dict[str, Any]:
        """Return what `monitor` and the filename may name: the logged metrics, ``epoch`` and ``step``."""
        return {**trainer.callback_metrics, "epoch": trainer.current_epoch, "step": trainer.global_step}

    def _plan_top_k(self, trainer: Trainer, plan: _Plan) -> None:
        metrics = self._candidates(trainer)
        if self.monitor is not None and self.monitor not in metrics and self._may_come_later(trainer):
            # A step checkpoint before the first validation: a validation metric cannot exist yet. As in
            # Lightning, skip the top-k save (last.ckpt is still written) and say so once.
            if not self._warned_missing:
                self._warned_missing = True
                rank_zero_warn(
                    f"ModelCheckpoint(monitor={self.monitor!r}) skips its top-k save at step "
                    f"{trainer.global_step}: no metric of that name yet, and no validation has run. It saves "
                    "once the metric is logged; if validation runs and does not log it, that is an error."
                )
            return
        if self.monitor is not None and self.monitor not in metrics:
            raise KeyError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no metric of that name. "
                f"Logged metrics: {', '.join(sorted(trainer.callback_metrics)) or 'none'} (and epoch, step). "
                f"Log it with self.log({self.monitor!r}, ...) or change `monitor`."
            )
        score = self._score(metrics[self.monitor]) if self.monitor is not None else float(trainer.global_step)
        path = self.format_checkpoint_name(metrics)
        kept = plan.best_k_models
        drop: str | None = None
        if path not in kept and self.save_top_k != -1 and len(kept) >= self.save_top_k:
            drop = self._worst(kept)
            if not self._better(score, kept[drop]):
                return
        if path not in kept and path != drop and self._enable_version_counter:
            path = _free_name(path, taken={self.last_model_path})
        if drop is not None:
            del kept[drop]
        kept[path] = score
        plan.save_path = path
        plan.drop_path = drop if drop != path else None
        plan.best_model_path = self._best(kept)
        plan.best_model_score = kept[plan.best_model_path] if self.monitor is not None else None
        plan.current_score = score if self.monitor is not None else None

    def _update_kth(self) -> None:
        """Set `kth_best_model_path` and `kth_value`: the worst kept file once `save_top_k` are kept, as Lightning."""
        kept = self.best_k_models
        if self.monitor is not None and kept and (self.save_top_k == -1 or len(kept) == self.save_top_k):
            self.kth_best_model_path = self._worst(kept)
            self.kth_value = kept[self.kth_best_model_path]

    def _may_come_later(self, trainer: Trainer) -> bool:
        """Whether a missing monitored metric may still be logged: by a validation that has not run yet,
        or, without validation, by the epoch aggregates of an epoch that has not ended yet."""
        if self._validated:
            return False
        return any(trainer.num_val_batches) or not trainer.state.batches_done

    def _score(self, value: Any) -> float:
        score = float(value)  # host sync: once per save, never per step
        if math.isnan(score):
            # A NaN is never better than anything kept.
            return math.inf if self.mode == "min" else -math.inf
        return score

    def _better(self, score: float, than: float) -> bool:
        # Without a monitor the score is the global step, and newer is better.
        if self.monitor is None or self.mode == "max":
            return score > than
        return score < than

    def _worst(self, kept: dict[str, float]) -> str:
        lowest_is_worst = self.monitor is None or self.mode == "max"
        return min(kept, key=kept.__getitem__) if lowest_is_worst else max(kept, key=kept.__getitem__)

    def _best(self, kept: dict[str, float]) -> str:
        lowest_is_best = self.monitor is not None and self.mode == "min"
        return min(kept, key=kept.__getitem__) if lowest_is_best else max(kept, key=kept.__getitem__)

    def _dir(self) -> str:
        if self.dirpath is None:
            raise RuntimeError("ModelCheckpoint has no directory yet; it is resolved when fit starts.")
        return self.dirpath

    def format_checkpoint_name(self, metrics: Mapping[str, Any]) -> str:
        """Return the path of a checkpoint with `metrics` (which include ``epoch`` and ``step``).

        A field naming a metric that was not logged renders as 0, as in Lightning.
        """
        return os.path.join(self._dir(), self._format(self.filename or "{epoch}-{step}", metrics) + self.FILE_EXTENSION)

    def _format(self, template: str, metrics: Mapping[str, Any]) -> str:
        def render(match: re.Match[str]) -> str:
            name, spec = match.group(1), match.group(2) or ""
            value = metrics.get(name, 0)
            if not isinstance(value, (int, float)):
                value = value.item()  # host sync: once per save
            rendered = format(value, spec)
            return f"{name}={rendered}" if self.auto_insert_metric_name else rendered

        return _FIELD.sub(render, template)

    # ------------------------------------------------------------- resuming
    def state_dict(self) -> dict[str, Any]:
        """Return the top-k bookkeeping, so a resumed run keeps and prunes the same files."""
        return {
            "monitor": self.monitor,
            "dirpath": self.dirpath,
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "current_score": self.current_score,
            "last_model_path": self.last_model_path,
            "last_global_step_saved": self._last_global_step_saved,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the bookkeeping; if the directory changed, keep only `best_model_path`."""
        saved_dir = state_dict.get("dirpath")
        self.best_model_path = state_dict.get("best_model_path", "")
        if self.dirpath is not None and saved_dir != self.dirpath:
            # The files listed belong to another directory: pruning them from this run would be wrong.
            rank_zero_warn(
                f"ModelCheckpoint's directory changed from {saved_dir} to {self.dirpath}; the top-k "
                "checkpoints of the old directory are not tracked (only best_model_path is restored)."
            )
            return
        self._resumed = True
        self.best_model_score = state_dict.get("best_model_score")
        self.best_k_models = dict(state_dict.get("best_k_models", {}))
        self.kth_best_model_path = state_dict.get("kth_best_model_path", self.kth_best_model_path)
        self.kth_value = state_dict.get("kth_value", self.kth_value)
        self.current_score = state_dict.get("current_score", self.current_score)
        self.last_model_path = state_dict.get("last_model_path", "")
        self._last_global_step_saved = state_dict.get("last_global_step_saved", -1)


def _real_dir(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else os.path.realpath(os.path.expanduser(os.fspath(path)))


def _settings(callback: ModelCheckpoint) -> dict[str, Any]:
    return {
        "monitor": callback.monitor,
        "mode": callback.mode,
        "every_n_train_steps": callback.every_n_train_steps,
        "every_n_epochs": callback.every_n_epochs,
        "train_time_interval": callback.train_time_interval,
    }


def _free_name(path: str, taken: set[str]) -> str:
    """Return `path`, or ``<stem>-v1.ckpt``, ``-v2``... when a file not tracked by this run is there."""
    stem, extension = os.path.splitext(path)
    candidate, version = path, 0
    while os.path.exists(candidate) or candidate in taken:
        version += 1
        candidate = f"{stem}-v{version}{extension}"
    return candidate


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
