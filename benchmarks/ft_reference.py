"""torchft's fault-tolerant DDP as the reference row of `python -m benchmarks live-recovery`.

torchft (PyTorch's per-step fault tolerance library, `pip install 'syncline[ft]'`) keeps replicas training
through a death as syncline's ``recovery="live"`` does: a lighthouse forms a quorum before every step, a step
whose all-reduce failed is not committed, and a replacement heals from a peer's memory. This runs it on the
live-recovery benchmark's workload: the same MLP and batches of 4, every step sleeping ``step_s``, replica 1
SIGKILLing itself once at step ``kill_at``, and one replacement started when the launcher sees it die (as
``max_restarts=1`` does). Each replica is a process of its own (a replica group of one) running torchft's
`Manager`, `ProcessGroupGloo` and `DistributedDataParallel` on 127.0.0.1; the lighthouse runs in the launching
process, with torchft's defaults except where an option says.

One difference in what a run trains: torchft counts committed steps, and each replica reads its own fixed shard,
so the batches the dead replica would have read while it was gone are not trained; syncline's live recovery
re-shards the rest of the epoch over the survivors, which then take more steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from syncline.lab.ft_diloco import missing

from . import MODULE
from .common import CHECKOUT_ENV

__all__ = ["fit", "missing"]


def fit(
    devices: int, batches: int, step_s: float, kill_at: int, heartbeat_timeout_ms: int = 5000, timeout: float = 300.0
) -> dict[str, Any]:
    """Train `batches` committed steps on `devices` torchft replicas; replica 1 dies at step `kill_at` (-1: never).

    Returns the wall seconds from the first replica's start to the last one's exit, the seconds from the first
    committed step to the last, the seconds the replacement took from its start to its first committed step, and
    whether every replica ended with the same weights.
    """
    from torchft.coordination import LighthouseServer

    # The survivors may go on without the dead replica; a new one joins at the next quorum.
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=max(devices - 1, 1), heartbeat_timeout_ms=heartbeat_timeout_ms
    )
    processes: dict[int, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="syncline-bench-ft-") as root:
        spec = {"lighthouse": lighthouse.address(), "batches": batches, "devices": devices, "step_s": step_s}
        spec.update(kill_at=kill_at, root=root)

        def start(replica: int, replacement: bool = False) -> subprocess.Popen:
            mine = json.dumps({**spec, "replica": replica, "replacement": replacement})
            argv = [sys.executable, "-m", f"{MODULE}.ft_reference", mine]
            with open(Path(root, f"replica{replica}.log"), "a") as log:  # the child keeps its own descriptor
                env = {**os.environ, **CHECKOUT_ENV}  # `benchmarks` is found from the checkout, not installed
                return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

        try:
            started = time.perf_counter()
            processes = {replica: start(replica) for replica in range(devices)}
            replaced_at = None
            while processes:
                for replica, process in list(processes.items()):
                    code = process.poll()
                    if code is None:
                        continue
                    del processes[replica]
                    if code == -signal.SIGKILL and replaced_at is None:  # the planned death: one replacement
                        replaced_at = time.time()
                        processes[replica] = start(replica, replacement=True)
                    elif code != 0:
                        tail = Path(root, f"replica{replica}.log").read_text()[-2000:]
                        raise RuntimeError(f"torchft replica {replica} exited with {code}:\n{tail}")
                if replaced_at and list(processes) == [1] and not Path(root, "joined").exists():
                    # The survivors trained every step before the replacement joined: it has nothing left to do.
                    late = processes.pop(1)
                    late.kill()
                    late.wait()
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"torchft fit still running after {timeout:.0f} s (logs in {root})")
                time.sleep(0.01)
            wall = time.perf_counter() - started
            records = [json.loads(p.read_text()) for p in sorted(Path(root).glob("replica*.json"))]
        finally:
            for process in processes.values():
                process.kill()
                process.wait()
            lighthouse.shutdown()
    replacement = [r["first_commit_at"] - replaced_at for r in records if r["replacement"]]  # none: never joined
    first = min(r["first_commit_at"] for r in records if not r["replacement"])
    return {
        "wall_s": wall,
        # From the first committed step to the last: the training alone, without the imports and exits around it.
        "train_s": max(r["last_commit_at"] for r in records) - first,
        "replacement_start_to_train_s": replacement[0] if replacement else None,
        "replicas_agree": all(r["weights"] == records[0]["weights"] for r in records),
    }


def _replica(spec: dict[str, Any]) -> None:
    """One replica group of one process: train until torchft has committed `batches` steps."""
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every replica starts from the same weights, as the live-recovery task's do
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

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own store
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=max(devices - 1, 1),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=f"replica{replica}",
        hostname="127.0.0.1",
        timeout=timedelta(seconds=30),
    )
    model = DistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, inner)
    marker = Path(spec["root"], "killed")
    first_commit_at = last_commit_at = None
    while manager.current_step() < spec["batches"]:
        step = manager.current_step()
        if replica == 1 and step == spec["kill_at"] and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        rows = slice((step * devices + replica) * 4, (step * devices + replica + 1) * 4)
        optimizer.zero_grad()  # starts the step's quorum
        time.sleep(spec["step_s"])
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()  # commits only if every replica's all-reduce succeeded
        if manager.current_step() > step:
            last_commit_at = time.time()
            if first_commit_at is None and spec["replacement"]:
                Path(spec["root"], "joined").touch()
            first_commit_at = first_commit_at or last_commit_at
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    record = {
        "replacement": spec["replacement"],
        "first_commit_at": first_commit_at,
        "last_commit_at": last_commit_at,
        "weights": weights.tolist(),
    }
    Path(spec["root"], f"replica{replica}-{os.getpid()}.json").write_text(json.dumps(record))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    _replica(json.loads(sys.argv[1]))
