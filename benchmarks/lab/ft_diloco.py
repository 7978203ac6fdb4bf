"""torchft's DiLoCo (`torchft.local_sgd.DiLoCo`) as a reference row of the lab's trade-off (`tradeoff.py`).

Inside a lab torchrun job, each node is a torchft replica group of one process: its own TCPStore, a `Manager` on
`ProcessGroupGloo` (synchronous quorum, as torchft's DiLoCo requires), the lighthouse in rank 0's process. It trains
the trade-off's CharGPT as syncline's ``diloco`` rows do: the task's AdamW and warm-up/cosine schedule as inner
optimizer, SGD with Nesterov momentum as outer optimizer (the paper's 0.7 and 0.9 unless the options say), an
exchange every ``period`` inner steps, the Trainer's shards of the training and validation data, and the validation
loss every ``val_every`` steps (each rank's own weights, averaged over the ranks, as the Trainer reports it).

torchft counts no bytes: a row's bytes per step are the fp32 pseudo-gradient (the parameters' bytes) per exchange,
which is what its all-reduce is handed. Runs only where torchft imports (`pip install 'syncline[ft]'`).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

__all__ = ["NAME", "missing", "own_address", "train_to_target"]

#: The name that marks a trade-off row as torchft's DiLoCo (not a registered syncline strategy).
NAME = "torchft_diloco"


def missing(rows: str = "torchft row") -> str | None:
    """Why torchft's `rows` cannot run in this interpreter (one line), or None where torchft imports."""
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        return f"{rows} skipped: torchft does not import here ({error}); pip install 'syncline[ft]'"
    return None


def own_address(master: str) -> str:
    """This node's address on the lab's network: the one its packets to the master leave from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, 1))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


def _lighthouse(world: int) -> tuple[Any, str]:
    """Start the lighthouse in rank 0's process; every rank gets its address (collective)."""
    import torch.distributed as dist

    server, address = None, [""]
    if dist.get_rank() == 0:
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=world)
        port = server.address().rsplit(":", 1)[1]
        address = [f"http://{os.environ['MASTER_ADDR']}:{port}"]
    dist.broadcast_object_list(address, src=0)
    return server, address[0]


def train_to_target(label: str, options: dict[str, Any], spec: dict[str, Any], global_batch: int) -> dict[str, Any]:
    """Train CharGPT with torchft's DiLoCo until the validation loss reaches ``spec["target"]`` (or ``max_steps``).

    Returns the trade-off's record for this row (rank 0's clock). Needs torchrun's environment.
    """
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from syncline.examples.char_gpt import CharGPT, _warmup_cosine
    from syncline.trainer.data import with_distributed_sampler, with_evaluation_sampler
    from syncline.trainer.seed import seed_everything

    from .cluster import StallGuard

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # for the lighthouse's address and the validation loss only
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(0)
    task = CharGPT(batch_size=global_batch // world, sample_chars=0)
    shard = {"num_replicas": world, "rank": rank}
    train = with_distributed_sampler(task.train_dataloader(), shard, seed=0)
    val = with_evaluation_sampler(task.val_dataloader(), shard)
    hparams = task.hparams
    decay = [p for p in task.parameters() if p.dim() >= 2]
    rest = [p for p in task.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": hparams["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
    inner = torch.optim.AdamW(groups, lr=hparams["lr"], betas=(0.9, 0.99))
    schedule = _warmup_cosine(hparams["warmup_steps"], spec["max_steps"], hparams["min_lr_ratio"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, schedule)
    momentum = options.get("outer_momentum", 0.9)
    outer = torch.optim.SGD(task.parameters(), lr=options.get("outer_lr", 0.7), momentum=momentum, nesterov=True)

    def state_dict() -> dict[str, Any]:
        return {"model": task.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        task.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    server, lighthouse = _lighthouse(world)
    host = own_address(os.environ["MASTER_ADDR"])
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's own
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(minutes=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=world,
        use_async_quorum=False,
        init_sync=False,  # every replica starts from the same seed
        timeout=timedelta(minutes=10),
        quorum_timeout=timedelta(hours=1),  # a quorum every `period` steps
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"node{rank}",
        hostname=host,
    )

    def validation_loss() -> float:
        task.eval()
        total, count = torch.zeros(2), 0
        with torch.no_grad():
            for inputs, targets in val:
                if count == spec["val_batches"]:
                    break
                total += torch.stack([task._loss(task(inputs), targets) * len(inputs), torch.tensor(len(inputs))])
                count += 1
        task.train()
        mean = total[0] / total[1]
        dist.all_reduce(mean)  # every rank's own weights' loss, averaged as the Trainer's sync_dist does
        return float(mean) / world

    guard = StallGuard(label)
    train_s_at_step: list[float] = []
    validations: list[list[float]] = []
    exchanges, validating, reached = 0, 0.0, None
    started = time.perf_counter()
    with DiLoCo(manager, [task], inner, outer, sync_every=options["period"]):
        for inputs, targets in train:
            inner.zero_grad()
            task._loss(task(inputs), targets).backward()
            inner.step()  # every `period`-th step also exchanges the pseudo-gradient and takes the outer step
            scheduler.step()
            guard.beat()
            step = len(train_s_at_step) + 1
            exchanges += step % options["period"] == 0
            train_s_at_step.append(time.perf_counter() - started - validating)
            if step % spec["val_every"] == 0:
                begun = time.perf_counter()
                loss = validation_loss()
                validations.append([step, round(loss, 4)])
                validating += time.perf_counter() - begun
                if loss <= spec["target"]:
                    reached = step
                    break
            if step == spec["max_steps"]:
                break
    guard.stop()
    manager.shutdown(wait=False)
    if server is not None:
        server.shutdown()
    steps = reached or len(train_s_at_step)
    parameter_bytes = sum(p.numel() * p.element_size() for p in task.parameters())
    return {
        "label": label,
        "strategy": NAME,
        "options": options,
        "reached": reached is not None,
        "steps": steps,
        "seconds": train_s_at_step[steps - 1],
        "step_s": round(train_s_at_step[steps - 1] / steps, 4),
        "validations": validations,
        "train_s_at_validation": [train_s_at_step[s - 1] for s, _ in validations],
        "comm_bytes_per_step": parameter_bytes * exchanges / len(train_s_at_step),
        "peak_comm_bytes_per_step": parameter_bytes if exchanges else 0,
    }
