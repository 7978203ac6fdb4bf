"""`python -m syncline.lab COMMAND ...`: the network lab's commands, from one entry point.

    python -m syncline.lab cluster --nodes 4 --rate 100mbit -- -m syncline trainer.max_steps=50
    python -m syncline.lab strategies --nodes 2 4 --rates none 1gbit 100mbit
    python -m syncline.lab tradeoff --nodes 2 --rates 100mbit --only bucketed_ddp powersgd
    python -m syncline.lab faults --strategies bucketed_ddp
    python -m syncline.lab live-recovery --nodes 2 4 --rates 1gbit 100mbit

Each command is a module with `add_arguments(parser)` and `command(args)`; this file only names them. A command's
workers on the lab's nodes, and the lab inside its namespaces, go through this entry point too (hidden options).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

__all__ = ["COMMANDS", "add_command", "add_commands", "main"]

#: Every command, by the name on the command line: the module that implements it.
COMMANDS: dict[str, str] = {
    "cluster": "syncline.lab.cluster",
    "strategies": "syncline.lab.strategies",
    "tradeoff": "syncline.lab.tradeoff",
    "faults": "syncline.lab.faults",
    "live-recovery": "syncline.lab.live_recovery",
}


def add_command(
    subparsers: argparse._SubParsersAction, name: str, module: ModuleType, hidden: bool = False, lab: bool = False
) -> None:
    """Add `module`'s command as `name`: its docstring's first line the help, the whole docstring the description.
    A `lab` command stopped by Ctrl-C (or a signal the lab turns into it) says so in one line and exits 130."""
    summary = (module.__doc__ or name).strip().splitlines()[0]
    parser = subparsers.add_parser(
        name,
        help=argparse.SUPPRESS if hidden else summary,
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    parser.set_defaults(command=functools.partial(_stopping, name, module.command) if lab else module.command)


#: The options that run a part of a lab command in a process of its own (`--inside-lab`, `--train`, `--worker`).
_INNER_ROLES = ("inside_lab", "train", "worker")


def _stopping(name: str, command: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int | None:
    """Run lab command `command`; a stop is one line and status 130, not a traceback."""
    try:
        return command(args)
    except KeyboardInterrupt as stop:
        if any(getattr(args, role, None) is not None for role in _INNER_ROLES):
            return 130  # a part of the command (the lab inside its namespaces, a node's job): the command says it
        # The lab has ended every node's processes (`run_lab`), and its namespaces went with it; what a command
        # writes after each cell or run is on disk.
        reason = str(stop) or "stopped by Ctrl-C"
        print(f"lab {name}: {reason}; every node's processes have ended.", file=sys.stderr, flush=True)
        return 130


def add_commands(
    subparsers: argparse._SubParsersAction,
    commands: Mapping[str, str],
    wanted: str | None,
    hidden: Sequence[str] = (),
    lab: bool = False,
) -> None:
    """Add every command of `commands` (name: module); only the `wanted` one's module is imported (all for help).
    `lab`: they are the lab's (see `add_command`)."""
    for name, module in commands.items():
        if wanted in (None, "-h", "--help") or wanted == name:
            add_command(subparsers, name, importlib.import_module(module), hidden=name in hidden, lab=lab)
        else:
            subparsers.add_parser(name, help=argparse.SUPPRESS)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the lab command `argv` (the process's arguments by default) names; return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m syncline.lab", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    add_commands(commands, COMMANDS, argv[0] if argv else None, lab=True)
    args = parser.parse_args(argv)
    return int(args.command(args) or 0)
