"""Bit-exact resume with manual optimization and several optimizers (one process, and 2 real processes under every
exact strategy), and checkpoints written before them."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from syncline.testing import run_distributed
from syncline.trainer import Trainer
from syncline.trainer.optim import OptimizerSetup
from tests.trainer._manual import ToyGAN, gan_data
from tests.trainer._tasks import quiet
from tests.trainer.test_manual_distributed import EXACT
from tests.trainer.test_resume import Crash, SaveThenCrash, _run


class NoisyGAN(ToyGAN):
    """Draws random numbers in every step, so a resume must restore the RNG as well as both optimizers; steps the
    discriminator every 3 batches on the gradients of all 3 (the user's accumulation), so a checkpoint between
    them must keep the gradients."""

    def training_step(self, batch, batch_idx):
        real, z = batch
        real = real + 0.05 * torch.randn_like(real)
        opt_g, opt_d = self.optimizers()
        with self.toggled_optimizer(opt_g):
            g_loss = self.generator_loss(z)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
        with self.toggled_optimizer(opt_d):
            fake = self.generator(z).detach()
            bce = torch.nn.functional.binary_cross_entropy_with_logits
            ones, zeros = real.new_ones(len(real), 1), real.new_zeros(len(real), 1)
            d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 6
            self.manual_backward(d_loss)
            if batch_idx % 3 == 2:
                opt_d.step()
                opt_d.zero_grad()
                self.lr_schedulers()[1].step()
        self.lr_schedulers()[0].step()

    def generator_loss(self, z):
        scores = self.discriminator(self.generator(z))
        return torch.nn.functional.binary_cross_entropy_with_logits(scores, torch.ones_like(scores))


def _fit(tmp_path, callbacks=(), ckpt_path=None, init_seed: int = 0):
    torch.manual_seed(init_seed)
    task = NoisyGAN()
    seed = 7 if ckpt_path is None else 1234  # a resumed run must not depend on the seed it is given
    trainer = Trainer(max_epochs=3, seed=seed, callbacks=list(callbacks), **quiet(default_root_dir=tmp_path))
    trainer.fit(task, DataLoader(gan_data(40), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return task, trainer


@pytest.mark.parametrize(("epoch", "batch_idx"), [(1, 1), (0, None)], ids=["mid-epoch-mid-accumulation", "epoch-end"])
def test_manual_optimization_with_two_optimizers_resumes_bit_exactly(tmp_path, epoch, batch_idx):
    """Adam's moments, SGD's momentum, both schedulers, global_step, the RNG and the gradients the task is
    accumulating come back: the resumed run ends with the uninterrupted run's weights and learning rates
    (tolerance 0)."""
    reference, reference_trainer = _fit(tmp_path)
    path = tmp_path / "interrupted.ckpt"
    with pytest.raises(Crash):
        _fit(tmp_path, callbacks=[SaveThenCrash(path, epoch, batch_idx)])
    saved = torch.load(path, weights_only=True)
    assert len(saved["optimizer_states"]) == 2 and len(saved["lr_schedulers"]) == 2  # Lightning's keys
    resumed, trainer = _fit(tmp_path, ckpt_path=path, init_seed=99)
    assert trainer.global_step == reference_trainer.global_step == 3 * 5 + 3 * 1
    for name, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    for mine, theirs in zip(trainer.optimizers, reference_trainer.optimizers):
        assert mine.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]


def test_a_checkpoint_with_another_number_of_optimizers_is_refused(tmp_path):
    _, trainer = _fit(tmp_path)
    trainer.save_checkpoint(tmp_path / "two.ckpt")

    class OneOptimizer(NoisyGAN):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match=r"checkpoint has 2 optimizer\(s\) but configure_optimizers\(\) returned 1"):
        Trainer(max_epochs=4, **quiet()).fit(
            OneOptimizer(), DataLoader(gan_data(40), batch_size=8), ckpt_path=tmp_path / "two.ckpt"
        )


def test_a_checkpoint_written_before_several_optimizers_still_resumes_bit_exactly(tmp_path, monkeypatch):
    """Checkpoints of one optimizer used to hold only ``optimizer["optimizer"]``: written so, one resumes as
    before (the automatic-optimization resume test's mid-window case, tolerance 0)."""
    new_state_dict = OptimizerSetup.state_dict

    def old_state_dict(self, *args, **kwargs):
        state = new_state_dict(self, *args, **kwargs)
        return {"optimizer": state["optimizer"], "lr_schedulers": state["lr_schedulers"]}

    reference, _ = _run(tmp_path, 0)
    path = tmp_path / "old.ckpt"
    with monkeypatch.context() as patch:
        patch.setattr(OptimizerSetup, "state_dict", old_state_dict)
        with pytest.raises(Crash):
            _run(tmp_path, 0, callbacks=[SaveThenCrash(path, 1, 4)])
    assert "optimizers" not in torch.load(path, weights_only=True)["optimizer"]
    resumed, _ = _run(tmp_path, 0, ckpt_path=path, init_seed=99)
    for name, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def _fit_on_ranks(name: str, tmp: str, callbacks=(), ckpt_path=None, init_seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(init_seed)
    task = NoisyGAN()
    seed = 7 if ckpt_path is None else 1234
    strategy = EXACT[name](find_unused_parameters=True)  # toggle_optimizer freezes the other network
    kwargs = quiet(default_root_dir=tmp, max_epochs=3, seed=seed, callbacks=list(callbacks))
    # 4 samples per rank from the DistributedSampler: the single-process test's batch of 8.
    Trainer(strategy=strategy, **kwargs).fit(
        task, DataLoader(gan_data(40), batch_size=4, shuffle=True), ckpt_path=ckpt_path
    )
    return {key: value.detach().clone() for key, value in task.state_dict().items()}


def _straight_and_resumed(rank: int, world_size: int, name: str, tmp: str) -> dict[str, dict[str, torch.Tensor]]:
    straight = _fit_on_ranks(name, f"{tmp}/straight")
    path = f"{tmp}/interrupted.ckpt"
    with pytest.raises(Crash):
        _fit_on_ranks(name, f"{tmp}/crashed", callbacks=[SaveThenCrash(path, 1, 1)])
    return {"straight": straight, "resumed": _fit_on_ranks(name, f"{tmp}/resumed", ckpt_path=path, init_seed=99)}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_manual_optimization_resumes_bit_exactly_on_two_processes_under_every_exact_strategy(tmp_path, name):
    """The GAN above on 2 processes, stopped mid-epoch while the discriminator accumulates: its gradients come back
    on each rank, and the generator's backward (which the toggle keeps from reaching the discriminator) leaves them
    in place, so the resumed run ends with the uninterrupted run's weights on both ranks (tolerance 0)."""
    for result in run_distributed(_straight_and_resumed, 2, args=(name, str(tmp_path)), timeout=180):
        for key, value in result["straight"].items():
            assert torch.equal(result["resumed"][key], value), key
