"""The Trainer across real processes (gloo, 127.0.0.1): data sharding, metric reduction, checkpoints, launch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from syncline.callbacks import Callback
from syncline.strategies import STRATEGIES, BucketedDDP, NativeDDP
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

ROOT = Path(__file__).resolve().parents[2]


class RankLogging(Regressor):
    """Logs values that differ per rank, with and without sync_dist."""

    def training_step(self, batch, batch_idx):
        rank = float(self.global_rank)
        self.log("rank_synced", torch.tensor(rank), sync_dist=True)
        self.log("rank_local", torch.tensor(rank))
        # Batch sizes differ per rank below (4 vs 2), so the synced epoch mean is sample-weighted.
        self.log(
            "weighted", torch.tensor(rank), on_step=False, on_epoch=True, sync_dist=True, batch_size=4 - 2 * int(rank)
        )
        return super().training_step(batch, batch_idx)


def _fit_ddp(rank, world_size, strategy, tmp, ckpt_in, ckpt_out, accumulate=1):
    torch.manual_seed(0)
    task = RankLogging()
    trainer = Trainer(
        max_epochs=2, strategy=strategy, accumulate_grad_batches=accumulate, **quiet(default_root_dir=tmp)
    )
    trainer.fit(task, loader(regression_data(32), 4 // accumulate), ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    return {k: v.clone() for k, v in task.state_dict().items()}, metrics, trainer.global_step


def _single(batch_size: int, epochs: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    task = Regressor()
    Trainer(max_epochs=epochs, **quiet()).fit(task, loader(regression_data(32), batch_size))
    return task.state_dict()


@pytest.mark.parametrize(("strategy", "accumulate"), [("bucketed_ddp", 1), ("bucketed_ddp", 2), ("native_ddp", 2)])
def test_ddp_trainer_equals_single_process_on_the_global_batch_and_reduces_metrics(tmp_path, strategy, accumulate):
    """Two ranks with micro-batches of 4/k, k per step, on DistributedSampler shards equal one process
    with batch 8 (1e-5); with k=2 the first micro-batch of each window does not synchronize."""
    args = (strategy, str(tmp_path), None, None, accumulate)
    results = run_distributed(_fit_ddp, world_size=2, args=args, timeout=120)
    reference = _single(8)
    for state, _, steps in results:
        assert steps == 2 * 32 // 8
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5)
    if accumulate > 1:
        return
    (_, metrics0, _), (_, metrics1, _) = results
    assert metrics0["rank_synced"] == metrics1["rank_synced"] == 0.5
    assert (metrics0["rank_local"], metrics1["rank_local"]) == (0.0, 1.0)
    # rank 0 weighs 4 per step with value 0, rank 1 weighs 2 with value 1: (0*4 + 1*2) / 6
    assert abs(metrics0["weighted"] - 1 / 3) < 1e-6 and metrics0["weighted"] == metrics1["weighted"]


class FreezeFirstLayer(Callback):
    """Freeze the first layer after two optimizer steps, as a fine-tuning schedule does."""

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        if trainer.global_step == 2:
            task.net[0].requires_grad_(False)


class AdamWRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def _fit_freezing(rank, world_size, strategy):
    torch.manual_seed(0)
    task = AdamWRegressor()
    strategy = {"bucketed_ddp": BucketedDDP, "native_ddp": NativeDDP}[strategy](find_unused_parameters=True)
    trainer = Trainer(max_epochs=1, strategy=strategy, callbacks=[FreezeFirstLayer()], **quiet())
    trainer.fit(task, loader(regression_data(32), 4))
    return {k: v.clone() for k, v in task.state_dict().items()}


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "native_ddp"])
def test_a_layer_frozen_by_a_callback_stays_where_one_process_leaves_it_under_adamw(strategy):
    """A frozen layer must get .grad None, not a zero view that AdamW's decay keeps moving."""
    results = run_distributed(_fit_freezing, world_size=2, args=(strategy,), timeout=120)
    torch.manual_seed(0)
    task = AdamWRegressor()
    Trainer(max_epochs=1, callbacks=[FreezeFirstLayer()], **quiet()).fit(task, loader(regression_data(32), 8))
    for state in results:
        for name, value in task.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


def _shards(rank, world_size):
    trainer = Trainer(max_epochs=2, strategy="bucketed_ddp", **quiet())
    seen: dict[int, list[int]] = {0: [], 1: []}

    class Recording(Regressor):
        def training_step(self, batch, batch_idx):
            seen[self.trainer.current_epoch].extend(batch[0][:, 0].tolist())
            return super().training_step(batch, batch_idx)

    data = regression_data(24)
    trainer.fit(Recording(), DataLoader(data, batch_size=4, shuffle=True, drop_last=False))
    return seen


def test_distributed_sampler_shards_shuffles_and_reshuffles_each_epoch():
    (rank0, rank1) = run_distributed(_shards, world_size=2, timeout=120)
    everything = sorted(regression_data(24).tensors[0][:, 0].tolist())
    for epoch in (0, 1):
        assert sorted(rank0[epoch] + rank1[epoch]) == everything  # disjoint shards covering the data
    assert rank0[0] != rank0[1]  # set_epoch reshuffled
    assert rank0[0] != sorted(rank0[0])  # the loader's shuffle=True was kept


