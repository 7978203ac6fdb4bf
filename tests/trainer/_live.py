"""A task for live-recovery tests: it logs every sample it trains on, and one replica dies at one step.

`LiveProbe` appends, per optimizer step, a line ``epoch step world_size idx,idx,... steps digest`` to
``<log_dir>/<pid>.log`` (`steps`: the strategy's optimizer steps, -1 where it counts none; `digest`: of the
weights the step starts from);
at the end of training each process writes ``<pid>.end`` with its step, a digest of its weights and one of the
strategy's outer state (DiLoCo's global copies, outer momentum and step count; "-" for other strategies), and a
replacement writes ``<pid>.healed``: 1 if its first step starts from DiLoCo's global copies θ̃; ``<pid>.times`` has a
line ``step unix_time`` per step, and ``<pid>.killed`` the time of the kill. The
process holding rank `victim` at step `at_step` kills itself with SIGKILL, once; with `second`, twice (the
member that holds rank `victim` when the healed group retries that step dies too); with ``fault="raise"`` it
raises instead, with ``fault="stop"`` it stops itself (SIGSTOP: ``<pid>.stopped`` has the time) and rank 0 kills
it at the end of training. With `preempt_at`, rank 0 sends SIGTERM to process `caller` (the launching script)
once, at that step; with ``replaced=False`` the survivors do not wait for a replacement.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncline.trainer import Task


def _digest(tensors) -> str:
    return hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors)).hexdigest()


def _flat_globals(state: dict):
    """DiLoCo's global copies θ̃ in parameter order (one dtype: the fragments are consecutive ranges), or None."""
    if "globals" not in state:
        return None
    return torch.cat([glob.cpu() for fragment in state["globals"] for glob in fragment])


def indexed_data(n: int = 96, features: int = 8) -> TensorDataset:
    """A fixed regression set whose third column is each sample's index."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(n))


class LiveProbe(Task):
    """A small MLP that logs the samples of every step and can die at one step."""

    def __init__(
        self,
        log_dir: str,
        victim: int = 1,
        at_step: int = -1,
        step_s: float = 0.0,
        second: bool = False,
        fault: str = "kill",
        preempt_at: int = -1,
        caller: int = 0,
        replaced: bool = True,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.log_dir, self.victim, self.at_step, self.step_s = log_dir, victim, at_step, step_s
        self.second, self.fault = second, fault
        self.preempt_at, self.caller, self.replaced = preempt_at, caller, replaced

    def train_dataloader(self):
        return DataLoader(indexed_data(), batch_size=4, shuffle=True)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        kills = len(list(Path(self.log_dir).glob("*.killed")))
        due = self.global_rank == self.victim and self.trainer.global_step == self.at_step
        if due and self.fault == "raise":
            raise ValueError(f"boom on rank {self.victim}")
        if due and self.fault == "stop" and not list(Path(self.log_dir).glob("*.stopped")):
            # Frozen with its connections open, as a node cut off: no collective of the others fails.
            Path(self.log_dir, f"{os.getpid()}.stopped").write_text(f"{time.time():.3f}")
            os.kill(os.getpid(), signal.SIGSTOP)
        if due and self.fault == "kill" and kills < (2 if self.second else 1):
            Path(self.log_dir, f"{os.getpid()}.killed").write_text(f"{time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)
        signalled = Path(self.log_dir, "preempted")
        if self.global_rank == 0 and self.trainer.global_step == self.preempt_at and not signalled.exists():
            signalled.touch()
            os.kill(self.caller, signal.SIGTERM)
        if self.replacement and not Path(self.log_dir, f"{os.getpid()}.healed").exists():
            healed = _flat_globals(self.trainer.strategy.state_dict())
            if healed is not None:
                same = torch.equal(healed, torch.cat([p.detach().flatten() for p in self.parameters()]))
                Path(self.log_dir, f"{os.getpid()}.healed").write_text(str(int(same)))
        if kills and self.trainer.world_size < 3 and self.replaced:
            # Short of a member: wait until the replacements have started (tens of seconds on a loaded
            # machine), then slow down, so that they come in before the run ends.
            deadline = time.monotonic() + 180
            while len(list(Path(self.log_dir).glob("*.replacement"))) < kills and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(self.step_s)
        trainer = self.trainer
        with open(Path(self.log_dir, f"{os.getpid()}.log"), "a") as file:
            ids = ",".join(str(int(i)) for i in idx)
            inner = getattr(trainer.strategy, "steps", -1)
            where = f"{trainer.current_epoch} {trainer.global_step} {trainer.world_size}"
            file.write(f"{where} {ids} {inner} {_digest(self.parameters())[:16]}\n")
        with open(Path(self.log_dir, f"{os.getpid()}.times"), "a") as file:
            file.write(f"{trainer.global_step} {time.time():.3f}\n")
        return nn.functional.mse_loss(self.net(x), y)

    def setup(self, stage: str) -> None:
        self.replacement = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if self.replacement:
            Path(self.log_dir, f"{os.getpid()}.replacement").touch()

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            for frozen in Path(self.log_dir).glob("*.stopped"):
                os.kill(int(frozen.stem), signal.SIGKILL)  # the run is over: its agent may take it for a death
        digest = _digest(self.parameters())
        state = self.trainer.strategy.state_dict()
        outer = "-"
        if "globals" in state:
            momenta = [s["momentum_buffer"] for o in state["outer"] for s in o["state"].values()]
            outer = f"{state['steps']}:{_digest([_flat_globals(state), *momenta])}"
        Path(self.log_dir, f"{os.getpid()}.end").write_text(f"{self.trainer.global_step} {digest} {outer}")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
