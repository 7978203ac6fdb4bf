"""The compression family on the default example: `python -m syncline strategy=<name> trainer.devices=2`.

Each strategy trains CharGPT (the default run's task and settings) through the real CLI, in a fresh
process, for the same shortened epoch (`trainer.limit_train_batches=STEPS`) and validates once at its end.
The run's TensorBoard events give the final `val_loss`, the last logged `comm/bytes` (bytes this rank
handed to collectives for one optimizer step) and `comm/total_bytes`, and, from the wall times of the
logged training steps, the steady time per step. Strategies run one after another in each repeat
(interleaved, so that load from other processes on the machine spreads over all of them); the JSON
keeps every repeat and the medians, and the table gives ratios to `bucketed_ddp`.

    python -m benchmarks strategies                      # 150 steps, 1 repeat, all strategies
    python -m benchmarks strategies --steps 150 --repeats 3 --strategies bucketed_ddp bytegrad
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import ROOT, add_out_argument, run_process, write_json

__all__ = ["STRATEGIES", "run_strategy", "table"]

#: The runs compared: a name for the table and the CLI overrides that select the strategy.
STRATEGIES: dict[str, list[str]] = {
    "bucketed_ddp": ["strategy=bucketed_ddp"],
    "bucketed_ddp (bf16 hook)": ["strategy=bucketed_ddp", "strategy.comm_hook=bf16"],
    "bytegrad": ["strategy=bytegrad"],
    "powersgd": ["strategy=powersgd"],
    "qadam": ["strategy=qadam"],
    "parameter_server": ["strategy=parameter_server"],
    "sharded_parameter_server": ["strategy=sharded_parameter_server"],
}


def run_strategy(overrides: list[str], steps: int, timeout: float) -> dict[str, Any]:
    """Train CharGPT with `overrides` on two processes through the CLI; return what its events say."""
    with tempfile.TemporaryDirectory(prefix="syncline-strategies-") as run_dir:
        command = [
            sys.executable,
            "-m",
            "syncline",
            *overrides,
            "trainer.devices=2",
            f"trainer.limit_train_batches={steps}",
            "trainer.val_check_interval=1.0",
            f"hydra.run.dir={run_dir}",
        ]
        start = time.perf_counter()
        run_process(command, timeout, cwd=ROOT)  # a timeout ends the launcher's ranks with it
        process_s = time.perf_counter() - start
        scalars = _scalars(Path(run_dir))
    train = scalars["train_loss"]
    step_ms = (train[-1][0] - train[0][0]) / (train[-1][1] - train[0][1]) * 1e3
    return {
        "val_loss": scalars["val_loss"][-1][2],
        "comm_bytes_per_step": scalars["comm/bytes"][-1][2],
        "comm_total_bytes": scalars["comm/total_bytes"][-1][2],
        "step_ms": round(step_ms, 2),
        "process_s": round(process_s, 2),
    }


def _scalars(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar of the run's TensorBoard events as (wall time, step, value), by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(run_dir.glob("lightning_logs/version_*"))))
    events.Reload()
    return {tag: [(e.wall_time, e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def table(results: dict[str, Any]) -> str:
    """The markdown table of medians, with ratios to bucketed_ddp."""
    base = results["bucketed_ddp"]["median"]
    lines = [
        "| strategy | val_loss | vs bucketed_ddp | bytes/step (last) | ratio | total bytes | ratio | ms/step | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        m = result["median"]
        lines.append(
            f"| {name} | {m['val_loss']:.3f} | {m['val_loss'] / base['val_loss'] - 1:+.1%} "
            f"| {m['comm_bytes_per_step']:,.0f} | {m['comm_bytes_per_step'] / base['comm_bytes_per_step']:.3f}x "
            f"| {m['comm_total_bytes']:,.0f} | {m['comm_total_bytes'] / base['comm_total_bytes']:.3f}x "
            f"| {m['step_ms']:.0f} | {m['step_ms'] / base['step_ms']:.2f}x |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    add_out_argument(parser, "strategies_example.json")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.strategies}
    for repeat in range(args.repeats):
        for name in args.strategies:
            runs[name].append(run_strategy(STRATEGIES[name], args.steps, args.timeout))
            print(f"repeat {repeat} {name}: {runs[name][-1]}", flush=True)
    results = {
        name: {"runs": done, "median": {key: statistics.median(r[key] for r in done) for key in done[0]}}
        for name, done in runs.items()
    }
    if args.out is not None:
        write_json(args.out, {"steps": args.steps, "repeats": args.repeats, "results": results})
    print(table(results))
