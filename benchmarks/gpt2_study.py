"""The GPT-2 data-parallel study at CPU scale: `python -m benchmarks --sections gpt2`.

The third founding paper trains GPT-2 data-parallel on one node in several ways -- one device, one
parameter server, a distributed (sharded) parameter server, Horovod, and the last two with mixed
precision -- and concludes that the distributed parameter server with mixed precision is fastest on one
node and that Horovod with mixed precision is the most robust. This section runs the same comparison with
syncline's strategies on a GPT-2-style CharGPT (`examples/char_gpt.py`), world size 2, gloo, one thread
per process:

| config | strategy | processes | precision |
| --- | --- | --- | --- |
| single | `single` | 1, the whole global batch | fp32 |
| parameter_server | `parameter_server` | 2 | fp32 |
| sharded_ps | `sharded_parameter_server` | 2 | fp32 |
| tensor_fusion | `tensor_fusion` (Horovod's design) | 2 | fp32 |
| sharded_ps bf16 | `sharded_parameter_server` | 2 | bf16-mixed |
| tensor_fusion bf16 | `tensor_fusion` | 2 | bf16-mixed |
| bucketed_ddp | `bucketed_ddp` (today's reference) | 2 | fp32 |
| native_ddp | `native_ddp` (torch's C++ DDP) | 2 | fp32 |

Each run is a fresh process (`benchmarks/gpt2_train.py`) that trains the same global batch for the same
steps, validating every `val_every` steps on a fixed subset; repeats are interleaved, the order rotated
by one per repeat. Per config: samples per second (the global batch over the median step, the first
`warmup` steps and the validations left out; also over the 25th-percentile step, the steps that
other jobs on a shared machine disturbed least), each rank's peak bytes of parameters, gradients and
optimizer state and its peak RSS, bytes per step (`comm/bytes`, rank 0), and the steps and training
seconds until the validation loss first reaches `target_loss`. The sharded server's optimizer state
per rank is checked against the full state (the single process's): it must be at most 0.6x.

    python -m benchmarks --sections gpt2             # about 30 minutes on 2 cores -> results/gpt2_study.json
    python -m benchmarks gpt2 --write docs/performance.md   # its table into the page
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .common import ROOT, fill_marked_block, run_child
from .plans import Plan

__all__ = ["CONFIGS", "fill_page", "gpt2_table", "run_gpt2_study", "summarize"]

#: label -> (strategy, processes, precision).
CONFIGS: dict[str, tuple[str, int, str]] = {
    "single": ("single", 1, "32"),
    "parameter_server": ("parameter_server", 2, "32"),
    "sharded_ps": ("sharded_parameter_server", 2, "32"),
    "tensor_fusion": ("tensor_fusion", 2, "32"),
    "sharded_ps bf16": ("sharded_parameter_server", 2, "bf16-mixed"),
    "tensor_fusion bf16": ("tensor_fusion", 2, "bf16-mixed"),
    "bucketed_ddp": ("bucketed_ddp", 2, "32"),
    "native_ddp": ("native_ddp", 2, "32"),
}
#: The sharded server's optimizer state on every rank must be at most this fraction of the full state.
SHARDED_STATE_LIMIT = 0.6
RESULTS = ROOT / "benchmarks" / "results" / "gpt2_study.json"
MARKER = "gpt2-study"


def run_gpt2_study(plan: Plan, log: Any = print) -> dict[str, Any]:
    """Train every config of `plan` (its `labels`; all where none are given), repeats interleaved; return the runs
    and their summary (the plan's fields it reads: `benchmarks/plans.py`)."""
    order = list(plan.labels or CONFIGS)
    unknown = [c for c in order if c not in CONFIGS]
    if unknown:
        raise ValueError(f"Unknown GPT-2 study config(s) {unknown}; valid: {', '.join(CONFIGS)}.")
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in order}
    for repeat in range(plan.repeats):
        shift = repeat % len(order)
        for label in order[shift:] + order[:shift]:
            log(f"gpt2: {label} (repeat {repeat + 1})")
            runs[label].append(run_child("gpt2-train", ["--config", json.dumps(_config(plan, label))], plan.timeout_s))
    return {
        "plan": asdict(plan),
        "configs": {label: list(CONFIGS[label]) for label in order},
        **summarize(plan, runs),
    }


def _config(plan: Plan, label: str) -> dict[str, Any]:
    strategy, devices, precision = CONFIGS[label]
    return {
        "strategy": strategy,
        "devices": devices,
        "precision": precision,
        "global_batch": plan.batch,
        "steps": plan.steps,
        "val_every": plan.val_every,
        "val_batches": plan.val_batches,
        # One thread per process, as every rank has: a second OpenMP thread on a shared core only waits.
        "threads": 1,
        "timeout": plan.timeout_s,
        "model": plan.model,
    }


