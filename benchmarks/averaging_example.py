"""The averaging family on the default example: CharGPT, 2 processes, the same shortened run for each.

    python -m benchmarks averaging --out benchmarks/results/averaging.json   # all runs, the committed figures
    python -m benchmarks averaging --steps 150 --repeats 3

Each run is a fresh process (`run_child`) that trains `examples/char_gpt.py`'s CharGPT for `--steps`
optimizer steps on 2 processes (the Trainer launches them; one thread each), validates on 20 batches and
reports rank 0's final validation loss (the mean over the ranks' replicas: `val_loss` is logged with
`sync_dist`), its bytes handed to collectives per optimizer step and the epoch's time.

Two parts:

- quality: `bucketed_ddp` and each averaging strategy (loss within 10% of bucketed_ddp's is the bar);
- speed: `local_sgd` against torch's own post-local SGD (`NativeDDP` with `post_localSGD_hook` and a
  `PeriodicModelAverager`, as torch's docs set it up) with the same period and warm-up, interleaved
  over `--repeats`, medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from syncline.callbacks import Callback
from syncline.strategies.native_ddp import NativeDDP

from .common import QUIET_TRAINER, add_out_argument, machine, run_child, write_json
from .example_runs import BatchRecorder

WARMUP = 25
PERIOD = 4

#: name -> (registered strategy, its options)
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "bucketed_ddp": ("bucketed_ddp", {}),
    "local_sgd": ("local_sgd", {"period": PERIOD, "warmup_steps": WARMUP}),
    "decentralized": ("decentralized", {"peers": "shift_one", "period": 1}),
    "decentralized_uint8": ("decentralized", {"peers": "all", "period": 1, "compression": "uint8"}),
    "async_model_average": ("async_model_average", {"interval_ms": 50, "warmup_steps": WARMUP}),
    "torch_post_local_sgd": ("torch_post_local_sgd", {"period": PERIOD, "warmup_steps": WARMUP}),
}


class TorchPostLocalSGD(NativeDDP):
    """torch's post-local SGD: DDP whose hook stops all-reducing after `warmup_steps`, plus its averager.

    As torch's documentation sets it up (`post_localSGD_hook`, `PeriodicModelAverager`), without the
    intra-node gradient all-reduce after the warm-up, so that it is the same algorithm as `LocalSGD`.
    """

    name = "torch_post_local_sgd"

    def __init__(self, period: int, warmup_steps: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.period, self.warmup_steps = period, warmup_steps

    def setup(self, task: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as hooks
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        super().setup(task)
        state = hooks.PostLocalSGDState(
            process_group=None,
            subgroup=None,
            start_localSGD_iter=self.warmup_steps,
            post_local_gradient_allreduce=False,
        )
        self.ddp.register_comm_hook(state, hooks.post_localSGD_hook)
        self.averager = PeriodicModelAverager(period=self.period, warmup_steps=self.warmup_steps)
        self.params = [p for p in task.parameters() if p.requires_grad]

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        step()
        self.averager.average_parameters(self.params)


class BytesRecorder(Callback):
    """Sum, on rank 0, the strategy's `comm/bytes` of every optimizer step."""

    reads_parameters = False  # times and counts only: a step in flight stays in flight

    def __init__(self) -> None:
        self.bytes: list[float] = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        # Once per optimizer step (global_step moved), right after it.
        if trainer.global_step != len(self.bytes):
            self.bytes.append(trainer.strategy.communication_stats().get("comm/bytes", 0.0))

    def state_dict(self):
        return {"bytes": self.bytes}

    def load_state_dict(self, state_dict):
        self.bytes = state_dict["bytes"]


def _train(config: dict[str, Any]) -> dict[str, Any]:
    """Train CharGPT with `config`'s strategy for its steps on 2 processes; return loss, bytes, time."""
    from syncline.examples.char_gpt import CharGPT
    from syncline.strategies import STRATEGIES
    from syncline.trainer import Trainer
    from syncline.trainer.seed import seed_everything

    registered, options = RUNS[config["name"]]
    cls = TorchPostLocalSGD if registered == "torch_post_local_sgd" else STRATEGIES[registered]
    strategy = cls(backend="gloo", **options)
    seed_everything(0)
    task = CharGPT(sample_chars=0)
    steps, recorder = BatchRecorder(), BytesRecorder()
    trainer = Trainer(
        max_steps=config["steps"],
        max_epochs=1,
        limit_val_batches=20,
        val_check_interval=1.0,
        strategy=strategy,
        devices=2,
        callbacks=[steps, recorder],
        **QUIET_TRAINER,
        seed=0,
    )
    start = time.perf_counter()
    trainer.fit(task)
    per_step = recorder.bytes
    model_bytes = sum(p.numel() * p.element_size() for p in task.parameters())
    if registered == "torch_post_local_sgd":
        # torch's averager has no counter: its all-reduces are the algorithm's (warm-up gradients, then
        # one flat parameter all-reduce after steps warmup+1, warmup+1+period, ...).
        averagings = len(range(WARMUP, config["steps"], PERIOD))
        per_step = [model_bytes] * WARMUP + [averagings * model_bytes / (config["steps"] - WARMUP)] * (
            config["steps"] - WARMUP
        )
    return {
        "name": config["name"],
        "fit_s": round(time.perf_counter() - start, 3),
        # Steady training time: from the end of the first micro-batch to the last (one-time costs out).
        "train_s": round(steps.ends[-1] - steps.ends[0], 3),
        "val_loss": round(float(trainer.callback_metrics["val_loss"]), 4),
        "bytes_per_step": round(sum(per_step) / len(per_step)),
        "total_bytes": round(sum(per_step)),
        "model_bytes": model_bytes,
    }


def run(name: str, steps: int) -> dict[str, Any]:
    """Run one configuration in a fresh process."""
    return run_child("averaging", ["--one", json.dumps({"name": name, "steps": steps})], 900)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the speed comparison")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    add_out_argument(parser, "averaging.json")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    if args.one:
        args.out.write_text(json.dumps(_train(json.loads(args.one))))
        return
    started = time.time()
    quality = {}
    for name in RUNS:
        if name != "torch_post_local_sgd":
            quality[name] = run(name, args.steps)
            print(json.dumps(quality[name]), flush=True)
    reference = quality["bucketed_ddp"]
    for result in quality.values():
        result["val_loss_vs_ddp"] = round(result["val_loss"] / reference["val_loss"], 3)
        result["bytes_vs_ddp"] = round(result["total_bytes"] / reference["total_bytes"], 3)
    speed: dict[str, list[dict[str, Any]]] = {"local_sgd": [], "torch_post_local_sgd": []}
    for _ in range(args.repeats):
        for name in speed:
            speed[name].append(run(name, args.steps))
            print(json.dumps(speed[name][-1]), flush=True)
    medians = {name: statistics.median(r["train_s"] for r in runs) for name, runs in speed.items()}
    report = {
        "command": f"python -m benchmarks averaging --steps {args.steps} --repeats {args.repeats}",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": machine(),
        "steps": args.steps,
        "quality": quality,
        "speed": {
            "runs": speed,
            "train_s_median": medians,
            "local_sgd_over_torch": round(medians["local_sgd"] / medians["torch_post_local_sgd"], 3),
        },
        "wall_s": round(time.time() - started, 1),
    }
    if args.out is not None:
        write_json(args.out, report)
    print(json.dumps({"quality": quality, "speed": report["speed"]["train_s_median"]}, indent=1))
