"""DataLoaders as the loop needs them: sharded across processes, limited, and resumable mid-epoch."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from syncline.rank_zero import rank_zero_warn
from syncline.strategies.strategy import move_to_device
from syncline.trainer.hooks import TRANSFER_HOOKS, DataHooks, overrides

if TYPE_CHECKING:
    from syncline.trainer.trainer import Trainer

__all__ = [
    "BatchIndexRecorder",
    "UnpaddedShardSampler",
    "batch_mover",
    "epoch_batches",
    "eval_dataloaders",
    "limit_batches",
    "loader_settings",
    "move_batch",
    "prepare_loader",
    "prepare_loaders",
    "with_batch_indices",
    "with_distributed_sampler",
    "with_evaluation_sampler",
    "without_shuffling",
]


def with_distributed_sampler(loader: DataLoader, sampler_kwargs: dict[str, int] | None, seed: int = 0) -> DataLoader:
    """Return `loader` rebuilt with a `DistributedSampler` when several processes share the data.

    The loader's shuffle setting and `drop_last` are kept. A loader with a sampler of the user's own
    is returned unchanged, with a warning, since syncline cannot know how to shard it.
    """
    if not _can_shard(loader, sampler_kwargs):
        return loader
    distributed = DistributedSampler(
        loader.dataset,
        shuffle=isinstance(loader.sampler, RandomSampler),
        drop_last=loader.drop_last,
        seed=seed,
        **sampler_kwargs,  # type: ignore[arg-type]
    )
    return _with_sampler(loader, distributed)


def with_evaluation_sampler(loader: DataLoader, sampler_kwargs: dict[str, int] | None) -> DataLoader:
    """Return `loader` rebuilt so that several processes evaluate every sample exactly once.

    `DistributedSampler` pads the data with duplicates until it divides by the number of processes, which
    makes a validation metric differ from the one-process value. Here each rank takes every
    ``num_replicas``-th sample instead, so the shards differ in size by at most one and none repeats; the
    epoch means that `self.log(..., sync_dist=True)` and torchmetrics reduce are then the exact global ones.
    """
    if not _can_shard(loader, sampler_kwargs):
        return loader
    assert sampler_kwargs is not None
    replicas = sampler_kwargs["num_replicas"]
    if len(loader.dataset) < replicas:  # type: ignore[arg-type]
        # A rank without a single batch would skip the epoch-end reductions the others wait in.
        rank_zero_warn(
            f"The evaluation set has {len(loader.dataset)} samples for {replicas} processes; it is padded "  # type: ignore[arg-type]
            "with repeated samples so that every process has one, which weights those samples twice."
        )
        return with_distributed_sampler(loader, sampler_kwargs)
    return _with_sampler(loader, UnpaddedShardSampler(len(loader.dataset), **sampler_kwargs))  # type: ignore[arg-type]


class UnpaddedShardSampler(Sampler[int]):
    """Indices ``rank, rank + num_replicas, ...`` of a data set of `size` samples, in order, unpadded."""

    def __init__(self, size: int, num_replicas: int, rank: int) -> None:
        self.size, self.num_replicas, self.rank = size, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.num_replicas))


class BatchIndexRecorder(Sampler[list[int]]):
    """A batch sampler that gives `batch_sampler`'s batches and remembers each one's sample indices in `seen`
    (what a prediction writer is told; Lightning's ``_IndexBatchSamplerWrapper``)."""

    def __init__(self, batch_sampler: Iterable[list[int]]) -> None:
        self.batch_sampler = batch_sampler
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen = []
        for batch in self.batch_sampler:
            self.seen.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


def with_batch_indices(loader: Any) -> Any:
    """Return `loader` with its batch sampler wrapped in a `BatchIndexRecorder` (a DataLoader that batches),
    or unchanged (any other loader: its batch indices are unknown)."""
    if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
        return loader
    if isinstance(loader.batch_sampler, BatchIndexRecorder):
        return loader
    return DataLoader(loader.dataset, batch_sampler=BatchIndexRecorder(loader.batch_sampler), **loader_settings(loader))


def _can_shard(loader: Any, sampler_kwargs: dict[str, int] | None) -> bool:
    """Whether syncline may replace `loader`'s sampler by a sharding one (warns where it may not)."""
    if sampler_kwargs is None or not isinstance(loader, DataLoader):
        return False
    sampler = loader.sampler
    if isinstance(sampler, (DistributedSampler, UnpaddedShardSampler)):
        return False
    if not isinstance(sampler, (RandomSampler, SequentialSampler)) or loader.batch_sampler is None:
        rank_zero_warn(
            f"The DataLoader uses its own sampler ({type(sampler).__name__}); syncline leaves it alone, so "
            "make sure it gives each process a different shard, or pass use_distributed_sampler=False."
        )
        return False
    if type(loader.batch_sampler).__name__ != "BatchSampler":
        rank_zero_warn("The DataLoader has a custom batch_sampler; syncline leaves it alone.")
        return False
    return True


def _with_sampler(loader: DataLoader, sampler: Sampler[int]) -> DataLoader:
    """Return a DataLoader like `loader` in every setting but its sampler."""
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        drop_last=loader.drop_last,
        **loader_settings(loader),
    )


