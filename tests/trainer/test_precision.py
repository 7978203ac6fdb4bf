"""Mixed precision with every strategy: fp16's loss-scaler verdict agreed across ranks, bf16 everywhere."""

from __future__ import annotations

import pytest
import torch

from syncline.callbacks import Callback
from syncline.strategies import (
    STRATEGIES,
    BucketedDDP,
    ByteGrad,
    LocalSGD,
    ParameterServer,
    PowerSGD,
    QAdam,
    ShardedParameterServer,
    TensorFusion,
)
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from syncline.trainer import precision as precision_module
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

#: The step (0-based) whose backward gets an inf in rank 1's gradient.
POISONED = 1


class PoisonedRegressor(Regressor):
    """Adam regressor; rank 1's first-layer gradient gets an inf in backward number POISONED, before any sync."""

    def __init__(self) -> None:
        super().__init__(lr=0.01, optimizer="adam")
        self.backwards = 0
        self.net[0].weight.register_hook(self._poison)

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        self.backwards += 1
        if self.backwards - 1 == POISONED and torch.distributed.get_rank() == 1:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad


class StepRecorder(Callback):
    """Each step's parameters and loss scale, before and after it."""

    def __init__(self) -> None:
        self.before: list[tuple[torch.Tensor, float]] = []
        self.after: list[tuple[torch.Tensor, float]] = []

    def _now(self, trainer, task) -> tuple[torch.Tensor, float]:
        flat = torch.cat([p.detach().reshape(-1).clone() for p in task.parameters()])
        return flat, trainer.precision.scaler.get_scale()

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        self.before.append(self._now(trainer, task))

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.after.append(self._now(trainer, task))


#: A representative set: exact, compressed (8-bit, low rank, 8-bit momentum), averaging, fused, served.
FP16_STRATEGIES = {
    "bucketed_ddp": BucketedDDP,
    "bytegrad": ByteGrad,
    "powersgd": lambda: PowerSGD(rank=1, start_iter=0),
    "qadam": lambda: QAdam(warmup_steps=1),  # the poisoned step is its first compressed-momentum step
    "local_sgd": lambda: LocalSGD(period=2),
    "tensor_fusion": TensorFusion,
    "parameter_server": lambda: ParameterServer(server_rank=0),  # the inf is on a worker's gradient
    "sharded_parameter_server": ShardedParameterServer,
}


def _fp16_with_an_inf_on_rank_one(rank: int, world_size: int) -> dict:
    data = regression_data(64)
    results = {}
    for name, make in FP16_STRATEGIES.items():
        torch.manual_seed(0)
        recorder = StepRecorder()
        trainer = Trainer(
            strategy=make(), precision="16-mixed", max_steps=3, callbacks=[recorder], num_sanity_val_steps=0, **quiet()
        )
        trainer.fit(PoisonedRegressor(), loader(data, 16))
        results[name] = {"before": recorder.before, "after": recorder.after}
    return results


def test_fp16_an_inf_on_one_rank_skips_the_step_on_every_rank_and_training_goes_on():
    ranks = run_distributed(_fp16_with_an_inf_on_rank_one, world_size=2, timeout=90)
    for name in FP16_STRATEGIES:
        for rank, results in enumerate(ranks):
            result, where = results[name], f"{name}, rank {rank}"
            (params_0, scale_0), (params_1, scale_1) = result["before"][POISONED], result["after"][POISONED]
            assert torch.equal(params_0, params_1), f"{where}: the poisoned step was taken"
            assert scale_1 == scale_0 / 2, f"{where}: the scale went from {scale_0} to {scale_1}"
            # The next step is taken, finite, at the same scale: nothing carried the inf into it.
            (params_2, scale_2), (params_3, scale_3) = result["before"][POISONED + 1], result["after"][POISONED + 1]
            assert not torch.equal(params_2, params_3) and torch.isfinite(params_3).all(), where
            assert scale_3 == scale_2, where
        if name != "local_sgd":  # local SGD's replicas differ between averagings
            torch.testing.assert_close(ranks[0][name]["after"][-1][0], ranks[1][name]["after"][-1][0], rtol=0, atol=0)


class DtypeProbe(Regressor):
    """Records the dtype its first layer computes in during training."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: set[torch.dtype] = set()

    def training_step(self, batch, batch_idx):
        self.seen.add(self.net[0](batch[0]).dtype)
        return super().training_step(batch, batch_idx)


def _bf16_with_every_strategy(rank: int, world_size: int) -> dict:
    data = regression_data(64)
    results = {}
    for name in sorted(set(STRATEGIES) - {"single"}):
        torch.manual_seed(0)
        task = DtypeProbe(lr=0.01, optimizer="adam")  # Adam: qadam needs it, every other strategy takes it
        start = torch.cat([p.detach().reshape(-1).clone() for p in task.parameters()])
        trainer = Trainer(strategy=name, precision="bf16-mixed", max_steps=2, num_sanity_val_steps=0, **quiet())
        trainer.fit(task, loader(data, 8))
        end = torch.cat([p.detach().reshape(-1) for p in task.parameters()])
        moved, finite = not torch.equal(start, end), bool(end.isfinite().all())
        results[name] = {"dtypes": task.seen, "moved": moved, "finite": finite}
    return results


def test_bf16_mixed_trains_with_every_registered_strategy():
    ranks = run_distributed(_bf16_with_every_strategy, world_size=2, timeout=90)
    assert set(ranks[0]) == set(STRATEGIES) - {"single"}  # single: test_training_math
    for result in ranks:
        for name, outcome in result.items():
            assert outcome == {"dtypes": {torch.bfloat16}, "moved": True, "finite": True}, name


def test_16_mixed_runs_on_the_cpu_and_is_a_clear_error_where_fp16_autocast_is_missing(monkeypatch):
    data = regression_data(16)
    trainer = Trainer(max_steps=2, precision="16-mixed", accelerator="cpu", **quiet())
    trainer.fit(Regressor(), loader(data, 8))
    assert trainer.precision.scaler is not None and trainer.state.global_step == 2
    monkeypatch.setattr(precision_module, "fp16_autocast_available", lambda device_type: False)
    with pytest.raises(ValueError, match=r"16-mixed.*needs float16 autocast on cpu.*Use precision='bf16-mixed'"):
        Trainer(max_steps=1, precision="16-mixed", accelerator="cpu", **quiet()).fit(Regressor(), loader(data, 8))
