"""`python -m benchmarks [command] ...`: every benchmark, report and lab job of the suite, from one entry point.

    python -m benchmarks                          # the suite (benchmarks/run.py): --quick, --report, --sections ...
    python -m benchmarks report --check docs/performance.md
    python -m benchmarks autotune --repeats 3
    python -m benchmarks lab ddp --rates 1gbit 100mbit --workload bert
    python -m benchmarks lab cluster ...          # the installed lab's commands: python -m syncline.lab cluster ...

The paper's experiments are not installed: run them from the checkout's root. Each command is a module with
`add_arguments(parser)` and `command(args)`; this file only names them. Commands a benchmark starts in a fresh
interpreter (one training run, a paper experiment's worker on a lab node) go through this entry point too, as
hidden commands of their own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from syncline.lab.cli import COMMANDS as LAB
from syncline.lab.cli import add_commands

__all__ = ["COMMANDS", "LAB_COMMANDS", "main", "parse_args"]

#: Every command, by the name on the command line: the module that implements it.
COMMANDS: dict[str, str] = {
    "suite": "benchmarks.run",
    "report": "benchmarks.report",
    "plot": "benchmarks.plot",
    "plot-timeline": "benchmarks.plot_timeline",
    "ddp": "benchmarks.ddp",
    "autotune": "benchmarks.bench_autotune",
    "many-params": "benchmarks.bench_many_params",
    "tensor-fusion": "benchmarks.bench_tensor_fusion",
    "trainer": "benchmarks.bench_trainer",
    "overhead": "benchmarks.overhead",
    "checkpoint": "benchmarks.bench_checkpoint",
    "nonfinite": "benchmarks.bench_nonfinite",
    "preemption-flag": "benchmarks.bench_preemption_flag",
    "live-recovery": "benchmarks.bench_live_recovery",
    "strategies": "benchmarks.strategies_example",
    "averaging": "benchmarks.averaging_example",
    "gpt2": "benchmarks.gpt2_study",
    "cuda-stream-check": "benchmarks.cuda_stream_check",
    # Started by other commands in a fresh interpreter (`common.run_child`).
    "example-run": "benchmarks.example_runs",
    "gpt2-train": "benchmarks.gpt2_train",
}
#: `python -m benchmarks lab <name>` (root and iproute2): the installed lab's commands (`python -m syncline.lab`),
#: and the DDP paper's experiments on the lab's clusters, which are not installed.
LAB_COMMANDS: dict[str, str] = {
    **LAB,
    "ddp": "benchmarks.lab_ddp",
    "deferred-update": "benchmarks.lab_deferred_update",
}
_HIDDEN = ("example-run", "gpt2-train")


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of `argv`'s command (only that command's module is imported: some import torch and more)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    wanted = argv[0] if argv else None
    add_commands(commands, COMMANDS, wanted, hidden=_HIDDEN)
    lab = commands.add_parser("lab", help=f"the network lab: {', '.join(LAB_COMMANDS)}")
    lab_commands = lab.add_subparsers(title="lab commands", metavar="COMMAND", required=True)
    lab_wanted = argv[1] if len(argv) > 1 else "-h"
    add_commands(lab_commands, LAB_COMMANDS, lab_wanted if wanted == "lab" else "", lab=True)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line of `python -m benchmarks` (no command, or one starting with an option, is the suite)."""
    argv = list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["suite", *argv]
    return _parser(argv).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` (the process's arguments by default) names; return its exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    status = args.command(args)
    return int(status or 0)
