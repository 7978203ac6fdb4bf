"""Everything that observes training: checkpoints, early stopping, progress, loggers."""

from callbacks.callback import Callback, CallbackDispatcher
from callbacks.checkpoint import ModelCheckpoint
from callbacks.csv_logger import CSVLogger
from callbacks.early_stopping import EarlyStopping
from callbacks.logger import Logger
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.progress import ProgressBar
from callbacks.tensorboard import TensorBoardLogger
from callbacks.versioned_logger import VersionedLogger

__all__ = [
    "CSVLogger",
    "Callback",
    "CallbackDispatcher",
    "EarlyStopping",
    "LearningRateMonitor",
    "Logger",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoardLogger",
    "VersionedLogger",
]
