"""The training loop and what it needs: Trainer, Task, state, Hydra config and CLI."""

from syncline.trainer.datamodule import DataModule
from syncline.trainer.task import Task
from syncline.trainer.trainer import Trainer

__all__ = ["DataModule", "Task", "Trainer"]
