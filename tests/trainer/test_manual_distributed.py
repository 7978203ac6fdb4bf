"""Manual optimization on 2 real processes (gloo, 127.0.0.1): every exact strategy equals one process on the
global batch, and a parameter a backward does not reach is a clear error on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch

from syncline.strategies import BucketedDDP, NativeDDP, ParameterServer, ShardedParameterServer, TensorFusion
from syncline.testing import run_distributed, run_ranks
from syncline.trainer import Trainer
from tests.trainer._manual import ToyGAN, gan_loader, train_by_hand
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

EXACT = {
    "bucketed_ddp": BucketedDDP,
    "native_ddp": NativeDDP,
    "tensor_fusion": TensorFusion,
    "parameter_server": ParameterServer,
    "sharded_parameter_server": ShardedParameterServer,
}


def _fit_gan(rank, world_size, name, find_unused, toggle, clip=None):
    torch.manual_seed(0)
    task = ToyGAN(toggle=toggle, clip=clip)
    strategy = EXACT[name](find_unused_parameters=find_unused)
    trainer = Trainer(**quiet(max_epochs=2, strategy=strategy, num_sanity_val_steps=0))
    # 4 samples per rank from the DistributedSampler: the global batch is the one process's 8.
    trainer.fit(task, gan_loader(batch_size=4))
    return {k: v.detach().clone() for k, v in task.state_dict().items()}, trainer.global_step


# Without toggling, the generator's backward also adds to the discriminator's gradients (then reset): run for the
# core's reducer and for both servers, whose reduced gradients are scaled before a backward adds to them.
GAN_CASES = [(name, True) for name in sorted(EXACT)] + [
    (name, False) for name in ("bucketed_ddp", "parameter_server", "sharded_parameter_server")
]
GAN_IDS = [f"{name}-{'toggle' if toggle else 'no_toggle'}" for name, toggle in GAN_CASES]


@pytest.mark.parametrize(("name", "toggle"), GAN_CASES, ids=GAN_IDS)
def test_a_manual_gan_on_two_processes_equals_one_process_on_the_global_batch(name, toggle):
    """Two optimizers, two synchronized backwards per batch (the discriminator's reaches no generator parameter;
    with toggle_optimizer the generator's reaches no discriminator parameter), the task's schedulers, 2 epochs:
    every rank ends with the weights of plain torch on the global batch (tolerance 1e-5: the mean of two shard
    means sums in another order), and counts 2 steps per batch."""
    results = run_distributed(_fit_gan, world_size=2, args=(name, True, toggle), timeout=120)
    torch.manual_seed(0)
    reference = train_by_hand(ToyGAN(), gan_loader(batch_size=8), epochs=2)
    for state, steps in results:
        assert steps == 2 * 2 * 32 // 8
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_clipping_inside_a_manual_step_on_two_processes_equals_one_process(name):
    """`clip_gradients(opt_d, 0.05, "norm")` before the discriminator's step clips by the norm of the global
    batch's gradients (the servers: on the ranks holding them; the sharded one: of every rank's slices): every rank
    ends with plain torch's weights with `clip_grad_norm_` (tolerance 1e-5)."""
    results = run_distributed(_fit_gan, world_size=2, args=(name, True, True, 0.05), timeout=120)
    torch.manual_seed(0)
    reference = train_by_hand(ToyGAN(clip=0.05), gan_loader(batch_size=8), epochs=2)
    torch.manual_seed(0)
    unclipped = train_by_hand(ToyGAN(), gan_loader(batch_size=8), epochs=2)
    assert not torch.allclose(reference["discriminator.0.weight"], unclipped["discriminator.0.weight"])
    for state, _ in results:
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_a_backward_that_reaches_not_every_parameter_is_an_error_on_every_rank_without_find_unused(name):
    """toggle_optimizer freezes the discriminator for the generator's backward: without find_unused_parameters,
    every rank raises, naming the fix, within the timeout (a bucketed reducer waiting for those gradients would
    hang instead)."""
    outcomes = run_ranks(_fit_gan, world_size=2, args=(name, False, True), timeout=90)
    for outcome in outcomes:
        assert outcome.error is not None, f"rank {outcome.rank} did not fail"
        assert "find_unused_parameters" in outcome.error, outcome.error
        assert "timed out" not in outcome.error


class Accumulating(Regressor):
    """Lightning's manual accumulation: two backwards per batch (each half of it), a step every 2 batches."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        half = len(x) // 2
        for part in (slice(None, half), slice(half, None)):
            loss = torch.nn.functional.mse_loss(self(x[part]), y[part]) / 2 / 2  # two halves, two batches
            self.manual_backward(loss)
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()


def _fit_accumulating(rank, world_size, name):
    torch.manual_seed(0)
    task = Accumulating()
    trainer = Trainer(**quiet(max_epochs=2, strategy=EXACT[name](), num_sanity_val_steps=0))
    trainer.fit(task, loader(regression_data(32), 4))
    return {k: v.detach().clone() for k, v in task.state_dict().items()}, trainer.global_step


def _accumulated_by_hand() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    task = Regressor()
    optimizer = task.configure_optimizers()
    for _ in range(2):
        for batch_idx, (x, y) in enumerate(loader(regression_data(32), 8)):
            (torch.nn.functional.mse_loss(task(x), y) / 2).backward()
            if batch_idx % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    return task.state_dict()


@pytest.mark.parametrize("name", sorted(EXACT))
def test_backwards_that_add_to_earlier_synchronized_gradients_equal_one_process(name):
    """Four synchronized backwards per optimizer step (two per batch, a step every two batches), each adding to
    gradients an earlier one averaged: every rank ends with plain torch's weights on the global batch, one
    backward per batch (tolerance 1e-5)."""
    results = run_distributed(_fit_accumulating, world_size=2, args=(name,), timeout=120)
    reference = _accumulated_by_hand()
    for state, steps in results:
        assert steps == 2 * 2
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5)
