"""ByteGrad: the 8-bit scatter-reduce averages within quantization error; error feedback per rank."""

from __future__ import annotations

import torch
from torch import nn

from syncline.strategies import ByteGrad
from syncline.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))  # 174 values: uneven chunks on 3 ranks


def _one_step(rank: int, world_size: int) -> dict:
    model = _model()
    strategy = ByteGrad(bucket_cap_mb=0.0005)  # several buckets
    strategy.setup_environment()
    strategy.setup(model)
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(rank))
    loss = model(x).pow(2).mean()
    local = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    strategy.backward(loss, sync=True)
    return {
        "local": [g.clone() for g in local],
        "averaged": [p.grad.clone() for p in model.parameters()],
        "memory": strategy.state_dict()["error_feedback"],
        "buckets": len(strategy.reducer.buckets),
    }


def test_average_is_within_quantization_error_and_the_same_on_every_rank():
    results = run_distributed(_one_step, world_size=3, timeout=60)
    assert results[0]["buckets"] > 1
    exact = [torch.stack(grads).mean(0) for grads in zip(*(r["local"] for r in results))]
    spread = max(float(g.max() - g.min()) for r in results for g in r["local"])
    for result in results:
        for got, want, other in zip(result["averaged"], exact, results[0]["averaged"]):
            assert torch.equal(got, other)  # identical replicas
            # Half a step when each rank quantizes, half a step when the average is re-quantized.
            torch.testing.assert_close(got, want, atol=spread / 255, rtol=0)
            assert not torch.equal(got, want)  # it really was quantized
    # Error feedback keeps, per rank and parameter, what the first quantization dropped.
    assert set(results[0]["memory"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert not torch.equal(results[0]["memory"]["0.weight"], results[1]["memory"]["0.weight"])


def _train(comm_thread: bool) -> dict:
    from syncline.callbacks import Callback
    from syncline.trainer import Trainer
    from tests.trainer._tasks import Regressor, loader, quiet, regression_data

    class SawThread(Callback):
        seen = False

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
            SawThread.seen = trainer.strategy.comm_state.comm_thread is not None

    torch.manual_seed(0)
    task = Regressor(optimizer="adam", lr=0.02)
    # 0.0003 MiB buckets: the MLP's 161 gradients in three buckets.
    strategy = ByteGrad(bucket_cap_mb=0.0003, comm_thread=comm_thread)
    trainer = Trainer(
        max_steps=8, strategy=strategy, accumulate_grad_batches=2, callbacks=[SawThread()], **quiet(seed=0)
    )
    trainer.fit(task, loader(regression_data(64), batch_size=4, shuffle=True))
    return {
        "weights": {k: v.clone() for k, v in task.state_dict().items()},
        "memory": strategy.state_dict()["error_feedback"],
        "bytes": strategy.communication_stats(),
        "thread": SawThread.seen,
    }


def _blocking_and_threaded(rank: int, world_size: int) -> dict:
    return {"blocking": _train(False), "threaded": _train(True)}


def test_the_communication_thread_gives_the_blocking_hooks_result_to_the_bit():
    for rank, runs in enumerate(run_distributed(_blocking_and_threaded, world_size=2, timeout=120)):
        blocking, threaded = runs["blocking"], runs["threaded"]
        assert threaded["thread"] and not blocking["thread"]
        for key, value in blocking["weights"].items():
            assert torch.equal(threaded["weights"][key], value), (rank, key)
        for key, value in blocking["memory"].items():
            assert torch.equal(threaded["memory"][key], value), (rank, key)
        assert threaded["bytes"] == blocking["bytes"], rank
