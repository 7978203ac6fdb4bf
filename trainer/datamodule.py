"""`DataModule`: the data of every stage in one class, as Lightning's LightningDataModule."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sized
from typing import TYPE_CHECKING, Any, TypeVar

from torch.utils.data import DataLoader, Dataset, IterableDataset

from syncline.trainer.hooks import DataHooks
from syncline.trainer.hparams import HyperparametersMixin, build_from_hparams, read_for_loading

if TYPE_CHECKING:
    from syncline.trainer.trainer import Trainer

DataModuleT = TypeVar("DataModuleT", bound="DataModule")

__all__ = ["DataModule", "check_datamodule", "datamodule_checkpoint", "merged_hparams", "prepare_and_setup"]


class DataModule(DataHooks, HyperparametersMixin):
    """Subclass this to keep downloading, splitting and loading the data apart from the task.

    Pass it as ``trainer.fit(task, datamodule=dm)`` (or to `validate`, `test`, `predict`). The Trainer calls
    `prepare_data` once per node (on local rank 0, while the other ranks wait), then `setup(stage)` on every
    process, then the stage's ``*_dataloader`` method, and `teardown(stage)` at the end. Its `state_dict`
    is kept in checkpoints under the class's name and given back to `load_state_dict` on a resume, after
    `setup` and before the loaders are built, as in Lightning.
    """

    #: Call `prepare_data` on local rank 0 of every node (True) or on global rank 0 only (False).
    prepare_data_per_node: bool = True

    def __init__(self) -> None:
        self._init_hparams()
        #: The Trainer this DataModule is attached to (None before a stage).
        self.trainer: Trainer | None = None

    @classmethod
    def load_from_checkpoint(
        cls: type[DataModuleT],
        checkpoint_path: str | os.PathLike[str],
        map_location: Any = None,
        hparams_file: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> DataModuleT:
        """Build the DataModule from a checkpoint's ``datamodule_hyper_parameters`` and give it its saved
        state, as Lightning does (`hparams_file` and `kwargs` as in `Task.load_from_checkpoint`)."""
        checkpoint = read_for_loading(checkpoint_path, map_location)
        datamodule = build_from_hparams(cls, checkpoint, "datamodule_", checkpoint_path, hparams_file, kwargs)
        if cls.__qualname__ in checkpoint:
            datamodule.load_state_dict(checkpoint[cls.__qualname__])
        return datamodule

    @classmethod
    def from_datasets(
        cls: type[DataModuleT],
        train_dataset: Dataset | Iterable[Dataset] | None = None,
        val_dataset: Dataset | Iterable[Dataset] | None = None,
        test_dataset: Dataset | Iterable[Dataset] | None = None,
        predict_dataset: Dataset | Iterable[Dataset] | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> DataModuleT:
        """Build a DataModule whose loaders read these datasets, as Lightning's ``from_datasets``.

        Each dataset (or each of a list or dict of them) gets a `DataLoader` of `batch_size` and `num_workers`;
        the training data is shuffled unless it is an `IterableDataset`. `batch_size` and `num_workers` also go
        to the constructor when it takes them; `datamodule_kwargs` always do.
        """

        def loaders(datasets: Any, shuffle: bool) -> Any:
            if isinstance(datasets, Dataset):
                shuffled = shuffle and not isinstance(datasets, IterableDataset)
                return DataLoader(datasets, batch_size=batch_size, shuffle=shuffled, num_workers=num_workers)
            if isinstance(datasets, dict):
                return {key: loaders(value, shuffle) for key, value in datasets.items()}
            if isinstance(datasets, (list, tuple)):
                return type(datasets)(loaders(value, shuffle) for value in datasets)
            return datasets

        parameters = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        special = {"batch_size": batch_size, "num_workers": num_workers}
        datamodule = cls(**datamodule_kwargs, **{k: v for k, v in special.items() if takes_any or k in parameters})
        for method, datasets, shuffle in (
            ("train_dataloader", train_dataset, True),
            ("val_dataloader", val_dataset, False),
            ("test_dataloader", test_dataset, False),
            ("predict_dataloader", predict_dataset, False),
        ):
            if datasets is not None:
                setattr(datamodule, method, lambda datasets=datasets, shuffle=shuffle: loaders(datasets, shuffle))
        return datamodule

    def state_dict(self) -> dict[str, Any]:
        """Return the state a resume needs (kept in checkpoints when not empty)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def on_exception(self, exception: BaseException) -> None:
        """Called when a stage raises (Ctrl-C included), before teardown."""

    def __str__(self) -> str:
        """Describe the dataset size behind each loader method, in Lightning's format (None where none)."""
        lines = []
        for title, method in (
            ("Train dataloader", "train_dataloader"),
            ("Validation dataloader", "val_dataloader"),
            ("Test dataloader", "test_dataloader"),
            ("Predict dataloader", "predict_dataloader"),
        ):
            try:
                loader = getattr(self, method)()
            except Exception:  # not set up yet, as Lightning reports it
                loader = None
            lines.append(f"{{{title}: {_loader_info(loader)}}}")
        return os.linesep.join(lines)


