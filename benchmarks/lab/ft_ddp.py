"""torchft's fault-tolerant DDP on the live-recovery workload: one replica, and the lighthouse it joins.

The reference rows of `python -m benchmarks live-recovery` (one machine, `benchmarks/ft_reference.py`) and of
`python -m syncline.lab live-recovery --modes torchft` (lab nodes) both run this: each replica is a torchft replica
group of one process (its own TCPStore, a `Manager`, `ProcessGroupGloo`, torchft's `DistributedDataParallel` and
`Optimizer`) training the workload of syncline's live-recovery rows: the same MLP and batches of 4, every step
sleeping ``step_s``, replica 1 SIGKILLing itself once at committed step ``kill_at``. A lighthouse forms a quorum
before every step; a step whose all-reduce failed is not committed; a replacement heals from a peer's memory.

torchft's defaults throughout, except the timeouts, set as syncline's live recovery would notice a dead member:
the lighthouse's heartbeat timeout (torchft's default, 5 s, named here), gloo's collective timeout 5 s and the
Manager's 30 s. The survivors may go on without the dead replica (``min_replicas`` one fewer than the replicas).

torchft trains a fixed number of committed steps, each replica reading its own shard, so the batches the dead
replica would have read while it was gone are not trained; syncline's live recovery re-shards the rest of the
epoch over the survivors, which then take more steps. Runs only where torchft imports (`ft_diloco.missing`).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["HEARTBEAT_TIMEOUT_MS", "lighthouse", "train_replica"]

#: How long the lighthouse counts a silent replica as alive (torchft's default).
HEARTBEAT_TIMEOUT_MS = 5000
#: gloo's collective timeout, and the Manager's for its RPCs and the checkpoint a replacement heals from.
COLLECTIVE_TIMEOUT = timedelta(seconds=5)
MANAGER_TIMEOUT = timedelta(seconds=30)


def lighthouse(bind: str, replicas: int, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS) -> Any:
    """Start torchft's lighthouse on `bind` (``host:port``) for `replicas` replicas, which may go on one short."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=max(replicas - 1, 1), heartbeat_timeout_ms=heartbeat_timeout_ms)


def train_replica(
    spec: dict[str, Any],
    host: str,
    lighthouse_address: str,
    on_step: Callable[[int, int], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Train replica ``spec["replica"]`` of ``spec["devices"]`` until torchft has committed ``spec["batches"]`` steps.

    `spec` also holds ``step_s``, ``kill_at`` (-1: never), ``replacement`` (whether this process replaces a dead one)
    and ``root``, a folder every replica shares: ``killed`` (the death's time) and ``joined`` (the replacement
    committed a step) are written there. `host` is the address this replica's store, Manager and checkpoint server
    are reached at. `on_ready()`, if given, is called once the Manager is up (the lighthouse sees it) and before
    the first quorum; `on_step(step, participants)` at each step once its quorum has formed.

    Returns when the first and last steps were committed (seconds since the epoch) and the final weights.
    """
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every replica starts from the same weights, as syncline's replicas do
    replica, devices = spec["replica"], spec["devices"]
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    inner = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(spec["batches"] * devices * 4, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's own store
    manager = Manager(
        pg=ProcessGroupGloo(timeout=COLLECTIVE_TIMEOUT),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=max(devices - 1, 1),
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=lighthouse_address,
        replica_id=f"replica{replica}",
        hostname=host,
        timeout=MANAGER_TIMEOUT,
        checkpoint_transport=_transport(host),
    )
    if on_ready is not None:
        on_ready()
    model = DistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, inner)
    marker = Path(spec["root"], "killed")
    first_commit_at = last_commit_at = None
    while manager.current_step() < spec["batches"]:
        step = manager.current_step()
        if replica == 1 and step == spec["kill_at"] and not marker.exists():
            marker.write_text(f"{time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()  # starts the step's quorum
        if on_step is not None:
            participants = manager.num_participants()  # waits for the quorum (a replacement heals in it)
            step = manager.current_step()
            on_step(step, participants)
        rows = slice((step * devices + replica) * 4, (step * devices + replica + 1) * 4)
        time.sleep(spec["step_s"])
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()  # commits only if every replica's all-reduce succeeded
        if manager.current_step() > step:
            last_commit_at = time.time()
            if first_commit_at is None and spec["replacement"]:
                Path(spec["root"], "joined").touch()
            first_commit_at = first_commit_at or last_commit_at
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    manager.shutdown(wait=False)
    return {"first_commit_at": first_commit_at, "last_commit_at": last_commit_at, "weights": weights.tolist()}


def _transport(host: str) -> Any:
    """torchft's default checkpoint transport (HTTP, what a replacement heals from), reached at `host`.

    Its server names itself by the machine's hostname, which every lab node shares; a peer must reach this node.
    """
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return super().address().replace(f"//{socket.gethostname()}:", f"//{host}:", 1)

    return Transport(timeout=MANAGER_TIMEOUT, num_chunks=0)
