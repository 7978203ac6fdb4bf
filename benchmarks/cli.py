"""`python -m benchmarks [command] ...`: every benchmark, report and lab job of the suite, from one entry point.

    python -m benchmarks                          # the suite (benchmarks/run.py): --quick, --report, --sections ...
    python -m benchmarks report --check docs/performance.md
    python -m benchmarks autotune --repeats 3
    python -m benchmarks lab strategies --nodes 2 4 --rates none 1gbit 100mbit
    python -m benchmarks lab cluster --nodes 4 --rate 100mbit -- -m syncline trainer.max_steps=50

Each command is a module with `add_arguments(parser)` and `command(args)`; this file only names them. Commands a
benchmark starts in a fresh interpreter (one training run, a lab node's worker) go through this entry point
too, as hidden commands of their own.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["COMMANDS", "LAB_COMMANDS", "main", "parse_args"]

#: Every command, by the name on the command line: the module that implements it.
COMMANDS: dict[str, str] = {
    "suite": ".run",
    "report": ".report",
    "plot": ".plot",
    "plot-timeline": ".plot_timeline",
    "ddp": ".ddp",
    "autotune": ".bench_autotune",
    "many-params": ".bench_many_params",
    "tensor-fusion": ".bench_tensor_fusion",
    "trainer": ".bench_trainer",
    "overhead": ".overhead",
    "checkpoint": ".bench_checkpoint",
    "nonfinite": ".bench_nonfinite",
    "preemption-flag": ".bench_preemption_flag",
    "live-recovery": ".bench_live_recovery",
    "strategies": ".strategies_example",
    "averaging": ".averaging_example",
    "gpt2": ".gpt2_study",
    "cuda-stream-check": ".cuda_stream_check",
    # Started by other commands in a fresh interpreter (`common.run_child`).
    "example-run": ".example_runs",
    "gpt2-train": ".gpt2_train",
}
#: The network lab's commands (`python -m benchmarks lab <name>`; root and iproute2).
LAB_COMMANDS: dict[str, str] = {
    "cluster": ".lab.cluster",
    "strategies": ".lab.strategies",
    "ddp": ".lab.ddp",
    "tradeoff": ".lab.tradeoff",
    "deferred-update": ".lab.deferred_update",
    "faults": ".lab.faults",
    "live-recovery": ".lab.live_recovery",
}
_HIDDEN = {"example-run", "gpt2-train"}


def _add(subparsers: argparse._SubParsersAction, name: str, module: ModuleType, hidden: bool) -> None:
    summary = (module.__doc__ or name).strip().splitlines()[0]
    parser = subparsers.add_parser(
        name,
        help=argparse.SUPPRESS if hidden else summary,
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    parser.set_defaults(command=module.command)


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of `argv`'s command (only that command's module is imported: some import torch and more)."""
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, module in COMMANDS.items():
        if wanted in (None, "-h", "--help") or wanted == name:
            _add(commands, name, importlib.import_module(module, __package__), hidden=name in _HIDDEN)
        else:
            commands.add_parser(name, help=argparse.SUPPRESS)
    lab = commands.add_parser(
        "lab", help="the network lab: strategies, ddp, tradeoff, deferred-update, faults, cluster"
    )
    lab_commands = lab.add_subparsers(title="lab commands", metavar="COMMAND", required=True)
    lab_wanted = argv[1] if wanted == "lab" and len(argv) > 1 else None
    for name, module in LAB_COMMANDS.items():
        if wanted == "lab" and lab_wanted in (None, "-h", "--help", name):
            _add(lab_commands, name, importlib.import_module(module, __package__), hidden=False)
        else:
            lab_commands.add_parser(name, help=argparse.SUPPRESS)
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
