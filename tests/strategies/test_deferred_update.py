"""BucketedDDP(deferred_update=True): the same weights as the blocking step, to the bit, and what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from syncline.callbacks import Callback
from syncline.options import OptionError
from syncline.strategies import BucketedDDP
from syncline.testing import run_distributed
from syncline.trainer import Task, Trainer
from tests.trainer._tasks import loader, quiet, regression_data


class DeepRegressor(Task):
    """Four layers (one bucket each with a 0 MiB cap), a parameter of the task's own read in `training_step`,
    AdamW with weight decay and a learning rate that changes every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1)
        )
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x) * self.scale, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x) * self.scale, y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SaveAt(Callback):
    """Save a checkpoint at the end of the batch that takes optimizer step `step` (its update still in flight)."""

    reads_parameters = False  # the checkpoint lands the update itself: what this test checks

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Trainer, task: Task, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and not trainer.fit_loop.accumulated_grads():
            deferred = trainer.strategy.deferred
            # Every bucket is in flight, and the held half was launched last-first.
            assert deferred is not None and deferred.stepped and len(deferred.pending) == 9, deferred.pending
            trainer.save_checkpoint(self.path)
            assert not deferred.pending


def _fit(deferred: bool, max_steps: int, ckpt_path: str | None = None, save: str | None = None, **options: Any):
    torch.manual_seed(0)
    task = DeepRegressor()
    strategy = BucketedDDP(bucket_cap_mb=0, first_bucket_mb=0, deferred_update=deferred, **options)
    trainer = Trainer(
        max_steps=max_steps,
        strategy=strategy,
        accumulate_grad_batches=2,
        val_check_interval=3,
        limit_val_batches=2,
        callbacks=[SaveAt(4, save)] if save else [],
        **quiet(seed=0),
    )
    data = regression_data(128)
    trainer.fit(task, loader(data, batch_size=4, shuffle=True), loader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer


def _snapshot(trainer: Trainer) -> dict[str, Any]:
    optimizer = trainer.optim.optimizer
    return {
        "weights": {k: v.clone() for k, v in trainer.task.state_dict().items()},
        "moments": [optimizer.state[p]["exp_avg_sq"].clone() for p in trainer.task.parameters()],
        "bytes": trainer.strategy.communication_stats()["comm/total_bytes"],
    }


def _blocking_and_deferred(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    runs = {
        "blocking": _fit(False, 9),
        "deferred": _fit(True, 9),
        "hold_all": _fit(True, 9, deferred_hold=1.0),
        "hold_none": _fit(True, 9, deferred_hold=0.0),
        "bf16_hook": _fit(True, 9, comm_hook="bf16"),
        "bf16_hook_blocking": _fit(False, 9, comm_hook="bf16"),
    }
    # A checkpoint taken while step 4's update is in flight: saving applies it, and the run goes on unchanged.
    runs["saving"] = _fit(True, 9, save=f"{tmp}/mid.ckpt")
    runs["resumed"] = _fit(True, 9, ckpt_path=f"{tmp}/mid.ckpt")
    return {name: _snapshot(trainer) for name, trainer in runs.items()}


def test_deferred_updates_equal_the_blocking_step_to_the_bit_and_resume_exactly(tmp_path):
    results = run_distributed(_blocking_and_deferred, world_size=2, args=(str(tmp_path),), timeout=240)
    for rank, runs in enumerate(results):
        pairs = [(name, "blocking") for name in ("deferred", "hold_all", "hold_none", "saving", "resumed")]
        for name, reference in [*pairs, ("bf16_hook", "bf16_hook_blocking")]:
            for key, value in runs[reference]["weights"].items():
                assert torch.equal(runs[name]["weights"][key], value), (rank, name, key)
            for mine, theirs in zip(runs[name]["moments"], runs[reference]["moments"]):
                assert torch.equal(mine, theirs), (rank, name)
            assert runs[name]["bytes"] == runs[reference]["bytes"], (rank, name)
    assert not torch.equal(results[0]["bf16_hook"]["weights"]["scale"], results[0]["blocking"]["weights"]["scale"])


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"find_unused_parameters": True}, "find_unused_parameters=True"),
        ({"bucket_cap_mb": "auto", "static_graph": True}, "bucket_cap_mb='auto'"),
        ({"gradient_as_bucket_view": False}, "gradient_as_bucket_view=False"),
        ({"deferred_hold": 1.5}, "fraction"),
    ],
)
def test_options_deferred_updates_cannot_combine_with_are_refused(options, words):
    with pytest.raises(OptionError, match=words):
        BucketedDDP(deferred_update=True, **options)


@pytest.mark.parametrize(
    ("trainer_options", "words"),
    [({"gradient_clip_val": 1.0}, "gradient_clip_val=1.0"), ({"precision": "16-mixed"}, "precision='16-mixed'")],
)
def test_clipping_and_the_fp16_scaler_are_refused_before_training(trainer_options, words):
    trainer = Trainer(max_steps=1, strategy=BucketedDDP(deferred_update=True), **trainer_options, **quiet())
    with pytest.raises(OptionError, match=f"deferred_update=True.*{words}"):
        trainer.fit(DeepRegressor(), loader(regression_data(16)))


def test_manual_optimization_and_join_are_refused():
    strategy = BucketedDDP(deferred_update=True)
    assert "deferred_update" in strategy.manual_optimization_refused
    assert not strategy.supports_join
    assert BucketedDDP().supports_join