def _loader_info(loader: Any) -> str:
    """Return ``size=N`` for a loader, ``1. size=N ; 2. size=M`` for several, None for none."""

    def size(one: Any) -> str:
        if not isinstance(one, DataLoader):
            return "None"
        return f"size={len(one.dataset) if isinstance(one.dataset, Sized) else 'NA'}"

    if loader is None or isinstance(loader, DataLoader):
        return size(loader)
    several = loader.values() if isinstance(loader, dict) else loader
    return " ; ".join(
        f"{i}. {size(one)}" if isinstance(one, DataLoader) else "None" for i, one in enumerate(several, 1)
    )


def check_datamodule(stage: str, datamodule: Any, loaders: dict[str, Any]) -> tuple[DataModule | None, dict[str, Any]]:
    """Return the stage's DataModule and DataLoaders (by argument name); a DataModule passed as the first
    loaders argument counts as the DataModule, as in Lightning's ``trainer.fit(model, dm)``.

    Raises:
        TypeError: `datamodule` is not a `DataModule`.
        ValueError: both loaders and a DataModule are given.
    """
    first = next(iter(loaders))
    if isinstance(loaders[first], DataModule) and datamodule is None:
        datamodule, loaders = loaders[first], {**loaders, first: None}
    if datamodule is None:
        return None, loaders
    if not isinstance(datamodule, DataModule):
        raise TypeError(
            f"Trainer.{stage}(datamodule=...) needs a syncline.DataModule, got {type(datamodule).__name__}; "
            "subclass syncline.DataModule, or pass DataLoaders as dataloaders=..."
        )
    given = [name for name, value in loaders.items() if value is not None]
    if given:
        raise ValueError(
            f"Trainer.{stage} got both {given[0]}=... and datamodule=...; pass one: the DataModule's "
            "*_dataloader methods give the data when it is passed."
        )
    return datamodule, loaders


def prepare_and_setup(trainer: Trainer, stage: str, checkpoint: dict[str, Any] | None) -> None:
    """Run `prepare_data`, then every `setup(stage)`, then give the DataModule its checkpointed state.

    As in Lightning: `prepare_data` (the DataModule's, then the task's) on local rank 0 of each node (global
    rank 0 with ``prepare_data_per_node=False``) while the others wait; then the DataModule's `setup`, the
    callbacks', the task's; a resume's DataModule state is loaded before any DataLoader is asked for.
    """
    from syncline.callbacks.callback import Callback
    from syncline.trainer.task import Task

    datamodule, task, strategy = trainer.datamodule, trainer.task, trainer.strategy
    if datamodule is not None:
        datamodule.trainer = trainer
        if strategy.local_rank == 0 if datamodule.prepare_data_per_node else strategy.is_global_zero:
            datamodule.prepare_data()
    if type(task).prepare_data is not Task.prepare_data and strategy.local_rank == 0:
        task.prepare_data()
    # Collective: nobody reads the prepared data before the process preparing it has finished.
    strategy.barrier()
    if datamodule is not None:
        datamodule.setup(stage=stage)
    trainer.dispatcher.fire(Callback.setup, stage=stage)
    if datamodule is not None and checkpoint is not None and type(datamodule).__qualname__ in checkpoint:
        datamodule.load_state_dict(checkpoint[type(datamodule).__qualname__])


def datamodule_checkpoint(datamodule: DataModule | None) -> dict[str, Any]:
    """Return the checkpoint entries of `datamodule`: its state under its class's name, its hyperparameters."""
    from syncline.checkpoint_file import to_primitive

    if datamodule is None:
        return {}
    entries: dict[str, Any] = {}
    state = datamodule.state_dict()
    if state:
        entries[type(datamodule).__qualname__] = state
    if datamodule.hparams:
        entries["datamodule_hyper_parameters"] = to_primitive(datamodule.hparams)
        if datamodule.hparams_name is not None:
            entries["datamodule_hparams_name"] = datamodule.hparams_name
        if datamodule.hparams_type is not None:
            entries["datamodule_hparams_type"] = datamodule.hparams_type
    return entries


def merged_hparams(task: Any, datamodule: DataModule | None) -> dict[str, Any]:
    """Return the task's hyperparameters and the DataModule's together, for the loggers (as Lightning).

    Raises:
        ValueError: a key is in both with different values.
    """
    from syncline.checkpoint_file import to_primitive

    merged = to_primitive(task.hparams) if task.hparams_logged else {}
    if datamodule is None or not datamodule.hparams_logged:
        return merged
    theirs = to_primitive(datamodule.hparams)
    clash = sorted(key for key, value in theirs.items() if key in merged and merged[key] != value)
    if clash:
        raise ValueError(
            f"The hyperparameters {clash} are in both {type(task).__name__}'s and {type(datamodule).__name__}'s "
            "hparams with different values; rename one, or ignore it in one save_hyperparameters."
        )
    merged.update(theirs)
    return merged
