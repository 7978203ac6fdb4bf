"""Everything that touches process groups and gradient synchronization."""

from syncline.strategies.bucketed_ddp import BucketedDDP
from syncline.strategies.bytegrad import ByteGrad
from syncline.strategies.native_ddp import NativeDDP
from syncline.strategies.powersgd import PowerSGD
from syncline.strategies.qadam import QAdam
from syncline.strategies.registry import STRATEGIES, register_strategy, resolve_strategy
from syncline.strategies.single_device import SingleDevice
from syncline.strategies.strategy import Strategy

__all__ = [
    "STRATEGIES",
    "BucketedDDP",
    "ByteGrad",
    "NativeDDP",
    "PowerSGD",
    "QAdam",
    "SingleDevice",
    "Strategy",
    "register_strategy",
    "resolve_strategy",
]
