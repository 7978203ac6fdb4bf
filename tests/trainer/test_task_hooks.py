"""The hooks a task overrides to change a step (Lightning's ModelHooks and batch-transfer DataHooks): each does
what Lightning's does, checked against plain torch where it changes the math (tolerance 0: the same operations)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from syncline import DataModule
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, reference_device, regression_data

DATA = regression_data(32)


def _fit(task, epochs: int = 1, **kwargs) -> Trainer:
    trainer = Trainer(**quiet(max_epochs=epochs, num_sanity_val_steps=0, **kwargs))
    trainer.fit(task, loader(DATA, 8))
    return trainer


def _by_hand(task, step_if=lambda batch_idx: True, zero_grad=True, clip=None, scale=1.0, epochs=1):
    """Plain torch, on the Trainer's device: for each batch, zero_grad (optional), backward of `scale` * loss, clip,
    step if asked."""
    device = reference_device()
    optimizer = task.to(device).configure_optimizers()
    for _ in range(epochs):
        for batch_idx, (x, y) in enumerate(loader(DATA, 8)):
            x, y = x.to(device), y.to(device)
            if zero_grad:
                optimizer.zero_grad()
            (scale * nn.functional.mse_loss(task(x), y)).backward()
            if clip is not None:
                clip(list(task.parameters()))
            if step_if(batch_idx):
                optimizer.step()
    return {name: value.cpu() for name, value in task.state_dict().items()}


def _assert_same(task, reference):
    for name, value in reference.items():
        torch.testing.assert_close(task.state_dict()[name], value, rtol=0, atol=0)


def _pair(cls):
    torch.manual_seed(0)
    task = cls()
    torch.manual_seed(0)
    return task, Regressor()


def test_backward_hook_runs_the_backward():
    """Lightning's ``backward(loss)`` override: doubling the loss there doubles every gradient."""

    class Doubled(Regressor):
        def backward(self, loss):
            (2 * loss).backward()

    task, plain = _pair(Doubled)
    _fit(task)
    _assert_same(task, _by_hand(plain, scale=2.0))


def test_optimizer_step_hook_decides_whether_and_how_to_step():
    """Skipping the step on odd batches (running only the closure): those batches' gradients are dropped at the
    next window's zero_grad; global_step still counts every call, as Lightning counts it."""
    calls = []

    class EvenSteps(Regressor):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            calls.append((epoch, batch_idx, type(optimizer).__name__))
            if batch_idx % 2 == 0:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()

    task, plain = _pair(EvenSteps)
    trainer = _fit(task)
    _assert_same(task, _by_hand(plain, step_if=lambda batch_idx: batch_idx % 2 == 0))
    assert calls == [(0, i, "TrainerSGD") for i in range(4)] and trainer.global_step == 4


def test_optimizer_step_hook_can_warm_up_the_learning_rate():
    class WarmUp(Regressor):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer.step(closure=optimizer_closure)
            for group in optimizer.param_groups:
                group["lr"] = 0.01 * (self.trainer.global_step + 1)

    trainer = _fit(WarmUp())
    # The hook runs before its step is counted (as in Lightning): the 4th sees global_step 3.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.04)


def test_optimizer_zero_grad_hook_decides_how_gradients_are_reset():
    """Never resetting them (an override that does nothing) accumulates every batch's gradient, as in torch."""

    class NeverReset(Regressor):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            pass

    task, plain = _pair(NeverReset)
    _fit(task)
    _assert_same(task, _by_hand(plain, zero_grad=False))


class _GradSeen(Regressor):
    """Records, per batch, whether the first weight has a gradient in training_step and in the batch hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, bool]] = []

    def _note(self, where: str, batch_idx: int) -> None:
        self.seen.append((where, batch_idx, next(self.parameters()).grad is not None))

    def on_train_batch_start(self, batch, batch_idx):
        self._note("batch_start", batch_idx)

    def training_step(self, batch, batch_idx):
        self._note("training_step", batch_idx)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._note("batch_end", batch_idx)


def test_gradients_are_reset_where_lightning_resets_them_whenever_a_hook_can_see_it():
    """Lightning resets a window's gradients after training_step, before the backward. With a listener of
    on_before_zero_grad the moment is Lightning's: training_step still sees the previous window's gradients."""

    class Listening(_GradSeen):
        def on_before_zero_grad(self, optimizer):
            self._note("before_zero_grad", self.trainer.fit_loop.state.batch_idx)

    task = Listening()
    _fit(task)
    assert [where for where, batch_idx, _ in task.seen if batch_idx == 1] == [
        "batch_start", "training_step", "before_zero_grad", "batch_end"
    ]  # fmt: skip
    assert all(has_grad for where, batch_idx, has_grad in task.seen if batch_idx > 0 or where == "batch_end")


def test_with_nothing_listening_gradients_are_reset_just_before_training_step_and_the_math_is_unchanged():
    """The one difference from Lightning (docs/from_lightning.md): with no on_before_zero_grad listener and no own
    optimizer_zero_grad, training_step sees `.grad` None; every hook still sees what it sees in Lightning (the
    previous window's gradients at batch start, this window's at batch end), and the weights equal plain torch's.
    With accumulation only a window's first micro-batch starts from reset gradients."""
    task, plain = _pair(_GradSeen)
    _fit(task)
    _assert_same(task, _by_hand(plain))
    assert task.seen == [
        (where, batch_idx, where != "training_step" and (batch_idx > 0 or where == "batch_end"))
        for batch_idx in range(4)
        for where in ("batch_start", "training_step", "batch_end")
    ]
    accumulating = _GradSeen()
    _fit(accumulating, accumulate_grad_batches=2)
    in_step = [has_grad for where, _, has_grad in accumulating.seen if where == "training_step"]
    assert in_step == [False, True, False, True]