def loader_settings(loader: DataLoader) -> dict[str, Any]:
    """`loader`'s settings other than its dataset and how it samples and batches, to build a copy with."""
    return {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }


def limit_batches(loader: Iterable[Any], limit: int | float | None, name: str) -> int | float:
    """Return how many batches of `loader` an epoch uses (`math.inf` when the loader has no length).

    Args:
        loader: the DataLoader.
        limit: None or 1.0 for all, an int for that many, a float in [0, 1] for that fraction.
        name: the Trainer argument, for error messages (e.g. "limit_train_batches").
    """
    try:
        length: int | float = len(loader)  # type: ignore[arg-type]
    except TypeError:
        length = math.inf
    if limit is None:
        return length
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 0:
        raise ValueError(f"{name} must be None, an int >= 0 or a float in [0, 1]; got {limit!r}.")
    if isinstance(limit, int):
        return min(length, limit)
    if limit > 1.0:
        raise ValueError(f"{name}={limit} is a float above 1.0; pass an int for a number of batches.")
    if length == math.inf:
        if limit == 1.0:
            return length
        raise ValueError(f"{name}={limit} is a fraction, but the DataLoader has no length; pass an int.")
    batches = int(length * limit)
    if limit > 0 and batches == 0:
        raise ValueError(f"{name}={limit} of {length} batches is less than one batch; raise it.")
    return batches


def epoch_batches(loader: Iterable[Any], num_batches: int | float, skip: int = 0) -> Iterator[Any]:
    """Iterate one epoch of `loader`, at most `num_batches` batches, after discarding the first `skip`.

    Skipping fetches and drops batches rather than indexing the sampler, so that worker processes and
    samplers advance exactly as in the original run.
    """
    iterator = iter(loader)
    for _ in range(skip):
        next(iterator, None)
    if num_batches == math.inf:
        return iterator
    return itertools.islice(iterator, int(num_batches) - skip)


