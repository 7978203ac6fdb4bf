"""The training loop and what it needs: Trainer, Task, state, Hydra config and CLI."""

from trainer.task import Task
from trainer.trainer import Trainer

__all__ = ["Task", "Trainer"]
