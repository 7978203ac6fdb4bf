"""Start `devices` local workers with torch's elastic agent, bring rank 0's result back, report a failure briefly.

`Trainer(devices=N)` outside `torchrun` calls `launch`, which runs torch's `elastic_launch` (the agent
behind torchrun) in this process. The agent starts N workers with the "spawn" method (each imports the
script that started it, to find the task's class), sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, watches them, stops every worker when one fails and, with `Trainer(max_restarts=k)`,
restarts the group up to k times. The rendezvous is `LoopbackRendezvous`: its store listens on 127.0.0.1
only and every worker joins it as a client. Rank 0 sends back the trained weights, the progress, the
metrics and the callbacks' state, which are loaded into the caller's objects, so that after `fit`
returns the caller holds what rank 0 trained, as with a single process.

A worker that raises writes its exception and traceback to the error file the agent gave it (elastic's
format); the agent's own multi-line logs are silenced during the launch, and the first failure is raised
once, as a `WorkerFailedError` naming the rank. Under `torchrun` nothing is launched: the environment
already describes the process group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from syncline.strategies.comm import worker_guard
from syncline.trainer import launch_reaper
from syncline.trainer.loopback_rendezvous import LOOPBACK_BACKEND, register

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["WorkerFailedError", "free_port", "launch", "launched_by_torchrun", "use_loopback_for_gloo"]

#: Exit status of a worker that found the launch being re-entered while it imported the user's script.
_UNGUARDED_EXIT = 87
#: Seconds the other workers get to stop after one failed, before the agent kills them.
_STOP_GRACE_S = 10
#: Loggers whose records a launch silences: the agent's, the rendezvous's and the worker processes'.
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")

register()


class WorkerFailedError(RuntimeError):
    """A worker process failed; the message carries its rank, its exception and its traceback."""


def launched_by_torchrun() -> bool:
    """Whether this process is a worker started by torchrun or by `launch`."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(trainer: Trainer, stage: str, task: Task, kwargs: dict[str, Any]) -> Any:
    """Run `getattr(trainer, stage)(task, **kwargs)` in `trainer.devices` processes; return rank 0's result.

    Raises:
        WorkerFailedError: a worker raised or died (after `trainer.max_restarts` restarts); names the
            rank, its error and its traceback.
        TrainingPreempted: the workers stopped on a preemption signal and saved a checkpoint.
    """
    from syncline.rng import capture_rng
    from syncline.trainer.preemption import TrainingPreempted

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # We are a worker importing the user's script, and the script launches workers at import time
        # (no `if __name__ == "__main__":`). Stop quietly; the launching process explains.
        sys.exit(_UNGUARDED_EXIT)
    nprocs = trainer.devices
    # Before any process starts: an option that cannot work on this many processes is one clear error.
    trainer.strategy.check_world_size(nprocs)
    timeout = float(getattr(trainer.strategy, "timeout", 1800.0))
    # Ctrl-C, and during fit the configured preemption signal (SIGTERM, or SIGUSR1/2, which SLURM's
    # `--signal` sends to every process of the job, this one included): the workers stop after a step.
    graceful = ["SIGINT"] + [s.name for s in trainer.preemption.signals if s != signal.SIGINT and stage == "fit"]
    remove_stale_launch_dirs()
    launch_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    with (
        tempfile.TemporaryDirectory(prefix=f"{LAUNCH_DIR_PREFIX}{os.getpid()}-") as log_dir,
        quiet_elastic(),
        reaped(launch_id),
    ):
        # The task travels in a file, not through the pipe that starts each worker: a worker that exits
        # while importing the user's script reads nothing, and a payload larger than the pipe's buffer
        # would block this process forever (the pipe's read end stays open here).
        payload = Path(log_dir, "payload.pkl")
        # Plain pickle bytes: multiprocessing's own pickler would put the parameters in shared memory, and
        # every rank's optimizer would then step the same tensors.
        payload.write_bytes(pickle.dumps((trainer, task, kwargs, capture_rng())))
        stop_file = str(Path(log_dir, "stop"))
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=f"syncline-{launch_id}",
            rdzv_backend=LOOPBACK_BACKEND,
            rdzv_endpoint="",
            rdzv_configs={"timeout": timeout},
            max_restarts=trainer.max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            # The graceful signals are handled by `stop_gracefully`: the workers stop at a step boundary.
            signals_to_handle=",".join(s for s in ("SIGTERM", "SIGHUP", "SIGQUIT") if s not in graceful),
            shutdown_timeout=_STOP_GRACE_S,
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        try:
            with stop_gracefully(graceful, stop_file):
                results = elastic_launch(config, _worker)(stage, str(payload), stop_file)
        except ChildFailedError as error:
            raise WorkerFailedError(_report(error, nprocs, stage)) from None
        except SignalException as error:
            # A second Ctrl-C or SIGTERM, or SIGHUP/SIGQUIT to this process: the agent stopped the workers.
            raise KeyboardInterrupt(f"{error}: the workers were stopped with {error.sigval.name}") from None
    outcome = results[0]
    trainer.apply_worker_result(task, outcome)
    if outcome.get("preempted"):
        raise TrainingPreempted(outcome["preempted"])
    return outcome["return"]