def without_shuffling(loader: Any, prefix: str) -> Any:
    """Return `loader` reading its data set in order, so that overfitting takes the same batches every epoch.

    A DataLoader whose sampler is not sequential is rebuilt with a `SequentialSampler`, with Lightning's
    warning; `prefix` ("train" or "val") names the loader in it. Other loaders are returned unchanged.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.sampler, SequentialSampler):
        return loader
    if type(loader.batch_sampler) is not BatchSampler:
        return loader  # a batch sampler of the user's own decides the order
    rank_zero_warn(
        f"You requested to overfit but enabled {prefix} dataloader shuffling. "
        f"We are turning off the {prefix} dataloader shuffling for you."
    )
    return _with_sampler(loader, SequentialSampler(loader.dataset))  # type: ignore[arg-type]


def prepare_loader(trainer: Trainer, loader: Any, evaluation: bool = False) -> Any:
    """Return `loader` sharded for the trainer's processes: training data with a `DistributedSampler`
    (seeded with `trainer.seed`), evaluation data so that every sample is seen exactly once.

    With `overfit_batches` during `fit`, the training and validation data are read in order, as in Lightning.
    """
    if trainer.overfit_batches and trainer.state.fn == "fit":
        loader = without_shuffling(loader, "val" if evaluation else "train")
    if not (trainer.use_distributed_sampler and isinstance(loader, DataLoader)):
        return loader
    if evaluation:
        # Every sample exactly once, so metrics over several processes equal the one-process values.
        return with_evaluation_sampler(loader, trainer.strategy.distributed_sampler_kwargs)
    return with_distributed_sampler(loader, trainer.strategy.distributed_sampler_kwargs, seed=trainer.seed or 0)


def prepare_loaders(
    trainer: Trainer, loaders: Any, limit: int | float | None, name: str, evaluation: bool = True
) -> tuple[list[Any], list[int | float]]:
    """Return `loaders` (one, a list or tuple, or None for none) prepared, and how many batches each gives."""
    if loaders is None:
        return [], []
    prepared = [
        prepare_loader(trainer, loader, evaluation)
        for loader in (loaders if isinstance(loaders, (list, tuple)) else [loaders])
    ]
    return prepared, [limit_batches(loader, limit, name) for loader in prepared]


#: The task's method that returns a stage's data when none is passed to the Trainer.
_LOADER_METHODS = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


def eval_dataloaders(task: Any, stage: str, dataloaders: Any) -> Any:
    """Return `dataloaders`, or the task's own for `stage` when None.

    Raises:
        ValueError: neither gives any data; names the method to override.
    """
    if dataloaders is None:
        dataloaders = getattr(task, _LOADER_METHODS[stage])()
    if dataloaders is None:
        raise ValueError(
            f"Trainer.{stage} has no data: pass `dataloaders=` or override "
            f"{type(task).__name__}.{_LOADER_METHODS[stage]}()."
        )
    return dataloaders


def batch_mover(trainer: Trainer) -> Callable[[Any, int], Any]:
    """Return how this stage moves a batch to the device, decided once: `move_batch` when the task or the
    DataModule overrides a batch-transfer hook; otherwise what the default hooks do (nothing on the CPU)."""
    task, datamodule = trainer.task, trainer.datamodule
    owners = [task] if datamodule is None else [task, datamodule]
    if any(overrides(owner, DataHooks, name) for owner in owners for name in TRANSFER_HOOKS):
        return functools.partial(move_batch, trainer)
    device = trainer.strategy.root_device
    if device.type == "cpu":
        return _unmoved
    return lambda batch, dataloader_idx: move_to_device(batch, device)


def _unmoved(batch: Any, dataloader_idx: int) -> Any:
    return batch


def move_batch(trainer: Trainer, batch: Any, dataloader_idx: int) -> Any:
    """Move `batch` to the strategy's device through the batch-transfer hooks, in Lightning's order:
    ``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer`` (each the
    DataModule's where it overrides it, else the task's)."""
    task, datamodule = trainer.task, trainer.datamodule

    def owner(name: str) -> DataHooks:
        overridden = datamodule is not None and getattr(type(datamodule), name) is not getattr(DataHooks, name)
        return datamodule if overridden else task

    batch = owner("on_before_batch_transfer").on_before_batch_transfer(batch, dataloader_idx)
    device = trainer.strategy.root_device
    batch = owner("transfer_batch_to_device").transfer_batch_to_device(batch, device, dataloader_idx)
    return owner("on_after_batch_transfer").on_after_batch_transfer(batch, dataloader_idx)