def test_checkpoint_moves_between_world_sizes(tmp_path):
    """A world-2 checkpoint resumes in one process and a one-process checkpoint resumes on two ranks."""
    two = tmp_path / "two.ckpt"
    run_distributed(_fit_ddp, world_size=2, args=("bucketed_ddp", str(tmp_path), None, str(two)), timeout=120)
    assert two.is_file()
    torch.manual_seed(5)
    task = Regressor()
    trainer = Trainer(max_epochs=3, **quiet())
    trainer.fit(task, loader(regression_data(32), 8), ckpt_path=two)
    assert trainer.global_step == 2 * 4 + 4  # two epochs on world 2 (4 steps each), then one here
    reference = _single(8, epochs=3)
    for name, value in reference.items():
        torch.testing.assert_close(task.state_dict()[name], value, rtol=1e-5, atol=1e-5)

    one = tmp_path / "one.ckpt"
    trainer.save_checkpoint(one)
    results = run_distributed(_fit_ddp, world_size=2, args=("bucketed_ddp", str(tmp_path), str(one), None), timeout=120)
    # max_epochs=2 < the checkpoint's 3 epochs: nothing more to train, the weights are the checkpoint's.
    for state, _, steps in results:
        assert steps == 12
        for name, value in task.state_dict().items():
            assert torch.equal(state[name], value)


def test_devices_2_launches_workers_and_returns_rank_zero_weights(tmp_path):
    """`Trainer(devices=2)` outside torchrun starts two processes via torch's elastic launch API."""
    script = textwrap.dedent(
        f"""
        import json, torch
        from tests.trainer._tasks import Regressor, loader, quiet, regression_data
        from syncline.trainer import Trainer
        if __name__ == "__main__":
            torch.manual_seed(0)
            task = Regressor()
            trainer = Trainer(max_epochs=2, accelerator="cpu", devices=2, **quiet(default_root_dir={str(tmp_path)!r}))
            trainer.fit(task, loader(regression_data(32), 4))
            torch.save(task.state_dict(), {str(tmp_path / "weights.pt")!r})
            print(json.dumps({{"steps": trainer.global_step, "strategy": type(trainer.strategy).__name__}}))
        """
    )
    path = tmp_path / "launch.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == {"steps": 8, "strategy": "BucketedDDP"}
    weights = torch.load(tmp_path / "weights.pt")
    for name, value in _single(8).items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5)


def _fit_with_csv(rank, world_size, tmp):
    from syncline.callbacks import CSVLogger

    torch.manual_seed(0)
    trainer = Trainer(
        max_steps=4,
        strategy="bucketed_ddp",
        log_every_n_steps=2,
        logger=CSVLogger(tmp),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Regressor(), loader(regression_data(32), 4))
    return trainer.log_dir


def test_communication_statistics_reach_the_logger_from_rank_zero_only(tmp_path):
    import csv

    log_dirs = run_distributed(_fit_with_csv, world_size=2, args=(str(tmp_path),), timeout=120)
    assert len(set(log_dirs)) == 1
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]  # rank 1 wrote nothing
    with open(Path(log_dirs[0]) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    logged = [row for row in rows if row.get("comm/collectives")]
    # Steps 2 and 4, logged as Lightning does under the step before them.
    assert [int(row["step"]) for row in logged] == [1, 3]
    # 161 float32 parameters in one bucket: one all-reduce of 644 bytes per synchronized step.
    assert {float(row["comm/collectives"]) for row in logged} == {1.0}
    assert {float(row["comm/bytes"]) for row in logged} == {644.0}


def test_torchrun_starts_the_workers(tmp_path):
    """Under torchrun the strategy takes rank and world size from the environment; nothing is relaunched."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch
            from tests.trainer._tasks import Regressor, loader, quiet, regression_data
            from syncline.trainer import Trainer
            torch.manual_seed(0)
            task = Regressor()
            trainer = Trainer(max_epochs=2, accelerator="cpu", **quiet())
            trainer.fit(task, loader(regression_data(32), 4))
            print(f"rank={trainer.global_rank} world={trainer.world_size} steps={trainer.global_step}", flush=True)
            if trainer.global_rank == 0:
                torch.save(task.state_dict(), os.environ["OUT"])
            # Every multi-process strategy in the same torchrun job, under accumulation and clipping, on a
            # model with a layer no step uses (find_unused_parameters).
            from syncline.strategies import STRATEGIES
            for name, cls in STRATEGIES.items():
                if not cls.multi_process:
                    continue
                torch.manual_seed(0)
                task = Regressor(optimizer="adam", lr=0.05)
                task.unused = torch.nn.Linear(2, 2)
                options = dict(accumulate_grad_batches=2, gradient_clip_val=1.0)
                strategy = cls(find_unused_parameters=True)
                trainer = Trainer(max_steps=4, strategy=strategy, accelerator="cpu", **options, **quiet())
                trainer.fit(task, loader(regression_data(64), 4))
                sent = trainer.strategy.communication_stats()["comm/total_bytes"] > 0
                print(f"rank={trainer.global_rank} {name} steps={trainer.global_step} sent={sent}", flush=True)
            """
        )
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "weights.pt"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    # Both ranks write to one pipe: their lines may interleave, so find them anywhere in the output.
    assert sorted(re.findall(r"rank=\d world=\d steps=\d+", done.stdout)) == [
        "rank=0 world=2 steps=8",
        "rank=1 world=2 steps=8",
    ]
    names = [name for name, cls in STRATEGIES.items() if cls.multi_process]
    assert len(names) >= 8
    for name in names:
        # The asynchronous averager's first round comes after 100 ms, later than 4 steps of this model; DiLoCo's
        # first outer exchange after `period` (100) inner steps.
        sent = "" if name in ("async_model_average", "diloco") else " sent=True"
        for rank in range(2):
            assert f"rank={rank} {name} steps=4{sent}" in done.stdout, (name, done.stderr[-3000:])
    weights = torch.load(tmp_path / "weights.pt")
    for name, value in _single(8).items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5)