# ------------------------------------------------------------------ summary
def summarize(plan: Plan, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over repeats per config, the time to the target loss, and the sharded-state check."""
    results = {label: _summarize_config(plan, items) for label, items in runs.items()}
    return {"results": results, "sharded_state_check": _sharded_check(results), "runs": runs}


def _summarize_config(plan: Plan, items: list[dict[str, Any]]) -> dict[str, Any]:
    # The first `warmup` steps are left out: first allocations, torch's bucket rebuild, warm caches.
    steady = [r["step_s"][plan.warmup :] for r in items]
    per_repeat = [plan.batch / statistics.median(steps) for steps in steady]
    # The fastest quarter of the steps: those that other jobs on a shared machine disturbed least.
    fast = [plan.batch / _quartile(steps) for steps in steady]
    curve = [[v["step"], v["val_loss"]] for v in items[0]["validations"]]
    reached = [_first_reaching(r["validations"], plan.target_loss) for r in items]
    first = items[0]
    return {
        "processes": first["config"]["devices"],
        "precision": first["config"]["precision"],
        "parameters": first["parameters"],
        "samples_per_s": _spread(per_repeat, 2),
        "samples_per_s_fast_quartile": _spread(fast, 2),
        "step_ms_median": round(statistics.median(1e3 * plan.batch / x for x in per_repeat), 1),
        # Tensor bytes do not vary between repeats; RSS may, and its largest is kept.
        "memory_per_rank": [
            {**rank, "peak_rss_bytes": max(r["memory_per_rank"][i]["peak_rss_bytes"] for r in items)}
            for i, rank in enumerate(first["memory_per_rank"])
        ],
        "comm_bytes_per_step": first["comm_bytes_per_step"],
        "val_curve": curve,
        "final_val_loss": curve[-1][1],
        "target_loss": plan.target_loss,
        "steps_to_target": reached[0],
        "train_s_to_target": (
            _spread([r["train_s_at_step"][s - 1] for r, s in zip(items, reached)], 3)
            if all(s is not None for s in reached)
            else None
        ),
    }


def _quartile(values: list[float]) -> float:
    """The 25th percentile of `values` (the value itself for one)."""
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


def _first_reaching(validations: list[dict[str, Any]], target: float) -> int | None:
    return next((v["step"] for v in validations if v["val_loss"] <= target), None)


def _spread(values: list[float], digits: int) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "all": [round(v, digits) for v in values],
    }


def _sharded_check(results: dict[str, Any]) -> dict[str, Any] | None:
    """Each sharded config's optimizer state per rank over the full state (the single process's)."""
    if "single" not in results:
        return None
    full = results["single"]["memory_per_rank"][0]["optimizer_state"]
    check: dict[str, Any] = {"full_optimizer_state_bytes": full, "limit": SHARDED_STATE_LIMIT, "configs": {}}
    for label, result in results.items():
        if CONFIGS[label][0] != "sharded_parameter_server":
            continue
        ratios = [round(rank["optimizer_state"] / full, 4) for rank in result["memory_per_rank"]]
        check["configs"][label] = {"per_rank": ratios, "passed": max(ratios) <= SHARDED_STATE_LIMIT}
    check["passed"] = all(c["passed"] for c in check["configs"].values())
    return check


# -------------------------------------------------------------------- table
def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def gpt2_table(section: dict[str, Any]) -> str:
    """The study's table: one row per config, medians over repeats, memory per rank as `rank 0 / rank 1`."""
    results = section["results"]
    single = results.get("single")
    header = [
        "config",
        "processes",
        "precision",
        "samples/s (min-max)",
        "/ single",
        "samples/s, fastest quartile of steps",
        "/ single",
        "params + grads + optimizer MiB per rank",
        "optimizer state MiB per rank",
        "peak RSS MiB per rank",
        "bytes/step (rank 0)",
        f"steps to val {section['plan']['target_loss']}",
        "train s to it (min-max)",
        "final val loss",
    ]
    rows = []
    for label, r in results.items():
        s, ranks, t = r["samples_per_s"], r["memory_per_rank"], r["train_s_to_target"]
        fast = r["samples_per_s_fast_quartile"]["median"]
        rows.append(
            [
                label,
                r["processes"],
                r["precision"],
                f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})",
                f"{s['median'] / single['samples_per_s']['median']:.2f}" if single else "",
                f"{fast:.1f}",
                f"{fast / single['samples_per_s_fast_quartile']['median']:.2f}" if single else "",
                " / ".join(_mib(m["total"]) for m in ranks),
                " / ".join(_mib(m["optimizer_state"]) for m in ranks),
                " / ".join(f"{m['peak_rss_bytes'] / 2**20:.0f}" for m in ranks),
                f"{r['comm_bytes_per_step']:,.0f}",
                r["steps_to_target"] if r["steps_to_target"] is not None else "not reached",
                f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f})" if t else "-",
                f"{r['final_val_loss']:.4f}",
            ]
        )
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fill_page(page: str, suite: dict[str, Any]) -> str:
    """Return `page` with its `<!-- gpt2-study -->` block replaced by the table of `suite` (a suite run's JSON).

    Raises:
        ValueError: the page has no such block, or the run has no `gpt2` section.
    """
    if "gpt2" not in suite["sections"]:
        raise ValueError("the run has no `gpt2` section: run `python -m benchmarks --sections gpt2`")
    return fill_marked_block(page, MARKER, gpt2_table(suite["sections"]["gpt2"]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--write", type=Path, metavar="PAGE", help="fill PAGE's <!-- gpt2-study --> block")


def command(args: argparse.Namespace) -> None:
    """Run the command."""
    suite = json.loads(args.results.read_text())
    if args.write is None:
        print(gpt2_table(suite["sections"]["gpt2"]))
        return
    try:
        args.write.write_text(fill_page(args.write.read_text(), suite))
    except ValueError as error:
        sys.exit(f"{args.write}: {error}")
    print(f"{args.write}: filled the GPT-2 study's table from {args.results}")
