"""The Trainer's optimization equals a hand-written loop: accumulation, clipping, schedulers, precision."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, reference_device, regression_data


def _hand_written(task: Regressor, data, batch_size: int, epochs: int, accumulate: int = 1, clip: float | None = None):
    """Train `task` the textbook way, on the Trainer's device; return it, on the CPU."""
    device = reference_device()
    optimizer = task.to(device).configure_optimizers()
    batches = [(x.to(device), y.to(device)) for x, y in loader(data, batch_size)]
    for _ in range(epochs):
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(task(x), y) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(task.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
    return task.cpu()


@pytest.mark.parametrize(
    ("accumulate", "clip"),
    [(1, None), (3, None), (1, 0.05), (4, 0.05)],
    ids=["plain", "accumulate3", "clip", "accumulate4+clip"],
)
def test_parameters_equal_hand_written_loop(accumulate, clip):
    """10 batches per epoch, so accumulation 3 and 4 also end each epoch with a partial window."""
    data = regression_data(80)
    torch.manual_seed(0)
    task = Regressor(lr=0.05)
    reference = _hand_written(copy.deepcopy(task), data, 8, epochs=2, accumulate=accumulate, clip=clip)
    trainer = Trainer(max_epochs=2, accumulate_grad_batches=accumulate, gradient_clip_val=clip, **quiet())
    trainer.fit(task, loader(data, 8))
    for ours, theirs in zip(task.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    steps_per_epoch = -(-10 // accumulate)
    assert trainer.global_step == 2 * steps_per_epoch


def test_clipping_changes_the_result():
    """Guard for the test above: a clip this small must actually bind."""
    data = regression_data(80)
    torch.manual_seed(0)
    task = Regressor(lr=0.05)
    clipped = _hand_written(copy.deepcopy(task), data, 8, epochs=1, clip=0.05)
    unclipped = _hand_written(copy.deepcopy(task), data, 8, epochs=1)
    assert not torch.allclose(clipped.net[0].weight, unclipped.net[0].weight)


def test_accumulation_equals_one_step_on_the_larger_batch():
    data = regression_data(32)
    torch.manual_seed(0)
    task = Regressor(lr=0.05)
    big = copy.deepcopy(task)
    Trainer(max_steps=1, accumulate_grad_batches=4, **quiet()).fit(task, loader(data, 8))
    Trainer(max_steps=1, **quiet()).fit(big, loader(data, 32))
    for ours, theirs in zip(task.parameters(), big.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_max_steps_counts_optimizer_steps_and_limits_apply():
    data = regression_data(80)
    trainer = Trainer(max_steps=7, accumulate_grad_batches=2, **quiet())
    trainer.fit(Regressor(), loader(data, 8))
    assert trainer.global_step == 7
    assert trainer.current_epoch == 1  # 5 steps in epoch 0, 2 in epoch 1

    trainer = Trainer(max_epochs=2, limit_train_batches=0.5, limit_val_batches=2, **quiet())
    seen: list[int] = []

    class Counting(Regressor):
        def validation_step(self, batch, batch_idx):
            seen.append(batch_idx)
            return super().validation_step(batch, batch_idx)

    trainer.fit(Counting(), loader(data, 8), loader(data, 8))
    assert trainer.global_step == 10  # half of 10 batches, two epochs
    assert seen == [0, 1] * 3  # sanity check (2) + 2 per epoch


def test_step_scheduler_and_val_check_interval():
    data = regression_data(80)
    validations: list[int] = []

    class Scheduled(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_validation_epoch_start(self):
            validations.append(self.trainer.global_step)

    trainer = Trainer(max_epochs=1, val_check_interval=0.25, num_sanity_val_steps=0, **quiet())
    task = Scheduled()
    trainer.fit(task, loader(data, 8), loader(data, 40))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5**10)
    # Quarters of 10 batches: after batches 2.5, 5, 7.5 and 10, rounded up.
    assert validations == [3, 5, 8, 10]


def test_epoch_metrics_are_batch_size_weighted_means():
    data = regression_data(20)
    logged: list[torch.Tensor] = []

    class Logging(Regressor):
        def training_step(self, batch, batch_idx):
            value = torch.tensor(float(batch_idx))
            logged.append(value)
            self.log("idx", value, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(max_epochs=1, **quiet())
    trainer.fit(Logging(), loader(data, 8))  # batches of 8, 8 and 4
    expected = (0 * 8 + 1 * 8 + 2 * 4) / 20
    assert trainer.callback_metrics["idx"].item() == pytest.approx(expected)


def test_torchmetrics_metric_is_computed_and_reset_each_epoch():
    import torchmetrics

    data = regression_data(32)

    class WithMetric(Regressor):
        def __init__(self):
            super().__init__()
            self.mae = torchmetrics.MeanAbsoluteError()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.mae(self(x), y)
            self.log("val_mae", self.mae)

    task = WithMetric()
    trainer = Trainer(max_epochs=1, **quiet())
    result = trainer.validate(task, loader(data, 8))
    with torch.no_grad():
        expected = (task(data.tensors[0]) - data.tensors[1]).abs().mean().item()
    assert result[0]["val_mae"] == pytest.approx(expected, rel=1e-5)
    assert task.mae._update_count == 0  # reset after compute


def test_bf16_mixed_runs_on_cpu():
    data = regression_data(16)
    seen_dtypes: list[torch.dtype] = []

    class Probe(Regressor):
        def training_step(self, batch, batch_idx):
            seen_dtypes.append(self.net[0](batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    Trainer(max_steps=1, precision="bf16-mixed", **quiet()).fit(Probe(), loader(data, 8))
    assert seen_dtypes == [torch.bfloat16]
    with pytest.raises(ValueError, match="Unknown precision '64'"):
        Trainer(precision="64")


def test_seed_makes_runs_repeatable():
    """Trainer(seed=...) seeds before the task is built: same seed, same weights; other seed, others."""
    data = regression_data(32)

    def run(seed: int) -> torch.Tensor:
        trainer = Trainer(max_epochs=1, seed=seed, **quiet())
        task = Regressor(dropout=0.5)
        trainer.fit(task, loader(data, 8, shuffle=True))
        return task.net[0].weight.detach().clone()

    first = run(123)
    torch.manual_seed(999)  # whatever happened before must not matter
    assert torch.equal(first, run(123))
    assert not torch.equal(first, run(124))
