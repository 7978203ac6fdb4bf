"""Start `devices` local worker processes with torch's elastic launch API and bring rank 0's result back.

`Trainer(devices=N)` outside `torchrun` calls `launch`. The trainer and the task are pickled into N
processes started by torch's elastic agent (which also sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT and stops every worker if one fails). Each worker runs the stage; rank 0 sends back the
trained weights, the progress, the metrics and the callbacks' state, which are loaded into the caller's
objects, so that after `fit` returns the caller holds what rank 0 trained, as with a single process.

Under `torchrun` nothing is launched: the environment already describes the process group.
"""

from __future__ import annotations

import os
import pickle
import socket
import uuid
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

if TYPE_CHECKING:
    from syncline.trainer.task import Task
    from syncline.trainer.trainer import Trainer

__all__ = ["WorkerFailedError", "free_port", "launch", "launched_by_torchrun"]


class WorkerFailedError(RuntimeError):
    """A worker process failed; the message carries its rank and the error it raised."""


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
        WorkerFailedError: a worker raised or died; names the rank and the error.
    """
    from syncline.trainer.state import capture_rng

    nprocs = trainer.devices
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"syncline-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        # Plain pickle bytes: multiprocessing's own pickler would put the parameters in shared memory, and
        # every rank's optimizer would then step the same tensors.
        payload = pickle.dumps((trainer, task, kwargs, capture_rng()))
        results = elastic_launch(config, _worker)(stage, payload)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        raise WorkerFailedError(
            f"Worker rank {rank} of {nprocs} failed during {stage}: {str(message).strip() or error}"
        ) from None
    outcome = results[0]
    trainer.apply_worker_result(task, outcome)
    return outcome["return"]


@record
def _worker(stage: str, payload: bytes) -> dict | None:
    """Entry point of one launched process."""
    from syncline.trainer.state import restore_rng

    trainer, task, kwargs, rng = pickle.loads(payload)
    if "OMP_NUM_THREADS" not in os.environ:
        # Share the cores instead of every rank starting one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    # Every rank starts from the caller's random stream, as a single process would have.
    restore_rng(rng)
    returned = getattr(trainer, stage)(task, **kwargs)
    if int(os.environ["RANK"]) != 0:
        return None
    return trainer.worker_result(task, returned)
