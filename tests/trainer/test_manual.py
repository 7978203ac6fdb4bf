"""Manual optimization (Lightning's ``automatic_optimization = False``) in one process, as Lightning behaves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.callbacks import Callback
from syncline.options import OptionError
from syncline.strategies import STRATEGIES, BucketedDDP, NativeDDP, ParameterServer, ShardedParameterServer
from syncline.trainer import Task, Trainer
from syncline.trainer.manual import TrainerOptimizer
from tests.trainer._manual import ToyGAN, gan_loader, train_by_hand
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


def _fit(task: Task, data=None, **kwargs) -> Trainer:
    trainer = Trainer(**quiet(**{"max_epochs": 1, "num_sanity_val_steps": 0, **kwargs}))
    trainer.fit(task, data if data is not None else gan_loader())
    return trainer


def test_gan_with_two_optimizers_equals_the_same_training_written_by_hand():
    """Two optimizers, toggle_optimizer, manual_backward and the task's schedulers: bit-identical (tolerance 0)
    to plain torch's loss.backward() and optimizer.step() on the same batches, over two epochs."""
    torch.manual_seed(0)
    task = ToyGAN()
    torch.manual_seed(0)
    reference = train_by_hand(ToyGAN(), gan_loader(), epochs=2)
    trainer = _fit(task, max_epochs=2)
    for name, value in reference.items():
        torch.testing.assert_close(task.state_dict()[name], value, rtol=0, atol=0)
    # Lightning counts every optimizer step: two per batch, 4 batches, 2 epochs.
    assert trainer.global_step == 16
    lr_g, lr_d = (opt.param_groups[0]["lr"] for opt in trainer.optimizers)
    assert lr_g == pytest.approx(0.05 * 0.9**8) and lr_d == pytest.approx(0.1 * 0.5**4)


def test_max_steps_counts_every_manual_optimizer_step():
    """As Lightning: max_steps=5 with two steps per batch stops after the batch that reaches it (6 steps)."""
    trainer = _fit(ToyGAN(), max_epochs=5, max_steps=5)
    assert trainer.global_step == 6


def test_schedulers_are_the_tasks_to_step():
    """Lightning steps no scheduler under manual optimization: a task that does not step them keeps its rates."""

    class NoScheduling(ToyGAN):
        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            self.gan_step(batch, opt_g, opt_d, self.manual_backward)

    trainer = _fit(NoScheduling())
    assert [opt.param_groups[0]["lr"] for opt in trainer.optimizers] == [0.05, 0.1]


def test_optimizers_are_wrapped_and_keep_their_class():
    seen = {}

    class Peek(ToyGAN):
        def training_step(self, batch, batch_idx):
            seen["wrapped"] = self.optimizers()
            seen["raw"] = self.optimizers(use_pl_optimizer=False)
            return super().training_step(batch, batch_idx)

    trainer = _fit(Peek(), limit_train_batches=1)
    opt_g, opt_d = seen["wrapped"]
    assert isinstance(opt_g, TrainerOptimizer) and isinstance(opt_g, torch.optim.Adam)
    assert isinstance(opt_d, torch.optim.SGD) and opt_d.optimizer is trainer.optimizers[1]
    assert seen["raw"] == trainer.optimizers and not isinstance(seen["raw"][0], TrainerOptimizer)


