"""Start `devices` local worker processes, bring rank 0's result back, and report a failure in a few lines.

`Trainer(devices=N)` outside `torchrun` calls `launch`. The trainer and the task are pickled into N
processes started with multiprocessing's "spawn" (each imports the script that started it, to find the
task's class). The launching process hosts the rendezvous store on a socket bound to 127.0.0.1, so a
run on one machine listens on loopback only: torch's stores accept no authentication. Each worker sets
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and joins the group as a client of that
store. Rank 0 sends back the trained weights, the progress, the metrics and the callbacks' state,
which are loaded into the caller's objects, so that after `fit` returns the caller holds what rank 0
trained, as with a single process.

A worker that raises sends its exception and traceback here; the first failure stops the others and is
raised once, as a `WorkerFailedError` naming the rank. Under `torchrun` nothing is launched: the
environment already describes the process group.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["STORE_HOSTED_ENV", "WorkerFailedError", "free_port", "launch", "launched_by_torchrun"]

#: Set in launched workers: the launching process hosts the store at MASTER_ADDR:MASTER_PORT, so every
#: rank (rank 0 included) joins it as a client.
STORE_HOSTED_ENV = "SYNCLINE_STORE_HOSTED"
#: Exit status of a worker that found the launch being re-entered while it imported the user's script.
_UNGUARDED_EXIT = 87
#: Seconds the other workers get to stop after one failed, before they are killed.
_STOP_GRACE_S = 5.0


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
        WorkerFailedError: a worker raised or died; names the rank, its error and its traceback.
    """
    import torch.distributed as dist

    from syncline.trainer.state import capture_rng

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # We are a worker importing the user's script, and the script launches workers at import time
        # (no `if __name__ == "__main__":`). Stop quietly; the launching process explains.
        sys.exit(_UNGUARDED_EXIT)
    nprocs = trainer.devices
    # Plain pickle bytes: multiprocessing's own pickler would put the parameters in shared memory, and
    # every rank's optimizer would then step the same tensors.
    payload = pickle.dumps((trainer, task, kwargs, capture_rng()))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # loopback only: nothing off this machine can reach the store
    listener.listen(nprocs * 4)
    port = listener.getsockname()[1]
    timeout = timedelta(seconds=float(getattr(trainer.strategy, "timeout", 1800.0)))
    # The store takes over the pre-bound socket, so no other interface is opened and no port race exists.
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    context = multiprocessing.get_context("spawn")
    messages = context.SimpleQueue()
    workers = [
        context.Process(target=_worker, args=(rank, nprocs, port, stage, payload, messages), name=f"rank{rank}")
        for rank in range(nprocs)
    ]
    try:
        for worker in workers:
            worker.start()
        result = _supervise(workers, messages, stage)
    finally:
        _stop(workers)
        del store  # closes the socket it was handed
    trainer.apply_worker_result(task, result)
    return result["return"]


def _supervise(workers: list[Any], messages: Any, stage: str) -> dict[str, Any]:
    """Wait for every worker; return rank 0's result, or raise the first failure once the others stopped."""
    nprocs = len(workers)
    result: dict[str, Any] | None = None
    errors: list[tuple[int, str]] = []
    running = {worker.sentinel: rank for rank, worker in enumerate(workers)}
    while running:
        ready = wait([messages._reader, *running])
        # Messages first: a worker writes its error before it exits.
        while not messages.empty():
            kind, rank, body = messages.get()
            if kind == "result":
                result = pickle.loads(body)
            else:
                errors.append((rank, body))
        for sentinel in ready:
            if sentinel in running:
                rank = running.pop(sentinel)
                workers[rank].join()  # reaped: its exit status is known from here on
                code = workers[rank].exitcode
                if code != 0 and not any(r == rank for r, _ in errors):
                    errors.append((rank, _describe_exit(code)))
        if errors:
            break
    if errors:
        _stop(workers)
        rank, report = errors[0]
        raise WorkerFailedError(f"Worker rank {rank} of {nprocs} failed during {stage}: {report}")
    if result is None:
        raise WorkerFailedError(f"Rank 0 of {nprocs} exited without sending its result during {stage}.")
    return result


def _describe_exit(code: int | None) -> str:
    if code == _UNGUARDED_EXIT:
        main = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
        return (
            f"it stopped while importing {main}, which starts training when it is imported. Each worker "
            "imports the script that launched it (to find your Task class); put the code that builds the "
            'Trainer and calls fit under `if __name__ == "__main__":`.'
        )
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = " (SIGKILL is often the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"the process was killed by {name}{hint}."
    return f"the process exited with status {code} before reporting an error."


def _stop(workers: list[Any]) -> None:
    """Stop the workers still running: SIGTERM, then SIGKILL after a grace period."""
    alive = [w for w in workers if w.is_alive()]
    for worker in alive:
        worker.terminate()
    for worker in alive:
        worker.join(_STOP_GRACE_S)
        if worker.is_alive():
            worker.kill()
            worker.join()


def _loopback_interface() -> str | None:
    """Return the name of the loopback network interface ("lo" on Linux), or None if none is found."""
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name in ("lo", "lo0"):
                return name
    return None


def _worker(rank: int, world_size: int, port: int, stage: str, payload: bytes, messages: Any) -> None:
    """Entry point of one launched process: run the stage, send rank 0's result or this rank's error."""
    from syncline.trainer.state import restore_rng

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            STORE_HOSTED_ENV: "1",
        }
    )
    loopback = _loopback_interface()
    if loopback is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo's connections between the ranks listen on this interface: keep them on loopback too.
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        trainer, task, kwargs, rng = pickle.loads(payload)
        if "OMP_NUM_THREADS" not in os.environ:
            # Share the cores instead of every rank starting one thread per core.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        # Every rank starts from the caller's random stream, as a single process would have.
        restore_rng(rng)
        returned = getattr(trainer, stage)(task, **kwargs)
        if rank == 0:
            messages.put(("result", rank, pickle.dumps(trainer.worker_result(task, returned))))
    except BaseException as error:
        # The traceback ends with the exception itself: the launcher shows it once, under the rank.
        report = f"{type(error).__name__} in this traceback:\n{traceback.format_exc()}"
        with contextlib.suppress(Exception):
            messages.put(("error", rank, report.rstrip()))
        sys.exit(1)