@pytest.mark.parametrize("listening", [False, True], ids=["nothing_listening", "on_before_zero_grad"])
def test_a_window_whose_first_training_step_returns_none_still_starts_from_reset_gradients(listening):
    """Lightning resets a window's gradients after its first training_step whatever that returned: with
    accumulation 2 and batch 2 skipped (None), the second step applies batch 3's gradient alone (halved, the
    window's average), not the first window's again. Checked against plain torch, tolerance 0."""

    class SkipsBatch2(Regressor):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == 2 else super().training_step(batch, batch_idx)

        if listening:

            def on_before_zero_grad(self, optimizer):
                pass

    task, plain = _pair(SkipsBatch2)
    _fit(task, accumulate_grad_batches=2)
    device = reference_device()
    optimizer = plain.to(device).configure_optimizers()
    for batch_idx, (x, y) in enumerate(loader(DATA, 8)):
        if batch_idx % 2 == 0:
            optimizer.zero_grad()
        if batch_idx != 2:
            (nn.functional.mse_loss(plain(x.to(device)), y.to(device)) / 2).backward()
        if batch_idx % 2 == 1:
            optimizer.step()
    _assert_same(task, {name: value.cpu() for name, value in plain.state_dict().items()})


def test_configure_gradient_clipping_gets_the_trainers_values_and_can_clip_its_own_way():
    seen = []

    class OwnClipping(Regressor):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            seen.append((gradient_clip_val, gradient_clip_algorithm))
            self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")

    task, plain = _pair(OwnClipping)
    _fit(task)  # no clipping configured on the Trainer: the hook clips anyway
    _assert_same(task, _by_hand(plain, clip=lambda params: torch.nn.utils.clip_grad_value_(params, 0.01)))
    assert seen[0] == (None, "norm")

    class Default(Regressor):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            seen.append((gradient_clip_val, gradient_clip_algorithm))
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    task, plain = _pair(Default)
    _fit(task, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    _assert_same(task, _by_hand(plain, clip=lambda params: torch.nn.utils.clip_grad_norm_(params, 0.05)))
    assert seen[-1] == (0.05, "norm")


class DictBatches(Regressor):
    """Takes dict batches; the transfer hooks turn them into (x, y) on the device and record what they saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, str]] = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.seen.append(("before", dataloader_idx, type(batch).__name__))
        return batch["x"], batch["y"]

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.seen.append(("transfer", dataloader_idx, device.type))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.seen.append(("after", dataloader_idx, type(batch).__name__))
        x, y = batch
        return x, 0 * y  # the step sees what this returns

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_y", batch[1].abs().sum())


def _dict_loader(n: int = 16) -> DataLoader:
    x, y = DATA.tensors
    return DataLoader([{"x": x[i], "y": y[i]} for i in range(n)], batch_size=8)


def test_batch_transfer_hooks_run_in_lightning_order_for_training_and_every_evaluation_loader():
    task = DictBatches()
    trainer = Trainer(**quiet(max_epochs=1, num_sanity_val_steps=0))
    trainer.fit(task, _dict_loader(), [_dict_loader(8), _dict_loader(8)])
    train = [("before", 0, "dict"), ("transfer", 0, trainer.strategy.root_device.type), ("after", 0, "tuple")]
    assert task.seen[:6] == train * 2
    assert task.seen[6:] == [(name, idx, kind) for idx in (0, 1) for name, _, kind in train]
    assert trainer.callback_metrics["val_y/dataloader_idx_0"] == 0  # the validation step saw the hook's batch


def test_a_datamodules_batch_transfer_hook_replaces_the_tasks():
    class Data(DataModule):
        def train_dataloader(self):
            return _dict_loader()

        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch["x"], batch["y"] * 0

    class Task(DictBatches):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            raise AssertionError("the DataModule's hook runs instead")

        def training_step(self, batch, batch_idx):
            assert batch[1].abs().sum() == 0
            return super().training_step(batch, batch_idx)

    Trainer(**quiet(max_epochs=1)).fit(Task(), datamodule=Data())


class Lazy(Regressor):
    """Builds its network in configure_model (once: it is called for every stage), as Lightning advises."""

    def __init__(self) -> None:
        super().__init__()
        del self.net
        self.net = None
        self.configured = 0

    def configure_model(self):
        self.configured += 1
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def test_configure_model_builds_the_model_before_the_optimizers_and_the_checkpoint_loads_into_it(tmp_path):
    task = Lazy()
    trainer = _fit(task, default_root_dir=tmp_path)
    assert task.configured == 1 and trainer.global_step == 4
    trainer.save_checkpoint(tmp_path / "lazy.ckpt")
    fresh = Lazy()
    metrics = Trainer(**quiet()).validate(fresh, loader(DATA, 8), ckpt_path=tmp_path / "lazy.ckpt")
    assert fresh.configured == 1 and torch.equal(fresh.net[0].weight, task.net[0].weight)
    assert metrics[0]["val_loss"] > 0


def test_prepare_data_on_the_task_runs_before_setup_without_a_datamodule():
    order = []

    class Prepared(Regressor):
        def prepare_data(self):
            order.append("prepare_data")

        def setup(self, stage):
            order.append(f"setup {stage}")

        def configure_model(self):
            order.append("configure_model")

    _fit(Prepared())
    assert order == ["prepare_data", "setup fit", "configure_model"]