def test_toggle_optimizer_freezes_the_others_and_untoggle_restores_what_was_frozen():
    seen = {}

    class Toggling(ToyGAN):
        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            self.toggle_optimizer(opt_g)
            seen["g"] = [p.requires_grad for p in self.parameters()]
            self.untoggle_optimizer(opt_g)
            with self.toggled_optimizer(opt_d):
                seen["d"] = [p.requires_grad for p in self.parameters()]
            seen["after"] = [p.requires_grad for p in self.parameters()]
            return None

    task = Toggling()
    task.generator[2].bias.requires_grad = False  # frozen before: stays frozen through toggles
    _fit(task, limit_train_batches=1)
    generator, discriminator = len(list(task.generator.parameters())), len(list(task.discriminator.parameters()))
    assert seen["g"] == [True, True, True, False] + [False] * discriminator
    assert seen["d"] == [False] * generator + [True] * discriminator
    assert seen["after"] == [True, True, True, False] + [True] * discriminator


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clip_gradients_clips_the_optimizers_parameters_as_torch_does(algorithm):
    """self.clip_gradients(opt, 0.05, algorithm) equals torch's clip_grad_norm_/clip_grad_value_ on the same
    gradients (tolerance 0); the other optimizer's gradients are untouched."""
    seen = {}

    class Clipping(ToyGAN):
        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            real, z = batch
            loss = self.discriminator(self.generator(z)).mean() + self.discriminator(real).pow(2).mean()
            self.manual_backward(loss)
            seen["before"] = [p.grad.clone() for p in self.parameters()]
            self.clip_gradients(opt_d, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
            seen["after"] = [p.grad.clone() for p in self.parameters()]

    task = Clipping()
    _fit(task, limit_train_batches=1)
    generator = len(list(task.generator.parameters()))
    expected = [g.clone() for g in seen["before"][generator:]]
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(_holders(expected), 0.05)
    else:
        torch.nn.utils.clip_grad_value_(_holders(expected), 0.05)
    for got, want in zip(seen["after"][generator:], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(seen["after"][:generator], seen["before"][:generator]):
        assert torch.equal(got, want)


def _holders(grads):
    """Parameters whose .grad is `grads`' tensors, so torch's clipping works on them in place."""
    holders = []
    for grad in grads:
        holder = nn.Parameter(torch.zeros_like(grad))
        holder.grad = grad
        holders.append(holder)
    return holders


def test_training_step_may_return_a_loss_or_none_and_the_batch_end_sees_it_detached():
    outputs = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, task, out, batch, batch_idx):
            outputs.append(out)

    _fit(ToyGAN(return_loss=True), limit_train_batches=1, callbacks=[Record()])
    _fit(ToyGAN(return_loss=False), limit_train_batches=1, callbacks=[Record()])
    assert set(outputs[0]) == {"loss"} and outputs[0]["loss"].grad_fn is None
    assert outputs[1] is None


def test_lightning_errors():
    with pytest.raises(ValueError, match=r"Automatic gradient clipping is not supported for manual optimization"):
        _fit(ToyGAN(), gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"Automatic gradient accumulation is not supported for manual"):
        _fit(ToyGAN(), accumulate_grad_batches=2)
    with pytest.raises(RuntimeError, match=r"To use manual_backward, please disable automatic optimization"):

        class Automatic(Regressor):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                self.manual_backward(loss)
                return loss

        _fit(Automatic(), loader(regression_data(16)))

    class ReturnsText(ToyGAN):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return "done"

    with pytest.raises(TypeError, match=r"must either return a Tensor \(or a dict\) or have no return"):
        _fit(ReturnsText())

    class Conflicting(ToyGAN):
        def training_step(self, batch, batch_idx):
            self.clip_gradients(self.optimizers()[0], gradient_clip_val=1.0, gradient_clip_algorithm="middle")

    with pytest.raises(ValueError, match=r"`gradient_clip_algorithm` 'middle' is invalid"):
        _fit(Conflicting())


REFUSED = [name for name, cls in STRATEGIES.items() if cls().manual_optimization_refused]


def test_the_refused_strategies_are_the_relaxed_ones():
    assert sorted(REFUSED) == sorted(
        [
            "bytegrad",
            "powersgd",
            "qadam",
            "local_sgd",
            "decentralized",
            "async_model_average",
            "diloco",
        ]
    )


@pytest.mark.parametrize("name", REFUSED)
def test_a_strategy_that_cannot_follow_manual_optimization_is_refused_before_any_process_starts(name):
    """One message naming the strategy, why, and the fix; raised in the calling process (no worker launched)."""
    trainer = Trainer(**quiet(max_epochs=1, strategy=name, accelerator="cpu", devices=2))
    with pytest.raises(OptionError, match=rf"strategy='{name}' cannot train ToyGAN, which uses manual .*Use an exact"):
        trainer.fit(ToyGAN(), gan_loader())


@pytest.mark.parametrize("strategy", [BucketedDDP(static_graph=True), NativeDDP(static_graph=True)])
def test_an_exact_strategy_promising_a_static_graph_is_refused(strategy):
    trainer = Trainer(**quiet(max_epochs=1, strategy=strategy, accelerator="cpu", devices=2))
    with pytest.raises(OptionError, match=r"static_graph=True promises .* drop static_graph"):
        trainer.fit(ToyGAN(), gan_loader())


@pytest.mark.parametrize("server", [ParameterServer, ShardedParameterServer])
def test_a_prefetching_parameter_server_is_refused_under_manual_optimization(server):
    """Its transfers land at the next forward, which a manual step need not reach before reading or stepping again."""
    trainer = Trainer(**quiet(max_epochs=1, strategy=server(prefetch=True), accelerator="cpu", devices=2))
    with pytest.raises(OptionError, match=rf"'{server.name}' cannot train ToyGAN.*drop prefetch"):
        trainer.fit(ToyGAN(), gan_loader())


def test_fp16_loss_scaling_with_clipping_inside_a_manual_step():
    """16-mixed: manual_backward scales the loss, clip_gradients unscales once, the step unscales no twice."""
    seen = {}

    class Scaled(ToyGAN):
        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            real, z = batch
            loss = self.discriminator(real).pow(2).mean()
            opt_d.zero_grad()
            self.manual_backward(loss)
            seen["scaled"] = self.discriminator[0].weight.grad.clone()
            self.clip_gradients(opt_d, gradient_clip_val=1e6)
            seen["unscaled"] = self.discriminator[0].weight.grad.clone()
            opt_d.step()

    _fit(Scaled(), limit_train_batches=2, precision="16-mixed")
    ratio = (seen["scaled"] / seen["unscaled"]).flatten()
    torch.testing.assert_close(ratio, torch.full_like(ratio, ratio[0].item()), rtol=1e-3, atol=0)
    assert ratio[0] > 1000  # the scaler's scale, 2**16 at the start


def test_a_scheduler_dicts_monitor_is_ignored_with_lightnings_warning():
    class Monitored(ToyGAN):
        def configure_optimizers(self):
            (opt_g, opt_d), _ = super().configure_optimizers()
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt_g)
            return [
                {"optimizer": opt_g, "lr_scheduler": {"scheduler": plateau, "monitor": "g_loss"}},
                {"optimizer": opt_d},
            ]

        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            self.gan_step(batch, opt_g, opt_d, self.manual_backward)

    with pytest.warns(UserWarning, match=r"contains the key\(s\) \['monitor'\], but the keys will be ignored"):
        trainer = _fit(Monitored(), limit_train_batches=1)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05  # nobody stepped the plateau scheduler