LAUNCH_DIR_PREFIX = "syncline-launch-"


def remove_stale_launch_dirs() -> None:
    """Remove the launch folders of callers that no longer run (killed with SIGKILL, they could not)."""
    for path in Path(tempfile.gettempdir()).glob(f"{LAUNCH_DIR_PREFIX}*-*"):
        pid = path.name[len(LAUNCH_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or not path.is_dir() or path.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)  # raises if no such process runs
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # it runs, under another user


@contextlib.contextmanager
def quiet_elastic() -> Iterator[None]:
    """Silence the elastic agent's logs (its own failure report spans dozens of lines) during a launch.

    Also puts back the environment variable in which the launch API passes the signals it handles.
    """
    loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
    levels = [logger.level for logger in loggers]
    signals = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if signals is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals


@contextlib.contextmanager
def reaped(launch_id: str) -> Iterator[None]:
    """Mark every process this launch starts with `launch_id`, and reap them all if this process dies.

    The workers inherit the mark (``SYNCLINE_LAUNCH=<this pid>-<id>``) from the moment they are spawned,
    so each knows its launcher before its first import, and `launch_reaper` finds every one of them,
    their own children included, even while they import.
    """
    previous = os.environ.get(worker_guard.LAUNCH_ENV)
    os.environ[worker_guard.LAUNCH_ENV] = launch_id
    reaper = None
    with contextlib.suppress(OSError):  # no reaper (no /proc, no fork): the workers' own guard remains
        if Path("/proc/self/environ").is_file():
            reaper = launch_reaper.start(os.getpid(), launch_id, worker_guard.grace_s())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(worker_guard.LAUNCH_ENV, None)
        else:
            os.environ[worker_guard.LAUNCH_ENV] = previous
        if reaper is not None:
            with contextlib.suppress(OSError, ValueError):
                reaper.stdin.write(launch_reaper.GOODBYE)  # type: ignore[union-attr]
                reaper.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(Exception):
                reaper.wait(5)


@contextlib.contextmanager
def stop_gracefully(names: list[str], stop_file: str) -> Iterator[None]:
    """Make a first SIGINT or preemption signal to this process stop the workers at a step boundary; a second aborts.

    The first writes the stop file every worker checks at the end of each optimizer step, so the ranks
    save ``last.ckpt`` and stop together, and `launch` raises `TrainingPreempted` (exit status 75), as for
    a signal sent to a worker. Ctrl-C in a terminal also signals the workers themselves; they take it the
    same way. A second signal at least half a second later makes the agent kill the workers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[float] = []

    def on_signal(signum: int, frame: Any) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if pressed and now - pressed[0] >= 0.5:
            raise SignalException(f"second {name}", signal.SIGKILL)
        if not pressed:
            pressed.append(now)
            worker_guard.request_stop(stop_file, signum)
            what = "Ctrl-C" if signum == signal.SIGINT else name
            print(f"{what}: stopping at the next step and saving a checkpoint; {what} again aborts.", file=sys.stderr)

    signums = [signal.Signals[name] for name in names]
    previous = {signum: signal.signal(signum, on_signal) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _report(error: ChildFailedError, nprocs: int, stage: str) -> str:
    """Return one message for the failure that came first: its rank, its exception and its traceback.

    The agent lists the workers it saw fail at one check; a rank whose exception caused the others'
    errors may still have been finishing then. Every rank's error file of this attempt is read, and
    the earliest failure wins (a death by a signal first: it leaves no file and no time of its own).
    """
    candidates: dict[int, tuple[tuple[int, float], str]] = {}
    for rank, failure in error.failures.items():
        candidates[rank] = (_failure_order(failure.exitcode, failure.message, failure.timestamp), _describe(failure))
    attempt_dir = next((Path(f.error_file).parent.parent for f in error.failures.values() if f.error_file), None)
    for rank in range(nprocs):
        path = attempt_dir / str(rank) / "error.json" if attempt_dir is not None else None
        if rank in candidates or path is None or not path.is_file():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            message = json.loads(path.read_text())["message"]
            candidates[rank] = (_failure_order(1, message, 0), _describe_message(message))
    rank = min(candidates, key=lambda r: candidates[r][0])
    blamed = _blamed_ranks(error.failures[rank].message if rank in error.failures else None, attempt_dir, rank)
    who = f"rank {rank}" if not blamed else f"rank{'s' if len(blamed) > 1 else ''} {', '.join(map(str, blamed))}"
    return f"Worker {who} of {nprocs} failed during {stage}: {candidates[rank][1]}"


def _blamed_ranks(message: Any, attempt_dir: Path | None, rank: int) -> list[int]:
    """The ranks an error raised alike on every rank names as its cause (a NaN loss's), from its error file."""
    if not isinstance(message, dict) and attempt_dir is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            message = json.loads((attempt_dir / str(rank) / "error.json").read_text())["message"]
    if isinstance(message, dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return [int(r) for r in message["extraInfo"]["syncline_ranks"]]
    return []


def _failure_order(exitcode: int, message: Any, timestamp: float) -> tuple[int, float]:
    """Sort key: deaths by a signal first (the others' errors follow from them), then by time of failure."""
    killed = exitcode < 0 and exitcode != -signal.SIGTERM
    at = float(message.get("extraInfo", {}).get("syncline_time", timestamp)) if isinstance(message, dict) else timestamp
    return (0 if killed else 1, at)


def _describe_message(message: dict[str, Any]) -> str:
    """Describe an exception recorded in an error file: its type and traceback (which ends with it)."""
    name = str(message["message"]).split(":", 1)[0]
    return f"{name} in this traceback:\n{message['extraInfo']['py_callstack'].rstrip()}"


def _describe(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict) and "py_callstack" in message.get("extraInfo", {}):
        return _describe_message(message)
    code = failure.exitcode
    if code == _UNGUARDED_EXIT:
        main = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
        return (
            f"it stopped while importing {main}, which starts training when it is imported. Each worker "
            "imports the script that launched it (to find your Task class); put the code that builds the "
            'Trainer and calls fit under `if __name__ == "__main__":`.'
        )
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (SIGKILL is often the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"the process was killed by {name}{hint}."
    return f"the process exited with status {code} before reporting an error."


def _record_failure(error: BaseException) -> None:
    """Write `error` to the error file the agent reads, in elastic's format, with a precise time."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(now)),
                # Finer than elastic's seconds: which rank failed first, when the others followed it.
                "syncline_time": repr(now),
                # An error every rank raises alike (a NaN loss) names the ranks that caused it.
                "syncline_ranks": [int(r) for r in getattr(error, "ranks", ())],
            },
        }
    }
    with contextlib.suppress(OSError), open(path, "w") as file:
        json.dump(data, file)


def _loopback_interface() -> str | None:
    """Return the name of the loopback network interface ("lo" on Linux), or None if none is found."""
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name in ("lo", "lo0"):
                return name
    return None


def use_loopback_for_gloo() -> None:
    """Keep gloo's connections between the ranks on loopback, unless the environment names an interface."""
    loopback = _loopback_interface()
    if loopback is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def _worker(stage: str, payload: str, stop_file: str) -> dict[str, Any] | None:
    """Entry point of one launched process: run the stage; return rank 0's result, record this rank's error."""
    from syncline.rng import restore_rng
    from syncline.trainer.preemption import TrainingPreempted

    use_loopback_for_gloo()
    # End with the launching process (whose pid came with the environment this process started with:
    # if it died while this one imported, the current parent is init), and take a teardown's SIGTERM for
    # what it is.
    launcher = worker_guard.launcher_pid()
    if not worker_guard.start(stop_file, parent=launcher):
        print(
            f"syncline: rank {os.environ.get('RANK', '?')}: the process that launched this worker (pid {launcher}) "
            "ended before training began; ending.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    preempted = None
    try:
        trainer, task, kwargs, rng = pickle.loads(Path(payload).read_bytes())
        if "OMP_NUM_THREADS" not in os.environ:
            # Share the cores instead of every rank starting one thread per core.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
        # Every rank starts from the caller's random stream, as a single process would have.
        restore_rng(rng)
        try:
            returned = getattr(trainer, stage)(task, **kwargs)
        except TrainingPreempted as stop:
            # A clean stop, not a failure: the agent must not restart the group for it.
            returned, preempted = None, str(stop)
    except BaseException as error:
        _record_failure(error)
        # Exit without running the interpreter's exit hooks: they would wait for the other ranks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    worker_guard.stage_finished()
    if int(os.environ["RANK"]) != 0:
        return None
    return {**trainer.worker_result(task, returned), "preempted": preempted}
