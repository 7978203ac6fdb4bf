"""A GAN-like task trained by manual optimization with two optimizers, and the same training written by hand."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from syncline.trainer import Task
from tests.trainer._tasks import reference_device

LATENT, FEATURES = 4, 6


def gan_data(n: int = 32, seed: int = 0) -> TensorDataset:
    """Real samples and the generator's noise, both fixed: every rank's noise is part of its data shard, so two
    processes see the global batch's noise as one process does."""
    generator = torch.Generator().manual_seed(seed)
    real = torch.randn(n, FEATURES, generator=generator) * 0.5 + 1.0
    return TensorDataset(real, torch.randn(n, LATENT, generator=generator))


def gan_loader(batch_size: int = 8, n: int = 32) -> DataLoader:
    return DataLoader(gan_data(n), batch_size=batch_size)


class ToyGAN(Task):
    """Lightning's GAN pattern: the generator's step, then the discriminator's, each with its own optimizer and
    scheduler stepped by the task; `toggle` freezes the other network around each backward; `clip` clips the
    discriminator's gradients to that 2-norm before its step."""

    def __init__(self, toggle: bool = True, return_loss: bool = True, clip: float | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(LATENT, 8), nn.Tanh(), nn.Linear(8, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        self.toggle = toggle
        self.return_loss = return_loss
        self.clip = clip

    def gan_step(
        self, batch, opt_g, opt_d, backward: Callable[[Tensor], None], clip: Callable[[], None] | None = None
    ) -> tuple[Tensor, Tensor]:
        """One generator step and one discriminator step (`clip` before it); the hand-written reference calls it
        too."""
        real, z = batch
        ones, zeros = real.new_ones(len(real), 1), real.new_zeros(len(real), 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        if self.toggle:
            self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self.generator(z)), ones)
        opt_g.zero_grad()
        backward(g_loss)
        opt_g.step()
        if self.toggle:
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 2
        opt_d.zero_grad()
        backward(d_loss)
        if clip is not None:
            clip()
        opt_d.step()
        if self.toggle:
            self.untoggle_optimizer(opt_d)
        return g_loss, d_loss

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        clip = None if self.clip is None else lambda: self.clip_gradients(opt_d, self.clip, "norm")
        g_loss, d_loss = self.gan_step(batch, opt_g, opt_d, self.manual_backward, clip)
        for scheduler in self.lr_schedulers():
            scheduler.step()  # the task's: Lightning steps no scheduler in manual optimization
        self.log("g_loss", g_loss)
        return d_loss if self.return_loss else None

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.05, betas=(0.5, 0.999))
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.9)
        schedulers = [torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.9), torch.optim.lr_scheduler.StepLR(opt_d, 2, 0.5)]
        return [opt_g, opt_d], schedulers


def train_by_hand(task: ToyGAN, loader: DataLoader, epochs: int = 1) -> dict[str, Tensor]:
    """Train `task` with plain torch (loss.backward(), optimizer.step()) on `loader`, on the Trainer's
    device: the reference."""
    device = reference_device()
    (opt_g, opt_d), schedulers = task.to(device).configure_optimizers()
    toggle, task.toggle = task.toggle, False  # toggling changes no value: zero_grad clears the other's grads

    def clip() -> None:
        nn.utils.clip_grad_norm_(task.discriminator.parameters(), task.clip)

    for _ in range(epochs):
        for batch in loader:
            batch = [tensor.to(device) for tensor in batch]
            task.gan_step(batch, opt_g, opt_d, lambda loss: loss.backward(), None if task.clip is None else clip)
            for scheduler in schedulers:
                scheduler.step()
    task.toggle = toggle
    return {name: value.detach().cpu().clone() for name, value in task.state_dict().items()}
