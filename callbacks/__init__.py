"""Everything that observes training: checkpoints, early stopping, progress, loggers."""

from syncline.callbacks.callback import Callback, CallbackDispatcher
from syncline.callbacks.csv_logger import CSVLogger
from syncline.callbacks.early_stopping import EarlyStopping, EarlyStoppingReason
from syncline.callbacks.equivalence import EquivalenceCheck, EquivalenceError
from syncline.callbacks.logger import Logger
from syncline.callbacks.lr_monitor import LearningRateMonitor
from syncline.callbacks.model_checkpoint import ModelCheckpoint
from syncline.callbacks.model_summary import ModelSummary
from syncline.callbacks.prediction_writer import BasePredictionWriter
from syncline.callbacks.progress import ProgressBar
from syncline.callbacks.tensorboard import TensorBoardLogger
from syncline.callbacks.timeline import CommunicationTimeline
from syncline.callbacks.timer import Timer
from syncline.callbacks.versioned_logger import VersionedLogger

__all__ = [
    "BasePredictionWriter",
    "CSVLogger",
    "Callback",
    "CallbackDispatcher",
    "CommunicationTimeline",
    "EarlyStopping",
    "EarlyStoppingReason",
    "EquivalenceCheck",
    "EquivalenceError",
    "LearningRateMonitor",
    "Logger",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "TensorBoardLogger",
    "Timer",
    "VersionedLogger",
]
