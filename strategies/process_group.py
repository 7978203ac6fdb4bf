"""Join and leave the default process group the way launchers (torchrun, SLURM wrappers) describe it.

A launcher starts one process per device and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in each. `init_process_group_from_env` reads them, picks the backend (gloo on CPU, NCCL on
CUDA) and joins the group with a timeout, so that a rank that never arrives fails the job instead of
hanging it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "DistributedEnv",
    "default_backend",
    "destroy_process_group",
    "device_for_local_rank",
    "init_process_group_from_env",
]

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> DistributedEnv:
        """Read the launcher's environment variables.

        Raises:
            RuntimeError: a required variable is missing.
        """
        missing = [name for name in _REQUIRED if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"Cannot join the process group: environment variable(s) {', '.join(missing)} are not set. "
                "Start the job with a launcher such as `torchrun --nproc-per-node=N`."
            )
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
        )


def default_backend() -> str:
    """Return "nccl" when CUDA is available, else "gloo"."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for_local_rank(local_rank: int, backend: str) -> torch.device:
    """Return the device a process with `local_rank` computes on: its GPU, unless the backend is gloo."""
    if torch.cuda.is_available() and backend != "gloo":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group_from_env(backend: str | None = None, timeout: float = 1800.0) -> bool:
    """Join the default process group described by the environment, unless already joined.

    Args:
        backend: "gloo", "nccl", ...; None picks `default_backend()`.
        timeout: seconds a collective (and the rendezvous) may take before it fails.

    Returns:
        True when this call created the group (and so its caller should destroy it).
    """
    if dist.is_initialized():
        return False
    env = DistributedEnv.from_environ()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    # Collective: rendezvous of all ranks at MASTER_ADDR:MASTER_PORT.
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout),
    )
    return True


def destroy_process_group() -> None:
    """Leave the default process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()
